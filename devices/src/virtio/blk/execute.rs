//! Executing a parsed request against the disk and completing it:
//! synchronously, or by handing it to the io_uring engine ([`Engine::submit`])
//! and completing it when it is reaped ([`Engine::complete_done`]).

use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::backend::Inline;
use super::queue::break_ring;
use super::request::{self, Malformed, Request, RequestType};
use super::stats::add;
use super::throttle::{Nanos, OpKind, RequestThrottle, monotonic_ns};
use super::uring::{Done, Slot};
use super::{
    Active, Engine, MAX_DISCARD_SECTORS, MAX_DISCARD_SEG, SECTOR_SIZE, WZ_UNMAP, blk_status,
    feature,
};
use crate::guest_log::GuestErrorKind;

/// What [`Engine::submit`] did with a request.
enum Taken {
    /// On the ring; [`Engine::complete_done`] finishes it.
    Queued,
    /// Done on the device thread (an inline write): its status.
    Inline(u8),
    /// Not taken: execute it synchronously.
    No,
}

impl Engine {
    fn finish(&self, act: &mut Active, head: u16, status: Option<(GuestAddress, u8)>, len: u32) {
        if let Some((addr, s)) = status
            && act.mem.write_obj(s, addr).is_err()
        {
            // Checked at parse time; cannot happen.
            add(&self.stats.no_status, 1);
        }
        if let Err(e) = act.queue.add_used(&act.mem, head, len) {
            break_ring(act, self, format_args!("cannot add a used entry: {e}"));
        }
    }

    pub(super) fn malformed(&self, act: &mut Active, m: Malformed) {
        match m.status {
            Some(addr) => {
                self.log.report(
                    GuestErrorKind::MalformedRequest,
                    format_args!(
                        "virtio-blk: malformed request (head {}): {}",
                        m.head, m.error
                    ),
                );
                add(&self.stats.malformed, 1);
                add(&self.stats.io_errors, 1);
                self.finish(act, m.head, Some((addr, blk_status::IOERR)), 1);
            }
            None => {
                self.log.report(
                    GuestErrorKind::NoStatus,
                    format_args!(
                        "virtio-blk: request without a status byte (head {}): {}",
                        m.head, m.error
                    ),
                );
                add(&self.stats.no_status, 1);
                self.finish(act, m.head, None, 0);
            }
        }
    }

    /// Executes `req` and puts it in the used ring (true) — or, on the
    /// io_uring engine, submits it (false; [`Engine::complete_done`]
    /// finishes it).
    pub(super) fn complete(
        &mut self,
        act: &mut Active,
        throttle: Option<&mut (dyn RequestThrottle + 'static)>,
        req: &Request,
        taken_at: Nanos,
    ) -> bool {
        let (status, written) = match self.submit(act, req, taken_at) {
            Taken::Queued => return false,
            Taken::Inline(status) => (status, 0),
            Taken::No => self.execute(&act.mem, req),
        };
        self.done(act, throttle, req, taken_at, status, written);
        true
    }

    /// Queues `req` on the io_uring engine if it takes it (reads and writes
    /// that need no bounce, flushes), after trying a page-cache disk's
    /// write inline ([`DiskFile::write_inline`]).
    fn submit(&mut self, act: &Active, req: &Request, taken_at: Nanos) -> Taken {
        if self.uring.is_none() {
            return Taken::No;
        }
        let (mut offset, mut iov) = match req.kind {
            RequestType::In | RequestType::Out if req.data_len > 0 => {
                let Some(off) = self.range(req.sector, req.data_len) else {
                    return Taken::No;
                };
                let write = req.kind == RequestType::Out;
                match self.disk.uring_iov(&act.mem, &req.data, off, write) {
                    Some(iov) => (off, iov),
                    None => return Taken::No,
                }
            }
            RequestType::Flush => (0, Vec::new()),
            _ => return Taken::No,
        };
        let mut pre = 0;
        if req.kind == RequestType::Out && !self.disk.direct() {
            // SAFETY: the iovecs came from `uring_iov` over `act.mem`,
            // borrowed (so mapped) for the call.
            match unsafe { self.disk.write_inline(&mut iov, offset) } {
                Inline::Done => {
                    add(&self.stats.write_ops, 1);
                    add(&self.stats.write_bytes, req.data_len);
                    return Taken::Inline(blk_status::OK);
                }
                Inline::Failed(e) => {
                    let k = GuestErrorKind::HostIo;
                    let msg = format_args!("write at {offset:#x} failed: {e}");
                    return Taken::Inline(self.refuse(k, msg));
                }
                Inline::Rest(n) => {
                    pre = n;
                    offset += n;
                }
            }
        }
        let slot = Slot {
            req: req.clone(),
            taken_at,
            offset,
            pre,
            iov,
            _mem: act.mem.clone(),
        };
        let fd = self.disk.raw_fd();
        match self.uring.as_mut() {
            Some(u) => match u.push(fd, slot) {
                None => Taken::Queued,
                // Every slot busy: finish the write's rest here (the
                // request's first `pre` bytes are written already).
                Some(mut slot) if pre > 0 => {
                    // SAFETY: as above.
                    let r = unsafe { self.disk.finish_short(&mut slot.iov, 0, offset, true) };
                    Taken::Inline(self.status_of_write(r, req, offset))
                }
                Some(_) => Taken::No,
            },
            None => Taken::No,
        }
    }

    /// Counts a write's outcome; its status.
    fn status_of_write(&self, r: std::io::Result<()>, req: &Request, off: u64) -> u8 {
        match r {
            Ok(()) => {
                add(&self.stats.write_ops, 1);
                add(&self.stats.write_bytes, req.data_len);
                blk_status::OK
            }
            Err(e) => {
                let k = GuestErrorKind::HostIo;
                self.refuse(k, format_args!("write at {off:#x} failed: {e}"))
            }
        }
    }

    /// Completes a request the io_uring engine finished.
    pub(super) fn complete_done(
        &mut self,
        act: &mut Active,
        throttle: Option<&mut (dyn RequestThrottle + 'static)>,
        d: Done,
    ) {
        let Done { mut slot, res } = d;
        let st = self.stats.clone();
        let req = &slot.req;
        let (status, written) = match req.kind {
            RequestType::Flush if res >= 0 => {
                add(&st.flush_ops, 1);
                (blk_status::OK, 0)
            }
            RequestType::Flush => {
                let e = std::io::Error::from_raw_os_error(-res);
                let k = GuestErrorKind::HostIo;
                (self.refuse(k, format_args!("fdatasync failed: {e}")), 0)
            }
            kind => {
                let write = kind == RequestType::Out;
                let want = req.data_len;
                // What the ring was given: the request less the inline
                // try's short write.
                let rest = want.saturating_sub(slot.pre);
                let r = match u64::try_from(res) {
                    Err(_) => Err(std::io::Error::from_raw_os_error(-res)),
                    Ok(n) if n >= rest => Ok(()),
                    Ok(0) => Err(std::io::ErrorKind::UnexpectedEof.into()),
                    // SAFETY: the iovecs came from `uring_iov` over guest
                    // memory that `slot.mem` keeps mapped.
                    Ok(n) => unsafe {
                        self.disk
                            .finish_short(&mut slot.iov, n as usize, slot.offset, write)
                    },
                };
                let off = slot.offset;
                match (r, write) {
                    (Ok(()), false) => {
                        add(&st.read_ops, 1);
                        add(&st.read_bytes, want);
                        (blk_status::OK, want)
                    }
                    (Ok(()), true) => {
                        add(&st.write_ops, 1);
                        add(&st.write_bytes, want);
                        (blk_status::OK, 0)
                    }
                    (Err(e), w) => {
                        let k = GuestErrorKind::HostIo;
                        let what = if w { "write" } else { "read" };
                        (
                            self.refuse(k, format_args!("{what} at {off:#x} failed: {e}")),
                            0,
                        )
                    }
                }
            }
        };
        self.done(act, throttle, &slot.req, slot.taken_at, status, written);
    }

    /// Counts the outcome, puts the request in the used ring, and tells the
    /// throttle its latency.
    fn done(
        &self,
        act: &mut Active,
        throttle: Option<&mut (dyn RequestThrottle + 'static)>,
        req: &Request,
        taken_at: Nanos,
        status: u8,
        written: u64,
    ) {
        match status {
            blk_status::OK => {}
            blk_status::UNSUPP => add(&self.stats.unsupported, 1),
            _ => add(&self.stats.io_errors, 1),
        }
        // Used length: bytes written into the chain, status included.
        let len = u32::try_from(written).map_or(u32::MAX, |w| w.saturating_add(1));
        self.finish(act, req.head, Some((req.status, status)), len);
        if let Some(g) = throttle {
            let kind = match req.kind {
                RequestType::In => OpKind::Read,
                RequestType::Out => OpKind::Write,
                _ => OpKind::Other,
            };
            g.record_latency(kind, monotonic_ns().saturating_sub(taken_at));
        }
    }

    /// Reports a refused request through the guest log; returns IOERR.
    fn refuse(&self, kind: GuestErrorKind, msg: std::fmt::Arguments<'_>) -> u8 {
        self.log
            .report(kind, format_args!("virtio-blk: request refused: {msg}"));
        blk_status::IOERR
    }

    fn out_of_range(&self, req: &Request) -> u8 {
        let (s, n) = (req.sector, req.data_len);
        let k = GuestErrorKind::OutOfRange;
        self.refuse(k, format_args!("{n} bytes at sector {s} beyond the disk"))
    }

    fn read_only(&self, req: &Request) -> u8 {
        let k = GuestErrorKind::ReadOnly;
        self.refuse(k, format_args!("{:?} on a read-only disk", req.kind))
    }

    fn unsupported(&self, req: &Request) -> u8 {
        let k = GuestErrorKind::Unsupported;
        self.refuse(k, format_args!("type {:?} not supported", req.kind));
        blk_status::UNSUPP
    }

    /// Byte offset of a range of `len` bytes at `sector`, if inside the disk.
    fn range(&self, sector: u64, len: u64) -> Option<u64> {
        let off = sector.checked_mul(SECTOR_SIZE)?;
        (off.checked_add(len)? <= self.disk.capacity()).then_some(off)
    }

    /// Returns (status, bytes written to guest data buffers).
    fn execute(&mut self, mem: &GuestMemoryMmap, req: &Request) -> (u8, u64) {
        let st = self.stats.clone();
        match req.kind {
            RequestType::In => {
                let Some(off) = self.range(req.sector, req.data_len) else {
                    return (self.out_of_range(req), 0);
                };
                match self.disk.read(mem, &req.data, off) {
                    Ok(()) => {
                        add(&st.read_ops, 1);
                        add(&st.read_bytes, req.data_len);
                        (blk_status::OK, req.data_len)
                    }
                    Err(e) => {
                        let k = GuestErrorKind::HostIo;
                        (
                            self.refuse(k, format_args!("read at {off:#x} failed: {e}")),
                            0,
                        )
                    }
                }
            }
            RequestType::Out => {
                if self.disk.read_only() {
                    return (self.read_only(req), 0);
                }
                let Some(off) = self.range(req.sector, req.data_len) else {
                    return (self.out_of_range(req), 0);
                };
                match self.disk.write(mem, &req.data, off) {
                    Ok(()) => {
                        add(&st.write_ops, 1);
                        add(&st.write_bytes, req.data_len);
                        (blk_status::OK, 0)
                    }
                    Err(e) => {
                        let k = GuestErrorKind::HostIo;
                        (
                            self.refuse(k, format_args!("write at {off:#x} failed: {e}")),
                            0,
                        )
                    }
                }
            }
            RequestType::Flush => match self.disk.flush() {
                Ok(()) => {
                    add(&st.flush_ops, 1);
                    (blk_status::OK, 0)
                }
                Err(e) => {
                    let k = GuestErrorKind::HostIo;
                    (self.refuse(k, format_args!("fdatasync failed: {e}")), 0)
                }
            },
            RequestType::GetId => {
                let n = req.data_len.min(20) as usize;
                let mut cursor = 0usize;
                for s in &req.data {
                    if cursor >= n {
                        break;
                    }
                    let k = (s.len as usize).min(n - cursor);
                    if mem
                        .write_slice(&self.serial[cursor..cursor + k], s.addr)
                        .is_err()
                    {
                        return (blk_status::IOERR, cursor as u64);
                    }
                    cursor += k;
                }
                add(&st.other_ops, 1);
                (blk_status::OK, n as u64)
            }
            RequestType::Discard | RequestType::WriteZeroes => {
                let wz = req.kind == RequestType::WriteZeroes;
                let bit = if wz {
                    feature::WRITE_ZEROES
                } else {
                    feature::DISCARD
                };
                if self.acked & bit == 0 {
                    return (self.unsupported(req), 0);
                }
                if self.disk.read_only() {
                    return (self.read_only(req), 0);
                }
                let status = self.ranges(mem, req, wz);
                if status == blk_status::OK {
                    add(&st.other_ops, 1);
                }
                (status, 0)
            }
            RequestType::Unsupported(_) => (self.unsupported(req), 0),
        }
    }

    /// Discard / write-zeroes: validates every range first, then applies.
    fn ranges(&mut self, mem: &GuestMemoryMmap, req: &Request, wz: bool) -> u8 {
        let count = req.data_len / request::RANGE_LEN;
        if count == 0 || count > u64::from(MAX_DISCARD_SEG) {
            let k = GuestErrorKind::MalformedRequest;
            return self.refuse(k, format_args!("{count} discard/write-zeroes ranges"));
        }
        let mut raw = vec![0u8; req.data_len as usize];
        let mut at = 0;
        for s in &req.data {
            let k = s.len as usize;
            if mem.read_slice(&mut raw[at..at + k], s.addr).is_err() {
                return blk_status::IOERR;
            }
            at += k;
        }
        let mut ranges = Vec::with_capacity(count as usize);
        for r in raw.chunks_exact(request::RANGE_LEN as usize) {
            let sector = u64::from_le_bytes(r[0..8].try_into().unwrap());
            let num = u32::from_le_bytes(r[8..12].try_into().unwrap());
            let flags = u32::from_le_bytes(r[12..16].try_into().unwrap());
            let allowed = if wz { WZ_UNMAP } else { 0 };
            if flags & !allowed != 0 {
                let k = GuestErrorKind::Unsupported;
                self.refuse(k, format_args!("range flags {flags:#x}"));
                return blk_status::UNSUPP;
            }
            let len = u64::from(num) * SECTOR_SIZE;
            let off = self
                .range(sector, len)
                .filter(|_| num <= MAX_DISCARD_SECTORS);
            let Some(off) = off else {
                let k = GuestErrorKind::OutOfRange;
                return self.refuse(k, format_args!("range of {num} sectors at {sector}"));
            };
            ranges.push((off, len, flags & WZ_UNMAP != 0));
        }
        for (off, len, unmap) in ranges {
            let r = if wz {
                self.disk.write_zeroes(off, len, unmap)
            } else {
                self.disk.discard(off, len)
            };
            if let Err(e) = r {
                let k = GuestErrorKind::HostIo;
                return self.refuse(k, format_args!("discard/write-zeroes failed: {e}"));
            }
        }
        blk_status::OK
    }
}
