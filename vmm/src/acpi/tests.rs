//! Table tests: structure checks in Rust, then the tables dumped from guest
//! memory and disassembled by ACPICA's `iasl` (and loaded into `acpiexec`,
//! the same interpreter Linux runs).

use std::path::{Path, PathBuf};
use std::process::Command;

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::*;

fn sum(b: &[u8]) -> u8 {
    b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
}

fn windows(n: usize) -> Vec<VirtioMmioWindow> {
    (0..n)
        .map(|i| VirtioMmioWindow {
            base: crate::layout::VIRTIO_MMIO_BASE + 0x1000 * i as u64,
            size: 0x1000,
            irq: 5 + i as u32,
        })
        .collect()
}

fn params(cpus: u8, devices: usize) -> AcpiParams {
    AcpiParams {
        cpus,
        virtio_mmio: windows(devices),
        serial: true,
    }
}

fn guest_mem() -> GuestMemoryMmap {
    GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap()
}

/// Reads a whole table (length from its header) from guest memory.
fn read_table(mem: &GuestMemoryMmap, addr: u64) -> Vec<u8> {
    let mut hdr = [0u8; 8];
    mem.read_slice(&mut hdr, GuestAddress(addr)).unwrap();
    let len = u32_at(&hdr, 4) as usize;
    assert!((36..=0x2_0000).contains(&len), "table length {len:#x}");
    let mut t = vec![0u8; len];
    mem.read_slice(&mut t, GuestAddress(addr)).unwrap();
    t
}

/// Walks the tables from the RSDP, as a kernel does: (signature, bytes).
fn dump(mem: &GuestMemoryMmap, rsdp_addr: u64) -> Vec<(String, Vec<u8>)> {
    let mut rsdp = vec![0u8; RSDP_LEN];
    mem.read_slice(&mut rsdp, GuestAddress(rsdp_addr)).unwrap();
    assert_eq!(&rsdp[..8], b"RSD PTR ");
    let xsdt = read_table(mem, u64_at(&rsdp, 24));
    let mut out = vec![
        ("RSDP".to_string(), rsdp),
        ("XSDT".to_string(), xsdt.clone()),
    ];
    for off in (HEADER_LEN..xsdt.len()).step_by(8) {
        let t = read_table(mem, u64_at(&xsdt, off));
        let sig = String::from_utf8_lossy(&t[..4]).into_owned();
        if sig == "FACP" {
            let dsdt = read_table(mem, u64_at(&t, 140));
            out.push(("DSDT".to_string(), dsdt));
        }
        out.push((sig, t));
    }
    out
}

#[test]
fn checksums_lengths_and_pointers() {
    for (cpus, devices) in [(1u8, 0usize), (2, 1), (4, 3), (8, 19), (MAX_CPUS, 18)] {
        let p = AcpiParams {
            serial: devices != 19, // 19 devices use IRQs 5..23, 4 stays free
            ..params(cpus, devices)
        };
        let tables = build(&p).unwrap();
        let sigs: Vec<&str> = tables.iter().map(Table::signature).collect();
        assert_eq!(sigs, ["RSD PTR ", "XSDT", "FACP", "APIC", "DSDT"]);
        let addr = |sig: &str| tables.iter().find(|t| t.signature() == sig).unwrap().addr;

        let rsdp = &tables[0].bytes;
        assert_eq!(tables[0].addr, RSDP_ADDR);
        assert_eq!(rsdp.len(), 36);
        assert_eq!(sum(&rsdp[..20]), 0, "RSDP checksum");
        assert_eq!(sum(rsdp), 0, "RSDP extended checksum");
        assert_eq!(rsdp[15], 2, "RSDP revision");
        assert_eq!(u32_at(rsdp, 20), 36);
        assert_eq!(u64_at(rsdp, 24), addr("XSDT"));

        for t in &tables[1..] {
            assert_eq!(
                u32_at(&t.bytes, 4) as usize,
                t.bytes.len(),
                "{}",
                t.signature()
            );
            assert_eq!(sum(&t.bytes), 0, "{} checksum", t.signature());
            assert_eq!(&t.bytes[10..16], b"CORRAL");
            assert_eq!(t.addr % 16, 0);
        }
        // No overlaps, all inside the reserved BIOS area.
        for w in tables.windows(2) {
            assert!(w[0].addr + w[0].bytes.len() as u64 <= w[1].addr);
        }
        let last = tables.last().unwrap();
        assert!(last.addr + last.bytes.len() as u64 <= TABLES_END);

        let xsdt = &tables[1].bytes;
        let entries: Vec<u64> = (36..xsdt.len())
            .step_by(8)
            .map(|o| u64_at(xsdt, o))
            .collect();
        assert_eq!(entries, [addr("FACP"), addr("APIC")]);

        let fadt = &tables[2].bytes;
        assert_eq!(fadt.len(), 276);
        assert_eq!(fadt[8], 6, "FADT revision");
        assert_eq!(u32_at(fadt, 40), 0, "32-bit DSDT pointer unused");
        assert_eq!(u64_at(fadt, 140), addr("DSDT"), "X_DSDT");
        assert_ne!(u32_at(fadt, 112) & (1 << 20), 0, "HW_REDUCED_ACPI");
        // Sleep control/status: system I/O, 8 bits, at the PM device.
        assert_eq!(fadt[244], 1);
        assert_eq!(u64_at(fadt, 248), u64::from(acpi_pm::PORT_BASE));
        assert_eq!(fadt[256], 1);
        assert_eq!(u64_at(fadt, 260), u64::from(acpi_pm::PORT_BASE) + 1);

        let madt = &tables[3].bytes;
        assert_eq!(u32_at(madt, 36), LAPIC_ADDR as u32);
        assert_eq!(u32_at(madt, 40) & 1, 1, "PCAT_COMPAT");
        let mut off = 44;
        let (mut lapics, mut ioapics) = (Vec::new(), Vec::new());
        while off < madt.len() {
            let (ty, len) = (madt[off], madt[off + 1] as usize);
            assert!(len >= 2 && off + len <= madt.len());
            match ty {
                0 => {
                    assert_eq!(len, 8);
                    assert_eq!(u32_at(madt, off + 4) & 1, 1, "enabled");
                    lapics.push(madt[off + 3]);
                }
                1 => ioapics.push((madt[off + 2], u32_at(madt, off + 4), u32_at(madt, off + 8))),
                4 => assert_eq!(len, 6),
                _ => panic!("unexpected MADT entry type {ty}"),
            }
            off += len;
        }
        assert_eq!(off, madt.len());
        assert_eq!(lapics, (0..cpus).collect::<Vec<_>>());
        assert_eq!(ioapics, [(cpus, IOAPIC_ADDR as u32, 0)]);

        assert_eq!(tables[4].bytes[8], 2, "DSDT revision");
    }
}

#[test]
fn written_tables_match_built_ones() {
    let mem = guest_mem();
    let p = params(2, 2);
    let rsdp = write(&mem, &p).unwrap();
    assert_eq!(rsdp, RSDP_ADDR);
    let built = build(&p).unwrap();
    let dumped = dump(&mem, rsdp);
    assert_eq!(dumped.len(), built.len());
    for t in &built {
        let mut b = vec![0u8; t.bytes.len()];
        mem.read_slice(&mut b, GuestAddress(t.addr)).unwrap();
        assert_eq!(b, t.bytes);
    }
}

#[test]
fn bad_params_refused() {
    let ok = params(2, 2);
    assert!(build(&ok).is_ok());
    let mut p = ok.clone();
    p.cpus = 0;
    assert!(matches!(build(&p), Err(AcpiError::Cpus(0))));
    p.cpus = 255;
    assert!(matches!(build(&p), Err(AcpiError::Cpus(255))));

    let with = |f: &dyn Fn(&mut VirtioMmioWindow)| {
        let mut p = ok.clone();
        f(&mut p.virtio_mmio[1]);
        build(&p)
    };
    assert!(matches!(
        with(&|w| w.size = 0),
        Err(AcpiError::Window { .. })
    ));
    assert!(matches!(
        with(&|w| w.base = 0x1000),
        Err(AcpiError::Window { .. })
    ));
    assert!(matches!(
        with(&|w| w.base = 0xffff_f800),
        Err(AcpiError::Window { .. })
    ));
    assert!(matches!(
        with(&|w| w.base = crate::layout::VIRTIO_MMIO_BASE + 0x800),
        Err(AcpiError::Window { .. })
    ));
    for irq in [0, 2, 4, 5, 24, u32::MAX] {
        assert!(
            matches!(with(&|w| w.irq = irq), Err(AcpiError::Irq { .. })),
            "irq {irq}"
        );
    }
    // Without COM1, IRQ 4 is free.
    let mut p = ok.clone();
    p.serial = false;
    p.virtio_mmio[1].irq = 4;
    assert!(build(&p).is_ok());
    let p = AcpiParams {
        virtio_mmio: vec![windows(1)[0]; MAX_VIRTIO_MMIO + 1],
        ..ok
    };
    assert!(matches!(build(&p), Err(AcpiError::TooManyDevices(_))));
    // The memory write fails cleanly when 0xe0000 is not guest RAM.
    let small = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x8_0000)]).unwrap();
    assert!(matches!(
        write(&small, &params(1, 0)),
        Err(AcpiError::Write(_))
    ));
}

// ---- iasl / acpiexec validation ------------------------------------------

/// Runs an ACPICA tool; a missing tool is a failure, not a skip (CI installs
/// acpica-tools, see .ci/run).
fn acpica(tool: &str, args: &[&str], dir: &Path) -> String {
    let out = Command::new(tool)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `{tool}` ({e}): install ACPICA's tools (Debian/Ubuntu: \
                 `apt-get install acpica-tools`); .ci/run installs them"
            )
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "`{tool} {}` failed ({}):\n{text}",
        args.join(" "),
        out.status
    );
    text
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let p =
            std::env::temp_dir().join(format!("corral-acpi-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // CORRAL_ACPI_KEEP=1 keeps the dumped tables and disassemblies.
        if std::env::var_os("CORRAL_ACPI_KEEP").is_some() {
            eprintln!("kept {}", self.0.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Lines of iasl/acpiexec output that report a problem.
fn problems(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            ["error", "warning", "invalid", "incorrect", "unknown", "mismatch"]
                .iter()
                .any(|w| l.contains(w))
                // iasl's summary line when all is well.
                && !l.contains("0 errors, 0 warnings")
        })
        .collect()
}

/// One device of the disassembled DSDT.
#[derive(Debug, PartialEq, Eq)]
struct AslDevice {
    path: String,
    hid: String,
    uid: u64,
    /// Resource descriptor lines of `_CRS`, normalized.
    resources: Vec<String>,
}

fn parse_int(s: &str) -> u64 {
    let s = s.trim().trim_end_matches(',');
    match s {
        "Zero" => 0,
        "One" => 1,
        "Ones" => u64::MAX,
        _ => match s.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16).unwrap_or_else(|_| panic!("int {s:?}")),
            None => s.parse().unwrap_or_else(|_| panic!("int {s:?}")),
        },
    }
}

/// A line without `// ...` and inline `/* ... */` comments, trimmed.
fn strip_comments(line: &str) -> String {
    let mut l = line.split("//").next().unwrap().to_string();
    while let Some(start) = l.find("/*") {
        match l[start..].find("*/") {
            Some(end) => l.replace_range(start..start + end + 2, ""),
            None => break, // a block comment's first line: dropped by the caller
        }
    }
    l.trim().to_string()
}

/// Extracts the devices, their `_HID`, `_UID` and `_CRS` from iasl's
/// disassembly; and the `_S5_` package's elements.
fn parse_dsdt(dsl: &str) -> (Vec<AslDevice>, Vec<u64>) {
    let lines: Vec<String> = dsl
        .lines()
        .map(strip_comments)
        .filter(|l| !l.is_empty() && !l.starts_with("/*") && !l.starts_with('*'))
        .collect();
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let mut devices = Vec::new();
    let mut scopes: Vec<(String, usize)> = Vec::new(); // (name, depth at open)
    let mut depth = 0usize;
    let mut pending: Option<String> = None;
    let mut s5 = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i];
        if let Some(rest) = l
            .strip_prefix("Scope (")
            .or_else(|| l.strip_prefix("Device ("))
        {
            pending = Some(rest.trim_end_matches(')').to_string());
            if l.starts_with("Device") {
                devices.push(AslDevice {
                    path: {
                        let mut p: Vec<String> = scopes.iter().map(|s| s.0.clone()).collect();
                        p.push(rest.trim_end_matches(')').to_string());
                        p.join(".")
                    },
                    hid: String::new(),
                    uid: u64::MAX,
                    resources: Vec::new(),
                });
            }
        } else if l == "{" {
            depth += 1;
            if let Some(n) = pending.take() {
                scopes.push((n, depth));
            }
        } else if l.starts_with('}') {
            if scopes.last().is_some_and(|s| s.1 == depth) {
                scopes.pop();
            }
            depth -= 1;
        } else if let Some(rest) = l.strip_prefix("Name (_HID, ") {
            let d = devices.last_mut().expect("_HID outside a device");
            d.hid = rest.trim_end_matches(')').trim().to_string();
        } else if let Some(rest) = l.strip_prefix("Name (_UID, ") {
            let d = devices.last_mut().expect("_UID outside a device");
            d.uid = parse_int(rest.trim_end_matches(')'));
        } else if l.starts_with("Name (_S5, Package") || l.starts_with("Name (_S5_, Package") {
            // Elements follow between braces, one or more per line.
            let mut j = i + 1;
            assert_eq!(lines[j], "{");
            j += 1;
            while !lines[j].starts_with('}') {
                s5.extend(
                    lines[j]
                        .split(',')
                        .filter(|e| !e.trim().is_empty())
                        .map(parse_int),
                );
                j += 1;
            }
            i = j + 1; // past the package's closing brace
            continue;
        } else if l.starts_with("Memory32Fixed (")
            || l.starts_with("IO (")
            || l.starts_with("Interrupt (")
        {
            let d = devices.last_mut().expect("resource outside a device");
            // A descriptor may continue over several lines up to its ")".
            let mut text = l.to_string();
            let mut j = i;
            while !text.ends_with(')') {
                j += 1;
                text.push(' ');
                text.push_str(lines[j]);
            }
            if text.starts_with("Interrupt") {
                // The interrupt list follows in braces.
                assert_eq!(lines[j + 1], "{");
                let mut irqs = Vec::new();
                j += 2;
                while !lines[j].starts_with('}') {
                    irqs.extend(
                        lines[j]
                            .split(',')
                            .filter(|e| !e.trim().is_empty())
                            .map(parse_int),
                    );
                    j += 1;
                }
                // The list's braces are not scopes: `j` now points at its
                // closing brace, which is skipped with it.
                text.push_str(&format!(" {irqs:?}"));
            }
            d.resources
                .push(text.split_whitespace().collect::<Vec<_>>().join(" "));
            i = j + 1;
            continue;
        }
        i += 1;
    }
    assert_eq!(depth, 0, "unbalanced braces in the disassembly");
    (devices, s5)
}

fn expected_devices(p: &AcpiParams) -> Vec<AslDevice> {
    let mut v = Vec::new();
    if p.serial {
        v.push(AslDevice {
            path: "\\_SB.COM1".into(),
            hid: "EisaId (\"PNP0501\")".into(),
            uid: 1,
            resources: vec![
                "IO (Decode16, 0x03F8, 0x03F8, 0x01, 0x08, )".into(),
                "Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive, ,, ) [4]".into(),
            ],
        });
    }
    for (i, w) in p.virtio_mmio.iter().enumerate() {
        v.push(AslDevice {
            path: format!("\\_SB.V{i:03X}"),
            hid: "\"LNRO0005\"".into(),
            uid: i as u64,
            resources: vec![
                format!(
                    "Memory32Fixed (ReadWrite, {:#010X}, {:#010X}, )",
                    w.base, w.size
                ),
                format!(
                    "Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive, ,, ) [{}]",
                    w.irq
                ),
            ],
        });
    }
    v.push(AslDevice {
        path: "\\_SB.PWRB".into(),
        hid: "EisaId (\"PNP0C0C\")".into(),
        uid: 0,
        resources: vec![],
    });
    v.push(AslDevice {
        path: "\\_SB.GED0".into(),
        hid: "\"ACPI0013\"".into(),
        uid: 0,
        resources: vec![format!(
            "Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive, ,, ) [{}]",
            super::GED_IRQ
        )],
    });
    v
}

/// iasl (as of 20200925) cannot disassemble a bare RSDP, but its data table
/// compiler builds one from named fields and computes both checksums. The
/// fields are read from our bytes at the spec's offsets and handed to iasl
/// by name: the result must be byte-identical, so a field at a wrong offset
/// or a wrong checksum is caught.
fn check_rsdp_with_iasl(rsdp: &[u8], dir: &Path) {
    let src = format!(
        "[0008] Signature : \"{}\"\n\
         [0001] Checksum : 00\n\
         [0006] Oem ID : \"{}\"\n\
         [0001] Revision : {:02X}\n\
         [0004] RSDT Address : {:08X}\n\
         [0004] Length : {:08X}\n\
         [0008] XSDT Address : {:016X}\n\
         [0001] Extended Checksum : 00\n\
         [0003] Reserved : 000000\n",
        String::from_utf8_lossy(&rsdp[0..8]),
        String::from_utf8_lossy(&rsdp[9..15]),
        rsdp[15],
        u32_at(rsdp, 16),
        u32_at(rsdp, 20),
        u64_at(rsdp, 24),
    );
    std::fs::write(dir.join("rsdp-ref.asl"), src).unwrap();
    let out = acpica("iasl", &["rsdp-ref.asl"], dir);
    assert!(out.contains("0 Errors, 0 Warnings"), "{out}");
    let reference = std::fs::read(dir.join("rsdp-ref.aml")).unwrap();
    assert_eq!(reference, rsdp, "iasl's RSDP differs from ours");
}

#[test]
fn iasl_disassembles_tables_from_guest_memory() {
    for (cpus, devices, serial) in [(1u8, 0usize, true), (3, 4, true), (8, 19, false)] {
        let p = AcpiParams {
            cpus,
            virtio_mmio: windows(devices),
            serial,
        };
        let mem = guest_mem();
        let rsdp = write(&mem, &p).unwrap();
        let dir = TempDir::new("iasl");
        let tables = dump(&mem, rsdp);
        let mut files = Vec::new();
        for (sig, bytes) in &tables {
            let f = format!("{}.dat", sig.to_ascii_lowercase());
            std::fs::write(dir.0.join(&f), bytes).unwrap();
            files.push((sig.clone(), f));
        }
        let mut dsl = std::collections::HashMap::new();
        for ((sig, f), (_, bytes)) in files.iter().zip(&tables) {
            if sig == "RSDP" {
                check_rsdp_with_iasl(bytes, &dir.0);
                continue;
            }
            let out = acpica("iasl", &["-d", f], &dir.0);
            let bad = problems(&out);
            assert!(bad.is_empty(), "iasl -d {sig}: {bad:?}\n{out}");
            let text = std::fs::read_to_string(dir.0.join(f.replace(".dat", ".dsl"))).unwrap();
            let bad = problems(&text);
            assert!(bad.is_empty(), "{sig} disassembly: {bad:?}\n{text}");
            dsl.insert(sig.clone(), text);
        }

        // DSDT: exactly the expected devices, resources and _S5_.
        let (found, s5) = parse_dsdt(&dsl["DSDT"]);
        let want = expected_devices(&p);
        assert_eq!(found, want, "DSDT devices; disassembly:\n{}", dsl["DSDT"]);
        assert_eq!(s5, [u64::from(acpi_pm::SLP_TYP_S5), 0, 0, 0]);

        let bytes_of = |sig: &str| &tables.iter().find(|t| t.0 == sig).unwrap().1;
        // FADT as iasl reads it.
        let facp = &dsl["FACP"];
        let field = |name: &str| -> Vec<String> {
            facp.lines()
                .filter_map(|l| {
                    let l = l.split_once(']').map_or(l, |(_, rest)| rest);
                    let (k, v) = l.split_once(':')?;
                    (k.trim() == name).then(|| v.trim().to_string())
                })
                .collect()
        };
        assert_eq!(field("Hardware Reduced (V5)"), ["1"], "{facp}");
        assert_eq!(field("Revision"), ["06"], "{facp}");
        assert_eq!(field("FADT Minor Revision"), ["05"], "{facp}");
        assert_eq!(field("Table Length"), ["00000114"], "{facp}");
        assert_eq!(field("DSDT Address").len(), 2, "{facp}");
        assert_eq!(
            field("DSDT Address")[1],
            format!("{:016X}", u64_at(bytes_of("FACP"), 140)),
            "{facp}"
        );
        // The two GAS blocks for sleep control/status, in order.
        let addrs = field("Address");
        let ctl = format!("{:016X}", acpi_pm::PORT_BASE);
        let sts = format!("{:016X}", acpi_pm::PORT_BASE + 1);
        assert!(
            addrs.windows(2).any(|w| w[0] == ctl && w[1] == sts),
            "sleep registers not found in {addrs:?}\n{facp}"
        );

        // MADT: N local APICs, one IOAPIC.
        let apic = &dsl["APIC"];
        let count = |s: &str| apic.lines().filter(|l| l.contains(s)).count();
        assert_eq!(count("[Processor Local APIC]"), cpus as usize, "{apic}");
        assert_eq!(count("[I/O APIC]"), 1, "{apic}");
        assert_eq!(count("PC-AT Compatibility : 1"), 1, "{apic}");

        // XSDT: the FADT and the MADT.
        let xsdt = &dsl["XSDT"];
        assert_eq!(
            xsdt.lines()
                .filter(|l| l.contains("ACPI Table Address"))
                .count(),
            2,
            "{xsdt}"
        );

        // The DSDT compiles back without errors or warnings.
        let out = acpica("iasl", &["-p", "recompiled", "dsdt.dsl"], &dir.0);
        assert!(
            out.contains("0 Errors, 0 Warnings"),
            "recompiling the DSDT:\n{out}"
        );
    }
}

#[test]
fn acpiexec_loads_tables_and_evaluates_objects() {
    let p = params(2, 2);
    let mem = guest_mem();
    let rsdp = write(&mem, &p).unwrap();
    let dir = TempDir::new("acpiexec");
    let mut files = Vec::new();
    for (sig, bytes) in dump(&mem, rsdp) {
        if sig == "RSDP" || sig == "XSDT" {
            continue; // acpiexec builds its own root tables
        }
        let f = format!("{}.dat", sig.to_ascii_lowercase());
        std::fs::write(dir.0.join(&f), bytes).unwrap();
        files.push(f);
    }
    // `resources` converts each _CRS into ACPICA's resource structures (what
    // Linux does with it) and back, and compares.
    let cmds = "evaluate \\_S5_; evaluate \\_SB.V001._HID; resources \\_SB.V000; \
                resources \\_SB.V001; resources \\_SB.COM1; evaluate \\_SB.GED0._EVT 3; \
                resources \\_SB.GED0";
    let mut args = vec!["-b", cmds];
    args.extend(files.iter().map(String::as_str));
    let out = acpica("acpiexec", &args, &dir.0);
    let bad = problems(&out);
    assert!(bad.is_empty(), "acpiexec: {bad:?}\n{out}");
    assert!(out.contains("LNRO0005"), "{out}");
    assert_eq!(out.matches("Evaluation of").count(), 2, "{out}");
    // The GED's event method runs (reads its event register) without error.
    assert!(
        out.contains("No object was returned from evaluation of \\_SB.GED0._EVT"),
        "{out}"
    );
    let fields: Vec<String> = out
        .lines()
        .filter_map(|l| l.split_once(" : "))
        .map(|(k, v)| format!("{}={}", k.trim(), v.trim()))
        .collect();
    let count = |f: &str| fields.iter().filter(|x| *x == f).count();
    assert_eq!(count("Triggering=Edge"), 4, "{out}");
    assert_eq!(count("Polarity=ActiveHigh"), 4, "{out}");
    assert_eq!(count("Sharing=Exclusive"), 4, "{out}");
    for irq in ["00000003", "00000004", "00000005", "00000006"] {
        assert_eq!(count(&format!("Dword00={irq}")), 1, "{out}");
    }
    assert_eq!(count("Address=D0000000"), 1, "{out}");
    assert_eq!(count("Address=D0001000"), 1, "{out}");
    assert_eq!(count("Address Length=00001000"), 2, "{out}");
    assert_eq!(count("Address Minimum=03F8"), 1, "{out}");
    assert_eq!(count("Address Length=08"), 1, "{out}");
}
