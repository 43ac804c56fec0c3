//! Running one call of the timed collective on one size's buffers, wherever `--mem` puts
//! them: host memory through the blocking or the non-blocking API, the emulated device (the
//! host-staged pipeline on host memory, `--features testing`), or GPU memory on the rank's GPU.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use dspark::internals::engine::staged::EmulatedDevice;
use dspark::internals::engine::Call;
use dspark::Communicator;

use crate::data::{BenchElem, Bufs};
use crate::{Args, CallApi, Coll, Mem};

/// One call of the collective on host memory, through the API `--api` names.
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
        Coll::AllToAllV => {
            let (sc, rc) = b.counts.as_ref().ok_or_else(no_counts)?;
            comm.all_to_all_v(&b.send, sc, &mut b.recv, rc)
        }
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

/// A bench's all_to_all_v buffers without their counts (`data::prepare` makes both).
fn no_counts() -> dspark::Error {
    dspark::Error::invalid(None, "all_to_all_v", "the bench prepared no counts")
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
            Coll::AllToAllV => {
                let (sc, rc) = b.counts.as_ref().ok_or_else(no_counts)?;
                s.all_to_all_v(&b.send, sc, &mut b.recv, rc)?
            }
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
        // Its counts go with it (`Runner::Emulated`); the call is what it is counted as.
        Coll::AllToAllV => Call::new(coll, None, send, 0, false),
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
pub(crate) struct Gpu {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) name: String,
}

impl Gpu {
    /// Opens GPU (local rank mod GPU count), like one process per GPU under torchrun.
    pub(crate) fn open(comm: &Communicator) -> Result<Self, String> {
        let info = comm.info();
        let me = &info.hosts[comm.rank()];
        let local_index = info.hosts[..comm.rank()]
            .iter()
            .filter(|h| *h == me)
            .count();
        let count = dspark::internals::gpu::probe::probe_cuda()
            .map_err(|e| format!("--mem device: {e}"))?
            .devices
            .len();
        if count == 0 {
            return Err("--mem device: the CUDA driver reports no GPU".into());
        }
        let ordinal = local_index % count;
        let ctx = dspark::internals::gpu::device::open_context(ordinal)
            .map_err(|e| format!("--mem device: {e}"))?;
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

/// all_to_all_v's counts: sent to each rank, received from each rank.
type Counts = (Vec<usize>, Vec<usize>);

/// One size's buffers wherever `--mem` puts them, and how to run the call on them (with
/// all_to_all_v's counts where it is the collective).
pub(crate) enum Runner<T: BenchElem> {
    Host(Bufs<T>),
    Emulated(Option<Call>, EmulatedDevice, Option<Counts>),
    Device {
        stream: Arc<CudaStream>,
        send: Option<CudaSlice<T>>,
        recv: Option<CudaSlice<T>>,
        counts: Option<Counts>,
    },
}

/// Maps a CUDA driver error to the bench's message, prefixed with what was being done.
fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

impl<T: BenchElem> Runner<T> {
    pub(crate) fn new(
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
                Ok(Runner::Emulated(call, dev, b.counts))
            }
            // A size whose buffers are empty (all_gather of 8 B on 4 ranks): CUDA allocates no
            // empty buffer, and the library skips an empty call on either memory without
            // touching memory or a peer (as NCCL does a count of 0), so it runs on host.
            (_, Some(_)) if b.recv.is_empty() && b.send.is_empty() => Ok(Runner::Host(b)),
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
                    counts: b.counts,
                })
            }
            (_, None) => Err("device memory requested but no GPU was opened".into()),
        }
    }

    pub(crate) fn run(&mut self, args: &Args, comm: &Communicator) -> dspark::Result<()> {
        match self {
            Runner::Host(b) => run_host(args, comm, b),
            Runner::Emulated(call, dev, counts) => match call {
                Some(c) => run_emulated(comm, *c, dev, counts.as_ref()),
                None => Ok(()),
            },
            Runner::Device {
                stream,
                send,
                recv,
                counts,
            } => run_device(args, comm, stream, (send, recv), counts.as_ref()),
        }
    }

    /// The output buffer, in host memory.
    pub(crate) fn output(&mut self) -> Result<Vec<T>, String> {
        match self {
            Runner::Host(b) => Ok(b.recv.clone()),
            Runner::Emulated(_, dev, _) => Ok(dev
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

/// One call on the emulated device (`--mem emulated`, refused at start without `testing`):
/// an all_to_all_v where it has `counts`.
#[cfg(feature = "testing")]
fn run_emulated(
    comm: &Communicator,
    call: Call,
    dev: &mut EmulatedDevice,
    counts: Option<&Counts>,
) -> dspark::Result<()> {
    match counts {
        Some((sc, rc)) => comm.run_staged_all_to_all_v(call.dtype, sc, rc, dev),
        None => comm.run_staged(call, dev),
    }
}

#[cfg(not(feature = "testing"))]
fn run_emulated(
    _: &Communicator,
    _: Call,
    _: &mut EmulatedDevice,
    _: Option<&Counts>,
) -> dspark::Result<()> {
    Err(dspark::Error::unavailable(
        "dspark-bench --mem emulated",
        "this dspark-bench was built without the `testing` feature",
    ))
}

/// The error of a device call whose buffer was never allocated (an empty side).
fn missing() -> dspark::Error {
    dspark::Error::invalid(None, "dspark-bench", "a device buffer is missing")
}

/// One call of the collective on GPU memory, ordered on the rank's stream.
fn run_device<T: BenchElem>(
    args: &Args,
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    (send, recv): (&mut Option<CudaSlice<T>>, &mut Option<CudaSlice<T>>),
    counts: Option<&Counts>,
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
        Coll::AllToAllV => {
            let (sc, rc) = counts.ok_or_else(no_counts)?;
            comm.all_to_all_v_device(
                send.as_ref().ok_or_else(missing)?,
                sc,
                recv.as_mut().ok_or_else(missing)?,
                rc,
                stream,
            )
        }
        Coll::SendRecv if r.is_multiple_of(2) && r + 1 < n => {
            comm.send_device(send.as_ref().ok_or_else(missing)?, r + 1, stream)
        }
        Coll::SendRecv if r % 2 == 1 => {
            comm.recv_device(recv.as_mut().ok_or_else(missing)?, r - 1, stream)
        }
        Coll::SendRecv => Ok(()),
    }
}
