//! virtio-blk throughput and throttle overhead on real VMs, guest-measured.
//!
//! ```sh
//! cargo build --release -p corral-api -p corral-bench
//! target/x86_64-unknown-linux-gnu/release/blkbench [RUNS] [--pairs N] [--poll-ab US]
//! target/x86_64-unknown-linux-gnu/release/blkbench --engines N
//! target/x86_64-unknown-linux-gnu/release/blkbench --fio ROUNDS [--dir DIR]
//! ```
//!
//! `--fio ROUNDS` compares an O_DIRECT disk on the io_uring engine with
//! Debian's `fio --ioengine=io_uring` on the same file from the host
//! (`fio.rs`).
//!
//! `--engines N` compares the disk engines only: for page-cache and
//! O_DIRECT files, reads and writes, 4 KiB and 128 KiB, queue depth 1, 4
//! and 32, N VMs each with four disks `sync`/`uring`/`uring`/`sync` (ABBA,
//! so a drift inside the run cancels) running the job on each in turn
//! (`probe.disks=all`); reported: the sync time (median over VMs of the
//! mean of its two disks) and the ratio uring/sync (median, and mean ± 95 %
//! interval of the per-VM ratios).
//!
//! Host page cache warm (the disk file is written and read once first);
//! median of RUNS (default 5) per job. Then, with `--poll-ab US`, each job
//! with the device's ring polling off versus `US` µs, interleaved pairs; and
//! the overhead of a limit 100× above what the disk does against no limit,
//! interleaved pairs (N, default 21; the order inside a pair alternates),
//! reported as the median and the mean ± 95 % interval of the per-pair
//! ratios.

mod fio;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use clap::Parser;

/// virtio-blk throughput, engines and throttle overhead on real VMs
/// (guest-measured).
#[derive(Parser, Debug)]
#[command(name = "blkbench")]
struct Args {
    /// Runs per job (the median is reported).
    #[arg(default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    /// Interleaved pairs for the polling and limit comparisons.
    #[arg(long, default_value_t = 21, value_parser = clap::value_parser!(u32).range(1..))]
    pairs: u32,
    /// Also compare ring polling off against this window (µs).
    #[arg(long, value_name = "US")]
    poll_ab: Option<u64>,
    /// Only compare the sync and uring engines, N VMs per job.
    #[arg(long, value_name = "N", conflicts_with = "fio", value_parser = clap::value_parser!(u32).range(1..))]
    engines: Option<u32>,
    /// Only compare an O_DIRECT uring disk with fio on the host, ROUNDS rounds.
    #[arg(long, value_name = "ROUNDS", value_parser = clap::value_parser!(u32).range(1..))]
    fio: Option<u32>,
    /// --fio: directory for the file (default: the first of $TMPDIR, /var/tmp,
    /// the binary's directory that is not tmpfs and does O_DIRECT).
    #[arg(long, value_name = "DIR", requires = "fio")]
    dir: Option<PathBuf>,
    /// --fio: size of the file in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 256, requires = "fio")]
    file_mib: u64,
    /// --fio: fio's run time per job, ms.
    #[arg(long, value_name = "MS", default_value_t = 1000, requires = "fio")]
    fio_ms: u64,
    /// --fio: the fio binary.
    #[arg(long, value_name = "PATH", default_value = "fio", requires = "fio")]
    fio_bin: PathBuf,
}

fn run(disk: &str, probe: &str) -> (f64, f64) {
    run_env(disk, probe, None)
}

/// The 128 KiB and 4 KiB read jobs (name, probe parameters).
const READ_128K: (&str, &str) = (
    "32 MiB read, 128 KiB, qd 4",
    "probe.op=read probe.size=32M probe.bs=128K probe.qd=4",
);
const READ_4K: (&str, &str) = (
    "8 MiB read, 2048 x 4 KiB, qd 4",
    "probe.op=read probe.size=8M probe.bs=4K probe.qd=4",
);
/// Limits 100x above what the disk does here: never hit.
const UNUSED_LIMIT: &str = "bps=400G,iops=10000000";

/// One `corral run` of the probe's blk job; `poll_us` sets
/// `CORRAL_BLK_POLL_US` for it. Returns (bytes, guest µs).
fn run_env(disk: &str, probe: &str, poll_us: Option<u64>) -> (f64, f64) {
    run_vm(&[disk], probe, poll_us)[0]
}

/// One `corral run` with `disks`; returns (bytes, guest µs) of every blk
/// result line (one per disk with `probe.disks=all`), each checked for
/// errors.
fn run_vm(disks: &[&str], probe: &str, poll_us: Option<u64>) -> Vec<(f64, f64)> {
    let mut cmd = Command::new(corral_tests::corral_bin());
    cmd.args(["run", "--memory", "96"]);
    for d in disks {
        cmd.args(["--disk", d]);
    }
    cmd.args(["--cmdline", probe])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit());
    if let Some(us) = poll_us {
        cmd.env("CORRAL_BLK_POLL_US", us.to_string());
    }
    let out = cmd.output().expect("run corral");
    let text = String::from_utf8_lossy(&out.stdout);
    let r: Vec<(f64, f64)> = text
        .lines()
        .filter(|l| l.starts_with("PROBE-RESULT mode=blk"))
        .map(|line| {
            let get = |k: &str| -> f64 {
                corral_tests::vms::field(line, k)
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("no {k} in {line}"))
            };
            assert_eq!(get("errors"), 0.0, "{line}");
            (get("bytes"), get("us"))
        })
        .collect();
    assert!(!r.is_empty(), "no result: {text}");
    r
}

/// Runs `a` and `b` in `n` interleaved pairs (alternating which goes
/// first) and returns their times and the per-pair ratios b / a.
fn pairs(n: usize, a: impl Fn() -> f64, b: impl Fn() -> f64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut ta, mut tb, mut r) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let (x, y) = if i % 2 == 0 {
            let x = a();
            (x, b())
        } else {
            let y = b();
            (a(), y)
        };
        ta.push(x);
        tb.push(y);
        r.push(y / x);
    }
    (ta, tb, r)
}

/// Mean and half-width of its 95 % interval (normal approximation).
fn mean_ci(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, 1.96 * (var / n).sqrt())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args = Args::parse();
    if let Some(n) = args.engines {
        engines(n as usize);
        return;
    }
    if let Some(rounds) = args.fio {
        let o = fio::FioOpts {
            rounds: rounds as usize,
            dir: args.dir,
            file_mib: args.file_mib.max(1),
            runtime: Duration::from_millis(args.fio_ms.max(100)),
            fio: args.fio_bin,
        };
        if let Err(e) = fio::run(&o) {
            eprintln!("blkbench --fio: {e}");
            std::process::exit(1);
        }
        return;
    }
    let runs = args.runs as usize;
    let npairs = args.pairs as usize;
    let poll_ab = args.poll_ab;
    let dir = std::env::temp_dir().join(format!("corral-blkbench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let img = dir.join("disk.img");
    std::fs::write(&img, vec![0x5au8; 64 << 20]).unwrap();
    let _ = std::fs::read(&img).unwrap();
    let disk = img.display().to_string();

    let jobs = [
        READ_128K,
        (
            "32 MiB write, 128 KiB, qd 4",
            "probe.op=write probe.size=32M probe.bs=128K probe.qd=4",
        ),
        READ_4K,
        (
            "8 MiB read, 2048 x 4 KiB, qd 1",
            "probe.op=read probe.size=8M probe.bs=4K probe.qd=1",
        ),
    ];
    println!("virtio-blk, guest-measured, median of {runs} (page cache warm)");
    for (name, p) in jobs {
        let probe = format!("probe.mode=blk {p}");
        run(&disk, &probe);
        let mut ms: Vec<f64> = (0..runs).map(|_| run(&disk, &probe).1 / 1000.0).collect();
        let (bytes, _) = run(&disk, &probe);
        let m = median(&mut ms);
        println!(
            "  {name:32} median {m:8.2} ms  ({:.0} MiB/s)  min {:.2} max {:.2}",
            bytes / 1048576.0 / (m / 1000.0),
            ms[0],
            ms[ms.len() - 1]
        );
    }

    if let Some(us) = poll_ab {
        println!(
            "device ring polling: off vs {us} us after each batch, {npairs} interleaved pairs"
        );
        for (name, p) in jobs {
            let probe = format!("probe.mode=blk {p}");
            let (mut a, mut b, mut r) = pairs(
                npairs,
                || run_env(&disk, &probe, Some(0)).1,
                || run_env(&disk, &probe, Some(us)).1,
            );
            let (m, ci) = mean_ci(&r);
            println!(
                "  {name:32} off median {:8.2} ms, polling median {:8.2} ms; polling/off median {:.3}, mean {:.3} ± {:.3}",
                median(&mut a) / 1000.0,
                median(&mut b) / 1000.0,
                median(&mut r),
                m,
                ci
            );
        }
    }

    // Overhead of limits that are never hit: 100x above what the disk does here.
    println!("limit 100x above need vs none, {npairs} interleaved pairs (ratio limited/none):");
    let limit = UNUSED_LIMIT;
    for (name, p) in [READ_128K, READ_4K] {
        let probe = format!("probe.mode=blk {p}");
        let limited = format!("{disk},{limit}");
        run(&disk, &probe);
        let (mut a, mut b, mut r) =
            pairs(npairs, || run(&disk, &probe).1, || run(&limited, &probe).1);
        let (m, ci) = mean_ci(&r);
        println!(
            "  {name:32} none median {:8.2} ms, limited ({limit}) median {:8.2} ms; ratio median {:+.2} %, mean {:+.2} % ± {:.2} %",
            median(&mut a) / 1000.0,
            median(&mut b) / 1000.0,
            (median(&mut r) - 1.0) * 100.0,
            (m - 1.0) * 100.0,
            ci * 100.0
        );
    }
    // The same, with the host's run-to-run noise taken out: one VM with four
    // disks on the same (page-cached) file, unlimited / limited / limited /
    // unlimited (ABBA cancels a drift inside the run), the job run on each
    // in turn (`probe.disks=all`); ratio = limited pair / unlimited pair.
    println!(
        "same, inside one VM (disks none/limited/limited/none, the job on each in turn), {npairs} VMs:"
    );
    for (name, p) in [READ_128K, READ_4K] {
        let limited = format!("{disk},readonly,{UNUSED_LIMIT}");
        let plain = format!("{disk},readonly");
        let probe = format!("probe.mode=blk probe.disks=all {p}");
        let mut r = Vec::new();
        for _ in 0..npairs {
            let us: Vec<f64> = run_vm(&[&plain, &limited, &limited, &plain], &probe, None)
                .into_iter()
                .map(|(_, us)| us)
                .collect();
            assert_eq!(us.len(), 4, "one result per disk: {us:?}");
            r.push((us[1] + us[2]) / (us[0] + us[3]));
        }
        let (m, ci) = mean_ci(&r);
        println!(
            "  {name:32} limited/none ratio median {:+.2} %, mean {:+.2} % ± {:.2} %",
            (median(&mut r) - 1.0) * 100.0,
            (m - 1.0) * 100.0,
            ci * 100.0
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--engines N`: sync against uring, ABBA disks inside each VM.
fn engines(n: usize) {
    let dir = std::env::temp_dir().join(format!("corral-blkbench-eng-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Four files (a writable image has one user), written so that reads
    // find data, and read once so the page-cache runs start warm.
    let imgs: Vec<String> = (0..4)
        .map(|i| {
            let p = dir.join(format!("d{i}.img"));
            std::fs::write(&p, vec![0x5au8; 40 << 20]).unwrap();
            let _ = std::fs::read(&p).unwrap();
            p.display().to_string()
        })
        .collect();
    println!("virtio-blk engines, {n} VMs per job, disks sync/uring/uring/sync in each VM:");
    for direct in ["", ",direct"] {
        for op in ["read", "write"] {
            for (bs, size) in [("4K", "8M"), ("128K", "32M")] {
                for qd in [1, 4, 32] {
                    let disks: Vec<String> = ["sync", "uring", "uring", "sync"]
                        .iter()
                        .zip(&imgs)
                        .map(|(e, img)| format!("{img}{direct},engine={e}"))
                        .collect();
                    let refs: Vec<&str> = disks.iter().map(String::as_str).collect();
                    let probe = format!(
                        "probe.mode=blk probe.disks=all probe.op={op} probe.size={size} probe.bs={bs} probe.qd={qd}"
                    );
                    let (mut sync_ms, mut r) = (Vec::new(), Vec::new());
                    for _ in 0..n {
                        let us: Vec<f64> = run_vm(&refs, &probe, None)
                            .into_iter()
                            .map(|(_, us)| us)
                            .collect();
                        assert_eq!(us.len(), 4, "one result per disk: {us:?}");
                        sync_ms.push((us[0] + us[3]) / 2000.0);
                        r.push((us[1] + us[2]) / (us[0] + us[3]));
                    }
                    let (m, ci) = mean_ci(&r);
                    let kind = if direct.is_empty() {
                        "cache "
                    } else {
                        "direct"
                    };
                    println!(
                        "  {kind} {op:5} {bs:>4} qd {qd:2} ({size:>3}): sync {:8.2} ms, uring/sync median {:.3}, mean {:.3} ± {:.3}",
                        median(&mut sync_ms),
                        median(&mut r),
                        m,
                        ci
                    );
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
