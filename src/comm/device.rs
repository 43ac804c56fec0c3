//! Collectives on GPU memory (cudarc device buffers), and the data-path report.
//!
//! Every device collective has the semantics of its host twin and is stream-ordered on the
//! stream the caller passes: it starts after the work already queued there, and work queued
//! there afterwards sees its result (no device-wide synchronisation).
//!
//! * The blocking forms (`all_reduce_device`, ...) return when the collective is complete;
//!   they run on the caller's thread and stream.
//! * The non-blocking forms ([`Communicator::enqueue`]) return at once with a [`Work`] for
//!   host-side completion, as NCCL's collectives do: the caller's stream waits on the GPU
//!   for the collective, which runs in issue order on the communicator's queue and its own
//!   stream of that GPU (see `gpu::order` for how, and why the stream never waits forever).
//!   Where the GPU cannot make a stream wait for a memory value (no stream memory
//!   operations), they run as the blocking forms do and return a completed [`Work`]; that is
//!   logged once per process and GPU and shown by [`Communicator::enqueue_blocks`].
//!
//! **Why the non-blocking forms are `unsafe`.** The operation keeps no borrow of the
//! buffers: its copies and kernels on them are issued later, while the call runs, by the
//! communicator's progress thread or by a thread that waits for an operation and runs the
//! queue itself ([`Work::wait`]). The ordering on the GPU is safe — cudarc's record of each
//! buffer's use is made on the caller's stream *after* the wait for the collective, so every
//! later use of the buffer through cudarc waits for it. The host's side is not: dropping a
//! cudarc buffer frees it at once (`cuMemFreeAsync`, ordered on the GPU, but CUDA makes any
//! work *issued* afterwards on that memory undefined), so a copy the library issues after
//! the drop is refused (`CUDA_ERROR_INVALID_VALUE` on an H200, driver 580: the call
//! fails and poisons the communicator) or, in CUDA's terms, undefined. Hence the contract of
//! [`Communicator::enqueue`]: buffers stay allocated until the call's [`Work`] has
//! completed. (Issuing every copy of the caller's buffers before returning, into memory the
//! library owns, would lift it at the price of a copy in and out of device memory per call.)
//!
//! **Path truth.** Device memory moves one of two ways, decided at init for the whole job:
//!
//! * *GPUDirect RDMA* over verbs, when every rank registered a direct region of GPU memory
//!   with its NIC (dma-buf first, then nvidia-peermem): a segment is copied on the GPU into a
//!   registered send slot, RDMA-written by the NIC straight into the peer's landing slot in
//!   its GPU memory, and consumed there by a copy or a reduction kernel (after a flush)
//!   before the slot is handed back (see [`crate::gpu::direct`]);
//! * *host-staged* otherwise: GPU → pinned host slot → wire → pinned host slot → GPU, with the
//!   copies, the wire and the GPU reductions of neighbouring segments overlapped (see
//!   [`crate::engine::staged`]).
//!
//! The path of every connection, with the reason when it is staged, is in
//! [`Communicator::data_paths`], in the bench header and in every bench row;
//! `DSPARK_DATA_PATH=gpu-direct` that cannot be honoured is an error at init naming every rank
//! that cannot, and why.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::Arc;

use std::sync::Mutex;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop};

use crate::comm::work::{Task, Work};
use crate::comm::{Api, Communicator, Target};
use crate::engine::staged::StagedDevice;
use crate::engine::{Call, Engine};
use crate::error::{Error, Result};
use crate::gpu::device::{driver_err, GpuReducer};
use crate::gpu::direct::{CudaDirectDevice, DirectRegion};
use crate::gpu::nvrtc::DiskCache;
use crate::gpu::order::{Doorbell, Raw};
use crate::gpu::staged::{CudaStagedDevice, StagingPool};
use crate::path::{self, BufferLocation, PathInputs, PathPlan, PathPolicy};
use crate::plan::Collective;
use crate::transport::TransportKind;
use crate::types::{Element, ReduceOp};

/// Pinned slots per direction for staged device collectives.
const STAGE_SLOTS: usize = 4;

/// Send slots of the direct region.
pub(crate) const DIRECT_SEND_SLOTS: usize = 4;

/// Per-communicator CUDA state (the reduction kernels and the contexts are the process's:
/// `GpuReducer::shared`, `gpu::device::open_context`).
#[derive(Debug, Default)]
pub(crate) struct GpuState {
    /// Pinned staging memory per GPU, reused by every call. Locked only by whoever holds the
    /// driver role (inside the engine's run), so never contended.
    pools: HashMap<usize, Arc<Mutex<StagingPool>>>,
    /// The communicator's own stream and doorbell per GPU, for non-blocking calls.
    queues: HashMap<usize, (Arc<CudaStream>, Arc<Doorbell>)>,
    /// Why non-blocking calls block on a GPU (no stream memory operations there).
    blocking: HashMap<usize, String>,
    warned: bool,
}

/// How a device call moves its data, prepared on the issuing thread.
enum Via {
    /// GPUDirect RDMA through the direct region.
    Direct(Arc<DirectRegion>),
    /// Host-staged through a pinned pool.
    Staged(Arc<Mutex<StagingPool>>),
}

impl Via {
    /// Whether a device's drop leaked the pool or region (its work never finished).
    fn stuck(&self) -> bool {
        match self {
            Via::Direct(r) => r.stuck().is_some(),
            Via::Staged(p) => p
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .stuck()
                .is_some(),
        }
    }
}

/// What a queued non-blocking device call holds until it ends (its drop): the ticket rings
/// the doorbell first, so that the caller's stream can pass its wait; only then is the
/// temporary copy freed. With stream-ordered allocation that free is queued on the caller's
/// stream and returns at once. Without it (a GPU without memory pools) cudarc synchronises
/// that stream first, and the stream may be waiting by then for a later call's ticket,
/// which only the thread dropping this (the progress thread, running calls in order) rings:
/// so the copy is freed on a thread of its own, which waits as long as the stream has work
/// before it, never for itself.
struct Hold {
    ticket: Option<crate::gpu::order::Ticket>,
    keep: Option<CudaSlice<u8>>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        drop(self.ticket.take());
        let Some(keep) = self.keep.take() else { return };
        if keep.context().has_async_alloc() {
            return;
        }
        let ordinal = keep.context().ordinal();
        let what = format!(
            "GPU {ordinal} has no stream-ordered memory pools: the temporary copy a \
             non-blocking device call runs on (in-place or overlapping buffers) is \
             allocated synchronously and freed on a thread of its own, each synchronising \
             with the caller's stream"
        );
        super::setup::once::warn_once!(key: &what, "{what}");
        let bytes = keep.len();
        // A refused spawn drops the closure here: `ManuallyDrop` then leaks the copy rather
        // than synchronise on this thread.
        let keep = std::mem::ManuallyDrop::new(keep);
        if let Err(e) = std::thread::Builder::new()
            .name("dspark-free".into())
            .spawn(move || drop(std::mem::ManuallyDrop::into_inner(keep)))
        {
            tracing::warn!(
                "no thread to free a device call's temporary copy on ({e}): its {bytes} \
                 bytes of GPU memory stay allocated"
            );
        }
    }
}

/// The counts of an all_to_all_v (sent to each rank, received from each rank), for a device
/// call that is one.
type VCounts<'a> = Option<(&'a [usize], &'a [usize])>;

/// A raw device buffer, `(address, bytes)`, where the call has one.
type RawBuf = Option<(u64, usize)>;

/// The elements an all_to_all_v sends, for its call's count (saturating: the engine's
/// `v_check` rejects counts that overflow, before the call takes a sequence number).
fn v_sent(send_counts: &[usize]) -> usize {
    send_counts.iter().fold(0, |a, &c| a.saturating_add(c))
}

/// Runs `call` (an all_to_all_v with counts `v`) on `eng` with the prepared device: `Err` is
/// a failure before the engine started (the caller fails the call for every rank), `Ok` the
/// engine's result.
#[allow(clippy::too_many_arguments)]
fn run_prepared<T, S, D>(
    eng: &mut Engine,
    call: &Call,
    v: VCounts<'_>,
    reducer: &GpuReducer,
    via: &Via,
    stream: &Arc<CudaStream>,
    src: Option<&S>,
    dst: Option<&mut D>,
) -> Result<Result<()>>
where
    T: DeviceRepr,
    S: DevicePtr<T>,
    D: DevicePtrMut<T>,
{
    let span = tracing::trace_span!("staged", coll = call.coll.name(), count = call.count);
    let _g = span.enter();
    let run = |eng: &mut Engine, dev: &mut dyn StagedDevice| match v {
        None => eng.run_staged(call, dev),
        Some((sent, received)) => eng.run_staged_all_to_all_v(call.dtype, sent, received, dev),
    };
    match via {
        Via::Direct(g) => {
            #[allow(unsafe_code)]
            // SAFETY: `dev` is a local of this function, dropped when it returns (never
            // leaked), which waits for everything it queued.
            let mut dev = unsafe {
                CudaDirectDevice::new::<T, S, D>(reducer, stream, src, dst, g, DIRECT_SEND_SLOTS)?
            };
            Ok(run(eng, &mut dev))
        }
        Via::Staged(pool) => {
            let mut pool = pool.lock().unwrap_or_else(|e| e.into_inner());
            #[allow(unsafe_code)]
            // SAFETY: as above: a local, dropped when this function returns.
            let mut dev =
                unsafe { CudaStagedDevice::new::<T, S, D>(reducer, stream, src, dst, &mut pool)? };
            Ok(run(eng, &mut dev))
        }
    }
}

impl Communicator {
    /// The data path of every connection of this rank, in each direction, for buffers in
    /// `buffers` (host or device memory), with the reason wherever it is not the fast path,
    /// and the warnings `auto` made.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the policy (`DSPARK_DATA_PATH`) asks for GPUDirect and it
    /// cannot be had, naming the rank and the reason.
    pub fn data_paths(&self, buffers: BufferLocation) -> Result<PathPlan> {
        self.data_paths_for(self.data_path(), buffers)
    }

    /// The device-memory path policy in effect: `DSPARK_DATA_PATH` from init, or the last
    /// [`Communicator::set_data_path`].
    pub fn data_path(&self) -> PathPolicy {
        *self.policy.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Switches the device-memory path policy for later device collectives — for side-by-side
    /// comparisons (`dspark-bench --compare-paths`). Every rank must make the same switch
    /// before its next device collective: ranks on different paths get a mismatch error.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when `policy` cannot be honoured here (the policy stays as it
    /// was).
    pub fn set_data_path(&self, policy: PathPolicy) -> Result<()> {
        self.data_paths_for(policy, BufferLocation::Device)?;
        *self.policy.lock().unwrap_or_else(|e| e.into_inner()) = policy;
        Ok(())
    }

    /// [`Communicator::data_paths`] under another policy: what `DSPARK_DATA_PATH=policy`
    /// would give (used by `dspark-bench --compare-paths`).
    ///
    /// # Errors
    /// As [`Communicator::data_paths`].
    pub fn data_paths_for(&self, policy: PathPolicy, buffers: BufferLocation) -> Result<PathPlan> {
        let peers: Vec<usize> = (0..self.world_size())
            .filter(|&p| p != self.rank())
            .collect();
        let caps = &self.info().gpu_direct;
        let info = self.info();
        if info.transport != TransportKind::ShmTcp {
            return path::decide(&PathInputs {
                policy,
                rank: self.rank(),
                peers: &peers,
                transport: info.transport,
                buffers,
                capabilities: caps,
            });
        }
        // A mixed communicator: each connection's path is that of its own transport.
        let kind = |p: usize| {
            info.peer_transports
                .get(p)
                .copied()
                .unwrap_or(info.transport)
        };
        let mut kinds: Vec<TransportKind> = peers.iter().map(|&p| kind(p)).collect();
        kinds.sort_by_key(|k| k.name());
        kinds.dedup();
        let mut plan = PathPlan {
            connections: Vec::with_capacity(peers.len()),
            warnings: Vec::new(),
        };
        for k in kinds {
            let some: Vec<usize> = peers.iter().copied().filter(|&p| kind(p) == k).collect();
            let part = path::decide(&PathInputs {
                policy,
                rank: self.rank(),
                peers: &some,
                transport: k,
                buffers,
                capabilities: caps,
            })?;
            plan.connections.extend(part.connections);
            plan.warnings.extend(part.warnings);
        }
        plan.connections.sort_by_key(|c| c.peer);
        Ok(plan)
    }

    /// Checks at init that the data-path policy can be honoured for device memory.
    pub(crate) fn check_path_policy(&self) -> Result<()> {
        if self.info().data_path == PathPolicy::GpuDirect && self.world_size() > 1 {
            self.data_paths(BufferLocation::Device)?;
        }
        Ok(())
    }

    fn reducer(&self, stream: &Arc<CudaStream>) -> Result<Arc<GpuReducer>> {
        let mut st = self.gpu_state();
        if !st.warned {
            st.warned = true;
            let plan = self.data_paths(BufferLocation::Device)?;
            for w in &plan.warnings {
                super::setup::once::warn_once!(key: w, "{w}");
            }
            if let Some(c) = plan.connections.first() {
                tracing::info!(rank = self.rank(), "device memory path: {:#}", c.send);
            }
        }
        drop(st);
        let disk = match &self.config.cache_dir {
            Some(d) => DiskCache::Dir(d.clone()),
            None => DiskCache::Off,
        };
        GpuReducer::shared(stream.context(), &disk)
    }

    /// What a device call on `stream`'s GPU needs, prepared on the issuing thread: the
    /// reduction kernels and the way its data moves.
    fn prepare(&self, stream: &Arc<CudaStream>) -> Result<(Arc<GpuReducer>, Via)> {
        let reducer = self.reducer(stream)?;
        let direct = self.world_size() > 1
            && path::uses_gpu_direct(
                self.data_path(),
                self.info().transport,
                &self.info().gpu_direct,
            );
        if direct {
            // Every rank announced a registered region at init and decides from the same
            // facts, so every rank takes this branch for this call.
            let Some(g) = self.region.as_ref() else {
                return Err(Error::invalid(
                    Some(self.rank()),
                    "device collective",
                    "GPUDirect RDMA was agreed but this rank has no direct region",
                ));
            };
            return Ok((reducer, Via::Direct(Arc::clone(g))));
        }
        let slot = self.info().segment_bytes;
        let ctx = stream.context();
        let mut st = self.gpu_state();
        // One pool per GPU for the communicator's life (its segment size is fixed at init).
        // Never locked here: a queued call running on it holds its lock, and issuing must not
        // wait for that.
        let pool = match st.pools.entry(ctx.ordinal()) {
            Entry::Occupied(mut e) => {
                // A pool that an earlier device leaked (its work never finished) is replaced.
                // (Not waited for: a pool in use is not leaked.)
                let stuck = e.get().try_lock().is_ok_and(|p| p.stuck().is_some());
                if stuck {
                    let pool = StagingPool::new(ctx, STAGE_SLOTS, STAGE_SLOTS, slot)?;
                    e.insert(Arc::new(Mutex::new(pool)));
                }
                Arc::clone(e.get())
            }
            Entry::Vacant(v) => {
                let pool = StagingPool::new(ctx, STAGE_SLOTS, STAGE_SLOTS, slot)?;
                Arc::clone(v.insert(Arc::new(Mutex::new(pool))))
            }
        };
        Ok((reducer, Via::Staged(pool)))
    }

    /// A blocking device call: on the caller's thread and stream, after every operation
    /// issued before it.
    fn device_call<T, S, D>(
        &self,
        call: Call,
        v: VCounts<'_>,
        stream: &Arc<CudaStream>,
        src: Option<&S>,
        dst: Option<&mut D>,
    ) -> Result<()>
    where
        T: Element + DeviceRepr,
        S: DevicePtr<T>,
        D: DevicePtrMut<T>,
    {
        // A poisoned communicator is reported by the engine for a call that runs. (An
        // all_to_all_v that sends nothing may still receive.)
        if v.is_none() {
            if let Some(res) = self.empty_call(&call, None) {
                return res;
            }
        }
        let call = Call {
            dtype: T::DATA_TYPE,
            ..call
        };
        // Every failure from here on — a kernel that does not compile, a staging allocation,
        // a stream on another GPU than the buffers — happens while the peers are in the call:
        // it poisons the communicator and tells them, like a failure half-way.
        // What the engine returns keeps the engine's rules (an argument error all ranks find
        // alike, such as a bad root, does not poison).
        let prepared = self.prepare(stream);
        self.shared.exclusive(None, |eng| {
            let r = prepared.and_then(|(reducer, via)| {
                run_prepared::<T, S, D>(eng, &call, v, &reducer, &via, stream, src, dst)
            });
            match r {
                Ok(r) => r,
                Err(e) => Err(eng.fail_before_start(&call, e)),
            }
        })
    }

    /// The communicator's own stream and doorbell on `stream`'s GPU (made at first use).
    fn queue_for(&self, stream: &Arc<CudaStream>) -> Result<(Arc<CudaStream>, Arc<Doorbell>)> {
        let ctx = stream.context();
        let mut st = self.gpu_state();
        if let Some((s, b)) = st.queues.get(&ctx.ordinal()) {
            return Ok((Arc::clone(s), Arc::clone(b)));
        }
        let own = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        let bell = Arc::new(Doorbell::new(ctx)?);
        st.queues
            .insert(ctx.ordinal(), (Arc::clone(&own), Arc::clone(&bell)));
        Ok((own, bell))
    }

    /// Why non-blocking device calls on GPU `ordinal` block the host (its driver cannot make
    /// a stream wait for a memory value), or `None` where they are stream-ordered as
    /// documented (or have not been tried on that GPU yet).
    pub fn enqueue_blocks(&self, ordinal: usize) -> Option<String> {
        self.gpu_state().blocking.get(&ordinal).cloned()
    }

    /// Every GPU where non-blocking device calls block the host, with why
    /// ([`Communicator::enqueue_blocks`]), by ordinal: among the GPUs a non-blocking call has
    /// run on so far.
    pub fn enqueue_blocking_gpus(&self) -> Vec<(usize, String)> {
        let mut all: Vec<(usize, String)> = self
            .gpu_state()
            .blocking
            .iter()
            .map(|(g, why)| (*g, why.clone()))
            .collect();
        all.sort_unstable();
        all
    }

    /// A non-blocking device call on raw buffers (`(address, bytes)`), ordered on `stream`:
    /// see the module docs. `guards` are cudarc's records of the buffers' use on `stream`,
    /// dropped once `stream` waits for the call.
    /// `keep` (a temporary copy the call runs on) is dropped once the call ran.
    /// `ordered`: `stream` is made to wait (on the GPU) for the call; where not, the call
    /// still starts after the work queued on `stream` before it, but `stream` goes on at once
    /// and the caller uses the buffers only after the `Work` completed (torch's asynchronous
    /// point-to-point operations).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn device_start(
        &self,
        call: Call,
        stream: &Arc<CudaStream>,
        src: Option<(u64, usize)>,
        dst: Option<(u64, usize)>,
        guards: Vec<SyncOnDrop<'_>>,
        keep: Option<CudaSlice<u8>>,
        timeout: Option<std::time::Duration>,
        ordered: bool,
    ) -> Result<Work> {
        let what = call.coll.name();
        if let Some(w) = self.empty_work(&call, timeout) {
            return Ok(w);
        }
        let ordinal = stream.context().ordinal();
        let blocked = ordered && self.gpu_state().blocking.contains_key(&ordinal);
        let fail = |e: Error| Ok(self.fail_queued(call, e, timeout));
        if blocked {
            drop(guards);
            return Ok(self.device_bytes_now(call, stream, src, dst, timeout));
        }
        let (prepared, queue) = match self
            .prepare(stream)
            .and_then(|p| Ok((p, self.queue_for(stream)?)))
        {
            Ok(x) => x,
            Err(e) => return fail(e),
        };
        let ((reducer, via), (own, bell)) = (prepared, queue);
        // What the caller queued on `stream` before this call.
        let start = match bell.recorded(stream) {
            Ok(e) => e,
            Err(e) => return fail(e),
        };
        let events = Arc::clone(&bell);
        let stuck = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stuck_flag = Arc::clone(&stuck);
        let mut issue = bell.issue();
        let ticket = match ordered.then(|| issue.ticket(stream)) {
            None => None,
            Some(Ok(t)) => Some(t),
            Some(Err(e)) => {
                drop(issue);
                let why = format!(
                    "GPU {ordinal} cannot make a stream wait for the collective ({e}): \
                     non-blocking device collectives there run as blocking ones"
                );
                super::setup::once::warn_once!(key: &why, rank = self.rank(), "{why}");
                self.gpu_state().blocking.insert(ordinal, why);
                drop(guards);
                return Ok(self.device_bytes_now(call, stream, src, dst, timeout));
            }
        };
        let hold = Hold { ticket, keep };
        let task: Task = Box::new(move |eng| {
            // Dropped when the task ends, after the device's drop waited for everything it
            // queued (or with the task, when it is dropped without running): rings the
            // doorbell, then frees the temporary copy.
            let _hold = hold;
            let stuck_before = via.stuck();
            let waited = own.wait(&start);
            // The wait is queued (or failed): the event may be recorded again.
            events.give_back(start);
            let r = waited
                .map_err(driver_err("cuStreamWaitEvent"))
                .and_then(|()| {
                    let src = src.map(|(p, n)| Raw::<u8>::new(p, n, &own));
                    let mut dst = dst.map(|(p, n)| Raw::<u8>::new(p, n, &own));
                    run_prepared::<u8, _, _>(
                        eng,
                        &call,
                        None,
                        &reducer,
                        &via,
                        &own,
                        src.as_ref(),
                        dst.as_mut(),
                    )
                });
            // The device was dropped: where its work never finished, the pool or region it
            // used is leaked now, and the buffers may still be in use.
            if !stuck_before && via.stuck() {
                stuck_flag.store(true, std::sync::atomic::Ordering::Release);
            }
            match r {
                Ok(r) => r,
                Err(e) => Err(eng.fail_before_start(&call, e)),
            }
        });
        let work = self
            .shared
            .submit(task, timeout, what)
            .with_stuck_flag(stuck);
        drop(issue);
        // The buffers' use is recorded on `stream` after its wait for the collective.
        drop(guards);
        Ok(work)
    }

    /// Queues the failure of `call` before its engine ran: as for a blocking call, it fails
    /// the call for every rank, in issue order.
    pub(super) fn fail_queued(
        &self,
        call: Call,
        e: Error,
        timeout: Option<std::time::Duration>,
    ) -> Work {
        let task: Task = Box::new(move |eng| Err(eng.fail_before_start(&call, e)));
        self.shared.submit(task, timeout, call.coll.name())
    }

    /// A non-blocking call run now, as a blocking one, on raw buffers (where the GPU cannot
    /// order it on the stream): a completed `Work`.
    fn device_bytes_now(
        &self,
        call: Call,
        stream: &Arc<CudaStream>,
        src: Option<(u64, usize)>,
        dst: Option<(u64, usize)>,
        timeout: Option<std::time::Duration>,
    ) -> Work {
        let r = self.device_bytes_run(call, None, stream, (src, dst), timeout);
        self.shared.finished(r, call.coll.name())
    }

    /// A device call (an all_to_all_v with counts `v`) on raw buffers, run on this thread
    /// after every operation issued before it: the body of [`Self::device_bytes_now`] and
    /// [`Communicator::run_raw_all_to_all_v_device_on`].
    fn device_bytes_run(
        &self,
        call: Call,
        v: VCounts<'_>,
        stream: &Arc<CudaStream>,
        (src, dst): (RawBuf, RawBuf),
        timeout: Option<std::time::Duration>,
    ) -> Result<()> {
        let src = src.map(|(p, n)| Raw::<u8>::new(p, n, stream));
        let mut dst = dst.map(|(p, n)| Raw::<u8>::new(p, n, stream));
        let prepared = self.prepare(stream);
        self.shared.exclusive(timeout, |eng| {
            let r = prepared.and_then(|(reducer, via)| {
                run_prepared::<u8, _, _>(
                    eng,
                    &call,
                    v,
                    &reducer,
                    &via,
                    stream,
                    src.as_ref(),
                    dst.as_mut(),
                )
            });
            match r {
                Ok(r) => r,
                Err(e) => Err(eng.fail_before_start(&call, e)),
            }
        })
    }

    /// The non-blocking device collectives: each is queued on the caller's stream and
    /// returns at once with a [`Work`] for host-side completion (see the module docs).
    ///
    /// The returned [`Enqueue`] makes one call (it is consumed by it).
    ///
    /// # Safety
    /// Every buffer passed to the call made through the returned [`Enqueue`] must stay
    /// allocated — not dropped, and not freed any other way, stream-ordered frees
    /// (`cuMemFreeAsync`, which cudarc's `Drop` calls) included — until the call's [`Work`]
    /// has completed without leaving device work behind: [`Work::wait`], [`Work::test`] or
    /// [`Work::wait_timeout`] reported the end (success or error) and
    /// [`Work::buffers_may_be_in_use`] is `false` (it always is after a success).
    /// Otherwise — the `Work` was dropped or forgotten before its end, or the flag is set —
    /// the buffers must never be freed (`std::mem::forget` them). The reason: the library
    /// issues copies and kernels on them from its progress thread (or a thread waiting in
    /// [`Work::wait`]) while the call runs, after this returns, and CUDA makes work issued
    /// on freed memory undefined. Using the buffers in stream order on `stream`
    /// (kernels, copies queued there) needs nothing more: that work waits for the call.
    ///
    /// ```no_run
    /// # fn main() -> dspark::Result<()> {
    /// use dspark::{Communicator, ReduceOp};
    /// let comm = Communicator::from_env()?;
    /// let ctx = dspark::cuda::open_context(0)?;
    /// let stream = ctx.default_stream();
    /// let mut grads = stream.alloc_zeros::<f32>(1 << 20).unwrap();
    /// // SAFETY: `grads` is freed only after the call succeeded, forgotten otherwise.
    /// let work = unsafe { comm.enqueue() }.all_reduce(&mut grads, ReduceOp::Avg, &stream)?;
    /// // ... queue more work on `stream`: it sees the reduced gradients ...
    /// match work.wait() {
    ///     Ok(()) => drop(grads),
    ///     Err(e) => {
    ///         std::mem::forget(grads); // the GPU may still be writing it
    ///         return Err(e);
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    // Declares the callers' contract above; performs no unsafe operation itself.
    #[allow(unsafe_code)]
    pub unsafe fn enqueue(&self) -> Enqueue<'_> {
        Enqueue {
            comm: self,
            blocking: false,
        }
    }

    fn blocking(&self) -> Enqueue<'_> {
        Enqueue {
            comm: self,
            blocking: true,
        }
    }

    /// [`Communicator::all_reduce`] on device memory, ordered on `stream`.
    ///
    /// # Errors
    /// [`Error::Unavailable`] without a CUDA driver or NVRTC; otherwise as `all_reduce`.
    pub fn all_reduce_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.blocking().all_reduce(buf, op, stream)?.wait()
    }

    /// [`Communicator::all_gather`] on device memory, ordered on `stream`.
    ///
    /// # Errors
    /// `InvalidArgument` on wrong lengths; otherwise as [`Communicator::all_reduce_device`].
    pub fn all_gather_device<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.blocking().all_gather(send, recv, stream)?.wait()
    }

    /// [`Communicator::reduce_scatter`] on device memory, ordered on `stream`.
    ///
    /// # Errors
    /// `InvalidArgument` on wrong lengths; otherwise as [`Communicator::all_reduce_device`].
    pub fn reduce_scatter_device<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.blocking()
            .reduce_scatter(send, recv, op, stream)?
            .wait()
    }

    /// [`Communicator::all_to_all`] on device memory, ordered on `stream`.
    ///
    /// # Errors
    /// `InvalidArgument` on wrong lengths; otherwise as [`Communicator::all_reduce_device`].
    pub fn all_to_all_device<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.blocking().all_to_all(send, recv, stream)?.wait()
    }

    /// [`Communicator::all_to_all_v`] on device memory, ordered on `stream`: `send_counts[j]`
    /// elements of `send` (blocks in rank order) to rank j, `recv_counts[i]` elements from rank
    /// i into `recv` — an expert-parallel exchange on GPU buffers. Blocking: it returns once
    /// the exchange is complete (through the same path as the other device collectives,
    /// GPUDirect or host-staged). The same frames as the host call, so host and device ranks
    /// can be mixed.
    ///
    /// # Errors
    /// `InvalidArgument` when the counts are not one per rank, do not add up to the buffers'
    /// lengths or disagree on this rank's own block; a mismatch where a peer's counts disagree
    /// with this rank's; otherwise as [`Communicator::all_reduce_device`].
    pub fn all_to_all_v_device<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        send_counts: &[usize],
        recv: &mut CudaSlice<T>,
        recv_counts: &[usize],
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        // The engine checks the counts against the buffers (`v_check`), as on host memory.
        let call = Call::new(Collective::AllToAll, None, v_sent(send_counts), 0, false);
        self.device_call::<T, _, _>(
            call,
            Some((send_counts, recv_counts)),
            stream,
            Some(send),
            Some(recv),
        )
    }

    /// [`Communicator::all_to_all_v_device`] on raw device buffers (`(address, bytes)`) of GPU
    /// `device`'s primary context, ordered on the CUDA stream whose handle is `stream` (0:
    /// the legacy default stream) — as torch gives them. Runs on the caller's thread, after
    /// every operation issued before it, and returns once complete; `timeout` replaces the
    /// communicator's deadline for this call.
    ///
    /// # Safety
    /// Until this returns: `src` and `dst` are device memory of that context valid for the
    /// bytes given (reads of `src`, reads and writes of `dst`), no other work writes `src` or
    /// accesses `dst`, and `stream` is 0 or a live stream of that context.
    ///
    /// # Errors
    /// `InvalidArgument` when the buffers overlap; otherwise as
    /// [`Communicator::all_to_all_v_device`].
    #[allow(unsafe_code, clippy::too_many_arguments)]
    pub unsafe fn run_raw_all_to_all_v_device_on(
        &self,
        dtype: crate::types::DataType,
        src: (u64, usize),
        send_counts: &[usize],
        dst: (u64, usize),
        recv_counts: &[usize],
        device: usize,
        stream: usize,
        timeout: Option<std::time::Duration>,
    ) -> Result<()> {
        let (s, d) = (src.0 as u128, dst.0 as u128);
        if src.1 > 0 && dst.1 > 0 && s < d + dst.1 as u128 && d < s + src.1 as u128 {
            return Err(Error::invalid(
                Some(self.rank()),
                Collective::AllToAll.name(),
                "the send and receive buffers overlap",
            ));
        }
        let call = Call {
            dtype,
            ..Call::new(Collective::AllToAll, None, v_sent(send_counts), 0, false)
        };
        let ctx = crate::gpu::device::open_context(device)?;
        // SAFETY: the caller's contract: a live stream of this context (or 0), alive until
        // this returns.
        let stream = unsafe { ctx.wrap_borrowed_stream(stream as cudarc::driver::sys::CUstream) };
        let v = Some((send_counts, recv_counts));
        self.device_bytes_run(call, v, &stream, (Some(src), Some(dst)), timeout)
    }

    /// [`Communicator::broadcast`] on device memory, ordered on `stream`.
    ///
    /// # Errors
    /// `InvalidArgument` when `root` is not a rank; otherwise as
    /// [`Communicator::all_reduce_device`].
    pub fn broadcast_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.blocking().broadcast(buf, root, stream)?.wait()
    }

    /// [`Communicator::reduce`] on device memory, ordered on `stream`.
    ///
    /// # Errors
    /// `InvalidArgument` when `root` is not a rank; otherwise as
    /// [`Communicator::all_reduce_device`].
    pub fn reduce_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
        root: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.blocking().reduce(buf, op, root, stream)?.wait()
    }

    /// [`Communicator::send`] from device memory, ordered on `stream`.
    ///
    /// # Errors
    /// `InvalidArgument` when `peer` is not another rank; otherwise as
    /// [`Communicator::all_reduce_device`].
    pub fn send_device<T: Element + DeviceRepr>(
        &self,
        buf: &CudaSlice<T>,
        peer: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.blocking().send(buf, peer, stream)?.wait()
    }

    /// [`Communicator::recv`] into device memory, ordered on `stream`.
    ///
    /// # Errors
    /// `InvalidArgument` when `peer` is not another rank; otherwise as
    /// [`Communicator::all_reduce_device`].
    pub fn recv_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        peer: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.blocking().recv(buf, peer, stream)?.wait()
    }
}

/// The non-blocking device collectives ([`Communicator::enqueue`], whose safety contract
/// binds the call made here: buffers stay allocated until the call's `Work` completed). One
/// value makes one call. Each has the semantics,
/// arguments and errors of the blocking form of the same name with `_device` (for example
/// [`Communicator::all_reduce_device`]), is queued on `stream` in issue order with every
/// other operation of the communicator, and returns at once: work queued on `stream`
/// afterwards sees its result; [`Work::wait`] / [`Work::test`] give host-side completion and
/// the error. Argument errors come back at once.
#[derive(Debug)]
pub struct Enqueue<'c> {
    comm: &'c Communicator,
    /// Run now on the caller's thread (the blocking forms), returning a completed `Work`.
    blocking: bool,
}

impl Enqueue<'_> {
    /// Blocking: runs the call now. Non-blocking: records `src` and `dst` on `stream` and
    /// queues the call.
    fn go<T, S, D>(
        self,
        call: Call,
        stream: &Arc<CudaStream>,
        src: Option<&S>,
        dst: Option<&mut D>,
    ) -> Result<Work>
    where
        T: Element + DeviceRepr,
        S: DevicePtr<T>,
        D: DevicePtrMut<T>,
    {
        let c = self.comm;
        if self.blocking {
            let r = c.device_call::<T, S, D>(call, None, stream, src, dst);
            return Ok(c.shared.finished(r, call.coll.name()));
        }
        let call = Call {
            dtype: T::DATA_TYPE,
            ..call
        };
        let mut guards = Vec::new();
        let src = src.map(|s| {
            let (p, g) = s.device_ptr(stream);
            guards.push(g);
            (p, s.num_bytes())
        });
        let dst = dst.map(|d| {
            let n = d.num_bytes();
            let (p, g) = d.device_ptr_mut(stream);
            guards.push(g);
            (p, n)
        });
        c.device_start(call, stream, src, dst, guards, None, None, true)
    }

    /// A collective on one buffer: in place, or received into (`Target::RecvFrom`).
    fn one<T: Element + DeviceRepr>(
        self,
        coll: Collective,
        op: Option<ReduceOp>,
        target: Target,
        buf: &mut CudaSlice<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<Work> {
        let n = buf.len();
        let send = if matches!(target, Target::RecvFrom(_)) {
            0
        } else {
            n
        };
        let call = self.comm.shape(Api::Device, coll, op, send, n, target)?;
        self.go::<T, CudaSlice<T>, _>(call, stream, None, Some(buf))
    }

    /// A collective from a send buffer into a receive buffer.
    fn two<T: Element + DeviceRepr>(
        self,
        coll: Collective,
        op: Option<ReduceOp>,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<Work> {
        let (s, r) = (send.len(), recv.len());
        let call = self.comm.shape(Api::Device, coll, op, s, r, Target::None)?;
        self.go::<T, _, _>(call, stream, Some(send), Some(recv))
    }

    /// [`Communicator::all_reduce_device`], non-blocking.
    ///
    /// # Errors
    /// Argument errors at once; the operation's from the [`Work`].
    pub fn all_reduce<T: Element + DeviceRepr>(
        self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> Result<Work> {
        self.one(Collective::AllReduce, Some(op), Target::None, buf, stream)
    }

    /// [`Communicator::all_gather_device`], non-blocking.
    ///
    /// # Errors
    /// Argument errors at once; the operation's from the [`Work`].
    pub fn all_gather<T: Element + DeviceRepr>(
        self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<Work> {
        self.two(Collective::AllGather, None, send, recv, stream)
    }

    /// [`Communicator::reduce_scatter_device`], non-blocking.
    ///
    /// # Errors
    /// Argument errors at once; the operation's from the [`Work`].
    pub fn reduce_scatter<T: Element + DeviceRepr>(
        self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> Result<Work> {
        self.two(Collective::ReduceScatter, Some(op), send, recv, stream)
    }

    /// [`Communicator::all_to_all_device`], non-blocking.
    ///
    /// # Errors
    /// Argument errors at once; the operation's from the [`Work`].
    pub fn all_to_all<T: Element + DeviceRepr>(
        self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<Work> {
        self.two(Collective::AllToAll, None, send, recv, stream)
    }

    /// [`Communicator::broadcast_device`], non-blocking.
    ///
    /// # Errors
    /// Argument errors at once; the operation's from the [`Work`].
    pub fn broadcast<T: Element + DeviceRepr>(
        self,
        buf: &mut CudaSlice<T>,
        root: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<Work> {
        self.one(Collective::Broadcast, None, Target::Root(root), buf, stream)
    }

    /// [`Communicator::reduce_device`], non-blocking.
    ///
    /// # Errors
    /// Argument errors at once; the operation's from the [`Work`].
    pub fn reduce<T: Element + DeviceRepr>(
        self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
        root: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<Work> {
        self.one(
            Collective::Reduce,
            Some(op),
            Target::Root(root),
            buf,
            stream,
        )
    }

    /// [`Communicator::send_device`], non-blocking.
    ///
    /// # Errors
    /// Argument errors at once; the operation's from the [`Work`].
    pub fn send<T: Element + DeviceRepr>(
        self,
        buf: &CudaSlice<T>,
        peer: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<Work> {
        let n = buf.len();
        let t = Target::SendTo(peer);
        let call = self
            .comm
            .shape(Api::Device, Collective::SendRecv, None, n, 0, t)?;
        self.go::<T, _, CudaSlice<T>>(call, stream, Some(buf), None)
    }

    /// [`Communicator::recv_device`], non-blocking.
    ///
    /// # Errors
    /// Argument errors at once; the operation's from the [`Work`].
    pub fn recv<T: Element + DeviceRepr>(
        self,
        buf: &mut CudaSlice<T>,
        peer: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<Work> {
        self.one(
            Collective::SendRecv,
            None,
            Target::RecvFrom(peer),
            buf,
            stream,
        )
    }
}
