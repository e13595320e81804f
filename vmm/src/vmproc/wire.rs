//! Framing of the VM-process protocol: one JSON message per SOCK_SEQPACKET
//! datagram (the kernel keeps message boundaries, so no length prefix), files
//! as SCM_RIGHTS beside it.
//!
//! Every message starts with its version header, the key `version` first
//! in the object (`{"version":3,"id":1,"req":"status"}`), and [`recv`]
//! reads it before any field of the message: a message of another version
//! is [`WireError::Version`], naming both, whatever its fields are. Version
//! 1 can express this header too: its first message, `Hello`, began with
//! its own `version` field, and its other messages had none (a message
//! without the header is version 1's). So a version-1 `Hello` is refused
//! for its version, not for a field it lacks, and a version-1 VM process
//! that gets a later version's `Hello` (the same shape) refuses it for its
//! version too.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::proto::{MAX_MESSAGE, PROTOCOL_VERSION};

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
    /// A message of another version of the protocol (its header, read
    /// before the rest of it).
    #[error("VM process protocol: the other end speaks version {theirs}, this end version {ours}")]
    Version {
        /// This end's version ([`PROTOCOL_VERSION`]).
        ours: u32,
        /// The other end's (1: a message without a version header).
        theirs: u32,
    },
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

/// A message with its version header, as it is sent.
#[derive(Serialize)]
struct Versioned<'a, T> {
    version: u32,
    #[serde(flatten)]
    msg: &'a T,
}

/// Sends `msg` (and `fds`) as one datagram, after its version header.
pub fn send<T: Serialize>(
    sock: impl AsFd,
    msg: &T,
    fds: &[BorrowedFd<'_>],
) -> Result<(), WireError> {
    let bytes = serde_json::to_vec(&Versioned {
        version: PROTOCOL_VERSION,
        msg,
    })
    .map_err(|e| WireError::Decode(e.to_string()))?;
    send_bytes(sock, &bytes, fds)
}

/// Tells a peer that speaks protocol version `theirs` why this end will
/// not talk to it (`msg`: a `StartFailed`, or an error reply), in the
/// framing that version reads: version 1 had no header.
pub fn refuse<T: Serialize>(sock: impl AsFd, theirs: u32, msg: &T) {
    let bytes = if theirs == 1 {
        serde_json::to_vec(msg)
    } else {
        serde_json::to_vec(&Versioned {
            version: PROTOCOL_VERSION,
            msg,
        })
    };
    if let Ok(b) = bytes {
        let _ = send_bytes(sock, &b, &[]);
    }
}

fn send_bytes(sock: impl AsFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), WireError> {
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
        match rustix::net::sendmsg(&sock, &[IoSlice::new(bytes)], &mut control, flags) {
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
    let msg = decode(buf.get(..r.bytes).unwrap_or_default())?;
    Ok(Some((msg, fds)))
}

/// Decodes one message: its version header first (another version, or
/// none, is [`WireError::Version`] before any other field is looked at),
/// then the message, whose unknown fields are errors as before.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, WireError> {
    use serde::de::DeserializeSeed;
    let seen = std::cell::Cell::new(None);
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let r = Header::<T> {
        seen: &seen,
        msg: std::marker::PhantomData,
    }
    .deserialize(&mut de)
    .and_then(|m| de.end().map(|()| m));
    match seen.get() {
        Some(theirs) if theirs != PROTOCOL_VERSION => Err(WireError::Version {
            ours: PROTOCOL_VERSION,
            theirs,
        }),
        _ => r.map_err(|e| WireError::Decode(e.to_string())),
    }
}

/// Reads a message's version header (noting the version it names in
/// `seen`) and, only if it is this end's, the message after it.
struct Header<'a, T> {
    seen: &'a std::cell::Cell<Option<u32>>,
    msg: std::marker::PhantomData<T>,
}

impl<'de, T: serde::Deserialize<'de>> serde::de::DeserializeSeed<'de> for Header<'_, T> {
    type Value = T;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for Header<'_, T> {
    type Value = T;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a message beginning with its version")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<T, A::Error> {
        use serde::de::Error;
        let key: Option<String> = map.next_key()?;
        if key.as_deref() != Some("version") {
            // Version 1: no header (its `Hello` began with `version`).
            self.seen.set(Some(1));
            return Err(A::Error::custom("no version header"));
        }
        let version: u32 = map.next_value()?;
        self.seen.set(Some(version));
        if version != PROTOCOL_VERSION {
            return Err(A::Error::custom("another version"));
        }
        let msg = T::deserialize(serde::de::value::MapAccessDeserializer::new(&mut map))?;
        // An enum message is one key: nothing may follow it.
        if map.next_key::<serde::de::IgnoredAny>()?.is_some() {
            return Err(A::Error::custom("a field after the message"));
        }
        Ok(msg)
    }
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

    /// The daemon's side: what a version-1 VM process sends (no header)
    /// is refused for its version, naming both, before any of it is read.
    #[test]
    fn a_daemon_refuses_a_version_1_vm_process_by_its_header() {
        use crate::vmproc::proto::FromVm;
        for v1 in [
            r#"{"start_failed":{"message":"protocol version 3 is not supported: this corral vmm speaks version 1"}}"#,
            r#"{"reply":{"id":1,"resp":{"status":{"name":"a","nonce":"n","pid":1,"paused":false,"parked":false,"unsupervised":true,"exit":null,"vcpu_tids":[],"device_tid":null,"uptime_secs":1.0}}}}"#,
            r#"{"reply":{"id":0,"resp":{"error":{"message":"VM process protocol: unknown field `version`","kind":"other"}}}}"#,
        ] {
            let e = decode::<FromVm>(v1.as_bytes()).unwrap_err();
            assert!(
                matches!(e, WireError::Version { ours: 3, theirs: 1 }),
                "{v1}: {e}"
            );
            let m = e.to_string();
            assert!(m.contains("version 1") && m.contains("version 3"), "{m}");
        }
        // A later version is named too, whatever its message holds.
        let e = decode::<FromVm>(br#"{"version":4,"hello_v4":{"x":1}}"#).unwrap_err();
        assert!(
            matches!(e, WireError::Version { ours: 3, theirs: 4 }),
            "{e}"
        );
    }

    /// The VM process's side: a version-1 daemon's `Hello` (its own
    /// `version` field first) and requests (no header) are refused for
    /// their version, before the configuration is looked at (this one
    /// would not decode).
    #[test]
    fn a_vm_process_refuses_a_version_1_daemon_by_its_header() {
        use crate::vmproc::proto::Hello;
        let e = decode::<Hello>(br#"{"version":1,"vm":{"park_relay":true}}"#).unwrap_err();
        assert!(
            matches!(e, WireError::Version { ours: 3, theirs: 1 }),
            "{e}"
        );
        let e = decode::<ToVm>(br#"{"id":4,"req":"park"}"#).unwrap_err();
        assert!(
            matches!(e, WireError::Version { ours: 3, theirs: 1 }),
            "{e}"
        );
        // Its own version's messages still refuse unknown fields, in the
        // message and after it.
        for bad in [
            r#"{"version":3,"id":1,"req":"stats","x":1}"#,
            r#"{"version":3,"id":1,"req":"format_disk"}"#,
            r#"{"version":3}"#,
        ] {
            assert!(
                matches!(decode::<ToVm>(bad.as_bytes()), Err(WireError::Decode(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            decode::<crate::vmproc::proto::FromVm>(
                br#"{"version":3,"start_failed":{"message":"m"},"x":1}"#
            ),
            Err(WireError::Decode(_))
        ));
    }

    /// What goes on the wire: the header first; a refusal to a version-1
    /// peer in its framing (no header), which it decodes as its own.
    #[test]
    fn the_header_comes_first_and_a_refusal_speaks_the_peers_version() {
        use crate::vmproc::proto::FromVm;
        let (a, b) = pair().unwrap();
        send(
            &a,
            &ToVm {
                id: 5,
                req: Request::Status,
            },
            &[],
        )
        .unwrap();
        let mut buf = [0u8; 256];
        let n = rustix::net::recv(&b, &mut buf, rustix::net::RecvFlags::empty())
            .unwrap()
            .0;
        assert_eq!(
            std::str::from_utf8(&buf[..n]).unwrap(),
            r#"{"version":3,"id":5,"req":"status"}"#
        );
        let m = FromVm::StartFailed {
            message: "m".into(),
        };
        refuse(&a, 1, &m);
        let n = rustix::net::recv(&b, &mut buf, rustix::net::RecvFlags::empty())
            .unwrap()
            .0;
        assert_eq!(
            std::str::from_utf8(&buf[..n]).unwrap(),
            r#"{"start_failed":{"message":"m"}}"#
        );
        refuse(&a, 3, &m);
        let (got, _) = recv::<FromVm>(&b).unwrap().unwrap();
        assert!(matches!(got, FromVm::StartFailed { .. }));
    }

    #[test]
    fn a_foreign_message_is_an_error() {
        let (a, b) = pair().unwrap();
        rustix::net::send(
            &a,
            b"{\"version\":3,\"id\":1,\"req\":\"format_disk\"}",
            SendFlags::empty(),
        )
        .unwrap();
        assert!(matches!(recv::<ToVm>(&b), Err(WireError::Decode(_))));
    }
}
