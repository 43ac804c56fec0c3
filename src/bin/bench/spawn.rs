//! How dspark-bench's ranks start: spawned here as local copies of this program on
//! 127.0.0.1 (`--ranks`, or no launcher around), each with the CPU binding the parent planned,
//! or as one rank of a launcher (torchrun, srun, mpirun); and the header's binding line, every
//! rank's CPUs gathered right after init. How the spawner waits for its ranks, and ends them
//! when one fails: `supervise`.

use std::process::{Command, ExitCode, Stdio};

use dspark::config::{LAUNCHER_RANK_VARS as RANK_VARS, SLURM_STEP_VARS};
use dspark::Communicator;

use crate::bind::{self, Bind};
use crate::distance;
use crate::supervise;
use crate::Args;

/// A launcher's word that it started this process as one rank of a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Launched {
    /// The rank variable that says so, and its value.
    pub(crate) rank: (&'static str, String),
    /// The world-size variable and its value, when one is set.
    pub(crate) world: Option<(&'static str, String)>,
}

impl Launched {
    /// The number of ranks the launcher started, when its variable says.
    pub(crate) fn world_size(&self) -> Option<usize> {
        self.world.as_ref().and_then(|(_, v)| v.trim().parse().ok())
    }

    /// `OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2`.
    pub(crate) fn vars(&self) -> String {
        let mut s = format!("{}={}", self.rank.0, self.rank.1.trim());
        if let Some((k, v)) = &self.world {
            s += &format!(", {k}={}", v.trim());
        }
        s
    }

    /// Every launcher variable set, to clear for a job of one's own (`RANK WORLD_SIZE`).
    pub(crate) fn set_names(get: impl Fn(&str) -> Option<String>) -> Vec<&'static str> {
        RANK_VARS
            .iter()
            .flat_map(|(r, w)| [*r, *w])
            .filter(|v| get(v).is_some())
            .collect()
    }
}

/// Whether a launcher (torchrun, mpirun, srun, or DSPARK_RANK by hand) started this process
/// as one rank, read through `get` (the environment): the rank variable `Config::from_env`
/// would take, with the world size beside it. Slurm's count only inside a job step (srun
/// sets `SLURM_STEP_ID`): an allocation's shell has `SLURM_NTASKS`, and a batch script
/// `SLURM_PROCID=0` as well, without being one of the tasks.
pub(crate) fn launched_by(get: impl Fn(&str) -> Option<String>) -> Option<Launched> {
    let set = |v: &str| get(v).filter(|x| !x.trim().is_empty());
    let in_step = SLURM_STEP_VARS.iter().any(|v| set(v).is_some());
    let usable = |v: &&(&str, &str)| in_step || !v.0.starts_with("SLURM_");
    let (rank_var, _) = RANK_VARS
        .iter()
        .filter(usable)
        .find(|(r, _)| set(r).is_some())?;
    let world = RANK_VARS
        .iter()
        .filter(usable)
        .find_map(|(_, w)| set(w).map(|v| (*w, v)));
    Some(Launched {
        rank: (rank_var, set(rank_var).unwrap_or_default()),
        world,
    })
}

/// [`launched_by`] over this process's environment.
pub(crate) fn launched() -> Option<Launched> {
    launched_by(|k| std::env::var(k).ok())
}

/// Why `--ranks` is refused here, if it is: a launcher started this process as one of
/// several ranks, so every rank would spawn a job of its own (`mpirun -np 2 dspark-bench
/// --ranks 2` ran two unrelated 2-rank jobs). A launcher's job of one rank (`srun -n 1`)
/// may spawn local ranks: nothing else runs them.
pub(crate) fn ranks_refused(ranks: usize, get: impl Fn(&str) -> Option<String>) -> Option<String> {
    let l = launched_by(&get)?;
    if l.world_size() == Some(1) {
        return None;
    }
    Some(format!(
        "--ranks {ranks}: a launcher started this process as one of its ranks ({}), and \
         every rank would spawn a job of its own: under a launcher, run without --ranks (its \
         -np, --nproc-per-node or --ntasks sets the ranks); for a local job from inside a \
         rank, clear its variables: env -u {} dspark-bench --ranks {ranks} ...",
        l.vars(),
        Launched::set_names(&get).join(" -u ")
    ))
}

/// Set in the ranks [`spawn_local`] starts, so they run as ranks rather than spawn again.
pub(crate) const CHILD: &str = "DSPARK_BENCH_CHILD";

/// Spawns `n` copies of this program as ranks on 127.0.0.1; rank 0's output is the table.
pub(crate) fn spawn_local(args: &Args, n: usize) -> ExitCode {
    if n == 0 {
        eprintln!("dspark-bench: --ranks must be at least 1");
        return ExitCode::from(2);
    }
    let port = match std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(a) => a.port(),
        Err(e) => {
            eprintln!("dspark-bench: cannot find a free port: {e}");
            return ExitCode::from(1);
        }
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("dspark-bench: cannot find my own executable: {e}");
            return ExitCode::from(1);
        }
    };
    // A random secret per job, which only these children know (a process's environment is
    // readable by its own user only): a stranger that reaches the port cannot join.
    let secret = match dspark::internals::trust::spawner_secret() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("dspark-bench: cannot draw the job's secret from /dev/urandom: {e}");
            return ExitCode::from(1);
        }
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let plan = bind::plan(args.bind, n, &bind::allowed(), std::path::Path::new("/sys"));
    let distances = plan.as_deref().map(distances_from_rank0);
    let parent = std::process::id().to_string();
    let mut children = Vec::new();
    for r in 0..n {
        let mut cmd = Command::new(&exe);
        match &plan {
            Some(p) => cmd.env(bind::CPUS_ENV, bind::format_list(&p[r])),
            // Asked for but impossible: say why in the header.
            None if args.bind != Bind::None => cmd.env(bind::CPUS_ENV, ""),
            None => cmd.env_remove(bind::CPUS_ENV),
        };
        cmd.args(&argv)
            .env(CHILD, "1")
            .env(supervise::PARENT_ENV, &parent)
            .env("DSPARK_RANK", r.to_string())
            .env("DSPARK_WORLD_SIZE", n.to_string())
            .env("DSPARK_ROOT_ADDR", format!("127.0.0.1:{port}"))
            .env(dspark::internals::trust::SPAWNER_SECRET_ENV, &secret)
            .env(DISTANCE_ENV, distances.as_deref().unwrap_or(""))
            .stdin(Stdio::null())
            .stdout(if r == 0 {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .stderr(Stdio::inherit());
        for v in bind::LAUNCHER_VARS {
            cmd.env_remove(v);
        }
        // A flag given beats the environment (the children inherit DSPARK_TRANSPORT and
        // DSPARK_DATA_PATH otherwise), as in a launcher's ranks (`run_rank`).
        if let Some(t) = &args.transport {
            cmd.env("DSPARK_TRANSPORT", t);
        }
        if let Some(p) = args.path {
            cmd.env("DSPARK_DATA_PATH", p.name());
        }
        match cmd.spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                eprintln!("dspark-bench: cannot start rank {r}: {e}");
                for mut c in children {
                    let _ = c.kill();
                }
                return ExitCode::from(1);
            }
        }
    }
    ExitCode::from(supervise::supervise(children))
}

/// Carries the header's distance line from the spawning parent to its ranks (empty: none).
pub(crate) const DISTANCE_ENV: &str = "DSPARK_BENCH_DISTANCE";

/// The header's distance line: a cache line's round trip between rank 0's first CPU and the
/// first CPU of every other rank on another CPU (at most 7), measured here before the ranks
/// start, so that each run says where the machine put its ranks this time (a VM's host
/// moves its vCPUs: 0.045 or 0.35 µs apart on this project's, minutes apart, and the small
/// shared-memory times follow).
fn distances_from_rank0(plan: &[Vec<usize>]) -> String {
    let Some(&home) = plan.first().and_then(|c| c.first()) else {
        return String::new();
    };
    let mut seen = Vec::new();
    let mut parts = Vec::new();
    for (r, cpus) in plan.iter().enumerate().skip(1) {
        let Some(&c) = cpus.first() else { continue };
        if c == home || seen.contains(&c) || seen.len() == 7 {
            continue;
        }
        seen.push(c);
        parts.push(match distance::measure(home, c) {
            Ok(us) => format!("rank {r} cpu {c} {us:.3} µs ({})", distance::reading(us)),
            Err(e) => format!("rank {r} cpu {c} not measured ({e})"),
        });
    }
    if parts.is_empty() {
        return String::new();
    }
    format!(
        "cache-line round trip from rank 0's cpu {home} (before the ranks started): {}",
        parts.join("; ")
    )
}

/// The binding line of the header (every rank's CPUs), gathered right after init.
pub(crate) static BINDING: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Applies the binding the parent chose for this spawned rank; returns how it was bound.
pub(crate) fn apply_binding(args: &Args) -> String {
    match std::env::var(bind::CPUS_ENV) {
        Ok(list) if list.is_empty() => format!(
            "--bind {}: not bound ({} ranks outnumber the {} CPUs this may use; mpirun does not \
             bind oversubscribed ranks either)",
            args.bind.name(),
            std::env::var("DSPARK_WORLD_SIZE").unwrap_or_default(),
            bind::allowed().len()
        ),
        Ok(list) => {
            let cpus = bind::parse_list(&list);
            match bind::bind_to(&cpus) {
                Ok(()) => format!("--bind {}", args.bind.name()),
                Err(e) => format!("--bind {} FAILED ({e})", args.bind.name()),
            }
        }
        Err(_) if std::env::var_os(CHILD).is_some() => "--bind none".into(),
        Err(_) => "as the launcher started it".into(),
    }
}

/// Every rank's CPUs, as one header line (one all_gather).
pub(crate) fn gather_binding(comm: &Communicator, how: &str) -> Result<String, String> {
    let mine = bind::to_words(&bind::allowed());
    let mut all = vec![0u64; 16 * comm.world_size()];
    comm.all_gather(&mine, &mut all)
        .map_err(|e| e.to_string())?;
    let total = std::thread::available_parallelism().map_or(0, |n| n.get());
    let per: Vec<String> = all
        .chunks(16)
        .enumerate()
        .take(8)
        .map(|(r, w)| {
            let cpus = bind::from_words(w);
            let list = if cpus.len() >= total && total > 1 {
                format!("any of {}", bind::format_list(&cpus))
            } else {
                bind::format_list(&cpus)
            };
            format!("rank {r} cpu {list}")
        })
        .collect();
    let more = if comm.world_size() > 8 { ", …" } else { "" };
    Ok(format!("{how}: {}{more}", per.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    /// What each launcher sets for its ranks is one rank of a job, and `--ranks` is refused
    /// there (each rank spawned a job of its own); where nothing started this process as one
    /// of several ranks, `--ranks` spawns.
    #[test]
    fn launchers_ranks_are_recognised_and_refuse_ranks() {
        let refused = [
            // torchrun
            &[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
            ][..],
            // Open MPI
            &[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")],
            // MPICH, Intel MPI
            &[("PMI_RANK", "3"), ("PMI_SIZE", "4")],
            // srun
            &[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "8"),
                ("SLURM_STEP_ID", "0"),
                ("SLURM_JOB_ID", "7"),
            ],
            // by hand
            &[("DSPARK_RANK", "0"), ("DSPARK_WORLD_SIZE", "2")],
            // A rank without a size: a job of several, as far as anyone can tell.
            &[("DSPARK_RANK", "0")],
        ];
        for vars in refused {
            let get = env(vars);
            let l = launched_by(&get).unwrap_or_else(|| panic!("{vars:?}"));
            assert_eq!(l.rank.0, vars[0].0, "{vars:?}");
            let why = ranks_refused(2, &get).unwrap_or_else(|| panic!("{vars:?}"));
            assert!(
                why.contains(&format!("{}={}", vars[0].0, vars[0].1)),
                "{why}"
            );
            assert!(why.contains("run without --ranks"), "{why}");
            assert!(why.contains(&format!("env -u {}", vars[0].0)), "{why}");
        }
        let spawn = [
            &[][..],
            // An allocation's shell (salloc), a batch script (sbatch): no job step, so not
            // one of the tasks (both measured on Slurm 22.05).
            &[("SLURM_NTASKS", "2"), ("SLURM_JOB_ID", "4")],
            &[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_LOCALID", "0"),
            ],
            // Set but empty: as Config::from_env, not set.
            &[("RANK", " "), ("WORLD_SIZE", "")],
        ];
        for vars in spawn {
            assert_eq!(launched_by(env(vars)), None, "{vars:?}");
            assert_eq!(ranks_refused(2, env(vars)), None, "{vars:?}");
        }
        // A launcher's job of one rank (`srun -n 1 dspark-bench --ranks 4`) spawns: nothing
        // else would start the ranks.
        let one = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_STEPID", "2"),
        ];
        assert!(launched_by(env(&one)).is_some());
        assert_eq!(ranks_refused(4, env(&one)), None);
    }

    /// The rank and world-size variables taken are the ones `Config::from_env` takes, in the
    /// same order, where several launchers' are set at once.
    #[test]
    fn the_variables_taken_are_the_librarys() {
        let cases = [
            &[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("OMPI_COMM_WORLD_RANK", "0"),
                ("OMPI_COMM_WORLD_SIZE", "3"),
            ][..],
            &[("DSPARK_RANK", "1"), ("WORLD_SIZE", "4"), ("PMI_SIZE", "5")],
            &[("PMI_RANK", "1"), ("PMI_SIZE", "2"), ("SLURM_NTASKS", "9")],
            &[
                ("SLURM_PROCID", "2"),
                ("SLURM_NTASKS", "3"),
                ("SLURM_STEP_ID", "0"),
            ],
        ];
        for vars in cases {
            let mut with_root = vars.to_vec();
            with_root.push(("DSPARK_ROOT_ADDR", "127.0.0.1:1"));
            let cfg = dspark::Config::from_lookup(env(&with_root)).expect("a configuration");
            let source = |k: &str| {
                cfg.sources
                    .iter()
                    .find(|(n, _)| n == k)
                    .map(|(_, v)| v.clone())
            };
            let l = launched_by(env(vars)).expect("launched");
            assert_eq!(source("rank").as_deref(), Some(l.rank.0), "{vars:?}");
            assert_eq!(
                source("world size").as_deref(),
                l.world.as_ref().map(|w| w.0),
                "{vars:?}"
            );
            assert_eq!(l.world_size(), Some(cfg.world_size), "{vars:?}");
        }
    }
}
