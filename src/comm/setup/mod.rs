//! Setup: how a communicator is built, in one place.
//!
//! 1. **Bootstrap**: the rendezvous with the other ranks ([`crate::bootstrap`]); rank 0 is
//!    found through `DSPARK_ROOT_ADDR`/`MASTER_ADDR`, a key-value store (`rendezvous.rs`) or
//!    a parent communicator (`split.rs`), which all end in [`Communicator::init_inner`].
//! 2. **Transport choice**, job-wide, through the bootstrap ([`choose_transport`]). Each
//!    candidate is a [`negotiate::Candidate`] run by the one driver [`negotiate::negotiate`]
//!    (announce an offer, all-gather, decide, connect, confirm), with its pure decision
//!    unit-tested without sockets and its offers typed and fuzzed ([`offer`]):
//!    - `shm.rs`: shared memory when every rank is on one host (equal host identities,
//!      `DSPARK_HOST_ID` or the host name, and equal boot ids) and no rank asks for TCP or
//!      verbs; and, in a job over several hosts, shared memory among the ranks of each host
//!      that has several (the transport is then [`MixedTransport`], `shm+tcp`);
//!    - `verbs.rs`: verbs where every rank has a usable RDMA port and no rank asks for TCP,
//!      else TCP (or [`Error::Unavailable`] everywhere where a rank asked for verbs or shm).
//! 3. **Direct region** (`region.rs`): once verbs found a usable port, the memory this rank
//!    brings for GPUDirect RDMA (GPU memory, its host emulation in tests, or why there is
//!    none), registered by the transport before the connection information is exchanged;
//!    kept only where GPUDirect RDMA is used job-wide, freed otherwise.
//! 4. **Path decision**: `DSPARK_DATA_PATH` checked against every rank's announced
//!    capability (`gpu-direct` that cannot be had is an error here, naming the rank).
//! 5. **Engine**: the engine over the transport, its operation queue and progress thread.
//!
//! Transports know nothing of this: they take plain options ([`VerbsOptions`],
//! [`TcpOptions`], [`ShmOptions`]) built here from the [`Config`].
//!
//! [`VerbsOptions`]: crate::transport::verbs::VerbsOptions
//! [`ShmOptions`]: crate::transport::shm::ShmOptions

use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::device::GpuState;
use super::{work, CommInfo, Communicator, DirectRegionFact};
use crate::bootstrap::{self, Bootstrap};
use crate::config::Config;
use crate::engine::{Engine, EngineOptions};
use crate::error::{Error, Result};
use crate::gpu::direct::DirectRegion;
use crate::path::{self, GpuDirectCapability, PathPolicy};
use crate::plan;
use crate::plan::model::{self, CostModel, Costs, Link, Medium};
use crate::transport::mixed::{self, MixedTransport};
use crate::transport::tcp::{TcpOptions, TcpTransport};
use crate::transport::{Transport, TransportKind};

pub(crate) mod crowd;
mod negotiate;
pub(crate) mod offer;
pub(crate) mod once;
mod probe;
pub(crate) mod quota;
mod region;
mod shm;
mod verbs;

use region::capabilities_of;

/// What init learned besides the transport, for [`CommInfo`].
struct Facts {
    /// The address of this rank's data listener (None for a world of one or a given
    /// transport).
    data_ip: Option<std::net::IpAddr>,
    /// What every rank of this communicator knows alike: rank 0's data address as the rank
    /// table carries it (None without one: the configured root address stands in).
    rank0_addr: Option<std::net::SocketAddr>,
    /// Where each rank runs, from the rank table (its host for `CommInfo::hosts`, and the
    /// flight record's places; default entries without a table).
    places: Vec<crate::engine::places::Place>,
    local_ranks: usize,
    /// The ranks that share this rank's CPUs, in words ([`crowd::Crowd::describe`]).
    cpu_sharing: String,
    /// Per rank, the transport among its host's ranks, when it is not the communicator's
    /// transport for every pair (mixed communicators).
    intra_host: Option<Vec<TransportKind>>,
    transport_reason: Option<String>,
    data_path: PathPolicy,
    gpu_direct: Vec<GpuDirectCapability>,
    direct_region: DirectRegionFact,
    /// Where the cost model's constants came from.
    model_source: String,
    /// How the ranks authenticated each other.
    auth: crate::config::JobAuth,
}

/// The flight record's `communicator_id`: what every rank of a communicator knows alike
/// and other communicators do not (rank 0's data address from the rank table, each
/// communicator's own listener, else the configured root address; the job id; the size),
/// hashed: 16 hex digits. The rank table's address, not each rank's spelling of the root
/// (`localhost` here, `127.0.0.1` there).
fn communicator_id(config: &Config, rank0: Option<std::net::SocketAddr>) -> String {
    let text = format!(
        "dspark flight communicator\0{}\0{}\0{}",
        rank0.map_or_else(|| config.root_addr.clone(), |a| a.to_string()),
        config.job_id.as_deref().unwrap_or(""),
        config.world_size
    );
    bootstrap::auth::sha256(text.as_bytes())[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether flight records can be written into `dir`: it is made if missing, and a file is
/// written there and removed.
fn dump_dir_writable(dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    // Two communicators of one process may check at once: a name of each check's own.
    static PROBES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let k = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let probe = dir.join(format!(".dspark-probe-{}-{k}", std::process::id()));
    std::fs::write(&probe, b"")?;
    std::fs::remove_file(&probe)
}

/// Whether this process warned that a job is open beyond loopback.
static OPEN_WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Warns, once per process (`warned`), that a job is open on an interface other than
/// loopback: anybody who reaches rank 0's port can join it. Returns whether it warned.
fn warn_if_open(
    auth: &crate::config::JobAuth,
    ip: std::net::IpAddr,
    warned: &std::sync::atomic::AtomicBool,
) -> bool {
    use crate::config::JobAuth;
    let exposed = auth.is_open() || matches!(auth, JobAuth::Store);
    let warn =
        exposed && !ip.is_loopback() && !warned.swap(true, std::sync::atomic::Ordering::Relaxed);
    const FIX: &str = "give every rank a secret with DSPARK_JOB_TOKEN_FILE (umask 077; head -c32 \
                       /dev/urandom | base64 > ~/.dspark-token; \
                       DSPARK_JOB_TOKEN_FILE=~/.dspark-token)";
    if warn && matches!(auth, JobAuth::Store) {
        tracing::warn!(
            "this job's secret is published in torch's TCPStore, which has no authentication, \
             and the job runs on {ip}: a client that reaches MASTER_PORT can read it and join, \
             stall or kill the job; {FIX}"
        );
    } else if warn {
        tracing::warn!(
            "this job is {auth} on {ip}: a stranger that reaches it can join, stall or kill the \
             job; {FIX}"
        );
    }
    warn
}

/// Spin time when ranks do not outnumber cores / when they do.
const SPIN: Duration = Duration::from_micros(50);
/// The largest all_reduce run one-shot through shared slots
/// ([`crate::plan::Algorithm::OneShot`]): measured against recursive doubling over the rings
/// on 2 and 4 ranks (benches/RESULTS.md).
const ONE_SHOT_MAX_BYTES: usize = 4096;

/// The largest all_reduce a communicator whose every peer is over `kind` runs one-shot
/// through its shared slots (0: the transport has none): the choice made before the cost
/// model, which never picks it. For tools that explain the choice (`dspark model`); init
/// takes the same bound from the transport it built.
pub fn one_shot_max_bytes(kind: TransportKind) -> usize {
    match kind {
        TransportKind::Shm => crate::transport::shm::SLOT_CAPACITY.min(ONE_SHOT_MAX_BYTES),
        _ => 0,
    }
}
const SPIN_OVERSUBSCRIBED: Duration = Duration::from_micros(100);

fn engine_options(
    cfg: &Config,
    oversubscribed: bool,
    per_host: usize,
    model: CostModel,
) -> EngineOptions {
    EngineOptions {
        model,
        timeout: cfg.timeout,
        segment_bytes: cfg.segment_bytes,
        spin: cfg.spin.unwrap_or(if oversubscribed {
            SPIN_OVERSUBSCRIBED
        } else {
            SPIN
        }),
        yield_while_spinning: oversubscribed,
        force_algo: cfg.algo,
        per_host,
        one_shot_bytes: 0,
        one_shot_slot_bytes: 0,
    }
}

/// The model's constants for `medium`: from `cfg.tune_file` when it has them, else the
/// defaults; and where they came from, in words. Never fails: a file that cannot be read or
/// parsed is a warning naming it.
fn load_costs(cfg: &Config, medium: Medium) -> (Costs, String) {
    let defaults = (Costs::defaults(medium), "defaults".to_string());
    let Some(path) = &cfg.tune_file else {
        return defaults;
    };
    let explicit = cfg.sources.iter().any(|(k, _)| k == "tune file");
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => return defaults,
        Err(e) => {
            let what = format!(
                "tune file {}: cannot read it ({e}); the cost model uses its default constants",
                path.display()
            );
            once::warn_once!(key: &what, "{what}");
            return (
                defaults.0,
                format!("defaults: {} unreadable", path.display()),
            );
        }
    };
    match model::parse_tune_file(&text) {
        Ok(entries) => match entries.into_iter().find(|(m, _)| *m == medium) {
            Some((_, c)) => (c, format!("from {}", path.display())),
            None => (
                defaults.0,
                format!(
                    "defaults: {} has no {} entry",
                    path.display(),
                    medium.name()
                ),
            ),
        },
        Err(e) => {
            let what = format!(
                "tune file {}: {e}; the cost model uses its default constants (run `dspark \
                 tune` to rewrite it)",
                path.display()
            );
            once::warn_once!(key: &what, "{what}");
            (
                defaults.0,
                format!("defaults: {} is invalid", path.display()),
            )
        }
    }
}

/// The medium whose constants a transport uses (`shm+tcp`: TCP's, whose hops decide).
fn medium_of(kind: TransportKind) -> Medium {
    match kind {
        TransportKind::Mem => Medium::Mem,
        TransportKind::Tcp | TransportKind::ShmTcp => Medium::Tcp,
        TransportKind::Shm => Medium::Shm,
        TransportKind::Verbs => Medium::Verbs,
    }
}

/// The host's online cores, whatever this process is bound to (a launcher that binds each
/// rank to one core does not make the ranks share it).
fn host_cores() -> usize {
    nix::unistd::sysconf(nix::unistd::SysconfVar::_NPROCESSORS_ONLN)
        .ok()
        .flatten()
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// File descriptors a rank of a world of `world` may hold at once: rank 0 holds a
/// connection to every rank while the job meets, an all-to-all over TCP connects every pair,
/// and listeners, shared-memory segments and event fds come on top.
fn descriptors_needed(world: usize) -> u64 {
    2 * world as u64 + 64
}

/// The soft `RLIMIT_NOFILE` to set for `need` descriptors under limits `(soft, hard)`: raised
/// as far as `need` allows within the hard limit (as Open MPI raises it at start), never
/// lowered; `None` when it is high enough already.
fn raised_nofile(soft: u64, hard: u64, need: u64) -> Option<u64> {
    (soft < need && soft < hard).then(|| need.min(hard))
}

/// Makes room for the descriptors a world of `world` may need: the usual soft limit of 1024
/// would fail rank 0's rendezvous with "too many open files" from about 1000 ranks, and an
/// all-to-all over TCP on any rank from about 1000. Says so where the hard limit is too low.
fn ensure_descriptors(rank: usize, world: usize) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let need = descriptors_needed(world);
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    if let Some(new) = raised_nofile(soft, hard, need) {
        match setrlimit(Resource::RLIMIT_NOFILE, new, hard) {
            Ok(()) => tracing::debug!(rank, soft, new, "raised the open-file limit"),
            Err(e) => once::warn_once!(
                key: &format!("open-file limit not raised to {need}: {e}"),
                rank,
                soft,
                need,
                error = %e,
                "could not raise the open-file limit"
            ),
        }
    }
    if hard < need {
        once::warn_once!(
            key: &format!("open-file limit {hard} below {need}"),
            rank,
            world,
            limit = hard,
            need,
            "the open-file limit (ulimit -Hn) is below what a world this size may need: rank 0 \
             connects to every rank while the job meets, and an all-to-all over TCP connects \
             every pair; raise it (ulimit -n, LimitNOFILE=, /etc/security/limits.conf)"
        );
    }
}

impl Communicator {
    /// Joins the job described by the environment (see [`crate::config`]).
    ///
    /// # Errors
    /// [`Error::Config`] for bad or missing variables; the errors of [`Communicator::init`].
    pub fn from_env() -> Result<Self> {
        Self::init(Config::from_env()?)
    }

    /// Joins the job described by `config`: rendezvous with the other ranks, connect to every
    /// one of them, agree on the transport.
    ///
    /// # Errors
    /// [`Error::Config`] (inconsistent settings, rendezvous port in use), [`Error::Timeout`]
    /// (rank 0 unreachable, ranks missing by the deadline), [`Error::Mismatch`] (ranks of
    /// another world size, job or version), [`Error::Unavailable`] (`DSPARK_TRANSPORT=verbs`
    /// that cannot be honoured).
    pub fn init(config: Config) -> Result<Self> {
        let rank = config.rank;
        Self::init_inner(config, None).map_err(|e| e.at_rank(rank))
    }

    /// [`Communicator::init`], where rank 0 accepts the others on `root` (already bound)
    /// instead of binding `config.root_addr`.
    pub(super) fn init_inner(config: Config, root: Option<std::net::TcpListener>) -> Result<Self> {
        if let crate::config::Rendezvous::TorchStore { prefix } = &config.rendezvous {
            if config.world_size > 1 {
                let prefix = prefix.clone();
                return Self::init_through_torch_store(config, &prefix);
            }
        }
        // The bootstrap's options, built once: this is where the configuration is checked.
        let boot_opts = bootstrap::BootstrapOptions::from_config(&config)?;
        ensure_descriptors(config.rank, config.world_size);
        // Only the pairs the collectives' schedules use connect now (O(log n) per rank):
        // the transports that need every pair complete the mesh, TCP connects the others
        // on first use.
        let world = config.world_size;
        let links = move |r: usize| plan::algo::standing_partners(world, r);
        let (mut boot, mut streams) = bootstrap::rendezvous_with(&boot_opts, root, Some(&links))?;
        let shrink_door = super::shrink::Door::open(&mut boot, &mut streams, &config)?;
        let local = boot.local_ranks();
        // Whether this rank shares its CPUs: every rank's kernel and affinity mask (crowd.rs).
        let seats: Vec<crowd::Seat> = boot
            .all_gather(&mut streams, &crowd::Seat::mine().encode())?
            .iter()
            .map(|b| crowd::Seat::decode(b))
            .collect();
        let crowd = crowd::crowd(config.rank, &seats, local, host_cores());
        if !crowd.by_seats() || crowd.over_quota() {
            // A degraded count: whether ranks share CPUs (and so how they spin) rests on the
            // host's rank and core counts, which miss ranks pinned together. Or more ranks
            // than their cgroup's CPU quota allows: every wait that spins costs them all.
            let what = crowd.describe();
            once::warn_once!(key: &what, rank = config.rank, "CPU sharing: {what}");
        }
        // Every rank agrees on the transport through the bootstrap (see `choose_transport`).
        // `region` first: a pattern's bindings drop last to first, and the GPU memory must
        // outlive the transport that registered it, should init fail before `assemble`.
        let Chosen {
            region,
            transport,
            reason,
            intra_host,
            gpu_direct,
            direct_region,
        } = choose_transport(&mut boot, &config, streams)?;
        let hosts: Vec<String> = boot.peers.iter().map(|p| p.host.clone()).collect();
        // The cost model: this transport's constants, and how crowded the cores are. Every
        // rank takes rank 0's, so that all choose alike (hosts may hold different tune files
        // or numbers of ranks).
        let medium = medium_of(transport.kind());
        let (costs, mut model_source) = load_costs(&config, medium);
        let mut model = CostModel {
            segment_bytes: config.segment_bytes,
            local_ranks: local,
            cores: host_cores(),
            ..CostModel::new(medium, costs)
        };
        // Rank 0's model, and whether rank 0 asks for the link probe (its first byte).
        let mut link_probe = config.link_probe;
        if config.world_size > 1 {
            let mut mine = vec![u8::from(config.link_probe)];
            mine.extend(model::encode(&model, &model_source));
            let root = boot.broadcast_root(&mine)?;
            link_probe = root.first() == Some(&1);
            match root.get(1..).and_then(model::decode) {
                Some((m, src)) => {
                    if config.rank != 0 && (m != model || src != model_source) {
                        model_source = format!("rank 0's: {src}");
                    } else {
                        model_source = src;
                    }
                    model = m;
                }
                None => {
                    return Err(Error::Mismatch {
                        rank: Some(config.rank),
                        peer: Some(0),
                        op: "init".into(),
                        what: "rank 0's cost model could not be decoded (another version?)".into(),
                    })
                }
            }
        }
        let opts = engine_options(
            &config,
            crowd.oversubscribed(),
            plan::uniform_per_host(&hosts),
            model,
        );
        let auth = config.auth();
        let data_ip = (config.world_size > 1).then(|| boot.peers[config.rank].addr.ip());
        if let Some(ip) = data_ip {
            warn_if_open(&auth, ip, &OPEN_WARNED);
        }
        let facts = Facts {
            auth,
            data_ip,
            rank0_addr: boot.peers.first().map(|p| p.addr),
            places: boot
                .peers
                .iter()
                .map(|p| crate::engine::places::Place {
                    host: p.host.clone(),
                    addr: if p.addr.port() == 0 {
                        String::new()
                    } else {
                        p.addr.to_string()
                    },
                    pid: p.pid,
                })
                .collect(),
            local_ranks: local,
            cpu_sharing: crowd.describe(),
            intra_host,
            transport_reason: reason,
            model_source: model_source.clone(),
            data_path: config.data_path,
            gpu_direct,
            direct_region,
        };
        drop(boot);
        let mut comm = Self::assemble(&config, transport, opts, facts)?;
        comm.region = region.map(Arc::new);
        comm.shrink_door = shrink_door;
        comm.check_path_policy()?;
        if let Some(peer) = probe::partner(&hosts).filter(|_| link_probe) {
            let start = std::time::Instant::now();
            let link = probe::run(&comm, peer, plan::uniform_per_host(&hosts))?;
            comm.adopt_link(link, peer, &model_source, start.elapsed())?;
        }
        Ok(comm)
    }

    /// Takes the link the probe measured (every rank the same, rank 0's) into the cost model
    /// of this communicator and of its engine, and into the model line of its facts.
    fn adopt_link(
        &mut self,
        link: Option<Link>,
        peer: usize,
        source: &str,
        took: Duration,
    ) -> Result<()> {
        let Some(link) = link else {
            tracing::warn!(
                rank = self.rank,
                peer,
                "the link probe between rank 0 and rank {peer} gave no usable constants: the \
                 cost model prices the hops between hosts at its transport's constants"
            );
            return Ok(());
        };
        let model = CostModel {
            link: Some(link),
            ..self.opts.model
        };
        self.shared.exclusive(None, |eng| {
            eng.set_model(model);
            Ok(())
        })?;
        self.opts.model = model;
        self.info.cost_model = format!(
            "{model} ({source}; link: rank 0 ↔ rank {peer}, {:.1} ms)",
            took.as_secs_f64() * 1e3
        );
        Ok(())
    }

    /// A communicator over an already connected transport (for example
    /// [`crate::transport::mem`] in tests). `config` supplies the deadline, segment size,
    /// spin time and algorithm; its rendezvous fields are ignored.
    ///
    /// A test hook, with the `testing` feature.
    ///
    /// # Example
    ///
    /// Three ranks as threads over the in-process transport:
    ///
    /// ```
    /// use dspark::internals::transport::mem::MemFabric;
    /// use dspark::{Communicator, Config, ReduceOp};
    ///
    /// let fabric = MemFabric::new(3, 4);
    /// let cfg = Config::new(0, 1, "");
    /// std::thread::scope(|s| {
    ///     for r in 0..3 {
    ///         let (t, cfg) = (fabric.transport(r), &cfg);
    ///         s.spawn(move || {
    ///             let comm = Communicator::from_transport(r, 3, Box::new(t), cfg).unwrap();
    ///             let mut v = vec![r as f32; 5];
    ///             comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    ///             assert_eq!(v, vec![3.0; 5]);
    ///         });
    ///     }
    /// });
    /// ```
    ///
    /// # Errors
    /// [`Error::Config`] when `rank`/`world` are inconsistent.
    #[cfg(feature = "testing")]
    pub fn from_transport(
        rank: usize,
        world: usize,
        transport: Box<dyn Transport>,
        config: &Config,
    ) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(Error::config(
                "rank",
                format!("rank {rank} of world size {world}"),
            ));
        }
        // The in-process transport's defaults (no tune file: tests do not depend on the
        // machine's).
        let model = CostModel {
            segment_bytes: config.segment_bytes,
            ..CostModel::new(Medium::Mem, Costs::defaults(Medium::Mem))
        };
        let opts = engine_options(config, false, 0, model);
        let facts = Facts {
            auth: crate::config::JobAuth::Alone,
            data_ip: None,
            rank0_addr: None,
            places: vec![crate::engine::places::Place::default(); world],
            local_ranks: world,
            cpu_sharing: "threads of one process (not counted)".into(),
            intra_host: None,
            transport_reason: None,
            model_source: "defaults".into(),
            data_path: config.data_path,
            gpu_direct: vec![
                GpuDirectCapability::Unavailable(path::MEM_STAGED_REASON.into());
                world
            ],
            direct_region: DirectRegionFact::NotAllocated("the transport was given".into()),
        };
        let config = Config {
            rank,
            world_size: world,
            ..config.clone()
        };
        let comm = Self::assemble(&config, transport, opts, facts)?;
        comm.check_path_policy()?;
        Ok(comm)
    }

    fn assemble(
        config: &Config,
        mut transport: Box<dyn Transport>,
        mut opts: EngineOptions,
        facts: Facts,
    ) -> Result<Self> {
        let (rank, world) = (config.rank, config.world_size);
        // Small all_reduces go one-shot through shared slots where the transport has them.
        opts.one_shot_slot_bytes = transport.slots().map_or(0, |s| s.capacity());
        opts.one_shot_bytes = opts.one_shot_slot_bytes.min(ONE_SHOT_MAX_BYTES);
        let peer_transports: Vec<TransportKind> =
            (0..world).map(|p| transport.peer_kind(p)).collect();
        let inter_host = match transport.kind() {
            TransportKind::ShmTcp => TransportKind::Tcp,
            k => k,
        };
        let info = CommInfo {
            transport: transport.kind(),
            peer_transports,
            intra_host: facts
                .intra_host
                .unwrap_or_else(|| vec![transport.kind(); world]),
            inter_host,
            transport_detail: transport.describe(),
            transport_reason: facts.transport_reason,
            cost_model: format!("{} ({})", opts.model, facts.model_source),
            hosts: facts.places.iter().map(|p| p.host.clone()).collect(),
            local_ranks: facts.local_ranks,
            cpu_sharing: facts.cpu_sharing,
            spin: opts.spin,
            spin_yields: opts.yield_while_spinning,
            segment_bytes: opts.segment_bytes,
            timeout: opts.timeout,
            data_path: facts.data_path,
            gpu_direct: facts.gpu_direct,
            direct_region: facts.direct_region,
            connected_at_init: transport.connected_peers(),
            auth: facts.auth,
            rendezvous: if world == 1 {
                "none (a world of one)".into()
            } else {
                let source = config
                    .sources
                    .iter()
                    .find(|(k, _)| k == "root address")
                    .map_or("Config::root_addr", |(_, v)| v.as_str());
                match config.sources.iter().find(|(k, _)| k == "rendezvous") {
                    Some((_, via)) => {
                        format!("rank 0 at {} from {source}, via {via}", config.root_addr)
                    }
                    None => format!("rank 0 at {} from {source}", config.root_addr),
                }
            },
        };
        let direct = transport.direct();
        let direct_layout = direct.and_then(|d| d.direct_layout());
        let direct_host = direct.and_then(|d| d.direct_host_region());
        let mut engine = Engine::new(rank, world, transport, opts.clone());
        let comm_id = communicator_id(config, facts.rank0_addr);
        engine.configure_flight(
            config.flight_entries,
            config.flight_dump.clone(),
            comm_id.clone(),
            facts.places,
        );
        if let (Some(dir), true) = (&config.flight_dump, config.flight_entries > 0) {
            // Found now, not after the hang whose record it was to keep.
            if let Err(e) = dump_dir_writable(dir) {
                let what = format!(
                    "DSPARK_FR_DUMP={}: {e}: a failure's flight record cannot be written there",
                    dir.display()
                );
                once::warn_once!(key: &what, rank, "{what}");
            }
        }
        if let Some(prefix) = &config.trace {
            let path = engine.start_trace(prefix, &comm_id)?;
            tracing::info!(rank, "DSPARK_TRACE: tracing to {}", path.display());
        }
        let shared = work::Shared::new(engine);
        let progress = {
            let s = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("dspark-progress-{rank}"))
                .spawn(move || s.progress())
                .map_err(|e| {
                    Error::io(
                        Some(rank),
                        None,
                        "starting the communicator's progress thread",
                        e,
                    )
                })?
        };
        Ok(Communicator {
            rank,
            world,
            info,
            forced: Mutex::new(opts.force_algo),
            opts,
            shared,
            progress: Some(progress),
            direct_layout,
            direct_host,
            config: config.clone(),
            data_ip: facts.data_ip,
            splits: std::sync::atomic::AtomicU64::new(0),
            shrink_door: None,
            gpu: Mutex::new(GpuState::default()),
            policy: Mutex::new(facts.data_path),
            region: None,
        })
    }
}

/// What the job-wide transport choice gave this rank.
struct Chosen {
    transport: Box<dyn Transport>,
    /// Why not the fastest transport, where one was a candidate and failed.
    reason: Option<String>,
    /// Per rank, the transport among its host's ranks (mixed communicators).
    intra_host: Option<Vec<TransportKind>>,
    gpu_direct: Vec<GpuDirectCapability>,
    direct_region: DirectRegionFact,
    /// The GPU memory of the direct region, where this rank keeps it.
    region: Option<DirectRegion>,
}

/// "a; b", "a", "b" or nothing.
fn join_reasons(a: Option<String>, b: Option<String>) -> Option<String> {
    match (a, b) {
        (Some(a), Some(b)) => Some(format!("{a}; {b}")),
        (a, b) => a.or(b),
    }
}

/// Agrees with every other rank, through the bootstrap, on the transport (each candidate in
/// its own module, all through [`negotiate::negotiate`]): shared memory when every rank is on
/// one host ([`shm::select`]); else verbs where every rank has a usable RDMA port
/// ([`verbs::select`]); else TCP between hosts, with shared memory among the ranks of each
/// host that has several ([`shm::select_within_hosts`]; the transport is then
/// [`MixedTransport`], `shm+tcp`). The direct region is set up only once verbs found a usable
/// port (no GPU context or allocation on machines that end up on TCP).
fn choose_transport(
    boot: &mut Bootstrap,
    config: &Config,
    mut streams: Vec<Option<TcpStream>>,
) -> Result<Chosen> {
    let world = config.world_size;
    let why_not_shm = match shm::select(boot, config, &mut streams)? {
        Ok(t) => {
            return Ok(Chosen {
                transport: Box::new(t),
                reason: None,
                intra_host: None,
                gpu_direct: vec![
                    GpuDirectCapability::Unavailable(path::SHM_STAGED_REASON.into());
                    world
                ],
                direct_region: DirectRegionFact::NotAllocated(
                    "the job runs over shared memory".into(),
                ),
                region: None,
            })
        }
        Err(why) => why,
    };
    let mut region = None;
    let why_not_verbs = match verbs::select(boot, config, &mut streams, &mut region)? {
        Ok(mut t) => {
            let gpu_direct = capabilities_of(t.direct_infos());
            let direct_region = region::settle_region(&mut t, &mut region, config);
            return Ok(Chosen {
                transport: t,
                reason: why_not_shm,
                intra_host: None,
                gpu_direct,
                direct_region,
                region,
            });
        }
        Err(why) => why,
    };
    // The verbs transport, and with it any registration of the region, is gone: device
    // memory is staged over TCP.
    let direct_region =
        region::free_unused_region(&mut region, None, config.rank, "the job runs over TCP")
            .unwrap_or_else(|| DirectRegionFact::NotAllocated("the job runs over TCP".into()));
    // Several hosts: shared memory within each host that has several ranks, TCP between
    // hosts.
    let within = shm::select_within_hosts(boot, config, &mut streams)?;
    let opts = TcpOptions {
        socket_buffer: config.socket_buffer,
    };
    let mut tcp = TcpTransport::new(config.rank, world, streams, opts)?;
    let mut shm = within.shm;
    if let Some(l) = boot.links() {
        match shm.take() {
            // One listener, two transports: the shm side's liveness connections on first use
            // go through TCP's links.
            Some((s, local)) => {
                let (net, own) = mixed::share_links(Box::new(l), local.clone());
                tcp = tcp.with_links(net);
                shm = Some((s.with_links(own), local));
            }
            None => tcp = tcp.with_links(Box::new(l)),
        }
    }
    let transport: Box<dyn Transport> = match shm {
        Some((shm, local)) => {
            let t = MixedTransport::new(config.rank, world, shm, Box::new(tcp), local)?;
            tracing::info!(
                rank = config.rank,
                transport = %t.describe(),
                "using shared memory within the host, TCP between hosts"
            );
            Box::new(t)
        }
        None => Box::new(tcp),
    };
    Ok(Chosen {
        transport,
        reason: join_reasons(why_not_shm, join_reasons(why_not_verbs, within.why)),
        intra_host: Some(within.intra),
        gpu_direct: vec![GpuDirectCapability::Unavailable(path::TCP_STAGED_REASON.into()); world],
        direct_region,
        region: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dump_directory_is_checked_at_init() {
        let base = std::env::temp_dir().join(format!("dspark-frdir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let made = base.join("made/here");
        dump_dir_writable(&made).expect("made and writable");
        assert!(made.is_dir());
        assert_eq!(
            std::fs::read_dir(&made).unwrap().count(),
            0,
            "the probe is removed"
        );
        let file = base.join("a-file");
        std::fs::write(&file, b"x").unwrap();
        assert!(dump_dir_writable(&file).is_err(), "a file is no directory");
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn an_open_job_beyond_loopback_warns_once_and_no_other_does() {
        use crate::config::JobAuth;
        let warned = std::sync::atomic::AtomicBool::new(false);
        let open = JobAuth::Open { port: 29500 };
        let lo: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let lan: std::net::IpAddr = "10.0.0.7".parse().unwrap();
        assert!(!warn_if_open(&open, lo, &warned));
        assert!(!warn_if_open(&JobAuth::Spawner, lan, &warned));
        assert!(!warn_if_open(&JobAuth::Store, lo, &warned));
        assert!(warn_if_open(&open, lan, &warned));
        assert!(!warn_if_open(&open, lan, &warned), "twice");
        // A secret in torch's store, on a network: its clients can read it.
        let fresh = std::sync::atomic::AtomicBool::new(false);
        assert!(warn_if_open(&JobAuth::Store, lan, &fresh));
    }

    #[test]
    fn the_open_file_limit_is_raised_to_what_the_world_needs_within_the_hard_limit() {
        // 4096 ranks under the common 1024 / 524288 limits: raised to 2·4096 + 64.
        assert_eq!(descriptors_needed(4096), 8256);
        assert_eq!(raised_nofile(1024, 524_288, 8256), Some(8256));
        // A hard limit below the need: as far as it goes.
        assert_eq!(raised_nofile(1024, 4096, 8256), Some(4096));
        // Already enough, or no room: untouched (never lowered).
        assert_eq!(raised_nofile(20_000, 20_000, 8256), None);
        assert_eq!(raised_nofile(4096, 4096, 8256), None);
        assert_eq!(raised_nofile(1024, 524_288, 200), None);
    }
}
