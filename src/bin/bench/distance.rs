//! How far apart two CPUs are for a cache line: two threads pinned to them pass a counter in
//! one cache line back and forth, and the round trip is the fastest of `samples` samples of
//! `trips` round trips (a sample the scheduler interrupted is slower, never faster). Shared
//! by `dspark doctor`'s core-to-core section and dspark-bench's header (measured by the
//! spawning parent before its ranks start, between rank 0's CPU and the others').

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Round trips per sample, and samples, of the default measurement.
pub(crate) const TRIPS: u64 = 1000;
pub(crate) const SAMPLES: u64 = 15;
/// A pair whose threads have not finished by then is not measured.
pub(crate) const PAIR_DEADLINE: Duration = Duration::from_millis(200);
/// A round trip at least this long (µs) is between CPUs that share no cache: different dies
/// or sockets (two cores sharing a cache take 0.04–0.15 µs).
pub(crate) const FAR_US: f64 = 0.2;

fn pin(cpu: usize) -> Result<(), String> {
    crate::bind::bind_to(&[cpu]).map_err(|e| format!("cannot pin a thread to cpu {cpu}: {e}"))
}

/// Waits until `w` holds at least `v`; `false` once `stop` is set or `until` passed.
fn wait_for(w: &AtomicU64, v: u64, stop: &AtomicBool, until: Instant) -> bool {
    let mut spins = 0u32;
    while w.load(Ordering::Acquire) < v {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(4096) && (stop.load(Ordering::Relaxed) || Instant::now() > until) {
            return false;
        }
    }
    true
}

#[repr(align(128))]
struct Line(AtomicU64);

/// The round trip (µs) between CPUs `a` and `b`, the fastest of `samples` samples of `trips`:
/// the calling thread, pinned to `a`, starts each trip, a scoped thread pinned to `b` answers
/// it. At `deadline` both stop: the fastest complete sample so far stands, an error if none
/// completed. The calling thread's CPU set is changed (it stays pinned to `a`): [`measure`]
/// runs it on a thread of its own.
fn round_trip(
    a: usize,
    b: usize,
    trips: u64,
    samples: u64,
    deadline: Duration,
) -> Result<f64, String> {
    let line = Line(AtomicU64::new(0));
    let stop = AtomicBool::new(false);
    let until = Instant::now() + deadline;
    let total = trips * samples;
    std::thread::scope(|s| {
        let answer = std::thread::Builder::new()
            .name(format!("core-pair-{b}"))
            .spawn_scoped(s, || {
                if let Err(e) = pin(b) {
                    // The measuring side stops waiting for answers at once.
                    stop.store(true, Ordering::Relaxed);
                    return Err(e);
                }
                for i in 0..total {
                    if !wait_for(&line.0, 2 * i + 1, &stop, until) {
                        return Ok(()); // stopped: the other side says why
                    }
                    line.0.store(2 * i + 2, Ordering::Release);
                }
                Ok(())
            })
            .map_err(|e| format!("no thread for cpu {b}: {e}"))?;
        let mine = (|| {
            pin(a)?;
            let mut best: Option<f64> = None;
            'samples: for k in 0..samples {
                let t0 = Instant::now();
                for i in k * trips..(k + 1) * trips {
                    line.0.store(2 * i + 1, Ordering::Release);
                    if !wait_for(&line.0, 2 * i + 2, &stop, until) {
                        break 'samples;
                    }
                }
                let us = t0.elapsed().as_secs_f64() * 1e6 / trips as f64;
                best = Some(best.map_or(us, |b: f64| b.min(us)));
            }
            best.ok_or_else(|| {
                format!(
                    "cpu {b} did not answer {trips} times within {} ms (busy?)",
                    deadline.as_millis()
                )
            })
        })();
        stop.store(true, Ordering::Relaxed);
        // The answering side's failure (its pinning) explains the measuring side's.
        answer
            .join()
            .unwrap_or_else(|_| Err("its thread failed".into()))?;
        mine
    })
}

/// [`round_trip`] with the defaults, on a thread of its own (the caller's CPU set is kept).
pub(crate) fn measure(a: usize, b: usize) -> Result<f64, String> {
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name(format!("core-pair-{a}"))
            .spawn_scoped(s, || round_trip(a, b, TRIPS, SAMPLES, PAIR_DEADLINE))
            .map_err(|e| format!("no thread for cpu {a}: {e}"))?
            .join()
            .unwrap_or_else(|_| Err("the measuring thread failed".into()))
    })
}

/// "near" or "far" for a round trip, with what it means.
pub(crate) fn reading(us: f64) -> &'static str {
    if us >= FAR_US {
        "far: likely no shared cache — different dies or sockets, or on a VM where the host put \
         the vCPUs"
    } else {
        "near: likely a shared cache"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_cpus_of_this_machine_answer_each_other() {
        let allowed = crate::bind::allowed();
        if allowed.len() < 2 {
            eprintln!("skipped: fewer than 2 CPUs allowed");
            return;
        }
        // Few trips and a long deadline: beside the other tests a round trip can wait for a
        // scheduler slice. The fastest sample must still be measured and plausible.
        let us = std::thread::scope(|s| {
            s.spawn(|| round_trip(allowed[0], allowed[1], 20, 5, Duration::from_secs(20)))
                .join()
                .unwrap()
        })
        .unwrap_or_else(|e| panic!("not measured: {e}"));
        assert!(us > 0.0 && us < 5000.0, "{us} µs");
        assert!(reading(0.05).starts_with("near"));
        assert!(reading(0.35).starts_with("far"));
    }
}
