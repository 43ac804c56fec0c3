//! The link probe: in a communicator over several hosts, rank 0 and the first rank of the
//! next host measure the link between them at init, over the communicator's own transport
//! (the one the hops between hosts use), so that the cost model prices those hops at the
//! link's α and β ([`crate::plan::model::Link`]; module docs of [`crate::plan::model`],
//! "Between hosts"). `DSPARK_LINK_PROBE=0` ([`crate::Config::link_probe`], rank 0's) turns it
//! off.
//!
//! * **α**: [`ROUND_TRIPS`] round trips of 8 bytes after one to warm the connection up; half
//!   the median of rank 0's. Where every host has as many ranks, every local rank `i` of host
//!   `2k` times its own with local rank `i` of host `2k + 1` at the same time, as the rails of
//!   a collective use the link and the hosts' cores together (ranks that share cores, or a
//!   link that slows with several flows, show in α as they do in every step of a call); and
//!   α is at least the time per hop across the link of an 8-byte allreduce of every rank (the
//!   median of [`STEP_SAMPLES`] samples of [`BACK_TO_BACK`] calls back to back, less its hops
//!   within hosts at shared memory's α, over its hops across): a step of a collective, not a
//!   lone round trip, is what the model prices (on the link bed, 4 ranks on 2 cores, a round
//!   trip took 7 µs and a step of a call ~35–45).
//! * **β**: rank 0 streams batches of [`BATCH`] messages of [`MESSAGE`] bytes; the receiver
//!   times every arrival and, after each batch, says whether to go on: until [`STREAM_FOR`]
//!   has passed since the first arrival (or [`MAX_BATCHES`]). β is taken over the later half
//!   of the last batch, so a token bucket's burst (a shaper lets some milliseconds of traffic
//!   through at once) is spent before the rate is read, and the pause between batches (one
//!   round trip) is not counted. The receiver sends β back to rank 0.
//!
//! Every call runs under the communicator's deadline. Rank 0 then broadcasts the link
//! ([`crate::plan::model::encode_link`]) and every rank adopts it, so that all choose alike.

use std::time::{Duration, Instant};

use crate::comm::Communicator;
use crate::error::Result;
use crate::plan::model::{self, Costs, Link, Medium};
use crate::plan::{Algorithm, Collective};
use crate::types::ReduceOp;

/// Timed 8-byte round trips.
const ROUND_TRIPS: usize = 8;
/// Samples of [`BACK_TO_BACK`] tiny allreduces each (α's second measure).
const STEP_SAMPLES: usize = 3;
/// Tiny allreduces per sample, back to back.
const BACK_TO_BACK: usize = 16;
/// The stream's message size, bytes.
const MESSAGE: usize = 256 << 10;
/// Messages per batch (2 MiB: ~17 ms at 1 Gbit/s, ~1.7 ms at 10 Gbit/s).
const BATCH: usize = 8;
/// How long the stream runs at least (from its first arrival).
const STREAM_FOR: Duration = Duration::from_millis(10);
/// The most batches (32 MiB), whatever the time.
const MAX_BATCHES: usize = 16;

/// The rank the probe pairs with rank 0: the first whose host differs from rank 0's.
pub(super) fn partner(hosts: &[String]) -> Option<usize> {
    let first = hosts.first()?;
    hosts.iter().position(|h| h != first)
}

/// The rank this one times its round trips with while rank 0 times its own with `peer`, and
/// whether it leads them: where every host has as many ranks (`per_host`, numbered host by
/// host), local rank `i` of host `2k` with local rank `i` of host `2k + 1` (the rails of a
/// collective); elsewhere only rank 0 and `peer`.
fn counterpart(rank: usize, world: usize, per_host: usize, peer: usize) -> Option<(usize, bool)> {
    if rank == 0 {
        return Some((peer, true));
    }
    if rank == peer {
        return Some((0, false));
    }
    if per_host == 0 || peer != per_host {
        return None;
    }
    let h = rank / per_host;
    if h % 2 == 1 {
        Some((rank - per_host, false))
    } else {
        (rank + per_host < world).then_some((rank + per_host, true))
    }
}

/// Runs this rank's side of the probe between rank 0 and `peer`, then the broadcast of the
/// result: every rank returns the link rank 0 holds (`None` where the measurement gave no
/// usable constants). `per_host`: ranks per host where every host has as many, else 0.
pub(super) fn run(comm: &Communicator, peer: usize, per_host: usize) -> Result<Option<Link>> {
    let rank = comm.rank();
    let mut measured = None;
    // Every pair of ranks across the link times its round trips at once, as a collective's
    // rails use the link (and the hosts' cores) together: α is rank 0's median.
    let alpha_us = match counterpart(rank, comm.world_size(), per_host, peer) {
        Some((other, true)) => round_trips(comm, other)?,
        Some((other, false)) => {
            echo(comm, other)?;
            0.0
        }
        None => 0.0,
    };
    // A step of a collective on this job: tiny allreduces, timed on every rank at once; rank
    // 0's median per hop of their critical path. Where ranks share cores or wait on several
    // transports, a step costs more than a lone round trip.
    let step_us = allreduce_steps(comm, per_host)?;
    let alpha_us = alpha_us.max(step_us);
    if rank == 0 {
        measured = lead(comm, peer, alpha_us)?;
    } else if rank == peer {
        follow(comm)?;
    }
    let mut wire = model::encode_link(measured);
    comm.broadcast(&mut wire, 0)?;
    Ok(model::decode_link(&wire).flatten().filter(Link::is_valid))
}

/// The leading side of the round trips with `peer`: one to warm the connection up, then
/// [`ROUND_TRIPS`] timed; half their median, µs.
fn round_trips(comm: &Communicator, peer: usize) -> Result<f64> {
    let mut small = [0u8; 8];
    comm.send(&small, peer)?;
    comm.recv(&mut small, peer)?;
    let mut trips = [0f64; ROUND_TRIPS];
    for t in &mut trips {
        let start = Instant::now();
        comm.send(&small, peer)?;
        comm.recv(&mut small, peer)?;
        *t = start.elapsed().as_secs_f64() * 1e6;
    }
    trips.sort_by(f64::total_cmp);
    Ok(trips[ROUND_TRIPS / 2] / 2.0)
}

/// One 8-byte allreduce to line the ranks up, then [`STEP_SAMPLES`] samples of
/// [`BACK_TO_BACK`] back-to-back ones: the median sample's time per call, per hop of the
/// critical path of the algorithm they ran (recursive doubling, as the model without the link
/// chooses at 8 bytes: ⌈log2 n⌉ hops, 2 more where `n` is not a power of two), µs. Calls back
/// to back, as collectives run in a job and as the benchmarks time them: a lone call's time
/// moved with the scheduler's choice of the moment on the bed (4 ranks on 2 cores; the lower
/// quartile of 8 lone calls gave 3.6 µs per hop in one init and 29–114 in the next, while
/// 1 KiB all_reduces back to back ran 35–40 µs per hop).
fn allreduce_steps(comm: &Communicator, per_host: usize) -> Result<f64> {
    let mut v = [0f32; 2];
    comm.all_reduce(&mut v, ReduceOp::Sum)?;
    let mut samples = [0f64; STEP_SAMPLES];
    for t in &mut samples {
        let start = Instant::now();
        for _ in 0..BACK_TO_BACK {
            comm.all_reduce(&mut v, ReduceOp::Sum)?;
        }
        *t = start.elapsed().as_secs_f64() * 1e6 / BACK_TO_BACK as f64;
    }
    samples.sort_by(f64::total_cmp);
    let typical = samples[STEP_SAMPLES / 2];
    let n = comm.world_size();
    let algo = comm.algorithm(Collective::AllReduce, 8);
    let hops = model::volume(Collective::AllReduce, algo, n, 2, per_host).map_or(1, |v| v.hops);
    Ok(per_link_hop(typical, hops, split_hops(algo, n, per_host)))
}

/// The hops of an 8-byte allreduce's critical path within hosts and across the link, where
/// the model tells them apart: recursive doubling on the layouts whose exchanges it counts
/// ([`model::doubling_hops`]).
fn split_hops(algo: Algorithm, n: usize, per_host: usize) -> Option<(usize, usize)> {
    (algo == Algorithm::RecursiveDoubling)
        .then(|| model::doubling_hops(n, per_host))
        .flatten()
}

/// The time of one hop across the link in a call of `typical` µs over `hops` hops: with the
/// hops told apart (`split`: within hosts, across), the call less its hops within hosts at
/// shared memory's α, over the hops across; else (and never less than) the call over all its
/// hops. On the link bed (2 hosts × 2 ranks, 4 Gbit/s) an 8-byte call took ~18 µs: 9 µs over
/// its 2 hops, but its one hop across took ~16; priced at 9, the model took Rabenseifner's 2
/// crossings over recursive doubling's 1 at 8 KiB, which measured 44–65 µs against 34.
fn per_link_hop(typical: f64, hops: usize, split: Option<(usize, usize)>) -> f64 {
    let mean = typical / hops.max(1) as f64;
    match split {
        Some((within, across)) if across > 0 => {
            let shm = Costs::defaults(Medium::Shm).alpha_us;
            ((typical - within as f64 * shm) / across as f64).max(mean)
        }
        _ => mean,
    }
}

/// The other side of [`round_trips`].
fn echo(comm: &Communicator, peer: usize) -> Result<()> {
    let mut small = [0u8; 8];
    for _ in 0..=ROUND_TRIPS {
        comm.recv(&mut small, peer)?;
        comm.send(&small, peer)?;
    }
    Ok(())
}

/// Rank 0's side of the stream, and β from the receiver.
fn lead(comm: &Communicator, peer: usize, alpha_us: f64) -> Result<Option<Link>> {
    let mut small = [0u8; 8];
    let data = vec![0x5au8; MESSAGE];
    loop {
        for _ in 0..BATCH {
            comm.send(&data, peer)?;
        }
        comm.recv(&mut small, peer)?;
        if small[0] == 0 {
            break;
        }
    }
    comm.recv(&mut small, peer)?;
    let beta_us_per_byte = f64::from_le_bytes(small);
    let link = Link {
        alpha_us,
        beta_us_per_byte,
    };
    if link.is_valid() {
        Ok(Some(link))
    } else {
        tracing::warn!(
            rank = 0,
            peer,
            ?link,
            "the link probe measured no usable constants; the cost model prices the hops \
             between hosts at its transport's constants"
        );
        Ok(None)
    }
}

/// The receiver's side of the stream: time it, send β back.
fn follow(comm: &Communicator) -> Result<()> {
    let mut data = vec![0u8; MESSAGE];
    let mut first = None;
    let mut beta = f64::NAN;
    let mut at = [Instant::now(); BATCH];
    for batch in 0..MAX_BATCHES {
        for t in &mut at {
            comm.recv(&mut data, 0)?;
            *t = Instant::now();
        }
        let start = *first.get_or_insert(at[0]);
        let from = BATCH / 2 - 1;
        let span = at[BATCH - 1].duration_since(at[from]).as_secs_f64() * 1e6;
        let bytes = (MESSAGE * (BATCH - 1 - from)) as f64;
        beta = span / bytes;
        let more = at[BATCH - 1].duration_since(start) < STREAM_FOR && batch + 1 < MAX_BATCHES;
        comm.send(&[u8::from(more); 8], 0)?;
        if !more {
            break;
        }
    }
    comm.send(&beta.to_le_bytes(), 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_partner_is_the_first_rank_on_another_host() {
        let h = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(partner(&h(&["a", "a", "b", "b"])), Some(2));
        assert_eq!(partner(&h(&["a", "b", "a", "b"])), Some(1));
        assert_eq!(partner(&h(&["a", "a", "a"])), None);
        assert_eq!(partner(&h(&[])), None);
    }

    #[test]
    fn the_rails_pair_up_across_hosts_and_rank_0_always_times_with_its_partner() {
        // 3 hosts of 2: host 0 with host 1, host 2 has no pair (but rank 0 and 2 time).
        let pairs: Vec<_> = (0..6).map(|r| counterpart(r, 6, 2, 2)).collect();
        assert_eq!(
            pairs,
            [
                Some((2, true)),
                Some((3, true)),
                Some((0, false)),
                Some((1, false)),
                None,
                None
            ]
        );
        // Uneven hosts (no layout): only rank 0 and its partner.
        let pairs: Vec<_> = (0..5).map(|r| counterpart(r, 5, 0, 2)).collect();
        assert_eq!(pairs, [Some((2, true)), None, Some((0, false)), None, None]);
    }

    #[test]
    fn a_hop_across_is_the_call_less_its_hops_within_hosts() {
        let rd = Algorithm::RecursiveDoubling;
        // 2 hosts × 2 ranks: one exchange within, one across; 8 × 4: 3 within, 3 across.
        assert_eq!(split_hops(rd, 4, 2), Some((1, 1)));
        assert_eq!(split_hops(rd, 32, 4), Some((2, 3)));
        assert_eq!(split_hops(rd, 4, 1), Some((0, 2)));
        // Layouts and algorithms the split does not cover.
        assert_eq!(split_hops(rd, 6, 2), None);
        assert_eq!(split_hops(rd, 4, 0), None);
        assert_eq!(split_hops(rd, 4, 4), None);
        assert_eq!(split_hops(Algorithm::Ring, 4, 2), None);
        let shm = Costs::defaults(Medium::Shm).alpha_us;
        // The bed's 18 µs call: its hop across is 18 less one within, not 9.
        assert_eq!(per_link_hop(18.0, 2, Some((1, 1))), 18.0 - shm);
        assert_eq!(per_link_hop(18.0, 2, None), 9.0);
        // Never under the mean per hop (hops within hosts slower than shared memory's α).
        assert_eq!(per_link_hop(2.0, 2, Some((1, 1))), 1.0);
        assert_eq!(per_link_hop(30.0, 6, Some((3, 3))), 10.0 - shm);
    }
}
