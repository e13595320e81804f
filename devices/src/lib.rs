//! Emulated devices of a corral VM: the port/MMIO buses, the 8250 serial
//! console (vm-superio) and its log, the i8042 reset line, the ACPI PM block
//! (S5 power-off), the guest-error counters, and the virtio-mmio transport
//! with virtio-blk ([`virtio::blk`]: the `--disk` grammar `DiskSpec`, the
//! request path and the disk's throttle seam).
//!
//! Every access comes from a guest and is untrusted: offsets and sizes are
//! checked, unknown accesses are counted and answered like floating hardware.

pub mod acpi_pm;
pub mod bus;
pub mod console;
pub mod guest_log;
pub mod i8042;
pub mod serial;
pub mod virtio;

pub use bus::{Bus, BusDevice, BusError, BusStats};
pub use console::ConsoleLog;
pub use guest_log::{GuestErrorKind, GuestLog};
pub use i8042::I8042;
pub use serial::{IrqTrigger, SerialDevice};
