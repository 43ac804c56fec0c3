//! Setup: creating this rank's segment ([`prepare`], [`prepare_group`]: a sealed memfd with
//! its header written and the standing partners' rings committed), what the ranks exchange
//! to find each other's ([`SegInfo`]), mapping and checking the peers' segments
//! ([`Prepared::connect`]), and building the transport over them ([`ShmTransport::new`]).
//! The communicator's setup drives these steps through the bootstrap; nothing here talks to
//! another rank.

use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;

use super::fence;
use super::liveness::proc_stat;
use super::seg::{self, Seg, LINE};
use super::sizing::{
    committed_len, fits_in_memory, mem_available, ring_base, ring_stride, seg_len,
};
use super::{
    Peer, PeerState, ShmOptions, ShmTransport, MAGIC, MAX_RING_BYTES, MIN_RING_BYTES, OFF_ASYM,
    OFF_MAGIC, OFF_NONCE, OFF_PID, OFF_RANK, OFF_RING, OFF_VERSION, OFF_WORLD, RINGS, VERSION,
};
use crate::error::{Error, Result};

/// This rank's segment, created before the ranks exchange where to find theirs.
#[derive(Debug)]
pub struct Prepared {
    rank: usize,
    world: usize,
    /// The ranks that share memory with this one (ascending, this rank included): every rank
    /// of the job, or the ranks of this host in a job that spans several hosts (then the
    /// other ranks are reached through another transport, see [`crate::transport::mixed`]). Rings are
    /// laid out by position in this list.
    members: Vec<usize>,
    ring: usize,
    /// The peers (members) whose rings are committed at init: the standing partners.
    partners: Vec<usize>,
    file: std::fs::File,
    pub(super) seg: Seg,
    nonce: u64,
}

/// Where a rank's segment is, as announced to its peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegInfo {
    /// The owner's process id.
    pub pid: u32,
    /// Its descriptor of the segment.
    pub fd: u32,
    /// Segment bytes.
    pub len: u64,
    /// Ring bytes.
    pub ring: u64,
    /// The nonce written in the segment's header.
    pub nonce: u64,
}

impl SegInfo {
    /// Little-endian bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(32);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.fd.to_le_bytes());
        v.extend_from_slice(&self.len.to_le_bytes());
        v.extend_from_slice(&self.ring.to_le_bytes());
        v.extend_from_slice(&self.nonce.to_le_bytes());
        v
    }

    /// Parses [`SegInfo::encode`]'s bytes.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != 32 {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or([0; 4]));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        Some(SegInfo {
            pid: u32_at(0),
            fd: u32_at(4),
            len: u64_at(8),
            ring: u64_at(16),
            nonce: u64_at(24),
        })
    }
}

/// Creates this rank's segment (`Err`: why shared memory cannot be used here). `partners(r)`:
/// the peers of rank `r` whose rings are committed at init (a symmetric relation, as
/// [`crate::plan::algo::standing_partners`]); every other ring is reserved and committed when
/// its pair is first used.
pub fn prepare(
    rank: usize,
    world: usize,
    partners: &dyn Fn(usize) -> Vec<usize>,
    opts: ShmOptions,
) -> std::result::Result<Prepared, String> {
    prepare_group(rank, world, &(0..world).collect::<Vec<_>>(), partners, opts)
}

/// Creates this rank's segment for shared memory with `members` only (the ranks of its host,
/// this rank included, in a `world`-rank job): one ring per member, none for the others;
/// those of the members among `partners` (as in [`prepare`]) committed now. `Err`: why
/// shared memory cannot be used here.
pub fn prepare_group(
    rank: usize,
    world: usize,
    members: &[usize],
    partners: &dyn Fn(usize) -> Vec<usize>,
    opts: ShmOptions,
) -> std::result::Result<Prepared, String> {
    let mut members = members.to_vec();
    members.sort_unstable();
    members.dedup();
    if !members.contains(&rank) || members.iter().any(|&m| m >= world) {
        return Err(format!(
            "internal: shared-memory group {members:?} of a {world}-rank job without rank {rank}"
        ));
    }
    let ring = opts
        .ring_bytes
        .clamp(MIN_RING_BYTES, MAX_RING_BYTES)
        .div_ceil(LINE)
        * LINE;
    let len = seg_len(members.len(), ring);
    // The members among `r`'s partners: the rings committed in `r`'s segment at init.
    let at_init = |r: usize| -> Vec<usize> {
        let mut v: Vec<usize> = partners(r)
            .into_iter()
            .filter(|&p| p != r && members.binary_search(&p).is_ok())
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    if let Some(avail) = mem_available() {
        let total: u64 = members
            .iter()
            .map(|&m| committed_len(at_init(m).len(), ring) as u64)
            .sum();
        fits_in_memory(members.len(), total, ring, avail)?;
    }
    let mine = at_init(rank);
    let pos = |r: usize| members.binary_search(&r).unwrap_or(0);
    let stride = ring_stride(ring);
    let ranges: Vec<(usize, usize)> = std::iter::once((0, RINGS))
        .chain(
            mine.iter()
                .map(|&p| (ring_base(pos(rank), pos(p), ring), stride)),
        )
        .collect();
    let file = seg::create(len, &ranges, &format!("dspark-shm-rank{rank}"))?;
    let seg = Seg::map(&file, len)?;
    for &(off, n) in &ranges {
        seg.populate(off, n)?;
    }
    let nonce = seg::nonce();
    seg.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Relaxed);
    seg.u32_at(OFF_VERSION).store(VERSION, Ordering::Relaxed);
    seg.u32_at(OFF_WORLD).store(world as u32, Ordering::Relaxed);
    seg.u32_at(OFF_RANK).store(rank as u32, Ordering::Relaxed);
    seg.u64_at(OFF_RING).store(ring as u64, Ordering::Relaxed);
    seg.u32_at(OFF_PID)
        .store(std::process::id(), Ordering::Relaxed);
    // Whether this rank will issue a membarrier before it sleeps, so that its peers may
    // publish with a compiler fence: read by them after the nonce. Not in a group of more
    // than `fence::MAX_GROUP` ranks, where every sleep would interrupt that many more CPUs.
    let asym = opts.membarrier && members.len() <= fence::MAX_GROUP && fence::registered();
    seg.u32_at(OFF_ASYM)
        .store(u32::from(asym), Ordering::Relaxed);
    seg.u64_at(OFF_NONCE).store(nonce, Ordering::Release);
    Ok(Prepared {
        rank,
        world,
        members,
        ring,
        partners: mine,
        file,
        seg,
        nonce,
    })
}

impl Prepared {
    /// What peers need to map this segment.
    pub fn info(&self) -> SegInfo {
        SegInfo {
            pid: std::process::id(),
            fd: self.file.as_raw_fd() as u32,
            len: self.seg.len() as u64,
            ring: self.ring as u64,
            nonce: self.nonce,
        }
    }

    /// Maps every peer's segment (`infos[r]` for rank `r`), checking each one's header.
    /// `Err` says which peer's segment could not be had, and why.
    pub fn connect(&self, infos: &[SegInfo]) -> std::result::Result<Vec<Option<Seg>>, String> {
        let infos: Vec<Option<SegInfo>> = infos.iter().copied().map(Some).collect();
        self.connect_group(&infos)
    }

    /// [`Prepared::connect`] for a group ([`prepare_group`]): `infos[r]` is needed for the
    /// members only; the others get `None` in the result.
    pub fn connect_group(
        &self,
        infos: &[Option<SegInfo>],
    ) -> std::result::Result<Vec<Option<Seg>>, String> {
        let mut segs = Vec::with_capacity(self.world);
        for r in 0..self.world {
            if r == self.rank || !self.members.contains(&r) {
                segs.push(None);
                continue;
            }
            let Some(info) = infos.get(r).copied().flatten() else {
                return Err(format!("rank {r} announced no segment"));
            };
            if info.ring != self.ring as u64 {
                return Err(format!(
                    "rank {r} has rings of {} bytes, this rank {} (DSPARK_SHM_RING_BYTES differs)",
                    info.ring, self.ring
                ));
            }
            // Every offset this rank uses in a peer's segment (header words, its ring's
            // counters and data) follows from the group's size and the ring size: a segment
            // of another length is refused here, so that no later access can fall outside it.
            let want = seg_len(self.members.len(), self.ring);
            if info.len != want as u64 {
                return Err(format!(
                    "rank {r} announced a segment of {} bytes where {} ranks with rings of {} \
                     bytes need {want}",
                    info.len,
                    self.members.len(),
                    self.ring
                ));
            }
            let file = seg::open_peer(info.pid, info.fd, info.len as usize)
                .map_err(|w| format!("rank {r}'s segment: {w}"))?;
            let s = Seg::map(&file, info.len as usize)
                .map_err(|w| format!("rank {r}'s segment: {w}"))?;
            // Its header, and the ring this rank sends into when they are partners.
            let pos = |q: usize| self.members.binary_search(&q).unwrap_or(0);
            s.populate(0, RINGS)
                .map_err(|w| format!("rank {r}'s segment: {w}"))?;
            if self.partners.binary_search(&r).is_ok() {
                s.populate(
                    ring_base(pos(r), pos(self.rank), self.ring),
                    ring_stride(self.ring),
                )
                .map_err(|w| format!("rank {r}'s segment: {w}"))?;
            }
            let ok = s.u64_at(OFF_MAGIC).load(Ordering::Relaxed) == MAGIC
                && s.u32_at(OFF_VERSION).load(Ordering::Relaxed) == VERSION
                && s.u32_at(OFF_WORLD).load(Ordering::Relaxed) as usize == self.world
                && s.u32_at(OFF_RANK).load(Ordering::Relaxed) as usize == r
                && s.u64_at(OFF_NONCE).load(Ordering::Acquire) == info.nonce;
            if !ok {
                return Err(format!(
                    "rank {r}'s segment (pid {}, fd {}) has another header: not its segment",
                    info.pid, info.fd
                ));
            }
            segs.push(Some(s));
        }
        Ok(segs)
    }
}

impl ShmTransport {
    /// The transport over this rank's segment, its peers' (`segs[r]`, from
    /// [`Prepared::connect`]) and the bootstrap's connections (`streams[r]`), kept as
    /// liveness descriptors. A peer without a connection gets one on first use, through
    /// [`ShmTransport::with_links`]. Once every peer has mapped this rank's segment (the
    /// caller's second bootstrap round), peers open nothing of it any more.
    pub fn new(
        prep: Prepared,
        segs: Vec<Option<Seg>>,
        streams: Vec<Option<TcpStream>>,
    ) -> Result<Self> {
        let Prepared {
            rank,
            world,
            members,
            ring,
            partners,
            file,
            seg: own,
            ..
        } = prep;
        // Rings are laid out by position among the members.
        let pos = |r: usize| members.iter().position(|&m| m == r).unwrap_or(0);
        let mut peers = Vec::with_capacity(world);
        for (r, (s, st)) in segs.into_iter().zip(streams).enumerate() {
            if r != rank && !members.contains(&r) {
                // Reached through another transport; its stream is not this transport's.
                peers.push(None);
                continue;
            }
            match s {
                Some(seg) => {
                    if let Some(stream) = &st {
                        stream.set_nonblocking(true).map_err(|e| {
                            Error::io(
                                Some(rank),
                                Some(r),
                                "configuring the liveness connection",
                                e,
                            )
                        })?;
                        let _ = stream.set_nodelay(true);
                    }
                    let pid = seg.u32_at(OFF_PID).load(Ordering::Relaxed);
                    peers.push(Some(Peer {
                        seg,
                        stream: st,
                        pid,
                        started: proc_stat(pid).map(|(_, t)| t),
                        committed: partners.binary_search(&r).is_ok(),
                        state: PeerState::Open,
                        tx_head: 0,
                        tx_tail: 0,
                        tx_in_frame: false,
                        rx_tail: 0,
                        rx_head: 0,
                        rx_in_frame: false,
                        tx_base: ring_base(pos(r), pos(rank), ring),
                        rx_base: ring_base(pos(rank), pos(r), ring),
                    }));
                }
                None if r == rank => peers.push(None),
                None => {
                    return Err(Error::invalid(
                        Some(rank),
                        "shared-memory transport",
                        format!("no segment for rank {r}"),
                    ))
                }
            }
        }
        let among = if members.len() < world {
            let rs: Vec<String> = members.iter().map(usize::to_string).collect();
            format!("among ranks {}, ", rs.join(","))
        } else {
            String::new()
        };
        // Read after the nonce (acquire, `Prepared::connect`), like the rest of the header.
        let asym = own.u32_at(OFF_ASYM).load(Ordering::Relaxed) == 1;
        let light_fence = asym
            && peers
                .iter()
                .flatten()
                .all(|p| p.seg.u32_at(OFF_ASYM).load(Ordering::Relaxed) == 1);
        let connected_at_init = peers
            .iter()
            .flatten()
            .filter(|p| p.stream.is_some())
            .count();
        let mut t = ShmTransport {
            rank,
            world,
            ring,
            own,
            file,
            peers,
            committed_at_init: committed_len(partners.len(), ring),
            connected_at_init,
            among,
            desc: String::new(),
            done: false,
            lazy: None,
            procs_looked: std::time::Instant::now(),
            coll_running: None,
            coll_done: 0,
            peer_aborted: false,
            slot_calls: 0,
            published_seq: 0,
            wake_owed: false,
            slot_tail: 0,
            asym,
            light_fence,
        };
        t.desc = t.description();
        Ok(t)
    }

    /// A transport for a world of one (no peers, no segment to share).
    pub fn single() -> Result<Self> {
        let prep = prepare(
            0,
            1,
            &|_| Vec::new(),
            ShmOptions {
                ring_bytes: MIN_RING_BYTES,
                ..ShmOptions::default()
            },
        )
        .map_err(|w| Error::unavailable("the shared-memory transport", w))?;
        Self::new(prep, vec![None], vec![None])
    }
}

/// `n` transports of one group in this process (tests): rank r's standing partners are
/// `partners(r)`, its options `opts(r)`.
#[cfg(test)]
pub(crate) fn group_in_process(
    n: usize,
    partners: &dyn Fn(usize) -> Vec<usize>,
    opts: &dyn Fn(usize) -> ShmOptions,
) -> Vec<ShmTransport> {
    let preps: Vec<Prepared> = (0..n)
        .map(|r| prepare(r, n, partners, opts(r)).unwrap())
        .collect();
    let infos: Vec<SegInfo> = preps.iter().map(Prepared::info).collect();
    let segs: Vec<_> = preps.iter().map(|p| p.connect(&infos).unwrap()).collect();
    preps
        .into_iter()
        .zip(segs)
        .map(|(p, s)| ShmTransport::new(p, s, (0..n).map(|_| None).collect()).unwrap())
        .collect()
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::transport::{
        FrameHeader, FrameKind, RecvProgress, RecvSink, SendProgress, Transport, HEADER_LEN,
    };

    /// A receive sink that takes a frame whole into its vector, sized by the header.
    pub(in super::super) struct Take(pub(in super::super) Vec<u8>);

    impl RecvSink for Take {
        fn on_header(&mut self, hdr: &FrameHeader) -> Result<usize> {
            self.0.resize(hdr.len as usize, 0);
            Ok(hdr.len as usize)
        }
        fn direct(&mut self) -> Option<&mut [u8]> {
            Some(&mut self.0)
        }
        fn granule(&self) -> usize {
            1
        }
        fn consume(&mut self, _: &[u8]) -> Result<()> {
            Ok(())
        }
    }

    /// The header of a data frame of collective code `coll`, call `seq`, `len` bytes.
    fn data_frame(coll: u8, seq: u64, len: usize) -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Data,
            coll,
            dtype: 0,
            op: crate::transport::NO_OP,
            root: 0,
            len: len as u32,
            seq,
            count: len as u64,
        }
    }

    /// Bytes of `file` the kernel has allocated.
    fn allocated(file: &std::fs::File) -> u64 {
        use std::os::unix::fs::MetadataExt;
        file.metadata().unwrap().blocks() * 512
    }

    /// Two ranks in this process; rank `declines` asks for no membarriers
    /// (`DSPARK_SHM_MEMBARRIER=0`).
    fn pair(declines: Option<usize>) -> Vec<ShmTransport> {
        let opts = |r: usize| ShmOptions {
            ring_bytes: 64 * 1024,
            membarrier: declines != Some(r),
        };
        group_in_process(2, &|r| vec![1 - r], &opts)
    }

    /// A publisher leaves the wake-up's full fence to the sleepers only when its process and
    /// every peer's issue a membarrier before they sleep; the description says which.
    #[test]
    fn publishers_fence_lightly_only_when_every_peer_sleeps_with_a_membarrier() {
        let registered = fence::registered();
        for t in pair(None) {
            assert_eq!(t.asym, registered, "membarrier registered: {registered}");
            assert_eq!(t.light_fence, registered);
            assert_eq!(
                t.describe().contains("(membarrier fences)"),
                registered,
                "{}",
                t.describe()
            );
        }
        let ts = pair(Some(1));
        assert!(
            !ts[0].light_fence,
            "rank 1 sleeps without a membarrier: rank 0 must publish with a full fence"
        );
        assert!(!ts[0].describe().contains("membarrier"));
        assert_eq!(ts[0].asym, registered);
        // Rank 1 declined: a full fence on both of its sides.
        assert!(!ts[1].asym);
        assert!(
            !ts[1].light_fence,
            "rank 1 declined: it publishes with a full fence too"
        );
    }

    /// Above `fence::MAX_GROUP` ranks on a host nobody issues membarriers (each sleep would
    /// interrupt every other running rank): full fences on both sides, whatever the options.
    #[test]
    fn a_group_larger_than_the_membarrier_bound_keeps_full_fences() {
        let opts = |_: usize| ShmOptions {
            ring_bytes: 64 * 1024,
            membarrier: true,
        };
        let n = fence::MAX_GROUP;
        for t in group_in_process(n, &|r| vec![(r + 1) % n], &opts) {
            assert_eq!(t.asym, fence::registered(), "a group of {n} may");
        }
        for t in group_in_process(n + 1, &|r| vec![(r + 1) % (n + 1)], &opts) {
            assert!(!t.asym && !t.light_fence, "a group of {} must not", n + 1);
            assert!(!t.describe().contains("membarrier"), "{}", t.describe());
        }
    }

    /// A frame of a later collective behind a wrap marker is still seen by a one-shot peek:
    /// rank 0's 20 KiB frame leaves its send position past the ring's hot window, so its
    /// next small frame (a broadcast #2, where rank 1 runs #2 one-shot) goes to the ring's
    /// start behind a marker. Rank 1's peek for rank 0's contribution to #2 is a mismatch
    /// naming that frame; it read the marker as the frame and saw nothing (the mismatch was
    /// left to rank 0 to find, or to the deadline).
    #[test]
    fn a_one_shot_peek_sees_a_frame_behind_a_wrap_marker() {
        use crate::plan::Collective;
        let mut ts = pair(None);
        let frame = |coll: Collective, seq: u64, len: usize| data_frame(coll.code(), seq, len);
        let big = vec![1u8; 20 * 1024];
        let mut sp = SendProgress::default();
        assert!(ts[0]
            .send(
                1,
                &frame(Collective::AllReduce, 1, big.len()),
                &big,
                &mut sp
            )
            .unwrap());
        let mut sink = Take(Vec::new());
        let mut rp = RecvProgress::default();
        assert!(ts[1].recv(0, &mut rp, &mut sink).unwrap());
        let small = [2u8; 16];
        let mut sp = SendProgress::default();
        assert!(ts[0]
            .send(1, &frame(Collective::Broadcast, 2, 16), &small, &mut sp)
            .unwrap());
        let slots = ts[1].slots().expect("shm has slots");
        match slots.peek(0, 2) {
            Err(e @ Error::Mismatch { .. }) => {
                assert!(e.to_string().contains("frame of collective #2"), "{e}");
            }
            other => panic!("expected a mismatch naming rank 0's frame, got {other:?}"),
        }
    }

    /// Three ranks in this process, of which only 0 and 1 are partners: each segment commits
    /// the header and its partners' rings at init, and a pair's rings on its first use.
    #[test]
    fn only_partner_rings_are_committed_at_init_and_the_others_on_first_use() {
        let ring = 64 * 1024;
        let partners = |r: usize| match r {
            0 => vec![1],
            1 => vec![0],
            _ => vec![],
        };
        let opts = ShmOptions {
            ring_bytes: ring,
            ..ShmOptions::default()
        };
        let preps: Vec<Prepared> = (0..3)
            .map(|r| prepare(r, 3, &partners, opts).unwrap())
            .collect();
        let stride = ring_stride(ring) as u64;
        let got: Vec<u64> = preps.iter().map(|p| allocated(&p.file)).collect();
        assert_eq!(
            got,
            vec![RINGS as u64 + stride, RINGS as u64 + stride, RINGS as u64]
        );
        let infos: Vec<SegInfo> = preps.iter().map(Prepared::info).collect();
        let segs: Vec<_> = preps.iter().map(|p| p.connect(&infos).unwrap()).collect();
        let mut ts: Vec<ShmTransport> = preps
            .into_iter()
            .zip(segs)
            .map(|(p, s)| ShmTransport::new(p, s, vec![None, None, None]).unwrap())
            .collect();
        assert_eq!(ts[0].committed_at_init(), RINGS + stride as usize);
        assert_eq!(ts[2].committed_at_init(), RINGS);
        assert!(
            ts[2].describe().contains("rings from 0 of 2 peers"),
            "{}",
            ts[2].describe()
        );
        // 2 sends to 0: 2 commits its ring in its own segment, and populates the one in 0's.
        let data = vec![7u8; 1000];
        let hdr = FrameHeader {
            kind: FrameKind::Data,
            coll: 0,
            dtype: 0,
            op: crate::transport::NO_OP,
            root: 0,
            len: data.len() as u32,
            seq: 1,
            count: data.len() as u64,
        };
        let mut sp = SendProgress::default();
        assert!(ts[2].send(0, &hdr, &data, &mut sp).unwrap());
        assert_eq!(allocated(&ts[2].file), RINGS as u64 + stride);
        // 0 has not used the pair yet: its ring from 2 holds the frame (2 populated it), and
        // its first receive commits it (a no-op for the pages 2 touched) and takes it.
        let mut sink = Take(vec![0u8; 1000]);
        let mut rp = RecvProgress::default();
        assert!(ts[0].recv(2, &mut rp, &mut sink).unwrap());
        assert_eq!(sink.0, data);
        assert_eq!(allocated(&ts[0].file), RINGS as u64 + 2 * stride);
        assert!(ts[0].peers[2].as_ref().is_some_and(|p| p.committed));
    }

    /// A frame the receiver took whole completes at its sender even when the receiver then
    /// said goodbye, though the ring was full at the frame's last byte (its padding to the
    /// next line had no room yet): the receiver finished the collective and closed, and the
    /// sender, still finishing that send, failed with "peer closed its communicator".
    #[test]
    fn a_frame_taken_whole_completes_at_its_sender_after_the_receiver_said_goodbye() {
        let ring = MIN_RING_BYTES;
        let opts = |_| ShmOptions {
            ring_bytes: ring,
            ..ShmOptions::default()
        };
        let mut ts = group_in_process(2, &|r| vec![1 - r], &opts);
        let hdr = |len: usize, seq: u64| data_frame(0, seq, len);
        // A 40-byte frame (one line), taken: the receiver's tail stops at byte 40, the next
        // frame starts at 64, so a frame of 4072 bytes ends where the ring is full.
        let small = [1u8; 8];
        let mut sp = SendProgress::default();
        assert!(ts[1].send(0, &hdr(8, 1), &small, &mut sp).unwrap());
        let mut sink = Take(Vec::new());
        assert!(ts[0]
            .recv(1, &mut RecvProgress::default(), &mut sink)
            .unwrap());
        let big = vec![2u8; ring - HEADER_LEN - 24];
        let mut sp = SendProgress::default();
        let done = ts[1].send(0, &hdr(big.len(), 2), &big, &mut sp).unwrap();
        assert!(ts[0]
            .recv(1, &mut RecvProgress::default(), &mut sink)
            .unwrap());
        assert_eq!(sink.0, big);
        ts[0].close();
        // The sender finishes the frame: nothing of it is left for the receiver.
        assert!(
            done || ts[1].send(0, &hdr(big.len(), 2), &big, &mut sp).unwrap(),
            "the frame the receiver took whole did not complete"
        );
        // Its next frame meets the goodbye.
        let mut sp = SendProgress::default();
        let e = ts[1].send(0, &hdr(8, 3), &small, &mut sp).unwrap_err();
        assert!(e.to_string().contains("closed its communicator"), "{e}");
    }

    #[test]
    fn segment_info_round_trips_and_rejects_other_lengths() {
        let i = SegInfo {
            pid: 42,
            fd: 7,
            len: 1 << 22,
            ring: 1 << 21,
            nonce: 0xdead_beef_cafe_f00d,
        };
        assert_eq!(SegInfo::decode(&i.encode()), Some(i));
        assert_eq!(SegInfo::decode(&[0u8; 31]), None);
    }

    /// A peer (misbehaving, or of another build) whose segment is too small for the layout
    /// would make later ring accesses fall outside it: refused at connect, naming the rank.
    #[test]
    fn a_peer_segment_of_another_length_is_refused_at_connect() {
        use std::os::fd::AsRawFd;
        let opts = ShmOptions {
            ring_bytes: 8192,
            ..ShmOptions::default()
        };
        let me = prepare(0, 2, &|_| Vec::new(), opts).unwrap();
        // A well-formed header for rank 1 of 2 in a segment of 4096 bytes: too small for
        // one ring of 8 KiB.
        let len = 4096;
        let file = seg::create(len, &[(0, len)], "dspark-shm-test-small").unwrap();
        let small = Seg::map(&file, len).unwrap();
        small.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Relaxed);
        small.u32_at(OFF_VERSION).store(VERSION, Ordering::Relaxed);
        small.u32_at(OFF_WORLD).store(2, Ordering::Relaxed);
        small.u32_at(OFF_RANK).store(1, Ordering::Relaxed);
        small.u64_at(OFF_NONCE).store(7, Ordering::Relaxed);
        let theirs = SegInfo {
            pid: std::process::id(),
            fd: file.as_raw_fd() as u32,
            len: len as u64,
            ring: me.ring as u64,
            nonce: 7,
        };
        let e = me.connect(&[me.info(), theirs]).unwrap_err();
        assert!(e.contains("rank 1") && e.contains("4096 bytes"), "{e}");
        let right = SegInfo {
            len: seg_len(2, me.ring) as u64,
            ..theirs
        };
        let e = me.connect(&[me.info(), right]).unwrap_err();
        assert!(
            e.contains("rank 1's segment"),
            "a mis-sized file is still caught: {e}"
        );
    }
}
