//! Intel MultiProcessor Specification 1.4 tables, so that guests without ACPI
//! (and Linux with `acpi=off`) find every vCPU, the IOAPIC and the ISA IRQs.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::{EBDA_START, IOAPIC_ADDR, LAPIC_ADDR};

/// Largest vCPU count an MP table can describe (APIC ids 0..=254, one for the IOAPIC).
pub const MAX_CPUS: u8 = 254;
const APIC_VERSION: u8 = 0x14;
const NUM_ISA_IRQS: u8 = 16;
/// Number of IOAPIC pins (KVM's in-kernel IOAPIC).
pub const IOAPIC_PINS: u8 = 24;

/// Errors while writing the MP table.
#[derive(Debug, thiserror::Error)]
pub enum MpTableError {
    /// Too many vCPUs.
    #[error("an MP table can describe at most {MAX_CPUS} vCPUs, not {0}")]
    TooManyCpus(u8),
    /// Guest memory write failed.
    #[error("cannot write the MP table to guest memory: {0}")]
    Write(#[from] vm_memory::GuestMemoryError),
}

fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |a, b| a.wrapping_add(*b))
        .wrapping_neg()
}

/// Builds the MP floating pointer and configuration table for `num_cpus` at `base`.
pub fn build(num_cpus: u8, base: u64) -> Result<Vec<u8>, MpTableError> {
    if num_cpus == 0 || num_cpus > MAX_CPUS {
        return Err(MpTableError::TooManyCpus(num_cpus));
    }
    let ioapic_id = num_cpus; // first id after the CPUs
    // Entries of the configuration table.
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for cpu in 0..num_cpus {
        let mut e = [0u8; 20];
        e[0] = 0; // processor
        e[1] = cpu; // local APIC id
        e[2] = APIC_VERSION;
        e[3] = 0x01 | if cpu == 0 { 0x02 } else { 0 }; // enabled, BSP
        e[4..8].copy_from_slice(&0x0006_00f1u32.to_le_bytes()); // family 6 signature
        e[8..12].copy_from_slice(&0x0000_0201u32.to_le_bytes()); // FPU + APIC
        entries.extend_from_slice(&e);
        count += 1;
    }
    // Bus 0: ISA.
    entries.extend_from_slice(&[1, 0, b'I', b'S', b'A', b' ', b' ', b' ']);
    count += 1;
    // The IOAPIC.
    let mut e = [0u8; 8];
    e[0] = 2;
    e[1] = ioapic_id;
    e[2] = APIC_VERSION;
    e[3] = 1; // usable
    e[4..8].copy_from_slice(&(IOAPIC_ADDR as u32).to_le_bytes());
    entries.extend_from_slice(&e);
    count += 1;
    // ISA IRQs 0..15 to IOAPIC pins of the same number (conforming polarity/trigger).
    for irq in 0..NUM_ISA_IRQS {
        entries.extend_from_slice(&[3, 0, 0, 0, 0, irq, ioapic_id, irq]);
        count += 1;
    }
    // Local interrupts: ExtINT on LINT0, NMI on LINT1, all local APICs.
    entries.extend_from_slice(&[4, 3, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, 1, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let table_addr = base + 16;
    let mut hdr = [0u8; 44];
    hdr[0..4].copy_from_slice(b"PCMP");
    let len = (44 + entries.len()) as u16;
    hdr[4..6].copy_from_slice(&len.to_le_bytes());
    hdr[6] = 4; // spec revision 1.4
    hdr[8..16].copy_from_slice(b"CORRAL  ");
    hdr[16..28].copy_from_slice(b"KVM VM      ");
    hdr[34..36].copy_from_slice(&count.to_le_bytes());
    hdr[36..40].copy_from_slice(&(LAPIC_ADDR as u32).to_le_bytes());
    let mut table = hdr.to_vec();
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut mpf = [0u8; 16];
    mpf[0..4].copy_from_slice(b"_MP_");
    mpf[4..8].copy_from_slice(&(table_addr as u32).to_le_bytes());
    mpf[8] = 1; // length in 16-byte units
    mpf[9] = 4;
    mpf[10] = checksum(&mpf);

    let mut out = mpf.to_vec();
    out.extend_from_slice(&table);
    Ok(out)
}

/// Writes the MP table for `num_cpus` into the EBDA.
pub fn write(mem: &GuestMemoryMmap, num_cpus: u8) -> Result<(), MpTableError> {
    let bytes = build(num_cpus, EBDA_START)?;
    mem.write_slice(&bytes, GuestAddress(EBDA_START))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    #[test]
    fn checksums_and_counts() {
        for n in [1u8, 2, 8, MAX_CPUS] {
            let t = build(n, EBDA_START).unwrap();
            assert_eq!(&t[0..4], b"_MP_");
            assert_eq!(sum(&t[0..16]), 0);
            let len = u16::from_le_bytes([t[20], t[21]]) as usize;
            assert_eq!(16 + len, t.len());
            assert_eq!(sum(&t[16..]), 0);
            let count = u16::from_le_bytes([t[50], t[51]]);
            assert_eq!(count as usize, n as usize + 1 + 1 + 16 + 2);
            // Processor entries: one per CPU, BSP flag only on the first.
            let cpus: Vec<&[u8]> = t[60..60 + 20 * n as usize].chunks(20).collect();
            assert!(cpus.iter().all(|e| e[0] == 0 && e[3] & 1 == 1));
            assert_eq!(cpus.iter().filter(|e| e[3] & 2 != 0).count(), 1);
        }
        assert!(build(0, 0).is_err());
        assert!(build(255, 0).is_err());
    }
}
