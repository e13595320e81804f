//! corral-devices
