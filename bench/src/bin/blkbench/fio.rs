//! `blkbench --fio ROUNDS`: corral's O_DIRECT disk on the io_uring engine
//! against Debian's `fio --ioengine=io_uring --direct=1` on the same file
//! from the host (issue 17: within 10 % at 4 KiB random reads, qd 32).
//!
//! One file on a filesystem that really does O_DIRECT (not tmpfs, whose
//! "direct" I/O is a page-cache copy: the directory is checked with
//! `statfs`), written with data (a sparse file's holes read as zeros with
//! no I/O) and flushed. Per round, each job runs once in a VM (the probe's
//! driver, `probe.pattern=random` for random reads, the disk
//! `FILE,readonly,direct,engine=uring`) and once as fio with the same block
//! size, queue depth and access pattern over the same file, the order
//! alternating between rounds. The figure is IOPS: the guest's requests
//! over its own clock (first submit to last completion, the boot left out)
//! and fio's `read.iops`. Reported per job: both medians, and the per-round
//! ratio corral/fio (median, min–max, and the geometric mean with its 95 %
//! t-interval).

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// A job of the comparison.
struct Job {
    name: &'static str,
    bs: u64,
    qd: u32,
    random: bool,
    /// Requests of the guest's job.
    requests: u64,
}

const JOBS: [Job; 5] = [
    Job {
        name: "4 KiB random read, qd 1",
        bs: 4096,
        qd: 1,
        random: true,
        requests: 2048,
    },
    Job {
        name: "4 KiB random read, qd 4",
        bs: 4096,
        qd: 4,
        random: true,
        requests: 4096,
    },
    Job {
        name: "4 KiB random read, qd 32",
        bs: 4096,
        qd: 32,
        random: true,
        requests: 16384,
    },
    Job {
        name: "128 KiB sequential read, qd 4",
        bs: 128 << 10,
        qd: 4,
        random: false,
        requests: 1024,
    },
    Job {
        name: "128 KiB sequential read, qd 32",
        bs: 128 << 10,
        qd: 32,
        random: false,
        requests: 2048,
    },
];

/// Options of the fio mode.
pub struct FioOpts {
    /// Rounds (each job once on each side per round).
    pub rounds: usize,
    /// Where to put the file (else the first of $TMPDIR, /var/tmp and the
    /// binary's directory that does O_DIRECT).
    pub dir: Option<PathBuf>,
    /// Size of the file, MiB.
    pub file_mib: u64,
    /// fio's run time per job.
    pub runtime: Duration,
    /// The fio binary.
    pub fio: PathBuf,
}

/// Runs the comparison; an error says what is missing.
pub fn run(o: &FioOpts) -> Result<(), String> {
    let fio_version = Command::new(&o.fio)
        .arg("--version")
        .output()
        .map_err(|e| {
            format!(
                "cannot run {} ({e}): install fio (Debian: apt-get install fio) or pass --fio-bin",
                o.fio.display()
            )
        })?;
    let base = pick_dir(o.dir.as_deref())?;
    let dir = base.join(format!("corral-blkbench-fio-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let img = dir.join("disk.img");
    println!(
        "{}; a {} MiB file on {} ({})",
        String::from_utf8_lossy(&fio_version.stdout).trim(),
        o.file_mib,
        base.display(),
        fs_name(&base)
    );
    let res = write_file(&img, o.file_mib << 20).and_then(|()| compare(o, &img));
    let _ = std::fs::remove_dir_all(&dir);
    res
}

fn compare(o: &FioOpts, img: &Path) -> Result<(), String> {
    let size = o.file_mib << 20;
    println!(
        "virtio-blk O_DIRECT, engine=uring, against fio --ioengine=io_uring --direct=1 on the same file; {} rounds, order alternating",
        o.rounds
    );
    println!(
        "  fio: {} --name=cmp --filename={} --readonly --ioengine=io_uring --direct=1 --rw=randread|read --bs=BS --iodepth=QD --size={size} --runtime={}ms --time_based --output-format=json",
        o.fio.display(),
        img.display(),
        o.runtime.as_millis()
    );
    for job in &JOBS {
        let (mut ours, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..o.rounds {
            let seed = 1 + round as u64;
            let (a, b) = if round % 2 == 0 {
                let a = corral_iops(img, size, job, seed)?;
                (a, fio_iops(o, img, size, job)?)
            } else {
                let b = fio_iops(o, img, size, job)?;
                (corral_iops(img, size, job, seed)?, b)
            };
            ours.push(a);
            theirs.push(b);
            ratios.push(a / b);
        }
        let (gm, lo, hi) = log_ci(&ratios);
        let (rmin, rmax) = min_max(&ratios);
        println!(
            "  {:32} corral {:8.0} IOPS, fio {:8.0} IOPS (medians); corral/fio median {:.3} (min {:.3} max {:.3}), mean {gm:.3} (95 % {lo:.3} … {hi:.3})",
            job.name,
            median(&mut ours),
            median(&mut theirs),
            median(&mut ratios.clone()),
            rmin,
            rmax
        );
    }
    Ok(())
}

/// The guest's IOPS for one run of `job` (a sequential job stops at the
/// end of the file's `size` bytes).
fn corral_iops(img: &Path, size: u64, job: &Job, seed: u64) -> Result<f64, String> {
    let disk = format!("{},readonly,direct,engine=uring", img.display());
    let pattern = if job.random { "random" } else { "seq" };
    let probe = format!(
        "probe.mode=blk probe.op=read probe.pattern={pattern} probe.seed={seed} probe.bs={} probe.qd={} probe.size={}",
        job.bs,
        job.qd,
        if job.random {
            job.bs * job.requests
        } else {
            (job.bs * job.requests).min(size / job.bs * job.bs)
        }
    );
    let out = Command::new(corral_tests::corral_bin())
        .args([
            "run",
            "--memory",
            "96",
            "--disk",
            &disk,
            "--cmdline",
            &probe,
        ])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run corral: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("PROBE-RESULT mode=blk"))
        .ok_or_else(|| format!("no result from the guest ({probe}):\n{}", tail(&text)))?;
    let get = |k: &str| -> Result<f64, String> {
        corral_tests::vms::field(line, k)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("no {k}= in {line}"))
    };
    if get("errors")? != 0.0 || corral_tests::vms::field(line, "pattern") != Some(pattern) {
        return Err(format!("the guest's job failed: {line}"));
    }
    let us = get("us")?;
    Ok(get("requests")? / us.max(1.0) * 1e6)
}

/// fio's IOPS for `job` on the same file.
fn fio_iops(o: &FioOpts, img: &Path, size: u64, job: &Job) -> Result<f64, String> {
    let rw = if job.random { "randread" } else { "read" };
    let out = Command::new(&o.fio)
        .arg("--name=cmp")
        .arg(format!("--filename={}", img.display()))
        .args(["--readonly", "--ioengine=io_uring", "--direct=1"])
        .arg(format!("--rw={rw}"))
        .arg(format!("--bs={}", job.bs))
        .arg(format!("--iodepth={}", job.qd))
        .arg(format!("--size={size}"))
        .arg(format!("--runtime={}ms", o.runtime.as_millis()))
        .args(["--time_based", "--output-format=json"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run fio: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "fio failed ({}): {}{}",
            out.status,
            tail(&text),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    // fio may print notes before the JSON document.
    let json = text.find('{').map_or("", |i| &text[i..]);
    let v: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| format!("fio's output is not JSON ({e}): {}", tail(&text)))?;
    v["jobs"][0]["read"]["iops"]
        .as_f64()
        .filter(|x| *x > 0.0)
        .ok_or_else(|| format!("no jobs[0].read.iops in fio's output: {}", tail(&text)))
}

/// The first candidate directory whose filesystem is not tmpfs and opens a
/// file `O_DIRECT` and reads it.
fn pick_dir(asked: Option<&Path>) -> Result<PathBuf, String> {
    let mut cands: Vec<PathBuf> = Vec::new();
    if let Some(d) = asked {
        cands.push(d.to_path_buf());
    } else {
        cands.push(std::env::temp_dir());
        cands.push(PathBuf::from("/var/tmp"));
        if let Some(d) = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf))
        {
            cands.push(d);
        }
    }
    let mut why = Vec::new();
    for d in &cands {
        match direct_ok(d) {
            Ok(()) => return Ok(d.clone()),
            Err(e) => why.push(format!("{}: {e}", d.display())),
        }
    }
    Err(format!(
        "no directory for an O_DIRECT file ({}); pass --dir DIR on a disk filesystem",
        why.join("; ")
    ))
}

const TMPFS_MAGIC: i64 = 0x0102_1994;

fn fs_magic(d: &Path) -> Option<i64> {
    let c = std::ffi::CString::new(d.as_os_str().as_bytes()).ok()?;
    // SAFETY: statfs writes into a zeroed struct we own; the path is a
    // NUL-terminated string that outlives the call.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let r = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    (r == 0).then_some(st.f_type as i64)
}

fn fs_name(d: &Path) -> String {
    match fs_magic(d) {
        Some(0xEF53) => "ext4".into(),
        Some(0x5846_5342) => "xfs".into(),
        Some(0x9123_683E) => "btrfs".into(),
        Some(0x794C_7630) => "overlayfs".into(),
        Some(TMPFS_MAGIC) => "tmpfs".into(),
        Some(m) => format!("filesystem {m:#x}"),
        None => "unknown filesystem".into(),
    }
}

fn direct_ok(d: &Path) -> Result<(), String> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    std::fs::create_dir_all(d).map_err(|e| e.to_string())?;
    match fs_magic(d) {
        None => return Err("statfs failed".into()),
        Some(TMPFS_MAGIC) => return Err("tmpfs (O_DIRECT there is a page-cache copy)".into()),
        Some(_) => {}
    }
    let p = d.join(format!(".corral-direct-check-{}", std::process::id()));
    let r = (|| {
        std::fs::write(&p, vec![1u8; 8192]).map_err(|e| e.to_string())?;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&p)
            .map_err(|e| format!("open O_DIRECT: {e}"))?;
        let layout = std::alloc::Layout::from_size_align(4096, 4096).map_err(|e| e.to_string())?;
        // SAFETY: a non-zero size layout; freed below.
        let buf = unsafe { std::alloc::alloc_zeroed(layout) };
        if buf.is_null() {
            return Err("out of memory".into());
        }
        // SAFETY: buf is 4096 bytes, aligned, and ours until dealloc.
        let s = unsafe { std::slice::from_raw_parts_mut(buf, 4096) };
        let r = f
            .read_at(s, 4096)
            .map_err(|e| format!("O_DIRECT read: {e}"));
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(buf, layout) };
        r.map(drop)
    })();
    let _ = std::fs::remove_file(&p);
    r
}

/// Writes `len` bytes of non-zero data (no holes) and flushes it, then
/// drops it from the page cache (the comparison is of O_DIRECT reads).
fn write_file(p: &Path, len: u64) -> Result<(), String> {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let mut f = std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()))?;
    let chunk: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8 | 1).collect();
    for _ in 0..len.div_ceil(chunk.len() as u64) {
        f.write_all(&chunk)
            .map_err(|e| format!("{}: {e}", p.display()))?;
    }
    f.sync_all().map_err(|e| format!("{}: {e}", p.display()))?;
    // SAFETY: a valid fd; advice only.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    Ok(())
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn min_max(v: &[f64]) -> (f64, f64) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}

/// Geometric mean of ratios and its 95 % t-interval (on the logarithms).
fn log_ci(r: &[f64]) -> (f64, f64, f64) {
    const T: [f64; 10] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    ];
    let l: Vec<f64> = r.iter().map(|x| x.ln()).collect();
    let n = l.len();
    let m = l.iter().sum::<f64>() / n.max(1) as f64;
    if n < 2 {
        return (m.exp(), f64::NAN, f64::NAN);
    }
    let var = l.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1) as f64;
    let t = T.get(n - 2).copied().unwrap_or(1.96 + 2.5 / n as f64);
    let h = t * (var / n as f64).sqrt();
    (m.exp(), (m - h).exp(), (m + h).exp())
}
