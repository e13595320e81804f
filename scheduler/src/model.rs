//! The configuration model: host capacity, classes and VMs, with validation
//! and admission control.
//!
//! The model holds *what the operator asked for*; it knows nothing about time
//! or usage (that is the [`policy`](crate::policy)'s job). Every mutation is
//! validated first and either applied completely or refused with a
//! [`ModelError`] that leaves the model unchanged.
//!
//! # Units
//!
//! * `shares` and `weight` are dimensionless relative weights in
//!   [`MIN_SHARES`]`..=`[`MAX_SHARES`] (resp. [`MIN_WEIGHT`]`..=`[`MAX_WEIGHT`]).
//! * `cap`, `reservation` and [`Capacity`] are in **percent of one host CPU**:
//!   `150` means one and a half CPUs; a 4-CPU capacity is `400`.
//!
//! # Admission control
//!
//! Reservations are guarantees, so their sum may never exceed capacity:
//! `Σ class.reservation ≤ capacity`. A class's reservation may not exceed its
//! own cap. Admission is checked on class create/update and on capacity
//! changes; those are refused with [`ModelError::ReservationExceedsCapacity`],
//! [`ModelError::ReservationAboveCap`] or
//! [`ModelError::CapacityBelowReservations`].
//!
//! **Decision:** a reservation larger than what the class's VMs could ever use
//! (e.g. 400 % reserved for a class whose only VM has 2 vCPUs, or for an
//! empty class) is **accepted**. The whole reservation is still counted
//! against capacity by admission control (it is a promise that may be claimed
//! as soon as VMs are added), but the policy only ever *grants* what the
//! class's runnable vCPUs can consume, and the unused remainder is handed to
//! other classes (work conservation). Refusing it instead would make VM
//! removal or moves fail admission, and would forbid the natural order
//! "create the class, then start its VMs". VMs carry no reservation of their
//! own, so adding, moving or re-weighting a VM never changes the reserved
//! total; those operations are still validated (class exists, weight and vCPU
//! bounds) and can fail with a typed error.

use std::collections::BTreeMap;
use std::fmt;

use thiserror::Error;

/// Smallest allowed class `shares`.
pub const MIN_SHARES: u32 = 1;
/// Largest allowed class `shares`.
pub const MAX_SHARES: u32 = 10_000;
/// Default class `shares` (same default as cgroup v2 `cpu.weight`).
pub const DEFAULT_SHARES: u32 = 100;
/// Smallest allowed per-VM `weight`.
pub const MIN_WEIGHT: u32 = 1;
/// Largest allowed per-VM `weight`.
pub const MAX_WEIGHT: u32 = 10_000;
/// Default per-VM `weight` inside its class.
pub const DEFAULT_WEIGHT: u32 = 100;
/// Largest vCPU count a VM may have.
pub const MAX_VCPUS: u32 = 1024;
/// Longest class name, in bytes.
pub const MAX_CLASS_NAME_LEN: usize = 64;
/// Deepest class tree: a root class is at depth 1.
pub const MAX_DEPTH: usize = 8;

/// Identifier of a VM, chosen by the caller (the VMM's manager).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VmId(pub u64);

impl fmt::Display for VmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl From<u64> for VmId {
    fn from(v: u64) -> Self {
        VmId(v)
    }
}

/// The amount of host CPU the daemon may hand out, in percent of one CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Capacity {
    percent: u64,
}

impl Capacity {
    /// `cpus` whole host CPUs (`cpus × 100` percent).
    pub fn from_cpus(cpus: u32) -> Self {
        Capacity {
            percent: u64::from(cpus) * 100,
        }
    }

    /// An explicit capacity in percent of one CPU (e.g. `350` = 3.5 CPUs).
    pub fn from_percent(percent: u64) -> Self {
        Capacity { percent }
    }

    /// The number of CPUs in the calling thread's CPU affinity mask
    /// (`sched_getaffinity`), i.e. the CPUs the daemon may run on.
    ///
    /// Falls back to [`std::thread::available_parallelism`] if the syscall
    /// fails (e.g. on a host with more CPUs than a `cpu_set_t` can describe).
    pub fn from_affinity() -> std::io::Result<Self> {
        match affinity_cpu_count() {
            Ok(n) if n > 0 => Ok(Self::from_cpus(n)),
            _ => {
                let n = std::thread::available_parallelism()?.get();
                Ok(Self::from_cpus(u32::try_from(n).unwrap_or(u32::MAX)))
            }
        }
    }

    /// Capacity in percent of one CPU.
    pub fn percent(&self) -> u64 {
        self.percent
    }

    /// Capacity in (possibly fractional) CPUs.
    pub fn cpus(&self) -> f64 {
        self.percent as f64 / 100.0
    }
}

impl fmt::Display for Capacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}%", self.percent)
    }
}

/// Number of CPUs in this thread's affinity mask.
fn affinity_cpu_count() -> std::io::Result<u32> {
    // SAFETY: `cpu_set_t` is a plain bitmask for which all-zeroes is a valid
    // (empty) value; `sched_getaffinity` writes at most
    // `size_of::<cpu_set_t>()` bytes into the set we own, and `CPU_COUNT`
    // only reads that set.
    let count = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        libc::CPU_COUNT(&set)
    };
    Ok(u32::try_from(count).unwrap_or(0))
}

/// The settings of a class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClassSpec {
    /// Relative weight among classes that want CPU, [`MIN_SHARES`]`..=`[`MAX_SHARES`].
    pub shares: u32,
    /// Upper bound on the class's total CPU, in percent of one CPU (`>= 1`).
    /// Enforced even when the host is otherwise idle.
    pub cap: Option<u32>,
    /// Guaranteed CPU for the class under contention, in percent of one CPU.
    /// `Some(0)` is the same as `None`.
    pub reservation: Option<u32>,
}

impl Default for ClassSpec {
    fn default() -> Self {
        ClassSpec {
            shares: DEFAULT_SHARES,
            cap: None,
            reservation: None,
        }
    }
}

impl ClassSpec {
    /// A class with the given shares, no cap and no reservation.
    pub fn new(shares: u32) -> Self {
        ClassSpec {
            shares,
            ..Default::default()
        }
    }

    /// Builder: set the cap (percent of one CPU).
    pub fn with_cap(mut self, cap: u32) -> Self {
        self.cap = Some(cap);
        self
    }

    /// Builder: set the reservation (percent of one CPU).
    pub fn with_reservation(mut self, reservation: u32) -> Self {
        self.reservation = Some(reservation);
        self
    }

    /// The reservation in percent, `0` if none.
    pub fn reserved_percent(&self) -> u64 {
        u64::from(self.reservation.unwrap_or(0))
    }

    /// Checks the spec on its own (not against capacity).
    pub fn validate(&self) -> Result<(), ModelError> {
        if !(MIN_SHARES..=MAX_SHARES).contains(&self.shares) {
            return Err(ModelError::InvalidShares(self.shares));
        }
        if let Some(cap) = self.cap {
            if cap == 0 {
                return Err(ModelError::InvalidCap(cap));
            }
            let reservation = self.reservation.unwrap_or(0);
            if reservation > cap {
                return Err(ModelError::ReservationAboveCap { reservation, cap });
            }
        }
        Ok(())
    }
}

/// The settings of a VM.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct VmSpec {
    /// Name of the class the VM belongs to.
    pub class: String,
    /// Weight of the VM inside its class, [`MIN_WEIGHT`]`..=`[`MAX_WEIGHT`].
    pub weight: u32,
    /// Number of vCPUs, `1..=`[`MAX_VCPUS`]. A VM can never use more than
    /// `vcpus × 100` percent.
    pub vcpus: u32,
    /// Upper bound on the VM's CPU, in percent of one CPU (`>= 1`; libvirt's
    /// `vcpu_quota` for the whole VM). Enforced even on an idle host, on top
    /// of its class's cap.
    pub cap: Option<u32>,
}

impl VmSpec {
    /// A VM of `vcpus` vCPUs in `class`, with the default weight.
    pub fn new(class: impl Into<String>, vcpus: u32) -> Self {
        VmSpec {
            class: class.into(),
            weight: DEFAULT_WEIGHT,
            vcpus,
            cap: None,
        }
    }

    /// Builder: set the VM's own cap (percent of one CPU).
    pub fn with_cap(mut self, cap: u32) -> Self {
        self.cap = Some(cap);
        self
    }

    /// Builder: set the weight.
    pub fn with_weight(mut self, weight: u32) -> Self {
        self.weight = weight;
        self
    }

    fn validate(&self) -> Result<(), ModelError> {
        validate_weight(self.weight)?;
        validate_vcpus(self.vcpus)?;
        validate_cap(self.cap)
    }
}

fn validate_weight(weight: u32) -> Result<(), ModelError> {
    if (MIN_WEIGHT..=MAX_WEIGHT).contains(&weight) {
        Ok(())
    } else {
        Err(ModelError::InvalidWeight(weight))
    }
}

fn validate_cap(cap: Option<u32>) -> Result<(), ModelError> {
    match cap {
        Some(0) => Err(ModelError::InvalidCap(0)),
        _ => Ok(()),
    }
}

fn validate_vcpus(vcpus: u32) -> Result<(), ModelError> {
    if (1..=MAX_VCPUS).contains(&vcpus) {
        Ok(())
    } else {
        Err(ModelError::InvalidVcpus(vcpus))
    }
}

/// What is wrong with a name used in URLs and Prometheus labels (classes,
/// and the VMM's VMs, disks and groups), if anything: it must be 1..=64
/// bytes of `[A-Za-z0-9_.-]`, not starting with `.` or `-`.
pub fn name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("must not be empty")
    } else if name.len() > MAX_CLASS_NAME_LEN {
        Some("must be at most 64 bytes long")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        Some("may only contain ASCII letters, digits, '_', '-' and '.'")
    } else if name.starts_with(['.', '-']) {
        Some("must not start with '.' or '-'")
    } else {
        None
    }
}

/// Checks a class name (see [`name_problem`]).
pub fn validate_class_name(name: &str) -> Result<(), ModelError> {
    match name_problem(name) {
        Some(reason) => Err(ModelError::InvalidClassName {
            name: name.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

/// Broad category of a [`ModelError`], for mapping to API status codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request itself is malformed or out of range (HTTP 400).
    Invalid,
    /// A named class or VM does not exist (HTTP 404).
    NotFound,
    /// The change conflicts with the current state (HTTP 409).
    Conflict,
    /// Refused by admission control (HTTP 422).
    Refused,
}

/// Why a model change was refused. The model is unchanged when one of these
/// is returned.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ModelError {
    /// Bad class name.
    #[error("invalid class name {name:?}: {reason}")]
    InvalidClassName {
        /// The offending name.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// `shares` out of range.
    #[error("shares must be in {MIN_SHARES}..={MAX_SHARES}, got {0}")]
    InvalidShares(u32),
    /// `weight` out of range.
    #[error("weight must be in {MIN_WEIGHT}..={MAX_WEIGHT}, got {0}")]
    InvalidWeight(u32),
    /// vCPU count out of range.
    #[error("vCPU count must be in 1..={MAX_VCPUS}, got {0}")]
    InvalidVcpus(u32),
    /// `cap` of zero.
    #[error("cap must be at least 1 (percent of one CPU), got {0}")]
    InvalidCap(u32),
    /// Capacity of zero.
    #[error("capacity must be at least 1 percent of one CPU")]
    InvalidCapacity,
    /// A class reserving more than its own cap.
    #[error("reservation {reservation}% exceeds the class cap {cap}%")]
    ReservationAboveCap {
        /// Requested reservation (percent).
        reservation: u32,
        /// The class cap (percent).
        cap: u32,
    },
    /// Admission control: reservations would exceed capacity.
    #[error(
        "admission refused: class {class:?} would bring total reservations to {total}% \
         but capacity is {capacity}% (only {available}% left to reserve)"
    )]
    ReservationExceedsCapacity {
        /// The class being created or updated.
        class: String,
        /// Sum of reservations after the change (percent).
        total: u64,
        /// Capacity (percent).
        capacity: u64,
        /// What could still be reserved for this class (percent).
        available: u64,
    },
    /// Admission control: new capacity below what is already reserved.
    #[error("capacity {capacity}% is below the {reserved}% already reserved by classes")]
    CapacityBelowReservations {
        /// Requested capacity (percent).
        capacity: u64,
        /// Current sum of reservations (percent).
        reserved: u64,
    },
    /// Creating a class that exists.
    #[error("class {0:?} already exists")]
    ClassExists(String),
    /// Unknown class.
    #[error("no class named {0:?}")]
    UnknownClass(String),
    /// Unknown parent class.
    #[error("no parent class named {0:?}")]
    UnknownParent(String),
    /// A class tree deeper than [`MAX_DEPTH`].
    #[error("class {class:?} would be at depth {depth}; classes nest at most {MAX_DEPTH} deep")]
    TooDeep {
        /// The class being created.
        class: String,
        /// Its depth.
        depth: usize,
    },
    /// Naming another parent for an existing class.
    #[error("class {0:?} already exists under another parent; a class cannot move in the tree")]
    ParentChange(String),
    /// Deleting a class that still has child classes.
    #[error("class {name:?} still has {children} child class(es); delete them first")]
    ClassHasChildren {
        /// The class.
        name: String,
        /// How many children it has.
        children: usize,
    },
    /// Deleting a class that still has VMs.
    #[error("class {name:?} still has {vms} VM(s); move or remove them first")]
    ClassNotEmpty {
        /// The class.
        name: String,
        /// How many VMs are still in it.
        vms: usize,
    },
    /// Adding a VM whose id is taken.
    #[error("VM {0} already exists")]
    VmExists(VmId),
    /// Unknown VM.
    #[error("no VM with id {0}")]
    UnknownVm(VmId),
}

impl ModelError {
    /// The broad category of the error (maps to 400/404/409/422).
    pub fn kind(&self) -> ErrorKind {
        use ModelError::*;
        match self {
            InvalidClassName { .. }
            | InvalidShares(_)
            | InvalidWeight(_)
            | InvalidVcpus(_)
            | InvalidCap(_)
            | InvalidCapacity
            | TooDeep { .. }
            | ReservationAboveCap { .. } => ErrorKind::Invalid,
            ReservationExceedsCapacity { .. } | CapacityBelowReservations { .. } => {
                ErrorKind::Refused
            }
            ClassExists(_)
            | ClassNotEmpty { .. }
            | ClassHasChildren { .. }
            | ParentChange(_)
            | VmExists(_) => ErrorKind::Conflict,
            UnknownClass(_) | UnknownParent(_) | UnknownVm(_) => ErrorKind::NotFound,
        }
    }
}

#[derive(Debug, Clone)]
struct ClassEntry {
    spec: ClassSpec,
    vms: usize,
    parent: Option<String>,
    /// Number of child classes.
    children: usize,
    /// Sum of the children's effective reservations.
    child_res: u64,
}

#[path = "model_tree.rs"]
pub mod tree;

/// Capacity, classes and VMs. See the [module docs](self).
///
/// Iteration orders are deterministic (classes by name, VMs by id).
#[derive(Debug, Clone)]
pub struct Model {
    capacity: Capacity,
    reserved: u64,
    classes: BTreeMap<String, ClassEntry>,
    vms: BTreeMap<VmId, VmSpec>,
    generation: u64,
}

impl Model {
    /// An empty model (no classes, no VMs) with the given capacity.
    ///
    /// # Panics
    /// If `capacity` is zero.
    pub fn new(capacity: Capacity) -> Self {
        assert!(capacity.percent() > 0, "capacity must be positive");
        Model {
            capacity,
            reserved: 0,
            classes: BTreeMap::new(),
            vms: BTreeMap::new(),
            generation: 0,
        }
    }

    /// A counter bumped by every successful change; lets the policy notice
    /// that it must resynchronise.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The capacity.
    pub fn capacity(&self) -> Capacity {
        self.capacity
    }

    /// Sum of class reservations, in percent.
    pub fn reserved_percent(&self) -> u64 {
        self.reserved
    }

    /// What is still free to reserve, in percent.
    pub fn unreserved_percent(&self) -> u64 {
        self.capacity.percent().saturating_sub(self.reserved)
    }

    /// Changes the capacity (e.g. after the affinity mask changed). Refused if
    /// below the current sum of reservations.
    pub fn set_capacity(&mut self, capacity: Capacity) -> Result<(), ModelError> {
        if capacity.percent() == 0 {
            return Err(ModelError::InvalidCapacity);
        }
        if capacity.percent() < self.reserved {
            return Err(ModelError::CapacityBelowReservations {
                capacity: capacity.percent(),
                reserved: self.reserved,
            });
        }
        self.capacity = capacity;
        self.bump();
        Ok(())
    }

    fn bump(&mut self) {
        self.generation += 1;
    }

    /// Admission check for giving `name` the spec `spec` under `parent`
    /// (replacing its current settings if it exists). O(depth); see
    /// [`tree`] for how reservations add up in a tree.
    fn admit_class(
        &self,
        name: &str,
        spec: &ClassSpec,
        parent: Option<&str>,
    ) -> Result<tree::Change, ModelError> {
        spec.validate()?;
        let change = tree::admit(
            &self.classes,
            self.reserved,
            name,
            spec.reserved_percent(),
            spec.cap,
            parent,
        )?;
        if change.total > self.capacity.percent() {
            // What this class could still reserve: capacity less the total
            // without its own reservation.
            let others = tree::admit(&self.classes, self.reserved, name, 0, None, parent)
                .map_or(change.total, |c| c.total);
            return Err(ModelError::ReservationExceedsCapacity {
                class: name.to_owned(),
                total: change.total,
                capacity: self.capacity.percent(),
                available: self.capacity.percent().saturating_sub(others),
            });
        }
        Ok(change)
    }

    /// Creates a root class. Fails if the name is invalid or taken, the spec
    /// is invalid, or admission control refuses its reservation.
    pub fn create_class(&mut self, name: &str, spec: ClassSpec) -> Result<(), ModelError> {
        self.create_class_in(name, spec, None)
    }

    /// Creates a class under `parent` (`None`: a root class). Shares divide
    /// the parent's portion among its children (and the VMs directly in
    /// it); at most [`MAX_DEPTH`] levels.
    pub fn create_class_in(
        &mut self,
        name: &str,
        spec: ClassSpec,
        parent: Option<&str>,
    ) -> Result<(), ModelError> {
        validate_class_name(name)?;
        if self.classes.contains_key(name) {
            return Err(ModelError::ClassExists(name.to_owned()));
        }
        if let Some(p) = parent {
            let depth = self
                .class_depth(p)
                .ok_or_else(|| ModelError::UnknownParent(p.to_owned()))?;
            if depth + 1 > MAX_DEPTH {
                return Err(ModelError::TooDeep {
                    class: name.to_owned(),
                    depth: depth + 1,
                });
            }
        }
        let change = self.admit_class(name, &spec, parent)?;
        tree::apply(&mut self.classes, &change);
        self.reserved = change.total;
        self.classes.insert(
            name.to_owned(),
            ClassEntry {
                spec,
                vms: 0,
                parent: parent.map(str::to_owned),
                children: 0,
                child_res: 0,
            },
        );
        if let Some(p) = parent.and_then(|p| self.classes.get_mut(p)) {
            p.children += 1;
        }
        self.bump();
        Ok(())
    }

    /// Replaces the spec of an existing class (live; VMs and children stay
    /// in it, its parent is kept).
    pub fn update_class(&mut self, name: &str, spec: ClassSpec) -> Result<(), ModelError> {
        let parent = self
            .classes
            .get(name)
            .ok_or_else(|| ModelError::UnknownClass(name.to_owned()))?
            .parent
            .clone();
        let change = self.admit_class(name, &spec, parent.as_deref())?;
        tree::apply(&mut self.classes, &change);
        self.reserved = change.total;
        if let Some(c) = self.classes.get_mut(name) {
            c.spec = spec;
        }
        self.bump();
        Ok(())
    }

    /// Creates the class (a root) or updates it if it exists. Returns `true`
    /// if it was created.
    pub fn set_class(&mut self, name: &str, spec: ClassSpec) -> Result<bool, ModelError> {
        self.set_class_in(name, spec, None)
    }

    /// Creates the class under `parent` or updates it if it exists; an
    /// existing class keeps its parent, and naming another one is refused
    /// ([`ModelError::ParentChange`]; `None` means "keep"). Returns `true`
    /// if it was created.
    pub fn set_class_in(
        &mut self,
        name: &str,
        spec: ClassSpec,
        parent: Option<&str>,
    ) -> Result<bool, ModelError> {
        match self.classes.get(name) {
            Some(c) => {
                if parent.is_some() && parent != c.parent.as_deref() {
                    return Err(ModelError::ParentChange(name.to_owned()));
                }
                self.update_class(name, spec).map(|()| false)
            }
            None => self.create_class_in(name, spec, parent).map(|()| true),
        }
    }

    /// Deletes an empty class, returning its spec. Refused while VMs or
    /// child classes are in it.
    pub fn delete_class(&mut self, name: &str) -> Result<ClassSpec, ModelError> {
        let entry = self
            .classes
            .get(name)
            .ok_or_else(|| ModelError::UnknownClass(name.to_owned()))?;
        if entry.vms > 0 {
            return Err(ModelError::ClassNotEmpty {
                name: name.to_owned(),
                vms: entry.vms,
            });
        }
        if entry.children > 0 {
            return Err(ModelError::ClassHasChildren {
                name: name.to_owned(),
                children: entry.children,
            });
        }
        let spec = entry.spec;
        let parent = entry.parent.clone();
        // A leaf's reservation goes to 0: that can only lower totals.
        if let Ok(change) = tree::admit(
            &self.classes,
            self.reserved,
            name,
            0,
            None,
            parent.as_deref(),
        ) {
            tree::apply(&mut self.classes, &change);
            self.reserved = change.total;
        }
        self.classes.remove(name);
        if let Some(p) = parent.as_deref().and_then(|p| self.classes.get_mut(p)) {
            p.children -= 1;
        }
        self.bump();
        Ok(spec)
    }

    /// A class's parent (`None` for a root class or an unknown one).
    pub fn class_parent(&self, name: &str) -> Option<&str> {
        self.classes.get(name)?.parent.as_deref()
    }

    /// A class's children, by name.
    pub fn class_children<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.classes
            .iter()
            .filter(move |(_, c)| c.parent.as_deref() == Some(name))
            .map(|(n, _)| n.as_str())
    }

    /// A class's depth (1 for a root class), `None` if unknown.
    pub fn class_depth(&self, name: &str) -> Option<usize> {
        let mut depth = 1;
        let mut c = self.classes.get(name)?;
        while let Some(p) = &c.parent {
            depth += 1;
            c = self.classes.get(p)?;
        }
        Some(depth)
    }

    /// The path from the root to `name` (root first), empty if unknown.
    pub fn class_path<'a>(&'a self, name: &'a str) -> Vec<&'a str> {
        let mut path = Vec::new();
        let mut cur = Some(name);
        while let Some(n) = cur {
            let Some(c) = self.classes.get(n) else {
                return Vec::new();
            };
            path.push(n);
            cur = c.parent.as_deref();
        }
        path.reverse();
        path
    }

    /// A class's effective reservation: its own, or what its children
    /// reserve together if that is more (see [`tree`]).
    pub fn class_reserved_percent(&self, name: &str) -> Option<u64> {
        tree::effective(&self.classes, name)
    }

    /// The spec of a class.
    pub fn class(&self, name: &str) -> Option<&ClassSpec> {
        self.classes.get(name).map(|c| &c.spec)
    }

    /// Number of VMs in a class.
    pub fn class_vm_count(&self, name: &str) -> Option<usize> {
        self.classes.get(name).map(|c| c.vms)
    }

    /// All classes, ordered by name.
    pub fn classes(&self) -> impl Iterator<Item = (&str, &ClassSpec)> {
        self.classes.iter().map(|(n, c)| (n.as_str(), &c.spec))
    }

    /// All classes with their parents, ordered by name (no lookups: cheap
    /// for the policy's resynchronisation).
    pub fn classes_with_parents(&self) -> impl Iterator<Item = (&str, &ClassSpec, Option<&str>)> {
        self.classes
            .iter()
            .map(|(n, c)| (n.as_str(), &c.spec, c.parent.as_deref()))
    }

    /// Number of classes.
    pub fn class_count(&self) -> usize {
        self.classes.len()
    }

    /// Adds a VM.
    pub fn add_vm(&mut self, id: VmId, spec: VmSpec) -> Result<(), ModelError> {
        spec.validate()?;
        if self.vms.contains_key(&id) {
            return Err(ModelError::VmExists(id));
        }
        let class = self
            .classes
            .get_mut(&spec.class)
            .ok_or_else(|| ModelError::UnknownClass(spec.class.clone()))?;
        class.vms += 1;
        self.vms.insert(id, spec);
        self.bump();
        Ok(())
    }

    /// Removes a VM, returning its spec.
    pub fn remove_vm(&mut self, id: VmId) -> Result<VmSpec, ModelError> {
        let spec = self.vms.remove(&id).ok_or(ModelError::UnknownVm(id))?;
        if let Some(c) = self.classes.get_mut(&spec.class) {
            c.vms -= 1;
        }
        self.bump();
        Ok(spec)
    }

    /// Changes a VM's weight inside its class.
    pub fn set_vm_weight(&mut self, id: VmId, weight: u32) -> Result<(), ModelError> {
        validate_weight(weight)?;
        let vm = self.vms.get_mut(&id).ok_or(ModelError::UnknownVm(id))?;
        vm.weight = weight;
        self.bump();
        Ok(())
    }

    /// Sets or removes a VM's own cap (live).
    pub fn set_vm_cap(&mut self, id: VmId, cap: Option<u32>) -> Result<(), ModelError> {
        validate_cap(cap)?;
        let vm = self.vms.get_mut(&id).ok_or(ModelError::UnknownVm(id))?;
        vm.cap = cap;
        self.bump();
        Ok(())
    }

    /// Changes a VM's vCPU count (vCPU hotplug).
    pub fn set_vm_vcpus(&mut self, id: VmId, vcpus: u32) -> Result<(), ModelError> {
        validate_vcpus(vcpus)?;
        let vm = self.vms.get_mut(&id).ok_or(ModelError::UnknownVm(id))?;
        vm.vcpus = vcpus;
        self.bump();
        Ok(())
    }

    /// Moves a VM to another class (live). Moving to its current class is a
    /// no-op. VMs carry no reservation, so the reserved total is unchanged and
    /// admission cannot refuse a move; only an unknown VM or class fails.
    pub fn move_vm(&mut self, id: VmId, class: &str) -> Result<(), ModelError> {
        let from = self
            .vms
            .get(&id)
            .ok_or(ModelError::UnknownVm(id))?
            .class
            .clone();
        if from == class {
            return Ok(());
        }
        let to = self
            .classes
            .get_mut(class)
            .ok_or_else(|| ModelError::UnknownClass(class.to_owned()))?;
        to.vms += 1;
        if let Some(c) = self.classes.get_mut(&from) {
            c.vms -= 1;
        }
        if let Some(vm) = self.vms.get_mut(&id) {
            vm.class = class.to_owned();
        }
        self.bump();
        Ok(())
    }

    /// The spec of a VM.
    pub fn vm(&self, id: VmId) -> Option<&VmSpec> {
        self.vms.get(&id)
    }

    /// All VMs, ordered by id.
    pub fn vms(&self) -> impl Iterator<Item = (VmId, &VmSpec)> {
        self.vms.iter().map(|(id, s)| (*id, s))
    }

    /// Number of VMs.
    pub fn vm_count(&self) -> usize {
        self.vms.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> Model {
        Model::new(Capacity::from_cpus(4))
    }

    #[test]
    fn affinity_is_positive() {
        let c = Capacity::from_affinity().unwrap();
        assert!(c.percent() >= 100);
    }

    #[test]
    fn class_validation() {
        let mut m = model();
        assert_eq!(
            m.create_class("a", ClassSpec::new(0)),
            Err(ModelError::InvalidShares(0))
        );
        assert_eq!(
            m.create_class("a", ClassSpec::new(10_001)),
            Err(ModelError::InvalidShares(10_001))
        );
        assert_eq!(
            m.create_class("a", ClassSpec::new(1).with_cap(0)),
            Err(ModelError::InvalidCap(0))
        );
        assert_eq!(
            m.create_class("a", ClassSpec::new(1).with_cap(100).with_reservation(150)),
            Err(ModelError::ReservationAboveCap {
                reservation: 150,
                cap: 100
            })
        );
        for bad in ["", "a b", "-x", ".x", "é", &"x".repeat(65)] {
            let e = m.create_class(bad, ClassSpec::default()).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Invalid, "{bad:?}");
        }
        m.create_class("gold_1.x-y", ClassSpec::new(10_000))
            .unwrap();
        assert_eq!(
            m.create_class("gold_1.x-y", ClassSpec::new(1)),
            Err(ModelError::ClassExists("gold_1.x-y".into()))
        );
        assert_eq!(m.generation(), 1);
    }

    #[test]
    fn admission_control() {
        let mut m = model();
        m.create_class("a", ClassSpec::new(1).with_reservation(250))
            .unwrap();
        let e = m
            .create_class("b", ClassSpec::new(1).with_reservation(200))
            .unwrap_err();
        assert_eq!(
            e,
            ModelError::ReservationExceedsCapacity {
                class: "b".into(),
                total: 450,
                capacity: 400,
                available: 150
            }
        );
        assert_eq!(e.kind(), ErrorKind::Refused);
        assert!(m.class("b").is_none());
        m.create_class("b", ClassSpec::new(1).with_reservation(150))
            .unwrap();
        assert_eq!(m.reserved_percent(), 400);
        // Updating a class replaces (not adds) its own reservation.
        m.update_class("a", ClassSpec::new(5).with_reservation(250))
            .unwrap();
        assert!(
            m.update_class("a", ClassSpec::new(5).with_reservation(251))
                .is_err()
        );
        assert_eq!(m.class("a").unwrap().shares, 5);
        // Capacity cannot drop below reservations.
        assert_eq!(
            m.set_capacity(Capacity::from_cpus(3)),
            Err(ModelError::CapacityBelowReservations {
                capacity: 300,
                reserved: 400
            })
        );
        m.delete_class("b").unwrap();
        assert_eq!(m.reserved_percent(), 250);
        m.set_capacity(Capacity::from_cpus(3)).unwrap();
        assert_eq!(m.unreserved_percent(), 50);
        // A reservation larger than the class's VMs could use is accepted.
        m.create_class("tiny", ClassSpec::new(1).with_reservation(50))
            .unwrap();
        m.add_vm(VmId(1), VmSpec::new("tiny", 1)).unwrap();
    }

    #[test]
    fn vms_and_moves() {
        let mut m = model();
        m.create_class("a", ClassSpec::default()).unwrap();
        m.create_class("b", ClassSpec::default()).unwrap();
        assert_eq!(
            m.add_vm(VmId(1), VmSpec::new("zz", 1)),
            Err(ModelError::UnknownClass("zz".into()))
        );
        assert_eq!(
            m.add_vm(VmId(1), VmSpec::new("a", 0)),
            Err(ModelError::InvalidVcpus(0))
        );
        assert_eq!(
            m.add_vm(VmId(1), VmSpec::new("a", 1).with_weight(0)),
            Err(ModelError::InvalidWeight(0))
        );
        m.add_vm(VmId(1), VmSpec::new("a", 2)).unwrap();
        assert_eq!(
            m.add_vm(VmId(1), VmSpec::new("a", 2)),
            Err(ModelError::VmExists(VmId(1)))
        );
        let e = m.delete_class("a").unwrap_err();
        assert_eq!(
            e,
            ModelError::ClassNotEmpty {
                name: "a".into(),
                vms: 1
            }
        );
        assert_eq!(e.kind(), ErrorKind::Conflict);
        m.move_vm(VmId(1), "b").unwrap();
        assert_eq!(m.class_vm_count("a"), Some(0));
        assert_eq!(m.class_vm_count("b"), Some(1));
        assert_eq!(
            m.move_vm(VmId(1), "c").unwrap_err().kind(),
            ErrorKind::NotFound
        );
        m.set_vm_weight(VmId(1), 500).unwrap();
        assert_eq!(
            m.set_vm_weight(VmId(1), 10_001),
            Err(ModelError::InvalidWeight(10_001))
        );
        m.set_vm_vcpus(VmId(1), 4).unwrap();
        assert_eq!(
            m.set_vm_cap(VmId(1), Some(0)),
            Err(ModelError::InvalidCap(0))
        );
        assert_eq!(
            m.add_vm(VmId(2), VmSpec::new("b", 1).with_cap(0)),
            Err(ModelError::InvalidCap(0))
        );
        m.set_vm_cap(VmId(1), Some(50)).unwrap();
        assert_eq!(m.vm(VmId(1)).unwrap().cap, Some(50));
        m.set_vm_cap(VmId(1), None).unwrap();
        assert_eq!(
            m.set_vm_cap(VmId(9), None),
            Err(ModelError::UnknownVm(VmId(9)))
        );
        assert_eq!(m.vm(VmId(1)).unwrap().weight, 500);
        m.delete_class("a").unwrap();
        assert!(m.delete_class("b").is_err());
        let spec = m.remove_vm(VmId(1)).unwrap();
        assert_eq!(spec.vcpus, 4);
        assert_eq!(m.remove_vm(VmId(1)), Err(ModelError::UnknownVm(VmId(1))));
        m.delete_class("b").unwrap();
        assert_eq!(m.class_count(), 0);
    }
}
