//! The sweep's sizes: the `-b`..`-e` list by `-f` (or `--sizes`), and per size and
//! collective the element counts of each rank's buffers and the bytes one engine call moves.

use crate::{Args, Coll};

/// The sizes of the sweep: `--sizes`, else `-b` times `-f` up to `-e`, and `-e` itself.
pub(crate) fn sizes(args: &Args) -> Vec<usize> {
    if !args.sizes.is_empty() {
        return args.sizes.clone();
    }
    let mut v = Vec::new();
    let mut s = args.min_bytes.max(1);
    let f = args.step_factor.max(2);
    while s <= args.max_bytes {
        v.push(s);
        s = match s.checked_mul(f) {
            Some(x) => x,
            None => break,
        };
    }
    if v.last() != Some(&args.max_bytes) && args.max_bytes >= args.min_bytes {
        v.push(args.max_bytes);
    }
    v
}

/// The `i`-th size of the sweep (the `-b` size before the collective's rounding).
pub(crate) fn bytes_of(args: &Args, i: usize) -> usize {
    sizes(args).get(i).copied().unwrap_or(0)
}

/// Per-rank element counts for a size: (send, recv, total count shown in the table).
pub(crate) fn counts(c: Coll, bytes: usize, esz: usize, n: usize) -> (usize, usize, usize) {
    let total = bytes / esz;
    match c {
        Coll::AllReduce | Coll::Broadcast | Coll::Reduce => (0, total, total),
        Coll::SendRecv => (total, total, total),
        Coll::AllGather => {
            let per = total / n;
            (per, per * n, per * n)
        }
        Coll::ReduceScatter => {
            let per = total / n;
            (per * n, per, per * n)
        }
        Coll::AllToAll | Coll::AllToAllV => {
            let per = total / n;
            (per * n, per * n, per * n)
        }
    }
}

/// all_to_all_v's block from rank `from` to rank `to` in a world of `n`: a rank's own block
/// is the even share `per`; a peer's, k = `(to − from) mod n` ranks on, is `per` plus
/// `per × skew × (2k − n) / (n − 2)` rounded toward zero, from `per × (1 − skew)` for the next
/// rank to `per × (1 + skew)` for the one before. The term is odd about k = n / 2, so the
/// blocks a rank sends add up to `n × per` exactly, as do those it receives, and as much
/// crosses between ranks as in an all_to_all of `per` (its bus bandwidth compares); the
/// two blocks between a pair (k and n − k) differ, except for ranks n / 2 apart. With fewer
/// than 3 ranks every block is `per`: one peer block of the same total cannot differ.
pub(crate) fn v_block(n: usize, per: usize, skew: f64, from: usize, to: usize) -> usize {
    let k = (to + n - from % n.max(1)) % n.max(1);
    if n < 3 || k == 0 {
        return per;
    }
    let d = (per as f64 * skew * (2.0 * k as f64 - n as f64) / (n - 2) as f64).trunc() as i64;
    (per as i64 + d).max(0) as usize
}

/// Rank `r`'s all_to_all_v counts, sent and received, for `send` elements in all.
pub(crate) fn v_counts(n: usize, skew: f64, r: usize, send: usize) -> (Vec<usize>, Vec<usize>) {
    let per = send / n.max(1);
    (
        (0..n).map(|j| v_block(n, per, skew, r, j)).collect(),
        (0..n).map(|i| v_block(n, per, skew, i, r)).collect(),
    )
}

/// The bytes of one call of a size as the engine counts them (its element count times the
/// element size: the whole buffer, or one rank's block for all_gather, reduce_scatter and
/// all_to_all), which the cost model predicts from.
pub(crate) fn engine_bytes(c: Coll, bytes: usize, esz: usize, n: usize) -> usize {
    let (send, recv, total) = counts(c, bytes, esz, n);
    esz * match c {
        Coll::AllGather => send,
        Coll::ReduceScatter => recv,
        Coll::AllToAll | Coll::AllToAllV => send / n.max(1),
        _ => total,
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::{parse_bytes, parse_skew};

    fn args(extra: &[&str]) -> Args {
        let argv = ["dspark-bench"].iter().chain(extra).copied();
        Args::try_parse_from(argv).expect("arguments parse")
    }

    #[test]
    fn sizes_take_binary_k_m_g_suffixes() {
        assert_eq!(parse_bytes("8"), Ok(8));
        assert_eq!(parse_bytes("64K"), Ok(64 * 1024));
        assert_eq!(parse_bytes("64k"), Ok(64 * 1024));
        assert_eq!(parse_bytes("16M"), Ok(16 * 1024 * 1024));
        assert_eq!(parse_bytes("1G"), Ok(1024 * 1024 * 1024));
        assert_eq!(parse_bytes("256MiB"), Ok(256 * 1024 * 1024));
        assert!(parse_bytes("1T").is_err());
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("").is_err());
        let a = args(&["-b", "1K", "-e", "2M"]);
        assert_eq!((a.min_bytes, a.max_bytes), (1024, 2 * 1024 * 1024));
        assert!(Args::try_parse_from(["dspark-bench", "-b", "8X"]).is_err());
    }

    #[test]
    fn the_sweep_multiplies_by_the_factor_and_ends_at_the_maximum() {
        assert_eq!(
            sizes(&args(&["-b", "8", "-e", "64K", "-f", "64"])),
            [8, 512, 32768, 65536]
        );
        assert_eq!(
            sizes(&args(&["-b", "1K", "-e", "16K", "-f", "4"])),
            [1024, 4096, 16384]
        );
        // --sizes replaces the sweep.
        assert_eq!(sizes(&args(&["--sizes", "8,1M"])), [8, 1 << 20]);
    }

    #[test]
    fn counts_round_to_whole_blocks_per_rank() {
        // 1000 B of f32 over 4 ranks: 250 elements, 62 per rank's block.
        assert_eq!(counts(Coll::AllReduce, 1000, 4, 4), (0, 250, 250));
        assert_eq!(counts(Coll::AllGather, 1000, 4, 4), (62, 248, 248));
        assert_eq!(counts(Coll::ReduceScatter, 1000, 4, 4), (248, 62, 248));
        assert_eq!(counts(Coll::AllToAll, 1000, 4, 4), (248, 248, 248));
        assert_eq!(engine_bytes(Coll::AllGather, 1000, 4, 4), 62 * 4);
        assert_eq!(engine_bytes(Coll::AllToAll, 1000, 4, 4), 62 * 4);
        assert_eq!(engine_bytes(Coll::AllReduce, 1000, 4, 4), 1000);
    }

    #[test]
    fn all_to_all_v_blocks_keep_every_ranks_totals_and_agree_between_sender_and_receiver() {
        // 4 ranks, 10 elements a block on average, skew 0.5: its own block 10, then to the
        // next rank 10 − 5, to the one 2 on 10 (ranks n / 2 apart swap equal blocks), to
        // the one before 10 + 5.
        assert_eq!(v_counts(4, 0.5, 0, 40).0, [10, 5, 10, 15]);
        assert_eq!(
            v_counts(4, 0.5, 2, 40),
            (vec![10, 15, 10, 5], vec![10, 5, 10, 15])
        );
        assert_eq!(v_counts(3, 1.0, 1, 9), (vec![6, 3, 0], vec![0, 3, 6]));
        // Two ranks: nothing to skew.
        assert_eq!(v_counts(2, 1.0, 1, 20), (vec![10, 10], vec![10, 10]));
        for n in 1..=9 {
            for per in [0, 1, 2, 7, 1000] {
                for skew in [0.0, 0.3, 1.0] {
                    for r in 0..n {
                        let (to, from) = v_counts(n, skew, r, per * n);
                        assert_eq!(to.iter().sum::<usize>(), per * n, "n {n} per {per} {skew}");
                        assert_eq!(from.iter().sum::<usize>(), per * n, "n {n} per {per}");
                        assert_eq!((to[r], from[r]), (per, per), "a rank's own block");
                        for (j, &c) in to.iter().enumerate() {
                            // What r sends j is what j expects from r.
                            assert_eq!(c, v_counts(n, skew, j, per * n).1[r]);
                            let apart = (j + n - r) % n;
                            if skew == 0.0 || apart == 0 || 2 * apart == n || n < 3 {
                                assert_eq!((c, from[j]), (per, per), "n {n} r {r} j {j}");
                            } else if per == 1000 {
                                assert_ne!(c, from[j], "n {n} r {r} j {j} {skew}");
                            }
                        }
                    }
                }
            }
        }
        assert!(parse_skew("1.5").is_err() && parse_skew("-0.1").is_err());
        assert_eq!(parse_skew("0.25"), Ok(0.25));
    }
}
