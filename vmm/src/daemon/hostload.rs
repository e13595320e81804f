//! What the host's CPUs did, from `/proc/stat`: idle, steal and busy time
//! of the CPUs the daemon may use (its affinity mask), for the scheduler
//! thread's measurement of the load that is not corral's.

use std::os::unix::fs::FileExt;

/// Cumulative times of the daemon's CPUs, ns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostStat {
    /// Idle + iowait.
    pub idle_ns: u64,
    /// Taken by the hypervisor below.
    pub steal_ns: u64,
    /// Busy: user + nice + system + irq + softirq (guest time is part of
    /// user time).
    pub busy_ns: u64,
}

/// Reads [`HostStat`] for a fixed set of CPUs.
#[derive(Debug)]
pub struct StatReader {
    /// CPUs to count (bitmap by CPU number).
    cpus: Vec<bool>,
    ns_per_tick: u64,
    buf: Vec<u8>,
    /// `/proc/stat`, kept open: a sample is one `pread` at offset 0 (the
    /// kernel makes the text anew), where open, read and close were three
    /// syscalls and a path walk.
    file: Option<std::fs::File>,
}

impl StatReader {
    /// A reader for the calling thread's CPU affinity mask (all CPUs if it
    /// cannot be read).
    pub fn for_affinity() -> Self {
        let mut cpus = Vec::new();
        // SAFETY: an all-zero `cpu_set_t` is a valid empty set;
        // sched_getaffinity writes at most `size_of::<cpu_set_t>()` bytes
        // into the set we own, and CPU_ISSET only reads it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                cpus = (0..libc::CPU_SETSIZE as usize)
                    .map(|i| libc::CPU_ISSET(i, &set))
                    .collect();
                while cpus.last() == Some(&false) {
                    cpus.pop();
                }
            }
        }
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
        // The cpu lines come first (~100 bytes each); the rest (interrupt
        // counts) can be long and is not needed.
        let want = (128 * (cpus.len() + 2)).max(4096);
        StatReader {
            cpus,
            ns_per_tick: 1_000_000_000 / hz,
            buf: vec![0; want],
            file: std::fs::File::open("/proc/stat").ok(),
        }
    }

    /// The current times, or `None` if `/proc/stat` cannot be read.
    pub fn read(&mut self) -> Option<HostStat> {
        if self.file.is_none() {
            self.file = std::fs::File::open("/proc/stat").ok();
        }
        let f = self.file.as_ref()?;
        let mut n = 0;
        while n < self.buf.len() {
            let want = self.buf.len() - n;
            match f.read_at(self.buf.get_mut(n..)?, n as u64) {
                Ok(0) => break,
                // The kernel makes the whole text at the first read and
                // copies what fits: a short read is the end (one syscall).
                Ok(k) if k < want => {
                    n += k;
                    break;
                }
                Ok(k) => n += k,
                Err(_) => {
                    self.file = None; // opened again next time
                    return None;
                }
            }
        }
        let text = match std::str::from_utf8(self.buf.get(..n)?) {
            Ok(t) => t,
            // Cut inside a multi-byte character (there are none in
            // /proc/stat): the valid part.
            Err(e) => std::str::from_utf8(self.buf.get(..e.valid_up_to())?).ok()?,
        };
        let cpus = &self.cpus;
        parse(
            text,
            |n| cpus.is_empty() || cpus.get(n).copied().unwrap_or(false),
            self.ns_per_tick,
        )
    }
}

/// Sums the `cpuN` lines of `/proc/stat` text for which `want(N)`.
fn parse(text: &str, want: impl Fn(usize) -> bool, ns_per_tick: u64) -> Option<HostStat> {
    let mut st = HostStat::default();
    let mut seen = false;
    for line in text.lines() {
        let Some(rest) = line
            .strip_prefix("cpu")
            .filter(|r| r.starts_with(|c: char| c.is_ascii_digit()))
        else {
            if line.starts_with("cpu ") {
                continue; // the total line
            }
            if seen {
                break;
            }
            continue;
        };
        let mut it = rest.split_whitespace();
        let Some(Ok(n)) = it.next().map(str::parse::<usize>) else {
            continue;
        };
        if !want(n) {
            continue;
        }
        let v: Vec<u64> = it.take(8).map(|x| x.parse().unwrap_or(0)).collect();
        let f = |i: usize| v.get(i).copied().unwrap_or(0);
        st.busy_ns += (f(0) + f(1) + f(2) + f(5) + f(6)) * ns_per_tick;
        st.idle_ns += (f(3) + f(4)) * ns_per_tick;
        st.steal_ns += f(7) * ns_per_tick;
        seen = true;
    }
    seen.then_some(st)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  35295 0 26050 61443 446 0 90 59 2 0\n\
        cpu0 16682 0 12398 32465 91 0 23 27 1 0\n\
        cpu1 18612 1 13652 28977 354 2 66 32 1 0\n\
        intr 1 2 3\n";

    #[test]
    fn sums_the_wanted_cpus() {
        let all = parse(STAT, |_| true, 10_000_000).unwrap();
        assert_eq!(
            all.busy_ns,
            (16682 + 12398 + 23 + 18612 + 1 + 13652 + 2 + 66) * 10_000_000
        );
        assert_eq!(all.idle_ns, (32465 + 91 + 28977 + 354) * 10_000_000);
        assert_eq!(all.steal_ns, (27 + 32) * 10_000_000);
        let one = parse(STAT, |n| n == 1, 1).unwrap();
        assert_eq!(one.idle_ns, 28977 + 354);
        assert!(parse(STAT, |n| n == 7, 1).is_none());
        assert!(parse("garbage", |_| true, 1).is_none());
    }

    #[test]
    fn reads_this_host() {
        let mut r = StatReader::for_affinity();
        let a = r.read().expect("/proc/stat");
        assert!(a.busy_ns + a.idle_ns > 0);
        // Read again through the same open file: fresh figures, never
        // going backwards.
        std::thread::sleep(std::time::Duration::from_millis(50));
        let b = r.read().expect("/proc/stat, read again");
        assert!(b.busy_ns + b.idle_ns + b.steal_ns > a.busy_ns + a.idle_ns + a.steal_ns);
        assert!(b.busy_ns >= a.busy_ns && b.idle_ns >= a.idle_ns);
    }
}
