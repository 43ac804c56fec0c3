//! The rows: the nccl-tests-style human table (size, count, type, redop, root, time, algbw,
//! busbw, #wrong, then the algorithm, the transport and the data path) and the `--csv` lines,
//! the bandwidths they show, and the side-by-side tables of `--algo all` and
//! `--compare-paths`. The lines are made by pure functions ([`csv_row`], [`human_row`],
//! [`column_heads`]) that the tests below pin down.

use std::io::Write;

use dspark::internals::plan::Algorithm;
use dspark::path::{PathPolicy, TransportKind};
use dspark::Communicator;

use crate::sizes::{bytes_of, engine_bytes};
use crate::sweep::default_algorithm;
use crate::Args;

/// One size of a sweep: the bytes and elements shown, the slowest rank's mean time, and the
/// wrong elements over all ranks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Row {
    pub(crate) bytes: usize,
    pub(crate) count: usize,
    pub(crate) time_us: f64,
    pub(crate) wrong: u64,
}

/// The first line of `--csv` output.
pub(crate) const CSV_HEADER: &str =
    "collective,dtype,op,ranks,bytes,count,time_us,algbw_GBps,busbw_GBps,wrong,transport,path";

/// Algorithm bandwidth (bytes / time, GB/s) and bus bandwidth (that times the collective's
/// factor, [`crate::Coll::bus_factor`]).
pub(crate) fn bandwidths(row: &Row, factor: f64) -> (f64, f64) {
    let algbw = if row.time_us > 0.0 {
        row.bytes as f64 / row.time_us / 1e3
    } else {
        0.0
    };
    (algbw, algbw * factor)
}

/// The redop column: the op of a reducing collective, else `none`.
fn op_column(args: &Args) -> &'static str {
    if args.collective.reduces() {
        args.op.name()
    } else {
        "none"
    }
}

/// The #wrong column: `N/A` without `--check`.
fn wrong_column(args: &Args, row: &Row) -> String {
    if args.check != 0 {
        row.wrong.to_string()
    } else {
        "N/A".into()
    }
}

/// One `--csv` line of a world of `n` ranks, its collective column `label` (`args.label()`,
/// or an algorithm's: [`side_csv`]).
pub(crate) fn csv_row(
    args: &Args,
    label: &str,
    n: usize,
    row: &Row,
    transport: TransportKind,
    path: &str,
) -> String {
    let coll = args.collective;
    let (algbw, busbw) = bandwidths(row, coll.bus_factor(n));
    format!(
        "{},{},{},{},{},{},{:.4},{:.4},{:.4},{},{},{}",
        label,
        args.dtype.name(),
        op_column(args),
        n,
        row.bytes,
        row.count,
        row.time_us,
        algbw,
        busbw,
        wrong_column(args, row),
        transport,
        path,
    )
}

/// One line of the human table of a world of `n` ranks; `algorithm` is the one the size ran.
pub(crate) fn human_row(
    args: &Args,
    n: usize,
    row: &Row,
    algorithm: &str,
    transport: TransportKind,
    path: &str,
) -> String {
    let coll = args.collective;
    let (algbw, busbw) = bandwidths(row, coll.bus_factor(n));
    let root: i64 = if coll.collective().rooted() {
        args.root as i64
    } else {
        -1
    };
    format!(
        "  {:>12} {:>12} {:>9} {:>6} {:>5} {:>11.2} {:>8.3} {:>8.3} {:>7}  {:<18} {:<9} {}",
        row.bytes,
        row.count,
        args.dtype.name(),
        op_column(args),
        root,
        row.time_us,
        algbw,
        busbw,
        wrong_column(args, row),
        algorithm,
        transport,
        path,
    )
}

/// The human table's two heading lines: the column names, then their units.
pub(crate) fn column_heads() -> [String; 2] {
    [
        format!(
            "# {:>12} {:>12} {:>9} {:>6} {:>5} {:>11} {:>8} {:>8} {:>7}  {:<18} {:<9} path",
            "size",
            "count",
            "type",
            "redop",
            "root",
            "time",
            "algbw",
            "busbw",
            "#wrong",
            "algorithm",
            "transport",
        ),
        format!(
            "# {:>12} {:>12} {:>9} {:>6} {:>5} {:>11} {:>8} {:>8} {:>7}",
            "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
        ),
    ]
}

/// Prints one row as `--csv` or the human table asks, at once (a long sweep shows progress).
pub(crate) fn print_row(args: &Args, comm: &Communicator, row: &Row, path: &str) {
    let n = comm.world_size();
    let transport = comm.info().transport;
    if args.csv {
        println!("{}", csv_row(args, &args.label(), n, row, transport, path));
    } else {
        let algo = comm.algorithm(args.collective.collective(), row.bytes);
        println!("{}", human_row(args, n, row, algo.name(), transport, path));
    }
    let _ = std::io::stdout().flush();
}

/// A side-by-side table's cells for one row: time and bus bandwidth, or how many elements
/// were wrong (a wrong result's time is no measure of anything, and is never the fastest),
/// one word (`WRONG(3)`) so that a cell stays one column for scripts that read the table.
fn side_cells(r: &Row, factor: f64) -> (String, String) {
    if r.wrong > 0 {
        (format!("WRONG({})", r.wrong), "-".into())
    } else {
        (
            format!("{:.2}", r.time_us),
            format!("{:.3}", bandwidths(r, factor).1),
        )
    }
}

/// nccl-tests' footer line for the wrong values of side-by-side sweeps, and which sweep and
/// sizes had them.
fn wrong_footer<'a>(runs: impl Iterator<Item = (String, &'a [Row])>) -> Vec<String> {
    let mut total = 0u64;
    let mut which = Vec::new();
    for (name, rows) in runs {
        let bad: Vec<String> = rows
            .iter()
            .filter(|r| r.wrong > 0)
            .map(|r| r.bytes.to_string())
            .collect();
        total += rows.iter().map(|r| r.wrong).sum::<u64>();
        if !bad.is_empty() {
            which.push(format!("# wrong results: {name} at {} B", bad.join(", ")));
        }
    }
    let mut out = vec![format!(
        "# Out of bounds values : {total} {}",
        if total == 0 { "OK" } else { "FAILED" }
    )];
    out.extend(which);
    out
}

/// `--algo all`'s table: per size each algorithm's time, bus bandwidth and the model's
/// prediction (`predict(algorithm, bytes the engine chooses by)`), or, where it ran as
/// another (`ran_as[k][i]`, per run and size), that one's name in parentheses; then the
/// fastest of those that computed right as themselves and the one the choice by size picks
/// (`default(bytes shown)`); then the wrong values' footer.
pub(crate) fn algorithm_table(
    args: &Args,
    n: usize,
    esz: usize,
    runs: &[(Algorithm, Vec<Row>)],
    ran_as: &[Vec<Algorithm>],
    predict: impl Fn(Algorithm, usize) -> Option<f64>,
    default: impl Fn(usize) -> &'static str,
) -> Vec<String> {
    let factor = args.collective.bus_factor(n);
    let mut out = vec![format!(
        "# --algo all: the same sweep with each algorithm of {} (time in us, busbw in GB/s)",
        args.label()
    )];
    let mut head = format!("# {:>12}", "size");
    for (a, _) in runs {
        head += &format!(" {:>20} {:>8} {:>10}", a.name(), "busbw", "model");
    }
    out.push(format!("{head} {:>20} {:>20}", "fastest", "default"));
    let mut ran_as_another = false;
    for i in 0..runs.first().map_or(0, |r| r.1.len()) {
        let bytes = runs[0].1[i].bytes;
        let mut line = format!("  {bytes:>12}");
        let mut best: Option<(Algorithm, f64)> = None;
        for (k, (a, rows)) in runs.iter().enumerate() {
            match rows.get(i) {
                Some(r) => {
                    let call = engine_bytes(args.collective, bytes_of(args, i), esz, n);
                    let ran = ran_as.get(k).and_then(|v| v.get(i)).copied().unwrap_or(*a);
                    if ran != *a {
                        ran_as_another = true;
                        line += &format!(" {:>20} {:>8} {:>10}", format!("({ran})"), "-", "-");
                        continue;
                    }
                    let model = predict(*a, call).map_or("-".to_string(), |t| format!("{t:.1}"));
                    let (time, busbw) = side_cells(r, factor);
                    line += &format!(" {time:>20} {busbw:>8} {model:>10}");
                    if r.wrong == 0 && best.is_none_or(|(_, t)| r.time_us < t) {
                        best = Some((*a, r.time_us));
                    }
                }
                None => line += &format!(" {:>20} {:>8} {:>10}", "-", "-", "-"),
            }
        }
        let fastest = best.map_or("-".to_string(), |(a, _)| a.name().to_string());
        out.push(format!("{line} {fastest:>20} {:>20}", default(bytes)));
    }
    if ran_as_another {
        out.push(
            "# (name): the forced algorithm ran as that one at this size: not its own time"
                .to_string(),
        );
    }
    out.extend(wrong_footer(
        runs.iter()
            .map(|(a, rows)| (a.name().to_string(), rows.as_slice())),
    ));
    out
}

/// [`algorithm_table`] printed, with the communicator's model and choice by size.
pub(crate) fn print_algorithm_table(
    args: &Args,
    comm: &Communicator,
    esz: usize,
    runs: &[(Algorithm, Vec<Row>)],
    ran_as: &[Vec<Algorithm>],
) {
    let c = args.collective.collective();
    let lines = algorithm_table(
        args,
        comm.world_size(),
        esz,
        runs,
        ran_as,
        |a, bytes| comm.predict(c, a, bytes),
        |bytes| default_algorithm(comm, c, bytes),
    );
    for l in lines {
        println!("{l}");
    }
}

/// `--compare-paths`' table: per size the time and bus bandwidth over GPUDirect RDMA and
/// host-staged (`results` in that order), and their ratio (only where both computed right);
/// then the wrong values' footer.
pub(crate) fn path_table(
    factor: f64,
    results: &[(PathPolicy, Result<Vec<Row>, String>)],
) -> Vec<String> {
    let mut out = vec![
        "# --compare-paths: the same sweep on each data path (time in us, busbw in GB/s)"
            .to_string(),
    ];
    for (policy, res) in results {
        if let Err(e) = res {
            out.push(format!("# {policy}: UNAVAILABLE — {e}"));
        }
    }
    out.push(format!(
        "# {:>12} {:>12} {:>9} {:>12} {:>9} {:>14}",
        "size", "gpu-direct", "busbw", "host-staged", "busbw", "staged/direct"
    ));
    let rows_of = |k: usize| results.get(k).and_then(|(_, r)| r.as_ref().ok());
    let (direct, staged) = (rows_of(0), rows_of(1));
    let list = staged.or(direct).map_or(0, Vec::len);
    for i in 0..list {
        let d = direct.and_then(|v| v.get(i));
        let h = staged.and_then(|v| v.get(i));
        let bytes = d.or(h).map_or(0, |r| r.bytes);
        let cell = |r: Option<&Row>| r.map_or(("-".into(), "-".into()), |r| side_cells(r, factor));
        let (dt, db) = cell(d);
        let (ht, hb) = cell(h);
        let ratio = match (d, h) {
            (Some(d), Some(h)) if d.time_us > 0.0 && d.wrong == 0 && h.wrong == 0 => {
                format!("{:.2}x", h.time_us / d.time_us)
            }
            _ => "-".into(),
        };
        out.push(format!(
            "  {bytes:>12} {dt:>12} {db:>9} {ht:>12} {hb:>9} {ratio:>14}"
        ));
    }
    out.extend(wrong_footer(results.iter().filter_map(|(p, r)| {
        r.as_ref().ok().map(|rows| (p.to_string(), rows.as_slice()))
    })));
    out
}

/// `--csv` for the side-by-side sweeps: the header, then each sweep's rows, an algorithm's
/// named in the collective column (`all_reduce/algo=ring`), a data path's in the path column.
pub(crate) fn side_csv<'a>(
    args: &Args,
    n: usize,
    transport: TransportKind,
    runs: impl Iterator<Item = (String, &'a str, &'a [Row])>,
) -> Vec<String> {
    let mut out = vec![CSV_HEADER.to_string()];
    for (label, path, rows) in runs {
        out.extend(
            rows.iter()
                .map(|r| csv_row(args, &label, n, r, transport, path)),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use dspark::path::TransportKind;

    use super::*;

    fn args(extra: &[&str]) -> Args {
        let argv = ["dspark-bench"].iter().chain(extra).copied();
        Args::try_parse_from(argv).expect("arguments parse")
    }

    /// nccl-tests' bus bandwidth factors (PERFORMANCE.md there), written out per collective
    /// name rather than taken from `Coll::bus_factor`.
    fn nccl_factor(collective: &str, n: usize) -> f64 {
        let n = n as f64;
        match collective {
            "all_reduce" => 2.0 * (n - 1.0) / n,
            "all_gather" | "reduce_scatter" | "all_to_all" | "all_to_all_v" => (n - 1.0) / n,
            "broadcast" | "reduce" | "send_recv" => 1.0,
            other => panic!("no factor for {other}"),
        }
    }

    const COLLECTIVES: [&str; 8] = [
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "reduce",
        "all_to_all",
        "all_to_all_v",
        "send_recv",
    ];

    #[test]
    fn csv_header_names_the_columns_in_order() {
        assert_eq!(
            CSV_HEADER,
            "collective,dtype,op,ranks,bytes,count,time_us,algbw_GBps,busbw_GBps,wrong,transport,path"
        );
    }

    #[test]
    fn csv_row_of_a_known_measurement() {
        // 1 MiB in 100 us: algbw 1048576 / 100 / 1e3 = 10.48576 GB/s; 4 ranks' all_reduce
        // moves 2 * 3 / 4 of it over the bus: 15.72864 GB/s.
        let row = Row {
            bytes: 1 << 20,
            count: 1 << 18,
            time_us: 100.0,
            wrong: 0,
        };
        let line = csv_row(
            &args(&[]),
            "all_reduce",
            4,
            &row,
            TransportKind::Tcp,
            "host",
        );
        assert_eq!(
            line,
            "all_reduce,float,sum,4,1048576,262144,100.0000,10.4858,15.7286,0,tcp,host"
        );
        assert_eq!(line.split(',').count(), CSV_HEADER.split(',').count());

        // A collective that does not reduce shows no op; without --check, no wrong count.
        let row = Row {
            bytes: 4096,
            count: 2048,
            time_us: 2.5,
            wrong: 7,
        };
        let a = args(&["all_gather", "-d", "half", "-o", "max", "-c", "0"]);
        assert_eq!(
            csv_row(&a, &a.label(), 2, &row, TransportKind::Shm, "staged"),
            "all_gather,half,none,2,4096,2048,2.5000,1.6384,0.8192,N/A,shm,staged"
        );
    }

    #[test]
    fn busbw_is_algbw_times_nccl_tests_factor_for_every_collective() {
        // 1 MB in 1000 us: algbw exactly 1 GB/s, so the busbw column is the factor.
        let row = Row {
            bytes: 1_000_000,
            count: 250_000,
            time_us: 1000.0,
            wrong: 0,
        };
        for name in COLLECTIVES {
            let a = args(&[name]);
            for n in [1, 2, 3, 4, 7, 8, 16, 64] {
                let want = nccl_factor(name, n);
                assert!(
                    (a.collective.bus_factor(n) - want).abs() < 1e-12,
                    "{name} with {n} ranks: factor {} != {want}",
                    a.collective.bus_factor(n)
                );
                let (algbw, busbw) = bandwidths(&row, a.collective.bus_factor(n));
                assert!((algbw - 1.0).abs() < 1e-12, "{name}: algbw {algbw}");
                assert!((busbw - want).abs() < 1e-12, "{name}: busbw {busbw}");
                let line = csv_row(&a, &a.label(), n, &row, TransportKind::Tcp, "host");
                let cols: Vec<&str> = line.split(',').collect();
                assert_eq!(cols[0], name, "{line}");
                assert_eq!(cols[7], "1.0000", "{name} algbw: {line}");
                assert_eq!(cols[8], format!("{want:.4}"), "{name} busbw: {line}");
            }
        }
    }

    #[test]
    fn bandwidth_of_an_unmeasured_row_is_zero() {
        let row = Row {
            bytes: 8,
            count: 2,
            time_us: 0.0,
            wrong: 0,
        };
        assert_eq!(bandwidths(&row, 2.0), (0.0, 0.0));
    }

    #[test]
    fn human_table_has_nccl_tests_columns_then_algorithm_transport_and_path() {
        let [names, units] = column_heads();
        let names: Vec<&str> = names.split_whitespace().collect();
        assert_eq!(
            names,
            [
                "#",
                "size",
                "count",
                "type",
                "redop",
                "root",
                "time",
                "algbw",
                "busbw",
                "#wrong",
                "algorithm",
                "transport",
                "path"
            ]
        );
        let units: Vec<&str> = units.split_whitespace().collect();
        assert_eq!(
            units,
            ["#", "(B)", "(elements)", "(us)", "(GB/s)", "(GB/s)"]
        );
    }

    #[test]
    fn human_row_of_a_known_measurement_lines_up_under_its_heading() {
        let row = Row {
            bytes: 1 << 20,
            count: 1 << 18,
            time_us: 100.0,
            wrong: 0,
        };
        let a = args(&["broadcast", "-r", "1"]);
        let line = human_row(&a, 4, &row, "ring", TransportKind::Tcp, "host");
        assert_eq!(
            line,
            "       1048576       262144     float   none     1      100.00   10.486   10.486       0  ring               tcp host"
        );
        // Each nccl-tests column is right-aligned under its heading (ends where it ends), the
        // algorithm and the transport start where theirs start. (The transport is not padded
        // to its width: `TransportKind`'s Display ignores it, so the path follows one space on.)
        let [names, _] = column_heads();
        let spans = |s: &str| -> Vec<(usize, usize)> {
            let mut out = Vec::new();
            let mut start = None;
            for (i, ch) in s.char_indices().chain([(s.len(), ' ')]) {
                match (ch == ' ', start) {
                    (false, None) => start = Some(i),
                    (true, Some(b)) => {
                        out.push((b, i));
                        start = None;
                    }
                    _ => {}
                }
            }
            out
        };
        let heads = &spans(&names)[1..]; // after "#"
        let cells = spans(&line);
        assert_eq!(heads.len(), cells.len(), "{names}\n{line}");
        for k in 0..9 {
            assert_eq!(cells[k].1, heads[k].1, "column {k} ends\n{names}\n{line}");
        }
        for k in 9..11 {
            assert_eq!(cells[k].0, heads[k].0, "column {k} starts\n{names}\n{line}");
        }

        // Unrooted collectives show root -1.
        let line = human_row(&args(&[]), 4, &row, "ring", TransportKind::Tcp, "host");
        assert!(line.contains("  float    sum    -1 "), "{line}");
    }

    fn row(bytes: usize, time_us: f64, wrong: u64) -> Row {
        Row {
            bytes,
            count: bytes / 4,
            time_us,
            wrong,
        }
    }

    /// `--algo all`: an algorithm that computed wrong shows how many elements in place of its
    /// time, is never the fastest however quick, and the footer says FAILED and where (the
    /// table showed clean times, and the run's exit code 2 was the only sign).
    #[test]
    fn algo_all_table_shows_wrong_results_and_never_calls_them_fastest() {
        let a = args(&["all_reduce", "-b", "8", "-e", "32", "-f", "4"]);
        let runs = vec![
            (Algorithm::Ring, vec![row(8, 5.0, 0), row(32, 6.0, 0)]),
            (
                Algorithm::RecursiveDoubling,
                vec![row(8, 1.0, 3), row(32, 2.0, 0)],
            ),
        ];
        let lines = algorithm_table(&a, 2, 4, &runs, &[], |_, _| None, |_| "ring");
        let body = lines.join("\n");
        let at = |b: &str| {
            lines
                .iter()
                .find(|l| l.split_whitespace().next() == Some(b))
                .unwrap_or_else(|| panic!("no row {b}:\n{body}"))
                .clone()
        };
        let r8 = at("8");
        assert!(r8.contains(" WRONG(3) "), "{body}");
        assert_eq!(
            r8.split_whitespace().nth_back(1),
            Some("ring"),
            "fastest: {body}"
        );
        assert_eq!(
            at("32").split_whitespace().nth_back(1),
            Some("recursive_doubling"),
            "{body}"
        );
        assert!(body.contains("# Out of bounds values : 3 FAILED"), "{body}");
        assert!(
            body.contains("# wrong results: recursive_doubling at 8 B"),
            "{body}"
        );
        // One_shot ran as itself at 8 B and as recursive doubling at 32 B (3 ranks beyond
        // the slots): that cell names it, and its time is no one_shot's.
        let runs = vec![
            (Algorithm::Ring, vec![row(8, 5.0, 0), row(32, 6.0, 0)]),
            (Algorithm::OneShot, vec![row(8, 1.0, 0), row(32, 2.0, 0)]),
        ];
        let ran = vec![
            vec![Algorithm::Ring; 2],
            vec![Algorithm::OneShot, Algorithm::RecursiveDoubling],
        ];
        let lines = algorithm_table(&a, 3, 4, &runs, &ran, |_, _| None, |_| "ring");
        let body = lines.join("\n");
        let r32 = lines
            .iter()
            .find(|l| l.split_whitespace().next() == Some("32"))
            .unwrap();
        assert!(r32.contains("(recursive_doubling)"), "{body}");
        assert_eq!(r32.split_whitespace().nth_back(1), Some("ring"), "{body}");
        assert!(
            body.contains("# (name): the forced algorithm ran as"),
            "{body}"
        );
        let clean = vec![(Algorithm::Ring, vec![row(8, 5.0, 0)])];
        let lines = algorithm_table(&a, 2, 4, &clean, &[], |_, _| None, |_| "ring");
        assert!(
            lines.iter().any(|l| l == "# Out of bounds values : 0 OK"),
            "{lines:?}"
        );
    }

    /// `--compare-paths`: a path's wrong result shows as such, no ratio is taken from it, and
    /// the footer says FAILED naming the path; an unavailable path is said.
    #[test]
    fn path_table_shows_wrong_results_and_takes_no_ratio_from_them() {
        let results = vec![
            (
                PathPolicy::GpuDirect,
                Ok(vec![row(1024, 10.0, 0), row(4096, 12.0, 7)]),
            ),
            (
                PathPolicy::HostStaged,
                Ok(vec![row(1024, 50.0, 0), row(4096, 60.0, 0)]),
            ),
        ];
        let lines = path_table(1.0, &results);
        let body = lines.join("\n");
        let r1 = lines
            .iter()
            .find(|l| l.trim_start().starts_with("1024 "))
            .unwrap();
        assert!(r1.ends_with("5.00x"), "{body}");
        let r4 = lines
            .iter()
            .find(|l| l.trim_start().starts_with("4096 "))
            .unwrap();
        assert!(r4.contains(" WRONG(7) ") && r4.ends_with(" -"), "{body}");
        assert!(body.contains("# Out of bounds values : 7 FAILED"), "{body}");
        assert!(body.contains("gpu-direct at 4096 B"), "{body}");
        let results = vec![
            (PathPolicy::GpuDirect, Err("no RDMA device".to_string())),
            (PathPolicy::HostStaged, Ok(vec![row(1024, 50.0, 0)])),
        ];
        let body = path_table(1.0, &results).join("\n");
        assert!(
            body.contains("gpu-direct: UNAVAILABLE — no RDMA device"),
            "{body}"
        );
        assert!(body.contains("# Out of bounds values : 0 OK"), "{body}");
    }

    /// The side-by-side sweeps' CSV: the header, then one well-formed row per sweep and size,
    /// each named by its label and path.
    #[test]
    fn side_by_side_csv_names_each_sweep_in_its_rows() {
        let a = args(&[]);
        let r = [row(8, 2.0, 0)];
        let lines = side_csv(
            &a,
            2,
            TransportKind::Shm,
            [
                ("all_reduce/algo=ring".to_string(), "host", &r[..]),
                ("all_reduce/algo=tree".to_string(), "host", &r[..]),
            ]
            .into_iter(),
        );
        assert_eq!(lines[0], CSV_HEADER);
        assert_eq!(lines.len(), 3);
        assert!(
            lines[1].starts_with("all_reduce/algo=ring,float,sum,2,8,2,2.0000,"),
            "{lines:?}"
        );
        assert!(lines[2].starts_with("all_reduce/algo=tree,"), "{lines:?}");
        assert!(
            lines.iter().all(|l| l.split(',').count() == 12),
            "{lines:?}"
        );
    }
}
