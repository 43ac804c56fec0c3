//! Time utilities shared by the layers that keep deadlines (engine, gpu, bootstrap, comm).
//!
//! They live here, below every one of those layers, rather than in `config`: computing a
//! deadline is arithmetic on instants, not a setting, and the engine and `gpu` may not depend
//! on the configuration.

use std::time::{Duration, Instant};

/// `start + timeout`, saturating far in the future (a `Duration::MAX` timeout means "no
/// practical limit", not an overflow).
pub(crate) fn deadline(start: Instant, timeout: Duration) -> Instant {
    start
        .checked_add(timeout)
        .or_else(|| start.checked_add(Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(start)
}
