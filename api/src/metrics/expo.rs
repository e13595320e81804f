//! The exposition machinery under `/metrics`: families of constant series
//! kept in label order, the two text formats, and `Accept` negotiation.
//!
//! `prometheus-client` writes OpenMetrics 1.0 only. The Prometheus text
//! format 0.0.4 differs from it, for what corral exports, in three ways:
//! a counter's HELP and TYPE lines name the sample (`x_total`, not the
//! family `x`), there is no `# EOF`, and there are no `# UNIT` lines (corral
//! registers none). [`to_text_004`] makes exactly those changes to the
//! crate's output; every sample line is the crate's, unchanged.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

/// A series' labels, in the order they are written.
pub type Labels = Vec<(&'static str, String)>;

/// Labels from `(name, value)` pairs.
pub fn l(pairs: &[(&'static str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

/// `labels` plus one more.
pub fn with(labels: &Labels, k: &'static str, v: &str) -> Labels {
    let mut out = labels.clone();
    out.push((k, v.to_string()));
    out
}

/// 0 for values that are 0 but for rounding (|v| < 1e-9, which also turns
/// `-0.0` into `0`), and for NaN and infinities, which no corral figure
/// means. The scheduler's float arithmetic leaves residues like `3.1e-75`.
pub fn clean(v: f64) -> f64 {
    if v.is_finite() && v.abs() >= 1e-9 {
        v
    } else {
        0.0
    }
}

/// One family: its series sorted by labels, so every scrape lists them in
/// the same order (`prometheus_client::metrics::family::Family` is a hash
/// map). Shared (`Arc`) so it can be registered first and filled after.
#[derive(Debug)]
pub struct Fam<M>(Arc<Mutex<BTreeMap<Labels, M>>>);

impl<M> Clone for Fam<M> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<M> Default for Fam<M> {
    fn default() -> Self {
        Self(Arc::default())
    }
}

impl<M> Fam<M> {
    /// Sets the series with `labels` (the last value set wins).
    pub fn put(&self, labels: Labels, m: M) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(labels, m);
    }
}

impl<M: EncodeMetric + TypedMetric> TypedMetric for Fam<M> {
    const TYPE: MetricType = M::TYPE;
}

impl<M: EncodeMetric + TypedMetric> EncodeMetric for Fam<M> {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let series = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        for (labels, m) in series.iter() {
            m.encode(encoder.encode_family(labels)?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        M::TYPE
    }
}

/// A histogram from a snapshot: sum, count, and per-bucket (not cumulative)
/// counts by upper bound, the last bound `+Inf`.
#[derive(Debug, Clone, Default)]
pub struct ConstHistogram {
    sum: f64,
    count: u64,
    buckets: Vec<(f64, u64)>,
}

impl ConstHistogram {
    /// A histogram; an infinite upper bound becomes the crate's `+Inf`
    /// marker (`f64::MAX`; `f64::INFINITY` would be written `le="inf"`,
    /// which parsers reject).
    pub fn new(sum: f64, count: u64, buckets: impl Iterator<Item = (f64, u64)>) -> Self {
        let mut buckets: Vec<(f64, u64)> = buckets
            .map(|(le, n)| (if le.is_infinite() { f64::MAX } else { le }, n))
            .collect();
        if buckets.last().is_none_or(|(le, _)| *le != f64::MAX) {
            let seen: u64 = buckets.iter().map(|(_, n)| n).sum();
            buckets.push((f64::MAX, count.saturating_sub(seen)));
        }
        Self {
            sum: clean(sum),
            count,
            buckets,
        }
    }
}

impl TypedMetric for ConstHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for ConstHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_histogram::<NoLabelSet>(self.sum, self.count, &self.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// Counter of events (integer).
pub type Counts = Fam<ConstCounter<u64>>;
/// Counter of seconds (or another continuous amount).
pub type Amounts = Fam<ConstCounter<f64>>;
/// Gauge with a continuous value.
pub type Gauges = Fam<ConstGauge<f64>>;
/// Gauge with an integer value (how many, bytes).
pub type Ints = Fam<ConstGauge<i64>>;
/// Histograms from snapshots.
pub type Hists = Fam<ConstHistogram>;

impl Counts {
    /// Sets a count.
    pub fn set(&self, labels: Labels, v: u64) {
        self.put(labels, ConstCounter::new(v));
    }
}

impl Amounts {
    /// Sets an amount (cleaned, never negative).
    pub fn set(&self, labels: Labels, v: f64) {
        self.put(labels, ConstCounter::new(clean(v).max(0.0)));
    }
}

impl Gauges {
    /// Sets a value (cleaned).
    pub fn set(&self, labels: Labels, v: f64) {
        self.put(labels, ConstGauge::new(clean(v)));
    }
}

impl Ints {
    /// Sets an integer value (saturating at `i64::MAX`).
    pub fn set(&self, labels: Labels, v: u64) {
        self.put(
            labels,
            ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)),
        );
    }
}

/// A registry that hands out [`Fam`]s in registration order (the order of
/// the families in the output).
#[derive(Debug, Default)]
pub struct Reg(pub Registry);

impl Reg {
    /// A family of any metric type.
    pub fn family<M: EncodeMetric + TypedMetric + std::fmt::Debug + Send + Sync + 'static>(
        &mut self,
        name: &str,
        help: &str,
    ) -> Fam<M> {
        let f = Fam::<M>::default();
        self.0.register(name, help, f.clone());
        f
    }

    /// A counter family of events; `name` without `_total` (the encoder
    /// appends it).
    pub fn counts(&mut self, name: &str, help: &str) -> Counts {
        self.family(name, help)
    }

    /// A counter family of seconds or bytes; `name` without `_total`.
    pub fn amounts(&mut self, name: &str, help: &str) -> Amounts {
        self.family(name, help)
    }

    /// A gauge family with continuous values.
    pub fn gauges(&mut self, name: &str, help: &str) -> Gauges {
        self.family(name, help)
    }

    /// A gauge family with integer values.
    pub fn ints(&mut self, name: &str, help: &str) -> Ints {
        self.family(name, help)
    }

    /// A histogram family.
    pub fn hists(&mut self, name: &str, help: &str) -> Hists {
        self.family(name, help)
    }

    /// One integer gauge without labels (registered as itself: a family
    /// with an empty label set would write `name{} v`).
    pub fn int(&mut self, name: &str, help: &str, v: u64) {
        let v = i64::try_from(v).unwrap_or(i64::MAX);
        self.0.register(name, help, ConstGauge::new(v));
    }

    /// One gauge without labels.
    pub fn gauge(&mut self, name: &str, help: &str, v: f64) {
        self.0.register(name, help, ConstGauge::new(clean(v)));
    }

    /// One counter of events without labels.
    pub fn count(&mut self, name: &str, help: &str, v: u64) {
        self.0.register(name, help, ConstCounter::new(v));
    }

    /// One counter of an amount (seconds) without labels.
    pub fn amount(&mut self, name: &str, help: &str, v: f64) {
        self.0
            .register(name, help, ConstCounter::new(clean(v).max(0.0)));
    }

    /// Encodes everything in `format`.
    pub fn encode(&self, format: Format) -> String {
        let mut om = String::with_capacity(16 * 1024);
        if prometheus_client::encoding::text::encode(&mut om, &self.0).is_err() {
            om.clear();
        }
        match format {
            Format::OpenMetrics => om,
            Format::Text004 => to_text_004(&om),
        }
    }
}

/// The exposition format of a scrape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4 (the default).
    Text004,
    /// OpenMetrics 1.0.0 text.
    OpenMetrics,
}

impl Format {
    /// The `Content-Type` of a response in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text004 => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }

    /// The format an `Accept` header asks for: OpenMetrics if
    /// `application/openmetrics-text` is acceptable (q > 0) and preferred at
    /// least as much as any text format (`text/plain`, `text/*`, `*/*`);
    /// text 0.0.4 otherwise, and without the header.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Text004;
        };
        let (mut om, mut text) = (0.0f64, 0.0f64);
        for range in accept.split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let mut q = 1.0f64;
            let mut version_ok = true;
            for p in parts {
                let Some((k, v)) = p.split_once('=') else {
                    continue;
                };
                match k.trim().to_ascii_lowercase().as_str() {
                    "q" => q = v.trim().parse::<f64>().unwrap_or(0.0).clamp(0.0, 1.0),
                    // OpenMetrics 1.0.0 (and 0.0.1, the same text) are what
                    // we write; a text/plain version other than 0.0.4 is not.
                    "version" if media == "text/plain" => version_ok = v.trim() == "0.0.4",
                    _ => {}
                }
            }
            match media.as_str() {
                "application/openmetrics-text" => om = om.max(q),
                "text/plain" if version_ok => text = text.max(q),
                "text/*" | "*/*" => text = text.max(q),
                _ => {}
            }
        }
        if om > 0.0 && om >= text {
            Format::OpenMetrics
        } else {
            Format::Text004
        }
    }
}

/// Rewrites `prometheus-client`'s OpenMetrics output as text format 0.0.4
/// (see the module docs): counter HELP/TYPE lines get the `_total` of their
/// samples, `# EOF` and `# UNIT` lines go.
pub fn to_text_004(om: &str) -> String {
    let mut out = String::with_capacity(om.len());
    // The encoder writes HELP before TYPE; HELP waits for its TYPE.
    let mut help: Option<(&str, &str)> = None;
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help = Some((name, text));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, ty) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (sample, ty) = match ty {
                "counter" => (format!("{name}_total"), "counter"),
                "unknown" => (name.to_string(), "untyped"),
                t => (name.to_string(), t),
            };
            if let Some((h, text)) = help.take()
                && h == name
            {
                out.push_str(&format!("# HELP {sample} {text}\n"));
            }
            out.push_str(&format!("# TYPE {sample} {ty}\n"));
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation_follows_accept() {
        use Format::*;
        assert_eq!(Format::negotiate(None), Text004);
        assert_eq!(Format::negotiate(Some("*/*")), Text004);
        assert_eq!(Format::negotiate(Some("text/plain;version=0.0.4")), Text004);
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text")),
            OpenMetrics
        );
        // What Prometheus 2.42 sends.
        assert_eq!(
            Format::negotiate(Some(
                "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                 version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
            )),
            OpenMetrics
        );
        assert_eq!(
            Format::negotiate(Some(
                "application/openmetrics-text;q=0.3, text/plain;version=0.0.4;q=0.9"
            )),
            Text004
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;q=0")),
            Text004
        );
    }

    #[test]
    fn families_are_sorted_and_both_formats_are_right() {
        let mut r = Reg::default();
        let c = r.counts("x_requests", "Requests");
        c.set(l(&[("vm", "b")]), 2);
        c.set(l(&[("vm", "a")]), 1);
        let h = r.hists("x_duration_seconds", "Latency");
        h.put(
            l(&[("op", "read")]),
            ConstHistogram::new(0.5, 3, [(0.1, 1), (1.0, 2), (f64::INFINITY, 0)].into_iter()),
        );
        r.gauge("x_ratio", "A ratio", -0.0);
        r.gauge("x_tiny", "A residue", 3.1e-75);
        let om = r.encode(Format::OpenMetrics);
        assert_eq!(
            om,
            "# HELP x_requests Requests.\n# TYPE x_requests counter\n\
             x_requests_total{vm=\"a\"} 1\nx_requests_total{vm=\"b\"} 2\n\
             # HELP x_duration_seconds Latency.\n# TYPE x_duration_seconds histogram\n\
             x_duration_seconds_sum{op=\"read\"} 0.5\nx_duration_seconds_count{op=\"read\"} 3\n\
             x_duration_seconds_bucket{le=\"0.1\",op=\"read\"} 1\n\
             x_duration_seconds_bucket{le=\"1.0\",op=\"read\"} 3\n\
             x_duration_seconds_bucket{le=\"+Inf\",op=\"read\"} 3\n\
             # HELP x_ratio A ratio.\n# TYPE x_ratio gauge\nx_ratio 0.0\n\
             # HELP x_tiny A residue.\n# TYPE x_tiny gauge\nx_tiny 0.0\n# EOF\n"
        );
        let text = r.encode(Format::Text004);
        assert!(
            text.starts_with(
                "# HELP x_requests_total Requests.\n# TYPE x_requests_total counter\n\
                 x_requests_total{vm=\"a\"} 1\n"
            ),
            "{text}"
        );
        assert!(!text.contains("# EOF"), "{text}");
        assert!(text.contains("# TYPE x_duration_seconds histogram\n"));
    }

    #[test]
    fn a_histogram_without_inf_bucket_gets_one() {
        let h = ConstHistogram::new(1.0, 5, [(0.1, 2)].into_iter());
        assert_eq!(h.buckets, vec![(0.1, 2), (f64::MAX, 3)]);
    }
}
