/*
 * mode_spin.c - probe.mode=spin: every CPU runs integer work for probe.secs
 * seconds of guest time, printing its cumulative iteration count every
 * probe.interval_ms. The counts show how much CPU each vCPU really got.
 */
#include "probe.h"

#define SPIN_CHUNK 1024 /* iterations between TSC reads */

/* The ACPI event register of corral's Generic Event Device and its power
 * button bit, and the S5 write to the sleep control register (see
 * corral_devices::acpi_pm): a guest that honours the button. */
#define ACPI_SLEEP_CONTROL 0x600
#define ACPI_GED_EVENT 0x602
#define GED_POWER_BUTTON 0x01
#define SLP_TYP_S5 5
#define SLP_EN (1 << 5)
#define PWRBTN_POLL_MS 5

static void check_power_button(void)
{
	if (inb(ACPI_GED_EVENT) & GED_POWER_BUTTON) {
		kprintf("PROBE-POWER-BUTTON pressed: powering off (S5)\n");
		outb(ACPI_SLEEP_CONTROL, (SLP_TYP_S5 << 2) | SLP_EN);
	}
}

static u64 spin_sink[MAX_CPUS];

static void spin_cpu(u32 id)
{
	const u64 start = run_start_tsc;
	const u64 end = start + ms_to_tsc(params.secs * 1000);
	const u64 interval = ms_to_tsc(params.interval_ms);
	u64 next = start + interval;
	const u64 btn_every = ms_to_tsc(PWRBTN_POLL_MS);
	u64 next_btn = start + btn_every;
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
		if (params.pwrbtn && id == 0 && now >= next_btn) {
			check_power_button();
			next_btn = now + btn_every;
		}
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
