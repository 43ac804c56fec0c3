//! Rank 0's side of the rendezvous (steps 1 to 3 of the [module docs](super)): binding the
//! root address, accepting the other ranks, checking each hello and proof, and sending every
//! rank its rank table with rank 0's own proof.
//!
//! A connection that does not prove the job token (a stranger, a port scanner, a rank of
//! another job or version) is refused with its reason and rank 0 keeps waiting; only a rank
//! that proved the token and does not fit this job (another world size or segment size, a
//! rank twice) fails the rendezvous, on every rank that joined so far.

#![forbid(unsafe_code)]

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;

use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::auth::{self, Nonce};
use super::msg::{self, HelloError, Reject, Reply, MSG_PROOF, REJECT_CONFIG, REJECT_MISMATCH};
use super::net::{is_local_ip, resolve};
use super::{describe, fresh_nonce, Ctx, PeerInfo, Star, HELLO_WAIT, MAX_HELLO};
use crate::error::{Error, Result};

/// Rank 0's rendezvous: on `pre_bound` when given, else on the configured root address.
/// `host`, `data_port` and `iface` are rank 0's own entry of the table.
pub(super) fn root_rendezvous(
    ctx: &Ctx<'_>,
    host: &str,
    data_port: u16,
    iface: Option<IpAddr>,
    pre_bound: Option<TcpListener>,
    links: Option<&dyn Fn(usize) -> Vec<usize>>,
) -> Result<Star> {
    let world = ctx.opts.world;
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
    let opts = ctx.opts;
    let (rhost, port) = (&opts.root.0, opts.root.1);
    let resolved = resolve(rhost, port).unwrap_or_default();
    let bind_addr = resolved
        .iter()
        .find(|a| is_local_ip(a.ip()))
        .copied()
        .unwrap_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port));
    let listener = TcpListener::bind(bind_addr).map_err(|e| {
        if e.kind() == io::ErrorKind::AddrInUse {
            Error::config(
                opts.root_source.clone(),
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

/// What rank 0 keeps of each rank that joined.
struct Joined {
    host: String,
    data_port: u16,
    ip: IpAddr,
    /// Its hello and the nonce rank 0 challenged it with: rank 0's proof in the welcome
    /// covers both.
    hello: Vec<u8>,
    nonce0: Nonce,
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
    tracing::debug!(%bind_addr, world, "rank 0 waiting for the other ranks");
    let mut lobby = Lobby {
        star: (0..world).map(|_| None).collect(),
        info: (0..world).map(|_| None).collect(),
        refused: Vec::new(),
        joined: 1,
    };
    while lobby.joined < world {
        let (s, from) = match accept_until(ctx, &listener) {
            Ok(x) => x,
            Err(Error::Timeout { .. }) => return Err(lobby.timeout(ctx, bind_addr)),
            Err(e) => return Err(e),
        };
        lobby.take(ctx, s, from)?;
    }
    let Lobby { mut star, info, .. } = lobby;
    let mut peers = table(ctx, (host, data_port, iface), &info)?;
    send_tables(ctx, &mut star, &info, &peers, (data_port, iface), links)?;
    if let Some(s) = star[1].as_ref() {
        if iface.is_none() {
            if let Ok(a) = s.local_addr() {
                peers[0].addr = SocketAddr::new(a.ip(), data_port);
            }
        }
    }
    Ok((star, peers))
}

/// The ranks that joined rank 0 so far, and the connections it refused meanwhile.
struct Lobby {
    /// The connection to each rank that joined (`None` at rank 0 and for those missing).
    star: Vec<Option<TcpStream>>,
    info: Vec<Option<Joined>>,
    /// What was refused, and why (for the error if the deadline passes).
    refused: Vec<String>,
    /// Ranks joined, rank 0 included.
    joined: usize,
}

impl Lobby {
    /// The deadline passed: which ranks are missing, and what was refused meanwhile.
    fn timeout(&self, ctx: &Ctx<'_>, bind_addr: SocketAddr) -> Error {
        let (joined, world) = (self.joined, self.star.len());
        let missing: Vec<String> = (1..world)
            .filter(|&r| self.star[r].is_none())
            .map(|r| r.to_string())
            .collect();
        let mut detail = format!(
            "{joined} of {world} ranks joined at {bind_addr}; missing rank(s) {}",
            missing.join(", ")
        );
        if !self.refused.is_empty() {
            detail += &format!("; refused: {}", self.refused.join("; "));
        }
        ctx.timeout(missing.first().and_then(|m| m.parse().ok()), detail)
    }

    /// One connection to the rendezvous listener: it joins once it said a hello of this job
    /// and proved the job token, and fits; one that does not prove the token is refused (the
    /// wait goes on); one that proved it and does not fit fails the rendezvous.
    fn take(&mut self, ctx: &Ctx<'_>, mut s: TcpStream, from: SocketAddr) -> Result<()> {
        let _ = s.set_nodelay(true);
        let _ = s.set_nonblocking(false);
        let Some((hello, h)) = self.hello(ctx, &mut s, from) else {
            return Ok(());
        };
        let Some(nonce0) = self.challenge(ctx, &mut s, from, &hello, h.rank as usize)? else {
            return Ok(());
        };
        self.admit(ctx, s, from, h, (hello, nonce0))
    }

    /// Refuses a connection that claims rank `r` with `why`, telling it why.
    fn refuse(
        &mut self,
        ctx: &Ctx<'_>,
        s: &mut TcpStream,
        from: SocketAddr,
        r: usize,
        why: String,
    ) {
        send_reject(ctx, s, REJECT_MISMATCH, "", &why);
        tracing::warn!(%from, "refused: {why}");
        self.refused
            .push(format!("{from} (claims rank {r}): {why}"));
    }

    /// Reads the hello of a new connection and checks that it comes from a rank of this job
    /// and protocol (`None`: refused, the reason recorded).
    fn hello(
        &mut self,
        ctx: &Ctx<'_>,
        s: &mut TcpStream,
        from: SocketAddr,
    ) -> Option<(Vec<u8>, msg::Hello)> {
        let sec = ctx.sec();
        // A stray connection must not eat the whole deadline.
        let hello = match ctx.recv_within(s, None, "reading a hello", HELLO_WAIT, MAX_HELLO) {
            Ok(m) => m,
            Err(e) => {
                self.refused.push(format!("{from}: {e}"));
                return None;
            }
        };
        let h = match msg::Hello::decode(&hello) {
            Ok(h) => h,
            Err(e) => {
                let why = describe(&e);
                if !matches!(e, HelloError::Foreign(_)) {
                    // A dspark rank of another version, or a broken one: it hears why.
                    send_reject(
                        ctx,
                        s,
                        REJECT_MISMATCH,
                        "",
                        &why.replace("this rank", "rank 0"),
                    );
                }
                tracing::warn!(%from, "refused a bootstrap connection: {why}");
                self.refused
                    .push(format!("{from}: {}", why.replace("this rank", "rank 0")));
                return None;
            }
        };
        let r = h.rank as usize;
        if h.job != sec.job {
            self.refuse(
                ctx,
                s,
                from,
                r,
                "the launcher's job id (SLURM_JOB_ID or TORCHELASTIC_RUN_ID) differs from rank \
                 0's: a rank of another job?"
                    .into(),
            );
            return None;
        }
        if h.token != sec.token {
            let why = sec.token_disagreement("rank 0", &format!("rank {r}"));
            self.refuse(ctx, s, from, r, why);
            return None;
        }
        Some((hello, h))
    }

    /// The challenge: the rank that claims rank `r` proves the token over a nonce of rank
    /// 0's, so that a recorded handshake proves nothing. Nothing it claims is acted on before
    /// that. Returns the nonce once the proof verified (`None`: refused, the reason recorded).
    fn challenge(
        &mut self,
        ctx: &Ctx<'_>,
        s: &mut TcpStream,
        from: SocketAddr,
        hello: &[u8],
        r: usize,
    ) -> Result<Option<Nonce>> {
        let sec = ctx.sec();
        let nonce0 = fresh_nonce(ctx)?;
        if let Err(e) = ctx.send(s, None, Reply::encode_challenge(&nonce0)) {
            self.refused.push(format!("{from} (claims rank {r}): {e}"));
            return Ok(None);
        }
        let proof = match ctx.recv_within(
            s,
            None,
            "reading the answer to the challenge",
            HELLO_WAIT,
            MAX_HELLO,
        ) {
            Ok(m) => m,
            Err(e) => {
                self.refused.push(format!("{from} (claims rank {r}): {e}"));
                return Ok(None);
            }
        };
        match msg::decode_proof(&proof, MSG_PROOF) {
            Ok(Ok(tag)) if auth::ct_eq(&tag, &sec.rank_proof(&nonce0, hello)) => Ok(Some(nonce0)),
            Ok(Ok(_)) => {
                let why = sec.bad_proof(&format!("rank {r}"), "rank 0");
                self.refuse(ctx, s, from, r, why);
                Ok(None)
            }
            Ok(Err(gave_up)) => {
                self.refused
                    .push(format!("{from} (claims rank {r}): {}", gave_up.why));
                Ok(None)
            }
            Err(w) => {
                self.refuse(ctx, s, from, r, format!("bad answer to the challenge: {w}"));
                Ok(None)
            }
        }
    }

    /// A rank that proved the token: it joins if its claims fit this job; else the
    /// rendezvous fails on every rank that joined, naming both sides.
    fn admit(
        &mut self,
        ctx: &Ctx<'_>,
        mut s: TcpStream,
        from: SocketAddr,
        h: msg::Hello,
        (hello, nonce0): (Vec<u8>, Nonce),
    ) -> Result<()> {
        let world = self.star.len();
        let segment = ctx.opts.segment_bytes;
        let r = h.rank as usize;
        if h.world as usize != world {
            let why = format!(
                "rank {r} (at {from}) has world size {} but rank 0 has {world}",
                h.world
            );
            send_reject(ctx, &mut s, REJECT_MISMATCH, "", &why);
            abort_all(ctx, &mut self.star, REJECT_MISMATCH, "", &why);
            return Err(Error::Mismatch {
                rank: Some(0),
                peer: Some(r),
                op: "bootstrap".into(),
                what: why,
            });
        }
        if h.segment != segment as u64 {
            let why = format!(
                "rank {r} uses {}-byte pipeline segments but rank 0 uses {}: set the same \
                 DSPARK_CHUNK_BYTES on every rank",
                h.segment, segment
            );
            send_reject(ctx, &mut s, REJECT_CONFIG, "DSPARK_CHUNK_BYTES", &why);
            abort_all(
                ctx,
                &mut self.star,
                REJECT_CONFIG,
                "DSPARK_CHUNK_BYTES",
                &why,
            );
            return Err(Error::config("DSPARK_CHUNK_BYTES", why));
        }
        if r == 0 || r >= world || self.star[r].is_some() {
            let prev = self.info[r.min(world - 1)]
                .as_ref()
                .map_or("this process".to_string(), |j| {
                    format!("{} ({})", j.host, j.ip)
                });
            let why = format!(
                "rank {r} joined twice: from {} ({from}) and earlier from {prev} — check \
                 DSPARK_RANK / RANK on each process",
                h.host
            );
            send_reject(ctx, &mut s, REJECT_CONFIG, "DSPARK_RANK", &why);
            abort_all(ctx, &mut self.star, REJECT_CONFIG, "DSPARK_RANK", &why);
            return Err(Error::config("DSPARK_RANK", why));
        }
        self.info[r] = Some(Joined {
            host: h.host,
            data_port: h.data_port,
            ip: from.ip(),
            hello,
            nonce0,
        });
        self.star[r] = Some(s);
        self.joined += 1;
        Ok(())
    }
}

/// The rank table once every rank joined: each rank's host and data address as rank 0 saw it
/// connect; rank 0's own entry from `(host, data_port, iface)`.
fn table(
    ctx: &Ctx<'_>,
    (host, data_port, iface): (&str, u16, Option<IpAddr>),
    info: &[Option<Joined>],
) -> Result<Vec<PeerInfo>> {
    let mut peers = Vec::with_capacity(info.len());
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
    Ok(peers)
}

/// Sends every rank its table, as that rank should see it (rank 0's address is the one that
/// rank reached; with `links`, only rank 0, itself and its links), with rank 0's proof over
/// the rank's hello and nonce and the table itself.
fn send_tables(
    ctx: &Ctx<'_>,
    star: &mut [Option<TcpStream>],
    info: &[Option<Joined>],
    peers: &[PeerInfo],
    (data_port, iface): (u16, Option<IpAddr>),
    links: Option<&dyn Fn(usize) -> Vec<usize>>,
) -> Result<()> {
    let sec = ctx.sec();
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
            None => peers.to_vec(),
        };
        table[0].addr = SocketAddr::new(my_ip, data_port);
        let m = msg::encode_welcome(&table);
        // Rank 0's own proof, over this rank's hello and nonce and the table itself.
        let tag = sec.root_proof(&j.hello, &j.nonce0, &m.0);
        ctx.send(s, Some(r), m.raw(&tag))?;
    }
    Ok(())
}

/// Tells a connection to the rendezvous listener why it is refused (best effort).
fn send_reject(ctx: &Ctx<'_>, s: &mut TcpStream, class: u8, var: &str, why: &str) {
    let rej = Reject {
        class,
        var: var.into(),
        why: why.into(),
    };
    let _ = ctx.send(s, None, rej.encode());
}

/// Tells every rank that joined why the rendezvous failed.
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

/// Accepts the next connection on `l` (non-blocking), waiting until the deadline.
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
