//! # corral-scheduler: classes, shares, caps, reservations
//!
//! This crate divides host CPU among VMs. It knows nothing about KVM: it
//! takes time and per-VM CPU usage as inputs and answers which VMs must be
//! *parked* (held off the CPU). The VMM supplies the clock, measures usage
//! (thread CPU clocks of the vCPU threads) and enforces the answers with a
//! [`Gate`] per VM.
//!
//! * [`capacity`]: the capacity the policy plans with, less steal and the
//!   load of other processes ([`HostLoad`]).
//! * [`model`]: capacity, classes ([`ClassSpec`]: shares, cap, reservation)
//!   and VMs ([`VmSpec`]: class, weight, vCPUs), validation and admission
//!   control.
//! * [`policy`]: the pure share policy ([`Policy`]).
//! * [`Scheduler`]: model + policy, the object the daemon keeps.
//! * [`gate`]: the park/unpark primitive vCPU threads wait on (a futex
//!   word in a page shared with the VM's process; the only module here
//!   that makes syscalls).
//! * [`sim`]: a deterministic simulator of N host CPUs and thousands of VMs.
//!
//! ## Units
//!
//! CPU amounts (capacity, caps, reservations, entitlements) are in percent
//! of one host CPU: 150 = 1.5 CPUs. Times are nanoseconds.
//!
//! ## The algorithm
//!
//! **Demand.** Each tick the caller reports per VM the CPU time used and how
//! many vCPUs wanted CPU. The policy turns that into a demand estimate in
//! percent, bounded by `100 × runnable vCPUs`: a VM that ran unparked shows
//! its demand in its usage (corrected for host contention; at least 60 % of
//! the bound counts as the full bound, otherwise usage × 1.1 + 5 % of
//! headroom); a parked or just-woken VM keeps its last estimate.
//!
//! **Entitlements** (rates, recomputed at every tick where some demand or
//! the model changed). Each class `c` gets bounds: upper `hi = min(cap, Σ
//! demand of its VMs)`, lower `lo = min(reservation, hi)`. The capacity `C`
//! is divided by *weighted max-min fairness* (water-filling): find the level
//! `λ` with `Σ clamp(λ·shares_c, lo_c, hi_c) = min(C, Σ hi_c)`; class `c`
//! gets `clamp(λ·shares_c, lo_c, hi_c)`. Admission control guarantees
//! `Σ reservation ≤ C`, so reservations always fit. The class's amount is
//! then water-filled among its VMs by `weight`, each bounded by its demand.
//! Because bounds come from demand, what an idle class or VM leaves flows to
//! the others (work conservation), and the sum of entitlements is
//! `min(C, total demand)`. Water-filling sorts `2n` breakpoints
//! (`O(n log n)`), with an `O(n)` fast path when no bound is hit.
//!
//! **Credits** (per VM, in ns of CPU time). Each tick of length `dt`, a VM
//! earns `entitlement × dt` and pays the CPU time it used. Idle VMs earn
//! nothing and, using no CPU, burn nothing. A VM that was free to run
//! (unparked) keeps at most one accounting period of its entitlement (no
//! hoarding); what it could not keep is handed to the other demanding VMs in
//! proportion to their entitlements (so CPU a VM cannot use, e.g. because
//! its vCPUs are all busy, goes to the others by shares). A parked VM's
//! credit is not clipped: it is owed for waiting its turn. Debt is bounded
//! at one period of entitlement plus two ticks of all vCPUs running.
//!
//! **Cap budgets** (per capped class): earn `cap × dt`, pay the class's
//! usage, bounded by one period of the cap. A class whose budget is spent has
//! all its VMs parked, even on an otherwise idle host.
//!
//! **Park decisions** each tick. Idle VMs stay unparked (so a waking VM runs
//! at once), unless their class's cap budget is spent. VMs that want CPU:
//! 1. class cap budget spent → park;
//! 2. class held back by its cap and VM out of credit → park (a capped VM
//!    whose credit is spent is parked even on an idle host);
//! 3. all others are ranked by *lag* = credit / entitlement (how far ahead
//!    of its fair schedule the VM is; positive credit always ranks above
//!    debt), except that a running VM with credit that uses on average less
//!    than half its entitlement (a light or latency-sensitive VM) goes
//!    first; VMs are admitted in that order until their demand covers the
//!    capacity (plus a small margin learnt from CPU left idle while VMs
//!    waited); the rest are parked;
//! 4. a VM unparked for its turn less than the *minimum slice* ago
//!    ([`PolicyConfig::min_slice_ns`], default 20 ms = two ticks) keeps
//!    running: to make room, the VMs step 3 would unpark are deferred,
//!    lowest lag first, while what runs still covers the host. A slice
//!    never parks a running VM and never leaves CPU idle, and a tick that
//!    defers the VM with the most lag starts no new slice, so it gets in
//!    within one slice. Each turn costs a kick and a wake of every vCPU of
//!    two VMs; two-tick turns halve them where every VM fills the host.
//!
//! So a VM out of credit is parked whenever VMs with credit can use the
//! host, and runs whenever they cannot (work conservation); admitting just
//! enough VMs to fill the host keeps the host's per-thread fairness from
//! diluting the shares; and since usage is charged and credit is bounded,
//! long-run usage matches entitlements. Enforcement works at tick
//! granularity: a VM runs for whole ticks, at least a slice when it waited
//! for its turn, so a 1-vCPU VM entitled to 1 % of a CPU runs one 20 ms
//! slice every two seconds.
//!
//! The tick costs `O(n log n)` for `n` VMs (the ranking sort and the
//! water-filling), about 60 µs at 1000 VMs in release builds (see the
//! `sim_cost` example), and does not allocate in steady state.
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
//! // then make every gate match the current decision (level-triggered, see
//! // the gate module).
//! let out = s.tick(10_000_000, &[
//!     VmUsage::total(VmId(1), 20_000_000, true),
//!     VmUsage::total(VmId(2), 20_000_000, true),
//! ]);
//! for d in out.vms() {
//!     let gate = &gates[d.vm.0 as usize - 1];
//!     if d.should_run { gate.unpark(); } else { gate.park(); }
//! }
//! ```
#![forbid(unsafe_op_in_unsafe_fn)]

pub mod capacity;
pub mod gate;
pub mod model;
pub mod policy;
mod scheduler;
pub mod sim;

pub use capacity::HostLoad;
pub use gate::{CpuClamp, Gate, Side, WaitOutcome};
pub use model::{Capacity, ClassSpec, ErrorKind, Model, ModelError, VmId, VmSpec};
pub use policy::{
    Action, Change, ClassStats, ConfigError, CpuTime, Policy, PolicyConfig, Stats, TickOutput,
    VmDecision, VmStats, VmUsage,
};
pub use scheduler::Scheduler;
