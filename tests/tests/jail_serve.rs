//! `corral serve` jails each `corral vmm` (issue 15 item 2): the VM
//! process runs as a uid of `--jail-uids`, with no capabilities and
//! `no_new_privs`, in namespaces of its own, its root holding only its
//! disks and `/dev/kvm`; the VM boots and serves its disk. `--no-jail`
//! leaves it root. A start whose jail cannot be had fails (no uid left).

use std::time::Duration;

use corral_tests::api::{Daemon, wait_until};
use serde_json::json;

const T: Duration = Duration::from_secs(30);

fn status_field(pid: u32, key: &str) -> Option<String> {
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    st.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// The pids of the processes below `root`.
fn descendants(root: u32) -> Vec<u32> {
    let all: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let p: u32 = e.file_name().to_str()?.parse().ok()?;
            let ppid = status_field(p, "PPid")?.parse().ok()?;
            Some((p, ppid))
        })
        .collect();
    let mut out = vec![root];
    let mut i = 0;
    while let Some(&p) = out.get(i) {
        out.extend(all.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    out.remove(0);
    out
}

/// The VM processes of daemon `d`: its descendants running `corral vmm`.
fn vm_processes(d: &Daemon) -> Vec<u32> {
    descendants(d.child.id())
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| c.split(|&b| b == 0).nth(1) == Some(b"vmm"))
                .unwrap_or(false)
        })
        .collect()
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn create_with_disk(d: &Daemon, name: &str) -> String {
    let disk = d.image_path(&format!("{name}.img"));
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    let body = json!({
        "name": name,
        "memory_mib": 32,
        "cmdline": "probe.mode=blk probe.op=verify probe.size=1M probe.bs=64K",
        "disks": [{"id": "data", "path": disk}],
    });
    let r = d.req("POST", "/v1/vms", Some(&body.to_string()));
    assert_eq!(r.status, 201, "{}", r.text());
    disk.display().to_string()
}

#[test]
fn serve_jails_each_vm_process() {
    if !is_root() {
        eprintln!("SKIP: the jail drops privileges from root; this test runs as a user");
        return;
    }
    let d = Daemon::start(&["--jail-uids", "3221230000:16"]);
    create_with_disk(&d, "jailed");
    // With a pid namespace, one process: the launcher's child, pid 1 of
    // its own namespace; the state file and the API name it by its host
    // pid.
    let pid_ns = corral_vmm::jail::probe(corral_vmm::jail::NsKind::Pid).is_ok();
    let pid = wait_until(T, || {
        let p = vm_processes(&d);
        p.into_iter()
            .find(|&p| !pid_ns || status_field(p, "NSpid").is_some_and(|n| n.contains(' ')))
    })
    .expect("no corral vmm process");
    if pid_ns {
        let nspid = status_field(pid, "NSpid").unwrap();
        assert_eq!(nspid, format!("{pid} 1"), "pid 1 of its own namespace");
        assert_ne!(
            std::fs::read_link("/proc/self/ns/pid").unwrap(),
            std::fs::read_link(format!("/proc/{pid}/ns/pid")).unwrap()
        );
        let v = d.req("GET", "/v1/vms/jailed", None).json();
        assert_eq!(v["pid"], pid, "the API reports the host pid: {v}");
        // No outer process: the launcher cloned the VM process into its
        // new pid namespace (`vmproc::spawn`), so the jail did not fork
        // and nothing of the VM's runs in the host's pid namespace; its
        // parent is the launcher (unjailed, the daemon's own helper).
        let parent: u32 = status_field(pid, "PPid").unwrap().parse().unwrap();
        let cmd = std::fs::read(format!("/proc/{parent}/cmdline")).unwrap();
        assert_eq!(
            cmd.split(|&b| b == 0).nth(1),
            Some(&b"vmm-launcher"[..]),
            "the parent {parent} of the VM process {pid} is not the launcher"
        );
        assert_eq!(
            vm_processes(&d).len(),
            1,
            "one process per VM: {:?}",
            vm_processes(&d)
        );
    } else {
        eprintln!(
            "SKIP (part): this host refuses a pid namespace; the VM process runs in the host's"
        );
    }
    let uid = status_field(pid, "Uid").unwrap();
    let first: u32 = uid.split(' ').next().unwrap().parse().unwrap();
    assert!((3_221_230_000..3_221_230_016).contains(&first), "{uid}");
    assert_eq!(uid, format!("{first} {first} {first} {first}"));
    assert_eq!(status_field(pid, "Gid").unwrap(), uid);
    assert_eq!(status_field(pid, "Groups").unwrap(), "");
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(pid, cap).unwrap(), "0000000000000000", "{cap}");
    }
    assert_eq!(status_field(pid, "NoNewPrivs").unwrap(), "1");
    for ns in ["mnt", "net", "ipc", "uts"] {
        assert_ne!(
            std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap(),
            std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).unwrap(),
            "{ns}"
        );
    }
    let mut root: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    root.sort();
    assert_eq!(root, ["data", "dev"], "built-in kernel: no kernel file");
    // The VM runs and its disk works, jailed and under its filters.
    let done = wait_until(T, || {
        let c = d.req("GET", "/v1/vms/jailed/console", None).text();
        c.contains("PROBE-DONE").then_some(c)
    })
    .expect("the jailed VM did not finish");
    assert!(done.contains("PROBE-DONE status=ok"), "{done}");
    assert!(done.contains(" mismatches=0"), "{done}");
}

#[test]
fn no_jail_leaves_the_vm_process_root_and_a_full_range_refuses_the_start() {
    if !is_root() {
        eprintln!("SKIP: needs root");
        return;
    }
    let d = Daemon::start(&["--no-jail"]);
    create_with_disk(&d, "free");
    let pid = wait_until(T, || vm_processes(&d).into_iter().next()).expect("no corral vmm process");
    assert_eq!(status_field(pid, "Uid").unwrap(), "0 0 0 0");
    drop(d);

    // Every uid of a one-uid range is taken by a host process: the VM
    // does not start, and says why.
    use std::os::unix::process::CommandExt;
    let busy = 3_221_230_100u32;
    let mut sleeper = std::process::Command::new("sleep")
        .arg("30")
        .uid(busy)
        .gid(busy)
        .spawn()
        .unwrap();
    let d = Daemon::start(&["--jail-uids", &format!("{busy}:1")]);
    let r = d.req(
        "POST",
        "/v1/vms",
        Some(r#"{"name": "nouid", "memory_mib": 16}"#),
    );
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert!(r.status >= 400, "{} {}", r.status, r.text());
    assert!(r.text().contains("every uid of the range"), "{}", r.text());
    assert!(vm_processes(&d).is_empty());
}
