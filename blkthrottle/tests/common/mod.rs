//! Fake-clock simulation helpers shared by the integration tests.
#![allow(dead_code)]

use corral_blkthrottle::{Decision, Limits, Nanos, OpKind, Request, Throttle, ThrottleGroup};

pub const S: u64 = 1_000_000_000;
pub const MS: u64 = 1_000_000;

/// Next poll instant for a caller whose timer has granularity `grid` ns
/// (1 = exact): the first grid point at or after `until`.
pub fn quantize(until: Nanos, grid: u64) -> Nanos {
    until.div_ceil(grid).saturating_mul(grid)
}

/// Admitted ops and bytes of one backlogged stream of `req`, counting
/// admissions at instants in `(from, to]`.
pub fn backlogged(limits: &Limits, req: Request, grid: u64, from: Nanos, to: Nanos) -> (u64, u64) {
    let mut t = Throttle::new(limits, 0).unwrap();
    let mut now = 0;
    let (mut ops, mut bytes) = (0, 0);
    loop {
        match t.poll(req, now) {
            Decision::Admit => {
                if now > from && now <= to {
                    ops += 1;
                    bytes += req.charged_bytes();
                }
            }
            Decision::Wait { until, .. } => {
                assert!(until > now, "wait instant {until} not after {now}");
                let next = quantize(until, grid);
                if next > to {
                    return (ops, bytes);
                }
                now = next;
            }
        }
    }
}

/// One simulated disk of a group simulation.
pub struct SimDisk {
    pub throttle: Throttle,
    pub req: Request,
    pub next: Nanos,
    /// (ops, bytes) admitted in the measurement window.
    pub ops: u64,
    pub bytes: u64,
    /// Every admission: (time, request).
    pub log: Vec<(Nanos, Request)>,
}

/// Runs backlogged disks (each always has `req` at the head of its queue),
/// each polling on its own timer of granularity `grid`, until `to`.
/// Disks due at the same instant run in an order rotated by `seed`.
/// Counts admissions in `(from, to]`.
pub fn run_group(
    disks: &mut [SimDisk],
    grid: u64,
    from: Nanos,
    to: Nanos,
    seed: u64,
    keep_log: bool,
) {
    let n = disks.len();
    let mut rot = seed as usize;
    loop {
        let now = disks.iter().map(|d| d.next).min().unwrap();
        if now > to {
            return;
        }
        rot = rot
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let first = (rot >> 33) % n;
        for k in 0..n {
            let i = (first + k) % n;
            if disks[i].next != now {
                continue;
            }
            let d = &mut disks[i];
            loop {
                match d.throttle.poll(d.req, now) {
                    Decision::Admit => {
                        if now > from && now <= to {
                            d.ops += 1;
                            d.bytes += d.req.charged_bytes();
                        }
                        if keep_log {
                            d.log.push((now, d.req));
                        }
                    }
                    Decision::Wait { until, .. } => {
                        assert!(until > now, "wait instant {until} not after {now}");
                        d.next = quantize(until, grid);
                        break;
                    }
                }
            }
        }
    }
}

pub fn group_disks(
    group: &ThrottleGroup,
    reqs: &[Request],
    weights: &[u32],
    own: &[Limits],
) -> Vec<SimDisk> {
    reqs.iter()
        .enumerate()
        .map(|(i, &req)| {
            let mut throttle = Throttle::new(own.get(i).unwrap_or(&Limits::UNLIMITED), 0).unwrap();
            throttle
                .join_group(group, weights.get(i).copied().unwrap_or(100), None)
                .unwrap();
            SimDisk {
                throttle,
                req,
                next: 0,
                ops: 0,
                bytes: 0,
                log: Vec::new(),
            }
        })
        .collect()
}

/// The six buckets as (is_bytes, direction) with the units a request takes.
pub fn units(bucket: usize, req: &Request) -> Option<u64> {
    let (bytes, dir) = (bucket < 3, bucket % 3);
    let touches = matches!(
        (req.kind, dir),
        (_, 0) | (OpKind::Read, 1) | (OpKind::Write | OpKind::Other, 2)
    );
    if !touches {
        return None;
    }
    if bytes {
        let b = req.charged_bytes();
        (b > 0).then_some(b)
    } else {
        Some(1)
    }
}

/// (rate, size, one_time) of bucket `i` as the crate documents it.
pub fn bucket_params(l: &Limits, i: usize) -> Option<(u64, u64, u64)> {
    let nz = |v: Option<u64>| v.filter(|&x| x != 0);
    let rate = nz([l.bps, l.rbps, l.wbps, l.iops, l.riops, l.wiops][i])?;
    let (burst, ot) = if i < 3 {
        (l.burst_bytes, l.onetime_bytes)
    } else {
        (l.burst_ops, l.onetime_ops)
    };
    Some((rate, nz(burst).unwrap_or(rate), nz(ot).unwrap_or(0)))
}

/// Checks `admitted(t, t+T) ≤ r·(T + 1 ns + extra) + O + max(b, M)` for
/// every window whose ends are admission instants, for every configured
/// bucket of `l`, over the admissions `log` (sorted by time). `extra` is 0
/// for a disk's own buckets (charged when the disk polls); for a group's
/// buckets, seen at the disks, it is how late a disk may pick up a grant made
/// on its behalf (its timer's lateness). Returns the worst ratio
/// admitted / bound seen, for information.
pub fn check_window_bound(l: &Limits, log: &[(Nanos, Request)], extra: u64) -> f64 {
    let mut worst: f64 = 0.0;
    for b in 0..6 {
        let Some((rate, size, ot)) = bucket_params(l, b) else {
            continue;
        };
        let pts: Vec<(Nanos, u64)> = log
            .iter()
            .filter_map(|(t, r)| units(b, r).map(|u| (*t, u)))
            .collect();
        let m = pts.iter().map(|p| p.1).max().unwrap_or(0);
        let slack = (ot as u128 + size.max(m) as u128) * S as u128;
        for i in 0..pts.len() {
            let mut sum: u128 = 0;
            for j in i..pts.len() {
                sum += pts[j].1 as u128;
                let dt = (pts[j].0 - pts[i].0) as u128;
                let bound = rate as u128 * (dt + 1 + extra as u128) + slack;
                assert!(
                    sum * S as u128 <= bound,
                    "bucket {b} (rate {rate}, size {size}, one-time {ot}, max req {m}): \
                     {sum} units admitted in [{}, {}] exceeds bound {}",
                    pts[i].0,
                    pts[j].0,
                    bound as f64 / S as f64
                );
                worst = worst.max((sum * S as u128) as f64 / bound as f64);
            }
        }
    }
    worst
}
