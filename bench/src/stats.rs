//! Summary statistics the kernel lists used: min / avg / max / sdev / spread.

/// Summary of one series of samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Smallest.
    pub min: f64,
    /// Mean.
    pub avg: f64,
    /// Largest.
    pub max: f64,
    /// Sample standard deviation (n - 1); 0 for one sample.
    pub sdev: f64,
}

impl Summary {
    /// Summary of `xs`; `None` when empty.
    pub fn of(xs: &[f64]) -> Option<Self> {
        if xs.is_empty() {
            return None;
        }
        let n = xs.len();
        let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
        let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let avg = xs.iter().sum::<f64>() / n as f64;
        let sdev = if n > 1 {
            (xs.iter().map(|x| (x - avg).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
        } else {
            0.0
        };
        Some(Self {
            n,
            min,
            avg,
            max,
            sdev,
        })
    }

    /// (max - min) / avg, as a fraction.
    pub fn spread(&self) -> f64 {
        if self.avg == 0.0 {
            0.0
        } else {
            (self.max - self.min) / self.avg
        }
    }
}

/// `(x - base) / base` in percent.
pub fn diff_pct(x: f64, base: f64) -> f64 {
    if base == 0.0 {
        0.0
    } else {
        (x - base) / base * 100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary() {
        let s = Summary::of(&[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(s.n, 4);
        assert_eq!(s.min, 1.0);
        assert_eq!(s.max, 4.0);
        assert!((s.avg - 2.5).abs() < 1e-12);
        assert!((s.sdev - 1.290_994_448_735_805_6).abs() < 1e-9);
        assert!((s.spread() - 1.2).abs() < 1e-12);
        assert!(Summary::of(&[]).is_none());
        assert_eq!(Summary::of(&[5.0]).unwrap().sdev, 0.0);
        assert!((diff_pct(101.0, 100.0) - 1.0).abs() < 1e-12);
    }
}
