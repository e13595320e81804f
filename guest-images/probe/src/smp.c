/* smp.c - xAPIC IPIs, AP start-up (INIT-SIPI-SIPI) and the per-run rendezvous. */
#include "probe.h"

#define MSR_APIC_BASE 0x1b
#define APIC_BASE_X2APIC (1UL << 10)
#define APIC_SVR 0x0f0
#define APIC_ICR_LO 0x300
#define APIC_ICR_HI 0x310
#define ICR_BUSY (1U << 12)
#define ICR_INIT 0x00004500 /* INIT, level assert */
#define ICR_SIPI 0x00004600 /* Start-up, level assert, | vector */
#define ICR_ALL_BUT_SELF (3U << 18)

#define ADMIT_CLOSED 0x80000000U

extern char tramp_start[], tramp_end[], tramp_cr3[];
extern const struct probe_mode *active_mode;

volatile u32 cpus_online;
u32 cpus_expected;
u32 cpu_apic_id[MAX_CPUS];

static volatile u32 admit;   /* CPUs admitted | ADMIT_CLOSED */
static volatile u32 go;      /* BSP released the mode's work */
static volatile u32 done;    /* APs that finished the mode's work */
u64 lapic;                   /* xAPIC MMIO base (irq.c uses it too) */
bool x2apic;

u32 this_apic_id(void)
{
	u32 a, b, c, d;
	cpuid(1, 0, &a, &b, &c, &d);
	return b >> 24;
}

static void apic_write(u32 reg, u32 v) { mmio_write32(lapic + reg, v); }
static u32 apic_read(u32 reg) { return mmio_read32(lapic + reg); }

static void icr_wait_idle(void)
{
	if (x2apic)
		return; /* x2APIC ICR has no delivery-status bit */
	u64 t0 = rdtsc(), lim = us_to_tsc(1000);
	while ((apic_read(APIC_ICR_LO) & ICR_BUSY) && rdtsc() - t0 < lim)
		cpu_relax();
}

static void send_ipi(u32 dest, u32 lo)
{
	if (x2apic) {
		wrmsr(0x830, ((u64)dest << 32) | lo);
		return;
	}
	icr_wait_idle();
	apic_write(APIC_ICR_HI, dest << 24);
	apic_write(APIC_ICR_LO, lo);
	icr_wait_idle();
}

void apic_init_bsp(void)
{
	u64 base = rdmsr(MSR_APIC_BASE);
	x2apic = (base & APIC_BASE_X2APIC) != 0;
	lapic = base & 0xffffff000UL;
	if (!lapic || lapic >= (1UL << 32))
		lapic = mp.lapic_addr ? mp.lapic_addr : 0xfee00000UL;
	/* Software-enable the local APIC (spurious vector 0xff). */
	if (x2apic)
		wrmsr(0x80f, (rdmsr(0x80f) & ~0xffUL) | 0x1ff);
	else
		apic_write(APIC_SVR, (apic_read(APIC_SVR) & ~0xffU) | 0x1ff);
}

static void install_trampoline(void)
{
	u64 len = (u64)(tramp_end - tramp_start);
	memcpy((void *)TRAMP_BASE, tramp_start, len);
	*(volatile u32 *)(TRAMP_BASE + (u64)(tramp_cr3 - tramp_start)) = (u32)read_cr3();
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
}

_Static_assert(TRAMP_BASE % 4096 == 0 && TRAMP_BASE < 0x100000, "SIPI vector");

u32 smp_boot(u64 wait_ms)
{
	u32 bsp = this_apic_id();
	u32 targets[MAX_CPUS];
	u32 ntargets = 0;
	bool broadcast = false;

	cpu_apic_id[0] = bsp;
	admit = 1;
	kprintf("PROBE-CPU id=0 apic=%u up\n", bsp);

	if (mp.found) {
		cpus_expected = mp.ncpus;
		for (u32 i = 0; i < mp.ncpus; i++)
			if (mp.apic_ids[i] != bsp)
				targets[ntargets++] = mp.apic_ids[i];
		/* A table that lacks our own APIC id still counts us. */
		if (ntargets == mp.ncpus && cpus_expected < MAX_CPUS)
			cpus_expected++;
	} else if (params.cpus > 1) {
		cpus_expected = (u32)params.cpus;
		broadcast = true; /* APIC ids unknown: INIT/SIPI all-but-self */
	} else {
		cpus_expected = 1;
	}

	if (cpus_expected > 1) {
		install_trampoline();
		apic_init_bsp();
		u32 vec = (u32)(TRAMP_BASE >> 12);
		/* INIT every AP, then SIPI twice; no per-AP wait so all start in
		 * parallel. Delays are the short ones modern CPUs need. */
		if (broadcast) {
			send_ipi(0, ICR_INIT | ICR_ALL_BUT_SELF);
			udelay(10);
			send_ipi(0, ICR_SIPI | ICR_ALL_BUT_SELF | vec);
			udelay(20);
			if (READ_ONCE(admit) < cpus_expected)
				send_ipi(0, ICR_SIPI | ICR_ALL_BUT_SELF | vec);
		} else {
			for (u32 i = 0; i < ntargets; i++)
				send_ipi(targets[i], ICR_INIT);
			udelay(10);
			for (u32 i = 0; i < ntargets; i++)
				send_ipi(targets[i], ICR_SIPI | vec);
			udelay(20);
			if (READ_ONCE(admit) < cpus_expected)
				for (u32 i = 0; i < ntargets; i++)
					send_ipi(targets[i], ICR_SIPI | vec);
		}
		u64 t0 = rdtsc(), lim = ms_to_tsc(wait_ms);
		while (READ_ONCE(admit) < cpus_expected && rdtsc() - t0 < lim)
			cpu_relax();
	}
	u32 n = __atomic_fetch_or(&admit, ADMIT_CLOSED, __ATOMIC_SEQ_CST) & ~ADMIT_CLOSED;
	/* Every admitted AP printed its line under the console lock. */
	console_lock();
	console_unlock();
	cpus_online = n;
	return n;
}

void ap_main(u32 slot)
{
	(void)slot;
	idt_load();
	u32 apic = this_apic_id();
	u32 id;

	console_lock();
	for (;;) {
		u32 v = READ_ONCE(admit);
		if ((v & ADMIT_CLOSED) || v >= MAX_CPUS) {
			console_unlock(); /* too late: the BSP gave up on us */
			halt_forever();
		}
		if (__atomic_compare_exchange_n(&admit, &v, v + 1, false, __ATOMIC_SEQ_CST,
						__ATOMIC_SEQ_CST)) {
			id = v;
			break;
		}
	}
	cpu_apic_id[id] = apic;
	kprintf_unlocked("PROBE-CPU id=%u apic=%u up\n", id, apic);
	console_unlock();

	/* Modes without per-CPU work (boot): nothing more to do. Halting
	 * (interrupts off) parks the vCPU in the host without burning CPU. */
	if (!active_mode->run_cpu)
		halt_forever();
	while (!READ_ONCE(go))
		cpu_relax();
	active_mode->run_cpu(id);
	__atomic_fetch_add(&done, 1, __ATOMIC_SEQ_CST);
	halt_forever();
}

void smp_release(void)
{
	run_start_tsc = rdtsc();
	__atomic_store_n(&go, 1, __ATOMIC_SEQ_CST);
}

bool smp_wait_done(u64 timeout_ms)
{
	if (!active_mode->run_cpu)
		return true; /* APs halted right after they announced themselves */
	u64 t0 = rdtsc(), lim = ms_to_tsc(timeout_ms);
	while (READ_ONCE(done) < cpus_online - 1) {
		if (rdtsc() - t0 > lim)
			return false;
		cpu_relax();
	}
	return true;
}
