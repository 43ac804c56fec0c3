//! The one-shot all_reduce through the transport's shared slots
//! ([`Slots`](crate::transport::Slots)): the small calls' path over shared memory. This rank
//! publishes its input once, then takes every rank's contribution in rank order — its own in
//! its turn, the peers' straight out of their slots as they arrive — copying the first and
//! reducing the others in, so that every rank computes the same sum in the same order. No
//! schedule, no frames: one cache line written and n − 1 read for a buffer of up to 32 bytes.
//!
//! It keeps the engine's rules: the call takes its sequence number and tells the transport
//! (which lets a peer that completed it abort without failing it), every header is checked
//! against the call (a peer in another call is a mismatch naming both), the wait spins for
//! [`EngineOptions::spin`](super::EngineOptions::spin) or longer (the engine's adapted spin,
//! `pace::Spin`; yielding when ranks outnumber cores),
//! then sleeps in the transport, never past the deadline nor longer than the abort poll, and a
//! failure poisons the engine and tells every peer.

use std::time::Instant;

use super::frame::{check_header, Desc};
use super::pace::{Pace, Pacer};
use super::trace::Lane;
use super::{flight, Call, Engine};
use crate::error::{Error, Result};
use crate::plan::{Algorithm, Collective};
use crate::reduce;
use crate::types::ReduceOp;

fn no_slots() -> Error {
    super::drive::internal("one-shot call without slots")
}

impl Engine {
    /// Whether `call` runs one-shot through the transport's slots: an all_reduce for which
    /// [`EngineOptions::algorithm`](super::EngineOptions::algorithm) says
    /// [`Algorithm::OneShot`], of a size the slots hold.
    pub(super) fn runs_one_shot(&mut self, call: &Call) -> bool {
        if call.coll != Collective::AllReduce || self.world < 2 {
            return false;
        }
        let bytes = call.count.saturating_mul(call.dtype.size());
        bytes > 0
            && self.opts.settled(self.world, call.coll, bytes) == Some(Algorithm::OneShot)
            && self
                .transport
                .slots()
                .is_some_and(|s| bytes <= s.capacity())
    }

    /// Runs `call` one-shot (see the module docs): sequencing, checking, tracing and
    /// poisoning as [`Engine::run`] does for a compiled schedule.
    pub(super) fn run_one_shot(&mut self, call: &Call, src: &[u8], dst: &mut [u8]) -> Result<()> {
        self.run_one_shot_as(call, flight::FlightPath::Host, src, dst)
    }

    /// [`Engine::run_one_shot`] on host bytes recorded as taken by `path` (a device rank's
    /// staged copy: [`Engine::run_staged`]).
    pub(super) fn run_one_shot_as(
        &mut self,
        call: &Call,
        path: flight::FlightPath,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<()> {
        self.ready()?;
        let seq = self.start_call_unrecorded(call);
        let entry = super::started(call, call.count, Algorithm::OneShot, path, seq);
        let desc = Desc {
            coll: call.coll,
            algo: Algorithm::OneShot,
            seq,
            dtype: call.dtype,
            op: call.op.map_or(crate::transport::NO_OP, ReduceOp::code),
            count: call.count as u64,
            root: 0,
        };
        let t0 = self.trace.is_some().then(Instant::now);
        let result = self
            .one_shot_body(call, &desc, &entry, src, dst)
            .map_err(|e| e.in_op(&desc.op_name()).at_rank(self.rank));
        // The wake-ups `publish` deferred, whatever the outcome: no peer stays asleep on this
        // rank's contribution past the call.
        if let Some(slots) = self.transport.slots() {
            slots.settle();
        }
        if result.is_err() {
            // A failed call's entry ends when it failed (a timeout: the deadline), not at
            // its start.
            self.fl.end_from_clock();
        }
        if let Some(t0) = t0 {
            let args = super::call_trace_args(call, Algorithm::OneShot);
            self.trace_call(&desc.op_name(), t0, args, &result);
        }
        self.end_call(call, seq, result, call.dtype.size())
    }

    fn one_shot_body(
        &mut self,
        call: &Call,
        desc: &Desc,
        entry: &flight::Started,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<()> {
        let published = self.one_shot_publish(call, desc, src, dst);
        // The recorder's entry opens now, while the contribution travels: its clock read and
        // stores delayed the publish by a fifth of an 8-byte call when they came first. The
        // coarse clock stamps it: a precise read cost an eighth of an 8-byte call, and a
        // call that waits reads the clock anyway (its pacer).
        self.flight_start_coarse(entry);
        published?;
        self.one_shot_gather(call, desc, src, dst)
    }

    /// Checks the buffers and publishes this rank's contribution: from `src`, or in place
    /// (`src` empty) from `dst`, which `one_shot_gather` overwrites before it takes this
    /// rank's turn, so kept in `one_shot_input` first, except on rank 0 (whose turn comes
    /// first: its contribution stays where it is).
    fn one_shot_publish(&mut self, call: &Call, desc: &Desc, src: &[u8], dst: &[u8]) -> Result<()> {
        let rank = self.rank;
        let dtype = call.dtype;
        let bytes = call.count * dtype.size();
        let input = if src.is_empty() { dst } else { src };
        if input.len() < bytes || dst.len() < bytes {
            return Err(Error::invalid(
                Some(rank),
                call.coll.name(),
                format!(
                    "buffers hold {} and {} bytes, the call needs {bytes}",
                    input.len(),
                    dst.len()
                ),
            ));
        }
        let input = if src.is_empty() && rank != 0 {
            self.one_shot_input.clear();
            self.one_shot_input.extend_from_slice(&dst[..bytes]);
            &self.one_shot_input
        } else {
            &input[..bytes]
        };
        let slots = self.transport.slots().ok_or_else(no_slots)?;
        slots.publish(&desc.header(bytes), input)
    }

    /// Takes every rank's contribution in rank order into `dst` (this rank's as
    /// [`Engine::one_shot_publish`] left it), after that publish. Rank 1 takes rank 0's and
    /// its own in one pass (`reduce_into`, the same operations in the same order as a copy
    /// and a reduce): with rank 0's in place, a 2-rank call copies only rank 1's input.
    fn one_shot_gather(
        &mut self,
        call: &Call,
        desc: &Desc,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<()> {
        let (rank, world) = (self.rank, self.world);
        let dtype = call.dtype;
        let bytes = call.count * dtype.size();
        let full = call.op.unwrap_or(ReduceOp::Sum);
        let op = full.step_op();
        let in_place = src.is_empty();
        // In place on rank 0 this is not read: its contribution is `out` before anything else.
        let mine: &[u8] = if in_place {
            &self.one_shot_input
        } else {
            &src[..bytes]
        };
        let out = &mut dst[..bytes];
        // The clock starts at the first contribution found missing (none is, mostly).
        let mut pacer: Option<Pacer> = None;
        for i in 0..world {
            if i == rank {
                if i == 0 {
                    if !in_place {
                        out.copy_from_slice(mine);
                    }
                } else if i != 1 {
                    reduce::reduce_inplace(dtype, op, out, mine);
                }
                // Rank 1's was taken with rank 0's.
                continue;
            }
            loop {
                let slots = self.transport.slots().ok_or_else(no_slots)?;
                if let Some((h, data)) = slots.peek(i, desc.seq)? {
                    check_header(rank, i, desc, &h, bytes)?;
                    if i == 0 && rank == 1 {
                        reduce::reduce_into(dtype, op, out, data, mine);
                    } else if i == 0 {
                        out.copy_from_slice(data);
                    } else {
                        reduce::reduce_inplace(dtype, op, out, data);
                    }
                    if let Some(p) = pacer.as_mut() {
                        p.after_pass(true, &self.abort);
                    }
                    break;
                }
                let pacer = pacer.get_or_insert_with(|| {
                    // No clock read before the first re-polls: most contributions are a
                    // few passes away.
                    let timeout = self.call_timeout.unwrap_or(self.opts.timeout);
                    Pacer::lazy(&self.opts, self.spin.now(), timeout)
                });
                match pacer.after_pass(false, &self.abort) {
                    Pace::Again => {}
                    Pace::Block => {
                        let t0 = self.trace.is_some().then(Instant::now);
                        pacer.sleeping();
                        slots.wait_slots(&[i], desc.seq, pacer.wait_until())?;
                        if let (Some(t), Some(t0)) = (self.trace.as_mut(), t0) {
                            let args = [("peers", format!("[{i}]"))];
                            t.span(Lane::Waits, "wait", "wait", t0, Instant::now(), &args);
                        }
                    }
                    Pace::Aborted => return Err(self.aborted_error(desc.op_name())),
                    Pace::TimedOut(waited) => {
                        return Err(Error::Timeout {
                            rank,
                            peer: Some(i),
                            op: desc.op_name(),
                            waited,
                            detail: format!(
                                "waiting for rank {i}'s one-shot contribution (shared slot; \
                                 {i} of {world} contributions taken)"
                            ),
                        })
                    }
                }
            }
        }
        if full != op {
            reduce::finalize(dtype, full, out, world);
        }
        let slept = pacer.as_mut().and_then(Pacer::finish);
        if slept.is_some() {
            // The recorder's end from the clock (`flight_end`): a call that slept is recorded
            // with its length. The others end at their start there, which spares the clock
            // read between the last contribution and the next call's.
            self.fl.end_from_clock();
        }
        self.spin.learn(slept);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineOptions;
    use crate::transport::shm::{group_in_process, ShmOptions};
    use crate::types::DataType;

    /// `n` engines in this process over one shared-memory group, one-shot up to 4 KiB.
    fn engines(n: usize) -> Vec<Engine> {
        let everyone = move |r: usize| (0..n).filter(|&p| p != r).collect();
        group_in_process(n, &everyone, &|_| ShmOptions::default())
            .into_iter()
            .enumerate()
            .map(|(r, t)| {
                let opts = EngineOptions {
                    one_shot_bytes: 4096,
                    ..EngineOptions::default()
                };
                Engine::new(r, n, Box::new(t), opts)
            })
            .collect()
    }

    /// A call of `count` f32 elements: an all_reduce (sum), or a send to / receive from `peer`.
    fn f32_call(coll: Collective, count: usize, peer: usize, is_send: bool) -> Call {
        let op = (coll == Collective::AllReduce).then_some(ReduceOp::Sum);
        let mut c = Call::new(coll, op, count, peer, is_send);
        c.dtype = DataType::F32;
        c
    }

    /// Rank 0 calls with no elements where the others run the call one-shot, then every rank
    /// calls an all_reduce large enough for frames: a prompt mismatch on every rank, not a
    /// wait for the deadline. With 2 ranks rank 1 finds rank 0's frame of the later call
    /// where its contribution should be (it looked for a frame of that very call only);
    /// with 3, rank 0's schedule may first wait on a peer still in the one-shot call, and
    /// rank 0 finds that peer's contribution to a collective it took as empty.
    #[test]
    fn an_empty_call_against_a_one_shot_one_then_frames_is_a_prompt_mismatch() {
        for n in [2, 3] {
            let t0 = Instant::now();
            let res: Vec<Result<()>> = std::thread::scope(|s| {
                let hs: Vec<_> = engines(n)
                    .into_iter()
                    .enumerate()
                    .map(|(r, mut eng)| {
                        s.spawn(move || {
                            eng.set_call_timeout(Some(std::time::Duration::from_secs(20)));
                            let mut c = f32_call(Collective::AllReduce, 4, 0, false);
                            if r == 0 {
                                c.count = 0;
                                eng.skip_empty(&c)?;
                            } else {
                                assert!(eng.runs_one_shot(&c));
                                eng.run(&c, &[], &mut [0u8; 16])?;
                            }
                            // 8 KiB: past the 4 KiB one-shot limit, so frames.
                            c.count = 2048;
                            assert!(!eng.runs_one_shot(&c));
                            eng.run(&c, &[], &mut vec![0u8; 8192])
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (r, e) in res.iter().enumerate() {
                let text = match e {
                    Err(e @ (Error::Mismatch { .. } | Error::Aborted { .. })) => e.to_string(),
                    other => panic!("world {n} rank {r}: {other:?}"),
                };
                assert!(
                    text.contains("#1") && text.contains("#2"),
                    "world {n} rank {r}: {text}"
                );
            }
            let took = t0.elapsed();
            assert!(
                took < std::time::Duration::from_secs(10),
                "world {n}: {took:?}"
            );
        }
    }

    /// After a 64 KiB all_reduce (frames) the send position of rank 0's ring to rank 1 is
    /// past the ring's hot window, so rank 0's next small frame comes behind a wrap marker.
    /// Rank 1 runs call #2 one-shot where rank 0 runs a reduce to rank 1: a prompt mismatch
    /// on both. Rank 1, which publishes 300 ms after rank 0's frame is in the ring, finds it
    /// itself ("rank 0 sent a frame of collective #2 ...") in its first look, where it used
    /// to read the marker as the frame, see nothing, and wait for rank 0 (waiting in its
    /// reduce) to find the mismatch and say so. Either way is accepted (rank 1 may be off
    /// its core long enough for rank 0 to be first); both sides' checks failing would be the
    /// deadline's timeout.
    #[test]
    fn a_frame_behind_a_wrap_marker_is_a_prompt_mismatch_for_a_one_shot_call() {
        let t0 = Instant::now();
        let both = std::sync::Barrier::new(2);
        let res: Vec<Result<()>> = std::thread::scope(|s| {
            let hs: Vec<_> = engines(2)
                .into_iter()
                .enumerate()
                .map(|(r, mut eng)| {
                    let both = &both;
                    s.spawn(move || {
                        eng.set_call_timeout(Some(std::time::Duration::from_secs(20)));
                        let big = f32_call(Collective::AllReduce, 16384, 0, false);
                        assert!(!eng.runs_one_shot(&big));
                        eng.run(&big, &[], &mut vec![0u8; 65536])?;
                        let res = if r == 1 {
                            // After rank 0's frame is in the ring.
                            std::thread::sleep(std::time::Duration::from_millis(300));
                            let c = f32_call(Collective::AllReduce, 4, 0, false);
                            assert!(eng.runs_one_shot(&c));
                            eng.run(&c, &[], &mut [0u8; 16])
                        } else {
                            let mut c =
                                Call::new(Collective::Reduce, Some(ReduceOp::Sum), 4, 1, false);
                            c.dtype = DataType::F32;
                            eng.run(&c, &[], &mut [0u8; 16])
                        };
                        // Rank 0 keeps its engine (no goodbye) until rank 1 is done.
                        both.wait();
                        res
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, e) in res.iter().enumerate() {
            match e {
                Err(e @ Error::Mismatch { .. }) => assert!(e.to_string().contains("#2"), "{e}"),
                other => panic!("rank {r} after {:?}: {other:?}", t0.elapsed()),
            }
        }
        let took = t0.elapsed();
        assert!(took < std::time::Duration::from_secs(10), "{took:?}");
    }

    /// A send/recv frame from the peer waits in the ring, unreceived, while this rank waits
    /// for that peer's one-shot contribution: the wait sleeps instead of turning at once on
    /// the frame it cannot take (it spun for the peer's whole delay), and then takes the
    /// contribution; the frame is received after.
    #[test]
    fn a_one_shot_wait_sleeps_past_a_send_it_cannot_take() {
        use nix::sys::resource::{getrusage, UsageWho};
        let cpu = || {
            let u = getrusage(UsageWho::RUSAGE_THREAD).unwrap();
            let us = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 * 1e6 + t.tv_usec() as f64;
            std::time::Duration::from_micros((us(u.user_time()) + us(u.system_time())) as u64)
        };
        let delay = std::time::Duration::from_millis(400);
        let sent = std::sync::Barrier::new(2);
        std::thread::scope(|s| {
            for (r, mut eng) in engines(2).into_iter().enumerate() {
                let sent = &sent;
                s.spawn(move || {
                    let ar = f32_call(Collective::AllReduce, 2, 0, false);
                    let mut sum = [0u8; 8];
                    sum.copy_from_slice(bytemuck::cast_slice(&[1.0f32 + r as f32; 2]));
                    if r == 1 {
                        let msg = [7u8; 12];
                        eng.run(&f32_call(Collective::SendRecv, 3, 0, true), &msg, &mut [])
                            .unwrap();
                        sent.wait();
                        std::thread::sleep(delay);
                        eng.run(&ar, &[], &mut sum).unwrap();
                    } else {
                        sent.wait();
                        let (t, c) = (Instant::now(), cpu());
                        eng.run(&ar, &[], &mut sum).unwrap();
                        let (waited, busy) = (t.elapsed(), cpu() - c);
                        assert!(waited >= delay / 2, "waited {waited:?}");
                        // Spinning, it took about all of the wait; asleep, a few ms.
                        assert!(busy < waited / 3, "busy {busy:?} of {waited:?}");
                        let mut got = [0u8; 12];
                        eng.run(&f32_call(Collective::SendRecv, 3, 1, false), &[], &mut got)
                            .unwrap();
                        assert_eq!(got, [7u8; 12]);
                    }
                    let got: &[f32] = bytemuck::cast_slice(&sum);
                    assert_eq!(got, [3.0f32, 3.0], "rank {r}");
                });
            }
        });
    }

    /// Rank r's contribution: large and small magnitudes whose f32 sum depends on the order
    /// in which the ranks are added.
    fn input(r: usize, count: usize) -> Vec<f32> {
        (0..count)
            .map(|i| match (r + i) % 3 {
                0 => 1.0e8,
                1 => 1.0 + i as f32,
                _ => -1.0e8 + 3.0,
            })
            .collect()
    }

    /// In place and out of place (where the input must stay as it was), on worlds 2 to 4:
    /// every rank ends with the contributions added in rank order, bit for bit (the
    /// reference folds them in that order; another order rounds differently). Rank 0 in
    /// place reduces into its own input and rank 1 takes rank 0's and its own in one pass.
    #[test]
    fn one_shot_adds_in_rank_order_in_place_and_out_of_place_on_every_rank() {
        for n in 2..=4 {
            for in_place in [true, false] {
                for count in [1, 2, 7, 16, 33, 1000] {
                    let want: Vec<u32> = (0..count)
                        .map(|i| {
                            (1..n)
                                .fold(input(0, count)[i], |acc, r| acc + input(r, count)[i])
                                .to_bits()
                        })
                        .collect();
                    std::thread::scope(|s| {
                        for (r, mut eng) in engines(n).into_iter().enumerate() {
                            let want = &want;
                            s.spawn(move || {
                                let mut call = Call::new(
                                    Collective::AllReduce,
                                    Some(ReduceOp::Sum),
                                    count,
                                    0,
                                    false,
                                );
                                call.dtype = DataType::F32;
                                assert!(eng.runs_one_shot(&call));
                                let src = input(r, count);
                                let mut dst = if in_place {
                                    src.clone()
                                } else {
                                    vec![0f32; count]
                                };
                                let src_bytes: &[u8] = if in_place {
                                    &[]
                                } else {
                                    bytemuck::cast_slice(&src)
                                };
                                eng.run(&call, src_bytes, bytemuck::cast_slice_mut(&mut dst))
                                    .unwrap();
                                let got: Vec<u32> = dst.iter().map(|x| x.to_bits()).collect();
                                assert_eq!(
                                    &got, want,
                                    "rank {r} of {n}, count {count}, in place: {in_place}"
                                );
                                assert_eq!(src, input(r, count), "rank {r}'s input changed");
                            });
                        }
                    });
                }
            }
        }
    }
}
