//! The communicator: the public API — host collectives (blocking, and non-blocking in a
//! [`Communicator::scope`]), device collectives, and setup.
//!
//! Where things are: `setup.rs` builds a communicator (bootstrap → transport choice → direct
//! region → path decision → engine: [`Communicator::init`]); `rendezvous.rs` and `split.rs`
//! find rank 0 another way and then build it the same way; this file holds the host
//! collectives, `device.rs` the device collectives and the data-path report, `scope.rs`,
//! [`work`] and `raw.rs` the non-blocking forms.
//!
//! # Non-blocking operations and why they are sound
//!
//! Every operation runs in issue order on one engine per communicator (see [`work`]), driven
//! by the communicator's progress thread or by a thread that waits. Non-blocking operations
//! on borrowed buffers are started inside [`Communicator::scope`], in the style of
//! [`std::thread::scope`]: the scope waits for every operation started in it before it
//! returns, also when its closure panics. A buffer borrowed by an operation therefore stays
//! borrowed until the library is done with it, and leaking a [`Work`] (`mem::forget`) only
//! loses its result, never the borrow: the library never touches a buffer after its borrow
//! has ended. The `unsafe` raw-pointer forms ([`Communicator::start_raw`]) are for the C ABI
//! and the Python binding, whose callers promise the same by contract.

#![deny(unsafe_code)]

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

mod any;
mod describe;
mod device;
mod flight;
mod raw;
mod rendezvous;
mod scope;
pub(crate) mod setup;
mod shrink;
pub(crate) mod split;
pub mod work;

pub use device::Enqueue;
pub use raw::{RawCall, RawOp};
pub use scope::Scope;
pub use work::Work;

use crate::config::Config;
use crate::engine::{Call, EngineOptions};
use crate::error::{Error, Result};
use crate::path::PathPolicy;
use crate::plan::{Algorithm, Collective};
use crate::transport::TransportKind;
use crate::types::{Element, ReduceOp};
use device::GpuState;

/// Facts about one rank's connections, for bench headers and debugging.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommInfo {
    /// Transport in use.
    pub transport: TransportKind,
    /// The transport's own description (addresses, device, options).
    pub transport_detail: String,
    /// Why the transport is not the fastest one available, if it is not.
    pub transport_reason: Option<String>,
    /// The cost model that chooses the algorithms, with the source of its constants
    /// (`tcp α=4.00 µs β=2.00 GB/s γ=10.0 GB/s (defaults)`, `... (from ~/.cache/dspark/tune.json)`;
    /// every rank uses rank 0's).
    pub cost_model: String,
    /// Host name of every rank.
    pub hosts: Vec<String>,
    /// Ranks on this host.
    pub local_ranks: usize,
    /// The transport of this rank's connection to every rank (indexed by rank; this rank's
    /// own entry is [`CommInfo::transport`]). In a mixed communicator (`shm+tcp`) same-host
    /// peers say `shm` and the others `tcp`.
    pub peer_transports: Vec<TransportKind>,
    /// For every rank, the transport between it and the other ranks of its host (`shm` where
    /// that host's ranks share memory, else the transport between hosts).
    pub intra_host: Vec<TransportKind>,
    /// The transport between ranks of different hosts.
    pub inter_host: TransportKind,
    /// The ranks that share this rank's CPUs, in words: `4 ranks on CPUs 0-1 (2 CPUs):
    /// oversubscribed`, `no other rank on its CPUs (3)`. Counted over every rank's kernel
    /// (boot id) and affinity mask, so "hosts" that are namespaces or containers of one
    /// machine count together; oversubscribed ranks spin briefly and yield the CPU meanwhile.
    /// Where a cgroup CPU quota limits the rank (a container's CPU limit), how many ranks
    /// are under it, and whether they are more than it allows: `…; 4 ranks under a CPU
    /// quota of 2 CPUs (cgroup): more than it allows, throttled whenever they all run`.
    pub cpu_sharing: String,
    /// Busy-poll time before blocking.
    pub spin: Duration,
    /// Whether that poll yields the CPU at every pass (oversubscribed ranks).
    pub spin_yields: bool,
    /// Pipeline segment size.
    pub segment_bytes: usize,
    /// Deadline of blocking calls.
    pub timeout: Duration,
    /// The data-path policy for device memory (`DSPARK_DATA_PATH`).
    pub data_path: PathPolicy,
    /// Every rank's GPUDirect RDMA capability, as announced at init (indexed by rank).
    pub gpu_direct: Vec<crate::path::GpuDirectCapability>,
    /// How the ranks met: rank 0's address and where it came from (`DSPARK_ROOT_ADDR`,
    /// `MASTER_ADDR:MASTER_PORT`, torchrun's agent store, a parent communicator).
    pub rendezvous: String,
    /// What init did with this rank's direct region (the GPU memory GPUDirect RDMA sends from
    /// and lands in): whether GPU memory was allocated, and whether it is still held.
    pub direct_region: DirectRegionFact,
    /// The peers this rank had a data connection to when init returned, where the transport
    /// connects the other pairs on first use (TCP and verbs: the pairs of the collectives'
    /// schedules, [`crate::plan::algo::standing_partners`], at most 2⌈log2 n⌉ + 6; all-to-all
    /// and send/recv partners when first used; shared memory: the peers whose rings were
    /// committed and that got a liveness connection at init, the same partners). `None`:
    /// every pair is connected at init.
    pub connected_at_init: Option<usize>,
    /// How the ranks authenticated each other at init: a spawner's, a token's, the store's
    /// or the parent's secret, or open to anybody who reaches rank 0's port (`Display` says
    /// it in words).
    pub auth: crate::config::JobAuth,
}

/// What became of this rank's direct region at init. A region (world × slots × segment bytes
/// of GPU memory, and a CUDA context) is allocated only over verbs, and kept only when
/// GPUDirect RDMA is used job-wide; `DSPARK_DATA_PATH=host-staged` allocates none.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DirectRegionFact {
    /// None was allocated, and why (staging requested, no GPU, not verbs, ...).
    NotAllocated(String),
    /// Allocated, registered with the NIC and held for the communicator's lifetime.
    Kept {
        /// Its size.
        bytes: usize,
        /// Host memory standing in for GPU memory (`DSPARK_EMULATE_GPU_DIRECT`, tests).
        emulated: bool,
    },
    /// Allocated at init, then deregistered and freed at init, and why.
    Freed {
        /// Its size.
        bytes: usize,
        /// Why nothing would use it.
        why: String,
    },
}

impl fmt::Display for DirectRegionFact {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let size = |b: usize| crate::types::human_bytes(b as u64, false);
        match self {
            DirectRegionFact::NotAllocated(why) => write!(f, "none allocated ({why})"),
            DirectRegionFact::Kept {
                bytes,
                emulated: false,
            } => write!(f, "{} of GPU memory, registered and held", size(*bytes)),
            DirectRegionFact::Kept {
                bytes,
                emulated: true,
            } => write!(
                f,
                "{} of host memory standing in for GPU memory (DSPARK_EMULATE_GPU_DIRECT), held",
                size(*bytes)
            ),
            DirectRegionFact::Freed { bytes, why } => {
                write!(f, "{} allocated, then freed at init: {why}", size(*bytes))
            }
        }
    }
}

impl CommInfo {
    /// The transport between ranks `a` and `b` (as every rank of the job agreed at init).
    pub fn transport_between(&self, a: usize, b: usize) -> TransportKind {
        if a == b {
            return self.transport;
        }
        match (self.hosts.get(a), self.hosts.get(b)) {
            (Some(x), Some(y)) if x == y => {
                self.intra_host.get(a).copied().unwrap_or(self.inter_host)
            }
            _ => self.inter_host,
        }
    }
}

/// Which API a call came through (for the operation named in errors).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Api {
    /// The host-memory collectives.
    Host,
    /// The `*_device` collectives.
    Device,
}

/// The rank a call is aimed at, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    /// No root or peer.
    None,
    /// The root of a broadcast or reduce.
    Root(usize),
    /// The peer of a send.
    SendTo(usize),
    /// The peer of a receive.
    RecvFrom(usize),
}

/// A group of ranks that run collectives together.
///
/// Every rank must call the same collectives in the same order with matching arguments (count,
/// type, operator, root); ranks that disagree get [`Error::Mismatch`] instead of corrupted data.
/// Every call has a deadline ([`Config::timeout`]); a dead or silent peer becomes an error on
/// every surviving rank within it. The first such error *poisons* the communicator: later
/// calls return it at once. Argument errors ([`Error::InvalidArgument`]) do not.
///
/// Methods take `&self`. Operations run one at a time in the order they were issued, on
/// every rank; calling collectives on one communicator from several threads at once is safe,
/// but their order across ranks is then up to chance, which is a mismatch waiting to happen.
/// Non-blocking forms are in [`Communicator::scope`]; [`Communicator::abort`] may be called
/// from any thread; [`Communicator::with_timeout`] gives one call its own deadline.
///
/// # Example
///
/// ```no_run
/// use dspark::{Communicator, ReduceOp};
///
/// # fn main() -> dspark::Result<()> {
/// // Rank and world size from DSPARK_RANK / RANK / OMPI_COMM_WORLD_RANK / SLURM_PROCID ...,
/// // the rendezvous from DSPARK_ROOT_ADDR or MASTER_ADDR + MASTER_PORT.
/// let comm = Communicator::from_env()?;
/// let mut grads = vec![1.0f32; 1 << 20];
/// comm.all_reduce(&mut grads, ReduceOp::Avg)?;
///
/// let mine = vec![comm.rank() as u32; 4];
/// let mut everyone = vec![0u32; 4 * comm.world_size()];
/// comm.all_gather(&mine, &mut everyone)?;
/// comm.barrier()?;
/// # Ok(())
/// # }
/// ```
pub struct Communicator {
    rank: usize,
    world: usize,
    info: CommInfo,
    opts: EngineOptions,
    /// The algorithm forced for the collectives that have it: `opts.force_algo` at init,
    /// then [`Communicator::set_algorithm`]'s.
    forced: Mutex<Option<Algorithm>>,
    /// The engine, its operation queue and the driver role.
    shared: Arc<work::Shared>,
    /// The progress thread (joined on drop).
    progress: Option<JoinHandle<()>>,
    /// The transport's direct region, fixed at init.
    direct_layout: Option<crate::transport::DirectLayout>,
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    direct_host: Option<Arc<dyn crate::transport::RegionAccess>>,
    /// The configuration it was built from (for [`Communicator::split`]).
    config: Config,
    /// The address peers reach this rank at (for [`Communicator::split`]).
    data_ip: Option<std::net::IpAddr>,
    /// How many times [`Communicator::split`] was called (the same on every rank): the
    /// children's secrets differ by it.
    splits: std::sync::atomic::AtomicU64,
    /// The listener [`Communicator::shrink`] agrees on (`None` in a world of one, or over a
    /// given transport).
    shrink_door: Option<shrink::Door>,
    gpu: Mutex<GpuState>,
    /// The device-memory path policy in effect (init's, or one set with `set_data_path`).
    pub(crate) policy: Mutex<PathPolicy>,
    /// The GPU memory registered with the NIC as this rank's direct region; declared after
    /// the engine so that the transport (and its registration) is dropped first.
    pub(crate) region: Option<Arc<crate::gpu::direct::DirectRegion>>,
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("transport", &self.info.transport)
            .finish()
    }
}

impl Communicator {
    pub(crate) fn gpu_state(&self) -> MutexGuard<'_, GpuState> {
        self.gpu.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Transport, addresses and settings.
    pub fn info(&self) -> &CommInfo {
        &self.info
    }

    /// The algorithm `coll` would use for a buffer of `bytes` bytes (the threshold is visible
    /// here and in the bench header; `DSPARK_ALGO` forces one).
    pub fn algorithm(&self, coll: Collective, bytes: usize) -> Algorithm {
        let opts = EngineOptions {
            force_algo: self.forced_algorithm(),
            ..self.opts.clone()
        };
        opts.algorithm(self.world, coll, bytes)
    }

    /// The cost model's predicted time, in µs, of `algo` running `coll` on `bytes` bytes
    /// (counted as the engine counts a call: [`crate::plan::model::CostModel::predict`]);
    /// `None` where `algo` does not implement `coll`.
    pub fn predict(&self, coll: Collective, algo: Algorithm, bytes: usize) -> Option<f64> {
        self.opts
            .model
            .predict(coll, algo, bytes, self.world, self.opts.per_host)
    }

    /// The cost model this communicator chooses algorithms with (rank 0's, on every rank).
    pub fn cost_model(&self) -> &crate::plan::model::CostModel {
        &self.opts.model
    }

    /// The algorithm the choice by size and host layout makes for `coll` on `bytes` bytes,
    /// whatever is forced (`DSPARK_ALGO`).
    pub fn default_algorithm(&self, coll: Collective, bytes: usize) -> Algorithm {
        let opts = EngineOptions {
            force_algo: None,
            ..self.opts.clone()
        };
        opts.algorithm(self.world, coll, bytes)
    }

    /// The algorithm `DSPARK_ALGO` (or [`crate::Config::algo`], or the last
    /// [`Communicator::set_algorithm`]) forces for the collectives that have it, if any.
    pub fn forced_algorithm(&self) -> Option<Algorithm> {
        *self.forced.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forces `algo` for the later calls of the collectives it implements (`None`: back to the
    /// choice by size), as `DSPARK_ALGO` does at init: for side-by-side comparisons
    /// (`dspark-bench --algo all`). It takes effect after every operation issued before it.
    /// Every rank must make the same switch before its next call: ranks that run different
    /// algorithms get a [`Error::Mismatch`] (the algorithm is part of every frame's
    /// descriptor), never wrong data.
    ///
    /// # Errors
    /// The communicator's error if it is poisoned.
    pub fn set_algorithm(&self, algo: Option<Algorithm>) -> Result<()> {
        self.shared.exclusive(None, |eng| {
            eng.set_forced_algorithm(algo);
            match eng.poisoned() {
                Some(e) => Err(e.clone()),
                None => Ok(()),
            }
        })?;
        *self.forced.lock().unwrap_or_else(|e| e.into_inner()) = algo;
        Ok(())
    }

    /// The error that poisoned this communicator, if any.
    pub fn poisoned(&self) -> Option<Error> {
        self.shared.poisoned()
    }

    /// Aborts the communicator, from any thread: the operation in progress on this rank
    /// fails within about 50 ms with [`Error::Aborted`], so do every queued and every later
    /// one, and every peer is told (they fail with an error naming this rank; over every
    /// transport, a peer still finishing a collective this rank had completed finishes it
    /// first, and its next call fails). Returns at once; never waits for a peer. Like
    /// `ncclCommAbort`, it is final: make a new communicator to go on.
    pub fn abort(&self) {
        self.shared.abort();
    }

    /// The blocking collectives with a deadline of their own, overriding the communicator's
    /// ([`Config::timeout`]) for one call: `comm.with_timeout(d).all_reduce(&mut buf, op)`.
    /// It bounds the call from its start; earlier operations run first to their own
    /// deadlines ([`Timed`]).
    pub fn with_timeout(&self, timeout: Duration) -> Timed<'_> {
        Timed {
            comm: self,
            timeout,
        }
    }

    /// Checks the buffers of a call of `coll` — `send` and `recv` elements (an in-place
    /// buffer counts as both; a send has no `recv`, a receive no `send`) and its root or
    /// peer — and builds the call. Every API (host, device, non-blocking, raw) shares it, so
    /// they accept and refuse exactly the same calls.
    pub(crate) fn shape(
        &self,
        api: Api,
        coll: Collective,
        op: Option<ReduceOp>,
        send: usize,
        recv: usize,
        target: Target,
    ) -> Result<Call> {
        let (root, is_send) = match target {
            Target::None => (0, false),
            Target::Root(r) | Target::RecvFrom(r) => (r, false),
            Target::SendTo(r) => (r, true),
        };
        let n = self.world;
        // A send or a receive is named as such, not as the send_recv collective it runs as.
        let op_name = match (coll, target) {
            (Collective::SendRecv, Target::SendTo(_)) => "send",
            (Collective::SendRecv, Target::RecvFrom(_)) => "recv",
            (c, _) => c.name(),
        };
        let invalid = |what: String| {
            let name = match api {
                Api::Host => op_name.to_string(),
                Api::Device => format!("{op_name}_device"),
            };
            Error::invalid(Some(self.rank), name, what)
        };
        let count = match coll {
            Collective::AllGather => {
                if recv != send.saturating_mul(n) {
                    return Err(invalid(format!(
                        "recv has {recv} elements, expected send ({send}) × world ({n}) = {}",
                        send.saturating_mul(n)
                    )));
                }
                send
            }
            Collective::ReduceScatter => {
                if send != recv.saturating_mul(n) {
                    return Err(invalid(format!(
                        "send has {send} elements, expected recv ({recv}) × world ({n}) = {}",
                        recv.saturating_mul(n)
                    )));
                }
                recv
            }
            Collective::AllToAll => {
                if send != recv || !send.is_multiple_of(n) {
                    return Err(invalid(format!(
                        "send ({send}) and recv ({recv}) must have the same length, a multiple \
                         of the world size ({n})"
                    )));
                }
                send / n
            }
            Collective::SendRecv if is_send => send,
            Collective::Barrier => 0,
            _ => recv,
        };
        let (what, rooted) = match coll {
            Collective::SendRecv => ("peer", true),
            c => ("root", c.rooted()),
        };
        if rooted && root >= n {
            return Err(invalid(format!(
                "{what} {root} is not a rank (world size {n})"
            )));
        }
        if coll == Collective::SendRecv && root == self.rank {
            return Err(invalid(if is_send {
                "cannot send to this rank itself".into()
            } else {
                "cannot receive from this rank itself".into()
            }));
        }
        Ok(Call::new(
            coll,
            op,
            count,
            if rooted { root } else { 0 },
            is_send,
        ))
    }

    /// The rule for empty calls, host and device alike: a call of no elements (other than a
    /// barrier) moves nothing, but takes its place in the issue order and its sequence
    /// number ([`Engine::skip_empty`](crate::engine::Engine::skip_empty)), so that a rank
    /// calling with 0 elements where the others call with N is a prompt mismatch.
    pub(crate) fn is_empty_call(call: &Call) -> bool {
        // An exchange with nothing to send may still receive: the engine takes care of it.
        call.count == 0 && call.coll != Collective::Barrier && call.recv_from.is_none()
    }

    /// Runs an empty call (blocking): `Some(result)` for one, `None` for a call that must
    /// run.
    pub(crate) fn empty_call(&self, call: &Call, timeout: Option<Duration>) -> Option<Result<()>> {
        if !Self::is_empty_call(call) {
            return None;
        }
        let call = *call;
        Some(self.shared.exclusive(timeout, |eng| eng.skip_empty(&call)))
    }

    /// Queues an empty call (non-blocking): `Some(work)` for one.
    pub(crate) fn empty_work(&self, call: &Call, timeout: Option<Duration>) -> Option<Work> {
        if !Self::is_empty_call(call) {
            return None;
        }
        let call = *call;
        let task: work::Task = Box::new(move |eng| eng.skip_empty(&call));
        Some(self.shared.submit(task, timeout, call.coll.name()))
    }

    /// Runs a host call on the caller's thread, after everything issued before it.
    fn exec(&self, op: HostOp<'_>, timeout: Option<Duration>) -> Result<()> {
        // This frame starts on a cache line, so that the frames of the call below it lie at
        // the same offsets within their lines whatever the caller's stack. Without it an
        // 8-byte all_reduce over shm (2 ranks, close vCPUs) took ~0.10 µs or ~0.12 µs
        // depending on where the caller's stack lay: one 16-byte stack offset in four was
        // slow, so ASLR made it differ run to run. With it, no run at any of 16 offsets was
        // slow (benches/RESULTS.md, "Issue 25, stop 35"). Which access the offset slowed
        // down is not known: a later change of these frames' sizes may land them on a slow
        // offset again, which that method (`modes.txt`) shows.
        #[repr(align(64))]
        struct Line([u8; 64]);
        let anchor = Line([0; 64]);
        std::hint::black_box(&anchor.0);
        if let Some(res) = self.empty_call(&op.call, timeout) {
            return res;
        }
        let span = tracing::trace_span!(
            "collective",
            coll = op.call.coll.name(),
            count = op.call.count
        );
        let _g = span.enter();
        let HostOp { call, src, dst } = op;
        self.shared
            .exclusive(timeout, |eng| eng.run(&call, src, dst))
    }

    /// Runs one call on device buffers through the host-staged path (`dev` holds the buffers
    /// and performs the device-side copies and reductions; see
    /// [`crate::engine::staged`]). This is the building block of the device-memory
    /// collectives; `call.dtype` must be set. Peers see exactly the frames of the host call,
    /// so host and device ranks can be mixed.
    ///
    /// A test hook, with the `testing` feature: the device collectives
    /// ([`Communicator::all_reduce_device`] and the rest) are the public way in.
    ///
    /// # Errors
    /// As the host collectives.
    #[cfg(feature = "testing")]
    pub fn run_staged(
        &self,
        call: Call,
        dev: &mut dyn crate::engine::staged::StagedDevice,
    ) -> Result<()> {
        self.exec_staged(call, dev)
    }

    /// [`Communicator::all_to_all_v`] on device buffers through the staged engine (`dev`'s
    /// `Src` the blocks sent, its `Dst` those received), as [`Communicator::run_staged`]:
    /// a test hook, with the `testing` feature.
    ///
    /// # Errors
    /// As [`Communicator::all_to_all_v`].
    #[cfg(feature = "testing")]
    pub fn run_staged_all_to_all_v(
        &self,
        dtype: crate::types::DataType,
        send_counts: &[usize],
        recv_counts: &[usize],
        dev: &mut dyn crate::engine::staged::StagedDevice,
    ) -> Result<()> {
        self.shared.exclusive(None, |eng| {
            eng.run_staged_all_to_all_v(dtype, send_counts, recv_counts, dev)
        })
    }

    /// Runs a call on device buffers through the staged engine: the body of `run_staged`
    /// (feature `testing`; the device collectives run `Engine::run_staged` inside their own
    /// queued or exclusive operation).
    #[cfg(feature = "testing")]
    fn exec_staged(
        &self,
        call: Call,
        dev: &mut dyn crate::engine::staged::StagedDevice,
    ) -> Result<()> {
        if let Some(res) = self.empty_call(&call, None) {
            return res;
        }
        let span = tracing::trace_span!("staged", coll = call.coll.name(), count = call.count);
        let _g = span.enter();
        self.shared
            .exclusive(None, |eng| eng.run_staged(&call, dev))
    }

    /// The layout of this rank's direct region, when the transport was set up with one
    /// (GPUDirect RDMA, or its host-memory emulation in tests).
    pub fn direct_layout(&self) -> Option<crate::transport::DirectLayout> {
        self.direct_layout
    }

    /// Host access to the direct region when it is host memory (the emulated GPUDirect path:
    /// [`crate::engine::staged::EmulatedDevice::direct`]); `None` otherwise. A test hook
    /// (feature `testing`): its writes land in slots the NIC and the engine own, which only
    /// the engine's own discipline keeps apart.
    #[cfg(feature = "testing")]
    pub fn direct_host_region(&self) -> Option<Arc<dyn crate::transport::RegionAccess>> {
        self.direct_host.clone()
    }

    /// Registers `buf` with the transport so that sends from it move zero-copy (RDMA verbs:
    /// the NIC reads the buffer directly instead of a pinned bounce slot; on TCP this does
    /// nothing). Registration happens once; every later collective on this buffer reuses it, so
    /// the steady state never registers memory.
    ///
    /// The returned [`Registration`] owns the buffer and derefs to it (`&reg[..]`,
    /// `&mut reg[..]`: use it in any collective); dropping it, or
    /// [`Registration::into_inner`], deregisters it first. The NIC holds the pages the buffer
    /// had when it was registered, so owning the buffer is what makes this sound: it cannot be
    /// freed, or reallocated so that a new allocation reuses the address, while the NIC may
    /// still send from it. The pages are pinned writable (`IBV_ACCESS_LOCAL_WRITE`), as NCCL
    /// does: a read-only pin can hold the shared zero page or, after a `fork`, a page the
    /// process no longer writes.
    ///
    /// ```no_run
    /// # fn f(comm: &dspark::Communicator) -> dspark::Result<()> {
    /// let mut grads = comm.register_buffer(vec![0f32; 1 << 20])?;
    /// for _step in 0..100 {
    ///     // ... fill grads[..] ...
    ///     comm.all_reduce(&mut grads, dspark::ReduceOp::Avg)?;
    /// }
    /// let grads: Vec<f32> = grads.into_inner();
    /// # Ok(()) }
    /// ```
    ///
    /// What made the old borrowed form unsound cannot be written: the buffer is not freed
    /// while registered.
    ///
    /// ```compile_fail
    /// # fn f(comm: &dspark::Communicator) -> dspark::Result<()> {
    /// let buf = vec![1u8; 4096];
    /// let reg = comm.register_buffer(buf)?;
    /// drop(buf); // error: `buf` moved into the registration
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Transport`] when the transport cannot register it (for example the memlock
    /// limit; the message says how to raise it). The buffer is dropped then.
    pub fn register_buffer<T: Element>(&self, buf: Vec<T>) -> Result<Registration<'_, T>> {
        let bytes: &[u8] = bytemuck::cast_slice(&buf);
        let id = self
            .shared
            .exclusive(None, |eng| eng.register_host(bytes))?;
        Ok(Registration {
            comm: self,
            id,
            buf,
        })
    }

    /// How many frames this rank has sent zero-copy from buffers registered with
    /// [`Communicator::register_buffer`] (0 on transports that always copy) — the check that a
    /// registration is really used.
    pub fn zero_copy_frames(&self) -> u64 {
        self.shared
            .exclusive(None, |eng| Ok(eng.zero_copy_frames()))
            .unwrap_or(0)
    }

    /// A call whose one buffer is input and output.
    fn in_place<'a, T: Element>(
        &self,
        coll: Collective,
        op: Option<ReduceOp>,
        buf: &'a mut [T],
        target: Target,
    ) -> Result<HostOp<'a>> {
        let n = buf.len();
        let call = self.shape(Api::Host, coll, op, n, n, target)?;
        Ok(HostOp::new(call, &[], buf))
    }

    /// A call that reads `send` and writes `recv`.
    fn out_of_place<'a, T: Element>(
        &self,
        coll: Collective,
        op: Option<ReduceOp>,
        send: &'a [T],
        recv: &'a mut [T],
        target: Target,
    ) -> Result<HostOp<'a>> {
        let call = self.shape(Api::Host, coll, op, send.len(), recv.len(), target)?;
        Ok(HostOp::new(call, send, recv))
    }

    fn op_all_reduce<'a, T: Element>(&self, buf: &'a mut [T], op: ReduceOp) -> Result<HostOp<'a>> {
        self.in_place(Collective::AllReduce, Some(op), buf, Target::None)
    }

    fn op_all_gather<'a, T: Element>(
        &self,
        send: &'a [T],
        recv: &'a mut [T],
    ) -> Result<HostOp<'a>> {
        self.out_of_place(Collective::AllGather, None, send, recv, Target::None)
    }

    fn op_reduce_scatter<'a, T: Element>(
        &self,
        send: &'a [T],
        recv: &'a mut [T],
        op: ReduceOp,
    ) -> Result<HostOp<'a>> {
        self.out_of_place(
            Collective::ReduceScatter,
            Some(op),
            send,
            recv,
            Target::None,
        )
    }

    fn op_all_to_all<'a, T: Element>(
        &self,
        send: &'a [T],
        recv: &'a mut [T],
    ) -> Result<HostOp<'a>> {
        self.out_of_place(Collective::AllToAll, None, send, recv, Target::None)
    }

    fn op_broadcast<'a, T: Element>(&self, buf: &'a mut [T], root: usize) -> Result<HostOp<'a>> {
        self.in_place(Collective::Broadcast, None, buf, Target::Root(root))
    }

    fn op_reduce<'a, T: Element>(
        &self,
        buf: &'a mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<HostOp<'a>> {
        self.in_place(Collective::Reduce, Some(op), buf, Target::Root(root))
    }

    fn op_send<'a, T: Element>(&self, buf: &'a [T], peer: usize) -> Result<HostOp<'a>> {
        self.out_of_place::<T>(
            Collective::SendRecv,
            None,
            buf,
            &mut [],
            Target::SendTo(peer),
        )
    }

    fn op_recv<'a, T: Element>(&self, buf: &'a mut [T], peer: usize) -> Result<HostOp<'a>> {
        self.out_of_place::<T>(Collective::SendRecv, None, &[], buf, Target::RecvFrom(peer))
    }

    fn op_send_recv<'a, T: Element>(
        &self,
        send: &'a [T],
        to: usize,
        recv: &'a mut [T],
        from: usize,
    ) -> Result<HostOp<'a>> {
        // Each half is checked as the send or the receive it is.
        let call = self.shape(
            Api::Host,
            Collective::SendRecv,
            None,
            send.len(),
            0,
            Target::SendTo(to),
        )?;
        self.shape(
            Api::Host,
            Collective::SendRecv,
            None,
            0,
            recv.len(),
            Target::RecvFrom(from),
        )?;
        let call = Call {
            recv_from: Some(from),
            ..call
        };
        Ok(HostOp::new(call, send, recv))
    }

    fn op_barrier(&self) -> HostOp<'static> {
        HostOp::new::<u8>(
            Call::new(Collective::Barrier, None, 0, 0, false),
            &[],
            &mut [],
        )
    }

    /// Reduces `buf` elementwise over all ranks, in place: afterwards every rank holds the
    /// same result.
    ///
    /// # Errors
    /// See [`Communicator`]: `Timeout`, `PeerLost`, `Mismatch`, `Aborted`, transport errors.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.exec(self.op_all_reduce(buf, op)?, None)
    }

    /// Gathers every rank's `send` into `recv` in rank order (`recv.len() == send.len() ×
    /// world`).
    ///
    /// # Errors
    /// `InvalidArgument` on wrong lengths; otherwise as [`Communicator::all_reduce`].
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.exec(self.op_all_gather(send, recv)?, None)
    }

    /// Reduces `send` (world blocks of `recv.len()`) over all ranks; rank r receives block r
    /// in `recv`.
    ///
    /// # Errors
    /// `InvalidArgument` on wrong lengths; otherwise as [`Communicator::all_reduce`].
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.exec(self.op_reduce_scatter(send, recv, op)?, None)
    }

    /// Block j of `send` goes to rank j; block j of `recv` comes from rank j (both have world
    /// blocks of equal length).
    ///
    /// # Errors
    /// `InvalidArgument` on wrong lengths; otherwise as [`Communicator::all_reduce`].
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.exec(self.op_all_to_all(send, recv)?, None)
    }

    /// Block j of `send` (`send_counts[j]` elements, the blocks in rank order) goes to rank
    /// j, and block i of `recv` (`recv_counts[i]` elements) comes from rank i: an all-to-all
    /// whose blocks differ in size, as MPI's `Alltoallv` with contiguous blocks (torch's
    /// `all_to_all_single` with split sizes). Rank j's `recv_counts[r]` must equal rank r's
    /// `send_counts[j]`, and a rank sends itself as many elements as it receives from itself.
    /// The blocks move as they are, in the rounds of [`Communicator::all_to_all`]: no
    /// agreement first, no padding.
    ///
    /// # Errors
    /// `InvalidArgument` when the counts are not one per rank or do not add up to the
    /// buffers' lengths; `Mismatch` when a peer's count for the block between the two
    /// differs (or a peer runs another collective); otherwise as
    /// [`Communicator::all_reduce`].
    pub fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.exec_all_to_all_v(send, send_counts, recv, recv_counts, None)
    }

    fn exec_all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
        timeout: Option<Duration>,
    ) -> Result<()> {
        let (src, dst) = (bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv));
        let span = tracing::trace_span!("collective", coll = "all_to_all_v", count = src.len());
        let _g = span.enter();
        self.shared.exclusive(timeout, |eng| {
            eng.run_all_to_all_v(T::DATA_TYPE, send_counts, recv_counts, src, dst)
        })
    }

    /// Copies `root`'s `buf` into every other rank's `buf`.
    ///
    /// # Errors
    /// `InvalidArgument` when `root` is not a rank; otherwise as [`Communicator::all_reduce`].
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.exec(self.op_broadcast(buf, root)?, None)
    }

    /// Reduces `buf` over all ranks into `root`'s `buf`. Other ranks' buffers are unspecified
    /// afterwards (they hold partial results).
    ///
    /// # Errors
    /// `InvalidArgument` when `root` is not a rank; otherwise as [`Communicator::all_reduce`].
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.exec(self.op_reduce(buf, op, root)?, None)
    }

    /// Sends `buf` to `peer`, which must call [`Communicator::recv`] with the same length.
    /// Returns when the data is handed to the transport (it may still be in flight).
    ///
    /// # Errors
    /// `InvalidArgument` when `peer` is not another rank; otherwise as
    /// [`Communicator::all_reduce`].
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.exec(self.op_send(buf, peer)?, None)
    }

    /// Receives `buf.len()` elements from `peer`.
    ///
    /// # Errors
    /// `InvalidArgument` when `peer` is not another rank; `Mismatch` when the sender sent
    /// another length or type; otherwise as [`Communicator::all_reduce`].
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.exec(self.op_recv(buf, peer)?, None)
    }

    /// Sends `send` to rank `to` and receives `recv.len()` elements from rank `from` at
    /// once, as MPI's `Sendrecv`: the two progress together, so ranks that exchange buffers
    /// (a halo exchange, a ring shift, a pairwise swap) complete whatever the size. A
    /// [`Communicator::send`] followed by a [`Communicator::recv`] on both ranks of a swap —
    /// blocking, or started together in a [`Communicator::scope`], where operations run in
    /// issue order — waits on each other once the message outgrows what the transport
    /// buffers, and fails at the deadline. `to` and `from` may be the same rank. The frames
    /// are those of a send to `to` and a receive from `from`, so a peer may answer with
    /// `send`/`recv` or with `send_recv`.
    ///
    /// # Errors
    /// `InvalidArgument` when `to` or `from` is not another rank; `Mismatch` when `from` sent
    /// another length or type; otherwise as [`Communicator::all_reduce`].
    pub fn send_recv<T: Element>(
        &self,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
    ) -> Result<()> {
        self.exec(self.op_send_recv(send, to, recv, from)?, None)
    }

    /// Returns once every rank has entered the barrier.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    pub fn barrier(&self) -> Result<()> {
        self.exec(self.op_barrier(), None)
    }
}

/// One host call, shaped and checked, on borrowed buffers (input, output or in place).
pub(crate) struct HostOp<'a> {
    call: Call,
    src: &'a [u8],
    dst: &'a mut [u8],
}

impl<'a> HostOp<'a> {
    fn new<T: Element>(call: Call, src: &'a [T], dst: &'a mut [T]) -> Self {
        HostOp {
            call: Call {
                dtype: T::DATA_TYPE,
                ..call
            },
            src: bytemuck::cast_slice(src),
            dst: bytemuck::cast_slice_mut(dst),
        }
    }
}

/// The blocking collectives with a deadline of their own ([`Communicator::with_timeout`]).
/// Each behaves as the [`Communicator`] method of the same name, except that it fails with
/// [`Error::Timeout`] after this deadline instead of the communicator's. The deadline is the
/// call's own, from its start: operations issued before it (non-blocking ones, or another
/// thread's call) run first, each to its own deadline, so the caller may wait longer than
/// this one behind a stuck earlier operation (and then gets that operation's error).
#[derive(Clone, Copy, Debug)]
pub struct Timed<'c> {
    comm: &'c Communicator,
    timeout: Duration,
}

#[allow(missing_docs)]
impl Timed<'_> {
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let c = self.comm;
        c.exec(c.op_all_reduce(buf, op)?, Some(self.timeout))
    }
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let c = self.comm;
        c.exec(c.op_all_gather(send, recv)?, Some(self.timeout))
    }
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let c = self.comm;
        c.exec(c.op_reduce_scatter(send, recv, op)?, Some(self.timeout))
    }
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let c = self.comm;
        c.exec(c.op_all_to_all(send, recv)?, Some(self.timeout))
    }
    pub fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let c = self.comm;
        c.exec_all_to_all_v(send, send_counts, recv, recv_counts, Some(self.timeout))
    }
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let c = self.comm;
        c.exec(c.op_broadcast(buf, root)?, Some(self.timeout))
    }
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        let c = self.comm;
        c.exec(c.op_reduce(buf, op, root)?, Some(self.timeout))
    }
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        let c = self.comm;
        c.exec(c.op_send(buf, peer)?, Some(self.timeout))
    }
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        let c = self.comm;
        c.exec(c.op_recv(buf, peer)?, Some(self.timeout))
    }
    pub fn send_recv<T: Element>(
        &self,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
    ) -> Result<()> {
        let c = self.comm;
        c.exec(c.op_send_recv(send, to, recv, from)?, Some(self.timeout))
    }
    pub fn barrier(&self) -> Result<()> {
        let c = self.comm;
        c.exec(c.op_barrier(), Some(self.timeout))
    }
}

/// A buffer registered with the transport by [`Communicator::register_buffer`]: it owns the
/// buffer, derefs to it, and deregisters it before giving it back ([`Registration::into_inner`])
/// or freeing it (drop).
#[derive(Debug)]
pub struct Registration<'a, T: Element> {
    comm: &'a Communicator,
    id: Option<u64>,
    buf: Vec<T>,
}

impl<T: Element> Registration<'_, T> {
    /// Whether the transport registered the buffer (RDMA); `false` when it has no use for it.
    pub fn is_registered(&self) -> bool {
        self.id.is_some()
    }

    /// Size of the registered buffer in bytes.
    pub fn bytes(&self) -> usize {
        size_of_val(self.buf.as_slice())
    }

    /// Deregisters the buffer and gives it back.
    pub fn into_inner(mut self) -> Vec<T> {
        self.deregister();
        std::mem::take(&mut self.buf)
    }

    fn deregister(&mut self) {
        if let Some(id) = self.id.take() {
            let _ = self.comm.shared.exclusive(None, |eng| {
                eng.deregister(id);
                Ok(())
            });
        }
    }
}

impl<T: Element> std::ops::Deref for Registration<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf
    }
}

impl<T: Element> std::ops::DerefMut for Registration<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf
    }
}

impl<T: Element> Drop for Registration<'_, T> {
    fn drop(&mut self) {
        // Before the buffer is freed (fields drop after this).
        self.deregister();
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Everything issued runs first (in order, each by its deadline), then the progress
        // thread exits, then the peers hear a goodbye.
        self.shared.shutdown();
        if let Some(t) = self.progress.take() {
            let _ = t.join();
        }
        self.shared.with_engine(|eng| eng.close());
    }
}
