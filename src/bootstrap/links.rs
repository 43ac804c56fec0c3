//! Data connections made after init, on first use: [`LazyLinks`], the bootstrap's side of
//! the transports' [`Links`]. It dials with the init's own steps ([`super::mesh`]) and
//! accepts on this rank's [`Door`], without ever waiting on a peer.

#![forbid(unsafe_code)]

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::door::{pull_message, Door, CROSSED};
use super::mesh::{answer_challenge, check_ack, connect_failed, send_hello};
use super::{msg, BootstrapOptions, Ctx, PeerInfo, HELLO_WAIT, MAX_HELLO};
use crate::error::{Error, Result};
use crate::transport::Links;

/// Data connections made after init, on first use (the pairs that [`rendezvous_with`](super::rendezvous_with)'s
/// `links` left out): the rank that needs the pair first connects to the other's data
/// listener, and both prove the job token as when the ranks connect at init; when both
/// connect at once, the higher rank's connection is kept. Never blocks on a peer:
/// [`crate::transport::Links::progress`] advances the handshakes whose next message has
/// arrived.
pub struct LazyLinks {
    pub(super) opts: BootstrapOptions,
    pub(super) door: Door,
    pub(super) peers: Vec<PeerInfo>,
    /// Connections this rank is making to lower ranks, by rank.
    pub(super) dials: Vec<Option<Dial>>,
    /// Where [`Door`] puts the higher ranks that proved themselves.
    pub(super) scratch: Vec<Option<TcpStream>>,
}

/// A connection to a lower rank in the making: `connecting` until the TCP connection is made
/// (started without waiting, so a peer host that does not answer holds up no call), then the
/// hello is sent; `challenged` once this rank answered the challenge (and waits for the
/// acknowledgement).
pub(super) struct Dial {
    s: TcpStream,
    connecting: bool,
    hello: Vec<u8>,
    challenged: bool,
    /// The part of the peer's next message that has arrived (read without waiting, so a peer
    /// that sends half a message holds up nothing until `due`).
    got: Vec<u8>,
    /// When the connection must be made, and then when the peer's next message must be
    /// whole: [`HELLO_WAIT`] after the connection was started, after the hello, and again
    /// after the answer to its challenge.
    due: Instant,
}

impl std::fmt::Debug for LazyLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyLinks")
            .field("rank", &self.opts.rank)
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

/// `e`, a dial's timeout, with the time the dial waited for its step (which began
/// [`HELLO_WAIT`] before `due`: the whole wait when it ran out, less when the peer closed
/// first), not the time of the `progress` call.
fn dial_timeout(mut e: Error, due: Instant) -> Error {
    if let Error::Timeout { waited, .. } = &mut e {
        *waited = (Instant::now() + HELLO_WAIT).saturating_duration_since(due);
    }
    e
}

/// The end of the error of a connection on first use that the peer's host took but whose
/// process did not answer within [`HELLO_WAIT`] (`LazyLinks`' [`Links::unanswered`]).
fn unanswered_suffix() -> String {
    format!(": nothing whole within {HELLO_WAIT:?}")
}

impl Links for LazyLinks {
    fn start(&mut self, peer: usize) -> Result<()> {
        let me = self.opts.rank;
        if peer == me || self.dials.get(peer).is_none_or(Option::is_some) {
            return Ok(());
        }
        let now = Instant::now();
        let ctx = Ctx {
            opts: &self.opts,
            deadline: now + HELLO_WAIT,
            start: now,
        };
        let s = connect_without_waiting(self.peers[peer].addr)
            .map_err(|e| connect_failed(&ctx, &self.peers[peer], e))?;
        tracing::debug!(rank = me, peer, "connecting on first use");
        self.dials[peer] = Some(Dial {
            s,
            connecting: true,
            hello: Vec::new(),
            challenged: false,
            got: Vec::new(),
            due: Instant::now() + HELLO_WAIT,
        });
        self.door.dialing[peer] = true;
        Ok(())
    }

    fn progress(&mut self, done: &mut Vec<(usize, TcpStream)>) -> Result<()> {
        let now = Instant::now();
        let ctx = Ctx {
            opts: &self.opts,
            deadline: now + HELLO_WAIT,
            start: now,
        };
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
                    d.as_ref().map(|d| {
                        // Made: writable. (Errors and hang-ups are reported either way.)
                        let ev = if d.connecting {
                            PollFlags::POLLOUT
                        } else {
                            PollFlags::POLLIN
                        };
                        (r, PollFd::new(d.s.as_fd(), ev))
                    })
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
            if d.connecting {
                if ready.contains(&r) {
                    let failed = match d.s.take_error() {
                        Ok(None) => None,
                        Ok(Some(e)) | Err(e) => Some(e),
                    };
                    let made = match failed {
                        None => d.s.set_nonblocking(false),
                        Some(e) => Err(e),
                    };
                    if let Err(e) = made {
                        self.door.dialing[r] = false;
                        return Err(connect_failed(&ctx, &self.peers[r], e));
                    }
                    d.hello = match send_hello(&ctx, &mut d.s, &self.peers[r]) {
                        Ok(h) => h,
                        Err(e) => {
                            self.door.dialing[r] = false;
                            return Err(e);
                        }
                    };
                    d.connecting = false;
                    d.due = Instant::now() + HELLO_WAIT;
                } else if Instant::now() >= d.due {
                    self.door.dialing[r] = false;
                    return Err(dial_timeout(
                        ctx.timeout(
                            Some(r),
                            format!(
                                "connecting to rank {r} at {}: not made within {HELLO_WAIT:?}",
                                self.peers[r].addr
                            ),
                        ),
                        d.due,
                    ));
                }
                self.dials[r] = Some(d);
                continue;
            }
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
                    return Err(dial_timeout(
                        ctx.timeout(Some(r), format!("{what}{}", unanswered_suffix())),
                        d.due,
                    ));
                }
                Err(why) if closed(&d.s) => {
                    // Closed without an answer: the peer's door looks at connections only
                    // inside its calls and closes those whose step it did not see within
                    // the hello wait of its own clock (which started before this rank's,
                    // with the challenge it sent), or it closed the oldest unproven one to
                    // make room, or its process ended. Unanswered, as at `due`: the next use
                    // dials again, and a process that ended refuses that dial.
                    self.door.dialing[r] = false;
                    return Err(dial_timeout(
                        ctx.timeout(Some(r), format!("{what}: {why}{}", unanswered_suffix())),
                        d.due,
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
                if let Err(e) = answer_challenge(&ctx, &mut d.s, &self.peers[r], &d.hello, &m) {
                    self.door.dialing[r] = false;
                    return Err(e);
                }
                d.challenged = true;
                d.due = Instant::now() + HELLO_WAIT;
                self.dials[r] = Some(d);
            }
        }
        Ok(())
    }

    /// A dial the peer's kernel took (its listener, and so its process, is there) whose
    /// challenge or acceptance did not come within [`HELLO_WAIT`]: the peer's door answers
    /// only inside its own calls.
    fn unanswered(&self, e: &Error) -> bool {
        matches!(e, Error::Timeout { op, detail, .. }
            if op == "bootstrap" && detail.ends_with(&unanswered_suffix()))
    }

    fn fds(&self) -> Vec<PollFd<'_>> {
        let readable = |fd| PollFd::new(fd, PollFlags::POLLIN);
        let mut v = vec![readable(self.door.gate.listener.as_fd())];
        v.extend(self.door.gate.cands.iter().map(|c| readable(c.s.as_fd())));
        v.extend(self.dials.iter().flatten().map(|d| {
            // A connection in the making is made (or failed) when it becomes writable.
            let ev = if d.connecting {
                PollFlags::POLLOUT
            } else {
                PollFlags::POLLIN
            };
            PollFd::new(d.s.as_fd(), ev)
        }));
        v
    }
}

/// Whether the peer closed `s` (an end of file, or a reset already reported: either way a
/// read without waiting now finds the end), as opposed to sending something that is no
/// dspark message on a connection still open.
fn closed(s: &TcpStream) -> bool {
    use nix::sys::socket::{recv, MsgFlags};
    use std::os::fd::AsRawFd;
    let mut b = [0u8; 1];
    matches!(
        recv(
            s.as_raw_fd(),
            &mut b,
            MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT
        ),
        Ok(0)
    )
}

/// A TCP connection to `addr`, started without waiting for it to be made (a non-blocking
/// `connect`): the stream is non-blocking and becomes writable once made or failed.
fn connect_without_waiting(addr: SocketAddr) -> io::Result<TcpStream> {
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, SockaddrStorage};
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    match connect(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(addr),
    ) {
        Ok(()) | Err(nix::errno::Errno::EINPROGRESS) => Ok(TcpStream::from(fd)),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;

    use super::*;
    use crate::bootstrap::mesh::tests::{config, peer, recv};

    /// Rank 1 of 2, with a listener of its own, dialling rank 0 at `rank0` on first use.
    fn dialling_rank_1(rank0: SocketAddr) -> LazyLinks {
        let own = TcpListener::bind("127.0.0.1:0").unwrap();
        let own_addr = own.local_addr().unwrap();
        own.set_nonblocking(true).unwrap();
        let mut door = Door::new(own, 2);
        door.lazy = true;
        LazyLinks {
            opts: config(1, 2, "a"),
            door,
            peers: vec![peer(0, rank0), peer(1, own_addr)],
            dials: (0..2).map(|_| None).collect(),
            scratch: (0..2).map(|_| None).collect(),
        }
    }

    /// Calls `progress` every 10 ms until it fails (asserting that nothing connects and that
    /// it gives up within three hello waits of `t0`): the error and the slowest call.
    fn progress_until_failure(links: &mut LazyLinks, t0: Instant) -> (Error, Duration) {
        let mut slowest = Duration::ZERO;
        loop {
            let t = Instant::now();
            let mut done = Vec::new();
            let r = links.progress(&mut done);
            slowest = slowest.max(t.elapsed());
            assert!(done.is_empty(), "connected to a peer that is no rank");
            if let Err(e) = r {
                return (e, slowest);
            }
            assert!(t0.elapsed() < HELLO_WAIT * 3, "never gave up");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The dialling side of a connection on first use: a peer that accepts, reads the hello
    /// and sends half a challenge holds up no `progress` call (each returns at once, so the
    /// caller's collective goes on), and fails the connection naming it once the hello wait
    /// is over. (The dialling side used to read a ready peer's message with a blocking read
    /// bounded by [`HELLO_WAIT`].)
    #[test]
    fn a_peer_that_sends_half_a_challenge_holds_up_no_progress_call() {
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
        let mut links = dialling_rank_1(fake_addr);
        let t0 = Instant::now();
        links.start(0).unwrap();
        let (e, slowest) = progress_until_failure(&mut links, t0);
        let text = e.to_string();
        assert!(
            matches!(e, Error::Timeout { peer: Some(0), waited, .. } if waited >= HELLO_WAIT)
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

    /// A peer that reads the hello and closes the connection without an answer (its door
    /// closes what it did not see in time, or makes room) leaves the connection unanswered,
    /// a timeout the transports dial again for, promptly, not a handshake failure that
    /// fails the peer for good; one that sends something that is no dspark message still
    /// fails it.
    #[test]
    fn a_peer_that_closes_the_handshake_unanswered_is_unanswered_not_failed() {
        for garbage in [false, true] {
            let fake = TcpListener::bind("127.0.0.1:0").unwrap();
            let fake_addr = fake.local_addr().unwrap();
            let peer = std::thread::spawn(move || {
                let (mut s, _) = fake.accept().unwrap();
                let _hello = recv(&mut s);
                if garbage {
                    s.write_all(&u32::MAX.to_le_bytes()).unwrap();
                    // Open until the dialling side gives up.
                    let mut rest = Vec::new();
                    let _ = s.read_to_end(&mut rest);
                }
            });
            let mut links = dialling_rank_1(fake_addr);
            let t0 = Instant::now();
            links.start(0).unwrap();
            let (e, _) = progress_until_failure(&mut links, t0);
            let text = e.to_string();
            if garbage {
                assert!(
                    matches!(e, Error::Transport { peer: Some(0), .. })
                        && !links.unanswered(&e)
                        && text.contains("bad message length"),
                    "{text}"
                );
            } else {
                assert!(
                    matches!(e, Error::Timeout { peer: Some(0), .. }) && links.unanswered(&e),
                    "{text}"
                );
                assert!(
                    t0.elapsed() < HELLO_WAIT,
                    "noticed after {:?}",
                    t0.elapsed()
                );
            }
            drop(links);
            peer.join().unwrap();
        }
    }

    /// The dialling side of a connection on first use to a host that does not answer (here a
    /// listener whose accept queue is full, so the kernel drops the SYNs): starting it and
    /// every `progress` call return at once, so a collective's own deadline and `abort` keep
    /// working, and the connection fails naming the peer once the hello wait is over. (The
    /// connect used to block `start` for up to five seconds.)
    #[test]
    fn a_peer_host_that_does_not_answer_holds_up_no_start_or_progress_call() {
        use nix::sys::socket::{bind, listen, socket, AddressFamily, Backlog, SockFlag};
        use nix::sys::socket::{SockType, SockaddrIn};
        let fd = socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        bind(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            &SockaddrIn::new(127, 0, 0, 1, 0),
        )
        .unwrap();
        listen(&fd, Backlog::new(0).unwrap()).unwrap();
        let full = TcpListener::from(fd);
        let full_addr = full.local_addr().unwrap();
        // Fill the accept queue: once a connect is not made within 200 ms, SYNs are dropped.
        let mut filler = Vec::new();
        while filler.len() < 64 {
            match TcpStream::connect_timeout(&full_addr, Duration::from_millis(200)) {
                Ok(s) => filler.push(s),
                Err(_) => break,
            }
        }
        assert!(filler.len() < 64, "the accept queue never filled");
        let mut links = dialling_rank_1(full_addr);
        let t0 = Instant::now();
        links.start(0).unwrap();
        let started = t0.elapsed();
        let (e, slowest) = progress_until_failure(&mut links, t0);
        let text = e.to_string();
        assert!(
            matches!(e, Error::Timeout { peer: Some(0), .. }) && text.contains("not made within"),
            "{text}"
        );
        assert!(
            started < Duration::from_millis(500),
            "start took {started:?}"
        );
        assert!(
            slowest < Duration::from_millis(500),
            "a progress call took {slowest:?}"
        );
    }
}
