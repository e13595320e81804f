//! What `corral serve` sets up on the host and takes down again: the state
//! directory and its lock, the Unix socket, the token file, the fd limit.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::ServeError;

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ServeError {
    let what = what.into();
    move |err| ServeError::Io { what, err }
}

/// The exclusive lock on a state directory, held while the daemon runs
/// (released by the kernel when the process ends, however it ends).
pub struct StateLock {
    _file: File,
}

/// Creates `dir` (mode 0700) if needed and takes `dir/corral.lock` with a
/// non-blocking exclusive `flock`; refuses, naming the holder's pid, when
/// another daemon has it.
pub fn lock_state_dir(dir: &Path) -> Result<StateLock, ServeError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io(format!(
            "creating the state directory {}",
            dir.display()
        )))?;
    let path = dir.join("corral.lock");
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .map_err(io(format!("opening {}", path.display())))?;
    // SAFETY: flock(2) on a descriptor this function owns.
    let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let who = if holder.is_empty() {
                "another corral daemon".to_string()
            } else {
                format!("corral pid {}", super::error::clip(holder))
            };
            return Err(ServeError::Config(format!(
                "the state directory {} is in use by {who} (lock {}); \
                 stop that daemon or pass another --state-dir",
                dir.display(),
                path.display()
            )));
        }
        return Err(ServeError::Io {
            what: format!("locking {}", path.display()),
            err,
        });
    }
    file.set_len(0)
        .and_then(|()| file.write_all(format!("{}\n", std::process::id()).as_bytes()))
        .map_err(io(format!("writing {}", path.display())))?;
    Ok(StateLock { _file: file })
}

/// A Unix socket this daemon bound: removed on drop only if the path still
/// is that very socket (same device and inode).
pub struct BoundSocket {
    path: PathBuf,
    id: Option<(u64, u64)>,
}

impl Drop for BoundSocket {
    fn drop(&mut self) {
        if let Ok(m) = std::fs::symlink_metadata(&self.path)
            && Some((m.dev(), m.ino())) == self.id
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds the Unix socket at `path`, mode 0600 (0660 with `group`, chowned
/// to it). If a daemon answers there, refuses and leaves it alone; replaces
/// the path only when it is a socket that nobody answers on; refuses any
/// other kind of file.
pub fn bind_unix(
    path: &Path,
    group: Option<u32>,
) -> Result<(tokio::net::UnixListener, BoundSocket), ServeError> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(ServeError::Config(format!(
                "{} exists and is not a socket; not touching it",
                path.display()
            )));
        }
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => {
                return Err(ServeError::Config(format!(
                    "a daemon is already listening on {}; leaving it alone",
                    path.display()
                )));
            }
            Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
                tracing::info!("removing the stale socket {}", path.display());
                std::fs::remove_file(path).map_err(io(format!("removing {}", path.display())))?;
            }
            Err(e) => {
                return Err(ServeError::Config(format!(
                    "{} is a socket that cannot be probed ({e}); not touching it",
                    path.display()
                )));
            }
        }
    }
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    }
    // Between bind and chmod the socket has the umask's mode; a peer that
    // connects then is still refused by the SO_PEERCRED check.
    let l =
        tokio::net::UnixListener::bind(path).map_err(io(format!("binding {}", path.display())))?;
    let id = std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()));
    let bound = BoundSocket {
        path: path.to_path_buf(),
        id,
    };
    let mode = match group {
        Some(gid) => {
            std::os::unix::fs::lchown(path, None, Some(gid))
                .map_err(io(format!("chgrp {gid} {}", path.display())))?;
            0o660
        }
        None => 0o600,
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io(format!("chmod {mode:o} {}", path.display())))?;
    Ok((l, bound))
}

/// The token file: written 0600 (by a rename, so a link at the path is
/// replaced, not followed); removed on drop if it still holds our token.
pub struct TokenFile {
    path: PathBuf,
    token: String,
}

impl TokenFile {
    /// Writes `token` to `path`.
    pub fn write(path: &Path, token: &str) -> Result<Self, ServeError> {
        if let Some(dir) = path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        }
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(io(format!("creating {}", tmp.display())))?;
        f.write_all(format!("{token}\n").as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(io(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, path).map_err(io(format!("renaming to {}", path.display())))?;
        Ok(Self {
            path: path.to_path_buf(),
            token: token.to_string(),
        })
    }
}

impl Drop for TokenFile {
    fn drop(&mut self) {
        if std::fs::read_to_string(&self.path).is_ok_and(|t| t.trim() == self.token) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A new random token: 32 bytes from the kernel's CSPRNG, in hex.
pub fn new_token() -> Result<String, ServeError> {
    let mut b = [0u8; 32];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(io("reading /dev/urandom"))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Raises the soft limit of open files to the hard limit: the connection
/// caps, not the fd limit, are meant to bound the daemon's connections.
pub fn raise_fd_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            let old = r.rlim_cur;
            r.rlim_cur = r.rlim_max.min(1 << 20);
            if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                tracing::warn!("cannot raise the open-file limit from {old}");
            }
        }
    }
}

/// A group given by name or number.
pub fn resolve_group(name: &str) -> Result<u32, ServeError> {
    if let Ok(gid) = name.parse::<u32>() {
        return Ok(gid);
    }
    let text = std::fs::read_to_string("/etc/group").map_err(io("reading /etc/group"))?;
    text.lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let n = f.next()?;
            let _ = f.next();
            let gid = f.next()?.parse::<u32>().ok()?;
            (n == name).then_some(gid)
        })
        .next()
        .ok_or_else(|| {
            ServeError::Config(format!(
                "--socket-group {name}: no such group in /etc/group"
            ))
        })
}
