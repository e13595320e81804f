/* time.c - TSC time base: frequency from the hypervisor CPUID leaf, else PIT. */
#include "probe.h"

u64 tsc_khz;

#define PIT_HZ 1193182UL
#define PIT_CAL_MS 5

static u64 tsc_khz_from_cpuid(void)
{
	u32 a, b, c, d;
	cpuid(1, 0, &a, &b, &c, &d);
	if (!(c & (1U << 31))) /* no hypervisor present */
		return 0;
	cpuid(0x40000000, 0, &a, &b, &c, &d);
	if (a < 0x40000010 || a > 0x4000ffff)
		return 0;
	cpuid(0x40000010, 0, &a, &b, &c, &d);
	return a;
}

/* Gate PIT channel 2 for PIT_CAL_MS and count TSC cycles. 0 on failure. */
static u64 tsc_khz_from_pit(void)
{
	const u32 count = (u32)(PIT_HZ * PIT_CAL_MS / 1000);
	u8 v = inb(0x61);
	outb(0x61, (u8)((v & ~0x02) | 0x01)); /* gate on, speaker off */
	outb(0x43, 0xb0);                     /* ch2, lo/hi, mode 0, binary */
	outb(0x42, (u8)(count & 0xff));
	outb(0x42, (u8)(count >> 8));
	u64 t0 = rdtsc();
	/* Bound: 100 ms at a (generous) 20 GHz, in case there is no PIT. */
	const u64 limit = 20000000UL * 100;
	u64 t1;
	for (;;) {
		t1 = rdtsc();
		if (inb(0x61) & 0x20)
			break;
		if (t1 - t0 > limit)
			return 0;
	}
	outb(0x61, v);
	u64 khz = (t1 - t0) * PIT_HZ / ((u64)count * 1000);
	return khz;
}

void time_init(void)
{
	const char *src = "cpuid";
	tsc_khz = tsc_khz_from_cpuid();
	if (!tsc_khz) {
		src = "pit";
		tsc_khz = tsc_khz_from_pit();
	}
	if (tsc_khz < 1000) { /* no usable source: assume 2 GHz, say so */
		src = "default";
		tsc_khz = 2000000;
	}
	kprintf("PROBE-TSC khz=%lu source=%s\n", tsc_khz, src);
}

u64 tsc_to_ms(u64 cycles) { return cycles / tsc_khz; }
u64 ms_to_tsc(u64 ms) { return ms * tsc_khz; }
u64 us_to_tsc(u64 us) { return us * tsc_khz / 1000; }

void udelay(u64 us)
{
	u64 t0 = rdtsc(), n = us_to_tsc(us);
	while (rdtsc() - t0 < n)
		cpu_relax();
}
