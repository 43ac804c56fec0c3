//! Communication microbenchmarks (criterion): what each layer costs on its own.
//!
//! Groups:
//! * `p2p/<transport>/<size>`: a send/recv ping-pong between two ranks (threads of this
//!   process) over the in-process `mem` transport and over TCP loopback; the time is one
//!   round trip, the throughput counts both directions. The limits: `memcpy` for `mem`, the
//!   TCP ping-pong of `../shared/peers/limits.sh` for `tcp`.
//! * `call/<api>/<world>`: the per-call cost of the engine, an 8-byte f32 all_reduce, through
//!   the blocking call and through the non-blocking one (`scope` + `Work::wait`): on one rank
//!   (no peer: pure call overhead) and on two ranks over `mem` (no wire). The difference
//!   between the two APIs is what the non-blocking path adds (issue #8's target: ≤ 2 µs).
//! * `recorder/<world>/<on|off>`: the flight recorder's cost per call: the blocking 8-byte
//!   f32 all_reduce of `call/` with the recorder on (`DSPARK_FR_ENTRIES` default) and off
//!   (`0`), one after the other in one run; the difference is the recorder's (target:
//!   ≤ 50 ns). `recorder/ring/start+clock+complete` is what the recorder adds to a call on
//!   its own, and `recorder/ab` (printed) the two whole calls measured interleaved.
//! * `plan/<collective>/<algorithm>/<world>`: building and compiling one rank's schedule of a
//!   1 MiB all_reduce (or a barrier) into its segment program, as every call does.
//! * `collective_mem/<collective>/<size>`: whole collectives on four ranks over `mem`.
//!
//! Every group runs its peers as threads that repeat rank 0's calls; rank 0's loop is timed.
//! `DSPARK_BENCH_QUICK=1` shortens every measurement (a smoke run, as CI does:
//! `DSPARK_BENCH_QUICK=1 cargo bench --bench comm`); without it `cargo bench --bench comm`
//! gives steady numbers.

use std::net::TcpListener;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use dspark::internals::engine::flight::{FlightPath, Recorder, Started, DEFAULT_ENTRIES};
use dspark::internals::plan::{self, Algorithm, Collective, Request};
use dspark::internals::transport::mem::MemFabric;
use dspark::{Communicator, Config, ReduceOp};

/// One rank's part of an iteration: the same call on every rank (its rank tells it its role).
type Step = Arc<dyn Fn(&Communicator, &mut Vec<f32>) + Send + Sync>;

fn quick() -> bool {
    std::env::var_os("DSPARK_BENCH_QUICK").is_some_and(|v| v != "0")
}

fn configure(g: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>, big: bool) {
    if quick() {
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(50))
            .measurement_time(Duration::from_millis(200));
    } else if big {
        g.sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3));
    } else {
        g.sample_size(50)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
    }
}

fn config(timeout: Duration) -> Config {
    let mut c = Config::new(0, 1, "");
    c.timeout = timeout;
    c
}

/// Communicators of `world` ranks over `mem`.
fn mem_comms(world: usize) -> Vec<Communicator> {
    mem_comms_with(world, &config(Duration::from_secs(60)))
}

/// Communicators of `world` ranks over `mem`, built from `cfg`.
fn mem_comms_with(world: usize, cfg: &Config) -> Vec<Communicator> {
    let fabric = MemFabric::new(world, 4);
    let hs: Vec<JoinHandle<Communicator>> = (0..world)
        .map(|r| {
            let (t, cfg) = (fabric.transport(r), cfg.clone());
            std::thread::spawn(move || {
                Communicator::from_transport(r, world, Box::new(t), &cfg)
                    .expect("a mem communicator")
            })
        })
        .collect();
    hs.into_iter()
        .map(|h| h.join().expect("init thread"))
        .collect()
}

/// Communicators of `world` ranks over TCP loopback (rendezvous on a free port).
fn tcp_comms(world: usize) -> Vec<Communicator> {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let hs: Vec<JoinHandle<Communicator>> = (0..world)
        .map(|r| {
            std::thread::spawn(move || {
                let mut c = Config::new(r, world, format!("127.0.0.1:{port}"));
                c.timeout = Duration::from_secs(60);
                c.transport = dspark::config::TransportChoice::Tcp;
                Communicator::init(c).expect("a TCP communicator")
            })
        })
        .collect();
    hs.into_iter()
        .map(|h| h.join().expect("init thread"))
        .collect()
}

/// Ranks 1.. of a communicator, as threads that run `step` as often as rank 0 asks.
struct Peers {
    asks: Vec<mpsc::Sender<u64>>,
    threads: Vec<JoinHandle<()>>,
}

impl Peers {
    fn start(comms: Vec<Communicator>, elems: usize, step: &Step) -> (Communicator, Peers) {
        let mut it = comms.into_iter();
        let first = it.next().expect("rank 0");
        let (mut asks, mut threads) = (Vec::new(), Vec::new());
        for c in it {
            let (tx, rx) = mpsc::channel::<u64>();
            let step = Arc::clone(step);
            asks.push(tx);
            threads.push(std::thread::spawn(move || {
                let mut buf = vec![1.0f32; elems];
                while let Ok(n) = rx.recv() {
                    for _ in 0..n {
                        step(&c, &mut buf);
                    }
                }
            }));
        }
        (first, Peers { asks, threads })
    }

    /// Times `iters` steps on rank 0 while the peers run theirs.
    fn run(&self, c: &Communicator, buf: &mut Vec<f32>, step: &Step, iters: u64) -> Duration {
        for a in &self.asks {
            a.send(iters).expect("peer alive");
        }
        let t = Instant::now();
        for _ in 0..iters {
            step(c, buf);
        }
        t.elapsed()
    }

    fn stop(self) {
        drop(self.asks);
        for t in self.threads {
            t.join().expect("peer thread");
        }
    }
}

/// Runs `step` on every rank of `comms` as one benchmark.
fn bench_ranks(
    g: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    id: &str,
    comms: Vec<Communicator>,
    elems: usize,
    step: Step,
) {
    let (c0, peers) = Peers::start(comms, elems, &step);
    let mut buf = vec![1.0f32; elems];
    g.bench_function(id, |b| {
        b.iter_custom(|iters| peers.run(&c0, &mut buf, &step, iters))
    });
    peers.stop();
}

const P2P_SIZES: [(usize, &str); 3] = [(8, "8B"), (64 << 10, "64KiB"), (4 << 20, "4MiB")];

fn ping_pong() -> Step {
    Arc::new(|c, buf| {
        if c.rank() == 0 {
            c.send(buf, 1).expect("send");
            c.recv(buf, 1).expect("recv");
        } else {
            c.recv(buf, 0).expect("recv");
            c.send(buf, 0).expect("send");
        }
    })
}

fn bench_p2p(c: &mut Criterion) {
    for (name, make) in [
        ("mem", mem_comms as fn(usize) -> Vec<Communicator>),
        ("tcp", tcp_comms),
    ] {
        let mut g = c.benchmark_group(format!("p2p/{name}"));
        for (bytes, label) in P2P_SIZES {
            configure(&mut g, bytes >= 1 << 20);
            g.throughput(Throughput::Bytes(2 * bytes as u64));
            bench_ranks(&mut g, label, make(2), bytes / 4, ping_pong());
        }
        g.finish();
    }
}

fn bench_call(c: &mut Criterion) {
    let blocking: Step = Arc::new(|c, buf| c.all_reduce(buf, ReduceOp::Sum).expect("all_reduce"));
    let nonblocking: Step = Arc::new(|c, buf| {
        c.scope(|s| s.all_reduce(buf, ReduceOp::Sum)?.wait())
            .expect("all_reduce")
    });
    let mut g = c.benchmark_group("call");
    configure(&mut g, false);
    for world in [1, 2] {
        for (api, step) in [("blocking", &blocking), ("nonblocking", &nonblocking)] {
            let id = format!("{api}/world{world}_mem");
            bench_ranks(&mut g, &id, mem_comms(world), 2, Arc::clone(step));
        }
    }
    g.finish();
}

fn bench_recorder(c: &mut Criterion) {
    let blocking: Step = Arc::new(|c, buf| c.all_reduce(buf, ReduceOp::Sum).expect("all_reduce"));
    let mut g = c.benchmark_group("recorder");
    configure(&mut g, false);
    for world in [1, 2] {
        // Twice each, alternating, so that drift of a noisy machine shows as a spread.
        for (pass, on) in [(1, false), (1, true), (2, false), (2, true)] {
            let mut cfg = config(Duration::from_secs(60));
            if !on {
                cfg.flight_entries = 0;
            }
            let id = format!("world{world}_mem/{}{pass}", if on { "on" } else { "off" });
            bench_ranks(
                &mut g,
                &id,
                mem_comms_with(world, &cfg),
                2,
                Arc::clone(&blocking),
            );
        }
    }
    // What the recorder adds to a call on its own: the clock read at the end (the start's
    // is the drive loop's anyway), the slot written at the start and at the end.
    let rec = Recorder::new(
        DEFAULT_ENTRIES,
        0,
        2,
        dspark::TransportKind::Tcp,
        None,
        false,
    );
    let call = Started {
        coll: Collective::AllReduce,
        is_send: false,
        dtype: dspark::DataType::F32,
        count: 2,
        op: Some(ReduceOp::Sum),
        root: 0,
        recv_from: None,
        algo: Algorithm::RecursiveDoubling,
        path: FlightPath::Host,
        seq: 1,
    };
    let t0 = rec.stamp(Instant::now());
    g.bench_function("ring/start+clock+complete", |b| {
        b.iter(|| {
            let pos = rec.start(std::hint::black_box(&call), t0);
            rec.complete(pos, rec.stamp(Instant::now()));
        })
    });
    // The one-shot all_reduce's way: a coarse stamp at the start, which is also the end.
    g.bench_function("ring/coarse-start+complete", |b| {
        b.iter(|| {
            let t = rec.coarse_stamp();
            let pos = rec.start(std::hint::black_box(&call), t);
            rec.complete(pos, t);
        })
    });
    g.finish();
    recorder_ab();
}

/// The recorder's cost as a difference measured interleaved (criterion's benches above run
/// one after the other, seconds apart on a noisy machine): one rank, communicators with and
/// without the recorder, rounds of `CALLS` blocking 8-byte all_reduces alternating between
/// them (which goes first alternates too); prints the median per-call time of each and the
/// median of the per-round differences.
fn recorder_ab() {
    const CALLS: u32 = 20_000;
    let rounds = if quick() { 5 } else { 41 };
    let mut off_cfg = config(Duration::from_secs(60));
    off_cfg.flight_entries = 0;
    let on = mem_comms(1).pop().expect("a communicator");
    let off = mem_comms_with(1, &off_cfg).pop().expect("a communicator");
    let mut buf = vec![1.0f32; 2];
    let time = |c: &Communicator, buf: &mut Vec<f32>| {
        let t = Instant::now();
        for _ in 0..CALLS {
            c.all_reduce(buf, ReduceOp::Sum).expect("all_reduce");
        }
        t.elapsed().as_nanos() as f64 / f64::from(CALLS)
    };
    let (mut ons, mut offs, mut diffs) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        let (a, b) = if r % 2 == 0 {
            let a = time(&on, &mut buf);
            (a, time(&off, &mut buf))
        } else {
            let b = time(&off, &mut buf);
            (time(&on, &mut buf), b)
        };
        ons.push(a);
        offs.push(b);
        diffs.push(a - b);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "recorder/ab world1_mem 8 B all_reduce, {rounds} rounds of {CALLS} calls interleaved: \
         on {:.1} ns, off {:.1} ns, on - off {:.1} ns per call (median of the rounds' \
         differences; loadavg {})",
        median(&mut ons),
        median(&mut offs),
        median(&mut diffs),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
}

fn bench_plan(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan");
    configure(&mut g, false);
    let cases = [
        (Collective::AllReduce, Algorithm::Ring),
        (Collective::AllReduce, Algorithm::RecursiveDoubling),
        (Collective::Broadcast, Algorithm::BinomialTree),
        (Collective::Barrier, Algorithm::Dissemination),
    ];
    for (coll, algo) in cases {
        for world in [8, 64, 512] {
            let req = Request {
                coll,
                algo,
                world,
                rank: world / 3,
                count: if coll == Collective::Barrier {
                    0
                } else {
                    1 << 18
                },
                root: 0,
                is_send: false,
                finalize: false,
                per_host: 0,
            };
            let id = format!("{}/{}/world{world}", coll.name(), algo.name());
            g.bench_function(id, |b| {
                b.iter(|| {
                    let s = plan::schedule(std::hint::black_box(&req)).expect("supported");
                    plan::compile(&s, 1 << 14)
                })
            });
        }
    }
    g.finish();
}

fn bench_collectives(c: &mut Criterion) {
    const WORLD: usize = 4;
    // (name, step, buffer elements for a call that moves `e` elements in all)
    type Case = (&'static str, Step, fn(usize) -> usize);
    let whole = |e: usize| e;
    // reduce_scatter and all_gather: a send and a receive part, split out of one buffer.
    let plus_block = |e: usize| e + e / WORLD;
    let cases: [Case; 4] = [
        (
            "all_reduce",
            Arc::new(|c, buf| c.all_reduce(buf, ReduceOp::Sum).expect("all_reduce")),
            whole,
        ),
        (
            "broadcast",
            Arc::new(|c, buf| c.broadcast(buf, 0).expect("broadcast")),
            whole,
        ),
        (
            "reduce_scatter",
            Arc::new(|c, buf| {
                let block = buf.len() / (WORLD + 1);
                let (send, recv) = buf.split_at_mut(block * WORLD);
                c.reduce_scatter(send, &mut recv[..block], ReduceOp::Sum)
                    .expect("reduce_scatter")
            }),
            plus_block,
        ),
        (
            "all_gather",
            Arc::new(|c, buf| {
                let block = buf.len() / (WORLD + 1);
                let (send, recv) = buf.split_at_mut(block);
                c.all_gather(send, &mut recv[..block * WORLD])
                    .expect("all_gather")
            }),
            plus_block,
        ),
    ];
    for (name, step, elems) in cases {
        let mut g = c.benchmark_group(format!("collective_mem/{name}"));
        for (bytes, label) in [(64usize << 10, "64KiB"), (4 << 20, "4MiB")] {
            configure(&mut g, bytes >= 1 << 20);
            g.throughput(Throughput::Bytes(bytes as u64));
            let e = elems(bytes / 4);
            bench_ranks(&mut g, label, mem_comms(WORLD), e, Arc::clone(&step));
        }
        g.finish();
    }
}

criterion_group!(
    benches,
    bench_p2p,
    bench_call,
    bench_recorder,
    bench_plan,
    bench_collectives
);
criterion_main!(benches);
