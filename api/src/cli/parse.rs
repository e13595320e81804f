//! Parsing of the client's arguments: sizes, `key=value` limits, `--disk`.

use super::CliError;
use crate::dto;

/// Parses a size with an optional K/M/G/T suffix (powers of 1024).
pub fn parse_size(key: &str, s: &str) -> Result<u64, CliError> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    if lower == "max" || lower == "unlimited" || lower == "none" {
        return Ok(0);
    }
    let digits = lower.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let suffix = &lower[digits.len()..];
    let mult: u64 = match suffix {
        "" | "b" => 1,
        "k" | "ki" | "kib" | "kb" => 1 << 10,
        "m" | "mi" | "mib" | "mb" => 1 << 20,
        "g" | "gi" | "gib" | "gb" => 1 << 30,
        "t" | "ti" | "tib" | "tb" => 1 << 40,
        _ => return Err(CliError(format!("{key}={s}: unknown suffix {suffix:?}"))),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|v| v.checked_mul(mult))
        .ok_or_else(|| CliError(format!("{key}={s}: not a number")))
}

/// Applies one `key=value` limit; `Ok(false)` if the key is not a limit key.
pub fn set_limit(l: &mut dto::Limits, key: &str, value: &str) -> Result<bool, CliError> {
    let v = Some(parse_size(key, value)?).filter(|v| *v != 0);
    let slot = match key {
        "bps" => &mut l.bps,
        "iops" => &mut l.iops,
        "rbps" => &mut l.rbps,
        "wbps" => &mut l.wbps,
        "riops" => &mut l.riops,
        "wiops" => &mut l.wiops,
        "burst_bytes" => &mut l.burst_bytes,
        "burst_ops" => &mut l.burst_ops,
        _ => return Ok(false),
    };
    *slot = v;
    Ok(true)
}

pub fn parse_limits<'a>(items: impl Iterator<Item = &'a str>) -> Result<dto::Limits, CliError> {
    apply_limits(dto::Limits::default(), items)
}

/// `key=value` limits applied over `l` (a key given as 0 or `none` is
/// removed; the others stay as they are).
pub fn apply_limits<'a>(
    mut l: dto::Limits,
    items: impl Iterator<Item = &'a str>,
) -> Result<dto::Limits, CliError> {
    for item in items.map(str::trim).filter(|i| !i.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| CliError(format!("expected key=value, got {item:?}")))?;
        if !set_limit(&mut l, k.trim(), v)? {
            return Err(CliError(format!(
                "unknown limit {k:?} (known: bps, iops, rbps, wbps, riops, wiops, burst_bytes, burst_ops)"
            )));
        }
    }
    Ok(l)
}

/// Parses `--disk PATH[,readonly][,direct][,id=..][,limits]`.
pub fn parse_disk(spec: &str) -> Result<dto::DiskCreate, CliError> {
    let mut d = dto::DiskCreate {
        id: None,
        path: String::new(),
        readonly: false,
        direct: false,
        limits: dto::Limits::default(),
    };
    for (i, item) in spec.split(',').map(str::trim).enumerate() {
        match item.split_once('=') {
            None if item == "readonly" || item == "ro" => d.readonly = true,
            None if item == "direct" => d.direct = true,
            None if i == 0 => d.path = item.to_string(),
            None => return Err(CliError(format!("--disk {spec}: unknown flag {item:?}"))),
            Some(("path", v)) => d.path = v.to_string(),
            Some(("id", v)) => d.id = Some(v.to_string()),
            Some((k, v)) => {
                if !set_limit(&mut d.limits, k, v)? {
                    return Err(CliError(format!("--disk {spec}: unknown key {k:?}")));
                }
            }
        }
    }
    if d.path.is_empty() {
        return Err(CliError(format!("--disk {spec}: no path")));
    }
    Ok(d)
}

pub fn pct_or_none(key: &str, s: &str) -> Result<Option<u32>, CliError> {
    if s.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    s.trim_end_matches('%')
        .parse::<u32>()
        .map(Some)
        .map_err(|_| CliError(format!("--{key} {s}: expected a percentage or `none`")))
}
