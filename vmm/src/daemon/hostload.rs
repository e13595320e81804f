//! What the host's CPUs did, from `/proc/stat`: idle, steal and busy time
//! of the CPUs the daemon may use (its affinity mask), for the scheduler
//! thread's measurement of the load that is not corral's.

use std::io::Read;

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
        StatReader {
            cpus,
            ns_per_tick: 1_000_000_000 / hz,
            buf: Vec::with_capacity(4096),
        }
    }

    /// The current times, or `None` if `/proc/stat` cannot be read.
    pub fn read(&mut self) -> Option<HostStat> {
        let f = std::fs::File::open("/proc/stat").ok()?;
        self.buf.clear();
        // The cpu lines come first (~100 bytes each); the rest (interrupt
        // counts) can be long and is not needed.
        let want = 128 * (self.cpus.len() as u64 + 2);
        f.take(want.max(4096)).read_to_end(&mut self.buf).ok()?;
        let text = std::str::from_utf8(&self.buf).ok()?;
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
    }
}
