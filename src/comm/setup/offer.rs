//! What ranks announce to each other while they negotiate the transport, as typed values with
//! total decoders (in the style of `bootstrap/msg.rs`): a malformed message from a peer
//! decodes to an offer that says it is malformed, never to a panic or an error that stops the
//! negotiation on one rank only. Fuzzed by `dspark::fuzzing` (`setup_shm_offer`,
//! `setup_verbs_offer`, `setup_confirm`).
//!
//! Every offer starts with the rank's requested transport (`DSPARK_TRANSPORT`) as one byte:
//! 0 auto, 1 tcp, 2 verbs, 3 shm (an empty message reads as auto, another value as none of
//! them).

use crate::config::TransportChoice;
use crate::transport::shm::SegInfo;
use crate::transport::verbs::wire::Blob;

/// The wire code of a requested transport.
pub(crate) fn mode_code(c: TransportChoice) -> u8 {
    match c {
        TransportChoice::Auto => 0,
        TransportChoice::Tcp => 1,
        TransportChoice::Verbs => 2,
        TransportChoice::Shm => 3,
    }
}

/// The requested transport of a wire code (`None`: a code this version does not know).
pub(crate) fn mode_of(code: u8) -> Option<TransportChoice> {
    [
        TransportChoice::Auto,
        TransportChoice::Tcp,
        TransportChoice::Verbs,
        TransportChoice::Shm,
    ]
    .into_iter()
    .find(|&c| mode_code(c) == code)
}

/// The first byte as a requested transport, and the rest (an empty message: auto).
fn split_mode(b: &[u8]) -> (Option<TransportChoice>, &[u8]) {
    match b.split_first() {
        Some((&m, rest)) => (mode_of(m), rest),
        None => (Some(TransportChoice::Auto), &[]),
    }
}

/// An offer's wire form: encoded by this rank, decoded from any rank's bytes by a total
/// function (a malformed message decodes to an offer that says so).
pub(crate) trait Wire: Sized {
    /// The offer's bytes.
    fn encode(&self) -> Vec<u8>;
    /// What `rank` sent, whatever the bytes.
    fn decode(rank: usize, bytes: &[u8]) -> Self;
}

impl Wire for ShmOffer {
    fn encode(&self) -> Vec<u8> {
        ShmOffer::encode(self)
    }
    fn decode(_: usize, bytes: &[u8]) -> Self {
        ShmOffer::decode(bytes)
    }
}

impl Wire for VerbsOffer {
    fn encode(&self) -> Vec<u8> {
        VerbsOffer::encode(self)
    }
    fn decode(rank: usize, bytes: &[u8]) -> Self {
        VerbsOffer::decode(rank, bytes)
    }
}

/// Whether a rank can share memory, as it announced it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SegOffer {
    /// It created its segment: its kernel's boot id and where the segment is.
    Capable {
        /// `/proc/sys/kernel/random/boot_id` (at most 255 bytes are sent).
        boot_id: String,
        /// The segment.
        info: SegInfo,
    },
    /// It cannot, and why.
    Incapable(String),
    /// Its announcement could not be read.
    Malformed,
}

/// A rank's shared-memory offer: the same announcement for a job on one host (`shm`) and for
/// the ranks of each host of a job on several (`shm+tcp`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShmOffer {
    /// The transport the rank asked for.
    pub(crate) mode: Option<TransportChoice>,
    /// Its capability.
    pub(crate) seg: SegOffer,
}

impl ShmOffer {
    /// `mode, 1, boot id length, boot id, segment` or `mode, 0, why` (UTF-8).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mode = self.mode.map_or(u8::MAX, mode_code);
        let mut msg = vec![mode];
        match &self.seg {
            SegOffer::Capable { boot_id, info } => {
                msg.push(1);
                let id = &boot_id.as_bytes()[..boot_id.len().min(255)];
                msg.push(id.len() as u8);
                msg.extend_from_slice(id);
                msg.extend_from_slice(&info.encode());
            }
            SegOffer::Incapable(why) => {
                msg.push(0);
                msg.extend_from_slice(why.as_bytes());
            }
            // Never sent by this version; what a reader of it would conclude.
            SegOffer::Malformed => msg.push(1),
        }
        msg
    }

    /// Total: any bytes decode (what cannot be read is [`SegOffer::Malformed`]).
    pub(crate) fn decode(b: &[u8]) -> Self {
        let (mode, rest) = split_mode(b);
        let seg = match rest.split_first() {
            Some((1, rest)) => {
                let n = rest.first().copied().unwrap_or(0) as usize;
                let id = rest
                    .get(1..1 + n)
                    .map(|b| String::from_utf8_lossy(b).into_owned());
                let info = rest.get(1 + n..).and_then(SegInfo::decode);
                match (id, info) {
                    (Some(boot_id), Some(info)) => SegOffer::Capable { boot_id, info },
                    _ => SegOffer::Malformed,
                }
            }
            Some((_, why)) => SegOffer::Incapable(String::from_utf8_lossy(why).into_owned()),
            None => SegOffer::Incapable(String::new()),
        };
        ShmOffer { mode, seg }
    }
}

/// A rank's verbs offer: its requested transport and its connection information (or why it
/// has none).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct VerbsOffer {
    /// The transport the rank asked for.
    pub(crate) mode: Option<TransportChoice>,
    /// Its port, queue pairs and direct region, or why it cannot use verbs.
    pub(crate) blob: Blob,
}

impl VerbsOffer {
    /// `mode` then the blob ([`Blob::encode`]).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut msg = vec![self.mode.map_or(u8::MAX, mode_code)];
        msg.extend_from_slice(&self.blob.encode());
        msg
    }

    /// Total: a blob that cannot be read is an incapable one naming `rank` and why.
    pub(crate) fn decode(rank: usize, b: &[u8]) -> Self {
        let (mode, rest) = split_mode(b);
        let blob = Blob::decode(rest).unwrap_or_else(|w| Blob::Incapable {
            reason: format!("(rank {rank}) {w}"),
        });
        VerbsOffer { mode, blob }
    }
}

/// A rank's answer in the confirming round: it connected (or had nothing to connect), or why
/// connecting failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Confirm {
    /// Connected, or nothing to do on this rank.
    Ok,
    /// Connecting failed, and why.
    Failed(String),
}

impl Confirm {
    /// `1`, or `0` and why (UTF-8).
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self {
            Confirm::Ok => vec![1],
            Confirm::Failed(why) => {
                let mut v = vec![0u8];
                v.extend_from_slice(why.as_bytes());
                v
            }
        }
    }

    /// Total: anything but a leading `1` is a failure, with the rest as its reason.
    pub(crate) fn decode(b: &[u8]) -> Self {
        match b.split_first() {
            Some((1, _)) => Confirm::Ok,
            _ => Confirm::Failed(
                String::from_utf8_lossy(b.get(1..).unwrap_or_default()).into_owned(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg() -> SegInfo {
        SegInfo {
            pid: 4242,
            fd: 17,
            len: 1 << 20,
            ring: 64 << 10,
            nonce: 0x0123_4567_89ab_cdef,
        }
    }

    #[test]
    fn shm_offers_round_trip_and_keep_todays_bytes() {
        let capable = ShmOffer {
            mode: Some(TransportChoice::Shm),
            seg: SegOffer::Capable {
                boot_id: "b00t".into(),
                info: seg(),
            },
        };
        let bytes = capable.encode();
        // The layout other versions read: mode 3, capable 1, length 4, the id, the segment.
        assert_eq!(&bytes[..7], &[3, 1, 4, b'b', b'0', b'0', b't']);
        assert_eq!(&bytes[7..], &seg().encode()[..]);
        assert_eq!(ShmOffer::decode(&bytes), capable);
        let no = ShmOffer {
            mode: Some(TransportChoice::Auto),
            seg: SegOffer::Incapable("alone on its host".into()),
        };
        assert_eq!(no.encode(), b"\0\0alone on its host");
        assert_eq!(ShmOffer::decode(&no.encode()), no);
    }

    #[test]
    fn malformed_shm_offers_say_so_instead_of_failing() {
        // A capable flag with a boot id longer than the message, or a segment cut short.
        assert_eq!(ShmOffer::decode(&[0, 1, 9, b'x']).seg, SegOffer::Malformed);
        let mut cut = ShmOffer {
            mode: None,
            seg: SegOffer::Capable {
                boot_id: "id".into(),
                info: seg(),
            },
        }
        .encode();
        cut.pop();
        assert_eq!(ShmOffer::decode(&cut).seg, SegOffer::Malformed);
        // An unknown mode code is none of the transports; an empty message is auto.
        assert_eq!(ShmOffer::decode(&cut).mode, None);
        assert_eq!(
            ShmOffer::decode(&[]),
            ShmOffer {
                mode: Some(TransportChoice::Auto),
                seg: SegOffer::Incapable(String::new())
            }
        );
    }

    #[test]
    fn a_boot_id_longer_than_255_bytes_is_cut_not_wrapped() {
        let long = ShmOffer {
            mode: Some(TransportChoice::Auto),
            seg: SegOffer::Capable {
                boot_id: "x".repeat(300),
                info: seg(),
            },
        };
        match ShmOffer::decode(&long.encode()).seg {
            SegOffer::Capable { boot_id, info } => {
                assert_eq!(boot_id.len(), 255);
                assert_eq!(info, seg());
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_unreadable_verbs_blob_is_an_incapable_offer_naming_its_rank() {
        let o = VerbsOffer::decode(5, &[2, 0xee, 0xee]);
        assert_eq!(o.mode, Some(TransportChoice::Verbs));
        match o.blob {
            Blob::Incapable { reason } => assert!(reason.starts_with("(rank 5) "), "{reason}"),
            other => panic!("{other:?}"),
        }
        let o = VerbsOffer {
            mode: Some(TransportChoice::Tcp),
            blob: Blob::Incapable {
                reason: "DSPARK_TRANSPORT=tcp".into(),
            },
        };
        assert_eq!(VerbsOffer::decode(0, &o.encode()), o);
    }

    #[test]
    fn confirmations_round_trip_and_anything_else_is_a_failure() {
        for c in [Confirm::Ok, Confirm::Failed("mmap: ENOMEM".into())] {
            assert_eq!(Confirm::decode(&c.encode()), c);
        }
        assert_eq!(Confirm::decode(&[]), Confirm::Failed(String::new()));
        assert_eq!(Confirm::decode(&[7, b'a']), Confirm::Failed("a".into()));
    }

    #[test]
    fn mode_codes_are_the_ones_older_versions_send() {
        for (c, code) in [
            (TransportChoice::Auto, 0),
            (TransportChoice::Tcp, 1),
            (TransportChoice::Verbs, 2),
            (TransportChoice::Shm, 3),
        ] {
            assert_eq!(mode_code(c), code);
            assert_eq!(mode_of(code), Some(c));
        }
        assert_eq!(mode_of(4), None);
    }
}
