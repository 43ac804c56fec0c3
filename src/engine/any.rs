//! Receives from any source ([`crate::Communicator::recv_any`], MPI's `MPI_ANY_SOURCE`,
//! torch's `dist.recv(src=None)`): the first point-to-point message that reaches this rank
//! from any peer.
//!
//! Frames from one peer arrive in order, and a peer's next frame to this rank may belong to a
//! later collective rather than to a send (a peer that is already further on), so the receive
//! looks at every peer's next frame without taking it ([`Transport::peek`]) and commits to
//! the first peer whose next frame is the next send this rank has to receive from it (its
//! per-pair sequence number is the next one, or a later one: the peer sent a message this
//! rank never received, an empty one, and the receive fails at once naming both numbers).
//! From there it is an ordinary receive from that
//! peer: the frame's descriptor is checked against the call (a sender of a different count or
//! type is a mismatch), and its sequence number is that pair's. The scan starts at a
//! different peer every time, so that a peer that sends without pause does not starve the
//! others.
//!
//! Nothing hangs: the call has the deadline of any call. A peer that closed its communicator
//! or is gone is passed over (everything it sent before was taken); when every peer is gone
//! the receive fails with that loss, otherwise with a timeout that names the peers it
//! waited for. An abort from any peer fails it at once.
//!
//! [`Transport::peek`]: crate::transport::Transport::peek

use std::time::{Duration, Instant};

use super::pace::{Pace, Pacer};
use super::{Call, Engine};
use crate::error::{Error, Result};
use crate::plan::Collective;
use crate::transport::{FrameHeader, FrameKind, Interest};

/// The operation named in the errors of a receive from any source before it found its peer.
pub(crate) const RECV_ANY: &str = "recv from any source";

impl Engine {
    /// Receives the next point-to-point message from whichever peer's comes first into `dst`
    /// (`call` is a receive: `coll` SendRecv, `is_send` false; its `root` is ignored) and
    /// returns the peer. With `wait`, gives up quietly after that long when no message came
    /// (`Ok(None)`: nothing was received, no sequence number taken, the engine as it was);
    /// without, the call's deadline applies and running out of it is a timeout.
    pub fn run_recv_any(
        &mut self,
        call: &Call,
        dst: &mut [u8],
        wait: Option<Duration>,
    ) -> Result<Option<usize>> {
        self.ready()?;
        if self.world < 2 {
            return Err(Error::invalid(
                Some(self.rank),
                RECV_ANY,
                "no other rank to receive from (world size 1)",
            ));
        }
        let start = Instant::now();
        let timeout = self.call_timeout.unwrap_or(self.opts.timeout);
        let deadline = crate::time::deadline(start, timeout);
        let give_up = wait.map(|w| crate::time::deadline(start, w).min(deadline));
        let found = self.find_source(start, deadline, give_up);
        let peer = match found {
            Ok(Some(p)) => p,
            Ok(None) => return Ok(None),
            Err(e) => {
                let e = e.at_rank(self.rank);
                self.fail(e.clone());
                return Err(e);
            }
        };
        // An ordinary receive from `peer` now, within what is left of the deadline.
        let saved = self.call_timeout;
        self.call_timeout = Some(deadline.saturating_duration_since(Instant::now()));
        let c = Call {
            root: peer,
            is_send: false,
            recv_from: None,
            ..*call
        };
        let r = self.run(&c, &[], dst);
        self.call_timeout = saved;
        r.map(|()| Some(peer))
    }

    /// Waits for a peer whose next frame is the next send to this rank; `Ok(None)` when
    /// `give_up` passed first.
    fn find_source(
        &mut self,
        start: Instant,
        deadline: Instant,
        give_up: Option<Instant>,
    ) -> Result<Option<usize>> {
        let (rank, world) = (self.rank, self.world);
        let peers: Vec<usize> = (0..world).filter(|&q| q != rank).collect();
        // Where the scan starts: moves on with every message received.
        let first = (self.p2p_received.iter().sum::<u64>() as usize) % peers.len();
        let mut gone: Vec<Option<Error>> = vec![None; world];
        let mut pacer = Pacer::new(
            &self.opts,
            self.spin.now(),
            start,
            give_up.unwrap_or(deadline),
        );
        let mut interest = Vec::with_capacity(peers.len());
        loop {
            for k in 0..peers.len() {
                let q = peers[(first + k) % peers.len()];
                if gone[q].is_some() {
                    continue;
                }
                match self.transport.peek(q) {
                    Ok(Some(h)) if self.next_send_from(q, &h) => return Ok(Some(q)),
                    Ok(_) => {}
                    Err(e @ Error::PeerLost { .. }) => gone[q] = Some(e),
                    Err(e) => return Err(e.in_op(RECV_ANY)),
                }
            }
            let alive: Vec<usize> = peers
                .iter()
                .copied()
                .filter(|&q| gone[q].is_none())
                .collect();
            if alive.is_empty() {
                let last = gone.into_iter().flatten().last();
                return Err(last.map_or_else(
                    || Error::invalid(Some(rank), RECV_ANY, "no peer"),
                    |e| e.in_op(RECV_ANY),
                ));
            }
            match pacer.after_pass(false, &self.abort) {
                Pace::Again => continue,
                Pace::Aborted => return Err(self.aborted_error(RECV_ANY)),
                Pace::TimedOut(waited) => {
                    if give_up.is_some_and(|g| g < deadline) {
                        return Ok(None);
                    }
                    return Err(self.no_source_error(&alive, &gone, waited));
                }
                Pace::Block => {}
            }
            interest.clear();
            interest.extend(alive.iter().map(|&peer| Interest {
                peer,
                recv: true,
                send: false,
            }));
            self.transport.wait(&interest, pacer.wait_until())?;
        }
    }

    /// Whether `h`, the next frame from `q`, is a send this rank has to take now: the next
    /// one from `q`, or a later one, which says that `q` sent a message this rank never
    /// received (an empty send takes its number but travels as no frame): the receive from
    /// `q` then fails at once naming both numbers, as a named receive does, where passing
    /// over it waited for the deadline. A collective's frame, or anything else, waits for its
    /// own call.
    fn next_send_from(&self, q: usize, h: &FrameHeader) -> bool {
        h.kind == FrameKind::Data
            && h.coll & 0x0f == Collective::SendRecv.code()
            && h.seq > self.p2p_received[q]
    }

    /// The timeout of a receive from any source that found no message.
    fn no_source_error(&self, alive: &[usize], gone: &[Option<Error>], waited: Duration) -> Error {
        let list = |v: &[usize]| {
            v.iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let gone: Vec<usize> = (0..gone.len()).filter(|&q| gone[q].is_some()).collect();
        let mut detail = format!(
            "waiting for a message from any of ranks {}; none came",
            list(alive)
        );
        if !gone.is_empty() {
            detail += &format!(" (ranks {} are gone)", list(&gone));
        }
        Error::Timeout {
            rank: self.rank,
            peer: None,
            op: RECV_ANY.into(),
            waited,
            detail,
        }
    }
}
