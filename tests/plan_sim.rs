//! Exhaustive simulation of every schedule: every world of 1..=9 ranks, every collective and
//! every algorithm that implements it, every root, awkward counts (0, 1, primes, counts smaller
//! than the world), several segment sizes and link capacities, several scheduling seeds.
//!
//! Results are compared with `Call::expected`, which computes each collective from its
//! definition (sums, concatenations, transpositions of the inputs) without looking at any
//! schedule; byte volumes are compared with the closed forms of each algorithm.

use std::collections::BTreeSet;

use dspark::internals::plan::sim::{
    self, BlockReason, Buffers, Call, SimConfig, SimError, SimOutcome, FINALIZE_FACTOR,
};
use dspark::internals::plan::{
    algo, compile, schedule, Algorithm, Collective, Loc, Op, Program, Schedule,
};

const MAX_WORLD: usize = 9;
const SEGS: [usize; 4] = [1, 3, 64, usize::MAX];
const CAPS: [usize; 2] = [1, 4];
/// Scheduling seeds per (world, count, segment, capacity) point; rooted collectives and
/// send/recv spread their roots (pairs) over at least this many runs.
const SEEDS: usize = 5;

/// Every algorithm: `Algorithm::ALL`, checked against the exhaustive `match` below, so that a
/// new variant is a compile error here until it gets an arm (its wire code) and `VARIANTS` is
/// bumped, and then a test failure until `Algorithm::ALL` lists it.
fn all_algorithms() -> Vec<Algorithm> {
    /// The wire code of each variant, which is also its position in `Algorithm::ALL`.
    fn expected_code(a: Algorithm) -> u8 {
        match a {
            Algorithm::Ring => 0,
            Algorithm::RecursiveDoubling => 1,
            Algorithm::Chain => 2,
            Algorithm::BinomialTree => 3,
            Algorithm::Pairwise => 4,
            Algorithm::Dissemination => 5,
            Algorithm::Direct => 6,
            Algorithm::Tree => 7,
            Algorithm::Hierarchical => 8,
            Algorithm::Rabenseifner => 9,
            Algorithm::OneShot => 10,
        }
    }
    /// The number of arms of the match above.
    const VARIANTS: usize = 11;
    assert_eq!(
        Algorithm::ALL.len(),
        VARIANTS,
        "Algorithm::ALL does not list every variant"
    );
    for (i, a) in Algorithm::ALL.into_iter().enumerate() {
        assert_eq!(
            usize::from(expected_code(a)),
            i,
            "{a:?} is out of wire-code order in Algorithm::ALL"
        );
        assert_eq!(a.code(), expected_code(a), "{a:?}.code()");
    }
    Algorithm::ALL.to_vec()
}

/// The counts every world is tried with: tiny, around the world size, primes, larger.
fn counts(n: usize) -> Vec<usize> {
    let set: BTreeSet<usize> = [
        0,
        1,
        2,
        3,
        n.saturating_sub(1),
        n,
        n + 1,
        7,
        13,
        31,
        97,
        100,
    ]
    .into_iter()
    .collect();
    set.into_iter().collect()
}

/// The variants of a call that differ only in root (pair) and finalize.
fn variants(coll: Collective, algo: Algorithm, n: usize, count: usize) -> Vec<Call> {
    let base = Call::new(coll, algo, n, count);
    let mut out = Vec::new();
    match coll {
        Collective::SendRecv => {
            for s in 0..n {
                for r in (0..n).filter(|&r| r != s) {
                    out.push(Call::send_recv(n, count, s, r));
                }
            }
        }
        _ if coll.rooted() => out.extend((0..n).map(|root| base.with_root(root))),
        _ => out.push(base),
    }
    if coll.reduces() {
        let fin: Vec<Call> = out.iter().map(|c| c.with_finalize(true)).collect();
        out.extend(fin);
    }
    out
}

/// Runs `call` and compares every rank's output with the independent reference.
fn run_and_check(call: &Call, cfg: &SimConfig, input_seed: u64) -> SimOutcome {
    let progs = call.programs(cfg.seg_elems).expect("valid call");
    run_programs_and_check(call, &progs, cfg, input_seed)
}

/// [`run_and_check`] with `call`'s programs already compiled (with `cfg.seg_elems`).
fn run_programs_and_check(
    call: &Call,
    progs: &[Program],
    cfg: &SimConfig,
    input_seed: u64,
) -> SimOutcome {
    let inputs = call.random_inputs(input_seed);
    let out = match sim::run_programs(progs, inputs.clone(), cfg) {
        Ok(out) => out,
        Err(e) => panic!("{call:?} {cfg:?}: {e}"),
    };
    let want = call.expected(&inputs);
    for (rank, want) in want.iter().enumerate() {
        let got = &out.buffers[rank];
        assert_eq!(
            got.src, inputs[rank].src,
            "{call:?} {cfg:?}: rank {rank} changed Src"
        );
        let Some(want) = want else { continue };
        assert_eq!(
            got.dst.len(),
            want.len(),
            "{call:?} {cfg:?}: rank {rank} Dst length"
        );
        if let Some(e) = (0..want.len()).find(|&e| got.dst[e] != want[e]) {
            panic!(
                "{call:?} {cfg:?}: rank {rank} element {e} is {:#x}, expected {:#x}",
                got.dst[e], want[e]
            );
        }
    }
    out
}

/// Sweeps one (collective, algorithm) pair over every world, count, segment size and link
/// capacity; every root (pair) and finalize variant runs, seeds rotate through them.
fn sweep(coll: Collective, algo: Algorithm) {
    sweep_worlds(coll, algo, 1..=MAX_WORLD);
}

/// [`sweep`] over the worlds `worlds`.
fn sweep_worlds(coll: Collective, algo: Algorithm, worlds: std::ops::RangeInclusive<usize>) {
    assert!(algo.supports(coll), "{algo} does not implement {coll}");
    let mut runs = 0usize;
    for n in worlds {
        if coll == Collective::SendRecv && n < 2 {
            continue;
        }
        let counts = if coll == Collective::Barrier {
            vec![0]
        } else {
            counts(n)
        };
        for &count in &counts {
            let vs = variants(coll, algo, n, count);
            for &seg in &SEGS {
                // Programs depend on neither seed nor capacity: compile each variant once.
                let mut progs: Vec<Option<Vec<Program>>> = vec![None; vs.len()];
                for &cap in &CAPS {
                    for k in 0..vs.len().max(SEEDS) {
                        let seed = (n * 1_000_003 + count * 1009 + seg % 997 * 31 + cap + k) as u64;
                        let cfg = SimConfig {
                            seed,
                            seg_elems: seg,
                            link_capacity: cap,
                        };
                        let call = vs[k % vs.len()];
                        let p = progs[k % vs.len()]
                            .get_or_insert_with(|| call.programs(seg).expect("valid call"));
                        let out = run_programs_and_check(&call, p, &cfg, seed ^ 0xABCD);
                        if coll == Collective::Barrier {
                            for (r, h) in out.heard_from.iter().enumerate() {
                                assert!(
                                    h.iter().all(|&x| x),
                                    "{call:?} {cfg:?}: rank {r} left the barrier having heard \
                                     only from {h:?}"
                                );
                            }
                        }
                        runs += 1;
                    }
                }
            }
        }
    }
    assert!(runs > 0);
}

#[test]
fn every_supported_collective_and_algorithm_pair_has_a_sweep_below() {
    let swept: BTreeSet<(Collective, &str)> = [
        (Collective::AllReduce, Algorithm::Ring),
        (Collective::AllReduce, Algorithm::RecursiveDoubling),
        (Collective::AllReduce, Algorithm::Tree),
        (Collective::AllReduce, Algorithm::Hierarchical),
        (Collective::AllReduce, Algorithm::Rabenseifner),
        (Collective::AllReduce, Algorithm::OneShot),
        (Collective::AllGather, Algorithm::Ring),
        (Collective::ReduceScatter, Algorithm::Ring),
        (Collective::Broadcast, Algorithm::Chain),
        (Collective::Broadcast, Algorithm::BinomialTree),
        (Collective::Broadcast, Algorithm::Tree),
        (Collective::Reduce, Algorithm::Chain),
        (Collective::Reduce, Algorithm::BinomialTree),
        (Collective::Reduce, Algorithm::Tree),
        (Collective::AllToAll, Algorithm::Pairwise),
        (Collective::SendRecv, Algorithm::Direct),
        (Collective::Barrier, Algorithm::Dissemination),
    ]
    .into_iter()
    .map(|(c, a)| (c, a.name()))
    .collect();
    let supported: BTreeSet<(Collective, &str)> = Collective::ALL
        .into_iter()
        .flat_map(|c| {
            all_algorithms()
                .into_iter()
                .filter(move |a| a.supports(c))
                .map(move |a| (c, a.name()))
        })
        .collect();
    assert_eq!(swept, supported);
}

#[test]
fn ring_all_reduce_gives_every_rank_the_sum_of_all_inputs() {
    sweep(Collective::AllReduce, Algorithm::Ring);
}

#[test]
fn hierarchical_all_reduce_without_host_information_gives_every_rank_the_sum() {
    sweep(Collective::AllReduce, Algorithm::Hierarchical);
}

/// Host layouts `(hosts, ranks per host)` the hierarchical allreduce is proved on: the
/// shapes it is chosen for (≥ 2 hosts of ≥ 2 ranks) and the degenerate ones it must still
/// get right when forced (one host, one rank per host).
const HIER_LAYOUTS: [(usize, usize); 10] = [
    (2, 2),
    (2, 3),
    (3, 2),
    (2, 4),
    (4, 2),
    (3, 3),
    (2, 5),
    (1, 3),
    (3, 1),
    (1, 1),
];

#[test]
fn hierarchical_all_reduce_gives_every_rank_the_sum_on_every_host_layout() {
    let mut runs = 0;
    for (hosts, l) in HIER_LAYOUTS {
        let n = hosts * l;
        for count in counts(n).into_iter().chain([2 * n + 1, 4 * n]) {
            for fin in [false, true] {
                let call = Call::new(Collective::AllReduce, Algorithm::Hierarchical, n, count)
                    .with_per_host(l)
                    .with_finalize(fin);
                for &seg in &SEGS {
                    let progs = call.programs(seg).expect("valid call");
                    for &cap in &CAPS {
                        for k in 0..SEEDS {
                            let seed =
                                (n * 7919 + count * 104_729 + seg % 997 * 31 + cap + k) as u64;
                            let cfg = SimConfig {
                                seed,
                                seg_elems: seg,
                                link_capacity: cap,
                            };
                            // Deadlock freedom: run_programs fails on a stuck schedule.
                            run_programs_and_check(&call, &progs, &cfg, seed ^ 0x41E2);
                            runs += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(runs > 1000);
}

/// The pipelined hierarchical allreduce (chunks flowing from the host reduce-scatter through
/// the rails into the host all-gather while later chunks are still reduced): exact on every
/// host layout with 1–7 chunks, including more chunks than elements (empty chunks), odd and
/// prime counts and counts smaller than the world, with and without the final division, at
/// every segment size and link capacity: no deadlock from the chunks' interleaving in the
/// per-peer FIFOs.
#[test]
fn pipelined_hierarchical_all_reduce_is_exact_in_any_number_of_chunks() {
    let mut runs = 0;
    for (hosts, l) in HIER_LAYOUTS {
        let n = hosts * l;
        for count in [
            0,
            1,
            n.saturating_sub(1),
            n + 1,
            2 * n + 1,
            13,
            97,
            4 * n * 7 + 3,
        ] {
            for chunks in [1, 2, 3, 7] {
                for fin in [false, true] {
                    let call = Call::new(Collective::AllReduce, Algorithm::Hierarchical, n, count)
                        .with_per_host(l)
                        .with_finalize(fin);
                    for &seg in &[1, 3, usize::MAX] {
                        let progs: Vec<Program> = (0..n)
                            .map(|r| {
                                let s = algo::hierarchical_all_reduce_in_chunks(
                                    n, r, count, fin, l, chunks,
                                );
                                compile(&s, seg)
                            })
                            .collect();
                        for &cap in &CAPS {
                            let seed = (n * 31 + count * 7 + chunks * 5 + cap) as u64;
                            let cfg = SimConfig {
                                seed,
                                seg_elems: seg,
                                link_capacity: cap,
                            };
                            let out = run_programs_and_check(&call, &progs, &cfg, seed ^ 0xC4);
                            // Chunking moves the same elements: the ring's 2(n−1)/n per rank
                            // in total, whatever the number of chunks.
                            if chunks == 1 {
                                continue;
                            }
                            let one: Vec<Program> = (0..n)
                                .map(|r| {
                                    let s = algo::hierarchical_all_reduce_in_chunks(
                                        n, r, count, fin, l, 1,
                                    );
                                    compile(&s, seg)
                                })
                                .collect();
                            let base = sim::run_programs(&one, call.random_inputs(1), &cfg)
                                .expect("one chunk runs");
                            assert_eq!(
                                out.elems_sent(),
                                base.elems_sent(),
                                "hosts {hosts} l {l} count {count} chunks {chunks}"
                            );
                            runs += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(runs > 500, "{runs}");
}

/// The engine's choice of chunks: one until every rail sub-block holds
/// `HIER_MIN_SUB_ELEMS`, then more with the count, at most `HIER_MAX_CHUNKS`; and the
/// schedule of a count that chunks is the chunked one.
#[test]
fn hierarchical_all_reduce_pipelines_large_buffers_in_chunks() {
    use dspark::internals::plan::algo::{hier_chunks, HIER_MAX_CHUNKS, HIER_MIN_SUB_ELEMS};
    let unit = HIER_MIN_SUB_ELEMS * 2 * 2;
    assert_eq!(hier_chunks(0, 2, 2), 1);
    assert_eq!(hier_chunks(unit - 1, 2, 2), 1);
    assert_eq!(hier_chunks(2 * unit, 2, 2), 2);
    assert_eq!(hier_chunks(5 * unit + 3, 2, 2), 5);
    assert_eq!(hier_chunks(usize::MAX, 2, 2), HIER_MAX_CHUNKS);
    assert_eq!(hier_chunks(usize::MAX, usize::MAX, usize::MAX), 1);
    let c = 3 * unit + 5;
    for r in 0..4 {
        assert_eq!(
            algo::hierarchical_all_reduce(4, r, c, true, 2),
            algo::hierarchical_all_reduce_in_chunks(4, r, c, true, 2, 3),
            "rank {r}"
        );
    }
}

#[test]
fn hierarchical_all_reduce_without_a_uniform_layout_runs_the_ring() {
    // 3+2 ranks (uneven hosts), interleaved hosts or no host information: per_host is 0
    // (`plan::uniform_per_host`), and every rank falls back to the same flat ring.
    use dspark::internals::plan::uniform_per_host;
    for hosts in [
        vec!["a", "a", "a", "b", "b"],
        vec!["a", "b", "a", "b"],
        vec!["a", "a", "b", "c", "c"],
    ] {
        let n = hosts.len();
        let l = uniform_per_host(&hosts);
        assert_eq!(l, 0, "{hosts:?}");
        for count in counts(n) {
            let hier = Call::new(Collective::AllReduce, Algorithm::Hierarchical, n, count)
                .with_per_host(l)
                .with_finalize(true);
            let ring =
                Call::new(Collective::AllReduce, Algorithm::Ring, n, count).with_finalize(true);
            assert_eq!(
                schedules(&hier),
                schedules(&ring),
                "{hosts:?} count {count}"
            );
            volumes(hier);
        }
    }
    // A per_host that does not divide the world is treated alike.
    for count in [0, 1, 5, 13] {
        let hier =
            Call::new(Collective::AllReduce, Algorithm::Hierarchical, 5, count).with_per_host(2);
        let ring = Call::new(Collective::AllReduce, Algorithm::Ring, 5, count);
        assert_eq!(schedules(&hier), schedules(&ring));
    }
}

/// Elements rank `r` of a hierarchical allreduce sends to ranks of other hosts, counted from
/// its schedule.
fn inter_host_elems(call: &Call, r: usize) -> usize {
    let l = call.per_host;
    let s = &schedules(call)[r];
    s.ops
        .iter()
        .map(|op| match *op {
            Op::Send { peer, src } if peer / l != r / l => src.len,
            _ => 0,
        })
        .sum()
}

#[test]
fn hierarchical_all_reduce_moves_the_rings_bytes_with_only_the_rail_share_between_hosts() {
    for (hosts, l) in HIER_LAYOUTS {
        let n = hosts * l;
        for count in counts(n).into_iter().chain([n * 12, n * 37, 1000]) {
            let call = Call::new(Collective::AllReduce, Algorithm::Hierarchical, n, count)
                .with_per_host(l);
            let ctx = format!("{hosts} hosts x {l} ranks, count {count}");
            let out = volumes(call);
            // The ring's total: every element travels 2(n−1) times across the job.
            assert_eq!(out.elems_sent(), 2 * (n - 1) * count, "{ctx}: total");
            for (r, st) in out.stats.iter().enumerate() {
                let (h, i) = (r / l, r % l);
                let a = |j: usize| dspark::internals::plan::block_range(count, l, j % l).len();
                let mine = a(i);
                let sub =
                    |k: usize| dspark::internals::plan::block_range(mine, hosts, k % hosts).len();
                // Host phases: every block but A(i) (reduce-scatter), every block but A(i+1)
                // (all-gather); the rail: A(i) but one sub-block, twice. Received: every
                // block but A(i−1), then every block but A(i); on the rail, A(i) but
                // sub-blocks h and h+1.
                let (rail, rail_in) = if hosts > 1 {
                    (
                        2 * mine - sub(h + 1) - sub(h + 2),
                        2 * mine - sub(h) - sub(h + 1),
                    )
                } else {
                    (0, 0)
                };
                let (host, host_in) = if l > 1 {
                    (2 * count - a(i) - a(i + 1), 2 * count - a(i + l - 1) - a(i))
                } else {
                    (0, 0)
                };
                assert_eq!(st.elems_sent, host + rail, "{ctx} rank {r}: sent");
                assert_eq!(
                    st.elems_received,
                    host_in + rail_in,
                    "{ctx} rank {r}: received"
                );
                if l > 1 {
                    assert_eq!(
                        inter_host_elems(&call, r),
                        rail,
                        "{ctx} rank {r}: between hosts"
                    );
                }
                if count % n == 0 {
                    assert_eq!(st.elems_sent, 2 * (n - 1) * count / n, "{ctx} rank {r}");
                    assert_eq!(
                        inter_host_elems(&call, r) * n,
                        if l > 1 {
                            2 * (hosts - 1) * count
                        } else {
                            inter_host_elems(&call, r) * n
                        },
                        "{ctx} rank {r}: 2(H−1)/(H·L) of the buffer between hosts"
                    );
                }
            }
        }
    }
}

#[test]
fn recursive_doubling_all_reduce_gives_every_rank_the_sum_of_all_inputs() {
    sweep(Collective::AllReduce, Algorithm::RecursiveDoubling);
}

#[test]
fn tree_broadcast_copies_the_root_buffer_to_every_rank_from_every_root() {
    sweep(Collective::Broadcast, Algorithm::Tree);
}

#[test]
fn tree_reduce_leaves_the_sum_at_every_root() {
    sweep(Collective::Reduce, Algorithm::Tree);
}

#[test]
fn ring_all_gather_concatenates_every_rank_block_in_rank_order() {
    sweep(Collective::AllGather, Algorithm::Ring);
}

#[test]
fn ring_reduce_scatter_leaves_block_r_of_the_sum_on_rank_r() {
    sweep(Collective::ReduceScatter, Algorithm::Ring);
}

#[test]
fn chain_broadcast_copies_the_root_buffer_to_every_rank_from_every_root() {
    sweep(Collective::Broadcast, Algorithm::Chain);
}

#[test]
fn binomial_tree_broadcast_copies_the_root_buffer_to_every_rank_from_every_root() {
    sweep(Collective::Broadcast, Algorithm::BinomialTree);
}

#[test]
fn chain_reduce_leaves_the_sum_at_every_root() {
    sweep(Collective::Reduce, Algorithm::Chain);
}

#[test]
fn binomial_tree_reduce_leaves_the_sum_at_every_root() {
    sweep(Collective::Reduce, Algorithm::BinomialTree);
}

#[test]
fn pairwise_all_to_all_moves_block_j_of_rank_i_to_block_i_of_rank_j() {
    sweep(Collective::AllToAll, Algorithm::Pairwise);
}

#[test]
fn direct_send_recv_delivers_the_message_between_every_pair_of_ranks() {
    sweep(Collective::SendRecv, Algorithm::Direct);
}

#[test]
fn dissemination_barrier_lets_no_rank_finish_before_hearing_from_every_rank() {
    sweep(Collective::Barrier, Algorithm::Dissemination);
}

// ---------------------------------------------------------------------------------------------
// Byte volumes.

/// One run with unit-free settings: volumes depend on neither seed nor segment size.
fn volumes(call: Call) -> SimOutcome {
    let cfg = SimConfig {
        seed: 11,
        seg_elems: 5,
        link_capacity: 1,
    };
    run_and_check(&call, &cfg, 5)
}

#[test]
fn ring_allreduce_moves_exactly_two_n_minus_one_over_n_of_the_buffer() {
    for n in 1..=MAX_WORLD {
        for count in counts(n).into_iter().chain([n * 12, n * 37]) {
            let out = volumes(Call::new(Collective::AllReduce, Algorithm::Ring, n, count));
            assert_eq!(
                out.elems_sent(),
                2 * (n - 1) * count,
                "n={n} count={count}: total"
            );
            if count % n == 0 {
                for (r, s) in out.stats.iter().enumerate() {
                    assert_eq!(
                        s.elems_sent,
                        2 * (n - 1) * count / n,
                        "n={n} count={count} rank {r}"
                    );
                    assert_eq!(
                        s.elems_received,
                        2 * (n - 1) * count / n,
                        "n={n} count={count} rank {r}"
                    );
                }
            }
        }
    }
}

/// Worlds 17..=64 for `algo`'s allreduce: each world gets `per_world` runs whose count,
/// segment size, link capacity, finalize and seeds are drawn from a fixed PRNG (so the
/// sample is the same on every run). Counts include 0, 1, counts below the world size and
/// odd counts.
fn sampled_calls(algo: Algorithm, per_world: usize) -> Vec<(Call, SimConfig, u64)> {
    let mut x = 0x7ee5_5eed_u64 ^ u64::from(algo.code());
    let mut next = move |m: usize| {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % m as u64) as usize
    };
    let mut out = Vec::new();
    for n in 17..=64 {
        for _ in 0..per_world {
            let count = match next(8) {
                0 => 0,
                1 => 1,
                2 => 2 + next(n - 2), // below the world size
                3 => n - 1,
                4 => n + 1,
                5 => 2 * n + 1,
                6 => 2 * next(300) + 1, // odd
                _ => next(1000),
            };
            let seg = [1, 2, 3, 7, 64, usize::MAX][next(6)];
            let cap = [1, 2, 4][next(3)];
            let call = Call::new(Collective::AllReduce, algo, n, count).with_finalize(next(2) == 1);
            let cfg = SimConfig {
                seed: next(1 << 30) as u64,
                seg_elems: seg,
                link_capacity: cap,
            };
            out.push((call, cfg, next(1 << 30) as u64));
        }
    }
    out
}

#[test]
fn double_binary_tree_all_reduce_gives_every_rank_the_sum_on_every_world_from_1_to_16() {
    sweep_worlds(Collective::AllReduce, Algorithm::Tree, 1..=16);
}

#[test]
fn double_binary_tree_all_reduce_gives_every_rank_the_sum_on_sampled_worlds_up_to_64() {
    sampled_worlds_up_to_64(Algorithm::Tree);
}

#[test]
fn rabenseifner_all_reduce_gives_every_rank_the_sum_on_every_world_from_1_to_16() {
    sweep_worlds(Collective::AllReduce, Algorithm::Rabenseifner, 1..=16);
}

#[test]
fn rabenseifner_all_reduce_gives_every_rank_the_sum_on_sampled_worlds_up_to_64() {
    sampled_worlds_up_to_64(Algorithm::Rabenseifner);
}

#[test]
fn one_shot_all_reduce_gives_every_rank_the_sum_on_every_world_from_1_to_16() {
    sweep_worlds(Collective::AllReduce, Algorithm::OneShot, 1..=16);
}

#[test]
fn one_shot_all_reduce_sends_the_buffer_to_every_peer_once_in_one_step() {
    for n in 1..=12 {
        for count in [1, 2, n + 1, 257] {
            let out = volumes(Call::new(
                Collective::AllReduce,
                Algorithm::OneShot,
                n,
                count,
            ));
            for (r, s) in out.stats.iter().enumerate() {
                let ctx = format!("n={n} count={count} rank {r}");
                assert_eq!(s.elems_sent, (n - 1) * count, "{ctx}: sent");
                assert_eq!(s.elems_received, (n - 1) * count, "{ctx}: received");
            }
        }
    }
}

/// [`sampled_calls`] for `algo`, each run against the reference.
fn sampled_worlds_up_to_64(algo: Algorithm) {
    let calls = sampled_calls(algo, 6);
    assert_eq!(calls.len(), 48 * 6);
    for (call, cfg, input_seed) in &calls {
        run_and_check(call, cfg, *input_seed);
    }
    // The sample covers what it claims to.
    assert!(calls.iter().any(|(c, ..)| c.count == 0));
    assert!(calls.iter().any(|(c, ..)| c.count > 0 && c.count < c.world));
    assert!(calls.iter().any(|(c, ..)| c.count % 2 == 1));
    assert!(calls
        .iter()
        .any(|(c, cfg, _)| c.count > 0 && cfg.link_capacity == 1));
}

/// What the double binary tree sends per rank, from the tree alone: each half once per tree
/// edge at the rank (to the parent on the way up, to each child on the way down).
fn tree_elems_per_rank(n: usize, r: usize, count: usize) -> usize {
    let halves = algo::double_binary_tree_halves(count);
    algo::double_binary_tree(n, r)
        .iter()
        .zip(halves)
        .map(|(t, h)| h.len * (usize::from(t.parent.is_some()) + t.children.len()))
        .sum()
}

#[test]
fn double_binary_tree_all_reduce_sends_each_half_once_per_tree_edge_and_at_most_2c_plus_1() {
    let mut worlds: Vec<(usize, usize)> = Vec::new();
    for n in 1..=16 {
        for count in counts(n).into_iter().chain([n * 12 + 1, 1000]) {
            worlds.push((n, count));
        }
    }
    for n in 17..=64 {
        for count in [1, n - 1, 2 * n + 1, 1000] {
            worlds.push((n, count));
        }
    }
    for (n, count) in worlds {
        let out = volumes(Call::new(Collective::AllReduce, Algorithm::Tree, n, count));
        let ctx = format!("n={n} count={count}");
        // Every tree edge carries its half once up and once down: 2(n−1) half-transfers per
        // tree, the same total as the ring.
        assert_eq!(out.elems_sent(), 2 * (n - 1) * count, "{ctx}: total");
        for (r, s) in out.stats.iter().enumerate() {
            let want = tree_elems_per_rank(n, r, count);
            assert_eq!(s.elems_sent, want, "{ctx} rank {r}: sent");
            assert_eq!(s.elems_received, want, "{ctx} rank {r}: received");
            // The bound that does not need the trees: a rank has children in at most one tree,
            // so it moves at most 3⌈c/2⌉ + ⌊c/2⌋ = 2c + (c mod 2) elements each way.
            assert!(
                s.elems_sent <= 2 * count + count % 2,
                "{ctx} rank {r}: sent {} > 2c + (c mod 2)",
                s.elems_sent
            );
        }
        // Odd worlds: rank 0 is a leaf in both trees and sends each half up once.
        if n % 2 == 1 && n > 1 {
            assert_eq!(out.stats[0].elems_sent, count, "{ctx}: rank 0");
        }
    }
}

/// What rank `r` of Rabenseifner's allreduce over `n` ranks and `count` elements sends, from
/// the block ownership alone (the largest power of two `p ≤ n` splits the buffer into blocks
/// of `block_range(count, p, i)`, and rank `r` ends the halving owning block `b` = its
/// log2 p bits reversed): in the halving every block but its own, once; in the doubling its
/// own block, then the aligned groups of 2, 4, ... p/2 blocks around it; plus the whole
/// buffer for a fold (ranks `p..n` to `r − p`, and back from `r < n − p`).
fn rabenseifner_elems_sent(n: usize, r: usize, count: usize) -> usize {
    let p = if n.is_power_of_two() {
        n
    } else {
        n.next_power_of_two() / 2
    };
    if r >= p {
        return count;
    }
    let bits = p.trailing_zeros();
    let b = if bits == 0 {
        0
    } else {
        r.reverse_bits() >> (usize::BITS - bits)
    };
    let blocks = |lo: usize, hi: usize| -> usize {
        (lo..hi)
            .map(|i| dspark::internals::plan::block_range(count, p, i).len())
            .sum()
    };
    let mut sent = count - blocks(b, b + 1);
    let mut size = 1;
    while size < p {
        let lo = b / size * size;
        sent += blocks(lo, lo + size);
        size *= 2;
    }
    sent + if r < n - p { count } else { 0 }
}

#[test]
fn rabenseifner_moves_the_rings_bytes_per_rank_and_the_fold_once_each_way() {
    for n in 1..=64 {
        let counts: Vec<usize> = if n <= 16 {
            counts(n).into_iter().chain([n * 12 + 1, 1000]).collect()
        } else {
            vec![1, n - 1, 2 * n + 1, 1000]
        };
        for count in counts {
            let out = volumes(Call::new(
                Collective::AllReduce,
                Algorithm::Rabenseifner,
                n,
                count,
            ));
            let ctx = format!("n={n} count={count}");
            // The ring's total: every rank but one's data reaches every other once, reduced
            // on one rank and copied back, 2(n−1)·count in all.
            assert_eq!(out.elems_sent(), 2 * (n - 1) * count, "{ctx}: total");
            for (r, s) in out.stats.iter().enumerate() {
                let want = rabenseifner_elems_sent(n, r, count);
                assert_eq!(s.elems_sent, want, "{ctx} rank {r}: sent");
                assert_eq!(s.elems_received, want, "{ctx} rank {r}: received");
            }
            // Powers of two with an even split: exactly the ring's 2(n−1)/n per rank.
            if n.is_power_of_two() && count % n == 0 {
                for s in &out.stats {
                    assert_eq!(s.elems_sent, 2 * (n - 1) * count / n, "{ctx}");
                }
            }
        }
    }
}

#[test]
fn ring_all_gather_and_reduce_scatter_send_n_minus_one_blocks_per_rank() {
    for n in 1..=MAX_WORLD {
        for count in counts(n) {
            for coll in [Collective::AllGather, Collective::ReduceScatter] {
                let out = volumes(Call::new(coll, Algorithm::Ring, n, count));
                for (r, s) in out.stats.iter().enumerate() {
                    assert_eq!(
                        s.elems_sent,
                        (n - 1) * count,
                        "{coll} n={n} count={count} rank {r}"
                    );
                    assert_eq!(
                        s.elems_received,
                        (n - 1) * count,
                        "{coll} n={n} count={count} rank {r}"
                    );
                }
            }
        }
    }
}

#[test]
fn recursive_doubling_sends_log2_n_buffers_per_rank_for_powers_of_two() {
    for n in [1usize, 2, 4, 8] {
        for count in counts(n) {
            let out = volumes(Call::new(
                Collective::AllReduce,
                Algorithm::RecursiveDoubling,
                n,
                count,
            ));
            let log2 = n.trailing_zeros() as usize;
            for (r, s) in out.stats.iter().enumerate() {
                assert_eq!(s.elems_sent, log2 * count, "n={n} count={count} rank {r}");
            }
        }
    }
}

#[test]
fn recursive_doubling_folds_extra_ranks_in_with_two_more_buffer_transfers_each() {
    // Non-powers of two: p = largest power of two ≤ n; each of the n − p extra ranks costs one
    // buffer in and one buffer out on top of the p·log2(p) exchanges.
    for n in [3usize, 5, 6, 7, 9] {
        let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
        let log2p = p.trailing_zeros() as usize;
        for count in [1, 13, 100] {
            let out = volumes(Call::new(
                Collective::AllReduce,
                Algorithm::RecursiveDoubling,
                n,
                count,
            ));
            assert_eq!(
                out.elems_sent(),
                (p * log2p + 2 * (n - p)) * count,
                "n={n} count={count}"
            );
        }
    }
}

#[test]
fn pairwise_all_to_all_sends_n_minus_one_blocks_per_rank() {
    for n in 1..=MAX_WORLD {
        for count in counts(n) {
            let out = volumes(Call::new(
                Collective::AllToAll,
                Algorithm::Pairwise,
                n,
                count,
            ));
            for (r, s) in out.stats.iter().enumerate() {
                assert_eq!(
                    s.elems_sent,
                    (n - 1) * count,
                    "n={n} count={count} rank {r}"
                );
                assert_eq!(
                    s.elems_received,
                    (n - 1) * count,
                    "n={n} count={count} rank {r}"
                );
            }
        }
    }
}

#[test]
fn chain_broadcast_sends_the_buffer_once_from_every_rank_but_the_last() {
    for n in 1..=MAX_WORLD {
        for root in 0..n {
            for count in [0, 1, 7, 100] {
                let call =
                    Call::new(Collective::Broadcast, Algorithm::Chain, n, count).with_root(root);
                let out = volumes(call);
                let last = (root + n - 1) % n;
                for (r, s) in out.stats.iter().enumerate() {
                    let want = if r == last { 0 } else { count };
                    assert_eq!(
                        s.elems_sent, want,
                        "n={n} root={root} count={count} rank {r}"
                    );
                }
            }
        }
    }
}

#[test]
fn rooted_collectives_move_the_buffer_exactly_once_into_every_non_root_rank() {
    // Broadcast: every non-root receives the buffer once; reduce: every non-root sends once.
    for n in 1..=MAX_WORLD {
        for root in 0..n {
            for algo in [Algorithm::Chain, Algorithm::BinomialTree] {
                for count in [1, 13] {
                    let b =
                        volumes(Call::new(Collective::Broadcast, algo, n, count).with_root(root));
                    let red =
                        volumes(Call::new(Collective::Reduce, algo, n, count).with_root(root));
                    for r in 0..n {
                        let want = if r == root { 0 } else { count };
                        let ctx = format!("{algo} n={n} root={root} count={count} rank {r}");
                        assert_eq!(b.stats[r].elems_received, want, "broadcast {ctx}");
                        assert_eq!(red.stats[r].elems_sent, want, "reduce {ctx}");
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Programs the simulator must reject.

fn empty_inputs(n: usize, dst: usize) -> Vec<Buffers> {
    (0..n)
        .map(|r| Buffers {
            src: vec![],
            dst: (0..dst as u64).map(|e| e + 10 * r as u64).collect(),
        })
        .collect()
}

#[test]
fn a_pair_of_schedules_that_both_receive_first_is_reported_as_a_deadlock() {
    // Each rank waits for the other's data before forwarding its own buffer.
    let sched = |peer| {
        let mut s = Schedule::new();
        s.round().recv_copy(peer, Loc::dst(0..4));
        s.round().send(peer, Loc::dst(0..4));
        s
    };
    let progs = vec![compile(&sched(1), 64), compile(&sched(0), 64)];
    for cap in CAPS {
        let cfg = SimConfig {
            seed: 1,
            seg_elems: 64,
            link_capacity: cap,
        };
        let err = sim::run_programs(&progs, empty_inputs(2, 4), &cfg).unwrap_err();
        let SimError::Deadlock { stuck } = &err else {
            panic!("expected a deadlock, got {err}")
        };
        assert_eq!(stuck.iter().map(|s| s.rank).collect::<Vec<_>>(), vec![0, 1]);
        for s in stuck {
            assert_eq!((s.done, s.total), (0, 2));
            assert_eq!(s.blocked[0].step, 0);
            assert_eq!(s.blocked[0].reason, BlockReason::NoFrame);
            assert_eq!(s.blocked[1].step, 1);
            assert_eq!(s.blocked[1].reason, BlockReason::Dependencies(vec![0]));
        }
        let msg = err.to_string();
        assert!(
            msg.contains("deadlock") && msg.contains("rank 0") && msg.contains("rank 1"),
            "{msg}"
        );
    }
}

#[test]
fn mismatched_send_and_receive_lengths_are_reported_with_both_steps() {
    let mut s0 = Schedule::new();
    s0.round().send(1, Loc::dst(0..3));
    let mut s1 = Schedule::new();
    s1.round().recv_copy(0, Loc::dst(0..2));
    let progs = vec![compile(&s0, 64), compile(&s1, 64)];
    let err = sim::run_programs(&progs, empty_inputs(2, 3), &SimConfig::default()).unwrap_err();
    assert_eq!(
        err,
        SimError::LengthMismatch {
            sender: 0,
            send_step: 0,
            receiver: 1,
            recv_step: 0,
            sent: 3,
            expected: 2
        }
    );
    let msg = err.to_string();
    assert!(
        msg.contains("rank 1 step 0") && msg.contains("rank 0"),
        "{msg}"
    );
}

#[test]
fn requests_for_an_algorithm_that_does_not_implement_the_collective_are_refused() {
    let call = Call::new(Collective::AllGather, Algorithm::Chain, 3, 4);
    assert!(matches!(
        call.run(call.random_inputs(0), &SimConfig::default()),
        Err(SimError::BadSetup(_))
    ));
}

// ---------------------------------------------------------------------------------------------
// The reference catches broken schedules (the checks above can fail).

/// Rebuilds `s` round by round, passing each op through `f` (which may drop or add ops).
fn mutate(s: &Schedule, mut f: impl FnMut(&Op, &mut Schedule)) -> Schedule {
    let mut out = Schedule::new();
    for round in s.rounds() {
        out.round();
        for op in round {
            f(op, &mut out);
        }
    }
    out
}

/// Runs per-rank schedules on `call`'s inputs; true when the outcome matches the reference.
fn matches_reference(call: &Call, scheds: &[Schedule], seed: u64) -> bool {
    let progs: Vec<_> = scheds.iter().map(|s| compile(s, 3)).collect();
    let inputs = call.random_inputs(seed);
    let cfg = SimConfig {
        seed,
        seg_elems: 3,
        link_capacity: 1,
    };
    let Ok(out) = sim::run_programs(&progs, inputs.clone(), &cfg) else {
        return false;
    };
    call.expected(&inputs)
        .iter()
        .zip(&out.buffers)
        .all(|(w, b)| w.as_ref().is_none_or(|w| *w == b.dst))
}

fn schedules(call: &Call) -> Vec<Schedule> {
    call.requests()
        .unwrap()
        .iter()
        .map(|r| schedule(r.as_ref().unwrap()).unwrap())
        .collect()
}

#[test]
fn a_ring_that_reduces_where_it_should_copy_is_caught_by_the_reference() {
    let call = Call::new(Collective::AllReduce, Algorithm::Ring, 4, 10);
    let good = schedules(&call);
    assert!(matches_reference(&call, &good, 1));
    let mut bad = good.clone();
    bad[2] = mutate(&good[2], |op, s| match *op {
        Op::Recv {
            peer,
            dst,
            acc: None,
        } => {
            s.push(Op::Recv {
                peer,
                dst,
                acc: Some(dst),
            });
        }
        _ => {
            s.push(*op);
        }
    });
    assert!(!matches_reference(&call, &bad, 1));
}

#[test]
fn a_missing_or_doubled_finalize_is_caught_by_the_reference() {
    for algo in [
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::Tree,
        Algorithm::Rabenseifner,
        Algorithm::OneShot,
    ] {
        let call = Call::new(Collective::AllReduce, algo, 5, 11).with_finalize(true);
        let good = schedules(&call);
        assert!(matches_reference(&call, &good, 2), "{algo}");
        let dropped: Vec<_> = good
            .iter()
            .map(|s| {
                mutate(s, |op, s| {
                    if !matches!(op, Op::Finalize { .. }) {
                        s.push(*op);
                    }
                })
            })
            .collect();
        assert!(
            !matches_reference(&call, &dropped, 2),
            "{algo} without finalize"
        );
        let doubled: Vec<_> = good
            .iter()
            .map(|s| {
                mutate(s, |op, s| {
                    s.push(*op);
                    if matches!(op, Op::Finalize { .. }) {
                        s.push(*op);
                    }
                })
            })
            .collect();
        assert!(
            !matches_reference(&call, &doubled, 2),
            "{algo} finalizing twice"
        );
    }
    // The factor really is odd (invertible), so K·x = x only for x = 0.
    assert_eq!(FINALIZE_FACTOR % 2, 1);
}

#[test]
fn a_double_binary_tree_whose_ranks_disagree_about_up_before_down_is_caught() {
    // Frames on a link match only because both ends list a segment's up op before its down
    // op: on odd ranks, move the down ops (the copy from the parent, the sends to the
    // children) in front of the up ops; the reference (or a deadlock) must catch it.
    for (n, count) in [(2, 1), (5, 11), (8, 40)] {
        let call = Call::new(Collective::AllReduce, Algorithm::Tree, n, count);
        let good = schedules(&call);
        assert!(matches_reference(&call, &good, 3), "n={n}");
        let mut bad = good.clone();
        for (r, s) in bad.iter_mut().enumerate().filter(|(r, _)| r % 2 == 1) {
            let children: Vec<usize> = algo::double_binary_tree(n, r)
                .iter()
                .flat_map(|t| t.children.clone())
                .collect();
            let down = |op: &Op| match *op {
                Op::Recv { acc: None, .. } => true,
                Op::Send { peer, .. } => children.contains(&peer),
                _ => false,
            };
            let mut moved = Schedule::new();
            moved.round();
            for op in s.ops.iter().filter(|op| down(op)) {
                moved.push(*op);
            }
            for op in s.ops.iter().filter(|op| !down(op)) {
                moved.push(*op);
            }
            *s = moved;
        }
        assert!(!matches_reference(&call, &bad, 3), "n={n}");
    }
}

/// `call` compiled, then every step's dependencies removed: some seed of the simulator (with
/// links of `capacity` frames) must expose it, as a wrong result or an error.
fn missing_dependencies_are_caught(call: Call, capacity: usize) {
    let mut progs = call.programs(3).unwrap();
    for p in &mut progs {
        for st in &mut p.steps {
            st.deps = (0, 0);
        }
    }
    let inputs = call.random_inputs(9);
    let want = call.expected(&inputs);
    let caught = (0..20).any(|seed| {
        let cfg = SimConfig {
            seed,
            seg_elems: 3,
            link_capacity: capacity,
        };
        match sim::run_programs(&progs, inputs.clone(), &cfg) {
            Ok(out) => out
                .buffers
                .iter()
                .zip(&want)
                .any(|(b, w)| Some(&b.dst) != w.as_ref()),
            Err(_) => true,
        }
    });
    assert!(caught, "no seed exposed the missing dependencies");
}

#[test]
fn a_compiled_double_binary_tree_without_its_dependencies_is_caught_by_some_seed() {
    missing_dependencies_are_caught(Call::new(Collective::AllReduce, Algorithm::Tree, 6, 24), 4);
}

#[test]
fn a_compiled_ring_without_its_dependencies_is_caught_by_some_seed() {
    missing_dependencies_are_caught(Call::new(Collective::AllReduce, Algorithm::Ring, 3, 9), 1);
}
