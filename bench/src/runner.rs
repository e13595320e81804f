//! Running probe guests through the manager and measuring them: host wall
//! time, guest-reported time, vCPU-thread CPU time, process CPU time; hog VMs
//! kept running in the background; disk files.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use corral_scheduler::ClassSpec;
use corral_vmm::manager::{
    ClassConfig, ConsoleWatch, CpuBackend, DiskRequest, Limits, Manager, ManagerConfig, VmRequest,
    thread_cpu_ns,
};

use super::BenchError;
use super::host::process_cpu_s;
use super::linux::{self, KbuildStatus, LinuxJob};

/// A manager with the built-in probe, this CPU backend and these classes
/// (name, shares) besides `default`.
pub fn new_manager(
    backend: CpuBackend,
    builtin: &Arc<[u8]>,
    classes: &[(&str, u32)],
) -> Result<Arc<Manager>, BenchError> {
    new_manager_with(backend, builtin, classes, Default::default())
}

/// [`new_manager`] with the scheduler's timing `policy`.
pub fn new_manager_with(
    backend: CpuBackend,
    builtin: &Arc<[u8]>,
    classes: &[(&str, u32)],
    policy: corral_scheduler::PolicyConfig,
) -> Result<Arc<Manager>, BenchError> {
    let mut initial = vec![("default".to_string(), ClassConfig::default())];
    for (name, shares) in classes {
        initial.push((
            name.to_string(),
            ClassConfig {
                cpu: ClassSpec::new(*shares),
                io: Limits::default(),
            },
        ));
    }
    let m = Manager::new(ManagerConfig {
        builtin_kernel: Some(builtin.clone()),
        cpu_backend: backend,
        initial_classes: initial,
        policy,
        ..Default::default()
    })
    .map_err(|e| BenchError(format!("manager ({backend:?} backend): {e}")))?;
    Ok(Arc::new(m))
}

/// Which guest a job boots, and so how it reports its end and its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guest {
    /// The built-in probe: `PROBE-DONE status=ok` and a `PROBE-RESULT` line.
    Probe,
    /// The Linux kernel-compile guest: a `KBUILD-RESULT` line.
    Kbuild,
}

/// A guest job: the command line and the VM's shape.
#[derive(Debug, Clone)]
pub struct Job {
    /// Kernel command line.
    pub cmdline: String,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest memory, MiB.
    pub memory_mib: u64,
    /// A disk with its limits.
    pub disk: Option<(PathBuf, Limits)>,
    /// The disk is attached read-only.
    pub disk_read_only: bool,
    /// Kernel and initramfs; `None` = the built-in probe.
    pub kernel: Option<(PathBuf, PathBuf)>,
    /// The guest's protocol.
    pub guest: Guest,
    /// Longest a run may take; `None` = the benchmark's default.
    pub timeout: Option<Duration>,
}

impl Job {
    /// The probe's fixed integer job: `units` units of `unit_iters` rounds.
    pub fn work(units: u64, unit_iters: u64, vcpus: u32) -> Self {
        Self::probe(
            format!("probe.mode=work probe.units={units} probe.unit_iters={unit_iters}"),
            vcpus,
            32,
            None,
        )
    }

    fn probe(
        cmdline: String,
        vcpus: u32,
        memory_mib: u64,
        disk: Option<(PathBuf, Limits)>,
    ) -> Self {
        Self {
            cmdline,
            vcpus,
            memory_mib,
            disk,
            disk_read_only: false,
            kernel: None,
            guest: Guest::Probe,
            timeout: None,
        }
    }

    /// The Linux kernel-compile job: its kernel, initramfs and root disk
    /// (read-only, no limits), its own timeout.
    pub fn kbuild(job: &LinuxJob) -> Self {
        Self {
            cmdline: job.cmdline(),
            vcpus: job.vcpus,
            memory_mib: job.memory_mib,
            disk: Some((job.rootfs.clone(), Limits::default())),
            disk_read_only: true,
            kernel: Some((job.kernel.clone(), job.initrd.clone())),
            guest: Guest::Kbuild,
            timeout: Some(Duration::from_secs(job.timeout_s)),
        }
    }

    /// Spinning on every vCPU for `secs`, progress every `interval_ms`.
    pub fn spin(secs: u64, interval_ms: u64, vcpus: u32) -> Self {
        Self::probe(
            format!("probe.mode=spin probe.secs={secs} probe.interval_ms={interval_ms}"),
            vcpus,
            32,
            None,
        )
    }

    /// virtio-blk reads of `size` bytes in requests of `bs`, `qd` in flight.
    pub fn blk_read(disk: &Path, limits: Limits, size: u64, bs: u64, qd: u32) -> Self {
        Self::probe(
            format!(
                "probe.mode=blk probe.op=read probe.size={size} probe.bs={bs} probe.qd={qd} probe.timeout_ms=60000"
            ),
            1,
            64,
            Some((disk.to_path_buf(), limits)),
        )
    }

    /// The same job with a disk attached (unused by CPU jobs; it makes
    /// configurations that differ only in the disk's limits comparable).
    pub fn with_disk(mut self, disk: &Path, limits: Limits) -> Self {
        self.disk = Some((disk.to_path_buf(), limits));
        self.memory_mib = self.memory_mib.max(64);
        self
    }

    /// The same probe job with `probe.wait=` set (how the disk driver
    /// waits for completions).
    pub fn with_wait(mut self, wait: super::ProbeWait) -> Self {
        self.cmdline = format!("{} probe.wait={}", self.cmdline, wait.param());
        self
    }

    /// The same job with other disk limits.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        if let Some((_, l)) = &mut self.disk {
            *l = limits;
        }
        self
    }
}

/// A VM started from a [`Job`], with its console followed and the CPU time
/// of its vCPU threads sampled. Deleted when dropped.
pub struct Vm {
    mgr: Arc<Manager>,
    /// Name.
    pub name: String,
    tids: Vec<libc::pid_t>,
    last_ns: Vec<u64>,
    watch: ConsoleWatch,
    pos: u64,
    partial: String,
    /// Complete console lines so far.
    pub lines: Vec<String>,
    /// When `create_vm` was called.
    pub t0: Instant,
    /// When the guest's end marker (`PROBE-DONE`, `KBUILD-RESULT`) arrived.
    pub done_at: Option<Instant>,
    guest: Guest,
}

impl Vm {
    /// Creates and starts the VM.
    pub fn start(
        mgr: &Arc<Manager>,
        name: &str,
        class: &str,
        job: &Job,
    ) -> Result<Self, BenchError> {
        let req = VmRequest {
            name: Some(name.to_string()),
            class: class.to_string(),
            vcpus: job.vcpus,
            memory_mib: job.memory_mib,
            kernel: job.kernel.as_ref().map(|(k, _)| k.clone()),
            initrd: job.kernel.as_ref().map(|(_, i)| i.clone()),
            cmdline: Some(job.cmdline.clone()),
            disks: job
                .disk
                .iter()
                .map(|(p, l)| DiskRequest {
                    id: "disk0".into(),
                    path: p.clone(),
                    read_only: job.disk_read_only,
                    direct: false,
                    engine: None,
                    limits: *l,
                })
                .collect(),
            ..Default::default()
        };
        let t0 = Instant::now();
        mgr.create_vm(req)
            .map_err(|e| BenchError(format!("creating VM {name}: {e}")))?;
        let watch = mgr
            .console_watch(name)
            .map_err(|e| BenchError(format!("VM {name}: {e}")))?;
        let tids = mgr
            .sched_vms()
            .into_iter()
            .find(|v| v.name == name)
            .map(|v| v.vcpu_tids)
            .unwrap_or_default();
        let last_ns = vec![0; tids.len()];
        let mut vm = Self {
            mgr: mgr.clone(),
            name: name.to_string(),
            tids,
            last_ns,
            watch,
            pos: 0,
            partial: String::new(),
            lines: Vec::new(),
            t0,
            done_at: None,
            guest: job.guest,
        };
        vm.cpu_ns();
        Ok(vm)
    }

    /// CPU time of the vCPU threads so far, in ns (the last reading is kept
    /// once a thread has exited).
    pub fn cpu_ns(&mut self) -> u64 {
        for (tid, last) in self.tids.iter().zip(self.last_ns.iter_mut()) {
            if let Some(ns) = thread_cpu_ns(*tid) {
                *last = (*last).max(ns);
            }
        }
        self.last_ns.iter().sum()
    }

    /// Reads new console output, waiting up to `timeout` for some. Returns
    /// true once the guest printed its end marker (`PROBE-DONE`, or
    /// `KBUILD-RESULT` for the Linux job) or the VM stopped.
    pub fn pump(&mut self, timeout: Duration) -> bool {
        let (data, pos, _closed) = self.watch.log.read_from(self.pos, timeout);
        let now = Instant::now();
        self.pos = pos;
        if !data.is_empty() {
            self.partial.push_str(&String::from_utf8_lossy(&data));
            while let Some(i) = self.partial.find('\n') {
                let line: String = self.partial.drain(..=i).collect();
                let line = line.trim_end().to_string();
                let done = match self.guest {
                    Guest::Probe => line.starts_with("PROBE-DONE"),
                    Guest::Kbuild => line.contains(linux::RESULT_MARKER),
                };
                if done && self.done_at.is_none() {
                    self.done_at = Some(now);
                }
                self.lines.push(line);
            }
        }
        self.done_at.is_some() || self.stopped()
    }

    /// Whether the VM has stopped.
    pub fn stopped(&self) -> bool {
        self.watch.finished()
    }

    /// The first `PROBE-RESULT` line.
    pub fn result_line(&self) -> Option<&str> {
        self.lines
            .iter()
            .find(|l| l.starts_with("PROBE-RESULT"))
            .map(String::as_str)
    }

    /// Ok if the guest finished with `PROBE-DONE status=ok`.
    pub fn check_ok(&self) -> Result<(), BenchError> {
        if self.lines.iter().any(|l| l == "PROBE-DONE status=ok") {
            return Ok(());
        }
        Err(BenchError(format!(
            "VM {} did not finish its job; console tail:\n    {}",
            self.name,
            self.tail(6).join("\n    ")
        )))
    }

    /// The last `n` non-blank console lines (with an incomplete last line),
    /// or a note that there was no output.
    pub fn tail(&self, n: usize) -> Vec<&str> {
        let lines: Vec<&str> = self
            .lines
            .iter()
            .map(String::as_str)
            .filter(|l| !l.trim().is_empty())
            .collect();
        let mut t = lines[lines.len().saturating_sub(n)..].to_vec();
        if !self.partial.trim().is_empty() {
            t.push(self.partial.trim_end());
        }
        if t.is_empty() {
            t.push("(no console output)");
        }
        t
    }

    /// How the VM ended, for error messages: its exit reason, or that it
    /// still runs.
    pub fn exit_note(&self) -> String {
        match self.mgr.get_vm(&self.name) {
            Ok(info) => match info.exit {
                Some(reason) => format!("the VM stopped: {reason}"),
                None => "the VM still runs".into(),
            },
            Err(e) => format!("VM state unknown: {e}"),
        }
    }

    /// The Linux job's result: its `KBUILD-RESULT` line (from the marker on)
    /// and make's time in seconds, or why there is none. A failed build is an
    /// error with the guest's `KBUILD-ERROR` and `kbuild-log:` lines.
    pub fn kbuild_result(&self, job: &Job) -> Result<(String, f64), BenchError> {
        let Some(line) = self.lines.iter().find(|l| l.contains(linux::RESULT_MARKER)) else {
            return Err(BenchError(format!(
                "VM {} (Linux kernel-compile job) printed no KBUILD-RESULT line; {}; console \
                 tail:\n    {}",
                self.name,
                self.exit_note(),
                self.tail(15).join("\n    ")
            )));
        };
        let from = line.find(linux::RESULT_MARKER).unwrap_or(0);
        let line = line[from..].to_string();
        let r = linux::parse_result(&line)
            .map_err(|e| BenchError(format!("VM {}: {e}: {line}", self.name)))?;
        let guest_log = || {
            self.lines
                .iter()
                .filter(|l| l.contains("KBUILD-ERROR") || l.starts_with("kbuild-log: "))
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join("\n    ")
        };
        match r.status {
            KbuildStatus::Fail { rc, stage } => Err(BenchError(format!(
                "VM {}: the guest's kernel build failed (rc={rc}, stage {}): {line}\n    {}",
                self.name,
                stage.as_deref().unwrap_or("?"),
                guest_log()
            ))),
            KbuildStatus::Ok if r.dry => Err(BenchError(format!(
                "VM {}: the guest ran a dry build (kbuild.dry=1), not a measurement: {line}",
                self.name
            ))),
            KbuildStatus::Ok => {
                let want_jobs = field(&job.cmdline, "kbuild.jobs").and_then(|v| v.parse().ok());
                let want_config = field(&job.cmdline, "kbuild.config");
                if r.jobs != want_jobs || r.config.as_deref() != want_config {
                    return Err(BenchError(format!(
                        "VM {}: the guest built with other parameters than asked ({}): {line}",
                        self.name, job.cmdline
                    )));
                }
                let ms = r.ms.unwrap_or(0);
                Ok((line, ms as f64 / 1e3))
            }
        }
    }

    /// Waits until the VM has stopped (up to `timeout`), sampling its CPU.
    pub fn wait_stopped(&mut self, timeout: Duration) {
        let end = Instant::now() + timeout;
        while !self.stopped() && Instant::now() < end {
            self.cpu_ns();
            std::thread::sleep(Duration::from_millis(1));
        }
        self.cpu_ns();
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.mgr.delete_vm(&self.name);
    }
}

/// One measured run of a job.
#[derive(Debug, Clone)]
pub struct JobResult {
    /// Host wall time from `create_vm` to the guest's end marker
    /// (`PROBE-DONE`, `KBUILD-RESULT`).
    pub wall_s: f64,
    /// The guest's own figure (`us=` of the probe's result line, `ms=` of
    /// `KBUILD-RESULT`), if it gave one.
    pub guest_s: Option<f64>,
    /// CPU time of the VM's vCPU threads.
    pub vm_cpu_s: f64,
    /// CPU time of this whole process from before `create_vm` to after
    /// `delete_vm` (includes the device thread and the scheduler thread).
    pub proc_cpu_s: f64,
    /// The guest's `PROBE-RESULT` or `KBUILD-RESULT` line.
    pub result: String,
    /// Bytes and requests the guest read from its disks (when it has any),
    /// as the disks' counters stood when the guest printed its end marker.
    pub disk_read: Option<(u64, u64)>,
}

impl JobResult {
    /// A numeric field of the result line.
    pub fn num(&self, key: &str) -> Option<f64> {
        field(&self.result, key).and_then(|v| v.parse().ok())
    }
}

/// Runs `job` to completion as VM `name` in `class` and measures it;
/// `timeout` applies unless the job has its own.
pub fn run_job(
    mgr: &Arc<Manager>,
    name: &str,
    class: &str,
    job: &Job,
    timeout: Duration,
) -> Result<JobResult, BenchError> {
    run_job_with(mgr, name, class, job, timeout, |_| {})
}

/// [`run_job`], calling `started` with the VM's vCPU thread ids right after
/// `create_vm` returns.
pub fn run_job_with(
    mgr: &Arc<Manager>,
    name: &str,
    class: &str,
    job: &Job,
    timeout: Duration,
    started: impl FnOnce(&[libc::pid_t]),
) -> Result<JobResult, BenchError> {
    let timeout = job.timeout.unwrap_or(timeout);
    let c0 = process_cpu_s();
    let mut vm = Vm::start(mgr, name, class, job)?;
    started(&vm.tids);
    let deadline = vm.t0 + timeout;
    while !vm.pump(Duration::from_millis(5)) {
        vm.cpu_ns();
        if Instant::now() > deadline {
            return Err(BenchError(format!(
                "VM {name} did not finish within {timeout:?} ({}); console tail:\n    {}",
                job.cmdline,
                vm.tail(8).join("\n    ")
            )));
        }
    }
    let end = vm.done_at.unwrap_or_else(Instant::now);
    let disk_read = disk_read(mgr, name);
    vm.wait_stopped(Duration::from_secs(5));
    // Output printed just before the exit.
    vm.pump(Duration::ZERO);
    let (result, guest_s) = match job.guest {
        Guest::Probe => {
            vm.check_ok()?;
            let result = vm
                .result_line()
                .ok_or_else(|| BenchError(format!("VM {name} printed no PROBE-RESULT")))?
                .to_string();
            let guest_s = field(&result, "us")
                .and_then(|v| v.parse::<f64>().ok())
                .map(|us| us / 1e6);
            (result, guest_s)
        }
        Guest::Kbuild => {
            let (line, s) = vm.kbuild_result(job)?;
            (line, Some(s))
        }
    };
    let vm_cpu_s = vm.cpu_ns() as f64 / 1e9;
    let wall_s = (end - vm.t0).as_secs_f64();
    drop(vm);
    let proc_cpu_s = process_cpu_s() - c0;
    Ok(JobResult {
        wall_s,
        guest_s,
        vm_cpu_s,
        proc_cpu_s,
        result,
        disk_read,
    })
}

/// The CPUs this process may run on (its affinity mask), in order.
pub fn allowed_cpus() -> Result<Vec<usize>, BenchError> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is ours and its size is passed; pid 0 is this thread.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(BenchError(format!(
            "sched_getaffinity: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: CPU_ISSET reads the set we own; the index is below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Pins thread `tid` (0: the calling thread) to the CPUs in `cpus`.
pub fn pin_thread(tid: libc::pid_t, cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: CPU_SET writes into the set we own; it ignores indices at
        // or over CPU_SETSIZE.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: `set` is ours and its size is passed; a tid that has exited
    // gives ESRCH, nothing else.
    let rc = unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The CPU `tid` is pinned to, if its affinity mask holds exactly one CPU.
pub fn pinned_cpu(tid: libc::pid_t) -> Option<usize> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is ours and its size is passed.
    let rc =
        unsafe { libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return None;
    }
    // SAFETY: CPU_ISSET reads the set we own; the index is below CPU_SETSIZE.
    let on: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect();
    (on.len() == 1).then(|| on[0])
}

/// Pins every thread of this process to `cpus`; returns how many threads
/// it pinned (threads that exit meanwhile are skipped).
pub fn pin_process(cpus: &[usize]) -> Result<usize, BenchError> {
    let dir = std::fs::read_dir("/proc/self/task")
        .map_err(|e| BenchError(format!("/proc/self/task: {e}")))?;
    let mut n = 0;
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        if pin_thread(tid, cpus).is_ok() {
            n += 1;
        }
    }
    Ok(n)
}

/// Bytes and requests VM `name` has read from its disks so far.
fn disk_read(mgr: &Manager, name: &str) -> Option<(u64, u64)> {
    mgr.get_vm(name)
        .ok()?
        .disks
        .iter()
        .filter_map(|d| d.stats.as_ref())
        .map(|s| (s.read.bytes, s.read.ops))
        .reduce(|a, b| (a.0 + b.0, a.1 + b.1))
}

/// The value of `key=` in a probe line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// A VM kept running in the background: restarted whenever its job ends,
/// until stopped. Its vCPU CPU time is summed over the restarts.
pub struct Hog {
    stop: Arc<AtomicBool>,
    cpu_ns: Arc<AtomicU64>,
    restarts: Arc<AtomicU64>,
    thread: Option<JoinHandle<Result<(), BenchError>>>,
}

impl Hog {
    /// Starts the hog (the first VM synchronously, so errors show at once).
    pub fn start(
        mgr: &Arc<Manager>,
        name: &str,
        class: &str,
        job: &Job,
    ) -> Result<Self, BenchError> {
        let stop = Arc::new(AtomicBool::new(false));
        let cpu_ns = Arc::new(AtomicU64::new(0));
        let restarts = Arc::new(AtomicU64::new(0));
        let first = Vm::start(mgr, name, class, job)?;
        let (mgr, name, class, job) = (
            mgr.clone(),
            name.to_string(),
            class.to_string(),
            job.clone(),
        );
        let (s, c, r) = (stop.clone(), cpu_ns.clone(), restarts.clone());
        let thread = std::thread::Builder::new()
            .name(format!("hog-{name}"))
            .spawn(move || {
                let mut vm = first;
                let mut base = 0u64;
                loop {
                    while !s.load(Ordering::Relaxed) && !vm.stopped() {
                        vm.pump(Duration::from_millis(10));
                        c.store(base + vm.cpu_ns(), Ordering::Relaxed);
                    }
                    if s.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                    vm.wait_stopped(Duration::from_secs(1));
                    vm.pump(Duration::ZERO);
                    base += vm.cpu_ns();
                    c.store(base, Ordering::Relaxed);
                    vm.check_ok()?;
                    drop(vm);
                    r.fetch_add(1, Ordering::Relaxed);
                    vm = Vm::start(&mgr, &name, &class, &job)?;
                }
            })
            .map_err(|e| BenchError(format!("spawning the hog thread: {e}")))?;
        Ok(Self {
            stop,
            cpu_ns,
            restarts,
            thread: Some(thread),
        })
    }

    /// vCPU CPU time over all its VMs so far, ns (updated every 10 ms).
    pub fn cpu_ns(&self) -> u64 {
        self.cpu_ns.load(Ordering::Relaxed)
    }

    /// Stops and deletes it; returns how often it was restarted.
    pub fn stop(mut self) -> Result<u64, BenchError> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join()
                .map_err(|_| BenchError("the hog thread panicked".into()))??;
        }
        Ok(self.restarts.load(Ordering::Relaxed))
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads the first `bytes` of `path` (into nothing), so that a guest's
/// later reads of that range come from the page cache: the first read of a
/// sparse file's range allocates its pages and is slower than every later
/// read.
pub fn warm(path: &Path, bytes: u64) -> Result<(), BenchError> {
    use std::io::Read as _;
    let err = |e: std::io::Error| BenchError(format!("reading {}: {e}", path.display()));
    let mut f = std::fs::File::open(path).map_err(err)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        let want = left.min(buf.len() as u64) as usize;
        let n = f.read(&mut buf[..want]).map_err(err)?;
        if n == 0 {
            break;
        }
        left -= n as u64;
    }
    Ok(())
}

/// A private temporary directory for disk files, removed when dropped.
pub struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    /// Creates it under the system's temporary directory.
    pub fn new(kind: &str) -> Result<Self, BenchError> {
        let dir = std::env::temp_dir().join(format!(
            "corral-bench-{kind}-{}-{}",
            std::process::id(),
            super::report::utc_stamp()
        ));
        std::fs::create_dir_all(&dir)
            .map_err(|e| BenchError(format!("cannot create {}: {e}", dir.display())))?;
        Ok(Self { dir })
    }

    /// A disk file of `bytes` filled with non-zero data (so reads come from
    /// page-cache pages that hold data, not holes).
    pub fn filled(&self, name: &str, bytes: u64) -> Result<PathBuf, BenchError> {
        let p = self.dir.join(name);
        let err = |e: std::io::Error| BenchError(format!("writing {}: {e}", p.display()));
        let mut f = std::fs::File::create(&p).map_err(err)?;
        let mut chunk = vec![0u8; 1 << 20];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for b in chunk.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            f.write_all(&chunk[..n]).map_err(err)?;
            left -= n as u64;
        }
        f.sync_all().map_err(err)?;
        Ok(p)
    }

    /// A sparse disk file of `bytes`.
    pub fn sparse(&self, name: &str, bytes: u64) -> Result<PathBuf, BenchError> {
        let p = self.dir.join(name);
        let f = std::fs::File::create(&p)
            .map_err(|e| BenchError(format!("creating {}: {e}", p.display())))?;
        f.set_len(bytes)
            .map_err(|e| BenchError(format!("sizing {}: {e}", p.display())))?;
        Ok(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields() {
        let l =
            "PROBE-RESULT mode=blk disk=0 op=read requests=256 errors=0 bytes=16777216 us=28807";
        assert_eq!(field(l, "us"), Some("28807"));
        assert_eq!(field(l, "bytes"), Some("16777216"));
        assert_eq!(field(l, "s"), None);
    }
}
