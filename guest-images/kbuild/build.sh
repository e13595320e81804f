#!/usr/bin/env bash
# guest-images/kbuild/build.sh: build the root disk of corral's Linux
# kernel-compile guest job (`corral bench overhead`, issue 7).
#
# A Debian root (debootstrap, variant minbase) with build-essential, the kernel
# build dependencies and the Debian 6.1 kernel source already unpacked in
# /usr/src/linux, packed into an ext4 raw image. Its init program
# /usr/local/sbin/corral-kbuild times `make -jN bzImage` into a tmpfs and prints
# one KBUILD-RESULT line. It boots with the kernel and initramfs of
# guest-images/linux/build.sh (run from here too): that /init mounts /dev/vda
# and, given corral.root=/dev/vda, switch_roots to the init= program.
#
# Outputs (in $OUT, default guest-images/kbuild/cache/out/):
#   rootfs.img     raw ext4 image (sparse; root tree + free space HEADROOM_MB)
#   packages.txt   the Debian packages in it (dpkg-query), for the record
#
# The last lines printed on success are KEY=VALUE pairs (ROOTFS_DISK=, CMDLINE=,
# KERNEL=, INITRD=, ...) for scripts; split each at the first '='. A rerun with
# everything built prints them in milliseconds, without network access.
#
# Usage: build.sh [--clean | --force | --update | --check [kbuild.OPT=V ...] | --help]
#   --clean   delete the cache (debootstrap's .debs, the source .deb, outputs) and exit
#   --force   rebuild the image (reuses the cached .debs)
#   --update  re-resolve the kernel source version with apt
#   --check   build first if needed, then run the guest job WITHOUT a VM: mount
#             rootfs.img read-only (loop), a tmpfs on /tmp, and run
#             /usr/local/sbin/corral-kbuild in a chroot with the given kbuild.*
#             options (default: kbuild.config=tinyconfig, jobs = host CPUs).
#             Its output goes to stderr; exit status: the job's. Needs root
#             and loop devices.
#
# Environment (all optional):
#   SUITE           Debian suite (default bookworm)
#   MIRROR          Debian mirror for debootstrap (default http://deb.debian.org/debian)
#   SOURCE_PKG      kernel source package (default linux-source-6.1)
#   SOURCE_VERSION  its Debian version (default: apt candidate, locked in cache/packages.lock)
#   SOURCE_DEB      a local linux-source .deb to use instead of apt (offline)
#   EXTRA_PACKAGES  more packages for the image (space-separated)
#   HEADROOM_MB     free space left in the image (default 2048; the file is sparse).
#                   The job builds into a tmpfs; this is for kbuild.out=disk.
#   LINUX_BUILD=0|1 also run ../linux/build.sh and print its KERNEL=/INITRD= (default 1)
#   CACHE_DIR       cache directory (default <script dir>/cache)
#   OUT             output directory (default $CACHE_DIR/out)
set -euo pipefail

PROG=${0##*/}
die() { printf '%s: error: %s\n' "$PROG" "$*" >&2; exit 1; }
log() { printf '%s: %s\n' "$PROG" "$*" >&2; }

SELF=$(readlink -f -- "${BASH_SOURCE[0]}")
HERE=$(dirname -- "$SELF")
export PATH="$PATH:/usr/sbin:/sbin"
export LC_ALL=C

CACHE=${CACHE_DIR:-$HERE/cache}
OUT=${OUT:-$CACHE/out}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SOURCE_PKG=${SOURCE_PKG:-linux-source-6.1}
REQ_SOURCE_VERSION=${SOURCE_VERSION:-}
REQ_SOURCE_DEB=${SOURCE_DEB:-}
HEADROOM_MB=${HEADROOM_MB:-2048}
LINUX_BUILD=${LINUX_BUILD:-1}
PACKAGES="build-essential bc bison flex libelf-dev libssl-dev cpio kmod xz-utils ${EXTRA_PACKAGES:-}"
read -r -a _pkgs <<< "$PACKAGES"; PACKAGES="${_pkgs[*]}"   # normalise whitespace (cache key)
INIT_PATH=/usr/local/sbin/corral-kbuild
SRC_DIR=/usr/src/linux
LOCKFILE=$CACHE/packages.lock
STAMP=$OUT/.corral-build-stamp
DEBS=$CACHE/debs
DEBOOTSTRAP_CACHE=$CACHE/debootstrap-debs
IMG=$OUT/rootfs.img
# The command line the job boots with (the one guest-images/linux prints, plus
# the switch to the root disk and its init).
BASE_CMDLINE="console=ttyS0 reboot=k panic=-1 pci=off i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd 8250.nr_uarts=1"
CMDLINE="$BASE_CMDLINE corral.root=/dev/vda init=$INIT_PATH"

case "$HEADROOM_MB" in ''|*[!0-9]*) die "HEADROOM_MB must be a number of MiB, not '$HEADROOM_MB'" ;; esac
case "$LINUX_BUILD" in 0|1) ;; *) die "LINUX_BUILD must be 0 or 1, not '$LINUX_BUILD'" ;; esac
case "$SUITE" in ''|*[!a-z0-9-]*) die "SUITE '$SUITE' does not look like a Debian suite name" ;; esac

# Unmounts everything mounted at or below $1, deepest first (debootstrap and
# --check mount proc, sys, dev and the image there; a plain rm -rf could
# otherwise reach into a bind-mounted host /dev).
unmount_under() {
    local dir mp
    dir=$(readlink -f -- "$1" 2>/dev/null) || return 0
    [ -n "$dir" ] && [ "$dir" != / ] || return 0
    while IFS= read -r mp; do
        umount -- "$mp" 2>/dev/null || umount -l -- "$mp" 2>/dev/null \
            || log "warning: cannot unmount $mp"
    done < <(awk -v d="$dir" '{ gsub(/\\040/, " ", $2) } $2 == d || index($2, d "/") == 1 { print $2 }' \
                 /proc/self/mounts | sort -r)
}

FORCE=0 UPDATE=0 CHECK=0
CHECK_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --clean)
            unmount_under "$CACHE"
            rm -rf --one-file-system -- "$CACHE"
            if [ -d "$OUT" ]; then
                rm -f -- "$STAMP" "$IMG" "$OUT/packages.txt"
                rm -rf --one-file-system -- "$OUT"/.staging.*
                rmdir -- "$OUT" 2>/dev/null || true
            fi
            log "cache removed: $CACHE"
            exit 0 ;;
        --force) FORCE=1 ;;
        --update) UPDATE=1 ;;
        --check)
            CHECK=1; shift
            for a in "$@"; do
                case "$a" in kbuild.*) ;; *) die "--check takes kbuild.NAME=VALUE options only, not '$a'" ;; esac
            done
            CHECK_ARGS=("$@")
            break ;;
        -h|--help) sed -n '2,/^set -euo/p' "$SELF" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
    shift
done

# ---------------------------------------------------------------------------
# Cache key and fast path
# ---------------------------------------------------------------------------
# packages.lock records the request and the kernel source version it resolved
# to, so a rerun needs neither apt nor the network. The stamp in $OUT holds the
# key of the image: script hash (the init program is in it) + suite, mirror,
# package list, source version, headroom. The toolchain packages are whatever
# the suite has when debootstrap runs; packages.txt lists them.

REQUEST="src=$SOURCE_PKG ver=$REQ_SOURCE_VERSION deb=$REQ_SOURCE_DEB"

read_lock() {            # sets L_REQUEST L_SPKG L_SVER; fails if absent
    L_REQUEST='' L_SPKG='' L_SVER=''
    [ -f "$LOCKFILE" ] || return 1
    local k v
    while IFS='=' read -r k v; do
        case "$k" in
            REQUEST) L_REQUEST=$v ;;
            SOURCE_PKG) L_SPKG=$v ;;
            SOURCE_VERSION) L_SVER=$v ;;
        esac
    done < "$LOCKFILE"
    [ -n "$L_SPKG" ] && [ -n "$L_SVER" ]
}

SCRIPT_HASH=$(sha256sum -- "$SELF") SCRIPT_HASH=${SCRIPT_HASH%% *}
compute_key() {
    KEY="script=$SCRIPT_HASH suite=$SUITE mirror=$MIRROR packages=$PACKAGES source=$L_SPKG=$L_SVER headroom=$HEADROOM_MB"
}

LINUX_LINES=''
linux_outputs() {        # runs ../linux/build.sh (fast when cached) for KERNEL= and INITRD=
    [ "$LINUX_BUILD" = 1 ] || return 0
    local script=$HERE/../linux/build.sh out
    [ -f "$script" ] || die "$script not found (set LINUX_BUILD=0 to skip it)"
    out=$(bash "$script") || die "$script failed"
    LINUX_LINES=$(printf '%s\n' "$out" | grep -E '^(KERNEL|INITRD)=') \
        || die "$script printed no KERNEL=/INITRD= lines"
}

print_outputs() {
    echo "SOURCE_PACKAGE=$L_SPKG=$L_SVER"
    echo "INIT=$INIT_PATH"
    echo "CMDLINE=$CMDLINE"
    echo "ROOTFS_DISK=$IMG"
    if [ -n "$LINUX_LINES" ]; then printf '%s\n' "$LINUX_LINES"; fi
}

outputs_fresh() {
    [ "$FORCE" = 0 ] && [ "$UPDATE" = 0 ] || return 1
    read_lock && [ "$L_REQUEST" = "$REQUEST" ] || return 1
    compute_key
    [ -f "$STAMP" ] && [ -f "$IMG" ] || return 1
    local s
    s=$(<"$STAMP")
    [ "$s" = "$KEY" ]
}

# --check: the guest job in a chroot on the read-only image (no VM).
run_check() {
    [ "$(id -u)" = 0 ] || die "--check needs root (loop mount, chroot)"
    command -v chroot >/dev/null || die "chroot not found"
    local mnt=$CACHE/check-mnt rc=0 args
    args="${CHECK_ARGS[*]:-}"
    mkdir -p -- "$mnt"
    unmount_under "$mnt"
    trap 'unmount_under "$mnt"' EXIT
    mount -o loop,ro -t ext4 -- "$IMG" "$mnt" || die "cannot loop-mount $IMG read-only (no loop devices?)"
    mount -t proc proc "$mnt/proc"
    mount --bind /dev "$mnt/dev"
    mount -t tmpfs -o mode=1777 tmpfs "$mnt/tmp"
    log "check: chroot $mnt $INIT_PATH with: ${args:-(defaults)} (image read-only, output in a tmpfs)"
    chroot "$mnt" /usr/bin/env -i KBUILD_CMDLINE="$args" "$INIT_PATH" >&2 || rc=$?
    log "check: $(du -sh "$mnt/tmp" 2>/dev/null | cut -f1) in the tmpfs (build output and log)"
    unmount_under "$mnt"
    trap - EXIT
    rmdir -- "$mnt" 2>/dev/null || true
    log "check: exit status $rc"
    return "$rc"
}

if outputs_fresh; then
    linux_outputs
    print_outputs
    if [ "$CHECK" = 1 ]; then run_check; fi
    exit 0
fi

# ---------------------------------------------------------------------------
# Slow path: serialize concurrent builders, then resolve, download, build.
# ---------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || die "building the image needs root (debootstrap); run as root"
for tool in debootstrap dpkg-deb mkfs.ext4 e2fsck tar xz sha256sum find du mktemp awk; do
    command -v "$tool" >/dev/null || die "'$tool' is required but not installed (apt-get install debootstrap e2fsprogs xz-utils)"
done
arch=$(dpkg --print-architecture 2>/dev/null || uname -m)
case "$arch" in amd64|x86_64) ;; *) die "this builds an amd64 root and runs its programs at build time; host architecture '$arch' is not supported" ;; esac

mkdir -p -- "$CACHE" "$DEBS" "$DEBOOTSTRAP_CACHE" "$OUT"
if command -v flock >/dev/null; then
    exec 9>"$CACHE/.lock"
    flock 9
    if outputs_fresh; then
        linux_outputs; print_outputs
        if [ "$CHECK" = 1 ]; then run_check; fi
        exit 0
    fi
fi

TMP=$(mktemp -d "$CACHE/tmp.XXXXXX")
STAGE=
cleanup() {
    unmount_under "$TMP"
    rm -rf --one-file-system -- "$TMP"
    if [ -n "$STAGE" ]; then rm -rf --one-file-system -- "$STAGE"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

# --- resolve the kernel source version ----------------------------------------
deb_field() { dpkg-deb -f "$1" "$2" 2>/dev/null || die "cannot read '$2' from '$1' (not a .deb?)"; }
deb_path() { printf '%s/%s_%s_all.deb\n' "$DEBS" "$1" "${2//:/%3a}"; }

resolve() {
    local spkg sver dst
    if [ -n "$REQ_SOURCE_DEB" ]; then
        [ -f "$REQ_SOURCE_DEB" ] || die "no such file: $REQ_SOURCE_DEB"
        spkg=$(deb_field "$REQ_SOURCE_DEB" Package) sver=$(deb_field "$REQ_SOURCE_DEB" Version)
        case "$spkg" in linux-source-*) ;; *) die "SOURCE_DEB must be a linux-source-* package, got '$spkg'" ;; esac
        dst=$(deb_path "$spkg" "$sver")
        if [ ! -f "$dst" ]; then cp -- "$REQ_SOURCE_DEB" "$TMP/import.deb" && mv -f -- "$TMP/import.deb" "$dst"; fi
    else
        spkg=$SOURCE_PKG
        if [ -n "$REQ_SOURCE_VERSION" ]; then
            sver=$REQ_SOURCE_VERSION
        else
            sver=$(apt-cache policy "$spkg" 2>/dev/null | awk '/^ *Candidate:/ {print $2; exit}')
            if [ -z "$sver" ] || [ "$sver" = "(none)" ]; then
                die "package '$spkg' is unknown to apt (try 'apt-get update', or set SOURCE_DEB=/path/to/linux-source.deb)"
            fi
        fi
    fi
    printf 'REQUEST=%s\nSOURCE_PKG=%s\nSOURCE_VERSION=%s\n' "$REQUEST" "$spkg" "$sver" > "$TMP/lock"
    mv -f -- "$TMP/lock" "$LOCKFILE"
    read_lock || die "internal error: cannot read back $LOCKFILE"
    log "resolved: $L_SPKG=$L_SVER"
}

if [ "$UPDATE" = 1 ] || ! read_lock || [ "$L_REQUEST" != "$REQUEST" ]; then
    resolve
fi
compute_key

# --- download the kernel source -------------------------------------------------
SDEB=$(deb_path "$L_SPKG" "$L_SVER")
if [ ! -f "$SDEB" ]; then
    command -v apt-get >/dev/null || die "apt-get not found and $SDEB is not cached"
    log "downloading $L_SPKG=$L_SVER"
    d=$(mktemp -d "$TMP/dl.XXXXXX")
    sandbox=(-o APT::Sandbox::User=root)
    (cd "$d" && apt-get download -q "${sandbox[@]}" "$L_SPKG=$L_SVER") >&2 \
        || die "apt-get download $L_SPKG=$L_SVER failed (no such version? try --update, 'apt-get update', or unset SOURCE_VERSION)"
    f=$(find "$d" -maxdepth 1 -name '*.deb' | head -n1)
    [ -n "$f" ] || die "apt-get download $L_SPKG=$L_SVER produced no .deb"
    if [ "$(deb_field "$f" Package)" != "$L_SPKG" ] || [ "$(deb_field "$f" Version)" != "$L_SVER" ]; then
        die "downloaded $f is not $L_SPKG=$L_SVER"
    fi
    mv -f -- "$f" "$SDEB"
fi
SRC_TARBALL=./usr/src/$L_SPKG.tar.xz
dpkg-deb -c "$SDEB" | awk '{print $6}' | grep -qxF "$SRC_TARBALL" \
    || die "$SDEB has no $SRC_TARBALL (not a linux-source package?)"

# --- debootstrap ----------------------------------------------------------------
ROOT=$TMP/root
t0=$(date +%s)
log "debootstrap --variant=minbase $SUITE from $MIRROR with: $PACKAGES"
debootstrap --variant=minbase --include="${PACKAGES// /,}" \
    --cache-dir="$(readlink -f -- "$DEBOOTSTRAP_CACHE")" \
    "$SUITE" "$ROOT" "$MIRROR" > "$TMP/debootstrap.log" 2>&1 \
    || { tail -n 30 "$TMP/debootstrap.log" >&2; die "debootstrap failed (log above; network, mirror or package names?)"; }
unmount_under "$ROOT"     # debootstrap unmounts on exit; make sure
log "debootstrap took $(( $(date +%s) - t0 )) s"
for tool in gcc make bc bison flex cpio depmod xz perl; do
    chroot "$ROOT" /bin/sh -c "command -v $tool" >/dev/null 2>&1 \
        || die "the image has no '$tool' after debootstrap"
done
chroot "$ROOT" dpkg-query -W -f '${Package}=${Version}\n' | sort > "$TMP/packages.txt"

# Trim: no package manager state or docs are needed to compile a kernel; no host
# configuration is kept.
rm -rf --one-file-system -- "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/cache/apt/*.bin \
    "$ROOT"/var/lib/apt/lists/* "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* \
    "$ROOT"/usr/share/info/* "$ROOT"/var/log/*.log
rm -f -- "$ROOT/etc/resolv.conf"
echo corral-kbuild > "$ROOT/etc/hostname"
printf '%s\n' "$L_SPKG=$L_SVER" > "$ROOT/etc/corral-kbuild-source"

# --- the kernel source, unpacked ---------------------------------------------------
t0=$(date +%s)
log "unpacking $SRC_TARBALL into $SRC_DIR"
dpkg-deb --fsys-tarfile "$SDEB" | tar -xO -f - "$SRC_TARBALL" \
    | tar -xJ --no-same-owner -C "$ROOT/usr/src" -f - \
    || die "cannot unpack the kernel source from $SDEB"
[ -f "$ROOT/usr/src/$L_SPKG/Makefile" ] || die "the source tarball has no $L_SPKG/Makefile"
mv -- "$ROOT/usr/src/$L_SPKG" "$ROOT$SRC_DIR"
[ ! -e "$ROOT$SRC_DIR/.config" ] || die "the source tree ships a .config; kbuild refuses O= builds from it"
log "unpacked in $(( $(date +%s) - t0 )) s: $(du -sh "$ROOT$SRC_DIR" | cut -f1)"

# --- the init program ------------------------------------------------------------------
mkdir -p -- "$ROOT$(dirname -- "$INIT_PATH")"
cat > "$ROOT$INIT_PATH" <<'KBUILD'
#!/bin/sh
# corral-kbuild: the guest kernel-compile job of `corral bench overhead`
# (generated by guest-images/kbuild/build.sh). Used as init= on the image's
# read-only root; also runs as a plain program (e.g. in a chroot).
#
# Options from the kernel command line ($KBUILD_CMDLINE instead, if set):
#   kbuild.jobs=N            make -jN (1..1024; default: online CPUs)
#   kbuild.config=NAME       tinyconfig | defconfig (default tinyconfig)
#   kbuild.out=tmpfs|disk    build output in /tmp/kbuild (tmpfs, default) or
#                            /var/tmp/kbuild on the root disk (needs corral.rw)
#   kbuild.dry=0|1           1: configure for real and build nothing (a test of
#                            the boot path and the toolchain; ms= is the configure step)
#   kbuild.halt=auto|poweroff|reboot|hang   how PID 1 stops (default auto)
#
# Console lines (kernel messages may come in between):
#   KBUILD-START jobs=N config=C out=O cpus=N mem_kb=N source=...
#   KBUILD-CONFIG rc=R ms=T
#   KBUILD-ERROR <message>                  bad option or setup problem
#   kbuild-log: <line>                      last lines of the log, on failure
#   KBUILD-IMAGE bytes=N out_kb=N           size of the bzImage and of the output tree
#   KBUILD-RESULT status=ok jobs=N config=C ms=T [dry=1]
#   KBUILD-RESULT status=fail rc=R stage=params|setup|config|build [jobs=N config=C ms=T]
# ms is the wall time of `make ARCH=x86_64 -jN bzImage` alone (date +%s%N), in a
# fresh output directory after `make ARCH=x86_64 <config>`. Exactly one
# KBUILD-RESULT line is printed. As PID 1 it then syncs and stops the machine
# (ACPI power-off through sysrq 'o' when the DSDT has _S5_, else sysrq 'b',
# a reboot, which corral treats as a stop with reboot=k); otherwise it exits
# with 0 or the failing rc.
set -f
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
HOME=/root
LC_ALL=C
export PATH HOME LC_ALL
umask 022
SRC=/usr/src/linux
PID1=0
[ "$$" = 1 ] && PID1=1

is_mnt() { grep -qs "^[^ ]* $1 " /proc/mounts; }

if [ "$PID1" = 1 ]; then
    # The initramfs moves its /proc, /sys and /dev here; mount what is missing.
    [ -r /proc/mounts ] || mount -t proc proc /proc
    is_mnt /sys || mount -t sysfs sysfs /sys
    is_mnt /dev || mount -t devtmpfs devtmpfs /dev
    [ -c /dev/console ] && exec </dev/console >/dev/console 2>&1
    # The build output goes here: fresh for every boot, whatever the disk holds.
    is_mnt /tmp || mount -t tmpfs -o mode=1777,size=75% tmpfs /tmp
fi

stop() {                 # $1: exit status when not PID 1
    sync
    if [ "$PID1" != 1 ]; then exit "$1"; fi
    halt=$(opt kbuild.halt) || halt=auto
    if [ "$halt" = auto ]; then
        if grep -qs _S5_ /sys/firmware/acpi/tables/DSDT; then halt=poweroff; else halt=reboot; fi
    fi
    echo "corral-kbuild: halt=$halt"
    case "$halt" in
        hang) while :; do sleep 3600; done ;;
        poweroff) echo o > /proc/sysrq-trigger; sleep 10 ;;
    esac
    echo b > /proc/sysrq-trigger
    while :; do sleep 3600; done
}

if [ -n "${KBUILD_CMDLINE+x}" ]; then
    CMDLINE=$KBUILD_CMDLINE
else
    CMDLINE=$(cat /proc/cmdline 2>/dev/null)
fi
# opt NAME: the value of NAME=value (1 for a bare NAME); fails if absent
opt() {
    for w in $CMDLINE; do
        case "$w" in
            "$1"=*) echo "${w#*=}"; return 0 ;;
            "$1") echo 1; return 0 ;;
        esac
    done
    return 1
}

fail_params() {
    echo "KBUILD-ERROR $*"
    echo "KBUILD-RESULT status=fail rc=2 stage=params"
    stop 2
}

cpus=$(nproc 2>/dev/null) || cpus=1
jobs=$(opt kbuild.jobs) || jobs=$cpus
case "$jobs" in
    ''|*[!0-9]*|0*|?????*) fail_params "kbuild.jobs='$jobs': want a whole number from 1 to 1024" ;;
esac
[ "$jobs" -le 1024 ] || fail_params "kbuild.jobs='$jobs': want a whole number from 1 to 1024"
config=$(opt kbuild.config) || config=tinyconfig
case "$config" in
    tinyconfig|defconfig) ;;
    *) fail_params "kbuild.config='$config': want tinyconfig or defconfig" ;;
esac
out=$(opt kbuild.out) || out=tmpfs
case "$out" in
    tmpfs) odir=/tmp/kbuild ;;
    disk) odir=/var/tmp/kbuild ;;
    *) fail_params "kbuild.out='$out': want tmpfs or disk" ;;
esac
dry=$(opt kbuild.dry) || dry=0
case "$dry" in 0|1) ;; *) fail_params "kbuild.dry='$dry': want 0 or 1" ;; esac
halt=$(opt kbuild.halt) || halt=auto
case "$halt" in auto|poweroff|reboot|hang) ;; *) fail_params "kbuild.halt='$halt': want auto, poweroff, reboot or hang" ;; esac

memkb=$(awk '/^MemTotal:/ { print $2 }' /proc/meminfo 2>/dev/null)
echo "KBUILD-START jobs=$jobs config=$config out=$out cpus=$cpus mem_kb=${memkb:-?} source=$(cat /etc/corral-kbuild-source 2>/dev/null || echo '?')"

fail_setup() {
    echo "KBUILD-ERROR $*"
    echo "KBUILD-RESULT status=fail rc=1 stage=setup jobs=$jobs config=$config"
    stop 1
}
[ -f "$SRC/Makefile" ] || fail_setup "no kernel source in $SRC"
[ ! -e "$SRC/.config" ] || fail_setup "$SRC has a .config: the source tree is not clean (make mrproper)"
logdir=/tmp
touch "$logdir/.kbuild-w" 2>/dev/null && rm -f "$logdir/.kbuild-w" \
    || fail_setup "/tmp is not writable"
# A fresh output directory: nothing from an earlier build is reused.
rm -rf "$odir" 2>/dev/null
mkdir -p "$odir" 2>/dev/null || fail_setup "cannot create $odir (kbuild.out=disk needs a read-write root: corral.rw)"
log=$logdir/kbuild.log

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
tail_log() { tail -n 25 "$log" | cut -c 1-300 | sed 's/^/kbuild-log: /'; }

# The source tree is never written: O= keeps every output in $odir. ARCH is
# explicit: kbuild would take x86 from uname -m, where tinyconfig turns 64BIT off.
t0=$(now_ms)
make -C "$SRC" O="$odir" ARCH=x86_64 "$config" > "$log" 2>&1
rc=$?
ms=$(( $(now_ms) - t0 ))
echo "KBUILD-CONFIG rc=$rc ms=$ms"
if [ "$rc" != 0 ]; then
    tail_log
    echo "KBUILD-RESULT status=fail rc=$rc stage=config jobs=$jobs config=$config"
    stop "$rc"
fi
if ! grep -q '^CONFIG_64BIT=y' "$odir/.config"; then
    echo "KBUILD-ERROR make $config wrote no 64-bit .config"
    echo "KBUILD-RESULT status=fail rc=1 stage=config jobs=$jobs config=$config"
    stop 1
fi
if [ "$dry" = 1 ]; then
    echo "KBUILD-RESULT status=ok jobs=$jobs config=$config ms=$ms dry=1"
    stop 0
fi

t0=$(now_ms)
make -C "$SRC" O="$odir" ARCH=x86_64 -j"$jobs" bzImage > "$log" 2>&1
rc=$?
ms=$(( $(now_ms) - t0 ))
if [ "$rc" = 0 ] && [ ! -s "$odir/arch/x86/boot/bzImage" ]; then
    echo "KBUILD-ERROR make succeeded but left no arch/x86/boot/bzImage"
    rc=1
fi
if [ "$rc" != 0 ]; then
    tail_log
    echo "KBUILD-RESULT status=fail rc=$rc stage=build jobs=$jobs config=$config ms=$ms"
    stop "$rc"
fi
echo "KBUILD-IMAGE bytes=$(wc -c < "$odir/arch/x86/boot/bzImage") out_kb=$(du -sk "$odir" | cut -f1)"
echo "KBUILD-RESULT status=ok jobs=$jobs config=$config ms=$ms"
stop 0
KBUILD
chmod 755 "$ROOT$INIT_PATH"
sh -n "$ROOT$INIT_PATH" || die "internal error: $INIT_PATH has a syntax error"
chroot "$ROOT" /bin/sh -n "$INIT_PATH" || die "internal error: $INIT_PATH does not parse with the image's /bin/sh"

# --- the image ----------------------------------------------------------------------
# Size: the tree's block usage + 10 %, inode tables (256 B each), 128 MiB for the
# journal and metadata, plus HEADROOM_MB of free space. The file is sparse.
used_kb=$(du -skx "$ROOT" | cut -f1)
files=$(find "$ROOT" -xdev | wc -l)
inodes=$(( files + files / 2 + 16384 + HEADROOM_MB * 16 ))
size_mb=$(( (used_kb * 11 / 10 + inodes / 4) / 1024 + 128 + HEADROOM_MB ))
log "root tree: $(( used_kb / 1024 )) MiB in $files files; image: $size_mb MiB, $inodes inodes"
STAGE=$(mktemp -d "$OUT/.staging.XXXXXX")
t0=$(date +%s)
mkfs.ext4 -q -F -t ext4 -L corral-kbuild -m 0 -N "$inodes" \
    -E root_owner=0:0 -d "$ROOT" "$STAGE/rootfs.img" "${size_mb}M" >&2 \
    || die "mkfs.ext4 -d failed (e2fsprogs >= 1.43 is needed for -d)"
e2fsck -fn "$STAGE/rootfs.img" > "$TMP/fsck.log" 2>&1 \
    || { cat "$TMP/fsck.log" >&2; die "e2fsck found errors in the new image"; }
log "mkfs + fsck took $(( $(date +%s) - t0 )) s; $(grep -E ' files \(' "$TMP/fsck.log" || true)"
mv -- "$TMP/packages.txt" "$STAGE/packages.txt"

# --- publish: each file renamed into place, the stamp last ----------------------------
rm -f -- "$STAMP"
mv -f -- "$STAGE/rootfs.img" "$IMG"
mv -f -- "$STAGE/packages.txt" "$OUT/packages.txt"
printf '%s' "$KEY" > "$STAGE/stamp"
mv -f -- "$STAGE/stamp" "$STAMP"
rm -rf -- "$STAGE"; STAGE=

log "built $IMG: $(( $(stat -c %s "$IMG") >> 20 )) MiB apparent, $(( $(du -k "$IMG" | cut -f1) >> 10 )) MiB on disk"
cleanup; trap - EXIT
linux_outputs
print_outputs
if [ "$CHECK" = 1 ]; then run_check; fi
