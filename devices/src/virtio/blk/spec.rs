//! The `--disk` argument:
//! `PATH[,readonly][,direct][,id=NAME][,engine=sync|uring][,key=value...]`,
//! the one grammar of `corral run --disk` and `corral vm create --disk`.

use std::path::PathBuf;

use corral_blkthrottle::{Limits, LimitsError};

/// Longest disk id (it is also the virtio serial, `VIRTIO_BLK_ID_BYTES`).
pub const MAX_ID_LEN: usize = 20;

/// A parsed `--disk` argument.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskSpec {
    /// Backing file or block device.
    pub path: PathBuf,
    /// Refuse writes (`readonly` or `ro`).
    pub read_only: bool,
    /// Open with `O_DIRECT` (`direct`).
    pub direct: bool,
    /// Name of the disk (`id=`), also its serial number.
    pub id: Option<String>,
    /// I/O engine (`engine=sync|uring`); `None`: io_uring where the kernel
    /// supports it, else sync ([`IoEngine::auto`]).
    pub engine: Option<IoEngine>,
    /// The disk's throttle limits (`bps=`, `iops=`, ...: the keys and values
    /// of [`Limits::parse_kv`]), validated.
    pub limits: Limits,
}

/// Errors parsing a [`DiskSpec`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DiskSpecError {
    /// Nothing before the first comma.
    #[error(
        "disk spec has an empty path (expected PATH[,readonly][,direct][,id=NAME][,key=value...])"
    )]
    EmptyPath,
    /// A bare word that is not a known flag.
    #[error("unknown disk flag `{0}` (known: readonly, direct; options are key=value)")]
    UnknownFlag(String),
    /// `readonly=...` or `direct=...`.
    #[error("disk flag `{0}` takes no value")]
    FlagWithValue(String),
    /// `=value` or an empty item (`,,`).
    #[error("empty option name in disk spec")]
    EmptyKey,
    /// `key=`.
    #[error("option `{0}` has an empty value")]
    EmptyValue(String),
    /// The same key twice.
    #[error("option `{0}` given twice")]
    Duplicate(String),
    /// `engine=` something other than `sync` or `uring`.
    #[error("unknown disk engine `{0}` (known: sync, uring)")]
    BadEngine(String),
    /// An id with characters outside `[A-Za-z0-9._-]` or too long.
    #[error("disk id `{0}` must be 1 to 20 characters of [A-Za-z0-9._-]")]
    BadId(String),
    /// A `key=value` whose key is neither `id` nor a throttle key.
    #[error(
        "unknown disk option `{0}` (flags: readonly, ro, direct; keys: id, bps, rbps, wbps, \
         iops, riops, wiops, burst_bytes, burst_ops, onetime_bytes, onetime_ops)"
    )]
    UnknownKey(String),
    /// A throttle value that does not parse, or a burst without a rate.
    #[error(transparent)]
    Limits(#[from] LimitsError),
}

impl DiskSpec {
    /// Parses `PATH[,readonly][,direct][,id=NAME][,key=value...]`. Paths
    /// containing a comma are not supported.
    pub fn parse(s: &str) -> Result<Self, DiskSpecError> {
        let mut items = s.split(',');
        let path = items.next().unwrap_or("");
        if path.is_empty() {
            return Err(DiskSpecError::EmptyPath);
        }
        let mut spec = DiskSpec {
            path: PathBuf::from(path),
            read_only: false,
            direct: false,
            id: None,
            engine: None,
            limits: Limits::default(),
        };
        let mut seen: Vec<String> = Vec::new();
        for item in items {
            let (key, value) = match item.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (item, None),
            };
            if key.is_empty() {
                return Err(DiskSpecError::EmptyKey);
            }
            let canon = if key == "ro" { "readonly" } else { key };
            if seen.iter().any(|k| k == canon) {
                return Err(DiskSpecError::Duplicate(canon.to_string()));
            }
            seen.push(canon.to_string());
            match (canon, value) {
                ("readonly", None) => spec.read_only = true,
                ("direct", None) => spec.direct = true,
                ("readonly" | "direct", Some(_)) => {
                    return Err(DiskSpecError::FlagWithValue(key.to_string()));
                }
                (_, None) => return Err(DiskSpecError::UnknownFlag(key.to_string())),
                (_, Some("")) => return Err(DiskSpecError::EmptyValue(key.to_string())),
                ("id", Some(v)) => {
                    let ok = v.len() <= MAX_ID_LEN
                        && v.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
                    if !ok {
                        return Err(DiskSpecError::BadId(v.to_string()));
                    }
                    spec.id = Some(v.to_string());
                }
                ("engine", Some(v)) => {
                    let e = v
                        .parse()
                        .map_err(|_| DiskSpecError::BadEngine(v.to_string()))?;
                    spec.engine = Some(e);
                }
                (k, Some(v)) => {
                    if !spec.limits.parse_kv(k, v)? {
                        return Err(DiskSpecError::UnknownKey(k.to_string()));
                    }
                }
            }
        }
        spec.limits.validate()?;
        Ok(spec)
    }
}

/// How a disk's reads, writes and flushes are executed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IoEngine {
    /// One `preadv`/`pwritev`/`fdatasync` at a time on the device thread.
    Sync,
    /// io_uring: many requests in flight, completions on the device
    /// thread's event loop (see `uring.rs`).
    Uring,
}

impl IoEngine {
    /// The default: [`IoEngine::Uring`] if the kernel can set a ring up and
    /// supports the opcodes the engine needs (probed once per process),
    /// else [`IoEngine::Sync`].
    pub fn auto() -> Self {
        Self::auto_for(true)
    }

    /// The default for a disk: [`IoEngine::auto`] for a `direct` (O_DIRECT)
    /// disk, [`IoEngine::Sync`] for one served from the page cache. Measured
    /// on this host's kernel (release, quiet, 32 MiB of 128 KiB requests at
    /// qd 4): page-cache reads took 8.1-8.4 ms with sync and 8.6-14 ms with
    /// uring, and writes were 7-37 % slower (`blkbench --engines 3`): the
    /// kernel hands buffered requests that would block to io_uring's worker
    /// threads, which costs more than the copy. O_DIRECT at qd 4 and 32 was
    /// 0.41-0.69x the sync time. `engine=uring` still picks it for any disk.
    pub fn auto_for(direct: bool) -> Self {
        if direct && super::uring::supported() {
            Self::Uring
        } else {
            Self::Sync
        }
    }

    /// `sync` or `uring`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sync => "sync",
            Self::Uring => "uring",
        }
    }
}

impl std::fmt::Display for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for IoEngine {
    type Err = DiskSpecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sync" => Ok(Self::Sync),
            "uring" => Ok(Self::Uring),
            _ => Err(DiskSpecError::BadEngine(s.to_string())),
        }
    }
}

impl std::str::FromStr for DiskSpec {
    type Err = DiskSpecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_flags_id_and_options() {
        let d = DiskSpec::parse("/img/a.raw,readonly,direct,id=root,bps=10M,iops=100").unwrap();
        assert_eq!(d.path, PathBuf::from("/img/a.raw"));
        assert!(d.read_only && d.direct);
        assert_eq!(d.id.as_deref(), Some("root"));
        assert_eq!(d.limits, Limits::parse("bps=10M,iops=100").unwrap());
        let d: DiskSpec = "disk.img".parse().unwrap();
        assert!(!d.read_only && !d.direct && d.id.is_none() && d.limits.is_unlimited());
        assert!(DiskSpec::parse("x,ro").unwrap().read_only);
        assert_eq!(d.engine, None);
        let e = |s| DiskSpec::parse(s).unwrap().engine;
        assert_eq!(e("x,engine=sync"), Some(IoEngine::Sync));
        assert_eq!(e("x,direct,engine=uring"), Some(IoEngine::Uring));
    }

    #[test]
    fn errors() {
        use DiskSpecError::*;
        assert_eq!(DiskSpec::parse(""), Err(EmptyPath));
        assert_eq!(DiskSpec::parse(",readonly"), Err(EmptyPath));
        assert_eq!(
            DiskSpec::parse("a,readonyl"),
            Err(UnknownFlag("readonyl".into()))
        );
        assert_eq!(
            DiskSpec::parse("a,direct=1"),
            Err(FlagWithValue("direct".into()))
        );
        assert_eq!(DiskSpec::parse("a,,direct"), Err(EmptyKey));
        assert_eq!(DiskSpec::parse("a,=3"), Err(EmptyKey));
        assert_eq!(DiskSpec::parse("a,bps="), Err(EmptyValue("bps".into())));
        assert_eq!(
            DiskSpec::parse("a,bps=1,bps=2"),
            Err(Duplicate("bps".into()))
        );
        assert_eq!(
            DiskSpec::parse("a,ro,readonly"),
            Err(Duplicate("readonly".into()))
        );
        assert_eq!(DiskSpec::parse("a,id=a b"), Err(BadId("a b".into())));
        assert_eq!(
            DiskSpec::parse("a,engine=aio"),
            Err(BadEngine("aio".into()))
        );
        assert_eq!(
            DiskSpec::parse("a,engine"),
            Err(UnknownFlag("engine".into()))
        );
        assert_eq!(
            DiskSpec::parse("a,engine=sync,engine=uring"),
            Err(Duplicate("engine".into()))
        );
        assert_eq!(
            DiskSpec::parse("a,id=012345678901234567890"),
            Err(BadId("012345678901234567890".into()))
        );
        assert_eq!(DiskSpec::parse("a,size=1G"), Err(UnknownKey("size".into())));
        // Operation counts take no suffix; a burst needs a rate.
        assert!(matches!(
            DiskSpec::parse("a,iops=1k"),
            Err(Limits(LimitsError::InvalidValue { .. }))
        ));
        assert!(matches!(
            DiskSpec::parse("a,burst_ops=8"),
            Err(Limits(LimitsError::BurstWithoutRate { .. }))
        ));
        // Messages name the culprit.
        assert!(
            DiskSpec::parse("a,foo")
                .unwrap_err()
                .to_string()
                .contains("`foo`")
        );
    }
}
