//! `/metrics`: the manager's figures through `prometheus-client`, in the
//! Prometheus text format 0.0.4 or, by `Accept` negotiation, OpenMetrics
//! 1.0 (see [`expo`]). A fresh registry per scrape, filled from one
//! snapshot, so every value of a scrape is consistent; series sorted by
//! labels, so scrapes list them in the same order.
//!
//! Units are base units in the name: seconds, bytes, and CPU amounts as
//! `_ratio` of one host CPU (1 = one CPU, 1.5 = one and a half; the API's
//! percent figures divided by 100). Counts are integer counters.

mod disk;
pub mod expo;
pub mod http;
pub mod process;

use corral_vmm::manager::{CpuBackend, Limits, Manager, VmState};

use expo::{Format, Gauges, Hists, Labels, Reg, l, with};

/// Both limit families of one set of I/O limits: rates by op
/// (`all` = the combined limit), and the burst sizes.
struct LimitFams {
    bytes: Gauges,
    ops: Gauges,
    burst_bytes: Gauges,
    burst_ops: Gauges,
}

impl LimitFams {
    fn new(r: &mut Reg, prefix: &str, what: &str) -> Self {
        Self {
            bytes: r.gauges(
                &format!("{prefix}_limit_bytes_per_second"),
                &format!("{what} byte rate limit, by op (all = reads and writes together)"),
            ),
            ops: r.gauges(
                &format!("{prefix}_limit_ops_per_second"),
                &format!("{what} request rate limit, by op (all = reads and writes together)"),
            ),
            burst_bytes: r.gauges(
                &format!("{prefix}_limit_burst_bytes"),
                &format!("{what} byte bucket size (burst)"),
            ),
            burst_ops: r.gauges(
                &format!("{prefix}_limit_burst_ops"),
                &format!("{what} request bucket size (burst)"),
            ),
        }
    }

    fn set(&self, base: &Labels, lim: &Limits) {
        for (fam, op, v) in [
            (&self.bytes, "all", lim.bps),
            (&self.bytes, "read", lim.rbps),
            (&self.bytes, "write", lim.wbps),
            (&self.ops, "all", lim.iops),
            (&self.ops, "read", lim.riops),
            (&self.ops, "write", lim.wiops),
        ] {
            if let Some(v) = v {
                fam.set(with(base, "op", op), v as f64);
            }
        }
        if let Some(v) = lim.burst_bytes {
            self.burst_bytes.set(base.clone(), v as f64);
        }
        if let Some(v) = lim.burst_ops {
            self.burst_ops.set(base.clone(), v as f64);
        }
    }
}

/// The I/O counter families of a disk or a group.
struct IoFams {
    ops: expo::Counts,
    bytes: expo::Counts,
    throttled: expo::Counts,
    throttled_secs: expo::Amounts,
    queue: expo::Ints,
    latency: Hists,
}

impl IoFams {
    fn new(r: &mut Reg, prefix: &str, what: &str) -> Self {
        Self {
            ops: r.counts(
                &format!("{prefix}_ops"),
                &format!("Requests admitted by the {what}, by op"),
            ),
            bytes: r.counts(
                &format!("{prefix}_bytes"),
                &format!("Bytes admitted by the {what}, by op"),
            ),
            throttled: r.counts(
                &format!("{prefix}_throttled_requests"),
                &format!("Requests that waited for the {what}'s tokens"),
            ),
            throttled_secs: r.amounts(
                &format!("{prefix}_throttled_seconds"),
                &format!("Time requests spent waiting for the {what}'s tokens"),
            ),
            queue: r.ints(
                &format!("{prefix}_queue_depth"),
                &format!("Requests queued in the {what}'s throttle"),
            ),
            latency: r.hists(
                &format!("{prefix}_request_duration_seconds"),
                &format!("Request latency in the {what}, by op"),
            ),
        }
    }

    fn set(&self, base: &Labels, s: &corral_blkthrottle::Stats) {
        for (op, o) in [("read", &s.read), ("write", &s.write), ("other", &s.other)] {
            let lb = with(base, "op", op);
            self.ops.set(lb.clone(), o.ops);
            self.bytes.set(lb.clone(), o.bytes);
            if o.latency.count() > 0 {
                self.latency.put(
                    lb,
                    expo::ConstHistogram::new(
                        o.latency.sum_seconds(),
                        o.latency.count(),
                        o.latency.buckets(),
                    ),
                );
            }
        }
        self.throttled.set(base.clone(), s.throttled_requests);
        self.throttled_secs.set(base.clone(), s.throttled_seconds());
        self.queue.set(base.clone(), s.queue_depth);
    }
}

fn backend_name(b: CpuBackend) -> &'static str {
    match b {
        CpuBackend::Gate => "gate",
        CpuBackend::Cgroup => "cgroup",
        CpuBackend::None => "none",
    }
}

/// CPU percent of one host CPU as a ratio.
fn ratio(pct: f64) -> f64 {
    pct / 100.0
}

/// Renders all metrics in `format`.
pub fn render(m: &Manager, format: Format) -> String {
    let host = m.host();
    let vms = m.list_vms();
    let classes = m.list_classes();
    let mut r = Reg::default();

    // Daemon and host.
    r.ints(
        "corral_build_info",
        "Always 1; the labels tell the corral version, build profile and CPU backend",
    )
    .set(
        l(&[
            ("version", env!("CARGO_PKG_VERSION")),
            (
                "profile",
                if cfg!(debug_assertions) {
                    "debug"
                } else {
                    "release"
                },
            ),
            ("cpu_backend", backend_name(m.cpu_backend())),
        ]),
        1,
    );
    process::register(&mut r);
    http::register(&mut r);
    r.gauge(
        "corral_cpu_capacity_ratio",
        "CPU capacity the daemon hands out, in host CPUs (1 = one CPU)",
        ratio(host.capacity_pct as f64),
    );
    r.gauge(
        "corral_cpu_reserved_ratio",
        "Sum of the classes' CPU reservations, in host CPUs",
        ratio(host.reserved_pct as f64),
    );
    r.gauge(
        "corral_cpu_available_ratio",
        "CPU the scheduler plans with: capacity less steal and the load of other processes, in host CPUs",
        ratio(host.available_pct),
    );
    r.gauge(
        "corral_cpu_outside_load_ratio",
        "CPU used by everything but corral's VMs (averaged over ~1 s), in host CPUs",
        ratio(host.outside_pct),
    );
    r.gauge(
        "corral_capacity_shortfall_ratio",
        "Fraction of the reservations claimed now that the available CPU cannot deliver (0 = all honoured)",
        host.shortfall_ratio,
    );
    let vm_count = r.ints("corral_vms", "VMs hosted, by state");
    for st in ["running", "paused", "shutdown", "stopped", "failed"] {
        let n = vms.iter().filter(|v| v.state.as_str() == st).count();
        vm_count.set(l(&[("state", st)]), n as u64);
    }
    r.int(
        "corral_vms_max",
        "Most VMs the daemon admits",
        host.max_vms as u64,
    );
    r.count(
        "corral_scheduler_ticks",
        "Scheduler ticks run (0 while no scheduler thread runs)",
        host.sched_ticks,
    );
    r.int(
        "corral_guest_memory_bytes",
        "Guest memory of all hosted VMs",
        host.memory_mib << 20,
    );
    r.int(
        "corral_guest_memory_budget_bytes",
        "Guest memory the daemon admits in all",
        host.memory_budget_mib << 20,
    );

    // VMs.
    let cpu = r.amounts("corral_vm_cpu_seconds", "CPU time of the VM's vCPU threads");
    let up = r.ints("corral_vm_up", "1 while the VM's vCPUs run, else 0");
    let vcpus = r.ints("corral_vm_vcpus", "vCPUs of the VM");
    let memory = r.ints("corral_vm_memory_bytes", "Guest memory of the VM");
    let uptime = r.gauges("corral_vm_uptime_seconds", "Time since the VM started");
    let exits = r.counts("corral_vm_exits", "vCPU exits to the VMM, by reason");
    let ent = r.gauges(
        "corral_vm_cpu_entitlement_ratio",
        "CPU the scheduler entitles the VM to, in host CPUs",
    );
    let used = r.gauges(
        "corral_vm_cpu_used_ratio",
        "CPU the VM used over the last accounting period, in host CPUs",
    );
    let parked = r.amounts(
        "corral_vm_parked_seconds",
        "Time the scheduler held the VM's vCPUs off the CPU",
    );
    let parks = r.counts("corral_vm_parks", "Times the scheduler parked the VM");
    for v in &vms {
        let base = l(&[("vm", &v.name), ("class", &v.class)]);
        cpu.set(base.clone(), v.cpu_secs);
        up.set(base.clone(), u64::from(v.state == VmState::Running));
        vcpus.set(base.clone(), u64::from(v.vcpus));
        memory.set(base.clone(), v.memory_mib << 20);
        if let Some(u) = v.uptime {
            uptime.set(base.clone(), u.as_secs_f64());
        }
        for (reason, n) in &v.exits {
            exits.set(with(&base, "reason", reason), *n);
        }
        if let Some(s) = &v.sched {
            ent.set(base.clone(), ratio(s.entitlement_pct));
            used.set(base.clone(), ratio(s.used_pct));
            parked.set(base.clone(), s.parked_secs);
            parks.set(base.clone(), s.park_count);
        }
    }

    // Guest-caused device errors (each also logged, rate-limited).
    let gerr = r.counts(
        "corral_guest_errors",
        "Guest-caused device errors (malformed requests, broken rings, bad registers, ...), by device and kind",
    );
    for v in &vms {
        for (device, kind, n) in &v.guest_errors {
            gerr.set(
                l(&[("vm", &v.name), ("device", device), ("kind", kind)]),
                *n,
            );
        }
    }

    // Classes.
    let ccpu = r.amounts(
        "corral_class_cpu_seconds",
        "CPU time of the class's current VMs (drops when a VM leaves the class)",
    );
    let shares = r.ints("corral_class_shares", "CPU shares of the class");
    let cap = r.gauges(
        "corral_class_cpu_cap_ratio",
        "CPU cap of the class, in host CPUs (absent: no cap)",
    );
    let resv = r.gauges(
        "corral_class_cpu_reservation_ratio",
        "CPU reservation of the class, in host CPUs",
    );
    let cvms = r.ints("corral_class_vms", "VMs in the class");
    let cent = r.gauges(
        "corral_class_cpu_entitlement_ratio",
        "CPU the scheduler entitles the class to, in host CPUs",
    );
    let cused = r.gauges(
        "corral_class_cpu_used_ratio",
        "CPU the class used over the last accounting period, in host CPUs",
    );
    let ctree = r.ints(
        "corral_class_info",
        "Always 1; the `parent` label names the class's parent in the class tree (empty for a root class)",
    );
    let climits = LimitFams::new(&mut r, "corral_class_io", "Class I/O group");
    for c in &classes {
        let base = l(&[("class", &c.name)]);
        ctree.set(
            l(&[
                ("class", &c.name),
                ("parent", c.parent.as_deref().unwrap_or("")),
            ]),
            1,
        );
        ccpu.set(base.clone(), c.cpu_secs);
        shares.set(base.clone(), u64::from(c.config.cpu.shares));
        if let Some(v) = c.config.cpu.cap {
            cap.set(base.clone(), ratio(f64::from(v)));
        }
        resv.set(
            base.clone(),
            ratio(f64::from(c.config.cpu.reservation.unwrap_or(0))),
        );
        cvms.set(base.clone(), c.vms.len() as u64);
        if let Some(e) = c.entitlement_pct {
            cent.set(base.clone(), ratio(e));
        }
        if let Some(u) = c.used_pct {
            cused.set(base.clone(), ratio(u));
        }
        climits.set(&base, &c.config.io);
    }

    // Disks.
    let dio = IoFams::new(&mut r, "corral_disk", "disk");
    let dlimits = LimitFams::new(&mut r, "corral_disk", "Disk");
    let dsize = r.ints("corral_disk_capacity_bytes", "Size of the disk");
    for v in &vms {
        for d in &v.disks {
            let base = l(&[("vm", &v.name), ("disk", &d.config.id)]);
            dlimits.set(&base, &d.config.limits);
            dsize.set(base.clone(), d.capacity_bytes);
            if let Some(s) = &d.stats {
                dio.set(&base, s);
            }
        }
    }

    disk::register(&mut r, m);

    // Class I/O groups (one throttle group per class, shared by its disks).
    let gio = IoFams::new(&mut r, "corral_group", "class's I/O group");
    for (class, s) in m.class_io_stats() {
        let group = format!("class:{class}");
        gio.set(&l(&[("class", &class), ("group", &group)]), &s);
    }

    r.encode(format)
}
