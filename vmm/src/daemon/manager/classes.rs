//! Resource classes: create, update, move in the class tree, delete; the
//! cgroup backend's class directories.

use super::*;

impl Manager {
    /// One class with its scheduler figures, without a snapshot of every
    /// class's (that made each class change O(classes)).
    pub(super) fn one_class_info(&self, st: &State, name: &str) -> Option<ClassInfo> {
        let (ticks, cs) = self.sched().class_stats(name);
        self.class_info(st, (ticks > 0).then_some(cs.as_ref()).flatten(), name)
    }

    pub(super) fn class_info(
        &self,
        st: &State,
        cs: Option<&corral_scheduler::ClassStats>,
        name: &str,
    ) -> Option<ClassInfo> {
        let s = self.sched();
        let spec = *s.model().class(name)?;
        let parent = s.model().class_parent(name).map(str::to_owned);
        let children = s.model().class_children(name).map(str::to_owned).collect();
        drop(s);
        let vms: Vec<Arc<Entry>> = st
            .vms
            .values()
            .filter(|e| *lock(&e.class) == name)
            .cloned()
            .collect();
        let cpu_ns: u64 = vms
            .iter()
            .map(|e| e.cpu_ns(e.handle.exit_reason().is_none()))
            .sum();
        Some(ClassInfo {
            name: name.to_string(),
            parent,
            children,
            config: ClassConfig {
                cpu: spec,
                io: st.class_io.get(name).copied().unwrap_or_default(),
            },
            vms: vms.iter().map(|e| e.name.clone()).collect(),
            cpu_secs: cpu_ns as f64 / 1e9,
            entitlement_pct: cs.map(|c| c.entitlement_pct),
            used_pct: cs.map(|c| c.used_pct),
        })
    }

    /// All classes.
    pub fn list_classes(&self) -> Vec<ClassInfo> {
        let st = lock(&self.state);
        let stats = self.sched().stats();
        let names: Vec<String> = self
            .sched()
            .model()
            .classes()
            .map(|(n, _)| n.to_string())
            .collect();
        // stats.classes is sorted by name, as the model's classes are.
        let find = |n: &str| {
            (stats.ticks > 0)
                .then(|| {
                    stats
                        .classes
                        .binary_search_by(|c| c.name.as_str().cmp(n))
                        .ok()
                        .and_then(|i| stats.classes.get(i))
                })
                .flatten()
        };
        names
            .iter()
            .filter_map(|n| self.class_info(&st, find(n), n))
            .collect()
    }

    /// One class.
    pub fn get_class(&self, name: &str) -> Result<ClassInfo, ManagerError> {
        let st = lock(&self.state);
        self.one_class_info(&st, name)
            .ok_or_else(|| ManagerError::NotFound(format!("no class named {name:?}")))
    }

    /// Creates a class; 409 if it exists, 422 if admission control refuses.
    pub fn create_class(&self, name: &str, cfg: ClassConfig) -> Result<ClassInfo, ManagerError> {
        self.create_class_in(name, cfg, None)
    }

    /// Creates a class under `parent` (a root class with `None`); 404 for
    /// an unknown parent, 400 past the depth limit (8).
    pub(super) fn create_class_in_live(
        &self,
        name: &str,
        cfg: ClassConfig,
        parent: Option<&str>,
    ) -> Result<ClassInfo, ManagerError> {
        cfg.io.validate()?;
        let mut st = lock(&self.state);
        self.check_class_count(&st, name)?;
        self.sched().create_class_in(name, cfg.cpu, parent)?;
        self.cgroup_class(name, &cfg);
        st.class_io.insert(name.to_string(), cfg.io);
        set_class_group(&mut st, name, &cfg.io, self.shared_groups())?;
        self.one_class_info(&st, name)
            .ok_or_else(|| ManagerError::NotFound(format!("no class named {name:?}")))
    }

    /// Creates or replaces a class; returns whether it was created.
    pub fn set_class(
        &self,
        name: &str,
        cfg: ClassConfig,
    ) -> Result<(bool, ClassInfo), ManagerError> {
        self.set_class_in(name, cfg, None)
    }

    /// Creates (under `parent`) or replaces a class; an existing class keeps
    /// its parent (naming another one is a 409). Returns whether it was
    /// created.
    pub(super) fn set_class_in_live(
        &self,
        name: &str,
        cfg: ClassConfig,
        parent: Option<&str>,
    ) -> Result<(bool, ClassInfo), ManagerError> {
        cfg.io.validate()?;
        let mut st = lock(&self.state);
        self.check_class_count(&st, name)?;
        let created = self.sched().set_class_in(name, cfg.cpu, parent)?;
        self.cgroup_class(name, &cfg);
        st.class_io.insert(name.to_string(), cfg.io);
        set_class_group(&mut st, name, &cfg.io, self.shared_groups())?;
        let info = self
            .one_class_info(&st, name)
            .ok_or_else(|| ManagerError::NotFound(format!("no class named {name:?}")))?;
        drop(st);
        if !created {
            self.push_class_io(name, cfg.io);
        }
        Ok((created, info))
    }

    /// Changes a class with a function of its current configuration.
    pub(super) fn update_class_live(
        &self,
        name: &str,
        f: impl FnOnce(&mut ClassConfig),
    ) -> Result<ClassInfo, ManagerError> {
        let mut st = lock(&self.state);
        let cpu = *self
            .sched()
            .model()
            .class(name)
            .ok_or_else(|| ManagerError::NotFound(format!("no class named {name:?}")))?;
        let mut cfg = ClassConfig {
            cpu,
            io: st.class_io.get(name).copied().unwrap_or_default(),
        };
        f(&mut cfg);
        cfg.io.validate()?;
        self.sched().update_class(name, cfg.cpu)?;
        self.cgroup_class(name, &cfg);
        st.class_io.insert(name.to_string(), cfg.io);
        set_class_group(&mut st, name, &cfg.io, self.shared_groups())?;
        let info = self
            .one_class_info(&st, name)
            .ok_or_else(|| ManagerError::NotFound(format!("no class named {name:?}")));
        drop(st);
        self.push_class_io(name, cfg.io);
        info
    }

    /// Deletes an empty class; 409 while VMs are in it.
    pub(super) fn delete_class_live(&self, name: &str) -> Result<(), ManagerError> {
        if name == DEFAULT_CLASS {
            self.get_class(name)?;
            return Err(ManagerError::Conflict(format!(
                "class {DEFAULT_CLASS:?} cannot be deleted: VMs created without a class join it \
                 (change its shares, cap or reservation instead)"
            )));
        }
        let mut st = lock(&self.state);
        // VMs being started are already in the scheduler's model, so a class
        // they are joining counts as in use.
        let path = self.cg_path(name);
        self.sched().delete_class(name)?;
        if let Some(cg) = &self.cgroup
            && let Err(e) = cg.remove_class(&path)
        {
            tracing::warn!(class = name, "cgroup backend: {e}");
        }
        st.class_io.remove(name);
        st.class_groups.remove(name);
        st.class_pages.remove(name);
        Ok(())
    }

    /// 422 if a new class `name` would exceed `max_classes` (every class
    /// has an entry in `class_io`).
    pub(super) fn check_class_count(&self, st: &State, name: &str) -> Result<(), ManagerError> {
        if !st.class_io.contains_key(name) && st.class_io.len() >= self.cfg.max_classes {
            return Err(ManagerError::Refused(format!(
                "this daemon has at most {} classes (--max-classes)",
                self.cfg.max_classes
            )));
        }
        Ok(())
    }

    /// Mirrors a class into the cgroup backend (when it is the one in use).
    pub(super) fn cgroup_class(&self, name: &str, cfg: &ClassConfig) {
        if let Some(cg) = &self.cgroup
            && let Err(e) = cg.set_class(&self.cg_path(name), cfg.cpu.shares, cfg.cpu.cap)
        {
            tracing::warn!(class = name, "cgroup backend: {e}");
        }
    }

    /// A class's group for the cgroup backend: its path from the root
    /// class, `/`-separated (nested groups). Takes the scheduler's lock.
    pub(super) fn cg_path(&self, class: &str) -> String {
        let s = self.sched();
        let path = s.model().class_path(class);
        if path.is_empty() {
            class.to_string()
        } else {
            path.join("/")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::manager::test_manager;

    fn cpu(shares: u32, cap: Option<u32>, reservation: Option<u32>) -> ClassConfig {
        ClassConfig {
            cpu: ClassSpec {
                shares,
                cap,
                reservation,
            },
            io: Limits::default(),
        }
    }

    #[test]
    fn create_get_update_delete() {
        let m = test_manager(|_| {});
        let c = m.create_class("web", cpu(200, Some(50), None)).unwrap();
        assert_eq!(c.name, "web");
        assert_eq!(m.get_class("web").unwrap().name, "web");
        let e = m.create_class("web", cpu(100, None, None)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Conflict, "{e}");
        m.update_class("web", |c| c.cpu.shares = 300).unwrap();
        let names: Vec<_> = m.list_classes().into_iter().map(|c| c.name).collect();
        assert_eq!(names, ["default", "web"]);
        m.delete_class("web").unwrap();
        assert_eq!(m.get_class("web").unwrap_err().kind(), ErrorKind::NotFound);
        assert_eq!(
            m.delete_class("web").unwrap_err().kind(),
            ErrorKind::NotFound
        );
        let e = m.update_class("nope", |_| {}).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    }

    #[test]
    fn the_default_class_cannot_be_deleted_but_can_change() {
        let m = test_manager(|_| {});
        let e = m.delete_class(DEFAULT_CLASS).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Conflict, "{e}");
        assert!(m.get_class(DEFAULT_CLASS).is_ok());
        m.update_class(DEFAULT_CLASS, |c| c.cpu.cap = Some(80))
            .unwrap();
        // Without a default class (a daemon configured without one) the
        // same call is a 404, not a 409.
        let m = test_manager(|c| c.initial_classes.clear());
        let e = m.delete_class(DEFAULT_CLASS).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    }

    #[test]
    fn bad_names_and_values_are_invalid() {
        let m = test_manager(|_| {});
        for name in ["", "a b", &"x".repeat(200)] {
            let e = m.create_class(name, cpu(100, None, None)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Invalid, "{name:?}: {e}");
        }
        let e = m.create_class("zero", cpu(0, None, None)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
        let bad_io = ClassConfig {
            io: Limits {
                burst_bytes: Some(1 << 20),
                ..Limits::default()
            },
            ..cpu(100, None, None)
        };
        let e = m.create_class("io", bad_io).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
        assert_eq!(m.get_class("io").unwrap_err().kind(), ErrorKind::NotFound);
        // An update to invalid limits changes nothing.
        let e = m
            .update_class(DEFAULT_CLASS, |c| c.io.burst_ops = Some(8))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
    }

    #[test]
    fn reservations_beyond_capacity_are_refused() {
        // 2 CPUs = 200 %.
        let m = test_manager(|_| {});
        m.create_class("a", cpu(100, None, Some(150))).unwrap();
        let e = m.create_class("b", cpu(100, None, Some(60))).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
        let e = m
            .update_class("a", |c| c.cpu.reservation = Some(250))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
        m.create_class("b", cpu(100, None, Some(50))).unwrap();
    }

    #[test]
    fn max_classes_counts_every_class() {
        let m = test_manager(|c| c.max_classes = 2);
        m.create_class("one", cpu(100, None, None)).unwrap();
        let e = m.create_class("two", cpu(100, None, None)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
        // Replacing an existing class is not a new one.
        let (created, _) = m.set_class("one", cpu(300, None, None)).unwrap();
        assert!(!created);
        m.delete_class("one").unwrap();
        let (created, _) = m.set_class("two", cpu(100, None, None)).unwrap();
        assert!(created);
    }

    #[test]
    fn classes_nest_under_known_parents() {
        let m = test_manager(|_| {});
        m.create_class("team", cpu(100, None, None)).unwrap();
        m.create_class_in("team-a", cpu(100, None, None), Some("team"))
            .unwrap();
        let e = m
            .create_class_in("orphan", cpu(100, None, None), Some("nope"))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
        assert_eq!(m.cg_path("team-a"), "team/team-a");
        // A parent with a child is in use.
        let e = m.delete_class("team").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Conflict, "{e}");
    }
}
