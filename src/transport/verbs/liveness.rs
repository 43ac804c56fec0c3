//! Liveness and leaving: the bootstrap's TCP connections, kept open as a signal that the peer
//! process lives (a closed one without a goodbye means it died; TCP keepalive closes it when
//! the peer's node stops answering, see [`keep_alive`]); waiting on the completion channel
//! and those connections together; waiting, at the end of a call, for this rank's writes to
//! be acknowledged ([`Transport::flush`]); and the goodbye and abort frames written to every
//! peer's control slot when this rank leaves.
//!
//! A peer found gone is not an error by itself ([`PeerState::Gone`]): what it delivered is
//! still taken, and only a call that needs more from it (a receive that finds nothing more
//! within [`GONE_GRACE`], a send to it) fails, with [`Error::PeerLost`] naming it.
//!
//! What this cannot see: a *stopped* peer (`SIGSTOP`, a debugger, a livelocked process). Its
//! kernel keeps answering keepalive probes and its NIC keeps acknowledging RDMA writes, so
//! it is indistinguishable from a slow one, and the survivors report it at the deadline
//! ([`Error::Timeout`]).
//!
//! [`Transport::wait`]: crate::transport::Transport::wait
//! [`Transport::check_peers`]: crate::transport::Transport::check_peers
//! [`Transport::abort`]: crate::transport::Transport::abort
//! [`Transport::close`]: crate::transport::Transport::close
//! [`Transport::flush`]: crate::transport::Transport::flush

use std::io;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use dspark_sys as ffi;
use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::options::CTRL_BYTES;
use super::wire::{wr_id, Imm, WrKind, CTS_LEN, READY};
use super::{PeerState, VerbsTransport};
use crate::error::{Error, Result};
use crate::transport::{AbortClass, FrameHeader, HEADER_LEN};

/// TCP keepalive on the liveness connections: first probe after this much silence.
pub(super) const KEEPALIVE_IDLE: Duration = Duration::from_secs(2);
/// ... then one probe every this often ...
pub(super) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
/// ... and the connection is dead after this many unanswered probes.
pub(super) const KEEPALIVE_COUNT: u32 = 3;

/// Makes a liveness connection notice a peer *node* that went away (power lost, kernel
/// crashed, cable pulled), not just a peer process that died (whose kernel closes the
/// connection at once).
///
/// Nothing is sent on these connections in verbs mode, so without keepalive a dead node is
/// noticed only by the RDMA retries of a write to it (the transport's retry budget) — and a
/// rank that only *receives* from it writes nothing and waits for its whole deadline. With
/// probes after [`KEEPALIVE_IDLE`] of silence, every [`KEEPALIVE_INTERVAL`], at most
/// [`KEEPALIVE_COUNT`] unanswered (and `TCP_USER_TIMEOUT` at the same total, so that
/// unacknowledged data cannot stretch it), a dead node is noticed about 5 s after it went
/// quiet, plus [`GONE_GRACE`]. Three probes a second apart ride out a few lost segments on a
/// congested link; the kernel answers them, so the cost is one small segment per second per
/// idle connection.
///
/// A stopped process (`SIGSTOP`, a debugger) is *not* noticed this way: its kernel keeps
/// answering the probes (and its NIC keeps acknowledging RDMA writes), so it looks like a
/// slow peer and is reported at the deadline.
pub(super) fn keep_alive(s: &std::net::TcpStream) -> nix::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    let secs = |d: Duration| d.as_secs() as u32;
    setsockopt(s, sockopt::KeepAlive, &true)?;
    setsockopt(s, sockopt::TcpKeepIdle, &secs(KEEPALIVE_IDLE))?;
    setsockopt(s, sockopt::TcpKeepInterval, &secs(KEEPALIVE_INTERVAL))?;
    setsockopt(s, sockopt::TcpKeepCount, &KEEPALIVE_COUNT)?;
    let total = KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_COUNT;
    setsockopt(s, sockopt::TcpUserTimeout, &(total.as_millis() as u32))
}

/// How long `abort` and `close` wait for their frames to be acknowledged.
const FAREWELL: Duration = Duration::from_millis(200);
/// How long a write posted before a peer's goodbye may still wait for its completion (the
/// peer acknowledged it before saying goodbye, so this is polling order, not the network).
pub(super) const CLOSED_GRACE: Duration = Duration::from_secs(2);
/// How long, after a peer's liveness connection closed without a goodbye, a receive that
/// finds no frame from it and a write to it not yet seen complete keep waiting before they
/// fail. A rank's call returns only once its writes were acknowledged
/// ([`VerbsTransport::flush_writes`]), and an acknowledged write's receive completion is in
/// this rank's queue before the acknowledgement leaves, so the frames of a call the peer
/// finished are there before its process can exit; but the closed TCP connection and the
/// completions come through different parts of the kernel and can be polled in either
/// order. One second covers that ordering on a loaded machine and adds at most that much
/// to the time a dead peer takes to surface.
pub(super) const GONE_GRACE: Duration = Duration::from_secs(1);

impl VerbsTransport {
    /// Checks the liveness connection to `peer`: a closed connection without a goodbye means
    /// the process is gone. That is no error yet: the peer is marked [`PeerState::Gone`],
    /// the frames it delivered before are still taken, and only what needs more from it
    /// fails (a receive that finds nothing more, a send to it, see `next_header` and
    /// `peer_err`) — a rank that finished its call and exited fails no survivor's same call.
    /// Errors are those of the completions polled here (an abort that came with it).
    pub(super) fn examine(&mut self, peer: usize) -> Result<()> {
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Ok(());
        };
        if !p.is_open() {
            return Ok(());
        }
        let Some(s) = &mut p.stream else {
            return Ok(());
        };
        // Nothing is sent on this connection in verbs mode but, on a connection made on first
        // use, the peer's "ready" (its queue pair accepts writes): discard whatever else is
        // there (leftovers of the bootstrap) so that the end of the stream becomes visible.
        let mut b = [0u8; 256];
        let gone = loop {
            match io::Read::read(s, &mut b) {
                Ok(0) => {
                    break Some("connection closed without goodbye (process died?)".to_string())
                }
                Ok(_) if p.await_ready => {
                    if b[0] != READY {
                        let e = Error::Transport {
                            rank: Some(self.rank),
                            peer: Some(peer),
                            op: "connect on first use (verbs)".into(),
                            what: format!(
                                "rank {peer} sent {:#04x} where its ready mark belongs",
                                b[0]
                            ),
                        };
                        p.state = PeerState::Failed(e.clone());
                        return Err(e);
                    }
                    p.await_ready = false;
                    continue;
                }
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break None,
                Err(e) if e.raw_os_error() == Some(libc::ETIMEDOUT) => {
                    break Some(format!(
                        "its node stopped answering on the liveness connection (TCP keepalive \
                         gave up after {:.0?}): powered off, crashed or cut off? ({e})",
                        KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_COUNT
                    ))
                }
                Err(e) => break Some(format!("{e} (process died?)")),
            }
        };
        let Some(detail) = gone else {
            return Ok(());
        };
        // A goodbye or abort written just before the process exited, and the frames before
        // it, are in the CQ already.
        let polled = self.progress();
        if let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) {
            if p.is_open() {
                tracing::debug!(peer, %detail, "liveness connection closed: the peer is gone");
                p.state = PeerState::Gone {
                    at: Instant::now(),
                    detail,
                };
            }
        }
        polled.map(|_| ())
    }

    /// Writes a control frame (abort or goodbye) to every open peer and waits briefly for the
    /// writes to be acknowledged.
    fn farewell(&mut self, hdr: &FrameHeader, msg: &[u8]) {
        let sb = self.opts.slot_bytes();
        for (peer, p) in self.peers.iter_mut().enumerate() {
            let Some(p) = p else { continue };
            // A peer whose queue pair may still be in INIT gets nothing: it sees the
            // liveness connection close.
            if !p.is_open() || p.their_ctrl_bytes < HEADER_LEN || p.await_ready {
                continue;
            }
            if !p.sq.has_room() {
                tracing::warn!(
                    peer,
                    "no room in the send queue for a goodbye/abort frame: the peer will see this \
                     rank vanish instead"
                );
                continue;
            }
            let n = p.send.n as usize;
            let msg = &msg[..msg
                .len()
                .min(p.their_ctrl_bytes.min(CTRL_BYTES) - HEADER_LEN)];
            let len = HEADER_LEN + msg.len();
            let mut h = *hdr;
            h.len = msg.len() as u32;
            let off = n * sb + n * CTS_LEN;
            // SAFETY: `ctrl_out` lies inside `local_mem` and is written only here, once.
            unsafe {
                let dst = p.local_mem.as_ptr().add(off);
                std::ptr::copy_nonoverlapping(h.encode().as_ptr(), dst, HEADER_LEN);
                std::ptr::copy_nonoverlapping(msg.as_ptr(), dst.add(HEADER_LEN), msg.len());
            }
            let mut sge = [ffi::ibv_sge {
                addr: p.local_mem.as_ptr() as u64 + off as u64,
                length: len as u32,
                lkey: p.local_mr.lkey,
            }];
            let idx = p.sq.post(true);
            let imm = Imm::Ctrl { len: len as u32 }.encode();
            // SAFETY: the SGE is inside `local_mr` and never rewritten; the remote range is
            // the peer's control slot.
            let r = unsafe {
                p.qp.post_write_imm(
                    wr_id(peer, WrKind::Ctrl, idx),
                    &mut sge,
                    p.theirs.ctrl_addr,
                    p.theirs.rkey,
                    imm,
                    true,
                )
            };
            if r.is_ok() {
                p.farewell = Some(idx);
            }
        }
        let until = Instant::now() + FAREWELL;
        while Instant::now() < until {
            let _ = self.progress();
            let pending = self
                .peers
                .iter()
                .flatten()
                .any(|p| p.farewell.is_some_and(|i| p.sq.retired <= i) && p.is_open());
            if !pending {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// [`Transport::wait`](crate::transport::Transport::wait): polls the completion queue
    /// (busy for the configured spin time), then sleeps on the completion channel and the
    /// liveness connections until `deadline` (at most 100 ms).
    pub(super) fn wait_events(&mut self, deadline: Instant) -> Result<()> {
        if self.progress()? > 0 {
            if self.shaking() {
                self.pump_links()?;
            }
            return Ok(());
        }
        let spin_until = Instant::now() + self.opts.spin;
        while Instant::now() < spin_until.min(deadline) {
            if self.progress()? > 0 {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        if let Err(e) = self.cq.arm() {
            return Err(Error::Transport {
                rank: Some(self.rank),
                peer: None,
                op: e.verb.into(),
                what: e.err.to_string(),
            });
        }
        // A completion that raced with arming is polled here; the channel catches the rest.
        if self.progress()? > 0 {
            return Ok(());
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(());
        }
        // Wake up at least every 100 ms: robustness against a missed event costs nothing.
        let ms = (deadline - now).as_micros().div_ceil(1000).min(100) as i32;
        let cq_fd = self.cq.fd();
        let mut watched = Vec::with_capacity(self.world);
        let linking;
        {
            // SAFETY: the channel's descriptor stays open while `self.cq` lives, which
            // outlives this poll.
            let cq_bfd = unsafe { std::os::fd::BorrowedFd::borrow_raw(cq_fd) };
            let mut fds = vec![PollFd::new(cq_bfd, PollFlags::POLLIN)];
            for (i, p) in self.peers.iter().enumerate() {
                let Some(p) = p else { continue };
                if let (true, Some(s)) = (p.is_open(), &p.stream) {
                    watched.push(i);
                    fds.push(PollFd::new(
                        s.as_fd(),
                        PollFlags::POLLIN | crate::transport::rdhup(),
                    ));
                }
            }
            // Connections in the making: a peer connecting to this rank, or answering it.
            let ours = fds.len();
            fds.extend(self.lazy_fds());
            let timeout = PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX);
            match nix::poll::poll(&mut fds, timeout) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(Error::io(Some(self.rank), None, "poll", io::Error::from(e))),
            }
            linking = fds[ours..]
                .iter()
                .any(|f| f.revents().is_some_and(|e| !e.is_empty()));
            // Only the liveness connections that poll flagged need a look (one read each):
            // the others have nothing new, and reading them all costs O(world) per wait.
            let flagged: Vec<usize> = fds[1..ours]
                .iter()
                .zip(&watched)
                // nix cannot name POLLRDHUP, so `revents()` is None exactly when it is set.
                .filter(|(fd, _)| fd.revents().is_none_or(|r| !r.is_empty()))
                .map(|(_, &i)| i)
                .collect();
            watched = flagged;
        }
        self.cq.drain_events();
        self.progress()?;
        // A flagged liveness connection that reads as closed means its process is gone.
        for i in watched {
            self.examine(i)?;
        }
        if linking || self.shaking() {
            self.pump_links()?;
        }
        Ok(())
    }

    /// [`Transport::flush`](crate::transport::Transport::flush): waits until every write
    /// posted to an open peer is acknowledged (or the peer is found gone or failed, or
    /// `deadline` passes). Writes are mostly unsignalled, so where the last one to a peer is,
    /// a signalled zero-length RDMA write follows it: on a reliable connection its completion means every write before it was
    /// acknowledged. Without this, a rank that returned from a call and exited at once took
    /// its last frames with it (a queue pair destroyed with the process sends nothing more,
    /// and a large frame goes out only as acknowledgements come back), and its peers' same
    /// call failed.
    pub(super) fn flush_writes(&mut self, deadline: Instant) -> Result<()> {
        if self.finished {
            return Ok(());
        }
        let mut target: Vec<Option<u64>> = vec![None; self.peers.len()];
        loop {
            let mut pending = false;
            for (peer, p) in self.peers.iter_mut().enumerate() {
                let Some(p) = p else { continue };
                if !p.is_open() || p.sq.retired >= p.sq.posted {
                    continue;
                }
                if target[peer].is_none() {
                    if p.sq.last_signalled == p.sq.posted {
                        target[peer] = Some(p.sq.posted);
                    } else if p.sq.has_room() {
                        let idx = p.sq.post(true);
                        // SAFETY: a zero-length write reads and writes no memory; the remote
                        // address and rkey are the peer's control slot, valid anyway.
                        let r = unsafe {
                            p.qp.post_write(
                                wr_id(peer, WrKind::Cts, idx),
                                &mut [],
                                p.theirs.ctrl_addr,
                                p.theirs.rkey,
                                true,
                            )
                        };
                        if let Err(e) = r {
                            // Recorded: the next call that needs this peer reports it.
                            let _ = p.fail_verb(
                                self.rank,
                                peer,
                                format!("{} (delivery mark)", e.verb),
                                &e,
                            );
                            continue;
                        }
                        target[peer] = Some(p.sq.posted);
                    }
                }
                // Without room yet, the signalled writes in the queue make some soon.
                pending |= target[peer].is_none_or(|t| p.sq.retired < t);
            }
            if !pending {
                return Ok(());
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    rank = self.rank,
                    "writes still unacknowledged at the end of the call's deadline"
                );
                return Ok(());
            }
            // A failed connection is in its state (reported by the next call that needs
            // it); an abort from a peer (the job is going down) and errors of the queue
            // itself are this call's.
            match self.wait_events(deadline) {
                Ok(())
                | Err(Error::PeerLost { .. })
                | Err(Error::Transport { peer: Some(_), .. }) => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// [`Transport::check_peers`](crate::transport::Transport::check_peers): the first failed
    /// connection, or a peer found gone.
    pub(super) fn check_liveness(&mut self) -> Result<()> {
        self.progress()?;
        for i in 0..self.peers.len() {
            self.examine(i)?;
            if let Some(p) = &self.peers[i] {
                match &p.state {
                    PeerState::Failed(e) => return Err(e.clone()),
                    PeerState::Gone { detail, .. } => {
                        return Err(Error::PeerLost {
                            rank: self.rank,
                            peer: i,
                            op: "communicator".into(),
                            detail: detail.clone(),
                        })
                    }
                    // Reported by `progress` above unless this collective may still finish.
                    PeerState::Open | PeerState::Closed(_) | PeerState::Aborted { .. } => {}
                }
            }
        }
        self.pump_links()
    }

    /// [`Transport::abort`](crate::transport::Transport::abort): an abort frame to every open
    /// peer, then every queue pair to ERR.
    pub(super) fn abort_connections(&mut self, origin: usize, class: AbortClass, reason: &str) {
        if self.finished {
            return;
        }
        let mut hdr = FrameHeader::abort(origin, 0, class);
        // How far this rank got: a peer still in a collective this rank completed finishes
        // it (`VerbsTransport::abort_news`).
        hdr.seq = self.coll_done;
        self.farewell(&hdr, reason.as_bytes());
        self.finished = true;
        self.drop_shakes();
        for p in self.peers.iter_mut().flatten() {
            if let Err(e) = p.qp.to_err() {
                tracing::debug!(qpn = p.qp.qpn, error = %e, "moving a queue pair to ERR failed");
            }
            if let Some(s) = &p.stream {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
        // Collect the flushed completions so that nothing is left in flight.
        let _ = self.progress();
    }

    /// [`Transport::close`](crate::transport::Transport::close): a goodbye frame to every
    /// open peer, then every queue pair to ERR.
    pub(super) fn close_connections(&mut self) {
        if self.finished {
            return;
        }
        self.farewell(&FrameHeader::bye(), &[]);
        self.finished = true;
        self.drop_shakes();
        for p in self.peers.iter_mut().flatten() {
            if let Err(e) = p.qp.to_err() {
                tracing::debug!(qpn = p.qp.qpn, error = %e, "moving a queue pair to ERR failed");
            }
            if let Some(s) = &p.stream {
                let _ = s.shutdown(std::net::Shutdown::Write);
            }
        }
        let _ = self.progress();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{getsockopt, sockopt};
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn liveness_connections_get_keepalive_and_a_user_timeout() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        assert!(!getsockopt(&s, sockopt::KeepAlive).unwrap());
        keep_alive(&s).unwrap();
        assert!(getsockopt(&s, sockopt::KeepAlive).unwrap());
        assert_eq!(getsockopt(&s, sockopt::TcpKeepIdle).unwrap(), 2);
        assert_eq!(getsockopt(&s, sockopt::TcpKeepInterval).unwrap(), 1);
        assert_eq!(getsockopt(&s, sockopt::TcpKeepCount).unwrap(), 3);
        assert_eq!(getsockopt(&s, sockopt::TcpUserTimeout).unwrap(), 5000);
    }
}
