//! virtio-blk throughput and throttle overhead on real VMs, guest-measured.
//!
//! ```sh
//! cargo build --release -p corral-api -p corral-tests
//! target/x86_64-unknown-linux-gnu/release/blkbench [RUNS]
//! ```
//!
//! Host page cache warm (the disk file is written and read once first);
//! median of RUNS (default 5) per job; then the overhead of a limit 100×
//! above what the disk does, interleaved none / limited, RUNS pairs.

use std::process::{Command, Stdio};

fn run(disk: &str, probe: &str) -> (f64, f64) {
    let out = Command::new(corral_tests::corral_bin())
        .args(["run", "--memory", "96", "--disk", disk, "--cmdline", probe])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .expect("run corral");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("PROBE-RESULT mode=blk"))
        .unwrap_or_else(|| panic!("no result: {text}"));
    let get = |k: &str| -> f64 {
        corral_tests::vms::field(line, k)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {k} in {line}"))
    };
    assert_eq!(get("errors"), 0.0, "{line}");
    (get("bytes"), get("us"))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let dir = std::env::temp_dir().join(format!("corral-blkbench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let img = dir.join("disk.img");
    std::fs::write(&img, vec![0x5au8; 64 << 20]).unwrap();
    let _ = std::fs::read(&img).unwrap();
    let disk = img.display().to_string();

    let jobs = [
        (
            "32 MiB read, 128 KiB, qd 4",
            "probe.op=read probe.size=32M probe.bs=128K probe.qd=4",
        ),
        (
            "32 MiB write, 128 KiB, qd 4",
            "probe.op=write probe.size=32M probe.bs=128K probe.qd=4",
        ),
        (
            "8 MiB read, 2048 x 4 KiB, qd 4",
            "probe.op=read probe.size=8M probe.bs=4K probe.qd=4",
        ),
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

    // Overhead of limits that are never hit: 100x above what the disk does here.
    let probe = "probe.mode=blk probe.op=read probe.size=32M probe.bs=128K probe.qd=4";
    let limited = format!("{disk},bps=200G,iops=10000000");
    run(&disk, probe);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..runs.max(5) {
        a.push(run(&disk, probe).1);
        b.push(run(&limited, probe).1);
    }
    let (ma, mb) = (median(&mut a), median(&mut b));
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    println!(
        "limit 100x above need vs none ({} interleaved pairs, 32 MiB read): none median {:.2} ms mean {:.2}, limited median {:.2} ms mean {:.2}; difference {:+.2} % (median), {:+.2} % (mean)",
        a.len(),
        ma / 1000.0,
        mean(&a) / 1000.0,
        mb / 1000.0,
        mean(&b) / 1000.0,
        (mb - ma) / ma * 100.0,
        (mean(&b) - mean(&a)) / mean(&a) * 100.0
    );
    let _ = std::fs::remove_dir_all(&dir);
}
