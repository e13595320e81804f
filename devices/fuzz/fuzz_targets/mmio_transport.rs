//! Fuzzes the virtio-mmio transport: register write/read sequences of any
//! offset and width, queue setup, ring pokes, device-thread passes and
//! resets at any point (see `corral_devices::virtio::fuzz_targets::mmio`
//! for the invariants checked). Any panic is a bug.
//!
//! `cargo +nightly fuzz run mmio_transport -- -max_total_time=60` (from
//! `devices/`); on stable, `fuzz_smoke_stable` runs the same code.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    corral_devices::virtio::fuzz_targets::mmio(data);
});
