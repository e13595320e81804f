//! VMs: snapshots, CPU sampling, admission and start (`create_vm`),
//! delete, cap, pause/resume, moving between classes.

use super::*;

impl Manager {
    /// The gate backend's scheduler service.
    pub fn cpu_scheduler(&self) -> &Arc<CpuScheduler> {
        &self.cpu
    }

    /// The CPU backend in use.
    pub fn cpu_backend(&self) -> CpuBackend {
        self.cfg.cpu_backend
    }

    pub(super) fn vm_info(&self, e: &Entry, stats: Option<&Stats>) -> VmInfo {
        let (state, exit) = e.state();
        let running = exit.is_none();
        let mut exits: BTreeMap<&'static str, u64> = BTreeMap::new();
        for (k, v) in e.handle.exit_counts() {
            *exits.entry(k).or_default() += v;
        }
        let sched_cpu_ns = stats
            .and_then(|s| s.vms.iter().find(|v| v.vm == e.id))
            .map_or(0, |v| v.cpu_ns);
        let sched = stats.filter(|s| s.ticks > 0).and_then(|s| {
            s.vms.iter().find(|v| v.vm == e.id).map(|v| SchedFigures {
                entitlement_pct: v.entitlement_pct,
                used_pct: v.used_pct,
                parked: v.parked,
                parked_secs: v.parked_ns as f64 / 1e9,
                park_count: v.park_count,
            })
        });
        VmInfo {
            name: e.name.clone(),
            id: e.id.0,
            state,
            exit,
            class: lock(&e.class).clone(),
            weight: e.weight.load(Ordering::Relaxed),
            cap: Some(e.cap.load(Ordering::Relaxed)).filter(|&c| c > 0),
            vcpus: e.request.vcpus,
            memory_mib: e.request.memory_mib,
            kernel: e.request.kernel.clone(),
            initrd: e.request.initrd.clone(),
            cmdline: e.cmdline.clone(),
            disks: e.disks_now(),
            created: e.created,
            uptime: running.then(|| e.handle.uptime()),
            cpu_secs: e.cpu_ns(running).max(sched_cpu_ns) as f64 / 1e9,
            pid: e
                .handle
                .remote()
                .filter(|_| e.handle.exit_reason().is_none())
                .map(|r| r.pid()),
            exits: exits.into_iter().collect(),
            guest_errors: e.handle.guest_errors(),
            sched,
        }
    }

    pub(super) fn entry(&self, name: &str) -> Result<Arc<Entry>, ManagerError> {
        lock(&self.state)
            .vms
            .get(name)
            .cloned()
            .ok_or_else(|| ManagerError::NotFound(format!("no VM named {name:?}")))
    }

    /// All VMs, by name.
    pub fn list_vms(&self) -> Vec<VmInfo> {
        let entries: Vec<Arc<Entry>> = lock(&self.state).vms.values().cloned().collect();
        let stats = self.sched().stats();
        entries
            .iter()
            .map(|e| self.vm_info(e, Some(&stats)))
            .collect()
    }

    /// One VM.
    pub fn get_vm(&self, name: &str) -> Result<VmInfo, ManagerError> {
        let e = self.entry(name)?;
        let stats = self.sched().stats();
        Ok(self.vm_info(&e, Some(&stats)))
    }

    /// A VM's console log.
    pub fn console(&self, name: &str) -> Result<Arc<ConsoleLog>, ManagerError> {
        Ok(self.entry(name)?.handle.console())
    }

    /// A VM's console plus a way to tell when the VM stopped (for
    /// streaming: the log is closed only when the VM is freed).
    pub fn console_watch(&self, name: &str) -> Result<ConsoleWatch, ManagerError> {
        let entry = self.entry(name)?;
        Ok(ConsoleWatch {
            log: entry.handle.console(),
            entry,
        })
    }

    /// Reads the CPU time of every running VM's vCPU threads, so that the
    /// figure survives the threads (call it every second or so).
    pub fn sample_cpu(&self) {
        let entries: Vec<Arc<Entry>> = lock(&self.state).vms.values().cloned().collect();
        for e in entries {
            if e.handle.exit_reason().is_none() {
                e.cpu_ns(true);
            }
        }
        self.reap();
    }

    /// Releases the resources of every VM that has stopped on its own (guest
    /// shutdown, a fatal exit, a panicked thread, a seccomp violation):
    /// joins its threads, closes its KVM fd, gives its RAM back, releases
    /// its image locks and takes it out of the scheduler and its cgroup.
    /// Never blocks: a VM whose threads are still finishing is released on
    /// a later call. The daemon calls it twice a second (with
    /// [`Manager::sample_cpu`]).
    pub fn reap(&self) {
        let entries: Vec<Arc<Entry>> = lock(&self.state).vms.values().cloned().collect();
        for e in entries {
            self.release_entry(&e, false);
        }
    }

    pub(super) fn validate_request(&self, req: &mut VmRequest) -> Result<(), ManagerError> {
        if let Some(n) = &req.name {
            validate_name("VM name", n)?;
        }
        if req.vcpus == 0 || req.vcpus > MAX_VM_VCPUS {
            return Err(ManagerError::Invalid(format!(
                "vcpus must be in 1..={MAX_VM_VCPUS}, got {}",
                req.vcpus
            )));
        }
        if !(corral_scheduler::model::MIN_WEIGHT..=corral_scheduler::model::MAX_WEIGHT)
            .contains(&req.weight)
        {
            return Err(ManagerError::Invalid(format!(
                "weight must be in 1..=10000, got {}",
                req.weight
            )));
        }
        if req.memory_mib < crate::layout::MIN_MEMORY_MIB {
            return Err(ManagerError::Invalid(format!(
                "{} MiB of memory is too small; the minimum is {} MiB",
                req.memory_mib,
                crate::layout::MIN_MEMORY_MIB
            )));
        }
        if req.kernel.is_none() && self.cfg.builtin_kernel.is_none() {
            return Err(ManagerError::Invalid(
                "no kernel given and this daemon has no built-in guest".into(),
            ));
        }
        if req.disks.len() > MAX_DISKS {
            return Err(ManagerError::Invalid(format!(
                "at most {MAX_DISKS} disks per VM"
            )));
        }
        let mut ids = BTreeSet::new();
        for (i, d) in req.disks.iter_mut().enumerate() {
            if d.id.is_empty() {
                d.id = crate::vm::disk_name(i);
            }
            validate_name("disk id", &d.id)?;
            if !ids.insert(d.id.clone()) {
                return Err(ManagerError::Invalid(format!(
                    "two disks are named {:?}",
                    d.id
                )));
            }
            d.limits.validate()?;
            // The file itself is opened and checked when the VM starts
            // (hostfile: the path policy, file type and lock, on the fd).
        }
        Ok(())
    }

    /// Creates and starts a VM. Blocks while it starts (milliseconds).
    pub(super) fn create_vm_live(&self, mut req: VmRequest) -> Result<VmInfo, ManagerError> {
        self.validate_request(&mut req)?;
        self.reap();
        // Open (never waiting), check and lock every file first: a refused
        // file is a 400 (or a 409) whatever else is booked.
        let files = self.open_files(&req)?;
        // Reserve the name, the id, the resources and the scheduler slot.
        let booked = (|| {
            let mut st = lock(&self.state);
            if st.shutting_down {
                return Err(ManagerError::ShuttingDown);
            }
            let id = VmId(st.next_id);
            let name = match &req.name {
                Some(n) => n.clone(),
                None => {
                    let mut n = st.next_id;
                    while st.vms.contains_key(&format!("vm-{n}"))
                        || st.starting.contains_key(&format!("vm-{n}"))
                    {
                        n += 1;
                    }
                    format!("vm-{n}")
                }
            };
            if st.vms.contains_key(&name) || st.starting.contains_key(&name) {
                return Err(ManagerError::Conflict(format!(
                    "a VM named {name:?} already exists"
                )));
            }
            let live = st
                .vms
                .values()
                .filter(|e| e.handle.exit_reason().is_none())
                .count();
            if live + st.starting.len() >= self.cfg.max_vms {
                return Err(ManagerError::Refused(format!(
                    "this daemon runs at most {} VMs",
                    self.cfg.max_vms
                )));
            }
            // Stopped VMs book no resources but are objects all the same.
            let defined_max = self.cfg.max_vms.saturating_mul(4);
            if st.vms.len() + st.starting.len() >= defined_max {
                return Err(ManagerError::Refused(format!(
                    "this daemon keeps at most {defined_max} VM definitions (4 x --max-vms); delete stopped VMs"
                )));
            }
            let (vcpus, mem) = Self::usage(&st);
            if vcpus + req.vcpus > self.cfg.max_total_vcpus {
                return Err(ManagerError::Refused(format!(
                    "{} more vCPUs would exceed the daemon's limit of {} ({} in use)",
                    req.vcpus, self.cfg.max_total_vcpus, vcpus
                )));
            }
            if mem.saturating_add(req.memory_mib) > self.memory_budget_mib {
                return Err(ManagerError::Refused(format!(
                    "{} MiB more guest memory would exceed the budget of {} MiB ({} MiB in use)",
                    req.memory_mib, self.memory_budget_mib, mem
                )));
            }
            self.sched().add_vm(
                id,
                VmSpec {
                    cap: req.cap,
                    ..VmSpec::new(req.class.clone(), req.vcpus).with_weight(req.weight)
                },
            )?;
            st.next_id += 1;
            st.starting
                .insert(name.clone(), (id, req.vcpus, req.memory_mib));
            let group = st.class_groups.get(&req.class).cloned();
            Ok((id, name, group))
        })();
        let (id, name, group) = match booked {
            Ok(b) => b,
            Err(e) => {
                self.images.release(None, files.all());
                return Err(e);
            }
        };
        self.images.book(&name, files.all());
        let result = self.launch(id, &name, &req, group, &files);
        if result.is_err() {
            self.images.release(Some(&name), files.all());
        }
        let mut st = lock(&self.state);
        st.starting.remove(&name);
        match result {
            Ok((handle, cmdline)) => {
                let entry = Arc::new(Entry::new(id, name.clone(), cmdline, handle, req, false));
                st.vms.insert(name, entry.clone());
                drop(st);
                let stats = self.sched().stats();
                Ok(self.vm_info(&entry, Some(&stats)))
            }
            Err(e) => {
                let _ = self.sched().remove_vm(id);
                Err(e)
            }
        }
    }

    /// vCPUs and guest memory in use. A VM that has stopped (shut down,
    /// stopped, failed) holds neither: its threads are joined and its RAM
    /// given back ([`Manager::reap`]), though it stays listed until deleted.
    pub(super) fn usage(st: &State) -> (u32, u64) {
        let mut vcpus = 0;
        let mut mem = 0;
        for e in st.vms.values().filter(|e| e.handle.exit_reason().is_none()) {
            vcpus += e.request.vcpus;
            mem += e.request.memory_mib;
        }
        for (_, v, m) in st.starting.values() {
            vcpus += v;
            mem += m;
        }
        (vcpus, mem)
    }

    /// Stops a VM, frees it and returns its last snapshot. Blocks until its
    /// threads are gone.
    pub(super) fn delete_vm_live(&self, name: &str) -> Result<VmInfo, ManagerError> {
        let e = lock(&self.state)
            .vms
            .remove(name)
            .ok_or_else(|| ManagerError::NotFound(format!("no VM named {name:?}")))?;
        e.handle.stop();
        // Unlocked now, even if a console follower still holds the entry.
        self.release_entry(&e, true);
        tracing::info!(vm = name, "VM deleted");
        Ok(self.vm_info(&e, None))
    }

    /// Sets or removes a VM's own CPU cap (percent of one CPU), live: the
    /// gate backend's policy and the cgroup backend (`cpu.max` of the VM's
    /// group) apply it from their next tick / at once.
    pub(super) fn set_vm_cap_live(
        &self,
        name: &str,
        cap: Option<u32>,
    ) -> Result<VmInfo, ManagerError> {
        let e = {
            let st = lock(&self.state);
            let e = st
                .vms
                .get(name)
                .cloned()
                .ok_or_else(|| ManagerError::NotFound(format!("no VM named {name:?}")))?;
            self.sched().set_vm_cap(e.id, cap)?;
            e.cap.store(cap.unwrap_or(0), Ordering::Relaxed);
            if let Some(cg) = &self.cgroup
                && let Err(err) = cg.set_vm_cap(&self.cg_path(&lock(&e.class)), &e.name, cap)
            {
                tracing::warn!(vm = name, "cgroup backend: {err}");
            }
            e
        };
        tracing::info!(vm = name, cap = ?cap, "VM cap set");
        let stats = self.sched().stats();
        Ok(self.vm_info(&e, Some(&stats)))
    }

    /// Pauses a VM's vCPUs (idempotent); 409 if it has stopped.
    pub fn pause_vm(&self, name: &str) -> Result<VmInfo, ManagerError> {
        self.set_paused(name, true)
    }

    /// Resumes a paused VM (idempotent); 409 if it has stopped.
    pub fn resume_vm(&self, name: &str) -> Result<VmInfo, ManagerError> {
        self.set_paused(name, false)
    }

    /// Pauses (`pause`) or resumes a running VM's vCPUs; 409 if it has
    /// stopped. Logs only a change.
    fn set_paused(&self, name: &str, pause: bool) -> Result<VmInfo, ManagerError> {
        let e = self.entry(name)?;
        if e.handle.exit_reason().is_some() {
            return Err(ManagerError::Conflict(if pause {
                format!("VM {name:?} has stopped; only a running VM can be paused")
            } else {
                format!("VM {name:?} has stopped; it cannot be resumed")
            }));
        }
        let changed = if pause {
            e.handle.pause()
        } else {
            e.handle.resume()
        };
        if changed {
            tracing::info!(vm = name, "VM {}", if pause { "paused" } else { "resumed" });
        }
        let stats = self.sched().stats();
        Ok(self.vm_info(&e, Some(&stats)))
    }

    /// Moves a VM to another class (live), optionally with a new weight.
    pub(super) fn move_vm_live(
        &self,
        name: &str,
        class: &str,
        weight: Option<u32>,
    ) -> Result<VmInfo, ManagerError> {
        let e = {
            let st = lock(&self.state);
            let e = st
                .vms
                .get(name)
                .cloned()
                .ok_or_else(|| ManagerError::NotFound(format!("no VM named {name:?}")))?;
            let mut s = self.sched();
            if s.model().class(class).is_none() {
                return Err(ManagerError::NotFound(format!("no class named {class:?}")));
            }
            if let Some(w) = weight {
                // Validate before changing anything.
                if !(corral_scheduler::model::MIN_WEIGHT..=corral_scheduler::model::MAX_WEIGHT)
                    .contains(&w)
                {
                    return Err(ManagerError::Invalid(format!(
                        "weight must be in 1..=10000, got {w}"
                    )));
                }
            }
            let old_class = lock(&e.class).clone();
            let old_weight = e.weight.load(Ordering::Relaxed);
            s.move_vm(e.id, class)?;
            if let Some(w) = weight {
                s.set_vm_weight(e.id, w)?;
                e.weight.store(w, Ordering::Relaxed);
            }
            drop(s);
            if let Some(cg) = &self.cgroup {
                let old = lock(&e.class).clone();
                let w = e.weight.load(Ordering::Relaxed);
                let cap = Some(e.cap.load(Ordering::Relaxed)).filter(|&c| c > 0);
                if let Err(err) = self.cg_place(&self.cg_path(class), &e.name, w, cap, &e.handle) {
                    tracing::warn!(vm = name, "cgroup backend: {err}");
                } else {
                    let _ = cg.remove_vm(&self.cg_path(&old), &e.name);
                }
            }
            *lock(&e.class) = class.to_string();
            let group = st.class_groups.get(class).cloned();
            let page = st.class_pages.get(class).cloned();
            (e, group, page, old_class, old_weight)
        };
        let (e, group, page, old_class, old_weight) = e;
        let weight = e.weight.load(Ordering::Relaxed);
        if e.handle.exit_reason().is_none() {
            for d in e.handle.disks() {
                // The disks have the VM's weight in their class's group. A
                // move within the class changes it in place (each disk
                // keeps its place in line); another class's group is joined
                // with it.
                let r = if old_class != class {
                    e.handle.set_disk_group(
                        &d.name,
                        group.clone().map(|g| (g, weight)),
                        page.as_deref(),
                    )
                } else if weight != old_weight {
                    e.handle.set_disk_weight(&d.name, weight)
                } else {
                    Ok(())
                };
                if let Err(err) = r {
                    tracing::warn!(
                        vm = name,
                        disk = d.name,
                        "moving to the class's I/O group (weight {weight}): {err}"
                    );
                }
            }
        }
        tracing::info!(vm = name, class, "VM moved");
        let stats = self.sched().stats();
        Ok(self.vm_info(&e, Some(&stats)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::manager::test_manager;

    fn req(name: &str) -> VmRequest {
        VmRequest {
            name: Some(name.into()),
            ..VmRequest::default()
        }
    }

    fn kind(m: &Manager, r: VmRequest) -> ErrorKind {
        m.create_vm(r).expect_err("refused before it starts").kind()
    }

    #[test]
    fn names_are_checked() {
        let m = test_manager(|_| {});
        for bad in ["", "a/b", "a b", &"v".repeat(MAX_NAME_LEN + 1)] {
            assert_eq!(kind(&m, req(bad)), ErrorKind::Invalid, "{bad:?}");
            assert!(validate_name("VM name", bad).is_err(), "{bad:?}");
        }
        for good in ["vm-1", "a.b_c", &"v".repeat(MAX_NAME_LEN)] {
            assert!(validate_name("VM name", good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn disks_get_names_and_must_differ() {
        let m = test_manager(|_| {});
        let disk = |id: &str| DiskRequest {
            id: id.into(),
            path: "/nonexistent".into(),
            read_only: false,
            direct: false,
            engine: None,
            limits: Limits::default(),
        };
        let mut r = VmRequest {
            disks: vec![disk(""), disk("data"), disk("")],
            ..req("d")
        };
        m.validate_request(&mut r).unwrap();
        let ids: Vec<_> = r.disks.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["disk0", "data", "disk2"]);
        // One naming scheme: `corral run --disk` names unnamed disks alike.
        for (i, d) in r.disks.iter().enumerate() {
            let spec = if d.id == "data" { "/x,id=data" } else { "/x" };
            let run = crate::vm::DiskConfig::parse(spec).unwrap();
            assert_eq!(run.name(i), d.id);
        }
        let mut r = VmRequest {
            disks: vec![disk("x"), disk("x")],
            ..req("d")
        };
        assert!(m.validate_request(&mut r).is_err());
        let mut r = VmRequest {
            disks: vec![disk("bad name")],
            ..req("d")
        };
        assert!(m.validate_request(&mut r).is_err());
        let mut r = VmRequest {
            disks: (0..=MAX_DISKS).map(|i| disk(&format!("d{i}"))).collect(),
            ..req("d")
        };
        assert!(m.validate_request(&mut r).is_err());
        let mut bad = disk("lim");
        bad.limits.burst_ops = Some(4);
        let mut r = VmRequest {
            disks: vec![bad],
            ..req("d")
        };
        assert!(m.validate_request(&mut r).is_err());
    }

    #[test]
    fn requests_out_of_range_are_invalid() {
        let m = test_manager(|_| {});
        for r in [
            VmRequest {
                vcpus: 0,
                ..req("v")
            },
            VmRequest {
                vcpus: MAX_VM_VCPUS + 1,
                ..req("v")
            },
            VmRequest {
                weight: 0,
                ..req("v")
            },
            VmRequest {
                memory_mib: 1,
                ..req("v")
            },
        ] {
            assert_eq!(kind(&m, r.clone()), ErrorKind::Invalid, "{r:?}");
        }
        let m = test_manager(|c| c.builtin_kernel = None);
        assert_eq!(kind(&m, req("v")), ErrorKind::Invalid);
    }

    #[test]
    fn limits_are_refused_before_a_vm_starts() {
        let m = test_manager(|c| c.max_vms = 0);
        assert_eq!(kind(&m, req("v")), ErrorKind::Refused);
        let m = test_manager(|c| c.memory_budget_mib = Some(100));
        let e = m.create_vm(req("v")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
        assert!(e.to_string().contains("budget of 100 MiB"), "{e}");
        let m = test_manager(|c| c.max_total_vcpus = 1);
        let e = m
            .create_vm(VmRequest {
                vcpus: 2,
                ..req("v")
            })
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
        // An unknown class is the scheduler model's 404.
        let m = test_manager(|_| {});
        let e = m
            .create_vm(VmRequest {
                class: "nope".into(),
                ..req("v")
            })
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
        // Nothing was booked by the refusals.
        assert!(m.list_vms().is_empty());
        assert_eq!(Manager::usage(&lock(&m.state)), (0, 0));
        assert!(lock(&m.state).starting.is_empty());
    }

    #[test]
    fn a_shut_down_manager_refuses_new_vms() {
        let m = test_manager(|_| {});
        m.shutdown();
        assert_eq!(kind(&m, req("v")), ErrorKind::Conflict);
    }
}
