//! The data connections made at init: [`connect_mesh`] connects the pairs of ranks the
//! rendezvous asks for, each proving the job token both ways, in steps that never wait on a
//! rank that is itself waiting. The dialling side's steps ([`say_hello`],
//! [`answer_challenge`], [`check_ack`]) serve the connections on first use too
//! ([`super::links`]); the accepting side is the [`Door`].

#![forbid(unsafe_code)]

use std::io;
use std::net::TcpStream;
use std::time::Duration;

use super::auth::{self, LABEL_ACCEPTOR, LABEL_CONNECTOR};
use super::door::{Door, Until};
use super::msg::{self, PeerHello, MSG_PEER_PROOF};
use super::{fresh_nonce, Ctx, PeerInfo};
use crate::error::{Error, Result};

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
pub(super) fn connect_mesh(
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
        let (s, hello) = say_hello(ctx, &peers[r])?;
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

/// Step 1 of a data connection to the lower rank `p` at init: connects to its data listener
/// and sends a hello with a fresh nonce; returns the stream and the hello. A refused
/// connection is retried until the deadline (the rank may not listen yet).
pub(super) fn say_hello(ctx: &Ctx<'_>, p: &PeerInfo) -> Result<(TcpStream, Vec<u8>)> {
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
            Err(e) => return Err(connect_failed(ctx, p, e)),
        }
    };
    let hello = send_hello(ctx, &mut s, p)?;
    Ok((s, hello))
}

/// The error of a connection to `p` that failed with `e`. After the rendezvous every listener
/// is up, so a refusal there means the rank is gone: [`Error::PeerLost`].
pub(super) fn connect_failed(ctx: &Ctx<'_>, p: &PeerInfo, e: io::Error) -> Error {
    if e.kind() == io::ErrorKind::ConnectionRefused {
        return Error::PeerLost {
            rank: ctx.rank(),
            peer: p.rank,
            op: "connect".into(),
            detail: format!(
                "its data listener at {} ({}) refused the connection: its communicator is \
                 closed or its process died",
                p.addr, p.host
            ),
        };
    }
    Error::io(
        Some(ctx.rank()),
        Some(p.rank),
        format!(
            "bootstrap: connecting to rank {} at {} ({})",
            p.rank, p.addr, p.host
        ),
        e,
    )
}

/// Step 1 on a connection to `p` that is made: sends the hello with a fresh nonce and returns
/// it (the proofs that follow cover it).
pub(super) fn send_hello(ctx: &Ctx<'_>, s: &mut TcpStream, p: &PeerInfo) -> Result<Vec<u8>> {
    let me = ctx.rank();
    let _ = s.set_nodelay(true);
    let hello = PeerHello {
        job: ctx.sec().job,
        world: ctx.opts.world as u32,
        from: me as u32,
        to: p.rank as u32,
        token: ctx.sec().token,
        nonce: fresh_nonce(ctx)?,
    }
    .encode();
    ctx.send(s, Some(p.rank), hello.clone())?;
    Ok(hello.0)
}

/// Step 3 of a data connection to the lower rank `p`: checks its challenge `m` (its proof
/// over `hello`, the hello this rank sent) and answers with this rank's proof.
pub(super) fn answer_challenge(
    ctx: &Ctx<'_>,
    s: &mut TcpStream,
    p: &PeerInfo,
    hello: &[u8],
    m: &[u8],
) -> Result<()> {
    let r = p.rank;
    let sec = ctx.sec();
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
pub(super) fn check_ack(ctx: &Ctx<'_>, r: usize, m: &[u8]) -> Result<()> {
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

#[cfg(test)]
pub(super) mod tests {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener};
    use std::time::Instant;

    use super::*;
    use crate::bootstrap::auth::{Nonce, Secret, TAG_LEN};
    use crate::bootstrap::msg::Msg;
    use crate::bootstrap::BootstrapOptions;
    use crate::bootstrap::HELLO_WAIT;

    /// The options of rank `rank` of `world` with job token `token` (and a 10 s deadline).
    pub(in crate::internals::bootstrap) fn config(
        rank: usize,
        world: usize,
        token: &str,
    ) -> BootstrapOptions {
        BootstrapOptions::for_test(rank, world, token)
    }

    fn mesh_of(opts: BootstrapOptions, listener: TcpListener, peers: Vec<PeerInfo>) -> Result<()> {
        let start = Instant::now();
        let ctx = Ctx {
            opts: &opts,
            deadline: start + opts.timeout,
            start,
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| ctx.io(None, "listener", e))?;
        let mut door = Door::new(listener, opts.world);
        let mut mesh: Vec<Option<TcpStream>> = (0..opts.world).map(|_| None).collect();
        connect_mesh(&ctx, &mut door, &peers, &mut mesh, &|_| true)
    }

    pub(in crate::internals::bootstrap) fn peer(rank: usize, addr: SocketAddr) -> PeerInfo {
        PeerInfo {
            rank,
            host: "h".into(),
            addr,
            pid: 0,
        }
    }

    fn send(s: &mut TcpStream, m: &Msg) {
        s.write_all(&(m.0.len() as u32).to_le_bytes()).unwrap();
        s.write_all(&m.0).unwrap();
    }

    pub(in crate::internals::bootstrap) fn recv(s: &mut TcpStream) -> Vec<u8> {
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
    ) -> (TcpStream, Secret, Msg, Nonce) {
        let sec = config(from as usize, world as usize, token).secret;
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
        proof: impl Fn(&Secret, &[u8], &Nonce) -> msg::Tag,
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

    /// 200 connections to a data listener that stay silent, send half a message or garbage
    /// (more than it holds at once) are there before the real rank 1: it is accepted and
    /// proved at once, and the strangers fail nothing.
    #[test]
    fn a_flood_of_strangers_on_a_data_listener_holds_up_nobody() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let peers = vec![peer(0, addr), peer(1, addr)];
        let mut c = config(0, 2, "a");
        c.timeout = HELLO_WAIT / 2;
        let acceptor = std::thread::spawn(move || mesh_of(c, listener, peers));
        let mut strangers = Vec::new();
        for i in 0..200u32 {
            let mut s = TcpStream::connect(addr).unwrap();
            match i % 3 {
                0 => {}
                1 => s.write_all(&[100, 0, 0, 0, 7, 7, 7]).unwrap(),
                _ => s.write_all(&[0xff; 64]).unwrap(),
            }
            strangers.push(s);
        }
        let t0 = Instant::now();
        let (mut s, sec, hello, nonce) = connect_as(addr, "a", 2, 1, 0);
        let proof = sec.peer_proof(LABEL_CONNECTOR, &hello.0, &nonce);
        send(&mut s, &msg::encode_proof(MSG_PEER_PROOF, &proof));
        assert!(msg::decode_peer_ack(&recv(&mut s)).unwrap().is_ok());
        acceptor.join().unwrap().unwrap();
        assert!(t0.elapsed() < HELLO_WAIT / 2, "{:?}", t0.elapsed());
        drop(strangers);
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
            sec.peer_proof(LABEL_CONNECTOR, hello, &[7; TAG_LEN])
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
        let sec = config(0, 2, "b").secret;
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
