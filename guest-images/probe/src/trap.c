/* trap.c - an IDT for CPU exceptions: report the fault and reset, never hang. */
#include "probe.h"

struct __attribute__((packed)) idt_ptr {
	u16 limit;
	u64 base;
};

/* The table itself is static, in entry.S. */
extern const char idt_table[], idt_table_end[];

void idt_load(void)
{
	struct idt_ptr p = {(u16)(idt_table_end - idt_table - 1), (u64)idt_table};
	__asm__ volatile("lidt %0" ::"m"(p));
}

/* frame: vector, error code, RIP, CS, RFLAGS, RSP, SS */
void __attribute__((noreturn)) exception_handler(u64 *frame)
{
	u64 cr2;
	__asm__ volatile("mov %%cr2, %0" : "=r"(cr2));
	console_force_lock();
	kprintf_unlocked("\nPROBE-ERROR exception vec=%lu err=0x%lx rip=0x%lx cr2=0x%lx apic=%u\n",
			 frame[0], frame[1], frame[2], cr2, this_apic_id());
	kprintf_unlocked("PROBE-DONE status=error reason=exception\n");
	outb(0x64, 0xfe);
	halt_forever();
}
