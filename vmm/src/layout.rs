//! The guest physical address map.
//!
//! ```text
//! 0x0000_0500  GDT (5 entries), then the IDT (empty)
//! 0x0000_7000  boot_params (the Linux "zero page")
//! 0x0000_8ff0  initial stack pointer of the BSP
//! 0x0000_9000  PML4, 0xa000 PDPT, 0xb000..0xefff four page directories
//!              (identity map of the first 4 GiB with 2 MiB pages)
//! 0x0002_0000  kernel command line (up to CMDLINE_MAX bytes)
//! 0x0009_fc00  MP table (EBDA area), reserved up to 1 MiB
//! 0x0010_0000  kernel (ELF p_paddr, or bzImage protected-mode code)
//! ...          RAM up to MMIO_GAP_START
//! 0xc000_0000  MMIO gap (1 GiB): virtio-mmio windows, IOAPIC, LAPIC
//! 0x1_0000_0000 RAM above the gap, for guests bigger than 3 GiB
//! ```

/// GDT location.
pub const GDT_ADDR: u64 = 0x500;
/// IDT location (limit 0: any exception before the guest sets one is fatal).
pub const IDT_ADDR: u64 = 0x528;
/// The zero page.
pub const BOOT_PARAMS_ADDR: u64 = 0x7000;
/// Initial RSP of the boot CPU.
pub const BOOT_STACK: u64 = 0x8ff0;
/// Page-map level 4.
pub const PML4_ADDR: u64 = 0x9000;
/// Page-directory-pointer table.
pub const PDPT_ADDR: u64 = 0xa000;
/// First of four page directories.
pub const PD_ADDR: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_ADDR: u64 = 0x2_0000;
/// Longest command line accepted (bytes, without the terminating NUL).
pub const CMDLINE_MAX: usize = 0xffff;
/// Start of the EBDA; the MP table goes here.
pub const EBDA_START: u64 = 0x9_fc00;
/// Top of the legacy reserved area.
pub const HIGH_MEM_START: u64 = 0x10_0000;
/// Start of the MMIO hole below 4 GiB.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
/// End of the MMIO hole.
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// Where virtio-mmio device windows are allocated (4 KiB each).
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;
/// IOAPIC base.
pub const IOAPIC_ADDR: u64 = 0xfec0_0000;
/// Local APIC base.
pub const LAPIC_ADDR: u64 = 0xfee0_0000;
/// Smallest guest accepted, in MiB.
pub const MIN_MEMORY_MIB: u64 = 8;

/// RAM ranges `(start, len)` for a guest of `mem_bytes`.
pub fn ram_ranges(mem_bytes: u64) -> Vec<(u64, u64)> {
    if mem_bytes <= MMIO_GAP_START {
        vec![(0, mem_bytes)]
    } else {
        vec![
            (0, MMIO_GAP_START),
            (MMIO_GAP_END, mem_bytes - MMIO_GAP_START),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gap_split() {
        assert_eq!(ram_ranges(128 << 20), vec![(0, 128 << 20)]);
        assert_eq!(ram_ranges(4 << 30), vec![(0, 3 << 30), (1 << 32, 1 << 30)]);
        // Nothing overlaps the fixed low structures' order.
        const { assert!(GDT_ADDR < IDT_ADDR && IDT_ADDR < BOOT_PARAMS_ADDR) };
        const { assert!(PD_ADDR + 4 * 0x1000 <= CMDLINE_ADDR) };
        const { assert!(CMDLINE_ADDR + (CMDLINE_MAX as u64) < EBDA_START) };
    }
}
