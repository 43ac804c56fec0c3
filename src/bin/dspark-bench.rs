//! `dspark-bench`: nccl-tests-style benchmarks of dspark's collectives.
//!
//! ```text
//! dspark-bench                                   # all_reduce, 2 local ranks over TCP, 8 B..256 MiB
//! dspark-bench all_gather -b 1K -e 64M -f 4 -d half --ranks 4
//! torchrun --nproc-per-node 8 ... dspark-bench all_reduce -b 1M -e 256M   # one rank per process
//! ```
//!
//! Columns follow nccl-tests (size, count, type, redop, root, time, algbw, busbw, #wrong) plus
//! the transport and the data path, so a slow path is visible in every row. `--csv` prints
//! `collective,dtype,op,ranks,bytes,count,time_us,algbw_GBps,busbw_GBps,wrong,transport,path`.
//!
//! This file is the command line and the wiring; the rest lives in `bench/`: how ranks start
//! (`spawn`), the sweep's sizes (`sizes`), inputs and checks (`data`), one call on host,
//! emulated or GPU memory (`runner`), the timing loop (`sweep`, `peer` for `--peer-rows`), the
//! header, the table and CSV rows (`header`, `table`), the footer and the plot (`summary`,
//! `plot`), the CPU binding (`bind`).

use std::process::ExitCode;

use clap::{Parser, ValueEnum};

#[path = "bench/bind.rs"]
mod bind;
#[path = "bench/data.rs"]
mod data;
#[path = "bench/distance.rs"]
mod distance;
#[path = "bench/header.rs"]
mod header;
#[path = "tools/logging.rs"]
mod logging;
#[path = "bench/peer.rs"]
mod peer;
#[path = "bench/plot.rs"]
mod plot;
#[path = "bench/runner.rs"]
mod runner;
#[path = "bench/sizes.rs"]
mod sizes;
#[path = "bench/spawn.rs"]
mod spawn;
#[path = "bench/summary.rs"]
mod summary;
#[path = "bench/supervise.rs"]
mod supervise;
#[path = "bench/sweep.rs"]
mod sweep;
#[path = "bench/table.rs"]
mod table;
use bind::Bind;

use dspark::config::{parse_size, TransportChoice};
use dspark::internals::plan::{Algorithm, Collective};
use dspark::path::PathPolicy;
use dspark::types::human_bytes;
use dspark::{Communicator, Config, DataType, ReduceOp};
use half::{bf16, f16};

use runner::Gpu;
use spawn::{apply_binding, gather_binding, BINDING, CHILD};
use sweep::{algorithms_of, bench, compare_algorithms, compare_paths};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
    AllToAll,
    /// all_to_all with a block size per pair (`Communicator::all_to_all_v`), skewed by
    /// `--skew`.
    AllToAllV,
    SendRecv,
}

impl Coll {
    fn collective(self) -> Collective {
        match self {
            Coll::AllReduce => Collective::AllReduce,
            Coll::AllGather => Collective::AllGather,
            Coll::ReduceScatter => Collective::ReduceScatter,
            Coll::Broadcast => Collective::Broadcast,
            Coll::Reduce => Collective::Reduce,
            Coll::AllToAll | Coll::AllToAllV => Collective::AllToAll,
            Coll::SendRecv => Collective::SendRecv,
        }
    }

    /// nccl-tests' bus bandwidth factor.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll | Coll::AllToAllV => {
                (n - 1.0) / n
            }
            Coll::Broadcast | Coll::Reduce | Coll::SendRecv => 1.0,
        }
    }

    fn reduces(self) -> bool {
        self.collective().reduces()
    }

    /// The name the header shows (the command line's).
    fn name(self) -> &'static str {
        match self {
            Coll::AllToAllV => "all_to_all_v",
            c => c.collective().name(),
        }
    }
}

impl Args {
    /// What the CSV's and the plot's rows are of: the collective's name, with the skew of
    /// an uneven all_to_all_v (`all_to_all_v/skew=0.5`).
    fn label(&self) -> String {
        match self.collective {
            Coll::AllToAllV if self.skew != 0.0 => format!("all_to_all_v/skew={}", self.skew),
            c => c.name().to_string(),
        }
    }
}

/// `--skew`: a fraction from 0 to 1.
fn parse_skew(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("{s:?} is not a fraction from 0 to 1")),
    }
}

fn parse_bytes(s: &str) -> Result<usize, String> {
    parse_size(s).ok_or_else(|| format!("{s:?} is not a size (e.g. 8, 64K, 16M, 1G)"))
}

/// `-f`: 2 or more (1 and 0 were taken as 2 without a word).
fn parse_factor(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(f) if f >= 2 => Ok(f),
        _ => Err(format!(
            "{s:?}: the step factor is a whole number of 2 or more"
        )),
    }
}

/// nccl-tests-style collective benchmark over dspark.
#[derive(Parser, Debug, Clone)]
#[command(name = "dspark-bench", version, about, long_about = None)]
struct Args {
    /// Collective to run.
    #[arg(value_enum, default_value = "all_reduce")]
    collective: Coll,
    /// Smallest size in bytes (K/M/G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_bytes)]
    min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "256M", value_parser = parse_bytes)]
    max_bytes: usize,
    /// Multiplication factor between sizes (2 or more).
    #[arg(
        short = 'f',
        long = "stepfactor",
        default_value_t = 4,
        value_parser = parse_factor,
        conflicts_with = "peer_rows"
    )]
    step_factor: usize,
    /// Data type: float, double, half, bfloat16, int8, uint8, int32, uint32, int64, uint64.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    dtype: DataType,
    /// Reduction: sum, prod, min, max, avg.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    op: ReduceOp,
    /// all_to_all_v's imbalance, from 0 (equal blocks, through the per-pair path) to 1: rank
    /// r sends rank j the even share plus or minus up to this fraction of it, the most to the
    /// rank before it and the least to itself (empty at 1), so that every rank sends and
    /// receives the same total while no two blocks between a pair need be equal.
    #[arg(long, default_value = "0", value_parser = parse_skew)]
    skew: f64,
    /// Root of broadcast / reduce.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    root: usize,
    /// Timed iterations per size. Default: at least 20, and as many more as fill 10 ms of
    /// calls at the warm-up's pace (at most 100 000): 20 calls of 8 bytes are a 5 µs window,
    /// which a single interruption of the machine (50–130 µs seen on a VM) would double, and
    /// a VM's slow stretches last milliseconds. The calls are timed in 5 windows; the row's
    /// time is the median window's.
    #[arg(short = 'n', long = "iters", conflicts_with = "peer_rows")]
    iters: Option<usize>,
    /// Warm-up iterations per size.
    #[arg(
        short = 'w',
        long = "warmup_iters",
        default_value_t = 5,
        conflicts_with = "peer_rows"
    )]
    warmup: usize,
    /// Check results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    check: u8,
    /// Spawn this many local ranks on 127.0.0.1 (refused where a launcher started this
    /// process as one of several ranks). Without it, run as one rank of a launcher (torchrun,
    /// srun, mpirun) when its variables are set, else 2 local ranks. A rank that fails gets
    /// the others ended within seconds (SIGTERM, then SIGKILL), and none outlives the spawner.
    #[arg(long)]
    ranks: Option<usize>,
    /// Transport: auto (shm when every rank is on one host), tcp, verbs, shm. Given, it beats
    /// DSPARK_TRANSPORT; not given, DSPARK_TRANSPORT applies, else auto.
    #[arg(long)]
    transport: Option<String>,
    /// Where the buffers live: host (RAM), device (CUDA GPU memory, through the data path
    /// reported in the header), or emulated (host memory driven through the host-staged
    /// device pipeline — tests the pipeline on machines without a GPU; needs a build with
    /// `--features testing`).
    #[arg(long, value_enum, default_value = "host")]
    mem: Mem,
    /// Data path for device memory: auto, gpu-direct, host-staged. Given, it beats
    /// DSPARK_DATA_PATH; not given, DSPARK_DATA_PATH applies, else auto.
    #[arg(long)]
    path: Option<PathPolicy>,
    /// Run the sweep on device memory over both data paths (gpu-direct and host-staged) and
    /// print them side by side with their ratio.
    #[arg(long)]
    compare_paths: bool,
    /// Which API the timed calls go through: the blocking calls, or the non-blocking ones
    /// (each call started in a `Communicator::scope` and waited for with `Work::wait`), to
    /// measure what the non-blocking path costs.
    #[arg(long, value_enum, default_value = "blocking")]
    api: CallApi,
    /// CPU binding of the local ranks this bench spawns: core (a distinct core each, the
    /// NIC's NUMA node first, as mpirun does), numa (a NUMA node each) or none. Ranks started
    /// by a launcher keep the binding they found; the header shows every rank's CPUs.
    #[arg(long, value_enum, default_value = "core")]
    bind: Bind,
    /// Machine-readable output.
    #[arg(long)]
    csv: bool,
    /// Print rows in the format of ../shared/peers (allreduce timing method of the peer
    /// benchmarks: median of samples of K back-to-back calls), labelled with this peer name,
    /// for the peers' sizes (8, 1K, 64K, 1M, 16M, 64M, 256M) from -b to -e, or --sizes.
    #[arg(long, value_name = "NAME")]
    peer_rows: Option<String>,
    /// Force the algorithm of the timed collective (a `DSPARK_ALGO` name such as `ring`), or
    /// `all`: the sweep once with every algorithm that implements the collective, printed
    /// side by side (and a curve each in --plot).
    #[arg(long, value_name = "NAME|all")]
    algo: Option<String>,
    /// Draw bus bandwidth against size into this SVG file: a curve per data path (with
    /// --compare-paths) or for this run.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<std::path::PathBuf>,
    /// Curves to draw beside dspark's in --plot: a CSV of ../shared/peers (one curve per
    /// peer) or of `dspark-bench --csv` (one per transport and path); rows of another world
    /// size are left out.
    #[arg(long, value_name = "CSV", requires = "plot")]
    plot_peers: Option<std::path::PathBuf>,
    /// Explicit size list (comma-separated, K/M/G suffixes), instead of -b/-e/-f's sweep or
    /// --peer-rows' list.
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = parse_bytes,
        conflicts_with_all = ["min_bytes", "max_bytes", "step_factor"]
    )]
    sizes: Vec<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "kebab-case")]
enum CallApi {
    /// `comm.all_reduce(...)`.
    Blocking,
    /// `comm.scope(|s| s.all_reduce(...)?.wait())`.
    Nonblocking,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
enum Mem {
    Host,
    Device,
    Emulated,
}

fn main() -> ExitCode {
    let args = Args::parse();
    logging::init("dspark-bench");
    let is_child = std::env::var_os(CHILD).is_some();
    if is_child {
        if let Err(e) = supervise::die_with_parent() {
            eprintln!("dspark-bench: {e}");
            return ExitCode::from(1);
        }
    }
    if let Some(t) = args
        .transport
        .as_deref()
        .filter(|t| TransportChoice::parse(t).is_none())
    {
        eprintln!("dspark-bench: --transport {t:?}: expected auto, tcp, verbs or shm");
        return ExitCode::from(2);
    }
    if let Err(why) = refused(&args) {
        eprintln!("dspark-bench: {why}");
        return ExitCode::from(2);
    }
    if args.mem == Mem::Emulated && !cfg!(feature = "testing") {
        eprintln!(
            "dspark-bench: --mem emulated drives the staged pipeline through a test hook: build \
             dspark-bench with `--features testing` to use it"
        );
        return ExitCode::from(2);
    }
    if args.skew != 0.0 && args.collective != Coll::AllToAllV {
        eprintln!("dspark-bench: --skew is all_to_all_v's (blocks of a size per pair)");
        return ExitCode::from(2);
    }
    if !is_child {
        if let Some(n) = args.ranks {
            if let Some(why) = spawn::ranks_refused(n, |k| std::env::var(k).ok()) {
                eprintln!("dspark-bench: {why}");
                return ExitCode::from(2);
            }
            return spawn::spawn_local(&args, n);
        }
        if spawn::launched().is_none() {
            return spawn::spawn_local(&args, 2);
        }
    }
    match run_rank(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dspark-bench: {e}");
            ExitCode::from(1)
        }
    }
}

/// Combinations of flags that would measure something other than what they name, refused
/// before any rank starts (exit 2): a header or a row must never claim what did not run.
fn refused(args: &Args) -> Result<(), String> {
    if args.api == CallApi::Nonblocking && (args.mem != Mem::Host || args.compare_paths) {
        return Err(
            "--api nonblocking times host buffers only: device and emulated memory \
                    go through the blocking device calls"
                .into(),
        );
    }
    if args.peer_rows.is_some() {
        // The peers' method and rows are of one thing (../shared/peers): say so rather than
        // print host all_reduce f32 numbers under another collective's or the GPU's name.
        let other = [
            (
                args.collective != Coll::AllReduce,
                "a collective other than all_reduce",
            ),
            (args.dtype != DataType::F32, "a data type other than float"),
            (args.op != ReduceOp::Sum, "an op other than sum"),
            (args.mem != Mem::Host, "device or emulated memory"),
            (args.api != CallApi::Blocking, "--api nonblocking"),
            (args.compare_paths, "--compare-paths"),
            (args.algo.as_deref() == Some("all"), "--algo all"),
        ];
        if let Some((_, what)) = other.iter().find(|(on, _)| *on) {
            return Err(format!(
                "--peer-rows measures the peers' case, a host all_reduce of float with sum, \
                 through the blocking calls: it cannot take {what}"
            ));
        }
    }
    if args.collective == Coll::SendRecv && args.ranks == Some(1) {
        return Err("send_recv needs 2 ranks or more (rank r sends to r + 1)".into());
    }
    if args.iters == Some(0) {
        return Err(
            "-n 0 times no call: give 1 or more timed iterations (or leave -n out: as many as \
             fill 10 ms per size, at least 20)"
                .into(),
        );
    }
    let short = |b: usize| human_bytes(b as u64, true);
    if args.sizes.is_empty() && args.min_bytes > args.max_bytes {
        return Err(format!(
            "-b {} is larger than -e {}: no size to measure (the sweep runs from -b, the \
             smallest, up to -e, the largest)",
            short(args.min_bytes),
            short(args.max_bytes)
        ));
    }
    if args.peer_rows.is_some() && peer::sizes(args).is_empty() {
        let list: Vec<String> = peer::PEER_SIZES.iter().map(|&b| short(b)).collect();
        return Err(format!(
            "--peer-rows times the peers' sizes from -b to -e, and none of theirs ({}) lies \
             between -b {} and -e {}: widen the range or name the sizes with --sizes",
            list.join(", "),
            short(args.min_bytes),
            short(args.max_bytes)
        ));
    }
    Ok(())
}

fn run_rank(args: &Args) -> Result<ExitCode, String> {
    let how = apply_binding(args);
    let mut cfg = Config::from_env().map_err(|e| e.to_string())?;
    if std::env::var_os(CHILD).is_some() {
        // The spawner picked the address and set DSPARK_ROOT_ADDR itself (over the user's):
        // the header's rendezvous line says so rather than name the user's variable.
        cfg.sources.retain(|(k, _)| k != "root address");
        cfg.sources.push((
            "root address".into(),
            "dspark-bench's spawner (a free port it picked)".into(),
        ));
    }
    // A flag given beats the environment, as it does in the ranks `spawn_local` starts.
    if let Some(t) = args.transport.as_deref().and_then(TransportChoice::parse) {
        cfg.transport = t;
    }
    if let Some(p) = args.path {
        cfg.data_path = p;
    }
    if args.compare_paths {
        // Both paths are measured on one communicator; the policy only decides the report.
        cfg.data_path = PathPolicy::Auto;
    }
    let comm = Communicator::init(cfg).map_err(|e| e.to_string())?;
    let _ = BINDING.set(gather_binding(&comm, &how)?);
    if args.skew != 0.0 && comm.world_size() < 3 {
        return Err(format!(
            "--skew {} needs 3 ranks or more: with {}, a rank's one peer block is all it \
             sends, so blocks of the same total per rank cannot differ",
            args.skew,
            comm.world_size()
        ));
    }
    if args.collective == Coll::SendRecv && comm.world_size() < 2 {
        // Rank 0 would neither send nor receive: a timed empty call, read as bandwidth.
        return Err("send_recv needs 2 ranks or more (rank r sends to r + 1)".into());
    }
    if args.root >= comm.world_size() {
        return Err(format!(
            "--root {} is not a rank (world size {})",
            args.root,
            comm.world_size()
        ));
    }
    let gpu = if args.mem == Mem::Device || args.compare_paths {
        Some(Gpu::open(&comm)?)
    } else {
        None
    };
    let all_algos = match args.algo.as_deref() {
        None => false,
        Some("all") => true,
        Some(name) => {
            let c = args.collective.collective();
            let a = Algorithm::from_name(name)
                .filter(|a| a.supports(c))
                .ok_or_else(|| {
                    format!(
                        "--algo {name}: not an algorithm of {} (it has: {})",
                        c.name(),
                        algorithms_of(c).join(", ")
                    )
                })?;
            comm.set_algorithm(Some(a)).map_err(|e| e.to_string())?;
            false
        }
    };
    if all_algos && args.compare_paths {
        return Err("--algo all and --compare-paths cannot be combined".into());
    }
    if let Some(peer) = &args.peer_rows {
        peer::peer_rows(args, &comm, peer)?;
        return Ok(ExitCode::SUCCESS);
    }
    macro_rules! go {
        ($t:ty) => {
            if all_algos {
                compare_algorithms::<$t>(args, &comm, gpu.as_ref())
            } else if args.compare_paths {
                compare_paths::<$t>(args, &comm, gpu.as_ref())
            } else {
                let column = header::path_view(args, &comm, gpu.as_ref())?.column;
                let label = format!("dspark {} {column}", comm.info().transport);
                bench::<$t>(args, &comm, gpu.as_ref(), true).map(|rows| vec![(label, rows)])
            }
        };
    }
    let rows = match args.dtype {
        DataType::F32 => go!(f32),
        DataType::F64 => go!(f64),
        DataType::F16 => go!(f16),
        DataType::BF16 => go!(bf16),
        DataType::I8 => go!(i8),
        DataType::U8 => go!(u8),
        DataType::I32 => go!(i32),
        DataType::U32 => go!(u32),
        DataType::I64 => go!(i64),
        DataType::U64 => go!(u64),
    }?;
    if comm.rank() == 0 {
        if let Some(file) = &args.plot {
            summary::write_plot(args, &comm, file, &rows)?;
        }
    }
    let wrong: u64 = rows.iter().flat_map(|(_, r)| r).map(|r| r.wrong).sum();
    Ok(if wrong > 0 {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    })
}
