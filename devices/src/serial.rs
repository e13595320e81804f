//! The 8250/16550 serial port (COM1) on vm-superio, with its interrupt
//! delivered through an irqfd.

use std::sync::Arc;

use vm_superio::{Serial, Trigger, serial::NoEvents};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;
use crate::console::{ConsoleLog, ConsoleOut};

/// Raises a guest interrupt by writing an eventfd registered as an irqfd.
#[derive(Debug)]
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// COM1, a range of 8 ports.
pub struct SerialDevice {
    serial: Serial<IrqTrigger, NoEvents, ConsoleOut>,
    dropped_input: u64,
}

impl std::fmt::Debug for SerialDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SerialDevice").finish_non_exhaustive()
    }
}

impl SerialDevice {
    /// A serial port whose output goes to `out_fd` (if any) and `log`.
    pub fn new(irq: EventFd, out_fd: Option<std::os::fd::OwnedFd>, log: Arc<ConsoleLog>) -> Self {
        Self {
            serial: Serial::new(IrqTrigger(irq), ConsoleOut::new(out_fd, log)),
            dropped_input: 0,
        }
    }

    /// Feeds host input to the guest; bytes beyond the FIFO's room are
    /// dropped and counted (a guest that does not read its console must not
    /// make the host buffer without bound). Returns bytes accepted.
    pub fn enqueue_input(&mut self, data: &[u8]) -> usize {
        let room = self.serial.fifo_capacity();
        let take = room.min(data.len());
        let n = self.serial.enqueue_raw_bytes(&data[..take]).unwrap_or(0);
        self.dropped_input += (data.len() - n) as u64;
        n
    }

    /// Input bytes dropped because the guest's receive FIFO was full.
    pub fn dropped_input(&self) -> u64 {
        self.dropped_input
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match (u8::try_from(offset), data.len()) {
            (Ok(off), 1) if off < 8 => data[0] = self.serial.read(off),
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(off), [value]) = (u8::try_from(offset), data)
            && off < 8
        {
            // An output error (host fd closed) is not the guest's problem.
            let _ = self.serial.write(off, *value);
        }
    }

    /// A `rep outsb` to the port: each byte goes through the UART model as
    /// one write would (divisor latch, loopback, interrupts), but what it
    /// transmits reaches the host fd and the log in one write at the end,
    /// not one syscall per byte.
    fn write_burst(&mut self, offset: u64, data: &[u8], size: usize) {
        self.serial.writer_mut().hold();
        for elem in data.chunks_exact(size) {
            self.write(offset, elem);
        }
        self.serial.writer_mut().release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_reaches_log_and_irq() {
        let log = ConsoleLog::new(1024);
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut s = SerialDevice::new(irq.try_clone().unwrap(), None, log.clone());
        for b in b"hi\n" {
            s.write(0, &[*b]);
        }
        assert_eq!(log.tail(16), b"hi\n");
        // Enable the receive-data interrupt, then feed input.
        s.write(1, &[0x01]);
        assert_eq!(s.enqueue_input(b"x"), 1);
        assert!(irq.read().unwrap() >= 1);
        let mut b = [0u8];
        s.read(0, &mut b);
        assert_eq!(b, [b'x']);
        // Bad sizes are ignored.
        s.write(0, &[1, 2]);
        let mut two = [0u8; 2];
        s.read(0, &mut two);
        assert_eq!(two, [0xff, 0xff]);
    }

    /// `rep outsb` to THR: all bytes in order, in one append to the log
    /// (one write to the host fd); with the divisor latch open the same
    /// burst sets the divisor and transmits nothing, as byte writes would.
    #[test]
    fn a_string_burst_is_one_output_write() {
        let log = ConsoleLog::new(1024);
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut fds = [0; 2];
        // SAFETY: pipe writes two new descriptors into the array we own.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both are fresh descriptors that nothing else owns.
        let (r, w) = unsafe {
            use std::os::fd::FromRawFd;
            (
                std::fs::File::from_raw_fd(fds[0]),
                std::os::fd::OwnedFd::from_raw_fd(fds[1]),
            )
        };
        let mut s = SerialDevice::new(irq, Some(w), log.clone());
        s.write_burst(0, b"PROBE-UP\n", 1);
        assert_eq!(log.tail(64), b"PROBE-UP\n");
        let mut got = [0u8; 64];
        let n = std::io::Read::read(&mut &r, &mut got).unwrap();
        assert_eq!(&got[..n], b"PROBE-UP\n", "one read gets the whole line");
        s.write(3, &[0x80]); // LCR.DLAB
        s.write_burst(0, b"ab", 1);
        s.write(3, &[0x03]);
        assert_eq!(log.total(), 9, "divisor writes are not output");
    }
}
