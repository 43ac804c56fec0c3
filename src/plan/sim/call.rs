//! One collective call over a whole world ([`Call`]): the per-rank requests, sized random
//! inputs, the run, and the result every rank must end with, computed from the definition of
//! the collective alone, independent of any schedule — what the simulator's runs are checked
//! against.

use super::exec::SplitMix64;
use super::{
    compile_requests, run_programs, Buffers, SimConfig, SimError, SimOutcome, FINALIZE_FACTOR,
};
use crate::plan::{Algorithm, Buf, Collective, Program, Rank, Request};

/// One collective call over a whole world: what every rank asks for, in one value.
///
/// Buffer lengths ([`Call::buffer_lens`]) follow the [`Request`] conventions: `count` is the
/// buffer length of all_reduce, broadcast and reduce (in place: `Dst` only); the per-rank block
/// of all_gather (`Src` = count, `Dst` = count·n), reduce_scatter (`Src` = count·n,
/// `Dst` = count) and all_to_all (`Src` = `Dst` = count·n); the message of send/recv (the
/// sender's `Src`, the receiver's `Dst`; other ranks take no part); 0 for barrier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    /// The collective.
    pub coll: Collective,
    /// The algorithm every rank uses.
    pub algo: Algorithm,
    /// Number of ranks.
    pub world: usize,
    /// Element count (see the type docs).
    pub count: usize,
    /// Root of broadcast and reduce; the *sender* of send/recv; ignored otherwise.
    pub root: Rank,
    /// The *receiver* of send/recv; ignored otherwise.
    pub peer: Rank,
    /// Whether reductions end with `Finalize` (`Avg`); ignored by non-reducing collectives.
    pub finalize: bool,
    /// Ranks per host ([`Request::per_host`]; 0: unknown).
    pub per_host: usize,
}

impl Call {
    /// A call with root 0, send/recv from rank 0 to rank 1 (or 0 in a world of one), and no
    /// finalize.
    pub fn new(coll: Collective, algo: Algorithm, world: usize, count: usize) -> Self {
        Call {
            coll,
            algo,
            world,
            count,
            root: 0,
            peer: world.min(2).saturating_sub(1),
            finalize: false,
            per_host: 0,
        }
    }

    /// A send/recv of `count` elements from `sender` to `receiver` in a world of `world`.
    pub fn send_recv(world: usize, count: usize, sender: Rank, receiver: Rank) -> Self {
        Call {
            root: sender,
            peer: receiver,
            ..Call::new(Collective::SendRecv, Algorithm::Direct, world, count)
        }
    }

    /// The same call with another root.
    pub fn with_root(self, root: Rank) -> Self {
        Call { root, ..self }
    }

    /// The same call on hosts of `per_host` ranks each ([`Request::per_host`]).
    pub fn with_per_host(self, per_host: usize) -> Self {
        Call { per_host, ..self }
    }

    /// The same call with `finalize` set.
    pub fn with_finalize(self, finalize: bool) -> Self {
        Call { finalize, ..self }
    }

    fn check(&self) -> Result<(), SimError> {
        let n = self.world;
        if n == 0 {
            return Err(SimError::BadSetup("a world needs at least one rank".into()));
        }
        if !self.algo.supports(self.coll) {
            return Err(SimError::BadSetup(format!(
                "{} does not implement {}",
                self.algo, self.coll
            )));
        }
        if self.root >= n {
            return Err(SimError::BadSetup(format!(
                "root {} outside a world of {n}",
                self.root
            )));
        }
        if self.coll == Collective::SendRecv && (self.peer >= n || self.peer == self.root) {
            return Err(SimError::BadSetup(format!(
                "send/recv from rank {} to rank {} in a world of {n}",
                self.root, self.peer
            )));
        }
        Ok(())
    }

    /// The per-rank requests (`None`: the rank takes no part, as the non-participants of a
    /// send/recv).
    pub fn requests(&self) -> Result<Vec<Option<Request>>, SimError> {
        self.check()?;
        Ok((0..self.world)
            .map(|rank| {
                let base = Request {
                    coll: self.coll,
                    algo: self.algo,
                    world: self.world,
                    rank,
                    count: if self.coll == Collective::Barrier {
                        0
                    } else {
                        self.count
                    },
                    root: self.root,
                    is_send: false,
                    finalize: self.finalize && self.coll.reduces(),
                    per_host: self.per_host,
                };
                if self.coll != Collective::SendRecv {
                    Some(base)
                } else if rank == self.root {
                    Some(Request {
                        root: self.peer,
                        is_send: true,
                        ..base
                    })
                } else if rank == self.peer {
                    Some(Request {
                        root: self.root,
                        ..base
                    })
                } else {
                    None
                }
            })
            .collect())
    }

    /// `(Src, Dst)` lengths of `rank`'s buffers.
    pub fn buffer_lens(&self, rank: Rank) -> (usize, usize) {
        let (c, n) = (self.count, self.world);
        match self.coll {
            Collective::AllReduce | Collective::Broadcast | Collective::Reduce => (0, c),
            Collective::AllGather => (c, c * n),
            Collective::ReduceScatter => (c * n, c),
            Collective::AllToAll => (c * n, c * n),
            Collective::SendRecv if rank == self.root => (c, 0),
            Collective::SendRecv if rank == self.peer => (0, c),
            Collective::SendRecv | Collective::Barrier => (0, 0),
        }
    }

    /// Random inputs of the right lengths for every rank, from `seed`. `Dst` is filled with
    /// random values too, so an output element nobody writes is detected.
    pub fn random_inputs(&self, seed: u64) -> Vec<Buffers> {
        let mut rng = SplitMix64(seed ^ 0x5151_7E57_0000_0001);
        (0..self.world)
            .map(|r| {
                let (s, d) = self.buffer_lens(r);
                Buffers {
                    src: (0..s).map(|_| rng.next_u64()).collect(),
                    dst: (0..d).map(|_| rng.next_u64()).collect(),
                }
            })
            .collect()
    }

    /// Schedules and compiles every rank's program (empty for ranks that take no part).
    pub fn programs(&self, seg_elems: usize) -> Result<Vec<Program>, SimError> {
        compile_requests(&self.requests()?, seg_elems)
    }

    /// Runs the call on `inputs` (see [`Call::random_inputs`]).
    pub fn run(&self, inputs: Vec<Buffers>, cfg: &SimConfig) -> Result<SimOutcome, SimError> {
        run_programs(&self.programs(cfg.seg_elems)?, inputs, cfg)
    }

    /// The expected final `Dst` of every rank, computed from the definition of the collective
    /// alone (no schedule involved); `None` where the result is unspecified (the non-root ranks
    /// of reduce).
    ///
    /// all_reduce: the elementwise wrapping sum of every rank's input (× [`FINALIZE_FACTOR`]
    /// when finalizing); all_gather: the inputs concatenated in rank order; reduce_scatter:
    /// block `r` of the sum; broadcast: the root's input; reduce: the sum at the root;
    /// all_to_all: block `j` of rank `i`'s input is block `i` of rank `j`'s output; send/recv:
    /// the sender's message at the receiver; barrier: nothing.
    ///
    /// # Panics
    ///
    /// When `inputs` does not have [`Call::buffer_lens`] for every rank.
    pub fn expected(&self, inputs: &[Buffers]) -> Vec<Option<Vec<u64>>> {
        let (c, n) = (self.count, self.world);
        assert_eq!(inputs.len(), n, "one set of buffers per rank");
        for (r, b) in inputs.iter().enumerate() {
            assert_eq!(
                (b.src.len(), b.dst.len()),
                self.buffer_lens(r),
                "rank {r}'s buffers"
            );
        }
        let fin = |v: u64| {
            if self.finalize {
                v.wrapping_mul(FINALIZE_FACTOR)
            } else {
                v
            }
        };
        let sum = |buf: Buf, range: std::ops::Range<usize>| -> Vec<u64> {
            range
                .map(|e| {
                    fin(inputs
                        .iter()
                        .fold(0u64, |acc, b| acc.wrapping_add(b.get(buf)[e])))
                })
                .collect()
        };
        match self.coll {
            Collective::AllReduce => vec![Some(sum(Buf::Dst, 0..c)); n],
            Collective::AllGather => {
                let all: Vec<u64> = inputs.iter().flat_map(|b| b.src.iter().copied()).collect();
                vec![Some(all); n]
            }
            Collective::ReduceScatter => (0..n)
                .map(|r| Some(sum(Buf::Src, r * c..r * c + c)))
                .collect(),
            Collective::Broadcast => vec![Some(inputs[self.root].dst.clone()); n],
            Collective::Reduce => (0..n)
                .map(|r| (r == self.root).then(|| sum(Buf::Dst, 0..c)))
                .collect(),
            Collective::AllToAll => (0..n)
                .map(|j| {
                    Some(
                        (0..n)
                            .flat_map(|i| inputs[i].src[j * c..j * c + c].iter().copied())
                            .collect(),
                    )
                })
                .collect(),
            Collective::SendRecv => (0..n)
                .map(|r| {
                    Some(if r == self.peer {
                        inputs[self.root].src.clone()
                    } else {
                        Vec::new()
                    })
                })
                .collect(),
            Collective::Barrier => vec![Some(Vec::new()); n],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_all_to_all_transposes_blocks() {
        let call = Call::new(Collective::AllToAll, Algorithm::Pairwise, 2, 2);
        let inputs = vec![
            Buffers {
                src: vec![1, 2, 3, 4],
                dst: vec![0; 4],
            },
            Buffers {
                src: vec![5, 6, 7, 8],
                dst: vec![0; 4],
            },
        ];
        assert_eq!(
            call.expected(&inputs),
            vec![Some(vec![1, 2, 5, 6]), Some(vec![3, 4, 7, 8])]
        );
    }

    #[test]
    fn expected_finalized_reduction_is_factor_times_sum() {
        let call = Call::new(Collective::ReduceScatter, Algorithm::Ring, 2, 1).with_finalize(true);
        let inputs = vec![
            Buffers {
                src: vec![1, 2],
                dst: vec![0],
            },
            Buffers {
                src: vec![10, 20],
                dst: vec![0],
            },
        ];
        let k = FINALIZE_FACTOR;
        assert_eq!(
            call.expected(&inputs),
            vec![
                Some(vec![11u64.wrapping_mul(k)]),
                Some(vec![22u64.wrapping_mul(k)])
            ]
        );
    }
}
