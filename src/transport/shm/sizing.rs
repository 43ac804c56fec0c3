//! How big things are: the segment's layout in bytes (each ring's stride, a segment's
//! reserved and committed lengths, where the ring from one rank to another starts) and
//! whether the segments a host's ranks commit at init fit in its memory. Pure arithmetic
//! (and one read of `/proc/meminfo`), shared by setup, the ring protocol and the commits on
//! first use.

use super::seg::{LINE, PAGE};
use super::{RINGS, RING_DATA};

/// `n` rounded up to whole lines: where the frame after one of `n` bytes starts.
pub(super) fn pad(n: u64) -> u64 {
    n.div_ceil(LINE as u64) * LINE as u64
}

/// Bytes of one ring's place in a segment: its counters' lines and its data, rounded up to
/// whole pages, so that each ring is committed on pages of its own.
pub(super) fn ring_stride(ring: usize) -> usize {
    (RING_DATA + ring).div_ceil(PAGE) * PAGE
}

/// Bytes of one rank's segment for `world` ranks and rings of `ring` bytes (reserved, not
/// all committed: [`committed_len`]).
pub(super) fn seg_len(world: usize, ring: usize) -> usize {
    RINGS + world.saturating_sub(1) * ring_stride(ring)
}

/// Bytes of a segment committed when the rings from `peers` peers are: the header page and
/// those rings.
pub(super) fn committed_len(peers: usize, ring: usize) -> usize {
    RINGS + peers * ring_stride(ring)
}

/// `MemAvailable` of `/proc/meminfo` in bytes.
pub(super) fn mem_available() -> Option<u64> {
    parse_mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// `MemAvailable` in bytes, from the text of `/proc/meminfo`; `None` (unknown) for a number
/// of KiB whose bytes do not fit a `u64`.
pub(crate) fn parse_mem_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Whether the segments of `ranks` ranks on one host fit in half of the host's available
/// memory `avail`, counting what they commit at init: `committed` bytes in all (the header
/// pages and the rings from each rank's standing partners, O(log n) per rank; the other
/// rings are committed when their pair is first used). `Err` says how much, and what to
/// change.
pub(super) fn fits_in_memory(
    ranks: usize,
    committed: u64,
    ring: usize,
    avail: u64,
) -> Result<(), String> {
    if committed <= avail / 2 {
        return Ok(());
    }
    let h = |b: u64| crate::types::human_bytes(b, true);
    Err(format!(
        "{ranks} ranks' segments would commit {} at init (rings of {} from each rank's \
         standing partners), more than half of this host's available memory ({}); smaller \
         rings (DSPARK_SHM_RING_BYTES, at least two DSPARK_CHUNK_BYTES segments) or fewer \
         ranks per host would fit",
        h(committed),
        h(ring as u64),
        h(avail)
    ))
}

/// Index of `sender`'s ring in `owner`'s segment.
fn ring_index(owner: usize, sender: usize) -> usize {
    if sender < owner {
        sender
    } else {
        sender - 1
    }
}

/// Offset of `sender`'s ring in `owner`'s segment (positions among the members).
pub(super) fn ring_base(owner: usize, sender: usize, ring: usize) -> usize {
    RINGS + ring_index(owner, sender) * ring_stride(ring)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the segments of `n` ranks commit at init with the standing partners' rings.
    fn at_init(n: usize, ring: usize) -> u64 {
        (0..n)
            .map(|r| committed_len(crate::plan::algo::standing_partners(n, r).len(), ring) as u64)
            .sum()
    }

    #[test]
    fn segments_that_would_commit_more_than_half_the_available_memory_at_init_are_refused() {
        let ring = 2 << 20;
        // 8 ranks with 2 MiB rings: at most 8 × 7 rings, 112 MiB and a little.
        let c = at_init(8, ring);
        assert!(c <= 8 * committed_len(7, ring) as u64);
        assert!(fits_in_memory(8, c, ring, 1 << 30).is_ok());
        assert!(fits_in_memory(8, c, ring, 150 << 20).is_err());
        // 128 ranks: a ring per ordered pair would be 128 × 127 rings of 2 MiB, 32 GiB; the
        // standing partners' (at most 20 per rank) are at most 5 GiB and fit on a 24 GiB host.
        let c = at_init(128, ring);
        assert!(c <= 128 * committed_len(20, ring) as u64, "{c}");
        assert!(fits_in_memory(128, c, ring, 24 << 30).is_ok());
        let e = fits_in_memory(128, c, ring, c).unwrap_err();
        assert!(
            e.contains("128 ranks") && e.contains("DSPARK_SHM_RING_BYTES"),
            "{e}"
        );
        let all = 128 * seg_len(128, ring) as u64;
        assert!(fits_in_memory(128, all, ring, 24 << 30).is_err());
    }

    #[test]
    fn rings_of_every_peer_fit_the_segment_on_their_own_lines() {
        for world in 1..8 {
            let ring = 8192;
            let len = seg_len(world, ring);
            for owner in 0..world {
                for sender in (0..world).filter(|&s| s != owner) {
                    let b = ring_base(owner, sender, ring);
                    assert_eq!(b % PAGE, 0, "rings are committed by the page");
                    assert!(b + RING_DATA + ring <= len);
                }
            }
        }
        assert_eq!(pad(33), 64);
        assert_eq!(pad(64), 64);
        assert_eq!(pad(0), 0);
    }

    /// Found by tests/fuzz.rs (target proc_files): a `MemAvailable` of more KiB than a `u64`
    /// holds in bytes overflowed the multiplication (a panic with overflow checks on);
    /// it is unknown now, as an unreadable file is.
    #[test]
    fn a_mem_available_too_large_for_u64_bytes_is_unknown_not_an_overflow() {
        let text = "MemTotal: 1 kB\nMemAvailable:   12481475759600000000 kB\n";
        assert_eq!(parse_mem_available(text), None);
        assert_eq!(
            parse_mem_available("MemAvailable: 18014398509481983 kB"),
            Some(18014398509481983 * 1024)
        );
        assert_eq!(parse_mem_available("MemAvailable:    16 kB"), Some(16384));
    }
}
