//! The sleep control and sleep status registers of a hardware-reduced ACPI
//! platform (ACPI 6.5, 4.8.3.7 and 4.8.3.8), so that the guest can power
//! itself off through S5, which corral treats as a clean stop (like the
//! i8042 reset).
//!
//! Two one-byte I/O ports, registered as a range of [`PORT_LEN`] ports at
//! [`PORT_BASE`] (0x600):
//!
//! | port  | register        | FADT field          |
//! |-------|-----------------|---------------------|
//! | 0x600 | sleep control   | `SLEEP_CONTROL_REG` |
//! | 0x601 | sleep status    | `SLEEP_STATUS_REG`  |
//!
//! Why 0x600 and not 0x3c0 (Cloud Hypervisor's choice): 0x3c0..0x3df is the
//! VGA register block, and Linux's VGA console code writes the attribute
//! controller at 0x3c0 (`VGA_ATT_W`); a stray `0x34` there would power the
//! VM off. 0x600 is free in corral's port map (PIC 0x20/0xa0, PIT 0x40-0x43,
//! i8042 0x60-0x64 with 0x61, CMOS 0x70/0x71 unclaimed, COM1 0x3f8-0x3ff,
//! PCI config 0xcf8-0xcff unclaimed) and is where QEMU's q35 puts its ACPI
//! PM block, so guests do not probe it as something else.
//!
//! | 0x602 | GED event       | the DSDT's `GED0` `_EVT` reads it |
//!
//! The third port is the event register of the platform's Generic Event
//! Device (ACPI 6.5, 5.6.9, `ACPI0013`): the host presses the power button
//! with [`AcpiPm::press_power_button`], which latches [`EVENT_POWER_BUTTON`]
//! and raises the GED's interrupt; the guest's `_EVT` method reads the
//! register (reading clears it) and notifies the power button device
//! (`PNP0C0C`, `Notify(PWRB, 0x80)`), which a Linux guest turns into
//! KEY_POWER (and systemd into a clean power-off). A guest without ACPI may
//! poll the register itself (the probe's `probe.pwrbtn=1` does).
//!
//! Sleep control (write): bits 2..4 `SLP_TYPx`, bit 5 `SLP_EN`. A write with
//! `SLP_EN` set and `SLP_TYPx == SLP_TYP_S5` (the value of the DSDT's `_S5_`
//! package) calls the shutdown callback. Other sleep types are ignored (corral
//! advertises no S1-S4) and counted. Sleep status: `WAK_STS` (bit 7) always
//! reads 0; writes (the guest clears `WAK_STS` before sleeping) are ignored.

use crate::bus::BusDevice;

/// First port of the device.
pub const PORT_BASE: u16 = 0x600;
/// Number of ports.
pub const PORT_LEN: u16 = 3;
/// Offset of the sleep control register.
pub const SLEEP_CONTROL_OFFSET: u64 = 0;
/// Offset of the sleep status register.
pub const SLEEP_STATUS_OFFSET: u64 = 1;
/// Offset of the GED event register (read to clear).
pub const GED_EVENT_OFFSET: u64 = 2;
/// GED event bit: the power button was pressed.
pub const EVENT_POWER_BUTTON: u8 = 1;
/// The `SLP_TYPx` value of S5 (soft off); the DSDT's `_S5_` package must
/// carry the same value.
pub const SLP_TYP_S5: u8 = 5;
/// `SLP_EN` bit of the sleep control register.
pub const SLP_EN: u8 = 1 << 5;
const SLP_TYP_SHIFT: u8 = 2;
const SLP_TYP_MASK: u8 = 0x7;

/// The hardware-reduced ACPI sleep registers.
pub struct AcpiPm {
    on_shutdown: Box<dyn FnMut() + Send>,
    /// Raises the GED's interrupt (an irqfd write in the VMM).
    on_event: Box<dyn FnMut() + Send>,
    /// Latched GED events, cleared when the guest reads them.
    events: u8,
    presses: u64,
    shutdowns: u64,
    ignored_writes: u64,
    log: crate::GuestLog,
}

impl std::fmt::Debug for AcpiPm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcpiPm")
            .field("shutdowns", &self.shutdowns)
            .field("ignored_writes", &self.ignored_writes)
            .finish()
    }
}

impl AcpiPm {
    /// A device that calls `on_shutdown` when the guest enters S5.
    pub fn new(on_shutdown: Box<dyn FnMut() + Send>) -> Self {
        Self::with_events(on_shutdown, Box::new(|| {}))
    }

    /// A device that also raises the GED interrupt through `on_event`.
    pub fn with_events(
        on_shutdown: Box<dyn FnMut() + Send>,
        on_event: Box<dyn FnMut() + Send>,
    ) -> Self {
        Self {
            on_shutdown,
            on_event,
            events: 0,
            presses: 0,
            shutdowns: 0,
            ignored_writes: 0,
            log: crate::GuestLog::new("acpi-pm"),
        }
    }

    /// Presses the power button: latches the event and raises the GED
    /// interrupt. The guest decides what to do (a clean power-off through
    /// S5, or nothing).
    pub fn press_power_button(&mut self) {
        self.events |= EVENT_POWER_BUTTON;
        self.presses += 1;
        (self.on_event)();
    }

    /// Power-button presses so far.
    pub fn presses(&self) -> u64 {
        self.presses
    }

    /// How many times the guest asked for S5.
    pub fn shutdowns(&self) -> u64 {
        self.shutdowns
    }

    /// Writes that did nothing: other sleep types, bad sizes or offsets.
    pub fn ignored_writes(&self) -> u64 {
        self.ignored_writes
    }
}

impl BusDevice for AcpiPm {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        // Control: SLP_EN reads as 0. Status: no wake event pending.
        data.fill(0);
        if let (GED_EVENT_OFFSET, [v]) = (offset, &mut *data) {
            *v = std::mem::take(&mut self.events);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match (offset, data) {
            (SLEEP_CONTROL_OFFSET, [v]) => {
                let typ = (v >> SLP_TYP_SHIFT) & SLP_TYP_MASK;
                if v & SLP_EN != 0 && typ == SLP_TYP_S5 {
                    self.shutdowns += 1;
                    (self.on_shutdown)();
                } else if v & SLP_EN != 0 {
                    self.log.report(
                        crate::GuestErrorKind::BadRegister,
                        format_args!("ACPI sleep type {typ} requested; only S5 is supported"),
                    );
                    self.ignored_writes += 1;
                }
                // SLP_EN clear: the guest only prepares the value; nothing to do.
            }
            // Clearing WAK_STS (write 1 to bit 7): nothing is latched.
            (SLEEP_STATUS_OFFSET, [_]) => {}
            // The event register is read-only (read to clear).
            _ => self.ignored_writes += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn dev() -> (AcpiPm, Arc<AtomicU32>) {
        let n = Arc::new(AtomicU32::new(0));
        let n2 = n.clone();
        let d = AcpiPm::new(Box::new(move || {
            n2.fetch_add(1, Ordering::SeqCst);
        }));
        (d, n)
    }

    #[test]
    fn power_button_latches_until_read_and_raises_the_interrupt() {
        let raised = Arc::new(AtomicU32::new(0));
        let r = raised.clone();
        let mut d = AcpiPm::with_events(
            Box::new(|| {}),
            Box::new(move || {
                r.fetch_add(1, Ordering::SeqCst);
            }),
        );
        let mut b = [0xffu8];
        d.read(GED_EVENT_OFFSET, &mut b);
        assert_eq!(b, [0], "nothing pending");
        d.press_power_button();
        assert_eq!(raised.load(Ordering::SeqCst), 1);
        d.read(GED_EVENT_OFFSET, &mut b);
        assert_eq!(b, [EVENT_POWER_BUTTON]);
        d.read(GED_EVENT_OFFSET, &mut b);
        assert_eq!(b, [0], "reading cleared it");
        // Wider reads and writes do not touch the latch.
        d.press_power_button();
        let mut w = [0xffu8; 2];
        d.read(GED_EVENT_OFFSET, &mut w);
        assert_eq!(w, [0, 0]);
        d.write(GED_EVENT_OFFSET, &[0]);
        assert_eq!(d.ignored_writes(), 1);
        d.read(GED_EVENT_OFFSET, &mut b);
        assert_eq!(b, [EVENT_POWER_BUTTON]);
        assert_eq!(d.presses(), 2);
    }

    #[test]
    fn s5_powers_off() {
        let (mut d, n) = dev();
        // What ACPICA's acpi_hw_extended_sleep writes: WAK_STS to status,
        // then (SLP_TYP << 2) | SLP_EN to control.
        d.write(SLEEP_STATUS_OFFSET, &[0x80]);
        assert_eq!(n.load(Ordering::SeqCst), 0);
        d.write(SLEEP_CONTROL_OFFSET, &[(SLP_TYP_S5 << 2) | SLP_EN]);
        assert_eq!(n.load(Ordering::SeqCst), 1);
        assert_eq!(d.shutdowns(), 1);
        assert_eq!(0x34, (SLP_TYP_S5 << 2) | SLP_EN);
    }

    #[test]
    fn other_writes_ignored() {
        let (mut d, n) = dev();
        // S5 type without SLP_EN: preparation only.
        d.write(SLEEP_CONTROL_OFFSET, &[SLP_TYP_S5 << 2]);
        // SLP_EN with other sleep types (S0, S3).
        d.write(SLEEP_CONTROL_OFFSET, &[SLP_EN]);
        d.write(SLEEP_CONTROL_OFFSET, &[(3 << 2) | SLP_EN]);
        // Wrong width or offset.
        d.write(SLEEP_CONTROL_OFFSET, &[0x34, 0]);
        d.write(SLEEP_CONTROL_OFFSET, &[]);
        d.write(SLEEP_STATUS_OFFSET, &[0x34]);
        d.write(7, &[0x34]);
        assert_eq!(n.load(Ordering::SeqCst), 0);
        assert_eq!(d.shutdowns(), 0);
        assert_eq!(d.ignored_writes(), 5);
        let mut b = [0xaau8; 1];
        d.read(SLEEP_STATUS_OFFSET, &mut b);
        assert_eq!(b, [0]);
        d.read(SLEEP_CONTROL_OFFSET, &mut b);
        assert_eq!(b, [0]);
    }

    #[test]
    fn through_the_bus() {
        use crate::bus::Bus;
        use std::sync::Mutex;
        let (d, n) = dev();
        let mut bus = Bus::new();
        bus.insert(
            u64::from(PORT_BASE),
            u64::from(PORT_LEN),
            Arc::new(Mutex::new(d)),
        )
        .unwrap();
        assert!(bus.write(u64::from(PORT_BASE) + 1, &[0x80]));
        assert!(bus.write(u64::from(PORT_BASE), &[0x34]));
        assert_eq!(n.load(Ordering::SeqCst), 1);
        assert!(!bus.write(u64::from(PORT_BASE + PORT_LEN), &[0x34]));
    }
}
