//! Receives from any source (`Communicator::recv_any`, `try_recv_any`), multi-process over
//! TCP, shared memory and both at once (shm within two `DSPARK_HOST_ID` hosts, TCP between):
//! senders racing to one receiver, messages from 1 element to several segments, each round
//! closed by a barrier whose frames may arrive at the receiver before the last message (they
//! must be left for the barrier); a named receive and an any-source one side by side; a
//! message of another length (a mismatch, never a truncation); a peer that closed its
//! communicator passed over; nothing received within `try_recv_any`'s wait; the deadline
//! with nobody sending. And deterministically, threads over `mem`: a peer whose next frame
//! is a collective's with the very sequence number the receiver expects of its next send is
//! left alone while another peer's message is taken.

mod common;

use std::time::{Duration, Instant};

use common::procs::{assert_all, rank_entry, say, spawn, vars, FAILED_AS_EXPECTED, OK, WRONG};
use dspark::internals::transport::mem::MemFabric;
use dspark::{Communicator, Error, ReduceOp};

#[test]
fn rank_process() {
    rank_entry(run_scenario);
}

/// Message sizes, in elements: one, prime, and several pipeline segments (512 KiB each).
const SIZES: [usize; 5] = [1, 7, 4099, 131_101, 400_009];

/// The message `from` sends in round `k`: depends on both, so a wrong source or round shows.
fn message(from: usize, k: usize, n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| (from as u32) << 24 | (k as u32) << 20 | (i as u32 & 0xf_ffff))
        .collect()
}

fn run_scenario(s: &str) -> Result<i32, String> {
    let comm = Communicator::from_env().map_err(|e| format!("init: {e}"))?;
    let (r, n) = (comm.rank(), comm.world_size());
    let e2s = |e: Error| e.to_string();
    match s {
        "race" => {
            // One collective first: the barrier closing round k then carries the sequence
            // number of the sender's next send (k + 2), so only the kind of frame tells the
            // two apart.
            comm.barrier().map_err(e2s)?;
            for (k, &m) in SIZES.iter().enumerate() {
                if r == 0 {
                    let mut seen = vec![false; n];
                    for _ in 1..n {
                        let mut buf = vec![0u32; m];
                        let from = comm.recv_any(&mut buf).map_err(e2s)?;
                        if from == 0 || from >= n || seen[from] {
                            return Err(format!("round {k}: source {from} (seen {seen:?})"));
                        }
                        seen[from] = true;
                        if buf != message(from, k, m) {
                            return Err(format!("round {k}: wrong data from rank {from}"));
                        }
                    }
                } else {
                    if r == n - 1 && n > 2 {
                        // The others' barrier frames reach rank 0 first.
                        std::thread::sleep(Duration::from_millis(30));
                    }
                    comm.send(&message(r, k, m), 0).map_err(e2s)?;
                }
                // Early senders' barrier frames reach rank 0 before the last message.
                comm.barrier().map_err(e2s)?;
            }
            // A named receive beside any-source ones: rank 0 takes rank 1's first message by
            // name; the any-source receives get everything else, rank 1's second included.
            let m = 13;
            if r == 0 {
                let mut buf = vec![0u32; m];
                comm.recv(&mut buf, 1).map_err(e2s)?;
                if buf != message(1, 100, m) {
                    return Err("named receive: wrong data".into());
                }
                let mut got = Vec::new();
                for _ in 1..n {
                    let from = comm.recv_any(&mut buf).map_err(e2s)?;
                    let k = if from == 1 { 101 } else { 100 };
                    if buf != message(from, k, m) {
                        return Err(format!("after the named receive: wrong data from {from}"));
                    }
                    got.push(from);
                }
                got.sort_unstable();
                if got != (1..n).collect::<Vec<_>>() {
                    return Err(format!("sources {got:?}"));
                }
            } else {
                comm.send(&message(r, 100, m), 0).map_err(e2s)?;
                if r == 1 {
                    comm.send(&message(r, 101, m), 0).map_err(e2s)?;
                }
            }
            // Still in step: a collective after all of it.
            let mut v = vec![1.0f64; 5];
            comm.all_reduce(&mut v, ReduceOp::Sum).map_err(e2s)?;
            if v != vec![n as f64; 5] {
                return Err(format!("all_reduce after: {v:?}"));
            }
            say(&format!("RACE OK rank {r}"));
            Ok(OK)
        }
        "other_length" => {
            if r == 0 {
                let mut buf = vec![0u32; 5];
                return match comm.recv_any(&mut buf) {
                    Err(e @ Error::Mismatch { .. }) => {
                        say(&format!("FAILED: {e}"));
                        let t = e.to_string();
                        if !t.contains("send_recv") || !t.contains("count 7") {
                            return Err(format!("the mismatch does not name the call: {t}"));
                        }
                        Ok(FAILED_AS_EXPECTED)
                    }
                    other => Err(format!("expected a mismatch, got {other:?}")),
                };
            }
            if r == 1 {
                comm.send(&message(1, 0, 7), 0).map_err(e2s)?;
            }
            // Everyone learns of the mismatch at its next call.
            match comm.barrier() {
                Err(Error::Mismatch { .. }) => Ok(FAILED_AS_EXPECTED),
                other => Err(format!(
                    "expected the mismatch at the barrier, got {other:?}"
                )),
            }
        }
        "closed_and_silent" => {
            // Rank 2 closes its communicator at once; rank 1 sends one message a moment
            // later, then stays (sending nothing) until rank 0 is done.
            match r {
                0 => {
                    let t0 = Instant::now();
                    let nothing = comm
                        .try_recv_any(&mut [0u8; 3], Duration::from_millis(200))
                        .map_err(e2s)?;
                    if nothing.is_some() || t0.elapsed() > Duration::from_secs(5) {
                        return Err(format!(
                            "try_recv_any: {nothing:?} after {:?}",
                            t0.elapsed()
                        ));
                    }
                    let mut buf = vec![0u32; 9];
                    let from = comm.recv_any(&mut buf).map_err(e2s)?;
                    if from != 1 || buf != message(1, 0, 9) {
                        return Err(format!("from {from}: {buf:?}"));
                    }
                    // Nobody sends any more: the deadline (DSPARK_TIMEOUT=3) names the wait.
                    let t0 = Instant::now();
                    match comm.recv_any(&mut buf) {
                        Err(e @ Error::Timeout { .. }) => {
                            let t = e.to_string();
                            say(&format!("FAILED: {t}"));
                            if !t.contains("recv from any source") || !t.contains("ranks 1") {
                                return Err(format!("the timeout does not say what: {t}"));
                            }
                            if t0.elapsed() > Duration::from_secs(20) {
                                return Err(format!("took {:?}", t0.elapsed()));
                            }
                            std::fs::write(std::env::var("DONE_FILE").unwrap(), b"done")
                                .map_err(|e| e.to_string())?;
                            Ok(FAILED_AS_EXPECTED)
                        }
                        other => Err(format!("expected a timeout, got {other:?}")),
                    }
                }
                1 => {
                    std::thread::sleep(Duration::from_millis(700));
                    comm.send(&message(1, 0, 9), 0).map_err(e2s)?;
                    let done = std::env::var("DONE_FILE").unwrap();
                    let t0 = Instant::now();
                    while !std::path::Path::new(&done).exists() {
                        if t0.elapsed() > Duration::from_secs(60) {
                            return Err("rank 0 never finished".into());
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    Ok(FAILED_AS_EXPECTED)
                }
                _ => {
                    drop(comm);
                    Ok(FAILED_AS_EXPECTED)
                }
            }
        }
        other => Err(format!("unknown scenario {other}")),
    }
}

/// Variables of rank `r` for `how`: "tcp", "shm" or "mixed" (two hosts of `n / 2`).
fn env(how: &str, r: usize, n: usize, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let host = if r < n / 2 { "a" } else { "b" };
    let mut v = match how {
        "tcp" => vars(&[("DSPARK_TRANSPORT", "tcp")]),
        "shm" => vars(&[("DSPARK_TRANSPORT", "auto")]),
        _ => vars(&[("DSPARK_TRANSPORT", "auto"), ("DSPARK_HOST_ID", host)]),
    };
    v.extend(vars(extra));
    v
}

fn race(how: &str, n: usize) {
    let outs = spawn(
        n,
        "race",
        &|r| env(how, r, n, &[("DSPARK_TIMEOUT", "60")]),
        None,
    )
    .wait(Duration::from_secs(120));
    assert_all(&outs, OK, &format!("race over {how}, {n} ranks"));
}

#[test]
fn senders_racing_to_one_any_source_receiver_each_arrive_once_over_tcp() {
    race("tcp", 2);
    race("tcp", 4);
}

#[test]
fn senders_racing_to_one_any_source_receiver_each_arrive_once_over_shm() {
    race("shm", 4);
}

#[test]
fn senders_racing_to_one_any_source_receiver_each_arrive_once_over_shm_and_tcp() {
    race("mixed", 4);
}

#[test]
fn a_message_of_another_length_is_a_mismatch_on_every_rank() {
    for how in ["tcp", "shm"] {
        let outs = spawn(
            3,
            "other_length",
            &|r| env(how, r, 3, &[("DSPARK_TIMEOUT", "30")]),
            None,
        )
        .wait(Duration::from_secs(60));
        assert_all(
            &outs,
            FAILED_AS_EXPECTED,
            &format!("other length over {how}"),
        );
    }
}

#[test]
fn a_closed_peer_is_passed_over_and_a_silent_world_times_out_naming_the_wait() {
    for how in ["tcp", "shm"] {
        let dir =
            std::env::temp_dir().join(format!("dspark-recv-any-{}-{how}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        let done = dir.display().to_string();
        let outs = spawn(
            3,
            "closed_and_silent",
            &|r| {
                env(
                    how,
                    r,
                    3,
                    &[("DSPARK_TIMEOUT", "3"), ("DONE_FILE", done.as_str())],
                )
            },
            None,
        )
        .wait(Duration::from_secs(60));
        let _ = std::fs::remove_file(&dir);
        assert_all(
            &outs,
            FAILED_AS_EXPECTED,
            &format!("closed and silent over {how}"),
        );
    }
    let _ = WRONG;
}

#[test]
fn a_peer_already_in_a_collective_is_left_alone_while_another_sends_over_mem() {
    let fabric = MemFabric::new(3, 64);
    let cfg = common::mem_config(Duration::from_secs(20), 4096);
    let out = common::run_mem_ranks(&fabric, 3, &cfg, |comm| -> Result<(), String> {
        let e2s = |e: Error| e.to_string();
        let r = comm.rank();
        // all_to_all: rank 1 sends its block to rank 0 at once. It is rank 1's collective
        // #1, and rank 0 expects send #1 from rank 1 next: only the kind of frame differs.
        let send: Vec<u32> = (0..6).map(|i| (r * 10 + i) as u32).collect();
        let mut recv = vec![0u32; 6];
        match r {
            0 => {
                std::thread::sleep(Duration::from_millis(150));
                let mut b = [0i32; 5];
                let from = comm.recv_any(&mut b).map_err(e2s)?;
                if from != 2 || b != [2; 5] {
                    return Err(format!("recv_any: from {from}: {b:?}"));
                }
            }
            2 => {
                std::thread::sleep(Duration::from_millis(300));
                comm.send(&[2i32; 5], 0).map_err(e2s)?;
            }
            _ => {}
        }
        comm.all_to_all(&send, &mut recv).map_err(e2s)?;
        let want: Vec<u32> = (0..3)
            .flat_map(|q| (0..2).map(move |i| (q * 10 + r * 2 + i) as u32))
            .collect();
        if recv != want {
            return Err(format!("all_to_all after: {recv:?}, expected {want:?}"));
        }
        Ok(())
    });
    for (r, o) in out.into_iter().enumerate() {
        assert_eq!(o, Ok(()), "rank {r}");
    }
}

/// A peer that sent an empty message (its number taken, no frame) and then a real one: a
/// receive from any source fails at once with a mismatch naming both numbers, as a named
/// receive does, where it passed over the later frame until its deadline and then said that
/// no message came.
#[test]
fn a_send_after_an_empty_one_is_a_prompt_mismatch_for_a_receive_from_any_source() {
    let fabric = MemFabric::new(2, 8);
    let cfg = common::mem_config(Duration::from_secs(10), 4096);
    let out = common::run_mem_ranks(&fabric, 2, &cfg, |comm| -> Result<(), String> {
        if comm.rank() == 1 {
            comm.send(&[] as &[u32], 0).map_err(|e| e.to_string())?;
            // The peer's failure may reach this send or not: either is fine.
            let _ = comm.send(&[7u32; 4], 0);
            return Ok(());
        }
        let t0 = Instant::now();
        let got = comm.recv_any(&mut [0u32; 4]);
        let took = t0.elapsed();
        match got {
            Err(e @ Error::Mismatch { .. }) if took < Duration::from_secs(5) => {
                let text = e.to_string();
                if text.contains("#1") && text.contains("#2") {
                    Ok(())
                } else {
                    Err(format!("the mismatch names no numbers: {text}"))
                }
            }
            other => Err(format!("after {took:?}: {other:?}")),
        }
    });
    assert_eq!(out[0], Ok(()), "rank 0");
}
