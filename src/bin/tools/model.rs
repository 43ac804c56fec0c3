//! `dspark model`: what the cost model ([`dspark::internals::plan::model`]) predicts for allreduce, per
//! algorithm, size and world, and where the cheapest algorithm changes — the choice every call
//! makes, run at plan level without any ranks.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use dspark::config::parse_size;
use dspark::internals::choice::one_shot_max_bytes;
use dspark::internals::plan::model::{self, CostModel, Costs, Medium};
use dspark::internals::plan::{hierarchical_fits, Algorithm, Collective};
use dspark::types::human_bytes;
use dspark::TransportKind;

/// `dspark model`'s arguments.
#[derive(Args, Debug)]
pub(crate) struct ModelArgs {
    /// Whose constants: tcp, shm, verbs or mem.
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// World sizes (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "8,16,64,256,1024,4096")]
    ranks: Vec<usize>,
    /// Smallest size.
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_bytes)]
    min: usize,
    /// Largest size.
    #[arg(short = 'e', long = "maxbytes", default_value = "1G", value_parser = parse_bytes)]
    max: usize,
    /// Size step factor of the table (the crossovers are found at every power of two).
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    factor: usize,
    /// Ranks per host, for the hierarchical allreduce (where it divides the world).
    #[arg(long, default_value_t = 0)]
    per_host: usize,
    /// The tune file to read (default: as init finds it, `DSPARK_TUNE_FILE`, else
    /// `$XDG_CACHE_HOME/dspark/tune.json`, else `$HOME/.cache/dspark/tune.json`; the
    /// defaults when there is none).
    #[arg(long, value_name = "PATH")]
    tune_file: Option<PathBuf>,
    /// Model ranks sharing cores: this many ranks per host (with --cores). Not oversubscribed
    /// unless given.
    #[arg(long, requires = "cores")]
    local_ranks: Option<usize>,
    /// Cores per host (with --local-ranks).
    #[arg(long, requires = "local_ranks")]
    cores: Option<usize>,
    /// Pipeline segment size (`DSPARK_CHUNK_BYTES`; the library's default unless given).
    #[arg(long, default_value = "512K", value_parser = parse_bytes)]
    segment: usize,
    /// Only the crossover table.
    #[arg(long)]
    crossovers_only: bool,
    /// The link between hosts, as the link probe measures it at init (`# model` line of
    /// `dspark-bench`: `link α=… µs β=… Gbit/s`): its α in µs (with --link-gbit and
    /// --per-host).
    #[arg(long, requires = "link_gbit")]
    link_alpha_us: Option<f64>,
    /// The link's rate, Gbit/s (with --link-alpha-us).
    #[arg(long, requires = "link_alpha_us")]
    link_gbit: Option<f64>,
}

fn parse_bytes(s: &str) -> Result<usize, String> {
    parse_size(s).ok_or_else(|| format!("{s:?} is not a size (e.g. 8, 64K, 1M, 1G)"))
}

const ALGOS: [Algorithm; 5] = [
    Algorithm::Ring,
    Algorithm::Tree,
    Algorithm::RecursiveDoubling,
    Algorithm::Rabenseifner,
    Algorithm::Hierarchical,
];

/// The constants for `medium` and where they came from.
fn load(args: &ModelArgs, medium: Medium) -> Result<(Costs, String), String> {
    let explicit = args.tune_file.is_some();
    let path = args
        .tune_file
        .clone()
        .or_else(|| dspark::config::tune_file_from(|k| std::env::var_os(k)));
    let Some(path) = path else {
        return Ok((Costs::defaults(medium), "defaults".into()));
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => {
            return Ok((Costs::defaults(medium), "defaults".into()))
        }
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let entries = model::parse_tune_file(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(match entries.into_iter().find(|(m, _)| *m == medium) {
        Some((_, c)) => (c, format!("from {}", path.display())),
        None => (
            Costs::defaults(medium),
            format!(
                "defaults: {} has no {} entry",
                path.display(),
                medium.name()
            ),
        ),
    })
}

fn size_text(b: usize) -> String {
    human_bytes(b as u64, true)
}

fn time_text(us: f64) -> String {
    if us < 1e4 {
        format!("{us:.1}")
    } else {
        format!("{us:.0}")
    }
}

/// The algorithm the model chooses at every power of two from `min` to `max`, as ranges:
/// `(algorithm, first size, last size)`.
/// Sizes up to `one_shot` bytes go one-shot ([`chosen`]).
pub(crate) fn crossovers(
    m: &CostModel,
    world: usize,
    per_host: usize,
    min: usize,
    max: usize,
    one_shot: usize,
) -> Vec<(Algorithm, usize, usize)> {
    let mut out: Vec<(Algorithm, usize, usize)> = Vec::new();
    let mut b = min.max(1).next_power_of_two();
    while b <= max {
        let a = chosen(m, b, world, per_host, one_shot);
        match out.last_mut() {
            Some(last) if last.0 == a => last.2 = b,
            _ => out.push((a, b, b)),
        }
        match b.checked_mul(2) {
            Some(x) => b = x,
            None => break,
        }
    }
    out
}

/// The algorithm a call of `bytes` runs with: one-shot through shared slots up to
/// `one_shot` bytes among 2 ranks or more (decided before the model, which never picks it:
/// `dspark::internals::choice::one_shot_max_bytes`), else the model's choice.
fn chosen(
    m: &CostModel,
    bytes: usize,
    world: usize,
    per_host: usize,
    one_shot: usize,
) -> Algorithm {
    if world > 1 && bytes <= one_shot {
        Algorithm::OneShot
    } else {
        m.choose(Collective::AllReduce, bytes, world, per_host)
    }
}

/// Runs `dspark model`.
pub(crate) fn model_main(args: &ModelArgs) -> ExitCode {
    let Some(medium) = Medium::from_name(&args.transport) else {
        eprintln!(
            "dspark model: --transport {:?}: expected tcp, shm, verbs or mem",
            args.transport
        );
        return ExitCode::from(2);
    };
    if args.ranks.is_empty() || args.ranks.contains(&0) {
        eprintln!("dspark model: --ranks needs world sizes of at least 1");
        return ExitCode::from(2);
    }
    if args.factor < 2 || args.min == 0 || args.min > args.max {
        eprintln!("dspark model: sizes must satisfy 1 <= -b <= -e and -f >= 2");
        return ExitCode::from(2);
    }
    let (costs, source) = match load(args, medium) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("dspark model: {e}");
            return ExitCode::from(1);
        }
    };
    let mut m = CostModel::new(medium, costs);
    m.segment_bytes = args.segment.max(1);
    if let (Some(l), Some(c)) = (args.local_ranks, args.cores) {
        m.local_ranks = l.max(1);
        m.cores = c.max(1);
    }
    if let (Some(alpha_us), Some(gbit)) = (args.link_alpha_us, args.link_gbit) {
        let link = model::Link {
            alpha_us,
            beta_us_per_byte: 8e-3 / gbit,
        };
        if !link.is_valid() {
            eprintln!("dspark model: --link-alpha-us and --link-gbit must be positive");
            return ExitCode::from(2);
        }
        m.link = Some(link);
    }
    // Over shared memory the smallest calls go one-shot through the slots, before the model.
    let one_shot = match medium {
        Medium::Shm => one_shot_max_bytes(TransportKind::Shm),
        _ => 0,
    };
    println!("# dspark model: allreduce, predicted time per algorithm (µs) and the choice");
    println!("# model   : {m} ({source})");
    println!(
        "# choice  : the cheapest; one later in the preference (recursive_doubling, \
         binomial_tree, tree, ring, rabenseifner, ...) must be cheaper by more than half a \
         hop's latency ({:.2} µs, the model's resolution) to displace one with fewer hops{}",
        0.5 * m.costs.alpha_us,
        if one_shot > 0 {
            format!(
                "; up to {} the all_reduce runs one_shot through shared slots (no model)",
                size_text(one_shot)
            )
        } else {
            String::new()
        }
    );
    println!(
        "# segment : {}; {}",
        size_text(m.segment_bytes),
        if m.oversubscription() > 1.0 {
            format!("{} ranks per host on {} cores", m.local_ranks, m.cores)
        } else {
            "one rank per core (not oversubscribed)".into()
        }
    );
    if !args.crossovers_only {
        for &n in &args.ranks {
            let per_host = args.per_host;
            let hier = hierarchical_fits(n, per_host);
            let shown: Vec<Algorithm> = ALGOS
                .into_iter()
                .filter(|&a| a != Algorithm::Hierarchical || hier)
                .collect();
            println!("#");
            println!(
                "# {n} ranks{}",
                if hier {
                    format!(", {per_host} per host")
                } else {
                    String::new()
                }
            );
            let mut head = format!("# {:>10}", "size");
            for a in &shown {
                head += &format!(" {:>20}", a.name());
            }
            head += &format!("  {:<20}", "chosen");
            println!("{head}");
            let mut b = args.min;
            while b <= args.max {
                let mut row = format!("  {:>10}", size_text(b));
                for &a in &shown {
                    let t = m.predict(Collective::AllReduce, a, b, n, per_host);
                    row += &format!(" {:>20}", t.map_or("-".into(), time_text));
                }
                row += &format!("  {:<20}", chosen(&m, b, n, per_host, one_shot).name());
                println!("{row}");
                match b.checked_mul(args.factor) {
                    Some(x) => b = x,
                    None => break,
                }
            }
        }
    }
    println!("#");
    println!("# crossovers: the algorithm chosen at each power of two");
    println!("# {:>6}  ranges", "ranks");
    for &n in &args.ranks {
        let ranges = crossovers(&m, n, args.per_host, args.min, args.max, one_shot)
            .into_iter()
            .map(|(a, lo, hi)| {
                if lo == hi {
                    format!("{} {}", a.name(), size_text(lo))
                } else {
                    format!("{} {}–{}", a.name(), size_text(lo), size_text(hi))
                }
            })
            .collect::<Vec<_>>()
            .join(" | ");
        println!("  {n:>6}  {ranges}");
    }
    ExitCode::SUCCESS
}
