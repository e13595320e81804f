//! corral-vmm
