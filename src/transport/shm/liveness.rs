//! Liveness, goodbye and abort (see the module docs of [`super`]): the peers' liveness
//! connections, polled without blocking, and their processes, watched through
//! `/proc/<pid>/stat` while a connection is in the making; the errors a peer's `status` word
//! (goodbye, abort) or its death turns into; sleeping on this rank's `bell` until something
//! may move; and writing this rank's own goodbye or abort.
//!
//! A peer found gone is not an error by itself ([`PeerState::Gone`]): what it wrote to the
//! ring is still taken, and only what needs more from it fails (outside a collective, the
//! next look at the peers fails too). Nor is, during a collective, the abort of a peer that
//! had completed that collective ([`ShmTransport::abort_news`]).

use std::io::{self, Read};
use std::net::Shutdown;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::seg;
use super::{
    out_of_bounds, PeerState, ShmTransport, LINK_POLL, LIVENESS_POLL, MSG_CAP, OFF_BELL, OFF_CLASS,
    OFF_DONE, OFF_MSG, OFF_MSG_LEN, OFF_ORIGIN, OFF_SLEEPING, OFF_STATUS, PROCESS_POLL, RING_TAIL,
    STATUS_ABORT, STATUS_BYE, STATUS_OPEN,
};
use crate::error::{Error, Result};
use crate::transport::{rdhup, AbortClass, Interest};

/// Whether `p`'s process runs: its pid names a process that is not a zombie and started
/// when the peer's did (not another process that took the pid since).
/// Only "no such process" is death: a read that fails otherwise (no file descriptor left,
/// no memory) or a text that does not parse says nothing about the peer, which counts as
/// alive (it used to count as dead: a live peer then failed as gone).
pub(super) fn alive(p: &super::Peer) -> bool {
    match std::fs::read_to_string(format!("/proc/{}/stat", p.pid)) {
        Ok(text) => parse_proc_stat(&text).is_none_or(|(state, t)| {
            !matches!(state, 'Z' | 'X' | 'x') && p.started.is_none_or(|s| s == t)
        }),
        Err(e) => !gone(&e),
    }
}

/// Whether reading a process's `/proc` file failed because the process is not there (the
/// file is missing, or the process exited between the open and the read).
fn gone(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH)
}

/// The state and start time (clock ticks after boot) of process `pid`, from
/// `/proc/<pid>/stat`; `None` when there is no such process.
pub(super) fn proc_stat(pid: u32) -> Option<(char, u64)> {
    parse_proc_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The state and start time in the text of a `/proc/<pid>/stat` file.
pub(crate) fn parse_proc_stat(text: &str) -> Option<(char, u64)> {
    // "pid (comm) state ppid ...": comm may hold anything, so split after its last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    // starttime is the 22nd field; `rest` begins at the 3rd.
    let start = f.nth(18)?.parse().ok()?;
    Some((state, start))
}

impl ShmTransport {
    /// The error a peer's `status` word announces (goodbye or abort), if any.
    pub(super) fn status_error(&self, peer: usize, op: &str) -> Option<Error> {
        let p = self.peers.get(peer)?.as_ref()?;
        match p.seg.u32_at(OFF_STATUS).load(Ordering::Acquire) {
            STATUS_OPEN => None,
            STATUS_BYE => Some(self.lost(peer, op, "peer closed its communicator")),
            _ => {
                let class = p.seg.u32_at(OFF_CLASS).load(Ordering::Relaxed) as u8;
                let origin = p.seg.u32_at(OFF_ORIGIN).load(Ordering::Relaxed) as usize;
                let n = (p.seg.u32_at(OFF_MSG_LEN).load(Ordering::Relaxed) as usize).min(MSG_CAP);
                let mut msg = vec![0u8; n];
                if let Err(b) = p.seg.read(OFF_MSG, &mut msg) {
                    return Some(out_of_bounds(self.rank, peer)(b));
                }
                let reason = String::from_utf8_lossy(&msg).into_owned();
                Some(AbortClass::error(class, self.rank, origin, op, reason))
            }
        }
    }

    /// Whether the peer aborted (not a goodbye).
    fn aborted_peer(&self, peer: usize) -> bool {
        self.peers
            .get(peer)
            .and_then(Option::as_ref)
            .is_some_and(|p| p.seg.u32_at(OFF_STATUS).load(Ordering::Acquire) == STATUS_ABORT)
    }

    /// The abort of `peer`, if it aborted and it fails this rank's call now: once everything
    /// the peer sent before it is taken, as over TCP (where the abort frame queues behind the
    /// data), and except during a collective the peer had completed when it aborted. That
    /// peer wrote all this rank needs from it and needs nothing more, so its failure in a
    /// later call (losing a third rank that exited right after this collective) must not fail
    /// this one: this rank finishes it, and its next call fails. What needs more from the
    /// peer fails at once (the receive finds its ring empty, the send its `status`).
    fn abort_of(&mut self, peer: usize) -> Option<Error> {
        let p = self.peers.get(peer)?.as_ref()?;
        if !self.aborted_peer(peer) || self.rx_pending(p) {
            return None;
        }
        let done = p.seg.u64_at(OFF_DONE).load(Ordering::Relaxed);
        if self.coll_running.is_some_and(|c| c <= done) {
            self.peer_aborted = true;
            return None;
        }
        self.status_error(peer, "communicator")
    }

    /// The abort that fails this rank's call now ([`ShmTransport::abort_of`]), looked for by
    /// `send` and `recv` once an abort was let through a collective (`wait` looks always).
    pub(super) fn abort_news(&mut self) -> Option<Error> {
        if !self.peer_aborted {
            return None;
        }
        (0..self.peers.len()).find_map(|i| self.abort_of(i))
    }

    /// Reads the liveness connection of `peer`: end of stream without a goodbye marks it
    /// gone.
    fn examine(&mut self, peer: usize) {
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return;
        };
        if p.state != PeerState::Open {
            return;
        }
        let Some(stream) = p.stream.as_mut() else {
            return;
        };
        let mut b = [0u8; 256];
        let gone = loop {
            match stream.read(&mut b) {
                // Nothing is sent on it in shm mode: discard bootstrap leftovers.
                Ok(0) => {
                    break Some(
                        "its process died: the liveness connection closed without a goodbye"
                            .to_string(),
                    )
                }
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break None,
                Err(e) => {
                    break Some(format!(
                        "its liveness connection failed: {e} (process died?)"
                    ))
                }
            }
        };
        if let Some(d) = gone {
            p.state = PeerState::Gone(d);
        }
    }

    /// The error of a peer found gone, for an operation that needs more from it (or
    /// `None` while what it wrote is still to be taken).
    pub(super) fn gone_error(&self, peer: usize, op: &str) -> Option<Error> {
        let p = self.peers.get(peer)?.as_ref()?;
        match &p.state {
            PeerState::Open => None,
            PeerState::Lost(d) => Some(self.lost(peer, op, d.clone())),
            PeerState::Gone(d) => {
                if let Some(e) = self.status_error(peer, op) {
                    return Some(e);
                }
                Some(self.lost(peer, op, d.clone()))
            }
        }
    }

    /// Polls every open peer's liveness connection without blocking; returns the first
    /// failure that this rank cannot wait through: an abort, or a gone peer with nothing
    /// more to take from it.
    pub(super) fn check_liveness(&mut self) -> Result<()> {
        self.look_at_linking();
        let mut fds = Vec::with_capacity(self.world);
        let mut which = Vec::with_capacity(self.world);
        for (i, p) in self.peers.iter().enumerate() {
            let Some(p) = p else { continue };
            let Some(stream) = p.stream.as_ref() else {
                continue;
            };
            if p.state == PeerState::Open {
                fds.push(PollFd::new(stream.as_fd(), PollFlags::POLLIN | rdhup()));
                which.push(i);
            }
        }
        // Connections in the making (a peer connecting to this rank, or answering it): their
        // links are advanced when one of their descriptors has something, or always where
        // the links have none of their own (shm+tcp's, which only hand over).
        let ours = fds.len();
        let mut pump = false;
        if let Some(l) = self.lazy.as_ref() {
            let link_fds = l.links.fds();
            pump = link_fds.is_empty();
            fds.extend(link_fds);
        }
        let mut flagged = Vec::new();
        if !fds.is_empty() {
            match nix::poll::poll(&mut fds, PollTimeout::ZERO) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    return Err(Error::io(Some(self.rank), None, "poll", io::Error::from(e)));
                }
            }
            for (fd, &i) in fds[..ours].iter().zip(&which) {
                if fd.revents().is_none_or(|r| !r.is_empty()) {
                    flagged.push(i);
                }
            }
            pump |= fds[ours..]
                .iter()
                .any(|f| f.revents().is_none_or(|r| !r.is_empty()));
        }
        drop(fds);
        if pump {
            self.pump_links()?;
        }
        for i in flagged {
            self.examine(i);
        }
        self.look_at_processes();
        for i in 0..self.peers.len() {
            if let Some(e) = self.abort_of(i) {
                return Err(e);
            }
            let Some(p) = self.peers[i].as_ref() else {
                continue;
            };
            if let PeerState::Gone(_) = &p.state {
                // Like a TCP connection closed with nothing left to read: outside a
                // collective an error now, unless it said goodbye (then only what needs it
                // fails); during one, only what needs it fails (see the module docs).
                let says_bye = p.seg.u32_at(OFF_STATUS).load(Ordering::Acquire) == STATUS_BYE;
                let idle = self.coll_running.is_none();
                if idle && !says_bye && !p.rx_in_frame && !self.rx_pending(p) {
                    if let Some(e) = self.gone_error(i, "communicator") {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether anything in `interest` may move now (or a peer changed its status).
    fn anything_ready(&self, interest: &[Interest]) -> bool {
        for it in interest {
            let Some(p) = self.peers.get(it.peer).and_then(Option::as_ref) else {
                continue;
            };
            if p.state != PeerState::Open
                || p.seg.u32_at(OFF_STATUS).load(Ordering::Acquire) != STATUS_OPEN
            {
                return true;
            }
            if it.recv && self.rx_pending(p) {
                return true;
            }
            if it.send && p.stream.is_none() && self.lazy.is_some() {
                // Its liveness connection is in the making (`wait` looks at it).
                continue;
            }
            if it.send {
                // A blocked send read the tail last (`send` re-reads it before it stops), so
                // it can move only once the receiver has taken more since. Any free byte is
                // not enough: a frame starts with a whole line, and the receiver leaves its
                // tail mid-line, so a sender could find 1-63 bytes free and never sleep.
                let tail = p.seg.u64_at(p.tx_base + RING_TAIL).load(Ordering::Acquire);
                if tail != p.tx_tail {
                    return true;
                }
            }
        }
        false
    }

    /// Marks gone the peers whose liveness connection is made but whose process ended: a
    /// child the peer forked without exec holds a copy of that socket, which the kernel
    /// closes only with the last copy (a rank killed with DataLoader workers alive went
    /// unnoticed until they ended, or until the deadline). At most every [`PROCESS_POLL`].
    fn look_at_processes(&mut self) {
        if self.procs_looked.elapsed() < PROCESS_POLL {
            return;
        }
        self.procs_looked = Instant::now();
        for p in self.peers.iter_mut().flatten() {
            if p.stream.is_some() && p.state == PeerState::Open && !alive(p) {
                p.state = PeerState::Gone(format!(
                    "its process {} ended (its liveness connection stays open: a process it \
                     forked holds it)",
                    p.pid
                ));
            }
        }
    }

    /// Marks gone the peers whose liveness connection is still in the making and whose
    /// process has ended (no such process, a zombie, or another process under its pid): a
    /// peer that died before it took this rank's connection. At most every
    /// [`LIVENESS_POLL`].
    fn look_at_linking(&mut self) {
        let Some(l) = self.lazy.as_mut() else {
            return;
        };
        if l.looked.elapsed() < LIVENESS_POLL {
            return;
        }
        l.looked = Instant::now();
        let started = l.started.clone();
        for (i, p) in self.peers.iter_mut().enumerate() {
            let Some(p) = p else { continue };
            if p.stream.is_some() || !started[i] || p.state != PeerState::Open {
                continue;
            }
            if !alive(p) {
                p.state = PeerState::Gone(format!(
                    "its process {} ended before its liveness connection was made",
                    p.pid
                ));
            }
        }
    }

    /// [`Transport::wait`](crate::transport::Transport::wait): sleeps on this rank's `bell` until a peer rings it, something in
    /// `interest` may move, the deadline or the next look at the liveness connections
    /// ([`LIVENESS_POLL`], [`LINK_POLL`] while one is in the making), then looks at them.
    pub(super) fn wait_on_bell(&mut self, interest: &[Interest], deadline: Instant) -> Result<()> {
        self.sleep_on_bell(deadline, |t| t.anything_ready(interest))
    }

    /// Sleeps on this rank's `bell` unless `ready` says something may move (asked after
    /// this rank said it sleeps, so a peer's ring is not missed), at most until `deadline`
    /// or the next look at the liveness connections, then looks at them.
    pub(super) fn sleep_on_bell(
        &mut self,
        deadline: Instant,
        ready: impl Fn(&Self) -> bool,
    ) -> Result<()> {
        let now = Instant::now();
        if now < deadline {
            let sleeping = self.own.u32_at(OFF_SLEEPING);
            sleeping.store(1, Ordering::Relaxed);
            let fenced = super::fence::sleeper(self.asym);
            if !fenced {
                self.membarrier_failed();
            }
            let bell = self.own.u32_at(OFF_BELL);
            let v = bell.load(Ordering::Acquire);
            if !ready(self) {
                // A peer that published with a compiler fence only may not have seen this
                // rank asleep when the membarrier failed: look again soon.
                let poll = if self.linking() || !fenced {
                    LINK_POLL
                } else {
                    LIVENESS_POLL
                };
                seg::futex_wait(bell, v, (deadline - now).min(poll));
            }
            self.own.u32_at(OFF_SLEEPING).store(0, Ordering::Relaxed);
        }
        self.check_liveness()
    }

    /// Says, once per process, that a sleeper's membarrier failed although the process had
    /// registered for them ([`super::fence`]): its wake-ups may then come at `LINK_POLL`.
    fn membarrier_failed(&self) {
        static SAID: AtomicBool = AtomicBool::new(false);
        if !SAID.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                rank = self.rank,
                "membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED) failed after the process registered \
                 ({}): peers that publish with a compiler fence may not wake this rank; it \
                 looks for their data every {LINK_POLL:?} while it sleeps",
                io::Error::last_os_error()
            );
        }
    }

    /// [`Transport::abort`](crate::transport::Transport::abort): writes the abort (class, origin, message) into this rank's
    /// `status`, wakes every peer and shuts the liveness connections.
    pub(super) fn announce_abort(&mut self, origin: usize, class: AbortClass, reason: &str) {
        if self.done {
            return;
        }
        self.done = true;
        let msg = reason.as_bytes();
        let msg = &msg[..msg.len().min(MSG_CAP)];
        if let Err(b) = self.own.write(OFF_MSG, msg) {
            tracing::warn!(
                rank = self.rank,
                "abort message not written to the segment: {b}"
            );
        }
        self.own
            .u32_at(OFF_MSG_LEN)
            .store(msg.len() as u32, Ordering::Relaxed);
        self.own
            .u32_at(OFF_CLASS)
            .store(class as u32, Ordering::Relaxed);
        self.own
            .u32_at(OFF_ORIGIN)
            .store(origin as u32, Ordering::Relaxed);
        // How far this rank got: a peer still in a collective this rank completed finishes
        // it (`ShmTransport::abort_of`).
        self.own
            .u64_at(OFF_DONE)
            .store(self.coll_done, Ordering::Relaxed);
        self.own
            .u32_at(OFF_STATUS)
            .store(STATUS_ABORT, Ordering::Release);
        for p in self.peers.iter_mut().flatten() {
            Self::ring_bell(&p.seg);
            if let Some(s) = &p.stream {
                let _ = s.shutdown(Shutdown::Both);
            }
            p.state = PeerState::Lost("this rank aborted".into());
        }
    }

    /// [`Transport::close`](crate::transport::Transport::close): says goodbye in this rank's `status`, wakes every peer and
    /// half-closes the liveness connections.
    pub(super) fn say_goodbye(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        self.own
            .u32_at(OFF_STATUS)
            .store(STATUS_BYE, Ordering::Release);
        for p in self.peers.iter_mut().flatten() {
            Self::ring_bell(&p.seg);
            if let Some(s) = &p.stream {
                let _ = s.shutdown(Shutdown::Write);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpStream;
    use std::time::Duration;

    use super::*;
    use crate::transport::shm::{prepare, Prepared, SegInfo, ShmOptions, OFF_PID};
    use crate::transport::Links;
    use crate::transport::{FrameHeader, RecvProgress, RecvSink, Transport};

    /// A sink that takes nothing.
    struct Nothing;

    impl RecvSink for Nothing {
        fn on_header(&mut self, _: &FrameHeader) -> Result<usize> {
            Ok(0)
        }
        fn direct(&mut self) -> Option<&mut [u8]> {
            None
        }
        fn granule(&self) -> usize {
            1
        }
        fn consume(&mut self, _: &[u8]) -> Result<()> {
            Ok(())
        }
    }

    /// A send blocked with less than a line free (the receiver's tail mid-line, the next
    /// frame's header needing a whole one) sleeps until the receiver takes more: its `wait`
    /// returned at once, so a sender spun a core for as long as its receiver was busy (about
    /// 100 000 waits in 100 ms; asleep, about one per 10 ms liveness look).
    #[test]
    fn a_send_blocked_with_less_than_a_line_free_sleeps_until_the_receiver_takes_more() {
        use crate::transport::shm::group_in_process;
        use crate::transport::shm::setup::tests::Take;
        use crate::transport::{FrameKind, SendProgress, NO_OP};
        let opts = ShmOptions {
            ring_bytes: 4096,
            ..ShmOptions::default()
        };
        let mut t = group_in_process(2, &|_| vec![], &|_| opts);
        let hdr = |len: usize| FrameHeader {
            kind: FrameKind::Data,
            coll: 0,
            dtype: 0,
            op: NO_OP,
            root: 0,
            len: len as u32,
            seq: 1,
            count: len as u64,
        };
        let send = |t: &mut ShmTransport, data: &[u8]| {
            t.send(1, &hdr(data.len()), data, &mut SendProgress::default())
                .unwrap()
        };
        // 132 bytes sent and taken: the receiver's tail mid-line.
        assert!(send(&mut t[0], &[1; 100]));
        assert!(t[1]
            .recv(0, &mut RecvProgress::default(), &mut Take(Vec::new()))
            .unwrap());
        // A frame up to 4200, then one that needs a line where 4 bytes are free.
        assert!(send(&mut t[0], &vec![2u8; 4008 - 32]));
        assert!(!send(&mut t[0], &[3; 8]));
        let interest = [Interest {
            peer: 1,
            recv: false,
            send: true,
        }];
        let (t0, mut waits) = (Instant::now(), 0);
        while t0.elapsed() < Duration::from_millis(100) {
            t[0].wait(&interest, Instant::now() + Duration::from_secs(1))
                .unwrap();
            waits += 1;
        }
        assert!(waits <= 30, "{waits} waits in 100 ms");
        // Once the receiver takes the frame, the send goes through.
        assert!(t[1]
            .recv(0, &mut RecvProgress::default(), &mut Take(Vec::new()))
            .unwrap());
        assert!(send(&mut t[0], &[3; 8]));
    }

    /// Links that never connect anything (a peer that never answers).
    #[derive(Debug)]
    struct Silent;

    impl Links for Silent {
        fn start(&mut self, _: usize) -> Result<()> {
            Ok(())
        }
        fn progress(&mut self, _: &mut Vec<(usize, TcpStream)>) -> Result<()> {
            Ok(())
        }
        fn fds(&self) -> Vec<PollFd<'_>> {
            Vec::new()
        }
    }

    /// Until its liveness connection is made, a peer is watched through its process: one
    /// that ended (here a child process that exited: a zombie, then reaped) is reported
    /// lost, naming it, by the next check, long before any deadline.
    #[test]
    fn a_peer_whose_process_ended_before_its_connection_was_made_is_lost_not_waited_for() {
        let partners = |_: usize| Vec::new();
        let opts = ShmOptions {
            ring_bytes: 8192,
            ..ShmOptions::default()
        };
        let preps: Vec<Prepared> = (0..2)
            .map(|r| prepare(r, 2, &partners, opts).unwrap())
            .collect();
        // Rank 1's process is a child that exits at once.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let t = Instant::now();
        while proc_stat(child.id()).is_some_and(|(s, _)| s != 'Z')
            && t.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        preps[1]
            .seg
            .u32_at(OFF_PID)
            .store(child.id(), Ordering::Relaxed);
        let infos: Vec<SegInfo> = preps.iter().map(Prepared::info).collect();
        let segs = preps[0].connect(&infos).unwrap();
        let mut it = preps.into_iter();
        let mut t0 = ShmTransport::new(it.next().unwrap(), segs, vec![None, None])
            .unwrap()
            .with_links(Box::new(Silent));
        assert_eq!(t0.connected_peers(), Some(0));
        assert!(t0
            .describe()
            .contains("liveness over TCP connections: 0 of 1 at init"));
        // A receive starts the connection and finds nothing yet.
        let mut rp = RecvProgress::default();
        assert!(!t0.recv(1, &mut rp, &mut Nothing).unwrap());
        let interest = [Interest {
            peer: 1,
            recv: true,
            send: false,
        }];
        let lost = |t0: &mut ShmTransport| -> Option<Error> {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Err(e) = t0.wait(&interest, Instant::now() + LIVENESS_POLL) {
                    return Some(e);
                }
            }
            None
        };
        // The zombie counts as gone.
        let e = lost(&mut t0).expect("a zombie peer is lost");
        assert!(
            matches!(&e, Error::PeerLost { peer: 1, detail, .. } if detail.contains("ended")),
            "{e:?}"
        );
        child.wait().unwrap();
    }

    /// An abort from a peer that had completed the collective this rank runs (it failed in
    /// the next one, say on losing a rank that exited) lets that collective finish: the
    /// abort fails the next call instead (#22 item 3). One that had not completed it fails
    /// it at once.
    #[test]
    fn an_abort_from_a_peer_that_completed_the_running_collective_fails_only_the_next_call() {
        let partners = |_: usize| Vec::new();
        let opts = ShmOptions {
            ring_bytes: 8192,
            ..ShmOptions::default()
        };
        let two = || super::super::setup::group_in_process(2, &partners, &|_| opts);
        let by_1 = |r: &Result<()>| matches!(r, Err(Error::Aborted { by: 1, reason, .. }) if reason.contains("lost rank 2"));

        let mut t = two();
        t[1].collective_progress(Some(2), 1);
        t[1].abort(
            1,
            AbortClass::Other,
            "rank 1: lost rank 2 during all_reduce #2",
        );
        t[0].collective_progress(Some(1), 0);
        t[0].check_peers().expect("#1 is not failed by the abort");
        t[0].wait(&[], Instant::now() + Duration::from_millis(5))
            .unwrap();
        t[0].collective_progress(None, 1);
        assert!(by_1(&t[0].check_peers()));
        // The next call's first receive reports it too, before it looks at any ring.
        let mut rp = RecvProgress::default();
        let r = t[0].recv(1, &mut rp, &mut Nothing).map(|_| ());
        assert!(by_1(&r), "{r:?}");

        let mut t = two();
        t[1].collective_progress(Some(1), 0);
        t[1].abort(
            1,
            AbortClass::Other,
            "rank 1: lost rank 2 during all_reduce #1",
        );
        t[0].collective_progress(Some(1), 0);
        assert!(by_1(&t[0].check_peers()));
    }
}
