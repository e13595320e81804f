//! CPU state for the Linux 64-bit boot protocol: GDT, identity page tables,
//! registers, MSRs and the local APIC's LINT pins.

use kvm_bindings::{Msrs, kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::*;

/// Errors while setting up a vCPU for boot.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// Guest memory write failed.
    #[error("cannot write boot structures to guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
    /// A KVM ioctl failed.
    #[error("{what}: {err}")]
    Kvm {
        /// What was being set.
        what: &'static str,
        /// The error.
        err: kvm_ioctls::Error,
    },
}

fn kvm(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> BootError {
    move |err| BootError::Kvm { what, err }
}

/// Selector of the 64-bit code segment (Linux's `__BOOT_CS`).
pub const BOOT_CS: u16 = 0x10;
/// Selector of the data segment (Linux's `__BOOT_DS`).
pub const BOOT_DS: u16 = 0x18;
/// Selector of the TSS.
pub const BOOT_TSS: u16 = 0x20;

const GDT: [u64; 5] = [
    0,                     // null
    0,                     // unused (0x08)
    0x00af_9b00_0000_ffff, // 0x10: code, 64-bit, present, DPL0, execute/read
    0x00cf_9300_0000_ffff, // 0x18: data, 4 GiB flat, read/write
    0x0080_8b00_0000_ffff, // 0x20: TSS (busy 64-bit)
];

fn segment_from_gdt(entry: u64, selector: u16) -> kvm_segment {
    let base = ((entry >> 16) & 0xff_ffff) | (((entry >> 56) & 0xff) << 24);
    let limit = ((entry & 0xffff) | (((entry >> 48) & 0xf) << 16)) as u32;
    let g = ((entry >> 55) & 1) as u8;
    kvm_segment {
        base,
        limit: if g == 1 { (limit << 12) | 0xfff } else { limit },
        selector,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        unusable: 0,
        padding: 0,
    }
}

/// Writes the GDT, the empty IDT and the identity-mapping page tables.
pub fn write_tables(mem: &GuestMemoryMmap) -> Result<(), BootError> {
    for (i, e) in GDT.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(GDT_ADDR + 8 * i as u64))?;
    }
    mem.write_obj(0u64, GuestAddress(IDT_ADDR))?;
    // PML4[0] -> PDPT; PDPT[0..4] -> four PDs; each PD maps 1 GiB in 2 MiB pages.
    mem.write_obj(PDPT_ADDR | 0x3, GuestAddress(PML4_ADDR))?;
    let mut pd = [0u8; 4 * 4096];
    for i in 0..4u64 {
        mem.write_obj(
            (PD_ADDR + i * 0x1000) | 0x3,
            GuestAddress(PDPT_ADDR + i * 8),
        )?;
    }
    for (i, chunk) in pd.chunks_exact_mut(8).enumerate() {
        let entry = ((i as u64) << 21) | 0x83; // present, writable, 2 MiB
        chunk.copy_from_slice(&entry.to_le_bytes());
    }
    mem.write_slice(&pd, GuestAddress(PD_ADDR))?;
    Ok(())
}

/// Puts `vcpu` in 64-bit mode at `entry` with `boot_params` in RSI.
pub fn setup_boot_cpu(vcpu: &VcpuFd, entry: u64) -> Result<(), BootError> {
    let mut sregs: kvm_sregs = vcpu.get_sregs().map_err(kvm("KVM_GET_SREGS"))?;
    let code = segment_from_gdt(GDT[2], BOOT_CS);
    let data = segment_from_gdt(GDT[3], BOOT_DS);
    let tss = segment_from_gdt(GDT[4], BOOT_TSS);
    sregs.gdt.base = GDT_ADDR;
    sregs.gdt.limit = (GDT.len() * 8 - 1) as u16;
    sregs.idt.base = IDT_ADDR;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    const CR0_PE: u64 = 1;
    const CR0_ET: u64 = 1 << 4;
    const CR0_PG: u64 = 1 << 31;
    const CR4_PAE: u64 = 1 << 5;
    const EFER_LME: u64 = 1 << 8;
    const EFER_LMA: u64 = 1 << 10;
    sregs.cr0 = CR0_PE | CR0_ET | CR0_PG;
    sregs.cr3 = PML4_ADDR;
    sregs.cr4 = CR4_PAE;
    sregs.efer = EFER_LME | EFER_LMA;
    vcpu.set_sregs(&sregs).map_err(kvm("KVM_SET_SREGS"))?;

    let regs = kvm_regs {
        rflags: 0x2,
        rip: entry,
        rsp: BOOT_STACK,
        rbp: BOOT_STACK,
        rsi: BOOT_PARAMS_ADDR,
        ..Default::default()
    };
    vcpu.set_regs(&regs).map_err(kvm("KVM_SET_REGS"))?;
    Ok(())
}

/// Common state of every vCPU: FPU control words, boot MSRs, LAPIC LINT pins.
pub fn setup_common(vcpu: &VcpuFd) -> Result<(), BootError> {
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(kvm("KVM_SET_FPU"))?;

    let entry = |index: u32, data: u64| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    let msrs = Msrs::from_entries(&[
        entry(0x174, 0),       // SYSENTER_CS
        entry(0x175, 0),       // SYSENTER_ESP
        entry(0x176, 0),       // SYSENTER_EIP
        entry(0xc000_0081, 0), // STAR
        entry(0xc000_0082, 0), // LSTAR
        entry(0xc000_0083, 0), // CSTAR
        entry(0xc000_0102, 0), // KERNEL_GS_BASE
        entry(0xc000_0084, 0), // SYSCALL_MASK
        entry(0x1a0, 1),       // MISC_ENABLE: fast strings
    ])
    .map_err(|_| BootError::Kvm {
        what: "building the MSR list",
        err: kvm_ioctls::Error::new(libc::EINVAL),
    })?;
    // Some MSRs may not exist on this host (e.g. MISC_ENABLE on AMD); KVM sets
    // the ones it knows in order and stops at the first it refuses. That is fine.
    vcpu.set_msrs(&msrs).map_err(kvm("KVM_SET_MSRS"))?;

    // LINT0 = ExtINT (the PIC's interrupts), LINT1 = NMI.
    let mut lapic = vcpu.get_lapic().map_err(kvm("KVM_GET_LAPIC"))?;
    const LVT_LINT0: usize = 0x350;
    const LVT_LINT1: usize = 0x360;
    let set = |regs: &mut [std::os::raw::c_char], off: usize, mode: u32| {
        let mut v = [0u8; 4];
        for (i, b) in v.iter_mut().enumerate() {
            *b = regs[off + i] as u8;
        }
        let val = u32::from_le_bytes(v);
        let val = (val & !0x700) | (mode << 8);
        for (i, b) in val.to_le_bytes().iter().enumerate() {
            regs[off + i] = *b as std::os::raw::c_char;
        }
    };
    set(&mut lapic.regs, LVT_LINT0, 0x7);
    set(&mut lapic.regs, LVT_LINT1, 0x4);
    vcpu.set_lapic(&lapic).map_err(kvm("KVM_SET_LAPIC"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_segments_decode() {
        let cs = segment_from_gdt(GDT[2], BOOT_CS);
        assert_eq!((cs.l, cs.db, cs.present, cs.s, cs.type_), (1, 0, 1, 1, 0xb));
        assert_eq!(cs.limit, 0xffff_ffff);
        let ds = segment_from_gdt(GDT[3], BOOT_DS);
        assert_eq!((ds.l, ds.db, ds.type_), (0, 1, 0x3));
        let tss = segment_from_gdt(GDT[4], BOOT_TSS);
        assert_eq!((tss.s, tss.type_, tss.present), (0, 0xb, 1));
    }

    #[test]
    fn page_tables_identity_map_4g() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write_tables(&mem).unwrap();
        let pml4: u64 = mem.read_obj(GuestAddress(PML4_ADDR)).unwrap();
        assert_eq!(pml4 & !0xfff, PDPT_ADDR);
        // The last 2 MiB page maps 0xffe0_0000 (covers the LAPIC).
        let last: u64 = mem.read_obj(GuestAddress(PD_ADDR + 4 * 4096 - 8)).unwrap();
        assert_eq!(last & !0xfff, 0xffe0_0000);
        assert_eq!(last & 0x83, 0x83);
    }
}
