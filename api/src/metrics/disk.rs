//! The disks' device counters (`BlockStats`): what the virtio-blk device
//! completed and what it refused, by VM and disk. The throttle's view of the
//! same disks (admitted requests, waits, latency) is in `corral_disk_ops` and
//! its neighbours.

use corral_vmm::manager::Manager;

use super::expo::{Reg, l, with};

/// Registers the device counter families of every running VM's disks.
pub(super) fn register(r: &mut Reg, m: &Manager) {
    let done = r.counts(
        "corral_disk_device_requests",
        "Requests the disk's virtio-blk device completed, by op (read, write, flush, other)",
    );
    let bytes = r.counts(
        "corral_disk_device_bytes",
        "Bytes the disk's virtio-blk device read or wrote for the guest, by op",
    );
    let io_errors = r.counts(
        "corral_disk_io_errors",
        "Requests answered VIRTIO_BLK_S_IOERR (host I/O errors, out-of-range and malformed requests)",
    );
    let unsupported = r.counts(
        "corral_disk_unsupported_requests",
        "Requests answered VIRTIO_BLK_S_UNSUPP (unknown request types)",
    );
    let malformed = r.counts(
        "corral_disk_malformed_requests",
        "Malformed request chains from the guest (bad layout, buffers outside its memory, ...)",
    );
    let no_status = r.counts(
        "corral_disk_no_status_requests",
        "Request chains without a status byte, returned unanswered",
    );
    let waits = r.counts(
        "corral_disk_throttle_waits",
        "Times a request had to wait for the disk's throttle",
    );
    let broken = r.counts(
        "corral_disk_broken_rings",
        "Times the guest's ring was found broken and the device asked for a reset",
    );
    for (vm, disk, s) in m.disk_device_stats() {
        let base = l(&[("vm", &vm), ("disk", &disk)]);
        for (op, n) in [
            ("read", s.read_ops),
            ("write", s.write_ops),
            ("flush", s.flush_ops),
            ("other", s.other_ops),
        ] {
            done.set(with(&base, "op", op), n);
        }
        bytes.set(with(&base, "op", "read"), s.read_bytes);
        bytes.set(with(&base, "op", "write"), s.write_bytes);
        io_errors.set(base.clone(), s.io_errors);
        unsupported.set(base.clone(), s.unsupported);
        malformed.set(base.clone(), s.malformed);
        no_status.set(base.clone(), s.no_status);
        waits.set(base.clone(), s.throttled);
        broken.set(base, s.broken_rings);
    }
}
