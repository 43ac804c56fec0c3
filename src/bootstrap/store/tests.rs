//! Tests of the stores: the in-process store, the prefix, and the TCPStore client against
//! fake servers.
use super::*;
use std::io::Read;
use std::net::TcpListener;
use std::thread;

const T: Duration = Duration::from_secs(10);

#[test]
fn mem_store_get_waits_for_a_key_set_later() {
    let store = MemStore::new();
    let other = store.clone();
    let setter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(150));
        other.set("k", b"v").unwrap();
    });
    let start = Instant::now();
    assert_eq!(store.get("k", T).unwrap(), b"v");
    assert!(start.elapsed() >= Duration::from_millis(100));
    setter.join().unwrap();
}

#[test]
fn mem_store_get_of_a_missing_key_times_out_naming_the_key_and_rank() {
    let store = MemStore::new().with_rank(3);
    let start = Instant::now();
    let e = store.get("nope", Duration::from_millis(200)).unwrap_err();
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_secs(5),
        "{took:?}"
    );
    match &e {
        Error::Timeout { rank: 3, op, .. } => assert!(op.contains("'nope'"), "{e}"),
        _ => panic!("expected a timeout, got {e}"),
    }
}

#[test]
fn mem_store_add_is_atomic_across_threads_and_stored_as_text() {
    let store = MemStore::new();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let s = store.clone();
            thread::spawn(move || (0..250).map(|_| s.add("n", 1).unwrap()).collect::<Vec<_>>())
        })
        .collect();
    let mut all: Vec<i64> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    all.sort_unstable();
    assert_eq!(all, (1..=1000).collect::<Vec<i64>>());
    assert_eq!(store.get("n", T).unwrap(), b"1000");
    assert_eq!(store.add("n", -1000).unwrap(), 0);
    store.set("text", b"abc").unwrap();
    assert!(matches!(
        store.add("text", 1),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn mem_store_wait_names_only_the_missing_keys() {
    let store = MemStore::new();
    store.set("a", b"").unwrap();
    store.wait(&["a"], Duration::ZERO).unwrap();
    let e = store
        .wait(&["a", "b"], Duration::from_millis(50))
        .unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, Error::Timeout { .. }), "{s}");
    assert!(s.contains("not set in the in-process store: 'b'"), "{s}");
}

#[test]
fn prefix_store_joins_prefix_and_key_with_a_slash_like_torch() {
    let mem = MemStore::new();
    let p = PrefixStore::new("default_pg/0", mem.clone());
    p.set("addr", b"x").unwrap();
    assert_eq!(mem.get("default_pg/0/addr", T).unwrap(), b"x");
    assert_eq!(p.add("n", 2).unwrap(), 2);
    assert_eq!(mem.get("default_pg/0/n", T).unwrap(), b"2");
    p.wait(&["addr", "n"], T).unwrap();
    let nested = PrefixStore::new("outer", PrefixStore::new("inner", &mem));
    nested.set("k", b"1").unwrap();
    assert_eq!(mem.get("inner/outer/k", T).unwrap(), b"1");
    let shared: Arc<dyn Store> = Arc::new(mem);
    assert_eq!(shared.get("default_pg/0/addr", T).unwrap(), b"x");
}

#[test]
fn encoders_write_torch_tcpstore_requests_byte_for_byte() {
    assert_eq!(encode_validate(), [0, 0xCE, 0xF7, 0x85, 0x3C]);
    assert_eq!(encode_ping(0x0102_0304), [13, 4, 3, 2, 1]);
    let mut set = vec![1, 2, 0, 0, 0, 0, 0, 0, 0, b'/', b'k'];
    set.extend([3, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, b'x']);
    assert_eq!(encode_set("k", &[0, 0xff, b'x']), set);
    assert_eq!(
        encode_set("", b""),
        [1, 1, 0, 0, 0, 0, 0, 0, 0, b'/', 0, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(
        encode_get("ab"),
        [3, 3, 0, 0, 0, 0, 0, 0, 0, b'/', b'a', b'b']
    );
    let mut add = vec![4, 2, 0, 0, 0, 0, 0, 0, 0, b'/', b'n'];
    add.extend((-2i64).to_le_bytes());
    assert_eq!(encode_add("n", -2), add);
    let wait = [
        6, 2, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, b'/', b'a',
    ];
    let mut wait2 = wait.to_vec();
    wait2.extend([2, 0, 0, 0, 0, 0, 0, 0, b'/', b'b']);
    assert_eq!(encode_wait(&["a", "b"]), wait2);
    let mut check = wait2.clone();
    check[0] = 5;
    assert_eq!(encode_check(&["a", "b"]), check);
    assert_eq!(encode_cancel_wait(), [12]);
}

/// A scripted server: checks each request's bytes and sends the scripted replies.
fn scripted(script: Vec<(Vec<u8>, Vec<u8>)>) -> (u16, thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let h = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        // The handshake: VALIDATE, then PING whose nonce is echoed.
        let mut v = [0u8; 5];
        s.read_exact(&mut v).unwrap();
        assert_eq!(v.to_vec(), encode_validate());
        let mut p = [0u8; 5];
        s.read_exact(&mut p).unwrap();
        assert_eq!(p[0], wire::PING);
        s.write_all(&p[1..]).unwrap();
        for (expect, reply) in script {
            let mut got = vec![0u8; expect.len()];
            s.read_exact(&mut got).unwrap();
            assert_eq!(got, expect);
            s.write_all(&reply).unwrap();
        }
        // Hold the connection until the client closes it.
        let _ = s.read(&mut [0u8; 1]);
    });
    (port, h)
}

#[test]
fn tcp_store_treats_keys_set_just_before_a_cancel_as_a_successful_wait() {
    let (port, server) = scripted(vec![
        (encode_wait(&["a"]), vec![]),
        // The cancel crosses the server's STOP_WAITING.
        (
            encode_cancel_wait(),
            vec![wire::STOP_WAITING, wire::WAIT_CANCELED],
        ),
        (encode_wait(&["b"]), vec![]),
        (encode_cancel_wait(), vec![wire::WAIT_CANCELED]),
        (encode_check(&["b"]), vec![wire::NOT_READY]),
        (encode_add("n", 7), 7i64.to_le_bytes().to_vec()),
    ]);
    let store = TcpStore::connect("127.0.0.1", port, T)
        .unwrap()
        .with_rank(5);
    store.wait(&["a"], Duration::from_millis(100)).unwrap();
    let e = store.wait(&["b"], Duration::from_millis(100)).unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, Error::Timeout { rank: 5, .. }), "{s}");
    assert!(s.contains("'b'"), "{s}");
    // The connection is still in step after a cancelled wait.
    assert_eq!(store.add("n", 7).unwrap(), 7);
    drop(store);
    server.join().unwrap();
}

#[test]
fn tcp_store_refuses_further_requests_after_a_garbled_reply() {
    let (port, server) = scripted(vec![(encode_wait(&["k"]), vec![9])]);
    let store = TcpStore::connect("127.0.0.1", port, T).unwrap();
    let e = store.get("k", T).unwrap_err();
    assert!(matches!(e, Error::Mismatch { .. }), "{e}");
    let e = store.add("n", 1).unwrap_err();
    assert!(matches!(e, Error::Transport { .. }), "{e}");
    assert!(e.to_string().contains("earlier failure"), "{e}");
    drop(store);
    server.join().unwrap();
}

#[test]
fn tcp_store_refuses_keys_and_values_the_server_would_drop_the_connection_for() {
    let (port, server) = scripted(vec![]);
    let store = TcpStore::connect("127.0.0.1", port, T).unwrap();
    let long = "k".repeat(wire::MAX_KEY_LEN);
    assert!(matches!(
        store.set(&long, b""),
        Err(Error::InvalidArgument { .. })
    ));
    let big = vec![0u8; wire::MAX_VALUE_LEN + 1];
    assert!(matches!(
        store.set("k", &big),
        Err(Error::InvalidArgument { .. })
    ));
    drop(store);
    server.join().unwrap();
}

/// A store that is not up, reached by name: the error is the refusal, never a resolver with
/// no time left (the last try used to come at the deadline, where a name's lookup could
/// only time out and hide it).
#[test]
fn a_store_that_is_not_up_reached_by_name_says_it_refused() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    for _ in 0..3 {
        let e = TcpStore::connect("localhost", port, Duration::from_millis(700))
            .expect_err("nothing listens there");
        let text = e.to_string();
        assert!(text.contains("refused"), "{text}");
        assert!(!text.contains("resolver"), "{text}");
    }
}
