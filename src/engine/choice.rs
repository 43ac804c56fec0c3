//! The cost model's choices remembered ([`Engine::chosen`]): the choice runs the model's
//! prediction for every algorithm, ~7% of a 2-rank 64-byte all_to_all over shared memory
//! (0.47 µs) in a profile, on every call of a size a training loop repeats (and twice per
//! all_reduce above the one-shot sizes, whose one-shot test asked the model too).

use super::Engine;
use crate::plan::{Algorithm, Collective};

/// (collective, size) pairs whose algorithm is remembered: a training loop's few bucket sizes
/// and the broadcasts and reduces around them (a collective that one algorithm implements is
/// not remembered: [`Collective::sole_algorithm`]).
const CHOICES: usize = 8;

/// The model's choices for the last [`CHOICES`] (collective, size) pairs, replaced round robin.
#[derive(Debug, Default)]
pub(super) struct Choices {
    entries: [Option<(Collective, usize, Algorithm)>; CHOICES],
    /// Where the next choice goes.
    next: usize,
}

impl Choices {
    /// Where the choice for `coll` on `bytes` bytes is kept, if it is.
    fn slot(&self, coll: Collective, bytes: usize) -> Option<usize> {
        self.entries
            .iter()
            .position(|e| matches!(*e, Some((c, b, _)) if c == coll && b == bytes))
    }

    /// Forgets every choice (a new model, or a forced algorithm set or lifted).
    pub(super) fn clear(&mut self) {
        *self = Choices::default();
    }
}

impl Engine {
    /// [`Engine::algorithm`]: a forced algorithm or the one-shot all_reduce at once, and the
    /// cost model's choice remembered for the last [`CHOICES`] (collective, size) pairs until
    /// the model or the forced algorithm changes ([`Choices::clear`]).
    pub(crate) fn chosen(&mut self, coll: Collective, bytes: usize) -> Algorithm {
        // Forced, or one-shot (the 8-byte all_reduce): two comparisons, before any lookup.
        if let Some(a) = self.opts.settled(self.world, coll, bytes) {
            return a;
        }
        // One algorithm implements it (a barrier, an all_gather): nothing to ask, nothing to
        // remember (a memo entry would push out an all_reduce's bucket size).
        if let Some(a) = coll.sole_algorithm() {
            return a;
        }
        let memo = &mut self.choices;
        if let Some((_, _, a)) = memo.slot(coll, bytes).and_then(|i| memo.entries[i]) {
            return a;
        }
        let a = self.algorithm(coll, bytes);
        let memo = &mut self.choices;
        memo.entries[memo.next] = Some((coll, bytes, a));
        memo.next = (memo.next + 1) % CHOICES;
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineOptions;
    use crate::plan::{self, model::CostModel};
    use crate::transport::mem::MemFabric;

    #[test]
    fn remembered_choices_are_the_models_are_used_and_are_forgotten_with_the_model() {
        let fabric = MemFabric::new(8, 4);
        let mut eng = Engine::new(
            0,
            8,
            Box::new(fabric.transport(0)),
            EngineOptions::default(),
        );
        let colls = [
            Collective::AllReduce,
            Collective::AllGather,
            Collective::Broadcast,
            Collective::AllToAll,
        ];
        let sizes = [1usize, 64, 4096, 65_536, 1 << 20, 64 << 20];
        // More (collective, size) pairs than the memo holds, twice over: every answer is the
        // model's as pairs are remembered and replaced.
        for _ in 0..2 {
            for &c in &colls {
                for &b in &sizes {
                    assert_eq!(eng.chosen(c, b), eng.algorithm(c, b), "{c:?} {b}");
                }
            }
        }
        // The collectives one algorithm implements took no slot: only all_reduce and
        // broadcast sizes are remembered.
        for c in [
            Collective::AllGather,
            Collective::AllToAll,
            Collective::Barrier,
        ] {
            for &b in &sizes {
                assert_eq!(eng.choices.slot(c, b), None, "{c:?} {b} remembered");
            }
        }
        assert!(eng.choices.slot(Collective::Broadcast, 64 << 20).is_some());
        // A pair asked again is answered from the memo: one made to say otherwise is believed.
        let big = 64 << 20;
        let model = eng.chosen(Collective::AllReduce, big);
        let other = if model == Algorithm::Ring {
            Algorithm::Rabenseifner
        } else {
            Algorithm::Ring
        };
        let slot = eng
            .choices
            .slot(Collective::AllReduce, big)
            .expect("the pair just asked is remembered");
        eng.choices.entries[slot] = Some((Collective::AllReduce, big, other));
        assert_eq!(eng.chosen(Collective::AllReduce, big), other);
        eng.choices.entries[slot] = Some((Collective::AllReduce, big, model));
        // A forced algorithm overrides a remembered choice, and the choice is back after.
        eng.set_forced_algorithm(Some(Algorithm::Ring));
        assert_eq!(eng.chosen(Collective::AllReduce, big), Algorithm::Ring);
        assert_eq!(eng.chosen(Collective::AllReduce, 64), Algorithm::Ring);
        eng.set_forced_algorithm(None);
        assert_eq!(eng.chosen(Collective::AllReduce, big), model);
        // Forced hier where hosts differ in size or interleave (`per_host` 0): its schedule
        // is the ring's, and the algorithm the call reports (its frames, the recorder, the
        // bench) says ring; with a uniform layout, hier.
        eng.set_forced_algorithm(Some(Algorithm::Hierarchical));
        assert_eq!(eng.opts.per_host, 0);
        assert!(eng.opts.forced_hier_is_ring(Collective::AllReduce));
        // (Its warning asks the same: not for an all_gather, whose ring is its only one.)
        assert!(!eng.opts.forced_hier_is_ring(Collective::AllGather));
        assert_eq!(eng.chosen(Collective::AllReduce, big), Algorithm::Ring);
        assert_eq!(eng.algorithm(Collective::AllReduce, 64), Algorithm::Ring);
        eng.opts.per_host = 4;
        assert!(!eng.opts.forced_hier_is_ring(Collective::AllReduce));
        assert_eq!(
            eng.algorithm(Collective::AllReduce, big),
            Algorithm::Hierarchical
        );
        eng.opts.per_host = 0;
        eng.set_forced_algorithm(None);
        // A model whose every hop costs a second chooses otherwise for some of these (a
        // 64 MiB all_reduce: the ring, where the default model takes Rabenseifner's): a new
        // model forgets what the old one chose.
        let m = eng.opts.model;
        let alt = CostModel {
            costs: plan::model::Costs {
                alpha_us: 1e6,
                ..m.costs
            },
            ..m
        };
        eng.set_model(alt);
        for &c in &colls {
            for &b in &sizes {
                assert_eq!(
                    eng.chosen(c, b),
                    eng.algorithm(c, b),
                    "new model: {c:?} {b}"
                );
            }
        }
    }
}
