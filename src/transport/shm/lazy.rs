//! Connections and rings on first use: a pair of ranks that are not standing partners gets
//! its liveness connection (through the bootstrap's [`Links`], as the TCP and verbs
//! transports' connections on first use) and its two rings committed when one of them first
//! sends to or receives from the other. A send waits for the connection (so that every pair
//! that exchanged frames can tell a goodbye from a death); a receive starts it and goes on.
//! Nothing here blocks: [`Links`] is advanced whenever this rank looks at its peers.

use std::time::Instant;

use super::seg;
use super::sizing::ring_stride;
use super::ShmTransport;
use crate::error::{Error, Result};
use crate::transport::Links;

/// Liveness connections on first use (the bootstrap's [`Links`], as TCP and verbs use them).
#[derive(Debug)]
pub(super) struct Lazy {
    pub(super) links: Box<dyn Links>,
    /// Peers this rank started connecting to.
    pub(super) started: Vec<bool>,
    /// Peers whose connection on first use failed: the error every later use returns.
    pub(super) failed: Vec<Option<Error>>,
    /// When the processes of the peers still being connected were last looked at.
    pub(super) looked: Instant,
}

impl ShmTransport {
    /// Connects the peers it has no liveness connection for on first use, through `links`
    /// (the bootstrap's, as the TCP and verbs transports do): the first send to such a peer
    /// reports "not yet" until the connection is made; a receive starts it and goes on.
    pub fn with_links(mut self, links: Box<dyn Links>) -> Self {
        let world = self.world;
        self.lazy = Some(Lazy {
            links,
            started: vec![false; world],
            failed: vec![None; world],
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
        let linked = |t: &Self| {
            t.peers
                .get(peer)
                .and_then(Option::as_ref)
                .is_some_and(|p| p.stream.is_some())
        };
        let Some(l) = self.lazy.as_ref() else {
            return Ok(true);
        };
        if let Some(e) = &l.failed[peer] {
            return Err(self.prefer_status(e.clone(), op));
        }
        // A connection the peer made may be waiting already (then there is nothing to start:
        // the peer may even have exited since, after its last frames).
        let mut res = self.pump_links();
        if res.is_ok() && !linked(self) {
            if let Some(l) = self.lazy.as_mut() {
                if !l.started[peer] {
                    l.started[peer] = true;
                    res = l.links.start(peer).inspect_err(|e| {
                        l.failed[peer] = Some(e.clone());
                    });
                    if res.is_ok() {
                        res = self.pump_links();
                    }
                }
            }
        }
        if let Err(e) = res {
            return Err(self.prefer_status(e, op));
        }
        Ok(linked(self) || !sending)
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
        let Some(l) = self.lazy.as_mut() else {
            return Ok(());
        };
        let got = match l.links.progress() {
            Ok(g) => g,
            Err(e) => {
                // A connection to a peer that failed: every later use of it fails alike.
                if let Some(p) = e.peer().filter(|&p| p < self.world) {
                    if l.started[p] && l.failed[p].is_none() {
                        l.failed[p] = Some(e.clone());
                    }
                }
                return Err(self.prefer_status(e, "connect on first use (shm)"));
            }
        };
        for (p, s) in got {
            let fresh = self
                .peers
                .get(p)
                .and_then(Option::as_ref)
                .is_some_and(|q| q.stream.is_none());
            if !fresh {
                return Err(Error::Transport {
                    rank: Some(self.rank),
                    peer: Some(p),
                    op: "connect on first use (shm)".into(),
                    what: format!("a second connection from rank {p}, or not a peer"),
                });
            }
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
            self.commit(p)?;
        }
        if let Some(l) = self.lazy.as_ref() {
            for (p, q) in self.peers.iter().enumerate() {
                if let Some(q) = q {
                    if q.stream.is_none() && l.started[p] {
                        Self::notify(&q.seg);
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether a liveness connection this rank started is still in the making.
    pub(super) fn linking(&self) -> bool {
        self.lazy.as_ref().is_some_and(|l| {
            self.peers
                .iter()
                .enumerate()
                .any(|(p, q)| q.as_ref().is_some_and(|q| q.stream.is_none()) && l.started[p])
        })
    }
}
