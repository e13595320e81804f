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
mod control;
pub mod cpuid;
pub mod daemon;
mod defined;
mod devthread;
pub mod handle;
pub mod hostfile;
mod images;
pub mod iopage;
pub mod jail;
pub mod layout;
pub mod loader;
pub mod mptable;
pub mod seccomp;
mod shared;
pub mod threadclock;
mod util;
pub mod vcpu;
pub mod vm;
pub mod vmgate;
pub mod vmproc;
mod vmthread;

pub use builder::{start, start_with_kvm};
pub use daemon::{cgroup, cpusched, hostload, manager};
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
    /// Issue 15: the one-VM code never refers to the daemon's model
    /// (`daemon::{manager, cpusched, cgroup, hostload}`), by its path or by
    /// the crate root's re-exports, so a VM process carries none of it.
    #[test]
    fn one_vm_code_never_refers_to_the_daemon() {
        let more: [(&str, &str); 16] = [
            ("vmproc/server/mod.rs", include_str!("vmproc/server/mod.rs")),
            (
                "vmproc/server/config.rs",
                include_str!("vmproc/server/config.rs"),
            ),
            (
                "vmproc/server/requests.rs",
                include_str!("vmproc/server/requests.rs"),
            ),
            (
                "vmproc/server/connection.rs",
                include_str!("vmproc/server/connection.rs"),
            ),
            (
                "vmproc/server/console.rs",
                include_str!("vmproc/server/console.rs"),
            ),
            (
                "vmproc/server/status.rs",
                include_str!("vmproc/server/status.rs"),
            ),
            (
                "vmproc/server/exit.rs",
                include_str!("vmproc/server/exit.rs"),
            ),
            ("vmproc/proto.rs", include_str!("vmproc/proto.rs")),
            ("vmproc/wire.rs", include_str!("vmproc/wire.rs")),
            ("vmgate.rs", include_str!("vmgate.rs")),
            ("threadclock.rs", include_str!("threadclock.rs")),
            ("iopage.rs", include_str!("iopage.rs")),
            ("hostfile.rs", include_str!("hostfile.rs")),
            ("seccomp/mod.rs", include_str!("seccomp/mod.rs")),
            ("boottrace.rs", include_str!("boottrace.rs")),
            ("cpuid.rs", include_str!("cpuid.rs")),
        ];
        let mut bad = Vec::new();
        for (name, src) in MODULES.iter().chain(more.iter()) {
            bad.extend(daemon_refs(src).into_iter().map(|l| format!("{name}: {l}")));
        }
        assert!(bad.is_empty(), "one-VM code refers to the daemon: {bad:#?}");
        // The check sees both forms, and not comments.
        let sample = "use crate::daemon::manager::Manager;\nlet c = crate::cpusched::own_thread_cpu_ns();\n/// [`crate::manager::Manager`]";
        assert_eq!(daemon_refs(sample).len(), 2);
    }

    /// The code lines of `src` that name a module of the daemon's model.
    fn daemon_refs(src: &str) -> Vec<String> {
        let daemon = ["daemon", "manager", "cpusched", "cgroup", "hostload"];
        let mut bad = Vec::new();
        for (i, line) in src.lines().enumerate() {
            let l = line.trim();
            if l.starts_with("//") {
                continue;
            }
            if daemon.iter().any(|d| {
                l.contains(&format!("crate::{d}::")) || l.contains(&format!("crate::{d};"))
            }) {
                bad.push(format!("{}: {l}", i + 1));
            }
        }
        bad
    }
}
