//! A minimal i8042 keyboard controller: enough for the guest to reset the
//! machine (command 0xFE on port 0x64), which corral treats as a clean stop.

use crate::bus::BusDevice;

/// Command that pulses the CPU reset line.
pub const CMD_RESET_CPU: u8 = 0xfe;

/// The i8042 at ports 0x60 (data) and 0x64 (status/command), registered as a
/// range of 5 ports starting at 0x60.
pub struct I8042 {
    on_reset: Box<dyn FnMut() + Send>,
    resets: u64,
}

impl std::fmt::Debug for I8042 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("I8042")
            .field("resets", &self.resets)
            .finish()
    }
}

impl I8042 {
    /// A controller that calls `on_reset` when the guest asks for a reset.
    pub fn new(on_reset: Box<dyn FnMut() + Send>) -> Self {
        Self {
            on_reset,
            resets: 0,
        }
    }

    /// How many resets the guest requested.
    pub fn resets(&self) -> u64 {
        self.resets
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // Status 0: output buffer empty, input buffer empty, no data.
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == 4 && data.first() == Some(&CMD_RESET_CPU) {
            self.resets += 1;
            (self.on_reset)();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn reset_only_on_fe_to_0x64() {
        let n = Arc::new(AtomicU32::new(0));
        let n2 = n.clone();
        let mut d = I8042::new(Box::new(move || {
            n2.fetch_add(1, Ordering::SeqCst);
        }));
        d.write(0, &[0xfe]);
        d.write(4, &[0xaa]);
        d.write(4, &[]);
        assert_eq!(n.load(Ordering::SeqCst), 0);
        d.write(4, &[0xfe]);
        assert_eq!(n.load(Ordering::SeqCst), 1);
        let mut b = [9u8; 1];
        d.read(4, &mut b);
        assert_eq!(b, [0]);
    }
}
