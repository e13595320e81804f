/* main.c - BSP flow: banner, command line, time, CPUs, mode, done, reset. */
#include "probe.h"

u64 boot_tsc;      /* TSC at _start (entry.S) */
u64 run_start_tsc; /* TSC when the mode's work was released */
const struct probe_mode *active_mode;

/* Modes, selected by probe.mode=. New modes (blk, ...) go here. */
static const struct probe_mode *const modes[] = {
	&mode_boot,
	&mode_spin,
	&mode_work,
	&mode_blk,
	&mode_evil,
	&mode_echo,
};

void __attribute__((noreturn)) probe_finish(bool ok, const char *reason)
{
	if (ok)
		kprintf("PROBE-DONE status=ok\n");
	else
		kprintf("PROBE-DONE status=error reason=%s\n", reason);
	outb(0x64, 0xfe); /* i8042 reset: the VMM stops the VM */
	halt_forever();
}

void __attribute__((noreturn)) probe_fail(const char *reason, const char *msg)
{
	kprintf("PROBE-ERROR %s\n", msg);
	probe_finish(false, reason);
}

u64 usable_kib; /* e820 type-1 RAM, reported by the boot mode */

#define MAX_RAM_RANGES 32
static struct {
	u64 start, end;
} ram[MAX_RAM_RANGES];
static u32 n_ram;

static void read_e820(const u8 *bp)
{
	u8 n = bp[0x1e8];
	u64 usable = 0;
	if (n > 128)
		n = 128;
	for (u32 i = 0; i < n; i++) {
		const u8 *e = bp + 0x2d0 + i * 20;
		u64 addr = *(const u64 *)e;
		u64 size = *(const u64 *)(e + 8);
		u32 type = *(const u32 *)(e + 16);
		if (type == 1) {
			usable += size;
			if (n_ram < MAX_RAM_RANGES && addr + size > addr) {
				ram[n_ram].start = addr;
				ram[n_ram].end = addr + size;
				n_ram++;
			}
		}
	}
	usable_kib = usable >> 10;
}

bool ram_range_ok(u64 start, u64 len)
{
	u64 end = start + len;
	if (end < start)
		return false;
	/* Adjacent ranges are merged on the fly: walk forward from start. */
	for (bool progress = true; progress && start < end;) {
		progress = false;
		for (u32 i = 0; i < n_ram; i++)
			if (ram[i].start <= start && start < ram[i].end) {
				start = ram[i].end;
				progress = true;
			}
	}
	return start >= end;
}

void kmain(const u8 *bp)
{
	/* PROBE-UP was already printed by _start (entry.S). */
	serial_init();
	idt_load();

	cmdline_load(bp);
	kprintf("PROBE-CMDLINE %s\n", cmdline);
	const char *err = cmdline_parse();
	if (err)
		probe_fail("bad-param", err);

	active_mode = NULL;
	for (u32 i = 0; i < sizeof(modes) / sizeof(modes[0]); i++)
		if (strcmp(modes[i]->name, params.mode) == 0)
			active_mode = modes[i];
	if (!active_mode) {
		console_lock();
		kprintf_unlocked("PROBE-ERROR unknown-mode %s\n", params.mode);
		console_unlock();
		probe_finish(false, "unknown-mode");
	}

	time_init();
	read_e820(bp);
	mp_scan();

	u32 online = smp_boot(1000);
	kprintf("PROBE-CPUS online=%u expected=%u\n", online, cpus_expected);

	if (active_mode->prepare && !active_mode->prepare(online))
		probe_finish(false, "prepare");
	smp_release();
	if (active_mode->run_cpu)
		active_mode->run_cpu(0);
	u64 tmo = active_mode->timeout_ms ? active_mode->timeout_ms() : 10000;
	if (!smp_wait_done(tmo)) {
		probe_fail("timeout", "timeout waiting for CPUs to finish");
	}
	const char *r = active_mode->report ? active_mode->report(online) : NULL;
	if (r)
		probe_finish(false, r);
	if (online < cpus_expected) {
		kprintf("PROBE-ERROR cpus-missing online=%u expected=%u\n", online, cpus_expected);
		probe_finish(false, "cpus-missing");
	}
	probe_finish(true, NULL);
}
