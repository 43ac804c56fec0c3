//! Connections and rings on first use: a pair of ranks that are not standing partners gets
//! its liveness connection (through the bootstrap's [`Links`], as the TCP and verbs
//! transports' connections on first use) and its two rings committed when one of them first
//! sends to or receives from the other. A send waits for the connection (so that every pair
//! that exchanged frames can tell a goodbye from a death); a receive starts it and goes on.
//! Nothing here blocks: [`Links`] is advanced whenever this rank looks at its peers.

use std::net::TcpStream;
use std::ops::Deref;
use std::time::Instant;

use super::seg;
use super::sizing::ring_stride;
use super::ShmTransport;
use crate::error::{Error, Result};
use crate::transport::links::{Accept, FirstUse};
use crate::transport::Links;

/// The operation named in errors.
const OP: &str = "connect on first use (shm)";

/// Liveness connections on first use (the bootstrap's [`Links`], as TCP and verbs use them).
/// The liveness code reads the links' descriptors and the started peers through it.
#[derive(Debug)]
pub(super) struct Lazy {
    first: FirstUse,
    /// When the processes of the peers still being connected were last looked at.
    pub(super) looked: Instant,
}

impl Deref for Lazy {
    type Target = FirstUse;

    fn deref(&self) -> &FirstUse {
        &self.first
    }
}

impl ShmTransport {
    /// Connects the peers it has no liveness connection for on first use, through `links`
    /// (the bootstrap's, as the TCP and verbs transports do): the first send to such a peer
    /// reports "not yet" until the connection is made; a receive starts it and goes on.
    pub fn with_links(mut self, links: Box<dyn Links>) -> Self {
        self.lazy = Some(Lazy {
            first: FirstUse::new(links, self.rank, self.world, OP, |p| {
                format!("a second connection from rank {p}, or not a peer")
            }),
            looked: Instant::now(),
        });
        self.desc = self.description();
        self
    }

    /// Commits the two rings between this rank and `peer` on this rank's side, on their
    /// first use: allocates the ring into this rank's segment (fallocate, as the owner) and
    /// populates the page tables of both (this rank's and the one it sends into in the
    /// peer's segment), so that no page is faulted in inside a transfer. A no-op once done.
    ///
    /// # Errors
    /// The memory could not be had (ENOMEM/ENOSPC: a memory cgroup's limit or the host's
    /// memory), naming the pair.
    pub(super) fn commit(&mut self, peer: usize) -> Result<()> {
        let Some(p) = self.peers.get(peer).and_then(Option::as_ref) else {
            return Ok(());
        };
        if p.committed {
            return Ok(());
        }
        let stride = ring_stride(self.ring);
        seg::commit(&self.file, p.rx_base, stride)
            .and_then(|()| self.own.populate(p.rx_base, stride))
            .and_then(|()| p.seg.populate(p.tx_base, stride))
            .map_err(|w| Error::Transport {
                rank: Some(self.rank),
                peer: Some(peer),
                op: "committing a shared-memory ring on first use".into(),
                what: format!(
                    "the rings between ranks {} and {peer} ({} KiB each): {w}",
                    self.rank,
                    stride / 1024
                ),
            })?;
        tracing::debug!(rank = self.rank, peer, "rings committed on first use");
        if let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) {
            p.committed = true;
        }
        Ok(())
    }

    /// Whether `peer` has its liveness connection; if not, starts or advances making it (on
    /// first use, through [`Links`]). A receive goes on meanwhile (`sending` false: what is
    /// in the ring is good whatever becomes of the connection); a send waits for it, so
    /// that every pair that exchanged frames can tell a goodbye from a death. Without links,
    /// `Ok(true)`.
    ///
    /// # Errors
    /// A connection on first use that failed (now or before), naming the peer: the peer's
    /// goodbye or abort where its segment says so.
    pub(super) fn link(&mut self, peer: usize, sending: bool, op: &str) -> Result<bool> {
        if self.done
            || self
                .peers
                .get(peer)
                .and_then(Option::as_ref)
                .is_none_or(|p| p.stream.is_some())
        {
            return Ok(true);
        }
        let Some(mut l) = self.lazy.take() else {
            return Ok(true);
        };
        // A connection the peer made may be waiting already (then there is nothing to start:
        // the peer may even have exited since, after its last frames).
        let res = l.first.link(peer, self);
        self.lazy = Some(l);
        if let Err(e) = res {
            return Err(self.prefer_status(e, op));
        }
        let linked = self
            .peers
            .get(peer)
            .and_then(Option::as_ref)
            .is_some_and(|p| p.stream.is_some());
        Ok(linked || !sending)
    }

    /// `e`, or the goodbye or abort of the peer it names, which says more.
    fn prefer_status(&self, e: Error, op: &str) -> Error {
        match e.peer() {
            Some(p) => self.status_error(p, op).unwrap_or(e),
            None => e,
        }
    }

    /// Installs the liveness connections [`Links`] completed, without waiting (commits the
    /// pair's rings too: the peer is about to use them), and wakes the peers whose connection
    /// is still in the making, so that they advance it.
    pub(super) fn pump_links(&mut self) -> Result<()> {
        if self.done {
            return Ok(());
        }
        let Some(mut l) = self.lazy.take() else {
            return Ok(());
        };
        let res = l.first.pump(self);
        self.lazy = Some(l);
        res
    }

    /// Whether a liveness connection this rank started is still in the making.
    pub(super) fn linking(&self) -> bool {
        self.lazy.as_ref().is_some_and(|l| l.linking(self))
    }
}

/// What a liveness connection on first use becomes (the transport's half of [`FirstUse`]).
impl Accept for ShmTransport {
    fn wants(&self, peer: usize) -> bool {
        self.peers
            .get(peer)
            .and_then(Option::as_ref)
            .is_some_and(|q| q.stream.is_none())
    }

    fn accept(&mut self, p: usize, s: TcpStream) -> Result<()> {
        s.set_nonblocking(true).map_err(|e| {
            Error::io(
                Some(self.rank),
                Some(p),
                "configuring the liveness connection",
                e,
            )
        })?;
        let _ = s.set_nodelay(true);
        tracing::debug!(
            rank = self.rank,
            peer = p,
            "liveness connection made on first use"
        );
        if let Some(q) = self.peers[p].as_mut() {
            q.stream = Some(s);
        }
        self.commit(p)
    }

    fn in_making(&mut self, peer: usize) {
        if let Some(q) = self.peers.get(peer).and_then(Option::as_ref) {
            Self::notify(&q.seg, self.light_fence);
        }
    }

    fn progress_failed(&self, e: Error) -> Error {
        self.prefer_status(e, OP)
    }

    /// A timeout with a peer whose process still runs: it is busy elsewhere (its door answers
    /// only inside its own calls), not lost. Its contributions and frames need no
    /// connection, and the call's deadline still bounds the wait.
    fn retry_link(&self, peer: usize, e: &Error, _unanswered: bool) -> bool {
        matches!(e, Error::Timeout { .. })
            && self
                .peers
                .get(peer)
                .and_then(Option::as_ref)
                .is_some_and(|p| p.state == super::PeerState::Open && super::liveness::alive(p))
    }
}
