//! Configuration, from the environment or built by hand.
//!
//! A user of torchrun, Slurm or mpirun needs nothing new: rank and world size fall back to
//! the launchers' own variables, and the rendezvous address to torchrun's `MASTER_ADDR` /
//! `MASTER_PORT`. Every error names the variable that is wrong and how to fix it.
//!
//! | variable | meaning | fallbacks |
//! | --- | --- | --- |
//! | `DSPARK_RANK`, `DSPARK_WORLD_SIZE` | this process's rank, number of ranks (at most [`MAX_WORLD_SIZE`], 2^20) | `RANK`/`WORLD_SIZE` (torchrun), `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE`, `PMI_RANK`/`PMI_SIZE`, `SLURM_PROCID`/`SLURM_NTASKS` (inside an srun step) |
//! | `DSPARK_ROOT_ADDR` | `host:port` where rank 0 listens for the rendezvous | `MASTER_ADDR` + `MASTER_PORT` |
//! | `DSPARK_TIMEOUT` | deadline of any blocking operation, seconds | 300 |
//! | `DSPARK_TRANSPORT` | `auto`, `tcp`, `verbs`, `shm` | `auto` (`shm` when every rank is on one host) |
//! | `DSPARK_HOST_ID` | this rank's host identity: ranks with equal ones share memory | the host name |
//! | `DSPARK_SHM_RING_BYTES` | bytes of each shared-memory ring (one per ordered pair of ranks; at least two segments) | 2 MiB |
//! | `DSPARK_SHM_MEMBARRIER` | `0`: shared-memory publishers keep a full fence before they look for sleeping peers, instead of leaving it to the sleepers' `membarrier(2)` | on where the kernel has it and a host's group has at most 4 ranks |
//! | `DSPARK_DATA_PATH` | device memory: `auto`, `gpu-direct`, `host-staged` | `auto` |
//! | `DSPARK_SOCKET_IFNAME` | network interface for the TCP connections | the one that reaches rank 0 |
//! | `DSPARK_IB_DEVICE`, `DSPARK_IB_GID_INDEX` | verbs device (`mlx5_0` or `mlx5_0:1`) and GID index | first active port, RoCE v2 IPv4 GID |
//! | `DSPARK_JOB_TOKEN_FILE` | a file (mode 600: refused when group or others may read it) holding the job's shared secret; ranks without it are refused ([`JobAuth`]) | `DSPARK_JOB_TOKEN` |
//! | `DSPARK_JOB_TOKEN` | the shared secret itself (both set: they must agree) | a random per-job secret where a private channel exists: dspark's spawners (`DSPARK_SPAWNER_SECRET`), the store rendezvous, `split`; else open |
//! | `DSPARK_ALGO` | force an algorithm for the collectives it implements (`ring`, `recursive_doubling`, `chain`, `binomial_tree`, `tree`, `pairwise`, `dissemination`, `direct`) | by size |
//! | `DSPARK_CHUNK_BYTES` | pipeline segment size, 64 B–256 MiB (two ranks over TCP: at most 256 KiB for all_reduces under 16 MiB) | 512 KiB |
//! | `DSPARK_SPIN_US` | busy-poll time before blocking, µs (at most 1 s); after a wait that slept and was woken soon after, the engine spins up to 2 ms (yielding the CPU past this), then gives it back call by call (0: never spin) | 50 (100, yielding the CPU, where ranks share CPUs: `CommInfo::cpu_sharing`) |
//! | `DSPARK_SOCKET_BUFFER` | TCP socket buffer size (0: the kernel's autotuning; at most 1 GiB) | 4 MiB |
//! | `DSPARK_IB_SLOTS`, `DSPARK_IB_SLOT_BYTES`, `DSPARK_IB_TIMEOUT`, `DSPARK_IB_RETRY_CNT`, `DSPARK_IB_RNR_RETRY`, `DSPARK_IB_SL`, `DSPARK_IB_TC`, `DSPARK_IB_SPIN_US`, `DSPARK_IB_ZERO_COPY_MIN` | verbs tunables ([`IbSettings`]; the table in [`crate::transport::verbs`]) | see there |
//! | `DSPARK_CACHE_DIR` | disk cache of compiled CUDA kernels | `$XDG_CACHE_HOME/dspark`, `$HOME/.cache/dspark` |
//! | `DSPARK_TRACE` | write a Chrome / Perfetto trace per rank to `<prefix>.rank<r>.json` | off |
//! | `DSPARK_FR_ENTRIES` | operations the flight recorder keeps per communicator (0: off; [`crate::engine::flight`]) | 2000 |
//! | `DSPARK_FR_DUMP` | directory each rank writes its flight record into when a communicator fails (`rank<r>.json`; `dspark analyze DIR` reads them) | off |
//! | `DSPARK_TUNE_FILE` | the cost model's measured constants (`dspark tune` writes them; [`crate::plan::model`]); rank 0's file decides for the job; a bad file is a warning and the defaults | `$XDG_CACHE_HOME/dspark/tune.json`, `$HOME/.cache/dspark/tune.json` (when present) |
//! | `DSPARK_LINK_PROBE` | `0` turns off the link probe: in a job over several hosts, rank 0 and the first rank of the next host time a few round trips and a ~10 ms stream at init, and the cost model prices the hops between hosts with what they measured ([`crate::plan::model`], "Between hosts"); rank 0's setting decides for the job | on |
//!
//! [`Config::from_env`] is the only place the environment is read: [`crate::Communicator::init`]
//! takes every setting from the `Config` it is given, and [`Config::validate`] checks their
//! bounds for a configuration built by hand too.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::path::{PathPolicy, DATA_PATH_ENV};
use crate::plan::Algorithm;

mod flight;
pub(crate) mod trust;
pub use trust::JobAuth;

/// Which transport to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// Shared memory when every rank is on one host; else verbs where every rank has a
    /// usable RDMA port, else TCP (with a warning naming why).
    #[default]
    Auto,
    /// TCP.
    Tcp,
    /// RDMA verbs; an error at init when it cannot be had.
    Verbs,
    /// Shared memory; an error at init, naming the ranks, when they are not on one host.
    Shm,
}

impl TransportChoice {
    /// Parses `auto`, `tcp`, `verbs` (`ib`, `rdma` also accepted), `shm` (`sm`, `shared`).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(TransportChoice::Auto),
            "tcp" | "socket" => Some(TransportChoice::Tcp),
            "verbs" | "ib" | "rdma" => Some(TransportChoice::Verbs),
            "shm" | "sm" | "shared" => Some(TransportChoice::Shm),
            _ => None,
        }
    }
}

impl fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Verbs => "verbs",
            TransportChoice::Shm => "shm",
        })
    }
}

/// Everything a communicator needs to start.
///
/// `#[non_exhaustive]`: a new setting is not a breaking change. Build one with
/// [`Config::new`] (or [`Config::from_env`]) and the chainable setters:
///
/// ```
/// use std::time::Duration;
/// use dspark::config::{Config, TransportChoice};
///
/// let cfg = Config::new(0, 4, "node0:29500")
///     .timeout(Duration::from_secs(60))
///     .transport(TransportChoice::Tcp)
///     .segment_bytes(256 << 10);
/// assert_eq!(cfg.timeout, Duration::from_secs(60));
/// assert!(cfg.validate().is_ok());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// `host:port` where rank 0 listens for the rendezvous (unused when `world_size` is 1).
    pub root_addr: String,
    /// Deadline of every blocking operation (rendezvous, each collective).
    pub timeout: Duration,
    /// Transport choice.
    pub transport: TransportChoice,
    /// This rank's host identity (`DSPARK_HOST_ID`; `None`: the host name): ranks with equal
    /// identities are on one host and may share memory. Tests give ranks in separate network
    /// namespaces distinct identities, so that they stand in for separate hosts.
    pub host_id: Option<String>,
    /// Bytes of each shared-memory ring (`DSPARK_SHM_RING_BYTES`); a ring holds at least two
    /// segments (`segment_bytes`), whatever is asked.
    pub shm_ring_bytes: usize,
    /// `DSPARK_SHM_MEMBARRIER` (on): where the kernel has `membarrier(2)`'s global expedited
    /// command, shared-memory ranks of a host with at most 4 of them leave the full fence of
    /// the wake-up handshake to the rank that goes to sleep (`crate::transport::shm`
    /// "Waiting"; off: a full fence on both sides).
    pub shm_membarrier: bool,
    /// Network interface for TCP connections.
    pub socket_ifname: Option<String>,
    /// Verbs device, optionally with `:port`.
    pub ib_device: Option<String>,
    /// Verbs GID index.
    pub ib_gid_index: Option<u32>,
    /// The verbs transport's other tunables (`DSPARK_IB_*`).
    pub ib: IbSettings,
    /// Where compiled CUDA kernels are cached on disk (`DSPARK_CACHE_DIR`, else
    /// `$XDG_CACHE_HOME/dspark`, else `$HOME/.cache/dspark`, resolved by [`Config::from_env`]).
    /// `None`: no disk cache (the default of [`Config::new`], which reads no environment).
    pub cache_dir: Option<PathBuf>,
    /// `DSPARK_TRACE`: write a Chrome / Perfetto trace of every call to
    /// `<prefix>.rank<r>.json` (see [`crate::engine::trace`]). `None`: no trace.
    pub trace: Option<PathBuf>,
    /// `DSPARK_FR_ENTRIES`: operations the flight recorder keeps (0: off).
    pub flight_entries: usize,
    /// `DSPARK_FR_DUMP`: the directory the flight record is dumped into on failure.
    pub flight_dump: Option<PathBuf>,
    /// The cost model's constants (`DSPARK_TUNE_FILE`, else `$XDG_CACHE_HOME/dspark/tune.json`,
    /// else `$HOME/.cache/dspark/tune.json`, resolved by [`Config::from_env`]; see
    /// [`tune_file_from`]). `None`: the model's defaults (the default of [`Config::new`]). A
    /// missing default file means the defaults, silently; a file named by `DSPARK_TUNE_FILE`
    /// that cannot be read, or any file that does not parse, is a warning and the defaults.
    pub tune_file: Option<PathBuf>,
    /// `DSPARK_LINK_PROBE`: measure the link between hosts at init (rank 0's decides; on).
    pub link_probe: bool,
    /// Shared secret: ranks with a different token are refused.
    pub job_token: Option<String>,
    /// Where `job_token` came from (ignored without one): [`Config::auth`].
    pub job_auth: JobAuth,
    /// Launcher job identity (`SLURM_JOB_ID`, `TORCHELASTIC_RUN_ID`) checked in the handshake.
    pub job_id: Option<String>,
    /// Force an algorithm.
    pub algo: Option<Algorithm>,
    /// Pipeline segment size in bytes.
    pub segment_bytes: usize,
    /// TCP socket buffer size in bytes (0 leaves the kernel's autotuning).
    pub socket_buffer: usize,
    /// Busy-poll time before blocking; `None` picks by core count.
    pub spin: Option<Duration>,
    /// Which memory path device buffers take (`DSPARK_DATA_PATH`).
    pub data_path: PathPolicy,
    /// The GPU whose memory this rank registers with the NIC for GPUDirect RDMA
    /// (`DSPARK_CUDA_DEVICE`, else the launcher's local rank: `LOCAL_RANK`,
    /// `OMPI_COMM_WORLD_LOCAL_RANK`, `MPI_LOCALRANKID`, `SLURM_LOCALID`; taken modulo the
    /// number of GPUs). `None`: device 0.
    pub cuda_device: Option<usize>,
    /// Testing only (`DSPARK_EMULATE_GPU_DIRECT=1`): give the verbs transport a direct region
    /// in host memory, so that the GPUDirect protocol runs on machines without a GPU. Reported
    /// as emulation, never as GPUDirect.
    pub emulate_gpu_direct: bool,
    /// How the ranks find rank 0 (`DSPARK_RENDEZVOUS`; torchrun's agent store by default
    /// under torchrun).
    pub rendezvous: Rendezvous,
    /// `DSPARK_LISTEN_ANY=1`: listeners bind every interface, not the rank's own address.
    pub listen_any: bool,
    /// `DSPARK_ACCEPT_ANY_SOURCE=1`: data listeners accept any address, not only the ranks'.
    pub accept_any_source: bool,
    /// Where each setting came from, for messages (`rank from RANK`, ...).
    pub sources: Vec<(String, String)>,
}

/// Tunables of the verbs transport, carried by [`Config`] so that [`crate::Communicator::init`]
/// reads no environment: [`Config::from_env`] parses them from the `DSPARK_IB_*` variables,
/// and [`Config::validate`] checks their bounds.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct IbSettings {
    /// Slots per peer and direction (`DSPARK_IB_SLOTS`, 2–256).
    pub slots: usize,
    /// Payload bytes per slot (`DSPARK_IB_SLOT_BYTES`, at least the segment size); `None`:
    /// the segment size.
    pub slot_bytes: Option<usize>,
    /// Local ACK timeout exponent, 4.096 µs × 2^t (`DSPARK_IB_TIMEOUT`, 1–31).
    pub timeout: u8,
    /// Transport retries after an ACK timeout (`DSPARK_IB_RETRY_CNT`, 0–7).
    pub retry_cnt: u8,
    /// Retries after a receiver-not-ready NAK (`DSPARK_IB_RNR_RETRY`, 0–6; 7 would retry
    /// forever and is refused).
    pub rnr_retry: u8,
    /// InfiniBand service level, which lossless (PFC) RoCE fabrics map to a priority
    /// (`DSPARK_IB_SL`, 0–15).
    pub service_level: u8,
    /// Traffic class of the global route header: the DSCP/ECN byte of RoCE v2 packets
    /// (`DSPARK_IB_TC`, 0–255; DSCP 26 is 104).
    pub traffic_class: u8,
    /// Busy-poll time of the completion queue before sleeping (`DSPARK_IB_SPIN_US`, at most
    /// 1 s).
    pub spin: Duration,
    /// Smallest payload sent zero-copy from a registered buffer (`DSPARK_IB_ZERO_COPY_MIN`).
    pub zero_copy_min: usize,
}

/// The default ACK timeout exponent: 4.096 µs × 2^20 ≈ 4.3 s, × (7 retries + 1) ≈ 34 s before
/// a queue pair gives up — NCCL's default, field-tested against congestion and PFC pauses. A
/// short budget turns a congestion stall into a job failure, and dspark needs none to find a
/// dead peer: a process that dies closes its liveness socket at once, and a node that dies
/// stops answering that socket's keepalive probes within seconds.
pub const DEFAULT_IB_TIMEOUT: u8 = 20;

impl Default for IbSettings {
    fn default() -> Self {
        IbSettings {
            slots: 8,
            slot_bytes: None,
            timeout: DEFAULT_IB_TIMEOUT,
            retry_cnt: 7,
            rnr_retry: 6,
            service_level: 0,
            traffic_class: 0,
            spin: Duration::from_micros(20),
            zero_copy_min: 64 * 1024,
        }
    }
}

/// How the ranks of a job find rank 0 at init.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Rendezvous {
    /// Rank 0 listens on [`Config::root_addr`]; the others connect to it.
    #[default]
    Listen,
    /// [`Config::root_addr`] is a PyTorch c10d TCPStore — the one torchrun's agent serves on
    /// `MASTER_ADDR:MASTER_PORT`, or rank 0's `init_process_group` — and every rank is its
    /// client: rank 0 listens on an ephemeral port and publishes it there, under keys that
    /// start with `prefix` ([`crate::Communicator::init_with_store`]). No fixed port is bound.
    TorchStore {
        /// Key prefix (per job and restart, so that restarts do not meet stale addresses).
        prefix: String,
    },
}

/// An on/off variable: `Ok(false)` for 0/false/no/off, `Ok(true)` for 1/true/yes/on or empty,
/// an error naming variable `n` otherwise.
fn switch(n: &str, v: &str) -> Result<bool> {
    let off = ["0", "false", "no", "off"].contains(&v.trim().to_ascii_lowercase().as_str());
    if !off && !truthy(v) && !v.trim().is_empty() {
        return Err(Error::config(n, format!("{v:?}: expected 0 or 1")));
    }
    Ok(!off)
}

/// Whether a launcher flag variable is set to true (`True`, `true`, `1`, `yes`).
fn truthy(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

/// Chainable setters, one per setting: `Config::new(..).timeout(d).transport(t)`.
macro_rules! setters {
    ($($name:ident: $ty:ty),* $(,)?) => {
        impl Config {
            $(
                #[doc = concat!("Sets [`Config::", stringify!($name), "`].")]
                #[must_use]
                pub fn $name(mut self, value: $ty) -> Self {
                    self.$name = value;
                    self
                }
            )*
        }
    };
}

setters! {
    rank: usize,
    world_size: usize,
    root_addr: String,
    timeout: Duration,
    transport: TransportChoice,
    host_id: Option<String>,
    shm_ring_bytes: usize,
    socket_ifname: Option<String>,
    ib_device: Option<String>,
    ib_gid_index: Option<u32>,
    ib: IbSettings,
    cache_dir: Option<PathBuf>,
    trace: Option<PathBuf>,
    tune_file: Option<PathBuf>,
    job_token: Option<String>,
    job_auth: JobAuth,
    job_id: Option<String>,
    algo: Option<Algorithm>,
    segment_bytes: usize,
    socket_buffer: usize,
    spin: Option<Duration>,
    data_path: PathPolicy,
    cuda_device: Option<usize>,
    emulate_gpu_direct: bool,
    rendezvous: Rendezvous,
    listen_any: bool,
    accept_any_source: bool,
}

/// Default deadline.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

impl Config {
    /// A configuration for `rank` of `world_size` that meets at `root_addr`, with defaults
    /// for everything else.
    pub fn new(rank: usize, world_size: usize, root_addr: impl Into<String>) -> Self {
        Config {
            rank,
            world_size,
            root_addr: root_addr.into(),
            timeout: DEFAULT_TIMEOUT,
            transport: TransportChoice::Auto,
            host_id: None,
            shm_ring_bytes: DEFAULT_SHM_RING_BYTES,
            shm_membarrier: true,
            socket_ifname: None,
            ib_device: None,
            ib_gid_index: None,
            ib: IbSettings::default(),
            cache_dir: None,
            trace: None,
            flight_entries: crate::engine::flight::DEFAULT_ENTRIES,
            flight_dump: None,
            tune_file: None,
            link_probe: true,
            job_token: None,
            job_auth: JobAuth::Token,
            job_id: None,
            algo: None,
            segment_bytes: 512 * 1024,
            socket_buffer: 4 << 20,
            spin: None,
            data_path: PathPolicy::Auto,
            cuda_device: None,
            emulate_gpu_direct: false,
            rendezvous: Rendezvous::Listen,
            listen_any: false,
            accept_any_source: false,
            sources: Vec::new(),
        }
    }

    /// Reads the configuration from the process environment (see the module docs).
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable that is missing, unparsable or inconsistent.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the configuration through `get` (a testable stand-in for the environment).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let pick = |names: &[&'static str]| -> Option<(&'static str, String)> {
            names
                .iter()
                .find_map(|n| get(n).filter(|v| !v.trim().is_empty()).map(|v| (*n, v)))
        };
        let parse_usize = |name: &str, v: &str| -> Result<usize> {
            v.trim()
                .parse::<usize>()
                .map_err(|_| Error::config(name, format!("{v:?} is not a non-negative integer")))
        };
        let rank_vars = LAUNCHER_RANK_VARS.map(|(r, _)| r);
        let size_vars = LAUNCHER_RANK_VARS.map(|(_, w)| w);
        let mut sources = Vec::new();
        let (rank_var, rank_s) = pick(&rank_vars).ok_or_else(|| {
            Error::config(
                "DSPARK_RANK",
                "no rank given: set DSPARK_RANK (or run under torchrun, mpirun or srun, which \
                 set RANK, OMPI_COMM_WORLD_RANK, PMI_RANK or SLURM_PROCID)",
            )
        })?;
        let (size_var, size_s) = pick(&size_vars).ok_or_else(|| {
            Error::config(
                "DSPARK_WORLD_SIZE",
                "no world size given: set DSPARK_WORLD_SIZE (or WORLD_SIZE, \
                 OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS)",
            )
        })?;
        let rank = parse_usize(rank_var, &rank_s)?;
        let world_size = parse_usize(size_var, &size_s)?;
        // Slurm sets SLURM_PROCID=0 and SLURM_NTASKS=N in the batch script itself, outside
        // any step: a process the script runs is one process, not one of the job's N tasks,
        // and rank 0 of N would wait its whole deadline for ranks that never start.
        if rank_var == "SLURM_PROCID" && world_size > 1 && pick(&SLURM_STEP_VARS).is_none() {
            return Err(Error::config(
                "SLURM_PROCID",
                format!(
                    "SLURM_PROCID={} and SLURM_NTASKS={world_size} are the batch script's, not \
                     a task's (no SLURM_STEP_ID: this process is not inside an srun step), so \
                     it is one process, not rank {} of the job's {world_size}: start the ranks \
                     with srun (one per task), or set DSPARK_RANK and DSPARK_WORLD_SIZE",
                    rank_s.trim(),
                    rank
                ),
            ));
        }
        sources.push(("rank".to_string(), rank_var.to_string()));
        sources.push(("world size".to_string(), size_var.to_string()));
        // Rank and world size first: they are the most common mistake.
        if world_size == 0 || world_size > MAX_WORLD_SIZE || rank >= world_size {
            let mut early = Config::new(rank, world_size, "unused:1");
            early.sources = sources.clone();
            early.validate()?;
        }

        let root_addr = match pick(&["DSPARK_ROOT_ADDR"]) {
            Some((_, v)) => {
                sources.push(("root address".into(), "DSPARK_ROOT_ADDR".into()));
                v.trim().to_string()
            }
            None => match (get("MASTER_ADDR"), get("MASTER_PORT")) {
                (Some(a), Some(p)) => {
                    let port = p.trim().parse::<u16>().map_err(|_| {
                        Error::config("MASTER_PORT", format!("{p:?} is not a port number"))
                    })?;
                    sources.push(("root address".into(), "MASTER_ADDR:MASTER_PORT".into()));
                    join_host_port(a.trim(), port)
                }
                (Some(_), None) => return Err(Error::config(
                    "MASTER_PORT",
                    "MASTER_ADDR is set but MASTER_PORT is not (or set DSPARK_ROOT_ADDR=host:port)",
                )),
                _ if world_size <= 1 => String::new(),
                _ => {
                    return Err(Error::config(
                        "DSPARK_ROOT_ADDR",
                        "no rendezvous address: set DSPARK_ROOT_ADDR=host:port of rank 0 (or \
                         MASTER_ADDR and MASTER_PORT as torchrun does)",
                    ))
                }
            },
        };

        let mut c = Config::new(rank, world_size, root_addr);
        // Under torchrun the agent already serves its c10d TCPStore on MASTER_PORT: meet
        // through it as a client instead of binding the same port. DSPARK_ROOT_ADDR keeps its
        // meaning wherever it is set; DSPARK_RENDEZVOUS chooses explicitly.
        let prefix = || {
            let run = get("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into());
            let restart = get("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into());
            format!("dspark/{}/{}", run.trim(), restart.trim())
        };
        let from_master = sources
            .iter()
            .any(|(k, v)| k == "root address" && v == "MASTER_ADDR:MASTER_PORT");
        match pick(&["DSPARK_RENDEZVOUS"]) {
            Some((n, v)) => match v.trim() {
                "listen" => {}
                "store" => {
                    c.rendezvous = Rendezvous::TorchStore { prefix: prefix() };
                    sources.push(("rendezvous".into(), format!("{n}={v}")));
                }
                _ => {
                    return Err(Error::config(
                        n,
                        format!("{v:?}: expected listen (rank 0 binds the root address) or store (a torch TCPStore serves it)"),
                    ))
                }
            },
            None if from_master
                && world_size > 1
                && get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| truthy(&v)) =>
            {
                c.rendezvous = Rendezvous::TorchStore { prefix: prefix() };
                sources.push((
                    "rendezvous".into(),
                    "TORCHELASTIC_USE_AGENT_STORE (torchrun's agent store at MASTER_ADDR:MASTER_PORT)".into(),
                ));
            }
            None => {}
        }
        c.sources = sources;
        if let Some((n, v)) = pick(&["DSPARK_TIMEOUT"]) {
            let secs: f64 = v
                .trim()
                .parse()
                .map_err(|_| Error::config(n, format!("{v:?} is not a number of seconds")))?;
            if !(secs > 0.0 && secs.is_finite() && secs < 1e9) {
                return Err(Error::config(
                    n,
                    format!("{v:?}: the timeout must be > 0 seconds"),
                ));
            }
            c.timeout = Duration::from_secs_f64(secs);
        }
        if let Some((n, v)) = pick(&["DSPARK_TRANSPORT"]) {
            c.transport = TransportChoice::parse(&v).ok_or_else(|| {
                Error::config(n, format!("{v:?}: expected auto, tcp, verbs or shm"))
            })?;
        }
        if let Some((n, v)) = pick(&["DSPARK_HOST_ID"]) {
            let v = v.trim();
            if v.is_empty() || v.len() > 255 {
                return Err(Error::config(
                    n,
                    format!("{v:?}: a host identity of 1 to 255 bytes"),
                ));
            }
            c.host_id = Some(v.to_string());
        }
        if let Some((n, v)) = pick(&["DSPARK_SHM_RING_BYTES"]) {
            c.shm_ring_bytes = parse_size(&v).ok_or_else(|| {
                Error::config(n, format!("{v:?} is not a size (e.g. 2M, 262144)"))
            })?;
        }
        if let Some((n, v)) = pick(&["DSPARK_SHM_MEMBARRIER"]) {
            c.shm_membarrier = switch(n, &v)?;
        }
        c.socket_ifname = pick(&["DSPARK_SOCKET_IFNAME"]).map(|(_, v)| v.trim().to_string());
        c.ib_device = pick(&["DSPARK_IB_DEVICE"]).map(|(_, v)| v.trim().to_string());
        if let Some((n, v)) = pick(&["DSPARK_IB_GID_INDEX"]) {
            c.ib_gid_index = Some(
                v.trim()
                    .parse()
                    .map_err(|_| Error::config(n, format!("{v:?} is not a GID index")))?,
            );
        }
        let num = |name: &'static str| -> Result<Option<u64>> {
            pick(&[name])
                .map(|(n, v)| {
                    v.trim().parse::<u64>().map_err(|_| {
                        Error::config(n, format!("{v:?} is not a non-negative integer"))
                    })
                })
                .transpose()
        };
        // Out-of-range values are refused by `validate`, which names the variable; here they
        // only must fit the field (saturated so that `validate` sees them as too large).
        let small = |x: u64| u8::try_from(x).unwrap_or(u8::MAX);
        if let Some(x) = num("DSPARK_IB_SLOTS")? {
            c.ib.slots = usize::try_from(x).unwrap_or(usize::MAX);
        }
        if let Some((n, v)) = pick(&["DSPARK_IB_SLOT_BYTES"]) {
            c.ib.slot_bytes = Some(
                parse_size(&v)
                    .ok_or_else(|| Error::config(n, format!("{v:?} is not a size (e.g. 1M)")))?,
            );
        }
        if let Some(x) = num("DSPARK_IB_TIMEOUT")? {
            c.ib.timeout = small(x);
        }
        if let Some(x) = num("DSPARK_IB_RETRY_CNT")? {
            c.ib.retry_cnt = small(x);
        }
        if let Some(x) = num("DSPARK_IB_RNR_RETRY")? {
            c.ib.rnr_retry = small(x);
        }
        if let Some(x) = num("DSPARK_IB_SL")? {
            c.ib.service_level = small(x);
        }
        if let Some(x) = num("DSPARK_IB_TC")? {
            if x > 255 {
                return Err(Error::config(
                    "DSPARK_IB_TC",
                    format!("{x}: expected 0..=255"),
                ));
            }
            c.ib.traffic_class = small(x);
        }
        if let Some(x) = num("DSPARK_IB_SPIN_US")? {
            c.ib.spin = Duration::from_micros(x.min(u64::from(u32::MAX)));
        }
        if let Some((n, v)) = pick(&["DSPARK_IB_ZERO_COPY_MIN"]) {
            c.ib.zero_copy_min =
                parse_size(&v).ok_or_else(|| Error::config(n, format!("{v:?} is not a size")))?;
        }
        c.cache_dir = cache_dir_from(|k| get(k).map(std::ffi::OsString::from));
        c.tune_file = tune_file_from(|k| get(k).map(std::ffi::OsString::from));
        if get("DSPARK_TUNE_FILE").is_some_and(|v| !v.is_empty()) {
            c.sources
                .push(("tune file".into(), "DSPARK_TUNE_FILE".into()));
        }
        c.trace = get("DSPARK_TRACE")
            .filter(|t| !t.is_empty())
            .map(PathBuf::from);
        (c.flight_entries, c.flight_dump) = flight::from_env(&get, c.flight_entries)?;
        if let Some((token, how)) = trust::token_from(&get)? {
            (c.job_token, c.job_auth) = (Some(token), how);
        }
        c.job_id = pick(&["SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"]).map(|(_, v)| v);
        if let Some((n, v)) = pick(&["DSPARK_ALGO"]) {
            c.algo = Some(Algorithm::from_name(&v).ok_or_else(|| {
                Error::config(
                    n,
                    format!(
                        "{v:?}: expected ring, recursive_doubling (rd), chain (pipeline), \
                         binomial_tree (binomial), tree (double binary tree for all_reduce, \
                         binomial tree for broadcast and reduce), hier (hierarchical all_reduce), \
                         rabenseifner (halving-doubling all_reduce), one_shot (all_reduce), \
                         pairwise, dissemination or direct"
                    ),
                )
            })?);
        }
        if let Some((n, v)) = pick(&["DSPARK_CHUNK_BYTES"]) {
            let b = parse_size(&v).ok_or_else(|| {
                Error::config(n, format!("{v:?} is not a size (e.g. 524288, 512K, 1M)"))
            })?;
            c.segment_bytes = b;
        }
        if let Some((n, v)) = pick(&["DSPARK_SOCKET_BUFFER"]) {
            c.socket_buffer =
                parse_size(&v).ok_or_else(|| Error::config(n, format!("{v:?} is not a size")))?;
        }
        if let Some((_, v)) = pick(&[DATA_PATH_ENV]) {
            c.data_path = v.parse()?;
        }
        if let Some((n, v)) = pick(&[
            "DSPARK_CUDA_DEVICE",
            "LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "MPI_LOCALRANKID",
            "SLURM_LOCALID",
        ]) {
            c.cuda_device = Some(parse_usize(n, &v)?);
        }
        if let Some((n, v)) = pick(&["DSPARK_EMULATE_GPU_DIRECT"]) {
            c.emulate_gpu_direct = match v.as_str() {
                "1" | "true" | "yes" => true,
                "0" | "false" | "no" | "" => false,
                _ => return Err(Error::config(n, format!("{v:?}: expected 0 or 1"))),
            };
        }
        if let Some((n, v)) = pick(&["DSPARK_LINK_PROBE"]) {
            c.link_probe = switch(n, &v)?;
        }
        c.listen_any = pick(&["DSPARK_LISTEN_ANY"]).is_some_and(|(_, v)| truthy(&v));
        c.accept_any_source = pick(&["DSPARK_ACCEPT_ANY_SOURCE"]).is_some_and(|(_, v)| truthy(&v));
        if let Some((n, v)) = pick(&["DSPARK_SPIN_US"]) {
            let us = parse_usize(n, &v)?;
            c.spin = Some(Duration::from_micros((us as u64).min(u64::from(u32::MAX))));
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks internal consistency (rank < world size, world size ≥ 1, root address shape).
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable.
    pub fn validate(&self) -> Result<()> {
        let src = |what: &str, default: &str| {
            self.sources
                .iter()
                .find(|(k, _)| k == what)
                .map_or(default.to_string(), |(_, v)| v.clone())
        };
        if self.world_size == 0 {
            return Err(Error::config(
                src("world size", "DSPARK_WORLD_SIZE"),
                "world size is 0: it must be at least 1",
            ));
        }
        if self.world_size > MAX_WORLD_SIZE {
            return Err(Error::config(
                src("world size", "DSPARK_WORLD_SIZE"),
                format!(
                    "world size {} is above the largest dspark supports ({MAX_WORLD_SIZE})",
                    self.world_size
                ),
            ));
        }
        if self.rank >= self.world_size {
            return Err(Error::config(
                src("rank", "DSPARK_RANK"),
                format!(
                    "rank {} is not below the world size {} (ranks are 0..{})",
                    self.rank,
                    self.world_size,
                    self.world_size - 1
                ),
            ));
        }
        if self.world_size > 1 {
            split_host_port(&self.root_addr)
                .map_err(|what| Error::config(src("root address", "DSPARK_ROOT_ADDR"), what))?;
        }
        if self.timeout.is_zero() {
            return Err(Error::config("DSPARK_TIMEOUT", "the timeout must be > 0"));
        }
        if !(MIN_SEGMENT..=MAX_SEGMENT).contains(&self.segment_bytes) {
            return Err(Error::config(
                "DSPARK_CHUNK_BYTES",
                format!(
                    "a segment of {} bytes: it must be between 64 B and 256 MiB",
                    self.segment_bytes
                ),
            ));
        }
        let ring = MIN_SHM_RING_BYTES..=MAX_SHM_RING_BYTES;
        if !ring.contains(&self.shm_ring_bytes) {
            return Err(Error::config(
                "DSPARK_SHM_RING_BYTES",
                format!(
                    "a ring of {} bytes: it must be between 4 KiB and 1 GiB",
                    self.shm_ring_bytes
                ),
            ));
        }
        if self.socket_buffer > MAX_SOCKET_BUFFER {
            return Err(Error::config(
                "DSPARK_SOCKET_BUFFER",
                format!(
                    "{} bytes: at most 1 GiB (0 leaves the kernel's autotuning)",
                    self.socket_buffer
                ),
            ));
        }
        if self.spin.is_some_and(|s| s > MAX_SPIN) || self.ib.spin > MAX_SPIN {
            let var = if self.ib.spin > MAX_SPIN {
                "DSPARK_IB_SPIN_US"
            } else {
                "DSPARK_SPIN_US"
            };
            return Err(Error::config(
                var,
                "a busy-poll time of at most 1 s (1000000 µs)",
            ));
        }
        self.ib.validate(self.segment_bytes)
    }
}

/// The disk cache directory of compiled kernels from an environment: `$DSPARK_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/dspark`, else `$HOME/.cache/dspark`; `None` when none is set.
pub fn cache_dir_from(env: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
    let nonempty = |k: &str| env(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    nonempty("DSPARK_CACHE_DIR")
        .or_else(|| nonempty("XDG_CACHE_HOME").map(|p| p.join("dspark")))
        .or_else(|| nonempty("HOME").map(|p| p.join(".cache").join("dspark")))
}

/// The cost model's tune file from an environment: `$DSPARK_TUNE_FILE`, else
/// `$XDG_CACHE_HOME/dspark/tune.json`, else `$HOME/.cache/dspark/tune.json`; `None` when none
/// is set. (`dspark tune` writes there by default.)
pub fn tune_file_from(env: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
    let nonempty = |k: &str| env(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    nonempty("DSPARK_TUNE_FILE")
        .or_else(|| nonempty("XDG_CACHE_HOME").map(|p| p.join("dspark").join("tune.json")))
        .or_else(|| nonempty("HOME").map(|p| p.join(".cache").join("dspark").join("tune.json")))
}

/// Bounds of the segment size (`DSPARK_CHUNK_BYTES`).
/// The launchers' rank and world-size variables, in the order [`Config::from_env`] takes them
/// (the first set wins): dspark's own, torchrun's, Open MPI's, MPICH's and Intel MPI's (PMI),
/// Slurm's (only inside an srun step: [`SLURM_STEP_VARS`]).
pub const LAUNCHER_RANK_VARS: [(&str, &str); 5] = [
    ("DSPARK_RANK", "DSPARK_WORLD_SIZE"),
    ("RANK", "WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
];

/// Slurm's variables that say a process runs inside an srun step (a batch script has
/// `SLURM_PROCID` and `SLURM_NTASKS` for itself, and neither of these).
pub const SLURM_STEP_VARS: [&str; 2] = ["SLURM_STEP_ID", "SLURM_STEPID"];

/// The largest world size (`DSPARK_WORLD_SIZE`) dspark accepts: 2^20 ranks. A larger one is a
/// [`Error::Config`] at once (ranks and world sizes travel as 32-bit numbers at the
/// rendezvous, and every rank holds per-peer state).
pub const MAX_WORLD_SIZE: usize = 1 << 20;

/// `DSPARK_SHM_RING_BYTES`' default and range (the shared-memory transport clamps to the
/// same range; a test in `comm::setup` keeps the two in step).
pub(crate) const DEFAULT_SHM_RING_BYTES: usize = 2 << 20;
pub(crate) const MIN_SHM_RING_BYTES: usize = 4096;
pub(crate) const MAX_SHM_RING_BYTES: usize = 1 << 30;
const MIN_SEGMENT: usize = 64;
/// A shared-memory ring holds two segments and their headers (`comm::setup::shm`) within
/// its 1 GiB limit: a larger segment left the ring clamped to less, where a schedule whose
/// receive waits for its own send waits for the deadline.
pub(crate) const MAX_SEGMENT: usize = 256 << 20;
/// The largest verbs slot (`DSPARK_IB_SLOT_BYTES`).
const MAX_IB_SLOT: usize = 1 << 30;
const MAX_SOCKET_BUFFER: usize = 1 << 30;
const MAX_SPIN: Duration = Duration::from_secs(1);

impl IbSettings {
    /// Checks the bounds of every setting, naming its variable; `segment` is the pipeline
    /// segment size, which a slot must hold.
    ///
    /// # Errors
    /// [`Error::Config`].
    pub fn validate(&self, segment: usize) -> Result<()> {
        let range = |name: &str, v: u64, lo: u64, hi: u64| -> Result<()> {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(Error::config(
                    name,
                    format!("{v}: expected an integer in {lo}..={hi}"),
                ))
            }
        };
        range("DSPARK_IB_SLOTS", self.slots as u64, 2, 256)?;
        range("DSPARK_IB_TIMEOUT", self.timeout.into(), 1, 31)?;
        range("DSPARK_IB_RETRY_CNT", self.retry_cnt.into(), 0, 7)?;
        range("DSPARK_IB_RNR_RETRY", self.rnr_retry.into(), 0, 6)?;
        range("DSPARK_IB_SL", self.service_level.into(), 0, 15)?;
        if let Some(b) = self.slot_bytes {
            if b < segment {
                return Err(Error::config(
                    "DSPARK_IB_SLOT_BYTES",
                    format!(
                        "{b} bytes is smaller than the segment size {segment} (DSPARK_CHUNK_BYTES): \
                         a slot must hold a whole segment"
                    ),
                ));
            }
            if b > MAX_IB_SLOT {
                return Err(Error::config(
                    "DSPARK_IB_SLOT_BYTES",
                    format!("{b} bytes: a slot holds at most 1 GiB"),
                ));
            }
        }
        Ok(())
    }
}

/// `host:port`, bracketing IPv6 literals.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Splits `host:port` (IPv6 as `[addr]:port`).
pub fn split_host_port(s: &str) -> std::result::Result<(String, u16), String> {
    let s = s.trim();
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, p) = rest
            .split_once("]:")
            .ok_or_else(|| format!("{s:?} is not [ipv6]:port"))?;
        (h, p)
    } else {
        s.rsplit_once(':')
            .ok_or_else(|| format!("{s:?} is not host:port (no port)"))?
    };
    if host.is_empty() {
        return Err(format!("{s:?} has no host"));
    }
    let port: u16 = port
        .parse()
        .map_err(|_| format!("{s:?}: {port:?} is not a port number"))?;
    if port == 0 {
        return Err(format!("{s:?}: port 0 is not a rendezvous port"));
    }
    Ok((host.to_string(), port))
}

/// Parses `1234`, `64K`, `16M`, `1G` (binary multiples; `KiB`/`MB` spellings accepted).
pub fn parse_size(s: &str) -> Option<usize> {
    let t = s.trim().to_ascii_uppercase();
    let t = t.trim_end_matches('B').trim_end_matches('I');
    let (num, mult) = match t.chars().last()? {
        'K' => (&t[..t.len() - 1], 1usize << 10),
        'M' => (&t[..t.len() - 1], 1 << 20),
        'G' => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let n: usize = num.trim().parse().ok()?;
    n.checked_mul(mult)
}

#[cfg(test)]
mod tests;
