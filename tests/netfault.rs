//! Network faults between "hosts" (#11 item 12): ranks run as processes in network namespaces
//! joined by a bridge (`Hosts` in tests/common/procs.rs), loop over checked all_reduces over
//! TCP, and mid-collective one host's network fails:
//!
//! * its link goes down (`ip link set eth0 down`);
//! * it drops every packet, in and out, without a word (an nftables `policy drop`): what its
//!   peers see when it loses power;
//! * it answers every segment with a reset (nftables `reject with tcp reset`).
//!
//! Every rank must fail with an error that names the peer it lost, well before the 60 s
//! deadline (keepalive on the TCP connections finds a silent host in seconds), with every
//! result before the fault checked against the independent reference; the harness kills what
//! still runs at a hard limit and fails.
//!
//! And before any of that, a nameserver that does not answer: every rank's init fails by
//! its deadline, naming the resolver (the rank's /etc/resolv.conf bind-mounted in a mount
//! namespace of its own, `unshare -m`).
//!
//! `tc netem` is not in this kernel, and neither are tc's `matchall` classifier and `gact`
//! (drop) action, so the silent drop and the reset use nftables (Debian's `nftables` package;
//! tests/run-all.sh installs it). Without root, `ip` or `nft` the tests skip with the reason;
//! with `DSPARK_REQUIRE_NETFAULT=1` they fail instead.

mod common;

use std::time::{Duration, Instant};

use common::procs::{
    netns_unavailable, rank_entry, say, spawn, vars, Hosts, Outcome, FAILED_AS_EXPECTED, WRONG,
};
use dspark::{Communicator, Error, ReduceOp};

/// Exit code of a rank that failed only at its deadline.
const TIMED_OUT: i32 = 4;
/// The deadline of every blocking operation in these tests.
const DEADLINE_S: &str = "60";
/// Every rank must have failed this long after the fault (the deadline is 60 s; keepalive
/// finds a silent peer in about 7 s; the rest is margin for a loaded 2-core machine).
const PROMPT: Duration = Duration::from_secs(30);
/// The harness kills every rank still running this long after the fault.
const HARD_LIMIT: Duration = Duration::from_secs(90);
/// Rank 0's rendezvous port on host 0 (each test has its own namespaces).
const ROOT_PORT: u16 = 29_517;

/// Entry point of a rank process. In a normal test run (no scenario set) it returns at once.
#[test]
fn rank_process() {
    rank_entry(run_scenario);
}

fn run_scenario(s: &str) -> Result<i32, String> {
    if s == "resolver" {
        // The init must fail by its deadline, saying the resolver did not answer.
        return Ok(match Communicator::from_env() {
            Ok(_) => {
                say("init succeeded with no resolver");
                WRONG
            }
            Err(e) => {
                say(&format!("FAILED init: {e}"));
                match e {
                    Error::Timeout { .. } if e.to_string().contains("resolver did not answer") => {
                        TIMED_OUT
                    }
                    _ => WRONG,
                }
            }
        });
    }
    let comm = Communicator::from_env().map_err(|e| format!("init: {e}"))?;
    let (r, n) = (comm.rank(), comm.world_size());
    let failed = |e: Error, what: &str| {
        say(&format!("FAILED {what}: {e}"));
        match e {
            Error::PeerLost { .. } | Error::Aborted { .. } => FAILED_AS_EXPECTED,
            Error::Timeout { .. } => TIMED_OUT,
            _ => WRONG,
        }
    };
    match s {
        "ring" => {
            // Checked all_reduces until one fails: every result before the fault is exact.
            let count = 64 * 1024 + 3;
            for it in 0u64.. {
                let mut buf = common::inputs::<f32>(ReduceOp::Sum, it, r, count);
                if let Err(e) = comm.all_reduce(&mut buf, ReduceOp::Sum) {
                    return Ok(failed(e, &format!("in all_reduce {it}")));
                }
                common::check(
                    &format!("all_reduce {it}"),
                    &buf,
                    &common::reduced::<f32>(ReduceOp::Sum, it, n, count),
                )?;
                if it == 0 {
                    say("READY");
                }
            }
            unreachable!()
        }
        "wait" => {
            let mut buf = vec![1u8; 1024];
            comm.all_reduce(&mut buf, ReduceOp::Max)
                .map_err(|e| e.to_string())?;
            say("READY");
            if r == 0 {
                // Waits to receive from rank 1, whose host then goes silent.
                let t = Instant::now();
                match comm.recv(&mut buf, 1) {
                    Ok(()) => Err("received from a host that is gone".into()),
                    Err(e) => Ok(failed(e, &format!("after {:.1?}", t.elapsed()))),
                }
            } else {
                // "Powered off": never heard from again; the harness kills it.
                std::thread::sleep(HARD_LIMIT * 2);
                Ok(WRONG)
            }
        }
        "stream" => {
            // Rank 0 streams to rank 1 without pause: there is always unacknowledged data on
            // the wire when rank 1's host goes silent, so keepalive cannot help.
            let mut buf = vec![7u8; 4 << 20];
            for it in 0u64.. {
                let res = if r == 0 {
                    comm.send(&buf, 1)
                } else {
                    comm.recv(&mut buf, 0)
                };
                if let Err(e) = res {
                    return Ok(failed(e, &format!("in transfer {it}")));
                }
                if it == 0 {
                    say("READY");
                }
            }
            unreachable!()
        }
        other => Err(format!("unknown scenario {other}")),
    }
}

/// Sets up `world` hosts, or says why this test cannot run here (`None`).
fn hosts(world: usize, tag: &str, test: &str) -> Option<Hosts> {
    if let Some(why) = netns_unavailable(&["ip", "nft"]) {
        assert!(
            std::env::var_os("DSPARK_REQUIRE_NETFAULT").is_none(),
            "{test}: DSPARK_REQUIRE_NETFAULT is set but {why}"
        );
        eprintln!("SKIPPED {test}: {why}; run as root with iproute2 and nftables");
        return None;
    }
    // Root with the tools: a set-up failure is a failure, not a skip.
    Some(Hosts::new(world, tag).unwrap_or_else(|e| panic!("{test}: setting up hosts: {e}")))
}

/// Starts `world` ranks of `scenario`, rank i on host i, and waits until each printed READY.
fn start(h: &Hosts, world: usize, scenario: &str) -> common::procs::Ranks {
    let root = format!("{}:{ROOT_PORT}", Hosts::addr(0));
    let env = move |_| {
        vars(&[
            ("DSPARK_ROOT_ADDR", root.as_str()),
            ("DSPARK_TIMEOUT", DEADLINE_S),
            ("DSPARK_TRANSPORT", "tcp"),
        ])
    };
    let wrap = |r: usize| h.wrap(r);
    let mut ranks = spawn(world, scenario, &env, Some(&wrap));
    ranks.wait_ready(world);
    ranks
}

/// The FAILED line of a rank's output, or all of it.
fn failure(o: &Outcome) -> &str {
    o.out
        .lines()
        .find(|l| l.starts_with("FAILED"))
        .unwrap_or(&o.out)
}

/// Every rank failed promptly with PeerLost or Aborted, and its error names `blame(rank)`.
fn assert_prompt_failures(what: &str, outs: &[Outcome], blame: &dyn Fn(usize) -> Vec<usize>) {
    let all: String = outs
        .iter()
        .enumerate()
        .map(|(r, o)| {
            format!(
                "--- rank {r}: exit {:?} after {:.1?}\n{}",
                o.code, o.elapsed, o.out
            )
        })
        .collect();
    for (r, o) in outs.iter().enumerate() {
        assert!(
            o.code != Some(TIMED_OUT),
            "{what}: rank {r} noticed nothing until its {DEADLINE_S} s deadline:\n{all}"
        );
        assert_eq!(o.code, Some(FAILED_AS_EXPECTED), "{what}: rank {r}:\n{all}");
        assert!(
            o.elapsed < PROMPT,
            "{what}: rank {r} failed only after {:.1?}:\n{all}",
            o.elapsed
        );
        let line = failure(o);
        let names = blame(r).iter().any(|p| line.contains(&format!("rank {p}")));
        assert!(
            names,
            "{what}: rank {r}'s error names none of ranks {:?}: {line}\n{all}",
            blame(r)
        );
    }
}

/// Three hosts loop over all_reduces; `fault` breaks host 1's network; every rank must fail
/// promptly and name the other side: ranks 0 and 2 name rank 1, rank 1 names 0 or 2.
fn fault_mid_collective(test: &str, tag: &str, fault: &dyn Fn(&Hosts) -> Result<(), String>) {
    let world = 3;
    let Some(h) = hosts(world, tag, test) else {
        return;
    };
    let ranks = start(&h, world, "ring");
    std::thread::sleep(Duration::from_millis(300));
    fault(&h).unwrap_or_else(|e| panic!("{test}: injecting the fault: {e}"));
    let t0 = Instant::now();
    let outs = ranks.wait(HARD_LIMIT);
    eprintln!(
        "{test}: every rank ended {:.1?} after the fault",
        t0.elapsed()
    );
    for (r, o) in outs.iter().enumerate() {
        eprintln!("  rank {r} after {:.1?}: {}", o.elapsed, failure(o));
    }
    assert_prompt_failures(test, &outs, &|r| if r == 1 { vec![0, 2] } else { vec![1] });
}

/// Adds an nftables table `f` to host `i` with input and output chains of `policy`, and
/// `rules` (each a list of words) in the input chain.
fn nft(h: &Hosts, i: usize, policy: &str, rules: &[&[&str]]) -> Result<(), String> {
    h.exec(i, &["nft", "add", "table", "inet", "f"])?;
    for (chain, hook) in [("in", "input"), ("out", "output")] {
        let spec = format!("{{ type filter hook {hook} priority 0 ; policy {policy} ; }}");
        h.exec(i, &["nft", "add", "chain", "inet", "f", chain, &spec])?;
    }
    for rule in rules {
        let mut argv = vec!["nft", "add", "rule", "inet", "f", "in"];
        argv.extend_from_slice(rule);
        h.exec(i, &argv)?;
    }
    Ok(())
}

#[test]
fn link_down_mid_all_reduce_fails_every_rank_promptly_naming_the_peer() {
    fault_mid_collective(
        "link_down_mid_all_reduce_fails_every_rank_promptly_naming_the_peer",
        "nfl",
        &|h| h.exec(1, &["ip", "link", "set", "eth0", "down"]),
    );
}

#[test]
fn silent_drop_mid_all_reduce_fails_every_rank_promptly_naming_the_peer() {
    fault_mid_collective(
        "silent_drop_mid_all_reduce_fails_every_rank_promptly_naming_the_peer",
        "nfd",
        // Host 1 drops everything on its wire, in and out: nothing tells anyone.
        &|h| nft(h, 1, "drop", &[&["iifname", "lo", "accept"]]),
    );
}

#[test]
fn reset_mid_all_reduce_fails_every_rank_promptly_naming_the_peer() {
    fault_mid_collective(
        "reset_mid_all_reduce_fails_every_rank_promptly_naming_the_peer",
        "nfr",
        // Every TCP segment reaching host 1 is answered with a reset (resets themselves pass,
        // so that the peers' resets reach rank 1 too).
        &|h| {
            nft(
                h,
                1,
                "accept",
                &[
                    &["tcp", "flags", "&", "rst", "==", "rst", "accept"],
                    &["meta", "l4proto", "tcp", "reject", "with", "tcp", "reset"],
                ],
            )
        },
    );
}

/// Starts a two-host `scenario`, makes host 1 silent (it drops everything, like a host that
/// lost power) and returns rank 0's outcome and how long after the fault it ended; rank 1 is
/// killed afterwards.
fn silence_host_1(test: &str, tag: &str, scenario: &str) -> Option<(Outcome, Duration)> {
    let h = hosts(2, tag, test)?;
    let mut ranks = start(&h, 2, scenario);
    std::thread::sleep(Duration::from_millis(500));
    nft(&h, 1, "drop", &[&["iifname", "lo", "accept"]])
        .unwrap_or_else(|e| panic!("{test}: injecting the fault: {e}"));
    let t0 = Instant::now();
    // Only rank 0 is judged: wait for it alone.
    while t0.elapsed() < HARD_LIMIT {
        if ranks.children[0].try_wait().ok().flatten().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let waited = t0.elapsed();
    let _ = ranks.children[1].kill();
    let outs = ranks.wait(Duration::from_secs(5));
    let o = outs.into_iter().next().expect("rank 0");
    eprintln!(
        "{test}: rank 0 ended {waited:.1?} after the fault: {}",
        failure(&o)
    );
    Some((o, waited))
}

#[test]
fn a_host_that_goes_silent_while_data_to_it_is_unacknowledged_is_found_before_the_deadline() {
    let test =
        "a_host_that_goes_silent_while_data_to_it_is_unacknowledged_is_found_before_the_deadline";
    let Some((o, waited)) = silence_host_1(test, "nfs", "stream") else {
        return;
    };
    // By design no sooner than 7 retransmission timeouts (at least 25 s, NCCL's order of
    // tolerance); the deadline is 60 s.
    let limit = Duration::from_secs(45);
    assert_eq!(o.code, Some(FAILED_AS_EXPECTED), "{test}:\n{}", o.out);
    assert!(
        waited < limit,
        "{test}: rank 0 noticed the silent host only after {waited:.1?}:\n{}",
        o.out
    );
    assert!(
        failure(&o).contains("lost rank 1")
            && (failure(&o).contains("retransmissions")
                || failure(&o).contains("zero-window probes")),
        "{test}: want PeerLost of rank 1 after retransmissions (or zero-window probes, when \
         its receive window was closed at the fault):\n{}",
        o.out
    );
}

#[test]
fn a_host_that_goes_silent_while_a_rank_waits_to_receive_from_it_is_found_in_seconds() {
    let test = "a_host_that_goes_silent_while_a_rank_waits_to_receive_from_it_is_found_in_seconds";
    // Rank 0 is (about to be) blocked in its receive from rank 1 when host 1 loses power;
    // rank 1 sleeps until the hard limit.
    let Some((o, waited)) = silence_host_1(test, "nfw", "wait") else {
        return;
    };
    let outs = [o];
    assert_prompt_failures(test, &outs[..1], &|_| vec![1]);
    assert!(
        waited < PROMPT,
        "{test}: rank 0 noticed the silent host only after {waited:.1?}"
    );
    assert!(
        outs[0].out.contains("lost rank 1"),
        "{test}: want PeerLost of rank 1:\n{}",
        outs[0].out
    );
}

/// The other side of the checks: a stopped process's kernel keeps acknowledging (and then
/// answers zero-window probes), so neither keepalive nor the retransmission check may take it
/// for a dead host. Its peer, whose sends filled the stopped rank's receive window, fails at
/// its deadline with `Timeout`, not earlier with `PeerLost`. (A short `TCP_USER_TIMEOUT` would
/// fail this: Linux applies it to zero-window probing.) Runs on loopback, without root.
#[test]
fn a_stopped_rank_whose_window_is_full_is_not_taken_for_a_dead_host() {
    let test = "a_stopped_rank_whose_window_is_full_is_not_taken_for_a_dead_host";
    // Longer than keepalive (about 7 s) and the retransmission check (at least 25 s).
    let deadline = Duration::from_secs(35);
    let secs = deadline.as_secs().to_string();
    let env = move |_| vars(&[("DSPARK_TIMEOUT", secs.as_str())]);
    let mut ranks = spawn(2, "stream", &env, None);
    ranks.wait_ready(2);
    let pid = nix::unistd::Pid::from_raw(ranks.children[1].id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    let t0 = Instant::now();
    while t0.elapsed() < deadline * 2 {
        if ranks.children[0].try_wait().ok().flatten().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let waited = t0.elapsed();
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
    let outs = ranks.wait(Duration::from_secs(5));
    let o = &outs[0];
    eprintln!(
        "{test}: rank 0 ended {waited:.1?} after SIGSTOP: {}",
        failure(o)
    );
    assert_eq!(o.code, Some(TIMED_OUT), "{test}: want Timeout:\n{}", o.out);
    assert!(
        waited + Duration::from_secs(3) >= deadline,
        "{test}: rank 0 gave up after {waited:.1?}, before its {deadline:?} deadline:\n{}",
        o.out
    );
}

/// A nameserver that does not answer: the root address is a name, and every rank's resolver
/// asks a nameserver (127.83.0.53:53, a socket this test holds and never answers; each rank
/// sees it as /etc/resolv.conf's only one, bind-mounted in a mount namespace of its own)
/// that holds each lookup for 30 s × 3 attempts. Every rank must fail within its 3 s
/// deadline, naming the resolver, not hang in init for 90 s (before: rank 0 in binding its
/// listener, rank 1 in reaching rank 0).
#[test]
fn a_nameserver_that_does_not_answer_fails_the_init_by_its_deadline() {
    let test = "a_nameserver_that_does_not_answer_fails_the_init_by_its_deadline";
    let skip = |why: &str| {
        assert!(
            std::env::var_os("DSPARK_REQUIRE_NETFAULT").is_none(),
            "{test}: {why}"
        );
        eprintln!("SKIPPED {test}: {why} (run as root with util-linux's unshare and mount)");
    };
    if let Some(why) = netns_unavailable(&["unshare", "mount"]) {
        return skip(&why);
    }
    // A mount namespace of its own (root in a container may lack CAP_SYS_ADMIN).
    let unshares = std::process::Command::new("unshare")
        .args(["-m", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !unshares {
        return skip("`unshare -m true` fails (no CAP_SYS_ADMIN?)");
    }
    // Lookups must go to resolv.conf's nameserver: glibc's `dns` module, no nscd or
    // systemd-resolved (`resolve`) in between, and a resolv.conf to mount over.
    let nss = std::fs::read_to_string("/etc/nsswitch.conf").unwrap_or_default();
    let hosts = nss
        .lines()
        .find(|l| l.trim_start().starts_with("hosts:"))
        .unwrap_or("");
    if !hosts.split_whitespace().any(|w| w == "dns") || hosts.contains("resolve") {
        return skip(&format!(
            "/etc/nsswitch.conf's {hosts:?} does not send lookups to resolv.conf's nameservers"
        ));
    }
    if std::path::Path::new("/var/run/nscd/socket").exists() {
        return skip("nscd runs (it would answer lookups instead of resolv.conf's nameserver)");
    }
    if std::fs::canonicalize("/etc/resolv.conf").is_err() {
        return skip("/etc/resolv.conf is missing or a dangling link (nothing to mount over)");
    }
    // An address of its own on loopback, so that a local resolver's port 53 is no matter.
    let Ok(_silent) = std::net::UdpSocket::bind("127.83.0.53:53") else {
        return skip("127.83.0.53:53 cannot be bound (something listens on *:53)");
    };
    let dir = std::env::temp_dir().join(format!("dspark-resolver-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let conf = dir.join("resolv.conf");
    std::fs::write(
        &conf,
        "nameserver 127.83.0.53\noptions timeout:30 attempts:3\n",
    )
    .expect("resolv.conf");
    let mount = format!(
        "mount --bind {} /etc/resolv.conf && exec \"$@\"",
        conf.display()
    );
    let wrap = |_: usize| {
        ["unshare", "-m", "sh", "-c", &mount, "sh"]
            .map(String::from)
            .to_vec()
    };
    let port = common::procs::free_port().to_string();
    let t0 = Instant::now();
    let outs = spawn(
        2,
        "resolver",
        &|_| {
            vars(&[
                (
                    "DSPARK_ROOT_ADDR",
                    &format!("dspark-no-answer.invalid:{port}"),
                ),
                ("DSPARK_TIMEOUT", "3"),
            ])
        },
        Some(&wrap),
    )
    .wait(Duration::from_secs(40));
    let _ = std::fs::remove_dir_all(&dir);
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(TIMED_OUT), "rank {r}:\n{}", o.out);
        assert!(
            o.elapsed < Duration::from_secs(20),
            "rank {r} took {:?}",
            o.elapsed
        );
    }
    eprintln!("{test}: both ranks failed in {:?}", t0.elapsed());
    for o in &outs {
        if let Some(l) = o.out.lines().find(|l| l.contains("FAILED init")) {
            eprintln!("  {l}");
        }
    }
}
