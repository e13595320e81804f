//! Building and starting a VM ([`start`]) in named steps, in the manner of
//! Firecracker's `builder.rs`: guest memory and the in-kernel irqchip, the
//! disks' devices, the boot payload (kernel, initrd, command line, boot
//! tables), the legacy devices (serial, i8042, ACPI PM), the disks'
//! transports, the vCPUs, and the threads.

use std::io::Cursor;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Instant;

use corral_devices::acpi_pm::{self, AcpiPm};
use corral_devices::virtio::blk::{Block, BlockOptions, DiskFile, SECTOR_SIZE};
use corral_devices::virtio::mmio::QUEUE_NOTIFY;
use corral_devices::virtio::{MMIO_WINDOW_SIZE, MmioTransport, VirtioDevice};
use corral_devices::{Bus, ConsoleLog, GuestLog, I8042, SerialDevice};
use corral_scheduler::gate::Gate;
use kvm_bindings::{
    KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY, kvm_pit_config, kvm_userspace_memory_region,
};
use kvm_ioctls::{IoEventAddress, Kvm, VcpuFd, VmFd};
use vm_memory::{Address, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::control::Control;
use crate::handle::VmHandle;
use crate::seccomp::{ThreadKind, VmFaults};
use crate::shared::VcpuStats;
use crate::shared::{self, AttachedDisk, Shared};
use crate::util::lock;
use crate::vcpu;
use crate::vm::{
    DiskConfig, ExitReason, KernelSource, OpenFiles, VIRTIO_IRQS, VmConfig, VmError, validate,
};
use crate::{acpi, boot, boottrace, cpuid, layout, loader, mptable};

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |err| VmError::Kvm { what, err }
}

fn io_err(what: &'static str) -> impl FnOnce(std::io::Error) -> VmError {
    move |err| VmError::Io { what, err }
}

/// Creates and starts a VM.
pub fn start(cfg: &VmConfig) -> Result<VmHandle, VmError> {
    let kvm = Kvm::new().map_err(kvm_err("cannot open /dev/kvm"))?;
    start_with_kvm(cfg, &kvm)
}

/// Creates and starts a VM on an already open `/dev/kvm`: a jailed VM
/// process opened it before dropping its privileges
/// ([`crate::jail::Jailed::kvm`]) and cannot open it again.
pub fn start_with_kvm(cfg: &VmConfig, kvm: &Kvm) -> Result<VmHandle, VmError> {
    boottrace::step("start");
    one_malloc_arena();
    let files = validate(cfg, kvm)?;
    shared::install_kick_handler().map_err(io_err("installing the vCPU kick signal handler"))?;
    boottrace::step("validate");

    let vm = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
    boottrace::step("create-vm");
    let mem = attach_memory(&vm, cfg.memory_mib)?;
    boottrace::step("memory");
    create_irqchip(&vm)?;
    boottrace::step("irqchip");
    let vm = Arc::new(vm);

    let disks = build_disks(cfg, &files)?;
    let entry = load_payload(cfg, &files, &mem, &disks)?;
    boottrace::step("payload");

    // Devices: the i8042 and the ACPI PM stop the VM through `Shared`,
    // which exists only once every device is on its bus.
    let shared_slot: Arc<Mutex<Option<Weak<Shared>>>> = Arc::new(Mutex::new(None));
    let console = ConsoleLog::new(cfg.console_log_bytes);
    let legacy = attach_legacy_devices(cfg, &vm, &console, &shared_slot)?;
    let mut mmio = Bus::new();
    let disks = attach_disks(&vm, &mem, disks, &mut mmio)?;
    boottrace::step("devices");

    let (control_tx, control_rx) = std::sync::mpsc::channel();
    let wake = EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?;
    let wake_fd = wake.as_raw_fd();
    let shared = Arc::new(Shared {
        pio: legacy.pio,
        mmio,
        vcpu_stats: (0..cfg.vcpus)
            .map(|_| Arc::new(VcpuStats::default()))
            .collect(),
        stopping: AtomicBool::new(false),
        exit: Mutex::new(None),
        exit_cond: Condvar::new(),
        vcpu_pthreads: Mutex::new(Vec::new()),
        vcpu_kick_tids: Mutex::new(Vec::new()),
        wake,
        pause_gate: Arc::new(Gate::new()),
        sched_gate: cfg.sched_gate.clone(),
        guest_logs: disks.iter().map(|d| lock(&d.block).guest_log()).collect(),
        disks,
        control: Mutex::new(control_tx),
        faults: VmFaults::new(wake_fd),
        device_thread: format!("dev-{}", cfg.name),
        name: cfg.name.clone(),
        serial: legacy.serial.clone(),
        acpi_pm: legacy.acpi_pm,
    });
    *lock(&shared_slot) = Some(Arc::downgrade(&shared));
    for g in shared.gates() {
        let w = Arc::downgrade(&shared);
        g.set_kick(move || {
            if let Some(s) = w.upgrade() {
                s.kick_all();
            }
        });
    }

    let vcpus = create_vcpus(kvm, &vm, cfg.vcpus, entry)?;
    boottrace::step("vcpus");
    let threads = start_threads(cfg, &shared, vcpus, legacy.serial, control_rx)?;
    boottrace::step("threads");

    Ok(VmHandle {
        name: cfg.name.clone(),
        shared,
        threads: Mutex::new(threads.handles),
        console,
        started: Instant::now(),
        vcpu_tids: threads.vcpu_tids,
        device_tid: threads.device_tid,
        vm_fd: Mutex::new(Some(vm)),
        mem,
        released: AtomicBool::new(false),
        files: files.all().cloned().collect(),
    })
}

/// Guest RAM: maps it and gives KVM one memory slot per range.
fn attach_memory(vm: &VmFd, memory_mib: u64) -> Result<GuestMemoryMmap, VmError> {
    let ranges: Vec<(GuestAddress, usize)> = layout::ram_ranges(memory_mib << 20)
        .into_iter()
        .map(|(s, l)| (GuestAddress(s), l as usize))
        .collect();
    let mem =
        GuestMemoryMmap::<()>::from_ranges(&ranges).map_err(|e| VmError::Memory(e.to_string()))?;
    let mut regions = Vec::new();
    for (slot, region) in mem.iter().enumerate() {
        let host = mem
            .get_host_address(region.start_addr())
            .map_err(|e| VmError::Memory(e.to_string()))?;
        regions.push(kvm_userspace_memory_region {
            slot: slot as u32,
            flags: 0,
            guest_phys_addr: region.start_addr().raw_value(),
            memory_size: region.len(),
            userspace_addr: host as u64,
        });
    }
    for r in regions {
        // SAFETY: the region is a live mapping owned by `mem`, which the
        // returned VmHandle keeps alive for as long as the VM fd exists (on
        // error both are dropped, the VM fd first).
        unsafe { vm.set_user_memory_region(r) }.map_err(kvm_err("KVM_SET_USER_MEMORY_REGION"))?;
    }
    Ok(mem)
}

/// The in-kernel irqchip and PIT. They come after the memory slots: once the
/// irqchip exists, every slot change waits for an SRCU grace period
/// (measured 4-8 ms on nested KVM, against 0.05 ms before it).
fn create_irqchip(vm: &VmFd) -> Result<(), VmError> {
    vm.set_tss_address(0xfffb_d000)
        .map_err(kvm_err("KVM_SET_TSS_ADDR"))?;
    vm.create_irq_chip()
        .map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
    vm.create_pit2(kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    })
    .map_err(kvm_err("KVM_CREATE_PIT2"))
}

/// A disk's device, built but not yet on the MMIO bus.
struct BuiltDisk {
    name: String,
    config: DiskConfig,
    base: u64,
    irq: u32,
    block: Arc<Mutex<Block>>,
}

/// The virtio-blk devices, each with its throttle (when it has limits or a
/// group), its 4 KiB MMIO window and its ISA IRQ.
fn build_disks(cfg: &VmConfig, files: &OpenFiles) -> Result<Vec<BuiltDisk>, VmError> {
    let mut built = Vec::new();
    for (i, d) in cfg.disks.iter().enumerate() {
        let name = d.name(i);
        let disk_err = |e: &dyn std::fmt::Display| VmError::Disk {
            name: name.clone(),
            msg: e.to_string(),
        };
        let irq = *VIRTIO_IRQS.get(i).ok_or_else(|| disk_err(&"no IRQ left"))?;
        let base = layout::VIRTIO_MMIO_BASE + i as u64 * MMIO_WINDOW_SIZE;
        let file = files
            .disks
            .get(i)
            .ok_or_else(|| disk_err(&"not open"))?
            .try_clone_file()
            .map_err(|e| disk_err(&e))?;
        let disk = DiskFile::from_file(file, d.read_only, d.direct)
            .map_err(|e| disk_err(&format!("{}: {e}", d.path.display())))?;
        let mut block = Block::new(
            disk,
            BlockOptions {
                serial: d.id.clone().unwrap_or_default(),
                engine: d.engine,
            },
        )
        .map_err(|e| disk_err(&e))?;
        let log = Arc::new(GuestLog::new(name.clone()));
        log.set_vm(&cfg.name);
        block.set_guest_log(log);
        block.set_limits(&d.limits).map_err(|e| disk_err(&e))?;
        if let Some((g, w)) = &d.group {
            block.set_group(Some((g, *w))).map_err(|e| disk_err(&e))?;
        }
        built.push(BuiltDisk {
            name,
            config: d.clone(),
            base,
            irq,
            block: Arc::new(Mutex::new(block)),
        });
    }
    Ok(built)
}

/// The boot payload: kernel and initrd (from the files opened and checked
/// by [`validate`]: nothing can swap them now), the command line with the
/// virtio-mmio announcements, the MP table, the ACPI tables, the boot
/// parameters and page tables. Returns the kernel's entry point.
fn load_payload(
    cfg: &VmConfig,
    files: &OpenFiles,
    mem: &GuestMemoryMmap,
    disks: &[BuiltDisk],
) -> Result<u64, VmError> {
    let loaded = match (&files.kernel, &cfg.kernel) {
        (Some(k), _) => {
            let path = k.path().display().to_string();
            let mut f = k
                .try_clone_file()
                .map_err(|err| loader::LoadError::KernelIo {
                    path: path.clone(),
                    err,
                })?;
            loader::load_kernel(mem, &mut f, &path)?
        }
        (None, KernelSource::Bytes(b)) => {
            loader::load_kernel(mem, &mut Cursor::new(&b[..]), "built-in probe")?
        }
        (None, _) => return Err(VmError::Config("the kernel is not open".into())),
    };
    let initrd = match &files.initrd {
        Some(f) => Some(loader::load_initrd(
            mem,
            f.file(),
            &f.path().display().to_string(),
            loader::initrd_addr_max(&loaded),
            loaded.kernel_end,
        )?),
        None => None,
    };
    // virtio-mmio disks are announced on the command line (for kernels that
    // read it, and the probe) and in the ACPI DSDT.
    let mut cmdline = cfg.cmdline.clone();
    let mut windows = Vec::new();
    for d in disks {
        if !cmdline.is_empty() {
            cmdline.push(' ');
        }
        cmdline.push_str(&MmioTransport::cmdline_arg(d.base, d.irq));
        windows.push(acpi::VirtioMmioWindow {
            base: d.base,
            size: MMIO_WINDOW_SIZE as u32,
            irq: d.irq,
        });
    }
    if cmdline.len() > layout::CMDLINE_MAX {
        return Err(VmError::Config(
            "the kernel command line with the virtio-mmio announcements is too long".into(),
        ));
    }
    loader::write_cmdline(mem, &cmdline)?;
    mptable::write(mem, cfg.vcpus)?;
    let rsdp = if cfg.acpi {
        Some(acpi::write(
            mem,
            &acpi::AcpiParams {
                cpus: cfg.vcpus,
                virtio_mmio: windows,
                serial: true,
            },
        )?)
    } else {
        None
    };
    loader::write_boot_params(
        mem,
        cfg.memory_mib << 20,
        &loaded,
        cmdline.len(),
        initrd,
        rsdp,
    )?;
    boot::write_tables(mem)?;
    Ok(loaded.entry)
}

/// The port-I/O bus with the legacy devices on it.
struct Legacy {
    pio: Bus,
    serial: Arc<Mutex<SerialDevice>>,
    acpi_pm: Option<Arc<Mutex<AcpiPm>>>,
}

/// COM1 (IRQ 4), the i8042 (its reset line stops the VM) and, with ACPI,
/// the PM registers (S5 stops the VM; the power button raises the GED IRQ).
fn attach_legacy_devices(
    cfg: &VmConfig,
    vm: &VmFd,
    console: &Arc<ConsoleLog>,
    shared: &Arc<Mutex<Option<Weak<Shared>>>>,
) -> Result<Legacy, VmError> {
    let bus_err = |e: corral_devices::bus::BusError| VmError::Config(e.to_string());
    let serial_irq = EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?;
    vm.register_irqfd(&serial_irq, 4)
        .map_err(kvm_err("KVM_IRQFD (serial)"))?;
    let out_fd = if cfg.console_stdout {
        dup_stdout()
    } else {
        None
    };
    let serial = Arc::new(Mutex::new(SerialDevice::new(
        serial_irq,
        out_fd,
        console.clone(),
    )));
    let mut pio = Bus::new();
    pio.insert(0x3f8, 8, serial.clone()).map_err(bus_err)?;

    // The guest stopping itself is a clean stop.
    let guest_shutdown = |slot: Arc<Mutex<Option<Weak<Shared>>>>| {
        move || {
            if let Some(s) = lock(&slot).as_ref().and_then(|w| w.upgrade()) {
                s.set_exit(ExitReason::GuestShutdown);
            }
        }
    };
    let i8042 = I8042::new(Box::new(guest_shutdown(shared.clone())));
    pio.insert(0x60, 5, Arc::new(Mutex::new(i8042)))
        .map_err(bus_err)?;
    let mut acpi_pm = None;
    if cfg.acpi {
        // The power button's event device interrupt (see acpi::GED_IRQ).
        let ged_irq = EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?;
        vm.register_irqfd(&ged_irq, acpi::GED_IRQ)
            .map_err(kvm_err("KVM_IRQFD (GED)"))?;
        let pm = AcpiPm::with_events(
            Box::new(guest_shutdown(shared.clone())),
            Box::new(move || {
                let _ = ged_irq.write(1);
            }),
        );
        let pm = Arc::new(Mutex::new(pm));
        pio.insert(
            u64::from(acpi_pm::PORT_BASE),
            u64::from(acpi_pm::PORT_LEN),
            pm.clone(),
        )
        .map_err(bus_err)?;
        acpi_pm = Some(pm);
    }
    Ok(Legacy {
        pio,
        serial,
        acpi_pm,
    })
}

fn dup_stdout() -> Option<OwnedFd> {
    // SAFETY: dup of fd 1 returns a new descriptor we own, or -1.
    let fd = unsafe { libc::dup(libc::STDOUT_FILENO) };
    // SAFETY: `fd` is a fresh descriptor owned by nobody else.
    (fd >= 0).then(|| unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Puts each disk behind a virtio-mmio transport on the MMIO bus, with its
/// interrupt (irqfd) and queue notifications (ioeventfds).
fn attach_disks(
    vm: &VmFd,
    mem: &GuestMemoryMmap,
    disks: Vec<BuiltDisk>,
    mmio: &mut Bus,
) -> Result<Vec<AttachedDisk>, VmError> {
    let mut attached = Vec::new();
    for d in disks {
        let dev_err = |msg: String| VmError::Disk {
            name: d.name.clone(),
            msg,
        };
        let irqfd = EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?;
        vm.register_irqfd(&irqfd, d.irq)
            .map_err(kvm_err("KVM_IRQFD (virtio)"))?;
        let dev: Arc<Mutex<dyn VirtioDevice>> = d.block.clone();
        let transport =
            MmioTransport::new(mem.clone(), dev, irqfd).map_err(|e| dev_err(e.to_string()))?;
        for (q, evt) in transport.queue_events().iter().enumerate() {
            vm.register_ioevent(evt, &IoEventAddress::Mmio(d.base + QUEUE_NOTIFY), q as u32)
                .map_err(kvm_err("KVM_IOEVENTFD"))?;
        }
        mmio.insert(d.base, MMIO_WINDOW_SIZE, Arc::new(Mutex::new(transport)))
            .map_err(|e| dev_err(e.to_string()))?;
        let (capacity_bytes, counters, engine) = {
            let b = lock(&d.block);
            (b.capacity_sectors() * SECTOR_SIZE, b.counters(), b.engine())
        };
        attached.push(AttachedDisk {
            name: d.name,
            config: d.config,
            capacity_bytes,
            engine,
            block: d.block,
            counters,
        });
    }
    Ok(attached)
}

/// glibc gives every thread that allocates its own malloc arena (a 128 MiB
/// reservation, and its first pages touched): a VM's few threads allocate
/// little on their hot paths (each thread keeps its tcache), so one arena
/// for the process is enough, and start-up maps less. Once per process.
fn one_malloc_arena() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: mallopt only sets an allocator parameter; M_ARENA_MAX = 1
        // is valid at any time (arenas already made stay in use).
        unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    });
}

/// The vCPUs, with their CPUID and registers; the boot CPU starts at `entry`.
///
/// `KVM_GET_SUPPORTED_CPUID` takes ~0.3 ms here (the kernel executes CPUID
/// for every leaf, and on nested KVM each one exits to the outer
/// hypervisor). Asking it on a helper thread during steps 2-5 was tried:
/// the irqchip's SRCU grace period then waited for the helper's CPU
/// (KVM_CREATE_IRQCHIP median 0.12 → 5 ms on a loaded host), so it is asked
/// here, inline.
fn create_vcpus(kvm: &Kvm, vm: &VmFd, count: u8, entry: u64) -> Result<Vec<VcpuFd>, VmError> {
    let supported = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("KVM_GET_SUPPORTED_CPUID"))?;
    boottrace::step("supported-cpuid");
    let mut vcpus = Vec::with_capacity(count.into());
    let mut tsc_khz = None;
    for i in 0..count {
        let v = vm
            .create_vcpu(u64::from(i))
            .map_err(kvm_err("KVM_CREATE_VCPU"))?;
        if i == 0 {
            tsc_khz = v.get_tsc_khz().ok().filter(|k| *k > 0);
        }
        let mut c = supported.clone();
        cpuid::fixup(&mut c, i, count, tsc_khz);
        v.set_cpuid2(&c).map_err(kvm_err("KVM_SET_CPUID2"))?;
        boot::setup_common(&v)?;
        if i == 0 {
            boot::setup_boot_cpu(&v, entry)?;
        }
        vcpus.push(v);
    }
    Ok(vcpus)
}

/// The VM's threads, started.
struct Threads {
    handles: Vec<std::thread::JoinHandle<()>>,
    vcpu_tids: Vec<libc::pid_t>,
    device_tid: Option<libc::pid_t>,
}

/// One thread per vCPU, then the device thread (host stdin to the serial
/// port, the disks' queues and timers, control messages). Each runs under
/// its seccomp filter and the VM's `vm` span (see [`crate::vmthread`]).
fn start_threads(
    cfg: &VmConfig,
    shared: &Arc<Shared>,
    vcpus: Vec<VcpuFd>,
    serial: Arc<Mutex<SerialDevice>>,
    control: std::sync::mpsc::Receiver<Control>,
) -> Result<Threads, VmError> {
    let mut handles = Vec::new();
    let mut vcpu_tids = vec![0; vcpus.len()];
    for (i, v) in vcpus.into_iter().enumerate() {
        let (tx, rx) = std::sync::mpsc::channel();
        let t = crate::vmthread::spawn(
            format!("vcpu{i}"),
            ThreadKind::Vcpu,
            i as u16,
            shared.clone(),
            tx,
            move |sh| vcpu::run(v, i as u8, sh),
        );
        match t {
            Ok(t) => {
                lock(&shared.vcpu_pthreads).push(t.as_pthread_t());
                handles.push(t);
                // Each thread sends its tid first thing.
                if let Ok(tid) = rx.recv()
                    && let Some(slot) = vcpu_tids.get_mut(i)
                {
                    *slot = tid;
                    // Before it is listed the thread has not reached its
                    // loop, which checks the gates and `stopping` before
                    // its first KVM_RUN: no kick can be missed.
                    if tid > 0 {
                        lock(&shared.vcpu_kick_tids).push(tid);
                    }
                }
            }
            Err(e) => {
                shared.set_exit(ExitReason::Stopped);
                for t in handles {
                    let _ = t.join();
                }
                return Err(VmError::Io {
                    what: "spawning a vCPU thread",
                    err: e,
                });
            }
        }
    }
    let stdin = cfg.console_stdin;
    let (dtid_tx, dtid_rx) = std::sync::mpsc::channel();
    let dev = crate::vmthread::spawn(
        shared.device_thread.clone(),
        ThreadKind::Device,
        0,
        shared.clone(),
        dtid_tx,
        move |sh| crate::devthread::run(sh, serial, stdin, control),
    )
    .map_err(io_err("spawning the device thread"))?;
    handles.push(dev);
    let device_tid = dtid_rx.recv().ok();
    Ok(Threads {
        handles,
        vcpu_tids,
        device_tid,
    })
}
