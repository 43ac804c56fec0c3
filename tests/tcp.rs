//! Multi-process tests over real TCP: this test binary re-executes itself as N rank
//! processes (`rank_process` is the entry point of a rank; it does nothing in a normal test
//! run). Covers every collective, type and operator on worlds 1..=5, the double binary tree
//! (`DSPARK_ALGO=tree`) and Rabenseifner's allreduce (`DSPARK_ALGO=rabenseifner`) on worlds
//! 3, 5, 7 and 8, large messages, a killed rank, a stopped (SIGSTOP) rank, mismatched calls,
//! and two ranks in separate network namespaces joined by a veth pair (root only; skipped
//! with a reason elsewhere).

mod common;

use std::time::Duration;

use common::procs::{assert_all, free_port, rank_entry, say, sh, spawn, status_kb, vars, OK};
use dspark::{Communicator, ReduceOp};

/// Entry point of a rank process. In a normal test run (no scenario set) it returns at once.
#[test]
fn rank_process() {
    rank_entry(run_scenario);
}

fn run_scenario(s: &str) -> Result<i32, String> {
    let t0 = std::time::Instant::now();
    let before = status_kb("VmRSS");
    let comm = Communicator::from_env().map_err(|e| format!("init: {e}"))?;
    if s == "scale" {
        let init = t0.elapsed();
        say(&format!(
            "SCALE init_ms {:.1} rss_before_kb {}",
            init.as_secs_f64() * 1e3,
            before
        ));
    }
    let r = comm.rank();
    match s {
        "matrix" => {
            common::run_matrix(&comm, &[0, 1, 2, 3, 7, 13, 100, 1023], 0x5eed)?;
            Ok(OK)
        }
        "forced" => {
            // Run with DSPARK_ALGO=tree (the double binary tree all_reduce, and the binomial
            // tree for reduce and broadcast) or DSPARK_ALGO=rabenseifner (all_reduce only),
            // checked to be forced, not silently replaced.
            let mut want = std::env::var("DSPARK_ALGO").unwrap_or_default();
            // A forced one_shot without shared slots runs as frames with 2 ranks, and as
            // recursive doubling with 3 or more (whose frames would add in each rank's own
            // order).
            if want == "one_shot" && comm.world_size() > 2 {
                want = "recursive_doubling".into();
            }
            let forced = comm.algorithm(dspark::internals::plan::Collective::AllReduce, 1 << 20);
            if forced.name() != want {
                return Err(format!("all_reduce runs {forced}, not {want}"));
            }
            common::run_tree_matrix(&comm, &[0, 1, 2, 5, 8, 13, 100, 1023], 0x7ee)?;
            Ok(OK)
        }
        "large" => {
            // 12 MiB of f32: several segments per block, direct placement and partial reads.
            let n = 3 * 1024 * 1024 + 17;
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let mut buf = common::inputs::<f32>(op, 9, r, n);
                comm.all_reduce(&mut buf, op).map_err(|e| e.to_string())?;
                common::check(
                    "large all_reduce",
                    &buf,
                    &common::reduced::<f32>(op, 9, comm.world_size(), n),
                )?;
            }
            let mut b = if r == 1 {
                common::inputs::<u8>(ReduceOp::Sum, 4, 1, n)
            } else {
                vec![0u8; n]
            };
            comm.broadcast(&mut b, 1).map_err(|e| e.to_string())?;
            common::check(
                "large broadcast",
                &b,
                &common::inputs::<u8>(ReduceOp::Sum, 4, 1, n),
            )?;
            let mine = common::inputs::<i32>(ReduceOp::Sum, 5, r, n / 4);
            let mut all = vec![0i32; n / 4 * comm.world_size()];
            comm.all_gather(&mine, &mut all)
                .map_err(|e| e.to_string())?;
            let want: Vec<i32> = (0..comm.world_size())
                .flat_map(|q| common::inputs::<i32>(ReduceOp::Sum, 5, q, n / 4))
                .collect();
            common::check("large all_gather", &all, &want)?;
            Ok(OK)
        }
        "lazy" => {
            // Only the schedules' partners are connected at init; the other pairs connect on
            // first use, from either end, also when both ends start at once.
            let n = comm.world_size();
            let partners = dspark::internals::plan::algo::standing_partners(n, r);
            let at_init = comm.info().connected_at_init;
            if at_init != Some(partners.len()) || partners.len() + 1 >= n {
                return Err(format!(
                    "connected to {at_init:?} peers at init, want {} of {}",
                    partners.len(),
                    n - 1
                ));
            }
            // Send/recv to every other rank, all-to-all over every pair, then the
            // collectives over the standing links.
            common::exchange_beyond_partners(&comm, &partners)?;
            common::run_matrix(&comm, &[0, 1, 7, 100], 0x1a27)?;
            comm.barrier().map_err(|e| e.to_string())?;
            Ok(OK)
        }
        "late_peer" => {
            // The last rank comes to an all_to_all (every pair, most connected on first use)
            // after the bootstrap's hello wait (5 s): the others, whose dials its door does
            // not answer until then, wait for it within their deadline (60 s) instead of
            // failing after 5 s; the exchange is exact.
            if r == comm.world_size() - 1 {
                std::thread::sleep(Duration::from_secs(7));
            }
            common::all_to_all_exact(&comm)?;
            Ok(OK)
        }
        "scale" => scale_rank(comm),
        "loop" => common::procs::loop_until_failure(&comm),
        "watch" => common::procs::watch_while_another_dies(&comm),
        "mismatch" => common::procs::mismatched_count(&comm),
        other => Err(format!("unknown scenario {other}")),
    }
}

#[test]
fn every_collective_type_and_op_is_exact_across_processes_on_worlds_1_to_5() {
    for world in 1..=5 {
        let outs = spawn(
            world,
            "matrix",
            &|_| vars(&[("DSPARK_CHUNK_BYTES", "4096"), ("DSPARK_TIMEOUT", "60")]),
            None,
        )
        .wait(Duration::from_secs(240));
        assert_all(&outs, OK, &format!("world {world}"));
    }
}

/// #10: `DSPARK_ALGO=tree` (the double binary tree) on worlds 3, 5, 7 and 8, every type and
/// operator; 1 KiB segments, so that the halves of the larger counts take several segments and
/// the pipeline (down while still up) runs across processes.
#[test]
fn double_binary_tree_all_reduce_is_exact_across_processes_on_worlds_3_5_7_and_8() {
    forced_all_reduce_is_exact_across_processes("tree", &[3, 5, 7, 8]);
}

/// #10: `DSPARK_ALGO=rabenseifner` on worlds 3, 5, 7 (folded) and 8 (a power of two), every
/// type and operator, 1 KiB segments (the halving's first halves take several).
#[test]
fn rabenseifner_all_reduce_is_exact_across_processes_on_worlds_3_5_7_and_8() {
    forced_all_reduce_is_exact_across_processes("rabenseifner", &[3, 5, 7, 8]);
}

/// `DSPARK_ALGO=one_shot` over TCP, which has no shared slots: the frame schedule (the
/// buffer to the peer) on world 2, recursive doubling on worlds 3 and 5 (what it runs as
/// there), every type and operator.
#[test]
fn a_forced_one_shot_all_reduce_is_exact_across_processes_on_worlds_2_3_and_5() {
    forced_all_reduce_is_exact_across_processes("one_shot", &[2, 3, 5]);
}

fn forced_all_reduce_is_exact_across_processes(algo: &str, worlds: &[usize]) {
    for &world in worlds {
        let outs = spawn(
            world,
            "forced",
            &|_| {
                vars(&[
                    ("DSPARK_ALGO", algo),
                    ("DSPARK_CHUNK_BYTES", "1024"),
                    ("DSPARK_TIMEOUT", "60"),
                ])
            },
            None,
        )
        .wait(Duration::from_secs(240));
        assert_all(&outs, OK, &format!("{algo}, world {world}"));
    }
}

/// #10: TCP connects only the pairs the collectives' schedules use at init
/// (`plan::algo::standing_partners`); send/recv and all-to-all partners connect on first use.
/// 13 ranks: 4 of each rank's 12 peers are not standing partners.
#[test]
fn pairs_outside_the_schedules_connect_on_first_use() {
    let outs = spawn(
        13,
        "lazy",
        &|_| vars(&[("DSPARK_CHUNK_BYTES", "4096"), ("DSPARK_TIMEOUT", "90")]),
        None,
    )
    .wait(Duration::from_secs(240));
    assert_all(&outs, OK, "world 13");
}

/// A rank late to a collective that connects on first use by more than the bootstrap's
/// hello wait is waited for, not called lost: 6 ranks' all_to_all, the last rank 7 s late.
/// Every other rank failed after 5 s ("waiting for rank 5's challenge"), naming a rank that
/// was alive.
#[test]
fn a_rank_late_by_more_than_the_hello_wait_is_waited_for_not_lost() {
    let outs = spawn(6, "late_peer", &|_| tcp_vars("60"), None).wait(Duration::from_secs(90));
    assert_all(&outs, OK, "a late rank");
}

/// Sockets this process holds.
fn sockets() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
                })
                .count()
        })
        .unwrap_or(0)
}

/// One rank of the scale test: one all_reduce checked against its closed form, a barrier,
/// and what the rank holds afterwards.
fn scale_rank(comm: Communicator) -> Result<i32, String> {
    let (r, n) = (comm.rank(), comm.world_size());
    common::all_reduce_closed_form(&comm)?;
    comm.barrier().map_err(|e| format!("barrier: {e}"))?;
    let partners = dspark::internals::plan::algo::standing_partners(n, r).len();
    let info = comm.info();
    let memory_reason = info
        .transport_reason
        .as_deref()
        .is_some_and(|w| w.contains("available memory"));
    // Shared memory: what this rank's segment committed at init, from the description.
    let committed = info
        .transport_detail
        .find(" KiB committed at init")
        .and_then(|i| info.transport_detail[..i].split_whitespace().next_back())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    say(&format!(
        "SCALE rank {r} transport {} memory_reason {} connected {} partners {partners} \
         sockets {} rss_kb {} hwm_kb {} shm_committed_kb {committed} shmem_kb {}",
        info.transport,
        u8::from(memory_reason),
        info.connected_at_init.unwrap_or(n - 1),
        sockets(),
        status_kb("VmRSS"),
        status_kb("VmHWM"),
        status_kb("RssShmem"),
    ));
    Ok(OK)
}

/// #10: 128 ranks on this machine: the rendezvous, one all_reduce and a barrier, with every
/// rank's init time, memory and sockets printed. Each rank connects to its schedules'
/// partners only (at most 2⌈log2 n⌉ + 6, here 20), so sockets per rank stay O(log n).
#[test]
fn a_world_of_128_ranks_meets_reduces_and_synchronises_with_log_n_connections_per_rank() {
    let n = 128;
    let t0 = std::time::Instant::now();
    let outs = spawn(n, "scale", &|_| vars(&[("DSPARK_TIMEOUT", "300")]), None)
        .wait(Duration::from_secs(420));
    let wall = t0.elapsed();
    assert_all(&outs, OK, "128 ranks");
    let field = |out: &str, key: &str| -> f64 {
        out.lines()
            .filter_map(|l| l.find("SCALE ").map(|i| &l[i..]))
            .flat_map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                w.windows(2)
                    .filter(|p| p[0] == key)
                    .map(|p| p[1].parse::<f64>().unwrap_or(f64::NAN))
                    .collect::<Vec<_>>()
            })
            .next()
            .unwrap_or(f64::NAN)
    };
    let col = |key: &str| -> Vec<f64> {
        let mut v: Vec<f64> = outs.iter().map(|o| field(&o.out, key)).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let med = |v: &[f64]| v[v.len() / 2];
    let (init, conn, sock, rss, before, hwm) = (
        col("init_ms"),
        col("connected"),
        col("sockets"),
        col("rss_kb"),
        col("rss_before_kb"),
        col("hwm_kb"),
    );
    println!(
        "128 ranks over TCP on this machine, all done in {:.1} s: init median {:.0} ms, \
         slowest {:.0} ms; data connections per rank median {}, most {} (limit 2*7+6 = 20; a \
         full mesh is 127); sockets per rank after the barrier median {}, most {}; memory per \
         rank (VmRSS) {:.1} MiB median after the barrier, {:.1} MiB before init, peak (VmHWM) \
         median {:.1} MiB",
        wall.as_secs_f64(),
        med(&init),
        init[n - 1],
        med(&conn),
        conn[n - 1],
        med(&sock),
        sock[n - 1],
        med(&rss) / 1024.0,
        med(&before) / 1024.0,
        med(&hwm) / 1024.0,
    );
    for (r, o) in outs.iter().enumerate() {
        let c = field(&o.out, "connected");
        let p = field(&o.out, "partners");
        let s = field(&o.out, "sockets");
        assert!(
            c == p && c <= 20.0,
            "rank {r}: {c} connections at init, {p} standing partners"
        );
        // The data connections and the listener; nothing left of the rendezvous.
        assert!(
            s <= c + 2.0,
            "rank {r} holds {s} sockets with {c} data connections:\n{}",
            o.out
        );
    }
}

/// 128 ranks on one host with the transport left to dspark. Shared memory commits at init
/// only the rings from each rank's standing partners (at most 20 of 2 MiB: about 40 MiB per
/// rank, 5 GiB at most in all, where a ring per ordered pair would be 128 × 127 rings, 32
/// GiB) and connects only them; where even that is more than half of the available memory
/// every rank says why and the job runs over TCP instead of running the host out of memory.
#[test]
fn a_world_of_128_ranks_left_to_choose_does_not_map_more_shared_memory_than_the_host_has() {
    let n = 128;
    let t0 = std::time::Instant::now();
    let outs = spawn(
        n,
        "scale",
        &|_| vars(&[("DSPARK_TIMEOUT", "300"), ("DSPARK_TRANSPORT", "auto")]),
        None,
    )
    .wait(Duration::from_secs(420));
    let wall = t0.elapsed();
    assert_all(&outs, OK, "128 ranks, transport auto");
    // A ring's place in a segment: 256 bytes of counters and 2 MiB of data, in whole pages.
    let ring_kib = 2048 + 4;
    let mut shm = 0;
    let (mut committed, mut shmem) = (Vec::new(), Vec::new());
    for (r, o) in outs.iter().enumerate() {
        let line = o
            .out
            .lines()
            .find(|l| l.contains("SCALE rank"))
            .unwrap_or_default();
        assert!(
            line.contains("transport shm ")
                || (line.contains("transport tcp ") && line.contains("memory_reason 1")),
            "rank {r}: {line}"
        );
        if !line.contains("transport shm ") {
            continue;
        }
        shm += 1;
        let w: Vec<&str> = line.split_whitespace().collect();
        let field = |key: &str| -> u64 {
            w.windows(2)
                .find(|p| p[0] == key)
                .and_then(|p| p[1].parse().ok())
                .unwrap_or(u64::MAX)
        };
        let (c, p) = (field("connected"), field("partners"));
        assert!(
            c == p && c <= 20,
            "rank {r}: {c} connected at init, {p} partners"
        );
        let k = field("shm_committed_kb");
        // The header page and the two one-shot slots of two pages each (20 KiB), and the
        // partners' rings.
        assert_eq!(k, 20 + ring_kib * p, "rank {r}: committed at init: {line}");
        committed.push(k);
        shmem.push(field("shmem_kb"));
    }
    committed.sort_unstable();
    shmem.sort_unstable();
    if shm > 0 {
        println!(
            "128 ranks over shared memory, done in {:.1} s: committed at init per rank median \
             {:.1} MiB, most {:.1} MiB ({:.2} GiB in all; a ring per ordered pair would be \
             {:.1} MiB per rank); RssShmem per rank after an all_reduce and a barrier median \
             {:.1} MiB",
            wall.as_secs_f64(),
            committed[shm / 2] as f64 / 1024.0,
            committed[shm - 1] as f64 / 1024.0,
            committed.iter().sum::<u64>() as f64 / (1024.0 * 1024.0),
            (20 + ring_kib * 127) as f64 / 1024.0,
            shmem[shm / 2] as f64 / 1024.0,
        );
    } else {
        println!("128 ranks fell back to TCP (not enough available memory for shared memory)");
    }
}

#[test]
fn large_messages_are_exact_across_processes() {
    for world in [2, 3] {
        let outs = spawn(world, "large", &|_| vars(&[("DSPARK_TIMEOUT", "60")]), None)
            .wait(Duration::from_secs(120));
        assert_all(&outs, OK, &format!("large, world {world}"));
    }
}

/// The variables of a rank with deadline `timeout` (`spawn` sets `DSPARK_TRANSPORT=tcp`).
fn tcp_vars(timeout: &str) -> Vec<(String, String)> {
    vars(&[("DSPARK_TIMEOUT", timeout)])
}

#[test]
fn killed_rank_makes_every_survivor_fail_within_the_deadline() {
    common::procs::killed_rank_fails_every_survivor_within_the_deadline(&tcp_vars);
}

#[test]
fn stopped_rank_makes_every_survivor_time_out_within_the_deadline() {
    common::procs::stopped_rank_times_out_every_survivor_within_the_deadline(&tcp_vars);
}

#[test]
fn mismatched_counts_fail_every_process_with_mismatch() {
    common::procs::mismatched_counts_fail_every_process(&tcp_vars);
}

struct Netns(Vec<String>);

impl Drop for Netns {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = sh(&["ip", "netns", "del", ns]);
        }
    }
}

#[test]
fn two_ranks_in_separate_network_namespaces_joined_by_veth() {
    let tag = std::process::id() % 100_000;
    let (a, b) = (format!("dspk{tag}a"), format!("dspk{tag}b"));
    let setup = || -> Result<Netns, String> {
        let mut guard = Netns(Vec::new());
        sh(&["ip", "netns", "add", &a])?;
        guard.0.push(a.clone());
        sh(&["ip", "netns", "add", &b])?;
        guard.0.push(b.clone());
        let (va, vb) = (format!("va{tag}"), format!("vb{tag}"));
        sh(&[
            "ip", "link", "add", &va, "netns", &a, "type", "veth", "peer", "name", &vb, "netns", &b,
        ])?;
        sh(&["ip", "-n", &a, "addr", "add", "10.231.0.1/24", "dev", &va])?;
        sh(&["ip", "-n", &b, "addr", "add", "10.231.0.2/24", "dev", &vb])?;
        for (ns, dev) in [(&a, &va), (&b, &vb)] {
            sh(&["ip", "-n", ns, "link", "set", dev, "up"])?;
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
        }
        // Some latency on the wire, where netem exists.
        if let Err(e) = sh(&[
            "ip", "netns", "exec", &a, "tc", "qdisc", "add", "dev", &va, "root", "netem", "delay",
            "1ms",
        ]) {
            eprintln!("note: no netem delay ({e}); running without added latency");
        }
        Ok(guard)
    };
    // Skipped only where namespaces cannot be made at all (not root, no `ip`); as root, a
    // set-up failure is a failure.
    if let Some(why) = common::procs::netns_unavailable(&["ip"]) {
        eprintln!("SKIPPED two_ranks_in_separate_network_namespaces_joined_by_veth: {why}; run as root on Linux with iproute2");
        return;
    }
    let _guard = setup().unwrap_or_else(|e| panic!("creating network namespaces as root: {e}"));
    // Rank 0 listens on its veth address: every byte crosses the virtual wire.
    let root = format!("10.231.0.1:{}", free_port());
    let env = move |_| {
        vars(&[
            ("DSPARK_ROOT_ADDR", root.as_str()),
            ("DSPARK_TIMEOUT", "60"),
            ("DSPARK_CHUNK_BYTES", "4096"),
        ])
    };
    let namespaces = [a.clone(), b.clone()];
    let wrap = move |r: usize| {
        vec![
            "ip".to_string(),
            "netns".into(),
            "exec".into(),
            namespaces[r].clone(),
        ]
    };
    let outs = spawn(2, "matrix", &env, Some(&wrap)).wait(Duration::from_secs(240));
    assert_all(&outs, OK, "network namespaces");
}

#[test]
fn a_peer_dying_while_this_rank_waits_on_another_is_noticed_at_once() {
    common::procs::a_peer_dying_while_rank_0_waits_on_another_is_noticed_at_once(&tcp_vars);
}
