//! virtio-blk end to end: the probe guest's driver against corral's device,
//! through `corral run --disk`.

use std::time::Duration;

use corral_tests::vms::num;
use corral_tests::{Running, run_corral, text};

const T: Duration = Duration::from_secs(120);

fn tmpdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("corral-blk-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn disk(dir: &std::path::Path, name: &str, mib: u64) -> String {
    let p = dir.join(name);
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(mib << 20).unwrap();
    p.to_str().unwrap().to_string()
}

fn result_line(out: &str) -> String {
    out.lines()
        .rfind(|l| l.starts_with("PROBE-RESULT mode=blk"))
        .unwrap_or_else(|| panic!("no blk result:\n{out}"))
        .to_string()
}

#[test]
fn verify_one_disk() {
    let d = tmpdir("one");
    let a = disk(&d, "a.img", 16);
    let o = run_corral(
        &[
            "run",
            "--memory",
            "64",
            "--disk",
            &a,
            "--cmdline",
            "probe.mode=blk probe.op=verify probe.size=8M probe.bs=64K probe.qd=8",
        ],
        T,
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let r = result_line(&out);
    assert_eq!(num(&r, "errors"), 0, "{r}");
    assert_eq!(num(&r, "mismatches"), 0, "{r}");
    assert!(num(&r, "bytes") >= 8 << 20, "{r}");
    assert!(out.contains("PROBE-DONE status=ok"), "{out}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn verify_two_disks() {
    let d = tmpdir("two");
    let a = disk(&d, "a.img", 8);
    let b = disk(&d, "b.img", 8);
    for (i, seed) in [(0, 7), (1, 9)] {
        let cmd = format!(
            "probe.mode=blk probe.op=verify probe.disk={i} probe.size=4M probe.bs=128K probe.qd=4 probe.seed={seed}"
        );
        let o = run_corral(
            &[
                "run",
                "--memory",
                "64",
                "--disk",
                &a,
                "--disk",
                &b,
                "--cmdline",
                &cmd,
            ],
            T,
        );
        let (out, err) = text(&o);
        assert!(o.status.success(), "disk {i}: {out}\n{err}");
        let r = result_line(&out);
        assert_eq!(num(&r, "disk"), i, "{r}");
        assert_eq!(num(&r, "errors"), 0, "{r}");
        assert_eq!(num(&r, "mismatches"), 0, "{r}");
    }
    // The two disks hold different data: each got its own writes.
    let x = std::fs::read(&a).unwrap();
    let y = std::fs::read(&b).unwrap();
    assert_ne!(x[..4 << 20], y[..4 << 20]);
    assert!(x[..4 << 20].iter().any(|b| *b != 0));
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn readonly_disk_refuses_writes() {
    let d = tmpdir("ro");
    let a = disk(&d, "a.img", 8);
    let spec = format!("{a},readonly");
    let o = run_corral(
        &[
            "run",
            "--memory",
            "64",
            "--disk",
            &spec,
            "--cmdline",
            "probe.mode=blk probe.op=write probe.size=1M probe.bs=64K",
        ],
        T,
    );
    let (out, _) = text(&o);
    let r = result_line(&out);
    assert!(
        num(&r, "errors") > 0,
        "writes to a read-only disk must fail: {r}"
    );
    assert!(out.contains("PROBE-DONE status=error"), "{out}");
    assert!(
        std::fs::read(&a).unwrap().iter().all(|b| *b == 0),
        "the read-only disk was modified"
    );
    // Reads still work.
    let o = run_corral(
        &[
            "run",
            "--memory",
            "64",
            "--disk",
            &spec,
            "--cmdline",
            "probe.mode=blk probe.op=read probe.size=1M probe.bs=64K",
        ],
        T,
    );
    let (out, _) = text(&o);
    assert_eq!(num(&result_line(&out), "errors"), 0, "{out}");
    std::fs::remove_dir_all(&d).ok();
}

/// The probe's verify pattern (guest-images/probe/src/virtio_blk.c).
fn pattern_sector(seed: u64, sector: u64) -> Vec<u8> {
    fn splitmix(x: &mut u64) -> u64 {
        *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    let mut x = seed;
    let pat: Vec<u64> = (0..128).map(|_| splitmix(&mut x)).collect();
    let h0 = splitmix(&mut x);
    let h1 = splitmix(&mut x);
    let mut w = vec![sector ^ h0, h1];
    let start = 2 + (sector & 63) as usize;
    w.extend_from_slice(&pat[start..start + 62]);
    w.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A flushed write survives SIGKILL of the VMM, on both engines, through
/// the page cache and with O_DIRECT.
#[test]
fn flushed_writes_survive_sigkill() {
    for (engine, direct) in [
        ("sync", ""),
        ("uring", ""),
        ("uring", ",direct"),
        ("sync", ",direct"),
    ] {
        flushed_writes_survive_sigkill_on(engine, direct);
    }
}

fn flushed_writes_survive_sigkill_on(engine: &str, direct: &str) {
    let d = tmpdir(&format!(
        "durable-{engine}{}",
        direct.trim_start_matches(',')
    ));
    let a = disk(&d, "a.img", 8);
    let spec = format!("{a}{direct},engine={engine}");
    let mut r = Running::start(&[
        "run",
        "--memory",
        "64",
        "--disk",
        &spec,
        "--cmdline",
        "probe.mode=blk probe.op=verify probe.size=2M probe.bs=64K probe.qd=8 probe.flush=1 probe.seed=42",
    ]);
    let line = r.wait_for("PROBE-RESULT mode=blk", T);
    assert!(line.is_some(), "{spec}: {:?}", r.seen);
    let line = line.unwrap();
    assert_eq!(num(&line, "errors"), 0, "{spec}: {line}");
    // SIGKILL: no clean shutdown, no chance to write anything more.
    r.signal(libc::SIGKILL);
    let _ = r.child.wait();
    let data = std::fs::read(&a).unwrap();
    for s in [0u64, 1, 63, 64, 1000, 4095] {
        let off = (s * 512) as usize;
        assert_eq!(
            &data[off..off + 512],
            &pattern_sector(42, s)[..],
            "{spec}: sector {s} is not what the guest wrote and flushed"
        );
    }
    std::fs::remove_dir_all(&d).ok();
}

/// `engine=` per disk in the API; `GET /v1/vms/{name}` reports the engine
/// serving each disk (the default: uring for a `direct` disk where the
/// kernel has io_uring, sync for a buffered one).
#[test]
fn engine_is_chosen_per_disk_and_reported() {
    use corral_tests::api::{Daemon, wait_until};
    let d = Daemon::start(&[]);
    let imgs: Vec<_> = (0..4).map(|i| d.image_path(&format!("e{i}.img"))).collect();
    for img in &imgs {
        std::fs::write(img, vec![0u8; 1 << 20]).unwrap();
    }
    let body = serde_json::json!({
        "name": "eng", "memory_mib": 64,
        "cmdline": "probe.mode=blk probe.op=verify probe.size=256K probe.bs=4K probe.qd=4",
        "disks": [
            {"id": "s", "path": imgs[0], "engine": "sync"},
            {"id": "u", "path": imgs[1], "engine": "uring"},
            {"id": "dflt", "path": imgs[2]},
            {"id": "dflt-direct", "path": imgs[3], "direct": true}
        ]
    });
    let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
    assert_eq!(r.status, 201, "{}", r.text());
    let v = wait_until(T, || {
        let v = d.req("GET", "/v1/vms/eng", None).json();
        v["disks"][0]["stats"].is_object().then_some(v)
    })
    .expect("disks attached");
    let engines: Vec<_> = (0..4).map(|i| v["disks"][i]["engine"].clone()).collect();
    let uring = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .map_or(true, |v| v.trim() == "0");
    let direct_default = if uring { "uring" } else { "sync" };
    assert_eq!(engines, ["sync", "uring", "sync", direct_default], "{v}");
    let bad = serde_json::json!({
        "name": "eng2", "disks": [{"path": imgs[0], "engine": "aio"}]
    });
    let r = d.req("POST", "/v1/vms", Some(&bad.to_string()));
    assert_eq!(r.status, 400, "{}", r.text());
}

#[test]
fn bad_disk_arguments_are_refused() {
    let d = tmpdir("bad");
    let a = disk(&d, "a.img", 1);
    for (spec, want) in [
        (format!("{a},bogus"), "unknown disk flag"),
        (format!("{a},bps=12q"), "bps"),
        ("/nonexistent/disk.img".to_string(), "No such file"),
        (d.to_str().unwrap().to_string(), "directory"),
        (format!("{a},burst_bytes=1M"), "burst"),
        (format!("{a},engine=aio"), "unknown disk engine"),
    ] {
        let o = run_corral(&["run", "--disk", &spec], T);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{spec}: {out}{err}");
        assert!(err.contains(want), "{spec}: want {want:?} in {err}");
        assert!(out.is_empty());
    }
    std::fs::remove_dir_all(&d).ok();
}

/// Whether an exclusive OFD lock on `path` is free right now (the lock a
/// writable disk takes; never waits).
fn exclusive_lock_is_free(path: &str) -> bool {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    // SAFETY: a zeroed flock is a valid value of the C struct.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    // SAFETY: F_OFD_SETLK with a valid flock on our own open fd.
    unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &fl) == 0 }
}

/// A VM with a uring disk leaves its image unlocked when its process has
/// exited, so it can be started again at once. With the disk's fd
/// registered with the ring (`IORING_REGISTER_FILES`), the ring's teardown
/// in a kernel worker after the exit held the file, and with it the lock,
/// for up to 23 ms: 4 of 5 back-to-back restarts were refused with "in use
/// by another VM or process".
#[test]
fn the_image_lock_is_free_as_soon_as_a_uring_vm_exits() {
    let uring = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .map_or(true, |v| v.trim() == "0");
    if !uring {
        eprintln!("SKIP: io_uring is disabled on this host (kernel.io_uring_disabled)");
        return;
    }
    let d = tmpdir("relock");
    let a = disk(&d, "a.img", 8);
    for (i, direct) in ["", ",direct", "", ",direct", "", ",direct", "", ""]
        .iter()
        .enumerate()
    {
        let spec = format!("{a}{direct},engine=uring");
        let o = run_corral(
            &[
                "run",
                "--memory",
                "32",
                "--disk",
                &spec,
                "--cmdline",
                "probe.mode=blk probe.op=write probe.size=1M probe.bs=4K probe.qd=4",
            ],
            T,
        );
        let (out, err) = text(&o);
        assert!(o.status.success(), "run {i} ({spec}): {out}\n{err}");
        assert!(
            exclusive_lock_is_free(&a),
            "run {i} ({spec}): the image is still locked after its VM process exited"
        );
    }
    std::fs::remove_dir_all(&d).ok();
}
