//! Parsing a virtio-blk request out of a descriptor chain (§5.2.6).
//!
//! The chain is treated as a byte stream (any layout, §2.7.4): its
//! device-readable part starts with the 16-byte header (`type`, `reserved`,
//! `sector`), the device-writable part ends with the 1-byte status; what lies
//! between is the data. Everything is checked before any I/O: descriptor
//! addresses inside guest memory, readable before writable, the data on the
//! side its type needs, nothing on the other side. The chain is walked by
//! [`chain::walk`], which reports loops, bad indices, nested indirect
//! tables and chains over 4 GiB as errors (answered IOERR when the chain
//! has a writable status byte) instead of ending the chain quietly.

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use super::chain::{self, ChainError};

/// `VIRTIO_BLK_T_IN`.
pub const T_IN: u32 = 0;
/// `VIRTIO_BLK_T_OUT`.
pub const T_OUT: u32 = 1;
/// `VIRTIO_BLK_T_FLUSH`.
pub const T_FLUSH: u32 = 4;
/// `VIRTIO_BLK_T_GET_ID`.
pub const T_GET_ID: u32 = 8;
/// `VIRTIO_BLK_T_DISCARD`.
pub const T_DISCARD: u32 = 11;
/// `VIRTIO_BLK_T_WRITE_ZEROES`.
pub const T_WRITE_ZEROES: u32 = 13;

/// Size of the request header.
pub const HEADER_LEN: usize = 16;
/// Size of one discard / write-zeroes range (§5.2.6).
pub const RANGE_LEN: u64 = 16;
/// Most descriptors accepted in one request (data segments plus header and
/// status); the device announces `seg_max` below it.
pub const MAX_DESCRIPTORS: usize = 1026;

/// A guest buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Guest physical address.
    pub addr: GuestAddress,
    /// Length in bytes.
    pub len: u32,
}

/// Request type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestType {
    /// Read sectors into guest buffers.
    In,
    /// Write guest buffers to sectors.
    Out,
    /// Make previous writes durable.
    Flush,
    /// Return the device serial.
    GetId,
    /// Deallocate ranges.
    Discard,
    /// Zero ranges.
    WriteZeroes,
    /// Anything else (answered `VIRTIO_BLK_S_UNSUPP`).
    Unsupported(u32),
}

impl RequestType {
    fn from_u32(t: u32) -> Self {
        match t {
            T_IN => Self::In,
            T_OUT => Self::Out,
            T_FLUSH => Self::Flush,
            T_GET_ID => Self::GetId,
            T_DISCARD => Self::Discard,
            T_WRITE_ZEROES => Self::WriteZeroes,
            t => Self::Unsupported(t),
        }
    }
}

/// A parsed, structurally valid request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Head descriptor index (for the used ring).
    pub head: u16,
    /// What to do.
    pub kind: RequestType,
    /// First sector (in 512-byte units).
    pub sector: u64,
    /// Data buffers: device-writable for `In`/`GetId`, device-readable for
    /// `Out`/`Discard`/`WriteZeroes`, empty otherwise.
    pub data: Vec<Segment>,
    /// Total length of `data`.
    pub data_len: u64,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

/// Why a chain is not a valid request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// No device-writable byte for the status (it cannot even be failed).
    #[error("no status byte")]
    NoStatus,
    /// More than [`MAX_DESCRIPTORS`] descriptors.
    #[error("too many descriptors")]
    TooManyDescriptors,
    /// A descriptor points outside guest memory.
    #[error("descriptor outside guest memory")]
    OutOfMemory,
    /// A device-readable descriptor follows a device-writable one.
    #[error("readable descriptor after a writable one")]
    ReadableAfterWritable,
    /// Fewer than 16 readable bytes.
    #[error("short header")]
    ShortHeader,
    /// Data on the wrong side (direction) for the request type.
    #[error("data descriptor of the wrong direction")]
    WrongDirection,
    /// Data length not a multiple of the sector (or range) size.
    #[error("bad data length")]
    BadLength,
    /// The chain itself is broken (loop, bad index, too long, ...).
    #[error(transparent)]
    Chain(ChainError),
}

/// A request that failed parsing: where to put the error status, if
/// anywhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Malformed {
    /// Head descriptor index.
    pub head: u16,
    /// The status byte, if the chain has one.
    pub status: Option<GuestAddress>,
    /// What is wrong.
    pub error: ParseError,
}

fn in_memory(mem: &GuestMemoryMmap, addr: GuestAddress, len: u32) -> bool {
    GuestMemoryBackend::check_range(mem, addr, len as usize)
}

/// Removes the first `n` bytes from `segs`, copying them into `out`.
fn take_front(
    mem: &GuestMemoryMmap,
    segs: &mut Vec<Segment>,
    out: &mut [u8],
) -> Result<(), ParseError> {
    let mut done = 0;
    let mut used = 0;
    while done < out.len() {
        let s = segs.get_mut(used).ok_or(ParseError::ShortHeader)?;
        let k = (s.len as usize).min(out.len() - done);
        mem.read_slice(&mut out[done..done + k], s.addr)
            .map_err(|_| ParseError::OutOfMemory)?;
        done += k;
        // In memory (checked), so addr + k does not overflow.
        s.addr = GuestAddress(s.addr.0 + k as u64);
        s.len -= k as u32;
        if s.len == 0 {
            used += 1;
        }
    }
    segs.drain(..used);
    Ok(())
}

fn total(segs: &[Segment]) -> u64 {
    segs.iter().map(|s| u64::from(s.len)).sum()
}

/// Parses the chain at `head` of the descriptor table at `table` (of
/// `queue_size` entries) into a [`Request`].
pub fn parse(
    mem: &GuestMemoryMmap,
    table: GuestAddress,
    queue_size: u16,
    head: u16,
) -> Result<Request, Malformed> {
    let walked = chain::walk(mem, table, queue_size, head, MAX_DESCRIPTORS);
    let mut error = walked.error.map(ParseError::Chain);
    if walked.dropped > 0 {
        error.get_or_insert(ParseError::TooManyDescriptors);
    }
    if walked.readable_after_writable {
        error.get_or_insert(ParseError::ReadableAfterWritable);
    }
    let mut readable = Vec::new();
    let mut writable = Vec::new();
    for d in &walked.descs {
        let seg = Segment {
            addr: d.addr,
            len: d.len,
        };
        if !in_memory(mem, seg.addr, seg.len) {
            error.get_or_insert(ParseError::OutOfMemory);
        }
        if d.write {
            writable.push(seg);
        } else {
            readable.push(seg);
        }
    }
    let last_writable = walked
        .last_writable
        .filter(|_| walked.error.is_none_or(ChainError::status_known));
    // The status is the last writable byte.
    let status = last_writable.and_then(|s| {
        let a = s.addr.0.checked_add(u64::from(s.len).checked_sub(1)?)?;
        in_memory(mem, GuestAddress(a), 1).then_some(GuestAddress(a))
    });
    let Some(status) = status else {
        return Err(Malformed {
            head,
            status: None,
            error: ParseError::NoStatus,
        });
    };
    let fail = |error| Malformed {
        head,
        status: Some(status),
        error,
    };
    if let Some(e) = error {
        return Err(fail(e));
    }
    // Drop the status byte from the writable side.
    if let Some(last) = writable.last_mut() {
        last.len -= 1;
        if last.len == 0 {
            writable.pop();
        }
    }
    let mut hdr = [0u8; HEADER_LEN];
    take_front(mem, &mut readable, &mut hdr).map_err(fail)?;
    let kind = RequestType::from_u32(u32::from_le_bytes(hdr[0..4].try_into().unwrap()));
    let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap());

    let (data, unit) = match kind {
        RequestType::In => {
            if !readable.is_empty() {
                return Err(fail(ParseError::WrongDirection));
            }
            (writable, 512)
        }
        RequestType::GetId => {
            if !readable.is_empty() {
                return Err(fail(ParseError::WrongDirection));
            }
            (writable, 1)
        }
        RequestType::Out => {
            if !writable.is_empty() {
                return Err(fail(ParseError::WrongDirection));
            }
            (readable, 512)
        }
        RequestType::Discard | RequestType::WriteZeroes => {
            if !writable.is_empty() {
                return Err(fail(ParseError::WrongDirection));
            }
            if readable.is_empty() {
                return Err(fail(ParseError::BadLength));
            }
            (readable, RANGE_LEN)
        }
        RequestType::Flush => {
            if !readable.is_empty() || !writable.is_empty() {
                return Err(fail(ParseError::WrongDirection));
            }
            (Vec::new(), 1)
        }
        RequestType::Unsupported(_) => (Vec::new(), 1),
    };
    let data_len = total(&data);
    if !data_len.is_multiple_of(unit) {
        return Err(fail(ParseError::BadLength));
    }
    Ok(Request {
        head,
        kind,
        sector,
        data,
        data_len,
        status,
    })
}
