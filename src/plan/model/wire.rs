//! The cost model's wire form. At init rank 0 broadcasts its model and where it came from, and
//! every rank adopts it: ranks that chose with different constants would schedule one call
//! differently. [`encode`] writes the form and [`decode`] reads it; [`decode`] is total (any
//! bytes give a model or `None`, never a panic), as it reads what another process sent.
//!
//! The form, 66 bytes (82 with a link) and the source:
//!
//! | bytes | what |
//! | --- | --- |
//! | 0 | the medium, its index in [`Medium::ALL`] |
//! | 1..33 | α, β, γ and `alpha_oversub_us` ([`Costs`]), each an `f64`'s bits, little-endian |
//! | 33..65 | `segment_bytes`, `local_ranks`, `cores`, `hier_min_bytes`: `u64`, little-endian |
//! | 65 | 1 where the link between hosts is known ([`Link`]), else 0 |
//! | 66..82 | with a link: its α and β, each an `f64`'s bits, little-endian |
//! | 66.. or 82.. | the source (where the constants came from), UTF-8, read lossily |

use super::{CostModel, Costs, Link, Medium};

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
    match &m.link {
        Some(l) => {
            out.push(1);
            for x in [l.alpha_us, l.beta_us_per_byte] {
                out.extend_from_slice(&x.to_bits().to_le_bytes());
            }
        }
        None => out.push(0),
    }
    out.extend_from_slice(source.as_bytes());
    out
}

/// The model and source [`encode`] wrote; `None` for bytes that are not such a form (shorter
/// than 66 bytes, or 82 with a link; an unknown medium or link tag, a size that does not fit a
/// `usize`). The source is read
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
    let at = |o: usize| -> Option<f64> {
        let s = b.get(o..o + 8)?;
        Some(f64::from_bits(u64::from_le_bytes(s.try_into().ok()?)))
    };
    let (link, rest) = match *b.get(65)? {
        0 => (None, 66),
        1 => (
            Some(Link {
                alpha_us: at(66)?,
                beta_us_per_byte: at(74)?,
            }),
            82,
        ),
        _ => return None,
    };
    let m = CostModel {
        medium,
        costs,
        segment_bytes: u(4)?,
        local_ranks: u(5)?,
        cores: u(6)?,
        hier_min_bytes: u(7)?,
        link,
    };
    let source = String::from_utf8_lossy(b.get(rest..)?).into_owned();
    Some((m, source))
}

/// The link's wire form (the link probe's result, which rank 0 broadcasts once it measured
/// it): a tag (1: a link, 0: none) and the link's α and β as `f64` bits, little-endian.
pub fn encode_link(link: Option<Link>) -> [u8; 17] {
    let mut out = [0u8; 17];
    if let Some(l) = link {
        out[0] = 1;
        out[1..9].copy_from_slice(&l.alpha_us.to_bits().to_le_bytes());
        out[9..17].copy_from_slice(&l.beta_us_per_byte.to_bits().to_le_bytes());
    }
    out
}

/// The link [`encode_link`] wrote: `Some(None)` for none, `None` for bytes that are not such a
/// form (not 17 bytes, an unknown tag).
pub fn decode_link(b: &[u8]) -> Option<Option<Link>> {
    if b.len() != 17 {
        return None;
    }
    let f = |o: usize| -> Option<f64> {
        Some(f64::from_bits(u64::from_le_bytes(
            b.get(o..o + 8)?.try_into().ok()?,
        )))
    };
    match b[0] {
        0 => Some(None),
        1 => Some(Some(Link {
            alpha_us: f(1)?,
            beta_us_per_byte: f(9)?,
        })),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The constants' bits, so that models with NaN constants compare too.
    fn bits(m: &CostModel) -> ([u64; 4], [usize; 4], Medium, Option<[u64; 2]>) {
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
            m.link
                .map(|l| [l.alpha_us.to_bits(), l.beta_us_per_byte.to_bits()]),
        )
    }

    /// The wire length of `m` without its source.
    fn fixed(m: &CostModel) -> usize {
        if m.link.is_some() {
            82
        } else {
            66
        }
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
                link: None,
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
        // A probed link (the bed's 1 Gbit/s), and one of any bits.
        out.push((
            CostModel {
                link: Some(Link {
                    alpha_us: 61.5,
                    beta_us_per_byte: 8e-3,
                }),
                ..CostModel::default()
            },
            "defaults",
        ));
        out.push((
            CostModel {
                link: Some(Link {
                    alpha_us: f64::NAN,
                    beta_us_per_byte: -0.0,
                }),
                ..CostModel::default()
            },
            "",
        ));
        out
    }

    #[test]
    fn models_round_trip_with_their_source() {
        for (m, src) in models() {
            let b = encode(&m, src);
            assert_eq!(b.len(), fixed(&m) + src.len());
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
             000064656661756c7473"
        );
        // With a link: the tag, then its α and β.
        let m = CostModel {
            link: Some(Link {
                alpha_us: 2.0,
                beta_us_per_byte: 0.5,
            }),
            ..CostModel::default()
        };
        let b = encode(&m, "x");
        assert_eq!(b.len(), 83);
        assert_eq!(b[65], 1);
        assert_eq!(b[66..74], 2.0f64.to_bits().to_le_bytes());
        assert_eq!(b[74..82], 0.5f64.to_bits().to_le_bytes());
        assert_eq!(b[82], b'x');
    }

    #[test]
    fn truncated_forms_and_unknown_media_are_refused() {
        for m in [&models()[5].0, &models()[7].0] {
            let b = encode(m, "source");
            let fixed = fixed(m);
            for n in 0..fixed {
                assert!(decode(&b[..n]).is_none(), "{n} bytes decoded");
            }
            // The source may be cut anywhere: it is read lossily.
            assert!(decode(&b[..fixed]).is_some_and(|(_, s)| s.is_empty()));
            for medium in [Medium::ALL.len() as u8, 0x7f, 0xff] {
                let mut bad = b.clone();
                bad[0] = medium;
                assert!(decode(&bad).is_none(), "medium {medium}");
            }
            for tag in [2u8, 0x80, 0xff] {
                let mut bad = b.clone();
                bad[65] = tag;
                assert!(decode(&bad).is_none(), "link tag {tag}");
            }
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
                assert!(len >= 66 && usize::from(garbage[0]) < Medium::ALL.len());
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

    #[test]
    fn links_round_trip_and_bad_forms_are_refused() {
        for link in [
            None,
            Some(Link {
                alpha_us: 61.5,
                beta_us_per_byte: 8e-3,
            }),
        ] {
            assert_eq!(decode_link(&encode_link(link)), Some(link));
        }
        let b = encode_link(Some(Link {
            alpha_us: 1.0,
            beta_us_per_byte: 2.0,
        }));
        for n in 0..17 {
            assert_eq!(decode_link(&b[..n]), None, "{n} bytes");
        }
        let mut bad = b;
        bad[0] = 2;
        assert_eq!(decode_link(&bad), None);
    }
}
