//! Going on without failed ranks: [`Communicator::shrink`], with `ncclCommShrink`'s semantics.
//!
//! A shrink has to work when the communicator cannot: after a peer was lost or after
//! [`Communicator::abort`], the communicator is poisoned and its data connections are shut
//! (an abort closes them on purpose, so that no peer waits on them), so no collective on it
//! can carry the survivors' agreement. Instead every rank reserves, at init, one more TCP
//! port on the address peers reach it at (its *shrink door*; the addresses travel in init's
//! own exchange, so a shrink needs no rendezvous port). The door is a bound socket that does
//! not listen until this rank leads a shrink: until then it refuses every connection, holds
//! nobody's connection unread and is no listening socket for a stranger to find.
//!
//! 1. Every survivor computes the same thing from its excluded set: the survivors in rank
//!    order, its new rank among them, and the *leader*, the lowest surviving rank.
//! 2. The leader opens its door (listens); the others connect to it, trying again while it
//!    refuses, until the deadline. The leader accepts (non-blocking, strangers and stale
//!    connections side by side, none able to hold it up) and greets each with a
//!    fresh nonce; each answers with its rank and excluded set under an HMAC, keyed with
//!    the communicator's secret, over the leader's nonce. The leader answers with the
//!    verdict under an HMAC over the member's own nonce, so each side knows the other holds
//!    the secret and no recorded exchange can be replayed.
//! 3. The verdict: once every survivor joined with the leader's excluded set, the address of
//!    the new communicator's rendezvous (an ephemeral listener of the leader's) and a random
//!    salt; the new communicator's secret is derived from the parent's as a split child's
//!    is (an HMAC of the excluded set and the salt). A survivor that names another set fails
//!    the shrink for everyone the leader keeps (each gets [`Error::Mismatch`] naming both
//!    sets: no split brain); a rank the leader excludes that calls it anyway gets an error
//!    saying so, and the others go on without it.
//! 4. Everyone builds the new communicator through the ordinary init
//!    ([`Communicator::init_inner`]): fresh sequence numbers, mismatch checks, transport
//!    choice and path report, and a shrink door of its own, so that it can shrink again.
//!
//! Every step has the parent's deadline ([`crate::Config::timeout`]): a survivor that never
//! calls shrink fails the others by it, each error naming the ranks that did not join.

#![forbid(unsafe_code)]

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::split::{self, RECORD};
use super::Communicator;
use crate::bootstrap::{auth, Bootstrap};
use crate::config::Config;
use crate::error::{Error, Result};

/// The operation named in errors.
const OP: &str = "shrink";
/// First bytes of the leader's greeting and of a member's hello.
const GREETING: &[u8; 8] = b"dspkSHG1";
const HELLO: &[u8; 8] = b"dspkSHH1";
/// Labels of the two proofs and of the derived secret: no proof of another kind verifies
/// with them, and the secret differs from every split child's.
const LABEL_HELLO: &[u8] = b"dspark/2 shrink member proves\0";
const LABEL_VERDICT: &[u8] = b"dspark/2 shrink leader proves\0";
const LABEL_SECRET: &[u8] = b"dspark/2 shrink child secret\0";
/// Verdicts.
const V_OK: u8 = 0;
const V_MISMATCH: u8 = 1;
const V_REFUSED: u8 = 2;
const V_FAILED: u8 = 3;
/// Connections the leader reads at once besides the survivors' (strangers, stale ones).
const EXTRA_PENDING: usize = 64;
/// Connections a leader accepts on its shrink door per round (as the bootstrap's gate).
const ACCEPT_BATCH: usize = 16;
/// Longest error text in a verdict.
const MAX_TEXT: usize = 4096;

/// This rank's shrink door, and every rank's address. Until this rank leads a shrink the
/// door is a socket bound to its port and not listening: it reserves the port, refuses every
/// connection (so nothing waits there unread, and no stranger's connection is held), and is
/// no listening socket at all to anyone looking. The first shrink this rank leads makes it
/// listen, until the communicator is dropped (for a retry).
#[derive(Debug)]
pub(crate) struct Door {
    addrs: Vec<SocketAddr>,
    /// Held by the shrink in progress (one at a time per communicator), with the hellos a
    /// leader received for its next shrink: a survivor that got its verdict (a failure) may
    /// call again before the leader finished telling the others, and its new connection
    /// belongs to the leader's next call, not to the one in progress.
    busy: Mutex<Carried>,
}

/// What a leader's call leaves to its next one (see [`Door`]): connections greeted and not yet
/// read, and hellos of survivors that called again.
/// The door's socket.
enum DoorSocket {
    /// Bound, not listening yet.
    Bound(OwnedFd),
    Listening(TcpListener),
    /// Failed to listen.
    Gone,
}

struct Carried {
    door: DoorSocket,
    pending: Vec<Conn>,
    hellos: Vec<(Conn, Vec<u8>)>,
}

impl std::fmt::Debug for Carried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Carried")
            .field("pending", &self.pending.len())
            .field("hellos", &self.hellos.len())
            .finish()
    }
}

impl Door {
    /// Opens this rank's door at init and learns everyone's, over the bootstrap's
    /// connections (`streams`, as the rendezvous returned them). A collective of the
    /// bootstrap: every rank calls it at the same point of init. `None` for a world of one.
    pub(crate) fn open(
        boot: &mut Bootstrap,
        streams: &mut [Option<TcpStream>],
        config: &Config,
    ) -> Result<Option<Door>> {
        let (me, n) = (config.rank, config.world_size);
        if n < 2 {
            return Ok(None);
        }
        let t0 = Instant::now();
        let advertised = boot.peers.get(me).map(|p| p.addr.ip());
        let (fd, addr) = reserve(config, advertised)?;
        let all = boot.all_gather(streams, &split::encode(0, 0, Some(addr)))?;
        let addrs = all
            .iter()
            .enumerate()
            .map(|(r, b)| {
                if b.len() == RECORD {
                    Ok(split::decode(b).2)
                } else {
                    Err(Error::Mismatch {
                        rank: Some(me),
                        peer: Some(r),
                        op: "init".into(),
                        what: format!(
                            "rank {r} sent {} bytes for its shrink door, expected {RECORD} \
                             (another version?)",
                            b.len()
                        ),
                    })
                }
            })
            .collect::<Result<Vec<_>>>()?;
        tracing::debug!(rank = me, took = ?t0.elapsed(), "init: shrink doors exchanged");
        Ok(Some(Door {
            addrs,
            busy: Mutex::new(Carried {
                door: DoorSocket::Bound(fd),
                pending: Vec::new(),
                hellos: Vec::new(),
            }),
        }))
    }
}

/// A TCP socket bound to an ephemeral port of the address peers reach this rank at (as
/// [`split::ephemeral_listener`] chooses it), not listening; with that address.
fn reserve(config: &Config, advertised: Option<IpAddr>) -> Result<(OwnedFd, SocketAddr)> {
    use nix::sys::socket::{bind, getsockname, socket, AddressFamily, SockFlag, SockType};
    use nix::sys::socket::{SockaddrIn, SockaddrIn6, SockaddrStorage};
    let advertised = advertised.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let bind_ip = match advertised {
        ip if !config.listen_any => ip,
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    };
    let err = |what: &str, e: nix::Error| {
        Error::io(
            Some(config.rank),
            None,
            format!("init: shrink door: {what} {bind_ip}"),
            io::Error::from(e),
        )
    };
    let family = match bind_ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)
        .map_err(|e| err("a socket for", e))?;
    let res = match SocketAddr::new(bind_ip, 0) {
        SocketAddr::V4(a) => bind(fd.as_raw_fd(), &SockaddrIn::from(a)),
        SocketAddr::V6(a) => bind(fd.as_raw_fd(), &SockaddrIn6::from(a)),
    };
    res.map_err(|e| err("binding", e))?;
    let local: SockaddrStorage = getsockname(fd.as_raw_fd()).map_err(|e| err("the port on", e))?;
    let port = local
        .as_sockaddr_in()
        .map(|a| a.port())
        .or_else(|| local.as_sockaddr_in6().map(|a| a.port()))
        .unwrap_or(0);
    Ok((fd, SocketAddr::new(advertised, port)))
}

/// What one shrink call knows: who it is, who stays, and the keys.
struct Plan<'a> {
    comm: &'a Communicator,
    door: &'a Door,
    me: usize,
    world: usize,
    excluded: Vec<usize>,
    survivors: Vec<usize>,
    key: Vec<u8>,
    deadline: Instant,
}

impl Communicator {
    /// A new communicator of this one's ranks minus `exclude`, as `ncclCommShrink` makes:
    /// for going on after ranks failed. Every surviving rank calls it with the same excluded
    /// ranks (in any order); the excluded ones do not call it. The survivors keep their
    /// order: a survivor's new rank is the number of survivors below it.
    ///
    /// It works when this communicator cannot: after a peer was lost, after
    /// [`Communicator::abort`] (to drop what is in flight first, as `SHRINK_ABORT` does,
    /// use [`Communicator::shrink_aborting`]), or on a healthy communicator, which it leaves
    /// as it is.
    /// The survivors agree over this communicator's secret on a port each rank reserved at
    /// init (no rendezvous port); the new communicator is built by an ordinary init, with
    /// fresh sequence numbers, mismatch checks, transport choice and path report, and a
    /// secret derived from this one's as a [split](Communicator::split) child's is. It can
    /// shrink again.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] for a rank that is not one, or when this rank is in
    ///   `exclude` (an excluded rank takes no part), or when the survivors' first rank
    ///   excludes this one.
    /// - [`Error::Mismatch`] on every survivor when one names another excluded set (nobody
    ///   gets a new communicator).
    /// - [`Error::Timeout`] by the deadline ([`crate::Config::timeout`]) when a survivor
    ///   does not join (a dead rank that was not excluded too), naming it;
    ///   [`Error::PeerLost`] when the survivors' first rank goes away during the exchange.
    /// - Those of [`Communicator::init`] for the new communicator.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # fn main() -> dspark::Result<()> {
    /// let comm = dspark::Communicator::from_env()?;
    /// let mut grads = vec![1.0f32; 1024];
    /// if let Err(e) = comm.all_reduce(&mut grads, dspark::ReduceOp::Sum) {
    ///     // Rank 2 died: the others go on without it.
    ///     eprintln!("{e}");
    ///     let comm = comm.shrink(&[2])?;
    ///     comm.all_reduce(&mut grads, dspark::ReduceOp::Sum)?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn shrink(&self, exclude: &[usize]) -> Result<Communicator> {
        self.shrink_as(exclude, false)
    }

    /// [`Communicator::shrink`] after aborting this communicator, as `ncclCommShrink` with
    /// `NCCL_SHRINK_ABORT`: what is in flight on it (a collective waiting for the dead rank)
    /// fails at once, and every later call on it fails. The abort comes after the arguments
    /// are checked: an `InvalidArgument` for a rank that is not one, or this rank among the
    /// excluded, leaves this communicator as it was.
    ///
    /// # Errors
    /// As [`Communicator::shrink`].
    pub fn shrink_aborting(&self, exclude: &[usize]) -> Result<Communicator> {
        self.shrink_as(exclude, true)
    }

    fn shrink_as(&self, exclude: &[usize], abort_first: bool) -> Result<Communicator> {
        let (me, n) = (self.rank(), self.world_size());
        let invalid = |what: String| Error::invalid(Some(me), OP, what);
        let mut excluded = exclude.to_vec();
        excluded.sort_unstable();
        excluded.dedup();
        if let Some(&r) = excluded.iter().find(|&&r| r >= n) {
            return Err(invalid(format!(
                "excluded rank {r} is not a rank (world size {n})"
            )));
        }
        if excluded.binary_search(&me).is_ok() {
            return Err(invalid(format!(
                "this rank is excluded ({}): an excluded rank takes no part in a shrink; the \
                 survivors go on without it",
                ranks(&excluded)
            )));
        }
        let survivors: Vec<usize> = (0..n)
            .filter(|r| excluded.binary_search(r).is_err())
            .collect();
        let new_rank = survivors.iter().position(|&r| r == me).unwrap_or(0);
        let without = ranks(&excluded);
        let how = |leader: usize| {
            format!(
                "the shrink of rank {me}'s communicator without {without} (rank {leader} leads)"
            )
        };
        if survivors.len() == 1 {
            if abort_first {
                self.abort();
            }
            let token = split::derived_secret(&self.config, &[LABEL_SECRET, b"alone"]);
            let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
            let cfg = split::child_config(&self.config, 0, 1, loopback, token, how(me));
            return Communicator::init_inner(cfg, None).map_err(|e| in_new_numbering(e, 0, &[me]));
        }
        let door = self.shrink_door.as_ref().ok_or_else(|| {
            Error::unavailable(
                "shrink",
                "this communicator was built over a given transport (a test hook): it has no \
                 shrink door",
            )
        })?;
        let mut carried = door.busy.try_lock().map_err(|_| {
            invalid("another shrink of this communicator is in progress on this rank".into())
        })?;
        if abort_first {
            self.abort();
        }
        let plan = Plan {
            comm: self,
            door,
            me,
            world: n,
            key: auth::job_key(
                self.config.job_token.as_deref(),
                self.config.job_id.as_deref(),
            ),
            deadline: crate::time::deadline(Instant::now(), self.config.timeout),
            excluded,
            survivors,
        };
        let leader = plan.survivors[0];
        let (root, listener, salt) = if new_rank == 0 {
            let (listener, addr) = split::ephemeral_listener(&self.config, self.data_ip, OP)?;
            let salt = auth::nonce().map_err(|e| {
                Error::io(
                    Some(me),
                    None,
                    "shrink: reading a salt from /dev/urandom",
                    e,
                )
            })?;
            plan.lead(addr, &salt, &mut carried)?;
            (addr, Some(listener), salt)
        } else {
            let (addr, salt) = plan.follow(leader)?;
            (addr, None, salt)
        };
        let token = split::derived_secret(
            &self.config,
            &[LABEL_SECRET, &encode_ranks(&plan.excluded), &salt],
        );
        let cfg = split::child_config(
            &self.config,
            new_rank,
            plan.survivors.len(),
            root,
            token,
            how(leader),
        );
        let new = Communicator::init_inner(cfg, listener)
            .map_err(|e| in_new_numbering(e, new_rank, &plan.survivors))?;
        tracing::info!(
            rank = me,
            new_rank,
            world = plan.survivors.len(),
            "shrunk without {}",
            ranks(&plan.excluded)
        );
        Ok(new)
    }
}

/// An error of the new communicator's init on its rank `new_rank`: its ranks are the
/// survivors renumbered (`survivors[k]` is new rank k), and it says so, with the map, so that
/// a reader who knows the job by its old numbers can tell which process it names.
fn in_new_numbering(e: Error, new_rank: usize, survivors: &[usize]) -> Error {
    let mut map: Vec<String> = survivors
        .iter()
        .enumerate()
        .take(16)
        .map(|(new, old)| format!("{new}←{old}"))
        .collect();
    if survivors.len() > 16 {
        map.push(format!("… and {} more", survivors.len() - 16));
    }
    let what = format!(
        "shrink: the new communicator's init (its ranks, new←old: {})",
        map.join(", ")
    );
    match e.at_rank(new_rank) {
        // Errors that `in_op` leaves as they are carry the map in their own words.
        Error::InvalidArgument { rank, op, what: w } => Error::InvalidArgument {
            rank,
            op: format!("{what} ({op})"),
            what: w,
        },
        Error::Unavailable {
            rank,
            what: w,
            reason,
        } => Error::Unavailable {
            rank,
            what: format!("{what}: {w}"),
            reason,
        },
        Error::Config { var, what: w } => Error::Config {
            var,
            what: format!("{w} [{what}]"),
        },
        e => e.in_op(&what),
    }
}

/// `[2, 5, 7]`, at most 16 named.
fn ranks(r: &[usize]) -> String {
    if r.is_empty() {
        return "no rank".into();
    }
    let shown: Vec<String> = r.iter().take(16).map(usize::to_string).collect();
    let more = r.len().saturating_sub(16);
    let what = if r.len() == 1 { "rank" } else { "ranks" };
    if more > 0 {
        format!("{what} {} … and {more} more", shown.join(", "))
    } else {
        format!("{what} {}", shown.join(", "))
    }
}

fn encode_ranks(r: &[usize]) -> Vec<u8> {
    let mut b = (r.len() as u64).to_le_bytes().to_vec();
    for &x in r {
        b.extend_from_slice(&(x as u64).to_le_bytes());
    }
    b
}

/// Little-endian u64 at `i` of `b` (the caller checked the length).
fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(w)
}

/// A member's hello, parsed.
struct Hello {
    rank: usize,
    world: usize,
    excluded: Vec<usize>,
    nonce: auth::Nonce,
}

/// `body` of a hello: magic, rank, world, excluded ranks, nonce.
fn hello_body(rank: usize, world: usize, excluded: &[usize], nonce: &auth::Nonce) -> Vec<u8> {
    let mut b = HELLO.to_vec();
    b.extend_from_slice(&(rank as u64).to_le_bytes());
    b.extend_from_slice(&(world as u64).to_le_bytes());
    b.extend_from_slice(&encode_ranks(excluded));
    b.extend_from_slice(nonce);
    b
}

fn parse_hello(body: &[u8]) -> Option<Hello> {
    if body.len() < 32 + auth::TAG_LEN || &body[..8] != HELLO {
        return None;
    }
    let (rank, world, k) = (u64_at(body, 8), u64_at(body, 16), u64_at(body, 24));
    let k = usize::try_from(k).ok()?;
    let end = 32usize.checked_add(k.checked_mul(8)?)?;
    if body.len() != end + auth::TAG_LEN {
        return None;
    }
    let excluded = (0..k)
        .map(|i| usize::try_from(u64_at(body, 32 + 8 * i)).ok())
        .collect::<Option<Vec<_>>>()?;
    let mut nonce = [0u8; auth::TAG_LEN];
    nonce.copy_from_slice(&body[end..]);
    Some(Hello {
        rank: usize::try_from(rank).ok()?,
        world: usize::try_from(world).ok()?,
        excluded,
        nonce,
    })
}

/// One length-prefixed message.
fn frame(payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(payload);
    f
}

/// The longest message of a shrink of a world of `n`.
fn max_message(n: usize) -> usize {
    64 + 8 * n + MAX_TEXT + 2 * auth::TAG_LEN + RECORD
}

/// A connection the leader reads, before and after it proved itself.
struct Conn {
    s: TcpStream,
    from: SocketAddr,
    /// The nonce the leader greeted it with.
    nonce: auth::Nonce,
    buf: Vec<u8>,
}

impl Conn {
    /// Reads what has arrived; `Ok(Some(payload))` once a whole message is there.
    fn read(&mut self, max: usize) -> io::Result<Option<Vec<u8>>> {
        let mut chunk = [0u8; 4096];
        loop {
            if self.buf.len() >= 4 {
                let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]])
                    as usize;
                if len > max {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("a message of {len} bytes (at most {max} expected)"),
                    ));
                }
                if self.buf.len() >= 4 + len {
                    let m = self.buf[4..4 + len].to_vec();
                    self.buf.drain(..4 + len);
                    return Ok(Some(m));
                }
            }
            match self.s.read(&mut chunk) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(k) => self.buf.extend_from_slice(&chunk[..k]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

impl Plan<'_> {
    fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    fn mine(&self) -> String {
        ranks(&self.excluded)
    }

    /// Sends a verdict to a member that greeted with `nonce` (best effort: a member that is
    /// gone learns nothing, and its absence is its own error).
    fn send_verdict(&self, s: &mut TcpStream, nonce: &auth::Nonce, body: &[u8]) {
        let mac = auth::hmac_sha256(&self.key, &[LABEL_VERDICT, nonce, body]);
        let mut m = body.to_vec();
        m.extend_from_slice(&mac);
        let _ = s.set_nonblocking(false);
        let _ = s.set_write_timeout(Some(
            self.remaining()
                .clamp(Duration::from_millis(100), Duration::from_secs(5)),
        ));
        let _ = s.write_all(&frame(&m));
    }

    fn refusal(code: u8, text: &str) -> Vec<u8> {
        let mut b = vec![code];
        let t = text.as_bytes();
        b.extend_from_slice(&t[..t.len().min(MAX_TEXT)]);
        b
    }

    /// The leader's side: accepts the other survivors until every one joined, checks their
    /// excluded sets, and hands each the new rendezvous address `root` and the `salt`.
    fn lead(&self, root: SocketAddr, salt: &auth::Nonce, carried: &mut Carried) -> Result<()> {
        let me = self.me;
        let io_err = |e: io::Error| Error::io(Some(me), None, "shrink: opening the shrink door", e);
        carried.door = match std::mem::replace(&mut carried.door, DoorSocket::Gone) {
            DoorSocket::Bound(fd) => {
                nix::sys::socket::listen(&fd, nix::sys::socket::Backlog::MAXCONN)
                    .map_err(|e| io_err(e.into()))?;
                DoorSocket::Listening(TcpListener::from(fd))
            }
            other => other,
        };
        let DoorSocket::Listening(l) = &carried.door else {
            return Err(io_err(io::Error::other(
                "an earlier shrink failed to open it",
            )));
        };
        l.set_nonblocking(true).map_err(io_err)?;
        let l = l.try_clone().map_err(io_err)?;
        let members: Vec<usize> = self.survivors[1..].to_vec();
        let mut pending: Vec<Conn> = std::mem::take(&mut carried.pending);
        let mut joined: Vec<Option<(TcpStream, auth::Nonce)>> =
            (0..self.world).map(|_| None).collect();
        // The first disagreement: (the rank, its text); then everyone gets it.
        let mut failed: Option<(usize, String)> = None;
        // Hellos of survivors that called again: for the next call (see `Door::busy`).
        let mut next: Vec<(Conn, Vec<u8>)> = Vec::new();
        for (c, m) in std::mem::take(&mut carried.hellos) {
            self.admit(c, m, &mut joined, &mut failed, &mut next);
        }
        let res = self.lead_loop(
            &l,
            &members,
            &mut pending,
            &mut joined,
            &mut failed,
            &mut next,
        );
        // Whatever arrived for the next call waits for it.
        carried.pending = pending;
        carried.hellos = next;
        res?;
        if let Some((r, what)) = failed {
            return Err(self.mismatch(r, what));
        }
        let mut body = vec![V_OK];
        body.extend_from_slice(&split::encode(0, 0, Some(root)));
        body.extend_from_slice(salt);
        for (s, nonce) in joined.iter_mut().flatten() {
            self.send_verdict(s, nonce, &body);
        }
        Ok(())
    }

    /// The leader's wait: until every member joined (`Ok`), or the deadline (`Err`, every
    /// member that joined told).
    fn lead_loop(
        &self,
        l: &TcpListener,
        members: &[usize],
        pending: &mut Vec<Conn>,
        joined: &mut [Option<(TcpStream, auth::Nonce)>],
        failed: &mut Option<(usize, String)>,
        next: &mut Vec<(Conn, Vec<u8>)>,
    ) -> Result<()> {
        let me = self.me;
        let max = max_message(self.world);
        loop {
            let missing: Vec<usize> = members
                .iter()
                .copied()
                .filter(|&r| joined[r].is_none())
                .collect();
            if missing.is_empty() {
                break;
            }
            if Instant::now() >= self.deadline {
                let text = format!(
                    "{} of the survivors did not join rank {me}'s shrink within {:.1?} (each \
                     survivor calls shrink with the same excluded ranks; name a dead rank \
                     there)",
                    ranks(&missing),
                    self.comm.config.timeout
                );
                let body = Self::refusal(V_FAILED, &text);
                for (s, nonce) in joined.iter_mut().flatten() {
                    self.send_verdict(s, nonce, &body);
                }
                if let Some((r, what)) = failed.take() {
                    return Err(self.mismatch(r, what));
                }
                return Err(Error::Timeout {
                    rank: me,
                    peer: missing.first().copied(),
                    op: OP.into(),
                    waited: self.comm.config.timeout,
                    detail: text,
                });
            }
            // Hellos first: a survivor whose hello is here joins before any new connection
            // can take its place.
            let mut i = 0;
            while i < pending.len() {
                match pending[i].read(max) {
                    Ok(None) => i += 1,
                    Err(e) => {
                        tracing::debug!(rank = me, from = %pending[i].from, error = %e,
                            "shrink: dropped a connection on the shrink door");
                        pending.swap_remove(i);
                    }
                    Ok(Some(m)) => {
                        let c = pending.swap_remove(i);
                        self.admit(c, m, joined, failed, next);
                    }
                }
            }
            // New connections, at most ACCEPT_BATCH a round: greet each with a fresh nonce.
            // One from an address that is no rank's door is closed unread (unless
            // DSPARK_ACCEPT_ANY_SOURCE), and a full queue makes room by dropping the oldest
            // connection that has sent nothing, never one whose hello has begun: a stranger
            // dialling fast pushed out survivors whose hellos were on their way, and the
            // shrink failed at its deadline.
            for _ in 0..ACCEPT_BATCH {
                match l.accept() {
                    Ok((mut s, from)) => {
                        let ip = from.ip().to_canonical();
                        if !self.comm.config.accept_any_source
                            && !self.door.addrs.iter().any(|a| a.ip().to_canonical() == ip)
                        {
                            continue;
                        }
                        if pending.len() >= members.len() + EXTRA_PENDING {
                            match pending.iter().position(|c| c.buf.is_empty()) {
                                Some(k) => {
                                    pending.remove(k);
                                }
                                None => continue,
                            }
                        }
                        let nonce = auth::nonce()
                            .map_err(|e| Error::io(Some(me), None, "shrink: reading a nonce", e))?;
                        let mut g = GREETING.to_vec();
                        g.extend_from_slice(&nonce);
                        let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
                        if s.write_all(&frame(&g)).is_ok() && s.set_nonblocking(true).is_ok() {
                            pending.push(Conn {
                                s,
                                from,
                                nonce,
                                buf: Vec::new(),
                            });
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => {}
                    Err(e) => return Err(Error::io(Some(me), None, "shrink: accepting", e)),
                }
            }
            let mut fds = vec![PollFd::new(l.as_fd(), PollFlags::POLLIN)];
            fds.extend(
                pending
                    .iter()
                    .map(|c| PollFd::new(c.s.as_fd(), PollFlags::POLLIN)),
            );
            let ms = self.remaining().as_millis().clamp(1, 100) as u16;
            let _ = nix::poll::poll(&mut fds, PollTimeout::from(ms));
        }
        Ok(())
    }

    fn mismatch(&self, peer: usize, what: String) -> Error {
        Error::Mismatch {
            rank: Some(self.me),
            peer: Some(peer),
            op: OP.into(),
            what,
        }
    }

    /// Checks one hello: a stranger's is dropped, an excluded rank's refused, a survivor
    /// with another excluded set fails the shrink; a good one joins.
    fn admit(
        &self,
        mut c: Conn,
        m: Vec<u8>,
        joined: &mut [Option<(TcpStream, auth::Nonce)>],
        failed: &mut Option<(usize, String)>,
        next: &mut Vec<(Conn, Vec<u8>)>,
    ) {
        let me = self.me;
        if m.len() < auth::TAG_LEN {
            return;
        }
        let (body, mac) = m.split_at(m.len() - auth::TAG_LEN);
        let want = auth::hmac_sha256(&self.key, &[LABEL_HELLO, &c.nonce, body]);
        let hello = match parse_hello(body) {
            Some(h) if auth::ct_eq(mac, &want) => h,
            _ => {
                tracing::warn!(
                    rank = me,
                    from = %c.from,
                    "shrink: a connection to the shrink door could not prove this \
                     communicator's secret; dropped"
                );
                return;
            }
        };
        let r = hello.rank;
        if hello.world != self.world || r >= self.world || r == me {
            let text = format!(
                "rank {me} leads a shrink of a communicator of {} ranks; this connection says \
                 it is rank {r} of {}",
                self.world, hello.world
            );
            self.send_verdict(&mut c.s, &hello.nonce, &Self::refusal(V_REFUSED, &text));
            return;
        }
        if joined[r].is_some() {
            // Its call in progress here got its verdict: this is its next call.
            next.push((c, m));
            return;
        }
        if self.survivors.binary_search(&r).is_err() {
            let text = format!(
                "rank {r} is excluded by the shrink rank {me} leads (which excludes {}; rank \
                 {r} named {}): the survivors go on without it",
                self.mine(),
                ranks(&hello.excluded)
            );
            self.send_verdict(&mut c.s, &hello.nonce, &Self::refusal(V_REFUSED, &text));
            return;
        }
        if failed.is_none() && hello.excluded != self.excluded {
            let text = format!(
                "the survivors disagree about whom to exclude: rank {r} names {}, rank {me} \
                 names {}; no rank gets a new communicator (call shrink again with one set)",
                ranks(&hello.excluded),
                self.mine()
            );
            let body = Self::refusal(V_MISMATCH, &text);
            for (s, nonce) in joined.iter_mut().flatten() {
                self.send_verdict(s, nonce, &body);
            }
            *failed = Some((r, text));
        }
        if let Some((_, text)) = failed {
            let body = Self::refusal(V_MISMATCH, text);
            self.send_verdict(&mut c.s, &hello.nonce, &body);
        }
        let _ = c.s.set_nonblocking(false);
        joined[r] = Some((c.s, hello.nonce));
    }

    /// A member's side: joins the leader's shrink; returns the new rendezvous address and
    /// the salt of the new secret.
    fn follow(&self, leader: usize) -> Result<(SocketAddr, auth::Nonce)> {
        let me = self.me;
        let addr = self.door.addrs[leader];
        let lost = |detail: String| Error::PeerLost {
            rank: me,
            peer: leader,
            op: OP.into(),
            detail,
        };
        let timeout = |detail: String| Error::Timeout {
            rank: me,
            peer: Some(leader),
            op: OP.into(),
            waited: self.comm.config.timeout,
            detail,
        };
        let role = format!("rank {leader}, the first survivor, which leads the shrink");
        // The leader's door refuses connections until it leads: try again until the deadline.
        let mut pause = Duration::from_millis(5);
        let mut s = loop {
            let left = self.remaining();
            if left.is_zero() {
                return Err(timeout(format!(
                    "{role} never opened its shrink door at {addr}: is it alive, and calling                      shrink with the same excluded ranks ({})? A dead rank must be excluded too",
                    self.mine()
                )));
            }
            match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
                Ok(s) => break s,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionRefused | io::ErrorKind::TimedOut
                    ) =>
                {
                    std::thread::sleep(pause.min(self.remaining()));
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                Err(e) => {
                    return Err(lost(format!("{role} cannot be reached at {addr}: {e}")));
                }
            }
        };
        let _ = s.set_nodelay(true);
        let recv = |s: &mut TcpStream, waiting: &str| -> Result<Vec<u8>> {
            let mut c = Conn {
                s: s.try_clone()
                    .map_err(|e| Error::io(Some(me), Some(leader), OP, e))?,
                from: addr,
                nonce: [0; auth::TAG_LEN],
                buf: Vec::new(),
            };
            loop {
                let left = self.remaining();
                if left.is_zero() {
                    return Err(timeout(waiting.to_string()));
                }
                let _ = c.s.set_read_timeout(Some(left));
                match c.read(max_message(self.world)) {
                    Ok(Some(m)) => return Ok(m),
                    Ok(None) => {}
                    Err(e) if e.kind() == io::ErrorKind::TimedOut => {}
                    Err(e) => return Err(lost(format!("{waiting}: {e}"))),
                }
            }
        };
        let greeting = recv(
            &mut s,
            &format!(
                "waiting for {role} to take part (is it calling shrink with the same \
                 excluded ranks, {}?)",
                self.mine()
            ),
        )?;
        if greeting.len() != 8 + auth::TAG_LEN || &greeting[..8] != GREETING {
            return Err(self.mismatch(
                leader,
                format!(
                    "{role} greeted with {} bytes that are no shrink greeting",
                    greeting.len()
                ),
            ));
        }
        let nonce =
            auth::nonce().map_err(|e| Error::io(Some(me), None, "shrink: reading a nonce", e))?;
        let body = hello_body(me, self.world, &self.excluded, &nonce);
        let mac = auth::hmac_sha256(&self.key, &[LABEL_HELLO, &greeting[8..], &body]);
        let mut m = body;
        m.extend_from_slice(&mac);
        let _ = s.set_write_timeout(Some(self.remaining().max(Duration::from_millis(1))));
        s.write_all(&frame(&m))
            .map_err(|e| lost(format!("sending this rank's hello to {role}: {e}")))?;
        let v = recv(
            &mut s,
            &format!("waiting for the verdict of {role} (it waits for every survivor)"),
        )?;
        if v.len() < 1 + auth::TAG_LEN {
            return Err(self.mismatch(leader, format!("{role} sent a short verdict")));
        }
        let (body, mac) = v.split_at(v.len() - auth::TAG_LEN);
        let want = auth::hmac_sha256(&self.key, &[LABEL_VERDICT, &nonce, body]);
        if !auth::ct_eq(mac, &want) {
            return Err(self.mismatch(
                leader,
                format!("{role}'s verdict does not prove this communicator's secret"),
            ));
        }
        let text = || String::from_utf8_lossy(&body[1..]).into_owned();
        match body[0] {
            V_OK if body.len() == 1 + RECORD + auth::TAG_LEN => {
                let root = split::decode(&body[1..1 + RECORD]).2;
                let mut salt = [0u8; auth::TAG_LEN];
                salt.copy_from_slice(&body[1 + RECORD..]);
                Ok((root, salt))
            }
            V_MISMATCH => Err(self.mismatch(leader, text())),
            V_REFUSED => Err(Error::invalid(Some(me), OP, text())),
            V_FAILED => Err(Error::Aborted {
                rank: me,
                by: leader,
                op: OP.into(),
                reason: text(),
            }),
            _ => Err(self.mismatch(leader, format!("{role} sent an unknown verdict"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hello_round_trips_and_a_truncated_one_is_refused() {
        let n = [7u8; auth::TAG_LEN];
        let b = hello_body(3, 5, &[1, 4], &n);
        let h = parse_hello(&b).unwrap();
        assert_eq!(
            (h.rank, h.world, h.excluded, h.nonce),
            (3, 5, vec![1, 4], n)
        );
        assert!(parse_hello(&b[..b.len() - 1]).is_none());
        let mut huge = b.clone();
        huge[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(parse_hello(&huge).is_none());
    }

    #[test]
    fn ranks_are_named_and_capped() {
        assert_eq!(ranks(&[2]), "rank 2");
        assert_eq!(ranks(&[1, 3]), "ranks 1, 3");
        let many: Vec<usize> = (0..20).collect();
        assert!(ranks(&many).ends_with("… and 4 more"));
    }

    #[test]
    fn an_error_of_the_new_communicators_init_says_its_ranks_are_renumbered() {
        // Survivors 0, 2, 3 of 4: old rank 3 is new rank 2, and the bootstrap's timeout
        // names new rank 1 (old rank 2).
        let e = Error::Timeout {
            rank: 0,
            peer: Some(1),
            op: "bootstrap".into(),
            waited: Duration::from_secs(1),
            detail: String::new(),
        };
        let e = in_new_numbering(e, 2, &[0, 2, 3]);
        let text = e.to_string();
        assert!(
            text.starts_with(
                "rank 2: shrink: the new communicator's init (its ranks, new←old: \
                              0←0, 1←2, 2←3) (bootstrap) timed out"
            ) && text.contains("waiting for rank 1"),
            "{text}"
        );
        let many: Vec<usize> = (0..40).collect();
        let text = in_new_numbering(Error::invalid(None, "init", "x"), 0, &many).to_string();
        assert!(
            text.starts_with(
                "rank 0: invalid argument to shrink: the new communicator's init \
                              (its ranks, new←old: 0←0, 1←1,"
            ) && text.ends_with("(init): x"),
            "{text}"
        );
        let text = in_new_numbering(Error::config("DSPARK_X", "bad"), 0, &[3]).to_string();
        assert!(
            text.ends_with("bad [shrink: the new communicator's init (its ranks, new←old: 0←3)]"),
            "{text}"
        );
        let e = in_new_numbering(
            Error::io(None, None, "listening", io::Error::other("x")),
            5,
            &many,
        );
        assert!(e.to_string().contains("15←15, … and 24 more)"), "{e}");
    }
}
