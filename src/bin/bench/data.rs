//! What the bench computes and checks: the element types with exact arithmetic, each rank's
//! inputs (small integers, so every result is exact in every type, nccl-tests' "verifiable"
//! idea), the expected outputs per collective, and the count of wrong elements.

use cudarc::driver::DeviceRepr;
use dspark::{Communicator, Element, ReduceOp};
use half::{bf16, f16};

use crate::sizes::v_counts;
use crate::{Args, Coll};

/// Values chosen so every result is exact in every type (nccl-tests' "verifiable" idea).
pub(crate) trait BenchElem: Element + Copy + DeviceRepr {
    fn from_i64(v: i64) -> Self;
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    fn div(a: Self, n: usize) -> Self;
}

macro_rules! bench_int {
    ($($t:ty),*) => {$(
        impl BenchElem for $t {
            fn from_i64(v: i64) -> Self { v as $t }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            // In i128: the world size may not fit the element type (i8 with 200 ranks).
            fn div(a: Self, n: usize) -> Self { (a as i128 / n as i128) as $t }
        }
    )*};
}
bench_int!(i8, u8, i32, u32, i64, u64);

macro_rules! bench_float {
    ($t:ty, $to:expr, $from:expr) => {
        impl BenchElem for $t {
            fn from_i64(v: i64) -> Self {
                $from(v as f64)
            }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                let (x, y): (f64, f64) = ($to(a), $to(b));
                $from(match op {
                    ReduceOp::Sum | ReduceOp::Avg => x + y,
                    ReduceOp::Prod => x * y,
                    ReduceOp::Min => x.min(y),
                    ReduceOp::Max => x.max(y),
                })
            }
            fn div(a: Self, n: usize) -> Self {
                <$t>::div_by(a, n)
            }
        }
    };
}

trait DivBy {
    fn div_by(a: Self, n: usize) -> Self;
}
impl DivBy for f32 {
    fn div_by(a: Self, n: usize) -> Self {
        a / n as f32
    }
}
impl DivBy for f64 {
    fn div_by(a: Self, n: usize) -> Self {
        a / n as f64
    }
}
impl DivBy for f16 {
    fn div_by(a: Self, n: usize) -> Self {
        f16::from_f32(a.to_f32() / n as f32)
    }
}
impl DivBy for bf16 {
    fn div_by(a: Self, n: usize) -> Self {
        bf16::from_f32(a.to_f32() / n as f32)
    }
}
bench_float!(f32, |v: f32| v as f64, |v: f64| v as f32);
bench_float!(f64, |v: f64| v, |v: f64| v);
bench_float!(f16, |v: f16| v.to_f64(), f16::from_f64);
bench_float!(bf16, |v: bf16| v.to_f64(), bf16::from_f64);

/// Input of rank `r` at element `i` for `op`: small integers (sums of up to hundreds of ranks
/// stay exact in bf16's 8 bits only for few ranks; products use ±1).
fn input_value(op: ReduceOp, r: usize, i: usize) -> i64 {
    let k = (r * 7 + i * 13) as i64;
    match op {
        ReduceOp::Sum | ReduceOp::Avg => k % 5 - 2,
        ReduceOp::Prod => {
            if (r + i).is_multiple_of(3) {
                -1
            } else {
                1
            }
        }
        ReduceOp::Min | ReduceOp::Max => (k % 101) - 50,
    }
}

/// Input of rank `r` at element `i` of an all-to-all, which moves data without reducing it:
/// the values repeat only every 127 elements (`input_value`'s sums repeat every 5, so a
/// block misplaced by a multiple of 5 would go unseen) and differ between ranks, while every
/// type holds them exactly (−63 to 63).
fn moved_value(r: usize, i: usize) -> i64 {
    ((r * 37 + i) % 127) as i64 - 63
}

/// Fills `buf` with rank `r`'s inputs from element `offset` on.
fn fill<T: BenchElem>(buf: &mut [T], op: ReduceOp, r: usize, offset: usize) {
    for (i, x) in buf.iter_mut().enumerate() {
        *x = T::from_i64(input_value(op, r, offset + i));
    }
}

/// The reduced value of element `i` over `n` ranks.
fn expected<T: BenchElem>(op: ReduceOp, n: usize, i: usize) -> T {
    let mut acc = T::from_i64(input_value(op, 0, i));
    for r in 1..n {
        acc = T::combine(op, acc, T::from_i64(input_value(op, r, i)));
    }
    if op == ReduceOp::Avg {
        acc = T::div(acc, n);
    }
    acc
}

/// The elements of `got` whose bytes differ from `want`'s.
fn count_wrong<T: BenchElem>(got: &[T], want: impl Fn(usize) -> T) -> u64 {
    got.iter()
        .enumerate()
        .filter(|(i, g)| bytemuck::bytes_of(*g) != bytemuck::bytes_of(&want(*i)))
        .count() as u64
}

/// Buffers for one size of one collective, in host memory.
pub(crate) struct Bufs<T> {
    pub(crate) send: Vec<T>,
    pub(crate) recv: Vec<T>,
    /// all_to_all_v's counts, sent and received ([`v_counts`]).
    pub(crate) counts: Option<(Vec<usize>, Vec<usize>)>,
}

/// One size's host buffers (`send` and `recv` elements), the input filled in where the
/// collective reads it.
pub(crate) fn prepare<T: BenchElem>(
    args: &Args,
    comm: &Communicator,
    send: usize,
    recv: usize,
) -> Bufs<T> {
    let r = comm.rank();
    let mut b = Bufs {
        send: vec![T::default(); send],
        recv: vec![T::default(); recv],
        counts: (args.collective == Coll::AllToAllV)
            .then(|| v_counts(comm.world_size(), args.skew, r, send)),
    };
    match args.collective {
        Coll::AllReduce | Coll::Reduce => fill(&mut b.recv, args.op, r, 0),
        Coll::Broadcast => {
            if r == args.root {
                fill(&mut b.recv, args.op, r, 0)
            }
        }
        Coll::AllToAll | Coll::AllToAllV => {
            for (i, x) in b.send.iter_mut().enumerate() {
                *x = T::from_i64(moved_value(r, i));
            }
        }
        _ => fill(&mut b.send, args.op, r, 0),
    }
    b
}

/// Wrong elements in `out` (the output buffer); `send_len` is the per-rank input length.
pub(crate) fn verify<T: BenchElem>(
    args: &Args,
    comm: &Communicator,
    send_len: usize,
    out: &[T],
) -> u64 {
    let n = comm.world_size();
    let r = comm.rank();
    let op = args.op;
    match args.collective {
        Coll::AllReduce => count_wrong(out, |i| expected::<T>(op, n, i)),
        Coll::Reduce if r == args.root => count_wrong(out, |i| expected::<T>(op, n, i)),
        Coll::Reduce => 0,
        Coll::Broadcast => count_wrong(out, |i| T::from_i64(input_value(op, args.root, i))),
        Coll::AllGather => {
            let per = send_len.max(1);
            count_wrong(out, |i| T::from_i64(input_value(op, i / per, i % per)))
        }
        Coll::ReduceScatter => {
            let per = out.len();
            count_wrong(out, |i| expected::<T>(op, n, r * per + i))
        }
        Coll::AllToAll => {
            let per = (out.len() / n).max(1);
            count_wrong(out, |i| {
                let (j, k) = (i / per, i % per);
                T::from_i64(moved_value(j, r * per + k))
            })
        }
        Coll::AllToAllV => {
            // Rank i's block for this rank starts in i's input after its blocks for ranks
            // before this one; it lands after the blocks from ranks before i.
            let mut want = Vec::with_capacity(out.len());
            for i in 0..n {
                let (to, _) = v_counts(n, args.skew, i, send_len);
                let at: usize = to[..r].iter().sum();
                want.extend((at..at + to[r]).map(|k| T::from_i64(moved_value(i, k))));
            }
            if want.len() != out.len() {
                return out.len().max(want.len()) as u64;
            }
            count_wrong(out, |i| want[i])
        }
        Coll::SendRecv if r % 2 == 1 => {
            count_wrong(out, |i| T::from_i64(input_value(op, r - 1, i)))
        }
        Coll::SendRecv => 0,
    }
}
