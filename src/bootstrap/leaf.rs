//! A rank's side of the rendezvous (steps 1 to 3 of the [module docs](super), other than
//! rank 0): reaching rank 0 (retrying until the deadline), the hello, the answer to rank 0's
//! challenge, and the rank table, accepted only with rank 0's proof that it knows the token.

#![forbid(unsafe_code)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use super::auth;
use super::msg::{self, Reject, Reply, MSG_PROOF, REJECT_CONFIG};
use super::net::{resolve, RESOLVE_FLOOR};
use super::{fresh_nonce, BootstrapOptions, Ctx, PeerInfo, Star, HELLO_WAIT};
use crate::error::{Error, Result};

/// Step 1 of a rank other than 0: connects to rank 0, retrying until the deadline (rank 0
/// may not listen yet). The connection's local address is the one this rank advertises: its
/// data listener binds it.
pub(super) fn reach_root(ctx: &Ctx<'_>) -> Result<TcpStream> {
    let opts = ctx.opts;
    let (rhost, port) = (&opts.root.0, opts.root.1);
    let mut last_err = String::from("no attempt made");
    loop {
        // The last try may come at the deadline: its lookup gets `RESOLVE_FLOOR` all the
        // same, or a name's lookup could only run out of time there and hide the error of
        // the tries before it.
        let within = ctx.remaining().unwrap_or_default().max(RESOLVE_FLOOR);
        match resolve(rhost, port, within) {
            Ok(addrs) if !addrs.is_empty() => {
                for a in addrs {
                    let rem = ctx.remaining().unwrap_or(Duration::from_millis(1));
                    match TcpStream::connect_timeout(&a, rem.min(Duration::from_secs(5))) {
                        Ok(s) => return Ok(s),
                        Err(e) => last_err = format!("{a}: {e}"),
                    }
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
                    opts.root_addr, opts.root_source
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// How many times a rank connects to rank 0 again when rank 0 closes its connection before
/// its challenge.
const MAX_RECONNECTS: u32 = 8;

/// The rendezvous of a rank other than 0 on `s`, its connection to rank 0 ([`reach_root`]):
/// `host`, `data_port` and `iface` are its own entry of the table.
pub(super) fn leaf_rendezvous(
    ctx: &Ctx<'_>,
    mut s: TcpStream,
    host: &str,
    data_port: u16,
    iface: Option<IpAddr>,
) -> Result<Star> {
    let opts = ctx.opts;
    let sec = ctx.sec();
    let world = opts.world;
    // Rank 0 may close a connection before reading its hello, when strangers fill its
    // listener (it keeps the ones that have spoken): then this rank connects again, at once,
    // a few times. A rank 0 that refused this rank says why instead.
    let mut tries = 0;
    let (mut s, hello, reply) = loop {
        let _ = s.set_nodelay(true);
        // (A reset connection has no peer address any more.)
        let at = s.peer_addr().ok();
        let hello = msg::Hello {
            world: world as u32,
            rank: opts.rank as u32,
            job: sec.job,
            data_port,
            host: host.to_string(),
            segment: opts.segment_bytes as u64,
            token: sec.token,
            nonce: fresh_nonce(ctx)?,
            pid: std::process::id(),
        }
        .encode();
        let got = ctx
            .send(&mut s, Some(0), hello.clone())
            .and_then(|()| ctx.recv(&mut s, Some(0), "waiting for rank 0's challenge"));
        match got {
            Ok(reply) => break (s, hello, reply),
            Err(e @ Error::PeerLost { .. }) if tries < MAX_RECONNECTS => {
                tries += 1;
                let again = at.and_then(|a| {
                    let rem = ctx.remaining()?.min(HELLO_WAIT);
                    TcpStream::connect_timeout(&a, rem).ok()
                });
                let Some(again) = again else { return Err(e) };
                tracing::debug!(
                    rank = opts.rank,
                    "rank 0 closed the connection unread ({e}); connecting again"
                );
                s = again;
            }
            Err(e) => return Err(e),
        }
    };
    let root_at = s
        .peer_addr()
        .map_or_else(|_| opts.root_addr.clone(), |a| a.to_string());
    let nonce0 = match Reply::decode(&reply, world).map_err(|w| ctx.bad(Some(0), w))? {
        Reply::Challenge(n) => n,
        Reply::Reject(rej) => return Err(refusal(opts, rej)),
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
                    rank: Some(opts.rank),
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
        Reply::Reject(rej) => return Err(refusal(opts, rej)),
        Reply::Challenge(_) => {
            return Err(ctx.bad(Some(0), "rank 0 sent a second challenge".into()))
        }
    };
    // A partial table (connections on first use): the rest is gathered after the mesh.
    let me = opts.rank;
    if peers.len() < world {
        let known = std::mem::take(&mut peers);
        peers = (0..world)
            .map(|rank| PeerInfo {
                rank,
                host: String::new(),
                addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
                pid: 0,
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

/// The error of a rank that rank 0 refused.
fn refusal(opts: &BootstrapOptions, rej: Reject) -> Error {
    let what = format!("rank 0 refused this rank: {}", rej.why);
    if rej.class == REJECT_CONFIG {
        Error::config(rej.var, what)
    } else {
        Error::Mismatch {
            rank: Some(opts.rank),
            peer: Some(0),
            op: "bootstrap".into(),
            what,
        }
    }
}
