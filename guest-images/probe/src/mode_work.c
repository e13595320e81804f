/*
 * mode_work.c - probe.mode=work: a fixed job of probe.units units, shared by
 * all CPUs through an atomic counter (work stealing). The checksum is the
 * sum of the per-unit hashes, so it depends on N only, not on CPU count or
 * scheduling order.
 */
#include "probe.h"

static volatile u64 next_unit;
static volatile u64 checksum;
static u64 finish_tsc[MAX_CPUS];
static u64 units_done[MAX_CPUS];

static u64 unit_hash(u64 u, u64 iters)
{
	u64 x = (u + 1) * 0x9e3779b97f4a7c15UL;
	for (u64 i = 0; i < iters; i++) {
		x ^= x >> 31;
		x *= 0xbf58476d1ce4e5b9UL;
		x ^= x >> 27;
		x += i;
	}
	return x;
}

static bool work_prepare(u32 ncpus)
{
	(void)ncpus;
	next_unit = 0;
	checksum = 0;
	return true;
}

static void work_cpu(u32 id)
{
	u64 sum = 0, n = 0;
	const u64 iters = params.unit_iters;
	for (;;) {
		u64 u = __atomic_fetch_add(&next_unit, 1, __ATOMIC_RELAXED);
		if (u >= params.units)
			break;
		sum += unit_hash(u, iters);
		n++;
	}
	__atomic_fetch_add(&checksum, sum, __ATOMIC_SEQ_CST);
	units_done[id] = n;
	finish_tsc[id] = rdtsc();
}

/* Generous: ~10000x the nominal 1 ms per 450000 rounds, because some hosts
 * run this guest in their instruction emulator (see README). */
static u64 work_timeout_ms(void)
{
	return params.units * (params.unit_iters / 45 + 1) + 60000;
}

static const char *work_report(u32 ncpus)
{
	u64 last = run_start_tsc;
	for (u32 i = 0; i < ncpus; i++)
		if (finish_tsc[i] > last)
			last = finish_tsc[i];
	u64 cyc = last - run_start_tsc;
	kprintf("PROBE-RESULT mode=work units=%lu cpus=%u ms=%lu checksum=%016lx us=%lu "
		"unit_iters=%lu\n",
		params.units, ncpus, tsc_to_ms(cyc), checksum, cyc * 1000 / tsc_khz,
		params.unit_iters);
	return NULL;
}

const struct probe_mode mode_work = {
	.name = "work",
	.prepare = work_prepare,
	.run_cpu = work_cpu,
	.timeout_ms = work_timeout_ms,
	.report = work_report,
};
