//! Non-blocking collectives on borrowed buffers: [`Communicator::scope`].

use std::marker::PhantomData;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use super::raw::RawBuffers;
use super::work::{Completion, Work};
use super::{Communicator, HostOp};
use crate::error::Result;
use crate::types::{Element, ReduceOp};

/// Started operations kept before the finished ones are pruned.
const PRUNE_AT: usize = 64;

/// A scope for non-blocking collectives on borrowed buffers ([`Communicator::scope`]).
///
/// Each method starts its operation and returns a [`Work`] at once; the operation runs on the
/// communicator's progress thread, after every operation issued before it, while the caller
/// goes on computing. The buffers stay borrowed until the scope ends, and the scope does not
/// end before every operation started in it has completed.
///
/// The borrow checker enforces what the library relies on. A buffer cannot be touched while
/// an operation on it may still run, even after its `Work` is forgotten:
///
/// ```compile_fail
/// # use dspark::{Communicator, ReduceOp};
/// # fn f(comm: &Communicator) -> dspark::Result<()> {
/// let mut grads = vec![1.0f32; 1024];
/// comm.scope(|s| -> dspark::Result<()> {
///     let w = s.all_reduce(&mut grads, ReduceOp::Sum)?;
///     std::mem::forget(w);
///     grads[0] = 2.0; // error: `grads` is still borrowed by the operation
///     Ok(())
/// })
/// # }
/// ```
///
/// nor freed before the scope has waited for it — a buffer made inside the scope cannot be
/// lent to an operation at all:
///
/// ```compile_fail
/// # use dspark::{Communicator, ReduceOp};
/// # fn f(comm: &Communicator) -> dspark::Result<()> {
/// comm.scope(|s| -> dspark::Result<()> {
///     let mut tmp = vec![1.0f32; 1024];
///     let w = s.all_reduce(&mut tmp, ReduceOp::Sum)?; // error: `tmp` does not live long enough
///     std::mem::forget(w);
///     drop(tmp);
///     Ok(())
/// })
/// # }
/// ```
///
/// while the same code with the buffer outside the scope compiles and is sound:
///
/// ```no_run
/// # use dspark::{Communicator, ReduceOp};
/// # fn f(comm: &Communicator) -> dspark::Result<()> {
/// let mut grads = vec![1.0f32; 1024];
/// comm.scope(|s| -> dspark::Result<()> {
///     let w = s.all_reduce(&mut grads, ReduceOp::Sum)?;
///     std::mem::forget(w); // the scope still waits for the operation
///     Ok(())
/// })?;
/// grads[0] = 2.0; // the library is done with `grads`
/// # Ok(())
/// # }
/// ```
pub struct Scope<'scope, 'env: 'scope> {
    comm: &'env Communicator,
    started: Mutex<Vec<Arc<Completion>>>,
    // Invariant in 'scope and 'env, as std::thread::Scope.
    scope: PhantomData<&'scope mut &'scope ()>,
    env: PhantomData<&'env mut &'env ()>,
}

impl std::fmt::Debug for Scope<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope")
            .field("rank", &self.comm.rank())
            .finish()
    }
}

impl Communicator {
    /// Runs `f` with a [`Scope`] in which collectives can be started without blocking, on
    /// buffers borrowed from outside the scope; returns once `f` has returned **and** every
    /// operation started in the scope has completed (successfully or not; the errors are
    /// reported by each [`Work`]).
    ///
    /// This is what makes the non-blocking API sound: as with [`std::thread::scope`], the
    /// borrow of every buffer outlives the operations on it, whatever happens to their
    /// `Work` handles (dropped, forgotten or waited for) and even when `f` panics.
    ///
    /// ```no_run
    /// use dspark::{Communicator, ReduceOp};
    /// # fn compute(_: usize) {}
    /// # fn main() -> dspark::Result<()> {
    /// let comm = Communicator::from_env()?;
    /// let mut buckets = vec![vec![1.0f32; 1 << 20]; 4];
    /// comm.scope(|s| {
    ///     let mut works = Vec::new();
    ///     for (i, b) in buckets.iter_mut().enumerate() {
    ///         works.push(s.all_reduce(b, ReduceOp::Avg)?); // returns at once
    ///         compute(i); // overlaps with the allreduce of bucket i
    ///     }
    ///     works.into_iter().try_for_each(|w| w.wait())
    /// })?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn scope<'env, F, R>(&'env self, f: F) -> R
    where
        F: for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> R,
    {
        let scope = Scope {
            comm: self,
            started: Mutex::new(Vec::new()),
            scope: PhantomData,
            env: PhantomData,
        };
        let r = catch_unwind(AssertUnwindSafe(|| f(&scope)));
        scope.join();
        match r {
            Ok(r) => r,
            Err(p) => resume_unwind(p),
        }
    }
}

impl<'scope> Scope<'scope, '_> {
    /// Waits for every operation started in the scope.
    fn join(&self) {
        let started = std::mem::take(&mut *self.started.lock().unwrap_or_else(|e| e.into_inner()));
        for c in started {
            // Each operation ends by its own deadline (or promptly after an abort).
            let w = Work::new(&self.comm.shared, c, "operation of a scope");
            let _ = w.wait();
        }
    }

    fn start(&self, op: Result<HostOp<'scope>>) -> Result<Work> {
        let op = op?;
        if let Some(w) = self.comm.empty_work(&op.call, None) {
            // Nothing borrowed: no need to track it for `join`.
            return Ok(w);
        }
        let what = op.call.coll.name();
        let bufs = RawBuffers::from_slices(op.call, op.src, op.dst);
        #[allow(unsafe_code)]
        // SAFETY: the buffers are borrowed for 'scope, which outlives `Communicator::scope`'s
        // call of `join`, and `join` returns only once this operation has completed (every
        // operation completes: by success, its deadline or an abort). Until then the borrow
        // keeps everybody else away from them: exactly `RawBuffers::run`'s contract.
        let work = unsafe { self.comm.submit_raw(bufs, None, what) };
        Ok(self.track(work))
    }

    /// Keeps `work`'s completion for `join` (operations on borrowed buffers only).
    fn track(&self, work: Work) -> Work {
        let mut started = self.started.lock().unwrap_or_else(|e| e.into_inner());
        if started.len() >= PRUNE_AT {
            started.retain(|c| c.get().is_none());
        }
        started.push(Arc::clone(work.completion()));
        work
    }

    /// Starts [`Communicator::all_reduce`].
    ///
    /// # Errors
    /// Argument errors at once; the operation's errors from its [`Work`].
    pub fn all_reduce<T: Element>(&self, buf: &'scope mut [T], op: ReduceOp) -> Result<Work> {
        self.start(self.comm.op_all_reduce(buf, op))
    }

    /// Starts [`Communicator::all_gather`].
    ///
    /// # Errors
    /// As [`Scope::all_reduce`].
    pub fn all_gather<T: Element>(&self, send: &'scope [T], recv: &'scope mut [T]) -> Result<Work> {
        self.start(self.comm.op_all_gather(send, recv))
    }

    /// Starts [`Communicator::reduce_scatter`].
    ///
    /// # Errors
    /// As [`Scope::all_reduce`].
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &'scope [T],
        recv: &'scope mut [T],
        op: ReduceOp,
    ) -> Result<Work> {
        self.start(self.comm.op_reduce_scatter(send, recv, op))
    }

    /// Starts [`Communicator::all_to_all`].
    ///
    /// # Errors
    /// As [`Scope::all_reduce`].
    pub fn all_to_all<T: Element>(&self, send: &'scope [T], recv: &'scope mut [T]) -> Result<Work> {
        self.start(self.comm.op_all_to_all(send, recv))
    }

    /// Starts [`Communicator::all_to_all_v`]. The counts are copied.
    ///
    /// # Errors
    /// `InvalidArgument` at once when the counts are not one per rank, do not add up to the
    /// buffers' lengths or differ for this rank's own block; the operation's errors from its
    /// [`Work`].
    pub fn all_to_all_v<T: Element>(
        &self,
        send: &'scope [T],
        send_counts: &[usize],
        recv: &'scope mut [T],
        recv_counts: &[usize],
    ) -> Result<Work> {
        let (rank, n) = (self.comm.rank(), self.comm.world_size());
        let counts = (send_counts, recv_counts);
        let bytes = Some((size_of_val(send), size_of_val(recv)));
        crate::engine::v_check((rank, n), T::DATA_TYPE, counts, bytes)?;
        let (src, dst) = (send.as_ptr().cast::<u8>(), recv.as_mut_ptr().cast::<u8>());
        #[allow(unsafe_code)]
        // SAFETY: the counts add up to exactly the slices' lengths (checked above), so `src`
        // is valid for reads and `dst` for reads and writes of what they describe. Both are
        // borrowed for 'scope, which outlives `join`, and `join` returns only once the
        // operation has completed; until then the borrows keep everybody else away from them.
        let work = unsafe {
            self.comm.start_raw_all_to_all_v(
                T::DATA_TYPE,
                (src, send_counts),
                (dst, recv_counts),
                None,
            )?
        };
        Ok(self.track(work))
    }

    /// Starts [`Communicator::broadcast`].
    ///
    /// # Errors
    /// As [`Scope::all_reduce`].
    pub fn broadcast<T: Element>(&self, buf: &'scope mut [T], root: usize) -> Result<Work> {
        self.start(self.comm.op_broadcast(buf, root))
    }

    /// Starts [`Communicator::reduce`].
    ///
    /// # Errors
    /// As [`Scope::all_reduce`].
    pub fn reduce<T: Element>(
        &self,
        buf: &'scope mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<Work> {
        self.start(self.comm.op_reduce(buf, op, root))
    }

    /// Starts [`Communicator::send`].
    ///
    /// # Errors
    /// As [`Scope::all_reduce`].
    pub fn send<T: Element>(&self, buf: &'scope [T], peer: usize) -> Result<Work> {
        self.start(self.comm.op_send(buf, peer))
    }

    /// Starts [`Communicator::recv`].
    ///
    /// # Errors
    /// As [`Scope::all_reduce`].
    pub fn recv<T: Element>(&self, buf: &'scope mut [T], peer: usize) -> Result<Work> {
        self.start(self.comm.op_recv(buf, peer))
    }

    /// Starts [`Communicator::send_recv`]. Use it, not a [`Scope::send`] and a
    /// [`Scope::recv`], for an exchange: operations run in issue order, so a send and a
    /// receive started together on both ranks of a swap wait on each other once the message
    /// outgrows what the transport buffers.
    ///
    /// # Errors
    /// As [`Scope::all_reduce`].
    pub fn send_recv<T: Element>(
        &self,
        send: &'scope [T],
        to: usize,
        recv: &'scope mut [T],
        from: usize,
    ) -> Result<Work> {
        self.start(self.comm.op_send_recv(send, to, recv, from))
    }

    /// Starts [`Communicator::barrier`].
    ///
    /// # Errors
    /// As [`Scope::all_reduce`].
    pub fn barrier(&self) -> Result<Work> {
        self.start(Ok(self.comm.op_barrier()))
    }
}
