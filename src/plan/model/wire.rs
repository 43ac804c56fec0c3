//! The cost model's wire form. At init rank 0 broadcasts its model and where it came from, and
//! every rank adopts it: ranks that chose with different constants would schedule one call
//! differently. [`encode`] writes the form and [`decode`] reads it; [`decode`] is total (any
//! bytes give a model or `None`, never a panic), as it reads what another process sent.
//!
//! The form, 65 bytes and the source:
//!
//! | bytes | what |
//! | --- | --- |
//! | 0 | the medium, its index in [`Medium::ALL`] |
//! | 1..33 | α, β, γ and `alpha_oversub_us` ([`Costs`]), each an `f64`'s bits, little-endian |
//! | 33..65 | `segment_bytes`, `local_ranks`, `cores`, `hier_min_bytes`: `u64`, little-endian |
//! | 65.. | the source (where the constants came from), UTF-8, read lossily |

use super::{CostModel, Costs, Medium};

/// Rank 0's model and its source, as every rank adopts it (ranks that chose with different
/// constants would schedule one call differently). [`decode`] reads it back.
pub fn encode(m: &CostModel, source: &str) -> Vec<u8> {
    let c = &m.costs;
    let mut out = vec![Medium::ALL.iter().position(|x| *x == m.medium).unwrap_or(0) as u8];
    for x in [
        c.alpha_us,
        c.beta_us_per_byte,
        c.gamma_us_per_byte,
        c.alpha_oversub_us,
    ] {
        out.extend_from_slice(&x.to_bits().to_le_bytes());
    }
    for x in [m.segment_bytes, m.local_ranks, m.cores, m.hier_min_bytes] {
        out.extend_from_slice(&(x as u64).to_le_bytes());
    }
    out.extend_from_slice(source.as_bytes());
    out
}

/// The model and source [`encode`] wrote; `None` for bytes that are not such a form (shorter
/// than 65 bytes, an unknown medium, a size that does not fit a `usize`). The source is read
/// lossily: bytes that are not UTF-8 become U+FFFD. The constants are taken as they come
/// (the caller judges them, e.g. with [`Costs::is_valid`]).
pub fn decode(b: &[u8]) -> Option<(CostModel, String)> {
    let medium = *Medium::ALL.get(usize::from(*b.first()?))?;
    let word = |i: usize| -> Option<u64> {
        let s = b.get(1 + 8 * i..9 + 8 * i)?;
        Some(u64::from_le_bytes(s.try_into().ok()?))
    };
    let f = |i| word(i).map(f64::from_bits);
    let costs = Costs {
        alpha_us: f(0)?,
        beta_us_per_byte: f(1)?,
        gamma_us_per_byte: f(2)?,
        alpha_oversub_us: f(3)?,
    };
    let u = |i| word(i).and_then(|x| usize::try_from(x).ok());
    let m = CostModel {
        medium,
        costs,
        segment_bytes: u(4)?,
        local_ranks: u(5)?,
        cores: u(6)?,
        hier_min_bytes: u(7)?,
    };
    let source = String::from_utf8_lossy(b.get(65..)?).into_owned();
    Some((m, source))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The constants' bits, so that models with NaN constants compare too.
    fn bits(m: &CostModel) -> ([u64; 4], [usize; 4], Medium) {
        let c = &m.costs;
        (
            [
                c.alpha_us.to_bits(),
                c.beta_us_per_byte.to_bits(),
                c.gamma_us_per_byte.to_bits(),
                c.alpha_oversub_us.to_bits(),
            ],
            [m.segment_bytes, m.local_ranks, m.cores, m.hier_min_bytes],
            m.medium,
        )
    }

    fn models() -> Vec<(CostModel, &'static str)> {
        let mut out = vec![(CostModel::default(), "defaults")];
        for m in Medium::ALL {
            out.push((CostModel::new(m, Costs::defaults(m)), ""));
        }
        out.push((
            CostModel {
                medium: Medium::Shm,
                costs: Costs {
                    alpha_us: 1.25,
                    beta_us_per_byte: 3.5e-4,
                    gamma_us_per_byte: 0.0,
                    alpha_oversub_us: 12.0,
                },
                segment_bytes: 1,
                local_ranks: 8,
                cores: 2,
                hier_min_bytes: usize::MAX,
            },
            "/etc/dspark/tune.json (measured 2 ranks, « tcp », 日本)",
        ));
        out.push((
            CostModel {
                costs: Costs {
                    alpha_us: f64::NAN,
                    beta_us_per_byte: f64::INFINITY,
                    gamma_us_per_byte: -0.0,
                    alpha_oversub_us: f64::MIN_POSITIVE,
                },
                segment_bytes: 0,
                cores: 0,
                ..CostModel::default()
            },
            "DSPARK_TUNE_FILE",
        ));
        out
    }

    #[test]
    fn models_round_trip_with_their_source() {
        for (m, src) in models() {
            let b = encode(&m, src);
            assert_eq!(b.len(), 65 + src.len());
            let (back, back_src) = decode(&b).expect("an encoded model decodes");
            assert_eq!(bits(&back), bits(&m), "{m:?}");
            assert_eq!(back_src, src);
            assert_eq!(encode(&back, &back_src), b);
        }
    }

    #[test]
    fn the_form_is_the_one_setup_broadcasts_byte_for_byte() {
        let b = encode(&CostModel::default(), "defaults");
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        assert_eq!(
            hex,
            "000000000000001040fca9f1d24d6240\
             3f2d431cebe2361a3f00000000000022\
             40000008000000000001000000000000\
             00010000000000000000004000000000\
             0064656661756c7473"
        );
    }

    #[test]
    fn truncated_forms_and_unknown_media_are_refused() {
        let b = encode(&models()[5].0, "source");
        for n in 0..65 {
            assert!(decode(&b[..n]).is_none(), "{n} bytes decoded");
        }
        // The source may be cut anywhere: it is read lossily.
        assert!(decode(&b[..65]).is_some_and(|(_, s)| s.is_empty()));
        for medium in [Medium::ALL.len() as u8, 0x7f, 0xff] {
            let mut bad = b.clone();
            bad[0] = medium;
            assert!(decode(&bad).is_none(), "medium {medium}");
        }
    }

    #[test]
    fn garbage_never_panics_and_a_source_that_is_not_utf8_is_read_lossily() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in 0..200 {
            let garbage: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            if let Some((m, s)) = decode(&garbage) {
                assert!(len >= 65 && usize::from(garbage[0]) < Medium::ALL.len());
                let again = decode(&encode(&m, &s)).expect("a re-encoded model decodes");
                assert_eq!(bits(&again.0), bits(&m));
                assert_eq!(again.1, s);
            }
        }
        let mut b = encode(&CostModel::default(), "");
        b.extend_from_slice(&[b'a', 0xff, 0xc3]);
        assert_eq!(
            decode(&b).map(|(_, s)| s).as_deref(),
            Some("a\u{fffd}\u{fffd}")
        );
    }
}
