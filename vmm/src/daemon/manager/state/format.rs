//! The state file's format (version 1), its parser and its atomic writer.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::daemon::manager::{DiskRequest, Limits, VmRequest};

/// The format this build writes and reads.
pub const STATE_VERSION: u32 = 1;
/// The state file, in the state directory.
pub const STATE_FILE: &str = "state.json";
/// The previous good state file.
pub const BACKUP_FILE: &str = "state.json.bak";

/// The state file's contents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateFile {
    /// [`STATE_VERSION`].
    pub version: u32,
    /// Classes, parents before their children.
    pub classes: Vec<SavedClass>,
    /// VM definitions.
    pub vms: Vec<SavedVm>,
}

/// A class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedClass {
    /// Name.
    pub name: String,
    /// Parent class; `None` for a root class.
    pub parent: Option<String>,
    /// CPU shares.
    pub shares: u32,
    /// CPU cap, percent of one CPU.
    pub cap: Option<u32>,
    /// CPU reservation, percent of one CPU.
    pub reservation: Option<u32>,
    /// Limits of the class's I/O group (absent = none).
    #[serde(default)]
    pub io: Limits,
}

/// A VM definition, with its current class, weight, cap and disk limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedVm {
    /// Name.
    pub name: String,
    /// Its current class.
    pub class: String,
    /// Its current weight in the class.
    pub weight: u32,
    /// Its own CPU cap, percent of one CPU.
    pub cap: Option<u32>,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest RAM, MiB.
    pub memory_mib: u64,
    /// Kernel file; `None` = the built-in probe guest.
    pub kernel: Option<PathBuf>,
    /// Initial ramdisk.
    pub initrd: Option<PathBuf>,
    /// Kernel command line as requested.
    pub cmdline: Option<String>,
    /// Disks (ids always set).
    pub disks: Vec<DiskRequest>,
    /// Meant to run: created or started, and not stopped, by the API.
    pub running: bool,
    /// The VM process of its current run, if it runs in one: a daemon
    /// started later re-adopts it by its control socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<SavedProcess>,
}

/// A VM process, as the state file records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedProcess {
    /// Its pid when last seen.
    pub pid: u32,
    /// The run's identity, which the process reports on its socket.
    pub nonce: String,
}

impl SavedVm {
    pub(super) fn request(&self) -> VmRequest {
        VmRequest {
            name: Some(self.name.clone()),
            class: self.class.clone(),
            weight: self.weight,
            cap: self.cap,
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            kernel: self.kernel.clone(),
            initrd: self.initrd.clone(),
            cmdline: self.cmdline.clone(),
            disks: self.disks.clone(),
        }
    }
}

/// Reads `dir/state.json` (or, with `from_backup`, `dir/state.json.bak`).
/// `Ok(None)` when the file does not exist (a first start). An error names
/// the file and what is wrong with it.
pub fn read_state(dir: &Path, from_backup: bool) -> Result<Option<StateFile>, String> {
    let path = dir.join(if from_backup { BACKUP_FILE } else { STATE_FILE });
    let text = match fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !from_backup => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    parse_state(&text)
        .map(Some)
        .map_err(|why| format!("{}: {why}", path.display()))
}

/// Parses a state file: its version first, then the rest.
pub fn parse_state(text: &[u8]) -> Result<StateFile, String> {
    let v: serde_json::Value =
        serde_json::from_slice(text).map_err(|e| format!("not valid JSON: {e}"))?;
    match v.get("version").map(serde_json::Value::as_u64) {
        Some(Some(n)) if n == u64::from(STATE_VERSION) => {}
        Some(Some(n)) => {
            return Err(format!(
                "unknown format version {n} (this corral reads version {STATE_VERSION})"
            ));
        }
        _ => return Err("no numeric \"version\" field".into()),
    }
    serde_json::from_value(v).map_err(|e| format!("not a corral state file: {e}"))
}

/// Writes `data` as `dir/state.json` atomically: a temp file, fsync'd; the
/// current file hard-linked to `state.json.bak`; the temp file renamed over
/// `state.json`; the directory fsync'd.
pub(super) fn write_atomic(dir: &Path, data: &[u8]) -> std::io::Result<()> {
    let path = dir.join(STATE_FILE);
    let tmp = dir.join("state.json.tmp");
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    if let Err(e) = f.write_all(data).and_then(|()| f.sync_all()) {
        drop(f);
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    drop(f);
    if fs::symlink_metadata(&path).is_ok() {
        let bak_tmp = dir.join("state.json.bak.tmp");
        let _ = fs::remove_file(&bak_tmp);
        fs::hard_link(&path, &bak_tmp)?;
        fs::rename(&bak_tmp, dir.join(BACKUP_FILE))?;
    }
    fs::rename(&tmp, &path)?;
    File::open(dir)?.sync_all()
}
