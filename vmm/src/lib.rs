//! corral-vmm: KVM virtual machines and the manager of many.
//!
//! One VM is built by [`builder::start`] from a [`vm::VmConfig`] and runs as
//! one thread per vCPU ([`vcpu`]) plus a device thread (`devthread`) that
//! share a `shared::Shared`; the caller holds a [`handle::VmHandle`]. The
//! [`manager::Manager`] hosts many VMs: resource classes, admission, CPU
//! scheduling ([`cpusched`] or [`cgroup`]), disk throttle groups, the
//! host-path policy ([`hostfile`]) and VM lifecycles. Each VM thread runs
//! under a seccomp filter of its kind ([`seccomp`]).

pub mod acpi;
pub mod boot;
pub mod builder;
pub mod cgroup;
mod control;
pub mod cpuid;
pub mod cpusched;
mod defined;
mod devthread;
pub mod handle;
pub mod hostfile;
pub mod hostload;
mod images;
pub mod layout;
pub mod loader;
pub mod manager;
pub mod mptable;
pub mod seccomp;
mod shared;
mod util;
pub mod vcpu;
pub mod vm;
mod vmthread;

pub use builder::start;
pub use handle::VmHandle;
pub use kvm_ioctls::Kvm;
pub use vm::{
    ExitReason, KernelSource, ThreadFault, VmConfig, VmError, host_memory_mib, max_vcpus, validate,
};
