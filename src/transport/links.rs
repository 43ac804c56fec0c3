//! Connections on first use, the bookkeeping the TCP, shared-memory and verbs transports
//! share: [`FirstUse`] owns the bootstrap's [`Links`] and remembers which peers this rank
//! started connecting to and which failed (a failure is the error of every later use of that
//! peer), takes the connections [`Links::progress`] completed (refusing a second connection
//! from a peer, or one from a rank that is no peer) and hands each to its transport through
//! [`Accept`]. What a transport then does with the stream (TCP configures it as a data
//! connection, shm as a liveness connection and commits the pair's rings, verbs exchanges
//! queue pairs over it) stays in the transport.

#![forbid(unsafe_code)]

use nix::poll::PollFd;
use std::net::TcpStream;

use super::Links;
use crate::error::{Error, Result};

/// A transport's side of [`FirstUse`]: which peers want a connection, and what becomes of one.
pub(crate) trait Accept {
    /// Whether a connection from `peer` is welcome: a peer of this transport with no
    /// connection, made or in the making.
    fn wants(&self, peer: usize) -> bool;

    /// Takes the connection to `peer`. An error fails the peer (every later use returns it).
    fn accept(&mut self, peer: usize, stream: TcpStream) -> Result<()>;

    /// After the connections that completed were taken: `peer`'s connection, which this rank
    /// started, is still in the making (shm wakes the peer so that it advances it).
    fn in_making(&mut self, _peer: usize) {}

    /// What a failed [`Links::progress`] is reported as (shm names a peer's goodbye or abort
    /// instead). The failure recorded for the peer is the error itself.
    fn progress_failed(&self, e: Error) -> Error {
        e
    }

    /// Whether the connection to `peer` that failed with `e` is to be made again on its next
    /// use instead of failing the peer (`unanswered`: the links say its host took the
    /// connection but it did not answer in time, [`Links::unanswered`]). A peer busy
    /// elsewhere, late to a collective by more than the bootstrap's hello wait, is not lost:
    /// its next use dials it again, within that call's deadline; a connection its host
    /// refused or never took still fails it at once. That is the default (TCP and verbs);
    /// shm judges by the peer's process instead.
    fn retry_link(&self, _peer: usize, _e: &Error, unanswered: bool) -> bool {
        unanswered
    }
}

/// Connections on first use of one transport (see the module docs).
#[derive(Debug)]
pub(crate) struct FirstUse {
    /// The bootstrap's links (shm's liveness code asks them for descriptors).
    pub(super) links: Box<dyn Links>,
    rank: usize,
    /// The operation named in the error about a connection that is not welcome.
    op: &'static str,
    /// That error's text, given the rank the connection came from.
    second: fn(usize) -> String,
    /// Peers this rank started connecting to (shm's liveness code reads them).
    pub(super) started: Vec<bool>,
    /// Peers whose connection on first use failed: the error every later use returns.
    failed: Vec<Option<Error>>,
}

impl FirstUse {
    /// Connections on first use for `rank` of `world` through `links`; a connection that is
    /// not welcome is an [`Error::Transport`] with `op` and the text `second` makes of the
    /// rank it came from.
    pub(crate) fn new(
        links: Box<dyn Links>,
        rank: usize,
        world: usize,
        op: &'static str,
        second: fn(usize) -> String,
    ) -> Self {
        FirstUse {
            links,
            rank,
            op,
            second,
            started: vec![false; world],
            failed: vec![None; world],
        }
    }

    /// Starts or advances connecting to `peer` (whom the caller needs and has no connection
    /// to): takes the connections that completed (the peer's own may be waiting already),
    /// then starts connecting to `peer` unless this rank did so before or `t` has no more use
    /// for it, and takes again. Whether `peer` is connected now is `t`'s to say.
    ///
    /// # Errors
    /// A connection on first use that failed, now or before (then every later call for that
    /// peer returns the same error), or one that is not welcome.
    pub(crate) fn link(&mut self, peer: usize, t: &mut impl Accept) -> Result<()> {
        if let Some(Some(e)) = self.failed.get(peer) {
            return Err(e.clone());
        }
        self.pump(t)?;
        if self.started.get(peer) == Some(&false) && t.wants(peer) {
            self.started[peer] = true;
            if let Err(e) = self.links.start(peer) {
                self.failed[peer] = Some(e.clone());
                return Err(e);
            }
            self.pump(t)?;
        }
        Ok(())
    }

    /// Takes the connections [`Links::progress`] completed, without waiting, and hands each
    /// to `t`; then tells `t` of the peers whose connection this rank started and that are
    /// still in the making.
    ///
    /// # Errors
    /// A failed link (a peer this rank started connecting to is failed from then on), a
    /// connection `t` could not take (its peer is failed from then on), or one that is not
    /// welcome: a second connection from a peer, or one from a rank that is no peer.
    pub(crate) fn pump(&mut self, t: &mut impl Accept) -> Result<()> {
        let world = self.started.len();
        let mut got = Vec::new();
        let polled = self.links.progress(&mut got);
        // A connection to a peer that failed: every later use of it fails alike, unless the
        // transport wants it made again (then its next use dials anew, and this is no error).
        let failure = polled.err().and_then(|e| {
            if let Some(p) = e.peer().filter(|&p| p < world) {
                if self.started[p] && self.failed[p].is_none() {
                    if t.retry_link(p, &e, self.links.unanswered(&e)) {
                        tracing::debug!(rank = self.rank, peer = p, "connecting again: {e}");
                        self.started[p] = false;
                        return None;
                    }
                    self.failed[p] = Some(e.clone());
                }
            }
            Some(e)
        });
        // The connections that completed in the same round are taken even then, and all of
        // them: one that is not welcome or that `t` could not take does not lose the others
        // (their peers hold their ends as made). The first error of the round is returned.
        let mut first: Option<Error> = None;
        for (p, s) in got {
            if p >= world || p == self.rank || !t.wants(p) {
                first.get_or_insert(Error::Transport {
                    rank: Some(self.rank),
                    peer: Some(p),
                    op: self.op.into(),
                    what: (self.second)(p),
                });
                continue;
            }
            if let Err(e) = t.accept(p, s) {
                if let Some(f) = self.failed.get_mut(p) {
                    *f = Some(e.clone());
                }
                first.get_or_insert(e);
            }
        }
        if let Some(e) = failure {
            return Err(t.progress_failed(e));
        }
        if let Some(e) = first {
            return Err(e);
        }
        for p in 0..world {
            if self.started[p] && t.wants(p) {
                t.in_making(p);
            }
        }
        Ok(())
    }

    /// Fails `peer` from now on with `e` (a step of the transport's own after the connection
    /// was taken failed).
    pub(crate) fn fail(&mut self, peer: usize, e: &Error) {
        if let Some(f) = self.failed.get_mut(peer) {
            *f = Some(e.clone());
        }
    }

    /// Whether a connection this rank started is still in the making.
    pub(crate) fn linking(&self, t: &impl Accept) -> bool {
        self.started
            .iter()
            .enumerate()
            .any(|(p, &s)| s && t.wants(p))
    }

    /// The descriptors to poll, with the events that mean [`FirstUse::pump`] has work.
    pub(crate) fn fds(&self) -> Vec<PollFd<'_>> {
        self.links.fds()
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// One end of a loopback connection (what the links hand over).
    pub(in super::super) fn stream() -> TcpStream {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let _ = l.accept().unwrap();
        s
    }

    pub(in super::super) fn timeout(peer: usize) -> Error {
        Error::Timeout {
            rank: 0,
            peer: Some(peer),
            op: "bootstrap".into(),
            waited: Duration::from_secs(5),
            detail: format!("waiting for rank {peer}'s challenge"),
        }
    }

    /// What the next `progress` of [`Scripted`] does: completes `done`, then fails with
    /// `fail`; `started` records the starts.
    #[derive(Debug, Default)]
    pub(in super::super) struct Script {
        pub(in super::super) done: Vec<(usize, TcpStream)>,
        pub(in super::super) fail: Option<Error>,
        pub(in super::super) unanswered: bool,
        pub(in super::super) started: Vec<usize>,
    }

    /// [`Links`] that do what their [`Script`] says.
    #[derive(Debug)]
    pub(in super::super) struct Scripted(pub(in super::super) Arc<Mutex<Script>>);

    impl Links for Scripted {
        fn start(&mut self, peer: usize) -> Result<()> {
            self.0.lock().unwrap().started.push(peer);
            Ok(())
        }
        fn progress(&mut self, done: &mut Vec<(usize, TcpStream)>) -> Result<()> {
            let mut s = self.0.lock().unwrap();
            done.append(&mut s.done);
            s.fail.take().map_or(Ok(()), Err)
        }
        fn fds(&self) -> Vec<PollFd<'_>> {
            Vec::new()
        }
        fn unanswered(&self, _: &Error) -> bool {
            self.0.lock().unwrap().unanswered
        }
    }

    /// A transport that takes every connection (and, by default, dials again the unanswered
    /// ones).
    #[derive(Default)]
    struct Take {
        got: Vec<usize>,
    }

    impl Accept for Take {
        fn wants(&self, peer: usize) -> bool {
            !self.got.contains(&peer)
        }
        fn accept(&mut self, peer: usize, _: TcpStream) -> Result<()> {
            self.got.push(peer);
            Ok(())
        }
    }

    /// Rank 0 of 4, its links scripted.
    fn first_use() -> (FirstUse, Arc<Mutex<Script>>) {
        let script = Arc::new(Mutex::new(Script::default()));
        let links = Box::new(Scripted(Arc::clone(&script)));
        let f = FirstUse::new(links, 0, 4, "test", |p| format!("a second from {p}"));
        (f, script)
    }

    /// Rank 0 linking to ranks 2 and 3, whose next round completes 3's connection and fails
    /// 2's with a timeout the links call `unanswered` or not.
    fn linking_2_and_3(unanswered: bool) -> (FirstUse, Arc<Mutex<Script>>, Take) {
        let (mut f, script) = first_use();
        let mut t = Take::default();
        f.link(2, &mut t).unwrap();
        f.link(3, &mut t).unwrap();
        assert_eq!(script.lock().unwrap().started, [2, 3]);
        {
            let mut s = script.lock().unwrap();
            s.done.push((3, stream()));
            s.fail = Some(timeout(2));
            s.unanswered = unanswered;
        }
        (f, script, t)
    }

    /// A round that completes one peer's connection and fails another's: the completed one
    /// is taken (it used to be dropped with the round, while its peer kept its end), the
    /// failed peer fails this call and every later use of it.
    #[test]
    fn a_failure_in_a_round_loses_no_connection_completed_in_it() {
        let (mut f, script, mut t) = linking_2_and_3(false);
        let e = f.pump(&mut t).unwrap_err();
        assert_eq!(e.peer(), Some(2), "{e}");
        assert_eq!(t.got, [3], "the completed connection was taken");
        // Rank 2 stays failed with the same error, without dialling again.
        let again = f.link(2, &mut t).unwrap_err();
        assert_eq!(again.to_string(), e.to_string());
        assert_eq!(script.lock().unwrap().started, [2, 3]);
        f.link(1, &mut t).unwrap();
    }

    /// A round whose first connection is not welcome (a second one from a connected peer)
    /// still takes the next one, and reports the first.
    #[test]
    fn an_unwelcome_connection_loses_none_after_it_in_the_round() {
        let (mut f, script) = first_use();
        let mut t = Take::default();
        t.got.push(2);
        script.lock().unwrap().done = vec![(2, stream()), (3, stream())];
        let e = f.pump(&mut t).unwrap_err();
        assert_eq!(e.peer(), Some(2), "{e}");
        assert!(e.to_string().contains("a second from 2"), "{e}");
        assert_eq!(t.got, [2, 3], "rank 3's connection was taken");
    }

    /// A peer that the links say took the connection but did not answer in time (late to
    /// its call) is dialled again on its next use when the transport wants it: no error, and
    /// a connection completed in the same round is taken too.
    #[test]
    fn an_unanswered_peer_is_dialled_again_and_the_round_is_no_error() {
        let (mut f, script, mut t) = linking_2_and_3(true);
        f.pump(&mut t).unwrap();
        assert_eq!(t.got, [3]);
        f.link(2, &mut t).unwrap();
        assert_eq!(
            script.lock().unwrap().started,
            [2, 3, 2],
            "dialled rank 2 again"
        );
    }
}
