//! Fuzzes the whole virtio-blk device behind a guest-memory image: the
//! input becomes the descriptor table, rings, headers, data and indirect
//! tables in guest memory; the device is brought up and serves the queue
//! (see `corral_devices::virtio::fuzz_targets::device`). Any panic is a bug.
//!
//! `cargo +nightly fuzz run blk_device -- -max_total_time=60` (from
//! `devices/`); on stable, `fuzz_smoke_stable` runs the same code.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    corral_devices::virtio::fuzz_targets::device(data);
});
