//! Starting one `corral vmm` ([`spawn_vm_process`]): what the launcher
//! does for the daemon, and `bootbench side` for its figures, so that the
//! bench times exactly the daemon's start.
//!
//! With a pid namespace the process is cloned into a new one
//! (`clone(CLONE_NEWPID)`) and execs `corral vmm` there as its pid 1. The
//! jail then has nothing to fork (`jail::enter` sees pid 1 and skips its
//! fork and the outer process). Measured (loaded dev host, `bootbench
//! side`; BENCHMARKS.md, "Boot"): the jail's fork made the VM process a
//! copy-on-write child of an already started one, whose first writes to
//! every page it had touched before (heap, stacks, data) each took a
//! fault, and its outer process dropped its privileges and built its
//! filter on the other CPU meanwhile.

use std::ffi::{CString, OsStr};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::launcher::CHILD_FD;
use super::nspool::{SPARE_KINDS, Spare};

/// How a VM process is started.
#[derive(Debug, Clone, Copy, Default)]
pub struct SpawnOpts<'a> {
    /// In a process group of its own with SIGHUP ignored (a VM that may
    /// outlive the daemon; it stays in the daemon's session: see
    /// `launcher`).
    pub own_group: bool,
    /// As pid 1 of a new pid namespace (the VM's jail asks for one).
    pub pid_namespace: bool,
    /// In these namespaces, made for it ahead ([`super::nspool`]); the
    /// process is told so (`--jail-ns net,ipc,uts`) and does not make its
    /// own.
    pub namespaces: Option<&'a Spare>,
    /// Its stderr (default: ours; a bench reads the boot trace there).
    pub stderr: Option<BorrowedFd<'a>>,
}

/// A started VM process: the launcher's child.
#[derive(Debug)]
pub struct VmChild {
    pid: libc::pid_t,
    reaped: bool,
}

/// How a child ended, as the daemon reports it (`exit status 1`, `killed
/// by signal 9`).
fn describe(status: libc::c_int) -> String {
    if libc::WIFEXITED(status) {
        format!("exit status {}", libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        format!("killed by signal {}", libc::WTERMSIG(status))
    } else {
        format!("wait status {status:#x}")
    }
}

impl VmChild {
    /// Its pid (in the host's pid namespace).
    pub fn id(&self) -> u32 {
        self.pid as u32
    }

    fn wait_flags(&mut self, flags: libc::c_int) -> std::io::Result<Option<String>> {
        if self.reaped {
            return Err(std::io::Error::from_raw_os_error(libc::ECHILD));
        }
        let mut status = 0;
        loop {
            // SAFETY: waitpid of our own child, into a local.
            let r = unsafe { libc::waitpid(self.pid, &mut status, flags) };
            match r {
                0 => return Ok(None),
                r if r == self.pid => {
                    self.reaped = true;
                    return Ok(Some(describe(status)));
                }
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// How it ended, if it has (reaps it).
    pub fn try_wait(&mut self) -> std::io::Result<Option<String>> {
        self.wait_flags(libc::WNOHANG)
    }

    /// Waits until it ends (reaps it).
    pub fn wait(&mut self) -> std::io::Result<String> {
        self.wait_flags(0)?
            .ok_or_else(|| std::io::Error::other("waitpid returned no status"))
    }

    /// SIGKILL, unless it was reaped (its pid may be another process's by
    /// then).
    pub fn kill(&mut self) {
        if !self.reaped {
            // SAFETY: kill(2) of our own child, not yet reaped, so its pid
            // is still its own.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
        }
    }
}

/// In the child of [`spawn_raw`]: reports `errno` on `wr` and exits.
///
/// # Safety
///
/// Async-signal-safe only; `wr` is the child's end of the exec pipe.
unsafe fn fail(wr: i32) -> ! {
    // SAFETY: errno of this thread; write(2) of 4 bytes we own; _exit.
    unsafe {
        let e: i32 = *libc::__errno_location();
        libc::write(wr, (&e as *const i32).cast(), 4);
        libc::_exit(127)
    }
}

fn cstr(s: &OsStr) -> std::io::Result<CString> {
    CString::new(s.as_bytes()).map_err(std::io::Error::other)
}

/// Starts `exe vmm --fd 3 --name NAME [--socket PATH] [--jail-ns LIST]`
/// with `sock` as its fd 3, stdin from `/dev/null`, stdout ours and stderr
/// ours or `opts.stderr`. Returns once it has exec'd (an exec that fails
/// is this call's error).
pub fn spawn_vm_process(
    exe: &Path,
    sock: &OwnedFd,
    name: &str,
    socket: Option<&Path>,
    opts: SpawnOpts<'_>,
) -> std::io::Result<VmChild> {
    let mut args: Vec<&OsStr> = vec![exe.as_os_str(), "vmm".as_ref(), "--fd".as_ref()];
    let fd = CHILD_FD.to_string();
    args.push(fd.as_ref());
    args.extend([OsStr::new("--name"), OsStr::new(name)]);
    if let Some(s) = socket {
        args.extend([OsStr::new("--socket"), s.as_os_str()]);
    }
    if opts.namespaces.is_some() {
        args.extend([OsStr::new("--jail-ns"), OsStr::new(SPARE_KINDS)]);
    }
    spawn_raw(exe, &args, sock, opts)
}

/// Forks (with `CLONE_NEWPID` if asked) and execs `exe` with `argv`. All
/// allocation is done before the clone: the launcher has threads, so the
/// child may make only async-signal-safe calls before `execv`.
fn spawn_raw(
    exe: &Path,
    argv: &[&OsStr],
    sock: &OwnedFd,
    opts: SpawnOpts<'_>,
) -> std::io::Result<VmChild> {
    let err_fd = opts.stderr.map(|f| f.as_raw_fd());
    let ns: Option<[(i32, libc::c_int); 3]> = opts.namespaces.map(|s| {
        [
            (s.net.as_raw_fd(), libc::CLONE_NEWNET),
            (s.ipc.as_raw_fd(), libc::CLONE_NEWIPC),
            (s.uts.as_raw_fd(), libc::CLONE_NEWUTS),
        ]
    });
    let path = cstr(exe.as_os_str())?;
    let owned: Vec<CString> = argv.iter().map(|a| cstr(a)).collect::<Result<_, _>>()?;
    let mut ptrs: Vec<*const libc::c_char> = owned.iter().map(|a| a.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    let null = rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    // The child reports a failed exec through this pipe (close-on-exec: a
    // successful exec closes it empty).
    let (rd, wr) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let raw = sock.as_raw_fd();
    let (null_fd, wr_fd) = (null.as_raw_fd(), wr.as_raw_fd());
    let mut flags = libc::SIGCHLD as libc::c_long;
    if opts.pid_namespace {
        flags |= libc::CLONE_NEWPID as libc::c_long;
    }
    // SAFETY: clone without CLONE_VM and with a null stack is fork(2): the
    // child gets a copy of this address space and returns here with 0.
    // It calls only async-signal-safe functions on memory prepared before
    // the clone (no allocation: another thread may hold malloc's lock) and
    // ends in execv or _exit.
    let pid = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
    if pid == 0 {
        // SAFETY: the child, as above; every fd named is open in it.
        unsafe {
            let mut empty: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut empty);
            libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            // First, before a dup2 could land on one of these fds.
            for (fd, kind) in ns.iter().flatten() {
                if libc::setns(*fd, *kind) < 0 {
                    fail(wr_fd);
                }
            }
            if libc::dup2(null_fd, 0) < 0 {
                fail(wr_fd);
            }
            if let Some(e) = err_fd
                && libc::dup2(e, 2) < 0
            {
                fail(wr_fd);
            }
            if raw == CHILD_FD {
                // dup2 onto itself would keep close-on-exec.
                if libc::fcntl(raw, libc::F_SETFD, 0) < 0 {
                    fail(wr_fd);
                }
            } else if libc::dup2(raw, CHILD_FD) < 0 {
                fail(wr_fd);
            }
            if opts.own_group {
                if libc::setpgid(0, 0) < 0 {
                    fail(wr_fd);
                }
                libc::signal(libc::SIGHUP, libc::SIG_IGN);
            }
            libc::execv(path.as_ptr(), ptrs.as_ptr());
            fail(wr_fd)
        }
    }
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    drop(wr);
    drop(null);
    let mut child = VmChild {
        pid: pid as libc::pid_t,
        reaped: false,
    };
    let mut errno = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match rustix::io::read(&rd, &mut errno[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    if got == 0 {
        return Ok(child);
    }
    let _ = child.wait();
    Err(std::io::Error::from_raw_os_error(i32::from_ne_bytes(errno)))
}
