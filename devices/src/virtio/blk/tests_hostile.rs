//! Hostile-driver regressions (issue 12): each of these misbehaved before.

use std::sync::atomic::Ordering;
use std::time::Duration;

use vm_memory::{Bytes, GuestAddress};

use super::tests::{BUF, HDR, IOERR, STATUS, engines, harness_on};
use super::*;
use crate::bus::lock;
use crate::guest_log::GuestErrorKind;
use crate::virtio::status;
use crate::virtio::testing::*;

/// Runs the device's queue processing on another thread; fails if it does
/// not return within a few seconds (the old device thread spun forever).
fn process_bounded(h: &Harness) {
    let block = h.block.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        lock(&block).process_queue_polling();
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("queue processing did not return (spinning device thread)");
}

#[test]
fn avail_ring_at_zero_needs_reset_and_does_not_spin() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        // Re-run the bring-up with the available ring at guest address 0,
        // which virtio-queue accepts as valid but then refuses to iterate.
        h.w32(0x70, 0);
        h.w32(0x70, status::ACKNOWLEDGE | status::DRIVER);
        h.w32(0x24, 1);
        h.w32(0x20, 1); // VERSION_1
        let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
        h.w32(0x70, s);
        h.w32(0x38, 256);
        h.w32(0x80, DESC_ADDR as u32);
        h.w32(0x90, 0);
        h.w32(0xa0, USED_ADDR as u32);
        h.w32(0x44, 1);
        assert_eq!(h.r32(0x44), 1);
        h.w32(0x70, s | status::DRIVER_OK);
        // avail->idx (at address 2) says one request is there.
        h.mem.write_obj(1u16, GuestAddress(2)).unwrap();
        process_bounded(&h);
        assert_ne!(h.r32(0x70) & status::DEVICE_NEEDS_RESET, 0);
        assert_eq!(h.r32(0x60) & int_config(), int_config(), "config interrupt");
        // Further notifications do nothing (and log nothing) until reset.
        for _ in 0..1000 {
            process_bounded(&h);
        }
        let log = lock(&h.block).guest_log();
        assert_eq!(log.count(GuestErrorKind::BrokenRing), 1);
        assert!(lock(&h.block).needs_reset());
        // A reset and a proper bring-up heal it.
        h.bring_up(0, 256);
        assert_eq!(h.r32(0x70) & status::DEVICE_NEEDS_RESET, 0);
        assert!(!lock(&h.block).needs_reset());
    }
}

fn int_config() -> u32 {
    crate::virtio::int::CONFIG
}

#[test]
fn four_gib_data_descriptor_gets_ioerr_and_a_used_entry() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        let (s, len) = h.req(request::T_IN, 0, &[(BUF, u32::MAX, true)]);
        assert_eq!((s, len), (IOERR, 1));
        let (s, len) = h.req(request::T_OUT, 0, &[(BUF, u32::MAX, false)]);
        assert_eq!((s, len), (IOERR, 1));
        assert!(
            lock(&h.block)
                .guest_log()
                .count(GuestErrorKind::MalformedRequest)
                >= 2
        );
    }
}

#[test]
fn looping_indirect_table_gets_ioerr() {
    for engine in engines() {
        let (t, mut h) = harness_on(engine);
        let before = super::tests::file_bytes(&t, 0, 512);
        // Indirect table at BUF + 0x1000: header -> data -> status -> header ...
        let table = BUF + 0x1000;
        write_header(&h.mem, HDR, request::T_IN, 0);
        h.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        h.ring.write_desc_at(table, 0, HDR, 16, F_NEXT, 1);
        h.ring
            .write_desc_at(table, 1, BUF, 512, F_NEXT | F_WRITE, 2);
        h.ring
            .write_desc_at(table, 2, STATUS, 1, F_NEXT | F_WRITE, 0);
        h.ring.write_desc(0, table, 48, F_INDIRECT, 0);
        h.ring.publish(0);
        h.process();
        assert_eq!(h.ring.used_idx(), 1);
        assert_eq!(read_u8(&h.mem, STATUS), IOERR);
        // The same chain as a write must not reach the disk either.
        write_header(&h.mem, HDR, request::T_OUT, 0);
        h.ring.write_desc_at(table, 1, BUF, 512, F_NEXT, 2);
        h.ring.publish(0);
        h.process();
        assert_eq!(h.ring.used_idx(), 2);
        assert_eq!(read_u8(&h.mem, STATUS), IOERR);
        assert_eq!(super::tests::file_bytes(&t, 0, 512), before);
        let st = lock(&h.block).stats();
        assert_eq!(st.read_ops.load(Ordering::Relaxed), 0);
        assert_eq!(st.write_ops.load(Ordering::Relaxed), 0);
    }
}

#[test]
fn looping_direct_chain_gets_ioerr() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        write_header(&h.mem, HDR, request::T_IN, 0);
        h.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        h.ring.write_desc(0, HDR, 16, F_NEXT, 1);
        h.ring.write_desc(1, BUF, 512, F_NEXT | F_WRITE, 2);
        h.ring.write_desc(2, STATUS, 1, F_NEXT | F_WRITE, 0);
        h.ring.publish(0);
        h.process();
        assert_eq!(h.ring.used_idx(), 1);
        assert_eq!(read_u8(&h.mem, STATUS), IOERR);
    }
}

#[test]
fn head_beyond_the_table_needs_reset() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        h.ring.publish(300);
        h.process();
        assert_ne!(h.r32(0x70) & status::DEVICE_NEEDS_RESET, 0);
        assert_eq!(h.ring.used_idx(), 0);
    }
}

#[test]
fn chain_cut_off_by_a_bad_next_has_no_known_status() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        // header -> data (next = 300, beyond the table): the status descriptor
        // cannot be reached, and the device must not guess one in the data.
        write_header(&h.mem, HDR, request::T_IN, 0);
        h.mem.write_obj(0x77u8, GuestAddress(BUF + 511)).unwrap();
        h.ring.write_desc(0, HDR, 16, F_NEXT, 1);
        h.ring.write_desc(1, BUF, 512, F_NEXT | F_WRITE, 300);
        h.ring.publish(0);
        h.process();
        assert_eq!(h.ring.used_idx(), 1);
        assert_eq!(h.ring.used(0).1, 0);
        assert_eq!(read_u8(&h.mem, BUF + 511), 0x77);
    }
}

#[test]
fn undefined_status_bits_are_refused() {
    for engine in engines() {
        let (_t, mut h) = harness_on(engine);
        h.w32(0x70, 0);
        h.w32(0x70, 0xfeec_1513);
        assert_eq!(h.r32(0x70), 0);
        h.w32(0x70, status::ACKNOWLEDGE | 0x10);
        assert_eq!(h.r32(0x70), 0);
    }
}
