//! Console output of the VM, pushed to the current daemon from the offset
//! it asked for (a daemon that re-adopts the process asks for what the
//! log still holds).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::VmProcess;
use crate::util::lock;
use crate::vmproc::proto::{CONSOLE_CHUNK, FromVm};

impl VmProcess {
    /// Pushes console output to the current daemon, from the offset it
    /// asked for; ends when the log is closed and everything is sent.
    pub(super) fn pump_console(&self) {
        let log = self.handle.console();
        loop {
            if lock(&self.link.conn).is_none() {
                // Nobody to send to: the log keeps the output for a daemon
                // that re-adopts the process.
                if log.read_from(u64::MAX, Duration::ZERO).2 {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
            let from = self.link.console_next.load(Ordering::Acquire);
            let (data, next, closed) = log.read_from(from, Duration::from_millis(250));
            let start = next - data.len() as u64;
            {
                for (i, chunk) in data.chunks(CONSOLE_CHUNK).enumerate() {
                    self.link.send(&FromVm::Console {
                        offset: start + (i * CONSOLE_CHUNK) as u64,
                        data: chunk.to_vec(),
                    });
                }
                // Only if no daemon asked for another offset meanwhile.
                let _ = self.link.console_next.compare_exchange(
                    from,
                    next,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
            if closed && data.is_empty() {
                return;
            }
        }
    }
}
