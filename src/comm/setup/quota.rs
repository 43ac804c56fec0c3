//! The CPU quota of this process's cgroup ([`Quota`]): the CPU time the kernel lets the
//! processes of a cgroup run per period (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` and
//! `cpu.cfs_period_us`), as a container's CPU limit sets it (`resources.limits.cpu` of a
//! Kubernetes pod, `docker run --cpus`). Ranks under one quota that want more CPUs than it
//! allows are throttled: the kernel stops all of them for the rest of each period once their
//! time is spent, whatever their affinity masks say. [`super::crowd`] reports it.
//!
//! Read from `/proc/self/cgroup` and `/proc/self/mountinfo`: for each hierarchy with the CPU
//! controller, the cgroup's directory under that hierarchy's mount, then its ancestors up to
//! the mount; the tightest limit wins.

#![forbid(unsafe_code)]

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// A CPU quota: `quota_us` of CPU time per `period_us`, shared by every process of the cgroup
/// `cgroup` (and its descendants).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quota {
    /// The limiting cgroup's identity on its kernel: the inode of its directory (cgroup v1
    /// ones with the top bit set, so that two hierarchies' numbers never meet).
    pub cgroup: u64,
    /// CPU time per period, µs.
    pub quota_us: u64,
    /// The period, µs.
    pub period_us: u64,
}

impl Quota {
    /// The CPUs' worth of time the quota allows.
    pub fn cpus(&self) -> f64 {
        self.quota_us as f64 / self.period_us as f64
    }

    /// Whether `ranks` busy ranks want more than the quota allows.
    pub fn exceeded_by(&self, ranks: usize) -> bool {
        (ranks as u128) * u128::from(self.period_us) > u128::from(self.quota_us)
    }

    /// Whether this quota is tighter than `other`.
    fn tighter_than(&self, other: &Quota) -> bool {
        u128::from(self.quota_us) * u128::from(other.period_us)
            < u128::from(other.quota_us) * u128::from(self.period_us)
    }

    /// The tighter of two quotas.
    fn tighter(self, other: Quota) -> Quota {
        if other.tighter_than(&self) {
            other
        } else {
            self
        }
    }

    /// The wire form (a line of a rank's seat): `cgroup quota_us period_us`.
    pub fn encode(&self) -> String {
        format!("{} {} {}", self.cgroup, self.quota_us, self.period_us)
    }

    /// What [`Quota::encode`] wrote, whatever the text: `None` for anything else (a zero
    /// quota or period included).
    pub fn decode(text: &str) -> Option<Quota> {
        let n: Vec<u64> = text
            .split(' ')
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        match n[..] {
            [cgroup, quota_us, period_us] if quota_us > 0 && period_us > 0 => Some(Quota {
                cgroup,
                quota_us,
                period_us,
            }),
            _ => None,
        }
    }
}

/// `cpus` CPUs in words: `1 CPU`, `2 CPUs`, `1.5 CPUs`, `0.33 CPUs` (two decimals at most).
pub fn cpus_text(cpus: f64) -> String {
    let n = format!("{cpus:.2}");
    let n = n.trim_end_matches('0').trim_end_matches('.');
    format!("{n} CPU{}", if n == "1" { "" } else { "s" })
}

/// `quota period` of a cgroup v2 `cpu.max` (`max 100000`: none).
pub(crate) fn parse_cpu_max(text: &str) -> Option<(u64, u64)> {
    let mut it = text.split_whitespace();
    let quota = it.next()?.parse::<u64>().ok()?;
    let period = it.next().map_or(Some(100_000), |p| p.parse::<u64>().ok())?;
    (quota > 0 && period > 0).then_some((quota, period))
}

/// `quota period` from cgroup v1's `cpu.cfs_quota_us` (`-1`: none) and `cpu.cfs_period_us`.
pub(crate) fn parse_cfs(quota: &str, period: &str) -> Option<(u64, u64)> {
    let q = quota.trim().parse::<u64>().ok()?;
    let p = period.trim().parse::<u64>().ok()?;
    (q > 0 && p > 0).then_some((q, p))
}

/// A hierarchy with the CPU controller that this process is in: its cgroup's directory and
/// the mount it is under (the walk up stops there).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuCgroup {
    /// The cgroup's directory.
    pub dir: PathBuf,
    /// The mount of its hierarchy.
    pub mount: PathBuf,
    /// Whether it is a cgroup v1 hierarchy (`cpu.cfs_quota_us`), not the unified one
    /// (`cpu.max`).
    pub v1: bool,
}

/// The CPU hierarchies of a process from the text of its `/proc/<pid>/cgroup` and
/// `/proc/<pid>/mountinfo`: the unified one (`0::/path` on a `cgroup2` mount) and a v1 one
/// whose controllers include `cpu` (on a `cgroup` mount with the `cpu` option). A cgroup
/// path outside what its mount shows (another cgroup namespace's) is left out.
pub fn cpu_cgroups(cgroup: &str, mountinfo: &str) -> Vec<CpuCgroup> {
    // (root, mount point, fstype, super options) of every mount.
    let mounts: Vec<(&str, &str, &str, &str)> = mountinfo
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let pre: Vec<&str> = pre.split(' ').collect();
            let mut post = post.split(' ');
            let fstype = post.next()?;
            let _source = post.next()?;
            let opts = post.next().unwrap_or("");
            Some((*pre.get(3)?, *pre.get(4)?, fstype, opts))
        })
        .collect();
    let mut out = Vec::new();
    for line in cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(ctrls), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let v2 = id == "0" && ctrls.is_empty();
        let v1 = !v2 && ctrls.split(',').any(|c| c == "cpu");
        if !v1 && !v2 {
            continue;
        }
        let mount = mounts.iter().find(|(_, _, fstype, opts)| {
            if v2 {
                *fstype == "cgroup2"
            } else {
                *fstype == "cgroup" && opts.split(',').any(|o| o == "cpu")
            }
        });
        let Some(&(root, point, _, _)) = mount else {
            continue;
        };
        let rel = if root == "/" {
            Some(path)
        } else {
            path.strip_prefix(root)
                .filter(|r| r.is_empty() || r.starts_with('/'))
        };
        let Some(rel) = rel else { continue };
        let mount = PathBuf::from(point);
        out.push(CpuCgroup {
            dir: mount.join(rel.trim_start_matches('/')),
            mount,
            v1,
        });
    }
    out
}

/// The quota set on `dir` itself, if any.
fn quota_at(dir: &Path, v1: bool) -> Option<Quota> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let (quota_us, period_us) = if v1 {
        parse_cfs(&read("cpu.cfs_quota_us")?, &read("cpu.cfs_period_us")?)?
    } else {
        parse_cpu_max(&read("cpu.max")?)?
    };
    let ino = std::fs::metadata(dir).ok()?.ino();
    Some(Quota {
        cgroup: if v1 { ino | 1 << 63 } else { ino & !(1 << 63) },
        quota_us,
        period_us,
    })
}

/// The quotas on `c`'s cgroup and its ancestors up to its mount, each with its directory:
/// the cgroups that can throttle this process in that hierarchy.
fn limiting(c: &CpuCgroup) -> impl Iterator<Item = (&Path, Quota)> {
    std::iter::successors(Some(c.dir.as_path()), |d| d.parent())
        .take_while(|d| d.starts_with(&c.mount))
        .filter_map(|d| Some((d, quota_at(d, c.v1)?)))
}

/// The tightest quota on `c`'s cgroup and its ancestors up to its mount.
fn tightest(c: &CpuCgroup) -> Option<Quota> {
    limiting(c).map(|(_, q)| q).reduce(Quota::tighter)
}

/// This process's cgroups in the hierarchies with the CPU controller (none where
/// `/proc/self/cgroup` or `mountinfo` cannot be read).
fn own_cpu_cgroups() -> Vec<CpuCgroup> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    match (read("/proc/self/cgroup"), read("/proc/self/mountinfo")) {
        (Some(cgroup), Some(mountinfo)) => cpu_cgroups(&cgroup, &mountinfo),
        _ => Vec::new(),
    }
}

/// The time a cgroup's quota has held it throttled, µs, from its `cpu.stat`: cgroup v2
/// `throttled_usec`, v1 `throttled_time` (ns). The kernel sums it over the CPUs the cgroup's
/// tasks were stopped on, so it can exceed the wall time.
fn parse_throttled(stat: &str, v1: bool) -> Option<u64> {
    let key = if v1 {
        "throttled_time"
    } else {
        "throttled_usec"
    };
    let v: u64 = stat
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())?;
    Some(if v1 { v / 1000 } else { v })
}

/// The throttled time of each cgroup with a quota on `c`'s path (its cgroup and its ancestors
/// up to the mount): its identity ([`Quota::cgroup`]) and µs, `None` where its `cpu.stat`
/// cannot be read.
fn throttled_on(c: &CpuCgroup) -> Vec<(u64, Option<u64>)> {
    limiting(c)
        .map(|(d, q)| {
            let us = std::fs::read_to_string(d.join("cpu.stat"))
                .ok()
                .and_then(|s| parse_throttled(&s, c.v1));
            (q.cgroup, us)
        })
        .collect()
}

/// The throttled time of every cgroup whose CPU quota is over this process, so far (each
/// hierarchy's cgroup of this process and its ancestors up to the mount; [`Throttled::since`]
/// compares two). Empty where no quota limits it, or where the files cannot be read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Throttled(Vec<(u64, Option<u64>)>);

/// How long the CPU quotas held a cgroup stopped between two [`Throttled`] snapshots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// No quota over the process.
    NoQuota,
    /// Under a quota, but no cgroup's `cpu.stat` could be read at both ends.
    Unknown,
    /// The most any one limiting cgroup was held, µs (summed by the kernel over its CPUs).
    Us(u64),
}

impl Throttled {
    /// This process's snapshot.
    pub fn now() -> Throttled {
        Throttled(own_cpu_cgroups().iter().flat_map(throttled_on).collect())
    }

    /// How long a cgroup was held since `before`: each cgroup's own difference, the most of
    /// them (a parent's history before the run, larger than its child's, must not hide the
    /// child's throttling).
    pub fn since(&self, before: &Throttled) -> Held {
        if self.0.is_empty() {
            return Held::NoQuota;
        }
        self.0
            .iter()
            .filter_map(|&(id, now)| {
                let then = before.0.iter().find(|&&(b, _)| b == id)?.1?;
                Some(now?.saturating_sub(then))
            })
            .max()
            .map_or(Held::Unknown, Held::Us)
    }
}

/// This process's CPU quota: the tightest of its hierarchies' (none where no cgroup limits
/// it, or where the files cannot be read).
pub fn mine() -> Option<Quota> {
    own_cpu_cgroups()
        .iter()
        .filter_map(tightest)
        .reduce(Quota::tighter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quota_files_parse() {
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(parse_cpu_max("150000 100000\n"), Some((150_000, 100_000)));
        assert_eq!(parse_cpu_max("50000"), Some((50_000, 100_000)));
        assert_eq!(parse_cpu_max("0 100000"), None);
        assert_eq!(parse_cpu_max("x 1"), None);
        assert_eq!(parse_cpu_max(""), None);
        assert_eq!(parse_cfs("-1\n", "100000\n"), None);
        assert_eq!(parse_cfs("200000\n", "100000\n"), Some((200_000, 100_000)));
        assert_eq!(parse_cfs("200000", "0"), None);
        let q = |quota_us, period_us| Quota {
            cgroup: 1,
            quota_us,
            period_us,
        };
        // 1.5 CPUs: one or two busy ranks... two want more.
        assert!(!q(150_000, 100_000).exceeded_by(1));
        assert!(q(150_000, 100_000).exceeded_by(2));
        assert!(!q(200_000, 100_000).exceeded_by(2));
        assert!(q(50_000, 100_000).tighter_than(&q(60_000, 100_000)));
        assert!(!q(100_000, 50_000).tighter_than(&q(150_000, 100_000)));
        assert_eq!(q(250_000, 100_000).cpus(), 2.5);
        assert_eq!(cpus_text(1.0), "1 CPU");
        assert_eq!(cpus_text(2.0), "2 CPUs");
        assert_eq!(cpus_text(1.5), "1.5 CPUs");
        assert_eq!(cpus_text(1.0 / 3.0), "0.33 CPUs");
        assert_eq!(cpus_text(0.999), "1 CPU");
        assert_eq!(cpus_text(10.0), "10 CPUs");
        assert_eq!(parse_throttled("throttled_usec 12\n", false), Some(12));
        assert_eq!(parse_throttled("throttled_time 12999\n", true), Some(12));
        assert_eq!(
            parse_throttled("nr_bursts 0\nthrottled_usec_x 5\nthrottled_usec 7", false),
            Some(7)
        );
        assert_eq!(parse_throttled("throttled_time 5\n", false), None);
        assert_eq!(parse_throttled("throttled_usec x\n", false), None);
        assert_eq!(parse_throttled("", true), None);
    }

    const MOUNTINFO: &str = "\
22 1 0:21 / /sys rw,nosuid - sysfs sysfs rw
30 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw
35 30 0:31 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
36 30 0:32 / /sys/fs/cgroup/cpuset rw,nosuid - cgroup cgroup rw,cpuset
";

    #[test]
    fn the_cpu_hierarchies_are_found_under_their_mounts() {
        let cgroup = "\
12:cpuset:/job
4:cpu,cpuacct:/kubepods/pod1/c1
0::/user.slice/s1
";
        let v = cpu_cgroups(cgroup, MOUNTINFO);
        assert_eq!(
            v,
            vec![
                CpuCgroup {
                    dir: "/sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/c1".into(),
                    mount: "/sys/fs/cgroup/cpu,cpuacct".into(),
                    v1: true,
                },
                CpuCgroup {
                    dir: "/sys/fs/cgroup/unified/user.slice/s1".into(),
                    mount: "/sys/fs/cgroup/unified".into(),
                    v1: false,
                },
            ]
        );
        // A container with its own cgroup namespace: the mount's root is its cgroup, which it
        // sees as "/".
        let pure_v2 = "40 30 0:27 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cpu_cgroups("0::/kubepods/pod1/c1\n", pure_v2)[0].dir,
            PathBuf::from("/sys/fs/cgroup/c1")
        );
        assert_eq!(
            cpu_cgroups(
                "0::/\n",
                "40 30 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
            )[0]
            .dir,
            PathBuf::from("/sys/fs/cgroup/")
        );
        // Outside the mount's root (another namespace's cgroup), or no mount at all: nothing.
        assert!(cpu_cgroups("0::/other/c1\n", pure_v2).is_empty());
        assert!(cpu_cgroups("0::/kubepods/pod10\n", pure_v2).is_empty());
        assert!(cpu_cgroups("3:cpu:/x\n", "").is_empty());
        assert!(cpu_cgroups("garbage\n::\n1:cpuacct:/x\n", MOUNTINFO).is_empty());
    }

    /// What this machine says: a quota found is a real one, on one of this process's
    /// hierarchies (most development machines and CI runners have none; tests/crowd.rs
    /// makes one and checks what ranks in it say).
    #[test]
    fn this_process_quota_if_any_is_well_formed() {
        if let Some(q) = mine() {
            assert!(q.quota_us > 0 && q.period_us > 0, "{q:?}");
        }
    }

    /// The walk up a cgroup tree, on a tree of plain files: the tightest quota of the cgroup
    /// and its ancestors up to the mount wins, a limit above the mount does not count, and
    /// the winner is named by its directory's inode (v1 ones with the top bit).
    #[test]
    fn the_tightest_quota_up_to_the_mount_wins() {
        let tmp = std::env::temp_dir().join(format!("dspark-quota-walk-{}", std::process::id()));
        let put = |rel: &str, name: &str, text: &str| {
            let d = tmp.join(rel);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join(name), text).unwrap();
        };
        let ino = |rel: &str| std::fs::metadata(tmp.join(rel)).unwrap().ino();
        let cg = |dir: &str, mount: &str, v1: bool| CpuCgroup {
            dir: tmp.join(dir),
            mount: tmp.join(mount),
            v1,
        };
        // v2: 0.5 CPU above the mount (not ours), none at the mount, 1.5 on a, 2 on a/b.
        put("v2", "cpu.max", "50000 100000\n");
        put("v2/cg", "cpu.max", "max 100000\n");
        put("v2/cg/a", "cpu.max", "150000 100000\n");
        put("v2/cg/a/b", "cpu.max", "200000 100000\n");
        let v2 = cg("v2/cg/a/b", "v2/cg", false);
        let want = Quota {
            cgroup: ino("v2/cg/a"),
            quota_us: 150_000,
            period_us: 100_000,
        };
        assert_eq!(tightest(&v2), Some(want));
        // Throttled time: each limiting cgroup's (a cgroup without a quota, or above the
        // mount, does not count; one whose cpu.stat says nothing is unknown).
        put("v2", "cpu.stat", "throttled_usec 999999\n");
        put("v2/cg", "cpu.stat", "throttled_usec 888888\n");
        put(
            "v2/cg/a",
            "cpu.stat",
            "usage_usec 5\nnr_throttled 3\nthrottled_usec 4200\n",
        );
        let (a, b) = (ino("v2/cg/a"), ino("v2/cg/a/b"));
        assert_eq!(throttled_on(&v2), vec![(b, None), (a, Some(4200))]);
        let before = Throttled(throttled_on(&v2));
        assert_eq!(Throttled(throttled_on(&v2)).since(&before), Held::Us(0));
        // The child is held 300 µs more, its parent (with a longer history) 100: the child's
        // 300, not a difference of the largest counters.
        put("v2/cg/a", "cpu.stat", "throttled_usec 4300\n");
        put("v2/cg/a/b", "cpu.stat", "throttled_usec 1000\n");
        let mid = Throttled(throttled_on(&v2));
        assert_eq!(mid.since(&before), Held::Us(100));
        put("v2/cg/a/b", "cpu.stat", "throttled_usec 1300\n");
        assert_eq!(Throttled(throttled_on(&v2)).since(&mid), Held::Us(300));
        assert_eq!(
            Throttled(vec![(b, None)]).since(&Throttled(vec![(b, Some(1))])),
            Held::Unknown
        );
        assert_eq!(Throttled::default().since(&mid), Held::NoQuota);
        // v1: none on x, 0.25 CPU (25 ms per 100 ms) on the mount itself.
        put("v1/cpu", "cpu.cfs_quota_us", "25000\n");
        put("v1/cpu", "cpu.cfs_period_us", "100000\n");
        put("v1/cpu/x", "cpu.cfs_quota_us", "-1\n");
        put("v1/cpu/x", "cpu.cfs_period_us", "100000\n");
        let v1 = cg("v1/cpu/x", "v1/cpu", true);
        put(
            "v1/cpu",
            "cpu.stat",
            "nr_periods 9\nnr_throttled 2\nthrottled_time 7000500\n",
        );
        assert_eq!(
            throttled_on(&v1),
            vec![(ino("v1/cpu") | 1 << 63, Some(7000))]
        );
        let got = tightest(&v1).unwrap();
        assert_eq!((got.quota_us, got.period_us), (25_000, 100_000));
        assert_eq!(got.cgroup, ino("v1/cpu") | 1 << 63);
        // Nothing set anywhere: none.
        put("none/cg/a", "cpu.max", "max 100000\n");
        let none = cg("none/cg/a", "none/cg", false);
        assert_eq!(tightest(&none), None);
        assert!(throttled_on(&none).is_empty());
        // The wire form round-trips, and junk is no quota.
        assert_eq!(Quota::decode(&want.encode()), Some(want));
        for junk in ["", "1 2", "1 0 100000", "1 2 3 4", "a b c", "1  2 3"] {
            assert_eq!(Quota::decode(junk), None, "{junk:?}");
        }
        let _ = std::fs::remove_dir_all(&tmp);
    }
}
