//! `/metrics`: the manager's figures in the OpenMetrics/Prometheus text
//! format, through `prometheus-client` (a fresh registry per scrape, filled
//! from one snapshot, so every value of a scrape is consistent).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use corral_vmm::manager::{Manager, VmState};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, String)>;
type CounterF = Family<Labels, Counter<f64, AtomicU64>>;
type GaugeF = Family<Labels, Gauge<f64, AtomicU64>>;

/// A histogram whose buckets come from a snapshot (the throttle's own
/// histogram), encoded as is.
#[derive(Debug, Clone, Default)]
struct ConstHistogram(Arc<Mutex<HistSnapshot>>);

/// (sum, count, per-bucket (upper bound, count)).
type HistSnapshot = (f64, u64, Vec<(f64, u64)>);

impl ConstHistogram {
    fn set(&self, sum: f64, count: u64, buckets: Vec<(f64, u64)>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = (sum, count, buckets);
    }
}

impl TypedMetric for ConstHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for ConstHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        encoder.encode_histogram::<NoLabelSet>(g.0, g.1, &g.2, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

struct Reg(Registry);

impl Reg {
    fn counter(&mut self, name: &str, help: &str) -> CounterF {
        let f = CounterF::default();
        self.0.register(name, help, f.clone());
        f
    }

    fn plain_gauge(&mut self, name: &str, help: &str, v: f64) {
        let g = Gauge::<f64, AtomicU64>::default();
        g.set(v);
        self.0.register(name, help, g);
    }

    fn plain_counter(&mut self, name: &str, help: &str, v: f64) {
        let c = Counter::<f64, AtomicU64>::default();
        c.inc_by(v);
        self.0.register(name, help, c);
    }

    fn gauge(&mut self, name: &str, help: &str) -> GaugeF {
        let f = GaugeF::default();
        self.0.register(name, help, f.clone());
        f
    }
}

fn l(pairs: &[(&'static str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

/// Renders all metrics.
pub fn render(m: &Manager) -> String {
    let host = m.host();
    let vms = m.list_vms();
    let classes = m.list_classes();
    let mut r = Reg(Registry::default());

    // Host.
    r.plain_gauge(
        "corral_capacity_percent",
        "CPU capacity the daemon hands out, percent of one host CPU",
        host.capacity_pct as f64,
    );
    r.plain_gauge(
        "corral_reserved_percent",
        "Sum of class CPU reservations, percent of one host CPU",
        host.reserved_pct as f64,
    );
    let vm_count = r.gauge("corral_vms", "VMs hosted, by state");
    for st in ["running", "paused", "shutdown", "stopped", "failed"] {
        let n = vms.iter().filter(|v| v.state.as_str() == st).count();
        vm_count.get_or_create(&l(&[("state", st)])).set(n as f64);
    }
    r.plain_counter(
        "corral_scheduler_ticks",
        "Scheduler ticks run (0 while no scheduler thread runs)",
        host.sched_ticks as f64,
    );
    r.plain_gauge(
        "corral_guest_memory_bytes",
        "Guest memory of all hosted VMs",
        (host.memory_mib << 20) as f64,
    );

    // VMs.
    let cpu = r.counter("corral_vm_cpu_seconds", "CPU time of the VM's vCPU threads");
    let up = r.gauge("corral_vm_up", "1 while the VM's vCPUs run, else 0");
    let vcpus = r.gauge("corral_vm_vcpus", "vCPUs of the VM");
    let memory = r.gauge("corral_vm_memory_bytes", "Guest memory of the VM");
    let uptime = r.gauge("corral_vm_uptime_seconds", "Time since the VM started");
    let exits = r.counter("corral_vm_exits", "vCPU exits to the VMM, by reason");
    let ent = r.gauge(
        "corral_vm_cpu_entitlement_percent",
        "CPU the scheduler entitles the VM to, percent of one host CPU",
    );
    let used = r.gauge(
        "corral_vm_cpu_used_percent",
        "CPU the VM used over the last accounting period, percent of one host CPU",
    );
    let parked = r.counter(
        "corral_vm_parked_seconds",
        "Time the scheduler held the VM's vCPUs off the CPU",
    );
    let parks = r.counter("corral_vm_parks", "Times the scheduler parked the VM");
    for v in &vms {
        let base = l(&[("vm", &v.name), ("class", &v.class)]);
        cpu.get_or_create(&base).inc_by(v.cpu_secs);
        up.get_or_create(&base)
            .set(f64::from(u8::from(v.state == VmState::Running)));
        vcpus.get_or_create(&base).set(f64::from(v.vcpus));
        memory.get_or_create(&base).set((v.memory_mib << 20) as f64);
        if let Some(u) = v.uptime {
            uptime.get_or_create(&base).set(u.as_secs_f64());
        }
        for (reason, n) in &v.exits {
            let mut lbl = base.clone();
            lbl.push(("reason", reason.to_string()));
            exits.get_or_create(&lbl).inc_by(*n as f64);
        }
        if let Some(s) = &v.sched {
            ent.get_or_create(&base).set(s.entitlement_pct);
            used.get_or_create(&base).set(s.used_pct);
            parked.get_or_create(&base).inc_by(s.parked_secs);
            parks.get_or_create(&base).inc_by(s.park_count as f64);
        }
    }

    // Classes.
    let ccpu = r.counter(
        "corral_class_cpu_seconds",
        "CPU time of the vCPU threads of the class's current VMs",
    );
    let shares = r.gauge("corral_class_shares", "CPU shares of the class");
    let cap = r.gauge(
        "corral_class_cap_percent",
        "CPU cap of the class, percent of one host CPU (absent: no cap)",
    );
    let resv = r.gauge(
        "corral_class_reservation_percent",
        "CPU reservation of the class, percent of one host CPU",
    );
    let cvms = r.gauge("corral_class_vms", "VMs in the class");
    let cent = r.gauge(
        "corral_class_cpu_entitlement_percent",
        "CPU the scheduler entitles the class to, percent of one host CPU",
    );
    let cused = r.gauge(
        "corral_class_cpu_used_percent",
        "CPU the class used over the last accounting period, percent of one host CPU",
    );
    for c in &classes {
        let base = l(&[("class", &c.name)]);
        ccpu.get_or_create(&base).inc_by(c.cpu_secs);
        shares
            .get_or_create(&base)
            .set(f64::from(c.config.cpu.shares));
        if let Some(v) = c.config.cpu.cap {
            cap.get_or_create(&base).set(f64::from(v));
        }
        resv.get_or_create(&base)
            .set(f64::from(c.config.cpu.reservation.unwrap_or(0)));
        cvms.get_or_create(&base).set(c.vms.len() as f64);
        if let Some(e) = c.entitlement_pct {
            cent.get_or_create(&base).set(e);
        }
        if let Some(u) = c.used_pct {
            cused.get_or_create(&base).set(u);
        }
    }
    // Disks.
    let dops = r.counter("corral_disk_ops", "Disk requests admitted, by op");
    let dbytes = r.counter("corral_disk_bytes", "Disk bytes admitted, by op");
    let dthr = r.counter(
        "corral_disk_throttled_requests",
        "Disk requests that waited for tokens",
    );
    let dthrs = r.counter(
        "corral_disk_throttled_seconds",
        "Time disk requests spent waiting for tokens",
    );
    let dq = r.gauge(
        "corral_disk_queue_depth",
        "Disk requests queued in the throttle",
    );
    let dlim = r.gauge(
        "corral_disk_limit",
        "Configured disk limit, by kind (bps, iops, rbps, wbps, riops, wiops)",
    );
    let dlat = Family::<Labels, ConstHistogram>::default();
    r.0.register(
        "corral_disk_request_duration_seconds",
        "Disk request latency, by op",
        dlat.clone(),
    );
    for v in &vms {
        for d in &v.disks {
            let base = l(&[("vm", &v.name), ("disk", &d.config.id)]);
            let lim = d.config.limits;
            for (k, val) in [
                ("bps", lim.bps),
                ("iops", lim.iops),
                ("rbps", lim.rbps),
                ("wbps", lim.wbps),
                ("riops", lim.riops),
                ("wiops", lim.wiops),
            ] {
                if let Some(x) = val {
                    let mut lb = base.clone();
                    lb.push(("kind", k.to_string()));
                    dlim.get_or_create(&lb).set(x as f64);
                }
            }
            let Some(s) = &d.stats else { continue };
            for (op, o) in [("read", &s.read), ("write", &s.write), ("other", &s.other)] {
                let mut lb = base.clone();
                lb.push(("op", op.to_string()));
                dops.get_or_create(&lb).inc_by(o.ops as f64);
                dbytes.get_or_create(&lb).inc_by(o.bytes as f64);
                if o.latency.count() == 0 {
                    continue;
                }
                dlat.get_or_create(&lb).set(
                    o.latency.sum_seconds(),
                    o.latency.count(),
                    o.latency.buckets().collect(),
                );
            }
            dthr.get_or_create(&base)
                .inc_by(s.throttled_requests as f64);
            dthrs.get_or_create(&base).inc_by(s.throttled_seconds());
            dq.get_or_create(&base).set(s.queue_depth as f64);
        }
    }

    // Class I/O groups (one throttle group per class, shared by its disks).
    let gops = r.counter(
        "corral_group_ops",
        "Requests admitted by a class's I/O group, by op",
    );
    let gbytes = r.counter(
        "corral_group_bytes",
        "Bytes admitted by a class's I/O group, by op",
    );
    let gthr = r.counter(
        "corral_group_throttled_requests",
        "Requests that waited for the group's tokens",
    );
    let gthrs = r.counter(
        "corral_group_throttled_seconds",
        "Time requests spent waiting for the group's tokens",
    );
    let gq = r.gauge("corral_group_queue_depth", "Requests queued in the group");
    let glat = Family::<Labels, ConstHistogram>::default();
    r.0.register(
        "corral_group_request_duration_seconds",
        "Request latency of the group's disks, by op",
        glat.clone(),
    );
    for (class, s) in m.class_io_stats() {
        let group = format!("class:{class}");
        let base = l(&[("class", &class), ("group", &group)]);
        for (op, o) in [("read", &s.read), ("write", &s.write), ("other", &s.other)] {
            let mut lb = base.clone();
            lb.push(("op", op.to_string()));
            gops.get_or_create(&lb).inc_by(o.ops as f64);
            gbytes.get_or_create(&lb).inc_by(o.bytes as f64);
            if o.latency.count() > 0 {
                glat.get_or_create(&lb).set(
                    o.latency.sum_seconds(),
                    o.latency.count(),
                    o.latency.buckets().collect(),
                );
            }
        }
        gthr.get_or_create(&base)
            .inc_by(s.throttled_requests as f64);
        gthrs.get_or_create(&base).inc_by(s.throttled_seconds());
        gq.get_or_create(&base).set(s.queue_depth as f64);
    }

    let mut out = String::with_capacity(16 * 1024);
    if encode(&mut out, &r.0).is_err() {
        out.clear();
    }
    out
}
