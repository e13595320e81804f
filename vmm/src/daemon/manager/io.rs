//! Disk I/O: the classes' throttle groups, live disk limits, and the
//! classes' I/O counters.

use super::*;
use corral_devices::virtio::blk::BlockStatsSnapshot;

/// Creates a class's I/O group or changes its limits live (tokens earned
/// and waiting requests are kept). With VM processes (`shared`) the group's
/// buckets are in a page ([`crate::iopage`]) that every VM process of the
/// class maps: one budget for all of them (ARCHITECTURE.md, "Block I/O").
pub(super) fn set_class_group(
    st: &mut State,
    class: &str,
    io: &Limits,
    shared: bool,
) -> Result<(), ManagerError> {
    let now = crate::util::monotonic_ns();
    let limits = *io;
    let bad = |e: String| ManagerError::Invalid(format!("class {class:?} io: {e}"));
    match st.class_groups.get(class) {
        Some(g) => g.set_limits(&limits, now).map_err(|e| bad(e.to_string()))?,
        None => {
            let name = format!("class:{class}");
            limits.validate().map_err(|e| bad(e.to_string()))?;
            let page = if shared {
                crate::iopage::IoPage::create()
                    .map_err(|e| e.to_string())
                    .and_then(|(p, fd)| {
                        ThrottleGroup::new_shared(name.clone(), &limits, now, p)
                            .map(|g| (g, fd))
                            .map_err(|e| e.to_string())
                    })
                    .inspect_err(|e| {
                        tracing::warn!(
                            class,
                            "I/O group page: {e}: each VM process of the class gets its own copy of the class's I/O limits"
                        )
                    })
                    .ok()
            } else {
                None
            };
            let g = match page {
                Some((g, fd)) => {
                    st.class_pages.insert(class.to_string(), Arc::new(fd));
                    g
                }
                None => ThrottleGroup::new(name, &limits, now).map_err(|e| bad(e.to_string()))?,
            };
            st.class_groups.insert(class.to_string(), g);
        }
    }
    Ok(())
}

impl Manager {
    /// Whether class groups are shared with VM processes.
    pub(super) fn shared_groups(&self) -> bool {
        self.cfg.vm_processes.is_some()
    }

    /// After a class's `io` changed: the VM processes of the class get the
    /// new limits as their own bound (the shared page has them already).
    pub(super) fn push_class_io(&self, class: &str, limits: Limits) {
        let entries: Vec<Arc<Entry>> = lock(&self.state)
            .vms
            .values()
            .filter(|e| *lock(&e.class) == class)
            .cloned()
            .collect();
        let name = format!("class:{class}");
        for e in entries {
            if e.handle.exit_reason().is_some() {
                continue;
            }
            if let Err(err) = e.handle.set_group_limits(&name, limits) {
                tracing::warn!(vm = e.name, class, "class io limits: {err}");
            }
        }
    }

    /// Puts every disk of VM process `vm` (of `class`, with `weight`) in
    /// the class's group over the class's page: at its start the daemon
    /// passes the page with its configuration; a re-adopted VM process gets
    /// this daemon's page here (its old one belonged to the last daemon).
    pub(super) fn attach_class_io(
        &self,
        vm: &crate::vmproc::remote::RemoteVm,
        class: &str,
        weight: u32,
        disks: &[DiskRequest],
    ) {
        if disks.is_empty() {
            return;
        }
        let (group, page) = {
            let st = lock(&self.state);
            (
                st.class_groups.get(class).cloned(),
                st.class_pages.get(class).cloned(),
            )
        };
        let Some(group) = group else { return };
        for d in disks {
            let g = Some((group.clone(), weight));
            if let Err(e) = vm.set_disk_group(&d.id, g, page.as_deref()) {
                tracing::warn!(vm = vm.name(), disk = d.id, "class I/O group: {e}");
            }
        }
    }

    /// Changes a disk's limits live.
    pub(super) fn set_disk_limits_live(
        &self,
        name: &str,
        disk: &str,
        limits: Limits,
    ) -> Result<DiskInfo, ManagerError> {
        limits.validate()?;
        let e = self.entry(name)?;
        if !lock(&e.disks).iter().any(|d| d.config.id == disk) {
            return Err(ManagerError::NotFound(format!(
                "VM {name:?} has no disk {disk:?}"
            )));
        }
        if e.handle.exit_reason().is_some() {
            return Err(VmError::Stopped(name.to_string()).into());
        }
        // The device thread swaps the limits between two requests and
        // answers once applied.
        e.handle.set_disk_limits(disk, limits)?;
        {
            let mut disks = lock(&e.disks);
            if let Some(d) = disks.iter_mut().find(|d| d.config.id == disk) {
                d.config.limits = limits;
            }
        }
        tracing::info!(vm = name, disk, "disk limits changed");
        e.disks_now()
            .into_iter()
            .find(|d| d.config.id == disk)
            .ok_or_else(|| ManagerError::NotFound(format!("VM {name:?} has no disk {disk:?}")))
    }

    /// Each VM's disks' device counters (completed requests, I/O errors,
    /// malformed requests, broken rings, ...): (VM, disk, counters), by VM
    /// name. Read from what the devices publish, without their locks.
    pub fn disk_device_stats(&self) -> Vec<(String, String, BlockStatsSnapshot)> {
        let entries: Vec<Arc<Entry>> = lock(&self.state).vms.values().cloned().collect();
        entries
            .iter()
            .flat_map(|e| {
                e.handle
                    .disks()
                    .into_iter()
                    .map(|d| (e.name.clone(), d.name, d.device))
            })
            .collect()
    }

    /// Each class's I/O group counters (ops, bytes, throttling, latency).
    pub fn class_io_stats(&self) -> Vec<(String, corral_blkthrottle::Stats)> {
        lock(&self.state)
            .class_groups
            .iter()
            .map(|(c, g)| (c.clone(), g.stats()))
            .collect()
    }
}
