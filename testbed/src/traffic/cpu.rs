//! CPU accounting: per-CPU time from /proc/stat, a thread's or a task's CPU time, a process's
//! CPU time and resident memory, the load average.

/// /proc/stat's columns: user nice system idle iowait irq softirq steal (USER_HZ ticks).
const IDLE: usize = 3;
const IOWAIT: usize = 4;
const SOFTIRQ: usize = 6;
const STEAL: usize = 7;

/// Every CPU's ticks, per column, at one moment.
pub struct CpuStat(Vec<[u64; 8]>);

impl CpuStat {
    pub fn read() -> Self {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        Self(
            stat.lines()
                .filter(|l| {
                    l.strip_prefix("cpu")
                        .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
                })
                .map(|l| {
                    // Guest time is within user: the first 8 columns are the whole.
                    let mut v = [0u64; 8];
                    for (i, x) in l.split_whitespace().skip(1).take(8).enumerate() {
                        v[i] = x.parse().unwrap_or(0);
                    }
                    v
                })
                .collect(),
        )
    }

    /// Since `before`: the busy share (%) of every CPU but `cpu` (what else ran on the machine:
    /// the measured processes are pinned to `cpu`) and `cpu`'s steal share (%).
    pub fn shares_since(&self, before: &Self, cpu: usize) -> (f64, f64) {
        let n = before.0.len().min(self.0.len());
        let d = |i: usize, k: usize| self.0[i][k].saturating_sub(before.0[i][k]) as f64;
        let total = |i: usize| (0..8).map(|k| d(i, k)).sum::<f64>();
        let (mut busy, mut all) = (0.0, 0.0);
        for i in (0..n).filter(|&i| i != cpu) {
            let t = total(i);
            busy += t - d(i, IDLE) - d(i, IOWAIT) - d(i, STEAL);
            all += t;
        }
        let share = |part: f64, whole: f64| {
            if whole > 0.0 {
                100.0 * part / whole
            } else {
                f64::NAN
            }
        };
        let steal = if cpu < n {
            share(d(cpu, STEAL), total(cpu))
        } else {
            f64::NAN
        };
        (share(busy, all), steal)
    }

    /// `cpu`'s softirq time since `before` (ns; tick-sampled).
    pub fn softirq_ns_since(&self, before: &Self, cpu: usize) -> f64 {
        let ticks = self
            .0
            .get(cpu)
            .zip(before.0.get(cpu))
            .map_or(f64::NAN, |(a, b)| {
                a[SOFTIRQ].saturating_sub(b[SOFTIRQ]) as f64
            });
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        ticks * 1e9 / if hz > 0 { hz as f64 } else { 100.0 }
    }
}

/// This thread's CPU time (ns): with tick-based accounting it includes the softirqs the thread
/// ran on its way out of a system call.
pub fn thread_cpu_ns() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 * 1e9 + ts.tv_nsec as f64
}

/// A task's CPU time so far (ns, `/proc/<pid>/schedstat`); 0 when unknown.
pub fn task_cpu_ns(pid: Option<u32>) -> f64 {
    pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/schedstat")).ok())
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

/// A process's resident memory and CPU time so far.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProcessUsage {
    /// Resident set now (KiB, `VmRSS` of /proc/<pid>/status).
    pub rss_kib: u64,
    /// Resident set at its peak since the process started (KiB, `VmHWM`).
    pub peak_rss_kib: u64,
    /// The resident set now, split: anonymous memory (the heap, stacks) and file pages (the
    /// executable's code and data as mapped; shared with other processes running it, and
    /// reclaimable) (KiB, `RssAnon`, `RssFile`).
    pub rss_anon_kib: u64,
    pub rss_file_kib: u64,
    /// User + system time of all its threads (s, utime + stime of /proc/<pid>/stat).
    pub cpu_secs: f64,
}

impl ProcessUsage {
    /// Process `pid`'s usage; `None` when it is gone.
    pub fn read(pid: u32) -> Option<Self> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        Self::parse(&status, &stat, if hz > 0 { hz as f64 } else { 100.0 })
    }

    /// From the text of /proc/<pid>/status and /proc/<pid>/stat, `hz` ticks a second.
    fn parse(status: &str, stat: &str, hz: f64) -> Option<Self> {
        let kib = |key: &str| -> Option<u64> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        };
        // After the command name in parentheses (which may hold spaces and parentheses):
        // state is field 3, utime 14, stime 15.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let ticks = |i: usize| fields.get(i - 3).and_then(|v| v.parse::<f64>().ok());
        Some(Self {
            rss_kib: kib("VmRSS:")?,
            peak_rss_kib: kib("VmHWM:")?,
            rss_anon_kib: kib("RssAnon:")?,
            rss_file_kib: kib("RssFile:")?,
            cpu_secs: (ticks(14)? + ticks(15)?) / hz,
        })
    }
}

/// The kernel thread that runs CPU `cpu`'s softirqs when they pile up.
pub fn ksoftirqd_pid(cpu: usize) -> Option<u32> {
    let want = format!("ksoftirqd/{cpu}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        (comm.trim() == want).then_some(pid)
    })
}

/// The 1-minute load average.
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|l| l.parse().ok()))
        .unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_usage_reads_status_and_stat() {
        let status = "Name:\tcalix-agent\nVmHWM:\t   30720 kB\nVmRSS:\t   20480 kB\n\
                      RssAnon:\t   12288 kB\nRssFile:\t    8192 kB\nRssShmem:\t       0 kB\n";
        let stat = "42 (calix (agent)) S 1 42 42 0 -1 4194560 100 0 0 0 150 50 0 0 20 0 4 0";
        let u = ProcessUsage::parse(status, stat, 100.0).expect("usage");
        assert_eq!((u.rss_kib, u.peak_rss_kib), (20480, 30720));
        assert_eq!((u.rss_anon_kib, u.rss_file_kib), (12288, 8192));
        assert!((u.cpu_secs - 2.0).abs() < 1e-9, "{u:?}");
        assert_eq!(ProcessUsage::parse("", stat, 100.0), None);
        let me = ProcessUsage::read(std::process::id()).expect("this process");
        assert!(me.rss_kib > 0 && me.peak_rss_kib >= me.rss_kib, "{me:?}");
    }
}
