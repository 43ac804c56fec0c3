//! Mixed communicators: shared memory between the ranks of one host, a network transport
//! (TCP) between hosts, in one communicator.
//!
//! [`MixedTransport`] routes every peer to one of two transports chosen at init: the
//! [`ShmTransport`] built over the ranks of this rank's host ([`super::shm::prepare_group`])
//! or the network transport built over the connections to the other hosts (the bootstrap's
//! streams to them; the streams to same-host peers stay the shm transport's liveness
//! descriptors). Frames to one peer always take one transport, so the per-pair FIFO order of
//! the [`Transport`] contract holds; the two transports share nothing else.
//!
//! # Waiting on both
//!
//! The shm transport sleeps on a futex in shared memory, TCP in `poll(2)`; no single system
//! call waits on both (a futex is not a descriptor). [`MixedTransport::wait`] therefore
//! looks at what the engine waits for:
//!
//! * **only same-host peers**: the shm wait (a futex sleep that a peer's publication ends at
//!   once), bounded by [`NET_CHECK`]; then the network peers are checked for an abort or a
//!   lost connection without blocking;
//! * **only other-host peers**: the network wait (`poll`, which ends as soon as data
//!   arrives), bounded by the same interval; then the shm peers are checked (status words,
//!   liveness connections);
//! * **both at once**: bounded alternation — a shm futex sleep of [`MIXED_SLICE_MIN`],
//!   doubling on every wait that finds nothing up to [`MIXED_SLICE_MAX`], then the network
//!   transport is checked and the call returns (a spurious wake-up, which the contract allows:
//!   the engine then tries every pending transfer, TCP ones included). Any completed transfer
//!   resets the slice.
//!
//! Why not one shared wake-up (a Unix socket or the liveness connection that shm peers write
//! to when this rank sleeps in `poll`, as UCX does, or a helper thread turning futex wakes
//! into an eventfd): it would change what every shm publication does on the fast path (the
//! shm transport's `notify`, which another change is reworking), or add a thread hand-off
//! to every shm wake-up. The ring's waits are one-sided — each rank receives from one
//! neighbour, and its send to the other completes into the ring or the socket buffer
//! without waiting — so over a mixed communicator it costs nothing extra. The both-sides
//! case pays at most the current slice in latency on the TCP side, and at most one wake-up
//! per slice in CPU while idle (≤ 1000/s at the largest slice), never a spinning core.
//!
//! Measured cost (2 cores shared with other work, 4 ranks, DSPARK_HOST_ID a,a,b,b on
//! loopback, dspark-bench, interleaved runs): all_reduce at 8 B 227–238 µs shm+tcp against
//! 231–240 µs pure TCP (pure shm 6.5–37 µs); send_recv between same-host ranks inside the
//! mixed communicator 0.70–3.3 µs at 8 B against 0.67–2.3 µs pure shm, between hosts
//! 2.2–4.9 µs against 2.9–5.4 µs pure TCP. The hierarchical allreduce is where both-sided
//! waits are common: during its rail phase (TCP) the first receive of its host all-gather
//! (shm) is already posted; counted at 64 KiB, about half of its waits were on both kinds.
//! Sleeping in `poll` instead of on the futex in that case made it no faster (hier at
//! 64 KiB–1 MiB 584–2940 µs against 604–2024 µs), and hier over pure TCP was no faster than
//! over shm+tcp (520–4408 µs against 605–2024 µs), so the alternation is not what limits it
//! on this machine; a shared wake-up would still remove the slice's latency (not done).
//!
//! # Liveness, abort, goodbye
//!
//! Each side keeps its own: the shm transport its status words and liveness connections,
//! TCP its stream ends and keepalives. [`Transport::abort`] and [`Transport::close`] go to
//! both, so an abort reaches every peer on either side; an abort or death seen on one side is
//! returned by the next wait or check whichever side the engine was waiting on, at most
//! [`NET_CHECK`] later.
//!
//! # Connections on first use
//!
//! Both sides connect the pairs outside the standing partners on first use through one
//! [`Links`] (the bootstrap's: one listener per rank), split by [`share_links`]: the network
//! side owns it (and polls its descriptors in its waits); the shm side asks it to start its
//! liveness connections and takes those to same-host peers from it. Those advance whenever
//! the network side pumps its links, which every mixed wait ends with. A failed connection
//! to a same-host peer goes to the shm side too, which judges it as over pure shm (a peer
//! late to its call is dialled again): the network side's call does not fail for it.

use nix::poll::PollFd;
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::shm::ShmTransport;
use super::Links;
use super::{
    AbortClass, FrameHeader, Interest, RecvProgress, RecvSink, Registering, SendProgress,
    Transport, TransportKind,
};
use crate::error::{Error, Result};

/// The longest a one-sided wait blocks before the other side's peers are checked for an
/// abort or a lost connection.
pub const NET_CHECK: Duration = Duration::from_millis(10);
/// First slice of a wait on peers of both kinds at once.
pub const MIXED_SLICE_MIN: Duration = Duration::from_micros(50);
/// Largest slice of a wait on peers of both kinds at once.
pub const MIXED_SLICE_MAX: Duration = Duration::from_millis(1);

/// Shared memory to the ranks of this host, a network transport to the others (see the
/// module docs).
#[derive(Debug)]
pub struct MixedTransport {
    rank: usize,
    shm: ShmTransport,
    net: Box<dyn Transport>,
    /// `local[p]`: `peer` p is reached through shared memory.
    local: Vec<bool>,
    slice: Duration,
    moved: bool,
    desc: String,
    li: Vec<Interest>,
    ni: Vec<Interest>,
}

impl MixedTransport {
    /// Routes the peers with `local[p]` to `shm`, the others to `net`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `local` does not fit the world or `net` is not a
    /// network transport.
    pub fn new(
        rank: usize,
        world: usize,
        shm: ShmTransport,
        net: Box<dyn Transport>,
        local: Vec<bool>,
    ) -> Result<Self> {
        if local.len() != world || rank >= world {
            return Err(Error::invalid(
                Some(rank),
                "mixed transport",
                format!("{} routes for a world of {world}", local.len()),
            ));
        }
        if net.kind() != TransportKind::Tcp {
            return Err(Error::invalid(
                Some(rank),
                "mixed transport",
                format!("{} between hosts is not supported (tcp only)", net.kind()),
            ));
        }
        let same: Vec<String> = (0..world)
            .filter(|&p| p == rank || local[p])
            .map(|p| p.to_string())
            .collect();
        let desc = format!(
            "shm+tcp: ranks {} over {}; the other hosts over {}",
            same.join(","),
            shm.describe(),
            net.describe()
        );
        Ok(MixedTransport {
            rank,
            shm,
            net,
            local,
            slice: MIXED_SLICE_MIN,
            moved: false,
            desc,
            li: Vec::new(),
            ni: Vec::new(),
        })
    }

    fn is_local(&self, peer: usize) -> bool {
        self.local.get(peer).copied().unwrap_or(false)
    }

    fn note(&mut self, r: Result<bool>) -> Result<bool> {
        if matches!(r, Ok(true)) {
            self.moved = true;
        }
        r
    }
}

impl Transport for MixedTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::ShmTcp
    }

    fn peer_kind(&self, peer: usize) -> TransportKind {
        if peer == self.rank {
            self.kind()
        } else if self.is_local(peer) {
            self.shm.kind()
        } else {
            self.net.kind()
        }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }

    fn connected_peers(&self) -> Option<usize> {
        let local = self.local.iter().filter(|&&l| l).count();
        let local = self.shm.connected_peers().unwrap_or(local);
        self.net.connected_peers().map(|n| n + local)
    }

    fn send(
        &mut self,
        peer: usize,
        hdr: &FrameHeader,
        data: &[u8],
        progress: &mut SendProgress,
    ) -> Result<bool> {
        let r = if self.is_local(peer) {
            self.shm.send(peer, hdr, data, progress)
        } else {
            self.net.send(peer, hdr, data, progress)
        };
        self.note(r)
    }

    fn peek(&mut self, peer: usize) -> Result<Option<FrameHeader>> {
        let r = if self.is_local(peer) {
            self.shm.peek(peer)
        } else {
            self.net.peek(peer)
        };
        if matches!(r, Ok(Some(_))) {
            self.moved = true;
        }
        r
    }

    fn recv(
        &mut self,
        peer: usize,
        progress: &mut RecvProgress,
        sink: &mut dyn RecvSink,
    ) -> Result<bool> {
        let r = if self.is_local(peer) {
            self.shm.recv(peer, progress, sink)
        } else {
            self.net.recv(peer, progress, sink)
        };
        self.note(r)
    }

    fn wait(&mut self, interest: &[Interest], deadline: Instant) -> Result<()> {
        let mut li = std::mem::take(&mut self.li);
        let mut ni = std::mem::take(&mut self.ni);
        li.clear();
        ni.clear();
        for it in interest {
            if self.is_local(it.peer) {
                li.push(*it);
            } else {
                ni.push(*it);
            }
        }
        if std::mem::take(&mut self.moved) {
            self.slice = MIXED_SLICE_MIN;
        }
        let now = Instant::now();
        let res = match (li.is_empty(), ni.is_empty()) {
            (false, true) | (true, true) => self
                .shm
                .wait(&li, deadline.min(now + NET_CHECK))
                .and_then(|()| self.net.check_peers()),
            (true, false) => self
                .net
                .wait(&ni, deadline.min(now + NET_CHECK))
                .and_then(|()| self.shm.check_peers()),
            (false, false) => {
                let r = self
                    .shm
                    .wait(&li, deadline.min(now + self.slice))
                    .and_then(|()| self.net.check_peers());
                self.slice = (self.slice * 2).min(MIXED_SLICE_MAX);
                r
            }
        };
        self.li = li;
        self.ni = ni;
        res
    }

    fn check_peers(&mut self) -> Result<()> {
        self.shm.check_peers()?;
        self.net.check_peers()
    }

    fn abort(&mut self, origin: usize, class: AbortClass, reason: &str) {
        self.shm.abort(origin, class, reason);
        self.net.abort(origin, class, reason);
    }

    fn close(&mut self) {
        self.shm.close();
        self.net.close();
    }

    fn collective_progress(&mut self, running: Option<u64>, completed: u64) {
        self.shm.collective_progress(running, completed);
        self.net.collective_progress(running, completed);
    }

    fn flush(&mut self, deadline: Instant) -> Result<()> {
        self.shm.flush(deadline)?;
        self.net.flush(deadline)
    }

    /// Reports the network side's zero-copy frames (the shm side always copies).
    /// Registrations are not forwarded: `registration_mut` stays `None`.
    fn registration(&self) -> Option<&dyn Registering> {
        self.net.registration()
    }
}

/// What the shm side of [`share_links`] asked for and gets.
#[derive(Debug, Default)]
struct Handoff {
    /// Same-host peers to start connecting to.
    starts: Vec<usize>,
    /// Connections to same-host peers that completed.
    ready: Vec<(usize, TcpStream)>,
    /// Starts and connections to same-host peers that failed, each with what the links said
    /// of it ([`Links::unanswered`]), oldest first.
    failed: Vec<(Error, bool)>,
}

fn handoff(h: &Mutex<Handoff>) -> std::sync::MutexGuard<'_, Handoff> {
    // A panic while the lock was held left nothing half-done worth refusing.
    h.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The network side's [`Links`] of [`share_links`]: owns the links, runs the shm side's starts
/// and hands it the connections to same-host peers.
#[derive(Debug)]
struct NetLinks {
    inner: Box<dyn Links>,
    local: Vec<bool>,
    shared: Arc<Mutex<Handoff>>,
}

impl Links for NetLinks {
    fn start(&mut self, peer: usize) -> Result<()> {
        self.inner.start(peer)
    }

    fn progress(&mut self, done: &mut Vec<(usize, TcpStream)>) -> Result<()> {
        let starts = std::mem::take(&mut handoff(&self.shared).starts);
        for p in starts {
            if let Err(e) = self.inner.start(p) {
                handoff(&self.shared).failed.push((e, false));
            }
        }
        let mut all = Vec::new();
        let res = self.inner.progress(&mut all);
        let local = |p: usize| self.local.get(p).copied().unwrap_or(false);
        for (p, s) in all {
            if local(p) {
                handoff(&self.shared).ready.push((p, s));
            } else {
                done.push((p, s));
            }
        }
        match res {
            // A same-host peer's connection (a liveness connection the shm side started) is
            // the shm side's to judge: it may dial again (a peer late to its call), and a
            // network call that needs only other hosts' ranks does not fail for it.
            Err(e) if e.peer().is_some_and(local) => {
                let unanswered = self.inner.unanswered(&e);
                handoff(&self.shared).failed.push((e, unanswered));
                Ok(())
            }
            res => res,
        }
    }

    fn fds(&self) -> Vec<PollFd<'_>> {
        self.inner.fds()
    }

    fn unanswered(&self, e: &Error) -> bool {
        self.inner.unanswered(e)
    }
}

/// The shm side's [`Links`] of [`share_links`]: its starts and completed connections go
/// through the network side, which advances them when it pumps its links.
#[derive(Debug)]
struct ShmLinks {
    shared: Arc<Mutex<Handoff>>,
    /// What the network side said of the failure [`Links::progress`] returned last.
    unanswered: bool,
}

impl Links for ShmLinks {
    fn start(&mut self, peer: usize) -> Result<()> {
        handoff(&self.shared).starts.push(peer);
        Ok(())
    }

    fn progress(&mut self, done: &mut Vec<(usize, TcpStream)>) -> Result<()> {
        let mut h = handoff(&self.shared);
        done.append(&mut h.ready);
        if !h.failed.is_empty() {
            let (e, unanswered) = h.failed.remove(0);
            self.unanswered = unanswered;
            return Err(e);
        }
        Ok(())
    }

    fn fds(&self) -> Vec<PollFd<'_>> {
        // Nothing of its own: the network side polls the links.
        Vec::new()
    }

    /// What the network side's links said of the failure [`Links::progress`] returned last
    /// (which is the one [`FirstUse`](super::links::FirstUse) asks about).
    fn unanswered(&self, _e: &Error) -> bool {
        self.unanswered
    }
}

/// Splits one rank's [`Links`] (the bootstrap's, whose listener is the only one a rank has)
/// between the two transports of a mixed communicator: `(network side, shm side)`, where
/// `local[p]` says that peer `p` is the shm side's. The network side owns the links; the shm
/// side's starts and connections advance when the network side pumps them (see the module
/// docs).
pub fn share_links(links: Box<dyn Links>, local: Vec<bool>) -> (Box<dyn Links>, Box<dyn Links>) {
    let shared = Arc::new(Mutex::new(Handoff::default()));
    (
        Box::new(NetLinks {
            inner: links,
            local,
            shared: Arc::clone(&shared),
        }),
        Box::new(ShmLinks {
            shared,
            unanswered: false,
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::super::links::tests::{stream, timeout, Script, Scripted};
    use super::*;

    /// The network side of 4 ranks whose ranks 0 and 1 share this host: a failure of a
    /// same-host peer's connection goes to the shm side (with what the links said of it),
    /// the network side's round is no error and keeps its own connections; a failure of
    /// another host's rank is the network side's.
    #[test]
    fn a_same_host_peers_failed_connection_is_the_shm_sides_to_judge() {
        let script = Arc::new(Mutex::new(Script::default()));
        let links = Box::new(Scripted(Arc::clone(&script)));
        let (mut net, mut shm) = share_links(links, vec![true, true, false, false]);
        {
            let mut s = script.lock().unwrap();
            s.done.push((3, stream()));
            s.done.push((1, stream()));
            s.fail = Some(timeout(1));
            s.unanswered = true;
        }
        let mut done = Vec::new();
        net.progress(&mut done).unwrap();
        assert_eq!(done.iter().map(|c| c.0).collect::<Vec<_>>(), [3]);
        let mut local = Vec::new();
        let e = shm.progress(&mut local).unwrap_err();
        assert_eq!(local.iter().map(|c| c.0).collect::<Vec<_>>(), [1]);
        assert_eq!(e.peer(), Some(1));
        assert!(shm.unanswered(&e), "the links' word on it went along");
        shm.progress(&mut local).unwrap();

        // A same-host peer's failure the links do not call unanswered says so on the shm
        // side too.
        {
            let mut s = script.lock().unwrap();
            s.fail = Some(timeout(0));
            s.unanswered = false;
        }
        net.progress(&mut done).unwrap();
        let e = shm.progress(&mut local).unwrap_err();
        assert_eq!(e.peer(), Some(0));
        assert!(!shm.unanswered(&e));

        script.lock().unwrap().fail = Some(timeout(2));
        let e = net.progress(&mut done).unwrap_err();
        assert_eq!(e.peer(), Some(2));
        shm.progress(&mut local).unwrap();
    }
}
