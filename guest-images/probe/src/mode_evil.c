/*
 * mode_evil.c - probe.mode=evil: a hostile driver. probe.case=NAME picks one
 * fault to commit against the VMM (virtio-blk disk probe.disk, the port
 * I/O bus, or the vCPU itself) and prints what the device answered:
 *
 *   PROBE-EVIL case=<name> result=<word> [status=<byte>] [used_len=<n>] dev_status=0x<s>
 *
 * result: ok | ioerr | unsupp | no-status (used entry, status byte not
 * written) | needs-reset (DEVICE_NEEDS_RESET set, no used entry) | refused
 * (the register write was refused) | timeout (no answer at all) | bad | ...
 * The tests (tests/tests/hostile.rs) know what the virtio spec requires for
 * each case; the guest only reports. Then PROBE-DONE status=ok and reset,
 * except for vcpu-fault, which never returns.
 *
 * Own queue (16 entries, in .bss), separate from virtio_blk.c's.
 */
#include "probe.h"

#define R_STATUS 0x070
#define R_QSEL 0x030
#define R_QNUM 0x038
#define R_QREADY 0x044
#define R_NOTIFY 0x050
#define R_ISR 0x060
#define R_DESC 0x080
#define R_AVAIL 0x090
#define R_USED 0x0a0
#define R_DFSEL 0x014
#define R_DF 0x010
#define R_GFSEL 0x024
#define R_GF 0x020
#define ST_ACK 1
#define ST_DRV 2
#define ST_DRV_OK 4
#define ST_FEAT_OK 8
#define ST_NEEDS_RESET 0x40
#define F_NEXT 1
#define F_WRITE 2
#define F_INDIRECT 4
#define F_RING_INDIRECT (1UL << 28)

#define QN 16
#define PENDING 0xff

struct desc {
	u64 addr;
	u32 len;
	u16 flags, next;
};
static struct desc dtab[QN] __attribute__((aligned(4096)));
static struct {
	u16 flags, idx, ring[QN], used_event;
} avail __attribute__((aligned(4096)));
static struct {
	u16 flags, idx;
	struct {
		u32 id, len;
	} ring[QN];
	u16 avail_event;
} used __attribute__((aligned(4096)));
static struct desc itab[8] __attribute__((aligned(64)));
static struct {
	u32 type, reserved;
	u64 sector;
} hdr __attribute__((aligned(64)));
static volatile u8 st_byte;
static u8 buf[4096] __attribute__((aligned(4096)));
static u64 base;
static u16 aidx, uidx;
static u64 capacity;

static u32 rd(u32 off) { return mmio_read32(base + off); }
static void wr(u32 off, u32 v) { mmio_write32(base + off, v); }

/* Brings the device up with queue 0 at the given ring addresses; returns
 * the status register after DRIVER_OK (or after the refused QueueReady). */
static u32 up_with(u64 d, u64 a, u64 u, u32 n, bool *ready)
{
	wr(R_STATUS, 0);
	wr(R_STATUS, ST_ACK);
	wr(R_STATUS, ST_ACK | ST_DRV);
	wr(R_DFSEL, 0);
	u64 f = rd(R_DF);
	wr(R_DFSEL, 1);
	f |= (u64)rd(R_DF) << 32;
	f &= VIRTIO_F_VERSION_1 | F_RING_INDIRECT;
	wr(R_GFSEL, 0);
	wr(R_GF, (u32)f);
	wr(R_GFSEL, 1);
	wr(R_GF, (u32)(f >> 32));
	wr(R_STATUS, ST_ACK | ST_DRV | ST_FEAT_OK);
	capacity = (u64)mmio_read32(base + 0x100) | (u64)mmio_read32(base + 0x104) << 32;
	wr(R_QSEL, 0);
	wr(R_QNUM, n);
	wr(R_DESC, (u32)d);
	wr(R_DESC + 4, (u32)(d >> 32));
	wr(R_AVAIL, (u32)a);
	wr(R_AVAIL + 4, (u32)(a >> 32));
	wr(R_USED, (u32)u);
	wr(R_USED + 4, (u32)(u >> 32));
	avail.idx = avail.flags = 0;
	used.idx = used.flags = 0;
	aidx = uidx = 0;
	wr(R_QREADY, 1);
	*ready = rd(R_QREADY) == 1;
	wr(R_STATUS, ST_ACK | ST_DRV | ST_FEAT_OK | ST_DRV_OK);
	return rd(R_STATUS);
}

static bool up(void)
{
	bool ready;
	u32 s = up_with((u64)dtab, (u64)&avail, (u64)&used, QN, &ready);
	return ready && (s & ST_DRV_OK) && !(s & ST_NEEDS_RESET);
}

static void set(u16 i, u64 addr, u32 len, u16 flags, u16 next)
{
	dtab[i].addr = addr;
	dtab[i].len = len;
	dtab[i].flags = flags;
	dtab[i].next = next;
}

/* A plain three-descriptor request in dtab[0..3). */
static void plain(u32 type, u64 sector, u64 data, u32 len, bool dev_writes)
{
	hdr.type = type;
	hdr.reserved = 0;
	hdr.sector = sector;
	set(0, (u64)&hdr, 16, F_NEXT, 1);
	set(1, data, len, F_NEXT | (dev_writes ? F_WRITE : 0), 2);
	set(2, (u64)&st_byte, 1, F_WRITE, 0);
}

static void publish(u16 head)
{
	avail.ring[aidx % QN] = head;
	aidx++;
	__asm__ volatile("" ::: "memory");
	WRITE_ONCE(avail.idx, aidx);
	__asm__ volatile("lock; addl $0, -8(%%rsp)" ::: "memory", "cc");
}

static void report(const char *name, const char *result)
{
	kprintf("PROBE-EVIL case=%s result=%s dev_status=0x%x\n", name, result, rd(R_STATUS));
}

/* Submits head 0, notifies and waits for a used entry or NEEDS_RESET. */
static void submit_and_report(const char *name)
{
	st_byte = PENDING;
	publish(0);
	wr(R_NOTIFY, 0);
	u64 t0 = rdtsc(), lim = ms_to_tsc(2000);
	for (;;) {
		if (READ_ONCE(used.idx) != uidx) {
			u32 len = used.ring[uidx % QN].len;
			uidx++;
			u8 s = st_byte;
			const char *r = s == VIRTIO_BLK_S_OK      ? "ok"
					: s == VIRTIO_BLK_S_IOERR  ? "ioerr"
					: s == VIRTIO_BLK_S_UNSUPP ? "unsupp"
					: s == PENDING             ? "no-status"
								   : "bad";
			kprintf("PROBE-EVIL case=%s result=%s status=%u used_len=%u dev_status=0x%x\n",
				name, r, s, len, rd(R_STATUS));
			return;
		}
		if (rd(R_STATUS) & ST_NEEDS_RESET) {
			report(name, "needs-reset");
			return;
		}
		if (rdtsc() - t0 > lim) {
			report(name, "timeout");
			return;
		}
		udelay(20);
	}
}

/* Waits (bounded) for the device to say NEEDS_RESET without a request. */
static void wait_needs_reset(const char *name)
{
	u64 t0 = rdtsc(), lim = ms_to_tsc(2000);
	while (!(rd(R_STATUS) & ST_NEEDS_RESET)) {
		if (READ_ONCE(used.idx) != uidx) {
			report(name, "completed");
			return;
		}
		if (rdtsc() - t0 > lim) {
			report(name, "timeout");
			return;
		}
		udelay(20);
	}
	/* §2.1.2: a configuration change notification comes with it. */
	report(name, (rd(R_ISR) & 2) ? "needs-reset" : "needs-reset-no-config-irq");
}

static u64 rng = 0x2545f4914f6cdd1dUL;
static u64 rnd(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

/* After a fault, a reset must bring the device back: one good read. */
static void recover_and_report(const char *name)
{
	if (!up()) {
		report(name, "not-recovered");
		return;
	}
	plain(VIRTIO_BLK_T_IN, 0, (u64)buf, 512, true);
	submit_and_report(name);
}

static bool skip_port(u32 p)
{
	return (p >= 0x40 && p <= 0x43) || p == 0x61 || (p >= 0x60 && p <= 0x64) ||
	       (p >= 0x3f8 && p <= 0x3ff) || (p >= 0x600 && p <= 0x601) || p == 0xcf9;
}

static void case_pio_string(const char *name)
{
	/* COM1's scratch register (0x3ff): `rep outsb` four bytes, then
	 * `rep insb` four: each element is one access, so the register ends up
	 * holding the last byte written and reads back as it four times. */
	static u8 out[4] = {0x11, 0x22, 0x33, 0x44}, in[4];
	const u8 *s = out;
	u8 *d = in;
	u64 n = 4;
	__asm__ volatile("rep outsb" : "+S"(s), "+c"(n) : "d"((u16)0x3ff) : "memory");
	n = 4;
	__asm__ volatile("rep insb" : "+D"(d), "+c"(n) : "d"((u16)0x3ff) : "memory");
	u8 single = inb(0x3ff);
	bool ok = in[0] == 0x44 && in[1] == 0x44 && in[2] == 0x44 && in[3] == 0x44 && single == 0x44;
	kprintf("PROBE-EVIL case=%s result=%s in=%x,%x,%x,%x single=%x\n", name, ok ? "ok" : "bad",
		in[0], in[1], in[2], in[3], single);
}

static void case_pio_fuzz(const char *name)
{
	static u8 junk[64];
	for (u32 i = 0; i < sizeof(junk); i++)
		junk[i] = (u8)rnd();
	u32 n = 0;
	for (u32 p = 0; p < 0x10000; p += 1 + (u32)(rnd() % 7)) {
		if (skip_port(p) || skip_port(p + 3))
			continue;
		switch (rnd() % 4) {
		case 0:
			outb((u16)p, (u8)rnd());
			break;
		case 1:
			(void)inb((u16)p);
			break;
		case 2: {
			const u8 *s = junk;
			u64 c = 1 + rnd() % 16;
			__asm__ volatile("rep outsb" : "+S"(s), "+c"(c) : "d"((u16)p) : "memory");
			break;
		}
		default: {
			static u8 sink[64];
			u8 *d = sink;
			u64 c = 1 + rnd() % 16;
			__asm__ volatile("rep insw" : "+D"(d), "+c"(c) : "d"((u16)p) : "memory");
			break;
		}
		}
		n++;
	}
	kprintf("PROBE-EVIL case=%s result=ok accesses=%u\n", name, n);
}

static void case_mmio_fuzz(const char *name)
{
	/* Random writes and reads at every register offset and in config
	 * space, aligned or not, interleaved with resets and notifies of
	 * queues that do not exist. Then a reset must bring it back. */
	for (u32 i = 0; i < 4000; i++) {
		u32 off = (u32)(rnd() % 0x200);
		u32 v = (u32)rnd();
		switch (rnd() % 6) {
		case 0:
			*(volatile u8 *)(base + off) = (u8)v;
			break;
		case 1:
			*(volatile u16 *)(base + (off & ~1u)) = (u16)v;
			break;
		case 2:
			(void)*(volatile u8 *)(base + off);
			break;
		case 3:
			wr(off & ~3u, (rnd() & 1) ? v : (u32)(rnd() % 0x100));
			break;
		case 4:
			(void)rd(off & ~3u);
			break;
		default:
			wr(R_NOTIFY, (u32)(rnd() % 4));
			break;
		}
	}
	recover_and_report(name);
}

static void case_reset_inflight(const char *name)
{
	/* Eight reads in flight, reset at once, repeatedly; then a good read. */
	for (u32 round = 0; round < 50; round++) {
		if (!up()) {
			report(name, "bring-up-failed");
			return;
		}
		for (u16 k = 0; k < 4; k++) {
			hdr.type = VIRTIO_BLK_T_IN;
			hdr.sector = k;
			set((u16)(3 * k), (u64)&hdr, 16, F_NEXT, (u16)(3 * k + 1));
			set((u16)(3 * k + 1), (u64)buf + 512 * k, 512, F_NEXT | F_WRITE, (u16)(3 * k + 2));
			set((u16)(3 * k + 2), (u64)&st_byte, 1, F_WRITE, 0);
			publish((u16)(3 * k));
		}
		wr(R_NOTIFY, 0);
		if (round & 1)
			udelay(round * 3);
		wr(R_STATUS, 0);
	}
	recover_and_report(name);
}

static void __attribute__((noreturn)) case_vcpu_fault(const char *name)
{
	kprintf("PROBE-EVIL case=%s result=faulting\n", name);
	/* No IDT: #UD cannot be delivered -> #DF cannot -> triple fault. */
	struct __attribute__((packed)) {
		u16 limit;
		u64 base;
	} none = {0, 0};
	__asm__ volatile("lidt %0; ud2" ::"m"(none));
	halt_forever();
}

static const char *evil_report(u32 ncpus)
{
	(void)ncpus;
	const char *c = params.evil_case;
	if (strcmp(c, "vcpu-fault") == 0)
		case_vcpu_fault(c);
	if (strcmp(c, "pio-string") == 0) {
		case_pio_string(c);
		return NULL;
	}
	if (strcmp(c, "pio-fuzz") == 0) {
		case_pio_fuzz(c);
		return NULL;
	}
	if (params.blk_disk >= n_vmmio) {
		kprintf("PROBE-ERROR evil no disk %lu\n", params.blk_disk);
		return "no-disk";
	}
	base = vmmio[params.blk_disk].base;
	if (rd(0) != 0x74726976 || rd(8) != 2) {
		kprintf("PROBE-ERROR evil not a virtio-blk device\n");
		return "no-disk";
	}

	if (strcmp(c, "avail0") == 0) {
		/* Available ring at guest address 0: valid memory, but virtio-queue
		 * treats it as "not ready". One request announced there. */
		bool ready;
		up_with((u64)dtab, 0, (u64)&used, QN, &ready);
		if (!ready) {
			report(c, "refused");
			return NULL;
		}
		/* avail->idx at guest address 2 (through asm: C forbids it) */
		__asm__ volatile("movw $1, 2" ::: "memory");
		wr(R_NOTIFY, 0);
		wait_needs_reset(c);
		return NULL;
	}
	if (strcmp(c, "bad-queue") == 0) {
		/* Size 3, misaligned rings, rings outside RAM: each QueueReady
		 * must read back 0; DRIVER_OK without a queue: NEEDS_RESET. */
		bool r1, r2, r3;
		up_with((u64)dtab, (u64)&avail, (u64)&used, 3, &r1);
		up_with((u64)dtab + 8, (u64)&avail + 1, (u64)&used + 2, QN, &r2);
		u32 s = up_with(0x7ffff0000000UL, (u64)&avail, (u64)&used, QN, &r3);
		const char *r = (r1 || r2 || r3)	    ? "accepted"
				: (s & ST_NEEDS_RESET) ? "needs-reset"
						       : "refused";
		kprintf("PROBE-EVIL case=%s result=%s dev_status=0x%x\n", c, r, s);
		return NULL;
	}
	if (strcmp(c, "mmio-fuzz") == 0) {
		case_mmio_fuzz(c);
		return NULL;
	}
	if (strcmp(c, "reset-inflight") == 0) {
		case_reset_inflight(c);
		return NULL;
	}

	if (!up()) {
		report(c, "bring-up-failed");
		return "bring-up";
	}
	if (strcmp(c, "read") == 0) {
		plain(VIRTIO_BLK_T_IN, 0, (u64)buf, 512, true);
	} else if (strcmp(c, "write") == 0) {
		for (u32 i = 0; i < 512; i++)
			buf[i] = (u8)(i ^ 0x5a);
		plain(VIRTIO_BLK_T_OUT, 0, (u64)buf, 512, false);
	} else if (strcmp(c, "huge") == 0) {
		/* 4 GiB - 1 byte of data (len = 0xffffffff), valid status. */
		plain(VIRTIO_BLK_T_IN, 0, (u64)buf, 0xffffffffu, true);
	} else if (strcmp(c, "huge-write") == 0) {
		plain(VIRTIO_BLK_T_OUT, 0, (u64)buf, 0xffffffffu, false);
	} else if (strcmp(c, "indirect-loop") == 0) {
		hdr.type = VIRTIO_BLK_T_IN;
		hdr.sector = 0;
		itab[0] = (struct desc){(u64)&hdr, 16, F_NEXT, 1};
		itab[1] = (struct desc){(u64)buf, 512, F_NEXT | F_WRITE, 2};
		itab[2] = (struct desc){(u64)&st_byte, 1, F_NEXT | F_WRITE, 0}; /* loops */
		set(0, (u64)itab, 3 * sizeof(struct desc), F_INDIRECT, 0);
	} else if (strcmp(c, "chain-loop") == 0) {
		plain(VIRTIO_BLK_T_IN, 0, (u64)buf, 512, true);
		dtab[2].flags |= F_NEXT;
		dtab[2].next = 0;
	} else if (strcmp(c, "bad-next") == 0) {
		plain(VIRTIO_BLK_T_IN, 0, (u64)buf, 512, true);
		dtab[1].next = 200; /* beyond the 16-entry table */
	} else if (strcmp(c, "oob-addr") == 0) {
		/* Data buffer in the MMIO gap, outside guest RAM. */
		plain(VIRTIO_BLK_T_IN, 0, 0xd0100000UL, 512, true);
	} else if (strcmp(c, "oob-addr-write") == 0) {
		plain(VIRTIO_BLK_T_OUT, 0, 0xfffffffffffff000UL, 4096, false);
	} else if (strcmp(c, "oob-sector") == 0) {
		plain(VIRTIO_BLK_T_IN, capacity, (u64)buf, 512, true);
	} else if (strcmp(c, "oob-sector-write") == 0) {
		/* Starts inside the disk, ends one sector beyond it. */
		plain(VIRTIO_BLK_T_OUT, capacity - 1, (u64)buf, 1024, false);
	} else if (strcmp(c, "sector-overflow") == 0) {
		plain(VIRTIO_BLK_T_OUT, ~0UL / 512, (u64)buf, 512, false);
	} else if (strcmp(c, "bad-type") == 0) {
		plain(0xdead, 0, (u64)buf, 512, false);
	} else if (strcmp(c, "no-status") == 0) {
		plain(VIRTIO_BLK_T_OUT, 0, (u64)buf, 512, false);
		dtab[2].flags = 0; /* status descriptor device-readable */
	} else if (strcmp(c, "readable-after-writable") == 0) {
		plain(VIRTIO_BLK_T_IN, 0, (u64)buf, 512, true);
		set(2, (u64)buf + 512, 16, F_NEXT, 3);
		set(3, (u64)&st_byte, 1, F_WRITE, 0);
	} else if (strcmp(c, "avail-ahead") == 0) {
		WRITE_ONCE(avail.idx, 1000);
		wr(R_NOTIFY, 0);
		wait_needs_reset(c);
		return NULL;
	} else {
		kprintf("PROBE-ERROR evil unknown case %s\n", c);
		return "unknown-case";
	}
	submit_and_report(c);
	return NULL;
}

const struct probe_mode mode_evil = {
	.name = "evil",
	.report = evil_report,
};
