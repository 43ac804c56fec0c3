//! The flight recorder on 3 rank processes over TCP: after a timeout, a lost peer and a
//! mismatch, every failing rank's dump (`DSPARK_FR_DUMP`) is checked field by field, and
//! `dspark analyze` names the late rank, the rank everyone waits for and the first call
//! where the ranks disagree.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::procs::{self, rank_entry, say, FAILED_AS_EXPECTED, OK, WRONG};
use dspark::{Communicator, Error, ReduceOp};
use serde_json::Value;

/// Calls every rank completes before the one that goes wrong (more than the ring holds).
const GOOD: u64 = 20;
/// The ring's size in these tests.
const ENTRIES: usize = 16;
/// Elements of every call (a prime, not a multiple of the world).
const COUNT: usize = 3;

#[test]
fn rank_process() {
    rank_entry(run_scenario);
}

fn dump_dir() -> Result<PathBuf, String> {
    std::env::var("DSPARK_FR_DUMP")
        .map(PathBuf::from)
        .map_err(|_| "DSPARK_FR_DUMP unset".to_string())
}

/// Waits until `files` exist in `dir` (the ranks that fail wrote them), at most a minute.
fn wait_for(dir: &Path, files: &[&str]) {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(60) && !files.iter().all(|f| dir.join(f).exists()) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run_scenario(s: &str) -> Result<i32, String> {
    let comm = Communicator::from_env().map_err(|e| format!("init: {e}"))?;
    let rank = comm.rank();
    say(&format!("PID {}", std::process::id()));
    if s == "split_mismatch" {
        return split_mismatch(&comm);
    }
    if s == "late" || s == "late_hosts" {
        return late(&comm);
    }
    say(&format!(
        "ALGO {}",
        comm.algorithm(dspark::Collective::AllReduce, COUNT * 4)
            .name()
    ));
    for i in 0..GOOD {
        let mut v = vec![(rank as f32) + i as f32; COUNT];
        comm.all_reduce(&mut v, ReduceOp::Sum)
            .map_err(|e| format!("call {i}: {e}"))?;
    }
    let dir = dump_dir()?;
    // Rank 0 times out first, always: rank 1 (which waits for rank 0 in the ring) hears its
    // abort before its own deadline.
    let short = comm.with_timeout(Duration::from_secs(if rank == 0 { 2 } else { 8 }));
    let mut v = vec![1f32; COUNT];
    let r = match (s, rank) {
        ("timeout", 2) => {
            // The late rank: never joins call GOOD+1; writes its record on demand once the
            // others have failed, and stays alive until then (its exit would be a lost peer).
            wait_for(&dir, &["rank0.json", "rank1.json"]);
            let rec = comm.flight_record().ok_or("no record")?;
            if rec.recorded != GOOD || rec.entries.len() != ENTRIES {
                return Err(format!("record of the late rank: {rec:?}"));
            }
            rec.write_to(&dir, "on_demand")
                .map_err(|e| format!("write: {e}"))?;
            return Ok(OK);
        }
        ("timeout", _) => short.all_reduce(&mut v, ReduceOp::Sum),
        ("peer_lost", 2) => std::process::exit(FAILED_AS_EXPECTED),
        ("peer_lost", _) => comm.all_reduce(&mut v, ReduceOp::Sum),
        ("mismatch", 2) => {
            let mut w = vec![1f32; COUNT + 2];
            comm.all_reduce(&mut w, ReduceOp::Sum)
        }
        ("mismatch", _) => comm.all_reduce(&mut v, ReduceOp::Sum),
        _ => return Err(format!("unknown scenario {s}")),
    };
    match r {
        Ok(()) => Err("the call that should fail succeeded".into()),
        Err(
            Error::Timeout { .. }
            | Error::PeerLost { .. }
            | Error::Mismatch { .. }
            | Error::Aborted { .. },
        ) => {
            // The dump is written when the communicator fails; the record says the same.
            let rec = comm.flight_record().ok_or("no record")?;
            let last = rec.entries.last().ok_or("empty record")?;
            if last.seq != Some(GOOD + 1) || last.failure.is_none() || rec.error.is_none() {
                return Err(format!("record after the failure: {rec:?}"));
            }
            Ok(FAILED_AS_EXPECTED)
        }
        Err(e) => {
            say(&format!("unexpected error: {e}"));
            Ok(WRONG)
        }
    }
}

/// Rank 1 comes to each of `GOOD` collectives 40 ms after the others (a straggler: its
/// data loading); every rank writes its record on demand.
fn late(comm: &Communicator) -> Result<i32, String> {
    for i in 0..GOOD {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(40));
        }
        let mut v = vec![i as f32; COUNT];
        comm.all_reduce(&mut v, ReduceOp::Sum)
            .map_err(|e| format!("call {i}: {e}"))?;
    }
    let rec = comm.flight_record().ok_or("no record")?;
    rec.write_to(&dump_dir()?, "on_demand")
        .map_err(|e| format!("write: {e}"))?;
    Ok(OK)
}

/// Four ranks split into two colour groups (even and odd ranks): each process's second
/// communicator, rank 0 of its group on ranks 0 and 1. In each group the second rank calls
/// an all_reduce of another size: both groups fail with a mismatch and dump.
fn split_mismatch(comm: &Communicator) -> Result<i32, String> {
    let rank = comm.rank();
    let sub = comm
        .split(Some((rank % 2) as i32), rank as i32)
        .map_err(|e| format!("split: {e}"))?
        .ok_or("no group")?;
    let mut v = vec![1f32; COUNT + sub.rank()];
    match sub.all_reduce(&mut v, ReduceOp::Sum) {
        Err(Error::Mismatch { .. } | Error::Aborted { .. }) => Ok(FAILED_AS_EXPECTED),
        other => Err(format!("the mismatched all_reduce gave {other:?}")),
    }
}

/// Runs `scenario` on 3 ranks; returns the dump directory and each rank's outcome.
fn run(scenario: &str) -> (PathBuf, Vec<procs::Outcome>) {
    run_on(3, scenario)
}

/// Runs `scenario` on `world` ranks.
fn run_on(world: usize, scenario: &str) -> (PathBuf, Vec<procs::Outcome>) {
    let dir = std::env::temp_dir().join(format!(
        "dspark-fr-{scenario}-{}-{}",
        std::process::id(),
        procs::free_port()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.display().to_string();
    let ranks = procs::spawn(
        world,
        scenario,
        &|r| {
            let mut v = procs::vars(&[
                ("DSPARK_FR_DUMP", &d),
                ("DSPARK_FR_ENTRIES", &ENTRIES.to_string()),
                ("DSPARK_ALGO", "ring"),
                ("DSPARK_TIMEOUT", "60"),
            ]);
            if scenario == "late_hosts" {
                // Ranks 0 and 1 on one host, rank 2 on another (as the link bed's hosts).
                let host = if r == 2 { "host-b" } else { "host-a" };
                v.push(("DSPARK_HOST_ID".into(), host.into()));
            }
            v
        },
        None,
    );
    (dir, ranks.wait(Duration::from_secs(120)))
}

fn load(dir: &Path, rank: usize) -> Value {
    let p = dir.join(format!("rank{rank}.json"));
    let t = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&t).unwrap_or_else(|e| panic!("{}: {e}\n{t}", p.display()))
}

/// Each rank's process id, as it printed it.
fn pids(outs: &[procs::Outcome]) -> Vec<u64> {
    outs.iter()
        .map(|o| {
            o.out
                .lines()
                .find_map(|l| l.split("PID ").nth(1)?.trim().parse().ok())
                .unwrap_or_else(|| panic!("no PID line in:\n{}", o.out))
        })
        .collect()
}

/// Checks a dump's `host`, `pid` and `places` (every rank: its host, data address and
/// process id) against the ranks' own `pids`; returns the host.
fn check_places(v: &Value, pids: &[u64]) -> String {
    let rank = v["rank"].as_u64().expect("rank") as usize;
    assert_eq!(v["pid"], pids[rank], "{v}");
    let host = v["host"].as_str().expect("host").to_string();
    assert!(!host.is_empty());
    let places = v["places"].as_array().expect("places");
    assert_eq!(places.len(), pids.len(), "{v}");
    for (r, p) in places.iter().enumerate() {
        assert_eq!(p["rank"], r as u64, "{p}");
        assert_eq!(p["pid"], pids[r], "{p}");
        assert_eq!(p["host"], host.as_str(), "one host: {p}");
        let addr = p["addr"].as_str().expect("addr");
        assert!(addr.parse::<std::net::SocketAddr>().is_ok(), "{p}");
    }
    host
}

fn algo(outs: &[procs::Outcome]) -> String {
    let line = outs[0]
        .out
        .lines()
        .find_map(|l| l.split("ALGO ").nth(1))
        .expect("rank 0 printed its algorithm");
    line.trim().to_string()
}

/// Checks the header and the completed entries of `rank`'s dump; returns the last entry.
fn check_dump(v: &Value, rank: u64, recorded: u64, algo: &str, reason: &[&str]) -> Value {
    assert_eq!(v["format"], "dspark-flight-record", "{v}");
    assert_eq!(v["version"], 1);
    assert_eq!(v["rank"], rank);
    assert_eq!(v["world"], 3);
    assert_eq!(v["communicator"], 0);
    assert_eq!(v["capacity"], ENTRIES as u64);
    assert_eq!(v["recorded"], recorded, "{v}");
    assert!(
        reason.contains(&v["reason"].as_str().unwrap_or("")),
        "reason {} not in {reason:?}",
        v["reason"]
    );
    let entries = v["entries"].as_array().expect("entries");
    assert_eq!(entries.len(), ENTRIES, "the ring keeps the last {ENTRIES}");
    let first = recorded + 1 - ENTRIES as u64;
    for (i, e) in entries.iter().enumerate() {
        assert_eq!(e["seq"], first + i as u64, "{e}");
        assert_eq!(e["collective"], "all_reduce");
        assert_eq!(e["dtype"], dspark::DataType::F32.name());
        assert_eq!(e["op"], "sum");
        assert_eq!(e["root"], Value::Null);
        assert_eq!(e["peer"], Value::Null);
        assert_eq!(e["algorithm"], algo);
        assert_eq!(e["transport"], "tcp");
        assert_eq!(e["path"], "host");
        let start = e["started_unix_ns"].as_u64().expect("start time");
        if e["seq"].as_u64() <= Some(GOOD) {
            assert_eq!(e["count"], COUNT as u64);
            assert_eq!(e["state"], "completed", "{e}");
            assert_eq!(e["failure"], Value::Null);
            assert!(e["ended_unix_ns"].as_u64().expect("end time") >= start);
        }
    }
    entries.last().cloned().expect("an entry")
}

/// `dspark analyze dir`'s output (it must succeed).
fn analyze(dir: &Path) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dspark"))
        .arg("analyze")
        .arg(dir)
        .output()
        .expect("run dspark analyze");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "dspark analyze failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("dspark analyze {}:\n{text}", dir.display());
    text
}

fn failure_kind(e: &Value) -> &str {
    e["failure"]["kind"].as_str().unwrap_or("none")
}

#[test]
fn a_timeout_leaves_dumps_that_name_the_late_rank_and_the_call_it_never_joined() {
    let (dir, outs) = run("timeout");
    for (r, o) in outs.iter().enumerate() {
        let want = if r == 2 { OK } else { FAILED_AS_EXPECTED };
        assert_eq!(o.code, Some(want), "rank {r}:\n{}", o.out);
    }
    let a = algo(&outs);
    // Rank 0 receives from rank 2 first in the ring: it times out waiting for rank 2, in
    // step 1, having received none of that step's bytes.
    let last0 = check_dump(&load(&dir, 0), 0, GOOD + 1, &a, &["timeout"]);
    assert_eq!(last0["seq"], GOOD + 1);
    assert_eq!(last0["state"], "failed");
    assert_eq!(last0["count"], COUNT as u64);
    assert_eq!(failure_kind(&last0), "timeout", "{last0}");
    assert_eq!(last0["failure"]["peer"], 2);
    let p = &last0["failure"]["progress"];
    assert_eq!(p["peer"], 2, "{last0}");
    assert_eq!(p["direction"], "recv");
    assert!(p["step"].as_u64() >= Some(1), "{last0}");
    assert_eq!(p["bytes"], 0);
    assert_eq!(p["of_bytes"], 4, "one element of the ring's thirds");
    assert!(p["steps"].as_u64() > p["step"].as_u64());
    // Rank 1 waits for rank 0 (its ring predecessor) and hears rank 0's abort.
    let last1 = check_dump(&load(&dir, 1), 1, GOOD + 1, &a, &["aborted"]);
    assert_eq!(last1["state"], "failed");
    assert_eq!(failure_kind(&last1), "aborted", "{last1}");
    assert_eq!(last1["failure"]["peer"], 0, "{last1}");
    assert_eq!(last1["failure"]["progress"]["peer"], 0, "{last1}");
    // The late rank's record, on demand: its last call is the last that every rank completed.
    let last2 = check_dump(&load(&dir, 2), 2, GOOD, &a, &["on_demand"]);
    assert_eq!(last2["seq"], GOOD);
    let pids = pids(&outs);
    let host = check_places(&load(&dir, 0), &pids);
    check_places(&load(&dir, 2), &pids);
    let report = analyze(&dir);
    for want in [
        format!("behind: rank 2 (on {host}, pid {}): its last call is all_reduce #{GOOD} (completed); it never started all_reduce #{}, which ranks 0, 1 reached", pids[2], GOOD + 1),
        format!("everyone waits for rank 2 (on {host}, pid {}): rank 0 timed out in all_reduce #{} receiving from rank 2", pids[2], GOOD + 1),
        format!("rank 1 was receiving from rank 0 in all_reduce #{} (step", GOOD + 1),
        format!("last call every rank completed: all_reduce #{GOOD}"),
    ] {
        assert!(report.contains(&want), "missing {want:?} in:\n{report}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_lost_peer_leaves_dumps_on_the_survivors() {
    let (dir, outs) = run("peer_lost");
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(FAILED_AS_EXPECTED), "rank {r}:\n{}", o.out);
    }
    let a = algo(&outs);
    // Rank 0 (which receives from rank 2 in the ring) or rank 1 (which sends to it) finds
    // rank 2 gone; the other fails with that one's abort, or finds it gone too.
    let kinds = ["peer_lost", "aborted"];
    let mut lost = 0;
    for r in 0..2u64 {
        let last = check_dump(&load(&dir, r as usize), r, GOOD + 1, &a, &kinds);
        assert_eq!(last["state"], "failed");
        assert_eq!(last["count"], COUNT as u64);
        let k = failure_kind(&last);
        assert!(kinds.contains(&k), "{last}");
        if k == "peer_lost" {
            assert_eq!(last["failure"]["peer"], 2, "{last}");
            lost += 1;
        } else {
            assert_eq!(
                last["failure"]["peer"],
                1 - r,
                "aborted by the other: {last}"
            );
        }
    }
    assert!(lost >= 1, "a survivor found rank 2 gone");
    assert!(
        !dir.join("rank2.json").exists(),
        "the dead rank wrote nothing"
    );
    // The survivors' tables say where the dead rank ran, and which process it was.
    let pids = pids(&outs);
    let host = check_places(&load(&dir, 1), &pids);
    let report = analyze(&dir);
    for want in [
        "dumps from ranks 0, 1 of 3; none from rank 2 (a rank writes one when its communicator fails".to_string(),
        format!("everyone waits for rank 2 (on {host}, pid {}; it left no dump): ", pids[2]),
        "lost rank 2 in all_reduce #21".to_string(),
        format!("next: look at rank 2's log or stack: rank 2: py-spy dump --pid {} on {host}", pids[2]),
    ] {
        assert!(report.contains(&want), "missing {want:?} in:\n{report}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs a straggler scenario (`late`, `late_hosts`): every rank must end well; returns
/// the dump directory, the ranks' pids and `dspark analyze`'s report.
fn run_late(scenario: &str) -> (PathBuf, Vec<u64>, String) {
    let (dir, outs) = run(scenario);
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(OK), "rank {r}:\n{}", o.out);
    }
    let report = analyze(&dir);
    (dir, pids(&outs), report)
}

/// The number of milliseconds the report's late line says right after `want` (and then,
/// if given, after `then`): rank 1 came 40 ms late, less what the others spend reaching
/// the call, within 20–45 ms on a loaded machine.
fn late_ms(report: &str, want: &str, then: Option<&str>) -> f64 {
    assert!(report.contains(want), "missing {want:?} in:\n{report}");
    let rest = report.split(want).nth(1).unwrap_or("");
    let rest = then.map_or(Some(rest), |t| rest.split(t).nth(1));
    let ms: f64 = rest
        .and_then(|t| t.split(" ms").next())
        .and_then(|t| t.parse().ok())
        .expect("the median lateness");
    assert!((20.0..=45.0).contains(&ms), "{report}");
    ms
}

#[test]
fn analyze_names_the_rank_that_starts_its_collectives_late() {
    let (dir, pids, report) = run_late("late");
    let host = check_places(&load(&dir, 0), &pids);
    // The ring keeps the last ENTRIES calls, every one of them 40 ms late on rank 1 (less
    // what the others spend reaching the call); its host is theirs: no clock caveat.
    let want = format!(
        "late: rank 1 (on {host}, pid {}) started last in {ENTRIES} of the {ENTRIES} \
         collectives every dump holds (#{}-#{GOOD}), a median ",
        pids[1],
        GOOD + 1 - ENTRIES as u64
    );
    late_ms(&report, &want, None);
    assert!(!report.contains("clock"), "{report}");
    assert!(report.contains("no rank is stuck"), "{report}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same straggler with ranks on two hosts (`DSPARK_HOST_ID`), whose clocks `dspark
/// analyze` does not compare: it goes by how much longer the others' calls lasted.
#[test]
fn analyze_names_a_late_rank_on_another_host_by_how_long_the_others_wait() {
    let (dir, pids, report) = run_late("late_hosts");
    // (The sequence numbers are not GOOD's: init's link probe between the hosts ran
    // collectives of its own.)
    let want = format!(
        "late: rank 1 (on host-a, pid {}) came last in {ENTRIES} of the {ENTRIES} collectives \
         every dump holds (#",
        pids[1],
    );
    late_ms(
        &report,
        &want,
        Some("): the others' calls lasted a median "),
    );
    assert!(
        report.contains("hosts: host-a (ranks 0, 1), host-b (rank 2)"),
        "{report}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_mismatch_leaves_dumps_that_show_the_first_disagreeing_call() {
    let (dir, outs) = run("mismatch");
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(FAILED_AS_EXPECTED), "rank {r}:\n{}", o.out);
    }
    let a = algo(&outs);
    let kinds = ["mismatch", "aborted", "peer_lost"];
    let mut mismatches = 0;
    for r in 0..3u64 {
        let last = check_dump(&load(&dir, r as usize), r, GOOD + 1, &a, &kinds);
        assert_eq!(last["state"], "failed");
        let want = if r == 2 { COUNT + 2 } else { COUNT };
        assert_eq!(last["count"], want as u64, "{last}");
        let k = failure_kind(&last);
        assert!(kinds.contains(&k), "{last}");
        mismatches += usize::from(k == "mismatch");
    }
    assert!(mismatches >= 1, "some rank found the mismatch");
    let report = analyze(&dir);
    let want = format!(
        "first disagreement: call #{}: rank 0 called all_reduce ({f} × {COUNT}, sum, {a}), rank 2 called all_reduce ({f} × {}, sum, {a})",
        GOOD + 1,
        COUNT + 2,
        f = dspark::DataType::F32.name(),
    );
    assert!(report.contains(&want), "missing {want:?} in:\n{report}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The two colour groups of one split both have a rank 0 whose second communicator it is:
/// their dumps are kept apart (each file names its communicator's id) and analyzed apart
/// (before, one group's rank 0 overwrote the other's `rank0.c1.json`, and the analysis mixed
/// the groups).
#[test]
fn the_dumps_of_two_colour_groups_of_one_split_stay_apart() {
    let (dir, outs) = run_on(4, "split_mismatch");
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(FAILED_AS_EXPECTED), "rank {r}:\n{}", o.out);
    }
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .expect("dump directory")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".json"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 4, "one dump per rank of each group: {files:?}");
    let mut ids = std::collections::BTreeSet::new();
    for f in &files {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(f)).unwrap())
            .unwrap_or_else(|e| panic!("{f}: {e}"));
        assert_eq!(v["communicator"], 1, "{f}");
        let id = v["communicator_id"].as_str().unwrap_or("").to_string();
        assert!(f.contains(&id) && id.len() == 16, "{f}: id {id:?}");
        ids.insert(id);
    }
    assert_eq!(ids.len(), 2, "two communicators: {files:?}");
    let report = analyze(&dir);
    assert_eq!(
        report.matches("communicator 1 (id ").count(),
        2,
        "two communicators analyzed apart:\n{report}"
    );
    assert_eq!(
        report.matches("dumps from ranks 0, 1 of 2").count(),
        2,
        "{report}"
    );
    assert!(!report.contains("second dump"), "{report}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn analyze_names_corrupt_and_missing_dumps_and_never_panics() {
    let dir = std::env::temp_dir().join(format!("dspark-fr-corrupt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Nothing usable: a clear error, not a panic.
    std::fs::write(
        dir.join("rank0.json"),
        "{\"format\":\"dspark-flight-record\",\"ver",
    )
    .unwrap();
    std::fs::write(dir.join("rank1.json"), "[1,2,3]").unwrap();
    std::fs::write(dir.join("rank3.json"), "").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dspark"))
        .arg("analyze")
        .arg(&dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no usable flight record"), "{err}");
    assert!(err.contains("rank0.json is cut short"), "{err}");
    assert!(
        err.contains("rank1.json is not a dspark flight record"),
        "{err}"
    );
    assert!(err.contains("rank3.json is empty"), "{err}");
    // One good dump beside them: analysed, the others named.
    let good = r#"{"format":"dspark-flight-record","version":1,"rank":1,"world":4,"communicator":0,
        "capacity":4,"recorded":1,"reason":"on_demand","error":null,"entries":[
        {"seq":1,"collective":"barrier","dtype":"u8","count":0,"op":null,"root":null,"peer":null,
         "algorithm":"dissemination","transport":"tcp","path":"host","state":"completed",
         "started_unix_ns":1,"ended_unix_ns":2,"duration_us":0.001,"failure":null}]}"#;
    std::fs::write(dir.join("rank1.json"), good).unwrap();
    std::fs::write(
        dir.join("rank2.json"),
        good.replace("\"version\":1", "\"version\":9"),
    )
    .unwrap();
    let report = analyze(&dir);
    for want in [
        "warning: rank0.json is cut short",
        "warning: rank2.json has format version 9",
        "dumps from rank 1 of 4; none from ranks 0, 2, 3",
        "last call every rank completed: barrier #1",
    ] {
        assert!(report.contains(want), "missing {want:?} in:\n{report}");
    }
    // No directory at all.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dspark"))
        .arg("analyze")
        .arg(dir.join("nope"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
    let _ = std::fs::remove_dir_all(&dir);
}
