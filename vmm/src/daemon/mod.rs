//! The daemon's model, along the seam of issue 15: what `corral serve`
//! runs to host many VMs, apart from the code of one VM.
//!
//! - [`manager`]: classes, admission, VM lifecycles, the state that
//!   survives the daemon, the VM processes it launches and re-adopts;
//! - [`cpusched`]: the `gate` CPU backend's scheduler thread;
//! - [`cgroup`]: the `cgroup` CPU backend;
//! - [`hostload`]: the host's CPU figures the scheduler plans with.
//!
//! The one-VM code (the crate's other modules: `vm`, `builder`, `vcpu`,
//! `devthread`, the VM process's side of `vmproc`) never refers to this
//! tree; the crate's `module_graph` test checks it.

pub mod cgroup;
pub mod cpusched;
pub mod hostload;
pub mod manager;
