//! The standard `process_*` metrics of the daemon itself, from `/proc/self`
//! (the names and meanings of the Prometheus client libraries' process
//! collectors, so existing dashboards and alerts work unchanged).

use super::expo::Reg;

/// What `/proc/self` says about this process.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ProcessFigures {
    /// User + system CPU time, seconds.
    pub cpu_seconds: f64,
    /// Resident set size, bytes.
    pub resident_bytes: u64,
    /// Virtual memory size, bytes.
    pub virtual_bytes: u64,
    /// Open file descriptors.
    pub open_fds: u64,
    /// The soft limit on open file descriptors.
    pub max_fds: Option<u64>,
    /// Start time, seconds since the Unix epoch.
    pub start_time_seconds: f64,
    /// Threads.
    pub threads: u64,
}

fn sysconf(name: libc::c_int) -> Option<u64> {
    // SAFETY: sysconf has no memory effects; an unknown name returns -1.
    let v = unsafe { libc::sysconf(name) };
    u64::try_from(v).ok().filter(|v| *v > 0)
}

/// Parses `/proc/<pid>/stat`; `btime` is the boot time from `/proc/stat`.
/// Fields after the command (which may hold spaces and parentheses) are
/// counted from its closing parenthesis.
pub fn parse_stat(stat: &str, btime: u64, ticks: u64, page: u64) -> Option<ProcessFigures> {
    let after = &stat[stat.rfind(')')? + 1..];
    // after[0] is field 3 (state); field N is after[N - 3].
    let f: Vec<&str> = after.split_whitespace().collect();
    let num = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    let ticks = ticks.max(1) as f64;
    Some(ProcessFigures {
        cpu_seconds: (num(14)? + num(15)?) as f64 / ticks,
        threads: num(20)?,
        start_time_seconds: btime as f64 + num(22)? as f64 / ticks,
        virtual_bytes: num(23)?,
        resident_bytes: num(24)?.saturating_mul(page),
        open_fds: 0,
        max_fds: None,
    })
}

fn boot_time() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

fn max_fds() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = s.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Reads this process's figures (None if `/proc` is not mounted).
pub fn read() -> Option<ProcessFigures> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let ticks = sysconf(libc::_SC_CLK_TCK).unwrap_or(100);
    let page = sysconf(libc::_SC_PAGESIZE).unwrap_or(4096);
    let mut p = parse_stat(&stat, boot_time()?, ticks, page)?;
    // The read_dir's own fd is among the entries.
    p.open_fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count().saturating_sub(1) as u64)
        .unwrap_or(0);
    p.max_fds = max_fds();
    Some(p)
}

/// Registers the `process_*` families.
pub fn register(r: &mut Reg) {
    let Some(p) = read() else { return };
    r.amount(
        "process_cpu_seconds",
        "Total user and system CPU time spent in seconds",
        p.cpu_seconds,
    );
    r.int(
        "process_resident_memory_bytes",
        "Resident memory size in bytes",
        p.resident_bytes,
    );
    r.int(
        "process_virtual_memory_bytes",
        "Virtual memory size in bytes",
        p.virtual_bytes,
    );
    r.int(
        "process_open_fds",
        "Number of open file descriptors",
        p.open_fds,
    );
    if let Some(m) = p.max_fds {
        r.int(
            "process_max_fds",
            "Maximum number of open file descriptors",
            m,
        );
    }
    r.gauge(
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds",
        p.start_time_seconds,
    );
    r.int(
        "process_threads",
        "Number of OS threads in the process",
        p.threads,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command() {
        // A command with spaces and a parenthesis, as the kernel writes it.
        let stat = "4242 (corral (x) y) S 1 4242 4242 0 -1 4194560 500 0 0 0 \
                    250 50 0 0 20 0 7 0 12345 104857600 2560 18446744073709551615";
        let p = parse_stat(stat, 1_700_000_000, 100, 4096).unwrap();
        assert_eq!(p.cpu_seconds, 3.0);
        assert_eq!(p.threads, 7);
        assert_eq!(p.start_time_seconds, 1_700_000_000.0 + 123.45);
        assert_eq!(p.virtual_bytes, 104_857_600);
        assert_eq!(p.resident_bytes, 2560 * 4096);
        assert!(parse_stat("garbage", 0, 100, 4096).is_none());
    }

    #[test]
    fn this_process_is_read() {
        let p = read().expect("/proc/self");
        assert!(
            p.resident_bytes > 0 && p.open_fds >= 3 && p.threads >= 1,
            "{p:?}"
        );
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(p.start_time_seconds <= now + 1.0 && p.start_time_seconds > now - 86_400.0 * 365.0);
    }
}
