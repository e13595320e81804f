#!/usr/bin/env python3
"""Writes the symbol-ordering file of the `corral` binary (api/boot-order.txt).

    scripts/boot-order.py MAP BINARY CALLGRIND_OUT... > api/boot-order.txt

MAP is lld's link map of BINARY (`CORRAL_LINK_MAP=PATH cargo build --release
-p corral-api`, see api/build.rs), each CALLGRIND_OUT a `valgrind
--tool=callgrind --dump-instr=yes` profile of BINARY (scripts/boot-order makes
them: from exec to PROBE-UP, and the seccomp set-up that valgrind cannot run). Prints one symbol per input section of `.text` that executed at
least one instruction, in the order of the current layout, so that lld puts
all of them at the start of `.text` (`--symbol-ordering-file`). See
ARCHITECTURE.md, "Static linking".
"""

import re
import struct
import sys

# lld's map: VMA LMA SIZE ALIGN, then the name indented by 0 (output
# section), 8 (input section) or 16 (symbol) spaces.
LINE = re.compile(r"^\s*([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+) (\s*)(\S.*)$")

# glibc's string functions are ifuncs: the variant a run picks depends on the
# CPU (valgrind has no AVX-512, the host may), so a hot variant brings every
# variant of the same function along.
MULTIARCH = re.compile(r"^(__(?:mem|str|stp|wmem|wcs|raw)[a-z0-9]*?)_(?:sse|ssse|avx|evex|erms|unaligned)")


def elf_entry_and_text(path):
    """(e_entry, start, end) of the binary's `.text`."""
    with open(path, "rb") as f:
        data = f.read()
    (e_entry,) = struct.unpack_from("<Q", data, 0x18)
    (e_shoff,) = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    shdrs = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    stroff = shdrs[e_shstrndx][4]
    for sh in shdrs:
        name = data[stroff + sh[0] : data.index(b"\0", stroff + sh[0])]
        if name == b".text":
            return e_entry, sh[3], sh[3] + sh[5]
    sys.exit("boot-order: no .text in " + path)


def input_sections(map_path):
    """[(start, end, [symbols])] of the input sections of `.text`, by address."""
    out, cur, sections = None, None, []
    with open(map_path) as f:
        for line in f:
            m = LINE.match(line)
            if not m:
                continue
            vma, size, indent, name = int(m.group(1), 16), int(m.group(3), 16), len(m.group(5)), m.group(6)
            if indent == 0:
                out = name
                cur = None
            elif out != ".text":
                continue
            elif indent == 8:
                cur = (vma, vma + size, [])
                sections.append(cur)
            elif indent >= 16 and cur is not None:
                cur[2].append(name.strip())
    return sections


def executed(cg_path):
    """Every instruction address that has a cost line in the profile."""
    addrs = set()
    with open(cg_path) as f:
        for line in f:
            if line.startswith("0x"):
                addrs.add(int(line.split()[0], 16))
    return addrs


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    map_path, binary = sys.argv[1:3]
    entry, lo, hi = elf_entry_and_text(binary)
    text = set()
    for cg_path in sys.argv[3:]:
        addrs = executed(cg_path)
        # valgrind loads a static-pie at its own base: the one at which the
        # entry point executed and most addresses fall into `.text`.
        bases = {a - entry for a in addrs if (a - entry) % 4096 == 0}
        if not bases:
            sys.exit(f"boot-order: the entry point never ran in {cg_path}")
        base = max(bases, key=lambda b: sum(1 for a in addrs if lo <= a - b < hi))
        text |= {a - base for a in addrs if lo <= a - base < hi}
    text = sorted(text)
    sections = input_sections(map_path)
    hot, i = [], 0
    for start, end, syms in sections:
        while i < len(text) and text[i] < start:
            i += 1
        if i < len(text) and text[i] < end and syms:
            hot.append(syms)
    names = []
    seen = set()

    def add(n):
        if n not in seen:
            seen.add(n)
            names.append(n)

    families = set()
    for syms in hot:
        add(syms[0])
        for s in syms:
            m = MULTIARCH.match(s)
            if m:
                families.add(m.group(1) + "_")
    for _, _, syms in sections:
        for s in syms:
            if any(s.startswith(f) for f in families):
                add(s)
                break
    size = sum(e - s for s, e, syms in sections if syms and syms[0] in seen)
    print(
        f"boot-order: {len(text)} instructions in {len(hot)} of {len(sections)} sections "
        f"({size // 1024} KiB of {(hi - lo) // 1024} KiB of .text), {len(names)} symbols",
        file=sys.stderr,
    )
    for n in names:
        print(n)


main()
