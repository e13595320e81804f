//! Issue 11, the host-file half: what a client of `corral serve` (root) can
//! make it open. Each test reproduces an attack through the real binary:
//! root-only files as initrd or disk (directly, by symlink, by `..`), block
//! devices, FIFOs that used to hang the API, two writers on one image, and
//! the resource defaults (memory budget, class count).

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use corral_tests::api::Daemon;
use corral_tests::{run_corral, text};
use serde_json::json;

/// A private tree: `images/` (the daemon's only image directory) and
/// `outside/` (root-only files a client must not reach).
struct Tree {
    root: PathBuf,
    images: PathBuf,
    outside: PathBuf,
}

impl Tree {
    fn new(tag: &str) -> Self {
        let root =
            std::env::temp_dir().join(format!("corral-secpaths-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let images = root.join("images");
        let outside = root.join("outside");
        std::fs::create_dir_all(&images).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        Tree {
            root,
            images,
            outside,
        }
    }

    /// A root-owned 0600 file outside the image directory.
    fn secret(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.outside.join(name);
        std::fs::write(&p, bytes).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        p
    }

    fn daemon(&self, extra: &[&str]) -> Daemon {
        let mut args = vec!["--image-dir", self.images.to_str().unwrap()];
        args.extend_from_slice(extra);
        Daemon::start(&args)
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: mkfifo(3) with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

fn assert_no_vms(d: &Daemon) {
    let st = d.req("GET", "/v1/status", None).json();
    assert_eq!(st["vms"], 0, "{st}");
    assert_eq!(st["memory_mib"], 0, "{st}");
    assert_eq!(d.req("GET", "/v1/vms", None).json(), json!([]));
}

/// The exploit: `"initrd": "/etc/shadow"` (the guest could copy it
/// to its console). Then the same file by a symlink inside the image
/// directory, by `..`, and as a disk.
#[test]
fn root_only_files_cannot_be_initrd_or_disk() {
    let t = Tree::new("shadow");
    let target = if Path::new("/etc/shadow").exists() {
        PathBuf::from("/etc/shadow")
    } else {
        t.secret("shadow", b"root:$6$secret:19000:0:99999:7:::\n")
    };
    std::os::unix::fs::symlink(&target, t.images.join("shadow-link")).unwrap();
    let d = t.daemon(&[]);
    let dotdot = format!(
        "{}/{}{}",
        s(&t.images),
        "../".repeat(t.images.components().count()),
        s(&target).trim_start_matches('/')
    );
    let create = |body: serde_json::Value| d.req("POST", "/v1/vms", Some(&body.to_string()));
    for (what, path) in [
        ("outside", s(&target).to_string()),
        ("symlink", s(&t.images.join("shadow-link")).to_string()),
        ("dotdot", dotdot.clone()),
        (
            "relative dotdot",
            format!("../../../../../../..{}", s(&target)),
        ),
    ] {
        let r = create(json!({"name": "thief", "memory_mib": 32, "initrd": path}));
        let msg = r.assert_error(400, "path_policy");
        assert!(msg.contains("initrd"), "{what}: {msg}");
        let r = create(json!({"name": "thief", "memory_mib": 32,
            "disks": [{"path": path, "readonly": true}]}));
        r.assert_error(400, "path_policy");
        eprintln!("{what}: {msg}");
    }
    let msg = create(json!({"name": "thief", "memory_mib": 32, "initrd": s(&target)}))
        .assert_error(400, "path_policy");
    assert!(msg.contains("--image-dir"), "names the rule: {msg}");
    let msg = create(
        json!({"name": "thief", "memory_mib": 32, "initrd": s(&t.images.join("shadow-link"))}),
    )
    .assert_error(400, "path_policy");
    assert!(msg.contains("symbolic link"), "{msg}");
    assert_no_vms(&d);
}

/// The probe in blk fill mode overwrote a root-owned 0600 file attached as
/// a disk. Now it is refused and the file is unchanged.
#[test]
fn root_only_file_outside_as_disk_is_untouched() {
    let t = Tree::new("fill");
    let before: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    let secret = t.secret("secret.img", &before);
    let d = t.daemon(&[]);
    let body = json!({"name": "filler", "memory_mib": 32,
        "cmdline": "probe.mode=blk probe.op=fill probe.size=1048576",
        "disks": [{"path": s(&secret)}]});
    let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
    let msg = r.assert_error(400, "path_policy");
    assert!(msg.contains("disk"), "{msg}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        std::fs::read(&secret).unwrap() == before,
        "the root-only file changed"
    );
    let m = std::fs::metadata(&secret).unwrap();
    assert_eq!(m.mode() & 0o777, 0o600);
    assert_no_vms(&d);
}

/// A block device beneath the image directory is refused unless the daemon
/// runs with `--allow-block-devices`.
#[test]
fn block_devices_need_the_flag() {
    let t = Tree::new("blk");
    let backing = t.outside.join("backing.img");
    std::fs::write(&backing, vec![7u8; 4 << 20]).unwrap();
    let out = std::process::Command::new("losetup")
        .args(["-f", "--show", s(&backing)])
        .output();
    let dev = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        other => {
            eprintln!(
                "SKIP: no loop device available (losetup: {other:?}); block-device refusal untested"
            );
            return;
        }
    };
    struct Detach(String);
    impl Drop for Detach {
        fn drop(&mut self) {
            let _ = std::process::Command::new("losetup")
                .args(["-d", &self.0])
                .status();
        }
    }
    let _detach = Detach(dev.clone());
    let rdev = std::fs::metadata(&dev).unwrap().rdev();
    assert!(
        std::fs::metadata(&dev)
            .unwrap()
            .file_type()
            .is_block_device()
    );
    let node = t.images.join("blk");
    let c = std::ffi::CString::new(s(&node)).unwrap();
    // SAFETY: mknod(2) with a valid NUL-terminated path; we are root.
    let r = unsafe { libc::mknod(c.as_ptr(), libc::S_IFBLK | 0o600, rdev) };
    assert_eq!(r, 0, "mknod");
    let body = json!({"name": "b", "memory_mib": 32, "disks": [{"path": s(&node)}]}).to_string();
    {
        let d = t.daemon(&[]);
        let msg = d
            .req("POST", "/v1/vms", Some(&body))
            .assert_error(400, "path_policy");
        assert!(msg.contains("--allow-block-devices"), "{msg}");
        // The device itself is outside the image directory.
        let direct = json!({"name": "b", "memory_mib": 32, "disks": [{"path": dev}]}).to_string();
        d.req("POST", "/v1/vms", Some(&direct))
            .assert_error(400, "path_policy");
        assert_no_vms(&d);
    }
    let d = t.daemon(&["--allow-block-devices"]);
    let r = d.req("POST", "/v1/vms", Some(&body));
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(
        r.json()["disks"][0]["capacity_bytes"],
        4 << 20,
        "{}",
        r.text()
    );
    assert_eq!(d.req("DELETE", "/v1/vms/b", None).status, 204);
}

/// 128 creates with a FIFO as the kernel hung `/v1/status`, `/v1/vms` and
/// `/metrics`, booked memory for VMs nobody could see, and made the daemon
/// ignore SIGTERM. Now each is a fast 400, the API answers throughout, the
/// budget is whole afterwards and SIGTERM stops the daemon at once.
#[test]
fn fifos_are_refused_at_once_and_nothing_blocks() {
    let t = Tree::new("fifo");
    let fifo = t.images.join("fifo");
    mkfifo(&fifo);
    let mut d = t.daemon(&["--memory-budget", "256"]);
    let fifo_s = s(&fifo).to_string();
    for body in [
        json!({"name": "f", "memory_mib": 128, "kernel": fifo_s}),
        json!({"name": "f", "memory_mib": 128, "initrd": fifo_s}),
        json!({"name": "f", "memory_mib": 128, "disks": [{"path": fifo_s}]}),
        json!({"name": "f", "memory_mib": 128, "disks": [{"path": fifo_s, "readonly": true}]}),
    ] {
        let t0 = Instant::now();
        let (tx, rx) = mpsc::channel();
        let sock = d.socket.clone();
        let b = body.to_string();
        std::thread::spawn(move || {
            let r = corral_tests::api::Conn::new(&sock).req("POST", "/v1/vms", Some(&b));
            let _ = tx.send(r);
        });
        let r = rx
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_else(|_| panic!("create with a FIFO hangs: {body}"));
        let msg = r.assert_error(400, "path_policy");
        assert!(msg.contains("FIFO"), "{msg}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }
    // The case: 128 at once, while the API keeps answering.
    const N: usize = 128;
    let (tx, rx) = mpsc::channel();
    for i in 0..N {
        let sock = d.socket.clone();
        let tx = tx.clone();
        let body =
            json!({"name": format!("f{i}"), "memory_mib": 128, "kernel": fifo_s}).to_string();
        std::thread::spawn(move || {
            let r = corral_tests::api::Conn::new(&sock).req("POST", "/v1/vms", Some(&body));
            let _ = tx.send(r.status);
        });
    }
    drop(tx);
    let t0 = Instant::now();
    let mut statuses = Vec::new();
    let mut probes = 0;
    while statuses.len() < N {
        // Each probe must answer within 2 s while the creates are in flight.
        for path in ["/v1/status", "/v1/vms", "/metrics"] {
            let (ptx, prx) = mpsc::channel();
            let sock = d.socket.clone();
            std::thread::spawn(move || {
                let _ = ptx.send(corral_tests::api::Conn::new(&sock).req("GET", path, None));
            });
            let r = prx
                .recv_timeout(Duration::from_secs(2))
                .unwrap_or_else(|_| panic!("GET {path} hangs during the FIFO creates"));
            assert_eq!(r.status, 200, "{path}: {}", r.text());
            probes += 1;
        }
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(st) => statuses.push(st),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        statuses.extend(rx.try_iter());
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "only {} of {N} FIFO creates answered in 20 s",
            statuses.len()
        );
    }
    assert_eq!(statuses.len(), N);
    assert!(statuses.iter().all(|s| *s == 400), "{statuses:?}");
    eprintln!(
        "{N} FIFO creates refused in {:?}, {probes} API probes answered meanwhile",
        t0.elapsed()
    );
    // Nothing stayed booked: the whole budget (256 MiB) is usable.
    assert_no_vms(&d);
    for n in ["a", "b"] {
        let body = json!({"name": n, "memory_mib": 128,
            "cmdline": "probe.mode=spin probe.secs=30 probe.interval_ms=500"});
        let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
        assert_eq!(r.status, 201, "{}", r.text());
    }
    assert_eq!(d.req("GET", "/v1/status", None).json()["memory_mib"], 256);
    // SIGTERM stops the daemon and its VMs within seconds.
    let t1 = Instant::now();
    let st = d.terminate(Duration::from_secs(5));
    assert!(st.is_some(), "the daemon ignored SIGTERM for 5 s");
    eprintln!("stopped on SIGTERM in {:?}", t1.elapsed());
}

/// Two VMs on one read-write image could corrupt it. Now: one writer or
/// many readers, the 409 names the holder, `corral run` is held off too,
/// and deleting the VM releases the lock.
#[test]
fn one_writer_or_many_readers_per_image() {
    let t = Tree::new("lock");
    let img = t.images.join("disk.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let d = t.daemon(&[]);
    let vm = |name: &str, read_only: bool| {
        let body = json!({"name": name, "memory_mib": 32,
            "cmdline": "probe.mode=spin probe.secs=30 probe.interval_ms=500",
            "disks": [{"path": s(&img), "readonly": read_only}]});
        d.req("POST", "/v1/vms", Some(&body.to_string()))
    };
    assert_eq!(vm("w1", false).status, 201);
    let msg = vm("w2", false).assert_error(409, "image_locked");
    assert!(msg.contains("\"w1\""), "names the holder: {msg}");
    let msg = vm("r1", true).assert_error(409, "image_locked");
    assert!(msg.contains("\"w1\""), "{msg}");
    // As a kernel (shared lock) too.
    let body = json!({"name": "k", "memory_mib": 32, "kernel": s(&img)});
    d.req("POST", "/v1/vms", Some(&body.to_string()))
        .assert_error(409, "image_locked");
    // Another process (`corral run`) takes the same locks.
    let o = run_corral(
        &["run", "--memory", "32", "--disk", s(&img)],
        Duration::from_secs(20),
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("in use"), "{err}");
    // Failed creates booked nothing.
    assert_eq!(d.req("GET", "/v1/status", None).json()["memory_mib"], 32);
    // Deleting the writer releases the image: readers may share it.
    assert_eq!(d.req("DELETE", "/v1/vms/w1", None).status, 204);
    assert_eq!(vm("r1", true).status, 201);
    assert_eq!(vm("r2", true).status, 201);
    let msg = vm("w3", false).assert_error(409, "image_locked");
    assert!(msg.contains("\"r1\"") || msg.contains("\"r2\""), "{msg}");
    assert_eq!(d.req("DELETE", "/v1/vms/r1", None).status, 204);
    assert_eq!(d.req("DELETE", "/v1/vms/r2", None).status, 204);
    assert_eq!(vm("w3", false).status, 201);
    assert_eq!(d.req("DELETE", "/v1/vms/w3", None).status, 204);
}

/// The default memory budget was 100 % of host RAM; it now leaves the
/// host 10 % of it or 1 GiB, whichever is larger.
#[test]
fn default_memory_budget_leaves_the_host_room() {
    let t = Tree::new("mem");
    let d = t.daemon(&[]);
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let total_mib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap()
        / 1024;
    let budget = d.req("GET", "/v1/status", None).json()["memory_budget_mib"]
        .as_u64()
        .unwrap();
    let keep = (total_mib / 10).max(1024);
    assert_eq!(
        budget,
        total_mib.saturating_sub(keep),
        "host {total_mib} MiB"
    );
    assert!(total_mib - budget >= 1024 && total_mib - budget >= total_mib / 10);
}

/// 10k classes took 25 s and nothing bounded them: `--max-classes`
/// (default 1024) refuses more with 422.
#[test]
fn class_count_is_bounded() {
    let t = Tree::new("classes");
    let d = t.daemon(&["--max-classes", "4"]);
    let mut c = d.conn();
    let class = |n: &str| json!({"name": n, "shares": 10}).to_string();
    for n in ["c1", "c2"] {
        assert_eq!(c.req("POST", "/v1/classes", Some(&class(n))).status, 201);
    }
    let put = json!({"shares": 20}).to_string();
    assert_eq!(c.req("PUT", "/v1/classes/c3", Some(&put)).status, 201);
    let msg = c
        .req("POST", "/v1/classes", Some(&class("c4")))
        .assert_error(422, "refused");
    assert!(msg.contains("--max-classes"), "{msg}");
    c.req("PUT", "/v1/classes/c5", Some(&put))
        .assert_error(422, "refused");
    // Changing an existing class is not creating one.
    assert_eq!(c.req("PUT", "/v1/classes/c1", Some(&put)).status, 200);
    assert_eq!(c.req("DELETE", "/v1/classes/c2", None).status, 204);
    assert_eq!(c.req("POST", "/v1/classes", Some(&class("c4"))).status, 201);
    drop(c);

    // The default: 1024 classes, `default` included.
    let d = t.daemon(&[]);
    let mut c = d.conn();
    let t0 = Instant::now();
    for i in 1..1024 {
        let r = c.req("POST", "/v1/classes", Some(&class(&format!("k{i}"))));
        assert_eq!(r.status, 201, "class {i}: {}", r.text());
    }
    let took = t0.elapsed();
    eprintln!("1023 class creations took {took:?}");
    c.req("POST", "/v1/classes", Some(&class("one-too-many")))
        .assert_error(422, "refused");
    assert_eq!(
        c.req("GET", "/v1/classes", None)
            .json()
            .as_array()
            .unwrap()
            .len(),
        1024
    );
}

/// A start that fails after the booking (a file that opens but is no
/// kernel, an initrd larger than guest memory) frees the memory, the name
/// and the image locks: the same VM is created right after.
#[test]
fn failed_starts_free_what_they_booked() {
    let t = Tree::new("failed");
    let junk = t.images.join("junk");
    std::fs::write(&junk, b"this is not a kernel").unwrap();
    let big = t.images.join("big.initrd");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let img = t.images.join("disk.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let d = t.daemon(&["--memory-budget", "64"]);
    let disk = json!([{"path": s(&img)}]);
    for (what, body) in [
        (
            "junk kernel",
            json!({"name": "v", "memory_mib": 64, "kernel": s(&junk), "disks": disk}),
        ),
        (
            "initrd too big",
            json!({"name": "v", "memory_mib": 64, "initrd": s(&big), "disks": disk}),
        ),
    ] {
        let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
        assert_eq!(r.status, 400, "{what}: {}", r.text());
        assert_no_vms(&d);
    }
    // Name, all 64 MiB of the budget and the disk's lock are free.
    let body = json!({"name": "v", "memory_mib": 64,
        "cmdline": "probe.mode=spin probe.secs=30 probe.interval_ms=500", "disks": disk});
    let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(d.req("DELETE", "/v1/vms/v", None).status, 204);
}

/// `corral run` is not limited to image directories, but its opens do not
/// wait on a FIFO either.
#[test]
fn corral_run_refuses_a_fifo_at_once() {
    let t = Tree::new("runfifo");
    let fifo = t.outside.join("fifo");
    mkfifo(&fifo);
    for args in [
        vec!["run", "--kernel", s(&fifo)],
        vec!["run", "--initrd", s(&fifo)],
        vec!["run", "--disk", s(&fifo)],
    ] {
        let t0 = Instant::now();
        let o = run_corral(&args, Duration::from_secs(10));
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("FIFO"), "{args:?}: {err}");
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "{args:?}: {:?}",
            t0.elapsed()
        );
    }
}
