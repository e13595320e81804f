//! CPUID for a vCPU: KVM's supported set with the usual fix-ups.

use kvm_bindings::CpuId;

/// Hypervisor timing leaf (VMware convention, also read by the probe guest):
/// EAX = TSC frequency in kHz.
pub const LEAF_TIMING: u32 = 0x4000_0010;

/// Adjusts `cpuid` for vCPU `index` of `count`, with `tsc_khz` when known.
pub fn fixup(cpuid: &mut CpuId, index: u8, count: u8, tsc_khz: Option<u32>) {
    let apic_id = u32::from(index);
    let count = u32::from(count.max(1));
    let mut has_timing = false;
    for e in cpuid.as_mut_slice().iter_mut() {
        match e.function {
            0x1 => {
                // APIC id, logical processor count; hypervisor bit; no x2APIC
                // requirement (keep what KVM offers).
                e.ebx = (e.ebx & 0x0000_ffff) | (apic_id << 24) | (count.min(255) << 16);
                e.ecx |= 1 << 31;
                if count > 1 {
                    e.edx |= 1 << 28; // HTT: the count field is valid
                }
            }
            0x4 if e.eax & 0x1f != 0 => {
                // Deterministic cache parameters: cores per package - 1 in
                // EAX[31:26]; each cache shared by one logical CPU.
                e.eax = (e.eax & 0x03ff_ffff) | ((count - 1).min(63) << 26);
                e.eax &= !(0xfff << 14);
            }
            0x6 => {
                // No power management to the guest.
                e.ecx &= !(1 << 3);
            }
            0xb => {
                // Extended topology: one thread per core, `count` cores.
                e.edx = apic_id;
                match e.index {
                    0 => {
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = 0x100; // level 0, type SMT
                    }
                    1 => {
                        e.eax = 32 - (count - 1).leading_zeros().min(32);
                        e.ebx = count;
                        e.ecx = 0x201; // level 1, type core
                    }
                    _ => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = e.index & 0xff;
                    }
                }
            }
            0x4000_0000 => {
                e.eax = e.eax.max(LEAF_TIMING);
            }
            0x8000_0008 => {
                // AMD: number of cores - 1 in ECX[7:0], APIC id size in ECX[15:12].
                let bits = 32 - (count - 1).leading_zeros().min(32);
                e.ecx = (e.ecx & !0xf0ff) | (bits << 12) | (count - 1).min(255);
            }
            0x8000_001e => {
                // AMD extended APIC id; one thread per core, node 0.
                e.eax = apic_id;
                e.ebx = apic_id & 0xff;
                e.ecx = 0;
            }
            LEAF_TIMING => has_timing = true,
            _ => {}
        }
    }
    if let Some(khz) = tsc_khz
        && !has_timing
    {
        let _ = cpuid.push(kvm_bindings::kvm_cpuid_entry2 {
            function: LEAF_TIMING,
            eax: khz,
            ebx: 1_000_000, // bus (LAPIC timer) frequency in kHz: 1 GHz
            ..Default::default()
        });
    }
}
