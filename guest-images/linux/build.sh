#!/usr/bin/env bash
# guest-images/linux/build.sh: build a bootable Linux guest for corral from
# Debian packages only (the Debian cloud kernel and busybox-static).
#
# Outputs (in $OUT, default guest-images/linux/cache/out/):
#   vmlinuz            the bzImage exactly as shipped in the Debian package
#   initramfs.cpio.gz  newc cpio + gzip: busybox, the needed kernel modules, /init
#   disk.img           16 MiB raw ext4 image holding /corral-marker (MAKE_DISK=0: none)
#
# The last lines printed on success are KEY=VALUE pairs (KERNEL=, INITRD=, DISK=)
# for tests to parse. A rerun with everything built returns in milliseconds
# without network access and without touching any file.
#
# Usage: build.sh [--clean | --force | --update | --help]
#   --clean   delete the cache (downloads, lock file, outputs) and exit
#   --force   rebuild the outputs from the cached packages
#   --update  re-resolve the package versions with apt (picks up a newer kernel)
#
# Environment (all optional):
#   KERNEL_PKG        package to use; a metapackage is resolved to the real image
#                     (default linux-image-cloud-amd64 -> linux-image-6.1.0-NN-cloud-amd64)
#   KERNEL_VERSION    Debian version of the real kernel package (default: apt candidate)
#   BUSYBOX_VERSION   Debian version of busybox-static (default: apt candidate)
#   KERNEL_DEB, BUSYBOX_DEB  use these local .deb files instead of apt (offline)
#   MODULES           modules wanted in the initramfs (deps are added; built-ins skipped)
#   EXTRA_MODULES     modules appended to MODULES
#   MAKE_DISK=0|1     build disk.img (default 1); DISK_MB (default 16)
#   CACHE_DIR         cache directory (default <script dir>/cache)
#   OUT               output directory (default $CACHE_DIR/out)
#   SOURCE_DATE_EPOCH file times in the initramfs (default 0): initramfs.cpio.gz is
#                     bit-reproducible (disk.img is not: mkfs stores the current time)
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
REQ_KERNEL_PKG=${KERNEL_PKG:-linux-image-cloud-amd64}
REQ_KERNEL_VERSION=${KERNEL_VERSION:-}
REQ_BUSYBOX_VERSION=${BUSYBOX_VERSION:-}
REQ_KERNEL_DEB=${KERNEL_DEB:-}
REQ_BUSYBOX_DEB=${BUSYBOX_DEB:-}
MODULES=${MODULES:-virtio virtio_ring virtio_mmio virtio_pci virtio_blk ext4 crc32c_generic}
MODULES="$MODULES ${EXTRA_MODULES:-}"
read -r -a _mods <<< "$MODULES"; MODULES="${_mods[*]}"   # normalise whitespace (used in the cache key)
MAKE_DISK=${MAKE_DISK:-1}
DISK_MB=${DISK_MB:-16}
EPOCH=${SOURCE_DATE_EPOCH:-0}
LOCKFILE=$CACHE/packages.lock
STAMP=$OUT/.corral-build-stamp
DEBS=$CACHE/debs

case "$MAKE_DISK" in 0|1) ;; *) die "MAKE_DISK must be 0 or 1, not '$MAKE_DISK'" ;; esac
case "$DISK_MB" in ''|*[!0-9]*) die "DISK_MB must be a number of MiB, not '$DISK_MB'" ;; esac
case "$EPOCH" in ''|*[!0-9]*) die "SOURCE_DATE_EPOCH must be a number, not '$EPOCH'" ;; esac

FORCE=0 UPDATE=0
for arg in "$@"; do
    case "$arg" in
        --clean)
            rm -rf -- "$CACHE"
            if [ -d "$OUT" ]; then
                rm -f -- "$STAMP" "$OUT/vmlinuz" "$OUT/initramfs.cpio.gz" "$OUT/disk.img"
                rm -rf -- "$OUT"/.staging.*
                rmdir -- "$OUT" 2>/dev/null || true
            fi
            log "cache removed: $CACHE"
            exit 0 ;;
        --force) FORCE=1 ;;
        --update) UPDATE=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$SELF" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$arg' (try --help)" ;;
    esac
done

# ---------------------------------------------------------------------------
# Cache key and fast path
# ---------------------------------------------------------------------------
# packages.lock records the request (env pins) and what it resolved to, so a
# rerun needs neither apt nor the network. The stamp in $OUT records the key of
# the outputs: script hash + resolved package versions + build options.

REQUEST="kpkg=$REQ_KERNEL_PKG kver=$REQ_KERNEL_VERSION bbver=$REQ_BUSYBOX_VERSION kdeb=$REQ_KERNEL_DEB bbdeb=$REQ_BUSYBOX_DEB"

read_lock() {            # sets L_REQUEST L_KPKG L_KVER L_BBPKG L_BBVER; fails if absent
    L_REQUEST='' L_KPKG='' L_KVER='' L_BBPKG='' L_BBVER=''
    [ -f "$LOCKFILE" ] || return 1
    local k v
    while IFS='=' read -r k v; do
        case "$k" in
            REQUEST) L_REQUEST=$v ;;
            KERNEL_PKG) L_KPKG=$v ;;
            KERNEL_VERSION) L_KVER=$v ;;
            BUSYBOX_PKG) L_BBPKG=$v ;;
            BUSYBOX_VERSION) L_BBVER=$v ;;
        esac
    done < "$LOCKFILE"
    [ -n "$L_KPKG" ] && [ -n "$L_KVER" ] && [ -n "$L_BBPKG" ] && [ -n "$L_BBVER" ]
}

SCRIPT_HASH=$(sha256sum -- "$SELF") SCRIPT_HASH=${SCRIPT_HASH%% *}
compute_key() {
    KEY="script=$SCRIPT_HASH kernel=$L_KPKG=$L_KVER busybox=$L_BBPKG=$L_BBVER modules=$MODULES disk=$MAKE_DISK/$DISK_MB epoch=$EPOCH"
}

print_outputs() {
    local disk=
    [ "$MAKE_DISK" = 1 ] && disk=$OUT/disk.img
    echo "KERNEL_PACKAGE=$L_KPKG=$L_KVER"
    echo "CMDLINE=console=ttyS0 reboot=k panic=-1 pci=off i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd 8250.nr_uarts=1"
    echo "KERNEL=$OUT/vmlinuz"
    echo "INITRD=$OUT/initramfs.cpio.gz"
    echo "DISK=$disk"
}

outputs_fresh() {
    [ "$FORCE" = 0 ] && [ "$UPDATE" = 0 ] || return 1
    read_lock && [ "$L_REQUEST" = "$REQUEST" ] || return 1
    compute_key
    [ -f "$STAMP" ] && [ -f "$OUT/vmlinuz" ] && [ -f "$OUT/initramfs.cpio.gz" ] || return 1
    [ "$MAKE_DISK" = 0 ] || [ -f "$OUT/disk.img" ] || return 1
    local s
    s=$(<"$STAMP")
    [ "$s" = "$KEY" ]
}

if outputs_fresh; then
    print_outputs
    exit 0
fi

# ---------------------------------------------------------------------------
# Slow path: serialize concurrent builders, then resolve, download, build.
# ---------------------------------------------------------------------------
for tool in dpkg-deb sha256sum gzip find sort mktemp; do
    command -v "$tool" >/dev/null || die "'$tool' is required but not installed"
done
[ "$MAKE_DISK" = 0 ] || command -v mkfs.ext4 >/dev/null \
    || die "mkfs.ext4 not found (install e2fsprogs, or MAKE_DISK=0)"
arch=$(dpkg --print-architecture 2>/dev/null || uname -m)
case "$arch" in amd64|x86_64) ;; *) die "this builds an x86_64 guest and runs its busybox at build time; host architecture '$arch' is not supported" ;; esac

mkdir -p -- "$CACHE" "$DEBS" "$OUT"
if command -v flock >/dev/null; then
    exec 9>"$CACHE/.lock"
    flock 9
    # another builder may have finished while we waited
    if outputs_fresh; then print_outputs; exit 0; fi
fi

TMP=$(mktemp -d "$CACHE/tmp.XXXXXX")
STAGE=
cleanup() {
    rm -rf -- "$TMP"
    if [ -n "$STAGE" ]; then rm -rf -- "$STAGE"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

# --- resolve package versions ----------------------------------------------
deb_field() { dpkg-deb -f "$1" "$2" 2>/dev/null || die "cannot read '$2' from '$1' (not a .deb?)"; }

apt_candidate() {      # $1 package -> its candidate version from the local apt lists
    local v
    v=$(apt-cache policy "$1" 2>/dev/null | awk '/^ *Candidate:/ {print $2; exit}')
    if [ -z "$v" ] || [ "$v" = "(none)" ]; then
        die "package '$1' is unknown to apt (is it spelled right? try 'apt-get update')"
    fi
    printf '%s\n' "$v"
}

resolve_kernel_pkg() {  # metapackage -> real linux-image-<abi>-<flavour> package
    local p=$1 dep
    case "$p" in linux-image-[0-9]*) printf '%s\n' "$p"; return ;; esac
    command -v apt-cache >/dev/null || die "apt-cache not found; set KERNEL_DEB=/path/to/linux-image.deb"
    dep=$(apt-cache depends --no-recommends --no-suggests "$p" 2>/dev/null \
          | awk '$1 ~ /^\|?Depends:$/ && $2 ~ /^linux-image-[0-9]/ {print $2; exit}')
    [ -n "$dep" ] || die "cannot resolve '$p' to a linux-image-<version> package with 'apt-cache depends' (try 'apt-get update' or set KERNEL_PKG=linux-image-6.1.0-NN-cloud-amd64)"
    printf '%s\n' "$dep"
}

deb_path() { printf '%s/%s_%s_amd64.deb\n' "$DEBS" "$1" "${2//:/%3a}"; }

import_local_deb() {   # $1 path -> copy into the cache; sets IMP_PKG IMP_VER
    [ -f "$1" ] || die "no such file: $1"
    IMP_PKG=$(deb_field "$1" Package) IMP_VER=$(deb_field "$1" Version)
    local dst
    dst=$(deb_path "$IMP_PKG" "$IMP_VER")
    if [ ! -f "$dst" ]; then cp -- "$1" "$TMP/import.deb" && mv -f -- "$TMP/import.deb" "$dst"; fi
}

resolve() {
    local kpkg kver bbver
    if [ -n "$REQ_KERNEL_DEB" ]; then
        import_local_deb "$REQ_KERNEL_DEB"; kpkg=$IMP_PKG kver=$IMP_VER
    else
        kpkg=$(resolve_kernel_pkg "$REQ_KERNEL_PKG")
        kver=${REQ_KERNEL_VERSION:-$(apt_candidate "$kpkg")}
    fi
    if [ -n "$REQ_BUSYBOX_DEB" ]; then
        import_local_deb "$REQ_BUSYBOX_DEB"
        [ "$IMP_PKG" = busybox-static ] || die "BUSYBOX_DEB must be a busybox-static package, got '$IMP_PKG'"
        bbver=$IMP_VER
    else
        bbver=${REQ_BUSYBOX_VERSION:-$(apt_candidate busybox-static)}
    fi
    printf 'REQUEST=%s\nKERNEL_PKG=%s\nKERNEL_VERSION=%s\nBUSYBOX_PKG=%s\nBUSYBOX_VERSION=%s\n' \
        "$REQUEST" "$kpkg" "$kver" busybox-static "$bbver" > "$TMP/lock"
    mv -f -- "$TMP/lock" "$LOCKFILE"
    read_lock || die "internal error: cannot read back $LOCKFILE"
    log "resolved: $L_KPKG=$L_KVER, $L_BBPKG=$L_BBVER"
}

if [ "$UPDATE" = 1 ] || ! read_lock || [ "$L_REQUEST" != "$REQUEST" ]; then
    resolve
fi
compute_key

# --- download ---------------------------------------------------------------
fetch() {              # $1 package $2 version -> path of the cached .deb
    local pkg=$1 ver=$2 dst d f
    dst=$(deb_path "$pkg" "$ver")
    if [ ! -f "$dst" ]; then
        command -v apt-get >/dev/null || die "apt-get not found and $dst is not cached"
        log "downloading $pkg=$ver"
        d=$(mktemp -d "$TMP/dl.XXXXXX")
        local sandbox=()
        [ "$(id -u)" = 0 ] && sandbox=(-o APT::Sandbox::User=root)
        (cd "$d" && apt-get download -q "${sandbox[@]}" "$pkg=$ver") >&2 \
            || die "apt-get download $pkg=$ver failed (no such version? try --update, 'apt-get update', or unset the version pin)"
        f=$(find "$d" -maxdepth 1 -name '*.deb' | head -n1)
        [ -n "$f" ] || die "apt-get download $pkg=$ver produced no .deb"
        if [ "$(deb_field "$f" Package)" != "$pkg" ] || [ "$(deb_field "$f" Version)" != "$ver" ]; then
            die "downloaded $f is not $pkg=$ver"
        fi
        mv -f -- "$f" "$dst"
    fi
    printf '%s\n' "$dst"
}

KDEB=$(fetch "$L_KPKG" "$L_KVER")
BBDEB=$(fetch "$L_BBPKG" "$L_BBVER")

# --- extract ----------------------------------------------------------------
log "extracting $(basename -- "$KDEB")"
dpkg-deb -x "$KDEB" "$TMP/kernel" || die "cannot extract $KDEB"
dpkg-deb -x "$BBDEB" "$TMP/busybox" || die "cannot extract $BBDEB"

shopt -s nullglob
vmlinuz=("$TMP"/kernel/boot/vmlinuz-*)
kconfig=("$TMP"/kernel/boot/config-*)
moddirs=("$TMP"/kernel/lib/modules/* "$TMP"/kernel/usr/lib/modules/*)
shopt -u nullglob
[ "${#vmlinuz[@]}" = 1 ] || die "$KDEB has no single /boot/vmlinuz-* (${#vmlinuz[@]} found); is it a real kernel image package?"
[ "${#moddirs[@]}" = 1 ] || die "$KDEB has no single lib/modules/<release> directory"
MODDIR=${moddirs[0]}
KREL=${MODDIR##*/}
BUSYBOX=$TMP/busybox/bin/busybox
[ -x "$BUSYBOX" ] || die "$BBDEB has no /bin/busybox"
"$BUSYBOX" true 2>/dev/null || die "cannot run $BUSYBOX on this host"

if [ "${#kconfig[@]}" = 1 ]; then
    for opt in CONFIG_VIRTIO_MMIO CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES CONFIG_VIRTIO_BLK CONFIG_EXT4_FS CONFIG_X86_MPPARSE; do
        v=$(grep -E "^$opt=|^# $opt is not set" "${kconfig[0]}" || true)
        case "$v" in "$opt="*) v=${v#*=} ;; *) v=n ;; esac
        log "kernel $KREL: $opt=$v"
    done
fi

# --- modules: resolve dependencies, order them ------------------------------
declare -A MODPATH=() BUILTIN=() VISITED=()
ORDER=()
norm() { local n=${1##*/}; n=${n%%.ko*}; printf '%s\n' "${n//-/_}"; }

while IFS= read -r -d '' f; do
    MODPATH[$(norm "$f")]=$f
done < <(find "$MODDIR" -name '*.ko*' -print0)
if [ -f "$MODDIR/modules.builtin" ]; then
    while IFS= read -r f; do BUILTIN[$(norm "$f")]=1; done < "$MODDIR/modules.builtin"
fi

ko_plain() {           # $1 module file -> uncompressed .ko on stdout
    case "$1" in
        *.ko) cat -- "$1" ;;
        *.ko.xz) xz -dc -- "$1" ;;
        *.ko.zst) zstd -qdc -- "$1" ;;
        *.ko.gz) gzip -dc -- "$1" ;;
        *) die "unknown module compression: $1" ;;
    esac
}

visit() {              # depth-first: dependencies first
    local name=$1 dep deps
    [ -z "${VISITED[$name]:-}" ] || return 0
    VISITED[$name]=1
    if [ -n "${BUILTIN[$name]:-}" ]; then log "module $name: built in"; return 0; fi
    [ -n "${MODPATH[$name]:-}" ] || die "module '$name' is neither built into $KREL nor shipped as a module (check MODULES/EXTRA_MODULES)"
    deps=$(ko_plain "${MODPATH[$name]}" | tr '\0' '\n' | sed -n 's/^depends=//p' | head -n1)
    for dep in ${deps//,/ }; do visit "$(norm "$dep")"; done
    ORDER+=("$name")
}
for m in $MODULES; do visit "$(norm "$m")"; done
log "modules to load, in order: ${ORDER[*]:-(none)}"

# --- initramfs tree -----------------------------------------------------------
ROOT=$TMP/initramfs
mkdir -p "$ROOT"/{bin,sbin,usr/bin,usr/sbin,dev,proc,sys,mnt,tmp,run,etc,root,lib/modules}
chmod 1777 "$ROOT/tmp"
cp -- "$BUSYBOX" "$ROOT/bin/busybox"
while IFS= read -r applet; do
    case "$applet" in bin/busybox|linuxrc) continue ;; esac
    mkdir -p -- "$ROOT/$(dirname -- "$applet")"
    ln -sf /bin/busybox "$ROOT/$applet"
done < <("$BUSYBOX" --list-full)
[ -L "$ROOT/bin/sh" ] || die "busybox has no sh applet"
# /dev/console lets the kernel give init a console before devtmpfs is mounted
# (only root can create it; /init also reopens the console after mounting devtmpfs)
if [ "$(id -u)" = 0 ]; then mknod -m 600 "$ROOT/dev/console" c 5 1; fi

: > "$ROOT/lib/modules/corral-modules.list"
for name in "${ORDER[@]}"; do
    src=${MODPATH[$name]}
    rel=${src#"$MODDIR"/}; rel=${rel%%.ko*}.ko
    mkdir -p -- "$ROOT/lib/modules/$KREL/$(dirname -- "$rel")"
    ko_plain "$src" > "$ROOT/lib/modules/$KREL/$rel"
    echo "/lib/modules/$KREL/$rel" >> "$ROOT/lib/modules/corral-modules.list"
done
echo "$KREL" > "$ROOT/etc/corral-kernel-release"

cat > "$ROOT/init" <<'INIT'
#!/bin/sh
# corral Linux guest /init (generated by guest-images/linux/build.sh).
# Prints CORRAL-LINUX-* markers on the console, then stops the VM.
# Kernel command-line options read here:
#   corral.rw             mount /dev/vda read-write (default read-only)
#   corral.vdawait=SECS   how long to wait for /dev/vda (default 3)
#   corral.run=PATH       run this script (path on the mounted disk, else in the
#                         initramfs) before CORRAL-LINUX-DONE; prints CORRAL-LINUX-RUN rc=N
#   corral.shell          start an interactive shell on the console before halting
#   corral.root=DEV       hand over to the root file system on DEV (/dev/vda; it is
#                         mounted as above): after CORRAL-LINUX-MEM, move /dev, /proc
#                         and /sys there and switch_root to init= (default /sbin/init);
#                         prints CORRAL-LINUX-ROOT (error=... and carries on if it cannot)
#   corral.halt=auto|poweroff|reboot|hang   how to stop (default auto: poweroff
#                         if the ACPI DSDT has an _S5_ object, else reboot -f)
PATH=/bin:/sbin:/usr/bin:/usr/sbin
export PATH
umask 022

mount -t proc proc /proc 2>/dev/null
mount -t sysfs sysfs /sys 2>/dev/null
mount -t devtmpfs devtmpfs /dev 2>/dev/null || mdev -s 2>/dev/null
[ -c /dev/console ] && exec </dev/console >/dev/console 2>&1
mkdir -p /dev/pts /dev/shm 2>/dev/null

echo "CORRAL-LINUX-INIT"

CMDLINE=$(cat /proc/cmdline 2>/dev/null)
# opt NAME: prints the value of NAME=value (or 1 for a bare NAME); fails if absent
opt() {
    for w in $CMDLINE; do
        case "$w" in
            "$1"=*) echo "${w#*=}"; return 0 ;;
            "$1") echo 1; return 0 ;;
        esac
    done
    return 1
}
echo "corral-init: kernel $(uname -r), cmdline: $CMDLINE"

# --- modules, in dependency order (computed at build time) ---
loaded=0 failed=0
if [ -f /lib/modules/corral-modules.list ]; then
    while read -r m; do
        case "$m" in ''|'#'*) continue ;; esac
        # pass <module>.<param>=<value> from the kernel command line, as modprobe would
        name=${m##*/}; name=${name%.ko}
        args=
        for w in $CMDLINE; do
            case "$w" in "$name".?*) args="$args ${w#"$name".}" ;; esac
        done
        # shellcheck disable=SC2086
        if out=$(insmod "$m" $args 2>&1); then
            loaded=$((loaded + 1))
        else
            failed=$((failed + 1))
            echo "corral-init: insmod $m$args failed: $out"
        fi
    done < /lib/modules/corral-modules.list
fi
echo "CORRAL-LINUX-MODULES loaded=$loaded failed=$failed"

# --- /dev/vda ---
wait=$(opt corral.vdawait) || wait=3
case "$wait" in ''|*[!0-9]*) wait=3 ;; esac
i=0
while [ ! -b /dev/vda ] && [ "$i" -lt $((wait * 10)) ]; do
    usleep 100000
    i=$((i + 1))
done
if [ -b /dev/vda ]; then
    echo "CORRAL-LINUX-VDA present"
    mode=ro
    opt corral.rw >/dev/null && mode=rw
    sectors=$(cat /sys/block/vda/size 2>/dev/null)
    fs=raw dev=/dev/vda
    for d in /dev/vda /dev/vda1; do
        [ -b "$d" ] || continue
        if mount -t ext4 -o "$mode" "$d" /mnt 2>/dev/null; then
            fs=ext4 dev=$d; break
        elif mount -o "$mode" "$d" /mnt 2>/dev/null; then
            fs=$(awk '$2 == "/mnt" { print $3 }' /proc/mounts) dev=$d; break
        fi
    done
    echo "CORRAL-LINUX-VDA-FS fs=$fs dev=$dev mode=$mode sectors=$sectors"
    if [ "$fs" = raw ]; then
        bytes=$(dd if=/dev/vda bs=4096 count=1 2>/dev/null | wc -c)
        echo "CORRAL-LINUX-VDA-RAW read=$bytes"
    elif [ -f /mnt/corral-marker ]; then
        echo "CORRAL-LINUX-VDA-MARKER $(head -n 1 /mnt/corral-marker)"
    fi
else
    echo "CORRAL-LINUX-VDA absent"
fi

# --- CPUs and memory ---
count_cpus() {           # "0-3,5,7-8" -> 7
    n=0
    for r in $(echo "$1" | tr ',' ' '); do
        case "$r" in
            *-*) n=$((n + ${r#*-} - ${r%-*} + 1)) ;;
            *) n=$((n + 1)) ;;
        esac
    done
    echo "$n"
}
if [ -r /sys/devices/system/cpu/online ]; then
    ncpu=$(count_cpus "$(cat /sys/devices/system/cpu/online)")
else
    ncpu=$(nproc)
fi
echo "CORRAL-LINUX-CPUS n=$ncpu"
memkb=$(awk '/^MemTotal:/ { print $2 }' /proc/meminfo)
echo "CORRAL-LINUX-MEM kb=$memkb"

# --- hand over to a root file system on the disk (corral.root=, init=) ---
if root=$(opt corral.root); then
    rinit=$(opt init) || rinit=/sbin/init
    if [ "${dev:-}" != "$root" ] || [ "${fs:-raw}" = raw ] || ! grep -q ' /mnt ' /proc/mounts; then
        echo "CORRAL-LINUX-ROOT error=not-mounted dev=$root"
    elif [ ! -e "/mnt$rinit" ] && [ ! -L "/mnt$rinit" ]; then
        echo "CORRAL-LINUX-ROOT error=no-init dev=$root init=$rinit"
    else
        echo "CORRAL-LINUX-ROOT dev=$root init=$rinit"
        for m in dev proc sys; do
            mount --move "/$m" "/mnt/$m" 2>/dev/null || umount -l "/$m" 2>/dev/null
        done
        exec switch_root -c /dev/console /mnt "$rinit"
    fi
fi

# --- optional workload ---
if run=$(opt corral.run); then
    if [ -f "/mnt/${run#/}" ]; then script="/mnt/${run#/}"; else script=$run; fi
    if [ -f "$script" ]; then
        (cd /mnt && sh "$script"); rc=$?
    else
        echo "corral-init: corral.run=$run: no such file"; rc=127
    fi
    echo "CORRAL-LINUX-RUN rc=$rc"
fi

if opt corral.shell >/dev/null; then
    echo "corral-init: starting a shell; exit it to halt"
    setsid cttyhack sh || sh
fi

sync
grep -q ' /mnt ' /proc/mounts && umount /mnt 2>/dev/null
echo "CORRAL-LINUX-DONE"

# --- stop the VM ---
# Without ACPI S5 support the kernel turns "poweroff" into "halt" and the VM
# would sit in HLT forever, so by default power off only if the DSDT has _S5_;
# otherwise reboot (with reboot=k: an i8042 reset, which corral treats as a stop).
halt=$(opt corral.halt) || halt=auto
if [ "$halt" = auto ]; then
    if grep -q _S5_ /sys/firmware/acpi/tables/DSDT 2>/dev/null; then halt=poweroff; else halt=reboot; fi
fi
echo "corral-init: halt=$halt"
case "$halt" in
    poweroff) poweroff -f; reboot -f ;;
    hang) while :; do sleep 3600; done ;;
    *) reboot -f ;;
esac
echo b > /proc/sysrq-trigger
while :; do sleep 3600; done
INIT
chmod 755 "$ROOT/init"
"$BUSYBOX" sh -n "$ROOT/init" || die "internal error: /init has a syntax error"

# --- pack ---------------------------------------------------------------------
STAGE=$(mktemp -d "$OUT/.staging.XXXXXX")
find "$ROOT" -exec touch -h -d "@$EPOCH" {} +
(
    cd "$ROOT"
    find . -mindepth 1 | sed 's|^\./||' | sort \
        | "$BUSYBOX" cpio -o -H newc -R 0:0 --ignore-devno --renumber-inodes 2>/dev/null
) | gzip -9n > "$STAGE/initramfs.cpio.gz"
[ -s "$STAGE/initramfs.cpio.gz" ] || die "creating the initramfs failed"
cp -- "${vmlinuz[0]}" "$STAGE/vmlinuz"

if [ "$MAKE_DISK" = 1 ]; then
    mkdir -p "$TMP/disk"
    printf 'CORRAL-DISK-OK\n' > "$TMP/disk/corral-marker"
    find "$TMP/disk" -exec touch -h -d "@$EPOCH" {} +
    mkfs.ext4 -q -F -t ext4 -L corral-test \
        -U 2c0a7a11-0000-4000-8000-000000000001 \
        -E root_owner=0:0,hash_seed=2c0a7a11-0000-4000-8000-000000000002 \
        -d "$TMP/disk" "$STAGE/disk.img" "${DISK_MB}M" >/dev/null \
        || die "mkfs.ext4 -d failed (e2fsprogs >= 1.43 is needed for -d)"
fi

# --- publish: each file renamed into place, the stamp last ----------------------
rm -f -- "$STAMP"
for f in vmlinuz initramfs.cpio.gz disk.img; do
    if [ -f "$STAGE/$f" ]; then mv -f -- "$STAGE/$f" "$OUT/$f"; fi
done
[ "$MAKE_DISK" = 1 ] || rm -f -- "$OUT/disk.img"
printf '%s' "$KEY" > "$STAGE/stamp"
mv -f -- "$STAGE/stamp" "$STAMP"
rm -rf -- "$STAGE"; STAGE=

log "built for kernel $KREL: vmlinuz $(stat -c %s "$OUT/vmlinuz") B, initramfs $(stat -c %s "$OUT/initramfs.cpio.gz") B${ORDER:+, modules: ${ORDER[*]}}"
print_outputs
