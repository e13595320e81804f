//! corral-vmm: one KVM virtual machine (memory, boot, vCPU threads, devices,
//! lifecycle), and later the manager of many.

pub mod acpi;
pub mod boot;
pub mod cgroup;
pub mod cpuid;
pub mod cpusched;
mod devthread;
pub mod hostfile;
pub mod hostload;
mod images;
pub mod layout;
pub mod loader;
pub mod manager;
pub mod mptable;
pub mod seccomp;
pub mod vcpu;
pub mod vm;
mod vmthread;

pub use kvm_ioctls::Kvm;
pub use vm::{
    ExitReason, KernelSource, ThreadFault, VmConfig, VmError, VmHandle, host_memory_mib, max_vcpus,
    start, validate,
};
