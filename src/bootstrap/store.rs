//! Key-value stores for the rendezvous.
//!
//! [`Store`] is the small interface the bootstrap needs from a key-value store: `set`, a `get`
//! that waits for the key, an atomic `add` and a `wait` for several keys, each with a deadline.
//! Implementations:
//!
//! - [`TcpStore`]: a client of PyTorch's c10d `TCPStore`, the store that torchrun's agent and
//!   `init_process_group` serve on `MASTER_ADDR:MASTER_PORT`, speaking torch's own wire
//!   protocol, so a dspark rank can rendezvous through the store a torch job already has.
//! - [`PrefixStore`]: scopes keys as `"<prefix>/<key>"`, exactly like torch's `PrefixStore`
//!   (the store a torch backend factory receives is one).
//! - [`MemStore`]: in-process, for tests and for ranks that are threads of one process.
//!
//! # The TCPStore wire protocol
//!
//! Read from torch's sources (`torch/csrc/distributed/c10d/TCPStore.cpp`,
//! `store/TCPStoreBackend.hpp`, `TCPStoreBackend.cpp`, `TCPStoreLibUvBackend.cpp`) and checked
//! against torch 2.15.0, with both server backends (libuv, the default, and the legacy one,
//! `use_libuv=False`):
//!
//! - A request is one query-type byte followed by its arguments. All integers are
//!   little-endian (torch writes its in-memory values); a string or byte vector is a `u64`
//!   length followed by the bytes.
//! - Query types: `VALIDATE` 0, `SET` 1, `COMPARE_SET` 2, `GET` 3, `ADD` 4, `CHECK` 5,
//!   `WAIT` 6, `GETNUMKEYS` 7, `DELETE_KEY` 8, `APPEND` 9, `MULTI_GET` 10, `MULTI_SET` 11,
//!   `CANCEL_WAIT` 12, `PING` 13, `QUEUE_PUSH` 14, `QUEUE_POP` 15, `QUEUE_LEN` 16 and, in
//!   2.15, `LIST_KEYS` 17, `BARRIER` 18. This client uses only 0-6, 12 and 13.
//! - Handshake: the first request on a connection must be `VALIDATE` with the `u32` magic
//!   `0x3C85F7CE`; it has no reply. The legacy server closes a connection that starts any
//!   other way; the libuv server ignores it and never answers (so without a deadline a wrong
//!   handshake hangs). torch's client then sends `PING` with a `u32` nonce (its pid), which
//!   the server echoes; this client does the same and checks the echo.
//! - `SET key value`: no reply. `ADD key i64`: replies the new value as `i64`; the server
//!   stores integers as decimal text (`b"5"`), so `get` of a counter returns text.
//! - `WAIT count key...`: replies one byte, `STOP_WAITING` (0), once every key is set. On
//!   timeout the client sends `CANCEL_WAIT`; the server replies `WAIT_CANCELED` (1), preceded
//!   by `STOP_WAITING` when the keys were set just before the cancel arrived.
//! - `GET key`: replies the value as a byte vector. torch's client always sends `WAIT` for the
//!   key first (the legacy server drops the connection on a `GET` of a missing key; libuv
//!   answers an empty value), and so does this client.
//! - `COMPARE_SET key expected desired`: sets `desired` where the key holds `expected` (or is
//!   missing and `expected` empty); replies what it holds then (missing: `expected`).
//! - `CHECK count key...`: replies `READY` (0) or `NOT_READY` (1).
//! - Keys: torch's `TCPStore` puts `"/"` before every key on the wire, so Python's
//!   `store.set("a", ..)` sends the key `"/a"`; this client does the same, so both see the same
//!   keys. The libuv server refuses keys over 8 KiB and values over 8 MiB (it closes the
//!   connection); this client refuses them first with an argument error.
//!
//! One connection carries one request at a time (the client holds its socket in a mutex, as
//! torch's holds a lock): a `get` or `wait` that is waiting holds the connection until it
//! returns. Threads that wait concurrently should each [`connect`](TcpStore::connect) their own.
//!
//! Nothing here blocks without a deadline: every read and write on the socket has one, and a
//! server that answers garbage, closes, or stays silent gives an error, not a hang. After a
//! failure in the middle of a request the connection's state is unknown, so the client refuses
//! every later request with an error naming that first failure (connect again to recover).

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// A key-value store shared by the ranks of a job.
pub trait Store: Send + Sync + fmt::Debug {
    /// Sets `key` to `value` (overwrites).
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Returns the value of `key`, waiting up to `timeout` for it to be set.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// Atomically adds `delta` to the integer stored at `key` (missing = 0) and returns the new
    /// value. The integer is stored as decimal text, as torch's stores do.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Waits until every key in `keys` is set, or `timeout` passes.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;
    /// Atomically sets `key` to `desired` where it holds `expected` (or is missing and
    /// `expected` is empty); returns what it holds then, as torch's `compare_set` does (for a
    /// missing key and a non-empty `expected`: `expected`, and nothing is set).
    ///
    /// The store rendezvous needs it. The default, for stores written before it existed, is
    /// [`Error::Unavailable`](crate::Error::Unavailable): such a store cannot host a rendezvous.
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let _ = (expected, desired);
        Err(Error::unavailable(
            format!("store compare_set '{key}'"),
            "this Store does not implement compare_set, which the store rendezvous needs to \
             join an init atomically (torch's stores and dspark's have it)",
        ))
    }
}

/// A store behind a pointer is a store: `Arc<S>`, `Box<S>` and `&S` forward every call.
macro_rules! forward_store {
    ($($ptr:ty),*) => {$(
        impl<S: Store + ?Sized> Store for $ptr {
            fn set(&self, key: &str, value: &[u8]) -> Result<()> {
                (**self).set(key, value)
            }
            fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
                (**self).get(key, timeout)
            }
            fn add(&self, key: &str, delta: i64) -> Result<i64> {
                (**self).add(key, delta)
            }
            fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
                (**self).wait(keys, timeout)
            }
            fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
                (**self).compare_set(key, expected, desired)
            }
        }
    )*};
}
forward_store!(Arc<S>, Box<S>, &S);

fn deadline_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(now)
}

fn quoted(keys: &[&str]) -> String {
    let list: Vec<String> = keys.iter().map(|k| format!("'{k}'")).collect();
    list.join(", ")
}

/// Parses a stored counter the way torch's servers do (`std::stoll` of the decimal text).
fn parse_counter(key: &str, value: &[u8], rank: Option<usize>) -> Result<i64> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .ok_or_else(|| {
            Error::invalid(
                rank,
                format!("store add '{key}'"),
                format!(
                    "the value at the key is not a decimal integer ({} bytes: {:?})",
                    value.len(),
                    String::from_utf8_lossy(&value[..value.len().min(32)])
                ),
            )
        })
}

// ------------------------------------------------------------------------------- MemStore

#[derive(Debug, Default)]
struct MemShared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// An in-process store (a map behind a mutex and a condition variable). Clones are handles to
/// the same store, so threads of one process can rendezvous through it.
#[derive(Debug, Default, Clone)]
pub struct MemStore {
    shared: Arc<MemShared>,
    rank: usize,
}

impl MemStore {
    /// A new, empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// This handle, naming `rank` in the errors it returns (other handles are unchanged).
    pub fn with_rank(mut self, rank: usize) -> Self {
        self.rank = rank;
        self
    }

    fn map(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A thread that panicked while holding the lock cannot have left the map half-written
        // (every update is one insert), so a poisoned lock is still usable.
        self.shared.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `ready(map)` holds or the deadline passes; returns the guard or `Err(())`.
    fn wait_until<'a>(
        &'a self,
        timeout: Duration,
        ready: impl Fn(&HashMap<String, Vec<u8>>) -> bool,
    ) -> std::result::Result<MutexGuard<'a, HashMap<String, Vec<u8>>>, ()> {
        let deadline = deadline_after(timeout);
        let mut map = self.map();
        loop {
            if ready(&map) {
                return Ok(map);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(());
            }
            map = self
                .shared
                .changed
                .wait_timeout(map, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn timeout(&self, op: String, waited: Duration, detail: String) -> Error {
        Error::Timeout {
            rank: self.rank,
            peer: None,
            op,
            waited,
            detail,
        }
    }
}

impl Store for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.map().insert(key.to_string(), value.to_vec());
        self.shared.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let start = Instant::now();
        match self.wait_until(timeout, |m| m.contains_key(key)) {
            Ok(map) => Ok(map.get(key).cloned().unwrap_or_default()),
            Err(()) => Err(self.timeout(
                format!("store get '{key}'"),
                start.elapsed(),
                format!("'{key}' was not set in the in-process store"),
            )),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut map = self.map();
        let old = match map.get(key) {
            Some(v) => parse_counter(key, v, Some(self.rank))?,
            None => 0,
        };
        let new = old.checked_add(delta).ok_or_else(|| {
            Error::invalid(
                Some(self.rank),
                format!("store add '{key}'"),
                format!("{old} + {delta} overflows i64"),
            )
        })?;
        map.insert(key.to_string(), new.to_string().into_bytes());
        drop(map);
        self.shared.changed.notify_all();
        Ok(new)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let mut map = self.map();
        let now = match map.get(key) {
            Some(v) if v != expected => v.clone(),
            None if !expected.is_empty() => expected.to_vec(),
            _ => {
                map.insert(key.to_string(), desired.to_vec());
                desired.to_vec()
            }
        };
        drop(map);
        self.shared.changed.notify_all();
        Ok(now)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let start = Instant::now();
        match self.wait_until(timeout, |m| keys.iter().all(|k| m.contains_key(*k))) {
            Ok(_) => Ok(()),
            Err(()) => {
                let map = self.map();
                let missing: Vec<&str> = keys
                    .iter()
                    .copied()
                    .filter(|k| !map.contains_key(*k))
                    .collect();
                Err(self.timeout(
                    format!("store wait [{}]", quoted(keys)),
                    start.elapsed(),
                    format!("not set in the in-process store: {}", quoted(&missing)),
                ))
            }
        }
    }
}

// ----------------------------------------------------------------------------- PrefixStore

/// Scopes every key of an inner store as `"<prefix>/<key>"`, as torch's `PrefixStore` does,
/// so keys written through one are seen through the other.
#[derive(Debug, Clone)]
pub struct PrefixStore<S> {
    prefix: String,
    inner: S,
}

impl<S: Store> PrefixStore<S> {
    /// Keys of `inner` prefixed with `"<prefix>/"`.
    pub fn new(prefix: impl Into<String>, inner: S) -> Self {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The prefix (without the `/` that joins it to keys).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The inner store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }
}

impl<S: Store> Store for PrefixStore<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key), timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&refs, timeout)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.key(key), expected, desired)
    }
}

// --------------------------------------------------------------------------- wire format

/// torch's c10d TCPStore protocol constants (torch 2.15.0, `store/TCPStoreBackend.hpp`).
mod wire {
    pub(super) const VALIDATE: u8 = 0;
    pub(super) const SET: u8 = 1;
    pub(super) const COMPARE_SET: u8 = 2;
    pub(super) const GET: u8 = 3;
    pub(super) const ADD: u8 = 4;
    pub(super) const CHECK: u8 = 5;
    pub(super) const WAIT: u8 = 6;
    pub(super) const CANCEL_WAIT: u8 = 12;
    pub(super) const PING: u8 = 13;

    /// The `u32` that `VALIDATE` carries.
    pub(super) const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

    /// `WaitResponseType`.
    pub(super) const STOP_WAITING: u8 = 0;
    pub(super) const WAIT_CANCELED: u8 = 1;
    /// `CheckResponseType`.
    pub(super) const READY: u8 = 0;
    pub(super) const NOT_READY: u8 = 1;

    /// What torch's `TCPStore` puts before every key.
    pub(super) const KEY_PREFIX: &str = "/";
    /// The libuv server's limits (`MAX_STRING_LEN`, `MAX_PAYLOAD_LEN`); beyond them it drops
    /// the connection.
    pub(super) const MAX_KEY_LEN: usize = 8 * 1024;
    pub(super) const MAX_VALUE_LEN: usize = 8 * 1024 * 1024;
    /// The most this client accepts as a reply value (the legacy server has no limit of its
    /// own; a garbage length must not make the client allocate without bound).
    pub(super) const MAX_REPLY_LEN: u64 = 1 << 30;
}

/// One request being built.
struct Msg(Vec<u8>);

impl Msg {
    fn new(query: u8) -> Self {
        Msg(vec![query])
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(self, b: &[u8]) -> Self {
        let mut m = self.u64(b.len() as u64);
        m.0.extend_from_slice(b);
        m
    }
    /// A key as torch's `TCPStore` sends it: `"/"` + key.
    fn key(self, key: &str) -> Self {
        let mut m = self.u64((wire::KEY_PREFIX.len() + key.len()) as u64);
        m.0.extend_from_slice(wire::KEY_PREFIX.as_bytes());
        m.0.extend_from_slice(key.as_bytes());
        m
    }
    fn keys(self, keys: &[&str]) -> Self {
        keys.iter()
            .fold(self.u64(keys.len() as u64), |m, k| m.key(k))
    }
}

fn encode_validate() -> Vec<u8> {
    Msg::new(wire::VALIDATE).u32(wire::VALIDATION_MAGIC).0
}
fn encode_ping(nonce: u32) -> Vec<u8> {
    Msg::new(wire::PING).u32(nonce).0
}
fn encode_set(key: &str, value: &[u8]) -> Vec<u8> {
    Msg::new(wire::SET).key(key).bytes(value).0
}
fn encode_compare_set(key: &str, expected: &[u8], desired: &[u8]) -> Vec<u8> {
    Msg::new(wire::COMPARE_SET)
        .key(key)
        .bytes(expected)
        .bytes(desired)
        .0
}
fn encode_get(key: &str) -> Vec<u8> {
    Msg::new(wire::GET).key(key).0
}
fn encode_add(key: &str, delta: i64) -> Vec<u8> {
    Msg::new(wire::ADD).key(key).i64(delta).0
}
fn encode_wait(keys: &[&str]) -> Vec<u8> {
    Msg::new(wire::WAIT).keys(keys).0
}
fn encode_check(keys: &[&str]) -> Vec<u8> {
    Msg::new(wire::CHECK).keys(keys).0
}
fn encode_cancel_wait() -> Vec<u8> {
    vec![wire::CANCEL_WAIT]
}

/// Reads exactly `buf.len()` bytes before `deadline` ([`super::net::read_by`]).
fn read_full(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    super::net::read_by(stream, buf, deadline)
}

fn read_u8(stream: &mut TcpStream, deadline: Instant) -> io::Result<u8> {
    let mut b = [0u8; 1];
    read_full(stream, &mut b, deadline)?;
    Ok(b[0])
}

fn read_u64(stream: &mut TcpStream, deadline: Instant) -> io::Result<u64> {
    let mut b = [0u8; 8];
    read_full(stream, &mut b, deadline)?;
    Ok(u64::from_le_bytes(b))
}

// ------------------------------------------------------------------------------ TcpStore

/// How a request failed, before it is turned into an [`Error`].
enum Fail {
    /// The socket failed or stayed silent mid-request: the connection is unusable.
    Io(io::Error),
    /// The server answered something the protocol does not allow: the connection is unusable.
    Protocol(String),
    /// A wait ran out and was cancelled cleanly: the connection is still good.
    WaitTimedOut,
    /// The connection was abandoned by an earlier failure (given).
    Broken(String),
}

impl From<io::Error> for Fail {
    fn from(e: io::Error) -> Self {
        Fail::Io(e)
    }
}

struct Conn {
    stream: TcpStream,
    /// Why the connection can no longer be used, after a failure mid-request.
    broken: Option<String>,
}

/// The shortest deadline for a reply the server should send at once (a `PING` echo, an `ADD`
/// result, a `WAIT_CANCELED`): generous, because the server may be a loaded rank 0.
const MIN_REPLY_WAIT: Duration = Duration::from_secs(5);
/// The shortest time the handshake gets after the TCP connection is up, even when `connect`'s
/// own timeout is nearly spent.
const MIN_HANDSHAKE_WAIT: Duration = Duration::from_secs(2);
/// How many keys of a timed-out `wait` are checked one by one to name the missing ones.
const MAX_KEYS_NAMED: usize = 16;

/// A client of PyTorch's c10d `TCPStore` (the store torchrun's agent and `init_process_group`
/// serve on `MASTER_ADDR:MASTER_PORT`).
///
/// Keys are the same keys torch's Python `store.set`/`store.get` use (the client adds torch's
/// `"/"` on the wire). See the [module documentation](self) for the protocol.
pub struct TcpStore {
    host: String,
    port: u16,
    rank: Option<usize>,
    reply_timeout: Duration,
    conn: Mutex<Conn>,
}

impl fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpStore")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

fn nonce() -> u32 {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    std::process::id() ^ t ^ COUNTER.fetch_add(0x9E37_79B9, Ordering::Relaxed)
}

/// One attempt to open a TCP connection to any address of `host:port` before `deadline`.
fn connect_once(host: &str, port: u16, deadline: Instant) -> io::Result<TcpStream> {
    // The last try comes at the deadline: its lookup gets `RESOLVE_FLOOR` all the same, or
    // a name's lookup could only run out of time there and hide why the tries failed.
    let left = deadline.saturating_duration_since(Instant::now());
    let addrs = super::net::resolve(host, port, left.max(super::net::RESOLVE_FLOOR))?;
    let mut last = io::Error::new(
        io::ErrorKind::NotFound,
        format!("'{host}' resolves to no address"),
    );
    for addr in addrs {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(10));
        match TcpStream::connect_timeout(&addr, left) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

impl TcpStore {
    /// Connects to the TCPStore server at `host:port`, retrying until `timeout` while the
    /// connection is refused (the server may not be up yet), then performs torch's handshake:
    /// `VALIDATE` with the magic number and a `PING` whose echo must match.
    ///
    /// Errors: [`Error::Io`] naming `host:port` when no connection could be opened in time;
    /// [`Error::Mismatch`] when the server answers the handshake wrongly or closes the
    /// connection (not a torch c10d TCPStore, or one whose protocol predates `PING`);
    /// [`Error::Timeout`] when it accepts the connection but stays silent.
    ///
    /// The handshake gets at least 2 s after the TCP connection is up, even when `timeout` is
    /// nearly spent by then.
    ///
    /// The same `timeout` (at least 5 s) bounds every later reply the server should send at
    /// once (`add`, `set`'s write); `get` and `wait` take their own.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<TcpStore> {
        let start = Instant::now();
        let deadline = deadline_after(timeout);
        let addr = format!("{host}:{port}");
        let mut backoff = Duration::from_millis(10);
        let stream = loop {
            let err = match connect_once(host, port, deadline) {
                Ok(s) => break s,
                Err(e) => e,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::io(
                    None,
                    None,
                    format!(
                        "store connect to the TCPStore at {addr} (retried for {:.1?})",
                        start.elapsed()
                    ),
                    err,
                ));
            }
            std::thread::sleep(backoff.min(deadline - now));
            backoff = (backoff * 2).min(Duration::from_millis(500));
        };
        let store = TcpStore {
            host: host.to_string(),
            port,
            rank: None,
            reply_timeout: timeout.max(MIN_REPLY_WAIT),
            conn: Mutex::new(Conn {
                stream,
                broken: None,
            }),
        };
        let left = deadline.saturating_duration_since(Instant::now());
        store.handshake(deadline_after(left.max(MIN_HANDSHAKE_WAIT)), start)?;
        Ok(store)
    }

    /// This client, naming `rank` in the errors it returns.
    pub fn with_rank(mut self, rank: usize) -> Self {
        self.rank = Some(rank);
        self
    }

    /// The server's host, as given to [`connect`](Self::connect).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether every key in `keys` is set now (torch's `check`); does not wait.
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        let op = format!("store check [{}]", quoted(keys));
        self.check_keys(keys)?;
        self.request(&op, |conn, reply| {
            send(conn, &encode_check(keys), reply)?;
            match read_u8(&mut conn.stream, deadline_after(reply))? {
                wire::READY => Ok(true),
                wire::NOT_READY => Ok(false),
                b => Err(Fail::Protocol(format!(
                    "answered CHECK with byte {b}, expected READY (0) or NOT_READY (1)"
                ))),
            }
        })
        .map_err(|e| self.error(&op, e, Duration::ZERO))
    }

    fn addr(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    fn handshake(&self, deadline: Instant, start: Instant) -> Result<()> {
        let op = format!("store connect to {}", self.addr());
        let nonce = nonce();
        let result = self.request(&op, |conn, reply| {
            send(conn, &encode_validate(), reply)?;
            send(conn, &encode_ping(nonce), reply)?;
            let mut b = [0u8; 4];
            read_full(&mut conn.stream, &mut b, deadline)?;
            let echo = u32::from_le_bytes(b);
            if echo == nonce {
                Ok(())
            } else {
                Err(Fail::Protocol(format!(
                    "answered PING (nonce {nonce:#010x}) with {echo:#010x}"
                )))
            }
        });
        let addr = self.addr();
        let not_torch = "not a torch c10d TCPStore, or one that predates PING in its protocol \
                         (this client was tested with torch 2.15.0)";
        result.map_err(|f| match f {
            Fail::Io(e) if e.kind() == io::ErrorKind::TimedOut => Error::Timeout {
                rank: self.rank.unwrap_or(0),
                peer: None,
                op: op.clone(),
                waited: start.elapsed(),
                detail: format!(
                    "the server at {addr} accepted the connection but did not answer torch's \
                     TCPStore handshake (VALIDATE + PING): not a torch c10d TCPStore?"
                ),
            },
            Fail::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => Error::Mismatch {
                rank: self.rank,
                peer: None,
                op: op.clone(),
                what: format!(
                    "the server at {addr} closed the connection during torch's TCPStore \
                     handshake (VALIDATE + PING): {not_torch}"
                ),
            },
            Fail::Protocol(what) => Error::Mismatch {
                rank: self.rank,
                peer: None,
                op: op.clone(),
                what: format!("the server at {addr} {what}: {not_torch}"),
            },
            Fail::Io(e) => Error::io(
                self.rank,
                None,
                format!("{op} (torch's TCPStore handshake)"),
                e,
            ),
            other => self.error(&op, other, start.elapsed()),
        })
    }

    /// Runs one request on the connection; a failure other than a cleanly cancelled wait
    /// marks the connection unusable.
    fn request<T>(
        &self,
        op: &str,
        f: impl FnOnce(&mut Conn, Duration) -> std::result::Result<T, Fail>,
    ) -> std::result::Result<T, Fail> {
        let mut conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = &conn.broken {
            return Err(Fail::Broken(why.clone()));
        }
        let result = f(&mut conn, self.reply_timeout);
        match &result {
            Ok(_) | Err(Fail::WaitTimedOut) | Err(Fail::Broken(_)) => {}
            Err(Fail::Io(e)) => conn.broken = Some(format!("{op}: {e}")),
            Err(Fail::Protocol(what)) => conn.broken = Some(format!("{op}: {what}")),
        }
        result
    }

    fn error(&self, op: &str, fail: Fail, waited: Duration) -> Error {
        let addr = self.addr();
        match fail {
            Fail::Io(e) if e.kind() == io::ErrorKind::TimedOut => Error::Timeout {
                rank: self.rank.unwrap_or(0),
                peer: None,
                op: op.to_string(),
                waited: self.reply_timeout,
                detail: format!("the TCPStore at {addr} did not answer; connection abandoned"),
            },
            Fail::Io(e) => Error::io(
                self.rank,
                None,
                format!("{op} on the TCPStore at {addr}"),
                e,
            ),
            Fail::Protocol(what) => Error::Mismatch {
                rank: self.rank,
                peer: None,
                op: op.to_string(),
                what: format!("the TCPStore at {addr} {what}"),
            },
            Fail::WaitTimedOut => Error::Timeout {
                rank: self.rank.unwrap_or(0),
                peer: None,
                op: op.to_string(),
                waited,
                detail: format!("not set on the TCPStore at {addr}"),
            },
            Fail::Broken(why) => Error::Transport {
                rank: self.rank,
                peer: None,
                op: op.to_string(),
                what: format!(
                    "the connection to the TCPStore at {addr} was abandoned after an earlier \
                     failure ({why}); connect again"
                ),
            },
        }
    }

    fn check_keys(&self, keys: &[&str]) -> Result<()> {
        for k in keys {
            if wire::KEY_PREFIX.len() + k.len() > wire::MAX_KEY_LEN {
                return Err(Error::invalid(
                    self.rank,
                    "store key",
                    format!(
                        "a key of {} bytes is longer than a TCPStore key may be ({} bytes)",
                        k.len(),
                        wire::MAX_KEY_LEN - wire::KEY_PREFIX.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `WAIT` for `keys` until `timeout`, cancelling it cleanly when it runs out.
    fn wait_on(
        conn: &mut Conn,
        keys: &[&str],
        timeout: Duration,
        reply: Duration,
    ) -> std::result::Result<(), Fail> {
        send(conn, &encode_wait(keys), reply)?;
        match read_u8(&mut conn.stream, deadline_after(timeout)) {
            Ok(wire::STOP_WAITING) => return Ok(()),
            Ok(b) => {
                return Err(Fail::Protocol(format!(
                    "answered WAIT with byte {b}, expected STOP_WAITING (0)"
                )))
            }
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {}
            Err(e) => return Err(Fail::Io(e)),
        }
        send(conn, &encode_cancel_wait(), reply)?;
        let deadline = deadline_after(reply);
        match read_u8(&mut conn.stream, deadline)? {
            wire::WAIT_CANCELED => Err(Fail::WaitTimedOut),
            // The keys were set just before the cancel arrived: the wait succeeded, and the
            // server still acknowledges the cancel.
            wire::STOP_WAITING => match read_u8(&mut conn.stream, deadline)? {
                wire::WAIT_CANCELED => Ok(()),
                b => Err(Fail::Protocol(format!(
                    "answered CANCEL_WAIT with byte {b}, expected WAIT_CANCELED (1)"
                ))),
            },
            b => Err(Fail::Protocol(format!(
                "answered CANCEL_WAIT with byte {b}, expected WAIT_CANCELED (1) or \
                 STOP_WAITING (0)"
            ))),
        }
    }

    /// The keys of `keys` that are not set, best effort (for error messages).
    fn missing(&self, keys: &[&str]) -> Option<Vec<String>> {
        if keys.len() > MAX_KEYS_NAMED {
            return None;
        }
        let mut missing = Vec::new();
        for k in keys {
            if !self.check(&[k]).ok()? {
                missing.push(format!("'{k}'"));
            }
        }
        Some(missing)
    }
}

fn send(conn: &mut Conn, bytes: &[u8], timeout: Duration) -> std::result::Result<(), Fail> {
    conn.stream
        .set_write_timeout(Some(timeout.max(Duration::from_millis(1))))?;
    conn.stream.write_all(bytes)?;
    Ok(())
}

/// A reply's byte vector (`u64` length, then the bytes), read in pieces: a length is only
/// believed as far as bytes arrive.
fn read_value(
    conn: &mut Conn,
    query: &str,
    deadline: Instant,
) -> std::result::Result<Vec<u8>, Fail> {
    let len = read_u64(&mut conn.stream, deadline)?;
    if len > wire::MAX_REPLY_LEN {
        return Err(Fail::Protocol(format!(
            "answered {query} with a value length of {len} bytes (at most {} expected)",
            wire::MAX_REPLY_LEN
        )));
    }
    let mut value = Vec::with_capacity(len.min(1 << 20) as usize);
    let mut chunk = [0u8; 64 * 1024];
    let mut left = len as usize;
    while left > 0 {
        let n = left.min(chunk.len());
        read_full(&mut conn.stream, &mut chunk[..n], deadline)?;
        value.extend_from_slice(&chunk[..n]);
        left -= n;
    }
    Ok(value)
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let op = format!("store set '{key}'");
        self.check_keys(&[key])?;
        if value.len() > wire::MAX_VALUE_LEN {
            return Err(Error::invalid(
                self.rank,
                op,
                format!(
                    "a value of {} bytes is larger than a TCPStore value may be ({} bytes)",
                    value.len(),
                    wire::MAX_VALUE_LEN
                ),
            ));
        }
        self.request(&op, |conn, reply| {
            send(conn, &encode_set(key, value), reply)
        })
        .map_err(|e| self.error(&op, e, Duration::ZERO))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let op = format!("store get '{key}'");
        self.check_keys(&[key])?;
        let start = Instant::now();
        self.request(&op, |conn, reply| {
            Self::wait_on(conn, &[key], timeout, reply)?;
            send(conn, &encode_get(key), reply)?;
            read_value(conn, "GET", deadline_after(reply))
        })
        .map_err(|e| self.error(&op, e, start.elapsed()))
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let op = format!("store compare_set '{key}'");
        self.check_keys(&[key])?;
        if expected.len().max(desired.len()) > wire::MAX_VALUE_LEN {
            return Err(Error::invalid(
                self.rank,
                op,
                "a value larger than a TCPStore value may be",
            ));
        }
        self.request(&op, |conn, reply| {
            send(conn, &encode_compare_set(key, expected, desired), reply)?;
            read_value(conn, "COMPARE_SET", deadline_after(reply))
        })
        .map_err(|e| self.error(&op, e, Duration::ZERO))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let op = format!("store add '{key}'");
        self.check_keys(&[key])?;
        self.request(&op, |conn, reply| {
            send(conn, &encode_add(key, delta), reply)?;
            let mut b = [0u8; 8];
            read_full(&mut conn.stream, &mut b, deadline_after(reply))?;
            Ok(i64::from_le_bytes(b))
        })
        .map_err(|e| match e {
            // torch's servers drop the connection when the value is not an integer.
            Fail::Io(io) if io.kind() == io::ErrorKind::UnexpectedEof => Error::io(
                self.rank,
                None,
                format!(
                    "{op} on the TCPStore at {} (the server closed the connection: is the value \
                     at the key not a decimal integer?)",
                    self.addr()
                ),
                io,
            ),
            other => self.error(&op, other, Duration::ZERO),
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let op = format!("store wait [{}]", quoted(keys));
        self.check_keys(keys)?;
        let start = Instant::now();
        match self.request(&op, |conn, reply| Self::wait_on(conn, keys, timeout, reply)) {
            Ok(()) => Ok(()),
            Err(Fail::WaitTimedOut) => {
                let waited = start.elapsed();
                let detail = match self.missing(keys) {
                    Some(m) => format!(
                        "not set on the TCPStore at {}: {}",
                        self.addr(),
                        m.join(", ")
                    ),
                    None => format!("not all set on the TCPStore at {}", self.addr()),
                };
                Err(Error::Timeout {
                    rank: self.rank.unwrap_or(0),
                    peer: None,
                    op,
                    waited,
                    detail,
                })
            }
            Err(e) => Err(self.error(&op, e, start.elapsed())),
        }
    }
}

#[cfg(test)]
mod tests;
