//! Whether this rank shares its CPUs with other ranks (whether it is *oversubscribed*), which
//! decides how long it busy-polls before it sleeps and whether it yields the CPU meanwhile
//! ([`super::engine_options`]).
//!
//! Every rank announces where it sits (a [`Seat`]): its kernel's boot id and the CPUs it may
//! run on (its affinity mask), in one all-gather at init. The ranks of this rank's kernel
//! whose CPUs overlap its own are its crowd ([`crowd`]); more of them than CPUs in the union of
//! their masks share CPUs.
//!
//! Why not count the ranks of this host against its cores, as before:
//! - the host identity is not the machine: "hosts" that are network namespaces or containers
//!   of one kernel (`benches/link_bed.sh`'s, pods on one node) each count their own ranks and
//!   none of them sees that 4 ranks run on 2 cores. A 1 KiB all_reduce on that bed took 75 µs
//!   with the 50 µs busy spin of ranks with a core each, 24 µs with a 5 µs spin;
//! - a rank's own mask does not say whether another rank was bound to the same CPUs: two ranks
//!   that `taskset -c 0` put on one core each see one allowed CPU, which is what a launcher
//!   that binds every rank to its own core gives too. On one core, a busy spin holds it from
//!   the very rank it waits for: an 8-byte all_reduce took 52 µs (shm) against 4.7 µs with a
//!   2 µs spin.

#![forbid(unsafe_code)]

use nix::sched::{sched_getaffinity, CpuSet};
use nix::unistd::Pid;

use super::quota::{self, Quota};

/// The largest CPU number a seat may name (a peer's larger one makes its seat unknown).
pub const MAX_CPU: usize = 1 << 16;
/// The longest boot id a seat carries (a kernel's is 36 characters).
const MAX_BOOT_ID: usize = 64;

/// The kernel's boot id (empty where it cannot be read): two "hosts" with one host identity
/// but different boot ids are two machines (the shared-memory offer), and "hosts" with
/// different identities but one boot id are one machine (the seats here).
pub(crate) fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The CPUs this process may run on (empty where the kernel does not say).
pub fn allowed() -> Vec<usize> {
    match sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..CpuSet::count())
            .filter(|&c| set.is_set(c).unwrap_or(false))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// CPUs as inclusive ranges, sorted, disjoint and not touching (`0-3,8` is `[(0, 3), (8, 8)]`):
/// a mask of thousands of CPUs stays a few numbers, and a peer's text costs memory in
/// proportion to its length, never to the CPU numbers it names.
pub type Ranges = Vec<(usize, usize)>;

/// Sorts and merges `v` into [`Ranges`].
fn normalize(mut v: Ranges) -> Ranges {
    v.sort_unstable();
    let mut out: Ranges = Vec::with_capacity(v.len());
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1.saturating_add(1) => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// Parses a kernel CPU list (`0-3,8,10-11`), leaving out the parts that do not parse and
/// CPUs from [`MAX_CPU`] on.
pub fn parse_ranges(s: &str) -> Ranges {
    let parts = s.trim().split(',').filter(|p| !p.is_empty());
    normalize(
        parts
            .filter_map(|part| {
                let (a, b) = part.split_once('-').unwrap_or((part, part));
                let (a, b) = (
                    a.trim().parse::<usize>().ok()?,
                    b.trim().parse::<usize>().ok()?,
                );
                (a <= b && b < MAX_CPU).then_some((a, b))
            })
            .collect(),
    )
}

/// The ranges of a set of CPUs.
pub fn ranges_of(cpus: &[usize]) -> Ranges {
    normalize(cpus.iter().map(|&c| (c, c)).collect())
}

/// How many CPUs `r` holds.
pub fn count(r: &[(usize, usize)]) -> usize {
    r.iter().map(|&(a, b)| b - a + 1).sum()
}

/// Formats ranges as a kernel CPU list (`0-3,8`).
pub fn format_ranges(r: &[(usize, usize)]) -> String {
    let part = |&(a, b): &(usize, usize)| {
        if a == b {
            a.to_string()
        } else {
            format!("{a}-{b}")
        }
    };
    r.iter().map(part).collect::<Vec<_>>().join(",")
}

/// Parses a kernel CPU list into sorted, distinct CPUs ([`parse_ranges`]).
pub fn parse_list(s: &str) -> Vec<usize> {
    parse_ranges(s)
        .into_iter()
        .flat_map(|(a, b)| a..=b)
        .collect()
}

/// Formats CPUs as a kernel CPU list (`0-3,8`).
pub fn format_list(cpus: &[usize]) -> String {
    format_ranges(&ranges_of(cpus))
}

/// Where a rank sits: its kernel, the CPUs it may run on and its cgroup's CPU quota.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seat {
    /// `/proc/sys/kernel/random/boot_id` (empty: unknown).
    pub boot_id: String,
    /// The allowed CPUs (empty: unknown).
    pub cpus: Ranges,
    /// The CPU quota of its cgroup (`src/comm/setup/quota.rs`), if any.
    pub quota: Option<Quota>,
}

impl Seat {
    /// This process's seat.
    pub fn mine() -> Seat {
        Seat {
            quota: quota::mine(),
            ..Seat::new(boot_id(), ranges_of(&allowed()))
        }
    }

    /// A seat, its boot id cut to 64 bytes (a CPU from [`MAX_CPU`] on makes its CPUs unknown).
    pub fn new(boot_id: String, cpus: Ranges) -> Seat {
        let mut boot_id = boot_id;
        if boot_id.len() > MAX_BOOT_ID {
            let mut cut = MAX_BOOT_ID;
            while !boot_id.is_char_boundary(cut) {
                cut -= 1;
            }
            boot_id.truncate(cut);
        }
        let mut cpus = normalize(cpus);
        if cpus.iter().any(|&(a, b)| a > b || b >= MAX_CPU) {
            cpus.clear();
        }
        Seat {
            boot_id,
            cpus,
            quota: None,
        }
    }

    /// The wire form: the boot id, a newline, the CPU list, and where a quota limits it, a
    /// newline and the quota (`cgroup quota_us period_us`).
    pub fn encode(&self) -> Vec<u8> {
        let mut s = format!("{}\n{}", self.boot_id, format_ranges(&self.cpus));
        if let Some(q) = self.quota {
            s += &format!("\n{}", q.encode());
        }
        s.into_bytes()
    }

    /// What a rank sent, whatever the bytes: a malformed message is an unknown seat (its
    /// kernel's ranks then fall back to the host's count, [`crowd`]); a malformed quota, none.
    pub fn decode(bytes: &[u8]) -> Seat {
        let text = String::from_utf8_lossy(bytes);
        let mut lines = text.splitn(3, '\n');
        let (Some(id), Some(list)) = (lines.next(), lines.next()) else {
            return Seat::new(String::new(), Vec::new());
        };
        Seat {
            quota: lines.next().and_then(Quota::decode),
            ..Seat::new(id.to_string(), parse_ranges(list))
        }
    }

    fn known(&self) -> bool {
        !self.boot_id.is_empty() && !self.cpus.is_empty()
    }

    /// Whether the two seats have a CPU in common.
    fn overlaps(&self, other: &Seat) -> bool {
        let (mut i, mut j) = (0, 0);
        while i < self.cpus.len() && j < other.cpus.len() {
            let ((a, b), (c, d)) = (self.cpus[i], other.cpus[j]);
            if a <= d && c <= b {
                return true;
            }
            if b < d {
                i += 1;
            } else {
                j += 1;
            }
        }
        false
    }
}

/// The ranks that share this rank's CPUs, and the CPUs they have between them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Crowd {
    /// Ranks (this one included) whose CPUs overlap this rank's, on its kernel.
    pub ranks: usize,
    /// The union of their masks.
    pub cpus: Ranges,
    /// The ranks whose unknown seats sent it to the host's count; empty where it was decided
    /// from every rank's seat ([`Crowd::by_seats`]).
    pub unknown: Vec<usize>,
    /// This rank's CPU quota and how many ranks of its kernel are under it (this one
    /// included).
    pub quota: Option<(Quota, usize)>,
}

impl Crowd {
    /// How it was decided: from every rank's seat, or (a seat unknown) by the host's count.
    pub fn by_seats(&self) -> bool {
        self.unknown.is_empty()
    }

    /// More ranks than CPUs: they take turns on them.
    pub fn oversubscribed(&self) -> bool {
        self.ranks > count(&self.cpus)
    }

    /// More ranks under this rank's CPU quota than CPUs' worth of time in it: when they all
    /// run (or spin), the kernel stops every one of them for the rest of the period. Not a
    /// reason to spin otherwise (`oversubscribed` is what decides that): with a quota of
    /// 1 CPU for 2 and 4 ranks on 2 cores, no spin policy measured better than the default,
    /// and never spinning was 5–150x slower per call (benches/RESULTS.md, stop 36).
    pub fn over_quota(&self) -> bool {
        self.quota.is_some_and(|(q, n)| q.exceeded_by(n))
    }

    /// In words, for the communicator's info and the bench header.
    pub fn describe(&self) -> String {
        let how = if self.by_seats() {
            String::new()
        } else {
            let rs: Vec<String> = self.unknown.iter().map(usize::to_string).collect();
            format!(
                " (counted by host: the CPUs of rank{} {} are unknown)",
                if rs.len() == 1 { "" } else { "s" },
                rs.join(",")
            )
        };
        let quota = self.quota.map_or(String::new(), |(q, n)| {
            format!(
                "; {n} rank{} under a CPU quota of {} (cgroup){}",
                if n == 1 { "" } else { "s" },
                quota::cpus_text(q.cpus()),
                if q.exceeded_by(n) {
                    ": more than it allows, throttled whenever they all run"
                } else {
                    ""
                }
            )
        });
        if self.ranks <= 1 {
            return format!(
                "no other rank on its CPUs ({}){how}{quota}",
                format_ranges(&self.cpus)
            );
        }
        let n = count(&self.cpus);
        format!(
            "{} ranks on CPU{} {}{}{}{how}{quota}",
            self.ranks,
            if n == 1 { "" } else { "s" },
            format_ranges(&self.cpus),
            if n == 1 {
                String::new()
            } else {
                format!(" ({n} CPUs)")
            },
            if self.oversubscribed() {
                ": oversubscribed"
            } else {
                ""
            },
        )
    }
}

/// The crowd of rank `me` among `seats` (every rank's, in rank order). Where this rank's
/// seat or one on its kernel is unknown, the host rule decides instead: `local` ranks of
/// this host on its `host_cores` online cores, or on this rank's mask where it allows
/// several.
pub fn crowd(me: usize, seats: &[Seat], local: usize, host_cores: usize) -> Crowd {
    // The ranks of this kernel under this rank's quota (the same limiting cgroup).
    let quota = seats.get(me).and_then(|mine| {
        let q = mine.quota?;
        let n = seats
            .iter()
            .filter(|s| s.boot_id == mine.boot_id && s.quota.map(|x| x.cgroup) == Some(q.cgroup))
            .count();
        Some((q, n))
    });
    let by_host = |mine: &Ranges, unknown: Vec<usize>| Crowd {
        ranks: local,
        cpus: if count(mine) > 1 {
            mine.clone()
        } else {
            vec![(0, host_cores.max(1) - 1)]
        },
        unknown,
        quota,
    };
    let Some(mine) = seats.get(me) else {
        return by_host(&ranges_of(&allowed()), vec![me]);
    };
    let same_kernel = || seats.iter().filter(|s| s.boot_id == mine.boot_id);
    let unknown: Vec<usize> = if mine.known() {
        (0..seats.len())
            .filter(|&r| seats[r].boot_id == mine.boot_id && !seats[r].known())
            .collect()
    } else {
        vec![me]
    };
    if !unknown.is_empty() {
        return by_host(&mine.cpus, unknown);
    }
    let crowd: Vec<&Seat> = same_kernel().filter(|s| s.overlaps(mine)).collect();
    Crowd {
        ranks: crowd.len(),
        cpus: normalize(crowd.iter().flat_map(|s| s.cpus.iter().copied()).collect()),
        unknown: Vec::new(),
        quota,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seat(id: &str, cpus: &str) -> Seat {
        Seat::new(id.into(), parse_ranges(cpus))
    }

    #[test]
    fn cpu_lists_parse_and_format() {
        assert_eq!(parse_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_list("x,2,5-3,7-,3,2"), vec![2, 3]);
        assert_eq!(parse_list("65535,65536,1-70000"), vec![65535]);
        assert_eq!(parse_ranges("8,0-3,2-5,7"), vec![(0, 5), (7, 8)]);
        assert_eq!(count(&parse_ranges("0-3,8")), 5);
        assert_eq!(format_list(&[11, 0, 1, 2, 3, 8, 10, 3]), "0-3,8,10-11");
        assert_eq!(format_list(&[]), "");
    }

    #[test]
    fn seats_round_trip_and_any_bytes_decode() {
        let s = seat("5c2e-boot", "0-3,9");
        assert_eq!(Seat::decode(&s.encode()), s);
        assert!(!Seat::decode(b"no newline").known());
        assert!(!Seat::decode(b"id\n0-99999999").known());
        // Any number of ranges merges into what they cover.
        let many = format!("id\n{}", "0-65535,".repeat(10_000));
        assert_eq!(Seat::decode(many.as_bytes()).cpus, vec![(0, MAX_CPU - 1)]);
        assert!(!Seat::decode(&[0xff, b'\n', b'1']).boot_id.is_empty());
        let long = Seat::new("é".repeat(40), vec![(1, 1)]);
        assert!(long.boot_id.len() <= MAX_BOOT_ID);
        assert_eq!(Seat::decode(&long.encode()), long);
    }

    #[test]
    fn ranks_bound_to_their_own_cores_are_alone_and_ranks_on_one_core_are_not() {
        // dspark-bench's or mpirun's binding: one core each.
        let own: Vec<Seat> = (0..4).map(|c| seat("k", &c.to_string())).collect();
        let c = crowd(1, &own, 4, 4);
        assert_eq!(
            (c.ranks, c.cpus.clone(), c.oversubscribed()),
            (1, vec![(1, 1)], false)
        );
        // `taskset -c 0` for two ranks: each sees one allowed CPU, as above, but they share it.
        let one = vec![seat("k", "0"), seat("k", "0")];
        let c = crowd(0, &one, 2, 2);
        assert_eq!((c.ranks, count(&c.cpus), c.oversubscribed()), (2, 1, true));
        // Two cores for two unbound ranks: not sharing; for four: sharing.
        let two = vec![seat("k", "0-1"); 2];
        assert!(!crowd(0, &two, 2, 2).oversubscribed());
        let four = vec![seat("k", "0-1"); 4];
        assert!(crowd(3, &four, 4, 64).oversubscribed());
    }

    #[test]
    fn hosts_of_one_kernel_are_one_machine_and_other_kernels_do_not_count() {
        // Two "hosts" (namespaces) of one kernel with 2 ranks each, all on CPUs 0-1: each host
        // counts 2 ranks on 2 cores, but the 4 share them.
        let bed = vec![seat("k", "0-1"); 4];
        assert!(crowd(0, &bed, 2, 2).oversubscribed());
        // Pinned a host to a core each: ranks 0, 1 on CPU 0 and 2, 3 on CPU 1.
        let pinned = vec![
            seat("k", "0"),
            seat("k", "0"),
            seat("k", "1"),
            seat("k", "1"),
        ];
        let c = crowd(2, &pinned, 2, 2);
        assert_eq!(
            (c.ranks, c.cpus.clone(), c.oversubscribed()),
            (2, vec![(1, 1)], true)
        );
        // Two machines with the same CPU numbers: nothing shared.
        let two_machines = vec![seat("a", "0"), seat("b", "0")];
        assert!(!crowd(0, &two_machines, 1, 1).oversubscribed());
        // Overlapping masks: rank 2 on CPUs 1-2 shares none of rank 0's CPU 0.
        let mixed = vec![seat("k", "0"), seat("k", "0"), seat("k", "1-2")];
        assert!(crowd(0, &mixed, 3, 3).oversubscribed());
        assert!(!crowd(2, &mixed, 3, 3).oversubscribed());
    }

    /// The host rule that decides when a seat is unknown: the assertions of the rule it
    /// replaced (`oversubscribed(local, host, allowed)` in setup), kept.
    #[test]
    fn the_host_rule_counts_a_mask_of_one_as_the_hosts_cores() {
        // This rank's seat known (`allowed` CPUs), another of its kernel unknown.
        let rule = |local: usize, host: usize, allowed: usize| {
            let mine = Seat::new("k".into(), vec![(0, allowed - 1)]);
            let seats = vec![mine, Seat::new("k".into(), Vec::new())];
            let c = crowd(0, &seats, local, host);
            assert!(!c.by_seats());
            c.oversubscribed()
        };
        // 2 ranks on 2 cores, each bound to its own (mask of 1): not sharing.
        assert!(!rule(2, 2, 1));
        // Unbound: the host's cores decide.
        assert!(!rule(2, 2, 2));
        assert!(rule(4, 2, 2));
        assert!(rule(4, 2, 1));
        // Four ranks confined to 2 of 64 CPUs share them.
        assert!(rule(4, 64, 2));
        assert!(!rule(4, 64, 1));
    }

    #[test]
    fn a_quota_travels_with_the_seat_and_counts_the_ranks_under_it() {
        let q = |cgroup, cpus: u64| Quota {
            cgroup,
            quota_us: cpus * 50_000,
            period_us: 100_000,
        };
        let with = |cpus: &str, quota| Seat {
            quota,
            ..seat("k", cpus)
        };
        let s = with("0-63", Some(q(7, 3)));
        assert_eq!(Seat::decode(&s.encode()), s);
        // A malformed quota line is no quota; the rest of the seat stands.
        for bad in [
            "k\n0-3\n7 0 100000",
            "k\n0-3\nx 1 2",
            "k\n0-3\n1 2",
            "k\n0-3\n",
        ] {
            let d = Seat::decode(bad.as_bytes());
            assert_eq!((d.quota, d.cpus.clone()), (None, vec![(0, 3)]), "{bad:?}");
        }
        // 4 ranks on 64 CPUs, 3 of them in a pod whose quota is 1.5 CPUs, one elsewhere with
        // its own: the mask says no sharing, the quota says 3 ranks for 1.5 CPUs.
        let seats = vec![
            with("0-63", Some(q(7, 3))),
            with("0-63", Some(q(7, 3))),
            with("0-63", Some(q(7, 3))),
            with("0-63", Some(q(9, 3))),
        ];
        let c = crowd(0, &seats, 4, 64);
        assert!(!c.oversubscribed() && c.over_quota());
        assert_eq!(c.quota, Some((q(7, 3), 3)));
        assert!(
            c.describe().ends_with(
                "; 3 ranks under a CPU quota of 1.5 CPUs (cgroup): more than it allows, \
                 throttled whenever they all run"
            ),
            "{}",
            c.describe()
        );
        // The one in its own cgroup: alone under 1.5 CPUs.
        let c = crowd(3, &seats, 4, 64);
        assert!(!c.over_quota());
        assert!(
            c.describe()
                .ends_with("; 1 rank under a CPU quota of 1.5 CPUs (cgroup)"),
            "{}",
            c.describe()
        );
        // The same cgroup number on another kernel is another cgroup.
        let other = vec![
            with("0", Some(q(7, 2))),
            Seat {
                boot_id: "other".into(),
                ..with("0", Some(q(7, 2)))
            },
        ];
        assert!(!crowd(0, &other, 1, 1).over_quota());
        // No quota: nothing said.
        assert!(!crowd(0, &[seat("k", "0")], 1, 1)
            .describe()
            .contains("quota"));
    }

    #[test]
    fn an_unknown_seat_falls_back_to_the_host_count() {
        let seats = vec![seat("k", "0"), Seat::decode(b"garbage"), seat("k", "1")];
        // Rank 1's seat is unknown, and not of kernel "k": ranks 0 and 2 decide by seats.
        assert!(crowd(0, &seats, 3, 2).by_seats());
        // Rank 1 itself: by the host, 3 ranks on 2 cores.
        let c = crowd(1, &seats, 3, 2);
        assert!(!c.by_seats() && c.oversubscribed());
        assert_eq!(c.unknown, vec![1]);
        // A rank of this kernel without CPUs: by the host, naming it.
        let seats = vec![seat("k", "0-3"), Seat::new("k".into(), Vec::new())];
        let c = crowd(0, &seats, 2, 4);
        assert!(!c.by_seats() && !c.oversubscribed());
        assert_eq!(c.unknown, vec![1]);
        assert!(
            c.describe()
                .contains("counted by host: the CPUs of rank 1 are unknown"),
            "{}",
            c.describe()
        );
        assert!(crowd(0, &[seat("k", "0")], 1, 2).unknown.is_empty());
    }
}
