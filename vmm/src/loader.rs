//! Kernel, initrd and command-line loading, and the zero page.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};

use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::loader::{BzImage, Elf, KernelLoader};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use crate::layout::*;

/// What kind of kernel image a file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelKind {
    /// An ELF64 x86-64 executable (vmlinux, the probe guest).
    Elf,
    /// A bzImage with the 64-bit entry point.
    BzImage,
}

/// Errors while loading the guest's boot payload.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The kernel file cannot be read.
    #[error("cannot read kernel {path}: {err}")]
    KernelIo {
        /// The path.
        path: String,
        /// The cause.
        err: std::io::Error,
    },
    /// The file is not a kernel corral can boot.
    #[error("{path} is not a bootable x86-64 kernel: {why}")]
    NotAKernel {
        /// The path.
        path: String,
        /// Why not.
        why: String,
    },
    /// The loader refused the image or it does not fit in guest memory.
    #[error("cannot load kernel {path}: {err}")]
    Load {
        /// The path.
        path: String,
        /// The cause.
        err: linux_loader::loader::Error,
    },
    /// The initrd cannot be read.
    #[error("cannot read initrd {path}: {err}")]
    InitrdIo {
        /// The path.
        path: String,
        /// The cause.
        err: std::io::Error,
    },
    /// The initrd does not fit.
    #[error("initrd {path} ({size} bytes) does not fit in guest memory below {limit:#x}")]
    InitrdTooBig {
        /// The path.
        path: String,
        /// Its size.
        size: u64,
        /// Highest usable address.
        limit: u64,
    },
    /// The command line is too long or contains a NUL.
    #[error("kernel command line: {0}")]
    Cmdline(String),
    /// Guest memory write failed.
    #[error("cannot write to guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
}

/// Inspects a kernel file without loading it.
pub fn probe_kernel<R: Read + Seek>(img: &mut R, path: &str) -> Result<KernelKind, LoadError> {
    let not = |why: &str| LoadError::NotAKernel {
        path: path.to_string(),
        why: why.to_string(),
    };
    let io = |err| LoadError::KernelIo {
        path: path.to_string(),
        err,
    };
    let mut head = vec![0u8; 0x300];
    img.seek(SeekFrom::Start(0)).map_err(io)?;
    let mut n = 0;
    while n < head.len() {
        let r = img.read(&mut head[n..]).map_err(io)?;
        if r == 0 {
            break;
        }
        n += r;
    }
    head.truncate(n);
    if head.len() >= 20 && head[0..4] == *b"\x7fELF" {
        if head[4] != 2 {
            return Err(not("ELF, but not 64-bit"));
        }
        if head[5] != 1 {
            return Err(not("ELF, but not little-endian"));
        }
        if u16::from_le_bytes([head[18], head[19]]) != 62 {
            return Err(not("ELF, but not for x86-64"));
        }
        if u16::from_le_bytes([head[16], head[17]]) != 2 {
            return Err(not("ELF, but not an executable"));
        }
        return Ok(KernelKind::Elf);
    }
    if head.len() >= 0x238 && head[0x202..0x206] == *b"HdrS" {
        let version = u16::from_le_bytes([head[0x206], head[0x207]]);
        let xloadflags = u16::from_le_bytes([head[0x236], head[0x237]]);
        if version < 0x020c || xloadflags & 1 == 0 {
            return Err(not(
                "bzImage without a 64-bit entry point (boot protocol < 2.12 or XLF_KERNEL_64 unset)",
            ));
        }
        return Ok(KernelKind::BzImage);
    }
    Err(not("neither an ELF64 executable nor a bzImage"))
}

/// Where the kernel was put and how to enter it.
#[derive(Debug, Clone, Copy)]
pub struct Loaded {
    /// 64-bit entry point.
    pub entry: u64,
    /// First byte after the kernel.
    pub kernel_end: u64,
    /// The bzImage setup header, if any.
    pub setup_header: Option<setup_header>,
}

/// Loads a kernel image from a reader.
pub fn load_kernel<R: Read + Seek + vm_memory::ReadVolatile>(
    mem: &GuestMemoryMmap,
    img: &mut R,
    path: &str,
) -> Result<Loaded, LoadError> {
    let kind = probe_kernel(img, path)?;
    let err = |err| LoadError::Load {
        path: path.to_string(),
        err,
    };
    match kind {
        KernelKind::Elf => {
            let r = Elf::load(mem, None, img, Some(GuestAddress(HIGH_MEM_START))).map_err(err)?;
            Ok(Loaded {
                entry: r.kernel_load.raw_value(),
                kernel_end: r.kernel_end,
                setup_header: None,
            })
        }
        KernelKind::BzImage => {
            let r =
                BzImage::load(mem, None, img, Some(GuestAddress(HIGH_MEM_START))).map_err(err)?;
            Ok(Loaded {
                entry: r.kernel_load.raw_value() + 0x200,
                kernel_end: r.kernel_end,
                setup_header: r.setup_header,
            })
        }
    }
}

/// Loads the initrd (an open, checked file) as high as possible below the
/// kernel's limit, returns (addr, size).
pub fn load_initrd(
    mem: &GuestMemoryMmap,
    file: &File,
    path: &str,
    max_addr: u64,
    kernel_end: u64,
) -> Result<(u64, u64), LoadError> {
    let p = path.to_string();
    let io = |err| LoadError::InitrdIo {
        path: p.clone(),
        err,
    };
    let mut f = file.try_clone().map_err(io)?;
    let size = f.metadata().map_err(io)?.len();
    f.seek(SeekFrom::Start(0)).map_err(io)?;
    // Highest RAM below the gap and the kernel's limit.
    let top = mem
        .iter()
        .map(|r| {
            use vm_memory::GuestMemoryRegion;
            r.start_addr().raw_value() + r.len()
        })
        .filter(|end| *end <= MMIO_GAP_START)
        .max()
        .unwrap_or(0)
        .min(max_addr.saturating_add(1));
    let too_big = || LoadError::InitrdTooBig {
        path: p.clone(),
        size,
        limit: top,
    };
    let addr = top.checked_sub(size).ok_or_else(too_big)? & !0xfff;
    if addr < kernel_end.max(HIGH_MEM_START) {
        return Err(too_big());
    }
    mem.read_exact_volatile_from(GuestAddress(addr), &mut f, size as usize)
        .map_err(LoadError::Memory)?;
    Ok((addr, size))
}

/// Writes the command line.
pub fn write_cmdline(mem: &GuestMemoryMmap, cmdline: &str) -> Result<(), LoadError> {
    if cmdline.len() > CMDLINE_MAX {
        return Err(LoadError::Cmdline(format!(
            "{} bytes, longer than the {} allowed",
            cmdline.len(),
            CMDLINE_MAX
        )));
    }
    if cmdline.as_bytes().contains(&0) {
        return Err(LoadError::Cmdline("contains a NUL byte".into()));
    }
    mem.write_slice(cmdline.as_bytes(), GuestAddress(CMDLINE_ADDR))?;
    mem.write_obj(0u8, GuestAddress(CMDLINE_ADDR + cmdline.len() as u64))?;
    Ok(())
}

/// e820 map of the guest: RAM below 640 KiB minus the EBDA, RAM from 1 MiB
/// up to the gap, RAM above 4 GiB.
pub fn e820_map(mem_bytes: u64) -> Vec<(u64, u64, u32)> {
    const RAM: u32 = 1;
    const RESERVED: u32 = 2;
    let mut v = vec![
        (0, EBDA_START, RAM),
        (EBDA_START, HIGH_MEM_START - EBDA_START, RESERVED),
    ];
    for (start, len) in ram_ranges(mem_bytes) {
        let (s, l) = if start == 0 {
            (HIGH_MEM_START, len - HIGH_MEM_START)
        } else {
            (start, len)
        };
        v.push((s, l, RAM));
    }
    v
}

/// Fills and writes the zero page.
pub fn write_boot_params(
    mem: &GuestMemoryMmap,
    mem_bytes: u64,
    loaded: &Loaded,
    cmdline_len: usize,
    initrd: Option<(u64, u64)>,
    acpi_rsdp: Option<u64>,
) -> Result<(), LoadError> {
    let mut params = boot_params::default();
    if let Some(rsdp) = acpi_rsdp {
        params.acpi_rsdp_addr = rsdp;
    }
    if let Some(h) = loaded.setup_header {
        params.hdr = h;
    } else {
        params.hdr.header = 0x5372_6448; // "HdrS"
        params.hdr.boot_flag = 0xaa55;
        params.hdr.kernel_alignment = 0x100_0000;
        params.hdr.version = 0x020f;
    }
    params.hdr.type_of_loader = 0xff;
    params.hdr.loadflags |= 0x01 | 0x80; // LOADED_HIGH, CAN_USE_HEAP
    params.hdr.heap_end_ptr = 0xfe00;
    params.hdr.cmd_line_ptr = CMDLINE_ADDR as u32;
    params.ext_cmd_line_ptr = (CMDLINE_ADDR >> 32) as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    if let Some((addr, size)) = initrd {
        params.hdr.ramdisk_image = addr as u32;
        params.ext_ramdisk_image = (addr >> 32) as u32;
        params.hdr.ramdisk_size = size as u32;
        params.ext_ramdisk_size = (size >> 32) as u32;
    }
    let map = e820_map(mem_bytes);
    for (i, (addr, size, ty)) in map.iter().enumerate() {
        params.e820_table[i] = boot_e820_entry {
            addr: *addr,
            size: *size,
            r#type: *ty,
        };
    }
    params.e820_entries = map.len() as u8;
    mem.write_obj(params, GuestAddress(BOOT_PARAMS_ADDR))?;
    Ok(())
}

/// The initrd address limit a kernel declares (default 0x37ffffff).
pub fn initrd_addr_max(loaded: &Loaded) -> u64 {
    match loaded.setup_header {
        Some(h) if h.initrd_addr_max != 0 => {
            if h.xloadflags & (1 << 1) != 0 {
                // XLF_CAN_BE_LOADED_ABOVE_4G
                u64::MAX
            } else {
                u64::from(h.initrd_addr_max)
            }
        }
        _ => 0x37ff_ffff,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    #[test]
    fn probe_rejects_junk() {
        for junk in [
            &b""[..],
            b"hello world",
            &[0x7f, b'E', b'L', b'F', 1, 1, 1, 0][..],
        ] {
            let mut c = Cursor::new(junk.to_vec());
            assert!(matches!(
                probe_kernel(&mut c, "x"),
                Err(LoadError::NotAKernel { .. })
            ));
        }
        let mut elf = vec![0u8; 64];
        elf[0..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[5] = 1;
        elf[16] = 2;
        elf[18] = 62;
        assert_eq!(
            probe_kernel(&mut Cursor::new(elf.clone()), "x").unwrap(),
            KernelKind::Elf
        );
        elf[18] = 183; // aarch64
        assert!(probe_kernel(&mut Cursor::new(elf), "x").is_err());
        let mut bz = vec![0u8; 0x300];
        bz[0x202..0x206].copy_from_slice(b"HdrS");
        bz[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
        assert!(probe_kernel(&mut Cursor::new(bz.clone()), "x").is_err());
        bz[0x236] = 1;
        assert_eq!(
            probe_kernel(&mut Cursor::new(bz), "x").unwrap(),
            KernelKind::BzImage
        );
    }

    #[test]
    fn e820_has_gap() {
        let m = e820_map(4 << 30);
        assert!(
            m.iter()
                .all(|(a, s, _)| a + s <= MMIO_GAP_START || *a >= MMIO_GAP_END)
        );
        let ram: u64 = m.iter().filter(|e| e.2 == 1).map(|e| e.1).sum();
        assert_eq!(ram, (4 << 30) - (HIGH_MEM_START - EBDA_START));
    }

    #[test]
    fn cmdline_checks() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        assert!(write_cmdline(&mem, "console=ttyS0").is_ok());
        assert!(write_cmdline(&mem, "a\0b").is_err());
        assert!(write_cmdline(&mem, &"x".repeat(CMDLINE_MAX + 1)).is_err());
    }
}
