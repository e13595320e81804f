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
pub mod boottrace;
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
pub mod iopage;
pub mod jail;
pub mod layout;
pub mod loader;
pub mod manager;
pub mod mptable;
pub mod seccomp;
mod shared;
mod util;
pub mod vcpu;
pub mod vm;
pub mod vmgate;
pub mod vmproc;
mod vmthread;

pub use builder::{start, start_with_kvm};
pub use handle::VmHandle;
pub use kvm_ioctls::Kvm;
pub use vm::{
    ExitReason, KernelSource, ThreadFault, VmConfig, VmError, host_memory_mib, max_vcpus, validate,
};

/// Issue 14: the modules of one VM do not import each other in a cycle
/// (`vm.rs` and `devthread.rs` did, through `Shared` and `Control`; `vcpu.rs`
/// and `vm.rs` too). Checks the `crate::` paths of their code lines.
#[cfg(test)]
mod module_graph {
    use std::collections::{BTreeMap, BTreeSet};

    const MODULES: [(&str, &str); 9] = [
        ("vm", include_str!("vm.rs")),
        ("builder", include_str!("builder.rs")),
        ("handle", include_str!("handle.rs")),
        ("shared", include_str!("shared.rs")),
        ("control", include_str!("control.rs")),
        ("vcpu", include_str!("vcpu.rs")),
        ("devthread", include_str!("devthread.rs")),
        ("vmthread", include_str!("vmthread.rs")),
        ("util", include_str!("util.rs")),
    ];

    fn deps(src: &str) -> BTreeSet<&'static str> {
        let mut d = BTreeSet::new();
        for line in src.lines().map(str::trim) {
            if line.starts_with("//") {
                continue;
            }
            for (name, _) in MODULES {
                if line.contains(&format!("crate::{name}::"))
                    || line.contains(&format!("crate::{name};"))
                    || line.contains(&format!("crate::{name}}}"))
                {
                    d.insert(name);
                }
            }
        }
        d
    }

    #[test]
    fn one_vm_modules_form_no_cycle() {
        let graph: BTreeMap<&str, BTreeSet<&str>> = MODULES
            .iter()
            .map(|(n, src)| (*n, deps(src).into_iter().filter(|d| d != n).collect()))
            .collect();
        assert!(graph["devthread"].contains("shared"), "{graph:?}");
        // Depth-first search for a back edge.
        fn visit<'a>(
            n: &'a str,
            g: &BTreeMap<&'a str, BTreeSet<&'a str>>,
            path: &mut Vec<&'a str>,
            done: &mut BTreeSet<&'a str>,
        ) {
            if done.contains(n) {
                return;
            }
            assert!(!path.contains(&n), "import cycle: {path:?} -> {n}");
            path.push(n);
            for d in &g[n] {
                visit(d, g, path, done);
            }
            path.pop();
            done.insert(n);
        }
        let mut done = BTreeSet::new();
        for n in graph.keys() {
            visit(n, &graph, &mut Vec::new(), &mut done);
        }
    }
}
