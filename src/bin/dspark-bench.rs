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

use std::io::{IsTerminal, Write};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use clap::{Parser, ValueEnum};

#[path = "bench/bind.rs"]
mod bind;
#[path = "bench/plot.rs"]
mod plot;
use bind::Bind;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use dspark::config::{parse_size, TransportChoice};
use dspark::engine::staged::EmulatedDevice;
use dspark::engine::Call;
use dspark::path::{BufferLocation, PathPolicy, TransportKind};
use dspark::plan::{Algorithm, Collective};
use dspark::types::human_bytes;
use dspark::{Communicator, Config, DataType, Element, ReduceOp};
use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
    AllToAll,
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
            Coll::AllToAll => Collective::AllToAll,
            Coll::SendRecv => Collective::SendRecv,
        }
    }

    /// nccl-tests' bus bandwidth factor.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll => (n - 1.0) / n,
            Coll::Broadcast | Coll::Reduce | Coll::SendRecv => 1.0,
        }
    }

    fn reduces(self) -> bool {
        self.collective().reduces()
    }
}

fn parse_bytes(s: &str) -> Result<usize, String> {
    parse_size(s).ok_or_else(|| format!("{s:?} is not a size (e.g. 8, 64K, 16M, 1G)"))
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
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    step_factor: usize,
    /// Data type: float, double, half, bfloat16, int8, uint8, int32, uint32, int64, uint64.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    dtype: DataType,
    /// Reduction: sum, prod, min, max, avg.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    op: ReduceOp,
    /// Root of broadcast / reduce.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    root: usize,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: usize,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: usize,
    /// Check results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    check: u8,
    /// Spawn this many local ranks on 127.0.0.1. Without it, run as one rank of a launcher
    /// (torchrun, srun, mpirun) when its variables are set, else 2 local ranks.
    #[arg(long)]
    ranks: Option<usize>,
    /// Transport: auto (shm when every rank is on one host), tcp, verbs, shm.
    #[arg(long, default_value = "auto")]
    transport: String,
    /// Where the buffers live: host (RAM), device (CUDA GPU memory, through the data path
    /// reported in the header), or emulated (host memory driven through the host-staged
    /// device pipeline — tests the pipeline on machines without a GPU; needs a build with
    /// `--features testing`).
    #[arg(long, value_enum, default_value = "host")]
    mem: Mem,
    /// Data path for device memory: auto, gpu-direct, host-staged (DSPARK_DATA_PATH).
    #[arg(long, default_value = "auto")]
    path: PathPolicy,
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
    /// benchmarks: median of samples of K back-to-back calls), labelled with this peer name.
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
    /// Explicit size list for --peer-rows (comma-separated bytes).
    #[arg(long, value_delimiter = ',', value_parser = parse_bytes)]
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

#[derive(Debug, Clone, Copy)]
struct Row {
    bytes: usize,
    count: usize,
    time_us: f64,
    wrong: u64,
}

fn launcher_present() -> bool {
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

const CHILD: &str = "DSPARK_BENCH_CHILD";

fn main() -> ExitCode {
    let args = Args::parse();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DSPARK_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    if TransportChoice::parse(&args.transport).is_none() {
        eprintln!(
            "dspark-bench: --transport {:?}: expected auto, tcp, verbs or shm",
            args.transport
        );
        return ExitCode::from(2);
    }
    if args.mem == Mem::Emulated && !cfg!(feature = "testing") {
        eprintln!(
            "dspark-bench: --mem emulated drives the staged pipeline through a test hook: build \
             dspark-bench with `--features testing` to use it"
        );
        return ExitCode::from(2);
    }
    let is_child = std::env::var_os(CHILD).is_some();
    if !is_child && (args.ranks.is_some() || !launcher_present()) {
        return spawn_local(&args, args.ranks.unwrap_or(2));
    }
    match run_rank(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dspark-bench: {e}");
            ExitCode::from(1)
        }
    }
}

/// Spawns `n` copies of this program as ranks on 127.0.0.1; rank 0's output is the table.
fn spawn_local(args: &Args, n: usize) -> ExitCode {
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
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let plan = bind::plan(args.bind, n, &bind::allowed(), std::path::Path::new("/sys"));
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
            .env("DSPARK_RANK", r.to_string())
            .env("DSPARK_WORLD_SIZE", n.to_string())
            .env("DSPARK_ROOT_ADDR", format!("127.0.0.1:{port}"))
            .env("DSPARK_TRANSPORT", &args.transport)
            .env("DSPARK_DATA_PATH", args.path.name())
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
    let mut worst = 0u8;
    for (r, mut c) in children.into_iter().enumerate() {
        match c.wait() {
            Ok(st) if st.success() => {}
            Ok(st) => {
                let code = st.code().unwrap_or(1).clamp(1, 255) as u8;
                if code != 2 {
                    eprintln!("dspark-bench: rank {r} exited with {st}");
                }
                worst = worst.max(code);
            }
            Err(e) => {
                eprintln!("dspark-bench: waiting for rank {r}: {e}");
                worst = worst.max(1);
            }
        }
    }
    ExitCode::from(worst)
}

fn sizes(args: &Args) -> Vec<usize> {
    if !args.sizes.is_empty() {
        return args.sizes.clone();
    }
    let mut v = Vec::new();
    let mut s = args.min_bytes.max(1);
    let f = args.step_factor.max(2);
    while s <= args.max_bytes {
        v.push(s);
        s = match s.checked_mul(f) {
            Some(x) => x,
            None => break,
        };
    }
    if v.last() != Some(&args.max_bytes) && args.max_bytes >= args.min_bytes {
        v.push(args.max_bytes);
    }
    v
}

/// The binding line of the header (every rank's CPUs), gathered right after init.
static BINDING: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Applies the binding the parent chose for this spawned rank; returns how it was bound.
fn apply_binding(args: &Args) -> String {
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
fn gather_binding(comm: &Communicator, how: &str) -> Result<String, String> {
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

fn run_rank(args: &Args) -> Result<ExitCode, String> {
    let how = apply_binding(args);
    let mut cfg = Config::from_env().map_err(|e| e.to_string())?;
    if let Some(t) = TransportChoice::parse(&args.transport) {
        if std::env::var_os("DSPARK_TRANSPORT").is_none() {
            cfg.transport = t;
        }
    }
    if std::env::var_os("DSPARK_DATA_PATH").is_none() {
        cfg.data_path = args.path;
    }
    if args.compare_paths {
        // Both paths are measured on one communicator; the policy only decides the report.
        cfg.data_path = PathPolicy::Auto;
    }
    let comm = Communicator::init(cfg).map_err(|e| e.to_string())?;
    let _ = BINDING.set(gather_binding(&comm, &how)?);
    if args.root >= comm.world_size() {
        return Err(format!(
            "--root {} is not a rank (world size {})",
            args.root,
            comm.world_size()
        ));
    }
    if let Some(peer) = &args.peer_rows {
        peer_rows(args, &comm, peer)?;
        return Ok(ExitCode::SUCCESS);
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
    macro_rules! go {
        ($t:ty) => {
            if all_algos {
                compare_algorithms::<$t>(args, &comm, gpu.as_ref())
            } else if args.compare_paths {
                compare_paths::<$t>(args, &comm, gpu.as_ref())
            } else {
                let column = path_view(args, &comm, gpu.as_ref())?.column;
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
            write_plot(args, &comm, file, &rows)?;
        }
    }
    let wrong: u64 = rows.iter().flat_map(|(_, r)| r).map(|r| r.wrong).sum();
    Ok(if wrong > 0 {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    })
}

/// The algorithms that implement `c`.
fn algorithms_of(c: Collective) -> Vec<&'static str> {
    Algorithm::ALL
        .iter()
        .filter(|a| a.supports(c))
        .map(|a| a.name())
        .collect()
}

/// `--algo all`: the same sweep with every algorithm that implements the collective, side by
/// side, with the fastest per size.
fn compare_algorithms<T: BenchElem>(
    args: &Args,
    comm: &Communicator,
    gpu: Option<&Gpu>,
) -> Result<Vec<(String, Vec<Row>)>, String> {
    let c = args.collective.collective();
    let factor = args.collective.bus_factor(comm.world_size());
    let before = comm.forced_algorithm();
    let mut runs: Vec<(Algorithm, Vec<Row>)> = Vec::new();
    for &a in Algorithm::ALL.iter().filter(|a| a.supports(c)) {
        // Every rank switches together: the same list in the same order.
        comm.set_algorithm(Some(a)).map_err(|e| e.to_string())?;
        let rows = bench::<T>(args, comm, gpu, false);
        comm.set_algorithm(before).map_err(|e| e.to_string())?;
        runs.push((a, rows?));
    }
    if comm.rank() == 0 {
        let pv = path_view(args, comm, gpu)?;
        header(args, comm, T::DATA_TYPE.size(), &pv);
        println!(
            "# --algo all: the same sweep with each algorithm of {} (time in us, busbw in GB/s)",
            c.name()
        );
        let mut head = format!("# {:>12}", "size");
        for (a, _) in &runs {
            head += &format!(" {:>20} {:>8} {:>10}", a.name(), "busbw", "model");
        }
        println!("{head} {:>20} {:>20}", "fastest", "default");
        for i in 0..runs.first().map_or(0, |r| r.1.len()) {
            let bytes = runs[0].1[i].bytes;
            let mut line = format!("  {bytes:>12}");
            let mut best: Option<(Algorithm, f64)> = None;
            for (a, rows) in &runs {
                match rows.get(i) {
                    Some(r) => {
                        let call = engine_bytes(
                            args.collective,
                            bytes_of(args, i),
                            T::DATA_TYPE.size(),
                            comm.world_size(),
                        );
                        let model = comm
                            .predict(c, *a, call)
                            .map_or("-".to_string(), |t| format!("{t:.1}"));
                        line += &format!(
                            " {:>20.2} {:>8.3} {:>10}",
                            r.time_us,
                            bandwidths(r, factor).1,
                            model
                        );
                        if best.is_none_or(|(_, t)| r.time_us < t) {
                            best = Some((*a, r.time_us));
                        }
                    }
                    None => line += &format!(" {:>20} {:>8} {:>10}", "-", "-", "-"),
                }
            }
            let default = default_algorithm(comm, c, bytes);
            let fastest = best.map_or("-".to_string(), |(a, _)| a.name().to_string());
            println!("{line} {fastest:>20} {default:>20}");
        }
    }
    let transport = comm.info().transport;
    Ok(runs
        .into_iter()
        .map(|(a, rows)| (format!("dspark {transport} {a}"), rows))
        .collect())
}

/// The `i`-th size of the sweep (the `-b` size before the collective's rounding).
fn bytes_of(args: &Args, i: usize) -> usize {
    sizes(args).get(i).copied().unwrap_or(0)
}

/// The algorithm the choice by size (nothing forced) picks for `bytes` of `c`.
fn default_algorithm(comm: &Communicator, c: Collective, bytes: usize) -> &'static str {
    comm.default_algorithm(c, bytes).name()
}

/// `--plot`: this run's curves, and the peers' from `--plot-peers`, into an SVG.
fn write_plot(
    args: &Args,
    comm: &Communicator,
    file: &std::path::Path,
    runs: &[(String, Vec<Row>)],
) -> Result<(), String> {
    let n = comm.world_size();
    let factor = args.collective.bus_factor(n);
    let mut series: Vec<plot::Series> = runs
        .iter()
        .map(|(label, rows)| plot::Series {
            label: label.clone(),
            points: rows
                .iter()
                .map(|r| (r.bytes as f64, bandwidths(r, factor).1))
                .collect(),
        })
        .collect();
    if let Some(csv) = &args.plot_peers {
        let text = std::fs::read_to_string(csv)
            .map_err(|e| format!("--plot-peers {}: {e}", csv.display()))?;
        series.extend(
            plot::read_csv(&text, n).map_err(|e| format!("--plot-peers {}: {e}", csv.display()))?,
        );
    }
    let op = if args.collective.reduces() {
        format!(" {}", args.op.name())
    } else {
        String::new()
    };
    let title = format!(
        "{} {}{op}, {n} ranks, {} — bus bandwidth",
        args.collective.collective().name(),
        args.dtype.name(),
        comm.info().transport
    );
    std::fs::write(file, plot::svg(&title, &series))
        .map_err(|e| format!("--plot {}: {e}", file.display()))?;
    eprintln!("# plot: {} ({} curves)", file.display(), series.len());
    Ok(())
}

/// Values chosen so every result is exact in every type (nccl-tests' "verifiable" idea).
trait BenchElem: Element + Copy + DeviceRepr {
    fn from_i64(v: i64) -> Self;
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    fn div(a: Self, n: usize) -> Self;
}

macro_rules! bench_int {
    ($($t:ty),*) => {$(
        impl BenchElem for $t {
            fn from_i64(v: i64) -> Self { v as $t }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            // In i128: the world size may not fit the element type (i8 with 200 ranks).
            fn div(a: Self, n: usize) -> Self { (a as i128 / n as i128) as $t }
        }
    )*};
}
bench_int!(i8, u8, i32, u32, i64, u64);

macro_rules! bench_float {
    ($t:ty, $to:expr, $from:expr) => {
        impl BenchElem for $t {
            fn from_i64(v: i64) -> Self {
                $from(v as f64)
            }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                let (x, y): (f64, f64) = ($to(a), $to(b));
                $from(match op {
                    ReduceOp::Sum | ReduceOp::Avg => x + y,
                    ReduceOp::Prod => x * y,
                    ReduceOp::Min => x.min(y),
                    ReduceOp::Max => x.max(y),
                })
            }
            fn div(a: Self, n: usize) -> Self {
                <$t>::div_by(a, n)
            }
        }
    };
}

trait DivBy {
    fn div_by(a: Self, n: usize) -> Self;
}
impl DivBy for f32 {
    fn div_by(a: Self, n: usize) -> Self {
        a / n as f32
    }
}
impl DivBy for f64 {
    fn div_by(a: Self, n: usize) -> Self {
        a / n as f64
    }
}
impl DivBy for f16 {
    fn div_by(a: Self, n: usize) -> Self {
        f16::from_f32(a.to_f32() / n as f32)
    }
}
impl DivBy for bf16 {
    fn div_by(a: Self, n: usize) -> Self {
        bf16::from_f32(a.to_f32() / n as f32)
    }
}
bench_float!(f32, |v: f32| v as f64, |v: f64| v as f32);
bench_float!(f64, |v: f64| v, |v: f64| v);
bench_float!(f16, |v: f16| v.to_f64(), f16::from_f64);
bench_float!(bf16, |v: bf16| v.to_f64(), bf16::from_f64);

/// Input of rank `r` at element `i` for `op`: small integers (sums of up to hundreds of ranks
/// stay exact in bf16's 8 bits only for few ranks; products use ±1).
fn input_value(op: ReduceOp, r: usize, i: usize) -> i64 {
    let k = (r * 7 + i * 13) as i64;
    match op {
        ReduceOp::Sum | ReduceOp::Avg => k % 5 - 2,
        ReduceOp::Prod => {
            if (r + i).is_multiple_of(3) {
                -1
            } else {
                1
            }
        }
        ReduceOp::Min | ReduceOp::Max => (k % 101) - 50,
    }
}

fn fill<T: BenchElem>(buf: &mut [T], op: ReduceOp, r: usize, offset: usize) {
    for (i, x) in buf.iter_mut().enumerate() {
        *x = T::from_i64(input_value(op, r, offset + i));
    }
}

fn expected<T: BenchElem>(op: ReduceOp, n: usize, i: usize) -> T {
    let mut acc = T::from_i64(input_value(op, 0, i));
    for r in 1..n {
        acc = T::combine(op, acc, T::from_i64(input_value(op, r, i)));
    }
    if op == ReduceOp::Avg {
        acc = T::div(acc, n);
    }
    acc
}

fn count_wrong<T: BenchElem>(got: &[T], want: impl Fn(usize) -> T) -> u64 {
    got.iter()
        .enumerate()
        .filter(|(i, g)| bytemuck::bytes_of(*g) != bytemuck::bytes_of(&want(*i)))
        .count() as u64
}

/// Buffers for one size of one collective, in host memory.
struct Bufs<T> {
    send: Vec<T>,
    recv: Vec<T>,
}

fn run_host<T: BenchElem>(args: &Args, comm: &Communicator, b: &mut Bufs<T>) -> dspark::Result<()> {
    if args.api == CallApi::Nonblocking {
        return run_host_nonblocking(args, comm, b);
    }
    let n = comm.world_size();
    let r = comm.rank();
    match args.collective {
        Coll::AllReduce => comm.all_reduce(&mut b.recv, args.op),
        Coll::AllGather => comm.all_gather(&b.send, &mut b.recv),
        Coll::ReduceScatter => comm.reduce_scatter(&b.send, &mut b.recv, args.op),
        Coll::Broadcast => comm.broadcast(&mut b.recv, args.root),
        Coll::Reduce => comm.reduce(&mut b.recv, args.op, args.root),
        Coll::AllToAll => comm.all_to_all(&b.send, &mut b.recv),
        Coll::SendRecv => {
            // Pairs 0→1, 2→3, ...; with an odd world the last rank idles.
            if r.is_multiple_of(2) && r + 1 < n {
                comm.send(&b.send, r + 1)
            } else if r % 2 == 1 {
                comm.recv(&mut b.recv, r - 1)
            } else {
                Ok(())
            }
        }
    }
}

/// [`run_host`] through the non-blocking API: start in a scope, then wait.
fn run_host_nonblocking<T: BenchElem>(
    args: &Args,
    comm: &Communicator,
    b: &mut Bufs<T>,
) -> dspark::Result<()> {
    let n = comm.world_size();
    let r = comm.rank();
    comm.scope(|s| {
        let w = match args.collective {
            Coll::AllReduce => s.all_reduce(&mut b.recv, args.op)?,
            Coll::AllGather => s.all_gather(&b.send, &mut b.recv)?,
            Coll::ReduceScatter => s.reduce_scatter(&b.send, &mut b.recv, args.op)?,
            Coll::Broadcast => s.broadcast(&mut b.recv, args.root)?,
            Coll::Reduce => s.reduce(&mut b.recv, args.op, args.root)?,
            Coll::AllToAll => s.all_to_all(&b.send, &mut b.recv)?,
            Coll::SendRecv if r.is_multiple_of(2) && r + 1 < n => s.send(&b.send, r + 1)?,
            Coll::SendRecv if r % 2 == 1 => s.recv(&mut b.recv, r - 1)?,
            Coll::SendRecv => return Ok(()),
        };
        w.wait()
    })
}

/// The engine call for the emulated device (`None`: this rank idles in send/recv).
fn staged_call<T: BenchElem>(
    args: &Args,
    comm: &Communicator,
    send: usize,
    recv: usize,
) -> Option<Call> {
    let n = comm.world_size();
    let r = comm.rank();
    let (coll, op) = (
        args.collective.collective(),
        args.collective.reduces().then_some(args.op),
    );
    let mut c = match args.collective {
        Coll::AllReduce | Coll::Broadcast | Coll::Reduce => {
            Call::new(coll, op, recv, args.root, false)
        }
        Coll::ReduceScatter => Call::new(coll, op, recv, 0, false),
        Coll::AllGather => Call::new(coll, op, send, 0, false),
        Coll::AllToAll => Call::new(coll, op, send / n, 0, false),
        Coll::SendRecv if r.is_multiple_of(2) && r + 1 < n => {
            Call::new(coll, None, send, r + 1, true)
        }
        Coll::SendRecv if r % 2 == 1 => Call::new(coll, None, recv, r - 1, false),
        Coll::SendRecv => return None,
    };
    c.dtype = T::DATA_TYPE;
    Some(c)
}

/// The rank's GPU: the context and the stream every device collective is ordered on.
struct Gpu {
    stream: Arc<CudaStream>,
    name: String,
}

impl Gpu {
    /// Opens GPU (local rank mod GPU count), like one process per GPU under torchrun.
    fn open(comm: &Communicator) -> Result<Self, String> {
        let info = comm.info();
        let me = &info.hosts[comm.rank()];
        let local_index = info.hosts[..comm.rank()]
            .iter()
            .filter(|h| *h == me)
            .count();
        let count = dspark::gpu::probe::probe_cuda()
            .map_err(|e| format!("--mem device: {e}"))?
            .devices
            .len();
        if count == 0 {
            return Err("--mem device: the CUDA driver reports no GPU".into());
        }
        let ordinal = local_index % count;
        let ctx =
            dspark::gpu::device::open_context(ordinal).map_err(|e| format!("--mem device: {e}"))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| format!("--mem device: creating a stream on GPU {ordinal}: {e:?}"))?;
        let name = ctx.name().unwrap_or_else(|_| "GPU".into());
        Ok(Gpu {
            stream,
            name: format!("GPU {ordinal} ({name})"),
        })
    }
}

/// One size's buffers wherever `--mem` puts them, and how to run the call on them.
enum Runner<T: BenchElem> {
    Host(Bufs<T>),
    Emulated(Option<Call>, EmulatedDevice),
    Device {
        stream: Arc<CudaStream>,
        send: Option<CudaSlice<T>>,
        recv: Option<CudaSlice<T>>,
    },
}

fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

impl<T: BenchElem> Runner<T> {
    fn new(
        args: &Args,
        comm: &Communicator,
        gpu: Option<&Gpu>,
        b: Bufs<T>,
    ) -> Result<Self, String> {
        match (args.mem, gpu) {
            (Mem::Host, _) if !args.compare_paths => Ok(Runner::Host(b)),
            (Mem::Emulated, _) => {
                let call = staged_call::<T>(args, comm, b.send.len(), b.recv.len());
                let seg = comm.info().segment_bytes;
                let dev = EmulatedDevice::new(
                    bytemuck::cast_slice(&b.send).to_vec(),
                    bytemuck::cast_slice(&b.recv).to_vec(),
                    4,
                    4,
                    seg,
                    comm.rank() as u64 + 1,
                );
                Ok(Runner::Emulated(call, dev))
            }
            (_, Some(g)) => {
                let up = |v: &Vec<T>| -> Result<Option<CudaSlice<T>>, String> {
                    if v.is_empty() {
                        Ok(None)
                    } else {
                        g.stream
                            .clone_htod(v)
                            .map(Some)
                            .map_err(cuda_err("copying inputs to the GPU"))
                    }
                };
                Ok(Runner::Device {
                    stream: g.stream.clone(),
                    send: up(&b.send)?,
                    recv: up(&b.recv)?,
                })
            }
            (_, None) => Err("device memory requested but no GPU was opened".into()),
        }
    }

    fn run(&mut self, args: &Args, comm: &Communicator) -> dspark::Result<()> {
        match self {
            Runner::Host(b) => run_host(args, comm, b),
            Runner::Emulated(call, dev) => match call {
                Some(c) => run_emulated(comm, *c, dev),
                None => Ok(()),
            },
            Runner::Device { stream, send, recv } => run_device(args, comm, stream, send, recv),
        }
    }

    /// The output buffer, in host memory.
    fn output(&mut self) -> Result<Vec<T>, String> {
        match self {
            Runner::Host(b) => Ok(b.recv.clone()),
            Runner::Emulated(_, dev) => Ok(dev
                .dst
                .chunks_exact(size_of::<T>())
                .map(bytemuck::pod_read_unaligned)
                .collect()),
            Runner::Device { stream, recv, .. } => match recv {
                Some(r) => stream
                    .clone_dtoh(r)
                    .map_err(cuda_err("copying results from the GPU")),
                None => Ok(Vec::new()),
            },
        }
    }
}

/// One call on the emulated device (`--mem emulated`, refused at start without `testing`).
#[cfg(feature = "testing")]
fn run_emulated(comm: &Communicator, call: Call, dev: &mut EmulatedDevice) -> dspark::Result<()> {
    comm.run_staged(call, dev)
}

#[cfg(not(feature = "testing"))]
fn run_emulated(_: &Communicator, _: Call, _: &mut EmulatedDevice) -> dspark::Result<()> {
    Err(dspark::Error::unavailable(
        "dspark-bench --mem emulated",
        "this dspark-bench was built without the `testing` feature",
    ))
}

fn missing() -> dspark::Error {
    dspark::Error::invalid(None, "dspark-bench", "a device buffer is missing")
}

fn run_device<T: BenchElem>(
    args: &Args,
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    send: &mut Option<CudaSlice<T>>,
    recv: &mut Option<CudaSlice<T>>,
) -> dspark::Result<()> {
    let n = comm.world_size();
    let r = comm.rank();
    let op = args.op;
    match args.collective {
        Coll::AllReduce => comm.all_reduce_device(recv.as_mut().ok_or_else(missing)?, op, stream),
        Coll::Broadcast => {
            comm.broadcast_device(recv.as_mut().ok_or_else(missing)?, args.root, stream)
        }
        Coll::Reduce => {
            comm.reduce_device(recv.as_mut().ok_or_else(missing)?, op, args.root, stream)
        }
        Coll::AllGather => comm.all_gather_device(
            send.as_ref().ok_or_else(missing)?,
            recv.as_mut().ok_or_else(missing)?,
            stream,
        ),
        Coll::ReduceScatter => comm.reduce_scatter_device(
            send.as_ref().ok_or_else(missing)?,
            recv.as_mut().ok_or_else(missing)?,
            op,
            stream,
        ),
        Coll::AllToAll => comm.all_to_all_device(
            send.as_ref().ok_or_else(missing)?,
            recv.as_mut().ok_or_else(missing)?,
            stream,
        ),
        Coll::SendRecv if r.is_multiple_of(2) && r + 1 < n => {
            comm.send_device(send.as_ref().ok_or_else(missing)?, r + 1, stream)
        }
        Coll::SendRecv if r % 2 == 1 => {
            comm.recv_device(recv.as_mut().ok_or_else(missing)?, r - 1, stream)
        }
        Coll::SendRecv => Ok(()),
    }
}

/// Per-rank element counts for a size: (send, recv, total count shown in the table).
fn counts(c: Coll, bytes: usize, esz: usize, n: usize) -> (usize, usize, usize) {
    let total = bytes / esz;
    match c {
        Coll::AllReduce | Coll::Broadcast | Coll::Reduce => (0, total, total),
        Coll::SendRecv => (total, total, total),
        Coll::AllGather => {
            let per = total / n;
            (per, per * n, per * n)
        }
        Coll::ReduceScatter => {
            let per = total / n;
            (per * n, per, per * n)
        }
        Coll::AllToAll => {
            let per = total / n;
            (per * n, per * n, per * n)
        }
    }
}

/// The bytes of one call of a size as the engine counts them (its element count times the
/// element size: the whole buffer, or one rank's block for all_gather, reduce_scatter and
/// all_to_all), which the cost model predicts from.
fn engine_bytes(c: Coll, bytes: usize, esz: usize, n: usize) -> usize {
    let (send, recv, total) = counts(c, bytes, esz, n);
    esz * match c {
        Coll::AllGather => send,
        Coll::ReduceScatter => recv,
        Coll::AllToAll => send / n.max(1),
        _ => total,
    }
}

fn prepare<T: BenchElem>(args: &Args, comm: &Communicator, send: usize, recv: usize) -> Bufs<T> {
    let r = comm.rank();
    let mut b = Bufs {
        send: vec![T::default(); send],
        recv: vec![T::default(); recv],
    };
    match args.collective {
        Coll::AllReduce | Coll::Reduce => fill(&mut b.recv, args.op, r, 0),
        Coll::Broadcast => {
            if r == args.root {
                fill(&mut b.recv, args.op, r, 0)
            }
        }
        _ => fill(&mut b.send, args.op, r, 0),
    }
    b
}

/// Wrong elements in `out` (the output buffer); `send_len` is the per-rank input length.
fn verify<T: BenchElem>(args: &Args, comm: &Communicator, send_len: usize, out: &[T]) -> u64 {
    let n = comm.world_size();
    let r = comm.rank();
    let op = args.op;
    match args.collective {
        Coll::AllReduce => count_wrong(out, |i| expected::<T>(op, n, i)),
        Coll::Reduce if r == args.root => count_wrong(out, |i| expected::<T>(op, n, i)),
        Coll::Reduce => 0,
        Coll::Broadcast => count_wrong(out, |i| T::from_i64(input_value(op, args.root, i))),
        Coll::AllGather => {
            let per = send_len.max(1);
            count_wrong(out, |i| T::from_i64(input_value(op, i / per, i % per)))
        }
        Coll::ReduceScatter => {
            let per = out.len();
            count_wrong(out, |i| expected::<T>(op, n, r * per + i))
        }
        Coll::AllToAll => {
            let per = (out.len() / n).max(1);
            count_wrong(out, |i| {
                let (j, k) = (i / per, i % per);
                T::from_i64(input_value(op, j, r * per + k))
            })
        }
        Coll::SendRecv if r % 2 == 1 => {
            count_wrong(out, |i| T::from_i64(input_value(op, r - 1, i)))
        }
        Coll::SendRecv => 0,
    }
}

// The bench's own bookkeeping goes through all_gather, which has one algorithm: an algorithm
// forced for the timed collective (`--algo chain`) then never applies to it, nor warns.

fn max_over_ranks(comm: &Communicator, v: f64) -> dspark::Result<f64> {
    let mut all = vec![0.0f64; comm.world_size()];
    comm.all_gather(&[v], &mut all)?;
    Ok(all.into_iter().fold(f64::MIN, f64::max))
}

fn sum_over_ranks(comm: &Communicator, v: u64) -> dspark::Result<u64> {
    let mut all = vec![0u64; comm.world_size()];
    comm.all_gather(&[v], &mut all)?;
    Ok(all.iter().sum())
}

/// What the bench reports about the data path: the row column and the header lines.
struct PathView {
    column: String,
    lines: Vec<String>,
}

fn path_view(args: &Args, comm: &Communicator, gpu: Option<&Gpu>) -> Result<PathView, String> {
    match args.mem {
        Mem::Host if !args.compare_paths => Ok(PathView {
            column: "host".into(),
            lines: vec!["host memory (buffers in RAM; no GPU involved)".into()],
        }),
        Mem::Emulated => Ok(PathView {
            column: "staged".into(),
            lines: vec![
                "staged, emulated device: host memory driven through the host-staged device \
                 pipeline (slot copies and reductions done on the CPU); no GPU involved"
                    .into(),
            ],
        }),
        _ => {
            let plan = comm
                .data_paths(BufferLocation::Device)
                .map_err(|e| e.to_string())?;
            let mut kinds: Vec<&str> = plan
                .connections
                .iter()
                .flat_map(|c| [c.send.memory.short(), c.recv.memory.short()])
                .collect();
            kinds.sort_unstable();
            kinds.dedup();
            let column = match kinds.as_slice() {
                [one] => one.to_string(),
                [] => "-".into(),
                _ => "mixed".into(),
            };
            let mut lines = vec![format!(
                "device memory on {}",
                gpu.map_or("the GPU".to_string(), |g| g.name.clone())
            )];
            lines.extend(plan.connections.iter().take(8).map(|c| format!("  {c:#}")));
            lines.extend(plan.warnings.iter().map(|w| format!("  WARNING: {w}")));
            Ok(PathView { column, lines })
        }
    }
}

fn header(args: &Args, comm: &Communicator, esz: usize, pv: &PathView) {
    let info = comm.info();
    let n = comm.world_size();
    let c = args.collective.collective();
    println!(
        "# dspark-bench {}: {} ranks, {} {}{}, {} iterations ({} warm-up), check {}",
        c,
        n,
        args.dtype,
        if args.collective.reduces() {
            args.op.name()
        } else {
            ""
        },
        if c.rooted() {
            format!(", root {}", args.root)
        } else {
            String::new()
        },
        args.iters,
        args.warmup,
        if args.check != 0 { "on" } else { "off" },
    );
    println!(
        "# transport : {} — {}",
        info.transport, info.transport_detail
    );
    if let Some(why) = &info.transport_reason {
        println!("#   (not RDMA: {why})");
    }
    for (i, l) in pv.lines.iter().enumerate() {
        println!(
            "# {} {l}",
            if i == 0 { "data path :" } else { "           " }
        );
    }
    println!("# gpu region: {}", info.direct_region);
    let hosts: Vec<&str> = info.hosts.iter().map(String::as_str).collect();
    let mut uniq = hosts.clone();
    uniq.sort_unstable();
    uniq.dedup();
    println!("# rendezvous: {}", info.rendezvous);
    if let Some(b) = BINDING.get() {
        println!("# binding   : {b}");
    }
    if args.api == CallApi::Nonblocking {
        println!("# api       : non-blocking (each call started in a scope, then Work::wait)");
    }
    println!(
        "# ranks     : {n} on {} host(s) [{}]; {} on this host; spin {} µs then block; segment {}; timeout {:?}",
        uniq.len(),
        uniq.join(", "),
        info.local_ranks,
        info.spin.as_micros(),
        human_bytes(info.segment_bytes as u64, false),
        info.timeout,
    );
    // Per connection: the transport of each pair (shm within a host and tcp between hosts
    // in a mixed communicator), the path on host memory.
    let shown = n.min(8);
    for r in 0..shown {
        let mut kinds: Vec<TransportKind> = (0..n)
            .filter(|&p| p != r)
            .map(|p| info.transport_between(r, p))
            .collect();
        kinds.sort_by_key(|k| k.name());
        kinds.dedup();
        for k in kinds {
            let all: Vec<usize> = (0..n)
                .filter(|&p| p != r && info.transport_between(r, p) == k)
                .collect();
            let peers: Vec<String> = all.iter().take(7).map(|p| p.to_string()).collect();
            println!(
                "#   rank {r} ({}) -> ranks {}{}: {k} both ways, path {}",
                info.hosts.get(r).map_or("?", String::as_str),
                peers.join(","),
                if all.len() > 7 { ",…" } else { "" },
                pv.column,
            );
        }
    }
    if n > shown {
        println!("#   ... ranks {shown}..{} alike", n - 1);
    }
    let mut algos: Vec<String> = Vec::new();
    for b in sizes(args) {
        let (_, recv, total) = counts(args.collective, b, esz, n);
        let bytes = if c == Collective::AllGather {
            total * esz
        } else {
            recv.max(total) * esz
        };
        let a = comm.algorithm(c, bytes).name().to_string();
        if algos
            .last()
            .map(|x| x.split(' ').next() != Some(a.as_str()))
            .unwrap_or(true)
        {
            algos.push(format!("{a} from {}", human_bytes(b as u64, false)));
        }
    }
    let forced = match comm.forced_algorithm() {
        None => "DSPARK_ALGO or --algo forces one".to_string(),
        Some(f) if f.supports(c) => format!("forced: {f}, by DSPARK_ALGO or --algo"),
        Some(f) => format!(
            "DSPARK_ALGO={f} does not implement {}, which runs its default; {f} applies to {}",
            c.name(),
            f.collectives()
        ),
    };
    println!("# algorithm : {} ({forced})", algos.join(", "));
    // The cost model beside the measurement: its predicted time for the algorithm each size
    // runs (the engine's count: the whole buffer, or one rank's block).
    println!("# model     : {}", info.cost_model);
    let mut pred: Vec<String> = Vec::new();
    for b in sizes(args) {
        let call_bytes = engine_bytes(args.collective, b, esz, n);
        let a = comm.algorithm(c, call_bytes);
        if let Some(t) = comm.predict(c, a, call_bytes) {
            pred.push(format!("{} {t:.1}", human_bytes(b as u64, false)));
        }
    }
    println!("# predicted : µs, {}", pred.join(", "));
    println!("#");
    println!(
        "# {:>12} {:>12} {:>9} {:>6} {:>5} {:>11} {:>8} {:>8} {:>7}  {:<18} {:<9} path",
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "algorithm",
        "transport",
    );
    println!(
        "# {:>12} {:>12} {:>9} {:>6} {:>5} {:>11} {:>8} {:>8} {:>7}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
    );
}

fn bench<T: BenchElem>(
    args: &Args,
    comm: &Communicator,
    gpu: Option<&Gpu>,
    print: bool,
) -> Result<Vec<Row>, String> {
    let n = comm.world_size();
    let esz = T::DATA_TYPE.size();
    let coll = args.collective;
    let rank0 = comm.rank() == 0 && print;
    let list = sizes(args);
    let tty = std::io::stderr().is_terminal();
    let pv = path_view(args, comm, gpu)?;
    if rank0 {
        if args.csv {
            println!("collective,dtype,op,ranks,bytes,count,time_us,algbw_GBps,busbw_GBps,wrong,transport,path");
        } else {
            header(args, comm, esz, &pv);
        }
    }
    let mut rows = Vec::new();
    let e = |what: &str, err: dspark::Error| format!("{what}: {err}");
    for (k, &bytes) in list.iter().enumerate() {
        let (send, recv, total) = counts(coll, bytes, esz, n);
        let shown_bytes = total * esz;
        if comm.rank() == 0 && (tty || bytes >= 64 << 20) {
            eprint!(
                "{}[{}/{}] {} ...{}",
                if tty { "\r" } else { "" },
                k + 1,
                list.len(),
                human_bytes(bytes as u64, false),
                if tty { "" } else { "\n" }
            );
            let _ = std::io::stderr().flush();
        }
        // Check first, on fresh inputs.
        let mut wrong = 0;
        if args.check != 0 {
            let mut run = Runner::new(args, comm, gpu, prepare::<T>(args, comm, send, recv))?;
            run.run(args, comm).map_err(|x| e("check", x))?;
            wrong = verify(args, comm, send, &run.output()?);
        }
        let mut run = Runner::new(args, comm, gpu, prepare::<T>(args, comm, send, recv))?;
        for _ in 0..args.warmup {
            run.run(args, comm).map_err(|x| e("warm-up", x))?;
        }
        comm.barrier().map_err(|x| e("barrier", x))?;
        let t0 = Instant::now();
        for _ in 0..args.iters.max(1) {
            run.run(args, comm).map_err(|x| e("timed run", x))?;
        }
        let mine = t0.elapsed().as_secs_f64() * 1e6 / args.iters.max(1) as f64;
        drop(run);
        let time_us = max_over_ranks(comm, mine).map_err(|x| e("timing", x))?;
        let wrong = if args.check != 0 {
            sum_over_ranks(comm, wrong).map_err(|x| e("check", x))?
        } else {
            0
        };
        let row = Row {
            bytes: shown_bytes,
            count: total,
            time_us,
            wrong,
        };
        if comm.rank() == 0 && tty {
            eprint!("\r\x1b[K");
        }
        if rank0 {
            print_row(args, comm, &row, &pv.column);
        }
        rows.push(row);
    }
    if rank0 && !args.csv {
        footer(&rows, coll.bus_factor(n));
    }
    Ok(rows)
}

fn bandwidths(row: &Row, factor: f64) -> (f64, f64) {
    let algbw = if row.time_us > 0.0 {
        row.bytes as f64 / row.time_us / 1e3
    } else {
        0.0
    };
    (algbw, algbw * factor)
}

fn print_row(args: &Args, comm: &Communicator, row: &Row, path: &str) {
    let coll = args.collective;
    let n = comm.world_size();
    let (algbw, busbw) = bandwidths(row, coll.bus_factor(n));
    let info = comm.info();
    let op = if coll.reduces() {
        args.op.name()
    } else {
        "none"
    };
    let wrong = if args.check != 0 {
        row.wrong.to_string()
    } else {
        "N/A".into()
    };
    if args.csv {
        println!(
            "{},{},{},{},{},{},{:.2},{:.4},{:.4},{},{},{}",
            coll.collective().name(),
            args.dtype.name(),
            op,
            n,
            row.bytes,
            row.count,
            row.time_us,
            algbw,
            busbw,
            wrong,
            info.transport,
            path,
        );
    } else {
        let root: i64 = if coll.collective().rooted() {
            args.root as i64
        } else {
            -1
        };
        let algo = comm.algorithm(coll.collective(), row.bytes);
        println!(
            "  {:>12} {:>12} {:>9} {:>6} {:>5} {:>11.2} {:>8.3} {:>8.3} {:>7}  {:<18} {:<9} {}",
            row.bytes,
            row.count,
            args.dtype.name(),
            op,
            root,
            row.time_us,
            algbw,
            busbw,
            wrong,
            algo.name(),
            info.transport,
            path,
        );
    }
    let _ = std::io::stdout().flush();
}

fn footer(rows: &[Row], factor: f64) {
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    let avg_bus = if rows.is_empty() {
        0.0
    } else {
        rows.iter().map(|r| bandwidths(r, factor).1).sum::<f64>() / rows.len() as f64
    };
    println!(
        "# Out of bounds values : {} {}",
        wrong,
        if wrong == 0 { "OK" } else { "FAILED" }
    );
    println!("# Avg bus bandwidth    : {avg_bus:.4} GB/s");
}

/// `--compare-paths`: the same sweep on device memory over GPUDirect RDMA and host-staged,
/// side by side, with the ratio — the check that catches a silently staged cluster.
fn compare_paths<T: BenchElem>(
    args: &Args,
    comm: &Communicator,
    gpu: Option<&Gpu>,
) -> Result<Vec<(String, Vec<Row>)>, String> {
    let n = comm.world_size();
    let factor = args.collective.bus_factor(n);
    let rank0 = comm.rank() == 0;
    let mut results: Vec<(PathPolicy, Result<Vec<Row>, String>)> = Vec::new();
    for policy in [PathPolicy::GpuDirect, PathPolicy::HostStaged] {
        // Whether this path can be had is decided the same way init decides it.
        let before = comm.data_path();
        let res = match comm.set_data_path(policy) {
            Err(e) => Err(e.to_string()),
            Ok(()) => bench::<T>(args, comm, gpu, false),
        };
        // Every rank switches together (the same decision from the same facts).
        let _ = comm.set_data_path(before);
        results.push((policy, res));
    }
    if rank0 {
        let pv = path_view(args, comm, gpu)?;
        header(args, comm, T::DATA_TYPE.size(), &pv);
        println!("# --compare-paths: the same sweep on each data path (time in us, busbw in GB/s)");
        for (policy, res) in &results {
            if let Err(e) = res {
                println!("# {policy}: UNAVAILABLE — {e}");
            }
        }
        println!(
            "# {:>12} {:>12} {:>9} {:>12} {:>9} {:>14}",
            "size", "gpu-direct", "busbw", "host-staged", "busbw", "staged/direct"
        );
        let staged = results[1].1.as_ref().ok();
        let direct = results[0].1.as_ref().ok();
        let list = staged.or(direct).map(|v| v.len()).unwrap_or(0);
        for i in 0..list {
            let d = direct.and_then(|v| v.get(i));
            let h = staged.and_then(|v| v.get(i));
            let bytes = d.or(h).map_or(0, |r| r.bytes);
            let cell = |r: Option<&Row>| match r {
                Some(r) => (
                    format!("{:.2}", r.time_us),
                    format!("{:.3}", bandwidths(r, factor).1),
                ),
                None => ("-".into(), "-".into()),
            };
            let (dt, db) = cell(d);
            let (ht, hb) = cell(h);
            let ratio = match (d, h) {
                (Some(d), Some(h)) if d.time_us > 0.0 => format!("{:.2}x", h.time_us / d.time_us),
                _ => "-".into(),
            };
            println!("  {bytes:>12} {dt:>12} {db:>9} {ht:>12} {hb:>9} {ratio:>14}");
        }
    }
    Ok(results
        .into_iter()
        .filter_map(|(policy, res)| res.ok().map(|rows| (policy.to_string(), rows)))
        .collect())
}

/// The peer benchmarks' method (../shared/peers/README.md): allreduce f32 sum, rank r's input
/// (r+1)*(i%97+1); per size 2 verified warm-up batches, then S samples (50 up to 64 KiB, 30 at
/// 1 MiB, 20 at 16 MiB, 10 above); a sample = barrier, K back-to-back allreduces
/// (K = clamp(4 MiB / bytes, 1, 50)), time / K, max over ranks; time = median of samples.
fn peer_rows(args: &Args, comm: &Communicator, peer: &str) -> Result<(), String> {
    let n = comm.world_size();
    let r = comm.rank();
    let list = if args.sizes.is_empty() {
        vec![8, 1024, 65536, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
    } else {
        args.sizes.clone()
    };
    let e = |err: dspark::Error| err.to_string();
    for &bytes in &list {
        let count = (bytes / 4).max(1);
        let fill = |buf: &mut Vec<f32>| {
            for (i, x) in buf.iter_mut().enumerate() {
                *x = ((r + 1) * (i % 97 + 1)) as f32;
            }
        };
        let mut buf = vec![0f32; count];
        let scale = (n * (n + 1) / 2) as f32;
        for _ in 0..2 {
            fill(&mut buf);
            comm.all_reduce(&mut buf, ReduceOp::Sum).map_err(e)?;
            let bad = buf
                .iter()
                .enumerate()
                .filter(|(i, &v)| v != scale * (i % 97 + 1) as f32)
                .count();
            let bad = sum_over_ranks(comm, bad as u64).map_err(e)?;
            if bad > 0 {
                if r == 0 {
                    println!("{peer},{n},{bytes},0,0,0,0,0,0,0,WRONG");
                }
                return Err(format!("{bad} wrong elements at {bytes} bytes"));
            }
        }
        let samples = if bytes <= 65536 {
            50
        } else if bytes <= 1 << 20 {
            30
        } else if bytes <= 16 << 20 {
            20
        } else {
            10
        };
        let k = ((4 << 20) / bytes).clamp(1, 50);
        let mut times = Vec::with_capacity(samples);
        for _ in 0..samples {
            comm.barrier().map_err(e)?;
            let t0 = Instant::now();
            for _ in 0..k {
                comm.all_reduce(&mut buf, ReduceOp::Sum).map_err(e)?;
            }
            let t = t0.elapsed().as_secs_f64() * 1e6 / k as f64;
            times.push(max_over_ranks(comm, t).map_err(e)?);
        }
        times.sort_by(f64::total_cmp);
        let med = if samples % 2 == 1 {
            times[samples / 2]
        } else {
            (times[samples / 2 - 1] + times[samples / 2]) / 2.0
        };
        let algbw = bytes as f64 / med / 1e3;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        if r == 0 {
            println!(
                "{peer},{n},{bytes},{samples},{k},{med:.2},{:.2},{:.2},{algbw:.4},{busbw:.4}",
                times[0],
                times[samples - 1]
            );
            let _ = std::io::stdout().flush();
        }
    }
    Ok(())
}
