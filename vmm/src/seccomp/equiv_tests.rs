//! The search-tree programs ([`super::bpf`]) against seccompiler's linear
//! chains of the same rules: both run through a small classic-BPF
//! interpreter (the subset seccomp filters use), for every syscall number
//! 0..=512 and for the argument-checked syscalls' matching and
//! non-matching arguments. Also counts the instructions each runs.

use std::collections::BTreeMap;

use seccompiler::{
    SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond,
    SeccompFilter, SeccompRule, TargetArch, sock_filter,
};

use super::ThreadKind;
use super::bpf::{AUDIT_ARCH_X86_64, Rules};
use super::rules;

const KINDS: [ThreadKind; 4] = [
    ThreadKind::Vcpu,
    ThreadKind::Device,
    ThreadKind::Scheduler,
    ThreadKind::Runtime,
];

/// `struct seccomp_data`.
#[derive(Clone, Copy, Debug)]
struct Data {
    nr: u32,
    arch: u32,
    ip: u64,
    args: [u64; 6],
}

impl Data {
    fn new(nr: u32) -> Self {
        Self {
            nr,
            arch: AUDIT_ARCH_X86_64,
            ip: 0x7f00_1234_5678,
            args: [0; 6],
        }
    }

    /// The 32-bit word at byte offset `off` (little-endian, as the kernel
    /// lays the struct out on x86-64).
    fn word(&self, off: u32) -> u32 {
        let half = |v: u64, hi: bool| if hi { (v >> 32) as u32 } else { v as u32 };
        match off {
            0 => self.nr,
            4 => self.arch,
            8 | 12 => half(self.ip, off == 12),
            16..=60 if off.is_multiple_of(4) => {
                let i = ((off - 16) / 8) as usize;
                half(self.args[i], off % 8 == 4)
            }
            _ => panic!("load at offset {off}"),
        }
    }
}

/// Runs `prog` on `d`: (return value, instructions executed).
fn run(prog: &[sock_filter], d: &Data) -> (u32, usize) {
    let mut a: u32 = 0;
    let mut pc = 0usize;
    let mut steps = 0;
    loop {
        let i = prog
            .get(pc)
            .unwrap_or_else(|| panic!("pc {pc} past the end"));
        steps += 1;
        pc += 1;
        let class = i.code & 0x07;
        match class {
            0x00 => {
                assert_eq!(i.code, 0x20, "only LD|W|ABS");
                a = d.word(i.k);
            }
            0x04 => {
                assert_eq!(i.code, 0x54, "only ALU|AND|K");
                a &= i.k;
            }
            0x05 => {
                let op = i.code & 0xf0;
                assert_eq!(i.code & 0x08, 0, "only K operands");
                if op == 0x00 {
                    pc += i.k as usize;
                    continue;
                }
                let taken = match op {
                    0x10 => a == i.k,
                    0x20 => a > i.k,
                    0x30 => a >= i.k,
                    0x40 => a & i.k != 0,
                    _ => panic!("jump op {op:#x}"),
                };
                pc += usize::from(if taken { i.jt } else { i.jf });
            }
            0x06 => {
                assert_eq!(i.code, 0x06, "only RET|K");
                return (i.k, steps);
            }
            _ => panic!("instruction class {class:#x}"),
        }
    }
}

/// The same rules in seccompiler's types.
fn to_seccompiler(r: &Rules) -> BTreeMap<i64, Vec<SeccompRule>> {
    r.iter()
        .map(|(&nr, chain)| {
            let chain = chain
                .iter()
                .map(|rule| {
                    let conds = rule
                        .iter()
                        .map(|c| {
                            let op = if c.mask == u32::MAX {
                                Op::Eq
                            } else {
                                Op::MaskedEq(u64::from(c.mask))
                            };
                            Cond::new(c.arg, Len::Dword, op, u64::from(c.value)).unwrap()
                        })
                        .collect();
                    SeccompRule::new(conds).unwrap()
                })
                .collect();
            (nr, chain)
        })
        .collect()
}

fn seccompiler_program(r: &Rules) -> Vec<sock_filter> {
    SeccompFilter::new(
        to_seccompiler(r),
        SeccompAction::Trap,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .unwrap()
    .try_into()
    .unwrap()
}

/// Argument sets for syscall `nr` with `rules`: each rule satisfied (with
/// junk in the high words and in the bits its masks ignore), and each of
/// its checks broken in turn.
fn cases(nr: u32, chain: &[super::bpf::Rule]) -> Vec<Data> {
    let mut out = Vec::new();
    for (n, rule) in chain.iter().enumerate() {
        let mut d = Data::new(nr);
        for c in rule {
            let junk = 0x9e37_79b9u32.rotate_left(n as u32 + u32::from(c.arg));
            let low = c.value | (junk & !c.mask);
            d.args[usize::from(c.arg)] = 0xdead_beef_0000_0000 | u64::from(low);
        }
        out.push(d);
        for c in rule {
            let mut bad = d;
            // A bit the check compares, flipped.
            let bit = 1u32 << c.mask.trailing_zeros().min(31);
            let i = usize::from(c.arg);
            bad.args[i] ^= u64::from(bit);
            out.push(bad);
            // The right low word in the high half only.
            let mut high = Data::new(nr);
            high.args[i] = u64::from(c.value) << 32 | u64::from(!c.value & c.mask);
            out.push(high);
        }
    }
    out
}

#[test]
fn search_tree_gives_seccompilers_verdicts() {
    for kind in KINDS {
        let rules = rules::rules(kind);
        let ours = rules::compile(kind).unwrap();
        let theirs = seccompiler_program(&rules);
        let mut data: Vec<Data> = (0..=512u32).map(Data::new).collect();
        for nr in [0x4000_0000u32, 0x4000_0010, 0x7fff_ffff, u32::MAX] {
            data.push(Data::new(nr));
        }
        for d in data.clone() {
            let mut ones = d;
            ones.args = [u64::MAX; 6];
            data.push(ones);
            let mut foreign = d;
            foreign.arch = 0x4000_0003; // AUDIT_ARCH_I386
            data.push(foreign);
        }
        for (&nr, chain) in &rules {
            data.extend(cases(nr as u32, chain));
        }
        let (mut allowed, mut checked) = (0, 0);
        for d in &data {
            let (a, _) = run(&ours, d);
            let (b, _) = run(&theirs, d);
            assert_eq!(a, b, "{kind:?}: verdicts differ for {d:x?}");
            allowed += usize::from(a == libc::SECCOMP_RET_ALLOW);
            checked += 1;
        }
        assert!(
            allowed > 0 && allowed < checked,
            "{kind:?}: {allowed}/{checked}"
        );
    }
}

#[test]
fn search_tree_runs_few_instructions_per_syscall() {
    for kind in KINDS {
        let rules = rules::rules(kind);
        let ours = rules::compile(kind).unwrap();
        let theirs = seccompiler_program(&rules);
        let cost = |p: &[sock_filter]| {
            let v: Vec<usize> = (0..=512u32).map(|nr| run(p, &Data::new(nr)).1).collect();
            let max = v.iter().copied().max().unwrap_or(0);
            (v.iter().sum::<usize>() as f64 / v.len() as f64, max)
        };
        let (o_avg, o_max) = cost(&ours);
        let (t_avg, t_max) = cost(&theirs);
        println!(
            "{kind:?}: {} syscalls; ours {} instructions, {o_avg:.1} run per syscall \
             (max {o_max}); seccompiler {} instructions, {t_avg:.1} (max {t_max})",
            rules.len(),
            ours.len(),
            theirs.len()
        );
        // A syscall without argument checks: the architecture (2), the
        // number (1), one JGE per level, at most 4 JEQs, the return, and a
        // few far-jump JAs.
        let depth = (rules.len() as f64 / 4.0).log2().ceil() as usize;
        for nr in 0..=512u32 {
            if rules.get(&i64::from(nr)).is_some_and(|c| !c.is_empty()) {
                continue;
            }
            let (_, steps) = run(&ours, &Data::new(nr));
            assert!(
                steps <= 3 + depth + 4 + 1 + 3,
                "{kind:?}: syscall {nr}: {steps}"
            );
        }
        assert!(o_avg * 3.0 < t_avg, "{kind:?}: {o_avg} vs {t_avg}");
    }
}
