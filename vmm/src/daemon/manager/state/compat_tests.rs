//! A state file written by the daemon before the limits types were merged
//! (`testdata/state-v1.json`: `corral serve --state-dir` of main at
//! f206f3b, after `corral class set gold --io bps=10M,burst_bytes=1M,riops=200`,
//! `corral class set bronze --parent gold ...`, `corral vm create web
//! --disk root.img,ro,id=root,bps=20M,iops=1k,burst_ops=50 --disk
//! data.img,direct,wbps=1M,wiops=100` and a stopped VM `idle`) still loads,
//! and is written back in the same form.

use super::*;
use crate::daemon::manager::{Limits, test_manager};

const FIXTURE: &str = include_str!("testdata/state-v1.json");

fn limits(s: &str) -> Limits {
    Limits::parse(s).unwrap()
}

#[test]
fn a_version_1_file_parses_into_the_one_limits_type() {
    let f = parse_state(FIXTURE.as_bytes()).unwrap();
    let gold = f.classes.iter().find(|c| c.name == "gold").unwrap();
    assert_eq!(gold.io, limits("bps=10M,riops=200,burst_bytes=1M"));
    let default = f.classes.iter().find(|c| c.name == "default").unwrap();
    assert_eq!(default.io, Limits::UNLIMITED);
    let web = f.vms.iter().find(|v| v.name == "web").unwrap();
    let (root, data) = (&web.disks[0], &web.disks[1]);
    assert_eq!(root.id, "root");
    assert!(root.read_only && !root.direct);
    assert_eq!(root.limits, limits("bps=20M,iops=1024,burst_ops=50"));
    assert_eq!(data.id, "disk1");
    assert!(!data.read_only && data.direct);
    assert_eq!(data.limits, limits("wbps=1M,wiops=100"));
    // Written back, it is the same JSON (the old daemon reads what the new
    // one writes, as long as no one-time burst is set).
    let again: serde_json::Value = serde_json::to_value(&f).unwrap();
    let old: serde_json::Value = serde_json::from_str(FIXTURE).unwrap();
    assert_eq!(again, old);
}

#[test]
fn a_version_1_file_restores_its_classes_vms_and_disk_limits() {
    let f = parse_state(FIXTURE.as_bytes()).unwrap();
    let m = test_manager(|_| {});
    let r = m.restore(&f, false).unwrap();
    assert_eq!((r.classes, r.vms, r.started), (3, 2, 0));
    assert_eq!(
        m.get_class("gold").unwrap().config.io,
        limits("bps=10M,riops=200,burst_bytes=1M")
    );
    let web = m.get_vm("web").unwrap();
    let d: Vec<_> = web.disks.iter().map(|d| &d.config).collect();
    assert_eq!(d[0].id, "root");
    assert!(d[0].read_only);
    assert_eq!(d[0].limits, limits("bps=20M,iops=1024,burst_ops=50"));
    assert_eq!(d[1].limits, limits("wbps=1M,wiops=100"));
    assert_eq!(m.get_vm("idle").unwrap().disks[0].config.id, "disk0");
}
