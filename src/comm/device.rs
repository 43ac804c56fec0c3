//! Collectives on GPU memory (cudarc device buffers), and the data-path report.
//!
//! Every device collective has the semantics of its host twin and is stream-ordered on the
//! stream the caller passes: it starts after the work already queued there, and work queued
//! there afterwards sees its result (no device-wide synchronisation). The call returns when
//! the collective is complete.
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

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};

use crate::comm::{Api, Communicator, Target};
use crate::engine::Call;
use crate::error::{Error, Result};
use crate::gpu::device::GpuReducer;
use crate::gpu::direct::CudaDirectDevice;
use crate::gpu::nvrtc::DiskCache;
use crate::gpu::staged::{CudaStagedDevice, StagingPool};
use crate::path::{self, BufferLocation, PathInputs, PathPlan, PathPolicy};
use crate::plan::Collective;
use crate::transport::TransportKind;
use crate::types::{Element, ReduceOp};

/// Pinned slots per direction for staged device collectives.
const STAGE_SLOTS: usize = 4;

/// Send slots of the direct region.
pub(crate) const DIRECT_SEND_SLOTS: usize = 4;

/// Per-communicator CUDA state: the reduction kernels, loaded once per GPU.
#[derive(Debug, Default)]
pub(crate) struct GpuState {
    reducers: HashMap<usize, Arc<GpuReducer>>,
    /// Pinned staging memory per GPU, reused by every call.
    pools: HashMap<usize, StagingPool>,
    warned: bool,
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
        let ordinal = stream.context().ordinal();
        let mut st = self.gpu_state();
        if !st.warned {
            st.warned = true;
            let plan = self.data_paths(BufferLocation::Device)?;
            for w in &plan.warnings {
                tracing::warn!("{w}");
            }
            if let Some(c) = plan.connections.first() {
                tracing::info!(rank = self.rank(), "device memory path: {:#}", c.send);
            }
        }
        if let Some(r) = st.reducers.get(&ordinal) {
            return Ok(Arc::clone(r));
        }
        let disk = match &self.config.cache_dir {
            Some(d) => DiskCache::Dir(d.clone()),
            None => DiskCache::Off,
        };
        let r = Arc::new(GpuReducer::with_cache(stream.context(), &disk)?);
        st.reducers.insert(ordinal, Arc::clone(&r));
        Ok(r)
    }

    fn device_call<T, S, D>(
        &self,
        call: Call,
        stream: &Arc<CudaStream>,
        src: Option<&S>,
        dst: Option<&mut D>,
    ) -> Result<()>
    where
        T: Element + DeviceRepr,
        S: DevicePtr<T>,
        D: DevicePtrMut<T>,
    {
        // A poisoned communicator is reported by the engine for a call that runs.
        if let Some(res) = self.empty_call(&call, None) {
            return res;
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
        match self.device_call_on(&call, stream, src, dst) {
            Ok(r) => r,
            Err(e) => self
                .shared
                .exclusive(None, |eng| Err(eng.fail_before_start(&call, e))),
        }
    }

    /// Prepares the device for `call` and runs it: `Err` is a failure before the engine
    /// started (the caller fails the call for every rank), `Ok` the engine's result.
    fn device_call_on<T, S, D>(
        &self,
        call: &Call,
        stream: &Arc<CudaStream>,
        src: Option<&S>,
        dst: Option<&mut D>,
    ) -> Result<Result<()>>
    where
        T: Element + DeviceRepr,
        S: DevicePtr<T>,
        D: DevicePtrMut<T>,
    {
        let call = *call;
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
            #[allow(unsafe_code)]
            // SAFETY: `dev` is a local of this function, dropped when it returns (never
            // leaked), which waits for everything it queued.
            let mut dev = unsafe {
                CudaDirectDevice::new::<T, S, D>(&reducer, stream, src, dst, g, DIRECT_SEND_SLOTS)?
            };
            return Ok(self.exec_staged(call, &mut dev));
        }
        let slot = self.info().segment_bytes;
        let ctx = stream.context();
        let mut st = self.gpu_state();
        let pool = match st.pools.entry(ctx.ordinal()) {
            Entry::Occupied(e) if e.get().fits(ctx, STAGE_SLOTS, STAGE_SLOTS, slot) => e.into_mut(),
            Entry::Occupied(mut e) => {
                e.insert(StagingPool::new(ctx, STAGE_SLOTS, STAGE_SLOTS, slot)?);
                e.into_mut()
            }
            Entry::Vacant(e) => e.insert(StagingPool::new(ctx, STAGE_SLOTS, STAGE_SLOTS, slot)?),
        };
        #[allow(unsafe_code)]
        // SAFETY: as above: a local, dropped when this function returns.
        let mut dev =
            unsafe { CudaStagedDevice::new::<T, S, D>(&reducer, stream, src, dst, pool)? };
        Ok(self.exec_staged(call, &mut dev))
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
        let n = buf.len();
        let call = self.shape(
            Api::Device,
            Collective::AllReduce,
            Some(op),
            n,
            n,
            Target::None,
        )?;
        self.device_call::<T, CudaSlice<T>, _>(call, stream, None, Some(buf))
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
        let (s, r) = (send.len(), recv.len());
        let call = self.shape(Api::Device, Collective::AllGather, None, s, r, Target::None)?;
        self.device_call::<T, _, _>(call, stream, Some(send), Some(recv))
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
        let (s, r) = (send.len(), recv.len());
        let call = self.shape(
            Api::Device,
            Collective::ReduceScatter,
            Some(op),
            s,
            r,
            Target::None,
        )?;
        self.device_call::<T, _, _>(call, stream, Some(send), Some(recv))
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
        let (s, r) = (send.len(), recv.len());
        let call = self.shape(Api::Device, Collective::AllToAll, None, s, r, Target::None)?;
        self.device_call::<T, _, _>(call, stream, Some(send), Some(recv))
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
        let n = buf.len();
        let call = self.shape(
            Api::Device,
            Collective::Broadcast,
            None,
            n,
            n,
            Target::Root(root),
        )?;
        self.device_call::<T, CudaSlice<T>, _>(call, stream, None, Some(buf))
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
        let n = buf.len();
        let call = self.shape(
            Api::Device,
            Collective::Reduce,
            Some(op),
            n,
            n,
            Target::Root(root),
        )?;
        self.device_call::<T, CudaSlice<T>, _>(call, stream, None, Some(buf))
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
        let n = buf.len();
        let call = self.shape(
            Api::Device,
            Collective::SendRecv,
            None,
            n,
            0,
            Target::SendTo(peer),
        )?;
        self.device_call::<T, _, CudaSlice<T>>(call, stream, Some(buf), None)
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
        let n = buf.len();
        let call = self.shape(
            Api::Device,
            Collective::SendRecv,
            None,
            0,
            n,
            Target::RecvFrom(peer),
        )?;
        self.device_call::<T, CudaSlice<T>, _>(call, stream, None, Some(buf))
    }
}
