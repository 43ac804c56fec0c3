//! This rank's data listener: [`Door`] accepts the connections of the other ranks and keeps
//! each one a candidate until it has proved the job token, at init ([`super::mesh`]) and for
//! connections on first use ([`super::links`]). Candidates are read without waiting
//! ([`pull_message`]), so a stranger who sends half a message holds up nothing.
//!
//! The machine itself, [`Gate`], serves rank 0's rendezvous listener too ([`super::root`]):
//! one poll over the listener and every pending candidate, each with its own deadline
//! ([`HELLO_WAIT`] for its hello, and again for its answer to the challenge), a cap on the
//! candidates (the oldest that has said nothing of this job goes first) and a capped list of
//! what was refused ([`Refused`]), so that silent, half-speaking, garbage or connect-and-reset
//! connections cost a bounded amount of memory and error text, and never the job its init.
//! Once the rank table is known, a connection from an address that is no rank's is closed
//! unread ([`Gate::allow`]; `DSPARK_ACCEPT_ANY_SOURCE=1` turns that off for multi-homed
//! hosts).

#![forbid(unsafe_code)]

use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::auth::{self, Nonce, LABEL_ACCEPTOR, LABEL_CONNECTOR};
use super::msg::{self, Msg, PeerHello, Reject, MSG_PEER_PROOF, REJECT_MISMATCH};
use super::{describe, fresh_nonce, Ctx, PeerInfo, HELLO_WAIT, MAX_HELLO};
use crate::error::{Error, Result};

/// The reason of the refusal a connection on first use gets when the two ranks connected to
/// each other at once and the other one's connection is kept (not an error).
pub(super) const CROSSED: &str = "dspark: crossed connections, the higher rank's is kept";

/// The most connections on a listener that have not proved the job token yet, beyond one for
/// each rank still expected: what a stranger who floods the listener can make this rank hold.
pub(super) const MAX_STRANGERS: usize = 64;

/// The most connections taken from the listener's backlog in one round, before the
/// candidates that have spoken are read: a flood in the backlog cannot push out a rank whose
/// hello has arrived before it is read.
const ACCEPT_BATCH: usize = 16;

/// How many refusals an error message names (the rest are counted).
const SHOWN: usize = 8;

/// The most bytes of one refusal in an error message.
const ENTRY_BYTES: usize = 240;

/// What a listener refused, for the error if the deadline passes: the first [`SHOWN`], each
/// cut to [`ENTRY_BYTES`], and how many more. A stranger who connects and resets a million
/// times makes the error no longer.
#[derive(Debug, Default)]
pub(super) struct Refused {
    shown: Vec<String>,
    more: usize,
}

impl Refused {
    /// Records one refusal.
    pub(super) fn push(&mut self, why: String) {
        if self.shown.len() < SHOWN {
            self.shown.push(cut(why, ENTRY_BYTES));
        } else {
            self.more = self.more.saturating_add(1);
        }
    }

    /// How many were refused.
    pub(super) fn count(&self) -> usize {
        self.shown.len().saturating_add(self.more)
    }

    /// `"; refused: a; b … and N more refused"`, or nothing when none was.
    pub(super) fn suffix(&self) -> String {
        if self.shown.is_empty() {
            return String::new();
        }
        let mut s = format!("; refused: {}", self.shown.join("; "));
        if self.more > 0 {
            s += &format!(" … and {} more refused", self.more);
        }
        s
    }
}

/// `s` cut to at most `max` bytes (on a character boundary), marked when cut.
fn cut(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max.saturating_sub(3);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

/// At most [`SHOWN`] items of `items`, joined with `", "`, then how many more.
pub(super) fn capped_list(items: impl Iterator<Item = String>) -> String {
    let mut shown = Vec::new();
    let mut more = 0usize;
    for i in items {
        if shown.len() < SHOWN {
            shown.push(cut(i, ENTRY_BYTES));
        } else {
            more += 1;
        }
    }
    let mut s = shown.join(", ");
    if more > 0 {
        s += &format!(" … and {more} more");
    }
    s
}

/// What a hello claims, in words, for the warnings and errors that name a candidate.
pub(super) trait Claim {
    /// `" (claims rank 3 ...)"`.
    fn claim(&self) -> String;
}

impl Claim for PeerHello {
    fn claim(&self) -> String {
        format!(" (claims rank {} for rank {})", self.from, self.to)
    }
}

impl Claim for msg::Hello {
    fn claim(&self) -> String {
        format!(" (claims rank {})", self.rank)
    }
}

/// A connection on a listener that has not proved the job token yet; `H` is the hello it
/// says (a rank's to rank 0, or a data connection's).
pub(super) struct Candidate<H> {
    pub(super) s: TcpStream,
    pub(super) from: SocketAddr,
    accepted: Instant,
    /// Once it sent a hello of this job: the hello, what it claims, and the nonce this rank
    /// challenged it with. Nothing it claims counts before its proof has verified.
    pub(super) hello: Option<(Vec<u8>, H, Nonce)>,
    /// When it was challenged: it has [`HELLO_WAIT`] from then to answer.
    pub(super) challenged: Option<Instant>,
    /// The part of its next message that has arrived (length prefix included).
    got: Vec<u8>,
}

impl<H> Candidate<H> {
    fn new(s: TcpStream, from: SocketAddr) -> Candidate<H> {
        Candidate {
            s,
            from,
            accepted: Instant::now(),
            hello: None,
            challenged: None,
            got: Vec::new(),
        }
    }

    /// When it must have sent its next message: the hello within [`HELLO_WAIT`] of being
    /// accepted, the answer within [`HELLO_WAIT`] of the challenge.
    fn due(&self) -> Instant {
        self.challenged.unwrap_or(self.accepted) + HELLO_WAIT
    }

    /// Reads what has arrived of its next message without waiting: the message once it is
    /// whole (at most `max` bytes), `None` while part of it is still on the way. A stranger
    /// that sends half a message therefore holds up nothing (the rank reads the next
    /// candidate, or returns to its collective) until it is dropped at [`Candidate::due`].
    pub(super) fn pull(&mut self, max: usize) -> std::result::Result<Option<Vec<u8>>, String> {
        pull_message(&self.s, &mut self.got, max)
    }
}

impl Candidate<PeerHello> {
    /// The rank it claims to be, if its hello arrived and fits this rank: a higher rank, or
    /// with `any` (connections on first use, [`LazyLinks`](super::LazyLinks)) any other rank.
    fn claims(&self, me: usize, world: usize, any: bool) -> Option<usize> {
        let (_, h, _) = self.hello.as_ref()?;
        let r = h.from as usize;
        (h.to as usize == me && (r > me || (any && r != me)) && r < world).then_some(r)
    }
}

/// Reads what has arrived on `s` of a length-prefixed message without waiting, into `got`
/// (the part that arrived before, length prefix included): the message once it is whole (at
/// most `max` bytes), `None` while part of it is still on the way. `Err` is a reason in words:
/// the connection closed or failed, or the length is not a dspark message's.
pub(crate) fn pull_message(
    s: &TcpStream,
    got: &mut Vec<u8>,
    max: usize,
) -> std::result::Result<Option<Vec<u8>>, String> {
    use nix::sys::socket::{recv, MsgFlags};
    use std::os::fd::AsRawFd;
    loop {
        let whole = if got.len() < 4 {
            4
        } else {
            let mut len = [0u8; 4];
            len.copy_from_slice(&got[..4]);
            let n = u32::from_le_bytes(len) as usize;
            if n == 0 || n > max {
                return Err(format!("bad message length {n} (not a dspark peer?)"));
            }
            4 + n
        };
        if whole > 4 && got.len() == whole {
            let m = got.split_off(4);
            got.clear();
            return Ok(Some(m));
        }
        // Read into a small buffer: what a connection makes this rank hold grows with what
        // it actually sent, not with the length it announced.
        let mut buf = [0u8; 4096];
        let want = (whole - got.len()).min(buf.len());
        let r = recv(s.as_raw_fd(), &mut buf[..want], MsgFlags::MSG_DONTWAIT);
        match r {
            Ok(0) => return Err("closed the connection in the middle of the handshake".into()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(nix::errno::Errno::EINTR) => {}
            Err(nix::errno::Errno::EAGAIN) => return Ok(None),
            Err(e) => return Err(format!("reading the handshake: {e}")),
        }
    }
}

/// Sends `m` (length-prefixed) on a candidate's connection without waiting: a handshake
/// message fits a fresh connection's send buffer, so one that does not fit is a connection
/// that reads nothing. `Err` is a reason in words.
pub(super) fn send_now(s: &TcpStream, m: &Msg) -> std::result::Result<(), String> {
    use nix::sys::socket::{send, MsgFlags};
    use std::os::fd::AsRawFd;
    let len = u32::try_from(m.0.len())
        .map_err(|_| format!("a message of {} bytes does not fit its length", m.0.len()))?;
    let mut buf = Vec::with_capacity(4 + m.0.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&m.0);
    let mut off = 0;
    while off < buf.len() {
        match send(
            s.as_raw_fd(),
            &buf[off..],
            MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
        ) {
            Ok(n) => off += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(nix::errno::Errno::EAGAIN) => {
                return Err("it reads nothing (its receive window is full)".into())
            }
            Err(e) => return Err(format!("sending to it: {e}")),
        }
    }
    Ok(())
}

/// A listener and the connections on it that have not proved the job token yet: the
/// non-blocking machine of rank 0's rendezvous ([`super::root`]) and of every data listener
/// ([`Door`]). The protocol reads and answers what the candidates send; the gate accepts them
/// (at most `cap` at once), closes the ones whose time is up, and keeps the record of what it
/// refused.
pub(super) struct Gate<H> {
    pub(super) listener: TcpListener,
    pub(super) cands: Vec<Candidate<H>>,
    /// What was refused, and why (for the error if the deadline passes).
    pub(super) refused: Refused,
    /// The most candidates held at once.
    cap: usize,
    /// The addresses of the job's ranks, once the table is known: a connection from any other
    /// is closed unread. `None`: any address may connect.
    ranks: Option<Vec<IpAddr>>,
}

impl<H: Claim> Gate<H> {
    /// A gate on `listener` (non-blocking) holding at most `cap` candidates.
    pub(super) fn new(listener: TcpListener, cap: usize) -> Gate<H> {
        Gate {
            listener,
            cands: Vec::new(),
            refused: Refused::default(),
            cap: cap.max(1),
            ranks: None,
        }
    }

    /// From now on only the addresses of `peers` may connect (entries not known yet, with an
    /// unspecified address, are skipped).
    pub(super) fn allow(&mut self, peers: &[PeerInfo]) {
        let mut ips: Vec<IpAddr> = peers
            .iter()
            .map(|p| p.addr.ip().to_canonical())
            .filter(|ip| !ip.is_unspecified())
            .collect();
        ips.sort_unstable();
        ips.dedup();
        self.ranks = Some(ips);
    }

    /// Drops a candidate with a warning naming its address, recording why.
    pub(super) fn refuse(&mut self, c: Candidate<H>, why: &str) {
        let claim = c
            .hello
            .as_ref()
            .map(|(_, h, _)| h.claim())
            .unwrap_or_default();
        self.note(format!("{}{claim}: {why}", c.from));
    }

    /// Records a refusal, with a warning: each of the first few, then one at every power of
    /// two with the count, so that a flood of connections does not flood the log either.
    fn note(&mut self, line: String) {
        let n = self.refused.count().saturating_add(1);
        if n <= SHOWN {
            tracing::warn!("refused a bootstrap connection: {line}");
        } else if n.is_power_of_two() {
            tracing::warn!("refused {n} bootstrap connections so far; the latest: {line}");
        }
        self.refused.push(line);
    }

    /// Closes the candidates whose time is up, then waits at most `rem` (and at most a
    /// second, and never past the next candidate's time) for the listener or a candidate.
    /// Returns the candidates that are ready to be read, in the order they were accepted
    /// (taken out: the caller gives back those that stay), and whether connections wait on
    /// the listener.
    pub(super) fn wait(
        &mut self,
        ctx: &Ctx<'_>,
        rem: Duration,
    ) -> Result<(Vec<Candidate<H>>, bool)> {
        let now = Instant::now();
        let (silent, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.cands)
            .into_iter()
            .partition(|c| now >= c.due());
        self.cands = rest;
        for c in silent {
            let what = if c.challenged.is_some() {
                "no answer to the challenge"
            } else {
                "no hello"
            };
            self.refuse(c, &format!("{what} within {HELLO_WAIT:?}"));
        }
        let next = self
            .cands
            .iter()
            .map(|c| c.due().saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::MAX);
        let ms = rem.min(next).as_millis().min(1000) as u16;
        let ready: Vec<bool> = {
            let mut fds = Vec::with_capacity(1 + self.cands.len());
            fds.push(PollFd::new(self.listener.as_fd(), PollFlags::POLLIN));
            for c in &self.cands {
                fds.push(PollFd::new(c.s.as_fd(), PollFlags::POLLIN));
            }
            match nix::poll::poll(&mut fds, PollTimeout::from(ms)) {
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => return Ok((Vec::new(), false)),
                Err(e) => return Err(ctx.io(None, "polling a listener", io::Error::from(e))),
            }
            fds.iter()
                .map(|f| f.revents().is_some_and(|e| !e.is_empty()))
                .collect()
        };
        let mut turn = Vec::new();
        for i in (0..self.cands.len()).rev() {
            if ready[1 + i] {
                turn.push(self.cands.remove(i));
            }
        }
        turn.reverse();
        Ok((turn, ready[0]))
    }

    /// Takes connections waiting on the listener (at most [`ACCEPT_BATCH`]). One from an
    /// address that is no rank's ([`Gate::allow`]) is closed unread. When the gate is full,
    /// the oldest candidate that has said nothing of this job goes, else the oldest whose
    /// claim no rank needs (`needed`: the rank it claims, if that rank is still expected),
    /// else the new connection.
    pub(super) fn accept(
        &mut self,
        ctx: &Ctx<'_>,
        needed: &dyn Fn(&Candidate<H>) -> Option<usize>,
    ) -> Result<()> {
        for _ in 0..ACCEPT_BATCH {
            let (s, from) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) =>
                {
                    continue
                }
                Err(e) => return Err(ctx.io(None, "accepting a connection", e)),
            };
            if let Some(ranks) = &self.ranks {
                if !ranks.contains(&from.ip().to_canonical()) {
                    // Closed before anything is read from it.
                    drop(s);
                    self.note(format!(
                        "{from}: not the address of any rank of this job (closed unread; \
                         DSPARK_ACCEPT_ANY_SOURCE=1 accepts any address)"
                    ));
                    continue;
                }
            }
            let _ = s.set_nonblocking(false);
            let _ = s.set_nodelay(true);
            if self.cands.len() >= self.cap {
                let unique = |c: &Candidate<H>, all: &[Candidate<H>]| {
                    needed(c)
                        .is_some_and(|r| all.iter().filter(|o| needed(o) == Some(r)).count() == 1)
                };
                let victim = (0..self.cands.len())
                    .find(|&i| self.cands[i].hello.is_none())
                    .or_else(|| {
                        (0..self.cands.len()).find(|&i| !unique(&self.cands[i], &self.cands))
                    });
                let Some(i) = victim else {
                    self.refuse(Candidate::new(s, from), "too many unproven connections");
                    continue;
                };
                let old = self.cands.remove(i);
                self.refuse(old, "too many unproven connections");
            }
            self.cands.push(Candidate::new(s, from));
        }
        Ok(())
    }
}

/// What [`Door::admit`] waits for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Until {
    /// Every higher rank has proved itself or has a connection that said a hello for it.
    Challenged,
    /// Every higher rank has proved itself.
    Proven,
}

/// This rank's data listener while the higher ranks connect (steps 2 and 4 of
/// [`connect_mesh`](super::mesh::connect_mesh)). Anyone who can reach it can connect and claim any rank: a connection
/// is only a candidate until it proves the job token, and several can claim one rank; the
/// first whose proof verifies is that rank's connection. A candidate that sends something
/// else is dropped at once with a warning naming its address, one that says no hello within
/// [`HELLO_WAIT`], or does not answer the challenge within [`HELLO_WAIT`], too. Candidates
/// are read without waiting ([`Candidate::pull`]): one that sends half a message holds up
/// nothing, and the real rank is accepted and proved next to it. Once the rank table is
/// known ([`Door::allow`]), a connection from an address that is no rank's is closed before
/// anything is read from it. Only a connection that proved the token and then does not fit
/// (for another rank, or a rank already connected) fails the init: that is a rank of this
/// job, confused. (The warnings are rate-limited and the refusals counted: see [`Gate`].)
pub(super) struct Door {
    /// The listener and its candidates.
    pub(super) gate: Gate<PeerHello>,
    /// Connections on first use ([`LazyLinks`](super::LazyLinks)): any rank may connect, not only higher ones.
    pub(super) lazy: bool,
    /// With `lazy`: the ranks this one is connecting to itself (and the lower ones it has
    /// connected to). When two ranks connect to each other at once, the higher rank's
    /// connection is kept and the lower's refused as [`CROSSED`], also when its proof comes
    /// after the higher rank's connection completed.
    pub(super) dialing: Vec<bool>,
    /// Where each proved rank connected from.
    proven: Vec<Option<SocketAddr>>,
}

impl std::fmt::Debug for Door {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Door")
            .field("listener", &self.gate.listener)
            .field("candidates", &self.gate.cands.len())
            .field("refused", &self.gate.refused.count())
            .finish()
    }
}

impl Door {
    /// The data listener of this rank of `world` (non-blocking), open to any address until
    /// [`Door::allow`].
    pub(super) fn new(listener: TcpListener, world: usize) -> Door {
        Door {
            gate: Gate::new(listener, world.saturating_add(MAX_STRANGERS)),
            lazy: false,
            dialing: vec![false; world],
            proven: vec![None; world],
        }
    }

    /// Only the ranks of `peers` may connect from now on (unless `any_source`,
    /// `DSPARK_ACCEPT_ANY_SOURCE`).
    pub(super) fn allow(&mut self, peers: &[PeerInfo], any_source: bool) {
        if !any_source {
            self.gate.allow(peers);
        }
    }

    /// Accepts, challenges and checks connections until `until` holds for every higher rank
    /// in `need`.
    pub(super) fn admit(
        &mut self,
        ctx: &Ctx<'_>,
        mesh: &mut [Option<TcpStream>],
        until: Until,
        need: &dyn Fn(usize) -> bool,
    ) -> Result<()> {
        let me = ctx.rank();
        let world = mesh.len();
        loop {
            let done = (me + 1..world).filter(|&r| need(r)).all(|r| {
                mesh[r].is_some()
                    || (until == Until::Challenged
                        && self
                            .gate
                            .cands
                            .iter()
                            .any(|c| c.claims(me, world, false) == Some(r)))
            });
            if done {
                return Ok(());
            }
            let Some(rem) = ctx.remaining() else {
                return Err(self.timeout(ctx, mesh, need));
            };
            self.round(ctx, mesh, rem)?;
        }
    }

    /// One look at the listener and the candidates, waiting at most `rem` (and at most a
    /// second) for one of them: accepts what is waiting, and reads, challenges and checks
    /// what the candidates sent. A rank that proves itself lands in `mesh`.
    pub(super) fn round(
        &mut self,
        ctx: &Ctx<'_>,
        mesh: &mut [Option<TcpStream>],
        rem: Duration,
    ) -> Result<()> {
        let me = ctx.rank();
        let world = mesh.len();
        let (turn, incoming) = self.gate.wait(ctx, rem)?;
        for c in turn {
            if let Some(c) = self.step(ctx, mesh, c)? {
                self.gate.cands.push(c);
            }
        }
        if incoming {
            let lazy = self.lazy;
            let needed = |c: &Candidate<PeerHello>| {
                c.claims(me, world, lazy)
                    .filter(|&r| mesh.get(r).is_some_and(Option::is_none))
            };
            self.gate.accept(ctx, &needed)?;
        }
        Ok(())
    }

    /// Reads what candidate `c` sent: its hello (answered with the challenge) or its proof.
    /// Gives it back while it is still a candidate.
    fn step(
        &mut self,
        ctx: &Ctx<'_>,
        mesh: &mut [Option<TcpStream>],
        mut c: Candidate<PeerHello>,
    ) -> Result<Option<Candidate<PeerHello>>> {
        let sec = ctx.sec();
        let me = ctx.rank();
        let world = mesh.len();
        let Some((hello, h, nonce)) = c.hello.take() else {
            let m = match c.pull(MAX_HELLO) {
                Ok(Some(m)) => m,
                Ok(None) => return Ok(Some(c)),
                Err(e) => {
                    self.gate.refuse(c, &format!("reading a peer hello: {e}"));
                    return Ok(None);
                }
            };
            let h = match PeerHello::decode(&m) {
                Ok(h) => h,
                Err(e) => {
                    self.gate.refuse(c, &describe(&e));
                    return Ok(None);
                }
            };
            if h.job != sec.job || h.world as usize != world || h.token != sec.token {
                self.gate.refuse(c, "a data connection of another job");
                return Ok(None);
            }
            // The challenge, whatever it claims: its claims are judged once it proved the
            // token.
            let nonce = fresh_nonce(ctx)?;
            let mine = sec.peer_proof(LABEL_ACCEPTOR, &m, &nonce);
            if let Err(e) = send_now(&c.s, &msg::encode_peer_challenge(&nonce, &mine)) {
                self.gate.refuse(c, &e);
                return Ok(None);
            }
            c.hello = Some((m, h, nonce));
            c.challenged = Some(Instant::now());
            return Ok(Some(c));
        };
        let (r, to) = (h.from as usize, h.to as usize);
        let m = match c.pull(MAX_HELLO) {
            Ok(Some(m)) => m,
            Ok(None) => {
                c.hello = Some((hello, h, nonce));
                return Ok(Some(c));
            }
            Err(e) => {
                c.hello = Some((hello, h, nonce));
                self.gate
                    .refuse(c, &format!("reading the answer to the challenge: {e}"));
                return Ok(None);
            }
        };
        let verdict = match msg::decode_proof(&m, MSG_PEER_PROOF) {
            Ok(Ok(tag)) if auth::ct_eq(&tag, &sec.peer_proof(LABEL_CONNECTOR, &hello, &nonce)) => {
                None
            }
            Ok(Ok(_)) => {
                let why = sec.bad_proof(
                    &format!("the data connection from {} (rank {r}?)", c.from),
                    &format!("rank {me}"),
                );
                reject(&c.s, &why);
                Some(why)
            }
            Ok(Err(rej)) => Some(format!("gave up: {}", rej.why)),
            Err(w) => Some(format!("bad answer to the challenge: {w}")),
        };
        if let Some(why) = verdict {
            c.hello = Some((hello, h, nonce));
            self.gate.refuse(c, &why);
            return Ok(None);
        }
        // Proved: a rank of this job. Now what it claims counts.
        if self.lazy && to == me && r < me && self.dialing.get(r) == Some(&true) {
            // Both connect at once: this (higher) rank's own connection is kept.
            let rej = Reject {
                class: REJECT_MISMATCH,
                var: String::new(),
                why: CROSSED.into(),
            };
            let _ = ctx.send(&mut c.s, Some(r), rej.encode());
            return Ok(None);
        }
        let lower_ok = self.lazy && r < me;
        if to != me
            || (r <= me && !lower_ok)
            || r >= world
            || mesh[r].is_some()
            || self.proven[r].is_some()
        {
            let why = match self.proven.get(r).copied().flatten() {
                Some(prev) if to == me => format!(
                    "rank {r} connected twice to rank {me}: from {} and earlier from {prev} \
                     (the same rank on two processes?)",
                    c.from
                ),
                _ => format!(
                    "rank {r} at {} connected to rank {me} for rank {to} (duplicate or confused \
                     rank)",
                    c.from
                ),
            };
            reject(&c.s, &why);
            return Err(Error::Mismatch {
                rank: Some(me),
                peer: Some(r),
                op: "bootstrap".into(),
                what: why,
            });
        }
        ctx.send(&mut c.s, Some(r), Msg::new(msg::MSG_PEER_ACK))?;
        self.proven[r] = Some(c.from);
        mesh[r] = Some(c.s);
        Ok(None)
    }

    /// Every higher rank has proved itself: what is left claimed something and proved
    /// nothing.
    pub(super) fn finish(&mut self) {
        for c in std::mem::take(&mut self.gate.cands) {
            let why = if c.hello.is_some() {
                "no proof of the job token (every rank had connected and proved itself)"
            } else {
                "no hello (every rank had connected and proved itself)"
            };
            self.gate.refuse(c, why);
        }
    }

    /// The deadline passed with ranks unproven: which, and what was dropped meanwhile.
    fn timeout(
        &self,
        ctx: &Ctx<'_>,
        mesh: &[Option<TcpStream>],
        need: &dyn Fn(usize) -> bool,
    ) -> Error {
        let me = ctx.rank();
        let world = mesh.len();
        let missing: Vec<usize> = (me + 1..world)
            .filter(|&r| need(r) && mesh[r].is_none())
            .collect();
        let mut detail = format!(
            "waiting for rank(s) {} to connect and prove the job token",
            capped_list(missing.iter().map(ToString::to_string))
        );
        let mut unproven = self
            .gate
            .cands
            .iter()
            .filter_map(|c| {
                c.claims(me, world, false)
                    .map(|r| format!("{} (claims rank {r})", c.from))
            })
            .peekable();
        if unproven.peek().is_some() {
            detail += &format!("; connected but not proved: {}", capped_list(unproven));
        }
        detail += &self.gate.refused.suffix();
        ctx.timeout(missing.first().copied(), detail)
    }
}

/// Tells a data connection why it is refused (best effort, without waiting: it may be gone
/// already, or read nothing).
fn reject(s: &TcpStream, why: &str) {
    let rej = Reject {
        class: REJECT_MISMATCH,
        var: String::new(),
        why: why.into(),
    };
    let _ = send_now(s, &rej.encode());
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::Ipv4Addr;
    use std::os::fd::OwnedFd;

    use super::*;
    use crate::bootstrap::mesh::tests::{config, peer};

    /// A connection to `to` from `from` (an address of this host other than the default, as
    /// a stranger on another host would have).
    fn connect_from(from: Ipv4Addr, to: SocketAddr) -> TcpStream {
        use nix::sys::socket::{
            bind, connect, socket, AddressFamily, SockFlag, SockType, SockaddrIn,
        };
        let fd: OwnedFd = socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::empty(),
            None,
        )
        .unwrap();
        let [a, b, c, d] = from.octets();
        bind(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            &SockaddrIn::new(a, b, c, d, 0),
        )
        .unwrap();
        let SocketAddr::V4(to) = to else {
            panic!("an IPv4 address")
        };
        let [a, b, c, d] = to.ip().octets();
        connect(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            &SockaddrIn::new(a, b, c, d, to.port()),
        )
        .unwrap();
        TcpStream::from(fd)
    }

    /// A connection from an address that is no rank's is closed before anything is read from
    /// it (its bytes unread, the kernel resets it), and counted; the same bytes from a rank's
    /// address are read (and, not being a hello, refused after reading: a plain close).
    #[test]
    fn a_connection_from_no_ranks_address_is_closed_unread() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let mut door = Door::new(listener, 2);
        door.allow(
            &[peer(0, addr), peer(1, "127.0.0.1:9".parse().unwrap())],
            false,
        );
        let opts = config(0, 2, "a");
        let ctx = Ctx::new(&opts);
        let mut mesh: Vec<Option<TcpStream>> = vec![None, None];
        // A whole frame that is no hello: 8 bytes.
        let frame = [8u8, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];
        let mut stranger = connect_from(Ipv4Addr::new(127, 0, 0, 2), addr);
        stranger.write_all(&frame).unwrap();
        let mut rank = connect_from(Ipv4Addr::LOCALHOST, addr);
        rank.write_all(&frame).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..5 {
            door.round(&ctx, &mut mesh, Duration::from_millis(50))
                .unwrap();
        }
        let heard = |s: &mut TcpStream| {
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let mut b = [0u8; 16];
            s.read(&mut b).map_err(|e| e.kind())
        };
        assert_eq!(heard(&mut stranger), Err(io::ErrorKind::ConnectionReset));
        assert_eq!(heard(&mut rank), Ok(0));
        let text = door.gate.refused.suffix();
        assert!(
            text.contains(&format!(
                "{}: not the address of any rank",
                stranger.local_addr().unwrap()
            )) && text.contains("closed unread")
                && text.contains(&rank.local_addr().unwrap().to_string()),
            "{text}"
        );
        // Without the table (or with DSPARK_ACCEPT_ANY_SOURCE) any address is read.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let mut door = Door::new(listener, 2);
        door.allow(&[peer(0, addr)], true);
        let mut stranger = connect_from(Ipv4Addr::new(127, 0, 0, 2), addr);
        stranger.write_all(&frame).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..5 {
            door.round(&ctx, &mut mesh, Duration::from_millis(50))
                .unwrap();
        }
        assert_eq!(heard(&mut stranger), Ok(0));
    }

    /// A message that arrives in pieces is whole only once its last byte came; a length
    /// beyond the limit is refused before its body is read.
    #[test]
    fn pull_message_assembles_pieces_and_refuses_long_lengths() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (rx, _) = listener.accept().unwrap();
        let mut got = Vec::new();
        assert_eq!(pull_message(&rx, &mut got, 100), Ok(None));
        let body: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(&body);
        for piece in frame.chunks(3001) {
            assert_eq!(pull_message(&rx, &mut got, 20_000), Ok(None));
            tx.write_all(piece).unwrap();
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(pull_message(&rx, &mut got, 20_000), Ok(Some(body)));
        assert!(got.is_empty());
        tx.write_all(&200u32.to_le_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let e = pull_message(&rx, &mut got, 100).unwrap_err();
        assert!(e.contains("bad message length 200"), "{e}");
        drop(tx);
        let mut got = Vec::new();
        std::thread::sleep(Duration::from_millis(20));
        assert!(pull_message(&rx, &mut got, 100).is_err());
    }

    /// However many are refused, the text that lists them stays short: the first few, cut,
    /// and a count.
    #[test]
    fn the_refused_list_is_capped_in_count_and_bytes() {
        let mut r = Refused::default();
        assert_eq!(r.suffix(), "");
        for i in 0..10_000 {
            r.push(format!("127.0.0.1:{i}: {}", "é".repeat(1000)));
        }
        let s = r.suffix();
        assert!(
            s.len() < SHOWN * (ENTRY_BYTES + 4) + 64,
            "{} bytes",
            s.len()
        );
        assert!(
            s.ends_with(&format!(" … and {} more refused", 10_000 - SHOWN)),
            "{s}"
        );
        assert_eq!(r.count(), 10_000);
        let l = capped_list((0..1000).map(|i| i.to_string()));
        assert!(
            l.starts_with("0, 1, 2") && l.ends_with(&format!(" … and {} more", 1000 - SHOWN)),
            "{l}"
        );
    }
}
