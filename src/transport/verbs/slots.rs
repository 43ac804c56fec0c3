//! Slot and queue accounting of one connection, as plain counters (no FFI, unit-tested).
//!
//! Per direction there are `n` slots. The receiver owns `n` receive slots; the sender owns `n`
//! staging slots and a ring of `n` clear-to-send (CTS) entries that the receiver writes.
//! Sequence numbers count from 0 for the life of the connection:
//!
//! * frame `k` goes into receive slot `k % n` and is staged in staging slot `k % n`;
//! * the sender may write frame `k` once CTS `k` arrived. The first `n` CTS are implied by the
//!   connection information (every slot starts free); CTS `k + n` is written by the receiver
//!   when it has consumed frame `k`, into ring entry `(k + n) % n`.
//!
//! CTS `k` implies frame `k − n` was consumed, so its write completed: staging slot `k % n` is
//! free again without any send completion, which is why data writes need not be signalled.
//! The send queue still needs its entries retired: every `depth / 2`-th work request is
//! signalled, and its completion retires everything posted before it.

#![forbid(unsafe_code)]

/// Sender-side counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendSide {
    /// Slots per direction.
    pub n: u64,
    /// CTS entries known to have arrived (their completions were polled).
    pub cts_arrived: u64,
    /// Frames written so far.
    pub sent: u64,
}

impl SendSide {
    /// A fresh connection: the first `n` slots are free.
    pub fn new(n: u64) -> Self {
        SendSide {
            n,
            cts_arrived: n,
            sent: 0,
        }
    }

    /// The CTS sequence (= frame sequence) of the next frame, if a slot is free for it.
    pub fn next_credit(&self) -> Option<u64> {
        (self.sent < self.cts_arrived).then_some(self.sent)
    }

    /// Ring entry / staging slot of sequence `seq`.
    pub fn index(&self, seq: u64) -> usize {
        (seq % self.n) as usize
    }

    /// Whether the entry for `seq` is one the receiver wrote (the first `n` are implied).
    pub fn cts_written_by_peer(&self, seq: u64) -> bool {
        seq >= self.n
    }
}

/// Receiver-side counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvSide {
    /// Slots per direction.
    pub n: u64,
    /// Frames whose completions were polled.
    pub arrived: u64,
    /// Frames handed to the engine.
    pub taken: u64,
    /// Frames whose slots are free again: every frame below this index was released (a direct
    /// frame's landing slot stays held after it was taken, until the engine releases it).
    pub consumed: u64,
    /// CTS entries written to the sender (implied initial ones included).
    pub cts_posted: u64,
}

impl RecvSide {
    /// A fresh connection: `n` slots advertised by the connection information.
    pub fn new(n: u64) -> Self {
        RecvSide {
            n,
            arrived: 0,
            taken: 0,
            consumed: 0,
            cts_posted: n,
        }
    }

    /// Slot of the next frame to take, if one arrived.
    pub fn next_frame(&self) -> Option<usize> {
        (self.taken < self.arrived).then_some((self.taken % self.n) as usize)
    }

    /// Recomputes `consumed` after a take or a release: the released prefix ends at the
    /// oldest frame still held (`oldest_held`), or at `taken` when none is.
    pub fn settle(&mut self, oldest_held: Option<u64>) {
        self.consumed = oldest_held.unwrap_or(self.taken).min(self.taken);
    }

    /// The next CTS to write (sequence, slot), if a consumed slot is not re-advertised yet.
    pub fn pending_cts(&self) -> Option<(u64, usize)> {
        (self.cts_posted < self.consumed + self.n)
            .then_some((self.cts_posted, (self.cts_posted % self.n) as usize))
    }

    /// Whether one more frame may arrive (a protocol check: the sender never exceeds the
    /// slots it was given).
    pub fn may_arrive(&self) -> bool {
        self.arrived < self.cts_posted
    }
}

/// Send-queue accounting: how many work requests are posted but not yet retired by a
/// signalled completion, and when to signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendQueue {
    /// Capacity of the send queue.
    pub depth: u64,
    /// Work requests posted (the index of the next one).
    pub posted: u64,
    /// Everything below this index is retired.
    pub retired: u64,
    /// Index + 1 of the last signalled request.
    pub last_signalled: u64,
}

impl SendQueue {
    /// An empty queue of `depth` entries (≥ 2).
    pub fn new(depth: u64) -> Self {
        SendQueue {
            depth: depth.max(2),
            posted: 0,
            retired: 0,
            last_signalled: 0,
        }
    }

    /// Whether one more request fits.
    pub fn has_room(&self) -> bool {
        self.has_room_for(1)
    }

    /// Whether `k` more requests fit.
    pub fn has_room_for(&self, k: u64) -> bool {
        self.posted - self.retired + k <= self.depth
    }

    /// Whether the next request must be signalled so that the queue keeps draining.
    pub fn must_signal(&self) -> bool {
        self.posted + 1 - self.last_signalled >= self.depth / 2
    }

    /// Records a post; returns its index.
    pub fn post(&mut self, signalled: bool) -> u64 {
        let i = self.posted;
        self.posted += 1;
        if signalled {
            self.last_signalled = self.posted;
        }
        i
    }

    /// Records the completion of signalled request `index` (its low
    /// [`INDEX_BITS`](super::wire::INDEX_BITS), as a `wr_id` carries it): it and everything
    /// before it are retired. The full index is the latest posted one with those low bits
    /// (a completion is of a request within the queue's depth of the last post).
    pub fn complete(&mut self, index: u64) {
        let mask = (1u64 << super::wire::INDEX_BITS) - 1;
        let last = self.posted.saturating_sub(1);
        let mut full = (last & !mask) | (index & mask);
        if full > last {
            full = full.saturating_sub(mask + 1);
        }
        self.retired = self.retired.max(full + 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A completion carries the low bits of its index: across the point where they wrap,
    /// the queue still retires up to the right request (it kept the smaller, older count and
    /// stopped with a full queue).
    #[test]
    fn a_completion_past_the_index_bits_retires_the_right_request() {
        let wrap = 1u64 << super::super::wire::INDEX_BITS;
        let mut q = SendQueue::new(8);
        q.posted = wrap - 2;
        q.retired = wrap - 4;
        for _ in 0..4 {
            q.post(false);
        }
        // Posted: wrap - 2, wrap - 1, wrap, wrap + 1; the last completes as low bits 1.
        q.complete((wrap + 1) & (wrap - 1));
        assert_eq!(q.retired, wrap + 2);
        assert!(q.has_room_for(8));
        // An older completion, from before the wrap, moves nothing back.
        q.complete((wrap - 1) & (wrap - 1));
        assert_eq!(q.retired, wrap + 2);
        let mut q = SendQueue::new(4);
        let i = q.post(true);
        q.complete(i);
        assert_eq!(q.retired, 1);
    }

    #[test]
    fn a_fresh_connection_has_every_slot_free_and_no_more() {
        let mut s = SendSide::new(4);
        for k in 0..4 {
            assert_eq!(s.next_credit(), Some(k));
            assert!(!s.cts_written_by_peer(k));
            s.sent += 1;
        }
        assert_eq!(
            s.next_credit(),
            None,
            "a fifth frame must wait for a clear-to-send"
        );
        s.cts_arrived += 1;
        assert_eq!(s.next_credit(), Some(4));
        assert_eq!(s.index(4), 0);
        assert!(s.cts_written_by_peer(4));
    }

    #[test]
    fn consuming_a_frame_readvertises_its_slot_in_order() {
        let mut r = RecvSide::new(3);
        assert_eq!(r.next_frame(), None);
        assert_eq!(r.pending_cts(), None);
        r.arrived = 2;
        assert_eq!(r.next_frame(), Some(0));
        r.taken += 1;
        r.settle(None);
        assert_eq!(r.pending_cts(), Some((3, 0)), "CTS 3 re-advertises slot 0");
        r.cts_posted += 1;
        assert_eq!(r.next_frame(), Some(1));
        r.taken += 1;
        r.settle(None);
        assert_eq!(r.pending_cts(), Some((4, 1)));
        r.cts_posted += 1;
        assert_eq!(r.pending_cts(), None);
        // The sender may now have 3 frames outstanding again: arrivals up to cts_posted.
        r.arrived = 5;
        assert!(!r.may_arrive());
    }

    #[test]
    fn a_held_direct_frame_keeps_later_slots_from_being_readvertised() {
        let mut r = RecvSide::new(4);
        r.arrived = 3;
        // Frame 0 is direct and held; frames 1 and 2 are ordinary and taken at once.
        let held = [0u64];
        r.taken = 1;
        r.settle(held.first().copied());
        assert_eq!(
            r.pending_cts(),
            None,
            "frame 0 is still being read by the device"
        );
        r.taken = 3;
        r.settle(held.first().copied());
        assert_eq!(r.consumed, 0);
        assert_eq!(
            r.pending_cts(),
            None,
            "CTS must stay in order behind frame 0"
        );
        assert_eq!(r.next_frame(), None, "but later frames were delivered");
        // Releasing frame 0 frees it and everything taken after it.
        r.settle(None);
        assert_eq!(r.consumed, 3);
        assert_eq!(r.pending_cts(), Some((4, 0)));
    }

    #[test]
    fn sender_and_receiver_agree_over_many_wraps() {
        let n = 5;
        let (mut s, mut r) = (SendSide::new(n), RecvSide::new(n));
        let mut written = std::collections::VecDeque::new();
        for step in 0..1000u64 {
            // Sender writes as long as it has credit.
            while let Some(k) = s.next_credit() {
                assert!(r.may_arrive());
                written.push_back((k, s.index(k)));
                s.sent += 1;
                r.arrived += 1;
            }
            // Receiver consumes one or two frames, in order, from the slot the sender used.
            for _ in 0..(1 + step % 2) {
                if let Some(slot) = r.next_frame() {
                    let (k, used) = written.pop_front().unwrap();
                    assert_eq!(slot, used, "frame {k}");
                    r.taken += 1;
                    r.settle(None);
                }
            }
            while let Some((seq, _slot)) = r.pending_cts() {
                assert_eq!(seq, s.cts_arrived, "CTS arrive in sequence");
                r.cts_posted += 1;
                s.cts_arrived += 1;
            }
            assert!(s.sent - r.consumed <= n);
        }
    }

    #[test]
    fn the_send_queue_never_overflows_when_signalled_requests_complete() {
        let mut q = SendQueue::new(8);
        let mut outstanding_signalled = Vec::new();
        for _ in 0..1000 {
            if !q.has_room() {
                // Only a signalled completion can make room: one must be outstanding.
                let i = outstanding_signalled.remove(0);
                q.complete(i);
                assert!(q.has_room());
            }
            let sig = q.must_signal();
            let i = q.post(sig);
            if sig {
                outstanding_signalled.push(i);
            }
            assert!(q.posted - q.retired <= q.depth);
        }
        assert!(!outstanding_signalled.is_empty());
    }
}
