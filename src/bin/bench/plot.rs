//! `dspark-bench --plot out.svg`: bus bandwidth against message size, one curve per data path
//! (or per run), with the peers' curves from a CSV beside them (`--plot-peers`).
//!
//! A plain SVG written by hand: log₂ size axis, linear GB/s axis, a legend that names every
//! curve. The CSV may be the peers' own (`../shared/peers`: `peer,ranks,bytes,...,busbw_GBps`,
//! one curve per `peer`) or `dspark-bench --csv` output (one curve per transport and path,
//! and per algorithm for `--algo all --csv`);
//! rows of another world size than this run's are left out.

use std::fmt::Write as _;

/// One curve: its name and (bytes, busbw GB/s) points.
pub(crate) struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

const W: f64 = 860.0;
const H: f64 = 520.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 250.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const COLOURS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A round step for an axis from 0 to `max` with about five ticks.
fn nice_step(max: f64) -> f64 {
    let raw = (max / 5.0).max(1e-9);
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let nice = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// The SVG text of the plot.
pub(crate) fn svg(title: &str, series: &[Series]) -> String {
    let pts = || series.iter().flat_map(|s| s.points.iter());
    let xs = pts().map(|p| p.0).filter(|&x| x > 0.0);
    let (lo, hi) = xs.fold((f64::MAX, 0.0f64), |(a, b), x| (a.min(x), b.max(x)));
    let (lo, hi) = if hi <= 0.0 {
        (8.0, 1024.0)
    } else {
        (
            lo.log2().floor(),
            hi.log2().ceil().max(lo.log2().floor() + 1.0),
        )
    };
    let ymax = pts().map(|p| p.1).fold(0.0f64, f64::max);
    let step = nice_step(if ymax > 0.0 { ymax } else { 1.0 });
    let ytop = ((ymax / step).ceil() * step).max(step);
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let px = |b: f64| LEFT + (b.max(1.0).log2() - lo) / (hi - lo) * pw;
    let py = |v: f64| TOP + ph - v / ytop * ph;

    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{}" y="28" font-size="15" text-anchor="middle">{}</text>"#,
        LEFT + pw / 2.0,
        esc(title)
    );
    // Grid and ticks.
    let mut e = lo as i64;
    while e as f64 <= hi {
        let x = px(2f64.powi(e as i32));
        let _ = writeln!(
            o,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#e4e4e4"/>"##,
            TOP + ph
        );
        if (e - lo as i64) % 2 == 0 || hi - lo <= 12.0 {
            let _ = writeln!(
                o,
                r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                TOP + ph + 18.0,
                dspark::types::human_bytes(2f64.powi(e as i32).round() as u64, true)
            );
        }
        e += 1;
    }
    let mut v = 0.0;
    while v <= ytop + step * 0.01 {
        let y = py(v);
        let _ = writeln!(
            o,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e4e4e4"/>"##,
            LEFT + pw
        );
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 6.0,
            y + 4.0,
            if step < 0.1 {
                format!("{v:.2}")
            } else {
                format!("{v:.1}")
            }
        );
        v += step;
    }
    let _ = writeln!(
        o,
        r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>"##
    );
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">message size (bytes)</text>"#,
        LEFT + pw / 2.0,
        H - 16.0
    );
    let _ = writeln!(
        o,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">bus bandwidth (GB/s)</text>"#,
        TOP + ph / 2.0,
        TOP + ph / 2.0
    );
    // Curves and legend.
    for (i, s) in series.iter().enumerate() {
        let c = COLOURS[i % COLOURS.len()];
        let dash = if i >= COLOURS.len() {
            r#" stroke-dasharray="5 3""#
        } else {
            ""
        };
        let mut p: Vec<&(f64, f64)> = s.points.iter().filter(|p| p.0 > 0.0).collect();
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        let line: Vec<String> = p
            .iter()
            .map(|&&(b, v)| format!("{:.1},{:.1}", px(b), py(v)))
            .collect();
        let _ = writeln!(
            o,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2"{dash} points="{}"/>"#,
            line.join(" ")
        );
        for &&(b, v) in &p {
            let _ = writeln!(
                o,
                r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{c}"/>"#,
                px(b),
                py(v)
            );
        }
        let ly = TOP + 10.0 + i as f64 * 20.0;
        let lx = LEFT + pw + 16.0;
        let _ = writeln!(
            o,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="2"{dash}/>"#,
            lx + 24.0
        );
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{}">{}</text>"#,
            lx + 30.0,
            ly + 4.0,
            esc(&s.label)
        );
    }
    o.push_str("</svg>\n");
    o
}

/// Curves from a CSV with a header naming `bytes` and `busbw_GBps`: one per `peer`, else one
/// per `transport`/`path`; rows whose `ranks` differs from `world` are skipped.
pub(crate) fn read_csv(text: &str, world: usize) -> Result<Vec<Series>, String> {
    let mut lines = text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'));
    let head: Vec<&str> = lines
        .next()
        .ok_or("the CSV is empty")?
        .split(',')
        .map(str::trim)
        .collect();
    let col = |name: &str| head.iter().position(|h| *h == name);
    let (Some(bytes), Some(busbw)) = (col("bytes"), col("busbw_GBps")) else {
        return Err(format!(
            "the CSV has no bytes and busbw_GBps columns (header: {})",
            head.join(",")
        ));
    };
    let (peer, ranks, transport, path) = (col("peer"), col("ranks"), col("transport"), col("path"));
    let (collective, wrong) = (col("collective"), col("wrong"));
    let mut out: Vec<Series> = Vec::new();
    for line in lines {
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        if f == head {
            continue; // concatenated CSVs repeat the header
        }
        let get = |i: Option<usize>| i.and_then(|i| f.get(i).copied());
        if get(ranks)
            .and_then(|r| r.parse::<usize>().ok())
            .is_some_and(|r| r != world)
        {
            continue;
        }
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
        // dspark-bench's rows whose result was wrong: their time is no bandwidth.
        if wrong.and_then(num).is_some_and(|w| w > 0.0) {
            continue;
        }
        // Rows without a size (iperf3's "stream") are not points of a curve.
        let (Some(b), Some(v)) = (num(bytes), num(busbw)) else {
            continue;
        };
        let mut label = match (get(peer), get(transport), get(path)) {
            (Some(p), _, _) => p.to_string(),
            (None, Some(t), Some(p)) => format!("dspark {t} {p}"),
            (None, Some(t), None) => format!("dspark {t}"),
            _ => "csv".to_string(),
        };
        // `--algo all --csv`'s rows: a curve per algorithm.
        if let Some((_, algo)) = get(collective).and_then(|c| c.split_once("/algo=")) {
            label = format!("{label} {algo}");
        }
        match out.iter_mut().find(|s| s.label == label) {
            Some(s) => s.points.push((b, v)),
            None => out.push(Series {
                label,
                points: vec![(b, v)],
            }),
        }
    }
    if out.is_empty() {
        return Err(format!(
            "no row of the CSV has a size and a busbw for {world} ranks"
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peers_csv_gives_one_curve_per_peer_of_this_world_size() {
        let csv = "peer,ranks,bytes,time_us,algbw_GBps,busbw_GBps\n\
                   gloo_tcp,2,8,314,0.0,0.0001\n\
                   gloo_tcp,2,1024,955,0.001,0.0011\n\
                   ompi_tcp,2,8,10.3,0.0,0.0008\n\
                   ompi_tcp,4,8,20.0,0.0,0.0004\n\
                   peer,ranks,bytes,time_us,algbw_GBps,busbw_GBps\n\
                   ompi_tcp,2,1024,11.2,0.0,0.09\n\
                   iperf3_uni,2,stream,5000100,3.79,3.79\n";
        let s = read_csv(csv, 2).unwrap();
        assert_eq!(s.len(), 2, "iperf3's row without a size is no curve");
        assert_eq!(s[0].label, "gloo_tcp");
        assert_eq!(s[0].points, vec![(8.0, 0.0001), (1024.0, 0.0011)]);
        assert_eq!(
            s[1].points,
            vec![(8.0, 0.0008), (1024.0, 0.09)],
            "the 4-rank row is left out, a repeated header skipped"
        );
    }

    /// dspark-bench's own CSV: a curve per transport and path, and per algorithm where the
    /// collective column names one (`--algo all --csv`).
    #[test]
    fn dspark_csv_gives_a_curve_per_path_and_algorithm() {
        let csv = "collective,dtype,op,ranks,bytes,count,time_us,algbw_GBps,busbw_GBps,wrong,transport,path\n\
                   all_reduce/algo=ring,float,sum,2,8,2,1.0,0.008,0.008,0,shm,host\n\
                   all_reduce/algo=tree,float,sum,2,8,2,2.0,0.004,0.004,0,shm,host\n\
                   all_reduce/algo=ring,float,sum,2,64,16,1.0,0.064,0.064,0,shm,host\n\
                   all_reduce/algo=tree,float,sum,2,64,16,1.0,9.999,9.999,3,shm,host\n\
                   all_reduce,float,sum,2,8,2,1.0,0.008,0.008,0,tcp,host\n";
        let s = read_csv(csv, 2).unwrap();
        let labels: Vec<&str> = s.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "dspark shm host ring",
                "dspark shm host tree",
                "dspark tcp host"
            ]
        );
        assert_eq!(s[0].points, vec![(8.0, 0.008), (64.0, 0.064)]);
        assert_eq!(s[1].points, vec![(8.0, 0.004)], "a wrong row is no point");
    }

    #[test]
    fn a_csv_without_the_columns_is_an_error_naming_them() {
        let e = read_csv("a,b\n1,2\n", 2).err().unwrap();
        assert!(e.contains("busbw_GBps"), "{e}");
        let e = read_csv("peer,ranks,bytes,busbw_GBps\nx,4,8,1.0\n", 2)
            .err()
            .unwrap();
        assert!(e.contains("2 ranks"), "{e}");
    }

    #[test]
    fn the_svg_has_a_curve_and_a_legend_entry_per_series() {
        let s = vec![
            Series {
                label: "dspark tcp host".into(),
                points: vec![(8.0, 0.001), (1048576.0, 2.5)],
            },
            Series {
                label: "ompi_tcp <peer>".into(),
                points: vec![(8.0, 0.0008), (1048576.0, 2.1)],
            },
        ];
        let out = svg("all_reduce", &s);
        assert_eq!(out.matches("<polyline").count(), 2);
        assert!(out.contains("dspark tcp host") && out.contains("ompi_tcp &lt;peer&gt;"));
        assert!(out.contains(">8<") && out.contains(">512K<"), "size ticks");
    }
}
