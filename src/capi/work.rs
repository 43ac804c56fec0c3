//! Work handles: waiting for an operation in flight (at most for a while), polling it, asking
//! where it is, freeing the handle.

use std::ffi::{c_char, c_int};
use std::time::Duration;

use super::boundary::{copy_out, guard, guard_keeping, invalid};
use super::{dspark_result_t, dspark_work_t, WorkState};
use crate::error::Error;

/// The work handle behind `work`, or an argument error.
///
/// # Safety
/// `work` is NULL or a live handle used by no other thread.
unsafe fn work_mut<'a>(
    work: *mut dspark_work_t,
    func: &str,
) -> Result<&'a mut dspark_work_t, Error> {
    // SAFETY: NULL or live and not shared (contract).
    unsafe { work.as_mut() }.ok_or_else(|| invalid(None, func, "work is NULL"))
}

/// Polls the operation behind `h` once: its result once it is complete (then kept in `h`, so
/// that later calls answer the same), `None` while it is in flight.
fn settle(h: &mut dspark_work_t) -> Option<Result<(), Error>> {
    let r = match &h.state {
        WorkState::Done(r) => return Some(r.clone()),
        WorkState::Pending(w) => match w.test() {
            Ok(false) => return None,
            Ok(true) => Ok(()),
            Err(e) => Err(e),
        },
    };
    h.state = WorkState::Done(r.clone());
    Some(r)
}

/// Waits for the operation of `work` and returns its result. It cannot wait forever: the
/// operation fails by its deadline. May be called again (and `dspark_work_test` after it):
/// it returns the same result. The handle must still be freed with `dspark_work_free`.
///
/// # Safety
/// `work` is NULL (refused) or a live handle that no other thread is using.
#[no_mangle]
pub unsafe extern "C" fn dspark_work_wait(work: *mut dspark_work_t) -> dspark_result_t {
    const F: &str = "dspark_work_wait";
    guard(F, || {
        // SAFETY: NULL or live, used by this thread only (contract).
        let h = unsafe { work_mut(work, F) }?;
        // (If waiting panicked, the handle would keep this placeholder.)
        let placeholder = WorkState::Done(Err(Error::Transport {
            rank: None,
            peer: None,
            op: F.into(),
            what: "internal error: waiting for the operation panicked".into(),
        }));
        let state = std::mem::replace(&mut h.state, placeholder);
        let r = match state {
            WorkState::Pending(w) => w.wait(),
            WorkState::Done(r) => r,
        };
        h.state = WorkState::Done(r.clone());
        r
    })
}

/// Polls the operation of `work` without blocking: `*done` is 1 once it is complete (then its
/// buffers are free again), 0 while it is in flight. When it completed with an error, `*done`
/// is 1 and the error is returned.
///
/// # Safety
/// `work` is NULL (refused) or a live handle that no other thread is using; `done` is NULL
/// (refused) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn dspark_work_test(
    work: *mut dspark_work_t,
    done: *mut c_int,
) -> dspark_result_t {
    const F: &str = "dspark_work_test";
    guard(F, || {
        // SAFETY: NULL or live, used by this thread only (contract).
        let h = unsafe { work_mut(work, F) }?;
        if done.is_null() {
            return Err(invalid(None, F, "done is NULL"));
        }
        let r = settle(h);
        // SAFETY: non-null (checked above) and valid for a write (contract).
        unsafe { done.write(c_int::from(r.is_some())) };
        r.unwrap_or(Ok(()))
    })
}

/// Frees a work handle; NULL is ignored. It leaves `dspark_last_error` as it was (wait, free,
/// then read the wait's error). Freeing the handle of an operation still in flight
/// does not cancel it: the operation runs to completion in issue order, and its buffers must
/// stay valid and untouched until then. So free a handle once `dspark_work_wait` returned
/// or `dspark_work_test` reported it done, unless the buffers outlive the communicator's
/// operations anyway (they are complete once `dspark_comm_destroy` returns).
///
/// # Safety
/// `work` is NULL or a live handle that no other thread is using; it is invalid afterwards.
#[no_mangle]
pub unsafe extern "C" fn dspark_work_free(work: *mut dspark_work_t) {
    let _ = guard_keeping("dspark_work_free", || {
        if !work.is_null() {
            // SAFETY: a pointer from `Box::into_raw` in this ABI, not yet freed, used by
            // nobody else (contract).
            drop(unsafe { Box::from_raw(work) });
        }
        Ok(())
    });
}

/// Waits at most `timeout_ms` milliseconds for the operation of `work`. Once it is complete
/// this returns its result, as `dspark_work_wait` does (and both may be asked again). When it
/// is still in flight at the end, this returns `DSPARK_ERR_TIMEOUT` and `dspark_last_error`
/// says where the operation is (what it waits for, as `dspark_work_whereabouts` tells); the
/// operation is not cancelled and the handle stays in flight: wait again, poll, or free it
/// (its buffers stay the operation's until it completes). An operation that failed by its
/// own deadline (`DSPARK_TIMEOUT`) returns `DSPARK_ERR_TIMEOUT` too, complete: after that
/// code, `dspark_work_test`'s `*done` (1: complete, the buffers free again) tells the two
/// apart. This is torch's `Work.wait(timeout)`; `timeout_ms` 0 polls once.
///
/// # Safety
/// `work` is NULL (refused) or a live handle that no other thread is using.
#[no_mangle]
pub unsafe extern "C" fn dspark_work_wait_timeout(
    work: *mut dspark_work_t,
    timeout_ms: u64,
) -> dspark_result_t {
    const F: &str = "dspark_work_wait_timeout";
    guard(F, || {
        // SAFETY: NULL or live, used by this thread only (contract).
        let h = unsafe { work_mut(work, F) }?;
        let waited = match &h.state {
            WorkState::Done(r) => return r.clone(),
            WorkState::Pending(w) => w.wait_timeout(Duration::from_millis(timeout_ms)),
        };
        // Complete or not is the operation's own state, not the wait's error: an operation
        // that failed by its own deadline is done, a wait that ran out is not.
        settle(h).unwrap_or_else(|| {
            // Still in flight: the wait's own error, which names the operation and says
            // where it is.
            Err(waited.err().unwrap_or_else(|| Error::Transport {
                rank: None,
                peer: None,
                op: F.into(),
                what: "internal error: the wait returned, the operation is in flight".into(),
            }))
        })
    })
}

/// Copies where the operation of `work` is — what it waits for, which operation ahead of it
/// holds it back and for how long (the text `dspark_work_wait_timeout`'s error carries) —
/// into `buf` as a NUL-terminated string; an empty string once the operation is complete.
/// `*needed` and `len` as for `dspark_comm_flight_record`: call once with `len` 0 to size the
/// buffer. Never waits.
///
/// # Safety
/// `work` is NULL (refused) or a live handle that no other thread is using; `needed` is NULL
/// (refused) or valid for a write; `buf` is valid for writes of `len` bytes (or NULL with
/// `len` 0).
#[no_mangle]
pub unsafe extern "C" fn dspark_work_whereabouts(
    work: *mut dspark_work_t,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> dspark_result_t {
    const F: &str = "dspark_work_whereabouts";
    guard(F, || {
        // SAFETY: NULL or live, used by this thread only (contract).
        let h = unsafe { work_mut(work, F) }?;
        let text = match &h.state {
            WorkState::Pending(w) => w.whereabouts().unwrap_or_default(),
            WorkState::Done(_) => String::new(),
        };
        // SAFETY: the caller's contract is `copy_out`'s.
        unsafe { copy_out(&text, "the whereabouts", buf, len, needed, None, F) }
    })
}
