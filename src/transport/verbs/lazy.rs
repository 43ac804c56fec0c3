//! Connections on first use: the pairs of ranks that got no queue pair at init (all-to-all,
//! send/recv, schedules outside the standing partners) connect when one of them first sends
//! to or receives from the other.
//!
//! The TCP connection comes from [`Links`] (the bootstrap's listener and token proofs, the
//! same as the TCP transport's connections on first use; a crossed dial is resolved there).
//! Over it each end sends, once the connection is there, a length-prefixed [`Blob`] with
//! the information of a queue pair and slot memory it just made for that peer; on the
//! other's, it moves its queue pair to RTR and RTS and sends one byte, [`READY`]. An end
//! writes frames only once it has the other's `READY`, that is once the other's queue pair
//! accepts them (a write into a queue pair still in INIT would be dropped and retried only
//! after the ACK timeout). The connection then stays open as the pair's liveness connection.
//!
//! Nothing here waits for a peer: every step reads or writes what the socket takes now and
//! the transport reports "not yet" until the pair is connected; [`Transport::wait`] polls
//! the sockets and [`Transport::check_peers`] advances the exchange too. The deadline is that
//! of the call that needs the peer.
//!
//! [`Transport::wait`]: crate::transport::Transport::wait
//! [`Transport::check_peers`]: crate::transport::Transport::check_peers

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;

use nix::poll::{PollFd, PollFlags};

use super::connect::{cq_entries, landing, Half, TheirEnd};
use super::options::CTRL_BYTES;
use super::wire::{self, Blob, DirectInfo, MAX_FIRST_USE, READY};
use super::{Peer, VerbsTransport};
use crate::error::{Error, Result};
use crate::transport::links::{Accept, FirstUse};
use crate::transport::Links;

/// The operation named in errors.
const OP: &str = "connect on first use (verbs)";

/// Connections on first use of one transport.
pub(super) struct Lazy {
    first: FirstUse,
    /// Exchanges in progress, by peer.
    shakes: Vec<Option<Shake>>,
    /// How many of `shakes` are in progress (so that `wait` asks in O(1)).
    active: usize,
}

/// What a connection on first use becomes: an exchange of queue pairs (the transport's half
/// of [`FirstUse`]).
struct Shaking<'a> {
    t: &'a mut VerbsTransport,
    shakes: &'a mut [Option<Shake>],
}

/// One exchange of queue-pair information over a fresh TCP connection.
struct Shake {
    s: TcpStream,
    /// This rank's queue pair (in INIT until the peer's information came) and slot memory.
    half: Half,
    /// What this rank sends: its message, then [`READY`] once its queue pair is at RTS.
    out: Vec<u8>,
    sent: usize,
    /// What arrived and was not parsed yet.
    inb: Vec<u8>,
    /// The peer's end, once its message came and this rank's queue pair is at RTS.
    theirs: Option<TheirEnd>,
    /// The peer's [`READY`] came.
    ready: bool,
}

impl VerbsTransport {
    /// Connects the peers it has no queue pair for on first use, through `links` (see the
    /// module docs of `lazy.rs`): the first send or receive to such a peer starts the
    /// connection and reports "not yet" until it is made.
    pub fn with_links(mut self, links: Box<dyn Links>) -> Self {
        let world = self.world;
        self.lazy = Some(Lazy {
            first: FirstUse::new(links, self.rank, world, OP, |p| {
                format!("a second connection from rank {p}")
            }),
            shakes: (0..world).map(|_| None).collect(),
            active: 0,
        });
        let n = self.connected();
        if n + 1 < world {
            self.desc.push_str(&format!(
                ", one queue pair per peer: {n} of {} connected at init, the others on first use",
                world - 1
            ));
        }
        self
    }

    /// Peers connected now (this rank excluded).
    pub fn connected(&self) -> usize {
        self.peers.iter().flatten().count()
    }

    /// Drops the exchanges in progress (the transport is closing or aborting): their peers
    /// see the connection close and report this rank lost.
    pub(super) fn drop_shakes(&mut self) {
        if let Some(l) = self.lazy.as_mut() {
            l.shakes.iter_mut().for_each(|s| *s = None);
            l.active = 0;
        }
    }

    /// Whether connections on first use are enabled.
    pub(super) fn lazy_enabled(&self) -> bool {
        self.lazy.is_some()
    }

    /// Whether an exchange is in progress (it needs pumping even when no socket is readable:
    /// a write that did not go out at once).
    pub(super) fn shaking(&self) -> bool {
        self.lazy.as_ref().is_some_and(|l| l.active > 0)
    }

    /// The descriptors to poll, with their events, for [`VerbsTransport::pump_links`].
    pub(super) fn lazy_fds(&self) -> Vec<PollFd<'_>> {
        let Some(l) = self.lazy.as_ref() else {
            return Vec::new();
        };
        let mut v = l.first.fds();
        if l.active > 0 {
            v.extend(
                l.shakes
                    .iter()
                    .flatten()
                    .map(|s| PollFd::new(s.s.as_fd(), PollFlags::POLLIN)),
            );
        }
        v
    }

    /// Where this rank's direct payloads would land at `peer`, from the direct region
    /// information exchanged at init (for a peer not connected yet).
    pub(super) fn landing_of(&self, peer: usize) -> Option<(u64, u32, usize)> {
        landing(
            self.rank,
            self.opts.slots,
            self.direct.as_ref(),
            self.direct_infos.get(peer)?,
        )
    }

    /// Whether `peer` is connected (and, when `sending`, its queue pair accepts writes); if
    /// not, starts or advances connecting to it (on first use). Without links, or for a rank
    /// that is no peer, `Ok(true)`: the caller reports that there is no connection.
    ///
    /// # Errors
    /// A connection on first use that failed (now or before), naming the peer.
    pub(super) fn link(&mut self, peer: usize, sending: bool) -> Result<bool> {
        if let Some(p) = self.peers.get(peer).and_then(Option::as_ref) {
            if !sending || !p.await_ready {
                return Ok(true);
            }
            // Its "ready" comes on the liveness connection. A peer found gone meanwhile is
            // reported by the caller (its state says why).
            self.examine(peer)?;
            return Ok(self.peers[peer]
                .as_ref()
                .is_some_and(|p| !p.await_ready || !p.is_open()));
        }
        if peer >= self.world || peer == self.rank || self.finished {
            return Ok(true);
        }
        let Some(mut l) = self.lazy.take() else {
            return Ok(true);
        };
        let r = l
            .first
            .link(
                peer,
                &mut Shaking {
                    t: self,
                    shakes: &mut l.shakes,
                },
            )
            .and_then(|()| self.advance_shakes(&mut l));
        l.active = l.shakes.iter().filter(|s| s.is_some()).count();
        self.lazy = Some(l);
        r?;
        Ok(self.peers[peer]
            .as_ref()
            .is_some_and(|p| !sending || !p.await_ready))
    }

    /// Takes the connections [`Links`] completed and advances every exchange, without
    /// waiting; installs the pairs that are connected.
    ///
    /// # Errors
    /// A failed link or exchange (the peer is failed from then on), or a second connection
    /// from a peer that is connected already.
    pub(super) fn pump_links(&mut self) -> Result<()> {
        let Some(mut l) = self.lazy.take() else {
            return Ok(());
        };
        let r = self.pump_with(&mut l);
        l.active = l.shakes.iter().filter(|s| s.is_some()).count();
        self.lazy = Some(l);
        r
    }

    fn pump_with(&mut self, l: &mut Lazy) -> Result<()> {
        if self.finished {
            return Ok(());
        }
        l.first.pump(&mut Shaking {
            t: self,
            shakes: &mut l.shakes,
        })?;
        self.advance_shakes(l)
    }

    /// Advances every exchange, without waiting; installs the pairs that are connected.
    fn advance_shakes(&mut self, l: &mut Lazy) -> Result<()> {
        for p in 0..l.shakes.len() {
            let Some(mut sh) = l.shakes[p].take() else {
                continue;
            };
            match self.advance(p, &mut sh) {
                Ok(true) => {
                    let Shake {
                        s,
                        half,
                        theirs,
                        ready,
                        ..
                    } = sh;
                    if let Some(t) = theirs {
                        tracing::debug!(
                            rank = self.rank,
                            peer = p,
                            ready,
                            "connected on first use"
                        );
                        let mut peer = Peer::new(p, half, t, Some(s), self.opts.slots);
                        // Its "ready" comes on the liveness connection (`examine`).
                        peer.await_ready = !ready;
                        self.peers[p] = Some(peer);
                    }
                }
                Ok(false) => l.shakes[p] = Some(sh),
                Err(e) => {
                    l.first.fail(p, &e);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    fn err(&self, peer: usize, what: impl Into<String>) -> Error {
        Error::Transport {
            rank: Some(self.rank),
            peer: Some(peer),
            op: OP.into(),
            what: what.into(),
        }
    }

    fn lost(&self, peer: usize, detail: impl Into<String>) -> Error {
        Error::PeerLost {
            rank: self.rank,
            peer,
            op: OP.into(),
            detail: detail.into(),
        }
    }

    /// A queue pair and slot memory for `peer`, and this rank's message about them.
    fn open_shake(&self, peer: usize, s: TcpStream) -> Result<Shake> {
        s.set_nonblocking(true)
            .map_err(|e| Error::io(Some(self.rank), Some(peer), OP, e))?;
        let half = Half::new(
            &self.pd,
            &self.cq,
            self.port,
            &self.opts,
            (self.rank, peer),
            &self.device,
        )
        .map_err(|w| self.err(peer, w))?;
        let blob = Blob::Capable {
            device: self.device.clone(),
            port: self.addr,
            slots: self.opts.slots as u32,
            slot_bytes: self.opts.slot_bytes() as u32,
            ctrl_bytes: CTRL_BYTES as u32,
            qps: vec![(peer as u32, half.info(&self.opts))],
            // Exchanged at init already (every rank's).
            direct: DirectInfo::None,
        };
        let out = wire::first_use_message(&blob);
        Ok(Shake {
            s,
            half,
            out,
            sent: 0,
            inb: Vec::new(),
            theirs: None,
            ready: false,
        })
    }

    /// Writes what the socket takes of `sh.out`.
    fn push_out(&self, peer: usize, sh: &mut Shake) -> Result<()> {
        while sh.sent < sh.out.len() {
            match sh.s.write(&sh.out[sh.sent..]) {
                Ok(0) => return Err(self.lost(peer, "connection closed during the exchange")),
                Ok(n) => sh.sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(self.lost(
                        peer,
                        format!("{e} while sending the queue-pair information (process died?)"),
                    ))
                }
            }
        }
        Ok(())
    }

    /// One step of the exchange with `peer`: `Ok(true)` once this rank's queue pair is at RTS
    /// and its "ready" went out. From then on the peer may write, and the frames' completions
    /// need the connection installed; the peer's "ready" may still be on its way (`sh.ready`).
    fn advance(&self, peer: usize, sh: &mut Shake) -> Result<bool> {
        self.push_out(peer, sh)?;
        let mut buf = [0u8; 512];
        loop {
            match sh.s.read(&mut buf) {
                Ok(0) => {
                    return Err(self.lost(
                        peer,
                        "connection closed during the queue-pair exchange (process died or \
                         closed its communicator?)",
                    ))
                }
                Ok(n) => {
                    sh.inb.extend_from_slice(&buf[..n]);
                    if sh.inb.len() > 4 + MAX_FIRST_USE + 1 {
                        return Err(self.err(
                            peer,
                            format!(
                                "rank {peer} sent more than {MAX_FIRST_USE} bytes in the exchange"
                            ),
                        ));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(self.lost(
                        peer,
                        format!("{e} during the queue-pair exchange (process died?)"),
                    ))
                }
            }
        }
        if sh.theirs.is_none() {
            let taken = wire::take_first_use(&mut sh.inb)
                .map_err(|w| self.err(peer, format!("rank {peer} sent {w}")))?;
            if let Some(blob) = taken {
                sh.theirs = Some(self.accept_end(peer, &blob, &mut sh.half)?);
                sh.out.push(READY);
                self.push_out(peer, sh)?;
            }
        }
        if sh.theirs.is_some() && !sh.ready {
            sh.ready = wire::take_ready(&mut sh.inb)
                .map_err(|w| self.err(peer, format!("rank {peer} sent {w}")))?;
        }
        Ok(sh.theirs.is_some() && sh.sent == sh.out.len())
    }

    /// Checks the peer's message against this rank's settings and connects this rank's queue
    /// pair to the peer's (RTR, RTS).
    fn accept_end(&self, peer: usize, blob: &Blob, half: &mut Half) -> Result<TheirEnd> {
        let Blob::Capable {
            device,
            port,
            slots,
            slot_bytes,
            ctrl_bytes,
            ..
        } = blob
        else {
            return Err(self.err(peer, format!("rank {peer} says it cannot use verbs")));
        };
        if (*slots as usize, *slot_bytes as usize) != (self.opts.slots, self.opts.slot_bytes()) {
            return Err(self.err(
                peer,
                format!(
                    "rank {} uses {} slots of {} bytes per peer but rank {peer} uses {slots} of \
                     {slot_bytes}: set the same DSPARK_IB_SLOTS, DSPARK_IB_SLOT_BYTES and \
                     DSPARK_CHUNK_BYTES on every rank",
                    self.rank,
                    self.opts.slots,
                    self.opts.slot_bytes()
                ),
            ));
        }
        if port.link != self.addr.link {
            return Err(self.err(
                peer,
                format!(
                    "this rank's RDMA port is {} but rank {peer}'s ({device}) is {}",
                    self.addr.link.name(),
                    port.link.name()
                ),
            ));
        }
        let Some(qp) = blob.qp_for(self.rank) else {
            return Err(self.err(
                peer,
                format!("rank {peer} sent no queue pair for rank {}", self.rank),
            ));
        };
        let rel = self.opts.reliability;
        half.connect((self.port, &self.addr), port, &qp, &rel)
            .map_err(|w| self.err(peer, format!("queue pair to rank {peer} ({device}): {w}")))?;
        Ok(TheirEnd {
            qp,
            slot_bytes: *slot_bytes as usize,
            ctrl_bytes: *ctrl_bytes as usize,
            landing: self.landing_of(peer),
        })
    }
}

impl Accept for Shaking<'_> {
    fn wants(&self, peer: usize) -> bool {
        self.t.peers.get(peer).is_some_and(Option::is_none)
            && self.shakes.get(peer).is_some_and(Option::is_none)
    }

    fn accept(&mut self, p: usize, s: TcpStream) -> Result<()> {
        // Room in the completion queue for one more queue pair (those connected and those
        // being connected), doubling when it grows (all-to-all connects every peer: n
        // resizes of a growing queue would copy O(n²) entries), never past every peer's.
        let pairs = self.t.connected() + self.shakes.iter().flatten().count() + 1;
        let need = cq_entries(self.t.opts.slots, pairs.min(self.t.world - 1));
        let entries = if need > self.t.cq.depth {
            let every = cq_entries(self.t.opts.slots, self.t.world - 1);
            need.max(self.t.cq.depth.saturating_mul(2).min(every))
        } else {
            need
        };
        if let Err(e) = self.t.cq.grow(entries) {
            return Err(self.t.err(
                p,
                format!(
                    "{}: cannot grow the completion queue to {entries} entries for its queue \
                     pair: {e}",
                    self.t.device
                ),
            ));
        }
        let sh = self.t.open_shake(p, s)?;
        tracing::debug!(rank = self.t.rank, peer = p, "exchanging queue pairs");
        self.shakes[p] = Some(sh);
        Ok(())
    }
}
