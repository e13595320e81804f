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

/// Parses `--disk PATH[,readonly][,direct][,id=NAME][,engine=sync|uring][,key=value...]` with
/// the grammar `corral run --disk` uses ([`DiskSpec::parse`]), with the same
/// errors.
pub fn parse_disk(spec: &str) -> Result<dto::DiskRequest, CliError> {
    let d = DiskSpec::parse(spec).map_err(|e| CliError(format!("--disk {spec}: {e}")))?;
    Ok(dto::DiskRequest {
        id: d.id.unwrap_or_default(),
        path: d.path,
        read_only: d.read_only,
        direct: d.direct,
        engine: d.engine,
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

#[cfg(test)]
mod tests {
    use super::*;
    use corral_vmm::vm::DiskConfig;
    use serde_json::json;

    /// As Cloud Hypervisor's `cloud-hypervisor/src/main.rs` tests do: a
    /// disk written on the command line and the same disk written as the
    /// API's JSON give equal configurations, for `corral vm create --disk`
    /// (sent as JSON), the REST body and `corral run --disk`.
    #[test]
    fn cli_and_json_disks_give_equal_configs() {
        for (cli, body) in [
            ("/img/a.raw", json!({ "path": "/img/a.raw" })),
            (
                "/img/a.raw,ro,id=root",
                json!({ "path": "/img/a.raw", "readonly": true, "id": "root" }),
            ),
            (
                "/img/b.raw,direct,bps=10M,iops=500,burst_ops=50",
                json!({
                    "path": "/img/b.raw",
                    "direct": true,
                    "limits": { "bps": 10 << 20, "iops": 500, "burst_ops": 50 }
                }),
            ),
            (
                "/img/c.raw,readonly,direct,rbps=1K,wbps=2GiB,riops=10,wiops=20,\
                 burst_bytes=64k,onetime_bytes=1M,onetime_ops=5,id=c.1",
                json!({
                    "path": "/img/c.raw",
                    "readonly": true,
                    "direct": true,
                    "id": "c.1",
                    "limits": {
                        "rbps": 1024, "wbps": 2u64 << 30, "riops": 10, "wiops": 20,
                        "burst_bytes": 65536, "onetime_bytes": 1 << 20, "onetime_ops": 5
                    }
                }),
            ),
            // 0, `max`, `none` and null all mean no limit.
            (
                "/img/d.raw,bps=0,iops=max,wbps=none",
                json!({ "path": "/img/d.raw", "limits": { "bps": 0, "iops": null } }),
            ),
        ] {
            let from_cli = parse_disk(cli).unwrap();
            let from_json: dto::DiskRequest = serde_json::from_value(body.clone()).unwrap();
            assert_eq!(from_cli, from_json, "{cli} vs {body}");
            // What the client sends is what the daemon reads.
            let sent = serde_json::to_string(&from_cli).unwrap();
            let read: dto::DiskRequest = serde_json::from_str(&sent).unwrap();
            assert_eq!(read, from_cli, "{sent}");
            // The daemon's request, and `corral run`'s disk.
            let req = dto::VmCreate {
                disks: vec![from_json],
                ..Default::default()
            }
            .request()
            .disks
            .remove(0);
            let run = DiskConfig::parse(cli).unwrap();
            assert_eq!(
                (
                    run.id.unwrap_or_default(),
                    run.path,
                    run.read_only,
                    run.direct,
                    run.limits
                ),
                (req.id, req.path, req.read_only, req.direct, req.limits),
                "{cli}"
            );
        }
    }

    /// `corral vm create --disk` and `corral run --disk` refuse the same
    /// specs with the same messages (`vm create` used to take `iops=1k`).
    #[test]
    fn run_and_vm_create_refuse_the_same_disks_alike() {
        for bad in [
            "",
            ",ro",
            "a,iops=1k",
            "a,size=1G",
            "a,path=b",
            "a,readonyl",
            "a,direct=1",
            "a,burst_bytes=1M",
            "a,iops=5,onetime_bytes=1M",
            "a,bps=1,bps=2",
            "a,bps=1X",
            "a,bps=-1",
            "a,id=a b",
            "a,,ro",
        ] {
            let cli = parse_disk(bad).unwrap_err().to_string();
            let run = DiskConfig::parse(bad).unwrap_err().to_string();
            assert_eq!(cli, run, "{bad:?}");
            assert!(cli.starts_with(&format!("--disk {bad}: ")), "{cli}");
        }
    }

    /// The one disk request type keeps the JSON form of the old DTO: the
    /// wire name `readonly`, `limits` only as an object, no unknown keys.
    #[test]
    fn a_disk_request_keeps_its_json_form() {
        let d: dto::DiskRequest =
            serde_json::from_value(json!({ "path": "a", "readonly": true })).unwrap();
        assert!(d.read_only && d.id.is_empty() && d.limits.is_unlimited());
        assert_eq!(
            serde_json::to_value(&d).unwrap(),
            json!({ "path": "a", "readonly": true, "direct": false, "limits": {} })
        );
        for bad in [
            json!({ "path": "a", "read_only": true }),
            json!({ "path": "a", "limits": [1, 2] }),
            json!({ "path": "a", "limits": null }),
            json!({ "path": "a", "limits": { "bps": "1M" } }),
            json!({ "readonly": true }),
        ] {
            assert!(
                serde_json::from_value::<dto::DiskRequest>(bad.clone()).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn limit_arguments_use_the_same_grammar() {
        let l = parse_limits("bps=10M, iops=500".split(',')).unwrap();
        assert_eq!(l, dto::Limits::parse("bps=10M,iops=500").unwrap());
        // Merging keeps the others; `none` and 0 remove one.
        let l = apply_limits(l, ["iops=none", "wbps=1K"].into_iter()).unwrap();
        assert_eq!(l, dto::Limits::parse("bps=10M,wbps=1024").unwrap());
        let l = apply_limits(l, ["bps=0"].into_iter()).unwrap();
        assert_eq!(l, dto::Limits::parse("wbps=1024").unwrap());
        for bad in ["iops=1k", "foo=1", "bps", "burst_ops=3"] {
            assert!(parse_limits(bad.split(',')).is_err(), "{bad}");
        }
    }
}
