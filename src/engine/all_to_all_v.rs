//! An all-to-all whose blocks differ in size ([`Engine::run_all_to_all_v`]): MPI's
//! `Alltoallv` with contiguous blocks, torch's `all_to_all_single` with split sizes. One
//! program of the pairwise all_to_all's rounds ([`plan::algo::pairwise_all_to_all_v`]) built
//! from this rank's counts, under a collective sequence number. Every pair exchanges at least
//! one frame (a descriptor-only one for an empty block), and each frame's header carries the
//! size of the block between its two ranks, marked with [`COUNT_PER_PEER`], where a plain
//! all_to_all's carry the call's count: two ranks that disagree about their block, or a rank
//! running a plain all_to_all against one running this, meet as a mismatch at the pair's first
//! frame, naming both sizes, never as data at the wrong offsets or a frame left over.

use std::sync::Arc;

use super::frame::Descs;
use super::{flight, Call, Engine, Framed};
use crate::error::{Error, Result};
use crate::plan::{self, Algorithm, Collective, Program};
use crate::transport::COUNT_PER_PEER;
use crate::types::{DataType, ReduceOp};

/// The count the flight recorder keeps for an all-to-all of counts per peer (`u64::MAX`): the
/// ranks' totals differ, and `dspark analyze` would take that for ranks that disagree.
const RECORDED_COUNT: usize = usize::MAX;

/// The blocks' starts (prefix sums of `counts`, `counts.len() + 1` entries), or `None` when
/// they overflow.
fn starts(counts: &[usize]) -> Option<Vec<usize>> {
    let mut at = Vec::with_capacity(counts.len() + 1);
    at.push(0usize);
    for &c in counts {
        at.push(at.last()?.checked_add(c)?);
    }
    Some(at)
}

/// Checks an all_to_all_v's counts on rank `rank` of `world`: one per rank, a sum that fits a
/// `usize` each way, buffers of `bytes` (sent, received) that hold exactly those sums of
/// `dtype` (`None` where their lengths are taken from the counts), and this rank's own block
/// the same both ways. Returns the elements sent and received in all. Every way in checks
/// them here (the engine, the raw and the scoped starts), so that an argument error reads the
/// same whichever found it.
///
/// # Errors
/// `InvalidArgument` naming what is wrong.
pub(crate) fn v_check(
    (rank, world): (usize, usize),
    dtype: DataType,
    (send_counts, recv_counts): (&[usize], &[usize]),
    bytes: Option<(usize, usize)>,
) -> Result<(usize, usize)> {
    let bad = |what: String| Err(Error::invalid(Some(rank), "all_to_all_v", what));
    if send_counts.len() != world || recv_counts.len() != world {
        return bad(format!(
            "{} send counts and {} receive counts for a world of {world} (one per rank)",
            send_counts.len(),
            recv_counts.len()
        ));
    }
    let total = |c: &[usize]| c.iter().try_fold(0usize, |a, &k| a.checked_add(k));
    let (Some(sent), Some(received)) = (total(send_counts), total(recv_counts)) else {
        return bad("the counts overflow".into());
    };
    if let Some((src_bytes, dst_bytes)) = bytes {
        let fits = |elems: usize, len: usize| elems.checked_mul(dtype.size()) == Some(len);
        if !fits(sent, src_bytes) || !fits(received, dst_bytes) {
            return bad(format!(
                "the counts add up to {sent} elements sent and {received} received, the \
                 buffers hold {src_bytes} and {dst_bytes} bytes of {dtype}"
            ));
        }
    }
    if send_counts[rank] != recv_counts[rank] {
        return bad(format!(
            "rank {rank} sends {} elements to itself but receives {}",
            send_counts[rank], recv_counts[rank]
        ));
    }
    Ok((sent, received))
}

impl Engine {
    /// Sends `send_counts[j]` elements of `src` (blocks in rank order) to rank j and receives
    /// `recv_counts[i]` elements from rank i into `dst` (blocks in rank order), every rank at
    /// once: an all-to-all whose blocks differ in size. This rank's own block is copied
    /// (`send_counts[rank] == recv_counts[rank]`); the others move in the pairwise
    /// all_to_all's rounds, one program under a collective sequence number. Rank j's
    /// `recv_counts[rank]` must equal this rank's `send_counts[j]`: where a pair disagrees,
    /// the pair's first frame (every pair exchanges one, even for an empty block) carries
    /// the sender's size, and the call fails with a mismatch naming the peer and both sizes.
    ///
    /// # Errors
    /// `InvalidArgument` (before the call takes its sequence number) when the counts are not
    /// one per rank, do not add up to the buffers' lengths or disagree on this rank's own
    /// block; then as [`Engine::run`].
    pub fn run_all_to_all_v(
        &mut self,
        dtype: DataType,
        send_counts: &[usize],
        recv_counts: &[usize],
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<()> {
        let lens = (src.len(), dst.len());
        let host = |_: &mut Self, _: &Call| Ok((flight::FlightPath::Host, ()));
        self.run_v(
            dtype,
            (send_counts, recv_counts),
            lens,
            host,
            |eng, prog, descs, ()| {
                eng.with_scratch(prog, |eng, s, start, deadline| {
                    let (sum, esz) = (ReduceOp::Sum, dtype.size());
                    eng.drive(prog, descs, sum, sum, src, dst, esz, start, deadline, s)
                })
            },
        )
    }

    /// [`Engine::run_all_to_all_v`] on device buffers through `dev` (the host-staged path, or
    /// GPUDirect where `dev` is direct): `dev`'s `Src` holds the blocks sent, its `Dst` those
    /// received. The same frames as the host call, so host and device ranks can be mixed.
    ///
    /// # Errors
    /// As [`Engine::run_all_to_all_v`]; a device that cannot run the call fails it for every
    /// rank, as in [`Engine::run_staged`].
    pub fn run_staged_all_to_all_v(
        &mut self,
        dtype: DataType,
        send_counts: &[usize],
        recv_counts: &[usize],
        dev: &mut dyn super::staged::StagedDevice,
    ) -> Result<()> {
        let lens = dev.buffer_bytes();
        // The device is judged once the counts are (an argument error poisons nothing).
        let device = |eng: &mut Self, call: &Call| match eng.check_device(dev) {
            Ok(Some(l)) => Ok((flight::FlightPath::GpuDirect, (dev, Some(l)))),
            Ok(None) => Ok((flight::FlightPath::HostStaged, (dev, None))),
            Err(e) => Err(eng.fail_before_start(call, e)),
        };
        self.run_v(
            dtype,
            (send_counts, recv_counts),
            lens,
            device,
            |eng, prog, descs, (dev, direct)| {
                eng.execute_staged(prog, &descs, ReduceOp::Sum, dev, direct)
            },
        )
    }

    /// What both all_to_all_v's share: the checks (before the call takes its sequence
    /// number), the call with every frame's count per peer, the kept program and the per-peer
    /// descriptors. `prepare` runs between the checks and the sequence number and says the
    /// path the flight recorder keeps; `run` drives the program.
    fn run_v<'c, P>(
        &mut self,
        dtype: DataType,
        counts: (&'c [usize], &'c [usize]),
        lens: (usize, usize),
        prepare: impl FnOnce(&mut Self, &Call) -> Result<(flight::FlightPath, P)>,
        run: impl FnOnce(&mut Self, &Program, Descs<'_>, P) -> Result<()>,
    ) -> Result<()> {
        self.ready()?;
        let totals = v_check((self.rank, self.world), dtype, counts, Some(lens))?;
        let call = Call {
            dtype,
            ..Call::new(Collective::AllToAll, None, totals.0, 0, false)
        };
        let (path, prepared) = prepare(self, &call)?;
        let frame = Framed {
            recorded: RECORDED_COUNT,
            algo: Algorithm::Pairwise,
            path,
            count: COUNT_PER_PEER,
        };
        self.framed(&call, frame, |eng, desc| {
            // Inside the call, as `guarded` fetches its program: the trace's span covers it.
            let built = eng.v_program(counts.0, counts.1, dtype.size())?;
            let prog = &built.prog;
            if prog.steps.is_empty() {
                return Ok(());
            }
            let descs = Descs {
                send: desc,
                recv: desc,
                per_peer: Some(counts),
            };
            run(eng, prog, descs, prepared)
        })
    }
}

/// An all_to_all_v's program for one set of counts: kept ([`V_SLOTS`]) for the next call with
/// the same counts and segment, as a training loop's fixed-capacity expert exchange makes.
#[derive(Debug)]
pub(super) struct VProgram {
    send_counts: Vec<usize>,
    recv_counts: Vec<usize>,
    seg_elems: usize,
    prog: Program,
}

/// all_to_all_v programs kept, the least recently used replaced. Building one took 0.25 µs for
/// 2 ranks, 0.64 for 4 and 1.3 for 8 (release build, the development VM), growing with the
/// world, where a whole 64-byte call over shared memory takes 0.45 µs with 2 ranks once its
/// program is kept (`benches/data/issue25-stop41-2026-12-05/`).
const V_SLOTS: usize = 8;

impl Engine {
    /// The program of an all_to_all_v with these counts, one per rank, from the engine's cache
    /// when a call had them before.
    ///
    /// # Errors
    /// `InvalidArgument` when the counts overflow (which [`Engine::run_all_to_all_v`] has
    /// ruled out before).
    fn v_program(
        &mut self,
        send_counts: &[usize],
        recv_counts: &[usize],
        esz: usize,
    ) -> Result<Arc<VProgram>> {
        let seg_elems = (self.opts.segment_bytes / esz).max(1);
        self.clock += 1;
        let now = self.clock;
        let hit = self.v_cache.iter_mut().find(|(_, v)| {
            v.seg_elems == seg_elems && v.send_counts == send_counts && v.recv_counts == recv_counts
        });
        if let Some((used, v)) = hit {
            *used = now;
            return Ok(Arc::clone(v));
        }
        let (n, me) = (self.world, self.rank);
        let (Some(sends), Some(recvs)) = (starts(send_counts), starts(recv_counts)) else {
            let what = "the counts overflow";
            return Err(Error::invalid(Some(me), Collective::AllToAll.name(), what));
        };
        let sched = plan::algo::pairwise_all_to_all_v(n, me, &sends, &recvs);
        let built = Arc::new(VProgram {
            send_counts: send_counts.to_vec(),
            recv_counts: recv_counts.to_vec(),
            seg_elems,
            prog: plan::compile(&sched, seg_elems),
        });
        if self.v_cache.len() >= V_SLOTS {
            if let Some(oldest) = (0..self.v_cache.len()).min_by_key(|&i| self.v_cache[i].0) {
                self.v_cache.swap_remove(oldest);
            }
        }
        self.v_cache.push((now, Arc::clone(&built)));
        Ok(built)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineOptions;
    use crate::transport::mem::MemFabric;
    use std::time::{Duration, Instant};

    /// The elements rank r sends rank j.
    type Count<'a> = &'a (dyn Fn(usize, usize) -> usize + Sync);
    /// Changes rank r's send and receive counts after its input is built.
    type Tweak<'a> = &'a (dyn Fn(usize, &mut Vec<usize>, &mut Vec<usize>) + Sync);

    /// Rank `r`'s block for rank `j` in world `n`: `count(r, j)` elements naming both.
    fn block(r: usize, j: usize, count: usize) -> Vec<u32> {
        (0..count)
            .map(|k| (r * 1_000_000 + j * 1000 + k) as u32)
            .collect()
    }

    /// Runs one all-to-all-v per rank as threads over a `mem` fabric (segments of `seg`
    /// bytes): `count(r, j)` elements from rank r to rank j. Returns each rank's result.
    fn run(n: usize, seg: usize, count: Count<'_>, tweak: Tweak<'_>) -> Vec<Result<Vec<u32>>> {
        let fabric = MemFabric::new(n, 4);
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|r| {
                    let opts = EngineOptions {
                        segment_bytes: seg,
                        timeout: Duration::from_secs(10),
                        ..EngineOptions::default()
                    };
                    let mut eng = Engine::new(r, n, Box::new(fabric.transport(r)), opts);
                    s.spawn(move || {
                        let mut sc: Vec<usize> = (0..n).map(|j| count(r, j)).collect();
                        let mut rc: Vec<usize> = (0..n).map(|i| count(i, r)).collect();
                        let src: Vec<u32> = (0..n).flat_map(|j| block(r, j, sc[j])).collect();
                        tweak(r, &mut sc, &mut rc);
                        let mut dst = vec![u32::MAX; rc.iter().sum()];
                        eng.run_all_to_all_v(
                            DataType::U32,
                            &sc,
                            &rc,
                            bytemuck::cast_slice(&src[..sc.iter().sum::<usize>()]),
                            bytemuck::cast_slice_mut(&mut dst),
                        )
                        .map(|()| dst)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Worlds of 1 to 5, blocks of every size from empty to several segments (odd, prime,
    /// smaller than the world): every rank ends with every peer's block for it, in rank order,
    /// compared with the blocks built here.
    #[test]
    fn every_rank_gets_every_peers_block_for_it_whatever_their_sizes() {
        let counts: [Count<'_>; 4] = [
            &|r, j| (r * 7 + j * 3) % 5,
            &|r, j| if (r + j) % 2 == 0 { 0 } else { 1 + r * 13 + j },
            &|r, j| 97 * (r + 1) + 31 * j + 1,
            &|_, _| 0,
        ];
        for n in 1..=5 {
            for (k, count) in counts.iter().enumerate() {
                // 64-byte segments: blocks of up to 30 segments.
                for (r, got) in run(n, 64, count, &|_, _, _| {}).into_iter().enumerate() {
                    let want: Vec<u32> = (0..n).flat_map(|i| block(i, r, count(i, r))).collect();
                    assert_eq!(got.unwrap(), want, "world {n}, counts {k}, rank {r}");
                }
            }
        }
    }

    /// One engine per rank running 11 sets of counts (more than the cache keeps) three times
    /// over, in an order that brings sets back both while kept and after they were replaced:
    /// every call's blocks exact, whichever way its program came, and the cache no larger
    /// than its slots.
    #[test]
    fn programs_kept_for_counts_seen_before_give_the_same_blocks() {
        let n = 3;
        let count = |set: usize, r: usize, j: usize| (set * 5 + r * 3 + j * 7) % (set + 4);
        let order: Vec<usize> = (0..11).chain((0..11).rev()).chain(0..11).collect();
        let fabric = MemFabric::new(n, 4);
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|r| {
                    let opts = EngineOptions {
                        segment_bytes: 16,
                        timeout: Duration::from_secs(10),
                        ..EngineOptions::default()
                    };
                    let mut eng = Engine::new(r, n, Box::new(fabric.transport(r)), opts);
                    let order = &order;
                    s.spawn(move || {
                        for &set in order {
                            let sc: Vec<usize> = (0..n).map(|j| count(set, r, j)).collect();
                            let rc: Vec<usize> = (0..n).map(|i| count(set, i, r)).collect();
                            let src: Vec<u32> = (0..n).flat_map(|j| block(r, j, sc[j])).collect();
                            let want: Vec<u32> = (0..n).flat_map(|i| block(i, r, rc[i])).collect();
                            let mut dst = vec![u32::MAX; want.len()];
                            eng.run_all_to_all_v(
                                DataType::U32,
                                &sc,
                                &rc,
                                bytemuck::cast_slice(&src),
                                bytemuck::cast_slice_mut(&mut dst),
                            )
                            .unwrap_or_else(|e| panic!("rank {r}, set {set}: {e}"));
                            assert_eq!(dst, want, "rank {r}, set {set}");
                            assert!(eng.v_cache.len() <= V_SLOTS);
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
        });
    }

    /// The same counts again give the kept program itself, while kept; other counts, a
    /// program of their own; once `V_SLOTS` others were used since, a new one; a different
    /// element size that cuts other segments, another.
    #[test]
    fn counts_seen_before_take_the_kept_program_until_it_is_replaced() {
        let fabric = MemFabric::new(1, 4);
        let opts = EngineOptions {
            segment_bytes: 64,
            ..EngineOptions::default()
        };
        let mut eng = Engine::new(0, 1, Box::new(fabric.transport(0)), opts);
        let mut get = |c: usize, esz: usize| eng.v_program(&[c], &[c], esz).unwrap();
        let first = get(5, 4);
        assert!(Arc::ptr_eq(&first, &get(5, 4)), "the same counts again");
        assert!(!Arc::ptr_eq(&first, &get(6, 4)), "other counts");
        assert!(Arc::ptr_eq(&first, &get(5, 4)), "kept among others");
        assert!(
            !Arc::ptr_eq(&first, &get(5, 8)),
            "another segment in elements"
        );
        for c in 100..100 + V_SLOTS {
            get(c, 4);
        }
        assert!(
            !Arc::ptr_eq(&first, &get(5, 4)),
            "replaced after {V_SLOTS} others"
        );
    }

    /// A rank that expects a larger, a smaller or an empty block where its peer sends 12
    /// elements (or a block where the peer sends none) fails at that pair's first frame, well
    /// before the deadline, with a mismatch naming the peer and both sizes.
    #[test]
    fn ranks_that_disagree_about_a_block_fail_with_a_mismatch_naming_both_sizes() {
        // (count from rank 0 to rank 2, what rank 2 expects of it)
        for (sent, expected) in [(12, 13), (12, 11), (12, 0), (0, 5), (16, 32)] {
            let t = Instant::now();
            let count = move |r: usize, j: usize| if (r, j) == (0, 2) { sent } else { 3 + r + j };
            let res = run(3, 64, &count, &|r, _, rc| {
                if r == 2 {
                    rc[0] = expected;
                }
            });
            let text = match &res[2] {
                Err(e @ Error::Mismatch { .. }) => e.to_string(),
                other => panic!("{sent} sent, {expected} expected: rank 2: {other:?}"),
            };
            assert!(
                text.contains("rank 0")
                    && text.contains(&format!("{sent} for this pair"))
                    && text.contains(&format!("{expected} for this pair")),
                "{sent} sent, {expected} expected: {text}"
            );
            assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
        }
    }

    /// A plain all_to_all against an all-to-all of counts per peer is a mismatch on the rank
    /// that runs the plain one, whatever the sizes.
    #[test]
    fn a_plain_all_to_all_against_one_of_counts_per_peer_is_a_mismatch() {
        let fabric = MemFabric::new(2, 4);
        let res: Vec<Result<()>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    let opts = EngineOptions {
                        timeout: Duration::from_secs(10),
                        ..EngineOptions::default()
                    };
                    let mut eng = Engine::new(r, 2, Box::new(fabric.transport(r)), opts);
                    s.spawn(move || {
                        let src = [7u8; 8];
                        let mut dst = [0u8; 8];
                        if r == 0 {
                            let call = Call::new(Collective::AllToAll, None, 4, 0, false);
                            eng.run(&call, &src, &mut dst)
                        } else {
                            eng.run_all_to_all_v(DataType::U8, &[4, 4], &[4, 4], &src, &mut dst)
                        }
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, e) in res.iter().enumerate() {
            let text = match e {
                Err(e @ (Error::Mismatch { .. } | Error::Aborted { .. })) => e.to_string(),
                other => panic!("rank {r}: {other:?}"),
            };
            assert!(
                text.contains("for this pair") || text.contains("aborted"),
                "{text}"
            );
        }
        assert!(
            matches!(res[0], Err(Error::Mismatch { .. })),
            "rank 0: {:?}",
            res[0]
        );
    }

    /// Wrong arguments fail before the call takes its sequence number: the next call runs.
    #[test]
    fn wrong_counts_are_refused_before_the_call_starts() {
        let fabric = MemFabric::new(1, 4);
        let mut eng = Engine::new(
            0,
            1,
            Box::new(fabric.transport(0)),
            EngineOptions::default(),
        );
        let src = [1u8, 2, 3];
        let mut dst = [0u8; 3];
        for (sc, rc, want) in [
            (vec![3, 0], vec![3], "one per rank"),
            (vec![2], vec![2], "add up"),
            (vec![3], vec![2], "add up"),
        ] {
            let e = eng
                .run_all_to_all_v(DataType::U8, &sc, &rc, &src, &mut dst)
                .unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains(want),
                "{e}"
            );
        }
        eng.run_all_to_all_v(DataType::U8, &[3], &[3], &src, &mut dst)
            .unwrap();
        assert_eq!(dst, src);
    }
}
