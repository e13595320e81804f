/*
 * mode_blk.c - probe.mode=blk: I/O on the virtio-blk disks announced by
 * virtio_mmio.device= entries (see virtio_blk.c for the driver).
 *
 * op=read|write: probe.size bytes from probe.offset in probe.bs requests,
 * probe.qd in flight; with probe.pattern=random each request goes to a
 * bs-aligned offset drawn from probe.seed within probe.span bytes from
 * probe.offset (default: to the end of the disk); op=verify: write a seed- and sector-dependent pattern,
 * (flush,) read it back and compare; op=flush; op=getid. Runs on the BSP
 * only; the APs halt. Everything happens in report(), after the CPUs are up.
 */
#include "probe.h"

#define BUF_BASE (4UL << 20)          /* data buffers: guest RAM from 4 MiB up */
#define DEFAULT_SIZE_CAP (32UL << 20) /* default probe.size: whole disk, capped */

static u8 idbuf[20] __attribute__((aligned(64)));

static u64 cyc_us(u64 cyc) { return cyc * 1000 / tsc_khz; }

static const char *status_word(u32 s)
{
	switch (s) {
	case VIRTIO_BLK_S_OK: return "ok";
	case VIRTIO_BLK_S_IOERR: return "ioerr";
	case VIRTIO_BLK_S_UNSUPP: return "unsupp";
	case VBLK_TIMEOUT: return "timeout";
	case VBLK_BAD_COMPLETION: return "bad-completion";
	default: return "bad-status";
	}
}

/* One synchronous request (flush / getid); prints a PROBE-ERROR on failure. */
static const char *sync_req(const struct vblk_dev *d, u32 disk, u32 type, u64 buf, u32 len,
			    u64 *us)
{
	u64 t0 = rdtsc();
	u32 s = vblk_sync(d, type, 0, buf, len, len != 0, params.blk_timeout_ms);
	*us = cyc_us(rdtsc() - t0);
	if (s == VIRTIO_BLK_S_OK)
		return NULL;
	kprintf("PROBE-ERROR blk disk=%u %s status=%s\n", disk,
		type == VIRTIO_BLK_T_FLUSH ? "flush" : "getid", status_word(s));
	return s == VBLK_TIMEOUT ? "timeout" : "io-error";
}

static const char *do_getid(const struct vblk_dev *d, u32 disk)
{
	u64 us;
	memset(idbuf, 0, sizeof(idbuf));
	const char *r = sync_req(d, disk, VIRTIO_BLK_T_GET_ID, (u64)idbuf, sizeof(idbuf), &us);
	char serial[21];
	u32 n = 0;
	for (; n < 20 && idbuf[n]; n++)
		serial[n] = (idbuf[n] > 0x20 && idbuf[n] < 0x7f) ? (char)idbuf[n] : '?';
	serial[n] = '\0';
	kprintf("PROBE-RESULT mode=blk disk=%u op=getid requests=1 errors=%u us=%lu capacity=%lu "
		"serial=%s\n",
		disk, r ? 1 : 0, us, d->capacity, serial);
	return r;
}

static const char *do_flush(const struct vblk_dev *d, u32 disk, u64 *us)
{
	if (!(d->features & VIRTIO_BLK_F_FLUSH)) {
		kprintf("PROBE-ERROR blk disk=%u flush-not-offered\n", disk);
		return "flush-unsupported";
	}
	return sync_req(d, disk, VIRTIO_BLK_T_FLUSH, 0, 0, us);
}

/* Prints the error lines for a job's stats; returns a reason or NULL. */
static const char *job_verdict(u32 disk, const char *what, const struct vblk_stats *st)
{
	if (st->timeout) {
		kprintf("PROBE-ERROR blk disk=%u %s timeout in_flight=%u done=%lu\n", disk, what,
			st->in_flight, st->requests);
		return "timeout";
	}
	if (st->errors) {
		kprintf("PROBE-ERROR blk disk=%u %s errors=%lu ioerr=%lu unsupp=%lu bad=%lu\n", disk,
			what, st->errors, st->ioerr, st->unsupp, st->bad);
		return "io-error";
	}
	return NULL;
}

static const char *do_io(const struct vblk_dev *d, u32 disk)
{
	const char *op = params.blk_op;
	bool verify = strcmp(op, "verify") == 0;
	u64 cap_bytes = d->capacity << 9;
	u64 off = params.blk_offset, size = params.blk_size;
	if (d->capacity >> 54 || off >= cap_bytes) {
		kprintf("PROBE-ERROR blk disk=%u offset-past-end offset=%lu capacity=%lu\n", disk, off,
			d->capacity);
		return "range";
	}
	bool rnd = params.blk_random;
	u64 span = rnd && params.blk_span ? params.blk_span : cap_bytes - off;
	if (span > cap_bytes - off) {
		kprintf("PROBE-ERROR blk disk=%u span-past-end offset=%lu span=%lu capacity=%lu\n",
			disk, off, span, d->capacity);
		return "range";
	}
	if (!size) {
		size = span;
		if (size > DEFAULT_SIZE_CAP)
			size = DEFAULT_SIZE_CAP;
	}
	/* Random requests stay inside the span however many there are. */
	if (!rnd && size > cap_bytes - off) {
		kprintf("PROBE-ERROR blk disk=%u range-past-end offset=%lu size=%lu capacity=%lu\n",
			disk, off, size, d->capacity);
		return "range";
	}
	u32 bs = (u32)params.blk_bs, qd = (u32)params.blk_qd;
	u64 slots = span / bs, nreq = (size + bs - 1) / bs;
	if (rnd && slots == 0) {
		kprintf("PROBE-ERROR blk disk=%u span-below-bs span=%lu bs=%u\n", disk, span, bs);
		return "bad-param";
	}
	if (3 * qd > d->qsize) {
		/* three descriptors per request in flight */
		kprintf("PROBE-ERROR blk disk=%u qd-too-deep qd=%u qsize=%u max_qd=%u\n", disk, qd,
			d->qsize, d->qsize / 3u);
		return "bad-param";
	}
	u64 buf = BUF_BASE;
	u64 img = ((u64)__image_end + 0x1fffff) & ~0x1fffffUL;
	if (img > buf)
		buf = img;
	/* random: the table of first sectors, one per request, after the buffers */
	u64 need = (u64)qd * bs + (rnd ? nreq * sizeof(u64) : 0);
	if (!ram_range_ok(buf, need) || buf + need > (1UL << 32)) {
		kprintf("PROBE-ERROR blk no-memory buffers=%lu@0x%lx mem_kib=%lu\n", need, buf,
			usable_kib);
		return "no-memory";
	}

	u64 *sectors = NULL;
	if (rnd) {
		sectors = (u64 *)(buf + (u64)qd * bs);
		vblk_random_sectors(sectors, nreq, params.blk_seed, off >> 9, slots, bs >> 9);
	}

	struct vblk_job job = {
		.sector = off >> 9,
		.bytes = size,
		.bs = bs,
		.qd = qd,
		.buf = buf,
		.sectors = sectors,
		.timeout_ms = params.blk_timeout_ms,
	};
	struct vblk_stats st, wst;
	memset(&st, 0, sizeof(st));
	st.first_mismatch = ~0UL;
	vblk_notifies = vblk_notifies_skipped = 0;
	irq_count = irq_sleeps = irq_timeouts = 0;
	const char *reason = NULL;
	u64 flush_us = 0, write_us = 0, read_us = 0;
	bool flushed = false;

	if (verify) {
		vblk_pattern_init(params.blk_seed);
		job.type = VIRTIO_BLK_T_OUT;
		job.fill = true;
		vblk_run(d, &job, &st);
		reason = job_verdict(disk, "write", &st);
		write_us = cyc_us(st.cycles);
		wst = st;
		if (!st.timeout && params.blk_flush) {
			reason = do_flush(d, disk, &flush_us) ?: reason;
			flushed = true;
		}
		if (!st.timeout) {
			memset(&st, 0, sizeof(st));
			st.first_mismatch = ~0UL;
			job.type = VIRTIO_BLK_T_IN;
			job.fill = false;
			job.check = true;
			vblk_run(d, &job, &st);
			read_us = cyc_us(st.cycles);
			reason = job_verdict(disk, "read", &st) ?: reason;
			st.requests += wst.requests;
			st.errors += wst.errors;
			st.bytes += wst.bytes;
			st.cycles += wst.cycles;
			if (st.mismatches) {
				kprintf("PROBE-ERROR blk disk=%u mismatches=%lu first_sector=%lu\n", disk,
					st.mismatches, st.first_mismatch);
				reason = reason ?: "mismatch";
			}
		}
	} else {
		/* read, write; fill = write the verify pattern, check = read and compare */
		bool fill = strcmp(op, "fill") == 0, check = strcmp(op, "check") == 0;
		if (fill || check)
			vblk_pattern_init(params.blk_seed);
		job.type = (fill || strcmp(op, "write") == 0) ? VIRTIO_BLK_T_OUT : VIRTIO_BLK_T_IN;
		job.fill = fill;
		job.check = check;
		vblk_run(d, &job, &st);
		reason = job_verdict(disk, op, &st);
		if (!st.timeout && params.blk_flush) {
			reason = do_flush(d, disk, &flush_us) ?: reason;
			flushed = true;
		}
		if (check && st.mismatches) {
			kprintf("PROBE-ERROR blk disk=%u mismatches=%lu first_sector=%lu\n", disk,
				st.mismatches, st.first_mismatch);
			reason = reason ?: "mismatch";
		}
		verify = check; /* print mismatches= */
	}

	console_lock();
	kprintf_unlocked("PROBE-RESULT mode=blk disk=%u op=%s requests=%lu errors=%lu bytes=%lu "
			 "us=%lu capacity=%lu bs=%u qd=%u notifies=%lu skipped=%lu wait=%s sleeps=%lu "
			 "irqs=%lu timer_wakes=%lu pattern=%s",
			 disk, op, st.requests, st.errors, st.bytes, cyc_us(st.cycles), d->capacity,
			 bs, qd, vblk_notifies, vblk_notifies_skipped, d->irq ? "irq" : "poll",
			 irq_sleeps, irq_count, irq_timeouts, rnd ? "random" : "seq");
	if (rnd)
		kprintf_unlocked(" span=%lu", span);
	if (verify && strcmp(op, "verify") == 0)
		kprintf_unlocked(" mismatches=%lu write_us=%lu read_us=%lu", st.mismatches, write_us,
				 read_us);
	else if (verify)
		kprintf_unlocked(" mismatches=%lu", st.mismatches);
	if (flushed)
		kprintf_unlocked(" flush_us=%lu", flush_us);
	kprintf_unlocked("\n");
	console_unlock();
	return reason;
}

static const char *run_disk(u32 disk)
{
	struct vblk_dev d;
	memset(&d, 0, sizeof(d));
	d.base = vmmio[disk].base;
	const char *why = vblk_init(&d);
	if (why) {
		kprintf("PROBE-ERROR blk disk=%u base=0x%lx setup %s\n", disk, d.base, why);
		return "device-setup";
	}
	if (params.blk_irq) {
		why = irq_attach(vmmio[disk].irq);
		if (why) {
			kprintf("PROBE-ERROR blk disk=%u irq=%u setup %s\n", disk, vmmio[disk].irq,
				why);
			vblk_reset(&d);
			return "device-setup";
		}
		d.irq = true;
		d.spin_tsc = us_to_tsc(params.blk_spin_us);
	}
	kprintf("PROBE-BLK disk=%u base=0x%lx irq=%u capacity=%lu features=0x%lx ro=%u "
		"seg_max=%u blk_size=%u qsize=%u wait=%s\n",
		disk, d.base, vmmio[disk].irq, d.capacity, d.dev_features, d.ro ? 1 : 0,
		d.seg_max, d.blk_size, d.qsize, d.irq ? "irq" : "poll");

	const char *r;
	const char *op = params.blk_op;
	if (strcmp(op, "getid") == 0) {
		r = do_getid(&d, disk);
	} else if (strcmp(op, "flush") == 0) {
		u64 us = 0;
		r = do_flush(&d, disk, &us);
		kprintf("PROBE-RESULT mode=blk disk=%u op=flush requests=1 errors=%u us=%lu "
			"capacity=%lu\n",
			disk, r ? 1 : 0, us, d.capacity);
	} else {
		r = do_io(&d, disk);
	}
	u32 s = vblk_device_status(&d);
	if (s & 0x40) { /* DEVICE_NEEDS_RESET */
		kprintf("PROBE-ERROR blk disk=%u device-needs-reset status=0x%x\n", disk, s);
		r = r ?: "device-needs-reset";
	}
	vblk_reset(&d);
	irq_detach();
	return r;
}

static const char *blk_report(u32 ncpus)
{
	(void)ncpus;
	if (n_vmmio == 0) {
		kprintf("PROBE-ERROR blk no-disk (no virtio_mmio.device= on the command line)\n");
		return "no-disk";
	}
	u32 first = (u32)params.blk_disk, last = first;
	if (params.blk_all) {
		first = 0;
		last = n_vmmio - 1;
	} else if (first >= n_vmmio) {
		kprintf("PROBE-ERROR blk no-disk disk=%u disks=%u\n", first, n_vmmio);
		return "no-disk";
	}
	const char *reason = NULL;
	for (u32 i = first; i <= last; i++) {
		const char *r = run_disk(i);
		if (r && !reason)
			reason = r;
	}
	return reason;
}

const struct probe_mode mode_blk = {
	.name = "blk",
	.report = blk_report,
};
