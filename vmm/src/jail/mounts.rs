//! The private root: the VM's files and `/dev/kvm` on a tmpfs, then
//! `pivot_root` into it and the old root detached.
//!
//! A file opened in the host's mount namespace cannot be bind-mounted by
//! its `/proc/self/fd/N` path from a new mount namespace: `mount(2)`
//! refuses a source whose mount belongs to another namespace (EINVAL,
//! checked on this host's 6.18 kernel). So each file's mount is cloned
//! from its fd with `open_tree(OPEN_TREE_CLONE)` *before* `unshare` (a
//! detached mount, which any namespace may attach), and attached with
//! `move_mount` after. The mount is made from the open fd, never from a
//! path: what is mounted is the file the caller checked and locked.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{CWD, Mode, OFlags};
use rustix::mount::{
    MountFlags, MountPropagationFlags, MoveMountFlags, OpenTreeFlags, UnmountFlags,
};

use super::error::{JailError, Step, at};
use super::spec::JailFile;

/// The detached mounts of the files and of the KVM device, cloned in the
/// host's mount namespace.
pub(super) struct Trees {
    files: Vec<(String, OwnedFd, bool)>,
    kvm: OwnedFd,
}

fn clone_tree(fd: BorrowedFd<'_>, name: &str) -> Result<OwnedFd, JailError> {
    rustix::mount::open_tree(
        fd,
        "",
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC
            | OpenTreeFlags::AT_EMPTY_PATH,
    )
    .map_err(at(Step::CloneMount(name.to_string())))
}

/// Clones the mounts of `files` and of `kvm` (before `unshare`).
pub(super) fn clone_trees(files: &[JailFile<'_>], kvm: BorrowedFd<'_>) -> Result<Trees, JailError> {
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        out.push((f.name.clone(), clone_tree(f.fd, &f.name)?, f.read_only));
    }
    Ok(Trees {
        files: out,
        kvm: clone_tree(kvm, "dev/kvm")?,
    })
}

/// Makes every mount of the new namespace private: nothing mounted here
/// reaches the host, nothing the host mounts later reaches the jail.
pub(super) fn make_private() -> Result<(), JailError> {
    rustix::mount::mount_change(
        "/",
        MountPropagationFlags::PRIVATE | MountPropagationFlags::REC,
    )
    .map_err(at(Step::PrivatePropagation))
}

fn mount_point(root: &OwnedFd, name: &str) -> Result<(), JailError> {
    rustix::fs::openat(
        root,
        name,
        OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::empty(),
    )
    .map(drop)
    .map_err(at(Step::MountPoint(name.to_string())))
}

fn attach(
    root: &OwnedFd,
    staging: &Path,
    name: &str,
    tree: &OwnedFd,
    flags: MountFlags,
) -> Result<(), JailError> {
    mount_point(root, name)?;
    rustix::mount::move_mount(
        tree.as_fd(),
        "",
        root,
        name,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )
    .map_err(at(Step::AttachMount(name.to_string())))?;
    // A bind mount keeps its source's flags; MS_REMOUNT|MS_BIND sets this
    // mount's own (read-only for a read-only image) without touching the
    // host's filesystem.
    rustix::mount::mount_remount(staging.join(name), MountFlags::BIND | flags, "")
        .map_err(at(Step::RemountFile(name.to_string())))
}

/// Mounts a tmpfs on `staging`, attaches the files at `/NAME` and the KVM
/// device at `/dev/kvm`, remounts the tmpfs read-only, and pivots into it
/// with the old root detached. Afterwards `/` holds only those.
pub(super) fn build_root(staging: &Path, trees: Trees) -> Result<(), JailError> {
    let sdisp = staging.display().to_string();
    // Size: nothing is ever written to it; inodes: the root, dev, the
    // mount points.
    let data = std::ffi::CString::new(format!(
        "mode=0755,size=16k,nr_inodes={}",
        trees.files.len() + 8
    ))
    .map_err(|e| at(Step::MountRoot(sdisp.clone()))(std::io::Error::other(e)))?;
    rustix::mount::mount(
        "corral-jail",
        staging,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        data.as_c_str(),
    )
    .map_err(at(Step::MountRoot(sdisp.clone())))?;
    let root = rustix::fs::openat(
        CWD,
        staging,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::empty(),
    )
    .map_err(at(Step::MountRoot(sdisp.clone())))?;
    let no_exec = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
    for (name, tree, ro) in &trees.files {
        let flags = if *ro {
            no_exec | MountFlags::RDONLY
        } else {
            no_exec
        };
        attach(&root, staging, name, tree, flags)?;
    }
    rustix::fs::mkdirat(&root, "dev", Mode::from_raw_mode(0o755))
        .map_err(at(Step::MountPoint("dev".into())))?;
    // The device node keeps its host mode and owner (root:kvm 0660): the
    // jailed uid cannot open it again; it uses the fd opened before the
    // drop.
    attach(
        &root,
        staging,
        "dev/kvm",
        &trees.kvm,
        MountFlags::NOSUID | MountFlags::NOEXEC,
    )?;
    rustix::mount::mount_remount(
        staging,
        MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        "",
    )
    .map_err(at(Step::RemountRoot))?;

    rustix::process::fchdir(&root).map_err(at(Step::PivotRoot))?;
    // pivot_root(".", "."): the old root ends up mounted on top of the new
    // one, and detaching "." removes it (pivot_root(2), NOTES).
    rustix::process::pivot_root(".", ".").map_err(at(Step::PivotRoot))?;
    rustix::mount::unmount(".", UnmountFlags::DETACH).map_err(at(Step::DetachOldRoot))?;
    rustix::process::chdir("/").map_err(at(Step::DetachOldRoot))?;
    Ok(())
}
