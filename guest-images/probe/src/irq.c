/*
 * irq.c - one device interrupt for the virtio-blk driver, and a race-free
 * sleep until it comes.
 *
 * The VMM raises a virtio-mmio device's interrupt by irqfd on its GSI, which
 * KVM's default routing wires to the IOAPIC pin of the same number; the MP
 * table lists those pins as ISA defaults (edge, active high). So: the pin's
 * redirection entry -> vector VEC_DEV on this CPU (physical destination), a
 * software-enabled local APIC, and an IDT with the exception gates plus
 * VEC_DEV, VEC_TIMER and the spurious vector. The 8259 PIC is masked and
 * LINT0 (ExtINT, set by the VMM) too: an unprogrammed PIC would deliver
 * vector 0..15 and look like an exception.
 *
 * The probe runs with interrupts off; they are on only for the one `sti;
 * hlt` in irq_sleep(), so a handler never interrupts driver code. A
 * one-shot local-APIC timer bounds every sleep: a lost interrupt costs at
 * most SLEEP_MAX_MS, never a hang.
 *
 * Every wake-up counts: on the nested kvm_pvm host a sleep and its wake-up
 * cost ~0.5-1 ms of the vCPU thread's CPU under load (16 ticks in 2 s for a
 * 10 ms bound that fired ~150 times). So a wake-up takes no MMIO exit to
 * the VMM: the interrupt is edge-triggered and the VMM pulses its irqfd for
 * every used-buffer notification whatever InterruptStatus holds, so the ISR
 * leaves the register alone (the driver looks at the device status after the
 * job); the bound is long (100 ms) and counted in the APIC timer's own time,
 * not TSC-deadline mode, whose deadlines fired within ~100 us of being armed
 * for 0.5-40 % of the sleeps here (the L1 host's TSCs seem to differ
 * between CPUs).
  */
#include "probe.h"

#define VEC_DEV 0x40
#define VEC_TIMER 0x41
#define VEC_SPURIOUS 0xff
#define SLEEP_MAX_MS 100

#define IOAPIC_DEFAULT 0xfec00000UL
#define IOREGSEL 0x00
#define IOWIN 0x10
#define IOAPIC_VER 0x01
#define IOAPIC_REDTBL(pin) (0x10 + 2 * (pin))
#define RTE_MASKED (1U << 16)

#define APIC_EOI 0x0b0
#define APIC_LVT_TIMER 0x320
#define APIC_LVT_LINT0 0x350
#define APIC_TIMER_INIT 0x380
#define APIC_TIMER_DIV 0x3e0
#define LVT_MASKED (1U << 16)

struct __attribute__((packed)) idt_gate {
	u16 off0, sel;
	u8 ist, type;
	u16 off1;
	u32 off2, rsvd;
};
struct __attribute__((packed)) idt_ptr {
	u16 limit;
	u64 base;
};
struct interrupt_frame;

extern const char idt_table[], idt_table_end[]; /* the 32 exception gates (entry.S) */
static struct idt_gate idt[256] __attribute__((aligned(16)));
static bool idt_ready;
static u64 ioapic, armed_until; /* TSC when the bound's timer fires */
static u32 dev_pin = ~0U;
u64 irq_count, irq_sleeps, irq_timeouts;

static void lapic_wr(u32 reg, u32 v)
{
	if (x2apic)
		wrmsr(0x800 + (reg >> 4), v);
	else
		mmio_write32(lapic + reg, v);
}
static u32 lapic_rd(u32 reg) { return x2apic ? (u32)rdmsr(0x800 + (reg >> 4)) : mmio_read32(lapic + reg); }

static void ioapic_wr(u32 reg, u32 v)
{
	mmio_write32(ioapic + IOREGSEL, reg);
	mmio_write32(ioapic + IOWIN, v);
}
static u32 ioapic_rd(u32 reg)
{
	mmio_write32(ioapic + IOREGSEL, reg);
	return mmio_read32(ioapic + IOWIN);
}

/* The device's interrupt: count it and EOI (the waiter looks at the ring). */
static __attribute__((interrupt)) void dev_isr(struct interrupt_frame *f)
{
	(void)f;
	irq_count++;
	lapic_wr(APIC_EOI, 0);
}

/* The sleep's time bound: nothing to do but EOI (the waiter re-checks). */
static __attribute__((interrupt)) void timer_isr(struct interrupt_frame *f)
{
	(void)f;
	irq_timeouts++;
	lapic_wr(APIC_EOI, 0);
}

/* Spurious interrupts take no EOI. */
static __attribute__((interrupt)) void spurious_isr(struct interrupt_frame *f) { (void)f; }

static void set_gate(u32 vec, void (*h)(struct interrupt_frame *))
{
	u64 a = (u64)h;
	idt[vec] = (struct idt_gate){(u16)a, 0x10, 0, 0x8e, (u16)(a >> 16), (u32)(a >> 32), 0};
}

static void idt_setup(void)
{
	if (idt_ready)
		return;
	/* Exceptions as before; every other vector but ours stays not present
	 * (#NP -> the exception report), so a stray interrupt is reported. */
	memcpy(idt, idt_table, (u64)(idt_table_end - idt_table));
	set_gate(VEC_DEV, dev_isr);
	set_gate(VEC_TIMER, timer_isr);
	set_gate(VEC_SPURIOUS, spurious_isr);
	struct idt_ptr p = {sizeof(idt) - 1, (u64)idt};
	__asm__ volatile("lidt %0" ::"m"(p));

	outb(0x21, 0xff); /* mask both 8259s (OCW1) */
	outb(0xa1, 0xff);
	apic_init_bsp(); /* software enable, spurious vector 0xff */
	lapic_wr(APIC_LVT_LINT0, lapic_rd(APIC_LVT_LINT0) | LVT_MASKED);
	lapic_wr(APIC_TIMER_DIV, 0xb);       /* divide by 1 */
	lapic_wr(APIC_LVT_TIMER, VEC_TIMER); /* one-shot */
	ioapic = mp.ioapic_addr ? mp.ioapic_addr : IOAPIC_DEFAULT;
	idt_ready = true;
}

const char *irq_attach(u32 irq)
{
	idt_setup();
	u32 pins = ((ioapic_rd(IOAPIC_VER) >> 16) & 0xff) + 1;
	if (irq >= pins || irq >= 24)
		return "irq-not-on-ioapic";
	irq_detach();
	dev_pin = irq;
	ioapic_wr(IOAPIC_REDTBL(irq) + 1, this_apic_id() << 24);
	/* fixed delivery, physical destination, active high, edge, unmasked */
	ioapic_wr(IOAPIC_REDTBL(irq), VEC_DEV);
	return NULL;
}

void irq_detach(void)
{
	if (dev_pin != ~0U)
		ioapic_wr(IOAPIC_REDTBL(dev_pin), RTE_MASKED | VEC_DEV);
	dev_pin = ~0U;
}

void irq_sleep(u64 until)
{
	u64 now = rdtsc(), lim = ms_to_tsc(SLEEP_MAX_MS);
	if (until <= now)
		return;
	if (until - now > lim)
		until = now + lim;
	/* Arm the bound, unless the one armed by an earlier sleep is still
	 * due before `until`: re-arming costs an exit per sleep, letting it
	 * fire costs one early wake-up per SLEEP_MAX_MS. KVM's APIC timer
	 * counts at 1 GHz (APIC_BUS_CYCLE_NS = 1); on a host that differs the
	 * bound is off by its factor, still finite. A timer that fired while
	 * we were awake is pending and only ends this sleep early: the waiter
	 * loops. */
	if (armed_until <= now || armed_until > until) {
		u64 ns = (until - now) * 1000000 / tsc_khz;
		lapic_wr(APIC_TIMER_INIT, ns > 0xffffffffUL ? 0xffffffffU : (u32)ns + 1);
		armed_until = until;
	}
	irq_sleeps++;
	/* sti takes effect after the next instruction: an interrupt pending
	 * now is taken on the hlt, never between the two. */
	__asm__ volatile("sti; hlt; cli" ::: "memory");
}
