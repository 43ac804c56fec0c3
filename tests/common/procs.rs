//! Rank processes: a test binary re-executes itself as N ranks. Each rank runs the
//! `rank_process` test of its binary with `DSPARK_TEST_SCENARIO` set; in a normal test run
//! that test returns at once.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The variable naming the scenario a rank process runs.
pub const SCENARIO: &str = "DSPARK_TEST_SCENARIO";
/// Exit code of a rank whose scenario passed.
pub const OK: i32 = 0;
/// Exit code of a rank whose scenario produced wrong results or the wrong error.
pub const WRONG: i32 = 1;
/// Exit code of a rank that failed the way its scenario expected (a dead peer, ...).
pub const FAILED_AS_EXPECTED: i32 = 3;

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Prints a line and flushes it (parents read rank output as it comes).
pub fn say(msg: &str) {
    let mut o = std::io::stdout();
    let _ = writeln!(o, "{msg}");
    let _ = o.flush();
}

/// The body of a binary's `rank_process` test: runs `run(scenario)` when a scenario is set,
/// prints `SCENARIO <name> EXIT <code>` and exits with the code.
pub fn rank_entry(run: impl FnOnce(&str) -> Result<i32, String>) {
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
pub struct Ranks {
    /// One child per rank.
    pub children: Vec<Child>,
}

/// How one rank process ended.
#[derive(Debug)]
pub struct Outcome {
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
pub fn spawn(
    world: usize,
    scenario: &str,
    env: &dyn Fn(usize) -> Vec<(String, String)>,
    wrap: Option<&dyn Fn(usize) -> Vec<String>>,
) -> Ranks {
    let port = free_port();
    let exe = std::env::current_exe().expect("own executable");
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
pub fn vars(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl Ranks {
    /// Waits for every rank, killing the ones still running after `limit`.
    pub fn wait(mut self, limit: Duration) -> Vec<Outcome> {
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
    pub fn wait_ready(&mut self, n: usize) {
        self.wait_ready_of(&(0..n).collect::<Vec<_>>());
    }

    /// Blocks until each rank in `ranks` printed READY.
    pub fn wait_ready_of(&mut self, ranks: &[usize]) {
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
pub fn assert_all(outs: &[Outcome], want: i32, what: &str) {
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
pub fn sh(cmd: &[&str]) -> Result<(), String> {
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
pub fn netns_unavailable(tools: &[&str]) -> Option<String> {
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
pub struct Hosts {
    /// The hosts' namespaces.
    pub names: Vec<String>,
    /// The switch's namespace.
    pub switch: String,
}

impl Hosts {
    /// Creates `n` hosts named after `tag` (unique per test and process).
    pub fn new(n: usize, tag: &str) -> Result<Hosts, String> {
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
    pub fn addr(i: usize) -> String {
        format!("10.232.0.{}", i + 1)
    }

    /// Runs `cmd` inside host `i`'s namespace.
    pub fn exec(&self, i: usize, cmd: &[&str]) -> Result<(), String> {
        let mut argv = vec!["ip", "netns", "exec", self.names[i].as_str()];
        argv.extend_from_slice(cmd);
        sh(&argv)
    }

    /// The command prefix that starts a process in host `i`.
    pub fn wrap(&self, i: usize) -> Vec<String> {
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
