//! Multi-process tests of the shared-memory transport: this test binary re-executes itself as
//! N rank processes on this host (`rank_process` is a rank's entry point; it does nothing in
//! a normal test run). Every collective, type and operator on worlds 1..=5 against the
//! independent reference of `tests/common`, large messages through small rings (wrap-around,
//! partial frames), the automatic choice and its overrides, a killed rank, a stopped
//! (SIGSTOP) rank, mismatched calls, and no shared-memory residue after any of it. Thirteen
//! ranks: only the standing partners' rings are committed and only they are connected at
//! init (the description, `connected_at_init` and the process's shared memory say so); the
//! other pairs commit their rings and connect on first use (send/recv, all-to-all), exact
//! against formulas; a first use of a non-partner that died fails naming it; a rank killed
//! during all-to-all fails every survivor; 128 ranks with every pair used.

mod common;

use std::time::{Duration, Instant};

use common::procs::{
    assert_all, rank_entry, say, shm_residue, spawn, status_kb, vars, FAILED_AS_EXPECTED, OK, WRONG,
};
use dspark::internals::transport::TransportKind;
use dspark::{Communicator, Error, ReduceOp};

/// Entry point of a rank process. In a normal test run (no scenario set) it returns at once.
#[test]
fn rank_process() {
    rank_entry(run_scenario);
}

fn expect_transport(comm: &Communicator, want: TransportKind) -> Result<(), String> {
    let got = comm.info().transport;
    if got != want {
        return Err(format!(
            "transport {got}, expected {want} ({:?})",
            comm.info().transport_reason
        ));
    }
    Ok(())
}

fn run_scenario(s: &str) -> Result<i32, String> {
    if s == "forced_on_two_hosts" {
        return match Communicator::from_env() {
            Err(e @ Error::Unavailable { .. }) => {
                say(&format!("FAILED: {e}"));
                Ok(FAILED_AS_EXPECTED)
            }
            Err(e) => Err(format!("expected Unavailable, got {e}")),
            Ok(_) => Err("init succeeded across two host identities".into()),
        };
    }
    let comm = Communicator::from_env().map_err(|e| format!("init: {e}"))?;
    let r = comm.rank();
    match s {
        "matrix" => {
            expect_transport(&comm, TransportKind::Shm)?;
            common::run_matrix(&comm, &[0, 1, 2, 3, 7, 13, 100, 1023], 0x5eed)?;
            Ok(OK)
        }
        "kind" => {
            let want = match std::env::var("WANT_TRANSPORT").as_deref() {
                Ok("tcp") => TransportKind::Tcp,
                Ok("shm+tcp") => TransportKind::ShmTcp,
                _ => TransportKind::Shm,
            };
            expect_transport(&comm, want)?;
            say(&format!("TRANSPORT {}", comm.info().transport_detail));
            let mut v = vec![r as f64 + 1.0; 33];
            comm.all_reduce(&mut v, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            let n = comm.world_size() as f64;
            common::check("all_reduce", &v, &vec![n * (n + 1.0) / 2.0; 33])?;
            Ok(OK)
        }
        "large" => {
            expect_transport(&comm, TransportKind::Shm)?;
            // 12 MiB of f32 through 64 KiB rings of 16 KiB segments: every ring wraps many
            // times, partial reads and writes.
            let n = 3 * 1024 * 1024 + 17;
            // 1 MiB: recursive doubling, whose in-place receive waits for its own send: the
            // ring must take whole frames while both ranks send.
            let m = 256 * 1024 + 3;
            let mut buf = common::inputs::<f32>(ReduceOp::Sum, 8, r, m);
            comm.all_reduce(&mut buf, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            common::check(
                "1 MiB all_reduce",
                &buf,
                &common::reduced::<f32>(ReduceOp::Sum, 8, comm.world_size(), m),
            )?;
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let mut buf = common::inputs::<f32>(op, 9, r, n);
                comm.all_reduce(&mut buf, op).map_err(|e| e.to_string())?;
                common::check(
                    "large all_reduce",
                    &buf,
                    &common::reduced::<f32>(op, 9, comm.world_size(), n),
                )?;
            }
            let mut b = if r == 1 {
                common::inputs::<u8>(ReduceOp::Sum, 4, 1, n)
            } else {
                vec![0u8; n]
            };
            comm.broadcast(&mut b, 1).map_err(|e| e.to_string())?;
            common::check(
                "large broadcast",
                &b,
                &common::inputs::<u8>(ReduceOp::Sum, 4, 1, n),
            )?;
            let mine = common::inputs::<i32>(ReduceOp::Sum, 5, r, n / 4);
            let mut all = vec![0i32; n / 4 * comm.world_size()];
            comm.all_gather(&mine, &mut all)
                .map_err(|e| e.to_string())?;
            let want: Vec<i32> = (0..comm.world_size())
                .flat_map(|q| common::inputs::<i32>(ReduceOp::Sum, 5, q, n / 4))
                .collect();
            common::check("large all_gather", &all, &want)?;
            Ok(OK)
        }
        "loop" => {
            expect_transport(&comm, TransportKind::Shm)?;
            common::procs::loop_until_failure(&comm)
        }
        "loop_forked" => {
            expect_transport(&comm, TransportKind::Shm)?;
            fork_a_sleeper();
            common::procs::loop_until_failure(&comm)
        }
        "watch" => {
            if r == 0 {
                expect_transport(&comm, TransportKind::Shm)?;
            }
            common::procs::watch_while_another_dies(&comm)
        }
        "mismatch" => {
            expect_transport(&comm, TransportKind::Shm)?;
            common::procs::mismatched_count(&comm)
        }
        "one_shot" => one_shot(&comm),
        "one_shot_against_frames" => {
            // Rank 0 runs all_reduce #1 one-shot (8 bytes), the others as frames (64 KiB):
            // every rank must fail with a mismatch naming a count, never time out.
            expect_transport(&comm, TransportKind::Shm)?;
            let mut buf = vec![1.0f32; if r == 0 { 2 } else { 16384 }];
            expect_mismatch(comm.all_reduce(&mut buf, ReduceOp::Sum))
        }
        "empty_against_one_shot" => {
            // Rank 0 calls all_reduce #1 with no elements, the others with 2 (one-shot);
            // then every rank calls #2 with 16384 (frames): every rank must fail with a
            // mismatch promptly, never wait for the deadline.
            expect_transport(&comm, TransportKind::Shm)?;
            let mut first = vec![1.0f32; if r == 0 { 0 } else { 2 }];
            let mut second = vec![1.0f32; 16384];
            expect_mismatch(
                comm.all_reduce(&mut first, ReduceOp::Sum)
                    .and_then(|()| comm.all_reduce(&mut second, ReduceOp::Sum)),
            )
        }
        "late_peer" => {
            // The last rank comes to its first collective after the bootstrap's hello wait
            // (5 s): the others, which connect to it on first use, wait for it (their
            // deadline is 60 s) instead of calling it lost; then every pair works.
            expect_transport(&comm, TransportKind::Shm)?;
            let n = comm.world_size();
            if r == n - 1 {
                std::thread::sleep(Duration::from_secs(7));
            }
            let mut small = vec![1.0f32 + r as f32; 3];
            comm.all_reduce(&mut small, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            let want = (1..=n).sum::<usize>() as f32;
            common::check("late peer's all_reduce", &small, &[want; 3])?;
            common::all_to_all_exact(&comm)?;
            Ok(OK)
        }
        "send_then_exit" => {
            // Rank 0 sends and exits at once without closing; rank 1 still gets every byte.
            expect_transport(&comm, TransportKind::Shm)?;
            let n = 300_000;
            if r == 0 {
                let v = common::inputs::<u32>(ReduceOp::Sum, 3, 0, n);
                comm.send(&v, 1).map_err(|e| e.to_string())?;
                say(&format!("SCENARIO {s} EXIT {OK}"));
                std::process::exit(OK);
            }
            std::thread::sleep(Duration::from_millis(300));
            let mut v = vec![0u32; n];
            comm.recv(&mut v, 0).map_err(|e| e.to_string())?;
            common::check(
                "recv after exit",
                &v,
                &common::inputs::<u32>(ReduceOp::Sum, 3, 0, n),
            )?;
            Ok(OK)
        }
        "lazy" => lazy(&comm),
        "a2a_loop" => {
            // all_to_all (every pair, most connected on first use) until something fails.
            expect_transport(&comm, TransportKind::Shm)?;
            let n = comm.world_size();
            let send = vec![r as u32; n * 1024];
            let mut recv = vec![0u32; n * 1024];
            comm.all_to_all(&send, &mut recv)
                .map_err(|e| e.to_string())?;
            say("READY");
            loop {
                if let Err(e) = comm.all_to_all(&send, &mut recv) {
                    say(&format!("FAILED: {e}"));
                    let expected = matches!(
                        e,
                        Error::PeerLost { .. } | Error::Aborted { .. } | Error::Timeout { .. }
                    );
                    return Ok(if expected { FAILED_AS_EXPECTED } else { WRONG });
                }
            }
        }
        "lazy_lost" => lazy_lost(&comm),
        other => Err(format!("unknown scenario {other}")),
    }
}

/// A scenario's end where every rank must fail with a mismatch (or the abort of the rank that
/// found it first).
fn expect_mismatch(res: dspark::Result<()>) -> Result<i32, String> {
    match res {
        Err(e @ (Error::Mismatch { .. } | Error::Aborted { .. })) => {
            say(&format!("FAILED: {e}"));
            Ok(FAILED_AS_EXPECTED)
        }
        other => Err(format!("expected a mismatch, got {other:?}")),
    }
}

/// The number just before `key` in `text` ("..., 140 KiB committed at init" with the key
/// "KiB committed at init" → 140).
/// Small all_reduces run one-shot through the shared slots: every type and operator at odd
/// counts up to the slot's size, exact against the reference (which reduces in rank order,
/// as the slots do: bitwise equal on every rank), a thousand calls so that the two slots
/// are reused many times, with calls that use the rings (a larger all_reduce, a broadcast,
/// send/recv) between them.
fn one_shot(comm: &Communicator) -> Result<i32, String> {
    use dspark::internals::plan::{Algorithm, Collective};
    expect_transport(comm, TransportKind::Shm)?;
    let (r, n) = (comm.rank(), comm.world_size());
    for bytes in [1, 8, 1000, 4064, 4096] {
        let a = comm.algorithm(Collective::AllReduce, bytes);
        if a != Algorithm::OneShot {
            return Err(format!("{bytes} bytes run {a}, not one_shot"));
        }
    }
    if comm.algorithm(Collective::AllReduce, 4100) == Algorithm::OneShot {
        return Err("4100 bytes run one_shot, above its 4 KiB".into());
    }
    // The bound `dspark model` shows is this communicator's (it takes its own from the
    // transport it built).
    let shown = dspark::internals::choice::one_shot_max_bytes(TransportKind::Shm);
    if comm.algorithm(Collective::AllReduce, shown) != Algorithm::OneShot
        || comm.algorithm(Collective::AllReduce, shown + 1) == Algorithm::OneShot
    {
        return Err(format!(
            "dspark model's one-shot bound, {shown} bytes, is not the communicator's"
        ));
    }
    let e = |e: Error| e.to_string();
    common::run_matrix(comm, &[1, 3, 5, 127, 507], 0x0e5)?;
    let ops = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];
    for i in 0..1000usize {
        let count = [1, 3, 7, 255, 1024][i % 5];
        let op = ops[(i / 5) % 5];
        let seed = i as u64;
        let mut buf = common::inputs::<f32>(op, seed, r, count);
        comm.all_reduce(&mut buf, op).map_err(e)?;
        common::check(
            "one-shot all_reduce",
            &buf,
            &common::reduced::<f32>(op, seed, n, count),
        )?;
        match i % 11 {
            3 => {
                let mut big = common::inputs::<f64>(ReduceOp::Sum, seed, r, 1001);
                comm.all_reduce(&mut big, ReduceOp::Sum).map_err(e)?;
                let want = common::reduced::<f64>(ReduceOp::Sum, seed, n, 1001);
                common::check("all_reduce between", &big, &want)?;
            }
            7 => {
                let mut b = vec![r as u32; 9];
                comm.broadcast(&mut b, i % n).map_err(e)?;
                common::check("broadcast between", &b, &[(i % n) as u32; 9])?;
            }
            9 if n > 1 => {
                let (to, from) = ((r + 1) % n, (r + n - 1) % n);
                let mut got = vec![0u32; 5];
                comm.send_recv(&[r as u32; 5], to, &mut got, from)
                    .map_err(e)?;
                common::check("send_recv between", &got, &[from as u32; 5])?;
            }
            _ => {}
        }
    }
    Ok(OK)
}

fn number_before(text: &str, key: &str) -> Option<u64> {
    let head = &text[..text.find(key)?];
    head.split_whitespace().next_back()?.parse().ok()
}

/// Thirteen ranks, rings of 64 KiB: what init commits and connects is the standing
/// partners', then the other pairs work on first use.
fn lazy(comm: &Communicator) -> Result<i32, String> {
    expect_transport(comm, TransportKind::Shm)?;
    let (r, n) = (comm.rank(), comm.world_size());
    let partners = dspark::internals::plan::algo::standing_partners(n, r);
    let k = partners.len();
    let info = comm.info();
    if info.connected_at_init != Some(k) || k + 1 >= n {
        return Err(format!(
            "connected to {:?} peers at init, want {k} of {}",
            info.connected_at_init,
            n - 1
        ));
    }
    // A ring's place: 256 bytes of counters and 64 KiB of data, in whole pages (68 KiB).
    let ring_kib = 68;
    // The header page and the two one-shot slots of two pages each: 20 KiB.
    let head_kib = 20;
    let detail = &info.transport_detail;
    let committed = number_before(detail, "KiB committed at init")
        .ok_or_else(|| format!("no committed figure in {detail:?}"))?;
    if committed != head_kib + ring_kib * k as u64 {
        return Err(format!(
            "{committed} KiB committed at init, want the header, the slots and {k} rings: {detail}"
        ));
    }
    if !detail.contains(&format!("{k} of {} at init", n - 1)) {
        return Err(format!(
            "the description hides the lazy connections: {detail}"
        ));
    }
    // Independently, the kernel's count of shared memory this process maps: its segment's
    // header and slots and partners' rings, each partner's ring it sends into, and every
    // peer's header and slot pages (`head_kib`); the other pairs' rings (2 × 68 KiB each) are not
    // touched.
    let at_init = status_kb("RssShmem");
    let want = head_kib + 2 * ring_kib * k as u64 + head_kib * (n as u64 - 1);
    say(&format!(
        "LAZY rank {r}: {k} partners, {committed} KiB committed at init, RssShmem {at_init} KiB \
         (partners' rings and headers {want} KiB; every pair's would be {} KiB)",
        head_kib + 2 * ring_kib * (n as u64 - 1) + head_kib * (n as u64 - 1)
    ));
    if at_init < want || at_init > want + ring_kib {
        return Err(format!(
            "RssShmem {at_init} KiB after init, want {want} KiB (the partners' rings only)"
        ));
    }
    // Send/recv to every non-partner and all-to-all over every pair, the odd ranks late.
    if r % 2 == 1 {
        std::thread::sleep(Duration::from_millis(200));
    }
    common::exchange_beyond_partners(comm, &partners)?;
    common::all_reduce_closed_form(comm)?;
    comm.barrier().map_err(|e| e.to_string())?;
    // Now every pair's rings are committed and mapped in.
    let after = status_kb("RssShmem");
    let all = head_kib + 2 * ring_kib * (n as u64 - 1) + head_kib * (n as u64 - 1);
    say(&format!(
        "LAZY rank {r}: RssShmem {after} KiB after every pair was used"
    ));
    if after < all {
        return Err(format!(
            "RssShmem {after} KiB after every pair was used, want at least {all} KiB"
        ));
    }
    Ok(OK)
}

/// The rank that leaves in `lazy_lost` (the first that is no standing partner of rank 0),
/// and the ranks that are not its standing partners.
fn victim_and_strangers(n: usize) -> (usize, Vec<usize>) {
    let of0 = dspark::internals::plan::algo::standing_partners(n, 0);
    let victim = (1..n).find(|q| !of0.contains(q)).unwrap_or(0);
    let of_victim = dspark::internals::plan::algo::standing_partners(n, victim);
    let strangers = (0..n)
        .filter(|&q| q != victim && !of_victim.contains(&q))
        .collect();
    (victim, strangers)
}

/// A rank that is no standing partner of rank 0 exits after a barrier without closing;
/// rank 0's first send to it and the other non-partners' first receive from it fail naming
/// it, long before the deadline.
fn lazy_lost(comm: &Communicator) -> Result<i32, String> {
    expect_transport(comm, TransportKind::Shm)?;
    let (r, n) = (comm.rank(), comm.world_size());
    let (victim, strangers) = victim_and_strangers(n);
    if strangers.len() < 2 || victim == 0 {
        return Err(format!(
            "too few non-partners of rank {victim} in a world of {n}"
        ));
    }
    comm.barrier()
        .map_err(|e| format!("rank {r}: barrier: {e}"))?;
    // Every rank leaves the barrier before the victim goes (a rank still in it would lose a
    // partner it waits on).
    std::thread::sleep(Duration::from_millis(300));
    if r == victim {
        say("victim exits now");
        std::process::exit(42);
    }
    if !strangers.contains(&r) {
        return Ok(OK);
    }
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let res = if r == 0 {
        comm.send(&[1u32, 2, 3], victim)
    } else {
        let mut b = [0u32; 3];
        comm.recv(&mut b, victim)
    };
    match res {
        Ok(()) => Err(format!("a first use of rank {victim}, gone, succeeded")),
        Err(e) => {
            say(&format!("rank {r}: after {:.1?}: {e}", t.elapsed()));
            let kind_ok = matches!(
                e,
                Error::PeerLost { .. } | Error::Io { .. } | Error::Transport { .. }
            );
            if e.peer() != Some(victim) || !kind_ok {
                return Err(format!("expected an error naming rank {victim}: {e:?}"));
            }
            if t.elapsed() > Duration::from_secs(10) {
                return Err(format!("the loss took {:.1?} to surface", t.elapsed()));
            }
            Ok(FAILED_AS_EXPECTED)
        }
    }
}

/// The shared-memory variables of every rank: auto choice (every rank is on this host).
fn shm_vars(extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v = vars(&[("DSPARK_TRANSPORT", "auto")]);
    v.extend(vars(extra));
    v
}

#[test]
fn every_collective_type_and_op_is_exact_over_shared_memory_on_worlds_1_to_5() {
    for world in 1..=5 {
        let outs = spawn(
            world,
            "matrix",
            &|_| {
                shm_vars(&[
                    // A world of one runs over TCP (no peers) unless shm is asked for.
                    ("DSPARK_TRANSPORT", if world == 1 { "shm" } else { "auto" }),
                    ("DSPARK_CHUNK_BYTES", "4096"),
                    // 64 KiB: small frames go back to the start of the ring past its first
                    // 16 KiB (wrap markers), large ones wrap at its end.
                    ("DSPARK_SHM_RING_BYTES", "64K"),
                    ("DSPARK_TIMEOUT", "60"),
                ])
            },
            None,
        )
        .wait(Duration::from_secs(240));
        assert_all(&outs, OK, &format!("world {world}"));
    }
}

#[test]
fn small_all_reduces_run_one_shot_and_exact_between_other_collectives_on_worlds_2_to_4() {
    for world in 2..=4 {
        let outs = spawn(
            world,
            "one_shot",
            &|_| shm_vars(&[("DSPARK_TIMEOUT", "60")]),
            None,
        )
        .wait(Duration::from_secs(240));
        assert_all(&outs, OK, &format!("world {world}"));
    }
}

/// Runs `scenario` on worlds 2 and 3 (shared memory, 30 s deadline): every rank fails with
/// a mismatch within 10 s, and its words pass `names` (what they must name).
fn every_rank_fails_promptly_with_a_mismatch(scenario: &str, names: &dyn Fn(&str) -> bool) {
    for world in [2, 3] {
        let outs = spawn(
            world,
            scenario,
            &|_| shm_vars(&[("DSPARK_TIMEOUT", "30")]),
            None,
        )
        .wait(Duration::from_secs(60));
        for (r, o) in outs.iter().enumerate() {
            assert_eq!(
                o.code,
                Some(FAILED_AS_EXPECTED),
                "world {world} rank {r}:\n{}",
                o.out
            );
            assert!(
                o.elapsed < Duration::from_secs(10),
                "world {world} rank {r} took {:?}: {}",
                o.elapsed,
                o.out
            );
            assert!(names(&o.out), "world {world} rank {r}: {}", o.out);
        }
    }
}

#[test]
fn a_one_shot_call_against_frames_at_the_same_sequence_number_fails_every_rank_with_a_mismatch() {
    every_rank_fails_promptly_with_a_mismatch("one_shot_against_frames", &|out| {
        out.contains("count")
    });
}

/// An empty call takes its sequence number without moving data: a rank that calls with no
/// elements where the others run the call one-shot, and then goes on to a call of frames,
/// leaves them a frame of the later call where its contribution should be, or (3 ranks) waits
/// on a peer still in the one-shot call. Every rank fails promptly with a mismatch naming
/// both collectives, its own words or the first failing rank's (it was a wait for the
/// deadline on every rank).
#[test]
fn an_empty_call_against_a_one_shot_one_then_frames_fails_every_rank_with_a_prompt_mismatch() {
    every_rank_fails_promptly_with_a_mismatch("empty_against_one_shot", &|out| {
        out.contains("#1") && out.contains("#2")
    });
}

/// A rank late to its first collective by more than the bootstrap's hello wait (its door
/// answers only inside its own calls) is not lost: the peers that connect to it on first use
/// (its small all_reduce reads every peer's slot; 6 ranks, so not every pair connects at
/// init) dial it again and wait within their deadline. They used to fail after 5 s naming
/// it lost, while it was alive and then completed the call.
#[test]
fn a_rank_late_by_more_than_the_hello_wait_is_waited_for_not_lost() {
    let outs = spawn(
        6,
        "late_peer",
        &|_| shm_vars(&[("DSPARK_TIMEOUT", "60")]),
        None,
    )
    .wait(Duration::from_secs(90));
    assert_all(&outs, OK, "a late rank");
}

#[test]
fn large_messages_through_small_rings_are_exact() {
    for world in [2, 3] {
        let outs = spawn(
            world,
            "large",
            &|_| {
                shm_vars(&[
                    ("DSPARK_TIMEOUT", "60"),
                    ("DSPARK_SHM_RING_BYTES", "64K"),
                    ("DSPARK_CHUNK_BYTES", "16K"),
                ])
            },
            None,
        )
        .wait(Duration::from_secs(120));
        assert_all(&outs, OK, &format!("large, world {world}"));
    }
}

#[test]
fn ranks_on_one_host_choose_shm_and_dspark_transport_tcp_rules_it_out() {
    let outs = spawn(3, "kind", &|_| shm_vars(&[]), None).wait(Duration::from_secs(60));
    assert_all(&outs, OK, "auto");
    assert!(outs[0].out.contains("TRANSPORT shm"), "{}", outs[0].out);
    let outs = spawn(
        3,
        "kind",
        &|_| vars(&[("DSPARK_TRANSPORT", "tcp"), ("WANT_TRANSPORT", "tcp")]),
        None,
    )
    .wait(Duration::from_secs(60));
    assert_all(&outs, OK, "DSPARK_TRANSPORT=tcp");
    // Forced by one rank only, the others on auto: shm everywhere.
    let outs = spawn(
        2,
        "kind",
        &|r| {
            if r == 0 {
                vars(&[("DSPARK_TRANSPORT", "shm")])
            } else {
                shm_vars(&[])
            }
        },
        None,
    )
    .wait(Duration::from_secs(60));
    assert_all(&outs, OK, "DSPARK_TRANSPORT=shm on rank 0");
}

#[test]
fn ranks_with_different_host_ids_share_memory_only_within_a_host_and_forcing_shm_names_the_ranks_per_host(
) {
    let host = |r: usize| if r < 2 { "host-a" } else { "host-b" };
    // Ranks 0 and 1 share host-a's memory and reach rank 2 over TCP; rank 2, alone on
    // host-b, uses TCP only (tests/mixed.rs covers mixed communicators).
    let want = |r: usize| if r < 2 { "shm+tcp" } else { "tcp" };
    let outs = spawn(
        3,
        "kind",
        &|r| shm_vars(&[("DSPARK_HOST_ID", host(r)), ("WANT_TRANSPORT", want(r))]),
        None,
    )
    .wait(Duration::from_secs(60));
    assert_all(&outs, OK, "two host identities, auto");
    let outs = spawn(
        3,
        "forced_on_two_hosts",
        &|r| vars(&[("DSPARK_HOST_ID", host(r)), ("DSPARK_TRANSPORT", "shm")]),
        None,
    )
    .wait(Duration::from_secs(60));
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(FAILED_AS_EXPECTED), "rank {r}:\n{}", o.out);
        assert!(
            o.out.contains("ranks 0, 1 on host-a") && o.out.contains("rank 2 on host-b"),
            "rank {r}: {}",
            o.out
        );
    }
}

#[test]
fn killed_rank_makes_every_survivor_fail_within_the_deadline_and_leaves_no_shared_memory() {
    // No FIN in shared memory: the liveness connection finds the dead rank long before 30 s.
    common::procs::killed_rank_fails_every_survivor_within_the_deadline(&|t| {
        shm_vars(&[("DSPARK_TIMEOUT", t)])
    });
    let (names, maps) = shm_residue();
    assert!(names.is_empty(), "dspark files in /dev/shm: {names:?}");
    assert!(
        maps.is_empty(),
        "processes still map dspark segments: {maps:?}"
    );
}

/// Forks a child that keeps copies of this process's sockets (the liveness connections
/// too) for 20 s, as torch's DataLoader workers (whose watchdog looks for the parent every
/// 5 s) or a multiprocessing pool do. It becomes `sleep 20` with only the sockets open: the
/// exec drops this process's mappings (another test checks that no process maps a dspark
/// segment) and every other descriptor (the test's pipes end with this process).
fn fork_a_sleeper() {
    let argv = [c"sleep".as_ptr(), c"20".as_ptr(), std::ptr::null()];
    // SAFETY: the child calls only async-signal-safe functions (fstat, fcntl, close, execv,
    // _exit), as fork in a threaded process requires; `argv` was built before the fork.
    match unsafe { nix::unistd::fork() } {
        Ok(nix::unistd::ForkResult::Child) => {
            for fd in 0..1024 {
                // SAFETY: a zeroed stat is a valid out-parameter; fstat, fcntl and close
                // accept any descriptor number.
                unsafe {
                    let mut st: libc::stat = std::mem::zeroed();
                    if libc::fstat(fd, &mut st) != 0 {
                        continue;
                    }
                    if st.st_mode & libc::S_IFMT == libc::S_IFSOCK {
                        libc::fcntl(fd, libc::F_SETFD, 0); // kept across the exec
                    } else {
                        libc::close(fd);
                    }
                }
            }
            for path in [c"/bin/sleep", c"/usr/bin/sleep"] {
                // SAFETY: a NUL-terminated path and a NULL-terminated argv of C strings.
                unsafe { libc::execv(path.as_ptr(), argv.as_ptr()) };
            }
            // SAFETY: _exit has no preconditions.
            unsafe { libc::_exit(127) }
        }
        Ok(nix::unistd::ForkResult::Parent { .. }) => {}
        Err(e) => panic!("fork: {e}"),
    }
}

/// A rank killed while a child it forked lives on (holding its liveness socket, so no end of
/// stream reaches the others): every survivor still fails within seconds, from the look at
/// the killed rank's process, not at the 30 s deadline or when the child ends.
#[test]
fn a_killed_rank_whose_forked_child_lives_on_fails_every_survivor_within_seconds() {
    common::procs::kill_one_rank(3, "loop_forked", 1, &shm_vars(&[("DSPARK_TIMEOUT", "30")]));
}

#[test]
fn stopped_rank_makes_every_survivor_time_out_within_the_deadline() {
    common::procs::stopped_rank_times_out_every_survivor_within_the_deadline(&|t| {
        shm_vars(&[("DSPARK_TIMEOUT", t)])
    });
}

#[test]
fn mismatched_counts_fail_every_process_with_mismatch_over_shared_memory() {
    common::procs::mismatched_counts_fail_every_process(&|t| shm_vars(&[("DSPARK_TIMEOUT", t)]));
}

#[test]
fn a_peer_dying_while_this_rank_waits_on_another_is_noticed_at_once_over_shared_memory() {
    common::procs::a_peer_dying_while_rank_0_waits_on_another_is_noticed_at_once(&|t| {
        shm_vars(&[("DSPARK_TIMEOUT", t)])
    });
}

#[test]
fn a_ring_asked_smaller_than_two_segments_still_takes_whole_frames() {
    // 4 KiB rings asked for, 512 KiB segments: recursive doubling at 1 MiB would deadlock
    // (each rank's receive waits for its own send) if the ring were not enlarged.
    let outs = spawn(
        2,
        "large",
        &|_| shm_vars(&[("DSPARK_TIMEOUT", "20"), ("DSPARK_SHM_RING_BYTES", "4K")]),
        None,
    )
    .wait(Duration::from_secs(60));
    assert_all(&outs, OK, "4 KiB ring asked for");
}

#[test]
fn what_a_rank_sent_before_exiting_is_still_received_from_its_segment() {
    let outs = spawn(
        2,
        "send_then_exit",
        &|_| shm_vars(&[("DSPARK_TIMEOUT", "20"), ("DSPARK_SHM_RING_BYTES", "2M")]),
        None,
    )
    .wait(Duration::from_secs(30));
    assert_all(&outs, OK, "send then exit");
}

/// #10: shared memory commits the rings of the standing partners at init and connects only
/// them (13 ranks: 4 of each rank's 12 peers are not partners); the other pairs' rings are
/// committed and their liveness connections made on first use.
#[test]
fn only_standing_partners_are_committed_and_connected_at_init_and_the_others_on_first_use() {
    let outs = spawn(
        13,
        "lazy",
        &|_| {
            shm_vars(&[
                ("DSPARK_CHUNK_BYTES", "4096"),
                ("DSPARK_SHM_RING_BYTES", "64K"),
                ("DSPARK_TIMEOUT", "90"),
            ])
        },
        None,
    )
    .wait(Duration::from_secs(240));
    if let Some(l) = outs[0].out.lines().find(|l| l.contains("LAZY rank 0:")) {
        println!("{l}");
    }
    assert_all(&outs, OK, "world 13");
}

#[test]
fn a_first_use_of_a_non_partner_that_died_fails_naming_it_instead_of_waiting() {
    let n = 13;
    let outs = spawn(
        n,
        "lazy_lost",
        &|_| shm_vars(&[("DSPARK_TIMEOUT", "60")]),
        None,
    )
    .wait(Duration::from_secs(120));
    let (victim, strangers) = victim_and_strangers(n);
    assert_eq!(
        outs[victim].code,
        Some(42),
        "the victim:\n{}",
        outs[victim].out
    );
    for (r, o) in outs.iter().enumerate().filter(|(r, _)| *r != victim) {
        if let Some(l) = o.out.lines().find(|l| l.contains(": after ")) {
            println!("{l}");
        }
        let want = if strangers.contains(&r) {
            FAILED_AS_EXPECTED
        } else {
            OK
        };
        assert_eq!(o.code, Some(want), "rank {r}:\n{}", o.out);
    }
}

/// #10 at scale: 128 ranks on this host over shared memory (rings of 64 KiB): each commits
/// and connects only its standing partners at init, then every rank sends to and receives
/// from each of its ~114 non-partners and runs an all_to_all, so every pair's rings are
/// committed and every pair connected on first use (8128 liveness connections), exact.
#[test]
fn a_world_of_128_ranks_over_shared_memory_commits_on_first_use_what_all_to_all_needs() {
    let t0 = Instant::now();
    let outs = spawn(
        128,
        "lazy",
        &|_| {
            shm_vars(&[
                ("DSPARK_TRANSPORT", "shm"),
                ("DSPARK_CHUNK_BYTES", "4096"),
                ("DSPARK_SHM_RING_BYTES", "64K"),
                ("DSPARK_TIMEOUT", "300"),
            ])
        },
        None,
    )
    .wait(Duration::from_secs(420));
    if let Some(l) = outs[0].out.lines().find(|l| l.contains("LAZY rank 0:")) {
        println!("{l}");
    }
    println!("128 ranks: {:.1} s", t0.elapsed().as_secs_f64());
    assert_all(&outs, OK, "128 ranks over shm");
}

/// A rank killed while 13 ranks run all_to_all, whose pairs are mostly connected on first
/// use: every survivor fails (lost peer or abort) well within the 30 s deadline.
#[test]
fn a_rank_killed_during_all_to_all_over_pairs_connected_on_first_use_fails_every_survivor() {
    let n = 13;
    let victim = 5;
    let mut ranks = spawn(
        n,
        "a2a_loop",
        &|_| {
            shm_vars(&[
                ("DSPARK_TIMEOUT", "30"),
                ("DSPARK_SHM_RING_BYTES", "64K"),
                ("DSPARK_CHUNK_BYTES", "16K"),
            ])
        },
        None,
    );
    ranks.wait_ready(n);
    std::thread::sleep(Duration::from_millis(200));
    ranks.children[victim].kill().unwrap();
    let outs = ranks.wait(Duration::from_secs(60));
    for (r, o) in outs.iter().enumerate().filter(|(r, _)| *r != victim) {
        assert_eq!(o.code, Some(FAILED_AS_EXPECTED), "rank {r}:\n{}", o.out);
        assert!(
            o.elapsed < Duration::from_secs(10),
            "rank {r} took {:?}",
            o.elapsed
        );
    }
}
