//! Framing of the VM-process protocol: one JSON message per SOCK_SEQPACKET
//! datagram (the kernel keeps message boundaries, so no length prefix), files
//! as SCM_RIGHTS beside it.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::proto::MAX_MESSAGE;

/// Most files passed with one message (kernel, initrd, 16 disks, a gate).
pub const MAX_FDS: usize = 24;

/// Errors of the framing.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The socket failed.
    #[error("VM process socket: {0}")]
    Io(#[from] std::io::Error),
    /// A message that is not the protocol's.
    #[error("VM process protocol: {0}")]
    Decode(String),
}

/// A connected pair of SOCK_SEQPACKET Unix sockets (close-on-exec).
pub fn pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    Ok(rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

/// An unbound SOCK_SEQPACKET Unix socket (close-on-exec).
fn socket() -> std::io::Result<OwnedFd> {
    Ok(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Listens on `path` (a VM process's control socket: mode 0600, backlog
/// 8), replacing a stale file there.
pub fn listen(path: &std::path::Path) -> std::io::Result<OwnedFd> {
    let s = socket()?;
    let addr = rustix::net::SocketAddrUnix::new(path)?;
    let _ = std::fs::remove_file(path);
    rustix::net::bind(&s, &addr)?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    rustix::net::listen(&s, 8)?;
    Ok(s)
}

/// Connects to the control socket at `path`.
pub fn connect(path: &std::path::Path) -> std::io::Result<OwnedFd> {
    let s = socket()?;
    rustix::net::connect(&s, &rustix::net::SocketAddrUnix::new(path)?)?;
    Ok(s)
}

/// The pid, in the caller's pid namespace, of the process that listens on
/// the other end of the connected `sock` (`SO_PEERCRED`: the kernel's
/// record of the process that called `listen`, which no peer can forge).
pub fn peer_pid(sock: impl AsFd) -> std::io::Result<u32> {
    // nix, not rustix: rustix's `UCred` holds a non-zero `Pid`, and the
    // kernel reports 0 for a peer that has no pid in our namespace.
    let c = nix::sys::socket::getsockopt(&sock, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(std::io::Error::from)?;
    match u32::try_from(c.pid()) {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(std::io::Error::other("no peer process")),
    }
}

/// Sends `msg` (and `fds`) as one datagram.
pub fn send<T: Serialize>(
    sock: impl AsFd,
    msg: &T,
    fds: &[BorrowedFd<'_>],
) -> Result<(), WireError> {
    let bytes = serde_json::to_vec(msg).map_err(|e| WireError::Decode(e.to_string()))?;
    if bytes.len() > MAX_MESSAGE {
        return Err(WireError::Decode(format!(
            "message of {} bytes is over the {MAX_MESSAGE}-byte limit",
            bytes.len()
        )));
    }
    if fds.len() > MAX_FDS {
        return Err(WireError::Decode(format!(
            "{} files in one message",
            fds.len()
        )));
    }
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(WireError::Decode("too many files".into()));
    }
    let flags = SendFlags::NOSIGNAL;
    let n = loop {
        match rustix::net::sendmsg(&sock, &[IoSlice::new(&bytes)], &mut control, flags) {
            Err(rustix::io::Errno::INTR) => continue,
            r => break r.map_err(std::io::Error::from)?,
        }
    };
    if n != bytes.len() {
        return Err(WireError::Decode("short send".into()));
    }
    Ok(())
}

/// Receives one message and its files; `None` at end of stream (the peer
/// closed its end: exited or dropped the connection).
pub fn recv<T: DeserializeOwned>(sock: impl AsFd) -> Result<Option<(T, Vec<OwnedFd>)>, WireError> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let r = loop {
        match rustix::net::recvmsg(
            &sock,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Err(rustix::io::Errno::INTR) => continue,
            r => break r.map_err(std::io::Error::from)?,
        }
    };
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(it) = m {
            fds.extend(it);
        }
    }
    if r.flags.contains(ReturnFlags::CTRUNC) {
        return Err(WireError::Decode("too many files in one message".into()));
    }
    if r.bytes == 0 {
        return Ok(None);
    }
    if r.flags.contains(ReturnFlags::TRUNC) || r.bytes > buf.len() {
        return Err(WireError::Decode(format!(
            "message over the {MAX_MESSAGE}-byte limit"
        )));
    }
    let msg =
        serde_json::from_slice(&buf[..r.bytes]).map_err(|e| WireError::Decode(e.to_string()))?;
    Ok(Some((msg, fds)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmproc::proto::{Request, ToVm};

    #[test]
    fn messages_and_files_cross_a_pair() {
        let (a, b) = pair().unwrap();
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        send(
            &a,
            &ToVm {
                id: 7,
                req: Request::Stats,
            },
            &[f.as_fd()],
        )
        .unwrap();
        let (m, fds): (ToVm, _) = recv(&b).unwrap().unwrap();
        assert_eq!(m.id, 7);
        assert!(matches!(m.req, Request::Stats));
        assert_eq!(fds.len(), 1);
        drop(a);
        assert!(
            recv::<ToVm>(&b).unwrap().is_none(),
            "EOF once the peer is gone"
        );
    }

    #[test]
    fn a_foreign_message_is_an_error() {
        let (a, b) = pair().unwrap();
        rustix::net::send(
            &a,
            b"{\"id\":1,\"req\":\"format_disk\"}",
            SendFlags::empty(),
        )
        .unwrap();
        assert!(matches!(recv::<ToVm>(&b), Err(WireError::Decode(_))));
    }
}
