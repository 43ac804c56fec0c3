//! Rank 0's side of the rendezvous (steps 1 to 3 of the [module docs](super)): binding the
//! root address, accepting the other ranks, checking each hello and proof, and sending every
//! rank its rank table with rank 0's own proof.
//!
//! A connection that does not prove the job token (a stranger, a port scanner, a rank of
//! another job or version) is refused with its reason and rank 0 keeps waiting; only a rank
//! that proved the token and does not fit this job (another world size or segment size, a
//! rank twice) fails the rendezvous, on every rank that joined so far.
//!
//! Rank 0 reads every pending connection side by side, without waiting on any, on the data
//! listener's machine ([`Gate`]): a silent, half-speaking or resetting connection holds up no
//! other, costs a bounded amount of memory, and adds at most a line to the error.

#![forbid(unsafe_code)]

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::time::Instant;

use super::auth::{self, Nonce};
use super::door::{capped_list, send_now, Candidate, Gate, MAX_STRANGERS};
use super::msg::{self, HelloError, Reject, Reply, MSG_PROOF, REJECT_CONFIG, REJECT_MISMATCH};
use super::net::{is_local_ip, resolve};
use super::{describe, fresh_nonce, Ctx, PeerInfo, Star, MAX_HELLO};
use crate::error::{Error, Result};

/// Rank 0's rendezvous: on `pre_bound` when given, else on the configured root address.
/// `host` and `iface` are rank 0's own entry of the table. Once every rank joined, rank 0
/// binds its data listener (on `iface`, else on the address the ranks reached it at) and
/// returns it with the connections and the table.
pub(super) fn root_rendezvous(
    ctx: &Ctx<'_>,
    host: &str,
    iface: Option<IpAddr>,
    pre_bound: Option<TcpListener>,
    links: Option<&dyn Fn(usize) -> Vec<usize>>,
) -> Result<(Star, TcpListener)> {
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
    let Lobby { mut star, info, .. } = root_accept(ctx, listener, bind_addr, world)?;
    // The data listener, on the address the ranks reached rank 0 at (where a rank on
    // another host reaches its data listener too), or on the interface asked for.
    let reached = star[1]
        .as_ref()
        .and_then(|s| s.local_addr().ok())
        .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |a| a.ip());
    let ip = iface.unwrap_or(if bind_addr.ip().is_unspecified() {
        reached
    } else {
        bind_addr.ip()
    });
    let data = super::bind_data(ctx, ip)?;
    let data_addr = data
        .local_addr()
        .map_err(|e| ctx.io(None, "data listener address", e))?;
    let own = SocketAddr::new(
        if data_addr.ip().is_unspecified() {
            reached
        } else {
            data_addr.ip()
        },
        data_addr.port(),
    );
    let peers = table(ctx, (host, own), &info)?;
    send_tables(ctx, &mut star, &info, &peers, data_addr, links)?;
    Ok(((star, peers), data))
}

/// Binds rank 0's rendezvous listener on the configured root address: on its IP, which must
/// be one of this host's, or on every interface with `DSPARK_LISTEN_ANY`.
fn bind_root(ctx: &Ctx<'_>) -> Result<(TcpListener, SocketAddr)> {
    let opts = ctx.opts;
    let (rhost, port) = (&opts.root.0, opts.root.1);
    // A name that does not resolve is judged below (not this host's); one the resolver
    // does not answer for by the deadline fails here, saying so.
    let resolved = match resolve(rhost, port, ctx.remaining().unwrap_or_default()) {
        Ok(a) => a,
        Err(e) if e.kind() == io::ErrorKind::TimedOut => {
            return Err(ctx.timeout(
                None,
                format!(
                    "cannot resolve the root address {} ({}): {e}",
                    opts.root_addr, opts.root_source
                ),
            ))
        }
        Err(_) => Vec::new(),
    };
    let local = resolved.iter().find(|a| is_local_ip(a.ip())).copied();
    let bind_addr = match local {
        _ if opts.listen_any => {
            let v6 = local
                .or(resolved.first().copied())
                .is_some_and(|a| a.is_ipv6());
            let any = if v6 {
                IpAddr::V6(Ipv6Addr::UNSPECIFIED)
            } else {
                IpAddr::V4(Ipv4Addr::UNSPECIFIED)
            };
            SocketAddr::new(any, port)
        }
        Some(a) => a,
        None => {
            let found = resolved
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ");
            return Err(Error::config(
                opts.root_source.clone(),
                format!(
                    "rank 0 cannot listen on {}: {rhost} resolves to no address of this host \
                     ({}); give rank 0's own address, or set DSPARK_LISTEN_ANY=1 to listen on \
                     every interface",
                    opts.root_addr,
                    if found.is_empty() { "none" } else { &found }
                ),
            ));
        }
    };
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
    super::net::widen_backlog(&listener);
    Ok((listener, bind_addr))
}

/// What rank 0 keeps of each rank that joined.
struct Joined {
    host: String,
    pid: u32,
    data_port: u16,
    ip: IpAddr,
    /// Its hello and the nonce rank 0 challenged it with: rank 0's proof in the welcome
    /// covers both.
    hello: Vec<u8>,
    nonce0: Nonce,
}

/// Rank 0's side of the rendezvous on `listener` (non-blocking), until every rank joined:
/// one poll over the listener and every connection that has not proved the token yet
/// ([`Gate`]), so that no connection holds up another.
fn root_accept(
    ctx: &Ctx<'_>,
    listener: TcpListener,
    bind_addr: SocketAddr,
    world: usize,
) -> Result<Lobby> {
    tracing::debug!(%bind_addr, world, "rank 0 waiting for the other ranks");
    let mut lobby = Lobby {
        star: (0..world).map(|_| None).collect(),
        info: (0..world).map(|_| None).collect(),
        gate: Gate::new(listener, world.saturating_add(MAX_STRANGERS)),
        joined: 1,
    };
    while lobby.joined < world {
        let Some(rem) = ctx.remaining() else {
            return Err(lobby.timeout(ctx, bind_addr));
        };
        let (turn, incoming) = lobby.gate.wait(ctx, rem)?;
        for c in turn {
            if let Some(c) = lobby.step(ctx, c)? {
                lobby.gate.cands.push(c);
            }
        }
        if incoming {
            let star = &lobby.star;
            let needed = |c: &Candidate<msg::Hello>| {
                let r = c.hello.as_ref()?.1.rank as usize;
                star.get(r).is_some_and(Option::is_none).then_some(r)
            };
            lobby.gate.accept(ctx, &needed)?;
        }
    }
    for c in std::mem::take(&mut lobby.gate.cands) {
        lobby
            .gate
            .refuse(c, "no proof of the job token (every rank had joined)");
    }
    Ok(lobby)
}

/// The ranks that joined rank 0 so far, and the connections that have not proved the token.
struct Lobby {
    /// The connection to each rank that joined (`None` at rank 0 and for those missing).
    star: Vec<Option<TcpStream>>,
    info: Vec<Option<Joined>>,
    /// The listener, the connections that have not proved the token yet, and what was
    /// refused.
    gate: Gate<msg::Hello>,
    /// Ranks joined, rank 0 included.
    joined: usize,
}

impl Lobby {
    /// The deadline passed: which ranks are missing, and what was refused meanwhile.
    fn timeout(&self, ctx: &Ctx<'_>, bind_addr: SocketAddr) -> Error {
        let (joined, world) = (self.joined, self.star.len());
        let missing: Vec<usize> = (1..world).filter(|&r| self.star[r].is_none()).collect();
        let mut detail = format!(
            "{joined} of {world} ranks joined at {bind_addr}; missing rank(s) {}",
            capped_list(missing.iter().map(ToString::to_string))
        );
        detail += &self.gate.refused.suffix();
        ctx.timeout(missing.first().copied(), detail)
    }

    /// What candidate `c` sent: its hello (checked, then answered with the challenge) or its
    /// proof (checked, then the rank joins if it fits). It joins once it said a hello of this
    /// job and proved the job token, and fits; one that does not prove the token is refused
    /// (the wait goes on); one that proved it and does not fit fails the rendezvous. Gives
    /// `c` back while it is still a candidate.
    fn step(
        &mut self,
        ctx: &Ctx<'_>,
        mut c: Candidate<msg::Hello>,
    ) -> Result<Option<Candidate<msg::Hello>>> {
        let Some((hello, h, nonce0)) = c.hello.take() else {
            return self.hello(ctx, c);
        };
        let r = h.rank as usize;
        let proof = match c.pull(MAX_HELLO) {
            Ok(Some(m)) => m,
            Ok(None) => {
                c.hello = Some((hello, h, nonce0));
                return Ok(Some(c));
            }
            Err(e) => {
                c.hello = Some((hello, h, nonce0));
                self.gate
                    .refuse(c, &format!("reading the answer to the challenge: {e}"));
                return Ok(None);
            }
        };
        let sec = ctx.sec();
        let why = match msg::decode_proof(&proof, MSG_PROOF) {
            Ok(Ok(tag)) if auth::ct_eq(&tag, &sec.rank_proof(&nonce0, &hello)) => {
                let from = c.from;
                self.admit(ctx, c.s, from, h, (hello, nonce0))?;
                return Ok(None);
            }
            Ok(Ok(_)) => {
                let why = sec.bad_proof(&format!("rank {r}"), "rank 0");
                send_reject_now(&c.s, REJECT_MISMATCH, "", &why);
                why
            }
            Ok(Err(gave_up)) => gave_up.why,
            Err(w) => {
                let why = format!("bad answer to the challenge: {w}");
                send_reject_now(&c.s, REJECT_MISMATCH, "", &why);
                why
            }
        };
        c.hello = Some((hello, h, nonce0));
        self.gate.refuse(c, &why);
        Ok(None)
    }

    /// Reads the hello of candidate `c` and checks that it comes from a rank of this job and
    /// protocol; answers one that does with the challenge: the rank that claims rank `r`
    /// proves the token over a nonce of rank 0's, so that a recorded handshake proves
    /// nothing. Nothing it claims is acted on before that.
    fn hello(
        &mut self,
        ctx: &Ctx<'_>,
        mut c: Candidate<msg::Hello>,
    ) -> Result<Option<Candidate<msg::Hello>>> {
        let sec = ctx.sec();
        let hello = match c.pull(MAX_HELLO) {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(Some(c)),
            Err(e) => {
                self.gate.refuse(c, &format!("reading a hello: {e}"));
                return Ok(None);
            }
        };
        let h = match msg::Hello::decode(&hello) {
            Ok(h) => h,
            Err(e) => {
                let why = describe(&e).replace("this rank", "rank 0");
                if !matches!(e, HelloError::Foreign(_)) {
                    // A dspark rank of another version, or a broken one: it hears why.
                    send_reject_now(&c.s, REJECT_MISMATCH, "", &why);
                }
                self.gate.refuse(c, &why);
                return Ok(None);
            }
        };
        let r = h.rank;
        let why = if h.job != sec.job {
            "the launcher's job id (SLURM_JOB_ID or TORCHELASTIC_RUN_ID) differs from rank 0's: \
             a rank of another job?"
                .to_string()
        } else if h.token != sec.token {
            sec.token_disagreement("rank 0", &format!("rank {r}"))
        } else {
            let nonce0 = fresh_nonce(ctx)?;
            if let Err(e) = send_now(&c.s, &Reply::encode_challenge(&nonce0)) {
                c.hello = Some((hello, h, nonce0));
                self.gate.refuse(c, &e);
                return Ok(None);
            }
            c.hello = Some((hello, h, nonce0));
            c.challenged = Some(Instant::now());
            return Ok(Some(c));
        };
        send_reject_now(&c.s, REJECT_MISMATCH, "", &why);
        // Kept for the claim that the refusal names; no nonce was sent.
        c.hello = Some((hello, h, [0; auth::TAG_LEN]));
        self.gate.refuse(c, &why);
        Ok(None)
    }

    /// A rank that proved the token: it joins if its claims fit this job; else the
    /// rendezvous fails on every rank that joined, naming both sides.
    fn admit(
        &mut self,
        ctx: &Ctx<'_>,
        s: TcpStream,
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
            send_reject_now(&s, REJECT_MISMATCH, "", &why);
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
            send_reject_now(&s, REJECT_CONFIG, "DSPARK_CHUNK_BYTES", &why);
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
                .map_or(format!("this process (pid {})", std::process::id()), |j| {
                    format!("{} ({}, pid {})", j.host, j.ip, j.pid)
                });
            let why = format!(
                "rank {r} joined twice: from {} ({from}, pid {}) and earlier from {prev} — \
                 check DSPARK_RANK / RANK on each process",
                h.host, h.pid
            );
            send_reject_now(&s, REJECT_CONFIG, "DSPARK_RANK", &why);
            abort_all(ctx, &mut self.star, REJECT_CONFIG, "DSPARK_RANK", &why);
            return Err(Error::config("DSPARK_RANK", why));
        }
        self.info[r] = Some(Joined {
            host: h.host,
            pid: h.pid,
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
/// connect; rank 0's own entry from `(host, own)`.
fn table(
    ctx: &Ctx<'_>,
    (host, own): (&str, SocketAddr),
    info: &[Option<Joined>],
) -> Result<Vec<PeerInfo>> {
    let mut peers = Vec::with_capacity(info.len());
    for (r, joined) in info.iter().enumerate() {
        let (hn, addr, pid) = match joined {
            _ if r == 0 => (host.to_string(), own, std::process::id()),
            Some(j) => (j.host.clone(), SocketAddr::new(j.ip, j.data_port), j.pid),
            None => return Err(ctx.bad(Some(r), "rank missing from the table".into())),
        };
        peers.push(PeerInfo {
            rank: r,
            host: hn,
            addr,
            pid,
        });
    }
    Ok(peers)
}

/// Sends every rank its table, as that rank should see it (rank 0's address is that of its
/// data listener `data`, or, when that listens on every interface, the one that rank reached;
/// with `links`, only rank 0, itself and its links), with rank 0's proof over the rank's hello
/// and nonce and the table itself.
fn send_tables(
    ctx: &Ctx<'_>,
    star: &mut [Option<TcpStream>],
    info: &[Option<Joined>],
    peers: &[PeerInfo],
    data: SocketAddr,
    links: Option<&dyn Fn(usize) -> Vec<usize>>,
) -> Result<()> {
    let sec = ctx.sec();
    for (r, slot) in star.iter_mut().enumerate().skip(1) {
        let (Some(s), Some(j)) = (slot.as_mut(), info[r].as_ref()) else {
            return Err(ctx.bad(Some(r), "no connection to this rank".into()));
        };
        let my_ip = if data.ip().is_unspecified() {
            s.local_addr()
                .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |a| a.ip())
        } else {
            data.ip()
        };
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
        table[0].addr = SocketAddr::new(my_ip, data.port());
        let m = msg::encode_welcome(&table);
        // Rank 0's own proof, over this rank's hello and nonce and the table itself.
        let tag = sec.root_proof(&j.hello, &j.nonce0, &m.0);
        ctx.send(s, Some(r), m.raw(&tag))?;
    }
    Ok(())
}

/// Tells a connection to the rendezvous listener why it is refused (best effort, without
/// waiting).
fn send_reject_now(s: &TcpStream, class: u8, var: &str, why: &str) {
    let rej = Reject {
        class,
        var: var.into(),
        why: why.into(),
    };
    let _ = send_now(s, &rej.encode());
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

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::Duration;

    use super::*;
    use crate::bootstrap::{rendezvous, BootstrapOptions, HELLO_WAIT};

    /// Rank `rank` of `world` with a job token, meeting at 127.0.0.1:`port`.
    fn opts(rank: usize, world: usize, port: u16, timeout: Duration) -> BootstrapOptions {
        let mut o = BootstrapOptions::for_test(rank, world, "a");
        o.root = ("127.0.0.1".into(), port);
        o.root_addr = format!("127.0.0.1:{port}");
        o.timeout = timeout;
        o
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Connects to rank 0, retrying until it listens.
    fn reach(port: u16) -> TcpStream {
        let t0 = Instant::now();
        loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => return s,
                Err(e) if t0.elapsed() > Duration::from_secs(5) => panic!("{e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    /// 200 connections that stay silent or send half a message (more than rank 0 holds at
    /// once) are there before the real rank 1 arrives: rank 0 reads them all side by side, so
    /// rank 1 joins at once rather than after one hello wait per stranger. (Rank 0 used to
    /// read each connection's hello with a blocking wait of up to 5 s, one after another.)
    #[test]
    fn silent_and_half_speaking_connections_hold_up_no_rank() {
        let port = free_port();
        let o0 = opts(0, 2, port, Duration::from_secs(20));
        let root = std::thread::spawn(move || rendezvous(&o0).map(|_| ()));
        let mut strangers = Vec::new();
        for i in 0..200 {
            let mut s = reach(port);
            if i % 2 == 1 {
                s.write_all(&100u32.to_le_bytes()).unwrap();
                s.write_all(&[7u8; 10]).unwrap();
            }
            strangers.push(s);
        }
        let t0 = Instant::now();
        let o1 = opts(1, 2, port, Duration::from_secs(20));
        let leaf = std::thread::spawn(move || rendezvous(&o1).map(|_| ()));
        leaf.join().unwrap().unwrap();
        root.join().unwrap().unwrap();
        assert!(
            t0.elapsed() < HELLO_WAIT / 2,
            "rank 1 took {:?} to join",
            t0.elapsed()
        );
        drop(strangers);
    }

    /// Rank 0 closes a rank's connection before reading its hello (as it does to the oldest
    /// silent connection when strangers fill its listener): the rank connects again and
    /// joins, rather than failing with a lost rank 0.
    #[test]
    fn a_rank_whose_connection_rank_0_closed_unread_connects_again() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let o1 = opts(1, 2, port, Duration::from_secs(10));
        let leaf = std::thread::spawn(move || rendezvous(&o1).map(|_| ()));
        let (first, _) = l.accept().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        drop(first);
        let o0 = opts(0, 2, port, Duration::from_secs(10));
        crate::bootstrap::rendezvous_with(&o0, Some(l), None).unwrap();
        leaf.join().unwrap().unwrap();
    }

    /// A root address that is not this host's is a configuration error naming the way out,
    /// not a silent wildcard listener; with `DSPARK_LISTEN_ANY` rank 0 listens on every
    /// interface (and waits for rank 1).
    #[test]
    fn a_root_address_of_another_host_needs_listen_any() {
        let port = free_port();
        let mut o = opts(0, 2, port, Duration::from_millis(300));
        // TEST-NET-1 (RFC 5737): never an address of this host.
        o.root = ("192.0.2.1".into(), port);
        o.root_addr = format!("192.0.2.1:{port}");
        let e = rendezvous(&o).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e, Error::Config { .. })
                && text.contains("no address of this host")
                && text.contains("DSPARK_LISTEN_ANY=1"),
            "{text}"
        );
        o.listen_any = true;
        let e = rendezvous(&o).unwrap_err();
        assert!(
            matches!(e, Error::Timeout { peer: Some(1), .. })
                && e.to_string().contains(&format!("0.0.0.0:{port}")),
            "{e}"
        );
    }

    /// Connections that connect and reset, or send garbage, for the whole wait, and a rank
    /// that never comes: the error names the missing rank, and its list of refused
    /// connections stays short whatever their number.
    #[test]
    fn connect_and_reset_churn_keeps_the_error_short() {
        let port = free_port();
        let o0 = opts(0, 2, port, Duration::from_millis(1500));
        let root = std::thread::spawn(move || rendezvous(&o0).map(|_| ()));
        let churn = std::thread::spawn(move || {
            let t0 = Instant::now();
            let mut n = 0u32;
            while t0.elapsed() < Duration::from_millis(1400) {
                let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                };
                if n.is_multiple_of(2) {
                    let _ = s.write_all(&[0, 0, 0, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
                }
                let lin = libc::linger {
                    l_onoff: 1,
                    l_linger: 0,
                };
                let _ = nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::Linger, &lin);
                n += 1;
            }
            n
        });
        let e = root.join().unwrap().unwrap_err();
        let n = churn.join().unwrap();
        let text = e.to_string();
        assert!(n > 100, "only {n} connections churned");
        assert!(
            matches!(e, Error::Timeout { peer: Some(1), .. })
                && text.contains("missing rank(s) 1")
                && text.contains("more refused")
                && text.len() < 4096,
            "{} bytes after {n} connections: {text}",
            text.len()
        );
    }
}
