//! The `#` lines above the table: the run, the transport, the data path device buffers take
//! (or that they are in host memory), every rank's binding, each connection's transport, the
//! algorithm each size runs and the cost model's prediction for it.

use dspark::internals::cpus::{count, format_list, parse_ranges};
use dspark::internals::engine::{call_segment, spin_adapts, ADAPTED_SPIN_MAX, PAIR_SEGMENT_BELOW};
use dspark::internals::plan::{Algorithm, Collective};
use dspark::path::{BufferLocation, TransportKind};
use dspark::types::human_bytes;
use dspark::{CommInfo, Communicator};

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

/// The most bytes of one rank's [`sharing_text`] that [`gather_sharing`] carries (a longer
/// one ends in `…`).
const SHARING_BYTES: usize = 384;

/// How this rank shares its CPUs and spins, in the ranks line's words: `2 ranks on CPUs 0-1
/// (2 CPUs); spin 50 µs then block`.
fn sharing_text(info: &CommInfo) -> String {
    format!(
        "{}; spin {} µs{}{} then block",
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
        }
    )
}

/// `text` cut to at most `max` bytes on a character boundary, ending in `…` where cut.
fn clip(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let ell = "…";
    let mut end = max.saturating_sub(ell.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{ell}", &text[..end])
}

/// Every rank's [`sharing_text`] (indexed by rank), gathered to every rank: the slowest rank
/// sets the pace of a collective, and a rank of another host may share its CPUs where rank 0
/// does not (`4 ranks on CPU 1: oversubscribed`), so the header shows each one, not rank
/// 0's alone. Collective: every rank calls it at the same point. Where the gather fails (a
/// communicator a failed run poisoned), this rank's own text, saying so.
pub(crate) fn gather_sharing(comm: &Communicator) -> Vec<String> {
    let own = sharing_text(comm.info());
    let mut mine = clip(&own, SHARING_BYTES).into_bytes();
    mine.resize(SHARING_BYTES, 0);
    let mut all = vec![0u8; SHARING_BYTES * comm.world_size()];
    match comm.all_gather(&mine, &mut all) {
        Ok(()) => all
            .chunks(SHARING_BYTES)
            .map(|b| {
                let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
                String::from_utf8_lossy(&b[..end]).into_owned()
            })
            .collect(),
        Err(e) => vec![format!(
            "{own} (rank {}'s; the others' not gathered: {e})",
            comm.rank()
        )],
    }
}

/// `text` with the CPU lists it names (`CPU 0`, `CPUs 0-1`) read as `…`, and `its CPUs
/// (0-3)` as `its CPUs (… 4)`: what two ranks bound to CPUs of their own, or two hosts'
/// crowds each on its own core, have in common.
fn situation(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        // The next CPU list: digits right after one of the keys.
        let found = ["CPU ", "CPUs ", "CPUs ("]
            .iter()
            .filter_map(|k| {
                rest.match_indices(k)
                    .map(|(i, _)| i + k.len())
                    .find(|&end| rest[end..].starts_with(|c: char| c.is_ascii_digit()))
                    .map(|end| (end, *k))
            })
            .min();
        let Some((at, key)) = found else {
            out.push_str(rest);
            break;
        };
        let len = rest[at..]
            .find(|c: char| !(c.is_ascii_digit() || c == ',' || c == '-'))
            .unwrap_or(rest.len() - at);
        out.push_str(&rest[..at]);
        if key == "CPUs (" {
            // `its CPUs (0-3)`: how many, the one thing the list says that matters here.
            let n = count(&parse_ranges(&rest[at..at + len]));
            out.push_str(&format!("… {n}"));
        } else {
            out.push('…');
        }
        rest = &rest[at + len..];
    }
    out
}

/// The ranks of `sharing` grouped by [`situation`], in order of first rank, each group with
/// its words: the ranks' own where they all said the same, else the situation.
fn sharing_groups(sharing: &[String]) -> Vec<(String, Vec<usize>)> {
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (r, t) in sharing.iter().enumerate() {
        let key = situation(t);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, ranks)) => ranks.push(r),
            None => groups.push((key, vec![r])),
        }
    }
    groups
        .into_iter()
        .map(|(key, ranks)| {
            let first = &sharing[ranks[0]];
            let alike = ranks.iter().all(|&r| sharing[r] == *first);
            (if alike { first.clone() } else { key }, ranks)
        })
        .collect()
}

/// Prints the `#` lines above the table, ending with the column headings.
/// The header's `# distance` line's value: rank 0's CPU to rank 1's, as the spawning parent
/// measured it just before the ranks started (`spawn::DISTANCE_ENV`); `None` when it did not.
pub(crate) fn distance() -> Option<String> {
    std::env::var(crate::spawn::DISTANCE_ENV)
        .ok()
        .filter(|d| !d.is_empty())
}

pub(crate) fn header(
    args: &Args,
    comm: &Communicator,
    esz: usize,
    pv: &PathView,
    sharing: &[String],
) {
    let info = comm.info();
    let n = comm.world_size();
    let c = args.collective.collective();
    println!(
        "# dspark-bench {}: {} ranks, {}{}{}, {}, {} warm-up, check {}; time: the median window's mean per call",
        args.collective.name(),
        n,
        args.dtype,
        if args.collective.reduces() {
            format!(" {}", args.op.name())
        } else {
            String::new()
        },
        if c.rooted() {
            format!(", root {}", args.root)
        } else if args.collective == crate::Coll::AllToAllV && args.skew == 0.0 {
            ", skew 0 (equal blocks, through the per-pair path)".to_string()
        } else if args.collective == crate::Coll::AllToAllV {
            format!(
                ", skew {} (its own block the even share, its peers' from {:.0}% to {:.0}% of it; \
                 the same total per rank)",
                args.skew,
                100.0 * (1.0 - args.skew),
                100.0 * (1.0 + args.skew)
            )
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
        println!("#   (not a faster transport: {why})");
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
    if let Some(d) = distance() {
        println!("# distance  : {d}");
    }
    if args.api == CallApi::Nonblocking {
        println!("# api       : non-blocking (each call started in a scope, then Work::wait)");
    }
    // Ranks on CPUs of their own each name theirs: alike where only those differ.
    let groups = sharing_groups(sharing);
    let same = groups.len() <= 1;
    println!(
        "# ranks     : {n} on {} host(s) [{}]; {} on this host; {}; segment {}; timeout {:?}",
        uniq.len(),
        uniq.join(", "),
        info.local_ranks,
        if sharing.len() != n {
            // The gather failed: rank 0's words, saying so.
            sharing
                .first()
                .cloned()
                .unwrap_or_else(|| sharing_text(info))
        } else if same {
            // Rank 0's own words, whole (a gathered text is cut at SHARING_BYTES).
            sharing_text(info)
        } else {
            "CPU sharing and spin differ between ranks (below)".into()
        },
        segment_text(info, n),
        info.timeout,
    );
    if !same {
        for (text, ranks) in groups {
            let hosts: Vec<&str> = {
                let mut h: Vec<&str> = ranks
                    .iter()
                    .filter_map(|&r| info.hosts.get(r).map(String::as_str))
                    .collect();
                h.sort_unstable();
                h.dedup();
                h
            };
            println!(
                "#   CPU sharing of rank{} {} ({}): {text}",
                if ranks.len() == 1 { "" } else { "s" },
                format_list(&ranks),
                hosts.join(", ")
            );
        }
    }
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
    let mut one_shot = false;
    for b in sizes(args) {
        let call_bytes = engine_bytes(args.collective, b, esz, n);
        let a = comm.algorithm(c, call_bytes);
        if a == Algorithm::OneShot {
            // Chosen before the model, which is not fitted to it: its number for the
            // one-shot schedule read 1.5 µs against 0.29 measured on 2 ranks, 63 against 4.7
            // on 4 ranks sharing 2 cores.
            one_shot = true;
            pred.push(format!("{} -", human_bytes(b as u64, false)));
        } else if let Some(t) = comm.predict(c, a, call_bytes) {
            pred.push(format!("{} {t:.1}", human_bytes(b as u64, false)));
        }
    }
    let mut notes = Vec::new();
    if one_shot {
        notes.push("-: one_shot, outside the cost model");
    }
    if args.collective == crate::Coll::AllToAllV && args.skew != 0.0 {
        notes.push("all_to_all's of equal blocks: the model does not see the skew");
    }
    let notes = if notes.is_empty() {
        String::new()
    } else {
        format!(" ({})", notes.join("; "))
    };
    println!("# predicted : µs, {}{notes}", pred.join(", "));
    println!("#");
    for line in table::column_heads() {
        println!("{line}");
    }
}

/// The segment size, and the smaller one all_reduces under a size take where the engine picks
/// one ([`call_segment`]: two ranks over TCP).
fn segment_text(info: &CommInfo, world: usize) -> String {
    let seg = info.segment_bytes;
    let small = call_segment(seg, world, info.transport, Collective::AllReduce, 0);
    if small < seg {
        format!(
            "{} ({} for all_reduces under {}: two ranks over TCP)",
            human_bytes(seg as u64, false),
            human_bytes(small as u64, false),
            human_bytes(PAIR_SEGMENT_BELOW as u64, false)
        )
    } else {
        human_bytes(seg as u64, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_sharing_text_is_cut_on_a_character_and_ranks_group_by_text() {
        assert_eq!(clip("spin 50 µs", 64), "spin 50 µs");
        // 'µ' spans bytes 8-9: a cut at 9 bytes (8 with the ellipsis's 3) must not split it.
        for max in 0..14 {
            let c = clip("spin 50 µs then", max);
            assert!(c.len() <= max.max(3), "{max}: {c:?}");
            assert!(c.ends_with('…'), "{max}: {c:?}");
        }
        let s = |t: &str| t.to_string();
        assert_eq!(
            situation("CPU quota of 2 CPUs, CPU 3"),
            "CPU quota of 2 CPUs, CPU …"
        );
        assert_eq!(
            situation("no other rank on its CPUs (0-3,8); spin 50 µs then block"),
            "no other rank on its CPUs (… 5); spin 50 µs then block"
        );
        // Alone on one CPU and alone on 64 are not alike.
        assert_ne!(
            situation("no other rank on its CPUs (3)"),
            situation("no other rank on its CPUs (0-63)")
        );
        assert_eq!(
            situation(
                "4 ranks on CPUs 0-1 (2 CPUs): oversubscribed; 4 ranks under a CPU quota of 1 \
                 CPU (cgroup)"
            ),
            "4 ranks on CPUs … (2 CPUs): oversubscribed; 4 ranks under a CPU quota of 1 CPU \
             (cgroup)"
        );
        let alone = |c: u32| format!("no other rank on its CPUs ({c}); spin 50 µs");
        let busy = |c: u32| format!("2 ranks on CPU {c}: oversubscribed; spin 100 µs yielding");
        // Bound a core each: one group (the ranks line then shows rank 0's own words).
        let v = [alone(0), alone(1), alone(2)];
        assert_eq!(
            sharing_groups(&v),
            vec![(
                s("no other rank on its CPUs (… 1); spin 50 µs"),
                vec![0, 1, 2]
            )]
        );
        // Two hosts' crowds on a core each, and one rank alone.
        let v = [busy(0), busy(0), busy(1), busy(1), alone(1)];
        assert_eq!(
            sharing_groups(&v),
            vec![
                (
                    s("2 ranks on CPU …: oversubscribed; spin 100 µs yielding"),
                    vec![0, 1, 2, 3]
                ),
                (alone(1), vec![4]),
            ]
        );
        let v = [busy(1), alone(0), busy(1)];
        assert_eq!(
            sharing_groups(&v),
            vec![(busy(1), vec![0, 2]), (alone(0), vec![1])]
        );
    }
}
