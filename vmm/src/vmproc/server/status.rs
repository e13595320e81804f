//! What the VM process says about itself: its [`Status`] (the answer to
//! `Started` and `status`) and its counters ([`Stats`]: disks, vCPU exits,
//! guest errors), read from the VM's atomics.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use super::VmProcess;
use crate::vmproc::proto::{Stats, Status, WireDisk};

impl VmProcess {
    pub(super) fn status(&self) -> Status {
        let h = &self.handle;
        Status {
            name: h.name().to_string(),
            nonce: self.nonce.clone(),
            pid: std::process::id(),
            paused: h.is_paused(),
            parked: self.sched_gate.as_ref().is_some_and(|(g, _)| g.is_parked()),
            unsupervised: !self.supervised.load(Ordering::Acquire),
            exit: h.exit_reason(),
            vcpu_tids: h.vcpu_tids().to_vec(),
            device_tid: h.device_tid(),
            uptime_secs: h.uptime().as_secs_f64(),
        }
    }

    pub(super) fn stats(&self) -> Stats {
        let h = &self.handle;
        let mut exits: BTreeMap<&'static str, u64> = BTreeMap::new();
        for s in h.vcpu_stats() {
            for (k, v) in s.snapshot() {
                *exits.entry(k).or_default() += v;
            }
        }
        Stats {
            disks: h
                .disks()
                .into_iter()
                .map(|d| WireDisk {
                    name: d.name,
                    path: d.path,
                    read_only: d.read_only,
                    direct: d.direct,
                    capacity_bytes: d.capacity_bytes,
                    limits: d.limits.into(),
                    group: d.group,
                    group_weight: d.group_weight,
                    stats: (&d.stats).into(),
                    device: d.device,
                    engine: crate::vmproc::proto::engine_name(d.engine),
                })
                .collect(),
            exits: exits.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            guest_errors: h
                .guest_errors()
                .into_iter()
                .map(|(d, k, n)| (d, k.to_string(), n))
                .collect(),
            unknown_accesses: h.unknown_accesses(),
        }
    }
}
