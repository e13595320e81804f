//! The exit record (`NAME.exit` beside the control socket): what a VM
//! process that ended leaves for a daemon that was not there to hear it.

use super::VmProcess;
use crate::vm::ExitReason;
use crate::vmproc::proto::ExitRecord;

/// The exit record's file, created empty (0600) before the jail: a jailed
/// process writes its record through this fd when its VM ends.
pub(super) fn open_exit_record(path: &std::path::Path) -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| tracing::warn!(path = %path.display(), "exit record: {e}"))
        .ok()
}

impl VmProcess {
    /// Leaves the exit record of the VM that ended with `reason` and
    /// removes the control socket, if the process has one (`exit_file`:
    /// the record's file opened before the jail).
    pub(super) fn record_exit(&self, reason: &ExitReason, exit_file: Option<&std::fs::File>) {
        let Some(path) = &self.control_socket else {
            return;
        };
        // For a daemon that is not there to hear it: written before the
        // socket goes, so a daemon that finds no socket finds this.
        let rec = ExitRecord {
            name: self.handle.name().to_string(),
            nonce: self.nonce.clone(),
            reason: reason.clone(),
        };
        if let Ok(data) = serde_json::to_vec(&rec) {
            match exit_file {
                // Jailed: the path is out of reach; the file was opened
                // before the jail. The socket stays (a daemon that finds
                // it refusing connections removes it and reads this).
                Some(f) => {
                    use std::io::Write;
                    let _ = (&*f).write_all(&data);
                }
                None => {
                    let _ = std::fs::write(path.with_extension("exit"), data);
                }
            }
        }
        let _ = std::fs::remove_file(path);
    }
}
