/* cmdline.c - copy the command line out of boot_params and parse probe.* keys. */
#include "probe.h"

/* Written up to its NUL before use, so it need not be zeroed (.noinit). */
char cmdline[CMDLINE_MAX] __attribute__((section(".noinit")));
struct probe_params params;
struct vmmio_entry vmmio[MAX_VMMIO];
u32 n_vmmio;

/* boot_params ("zero page") offsets, Linux boot protocol. */
#define BP_EXT_CMD_LINE_PTR 0x0c8
#define BP_CMD_LINE_PTR 0x228
#define BP_CMDLINE_SIZE 0x238

void cmdline_load(const u8 *bp)
{
	u64 ptr = *(const u32 *)(bp + BP_CMD_LINE_PTR) |
		  ((u64) * (const u32 *)(bp + BP_EXT_CMD_LINE_PTR) << 32);
	u64 max = *(const u32 *)(bp + BP_CMDLINE_SIZE);
	size_t n = 0;
	/* Only follow pointers into the identity-mapped low 4 GiB. */
	if (ptr && ptr < (1UL << 32)) {
		const volatile char *src = (const volatile char *)ptr;
		u64 lim = CMDLINE_MAX - 1;
		if (max && max < lim)
			lim = max;
		if (ptr + lim > (1UL << 32))
			lim = (1UL << 32) - ptr;
		while (n < lim && src[n]) {
			char c = src[n];
			/* keep PROBE-CMDLINE on one line and printable */
			if (c == '\n' || c == '\r' || c == '\t')
				c = ' ';
			else if ((u8)c < 0x20 || (u8)c > 0x7e)
				c = '?';
			cmdline[n++] = c;
		}
	}
	cmdline[n] = '\0';
}

static bool num_param(const char *v, size_t vl, u64 lo, u64 hi, u64 *out)
{
	u64 x;
	if (!parse_u64(v, vl, &x) || x < lo || x > hi)
		return false;
	*out = x;
	return true;
}

static void set_str(char *dst, size_t cap, const char *s, size_t n)
{
	if (n > cap - 1)
		n = cap - 1;
	memcpy(dst, s, n);
	dst[n] = '\0';
}

static bool size_param(const char *v, size_t vl, u64 lo, u64 hi, u64 *out)
{
	u64 x;
	if (!parse_size(v, vl, &x) || x < lo || x > hi)
		return false;
	*out = x;
	return true;
}

/* virtio_mmio.device=<size>@<base>:<irq>[:<id>] (Linux's format). */
static bool vmmio_param(const char *v, size_t vl)
{
	size_t at = 0, c1, c2;
	while (at < vl && v[at] != '@')
		at++;
	c1 = at + 1;
	while (c1 < vl && v[c1] != ':')
		c1++;
	c2 = c1 + 1;
	while (c2 < vl && v[c2] != ':')
		c2++;
	struct vmmio_entry e;
	u64 irq;
	if (at >= vl || c1 >= vl)
		return false;
	if (!parse_size(v, at, &e.size) || !parse_size(v + at + 1, c1 - at - 1, &e.base) ||
	    !parse_u64(v + c1 + 1, c2 - c1 - 1, &irq) || irq > 0xffffffffUL || e.size == 0)
		return false;
	e.irq = (u32)irq;
	if (n_vmmio < MAX_VMMIO)
		vmmio[n_vmmio++] = e;
	return true;
}

/* Parses cmdline in place (it is not modified). */
const char *cmdline_parse(void)
{
	static char errbuf[96];
	set_str(params.mode, sizeof(params.mode), "boot", 4);
	params.secs = 1;
	params.interval_ms = 100;
	params.units = 100;
	params.unit_iters = DEFAULT_UNIT_ITERS;
	params.cpus = 0;
	params.blk_disk = 0;
	params.blk_all = false;
	set_str(params.blk_op, sizeof(params.blk_op), "read", 4);
	params.blk_size = 0;
	params.blk_bs = 128 * 1024;
	params.blk_qd = 4;
	params.blk_offset = 0;
	params.blk_flush = 0;
	params.blk_seed = 1;
	params.blk_timeout_ms = 10000;
	params.blk_irq = true;
	params.blk_spin_us = 50;
	params.blk_random = false;
	params.blk_span = 0;
	set_str(params.evil_case, sizeof(params.evil_case), "read", 4);
	n_vmmio = 0;

	const char *p = cmdline;
	for (;;) {
		while (*p == ' ')
			p++;
		if (!*p)
			break;
		const char *tok = p;
		while (*p && *p != ' ')
			p++;
		size_t tl = (size_t)(p - tok);
		size_t kl = 0;
		while (kl < tl && tok[kl] != '=')
			kl++;
		bool has_v = kl < tl;
		const char *v = tok + kl + 1;
		size_t vl = has_v ? tl - kl - 1 : 0;
		bool ok;

		if (str_eq_n(tok, kl, "probe.mode")) {
			ok = vl > 0 && vl < sizeof(params.mode);
			if (ok)
				set_str(params.mode, sizeof(params.mode), v, vl);
		} else if (str_eq_n(tok, kl, "probe.secs")) {
			ok = num_param(v, vl, 1, 86400, &params.secs);
		} else if (str_eq_n(tok, kl, "probe.interval_ms")) {
			ok = num_param(v, vl, 1, 86400000, &params.interval_ms);
		} else if (str_eq_n(tok, kl, "probe.pwrbtn")) {
			ok = num_param(v, vl, 0, 1, &params.pwrbtn);
		} else if (str_eq_n(tok, kl, "probe.units")) {
			ok = num_param(v, vl, 1, 100000000, &params.units);
		} else if (str_eq_n(tok, kl, "probe.unit_iters")) {
			ok = num_param(v, vl, 1, 1000000000, &params.unit_iters);
		} else if (str_eq_n(tok, kl, "virtio_mmio.device")) {
			ok = vmmio_param(v, vl);
		} else if (str_eq_n(tok, kl, "probe.disk")) {
			ok = num_param(v, vl, 0, MAX_VMMIO - 1, &params.blk_disk);
		} else if (str_eq_n(tok, kl, "probe.disks")) {
			ok = str_eq_n(v, vl, "all") || str_eq_n(v, vl, "one");
			params.blk_all = str_eq_n(v, vl, "all");
		} else if (str_eq_n(tok, kl, "probe.op")) {
			ok = str_eq_n(v, vl, "read") || str_eq_n(v, vl, "write") ||
			     str_eq_n(v, vl, "verify") || str_eq_n(v, vl, "flush") ||
			     str_eq_n(v, vl, "getid") || str_eq_n(v, vl, "fill") ||
			     str_eq_n(v, vl, "check");
			if (ok)
				set_str(params.blk_op, sizeof(params.blk_op), v, vl);
		} else if (str_eq_n(tok, kl, "probe.size")) {
			ok = size_param(v, vl, 512, 1UL << 50, &params.blk_size) &&
			     !(params.blk_size & 511);
		} else if (str_eq_n(tok, kl, "probe.bs")) {
			ok = size_param(v, vl, 512, 4UL << 20, &params.blk_bs) &&
			     !(params.blk_bs & 511);
		} else if (str_eq_n(tok, kl, "probe.qd")) {
			ok = num_param(v, vl, 1, VBLK_MAX_QD, &params.blk_qd);
		} else if (str_eq_n(tok, kl, "probe.offset")) {
			ok = size_param(v, vl, 0, 1UL << 50, &params.blk_offset) &&
			     !(params.blk_offset & 511);
		} else if (str_eq_n(tok, kl, "probe.flush")) {
			ok = num_param(v, vl, 0, 1, &params.blk_flush);
		} else if (str_eq_n(tok, kl, "probe.seed")) {
			ok = parse_size(v, vl, &params.blk_seed);
		} else if (str_eq_n(tok, kl, "probe.timeout_ms")) {
			ok = num_param(v, vl, 1, 86400000, &params.blk_timeout_ms);
		} else if (str_eq_n(tok, kl, "probe.wait")) {
			ok = str_eq_n(v, vl, "irq") || str_eq_n(v, vl, "poll");
			params.blk_irq = str_eq_n(v, vl, "irq");
		} else if (str_eq_n(tok, kl, "probe.spin_us")) {
			ok = num_param(v, vl, 0, 1000000, &params.blk_spin_us);
		} else if (str_eq_n(tok, kl, "probe.pattern")) {
			ok = str_eq_n(v, vl, "seq") || str_eq_n(v, vl, "random");
			params.blk_random = str_eq_n(v, vl, "random");
		} else if (str_eq_n(tok, kl, "probe.span")) {
			ok = size_param(v, vl, 512, 1UL << 50, &params.blk_span) &&
			     !(params.blk_span & 511);
		} else if (str_eq_n(tok, kl, "probe.case")) {
			ok = vl > 0 && vl < sizeof(params.evil_case);
			if (ok)
				set_str(params.evil_case, sizeof(params.evil_case), v, vl);
		} else if (str_eq_n(tok, kl, "cpus")) {
			ok = num_param(v, vl, 1, MAX_CPUS, &params.cpus);
		} else {
			continue; /* unknown key (e.g. console=ttyS0): ignored */
		}
		if (!ok) {
			/* "bad-param <token>", token truncated to fit */
			const char *pre = "bad-param ";
			size_t n = strlen(pre);
			memcpy(errbuf, pre, n);
			if (tl > sizeof(errbuf) - 1 - n)
				tl = sizeof(errbuf) - 1 - n;
			memcpy(errbuf + n, tok, tl);
			errbuf[n + tl] = '\0';
			return errbuf;
		}
	}
	return NULL;
}
