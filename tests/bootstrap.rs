//! Rendezvous over real TCP (ranks as threads): bad configuration gets a clear error naming
//! the variable or the disagreement, never a hang.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use dspark::{Communicator, Config, Error, ReduceOp};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn cfg(rank: usize, world: usize, port: u16, timeout_ms: u64) -> Config {
    let mut c = Config::new(rank, world, format!("127.0.0.1:{port}"));
    c.timeout = Duration::from_millis(timeout_ms);
    c
}

/// Starts every config on its own thread and returns each init's result.
fn init_all(cfgs: Vec<Config>) -> Vec<dspark::Result<Communicator>> {
    let handles: Vec<_> = cfgs
        .into_iter()
        .map(|c| std::thread::spawn(move || Communicator::init(c)))
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn ranks_meet_and_run_a_collective() {
    let port = free_port();
    let comms = init_all((0..3).map(|r| cfg(r, 3, port, 20_000)).collect());
    let comms: Vec<Communicator> = comms.into_iter().map(|c| c.unwrap()).collect();
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                let mut v = [c.rank() as i64 + 1; 5];
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                assert_eq!(v, [6; 5]);
            });
        }
    });
    assert_eq!(comms[1].info().hosts.len(), 3);
}

#[test]
fn unreachable_root_times_out_naming_the_address() {
    let port = free_port(); // nobody listens there
    let t0 = Instant::now();
    let e = Communicator::init(cfg(1, 2, port, 700)).unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, Error::Timeout { peer: Some(0), .. }), "{s}");
    assert!(
        s.contains(&format!("127.0.0.1:{port}")) && s.contains("DSPARK_ROOT_ADDR"),
        "{s}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn missing_rank_times_out_naming_it() {
    let port = free_port();
    let res = init_all(vec![cfg(0, 3, port, 800), cfg(1, 3, port, 800)]);
    let s = res[0].as_ref().unwrap_err().to_string();
    assert!(s.contains("missing rank(s) 2"), "{s}");
    assert!(res[1].is_err());
}

#[test]
fn rendezvous_port_in_use_is_a_config_error() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let e = Communicator::init(cfg(0, 2, port, 2000)).unwrap_err();
    let s = e.to_string();
    assert!(
        matches!(e, Error::Config { .. }) && s.contains("in use"),
        "{s}"
    );
}

#[test]
fn the_same_rank_twice_fails_everybody_with_both_named() {
    let port = free_port();
    let res = init_all(vec![
        cfg(0, 3, port, 3000),
        cfg(1, 3, port, 3000),
        cfg(1, 3, port, 3000),
    ]);
    let s = res[0].as_ref().unwrap_err().to_string();
    assert!(
        s.contains("rank 1 joined twice") && s.contains("DSPARK_RANK"),
        "{s}"
    );
    for r in &res[1..] {
        let e = r.as_ref().unwrap_err();
        assert!(e.to_string().contains("joined twice"), "{e}");
    }
}

#[test]
fn another_world_size_is_a_mismatch_on_both_sides() {
    let port = free_port();
    let res = init_all(vec![cfg(0, 2, port, 3000), cfg(1, 3, port, 3000)]);
    for r in &res {
        let e = r.as_ref().unwrap_err();
        assert!(
            matches!(e, Error::Mismatch { .. }) && e.to_string().contains("world size"),
            "{e}"
        );
    }
}

#[test]
fn a_rank_with_another_job_token_is_refused() {
    let port = free_port();
    let mut a = cfg(0, 2, port, 1500);
    a.job_token = Some("alpha".into());
    let mut b = cfg(1, 2, port, 1500);
    b.job_token = Some("beta".into());
    let res = init_all(vec![a, b]);
    let refused = res[1].as_ref().unwrap_err();
    assert!(matches!(refused, Error::Mismatch { .. }), "{refused}");
    assert!(refused.to_string().contains("job"), "{refused}");
    // Rank 0 keeps waiting for the right rank 1 and then says whom it refused.
    let root = res[0].as_ref().unwrap_err().to_string();
    assert!(root.contains("refused") && root.contains("job"), "{root}");
}

#[test]
fn different_segment_sizes_are_refused_at_init() {
    let port = free_port();
    let a = cfg(0, 2, port, 3000);
    let mut b = cfg(1, 2, port, 3000);
    b.segment_bytes = 64 * 1024;
    let res = init_all(vec![a, b]);
    for r in &res {
        let e = r.as_ref().unwrap_err();
        assert!(e.to_string().contains("DSPARK_CHUNK_BYTES"), "{e}");
    }
}

#[test]
fn bad_local_settings_fail_before_any_network_activity() {
    let e = Communicator::init(cfg(3, 3, 1, 1000)).unwrap_err();
    assert!(
        matches!(e, Error::Config { .. }) && e.to_string().contains("rank 3"),
        "{e}"
    );
    let e = Communicator::init(cfg(0, 0, 1, 1000)).unwrap_err();
    assert!(e.to_string().contains("world size is 0"), "{e}");
    let mut c = cfg(0, 2, 1, 1000);
    c.root_addr = "no-port-here".into();
    let e = Communicator::init(c).unwrap_err();
    assert!(e.to_string().contains("DSPARK_ROOT_ADDR"), "{e}");
    let mut c = cfg(1, 2, free_port(), 1000);
    c.socket_ifname = Some("nosuchif0".into());
    let e = Communicator::init(c).unwrap_err();
    assert!(
        e.to_string().contains("DSPARK_SOCKET_IFNAME") && e.to_string().contains("nosuchif0"),
        "{e}"
    );
}

#[test]
fn a_stray_connection_to_the_root_does_not_break_the_rendezvous() {
    let port = free_port();
    let h = std::thread::spawn(move || Communicator::init(cfg(0, 2, port, 10_000)));
    // Something that is not a dspark rank connects and sends garbage.
    let t0 = Instant::now();
    let mut s = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(_) if t0.elapsed() < Duration::from_secs(5) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("{e}"),
        }
    };
    use std::io::Write;
    s.write_all(&[0, 0, 0, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9])
        .unwrap();
    drop(s);
    let leaf = Communicator::init(cfg(1, 2, port, 10_000)).unwrap();
    let root = h.join().unwrap().unwrap();
    std::thread::scope(|sc| {
        sc.spawn(|| root.barrier().unwrap());
        sc.spawn(|| leaf.barrier().unwrap());
    });
}

/// A stray connection that announces a huge hello and sends nothing more is dropped at
/// once: rank 0 allocates nothing for an unvalidated connection beyond a hello's size (it
/// used to allocate up to 64 MiB and then wait the hello's 5 s for the bytes; issue #11,
/// item 9).
#[test]
fn a_stray_connection_announcing_a_huge_hello_is_dropped_at_once() {
    use std::io::{Read, Write};
    let port = free_port();
    let h = std::thread::spawn(move || Communicator::init(cfg(0, 2, port, 20_000)));
    let t0 = Instant::now();
    let mut s = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(_) if t0.elapsed() < Duration::from_secs(5) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("{e}"),
        }
    };
    s.write_all(&(60u32 << 20).to_le_bytes()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let asked = Instant::now();
    let mut b = [0u8; 1];
    // EOF (or a reset): rank 0 closed it without waiting for 60 MiB.
    let _ = s.read(&mut b);
    let took = asked.elapsed();
    assert!(
        took < Duration::from_millis(2500),
        "rank 0 held a connection that announced 60 MiB for {took:?} (the hello wait is 5 s)"
    );
    let leaf = Communicator::init(cfg(1, 2, port, 20_000)).unwrap();
    let root = h.join().unwrap().unwrap();
    std::thread::scope(|sc| {
        sc.spawn(|| root.barrier().unwrap());
        sc.spawn(|| leaf.barrier().unwrap());
    });
}

#[test]
fn a_silent_stray_connection_does_not_hold_the_rendezvous_for_the_whole_deadline() {
    let port = free_port();
    let t0 = Instant::now();
    let h = std::thread::spawn(move || Communicator::init(cfg(0, 2, port, 60_000)));
    // Connects first and never says anything (a port scanner, a wedged leftover).
    let silent = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(_) if t0.elapsed() < Duration::from_secs(5) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("{e}"),
        }
    };
    std::thread::sleep(Duration::from_millis(100));
    let leaf = Communicator::init(cfg(1, 2, port, 60_000)).unwrap();
    let root = h.join().unwrap().unwrap();
    // Rank 0 gave the silent connection a few seconds, not the 60 s deadline.
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    drop(silent);
    std::thread::scope(|sc| {
        sc.spawn(|| root.barrier().unwrap());
        sc.spawn(|| leaf.barrier().unwrap());
    });
}
