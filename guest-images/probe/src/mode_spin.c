/*
 * mode_spin.c - probe.mode=spin: every CPU runs integer work for probe.secs
 * seconds of guest time, printing its cumulative iteration count every
 * probe.interval_ms. The counts show how much CPU each vCPU really got.
 */
#include "probe.h"

#define SPIN_CHUNK 1024 /* iterations between TSC reads */

static u64 spin_sink[MAX_CPUS];

static void spin_cpu(u32 id)
{
	const u64 start = run_start_tsc;
	const u64 end = start + ms_to_tsc(params.secs * 1000);
	const u64 interval = ms_to_tsc(params.interval_ms);
	u64 next = start + interval;
	u64 iters = 0, x = id + 1, now;

	for (;;) {
		for (u32 i = 0; i < SPIN_CHUNK; i++) {
			x ^= x << 13;
			x ^= x >> 7;
			x ^= x << 17;
		}
		/* keep the loop: x must look used */
		__asm__ volatile("" : "+r"(x));
		iters += SPIN_CHUNK;
		now = rdtsc();
		if (now >= end)
			break;
		if (now >= next) {
			kprintf("PROBE-PROGRESS cpu=%u t_ms=%lu iters=%lu\n", id,
				tsc_to_ms(now - start), iters);
			/* skip boundaries missed while descheduled */
			next += interval * ((now - next) / interval + 1);
		}
	}
	spin_sink[id] = x;
	kprintf("PROBE-RESULT mode=spin cpu=%u iters=%lu ms=%lu\n", id, iters,
		tsc_to_ms(now - start));
}

static u64 spin_timeout_ms(void) { return params.secs * 1000 + 30000; }

const struct probe_mode mode_spin = {
	.name = "spin",
	.run_cpu = spin_cpu,
	.timeout_ms = spin_timeout_ms,
};
