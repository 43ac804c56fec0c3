//! What every C function does at the boundary ([`guard`]): the thread's last error, panics
//! contained, the result code of an [`Error`]; and the log a C program gets
//! ([`log_to_stderr`]); and how a text goes out into a caller's buffer ([`copy_out`]).

use std::cell::RefCell;
use std::ffi::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use super::dspark_result_t;
use crate::error::Error;

thread_local! {
    /// The message of this thread's last failed call, NUL-terminated; just a NUL when the
    /// last call succeeded. Cleared in place (never reallocated when shrinking), so a pointer
    /// from `dspark_last_error` stays a valid string until the next call on this thread.
    static LAST_ERROR: RefCell<Vec<u8>> = RefCell::new(vec![0]);
}

// `try_with` in both: a call from an `atexit` handler or a thread-exit destructor comes after
// this thread's locals were destroyed, where `with` panics, and a panic out of an `extern "C"`
// function aborts the process. The message is then not kept.
fn set_last_error(msg: &str) {
    let _ = LAST_ERROR.try_with(|b| {
        if let Ok(mut b) = b.try_borrow_mut() {
            b.clear();
            // A C string ends at the first NUL: keep the message whole.
            b.extend(msg.bytes().map(|c| if c == 0 { b'?' } else { c }));
            b.push(0);
        }
    });
}

fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|b| {
        if let Ok(mut b) = b.try_borrow_mut() {
            b.clear();
            b.push(0);
        }
    });
}

/// The code of `e`.
fn code_of(e: &Error) -> dspark_result_t {
    use dspark_result_t::*;
    match e {
        Error::Timeout { .. } => DSPARK_ERR_TIMEOUT,
        Error::PeerLost { .. } => DSPARK_ERR_PEER_LOST,
        Error::Mismatch { .. } => DSPARK_ERR_MISMATCH,
        Error::InvalidArgument { .. } => DSPARK_ERR_INVALID_ARGUMENT,
        Error::Config { .. } => DSPARK_ERR_CONFIG,
        Error::Io { .. } => DSPARK_ERR_IO,
        Error::Aborted { .. } => DSPARK_ERR_ABORTED,
        Error::Transport { what, .. } if what.starts_with("internal error") => DSPARK_ERR_INTERNAL,
        Error::Transport { .. } => DSPARK_ERR_IO,
        Error::Unavailable { .. } | Error::Cuda { .. } => DSPARK_ERR_UNAVAILABLE,
    }
}

/// An invalid-argument error of the C call `func`.
pub(super) fn invalid(rank: Option<usize>, func: &str, what: impl Into<String>) -> Error {
    Error::invalid(rank, func, what)
}

/// Runs the body of the C function `func`: clears the last error, contains panics, and
/// turns the outcome into a result code (leaving the error's text behind).
pub(super) fn guard(func: &str, body: impl FnOnce() -> Result<(), Error>) -> dspark_result_t {
    clear_last_error();
    guard_keeping(func, body)
}

/// [`guard`] without clearing the last error first: for a call that cannot fail
/// (`dspark_work_free`), so that wait, free, then `dspark_last_error` still reads the wait's.
pub(super) fn guard_keeping(
    func: &str,
    body: impl FnOnce() -> Result<(), Error>,
) -> dspark_result_t {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => dspark_result_t::DSPARK_SUCCESS,
        Ok(Err(e)) => {
            set_last_error(&e.to_string());
            code_of(&e)
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            set_last_error(&format!(
                "internal error in {func}: {what} (a dspark bug; please report it)"
            ));
            dspark_result_t::DSPARK_ERR_INTERNAL
        }
    }
}

/// `dspark_last_error`'s answer: this thread's last error text, `""` where there is none to
/// give (the thread's locals destroyed, a panic).
pub(super) fn last_error() -> *const c_char {
    catch_unwind(|| {
        LAST_ERROR
            .try_with(|b| match b.try_borrow() {
                Ok(b) => b.as_ptr().cast::<c_char>(),
                Err(_) => c"".as_ptr(),
            })
            .unwrap_or(c"".as_ptr())
    })
    .unwrap_or(c"".as_ptr())
}

/// dspark's log to stderr ([`crate::internals::stderr_log`], once per process), filtered by
/// `DSPARK_LOG`: a C program has no tracing subscriber, and every degraded path would go
/// unseen. No panic may leave an `extern "C"` function: one here costs the log, not the call.
pub(super) fn log_to_stderr() {
    let _ = catch_unwind(crate::internals::stderr_log::install);
}

/// Copies `text` and a NUL into `buf` and its length with the NUL into `*needed`; when `len`
/// is too small, writes nothing to `buf` and says so (`what` names the text).
///
/// # Safety
/// `needed` is NULL (refused) or valid for a write; `buf` is valid for writes of `len` bytes
/// (or NULL).
pub(super) unsafe fn copy_out(
    text: &str,
    what: &str,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
    rank: Option<usize>,
    func: &str,
) -> Result<(), Error> {
    let need = text.len() + 1;
    // SAFETY: NULL (refused) or valid for a write (contract).
    unsafe { super::put(needed, need, "needed", rank, func) }?;
    if buf.is_null() {
        return Err(invalid(
            rank,
            func,
            format!("buf is NULL (len {len}); {what} takes {need} bytes with its NUL"),
        ));
    }
    if len < need {
        return Err(invalid(
            rank,
            func,
            format!("{what} takes {need} bytes with its NUL; buf holds {len}"),
        ));
    }
    // SAFETY: `buf` is valid for `len >= need` bytes (contract) and does not overlap `text`,
    // which the caller owns.
    unsafe {
        ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
        buf.add(text.len()).write(0);
    }
    Ok(())
}
