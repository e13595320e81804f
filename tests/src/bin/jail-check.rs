//! Enters a VM process's jail (`corral_vmm::jail::enter`) as `corral vmm`
//! does, then reports what it can reach and hold from inside (`FACT
//! key=value` lines), and boots the probe guest through the vmm library
//! on the jail's KVM fd with seccomp on. For `tests/tests/jail.rs`.
//!
//! `jail-check DIR [--uid N] [--gid N] [--kvm PATH] [--no-ns KIND]...
//! [--staging DIR] [--thread] [--port P] [--wait] [--boot] [--for-vm]
//! [--cmdline GUEST-CMDLINE]`:
//! DIR holds `probe.elf`, `ro.img` and `rw.img` (all three are jailed,
//! under those names, or with `--for-vm` as `JailSpec::for_vm` names them)
//! and `other.img` (not).
//! Exit 3 with `JAIL-ERROR <message>` when the jail cannot be set up.

use std::io::BufRead;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use corral_vmm::hostfile::{HostPolicy, Role};
use corral_vmm::jail::{self, JailFile, JailLimits, JailSpec, JailStatus};
use corral_vmm::vm::DiskConfig;
use corral_vmm::{KernelSource, VmConfig};

fn errno(r: std::io::Result<impl Sized>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(e) => e.raw_os_error().map_or(e.to_string(), |n| n.to_string()),
    }
}

fn listing(p: &str) -> String {
    let mut v: Vec<String> = match std::fs::read_dir(p) {
        Ok(d) => d
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(e) => vec![format!("error:{e}")],
    };
    v.sort();
    v.join(",")
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().expect("DIR"));
    let (mut uid, mut gid, mut kvm) = (3_221_225_600u32, 3_221_225_600u32, "/dev/kvm".to_string());
    let (mut thread, mut wait, mut boot, mut port) = (false, false, false, None::<u16>);
    let mut staging = None::<PathBuf>;
    let mut for_vm = false;
    let mut cmdline = None::<String>;
    let mut ns = jail::Namespaces::default();
    while let Some(a) = args.next() {
        let mut val = || args.next().expect("option value");
        match a.as_str() {
            "--uid" => uid = val().parse().expect("uid"),
            "--gid" => gid = val().parse().expect("gid"),
            "--kvm" => kvm = val(),
            "--staging" => staging = Some(PathBuf::from(val())),
            "--port" => port = Some(val().parse().expect("port")),
            "--no-ns" => match val().as_str() {
                "pid" => ns.pid = false,
                "ipc" => ns.ipc = false,
                "net" => ns.net = false,
                "uts" => ns.uts = false,
                k => panic!("unknown namespace {k}"),
            },
            "--thread" => thread = true,
            "--wait" => wait = true,
            "--boot" => boot = true,
            "--for-vm" => for_vm = true,
            "--cmdline" => cmdline = Some(val()),
            a => panic!("unknown option {a}"),
        }
    }

    // Opened as the daemon opens them (checked, locked), before the jail.
    let p = HostPolicy::unrestricted();
    let kernel = p
        .open(&dir.join("probe.elf"), Role::Kernel)
        .expect("kernel");
    let ro = p
        .open(
            &dir.join("ro.img"),
            Role::Disk {
                writable: false,
                direct: false,
            },
        )
        .expect("ro.img");
    let rw = p
        .open(
            &dir.join("rw.img"),
            Role::Disk {
                writable: true,
                direct: false,
            },
        )
        .expect("rw.img");

    let _parked =
        thread.then(|| std::thread::spawn(|| std::thread::sleep(Duration::from_secs(30))));
    let mut cfg = VmConfig::new("jail-check", KernelSource::File(kernel.clone()));
    cfg.memory_mib = 64;
    cfg.cmdline = cmdline.unwrap_or_else(|| {
        "probe.mode=blk probe.op=verify probe.disk=1 probe.size=1M probe.bs=64K".into()
    });
    for (f, read_only) in [(ro.clone(), true), (rw.clone(), false)] {
        cfg.disks.push(DiskConfig {
            id: None,
            path: f.path().to_path_buf(),
            read_only,
            direct: false,
            // The io_uring engine must work jailed: asked for where the
            // kernel has it (a buffered disk's default is sync).
            engine: Some(corral_vmm::manager::IoEngine::auto()),
            limits: Default::default(),
            group: None,
            file: Some(f),
        });
    }
    let mut spec = if for_vm {
        JailSpec::for_vm(&cfg, uid, gid).expect("JailSpec::for_vm")
    } else {
        let mut spec = JailSpec::new("jail-check", uid, gid);
        spec.limits = JailLimits::for_vm(64, 1, 2, rw.len());
        spec.files = vec![
            JailFile {
                name: "probe.elf".into(),
                fd: kernel.file().as_fd(),
                read_only: true,
            },
            JailFile {
                name: "ro.img".into(),
                fd: ro.file().as_fd(),
                read_only: true,
            },
            JailFile {
                name: "rw.img".into(),
                fd: rw.file().as_fd(),
                read_only: false,
            },
        ];
        spec
    };
    spec.kvm_path = PathBuf::from(&kvm);
    spec.namespaces = ns;
    if let Some(s) = staging {
        spec.staging = s;
    }
    let jailed = match jail::enter(&spec) {
        Ok(j) => j,
        Err(e) => {
            println!("JAIL-ERROR {e}");
            std::process::exit(3);
        }
    };
    println!("JAIL-IN");
    if wait {
        let mut l = String::new();
        let _ = std::io::stdin().lock().read_line(&mut l);
    }

    let st = JailStatus::current();
    let fact = |k: &str, v: String| println!("FACT {k}={v}");
    fact("root", listing("/"));
    fact("dev", listing("/dev"));
    fact("shadow", errno(std::fs::File::open("/etc/shadow")));
    fact("proc", errno(std::fs::metadata("/proc/self")));
    fact("hostdir", errno(std::fs::metadata(&dir)));
    fact("other", errno(std::fs::metadata(dir.join("other.img"))));
    fact("uid", format!("{},{}", st.uid.0, st.uid.1));
    fact("gid", format!("{},{}", st.gid.0, st.gid.1));
    fact("groups", st.groups.to_string());
    fact("caps", format!("{},{},{}", st.caps.0, st.caps.1, st.caps.2));
    fact("bounding", st.bounding.to_string());
    fact("ambient", st.ambient.to_string());
    fact("nnp", u8::from(st.no_new_privs).to_string());
    fact("pid", st.pid.to_string());
    let lim = |v: Option<u64>| v.map_or("inf".to_string(), |n| n.to_string());
    fact(
        "limits",
        st.limits
            .iter()
            .map(|&v| lim(v))
            .collect::<Vec<_>>()
            .join(","),
    );
    fact(
        "rt_limits",
        st.rt_limits
            .iter()
            .map(|&v| lim(v))
            .collect::<Vec<_>>()
            .join(","),
    );
    // SCHED_FIFO 1 (what a boosted device thread takes) and 2 (above the
    // jail's RLIMIT_RTPRIO), each undone.
    for prio in [1, 2] {
        let param = libc::sched_param {
            sched_priority: prio,
        };
        // SAFETY: pid 0 is this thread; `param` outlives the call.
        let r = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
        let v = errno(if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        });
        let zero = libc::sched_param { sched_priority: 0 };
        // SAFETY: as above.
        unsafe { libc::sched_setscheduler(0, libc::SCHED_OTHER, &zero) };
        fact(&format!("fifo{prio}"), v);
    }
    let wo = |p: &str| std::fs::OpenOptions::new().write(true).open(p);
    fact("ro_write", errno(wo("/ro.img")));
    fact("kernel_write", errno(wo("/probe.elf")));
    fact("rw_write", errno(wo("/rw.img")));
    fact("kvm_reopen", errno(std::fs::File::open("/dev/kvm")));
    fact("mkdir_root", errno(std::fs::create_dir("/x")));
    fact("mkdir_tmp", errno(std::fs::create_dir("/tmp")));
    if let Some(port) = port {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        fact(
            "tcp",
            errno(std::net::TcpStream::connect_timeout(
                &addr,
                Duration::from_secs(2),
            )),
        );
    }
    let mut name = [0u8; 65];
    // SAFETY: gethostname writes at most `len` bytes into the buffer.
    unsafe { libc::gethostname(name.as_mut_ptr().cast(), 64) };
    let end = name.iter().position(|&b| b == 0).unwrap_or(0);
    fact(
        "hostname",
        String::from_utf8_lossy(&name[..end]).into_owned(),
    );

    if boot {
        boot_probe(jailed, &cfg);
    }
}

fn boot_probe(jailed: jail::Jailed, cfg: &VmConfig) {
    use corral_vmm::seccomp;
    if let Err(e) = seccomp::enable()
        .and_then(|()| seccomp::check_all())
        .and_then(|()| seccomp::install(seccomp::ThreadKind::Runtime))
    {
        println!("BOOT-ERROR seccomp: {e}");
        std::process::exit(4);
    }
    let kvm = jailed.kvm();
    let vm = match corral_vmm::start_with_kvm(cfg, &kvm) {
        Ok(vm) => vm,
        Err(e) => {
            println!("BOOT-ERROR {e}");
            std::process::exit(4);
        }
    };
    // Thread ids as this process's (pid) namespace numbers them.
    let tids: Vec<String> = vm
        .vcpu_tids()
        .iter()
        .chain(vm.device_tid().iter())
        .map(|t| t.to_string())
        .collect();
    println!("VM-TIDS {}", tids.join(","));
    let engines: Vec<String> = vm
        .disks()
        .iter()
        .map(|d| format!("{:?}", d.engine))
        .collect();
    println!("VM-ENGINES {}", engines.join(","));
    let console = vm.console();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    let mut at = 0;
    while Instant::now() < deadline && vm.exit_reason().is_none() {
        let (b, next, _) = console.read_from(at, Duration::from_millis(100));
        at = next;
        out.extend_from_slice(&b);
        if out.len() > 1 << 20 {
            break;
        }
    }
    vm.stop();
    let reason = vm.join();
    let (b, _, _) = console.read_from(at, Duration::from_millis(0));
    out.extend_from_slice(&b);
    for l in String::from_utf8_lossy(&out).lines().take(200) {
        if l.starts_with("PROBE-") {
            println!("GUEST {l}");
        }
    }
    println!("BOOT-EXIT {reason}");
}
