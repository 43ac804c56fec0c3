//! Strangers who flood a job's listeners (issue 22, "Init that strangers cannot stall"): each
//! case spawns rank processes of this test binary (the `flood_rank` test, with
//! `DSPARK_FLOOD_SCENARIO` set) on 127.0.0.1, plays the stranger from the test itself, and is
//! judged by the job's outcome.
//!
//! - 200 silent connections, then 2 s of connect/reset churn (`SO_LINGER` 0 closes, half of
//!   them after some garbage) on rank 0's rendezvous port while a 2-rank job with a token
//!   initialises (rank 1 starts 1.5 s into the churn, with the silent ones still open): every
//!   rank's init is Ok, rank 1's well within the deadline (under 10 s of 30).
//! - The same churn while a rank never comes: rank 0's error names the missing rank and stays
//!   under 4 KB (it grew past 300 KB before).
//! - After init, the ranks' listening sockets (read from `/proc/self/net/tcp{,6}`) bind
//!   127.0.0.1, never a wildcard; a connection to a data listener from 127.0.0.2 (this host,
//!   but no rank's address) is closed unread (the kernel resets it: its bytes were never
//!   read), while the same bytes from 127.0.0.1 are read and refused. Over TCP and over the
//!   default transport (shared memory on one host).
//!
//! Self-contained (no `common` module), so that it can be a module of another test file.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dspark::{Communicator, ReduceOp};

use crate::common::procs::free_port;

/// The variable naming the scenario a rank process runs.
const SCENARIO: &str = "DSPARK_FLOOD_SCENARIO";
/// A file whose existence tells the ranks of the `listen` scenario to finish.
const STOP: &str = "DSPARK_FLOOD_STOP";
const TOKEN: &str = "flood-test-token";

/// The rank processes' entry: runs the scenario when one is set, else returns at once.
#[test]
fn flood_rank() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    // The harness printed "test ... " without a line end: the markers start lines.
    println!();
    let code = match scenario.as_str() {
        "init" => rank_init(),
        "alone" => rank_alone(),
        "listen" => rank_listen(),
        other => {
            println!("unknown scenario {other}");
            1
        }
    };
    println!("FLOOD {scenario} EXIT {code}");
    let _ = std::io::stdout().flush();
    std::process::exit(code);
}

/// Init, one all_reduce, and how long init took.
fn rank_init() -> i32 {
    let t0 = Instant::now();
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            println!("INIT FAILED after {:?}: {e}", t0.elapsed());
            return 1;
        }
    };
    println!("INIT_MS {}", t0.elapsed().as_millis());
    let mut v = [comm.rank() as i64 + 1; 4];
    match comm.all_reduce(&mut v, ReduceOp::Sum) {
        Ok(()) if v == [3; 4] => 0,
        r => {
            println!("all_reduce: {r:?} {v:?}");
            1
        }
    }
}

/// Rank 0 of a job whose rank 1 never comes: its error, and its length.
fn rank_alone() -> i32 {
    match Communicator::from_env() {
        Ok(_) => {
            println!("init succeeded without rank 1");
            1
        }
        Err(e) => {
            let text = e.to_string();
            println!("ERRLEN {}", text.len());
            let shown: String = text.chars().take(8192).collect();
            println!("ERR {shown}");
            0
        }
    }
}

/// Init, then the listening sockets, then collectives (so that the listeners are watched)
/// until the parent creates the stop file.
fn rank_listen() -> i32 {
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            println!("INIT FAILED: {e}");
            return 1;
        }
    };
    for a in super::listening("self") {
        println!("LISTEN {a}");
    }
    println!("READY");
    let _ = std::io::stdout().flush();
    let stop = std::env::var(STOP).unwrap_or_default();
    let t0 = Instant::now();
    loop {
        // Rank 0 decides for everybody, so that all leave the loop together.
        let mut flag = [u8::from(
            std::path::Path::new(&stop).exists() || t0.elapsed() > Duration::from_secs(60),
        )];
        if let Err(e) = comm.broadcast(&mut flag, 0) {
            println!("broadcast: {e}");
            return 1;
        }
        if flag[0] == 1 {
            return 0;
        }
        if let Err(e) = comm.barrier() {
            println!("barrier: {e}");
            return 1;
        }
    }
}

/// Starts rank `rank` of `world` running `scenario`, meeting at 127.0.0.1:`port`.
fn spawn_rank(rank: usize, world: usize, port: u16, scenario: &str, env: &[(&str, &str)]) -> Child {
    let exe = std::env::current_exe().expect("own executable");
    // This test's name in the binary: this module's path without the crate's name.
    let path = module_path!();
    let module = path.split_once("::").map_or("", |(_, m)| m);
    let name = if module.is_empty() {
        "flood_rank".to_string()
    } else {
        format!("{module}::flood_rank")
    };
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", &name, "--nocapture", "--test-threads", "1"])
        .env(SCENARIO, scenario)
        .env("DSPARK_RANK", rank.to_string())
        .env("DSPARK_WORLD_SIZE", world.to_string())
        .env("DSPARK_ROOT_ADDR", format!("127.0.0.1:{port}"))
        .env("DSPARK_JOB_TOKEN", TOKEN)
        .env("DSPARK_TIMEOUT", "30")
        .env("DSPARK_TRANSPORT", "tcp")
        .env_remove("DSPARK_LISTEN_ANY")
        .env_remove("DSPARK_ACCEPT_ANY_SOURCE")
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn a rank process")
}

/// Waits for `c` (killing it after `limit`): its exit code and output.
fn finish(mut c: Child, limit: Duration) -> (Option<i32>, String) {
    let t0 = Instant::now();
    let code = loop {
        if let Ok(Some(st)) = c.try_wait() {
            break st.code();
        }
        if t0.elapsed() > limit {
            let _ = c.kill();
            let _ = c.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut out = String::new();
    if let Some(mut o) = c.stdout.take() {
        let _ = o.read_to_string(&mut out);
    }
    if let Some(mut e) = c.stderr.take() {
        let _ = e.read_to_string(&mut out);
    }
    (code, out)
}

/// Connects to 127.0.0.1:`port`, retrying for `limit` (until rank 0 listens).
fn reach(port: u16, limit: Duration) -> TcpStream {
    let t0 = Instant::now();
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => return s,
            Err(e) if t0.elapsed() > limit => panic!("rank 0 never listened on {port}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// Connects to `port` and resets, again and again for `span` (half of the connections send
/// garbage first): returns how many connected.
fn churn(port: u16, span: Duration) -> usize {
    let t0 = Instant::now();
    let mut n = 0usize;
    while t0.elapsed() < span {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        };
        if n.is_multiple_of(2) {
            let _ = s.write_all(&[0, 0, 0, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
        }
        let lin = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        let _ = nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::Linger, &lin);
        drop(s);
        n += 1;
    }
    n
}

#[test]
fn silent_connections_and_reset_churn_do_not_fail_a_tokened_init() {
    let port = free_port();
    let r0 = spawn_rank(0, 2, port, "init", &[]);
    // 200 silent connections are there before rank 1 starts (within their hello wait), and
    // churn goes on meanwhile.
    let silent: Vec<TcpStream> = (0..200)
        .map(|_| reach(port, Duration::from_secs(20)))
        .collect();
    let churner = std::thread::spawn(move || churn(port, Duration::from_secs(2)));
    // Rank 1 comes while the churn goes on (init ends as soon as it joined).
    std::thread::sleep(Duration::from_millis(1500));
    let r1 = spawn_rank(1, 2, port, "init", &[]);
    let (c1, out1) = finish(r1, Duration::from_secs(40));
    let (c0, out0) = finish(r0, Duration::from_secs(10));
    let churned = churner.join().unwrap();
    drop(silent);
    assert_eq!(
        c0,
        Some(0),
        "rank 0 ({churned} churned connections):\n{out0}"
    );
    assert_eq!(
        c1,
        Some(0),
        "rank 1 ({churned} churned connections):\n{out1}"
    );
    assert!(churned > 100, "only {churned} churned connections");
    // Rank 1 is not made to wait for the strangers' hello waits (5 s each, one after another
    // before): well under the 30 s deadline, even on a loaded machine.
    let ms: u64 = out1
        .lines()
        .find_map(|l| l.strip_prefix("INIT_MS "))
        .and_then(|v| v.trim().parse().ok())
        .expect("rank 1's init time");
    assert!(ms < 10_000, "rank 1's init took {ms} ms:\n{out1}");
}

#[test]
fn the_error_stays_short_when_a_rank_is_missing_under_churn() {
    let port = free_port();
    let r0 = spawn_rank(0, 2, port, "alone", &[("DSPARK_TIMEOUT", "3")]);
    let _first = reach(port, Duration::from_secs(20));
    let churned = churn(port, Duration::from_millis(2800));
    let (c0, out0) = finish(r0, Duration::from_secs(20));
    assert_eq!(c0, Some(0), "{out0}");
    let len: usize = out0
        .lines()
        .find_map(|l| l.strip_prefix("ERRLEN "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the error's length");
    println!("rank 0's error after {churned} churned connections: {len} bytes");
    assert!(churned > 100, "only {churned} churned connections");
    assert!(
        len < 4096 && out0.contains("missing rank(s) 1") && out0.contains("more refused"),
        "{len} bytes after {churned} connections:\n{}",
        out0.chars().take(6000).collect::<String>()
    );
}

/// A connection to `to` from 127.0.0.`last`.
fn connect_from(last: u8, to: SocketAddr) -> TcpStream {
    use nix::sys::socket::{bind, connect, socket, AddressFamily, SockFlag, SockType, SockaddrIn};
    use std::os::fd::AsRawFd;
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::empty(),
        None,
    )
    .expect("a socket");
    bind(fd.as_raw_fd(), &SockaddrIn::new(127, 0, 0, last, 0)).expect("bind 127.0.0.x");
    let SocketAddr::V4(to) = to else {
        panic!("{to} is not IPv4")
    };
    let [a, b, c, d] = to.ip().octets();
    connect(fd.as_raw_fd(), &SockaddrIn::new(a, b, c, d, to.port())).expect("connect");
    TcpStream::from(fd)
}

/// What a connection hears after sending `frame`: `Ok(bytes)` read before the close, or the
/// error (a reset when its bytes were never read), within `limit`.
fn hear(mut s: TcpStream, frame: &[u8], limit: Duration) -> Result<usize, std::io::ErrorKind> {
    s.write_all(frame).map_err(|e| e.kind())?;
    s.set_read_timeout(Some(limit)).unwrap();
    let mut got = 0;
    let mut b = [0u8; 256];
    loop {
        match s.read(&mut b) {
            Ok(0) => return Ok(got),
            Ok(n) => got += n,
            Err(e) => return Err(e.kind()),
        }
    }
}

#[test]
fn listeners_bind_no_wildcard_and_a_stranger_after_init_is_refused_unread() {
    // Over TCP, and over the default (shared memory on one host, which keeps the data
    // listener for its liveness connections).
    let mut verdicts = listen_case("tcp");
    verdicts.extend(listen_case("auto"));
    assert!(verdicts.is_empty(), "{}", verdicts.join("\n"));
}

/// A 2-rank job over `transport`: what is wrong with its listeners.
fn listen_case(transport: &str) -> Vec<String> {
    let port = free_port();
    let stop =
        std::env::temp_dir().join(format!("dspark-flood-stop-{}-{port}", std::process::id()));
    let _ = std::fs::remove_file(&stop);
    let stop_s = stop.display().to_string();
    let mut ranks: Vec<Child> = (0..2)
        .map(|r| {
            spawn_rank(
                r,
                2,
                port,
                "listen",
                &[(STOP, &stop_s), ("DSPARK_TRANSPORT", transport)],
            )
        })
        .collect();
    // Each rank's listening sockets, printed before READY.
    let mut seen: Vec<String> = Vec::new();
    for c in &mut ranks {
        let out = c.stdout.as_mut().expect("piped stdout");
        let mut text = Vec::new();
        let mut b = [0u8; 1];
        let t0 = Instant::now();
        while !String::from_utf8_lossy(&text).contains("READY") {
            assert!(
                t0.elapsed() < Duration::from_secs(40),
                "a rank never got ready"
            );
            match out.read(&mut b) {
                Ok(1) => text.push(b[0]),
                _ => break,
            }
        }
        seen.push(String::from_utf8_lossy(&text).to_string());
    }
    let mut verdicts = Vec::new();
    let mut data_ports = Vec::new();
    for (r, text) in seen.iter().enumerate() {
        let addrs: Vec<SocketAddr> = text
            .lines()
            .filter_map(|l| l.strip_prefix("LISTEN ")?.trim().parse().ok())
            .collect();
        if !text.contains("READY") || addrs.is_empty() {
            verdicts.push(format!("rank {r}: no listening socket seen:\n{text}"));
        }
        for a in &addrs {
            if a.ip().is_unspecified() || a.ip() != std::net::IpAddr::V4(Ipv4Addr::LOCALHOST) {
                verdicts.push(format!("rank {r} listens on {a}"));
            }
            data_ports.push(*a);
        }
    }
    // A stranger on this host, but at an address of no rank, is closed before anything it
    // sent is read (so the kernel resets it); the same bytes from a rank's address are read.
    let frame = [8u8, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];
    println!("{transport}: the ranks listen on {data_ports:?}");
    for a in &data_ports {
        // A listener that closes a stranger the moment it accepts it may close before the
        // stranger's bytes arrive (the stranger's thread was preempted between connect and
        // write): the stranger then hears the close first, `Ok(0)`, though nothing was read.
        // So a reset in any of a few tries is the evidence; a listener that read strangers'
        // bytes before closing would give `Ok(0)` every time, and one that answered them would
        // give bytes, which no try may hear.
        let mut heard = Vec::new();
        let verdict = loop {
            let t0 = Instant::now();
            let stranger = hear(connect_from(2, *a), &frame, Duration::from_secs(4));
            let took = t0.elapsed();
            heard.push(format!("{stranger:?} after {took:?}"));
            if (stranger != Ok(0) && stranger != Err(std::io::ErrorKind::ConnectionReset))
                || took > Duration::from_secs(3)
            {
                break Some("heard");
            }
            if stranger != Ok(0) {
                break None;
            }
            if heard.len() == 5 {
                break Some("was never reset unread; it heard");
            }
        };
        if let Some(what) = verdict {
            verdicts.push(format!(
                "a connection from 127.0.0.2 to {a} {what}: {}",
                heard.join(", ")
            ));
        }
        let local = hear(connect_from(1, *a), &frame, Duration::from_secs(4));
        if local != Ok(0) {
            verdicts.push(format!(
                "a connection from 127.0.0.1 to {a} heard {local:?}"
            ));
        }
    }
    std::fs::write(&stop, b"stop").unwrap();
    let outs: Vec<(Option<i32>, String)> = ranks
        .into_iter()
        .map(|c| finish(c, Duration::from_secs(30)))
        .collect();
    let _ = std::fs::remove_file(&stop);
    for (r, (code, out)) in outs.iter().enumerate() {
        if *code != Some(0) {
            verdicts.push(format!("rank {r} exited {code:?}:\n{}{out}", seen[r]));
        }
    }
    verdicts
        .into_iter()
        .map(|v| format!("{transport}: {v}"))
        .collect()
}
