//! Setup: how a communicator is built, in one place.
//!
//! 1. **Bootstrap**: the rendezvous with the other ranks ([`crate::bootstrap`]); rank 0 is
//!    found through `DSPARK_ROOT_ADDR`/`MASTER_ADDR`, a key-value store (`rendezvous.rs`) or
//!    a parent communicator (`split.rs`), which all end in [`Communicator::init_inner`].
//! 2. **Transport choice**, job-wide, through the bootstrap: shared memory when every rank is
//!    on one host (equal host identities, `DSPARK_HOST_ID` or the host name, and equal boot
//!    ids) and no rank asks for TCP or verbs ([`select_shm`]); else verbs where every rank
//!    has a usable RDMA port and no rank asks for TCP, else TCP between hosts (or
//!    [`Error::Unavailable`] everywhere where a rank asked for verbs or shm) with shared
//!    memory among the ranks of each host that has several, unless a rank asked for TCP
//!    ([`select_mixed`]; the transport is then [`MixedTransport`], `shm+tcp`).
//! 3. **Direct region**: once verbs found a usable port, the memory this rank brings for
//!    GPUDirect RDMA (GPU memory, its host emulation in tests, or why there is none),
//!    registered by the transport before the connection information is exchanged.
//! 4. **Path decision**: `DSPARK_DATA_PATH` checked against every rank's announced
//!    capability (`gpu-direct` that cannot be had is an error here, naming the rank).
//! 5. **Engine**: the engine over the transport, its operation queue and progress thread.
//!
//! Transports know nothing of this: they take plain options ([`VerbsOptions`],
//! [`TcpOptions`]) built here from the [`Config`].

use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::device::{GpuState, DIRECT_SEND_SLOTS};
use super::{work, CommInfo, Communicator, DirectRegionFact};
use crate::bootstrap::{self, Bootstrap};
use crate::config::{Config, TransportChoice};
use crate::engine::{Engine, EngineOptions};
use crate::error::{Error, Result};
use crate::gpu::direct::DirectRegion;
use crate::path::{self, GpuDirectCapability, PathPolicy};
use crate::plan;
use crate::plan::model::{self, CostModel, Costs, Medium};
use crate::transport::mixed::{self, MixedTransport};
use crate::transport::shm::{self, SegInfo, ShmOptions, ShmTransport};
use crate::transport::tcp::{TcpOptions, TcpTransport};
use crate::transport::verbs::wire::{self, Blob, DirectInfo, DirectKind};
use crate::transport::verbs::{self, DirectSpec, VerbsOptions, VerbsTransport};
use crate::transport::{Transport, TransportKind, HEADER_LEN};

/// What init learned besides the transport, for [`CommInfo`].
struct Facts {
    /// The address of this rank's data listener (None for a world of one or a given
    /// transport).
    data_ip: Option<std::net::IpAddr>,
    hosts: Vec<String>,
    local_ranks: usize,
    /// Per rank, the transport among its host's ranks, when it is not the communicator's
    /// transport for every pair (mixed communicators).
    intra_host: Option<Vec<TransportKind>>,
    transport_reason: Option<String>,
    data_path: PathPolicy,
    gpu_direct: Vec<GpuDirectCapability>,
    direct_region: DirectRegionFact,
    /// Where the cost model's constants came from.
    model_source: String,
}

/// Spin time when ranks do not outnumber cores / when they do.
const SPIN: Duration = Duration::from_micros(50);
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
            tracing::warn!(
                "tune file {}: cannot read it ({e}); the cost model uses its default constants",
                path.display()
            );
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
            tracing::warn!(
                "tune file {}: {e}; the cost model uses its default constants (run `dspark \
                 tune` to rewrite it)",
                path.display()
            );
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

/// Rank 0's model and its source, as every rank adopts it (ranks that chose with different
/// constants would schedule one call differently).
fn encode_model(m: &CostModel, source: &str) -> Vec<u8> {
    let c = &m.costs;
    let mut out = vec![Medium::ALL.iter().position(|x| *x == m.medium).unwrap_or(0) as u8];
    for x in [
        c.alpha_us,
        c.beta_us_per_byte,
        c.gamma_us_per_byte,
        c.alpha_oversub_us,
    ] {
        out.extend_from_slice(&x.to_bits().to_le_bytes());
    }
    for x in [m.segment_bytes, m.local_ranks, m.cores, m.hier_min_bytes] {
        out.extend_from_slice(&(x as u64).to_le_bytes());
    }
    out.extend_from_slice(source.as_bytes());
    out
}

fn decode_model(b: &[u8]) -> Option<(CostModel, String)> {
    let medium = *Medium::ALL.get(usize::from(*b.first()?))?;
    let word = |i: usize| -> Option<u64> {
        let s = b.get(1 + 8 * i..9 + 8 * i)?;
        Some(u64::from_le_bytes(s.try_into().ok()?))
    };
    let f = |i| word(i).map(f64::from_bits);
    let costs = Costs {
        alpha_us: f(0)?,
        beta_us_per_byte: f(1)?,
        gamma_us_per_byte: f(2)?,
        alpha_oversub_us: f(3)?,
    };
    let u = |i| word(i).and_then(|x| usize::try_from(x).ok());
    let m = CostModel {
        medium,
        costs,
        segment_bytes: u(4)?,
        local_ranks: u(5)?,
        cores: u(6)?,
        hier_min_bytes: u(7)?,
    };
    let source = String::from_utf8_lossy(b.get(65..)?).into_owned();
    Some((m, source))
}

/// The host's online cores, whatever this process is bound to (a launcher that binds each
/// rank to one core does not make the ranks share it).
fn host_cores() -> usize {
    nix::unistd::sysconf(nix::unistd::SysconfVar::_NPROCESSORS_ONLN)
        .ok()
        .flatten()
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(cores)
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
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
            Err(e) => {
                tracing::warn!(rank, soft, need, error = %e, "could not raise the open-file limit")
            }
        }
    }
    if hard < need {
        tracing::warn!(
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
        let opts = bootstrap::BootstrapOptions::from_config(&config)?;
        ensure_descriptors(config.rank, config.world_size);
        // Only the pairs the collectives' schedules use connect now (O(log n) per rank):
        // the transports that need every pair complete the mesh, TCP connects the others
        // on first use.
        let world = config.world_size;
        let links = move |r: usize| plan::algo::standing_partners(world, r);
        let (mut boot, streams) = bootstrap::rendezvous_with(&opts, root, Some(&links))?;
        let local = boot.local_ranks();
        let oversubscribed = local > cores();
        // Every rank agrees on the transport through the bootstrap: verbs where every rank
        // has a usable RDMA port, else TCP everywhere (or Unavailable where verbs was asked).
        // The direct region is set up only once verbs found a usable port (no GPU context or
        // allocation on machines that end up on TCP).
        let mut region = None;
        let mut direct = |opts: &VerbsOptions, nic: &str| {
            let (spec, r) = direct_spec(&config, opts, nic);
            region = r;
            spec
        };
        let mut intra_host = None;
        let mut direct_region =
            DirectRegionFact::NotAllocated("the job runs over shared memory".into());
        let mut gpu_direct = vec![
            GpuDirectCapability::Unavailable(path::TCP_STAGED_REASON.into());
            config.world_size
        ];
        let (transport, reason): (Box<dyn Transport>, Option<String>) =
            match select_shm(&mut boot, &config, streams)? {
                ShmSelected::Shm(t) => {
                    gpu_direct =
                        vec![
                            GpuDirectCapability::Unavailable(path::SHM_STAGED_REASON.into());
                            config.world_size
                        ];
                    (Box::new(t), None)
                }
                ShmSelected::Not { streams, why } => {
                    let (t, reason): (Box<dyn Transport>, Option<String>) =
                        match select_transport(&mut boot, &config, streams, &mut direct)? {
                            Selected::Verbs(mut t) => {
                                gpu_direct = capabilities_of(t.direct_infos());
                                direct_region = settle_region(&mut t, &mut region, &config);
                                (t, None)
                            }
                            Selected::Tcp { streams, reason } => {
                                // The verbs transport, and with it any registration of the region, is
                                // gone: device memory is staged over TCP.
                                direct_region = free_unused_region(
                                    &mut region,
                                    None,
                                    config.rank,
                                    "the job runs over TCP",
                                )
                                .unwrap_or_else(|| {
                                    DirectRegionFact::NotAllocated("the job runs over TCP".into())
                                });
                                let opts = TcpOptions {
                                    socket_buffer: config.socket_buffer,
                                };
                                // Several hosts: shared memory within each host that has
                                // several ranks, TCP between hosts.
                                let mixed = select_mixed(&mut boot, &config, streams)?;
                                intra_host = Some(mixed.intra);
                                let mut tcp = TcpTransport::new(
                                    config.rank,
                                    config.world_size,
                                    mixed.streams,
                                    opts,
                                )?;
                                let mut shm = mixed.shm;
                                if let Some(l) = boot.links() {
                                    match shm.take() {
                                        // One listener, two transports: the shm side's
                                        // liveness connections on first use go through
                                        // TCP's links.
                                        Some((s, local)) => {
                                            let (net, own) =
                                                mixed::share_links(Box::new(l), local.clone());
                                            tcp = tcp.with_links(net);
                                            shm = Some((s.with_links(own), local));
                                        }
                                        None => tcp = tcp.with_links(Box::new(l)),
                                    }
                                }
                                let reason = match (reason, mixed.why) {
                                    (Some(r), Some(w)) => Some(format!("{r}; {w}")),
                                    (r, w) => r.or(w),
                                };
                                match shm {
                                    Some((shm, local)) => {
                                        let t = MixedTransport::new(
                                            config.rank,
                                            config.world_size,
                                            shm,
                                            Box::new(tcp),
                                            local,
                                        )?;
                                        tracing::info!(
                                            rank = config.rank,
                                            transport = %t.describe(),
                                            "using shared memory within the host, TCP between hosts"
                                        );
                                        (Box::new(t), reason)
                                    }
                                    None => (Box::new(tcp), reason),
                                }
                            }
                        };
                    let reason = match (why, reason) {
                        (Some(w), Some(r)) => Some(format!("{w}; {r}")),
                        (w, r) => w.or(r),
                    };
                    (t, reason)
                }
            };
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
        if config.world_size > 1 {
            let root = boot.broadcast_root(&encode_model(&model, &model_source))?;
            match decode_model(&root) {
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
            oversubscribed,
            plan::uniform_per_host(&hosts),
            model,
        );
        let facts = Facts {
            data_ip: (config.world_size > 1).then(|| boot.peers[config.rank].addr.ip()),
            hosts: boot.peers.iter().map(|p| p.host.clone()).collect(),
            local_ranks: local,
            intra_host,
            transport_reason: reason,
            model_source,
            data_path: config.data_path,
            gpu_direct,
            direct_region,
        };
        drop(boot);
        let mut comm = Self::assemble(&config, transport, opts, facts)?;
        comm.region = region.map(Arc::new);
        comm.check_path_policy()?;
        Ok(comm)
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
    /// use dspark::transport::mem::MemFabric;
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
            data_ip: None,
            hosts: vec![String::new(); world],
            local_ranks: world,
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
        transport: Box<dyn Transport>,
        opts: EngineOptions,
        facts: Facts,
    ) -> Result<Self> {
        let (rank, world) = (config.rank, config.world_size);
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
            hosts: facts.hosts,
            local_ranks: facts.local_ranks,
            spin: opts.spin,
            segment_bytes: opts.segment_bytes,
            timeout: opts.timeout,
            data_path: facts.data_path,
            gpu_direct: facts.gpu_direct,
            direct_region: facts.direct_region,
            connected_at_init: transport.connected_peers(),
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
        let direct_layout = transport.direct_layout();
        let direct_host = transport.direct_host_region();
        let mut engine = Engine::new(rank, world, transport, opts.clone());
        if let Some(prefix) = &config.trace {
            let path = engine.start_trace(prefix)?;
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
            gpu: Mutex::new(GpuState::default()),
            policy: Mutex::new(facts.data_path),
            region: None,
        })
    }
}

/// What the shared-memory negotiation decided.
#[derive(Debug)]
enum ShmSelected {
    /// Shared memory on every rank.
    Shm(ShmTransport),
    /// Not shared memory: the bootstrap's streams go on to the verbs/TCP choice; `why` says
    /// why not shm where it was a candidate (every rank on one host, none asked for another
    /// transport) and failed.
    Not {
        streams: Vec<Option<TcpStream>>,
        why: Option<String>,
    },
}

/// The kernel's boot id: two "hosts" with one host identity but different boot ids are two
/// machines (or containers of two machines) with the same host name.
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// "ranks 0, 1 on a; rank 2 on b".
fn ranks_by_host(hosts: &[String]) -> String {
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (r, h) in hosts.iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| *g == h.as_str()) {
            Some((_, v)) => v.push(r),
            None => groups.push((h.as_str(), vec![r])),
        }
    }
    groups
        .iter()
        .map(|(h, v)| {
            let rs: Vec<String> = v.iter().map(usize::to_string).collect();
            let word = if v.len() == 1 { "rank" } else { "ranks" };
            format!("{word} {} on {h}", rs.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Appends this rank's shared-memory capability to its bootstrap announcement: 1, its boot
/// id and its segment, or 0 and why it has none.
fn push_shm_capability(msg: &mut Vec<u8>, capable: &std::result::Result<SegInfo, String>) {
    match capable {
        Ok(info) => {
            msg.push(1);
            let id = boot_id();
            msg.push(id.len().min(255) as u8);
            msg.extend_from_slice(&id.as_bytes()[..id.len().min(255)]);
            msg.extend_from_slice(&info.encode());
        }
        Err(why) => {
            msg.push(0);
            msg.extend_from_slice(why.as_bytes());
        }
    }
}

/// Why the ranks of a host do not share memory: a warning from the host's first rank, the
/// others' at debug level (every rank's `CommInfo` carries the reason; 128 ranks on a host
/// would otherwise print it 128 times).
fn shm_declined(first_on_host: bool, rank: usize, reason: &str, what: &str) {
    if first_on_host {
        tracing::warn!(rank, reason = %reason, "{what}");
    } else {
        tracing::debug!(rank, reason = %reason, "{what}");
    }
}

fn shm_unavailable(forced: &[usize], reason: &str) -> Error {
    let who: Vec<String> = forced.iter().map(usize::to_string).collect();
    Error::unavailable(
        format!(
            "the shared-memory transport (DSPARK_TRANSPORT=shm on rank(s) {})",
            who.join(", ")
        ),
        reason,
    )
}

/// Agrees with every other rank on whether to use shared memory, through the bootstrap: yes
/// when every rank is on one host and none asks for TCP or verbs, and every rank could
/// create its segment and map every peer's (two rounds: announce, then confirm). A rank
/// that asked for shm (`DSPARK_TRANSPORT=shm`) turns every "no" into [`Error::Unavailable`]
/// on every rank, naming the ranks and why.
///
/// # Errors
/// [`Error::Unavailable`], bootstrap errors ([`Error::Timeout`], [`Error::PeerLost`]).
fn select_shm(
    boot: &mut Bootstrap,
    cfg: &Config,
    mut streams: Vec<Option<TcpStream>>,
) -> Result<ShmSelected> {
    let (rank, world) = (cfg.rank, cfg.world_size);
    if world == 1 {
        if cfg.transport == TransportChoice::Shm {
            return Ok(ShmSelected::Shm(ShmTransport::single()?));
        }
        return Ok(ShmSelected::Not { streams, why: None });
    }
    let hosts: Vec<String> = boot.peers.iter().map(|p| p.host.clone()).collect();
    let one_host = hosts.iter().all(|h| *h == hosts[0]);
    let wants = matches!(cfg.transport, TransportChoice::Auto | TransportChoice::Shm);
    let opts = shm_options(cfg);
    // Round 1: mode, capability, boot id and where this rank's segment is.
    let mut prep = None;
    let mut msg = vec![mode_code(cfg.transport)];
    let capable = if !wants {
        Err(format!("DSPARK_TRANSPORT={}", cfg.transport))
    } else if !one_host {
        Err("the ranks are on several hosts".to_string())
    } else {
        let partners = |r: usize| plan::algo::standing_partners(world, r);
        shm::prepare(rank, world, &partners, opts).map(|p| {
            let info = p.info();
            prep = Some(p);
            info
        })
    };
    push_shm_capability(&mut msg, &capable);
    let all = boot.all_gather(&mut streams, &msg)?;
    let mut modes = Vec::with_capacity(world);
    let mut infos = Vec::with_capacity(world);
    let mut boots = Vec::with_capacity(world);
    let mut why_not: Option<String> = None;
    for (r, m) in all.iter().enumerate() {
        let mode = m.first().copied().unwrap_or(0);
        modes.push(mode);
        match m.get(1) {
            Some(1) => {
                let n = m.get(2).copied().unwrap_or(0) as usize;
                let id = m
                    .get(3..3 + n)
                    .map(|b| String::from_utf8_lossy(b).into_owned());
                let info = m.get(3 + n..).and_then(SegInfo::decode);
                match (id, info) {
                    (Some(id), Some(info)) => {
                        boots.push(id);
                        infos.push(info);
                    }
                    _ => {
                        why_not
                            .get_or_insert(format!("rank {r} sent a malformed shm announcement"));
                    }
                }
            }
            _ => {
                let w = String::from_utf8_lossy(m.get(2..).unwrap_or_default()).into_owned();
                why_not.get_or_insert(format!("rank {r}: {w}"));
            }
        }
    }
    let code = mode_code(TransportChoice::Shm);
    let forced: Vec<usize> = (0..world).filter(|&r| modes[r] == code).collect();
    if !one_host {
        why_not = Some(format!(
            "the ranks are not on one host: {} (host identity: DSPARK_HOST_ID, else the host \
             name); DSPARK_TRANSPORT=shm needs every rank on one host, while auto uses shared \
             memory within each host and TCP between hosts",
            ranks_by_host(&hosts)
        ));
    } else if why_not.is_none() && boots.iter().any(|b| *b != boots[0]) {
        why_not = Some(format!(
            "the ranks share a host identity ({}) but not a kernel (different boot ids): \
             several machines with one host name?",
            hosts[0]
        ));
    }
    let others_asked = modes
        .iter()
        .any(|&m| m == mode_code(TransportChoice::Tcp) || m == mode_code(TransportChoice::Verbs));
    if let Some(why) = why_not {
        if !forced.is_empty() {
            return Err(shm_unavailable(&forced, &why));
        }
        // A candidate that failed is worth a reason; another host or transport is not.
        let candidate = one_host && !others_asked;
        if candidate {
            shm_declined(
                rank == 0,
                rank,
                &why,
                "not using shared memory although every rank is on one host",
            );
        }
        return Ok(ShmSelected::Not {
            streams,
            why: candidate.then(|| format!("shm unavailable: {why}")),
        });
    }
    let Some(prep) = prep else {
        return Err(shm_unavailable(
            &forced,
            "internal: capable without a segment",
        ));
    };
    // Round 2: map every peer's segment; confirm. Until every rank confirmed, every owner
    // keeps its segment's descriptor open for the peers to open.
    let res = prep.connect(&infos);
    let mine = match &res {
        Ok(_) => vec![1u8],
        Err(w) => {
            let mut v = vec![0u8];
            v.extend_from_slice(w.as_bytes());
            v
        }
    };
    let all = boot.all_gather(&mut streams, &mine)?;
    let mut failed = None;
    for (r, m) in all.iter().enumerate() {
        if m.first() != Some(&1) {
            let w = String::from_utf8_lossy(m.get(1..).unwrap_or_default()).into_owned();
            failed = Some(format!("rank {r}: mapping the segments failed: {w}"));
            break;
        }
    }
    match (failed, res) {
        (None, Ok(segs)) => {
            // Shared memory watches each peer's liveness through a connection to it: the
            // standing partners' from the rendezvous, the others' made on first use, when
            // their rings are committed too.
            let mut t = ShmTransport::new(prep, segs, streams)?;
            if let Some(l) = boot.links() {
                t = t.with_links(Box::new(l));
            }
            tracing::info!(rank, transport = %t.describe(), "using shared memory");
            Ok(ShmSelected::Shm(t))
        }
        (Some(why), _) | (None, Err(why)) => {
            if !forced.is_empty() {
                return Err(shm_unavailable(&forced, &why));
            }
            shm_declined(
                rank == 0,
                rank,
                &why,
                "not using shared memory although every rank is on one host",
            );
            Ok(ShmSelected::Not {
                streams,
                why: Some(format!("shm unavailable: {why}")),
            })
        }
    }
}

/// The shared-memory transport's options for `cfg`.
fn shm_options(cfg: &Config) -> ShmOptions {
    // A ring holds at least two whole frames: a sender must be able to finish a frame (up to
    // a segment) while its peer is itself still sending, as TCP's socket buffers and the
    // verbs slots allow; a schedule whose receive waits for its own send (recursive doubling
    // in place) would otherwise deadlock until the deadline.
    ShmOptions {
        ring_bytes: cfg
            .shm_ring_bytes
            .max(2 * (cfg.segment_bytes.max(64) + 2 * 64)),
    }
}

/// What the mixed negotiation decided for this rank.
struct MixedSelected {
    /// The streams left to TCP (those to other hosts, or all of them).
    streams: Vec<Option<TcpStream>>,
    /// The shared-memory transport to the ranks of this host and which peers it serves,
    /// when this host's ranks share memory.
    shm: Option<(ShmTransport, Vec<bool>)>,
    /// Per rank, the transport among its host's ranks.
    intra: Vec<TransportKind>,
    /// Why this host's ranks do not share memory, where they could have.
    why: Option<String>,
}

/// In a job over several hosts that ended up on TCP, agrees with every other rank, through the
/// bootstrap, on which hosts' ranks share memory: every host with at least two ranks, each of
/// which could create its segment and map its host peers' (same boot id), unless some rank
/// asked for `DSPARK_TRANSPORT=tcp` (no shared memory at all). Two rounds as in
/// [`select_shm`]; a host whose ranks cannot share memory keeps TCP among them (with a
/// warning and the reason), the others are not affected.
///
/// # Errors
/// Bootstrap errors ([`Error::Timeout`], [`Error::PeerLost`]); a transport that cannot be
/// built.
fn select_mixed(
    boot: &mut Bootstrap,
    cfg: &Config,
    mut streams: Vec<Option<TcpStream>>,
) -> Result<MixedSelected> {
    let (rank, world) = (cfg.rank, cfg.world_size);
    let hosts: Vec<String> = boot.peers.iter().map(|p| p.host.clone()).collect();
    let members =
        |r: usize| -> Vec<usize> { (0..world).filter(|&q| hosts[q] == hosts[r]).collect() };
    let tcp_only = |streams| MixedSelected {
        streams,
        shm: None,
        intra: vec![TransportKind::Tcp; world],
        why: None,
    };
    let one_host = hosts.iter().all(|h| *h == hosts[0]);
    let shared = (0..world).any(|r| members(r).len() > 1);
    if world < 2 || one_host || !shared || hosts.len() != world {
        return Ok(tcp_only(streams));
    }
    let mine = members(rank);
    // Round 1: mode, capability, boot id and where this rank's segment is.
    let mut prep = None;
    let capable = if cfg.transport != TransportChoice::Auto {
        Err(format!("DSPARK_TRANSPORT={}", cfg.transport))
    } else if mine.len() < 2 {
        Err("alone on its host".to_string())
    } else {
        let partners = |r: usize| plan::algo::standing_partners(world, r);
        shm::prepare_group(rank, world, &mine, &partners, shm_options(cfg)).map(|p| {
            let info = p.info();
            prep = Some(p);
            info
        })
    };
    let mut msg = vec![mode_code(cfg.transport)];
    push_shm_capability(&mut msg, &capable);
    let all = boot.all_gather(&mut streams, &msg)?;
    if all
        .iter()
        .any(|m| m.first() != Some(&mode_code(TransportChoice::Auto)))
    {
        // Some rank asked for one transport everywhere.
        return Ok(tcp_only(streams));
    }
    let mut infos: Vec<Option<SegInfo>> = vec![None; world];
    let mut boots: Vec<Option<String>> = vec![None; world];
    let mut whys: Vec<Option<String>> = vec![None; world];
    for (r, m) in all.iter().enumerate() {
        match m.get(1) {
            Some(1) => {
                let n = m.get(2).copied().unwrap_or(0) as usize;
                boots[r] = m
                    .get(3..3 + n)
                    .map(|b| String::from_utf8_lossy(b).into_owned());
                infos[r] = m.get(3 + n..).and_then(SegInfo::decode);
                if boots[r].is_none() || infos[r].is_none() {
                    whys[r] = Some(format!("rank {r} sent a malformed shm announcement"));
                }
            }
            _ => {
                let w = String::from_utf8_lossy(m.get(2..).unwrap_or_default()).into_owned();
                whys[r] = Some(format!("rank {r}: {w}"));
            }
        }
    }
    // Why the ranks of `r`'s host cannot share memory (None: they can).
    let group_why = |r: usize, whys: &[Option<String>]| -> Option<String> {
        let g = members(r);
        if g.len() < 2 {
            return Some("alone on its host".into());
        }
        if let Some(w) = g.iter().find_map(|&q| whys[q].clone()) {
            return Some(w);
        }
        if g.iter().any(|&q| boots[q] != boots[g[0]]) {
            return Some(format!(
                "the ranks share a host identity ({}) but not a kernel (different boot ids)",
                hosts[r]
            ));
        }
        None
    };
    let mut ok: Vec<bool> = (0..world).map(|r| group_why(r, &whys).is_none()).collect();
    // Round 2: map the host peers' segments; confirm. Until every rank confirmed, every owner
    // keeps its segment's descriptor open for the peers to open.
    let res = match (&prep, ok[rank]) {
        (Some(p), true) => Some(p.connect_group(&infos)),
        _ => None,
    };
    let reply = match &res {
        Some(Err(w)) => {
            let mut v = vec![0u8];
            v.extend_from_slice(w.as_bytes());
            v
        }
        _ => vec![1u8],
    };
    let all = boot.all_gather(&mut streams, &reply)?;
    for (r, m) in all.iter().enumerate() {
        if m.first() != Some(&1) {
            let w = String::from_utf8_lossy(m.get(1..).unwrap_or_default()).into_owned();
            whys[r] = Some(format!("rank {r}: mapping the segments failed: {w}"));
        }
    }
    for (r, o) in ok.iter_mut().enumerate() {
        *o = *o && group_why(r, &whys).is_none();
    }
    let intra: Vec<TransportKind> = ok
        .iter()
        .map(|&o| {
            if o {
                TransportKind::Shm
            } else {
                TransportKind::Tcp
            }
        })
        .collect();
    match (ok[rank], prep, res) {
        (true, Some(prep), Some(Ok(segs))) => {
            // The standing partners within the host have their liveness connections from the
            // rendezvous; the other same-host pairs connect on first use (the links the
            // caller shares between the two transports).
            let mut shm_streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
            let mut local = vec![false; world];
            for &p in mine.iter().filter(|&&p| p != rank) {
                shm_streams[p] = streams[p].take();
                local[p] = true;
            }
            let t = ShmTransport::new(prep, segs, shm_streams)?;
            Ok(MixedSelected {
                streams,
                shm: Some((t, local)),
                intra,
                why: None,
            })
        }
        _ => {
            let why = (mine.len() > 1)
                .then(|| group_why(rank, &whys))
                .flatten()
                .map(|w| {
                    format!(
                        "shm unavailable among the ranks of host {}: {w}",
                        hosts[rank]
                    )
                });
            if let Some(w) = &why {
                let first = mine.first() == Some(&rank);
                shm_declined(first, rank, w, "not using shared memory within this host");
            }
            Ok(MixedSelected {
                streams,
                shm: None,
                intra,
                why,
            })
        }
    }
}

/// What the transport negotiation decided.
#[derive(Debug)]
enum Selected {
    /// Verbs on every rank.
    Verbs(Box<VerbsTransport>),
    /// TCP on every rank, over these streams; `reason` says why not verbs (when there were
    /// peers to reach and verbs was not ruled out by `DSPARK_TRANSPORT=tcp`).
    Tcp {
        /// The bootstrap's data connections.
        streams: Vec<Option<TcpStream>>,
        /// Why verbs is not used.
        reason: Option<String>,
    },
}

fn mode_code(c: TransportChoice) -> u8 {
    match c {
        TransportChoice::Auto => 0,
        TransportChoice::Tcp => 1,
        TransportChoice::Verbs => 2,
        TransportChoice::Shm => 3,
    }
}

fn unavailable(reason: &str) -> Error {
    Error::unavailable("the verbs transport (DSPARK_TRANSPORT=verbs)", reason)
}

/// Agrees with every other rank on the transport, through the bootstrap (see
/// [`Communicator::init`]): verbs when every rank has a usable port and no rank
/// asks for TCP; otherwise TCP everywhere, or — when some rank asked for verbs —
/// [`Error::Unavailable`] on every rank, naming the rank and the reason.
///
/// # Errors
/// [`Error::Unavailable`], bootstrap errors ([`Error::Timeout`], [`Error::PeerLost`]),
/// [`Error::Config`] for bad `DSPARK_IB_*` settings.
fn select_transport(
    boot: &mut Bootstrap,
    cfg: &Config,
    mut streams: Vec<Option<TcpStream>>,
    direct: &mut dyn FnMut(&VerbsOptions, &str) -> DirectSpec,
) -> Result<Selected> {
    let rank = cfg.rank;
    let world = cfg.world_size;
    let opts = VerbsOptions::from_config(cfg)?;
    if world == 1 {
        return match cfg.transport {
            TransportChoice::Verbs => {
                let prep =
                    verbs::prepare(rank, world, &[], opts, direct).map_err(|r| unavailable(&r))?;
                Ok(Selected::Verbs(Box::new(VerbsTransport::build(
                    rank,
                    world,
                    prep,
                    &[],
                    streams,
                ))))
            }
            _ => Ok(Selected::Tcp {
                streams,
                reason: None,
            }),
        };
    }
    // Queue pairs and slot memory now only for the pairs the collectives' schedules use
    // (the rendezvous connected the same pairs); the others connect on first use.
    let partners = plan::algo::standing_partners(world, rank);
    // Round 1: requested mode + capability (+ connection information).
    let mut prep = None;
    let blob = if cfg.transport == TransportChoice::Tcp {
        Blob::Incapable {
            reason: "DSPARK_TRANSPORT=tcp".into(),
        }
    } else {
        match verbs::prepare(rank, world, &partners, opts, direct) {
            Ok(p) => {
                let b = p.blob();
                prep = Some(p);
                b
            }
            Err(reason) => Blob::Incapable { reason },
        }
    };
    let mut msg = vec![mode_code(cfg.transport)];
    msg.extend_from_slice(&blob.encode());
    let all = boot.all_gather(&mut streams, &msg)?;
    let mut modes = Vec::with_capacity(world);
    let mut blobs = Vec::with_capacity(world);
    for (r, m) in all.iter().enumerate() {
        let (mode, rest) = m.split_first().map_or((0, &[][..]), |(a, b)| (*a, b));
        modes.push(mode);
        blobs.push(Blob::decode(rest).unwrap_or_else(|w| Blob::Incapable {
            reason: format!("(rank {r}) {w}"),
        }));
    }
    let hosts: Vec<String> = boot.peers.iter().map(|p| p.host.clone()).collect();
    let host = |r: usize| hosts.get(r).map_or(String::new(), |h| format!(" on {h}"));
    let someone_wants_verbs = modes.contains(&mode_code(TransportChoice::Verbs));
    let mut why_not = verbs::why_not_connectable(&blobs, &host)?;
    // Round 2 (only when round 1 found every rank capable): connect and agree it worked.
    if why_not.is_none() {
        let mut prep = prep
            .take()
            .ok_or_else(|| unavailable("internal: capable without resources"))?;
        let res = prep.connect(rank, &blobs);
        let mine = match &res {
            Ok(()) => vec![1u8],
            Err(w) => {
                let mut v = vec![0u8];
                v.extend_from_slice(w.as_bytes());
                v
            }
        };
        let all = boot.all_gather(&mut streams, &mine)?;
        for (r, m) in all.iter().enumerate() {
            if m.first() != Some(&1) {
                let w = String::from_utf8_lossy(m.get(1..).unwrap_or_default()).into_owned();
                why_not = Some(format!(
                    "rank {r}{}: connecting queue pairs failed: {w}",
                    host(r)
                ));
                break;
            }
        }
        if why_not.is_none() {
            // A connection beside each queue pair (the rendezvous made them already), and
            // the other pairs on first use.
            boot.complete_mesh(&mut streams, &|p| partners.binary_search(&p).is_ok())?;
            let mut t = VerbsTransport::build(rank, world, prep, &blobs, streams);
            match boot.links() {
                Some(l) => t = t.with_links(Box::new(l)),
                None if partners.len() + 1 < world => {
                    return Err(unavailable(
                        "internal: the bootstrap has no listener left for connections on \
                         first use",
                    ))
                }
                None => {}
            }
            tracing::info!(rank, transport = %t.describe(), "using RDMA verbs");
            return Ok(Selected::Verbs(Box::new(t)));
        }
    }
    let why = why_not.unwrap_or_default();
    if someone_wants_verbs {
        let who: Vec<String> = modes
            .iter()
            .enumerate()
            .filter(|(_, &m)| m == mode_code(TransportChoice::Verbs))
            .map(|(r, _)| r.to_string())
            .collect();
        return Err(unavailable(&format!(
            "{why} (DSPARK_TRANSPORT=verbs on rank(s) {})",
            who.join(", ")
        )));
    }
    let any_capable = blobs.iter().any(|b| matches!(b, Blob::Capable { .. }));
    let asked_tcp = modes.contains(&mode_code(TransportChoice::Tcp));
    if any_capable && !asked_tcp {
        // Some ranks could do RDMA but not all: the job silently runs slower. Say so.
        tracing::warn!(rank, reason = %why, "falling back to TCP on every rank: not every rank can use RDMA verbs");
    } else {
        tracing::info!(rank, reason = %why, "using TCP");
    }
    let reason = if cfg.transport == TransportChoice::Tcp
        && modes.iter().all(|&m| m == mode_code(TransportChoice::Tcp))
    {
        None
    } else {
        Some(format!("verbs unavailable: {why}"))
    };
    Ok(Selected::Tcp { streams, reason })
}

impl VerbsOptions {
    /// The options for `cfg` (its `DSPARK_IB_*` settings, [`Config::ib`]); no environment is
    /// read.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable.
    pub fn from_config(cfg: &Config) -> Result<Self> {
        cfg.ib.validate(cfg.segment_bytes)?;
        let device = match &cfg.ib_device {
            None => None,
            Some(spec) => {
                Some(verbs::parse_device(spec).map_err(|w| Error::config("DSPARK_IB_DEVICE", w))?)
            }
        };
        let seg = cfg.segment_bytes.max(64);
        let slot_payload = cfg.ib.slot_bytes.unwrap_or(seg).max(seg);
        if (slot_payload + HEADER_LEN) as u64 > u64::from(wire::MAX_FRAME) {
            return Err(Error::config(
                "DSPARK_CHUNK_BYTES",
                format!(
                    "verbs slots hold at most {} payload bytes; {slot_payload} is too large",
                    wire::MAX_FRAME as usize - HEADER_LEN
                ),
            ));
        }
        let ib = &cfg.ib;
        Ok(VerbsOptions {
            device,
            gid_index: cfg.ib_gid_index,
            slots: ib.slots,
            slot_payload,
            reliability: verbs::ib::Reliability {
                timeout: ib.timeout,
                retry_cnt: ib.retry_cnt,
                rnr_retry: ib.rnr_retry,
                min_rnr_timer: 12,
                service_level: ib.service_level,
                traffic_class: ib.traffic_class,
            },
            spin: ib.spin,
            zero_copy_min: ib.zero_copy_min,
        })
    }
}

/// What this rank brings to the verbs transport as its direct region (called by the verbs
/// transport once it found a usable port): the host-memory emulation when asked for (tests),
/// nothing when device memory is to be staged anyway, otherwise GPU memory of the configured
/// device with its registration candidates — the region, which the communicator keeps for as
/// long as its transport lives — or why there is none.
pub(crate) fn direct_spec(
    config: &Config,
    opts: &VerbsOptions,
    nic: &str,
) -> (DirectSpec, Option<DirectRegion>) {
    if config.emulate_gpu_direct {
        return (
            DirectSpec::HostEmulated {
                send_slots: DIRECT_SEND_SLOTS,
            },
            None,
        );
    }
    if config.data_path == PathPolicy::HostStaged {
        return (
            DirectSpec::Unavailable(path::REQUESTED_STAGED_REASON.into()),
            None,
        );
    }
    if config.world_size < 2 {
        return (DirectSpec::None, None);
    }
    match gpu_region(config, opts, nic) {
        Ok(g) => {
            let (candidates, reasons) = g.registration_candidates();
            let spec = DirectSpec::Device {
                addr: g.ptr(),
                send_slots: DIRECT_SEND_SLOTS,
                candidates,
                reasons,
            };
            (spec, Some(g))
        }
        Err(why) => (DirectSpec::Unavailable(why), None),
    }
}

/// Allocates this rank's direct region on its GPU (`Config::cuda_device` modulo the number of
/// GPUs), sized for the verbs transport's slots, unless the GPU is farther from `nic` than
/// [`path::GDR_MAX_DISTANCE`] and the path was left to `auto` (an explicit `gpu-direct` is
/// honoured with a warning).
fn gpu_region(
    config: &Config,
    opts: &VerbsOptions,
    nic: &str,
) -> std::result::Result<DirectRegion, String> {
    if !crate::gpu::probe::libcuda_present() {
        return Err("no CUDA driver (libcuda.so.1 not found)".into());
    }
    let probe = crate::gpu::probe::probe_cuda().map_err(|e| e.to_string())?;
    if probe.devices.is_empty() {
        return Err(format!(
            "no CUDA GPU visible{}",
            probe
                .init_error
                .map(|e| format!(" ({e})"))
                .unwrap_or_default()
        ));
    }
    let ordinal = config.cuda_device.unwrap_or(0) % probe.devices.len();
    let far = probe
        .devices
        .get(ordinal)
        .and_then(|d| d.pci)
        .and_then(|pci| crate::gpu::sysfs::Sysfs::default().distance(pci, nic).ok())
        .and_then(|r| path::distance_blocker(r.distance, path::GDR_MAX_DISTANCE));
    if let Some(why) = far {
        let why = format!("GPU {ordinal} and {nic}: {why}");
        if config.data_path != PathPolicy::GpuDirect {
            return Err(why);
        }
        tracing::warn!("DSPARK_DATA_PATH=gpu-direct: using GPUDirect although {why}");
    }
    let ctx = crate::gpu::device::open_context(ordinal).map_err(|e| e.to_string())?;
    let layout = verbs::direct_layout(config.world_size, opts, DIRECT_SEND_SLOTS);
    DirectRegion::new(&ctx, layout)
        .map_err(|e| format!("GPU {ordinal}: cannot allocate the direct region: {e}"))
}

/// Whether this rank keeps its direct region after init: `Ok` when it registered one and
/// every rank can use theirs — GPUDirect RDMA is used job-wide ([`path::uses_gpu_direct`] over
/// [`capabilities_of`], the rule device collectives follow), or, for the host-memory
/// emulation (which is never reported as GPUDirect), every rank announced an emulated region.
/// Otherwise why the region is of no use. Every rank decides from the same exchanged facts,
/// so all keep theirs or none does.
fn region_fate(
    policy: PathPolicy,
    infos: &[DirectInfo],
    rank: usize,
) -> std::result::Result<(), String> {
    let emulated = match infos.get(rank) {
        Some(DirectInfo::Region { kind, .. }) => *kind == DirectKind::HostEmulated,
        Some(DirectInfo::Unavailable(why)) => {
            return Err(format!("it could not be registered: {why}"))
        }
        _ => return Err("this rank announced no region".into()),
    };
    let is_emulated = |i: &DirectInfo| {
        matches!(
            i,
            DirectInfo::Region {
                kind: DirectKind::HostEmulated,
                ..
            }
        )
    };
    let caps = capabilities_of(infos);
    let agreed = if emulated {
        infos.iter().all(is_emulated)
    } else {
        path::uses_gpu_direct(policy, TransportKind::Verbs, &caps)
    };
    if agreed {
        return Ok(());
    }
    let lacking: Vec<String> = infos
        .iter()
        .zip(&caps)
        .enumerate()
        .filter_map(
            |(r, (info, cap))| match (emulated, is_emulated(info), cap) {
                (true, true, _) => None,
                (true, false, GpuDirectCapability::Unavailable(why))
                | (false, _, GpuDirectCapability::Unavailable(why)) => {
                    Some(format!("rank {r}: {why}"))
                }
                (true, false, _) => Some(format!(
                    "rank {r}: its region is GPU memory, not the emulation"
                )),
                (false, _, _) => None,
            },
        )
        .collect();
    let who = if lacking.is_empty() {
        format!("{}={policy}", path::DATA_PATH_ENV)
    } else {
        lacking.join("; ")
    };
    Err(format!("GPUDirect RDMA is not used job-wide ({who})"))
}

/// Keeps this rank's direct region where [`region_fate`] says so; otherwise drops the
/// transport's registration of it first (so that the NIC never touches it again) and then
/// frees it. Returns what became of it.
fn settle_region(
    t: &mut VerbsTransport,
    region: &mut Option<DirectRegion>,
    config: &Config,
) -> DirectRegionFact {
    let rank = config.rank;
    let infos = t.direct_infos();
    match region_fate(config.data_path, infos, rank) {
        Ok(()) => DirectRegionFact::Kept {
            bytes: t.direct_layout().map_or(0, |l| l.len()),
            emulated: region.is_none(),
        },
        Err(why) => {
            let none_why = match infos.get(rank) {
                Some(DirectInfo::Unavailable(w)) => w.clone(),
                _ => "no device memory is set up for a world of one".to_string(),
            };
            let registered = t.drop_direct_region();
            free_unused_region(region, registered, rank, &why)
                .unwrap_or(DirectRegionFact::NotAllocated(none_why))
        }
    }
}

/// Frees a direct region that nothing will use (its registration failed or was dropped, or
/// the job fell back to TCP), so that the GPU memory does not stay allocated for the
/// communicator's lifetime; `registered` is the size of a region the transport held itself
/// (the emulation's host memory, already freed). Logs why; `None` when there was none.
fn free_unused_region(
    region: &mut Option<DirectRegion>,
    registered: Option<usize>,
    rank: usize,
    why: &str,
) -> Option<DirectRegionFact> {
    let bytes = region.take().map(|r| r.len()).or(registered)?;
    tracing::info!(rank, bytes, "freed the GPUDirect region at init: {why}");
    Some(DirectRegionFact::Freed {
        bytes,
        why: why.into(),
    })
}

/// Every rank's GPUDirect capability from the direct regions announced at init.
pub(crate) fn capabilities_of(infos: &[DirectInfo]) -> Vec<GpuDirectCapability> {
    infos
        .iter()
        .map(|d| match d {
            DirectInfo::Region {
                kind: DirectKind::DmaBuf,
                ..
            } => GpuDirectCapability::DmaBuf,
            DirectInfo::Region {
                kind: DirectKind::PeerMem,
                ..
            } => GpuDirectCapability::PeerMem,
            DirectInfo::Region {
                kind: DirectKind::HostEmulated,
                ..
            } => GpuDirectCapability::Unavailable(
                "its direct region is host memory (DSPARK_EMULATE_GPU_DIRECT, for tests)".into(),
            ),
            DirectInfo::None => {
                GpuDirectCapability::Unavailable("no GPU memory was set up at init".into())
            }
            DirectInfo::Unavailable(why) => GpuDirectCapability::Unavailable(why.clone()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
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

    use super::*;

    fn opts_of(vars: &[(&str, &str)]) -> Result<VerbsOptions> {
        let m: std::collections::HashMap<String, String> = [
            ("DSPARK_RANK", "0"),
            ("DSPARK_WORLD_SIZE", "2"),
            ("DSPARK_ROOT_ADDR", "h:1"),
        ]
        .iter()
        .chain(vars)
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let cfg = Config::from_lookup(|k| m.get(k).cloned())?;
        VerbsOptions::from_config(&cfg)
    }

    fn region(kind: DirectKind) -> DirectInfo {
        DirectInfo::Region {
            kind,
            addr: 1 << 20,
            rkey: 7,
            slot_bytes: 512 << 10,
        }
    }

    /// #11 item 7: a direct region is kept only where it was registered and GPUDirect RDMA is
    /// used job-wide; every other rank frees its own, and says which rank stands in the way.
    #[test]
    fn a_direct_region_is_kept_only_when_every_rank_registered_one() {
        use DirectKind::{DmaBuf, HostEmulated, PeerMem};
        let fate = |infos: &[DirectInfo], r| region_fate(PathPolicy::Auto, infos, r);
        // Every rank registered GPU memory (mechanisms may differ): all keep theirs.
        let all = [region(DmaBuf), region(PeerMem), region(DmaBuf)];
        for r in 0..3 {
            assert_eq!(fate(&all, r), Ok(()), "rank {r}");
            assert_eq!(region_fate(PathPolicy::GpuDirect, &all, r), Ok(()));
        }
        // Rank 1 could not register, rank 2 set up none: nobody keeps one, and the ranks
        // that registered name the ranks that did not.
        let why = DirectInfo::Unavailable("ibv_reg_mr: EFAULT".into());
        let infos = [region(PeerMem), why, DirectInfo::None];
        let e = fate(&infos, 0).unwrap_err();
        assert!(e.contains("not used job-wide"), "{e}");
        assert!(e.contains("rank 1: ibv_reg_mr: EFAULT"), "{e}");
        assert!(e.contains("rank 2: no GPU memory"), "{e}");
        assert!(!e.contains("rank 0"), "{e}");
        let e = fate(&infos, 1).unwrap_err();
        assert!(
            e.contains("could not be registered: ibv_reg_mr: EFAULT"),
            "{e}"
        );
        assert!(fate(&infos, 2).is_err(), "no region announced: freed");
        assert!(fate(&infos, 3).is_err(), "no information: freed");
        // The emulation agrees with itself only: every rank emulating keeps; one rank without
        // it (or with real GPU memory) makes every emulating rank free its region.
        let emu = [
            region(HostEmulated),
            region(HostEmulated),
            region(HostEmulated),
        ];
        for r in 0..3 {
            assert_eq!(fate(&emu, r), Ok(()), "rank {r}");
        }
        let infos = [
            region(HostEmulated),
            region(HostEmulated),
            DirectInfo::Unavailable("no CUDA driver".into()),
        ];
        for r in 0..2 {
            let e = fate(&infos, r).unwrap_err();
            assert!(e.contains("rank 2: no CUDA driver"), "{e}");
            assert!(!e.contains("rank 0") && !e.contains("rank 1"), "{e}");
        }
        let mixed = [region(HostEmulated), region(DmaBuf)];
        let e = fate(&mixed, 0).unwrap_err();
        assert!(e.contains("rank 1: its region is GPU memory"), "{e}");
        let e = fate(&mixed, 1).unwrap_err();
        assert!(
            e.contains("rank 0: its direct region is host memory"),
            "{e}"
        );
    }

    /// What the bench header and `CommInfo` print about the region: its size and its fate.
    #[test]
    fn the_direct_region_fact_says_what_was_allocated_and_whether_it_is_held() {
        let kept = DirectRegionFact::Kept {
            bytes: 36 << 20,
            emulated: false,
        };
        assert_eq!(
            kept.to_string(),
            "36 MiB of GPU memory, registered and held"
        );
        let freed = DirectRegionFact::Freed {
            bytes: 3 << 20,
            why: "GPUDirect RDMA is not used job-wide (rank 2: no CUDA driver)".into(),
        };
        let s = freed.to_string();
        assert!(
            s.starts_with("3 MiB allocated, then freed at init: "),
            "{s}"
        );
        assert!(s.ends_with("(rank 2: no CUDA driver)"), "{s}");
        let none = DirectRegionFact::NotAllocated(path::REQUESTED_STAGED_REASON.into());
        assert_eq!(
            none.to_string(),
            "none allocated (DSPARK_DATA_PATH=host-staged was requested)"
        );
    }

    #[test]
    fn default_ack_budget_rides_out_congestion_like_nccls() {
        let o = opts_of(&[]).unwrap();
        let r = o.reliability;
        // The ACK timeout is 4.096 µs × 2^t, tried retry_cnt + 1 times: about 34 s, NCCL's
        // budget (a dead peer is found by the liveness connection, not by this).
        let worst_ms = 4.096e-3 * f64::from(1u32 << r.timeout) * f64::from(r.retry_cnt + 1);
        assert!((20_000.0..60_000.0).contains(&worst_ms), "{worst_ms} ms");
        assert!(r.rnr_retry < 7, "RNR retry 7 means forever");
        assert_eq!((r.service_level, r.traffic_class), (0, 0));
        assert_eq!(o.slot_payload, 512 * 1024);
        assert_eq!(o.slot_bytes() % 64, 0);
        assert!(o.slot_bytes() >= o.slot_payload + HEADER_LEN);
        let o = opts_of(&[("DSPARK_IB_SL", "5"), ("DSPARK_IB_TC", "106")]).unwrap();
        assert_eq!(
            (o.reliability.service_level, o.reliability.traffic_class),
            (5, 106)
        );
    }

    #[test]
    fn bad_tunables_name_their_variable() {
        let e = opts_of(&[("DSPARK_IB_SLOTS", "1")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("DSPARK_IB_SLOTS"), "{e}");
        let e = opts_of(&[("DSPARK_IB_SLOT_BYTES", "4K")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("DSPARK_IB_SLOT_BYTES") && e.contains("segment"),
            "{e}"
        );
        let e = opts_of(&[("DSPARK_IB_RETRY_CNT", "8")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("DSPARK_IB_RETRY_CNT"), "{e}");
        let o = opts_of(&[("DSPARK_IB_SLOTS", "4"), ("DSPARK_IB_SLOT_BYTES", "1M")]).unwrap();
        assert_eq!((o.slots, o.slot_payload), (4, 1 << 20));
    }
}
