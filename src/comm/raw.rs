//! Host buffers as raw pointers, for operations that run on another thread than the one that
//! issued them (the progress thread), and for the C ABI and the Python binding; device
//! buffers as raw addresses for the Python binding's CUDA tensors
//! ([`Communicator::start_raw_device`]). This is the
//! one place in `comm/` that turns pointers back into slices; the safe APIs built on it
//! ([`Communicator::scope`](crate::Communicator::scope)) guarantee its contract by their
//! borrows.

#![allow(unsafe_code)]

use std::ptr;
use std::time::Duration;

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::work::{Task, Work};
use super::{Api, Communicator, Target};
use crate::engine::{Call, Engine};
use crate::error::{Error, Result};
use crate::gpu::device::driver_err;
use crate::gpu::order::copy_dtod_async;
use crate::plan::Collective;
use crate::types::{DataType, ReduceOp};

/// How a call's buffers are prepared when it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Prepare {
    /// Run with `src` and `dst` as given (a copy of `src` is taken first when they overlap).
    AsGiven,
    /// Copy `src` over `dst` first (unless they are the same buffer), then run in place on
    /// `dst`: out-of-place all_reduce, broadcast at its root, reduce at its root.
    CopyIntoDst,
    /// Run in place on a temporary copy of `src`; `dst` is not touched: reduce away from its
    /// root, where the out-of-place receive buffer means nothing.
    InPlaceOnCopy,
}

/// One call's host buffers.
#[derive(Debug)]
pub(crate) struct RawBuffers {
    call: Call,
    src: *const u8,
    src_len: usize,
    dst: *mut u8,
    dst_len: usize,
    prepare: Prepare,
}

// SAFETY: a `RawBuffers` is only run through `RawBuffers::run`, whose caller guarantees that
// both buffers stay valid and are not used by anybody else until the operation completes;
// the driver role makes exactly one thread run it. Moving the pointers to that thread is
// therefore no different from moving the borrows they came from.
unsafe impl Send for RawBuffers {}

impl RawBuffers {
    /// The buffers of `call`: `src` of `src_len` bytes (read), `dst` of `dst_len` bytes (read
    /// and written). Either may be null when its length is 0.
    pub(crate) fn new(
        call: Call,
        (src, src_len): (*const u8, usize),
        (dst, dst_len): (*mut u8, usize),
        prepare: Prepare,
    ) -> Self {
        RawBuffers {
            call,
            src,
            src_len,
            dst,
            dst_len,
            prepare,
        }
    }

    /// The buffers of a call on borrowed slices (the borrow checker keeps them apart).
    pub(crate) fn from_slices(call: Call, src: &[u8], dst: &mut [u8]) -> Self {
        Self::new(
            call,
            (src.as_ptr(), src.len()),
            (dst.as_mut_ptr(), dst.len()),
            Prepare::AsGiven,
        )
    }

    pub(crate) fn call(&self) -> &Call {
        &self.call
    }

    /// The call, its buffers as `(address, bytes)`, and how they are prepared (for the
    /// device form, [`Communicator::start_raw_device`], which prepares them on the GPU).
    pub(crate) fn parts(&self) -> (Call, (u64, usize), (u64, usize), Prepare) {
        (
            self.call,
            (self.src as u64, self.src_len),
            (self.dst as u64, self.dst_len),
            self.prepare,
        )
    }

    /// Whether the two buffers overlap (an in-place all_gather / reduce_scatter /
    /// all_to_all in NCCL's convention).
    pub(crate) fn overlapping(&self) -> bool {
        self.overlap()
    }

    fn overlap(&self) -> bool {
        overlap((self.src, self.src_len), (self.dst, self.dst_len))
    }

    /// Runs the call on `eng`.
    ///
    /// # Safety
    /// Until this returns, `src` must be valid for reads of `src_len` bytes and `dst` valid
    /// for reads and writes of `dst_len` bytes (each may be null when its length is 0), and
    /// no other thread may write `src` or access `dst`. The two may overlap.
    pub(crate) unsafe fn run(self, eng: &mut Engine) -> Result<()> {
        // A failed or aborted communicator fails the call before its buffers are touched
        // (the out-of-place copy into `dst` below overwrote the caller's receive buffer).
        eng.ready()?;
        let src: &[u8] = if self.src_len == 0 {
            &[]
        } else {
            // SAFETY: valid for reads of src_len bytes and not written meanwhile (contract).
            unsafe { std::slice::from_raw_parts(self.src, self.src_len) }
        };
        match self.prepare {
            Prepare::InPlaceOnCopy => {
                let mut tmp = copy_of(eng, &self.call, self.call.coll.name(), src)?;
                eng.run(&self.call, &[], &mut tmp)
            }
            Prepare::CopyIntoDst => {
                let n = self.src_len.min(self.dst_len);
                if n > 0 && !ptr::eq(self.src, self.dst) {
                    // SAFETY: both valid for n bytes (contract); `copy` allows overlap.
                    unsafe { ptr::copy(self.src, self.dst, n) };
                }
                // SAFETY: valid for reads and writes of dst_len bytes, used by nobody else
                // (contract); `src` is not used past this point, so no shared view aliases it.
                let dst = unsafe { dst_slice(self.dst, self.dst_len) };
                eng.run(&self.call, &[], dst)
            }
            Prepare::AsGiven if self.overlap() => {
                // In-place all_gather / reduce_scatter / all_to_all (NCCL's convention: the
                // send buffer is a part of the receive buffer): read a copy.
                let tmp = copy_of(eng, &self.call, self.call.coll.name(), src)?;
                // SAFETY: as above; `src` is no longer used.
                let dst = unsafe { dst_slice(self.dst, self.dst_len) };
                eng.run(&self.call, &tmp, dst)
            }
            Prepare::AsGiven => {
                // SAFETY: as above; the buffers do not overlap, so the shared `src` and the
                // exclusive `dst` do not alias.
                let dst = unsafe { dst_slice(self.dst, self.dst_len) };
                eng.run(&self.call, src, dst)
            }
        }
    }
}

/// A copy of `src` for `call` to read from (an in-place call), or, where the memory cannot
/// be had, the call failed on every rank (`Unavailable`) instead of the process aborted.
fn copy_of(eng: &mut Engine, call: &Call, name: &str, src: &[u8]) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    match v.try_reserve_exact(src.len()) {
        Ok(()) => {
            v.extend_from_slice(src);
            Ok(v)
        }
        Err(e) => Err(eng.fail_before_start(
            call,
            Error::unavailable(
                format!("{name}: memory"),
                format!(
                    "a {} copy of the send buffer, which an in-place call reads from: {e}",
                    crate::types::human_bytes(src.len() as u64, false)
                ),
            ),
        )),
    }
}

/// Whether two byte ranges share a byte (an in-place call in NCCL's convention).
fn overlap((src, src_len): (*const u8, usize), (dst, dst_len): (*mut u8, usize)) -> bool {
    let (s, d) = (src as usize, dst as usize);
    src_len > 0 && dst_len > 0 && s < d + dst_len && d < s + src_len
}

/// # Safety
/// `p` valid for reads and writes of `len` bytes (or `len == 0`), accessed by nobody else
/// for the lifetime chosen.
unsafe fn dst_slice<'a>(p: *mut u8, len: usize) -> &'a mut [u8] {
    if len == 0 {
        &mut []
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(p, len) }
    }
}

/// A collective of the raw-pointer API ([`Communicator::start_raw`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawOp {
    /// [`Communicator::all_reduce`]; out of place unless `send == recv`.
    AllReduce(ReduceOp),
    /// [`Communicator::all_gather`]; `count` is the send count.
    AllGather,
    /// [`Communicator::reduce_scatter`]; `count` is the receive count.
    ReduceScatter(ReduceOp),
    /// [`Communicator::broadcast`] from `send` at the root into `recv` everywhere.
    Broadcast {
        /// The root.
        root: usize,
    },
    /// [`Communicator::reduce`] of `send` into the root's `recv` (`recv` is only written at
    /// the root).
    Reduce {
        /// The operator.
        op: ReduceOp,
        /// The root.
        root: usize,
    },
    /// [`Communicator::all_to_all`]; `count` is the count per rank.
    AllToAll,
    /// [`Communicator::send`] of `send`.
    Send {
        /// The receiving rank.
        peer: usize,
    },
    /// [`Communicator::recv`] into `recv`.
    Recv {
        /// The sending rank.
        peer: usize,
    },
    /// [`Communicator::send_recv`]: `count` elements of `send` to `to` and `recv_count`
    /// into `recv` from `from`, progressing together (host buffers only).
    SendRecv {
        /// The receiving rank of `send`.
        to: usize,
        /// The sending rank of `recv`.
        from: usize,
        /// The elements received into `recv`.
        recv_count: usize,
    },
    /// [`Communicator::barrier`] (no buffers).
    Barrier,
}

/// One call on raw host buffers, with NCCL's conventions: separate send and receive
/// buffers, in place when they are equal (for all_gather in place means `send` is block
/// `rank` of `recv`; for reduce_scatter, `recv` is block `rank` of `send`).
#[derive(Clone, Copy, Debug)]
pub struct RawCall {
    /// The collective.
    pub op: RawOp,
    /// The element type of both buffers.
    pub dtype: DataType,
    /// The send buffer (may be null where the collective reads none or `count` is 0).
    pub send: *const u8,
    /// The receive buffer (may be null where the collective writes none or `count` is 0).
    pub recv: *mut u8,
    /// Elements, as [`RawOp`] says for each collective.
    pub count: usize,
    /// The call's own deadline, overriding the communicator's.
    pub timeout: Option<Duration>,
}

impl Communicator {
    /// Queues `bufs`; it runs on whichever thread drives the queue.
    ///
    /// # Safety
    /// [`RawBuffers::run`]'s contract, until the returned [`Work`] completes.
    pub(crate) unsafe fn submit_raw(
        &self,
        bufs: RawBuffers,
        timeout: Option<Duration>,
        what: &'static str,
    ) -> Work {
        // SAFETY: the caller's contract covers the run, which happens before completion.
        let task: Task = Box::new(move |eng| unsafe { bufs.run(eng) });
        self.shared.submit(task, timeout, what)
    }

    /// Checks `c` and turns it into the call and buffers the engine runs.
    pub(crate) fn raw_buffers(&self, c: &RawCall, api: Api) -> Result<RawBuffers> {
        let n = self.world_size();
        let me = self.rank();
        let esz = c.dtype.size();
        let name = match c.op {
            RawOp::AllReduce(_) => Collective::AllReduce,
            RawOp::AllGather => Collective::AllGather,
            RawOp::ReduceScatter(_) => Collective::ReduceScatter,
            RawOp::Broadcast { .. } => Collective::Broadcast,
            RawOp::Reduce { .. } => Collective::Reduce,
            RawOp::AllToAll => Collective::AllToAll,
            RawOp::Send { .. } | RawOp::Recv { .. } | RawOp::SendRecv { .. } => {
                Collective::SendRecv
            }
            RawOp::Barrier => Collective::Barrier,
        };
        let bad = |what: String| Error::invalid(Some(me), name.name(), what);
        let bytes = |elems: usize| {
            elems
                .checked_mul(esz)
                .filter(|&b| b <= isize::MAX as usize)
                .ok_or_else(|| bad(format!("{elems} elements of {} overflow", c.dtype)))
        };
        let times_world = |elems: usize| {
            elems
                .checked_mul(n)
                .ok_or_else(|| bad(format!("{elems} elements × world {n} overflows")))
        };
        let need = |p: *const u8, len: usize, which: &str| -> Result<(*const u8, usize)> {
            if len > 0 && p.is_null() {
                return Err(bad(format!("{which} is NULL with {len} bytes to move")));
            }
            Ok((p, len))
        };
        let (send, recv) = (c.send, c.recv);
        let none = (ptr::null::<u8>(), 0usize);
        let (call, src, dst, prepare) = match c.op {
            RawOp::AllReduce(op) => {
                let call = self.shape(api, name, Some(op), c.count, c.count, Target::None)?;
                let b = bytes(c.count)?;
                (
                    call,
                    need(send, b, "sendbuf")?,
                    need(recv, b, "recvbuf")?,
                    Prepare::CopyIntoDst,
                )
            }
            RawOp::AllGather => {
                let total = times_world(c.count)?;
                let call = self.shape(api, name, None, c.count, total, Target::None)?;
                let (s, r) = (bytes(c.count)?, bytes(total)?);
                (
                    call,
                    need(send, s, "sendbuf")?,
                    need(recv, r, "recvbuf")?,
                    Prepare::AsGiven,
                )
            }
            RawOp::ReduceScatter(op) => {
                let total = times_world(c.count)?;
                let call = self.shape(api, name, Some(op), total, c.count, Target::None)?;
                let (s, r) = (bytes(total)?, bytes(c.count)?);
                (
                    call,
                    need(send, s, "sendbuf")?,
                    need(recv, r, "recvbuf")?,
                    Prepare::AsGiven,
                )
            }
            RawOp::AllToAll => {
                let total = times_world(c.count)?;
                let call = self.shape(api, name, None, total, total, Target::None)?;
                let b = bytes(total)?;
                (
                    call,
                    need(send, b, "sendbuf")?,
                    need(recv, b, "recvbuf")?,
                    Prepare::AsGiven,
                )
            }
            RawOp::Broadcast { root } => {
                let t = Target::Root(root);
                let call = self.shape(api, name, None, c.count, c.count, t)?;
                let b = bytes(c.count)?;
                let r = need(recv, b, "recvbuf")?;
                if root == me {
                    (call, need(send, b, "sendbuf")?, r, Prepare::CopyIntoDst)
                } else {
                    (call, none, r, Prepare::AsGiven)
                }
            }
            RawOp::Reduce { op, root } => {
                let t = Target::Root(root);
                let call = self.shape(api, name, Some(op), c.count, c.count, t)?;
                let b = bytes(c.count)?;
                let s = need(send, b, "sendbuf")?;
                if root == me {
                    (call, s, need(recv, b, "recvbuf")?, Prepare::CopyIntoDst)
                } else if ptr::eq(send, recv) {
                    (call, none, need(recv, b, "recvbuf")?, Prepare::AsGiven)
                } else {
                    (call, s, none, Prepare::InPlaceOnCopy)
                }
            }
            RawOp::Send { peer } => {
                let t = Target::SendTo(peer);
                let call = self.shape(api, name, None, c.count, 0, t)?;
                (
                    call,
                    need(send, bytes(c.count)?, "buf")?,
                    none,
                    Prepare::AsGiven,
                )
            }
            RawOp::Recv { peer } => {
                let t = Target::RecvFrom(peer);
                let call = self.shape(api, name, None, 0, c.count, t)?;
                (
                    call,
                    none,
                    need(recv, bytes(c.count)?, "buf")?,
                    Prepare::AsGiven,
                )
            }
            RawOp::SendRecv {
                to,
                from,
                recv_count,
            } => {
                if api == Api::Device {
                    return Err(Error::Unavailable {
                        rank: Some(me),
                        what: "send_recv of device buffers".into(),
                        reason: "not implemented: use a send and a recv".into(),
                    });
                }
                let call = self.shape(api, name, None, c.count, 0, Target::SendTo(to))?;
                self.shape(api, name, None, 0, recv_count, Target::RecvFrom(from))?;
                let call = Call {
                    recv_from: Some(from),
                    ..call
                };
                (
                    call,
                    need(send, bytes(c.count)?, "sendbuf")?,
                    need(recv, bytes(recv_count)?, "recvbuf")?,
                    Prepare::AsGiven,
                )
            }
            RawOp::Barrier => (
                Call::new(name, None, 0, 0, false),
                none,
                none,
                Prepare::AsGiven,
            ),
        };
        let call = Call {
            dtype: c.dtype,
            ..call
        };
        Ok(RawBuffers::new(
            call,
            src,
            (dst.0.cast_mut(), dst.1),
            prepare,
        ))
    }

    /// Starts `c` without blocking: it runs on the progress thread after every operation
    /// issued before it. This is the entry point of the C ABI and the Python binding; Rust
    /// code uses [`Communicator::scope`], which is safe.
    ///
    /// # Safety
    /// Until the returned [`Work`] has completed (waited for, or tested complete — it runs to
    /// completion even if the `Work` is dropped):
    /// * `c.send` must be valid for reads, and `c.recv` for reads and writes, of as many
    ///   elements of `c.dtype` as the collective uses ([`RawOp`]);
    /// * nothing else may write `c.send` or access `c.recv`.
    ///
    /// # Errors
    /// Argument errors ([`Error::InvalidArgument`]) at once; the operation's errors from the
    /// [`Work`].
    pub unsafe fn start_raw(&self, c: &RawCall) -> Result<Work> {
        let bufs = self.raw_buffers(c, Api::Host)?;
        let what = bufs.call().coll.name();
        if let Some(w) = self.empty_work(bufs.call(), c.timeout) {
            return Ok(w);
        }
        // SAFETY: the caller's contract is `submit_raw`'s.
        Ok(unsafe { self.submit_raw(bufs, c.timeout, what) })
    }

    /// Runs `c` and returns when it is complete (on the caller's thread, after every
    /// operation issued before it).
    ///
    /// # Safety
    /// As [`Communicator::start_raw`], until this returns.
    ///
    /// # Errors
    /// As the blocking collectives.
    pub unsafe fn run_raw(&self, c: &RawCall) -> Result<()> {
        let bufs = self.raw_buffers(c, Api::Host)?;
        if let Some(r) = self.empty_call(bufs.call(), c.timeout) {
            return r;
        }
        self.shared.exclusive(c.timeout, |eng| {
            // SAFETY: the caller's contract, for as long as this call runs.
            unsafe { bufs.run(eng) }
        })
    }

    /// [`Communicator::all_to_all_v`] on raw host buffers, started without blocking: it runs
    /// on the progress thread after every operation issued before it (the Python binding's
    /// entry point). `send` holds the blocks for ranks 0, 1, ... of `send_counts[j]` elements
    /// of `dtype` each, `recv` receives rank i's block of `recv_counts[i]` elements at the sum
    /// of the counts before it. The counts are copied.
    ///
    /// # Safety
    /// Until the returned [`Work`] has completed (it runs to completion even if the `Work` is
    /// dropped): `send` must be valid for reads of the sum of `send_counts` elements and
    /// `recv` for reads and writes of the sum of `recv_counts` (either may be null where its
    /// sum is 0); nothing else may write `send` or access `recv`. They may overlap (a copy of
    /// `send` is then sent).
    ///
    /// # Errors
    /// Argument errors at once; the operation's errors from the [`Work`].
    pub unsafe fn start_raw_all_to_all_v(
        &self,
        dtype: DataType,
        (send, send_counts): (*const u8, &[usize]),
        (recv, recv_counts): (*mut u8, &[usize]),
        timeout: Option<Duration>,
    ) -> Result<Work> {
        let bufs = self.v_buffers(dtype, (send, send_counts), (recv, recv_counts))?;
        // SAFETY: the caller's contract covers the run, which happens before completion.
        let task: Task = Box::new(move |eng| unsafe { bufs.run(eng) });
        Ok(self
            .shared
            .submit(task, timeout, Collective::AllToAll.name()))
    }

    /// [`Communicator::start_raw_all_to_all_v`], run on the caller's thread (after every
    /// operation issued before it); returns when it is complete.
    ///
    /// # Safety
    /// As [`Communicator::start_raw_all_to_all_v`], until this returns.
    ///
    /// # Errors
    /// As [`Communicator::all_to_all_v`].
    pub unsafe fn run_raw_all_to_all_v(
        &self,
        dtype: DataType,
        (send, send_counts): (*const u8, &[usize]),
        (recv, recv_counts): (*mut u8, &[usize]),
        timeout: Option<Duration>,
    ) -> Result<()> {
        let bufs = self.v_buffers(dtype, (send, send_counts), (recv, recv_counts))?;
        self.shared.exclusive(timeout, |eng| {
            // SAFETY: the caller's contract, for as long as this call runs.
            unsafe { bufs.run(eng) }
        })
    }

    /// Checks an all-to-all-v's counts ([`crate::engine::v_check`]) and its pointers, and
    /// keeps them.
    fn v_buffers(
        &self,
        dtype: DataType,
        (send, send_counts): (*const u8, &[usize]),
        (recv, recv_counts): (*mut u8, &[usize]),
    ) -> Result<VBuffers> {
        let me = self.rank();
        let counts = (send_counts, recv_counts);
        let (sent, received) =
            crate::engine::v_check((me, self.world_size()), dtype, counts, None)?;
        let bad = |what: String| Error::invalid(Some(me), "all_to_all_v", what);
        let bytes = |elems: usize, p: *const u8, which: &str| -> Result<usize> {
            let b = elems
                .checked_mul(dtype.size())
                .filter(|&b| b <= isize::MAX as usize)
                .ok_or_else(|| bad(format!("the {which} counts overflow")))?;
            if b > 0 && p.is_null() {
                return Err(bad(format!(
                    "{which} buffer is NULL with {b} bytes to move"
                )));
            }
            Ok(b)
        };
        Ok(VBuffers {
            dtype,
            src_len: bytes(sent, send, "send")?,
            dst_len: bytes(received, recv.cast_const(), "receive")?,
            src: send,
            dst: recv,
            send_counts: send_counts.to_vec(),
            recv_counts: recv_counts.to_vec(),
        })
    }
}

/// An all-to-all-v's host buffers and counts ([`Communicator::start_raw_all_to_all_v`]).
struct VBuffers {
    dtype: DataType,
    src: *const u8,
    src_len: usize,
    dst: *mut u8,
    dst_len: usize,
    send_counts: Vec<usize>,
    recv_counts: Vec<usize>,
}

// SAFETY: as `RawBuffers`: run only through `VBuffers::run`, whose caller guarantees that both
// buffers stay valid and unused by anybody else until the operation completes, on the one
// thread the driver role picks.
unsafe impl Send for VBuffers {}

impl VBuffers {
    /// Runs the all-to-all-v on `eng`.
    ///
    /// # Safety
    /// Until this returns, `src` must be valid for reads of `src_len` bytes and `dst` for
    /// reads and writes of `dst_len` bytes (each may be null when its length is 0), and no
    /// other thread may write `src` or access `dst`. The two may overlap.
    unsafe fn run(self, eng: &mut Engine) -> Result<()> {
        eng.ready()?;
        let overlap = overlap((self.src, self.src_len), (self.dst, self.dst_len));
        let src: &[u8] = if self.src_len == 0 {
            &[]
        } else {
            // SAFETY: valid for reads of src_len bytes and not written meanwhile (contract).
            unsafe { std::slice::from_raw_parts(self.src, self.src_len) }
        };
        // Overlapping buffers: send from a copy, so that no shared view aliases `dst`.
        let copy = if overlap {
            let count = self
                .send_counts
                .iter()
                .fold(0, |a: usize, &c| a.saturating_add(c));
            let call = Call {
                dtype: self.dtype,
                ..Call::new(Collective::AllToAll, None, count, 0, false)
            };
            Some(copy_of(eng, &call, "all_to_all_v", src)?)
        } else {
            None
        };
        let src = copy.as_deref().unwrap_or(src);
        // SAFETY: valid for reads and writes of dst_len bytes, used by nobody else (contract);
        // where it overlaps `src`, `src` is a copy.
        let dst = unsafe { dst_slice(self.dst, self.dst_len) };
        eng.run_all_to_all_v(self.dtype, &self.send_counts, &self.recv_counts, src, dst)
    }
}

impl Communicator {
    /// [`Communicator::start_raw`] on device memory, ordered on `stream` as the
    /// [`Communicator::enqueue`] forms are: the entry point of the Python binding's CUDA
    /// tensors (torch's current stream, wrapped with cudarc's `wrap_borrowed_stream`).
    /// NCCL's buffer conventions, as [`RawCall`] says; an out-of-place call's copy, and the
    /// temporary copy an in-place all_gather / reduce_scatter / all_to_all or a reduce away
    /// from its root runs on, are made on `stream` ahead of the call.
    ///
    /// # Safety
    /// `c.send` and `c.recv` are device addresses of `stream`'s GPU, valid for as many
    /// elements of `c.dtype` as the collective uses ([`crate::RawOp`]). Until the collective
    /// is complete on `stream` (the returned [`Work`] completes no earlier): nothing but work
    /// queued on `stream` after this call may write `c.send` or access `c.recv`. The memory
    /// must not be returned to CUDA (`cuMemFree`, or `cuMemFreeAsync` even on `stream`: the
    /// library issues copies on it from its progress thread while the call runs, and CUDA
    /// makes work issued on freed memory undefined) before the `Work` completed with
    /// [`Work::buffers_may_be_in_use`] false; a caching allocator may hand it out again in
    /// stream order on `stream` (torch's does, for a tensor whose use was recorded there:
    /// the new owner's work queued on `stream` waits for the call).
    ///
    /// # Errors
    /// Argument errors at once; the operation's errors from the [`Work`].
    pub unsafe fn start_raw_device(&self, c: &RawCall, stream: &Arc<CudaStream>) -> Result<Work> {
        // SAFETY: the caller's contract.
        unsafe { self.start_raw_device_with(c, stream, true) }
    }

    /// [`Communicator::start_raw_device`], with `stream` made to wait for the call
    /// (`ordered`) or not.
    ///
    /// # Safety
    /// As [`Communicator::start_raw_device`]; unordered, until the returned [`Work`]
    /// completed: no work on any stream may write `c.send` or access `c.recv`, and the
    /// memory may not be freed.
    unsafe fn start_raw_device_with(
        &self,
        c: &RawCall,
        stream: &Arc<CudaStream>,
        ordered: bool,
    ) -> Result<Work> {
        let bufs = self.raw_buffers(c, Api::Device)?;
        let overlap = bufs.overlapping();
        let (call, src, dst, prepare) = bufs.parts();
        if let Some(w) = self.empty_work(&call, c.timeout) {
            return Ok(w);
        }
        let some = |(p, n): (u64, usize)| (n > 0).then_some((p, n));
        let copy_of = |(p, n): (u64, usize)| -> Result<(CudaSlice<u8>, u64)> {
            let tmp = stream
                .alloc_zeros::<u8>(n)
                .map_err(driver_err("cuMemAllocAsync"))?;
            let (t, _g) = tmp.device_ptr(stream);
            // SAFETY: `tmp` is a fresh allocation of `n` bytes on `stream`'s context and `p`
            // is valid for `n` bytes (the caller's contract); they cannot overlap.
            unsafe { copy_dtod_async(stream, t, p, n)? };
            drop(_g);
            Ok((tmp, t))
        };
        // Preparations on the GPU, queued on the caller's stream ahead of the call.
        let prepared = match prepare {
            Prepare::CopyIntoDst => {
                let n = src.1.min(dst.1);
                if n > 0 && src.0 != dst.0 {
                    // SAFETY: both valid for `n` bytes (the caller's contract); out of place,
                    // so distinct buffers.
                    unsafe { copy_dtod_async(stream, dst.0, src.0, n) }
                        .map(|()| (None, some(dst), None))
                } else {
                    Ok((None, some(dst), None))
                }
            }
            Prepare::InPlaceOnCopy => {
                copy_of(src).map(|(tmp, t)| (None, Some((t, src.1)), Some(tmp)))
            }
            Prepare::AsGiven if overlap => {
                copy_of(src).map(|(tmp, t)| (Some((t, src.1)), some(dst), Some(tmp)))
            }
            Prepare::AsGiven => Ok((some(src), some(dst), None)),
        };
        match prepared {
            Ok((s, d, keep)) => {
                self.device_start(call, stream, s, d, Vec::new(), keep, c.timeout, ordered)
            }
            Err(e) => Ok(self.fail_queued(call, e, c.timeout)),
        }
    }

    /// [`Communicator::start_raw_device`] on GPU `device`'s primary context and the CUDA
    /// stream whose handle (`CUstream`) is `stream` — as torch gives them
    /// (`tensor.device.index`, `torch.cuda.current_stream().cuda_stream`); 0 is the legacy
    /// default stream.
    ///
    /// # Safety
    /// As [`Communicator::start_raw_device`]; `stream` is 0 or a live CUDA stream of that
    /// device's primary context, which stays alive until the call completed.
    ///
    /// # Errors
    /// [`Error::Unavailable`] without a CUDA driver or that device; otherwise as
    /// [`Communicator::start_raw_device`].
    pub unsafe fn start_raw_device_on(
        &self,
        c: &RawCall,
        device: usize,
        stream: usize,
    ) -> Result<Work> {
        // SAFETY: the caller's contract.
        unsafe { self.start_raw_device_on_stream(c, device, stream, true) }
    }

    /// [`Communicator::start_raw_device_on`] without making `stream` wait for the call: it
    /// starts after the work queued on `stream` before it, and `stream` goes on at once.
    /// torch's asynchronous point-to-point semantics (NCCL's stream waits only in
    /// `Work.wait()`): an `isend` and an `irecv` issued back to back on one stream, on
    /// communicators of their own, must not wait for each other, or two ranks exchanging
    /// more than the transport buffers each wait for the other's send to finish first.
    ///
    /// # Safety
    /// As [`Communicator::start_raw_device_on`], and until the returned [`Work`]
    /// completed (the caller waits for it on the host before using the buffers): no work on
    /// any stream may write `c.send` or access `c.recv`, and the memory may not be freed.
    ///
    /// # Errors
    /// As [`Communicator::start_raw_device_on`].
    pub unsafe fn start_raw_device_unordered_on(
        &self,
        c: &RawCall,
        device: usize,
        stream: usize,
    ) -> Result<Work> {
        // SAFETY: the caller's contract.
        unsafe { self.start_raw_device_on_stream(c, device, stream, false) }
    }

    /// [`Communicator::start_raw_device_with`] on the CUDA stream whose handle is `stream`,
    /// of GPU `device`'s primary context (the process's wrapper of it), borrowed: the
    /// wrapper never destroys it.
    ///
    /// # Safety
    /// As [`Communicator::start_raw_device_on`] (ordered) or
    /// [`Communicator::start_raw_device_unordered_on`].
    unsafe fn start_raw_device_on_stream(
        &self,
        c: &RawCall,
        device: usize,
        stream: usize,
        ordered: bool,
    ) -> Result<Work> {
        let ctx = crate::gpu::device::open_context(device)?;
        // SAFETY: the caller's contract: a live stream of this context (or 0), alive until
        // the call completed.
        let s = unsafe { ctx.wrap_borrowed_stream(stream as cudarc::driver::sys::CUstream) };
        // SAFETY: the caller's contract.
        unsafe { self.start_raw_device_with(c, &s, ordered) }
    }
}
