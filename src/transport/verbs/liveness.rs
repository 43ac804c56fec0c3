//! Liveness and leaving: the bootstrap's TCP connections, kept open as a signal that the peer
//! process lives (a closed one without a goodbye means it died); waiting on the completion
//! channel and those connections together; and the goodbye and abort frames written to every
//! peer's control slot when this rank leaves.
//!
//! [`Transport::wait`]: crate::transport::Transport::wait
//! [`Transport::check_peers`]: crate::transport::Transport::check_peers
//! [`Transport::abort`]: crate::transport::Transport::abort
//! [`Transport::close`]: crate::transport::Transport::close

use std::io;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use dspark_sys as ffi;
use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::options::CTRL_BYTES;
use super::wire::{wr_id, Imm, WrKind, CTS_LEN};
use super::{PeerState, VerbsTransport};
use crate::error::{Error, Result};
use crate::transport::{AbortClass, FrameHeader, HEADER_LEN};

/// How long `abort` and `close` wait for their frames to be acknowledged.
const FAREWELL: Duration = Duration::from_millis(200);
/// How long a write posted before a peer's goodbye may still wait for its completion (the
/// peer acknowledged it before saying goodbye, so this is polling order, not the network).
pub(super) const CLOSED_GRACE: Duration = Duration::from_secs(2);

impl VerbsTransport {
    /// Checks the liveness connection to `peer`: a closed connection without a goodbye means
    /// the process is gone.
    fn examine(&mut self, peer: usize) -> Result<()> {
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Ok(());
        };
        if !p.is_open() {
            return Ok(());
        }
        let Some(s) = &mut p.stream else {
            return Ok(());
        };
        // Nothing is ever sent on this connection in verbs mode: discard whatever is there
        // (leftovers of the bootstrap) so that the end of the stream becomes visible.
        let mut b = [0u8; 256];
        let gone = loop {
            match io::Read::read(s, &mut b) {
                Ok(0) => {
                    break Some("connection closed without goodbye (process died?)".to_string())
                }
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break None,
                Err(e) => break Some(format!("{e} (process died?)")),
            }
        };
        let Some(detail) = gone else {
            return Ok(());
        };
        // A goodbye or abort written just before the process exited is in the CQ already.
        self.progress()?;
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Ok(());
        };
        if !p.is_open() {
            return Ok(());
        }
        let e = Error::PeerLost {
            rank: self.rank,
            peer,
            op: "communicator".into(),
            detail,
        };
        p.state = PeerState::Failed(e.clone());
        Err(e)
    }

    /// Writes a control frame (abort or goodbye) to every open peer and waits briefly for the
    /// writes to be acknowledged.
    fn farewell(&mut self, hdr: &FrameHeader, msg: &[u8]) {
        let sb = self.opts.slot_bytes();
        for (peer, p) in self.peers.iter_mut().enumerate() {
            let Some(p) = p else { continue };
            if !p.is_open() || p.their_ctrl_bytes < HEADER_LEN {
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

    /// [`Transport::wait`]: polls the completion queue (busy for the configured spin time),
    /// then sleeps on the completion channel and the liveness connections until `deadline`
    /// (at most 100 ms).
    pub(super) fn wait_events(&mut self, deadline: Instant) -> Result<()> {
        if self.progress()? > 0 {
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
            let timeout = PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX);
            match nix::poll::poll(&mut fds, timeout) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(Error::io(Some(self.rank), None, "poll", io::Error::from(e))),
            }
            // Only the liveness connections that poll flagged need a look (one read each):
            // the others have nothing new, and reading them all costs O(world) per wait.
            let flagged: Vec<usize> = fds[1..]
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
        Ok(())
    }

    /// [`Transport::check_peers`]: the first failed connection, or a peer found gone.
    pub(super) fn check_liveness(&mut self) -> Result<()> {
        self.progress()?;
        for i in 0..self.peers.len() {
            if let Some(p) = &self.peers[i] {
                if let PeerState::Failed(e) = &p.state {
                    return Err(e.clone());
                }
            }
            self.examine(i)?;
        }
        Ok(())
    }

    /// [`Transport::abort`]: an abort frame to every open peer, then every queue pair to ERR.
    pub(super) fn abort_connections(&mut self, origin: usize, class: AbortClass, reason: &str) {
        if self.finished {
            return;
        }
        let hdr = FrameHeader::abort(origin, 0, class);
        self.farewell(&hdr, reason.as_bytes());
        self.finished = true;
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

    /// [`Transport::close`]: a goodbye frame to every open peer, then every queue pair to ERR.
    pub(super) fn close_connections(&mut self) {
        if self.finished {
            return;
        }
        self.farewell(&FrameHeader::bye(), &[]);
        self.finished = true;
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
