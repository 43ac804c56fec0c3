//! CPU binding of dspark-bench's ranks (`--bind none|core|numa`), as mpirun binds its ranks:
//! local ranks spawned by the bench get distinct cores — the NIC's NUMA node first, first
//! hardware threads before their siblings — or a NUMA node each; a rank started by a
//! launcher keeps the binding it found, and the header reports what every rank runs on.

use std::path::Path;

use clap::ValueEnum;
use nix::sched::{sched_setaffinity, CpuSet};
use nix::unistd::Pid;

pub(crate) use dspark::internals::cpus::{allowed, format_list, parse_list};

/// Environment variable that carries a spawned rank's CPUs (`0,2`), set by the parent.
pub(crate) const CPUS_ENV: &str = "DSPARK_BENCH_CPUS";

/// The launchers' rank variables: a rank spawned by a tool (dspark-bench, dspark tune) must
/// not take them from the tool's own environment for its own (the tool may itself run under
/// torchrun, mpirun or srun).
pub(crate) const LAUNCHER_VARS: [&str; 10] = [
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
];

/// How the bench binds the local ranks it spawns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Bind {
    /// No binding: the kernel places every rank.
    None,
    /// One core per rank (one hardware thread); none when ranks outnumber the CPUs.
    Core,
    /// One NUMA node per rank (all its CPUs), round-robin.
    Numa,
}

impl Bind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Bind::None => "none",
            Bind::Core => "core",
            Bind::Numa => "numa",
        }
    }
}

/// Binds this process to `cpus`.
pub(crate) fn bind_to(cpus: &[usize]) -> Result<(), String> {
    let mut set = CpuSet::new();
    for &c in cpus {
        set.set(c).map_err(|e| format!("cpu {c}: {e}"))?;
    }
    sched_setaffinity(Pid::from_raw(0), &set).map_err(|e| format!("sched_setaffinity: {e}"))
}

fn read(p: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(p).ok()
}

/// The machine's NUMA nodes as (node, CPUs), from sysfs (one node with every CPU when the
/// kernel exposes none).
fn numa_nodes(root: &Path) -> Vec<(usize, Vec<usize>)> {
    let mut nodes: Vec<(usize, Vec<usize>)> = std::fs::read_dir(root.join("devices/system/node"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let n = name.strip_prefix("node")?.parse().ok()?;
            Some((n, parse_list(&read(e.path().join("cpulist"))?)))
        })
        .collect();
    nodes.sort();
    nodes
}

/// The NUMA node of the first RDMA device that reports one.
fn nic_node(root: &Path) -> Option<usize> {
    let mut devs: Vec<_> = std::fs::read_dir(root.join("class/infiniband"))
        .ok()?
        .flatten()
        .map(|e| e.path())
        .collect();
    devs.sort();
    devs.iter()
        .filter_map(|d| read(d.join("device/numa_node"))?.trim().parse::<i64>().ok())
        .find(|&n| n >= 0)
        .map(|n| n as usize)
}

/// Position of `cpu` among its core's hardware threads (0: the first thread).
fn thread_index(root: &Path, cpu: usize) -> usize {
    read(root.join(format!(
        "devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
    )))
    .map(|s| parse_list(&s))
    .and_then(|sib| sib.iter().position(|&c| c == cpu))
    .unwrap_or(0)
}

/// The CPUs of each of `ranks` local ranks under `mode`, from the CPUs this process may use
/// and the machine's topology under `root` (`/sys`); `None` for [`Bind::None`] or when there
/// is nothing to bind to.
pub(crate) fn plan(
    mode: Bind,
    ranks: usize,
    allowed: &[usize],
    root: &Path,
) -> Option<Vec<Vec<usize>>> {
    if mode == Bind::None || allowed.is_empty() || ranks == 0 {
        return None;
    }
    let nic = nic_node(root);
    let mut nodes: Vec<(usize, Vec<usize>)> = numa_nodes(root)
        .into_iter()
        .map(|(n, cpus)| {
            (
                n,
                cpus.into_iter().filter(|c| allowed.contains(c)).collect(),
            )
        })
        .filter(|(_, cpus): &(usize, Vec<usize>)| !cpus.is_empty())
        .collect();
    if nodes.is_empty() {
        nodes.push((0, allowed.to_vec()));
    }
    // The NIC's node first: ranks talk to the NIC, as NCCL and mpirun's defaults prefer.
    nodes.sort_by_key(|(n, _)| (Some(*n) != nic, *n));
    match mode {
        Bind::None => None,
        Bind::Numa => Some(
            (0..ranks)
                .map(|r| nodes[r % nodes.len()].1.clone())
                .collect(),
        ),
        Bind::Core => {
            let mut order: Vec<(usize, usize, usize)> = nodes
                .iter()
                .enumerate()
                .flat_map(|(rank_of_node, (_, cpus))| {
                    cpus.iter()
                        .map(move |&c| (rank_of_node, c))
                        .collect::<Vec<_>>()
                })
                .map(|(k, c)| (thread_index(root, c), k, c))
                .collect();
            // First threads of every core (NIC node first) before any sibling thread.
            order.sort();
            if ranks > order.len() {
                // Oversubscribed: pinning two ranks to one CPU forbids the kernel to move
                // either when the other spins; mpirun does not bind then either.
                return None;
            }
            Some((0..ranks).map(|r| vec![order[r % order.len()].2]).collect())
        }
    }
}

/// A CPU set as 16 words (CPUs 0..1024), for gathering every rank's binding.
pub(crate) fn to_words(cpus: &[usize]) -> [u64; 16] {
    let mut w = [0u64; 16];
    for &c in cpus.iter().filter(|&&c| c < 1024) {
        w[c / 64] |= 1 << (c % 64);
    }
    w
}

/// The CPUs of a word set.
pub(crate) fn from_words(w: &[u64]) -> Vec<usize> {
    (0..w.len() * 64)
        .filter(|&c| w[c / 64] & (1 << (c % 64)) != 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_words_round_trip() {
        assert_eq!(
            from_words(&to_words(&[0, 63, 64, 1023])),
            vec![0, 63, 64, 1023]
        );
    }

    /// A fake sysfs: two nodes of two cores with two threads each, the NIC on node 1.
    #[test]
    fn core_binding_prefers_the_nics_node_and_first_threads() {
        let root = std::env::temp_dir().join(format!("dspark-bind-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let w = |p: &str, s: &str| {
            let p = root.join(p);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, s).unwrap();
        };
        // node 0: cpus 0,1 (core 0) and 4,5 (core 1): threads 0/4 and 1/5 are siblings.
        w("devices/system/node/node0/cpulist", "0-1,4-5");
        w("devices/system/node/node1/cpulist", "2-3,6-7");
        for (a, b) in [(0, 4), (1, 5), (2, 6), (3, 7)] {
            for c in [a, b] {
                w(
                    &format!("devices/system/cpu/cpu{c}/topology/thread_siblings_list"),
                    &format!("{a},{b}"),
                );
            }
        }
        w("class/infiniband/mlx5_0/device/numa_node", "1");
        let all: Vec<usize> = (0..8).collect();
        let p = plan(Bind::Core, 5, &all, &root).unwrap();
        assert_eq!(p, vec![vec![2], vec![3], vec![0], vec![1], vec![6]]);
        assert_eq!(
            plan(Bind::Core, 9, &all, &root),
            None,
            "oversubscribed: not bound"
        );
        let p = plan(Bind::Numa, 3, &all, &root).unwrap();
        assert_eq!(
            p,
            vec![vec![2, 3, 6, 7], vec![0, 1, 4, 5], vec![2, 3, 6, 7]]
        );
        // Only the CPUs this process may use.
        let p = plan(Bind::Core, 2, &[0, 4], &root).unwrap();
        assert_eq!(p, vec![vec![0], vec![4]]);
        assert_eq!(plan(Bind::None, 2, &all, &root), None);
        let _ = std::fs::remove_dir_all(&root);
    }
}
