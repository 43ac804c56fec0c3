//! `TcpStore` against PyTorch's real c10d TCPStore (both server backends), and against servers
//! that are not one.
//!
//! The torch tests spawn `tests/torch/tcpstore_server.py` with the python of
//! `DSPARK_TORCH_PYTHON`, else `$HOME/.cache/dspark/torch-venv/bin/python` (made by
//! `bash tests/torch/venv.sh`). Without a python that imports torch they print `SKIP: ...` and
//! pass, unless `DSPARK_REQUIRE_TORCH=1`, when they fail. The tests of non-TCPStore servers
//! need no torch.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::thread;
use std::time::{Duration, Instant};

use dspark::internals::bootstrap::store::{PrefixStore, Store, TcpStore};
use dspark::Error;

/// Deadline for python to import torch and start the store (seconds, under load).
const START: Duration = Duration::from_secs(120);
/// Deadline for one command of the helper.
const REPLY: Duration = Duration::from_secs(60);
/// Generous deadline for operations that should succeed.
const LONG: Duration = Duration::from_secs(30);

fn python() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("DSPARK_TORCH_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let home = std::env::var_os("HOME")?;
    let p = PathBuf::from(home).join(".cache/dspark/torch-venv/bin/python");
    p.exists().then_some(p)
}

fn required() -> bool {
    std::env::var("DSPARK_REQUIRE_TORCH").is_ok_and(|v| v == "1")
}

fn skip(reason: &str) -> Option<Torch> {
    assert!(
        !required(),
        "DSPARK_REQUIRE_TORCH=1 but {reason}; run bash tests/torch/venv.sh"
    );
    eprintln!("SKIP: {reason}; run bash tests/torch/venv.sh");
    None
}

/// A python process running torch's TCPStore (server or client), driven by commands.
struct Torch {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    port: u16,
}

impl Torch {
    /// torch's TCPStore server on 127.0.0.1, with the libuv or the legacy backend.
    fn serve(libuv: bool) -> Option<Torch> {
        Self::start(&[
            "serve",
            "--world-size",
            "2",
            "--libuv",
            if libuv { "1" } else { "0" },
        ])
    }

    /// The same on a given port.
    fn serve_on(port: u16) -> Option<Torch> {
        Self::start(&["serve", "--port", &port.to_string()])
    }

    /// A torch client of the store on `port`.
    fn client(port: u16) -> Option<Torch> {
        Self::start(&["client", "127.0.0.1", &port.to_string()])
    }

    fn start(args: &[&str]) -> Option<Torch> {
        let Some(py) = python() else {
            return skip("no python with torch (DSPARK_TORCH_PYTHON unset, no cached venv)");
        };
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/torch/tcpstore_server.py"
        );
        let mut child = match Command::new(&py)
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
        {
            Ok(c) => c,
            Err(e) => return skip(&format!("cannot run {}: {e}", py.display())),
        };
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut t = Torch {
            child,
            stdin,
            lines,
            port: 0,
        };
        let first = match t.lines.recv_timeout(START) {
            Ok(l) => l,
            Err(_) => panic!("{} {args:?} did not start within {START:?}", py.display()),
        };
        if let Some(why) = first.strip_prefix("noimport ") {
            return skip(&format!("{} cannot import torch ({why})", py.display()));
        }
        let mut words = first.split_whitespace();
        assert_eq!(words.next(), Some("ready"), "helper said: {first}");
        t.port = words.next().and_then(|p| p.parse().ok()).expect("a port");
        eprintln!(
            "torch {} store on port {}",
            words.next().unwrap_or("?"),
            t.port
        );
        Some(t)
    }

    /// Runs one command and returns what follows `ok` (panics on `err`).
    fn cmd(&mut self, line: &str) -> String {
        self.try_cmd(line)
            .unwrap_or_else(|reply| panic!("torch failed '{line}': {reply}"))
    }

    /// Runs one command: what follows `ok`, or the whole reply when it is not `ok`.
    fn try_cmd(&mut self, line: &str) -> Result<String, String> {
        writeln!(self.stdin, "{line}").expect("write to the helper");
        self.stdin.flush().expect("flush the helper's stdin");
        let reply = self
            .lines
            .recv_timeout(REPLY)
            .unwrap_or_else(|_| panic!("no reply to '{line}' within {REPLY:?}"));
        match reply.strip_prefix("ok") {
            Some(rest) => Ok(rest.trim().to_string()),
            None => Err(reply),
        }
    }

    fn connect(&self) -> TcpStore {
        TcpStore::connect("127.0.0.1", self.port, LONG).expect("connect to torch's TCPStore")
    }
}

impl Drop for Torch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn hex(b: &[u8]) -> String {
    if b.is_empty() {
        return "-".into();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    if s == "-" {
        return Vec::new();
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex from the helper"))
        .collect()
}

fn round_trip(libuv: bool) {
    let Some(mut py) = Torch::serve(libuv) else {
        return;
    };
    let store = py.connect().with_rank(1);
    store.set("rust/k", b"from rust").unwrap();
    assert_eq!(store.get("rust/k", LONG).unwrap(), b"from rust");
    assert_eq!(unhex(&py.cmd("get rust/k")), b"from rust");
    store.set("rust/k", b"overwritten").unwrap();
    assert_eq!(unhex(&py.cmd("get rust/k")), b"overwritten");
    py.cmd(&format!("set py/k {}", hex(b"from\0torch\xff")));
    assert_eq!(store.get("py/k", LONG).unwrap(), b"from\0torch\xff");
    assert!(store.check(&["py/k", "rust/k"]).unwrap());
    assert!(!store.check(&["py/k", "never"]).unwrap());
    assert_eq!(py.cmd("check rust/k py/k"), "1");
}

/// `compare_set` against torch's server, with torch's semantics (which the store rendezvous'
/// generation record relies on), and a stray `add` on a record that is no number: refused by
/// the server, from a torch client and from this one, leaving the record as it was.
fn compare_set_as_torch_does(libuv: bool) {
    let Some(mut py) = Torch::serve(libuv) else {
        return;
    };
    let store = py.connect().with_rank(1);
    // A missing key with a non-empty `expected`: answers `expected` and sets nothing.
    assert_eq!(
        store.compare_set("cas", b"probe", b"probe").unwrap(),
        b"probe"
    );
    assert_eq!(py.cmd("check cas"), "0");
    // A missing key with an empty `expected`: set.
    assert_eq!(store.compare_set("cas", b"", b"one").unwrap(), b"one");
    assert_eq!(unhex(&py.cmd("get cas")), b"one");
    // Another value: unchanged, and told what it holds.
    assert_eq!(store.compare_set("cas", b"two", b"three").unwrap(), b"one");
    assert_eq!(store.compare_set("cas", b"one", b"two").unwrap(), b"two");
    assert_eq!(unhex(&py.cmd("get cas")), b"two");
    // The rendezvous' record: an add fails and changes nothing.
    let rec = b"dspark-gen-v1 0 1 abc def";
    assert_eq!(store.compare_set("gen", b"", rec).unwrap(), rec);
    assert!(
        py.try_cmd("add gen 1 1").is_err(),
        "torch added to a record"
    );
    assert!(
        py.connect().add("gen", 1).is_err(),
        "an add moved the record"
    );
    // (The server drops the connection of a client that adds to a value that is no number:
    // that client is unusable afterwards; the server and the other clients are fine.)
    assert_eq!(store.get("gen", LONG).unwrap(), rec);
    assert_eq!(py.connect().compare_set("gen", b"x", b"y").unwrap(), rec);
}

#[test]
fn compare_set_works_as_torchs_on_its_libuv_server() {
    compare_set_as_torch_does(true);
}

#[test]
fn compare_set_works_as_torchs_on_its_legacy_server() {
    compare_set_as_torch_does(false);
}

#[test]
fn set_then_get_round_trips_through_torchs_libuv_server() {
    round_trip(true);
}

#[test]
fn set_then_get_round_trips_through_torchs_legacy_server() {
    round_trip(false);
}

#[test]
fn values_set_by_rust_are_read_back_byte_exact_by_torch() {
    let Some(mut py) = Torch::serve(true) else {
        return;
    };
    let store = py.connect();
    let all: Vec<u8> = (0..=255u8).collect();
    let big: Vec<u8> = (0..1 << 20)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let values: [(&str, &[u8]); 6] = [
        ("empty", b""),
        ("nul", b"\0"),
        ("ff", b"\xff"),
        ("mixed", b"\0a\xff\0\n b\r\x7f"),
        ("all", &all),
        ("big", &big),
    ];
    for (k, v) in values {
        store.set(k, v).unwrap();
    }
    for (k, v) in values {
        assert_eq!(
            unhex(&py.cmd(&format!("get {k}"))),
            v,
            "value '{k}' as torch reads it"
        );
        assert_eq!(
            store.get(k, LONG).unwrap(),
            v,
            "value '{k}' as rust reads it"
        );
    }
    // And the other way: what torch sets, Rust reads exactly.
    py.cmd(&format!("set py_all {}", hex(&all)));
    py.cmd("set py_empty -");
    assert_eq!(store.get("py_all", LONG).unwrap(), all);
    assert_eq!(store.get("py_empty", LONG).unwrap(), b"");
}

#[test]
fn get_waits_for_a_key_a_torch_client_sets_later() {
    let Some(mut py) = Torch::serve(true) else {
        return;
    };
    let store = py.connect();
    assert!(!store.check(&["late"]).unwrap());
    py.cmd(&format!("set_after 0.8 late {}", hex(b"worth the wait")));
    let start = Instant::now();
    assert_eq!(store.get("late", LONG).unwrap(), b"worth the wait");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(500),
        "get returned after {took:?}: it did not wait for the key"
    );
}

fn never_set_key_times_out(libuv: bool) {
    let Some(mut py) = Torch::serve(libuv) else {
        return;
    };
    let store = py.connect().with_rank(4);
    let timeout = Duration::from_millis(1500);
    let start = Instant::now();
    let e = store.get("never", timeout).unwrap_err();
    let took = start.elapsed();
    match &e {
        Error::Timeout { rank, op, .. } => {
            assert_eq!(*rank, 4, "{e}");
            assert!(op.contains("'never'"), "{e}");
        }
        _ => panic!("expected Error::Timeout, got {e}"),
    }
    assert!(
        took >= timeout && took < timeout + Duration::from_secs(4),
        "timed out after {took:?} for a timeout of {timeout:?}"
    );
    // The wait was cancelled cleanly: the same connection still works.
    py.cmd(&format!("set never {}", hex(b"now")));
    assert_eq!(store.get("never", LONG).unwrap(), b"now");
    assert_eq!(store.add("after_timeout", 3).unwrap(), 3);
}

#[test]
fn get_of_a_never_set_key_times_out_on_torchs_libuv_server() {
    never_set_key_times_out(true);
}

#[test]
fn get_of_a_never_set_key_times_out_on_torchs_legacy_server() {
    never_set_key_times_out(false);
}

#[test]
fn adds_from_rust_threads_and_a_torch_client_are_atomic() {
    let Some(server) = Torch::serve(true) else {
        return;
    };
    let Some(mut client) = Torch::client(server.port) else {
        return;
    };
    const THREADS: usize = 4;
    const PER_THREAD: usize = 500;
    const TORCH_ADDS: usize = 2000;
    // torch starts its adds, then the Rust threads start theirs, while torch is still adding.
    writeln!(client.stdin, "add counter 1 {TORCH_ADDS}").unwrap();
    client.stdin.flush().unwrap();
    let port = server.port;
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            thread::spawn(move || {
                let s = TcpStore::connect("127.0.0.1", port, LONG).unwrap();
                (0..PER_THREAD)
                    .map(|_| s.add("counter", 1).unwrap())
                    .collect::<Vec<i64>>()
            })
        })
        .collect();
    let mut seen: Vec<i64> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    let reply = client.lines.recv_timeout(REPLY).expect("torch's adds");
    let torch: Vec<i64> = reply
        .strip_prefix("ok ")
        .unwrap_or_else(|| panic!("torch's adds failed: {reply}"))
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    assert_eq!(torch.len(), TORCH_ADDS);
    seen.extend(&torch);
    seen.sort_unstable();
    let total = (THREADS * PER_THREAD + TORCH_ADDS) as i64;
    // Every add saw a distinct value, and none was lost.
    assert_eq!(seen, (1..=total).collect::<Vec<i64>>());
    let store = server.connect();
    assert_eq!(
        store.get("counter", LONG).unwrap(),
        total.to_string().into_bytes()
    );
    assert_eq!(store.add("counter", -total).unwrap(), 0);
    assert_eq!(client.cmd("get counter"), hex(b"0"));
}

#[test]
fn wait_returns_once_every_key_is_set_and_names_the_missing_ones_on_timeout() {
    let Some(mut py) = Torch::serve(true) else {
        return;
    };
    let store = py.connect().with_rank(2);
    py.cmd("set_after 0.3 w/a -");
    py.cmd("set_after 0.6 w/b 01");
    py.cmd("set_after 0.9 w/c 02");
    let start = Instant::now();
    store.wait(&["w/a", "w/b", "w/c"], LONG).unwrap();
    assert!(
        start.elapsed() >= Duration::from_millis(600),
        "wait returned after {:?}, before the last key was set",
        start.elapsed()
    );
    assert_eq!(py.cmd("check w/a w/b w/c"), "1");
    store.wait(&[], Duration::ZERO).unwrap();

    let timeout = Duration::from_millis(1000);
    let start = Instant::now();
    let e = store.wait(&["w/a", "w/missing"], timeout).unwrap_err();
    let took = start.elapsed();
    let s = e.to_string();
    assert!(matches!(e, Error::Timeout { rank: 2, .. }), "{s}");
    assert!(s.contains("'w/missing'"), "{s}");
    // Only the key that is still missing is named as missing.
    let detail = format!(
        "not set on the TCPStore at 127.0.0.1:{}: 'w/missing'",
        py.port
    );
    assert!(s.ends_with(&detail), "{s}");
    assert!(
        took >= timeout && took < timeout + Duration::from_secs(4),
        "{took:?}"
    );
}

#[test]
fn prefix_store_keys_interoperate_with_torchs_prefix_store() {
    let Some(mut py) = Torch::serve(true) else {
        return;
    };
    let tcp = py.connect();
    let pg = PrefixStore::new("default_pg/0/cpu", &tcp);
    pg.set("addr", b"10.0.0.1:4242").unwrap();
    assert_eq!(
        unhex(&py.cmd("pget default_pg/0/cpu addr")),
        b"10.0.0.1:4242"
    );
    assert_eq!(
        unhex(&py.cmd("get default_pg/0/cpu/addr")),
        b"10.0.0.1:4242"
    );
    py.cmd(&format!("pset default_pg/0/cpu qp {}", hex(b"\x01\x02")));
    assert_eq!(pg.get("qp", LONG).unwrap(), b"\x01\x02");
    assert_eq!(tcp.get("default_pg/0/cpu/qp", LONG).unwrap(), b"\x01\x02");
    assert_eq!(pg.add("count", 5).unwrap(), 5);
    assert_eq!(unhex(&py.cmd("pget default_pg/0/cpu count")), b"5");
    pg.wait(&["addr", "qp", "count"], LONG).unwrap();
}

#[test]
fn connect_retries_until_a_slow_starting_torch_server_is_up() {
    if python().is_none() {
        let _ = skip("no python with torch (DSPARK_TORCH_PYTHON unset, no cached venv)");
        return;
    }
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    // Connect first; python takes seconds to import torch and bind the port.
    let connecting = thread::spawn(move || {
        let start = Instant::now();
        let r = TcpStore::connect("127.0.0.1", port, START);
        (r, start.elapsed())
    });
    let Some(mut py) = Torch::serve_on(port) else {
        return;
    };
    let (store, took) = connecting.join().unwrap();
    let store = store.expect("connect retried until the server was up");
    eprintln!("connected after {took:?}");
    store.set("hello", b"world").unwrap();
    assert_eq!(unhex(&py.cmd("get hello")), b"world");
}

// ------------------------------------------------------------- servers that are not a TCPStore

/// A listener on 127.0.0.1 whose every connection is handed to `serve`.
fn fake_server(serve: impl Fn(std::net::TcpStream) + Send + 'static) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    thread::spawn(move || {
        for s in l.incoming().flatten() {
            serve(s);
        }
    });
    port
}

#[test]
fn connect_to_a_server_that_answers_garbage_fails_with_a_mismatch() {
    let port = fake_server(|mut s| {
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        thread::spawn(move || {
            let _ = s.read(&mut [0u8; 64]);
            thread::sleep(Duration::from_secs(30));
        });
    });
    let start = Instant::now();
    let e = TcpStore::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap_err();
    assert!(matches!(e, Error::Mismatch { .. }), "{e}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn connect_to_a_server_that_closes_at_once_fails_promptly() {
    let port = fake_server(drop);
    let start = Instant::now();
    let e = TcpStore::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap_err();
    assert!(
        matches!(e, Error::Mismatch { .. } | Error::Io { .. }),
        "{e}"
    );
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn connect_to_a_silent_server_times_out_instead_of_hanging() {
    let port = fake_server(|s| {
        thread::spawn(move || {
            let _s = s;
            thread::sleep(Duration::from_secs(60));
        });
    });
    let timeout = Duration::from_secs(2);
    let start = Instant::now();
    let e = TcpStore::connect("127.0.0.1", port, timeout).unwrap_err();
    let took = start.elapsed();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("handshake"), "{e}");
    assert!(
        took >= timeout && took < timeout + Duration::from_secs(3),
        "{took:?}"
    );
}

#[test]
fn connect_to_a_port_nobody_listens_on_fails_after_the_timeout_naming_the_address() {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let timeout = Duration::from_millis(800);
    let start = Instant::now();
    let e = TcpStore::connect("127.0.0.1", port, timeout).unwrap_err();
    let took = start.elapsed();
    assert!(matches!(e, Error::Io { .. }), "{e}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    assert!(
        took >= timeout && took < timeout + Duration::from_secs(3),
        "{took:?}"
    );
}
