//! The Linux kernel-compile job of `corral bench overhead` (issue 7).
//!
//! The guest is the Debian cloud kernel and busybox initramfs of
//! `guest-images/linux/build.sh` booting the root disk of
//! `guest-images/kbuild/build.sh`: the initramfs mounts `/dev/vda` and, given
//! `corral.root=/dev/vda`, switch_roots to `init=/usr/local/sbin/corral-kbuild`,
//! which times `make -jN bzImage` of a small configuration of the Debian
//! kernel source and prints one line:
//!
//! ```text
//! KBUILD-RESULT status=ok jobs=2 config=tinyconfig ms=61234
//! KBUILD-RESULT status=fail rc=2 stage=build jobs=2 config=tinyconfig ms=812
//! ```
//!
//! Every run gets a fresh guest: the root disk is attached read-only (the
//! virtio-blk device refuses writes, the guest mounts it read-only) and the
//! build output goes to a tmpfs inside the VM, so no run sees another's
//! output and no copy of the multi-GiB image is needed.
//!
//! This module holds the pure parts: options and their validation, the
//! "can it run here" decision ([`plan`]), the command line and the result
//! parser. Running it is `runner::run_job` with [`super::runner::Guest::Kbuild`].

use std::io::Read as _;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Where the guest's job program lives in the kbuild image.
pub const KBUILD_INIT: &str = "/usr/local/sbin/corral-kbuild";

/// The command line of the Debian cloud kernel under corral (the one
/// `guest-images/linux/build.sh` prints as `CMDLINE=`).
pub const BASE_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 pci=off i8042.noaux i8042.nomux \
     i8042.nopnp i8042.dumbkbd 8250.nr_uarts=1";

/// The command that builds the images (it runs `guest-images/linux/build.sh`
/// too).
pub const BUILD_COMMAND: &str = "sudo guest-images/kbuild/build.sh";

/// Set to `1` to run the job even on kvm_pvm hosts (it will not finish there:
/// the guest never reaches user space; for testing the harness only).
pub const PVM_OVERRIDE_ENV: &str = "CORRAL_BENCH_LINUX_ON_PVM";

/// Most `make` jobs the guest accepts (`kbuild.jobs`).
pub const MAX_JOBS: u32 = 1024;

/// Least guest memory for the job, MiB.
pub const MIN_MEMORY_MIB: u64 = 512;

/// The kernel configuration the guest builds.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KbuildConfig {
    /// `make tinyconfig`: the smallest kernel.
    #[default]
    Tinyconfig,
    /// `make defconfig`: x86_64's default configuration (several times longer).
    Defconfig,
}

impl KbuildConfig {
    /// The make target and the `kbuild.config=` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tinyconfig => "tinyconfig",
            Self::Defconfig => "defconfig",
        }
    }

    /// Default guest memory: the build output lives in a tmpfs in guest RAM.
    pub fn default_memory_mib(self) -> u64 {
        match self {
            Self::Tinyconfig => 2048,
            Self::Defconfig => 4096,
        }
    }
}

/// Options of the Linux kernel-compile job (part of `corral bench overhead`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct LinuxArgs {
    /// Kernel of the Linux job [default: guest-images/linux/cache/out/vmlinuz
    /// in the source tree corral was built from].
    #[arg(long, value_name = "PATH")]
    pub linux_kernel: Option<PathBuf>,
    /// Initramfs of the Linux job [default:
    /// guest-images/linux/cache/out/initramfs.cpio.gz].
    #[arg(long, value_name = "PATH")]
    pub linux_initrd: Option<PathBuf>,
    /// Root disk of the Linux job, attached read-only [default:
    /// guest-images/kbuild/cache/out/rootfs.img].
    #[arg(long, value_name = "PATH")]
    pub linux_rootfs: Option<PathBuf>,
    /// `make -jN` in the guest [default: the VM's vCPUs].
    #[arg(long, value_name = "N")]
    pub linux_jobs: Option<u32>,
    /// vCPUs of the Linux VM [default: the CPUs corral may use].
    #[arg(long, value_name = "N")]
    pub linux_vcpus: Option<u32>,
    /// Memory of the Linux VM in MiB [default: 2048 for tinyconfig, 4096 for
    /// defconfig].
    #[arg(long, value_name = "MiB")]
    pub linux_memory: Option<u64>,
    /// Kernel configuration the guest builds.
    #[arg(long, value_enum, default_value_t = KbuildConfig::Tinyconfig)]
    pub linux_config: KbuildConfig,
    /// Seconds one run of the Linux job may take.
    #[arg(long, value_name = "SECS", default_value_t = 3600)]
    pub linux_timeout: u64,
}

/// Whether the user asked for the Linux job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selection {
    /// `--job linux`: it must run; anything that stops it is an error.
    Required,
    /// `--job all`: it runs when this host and the images allow it.
    IfPossible,
    /// `--job cpu|io|both`.
    NotSelected,
}

/// What [`plan`] needs to know about the host.
#[derive(Debug, Clone)]
pub struct Host {
    /// KVM is kvm_pvm and the override is not set.
    pub pvm: bool,
    /// CPUs corral may use (the default vCPU count).
    pub cpus: u32,
    /// The source tree corral was built from (for the default image paths).
    pub tree: PathBuf,
}

impl Host {
    /// This host.
    pub fn detect() -> Self {
        let override_pvm = std::env::var(PVM_OVERRIDE_ENV).is_ok_and(|v| v == "1");
        Self {
            pvm: super::host::host_is_pvm() && !override_pvm,
            cpus: super::host::host_cpus(),
            tree: source_tree(),
        }
    }
}

/// The source tree this binary was built from.
pub fn source_tree() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The default image paths under a source tree.
pub fn default_paths(tree: &Path) -> [PathBuf; 3] {
    [
        tree.join("guest-images/linux/cache/out/vmlinuz"),
        tree.join("guest-images/linux/cache/out/initramfs.cpio.gz"),
        tree.join("guest-images/kbuild/cache/out/rootfs.img"),
    ]
}

/// A Linux job ready to run: checked files and sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinuxJob {
    /// Kernel (bzImage or ELF vmlinux).
    pub kernel: PathBuf,
    /// Initramfs.
    pub initrd: PathBuf,
    /// Root disk (ext4), attached read-only.
    pub rootfs: PathBuf,
    /// `make -jN`.
    pub jobs: u32,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest memory, MiB.
    pub memory_mib: u64,
    /// Configuration built.
    pub config: KbuildConfig,
    /// Seconds one run may take.
    pub timeout_s: u64,
}

impl LinuxJob {
    /// The kernel command line: the base line, the switch to the root disk
    /// and the job's parameters.
    pub fn cmdline(&self) -> String {
        format!(
            "{BASE_CMDLINE} corral.root=/dev/vda init={KBUILD_INIT} kbuild.jobs={} kbuild.config={}",
            self.jobs,
            self.config.as_str()
        )
    }

    /// One sentence for the report.
    pub fn describe(&self) -> String {
        format!(
            "Linux kernel-compile job: `make -j{} bzImage` ({}) of the kernel source in the root \
             disk, in a VM with {} vCPUs and {} MiB; kernel `{}`, initramfs `{}`, root disk `{}` \
             attached read-only with the build output in a tmpfs in the guest (fresh every run). \
             Its **guest seconds** are make's wall time as the guest measured it; its total \
             seconds run from `create_vm` to the `KBUILD-RESULT` line and include the boot.",
            self.jobs,
            self.config.as_str(),
            self.vcpus,
            self.memory_mib,
            self.kernel.display(),
            self.initrd.display(),
            self.rootfs.display()
        )
    }
}

/// What `overhead` does about the Linux job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Run it.
    Run(LinuxJob),
    /// Leave it out; the reason goes into the report.
    Skip(String),
}

/// A reason the Linux job cannot run, or a bad option.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum LinuxJobError {
    /// An image file given on the command line does not exist or is no file.
    #[error("{option} {}: {problem}", path.display())]
    BadFile {
        /// The option (`--linux-kernel`, ...).
        option: &'static str,
        /// The path given.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A numeric option out of range.
    #[error("{option} {value}: {expected}")]
    OutOfRange {
        /// The option.
        option: &'static str,
        /// The value given.
        value: u64,
        /// The range.
        expected: String,
    },
    /// The job was required (`--job linux`) but cannot run here.
    #[error("{0}")]
    CannotRun(String),
}

impl From<LinuxJobError> for super::BenchError {
    fn from(e: LinuxJobError) -> Self {
        Self(e.to_string())
    }
}

/// Decides whether the Linux job runs, checking the options first.
///
/// Options given explicitly are checked whatever the host: a missing file or
/// a bad number is an error. Then, in this order, the job is left out (or,
/// with [`Selection::Required`], refused) on kvm_pvm hosts, with `--quick`
/// (unless required), and when a default image file is missing.
pub fn plan(
    args: &LinuxArgs,
    selection: Selection,
    host: &Host,
    quick: bool,
) -> Result<Plan, LinuxJobError> {
    if selection == Selection::NotSelected {
        return Ok(Plan::Skip(
            "Linux kernel-compile job not selected (--job cpu, io or both); `--job all` or \
             `--job linux` runs it."
                .into(),
        ));
    }
    let [dk, di, dr] = default_paths(&host.tree);
    let given = [
        ("--linux-kernel", &args.linux_kernel, dk, FileKind::Kernel),
        ("--linux-initrd", &args.linux_initrd, di, FileKind::Any),
        ("--linux-rootfs", &args.linux_rootfs, dr, FileKind::Ext4),
    ];
    for (option, path, _, kind) in &given {
        if let Some(p) = path {
            check_file(p, *kind).map_err(|problem| LinuxJobError::BadFile {
                option,
                path: p.clone(),
                problem,
            })?;
        }
    }
    let vcpus = args.linux_vcpus.unwrap_or(host.cpus.max(1));
    if !(1..=254).contains(&vcpus) {
        return Err(LinuxJobError::OutOfRange {
            option: "--linux-vcpus",
            value: vcpus.into(),
            expected: "want 1 to 254".into(),
        });
    }
    let jobs = args.linux_jobs.unwrap_or(vcpus);
    if !(1..=MAX_JOBS).contains(&jobs) {
        return Err(LinuxJobError::OutOfRange {
            option: "--linux-jobs",
            value: jobs.into(),
            expected: format!("want 1 to {MAX_JOBS}"),
        });
    }
    let memory_mib = args
        .linux_memory
        .unwrap_or(args.linux_config.default_memory_mib());
    if memory_mib < MIN_MEMORY_MIB {
        return Err(LinuxJobError::OutOfRange {
            option: "--linux-memory",
            value: memory_mib,
            expected: format!(
                "want at least {MIN_MEMORY_MIB} MiB (the build output lives in guest RAM)"
            ),
        });
    }
    if args.linux_timeout == 0 {
        return Err(LinuxJobError::OutOfRange {
            option: "--linux-timeout",
            value: 0,
            expected: "want at least 1 second".into(),
        });
    }

    let refuse = |why: String| {
        if selection == Selection::Required {
            Err(LinuxJobError::CannotRun(why))
        } else {
            Ok(Plan::Skip(why))
        }
    };
    if host.pvm {
        return refuse(
            "Linux kernel-compile job not run: this host's KVM is kvm_pvm (/sys/module/kvm_pvm: \
             nested, guest code runs in KVM's instruction emulator at ~1 µs per instruction), \
             where a Linux guest prints its banner after about a minute and never reaches user \
             space. It needs a host with hardware virtualisation (VMX or SVM)."
                .into(),
        );
    }
    if quick && selection == Selection::IfPossible {
        return refuse(
            "Linux kernel-compile job left out by --quick (it takes minutes per run); \
             `--job linux` runs it."
                .into(),
        );
    }
    let mut files = Vec::with_capacity(3);
    for (option, path, default, kind) in given {
        let p = match path {
            Some(p) => p.clone(),
            None => {
                if let Err(problem) = check_file(&default, kind) {
                    return refuse(format!(
                        "Linux kernel-compile job not run: {} ({problem}; the default of \
                         {option}). Build the images with `{BUILD_COMMAND}` (it also runs \
                         guest-images/linux/build.sh), or name the files with --linux-kernel, \
                         --linux-initrd and --linux-rootfs.",
                        default.display()
                    ));
                }
                default
            }
        };
        files.push(p);
    }
    let [kernel, initrd, rootfs]: [PathBuf; 3] = files
        .try_into()
        .map_err(|_| LinuxJobError::CannotRun("internal error: image paths".into()))?;
    Ok(Plan::Run(LinuxJob {
        kernel,
        initrd,
        rootfs,
        jobs,
        vcpus,
        memory_mib,
        config: args.linux_config,
        timeout_s: args.linux_timeout,
    }))
}

/// What a file must be.
#[derive(Debug, Clone, Copy)]
enum FileKind {
    /// A bzImage (`HdrS` at 0x202) or an ELF file.
    Kernel,
    /// An ext4 file system (magic 0xEF53 at byte 1080).
    Ext4,
    /// Any non-empty regular file.
    Any,
}

/// Checks that `p` is a non-empty regular file of `kind`; the problem if not.
fn check_file(p: &Path, kind: FileKind) -> Result<(), String> {
    let meta = std::fs::metadata(p).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".to_string(),
        _ => e.to_string(),
    })?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() == 0 {
        return Err("empty file".into());
    }
    let mut head = Vec::with_capacity(2048);
    std::fs::File::open(p)
        .and_then(|f| f.take(2048).read_to_end(&mut head))
        .map_err(|e| format!("cannot read it: {e}"))?;
    match kind {
        FileKind::Any => Ok(()),
        FileKind::Kernel => {
            if head.starts_with(b"\x7fELF") || head.get(0x202..0x206) == Some(b"HdrS".as_slice()) {
                Ok(())
            } else {
                Err("neither a bzImage nor an ELF kernel".into())
            }
        }
        FileKind::Ext4 => {
            if head.get(1080..1082) == Some([0x53, 0xef].as_slice()) {
                Ok(())
            } else {
                Err("not an ext4 image (guest-images/kbuild/build.sh builds one)".into())
            }
        }
    }
}

/// How the guest's build ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KbuildStatus {
    /// `status=ok`.
    Ok,
    /// `status=fail rc=R [stage=S]`.
    Fail {
        /// make's (or the setup's) exit status.
        rc: i32,
        /// `params`, `setup`, `config` or `build`, when given.
        stage: Option<String>,
    },
}

/// A parsed `KBUILD-RESULT` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KbuildResult {
    /// How it ended.
    pub status: KbuildStatus,
    /// `jobs=`.
    pub jobs: Option<u32>,
    /// `config=`.
    pub config: Option<String>,
    /// `ms=`: wall time of `make bzImage` in the guest.
    pub ms: Option<u64>,
    /// `dry=1`: only `make -n` ran (a test of the path, not a build).
    pub dry: bool,
}

/// Why a console line is not a usable `KBUILD-RESULT`.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ResultParseError {
    /// No `KBUILD-RESULT` in the line.
    #[error("not a KBUILD-RESULT line")]
    NotResult,
    /// No `status=`.
    #[error("KBUILD-RESULT without status=")]
    NoStatus,
    /// A status other than ok and fail.
    #[error("KBUILD-RESULT with unknown status={0:?}")]
    BadStatus(String),
    /// A field that must be a number is not.
    #[error("KBUILD-RESULT {key}={value:?} is not a number")]
    BadNumber {
        /// The field.
        key: &'static str,
        /// Its text.
        value: String,
    },
    /// A field that the status requires is missing.
    #[error("KBUILD-RESULT status={status} without {key}=")]
    Missing {
        /// The status.
        status: &'static str,
        /// The missing field.
        key: &'static str,
    },
}

/// The marker the guest prints.
pub const RESULT_MARKER: &str = "KBUILD-RESULT";

/// Parses a `KBUILD-RESULT` line. Text before the marker (a kernel message
/// that interrupted the line) is ignored; so are unknown fields.
pub fn parse_result(line: &str) -> Result<KbuildResult, ResultParseError> {
    let at = line
        .find(RESULT_MARKER)
        .ok_or(ResultParseError::NotResult)?;
    let rest = &line[at + RESULT_MARKER.len()..];
    if !rest.is_empty() && !rest.starts_with(char::is_whitespace) {
        return Err(ResultParseError::NotResult);
    }
    let field = |key: &str| {
        rest.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
    };
    fn num<T: std::str::FromStr>(
        key: &'static str,
        v: Option<&str>,
    ) -> Result<Option<T>, ResultParseError> {
        v.map(|s| {
            s.parse().map_err(|_| ResultParseError::BadNumber {
                key,
                value: s.to_string(),
            })
        })
        .transpose()
    }
    let jobs = num::<u32>("jobs", field("jobs"))?;
    let ms = num::<u64>("ms", field("ms"))?;
    let config = field("config").map(str::to_string);
    let dry = field("dry") == Some("1");
    let status = match field("status") {
        None => return Err(ResultParseError::NoStatus),
        Some("ok") => {
            for (key, present) in [
                ("jobs", jobs.is_some()),
                ("config", config.is_some()),
                ("ms", ms.is_some()),
            ] {
                if !present {
                    return Err(ResultParseError::Missing { status: "ok", key });
                }
            }
            KbuildStatus::Ok
        }
        Some("fail") => {
            let rc = num::<i32>("rc", field("rc"))?.ok_or(ResultParseError::Missing {
                status: "fail",
                key: "rc",
            })?;
            KbuildStatus::Fail {
                rc,
                stage: field("stage").map(str::to_string),
            }
        }
        Some(other) => return Err(ResultParseError::BadStatus(other.to_string())),
    };
    Ok(KbuildResult {
        status,
        jobs,
        config,
        ms,
        dry,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_an_ok_line() {
        let r = parse_result("KBUILD-RESULT status=ok jobs=2 config=tinyconfig ms=61234").unwrap();
        assert_eq!(r.status, KbuildStatus::Ok);
        assert_eq!(r.jobs, Some(2));
        assert_eq!(r.config.as_deref(), Some("tinyconfig"));
        assert_eq!(r.ms, Some(61234));
        assert!(!r.dry);
        // A kernel message before the marker, a dry run, an unknown field.
        let r = parse_result(
            "[   12.345678] random: crng init done KBUILD-RESULT status=ok jobs=4 config=defconfig ms=7 dry=1 extra=x",
        )
        .unwrap();
        assert_eq!((r.jobs, r.ms, r.dry), (Some(4), Some(7), true));
    }

    #[test]
    fn parses_a_fail_line() {
        let r = parse_result(
            "KBUILD-RESULT status=fail rc=2 stage=build jobs=2 config=tinyconfig ms=812",
        )
        .unwrap();
        assert_eq!(
            r.status,
            KbuildStatus::Fail {
                rc: 2,
                stage: Some("build".into())
            }
        );
        assert_eq!(r.ms, Some(812));
        let r = parse_result("KBUILD-RESULT status=fail rc=2 stage=params").unwrap();
        assert_eq!(
            r.status,
            KbuildStatus::Fail {
                rc: 2,
                stage: Some("params".into())
            }
        );
        assert_eq!((r.jobs, r.config, r.ms), (None, None, None));
    }

    #[test]
    fn rejects_garbage() {
        use ResultParseError as E;
        assert_eq!(parse_result(""), Err(E::NotResult));
        assert_eq!(parse_result("PROBE-RESULT us=1"), Err(E::NotResult));
        assert_eq!(parse_result("KBUILD-RESULTS status=ok"), Err(E::NotResult));
        assert_eq!(parse_result("KBUILD-RESULT"), Err(E::NoStatus));
        assert_eq!(
            parse_result("KBUILD-RESULT status=maybe"),
            Err(E::BadStatus("maybe".into()))
        );
        assert_eq!(
            parse_result("KBUILD-RESULT status=ok jobs=2 config=tinyconfig ms=12x"),
            Err(E::BadNumber {
                key: "ms",
                value: "12x".into()
            })
        );
        assert_eq!(
            parse_result("KBUILD-RESULT status=ok jobs=2 ms=5"),
            Err(E::Missing {
                status: "ok",
                key: "config"
            })
        );
        assert_eq!(
            parse_result("KBUILD-RESULT status=fail stage=build"),
            Err(E::Missing {
                status: "fail",
                key: "rc"
            })
        );
        assert_eq!(
            parse_result("KBUILD-RESULT status=ok jobs=-1 config=tinyconfig ms=5"),
            Err(E::BadNumber {
                key: "jobs",
                value: "-1".into()
            })
        );
        // Non-ASCII noise does not panic.
        assert!(parse_result("\u{fffd}\u{fffd}KBUILD-RESULT status=\u{fffd}").is_err());
    }

    /// A temporary source tree with (some of) the default image files.
    struct Tree(PathBuf);

    impl Tree {
        fn new(tag: &str) -> Self {
            let d = std::env::temp_dir()
                .join(format!("corral-linux-plan-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            Self(d)
        }

        fn host(&self, pvm: bool) -> Host {
            Host {
                pvm,
                cpus: 2,
                tree: self.0.clone(),
            }
        }

        /// Writes the three default images (valid headers).
        fn images(&self) -> [PathBuf; 3] {
            let paths = default_paths(&self.0);
            let mut kernel = vec![0u8; 4096];
            kernel[0x202..0x206].copy_from_slice(b"HdrS");
            let mut ext4 = vec![0u8; 4096];
            ext4[1080] = 0x53;
            ext4[1081] = 0xef;
            for (p, data) in paths.iter().zip([kernel, vec![1u8; 64], ext4]) {
                std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                std::fs::write(p, data).unwrap();
            }
            paths
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn runs_with_the_default_images_on_a_capable_host() {
        let t = Tree::new("run");
        let [k, i, r] = t.images();
        let p = plan(
            &LinuxArgs {
                linux_timeout: 60,
                ..Default::default()
            },
            Selection::IfPossible,
            &t.host(false),
            false,
        )
        .unwrap();
        let Plan::Run(job) = p else { panic!("{p:?}") };
        assert_eq!((&job.kernel, &job.initrd, &job.rootfs), (&k, &i, &r));
        assert_eq!((job.vcpus, job.jobs, job.memory_mib), (2, 2, 2048));
        assert!(
            job.cmdline()
                .ends_with("corral.root=/dev/vda init=/usr/local/sbin/corral-kbuild kbuild.jobs=2 kbuild.config=tinyconfig")
        );
    }

    #[test]
    fn cannot_run_here_decisions() {
        let t = Tree::new("decide");
        let args = LinuxArgs {
            linux_timeout: 60,
            ..Default::default()
        };
        // Not selected: skipped whatever the host.
        let p = plan(&args, Selection::NotSelected, &t.host(true), false).unwrap();
        assert!(
            matches!(&p, Plan::Skip(s) if s.contains("not selected")),
            "{p:?}"
        );
        // kvm_pvm: skipped with the reason, or an error when required.
        let p = plan(&args, Selection::IfPossible, &t.host(true), false).unwrap();
        assert!(
            matches!(&p, Plan::Skip(s) if s.starts_with("Linux kernel-compile job not run") && s.contains("kvm_pvm")),
            "{p:?}"
        );
        let e = plan(&args, Selection::Required, &t.host(true), false).unwrap_err();
        assert!(
            matches!(&e, LinuxJobError::CannotRun(s) if s.contains("kvm_pvm")),
            "{e}"
        );
        // Images missing: the report names the file and the build command.
        let p = plan(&args, Selection::IfPossible, &t.host(false), false).unwrap();
        let Plan::Skip(s) = &p else { panic!("{p:?}") };
        assert!(s.contains("guest-images/linux/cache/out/vmlinuz"), "{s}");
        assert!(s.contains("no such file"), "{s}");
        assert!(s.contains(BUILD_COMMAND), "{s}");
        let e = plan(&args, Selection::Required, &t.host(false), false).unwrap_err();
        assert!(e.to_string().contains(BUILD_COMMAND), "{e}");
        // Only the root disk missing.
        let [_, _, r] = t.images();
        std::fs::remove_file(&r).unwrap();
        let p = plan(&args, Selection::IfPossible, &t.host(false), false).unwrap();
        assert!(
            matches!(&p, Plan::Skip(s) if s.contains("kbuild/cache/out/rootfs.img")),
            "{p:?}"
        );
        // --quick leaves it out unless required.
        t.images();
        let p = plan(&args, Selection::IfPossible, &t.host(false), true).unwrap();
        assert!(
            matches!(&p, Plan::Skip(s) if s.contains("--quick")),
            "{p:?}"
        );
        let p = plan(&args, Selection::Required, &t.host(false), true).unwrap();
        assert!(matches!(p, Plan::Run(_)), "{p:?}");
    }

    #[test]
    fn option_validation() {
        let t = Tree::new("opts");
        let [k, _, r] = t.images();
        let missing = t.0.join("nope.img");
        let args = |f: &dyn Fn(&mut LinuxArgs)| {
            let mut a = LinuxArgs {
                linux_timeout: 60,
                ..Default::default()
            };
            f(&mut a);
            a
        };
        // A missing explicit file is an error even where the job would be
        // skipped anyway (kvm_pvm), and names the option and the path.
        for host in [t.host(false), t.host(true)] {
            let e = plan(
                &args(&|a| a.linux_rootfs = Some(missing.clone())),
                Selection::IfPossible,
                &host,
                false,
            )
            .unwrap_err();
            assert_eq!(
                e,
                LinuxJobError::BadFile {
                    option: "--linux-rootfs",
                    path: missing.clone(),
                    problem: "no such file".into()
                }
            );
            assert!(e.to_string().starts_with("--linux-rootfs /"), "{e}");
        }
        // Wrong kinds of file.
        let refused = |f: &dyn Fn(&mut LinuxArgs)| {
            plan(&args(f), Selection::IfPossible, &t.host(false), false)
                .unwrap_err()
                .to_string()
        };
        let e = refused(&|a| a.linux_kernel = Some(r.clone()));
        assert!(e.contains("neither a bzImage"), "{e}");
        let e = refused(&|a| a.linux_rootfs = Some(k.clone()));
        assert!(e.contains("not an ext4 image"), "{e}");
        let e = refused(&|a| a.linux_initrd = Some(t.0.clone()));
        assert!(e.contains("not a regular file"), "{e}");
        // Numbers.
        for (f, opt) in [
            (
                &(|a: &mut LinuxArgs| a.linux_jobs = Some(0)) as &dyn Fn(&mut LinuxArgs),
                "--linux-jobs",
            ),
            (
                &|a: &mut LinuxArgs| a.linux_jobs = Some(5000),
                "--linux-jobs",
            ),
            (
                &|a: &mut LinuxArgs| a.linux_vcpus = Some(0),
                "--linux-vcpus",
            ),
            (
                &|a: &mut LinuxArgs| a.linux_memory = Some(64),
                "--linux-memory",
            ),
            (&|a: &mut LinuxArgs| a.linux_timeout = 0, "--linux-timeout"),
        ] {
            let e = plan(&args(f), Selection::IfPossible, &t.host(false), false).unwrap_err();
            assert!(
                matches!(&e, LinuxJobError::OutOfRange { option, .. } if *option == opt),
                "{e}"
            );
        }
        // Explicit values are used.
        let p = plan(
            &args(&|a| {
                a.linux_jobs = Some(3);
                a.linux_vcpus = Some(1);
                a.linux_config = KbuildConfig::Defconfig;
            }),
            Selection::Required,
            &t.host(false),
            false,
        )
        .unwrap();
        let Plan::Run(job) = p else { panic!("{p:?}") };
        assert_eq!((job.jobs, job.vcpus, job.memory_mib), (3, 1, 4096));
        assert!(
            job.cmdline()
                .ends_with("kbuild.jobs=3 kbuild.config=defconfig")
        );
    }
}
