//! A small encoder for the subset of AML (ACPI 6.5, chapter 20) and of the
//! resource descriptors (6.4) that corral's DSDT needs: names, scopes,
//! devices, integers, strings, EISA ids, packages and resource templates
//! with IO, Memory32Fixed and extended Interrupt descriptors.
//!
//! Every builder returns the encoded bytes; callers concatenate them into
//! term lists. Names are produced by corral itself, so an invalid one is a
//! programming error and panics.

const ZERO_OP: u8 = 0x00;
const ONE_OP: u8 = 0x01;
const NAME_OP: u8 = 0x08;
const BYTE_PREFIX: u8 = 0x0a;
const WORD_PREFIX: u8 = 0x0b;
const DWORD_PREFIX: u8 = 0x0c;
const STRING_PREFIX: u8 = 0x0d;
const QWORD_PREFIX: u8 = 0x0e;
const SCOPE_OP: u8 = 0x10;
const BUFFER_OP: u8 = 0x11;
const PACKAGE_OP: u8 = 0x12;
const DUAL_NAME_PREFIX: u8 = 0x2e;
const MULTI_NAME_PREFIX: u8 = 0x2f;
const ROOT_CHAR: u8 = b'\\';
const EXT_OP_PREFIX: u8 = 0x5b;
const DEVICE_OP: u8 = 0x82;
const METHOD_OP: u8 = 0x14;
const OP_REGION_OP: u8 = 0x80;
const FIELD_OP: u8 = 0x81;
const IF_OP: u8 = 0xa0;
const AND_OP: u8 = 0x7b;
const NOTIFY_OP: u8 = 0x86;
const NULL_NAME: u8 = 0x00;
const ONES_OP: u8 = 0xff;

/// One 4-character name segment: `[A-Z_][A-Z0-9_]{0,3}`, padded with `_`.
fn name_seg(s: &str) -> [u8; 4] {
    let b = s.as_bytes();
    assert!(
        !b.is_empty()
            && b.len() <= 4
            && (b[0].is_ascii_uppercase() || b[0] == b'_')
            && b.iter()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == b'_'),
        "invalid AML name segment {s:?}"
    );
    let mut seg = [b'_'; 4];
    seg[..b.len()].copy_from_slice(b);
    seg
}

/// A NameString: an optional root prefix `\` and dot-separated segments.
pub fn name_string(path: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let rest = match path.strip_prefix('\\') {
        Some(r) => {
            out.push(ROOT_CHAR);
            r
        }
        None => path,
    };
    let segs: Vec<[u8; 4]> = if rest.is_empty() {
        Vec::new()
    } else {
        rest.split('.').map(name_seg).collect()
    };
    match segs.len() {
        0 => out.push(0), // NullName (only meaningful after the root prefix)
        1 => {}
        2 => out.push(DUAL_NAME_PREFIX),
        n => {
            out.push(MULTI_NAME_PREFIX);
            out.push(u8::try_from(n).expect("at most 255 name segments"));
        }
    }
    for s in segs {
        out.extend_from_slice(&s);
    }
    out
}

/// PkgLength (20.2.4) of a package whose contents (after the PkgLength
/// itself) are `body_len` bytes. The encoded length counts its own bytes.
pub fn pkg_length(body_len: usize) -> Vec<u8> {
    if body_len + 1 < 0x40 {
        return vec![(body_len + 1) as u8];
    }
    for extra in 1..=3usize {
        let total = body_len + 1 + extra;
        if total < 1 << (4 + 8 * extra) {
            let mut out = vec![((extra as u8) << 6) | (total & 0xf) as u8];
            for i in 0..extra {
                out.push((total >> (4 + 8 * i)) as u8);
            }
            return out;
        }
    }
    panic!("AML package of {body_len} bytes is too long");
}

fn with_pkg_length(op: &[u8], body: Vec<u8>) -> Vec<u8> {
    let mut out = op.to_vec();
    out.extend(pkg_length(body.len()));
    out.extend(body);
    out
}

/// An integer constant, in its shortest encoding.
pub fn integer(v: u64) -> Vec<u8> {
    match v {
        0 => vec![ZERO_OP],
        1 => vec![ONE_OP],
        u64::MAX => vec![ONES_OP],
        v if v <= 0xff => vec![BYTE_PREFIX, v as u8],
        v if v <= 0xffff => {
            let mut o = vec![WORD_PREFIX];
            o.extend((v as u16).to_le_bytes());
            o
        }
        v if v <= 0xffff_ffff => dword(v as u32),
        v => {
            let mut o = vec![QWORD_PREFIX];
            o.extend(v.to_le_bytes());
            o
        }
    }
}

/// A DWordConst, whatever the value (EISA ids are always DWords).
fn dword(v: u32) -> Vec<u8> {
    let mut o = vec![DWORD_PREFIX];
    o.extend(v.to_le_bytes());
    o
}

/// A null-terminated ASCII string.
pub fn string(s: &str) -> Vec<u8> {
    assert!(
        s.bytes().all(|b| (1..=0x7f).contains(&b)),
        "AML strings are ASCII without NUL: {s:?}"
    );
    let mut o = vec![STRING_PREFIX];
    o.extend_from_slice(s.as_bytes());
    o.push(0);
    o
}

/// The compressed 32-bit form of a 7-character EISA/PNP id such as
/// `PNP0501` (what ASL's `EisaId()` produces).
pub fn eisa_id(id: &str) -> Vec<u8> {
    let b = id.as_bytes();
    assert!(
        b.len() == 7
            && b[..3].iter().all(u8::is_ascii_uppercase)
            && b[3..].iter().all(u8::is_ascii_hexdigit),
        "invalid EISA id {id:?}"
    );
    let letters = b[..3]
        .iter()
        .fold(0u32, |acc, c| (acc << 5) | u32::from(c - 0x40));
    let product = u32::from_str_radix(&id[3..], 16).expect("checked hex digits");
    // Vendor letters in the top 15 bits (bit 31 clear), product below, the
    // whole stored big-endian.
    dword(((letters << 16) | product).swap_bytes())
}

/// `Name (path, data)`.
pub fn name(path: &str, data: Vec<u8>) -> Vec<u8> {
    let mut o = vec![NAME_OP];
    o.extend(name_string(path));
    o.extend(data);
    o
}

/// `Scope (path) { terms }`.
pub fn scope(path: &str, terms: Vec<u8>) -> Vec<u8> {
    let mut body = name_string(path);
    body.extend(terms);
    with_pkg_length(&[SCOPE_OP], body)
}

/// `Device (name) { terms }`.
pub fn device(path: &str, terms: Vec<u8>) -> Vec<u8> {
    let mut body = name_string(path);
    body.extend(terms);
    with_pkg_length(&[EXT_OP_PREFIX, DEVICE_OP], body)
}

/// `Package () { elements }` (at most 255 elements).
pub fn package(elements: &[Vec<u8>]) -> Vec<u8> {
    let mut body = vec![u8::try_from(elements.len()).expect("at most 255 package elements")];
    for e in elements {
        body.extend_from_slice(e);
    }
    with_pkg_length(&[PACKAGE_OP], body)
}

/// `Buffer () { bytes }`.
pub fn buffer(bytes: &[u8]) -> Vec<u8> {
    let mut body = integer(bytes.len() as u64);
    body.extend_from_slice(bytes);
    with_pkg_length(&[BUFFER_OP], body)
}

/// `ResourceTemplate () { descriptors }`: a buffer of resource descriptors
/// closed by an End Tag (checksum 0: "treat as valid", as iasl emits it).
pub fn resource_template(descriptors: &[Vec<u8>]) -> Vec<u8> {
    let mut bytes: Vec<u8> = descriptors.concat();
    bytes.extend_from_slice(&[0x79, 0x00]);
    buffer(&bytes)
}

/// `IO (Decode16, base, base, 1, len)`: a fixed 16-bit-decoded port range
/// (small descriptor 0x47, 6.4.2.5).
pub fn io16(base: u16, len: u8) -> Vec<u8> {
    let mut o = vec![0x47, 0x01];
    o.extend(base.to_le_bytes()); // minimum
    o.extend(base.to_le_bytes()); // maximum
    o.push(1); // alignment
    o.push(len);
    o
}

/// `Memory32Fixed (ReadWrite, base, len)` (large descriptor 0x86, 6.4.3.4).
pub fn memory32_fixed(base: u32, len: u32) -> Vec<u8> {
    let mut o = vec![0x86];
    o.extend(9u16.to_le_bytes());
    o.push(0x01); // read-write
    o.extend(base.to_le_bytes());
    o.extend(len.to_le_bytes());
    o
}

/// Trigger mode of an interrupt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// Edge-triggered.
    Edge,
    /// Level-triggered.
    Level,
}

/// `Interrupt (ResourceConsumer, trigger, ActiveHigh, Exclusive) { gsi }`
/// (extended interrupt descriptor 0x89, 6.4.3.6). Linux takes the trigger
/// and polarity of extended descriptors from `_CRS` as they are, without
/// applying ISA overrides.
pub fn interrupt(trigger: Trigger, gsi: u32) -> Vec<u8> {
    let mut o = vec![0x89];
    o.extend(6u16.to_le_bytes());
    // Bit 0 consumer, bit 1 edge, bit 2 active low (0), bit 3 shared (0).
    let flags = 0x01 | if trigger == Trigger::Edge { 0x02 } else { 0 };
    o.push(flags);
    o.push(1); // one interrupt in the table
    o.extend(gsi.to_le_bytes());
    o
}

/// `Method (name, args, NotSerialized) { terms }`.
pub fn method(name: &str, args: u8, terms: Vec<u8>) -> Vec<u8> {
    let mut body = name_string(name);
    body.push(args & 0x7);
    body.extend(terms);
    with_pkg_length(&[METHOD_OP], body)
}

/// `OperationRegion (name, SystemIO, base, len)`.
pub fn system_io_region(name: &str, base: u16, len: u16) -> Vec<u8> {
    const SYSTEM_IO: u8 = 0x01;
    let mut o = vec![EXT_OP_PREFIX, OP_REGION_OP];
    o.extend(name_string(name));
    o.push(SYSTEM_IO);
    o.extend(integer(u64::from(base)));
    o.extend(integer(u64::from(len)));
    o
}

/// `Field (region, ByteAcc, NoLock, Preserve) { name, 8, ... }`: byte-wide
/// fields, one per name (4-character name segments).
pub fn byte_fields(region: &str, names: &[&str]) -> Vec<u8> {
    const BYTE_ACC: u8 = 0x01;
    let mut body = name_string(region);
    body.push(BYTE_ACC);
    for n in names {
        let seg = n.as_bytes();
        assert!(seg.len() == 4, "field names are one 4-character segment");
        body.extend_from_slice(seg);
        body.push(8); // width in bits, a one-byte PkgLength
    }
    with_pkg_length(&[EXT_OP_PREFIX, FIELD_OP], body)
}

/// `If (predicate) { terms }`.
pub fn if_(predicate: Vec<u8>, terms: Vec<u8>) -> Vec<u8> {
    let mut body = predicate;
    body.extend(terms);
    with_pkg_length(&[IF_OP], body)
}

/// `And (a, b)` with no target (its value is the result).
pub fn and(a: Vec<u8>, b: Vec<u8>) -> Vec<u8> {
    let mut o = vec![AND_OP];
    o.extend(a);
    o.extend(b);
    o.push(NULL_NAME);
    o
}

/// A reference to a named object (a field, a device) as an operand.
pub fn path(path: &str) -> Vec<u8> {
    name_string(path)
}

/// `Notify (object, value)`.
pub fn notify(object: &str, value: u64) -> Vec<u8> {
    let mut o = vec![NOTIFY_OP];
    o.extend(name_string(object));
    o.extend(integer(value));
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pkg_lengths() {
        assert_eq!(pkg_length(0), vec![1]);
        assert_eq!(pkg_length(0x3e), vec![0x3f]);
        // 0x3f + 2 = 0x41: two bytes, low nibble 1, then 0x04.
        assert_eq!(pkg_length(0x3f), vec![0x41, 0x04]);
        assert_eq!(pkg_length(0xffd), vec![0x4f, 0xff]);
        assert_eq!(pkg_length(0xffe), vec![0x81, 0x00, 0x01]);
        assert_eq!(pkg_length(0x1000), vec![0x83, 0x00, 0x01]);
    }

    #[test]
    fn integers() {
        assert_eq!(integer(0), [0x00]);
        assert_eq!(integer(1), [0x01]);
        assert_eq!(integer(5), [0x0a, 5]);
        assert_eq!(integer(0x3f8), [0x0b, 0xf8, 0x03]);
        assert_eq!(integer(0xd000_0000), [0x0c, 0, 0, 0, 0xd0]);
        assert_eq!(integer(1 << 32), [0x0e, 0, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(integer(u64::MAX), [0xff]);
    }

    #[test]
    fn eisa_ids() {
        // iasl: EisaId ("PNP0501") == 0x0105D041, EisaId ("PNP0A03") == 0x030AD041.
        assert_eq!(eisa_id("PNP0501"), [0x0c, 0x41, 0xd0, 0x05, 0x01]);
        assert_eq!(eisa_id("PNP0A03"), [0x0c, 0x41, 0xd0, 0x0a, 0x03]);
    }

    #[test]
    fn names() {
        assert_eq!(name_string("COM1"), b"COM1");
        assert_eq!(name_string("_S5"), b"_S5_");
        assert_eq!(name_string("\\_SB"), b"\\_SB_");
        assert_eq!(name_string("\\_SB.V000"), b"\\\x2e_SB_V000");
        assert_eq!(name_string("\\A.B.C"), b"\\\x2f\x03A___B___C___");
        assert_eq!(
            name("_HID", string("LNRO0005")),
            b"\x08_HID\x0dLNRO0005\x00"
        );
    }

    #[test]
    #[should_panic(expected = "invalid AML name segment")]
    fn bad_name() {
        name_string("0ABC");
    }

    #[test]
    fn s5_package() {
        // Name (_S5_, Package () { 5, 0, 0, 0 }) as iasl encodes it.
        let p = name(
            "_S5_",
            package(&[integer(5), integer(0), integer(0), integer(0)]),
        );
        assert_eq!(
            p,
            [
                0x08, b'_', b'S', b'5', b'_', 0x12, 0x07, 0x04, 0x0a, 0x05, 0x00, 0x00, 0x00
            ]
        );
    }

    #[test]
    fn resources() {
        let rt = resource_template(&[io16(0x3f8, 8), interrupt(Trigger::Edge, 4)]);
        assert_eq!(
            rt,
            [
                0x11, 0x16, 0x0a, 0x13, // Buffer, PkgLength, size 19
                0x47, 0x01, 0xf8, 0x03, 0xf8, 0x03, 0x01, 0x08, // IO
                0x89, 0x06, 0x00, 0x03, 0x01, 0x04, 0x00, 0x00, 0x00, // Interrupt
                0x79, 0x00, // End tag
            ]
        );
        assert_eq!(
            memory32_fixed(0xd000_0000, 0x1000),
            [0x86, 0x09, 0x00, 0x01, 0, 0, 0, 0xd0, 0, 0x10, 0, 0]
        );
        assert_eq!(interrupt(Trigger::Level, 5)[3], 0x01);
    }
}
