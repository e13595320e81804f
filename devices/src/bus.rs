//! Address-range dispatch for port I/O and MMIO exits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A device reachable through port I/O or MMIO.
pub trait BusDevice: Send {
    /// The guest reads `data.len()` bytes at `offset` from the device's base.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// The guest writes `data` at `offset` from the device's base.
    fn write(&mut self, offset: u64, data: &[u8]);
    /// String I/O (`rep outsb`): the guest writes `data`, elements of `size`
    /// bytes, one after the other at `offset`, in one VM exit. By default
    /// one [`Self::write`] each; a device may do the whole burst at once.
    fn write_burst(&mut self, offset: u64, data: &[u8], size: usize) {
        for elem in data.chunks_exact(size) {
            self.write(offset, elem);
        }
    }
}

/// Errors of bus construction.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    /// The new range is empty or wraps around.
    #[error("invalid bus range {base:#x}+{len:#x}")]
    InvalidRange {
        /// Base address.
        base: u64,
        /// Length.
        len: u64,
    },
    /// The new range overlaps a registered one.
    #[error("bus range {base:#x}+{len:#x} overlaps an existing device")]
    Overlap {
        /// Base address.
        base: u64,
        /// Length.
        len: u64,
    },
}

/// Counters of accesses no device claimed.
#[derive(Debug, Default)]
pub struct BusStats {
    /// Reads of unclaimed addresses.
    pub unknown_reads: AtomicU64,
    /// Writes to unclaimed addresses.
    pub unknown_writes: AtomicU64,
}

struct Entry {
    base: u64,
    len: u64,
    dev: Arc<Mutex<dyn BusDevice>>,
}

/// A set of non-overlapping address ranges, each served by one device.
///
/// Unclaimed reads return all ones (a floating bus) and unclaimed writes are
/// dropped; both are counted.
#[derive(Default)]
pub struct Bus {
    entries: Vec<Entry>,
    stats: Arc<BusStats>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranges: Vec<(u64, u64)> = self.entries.iter().map(|e| (e.base, e.len)).collect();
        f.debug_struct("Bus").field("ranges", &ranges).finish()
    }
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `dev` at `[base, base + len)`.
    pub fn insert(
        &mut self,
        base: u64,
        len: u64,
        dev: Arc<Mutex<dyn BusDevice>>,
    ) -> Result<(), BusError> {
        let end = base
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or(BusError::InvalidRange { base, len })?;
        if self
            .entries
            .iter()
            .any(|e| base < e.base + e.len && e.base < end)
        {
            return Err(BusError::Overlap { base, len });
        }
        let pos = self.entries.partition_point(|e| e.base < base);
        self.entries.insert(pos, Entry { base, len, dev });
        Ok(())
    }

    /// Counters of unclaimed accesses.
    pub fn stats(&self) -> Arc<BusStats> {
        self.stats.clone()
    }

    fn find(&self, addr: u64, size: usize) -> Option<(&Entry, u64)> {
        let idx = self.entries.partition_point(|e| e.base <= addr);
        let e = self.entries.get(idx.checked_sub(1)?)?;
        let off = addr - e.base;
        // The whole access must be inside the device's range.
        let end = off.checked_add(size as u64)?;
        (end <= e.len).then_some((e, off))
    }

    /// Dispatches a read; returns whether a device claimed it.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((e, off)) => {
                lock(&e.dev).read(off, data);
                true
            }
            None => {
                data.fill(0xff);
                self.stats.unknown_reads.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Dispatches a port-I/O read of `data.len() / size` elements of `size`
    /// bytes, all from the same port (string I/O, `rep insb`: a
    /// `KVM_EXIT_IO` with `count > 1`); each element is its own device
    /// access. A `size` other than 1, 2 or 4, or data that is not a whole
    /// number of elements, is not claimed (reads as all ones).
    pub fn read_elems(&self, addr: u64, data: &mut [u8], size: usize) -> bool {
        let whole = matches!(size, 1 | 2 | 4) && data.len().is_multiple_of(size);
        match self.find(addr, size).filter(|_| whole) {
            Some((e, off)) => {
                let mut dev = lock(&e.dev);
                for elem in data.chunks_exact_mut(size) {
                    dev.read(off, elem);
                }
                true
            }
            None => {
                data.fill(0xff);
                self.stats.unknown_reads.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Dispatches a port-I/O write of `data.len() / size` elements of
    /// `size` bytes to the same port (`rep outsb`); see [`Bus::read_elems`].
    pub fn write_elems(&self, addr: u64, data: &[u8], size: usize) -> bool {
        let whole = matches!(size, 1 | 2 | 4) && data.len().is_multiple_of(size);
        match self.find(addr, size).filter(|_| whole) {
            Some((e, off)) => {
                lock(&e.dev).write_burst(off, data, size);
                true
            }
            None => {
                self.stats.unknown_writes.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Dispatches a write; returns whether a device claimed it.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((e, off)) => {
                lock(&e.dev).write(off, data);
                true
            }
            None => {
                self.stats.unknown_writes.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }
}

/// Locks a device, recovering from a poisoned lock (a panicking device
/// thread must not take the vCPUs down with it).
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Mem(Vec<u8>);
    impl BusDevice for Mem {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            for (i, b) in data.iter_mut().enumerate() {
                *b = self.0[offset as usize + i];
            }
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        }
    }

    #[test]
    fn dispatch_and_unknown() {
        let mut bus = Bus::new();
        bus.insert(0x10, 8, Arc::new(Mutex::new(Mem(vec![0; 8]))))
            .unwrap();
        assert!(bus.write(0x12, &[7, 8]));
        let mut b = [0u8; 2];
        assert!(bus.read(0x12, &mut b));
        assert_eq!(b, [7, 8]);
        // Straddling the end is not claimed.
        assert!(!bus.read(0x17, &mut b));
        assert_eq!(b, [0xff, 0xff]);
        assert!(!bus.write(0x0, &[1]));
        assert!(!bus.write(u64::MAX, &[1, 2]));
        let s = bus.stats();
        assert_eq!(s.unknown_reads.load(Ordering::Relaxed), 1);
        assert_eq!(s.unknown_writes.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn string_io_is_one_access_per_element() {
        let mut bus = Bus::new();
        bus.insert(0x10, 8, Arc::new(Mutex::new(Mem(vec![0; 8]))))
            .unwrap();
        // `rep outsb` of 3 bytes to the last port: each lands there in turn.
        assert!(bus.write_elems(0x17, &[1, 2, 3], 1));
        let mut b = [0u8; 4];
        assert!(bus.read_elems(0x17, &mut b, 1));
        assert_eq!(b, [3, 3, 3, 3]);
        // Words.
        assert!(bus.write_elems(0x12, &[1, 2, 3, 4], 2));
        let mut w = [0u8; 4];
        assert!(bus.read_elems(0x12, &mut w, 2));
        assert_eq!(w, [3, 4, 3, 4]);
        // Bad element sizes and ragged data are not claimed.
        assert!(!bus.read_elems(0x10, &mut w, 3));
        assert_eq!(w, [0xff; 4]);
        assert!(!bus.write_elems(0x10, &[1, 2, 3], 2));
        assert!(!bus.write_elems(0x10, &[1, 2], 0));
        // An element straddling the end is not claimed either.
        assert!(!bus.read_elems(0x16, &mut w, 4));
    }

    #[test]
    fn overlap_refused() {
        let mut bus = Bus::new();
        let d: Arc<Mutex<dyn BusDevice>> = Arc::new(Mutex::new(Mem(vec![0; 8])));
        bus.insert(0x10, 8, d.clone()).unwrap();
        assert_eq!(
            bus.insert(0x17, 2, d.clone()),
            Err(BusError::Overlap { base: 0x17, len: 2 })
        );
        assert!(bus.insert(0x8, 8, d.clone()).is_ok());
        assert!(bus.insert(u64::MAX, 2, d.clone()).is_err());
        assert!(bus.insert(0x100, 0, d).is_err());
    }
}
