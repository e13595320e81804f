/* probe.h - shared declarations for the corral probe guest. */
#ifndef PROBE_H
#define PROBE_H

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long u64;
typedef long i64;
typedef unsigned long size_t;
typedef _Bool bool;
#define true 1
#define false 0
#define NULL ((void *)0)

#define MAX_CPUS 64
#define STACK_SIZE 16384 /* keep in sync with entry.S */

/* Fixed guest-physical addresses from the boot contract. */
#define TRAMP_BASE 0x3000UL /* SIPI vector 0x03 */
#define TRAMP_LIMIT 0x5000UL

/* ---- low-level helpers ---- */
static inline void outb(u16 port, u8 v) { __asm__ volatile("outb %0, %1" ::"a"(v), "Nd"(port)); }
static inline u8 inb(u16 port)
{
	u8 v;
	__asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(port));
	return v;
}
static inline u64 rdtsc(void)
{
	u32 lo, hi;
	__asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
	return ((u64)hi << 32) | lo;
}
static inline void cpuid(u32 leaf, u32 sub, u32 *a, u32 *b, u32 *c, u32 *d)
{
	__asm__ volatile("cpuid" : "=a"(*a), "=b"(*b), "=c"(*c), "=d"(*d) : "a"(leaf), "c"(sub));
}
static inline u64 rdmsr(u32 msr)
{
	u32 lo, hi;
	__asm__ volatile("rdmsr" : "=a"(lo), "=d"(hi) : "c"(msr));
	return ((u64)hi << 32) | lo;
}
static inline void wrmsr(u32 msr, u64 v)
{
	__asm__ volatile("wrmsr" ::"c"(msr), "a"((u32)v), "d"((u32)(v >> 32)) : "memory");
}
static inline void cpu_relax(void) { __asm__ volatile("pause" ::: "memory"); }
static inline u64 read_cr3(void)
{
	u64 v;
	__asm__ volatile("mov %%cr3, %0" : "=r"(v));
	return v;
}
static inline u32 mmio_read32(u64 addr) { return *(volatile u32 *)addr; }
static inline void mmio_write32(u64 addr, u32 v) { *(volatile u32 *)addr = v; }

#define READ_ONCE(x) __atomic_load_n(&(x), __ATOMIC_ACQUIRE)
#define WRITE_ONCE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELEASE)

/* ---- lib.c ---- */
void *memset(void *d, int c, size_t n);
void *memcpy(void *d, const void *s, size_t n);
void *memmove(void *d, const void *s, size_t n);
int memcmp(const void *a, const void *b, size_t n);
size_t strlen(const char *s);
int strcmp(const char *a, const char *b);
bool str_eq_n(const char *a, size_t alen, const char *b); /* a[0..alen) == b */
/* Parse decimal u64 from s[0..n); false on empty/non-digit/overflow. */
bool parse_u64(const char *s, size_t n, u64 *out);
/* Decimal or 0x-hex, with an optional K/M/G (binary) suffix. */
bool parse_size(const char *s, size_t n, u64 *out);

/* ---- serial.c ---- */
typedef struct { volatile u32 v; } spinlock_t;
void spin_lock(spinlock_t *l);
void spin_unlock(spinlock_t *l);
void serial_init(void);
void serial_putc(char c);       /* raw, caller holds console lock */
void console_lock(void);
void console_unlock(void);
void console_force_lock(void);  /* for exception paths: bounded wait, then take */
/* printf subset: %s %c %d %u %x %lu %ld %lx %llu %llx %%, with optional 0-pad width */
void kprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void kprintf_unlocked(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---- time.c ---- */
extern u64 tsc_khz;
void time_init(void);
u64 tsc_to_ms(u64 cycles);
u64 ms_to_tsc(u64 ms);
u64 us_to_tsc(u64 us);
void udelay(u64 us);

/* ---- cmdline.c ---- */
#define CMDLINE_MAX 4096
#define DEFAULT_UNIT_ITERS 450000 /* work unit: ~1 ms on a current x86 core */
struct probe_params {
	char mode[32];
	u64 secs;          /* spin */
	u64 interval_ms;   /* spin */
	u64 units;         /* work */
	u64 unit_iters;    /* work: hash rounds per unit */
	u64 cpus;          /* fallback CPU count, 0 = unset */
	/* blk */
	u64 blk_disk;      /* index among virtio_mmio.device= entries */
	bool blk_all;      /* probe.disks=all */
	char blk_op[16];   /* read|write|verify|flush|getid */
	u64 blk_size;      /* bytes, 0 = whole disk capped at 32 MiB */
	u64 blk_bs;        /* request size */
	u64 blk_qd;        /* requests in flight */
	u64 blk_offset;    /* bytes */
	u64 blk_flush;     /* FLUSH after the writes */
	u64 blk_seed;      /* verify pattern seed */
	u64 blk_timeout_ms;/* no-progress timeout */
	char evil_case[32];/* evil: which fault (probe.case) */
	u64 pwrbtn;        /* spin: power off when the ACPI power button is pressed */
	bool blk_irq;      /* probe.wait=irq (default) | poll */
	u64 blk_spin_us;   /* irq: poll this long before sleeping */
	bool blk_random;   /* probe.pattern=random: offsets drawn from probe.seed */
	u64 blk_span;      /* random: bytes from probe.offset the offsets fall in, 0 = to the end */
};
/* virtio_mmio.device=<size>@<base>:<irq>[:<id>] entries, in command-line order. */
#define MAX_VMMIO 16
struct vmmio_entry {
	u64 base, size;
	u32 irq;
};
extern struct vmmio_entry vmmio[MAX_VMMIO];
extern u32 n_vmmio;
extern struct probe_params params;
extern char cmdline[CMDLINE_MAX];
void cmdline_load(const u8 *boot_params);
void kmain(const u8 *boot_params);
void ap_main(u32 slot);
void exception_handler(u64 *frame);
/* Returns NULL on success, else a short error text. */
const char *cmdline_parse(void);

/* ---- mp.c ---- */
struct mp_info {
	bool found;
	u32 lapic_addr;
	u32 ioapic_addr;        /* first enabled IOAPIC, 0 = none listed */
	u32 ncpus;              /* enabled processor entries */
	u8 apic_ids[MAX_CPUS];  /* enabled processors (first MAX_CPUS) */
};
extern struct mp_info mp;
void mp_scan(void);

/* ---- smp.c ---- */
extern volatile u32 cpus_online;   /* CPUs admitted (BSP included) */
extern u32 cpus_expected;
extern u32 cpu_apic_id[MAX_CPUS];
extern u64 lapic;   /* xAPIC MMIO base, set by apic_init_bsp() */
extern bool x2apic; /* the local APIC is in x2APIC mode */
u32 this_apic_id(void);
/* Reads the APIC base, software-enables the local APIC (idempotent). */
void apic_init_bsp(void);
/* Start the APs and wait (bounded) for them; returns number online. */
u32 smp_boot(u64 wait_ms);
/* Per-run rendezvous: BSP releases APs into the mode's per-CPU function. */
void smp_release(void);
/* BSP: wait until every AP finished the mode work; false on timeout. */
bool smp_wait_done(u64 timeout_ms);

/* ---- trap.c ---- */
void idt_load(void);

/* ---- irq.c ---- */
/* Routes IOAPIC pin `irq` (edge, active high) to this CPU and installs the
 * interrupt's IDT entry. NULL or an error text. */
const char *irq_attach(u32 irq);
void irq_detach(void);      /* masks the pin again */
/* Sleeps (sti; hlt) until an interrupt, or at the latest until TSC value
 * `until`. The caller has checked its condition with interrupts off, after
 * enabling the device's interrupt; an interrupt raised in between is pending
 * and ends the hlt at once, so no wake-up is lost. */
void irq_sleep(u64 until);
extern u64 irq_count, irq_sleeps, irq_timeouts; /* device interrupts taken, hlts, bounds hit */

/* ---- main.c ---- */
extern u64 boot_tsc;
extern u64 usable_kib;
void __attribute__((noreturn)) probe_finish(bool ok, const char *reason);
/* Print "PROBE-ERROR <msg>", then PROBE-DONE status=error reason=<reason>, reset. */
void __attribute__((noreturn)) probe_fail(const char *reason, const char *msg);
void __attribute__((noreturn)) halt_forever(void);

/* RAM check against the e820 map: is [start, start+len) usable RAM? */
bool ram_range_ok(u64 start, u64 len);
extern char __image_end[];

/* ---- virtio_blk.c ---- */
#define VQ_SIZE_MAX 256
#define VBLK_MAX_QD 64
#define VIRTIO_F_VERSION_1 (1UL << 32)
#define VIRTIO_BLK_F_SEG_MAX (1UL << 2)
#define VIRTIO_BLK_F_RO (1UL << 5)
#define VIRTIO_BLK_F_BLK_SIZE (1UL << 6)
#define VIRTIO_BLK_F_FLUSH (1UL << 9)
#define VIRTIO_BLK_T_IN 0
#define VIRTIO_BLK_T_OUT 1
#define VIRTIO_BLK_T_FLUSH 4
#define VIRTIO_BLK_T_GET_ID 8
#define VIRTIO_BLK_S_OK 0
#define VIRTIO_BLK_S_IOERR 1
#define VIRTIO_BLK_S_UNSUPP 2
#define VBLK_TIMEOUT 0x100
#define VBLK_BAD_COMPLETION 0x101
struct vblk_dev {
	u64 base;
	bool irq;                   /* waits sleep until the used-ring interrupt (probe.wait=irq) */
	u64 spin_tsc;               /* irq: poll this many TSC cycles before sleeping */
	u64 dev_features, features; /* offered, accepted */
	u64 capacity;               /* 512-byte sectors */
	u32 seg_max, blk_size;
	u16 qsize;
	bool ro;
};
struct vblk_job {
	u32 type;      /* VIRTIO_BLK_T_IN / _OUT */
	u64 sector;    /* first sector */
	u64 bytes;     /* total, multiple of 512 */
	u32 bs;        /* bytes per request, multiple of 512 */
	u32 qd;        /* 1..VBLK_MAX_QD */
	u64 buf;       /* qd * bs bytes of buffers */
	const u64 *sectors; /* random: the first sector of each request, in order; NULL = sequential */
	bool fill;     /* OUT: write the verify pattern into each buffer */
	bool check;    /* IN: compare each completed buffer with the pattern */
	u64 timeout_ms;/* give up after this long without a completion */
};
struct vblk_stats {
	u64 requests, errors, ioerr, unsupp, bad, bytes, cycles;
	u64 mismatches, first_mismatch; /* first_mismatch: set to ~0 before */
	u32 in_flight; /* left in flight (after a timeout) */
	bool timeout;
};
const char *vblk_init(struct vblk_dev *d);
void vblk_reset(struct vblk_dev *d);
u32 vblk_device_status(const struct vblk_dev *d);
u32 vblk_sync(const struct vblk_dev *d, u32 type, u64 sector, u64 buf, u32 len, bool dev_writes,
	      u64 timeout_ms);
void vblk_pattern_init(u64 seed);
/* Random offsets: n first sectors, each off_sec + k * spr for a k < slots
 * drawn from a splitmix64 stream seeded with seed ^ VBLK_OFFSET_SALT. */
#define VBLK_OFFSET_SALT 0x6f66667365747321UL
void vblk_random_sectors(u64 *out, u64 n, u64 seed, u64 off_sec, u64 slots, u64 spr);
void vblk_run(const struct vblk_dev *d, const struct vblk_job *job, struct vblk_stats *st);
extern u64 vblk_notifies, vblk_notifies_skipped;

/* ---- modes ---- */
struct probe_mode {
	const char *name;
	/* BSP, before APs are released. Return false (after printing) to fail. */
	bool (*prepare)(u32 ncpus);
	/* Every CPU (id 0 = BSP), concurrently; NULL = nothing to do. */
	void (*run_cpu)(u32 id);
	/* Extra guest-ms allowed for the CPUs to finish, beyond the mode's own time. */
	u64 (*timeout_ms)(void);
	/* BSP, after all CPUs finished: print PROBE-RESULT lines. Return NULL for
	 * success or a one-word error reason. */
	const char *(*report)(u32 ncpus);
};
extern const struct probe_mode mode_boot, mode_spin, mode_work, mode_blk, mode_evil, mode_echo;
extern u64 run_start_tsc; /* TSC at release of the mode's work */

#endif
