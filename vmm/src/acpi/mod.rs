//! ACPI tables, so that stock distribution kernels find every vCPU, every
//! virtio-mmio device and the serial port, and can power the VM off.
//!
//! # Why ACPI
//!
//! Distribution kernels (Debian's cloud and generic 6.1/6.12) are built
//! without `CONFIG_X86_MPPARSE` and without `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES`:
//! they ignore the MP table and `virtio_mmio.device=`, and find CPUs only in
//! the MADT and virtio-mmio devices only in the DSDT. corral writes both the
//! MP table (for `acpi=off` and minimal kernels) and these tables; the
//! command-line announcement of virtio devices stays for kernels that use it.
//!
//! # What is written
//!
//! All tables live in the legacy BIOS area `0xe0000..0x100000`, which the
//! e820 map already reserves, clear of the MP table in the EBDA (0x9fc00).
//! The RSDP is at [`RSDP_ADDR`] (0xe0000, on the 16-byte grid that kernels
//! scan) and its address also goes into `boot_params.acpi_rsdp_addr`, so a
//! kernel need not scan. The other tables follow at 16-byte boundaries:
//!
//! ```text
//! RSDP  rev 2, XSDT address only (no RSDT)
//! XSDT  -> FACP, APIC
//! FACP  FADT rev 6.5, HW_REDUCED_ACPI; X_DSDT; sleep control/status
//!       registers (system I/O 0x600/0x601, corral_devices::acpi_pm);
//!       reset register: I/O 0x64 <- 0xfe (the i8042 reset, a clean stop);
//!       IAPC_BOOT_ARCH: no VGA, no CMOS RTC, no i8042 keyboard to probe
//! APIC  MADT rev 5: PCAT_COMPAT (KVM's 8259 exists); one enabled local APIC
//!       per vCPU (APIC id = UID = index); the IOAPIC (id = vCPU count, as in
//!       the MP table, GSI base 0, 24 pins); local APIC NMI on LINT1
//! DSDT  \_S5_ = Package { 5, 0, 0, 0 }
//!       \_SB.COM1  PNP0501, IO 0x3f8/8, IRQ 4 (edge, active high)
//!       \_SB.Vnnn  LNRO0005 per virtio-mmio window (nnn = index in hex,
//!                  _UID = index): Memory32Fixed(base, size) + Interrupt
//! ```
//!
//! No FACS (hardware-reduced platforms have none), no SCI, no PM timer, no
//! GPEs, no CPU objects in the DSDT (the MADT is enough to bring CPUs up).
//!
//! # Choices
//!
//! * **Hardware-reduced ACPI.** There is no PM1 event/control block, PM timer
//!   or SCI to emulate. Linux then leaves the 8259 and the PIT alone
//!   (`acpi_reduced_hw_init`) and powers off by writing `SLP_TYP | SLP_EN` to
//!   the sleep control register, which is all corral needs. Because Linux
//!   does not use the 8259 on such platforms, it does not set up legacy ISA
//!   IRQs by itself: every device that has an interrupt (COM1 included) is
//!   declared in the DSDT with an extended Interrupt descriptor, whose trigger
//!   and polarity Linux takes as written.
//! * **No interrupt source overrides.** An ISO describes how a board wires ISA
//!   IRQs to IOAPIC pins when it differs from identity. QEMU declares IRQ0 ->
//!   GSI2 because it *installs* that route (`kvm_pc_setup_irq_routing`);
//!   corral keeps KVM's default routing, where GSI n is IOAPIC pin n and PIC
//!   pin n for n < 16, so the PIT (GSI 0) is on pin 0 and every ISA IRQ is
//!   identity-mapped with the ISA default (edge, active high) — exactly what
//!   the MP table says. Declaring IRQ0 -> GSI2 would point Linux at a pin the
//!   PIT never raises.
//! * **Edge-triggered virtio-mmio interrupts.** Device interrupts reach KVM
//!   through plain irqfds (no resample fd), and a plain irqfd *pulses* its GSI
//!   (assert, then deassert at once). On a level-triggered IOAPIC pin a pulse
//!   that arrives while the previous interrupt is still unacknowledged
//!   (remote IRR set) is lost when the line drops, and the device stalls.
//!   Edge mode latches every pulse, and Linux's virtio-mmio handler reads and
//!   acknowledges `InterruptStatus` for everything pending, so nothing is
//!   missed. Firecracker, which also drives them through plain irqfds,
//!   declares them edge-triggered too; QEMU's microvm declares them level
//!   because it drives a real level line (or a resampling irqfd). Interrupts
//!   are exclusive (never shared): an edge cannot be shared safely.
//! * **Port 0x600** for the sleep registers: see `corral_devices::acpi_pm`
//!   (0x3c0 would collide with the VGA attribute controller).

pub mod aml;
#[cfg(test)]
mod tests;

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::{HIGH_MEM_START, IOAPIC_ADDR, LAPIC_ADDR, MMIO_GAP_END, MMIO_GAP_START};
use crate::mptable::{IOAPIC_PINS, MAX_CPUS};
use aml::Trigger;
use corral_devices::acpi_pm;

/// Where the RSDP goes (start of the BIOS area kernels scan).
pub const RSDP_ADDR: u64 = 0xe_0000;
/// End of the area the tables may use (reserved in e820 up to here).
pub const TABLES_END: u64 = HIGH_MEM_START;
/// COM1's first port.
pub const COM1_PORT: u16 = 0x3f8;
/// COM1's interrupt (GSI = IOAPIC pin).
pub const COM1_IRQ: u32 = 4;
/// The Generic Event Device's interrupt (the power button): ISA IRQ 3,
/// COM2's, which corral has no device for.
pub const GED_IRQ: u32 = 3;
/// Most virtio-mmio windows the DSDT names (`V000`..`VFFF`).
pub const MAX_VIRTIO_MMIO: usize = 0x1000;

const OEM_ID: [u8; 6] = *b"CORRAL";
const OEM_TABLE_ID: [u8; 8] = *b"CORRALVM";
const OEM_REVISION: u32 = 1;
const CREATOR_ID: [u8; 4] = *b"CRRL";
const CREATOR_REVISION: u32 = 1;
const HEADER_LEN: usize = 36;
const RSDP_LEN: usize = 36;
const FADT_LEN: usize = 276;
const ALIGN: u64 = 16;

/// One virtio-mmio device window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioMmioWindow {
    /// Guest-physical base of the register window.
    pub base: u64,
    /// Window size in bytes.
    pub size: u32,
    /// GSI (IOAPIC pin) of the device's interrupt.
    pub irq: u32,
}

/// What the tables describe.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AcpiParams {
    /// Number of vCPUs (APIC ids 0..cpus).
    pub cpus: u8,
    /// virtio-mmio windows, in the order the DSDT lists them.
    pub virtio_mmio: Vec<VirtioMmioWindow>,
    /// Whether COM1 (ports 0x3f8-0x3ff, IRQ 4) exists.
    pub serial: bool,
}

/// Errors while building or writing the tables.
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    /// vCPU count out of range.
    #[error("ACPI tables can describe 1 to {MAX_CPUS} vCPUs, not {0}")]
    Cpus(u8),
    /// A virtio-mmio window that cannot be described or overlaps another.
    #[error("virtio-mmio window {base:#x}+{size:#x}: {why}")]
    Window {
        /// Base address.
        base: u64,
        /// Size.
        size: u32,
        /// What is wrong.
        why: &'static str,
    },
    /// An interrupt that cannot be given to a device.
    #[error("virtio-mmio interrupt {irq}: {why}")]
    Irq {
        /// The GSI.
        irq: u32,
        /// What is wrong.
        why: &'static str,
    },
    /// Too many devices to name.
    #[error("at most {MAX_VIRTIO_MMIO} virtio-mmio devices, not {0}")]
    TooManyDevices(usize),
    /// The tables do not fit below 1 MiB.
    #[error("ACPI tables need {0:#x} bytes from {RSDP_ADDR:#x}, beyond {TABLES_END:#x}")]
    TooLarge(u64),
    /// Guest memory write failed.
    #[error("cannot write the ACPI tables to guest memory: {0}")]
    Write(#[from] vm_memory::GuestMemoryError),
}

/// One table and where it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    /// Guest-physical address.
    pub addr: u64,
    /// Its bytes (length and checksum filled in).
    pub bytes: Vec<u8>,
}

impl Table {
    /// The signature: `RSD PTR ` for the RSDP, else the 4-byte table name.
    pub fn signature(&self) -> &str {
        let n = if self.bytes.starts_with(b"RSD PTR ") {
            8
        } else {
            4
        };
        std::str::from_utf8(&self.bytes[..n]).unwrap_or("????")
    }
}

fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |a, b| a.wrapping_add(*b))
        .wrapping_neg()
}

/// A System Description Table header with length 0 and checksum 0.
fn header(signature: &[u8; 4], revision: u8) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_LEN);
    h.extend_from_slice(signature);
    h.extend_from_slice(&[0; 4]); // length
    h.push(revision);
    h.push(0); // checksum
    h.extend_from_slice(&OEM_ID);
    h.extend_from_slice(&OEM_TABLE_ID);
    h.extend_from_slice(&OEM_REVISION.to_le_bytes());
    h.extend_from_slice(&CREATOR_ID);
    h.extend_from_slice(&CREATOR_REVISION.to_le_bytes());
    debug_assert_eq!(h.len(), HEADER_LEN);
    h
}

/// Fills in a table's length and checksum.
fn finish(mut t: Vec<u8>) -> Vec<u8> {
    let len = u32::try_from(t.len()).expect("ACPI tables are small");
    t[4..8].copy_from_slice(&len.to_le_bytes());
    t[9] = 0;
    t[9] = checksum(&t);
    t
}

fn validate(p: &AcpiParams) -> Result<(), AcpiError> {
    if p.cpus == 0 || p.cpus > MAX_CPUS {
        return Err(AcpiError::Cpus(p.cpus));
    }
    if p.virtio_mmio.len() > MAX_VIRTIO_MMIO {
        return Err(AcpiError::TooManyDevices(p.virtio_mmio.len()));
    }
    let mut irqs = Vec::new();
    for (i, w) in p.virtio_mmio.iter().enumerate() {
        let bad = |why| AcpiError::Window {
            base: w.base,
            size: w.size,
            why,
        };
        let end = w.base + u64::from(w.size);
        if w.size == 0 {
            return Err(bad("empty"));
        }
        if w.base < MMIO_GAP_START || end > MMIO_GAP_END {
            return Err(bad("outside the MMIO gap below 4 GiB"));
        }
        if p.virtio_mmio[..i]
            .iter()
            .any(|o| w.base < o.base + u64::from(o.size) && o.base < end)
        {
            return Err(bad("overlaps another window"));
        }
        let bad_irq = |why| AcpiError::Irq { irq: w.irq, why };
        if w.irq >= u32::from(IOAPIC_PINS) {
            return Err(bad_irq("the IOAPIC has 24 pins"));
        }
        if w.irq == 0 || w.irq == 2 {
            return Err(bad_irq("reserved for the PIT and the 8259 cascade"));
        }
        if p.serial && w.irq == COM1_IRQ {
            return Err(bad_irq("used by COM1"));
        }
        if w.irq == GED_IRQ {
            return Err(bad_irq("used by the power button's event device"));
        }
        if irqs.contains(&w.irq) {
            return Err(bad_irq(
                "used by another device (edge interrupts are not shared)",
            ));
        }
        irqs.push(w.irq);
    }
    Ok(())
}

/// The DSDT: `_S5_`, COM1, one device per virtio-mmio window.
fn dsdt(p: &AcpiParams) -> Vec<u8> {
    let mut sb = Vec::new();
    if p.serial {
        sb.extend(aml::device(
            "COM1",
            [
                aml::name("_HID", aml::eisa_id("PNP0501")),
                aml::name("_UID", aml::integer(1)),
                aml::name(
                    "_CRS",
                    aml::resource_template(&[
                        aml::io16(COM1_PORT, 8),
                        aml::interrupt(Trigger::Edge, COM1_IRQ),
                    ]),
                ),
            ]
            .concat(),
        ));
    }
    for (i, w) in p.virtio_mmio.iter().enumerate() {
        sb.extend(aml::device(
            &format!("V{i:03X}"),
            [
                aml::name("_HID", aml::string("LNRO0005")),
                aml::name("_UID", aml::integer(i as u64)),
                aml::name(
                    "_CRS",
                    aml::resource_template(&[
                        // `validate` keeps windows below 4 GiB.
                        aml::memory32_fixed(w.base as u32, w.size),
                        // Edge: see the module documentation.
                        aml::interrupt(Trigger::Edge, w.irq),
                    ]),
                ),
            ]
            .concat(),
        ));
    }
    // The power button (PNP0C0C) and the Generic Event Device whose
    // interrupt tells the guest to read the event register (see
    // `corral_devices::acpi_pm`): `_EVT` notifies the button with 0x80
    // ("pressed"), which Linux's button driver turns into KEY_POWER.
    sb.extend(aml::device(
        "PWRB",
        [
            aml::name("_HID", aml::eisa_id("PNP0C0C")),
            aml::name("_UID", aml::integer(0)),
        ]
        .concat(),
    ));
    let ged_port = acpi_pm::PORT_BASE + acpi_pm::GED_EVENT_OFFSET as u16;
    sb.extend(aml::device(
        "GED0",
        [
            aml::name("_HID", aml::string("ACPI0013")),
            aml::name("_UID", aml::integer(0)),
            aml::name(
                "_CRS",
                aml::resource_template(&[aml::interrupt(Trigger::Edge, GED_IRQ)]),
            ),
            aml::system_io_region("GDST", ged_port, 1),
            aml::byte_fields("GDST", &["GDAT"]),
            aml::method(
                "_EVT",
                1,
                aml::if_(
                    aml::and(
                        aml::path("GDAT"),
                        aml::integer(u64::from(acpi_pm::EVENT_POWER_BUTTON)),
                    ),
                    aml::notify("\\_SB.PWRB", 0x80),
                ),
            ),
        ]
        .concat(),
    ));
    let mut t = header(b"DSDT", 2); // revision 2: 64-bit integers
    let s5 = u64::from(acpi_pm::SLP_TYP_S5);
    t.extend(aml::name(
        "_S5",
        aml::package(&[
            aml::integer(s5),
            aml::integer(0),
            aml::integer(0),
            aml::integer(0),
        ]),
    ));
    t.extend(aml::scope("\\_SB", sb));
    finish(t)
}

/// The MADT: local APICs, the IOAPIC, the local APIC NMI.
fn madt(cpus: u8) -> Vec<u8> {
    const PCAT_COMPAT: u32 = 1;
    const LAPIC_ENABLED: u32 = 1;
    let mut t = header(b"APIC", 5);
    t.extend((LAPIC_ADDR as u32).to_le_bytes());
    t.extend(PCAT_COMPAT.to_le_bytes());
    for cpu in 0..cpus {
        // Type 0, length 8: ACPI processor UID, APIC id, flags.
        t.extend([0, 8, cpu, cpu]);
        t.extend(LAPIC_ENABLED.to_le_bytes());
    }
    // Type 1, length 12: IOAPIC id, reserved, address, GSI base.
    t.extend([1, 12, cpus, 0]);
    t.extend((IOAPIC_ADDR as u32).to_le_bytes());
    t.extend(0u32.to_le_bytes());
    // Type 4, length 6: NMI on LINT1 of all processors (UID 0xff),
    // polarity and trigger conforming to the bus.
    t.extend([4, 6, 0xff, 0, 0, 1]);
    finish(t)
}

/// A Generic Address Structure for a byte-wide system I/O register.
fn gas_io8(port: u16) -> [u8; 12] {
    let mut g = [0u8; 12];
    g[0] = 1; // system I/O space
    g[1] = 8; // register bit width
    g[2] = 0; // bit offset
    g[3] = 1; // access size: byte
    g[4..12].copy_from_slice(&u64::from(port).to_le_bytes());
    g
}

/// The FADT (ACPI 6.5, table 5.9), hardware-reduced.
fn fadt(dsdt_addr: u64) -> Vec<u8> {
    const WBINVD: u32 = 1 << 0;
    const PWR_BUTTON: u32 = 1 << 4; // no fixed power button
    const SLP_BUTTON: u32 = 1 << 5; // no fixed sleep button
    const RESET_REG_SUP: u32 = 1 << 10;
    const HW_REDUCED_ACPI: u32 = 1 << 20;
    const IAPC_VGA_NOT_PRESENT: u16 = 1 << 2;
    const IAPC_CMOS_RTC_NOT_PRESENT: u16 = 1 << 5;
    // LEGACY_DEVICES (bit 0) and 8042 (bit 1) stay clear: corral's i8042
    // only resets, there is nothing for the keyboard driver to probe.
    let mut t = header(b"FACP", 6);
    t.resize(FADT_LEN, 0);
    // FIRMWARE_CTRL, DSDT (32-bit), SCI_INT, SMI_CMD, PM blocks: all 0.
    let boot_arch = IAPC_VGA_NOT_PRESENT | IAPC_CMOS_RTC_NOT_PRESENT;
    t[109..111].copy_from_slice(&boot_arch.to_le_bytes());
    let flags = WBINVD | PWR_BUTTON | SLP_BUTTON | RESET_REG_SUP | HW_REDUCED_ACPI;
    t[112..116].copy_from_slice(&flags.to_le_bytes());
    t[116..128].copy_from_slice(&gas_io8(0x64)); // RESET_REG: the i8042
    t[128] = corral_devices::i8042::CMD_RESET_CPU; // RESET_VALUE
    t[131] = 5; // FADT minor version: ACPI 6.5
    t[140..148].copy_from_slice(&dsdt_addr.to_le_bytes()); // X_DSDT
    let ctl = acpi_pm::PORT_BASE + acpi_pm::SLEEP_CONTROL_OFFSET as u16;
    let sts = acpi_pm::PORT_BASE + acpi_pm::SLEEP_STATUS_OFFSET as u16;
    t[244..256].copy_from_slice(&gas_io8(ctl)); // SLEEP_CONTROL_REG
    t[256..268].copy_from_slice(&gas_io8(sts)); // SLEEP_STATUS_REG
    t[268..276].copy_from_slice(b"CORRAL  "); // hypervisor vendor identity
    finish(t)
}

fn xsdt(entries: &[u64]) -> Vec<u8> {
    let mut t = header(b"XSDT", 1);
    for e in entries {
        t.extend(e.to_le_bytes());
    }
    finish(t)
}

fn rsdp(xsdt_addr: u64) -> Vec<u8> {
    let mut r = Vec::with_capacity(RSDP_LEN);
    r.extend_from_slice(b"RSD PTR ");
    r.push(0); // checksum of the first 20 bytes
    r.extend_from_slice(&OEM_ID);
    r.push(2); // revision: ACPI 2.0+
    r.extend(0u32.to_le_bytes()); // no RSDT
    r.extend((RSDP_LEN as u32).to_le_bytes());
    r.extend(xsdt_addr.to_le_bytes());
    r.push(0); // extended checksum
    r.extend([0; 3]);
    r[8] = checksum(&r[..20]);
    r[32] = checksum(&r);
    r
}

fn align_up(v: u64) -> u64 {
    v.div_ceil(ALIGN) * ALIGN
}

/// Builds every table and its address; the RSDP comes first, at
/// [`RSDP_ADDR`], followed by XSDT, FACP, APIC and DSDT.
pub fn build(p: &AcpiParams) -> Result<Vec<Table>, AcpiError> {
    validate(p)?;
    let dsdt = dsdt(p);
    let madt = madt(p.cpus);
    let xsdt_len = HEADER_LEN + 2 * 8;
    let xsdt_addr = align_up(RSDP_ADDR + RSDP_LEN as u64);
    let fadt_addr = align_up(xsdt_addr + xsdt_len as u64);
    let madt_addr = align_up(fadt_addr + FADT_LEN as u64);
    let dsdt_addr = align_up(madt_addr + madt.len() as u64);
    let end = dsdt_addr + dsdt.len() as u64;
    if end > TABLES_END {
        return Err(AcpiError::TooLarge(end - RSDP_ADDR));
    }
    let tables = vec![
        Table {
            addr: RSDP_ADDR,
            bytes: rsdp(xsdt_addr),
        },
        Table {
            addr: xsdt_addr,
            bytes: xsdt(&[fadt_addr, madt_addr]),
        },
        Table {
            addr: fadt_addr,
            bytes: fadt(dsdt_addr),
        },
        Table {
            addr: madt_addr,
            bytes: madt,
        },
        Table {
            addr: dsdt_addr,
            bytes: dsdt,
        },
    ];
    debug_assert_eq!(tables[1].bytes.len(), xsdt_len);
    Ok(tables)
}

/// Writes the tables into guest memory; returns the RSDP's address (for
/// `boot_params.acpi_rsdp_addr`).
pub fn write(mem: &GuestMemoryMmap, p: &AcpiParams) -> Result<u64, AcpiError> {
    let tables = build(p)?;
    for t in &tables {
        mem.write_slice(&t.bytes, GuestAddress(t.addr))?;
    }
    Ok(RSDP_ADDR)
}
