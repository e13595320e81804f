/* mode_boot.c - probe.mode=boot: bring the CPUs up, report, shut down. */
#include "probe.h"

static const char *boot_report(u32 ncpus)
{
	/* Guest-side time from kernel entry to "all CPUs online". */
	u64 us = (run_start_tsc - boot_tsc) * 1000 / tsc_khz;
	kprintf("PROBE-RESULT mode=boot cpus=%u boot_us=%lu mem_kib=%lu mp=%s\n", ncpus, us,
		usable_kib, mp.found ? "yes" : "no");
	return NULL;
}

const struct probe_mode mode_boot = {
	.name = "boot",
	.report = boot_report,
};
