/*
 * entry.S - BSP entry point, AP 64-bit entry, GDT and exception stubs.
 *
 * The VMM enters _start in 64-bit long mode (Linux 64-bit boot protocol):
 * CS=0x10, DS/ES/SS=0x18, paging on with the low 4 GiB identity-mapped,
 * interrupts off, RSI = &boot_params, RSP = temporary stack.
 */
#define STACK_SIZE 16384
#define MAX_CPUS 64

	.section .text.entry, "ax"
	.code64
	.globl _start
_start:
	cli
	cld
	/* Timestamp entry before anything else. */
	rdtsc
	shlq	$32, %rdx
	orq	%rax, %rdx
	movq	%rdx, %r12
	movq	%rsi, %r13		/* boot_params */

	/*
	 * PROBE-UP first: the boot benchmark stops its clock on this line, so
	 * it goes out before anything else (no stack, no .bss needed). As a
	 * 16550 driver may: enable the FIFOs, wait once for LSR.THRE (the
	 * whole 16-byte TX FIFO free), then hand the 9 bytes over with one
	 * `rep outsb`: three VM exits for the line instead of eighteen (one
	 * LSR read and one THR write per byte).
	 */
	movw	$0x3fa, %dx		/* FCR: enable + clear FIFOs */
	movb	$0x07, %al
	outb	%al, %dx
	movl	$100000, %ecx		/* bounded: a missing UART can't hang us */
	movw	$0x3fd, %dx
2:	inb	%dx, %al
	testb	$0x20, %al
	jnz	4f
	pause
	decl	%ecx
	jnz	2b
4:	movw	$0x3f8, %dx
	leaq	probe_up_msg(%rip), %rsi
	movl	$probe_up_len, %ecx	/* <= 16: fits the FIFO */
	rep outsb
3:
	/* Own stack: slot 0 of cpu_stacks. */
	leaq	cpu_stacks + STACK_SIZE(%rip), %rsp

	/* Zero .bss (the stacks live in .stack, which is not cleared). */
	leaq	__bss_start(%rip), %rdi
	leaq	__bss_end(%rip), %rcx
	subq	%rdi, %rcx
	shrq	$3, %rcx
	xorl	%eax, %eax
	rep stosq

	movq	%r12, boot_tsc(%rip)

	call	load_gdt

	movq	%r13, %rdi
	call	kmain
	jmp	halt_forever

/*
 * Load our own GDT (same selectors as the VMM's: 0x08 code32, 0x10 code64,
 * 0x18 data) and reload every segment register.
 */
	.globl load_gdt
load_gdt:
	lgdt	gdt_ptr(%rip)
	movl	$0x18, %eax
	movl	%eax, %ds
	movl	%eax, %es
	movl	%eax, %ss
	xorl	%eax, %eax
	movl	%eax, %fs
	movl	%eax, %gs
	popq	%rax			/* return address */
	pushq	$0x10
	pushq	%rax
	lretq

/*
 * APs arrive here from the real-mode trampoline (trampoline.S), already in
 * 64-bit mode on CS=0x10 with the BSP's page tables.
 */
	.globl ap_entry64
ap_entry64:
	movl	$0x18, %eax
	movl	%eax, %ds
	movl	%eax, %es
	movl	%eax, %ss
	xorl	%eax, %eax
	movl	%eax, %fs
	movl	%eax, %gs
	/* Take a stack slot: ap_stack_next starts at 1 (slot 0 is the BSP's). */
	movl	$1, %eax
	lock xaddl %eax, ap_stack_next(%rip)
	cmpl	$MAX_CPUS, %eax
	jae	halt_forever
	movl	%eax, %edi
	leaq	1(%rax), %rax
	shlq	$14, %rax		/* * STACK_SIZE */
	leaq	cpu_stacks(%rip), %rsp
	addq	%rax, %rsp
	call	ap_main
	/* fall through */

	.globl halt_forever
halt_forever:
	cli
1:	hlt
	jmp	1b

/* ---- exception stubs: push a vector (and a dummy error code) ---- */
	.macro EXC_NOERR vec
	.balign 16
	pushq	$0
	pushq	$\vec
	jmp	exc_common
	.endm
	.macro EXC_ERR vec
	.balign 16
	pushq	$\vec
	jmp	exc_common
	.endm

	.balign 16
	.globl exc_stubs
exc_stubs:
	EXC_NOERR 0
	EXC_NOERR 1
	EXC_NOERR 2
	EXC_NOERR 3
	EXC_NOERR 4
	EXC_NOERR 5
	EXC_NOERR 6
	EXC_NOERR 7
	EXC_ERR   8
	EXC_NOERR 9
	EXC_ERR   10
	EXC_ERR   11
	EXC_ERR   12
	EXC_ERR   13
	EXC_ERR   14
	EXC_NOERR 15
	EXC_NOERR 16
	EXC_ERR   17
	EXC_NOERR 18
	EXC_NOERR 19
	EXC_NOERR 20
	EXC_ERR   21
	EXC_NOERR 22
	EXC_NOERR 23
	EXC_NOERR 24
	EXC_NOERR 25
	EXC_NOERR 26
	EXC_NOERR 27
	EXC_NOERR 28
	EXC_ERR   29
	EXC_ERR   30
	EXC_NOERR 31
	.globl exc_stubs_end
exc_stubs_end:

exc_common:
	/* Stack: vector, error code, RIP, CS, RFLAGS, RSP, SS. Never returns. */
	movq	%rsp, %rdi
	andq	$-16, %rsp
	call	exception_handler
	jmp	halt_forever

/* ---- data ---- */
	.section .rodata
probe_up_msg:
	.ascii	"PROBE-UP\n"
	.set	probe_up_len, . - probe_up_msg
	.balign 16
	.globl gdt
gdt:
	.quad	0				/* 0x00 null */
	.quad	0x00cf9b000000ffff		/* 0x08 32-bit code */
	.quad	0x00af9b000000ffff		/* 0x10 64-bit code */
	.quad	0x00cf93000000ffff		/* 0x18 data */
gdt_end:
	.globl gdt_ptr
	.balign 16
gdt_ptr:
	.word	gdt_end - gdt - 1
	.quad	gdt

/*
 * Static IDT for the 32 exception vectors: no code at boot builds it. The
 * linker script asserts the stubs sit in [0x100000, 0x110000), so each
 * gate's offset is (0x0010 << 16) | (stub - 0x100000).
 */
	.balign 16
	.globl idt_table
idt_table:
	.set	vec, 0
	.rept	32
	.word	exc_stubs - 0x100000 + vec * 16	/* offset 15:0 */
	.word	0x10				/* 64-bit code selector */
	.byte	0				/* IST */
	.byte	0x8e				/* present, DPL0, interrupt gate */
	.word	0x0010				/* offset 31:16 */
	.long	0				/* offset 63:32 */
	.long	0
	.set	vec, vec + 1
	.endr
	.globl idt_table_end
idt_table_end:

	.data
	.balign 4
	.globl ap_stack_next
ap_stack_next:
	.long	1

	.section .stack, "aw", @nobits
	.balign 4096
	.globl cpu_stacks
cpu_stacks:
	.skip	STACK_SIZE * MAX_CPUS

	.section .note.GNU-stack, "", @progbits
