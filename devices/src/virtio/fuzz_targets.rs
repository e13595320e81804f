//! Fuzz targets beyond request parsing (`testing::fuzz`): the virtio-mmio
//! transport driven by register sequences, and the whole block device
//! behind a guest-memory image. Shared by the `cargo fuzz` targets in
//! `devices/fuzz` (`mmio_transport`, `blk_device`) and the stable smoke
//! test `fuzz_smoke_stable`. Each checks invariants after every step; any
//! panic is a bug.

use std::cell::RefCell;

use vm_memory::{Bytes, GuestAddress};

use super::blk::IoEngine;
use super::testing::fuzz::{Input, MEM_SIZE, State, engine_of, new_state};
use super::testing::{AVAIL_ADDR, DATA_ADDR, DESC_ADDR, Harness, USED_ADDR};
use super::{features, status};
use crate::bus::{BusDevice, lock};

thread_local! {
    static STATE: RefCell<[Option<State>; 2]> = const { RefCell::new([None, None]) };
}

/// Runs `f` on the harness of `data`'s engine (both engines are fuzzed:
/// [`engine_of`]).
fn with_harness(data: &[u8], f: impl FnOnce(&mut Harness)) {
    let engine = engine_of(data);
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let st = s[usize::from(engine == IoEngine::Uring)].get_or_insert_with(|| new_state(engine));
        f(&mut st.h);
    });
}

fn used_idx(h: &Harness) -> u16 {
    h.mem
        .read_obj::<u16>(GuestAddress(USED_ADDR + 2))
        .unwrap_or(0)
}

/// Serves the queue as the device thread does, and checks that a device in
/// `DEVICE_NEEDS_RESET` serves nothing and, if `counted` (the used index in
/// memory is the device's own since the last bring-up), that one pass uses
/// at most [`BUDGET`](crate::virtio::blk::BUDGET) entries.
fn serve(h: &mut Harness, counted: bool) {
    let before = used_idx(h);
    let broken = h.r32(0x70) & status::DEVICE_NEEDS_RESET != 0;
    {
        // A pass, then its io_uring completions (nothing is in flight
        // before it: every pass here ends so).
        let mut b = lock(&h.block);
        b.process_queue();
        b.wait_io();
    }
    let done = used_idx(h).wrapping_sub(before);
    if broken {
        assert_eq!(done, 0, "a device needing reset served requests");
    }
    // At most the budget per pass (not the queue size: a read into the
    // available ring publishes more requests mid-pass, as a driver may).
    if counted {
        let budget = crate::virtio::blk::BUDGET;
        assert!(
            usize::from(done) <= budget,
            "{done} used entries in one pass"
        );
    }
}

fn clear_used_idx(h: &Harness) {
    h.mem.write_obj(0u16, GuestAddress(USED_ADDR + 2)).unwrap();
}

/// The transport: an input is a sequence of register accesses (any offset,
/// width and value, config space included), guest-memory pokes into the
/// rings, device-thread passes and resets, with now and then a proper
/// bring-up step so that deep states are reached.
pub fn mmio(data: &[u8]) {
    with_harness(data, |h| mmio_on(h, data));
}

fn mmio_on(h: &mut Harness, data: &[u8]) {
    let mut u = Input(data);
    h.w32(0x70, 0);
    assert_eq!(h.r32(0x70), 0, "status after reset");
    h.mem
        .write_slice(&[0u8; 0x4000], GuestAddress(DESC_ADDR))
        .unwrap();
    let mut steps = 0;
    while !u.is_empty() && steps < 512 {
        steps += 1;
        let op = u.u8();
        match op % 10 {
            0..=2 => {
                let off = u64::from(u.u16() % 0x180);
                let v = u.u64().to_le_bytes();
                let width = [4usize, 4, 1, 2, 8, 3][usize::from(op >> 4) % 6];
                h.transport.write(off, &v[..width]);
            }
            3 => {
                let off = u64::from(u.u16() % 0x180);
                let mut b = [0u8; 8];
                let width = [4usize, 1, 2, 8][usize::from(op >> 4) % 4];
                h.transport.read(off, &mut b[..width]);
            }
            4 => {
                // A word of the descriptor table or the available ring.
                let at = DESC_ADDR + u64::from(u.u16()) % (USED_ADDR - DESC_ADDR);
                let v = u.u32();
                let _ = h.mem.write_obj(v, GuestAddress(at));
            }
            5 => serve(h, false),
            6 => {
                h.w32(0x70, 0);
                assert_eq!(h.r32(0x70), 0, "status after reset");
                assert_eq!(h.r32(0x44), 0, "queue ready after reset");
            }
            7 => {
                // Queue registers as a driver would set them, with a size
                // from the input.
                h.w32(0x30, 0);
                h.w32(0x38, u32::from(u.u16()));
                h.w32(0x80, DESC_ADDR as u32);
                h.w32(0x90, AVAIL_ADDR as u32);
                h.w32(0xa0, USED_ADDR as u32);
                h.w32(0x44, 1);
            }
            8 => {
                let s = [
                    status::ACKNOWLEDGE,
                    status::ACKNOWLEDGE | status::DRIVER,
                    status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
                    status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK,
                ][usize::from(op >> 4) % 4];
                if op & 0x80 != 0 {
                    // The features a driver would accept.
                    h.w32(0x24, 1);
                    h.w32(0x20, (features::VERSION_1 >> 32) as u32);
                }
                h.w32(0x70, s);
            }
            _ => {
                // A notify (through the MMIO exit path) then a pass.
                h.w32(0x50, u32::from(u.u8() % 3));
                serve(h, false);
            }
        }
        // The driver never sees a status with bits it may not set unless
        // the device set NEEDS_RESET itself.
        let st = h.r32(0x70);
        assert_eq!(st & !0xcf, 0, "status {st:#x} has bits outside the spec's");
        let ready = h.r32(0x44);
        assert!(ready <= 1, "QueueReady reads {ready}");
    }
}

/// The whole device behind a guest-memory image: the input's first byte
/// picks the queue size and features, the rest is copied into guest memory
/// as the available ring, the descriptor table and the data area (headers,
/// data, indirect tables: whatever the fuzzer makes of it). The device is brought
/// up and serves the queue twice, with a reset or a notify between.
pub fn device(data: &[u8]) {
    with_harness(data, |h| device_on(h, data));
}

fn device_on(h: &mut Harness, data: &[u8]) {
    let mut u = Input(data);
    let cfg = u.u8();
    let qsize = 1u16 << (cfg % 9);
    let drop = if cfg & 0x10 != 0 {
        features::RING_EVENT_IDX
    } else {
        0
    } | if cfg & 0x20 != 0 {
        features::RING_INDIRECT_DESC
    } else {
        0
    };
    h.mem
        .write_slice(&[0u8; 0x4000], GuestAddress(DESC_ADDR))
        .unwrap();
    h.bring_up(drop, qsize);
    // The image in three pieces, so that short inputs reach every part:
    // the available ring (flags, idx, 8 entries), 32 descriptors, then
    // headers, data and indirect tables at DATA_ADDR.
    let rest = u.0;
    let (avail, rest) = rest.split_at(rest.len().min(20));
    let (descs, rest) = rest.split_at(rest.len().min(32 * 16));
    let rest = &rest[..rest.len().min(MEM_SIZE - DATA_ADDR as usize)];
    h.mem.write_slice(avail, GuestAddress(AVAIL_ADDR)).unwrap();
    h.mem.write_slice(descs, GuestAddress(DESC_ADDR)).unwrap();
    h.mem.write_slice(rest, GuestAddress(DATA_ADDR)).unwrap();
    clear_used_idx(h);
    serve(h, true);
    if cfg & 0x40 != 0 {
        h.bring_up(drop, qsize);
        clear_used_idx(h);
    } else {
        h.w32(0x50, 0);
    }
    serve(h, true);
    assert_eq!(
        lock(&h.block).capacity_sectors(),
        (1 << 20) / 512,
        "the disk changed size"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_run_on_empty_and_short_inputs() {
        for d in [&[][..], &[0], &[5, 0, 0, 0, 0], &[0xff; 64]] {
            mmio(d);
            device(d);
        }
    }
}
