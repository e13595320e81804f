/* mp.c - find the Intel MP table: the enabled processors and the first IOAPIC. */
#include "probe.h"

struct mp_info mp;

static u8 sum8(const volatile u8 *p, u64 n)
{
	u8 s = 0;
	for (u64 i = 0; i < n; i++)
		s = (u8)(s + p[i]);
	return s;
}

static const volatile u8 *find_mpfp(u64 start, u64 end)
{
	const u32 sig = '_' | ('M' << 8) | ('P' << 16) | ('_' << 24);
	for (u64 a = start; a + 16 <= end; a += 16) {
		/* one 32-bit compare per step: the scan of the BIOS area is the
		 * longest loop of a boot without an MP table */
		if (*(const volatile u32 *)a != sig)
			continue;
		const volatile u8 *p = (const volatile u8 *)a;
		u8 len = p[8]; /* in 16-byte units */
		if (len == 0 || a + (u64)len * 16 > end)
			continue;
		if (sum8(p, (u64)len * 16) != 0)
			continue;
		return p;
	}
	return NULL;
}

static bool parse_config(u64 addr)
{
	/* The table must sit in low RAM, away from our own image and stacks. */
	if (addr < 0x1000 || addr >= 0x100000)
		return false;
	const volatile u8 *t = (const volatile u8 *)addr;
	if (t[0] != 'P' || t[1] != 'C' || t[2] != 'M' || t[3] != 'P')
		return false;
	u16 len = (u16)(t[4] | (t[5] << 8));
	if (len < 0x2c || addr + len > 0x100000)
		return false;
	if (sum8(t, len) != 0)
		return false;
	u16 count = (u16)(t[0x22] | (t[0x23] << 8));
	mp.lapic_addr = *(const volatile u32 *)(t + 0x24);

	u64 off = 0x2c;
	for (u16 i = 0; i < count && off < len; i++) {
		u8 type = t[off];
		u64 size = type == 0 ? 20 : 8;
		if (type > 4 || off + size > len)
			break; /* unknown entry type: its length is unknown, stop */
		if (type == 0 && (t[off + 3] & 1) && mp.ncpus < MAX_CPUS)
			mp.apic_ids[mp.ncpus++] = t[off + 1];
		if (type == 2 && (t[off + 3] & 1) && !mp.ioapic_addr)
			mp.ioapic_addr = *(const volatile u32 *)(t + off + 4); /* the first one */
		off += size;
	}
	return mp.ncpus > 0;
}

void mp_scan(void)
{
	static const u64 ranges[][2] = {
		{0x9fc00, 0xa0000}, /* last KiB of base memory */
		{0xf0000, 0x100000}, /* BIOS ROM area */
	};
	memset(&mp, 0, sizeof(mp));
	for (u32 r = 0; r < 2; r++) {
		const volatile u8 *fp = find_mpfp(ranges[r][0], ranges[r][1]);
		if (!fp)
			continue;
		if (fp[11] != 0) /* default configuration, no table: not supported */
			continue;
		u32 cfg = *(const volatile u32 *)(fp + 4);
		memset(&mp, 0, sizeof(mp));
		if (parse_config(cfg)) {
			mp.found = true;
			return;
		}
	}
	memset(&mp, 0, sizeof(mp));
}
