//! # corral-scheduler: classes, shares, caps, reservations
//!
//! This crate divides host CPU among VMs. It knows nothing about KVM: it
//! takes time and per-VM CPU usage as inputs and answers which VMs must be
//! *parked* (held off the CPU). The VMM supplies the clock, measures usage
//! (thread CPU clocks of the vCPU threads) and enforces the answers with a
//! [`Gate`] per VM.
//!
//! * [`model`]: capacity, classes ([`ClassSpec`]: shares, cap, reservation)
//!   and VMs ([`VmSpec`]: class, weight, vCPUs), validation and admission
//!   control.
//! * [`policy`]: the pure share policy ([`Policy`]).
//! * [`Scheduler`]: model + policy, the object the daemon keeps.
//! * [`gate`]: the park/unpark primitive vCPU threads wait on.
//! * [`sim`]: a deterministic simulator of N host CPUs and thousands of VMs.
//!
//! ## Units
//!
//! CPU amounts (capacity, caps, reservations, entitlements) are in percent
//! of one host CPU: 150 = 1.5 CPUs. Times are nanoseconds.
//!
//! ## The algorithm
//!
//! **Entitlements** (rates, recomputed at a tick whenever the set of
//! runnable vCPUs or the model changed). Only VMs that want CPU count. Each
//! class `c` gets bounds: upper `hi = min(cap, 100 × runnable vCPUs of its
//! VMs)`, lower `lo = min(reservation, hi)`. The capacity `C` is divided by
//! *weighted max-min fairness* (water-filling): find the level `λ` with
//! `Σ clamp(λ·shares_c, lo_c, hi_c) = min(C, Σ hi_c)`; class `c` gets
//! `clamp(λ·shares_c, lo_c, hi_c)`. Admission control guarantees
//! `Σ reservation ≤ C`, so reservations always fit. The class's amount is
//! then water-filled among its runnable VMs by `weight`, each bounded by
//! `100 × runnable vCPUs`. Because bounds come from actual demand, what an
//! idle class or VM leaves flows to the others (work conservation), and the
//! sum of entitlements is `min(C, what the runnable vCPUs can use)`.
//! Water-filling sorts `2n` breakpoints (`O(n log n)`), with an `O(n)` fast
//! path when no bound is hit.
//!
//! **Credits** (per VM, in ns of CPU time). Each tick of length `dt`, a VM
//! earns `entitlement × dt` and pays the CPU time it used. Credit is bounded
//! above by one accounting period of its entitlement (an idle VM cannot
//! hoard) and below by that plus two ticks of all its vCPUs running (debt
//! from kick latency is repaid, but bounded). Idle VMs earn nothing and,
//! using no CPU, burn nothing: their credit is kept for when they wake.
//!
//! **Cap budgets** (per capped class): earn `cap × dt`, pay the class's
//! usage, bounded by one period of the cap. A class whose budget is spent has
//! all its VMs parked, even on an otherwise idle host.
//!
//! **Park decisions** each tick, for VMs that want CPU:
//! 1. class cap budget spent → park;
//! 2. credit > 0 → run;
//! 3. otherwise the VM is a *candidate*: if the VMs with credit cannot fill
//!    the host (their runnable vCPUs < `C`), candidates are admitted in order
//!    of decreasing credit until the admitted vCPUs cover `C`; the rest are
//!    parked. Candidates of a class whose cap is what limits it are never
//!    admitted (a capped VM out of credit stays parked on an idle host).
//!
//! Idle VMs are never parked (except by a spent cap budget), so a waking VM
//! runs at once. Since over time every VM's usage equals what it earned
//! (up to the bounded credit), long-run usage matches entitlements; since a
//! VM out of credit is only held back when VMs with credit can use the host,
//! no CPU is left idle while an uncapped VM wants it, except between ticks.
//!
//! The tick costs `O(n)` (plus the water-filling sort when demand changed and
//! an `O(n)` selection of the admitted candidates), and does not allocate in
//! steady state.
//!
//! ## Using it from the VMM
//!
//! ```
//! use std::sync::Arc;
//! use corral_scheduler::{Capacity, ClassSpec, Gate, PolicyConfig, Scheduler, VmId, VmSpec, VmUsage};
//!
//! let mut s = Scheduler::new(Capacity::from_cpus(2), PolicyConfig::default()).unwrap();
//! s.create_class("gold", ClassSpec::new(300)).unwrap();
//! s.create_class("bronze", ClassSpec::new(100).with_cap(50)).unwrap();
//! s.add_vm(VmId(1), VmSpec::new("gold", 2)).unwrap();
//! s.add_vm(VmId(2), VmSpec::new("bronze", 2)).unwrap();
//! let gates = [Arc::new(Gate::new()), Arc::new(Gate::new())];
//!
//! // Every tick (scheduler thread): sample cumulative vCPU thread CPU time,
//! // then apply the changes to the gates.
//! let out = s.tick(10_000_000, &[
//!     VmUsage::total(VmId(1), 20_000_000, true),
//!     VmUsage::total(VmId(2), 20_000_000, true),
//! ]);
//! for change in out.changes() {
//!     gates[change.vm.0 as usize - 1].apply(change.action);
//! }
//! ```
#![forbid(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod gate;
pub mod model;
pub mod policy;
mod scheduler;
pub mod sim;

pub use gate::{Gate, WaitOutcome};
pub use model::{Capacity, ClassSpec, ErrorKind, Model, ModelError, VmId, VmSpec};
pub use policy::{
    Action, Change, ClassStats, ConfigError, CpuTime, Policy, PolicyConfig, Stats, TickOutput,
    VmDecision, VmStats, VmUsage,
};
pub use scheduler::Scheduler;
