//! `dspark tune`: measures the cost model's constants on this machine
//! ([`dspark::internals::plan::model`]) and writes them to the tune file that init reads.
//!
//! * α: the one-way time of an 8-byte ping-pong between 2 local ranks (half the round trip);
//! * β: the per-byte cost of an exchange (both ranks send and receive at once: a 2-rank
//!   all-gather) less the 8-byte exchange's time, the median over 64 KiB, 256 KiB, 1 MiB and
//!   4 MiB (where the crossovers fall; 1 MiB alone with `--quick`). Not 1–4 MiB alone: on the
//!   development machine 4 MiB ran at 1 GB/s over tcp while 64 KiB–1 MiB ran at 3.4–4 GB/s,
//!   and a β from 1 and 4 MiB alone (0.5 GB/s in a loaded run) made the model pick the ring
//!   from 16 KiB for 4 ranks on 2 cores, where doubling measured 1.6–2.2x faster;
//! * γ: the f32 sum kernel (`dst += src`) over 1 and 4 MiB buffers, in this process;
//! * the oversubscription constant: the one-way time of 8-byte ping-pongs that 2 ranks per core
//!   run in pairs at once (only on hosts of at most 4 cores, and not with `--quick`), less α,
//!   per core's worth of extra ranks.
//!
//! The ranks are copies of this program (`dspark tune-rank`, hidden), started on 127.0.0.1 as
//! `dspark-bench --ranks` starts its own, each with a deadline. Every figure is a median of
//! samples.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use dspark::internals::plan::model::{self, Costs, Medium};
use dspark::types::human_bytes;
use dspark::{Communicator, ReduceOp};

use crate::bind::{self, Bind};

/// `dspark tune`'s arguments.
#[derive(Args, Debug)]
pub(crate) struct TuneArgs {
    /// The transport to measure between 2 local ranks.
    #[arg(long, value_enum, default_value = "tcp")]
    transport: TuneTransport,
    /// Where to write the constants (default: `$DSPARK_TUNE_FILE`, else
    /// `$XDG_CACHE_HOME/dspark/tune.json`, else `$HOME/.cache/dspark/tune.json`). The other
    /// transports' entries of an existing file are kept.
    #[arg(long, value_name = "PATH")]
    out: Option<PathBuf>,
    /// Fewer samples and sizes (a few seconds; the oversubscription constant keeps its
    /// default).
    #[arg(long)]
    quick: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum TuneTransport {
    Tcp,
    Shm,
}

impl TuneTransport {
    fn medium(self) -> Medium {
        match self {
            TuneTransport::Tcp => Medium::Tcp,
            TuneTransport::Shm => Medium::Shm,
        }
    }
}

/// The hidden `dspark tune-rank`: one rank of a measurement.
#[derive(Args, Debug)]
pub(crate) struct RankArgs {
    /// pair: ping-pong and exchanges between ranks 0 and 1; crowd: every rank ping-pongs with
    /// its neighbour at once.
    #[arg(long, value_enum)]
    mode: RankMode,
    /// Fewer samples.
    #[arg(long)]
    quick: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum RankMode {
    Pair,
    Crowd,
}

impl RankMode {
    fn name(self) -> &'static str {
        match self {
            RankMode::Pair => "pair",
            RankMode::Crowd => "crowd",
        }
    }
}

const MIB: usize = 1 << 20;

/// The median of `v` (NaN when empty).
fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn elapsed_us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

// ---------------------------------------------------------------------------------------------
// The ranks.

/// Runs one rank; rank 0 prints `RESULT <key> [<bytes>] <value>` lines for the parent.
pub(crate) fn rank_main(args: &RankArgs) -> ExitCode {
    let run = || -> Result<(), String> {
        // The binding the parent chose (one core each, as `dspark-bench --bind core`).
        if let Ok(list) = std::env::var(bind::CPUS_ENV) {
            if !list.is_empty() {
                bind::bind_to(&bind::parse_list(&list))?;
            }
        }
        let comm = Communicator::from_env().map_err(|e| format!("init: {e}"))?;
        match args.mode {
            RankMode::Pair => pair(&comm, args.quick),
            RankMode::Crowd => crowd(&comm, args.quick),
        }
        .map_err(|e| e.to_string())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dspark tune-rank: {e}");
            ExitCode::from(1)
        }
    }
}

/// Ping-pong (α) and exchanges (β) between ranks 0 and 1; other ranks idle.
fn pair(comm: &Communicator, quick: bool) -> dspark::Result<()> {
    let rank = comm.rank();
    if rank > 1 {
        return comm.barrier();
    }
    let peer = 1 - rank;
    let ping_pong = |iters: usize| ping_pong(comm, peer, rank == 0, iters);
    ping_pong(100)?;
    let mut alpha = Vec::new();
    for _ in 0..if quick { 15 } else { 41 } {
        alpha.push(ping_pong(20)?);
    }
    // Time of one exchange of `bytes` each way, µs, over `iters` back-to-back exchanges: a
    // 2-rank all-gather (each rank sends its block and receives the other's at once, as the
    // engine runs a collective's step; it also copies its own block locally). Not a send and
    // a receive started together in a scope: those deadlock once a message outgrows what the
    // transport buffers (found here: shm from 4 MiB, tcp from 32 MiB; see the report).
    // The buffers are allocated and touched once per size: fresh ones per sample measured the
    // page faults of an 8 MiB receive buffer (0.3 GB/s at 4 MiB instead of 2).
    let exchange = |out: &[u8], inb: &mut [u8], iters: usize| -> dspark::Result<f64> {
        let t = Instant::now();
        for _ in 0..iters {
            comm.all_gather(out, inb)?;
        }
        Ok(elapsed_us(t) / iters as f64)
    };
    let sizes: &[usize] = if quick {
        &[8, MIB]
    } else {
        &[8, 64 << 10, 256 << 10, MIB, 4 * MIB]
    };
    let mut times = Vec::new();
    for &b in sizes {
        let out = vec![1u8; b];
        let mut inb = vec![0u8; 2 * b];
        let iters = if b <= 8 { 20 } else { 2 };
        exchange(&out, &mut inb, if b <= 8 { 50 } else { 2 })?;
        let mut v = Vec::new();
        for _ in 0..if quick { 9 } else { 21 } {
            v.push(exchange(&out, &mut inb, iters)?);
        }
        times.push((b, median(v)));
    }
    if rank == 0 {
        println!("RESULT alpha_us {}", median(alpha));
        for (b, t) in times {
            println!("RESULT exchange_us {b} {t}");
        }
    }
    Ok(())
}

/// The one-way time in µs of `iters` 8-byte ping-pongs with `peer`; `leads`: this rank sends
/// first.
fn ping_pong(comm: &Communicator, peer: usize, leads: bool, iters: usize) -> dspark::Result<f64> {
    let mut token = [0u8; 8];
    let t = Instant::now();
    for _ in 0..iters {
        if leads {
            comm.send(&token, peer)?;
            comm.recv(&mut token, peer)?;
        } else {
            comm.recv(&mut token, peer)?;
            comm.send(&token, peer)?;
        }
    }
    Ok(elapsed_us(t) / (2 * iters) as f64)
}

/// Every rank ping-pongs 8 bytes with its neighbour (`rank ^ 1`) at once: the one-way time
/// of a hop while all ranks are busy, as in a collective's step (the ranks outnumbering the
/// cores, each hop waits for the scheduler to run its receiver).
fn crowd(comm: &Communicator, quick: bool) -> dspark::Result<()> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let peer = rank ^ 1;
    if peer >= n {
        return comm.barrier();
    }
    let ping_pong = |iters: usize| ping_pong(comm, peer, rank % 2 == 0, iters);
    ping_pong(50)?;
    let mut hop = Vec::new();
    for _ in 0..if quick { 9 } else { 31 } {
        hop.push(ping_pong(20)?);
    }
    // Every pair has finished before rank 0 reports (so none ran alone at the end).
    comm.barrier()?;
    if rank == 0 {
        let m = comm.cost_model();
        println!("RESULT hop_us {}", median(hop));
        println!("RESULT local_ranks {}", m.local_ranks);
        println!("RESULT cores {}", m.cores);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The parent.

/// Starts `n` ranks of `mode` over `transport` on 127.0.0.1 and returns rank 0's output,
/// killing every rank at `limit`.
fn spawn_ranks(
    n: usize,
    transport: TuneTransport,
    mode: RankMode,
    quick: bool,
    limit: Duration,
) -> Result<String, String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("cannot find a free port: {e}"))?
        .port();
    let exe = std::env::current_exe().map_err(|e| format!("cannot find my own executable: {e}"))?;
    let tname = match transport {
        TuneTransport::Tcp => "tcp",
        TuneTransport::Shm => "shm",
    };
    // One core each, as dspark-bench binds its ranks (unbound where they outnumber the cores,
    // as mpirun leaves oversubscribed ranks): unbound ranks measured 60 µs one way here
    // instead of 4, the scheduler moving them.
    let binding = bind::plan(Bind::Core, n, &bind::allowed(), Path::new("/sys"));
    let mut children: Vec<Child> = Vec::new();
    let kill_all = |children: &mut Vec<Child>| {
        for c in children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    };
    // A random secret per job, which only these children know (a process's environment is
    // readable by its own user only).
    let secret = dspark::internals::trust::spawner_secret()
        .map_err(|e| format!("cannot draw the job's secret from /dev/urandom: {e}"))?;
    for r in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.arg("tune-rank").args(["--mode", mode.name()]);
        if quick {
            cmd.arg("--quick");
        }
        for v in bind::LAUNCHER_VARS.iter().chain(&["DSPARK_ALGO"]) {
            cmd.env_remove(v);
        }
        match binding.as_ref().and_then(|p| p.get(r)) {
            Some(cpus) => cmd.env(bind::CPUS_ENV, bind::format_list(cpus)),
            None => cmd.env_remove(bind::CPUS_ENV),
        };
        cmd.env("DSPARK_RANK", r.to_string())
            .env("DSPARK_WORLD_SIZE", n.to_string())
            .env("DSPARK_ROOT_ADDR", format!("127.0.0.1:{port}"))
            .env("DSPARK_TRANSPORT", tname)
            .env(dspark::internals::trust::SPAWNER_SECRET_ENV, &secret)
            // The ranks' own deadline comes first, so that a stuck rank says where.
            .env("DSPARK_TIMEOUT", (limit.as_secs() / 3).max(1).to_string())
            .stdin(Stdio::null())
            .stdout(if r == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stderr(Stdio::inherit());
        match cmd.spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                kill_all(&mut children);
                return Err(format!("cannot start rank {r}: {e}"));
            }
        }
    }
    let deadline = Instant::now() + limit;
    let mut status = vec![None; n];
    while status.iter().any(Option::is_none) {
        for (r, c) in children.iter_mut().enumerate() {
            if status[r].is_none() {
                match c.try_wait() {
                    Ok(Some(st)) => status[r] = Some(st.success()),
                    Ok(None) => {}
                    Err(e) => {
                        kill_all(&mut children);
                        return Err(format!("waiting for rank {r}: {e}"));
                    }
                }
            }
        }
        if status.contains(&Some(false)) || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if let Some(r) = status.iter().position(|s| *s == Some(false)) {
        kill_all(&mut children);
        return Err(format!(
            "rank {r} of the {} measurement failed (its error is above)",
            mode.name()
        ));
    }
    if status.iter().any(Option::is_none) {
        kill_all(&mut children);
        return Err(format!(
            "the {} measurement did not finish within {} s",
            mode.name(),
            limit.as_secs()
        ));
    }
    let mut out = String::new();
    if let Some(mut so) = children.first_mut().and_then(|c| c.stdout.take()) {
        so.read_to_string(&mut out)
            .map_err(|e| format!("reading rank 0's output: {e}"))?;
    }
    Ok(out)
}

/// The values of `RESULT key ...` lines: the rest of each line's words as numbers.
fn results(out: &str, key: &str) -> Vec<Vec<f64>> {
    out.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("RESULT") && w.next() == Some(key))
                .then(|| w.filter_map(|x| x.parse::<f64>().ok()).collect())
        })
        .collect()
}

fn one(out: &str, key: &str) -> Result<f64, String> {
    results(out, key)
        .first()
        .and_then(|v| v.first().copied())
        .filter(|x| x.is_finite())
        .ok_or_else(|| format!("rank 0 reported no {key} (its output: {out:?})"))
}

/// The f32 sum kernel's cost per byte reduced, µs/B, and its rate per size (GB/s).
fn measure_gamma(quick: bool) -> (f64, Vec<(usize, f64)>) {
    let sizes: &[usize] = if quick { &[MIB] } else { &[MIB, 4 * MIB] };
    let mut pooled = Vec::new();
    let mut per_size = Vec::new();
    for &b in sizes {
        let n = b / 4;
        let mut dst = vec![1.0f32; n];
        let src = vec![0.5f32; n];
        for _ in 0..3 {
            dspark::internals::reduce::reduce_slice(ReduceOp::Sum, &mut dst, &src);
        }
        let mut v = Vec::new();
        for _ in 0..if quick { 15 } else { 31 } {
            let t = Instant::now();
            dspark::internals::reduce::reduce_slice(ReduceOp::Sum, &mut dst, &src);
            std::hint::black_box(&mut dst);
            v.push(elapsed_us(t) / b as f64);
        }
        pooled.extend_from_slice(&v);
        per_size.push((b, 1e-3 / median(v)));
    }
    (median(pooled), per_size)
}

/// The host's online cores (as the model counts them).
fn online_cores() -> usize {
    nix::unistd::sysconf(nix::unistd::SysconfVar::_NPROCESSORS_ONLN)
        .ok()
        .flatten()
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Where `dspark tune` writes without `--out`.
fn default_out() -> Option<PathBuf> {
    dspark::config::tune_file_from(|k| std::env::var_os(k))
}

fn rate(us_per_byte: f64) -> f64 {
    1e-3 / us_per_byte
}

/// Runs `dspark tune`.
pub(crate) fn tune_main(args: &TuneArgs) -> ExitCode {
    match tune(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dspark tune: {e}");
            ExitCode::from(1)
        }
    }
}

fn tune(args: &TuneArgs) -> Result<(), String> {
    let medium = args.transport.medium();
    let out_path = match args.out.clone().or_else(default_out) {
        Some(p) => p,
        None => {
            return Err(
                "no place for the tune file: give --out PATH, or set DSPARK_TUNE_FILE, \
                 XDG_CACHE_HOME or HOME"
                    .into(),
            )
        }
    };
    // Before measuring: the directory, and the other transports' entries of an existing file
    // (kept).
    if let Some(dir) = out_path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let mut entries = Vec::new();
    let mut kept = Vec::new();
    match std::fs::read_to_string(&out_path) {
        Ok(text) => match model::parse_tune_file(&text) {
            Ok(old) => {
                for (m, c) in old {
                    if m != medium {
                        kept.push(m.name());
                        entries.push((m, c));
                    }
                }
            }
            Err(e) => println!(
                "  (the existing {} is not a tune file this build reads: {e}; replacing it)",
                out_path.display()
            ),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(format!("cannot read {}: {e}", out_path.display()));
        }
    }
    let defaults = Costs::defaults(medium);
    let limit = Duration::from_secs(if args.quick { 60 } else { 180 });
    println!(
        "dspark tune: {} between 2 local ranks{}",
        medium.name(),
        if args.quick { " (--quick)" } else { "" }
    );

    let (gamma, gamma_sizes) = measure_gamma(args.quick);
    let pair_out = spawn_ranks(2, args.transport, RankMode::Pair, args.quick, limit)?;
    let alpha = one(&pair_out, "alpha_us")?;
    let exch = results(&pair_out, "exchange_us");
    let small = exch
        .iter()
        .find(|v| v.first() == Some(&8.0))
        .and_then(|v| v.get(1).copied())
        .ok_or("rank 0 reported no 8-byte exchange")?;
    let mut betas = Vec::new();
    for v in &exch {
        if let [b, t] = v[..] {
            if b > 8.0 {
                betas.push((b as usize, (t - small).max(0.0) / (b - 8.0)));
            }
        }
    }
    let beta = median(betas.iter().map(|&(_, x)| x).collect());

    // Oversubscription: 2 ranks per core, only where that is a handful of ranks.
    let cores = online_cores();
    let mut oversub = defaults.alpha_oversub_us;
    let oversub_note;
    if args.quick {
        oversub_note = "not measured (--quick): the default".to_string();
    } else if cores > 4 {
        oversub_note = format!(
            "not measured ({cores} cores: 2 ranks per core would be {} ranks): the default",
            2 * cores
        );
    } else {
        let n = 2 * cores.max(1);
        let ring_out = spawn_ranks(n, args.transport, RankMode::Crowd, args.quick, limit)?;
        let hop = one(&ring_out, "hop_us")?;
        let model_cores = one(&ring_out, "cores")?;
        let f = n as f64 / model_cores.max(1.0);
        if f > 1.0 {
            oversub = ((hop - alpha) / (f - 1.0)).max(0.0);
            oversub_note =
                format!("{n} ranks on {model_cores} cores, each ping-ponging 8 bytes with a neighbour at once: {hop:.1} µs one way");
        } else {
            oversub_note = format!(
                "not measured ({n} ranks on {model_cores} cores is not oversubscribed): the default"
            );
        }
    }

    let costs = Costs {
        alpha_us: alpha,
        beta_us_per_byte: beta,
        gamma_us_per_byte: gamma,
        alpha_oversub_us: oversub,
    };
    if !costs.is_valid() {
        return Err(format!(
            "the measurements are not usable constants ({costs:?}); nothing written"
        ));
    }

    let sizes_text = |v: &[(usize, f64)]| {
        v.iter()
            .map(|&(b, r)| format!("{} {r:.2} GB/s", human_bytes(b as u64, true)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let beta_sizes: Vec<(usize, f64)> = betas.iter().map(|&(b, x)| (b, rate(x))).collect();
    println!("  {:<44} {:>14} {:>16}", "constant", "measured", "default");
    println!(
        "  {:<44} {:>11.2} µs {:>13.2} µs",
        "α   8-byte ping-pong, one way", alpha, defaults.alpha_us
    );
    println!(
        "  {:<44} {:>9.2} GB/s {:>11.2} GB/s   ({}; 8-byte exchange {small:.1} µs)",
        "β   exchange, both ranks sending",
        rate(beta),
        rate(defaults.beta_us_per_byte),
        sizes_text(&beta_sizes)
    );
    println!(
        "  {:<44} {:>9.2} GB/s {:>11.2} GB/s   ({})",
        "γ   f32 sum kernel, dst += src",
        rate(gamma),
        rate(defaults.gamma_us_per_byte),
        sizes_text(&gamma_sizes)
    );
    println!(
        "  {:<44} {:>11.2} µs {:>13.2} µs   ({oversub_note})",
        "α+  per hop per core's worth of extra ranks", oversub, defaults.alpha_oversub_us
    );

    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_default();
    let when = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let notes = [
        (
            "measured",
            format!(
                "{} by dspark tune{} on {host} ({cores} online cores) at unix time {when}",
                medium.name(),
                if args.quick { " --quick" } else { "" }
            ),
        ),
        (
            "method",
            format!(
                "alpha: median one-way time of an 8-byte ping-pong between 2 local ranks; beta: \
                 (2-rank all-gather time - its 8-byte time) / bytes at {}; gamma: the f32 sum kernel \
                 at {}; alpha_oversub: {oversub_note}",
                sizes_text(&beta_sizes),
                sizes_text(&gamma_sizes)
            ),
        ),
    ];
    entries.insert(0, (medium, costs));
    let text = model::format_tune_file(&entries, &notes);
    write_file(&out_path, &text)?;
    println!(
        "wrote {}{}",
        out_path.display(),
        if kept.is_empty() {
            String::new()
        } else {
            format!(" (kept its {} entries)", kept.join(", "))
        }
    );
    Ok(())
}

/// Writes `text` to `path` through a temporary file beside it (a reader never sees half).
fn write_file(path: &Path, text: &str) -> Result<(), String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, text).map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot write {}: {e}", path.display())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_result_lines_are_read_as_written() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
        let out =
            "noise\nRESULT alpha_us 3.5\nRESULT exchange_us 8 7\nRESULT exchange_us 1048576 600\n";
        assert_eq!(one(out, "alpha_us").unwrap(), 3.5);
        assert_eq!(
            results(out, "exchange_us"),
            vec![vec![8.0, 7.0], vec![1048576.0, 600.0]]
        );
        assert!(one(out, "hop_us").is_err());
    }
}
