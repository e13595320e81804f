//! Host files a VM uses (kernel, initrd, disks): which paths may be opened,
//! how they are opened so that nothing can hang or be swapped, and the image
//! locks (one writer or many readers, as QEMU does).
//!
//! - **Where**: the daemon ([`HostPolicy::beneath`]) opens a client's path
//!   only beneath one of its image directories: relative to that
//!   directory's fd with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`,
//!   so `..`, absolute symlinks and links anywhere in the path are refused
//!   by the kernel, not by string checks. `corral run` and library users
//!   ([`HostPolicy::unrestricted`]) open any path with their own rights.
//! - **How**: always `O_NONBLOCK | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC`
//!   (a FIFO opens at once instead of waiting for a writer; `NOFOLLOW`
//!   only beneath the image directories), read-only
//!   unless the disk is writable. The *opened* fd is checked with fstat:
//!   regular files, and block devices for disks when allowed; FIFOs,
//!   sockets, character devices and directories are refused. Then
//!   `O_NONBLOCK` is cleared and that same fd is used for everything, so a
//!   rename or symlink swap after the check changes nothing.
//! - **Locks**: an OFD lock (`F_OFD_SETLK`, never waits) on the opened fd,
//!   exclusive for a writable disk, shared otherwise. OFD locks belong to
//!   the open file, so two VMs of one daemon conflict as two processes do
//!   (a `corral run` takes the same locks). They are released when the last
//!   fd of the open file closes, or by [`HostFile::unlock`].

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use rustix::fs::{Mode, OFlags, ResolveFlags};

/// The image directory when `corral serve` is given none.
pub const DEFAULT_IMAGE_DIR: &str = "/var/lib/corral/images";

/// Longest part of a client's path quoted in an error message.
const QUOTE_MAX: usize = 64;

/// What a file is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The kernel image (read-only, shared lock).
    Kernel,
    /// The initial ramdisk (read-only, shared lock).
    Initrd,
    /// A disk: exclusive lock when writable, shared when read-only.
    Disk {
        /// Opened read-write.
        writable: bool,
        /// Opened `O_DIRECT`.
        direct: bool,
    },
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Kernel => "kernel",
            Self::Initrd => "initrd",
            Self::Disk { .. } => "disk",
        })
    }
}

/// Why a host file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum HostFileError {
    /// The host-path policy refuses it (HTTP 400, code `path_policy`).
    #[error("{role} {path}: {why}")]
    Policy {
        /// What it was for.
        role: Role,
        /// The path as given (quoted, at most 64 bytes).
        path: String,
        /// Which rule refuses it.
        why: String,
    },
    /// Another user holds a conflicting lock (HTTP 409, code `image_locked`).
    #[error(
        "{role} {path} is in use{}: one writer or many readers per image ({wanted} lock refused)",
        holder.as_ref().map(|h| format!(" by VM {h:?}")).unwrap_or_else(|| " by another VM or process".into())
    )]
    Locked {
        /// What it was for.
        role: Role,
        /// The path as given (quoted).
        path: String,
        /// `shared` or `exclusive`.
        wanted: &'static str,
        /// The VM that holds it, when known.
        holder: Option<String>,
        /// Device and inode of the file.
        key: (u64, u64),
    },
    /// The file cannot be opened or examined (HTTP 400).
    #[error("cannot read {role} {path}: {err}")]
    Io {
        /// What it was for.
        role: Role,
        /// The path as given (quoted).
        path: String,
        /// The cause.
        err: std::io::Error,
    },
}

/// A client's path for an error message: at most 64 bytes of it.
fn quote(p: &Path) -> String {
    let s = p.to_string_lossy();
    if s.len() <= QUOTE_MAX {
        return s.into_owned();
    }
    let mut end = QUOTE_MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// One image directory, open.
#[derive(Debug)]
struct ImageDir {
    /// As configured.
    given: PathBuf,
    /// Canonical form.
    canonical: PathBuf,
    fd: OwnedFd,
}

/// Which host files may be opened. Cheap to clone.
#[derive(Debug, Clone)]
pub struct HostPolicy {
    /// `None`: any path, with the caller's rights.
    dirs: Option<Arc<Vec<ImageDir>>>,
    allow_block_devices: bool,
}

impl HostPolicy {
    /// Any path, as the calling user may open it (`corral run`, library
    /// users); block devices allowed as disks. Still non-blocking,
    /// type-checked and locked.
    pub fn unrestricted() -> Self {
        Self {
            dirs: None,
            allow_block_devices: true,
        }
    }

    /// Only beneath `dirs` (each created 0700 if missing); block devices
    /// only with `allow_block_devices`.
    pub fn beneath(dirs: &[PathBuf], allow_block_devices: bool) -> std::io::Result<Self> {
        let mut open = Vec::new();
        for d in dirs {
            if !d.is_absolute() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("image directory {} is not an absolute path", d.display()),
                ));
            }
            if !d.exists() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(d)
                    .map_err(|e| ctx(e, format!("creating image directory {}", d.display())))?;
            }
            let canonical = d
                .canonicalize()
                .map_err(|e| ctx(e, format!("image directory {}", d.display())))?;
            let fd = rustix::fs::open(
                &canonical,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| ctx(e.into(), format!("opening image directory {}", d.display())))?;
            open.push(ImageDir {
                given: d.clone(),
                canonical,
                fd,
            });
        }
        if open.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "at least one image directory is needed",
            ));
        }
        Ok(Self {
            dirs: Some(Arc::new(open)),
            allow_block_devices,
        })
    }

    /// The image directories (canonical), or `None` when unrestricted.
    pub fn image_dirs(&self) -> Option<Vec<PathBuf>> {
        self.dirs
            .as_ref()
            .map(|d| d.iter().map(|d| d.canonical.clone()).collect())
    }

    /// Opens `path` for `role`: checks, clears `O_NONBLOCK`, locks.
    pub fn open(&self, path: &Path, role: Role) -> Result<HostFile, HostFileError> {
        let policy = |why: String| HostFileError::Policy {
            role,
            path: quote(path),
            why,
        };
        let io = |err| HostFileError::Io {
            role,
            path: quote(path),
            err,
        };
        let (writable, direct) = match role {
            Role::Disk { writable, direct } => (writable, direct),
            _ => (false, false),
        };
        let file = match &self.dirs {
            None => {
                // The caller's own rights, links followed; still never
                // waits for a FIFO's writer.
                let mut flags = libc::O_NONBLOCK | libc::O_NOCTTY;
                if direct {
                    flags |= libc::O_DIRECT;
                }
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(writable)
                    .custom_flags(flags)
                    .open(path)
                    .map_err(io)?
            }
            Some(dirs) => {
                let (dir, rest) = self.locate(dirs, path).ok_or_else(|| {
                    policy(format!(
                        "not beneath an image directory ({}); this daemon opens kernels, \
                         initrds and disks only beneath its --image-dir directories",
                        dirs.iter()
                            .map(|d| d.canonical.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                })?;
                let mut flags = OFlags::NONBLOCK
                    | OFlags::NOFOLLOW
                    | OFlags::NOCTTY
                    | OFlags::CLOEXEC
                    | if writable {
                        OFlags::RDWR
                    } else {
                        OFlags::RDONLY
                    };
                if direct {
                    flags |= OFlags::DIRECT;
                }
                let fd = rustix::fs::openat2(
                    &dir.fd,
                    &rest,
                    flags,
                    Mode::empty(),
                    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
                )
                .map_err(|e| match e {
                    rustix::io::Errno::XDEV => policy(format!(
                        "resolves outside the image directory {}; `..` may not leave it",
                        dir.canonical.display()
                    )),
                    rustix::io::Errno::LOOP => policy(
                        "is or passes through a symbolic link; links are not followed beneath the image directories"
                            .into(),
                    ),
                    rustix::io::Errno::ISDIR => policy("is a directory".into()),
                    rustix::io::Errno::NOSYS => policy(
                        "this kernel has no openat2(2) (Linux 5.6 or later is needed to open files beneath the image directories)"
                            .into(),
                    ),
                    e => io(e.into()),
                })?;
                File::from(fd)
            }
        };
        let meta = file.metadata().map_err(io)?;
        let ft = meta.file_type();
        let kind = if ft.is_file() {
            "regular"
        } else if ft.is_block_device() {
            "block"
        } else if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_socket() {
            "a socket"
        } else if ft.is_char_device() {
            "a character device"
        } else if ft.is_dir() {
            "a directory"
        } else {
            "not a regular file"
        };
        match (kind, role) {
            ("regular", _) => {}
            ("block", Role::Disk { .. }) if self.allow_block_devices => {}
            ("block", Role::Disk { .. }) => {
                return Err(policy(
                    "is a block device; block devices are accepted as disks only when the daemon runs with --allow-block-devices"
                        .into(),
                ));
            }
            ("block", _) => {
                return Err(policy(format!(
                    "is a block device; a {role} must be a regular file"
                )));
            }
            (k, _) => {
                return Err(policy(format!(
                    "is {k}; only regular files{} are accepted",
                    if matches!(role, Role::Disk { .. }) {
                        " (and block devices, with --allow-block-devices)"
                    } else {
                        ""
                    }
                )));
            }
        }
        // Blocking I/O from now on (regular files and block devices ignore
        // O_NONBLOCK anyway; cleared so that nothing depends on that).
        let fl = rustix::fs::fcntl_getfl(&file).map_err(|e| io(e.into()))?;
        rustix::fs::fcntl_setfl(&file, fl - OFlags::NONBLOCK).map_err(|e| io(e.into()))?;
        let exclusive = writable;
        let key = (meta.dev(), meta.ino());
        if let Err(e) = ofd_lock(
            &file,
            if exclusive {
                LockOp::Exclusive
            } else {
                LockOp::Shared
            },
        ) {
            return Err(match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EACCES) => HostFileError::Locked {
                    role,
                    path: quote(path),
                    wanted: if exclusive { "exclusive" } else { "shared" },
                    holder: None,
                    key,
                },
                _ => io(e),
            });
        }
        Ok(HostFile {
            file: Arc::new(file),
            path: path.to_path_buf(),
            key,
            len: meta.len(),
            block: kind == "block",
        })
    }

    /// The image directory `path` is beneath and the rest of the path
    /// (relative paths: the first directory where the file exists).
    fn locate<'a>(&self, dirs: &'a [ImageDir], path: &Path) -> Option<(&'a ImageDir, PathBuf)> {
        if path.is_relative() {
            let first = dirs.first()?;
            let found = dirs.iter().find(|d| {
                rustix::fs::statat(&d.fd, path, rustix::fs::AtFlags::SYMLINK_NOFOLLOW).is_ok()
            });
            return Some((found.unwrap_or(first), path.to_path_buf()));
        }
        // The longest image directory that is a prefix (component-wise) of
        // the path as given; `..` after it is left to RESOLVE_BENEATH.
        let mut best: Option<(&ImageDir, PathBuf, usize)> = None;
        for d in dirs {
            for base in [&d.canonical, &d.given] {
                if let Ok(rest) = path.strip_prefix(base) {
                    let depth = base.components().count();
                    if best.as_ref().is_none_or(|b| depth > b.2) {
                        best = Some((d, rest.to_path_buf(), depth));
                    }
                }
            }
        }
        let (d, rest, _) = best?;
        // "DIR" itself, or "DIR/." : nothing to open beneath it.
        if rest.components().all(|c| matches!(c, Component::CurDir)) {
            return Some((d, PathBuf::from(".")));
        }
        Some((d, rest))
    }
}

fn ctx(e: std::io::Error, what: String) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

#[derive(Clone, Copy)]
enum LockOp {
    Shared,
    Exclusive,
    Unlock,
}

/// `fcntl(F_OFD_SETLK)` over the whole file; never waits.
fn ofd_lock(f: &impl AsFd, op: LockOp) -> std::io::Result<()> {
    // SAFETY: `flock` is a plain C struct; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = match op {
        LockOp::Shared => libc::F_RDLCK,
        LockOp::Exclusive => libc::F_WRLCK,
        LockOp::Unlock => libc::F_UNLCK,
    } as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    // l_start = l_len = 0: the whole file; l_pid must be 0 for OFD locks.
    // SAFETY: F_OFD_SETLK reads the `flock` we pass, which outlives the call;
    // the fd is valid for the borrow.
    let r = unsafe { libc::fcntl(f.as_fd().as_raw_fd(), libc::F_OFD_SETLK, &fl) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// An opened, checked and locked host file. Clones share the open file
/// (and so its lock).
#[derive(Debug, Clone)]
pub struct HostFile {
    file: Arc<File>,
    path: PathBuf,
    key: (u64, u64),
    len: u64,
    block: bool,
}

impl HostFile {
    /// A file opened, checked and locked by another process (the daemon)
    /// and passed to this one (a VM process): its lock is the open file's,
    /// shared with the sender.
    pub fn from_passed(file: File, path: PathBuf) -> std::io::Result<Self> {
        let meta = file.metadata()?;
        let block = meta.file_type().is_block_device();
        if !block && !meta.file_type().is_file() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{}: a passed file must be regular or a block device",
                    path.display()
                ),
            ));
        }
        Ok(HostFile {
            file: Arc::new(file),
            path,
            key: (meta.dev(), meta.ino()),
            len: meta.len(),
            block,
        })
    }

    /// The open file.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// A new fd of the same open file (same offset, same lock).
    pub fn try_clone_file(&self) -> std::io::Result<File> {
        self.file.try_clone()
    }

    /// The path as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// (device, inode): the image's identity for lock bookkeeping.
    pub fn key(&self) -> (u64, u64) {
        self.key
    }

    /// Size in bytes from fstat (0 for block devices).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True if the file is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A block device.
    pub fn is_block_device(&self) -> bool {
        self.block
    }

    /// Releases the image lock now, even while other fds of the open file
    /// (a stopped VM's device) are still alive.
    pub fn unlock(&self) {
        if let Err(e) = ofd_lock(&*self.file, LockOp::Unlock) {
            tracing::warn!(path = %self.path.display(), "releasing the image lock: {e}");
        }
    }
}

/// A file given by path (opened by [`crate::builder::start`] with
/// [`HostPolicy::unrestricted`]) or already opened under a policy.
#[derive(Debug, Clone)]
pub enum HostImage {
    /// Open this path with the caller's rights.
    Path(PathBuf),
    /// Already open.
    File(HostFile),
}

impl HostImage {
    /// Opens a `Path` (unrestricted) or returns the open file.
    pub fn open(&self, role: Role) -> Result<HostFile, HostFileError> {
        match self {
            Self::Path(p) => HostPolicy::unrestricted().open(p, role),
            Self::File(f) => Ok(f.clone()),
        }
    }

    /// The path, for messages.
    pub fn path(&self) -> &Path {
        match self {
            Self::Path(p) => p,
            Self::File(f) => f.path(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("corral-hostfile-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn beneath_refuses_escapes_links_and_fifos() {
        let d = tmp("policy");
        let outside = tmp("outside");
        std::fs::write(outside.join("secret"), b"x").unwrap();
        std::fs::write(d.join("ok.img"), vec![0u8; 4096]).unwrap();
        std::os::unix::fs::symlink(outside.join("secret"), d.join("link")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            d.join("fifo"),
            rustix::fs::FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let p = HostPolicy::beneath(std::slice::from_ref(&d), false).unwrap();
        let ro = Role::Disk {
            writable: false,
            direct: false,
        };
        assert!(p.open(&d.join("ok.img"), ro).is_ok());
        assert!(p.open(Path::new("ok.img"), ro).is_ok());
        for bad in [
            outside.join("secret"),
            d.join("link"),
            d.join("../")
                .join(outside.file_name().unwrap())
                .join("secret"),
            d.join("fifo"),
            d.clone(),
        ] {
            let e = p.open(&bad, ro).unwrap_err();
            assert!(matches!(e, HostFileError::Policy { .. }), "{bad:?}: {e}");
        }
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_dir_all(&outside);
    }

    #[test]
    fn one_writer_or_many_readers() {
        let d = tmp("locks");
        let img = d.join("a.img");
        std::fs::write(&img, vec![0u8; 4096]).unwrap();
        let p = HostPolicy::unrestricted();
        let rw = Role::Disk {
            writable: true,
            direct: false,
        };
        let w = p.open(&img, rw).unwrap();
        assert!(matches!(
            p.open(&img, rw),
            Err(HostFileError::Locked { .. })
        ));
        assert!(matches!(
            p.open(&img, Role::Kernel),
            Err(HostFileError::Locked { .. })
        ));
        w.unlock();
        let r1 = p.open(&img, Role::Initrd).unwrap();
        let _r2 = p.open(&img, Role::Kernel).unwrap();
        assert!(p.open(&img, rw).is_err());
        drop(r1);
        drop(_r2);
        assert!(p.open(&img, rw).is_ok());
        let _ = std::fs::remove_dir_all(&d);
    }
}
