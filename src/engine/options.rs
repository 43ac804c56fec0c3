//! The engine's options ([`EngineOptions`]) and the rules that follow from them alone: the
//! algorithm a call runs (forced, one-shot through the slots, or the cost model's choice)
//! and its pipeline segment ([`call_segment`]).

use std::time::Duration;

use crate::plan::model::CostModel;
use crate::plan::{self, Algorithm, Collective};
use crate::transport::TransportKind;

/// How the engine runs.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Deadline of every blocking call.
    pub timeout: Duration,
    /// Pipeline segment size in bytes.
    pub segment_bytes: usize,
    /// How long to poll without progress before blocking in the transport: the base, which
    /// the engine grows up to 2 ms (yielding the CPU past the base) after a wait that slept
    /// and was woken soon after, and gives back call by call (`pace::Spin`).
    pub spin: Duration,
    /// Yield the CPU while spinning (when ranks outnumber cores).
    pub yield_while_spinning: bool,
    /// The cost model that chooses the algorithm of every call that does not force one
    /// ([`plan::model`]). Every rank must hold the same one.
    pub model: CostModel,
    /// Force one algorithm for every collective it supports (`DSPARK_ALGO`).
    pub force_algo: Option<Algorithm>,
    /// The host layout ([`plan::Request::per_host`]): ranks per host when every host has
    /// as many and numbers them contiguously, else 0.
    pub per_host: usize,
    /// The largest all_reduce, in bytes, that runs [`Algorithm::OneShot`] through the
    /// transport's shared slots ([`crate::transport::Slots`]) when no algorithm is forced;
    /// 0 where the transport has none. Set at init from the transport.
    pub one_shot_bytes: usize,
    /// The largest all_reduce, in bytes, the transport's shared slots hold (0 where it has
    /// none): a forced [`Algorithm::OneShot`] runs through them up to this size. Set at init.
    pub one_shot_slot_bytes: usize,
}

/// The pipeline segment of an all_reduce under [`PAIR_SEGMENT_BELOW`] bytes between exactly two
/// ranks over TCP ([`call_segment`]).
pub const PAIR_SEGMENT: usize = 256 << 10;
/// The size from which a two-rank all_reduce over TCP takes the communicator's segment again.
pub const PAIR_SEGMENT_BELOW: usize = 16 << 20;

/// The pipeline segment, in bytes, of a call of `coll` on `bytes` bytes (the request's count
/// times the element size) on a communicator of `world` ranks over `kind` whose segment is
/// `segment` (`DSPARK_CHUNK_BYTES`): `segment`, except for an all_reduce of fewer than
/// [`PAIR_SEGMENT_BELOW`] bytes between two ranks over TCP, which takes at most
/// [`PAIR_SEGMENT`]. Between two ranks of one host (loopback), 1–8 MiB all_reduces run in one
/// of two modes about 2x apart from run to run; at 4 MiB, 256 KiB segments ran in the fast
/// one in 24 of 33 fresh runs (stops 37 and 40), 512 KiB ones in 4 of 28; at 1–2 MiB neither
/// was the faster, at 8 MiB both scattered. From 16 MiB 512 KiB was 5–10% faster; between
/// hosts (the link bed at 10 Gbit/s) both took 0.96–0.97 of the link (benches/RESULTS.md,
/// stops 37 and 40). With more ranks no segment was better throughout, and the other
/// collectives were not measured, so they keep `segment`. The cost model
/// ([`EngineOptions::model`]) prices every call with the communicator's segment. Every rank of
/// a call computes the same (the transport is a job-wide choice).
pub fn call_segment(
    segment: usize,
    world: usize,
    kind: TransportKind,
    coll: Collective,
    bytes: usize,
) -> usize {
    if world == 2
        && kind == TransportKind::Tcp
        && coll == Collective::AllReduce
        && bytes < PAIR_SEGMENT_BELOW
    {
        segment.min(PAIR_SEGMENT)
    } else {
        segment
    }
}

impl EngineOptions {
    /// The algorithm a call of `coll` on `bytes` bytes runs with on a world of `world`.
    pub fn algorithm(&self, world: usize, coll: Collective, bytes: usize) -> Algorithm {
        self.settled(world, coll, bytes)
            .unwrap_or_else(|| plan::choose(coll, bytes, world, self.per_host, &self.model))
    }

    /// Whether `coll` is an all_reduce with the hierarchical algorithm forced on a layout it
    /// needs and does not have: hosts of equal size, each numbering its ranks contiguously
    /// (`per_host`). Its schedule is then the ring's, and the call says ring.
    pub(crate) fn forced_hier_is_ring(&self, coll: Collective) -> bool {
        self.force_algo == Some(Algorithm::Hierarchical)
            && coll == Collective::AllReduce
            && self.per_host == 0
    }

    /// Whether a forced one-shot all_reduce of `bytes` runs recursive doubling instead: with
    /// 3 ranks or more beyond what the shared slots hold. Its frames would have each rank
    /// add its own contribution first and the others after, a different order on each rank,
    /// so that float sums differed in their last bits from rank to rank (two ranks add the
    /// same two values, in either order alike).
    pub(crate) fn forced_one_shot_is_doubling(
        &self,
        world: usize,
        coll: Collective,
        bytes: usize,
    ) -> bool {
        self.force_algo == Some(Algorithm::OneShot)
            && coll == Collective::AllReduce
            && world > 2
            && bytes > self.one_shot_slot_bytes
    }

    /// The algorithm when no model is asked: a forced one that implements `coll` (the ring
    /// for a forced hierarchical all_reduce without its layout; recursive doubling for a
    /// forced one-shot all_reduce its slots cannot hold among 3 ranks or more), or the
    /// one-shot all_reduce for the sizes the transport's slots hold. The model never picks
    /// the one-shot all_reduce ([`plan::choose`]), so a call runs one-shot exactly when this
    /// says so.
    #[inline]
    pub(crate) fn settled(
        &self,
        world: usize,
        coll: Collective,
        bytes: usize,
    ) -> Option<Algorithm> {
        match self.force_algo {
            _ if self.forced_hier_is_ring(coll) => Some(Algorithm::Ring),
            _ if self.forced_one_shot_is_doubling(world, coll, bytes) => {
                Some(Algorithm::RecursiveDoubling)
            }
            Some(a) if a.supports(coll) => Some(a),
            _ if coll == Collective::AllReduce
                && world > 1
                && bytes > 0
                && bytes <= self.one_shot_bytes =>
            {
                Some(Algorithm::OneShot)
            }
            _ => None,
        }
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            timeout: Duration::from_secs(300),
            segment_bytes: 512 * 1024,
            spin: Duration::from_micros(50),
            yield_while_spinning: false,
            model: CostModel::default(),
            force_algo: None,
            per_host: 0,
            one_shot_bytes: 0,
            one_shot_slot_bytes: 0,
        }
    }
}
