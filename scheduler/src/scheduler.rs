//! [`Scheduler`]: the model plus the policy state, the one object the daemon
//! keeps.

use crate::model::{Capacity, ClassSpec, Model, ModelError, VmId, VmSpec};
use crate::policy::{ConfigError, Policy, PolicyConfig, Stats, TickOutput, VmUsage};

/// Owns the [`Model`] and the [`Policy`] state.
///
/// The daemon's scheduler thread calls [`tick`](Self::tick) every
/// [`PolicyConfig::tick_ns`] and makes each VM's
/// [`Gate`](crate::gate::Gate) match its decision in [`TickOutput::vms`]; the control plane calls the mutators. Share
/// it as `Mutex<Scheduler>`: a tick at 1000 VMs takes tens of microseconds,
/// so the lock is never held long. Every mutator validates first and leaves
/// the scheduler unchanged on error; changes take effect at the next tick.
#[derive(Debug, Clone)]
pub struct Scheduler {
    model: Model,
    policy: Policy,
}

impl Scheduler {
    /// An empty scheduler (no classes, no VMs).
    pub fn new(capacity: Capacity, config: PolicyConfig) -> Result<Self, ConfigError> {
        Self::with_model(Model::new(capacity), config)
    }

    /// A scheduler over an existing model.
    pub fn with_model(model: Model, config: PolicyConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let mut policy = Policy::new(config);
        policy.sync(&model);
        Ok(Scheduler { model, policy })
    }

    /// The model (classes, VMs, capacity).
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The policy configuration.
    pub fn config(&self) -> PolicyConfig {
        self.policy.config()
    }

    /// Changes tick/period live.
    pub fn set_config(&mut self, config: PolicyConfig) -> Result<(), ConfigError> {
        self.policy.set_config(config)
    }

    fn synced<T>(&mut self, r: Result<T, ModelError>) -> Result<T, ModelError> {
        if r.is_ok() {
            self.policy.sync(&self.model);
        }
        r
    }

    /// See [`Model::set_capacity`].
    pub fn set_capacity(&mut self, capacity: Capacity) -> Result<(), ModelError> {
        let r = self.model.set_capacity(capacity);
        self.synced(r)
    }

    /// See [`Model::create_class`].
    pub fn create_class(&mut self, name: &str, spec: ClassSpec) -> Result<(), ModelError> {
        let r = self.model.create_class(name, spec);
        self.synced(r)
    }

    /// See [`Model::create_class_in`].
    pub fn create_class_in(
        &mut self,
        name: &str,
        spec: ClassSpec,
        parent: Option<&str>,
    ) -> Result<(), ModelError> {
        let r = self.model.create_class_in(name, spec, parent);
        self.synced(r)
    }

    /// See [`Model::set_class_in`].
    pub fn set_class_in(
        &mut self,
        name: &str,
        spec: ClassSpec,
        parent: Option<&str>,
    ) -> Result<bool, ModelError> {
        let r = self.model.set_class_in(name, spec, parent);
        self.synced(r)
    }

    /// See [`Model::update_class`].
    pub fn update_class(&mut self, name: &str, spec: ClassSpec) -> Result<(), ModelError> {
        let r = self.model.update_class(name, spec);
        self.synced(r)
    }

    /// Create-or-update; `Ok(true)` if created. See [`Model::set_class`].
    pub fn set_class(&mut self, name: &str, spec: ClassSpec) -> Result<bool, ModelError> {
        let r = self.model.set_class(name, spec);
        self.synced(r)
    }

    /// See [`Model::delete_class`].
    pub fn delete_class(&mut self, name: &str) -> Result<ClassSpec, ModelError> {
        let r = self.model.delete_class(name);
        self.synced(r)
    }

    /// Adds a VM (unparked, zero credit). See [`Model::add_vm`].
    pub fn add_vm(&mut self, id: VmId, spec: VmSpec) -> Result<(), ModelError> {
        let r = self.model.add_vm(id, spec);
        self.synced(r)
    }

    /// Removes a VM. The caller should unpark or shut down its gate: the
    /// scheduler will not mention it again.
    pub fn remove_vm(&mut self, id: VmId) -> Result<VmSpec, ModelError> {
        let r = self.model.remove_vm(id);
        self.synced(r)
    }

    /// See [`Model::set_vm_weight`].
    pub fn set_vm_weight(&mut self, id: VmId, weight: u32) -> Result<(), ModelError> {
        let r = self.model.set_vm_weight(id, weight);
        self.synced(r)
    }

    /// See [`Model::set_vm_cap`].
    pub fn set_vm_cap(&mut self, id: VmId, cap: Option<u32>) -> Result<(), ModelError> {
        let r = self.model.set_vm_cap(id, cap);
        self.synced(r)
    }

    /// See [`Model::set_vm_vcpus`].
    pub fn set_vm_vcpus(&mut self, id: VmId, vcpus: u32) -> Result<(), ModelError> {
        let r = self.model.set_vm_vcpus(id, vcpus);
        self.synced(r)
    }

    /// Moves a VM to another class; its credit and statistics move with it.
    /// See [`Model::move_vm`].
    pub fn move_vm(&mut self, id: VmId, class: &str) -> Result<(), ModelError> {
        let r = self.model.move_vm(id, class);
        self.synced(r)
    }

    /// Runs one tick; see [`Policy::tick`]. `now_ns` is any monotonic clock
    /// (e.g. `CLOCK_MONOTONIC`); `usages` has one entry per VM (missing VMs
    /// count as idle).
    pub fn tick(&mut self, now_ns: u64, usages: &[VmUsage]) -> &TickOutput {
        self.policy.tick(&self.model, now_ns, usages)
    }

    /// The host's measured idle CPU during the coming tick; see
    /// [`Policy::set_measured_idle`].
    pub fn set_measured_idle(&mut self, idle_pct: Option<f64>) {
        self.policy.set_measured_idle(idle_pct);
    }

    /// See [`Policy::set_measured_steal`].
    pub fn set_measured_steal(&mut self, steal_pct: Option<f64>) {
        self.policy.set_measured_steal(steal_pct);
    }

    /// See [`Policy::set_measured_outside`].
    pub fn set_measured_outside(&mut self, outside_pct: Option<f64>, interval_ns: u64) {
        self.policy.set_measured_outside(outside_pct, interval_ns);
    }

    /// See [`Policy::host_load`].
    pub fn host_load(&self) -> &crate::capacity::HostLoad {
        self.policy.host_load()
    }

    /// VM ids in tick order; see [`Policy::vm_order`].
    pub fn vm_order(&self) -> impl Iterator<Item = VmId> + '_ {
        self.policy.vm_order()
    }

    /// The output of the last tick.
    pub fn last_output(&self) -> &TickOutput {
        self.policy.last_output()
    }

    /// Whether a VM is parked (`None` if unknown).
    pub fn is_parked(&self, id: VmId) -> Option<bool> {
        self.policy.is_parked(id)
    }

    /// A VM's current entitlement in percent of one CPU.
    pub fn entitlement_pct(&self, id: VmId) -> Option<f64> {
        self.policy.entitlement_pct(id)
    }

    /// The demand admission counted a VM at in the last tick, percent.
    pub fn demand_pct(&self, id: VmId) -> Option<f64> {
        self.policy.demand_pct(id)
    }

    /// One class's statistics (see [`Policy::class_stats`]) and the ticks
    /// run so far.
    pub fn class_stats(&self, name: &str) -> (u64, Option<crate::policy::ClassStats>) {
        (self.policy.ticks(), self.policy.class_stats(name))
    }

    /// Statistics for metrics: per VM entitlement, usage, credit, parked
    /// time; per class sums.
    pub fn stats(&self) -> Stats {
        self.policy.stats()
    }
}
