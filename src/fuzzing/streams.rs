//! Stateful targets: byte streams a peer sends over a real loopback connection, written in
//! pieces split at points the input chooses, read by the code that reassembles them — the TCP
//! transport's frame reassembly ([`tcp_frames`]), the data listener's non-blocking message
//! reader ([`door_messages`]) — and a fake TCPStore server that answers a client with the
//! input's bytes ([`store_replies`]).
//!
//! Each thread keeps one connected pair of sockets (and one fake server) for all its inputs:
//! a connection per input would cost more than the decoding. A target writes one piece,
//! waits until it is readable (a piece is one TCP segment on loopback: it arrives whole),
//! lets the reader take what it can without waiting, and goes on; at the end what the reader
//! left is drained, so the next input starts on an empty connection.

use std::cell::RefCell;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use super::{Rng, XorShift};
use crate::bootstrap::door::pull_message;
use crate::error::{Error, Result};
use crate::transport::tcp::{TcpOptions, TcpTransport};
use crate::transport::{
    AbortClass, FrameHeader, FrameKind, RecvProgress, RecvSink, Transport, HEADER_LEN,
};

/// How long a piece written to loopback may take to become readable before the target calls
/// the connection stalled (it never takes more than microseconds).
const ARRIVAL: Duration = Duration::from_secs(10);

/// A connected pair of loopback sockets: what the peer writes, what this rank reads.
struct Pair {
    writer: TcpStream,
    reader: TcpStream,
}

fn pair() -> Pair {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("a loopback listener");
    let writer = TcpStream::connect(l.local_addr().expect("its address")).expect("connect");
    let (reader, _) = l.accept().expect("accept");
    // Each piece goes out at once, as one segment.
    writer.set_nodelay(true).expect("TCP_NODELAY");
    Pair { writer, reader }
}

thread_local! {
    static PAIR: RefCell<Option<Pair>> = const { RefCell::new(None) };
}

/// Runs `f` on this thread's pair (made on first use).
fn with_pair<T>(f: impl FnOnce(&Pair) -> T) -> T {
    PAIR.with(|p| {
        let mut p = p.borrow_mut();
        f(p.get_or_insert_with(pair))
    })
}

/// Bytes that have arrived and are not read yet, as far as `buf` holds them.
fn unread(p: &Pair, buf: &mut [u8]) -> usize {
    use nix::sys::socket::{recv, MsgFlags};
    use std::os::fd::AsRawFd;
    let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
    recv(p.reader.as_raw_fd(), buf, flags).unwrap_or(0)
}

/// Writes `piece` and waits until all of it has arrived (a piece written to loopback is
/// normally readable before the write returns): what the reader then does not take is what
/// it chose to leave, not bytes still on the way. `peek` is a buffer at least as long as the
/// whole stream.
fn deliver(p: &Pair, piece: &[u8], peek: &mut [u8]) {
    let before = unread(p, peek);
    (&p.writer).write_all(piece).expect("writing a piece");
    let want = (before + piece.len()).min(peek.len());
    let t = Instant::now();
    while unread(p, peek) < want {
        assert!(
            t.elapsed() < ARRIVAL,
            "a piece written to loopback did not arrive within {ARRIVAL:?}"
        );
        let mut fds = [PollFd::new(p.reader.as_fd(), PollFlags::POLLIN)];
        let _ = poll(&mut fds, PollTimeout::from(1u8));
        std::thread::yield_now();
    }
}

/// Reads and drops whatever the reader left (every piece written has arrived).
fn drain(p: &Pair) {
    let blocking = p.reader.set_nonblocking(true).is_ok();
    let mut b = [0u8; 4096];
    while matches!((&p.reader).read(&mut b), Ok(n) if n > 0) {}
    if blocking {
        let _ = p.reader.set_nonblocking(false);
    }
}

/// `stream` cut into 1 to 8 non-empty pieces at points drawn from `data`.
fn pieces<'a>(data: &[u8], stream: &'a [u8]) -> Vec<&'a [u8]> {
    let seed = data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    // Seeded by the input: where a stream is split depends on the input only.
    let mut r = XorShift(seed | 1);
    let mut cuts: Vec<usize> = (0..r.below(8)).map(|_| r.below(stream.len() + 1)).collect();
    // Cuts next to a frame boundary, inside a header, one byte apart: the interesting ones.
    if !stream.is_empty() && r.below(2) == 0 {
        let at = r.below(stream.len());
        cuts.extend([at, at + 1]);
    }
    cuts.push(0);
    cuts.push(stream.len());
    cuts.sort_unstable();
    cuts.dedup();
    cuts.windows(2)
        .map(|w| &stream[w[0]..w[1].min(stream.len())])
        .filter(|s| !s.is_empty())
        .collect()
}

// ---------------------------------------------------------------------------- tcp_frames

/// The longest payload [`Frames`] accepts (a real receiver expects one length; a longer
/// announced frame is its mismatch error).
const FRAME_CAP: usize = 16 << 10;

/// A receiver that records every frame: payloads of whole elements of `granule` bytes, at
/// most [`FRAME_CAP`] bytes, taken directly or through `consume`.
struct Frames {
    granule: usize,
    direct: bool,
    header: Option<FrameHeader>,
    buf: Vec<u8>,
    done: Vec<(FrameHeader, Vec<u8>)>,
}

impl RecvSink for Frames {
    fn on_header(&mut self, hdr: &FrameHeader) -> Result<usize> {
        let n = hdr.len as usize;
        if n > FRAME_CAP || !n.is_multiple_of(self.granule) {
            return Err(Error::invalid(None, "fuzz receive", "unexpected length"));
        }
        self.header = Some(*hdr);
        self.buf.clear();
        if self.direct {
            self.buf.resize(n, 0);
        }
        Ok(n)
    }
    fn direct(&mut self) -> Option<&mut [u8]> {
        self.direct.then_some(&mut self.buf[..])
    }
    fn granule(&self) -> usize {
        self.granule
    }
    fn consume(&mut self, bytes: &[u8]) -> Result<()> {
        assert!(
            bytes.len().is_multiple_of(self.granule),
            "consume got part of an element"
        );
        self.buf.extend_from_slice(bytes);
        Ok(())
    }
}

/// How a stream ended for the receiver: still waiting for more, or the error's kind.
fn ending(e: Option<&Error>) -> String {
    match e {
        None => "waiting".into(),
        Some(e) => {
            let d = format!("{e:?}");
            d.split([' ', '{', '(']).next().unwrap_or("").to_string()
        }
    }
}

/// The frames a [`TcpTransport`] receives from `stream` delivered as `pieces`, and how it
/// ended.
fn receive(
    p: &Pair,
    pieces: &[&[u8]],
    granule: usize,
    direct: bool,
) -> (Vec<(FrameHeader, Vec<u8>)>, String) {
    let stream = p.reader.try_clone().expect("dup of the reader");
    let mut t = TcpTransport::new(
        0,
        2,
        vec![None, Some(stream)],
        TcpOptions { socket_buffer: 0 },
    )
    .expect("a transport over the pair");
    let mut sink = Frames {
        granule,
        direct,
        header: None,
        buf: Vec::new(),
        done: Vec::new(),
    };
    let mut progress = RecvProgress::default();
    let mut end = None;
    let mut peek = vec![0u8; pieces.iter().map(|s| s.len()).sum::<usize>().max(1)];
    'pieces: for piece in pieces {
        deliver(p, piece, &mut peek);
        loop {
            match t.recv(1, &mut progress, &mut sink) {
                Ok(true) => {
                    let hdr = sink
                        .header
                        .take()
                        .expect("a frame completed without a header");
                    assert_eq!(progress.header, None);
                    let payload = std::mem::take(&mut sink.buf);
                    assert_eq!(payload.len(), hdr.len as usize, "a frame of another length");
                    sink.done.push((hdr, payload));
                }
                Ok(false) => break,
                Err(e) => {
                    end = Some(e);
                    break 'pieces;
                }
            }
        }
    }
    drop(t);
    drain(p);
    (sink.done, ending(end.as_ref()))
}

/// What a receiver must get from `stream`: its whole data frames in order (lengths up to
/// [`FRAME_CAP`], of whole elements), until a frame it cannot take or the end; whether that
/// end is waiting for more.
fn reference(stream: &[u8], granule: usize) -> (Vec<(FrameHeader, Vec<u8>)>, bool) {
    let mut frames = Vec::new();
    let mut rest = stream;
    loop {
        let Some(b) = rest
            .get(..HEADER_LEN)
            .and_then(|b| <&[u8; HEADER_LEN]>::try_from(b).ok())
        else {
            return (frames, true);
        };
        let Ok(h) = FrameHeader::decode(b) else {
            return (frames, false);
        };
        let n = h.len as usize;
        match h.kind {
            // An abort waits for its message, unless it could never be buffered.
            FrameKind::Abort => {
                return (
                    frames,
                    rest.len() < HEADER_LEN + n && HEADER_LEN + n <= 256 << 10,
                )
            }
            FrameKind::Bye => return (frames, false),
            FrameKind::Data => {}
        }
        if n > FRAME_CAP || !n.is_multiple_of(granule) {
            return (frames, false);
        }
        let Some(payload) = rest.get(HEADER_LEN..HEADER_LEN + n) else {
            return (frames, true);
        };
        frames.push((h, payload.to_vec()));
        rest = &rest[HEADER_LEN + n..];
    }
}

/// The TCP transport's frame reassembly. The first byte chooses the receiver (element size
/// 1, 2, 4 or 8; copying directly or through `consume`), the rest is what the peer sends,
/// written whole and, again, in pieces split at points the input draws. Checks: no panic;
/// the frames received and how the stream ended (waiting, or the kind of error) are the same
/// whether it came whole or in pieces; they are the frames a reference reading of the
/// stream finds; payloads are handed over in whole elements.
pub fn tcp_frames(data: &[u8]) {
    let (ctrl, stream) = super::split_first(data);
    let granule = 1 << (ctrl & 3);
    let direct = ctrl & 4 != 0;
    with_pair(|p| {
        let whole = receive(
            p,
            &[stream][..usize::from(!stream.is_empty())],
            granule,
            direct,
        );
        let split = receive(p, &pieces(data, stream), granule, direct);
        assert_eq!(
            whole, split,
            "the frames depend on how the stream was split"
        );
        let (frames, waiting) = reference(stream, granule);
        assert_eq!(whole.0, frames, "frames other than the stream's");
        // Abort frames end in the error their class names; frames whose message is longer
        // than the receive buffer are reported at once (their message cut short).
        if !stream.is_empty() && waiting != (whole.1 == "waiting") {
            let abort = stream
                .get(
                    frames
                        .iter()
                        .map(|(h, _)| HEADER_LEN + h.len as usize)
                        .sum::<usize>()..,
                )
                .is_some_and(|r| r.first() == Some(&(FrameKind::Abort as u8)));
            assert!(
                abort,
                "the stream ended {:?} where {waiting} was expected",
                whole.1
            );
        }
    });
}

/// A valid stream for [`tcp_frames`]: data frames of whole elements, sometimes an abort or
/// a goodbye at the end, sometimes cut short.
pub(super) fn tcp_frames_sample(r: &mut dyn Rng) -> Vec<u8> {
    let ctrl = r.below(8) as u8;
    let g = 1usize << (ctrl & 3);
    let mut out = vec![ctrl];
    for _ in 0..r.below(6) {
        let most = if r.below(8) == 0 { 600 } else { 24 };
        let n = g * r.below(most);
        let h = FrameHeader {
            kind: FrameKind::Data,
            coll: r.below(8) as u8,
            dtype: r.below(12) as u8,
            op: r.below(5) as u8,
            root: r.below(4) as u32,
            len: n as u32,
            seq: r.next_u64() >> r.below(64),
            count: (n / g) as u64,
        };
        out.extend_from_slice(&h.encode());
        let mut payload = vec![0u8; n];
        r.fill(&mut payload);
        out.extend_from_slice(&payload);
    }
    match r.below(4) {
        0 => {
            let msg = b"rank 1: lost rank 2 during all_reduce #3";
            let class = [AbortClass::Other, AbortClass::Mismatch][r.below(2)];
            out.extend_from_slice(&FrameHeader::abort(1, msg.len(), class).encode());
            out.extend_from_slice(msg);
        }
        1 => out.extend_from_slice(&FrameHeader::bye().encode()),
        2 if out.len() > 1 => {
            let cut = 1 + r.below(out.len() - 1);
            out.truncate(cut);
        }
        _ => {}
    }
    out
}

// ------------------------------------------------------------------------- door_messages

/// The largest message the reader accepts in [`door_messages`] for each value of the first
/// byte's low bits.
const DOOR_MAX: [usize; 4] = [1, 40, 300, 64 << 10];

/// The messages of a length-prefixed stream (what [`pull_message`] must return), until a
/// length it refuses; whether the end is waiting for more.
fn door_reference(stream: &[u8], max: usize) -> (Vec<Vec<u8>>, bool) {
    let mut out = Vec::new();
    let mut rest = stream;
    loop {
        let Some(len) = rest.get(..4) else {
            return (out, true);
        };
        let n = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        if n == 0 || n > max {
            return (out, false);
        }
        let Some(m) = rest.get(4..4 + n) else {
            return (out, true);
        };
        out.push(m.to_vec());
        rest = &rest[4 + n..];
    }
}

/// The data listener's reader of a candidate's handshake messages ([`pull_message`]), on a
/// blocking socket, over the stream after the first byte (whose low bits choose the largest
/// message). Checks: no panic; it never blocks (each call returns at once, the socket is
/// not made non-blocking); it never holds more than one message and its length prefix, nor
/// returns a message longer than the largest or empty; the messages and the ending are those
/// of a reference reading of the stream, however it was split.
pub fn door_messages(data: &[u8]) {
    let (ctrl, stream) = super::split_first(data);
    let max = DOOR_MAX[usize::from(ctrl & 3)];
    with_pair(|p| {
        let mut got = Vec::new();
        let mut msgs = Vec::new();
        let mut failed = false;
        let mut peek = vec![0u8; stream.len().max(1)];
        'pieces: for piece in pieces(data, stream) {
            deliver(p, piece, &mut peek);
            loop {
                let t = Instant::now();
                let r = pull_message(&p.reader, &mut got, max);
                assert!(
                    t.elapsed() < Duration::from_secs(1),
                    "pull_message blocked for {:?}",
                    t.elapsed()
                );
                assert!(got.len() <= 4 + max, "holds {} bytes", got.len());
                match r {
                    Ok(Some(m)) => {
                        assert!(
                            !m.is_empty() && m.len() <= max,
                            "a message of {} bytes",
                            m.len()
                        );
                        msgs.push(m);
                    }
                    Ok(None) => break,
                    Err(_) => {
                        failed = true;
                        break 'pieces;
                    }
                }
            }
        }
        // Nothing more to read: a call returns at once and says so.
        if !failed {
            let t = Instant::now();
            assert_eq!(pull_message(&p.reader, &mut got, max), Ok(None));
            assert!(t.elapsed() < Duration::from_secs(1), "pull_message blocked");
        }
        drain(p);
        let (want, waiting) = door_reference(stream, max);
        assert_eq!(msgs, want, "messages other than the stream's");
        assert_eq!(
            !failed, waiting,
            "the reader ended otherwise than the stream"
        );
    });
}

/// A valid stream for [`door_messages`]: length-prefixed messages, sometimes cut short.
pub(super) fn door_messages_sample(r: &mut dyn Rng) -> Vec<u8> {
    let ctrl = r.below(4) as u8;
    let max = DOOR_MAX[usize::from(ctrl)];
    let mut out = vec![ctrl];
    for _ in 0..r.below(6) {
        let n = 1 + r.below(max.min(200));
        out.extend_from_slice(&(n as u32).to_le_bytes());
        let mut m = vec![0u8; n];
        r.fill(&mut m);
        out.extend_from_slice(&m);
    }
    if r.below(4) == 0 && out.len() > 1 {
        let cut = 1 + r.below(out.len() - 1);
        out.truncate(cut);
    }
    out
}

// ------------------------------------------------------------------------- store_replies

/// A fake TCPStore server: for each connection, the bytes it answers with after the
/// handshake, and whether it echoes the client's PING nonce.
struct FakeStore {
    port: u16,
    scripts: mpsc::Sender<(Vec<u8>, bool)>,
    done: mpsc::Receiver<()>,
}

fn fake_store() -> FakeStore {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("a loopback listener");
    let port = l.local_addr().expect("its address").port();
    let (scripts, rx) = mpsc::channel::<(Vec<u8>, bool)>();
    let (done_tx, done) = mpsc::channel();
    std::thread::spawn(move || {
        for (script, echo) in rx {
            let Ok((mut s, _)) = l.accept() else {
                return;
            };
            let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
            // VALIDATE (query byte + u32 magic), PING (query byte + u32 nonce).
            let mut hs = [0u8; 10];
            if s.read_exact(&mut hs).is_ok() {
                let mut nonce = [hs[6], hs[7], hs[8], hs[9]];
                if !echo {
                    nonce[0] ^= 1;
                }
                let _ = s.write_all(&nonce);
                let _ = s.write_all(&script);
            }
            // The end of the answers, then whatever the client still sends, until it goes.
            let _ = s.shutdown(std::net::Shutdown::Write);
            let mut sink = [0u8; 4096];
            while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
            let _ = done_tx.send(());
        }
    });
    FakeStore {
        port,
        scripts,
        done,
    }
}

thread_local! {
    static STORE: RefCell<Option<FakeStore>> = const { RefCell::new(None) };
}

/// The TCPStore client ([`crate::bootstrap::store::TcpStore`]) reading a server's replies:
/// after the handshake (the first byte's low bit: the server echoes the PING nonce or not),
/// the server answers with the rest of the input and closes; the client runs a request
/// sequence the first byte chooses (`get`, `add`, `check`, `wait`). Checks: no panic; every
/// call returns, well before its deadline, since the server closes; a value is never longer
/// than what the server sent. Also the in-process store's parsing of a stored counter
/// (torch's decimal text) on the same bytes: `add` succeeds exactly when they are a decimal
/// integer, and adds to it.
pub fn store_replies(data: &[u8]) {
    use crate::bootstrap::store::{MemStore, Store, TcpStore};
    let (ctrl, script) = super::split_first(data);
    // The in-process store's counter parsing.
    let mem = MemStore::new();
    mem.set("k", script).expect("a set");
    let want = std::str::from_utf8(script)
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok());
    match (mem.add("k", 3), want) {
        (Ok(v), Some(w)) => assert_eq!(Some(v), w.checked_add(3)),
        (Err(_), Some(w)) => assert!(w.checked_add(3).is_none(), "{w} + 3 refused"),
        (Ok(v), None) => panic!("added to a value that is no integer: {v}"),
        (Err(_), None) => {}
    }
    STORE.with(|s| {
        let mut s = s.borrow_mut();
        let server = s.get_or_insert_with(fake_store);
        server
            .scripts
            .send((script.to_vec(), ctrl & 1 == 0))
            .expect("the fake store runs");
        let t0 = Instant::now();
        let limit = Duration::from_secs(2);
        if let Ok(c) = TcpStore::connect("127.0.0.1", server.port, limit) {
            let order = [ctrl >> 1 & 3, ctrl >> 3 & 3, ctrl >> 5 & 3];
            for q in order {
                match q {
                    0 => {
                        if let Ok(v) = c.get("key", limit) {
                            assert!(v.len() <= script.len(), "a value longer than the reply");
                        }
                    }
                    1 => {
                        let _ = c.add("counter", 1);
                    }
                    2 => {
                        let _ = c.check(&["a", "b"]);
                    }
                    _ => {
                        let _ = c.wait(&["a"], limit);
                    }
                }
            }
        }
        server
            .done
            .recv_timeout(Duration::from_secs(10))
            .expect("the fake store finished the connection");
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the client took {:?} against a server that closed",
            t0.elapsed()
        );
    });
}

/// Replies a real server could send to [`store_replies`]' requests: STOP_WAITING, a GET's
/// length-prefixed value, an ADD's `i64`, READY / NOT_READY, in some order.
pub(super) fn store_replies_sample(r: &mut dyn Rng) -> Vec<u8> {
    let mut out = vec![(r.below(64) as u8) << 1];
    for _ in 0..1 + r.below(4) {
        match r.below(4) {
            0 => {
                out.push(0);
                let n = r.below(40);
                out.extend_from_slice(&(n as u64).to_le_bytes());
                out.extend((0..n).map(|_| r.next_u64() as u8));
            }
            1 => out.extend_from_slice(&(r.next_u64() as i64).to_le_bytes()),
            2 => out.push(r.below(2) as u8),
            _ => out.extend_from_slice(&[0, 1]),
        }
    }
    if r.below(4) == 0 {
        out.truncate(1 + r.below(out.len()));
    }
    out
}
