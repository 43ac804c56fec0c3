//! TCP rendezvous: how ranks find each other.
//!
//! 1. Rank 0 listens on the root address; every other rank connects to it, retrying until the
//!    deadline, and sends a hello: magic number, protocol version, world size, rank, job
//!    identity (a hash of `DSPARK_JOB_TOKEN` and the launcher's job id), the address of its
//!    own data listener and its host name.
//! 2. Rank 0 checks every hello. A connection that is not a dspark rank of this protocol, or
//!    of another job, is refused with a reason (the refused side fails with that reason; rank
//!    0 logs it and keeps waiting for the right rank). Disagreement inside the job — another
//!    world size, the same rank twice — fails the whole rendezvous with an error naming both.
//! 3. Rank 0 sends everybody the table of data addresses; every rank connects to the ranks
//!    below it and accepts the ranks above it (each connection opens with its own checked
//!    hello), giving one TCP connection per pair of ranks.
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

/// Magic number opening every bootstrap message.
pub const MAGIC: u64 = 0x6473_7061_726b_0001; // "dspark" + 1
/// Bootstrap / wire protocol version.
pub const VERSION: u32 = 1;

const MSG_HELLO: u8 = 1;
const MSG_WELCOME: u8 = 2;
const MSG_REJECT: u8 = 3;
const MSG_PEER_HELLO: u8 = 4;
const MSG_PEER_ACK: u8 = 5;
const MSG_BLOB: u8 = 6;

const REJECT_MISMATCH: u8 = 1;
const REJECT_CONFIG: u8 = 2;

const MAX_MSG: usize = 64 << 20;

/// The largest hello (a few numbers and a host name): what an unvalidated connection may
/// make this rank allocate, so a port scanner or a stray client costs no memory.
const MAX_HELLO: usize = 64 << 10;

/// How long an accepted connection may take to say hello: a stray client that connects and
/// stays silent (a port scanner, a health check, a wedged leftover) must not hold the
/// rendezvous for the whole deadline.
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
}

/// Little-endian message builder.
#[derive(Default)]
struct Msg(Vec<u8>);

impl Msg {
    fn new(kind: u8) -> Self {
        let mut m = Msg(Vec::with_capacity(64));
        m.0.push(kind);
        m
    }
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u16(mut self, v: u16) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(&(b.len() as u32).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }
    fn str(self, s: &str) -> Self {
        self.bytes(s.as_bytes())
    }
}

/// Little-endian message reader; every getter fails cleanly on a short message.
struct Rd<'a>(&'a [u8]);

impl Rd<'_> {
    fn take(&mut self, n: usize) -> std::result::Result<&[u8], String> {
        if self.0.len() < n {
            return Err("truncated bootstrap message".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> std::result::Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> std::result::Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> std::result::Result<u64, String> {
        let b = self.take(8)?;
        let mut w = [0u8; 8];
        w.copy_from_slice(b);
        Ok(u64::from_le_bytes(w))
    }
    fn bytes(&mut self) -> std::result::Result<Vec<u8>, String> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn str(&mut self) -> std::result::Result<String, String> {
        String::from_utf8(self.bytes()?).map_err(|_| "bad string in bootstrap message".into())
    }
}

struct Hello {
    magic: u64,
    version: u32,
    world: u32,
    rank: u32,
    job: u64,
    data_port: u16,
    host: String,
    segment: u64,
}

struct Ctx<'a> {
    cfg: &'a Config,
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
    rendezvous_with(cfg, None)
}

/// [`rendezvous`], where rank 0 accepts the other ranks on `root` — a listener it bound
/// itself, typically on an ephemeral port whose address it published through a key-value
/// store or a parent communicator — instead of binding `cfg.root_addr`. The other ranks
/// connect to `cfg.root_addr` as usual.
///
/// # Errors
/// As [`rendezvous`].
pub fn rendezvous_with(
    cfg: &Config,
    root: Option<TcpListener>,
) -> Result<(Bootstrap, Vec<Option<TcpStream>>)> {
    cfg.validate()?;
    let start = Instant::now();
    let ctx = Ctx {
        cfg,
        deadline: crate::config::deadline(start, cfg.timeout),
        start,
    };
    let host = hostname();
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
        root_rendezvous(&ctx, &host, data_port, iface_ip, root)?
    } else {
        leaf_rendezvous(&ctx, &host, data_port, iface_ip)?
    };
    let mesh = connect_mesh(&ctx, &data_listener, &peers)?;
    Ok((
        Bootstrap {
            rank: cfg.rank,
            world: cfg.world_size,
            timeout: cfg.timeout,
            star,
            peers,
        },
        mesh,
    ))
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
    root_accept(ctx, host, data_port, iface, listener, bind_addr, world)
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

/// Rank 0's side of the rendezvous on `listener`.
fn root_accept(
    ctx: &Ctx<'_>,
    host: &str,
    data_port: u16,
    iface: Option<IpAddr>,
    listener: TcpListener,
    bind_addr: SocketAddr,
    world: usize,
) -> Result<Star> {
    let cfg = ctx.cfg;
    tracing::debug!(%bind_addr, world, "rank 0 waiting for the other ranks");

    let mut star: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut info: Vec<Option<(String, u16, IpAddr)>> = vec![None; world];
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
        // A stray connection must not eat the whole deadline.
        let hello = match ctx.recv_within(&mut s, None, "reading a hello", HELLO_WAIT, MAX_HELLO) {
            Ok(m) => m,
            Err(e) => {
                refused.push(format!("{from}: {e}"));
                continue;
            }
        };
        let h = match parse_hello(&hello) {
            Ok(h) => h,
            Err(w) => {
                refused.push(format!("{from}: {w}"));
                tracing::warn!(%from, "refused a bootstrap connection: {w}");
                continue;
            }
        };
        let reject = |s: &mut TcpStream, class: u8, var: &str, why: &str| {
            let _ = ctx.send(s, None, Msg::new(MSG_REJECT).u8(class).str(var).str(why));
        };
        if h.magic != MAGIC {
            refused.push(format!("{from}: not a dspark rank (bad magic)"));
            continue;
        }
        if h.version != VERSION {
            let why = format!(
                "protocol version {} but rank 0 runs version {VERSION} (mixed dspark builds?)",
                h.version
            );
            reject(&mut s, REJECT_MISMATCH, "", &why);
            tracing::warn!(%from, "refused: {why}");
            refused.push(format!("{from}: {why}"));
            continue;
        }
        if h.job != cfg.job_hash() {
            let why = "job identity differs from rank 0's (DSPARK_JOB_TOKEN or the launcher's job \
                       id do not match: a rank of another job?)"
                .to_string();
            reject(&mut s, REJECT_MISMATCH, "", &why);
            tracing::warn!(%from, "refused: {why}");
            refused.push(format!("{from} (claims rank {}): {why}", h.rank));
            continue;
        }
        let r = h.rank as usize;
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
                .map_or("this process".to_string(), |(hn, _, ip)| {
                    format!("{hn} ({ip})")
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
        let peer_ip = from.ip();
        info[r] = Some((h.host, h.data_port, peer_ip));
        star[r] = Some(s);
        joined += 1;
    }
    // The table, as each peer should see it: rank 0's address is the one that peer reached.
    let mut peers = Vec::with_capacity(world);
    for (r, joined) in info.into_iter().enumerate() {
        let (hn, port, ip) = match joined {
            _ if r == 0 => (
                host.to_string(),
                data_port,
                iface.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            ),
            Some(x) => x,
            None => return Err(ctx.bad(Some(r), "rank missing from the table".into())),
        };
        peers.push(PeerInfo {
            rank: r,
            host: hn,
            addr: SocketAddr::new(ip, port),
        });
    }
    for (r, slot) in star.iter_mut().enumerate().skip(1) {
        let Some(s) = slot.as_mut() else {
            return Err(ctx.bad(Some(r), "no connection to this rank".into()));
        };
        let my_ip = iface.unwrap_or_else(|| {
            s.local_addr()
                .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |a| a.ip())
        });
        let mut m = Msg::new(MSG_WELCOME).u32(world as u32);
        for p in &peers {
            let ip = if p.rank == 0 { my_ip } else { p.addr.ip() };
            m = m
                .u32(p.rank as u32)
                .str(&ip.to_string())
                .u16(p.addr.port())
                .str(&p.host);
        }
        ctx.send(s, Some(r), m)?;
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
    for s in star.iter_mut().flatten() {
        let _ = ctx.send(s, None, Msg::new(MSG_REJECT).u8(class).str(var).str(why));
    }
}

fn parse_hello(m: &[u8]) -> std::result::Result<Hello, String> {
    let mut r = Rd(m);
    if r.u8()? != MSG_HELLO {
        return Err("expected a hello".into());
    }
    Ok(Hello {
        magic: r.u64()?,
        version: r.u32()?,
        world: r.u32()?,
        rank: r.u32()?,
        job: r.u64()?,
        data_port: r.u16()?,
        host: r.str()?,
        segment: r.u64()?,
    })
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
    let hello = Msg::new(MSG_HELLO)
        .u64(MAGIC)
        .u32(VERSION)
        .u32(world as u32)
        .u32(cfg.rank as u32)
        .u64(cfg.job_hash())
        .u16(data_port)
        .str(host)
        .u64(cfg.segment_bytes as u64);
    ctx.send(&mut s, Some(0), hello)?;
    let reply = ctx.recv(&mut s, Some(0), "waiting for rank 0 to admit this rank")?;
    let mut rd = Rd(&reply);
    match rd.u8().map_err(|w| ctx.bad(Some(0), w))? {
        MSG_WELCOME => {}
        MSG_REJECT => {
            let class = rd.u8().unwrap_or(0);
            let var = rd.str().unwrap_or_default();
            let why = rd.str().unwrap_or_else(|_| "no reason given".into());
            let what = format!("rank 0 refused this rank: {why}");
            return Err(if class == REJECT_CONFIG {
                Error::config(var, what)
            } else {
                Error::Mismatch {
                    rank: Some(cfg.rank),
                    peer: Some(0),
                    op: "bootstrap".into(),
                    what,
                }
            });
        }
        k => return Err(ctx.bad(Some(0), format!("unexpected bootstrap message {k}"))),
    }
    let n = rd.u32().map_err(|w| ctx.bad(Some(0), w))? as usize;
    if n != world {
        return Err(ctx.bad(
            Some(0),
            format!("rank table has {n} entries, world size is {world}"),
        ));
    }
    let mut peers = Vec::with_capacity(world);
    for i in 0..world {
        let r = rd.u32().map_err(|w| ctx.bad(Some(0), w))? as usize;
        if r != i {
            return Err(ctx.bad(Some(0), format!("rank table entry {i} is for rank {r}")));
        }
        let ip: IpAddr = rd
            .str()
            .map_err(|w| ctx.bad(Some(0), w))?
            .parse()
            .map_err(|_| ctx.bad(Some(0), "bad address in rank table".into()))?;
        let port = rd.u16().map_err(|w| ctx.bad(Some(0), w))?;
        let hn = rd.str().map_err(|w| ctx.bad(Some(0), w))?;
        peers.push(PeerInfo {
            rank: r,
            host: hn,
            addr: SocketAddr::new(ip, port),
        });
    }
    // Our own entry: rank 0 recorded the address it saw us connect from.
    let me = cfg.rank;
    if let Some(ip) = iface {
        peers[me].addr = SocketAddr::new(ip, data_port);
    }
    let mut star: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    star[0] = Some(s);
    Ok((star, peers))
}

fn connect_mesh(
    ctx: &Ctx<'_>,
    listener: &TcpListener,
    peers: &[PeerInfo],
) -> Result<Vec<Option<TcpStream>>> {
    let cfg = ctx.cfg;
    let world = cfg.world_size;
    let me = cfg.rank;
    let mut mesh: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let peer_hello = |to: usize| {
        Msg::new(MSG_PEER_HELLO)
            .u64(MAGIC)
            .u32(VERSION)
            .u64(cfg.job_hash())
            .u32(world as u32)
            .u32(me as u32)
            .u32(to as u32)
    };
    // 1. Connect to every lower rank and say hello (acks are read after accepting).
    for p in peers.iter().take(me) {
        let mut s = loop {
            let rem = ctx.remaining().ok_or_else(|| {
                ctx.timeout(
                    Some(p.rank),
                    format!("connecting to rank {} at {}", p.rank, p.addr),
                )
            })?;
            match TcpStream::connect_timeout(&p.addr, rem.min(Duration::from_secs(5))) {
                Ok(s) => break s,
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    std::thread::sleep(Duration::from_millis(20));
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
        ctx.send(&mut s, Some(p.rank), peer_hello(p.rank))?;
        mesh[p.rank] = Some(s);
    }
    // 2. Accept every higher rank.
    listener
        .set_nonblocking(true)
        .map_err(|e| ctx.io(None, "listener", e))?;
    let mut pending = world - me - 1;
    while pending > 0 {
        let (mut s, from) = accept_until(ctx, listener).map_err(|e| match e {
            Error::Timeout { .. } => {
                let missing: Vec<String> = (me + 1..world)
                    .filter(|&r| mesh[r].is_none())
                    .map(|r| r.to_string())
                    .collect();
                ctx.timeout(
                    missing.first().and_then(|m| m.parse().ok()),
                    format!("waiting for rank(s) {} to connect", missing.join(", ")),
                )
            }
            e => e,
        })?;
        let _ = s.set_nonblocking(false);
        let _ = s.set_nodelay(true);
        let m = match ctx.recv_within(&mut s, None, "reading a peer hello", HELLO_WAIT, MAX_HELLO) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(%from, "dropped a data connection: {e}");
                continue;
            }
        };
        let parsed = (|| -> std::result::Result<(u64, u32, u64, u32, u32, u32), String> {
            let mut r = Rd(&m);
            if r.u8()? != MSG_PEER_HELLO {
                return Err("not a peer hello".into());
            }
            Ok((r.u64()?, r.u32()?, r.u64()?, r.u32()?, r.u32()?, r.u32()?))
        })();
        let Ok((magic, version, job, w, from_rank, to)) = parsed else {
            tracing::warn!(%from, "dropped a data connection: not a dspark peer");
            continue;
        };
        let from_rank = from_rank as usize;
        if magic != MAGIC || version != VERSION || job != cfg.job_hash() || w as usize != world {
            tracing::warn!(%from, "dropped a data connection from another job or version");
            continue;
        }
        if to as usize != me || from_rank <= me || from_rank >= world || mesh[from_rank].is_some() {
            return Err(Error::Mismatch {
                rank: Some(me),
                peer: Some(from_rank),
                op: "bootstrap".into(),
                what: format!(
                    "rank {from_rank} at {from} connected for rank {to} (duplicate or confused rank)"
                ),
            });
        }
        ctx.send(&mut s, Some(from_rank), Msg::new(MSG_PEER_ACK))?;
        mesh[from_rank] = Some(s);
        pending -= 1;
    }
    // 3. Read the acks of the lower ranks.
    for (r, slot) in mesh.iter_mut().enumerate().take(me) {
        let Some(s) = slot.as_mut() else {
            return Err(ctx.bad(Some(r), "no connection to this rank".into()));
        };
        let m = ctx.recv(
            s,
            Some(r),
            &format!("waiting for rank {r} to accept the connection"),
        )?;
        if m.first() != Some(&MSG_PEER_ACK) {
            return Err(ctx.bad(Some(r), "peer did not acknowledge the connection".into()));
        }
    }
    for s in mesh.iter().flatten() {
        let _ = s.set_read_timeout(None);
        let _ = s.set_write_timeout(None);
    }
    Ok(mesh)
}

impl Bootstrap {
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

    /// Gathers one blob from every rank, through rank 0, in rank order.
    ///
    /// # Errors
    /// [`Error::Timeout`] by the configured deadline, [`Error::PeerLost`], [`Error::Io`].
    pub fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        if self.world == 1 {
            return Ok(vec![mine.to_vec()]);
        }
        let start = Instant::now();
        // Only the deadline and rank are read from the config here.
        let cfg = Config::new(self.rank, self.world, String::new());
        let ctx = Ctx {
            cfg: &cfg,
            deadline: crate::config::deadline(start, self.timeout),
            start,
        };
        if self.rank == 0 {
            let mut all = vec![mine.to_vec()];
            for r in 1..self.world {
                let s = self.star[r]
                    .as_mut()
                    .ok_or_else(|| ctx.bad(Some(r), "no connection".into()))?;
                let m = ctx.recv(s, Some(r), "gathering init data")?;
                let mut rd = Rd(&m);
                if rd.u8().ok() != Some(MSG_BLOB) {
                    return Err(ctx.bad(Some(r), "expected a blob".into()));
                }
                all.push(rd.bytes().map_err(|w| ctx.bad(Some(r), w))?);
            }
            for (r, slot) in self.star.iter_mut().enumerate().skip(1) {
                let mut m = Msg::new(MSG_BLOB).u32(self.world as u32);
                for b in &all {
                    m = m.bytes(b);
                }
                let s = slot
                    .as_mut()
                    .ok_or_else(|| ctx.bad(Some(r), "no connection".into()))?;
                ctx.send(s, Some(r), m)?;
            }
            Ok(all)
        } else {
            let s = self.star[0]
                .as_mut()
                .ok_or_else(|| ctx.bad(Some(0), "no connection".into()))?;
            ctx.send(s, Some(0), Msg::new(MSG_BLOB).bytes(mine))?;
            let m = ctx.recv(s, Some(0), "waiting for everybody's init data")?;
            let mut rd = Rd(&m);
            if rd.u8().ok() != Some(MSG_BLOB) {
                return Err(ctx.bad(Some(0), "expected a blob".into()));
            }
            let n = rd.u32().map_err(|w| ctx.bad(Some(0), w))? as usize;
            if n != self.world {
                return Err(ctx.bad(Some(0), format!("{n} blobs for {} ranks", self.world)));
            }
            (0..n)
                .map(|_| rd.bytes().map_err(|w| ctx.bad(Some(0), w)))
                .collect()
        }
    }
}
