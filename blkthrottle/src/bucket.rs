//! Exact token buckets and the limiter that combines up to six of them.
//!
//! See the crate documentation for the arithmetic.

use crate::limits::{
    BYTES_READ, BYTES_TOTAL, BYTES_WRITE, BucketConfig, Limits, NUM_BUCKETS, OPS_READ, OPS_TOTAL,
    OPS_WRITE,
};
use crate::{Nanos, OpKind, Request};

/// Nanoseconds per second: tokens are stored multiplied by this.
pub(crate) const SCALE: i128 = 1_000_000_000;

/// One token bucket. Tokens are kept in *scaled* units (token × 10⁹), so a
/// refill over `dt` nanoseconds at `rate` tokens/s adds exactly `rate × dt`
/// scaled units: no division, no rounding, no drift.
#[derive(Clone, Debug)]
pub(crate) struct Bucket {
    rate: u64,
    size: u64,
    /// Refilling tokens × 10⁹; may be negative (debt); at most
    /// `size × 10⁹ + rate − 1` (see [`Bucket::advance`]).
    level: i128,
    /// Remaining one-time tokens (whole units, never refilled).
    one_time: u64,
    /// Time up to which `level` has been refilled.
    last: Nanos,
}

impl Bucket {
    pub(crate) fn new(cfg: BucketConfig, now: Nanos) -> Bucket {
        Bucket {
            rate: cfg.rate,
            size: cfg.size,
            level: cfg.size as i128 * SCALE,
            one_time: cfg.one_time,
            last: now,
        }
    }

    fn cap(&self) -> i128 {
        self.size as i128 * SCALE
    }

    /// Refills up to `now`. Times before `last` (a slightly stale clock read on
    /// another thread) are treated as `last`: time never runs backwards.
    pub(crate) fn advance(&mut self, now: Nanos) {
        if now <= self.last {
            return;
        }
        let dt = now - self.last;
        self.last = now;
        let cap = self.cap();
        if self.level >= cap {
            // Full for at least a nanosecond already.
            self.level = cap;
            return;
        }
        let deficit = (cap - self.level) as u128;
        // u64 × u64 always fits in u128.
        let gain = self.rate as u128 * dt as u128;
        if gain >= deficit {
            // The bucket became full at the fractional instant
            // `now − over / rate`. If that was less than a nanosecond ago,
            // keep the overshoot (< `rate` scaled units): it is what a
            // request waiting for a full bucket would have had at that
            // instant, and dropping it would make every such wait lose up to
            // a nanosecond to the rounding of the wake-up instant.
            let over = gain - deficit;
            self.level = cap
                + if over < self.rate as u128 {
                    over as i128
                } else {
                    0
                };
        } else {
            self.level += gain as i128;
        }
    }

    /// Scaled refilling-token level needed to admit a request of `n` units:
    /// `n` tokens if the bucket can ever hold them (size + remaining one-time
    /// tokens), otherwise a full bucket (the debt rule).
    fn threshold(&self, n: u64) -> i128 {
        let n = n as i128;
        let ot = self.one_time as i128;
        (n.min(self.size as i128 + ot) - ot) * SCALE
    }

    /// Earliest instant (≥ `now`, or `now` itself if ready) at which `n`
    /// units are admissible, assuming nothing else is charged meanwhile.
    pub(crate) fn ready_at(&mut self, n: u64, now: Nanos) -> Nanos {
        self.advance(now);
        let need = self.threshold(n);
        if self.level >= need {
            return now;
        }
        let missing = (need - self.level) as u128;
        let rate = self.rate as u128;
        let wait = missing.div_ceil(rate);
        let wait = u64::try_from(wait).unwrap_or(u64::MAX);
        self.last.saturating_add(wait)
    }

    /// Nanoseconds between the instant the bucket first admits `n` units
    /// (its level reaches [`Self::threshold`]) and the instant it is full:
    /// how late a caller may poll for such a request without the bucket
    /// overflowing, i.e. without losing rate. Zero for a request that needs
    /// the whole bucket (a bucket one request deep).
    pub(crate) fn headroom_ns(&self, n: u64) -> Nanos {
        let room = (self.cap() - self.threshold(n)).max(0) as u128;
        u64::try_from(room / self.rate as u128).unwrap_or(u64::MAX)
    }

    /// Takes `n` units: one-time tokens first, then the refilling ones (which
    /// may go negative).
    pub(crate) fn charge(&mut self, n: u64) {
        let from_one_time = n.min(self.one_time);
        self.one_time -= from_one_time;
        self.level -= (n - from_one_time) as i128 * SCALE;
    }

    /// Applies a new configuration, keeping the tokens earned so far (clamped
    /// to the new size), any debt, and the one-time tokens left (clamped to
    /// the new one-time amount).
    pub(crate) fn reconfigure(&mut self, cfg: BucketConfig, now: Nanos) {
        self.advance(now);
        self.rate = cfg.rate;
        self.size = cfg.size;
        self.level = self.level.min(self.cap());
        self.one_time = self.one_time.min(cfg.one_time);
    }

    /// Virtual-time cost of `n` units in picoseconds of this bucket's refill
    /// time (`n / rate` seconds), rounded up.
    pub(crate) fn cost_ps(&self, n: u64) -> u128 {
        (n as u128 * 1_000_000_000_000).div_ceil(self.rate as u128)
    }

    #[cfg(test)]
    pub(crate) fn level_scaled(&self) -> i128 {
        self.level
    }
}

/// Which buckets (bit i = bucket index i) a request touches, given which are
/// configured.
pub(crate) fn touch_mask(req: &Request) -> u8 {
    let bytes = req.charged_bytes() > 0;
    let b = |i: usize| 1u8 << i;
    match req.kind {
        OpKind::Read => {
            b(OPS_TOTAL)
                | b(OPS_READ)
                | if bytes {
                    b(BYTES_TOTAL) | b(BYTES_READ)
                } else {
                    0
                }
        }
        OpKind::Write => {
            b(OPS_TOTAL)
                | b(OPS_WRITE)
                | if bytes {
                    b(BYTES_TOTAL) | b(BYTES_WRITE)
                } else {
                    0
                }
        }
        OpKind::Other => b(OPS_TOTAL) | b(OPS_WRITE),
    }
}

/// Units a request takes from bucket `i`.
fn need(i: usize, req: &Request) -> u64 {
    if i < OPS_TOTAL {
        req.charged_bytes()
    } else {
        1
    }
}

/// Iterates over the set bits of a mask.
pub(crate) fn bits(mut mask: u8) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        if mask == 0 {
            None
        } else {
            let i = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            Some(i)
        }
    })
}

/// Up to six buckets (total/read/write × bytes/ops) applied together.
#[derive(Clone, Debug, Default)]
pub(crate) struct Limiter {
    buckets: [Option<Bucket>; NUM_BUCKETS],
    configured: u8,
}

impl Limiter {
    pub(crate) fn new(limits: &Limits, now: Nanos) -> Limiter {
        let mut l = Limiter::default();
        l.set_limits(limits, now);
        l
    }

    /// Buckets that exist.
    pub(crate) fn configured(&self) -> u8 {
        self.configured
    }

    /// Buckets that `req` touches and that exist.
    pub(crate) fn mask(&self, req: &Request) -> u8 {
        touch_mask(req) & self.configured
    }

    /// Earliest instant at which every bucket in `mask` admits `req`; `now` if
    /// it is admissible now. Because buckets only gain tokens until charged,
    /// the maximum of the per-bucket instants is exactly the earliest instant
    /// at which all of them are ready.
    pub(crate) fn ready_at_mask(&mut self, mask: u8, req: &Request, now: Nanos) -> Nanos {
        let mut t = now;
        let mut m = mask;
        while m != 0 {
            let i = m.trailing_zeros() as usize;
            m &= m - 1;
            if let Some(b) = &mut self.buckets[i] {
                t = t.max(b.ready_at(need(i, req), now));
            }
        }
        t
    }

    /// How long after the instant `req` becomes admissible on the buckets in
    /// `mask` it may still be admitted without a binding bucket (one whose
    /// ready instant is that instant) overflowing meanwhile: the headroom of
    /// the tightest binding bucket. `Nanos::MAX` with no bucket.
    pub(crate) fn slack_mask(&mut self, mask: u8, req: &Request, now: Nanos) -> Nanos {
        let until = self.ready_at_mask(mask, req, now);
        let mut slack = Nanos::MAX;
        let mut m = mask;
        while m != 0 {
            let i = m.trailing_zeros() as usize;
            m &= m - 1;
            if let Some(b) = &mut self.buckets[i] {
                let n = need(i, req);
                if b.ready_at(n, now) == until {
                    slack = slack.min(b.headroom_ns(n));
                }
            }
        }
        slack
    }

    #[cfg(test)]
    pub(crate) fn ready_at(&mut self, req: &Request, now: Nanos) -> Nanos {
        let m = self.mask(req);
        self.ready_at_mask(m, req, now)
    }

    /// Charges `req` to every bucket it touches (after refilling to `now`).
    #[cfg(test)]
    pub(crate) fn charge(&mut self, req: &Request, now: Nanos) {
        self.charge_mask(self.mask(req), req, now);
    }

    /// Charges `req` to the buckets in `mask` (after refilling to `now`).
    pub(crate) fn charge_mask(&mut self, mask: u8, req: &Request, now: Nanos) {
        let mut m = mask;
        while m != 0 {
            let i = m.trailing_zeros() as usize;
            m &= m - 1;
            if let Some(b) = &mut self.buckets[i] {
                b.advance(now);
                b.charge(need(i, req));
            }
        }
    }

    /// Admits and charges `req` if every bucket has the tokens; otherwise
    /// returns the exact instant at which all of them will.
    #[cfg(test)]
    pub(crate) fn try_admit(&mut self, req: &Request, now: Nanos) -> Result<(), Nanos> {
        let t = self.ready_at(req, now);
        if t <= now {
            self.charge(req, now);
            Ok(())
        } else {
            Err(t)
        }
    }

    /// Largest per-bucket cost of `req` over the buckets in `mask`, in
    /// picoseconds of refill time (the dominant-resource cost used for
    /// fairness).
    pub(crate) fn cost_ps(&self, mask: u8, req: &Request) -> u128 {
        bits(mask)
            .filter_map(|i| self.buckets[i].as_ref().map(|b| b.cost_ps(need(i, req))))
            .max()
            .unwrap_or(0)
    }

    /// Live change: existing buckets keep their tokens (clamped to the new
    /// size) and debt; new buckets start full; removed buckets vanish.
    pub(crate) fn set_limits(&mut self, limits: &Limits, now: Nanos) {
        let cfgs = limits.buckets();
        self.configured = 0;
        for (i, cfg) in cfgs.into_iter().enumerate() {
            match (cfg, &mut self.buckets[i]) {
                (None, slot) => *slot = None,
                (Some(cfg), Some(b)) => b.reconfigure(cfg, now),
                (Some(cfg), slot) => *slot = Some(Bucket::new(cfg, now)),
            }
            if self.buckets[i].is_some() {
                self.configured |= 1 << i;
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn bucket(&self, i: usize) -> Option<&Bucket> {
        self.buckets[i].as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn ops(rate: u64, burst: u64) -> Limits {
        Limits {
            iops: Some(rate),
            burst_ops: Some(burst),
            ..Default::default()
        }
    }

    #[test]
    fn exact_instants() {
        // 3 ops/s: token k arrives at ceil(k * 1e9 / 3) ns.
        let mut l = Limiter::new(&ops(3, 1), 0);
        let r = Request::read(4096);
        assert_eq!(l.try_admit(&r, 0), Ok(()));
        let t = l.try_admit(&r, 0).unwrap_err();
        assert_eq!(t, 333_333_334);
        assert_eq!(l.try_admit(&r, t - 1), Err(t));
        assert_eq!(l.try_admit(&r, t), Ok(()));
        // after 10 s exactly 1 + 30 ops have gone at exact instants
        let mut now = t;
        let mut n = 2;
        loop {
            match l.try_admit(&r, now) {
                Ok(()) => n += 1,
                Err(t) if t <= 10 * S => now = t,
                Err(_) => break,
            }
        }
        assert_eq!(n, 31);
    }

    #[test]
    fn oversize_goes_into_debt() {
        let lim = Limits {
            bps: Some(1000),
            burst_bytes: Some(100),
            ..Default::default()
        };
        let mut l = Limiter::new(&lim, 0);
        let big = Request::write(1000);
        assert_eq!(l.try_admit(&big, 0), Ok(()));
        assert_eq!(l.bucket(BYTES_TOTAL).unwrap().level_scaled(), -900 * SCALE);
        // full again (100 tokens) after 1 s
        assert_eq!(l.try_admit(&big, 1), Err(S));
        assert_eq!(l.try_admit(&big, S), Ok(()));
        // small request needs only its own tokens
        assert_eq!(l.try_admit(&Request::write(10), S), Err(S + 910_000_000));
    }

    #[test]
    fn one_time_is_spent_first_and_not_refilled() {
        let lim = Limits {
            iops: Some(10),
            burst_ops: Some(2),
            onetime_ops: Some(3),
            ..Default::default()
        };
        let mut l = Limiter::new(&lim, 0);
        let r = Request::other();
        for _ in 0..5 {
            assert_eq!(l.try_admit(&r, 0), Ok(()));
        }
        assert_eq!(l.try_admit(&r, 0), Err(100_000_000));
        // after a long idle, only `size` tokens are there again
        for _ in 0..2 {
            assert_eq!(l.try_admit(&r, 100 * S), Ok(()));
        }
        assert!(l.try_admit(&r, 100 * S).is_err());
    }

    #[test]
    fn oversize_with_one_time() {
        let lim = Limits {
            bps: Some(100),
            burst_bytes: Some(10),
            onetime_bytes: Some(50),
            ..Default::default()
        };
        let mut l = Limiter::new(&lim, 0);
        // 55 <= 10 + 50: admitted using 50 one-time + 5 refilling tokens
        assert_eq!(l.try_admit(&Request::read(55), 0), Ok(()));
        // 200 > size: needs a full bucket (5 missing -> 50 ms) and leaves debt
        assert_eq!(l.try_admit(&Request::read(200), 0), Err(50_000_000));
        assert_eq!(l.try_admit(&Request::read(200), 50_000_000), Ok(()));
        assert_eq!(l.bucket(BYTES_TOTAL).unwrap().level_scaled(), -190 * SCALE);
    }

    #[test]
    fn split_and_total() {
        let lim = Limits::parse("bps=1000,rbps=100,wiops=1,burst_bytes=100,burst_ops=1").unwrap();
        let mut l = Limiter::new(&lim, 0);
        assert_eq!(l.try_admit(&Request::read(100), 0), Ok(()));
        // read bucket empty: 100 bytes at 100/s
        assert_eq!(l.try_admit(&Request::read(100), 0), Err(S));
        // writes only see bps (0 left, 100 needed at 1000/s) and wiops
        assert_eq!(l.try_admit(&Request::write(100), 0), Err(S / 10));
        assert_eq!(l.try_admit(&Request::write(100), S / 10), Ok(()));
        // flush takes a write op, no bytes
        assert_eq!(l.try_admit(&Request::other(), S / 10), Err(S / 10 + S));
    }

    #[test]
    fn live_change_keeps_tokens() {
        let mut l = Limiter::new(&ops(100, 100), 0);
        for _ in 0..60 {
            l.try_admit(&Request::read(1), 0).unwrap();
        }
        // 40 left; new size 50 keeps 40
        l.set_limits(&ops(10, 50), 0);
        assert_eq!(l.bucket(OPS_TOTAL).unwrap().level_scaled(), 40 * SCALE);
        // new size 20 clamps to 20
        l.set_limits(&ops(10, 20), 0);
        assert_eq!(l.bucket(OPS_TOTAL).unwrap().level_scaled(), 20 * SCALE);
        // refill at the new rate
        for _ in 0..20 {
            l.try_admit(&Request::read(1), 0).unwrap();
        }
        assert_eq!(l.try_admit(&Request::read(1), 0), Err(S / 10));
        // remove: admissible at once
        l.set_limits(&Limits::UNLIMITED, 0);
        for _ in 0..1000 {
            assert_eq!(l.try_admit(&Request::read(1 << 20), 0), Ok(()));
        }
    }

    #[test]
    fn stale_clock_is_harmless() {
        let mut l = Limiter::new(&ops(10, 1), 1000);
        l.try_admit(&Request::read(1), 1000).unwrap();
        // a reader with an older clock sees the same absolute instant
        assert_eq!(l.try_admit(&Request::read(1), 500), Err(1000 + S / 10));
    }

    #[test]
    fn huge_values_do_not_overflow() {
        let lim = Limits {
            bps: Some(u64::MAX),
            iops: Some(1),
            burst_bytes: Some(u64::MAX),
            burst_ops: Some(1),
            onetime_bytes: Some(u64::MAX),
            ..Default::default()
        };
        let mut l = Limiter::new(&lim, 0);
        l.try_admit(&Request::write(u64::MAX), 0).unwrap();
        let t = l.try_admit(&Request::write(u64::MAX), u64::MAX - 5);
        assert!(t.is_ok() || t.unwrap_err() >= u64::MAX - 5);
        let mut l = Limiter::new(
            &Limits {
                bps: Some(1),
                burst_bytes: Some(1),
                ..Default::default()
            },
            0,
        );
        l.try_admit(&Request::write(u64::MAX), 0).unwrap();
        assert_eq!(l.try_admit(&Request::write(1), 0), Err(u64::MAX));
    }
}
