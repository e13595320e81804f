/*
 * trampoline.S - AP start-up code. The BSP copies [tramp_start, tramp_end)
 * to TRAMP_BASE (0x3000, SIPI vector 0x03) and patches tramp_cr3 with its
 * own CR3. An AP starts here in real mode with CS=0x0300, IP=0.
 *
 * real mode -> 32-bit protected mode (no paging) -> PAE + CR3 + EFER.LME
 * -> paging on (IA-32e) -> far jump to ap_entry64 in the kernel image.
 * The GDT is the kernel's own (linked below 4 GiB, so reachable by lgdtl).
 */
#define TRAMP_BASE 0x3000
#define OFF(x) ((x) - tramp_start)

	.section .rodata.tramp, "a"
	.code16
	.globl tramp_start, tramp_end, tramp_cr3
	.balign 16
tramp_start:
	cli
	cld
	movw	%cs, %ax
	movw	%ax, %ds
	lgdtl	%ds:OFF(tramp_gdtr)
	movl	%cr0, %eax
	orl	$1, %eax			/* PE */
	movl	%eax, %cr0
	ljmpl	$0x08, $(TRAMP_BASE + OFF(tramp_pm32))

	.code32
tramp_pm32:
	movl	$0x18, %eax
	movl	%eax, %ds
	movl	%eax, %es
	movl	%eax, %ss
	movl	%cr4, %eax
	orl	$0x20, %eax			/* PAE */
	movl	%eax, %cr4
	movl	(TRAMP_BASE + OFF(tramp_cr3)), %eax
	movl	%eax, %cr3
	movl	$0xc0000080, %ecx		/* EFER */
	rdmsr
	orl	$0x100, %eax			/* LME */
	wrmsr
	movl	%cr0, %eax
	orl	$0x80000001, %eax		/* PG | PE */
	movl	%eax, %cr0
	ljmpl	$0x10, $ap_entry64

	.balign 8
tramp_gdtr:
	.word	4 * 8 - 1			/* 4 descriptors, see entry.S */
	.long	gdt
	.balign 4
tramp_cr3:
	.long	0
tramp_end:

	.section .note.GNU-stack, "", @progbits
