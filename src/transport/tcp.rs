//! The TCP transport: one non-blocking stream per peer, driven from the caller's thread.
//!
//! * Sends use `sendmsg` with the header and payload as two I/O vectors (`MSG_NOSIGNAL`, so a
//!   dead peer is an error, never a `SIGPIPE`).
//! * Receives read into a per-peer buffer, as much as the socket has, so a small frame costs
//!   one system call; large copying receives bypass the buffer and land in the caller's
//!   memory directly; reducing receives are reduced straight out of the buffer while the kernel
//!   keeps receiving the next bytes.
//! * A peer that closed its socket without saying goodbye is [`Error::PeerLost`] for what
//!   needs more from it (its bytes before the end are still taken), and at once outside a
//!   collective; one that sent an abort frame fails every survivor with [`Error::Aborted`],
//!   except a collective the aborting rank had completed: the abort frame carries that
//!   rank's last completed collective in its `seq` ([`Transport::collective_progress`]), so
//!   a survivor still finishing it finishes with what was delivered, and its next call
//!   fails. See "Nothing hangs" in the README for the rule every transport follows.
//!
//! # Dead hosts
//!
//! A host that loses power, or whose network is cut, sends no FIN and no RST: without help
//! its peers would learn of it only at the deadline. Two checks find it in seconds, both
//! answered by the peer's *kernel*, so a live host answers them however busy its rank is:
//!
//! * **Keepalive** on every connection ([`KEEPALIVE_IDLE`], [`KEEPALIVE_INTERVAL`],
//!   [`KEEPALIVE_PROBES`]): a connection that has heard nothing for 2 s is probed once a
//!   second; 5 unanswered probes fail it, so a silent host is [`Error::PeerLost`] about 7 s
//!   after the last byte it sent ("no answer from its host ..."). The kernel probes only a
//!   connection with no unacknowledged data of ours, the case of a rank waiting to receive.
//! * **Retransmission stall**: for a connection with unacknowledged data, keepalive does not
//!   run; there a `wait` that heard nothing for its whole timeout reads the kernel's count of
//!   consecutive retransmission timeouts (`/proc/net/tcp`) at most once a second and fails
//!   the peer after [`STALL_RETRANSMITS`] (7) without an acknowledgement: at Linux's smallest RTO of
//!   200 ms that is at least 25 s of total silence from the peer's host, the order of NCCL's
//!   tolerance on InfiniBand (about 30 s), so congestion (which delays acknowledgements but
//!   does not stop them) does not fail a job. The same count of unanswered zero-window probes
//!   fails a peer whose host died while its receive window was closed.
//!
//! `TCP_USER_TIMEOUT` is deliberately not set. Linux lets it override the keepalive count (a
//! keepalive-probed connection then fails only after the user timeout), so a generous value
//! would slow the 7 s detection down to it; and Linux applies it to zero-window probing too,
//! so a short value would fail the connection to a live rank that is merely late (busy with a
//! checkpoint while its peers' sends filled its receive window) after that short time.
//!
//! A **stopped** process (SIGSTOP, a debugger, a swapped-out host that still runs its kernel)
//! is *not* found by either check: its kernel keeps acknowledging data and probes until its
//! receive buffer is full, and then answers zero-window probes. That case is the deadline's
//! (the operation times out naming the peer it waited for).
//!
//! No `unsafe` here: sockets come from `std`, `poll`, `sendmsg` and the socket options from
//! `nix`. The retransmission-stall check reads the kernel's timers in `stall.rs`.

#![forbid(unsafe_code)]

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{sendmsg, MsgFlags, SockaddrStorage};

use super::links::{Accept, FirstUse};
use super::{
    rdhup, AbortClass, FrameHeader, FrameKind, Interest, Links, RecvProgress, RecvSink,
    SendProgress, Transport, TransportKind, HEADER_LEN,
};
use crate::error::{Error, Result};

#[cfg(test)]
mod exit_tests;
pub(crate) mod stall;

/// Per-peer receive buffer size.
const RX_CAP: usize = 256 * 1024;
/// Copying receives of at least this many remaining bytes read straight into the destination.
const DIRECT_MIN: usize = 32 * 1024;

/// Keepalive: a connection silent this long gets its first probe (`TCP_KEEPIDLE`). A live
/// host's kernel answers at once, however loaded, so a short idle time costs one small
/// packet per idle connection every 2 s and detects nothing that is alive.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(2);
/// Keepalive: time between unanswered probes (`TCP_KEEPINTVL`).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
/// Keepalive: unanswered probes that fail the connection (`TCP_KEEPCNT`): 5 s of silence
/// after the first probe, so a few lost probes on a congested path do not fail it.
pub const KEEPALIVE_PROBES: u32 = 5;
/// Consecutive retransmission timeouts (or unanswered zero-window probes) without an
/// acknowledgement after which a peer with unacknowledged data is lost: RTOs double from
/// at least 200 ms, so 7 mean at least 25 s without a word from the peer's host.
pub const STALL_RETRANSMITS: u32 = 7;
/// How often, at most, a waiting transport reads the retransmission counters.
const STALL_CHECK: Duration = Duration::from_secs(1);

/// Socket options for the data connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpOptions {
    /// `SO_SNDBUF` / `SO_RCVBUF` in bytes (0: leave the kernel's autotuning alone).
    pub socket_buffer: usize,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            socket_buffer: 4 << 20,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum PeerState {
    Open,
    /// The peer said goodbye.
    Closed,
    /// The connection failed (or ended without a goodbye): bytes already buffered are still
    /// taken; what needs more fails.
    Lost(String),
    /// The peer aborted after completing collective `.0` (its abort frame, at the front of
    /// what it sent, says so); reported by [`TcpTransport::abort_news`].
    Aborted(u64),
}

#[derive(Debug)]
struct Peer {
    stream: TcpStream,
    rx: Box<[u8]>,
    start: usize,
    end: usize,
    /// A frame's header has been taken and its payload is not complete.
    rx_in_frame: bool,
    /// A frame is partly written.
    tx_in_frame: bool,
    state: PeerState,
    /// The peer shut down its sending side and everything readable has been examined.
    eof_seen: bool,
    /// The socket's inode, its key in `/proc/net/tcp` (None: unknown, no stall check).
    inode: Option<u64>,
    /// IPv6 (`/proc/net/tcp6`) rather than IPv4.
    v6: bool,
}

/// A connection on first use becomes a data connection (see [`Peer::configure`]).
struct Install<'a> {
    rank: usize,
    fixed_buffer: Option<usize>,
    peers: &'a mut [Option<Peer>],
}

impl Accept for Install<'_> {
    fn wants(&self, peer: usize) -> bool {
        self.peers.get(peer).is_some_and(Option::is_none)
    }

    fn accept(&mut self, peer: usize, stream: TcpStream) -> Result<()> {
        self.peers[peer] = Some(Peer::configure(self.rank, peer, stream, self.fixed_buffer)?);
        Ok(())
    }
}

enum Fill {
    Data,
    WouldBlock,
    Eof,
}

impl Peer {
    /// Configures a connected stream to `p` (see the module docs): `TCP_NODELAY`,
    /// keepalive, the socket buffers when fixed, non-blocking.
    fn configure(rank: usize, p: usize, stream: TcpStream, buffer: Option<usize>) -> Result<Peer> {
        use nix::sys::socket::{setsockopt, sockopt};
        let io_err = |e| Error::io(Some(rank), Some(p), "configuring TCP connection", e);
        stream.set_nodelay(true).map_err(io_err)?;
        // Best effort, like the buffer sizes: without keepalive a dead host is found at the
        // deadline instead, which is worth a warning, not a failed init.
        let idle = KEEPALIVE_IDLE.as_secs() as u32;
        let intvl = KEEPALIVE_INTERVAL.as_secs() as u32;
        let keepalive = setsockopt(&stream, sockopt::KeepAlive, &true)
            .and_then(|()| setsockopt(&stream, sockopt::TcpKeepIdle, &idle))
            .and_then(|()| setsockopt(&stream, sockopt::TcpKeepInterval, &intvl))
            .and_then(|()| setsockopt(&stream, sockopt::TcpKeepCount, &KEEPALIVE_PROBES));
        if let Err(e) = keepalive {
            tracing::warn!(
                rank,
                peer = p,
                "TCP keepalive could not be set ({e}): a host of rank {p} that dies while \
                 this rank waits for it is found only at the deadline"
            );
        }
        if let Some(b) = buffer {
            let _ = setsockopt(&stream, sockopt::SndBuf, &b);
            let _ = setsockopt(&stream, sockopt::RcvBuf, &b);
        }
        stream.set_nonblocking(true).map_err(io_err)?;
        let inode = nix::sys::stat::fstat(&stream).ok().map(|st| st.st_ino);
        let v6 = stream.local_addr().is_ok_and(|a| a.is_ipv6());
        Ok(Peer {
            stream,
            rx: vec![0u8; RX_CAP].into_boxed_slice(),
            start: 0,
            end: 0,
            rx_in_frame: false,
            tx_in_frame: false,
            state: PeerState::Open,
            eof_seen: false,
            inode,
            v6,
        })
    }

    fn buffered(&self) -> usize {
        self.end - self.start
    }

    fn take(&mut self, n: usize) -> std::ops::Range<usize> {
        let r = self.start..self.start + n;
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        r
    }

    /// Reads what the socket has into the buffer, keeping unconsumed bytes.
    fn fill(&mut self) -> io::Result<Fill> {
        if self.end == self.rx.len() {
            if self.start == 0 {
                return Ok(Fill::Data); // full: the caller consumes first
            }
            self.rx.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        loop {
            match self.stream.read(&mut self.rx[self.end..]) {
                Ok(0) => return Ok(Fill::Eof),
                Ok(n) => {
                    self.end += n;
                    return Ok(Fill::Data);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Fill::WouldBlock),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn peek_header(&self) -> Option<&[u8; HEADER_LEN]> {
        if self.buffered() < HEADER_LEN {
            return None;
        }
        self.rx[self.start..self.start + HEADER_LEN].try_into().ok()
    }
}

/// The TCP transport.
#[derive(Debug)]
pub struct TcpTransport {
    rank: usize,
    world: usize,
    peers: Vec<Option<Peer>>,
    /// Connections on first use (None: every peer's stream was given at init).
    links: Option<FirstUse>,
    /// The socket buffer size to set on new connections (None: autotuned).
    fixed_buffer: Option<usize>,
    desc: String,
    aborted: bool,
    /// When `wait` last read the retransmission counters.
    stall_checked: Instant,
    /// The collective the engine runs and the last one it completed
    /// ([`Transport::collective_progress`]); abort frames carry `coll_done`.
    coll_running: Option<u64>,
    coll_done: u64,
    /// Some peer is [`PeerState::Aborted`] (so that `abort_news` looks only then).
    peer_aborted: bool,
}

fn lost_detail(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::ConnectionReset => "connection reset by peer (process died?)".into(),
        io::ErrorKind::BrokenPipe => "broken pipe (peer closed the connection)".into(),
        io::ErrorKind::TimedOut => format!(
            "no answer from its host ({e}: {KEEPALIVE_PROBES} keepalive probes {} s apart \
             after {} s of silence): host down or network cut",
            KEEPALIVE_INTERVAL.as_secs(),
            KEEPALIVE_IDLE.as_secs()
        ),
        io::ErrorKind::HostUnreachable
        | io::ErrorKind::NetworkUnreachable
        | io::ErrorKind::NetworkDown => {
            format!("{e} (a link is down or the network is cut)")
        }
        _ => e.to_string(),
    }
}

fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::NotConnected
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::TimedOut
            | io::ErrorKind::HostUnreachable
            | io::ErrorKind::NetworkUnreachable
            | io::ErrorKind::NetworkDown
    )
}

impl TcpTransport {
    /// Wraps connected streams (`streams[p]` is the connection to rank `p`; `None` for this
    /// rank) and configures them: non-blocking, `TCP_NODELAY`, socket buffers, keepalive
    /// (see the module docs).
    pub fn new(
        rank: usize,
        world: usize,
        streams: Vec<Option<TcpStream>>,
        opts: TcpOptions,
    ) -> Result<Self> {
        let mut peers = Vec::with_capacity(world);
        let mut local = None;
        // Setting SO_SNDBUF/SO_RCVBUF switches the kernel's autotuning off and is clamped to
        // net.core.{w,r}mem_max: ask only where the kernel allows the full size, else keep
        // autotuning. Either way, report what the socket really has.
        let limit = |name: &str| {
            std::fs::read_to_string(format!("/proc/sys/net/core/{name}"))
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
        };
        let fixed = opts.socket_buffer > 0
            && [limit("wmem_max"), limit("rmem_max")]
                .iter()
                .all(|m| m.is_some_and(|m| m >= opts.socket_buffer));
        let fixed_buffer = fixed.then_some(opts.socket_buffer);
        let mut actual: Option<(usize, usize)> = None;
        for (p, s) in streams.into_iter().enumerate() {
            let Some(stream) = s else {
                peers.push(None);
                continue;
            };
            if actual.is_none() {
                use nix::sys::socket::{getsockopt, sockopt};
                if let Some(b) = fixed_buffer {
                    use nix::sys::socket::setsockopt;
                    let _ = setsockopt(&stream, sockopt::SndBuf, &b);
                    let _ = setsockopt(&stream, sockopt::RcvBuf, &b);
                }
                if let (Ok(snd), Ok(rcv)) = (
                    getsockopt(&stream, sockopt::SndBuf),
                    getsockopt(&stream, sockopt::RcvBuf),
                ) {
                    actual = Some((snd, rcv));
                }
            }
            if local.is_none() {
                local = stream.local_addr().ok();
            }
            peers.push(Some(Peer::configure(rank, p, stream, fixed_buffer)?));
        }
        let buffers = match (fixed, actual) {
            (true, Some((snd, rcv))) => {
                format!(
                    "socket buffers send {} KiB / receive {} KiB",
                    snd / 1024,
                    rcv / 1024
                )
            }
            (false, Some((snd, rcv))) => format!(
                "socket buffers autotuned (now send {} KiB / receive {} KiB{})",
                snd / 1024,
                rcv / 1024,
                if opts.socket_buffer > 0 {
                    format!(
                        "; {} KiB requested but net.core.wmem_max/rmem_max are smaller",
                        opts.socket_buffer / 1024
                    )
                } else {
                    String::new()
                }
            ),
            (_, None) => "socket buffers unknown".to_string(),
        };
        let desc = match local {
            Some(a) => format!(
                "tcp {} (TCP_NODELAY, {buffers}, keepalive {}+{}x{} s, one stream per peer)",
                a.ip(),
                KEEPALIVE_IDLE.as_secs(),
                KEEPALIVE_PROBES,
                KEEPALIVE_INTERVAL.as_secs()
            ),
            None => "tcp (no peers)".to_string(),
        };
        Ok(TcpTransport {
            rank,
            world,
            peers,
            links: None,
            fixed_buffer,
            desc,
            aborted: false,
            stall_checked: Instant::now(),
            coll_running: None,
            coll_done: 0,
            peer_aborted: false,
        })
    }

    /// Connects the peers it has no stream for on first use, through `links`.
    pub fn with_links(mut self, links: Box<dyn Links>) -> Self {
        self.links = Some(FirstUse::new(
            links,
            self.rank,
            self.world,
            "connect",
            |p| format!("a second connection to rank {p}"),
        ));
        let n = self.connected();
        if n + 1 < self.world {
            self.desc = self.desc.replace(
                "one stream per peer",
                &format!(
                    "one stream per peer: {n} of {} connected at init, the others on first use",
                    self.world - 1
                ),
            );
        }
        self
    }

    /// Peers connected now (this rank excluded).
    pub fn connected(&self) -> usize {
        self.peers.iter().flatten().count()
    }

    /// Installs the connections [`Links::progress`] completed.
    fn pump(&mut self) -> Result<()> {
        let Some(l) = self.links.as_mut() else {
            return Ok(());
        };
        l.pump(&mut Install {
            rank: self.rank,
            fixed_buffer: self.fixed_buffer,
            peers: &mut self.peers,
        })
    }

    /// Whether `peer` is connected; if not, starts or advances connecting to it (on first
    /// use). Without [`Links`], an unconnected peer is an error.
    fn link(&mut self, peer: usize, op: &str) -> Result<bool> {
        if self.peers.get(peer).is_some_and(Option::is_some) {
            return Ok(true);
        }
        if peer >= self.world || peer == self.rank || self.links.is_none() {
            self.peer_mut(peer, op)?;
            return Ok(true);
        }
        if let Some(l) = self.links.as_mut() {
            l.link(
                peer,
                &mut Install {
                    rank: self.rank,
                    fixed_buffer: self.fixed_buffer,
                    peers: &mut self.peers,
                },
            )?;
        }
        Ok(self.peers[peer].is_some())
    }

    fn peer_mut(&mut self, p: usize, op: &str) -> Result<&mut Peer> {
        let rank = self.rank;
        match self.peers.get_mut(p).and_then(Option::as_mut) {
            Some(peer) => Ok(peer),
            None => Err(Error::invalid(
                Some(rank),
                op,
                format!("no connection to rank {p}"),
            )),
        }
    }

    /// What one read attempt from `peer` means for a receive: `Ok(true)` bytes arrived (go
    /// on), `Ok(false)` nothing to read now; an end of stream (`eof` says what it interrupted)
    /// or a read error marks the peer lost and becomes the error.
    fn after_fill(
        &mut self,
        peer: usize,
        res: io::Result<Fill>,
        eof: &str,
        op: &str,
    ) -> Result<bool> {
        let d = match res {
            Ok(Fill::Data) => return Ok(true),
            Ok(Fill::WouldBlock) => return Ok(false),
            Ok(Fill::Eof) => eof.to_string(),
            Err(e) => lost_detail(&e),
        };
        if let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) {
            p.state = PeerState::Lost(d.clone());
        }
        Err(self.lost(peer, op, d))
    }

    /// The header of the next data frame from `peer`, once it is buffered, left in the
    /// buffer (`recv` takes it once its sink accepted it; `peek` only looks). Reads what the
    /// socket has; reports an abort, a goodbye or a lost connection met instead.
    fn head_frame(&mut self, peer: usize, op: &str) -> Result<Option<FrameHeader>> {
        let rank = self.rank;
        loop {
            let p = self.peer_mut(peer, op)?;
            if let (PeerState::Lost(d), 0) = (&p.state, p.buffered()) {
                let d = d.clone();
                return Err(self.lost(peer, op, d));
            }
            let Some(b) = p.peek_header() else {
                if p.state == PeerState::Closed {
                    return Err(self.lost(peer, op, "peer closed its communicator"));
                }
                let eof = if p.buffered() > 0 {
                    "connection closed in the middle of a frame header"
                } else {
                    "connection closed (process died or closed its communicator)"
                };
                let res = p.fill();
                if self.after_fill(peer, res, eof, op)? {
                    continue;
                }
                return Ok(None);
            };
            let hdr = FrameHeader::decode(b).map_err(|what| Error::Transport {
                rank: Some(rank),
                peer: Some(peer),
                op: "receive frame header".into(),
                what,
            })?;
            match hdr.kind {
                FrameKind::Data => return Ok(Some(hdr)),
                FrameKind::Abort => {
                    // Wait until the message is buffered (it is short), then report it.
                    let need = HEADER_LEN + hdr.len as usize;
                    if p.buffered() < need && need <= RX_CAP {
                        match p.fill() {
                            Ok(Fill::Data) => continue,
                            Ok(Fill::WouldBlock) => return Ok(None),
                            _ => {}
                        }
                    }
                    return Err(self.abort_error(peer, &hdr, op));
                }
                FrameKind::Bye => {
                    p.take(HEADER_LEN);
                    p.state = PeerState::Closed;
                    return Err(self.lost(peer, op, "peer closed its communicator"));
                }
            }
        }
    }

    fn lost(&self, peer: usize, op: &str, detail: impl Into<String>) -> Error {
        Error::PeerLost {
            rank: self.rank,
            peer,
            op: op.into(),
            detail: detail.into(),
        }
    }

    /// Reads and returns the abort message at the front of `peer`'s buffer if the whole frame
    /// is buffered.
    fn abort_error(&self, peer: usize, hdr: &FrameHeader, op: &str) -> Error {
        let Some(p) = self.peers.get(peer).and_then(Option::as_ref) else {
            return AbortClass::error(hdr.coll, self.rank, hdr.root as usize, op, String::new());
        };
        let need = HEADER_LEN + hdr.len as usize;
        let msg = if p.buffered() >= need {
            String::from_utf8_lossy(&p.rx[p.start + HEADER_LEN..p.start + need]).into_owned()
        } else if p.buffered() > HEADER_LEN {
            String::from_utf8_lossy(&p.rx[p.start + HEADER_LEN..p.end]).into_owned() + "…"
        } else {
            "(no reason given)".to_string()
        };
        AbortClass::error(hdr.coll, self.rank, hdr.root as usize, op, msg)
    }

    /// After a failed write to `peer`: its abort frame, if it sent one before closing and it is
    /// at the front of what it sent.
    fn pending_abort(&mut self, peer: usize, op: &str) -> Option<Error> {
        let hdr = {
            let p = self.peers.get_mut(peer)?.as_mut()?;
            if p.rx_in_frame {
                return None;
            }
            while p.buffered() < HEADER_LEN {
                if !matches!(p.fill(), Ok(Fill::Data)) || p.end == p.rx.len() {
                    break;
                }
            }
            FrameHeader::decode(p.peek_header()?).ok()?
        };
        (hdr.kind == FrameKind::Abort).then(|| self.abort_error(peer, &hdr, op))
    }

    /// Examines `peer`'s connection between frames: returns an error for an abort or a lost
    /// connection, records a goodbye.
    fn examine(&mut self, peer: usize) -> Result<()> {
        let rank = self.rank;
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Ok(());
        };
        if p.state != PeerState::Open || p.eof_seen {
            return Ok(());
        }
        // A peer found gone fails the collective in progress only where it needs the peer
        // (the send or receive that does fails): every rank takes part in a collective, so
        // some survivor needs it at once and its abort tells the others; but this rank's same
        // collective, complete on the exited rank's side, finishes. Outside a collective no
        // one else may notice: at once.
        let gone = |p: &mut Peer, d: String, running: Option<u64>| {
            p.state = PeerState::Lost(d.clone());
            running.map_or(
                Err(Error::PeerLost {
                    rank,
                    peer,
                    op: "communicator".into(),
                    detail: d,
                }),
                |_| Ok(()),
            )
        };
        let fill = p.fill();
        let eof = match fill {
            Ok(Fill::Eof) => true,
            Ok(_) => false,
            Err(e) => return gone(p, lost_detail(&e), self.coll_running),
        };
        if !p.rx_in_frame {
            if let Some(b) = p.peek_header() {
                if let Ok(h) = FrameHeader::decode(b) {
                    match h.kind {
                        FrameKind::Abort => {
                            p.state = PeerState::Aborted(h.seq);
                            self.peer_aborted = true;
                            return self.abort_news().map_or(Ok(()), Err);
                        }
                        FrameKind::Bye => {
                            p.take(HEADER_LEN);
                            p.state = PeerState::Closed;
                            return Ok(());
                        }
                        FrameKind::Data => {}
                    }
                }
            }
        }
        if eof {
            if p.buffered() == 0 && !p.rx_in_frame {
                let d = "connection closed without goodbye (process died?)".to_string();
                return gone(p, d, self.coll_running);
            }
            // Data is still buffered for later receives: remember and stop polling it.
            p.eof_seen = true;
        }
        Ok(())
    }

    /// After a frame from `peer` that ended its stream: an abort frame behind it is recorded
    /// (`examine` no longer looks at a peer whose end was seen).
    fn note_abort(&mut self, peer: usize) {
        let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return;
        };
        let hdr = p.peek_header().and_then(|b| FrameHeader::decode(b).ok());
        if let (PeerState::Open, Some(h)) = (&p.state, hdr) {
            if h.kind == FrameKind::Abort {
                p.state = PeerState::Aborted(h.seq);
                self.peer_aborted = true;
            }
        }
    }

    /// The abort of a peer that fails this rank's call now, if any: every peer's abort
    /// except, during a collective the aborting peer had completed, that peer's (it delivered
    /// all this rank needs from it and needs nothing more: this rank finishes the collective
    /// and its next call fails). What needs more from that peer fails at once (`recv` meets
    /// its abort frame, `send` its state).
    fn abort_news(&mut self) -> Option<Error> {
        if !self.peer_aborted {
            return None;
        }
        let running = self.coll_running;
        let peer = self.peers.iter().position(|p| {
            p.as_ref().is_some_and(|p| match p.state {
                PeerState::Aborted(done) => running.is_none_or(|c| c > done),
                _ => false,
            })
        })?;
        Some(self.aborted_error(peer, "communicator"))
    }

    /// The error of `peer`'s abort frame at the front of its buffer, its message read whole
    /// where the socket has it.
    fn aborted_error(&mut self, peer: usize, op: &str) -> Error {
        let hdr = self
            .peers
            .get_mut(peer)
            .and_then(Option::as_mut)
            .and_then(|p| {
                let hdr = FrameHeader::decode(p.peek_header()?).ok()?;
                let need = HEADER_LEN + hdr.len as usize;
                while p.buffered() < need && need <= RX_CAP && matches!(p.fill(), Ok(Fill::Data)) {}
                Some(hdr)
            });
        match hdr {
            Some(hdr) => self.abort_error(peer, &hdr, op),
            None => self.lost(peer, op, "peer aborted"),
        }
    }
}

/// How long an abort or a goodbye waits for peers whose sockets are full, all of them
/// together.
const FAREWELL: Duration = Duration::from_millis(200);

impl TcpTransport {
    /// Writes `frame` (an abort, a goodbye) to every open peer not inside a frame of its
    /// own, within [`FAREWELL`] for them all: every peer is tried without blocking first (one
    /// whose socket has room takes it at once, whatever the others do), then those that
    /// blocked are waited for in turn until that one deadline. Each peer used to get 200 ms
    /// of its own, one after another: 256 peers with full sockets held an abort for 51 s.
    /// Returns, per peer in order (`peers.iter().flatten()`), whether it was written to.
    fn farewell(&mut self, frame: &[u8]) -> Vec<bool> {
        let deadline = Instant::now() + FAREWELL;
        let mut told = Vec::new();
        let mut blocked = Vec::new();
        for (k, p) in self.peers.iter_mut().flatten().enumerate() {
            let open = p.state == PeerState::Open && !p.tx_in_frame;
            told.push(open);
            if !open {
                continue;
            }
            let _ = p.stream.set_nonblocking(true);
            match p.stream.write(frame) {
                Ok(n) if n == frame.len() => {}
                Ok(n) => blocked.push((k, n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => blocked.push((k, 0)),
                Err(_) => {}
            }
        }
        for (k, mut done) in blocked {
            let Some(p) = self.peers.iter_mut().flatten().nth(k) else {
                continue;
            };
            let _ = p.stream.set_nonblocking(false);
            while done < frame.len() {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                let _ = p
                    .stream
                    .set_write_timeout(Some((deadline - now).max(Duration::from_millis(1))));
                match p.stream.write(&frame[done..]) {
                    Ok(0) => break,
                    Ok(n) => done += n,
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::Interrupted
                                | io::ErrorKind::WouldBlock
                                | io::ErrorKind::TimedOut
                        ) => {}
                    Err(_) => break,
                }
            }
        }
        told
    }
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }

    fn connected_peers(&self) -> Option<usize> {
        self.links.is_some().then(|| self.connected())
    }

    fn send(
        &mut self,
        peer: usize,
        hdr: &FrameHeader,
        data: &[u8],
        progress: &mut SendProgress,
    ) -> Result<bool> {
        const OP: &str = "send";
        let rank = self.rank;
        if let Some(e) = self.abort_news() {
            return Err(e);
        }
        if !self.link(peer, OP)? {
            return Ok(false);
        }
        let p = self.peer_mut(peer, OP)?;
        match &p.state {
            PeerState::Open => {}
            PeerState::Closed => {
                return Err(self.lost(peer, OP, "peer closed its communicator"));
            }
            PeerState::Lost(d) => {
                let d = d.clone();
                return Err(self.lost(peer, OP, d));
            }
            PeerState::Aborted(_) => return Err(self.aborted_error(peer, OP)),
        }
        let head = hdr.encode();
        let total = HEADER_LEN + data.len();
        while progress.written < total {
            let w = progress.written;
            let res = if w < HEADER_LEN {
                let iov = [IoSlice::new(&head[w..]), IoSlice::new(data)];
                sendmsg::<SockaddrStorage>(
                    p.stream.as_raw_fd(),
                    &iov,
                    &[],
                    MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
                    None,
                )
            } else {
                let iov = [IoSlice::new(&data[w - HEADER_LEN..])];
                sendmsg::<SockaddrStorage>(
                    p.stream.as_raw_fd(),
                    &iov,
                    &[],
                    MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
                    None,
                )
            };
            match res {
                Ok(n) => {
                    progress.written += n;
                    p.tx_in_frame = progress.written < total;
                }
                Err(nix::errno::Errno::EAGAIN) => return Ok(false),
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    let e = io::Error::from(e);
                    let d = lost_detail(&e);
                    if is_disconnect(&e) {
                        // A peer that failed first sends an abort and closes: report its
                        // error, which names the cause, rather than the closed socket.
                        if let Some(abort) = self.pending_abort(peer, OP) {
                            return Err(abort);
                        }
                        if let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) {
                            p.state = PeerState::Lost(d.clone());
                        }
                        return Err(Error::PeerLost {
                            rank,
                            peer,
                            op: OP.into(),
                            detail: d,
                        });
                    }
                    return Err(Error::io(Some(rank), Some(peer), OP, e));
                }
            }
        }
        Ok(true)
    }

    fn recv(
        &mut self,
        peer: usize,
        progress: &mut RecvProgress,
        sink: &mut dyn RecvSink,
    ) -> Result<bool> {
        const OP: &str = "receive";
        if let Some(e) = self.abort_news() {
            return Err(e);
        }
        if !self.link(peer, OP)? {
            return Ok(false);
        }
        loop {
            if progress.header.is_none() {
                let Some(hdr) = self.head_frame(peer, OP)? else {
                    return Ok(false);
                };
                let expected = sink.on_header(&hdr)?;
                let p = self.peer_mut(peer, OP)?;
                p.take(HEADER_LEN);
                p.rx_in_frame = expected > 0;
                progress.header = Some(hdr);
                progress.expected = expected;
                progress.got = 0;
            }
            let p = self.peer_mut(peer, OP)?;
            let want = progress.expected - progress.got;
            if want == 0 {
                p.rx_in_frame = false;
                progress.header = None;
                if p.eof_seen {
                    self.note_abort(peer);
                }
                return Ok(true);
            }
            let avail = p.buffered();
            if avail > 0 {
                if let Some(dst) = sink.direct() {
                    let n = want.min(avail);
                    let r = p.take(n);
                    let got = progress.got;
                    dst[got..got + n].copy_from_slice(&p.rx[r]);
                    progress.got += n;
                    continue;
                }
                let g = sink.granule().max(1);
                let mut n = want.min(avail);
                n -= n % g;
                if n > 0 {
                    let r = p.take(n);
                    sink.consume(&p.rx[r])?;
                    progress.got += n;
                    continue;
                }
                // Less than one element buffered: read more below.
            }
            let p = self.peer_mut(peer, OP)?;
            let res = if avail == 0 && want >= DIRECT_MIN {
                match sink.direct() {
                    Some(dst) => {
                        let got = progress.got;
                        match p.stream.read(&mut dst[got..got + want]) {
                            Ok(0) => Ok(Fill::Eof),
                            Ok(n) => {
                                progress.got += n;
                                Ok(Fill::Data)
                            }
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Fill::WouldBlock),
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(Fill::Data),
                            Err(e) => Err(e),
                        }
                    }
                    None => p.fill(),
                }
            } else {
                p.fill()
            };
            if !self.after_fill(peer, res, "connection closed in the middle of a frame", OP)? {
                return Ok(false);
            }
        }
    }

    fn peek(&mut self, peer: usize) -> Result<Option<FrameHeader>> {
        const OP: &str = "receive";
        if let Some(e) = self.abort_news() {
            return Err(e);
        }
        if !self.link(peer, OP)? {
            return Ok(None);
        }
        self.head_frame(peer, OP)
    }

    fn wait(&mut self, interest: &[Interest], deadline: Instant) -> Result<()> {
        if let Some(e) = self.abort_news() {
            return Err(e);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(());
        }
        // Round up so that a sub-millisecond remainder does not turn into a busy loop.
        // Wake at least once a second to look for stalled connections.
        let ms = (deadline - now)
            .min(STALL_CHECK)
            .as_micros()
            .div_ceil(1000)
            .min(i32::MAX as u128) as i32;
        let mut which = Vec::with_capacity(self.world);
        let mut fds = Vec::with_capacity(self.world);
        for (i, p) in self.peers.iter().enumerate() {
            let Some(p) = p else { continue };
            let mut ev = PollFlags::empty();
            if let Some(it) = interest.iter().find(|it| it.peer == i) {
                if it.recv {
                    ev |= PollFlags::POLLIN;
                }
                if it.send {
                    ev |= PollFlags::POLLOUT;
                }
            }
            // A peer whose unread data fills our buffer cannot be examined further until the
            // engine consumes it; watching it for a hang-up would only make poll spin.
            let full = p.start == 0 && p.end == p.rx.len();
            if p.state == PeerState::Open && !p.eof_seen && !full {
                ev |= rdhup();
            } else if ev.is_empty() {
                continue;
            }
            which.push(i);
            fds.push(PollFd::new(p.stream.as_fd(), ev));
        }
        // Connections in the making: a peer connecting to this rank, or answering it.
        let ours = fds.len();
        if let Some(l) = self.links.as_ref() {
            fds.extend(l.fds());
        }
        let timeout = PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX);
        // Whether the whole timeout passed with nothing on any descriptor.
        let idle = match nix::poll::poll(&mut fds, timeout) {
            Ok(n) => n == 0,
            Err(nix::errno::Errno::EINTR) => false,
            Err(e) => {
                return Err(Error::io(Some(self.rank), None, "poll", io::Error::from(e)));
            }
        };
        let linking = fds[ours..]
            .iter()
            .any(|f| f.revents().is_some_and(|e| !e.is_empty()));
        let flagged: Vec<usize> = fds[..ours]
            .iter()
            .zip(&which)
            .filter(|(fd, _)| {
                // nix cannot name POLLRDHUP, so `revents()` is None exactly when it is set.
                fd.revents()
                    .is_none_or(|r| r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR))
            })
            .map(|(_, &i)| i)
            .collect();
        drop(fds);
        for i in flagged {
            self.examine(i)?;
        }
        if linking {
            self.pump()?;
        }
        // Has a peer's host stopped acknowledging? Asked only by a wait that heard nothing
        // for its whole timeout (a silent peer, the case the check is for), at most once a
        // second: reading /proc/net/tcp takes about 2 ms with 300 sockets on the host, which
        // inside a busy collective made one fresh 8-byte bench run in about 25 take 20–290 µs
        // a call instead of 3.3.
        if idle && self.stall_checked.elapsed() >= STALL_CHECK {
            self.check_stalls()?;
        }
        Ok(())
    }

    fn check_peers(&mut self) -> Result<()> {
        if let Some(e) = self.abort_news() {
            return Err(e);
        }
        for i in 0..self.peers.len() {
            self.examine(i)?;
        }
        self.pump()
    }

    fn abort(&mut self, origin: usize, class: AbortClass, reason: &str) {
        if self.aborted {
            return;
        }
        self.aborted = true;
        let msg = reason.as_bytes();
        let msg = &msg[..msg.len().min(16 * 1024)];
        let mut head = FrameHeader::abort(origin, msg.len(), class);
        // How far this rank got: a peer still in a collective this rank completed finishes
        // it (`TcpTransport::abort_news`).
        head.seq = self.coll_done;
        let mut frame = head.encode().to_vec();
        frame.extend_from_slice(msg);
        let told = self.farewell(&frame);
        for (p, told) in self.peers.iter_mut().flatten().zip(told) {
            let _ = p.stream.shutdown(if told {
                Shutdown::Write
            } else {
                Shutdown::Both
            });
            p.state = PeerState::Lost("this rank aborted".into());
        }
    }

    fn close(&mut self) {
        if self.aborted {
            return;
        }
        self.farewell(&FrameHeader::bye().encode());
        for p in self.peers.iter_mut().flatten() {
            let _ = p.stream.shutdown(Shutdown::Write);
        }
        self.aborted = true;
    }

    fn collective_progress(&mut self, running: Option<u64>, completed: u64) {
        self.coll_running = running;
        self.coll_done = completed;
    }
}
