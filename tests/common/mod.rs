//! Shared test code: deterministic inputs, an independent reference for every collective,
//! and a matrix runner that checks every collective × type × operator × count on one
//! communicator. The reference is plain scalar code written here, independent of
//! `dspark::internals::reduce` and of the schedules.

#![allow(dead_code)]

pub(crate) mod procs;

use std::time::Duration;

use dspark::internals::transport::mem::MemFabric;
use dspark::{Communicator, Config, Element, ReduceOp};
use half::{bf16, f16};

/// SplitMix64: deterministic per (seed, rank, index).
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn rnd(seed: u64, rank: usize, i: usize) -> u64 {
    mix(seed ^ mix((rank as u64) << 32 ^ i as u64))
}

/// Float total-order min/max as the library defines them: NaN wins, −0 < +0.
fn fmin(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if a == b {
        if a.is_sign_negative() {
            a
        } else {
            b
        }
    } else if a < b {
        a
    } else {
        b
    }
}

fn fmax(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if a == b {
        if a.is_sign_positive() {
            a
        } else {
            b
        }
    } else if a > b {
        a
    } else {
        b
    }
}

/// Test-side knowledge of an element type: exact inputs and the reference reduction.
pub(crate) trait TestElem: Element + Copy {
    /// An input value for rank `rank`, element `i`, chosen so that every reduction order gives
    /// the same exact result.
    fn input(op: ReduceOp, seed: u64, rank: usize, i: usize) -> Self;
    /// One reference reduction step.
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    /// The final division of Avg.
    fn avg(sum: Self, world: usize) -> Self;
    /// Bitwise equality (NaN == NaN).
    fn same(a: Self, b: Self) -> bool {
        bytemuck::bytes_of(&a) == bytemuck::bytes_of(&b)
    }
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl TestElem for $t {
            fn input(_op: ReduceOp, seed: u64, rank: usize, i: usize) -> Self {
                // Full range: wrapping Sum/Prod are associative and commutative.
                rnd(seed, rank, i) as $t
            }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            fn avg(sum: Self, world: usize) -> Self {
                sum / (world as $t)
            }
        }
    )*};
}
int_elem!(i8, u8, i32, u32, i64, u64);

/// Small exact inputs for floats: sums of ≤ 9 values in [-12, 12] and products of ±1/±2 are
/// exact in every float type including bf16 (8 significant bits).
fn float_input(op: ReduceOp, seed: u64, rank: usize, i: usize) -> f64 {
    let r = rnd(seed, rank, i);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => (r % 25) as f64 - 12.0,
        ReduceOp::Prod => [1.0, -1.0, 2.0, -2.0, 0.5, 1.0, -1.0][(r % 7) as usize],
        ReduceOp::Min | ReduceOp::Max => {
            let v = ((r % 2001) as f64 - 1000.0) / 8.0;
            if r.is_multiple_of(53) {
                -0.0
            } else if r.is_multiple_of(59) {
                0.0
            } else {
                v
            }
        }
    }
}

fn float_combine(op: ReduceOp, a: f64, b: f64) -> f64 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => a + b,
        ReduceOp::Prod => a * b,
        ReduceOp::Min => fmin(a, b),
        ReduceOp::Max => fmax(a, b),
    }
}

impl TestElem for f32 {
    fn input(op: ReduceOp, seed: u64, rank: usize, i: usize) -> Self {
        float_input(op, seed, rank, i) as f32
    }
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
        float_combine(op, a as f64, b as f64) as f32
    }
    fn avg(sum: Self, world: usize) -> Self {
        sum / world as f32
    }
}

impl TestElem for f64 {
    fn input(op: ReduceOp, seed: u64, rank: usize, i: usize) -> Self {
        float_input(op, seed, rank, i)
    }
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
        float_combine(op, a, b)
    }
    fn avg(sum: Self, world: usize) -> Self {
        sum / world as f64
    }
}

impl TestElem for f16 {
    fn input(op: ReduceOp, seed: u64, rank: usize, i: usize) -> Self {
        f16::from_f64(float_input(op, seed, rank, i))
    }
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
        f16::from_f32(float_combine(op, a.to_f64(), b.to_f64()) as f32)
    }
    fn avg(sum: Self, world: usize) -> Self {
        f16::from_f32(sum.to_f32() / world as f32)
    }
}

impl TestElem for bf16 {
    fn input(op: ReduceOp, seed: u64, rank: usize, i: usize) -> Self {
        bf16::from_f64(float_input(op, seed, rank, i))
    }
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
        bf16::from_f32(float_combine(op, a.to_f64(), b.to_f64()) as f32)
    }
    fn avg(sum: Self, world: usize) -> Self {
        bf16::from_f32(sum.to_f32() / world as f32)
    }
}

pub(crate) fn inputs<T: TestElem>(op: ReduceOp, seed: u64, rank: usize, n: usize) -> Vec<T> {
    (0..n).map(|i| T::input(op, seed, rank, i)).collect()
}

/// The reduction of every rank's input, element by element, in rank order.
pub(crate) fn reduced<T: TestElem>(op: ReduceOp, seed: u64, world: usize, n: usize) -> Vec<T> {
    (0..n)
        .map(|i| {
            let mut acc = T::input(op, seed, 0, i);
            for r in 1..world {
                acc = T::combine(op, acc, T::input(op, seed, r, i));
            }
            if op == ReduceOp::Avg {
                acc = T::avg(acc, world);
            }
            acc
        })
        .collect()
}

pub(crate) fn check<T: TestElem>(what: &str, got: &[T], want: &[T]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} != {}", got.len(), want.len()));
    }
    let wrong: Vec<usize> = (0..got.len())
        .filter(|&i| !T::same(got[i], want[i]))
        .collect();
    if let Some(&i) = wrong.first() {
        return Err(format!(
            "{what}: {} of {} elements wrong; first at {i}: got {:?}, want {:?}",
            wrong.len(),
            got.len(),
            got[i],
            want[i]
        ));
    }
    Ok(())
}

/// Runs every collective for type `T` and operator `op` at `count` and checks the results.
pub(crate) fn run_all_collectives<T: TestElem>(
    comm: &Communicator,
    op: ReduceOp,
    count: usize,
    seed: u64,
) -> Result<(), String> {
    let n = comm.world_size();
    let r = comm.rank();
    let e = |what: &str| {
        let what = what.to_string();
        move |err: dspark::Error| format!("{what}: {err}")
    };
    let ctx = format!("{} {} count {count} world {n} rank {r}", T::DATA_TYPE, op);

    // all_reduce
    let mut buf = inputs::<T>(op, seed, r, count);
    comm.all_reduce(&mut buf, op)
        .map_err(e(&format!("all_reduce {ctx}")))?;
    check(
        &format!("all_reduce {ctx}"),
        &buf,
        &reduced::<T>(op, seed, n, count),
    )?;

    // reduce_scatter: every rank's send is count × n; rank r gets block r.
    let send = inputs::<T>(op, seed ^ 1, r, count * n);
    let mut recv = vec![T::default(); count];
    comm.reduce_scatter(&send, &mut recv, op)
        .map_err(e(&format!("reduce_scatter {ctx}")))?;
    let full = reduced::<T>(op, seed ^ 1, n, count * n);
    check(
        &format!("reduce_scatter {ctx}"),
        &recv,
        &full[r * count..(r + 1) * count],
    )?;

    // reduce to every root in turn.
    for root in 0..n {
        let mut buf = inputs::<T>(op, seed ^ 2, r, count);
        comm.reduce(&mut buf, op, root)
            .map_err(e(&format!("reduce root {root} {ctx}")))?;
        if r == root {
            check(
                &format!("reduce root {root} {ctx}"),
                &buf,
                &reduced::<T>(op, seed ^ 2, n, count),
            )?;
        }
    }

    if op == ReduceOp::Sum {
        // Non-reducing collectives: once per type.
        let mine = inputs::<T>(op, seed ^ 3, r, count);
        let mut all = vec![T::default(); count * n];
        comm.all_gather(&mine, &mut all)
            .map_err(e(&format!("all_gather {ctx}")))?;
        let want: Vec<T> = (0..n)
            .flat_map(|q| inputs::<T>(op, seed ^ 3, q, count))
            .collect();
        check(&format!("all_gather {ctx}"), &all, &want)?;

        for root in 0..n {
            let mut buf = if r == root {
                inputs::<T>(op, seed ^ 4, root, count)
            } else {
                vec![T::default(); count]
            };
            comm.broadcast(&mut buf, root)
                .map_err(e(&format!("broadcast root {root} {ctx}")))?;
            check(
                &format!("broadcast root {root} {ctx}"),
                &buf,
                &inputs::<T>(op, seed ^ 4, root, count),
            )?;
        }

        let send = inputs::<T>(op, seed ^ 5, r, count * n);
        let mut recv = vec![T::default(); count * n];
        comm.all_to_all(&send, &mut recv)
            .map_err(e(&format!("all_to_all {ctx}")))?;
        let want: Vec<T> = (0..n)
            .flat_map(|j| {
                inputs::<T>(op, seed ^ 5, j, count * n)[r * count..(r + 1) * count].to_vec()
            })
            .collect();
        check(&format!("all_to_all {ctx}"), &recv, &want)?;

        // send/recv around a ring: even ranks send first, odd ranks receive first.
        if n > 1 && count > 0 {
            let right = (r + 1) % n;
            let left = (r + n - 1) % n;
            let mine = inputs::<T>(op, seed ^ 6, r, count);
            let mut got = vec![T::default(); count];
            if r.is_multiple_of(2) {
                comm.send(&mine, right).map_err(e(&format!("send {ctx}")))?;
                comm.recv(&mut got, left)
                    .map_err(e(&format!("recv {ctx}")))?;
            } else {
                comm.recv(&mut got, left)
                    .map_err(e(&format!("recv {ctx}")))?;
                comm.send(&mine, right).map_err(e(&format!("send {ctx}")))?;
            }
            check(
                &format!("send/recv {ctx}"),
                &got,
                &inputs::<T>(op, seed ^ 6, left, count),
            )?;
        }
        comm.barrier().map_err(e(&format!("barrier {ctx}")))?;
    }
    Ok(())
}

/// Runs `$f::<T>(comm, op, count, seed)?` for every count of `$counts`, every operator and
/// each of the ten element types (the seed varies with count and operator); `Ok(())` after.
macro_rules! for_every_type_op_and_count {
    ($f:ident, $comm:expr, $counts:expr, $seed:expr) => {{
        for &count in $counts {
            for op in ReduceOp::ALL {
                let s = $seed ^ mix(count as u64) ^ (op as u64);
                $f::<f32>($comm, op, count, s)?;
                $f::<f64>($comm, op, count, s)?;
                $f::<f16>($comm, op, count, s)?;
                $f::<bf16>($comm, op, count, s)?;
                $f::<i8>($comm, op, count, s)?;
                $f::<u8>($comm, op, count, s)?;
                $f::<i32>($comm, op, count, s)?;
                $f::<u32>($comm, op, count, s)?;
                $f::<i64>($comm, op, count, s)?;
                $f::<u64>($comm, op, count, s)?;
            }
        }
        Ok(())
    }};
}

/// The whole matrix for one communicator: every type, every operator, every count.
pub(crate) fn run_matrix(comm: &Communicator, counts: &[usize], seed: u64) -> Result<(), String> {
    for_every_type_op_and_count!(run_all_collectives, comm, counts, seed)
}

/// The collectives `DSPARK_ALGO=tree` applies to, for type `T` and operator `op` at `count`:
/// all_reduce (the double binary tree), reduce to one root and, for `Sum`, broadcast from
/// another (the binomial tree). The roots move with the count so that a list of counts
/// covers several.
pub(crate) fn run_tree_collectives<T: TestElem>(
    comm: &Communicator,
    op: ReduceOp,
    count: usize,
    seed: u64,
) -> Result<(), String> {
    let n = comm.world_size();
    let r = comm.rank();
    let ctx = format!("{} {} count {count} world {n} rank {r}", T::DATA_TYPE, op);
    let mut buf = inputs::<T>(op, seed, r, count);
    comm.all_reduce(&mut buf, op)
        .map_err(|e| format!("all_reduce {ctx}: {e}"))?;
    check(
        &format!("all_reduce {ctx}"),
        &buf,
        &reduced::<T>(op, seed, n, count),
    )?;
    let root = count % n;
    let mut buf = inputs::<T>(op, seed ^ 2, r, count);
    comm.reduce(&mut buf, op, root)
        .map_err(|e| format!("reduce root {root} {ctx}: {e}"))?;
    if r == root {
        check(
            &format!("reduce root {root} {ctx}"),
            &buf,
            &reduced::<T>(op, seed ^ 2, n, count),
        )?;
    }
    if op == ReduceOp::Sum {
        let root = (count + 1) % n;
        let mut buf = if r == root {
            inputs::<T>(op, seed ^ 4, root, count)
        } else {
            vec![T::default(); count]
        };
        comm.broadcast(&mut buf, root)
            .map_err(|e| format!("broadcast root {root} {ctx}: {e}"))?;
        check(
            &format!("broadcast root {root} {ctx}"),
            &buf,
            &inputs::<T>(op, seed ^ 4, root, count),
        )?;
    }
    Ok(())
}

/// [`run_tree_collectives`] for every type, every operator, every count.
pub(crate) fn run_tree_matrix(
    comm: &Communicator,
    counts: &[usize],
    seed: u64,
) -> Result<(), String> {
    for_every_type_op_and_count!(run_tree_collectives, comm, counts, seed)
}

/// A configuration for ranks over `mem`: this deadline and segment size, defaults otherwise.
pub(crate) fn mem_config(timeout: Duration, segment_bytes: usize) -> Config {
    let mut c = Config::new(0, 1, "");
    c.timeout = timeout;
    c.segment_bytes = segment_bytes;
    c
}

/// Runs `f` on `world` ranks (threads) over one `mem` fabric and returns each rank's result.
pub(crate) fn run_mem_ranks<R: Send>(
    fabric: &MemFabric,
    world: usize,
    cfg: &Config,
    f: impl Fn(&Communicator) -> R + Sync,
) -> Vec<R> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let f = &f;
                let t = fabric.transport(r);
                s.spawn(move || {
                    let comm = Communicator::from_transport(r, world, Box::new(t), cfg).unwrap();
                    f(&comm)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// The traffic of the tests of connections on first use: every rank sends a small message to
/// each rank outside `partners` (values a formula of sender and receiver), then receives one
/// from each — the sends are small, so they must not wait for the receiver's matching call —
/// and then an all_to_all over every pair, exact against a formula.
pub(crate) fn exchange_beyond_partners(
    comm: &Communicator,
    partners: &[usize],
) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let others: Vec<usize> = (0..n)
        .filter(|q| *q != r && !partners.contains(q))
        .collect();
    let msg = |from: usize, to: usize| vec![(from * 1000 + to) as i64; 3 + from % 4];
    for &q in &others {
        comm.send(&msg(r, q), q)
            .map_err(|e| format!("send to {q}: {e}"))?;
    }
    for &q in &others {
        let mut got = vec![0i64; 3 + q % 4];
        comm.recv(&mut got, q)
            .map_err(|e| format!("recv from {q}: {e}"))?;
        check(&format!("recv from {q}"), &got, &msg(q, r))?;
    }
    all_to_all_exact(comm)
}

/// An all_to_all over every pair (5 values per pair, a formula of sender, receiver and
/// index), then an all_to_all_v of blocks of every size (empty, small, over a segment), exact.
pub(crate) fn all_to_all_exact(comm: &Communicator) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let b = 5;
    let send: Vec<i32> = (0..n * b).map(|i| (r * 10_000 + i) as i32).collect();
    let mut recv = vec![0i32; n * b];
    comm.all_to_all(&send, &mut recv)
        .map_err(|e| format!("all_to_all: {e}"))?;
    let want: Vec<i32> = (0..n)
        .flat_map(|q| (0..b).map(move |j| (q * 10_000 + r * b + j) as i32))
        .collect();
    check("all_to_all", &recv, &want)?;
    // All-to-all-v: blocks of 0 to 6 elements, and rank 0's block for the last rank longer
    // than a 512 KiB segment; each element names its sender, its receiver and its place.
    let count = |i: usize, j: usize| {
        if i == 0 && j == n - 1 {
            131_101
        } else {
            (i * 3 + j * 5) % 7
        }
    };
    let block =
        |i: usize, j: usize| (0..count(i, j)).map(move |k| ((i * n + j) * 200_000 + k) as i32);
    let send_counts: Vec<usize> = (0..n).map(|j| count(r, j)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|i| count(i, r)).collect();
    let send: Vec<i32> = (0..n).flat_map(|j| block(r, j)).collect();
    let mut recv = vec![-1i32; recv_counts.iter().sum()];
    comm.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)
        .map_err(|e| format!("all_to_all_v: {e}"))?;
    let want: Vec<i32> = (0..n).flat_map(|i| block(i, r)).collect();
    check("all_to_all_v", &recv, &want)
}

/// An all_reduce of 1031 f64 (rank r holds r·1031 + i) against its closed form:
/// Σ_q (q·count + i) = count·n(n−1)/2 + n·i.
pub(crate) fn all_reduce_closed_form(comm: &Communicator) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let count = 1031;
    let mut v: Vec<f64> = (0..count).map(|i| (r * count + i) as f64).collect();
    comm.all_reduce(&mut v, ReduceOp::Sum)
        .map_err(|e| format!("all_reduce: {e}"))?;
    let closed: Vec<f64> = (0..count)
        .map(|i| (count * n * (n - 1) / 2 + n * i) as f64)
        .collect();
    check("all_reduce", &v, &closed)
}
