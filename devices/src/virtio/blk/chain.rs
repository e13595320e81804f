//! Walking a descriptor chain (split ring, §2.7.5) with every fault seen.
//!
//! `virtio-queue`'s own `DescriptorChain` iterator ends a chain silently
//! where it cannot go on: a `next` loop stops after queue-size descriptors,
//! a chain longer than 4 GiB, a `next` beyond the table, an unreadable
//! descriptor or a nested indirect table all look like a normal end. A
//! request then looks well formed (a loop in an indirect table was served as
//! a good read) or loses its status byte (a 4 GiB data descriptor got no
//! used entry). This walker reads the same table but reports why it
//! stopped, and keeps the last device-writable buffer it saw so that a
//! faulty chain can still be answered `VIRTIO_BLK_S_IOERR`.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;
/// Size of one descriptor.
const DESC_LEN: u64 = 16;

/// One descriptor's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    /// Guest address.
    pub addr: GuestAddress,
    /// Length.
    pub len: u32,
    /// Device-writable.
    pub write: bool,
}

/// Why a chain is broken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// `next` fields form a loop (more descriptors than the table holds).
    #[error("descriptor chain loops")]
    Loop,
    /// A `next` index beyond the table.
    #[error("descriptor index out of the table")]
    BadIndex,
    /// A descriptor (or the indirect table) outside guest memory.
    #[error("descriptor table outside guest memory")]
    Unreadable,
    /// An indirect descriptor inside an indirect table, or with `NEXT` set.
    #[error("nested or chained indirect descriptor")]
    BadIndirect,
    /// An indirect table whose length is 0 or not a multiple of 16.
    #[error("bad indirect table length")]
    BadIndirectLen,
    /// The buffers add up to more than 4 GiB (§2.7.5.2).
    #[error("descriptor chain longer than 4 GiB")]
    TooLong,
}

impl ChainError {
    /// Whether the walk saw the whole chain, so that its last writable
    /// buffer is the status byte: a loop was walked once round (up to the
    /// first descriptor seen twice), an over-long chain to its end. A chain
    /// cut off by a bad index, an unreadable or malformed indirect table
    /// has its status somewhere the device cannot see.
    pub fn status_known(self) -> bool {
        matches!(self, Self::Loop | Self::TooLong)
    }
}

/// Descriptors of one table already visited (a bit each).
struct Seen {
    small: [u64; 16],
    big: Vec<u64>,
}

impl Seen {
    fn new() -> Self {
        Self {
            small: [0; 16],
            big: Vec::new(),
        }
    }

    /// Forgets everything; tables up to 1024 entries need no allocation.
    fn reset(&mut self, size: u16) {
        self.small = [0; 16];
        self.big.clear();
        if size > 1024 {
            self.big.resize(usize::from(size).div_ceil(64), 0);
        }
    }

    /// Marks `i`; false if it was marked already.
    fn mark(&mut self, i: u16) -> bool {
        let words: &mut [u64] = if self.big.is_empty() {
            &mut self.small
        } else {
            &mut self.big
        };
        let (w, b) = (usize::from(i / 64), 1u64 << (i % 64));
        match words.get_mut(w) {
            Some(x) if *x & b == 0 => {
                *x |= b;
                true
            }
            _ => false,
        }
    }
}

/// A chain as walked: the buffers up to the first fault, and the fault.
#[derive(Debug, Default)]
pub struct Walked {
    /// Non-empty buffers in chain order (at most `cap`).
    pub descs: Vec<Desc>,
    /// Buffers seen beyond `cap` (not kept).
    pub dropped: usize,
    /// The last device-writable buffer seen (kept even beyond `cap`).
    pub last_writable: Option<Desc>,
    /// Whether a device-readable buffer followed a writable one.
    pub readable_after_writable: bool,
    /// The first fault, if any; the walk stopped there (or, for
    /// [`ChainError::TooLong`], went on only to find the status byte).
    pub error: Option<ChainError>,
}

fn read_desc(mem: &GuestMemoryMmap, table: GuestAddress, i: u16) -> Option<(u64, u32, u16, u16)> {
    let at = table.0.checked_add(u64::from(i) * DESC_LEN)?;
    let mut raw = [0u8; DESC_LEN as usize];
    mem.read_slice(&mut raw, GuestAddress(at)).ok()?;
    let (a, rest) = raw.split_at(8);
    let (l, rest) = rest.split_at(4);
    let (f, n) = rest.split_at(2);
    Some((
        u64::from_le_bytes(a.try_into().ok()?),
        u32::from_le_bytes(l.try_into().ok()?),
        u16::from_le_bytes(f.try_into().ok()?),
        u16::from_le_bytes(n.try_into().ok()?),
    ))
}

/// Walks the chain starting at `head` in the table at `table` of
/// `queue_size` entries, keeping at most `cap` buffers.
pub fn walk(
    mem: &GuestMemoryMmap,
    table: GuestAddress,
    queue_size: u16,
    head: u16,
    cap: usize,
) -> Walked {
    let mut w = Walked::default();
    let mut table = table;
    let mut size = queue_size;
    let mut index = head;
    let mut indirect = false;
    // A chain visits each descriptor of a table at most once.
    let mut seen = Seen::new();
    seen.reset(size);
    let mut total: u64 = 0;
    loop {
        if index >= size {
            w.error.get_or_insert(ChainError::BadIndex);
            return w;
        }
        if !seen.mark(index) {
            w.error.get_or_insert(ChainError::Loop);
            return w;
        }
        let Some((addr, len, flags, next)) = read_desc(mem, table, index) else {
            w.error.get_or_insert(ChainError::Unreadable);
            return w;
        };
        if flags & F_INDIRECT != 0 {
            // §2.7.5.3.1: not inside an indirect table, not with NEXT.
            if indirect || flags & F_NEXT != 0 {
                w.error.get_or_insert(ChainError::BadIndirect);
                return w;
            }
            if len == 0 || u64::from(len) % DESC_LEN != 0 || u64::from(len) / DESC_LEN > 65535 {
                w.error.get_or_insert(ChainError::BadIndirectLen);
                return w;
            }
            table = GuestAddress(addr);
            size = (u64::from(len) / DESC_LEN) as u16;
            index = 0;
            indirect = true;
            seen.reset(size);
            continue;
        }
        total += u64::from(len);
        if total > u64::from(u32::MAX) {
            w.error.get_or_insert(ChainError::TooLong);
        }
        if len > 0 {
            let d = Desc {
                addr: GuestAddress(addr),
                len,
                write: flags & F_WRITE != 0,
            };
            if d.write {
                w.last_writable = Some(d);
            } else if w.last_writable.is_some() {
                w.readable_after_writable = true;
            }
            if w.descs.len() < cap {
                w.descs.push(d);
            } else {
                w.dropped += 1;
            }
        }
        if flags & F_NEXT == 0 {
            return w;
        }
        index = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap()
    }

    fn put(m: &GuestMemoryMmap, table: u64, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let b = table + 16 * u64::from(i);
        m.write_obj(addr, GuestAddress(b)).unwrap();
        m.write_obj(len, GuestAddress(b + 8)).unwrap();
        m.write_obj(flags, GuestAddress(b + 12)).unwrap();
        m.write_obj(next, GuestAddress(b + 14)).unwrap();
    }

    #[test]
    fn plain_chain() {
        let m = mem();
        put(&m, 0, 0, 0x1000, 16, F_NEXT, 1);
        put(&m, 0, 1, 0x2000, 512, F_NEXT | F_WRITE, 2);
        put(&m, 0, 2, 0x3000, 1, F_WRITE, 0);
        let w = walk(&m, GuestAddress(0), 8, 0, 16);
        assert_eq!(w.error, None);
        assert_eq!(w.descs.len(), 3);
        assert_eq!(w.last_writable.unwrap().addr, GuestAddress(0x3000));
    }

    #[test]
    fn loop_in_indirect_table_is_an_error() {
        let m = mem();
        put(&m, 0, 0, 0x800, 48, F_INDIRECT, 0);
        put(&m, 0x800, 0, 0x1000, 16, F_NEXT, 1);
        put(&m, 0x800, 1, 0x2000, 512, F_NEXT | F_WRITE, 2);
        put(&m, 0x800, 2, 0x3000, 1, F_WRITE | F_NEXT, 0);
        let w = walk(&m, GuestAddress(0), 8, 0, 1026);
        assert_eq!(w.error, Some(ChainError::Loop));
        // Walked once round: the status is the last writable buffer.
        assert_eq!(w.descs.len(), 3);
        assert_eq!(w.last_writable.unwrap().addr, GuestAddress(0x3000));
        // A loop back into the middle of a big table.
        put(&m, 0, 0, 0x800, 16 * 2000, F_INDIRECT, 0);
        for i in 0..1999 {
            put(&m, 0x800, i, 0x1000, 16, F_NEXT, i + 1);
        }
        put(&m, 0x800, 1999, 0x3000, 1, F_WRITE | F_NEXT, 1500);
        let w = walk(&m, GuestAddress(0), 8, 0, 4000);
        assert_eq!(w.error, Some(ChainError::Loop));
        assert_eq!(w.descs.len(), 2000);
    }

    #[test]
    fn four_gib_is_too_long_but_keeps_the_status() {
        let m = mem();
        put(&m, 0, 0, 0x1000, 16, F_NEXT, 1);
        put(&m, 0, 1, 0x2000, u32::MAX, F_NEXT | F_WRITE, 2);
        put(&m, 0, 2, 0x3000, 1, F_WRITE, 0);
        let w = walk(&m, GuestAddress(0), 8, 0, 16);
        assert_eq!(w.error, Some(ChainError::TooLong));
        assert_eq!(w.last_writable.unwrap().addr, GuestAddress(0x3000));
    }

    #[test]
    fn other_faults() {
        let m = mem();
        put(&m, 0, 0, 0x1000, 16, F_NEXT, 9);
        assert_eq!(
            walk(&m, GuestAddress(0), 8, 0, 16).error,
            Some(ChainError::BadIndex)
        );
        put(&m, 0, 0, 0x800, 48, F_INDIRECT | F_NEXT, 1);
        assert_eq!(
            walk(&m, GuestAddress(0), 8, 0, 16).error,
            Some(ChainError::BadIndirect)
        );
        put(&m, 0, 0, 0x800, 20, F_INDIRECT, 0);
        assert_eq!(
            walk(&m, GuestAddress(0), 8, 0, 16).error,
            Some(ChainError::BadIndirectLen)
        );
        put(&m, 0, 0, 0xfff0_0000, 48, F_INDIRECT, 0);
        assert_eq!(
            walk(&m, GuestAddress(0), 8, 0, 16).error,
            Some(ChainError::Unreadable)
        );
        put(&m, 0, 0, 0x800, 16, F_INDIRECT, 0);
        put(&m, 0x800, 0, 0x900, 16, F_INDIRECT, 0);
        assert_eq!(
            walk(&m, GuestAddress(0), 8, 0, 16).error,
            Some(ChainError::BadIndirect)
        );
        assert_eq!(
            walk(&m, GuestAddress(0), 8, 8, 16).error,
            Some(ChainError::BadIndex)
        );
    }
}
