//! Starting a VM for the manager: its files opened under the host-path
//! policy, its [`crate::vm::VmConfig`] built from the request (disks in
//! their class's I/O group), [`crate::builder::start`], and its placement on
//! the CPU backend (the gate scheduler or a cgroup).

use super::*;
use crate::hostfile::HostFile;
use crate::vmproc::remote::RemoteVm;
use std::os::unix::fs::DirBuilderExt;

impl Manager {
    pub(super) fn launch(
        &self,
        id: VmId,
        name: &str,
        req: &VmRequest,
        class_group: Option<ThrottleGroup>,
        files: &crate::images::VmFiles,
    ) -> Result<(VmRun, String), ManagerError> {
        let vcpus = u8::try_from(req.vcpus)
            .map_err(|_| ManagerError::Invalid(format!("too many vCPUs: {}", req.vcpus)))?;
        if req.kernel.is_none() && self.cfg.builtin_kernel.is_none() {
            return Err(ManagerError::Invalid(
                "no kernel given and this daemon has no built-in guest".into(),
            ));
        }
        self.start_opened(id, name, req, class_group, files, vcpus)
    }

    /// Opens a VM's kernel, initrd and disks under the host-path policy.
    pub(super) fn open_files(
        &self,
        req: &VmRequest,
    ) -> Result<crate::images::VmFiles, ManagerError> {
        let disks: Vec<_> = req
            .disks
            .iter()
            .map(|d| (d.path.as_path(), d.read_only, d.direct))
            .collect();
        Ok(self.images.open_vm(
            &self.cfg.host_files,
            req.kernel.as_deref(),
            req.initrd.as_deref(),
            &disks,
        )?)
    }

    pub(super) fn start_opened(
        &self,
        id: VmId,
        name: &str,
        req: &VmRequest,
        class_group: Option<ThrottleGroup>,
        files: &crate::images::VmFiles,
        vcpus: u8,
    ) -> Result<(VmRun, String), ManagerError> {
        let (kernel, default_cmdline) = match (&files.kernel, &self.cfg.builtin_kernel) {
            (Some(f), _) => (KernelSource::File(f.clone()), DEFAULT_LINUX_CMDLINE),
            (None, Some(b)) => (KernelSource::Bytes(b.clone()), ""),
            (None, None) => {
                return Err(ManagerError::Invalid(
                    "no kernel given and this daemon has no built-in guest".into(),
                ));
            }
        };
        let mut cfg = VmConfig::new(name, kernel);
        cfg.initrd = files.initrd.clone().map(HostImage::File);
        cfg.cmdline = req
            .cmdline
            .clone()
            .unwrap_or_else(|| default_cmdline.to_string());
        cfg.vcpus = vcpus;
        cfg.memory_mib = req.memory_mib;
        cfg.console_log_bytes = self.cfg.console_log_bytes;
        cfg.disks = req
            .disks
            .iter()
            .zip(&files.disks)
            .map(|(d, f)| crate::vm::DiskConfig {
                id: Some(d.id.clone()),
                path: d.path.clone(),
                read_only: d.read_only,
                direct: d.direct,
                engine: d.engine,
                limits: d.limits,
                // Every disk is in its class's I/O group (unlimited until the
                // class gets `io` limits), so class limits apply live, with
                // the VM's weight: VMs share the class's I/O as its CPU.
                group: class_group.clone().map(|g| (g, req.weight)),
                file: Some(f.clone()),
            })
            .collect();
        let gated = self.cfg.cpu_backend == CpuBackend::Gate;
        let handle = match &self.cfg.vm_processes {
            Some(p) => {
                // The gate is a page shared with the VM process.
                let (gate, fd) = match gated {
                    true => Gate::new_shared()
                        .map(|(g, fd)| (Some(g), Some(fd)))
                        .map_err(|e| VmError::Config(format!("scheduler gate: {e}")))?,
                    false => (None, None),
                };
                // With the cgroup backend, in its group from the start.
                let vm = self.start_process(p, &cfg, files, req, fd)?;
                if let Some(gate) = gate {
                    self.attach_process(id, &vm, gate, usize::from(vcpus));
                }
                VmRun::Remote(vm)
            }
            _ => {
                let gate = gated.then(|| Arc::new(Gate::new()));
                cfg.sched_gate = gate.clone();
                let h = crate::builder::start(&cfg)?;
                if let Some(gate) = gate {
                    let extra = h.device_tid().into_iter().collect();
                    self.cpu.attach(id, gate, h.vcpu_tids().to_vec(), extra);
                }
                VmRun::Local(h)
            }
        };
        match self.cfg.cpu_backend {
            // A VM process is in its group already (`start_process`); the
            // threads of a VM in the daemon join it now.
            CpuBackend::Cgroup if matches!(handle, VmRun::Local(_)) => {
                if let Err(e) = self.cg_place(
                    &self.cg_path(&req.class),
                    name,
                    req.weight,
                    req.cap,
                    &handle,
                ) {
                    handle.stop();
                    handle.join();
                    return Err(cgplace::cg_err(e));
                }
            }
            CpuBackend::Gate | CpuBackend::Cgroup | CpuBackend::None => {}
        }
        tracing::info!(
            vm = name,
            vcpus = req.vcpus,
            memory_mib = req.memory_mib,
            "VM started"
        );
        Ok((handle, cfg.cmdline))
    }

    /// Enforces the gate backend on VM process `vm` (`vcpus` vCPUs)
    /// through `gate`, the owner side of the page it shares with the
    /// process: the scheduler thread parks and unparks the word itself and
    /// kicks the vCPU threads by host tid (`KickMode::Signal`); their CPU
    /// time is the process's clock and their run times (host tids).
    pub(super) fn attach_process(&self, id: VmId, vm: &RemoteVm, gate: Arc<Gate>, vcpus: usize) {
        gate.set_kick(vm.gate_kick());
        let ids = vm.host_ids();
        let (pid, tids) = (ids.pid as libc::pid_t, ids.vcpu_tids.clone());
        self.cpu.attach_process(id, gate, pid, vcpus, tids);
    }

    /// Starts `cfg` in a VM process of its own: the files the daemon opened
    /// (and locked) are passed as fds, the rest as the configuration
    /// message, with the scheduler gate's memfd `gate` if any. The daemon
    /// keeps its own handles of the files (the image book releases their
    /// locks when the VM is released). The disks' group is its class's,
    /// over the class's shared page when it has one.
    fn start_process(
        &self,
        p: &VmProcesses,
        cfg: &VmConfig,
        files: &crate::images::VmFiles,
        req: &VmRequest,
        gate: Option<std::os::fd::OwnedFd>,
    ) -> Result<Arc<RemoteVm>, ManagerError> {
        use crate::vmproc::proto::{DiskSpec, PassedFile, VmSpec};
        use std::os::fd::AsFd;
        let mut fds = Vec::new();
        let mut keep = Vec::new();
        let mut pass = |f: &HostFile| {
            fds.push(f.clone());
            keep.push(f.clone());
            PassedFile {
                fd: fds.len() - 1,
                path: f.path().to_path_buf(),
            }
        };
        let kernel = files.kernel.as_ref().map(&mut pass);
        let initrd = files.initrd.as_ref().map(&mut pass);
        let mut disks = Vec::new();
        for (d, f) in cfg.disks.iter().zip(&files.disks) {
            disks.push(DiskSpec {
                id: d.id.clone().unwrap_or_default(),
                file: pass(f),
                read_only: d.read_only,
                direct: d.direct,
                limits: d.limits.into(),
                group: d
                    .group
                    .as_ref()
                    .map(|(g, w)| crate::vmproc::proto::GroupSpec {
                        name: g.name().to_string(),
                        limits: g.limits().into(),
                        weight: *w,
                        page: None,
                    }),
                engine: d.engine.map(crate::vmproc::proto::engine_name),
            });
        }
        // The class group's page goes after the files (for a VM with disks).
        let page = match disks.iter().any(|d| d.group.is_some()) {
            true => lock(&self.state).class_pages.get(&req.class).cloned(),
            false => None,
        };
        if page.is_some() {
            let i = fds.len();
            for g in disks.iter_mut().filter_map(|d| d.group.as_mut()) {
                g.page = Some(i);
            }
        }
        // A uid no process runs as; the lease ends with this call, when the
        // VM process already runs as it (it jails itself before `Started`).
        let lease = match &p.jail {
            Some(pool) => Some(
                pool.take()
                    .map_err(|e| ManagerError::Invalid(e.to_string()))?,
            ),
            None => None,
        };
        let spec = VmSpec {
            name: cfg.name.clone(),
            nonce: format!("{:016x}", rand_nonce()),
            vcpus: cfg.vcpus,
            memory_mib: cfg.memory_mib,
            cmdline: cfg.cmdline.clone(),
            console_log_bytes: cfg.console_log_bytes,
            acpi: cfg.acpi,
            kernel,
            initrd,
            disks,
            // After the files and the class group's page.
            sched_gate: gate
                .as_ref()
                .map(|_| fds.len() + usize::from(page.is_some())),
            seccomp: p.seccomp,
            control_socket: self.control_socket(&cfg.name),
            jail: lease.as_ref().map(|l| crate::vmproc::proto::JailParams {
                uid: l.uid(),
                pid_namespace: p.pid_namespace,
            }),
        };
        let mut borrowed: Vec<_> = fds.iter().map(|f| f.file().as_fd()).collect();
        borrowed.extend(page.as_deref().map(|f| f.as_fd()));
        borrowed.extend(gate.as_ref().map(|g| g.as_fd()));
        // In a session of its own when it may outlive the daemon.
        let setsid = spec.control_socket.is_some();
        // The cgroup backend's group, made before the process exists; the
        // process is moved in before it gets its configuration, so before
        // it runs a thread of the VM (race-free: nothing to move later).
        let group = self.cg_prepare(&req.class, &cfg.name, req.weight, req.cap)?;
        let spawned = |pid| self.cg_add_process(group.as_deref(), &cfg.name, pid);
        let vm = RemoteVm::start(&p.launcher, spec, &borrowed, keep, setsid, &spawned);
        drop(lease);
        match vm {
            Ok(vm) => Ok(Arc::new(vm)),
            Err(e) => {
                if let (Some(cg), Some(path)) = (&self.cgroup, &group) {
                    let _ = cg.remove_vm(path, &cfg.name);
                }
                Err(e.into())
            }
        }
    }
}

impl Manager {
    /// Where VM `name`'s process listens for a daemon that re-adopts it:
    /// `STATE_DIR/vms/NAME.sock` (the directory 0700). `None` without a
    /// state directory, or when the path is too long for a Unix socket
    /// (the VM then cannot outlive the daemon).
    fn control_socket(&self, name: &str) -> Option<std::path::PathBuf> {
        let dir = self.cfg.state_dir.as_ref()?;
        let p = crate::vmproc::adopt::control_socket(dir, name);
        if p.as_os_str().len() > crate::vmproc::adopt::MAX_SOCKET_PATH {
            tracing::warn!(vm = name, path = %p.display(), "control socket path too long: the VM will not outlive the daemon");
            return None;
        }
        let vms = p.parent()?;
        if let Err(e) = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(vms)
        {
            tracing::warn!(vm = name, "cannot create {}: {e}", vms.display());
            return None;
        }
        Some(p)
    }
}

/// A run's identity: 64 random bits.
fn rand_nonce() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        return std::process::id() as u64 ^ crate::util::monotonic_ns();
    }
    u64::from_le_bytes(b)
}
