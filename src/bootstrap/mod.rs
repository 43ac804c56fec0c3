//! TCP rendezvous: how ranks find each other.
//!
//! 1. Rank 0 listens on the root address; every other rank connects to it, retrying until the
//!    deadline, and sends a hello: magic number, protocol version, world size, rank, a hash
//!    of the launcher's job id, whether it has a job token, the address of its own data
//!    listener, its host name and a fresh random nonce.
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
//! Without `DSPARK_JOB_TOKEN` the key is the launcher's job id alone, which is no secret:
//! the handshake then only keeps ranks of different jobs (or different protocol versions)
//! from joining each other by accident. Nothing is encrypted; set a token wherever a stranger
//! can reach the rendezvous port.
//!
//! A rank of another protocol version is refused with both versions named, in either
//! direction: version 2's hello starts with version 1's fields.
//!
//! The connections to rank 0 stay open until init is over for small exchanges
//! ([`Bootstrap::all_gather`]), e.g. the verbs connection information.

#![forbid(unsafe_code)]

pub mod store;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};

use crate::config::{split_host_port, Config};
use crate::error::{Error, Result};

pub(crate) mod auth;
pub(crate) mod msg;

use msg::{
    HelloError, Msg, PeerHello, Reject, Reply, MSG_PEER_PROOF, MSG_PROOF, REJECT_CONFIG,
    REJECT_MISMATCH,
};
pub use msg::{MAGIC, VERSION};

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
}

/// The rendezvous state kept during init.
#[derive(Debug)]
pub struct Bootstrap {
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Rank 0: connections to every rank; others: `star[0]` is the connection to rank 0.
    star: Vec<Option<TcpStream>>,
    /// Everybody's host and data address, by rank.
    pub peers: Vec<PeerInfo>,
    /// The configuration, for connections made after the rendezvous.
    cfg: Config,
    /// This rank's data listener, with the connections on it still proving themselves:
    /// kept for [`Bootstrap::complete_mesh`] and [`Bootstrap::links`].
    door: Option<Door>,
}

struct Ctx<'a> {
    cfg: &'a Config,
    sec: Secret,
    deadline: Instant,
    start: Instant,
}

impl Ctx<'_> {
    fn rank(&self) -> usize {
        self.cfg.rank
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
        let rem = self
            .remaining()
            .ok_or_else(|| self.timeout(peer, "sending a bootstrap message"))?;
        s.set_write_timeout(Some(rem))
            .map_err(|e| self.io(peer, "socket option", e))?;
        let mut buf = Vec::with_capacity(4 + m.0.len());
        buf.extend_from_slice(&(m.0.len() as u32).to_le_bytes());
        buf.extend_from_slice(&m.0);
        s.write_all(&buf)
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
        s.set_read_timeout(Some(rem))
            .map_err(|e| self.io(peer, "socket option", e))?;
        let mut len = [0u8; 4];
        s.read_exact(&mut len).map_err(|e| self.io(peer, what, e))?;
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
        s.read_exact(&mut buf).map_err(|e| self.io(peer, what, e))?;
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

fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "unknown-host".into())
}

/// The IPv4 address of interface `name`.
pub(crate) fn interface_ip(name: &str) -> Result<IpAddr> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(|e| {
        Error::config(
            "DSPARK_SOCKET_IFNAME",
            format!("cannot list interfaces: {e}"),
        )
    })?;
    let mut names = Vec::new();
    for a in addrs {
        if !names.contains(&a.interface_name) {
            names.push(a.interface_name.clone());
        }
        if a.interface_name != name {
            continue;
        }
        if let Some(sin) = a.address.as_ref().and_then(|s| s.as_sockaddr_in()) {
            return Ok(IpAddr::V4(sin.ip()));
        }
    }
    Err(Error::config(
        "DSPARK_SOCKET_IFNAME",
        format!(
            "interface {name:?} has no IPv4 address (interfaces here: {})",
            names.join(", ")
        ),
    ))
}

fn resolve(host: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
    Ok((host, port).to_socket_addrs()?.collect())
}

pub(crate) fn is_local_ip(ip: IpAddr) -> bool {
    TcpListener::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// Runs the rendezvous for `cfg`: returns the bootstrap state and one connected stream per
/// peer (`None` at this rank's own index).
///
/// # Errors
/// [`Error::Config`] (port in use, bad interface), [`Error::Timeout`] (rank 0 unreachable or
/// ranks missing by the deadline), [`Error::Mismatch`] (another world size, job or protocol),
/// [`Error::PeerLost`], [`Error::Io`].
pub fn rendezvous(cfg: &Config) -> Result<(Bootstrap, Vec<Option<TcpStream>>)> {
    rendezvous_with(cfg, None, None)
}

/// [`rendezvous`], where rank 0 accepts the other ranks on `root` — a listener it bound
/// itself, typically on an ephemeral port whose address it published through a key-value
/// store or a parent communicator — instead of binding `cfg.root_addr`. The other ranks
/// connect to `cfg.root_addr` as usual.
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
    cfg: &Config,
    root: Option<TcpListener>,
    links: Option<&dyn Fn(usize) -> Vec<usize>>,
) -> Result<(Bootstrap, Vec<Option<TcpStream>>)> {
    cfg.validate()?;
    let start = Instant::now();
    let ctx = Ctx {
        cfg,
        sec: Secret::of(cfg),
        deadline: crate::config::deadline(start, cfg.timeout),
        start,
    };
    // The host identity: equal ones share memory (DSPARK_HOST_ID stands in for separate
    // hosts in tests with network namespaces).
    let host = cfg.host_id.clone().unwrap_or_else(hostname);
    if cfg.world_size == 1 {
        let peers = vec![PeerInfo {
            rank: 0,
            host,
            addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
        }];
        return Ok((
            Bootstrap {
                rank: 0,
                world: 1,
                timeout: cfg.timeout,
                star: vec![None],
                peers,
                cfg: cfg.clone(),
                door: None,
            },
            vec![None],
        ));
    }
    let iface_ip = cfg.socket_ifname.as_deref().map(interface_ip).transpose()?;
    let data_bind = SocketAddr::new(iface_ip.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)), 0);
    let data_listener = TcpListener::bind(data_bind).map_err(|e| {
        Error::io(
            Some(cfg.rank),
            None,
            format!("bootstrap: binding the data listener on {data_bind}"),
            e,
        )
    })?;
    let data_port = data_listener
        .local_addr()
        .map_err(|e| ctx.io(None, "data listener address", e))?
        .port();
    let (star, peers) = if cfg.rank == 0 {
        root_rendezvous(&ctx, &host, data_port, iface_ip, root, links)?
    } else {
        leaf_rendezvous(&ctx, &host, data_port, iface_ip)?
    };
    data_listener
        .set_nonblocking(true)
        .map_err(|e| ctx.io(None, "listener", e))?;
    let mut door = Door::new(data_listener, cfg.world_size);
    let mut mesh: Vec<Option<TcpStream>> = (0..cfg.world_size).map(|_| None).collect();
    let mine = links.map(|l| l(cfg.rank));
    let need = |p: usize| mine.as_ref().is_none_or(|l| l.binary_search(&p).is_ok());
    connect_mesh(&ctx, &mut door, &peers, &mut mesh, &need)?;
    if links.is_none() {
        door.finish();
    }
    let mut boot = Bootstrap {
        rank: cfg.rank,
        world: cfg.world_size,
        timeout: cfg.timeout,
        star,
        peers,
        cfg: cfg.clone(),
        door: Some(door),
    };
    if links.is_some() {
        boot.gather_table(&mut mesh)?;
    }
    Ok((boot, mesh))
}

fn source_of(cfg: &Config) -> String {
    cfg.sources
        .iter()
        .find(|(k, _)| k == "root address")
        .map_or("DSPARK_ROOT_ADDR".to_string(), |(_, v)| v.clone())
}

type Star = (Vec<Option<TcpStream>>, Vec<PeerInfo>);

fn root_rendezvous(
    ctx: &Ctx<'_>,
    host: &str,
    data_port: u16,
    iface: Option<IpAddr>,
    pre_bound: Option<TcpListener>,
    links: Option<&dyn Fn(usize) -> Vec<usize>>,
) -> Result<Star> {
    let cfg = ctx.cfg;
    let world = cfg.world_size;
    let (listener, bind_addr) = match pre_bound {
        Some(l) => {
            let a = l
                .local_addr()
                .map_err(|e| ctx.io(None, "listener address", e))?;
            (l, a)
        }
        None => bind_root(ctx)?,
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| ctx.io(None, "listener", e))?;
    root_accept(
        ctx,
        host,
        data_port,
        iface,
        (listener, bind_addr),
        world,
        links,
    )
}

/// Binds rank 0's rendezvous listener on the configured root address.
fn bind_root(ctx: &Ctx<'_>) -> Result<(TcpListener, SocketAddr)> {
    let cfg = ctx.cfg;
    let (rhost, port) =
        split_host_port(&cfg.root_addr).map_err(|w| Error::config(source_of(cfg), w))?;
    let resolved = resolve(&rhost, port).unwrap_or_default();
    let bind_addr = resolved
        .iter()
        .find(|a| is_local_ip(a.ip()))
        .copied()
        .unwrap_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port));
    let listener = TcpListener::bind(bind_addr).map_err(|e| {
        if e.kind() == io::ErrorKind::AddrInUse {
            Error::config(
                source_of(cfg),
                format!(
                    "rank 0 cannot listen on {bind_addr}: port {port} is already in use (another \
                     job, or an earlier run still exiting? pick another port)"
                ),
            )
        } else {
            Error::io(
                Some(0),
                None,
                format!("bootstrap: listening on {bind_addr}"),
                e,
            )
        }
    })?;
    Ok((listener, bind_addr))
}

/// The job's handshake secret (see [`auth`]) and what the hellos carry in the clear.
#[derive(Clone)]
struct Secret {
    /// HMAC key: the job token and the launcher's job id.
    key: Vec<u8>,
    /// Hash of the launcher's job id alone (0 without one): the token never travels, not
    /// even hashed.
    job: u64,
    /// Whether this rank has a job token.
    token: bool,
}

impl Secret {
    fn of(cfg: &Config) -> Secret {
        // `job_hash` of a configuration with the job id and no token: the job id's hash.
        let mut id_only = Config::new(0, 1, String::new());
        id_only.job_id = cfg.job_id.clone();
        Secret {
            key: auth::job_key(cfg.job_token.as_deref(), cfg.job_id.as_deref()),
            job: id_only.job_hash(),
            token: cfg.job_token.is_some(),
        }
    }

    /// A rank's proof to rank 0: over rank 0's nonce and the rank's whole hello (its own
    /// nonce, rank, world size, address).
    fn rank_proof(&self, nonce0: &auth::Nonce, hello: &[u8]) -> msg::Tag {
        auth::hmac_sha256(&self.key, &[LABEL_RANK, nonce0, hello])
    }

    /// Rank 0's proof to a rank: over that rank's hello, rank 0's nonce and the welcome
    /// (the rank table) it sends.
    fn root_proof(&self, hello: &[u8], nonce0: &auth::Nonce, welcome: &[u8]) -> msg::Tag {
        auth::hmac_sha256(&self.key, &[LABEL_ROOT, nonce0, hello, welcome])
    }

    /// A data connection's proofs, by the accepting (`LABEL_ACCEPTOR`) or the connecting
    /// (`LABEL_CONNECTOR`) rank: over the connecting rank's hello and the acceptor's nonce.
    fn peer_proof(&self, label: &[u8], hello: &[u8], nonce: &auth::Nonce) -> msg::Tag {
        auth::hmac_sha256(&self.key, &[label, nonce, hello])
    }

    /// What to say when a peer's token flag differs from this rank's.
    fn token_disagreement(&self, me: &str, them: &str) -> String {
        let (has, hasnt) = if self.token { (me, them) } else { (them, me) };
        format!(
            "{has} has DSPARK_JOB_TOKEN set but {hasnt} has none (set the same DSPARK_JOB_TOKEN \
             on every rank)"
        )
    }

    /// What to say when a proof did not verify.
    fn bad_proof(&self, who: &str, than: &str) -> String {
        if self.token {
            format!(
                "{who} did not prove that it knows the job token: its DSPARK_JOB_TOKEN differs \
                 from {than}'s (or a recorded handshake was replayed)"
            )
        } else {
            format!(
                "{who}'s handshake proof did not verify (no DSPARK_JOB_TOKEN is set: a replayed \
                 or forged handshake, or a broken peer?)"
            )
        }
    }
}

// The labels of the four proofs: no proof made for one purpose verifies for another.
const LABEL_RANK: &[u8] = b"dspark/2 rank proves to rank 0\0";
const LABEL_ROOT: &[u8] = b"dspark/2 rank 0 proves to a rank\0";
const LABEL_ACCEPTOR: &[u8] = b"dspark/2 data acceptor proves\0";
const LABEL_CONNECTOR: &[u8] = b"dspark/2 data connector proves\0";

fn describe(e: &HelloError) -> String {
    match e {
        HelloError::Foreign(w) | HelloError::Malformed(w) => w.clone(),
        HelloError::Version(v) => format!(
            "protocol version {v} but this rank runs version {VERSION} (mixed dspark builds?)"
        ),
    }
}

fn fresh_nonce(ctx: &Ctx<'_>) -> Result<auth::Nonce> {
    auth::nonce().map_err(|e| ctx.io(None, "reading a nonce from /dev/urandom", e))
}

/// What rank 0 keeps of each rank that joined.
struct Joined {
    host: String,
    data_port: u16,
    ip: IpAddr,
    /// Its hello and the nonce rank 0 challenged it with: rank 0's proof in the welcome
    /// covers both.
    hello: Vec<u8>,
    nonce0: auth::Nonce,
}

/// Rank 0's side of the rendezvous on `listener`.
fn root_accept(
    ctx: &Ctx<'_>,
    host: &str,
    data_port: u16,
    iface: Option<IpAddr>,
    (listener, bind_addr): (TcpListener, SocketAddr),
    world: usize,
    links: Option<&dyn Fn(usize) -> Vec<usize>>,
) -> Result<Star> {
    let cfg = ctx.cfg;
    let sec = &ctx.sec;
    tracing::debug!(%bind_addr, world, "rank 0 waiting for the other ranks");

    let mut star: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut info: Vec<Option<Joined>> = (0..world).map(|_| None).collect();
    let mut refused: Vec<String> = Vec::new();
    let mut joined = 1;
    while joined < world {
        let (mut s, from) = match accept_until(ctx, &listener) {
            Ok(x) => x,
            Err(Error::Timeout { .. }) => {
                let missing: Vec<String> = (1..world)
                    .filter(|&r| star[r].is_none())
                    .map(|r| r.to_string())
                    .collect();
                let mut detail = format!(
                    "{joined} of {world} ranks joined at {bind_addr}; missing rank(s) {}",
                    missing.join(", ")
                );
                if !refused.is_empty() {
                    detail += &format!("; refused: {}", refused.join("; "));
                }
                return Err(ctx.timeout(missing.first().and_then(|m| m.parse().ok()), detail));
            }
            Err(e) => return Err(e),
        };
        let _ = s.set_nodelay(true);
        let _ = s.set_nonblocking(false);
        let reject = |s: &mut TcpStream, class: u8, var: &str, why: &str| {
            let rej = Reject {
                class,
                var: var.into(),
                why: why.into(),
            };
            let _ = ctx.send(s, None, rej.encode());
        };
        // A stray connection must not eat the whole deadline.
        let hello = match ctx.recv_within(&mut s, None, "reading a hello", HELLO_WAIT, MAX_HELLO) {
            Ok(m) => m,
            Err(e) => {
                refused.push(format!("{from}: {e}"));
                continue;
            }
        };
        let h = match msg::Hello::decode(&hello) {
            Ok(h) => h,
            Err(e) => {
                let why = describe(&e);
                if !matches!(e, HelloError::Foreign(_)) {
                    // A dspark rank of another version, or a broken one: it hears why.
                    reject(
                        &mut s,
                        REJECT_MISMATCH,
                        "",
                        &why.replace("this rank", "rank 0"),
                    );
                }
                tracing::warn!(%from, "refused a bootstrap connection: {why}");
                refused.push(format!("{from}: {}", why.replace("this rank", "rank 0")));
                continue;
            }
        };
        let r = h.rank as usize;
        let mut refuse = |s: &mut TcpStream, why: String| {
            reject(s, REJECT_MISMATCH, "", &why);
            tracing::warn!(%from, "refused: {why}");
            refused.push(format!("{from} (claims rank {r}): {why}"));
        };
        if h.job != sec.job {
            refuse(
                &mut s,
                "the launcher's job id (SLURM_JOB_ID or TORCHELASTIC_RUN_ID) differs from rank \
                 0's: a rank of another job?"
                    .into(),
            );
            continue;
        }
        if h.token != sec.token {
            refuse(
                &mut s,
                sec.token_disagreement("rank 0", &format!("rank {r}")),
            );
            continue;
        }
        // The challenge: the rank proves the token over a nonce of rank 0's, so that a
        // recorded handshake proves nothing. Nothing it claims is acted on before that.
        let nonce0 = fresh_nonce(ctx)?;
        if let Err(e) = ctx.send(&mut s, None, Reply::encode_challenge(&nonce0)) {
            refused.push(format!("{from} (claims rank {r}): {e}"));
            continue;
        }
        let proof = match ctx.recv_within(
            &mut s,
            None,
            "reading the answer to the challenge",
            HELLO_WAIT,
            MAX_HELLO,
        ) {
            Ok(m) => m,
            Err(e) => {
                refused.push(format!("{from} (claims rank {r}): {e}"));
                continue;
            }
        };
        match msg::decode_proof(&proof, MSG_PROOF) {
            Ok(Ok(tag)) if auth::ct_eq(&tag, &sec.rank_proof(&nonce0, &hello)) => {}
            Ok(Ok(_)) => {
                refuse(&mut s, sec.bad_proof(&format!("rank {r}"), "rank 0"));
                continue;
            }
            Ok(Err(gave_up)) => {
                refused.push(format!("{from} (claims rank {r}): {}", gave_up.why));
                continue;
            }
            Err(w) => {
                refuse(&mut s, format!("bad answer to the challenge: {w}"));
                continue;
            }
        }
        if h.world as usize != world {
            let why = format!(
                "rank {r} (at {from}) has world size {} but rank 0 has {world}",
                h.world
            );
            reject(&mut s, REJECT_MISMATCH, "", &why);
            abort_all(ctx, &mut star, REJECT_MISMATCH, "", &why);
            return Err(Error::Mismatch {
                rank: Some(0),
                peer: Some(r),
                op: "bootstrap".into(),
                what: why,
            });
        }
        if h.segment != cfg.segment_bytes as u64 {
            let why = format!(
                "rank {r} uses {}-byte pipeline segments but rank 0 uses {}: set the same \
                 DSPARK_CHUNK_BYTES on every rank",
                h.segment, cfg.segment_bytes
            );
            reject(&mut s, REJECT_CONFIG, "DSPARK_CHUNK_BYTES", &why);
            abort_all(ctx, &mut star, REJECT_CONFIG, "DSPARK_CHUNK_BYTES", &why);
            return Err(Error::config("DSPARK_CHUNK_BYTES", why));
        }
        if r == 0 || r >= world || star[r].is_some() {
            let prev = info[r.min(world - 1)]
                .as_ref()
                .map_or("this process".to_string(), |j| {
                    format!("{} ({})", j.host, j.ip)
                });
            let why = format!(
                "rank {r} joined twice: from {} ({from}) and earlier from {prev} — check \
                 DSPARK_RANK / RANK on each process",
                h.host
            );
            reject(&mut s, REJECT_CONFIG, "DSPARK_RANK", &why);
            abort_all(ctx, &mut star, REJECT_CONFIG, "DSPARK_RANK", &why);
            return Err(Error::config("DSPARK_RANK", why));
        }
        info[r] = Some(Joined {
            host: h.host,
            data_port: h.data_port,
            ip: from.ip(),
            hello,
            nonce0,
        });
        star[r] = Some(s);
        joined += 1;
    }
    // The table, as each peer should see it: rank 0's address is the one that peer reached.
    let mut peers = Vec::with_capacity(world);
    for (r, joined) in info.iter().enumerate() {
        let (hn, port, ip) = match joined {
            _ if r == 0 => (
                host.to_string(),
                data_port,
                iface.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            ),
            Some(j) => (j.host.clone(), j.data_port, j.ip),
            None => return Err(ctx.bad(Some(r), "rank missing from the table".into())),
        };
        peers.push(PeerInfo {
            rank: r,
            host: hn,
            addr: SocketAddr::new(ip, port),
        });
    }
    for (r, slot) in star.iter_mut().enumerate().skip(1) {
        let (Some(s), Some(j)) = (slot.as_mut(), info[r].as_ref()) else {
            return Err(ctx.bad(Some(r), "no connection to this rank".into()));
        };
        let my_ip = iface.unwrap_or_else(|| {
            s.local_addr()
                .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |a| a.ip())
        });
        let mut table = match links {
            Some(l) => {
                let mut want = l(r);
                want.extend([0, r]);
                want.sort_unstable();
                want.dedup();
                want.into_iter()
                    .filter_map(|q| peers.get(q).cloned())
                    .collect()
            }
            None => peers.clone(),
        };
        table[0].addr = SocketAddr::new(my_ip, data_port);
        let m = msg::encode_welcome(&table);
        // Rank 0's own proof, over this rank's hello and nonce and the table itself.
        let tag = sec.root_proof(&j.hello, &j.nonce0, &m.0);
        ctx.send(s, Some(r), m.raw(&tag))?;
    }
    if let Some(s) = star[1].as_ref() {
        if iface.is_none() {
            if let Ok(a) = s.local_addr() {
                peers[0].addr = SocketAddr::new(a.ip(), data_port);
            }
        }
    }
    Ok((star, peers))
}

fn abort_all(ctx: &Ctx<'_>, star: &mut [Option<TcpStream>], class: u8, var: &str, why: &str) {
    let rej = Reject {
        class,
        var: var.into(),
        why: why.into(),
    };
    for s in star.iter_mut().flatten() {
        let _ = ctx.send(s, None, rej.encode());
    }
}

/// The error of a rank that rank 0 refused.
fn refusal(cfg: &Config, rej: Reject) -> Error {
    let what = format!("rank 0 refused this rank: {}", rej.why);
    if rej.class == REJECT_CONFIG {
        Error::config(rej.var, what)
    } else {
        Error::Mismatch {
            rank: Some(cfg.rank),
            peer: Some(0),
            op: "bootstrap".into(),
            what,
        }
    }
}

fn accept_until(ctx: &Ctx<'_>, l: &TcpListener) -> Result<(TcpStream, SocketAddr)> {
    loop {
        match l.accept() {
            Ok(x) => return Ok(x),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ctx.io(None, "accepting a connection", e)),
        }
        let rem = ctx
            .remaining()
            .ok_or_else(|| ctx.timeout(None, "waiting for connections"))?;
        let ms = rem.as_millis().clamp(1, 1000) as u16;
        let mut fds = [PollFd::new(l.as_fd(), PollFlags::POLLIN)];
        let _ = nix::poll::poll(&mut fds, PollTimeout::from(ms));
    }
}

fn leaf_rendezvous(
    ctx: &Ctx<'_>,
    host: &str,
    data_port: u16,
    iface: Option<IpAddr>,
) -> Result<Star> {
    let cfg = ctx.cfg;
    let sec = &ctx.sec;
    let world = cfg.world_size;
    let (rhost, port) =
        split_host_port(&cfg.root_addr).map_err(|w| Error::config(source_of(cfg), w))?;
    let mut last_err = String::from("no attempt made");
    let mut s = loop {
        match resolve(&rhost, port) {
            Ok(addrs) if !addrs.is_empty() => {
                let mut connected = None;
                for a in addrs {
                    let rem = ctx.remaining().unwrap_or(Duration::from_millis(1));
                    match TcpStream::connect_timeout(&a, rem.min(Duration::from_secs(5))) {
                        Ok(s) => {
                            connected = Some(s);
                            break;
                        }
                        Err(e) => last_err = format!("{a}: {e}"),
                    }
                }
                if let Some(s) = connected {
                    break s;
                }
            }
            Ok(_) => last_err = format!("{rhost} resolves to no address"),
            Err(e) => last_err = format!("cannot resolve {rhost}: {e}"),
        }
        if ctx.remaining().is_none() {
            return Err(ctx.timeout(
                Some(0),
                format!(
                    "could not reach rank 0 at {} (from {}): {last_err} — is rank 0 running, \
                     and is the address right?",
                    cfg.root_addr,
                    source_of(cfg)
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = s.set_nodelay(true);
    let root_at = s
        .peer_addr()
        .map_or_else(|_| cfg.root_addr.clone(), |a| a.to_string());
    let hello = msg::Hello {
        world: world as u32,
        rank: cfg.rank as u32,
        job: sec.job,
        data_port,
        host: host.to_string(),
        segment: cfg.segment_bytes as u64,
        token: sec.token,
        nonce: fresh_nonce(ctx)?,
    }
    .encode();
    ctx.send(&mut s, Some(0), hello.clone())?;
    let reply = ctx.recv(&mut s, Some(0), "waiting for rank 0's challenge")?;
    let nonce0 = match Reply::decode(&reply, world).map_err(|w| ctx.bad(Some(0), w))? {
        Reply::Challenge(n) => n,
        Reply::Reject(rej) => return Err(refusal(cfg, rej)),
        Reply::Welcome { .. } => {
            return Err(ctx.bad(
                Some(0),
                "rank 0 sent a rank table without a challenge".into(),
            ))
        }
    };
    let proof = sec.rank_proof(&nonce0, &hello.0);
    ctx.send(&mut s, Some(0), msg::encode_proof(MSG_PROOF, &proof))?;
    let reply = ctx.recv(&mut s, Some(0), "waiting for rank 0 to admit this rank")?;
    let mut peers = match Reply::decode(&reply, world).map_err(|w| ctx.bad(Some(0), w))? {
        Reply::Welcome { peers, signed, tag } => {
            if !auth::ct_eq(&tag, &sec.root_proof(&hello.0, &nonce0, &reply[..signed])) {
                return Err(Error::Mismatch {
                    rank: Some(cfg.rank),
                    peer: Some(0),
                    op: "bootstrap".into(),
                    what: format!(
                        "{}: refusing its rank table",
                        sec.bad_proof(&format!("rank 0 at {root_at}"), "this rank")
                    ),
                });
            }
            peers
        }
        Reply::Reject(rej) => return Err(refusal(cfg, rej)),
        Reply::Challenge(_) => {
            return Err(ctx.bad(Some(0), "rank 0 sent a second challenge".into()))
        }
    };
    // A partial table (connections on first use): the rest is gathered after the mesh.
    let me = cfg.rank;
    if peers.len() < world {
        let known = std::mem::take(&mut peers);
        peers = (0..world)
            .map(|rank| PeerInfo {
                rank,
                host: String::new(),
                addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
            })
            .collect();
        for p in known {
            let r = p.rank;
            peers[r] = p;
        }
        if peers[0].addr.port() == 0 || peers[me].addr.port() == 0 {
            return Err(ctx.bad(Some(0), "rank 0's table lacks rank 0 or this rank".into()));
        }
    }
    // Our own entry: rank 0 recorded the address it saw us connect from.
    if let Some(ip) = iface {
        peers[me].addr = SocketAddr::new(ip, data_port);
    }
    let mut star: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    star[0] = Some(s);
    Ok((star, peers))
}

/// The reason of the refusal a connection on first use gets when the two ranks connected to
/// each other at once and the other one's connection is kept (not an error).
const CROSSED: &str = "dspark: crossed connections, the higher rank's is kept";

/// The most connections on a data listener that have not proved the job token yet, beyond
/// one for each higher rank: what a stranger who floods the listener can make this rank hold.
const MAX_STRANGERS: usize = 64;

/// A connection on this rank's data listener that has not proved the job token yet.
struct Candidate {
    s: TcpStream,
    from: SocketAddr,
    accepted: Instant,
    /// Once it sent a hello of this job: the hello, what it claims, and the nonce this rank
    /// challenged it with. Nothing it claims counts before its proof has verified.
    hello: Option<(Vec<u8>, PeerHello, auth::Nonce)>,
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
    /// with `any` (connections on first use, [`LazyLinks`]) any other rank.
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
fn pull_message(
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
enum Until {
    /// Every higher rank has proved itself or has a connection that said a hello for it.
    Challenged,
    /// Every higher rank has proved itself.
    Proven,
}

/// This rank's data listener while the higher ranks connect (steps 2 and 4 of
/// [`connect_mesh`]). Anyone who can reach it can connect and claim any rank: a connection
/// is only a candidate until it proves the job token, and several can claim one rank; the
/// first whose proof verifies is that rank's connection. A candidate that sends something
/// else is dropped at once with a warning naming its address, one that says no hello within
/// [`HELLO_WAIT`], or does not answer the challenge within [`HELLO_WAIT`], too. Candidates
/// are read without waiting ([`Candidate::pull`]): one that sends half a message holds up
/// nothing, and the real rank is accepted and proved next to it. Only a connection
/// that proved the token and then does not fit (for another rank, or a rank already
/// connected) fails the init: that is a rank of this job, confused.
struct Door {
    listener: TcpListener,
    /// Connections on first use ([`LazyLinks`]): any rank may connect, not only higher ones.
    lazy: bool,
    /// With `lazy`: the ranks this one is connecting to itself (and the lower ones it has
    /// connected to). When two ranks connect to each other at once, the higher rank's
    /// connection is kept and the lower's refused as [`CROSSED`], also when its proof comes
    /// after the higher rank's connection completed.
    dialing: Vec<bool>,
    cands: Vec<Candidate>,
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
    fn new(listener: TcpListener, world: usize) -> Door {
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
    fn admit(
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
    fn round(
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
        let sec = &ctx.sec;
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
    fn finish(&mut self) {
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

/// Connects every pair of ranks. Each connection proves the job token both ways, in steps
/// that never wait on a rank that is itself waiting (every step of every rank depends only on
/// earlier steps of the others):
///
/// 1. connect to every lower rank and send a hello with a fresh nonce;
/// 2. accept connections, answer every hello of this job with a nonce of this rank's and
///    this rank's proof (over the hello and that nonce), until every higher rank has said a
///    hello (or proved itself already);
/// 3. check every lower rank's proof and send this rank's (over the same);
/// 4. check the higher ranks' proofs and acknowledge them, accepting and challenging further
///    connections until every higher rank has proved itself;
/// 5. read the lower ranks' acknowledgements.
///
/// Anyone who can reach the data listener can say a hello claiming any rank, so in steps 2
/// and 4 a connection is only a candidate until its proof verifies (see [`Door`]): a
/// stranger's connection is dropped, or outlived, and neither fails the init nor holds it.
fn connect_mesh(
    ctx: &Ctx<'_>,
    door: &mut Door,
    peers: &[PeerInfo],
    mesh: &mut [Option<TcpStream>],
    need: &dyn Fn(usize) -> bool,
) -> Result<()> {
    let me = ctx.rank();
    let world = mesh.len();
    // The hellos this rank sent to the lower ranks.
    let mut sent: Vec<Vec<u8>> = vec![Vec::new(); world];
    let lower: Vec<usize> = (0..me.min(peers.len()))
        .filter(|&r| need(r) && mesh[r].is_none())
        .collect();
    // 1. Connect to every lower rank and say hello.
    for &r in &lower {
        let (s, hello) = say_hello(ctx, &peers[r], false)?;
        sent[r] = hello;
        mesh[r] = Some(s);
    }
    // 2. Accept the higher ranks and challenge them, until every one of them has answered
    //    with a hello (or already proved itself).
    door.admit(ctx, mesh, Until::Challenged, need)?;
    // 3. Check every lower rank's proof, and prove this rank's knowledge to it.
    for &r in &lower {
        let Some(s) = mesh[r].as_mut() else {
            return Err(ctx.bad(Some(r), "no connection to this rank".into()));
        };
        let m = ctx.recv(s, Some(r), &format!("waiting for rank {r}'s challenge"))?;
        answer_challenge(ctx, s, &peers[r], &sent[r], &m)?;
    }
    // 4. Check the higher ranks' proofs and acknowledge them, still accepting connections
    //    until every higher rank has proved itself: the first valid proof for a rank wins.
    door.admit(ctx, mesh, Until::Proven, need)?;
    // 5. Read the acknowledgements of the lower ranks.
    for &r in &lower {
        let Some(s) = mesh[r].as_mut() else {
            return Err(ctx.bad(Some(r), "no connection to this rank".into()));
        };
        let m = ctx.recv(
            s,
            Some(r),
            &format!("waiting for rank {r} to accept the connection"),
        )?;
        check_ack(ctx, r, &m)?;
    }
    for s in mesh.iter().flatten() {
        let _ = s.set_read_timeout(None);
        let _ = s.set_write_timeout(None);
    }
    Ok(())
}

/// Step 1 of a data connection to the lower rank `p`: connects to its data listener and
/// sends a hello with a fresh nonce; returns the stream and the hello. A refused connection
/// is retried until the deadline (the rank may not listen yet) unless `refused_is_lost`: after
/// the rendezvous every listener is up, and a refusal means the rank is gone.
fn say_hello(ctx: &Ctx<'_>, p: &PeerInfo, refused_is_lost: bool) -> Result<(TcpStream, Vec<u8>)> {
    let me = ctx.rank();
    let mut s = loop {
        let rem = ctx.remaining().ok_or_else(|| {
            ctx.timeout(
                Some(p.rank),
                format!("connecting to rank {} at {}", p.rank, p.addr),
            )
        })?;
        match TcpStream::connect_timeout(&p.addr, rem.min(Duration::from_secs(5))) {
            Ok(s) => break s,
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused && !refused_is_lost => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                return Err(Error::PeerLost {
                    rank: me,
                    peer: p.rank,
                    op: "connect".into(),
                    detail: format!(
                        "its data listener at {} ({}) refused the connection: its communicator \
                         is closed or its process died",
                        p.addr, p.host
                    ),
                })
            }
            Err(e) => {
                return Err(Error::io(
                    Some(me),
                    Some(p.rank),
                    format!(
                        "bootstrap: connecting to rank {} at {} ({})",
                        p.rank, p.addr, p.host
                    ),
                    e,
                ))
            }
        }
    };
    let _ = s.set_nodelay(true);
    let hello = PeerHello {
        job: ctx.sec.job,
        world: ctx.cfg.world_size as u32,
        from: me as u32,
        to: p.rank as u32,
        token: ctx.sec.token,
        nonce: fresh_nonce(ctx)?,
    }
    .encode();
    ctx.send(&mut s, Some(p.rank), hello.clone())?;
    Ok((s, hello.0))
}

/// Step 3 of a data connection to the lower rank `p`: checks its challenge `m` (its proof
/// over `hello`, the hello this rank sent) and answers with this rank's proof.
fn answer_challenge(
    ctx: &Ctx<'_>,
    s: &mut TcpStream,
    p: &PeerInfo,
    hello: &[u8],
    m: &[u8],
) -> Result<()> {
    let r = p.rank;
    let sec = &ctx.sec;
    let (nonce, theirs) = match msg::decode_peer_challenge(m).map_err(|w| ctx.bad(Some(r), w))? {
        Ok(x) => x,
        Err(rej) => {
            return Err(peer_mismatch(
                ctx,
                r,
                format!("rank {r} refused: {}", rej.why),
            ))
        }
    };
    if !auth::ct_eq(&theirs, &sec.peer_proof(LABEL_ACCEPTOR, hello, &nonce)) {
        let at = p.addr;
        return Err(peer_mismatch(
            ctx,
            r,
            sec.bad_proof(
                &format!("the data listener of rank {r} at {at}"),
                "this rank",
            ),
        ));
    }
    let proof = sec.peer_proof(LABEL_CONNECTOR, hello, &nonce);
    ctx.send(s, Some(r), msg::encode_proof(MSG_PEER_PROOF, &proof))
}

/// Step 5 of a data connection to the lower rank `r`: its acknowledgement `m`.
fn check_ack(ctx: &Ctx<'_>, r: usize, m: &[u8]) -> Result<()> {
    match msg::decode_peer_ack(m).map_err(|w| ctx.bad(Some(r), w))? {
        Ok(()) => Ok(()),
        Err(rej) => Err(peer_mismatch(
            ctx,
            r,
            format!("rank {r} refused: {}", rej.why),
        )),
    }
}

fn peer_mismatch(ctx: &Ctx<'_>, peer: usize, what: String) -> Error {
    Error::Mismatch {
        rank: Some(ctx.rank()),
        peer: Some(peer),
        op: "bootstrap".into(),
        what,
    }
}

/// Data connections made after init, on first use (the pairs that [`rendezvous_with`]'s
/// `links` left out): the rank that needs the pair first connects to the other's data
/// listener, and both prove the job token as when the ranks connect at init; when both
/// connect at once, the higher rank's connection is kept. Never blocks on a peer:
/// [`crate::transport::Links::progress`] advances the handshakes whose next message has
/// arrived.
pub struct LazyLinks {
    cfg: Config,
    sec: Secret,
    door: Door,
    peers: Vec<PeerInfo>,
    /// Connections this rank is making to lower ranks, by rank.
    dials: Vec<Option<Dial>>,
    /// Where [`Door`] puts the higher ranks that proved themselves.
    scratch: Vec<Option<TcpStream>>,
}

/// A connection to a lower rank in the making: the hello is sent; `challenged` once this
/// rank answered the challenge (and waits for the acknowledgement).
struct Dial {
    s: TcpStream,
    hello: Vec<u8>,
    challenged: bool,
    /// The part of the peer's next message that has arrived (read without waiting, so a peer
    /// that sends half a message holds up nothing until `due`).
    got: Vec<u8>,
    /// When the peer's next message must be whole: [`HELLO_WAIT`] after the hello, and again
    /// after the answer to its challenge.
    due: Instant,
}

impl std::fmt::Debug for LazyLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyLinks")
            .field("rank", &self.cfg.rank)
            .field("door", &self.door)
            .field(
                "dialing",
                &self
                    .dials
                    .iter()
                    .enumerate()
                    .filter(|(_, d)| d.is_some())
                    .map(|(r, _)| r)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl crate::transport::Links for LazyLinks {
    fn start(&mut self, peer: usize) -> Result<()> {
        let me = self.cfg.rank;
        if peer == me || self.dials.get(peer).is_none_or(Option::is_some) {
            return Ok(());
        }
        let now = Instant::now();
        let ctx = Ctx {
            cfg: &self.cfg,
            sec: self.sec.clone(),
            deadline: now + HELLO_WAIT,
            start: now,
        };
        let (s, hello) = say_hello(&ctx, &self.peers[peer], true)?;
        tracing::debug!(rank = me, peer, "connecting on first use");
        self.dials[peer] = Some(Dial {
            s,
            hello,
            challenged: false,
            got: Vec::new(),
            due: Instant::now() + HELLO_WAIT,
        });
        self.door.dialing[peer] = true;
        Ok(())
    }

    fn progress(&mut self) -> Result<Vec<(usize, TcpStream)>> {
        let now = Instant::now();
        let ctx = Ctx {
            cfg: &self.cfg,
            sec: self.sec.clone(),
            deadline: now + HELLO_WAIT,
            start: now,
        };
        let mut done = Vec::new();
        self.door.round(&ctx, &mut self.scratch, Duration::ZERO)?;
        for (r, slot) in self.scratch.iter_mut().enumerate() {
            if let Some(s) = slot.take() {
                // A rank this one was connecting to connected first and is higher: its
                // connection is the one (it refuses this rank's as crossed).
                self.dials[r] = None;
                self.door.dialing[r] = false;
                tracing::debug!(rank = ctx.rank(), peer = r, "connected on first use");
                done.push((r, s));
            }
        }
        let ready: Vec<usize> = {
            let (which, mut fds): (Vec<usize>, Vec<PollFd<'_>>) = self
                .dials
                .iter()
                .enumerate()
                .filter_map(|(r, d)| {
                    d.as_ref()
                        .map(|d| (r, PollFd::new(d.s.as_fd(), PollFlags::POLLIN)))
                })
                .unzip();
            if fds.is_empty() {
                Vec::new()
            } else {
                match nix::poll::poll(&mut fds, PollTimeout::ZERO) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(e) => return Err(ctx.io(None, "polling connections", io::Error::from(e))),
                }
                fds.iter()
                    .zip(which)
                    .filter(|(f, _)| f.revents().is_some_and(|e| !e.is_empty()))
                    .map(|(_, r)| r)
                    .collect()
            }
        };
        for r in 0..self.dials.len() {
            let Some(mut d) = self.dials[r].take() else {
                continue;
            };
            let what = if d.challenged {
                format!("waiting for rank {r} to accept the connection")
            } else {
                format!("waiting for rank {r}'s challenge")
            };
            let pulled = if ready.contains(&r) {
                pull_message(&d.s, &mut d.got, MAX_HELLO)
            } else {
                Ok(None)
            };
            let m = match pulled {
                Ok(Some(m)) => m,
                Ok(None) if Instant::now() < d.due => {
                    self.dials[r] = Some(d);
                    continue;
                }
                Ok(None) => {
                    self.door.dialing[r] = false;
                    return Err(ctx.timeout(
                        Some(r),
                        format!("{what}: nothing whole within {HELLO_WAIT:?}"),
                    ));
                }
                Err(why) => {
                    self.door.dialing[r] = false;
                    return Err(Error::Transport {
                        rank: Some(ctx.rank()),
                        peer: Some(r),
                        op: "bootstrap".into(),
                        what: format!("{what}: {why}"),
                    });
                }
            };
            if d.challenged {
                if let Ok(Err(rej)) = msg::decode_peer_ack(&m) {
                    if rej.why == CROSSED {
                        // The higher rank's connection to this one is kept: it arrives on
                        // the listener.
                        self.door.dialing[r] = false;
                        continue;
                    }
                }
                if let Err(e) = check_ack(&ctx, r, &m) {
                    self.door.dialing[r] = false;
                    return Err(e);
                }
                // Connected. A lower rank that was connecting to this one at the same time
                // dropped its connection when this one arrived, but its proof may still be
                // on the way: it stays refused as crossed (else this rank would take a
                // second connection from it).
                self.door.dialing[r] = r < ctx.rank();
                let _ = d.s.set_read_timeout(None);
                let _ = d.s.set_write_timeout(None);
                tracing::debug!(rank = ctx.rank(), peer = r, "connected on first use");
                done.push((r, d.s));
            } else {
                answer_challenge(&ctx, &mut d.s, &self.peers[r], &d.hello, &m)?;
                d.challenged = true;
                d.due = Instant::now() + HELLO_WAIT;
                self.dials[r] = Some(d);
            }
        }
        Ok(done)
    }

    fn fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        let mut v = vec![self.door.listener.as_fd()];
        v.extend(self.door.cands.iter().map(|c| c.s.as_fd()));
        v.extend(self.dials.iter().flatten().map(|d| d.s.as_fd()));
        v
    }
}

/// [`Bootstrap::all_gather`] over the connections at distances 2^k (every one present).
fn bruck_all_gather(
    ctx: &Ctx<'_>,
    mesh: &mut [Option<TcpStream>],
    mine: &[u8],
) -> Result<Vec<Vec<u8>>> {
    let n = mesh.len();
    let r = ctx.rank();
    // held[i] is the blob of rank (r + i) mod n.
    let mut held = vec![mine.to_vec()];
    let mut d = 1;
    while d < n {
        let cnt = d.min(n - d);
        let (to, from) = ((r + n - d) % n, (r + d) % n);
        let m = msg::encode_blobs(&held[..cnt]);
        let out = mesh[to]
            .as_ref()
            .ok_or_else(|| ctx.bad(Some(to), "no connection".into()))?
            .try_clone()
            .map_err(|e| ctx.io(Some(to), "duplicating a connection", e))?;
        let src = mesh[from]
            .as_mut()
            .ok_or_else(|| ctx.bad(Some(from), "no connection".into()))?;
        // Send and receive at once: every rank sends before it receives, and a message larger
        // than the socket buffers would otherwise block every rank in its send.
        let got = std::thread::scope(|sc| {
            let sender = sc.spawn(move || {
                let mut out = out;
                ctx.send(&mut out, Some(to), m)
            });
            let got = ctx.recv(src, Some(from), "gathering init data");
            let sent = sender
                .join()
                .unwrap_or_else(|_| Err(ctx.bad(Some(to), "the sending thread failed".into())));
            sent.and(got)
        })?;
        let blobs = msg::decode_blobs(&got, cnt).map_err(|w| ctx.bad(Some(from), w))?;
        held.extend(blobs);
        d *= 2;
    }
    let mut all = vec![Vec::new(); n];
    for (i, b) in held.into_iter().enumerate().take(n) {
        all[(r + i) % n] = b;
    }
    Ok(all)
}

impl Bootstrap {
    /// Completes a partial rank table (rank 0 sent only this rank's links): every rank
    /// contributes its own entry, gathered over the data connections (Bruck).
    fn gather_table(&mut self, mesh: &mut [Option<TcpStream>]) -> Result<()> {
        let me = &self.peers[self.rank];
        let mine = format!("{}\n{}", me.addr, me.host);
        let all = self.all_gather(mesh, mine.as_bytes())?;
        for (r, b) in all.iter().enumerate() {
            if r == 0 || r == self.rank {
                // Rank 0's address as this rank reached it, and its own, stay.
                continue;
            }
            let text = String::from_utf8_lossy(b);
            let (addr, host) = text.split_once('\n').unwrap_or((&text, ""));
            let addr: SocketAddr = addr.parse().map_err(|_| Error::Transport {
                rank: Some(self.rank),
                peer: Some(r),
                op: "bootstrap".into(),
                what: format!("rank {r} gave a bad address {addr:?} for the rank table"),
            })?;
            self.peers[r] = PeerInfo {
                rank: r,
                host: host.to_string(),
                addr,
            };
        }
        Ok(())
    }

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
        let start = Instant::now();
        let ctx = Ctx {
            cfg: &self.cfg,
            sec: Secret::of(&self.cfg),
            deadline: crate::config::deadline(start, self.timeout),
            start,
        };
        let res = connect_mesh(&ctx, &mut door, &self.peers, mesh, need);
        self.door = Some(door);
        res
    }

    /// The data listener and the rank table, for connections made on first use after init
    /// (None for a world of one). Only one caller gets them.
    pub fn links(&mut self) -> Option<LazyLinks> {
        let mut door = self.door.take()?;
        door.lazy = true;
        let world = self.world;
        Some(LazyLinks {
            sec: Secret::of(&self.cfg),
            cfg: self.cfg.clone(),
            door,
            peers: self.peers.clone(),
            dials: (0..world).map(|_| None).collect(),
            scratch: (0..world).map(|_| None).collect(),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Number of ranks on this rank's host (by host name), this one included.
    pub fn local_ranks(&self) -> usize {
        let me = &self.peers[self.rank].host;
        self.peers.iter().filter(|p| &p.host == me).count()
    }

    /// Rank 0's `mine`, on every rank (rank 0 sends it to each rank once: O(n)).
    ///
    /// # Errors
    /// [`Error::Timeout`] by the configured deadline, [`Error::PeerLost`], [`Error::Io`].
    pub fn broadcast_root(&mut self, mine: &[u8]) -> Result<Vec<u8>> {
        if self.world == 1 {
            return Ok(mine.to_vec());
        }
        let start = Instant::now();
        let cfg = Config::new(self.rank, self.world, String::new());
        let ctx = Ctx {
            cfg: &cfg,
            sec: Secret::of(&cfg),
            deadline: crate::config::deadline(start, self.timeout),
            start,
        };
        if self.rank == 0 {
            for (r, slot) in self.star.iter_mut().enumerate().skip(1) {
                let s = slot
                    .as_mut()
                    .ok_or_else(|| ctx.bad(Some(r), "no connection".into()))?;
                ctx.send(s, Some(r), msg::encode_blob(mine))?;
            }
            Ok(mine.to_vec())
        } else {
            let s = self.star[0]
                .as_mut()
                .ok_or_else(|| ctx.bad(Some(0), "no connection".into()))?;
            let m = ctx.recv(s, Some(0), "waiting for rank 0's init data")?;
            msg::decode_blob(&m).map_err(|w| ctx.bad(Some(0), w))
        }
    }

    /// Gathers one blob from every rank, in rank order, over the data connections in `mesh`
    /// (the rendezvous's, as [`rendezvous_with`] returned them): Bruck's all-gather, in which
    /// at step `k` each rank sends what it holds to the rank `2^k` below it and receives from
    /// the rank `2^k` above, so every rank sends and receives n − 1 blobs in ⌈log2 n⌉ steps and
    /// rank 0 carries no more than any other. Where a needed connection is missing it goes
    /// through rank 0 instead (n² blobs out of rank 0).
    ///
    /// # Errors
    /// [`Error::Timeout`] by the configured deadline, [`Error::PeerLost`], [`Error::Io`].
    pub fn all_gather(
        &mut self,
        mesh: &mut [Option<TcpStream>],
        mine: &[u8],
    ) -> Result<Vec<Vec<u8>>> {
        if self.world == 1 {
            return Ok(vec![mine.to_vec()]);
        }
        let start = Instant::now();
        // Only the deadline and rank are read from the config here.
        let cfg = Config::new(self.rank, self.world, String::new());
        let ctx = Ctx {
            cfg: &cfg,
            sec: Secret::of(&cfg),
            deadline: crate::config::deadline(start, self.timeout),
            start,
        };
        let (n, r) = (self.world, self.rank);
        let linked = |d: usize| {
            mesh.get((r + n - d) % n).is_some_and(Option::is_some)
                && mesh.get((r + d) % n).is_some_and(Option::is_some)
        };
        let mut d = 1;
        let mut bruck = mesh.len() == n;
        while d < n {
            bruck &= linked(d);
            d *= 2;
        }
        if bruck {
            let res = bruck_all_gather(&ctx, mesh, mine);
            for s in mesh.iter().flatten() {
                let _ = s.set_read_timeout(None);
                let _ = s.set_write_timeout(None);
            }
            return res;
        }
        tracing::debug!(
            rank = r,
            "init exchange through rank 0: a connection at a power-of-two distance is missing"
        );
        if self.rank == 0 {
            let mut all = vec![mine.to_vec()];
            for r in 1..self.world {
                let s = self.star[r]
                    .as_mut()
                    .ok_or_else(|| ctx.bad(Some(r), "no connection".into()))?;
                let m = ctx.recv(s, Some(r), "gathering init data")?;
                all.push(msg::decode_blob(&m).map_err(|w| ctx.bad(Some(r), w))?);
            }
            let m = msg::encode_blobs(&all);
            for (r, slot) in self.star.iter_mut().enumerate().skip(1) {
                let s = slot
                    .as_mut()
                    .ok_or_else(|| ctx.bad(Some(r), "no connection".into()))?;
                ctx.send(s, Some(r), m.clone())?;
            }
            Ok(all)
        } else {
            let s = self.star[0]
                .as_mut()
                .ok_or_else(|| ctx.bad(Some(0), "no connection".into()))?;
            ctx.send(s, Some(0), msg::encode_blob(mine))?;
            let m = ctx.recv(s, Some(0), "waiting for everybody's init data")?;
            msg::decode_blobs(&m, self.world).map_err(|w| ctx.bad(Some(0), w))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(rank: usize, world: usize, token: &str) -> Config {
        let mut c = Config::new(rank, world, "127.0.0.1:1");
        c.timeout = Duration::from_secs(10);
        c.job_token = Some(token.into());
        c
    }

    fn mesh_of(cfg: Config, listener: TcpListener, peers: Vec<PeerInfo>) -> Result<()> {
        let start = Instant::now();
        let ctx = Ctx {
            cfg: &cfg,
            sec: Secret::of(&cfg),
            deadline: start + cfg.timeout,
            start,
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| ctx.io(None, "listener", e))?;
        let mut door = Door::new(listener, cfg.world_size);
        let mut mesh: Vec<Option<TcpStream>> = (0..cfg.world_size).map(|_| None).collect();
        connect_mesh(&ctx, &mut door, &peers, &mut mesh, &|_| true)
    }

    fn peer(rank: usize, addr: SocketAddr) -> PeerInfo {
        PeerInfo {
            rank,
            host: "h".into(),
            addr,
        }
    }

    fn send(s: &mut TcpStream, m: &Msg) {
        s.write_all(&(m.0.len() as u32).to_le_bytes()).unwrap();
        s.write_all(&m.0).unwrap();
    }

    fn recv(s: &mut TcpStream) -> Vec<u8> {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        let mut m = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut m).unwrap();
        m
    }

    /// Connects to a data listener at `addr` as rank `from` of a job of `world` ranks with
    /// `token`, meaning to reach rank `to`; returns the connection, its hello and the nonce
    /// of the challenge it got.
    fn connect_as(
        addr: SocketAddr,
        token: &str,
        world: u32,
        from: u32,
        to: u32,
    ) -> (TcpStream, Secret, Msg, auth::Nonce) {
        let sec = Secret::of(&config(from as usize, world as usize, token));
        let mut s = TcpStream::connect(addr).unwrap();
        let hello = PeerHello {
            job: sec.job,
            world,
            from,
            to,
            token: true,
            nonce: auth::nonce().unwrap(),
        }
        .encode();
        send(&mut s, &hello);
        let (nonce, _) = msg::decode_peer_challenge(&recv(&mut s)).unwrap().unwrap();
        (s, sec, hello, nonce)
    }

    /// Rank 0 of 2 accepts a data connection that claims to be rank 1 and answers the
    /// challenge with `proof(secret of the impostor, hello, the challenge's nonce)`. Returns
    /// rank 0's result (the real rank 1 never comes: a timeout, after 1.5 s), the reply to
    /// the proof, and where the impostor connected from.
    fn impostor_connects(
        token: &str,
        proof: impl Fn(&Secret, &[u8], &auth::Nonce) -> msg::Tag,
    ) -> (Result<()>, Vec<u8>, SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let peers = vec![peer(0, addr), peer(1, addr)];
        let mut c = config(0, 2, "a");
        c.timeout = Duration::from_millis(1500);
        let acceptor = std::thread::spawn(move || mesh_of(c, listener, peers));
        let (mut s, sec, hello, nonce) = connect_as(addr, token, 2, 1, 0);
        send(
            &mut s,
            &msg::encode_proof(MSG_PEER_PROOF, &proof(&sec, &hello.0, &nonce)),
        );
        let reply = recv(&mut s);
        let me = s.local_addr().unwrap();
        (acceptor.join().unwrap(), reply, me)
    }

    /// A connection whose proof does not verify is refused with the reason, and rank 0 keeps
    /// waiting for the real rank 1: a stranger's claims fail nothing (the deadline names it).
    #[test]
    fn a_data_connection_with_another_token_is_refused_on_both_ends() {
        let (res, reply, from) = impostor_connects("b", |sec, hello, nonce| {
            sec.peer_proof(LABEL_CONNECTOR, hello, nonce)
        });
        let e = res.unwrap_err();
        let s = e.to_string();
        assert!(
            matches!(e, Error::Timeout { peer: Some(1), .. })
                && s.contains("did not prove that it knows the job token")
                && s.contains(&format!("refused: {from} (claims rank 1 for rank 0)")),
            "{s}"
        );
        let rej = msg::decode_peer_ack(&reply).unwrap().unwrap_err();
        assert!(rej.why.contains("DSPARK_JOB_TOKEN differs"), "{}", rej.why);
    }

    /// A stranger that sends half a hello and then nothing holds up nobody: the real rank
    /// that connects after it is accepted and proved within a deadline shorter than the hello
    /// wait. (The door used to read a ready candidate's message with a blocking read, so the
    /// half hello stalled the rank for up to [`HELLO_WAIT`], inside a collective after init.)
    #[test]
    fn a_strangers_half_hello_holds_up_nobody() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let peers = vec![peer(0, addr), peer(1, addr)];
        let mut c = config(0, 2, "a");
        c.timeout = HELLO_WAIT / 2;
        let acceptor = std::thread::spawn(move || mesh_of(c, listener, peers));
        let mut stranger = TcpStream::connect(addr).unwrap();
        // A length prefix of 100 bytes, and 10 of them.
        stranger.write_all(&100u32.to_le_bytes()).unwrap();
        stranger.write_all(&[7u8; 10]).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let (mut s, sec, hello, nonce) = connect_as(addr, "a", 2, 1, 0);
        let proof = sec.peer_proof(LABEL_CONNECTOR, &hello.0, &nonce);
        send(&mut s, &msg::encode_proof(MSG_PEER_PROOF, &proof));
        assert!(msg::decode_peer_ack(&recv(&mut s)).unwrap().is_ok());
        acceptor.join().unwrap().unwrap();
        drop(stranger);
    }

    /// The dialling side of a connection on first use: a peer that accepts, reads the hello
    /// and sends half a challenge holds up no `progress` call (each returns at once, so the
    /// caller's collective goes on), and fails the connection naming it once the hello wait
    /// is over. (The dialling side used to read a ready peer's message with a blocking read
    /// bounded by [`HELLO_WAIT`].)
    #[test]
    fn a_peer_that_sends_half_a_challenge_holds_up_no_progress_call() {
        use crate::transport::Links;
        let fake = TcpListener::bind("127.0.0.1:0").unwrap();
        let fake_addr = fake.local_addr().unwrap();
        let half = std::thread::spawn(move || {
            let (mut s, _) = fake.accept().unwrap();
            let _hello = recv(&mut s);
            s.write_all(&100u32.to_le_bytes()).unwrap();
            s.write_all(&[7u8; 10]).unwrap();
            // Hold the connection open until the dialling side gives up.
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        });
        let own = TcpListener::bind("127.0.0.1:0").unwrap();
        let own_addr = own.local_addr().unwrap();
        own.set_nonblocking(true).unwrap();
        let cfg = config(1, 2, "a");
        let mut door = Door::new(own, 2);
        door.lazy = true;
        let mut links = LazyLinks {
            sec: Secret::of(&cfg),
            cfg,
            door,
            peers: vec![peer(0, fake_addr), peer(1, own_addr)],
            dials: (0..2).map(|_| None).collect(),
            scratch: (0..2).map(|_| None).collect(),
        };
        let t0 = Instant::now();
        links.start(0).unwrap();
        let mut slowest = Duration::ZERO;
        let e = loop {
            let t = Instant::now();
            let r = links.progress();
            slowest = slowest.max(t.elapsed());
            match r {
                Ok(done) => assert!(done.is_empty(), "connected to a fake rank 0"),
                Err(e) => break e,
            }
            assert!(t0.elapsed() < HELLO_WAIT * 3, "never gave up");
            std::thread::sleep(Duration::from_millis(10));
        };
        let text = e.to_string();
        assert!(
            matches!(e, Error::Timeout { peer: Some(0), .. })
                && text.contains("waiting for rank 0's challenge"),
            "{text}"
        );
        assert!(
            t0.elapsed() >= HELLO_WAIT,
            "gave up after {:?}",
            t0.elapsed()
        );
        assert!(
            slowest < Duration::from_millis(500),
            "a progress call took {slowest:?}"
        );
        drop(links);
        half.join().unwrap();
    }

    /// A rank of this job (it proves the token) that connects for another rank is confused,
    /// not a stranger: that fails the init, on both ends, with both named.
    #[test]
    fn a_proven_data_connection_for_another_rank_is_a_mismatch() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let peers = vec![peer(0, addr), peer(1, addr)];
        let acceptor = std::thread::spawn(move || mesh_of(config(0, 2, "a"), listener, peers));
        let (mut s, sec, hello, nonce) = connect_as(addr, "a", 2, 1, 5);
        let proof = sec.peer_proof(LABEL_CONNECTOR, &hello.0, &nonce);
        send(&mut s, &msg::encode_proof(MSG_PEER_PROOF, &proof));
        let rej = msg::decode_peer_ack(&recv(&mut s)).unwrap().unwrap_err();
        let e = acceptor.join().unwrap().unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e, Error::Mismatch { peer: Some(1), .. })
                && text.contains("connected to rank 0 for rank 5"),
            "{text}"
        );
        assert!(rej.why.contains("for rank 5"), "{}", rej.why);
    }

    /// Two connections that both prove the token for rank 1: the same rank twice, which
    /// fails the init naming both addresses.
    #[test]
    fn the_same_rank_proven_twice_on_a_data_listener_is_a_mismatch() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let peers = vec![peer(0, addr), peer(1, addr), peer(2, addr)];
        let acceptor = std::thread::spawn(move || mesh_of(config(0, 3, "a"), listener, peers));
        let mut twice = Vec::new();
        for _ in 0..2 {
            let (mut s, sec, hello, nonce) = connect_as(addr, "a", 3, 1, 0);
            let proof = sec.peer_proof(LABEL_CONNECTOR, &hello.0, &nonce);
            send(&mut s, &msg::encode_proof(MSG_PEER_PROOF, &proof));
            let ack = msg::decode_peer_ack(&recv(&mut s)).unwrap();
            twice.push((s.local_addr().unwrap(), ack));
        }
        assert!(
            twice[0].1.is_ok(),
            "the first one is rank 1: {:?}",
            twice[0].1
        );
        assert!(twice[1].1.is_err(), "the second one is refused");
        let e = acceptor.join().unwrap().unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e, Error::Mismatch { peer: Some(1), .. })
                && text.contains(&format!(
                    "rank 1 connected twice to rank 0: from {} and earlier from {}",
                    twice[1].0, twice[0].0
                )),
            "{text}"
        );
    }

    /// The right token, but a proof over another nonce: what replaying a recorded data
    /// connection's answer amounts to.
    #[test]
    fn a_replayed_proof_on_a_data_connection_is_refused() {
        let (res, reply, _) = impostor_connects("a", |sec, hello, _| {
            sec.peer_proof(LABEL_CONNECTOR, hello, &[7; auth::TAG_LEN])
        });
        assert!(res.unwrap_err().to_string().contains("did not prove"));
        assert!(msg::decode_peer_ack(&reply).unwrap().is_err());
        // And the acceptor's own proof is no answer either (the labels differ).
        let (res, _, _) = impostor_connects("a", |sec, hello, nonce| {
            sec.peer_proof(LABEL_ACCEPTOR, hello, nonce)
        });
        assert!(res.unwrap_err().to_string().contains("did not prove"));
    }

    #[test]
    fn a_data_listener_that_cannot_prove_the_token_is_refused() {
        let fake = TcpListener::bind("127.0.0.1:0").unwrap();
        let fake_addr = fake.local_addr().unwrap();
        let own = TcpListener::bind("127.0.0.1:0").unwrap();
        let own_addr = own.local_addr().unwrap();
        let peers = vec![peer(0, fake_addr), peer(1, own_addr)];
        let connector = std::thread::spawn(move || mesh_of(config(1, 2, "a"), own, peers));
        let (mut s, _) = fake.accept().unwrap();
        let hello = recv(&mut s);
        assert!(PeerHello::decode(&hello).is_ok());
        let sec = Secret::of(&config(0, 2, "b"));
        let nonce = auth::nonce().unwrap();
        let tag = sec.peer_proof(LABEL_ACCEPTOR, &hello, &nonce);
        send(&mut s, &msg::encode_peer_challenge(&nonce, &tag));
        let e = connector.join().unwrap().unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e, Error::Mismatch { peer: Some(0), .. })
                && text.contains(&format!("the data listener of rank 0 at {fake_addr}"))
                && text.contains("did not prove"),
            "{text}"
        );
    }
}
