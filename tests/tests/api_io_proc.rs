//! A class's I/O limit is one budget for all the class's VMs when each VM
//! runs in its own process (`corral serve`'s default `--vm-mode process`):
//! the VM processes share the class group's buckets in a page the daemon
//! passes them (ARCHITECTURE.md, "Block I/O"). Two VMs of one class read as
//! fast as they can; the sum of what their devices read stays within the
//! class's limit (a copy of the group per process let each VM have the
//! whole limit: the sum was ~2×), also after a live change of the limit.
//! A VM moved to another class reads against that class's budget; after
//! a `kill -9` of the daemon, the next one re-attaches the re-adopted VM
//! processes to its own class pages. The class's group is also fair across
//! the VM processes (start tags in the page): two VMs of equal weight each
//! get half of what the class reads, within [`SPLIT`]; VMs of weights 300
//! and 100 get 3/4 and 1/4 (their disks are in the group with their VMs'
//! weights), also after a live weight change.

use std::time::{Duration, Instant};

use corral_tests::api::{Daemon, wait_until};
use serde_json::json;

/// Bytes the VM's disk `data` read for its guest (the device's counter).
fn read_bytes(metrics: &str, vm: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("corral_disk_device_bytes_total{"))
        .filter(|l| {
            l.contains(&format!("vm=\"{vm}\""))
                && l.contains("disk=\"data\"")
                && l.contains("op=\"read\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Both VMs' read rates (bytes/s) over `secs` of host time.
fn rates(d: &Daemon, secs: f64) -> (f64, f64) {
    let m0 = d.req("GET", "/metrics", None).text();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let m1 = d.req("GET", "/metrics", None).text();
    let dt = t0.elapsed().as_secs_f64();
    (
        (read_bytes(&m1, "va") - read_bytes(&m0, "va")) / dt,
        (read_bytes(&m1, "vb") - read_bytes(&m0, "vb")) / dt,
    )
}

/// The class's limit (bytes/s).
const LIMIT: f64 = 2_000_000.0;

/// How far from half of the class's reads each of two VM processes of
/// equal weight may be, as a share of their sum over a 3-s window: the
/// fairness window (2 ms of the rate) and a 64-KiB request of each are
/// 2 % of 3 s at 2 MB/s, the counters' 100-ms freshness about 3 %; the
/// rest is for a loaded host (a device thread later than 10 ms past its
/// timer loses its place in line once).
const SPLIT: f64 = 0.10;

/// Each VM's share of the sum, checked against [`SPLIT`]; printed.
fn check_split(what: &str, a: f64, b: f64) {
    check_share(what, a, b, 0.5, SPLIT);
}

/// `va`'s share of the sum within `tol` of `want`; printed.
fn check_share(what: &str, a: f64, b: f64, want: f64, tol: f64) {
    let share = a / (a + b);
    eprintln!(
        "{what}: va {a:.0} B/s + vb {b:.0} B/s = {:.0} B/s; va's share {share:.3}, vb's {:.3} (want {want:.3} +- {tol})",
        a + b,
        1.0 - share
    );
    assert!(
        (share - want).abs() <= tol,
        "{what}: va {a:.0} B/s, vb {b:.0} B/s: va's share {share:.3} not within {tol} of {want}"
    );
}

/// How far from its weighted share `va`'s share of the sum may be, over a
/// 3-s window, for two VM processes of unequal weights (the bound issue 15
/// set; [`SPLIT`] is wider for the even split on a loaded host).
const WEIGHTED_SPLIT: f64 = 0.07;

/// Classes `names` with `bps=2M` (128 KiB bucket), and VMs `va` and `vb`
/// in the first, each reading its whole 64 MiB disk 64 KiB at a time, 4 in
/// flight: far more than the limit lets through while the test runs.
fn two_readers(d: &Daemon, dir: &std::path::Path, names: &[&str]) {
    two_weighted_readers(d, dir, names, [100, 100]);
}

/// [`two_readers`] with the VMs' weights (`va`'s, `vb`'s).
fn two_weighted_readers(d: &Daemon, dir: &std::path::Path, names: &[&str], weights: [u32; 2]) {
    std::fs::create_dir_all(dir).unwrap();
    for c in names {
        let body =
            json!({"name": c, "shares": 100, "io": {"bps": LIMIT as u64, "burst_bytes": 131072}});
        let r = d.req("POST", "/v1/classes", Some(&body.to_string()));
        assert_eq!(r.status, 201, "{}", r.text());
    }
    let job = "probe.mode=blk probe.op=read probe.size=64M probe.bs=64K probe.qd=4";
    for (name, weight) in ["va", "vb"].into_iter().zip(weights) {
        let p = dir.join(format!("{name}.img"));
        std::fs::File::create(&p)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        let body = json!({
            "name": name, "class": names[0], "weight": weight, "memory_mib": 64,
            "cmdline": job, "disks": [{"id": "data", "path": p}]
        });
        let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
        assert_eq!(r.status, 201, "{}", r.text());
    }
    wait_until(Duration::from_secs(30), || {
        let m = d.req("GET", "/metrics", None).text();
        (read_bytes(&m, "va") >= 256e3 && read_bytes(&m, "vb") >= 256e3).then_some(())
    })
    .expect("both VMs reading");
}

#[test]
fn a_class_io_limit_binds_the_sum_of_its_vm_processes() {
    let d = Daemon::start(&[]);
    let dir = std::env::temp_dir().join(format!("corral-api-io-proc-{}", std::process::id()));
    let limit = LIMIT;
    two_readers(&d, &dir, &["capped"]);
    // A ceiling on a loaded host: the sum must not exceed the limit by more
    // than 10 % (the burst and the counters' 100 ms freshness are a few %);
    // one copy of the group per process gives 2×.
    let (a, b) = rates(&d, 3.0);
    eprintln!(
        "class bps=2M, two VM processes: va {a:.0} B/s + vb {b:.0} B/s = {:.0} B/s",
        a + b
    );
    assert!(
        a + b <= limit * 1.1,
        "two VM processes of one class read {:.0} B/s together, over the class's {limit} B/s",
        a + b
    );
    assert!(
        a > 0.0 && b > 0.0,
        "a VM did not read: va {a:.0}, vb {b:.0}"
    );
    check_split("bps=2M", a, b);

    // A live change reaches both VM processes: 2× the limit, and the sum
    // goes past the old one, still within the new.
    let r = d.req(
        "PATCH",
        "/v1/classes/capped",
        Some(r#"{"io":{"bps":4000000,"burst_bytes":131072}}"#),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    std::thread::sleep(Duration::from_millis(300));
    let (a, b) = rates(&d, 3.0);
    eprintln!(
        "after PATCH bps=4M: va {a:.0} + vb {b:.0} = {:.0} B/s",
        a + b
    );
    assert!(
        a + b <= 2.0 * limit * 1.1,
        "{:.0} B/s over the new limit",
        a + b
    );
    assert!(
        a + b > limit * 1.2,
        "{:.0} B/s: the new limit did not reach the VM processes",
        a + b
    );
    check_split("bps=4M", a, b);
    for vm in ["va", "vb"] {
        d.req("DELETE", &format!("/v1/vms/{vm}"), None);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_moved_vm_switches_group_and_a_readopted_one_rejoins_its_class() {
    let base = std::env::temp_dir().join(format!("corral-api-io-move-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let sd = base.join("state");
    let sd = sd.to_str().unwrap();
    let d = Daemon::start(&["--state-dir", sd]);
    two_readers(&d, &base.join("img"), &["capped", "other"]);
    // vb moves to `other`: each class's budget is its own, so together they
    // read past one limit (each within its class's).
    let r = d.req("POST", "/v1/vms/vb/move", Some(r#"{"class":"other"}"#));
    assert_eq!(r.status, 200, "{}", r.text());
    std::thread::sleep(Duration::from_millis(300));
    let (a, b) = rates(&d, 3.0);
    eprintln!("vb moved to another bps=2M class: va {a:.0} + vb {b:.0} B/s");
    assert!(
        a <= LIMIT * 1.1 && b <= LIMIT * 1.1,
        "over a class's limit: va {a:.0}, vb {b:.0} B/s"
    );
    assert!(
        a + b > LIMIT * 1.3,
        "{:.0} B/s: the moved VM still reads against its old class",
        a + b
    );
    // kill -9 of the daemon; the next one re-adopts both VM processes and
    // attaches them to its own pages: vb moved back into `capped` shares
    // one budget with va again (were va still on the dead daemon's page,
    // they would read 2× together).
    let d = kill9_and_readopt(d, sd);
    let r = d.req("POST", "/v1/vms/vb/move", Some(r#"{"class":"capped"}"#));
    assert_eq!(r.status, 200, "{}", r.text());
    std::thread::sleep(Duration::from_millis(300));
    let (a, b) = rates(&d, 3.0);
    eprintln!(
        "re-adopted, vb back in capped: va {a:.0} + vb {b:.0} = {:.0} B/s",
        a + b
    );
    assert!(
        a + b <= LIMIT * 1.1,
        "{:.0} B/s: the re-adopted VM processes do not share their class's budget",
        a + b
    );
    assert!(
        a > 0.0 && b > 0.0,
        "a VM did not read: va {a:.0}, vb {b:.0}"
    );
    check_split("re-adopted", a, b);
    remove_both(d, &base);
}

/// The class's I/O is shared among its VMs by their weights, as its CPU:
/// each VM's disks are in the class's group with the VM's weight, in every
/// VM process (the start tags they publish in the class's page are
/// weighted). VMs of weights 300 and 100 in a `bps=2M` class, both reading
/// flat out, split it 3:1; after a live weight change (`vb` moved within
/// its class with weight 900: its disk keeps its place in the group, at
/// the new weight), 1:3; after a `kill -9` of the daemon, the next one
/// re-attaches the re-adopted VM processes to its page with their weights:
/// 1:3 still. Before, every disk joined at weight 100: 1:1 every time.
#[test]
fn vm_weights_split_a_class_io_limit_across_vm_processes() {
    let base = std::env::temp_dir().join(format!("corral-api-io-weight-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let sd = base.join("state");
    let sd = sd.to_str().unwrap();
    let d = Daemon::start(&["--state-dir", sd]);
    weighted_split(&d, &base.join("img"), "process");
    let d = kill9_and_readopt(d, sd);
    wait_until(Duration::from_secs(5), || {
        (disk_weight(&d, "va") == 300 && disk_weight(&d, "vb") == 900).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "re-adopted: disk weights {} and {}",
            disk_weight(&d, "va"),
            disk_weight(&d, "vb")
        )
    });
    std::thread::sleep(Duration::from_millis(300));
    let (a, b) = rates(&d, 3.0);
    check_share(
        "process, re-adopted, weights 300/900",
        a,
        b,
        0.25,
        WEIGHTED_SPLIT,
    );
    remove_both(d, &base);
}

/// The same split with the VMs as threads of the daemon (`--vm-mode
/// thread`): their disks share the class's in-process group, weighted
/// alike.
#[test]
fn vm_weights_split_a_class_io_limit_in_the_daemon_too() {
    let d = Daemon::start(&["--vm-mode", "thread"]);
    let dir = std::env::temp_dir().join(format!("corral-api-io-wthread-{}", std::process::id()));
    weighted_split(&d, &dir, "thread");
    for vm in ["va", "vb"] {
        d.req("DELETE", &format!("/v1/vms/{vm}"), None);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A VM's disk's weight in its group, as the API shows it.
fn disk_weight(d: &Daemon, vm: &str) -> serde_json::Value {
    d.req("GET", &format!("/v1/vms/{vm}"), None).json()["disks"][0]["group_weight"].clone()
}

/// `va` (weight 300) and `vb` (100) read flat out in class `wclass`
/// (`bps=2M`): 3:1; `vb` moved within its class with weight 900: 1:3.
fn weighted_split(d: &Daemon, dir: &std::path::Path, mode: &str) {
    two_weighted_readers(d, dir, &["wclass"], [300, 100]);
    assert_eq!(disk_weight(d, "va"), 300);
    assert_eq!(disk_weight(d, "vb"), 100);
    let (a, b) = rates(d, 3.0);
    assert!(
        a + b <= LIMIT * 1.1,
        "{:.0} B/s over the class's limit",
        a + b
    );
    check_share(
        &format!("{mode}, weights 300/100, bps=2M"),
        a,
        b,
        0.75,
        WEIGHTED_SPLIT,
    );
    let r = d.req(
        "POST",
        "/v1/vms/vb/move",
        Some(r#"{"class":"wclass","weight":900}"#),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    wait_until(Duration::from_secs(5), || {
        (disk_weight(d, "vb") == 900).then_some(())
    })
    .unwrap_or_else(|| panic!("vb's disk weight: {}", disk_weight(d, "vb")));
    std::thread::sleep(Duration::from_millis(300));
    let (a, b) = rates(d, 3.0);
    check_share(
        &format!("{mode}, weights 300/900 (live), bps=2M"),
        a,
        b,
        0.25,
        WEIGHTED_SPLIT,
    );
}

/// `kill -9` of the daemon `d` (state directory `sd`) and a new one on the
/// same state: both VM processes, `va` and `vb`, are re-adopted running.
fn kill9_and_readopt(mut d: Daemon, sd: &str) -> Daemon {
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    drop(d);
    let d = Daemon::start(&["--state-dir", sd]);
    for vm in ["va", "vb"] {
        let v = d.req("GET", &format!("/v1/vms/{vm}"), None).json();
        assert_eq!(v["state"], "running", "{v}");
    }
    d
}

/// Deletes `va` and `vb`, stops the daemon and removes the test's `base`.
fn remove_both(d: Daemon, base: &std::path::Path) {
    for vm in ["va", "vb"] {
        d.req("DELETE", &format!("/v1/vms/{vm}"), None);
    }
    drop(d);
    let _ = std::fs::remove_dir_all(base);
}
