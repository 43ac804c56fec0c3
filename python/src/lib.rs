//! `dspark._dspark`: the native half of the `dspark` Python package.
//!
//! It is deliberately small. Python code (`python/dspark/`) turns torch tensors and
//! buffer-protocol objects (numpy arrays, `bytearray`, ...) into (data pointer, element
//! count, dtype) and keeps their memory alive; the pointer of a buffer comes from
//! `_buffer_address` (the exporter's own, never a number a Python object claims, such as
//! an `__array_interface__`'s), that of a tensor is checked to lie in its storage. This
//! module runs the collectives on those pointers through dspark's raw-pointer API
//! ([`dspark::Communicator::run_raw`] / [`start_raw`](dspark::Communicator::start_raw)),
//! always with the GIL released. It never links libtorch, so one abi3 wheel serves every
//! CPython ≥ 3.9 and every torch 2.x.
//!
//! # Lifetimes (why the raw pointers are safe to use)
//! A non-blocking call is given a `keepalive` object: the memoryviews of the buffers it
//! reads and writes (an exported buffer cannot be resized or freed), the tensors and their
//! storages (a tensor's `set_()` or `del` leaves the storage's memory alive). The
//! communicator itself holds that object until the operation completes: the `Work`
//! returned to Python may be dropped or leaked at any time without the buffers being freed
//! under the operation. (Growing a tensor with `resize_` in flight reallocates its storage
//! in place: that stays the caller's contract, as with torch's own asynchronous work.) Operations complete in issue order, so completed ones are
//! released from the front of the list at the next call, and all of them when the
//! communicator closes (closing runs every issued operation to completion first).
//!
//! Errors become Python exceptions, one class per kind, all under `dspark.Error`.

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use dspark::internals::bootstrap::store::Store;
use dspark::{Communicator, Config, DataType, RawCall, RawOp, ReduceOp};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyMemoryView};

create_exception!(
    dspark,
    Error,
    PyRuntimeError,
    "Every dspark error. The message names the rank, the peer and the operation."
);
create_exception!(
    dspark,
    TimeoutError,
    Error,
    "An operation did not finish before its deadline (a silent, stopped or overloaded peer)."
);
create_exception!(
    dspark,
    PeerLostError,
    Error,
    "A peer closed its connection or died."
);
create_exception!(
    dspark,
    MismatchError,
    Error,
    "Ranks disagree about a call (collective, count, dtype, op, root) or about the job."
);
create_exception!(
    dspark,
    InvalidArgumentError,
    Error,
    "A bad argument: a wrong size, root, dtype or a buffer dspark cannot use."
);
create_exception!(
    dspark,
    ConfigError,
    Error,
    "A missing, unparsable or inconsistent setting (the message names the variable)."
);
create_exception!(dspark, IoError, Error, "An operating-system I/O error.");
create_exception!(
    dspark,
    AbortedError,
    Error,
    "The communicator was aborted, here or by another rank."
);
create_exception!(
    dspark,
    UnavailableError,
    Error,
    "Something asked for cannot be had on this machine (verbs, GPUDirect RDMA, CUDA)."
);
create_exception!(
    dspark,
    InternalError,
    Error,
    "A bug in dspark: please report it with the message."
);

/// The Python exception for a dspark error.
fn py_err(e: dspark::Error) -> PyErr {
    use dspark::Error as E;
    let msg = e.to_string();
    match e {
        E::Timeout { .. } => TimeoutError::new_err(msg),
        E::PeerLost { .. } => PeerLostError::new_err(msg),
        E::Mismatch { .. } => MismatchError::new_err(msg),
        E::InvalidArgument { .. } => InvalidArgumentError::new_err(msg),
        E::Config { .. } => ConfigError::new_err(msg),
        E::Io { .. } => IoError::new_err(msg),
        E::Aborted { .. } => AbortedError::new_err(msg),
        E::Transport { ref what, .. } if what.starts_with("internal error") => {
            InternalError::new_err(msg)
        }
        E::Transport { .. } => IoError::new_err(msg),
        E::Unavailable { .. } | E::Cuda { .. } => UnavailableError::new_err(msg),
        _ => Error::new_err(msg),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn secs(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(PyValueError::new_err(format!(
            "dspark: timeout {s} is not a number of seconds > 0"
        ))),
    }
}

// ------------------------------------------------------------------------------- the store

/// A Python key-value store with torch's `Store` interface (`set`, `get`, `add`,
/// `wait(keys, timedelta)`, `compare_set`): torch's `TCPStore`, `FileStore`, `HashStore`,
/// `PrefixStore`.
/// Each call takes the GIL for its duration; the rendezvous itself runs without it.
#[derive(Debug)]
struct PyStore {
    store: Py<PyAny>,
    rank: usize,
}

impl PyStore {
    fn fail(&self, what: &str, key: &str, e: PyErr, started: Instant) -> dspark::Error {
        let (name, text) = Python::attach(|py| {
            let name = e.get_type(py).name().map(|n| n.to_string());
            (name.unwrap_or_default(), e.value(py).to_string())
        });
        let lower = text.to_ascii_lowercase();
        if lower.contains("timeout") || lower.contains("timed out") {
            dspark::Error::Timeout {
                rank: self.rank,
                peer: None,
                op: format!("rendezvous: store {what} of {key:?}"),
                waited: started.elapsed(),
                detail: format!("the store said {name}: {text}"),
            }
        } else {
            dspark::Error::io(
                Some(self.rank),
                None,
                format!("rendezvous: store {what} of {key:?}"),
                io::Error::other(format!("{name}: {text}")),
            )
        }
    }

    fn wait_keys(&self, py: Python<'_>, keys: &[&str], timeout: Duration) -> PyResult<()> {
        let td = py
            .import("datetime")?
            .getattr("timedelta")?
            .call1((0, timeout.as_secs_f64()))?;
        let list = PyList::new(py, keys)?;
        self.store.bind(py).call_method1("wait", (list, td))?;
        Ok(())
    }
}

impl Store for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> dspark::Result<()> {
        let t = Instant::now();
        Python::attach(|py| {
            self.store
                .bind(py)
                .call_method1("set", (key, PyBytes::new(py, value)))
                .map(drop)
        })
        .map_err(|e| self.fail("set", key, e, t))
    }

    fn get(&self, key: &str, timeout: Duration) -> dspark::Result<Vec<u8>> {
        let t = Instant::now();
        Python::attach(|py| -> PyResult<Vec<u8>> {
            self.wait_keys(py, &[key], timeout)?;
            let v = self.store.bind(py).call_method1("get", (key,))?;
            v.extract::<Vec<u8>>()
        })
        .map_err(|e| self.fail("get", key, e, t))
    }

    fn add(&self, key: &str, delta: i64) -> dspark::Result<i64> {
        let t = Instant::now();
        Python::attach(|py| {
            self.store
                .bind(py)
                .call_method1("add", (key, delta))?
                .extract::<i64>()
        })
        .map_err(|e| self.fail("add", key, e, t))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> dspark::Result<()> {
        let t = Instant::now();
        Python::attach(|py| self.wait_keys(py, keys, timeout))
            .map_err(|e| self.fail("wait", &keys.join(","), e, t))
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> dspark::Result<Vec<u8>> {
        let t = Instant::now();
        Python::attach(|py| {
            self.store
                .bind(py)
                .call_method1(
                    "compare_set",
                    (key, PyBytes::new(py, expected), PyBytes::new(py, desired)),
                )?
                .extract::<Vec<u8>>()
        })
        .map_err(|e| self.fail("compare_set", key, e, t))
    }
}

// ------------------------------------------------------------------------- communicators

/// A dspark communicator (`dspark._dspark.Communicator`). Use `dspark.Communicator`, which
/// takes numpy arrays and torch tensors; the methods here take data pointers.
#[pyclass(module = "dspark._dspark", name = "Communicator", frozen)]
struct PyComm {
    /// `None` once closed. Each call clones the `Arc` under a short read lock, so `close`
    /// and `abort` never wait for a call in progress.
    comm: RwLock<Option<Arc<Communicator>>>,
    /// Non-blocking operations in flight with the objects that own their buffers, in issue
    /// (= completion) order. Declared after `comm`: dropped after it, i.e. after every
    /// issued operation has run.
    pending: Mutex<VecDeque<(Arc<dspark::Work>, Py<PyAny>)>>,
    rank: usize,
    world: usize,
}

impl std::fmt::Debug for PyComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Communicator(rank {}/{})", self.rank, self.world)
    }
}

impl PyComm {
    fn new(c: Communicator) -> Self {
        PyComm {
            rank: c.rank(),
            world: c.world_size(),
            comm: RwLock::new(Some(Arc::new(c))),
            pending: Mutex::new(VecDeque::new()),
        }
    }

    fn get(&self) -> PyResult<Arc<Communicator>> {
        self.comm
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| {
                AbortedError::new_err(format!("rank {}: the communicator is closed", self.rank))
            })
    }

    /// Starts an operation with `start` and holds `keepalive` until it completes (in
    /// `pending`, released by `prune` after `test` saw it finished, or when the communicator
    /// is dropped, after its drop ran every issued operation to completion).
    fn pend(
        &self,
        coll: &str,
        keepalive: Py<PyAny>,
        start: impl FnOnce(&Communicator) -> dspark::Result<dspark::Work>,
    ) -> PyResult<PyWork> {
        let c = self.get()?;
        let w = start(&c).map_err(py_err)?;
        Ok(self.held(coll, keepalive, w))
    }

    /// The `PyWork` of a started operation, whose `keepalive` is held until it completes.
    fn held(&self, coll: &str, keepalive: Py<PyAny>, w: dspark::Work) -> PyWork {
        let w = Arc::new(w);
        let mut pending = lock(&self.pending);
        Self::prune(&mut pending);
        pending.push_back((Arc::clone(&w), keepalive));
        PyWork {
            w,
            what: coll.to_string(),
        }
    }

    /// [`PyComm::pend`] for a start that may run the whole operation (a device collective
    /// on a GPU that cannot order it on the stream runs to completion inline, and a first
    /// device call compiles its kernels): `start` runs without the GIL, so that the other
    /// Python threads (the lanes completing torch's futures, another group's caller) go on,
    /// and without `pending`'s lock, which a thread holding the GIL may be waiting for.
    /// `keepalive` is the caller's argument meanwhile, so alive.
    fn pend_detached(
        &self,
        py: Python<'_>,
        coll: &str,
        keepalive: Py<PyAny>,
        start: impl FnOnce(&Communicator) -> dspark::Result<dspark::Work> + Send,
    ) -> PyResult<PyWork> {
        let c = self.get()?;
        // `c` is dropped without the GIL too: a `close()` meanwhile leaves it the last
        // reference, and the communicator's drop runs every issued operation to completion.
        let w = py.detach(move || {
            let r = start(&c);
            drop(c);
            r
        });
        Ok(self.held(coll, keepalive, w.map_err(py_err)?))
    }

    /// Releases the keepalives of operations that completed (from the front: they complete
    /// in order).
    fn prune(pending: &mut VecDeque<(Arc<dspark::Work>, Py<PyAny>)>) {
        while let Some((w, _)) = pending.front() {
            if matches!(w.test(), Ok(false)) {
                break;
            }
            if let Some((w, keep)) = pending.pop_front() {
                Self::release(&w, keep);
            }
        }
    }

    /// Drops the keepalive of a completed operation, unless GPU work it queued on those
    /// buffers never finished (`Work::buffers_may_be_in_use`): then the objects are kept
    /// for the rest of the process, so that torch's allocator never hands their memory out
    /// while that work may still write it.
    fn release(w: &dspark::Work, keep: Py<PyAny>) {
        if w.buffers_may_be_in_use() {
            eprintln!(
                "dspark: a failed GPU operation's device work never finished: its tensors are \
                 kept alive (never freed) for the rest of the process"
            );
            std::mem::forget(keep);
        }
    }
}

impl Drop for PyComm {
    fn drop(&mut self) {
        let c = self
            .comm
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        // Closing runs what was issued (each by its deadline): without the GIL, so other
        // Python threads go on meanwhile.
        Python::attach(|py| py.detach(move || drop(c)));
        let pending = std::mem::take(
            self.pending
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for (w, keep) in pending {
            Self::release(&w, keep);
        }
    }
}

fn parse_dtype(s: &str) -> PyResult<DataType> {
    s.parse::<DataType>()
        .map_err(|e| InvalidArgumentError::new_err(format!("dspark: {e}")))
}

fn parse_op(s: &str) -> PyResult<ReduceOp> {
    s.parse::<ReduceOp>()
        .map_err(|e| InvalidArgumentError::new_err(format!("dspark: {e}")))
}

/// The call the Python layer describes. `peer` is the root or the peer, as the collective
/// needs; `send_recv` also names the source (`peer2`) and the elements received (`count2`).
#[allow(clippy::too_many_arguments)]
fn raw_call(
    coll: &str,
    dtype: &str,
    send: usize,
    recv: usize,
    count: usize,
    op: Option<&str>,
    (peer, peer2, count2): (usize, usize, usize),
    timeout: Option<f64>,
) -> PyResult<RawCall> {
    let red = || parse_op(op.unwrap_or("sum"));
    let op = match coll {
        "all_reduce" => RawOp::AllReduce(red()?),
        "all_gather" => RawOp::AllGather,
        "reduce_scatter" => RawOp::ReduceScatter(red()?),
        "broadcast" => RawOp::Broadcast { root: peer },
        "reduce" => RawOp::Reduce {
            op: red()?,
            root: peer,
        },
        "all_to_all" => RawOp::AllToAll,
        "send" => RawOp::Send { peer },
        "recv" => RawOp::Recv { peer },
        // `count` elements of `send` to `peer`, `count2` into `recv` from `peer2`.
        "send_recv" => RawOp::SendRecv {
            to: peer,
            from: peer2,
            recv_count: count2,
        },
        "barrier" => RawOp::Barrier,
        other => {
            return Err(InvalidArgumentError::new_err(format!(
                "dspark: no collective named {other:?}"
            )))
        }
    };
    Ok(RawCall {
        op,
        dtype: parse_dtype(dtype)?,
        send: send as *const u8,
        recv: recv as *mut u8,
        count,
        timeout: secs(timeout)?,
    })
}

/// The dtypes of `_all_reduce`, by index (the module exports their names as `_FAST_DTYPES`).
const FAST_DTYPES: [DataType; 10] = [
    DataType::F32,
    DataType::F64,
    DataType::F16,
    DataType::BF16,
    DataType::I8,
    DataType::U8,
    DataType::I32,
    DataType::I64,
    DataType::U32,
    DataType::U64,
];

/// The ops of `_all_reduce`, by index (exported as `_FAST_OPS`).
const FAST_OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Avg,
];

fn fast_call(
    ptr: usize,
    count: usize,
    dtype: usize,
    op: usize,
    timeout: Option<f64>,
) -> PyResult<RawCall> {
    let (Some(&dtype), Some(&op)) = (FAST_DTYPES.get(dtype), FAST_OPS.get(op)) else {
        return Err(InvalidArgumentError::new_err(format!(
            "dspark: no dtype {dtype} or op {op} in the fast tables"
        )));
    };
    Ok(RawCall {
        op: RawOp::AllReduce(op),
        dtype,
        send: ptr as *const u8,
        recv: ptr as *mut u8,
        count,
        timeout: secs(timeout)?,
    })
}

/// A rank or a world size from Python: any int that fits in `usize` goes on to `Config`'s
/// validation (which says what the largest allowed value is); a negative or larger int is
/// a `ConfigError` naming it, not an `OverflowError` from the conversion.
fn count_arg(v: &Bound<'_, PyAny>, what: &str, var: &str) -> PyResult<usize> {
    v.extract::<usize>().map_err(|e| {
        if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(v.py()) {
            ConfigError::new_err(format!(
                "dspark: {what} {} (as {var}) is not a number from 0 to {}",
                v.repr().map(|r| r.to_string()).unwrap_or_default(),
                usize::MAX
            ))
        } else {
            e
        }
    })
}

fn config_for(rank: usize, world: usize, timeout: Option<f64>) -> PyResult<Config> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    // Rank 0's address comes from the store; MASTER_ADDR / DSPARK_ROOT_ADDR, where set,
    // only choose the interface rank 0 publishes. Without them, a placeholder satisfies the
    // parser and is removed again below.
    // (torch's file:// and tcp:// init methods set MASTER_ADDR without MASTER_PORT: the
    // port is not needed to choose an interface.)
    let hint = env("DSPARK_ROOT_ADDR").is_some() || env("MASTER_ADDR").is_some();
    let t = timeout.map(|s| s.to_string());
    let mut c = Config::from_lookup(|k| match k {
        "DSPARK_RANK" => Some(rank.to_string()),
        "DSPARK_WORLD_SIZE" => Some(world.to_string()),
        "DSPARK_TIMEOUT" if t.is_some() => t.clone(),
        "DSPARK_ROOT_ADDR" if !hint => Some("127.0.0.1:1".into()),
        "MASTER_PORT" => env(k).or_else(|| Some("1".into())),
        // torch's flight-recorder size, when dspark's own is not set (python/dspark/_flight.py).
        "DSPARK_FR_ENTRIES" => env(k)
            .or_else(|| env("TORCH_FR_BUFFER_SIZE"))
            .or_else(|| env("TORCH_NCCL_TRACE_BUFFER_SIZE")),
        _ => env(k),
    })
    .map_err(py_err)?;
    if !hint {
        c.root_addr.clear();
    }
    c.sources.retain(|(k, _)| k != "rank" && k != "world size");
    c.sources
        .push(("rank".into(), "the caller (a torch backend factory)".into()));
    if timeout.is_some() {
        c.sources.retain(|(k, _)| k != "timeout");
        c.sources
            .push(("timeout".into(), "the caller (init_process_group)".into()));
    }
    Ok(c)
}

#[pymethods]
impl PyComm {
    /// Joins the job described by the environment (`DSPARK_*`, torchrun's, mpirun's or
    /// srun's variables), exactly as `dspark-bench` does.
    #[staticmethod]
    fn from_env(py: Python<'_>) -> PyResult<Self> {
        py.detach(Communicator::from_env)
            .map(PyComm::new)
            .map_err(py_err)
    }

    /// Joins a job through a key-value store with torch's interface (`set`, `get`, `add`,
    /// `wait`, `compare_set`): rank 0 listens on an ephemeral port and publishes its address
    /// there, with a random secret unless the ranks have a token.
    /// `timeout` (seconds) is the deadline of every call; the environment gives the rest of
    /// the configuration.
    #[staticmethod]
    #[pyo3(signature = (store, rank, world_size, timeout=None))]
    fn init_with_store(
        py: Python<'_>,
        store: Py<PyAny>,
        rank: &Bound<'_, PyAny>,
        world_size: &Bound<'_, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<Self> {
        let rank = count_arg(rank, "rank", "DSPARK_RANK")?;
        let world_size = count_arg(world_size, "world size", "DSPARK_WORLD_SIZE")?;
        secs(timeout)?;
        let config = config_for(rank, world_size, timeout)?;
        let store = PyStore { store, rank };
        py.detach(|| Communicator::init_with_store(&store, rank, world_size, config))
            .map(PyComm::new)
            .map_err(py_err)
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.world
    }

    /// Every fact the communicator knows about its paths, as a dict (the library's
    /// `Communicator::describe_json`, the object C's `dspark_comm_describe` copies out):
    /// the transport and why not a faster one (`transport`, `transport_reason`), each
    /// connection's (`peer_transports`), hosts, whether this rank shares its CPUs with other
    /// ranks (`cpu_sharing`, and the spin that follows from it: `spin_us`, `spin_yields`),
    /// `timeout` (seconds), the cost model and where all_reduce switches algorithm
    /// (`all_reduce_algorithms`), the path device memory (CUDA tensors) takes on every
    /// connection and why (`device_path`, `device_paths`, `data_path`: the policy,
    /// `gpu_direct`), GPUs where asynchronous device calls block the host
    /// (`enqueue_blocks`, among those used so far), what init allocated for GPUDirect
    /// (`direct_region`), rendezvous, and how the ranks authenticated each other (`auth`, in
    /// words: "job secret from the spawner", "token file /path", "secret published in the
    /// store", "open: any host that reaches port P can join", ...).
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let text = self.get()?.describe_json();
        py.import("json")?.call_method1("loads", (text,))
    }

    /// Runs one collective on raw buffers and waits for it, without the GIL.
    ///
    /// Private to the package: the pointers must be those of live, contiguous buffers of
    /// the sizes the collective needs, which nothing here can check. `dspark.Communicator`
    /// and the torch backend pass pointers of objects they hold for the call's duration.
    #[pyo3(signature = (coll, dtype, send, recv, count, op=None, peer=0, timeout=None, peer2=0, count2=0))]
    #[allow(clippy::too_many_arguments)]
    fn _run(
        &self,
        py: Python<'_>,
        coll: &str,
        dtype: &str,
        send: usize,
        recv: usize,
        count: usize,
        op: Option<&str>,
        peer: usize,
        timeout: Option<f64>,
        peer2: usize,
        count2: usize,
    ) -> PyResult<()> {
        let call = raw_call(
            coll,
            dtype,
            send,
            recv,
            count,
            op,
            (peer, peer2, count2),
            timeout,
        )?;
        let c = self.get()?;
        // Raw pointers are not Send; their addresses are.
        let call = SendCall(call);
        py.detach(move || {
            let call = call;
            // SAFETY: the Python caller (dspark/_buffers.py) passes the data pointers and
            // sizes of live contiguous arrays or tensors that it references until this call
            // returns, and this call returns only after the operation completed.
            unsafe { c.run_raw(&call.0) }
        })
        .map_err(py_err)
    }

    /// Receives the next message any peer sends to this rank into the `count` elements of
    /// `dtype` at `recv`, without the GIL, and returns the peer (`Communicator::recv_any`);
    /// with `wait` (seconds), `None` when no message started arriving within it (nothing
    /// received: `Communicator::try_recv_any`). Same contract as `_run` for `recv`.
    #[pyo3(signature = (dtype, recv, count, wait=None, timeout=None))]
    fn _recv_any(
        &self,
        py: Python<'_>,
        dtype: &str,
        recv: usize,
        count: usize,
        wait: Option<f64>,
        timeout: Option<f64>,
    ) -> PyResult<Option<usize>> {
        let dt = parse_dtype(dtype)?;
        let (wait, timeout) = (secs(wait)?, secs(timeout)?);
        let len = count
            .checked_mul(dt.size())
            .ok_or_else(|| InvalidArgumentError::new_err("dspark: recv: count overflows"))?;
        let c = self.get()?;
        py.detach(move || {
            let buf: &mut [u8] = if len == 0 {
                &mut []
            } else {
                // SAFETY: the Python caller (dspark/_torch_collectives.py, all_reduce's fast
                // path) passes the data pointer of a live contiguous tensor of `count`
                // elements of `dtype` that it references, and touches in no other way, until
                // this call returns.
                unsafe { std::slice::from_raw_parts_mut(recv as *mut u8, len) }
            };
            c.recv_any_bytes(dt, buf, wait, timeout)
        })
        .map_err(py_err)
    }

    /// `_run("all_reduce", ...)` in place on one buffer, for the torch backend's fast path
    /// (one small call per `dist.all_reduce`): the dtype and the op are indices into
    /// `FAST_DTYPES` and `FAST_OPS` (the module's `_FAST_DTYPES` / `_FAST_OPS`), not names.
    /// Same contract as `_run`.
    #[pyo3(signature = (ptr, count, dtype, op, timeout=None))]
    fn _all_reduce(
        &self,
        py: Python<'_>,
        ptr: usize,
        count: usize,
        dtype: usize,
        op: usize,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let call = fast_call(ptr, count, dtype, op, timeout)?;
        let c = self.get()?;
        let call = SendCall(call);
        py.detach(move || {
            let call = call;
            // SAFETY: as in `_run`: the pointer and count are those of a live contiguous
            // tensor that the caller references until this call returns.
            unsafe { c.run_raw(&call.0) }
        })
        .map_err(py_err)
    }

    /// Starts one collective on raw CUDA buffers of GPU `device`, ordered on the CUDA
    /// stream whose handle is `stream` (torch's current stream), and returns its `Work`
    /// (host-side completion). Work queued on that stream afterwards sees the result.
    /// `keepalive` is held until the operation completes, as for `_start`. With
    /// `ordered=False` the stream is not made to wait: the caller waits for the `Work` before
    /// the buffers are used again (torch's asynchronous point-to-point operations).
    #[pyo3(signature = (coll, dtype, send, recv, count, keepalive, device, stream, op=None, peer=0, timeout=None, ordered=true))]
    #[allow(clippy::too_many_arguments)]
    fn _start_device(
        &self,
        py: Python<'_>,
        coll: &str,
        dtype: &str,
        send: usize,
        recv: usize,
        count: usize,
        keepalive: Py<PyAny>,
        device: usize,
        stream: usize,
        op: Option<&str>,
        peer: usize,
        timeout: Option<f64>,
        ordered: bool,
    ) -> PyResult<PyWork> {
        let call = raw_call(coll, dtype, send, recv, count, op, (peer, 0, 0), timeout)?;
        let start = if ordered {
            Communicator::start_raw_device_on
        } else {
            Communicator::start_raw_device_unordered_on
        };
        let call = SendCall(call);
        self.pend_detached(py, coll, keepalive, move |c| {
            let call = call;
            // SAFETY: the torch backend passes the data pointers of live contiguous CUDA
            // tensors of `device`, held in `keepalive` until the operation completes (as in
            // `_start`), and the handle of torch's current stream of that device, which
            // torch never destroys. Ordered, later work on the tensors is queued on that
            // stream (torch's stream semantics), after the call; unordered only for
            // point-to-point calls, whose Work torch's contract has the user wait for (on the
            // host) before touching the tensors again.
            unsafe { start(c, &call.0, device, stream) }
        })
    }

    /// Starts one collective on raw buffers and returns its `Work`. `keepalive` (the
    /// objects owning the buffers) is held by the communicator until the operation
    /// completes, whatever happens to the `Work`.
    #[pyo3(signature = (coll, dtype, send, recv, count, keepalive, op=None, peer=0, timeout=None, peer2=0, count2=0))]
    #[allow(clippy::too_many_arguments)]
    fn _start(
        &self,
        coll: &str,
        dtype: &str,
        send: usize,
        recv: usize,
        count: usize,
        keepalive: Py<PyAny>,
        op: Option<&str>,
        peer: usize,
        timeout: Option<f64>,
        peer2: usize,
        count2: usize,
    ) -> PyResult<PyWork> {
        let call = raw_call(
            coll,
            dtype,
            send,
            recv,
            count,
            op,
            (peer, peer2, count2),
            timeout,
        )?;
        self.pend(coll, keepalive, |c| {
            // SAFETY: as in `_run`, the pointers are those of the objects in `keepalive`,
            // which `pend` holds until the operation completes.
            unsafe { c.start_raw(&call) }
        })
    }

    /// An all-to-all of blocks of any size (`Communicator::all_to_all_v`) on raw host buffers:
    /// `send_counts[j]` elements of `dtype` at `send` (blocks in rank order) to rank j,
    /// `recv_counts[i]` from rank i into `recv`. Started, its `Work` returned, with
    /// `keepalive` held until it completes (as `_start`); with `wait=True`, run to completion
    /// on this thread without the GIL first (as `_run`), and `None` returned.
    #[pyo3(signature = (dtype, send, send_counts, recv, recv_counts, keepalive, timeout=None, wait=false))]
    #[allow(clippy::too_many_arguments)]
    fn _all_to_all_v(
        &self,
        py: Python<'_>,
        dtype: &str,
        send: usize,
        send_counts: Vec<usize>,
        recv: usize,
        recv_counts: Vec<usize>,
        keepalive: Py<PyAny>,
        timeout: Option<f64>,
        wait: bool,
    ) -> PyResult<Option<PyWork>> {
        let dt = parse_dtype(dtype)?;
        let timeout = secs(timeout)?;
        if wait {
            let c = self.get()?;
            // Raw pointers are not Send; their addresses are.
            py.detach(move || {
                // SAFETY: as `_run`: the Python caller (dspark/_torch_collectives.py) passes
                // the data pointers of live contiguous tensors holding the counts' sums of
                // elements, which it references until this call returns.
                unsafe {
                    c.run_raw_all_to_all_v(
                        dt,
                        (send as *const u8, &send_counts),
                        (recv as *mut u8, &recv_counts),
                        timeout,
                    )
                }
            })
            .map_err(py_err)?;
            return Ok(None);
        }
        self.pend("all_to_all", keepalive, |c| {
            // SAFETY: as `_start`: the pointers are those of the tensors in `keepalive`,
            // which `pend` holds until the operation completes.
            unsafe {
                c.start_raw_all_to_all_v(
                    dt,
                    (send as *const u8, &send_counts),
                    (recv as *mut u8, &recv_counts),
                    timeout,
                )
            }
        })
        .map(Some)
    }

    /// all_to_all_v on CUDA memory: the tensors' data pointers on GPU `device`, ordered on the
    /// CUDA stream whose handle is `stream` (torch's current stream there). Runs to completion
    /// on this thread without the GIL (GPU buffers go through the device path, GPUDirect or
    /// host-staged: `info()["device_path"]`).
    #[pyo3(signature = (dtype, send, send_counts, recv, recv_counts, device, stream, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn _all_to_all_v_device(
        &self,
        py: Python<'_>,
        dtype: &str,
        send: u64,
        send_counts: Vec<usize>,
        recv: u64,
        recv_counts: Vec<usize>,
        device: usize,
        stream: usize,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let dt = parse_dtype(dtype)?;
        let timeout = secs(timeout)?;
        let c = self.get()?;
        let bytes = |counts: &[usize]| {
            counts
                .iter()
                .try_fold(0usize, |a, &k| a.checked_add(k))
                .and_then(|n| n.checked_mul(dt.size()))
                .ok_or_else(|| {
                    py_err(dspark::Error::invalid(
                        Some(c.rank()),
                        "all_to_all",
                        "the counts overflow",
                    ))
                })
        };
        let (sent, received) = (bytes(&send_counts)?, bytes(&recv_counts)?);
        py.detach(move || {
            // SAFETY: the Python caller (dspark/_torch_collectives.py) passes the data
            // pointers of live contiguous CUDA tensors of `device` holding the counts' sums
            // of elements, which it references until this call returns, and the handle of
            // torch's current stream of that device, which torch never destroys.
            unsafe {
                c.run_raw_all_to_all_v_device_on(
                    dt,
                    (send, sent),
                    &send_counts,
                    (recv, received),
                    &recv_counts,
                    device,
                    stream,
                    timeout,
                )
            }
        })
        .map_err(py_err)
    }

    /// Splits into sub-communicators, as `ncclCommSplit`: ranks with the same `colour` form
    /// one, ordered by `key` then by rank; `None` or a negative colour opts out (returns
    /// `None`). Collective over this communicator.
    #[pyo3(signature = (colour, key=0))]
    fn split(&self, py: Python<'_>, colour: Option<i32>, key: i32) -> PyResult<Option<Self>> {
        let c = self.get()?;
        py.detach(move || c.split(colour, key))
            .map(|o| o.map(PyComm::new))
            .map_err(py_err)
    }

    /// A communicator of this one's ranks minus `exclude`, as `ncclCommShrink`: every
    /// survivor calls it with the same excluded ranks, after a lost peer or an abort too.
    /// `abort`: this one is aborted first, once the excluded ranks were checked
    /// (`Communicator::shrink_aborting`).
    #[pyo3(signature = (exclude, abort=false))]
    fn shrink(&self, py: Python<'_>, exclude: Vec<usize>, abort: bool) -> PyResult<Self> {
        let c = self.get()?;
        py.detach(move || {
            if abort {
                c.shrink_aborting(&exclude)
            } else {
                c.shrink(&exclude)
            }
        })
        .map(PyComm::new)
        .map_err(py_err)
    }

    /// The flight record (the last operations; `DSPARK_FR_ENTRIES`) as the JSON text of
    /// the dump format, or `None` when the recorder is off. Never waits for an operation.
    fn flight_record_json(&self) -> PyResult<Option<String>> {
        Ok(self.get()?.flight_record().map(|r| r.to_json()))
    }

    /// Writes the flight record into `dir` (created if missing) as `DSPARK_FR_DUMP` does
    /// (`rank<r>.json`, or `rank<r>.c<k>.<id>.json` for this process's further
    /// communicators), for `dspark analyze dir`; returns the file, or `None` when the
    /// recorder is off. Never waits for an operation.
    fn write_flight_record(&self, dir: std::path::PathBuf) -> PyResult<Option<String>> {
        let Some(rec) = self.get()?.flight_record() else {
            return Ok(None);
        };
        rec.write_to(&dir, "on_demand")
            .map(|p| Some(p.display().to_string()))
            .map_err(|e| {
                pyo3::exceptions::PyOSError::new_err(format!(
                    "cannot write the flight record into {}: {e}",
                    dir.display()
                ))
            })
    }

    /// Makes every operation in flight and every later one fail with `AbortedError` on this
    /// rank, and tells the peers. Any thread, any time; returns at once.
    fn abort(&self) {
        if let Some(c) = self
            .comm
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        {
            c.abort();
        }
    }

    /// Closes the communicator: runs what was issued to completion (each by its deadline),
    /// says goodbye to the peers, stops the progress thread. Later calls fail.
    fn close(&self, py: Python<'_>) {
        let c = self
            .comm
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(c) = c {
            let last = py.detach(move || Arc::try_unwrap(c).map(drop).is_ok());
            if last {
                lock(&self.pending).clear();
            }
        }
    }

    /// Whether the communicator is closed.
    #[getter]
    fn closed(&self) -> bool {
        self.comm
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }

    /// The error that poisoned the communicator, if one did (as text).
    fn poisoned(&self) -> PyResult<Option<String>> {
        Ok(self.get()?.poisoned().map(|e| e.to_string()))
    }

    fn __repr__(&self) -> String {
        format!(
            "<dspark._dspark.Communicator rank {}/{}>",
            self.rank, self.world
        )
    }
}

/// `RawCall` holds raw pointers, which are not `Send`; the closure that carries it to the
/// detached section runs before `_run` returns, while the buffers are alive.
struct SendCall(RawCall);
// SAFETY: the pointers are only dereferenced by `run_raw` inside `_run`'s detached section,
// or by the device start inside `_start_device`'s, whose contracts (above) keep the buffers
// alive; nothing else is shared.
unsafe impl Send for SendCall {}

// -------------------------------------------------------------------------------- Work

/// A non-blocking operation in flight (`dspark._dspark.Work`).
#[pyclass(module = "dspark._dspark", name = "Work", frozen)]
struct PyWork {
    w: Arc<dspark::Work>,
    what: String,
}

impl std::fmt::Debug for PyWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Work({})", self.what)
    }
}

#[pymethods]
impl PyWork {
    /// `True` once the operation completed, `False` while it is in flight; raises its
    /// error if it failed. Never blocks.
    fn test(&self) -> PyResult<bool> {
        self.w.test().map_err(py_err)
    }

    /// Whether the operation finished, successfully or not. Never blocks, never raises.
    fn is_completed(&self) -> bool {
        !matches!(self.w.test(), Ok(false))
    }

    /// Waits for the operation, without the GIL, and raises its error. Without `timeout`
    /// the operation's own deadline bounds the wait, and this thread runs the operation when
    /// no other does (`Work::wait`: no wake-up of the progress thread, which a bounded wait
    /// costs, ~25 µs on a VM); with one, `TimeoutError` after `timeout` seconds means it is
    /// still in flight (it goes on).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let t = secs(timeout)?;
        let w = Arc::clone(&self.w);
        py.detach(move || match t {
            Some(t) => w.wait_timeout(t),
            None => w.wait(),
        })
        .map_err(py_err)
    }

    /// Where the operation stands while in flight (`None` once it ended): queued behind
    /// which running call and how many more, or running as which call (`all_reduce #17`) and
    /// for how long. Never blocks; `wait(timeout)`'s `TimeoutError` carries the same words.
    fn whereabouts(&self) -> Option<String> {
        self.w.whereabouts()
    }

    fn __repr__(&self) -> String {
        let state = match self.w.test() {
            Ok(false) => "in flight",
            Ok(true) => "done",
            Err(_) => "failed",
        };
        format!("<dspark._dspark.Work {} {state}>", self.what)
    }
}

// ------------------------------------------------------------------------------ buffers

/// CPython's `Py_buffer` (PEP 3118). PyO3's buffer API is not part of the abi3-py39
/// limited API it builds against (the buffer functions entered the stable ABI in 3.11),
/// so the two functions below are declared here: every CPython 3 exports them, and this
/// struct's layout has been the same since 3.3 (it is the stable ABI's from 3.11 on).
#[repr(C)]
struct RawBuffer {
    buf: *mut std::ffi::c_void,
    obj: *mut pyo3::ffi::PyObject,
    len: pyo3::ffi::Py_ssize_t,
    itemsize: pyo3::ffi::Py_ssize_t,
    readonly: std::ffi::c_int,
    ndim: std::ffi::c_int,
    format: *mut std::ffi::c_char,
    shape: *mut pyo3::ffi::Py_ssize_t,
    strides: *mut pyo3::ffi::Py_ssize_t,
    suboffsets: *mut pyo3::ffi::Py_ssize_t,
    internal: *mut std::ffi::c_void,
}

/// `PyBUF_WRITABLE`: the request fails on a read-only buffer.
const PYBUF_WRITABLE: std::ffi::c_int = 0x0001;

extern "C" {
    fn PyObject_GetBuffer(
        obj: *mut pyo3::ffi::PyObject,
        view: *mut RawBuffer,
        flags: std::ffi::c_int,
    ) -> std::ffi::c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

/// The address of the memory a `memoryview` shows, for `dspark/_buffers.py`, which keeps
/// the view (and with it the exporter's promise not to move or free that memory) for as
/// long as dspark uses the address. The view must be C-contiguous (`PyBUF_SIMPLE`), and
/// writable when `writable`; otherwise the exporter's `BufferError` is raised. The address
/// is the exporter's, never a number a Python object claimed.
#[pyfunction]
fn _buffer_address(view: &Bound<'_, PyMemoryView>, writable: bool) -> PyResult<usize> {
    let mut raw = std::mem::MaybeUninit::<RawBuffer>::zeroed();
    let flags = if writable { PYBUF_WRITABLE } else { 0 };
    // SAFETY: `view` is a live memoryview (the GIL is held through `Bound`) and `raw` a
    // writable `Py_buffer` of CPython's layout; on success CPython filled it in and holds
    // a reference for it, which `PyBuffer_Release` below gives back exactly once.
    let rc = unsafe { PyObject_GetBuffer(view.as_ptr(), raw.as_mut_ptr(), flags) };
    if rc != 0 {
        return Err(PyErr::fetch(view.py()));
    }
    // SAFETY: `PyObject_GetBuffer` returned 0, so it initialised `raw`.
    let mut raw = unsafe { raw.assume_init() };
    let addr = raw.buf as usize;
    // SAFETY: `raw` was filled by the successful `PyObject_GetBuffer` above and is
    // released once; the memory stays exported by `view` itself, which the caller keeps.
    unsafe { PyBuffer_Release(&mut raw) };
    Ok(addr)
}

/// The module.
#[pymodule]
fn _dspark(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // dspark's warnings — every degraded path (GPUDirect that falls back to staging, device
    // calls that run as blocking ones, a forced algorithm that does not apply, a link probe
    // that failed) — to stderr as the binaries print them, filtered by DSPARK_LOG (levels and
    // target=level) as it is at import (`off` silences them; `dspark=debug` says more).
    dspark::internals::stderr_log::install();
    m.add_class::<PyComm>()?;
    m.add_class::<PyWork>()?;
    m.add_function(wrap_pyfunction!(_buffer_address, m)?)?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("TimeoutError", py.get_type::<TimeoutError>())?;
    m.add("PeerLostError", py.get_type::<PeerLostError>())?;
    m.add("MismatchError", py.get_type::<MismatchError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("IoError", py.get_type::<IoError>())?;
    m.add("AbortedError", py.get_type::<AbortedError>())?;
    m.add("UnavailableError", py.get_type::<UnavailableError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("_FAST_DTYPES", FAST_DTYPES.map(|d| d.rust_name()).to_vec())?;
    m.add("_FAST_OPS", FAST_OPS.map(|o| o.name()).to_vec())?;
    Ok(())
}
