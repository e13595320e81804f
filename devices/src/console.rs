//! The guest console's output: an optional host file descriptor (stdout for
//! `corral run`) plus a bounded in-memory log that the REST API serves.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex};

/// Bounded log of console output, shared between the serial device and readers.
#[derive(Debug)]
pub struct ConsoleLog {
    inner: Mutex<LogInner>,
    cond: Condvar,
    capacity: usize,
}

#[derive(Debug, Default)]
struct LogInner {
    buf: std::collections::VecDeque<u8>,
    /// Total bytes ever written; the offset of `buf[0]` is `total - buf.len()`.
    total: u64,
    closed: bool,
    /// Readers waiting in [`ConsoleLog::read_from`]: `append` wakes them
    /// only if there are any (a futex syscall per guest byte otherwise).
    waiters: u32,
}

impl ConsoleLog {
    /// A log keeping the last `capacity` bytes.
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(LogInner::default()),
            cond: Condvar::new(),
            capacity: capacity.max(1),
        })
    }

    /// Appends bytes, dropping the oldest beyond capacity.
    pub fn append(&self, data: &[u8]) {
        let mut g = crate::bus::lock(&self.inner);
        g.total += data.len() as u64;
        let data = if data.len() > self.capacity {
            &data[data.len() - self.capacity..]
        } else {
            data
        };
        let excess = (g.buf.len() + data.len()).saturating_sub(self.capacity);
        g.buf.drain(..excess);
        g.buf.extend(data);
        let waiters = g.waiters;
        drop(g);
        if waiters > 0 {
            self.cond.notify_all();
        }
    }

    /// Marks the log finished (the VM stopped): waiters return.
    pub fn close(&self) {
        crate::bus::lock(&self.inner).closed = true;
        self.cond.notify_all();
    }

    /// The last `n` bytes (or all that are kept).
    pub fn tail(&self, n: usize) -> Vec<u8> {
        let g = crate::bus::lock(&self.inner);
        let skip = g.buf.len().saturating_sub(n);
        g.buf.iter().skip(skip).copied().collect()
    }

    /// Total bytes ever written.
    pub fn total(&self) -> u64 {
        crate::bus::lock(&self.inner).total
    }

    /// Bytes from absolute offset `from` (clamped to what is kept), and the
    /// offset after them. Waits up to `timeout` for new data if none is there.
    pub fn read_from(&self, from: u64, timeout: std::time::Duration) -> (Vec<u8>, u64, bool) {
        let mut g = crate::bus::lock(&self.inner);
        if g.total <= from && !g.closed {
            // Counted under the lock before waiting: an `append` after this
            // sees the waiter, one before it left data that ends the wait.
            g.waiters += 1;
            g = self
                .cond
                .wait_timeout(g, timeout)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            g.waiters -= 1;
        }
        let start = g.total - g.buf.len() as u64;
        let from = from.clamp(start, g.total);
        let out: Vec<u8> = g
            .buf
            .iter()
            .skip((from - start) as usize)
            .copied()
            .collect();
        (out, g.total, g.closed)
    }

    /// Whether the output so far contains `needle`.
    pub fn contains(&self, needle: &str) -> bool {
        let g = crate::bus::lock(&self.inner);
        let (a, b) = g.buf.as_slices();
        let mut v = Vec::with_capacity(a.len() + b.len());
        v.extend_from_slice(a);
        v.extend_from_slice(b);
        v.windows(needle.len().max(1))
            .any(|w| w == needle.as_bytes())
    }
}

/// Where the serial port's transmitter writes.
#[derive(Debug)]
pub struct ConsoleOut {
    fd: Option<OwnedFd>,
    log: Arc<ConsoleLog>,
    /// While `holding` (a burst of string I/O), output collects here.
    held: Vec<u8>,
    holding: bool,
}

/// Most a hold collects before it writes through (a `rep outsb` exit
/// carries at most a page).
const HOLD_MAX: usize = 4096;

impl ConsoleOut {
    /// Output to `fd` (if any) and to `log`.
    pub fn new(fd: Option<OwnedFd>, log: Arc<ConsoleLog>) -> Self {
        Self {
            fd,
            log,
            held: Vec::new(),
            holding: false,
        }
    }

    /// Collects output until [`Self::release`], which writes it at once.
    pub fn hold(&mut self) {
        self.holding = true;
    }

    /// Writes what was held, and stops holding.
    pub fn release(&mut self) {
        self.holding = false;
        self.flush_held();
    }

    fn flush_held(&mut self) {
        if !self.held.is_empty() {
            let buf = std::mem::take(&mut self.held);
            self.emit(&buf);
            // Keep the allocation for the next burst.
            self.held = buf;
            self.held.clear();
        }
    }

    fn emit(&mut self, buf: &[u8]) {
        self.log.append(buf);
        if let Some(fd) = &self.fd {
            let mut rest = buf;
            while !rest.is_empty() {
                // SAFETY: `fd` is an open descriptor we own and `rest` is a
                // valid slice for the duration of the call.
                let n = unsafe { libc::write(fd.as_raw_fd(), rest.as_ptr().cast(), rest.len()) };
                if n < 0 {
                    let e = io::Error::last_os_error();
                    if e.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    // A closed stdout must not stop the guest: drop output.
                    break;
                }
                rest = &rest[n as usize..];
            }
        }
    }
}

impl Write for ConsoleOut {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if !self.holding {
            self.emit(buf);
        } else if self.held.len() + buf.len() <= HOLD_MAX {
            self.held.extend_from_slice(buf);
        } else {
            self.flush_held();
            self.emit(buf);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_burst_reaches_the_log_at_release() {
        let log = ConsoleLog::new(64);
        let mut out = ConsoleOut::new(None, log.clone());
        out.hold();
        out.write_all(b"PROBE").unwrap();
        out.write_all(b"-UP\n").unwrap();
        assert_eq!(log.total(), 0, "held until released");
        out.release();
        assert_eq!(log.tail(64), b"PROBE-UP\n");
        out.write_all(b"x").unwrap();
        assert_eq!(log.total(), 10, "not held any more");
        // A burst larger than the hold buffer writes through, in order.
        out.hold();
        out.write_all(&[b'a'; HOLD_MAX]).unwrap();
        out.write_all(b"b").unwrap();
        out.release();
        assert_eq!(log.total(), 10 + HOLD_MAX as u64 + 1);
        assert_eq!(log.tail(2), b"ab");
    }

    #[test]
    fn a_waiting_reader_is_woken_by_append() {
        let log = ConsoleLog::new(64);
        let l2 = log.clone();
        let t = std::thread::spawn(move || l2.read_from(0, std::time::Duration::from_secs(20)));
        std::thread::sleep(std::time::Duration::from_millis(50));
        let t0 = std::time::Instant::now();
        log.append(b"hi");
        let (d, end, _) = t.join().unwrap();
        assert_eq!((d.as_slice(), end), (&b"hi"[..], 2));
        assert!(t0.elapsed() < std::time::Duration::from_secs(10));
    }

    #[test]
    fn ring_keeps_tail() {
        let log = ConsoleLog::new(4);
        log.append(b"abc");
        log.append(b"def");
        assert_eq!(log.tail(10), b"cdef");
        assert_eq!(log.total(), 6);
        let (d, end, _) = log.read_from(0, std::time::Duration::ZERO);
        assert_eq!(d, b"cdef");
        assert_eq!(end, 6);
        log.append(b"0123456789");
        assert_eq!(log.tail(2), b"89");
        assert!(log.contains("6789"));
        assert!(!log.contains("abc"));
    }
}
