//! The capacity the policy plans with: the CPU that corral's VMs can really
//! get on a host that also runs other work.
//!
//! The model's [`Capacity`](crate::Capacity) is what the daemon may use (its
//! affinity mask). Two things take part of it away, and the VMM measures
//! both and hands them in:
//!
//! * **steal**: CPU the hypervisor below gives to others (`/proc/stat`);
//! * **outside load**: CPU that processes other than corral's VMs use (host
//!   busy time from `/proc/stat` less the VMs' own thread clocks). The
//!   host's scheduler (CFS) gives those processes their fair share of the
//!   host, whatever corral's shares say; the VMs get the rest.
//!
//! Planning with the nominal capacity beside an outside load promises the
//! VMs CPU they cannot get, and the shares among them break: with classes
//! 3:1 on 2 CPUs beside one busy loop, gold is entitled to 150 % but, when
//! it runs, gets the ~133 % that CFS leaves it; its unreachable credit
//! flows to bronze, and gold ended with 62 % of the VMs' CPU instead of
//! 75 %. Planning with the ~133 % that is there makes every entitlement
//! reachable, and the ratio holds (see the simulator's outside load,
//! [`Simulator::set_outside_load`](crate::sim::Simulator::set_outside_load)).
//!
//! The outside load depends on what corral runs (CFS divides by threads),
//! so it is measured under the admission in force and smoothed
//! ([`OUTSIDE_TAU_NS`]); the estimate settles where the VMs' plan and the
//! host's division agree.
//!
//! Reservations are guarantees of the CPU that is there: when the
//! reservations that classes claim (bounded by their demand) exceed the
//! planned capacity, they are scaled down in proportion and the policy
//! reports the missing fraction ([`shortfall_ratio`]) instead of hiding it.

/// Time constant of the outside-load average, ns. `/proc/stat` counts in
/// 10 ms jiffies: one 40 ms sample on 2 CPUs is 8 jiffies, ±1 of which is
/// ±25 % of a CPU; averaging over ~1 s of samples brings that to a few %.
pub const OUTSIDE_TAU_NS: u64 = 1_000_000_000;

/// Steal or outside load below this (percent of one CPU) is noise.
const NOISE_PCT: f64 = 1.0;

/// The planned capacity never drops below this fraction of the nominal one
/// (a measurement gone wrong must not starve the VMs).
const MIN_FRACTION: f64 = 0.25;

/// Host CPU taken away from corral's VMs, and the capacity left to plan
/// with. All amounts in percent of one CPU.
#[derive(Debug, Clone, PartialEq)]
pub struct HostLoad {
    nominal: f64,
    steal: f64,
    outside: f64,
    /// Whether an outside-load sample has been seen.
    outside_seen: bool,
    available: f64,
}

impl HostLoad {
    /// No load measured yet: the whole `nominal` capacity is available.
    pub fn new(nominal_pct: f64) -> Self {
        HostLoad {
            nominal: nominal_pct,
            steal: 0.0,
            outside: 0.0,
            outside_seen: false,
            available: nominal_pct,
        }
    }

    /// The model's capacity.
    pub fn nominal_pct(&self) -> f64 {
        self.nominal
    }

    /// Steal, as last measured (0 below noise).
    pub fn steal_pct(&self) -> f64 {
        self.steal
    }

    /// Outside load, smoothed (0 below noise).
    pub fn outside_pct(&self) -> f64 {
        if self.outside < NOISE_PCT {
            0.0
        } else {
            self.outside
        }
    }

    /// The capacity to plan with: nominal less steal and outside load, at
    /// least a quarter of the nominal capacity.
    pub fn available_pct(&self) -> f64 {
        self.available
    }

    fn recompute(&mut self) {
        let taken = self.steal + self.outside_pct();
        self.available = (self.nominal - taken).max(self.nominal * MIN_FRACTION);
    }

    /// Changes the nominal capacity.
    pub fn set_nominal(&mut self, nominal_pct: f64) {
        self.nominal = nominal_pct;
        self.recompute();
    }

    /// Steal over the last measurement (`None`: not measured, counts as 0).
    /// Kept only if it moved by at least 1 % of a CPU (so the plan is not
    /// redone for noise).
    pub fn set_steal(&mut self, steal_pct: Option<f64>) {
        let s = steal_pct.filter(|s| s.is_finite()).unwrap_or(0.0).max(0.0);
        let s = if s < NOISE_PCT { 0.0 } else { s };
        if (s - self.steal).abs() >= NOISE_PCT {
            self.steal = s;
            self.recompute();
        }
    }

    /// One measurement of the CPU used by everything but corral's VMs over
    /// the last `interval_ns`, folded into an average of time constant
    /// [`OUTSIDE_TAU_NS`] (the first sample is taken as it is).
    pub fn add_outside_sample(&mut self, outside_pct: f64, interval_ns: u64) {
        if !outside_pct.is_finite() || interval_ns == 0 {
            return;
        }
        let x = outside_pct.clamp(0.0, self.nominal);
        if self.outside_seen {
            let a = (interval_ns as f64 / OUTSIDE_TAU_NS as f64).min(1.0);
            self.outside += a * (x - self.outside);
        } else {
            self.outside = x;
            self.outside_seen = true;
        }
        self.recompute();
    }

    /// Forgets the outside load (e.g. the caller stopped measuring it).
    pub fn clear_outside(&mut self) {
        self.outside = 0.0;
        self.outside_seen = false;
        self.recompute();
    }
}

/// Fraction of the reservations claimed now (`claimed_pct`: each class's
/// reservation bounded by its demand) that `available_pct` cannot deliver:
/// `0` when they fit, up to `1`.
pub fn shortfall_ratio(claimed_pct: f64, available_pct: f64) -> f64 {
    if claimed_pct <= 0.0 {
        return 0.0;
    }
    ((claimed_pct - available_pct) / claimed_pct).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_load_is_smoothed_and_subtracted() {
        let mut h = HostLoad::new(200.0);
        assert_eq!(h.available_pct(), 200.0);
        h.add_outside_sample(67.0, 40_000_000);
        assert!((h.available_pct() - 133.0).abs() < 1e-9);
        // One noisy sample moves the average by interval/tau of the error.
        h.add_outside_sample(167.0, 40_000_000);
        assert!((h.outside_pct() - 71.0).abs() < 1e-9, "{}", h.outside_pct());
        // Alternating jiffy-quantised samples average out.
        for i in 0..200 {
            let x = if i % 2 == 0 { 50.0 } else { 100.0 };
            h.add_outside_sample(x, 40_000_000);
        }
        assert!((h.outside_pct() - 75.0).abs() < 2.0, "{}", h.outside_pct());
        h.set_steal(Some(10.0));
        assert!((h.available_pct() - (200.0 - 10.0 - h.outside_pct())).abs() < 1e-9);
        // Never below a quarter of nominal.
        h.add_outside_sample(1e9, 2 * OUTSIDE_TAU_NS);
        assert_eq!(h.available_pct(), 50.0);
        h.clear_outside();
        assert_eq!(h.available_pct(), 190.0);
        // Noise is ignored.
        h.set_steal(Some(0.5));
        h.add_outside_sample(0.5, 40_000_000);
        assert_eq!(h.available_pct(), 200.0);
    }

    #[test]
    fn shortfall_is_the_missing_fraction_of_claimed_reservations() {
        assert_eq!(shortfall_ratio(0.0, 200.0), 0.0);
        assert_eq!(shortfall_ratio(150.0, 200.0), 0.0);
        assert_eq!(shortfall_ratio(100.0, 100.0), 0.0);
        assert!((shortfall_ratio(150.0, 100.0) - 1.0 / 3.0).abs() < 1e-9);
    }
}
