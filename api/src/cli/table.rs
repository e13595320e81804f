//! Human output of the client commands: aligned tables, sizes and rates in
//! binary units, limits as the CLI spells them, and `vm show`.

use crate::dto;

/// Prints rows as an aligned table.
pub fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < w.len() {
                w[i] = w[i].max(c.chars().count());
            }
        }
    }
    let line = |cells: &[String]| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                let width = w.get(i).copied().unwrap_or(0);
                s.push_str(&format!("{c:<width$}  "));
            }
        }
        println!("{}", s.trim_end());
    };
    line(&header.iter().map(|h| h.to_string()).collect::<Vec<_>>());
    for r in rows {
        line(r);
    }
}

/// `v` or `-`.
pub fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or("-".into(), |v| v.to_string())
}

/// One decimal, and never `-0.0` (a rounding residue shows as `0.0`).
pub fn num1(v: f64) -> String {
    let r = (v * 10.0).round() / 10.0;
    if r == 0.0 || !r.is_finite() {
        "0.0".into()
    } else {
        format!("{r:.1}")
    }
}

/// A percentage figure with one decimal, `-` when absent.
pub fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), num1)
}

/// Bytes in binary units: `512 B`, `1.5 KiB`, `16.0 MiB`.
pub fn bytes(n: f64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n.abs() < 1024.0 {
        return format!("{} B", n.round().max(0.0));
    }
    let mut v = n / 1024.0;
    let mut u = 0;
    while v.abs() >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{} {}", num1(v), UNITS[u])
}

/// A byte rate: `bytes(n)/s`.
pub fn rate(n: f64) -> String {
    format!("{}/s", bytes(n))
}

/// Limits as `key value` pairs in the CLI's keys (`bps 10.0 MiB/s, iops
/// 500/s`), or `none`.
pub fn limits(l: &dto::Limits) -> String {
    let mut out = vec![];
    for (k, v, is_bytes) in [
        ("bps", l.bps, true),
        ("iops", l.iops, false),
        ("rbps", l.rbps, true),
        ("wbps", l.wbps, true),
        ("riops", l.riops, false),
        ("wiops", l.wiops, false),
    ] {
        if let Some(v) = v.filter(|v| *v != 0) {
            let shown = if is_bytes {
                rate(v as f64)
            } else {
                format!("{v}/s")
            };
            out.push(format!("{k} {shown}"));
        }
    }
    if let Some(v) = l.burst_bytes.filter(|v| *v != 0) {
        out.push(format!("burst_bytes {}", bytes(v as f64)));
    }
    if let Some(v) = l.burst_ops.filter(|v| *v != 0) {
        out.push(format!("burst_ops {v}"));
    }
    if out.is_empty() {
        "none".into()
    } else {
        out.join(", ")
    }
}

/// The lines of one disk in `vm show`.
pub fn disk_lines(d: &dto::Disk) -> Vec<String> {
    let mut flags = vec![];
    if d.read_only {
        flags.push("read-only");
    }
    if d.direct {
        flags.push("O_DIRECT");
    }
    let flags = if flags.is_empty() {
        String::new()
    } else {
        format!(" ({})", flags.join(", "))
    };
    let mut v = vec![
        format!(
            "disk {}: {}{flags}, {}",
            d.id,
            d.path,
            bytes(d.capacity_bytes as f64)
        ),
        format!("  limits:    {}", limits(&d.limits)),
    ];
    if let Some(g) = &d.group {
        let w = d
            .group_weight
            .map(|w| format!(", weight {w}"))
            .unwrap_or_default();
        v.push(format!(
            "  group:     {g}{w} (the class's I/O limits apply too)"
        ));
    }
    match &d.stats {
        Some(s) => {
            v.push(format!(
                "  read:      {} requests, {}",
                s.read_ops,
                bytes(s.read_bytes as f64)
            ));
            v.push(format!(
                "  written:   {} requests, {}",
                s.write_ops,
                bytes(s.write_bytes as f64)
            ));
            v.push(format!("  other:     {} requests (flush)", s.other_ops));
            v.push(format!(
                "  throttled: {} requests waited {} s in all; {} queued now",
                s.throttled_requests,
                num3(s.throttled_seconds),
                s.queue_depth
            ));
        }
        None => v.push("  stats:     none (the VM is not running)".into()),
    }
    v
}

fn num3(v: f64) -> String {
    let r = (v * 1000.0).round() / 1000.0;
    if r == 0.0 || !r.is_finite() {
        "0.000".into()
    } else {
        format!("{r:.3}")
    }
}

/// `vm show`.
pub fn show_vm(v: &dto::Vm) {
    println!("name:      {}", v.name);
    println!("id:        {}", v.id);
    println!("state:     {}", v.state);
    if let Some(e) = &v.exit {
        println!("exit:      {} ({})", e.reason, e.message);
    }
    println!("class:     {} (weight {})", v.class, v.weight);
    println!("vcpus:     {}", v.vcpus);
    println!("memory:    {} MiB", v.memory_mib);
    println!(
        "kernel:    {}",
        v.kernel.as_deref().unwrap_or("built-in probe")
    );
    if let Some(i) = &v.initrd {
        println!("initrd:    {i}");
    }
    println!("cmdline:   {}", v.cmdline);
    if let Some(u) = v.uptime_seconds {
        println!("uptime:    {} s", num1(u));
    }
    println!("cpu:       {} s", num3(v.cpu_seconds));
    if let Some(s) = &v.sched {
        println!(
            "scheduler: entitled {}% of one CPU, used {}%, {} ({} s parked in {} parks)",
            num1(s.entitlement_pct),
            num1(s.used_pct),
            if s.parked { "parked now" } else { "running" },
            num3(s.parked_seconds),
            s.park_count
        );
    }
    let exits: Vec<String> = v
        .exits
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| format!("{k}={n}"))
        .collect();
    println!("exits:     {}", exits.join(" "));
    for d in &v.disks {
        for line in disk_lines(d) {
            println!("{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_units() {
        assert_eq!(num1(-0.01), "0.0");
        assert_eq!(num1(-0.0), "0.0");
        assert_eq!(num1(12.34), "12.3");
        assert_eq!(bytes(0.0), "0 B");
        assert_eq!(bytes(1536.0), "1.5 KiB");
        assert_eq!(bytes((16u64 << 20) as f64), "16.0 MiB");
        assert_eq!(rate(10.0 * 1048576.0), "10.0 MiB/s");
        let l = dto::Limits {
            bps: Some(10 << 20),
            iops: Some(500),
            burst_ops: Some(10),
            ..Default::default()
        };
        assert_eq!(limits(&l), "bps 10.0 MiB/s, iops 500/s, burst_ops 10");
        assert_eq!(limits(&dto::Limits::default()), "none");
    }
}
