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

/// Nanoseconds on `clock`; `None` where it cannot be read.
fn ns_on(clock: nix::time::ClockId) -> Option<u64> {
    let t = nix::time::clock_gettime(clock).ok()?;
    let secs = u64::try_from(t.tv_sec()).ok()?;
    let nanos = u64::try_from(t.tv_nsec()).ok()?;
    Some(secs.saturating_mul(1_000_000_000).saturating_add(nanos))
}

/// `CLOCK_MONOTONIC` now, in ns: the clock [`Instant`] reads on Linux, so a stamp of
/// [`coarse_ns`] can be placed on the same axis as instants read next to this.
pub(crate) fn mono_ns() -> Option<u64> {
    ns_on(nix::time::ClockId::CLOCK_MONOTONIC)
}

/// `CLOCK_MONOTONIC_COARSE` now, in ns: the monotonic clock as of the kernel's last tick, so
/// behind [`mono_ns`] by up to one tick (1–4 ms), never ahead. A read costs ~5 ns on this
/// project's VMs against ~21 ns for [`Instant::now`] (benches: the flight recorder's stamp
/// of a one-shot all_reduce, a sixth of an 8-byte call over shared memory).
pub(crate) fn coarse_ns() -> Option<u64> {
    ns_on(nix::time::ClockId::CLOCK_MONOTONIC_COARSE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_coarse_clock_is_the_monotonic_clock_at_most_a_tick_behind() {
        for _ in 0..100 {
            let before = mono_ns().expect("CLOCK_MONOTONIC unreadable");
            let coarse = coarse_ns().expect("CLOCK_MONOTONIC_COARSE unreadable");
            let after = mono_ns().expect("CLOCK_MONOTONIC unreadable");
            assert!(
                coarse <= after,
                "coarse {coarse} ahead of monotonic {after}"
            );
            // A tick is at most 10 ms (HZ=100); allow for a preempted test thread.
            assert!(
                before.saturating_sub(coarse) < 50_000_000,
                "coarse {coarse} far behind monotonic {before}"
            );
        }
    }
}
