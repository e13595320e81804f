/*
 * virtio_blk.c - a virtio-mmio (version 2) virtio-blk driver: polled, or
 * sleeping on the used-ring interrupt.
 *
 * One split virtqueue (queue 0), in .bss, reused for every disk in turn.
 * Each request slot owns a fixed three-descriptor chain: header (16 bytes,
 * device-readable) -> data (device-writable for IN) -> status (1 byte,
 * device-writable). The descriptor table is written once per job; a request
 * then costs a header sector store, a status store and an avail ring entry.
 * Completions are found by polling used->idx in memory (no MMIO on the
 * completion path, one QueueNotify write per batch of completions), with
 * interrupts suppressed (VIRTQ_AVAIL_F_NO_INTERRUPT) while the driver looks.
 * With d->irq (probe.wait=irq, the default) a wait that polled d->spin_tsc
 * in vain enables the used-buffer interrupt and sleeps in hlt until it
 * comes (irq.c), so a throttled job leaves its vCPU idle instead of
 * spinning; probe.wait=poll spins for the whole wait (the old behaviour).
 *
 * The guest may run in the host's instruction emulator at ~1 us per
 * instruction (~0.5 us register-only, ~1 us with a memory operand, ~0.9 us
 * per rep-string iteration, measured), so the read/write steady state is 19
 * instructions per request (fast_path) and never touches the data buffers;
 * only the verify pattern (fill/check) does.
 */
#include "probe.h"

/* virtio-mmio registers (virtio 1.2, 4.2.2) */
#define VM_MAGIC 0x000
#define VM_VERSION 0x004
#define VM_DEVICE_ID 0x008
#define VM_DEV_FEATURES 0x010
#define VM_DEV_FEATURES_SEL 0x014
#define VM_DRV_FEATURES 0x020
#define VM_DRV_FEATURES_SEL 0x024
#define VM_QUEUE_SEL 0x030
#define VM_QUEUE_NUM_MAX 0x034
#define VM_QUEUE_NUM 0x038
#define VM_QUEUE_READY 0x044
#define VM_QUEUE_NOTIFY 0x050
#define VM_STATUS 0x070
#define VM_QUEUE_DESC_LO 0x080
#define VM_QUEUE_DESC_HI 0x084
#define VM_QUEUE_DRIVER_LO 0x090
#define VM_QUEUE_DRIVER_HI 0x094
#define VM_QUEUE_DEVICE_LO 0x0a0
#define VM_QUEUE_DEVICE_HI 0x0a4
#define VM_CONFIG_GEN 0x0fc
#define VM_CONFIG 0x100

#define VIRTIO_MAGIC 0x74726976 /* "virt" */

/* device status bits */
#define S_ACK 1
#define S_DRIVER 2
#define S_DRIVER_OK 4
#define S_FEATURES_OK 8
#define S_NEEDS_RESET 0x40
#define S_FAILED 0x80

/* virtio-blk config offsets */
#define BLK_CFG_CAPACITY 0
#define BLK_CFG_SEG_MAX 12
#define BLK_CFG_BLK_SIZE 20

#define VRING_DESC_F_NEXT 1
#define VRING_DESC_F_WRITE 2
#define VRING_AVAIL_F_NO_INTERRUPT 1
#define VRING_USED_F_NO_NOTIFY 1

#define STATUS_PENDING 0xff

struct vq_desc {
	u64 addr;
	u32 len;
	u16 flags;
	u16 next;
};
struct vq_avail {
	u16 flags;
	u16 idx;
	u16 ring[VQ_SIZE_MAX + 1]; /* + used_event */
};
struct vq_used_elem {
	u32 id;
	u32 len;
};
struct vq_used {
	u16 flags;
	u16 idx;
	struct vq_used_elem ring[VQ_SIZE_MAX];
	u16 avail_event;
};
struct blk_hdr {
	u32 type;
	u32 reserved;
	u64 sector;
};

static struct vq_desc vq_desc[VQ_SIZE_MAX] __attribute__((aligned(4096)));
static struct vq_avail vq_avail __attribute__((aligned(4096)));
static struct vq_used vq_used __attribute__((aligned(4096)));
/*
 * Headers, by head descriptor h (3 * slot): the header of head h starts at
 * hdr_words[h], so they are 24 bytes apart and the sector of head h is
 * hdr_words[h + 1], one scaled-index store with no multiply (the hot loop is
 * counted in instructions).
 */
static u64 hdr_words[VQ_SIZE_MAX + 2] __attribute__((aligned(64)));
#define HDR(h) ((struct blk_hdr *)&hdr_words[h])
#define HDR_SECTOR(h) hdr_words[(h) + 1]
static volatile u8 status[VQ_SIZE_MAX];
static u64 slot_buf[VQ_SIZE_MAX];

/* Driver's copies of the ring indices. */
static u16 avail_idx, used_idx;

static inline u32 rd(const struct vblk_dev *d, u32 off) { return mmio_read32(d->base + off); }
static inline void wr(const struct vblk_dev *d, u32 off, u32 v) { mmio_write32(d->base + off, v); }
static inline void barrier(void) { __asm__ volatile("" ::: "memory"); }

static u64 cfg_read64(const struct vblk_dev *d, u32 off)
{
	for (int tries = 0; tries < 8; tries++) {
		u32 g0 = rd(d, VM_CONFIG_GEN);
		u64 lo = rd(d, VM_CONFIG + off);
		u64 hi = rd(d, VM_CONFIG + off + 4);
		if (rd(d, VM_CONFIG_GEN) == g0)
			return lo | hi << 32;
	}
	return ~0UL;
}

void vblk_reset(struct vblk_dev *d)
{
	wr(d, VM_STATUS, 0);
	for (int i = 0; i < 1000 && rd(d, VM_STATUS) != 0; i++)
		udelay(10);
}

static const char *fail(struct vblk_dev *d, const char *why)
{
	wr(d, VM_STATUS, rd(d, VM_STATUS) | S_FAILED);
	return why;
}

/* Brings the device at d->base up to DRIVER_OK. NULL or an error text. */
const char *vblk_init(struct vblk_dev *d)
{
	if (d->base + 0x1000 > (1UL << 32) || (d->base & 0xfff))
		return "window-outside-low-4g";
	u32 magic = rd(d, VM_MAGIC), ver = rd(d, VM_VERSION), id = rd(d, VM_DEVICE_ID);
	if (magic != VIRTIO_MAGIC)
		return "bad-magic";
	if (ver != 2)
		return "not-virtio-mmio-v2";
	if (id != 2)
		return id == 0 ? "no-device" : "not-a-block-device";

	vblk_reset(d);
	if (rd(d, VM_STATUS) != 0)
		return "reset-failed";
	wr(d, VM_STATUS, S_ACK);
	wr(d, VM_STATUS, S_ACK | S_DRIVER);

	wr(d, VM_DEV_FEATURES_SEL, 0);
	u64 f = rd(d, VM_DEV_FEATURES);
	wr(d, VM_DEV_FEATURES_SEL, 1);
	f |= (u64)rd(d, VM_DEV_FEATURES) << 32;
	d->dev_features = f;
	if (!(f & VIRTIO_F_VERSION_1))
		return fail(d, "no-version-1");
	d->features = f & (VIRTIO_F_VERSION_1 | VIRTIO_BLK_F_SEG_MAX | VIRTIO_BLK_F_BLK_SIZE |
			   VIRTIO_BLK_F_FLUSH | VIRTIO_BLK_F_RO);
	wr(d, VM_DRV_FEATURES_SEL, 0);
	wr(d, VM_DRV_FEATURES, (u32)d->features);
	wr(d, VM_DRV_FEATURES_SEL, 1);
	wr(d, VM_DRV_FEATURES, (u32)(d->features >> 32));
	wr(d, VM_STATUS, S_ACK | S_DRIVER | S_FEATURES_OK);
	if (!(rd(d, VM_STATUS) & S_FEATURES_OK))
		return fail(d, "features-not-accepted");

	d->capacity = cfg_read64(d, BLK_CFG_CAPACITY);
	d->seg_max = (d->features & VIRTIO_BLK_F_SEG_MAX) ? rd(d, VM_CONFIG + BLK_CFG_SEG_MAX) : 0;
	d->blk_size = (d->features & VIRTIO_BLK_F_BLK_SIZE) ? rd(d, VM_CONFIG + BLK_CFG_BLK_SIZE)
							    : 512;
	d->ro = (d->features & VIRTIO_BLK_F_RO) != 0;

	wr(d, VM_QUEUE_SEL, 0);
	if (rd(d, VM_QUEUE_READY) != 0)
		return fail(d, "queue-already-ready");
	u32 max = rd(d, VM_QUEUE_NUM_MAX);
	if (max == 0)
		return fail(d, "queue-unavailable");
	u32 n = VQ_SIZE_MAX;
	while (n > max)
		n >>= 1;
	if (n < 4)
		return fail(d, "queue-too-small");
	d->qsize = (u16)n;

	/* Only the ring headers need resetting (zeroing all of it would cost
	 * ~7k rep iterations, ~6 ms, in the emulator): descriptors and avail
	 * entries are written before they are published, used entries by the
	 * device before it moves used->idx. */
	vq_avail.idx = 0;
	vq_avail.flags = VRING_AVAIL_F_NO_INTERRUPT; /* on only for a sleep */
	vq_used.idx = 0;
	vq_used.flags = 0;
	avail_idx = used_idx = 0;

	wr(d, VM_QUEUE_NUM, n);
	wr(d, VM_QUEUE_DESC_LO, (u32)(u64)vq_desc);
	wr(d, VM_QUEUE_DESC_HI, (u32)((u64)vq_desc >> 32));
	wr(d, VM_QUEUE_DRIVER_LO, (u32)(u64)&vq_avail);
	wr(d, VM_QUEUE_DRIVER_HI, (u32)((u64)&vq_avail >> 32));
	wr(d, VM_QUEUE_DEVICE_LO, (u32)(u64)&vq_used);
	wr(d, VM_QUEUE_DEVICE_HI, (u32)((u64)&vq_used >> 32));
	wr(d, VM_QUEUE_READY, 1);
	if (rd(d, VM_QUEUE_READY) != 1)
		return fail(d, "queue-not-ready");

	wr(d, VM_STATUS, S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
	u32 st = rd(d, VM_STATUS);
	if (st & S_NEEDS_RESET)
		return fail(d, "device-needs-reset");
	if (!(st & S_DRIVER_OK))
		return fail(d, "driver-ok-not-accepted");
	return NULL;
}

/* Device status register, for a post-run health check. */
u32 vblk_device_status(const struct vblk_dev *d) { return rd(d, VM_STATUS); }

/* Chain for slot head h: header -> [data] -> status. */
static void chain_setup(u16 h, u32 type, u64 buf, u32 len, bool dev_writes)
{
	HDR(h)->type = type;
	HDR(h)->reserved = 0;
	vq_desc[h].addr = (u64)HDR(h);
	vq_desc[h].len = sizeof(struct blk_hdr);
	vq_desc[h].flags = VRING_DESC_F_NEXT;
	u16 s = h + 1;
	if (len) {
		vq_desc[h].next = h + 1;
		vq_desc[h + 1].addr = buf;
		vq_desc[h + 1].len = len;
		vq_desc[h + 1].flags = VRING_DESC_F_NEXT | (dev_writes ? VRING_DESC_F_WRITE : 0);
		vq_desc[h + 1].next = h + 2;
		s = h + 2;
	} else {
		vq_desc[h].next = h + 1;
	}
	vq_desc[s].addr = (u64)&status[h];
	vq_desc[s].len = 1;
	vq_desc[s].flags = VRING_DESC_F_WRITE;
	vq_desc[s].next = 0;
	slot_buf[h] = buf;
}

/*
 * Notifications actually written (QueueNotify) and skipped because the
 * device said it needs none (VRING_USED_F_NO_NOTIFY: it is serving or
 * polling the ring). Reported on the result line.
 */
u64 vblk_notifies, vblk_notifies_skipped;

/*
 * Publish the avail index and notify unless the device set
 * VRING_USED_F_NO_NOTIFY (virtio 1.2, 2.7.10: without EVENT_IDX the driver
 * reads the flag after a full barrier that orders its avail-index store
 * before the load). The barrier is a locked add to the stack, not mfence
 * (SSE2). A notify is an in-kernel ioeventfd write, 3-12 us of guest time
 * here; a device that polls the ring after a batch keeps the flag set, and
 * then the driver's steady state has no exit at all.
 */
static inline void kick(const struct vblk_dev *d)
{
	WRITE_ONCE(vq_avail.idx, avail_idx);
	__asm__ volatile("lock; addl $0, -8(%%rsp)" ::: "memory", "cc");
	if (READ_ONCE(vq_used.flags) & VRING_USED_F_NO_NOTIFY) {
		vblk_notifies_skipped++;
		return;
	}
	vblk_notifies++;
	wr(d, VM_QUEUE_NOTIFY, 0);
}

/*
 * irq mode, a wait that found nothing: enable the used-buffer interrupt,
 * look at used->idx once more, and sleep unless it moved. The full barrier
 * orders the flag store before the index load; the device does the mirror
 * image (used->idx store, fence, flag load), so either it sees the flag
 * clear and interrupts, or the driver sees the new index (virtio 1.2,
 * 2.7.10). An interrupt raised before the hlt is pending and ends it at once.
 */
static void sleep_for_used(u16 uidx, u64 until)
{
	WRITE_ONCE(vq_avail.flags, 0);
	__asm__ volatile("lock; addl $0, -8(%%rsp)" ::: "memory", "cc");
	if (READ_ONCE(vq_used.idx) == uidx)
		irq_sleep(until);
	WRITE_ONCE(vq_avail.flags, VRING_AVAIL_F_NO_INTERRUPT);
}

/*
 * The wait for used->idx to move past uidx, once a first look found nothing.
 * poll: spin, reading the clock every 256 spins for the idle timeout. irq:
 * read it every 8 spins (the guest may run in the emulator at ~1 us per
 * instruction, where 256 spins are ~0.8 ms of CPU: that was 16 % of a CPU
 * for a job throttled to 100 ops/s) and sleep once the wait has lasted
 * d->spin_tsc. Returns the new index, or sets *timeout.
 */
static __attribute__((noinline)) u16 wait_used(const struct vblk_dev *d, u16 uidx, u64 idle_lim,
					      bool *timeout)
{
	const u32 every = d->irq ? 8 : 256;
	u64 t0 = rdtsc();
	u32 spins = 0;
	for (;;) {
		u16 ui = READ_ONCE(vq_used.idx);
		if (ui != uidx)
			return ui;
		if (++spins < every)
			continue;
		spins = 0;
		u64 now = rdtsc();
		if (now - t0 > idle_lim) {
			*timeout = true;
			return ui;
		}
		if (d->irq && now - t0 >= d->spin_tsc)
			sleep_for_used(uidx, t0 + idle_lim + 1);
	}
}

/* One request with the queue otherwise idle. Returns the status byte, or
 * VBLK_TIMEOUT / VBLK_BAD_COMPLETION. */
u32 vblk_sync(const struct vblk_dev *d, u32 type, u64 sector, u64 buf, u32 len, bool dev_writes,
	      u64 timeout_ms)
{
	chain_setup(0, type, buf, len, dev_writes);
	HDR_SECTOR(0) = sector;
	status[0] = STATUS_PENDING;
	vq_avail.ring[avail_idx & (d->qsize - 1)] = 0;
	avail_idx++;
	kick(d);
	u64 t0 = rdtsc(), lim = ms_to_tsc(timeout_ms);
	while (READ_ONCE(vq_used.idx) == used_idx) {
		u64 now = rdtsc();
		if (now - t0 > lim)
			return VBLK_TIMEOUT;
		if (d->irq && now - t0 >= d->spin_tsc)
			sleep_for_used(used_idx, t0 + lim + 1);
		else
			cpu_relax();
	}
	u32 id = vq_used.ring[used_idx & (d->qsize - 1)].id;
	used_idx++;
	if (id != 0 || READ_ONCE(vq_used.idx) != used_idx)
		return VBLK_BAD_COMPLETION;
	return status[0];
}

/* ---- verify pattern ----
 * Sector s (512 bytes = 64 words): w[0] = s ^ seed_hash, w[1] = seed_hash2,
 * w[2..63] = pat[2 + (s & 63) ..], a window into a seed-derived table. It
 * depends on the sector throughout, costs one `rep movsq` per sector to
 * write and one `repe cmpsq` to check (the emulator runs a rep iteration far
 * cheaper than an instruction).
 */
static u64 pat[128];
static u64 pat_h0, pat_h1;

static u64 splitmix(u64 *x)
{
	u64 z = (*x += 0x9e3779b97f4a7c15UL);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9UL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebUL;
	return z ^ (z >> 31);
}

void vblk_pattern_init(u64 seed)
{
	u64 x = seed;
	for (u32 i = 0; i < 128; i++)
		pat[i] = splitmix(&x);
	pat_h0 = splitmix(&x);
	pat_h1 = splitmix(&x);
}

static void pattern_fill(u64 *p, u64 sector, u32 nsec)
{
	for (u32 i = 0; i < nsec; i++, sector++, p += 64) {
		p[0] = sector ^ pat_h0;
		p[1] = pat_h1;
		const u64 *src = &pat[2 + (sector & 63)];
		u64 *dst = p + 2;
		u64 n = 62;
		__asm__ volatile("rep movsq" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
	}
}

/* Number of sectors in [p, p + nsec*512) that differ from the pattern; the
 * first bad sector goes to *first. */
static u64 pattern_check(const u64 *p, u64 sector, u32 nsec, u64 *first)
{
	u64 bad = 0;
	for (u32 i = 0; i < nsec; i++, sector++, p += 64) {
		bool ne = p[0] != (sector ^ pat_h0) || p[1] != pat_h1;
		if (!ne) {
			const u64 *a = p + 2, *b = &pat[2 + (sector & 63)];
			u64 n = 62;
			__asm__ volatile("repe cmpsq"
					 : "+D"(a), "+S"(b), "+c"(n), "=@ccne"(ne)
					 :
					 : "memory");
		}
		if (ne) {
			if (!bad && *first == ~0UL)
				*first = sector;
			bad++;
		}
	}
	return bad;
}

/*
 * Read/write steady state, in assembly because the guest may run in the
 * host's instruction emulator where each instruction costs ~0.5-1 us:
 * consume completions [*uidx, ui) as long as each is one of ours (head <
 * nh), has status OK and is not followed by the last request (which may be
 * short), resubmitting its slot with the next sector. Stops at the first
 * completion that needs the general path (left unconsumed). While it runs,
 * aidx - uidx is constant (one submission per completion), so the avail
 * slot is (uidx + k) & mask. 19 instructions, 5 memory accesses per request
 * (sequential: *sec is the next sector, step the sectors per request);
 * random: *sec points into the table of sectors (step 8), one load and one
 * instruction more.
 */
#define FAST_PATH_ASM(SECTOR_STORE)                                                               \
	"	cmpw	%w[ui], %w[u]\n"                                                          \
	"	je	9f\n"                                                                     \
	"1:	mov	%[u], %%eax\n"                                                            \
	"	and	%[mask], %%eax\n"                                                         \
	"	mov	%c[ring](,%%rax,8), %%eax\n" /* used->ring[].id */                        \
	"	cmp	%[nh], %%eax\n"                                                           \
	"	jae	9f\n"                                                                     \
	"	cmpb	$0, %c[st](%%rax)\n"                                                      \
	"	jne	9f\n"                                                                     \
	"	test	%[nf], %[nf]\n"                                                           \
	"	jz	9f\n"                                                                     \
	"	dec	%[nf]\n"                                                                  \
	"	movb	$0xff, %c[st](%%rax)\n" SECTOR_STORE "	add	%[step], %[s]\n"           \
	"	lea	(%q[u],%[k]), %%edx\n"                                                    \
	"	and	%[mask], %%edx\n"                                                         \
	"	inc	%[u]\n"                                                                   \
	"	mov	%%ax, %c[avail](%%rdx,%%rdx)\n"                                           \
	"	cmpw	%w[ui], %w[u]\n"                                                          \
	"	jne	1b\n"                                                                     \
	"9:\n"
#define SEQ_STORE "	mov	%[s], %c[sect](,%%rax,8)\n"
#define RND_STORE "	mov	(%[s]), %%rcx\n	mov	%%rcx, %c[sect](,%%rax,8)\n"
#define FAST_PATH_OPERANDS                                                                       \
	: [u] "+r"(u), [nf] "+r"(nf), [s] "+r"(s)                                                 \
	: [ui] "r"((u32)ui), [mask] "r"(mask), [nh] "r"(nh), [step] "r"(step), [k] "r"(k),        \
	  [ring] "i"(&vq_used.ring[0].id), [st] "i"(&status[0]), [sect] "i"(&HDR_SECTOR(0)),      \
	  [avail] "i"(&vq_avail.ring[0])                                                          \
	: "rax", "rcx", "rdx", "memory", "cc"

static inline __attribute__((always_inline)) void fast_path(u32 *uidx, u16 ui, u32 *aidx, u64 *sec,
							    u64 *nleft, u32 mask, u32 nh, u64 step,
							    const bool rnd)
{
	u32 u = *uidx, u0 = u;
	u64 k = *aidx - u;
	u64 nf = *nleft ? *nleft - 1 : 0; /* submissions allowed before the last one */
	u64 s = *sec;
	if (rnd)
		__asm__ volatile(FAST_PATH_ASM(RND_STORE) FAST_PATH_OPERANDS);
	else
		__asm__ volatile(FAST_PATH_ASM(SEQ_STORE) FAST_PATH_OPERANDS);
	u32 n = u - u0;
	*uidx = u;
	*aidx += n;
	*nleft -= n;
	*sec = s;
}

/*
 * The job loop. Completion and resubmission are fused: a completed slot is
 * refilled with the next request on the spot (no free list), the avail index
 * is published and the device notified once per batch of completions.
 * Requests done = submitted - outstanding, both from the ring indices, so
 * nothing is counted per request. Specialised for fill/check at compile time
 * so read and write jobs carry no verify code. About 5 memory accesses and a
 * dozen register instructions per request.
 */
static inline __attribute__((always_inline)) void
run_loop(const struct vblk_dev *d, const struct vblk_job *job, struct vblk_stats *st,
	 const bool fill, const bool check, const bool rnd)
{
	const u32 mask = d->qsize - 1u;
	const u64 bs = job->bs, spr = job->bs >> 9; /* sectors per request */
	/* sec: the next sector (sequential), or a pointer to it in the table */
	const u64 step = rnd ? sizeof(u64) : spr;
#define SEC_VAL(x) (rnd ? *(const u64 *)(x) : (x))
	const u64 nreq = (job->bytes + bs - 1) / bs;
	const u32 tail = (u32)(job->bytes - (nreq - 1) * bs); /* bytes of the last one */
	const u64 idle_lim = ms_to_tsc(job->timeout_ms);
	u64 nleft = nreq, sec = rnd ? (u64)job->sectors : job->sector;
	/* u32 copies of the u16 ring indices: no zero-extensions in the loop */
	u32 aidx = avail_idx, uidx = used_idx;
	u64 ioerr = 0, unsupp = 0, nostatus = 0, errbytes = 0;
	bool timeout = false, badhead = false;

	u32 qd = job->qd;
	if (qd > nreq)
		qd = (u32)nreq;
	for (u32 i = 0; i < qd; i++)
		chain_setup((u16)(3 * i), job->type, job->buf + (u64)i * bs, (u32)bs,
			    job->type == VIRTIO_BLK_T_IN);

	const u32 nh = 3 * qd; /* heads in use: 0, 3, .., 3 * (qd - 1) */
	u64 t0 = rdtsc();
	for (u32 i = 0; i < qd; i++) {
		u16 h = (u16)(3 * i);
		HDR_SECTOR(h) = SEC_VAL(sec);
		status[h] = STATUS_PENDING;
		if (--nleft == 0 && tail != bs)
			vq_desc[h + 1].len = tail; /* the short last request */
		if (fill)
			pattern_fill((u64 *)slot_buf[h], HDR_SECTOR(h), vq_desc[h + 1].len >> 9);
		vq_avail.ring[aidx & mask] = h;
		aidx++;
		sec += step;
	}
	avail_idx = (u16)aidx;
	barrier();
	kick(d);

	for (;;) {
		/* Wait for a completion: poll used->idx in memory, no MMIO. */
		u16 ui = READ_ONCE(vq_used.idx);
		if (ui == (u16)uidx) {
			ui = wait_used(d, (u16)uidx, idle_lim, &timeout);
			if (timeout)
				goto out;
		}
		const u32 a0 = aidx;
		do {
			if (!fill && !check) {
				fast_path(&uidx, ui, &aidx, &sec, &nleft, mask, nh, step, rnd);
				if ((u16)uidx == ui)
					break;
			}
			u32 h = vq_used.ring[uidx & mask].id;
			uidx++;
			if (__builtin_expect(h >= nh, 0)) {
				badhead = true; /* not one of ours: give up on this device */
				goto out;
			}
			u8 s = status[h];
			if (__builtin_expect(s != 0, 0)) {
				errbytes += vq_desc[h + 1].len;
				if (s == VIRTIO_BLK_S_IOERR)
					ioerr++;
				else if (s == VIRTIO_BLK_S_UNSUPP)
					unsupp++;
				else
					nostatus++; /* status not written (still 0xff) or garbage */
			} else if (check) {
				st->mismatches += pattern_check((const u64 *)slot_buf[h], HDR_SECTOR(h),
								vq_desc[h + 1].len >> 9,
								&st->first_mismatch);
			}
			if (nleft) {
				HDR_SECTOR(h) = SEC_VAL(sec);
				status[h] = STATUS_PENDING;
				if (__builtin_expect(--nleft == 0, 0)) {
					if (tail != bs)
						vq_desc[h + 1].len = tail;
				}
				if (fill)
					pattern_fill((u64 *)slot_buf[h], HDR_SECTOR(h),
						     vq_desc[h + 1].len >> 9);
				vq_avail.ring[aidx & mask] = (u16)h;
				aidx++;
				sec += step;
			}
		} while ((u16)uidx != ui);
		if (aidx != a0) {
			avail_idx = (u16)aidx;
			barrier();
			kick(d);
		} else if ((u16)aidx == (u16)uidx) {
			break; /* nothing left, nothing in flight */
		}
	}
out:
	st->cycles += rdtsc() - t0;
	used_idx = (u16)uidx;
	avail_idx = (u16)aidx;
	u32 outstanding = (u16)(aidx - uidx);
	u64 done = (nreq - nleft) - outstanding;
	u64 errors = ioerr + unsupp + nostatus;
	st->requests += done;
	st->errors += errors + badhead;
	st->ioerr += ioerr;
	st->unsupp += unsupp;
	st->bad += nostatus + badhead;
	st->timeout = timeout;
	st->in_flight = outstanding;
	/* Bytes of the requests that completed with status OK. */
	u64 completed = (nleft == 0 && outstanding == 0 && !badhead) ? job->bytes : done * bs;
	st->bytes += completed - errbytes;
#undef SEC_VAL
}

/*
 * Runs a job: job->bytes from job->sector in requests of job->bs bytes, at
 * most job->qd in flight, slot i's buffer at job->buf + i * job->bs.
 */
#define RUN_VARIANT(name, f, c, r)                                                                \
	static __attribute__((noinline)) void name(const struct vblk_dev *d,                      \
						   const struct vblk_job *job, struct vblk_stats *st) \
	{                                                                                         \
		run_loop(d, job, st, f, c, r);                                                    \
	}
RUN_VARIANT(run_plain, false, false, false)
RUN_VARIANT(run_fill, true, false, false)
RUN_VARIANT(run_check, false, true, false)
RUN_VARIANT(run_plain_rnd, false, false, true)
RUN_VARIANT(run_fill_rnd, true, false, true)
RUN_VARIANT(run_check_rnd, false, true, true)

void vblk_run(const struct vblk_dev *d, const struct vblk_job *job, struct vblk_stats *st)
{
	bool rnd = job->sectors != NULL;
	if (job->fill)
		(rnd ? run_fill_rnd : run_fill)(d, job, st);
	else if (job->check)
		(rnd ? run_check_rnd : run_check)(d, job, st);
	else
		(rnd ? run_plain_rnd : run_plain)(d, job, st);
}

/*
 * The random offsets, drawn before the job (its clock starts at the first
 * submit): slot k of `slots` is splitmix64 % slots, an exact and portable
 * rule that a host-side test reproduces (tests/tests/blk_random.rs).
 */
void vblk_random_sectors(u64 *out, u64 n, u64 seed, u64 off_sec, u64 slots, u64 spr)
{
	u64 x = seed ^ VBLK_OFFSET_SALT;
	for (u64 i = 0; i < n; i++)
		out[i] = off_sec + (splitmix(&x) % slots) * spr;
}
