//! How dspark-bench's ranks start: spawned here as local copies of this program on
//! 127.0.0.1 (`--ranks`, or no launcher around), each with the CPU binding the parent planned,
//! or as one rank of a launcher (torchrun, srun, mpirun); and the header's binding line, every
//! rank's CPUs gathered right after init. How the spawner waits for its ranks, and ends them
//! when one fails: `supervise`.

use std::process::{Command, ExitCode, Stdio};

use dspark::Communicator;

use crate::bind::{self, Bind};
use crate::distance;
use crate::supervise;
use crate::Args;

/// Whether a launcher started this process as one rank (its rank variable is set).
pub(crate) fn launcher_present() -> bool {
    [
        "DSPARK_RANK",
        "RANK",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
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
