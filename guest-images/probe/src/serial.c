/* serial.c - COM1 (8250/16550) output, the console lock and kprintf. */
#include "probe.h"
#include <stdarg.h>

#define COM1 0x3f8
#define UART_THR 0
#define UART_IER 1
#define UART_FCR 2
#define UART_LCR 3
#define UART_MCR 4
#define UART_LSR 5
#define LSR_THRE 0x20

#define TX_FIFO 16 /* 16550: THRE set means the whole TX FIFO is free */

static spinlock_t console;
static u32 tx_room; /* bytes we may write before polling LSR again */

void spin_lock(spinlock_t *l)
{
	while (__atomic_exchange_n(&l->v, 1, __ATOMIC_ACQUIRE)) {
		while (__atomic_load_n(&l->v, __ATOMIC_RELAXED))
			cpu_relax();
	}
}

void spin_unlock(spinlock_t *l) { __atomic_store_n(&l->v, 0, __ATOMIC_RELEASE); }

void serial_init(void)
{
	/* Polled output only: no interrupts, 8N1, DTR/RTS. Baud is irrelevant
	 * on a virtual UART, so the divisor is left alone (fewer exits). */
	outb(COM1 + UART_IER, 0x00);
	outb(COM1 + UART_LCR, 0x03);
	outb(COM1 + UART_MCR, 0x03);
	outb(COM1 + UART_FCR, 0x07); /* enable + clear FIFOs */
	tx_room = 0;
}

/* Write n bytes; caller holds the console lock. Polls LSR only when the TX
 * FIFO may be full: every port access is a VM exit, and on hosts that
 * emulate the guest every instruction counts too. Bounded: a missing UART
 * must not hang the guest. */
static void serial_write(const char *p, size_t n)
{
	while (n) {
		if (tx_room == 0) {
			for (u32 i = 0; i < 100000; i++) {
				if (inb(COM1 + UART_LSR) & LSR_THRE)
					break;
				cpu_relax();
			}
			tx_room = TX_FIFO;
		}
		u32 k = n < tx_room ? (u32)n : tx_room;
		tx_room -= k;
		n -= k;
		while (k--)
			outb(COM1 + UART_THR, (u8)*p++);
	}
}

void serial_putc(char c) { serial_write(&c, 1); }

void console_lock(void) { spin_lock(&console); }
void console_unlock(void) { spin_unlock(&console); }

void console_force_lock(void)
{
	for (u64 i = 0; i < 50000000UL; i++) {
		if (!__atomic_exchange_n(&console.v, 1, __ATOMIC_ACQUIRE))
			return;
		cpu_relax();
	}
	/* Holder is presumably dead (e.g. faulted while printing): take it. */
	__atomic_store_n(&console.v, 1, __ATOMIC_SEQ_CST);
}

/* Formatting goes through a small buffer, flushed when full and at the end. */
struct outbuf {
	char b[128];
	u32 n;
};

static void ob_putc(struct outbuf *o, char c)
{
	if (o->n == sizeof(o->b)) {
		serial_write(o->b, o->n);
		o->n = 0;
	}
	o->b[o->n++] = c;
}

static void put_str(struct outbuf *o, const char *s)
{
	if (!s)
		s = "(null)";
	while (*s)
		ob_putc(o, *s++);
}

static void put_num(struct outbuf *o, u64 v, unsigned base, int width, char pad, bool neg)
{
	char buf[24];
	int n = 0;
	do {
		unsigned d = (unsigned)(v % base);
		buf[n++] = (char)(d < 10 ? '0' + d : 'a' + d - 10);
		v /= base;
	} while (v);
	if (neg)
		buf[n++] = '-';
	while (width > n) {
		ob_putc(o, pad);
		width--;
	}
	while (n)
		ob_putc(o, buf[--n]);
}

static void vformat(const char *fmt, va_list ap)
{
	struct outbuf o;
	o.n = 0;
	for (; *fmt; fmt++) {
		if (*fmt != '%') {
			ob_putc(&o, *fmt);
			continue;
		}
		fmt++;
		char pad = ' ';
		int width = 0, lng = 0;
		if (*fmt == '0') {
			pad = '0';
			fmt++;
		}
		while (*fmt >= '0' && *fmt <= '9')
			width = width * 10 + (*fmt++ - '0');
		while (*fmt == 'l') {
			lng++;
			fmt++;
		}
		switch (*fmt) {
		case 's':
			put_str(&o, va_arg(ap, const char *));
			break;
		case 'c':
			ob_putc(&o, (char)va_arg(ap, int));
			break;
		case 'd': {
			i64 v = lng ? va_arg(ap, i64) : va_arg(ap, int);
			put_num(&o, v < 0 ? (u64)(-v) : (u64)v, 10, width, pad, v < 0);
			break;
		}
		case 'u':
			put_num(&o, lng ? va_arg(ap, u64) : va_arg(ap, u32), 10, width, pad, false);
			break;
		case 'x':
			put_num(&o, lng ? va_arg(ap, u64) : va_arg(ap, u32), 16, width, pad, false);
			break;
		case '%':
			ob_putc(&o, '%');
			break;
		case '\0':
			goto out;
		default:
			ob_putc(&o, '?');
			break;
		}
	}
out:
	serial_write(o.b, o.n);
}

void kprintf_unlocked(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vformat(fmt, ap);
	va_end(ap);
}

void kprintf(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	console_lock();
	vformat(fmt, ap);
	console_unlock();
	va_end(ap);
}
