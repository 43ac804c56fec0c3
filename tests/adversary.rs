//! The stranger's test bed (issue 22): someone on the same machine or network who speaks
//! dspark's protocol but holds none of the job's secrets tries to join, stall or break a job.
//! Each case is judged by the job's outcome: the stranger is refused, and the job's own ranks
//! run as if it had not been there.
//!
//! The stranger is dspark itself, configured without the job's secret: its hellos and proofs
//! are exactly those anybody can compute from public values (the job-id-only key; with a
//! guessed token, a proof under a wrong key). So that it is not merely late, each case makes
//! the stranger arrive first: a rank of the job waits before it joins, and the stranger's
//! refusal must come from the job's rank 0 ("rank 0 refused this rank"), not from a closed
//! port or a deadline.
//!
//! Cases: a job of spawned processes (the spawner's secret, as `dspark-bench --ranks` gives
//! its ranks), a job that meets through a key-value store (the secret rank 0 publishes there;
//! and a stray `add` by another client of the store), and a sub-communicator of an open
//! parent (the secret derived at the split). This binary re-executes itself as rank processes
//! (`rank_process` is a rank's entry point; it does nothing in a normal test run).
//!
//! The module `during_run` (`tests/adversary/during_run.rs`) plays the stranger during a
//! run: while a spawned job's ranks run all_reduce and send/recv in a loop, it connects to
//! every listening socket of every rank process again and again, claiming each rank with no
//! secret and with a guessed token; each is refused by the rank (a challenge it cannot answer,
//! or its hello closed as another job's), never acknowledged, and every collective of the job
//! completes with exact results. Cases: 3 ranks over TCP with a split child, 3 ranks over
//! shared memory (the default on one host), and 6 ranks over TCP whose pairs connected on
//! first use connect while the stranger is at the listeners.
//!
//! The module `flood` (`tests/adversary/flood.rs`) holds the strangers who flood a job's
//! listeners: silent connections and reset churn during init, no wildcard listener, a
//! connection from no rank's address after init.

mod common;
#[path = "adversary/during_run.rs"]
mod during_run;
#[path = "adversary/flood.rs"]
mod flood;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use common::procs::{assert_all, free_port, rank_entry, say, spawn, vars, OK, WRONG};
use dspark::store::{MemStore, Store};
use dspark::{Communicator, Config, JobAuth, ReduceOp};

/// Entry point of a rank process. In a normal test run (no scenario set) it returns at once.
#[test]
fn rank_process() {
    rank_entry(run_scenario);
}

/// How long rank 1 of a spawned job waits before it joins: the stranger comes first.
const RANK_1_LATE: Duration = Duration::from_secs(3);

fn run_scenario(s: &str) -> Result<i32, String> {
    match s {
        "late_rank_1" => {
            if std::env::var("DSPARK_RANK").as_deref() == Ok("1") {
                thread::sleep(RANK_1_LATE);
            }
            let comm = Communicator::from_env().map_err(|e| format!("init: {e}"))?;
            // The words CommInfo says it in: the spawner's secret unless the case says else.
            let want = std::env::var("ADVERSARY_AUTH")
                .unwrap_or_else(|_| "job secret from the spawner".into());
            if !comm.info().auth.to_string().starts_with(&want) {
                say(&format!("auth is {}, not {want}", comm.info().auth));
                return Ok(WRONG);
            }
            all_reduce_is_exact(&comm)?;
            Ok(OK)
        }
        "during_run" => during_run::rank(),
        other => Err(format!("unknown scenario {other}")),
    }
}

/// The ranks' sum of `rank + 1`.
fn all_reduce_is_exact(comm: &Communicator) -> Result<(), String> {
    let n = comm.world_size();
    let mut v = vec![(comm.rank() + 1) as f64; 1000];
    comm.all_reduce(&mut v, ReduceOp::Sum)
        .map_err(|e| format!("all_reduce: {e}"))?;
    let want = (n * (n + 1) / 2) as f64;
    if v.iter().any(|&x| x != want) {
        return Err(format!("all_reduce gave {}, not {want}", v[0]));
    }
    Ok(())
}

/// A stranger claiming rank 1 of a 2-rank job whose rank 0 is at `addr`: first as a dspark
/// rank without any secret (the public job-id-only key), then with a guessed token (a proof
/// under a wrong key). Each must be refused by rank 0 itself.
fn stranger_is_refused(addr: &str) {
    for token in [None, Some("guessed")] {
        let mut c = Config::new(1, 2, addr);
        c.timeout = Duration::from_secs(20);
        c.job_token = token.map(String::from);
        let t0 = Instant::now();
        let e = Communicator::init(c)
            .map(|_| ())
            .expect_err("a stranger joined");
        let s = e.to_string();
        assert!(
            s.contains("rank 0 refused this rank"),
            "the stranger (token {token:?}) was not refused by rank 0 after {:.1?}: {s}",
            t0.elapsed()
        );
    }
}

/// A job of spawned processes has the spawner's secret: a stranger that reaches rank 0's
/// port at init, before the real rank 1, is refused and the job runs. (Before the secret,
/// the stranger was welcomed as rank 1 and the real rank 1 then failed the job: "rank 1
/// twice".)
#[test]
fn a_stranger_claiming_a_rank_of_a_spawned_job_at_init_is_refused_and_the_job_runs() {
    let _one = one_at_a_time();
    spawned_job_refuses_a_stranger(&[]);
}

/// The same with a token file (`DSPARK_JOB_TOKEN_FILE`, private to its owner), which wins
/// over the spawner's secret: the stranger's guessed token is refused.
#[test]
fn a_stranger_claiming_a_rank_of_a_token_file_job_at_init_is_refused_and_the_job_runs() {
    use std::os::unix::fs::PermissionsExt;
    let _one = one_at_a_time();
    let dir = std::env::temp_dir().join(format!("dspark-adversary-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    std::fs::write(&file, "the job's own token\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let f = file.to_str().unwrap().to_string();
    spawned_job_refuses_a_stranger(&[
        ("DSPARK_JOB_TOKEN_FILE", &f),
        ("ADVERSARY_AUTH", &format!("token file {f}")),
    ]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two spawned ranks (rank 1 late, with `extra` variables), a stranger first: refused by
/// rank 0, and the job runs.
fn spawned_job_refuses_a_stranger(extra: &[(&str, &str)]) {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut env = vec![
        ("DSPARK_ROOT_ADDR", addr.as_str()),
        ("DSPARK_TIMEOUT", "30"),
    ];
    env.extend_from_slice(extra);
    let env = vars(&env);
    let ranks = spawn(2, "late_rank_1", &move |_| env.clone(), None);
    // Refused by rank 0 itself means first: once the real rank 1 is in, rank 0 listens no
    // more, and a late stranger would time out instead.
    stranger_is_refused(&addr);
    let outs = ranks.wait(Duration::from_secs(60));
    assert_all(&outs, OK, "the job with a stranger at init");
}

/// Rank 0's address and secret of the store rendezvous' current generation, as a client of
/// the store reads them (the test's view; the stranger has no access to the store).
fn published_root(store: &MemStore) -> (String, String) {
    let t0 = Instant::now();
    loop {
        let g = store
            .compare_set("dspark/generation", b"probe", b"probe")
            .unwrap();
        let g = String::from_utf8_lossy(&g).to_string();
        let w: Vec<&str> = g.split_whitespace().collect();
        if w.len() == 5 && w[0] == "dspark-gen-v1" {
            let key = format!("dspark/root/{}-{}", w[1], w[3]);
            let v = store.get(&key, Duration::from_secs(20)).unwrap();
            let v = String::from_utf8(v).unwrap();
            let mut p = v.strip_prefix("dspark-root-v2 ").unwrap().split(' ');
            return (p.next().unwrap().into(), p.next().unwrap().into());
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no generation: {g}");
        thread::sleep(Duration::from_millis(5));
    }
}

fn store_config() -> Config {
    let mut c = Config::new(0, 1, "");
    c.timeout = Duration::from_secs(30);
    c
}

/// A torch-style store job (no token: rank 0 publishes a random secret in the store): a
/// stranger that reaches rank 0's port but not the store is refused, and the job runs.
#[test]
fn a_stranger_claiming_a_rank_of_a_store_job_at_init_is_refused_and_the_job_runs() {
    let _one = one_at_a_time();
    let store = MemStore::new();
    let s0 = store.clone();
    let r0 = thread::spawn(move || Communicator::init_with_store(&s0, 0, 2, store_config()));
    let (addr, secret) = published_root(&store);
    assert!(
        addr.starts_with("127.0.0.1:"),
        "rank 0 listens on {addr}, not loopback"
    );
    assert_eq!(secret.len(), 64, "the published secret: {secret}");
    stranger_is_refused(&addr);
    let s1 = store.clone();
    let r1 = thread::spawn(move || Communicator::init_with_store(&s1, 1, 2, store_config()));
    let comms: Vec<Communicator> = [r0, r1]
        .into_iter()
        .map(|r| r.join().unwrap().expect("the job's init"))
        .collect();
    thread::scope(|s| {
        for comm in &comms {
            assert_eq!(comm.info().auth, JobAuth::Store);
            assert!(comm
                .info()
                .auth
                .to_string()
                .contains("secret published in the store"));
            s.spawn(move || all_reduce_is_exact(comm).unwrap());
        }
    });
}

/// Another client of the store `add`s to the rendezvous' keys — the generation record, and
/// the counter that older versions kept — before and during two inits through one store:
/// neither init is moved to another generation. (With the old shared counter, the add
/// between rank 0's and the others' arrival sent rank 2 to the next generation, and the job
/// timed out.)
#[test]
fn a_stray_add_on_the_store_does_not_desynchronise_the_store_rendezvous() {
    let _one = one_at_a_time();
    let store = MemStore::new();
    // Before any init: the generation key becomes a number, which the first init replaces.
    assert_eq!(store.add("dspark/generation", 1).unwrap(), 1);
    for round in 0..2 {
        let s0 = store.clone();
        let r0 = thread::spawn(move || Communicator::init_with_store(&s0, 0, 3, store_config()));
        let _ = published_root(&store);
        // While rank 0 waits: the record is no number, so an add on it fails and changes
        // nothing; the old counter's key means nothing any more.
        assert!(
            store.add("dspark/generation", 1).is_err(),
            "round {round}: an add moved the generation record"
        );
        store.add("dspark/inits", 1).unwrap();
        let later: Vec<_> = (1..3)
            .map(|r| {
                let s = store.clone();
                thread::spawn(move || Communicator::init_with_store(&s, r, 3, store_config()))
            })
            .collect();
        let comms: Vec<Communicator> = std::iter::once(r0)
            .chain(later)
            .map(|h| h.join().unwrap().expect("an init through the store"))
            .collect();
        thread::scope(|s| {
            for c in &comms {
                s.spawn(move || all_reduce_is_exact(c).unwrap());
            }
        });
    }
}

/// One case at a time: the split case watches this process's listeners.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A sub-communicator of an open parent (no token, no spawner) still has a secret of its
/// own, derived at the split: a stranger that finds the new group's port while the group's
/// second rank is late (it connects before that rank even knows the address) is refused,
/// and the group runs. The group's listener binds the advertised loopback address, not a
/// wildcard.
#[test]
fn a_stranger_claiming_a_rank_of_a_split_child_at_init_is_refused_and_the_child_runs() {
    let _one = one_at_a_time();
    let port = free_port();
    let parents_up = Arc::new(Barrier::new(3));
    let scanned = Arc::new(Barrier::new(3));
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            let (up, scanned) = (parents_up.clone(), scanned.clone());
            thread::spawn(move || {
                let mut c = Config::new(r, 2, format!("127.0.0.1:{port}"));
                c.timeout = Duration::from_secs(30);
                let parent = Communicator::init(c).expect("the parent's init");
                assert_eq!(parent.info().auth, JobAuth::Open { port });
                up.wait();
                scanned.wait();
                if r == 1 {
                    thread::sleep(Duration::from_secs(3));
                }
                let child = parent
                    .split(Some(0), 0)
                    .expect("the split")
                    .expect("a member");
                assert_eq!(child.info().auth, JobAuth::Parent);
                all_reduce_is_exact(&child).unwrap();
            })
        })
        .collect();
    parents_up.wait();
    let before = listening("self");
    scanned.wait();
    // Rank 0's new listener appears at once (rank 1 calls split 3 s later).
    let t0 = Instant::now();
    let new = loop {
        let new: Vec<SocketAddr> = listening("self")
            .into_iter()
            .filter(|l| !before.contains(l))
            .collect();
        if !new.is_empty() {
            break new;
        }
        assert!(t0.elapsed() < Duration::from_secs(2), "no new listener");
        thread::sleep(Duration::from_millis(1));
    };
    // One stranger per new listener of this process (the group's rank 0's, and maybe a
    // port another case probed at the same moment), all at once: the group's rank 0 refuses
    // its stranger when rank 1 arrives; a stranger at any other port fails otherwise.
    let strangers: Vec<_> = new
        .into_iter()
        .map(|listener| {
            let (ip, child_port) = (listener.ip().to_string(), listener.port());
            thread::spawn(move || {
                let mut c = Config::new(1, 2, format!("127.0.0.1:{child_port}"));
                c.timeout = Duration::from_secs(12);
                let e = Communicator::init(c)
                    .map(|_| ())
                    .expect_err("a stranger joined");
                (ip, e.to_string())
            })
        })
        .collect();
    let outcomes: Vec<(String, String)> =
        strangers.into_iter().map(|t| t.join().unwrap()).collect();
    let refused: Vec<&(String, String)> = outcomes
        .iter()
        .filter(|(_, s)| s.contains("rank 0 refused this rank"))
        .collect();
    assert_eq!(
        refused.len(),
        1,
        "no stranger refused by the group's rank 0: {outcomes:?}"
    );
    assert_eq!(
        refused[0].0, "127.0.0.1",
        "the split's listener binds {}, not 127.0.0.1",
        refused[0].0
    );
    for r in ranks {
        r.join().unwrap();
    }
}

/// Asked for (`DSPARK_LISTEN_ANY=1`), the store rendezvous' rank 0 and a split group's first
/// rank listen on every interface, but still publish the address the ranks reach: the job
/// and its group meet.
#[test]
fn with_listen_any_a_store_job_and_its_split_child_still_meet() {
    let _one = one_at_a_time();
    let store = MemStore::new();
    let inits: Vec<_> = (0..2)
        .map(|r| {
            let s = store.clone();
            thread::spawn(move || {
                let mut c = store_config();
                c.listen_any = true;
                Communicator::init_with_store(&s, r, 2, c)
            })
        })
        .collect();
    let (addr, _) = published_root(&store);
    assert!(addr.starts_with("127.0.0.1:"), "rank 0 published {addr}");
    let comms: Vec<Communicator> = inits
        .into_iter()
        .map(|h| h.join().unwrap().expect("an init through the store"))
        .collect();
    thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                let child = c.split(Some(0), 0).expect("the split").expect("a member");
                assert_eq!(child.info().auth, JobAuth::Parent);
                all_reduce_is_exact(&child).unwrap();
            });
        }
    });
}

/// The TCP sockets process `pid` (a number, or `self`) listens on, from
/// `/proc/<pid>/net/tcp{,6}` matched to its descriptors by inode, oldest socket (lowest inode)
/// first: the parent's data listener before its split child's.
fn listening(pid: &str) -> Vec<SocketAddr> {
    let mut inodes = Vec::new();
    if let Ok(d) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for e in d.flatten() {
            if let Ok(t) = std::fs::read_link(e.path()) {
                let t = t.to_string_lossy().to_string();
                if let Some(i) = t.strip_prefix("socket:[").and_then(|t| t.strip_suffix(']')) {
                    inodes.push(i.to_string());
                }
            }
        }
    }
    let mut out = Vec::new();
    for (file, v6) in [("tcp", false), ("tcp6", true)] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{file}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[3] != "0A" || !inodes.iter().any(|i| i == f[9]) {
                continue;
            }
            if let Some(a) = parse_proc_addr(f[1], v6) {
                out.push((f[9].parse::<u64>().unwrap_or(u64::MAX), a));
            }
        }
    }
    out.sort_unstable();
    out.into_iter().map(|(_, a)| a).collect()
}

/// `0100007F:1F90` (or 32 hex digits for IPv6): words in host order, the port big-endian.
fn parse_proc_addr(s: &str, v6: bool) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let mut bytes = Vec::new();
    for k in (0..ip.len()).step_by(8) {
        let w = u32::from_str_radix(ip.get(k..k + 8)?, 16).ok()?;
        bytes.extend_from_slice(&w.to_ne_bytes());
    }
    let ip = if v6 {
        let b: [u8; 16] = bytes.try_into().ok()?;
        IpAddr::V6(Ipv6Addr::from(b))
    } else {
        let b: [u8; 4] = bytes.try_into().ok()?;
        IpAddr::V4(Ipv4Addr::from(b))
    };
    Some(SocketAddr::new(ip, port))
}
