//! Collectives on GPU memory (cudarc device buffers), and the data-path report.
//!
//! Every device collective has the semantics of its host twin and is stream-ordered on the
//! stream the caller passes: it starts after the work already queued there, and work queued
//! there afterwards sees its result (no device-wide synchronisation). The call returns when
//! the collective is complete.
//!
//! **Path truth.** This build moves device memory *host-staged*: GPU → pinned host slot →
//! wire → pinned host slot → GPU, with the copies, the wire and the GPU reductions of
//! neighbouring segments overlapped (see [`crate::engine::staged`]). GPUDirect RDMA transfers
//! (the NIC reading and writing GPU memory) are not implemented yet, so
//! `DSPARK_DATA_PATH=gpu-direct` is an error at init that says so, and the path of every
//! connection says `staged` with the reason — in [`Communicator::data_paths`], in the bench
//! header and in every bench row.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};

use crate::comm::Communicator;
use crate::engine::Call;
use crate::error::{Error, Result};
use crate::gpu::device::GpuReducer;
use crate::gpu::staged::{CudaStagedDevice, StagingPool};
use crate::path::{self, BufferLocation, GpuDirectCapability, PathInputs, PathPlan, PathPolicy};
use crate::plan::Collective;
use crate::types::{Element, ReduceOp};

/// Why device memory is not moved with GPUDirect RDMA by this build.
pub const GPU_DIRECT_NOT_IMPLEMENTED: &str =
    "this build moves device memory host-staged only: GPUDirect RDMA transfers (the NIC reading \
     and writing GPU memory) are not implemented yet";

/// Pinned slots per direction for staged device collectives.
const STAGE_SLOTS: usize = 4;

/// Per-communicator CUDA state: the reduction kernels, loaded once per GPU.
#[derive(Debug, Default)]
pub(crate) struct GpuState {
    reducers: HashMap<usize, Arc<GpuReducer>>,
    /// Pinned staging memory per GPU, reused by every call.
    pools: HashMap<usize, StagingPool>,
    warned: bool,
}

/// The GPUDirect capability this build announces for every rank.
fn capabilities(world: usize) -> Vec<GpuDirectCapability> {
    vec![GpuDirectCapability::Unavailable(GPU_DIRECT_NOT_IMPLEMENTED.to_string()); world]
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
        self.data_paths_for(self.info().data_path, buffers)
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
        let caps = capabilities(self.world_size());
        path::decide(&PathInputs {
            policy,
            rank: self.rank(),
            peers: &peers,
            transport: self.info().transport,
            buffers,
            capabilities: &caps,
        })
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
        let r = Arc::new(GpuReducer::new(stream.context())?);
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
        if let Some(e) = self.poisoned() {
            return Err(e);
        }
        if call.count == 0 {
            return Ok(());
        }
        let reducer = self.reducer(stream)?;
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
        let mut dev = CudaStagedDevice::new::<T, S, D>(&reducer, stream, src, dst, pool)?;
        let call = Call {
            dtype: T::DATA_TYPE,
            ..call
        };
        self.run_staged(call, &mut dev)
    }

    fn dev_invalid(&self, coll: Collective, what: String) -> Error {
        Error::invalid(Some(self.rank()), format!("{}_device", coll.name()), what)
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
        let call = Call::new(Collective::AllReduce, Some(op), buf.len(), 0, false);
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
        if recv.len() != send.len() * self.world_size() {
            return Err(self.dev_invalid(
                Collective::AllGather,
                format!(
                    "recv has {} elements, expected {} × {}",
                    recv.len(),
                    send.len(),
                    self.world_size()
                ),
            ));
        }
        let call = Call::new(Collective::AllGather, None, send.len(), 0, false);
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
        if send.len() != recv.len() * self.world_size() {
            return Err(self.dev_invalid(
                Collective::ReduceScatter,
                format!(
                    "send has {} elements, expected {} × {}",
                    send.len(),
                    recv.len(),
                    self.world_size()
                ),
            ));
        }
        let call = Call::new(Collective::ReduceScatter, Some(op), recv.len(), 0, false);
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
        let n = self.world_size();
        if send.len() != recv.len() || !send.len().is_multiple_of(n) {
            return Err(self.dev_invalid(
                Collective::AllToAll,
                format!(
                    "send ({}) and recv ({}) must be equal multiples of {n}",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        let call = Call::new(Collective::AllToAll, None, send.len() / n, 0, false);
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
        let call = Call::new(Collective::Broadcast, None, buf.len(), root, false);
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
        let call = Call::new(Collective::Reduce, Some(op), buf.len(), root, false);
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
        if peer == self.rank() {
            return Err(self.dev_invalid(
                Collective::SendRecv,
                "cannot send to this rank itself".into(),
            ));
        }
        let call = Call::new(Collective::SendRecv, None, buf.len(), peer, true);
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
        if peer == self.rank() {
            return Err(self.dev_invalid(
                Collective::SendRecv,
                "cannot receive from this rank itself".into(),
            ));
        }
        let call = Call::new(Collective::SendRecv, None, buf.len(), peer, false);
        self.device_call::<T, CudaSlice<T>, _>(call, stream, None, Some(buf))
    }
}
