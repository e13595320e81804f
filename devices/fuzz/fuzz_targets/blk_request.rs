//! Fuzzes virtio-blk request parsing and execution: the input becomes the
//! queue configuration, descriptor table, available ring, request headers
//! and data in guest memory, plus a few MMIO register writes (see
//! `corral_devices::virtio::testing::fuzz`). Any panic is a bug.
//!
//! `cargo +nightly fuzz run blk_request -- -max_total_time=60`
//! (from `devices/`). On stable the same logic runs as the unit test
//! `fuzz_smoke_stable` (`CORRAL_FUZZ_SECS=30 cargo test -p corral-devices
//! --release fuzz_smoke_stable`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    corral_devices::virtio::testing::fuzz::run(data);
});
