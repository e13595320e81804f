//! In-process VMs of the probe guest, scheduled by the real `gate` backend
//! (`corral_vmm::cpusched`) or placed in cgroups — for the CPU tests and
//! benchmarks.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use corral_scheduler::{Capacity, ClassSpec, Gate, PolicyConfig, Scheduler, VmId, VmSpec};
use corral_vmm::cgroup::CgroupBackend;
use corral_vmm::cpusched::{CpuScheduler, thread_cpu_ns};
use corral_vmm::{KernelSource, VmConfig, VmHandle};

/// The built-in probe guest, exported once from the `corral` binary.
pub fn probe_elf() -> Arc<[u8]> {
    static ELF: OnceLock<Arc<[u8]>> = OnceLock::new();
    ELF.get_or_init(|| {
        let p = std::env::temp_dir().join(format!("corral-probe-{}.elf", std::process::id()));
        let st = std::process::Command::new(crate::corral_bin())
            .arg("export-probe")
            .arg(&p)
            .status()
            .expect("run corral export-probe");
        assert!(st.success(), "corral export-probe failed");
        let b = std::fs::read(&p).expect("read exported probe");
        let _ = std::fs::remove_file(&p);
        Arc::from(b)
    })
    .clone()
}

/// How CPU is divided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// corral's scheduler thread and gates.
    Gate,
    /// Linux cgroups (cpu.shares/cpu.weight, quotas).
    Cgroup,
    /// Nothing: the host scheduler alone.
    None,
}

/// A class for [`Bench::class`].
#[derive(Debug, Clone, Copy)]
pub struct Class {
    /// Shares.
    pub shares: u32,
    /// Cap, % of one CPU.
    pub cap: Option<u32>,
    /// Reservation, % of one CPU.
    pub reservation: Option<u32>,
}

/// One running probe VM.
pub struct Vm {
    /// Its handle.
    pub handle: VmHandle,
    /// Scheduler id.
    pub id: VmId,
    /// Class name.
    pub class: String,
}

impl Vm {
    /// CPU time of all its vCPU threads so far, ns.
    pub fn cpu_ns(&self) -> u64 {
        self.handle
            .vcpu_tids()
            .iter()
            .filter_map(|t| thread_cpu_ns(*t))
            .sum()
    }
}

/// A set of VMs under one backend.
pub struct Bench {
    /// Backend in use.
    pub backend: Backend,
    cpu: Arc<CpuScheduler>,
    cg: Option<CgroupBackend>,
    classes: Vec<(String, Class)>,
    /// The VMs.
    pub vms: Vec<Vm>,
    next_id: u64,
}

impl Bench {
    /// An empty set on `backend`.
    pub fn new(backend: Backend) -> Self {
        let cap = Capacity::from_affinity().expect("affinity");
        let sched = Scheduler::new(cap, PolicyConfig::default()).expect("scheduler");
        let cpu = CpuScheduler::new(Arc::new(std::sync::Mutex::new(sched)));
        if backend == Backend::Gate {
            cpu.start().expect("start scheduler thread");
        }
        let cg = (backend == Backend::Cgroup).then(|| {
            CgroupBackend::new(&format!("t{}-{}", std::process::id(), rand_suffix()))
                .expect("cgroup cpu controller (run as root)")
        });
        Self {
            backend,
            cpu,
            cg,
            classes: Vec::new(),
            vms: Vec::new(),
            next_id: 1,
        }
    }

    /// The gate backend's scheduler service.
    pub fn cpu(&self) -> &Arc<CpuScheduler> {
        &self.cpu
    }

    /// Defines a class.
    pub fn class(&mut self, name: &str, c: Class) {
        let mut spec = ClassSpec::new(c.shares);
        if let Some(cap) = c.cap {
            spec = spec.with_cap(cap);
        }
        if let Some(r) = c.reservation {
            spec = spec.with_reservation(r);
        }
        self.cpu
            .with(|s| s.create_class(name, spec))
            .expect("create class");
        if let Some(cg) = &self.cg {
            cg.set_class(name, c.shares, c.cap).expect("cgroup class");
        }
        self.classes.push((name.to_string(), c));
    }

    /// Defines a class under `parent` (a nested cgroup under the cgroup
    /// backend).
    pub fn class_in(&mut self, name: &str, parent: &str, c: Class) {
        let mut spec = ClassSpec::new(c.shares);
        spec.cap = c.cap;
        spec.reservation = c.reservation;
        self.cpu
            .with(|s| s.create_class_in(name, spec, Some(parent)))
            .expect("create child class");
        if let Some(cg) = &self.cg {
            cg.set_class(&self.cg_path(name), c.shares, c.cap)
                .expect("cgroup class");
        }
        self.classes.push((name.to_string(), c));
    }

    /// A class's cgroup path from the root class.
    fn cg_path(&self, class: &str) -> String {
        self.cpu.with(|s| s.model().class_path(class).join("/"))
    }

    /// Starts a probe VM in `class` with `cmdline`.
    pub fn launch(&mut self, class: &str, vcpus: u8, memory_mib: u64, cmdline: &str) -> usize {
        let id = VmId(self.next_id);
        self.next_id += 1;
        let mut cfg = VmConfig::new(format!("vm{}", id.0), KernelSource::Bytes(probe_elf()));
        cfg.vcpus = vcpus;
        cfg.memory_mib = memory_mib;
        cfg.cmdline = cmdline.to_string();
        let gate = Arc::new(Gate::new());
        self.cpu
            .with(|s| s.add_vm(id, VmSpec::new(class, u32::from(vcpus))))
            .expect("admit VM");
        if self.backend == Backend::Gate {
            cfg.sched_gate = Some(gate.clone());
        }
        let handle = corral_vmm::start(&cfg).expect("start VM");
        match self.backend {
            Backend::Gate => self.cpu.attach(
                id,
                gate,
                handle.vcpu_tids().to_vec(),
                handle.device_tid().into_iter().collect(),
            ),
            Backend::Cgroup => {
                if let Some(cg) = &self.cg {
                    cg.place_vm(
                        &self.cg_path(class),
                        &format!("vm{}", id.0),
                        100,
                        handle.vcpu_tids(),
                    )
                    .expect("place vCPU threads");
                }
            }
            Backend::None => {}
        }
        self.vms.push(Vm {
            handle,
            id,
            class: class.to_string(),
        });
        self.vms.len() - 1
    }

    /// Sets or removes VM `i`'s own CPU cap (percent of one CPU) in the
    /// backend in use: the gate policy's model, or the VM's cgroup.
    pub fn set_vm_cap(&self, i: usize, cap: Option<u32>) {
        let vm = &self.vms[i];
        self.cpu
            .with(|s| s.set_vm_cap(vm.id, cap))
            .expect("set the VM's cap");
        if let Some(cg) = &self.cg {
            cg.set_vm_cap(&self.cg_path(&vm.class), &format!("vm{}", vm.id.0), cap)
                .expect("cgroup VM cap");
        }
    }

    /// CPU used by each VM over `window` (after `warmup`), in % of one CPU.
    pub fn measure(&self, warmup: Duration, window: Duration) -> Vec<f64> {
        std::thread::sleep(warmup);
        let a: Vec<u64> = self.vms.iter().map(Vm::cpu_ns).collect();
        let t0 = Instant::now();
        std::thread::sleep(window);
        let el = t0.elapsed().as_nanos() as f64;
        let b: Vec<u64> = self.vms.iter().map(Vm::cpu_ns).collect();
        a.iter()
            .zip(&b)
            .map(|(x, y)| (y.saturating_sub(*x)) as f64 * 100.0 / el)
            .collect()
    }

    /// Waits for VM `i` to stop; returns its console text.
    pub fn wait(&self, i: usize, timeout: Duration) -> String {
        let vm = &self.vms[i];
        assert!(
            vm.handle.wait(Some(timeout)).is_some(),
            "{} did not finish in {timeout:?}",
            vm.handle.name()
        );
        String::from_utf8_lossy(&vm.handle.console().tail(1 << 20)).into_owned()
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        for vm in &self.vms {
            vm.handle.stop();
            self.cpu.detach(vm.id);
        }
        for vm in &self.vms {
            vm.handle.join();
        }
        self.vms.clear();
        self.cpu.shutdown();
    }
}

fn rand_suffix() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Parses `key=value` from a probe result line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// The integer `key=N` of a probe result line; panics, naming the key and
/// the line, if it is missing or not a number.
pub fn num(line: &str, key: &str) -> u64 {
    field(line, key)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {line}"))
}
