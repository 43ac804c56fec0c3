//! **GPU-only code**: what orders a non-blocking device collective on the caller's stream
//! while the host returns at once (stream-ordered, as NCCL's collectives are).
//!
//! A device collective issued with [`crate::Communicator::enqueue`] on the caller's stream `S`:
//!
//! 1. **At issue**, on the caller's thread: an event `E` is recorded on `S` (it completes
//!    when the work queued on `S` before the call has), and `S` is made to wait until this
//!    GPU's [`Doorbell`] word reaches the call's ticket number (`cuStreamWaitValue32`,
//!    greater-or-equal, cyclic): work queued on `S` after the call starts only once the
//!    collective is complete. Nothing blocks the host.
//! 2. **On the communicator's queue**, in issue order with every other operation, whoever
//!    drives it (the progress thread, or a waiter) makes the communicator's own stream `I`
//!    of that GPU wait for `E`, runs the collective on `I` exactly as a blocking device call
//!    runs it on the caller's stream, and waits for `I` (the device's drop).
//! 3. **Then the ticket rings the doorbell**, and `S` goes on.
//!
//! The doorbell rings on *every* outcome — success, failure, abort, an operation failed or
//! dropped without running — because the ring is the [`Ticket`]'s `Drop`: a caller's stream
//! never waits forever (after a failure its buffers hold unspecified data and the `Work`
//! carries the error). Tickets are handed out and queued under one lock, so ticket order is
//! queue order, and the queue consumes operations in that order: the word only moves forward.
//!
//! The doorbell is one 32-bit word of pinned, device-mapped host memory per GPU and
//! communicator; the host writes it, the GPU's stream front end reads it.

#![allow(unsafe_code)]

use std::sync::{Arc, Mutex, MutexGuard};

use std::marker::PhantomData;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};

use super::cuda::driver::{
    self, driver_err, require_driver_symbols, CUdeviceptr, CU_MEMHOSTALLOC_DEVICEMAP,
    CU_MEMHOSTALLOC_PORTABLE,
};
use crate::error::Result;

pub(crate) use super::cuda::driver::copy_dtod_async;

/// The driver functions a doorbell needs (checked before the first use: cudarc panics on a
/// missing symbol).
const SYMBOLS: [&str; 4] = [
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostGetDevicePointer_v2",
    "cuStreamWaitValue32_v2",
];

/// One word of pinned host memory that streams of one GPU wait on (see the module docs).
#[derive(Debug)]
pub(crate) struct Doorbell {
    ctx: Arc<CudaContext>,
    /// The word, as the host writes it (`cuMemHostAlloc`, device-mapped).
    host: *mut u32,
    /// The same word as the GPU reads it.
    dev: CUdeviceptr,
    /// The last ticket handed out: the issue lock, held while a ticket is issued and its
    /// operation queued, so that ticket order is queue order.
    issued: Mutex<u32>,
    /// The last value rung: the word's own lock (a separate one, so that a ticket may ring
    /// while another thread issues).
    rung: Mutex<u32>,
    /// An event after each stream's latest wait on the word: the word may only be freed once
    /// every stream has read it for the last time (see `Drop`).
    passed: Mutex<Vec<CudaEvent>>,
    /// An event could not be recorded after a wait: the word is never freed.
    leak: std::sync::atomic::AtomicBool,
    /// Events for the issue side (the caller's stream's position at issue, the end of its
    /// wait), made with the doorbell and reused, so that issuing creates none in the usual
    /// case: creating one takes a CUDA context lock that another thread of the process,
    /// blocked in a copy from a stream waiting on this doorbell, may hold (see
    /// `staged::Marks`).
    spare: Mutex<Vec<CudaEvent>>,
    /// The spare events ran out once (said once).
    spare_out: std::sync::atomic::AtomicBool,
}

/// Events a doorbell starts with: two per queued call (its start and the end of the stream's
/// wait) until it ran, for DDP's dozens of buckets queued in one backward pass.
const SPARE_EVENTS: usize = 64;

// SAFETY: the word is ordinary pinned process memory, written only under the `rung` lock
// and read by the GPU; the context handle is thread-safe (cudarc's `CudaContext` is
// Send + Sync). Nothing else is shared.
unsafe impl Send for Doorbell {}
// SAFETY: as above: every host access to the word happens under the lock.
unsafe impl Sync for Doorbell {}

/// `a` is after `b` in the cyclic order of 32-bit ticket numbers (as the GPU compares them).
fn after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

impl Doorbell {
    /// A doorbell on `ctx`'s GPU, at 0.
    ///
    /// # Errors
    /// [`Error::Unavailable`](crate::error::Error::Unavailable) when the driver lacks the
    /// functions; [`Error::Cuda`](crate::error::Error::Cuda) when the allocation fails.
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        require_driver_symbols(&SYMBOLS)?;
        ctx.bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        let flags = CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE;
        // The symbols were checked and a context is current: at least 4 bytes (64) of
        // page-locked, device-mapped memory, never null.
        let p = driver::mem_host_alloc(64, flags)?;
        let host = p.cast::<u32>();
        // SAFETY: `host` points to 64 live bytes just allocated, suitably aligned (page).
        unsafe { host.write_volatile(0) };
        // `p` is a device-mapped host allocation of this context.
        let dev = match driver::mem_host_get_device_pointer(p) {
            Ok(dev) => dev,
            Err(e) => {
                // SAFETY: `p` came from cuMemHostAlloc and is freed once, here.
                unsafe { driver::mem_free_host(p) };
                return Err(e);
            }
        };
        let spare = match super::staged::new_events(ctx, SPARE_EVENTS) {
            Ok(v) => v,
            Err(e) => {
                // SAFETY: `p` came from cuMemHostAlloc and is freed once, here.
                unsafe { driver::mem_free_host(p) };
                return Err(e);
            }
        };
        Ok(Doorbell {
            ctx: ctx.clone(),
            host,
            dev,
            issued: Mutex::new(0),
            rung: Mutex::new(0),
            passed: Mutex::new(Vec::new()),
            leak: std::sync::atomic::AtomicBool::new(false),
            spare: Mutex::new(spare),
            spare_out: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// An event recorded at the current end of `stream`: a spare one, or a new one when
    /// every spare is in use. Give it back with [`Doorbell::give_back`].
    pub(crate) fn recorded(&self, stream: &CudaStream) -> Result<CudaEvent> {
        let spare = self.spare.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let ev = match spare {
            Some(ev) => ev,
            None => {
                if !self
                    .spare_out
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::warn!(
                        "more than {SPARE_EVENTS} non-blocking device calls in flight on GPU {}: \
                         events are now made as calls are issued, which can wait on a CUDA \
                         lock held by a thread blocked in a copy from a stream",
                        self.ctx.ordinal()
                    );
                }
                self.ctx
                    .new_event(None)
                    .map_err(driver_err("cuEventCreate"))?
            }
        };
        match ev.record(stream) {
            Ok(()) => Ok(ev),
            Err(e) => {
                self.give_back(ev);
                Err(driver_err("cuEventRecord")(e))
            }
        }
    }

    /// Returns an event of [`Doorbell::recorded`] once nothing waits on it any more (a
    /// stream that was made to wait for it keeps waiting for that record).
    pub(crate) fn give_back(&self, ev: CudaEvent) {
        self.spare
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(ev);
    }

    /// Takes the issue lock: hold it from [`Issue::ticket`] until the operation is queued.
    pub(crate) fn issue(self: &Arc<Self>) -> Issue<'_> {
        Issue {
            bell: self,
            issued: lock(&self.issued),
        }
    }

    /// Moves the word forward to `seq` (never back).
    fn ring(&self, seq: u32) {
        let mut rung = lock(&self.rung);
        if after(seq, *rung) {
            *rung = seq;
            // SAFETY: the word is live for as long as `self`, and written only under the lock.
            unsafe { self.host.write_volatile(seq) };
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// How long a dropped doorbell waits for the streams that waited on it to have read it for
/// the last time before it gives up and leaks the word instead of freeing it.
const FREE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl Drop for Doorbell {
    fn drop(&mut self) {
        // Every ticket holds an `Arc` of its doorbell, so every ticket has rung: no stream
        // waits for a value that will never come. But a stream may not have *read* the word
        // yet (its wait is behind other work): free it only once every stream got past its
        // last wait, within FREE_WAIT; otherwise leak it (one pinned page) and say so.
        let passed = std::mem::take(&mut *self.passed.lock().unwrap_or_else(|e| e.into_inner()));
        let until = std::time::Instant::now() + FREE_WAIT;
        let mut all = true;
        for ev in &passed {
            while !ev.try_is_complete().unwrap_or(true) {
                if std::time::Instant::now() >= until {
                    all = false;
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        if !all || self.leak.load(std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                "a CUDA stream has not passed (or could not be tracked past) its wait on a dropped communicator's doorbell \
                 within {FREE_WAIT:?} (work queued ahead of it is still running): leaking \
                 the doorbell's pinned page instead of freeing memory the GPU may still read"
            );
            return;
        }
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc in `new`, freed exactly once; every stream
            // that waited on it has passed its wait (above).
            unsafe { driver::mem_free_host(self.host.cast()) };
        }
    }
}

fn lock(m: &Mutex<u32>) -> MutexGuard<'_, u32> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The doorbell's issue lock (see [`Doorbell::issue`]).
#[derive(Debug)]
pub(crate) struct Issue<'a> {
    bell: &'a Arc<Doorbell>,
    issued: MutexGuard<'a, u32>,
}

impl Issue<'_> {
    /// The next ticket: `stream` waits (on the GPU) until it rings.
    ///
    /// # Errors
    /// The driver's error when the wait cannot be queued — for example on a GPU without
    /// stream memory operations (`CUDA_ERROR_NOT_SUPPORTED`). The ticket number is used up
    /// and rung at once, so later tickets still ring in order.
    pub(crate) fn ticket(&mut self, stream: &CudaStream) -> Result<Ticket> {
        let seq = self.issued.wrapping_add(1);
        *self.issued = seq;
        stream
            .context()
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))
            .and_then(|()| {
                // SAFETY: the symbol was checked in `new`; the stream belongs to the
                // doorbell's context (the caller checked the ordinal) and the address is the
                // device mapping of the live word.
                unsafe { driver::stream_wait_value32_geq(stream, self.bell.dev, seq) }
            })
            .inspect_err(|_| self.bell.ring(seq))?;
        // Remembered until the word is freed; events of waits already passed are dropped.
        let mut passed = self.bell.passed.lock().unwrap_or_else(|e| e.into_inner());
        let (done, running): (Vec<CudaEvent>, Vec<CudaEvent>) = std::mem::take(&mut *passed)
            .into_iter()
            .partition(|e| e.try_is_complete().unwrap_or(true));
        *passed = running;
        for e in done {
            self.bell.give_back(e);
        }
        match self.bell.recorded(stream) {
            Ok(e) => passed.push(e),
            // Without the event the word can never be known unread: never free it.
            Err(_) => self
                .bell
                .leak
                .store(true, std::sync::atomic::Ordering::Relaxed),
        }
        drop(passed);
        Ok(Ticket {
            bell: Arc::clone(self.bell),
            seq,
        })
    }
}

/// A queued device operation's place in its GPU's doorbell order: rings when dropped.
#[derive(Debug)]
pub(crate) struct Ticket {
    bell: Arc<Doorbell>,
    seq: u32,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.bell.ring(self.seq);
    }
}

/// A device buffer by address, for work the communicator queues on its own stream after the
/// caller's stream was made to wait for it (see the module docs): cudarc's per-buffer
/// bookkeeping was done on the caller's stream at issue, so none is done here.
///
/// Only built by the non-blocking device path, whose queued operation owns it while the
/// caller's stream (and with it every later use of the memory queued there) waits for that
/// operation's doorbell. A free is another matter: CUDA treats memory as freed when the free
/// is *issued* on the host, even a stream-ordered one, so the caller must not free it before
/// the operation's `Work` completed (the contract of `Communicator::enqueue` and of the raw
/// device entry points).
#[derive(Debug)]
pub(crate) struct Raw<T> {
    ptr: CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    _t: PhantomData<fn() -> T>,
}

impl<T> Raw<T> {
    /// `len` elements of `T` at `ptr`, used on `stream`.
    pub(crate) fn new(ptr: CUdeviceptr, len: usize, stream: &Arc<CudaStream>) -> Self {
        Raw {
            ptr,
            len,
            stream: Arc::clone(stream),
            _t: PhantomData,
        }
    }
}

impl<T> DeviceSlice<T> for Raw<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for Raw<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for Raw<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

#[cfg(test)]
mod tests {
    use super::after;

    #[test]
    fn ticket_order_is_cyclic_like_the_gpus_comparison() {
        assert!(after(2, 1));
        assert!(!after(1, 2));
        assert!(!after(7, 7));
        // Across the wrap: 0 and 3 come after u32::MAX, as CU_STREAM_WAIT_VALUE_GEQ's
        // "(int32_t)(*addr - value) >= 0" sees them.
        assert!(after(0, u32::MAX));
        assert!(after(3, u32::MAX - 5));
        assert!(!after(u32::MAX, 0));
    }
}
