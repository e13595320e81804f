//! A restarted daemon and the VM processes of the last one: each VM of the
//! state file with a process record is re-adopted by its control socket
//! (identity: name and nonce) and booked again (scheduler, images), or
//! listed with how its process ended. VM processes the state does not name
//! are stopped.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::state::StateFile;
use super::{CpuBackend, Entry, Manager, VmRun, lock};
use crate::handle::VmHandle;
use crate::vmproc::adopt::{Adopted, adopt, stop_strays};
use corral_scheduler::VmSpec;

impl Manager {
    /// Re-adopts the VM processes of `file`'s VMs (their entries are
    /// defined, not running, when this is called); returns the names of
    /// those adopted.
    pub(super) fn readopt(&self, file: &StateFile) -> BTreeSet<String> {
        let mut adopted = BTreeSet::new();
        // Running, but of another protocol version: not adopted, not strays.
        let mut refused = Vec::new();
        let (Some(p), Some(dir)) = (&self.cfg.vm_processes, &self.cfg.state_dir) else {
            return adopted;
        };
        let t0 = std::time::Instant::now();
        let todo: Vec<_> = file
            .vms
            .iter()
            .filter_map(|v| {
                let rec = v.process.as_ref()?;
                let old = lock(&self.state).vms.get(&v.name).cloned()?;
                Some((v, rec, old))
            })
            .collect();
        // The handshakes (connect, status, files, adopt: four round trips
        // with a VM process, each a wake-up of its threads) in parallel;
        // the booking below is serial and cheap.
        // CORRAL_ADOPT_WORKERS: for measuring (1 = one after the other).
        let workers = std::env::var("CORRAL_ADOPT_WORKERS")
            .ok()
            .and_then(|w| w.parse().ok())
            .filter(|&w| w > 0)
            .unwrap_or(ADOPT_WORKERS);
        let results = parallel_map(&todo, workers, |(v, rec, _)| {
            adopt(
                dir,
                &v.name,
                &rec.nonce,
                rec.pid,
                self.cfg.console_log_bytes,
                &p.launcher,
            )
        });
        let handshakes = t0.elapsed();
        for ((v, _, old), adopted_as) in todo.into_iter().zip(results) {
            let Some(adopted_as) = adopted_as else {
                continue;
            };
            let run = match adopted_as {
                Adopted::Running(vm, files) => {
                    let spec = VmSpec {
                        cap: old.request.cap,
                        ..VmSpec::new(old.request.class.clone(), old.request.vcpus)
                            .with_weight(old.request.weight)
                    };
                    if let Err(e) = self.sched().add_vm(old.id, spec) {
                        tracing::warn!(vm = v.name, "re-adopted VM does not fit: stopping it: {e}");
                        vm.join();
                        continue;
                    }
                    self.images.book(&v.name, files.iter());
                    self.attach_class_io(
                        &vm,
                        &old.request.class,
                        old.request.weight,
                        &old.request.disks,
                    );
                    self.cg_readopt(&v.name, &old.request, &vm);
                    // The gate the VM process gave back, owned again; it
                    // runs unsupervised, its gate open, without one.
                    match vm.take_sched_gate() {
                        Some(gate) if self.cfg.cpu_backend == CpuBackend::Gate => {
                            self.attach_process(old.id, &vm, gate, old.request.vcpus as usize);
                        }
                        None if self.cfg.cpu_backend == CpuBackend::Gate => {
                            tracing::warn!(
                                vm = v.name,
                                "no scheduler gate: its shares are not enforced"
                            );
                        }
                        _ => {}
                    }
                    adopted.insert(v.name.clone());
                    tracing::info!(vm = v.name, pid = vm.pid(), "VM process re-adopted");
                    VmRun::Remote(vm)
                }
                Adopted::Gone(reason) => {
                    tracing::warn!(vm = v.name, "its VM process is gone: {reason}");
                    match VmHandle::defined(&v.name, reason) {
                        Ok(h) => VmRun::Local(h),
                        Err(_) => continue,
                    }
                }
                // Shown `failed` with the reason (`not_adopted`), and the
                // state keeps its process record (`state.rs`).
                Adopted::Refused(reason) => {
                    refused.push(v.name.clone());
                    match VmHandle::defined(&v.name, reason) {
                        Ok(h) => VmRun::Local(h),
                        Err(_) => continue,
                    }
                }
            };
            let reaped = !matches!(run, VmRun::Remote(_));
            let entry = Entry::new(
                old.id,
                v.name.clone(),
                old.cmdline.clone(),
                run,
                old.request.clone(),
                reaped,
            );
            lock(&self.state)
                .vms
                .insert(v.name.clone(), Arc::new(entry));
        }
        let known: Vec<String> = adopted.iter().cloned().chain(refused).collect();
        let strays = stop_strays(dir, &known);
        tracing::info!(
            adopted = adopted.len(),
            strays,
            workers,
            handshakes_ms = handshakes.as_secs_f64() * 1e3,
            ms = t0.elapsed().as_secs_f64() * 1e3,
            "VM processes of the last daemon re-adopted"
        );
        adopted
    }
}

/// How many VM processes are adopted at once.
const ADOPT_WORKERS: usize = 8;

/// `f` of each item, on up to `workers` threads; results in item order
/// (`None` only if a worker died, which the scope then reports).
fn parallel_map<T: Sync, R: Send>(
    items: &[T],
    workers: usize,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<Option<R>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let out: Vec<std::sync::Mutex<Option<R>>> =
        items.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..workers.min(items.len()) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(i) else { return };
                    let r = f(item);
                    if let Some(slot) = out.get(i) {
                        *lock(slot) = Some(r);
                    }
                }
            });
        }
    });
    out.into_iter()
        .map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()))
        .collect()
}
