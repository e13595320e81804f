/*
 * mode_echo.c - probe.mode=echo: the BSP reads its console (COM1's receive
 * register, polled) and prints every line it gets back as
 * "PROBE-ECHO <line>", for probe.secs seconds or until the line "quit".
 * This is what the host's console input (`corral vm console --attach`,
 * POST /v1/vms/{name}/console) is tested with.
 */
#include "probe.h"

#define COM1 0x3f8
#define UART_RBR 0
#define UART_LSR 5
#define LSR_DR 0x01
#define LINE_MAX 120

static u64 echo_lines;

static void echo_cpu(u32 id)
{
	if (id != 0)
		return;
	const u64 end = run_start_tsc + ms_to_tsc(params.secs * 1000);
	char line[LINE_MAX + 1];
	u32 n = 0;
	kprintf("PROBE-ECHO-READY\n");
	while (rdtsc() < end) {
		if (!(inb(COM1 + UART_LSR) & LSR_DR)) {
			cpu_relax();
			continue;
		}
		char c = (char)inb(COM1 + UART_RBR);
		if (c == '\r' || c == '\n') {
			line[n] = 0;
			if (n == 4 && line[0] == 'q' && line[1] == 'u' && line[2] == 'i' && line[3] == 't')
				break;
			if (n > 0) {
				kprintf("PROBE-ECHO %s\n", line);
				echo_lines++;
			}
			n = 0;
		} else if (n < LINE_MAX) {
			/* printable ASCII as is, anything else as '?' */
			line[n++] = (c >= 0x20 && c < 0x7f) ? c : '?';
		}
	}
}

static u64 echo_timeout_ms(void) { return params.secs * 1000 + 30000; }

static const char *echo_report(u32 ncpus)
{
	(void)ncpus;
	kprintf("PROBE-RESULT mode=echo lines=%lu\n", echo_lines);
	return NULL;
}

const struct probe_mode mode_echo = {
	.name = "echo",
	.run_cpu = echo_cpu,
	.timeout_ms = echo_timeout_ms,
	.report = echo_report,
};
