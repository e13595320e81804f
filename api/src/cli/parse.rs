//! Parsing of the client's arguments: `key=value` limits, `--disk`.

use corral_devices::virtio::blk::DiskSpec;

use super::CliError;
use crate::dto;

/// Parses `key=value` limits (the grammar of [`dto::Limits::parse_kv`],
/// the same as in `--disk`).
pub fn parse_limits<'a>(items: impl Iterator<Item = &'a str>) -> Result<dto::Limits, CliError> {
    apply_limits(dto::Limits::default(), items)
}

/// `key=value` limits applied over `l` (a key given as 0 or `none` is
/// removed; the others stay as they are); the result is validated.
pub fn apply_limits<'a>(
    mut l: dto::Limits,
    items: impl Iterator<Item = &'a str>,
) -> Result<dto::Limits, CliError> {
    let err = |e: corral_blkthrottle::LimitsError| CliError(e.to_string());
    for item in items.map(str::trim).filter(|i| !i.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| err(corral_blkthrottle::LimitsError::MissingValue(item.into())))?;
        if !l.parse_kv(k.trim(), v.trim()).map_err(err)? {
            return Err(err(corral_blkthrottle::LimitsError::UnknownKey(
                k.trim().into(),
            )));
        }
    }
    l.validate().map_err(err)?;
    Ok(l)
}

/// Parses `--disk PATH[,readonly][,direct][,id=NAME][,key=value...]` with
/// the grammar `corral run --disk` uses ([`DiskSpec::parse`]), with the same
/// errors.
pub fn parse_disk(spec: &str) -> Result<dto::DiskCreate, CliError> {
    let d = DiskSpec::parse(spec).map_err(|e| CliError(format!("--disk {spec}: {e}")))?;
    Ok(dto::DiskCreate {
        id: d.id,
        path: d.path.display().to_string(),
        read_only: d.read_only,
        direct: d.direct,
        limits: d.limits,
    })
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
