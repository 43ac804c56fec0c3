//! The exit rule over TCP (a peer's exit or abort fails only what still needs that peer), on
//! loopback connections inside one process: an abort from a peer that had completed the
//! running collective is held for the next call, and the waits meanwhile sleep; a peer whose
//! stream ended after its last frame fails, during a collective, only the receive that needs
//! more from it, and outside a collective at once.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::{TcpOptions, TcpTransport};
use crate::error::{Error, Result};
use crate::transport::{
    AbortClass, FrameHeader, FrameKind, Interest, RecvProgress, RecvSink, Transport, NO_OP,
};

/// A connected pair of loopback streams.
fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

/// Rank 0 and rank 1 of three as transports, and rank 2's end of its stream to rank 0.
fn three() -> (TcpTransport, TcpTransport, TcpStream) {
    let (s01, s10) = pair();
    let (s02, s20) = pair();
    let opts = TcpOptions::default();
    let t0 = TcpTransport::new(0, 3, vec![None, Some(s01), Some(s02)], opts).unwrap();
    let t1 = TcpTransport::new(1, 3, vec![Some(s10), None, None], opts).unwrap();
    (t0, t1, s20)
}

struct Collect(Vec<u8>);

impl RecvSink for Collect {
    fn on_header(&mut self, hdr: &FrameHeader) -> Result<usize> {
        self.0 = vec![0; hdr.len as usize];
        Ok(hdr.len as usize)
    }
    fn direct(&mut self) -> Option<&mut [u8]> {
        Some(&mut self.0)
    }
    fn granule(&self) -> usize {
        1
    }
    fn consume(&mut self, _: &[u8]) -> Result<()> {
        unreachable!("copying receive")
    }
}

/// Waits `n` times for 20 ms each; the first error, or how long the waits took.
fn waits(t: &mut TcpTransport, interest: &[Interest], n: usize) -> Result<Duration> {
    let t0 = Instant::now();
    for _ in 0..n {
        t.wait(interest, Instant::now() + Duration::from_millis(20))?;
    }
    Ok(t0.elapsed())
}

#[test]
fn an_abort_from_a_peer_that_completed_the_running_collective_fails_only_the_next_call() {
    let (mut t0, mut t1, _r2) = three();
    // Rank 1 completed collective #1, lost rank 2 in #2 and aborted.
    t1.collective_progress(Some(2), 1);
    t1.abort(
        1,
        AbortClass::Other,
        "rank 1: lost rank 2 during all_reduce #2",
    );
    // Rank 0 is still finishing #1: its waits go on, and sleep (the hang-up is not polled).
    t0.collective_progress(Some(1), 0);
    let took = waits(&mut t0, &[], 5).expect("#1 is not failed by the abort");
    assert!(took >= Duration::from_millis(80), "waits spun: {took:?}");
    t0.check_peers().expect("nor by a check");
    // Its next call fails with the abort.
    t0.collective_progress(None, 1);
    t0.collective_progress(Some(2), 1);
    match t0.check_peers() {
        Err(Error::Aborted { by: 1, reason, .. }) => assert!(reason.contains("lost rank 2")),
        other => panic!("expected rank 1's abort, got {other:?}"),
    }
}

#[test]
fn an_abort_from_a_peer_that_had_not_completed_the_running_collective_fails_it() {
    let (mut t0, mut t1, _r2) = three();
    t1.collective_progress(Some(1), 0);
    t1.abort(
        1,
        AbortClass::Other,
        "rank 1: lost rank 2 during all_reduce #1",
    );
    t0.collective_progress(Some(1), 0);
    match waits(&mut t0, &[], 50) {
        Err(Error::Aborted { by: 1, .. }) => {}
        other => panic!("expected rank 1's abort, got {other:?}"),
    }
}

#[test]
fn a_peer_that_exited_after_its_last_frame_fails_only_what_needs_more_from_it() {
    let (mut t0, _t1, mut r2) = three();
    let hdr = FrameHeader {
        kind: FrameKind::Data,
        coll: 0,
        dtype: 0,
        op: NO_OP,
        root: 0,
        len: 8,
        seq: 1,
        count: 2,
    };
    r2.write_all(&hdr.encode()).unwrap();
    r2.write_all(&[7; 8]).unwrap();
    drop(r2); // exits without a goodbye
    t0.collective_progress(Some(1), 0);
    let from2 = [Interest {
        peer: 2,
        recv: true,
        send: false,
    }];
    waits(&mut t0, &from2, 3).expect("a wait does not fail the collective");
    let mut sink = Collect(Vec::new());
    let mut rp = RecvProgress::default();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !t0.recv(2, &mut rp, &mut sink).expect("its last frame") {
        assert!(Instant::now() < deadline, "the last frame never arrived");
        t0.wait(&from2, Instant::now() + Duration::from_millis(20))
            .unwrap();
    }
    assert_eq!(sink.0, [7; 8]);
    // Nothing more is needed from it in this collective: the waits go on, and sleep.
    let took = waits(&mut t0, &[], 5).expect("the end of its stream fails nothing yet");
    assert!(took >= Duration::from_millis(80), "waits spun: {took:?}");
    // A receive that needs more from it fails, naming it.
    let mut rp = RecvProgress::default();
    match t0.recv(2, &mut rp, &mut sink) {
        Err(Error::PeerLost { peer: 2, .. }) => {}
        other => panic!("expected rank 2 lost, got {other:?}"),
    }
}

#[test]
fn outside_a_collective_a_peer_found_gone_fails_the_wait_at_once() {
    let (mut t0, _t1, r2) = three();
    drop(r2);
    match waits(&mut t0, &[], 50) {
        Err(Error::PeerLost { peer: 2, .. }) => {}
        other => panic!("expected rank 2 lost, got {other:?}"),
    }
}

/// Rank 0 of 18: the sockets to ranks 1–16 are full (they read nothing), rank 17 reads. Its
/// abort tells rank 17 at once and gives up on the others within one 200 ms deadline for
/// them all (each used to get 200 ms of its own, one after another: 3.2 s here, 51 s at 256).
#[test]
fn an_abort_waits_for_full_sockets_once_for_them_all() {
    const N: usize = 18;
    let mut ours = vec![None];
    let mut theirs = Vec::new();
    for _ in 1..N {
        let (a, b) = pair();
        // Fixed small buffers (no autotuning to make room again after the fill).
        nix::sys::socket::setsockopt(&a, nix::sys::socket::sockopt::SndBuf, &4096).unwrap();
        nix::sys::socket::setsockopt(&b, nix::sys::socket::sockopt::RcvBuf, &4096).unwrap();
        ours.push(Some(a));
        theirs.push(b);
    }
    // Fill the silent peers' directions.
    for s in ours.iter_mut().take(N - 1).flatten() {
        s.set_nonblocking(true).unwrap();
        let chunk = vec![0u8; 1 << 20];
        while s.write(&chunk).is_ok() {}
        s.set_nonblocking(false).unwrap();
    }
    // The buffers as they are (no resize after the fill above, which would make room).
    let opts = TcpOptions { socket_buffer: 0 };
    let mut t0 = TcpTransport::new(0, N, ours, opts).unwrap();
    let start = Instant::now();
    t0.abort(0, AbortClass::Other, "rank 0: a test abort");
    let took = start.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "the abort took {took:?}"
    );
    // The reading rank got the abort frame.
    let mut r5 = theirs.pop().unwrap();
    r5.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut head = [0u8; crate::transport::HEADER_LEN];
    std::io::Read::read_exact(&mut r5, &mut head).expect("rank 5's abort frame");
    let h = FrameHeader::decode(&head).expect("a frame header");
    assert_eq!(h.kind, FrameKind::Abort);
}
