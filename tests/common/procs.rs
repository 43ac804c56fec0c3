//! Rank processes: a test binary re-executes itself as N ranks. Each rank runs the
//! `rank_process` test of its binary with `DSPARK_TEST_SCENARIO` set; in a normal test run
//! that test returns at once.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The variable naming the scenario a rank process runs.
pub(crate) const SCENARIO: &str = "DSPARK_TEST_SCENARIO";
/// Exit code of a rank whose scenario passed.
pub(crate) const OK: i32 = 0;
/// Exit code of a rank whose scenario produced wrong results or the wrong error.
pub(crate) const WRONG: i32 = 1;
/// Exit code of a rank that failed the way its scenario expected (a dead peer, ...).
pub(crate) const FAILED_AS_EXPECTED: i32 = 3;

/// A free TCP port on 127.0.0.1, for a rank to listen on a moment later: one below the
/// kernel's ephemeral range (`ip_local_port_range`), which no `connect` or `bind(0)` is given
/// meanwhile. (A port of that range, found free by binding port 0, was taken by another
/// socket before rank 0 listened on it, twice in CI.) Tried from a start that differs per
/// process and call, and never one this process was given before.
pub(crate) fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static CALLS: AtomicU32 = AtomicU32::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let base = 10_000u32;
    // Never the same port twice in one test process: two tests running in parallel that
    // drew the same free port (each before its rank 0 listened) would fail one of them.
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if low <= base + 1000 {
        // No room below the ephemeral range: one the kernel finds free, never one given.
        for _ in 0..1000 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            if !given.contains(&port) {
                given.push(port);
                return port;
            }
        }
        panic!("no free port not given before");
    }
    let span = low - base;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let seed = nanos
        ^ std::process::id().wrapping_mul(2_654_435_761)
        ^ CALLS.fetch_add(1, Ordering::Relaxed).wrapping_mul(40_503);
    for k in 0..span {
        let port = (base + (seed.wrapping_add(k.wrapping_mul(7919))) % span) as u16;
        if !given.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.push(port);
            return port;
        }
    }
    panic!("no free port in {base}..{low}");
}

/// Prints a line and flushes it (parents read rank output as it comes).
pub(crate) fn say(msg: &str) {
    let mut o = std::io::stdout();
    let _ = writeln!(o, "{msg}");
    let _ = o.flush();
}

/// The body of a binary's `rank_process` test: runs `run(scenario)` when a scenario is set,
/// prints `SCENARIO <name> EXIT <code>` and exits with the code.
pub(crate) fn rank_entry(run: impl FnOnce(&str) -> Result<i32, String>) {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    let code = match run(&scenario) {
        Ok(code) => code,
        Err(e) => {
            say(&format!("RANK ERROR in scenario {scenario}: {e}"));
            WRONG
        }
    };
    say(&format!("SCENARIO {scenario} EXIT {code}"));
    std::process::exit(code);
}

/// Running rank processes.
pub(crate) struct Ranks {
    /// One child per rank.
    pub children: Vec<Child>,
}

/// How one rank process ended.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// Exit code (`None`: killed, e.g. after the time limit).
    pub code: Option<i32>,
    /// Its stdout then stderr.
    pub out: String,
    /// When it ended, from the start of waiting.
    pub elapsed: Duration,
}

/// Starts `world` rank processes of this binary running `scenario`, meeting on a fresh
/// 127.0.0.1 port; `env(rank)` adds variables; `wrap(rank)` prefixes the command (e.g.
/// `ip netns exec NS`).
pub(crate) fn spawn(
    world: usize,
    scenario: &str,
    env: &dyn Fn(usize) -> Vec<(String, String)>,
    wrap: Option<&dyn Fn(usize) -> Vec<String>>,
) -> Ranks {
    let port = free_port();
    let exe = std::env::current_exe().expect("own executable");
    // A random secret per job, as dspark-bench's spawner gives its ranks: a stranger that
    // reaches the port cannot join (a scenario's `env` may override it).
    let secret = dspark::internals::trust::spawner_secret().expect("a job secret");
    let children = (0..world)
        .map(|r| {
            let mut argv: Vec<String> = wrap.map(|w| w(r)).unwrap_or_default();
            argv.push(exe.display().to_string());
            argv.extend(
                [
                    "--exact",
                    "rank_process",
                    "--nocapture",
                    "--test-threads",
                    "1",
                ]
                .map(String::from),
            );
            let mut cmd = Command::new(&argv[0]);
            cmd.args(&argv[1..])
                .env(SCENARIO, scenario)
                .env("DSPARK_RANK", r.to_string())
                .env("DSPARK_WORLD_SIZE", world.to_string())
                .env("DSPARK_ROOT_ADDR", format!("127.0.0.1:{port}"))
                .env_remove("RUST_LOG")
                .env_remove("DSPARK_NODE")
                // The suites written for TCP keep testing TCP now that ranks on one host
                // choose shared memory by themselves; tests/shm.rs sets its own.
                .env("DSPARK_TRANSPORT", "tcp")
                .env(dspark::internals::trust::SPAWNER_SECRET_ENV, &secret)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env(r) {
                cmd.env(k, v);
            }
            cmd.spawn().expect("spawn rank process")
        })
        .collect();
    Ranks { children }
}

/// `list` as owned variables.
pub(crate) fn vars(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl Ranks {
    /// Waits for every rank, killing the ones still running after `limit`.
    pub(crate) fn wait(mut self, limit: Duration) -> Vec<Outcome> {
        let t0 = Instant::now();
        let mut done: Vec<Option<(Option<i32>, Duration)>> = vec![None; self.children.len()];
        while done.iter().any(Option::is_none) {
            for (i, c) in self.children.iter_mut().enumerate() {
                if done[i].is_none() {
                    if let Ok(Some(st)) = c.try_wait() {
                        done[i] = Some((st.code(), t0.elapsed()));
                    }
                }
            }
            if t0.elapsed() > limit {
                for (i, c) in self.children.iter_mut().enumerate() {
                    if done[i].is_none() {
                        let _ = c.kill();
                        let _ = c.wait();
                        done[i] = Some((None, t0.elapsed()));
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.children
            .iter_mut()
            .zip(done)
            .map(|(c, d)| {
                let mut out = String::new();
                if let Some(mut o) = c.stdout.take() {
                    let _ = o.read_to_string(&mut out);
                }
                if let Some(mut e) = c.stderr.take() {
                    let _ = e.read_to_string(&mut out);
                }
                let (code, elapsed) = d.unwrap_or((None, Duration::ZERO));
                Outcome { code, out, elapsed }
            })
            .collect()
    }

    /// Blocks until each of the first `n` ranks printed READY (after its first collective).
    pub(crate) fn wait_ready(&mut self, n: usize) {
        self.wait_ready_of(&(0..n).collect::<Vec<_>>());
    }

    /// Blocks until each rank in `ranks` printed READY.
    pub(crate) fn wait_ready_of(&mut self, ranks: &[usize]) {
        for &r in ranks {
            let c = &mut self.children[r];
            let out = c.stdout.as_mut().expect("piped stdout");
            let mut seen = Vec::new();
            let mut b = [0u8; 1];
            let t0 = Instant::now();
            while !String::from_utf8_lossy(&seen).contains("READY") {
                assert!(
                    t0.elapsed() < Duration::from_secs(120),
                    "rank never got ready"
                );
                match out.read(&mut b) {
                    Ok(1) => seen.push(b[0]),
                    _ => panic!(
                        "rank exited before READY: {}",
                        String::from_utf8_lossy(&seen)
                    ),
                }
            }
        }
    }
}

/// Asserts every rank exited with `want` after actually running its scenario.
pub(crate) fn assert_all(outs: &[Outcome], want: i32, what: &str) {
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(
            o.code,
            Some(want),
            "{what}: rank {r} exited {:?} after {:.1?}:\n{}",
            o.code,
            o.elapsed,
            o.out
        );
        // Guard against a rank process that ran no scenario at all.
        assert!(
            o.out.contains(&format!("EXIT {want}")),
            "{what}: rank {r} did not run its scenario:\n{}",
            o.out
        );
    }
}

/// Runs `cmd`, returning its stderr on failure.
pub(crate) fn sh(cmd: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd[0])
        .args(&cmd[1..])
        .output()
        .map_err(|e| format!("{}: {e}", cmd[0]))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            cmd.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Why network-namespace tests cannot run here (not root, a tool missing), or `None` where
/// they can. Where they can, a failure to set them up is a test failure, not a skip.
pub(crate) fn netns_unavailable(tools: &[&str]) -> Option<String> {
    // The effective uid, second on the `Uid:` line.
    let euid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(str::to_string))
        });
    if euid.as_deref() != Some("0") {
        return Some("not root (network namespaces need CAP_SYS_ADMIN)".into());
    }
    for t in tools {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {t}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            return Some(format!("`{t}` is not installed"));
        }
    }
    None
}

/// "Hosts": network namespaces, each with one interface `eth0` at 10.232.0.(i+1)/24, joined by
/// a bridge in a further "switch" namespace. Everything is deleted on drop.
pub(crate) struct Hosts {
    /// The hosts' namespaces.
    pub names: Vec<String>,
    /// The switch's namespace.
    pub switch: String,
}

impl Hosts {
    /// Creates `n` hosts named after `tag` (unique per test and process).
    pub(crate) fn new(n: usize, tag: &str) -> Result<Hosts, String> {
        let tag = format!("{tag}{}", std::process::id() % 100_000);
        let mut hosts = Hosts {
            names: Vec::new(),
            switch: format!("{tag}sw"),
        };
        sh(&["ip", "netns", "add", &hosts.switch])?;
        let sw = hosts.switch.clone();
        sh(&["ip", "-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        sh(&["ip", "-n", &sw, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let ns = format!("{tag}h{i}");
            sh(&["ip", "netns", "add", &ns])?;
            hosts.names.push(ns.clone());
            let port = format!("p{i}");
            sh(&[
                "ip", "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &port,
                "netns", &sw,
            ])?;
            sh(&["ip", "-n", &sw, "link", "set", &port, "master", "br0"])?;
            sh(&["ip", "-n", &sw, "link", "set", &port, "up"])?;
            let addr = format!("{}/24", Hosts::addr(i));
            sh(&["ip", "-n", &ns, "addr", "add", &addr, "dev", "eth0"])?;
            sh(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    /// Host `i`'s address.
    pub(crate) fn addr(i: usize) -> String {
        format!("10.232.0.{}", i + 1)
    }

    /// Runs `cmd` inside host `i`'s namespace.
    pub(crate) fn exec(&self, i: usize, cmd: &[&str]) -> Result<(), String> {
        let mut argv = vec!["ip", "netns", "exec", self.names[i].as_str()];
        argv.extend_from_slice(cmd);
        sh(&argv)
    }

    /// The command prefix that starts a process in host `i`.
    pub(crate) fn wrap(&self, i: usize) -> Vec<String> {
        ["ip", "netns", "exec", self.names[i].as_str()]
            .map(String::from)
            .to_vec()
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in self.names.iter().chain([&self.switch]) {
            let _ = sh(&["ip", "netns", "del", ns]);
        }
    }
}

/// The rank-process variables of a fault test: `DSPARK_TIMEOUT` plus the transport's own.
pub(crate) type Env<'a> = &'a dyn Fn(&str) -> Vec<(String, String)>;

/// Scenario `loop`: all_reduce until something fails; `FAILED_AS_EXPECTED` for a lost peer,
/// an abort or a timeout, `WRONG` for any other error. Prints `READY` after the first call.
pub(crate) fn loop_until_failure(comm: &dspark::Communicator) -> Result<i32, String> {
    use dspark::{Error, ReduceOp};
    let mut buf = vec![1.0f32; 256 * 1024];
    comm.all_reduce(&mut buf, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    say("READY");
    loop {
        if let Err(e) = comm.all_reduce(&mut buf, ReduceOp::Sum) {
            say(&format!("FAILED: {e}"));
            let expected = matches!(
                e,
                Error::PeerLost { .. } | Error::Aborted { .. } | Error::Timeout { .. }
            );
            return Ok(if expected { FAILED_AS_EXPECTED } else { WRONG });
        }
    }
}

/// Scenario `watch`: rank 0 receives from rank 1, which is alive and silent (8 s); rank 2
/// is killed meanwhile, and rank 0 must report `PeerLost` of rank 2.
pub(crate) fn watch_while_another_dies(comm: &dspark::Communicator) -> Result<i32, String> {
    use dspark::Error;
    match comm.rank() {
        0 => {
            say("READY");
            let t = Instant::now();
            let mut buf = vec![0u8; 16];
            match comm.recv(&mut buf, 1) {
                Err(e @ Error::PeerLost { peer: 2, .. }) => {
                    say(&format!("FAILED after {:?}: {e}", t.elapsed()));
                    Ok(FAILED_AS_EXPECTED)
                }
                other => Err(format!("expected PeerLost of rank 2, got {other:?}")),
            }
        }
        1 => {
            std::thread::sleep(Duration::from_secs(8));
            Ok(OK)
        }
        _ => {
            say("READY");
            std::thread::sleep(Duration::from_secs(60));
            Ok(OK)
        }
    }
}

/// Scenario `mismatch`: every rank passes a different count; each must get `Mismatch`.
pub(crate) fn mismatched_count(comm: &dspark::Communicator) -> Result<i32, String> {
    let mut buf = vec![1.0f32; 10 + comm.rank()];
    match comm.all_reduce(&mut buf, dspark::ReduceOp::Sum) {
        Err(e @ dspark::Error::Mismatch { .. }) => {
            say(&format!("FAILED: {e}"));
            Ok(FAILED_AS_EXPECTED)
        }
        other => Err(format!("expected Mismatch, got {other:?}")),
    }
}

/// Four ranks in scenario `loop`, rank 2 killed (SIGKILL) mid-collective: every survivor
/// must fail as expected well within the 30 s deadline, and one of them must name rank 2
/// (the dead rank directly, or inside the abort a survivor that noticed first sent).
/// `env(timeout)` gives a rank's variables. Returns the outcomes for further checks.
pub(crate) fn killed_rank_fails_every_survivor_within_the_deadline(env: Env<'_>) -> Vec<Outcome> {
    kill_one_rank(4, "loop", 2, &env("30"))
}

/// `world` ranks in `scenario` (which prints READY, then runs collectives until they
/// fail), rank `victim` killed (SIGKILL) mid-collective: every survivor fails as expected
/// within 10 s (the deadline in `vars` is 30 s), and one names the victim.
pub(crate) fn kill_one_rank(
    world: usize,
    scenario: &str,
    victim: usize,
    vars: &[(String, String)],
) -> Vec<Outcome> {
    let mut ranks = spawn(world, scenario, &|_| vars.to_vec(), None);
    ranks.wait_ready(world);
    std::thread::sleep(Duration::from_millis(200));
    ranks.children[victim].kill().unwrap(); // SIGKILL mid-collective
    let outs = ranks.wait(Duration::from_secs(60));
    for (r, o) in outs.iter().enumerate() {
        if r == victim {
            continue;
        }
        assert_eq!(o.code, Some(FAILED_AS_EXPECTED), "rank {r}:\n{}", o.out);
        // A dead peer is noticed at once, long before the 30 s deadline.
        assert!(
            o.elapsed < Duration::from_secs(10),
            "rank {r} took {:?}",
            o.elapsed
        );
    }
    let named = format!("rank {victim}");
    assert!(
        outs.iter()
            .enumerate()
            .filter(|(r, _)| *r != victim)
            .any(|(_, o)| o.out.contains(&named)),
        "no survivor names the killed {named}:\n{}",
        outs.iter()
            .map(|o| o.out.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    outs
}

/// Three ranks in scenario `loop`, rank 1 stopped (SIGSTOP): both survivors must finish on
/// their own with a timeout within the 2 s deadline (well under 8 s), naming the peer they
/// waited for; the stopped rank is killed afterwards.
pub(crate) fn stopped_rank_times_out_every_survivor_within_the_deadline(env: Env<'_>) {
    let world = 3;
    let vars = env("2");
    let mut ranks = spawn(world, "loop", &|_| vars.clone(), None);
    ranks.wait_ready(world);
    let pid = nix::unistd::Pid::from_raw(ranks.children[1].id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let t0 = Instant::now();
    // Survivors must finish on their own; the stopped rank is killed afterwards.
    let mut survivors_done = false;
    while t0.elapsed() < Duration::from_secs(20) {
        let done = [0, 2]
            .iter()
            .all(|&r| ranks.children[r].try_wait().ok().flatten().is_some());
        if done {
            survivors_done = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let waited = t0.elapsed();
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
    let outs = ranks.wait(Duration::from_secs(5));
    assert!(survivors_done, "survivors still running after {waited:?}");
    assert!(
        waited < Duration::from_secs(8),
        "deadline 2 s, took {waited:?}"
    );
    for r in [0, 2] {
        assert_eq!(
            outs[r].code,
            Some(FAILED_AS_EXPECTED),
            "rank {r}:\n{}",
            outs[r].out
        );
    }
    let all = format!("{}{}", outs[0].out, outs[2].out);
    // Whoever's deadline passes first names the peer it waited for: rank 1 itself, or — in
    // the ring, where rank 0 receives from rank 2, which is stuck on rank 1 — rank 2.
    assert!(
        all.contains("timed out") && (all.contains("rank 1") || all.contains("for rank 2")),
        "{all}"
    );
}

/// Three ranks in scenario `mismatch`: every one must fail with a `Mismatch` naming the
/// count, within 10 s (deadline 20 s).
pub(crate) fn mismatched_counts_fail_every_process(env: Env<'_>) {
    let vars = env("20");
    let outs = spawn(3, "mismatch", &|_| vars.clone(), None).wait(Duration::from_secs(30));
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(FAILED_AS_EXPECTED), "rank {r}:\n{}", o.out);
        assert!(o.out.contains("count"), "rank {r}: {}", o.out);
        assert!(
            o.elapsed < Duration::from_secs(10),
            "rank {r} took {:?}",
            o.elapsed
        );
    }
}

/// Three ranks in scenario `watch`: rank 0 waits on the silent rank 1 while rank 2 is killed;
/// rank 0 must fail as expected within 5 s — long before rank 1 wakes up (8 s) or the
/// deadline (30 s).
pub(crate) fn a_peer_dying_while_rank_0_waits_on_another_is_noticed_at_once(env: Env<'_>) {
    let vars = env("30");
    let mut ranks = spawn(3, "watch", &|_| vars.clone(), None);
    // Rank 0 is in its receive from the silent rank 1 once it printed READY.
    ranks.wait_ready_of(&[0, 2]);
    std::thread::sleep(Duration::from_millis(300));
    ranks.children[2].kill().unwrap();
    let outs = ranks.wait(Duration::from_secs(40));
    assert_eq!(
        outs[0].code,
        Some(FAILED_AS_EXPECTED),
        "rank 0:\n{}",
        outs[0].out
    );
    assert!(
        outs[0].elapsed < Duration::from_secs(5),
        "rank 0 took {:?}",
        outs[0].elapsed
    );
}

/// dspark's names in /dev/shm (there should never be any: segments are memfds), and the
/// processes of this test binary, other than this process and its running ranks (other tests
/// run in parallel), that still map a dspark segment: an orphaned rank would keep one alive.
/// Other programs' processes are not looked at: the machine is shared.
pub(crate) fn shm_residue() -> (Vec<String>, Vec<String>) {
    let names: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains("dspark"))
                .collect()
        })
        .unwrap_or_default();
    let me = std::process::id().to_string();
    let exe = std::env::current_exe().ok();
    let mut maps = Vec::new();
    if let Ok(d) = std::fs::read_dir("/proc") {
        for e in d.flatten() {
            let pid = e.file_name().to_string_lossy().into_owned();
            if pid.parse::<u32>().is_err() || pid == me {
                continue;
            }
            let parent = std::fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find_map(|l| l.strip_prefix("PPid:").map(|v| v.trim().to_string()))
                });
            if parent.as_deref() == Some(me.as_str()) {
                continue;
            }
            if std::fs::read_link(format!("/proc/{pid}/exe")).ok() != exe {
                continue;
            }
            if let Ok(m) = std::fs::read_to_string(format!("/proc/{pid}/maps")) {
                if m.contains("memfd:dspark-shm") {
                    maps.push(pid);
                }
            }
        }
    }
    (names, maps)
}

/// A line of /proc/self/status in KiB (0 when unknown).
pub(crate) fn status_kb(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with(&format!("{key}:")))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}
