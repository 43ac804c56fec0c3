//! What follows the table: the nccl-tests footer (wrong values, average bus bandwidth) and the
//! `--plot` SVG of this run's curves beside the peers'.

use dspark::Communicator;

use crate::table::{bandwidths, Row};
use crate::{plot, Args};

/// `--plot`: this run's curves, and the peers' from `--plot-peers`, into an SVG.
pub(crate) fn write_plot(
    args: &Args,
    comm: &Communicator,
    file: &std::path::Path,
    runs: &[(String, Vec<Row>)],
) -> Result<(), String> {
    let n = comm.world_size();
    let factor = args.collective.bus_factor(n);
    let mut series: Vec<plot::Series> = runs
        .iter()
        .map(|(label, rows)| plot::Series {
            label: label.clone(),
            points: rows
                .iter()
                .map(|r| (r.bytes as f64, bandwidths(r, factor).1))
                .collect(),
        })
        .collect();
    if let Some(csv) = &args.plot_peers {
        let text = std::fs::read_to_string(csv)
            .map_err(|e| format!("--plot-peers {}: {e}", csv.display()))?;
        series.extend(
            plot::read_csv(&text, n).map_err(|e| format!("--plot-peers {}: {e}", csv.display()))?,
        );
    }
    let op = if args.collective.reduces() {
        format!(" {}", args.op.name())
    } else {
        String::new()
    };
    let title = format!(
        "{} {}{op}, {n} ranks, {} — bus bandwidth",
        args.collective.collective().name(),
        args.dtype.name(),
        comm.info().transport
    );
    std::fs::write(file, plot::svg(&title, &series))
        .map_err(|e| format!("--plot {}: {e}", file.display()))?;
    eprintln!("# plot: {} ({} curves)", file.display(), series.len());
    Ok(())
}

/// nccl-tests' footer: the wrong values over the sweep and the average bus bandwidth.
pub(crate) fn footer(rows: &[Row], factor: f64) {
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    let avg_bus = if rows.is_empty() {
        0.0
    } else {
        rows.iter().map(|r| bandwidths(r, factor).1).sum::<f64>() / rows.len() as f64
    };
    println!(
        "# Out of bounds values : {} {}",
        wrong,
        if wrong == 0 { "OK" } else { "FAILED" }
    );
    println!("# Avg bus bandwidth    : {avg_bus:.4} GB/s");
}
