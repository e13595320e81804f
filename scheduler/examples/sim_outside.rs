//! The simulator with an outside busy loop: two classes at shares 3:1, hog
//! VMs of 1, 2 or 4 vCPUs, with and without measuring the outside load.

use corral_scheduler::model::{Capacity, ClassSpec};
use corral_scheduler::sim::{Pattern, SimConfig, Simulator};
fn main() {
    for (vcpus, loops) in [(2, 1), (1, 1), (2, 2), (4, 1), (2, 0)] {
        for measure in [true, false] {
            let mut s = Simulator::new(
                Capacity::from_cpus(2),
                SimConfig {
                    park_latency_ns: 4_000_000,
                    stat_jiffy_ns: 10_000_000,
                    measure_outside: measure,
                    ..SimConfig::default()
                },
            );
            s.create_class("gold", ClassSpec::new(3)).unwrap();
            s.create_class("bronze", ClassSpec::new(1)).unwrap();
            s.add_vm("gold", 100, vcpus, Pattern::Hog).unwrap();
            s.add_vm("bronze", 100, vcpus, Pattern::Hog).unwrap();
            s.set_outside_load(loops);
            s.run_for(2_000_000_000);
            s.reset_counters();
            s.run_for(10_000_000_000);
            let r = s.report();
            println!(
                "vcpus {vcpus} loops {loops} measure {measure}: gold {:.2} % of VMs {:.1} %, outside {:.1}",
                r.class_share("gold"),
                r.class_pct("gold") + r.class_pct("bronze"),
                r.outside_ns / r.window_ns as f64 * 100.0
            );
        }
    }
}
