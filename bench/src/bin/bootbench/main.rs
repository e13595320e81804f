//! Boot benchmark: process start to the probe's `PROBE-UP` line, and the
//! process's RSS at that moment. Usage:
//!
//! ```sh
//! cargo build --release -p corral-api -p corral-bench
//! target/x86_64-unknown-linux-gnu/release/bootbench [RUNS] [VCPUS] [MEMORY_MIB]
//! ```
//!
//! One warm-up run, then RUNS (default 11) measured runs; prints each run and
//! min / median / max. With `BOOTBENCH_STEPS=1` the VM is started with
//! `CORRAL_BOOT_TRACE=1` and the median offset of each start-up step from
//! the spawn is printed too (the steps are in `corral_vmm::boottrace`).
//!
//! `bootbench side [ROUNDS] [VCPUS] [MEMORY_MIB]` (default 21 rounds)
//! compares, interleaved (each round runs the three in turn, the order
//! reversed every other round), `corral run` with a VM process as the
//! daemon starts one (`corral vmm`, not jailed and jailed; see `vmm.rs`):
//! time from the spawn to `PROBE-UP` and RSS then, each one's min / median
//! / max, and the ratios to `corral run` (issue 15's guards: ≤ 1.5×, and
//! ≤ 4 MiB RSS per VM process).
//!
//! `bootbench jail-ab [ROUNDS] [VCPUS] [MEMORY_MIB]` times the jailed start
//! as the daemon makes it against the same jail without the namespace pool
//! and with the jail's own fork (`vmm.rs`).

mod vmm;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::Instant;

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One run's start-up steps: (name, µs after the spawn), in order.
type Steps = Vec<(String, f64)>;

fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Prints the resident KiB of each mapping of `pid` (largest first): where
/// the RSS at `PROBE-UP` comes from.
fn print_smaps(pid: u32) {
    // Field 10 of /proc/PID/stat (after the parenthesised name): minor
    // faults so far, i.e. the pages the process start and the VM touched.
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        && let Some((_, rest)) = stat.rsplit_once(')')
        && let Some(minflt) = rest.split_whitespace().nth(7)
    {
        eprintln!("  minor page faults so far: {minflt}");
    }
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) else {
        return;
    };
    let mut rows: Vec<(u64, String)> = Vec::new();
    let mut name = String::new();
    for l in text.lines() {
        let first = l.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            let f: Vec<&str> = l.split_whitespace().collect();
            name = format!(
                "{} {}",
                f.get(1).unwrap_or(&""),
                f.get(5).unwrap_or(&"[anon]")
            );
        } else if let Some(v) = l.strip_prefix("Rss:") {
            let kib: u64 = v.trim().trim_end_matches(" kB").trim().parse().unwrap_or(0);
            if kib > 0 {
                rows.push((kib, name.clone()));
            }
        }
    }
    rows.sort_by_key(|r| std::cmp::Reverse(r.0));
    for (kib, n) in rows {
        eprintln!("  {kib:6} KiB  {n}");
    }
}

fn one(vcpus: &str, mem: &str) -> (f64, u64, Steps) {
    let steps_on = std::env::var_os("BOOTBENCH_STEPS").is_some();
    let mut cmd = Command::new(corral_tests::corral_bin());
    if steps_on {
        cmd.env("CORRAL_BOOT_TRACE", "1").stderr(Stdio::piped());
    } else {
        cmd.stderr(Stdio::inherit());
    }
    let m0 = monotonic_ns();
    let t0 = Instant::now();
    let mut child = cmd
        .args([
            "run",
            "--vcpus",
            vcpus,
            "--memory",
            mem,
            "--cmdline",
            "probe.mode=spin probe.secs=2",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn corral");
    let reader = child.stderr.take().map(|e| {
        std::thread::spawn(move || {
            let mut steps = Steps::new();
            for line in BufReader::new(e).lines().take(1000) {
                let Ok(line) = line else { break };
                let mut f = line.split_whitespace();
                if f.next() == Some("corral-boot-step")
                    && let (Some(name), Some(Ok(ns))) = (f.next(), f.next().map(str::parse::<u64>))
                {
                    steps.push((name.to_string(), ns.saturating_sub(m0) as f64 / 1e3));
                }
            }
            steps
        })
    });
    let mut out = child.stdout.take().expect("stdout");
    let mut buf = Vec::new();
    let mut b = [0u8; 256];
    let ms = loop {
        let n = out.read(&mut b).expect("read");
        assert!(n > 0, "corral exited before PROBE-UP");
        buf.extend_from_slice(&b[..n]);
        if buf.windows(8).any(|w| w == b"PROBE-UP") {
            break t0.elapsed().as_secs_f64() * 1e3;
        }
    };
    let up_us = monotonic_ns().saturating_sub(m0) as f64 / 1e3;
    let rss = rss_kib(child.id()).unwrap_or(0);
    if std::env::var_os("BOOTBENCH_SMAPS").is_some() {
        print_smaps(child.id());
    }
    let _ = child.kill();
    let _ = child.wait();
    let mut steps = reader.and_then(|r| r.join().ok()).unwrap_or_default();
    if steps_on {
        steps.push(("PROBE-UP-seen".into(), up_us));
    }
    (ms, rss, steps)
}

/// Median offset of each step over the runs, in the order of the first run,
/// with the time since the step before.
fn print_steps(runs: &[Steps]) {
    let Some(first) = runs.first() else { return };
    let mut by: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in runs {
        for (n, us) in r {
            by.entry(n.as_str()).or_default().push(*us);
        }
    }
    println!(
        "start-up steps (µs after spawn over {} runs: median, its delta from the step before, min):",
        runs.len()
    );
    let mut prev = 0.0;
    for (n, _) in first {
        let Some(v) = by.get_mut(n.as_str()) else {
            continue;
        };
        v.sort_by(|a, b| a.total_cmp(b));
        let med = v[v.len() / 2];
        println!(
            "  {n:16} {med:8.0} µs  (+{:6.0})  min {:8.0}",
            med - prev,
            v[0]
        );
        prev = med;
    }
}

/// `bootbench side`: `corral run` against `corral vmm`, interleaved.
fn side_by_side(rounds: usize, vcpus: &str, mem: &str) {
    let v: u8 = vcpus.parse().expect("VCPUS is a number 1..=254");
    let m: u64 = mem.parse().expect("MEMORY_MIB is a number");
    const NAMES: [&str; 3] = ["corral run", "corral vmm", "corral vmm, jailed"];
    let once = |which: usize, n: usize| match which {
        0 => one(vcpus, mem),
        1 => vmm::one(v, m, false, n),
        _ => vmm::one(v, m, true, n),
    };
    println!(
        "boot side by side: {vcpus} vCPU, {mem} MiB, {rounds} rounds after 1 warm-up \
         (order reversed every other round)"
    );
    for w in 0..3 {
        once(w, 0);
    }
    let mut t: [Vec<f64>; 3] = Default::default();
    let mut r: [Vec<u64>; 3] = Default::default();
    let mut steps: [Vec<Steps>; 3] = Default::default();
    for i in 0..rounds {
        let order: [usize; 3] = if i % 2 == 0 { [0, 1, 2] } else { [2, 1, 0] };
        let mut line = format!("round {:2}:", i + 1);
        let mut got: [(f64, u64, Steps); 3] = Default::default();
        for w in order {
            got[w] = once(w, i + 1);
        }
        for (w, (ms, rss, st)) in got.into_iter().enumerate() {
            t[w].push(ms);
            r[w].push(rss);
            steps[w].push(st);
            line += &format!("  {} {ms:6.2} ms {rss:5} KiB", ["run", "vmm", "jail"][w]);
        }
        println!("{line}");
    }
    let pair_ratios = |w: usize| {
        let mut q: Vec<f64> = t[w].iter().zip(&t[0]).map(|(a, b)| a / b).collect();
        q.sort_by(|a, b| a.total_cmp(b));
        q[q.len() / 2]
    };
    let mut med_t = [0.0; 3];
    for w in 0..3 {
        let mut ts = t[w].clone();
        ts.sort_by(|a, b| a.total_cmp(b));
        let mut rs = r[w].clone();
        rs.sort();
        med_t[w] = ts[ts.len() / 2];
        println!(
            "{:20} time to PROBE-UP min {:.2} / median {:.2} / max {:.2} ms; \
             RSS median {} KiB ({:.2} MiB), max {} KiB",
            NAMES[w],
            ts[0],
            med_t[w],
            ts[ts.len() - 1],
            rs[rs.len() / 2],
            rs[rs.len() / 2] as f64 / 1024.0,
            rs[rs.len() - 1]
        );
    }
    if std::env::var_os("BOOTBENCH_STEPS").is_some() {
        for w in 0..3 {
            println!("{}:", NAMES[w]);
            print_steps(&steps[w]);
        }
    }
    for w in 1..3 {
        let ratio = med_t[w] / med_t[0];
        println!(
            "{} / corral run: {ratio:.2}x of the medians, {:.2}x median of the per-round \
             ratios (guard <= 1.5x: {})",
            NAMES[w],
            pair_ratios(w),
            if ratio <= 1.5 { "met" } else { "NOT met" }
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).is_some_and(|a| a == "jail-ab") {
        let arg = |i: usize, d: u64| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
        vmm::jail_ab(arg(2, 21) as usize, arg(3, 1) as u8, arg(4, 128));
        return;
    }
    if args.get(1).is_some_and(|a| a == "side") {
        let rounds = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(21);
        let vcpus = args.get(3).map(String::as_str).unwrap_or("1");
        let mem = args.get(4).map(String::as_str).unwrap_or("128");
        side_by_side(rounds, vcpus, mem);
        return;
    }
    let runs: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(11);
    let vcpus = args.get(2).map(String::as_str).unwrap_or("1");
    let mem = args.get(3).map(String::as_str).unwrap_or("128");
    println!(
        "boot: {} vCPU, {} MiB, {} runs after 1 warm-up",
        vcpus, mem, runs
    );
    one(vcpus, mem);
    let mut t = Vec::new();
    let mut r = Vec::new();
    let mut all_steps = Vec::new();
    for i in 0..runs {
        let (ms, rss, steps) = one(vcpus, mem);
        all_steps.push(steps);
        println!(
            "run {:2}: {:6.2} ms to PROBE-UP, RSS {:5} KiB",
            i + 1,
            ms,
            rss
        );
        t.push(ms);
        r.push(rss);
    }
    t.sort_by(|a, b| a.total_cmp(b));
    r.sort();
    let med = |v: &[f64]| v[v.len() / 2];
    println!(
        "time to PROBE-UP: min {:.2} ms, median {:.2} ms, max {:.2} ms",
        t[0],
        med(&t),
        t[t.len() - 1]
    );
    println!(
        "RSS at PROBE-UP:  min {} KiB, median {} KiB ({:.2} MiB), max {} KiB",
        r[0],
        r[r.len() / 2],
        r[r.len() / 2] as f64 / 1024.0,
        r[r.len() - 1]
    );
    if std::env::var_os("BOOTBENCH_STEPS").is_some() {
        print_steps(&all_steps);
    }
}
