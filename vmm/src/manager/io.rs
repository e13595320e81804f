//! Disk I/O: the classes' throttle groups, live disk limits, and the
//! classes' I/O counters.

use super::*;
use corral_devices::virtio::blk::BlockStatsSnapshot;

/// Creates a class's I/O group or changes its limits live (tokens earned
/// and waiting requests are kept).
pub(super) fn set_class_group(
    st: &mut State,
    class: &str,
    io: &Limits,
) -> Result<(), ManagerError> {
    let now = crate::util::monotonic_ns();
    let limits = *io;
    match st.class_groups.get(class) {
        Some(g) => g
            .set_limits(&limits, now)
            .map_err(|e| ManagerError::Invalid(format!("class {class:?} io: {e}")))?,
        None => {
            let g = ThrottleGroup::new(format!("class:{class}"), &limits, now)
                .map_err(|e| ManagerError::Invalid(format!("class {class:?} io: {e}")))?;
            st.class_groups.insert(class.to_string(), g);
        }
    }
    Ok(())
}

impl Manager {
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
