//! This rank's data listener: [`Door`] accepts the connections of the other ranks and keeps
//! each one a candidate until it has proved the job token, at init ([`super::mesh`]) and for
//! connections on first use ([`super::links`]). Candidates are read without waiting
//! ([`pull_message`]), so a stranger who sends half a message holds up nothing.

#![forbid(unsafe_code)]

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::auth::{self, Nonce, LABEL_ACCEPTOR, LABEL_CONNECTOR};
use super::msg::{self, Msg, PeerHello, Reject, MSG_PEER_PROOF, REJECT_MISMATCH};
use super::{describe, fresh_nonce, Ctx, HELLO_WAIT, MAX_HELLO};
use crate::error::{Error, Result};

/// The reason of the refusal a connection on first use gets when the two ranks connected to
/// each other at once and the other one's connection is kept (not an error).
pub(super) const CROSSED: &str = "dspark: crossed connections, the higher rank's is kept";

/// The most connections on a data listener that have not proved the job token yet, beyond
/// one for each higher rank: what a stranger who floods the listener can make this rank hold.
const MAX_STRANGERS: usize = 64;

/// A connection on this rank's data listener that has not proved the job token yet.
pub(super) struct Candidate {
    pub(super) s: TcpStream,
    from: SocketAddr,
    accepted: Instant,
    /// Once it sent a hello of this job: the hello, what it claims, and the nonce this rank
    /// challenged it with. Nothing it claims counts before its proof has verified.
    hello: Option<(Vec<u8>, PeerHello, Nonce)>,
    /// When it was challenged: it has [`HELLO_WAIT`] from then to answer.
    challenged: Option<Instant>,
    /// The part of its next message that has arrived (length prefix included).
    got: Vec<u8>,
}

impl Candidate {
    fn new(s: TcpStream, from: SocketAddr) -> Candidate {
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
    fn pull(&mut self, max: usize) -> std::result::Result<Option<Vec<u8>>, String> {
        pull_message(&self.s, &mut self.got, max)
    }

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
        let old = got.len();
        got.resize(whole, 0);
        let r = recv(s.as_raw_fd(), &mut got[old..], MsgFlags::MSG_DONTWAIT);
        got.truncate(old + r.unwrap_or(0));
        match r {
            Ok(0) => return Err("closed the connection in the middle of the handshake".into()),
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(nix::errno::Errno::EAGAIN) => return Ok(None),
            Err(e) => return Err(format!("reading the handshake: {e}")),
        }
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
/// nothing, and the real rank is accepted and proved next to it. Only a connection
/// that proved the token and then does not fit (for another rank, or a rank already
/// connected) fails the init: that is a rank of this job, confused.
pub(super) struct Door {
    pub(super) listener: TcpListener,
    /// Connections on first use ([`LazyLinks`](super::LazyLinks)): any rank may connect, not only higher ones.
    pub(super) lazy: bool,
    /// With `lazy`: the ranks this one is connecting to itself (and the lower ones it has
    /// connected to). When two ranks connect to each other at once, the higher rank's
    /// connection is kept and the lower's refused as [`CROSSED`], also when its proof comes
    /// after the higher rank's connection completed.
    pub(super) dialing: Vec<bool>,
    pub(super) cands: Vec<Candidate>,
    /// Where each proved rank connected from.
    proven: Vec<Option<SocketAddr>>,
    /// What was dropped, and why (for the error if the deadline passes).
    refused: Vec<String>,
}

impl std::fmt::Debug for Door {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Door")
            .field("listener", &self.listener)
            .field("candidates", &self.cands.len())
            .finish()
    }
}

impl Door {
    pub(super) fn new(listener: TcpListener, world: usize) -> Door {
        Door {
            listener,
            lazy: false,
            dialing: vec![false; world],
            cands: Vec::new(),
            proven: vec![None; world],
            refused: Vec::new(),
        }
    }

    /// Drops a candidate with a warning naming its address.
    fn refuse(&mut self, c: Candidate, why: &str) {
        let claim = match &c.hello {
            Some((_, h, _)) => format!(" (claims rank {} for rank {})", h.from, h.to),
            None => String::new(),
        };
        tracing::warn!(from = %c.from, "dropped a data connection{claim}: {why}");
        if self.refused.len() < 16 {
            self.refused.push(format!("{}{claim}: {why}", c.from));
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
        {
            // Connections that did not say their hello, or answer the challenge, within the
            // hello wait go.
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
                    Err(nix::errno::Errno::EINTR) => return Ok(()),
                    Err(e) => {
                        return Err(ctx.io(None, "polling the data listener", io::Error::from(e)))
                    }
                }
                fds.iter()
                    .map(|f| f.revents().is_some_and(|e| !e.is_empty()))
                    .collect()
            };
            // The ready candidates, in the order they were accepted.
            let mut turn = Vec::new();
            for i in (0..self.cands.len()).rev() {
                if ready[1 + i] {
                    turn.push(self.cands.remove(i));
                }
            }
            turn.reverse();
            for c in turn {
                if let Some(c) = self.step(ctx, mesh, c)? {
                    self.cands.push(c);
                }
            }
            if ready[0] {
                self.accept(ctx, me, world)?;
            }
        }
        Ok(())
    }

    /// Takes every connection waiting on the listener.
    fn accept(&mut self, ctx: &Ctx<'_>, me: usize, world: usize) -> Result<()> {
        loop {
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
                Err(e) => return Err(ctx.io(None, "accepting a data connection", e)),
            };
            let _ = s.set_nonblocking(false);
            let _ = s.set_nodelay(true);
            if self.cands.len() >= world - me - 1 + MAX_STRANGERS {
                // Full: the oldest connection that no rank needs goes (one still silent, or
                // one whose claim does not fit or is claimed by another too), else this one.
                let needed = |c: &Candidate, all: &[Candidate]| {
                    c.claims(me, world, self.lazy).is_some_and(|r| {
                        all.iter()
                            .filter(|o| o.claims(me, world, self.lazy) == Some(r))
                            .count()
                            == 1
                    })
                };
                let victim = (0..self.cands.len()).find(|&i| !needed(&self.cands[i], &self.cands));
                let Some(i) = victim else {
                    self.refuse(Candidate::new(s, from), "too many unproven connections");
                    continue;
                };
                let old = self.cands.remove(i);
                self.refuse(old, "too many unproven connections");
            }
            self.cands.push(Candidate::new(s, from));
        }
    }

    /// Reads what candidate `c` sent: its hello (answered with the challenge) or its proof.
    /// Gives it back while it is still a candidate.
    fn step(
        &mut self,
        ctx: &Ctx<'_>,
        mesh: &mut [Option<TcpStream>],
        mut c: Candidate,
    ) -> Result<Option<Candidate>> {
        let sec = ctx.sec();
        let me = ctx.rank();
        let world = mesh.len();
        let Some((hello, h, nonce)) = c.hello.take() else {
            let m = match c.pull(MAX_HELLO) {
                Ok(Some(m)) => m,
                Ok(None) => return Ok(Some(c)),
                Err(e) => {
                    self.refuse(c, &format!("reading a peer hello: {e}"));
                    return Ok(None);
                }
            };
            let h = match PeerHello::decode(&m) {
                Ok(h) => h,
                Err(e) => {
                    self.refuse(c, &describe(&e));
                    return Ok(None);
                }
            };
            if h.job != sec.job || h.world as usize != world || h.token != sec.token {
                self.refuse(c, "a data connection of another job");
                return Ok(None);
            }
            // The challenge, whatever it claims: its claims are judged once it proved the
            // token.
            let nonce = fresh_nonce(ctx)?;
            let mine = sec.peer_proof(LABEL_ACCEPTOR, &m, &nonce);
            if let Err(e) = ctx.send(&mut c.s, None, msg::encode_peer_challenge(&nonce, &mine)) {
                self.refuse(c, &e.to_string());
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
                self.refuse(c, &format!("reading the answer to the challenge: {e}"));
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
                reject(ctx, &mut c.s, &why);
                Some(why)
            }
            Ok(Err(rej)) => Some(format!("gave up: {}", rej.why)),
            Err(w) => Some(format!("bad answer to the challenge: {w}")),
        };
        if let Some(why) = verdict {
            c.hello = Some((hello, h, nonce));
            self.refuse(c, &why);
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
            reject(ctx, &mut c.s, &why);
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
        for c in std::mem::take(&mut self.cands) {
            let why = if c.hello.is_some() {
                "no proof of the job token (every rank had connected and proved itself)"
            } else {
                "no hello (every rank had connected and proved itself)"
            };
            self.refuse(c, why);
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
        let list = |v: &[usize]| {
            v.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut detail = format!(
            "waiting for rank(s) {} to connect and prove the job token",
            list(&missing)
        );
        let unproven: Vec<String> = self
            .cands
            .iter()
            .filter_map(|c| {
                c.claims(me, world, false)
                    .map(|r| format!("{} (claims rank {r})", c.from))
            })
            .collect();
        if !unproven.is_empty() {
            detail += &format!("; connected but not proved: {}", unproven.join(", "));
        }
        if !self.refused.is_empty() {
            detail += &format!("; refused: {}", self.refused.join("; "));
        }
        ctx.timeout(missing.first().copied(), detail)
    }
}

/// Tells a data connection why it is refused (best effort: it may be gone already).
fn reject(ctx: &Ctx<'_>, s: &mut TcpStream, why: &str) {
    let rej = Reject {
        class: REJECT_MISMATCH,
        var: String::new(),
        why: why.into(),
    };
    let _ = ctx.send(s, None, rej.encode());
}
