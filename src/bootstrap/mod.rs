//! TCP rendezvous: how ranks find each other.
//!
//! 1. Rank 0 listens on the root address; every other rank connects to it, retrying until the
//!    deadline, and sends a hello: magic number, protocol version, world size, rank, a hash
//!    of the launcher's job id, whether it has a job token, the address of its own data
//!    listener, its host name, a fresh random nonce and its process id (which the rank
//!    table carries, for the flight record).
//! 2. Rank 0 checks every hello. A connection that is not a dspark rank of this protocol, or
//!    of another job, is refused with a reason (the refused side fails with that reason; rank
//!    0 logs it and keeps waiting for the right rank). Otherwise rank 0 answers with a nonce
//!    of its own, and the rank proves that it knows the job token: an HMAC-SHA256, keyed with
//!    `DSPARK_JOB_TOKEN` and the job id, over rank 0's nonce and its whole hello. A wrong
//!    proof is refused like a rank of another job. Only then are the rank's claims acted on:
//!    disagreement inside the job — another world size, the same rank twice — fails the whole
//!    rendezvous with an error naming both.
//! 3. Rank 0 sends everybody the table of data addresses, with its own proof (over that
//!    rank's hello, rank 0's nonce and the table): a rank accepts a table only from a rank 0
//!    that knows the token. Every rank then connects to the ranks below it and accepts the
//!    ranks above it, giving one TCP connection per pair of ranks. Each connection opens with
//!    its own hello and proves the token both ways, in the same way (see `connect_mesh`).
//!    Here too nothing a connection claims is acted on before its proof: several connections
//!    may claim a rank, the first that proves the token is that rank, and the others (a
//!    stranger's) are dropped with a warning naming their address. Only a connection that
//!    proved the token and does not fit (a rank twice, or for another rank) fails the init.
//!
//! The nonces are fresh for every connection (from `/dev/urandom`), so a recorded handshake
//! proves nothing when it is replayed; the token itself never travels, not even hashed.
//! The token is `DSPARK_JOB_TOKEN` (or its file), else a random per-job secret where a
//! private channel exists (a dspark spawner, the store rendezvous, a parent communicator:
//! `crate::config::trust`). Without any, the key is the launcher's job id alone, which is no
//! secret: the handshake then only keeps ranks of different jobs (or different protocol
//! versions) from joining each other by accident. Nothing is encrypted; set a token wherever
//! a stranger can reach the rendezvous port.
//!
//! A rank of another protocol version is refused with both versions named, in either
//! direction: every later version's hello starts with version 1's fields.
//!
//! Strangers cannot stall it: rank 0 and every data listener read all their pending
//! connections side by side without waiting on any ([`door`]'s `Gate`), each with its own
//! hello wait, at most a bounded number at once, and list what they refused in capped error
//! text. Listeners bind the address the rank advertises (rank 0's rendezvous listener the
//! root address's IP, a data listener `DSPARK_SOCKET_IFNAME`'s address or the one the rank
//! reaches rank 0 from), never a wildcard unless `DSPARK_LISTEN_ANY=1`; once the rank table is
//! known, a data listener closes a connection from an address that is no rank's before
//! reading anything (`DSPARK_ACCEPT_ANY_SOURCE=1` turns that off for multi-homed hosts).
//!
//! The connections to rank 0 stay open until init is over for small exchanges
//! ([`Bootstrap::all_gather`]), e.g. the verbs connection information.
//!
//! Where things live: `options` (what the bootstrap reads of the configuration,
//! [`BootstrapOptions`]), `root` and `leaf` (the two sides of the rendezvous), `mesh` (the
//! data connections made at init), `door` (this rank's data listener, where connections prove
//! themselves), `links` (the data connections made on first use, [`LazyLinks`]), `collective`
//! (the broadcast and all-gather of init), `auth` (the proofs), `msg` (the messages), `net`
//! (interface and address helpers) and [`store`] (key-value stores).

#![forbid(unsafe_code)]

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

pub(crate) mod auth;
mod collective;
pub(crate) mod door;
mod leaf;
mod links;
mod mesh;
pub(crate) mod msg;
pub(crate) mod net;
mod options;
mod root;
pub mod store;
#[doc(hidden)]
pub mod stranger;

use auth::Secret;
use door::Door;
pub use links::LazyLinks;
use msg::{HelloError, Msg};
pub use msg::{MAGIC, VERSION};
pub(crate) use net::{interface_ip, is_local_ip, resolve};
pub use options::BootstrapOptions;

const MAX_MSG: usize = 64 << 20;

/// The largest hello (a few numbers and a host name): what an unvalidated connection may
/// make this rank allocate, so a port scanner or a stray client costs no memory.
const MAX_HELLO: usize = 64 << 10;

/// How long an accepted connection may take to say hello (and to answer the challenge): a
/// stray client that connects and stays silent (a port scanner, a health check, a wedged
/// leftover) must not hold the rendezvous for the whole deadline.
const HELLO_WAIT: Duration = Duration::from_secs(5);

/// What every rank knows about every other after the rendezvous.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The rank.
    pub rank: usize,
    /// Its host name.
    pub host: String,
    /// Its data listener.
    pub addr: SocketAddr,
    /// Its process id on its host (what `py-spy dump --pid` and `gdb -p` take; 0 where
    /// unknown).
    pub pid: u32,
}

/// The rendezvous state kept during init.
#[derive(Debug)]
pub struct Bootstrap {
    /// The settings of the rendezvous, for the collectives and the connections made after it.
    opts: BootstrapOptions,
    /// Rank 0: connections to every rank; others: `star[0]` is the connection to rank 0.
    star: Vec<Option<TcpStream>>,
    /// Everybody's host and data address, by rank.
    pub peers: Vec<PeerInfo>,
    /// This rank's data listener, with the connections on it still proving themselves:
    /// kept for [`Bootstrap::complete_mesh`] and [`Bootstrap::links`].
    door: Option<Door>,
}

/// One blocking step of the bootstrap (the rendezvous, a collective, a handshake on first
/// use): its settings, and its deadline, by which every send and receive is bounded.
struct Ctx<'a> {
    opts: &'a BootstrapOptions,
    deadline: Instant,
    start: Instant,
}

impl<'a> Ctx<'a> {
    /// A step that starts now, with the configured deadline.
    fn new(opts: &'a BootstrapOptions) -> Ctx<'a> {
        let start = Instant::now();
        Ctx {
            opts,
            deadline: opts.deadline(start),
            start,
        }
    }

    fn rank(&self) -> usize {
        self.opts.rank
    }

    /// The job's secret.
    fn sec(&self) -> &'a Secret {
        &self.opts.secret
    }

    fn timeout(&self, peer: Option<usize>, detail: impl Into<String>) -> Error {
        Error::Timeout {
            rank: self.rank(),
            peer,
            op: "bootstrap".into(),
            waited: self.start.elapsed(),
            detail: detail.into(),
        }
    }

    fn io(&self, peer: Option<usize>, what: &str, e: io::Error) -> Error {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            return self.timeout(peer, what.to_string());
        }
        if matches!(
            e.kind(),
            io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::ConnectionAborted
        ) {
            if let Some(p) = peer {
                return Error::PeerLost {
                    rank: self.rank(),
                    peer: p,
                    op: "bootstrap".into(),
                    detail: format!("{what}: {e}"),
                };
            }
        }
        Error::io(Some(self.rank()), peer, format!("bootstrap: {what}"), e)
    }

    fn remaining(&self) -> Option<Duration> {
        let now = Instant::now();
        (now < self.deadline).then(|| self.deadline - now)
    }

    fn send(&self, s: &mut TcpStream, peer: Option<usize>, m: Msg) -> Result<()> {
        if self.remaining().is_none() {
            return Err(self.timeout(peer, "sending a bootstrap message"));
        }
        // The length travels as a u32: a longer message is an error, never a wrapped length.
        let len = u32::try_from(m.0.len()).map_err(|_| Error::Transport {
            rank: Some(self.rank()),
            peer,
            op: "bootstrap".into(),
            what: format!(
                "a bootstrap message of {} bytes does not fit its 32-bit length",
                m.0.len()
            ),
        })?;
        let mut buf = Vec::with_capacity(4 + m.0.len());
        buf.extend_from_slice(&len.to_le_bytes());
        buf.extend_from_slice(&m.0);
        net::write_by(s, &buf, self.deadline)
            .map_err(|e| self.io(peer, "sending a bootstrap message", e))
    }

    fn recv(&self, s: &mut TcpStream, peer: Option<usize>, what: &str) -> Result<Vec<u8>> {
        self.recv_within(s, peer, what, Duration::MAX, MAX_MSG)
    }

    /// [`Ctx::recv`] waiting at most `limit` (and never past the deadline).
    /// Messages longer than `max` bytes are refused before anything is allocated for them.
    fn recv_within(
        &self,
        s: &mut TcpStream,
        peer: Option<usize>,
        what: &str,
        limit: Duration,
        max: usize,
    ) -> Result<Vec<u8>> {
        let rem = self
            .remaining()
            .ok_or_else(|| self.timeout(peer, what.to_string()))?
            .min(limit);
        // The whole message by then, not each read (a peer that stopped mid-message).
        let by = Instant::now() + rem;
        let mut len = [0u8; 4];
        net::read_by(s, &mut len, by).map_err(|e| self.io(peer, what, e))?;
        let n = u32::from_le_bytes(len) as usize;
        if n == 0 || n > max {
            return Err(Error::Transport {
                rank: Some(self.rank()),
                peer,
                op: "bootstrap".into(),
                what: format!("{what}: bad message length {n} (not a dspark peer?)"),
            });
        }
        let mut buf = vec![0u8; n];
        net::read_by(s, &mut buf, by).map_err(|e| self.io(peer, what, e))?;
        Ok(buf)
    }

    fn bad(&self, peer: Option<usize>, what: String) -> Error {
        Error::Transport {
            rank: Some(self.rank()),
            peer,
            op: "bootstrap".into(),
            what,
        }
    }
}

/// Runs the rendezvous for `opts`: returns the bootstrap state and one connected stream per
/// peer (`None` at this rank's own index).
///
/// # Errors
/// [`Error::Config`] (port in use, bad interface), [`Error::Timeout`] (rank 0 unreachable or
/// ranks missing by the deadline), [`Error::Mismatch`] (another world size, job or protocol),
/// [`Error::PeerLost`], [`Error::Io`].
pub fn rendezvous(opts: &BootstrapOptions) -> Result<(Bootstrap, Vec<Option<TcpStream>>)> {
    rendezvous_with(opts, None, None)
}

/// [`rendezvous`], where rank 0 accepts the other ranks on `root` — a listener it bound
/// itself, typically on an ephemeral port whose address it published through a key-value
/// store or a parent communicator — instead of binding the configured root address. The
/// other ranks connect to the root address as usual.
///
/// `links(r)`: the ranks rank `r` connects to during the rendezvous, sorted (`None`: every
/// rank). The relation must be symmetric — rank `a` lists `b` exactly when `b` lists `a` —
/// as [`crate::plan::algo::standing_partners`] is. The other pairs connect later:
/// [`Bootstrap::complete_mesh`], or on first use through [`Bootstrap::links`]. With `links`,
/// rank 0 sends each rank only the addresses of rank 0, itself and its links (O(log n) with
/// the standing partners, instead of the whole table to every rank: n² entries out of rank
/// 0), and the ranks gather the rest of the table from each other over those connections
/// ([`Bootstrap::all_gather`]).
///
/// # Errors
/// As [`rendezvous`].
pub fn rendezvous_with(
    opts: &BootstrapOptions,
    root: Option<TcpListener>,
    links: Option<&dyn Fn(usize) -> Vec<usize>>,
) -> Result<(Bootstrap, Vec<Option<TcpStream>>)> {
    let ctx = Ctx::new(opts);
    // The host identity: equal ones share memory (DSPARK_HOST_ID stands in for separate
    // hosts in tests with network namespaces).
    let host = opts.host_id.clone().unwrap_or_else(net::hostname);
    if opts.world == 1 {
        let peers = vec![PeerInfo {
            rank: 0,
            host,
            addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            pid: std::process::id(),
        }];
        return Ok((
            Bootstrap {
                opts: opts.clone(),
                star: vec![None],
                peers,
                door: None,
            },
            vec![None],
        ));
    }
    let iface_ip = opts
        .socket_ifname
        .as_deref()
        .map(interface_ip)
        .transpose()?;
    let ((star, peers), data_listener) = if opts.rank == 0 {
        root::root_rendezvous(&ctx, &host, iface_ip, root, links)?
    } else {
        let s = leaf::reach_root(&ctx)?;
        // The data listener binds the address this rank advertises: the interface asked for,
        // else the one it reaches rank 0 from (which rank 0 puts in the table).
        let ip = match iface_ip {
            Some(ip) => ip,
            None => s
                .local_addr()
                .map_err(|e| ctx.io(Some(0), "the local address of the connection to rank 0", e))?
                .ip(),
        };
        let l = bind_data(&ctx, ip)?;
        let port = l
            .local_addr()
            .map_err(|e| ctx.io(None, "data listener address", e))?
            .port();
        (leaf::leaf_rendezvous(&ctx, s, &host, port, iface_ip)?, l)
    };
    data_listener
        .set_nonblocking(true)
        .map_err(|e| ctx.io(None, "listener", e))?;
    let mut door = Door::new(data_listener, opts.world);
    door.allow(&peers, opts.any_source);
    let mut mesh: Vec<Option<TcpStream>> = (0..opts.world).map(|_| None).collect();
    let mine = links.map(|l| l(opts.rank));
    let need = |p: usize| mine.as_ref().is_none_or(|l| l.binary_search(&p).is_ok());
    mesh::connect_mesh(&ctx, &mut door, &peers, &mut mesh, &need)?;
    if links.is_none() {
        door.finish();
    }
    let mut boot = Bootstrap {
        opts: opts.clone(),
        star,
        peers,
        door: Some(door),
    };
    if links.is_some() {
        boot.gather_table(&mut mesh)?;
        // The whole table is known now: every rank's address may connect.
        if let Some(d) = boot.door.as_mut() {
            d.allow(&boot.peers, opts.any_source);
        }
    }
    Ok((boot, mesh))
}

/// Binds this rank's data listener on `ip`, the address it advertises (an ephemeral port), or
/// on every interface with `DSPARK_LISTEN_ANY`.
fn bind_data(ctx: &Ctx<'_>, ip: IpAddr) -> Result<TcpListener> {
    let ip = match ip {
        _ if !ctx.opts.listen_any => ip,
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    };
    let at = SocketAddr::new(ip, 0);
    let l = TcpListener::bind(at).map_err(|e| {
        Error::io(
            Some(ctx.rank()),
            None,
            format!("bootstrap: binding the data listener on {at}"),
            e,
        )
    })?;
    net::widen_backlog(&l);
    Ok(l)
}

/// The connections to rank 0 (rank 0: to every rank) and the rank table.
type Star = (Vec<Option<TcpStream>>, Vec<PeerInfo>);

/// A bad hello's reason, in words.
fn describe(e: &HelloError) -> String {
    match e {
        HelloError::Foreign(w) | HelloError::Malformed(w) => w.clone(),
        HelloError::Version(v) => format!(
            "protocol version {v} but this rank runs version {VERSION} (mixed dspark builds?)"
        ),
    }
}

/// A fresh nonce for a handshake.
fn fresh_nonce(ctx: &Ctx<'_>) -> Result<auth::Nonce> {
    auth::nonce().map_err(|e| ctx.io(None, "reading a nonce from /dev/urandom", e))
}

impl Bootstrap {
    /// Connects the pairs of ranks the rendezvous left out that `need` names (by the other
    /// rank), with the same proofs both ways: every rank of the job calls it at the same
    /// point with a symmetric `need`, as [`rendezvous_with`]'s `links`. `mesh` is the
    /// rendezvous's and gains the new connections.
    ///
    /// # Errors
    /// As [`rendezvous`], by the configured deadline from now.
    pub fn complete_mesh(
        &mut self,
        mesh: &mut [Option<TcpStream>],
        need: &dyn Fn(usize) -> bool,
    ) -> Result<()> {
        let Some(mut door) = self.door.take() else {
            return Ok(());
        };
        let ctx = Ctx::new(&self.opts);
        let res = mesh::connect_mesh(&ctx, &mut door, &self.peers, mesh, need);
        self.door = Some(door);
        res
    }

    /// The data listener and the rank table, for connections made on first use after init
    /// (None for a world of one). Only one caller gets them.
    pub fn links(&mut self) -> Option<LazyLinks> {
        let mut door = self.door.take()?;
        door.lazy = true;
        let world = self.opts.world;
        Some(LazyLinks {
            opts: self.opts.clone(),
            door,
            peers: self.peers.clone(),
            dials: (0..world).map(|_| None).collect(),
            scratch: (0..world).map(|_| None).collect(),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.opts.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.opts.world
    }

    /// Number of ranks on this rank's host (by host name), this one included.
    pub fn local_ranks(&self) -> usize {
        let me = &self.peers[self.opts.rank].host;
        self.peers.iter().filter(|p| &p.host == me).count()
    }
}
