//! `dspark analyze`'s tests: the analysis of dumps made here, each case the lines it must say.

use super::*;

/// Where a schedule of 4 steps waits, on its first, to receive 8 bytes from `peer`.
fn recv_from(peer: u64) -> Progress {
    Progress {
        peer,
        direction: "recv".into(),
        step: 1,
        steps: 4,
        of_bytes: 8,
        ..Default::default()
    }
}

fn call(seq: u64, count: u64, state: &str) -> Call {
    Call {
        seq: Some(seq),
        coll: "all_reduce".into(),
        dtype: "f32".into(),
        count,
        op: "sum".into(),
        root: None,
        algorithm: "ring".into(),
        state: state.into(),
        ..Default::default()
    }
}

#[test]
fn a_late_rank_and_a_disagreement_are_named() {
    let mut dumps = BTreeMap::new();
    let timeout = Failure {
        kind: "timeout".into(),
        peer: Some(2),
        progress: Some(recv_from(2)),
    };
    for r in 0..2 {
        let mut last = call(3, 2, "failed");
        last.failure = Some(timeout.clone());
        dumps.insert(
            r,
            Dump {
                rank: r,
                world: 3,
                calls: vec![call(1, 2, "completed"), call(2, 2, "completed"), last],
                ..Default::default()
            },
        );
    }
    dumps.insert(
        2,
        Dump {
            rank: 2,
            world: 3,
            calls: vec![call(1, 2, "completed"), call(2, 5, "completed")],
            ..Default::default()
        },
    );
    let out = analyze(&dumps).join("\n");
    assert!(
        out.contains("behind: rank 2: its last call is all_reduce #2"),
        "{out}"
    );
    assert!(out.contains("first disagreement: call #2"), "{out}");
    assert!(out.contains("everyone waits for rank 2"), "{out}");
    assert!(
        out.contains("last call every rank completed: all_reduce #2"),
        "{out}"
    );
}

/// Rank `r`'s dump of `world`, its last call failed with `kind` while it waited for
/// `peer` (receiving).
fn failed(r: u64, world: u64, kind: &str, peer: u64) -> Dump {
    let mut last = call(3, 2, "failed");
    last.failure = Some(Failure {
        kind: kind.into(),
        peer: Some(peer),
        progress: Some(recv_from(peer)),
    });
    Dump {
        rank: r,
        world,
        error: Some(format!("rank {r}: {kind}")),
        calls: vec![call(1, 2, "completed"), call(2, 2, "completed"), last],
        ..Default::default()
    }
}

#[test]
fn ranks_waiting_for_one_another_are_a_cycle_not_one_rank() {
    let dumps: BTreeMap<u64, Dump> = (0..3)
        .map(|r| (r, failed(r, 3, "timeout", (r + 1) % 3)))
        .collect();
    let out = analyze(&dumps).join("\n");
    assert!(out.contains("ranks 0-2 wait for one another"), "{out}");
    assert!(!out.contains("everyone waits for rank"), "{out}");
}

#[test]
fn an_aborted_ranks_wait_leads_to_the_rank_the_timeout_waited_for() {
    // Rank 1 came late: rank 2 timed out waiting for it and aborted the others, who
    // were waiting for ranks 2 and 0 then.
    let mut dumps = BTreeMap::new();
    dumps.insert(0, failed(0, 3, "aborted", 2));
    dumps.insert(1, failed(1, 3, "aborted", 0));
    dumps.insert(2, failed(2, 3, "timeout", 1));
    let out = analyze(&dumps).join("\n");
    let verdict = out.lines().find(|l| l.contains("wait")).unwrap_or("");
    assert!(
        verdict.starts_with("everyone waits for rank 1: rank 2 timed out"),
        "{out}"
    );
}

/// Rank `r`'s dump of a world of 3 whose all_reduce #474 (88 steps, `done` of them done)
/// failed with `kind` (`peer`: the rank lost, or the aborting rank), its schedule waiting to
/// receive from `waiting`.
fn ring_failure(r: u64, kind: &str, peer: u64, waiting: u64, done: u64) -> Dump {
    let mut d = failed(r, 3, kind, peer);
    let last = d.calls.last_mut().unwrap();
    last.seq = Some(474);
    last.failure = Some(Failure {
        kind: kind.into(),
        peer: Some(peer),
        progress: Some(Progress {
            steps: 88,
            steps_done: done,
            ..recv_from(waiting)
        }),
    });
    d
}

/// Rank 2 killed in a ring all_reduce: rank 1 lost it while its schedule was receiving from
/// rank 0 (the lost rank is the wait, not the schedule's peer); rank 0, aborted by rank 1,
/// was receiving from rank 2. Once said "everyone waits for rank 0 ... rank 1 lost rank 0".
#[test]
fn a_lost_rank_is_the_wait_whatever_the_schedule_waited_on() {
    let mut dumps = BTreeMap::new();
    dumps.insert(0, ring_failure(0, "aborted", 1, 2, 13));
    dumps.insert(1, ring_failure(1, "peer_lost", 2, 0, 17));
    let out = analyze(&dumps).join("\n");
    assert!(
        out.contains("everyone waits for rank 2 (it left no dump): rank 1 lost rank 2"),
        "{out}"
    );
    assert!(!out.contains("lost rank 0"), "{out}");
}

/// Rank 2 SIGSTOPped, then resumed (so it dumped too): the waits close a cycle (1 on 0, 0
/// on 2, 2 on 1), and rank 2's progress, far behind, says it is the one. Once said
/// "everyone waits for rank 0".
#[test]
fn a_stopped_rank_is_found_behind_the_cycle_of_waits() {
    let mut dumps = BTreeMap::new();
    dumps.insert(0, ring_failure(0, "aborted", 1, 2, 75));
    dumps.insert(1, ring_failure(1, "timeout", 0, 0, 77));
    dumps.insert(2, ring_failure(2, "aborted", 1, 1, 61));
    let out = analyze(&dumps).join("\n");
    assert!(
        out.contains(
            "everyone waits for rank 2: rank 2 is behind, not waiting: it had done 61 of 88"
        ),
        "{out}"
    );
    // Before it dumped: rank 0 waited for it, silent.
    dumps.remove(&2);
    let out = analyze(&dumps).join("\n");
    assert!(
        out.contains("everyone waits for rank 2 (it left no dump)"),
        "{out}"
    );
}

/// Only the aborted rank's dump: the rank that aborted it lost another, as its error says;
/// that one is the wait, not the aborting rank. Once said "everyone waits for rank 2".
#[test]
fn the_aborting_ranks_cause_is_read_from_the_error_when_it_left_no_dump() {
    let mut d = ring_failure(0, "aborted", 2, 2, 52);
    d.error = Some(
        dspark::Error::Aborted {
            rank: 0,
            by: 2,
            op: "all_reduce #474 (communicator)".into(),
            reason: dspark::Error::PeerLost {
                rank: 2,
                peer: 1,
                op: "all_reduce #474 (receive)".into(),
                detail: "its process died".into(),
            }
            .to_string(),
        }
        .to_string(),
    );
    let dumps = BTreeMap::from([(0, d)]);
    let out = analyze(&dumps).join("\n");
    assert!(
        out.contains("everyone waits for rank 1 (it left no dump): rank 2 lost rank 1 in all_reduce #474 (as rank 0's error says)"),
        "{out}"
    );
    assert!(out.contains("next: look at rank 1's log"), "{out}");
}

/// Only the late rank's dump (the other host's directory not there): rank 1 timed out
/// waiting for rank 0 and aborted it, as rank 0's error says. The verdict is rank 0, not a
/// cycle of the two (a review's case: the aborting rank counted as silent).
#[test]
fn the_late_ranks_own_dump_names_it_from_the_timeout_in_its_error() {
    let mut d = ring_failure(0, "aborted", 1, 1, 0);
    d.error = Some(
        dspark::Error::Aborted {
            rank: 0,
            by: 1,
            op: "all_reduce #474 (communicator)".into(),
            reason: dspark::Error::Timeout {
                rank: 1,
                peer: Some(0),
                op: "all_reduce #474".into(),
                waited: std::time::Duration::from_secs(300),
                detail: "waiting to receive from rank 0 (step 1 of 2)".into(),
            }
            .to_string(),
        }
        .to_string(),
    );
    let out = analyze(&BTreeMap::from([(0, d)])).join("\n");
    assert!(
        out.contains("everyone waits for rank 0: rank 1 timed out waiting for rank 0"),
        "{out}"
    );
    assert!(!out.contains("one another"), "{out}");
}

#[test]
fn two_dead_ranks_are_two_groups_and_long_lists_are_ranges() {
    let mut dumps: BTreeMap<u64, Dump> = (0..4)
        .map(|r| (r, failed(r, 70, "peer_lost", if r < 2 { 5 } else { 4 })))
        .collect();
    for r in 6..70 {
        dumps.insert(r, failed(r, 70, "peer_lost", 5));
    }
    let out = analyze(&dumps).join("\n");
    assert!(out.contains("dumps from ranks 0-3, 6-69 of 70"), "{out}");
    assert!(out.contains("ranks 0, 1, 6-69 wait for rank 5"), "{out}");
    assert!(out.contains("ranks 2, 3 wait for rank 4"), "{out}");
    assert!(out.contains("and 62 more"), "{out}");
    assert!(out.contains("ranks 6-69 failed too"), "{out}");
    assert!(out.lines().all(|l| l.len() < 1000), "{out}");
}

#[test]
fn dumps_written_a_day_apart_are_said_to_be_of_different_runs() {
    let day = 86_400 * 1_000_000_000u64;
    let mut dumps: BTreeMap<u64, Dump> = (0..4).map(|r| (r, failed(r, 4, "timeout", 3))).collect();
    for (r, d) in dumps.iter_mut() {
        d.dumped_at_ns = if *r >= 2 { day } else { 2 * day };
    }
    let out = analyze(&dumps).join("\n");
    assert!(out.contains("24.0 hours apart (ranks 2, 3 older)"), "{out}");
    for d in dumps.values_mut() {
        d.dumped_at_ns = day;
    }
    assert!(!analyze(&dumps).join("\n").contains("apart"));
}

#[test]
fn a_ring_of_sends_and_a_stuck_receive_are_said() {
    let mut dumps: BTreeMap<u64, Dump> = (0..2).map(|r| (r, failed(r, 3, "timeout", 2))).collect();
    let mut send = call(115, 4, "completed");
    send.coll = "send".into();
    send.peer = Some(1);
    let mut recv = call(3, 4, "started");
    recv.coll = "recv".into();
    recv.peer = Some(0);
    dumps.insert(
        2,
        Dump {
            rank: 2,
            world: 3,
            calls: vec![send, recv],
            recorded: 135,
            ..Default::default()
        },
    );
    let out = analyze(&dumps).join("\n");
    assert!(
        out.contains("rank 2: its ring holds only its last 2 of 135 calls"),
        "{out}"
    );
    assert!(
        out.contains("rank 2 is inside recv #3 from rank 0, started and not finished"),
        "{out}"
    );
    assert!(!out.contains("no rank is stuck"), "{out}");
}

/// Rank `r`'s dump of a world of 3 holding `calls`, on `host` with pid 100 + r.
fn placed(r: u64, calls: Vec<Call>, host: &str) -> Dump {
    let mut d = Dump {
        rank: r,
        world: 3,
        calls,
        ..Default::default()
    };
    d.places.insert(r, place(host, 100 + r));
    d
}

fn place(host: &str, pid: u64) -> Place {
    Place {
        host: host.into(),
        pid: Some(pid),
    }
}

#[test]
fn a_rank_that_left_no_dump_is_named_with_its_host_and_process() {
    // Ranks 0 and 1 on host a lost rank 2 on host b, which left no dump; their tables
    // say where it ran.
    let table: BTreeMap<u64, Place> = [
        (0, place("a", 10)),
        (1, place("a", 11)),
        (2, place("b", 12)),
    ]
    .into();
    let dumps: BTreeMap<u64, Dump> = (0..2)
        .map(|r| {
            let mut d = failed(r, 3, "peer_lost", 2);
            d.places = table.clone();
            (r, d)
        })
        .collect();
    let out = analyze(&dumps).join("\n");
    for want in [
        "hosts: a (ranks 0, 1), b (rank 2)",
        "everyone waits for rank 2 (on b, pid 12; it left no dump)",
        "next: look at rank 2's log or stack: rank 2: py-spy dump --pid 12 on b (or gdb -p 12)",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
    // A rank's word on itself wins over another's table (a pid reused, a stale table),
    // in whichever order the dumps come; an empty host of its own erases nothing.
    let mut dumps = dumps;
    if let Some(d) = dumps.get_mut(&1) {
        d.places.insert(1, place("", 99));
        d.places.insert(0, place("c", 98));
    }
    // Above FULL_PLACES a dump lists only the ranks it names: the line says how many.
    assert_eq!(
        hosts_line(&table, 2000).as_deref(),
        Some("hosts: a (ranks 0, 1), b (rank 2) (3 ranks' places known)")
    );
    let merged = merged_places(&dumps);
    assert_eq!(merged[&0], place("a", 10), "rank 0's own word");
    assert_eq!(
        merged[&1],
        place("a", 99),
        "rank 1's own pid, rank 0's host"
    );
    assert_eq!(merged[&2], place("b", 12));
}

#[test]
fn a_rank_that_starts_its_collectives_late_is_named() {
    const MS: u64 = 1_000_000;
    let mut dumps: BTreeMap<u64, Dump> = BTreeMap::new();
    for r in 0..3u64 {
        let calls = (1..=8u64)
            .map(|s| {
                let t0 = s * 1_000 * MS;
                let mut c = call(s, 2, "completed");
                c.started_ns = if r == 1 {
                    t0 + 25 * MS
                } else {
                    t0 + r * MS / 10
                };
                c.ended_ns = t0 + 26 * MS;
                c
            })
            .collect();
        dumps.insert(r, placed(r, calls, "a"));
    }
    let out = analyze(&dumps).join("\n");
    let want = "late: rank 1 (on a, pid 101) started last in 8 of the 8 collectives every \
                dump holds (#1-#8), a median 24.8 ms after the others (at most 24.8 ms): \
                they wait for it";
    assert!(out.contains(want), "missing {want:?} in:\n{out}");
    assert!(out.contains("no rank is stuck"), "{out}");
    // One-shot calls (coarse start stamps) are not counted.
    for d in dumps.values_mut() {
        for c in &mut d.calls {
            c.algorithm = "one_shot".into();
        }
    }
    let out = analyze(&dumps).join("\n");
    assert!(!out.contains("late: rank"), "{out}");
    assert!(out.contains("late: not judged"), "{out}");
}

/// Ranks 0, 1 on host `h0`, rank 2 on `h2`; rank 2 comes 30 ms late to each of 8
/// all_reduces, and its clock is 500 ms ahead: its calls take 1 ms, the others' 31.
fn two_hosts(h0: &str, h2: &str) -> BTreeMap<u64, Dump> {
    const MS: u64 = 1_000_000;
    (0..3u64)
        .map(|r| {
            let skew = if r == 2 { 500 * MS } else { 0 };
            let calls = (1..=8u64)
                .map(|s| {
                    let t0 = s * 1_000 * MS;
                    let mut c = call(s, 2, "completed");
                    c.started_ns = skew + if r == 2 { t0 + 30 * MS } else { t0 };
                    c.ended_ns = skew + t0 + 31 * MS;
                    c
                })
                .collect();
            (r, placed(r, calls, if r == 2 { h2 } else { h0 }))
        })
        .collect()
}

#[test]
fn across_hosts_a_late_rank_is_found_by_how_long_the_others_calls_last() {
    let out = analyze(&two_hosts("node01", "waitrose02")).join("\n");
    let want = "late: rank 2 (on waitrose02, pid 102) came last in 8 of the 8 collectives \
                every dump holds (#1-#8): the others' calls lasted a median 30.0 ms \
                longer than its own";
    assert!(out.contains(want), "missing {want:?} in:\n{out}");
    // A host named like a wait is no wait.
    assert!(
        out.contains("hosts: node01 (ranks 0, 1), waitrose02 (rank 2)"),
        "{out}"
    );
    assert!(out.contains("no rank is stuck"), "{out}");
    // A broadcast's root waits for nobody: broadcasts are not counted.
    let mut dumps = two_hosts("node01", "node02");
    for d in dumps.values_mut() {
        for c in &mut d.calls {
            c.coll = "broadcast".into();
        }
    }
    assert!(!analyze(&dumps).join("\n").contains("late:"));
}

#[test]
fn a_communicator_without_calls_is_one_line() {
    let dumps: BTreeMap<u64, Dump> = (0..3)
        .map(|r| {
            let d = Dump {
                rank: r,
                world: 3,
                ..Default::default()
            };
            (r, d)
        })
        .collect();
    assert_eq!(
        analyze(&dumps),
        ["dumps from ranks 0-2 of 3; no calls recorded"]
    );
}

#[test]
fn rank_lists_fold_runs_of_three_or_more() {
    let l = |v: &[u64]| list(&v.iter().copied().collect());
    assert_eq!(l(&[3]), "rank 3");
    assert_eq!(l(&[0, 1]), "ranks 0, 1");
    assert_eq!(l(&[0, 1, 2, 5, 7, 8]), "ranks 0-2, 5, 7, 8");
}

/// Small all_reduces run one-shot are not compared for a late rank (their start is coarse):
/// when they are all there is, the report says it did not judge, not only "no rank is stuck".
#[test]
fn a_job_of_one_shot_calls_is_said_not_judged_for_lateness() {
    let dumps: BTreeMap<u64, Dump> = (0..2)
        .map(|r| {
            let calls = (1..=12)
                .map(|s| Call {
                    algorithm: "one_shot".into(),
                    started_ns: 1_000_000 * s + r * 40_000_000,
                    ended_ns: 1_000_000 * s + 40_000_000,
                    ..call(s, 1000, "completed")
                })
                .collect();
            (
                r,
                Dump {
                    rank: r,
                    world: 2,
                    calls,
                    ..Default::default()
                },
            )
        })
        .collect();
    let out = analyze(&dumps).join("\n");
    assert!(out.contains("no rank is stuck"), "{out}");
    assert!(
        out.contains("late: not judged: 12 of the calls ran one_shot"),
        "{out}"
    );
}
