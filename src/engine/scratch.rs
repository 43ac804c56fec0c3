//! The drive loops' per-call bookkeeping ([`Scratch`]): which steps are done, each peer's
//! queues of sends and receives in program order, their progress in the transport, and the
//! peers a blocked loop waits on. Kept in the engine between calls, so that a call allocates
//! nothing once the vectors have grown to size.

use std::collections::VecDeque;
use std::time::Instant;

use super::staged::StagedScratch;
use crate::plan::{Op, Program};
use crate::transport::{Interest, RecvProgress, SendProgress};

/// Reusable per-call bookkeeping, kept to avoid allocating on every call.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    pub(super) done: Vec<bool>,
    /// Steps not yet complete.
    pub(super) remaining: usize,
    pub(super) sendq: Vec<VecDeque<u32>>,
    pub(super) recvq: Vec<VecDeque<u32>>,
    pub(super) local: Vec<u32>,
    pub(super) active: Vec<usize>,
    pub(super) send_prog: Vec<SendProgress>,
    pub(super) recv_prog: Vec<RecvProgress>,
    pub(super) interest: Vec<Interest>,
    /// When the head send / receive of each peer could first go (only while tracing).
    pub(super) send_started: Vec<Option<Instant>>,
    pub(super) recv_started: Vec<Option<Instant>>,
    /// The device (staged and direct) path's own bookkeeping.
    pub(super) staged: StagedScratch,
}

impl Scratch {
    /// Marks step `i` complete.
    pub(super) fn complete(&mut self, i: u32) {
        self.done[i as usize] = true;
        self.remaining -= 1;
    }

    /// Completes the head send to `p`.
    pub(super) fn complete_send(&mut self, p: usize, i: u32) {
        self.send_prog[p] = SendProgress::default();
        self.sendq[p].pop_front();
        self.complete(i);
    }

    /// Completes the head receive from `p`.
    pub(super) fn complete_recv(&mut self, p: usize, i: u32) {
        self.recv_prog[p] = RecvProgress::default();
        self.recvq[p].pop_front();
        self.complete(i);
    }

    /// The peers whose head send or receive may progress, for [`Transport::wait`].
    ///
    /// [`Transport::wait`]: crate::transport::Transport::wait
    pub(super) fn collect_interest(&mut self, prog: &Program) {
        let ready = |i: u32| prog.deps(i as usize).iter().all(|&d| self.done[d as usize]);
        self.interest.clear();
        for &p in &self.active {
            let send = self.sendq[p].front().is_some_and(|&i| ready(i));
            let recv = self.recvq[p].front().is_some_and(|&i| ready(i));
            if send || recv {
                self.interest.push(Interest {
                    peer: p,
                    send,
                    recv,
                });
            }
        }
    }

    /// Resets for a call of `prog` over `world` ranks: every step to do, queued by peer and
    /// direction (local steps apart), and the peers that have any.
    pub(super) fn prepare(&mut self, world: usize, prog: &Program) {
        let n = prog.steps.len();
        self.done.clear();
        self.done.resize(n, false);
        self.remaining = n;
        if self.sendq.len() != world {
            self.send_started = vec![None; world];
            self.recv_started = vec![None; world];
            self.sendq = (0..world).map(|_| VecDeque::new()).collect();
            self.recvq = (0..world).map(|_| VecDeque::new()).collect();
            self.send_prog = vec![SendProgress::default(); world];
            self.recv_prog = vec![RecvProgress::default(); world];
        }
        for q in self.sendq.iter_mut().chain(self.recvq.iter_mut()) {
            q.clear();
        }
        self.send_prog.fill(SendProgress::default());
        self.recv_prog.fill(RecvProgress::default());
        self.send_started.fill(None);
        self.recv_started.fill(None);
        self.local.clear();
        self.active.clear();
        for (i, st) in prog.steps.iter().enumerate() {
            match st.op {
                Op::Send { peer, .. } => self.sendq[peer].push_back(i as u32),
                Op::Recv { peer, .. } => self.recvq[peer].push_back(i as u32),
                _ => self.local.push(i as u32),
            }
        }
        for p in 0..world {
            if !self.sendq[p].is_empty() || !self.recvq[p].is_empty() {
                self.active.push(p);
            }
        }
    }
}
