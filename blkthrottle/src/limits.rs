//! [`Limits`]: the user-facing throttle configuration, its validation and the
//! parser for the CLI / REST key=value form.

use std::fmt;

use thiserror::Error;

/// Errors from building or parsing [`Limits`] (and from group membership).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum LimitsError {
    /// A value could not be parsed.
    #[error("invalid value {value:?} for `{key}`: {reason}")]
    InvalidValue {
        /// The key whose value was bad.
        key: String,
        /// The value as given.
        value: String,
        /// What was wrong with it.
        reason: &'static str,
    },
    /// A burst or one-time burst was given without any rate it could apply to.
    #[error("`{key}` is set but none of {needs} is: a burst needs a rate limit to belong to")]
    BurstWithoutRate {
        /// The burst key (`burst_bytes`, `burst_ops`, `onetime_bytes`, `onetime_ops`).
        key: &'static str,
        /// The rate keys that would make it meaningful.
        needs: &'static str,
    },
    /// [`Limits::parse`] met a key it does not know.
    #[error(
        "unknown throttle key `{0}` (known: bps, rbps, wbps, iops, riops, wiops, burst_bytes, \
         burst_ops, onetime_bytes, onetime_ops)"
    )]
    UnknownKey(String),
    /// [`Limits::parse`] met an item without `=`.
    #[error("expected key=value, got {0:?}")]
    MissingValue(String),
    /// A group member weight outside `1..=10000`.
    #[error("weight {0} is out of range 1..=10000")]
    InvalidWeight(u32),
}

/// Throttle limits of one disk or one group.
///
/// Every field is optional; `None` means "no limit" (for rates), "default"
/// (for burst sizes) or "none" (for one-time bursts). **A value of `0` is
/// treated exactly like `None`**, as QEMU does for `bps=0` and cgroup `io.max`
/// does for `max`: so `bps=0` on the command line or `"bps": 0` over REST
/// removes the limit instead of blocking the disk forever.
///
/// * `bps`, `iops` limit the total (reads + writes + other); `rbps`/`riops`
///   limit reads, `wbps`/`wiops` limit writes. Total and split limits may be
///   combined: a request must then satisfy both (QEMU rejects the combination;
///   cgroup has only the split form; we allow both since the meaning is clear).
/// * Flush and other non-data requests ([`crate::OpKind::Other`]) count as one
///   op in `iops` and `wiops` (Linux treats flush/discard as write-direction
///   operations) and as zero bytes.
/// * `burst_bytes` / `burst_ops` are the bucket *size* (capacity) of every
///   bytes / ops bucket that is configured. Default when unset: one second of
///   the bucket's rate (as with Firecracker's `size` per 1000 ms refill). A
///   burst smaller than a request is fine: an oversize request is admitted
///   when the bucket is full and leaves it in debt.
/// * `onetime_bytes` / `onetime_ops` are extra tokens granted once, at
///   creation, to every bucket of that unit; they are spent before the
///   refilling tokens and never come back.
///
/// With the `serde` feature this is also the JSON form of the REST API and of
/// the daemon's state file: an object of these keys, each absent, `null` or
/// an integer (`0` reads as absent); unknown keys are refused; unset keys are
/// not written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default, deny_unknown_fields))]
pub struct Limits {
    /// Total bytes per second.
    #[cfg_attr(
        feature = "serde",
        serde(skip_serializing_if = "Option::is_none", deserialize_with = "nonzero")
    )]
    pub bps: Option<u64>,
    /// Read bytes per second.
    #[cfg_attr(
        feature = "serde",
        serde(skip_serializing_if = "Option::is_none", deserialize_with = "nonzero")
    )]
    pub rbps: Option<u64>,
    /// Write bytes per second.
    #[cfg_attr(
        feature = "serde",
        serde(skip_serializing_if = "Option::is_none", deserialize_with = "nonzero")
    )]
    pub wbps: Option<u64>,
    /// Total operations per second.
    #[cfg_attr(
        feature = "serde",
        serde(skip_serializing_if = "Option::is_none", deserialize_with = "nonzero")
    )]
    pub iops: Option<u64>,
    /// Read operations per second.
    #[cfg_attr(
        feature = "serde",
        serde(skip_serializing_if = "Option::is_none", deserialize_with = "nonzero")
    )]
    pub riops: Option<u64>,
    /// Write (and flush/other) operations per second.
    #[cfg_attr(
        feature = "serde",
        serde(skip_serializing_if = "Option::is_none", deserialize_with = "nonzero")
    )]
    pub wiops: Option<u64>,
    /// Capacity of every bytes bucket, in bytes.
    #[cfg_attr(
        feature = "serde",
        serde(skip_serializing_if = "Option::is_none", deserialize_with = "nonzero")
    )]
    pub burst_bytes: Option<u64>,
    /// Capacity of every ops bucket, in operations.
    #[cfg_attr(
        feature = "serde",
        serde(skip_serializing_if = "Option::is_none", deserialize_with = "nonzero")
    )]
    pub burst_ops: Option<u64>,
    /// One-time extra bytes for every bytes bucket.
    #[cfg_attr(
        feature = "serde",
        serde(skip_serializing_if = "Option::is_none", deserialize_with = "nonzero")
    )]
    pub onetime_bytes: Option<u64>,
    /// One-time extra operations for every ops bucket.
    #[cfg_attr(
        feature = "serde",
        serde(skip_serializing_if = "Option::is_none", deserialize_with = "nonzero")
    )]
    pub onetime_ops: Option<u64>,
}

/// The resolved parameters of one token bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BucketConfig {
    /// Tokens per second, > 0.
    pub rate: u64,
    /// Capacity in tokens, > 0.
    pub size: u64,
    /// One-time extra tokens.
    pub one_time: u64,
}

/// Index of the six buckets a limiter may have.
pub(crate) const BYTES_TOTAL: usize = 0;
pub(crate) const BYTES_READ: usize = 1;
pub(crate) const BYTES_WRITE: usize = 2;
pub(crate) const OPS_TOTAL: usize = 3;
pub(crate) const OPS_READ: usize = 4;
pub(crate) const OPS_WRITE: usize = 5;
pub(crate) const NUM_BUCKETS: usize = 6;

fn nz(v: Option<u64>) -> Option<u64> {
    v.filter(|&x| x != 0)
}

/// A limit as JSON: `null` or an integer, `0` read as unset.
#[cfg(feature = "serde")]
fn nonzero<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    <Option<u64> as serde::Deserialize>::deserialize(d).map(nz)
}

/// Which kind of number a key takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Unit {
    /// Bytes: K/M/G/T suffixes (powers of 1024) accepted.
    Bytes,
    /// Plain count.
    Ops,
}

const KEYS: [(&str, Unit, bool); 10] = [
    // (key, unit, is a rate)
    ("bps", Unit::Bytes, true),
    ("rbps", Unit::Bytes, true),
    ("wbps", Unit::Bytes, true),
    ("iops", Unit::Ops, true),
    ("riops", Unit::Ops, true),
    ("wiops", Unit::Ops, true),
    ("burst_bytes", Unit::Bytes, false),
    ("burst_ops", Unit::Ops, false),
    ("onetime_bytes", Unit::Bytes, false),
    ("onetime_ops", Unit::Ops, false),
];

impl Limits {
    /// No limit at all.
    pub const UNLIMITED: Limits = Limits {
        bps: None,
        rbps: None,
        wbps: None,
        iops: None,
        riops: None,
        wiops: None,
        burst_bytes: None,
        burst_ops: None,
        onetime_bytes: None,
        onetime_ops: None,
    };

    fn field_mut(&mut self, key: &str) -> Option<&mut Option<u64>> {
        Some(match key {
            "bps" => &mut self.bps,
            "rbps" => &mut self.rbps,
            "wbps" => &mut self.wbps,
            "iops" => &mut self.iops,
            "riops" => &mut self.riops,
            "wiops" => &mut self.wiops,
            "burst_bytes" => &mut self.burst_bytes,
            "burst_ops" => &mut self.burst_ops,
            "onetime_bytes" => &mut self.onetime_bytes,
            "onetime_ops" => &mut self.onetime_ops,
            _ => return None,
        })
    }

    fn fields(&self) -> [Option<u64>; 10] {
        [
            self.bps,
            self.rbps,
            self.wbps,
            self.iops,
            self.riops,
            self.wiops,
            self.burst_bytes,
            self.burst_ops,
            self.onetime_bytes,
            self.onetime_ops,
        ]
    }

    /// Applies one `key=value` pair of the CLI/REST form.
    ///
    /// Returns `Ok(true)` if the key is a throttle key (and the value was
    /// stored), `Ok(false)` if the key is not a throttle key (so the caller can
    /// try its own keys, e.g. `path` or `readonly`), and an error if the key is
    /// known but the value is bad. A later value for the same key overrides an
    /// earlier one. Does not validate the whole set: call [`Limits::validate`]
    /// after the last key.
    ///
    /// Values: decimal integers. Byte keys (`bps`, `rbps`, `wbps`,
    /// `burst_bytes`, `onetime_bytes`) accept a suffix `K`, `M`, `G`, `T`
    /// (powers of 1024; also written `Ki`, `KiB`, `KB`, any case). Every key
    /// accepts `none` and rate keys also `max` or `unlimited`, all meaning
    /// unset, as `0` does (see [`Limits`]). This is the one grammar of
    /// `corral run --disk`, `corral vm create --disk`, `corral disk limit`
    /// and `corral class set --io`.
    pub fn parse_kv(&mut self, key: &str, value: &str) -> Result<bool, LimitsError> {
        let Some(&(_, unit, is_rate)) = KEYS.iter().find(|(k, _, _)| *k == key) else {
            return Ok(false);
        };
        let parsed = parse_value(key, value, unit, is_rate)?;
        if let Some(field) = self.field_mut(key) {
            *field = nz(parsed);
        }
        Ok(true)
    }

    /// Parses a whole comma-separated list such as `bps=10M,iops=500` and
    /// validates it. Unknown keys are an error. An empty string is
    /// [`Limits::UNLIMITED`].
    pub fn parse(s: &str) -> Result<Limits, LimitsError> {
        let mut l = Limits::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| LimitsError::MissingValue(item.to_string()))?;
            if !l.parse_kv(k.trim(), v.trim())? {
                return Err(LimitsError::UnknownKey(k.trim().to_string()));
            }
        }
        l.validate()?;
        Ok(l)
    }

    /// Checks that the set is meaningful: every burst and one-time burst must
    /// belong to at least one configured rate of its unit. Zero values count
    /// as unset and never fail.
    pub fn validate(&self) -> Result<(), LimitsError> {
        let has_bytes = nz(self.bps).or(nz(self.rbps)).or(nz(self.wbps)).is_some();
        let has_ops = nz(self.iops)
            .or(nz(self.riops))
            .or(nz(self.wiops))
            .is_some();
        let checks = [
            (
                "burst_bytes",
                self.burst_bytes,
                has_bytes,
                "bps, rbps, wbps",
            ),
            (
                "onetime_bytes",
                self.onetime_bytes,
                has_bytes,
                "bps, rbps, wbps",
            ),
            ("burst_ops", self.burst_ops, has_ops, "iops, riops, wiops"),
            (
                "onetime_ops",
                self.onetime_ops,
                has_ops,
                "iops, riops, wiops",
            ),
        ];
        for (key, v, ok, needs) in checks {
            if nz(v).is_some() && !ok {
                return Err(LimitsError::BurstWithoutRate { key, needs });
            }
        }
        Ok(())
    }

    /// True if no rate is limited.
    pub fn is_unlimited(&self) -> bool {
        self.fields()[..6].iter().all(|f| nz(*f).is_none())
    }

    /// The six bucket configurations, indexed by the `BYTES_*`/`OPS_*`
    /// constants; `None` where the rate is unlimited.
    pub(crate) fn buckets(&self) -> [Option<BucketConfig>; NUM_BUCKETS] {
        let bytes = |rate: Option<u64>| {
            nz(rate).map(|rate| BucketConfig {
                rate,
                size: nz(self.burst_bytes).unwrap_or(rate),
                one_time: nz(self.onetime_bytes).unwrap_or(0),
            })
        };
        let ops = |rate: Option<u64>| {
            nz(rate).map(|rate| BucketConfig {
                rate,
                size: nz(self.burst_ops).unwrap_or(rate),
                one_time: nz(self.onetime_ops).unwrap_or(0),
            })
        };
        [
            bytes(self.bps),
            bytes(self.rbps),
            bytes(self.wbps),
            ops(self.iops),
            ops(self.riops),
            ops(self.wiops),
        ]
    }
}

/// Canonical `key=value,...` form (only set, non-zero keys; plain integers),
/// which [`Limits::parse`] reads back. Empty for [`Limits::UNLIMITED`].
impl fmt::Display for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for ((key, _, _), v) in KEYS.iter().zip(self.fields()) {
            if let Some(v) = nz(v) {
                if !first {
                    f.write_str(",")?;
                }
                first = false;
                write!(f, "{key}={v}")?;
            }
        }
        Ok(())
    }
}

fn parse_value(
    key: &str,
    value: &str,
    unit: Unit,
    is_rate: bool,
) -> Result<Option<u64>, LimitsError> {
    let err = |reason| LimitsError::InvalidValue {
        key: key.to_string(),
        value: value.to_string(),
        reason,
    };
    let v = value.trim();
    if v.eq_ignore_ascii_case("none")
        || (is_rate && (v.eq_ignore_ascii_case("max") || v.eq_ignore_ascii_case("unlimited")))
    {
        return Ok(None);
    }
    let digits_end = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (digits, suffix) = v.split_at(digits_end);
    if digits.is_empty() {
        return Err(err(if is_rate {
            "expected a non-negative integer, `max`, `unlimited` or `none`"
        } else {
            "expected a non-negative integer or `none`"
        }));
    }
    let n: u64 = digits.parse().map_err(|_| err("number too large"))?;
    let mult: u64 = if suffix.is_empty() {
        1
    } else if unit == Unit::Ops {
        return Err(err("operation counts take a plain integer (no suffix)"));
    } else {
        let s = suffix.to_ascii_lowercase();
        let s = s.strip_suffix('b').unwrap_or(&s);
        let s = s.strip_suffix('i').unwrap_or(s);
        match s {
            "k" => 1 << 10,
            "m" => 1 << 20,
            "g" => 1 << 30,
            "t" => 1 << 40,
            _ => return Err(err("unknown suffix (use K, M, G or T, powers of 1024)")),
        }
    };
    n.checked_mul(mult)
        .map(Some)
        .ok_or_else(|| err("number too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_suffixes() {
        let mut l = Limits::default();
        assert_eq!(l.parse_kv("bps", "10M"), Ok(true));
        assert_eq!(l.bps, Some(10 << 20));
        for (v, want) in [
            ("1K", 1024),
            ("1k", 1024),
            ("2Ki", 2048),
            ("3KiB", 3072),
            ("1G", 1 << 30),
            ("4Gi", 4 << 30),
            ("1T", 1 << 40),
            ("512", 512),
            ("5MB", 5 << 20),
        ] {
            assert!(l.parse_kv("burst_bytes", v).unwrap());
            assert_eq!(l.burst_bytes, Some(want), "{v}");
        }
        assert_eq!(l.parse_kv("path", "/x"), Ok(false));
    }

    #[test]
    fn parse_errors_are_clear() {
        let mut l = Limits::default();
        let e = l.parse_kv("iops", "1K").unwrap_err();
        assert!(e.to_string().contains("plain integer"), "{e}");
        let e = l.parse_kv("bps", "1X").unwrap_err();
        assert!(e.to_string().contains("unknown suffix"), "{e}");
        let e = l.parse_kv("bps", "-1").unwrap_err();
        assert!(e.to_string().contains("`bps`"), "{e}");
        let e = l.parse_kv("bps", "99999999999999999999").unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
        let e = l.parse_kv("bps", "16777216T").unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
        assert!(matches!(
            Limits::parse("burst_bytes=1M"),
            Err(LimitsError::BurstWithoutRate {
                key: "burst_bytes",
                ..
            })
        ));
        assert!(matches!(
            Limits::parse("iops=5,onetime_bytes=1M"),
            Err(LimitsError::BurstWithoutRate {
                key: "onetime_bytes",
                ..
            })
        ));
        assert!(matches!(
            Limits::parse("foo=1"),
            Err(LimitsError::UnknownKey(_))
        ));
        assert!(matches!(
            Limits::parse("bps"),
            Err(LimitsError::MissingValue(_))
        ));
    }

    #[test]
    fn zero_and_max_mean_unlimited() {
        let l = Limits::parse("bps=0,iops=max,wiops=unlimited").unwrap();
        assert!(l.is_unlimited());
        assert_eq!(l, Limits::UNLIMITED);
        let l = Limits::parse("bps=1M,bps=0").unwrap();
        assert!(l.is_unlimited());
        // burst 0 is "default", so no error without a rate
        assert!(Limits::parse("burst_bytes=0").is_ok());
        // struct with Some(0) behaves like None
        let l = Limits {
            bps: Some(0),
            ..Default::default()
        };
        assert!(l.is_unlimited());
        assert!(l.buckets().iter().all(Option::is_none));
    }

    #[test]
    fn none_unsets_every_key() {
        let l = Limits::parse("bps=1M,burst_bytes=none,iops=NONE").unwrap();
        assert_eq!(
            l,
            Limits {
                bps: Some(1 << 20),
                ..Limits::UNLIMITED
            }
        );
        // `max` is a rate's word only.
        assert!(Limits::parse("bps=1M,burst_bytes=max").is_err());
    }

    #[cfg(feature = "serde")]
    #[test]
    fn json_form() {
        let l: Limits = serde_json::from_str(
            r#"{"bps": 1048576, "iops": 0, "rbps": null, "burst_ops": 7, "wiops": 100}"#,
        )
        .unwrap();
        // 0 and null read as unset; unset keys are not written.
        assert_eq!(
            l,
            Limits {
                bps: Some(1 << 20),
                wiops: Some(100),
                burst_ops: Some(7),
                ..Limits::UNLIMITED
            }
        );
        assert_eq!(
            serde_json::to_string(&l).unwrap(),
            r#"{"bps":1048576,"wiops":100,"burst_ops":7}"#
        );
        assert_eq!(serde_json::to_string(&Limits::UNLIMITED).unwrap(), "{}");
        assert_eq!(
            serde_json::from_str::<Limits>("{}").unwrap(),
            Limits::UNLIMITED
        );
        for bad in [
            r#"{"bsp": 1}"#,
            r#"{"bps": -1}"#,
            r#"{"bps": 1.5}"#,
            r#"{"bps": "1M"}"#,
        ] {
            assert!(serde_json::from_str::<Limits>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn display_round_trips() {
        let l = Limits::parse("bps=10M, wiops=100,burst_ops=7,onetime_bytes=1G").unwrap();
        let s = l.to_string();
        assert_eq!(
            s,
            "bps=10485760,wiops=100,burst_ops=7,onetime_bytes=1073741824"
        );
        assert_eq!(Limits::parse(&s).unwrap(), l);
        assert_eq!(Limits::UNLIMITED.to_string(), "");
        assert_eq!(Limits::parse("").unwrap(), Limits::UNLIMITED);
    }

    #[test]
    fn bucket_defaults() {
        let l = Limits::parse("bps=1000,riops=10,burst_ops=3,onetime_ops=5").unwrap();
        let b = l.buckets();
        assert_eq!(
            b[BYTES_TOTAL],
            Some(BucketConfig {
                rate: 1000,
                size: 1000,
                one_time: 0
            })
        );
        assert_eq!(
            b[OPS_READ],
            Some(BucketConfig {
                rate: 10,
                size: 3,
                one_time: 5
            })
        );
        assert!(b[BYTES_READ].is_none() && b[OPS_TOTAL].is_none());
    }
}
