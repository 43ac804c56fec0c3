//! The `#` lines above the table: the run, the transport, the data path device buffers take
//! (or that they are in host memory), every rank's binding, each connection's transport, the
//! algorithm each size runs and the cost model's prediction for it.

use dspark::internals::engine::{spin_adapts, ADAPTED_SPIN_MAX};
use dspark::internals::plan::Collective;
use dspark::path::{BufferLocation, TransportKind};
use dspark::types::human_bytes;
use dspark::Communicator;

use crate::runner::Gpu;
use crate::sizes::{counts, engine_bytes, sizes};
use crate::spawn::BINDING;
use crate::table;
use crate::{Args, CallApi, Mem};

/// What the bench reports about the data path: the row column and the header lines.
pub(crate) struct PathView {
    pub(crate) column: String,
    pub(crate) lines: Vec<String>,
}

/// The data path of this run: host memory, the emulated device, or the path device buffers
/// take per connection (decided as init decides it).
pub(crate) fn path_view(
    args: &Args,
    comm: &Communicator,
    gpu: Option<&Gpu>,
) -> Result<PathView, String> {
    match args.mem {
        Mem::Host if !args.compare_paths => Ok(PathView {
            column: "host".into(),
            lines: vec!["host memory (buffers in RAM; no GPU involved)".into()],
        }),
        Mem::Emulated => Ok(PathView {
            column: "staged".into(),
            lines: vec![
                "staged, emulated device: host memory driven through the host-staged device \
                 pipeline (slot copies and reductions done on the CPU); no GPU involved"
                    .into(),
            ],
        }),
        _ => {
            let plan = comm
                .data_paths(BufferLocation::Device)
                .map_err(|e| e.to_string())?;
            let mut kinds: Vec<&str> = plan
                .connections
                .iter()
                .flat_map(|c| [c.send.memory.short(), c.recv.memory.short()])
                .collect();
            kinds.sort_unstable();
            kinds.dedup();
            let column = match kinds.as_slice() {
                [one] => one.to_string(),
                [] => "-".into(),
                _ => "mixed".into(),
            };
            let mut lines = vec![format!(
                "device memory on {}",
                gpu.map_or("the GPU".to_string(), |g| g.name.clone())
            )];
            lines.extend(plan.connections.iter().take(8).map(|c| format!("  {c:#}")));
            lines.extend(plan.warnings.iter().map(|w| format!("  WARNING: {w}")));
            Ok(PathView { column, lines })
        }
    }
}

/// Prints the `#` lines above the table, ending with the column headings.
pub(crate) fn header(args: &Args, comm: &Communicator, esz: usize, pv: &PathView) {
    let info = comm.info();
    let n = comm.world_size();
    let c = args.collective.collective();
    println!(
        "# dspark-bench {}: {} ranks, {} {}{}, {}, {} warm-up, check {}; time: the median window's mean per call",
        c,
        n,
        args.dtype,
        if args.collective.reduces() {
            args.op.name()
        } else {
            ""
        },
        if c.rooted() {
            format!(", root {}", args.root)
        } else {
            String::new()
        },
        args.iters.map_or_else(
            || format!(
                "iterations filling {} ms per size (at least {}) timed in {} windows",
                crate::sweep::MIN_TIMED_US / 1000.0,
                crate::sweep::MIN_ITERS,
                crate::sweep::WINDOWS
            ),
            |n| {
                let w = crate::sweep::WINDOWS.min(n.max(1));
                format!(
                    "{n} iteration{} timed in {w} window{}",
                    if n == 1 { "" } else { "s" },
                    if w == 1 { "" } else { "s" }
                )
            }
        ),
        args.warmup,
        if args.check != 0 { "on" } else { "off" },
    );
    println!(
        "# transport : {} — {}",
        info.transport, info.transport_detail
    );
    if let Some(why) = &info.transport_reason {
        println!("#   (not RDMA: {why})");
    }
    for (i, l) in pv.lines.iter().enumerate() {
        println!(
            "# {} {l}",
            if i == 0 { "data path :" } else { "           " }
        );
    }
    println!("# gpu region: {}", info.direct_region);
    let hosts: Vec<&str> = info.hosts.iter().map(String::as_str).collect();
    let mut uniq = hosts.clone();
    uniq.sort_unstable();
    uniq.dedup();
    println!("# rendezvous: {}", info.rendezvous);
    println!("# auth      : {}", info.auth);
    if let Some(b) = BINDING.get() {
        println!("# binding   : {b}");
    }
    if let Some(d) = std::env::var(crate::spawn::DISTANCE_ENV)
        .ok()
        .filter(|d| !d.is_empty())
    {
        println!("# distance  : {d}");
    }
    if args.api == CallApi::Nonblocking {
        println!("# api       : non-blocking (each call started in a scope, then Work::wait)");
    }
    println!(
        "# ranks     : {n} on {} host(s) [{}]; {} on this host; {}; spin {} µs{}{} then block; segment {}; timeout {:?}",
        uniq.len(),
        uniq.join(", "),
        info.local_ranks,
        info.cpu_sharing,
        info.spin.as_micros(),
        if info.spin_yields { " yielding" } else { "" },
        if spin_adapts(info.spin) {
            format!(
                " (up to {} ms, yielding, after a wait that slept and was woken soon after)",
                ADAPTED_SPIN_MAX.as_millis()
            )
        } else {
            String::new()
        },
        human_bytes(info.segment_bytes as u64, false),
        info.timeout,
    );
    // Per connection: the transport of each pair (shm within a host and tcp between hosts
    // in a mixed communicator), the path on host memory.
    let shown = n.min(8);
    for r in 0..shown {
        let mut kinds: Vec<TransportKind> = (0..n)
            .filter(|&p| p != r)
            .map(|p| info.transport_between(r, p))
            .collect();
        kinds.sort_by_key(|k| k.name());
        kinds.dedup();
        for k in kinds {
            let all: Vec<usize> = (0..n)
                .filter(|&p| p != r && info.transport_between(r, p) == k)
                .collect();
            let peers: Vec<String> = all.iter().take(7).map(|p| p.to_string()).collect();
            println!(
                "#   rank {r} ({}) -> ranks {}{}: {k} both ways, path {}",
                info.hosts.get(r).map_or("?", String::as_str),
                peers.join(","),
                if all.len() > 7 { ",…" } else { "" },
                pv.column,
            );
        }
    }
    if n > shown {
        println!("#   ... ranks {shown}..{} alike", n - 1);
    }
    let mut algos: Vec<String> = Vec::new();
    for b in sizes(args) {
        let (_, recv, total) = counts(args.collective, b, esz, n);
        let bytes = if c == Collective::AllGather {
            total * esz
        } else {
            recv.max(total) * esz
        };
        let a = comm.algorithm(c, bytes).name().to_string();
        if algos
            .last()
            .map(|x| x.split(' ').next() != Some(a.as_str()))
            .unwrap_or(true)
        {
            algos.push(format!("{a} from {}", human_bytes(b as u64, false)));
        }
    }
    let forced = match comm.forced_algorithm() {
        None => "DSPARK_ALGO or --algo forces one".to_string(),
        Some(f) if f.supports(c) => format!("forced: {f}, by DSPARK_ALGO or --algo"),
        Some(f) => format!(
            "DSPARK_ALGO={f} does not implement {}, which runs its default; {f} applies to {}",
            c.name(),
            f.collectives()
        ),
    };
    println!("# algorithm : {} ({forced})", algos.join(", "));
    // The cost model beside the measurement: its predicted time for the algorithm each size
    // runs (the engine's count: the whole buffer, or one rank's block).
    println!("# model     : {}", info.cost_model);
    let mut pred: Vec<String> = Vec::new();
    for b in sizes(args) {
        let call_bytes = engine_bytes(args.collective, b, esz, n);
        let a = comm.algorithm(c, call_bytes);
        if let Some(t) = comm.predict(c, a, call_bytes) {
            pred.push(format!("{} {t:.1}", human_bytes(b as u64, false)));
        }
    }
    println!("# predicted : µs, {}", pred.join(", "));
    println!("#");
    for line in table::column_heads() {
        println!("{line}");
    }
}
