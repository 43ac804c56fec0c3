//! The C ABI: `include/dspark.h`, generated from this file by cbindgen (`cbindgen.toml`;
//! regenerate with `DSPARK_BLESS=1 cargo test --test capi header`).
//!
//! Every function is a thin shell over the Rust API ([`Communicator`],
//! [`Communicator::start_raw`], [`Work`]): it checks its pointers and integer arguments, runs
//! the call inside [`catch_unwind`] (no panic crosses the boundary: one becomes
//! `DSPARK_ERR_INTERNAL`), turns the [`Error`] into a [`dspark_result_t`] and leaves the
//! error's text for `dspark_last_error`.
//!
//! Element types and operators travel as plain `uint32_t` ([`dspark_dtype_t`],
//! [`dspark_op_t`]) and are checked here: a Rust enum receiving an out-of-range value from C
//! would be undefined behaviour, an integer is not.
//!
//! Error codes: each [`Error`] variant has its own code, except [`Error::Transport`], which
//! is `DSPARK_ERR_IO` (a failed verbs call or completion, a peer breaking the protocol: a
//! communication failure like an I/O error) unless its text says it is an internal error
//! (`DSPARK_ERR_INTERNAL`), and [`Error::Cuda`], which is `DSPARK_ERR_UNAVAILABLE` (the CUDA
//! driver, runtime or NVRTC could not provide what was asked on this machine; the
//! host-memory calls of this ABI never touch CUDA).
//!
//! [`Communicator`]: crate::Communicator
//! [`Communicator::start_raw`]: crate::Communicator::start_raw
//! [`Work`]: crate::comm::Work
//! [`catch_unwind`]: std::panic::catch_unwind
//! [`Error`]: crate::Error
//! [`Error::Transport`]: crate::Error::Transport
//! [`Error::Cuda`]: crate::Error::Cuda
//! [`dspark_result_t`]: crate::internals::capi::dspark_result_t
//! [`dspark_dtype_t`]: crate::internals::capi::dspark_dtype_t
//! [`dspark_op_t`]: crate::internals::capi::dspark_op_t

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int};
use std::ptr;

use crate::comm::{RawCall, RawOp, Work};
use crate::error::Error;
use crate::types::{DataType, ReduceOp};
use crate::Communicator;

mod boundary;
mod work;
use boundary::{copy_out, guard, invalid, log_to_stderr};
pub use work::*;

/// A communicator: one rank's membership of a group of ranks.
///
/// Thread safety: a communicator may be used by several threads at once. Its operations run
/// one at a time, in the order they were issued (across all threads), so ranks must issue
/// them in the same order. `dspark_comm_abort` may be called from any thread at any time.
/// `dspark_comm_destroy` must not race any other call on the same communicator.
#[derive(Debug)]
pub struct dspark_comm_t {
    comm: Communicator,
}

/// An operation in flight, returned by the non-blocking form of a collective.
///
/// A work handle may be passed between threads, but not used by two threads at once.
#[derive(Debug)]
pub struct dspark_work_t {
    state: WorkState,
}

#[derive(Debug)]
enum WorkState {
    /// Not known to be complete.
    Pending(Work),
    /// Complete, with its result (kept so that wait and test can be asked again).
    Done(Result<(), Error>),
}

/// The result of every call: `DSPARK_SUCCESS` (0) or an error code; the message of the
/// error is `dspark_last_error()`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum dspark_result_t {
    /// The call succeeded.
    DSPARK_SUCCESS = 0,
    /// A blocking operation did not finish by its deadline (`DSPARK_TIMEOUT`, default 300 s):
    /// a silent, stopped or overloaded peer. The communicator is unusable. Also what
    /// `dspark_work_wait_timeout` returns when its own wait runs out while the operation is
    /// still in flight: then nothing is broken and the operation goes on (`dspark_work_test`
    /// says which of the two: `*done` 0 for a wait that ran out, 1 for a failed operation).
    DSPARK_ERR_TIMEOUT = 1,
    /// A peer closed its connection or died. The communicator is unusable.
    DSPARK_ERR_PEER_LOST = 2,
    /// Ranks disagree about a call (collective, count, type, operator or root) or about the
    /// job. The communicator is unusable.
    DSPARK_ERR_MISMATCH = 3,
    /// An argument is invalid: a NULL pointer, an unknown type or operator, a root or peer
    /// out of range (or a peer that is this rank: no send or receive to itself), counts that
    /// overflow. Local: the communicator stays usable.
    DSPARK_ERR_INVALID_ARGUMENT = 4,
    /// Bad configuration (an environment variable): the message names it.
    DSPARK_ERR_CONFIG = 5,
    /// An I/O or transport failure (socket, verbs call or completion, protocol violation).
    DSPARK_ERR_IO = 6,
    /// The communicator was aborted, here (`dspark_comm_abort`) or by a failing peer.
    DSPARK_ERR_ABORTED = 7,
    /// Something asked for cannot be had on this machine (verbs, GPUDirect RDMA, CUDA).
    DSPARK_ERR_UNAVAILABLE = 8,
    /// A bug in dspark (a caught panic, an impossible state): please report the message.
    DSPARK_ERR_INTERNAL = 9,
}

/// The element type of a collective's buffers (values of `enum dspark_dtype_t`, passed as
/// `uint32_t`; any other value is refused with `DSPARK_ERR_INVALID_ARGUMENT`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DsparkDtype {
    /// `float` (IEEE 754 binary32).
    DSPARK_F32 = 0,
    /// `double` (IEEE 754 binary64).
    DSPARK_F64 = 1,
    /// IEEE 754 binary16, as `uint16_t` bits (f16 reductions accumulate in f32, round once).
    DSPARK_F16 = 2,
    /// bfloat16, as `uint16_t` bits (accumulated in f32, rounded once).
    DSPARK_BF16 = 3,
    /// `int8_t`.
    DSPARK_I8 = 4,
    /// `uint8_t`.
    DSPARK_U8 = 5,
    /// `int32_t`.
    DSPARK_I32 = 6,
    /// `uint32_t`.
    DSPARK_U32 = 7,
    /// `int64_t`.
    DSPARK_I64 = 8,
    /// `uint64_t`.
    DSPARK_U64 = 9,
}

/// A reduction operator (values of `enum dspark_op_t`, passed as `uint32_t`; any other value
/// is refused with `DSPARK_ERR_INVALID_ARGUMENT`). Integer sums and products wrap.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DsparkOp {
    /// Sum.
    DSPARK_SUM = 0,
    /// Product.
    DSPARK_PROD = 1,
    /// Minimum.
    DSPARK_MIN = 2,
    /// Maximum.
    DSPARK_MAX = 3,
    /// Sum, then one division by the number of ranks (integers truncate toward zero).
    DSPARK_AVG = 4,
}

/// An element type as it crosses the ABI: a value of `enum dspark_dtype_t`.
pub type dspark_dtype_t = u32;
/// A reduction operator as it crosses the ABI: a value of `enum dspark_op_t`.
pub type dspark_op_t = u32;

const DTYPES: [(DsparkDtype, DataType); 10] = [
    (DsparkDtype::DSPARK_F32, DataType::F32),
    (DsparkDtype::DSPARK_F64, DataType::F64),
    (DsparkDtype::DSPARK_F16, DataType::F16),
    (DsparkDtype::DSPARK_BF16, DataType::BF16),
    (DsparkDtype::DSPARK_I8, DataType::I8),
    (DsparkDtype::DSPARK_U8, DataType::U8),
    (DsparkDtype::DSPARK_I32, DataType::I32),
    (DsparkDtype::DSPARK_U32, DataType::U32),
    (DsparkDtype::DSPARK_I64, DataType::I64),
    (DsparkDtype::DSPARK_U64, DataType::U64),
];

const OPS: [(DsparkOp, ReduceOp); 5] = [
    (DsparkOp::DSPARK_SUM, ReduceOp::Sum),
    (DsparkOp::DSPARK_PROD, ReduceOp::Prod),
    (DsparkOp::DSPARK_MIN, ReduceOp::Min),
    (DsparkOp::DSPARK_MAX, ReduceOp::Max),
    (DsparkOp::DSPARK_AVG, ReduceOp::Avg),
];

// The communicator is shared between threads through `*const dspark_comm_t` (any thread may
// call, and abort, while another waits), and a work handle moves between threads.
const _: () = {
    const fn shareable<T: Send + Sync>() {}
    const fn movable<T: Send>() {}
    shareable::<Communicator>();
    movable::<Work>();
};

/// The communicator behind `comm`, or an argument error.
///
/// # Safety
/// `comm` is NULL or a pointer returned by this ABI and not yet destroyed.
unsafe fn comm_ref<'a>(comm: *const dspark_comm_t, func: &str) -> Result<&'a Communicator, Error> {
    // SAFETY: NULL or a live communicator (the caller's contract); shared access is what
    // every call but destroy makes, and destroy must not race them.
    match unsafe { comm.as_ref() } {
        Some(c) => Ok(&c.comm),
        None => Err(invalid(None, func, "comm is NULL")),
    }
}

fn dtype_of(v: dspark_dtype_t, rank: usize, func: &str) -> Result<DataType, Error> {
    DTYPES
        .iter()
        .find(|(c, _)| *c as u32 == v)
        .map(|&(_, d)| d)
        .ok_or_else(|| {
            invalid(
                Some(rank),
                func,
                format!(
                    "dtype {v} is not a dspark_dtype_t (DSPARK_F32 = 0 .. DSPARK_U64 = {})",
                    DTYPES.len() - 1
                ),
            )
        })
}

fn op_of(v: dspark_op_t, rank: usize, func: &str) -> Result<ReduceOp, Error> {
    OPS.iter()
        .find(|(c, _)| *c as u32 == v)
        .map(|&(_, o)| o)
        .ok_or_else(|| {
            invalid(
                Some(rank),
                func,
                format!(
                    "op {v} is not a dspark_op_t (DSPARK_SUM = 0 .. DSPARK_AVG = {})",
                    OPS.len() - 1
                ),
            )
        })
}

fn rank_arg(v: c_int, what: &str, rank: usize, func: &str) -> Result<usize, Error> {
    usize::try_from(v).map_err(|_| invalid(Some(rank), func, format!("{what} {v} is negative")))
}

fn to_c_int(v: usize, what: &str, rank: usize, func: &str) -> Result<c_int, Error> {
    c_int::try_from(v).map_err(|_| invalid(Some(rank), func, format!("{what} {v} exceeds INT_MAX")))
}

/// Writes `v` through `out`, or fails when `out` is NULL.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
unsafe fn put<T>(
    out: *mut T,
    v: T,
    what: &str,
    rank: Option<usize>,
    func: &str,
) -> Result<(), Error> {
    if out.is_null() {
        return Err(invalid(rank, func, format!("{what} is NULL")));
    }
    // SAFETY: non-null and valid for a write (the caller's contract).
    unsafe { out.write(v) };
    Ok(())
}

/// The element type and operator arguments of a collective, still unchecked.
#[derive(Clone, Copy)]
enum Kind {
    AllReduce(dspark_op_t),
    AllGather,
    ReduceScatter(dspark_op_t),
    Broadcast(c_int),
    Reduce(dspark_op_t, c_int),
    AllToAll,
    Send(c_int),
    Recv(c_int),
    /// To, from, and the elements received.
    SendRecv(c_int, c_int, usize),
    Barrier,
}

/// Checks and issues one collective: blocking when `work` is NULL, else non-blocking with
/// the handle in `*work`.
///
/// # Safety
/// `comm` NULL or live; `work` NULL or valid for a write; the buffers as the public
/// functions require.
#[allow(clippy::too_many_arguments)]
unsafe fn issue(
    func: &'static str,
    comm: *const dspark_comm_t,
    kind: Kind,
    dtype: dspark_dtype_t,
    send: *const u8,
    recv: *mut u8,
    count: usize,
    work: *mut *mut dspark_work_t,
) -> dspark_result_t {
    guard(func, || {
        if !work.is_null() {
            // SAFETY: non-null `work` is valid for a write (contract). Set first, so that
            // `*work` is NULL whenever the call fails.
            unsafe { work.write(ptr::null_mut()) };
        }
        // SAFETY: NULL or live (contract).
        let c = unsafe { comm_ref(comm, func) }?;
        let me = c.rank();
        let dtype = match kind {
            Kind::Barrier => DataType::U8,
            _ => dtype_of(dtype, me, func)?,
        };
        let op = match kind {
            Kind::AllReduce(op) => RawOp::AllReduce(op_of(op, me, func)?),
            Kind::AllGather => RawOp::AllGather,
            Kind::ReduceScatter(op) => RawOp::ReduceScatter(op_of(op, me, func)?),
            Kind::Broadcast(root) => RawOp::Broadcast {
                root: rank_arg(root, "root", me, func)?,
            },
            Kind::Reduce(op, root) => RawOp::Reduce {
                op: op_of(op, me, func)?,
                root: rank_arg(root, "root", me, func)?,
            },
            Kind::AllToAll => RawOp::AllToAll,
            Kind::Send(peer) => RawOp::Send {
                peer: rank_arg(peer, "peer", me, func)?,
            },
            Kind::Recv(peer) => RawOp::Recv {
                peer: rank_arg(peer, "peer", me, func)?,
            },
            Kind::SendRecv(to, from, recv_count) => RawOp::SendRecv {
                to: rank_arg(to, "dest", me, func)?,
                from: rank_arg(from, "source", me, func)?,
                recv_count,
            },
            Kind::Barrier => RawOp::Barrier,
        };
        let call = RawCall {
            op,
            dtype,
            send,
            recv,
            count,
            timeout: None,
        };
        // SAFETY: `work` was checked as `run_or_start` needs; the buffers are valid for the
        // call until it returns, and stay valid and untouched by the caller until a started
        // operation completes (the caller's contract, documented on each public function
        // and on `dspark_work_free`).
        unsafe { run_or_start(work, || c.run_raw(&call), || c.start_raw(&call)) }
    })
}

/// Runs an operation on this thread when `work` is NULL (`run`), else starts it (`start`)
/// and hands its handle out through `work`.
///
/// # Safety
/// `work` is NULL or valid for a write of a pointer; `run` and `start` are safe to call
/// under the caller's contract for the operation's buffers.
unsafe fn run_or_start(
    work: *mut *mut dspark_work_t,
    run: impl FnOnce() -> Result<(), Error>,
    start: impl FnOnce() -> Result<Work, Error>,
) -> Result<(), Error> {
    if work.is_null() {
        return run();
    }
    let h = Box::new(dspark_work_t {
        state: WorkState::Pending(start()?),
    });
    // SAFETY: non-null and valid for a write (contract).
    unsafe { work.write(Box::into_raw(h)) };
    Ok(())
}

/// The message of the last call on this thread that failed, when it was the last call on
/// this thread; an empty string after a call that succeeded. The string is owned by dspark
/// and valid until the next dspark call on this thread. It names the rank, the peer and the
/// operation where there are ones. Never NULL.
#[no_mangle]
pub extern "C" fn dspark_last_error() -> *const c_char {
    boundary::last_error()
}

/// Joins the job described by the environment: `DSPARK_RANK`, `DSPARK_WORLD_SIZE`,
/// `DSPARK_ROOT_ADDR` (or the launcher's: torchrun, Open MPI, PMI, Slurm), `DSPARK_TIMEOUT`,
/// ... Every rank calls it; it returns once all ranks have joined (or fails by the deadline).
/// On success `*out` is a new communicator, to be freed with `dspark_comm_destroy`; on
/// failure it is NULL.
///
/// # Safety
/// `out` is NULL (refused) or valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn dspark_comm_init_from_env(
    out: *mut *mut dspark_comm_t,
) -> dspark_result_t {
    const F: &str = "dspark_comm_init_from_env";
    log_to_stderr();
    guard(F, || {
        // SAFETY: NULL or valid for a write (contract).
        unsafe { put(out, ptr::null_mut(), "out", None, F) }?;
        let comm = Communicator::from_env()?;
        let h = Box::into_raw(Box::new(dspark_comm_t { comm }));
        // SAFETY: non-null (checked by `put` above) and valid for a write (contract).
        unsafe { out.write(h) };
        Ok(())
    })
}

/// This process's rank in `comm`, in `[0, size)`.
///
/// # Safety
/// `comm` is NULL (refused) or a live communicator; `rank` is NULL (refused) or valid for a
/// write.
#[no_mangle]
pub unsafe extern "C" fn dspark_comm_rank(
    comm: *const dspark_comm_t,
    rank: *mut c_int,
) -> dspark_result_t {
    const F: &str = "dspark_comm_rank";
    guard(F, || {
        // SAFETY: NULL or live (contract).
        let c = unsafe { comm_ref(comm, F) }?;
        let v = to_c_int(c.rank(), "rank", c.rank(), F)?;
        // SAFETY: NULL or valid for a write (contract).
        unsafe { put(rank, v, "rank", Some(c.rank()), F) }
    })
}

/// The number of ranks in `comm`.
///
/// # Safety
/// `comm` is NULL (refused) or a live communicator; `size` is NULL (refused) or valid for a
/// write.
#[no_mangle]
pub unsafe extern "C" fn dspark_comm_size(
    comm: *const dspark_comm_t,
    size: *mut c_int,
) -> dspark_result_t {
    const F: &str = "dspark_comm_size";
    guard(F, || {
        // SAFETY: NULL or live (contract).
        let c = unsafe { comm_ref(comm, F) }?;
        let v = to_c_int(c.world_size(), "size", c.rank(), F)?;
        // SAFETY: NULL or valid for a write (contract).
        unsafe { put(size, v, "size", Some(c.rank()), F) }
    })
}

/// Splits `comm` as `ncclCommSplit` does: the ranks that pass the same `color` (>= 0) form a
/// new communicator, ranked by `key`, then by their rank in `comm`. A rank that passes a
/// negative `color` opts out and gets `*out == NULL` (with `DSPARK_SUCCESS`). Every rank of
/// `comm` must call it (it is a collective on `comm`); `comm` stays usable. Free the new
/// communicator with `dspark_comm_destroy`. `*out` is NULL on every failure.
///
/// # Safety
/// `comm` is NULL (refused) or a live communicator; `out` is NULL (refused) or valid for a
/// write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn dspark_comm_split(
    comm: *mut dspark_comm_t,
    color: c_int,
    key: c_int,
    out: *mut *mut dspark_comm_t,
) -> dspark_result_t {
    const F: &str = "dspark_comm_split";
    guard(F, || {
        // SAFETY: NULL or valid for a write (contract). First: NULL on every failure.
        unsafe { put(out, ptr::null_mut(), "out", None, F) }?;
        // SAFETY: NULL or live (contract).
        let c = unsafe { comm_ref(comm, F) }?;
        if let Some(new) = c.split(Some(color), key)? {
            let h = Box::into_raw(Box::new(dspark_comm_t { comm: new }));
            // SAFETY: non-null (checked by `put` above) and valid for a write (contract).
            unsafe { out.write(h) };
        }
        Ok(())
    })
}

/// `dspark_comm_shrink` flags: shrink beside what runs on `comm`.
pub const DSPARK_SHRINK_DEFAULT: c_int = 0;
/// `dspark_comm_shrink` flags: abort `comm` first (as `dspark_comm_abort`), so that whatever is
/// in flight on it fails at once, as NCCL's `NCCL_SHRINK_ABORT`. The arguments are checked
/// before: a call refused with `DSPARK_ERR_INVALID_ARGUMENT` for a rank out of range or this
/// rank among the excluded leaves `comm` as it was.
pub const DSPARK_SHRINK_ABORT: c_int = 1;

/// Makes a communicator of the ranks of `comm` minus the `count` ranks in `exclude`, as
/// `ncclCommShrink` does: for going on after ranks failed. Every surviving rank calls it with
/// the same excluded ranks (in any order); the excluded ones do not. A survivor's new rank is
/// the number of survivors below it. It works after a peer was lost and after
/// `dspark_comm_abort` (`comm` itself stays as it is, aborted or not; destroy it as usual).
/// Errors: `DSPARK_ERR_INVALID_ARGUMENT` for a rank out of range or this rank among the
/// excluded, or when the survivors' first rank excludes this one; `DSPARK_ERR_MISMATCH` on
/// every survivor when one names another set; `DSPARK_ERR_TIMEOUT` by the deadline when a
/// survivor does not join, e.g. a dead rank that was not excluded (the message names it).
/// Free the new communicator with `dspark_comm_destroy`. `*out` is NULL on every failure.
///
/// # Safety
/// `comm` is NULL (refused) or a live communicator; `exclude` is valid for reads of `count`
/// ints (or NULL when `count` is 0); `out` is NULL (refused) or valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn dspark_comm_shrink(
    comm: *mut dspark_comm_t,
    exclude: *const c_int,
    count: c_int,
    out: *mut *mut dspark_comm_t,
    flags: c_int,
) -> dspark_result_t {
    const F: &str = "dspark_comm_shrink";
    guard(F, || {
        // SAFETY: NULL or valid for a write (contract). First: NULL on every failure.
        unsafe { put(out, ptr::null_mut(), "out", None, F) }?;
        // SAFETY: NULL or live (contract).
        let c = unsafe { comm_ref(comm, F) }?;
        let me = c.rank();
        let n = rank_arg(count, "count", me, F)?;
        if n > 0 && exclude.is_null() {
            return Err(invalid(
                Some(me),
                F,
                format!("exclude is NULL and count is {n}"),
            ));
        }
        if flags & !DSPARK_SHRINK_ABORT != 0 {
            return Err(invalid(Some(me), F, format!("unknown flags {flags:#x}")));
        }
        let list: &[c_int] = if n == 0 {
            &[]
        } else {
            // SAFETY: non-null and valid for reads of `count` ints (contract).
            unsafe { std::slice::from_raw_parts(exclude, n) }
        };
        let ranks = list
            .iter()
            .map(|&r| rank_arg(r, "excluded rank", me, F))
            .collect::<Result<Vec<usize>, Error>>()?;
        let new = if flags & DSPARK_SHRINK_ABORT != 0 {
            c.shrink_aborting(&ranks)?
        } else {
            c.shrink(&ranks)?
        };
        let h = Box::into_raw(Box::new(dspark_comm_t { comm: new }));
        // SAFETY: non-null (checked by `put` above) and valid for a write (contract).
        unsafe { out.write(h) };
        Ok(())
    })
}

/// Aborts `comm`, from any thread, like `ncclCommAbort` but without freeing it: the
/// operation in progress fails soon (within about 50 ms) with `DSPARK_ERR_ABORTED`, and so do
/// every queued and every later operation on `comm`; the peers are told and fail too (with
/// an error naming this rank). Returns at once. Final: the communicator cannot be used again
/// except to destroy it (which still must not race other calls).
///
/// # Safety
/// `comm` is NULL (refused) or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn dspark_comm_abort(comm: *mut dspark_comm_t) -> dspark_result_t {
    const F: &str = "dspark_comm_abort";
    guard(F, || {
        // SAFETY: NULL or live (contract).
        let c = unsafe { comm_ref(comm, F) }?;
        c.abort();
        Ok(())
    })
}

/// Frees `comm`. Every operation issued on it runs to completion first (each by its
/// deadline), then its connections close. Work handles of its operations stay valid (and
/// complete) and must still be freed. A NULL `comm` is refused with
/// `DSPARK_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `comm` is NULL or a live communicator that no other thread is using or will use; it is
/// invalid afterwards.
#[no_mangle]
pub unsafe extern "C" fn dspark_comm_destroy(comm: *mut dspark_comm_t) -> dspark_result_t {
    const F: &str = "dspark_comm_destroy";
    guard(F, || {
        if comm.is_null() {
            return Err(invalid(None, F, "comm is NULL"));
        }
        // SAFETY: a pointer from `Box::into_raw` in this ABI, not yet destroyed and used by
        // nobody else (contract).
        drop(unsafe { Box::from_raw(comm) });
        Ok(())
    })
}

/// All-reduce of `count` elements: every rank's `recvbuf` receives the reduction (`op`) of
/// every rank's `sendbuf`. In place when `sendbuf == recvbuf`.
///
/// Blocking when `work` is NULL. Otherwise non-blocking: `*work` receives a handle (NULL on
/// failure) to pass to `dspark_work_wait` / `dspark_work_test` and then `dspark_work_free`.
///
/// # Safety
/// `comm` is NULL (refused) or a live communicator; `work` is NULL or valid for a write of a
/// pointer. `sendbuf` must be valid for reads and `recvbuf` for reads and writes of `count`
/// elements of `dtype` (either may be NULL when `count` is 0), and nothing else may write
/// `sendbuf` or access `recvbuf` until the operation completes: until this call returns when
/// blocking, else until `dspark_work_wait` returns or `dspark_work_test` reports it done.
#[no_mangle]
pub unsafe extern "C" fn dspark_all_reduce(
    comm: *const dspark_comm_t,
    sendbuf: *const core::ffi::c_void,
    recvbuf: *mut core::ffi::c_void,
    count: usize,
    dtype: dspark_dtype_t,
    op: dspark_op_t,
    work: *mut *mut dspark_work_t,
) -> dspark_result_t {
    // SAFETY: the caller's contract is `issue`'s.
    unsafe {
        issue(
            "dspark_all_reduce",
            comm,
            Kind::AllReduce(op),
            dtype,
            sendbuf.cast(),
            recvbuf.cast(),
            count,
            work,
        )
    }
}

/// All-gather: `recvbuf` (`sendcount * size` elements) receives every rank's `sendbuf`
/// (`sendcount` elements), rank `i`'s at offset `i * sendcount`. In place when `sendbuf ==
/// recvbuf + rank * sendcount`.
///
/// Blocking when `work` is NULL, else non-blocking as `dspark_all_reduce`.
///
/// # Safety
/// As `dspark_all_reduce`, with `sendcount` elements in `sendbuf` and `sendcount * size` in
/// `recvbuf`.
#[no_mangle]
pub unsafe extern "C" fn dspark_all_gather(
    comm: *const dspark_comm_t,
    sendbuf: *const core::ffi::c_void,
    recvbuf: *mut core::ffi::c_void,
    sendcount: usize,
    dtype: dspark_dtype_t,
    work: *mut *mut dspark_work_t,
) -> dspark_result_t {
    // SAFETY: the caller's contract is `issue`'s.
    unsafe {
        issue(
            "dspark_all_gather",
            comm,
            Kind::AllGather,
            dtype,
            sendbuf.cast(),
            recvbuf.cast(),
            sendcount,
            work,
        )
    }
}

/// Reduce-scatter: `sendbuf` holds `recvcount * size` elements; rank `i`'s `recvbuf`
/// (`recvcount` elements) receives the reduction (`op`) over ranks of block `i`. In place when
/// `recvbuf == sendbuf + rank * recvcount`.
///
/// Blocking when `work` is NULL, else non-blocking as `dspark_all_reduce`.
///
/// # Safety
/// As `dspark_all_reduce`, with `recvcount * size` elements in `sendbuf` and `recvcount` in
/// `recvbuf`.
#[no_mangle]
pub unsafe extern "C" fn dspark_reduce_scatter(
    comm: *const dspark_comm_t,
    sendbuf: *const core::ffi::c_void,
    recvbuf: *mut core::ffi::c_void,
    recvcount: usize,
    dtype: dspark_dtype_t,
    op: dspark_op_t,
    work: *mut *mut dspark_work_t,
) -> dspark_result_t {
    // SAFETY: the caller's contract is `issue`'s.
    unsafe {
        issue(
            "dspark_reduce_scatter",
            comm,
            Kind::ReduceScatter(op),
            dtype,
            sendbuf.cast(),
            recvbuf.cast(),
            recvcount,
            work,
        )
    }
}

/// Broadcast of `count` elements from `root`'s `sendbuf` into every rank's `recvbuf`
/// (`sendbuf` is only read at the root; it may be NULL elsewhere). In place when `sendbuf ==
/// recvbuf`.
///
/// Blocking when `work` is NULL, else non-blocking as `dspark_all_reduce`.
///
/// # Safety
/// As `dspark_all_reduce`.
#[no_mangle]
pub unsafe extern "C" fn dspark_broadcast(
    comm: *const dspark_comm_t,
    sendbuf: *const core::ffi::c_void,
    recvbuf: *mut core::ffi::c_void,
    count: usize,
    dtype: dspark_dtype_t,
    root: c_int,
    work: *mut *mut dspark_work_t,
) -> dspark_result_t {
    // SAFETY: the caller's contract is `issue`'s.
    unsafe {
        issue(
            "dspark_broadcast",
            comm,
            Kind::Broadcast(root),
            dtype,
            sendbuf.cast(),
            recvbuf.cast(),
            count,
            work,
        )
    }
}

/// Reduce of `count` elements: `root`'s `recvbuf` receives the reduction (`op`) of every
/// rank's `sendbuf`. `recvbuf` is only written at the root (it may be NULL elsewhere). In
/// place when `sendbuf == recvbuf` (then a non-root's buffer may be used as scratch space).
///
/// Blocking when `work` is NULL, else non-blocking as `dspark_all_reduce`.
///
/// # Safety
/// As `dspark_all_reduce`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn dspark_reduce(
    comm: *const dspark_comm_t,
    sendbuf: *const core::ffi::c_void,
    recvbuf: *mut core::ffi::c_void,
    count: usize,
    dtype: dspark_dtype_t,
    op: dspark_op_t,
    root: c_int,
    work: *mut *mut dspark_work_t,
) -> dspark_result_t {
    // SAFETY: the caller's contract is `issue`'s.
    unsafe {
        issue(
            "dspark_reduce",
            comm,
            Kind::Reduce(op, root),
            dtype,
            sendbuf.cast(),
            recvbuf.cast(),
            count,
            work,
        )
    }
}

/// All-to-all: block `j` (`count_per_rank` elements at offset `j * count_per_rank`) of each
/// rank's `sendbuf` goes to rank `j`, into block `i` of its `recvbuf` for sender `i`. Both
/// buffers hold `count_per_rank * size` elements. In place when `sendbuf == recvbuf`.
///
/// Blocking when `work` is NULL, else non-blocking as `dspark_all_reduce`.
///
/// # Safety
/// As `dspark_all_reduce`, with `count_per_rank * size` elements in each buffer.
#[no_mangle]
pub unsafe extern "C" fn dspark_all_to_all(
    comm: *const dspark_comm_t,
    sendbuf: *const core::ffi::c_void,
    recvbuf: *mut core::ffi::c_void,
    count_per_rank: usize,
    dtype: dspark_dtype_t,
    work: *mut *mut dspark_work_t,
) -> dspark_result_t {
    // SAFETY: the caller's contract is `issue`'s.
    unsafe {
        issue(
            "dspark_all_to_all",
            comm,
            Kind::AllToAll,
            dtype,
            sendbuf.cast(),
            recvbuf.cast(),
            count_per_rank,
            work,
        )
    }
}

/// Sends `count` elements of `buf` to rank `peer` (another rank: one's own is refused), which
/// receives them with `dspark_recv`.
///
/// Operations of a communicator run one at a time in issue order, also non-blocking ones:
/// order sends and receives so that they match without deadlock (in a ring, for example,
/// let even ranks send first and odd ranks receive first), or exchange with
/// `dspark_send_recv`.
///
/// Blocking when `work` is NULL, else non-blocking as `dspark_all_reduce`.
///
/// # Safety
/// As `dspark_all_reduce`, with `buf` valid for reads of `count` elements of `dtype`, not
/// written by anybody until the operation completes.
#[no_mangle]
pub unsafe extern "C" fn dspark_send(
    comm: *const dspark_comm_t,
    buf: *const core::ffi::c_void,
    count: usize,
    dtype: dspark_dtype_t,
    peer: c_int,
    work: *mut *mut dspark_work_t,
) -> dspark_result_t {
    // SAFETY: the caller's contract is `issue`'s.
    unsafe {
        issue(
            "dspark_send",
            comm,
            Kind::Send(peer),
            dtype,
            buf.cast(),
            ptr::null_mut(),
            count,
            work,
        )
    }
}

/// Receives `count` elements from rank `peer` (its matching `dspark_send`; another rank: one's
/// own is refused) into `buf`.
///
/// Blocking when `work` is NULL, else non-blocking as `dspark_all_reduce` (see `dspark_send`
/// on ordering).
///
/// # Safety
/// As `dspark_all_reduce`, with `buf` valid for writes of `count` elements of `dtype`, not
/// accessed by anybody until the operation completes.
#[no_mangle]
pub unsafe extern "C" fn dspark_recv(
    comm: *const dspark_comm_t,
    buf: *mut core::ffi::c_void,
    count: usize,
    dtype: dspark_dtype_t,
    peer: c_int,
    work: *mut *mut dspark_work_t,
) -> dspark_result_t {
    // SAFETY: the caller's contract is `issue`'s.
    unsafe {
        issue(
            "dspark_recv",
            comm,
            Kind::Recv(peer),
            dtype,
            ptr::null(),
            buf.cast(),
            count,
            work,
        )
    }
}

/// Sends `sendcount` elements of `sendbuf` to rank `dest` and receives `recvcount` elements
/// from rank `source` into `recvbuf`, at once (MPI's `MPI_Sendrecv`): the two progress
/// together, so ranks that exchange buffers (a swap, a ring shift, a halo) complete whatever
/// the size, where a `dspark_send` then a `dspark_recv` on both ranks of a swap wait on each
/// other once the message outgrows what the transport buffers. `dest` and `source` may be
/// the same rank, but not this one (refused); the peers may answer with `dspark_send_recv` or with `dspark_recv` and
/// `dspark_send`. Host buffers only.
///
/// Blocking when `work` is NULL, else non-blocking as `dspark_all_reduce`.
///
/// # Safety
/// As `dspark_all_reduce`, with `sendbuf` valid for reads of `sendcount` elements of `dtype`
/// and not written, and `recvbuf` valid for writes of `recvcount` elements and not accessed,
/// by anybody until the operation completes; the two do not overlap.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn dspark_send_recv(
    comm: *const dspark_comm_t,
    sendbuf: *const core::ffi::c_void,
    sendcount: usize,
    dest: c_int,
    recvbuf: *mut core::ffi::c_void,
    recvcount: usize,
    source: c_int,
    dtype: dspark_dtype_t,
    work: *mut *mut dspark_work_t,
) -> dspark_result_t {
    // SAFETY: the caller's contract is `issue`'s.
    unsafe {
        issue(
            "dspark_send_recv",
            comm,
            Kind::SendRecv(dest, source, recvcount),
            dtype,
            sendbuf.cast(),
            recvbuf.cast(),
            sendcount,
            work,
        )
    }
}

/// All-to-all of blocks of any size (MPI's `MPI_Alltoallv` with contiguous blocks):
/// `sendcounts[j]` elements of `sendbuf` (the blocks in rank order) go to rank `j`, and
/// `recvcounts[i]` elements from rank `i` land in `recvbuf` (in rank order). Rank `j`'s
/// `recvcounts[r]` must equal rank `r`'s `sendcounts[j]`; a pair that disagrees fails with
/// `DSPARK_ERR_MISMATCH` naming both sizes. The counts (`size` each) are read during the
/// call and may be freed once it returns. The buffers may overlap (a copy of the send blocks
/// is then sent).
///
/// Blocking when `work` is NULL, else non-blocking as `dspark_all_reduce`.
///
/// # Safety
/// As `dspark_all_reduce`, with `sendcounts` and `recvcounts` valid for reads of `size`
/// `size_t` each during the call, `sendbuf` valid for reads of the sum of `sendcounts`
/// elements of `dtype` and `recvbuf` for reads and writes of the sum of `recvcounts`, until
/// the operation completes.
#[no_mangle]
pub unsafe extern "C" fn dspark_all_to_all_v(
    comm: *const dspark_comm_t,
    sendbuf: *const core::ffi::c_void,
    sendcounts: *const usize,
    recvbuf: *mut core::ffi::c_void,
    recvcounts: *const usize,
    dtype: dspark_dtype_t,
    work: *mut *mut dspark_work_t,
) -> dspark_result_t {
    const FUNC: &str = "dspark_all_to_all_v";
    guard(FUNC, || {
        if !work.is_null() {
            // SAFETY: non-null `work` is valid for a write (contract). Set first, so that
            // `*work` is NULL whenever the call fails.
            unsafe { work.write(ptr::null_mut()) };
        }
        // SAFETY: NULL or live (contract).
        let c = unsafe { comm_ref(comm, FUNC) }?;
        let (me, n) = (c.rank(), c.world_size());
        let dtype = dtype_of(dtype, me, FUNC)?;
        let counts = |p: *const usize, which: &str| -> Result<&[usize], Error> {
            if p.is_null() {
                return Err(invalid(Some(me), FUNC, format!("{which} is NULL")));
            }
            // SAFETY: valid for reads of `size` counts during the call (contract).
            Ok(unsafe { std::slice::from_raw_parts(p, n) })
        };
        let send = (sendbuf.cast::<u8>(), counts(sendcounts, "sendcounts")?);
        let recv = (recvbuf.cast::<u8>(), counts(recvcounts, "recvcounts")?);
        // SAFETY: as in `issue`; the counts are copied before `start` returns.
        unsafe {
            run_or_start(
                work,
                || c.run_raw_all_to_all_v(dtype, send, recv, None),
                || c.start_raw_all_to_all_v(dtype, send, recv, None),
            )
        }
    })
}

/// Barrier: completes once every rank of `comm` has reached it.
///
/// Blocking when `work` is NULL, else non-blocking as `dspark_all_reduce`.
///
/// # Safety
/// `comm` is NULL (refused) or a live communicator; `work` is NULL or valid for a write of a
/// pointer.
#[no_mangle]
pub unsafe extern "C" fn dspark_barrier(
    comm: *const dspark_comm_t,
    work: *mut *mut dspark_work_t,
) -> dspark_result_t {
    // SAFETY: the caller's contract is `issue`'s.
    unsafe {
        issue(
            "dspark_barrier",
            comm,
            Kind::Barrier,
            0,
            ptr::null(),
            ptr::null_mut(),
            0,
            work,
        )
    }
}

/// Copies `comm`'s flight record — its last operations (`DSPARK_FR_ENTRIES`), in the JSON
/// dump format that `DSPARK_FR_DUMP` writes and `dspark analyze` reads — into `buf` as a
/// NUL-terminated string. `*needed` (never NULL) is set to the bytes the record takes with
/// its NUL; when `len` is smaller, nothing is written to `buf` (which may then be NULL) and
/// `DSPARK_ERR_INVALID_ARGUMENT` says so: call once with `len` 0 to size the buffer, then
/// again (the record may have grown meanwhile). `DSPARK_ERR_UNAVAILABLE` when the recorder
/// is off (`DSPARK_FR_ENTRIES=0`; `*needed` is 0 then). Never waits for an operation in
/// progress.
///
/// # Safety
/// `comm` is NULL (refused) or a live communicator; `needed` is NULL (refused) or valid for
/// a write; `buf` is valid for writes of `len` bytes (or NULL with `len` 0).
#[no_mangle]
pub unsafe extern "C" fn dspark_comm_flight_record(
    comm: *const dspark_comm_t,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> dspark_result_t {
    const F: &str = "dspark_comm_flight_record";
    guard(F, || {
        // SAFETY: NULL or live (contract).
        let c = unsafe { comm_ref(comm, F) }?;
        let rank = Some(c.rank());
        // SAFETY: NULL (refused) or valid for a write (contract).
        unsafe { put(needed, 0, "needed", rank, F) }?;
        let rec = c.flight_record().ok_or_else(|| Error::Unavailable {
            rank,
            what: "the flight record".into(),
            reason: "the flight recorder is off (DSPARK_FR_ENTRIES=0)".into(),
        })?;
        // SAFETY: the caller's contract is `copy_out`'s.
        unsafe { copy_out(&rec.to_json(), "the record", buf, len, needed, rank, F) }
    })
}

/// Copies `comm`'s description — every fact it knows about its paths, as one JSON object
/// (format `"dspark-comm-info"`, version 1; the object Python's `Communicator.info()`
/// returns) — into `buf` as a NUL-terminated string: the transport and why not a faster one
/// (`transport`, `transport_reason`), every connection's (`peer_transports`), hosts, CPU
/// sharing, `timeout` (seconds), the cost model and where all_reduce switches algorithm
/// (`all_reduce_algorithms`), the path device memory takes on every connection and why
/// (`device_path`, `device_paths`), GPUs where non-blocking device calls block
/// (`enqueue_blocks`, among those used so far), the rendezvous and how the ranks
/// authenticated each other (`auth`).
/// `*needed` and `len` as for `dspark_comm_flight_record`: call once with `len` 0 to size
/// the buffer. Never waits for an operation in progress.
///
/// # Safety
/// `comm` is NULL (refused) or a live communicator; `needed` is NULL (refused) or valid for
/// a write; `buf` is valid for writes of `len` bytes (or NULL with `len` 0).
#[no_mangle]
pub unsafe extern "C" fn dspark_comm_describe(
    comm: *const dspark_comm_t,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> dspark_result_t {
    const F: &str = "dspark_comm_describe";
    guard(F, || {
        // SAFETY: NULL or live (contract).
        let c = unsafe { comm_ref(comm, F) }?;
        // SAFETY: the caller's contract is `copy_out`'s.
        unsafe {
            copy_out(
                &c.describe_json(),
                "the description",
                buf,
                len,
                needed,
                Some(c.rank()),
                F,
            )
        }
    })
}
