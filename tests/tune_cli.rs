//! `dspark tune` measures constants that a communicator then uses, keeps the other transports'
//! entries of the file it rewrites, fails with a reason where it cannot write; `dspark model`
//! prints the choices the library makes.

use std::path::PathBuf;
use std::process::{Command, Output};

use dspark::internals::plan::model::{format_tune_file, parse_tune_file, CostModel, Costs, Medium};
use dspark::internals::plan::{Algorithm, Collective};

/// A 2-rank, 8-byte all_reduce run of dspark-bench over TCP with `envs`.
fn bench_8_bytes(envs: &[(&str, &str)]) -> Output {
    run(
        env!("CARGO_BIN_EXE_dspark-bench"),
        &[
            "all_reduce",
            "--ranks",
            "2",
            "--transport",
            "tcp",
            "-b",
            "8",
            "-e",
            "8",
            "-n",
            "2",
            "-w",
            "1",
        ],
        envs,
    )
}

fn run(exe: &str, args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut c = Command::new(exe);
    c.args(args);
    for v in ["DSPARK_TUNE_FILE", "DSPARK_ALGO", "RANK", "DSPARK_RANK"] {
        c.env_remove(v);
    }
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().expect("start the binary")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("dspark-tune-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn tune_writes_constants_that_a_communicator_then_reports() {
    let dir = TempDir::new("cli");
    // A directory that does not exist yet: tune creates it.
    let out = dir.0.join("sub").join("tune.json");
    let out_s = out.to_str().unwrap();
    // An shm entry from an earlier run, which a tcp run must keep.
    let shm = Costs {
        alpha_us: 1.25,
        beta_us_per_byte: 1e-4,
        gamma_us_per_byte: 2e-4,
        alpha_oversub_us: 7.0,
    };
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    std::fs::write(&out, format_tune_file(&[(Medium::Shm, shm)], &[])).unwrap();

    let o = run(
        env!("CARGO_BIN_EXE_dspark"),
        &["tune", "--quick", "--transport", "tcp", "--out", out_s],
        &[],
    );
    let (so, se) = text(&o);
    assert!(o.status.success(), "tune failed:\n{so}\n{se}");
    assert!(so.contains(&format!("wrote {out_s}")), "{so}");

    let entries = parse_tune_file(&std::fs::read_to_string(&out).unwrap()).expect("parses");
    let tcp = entries
        .iter()
        .find(|(m, _)| *m == Medium::Tcp)
        .map(|&(_, c)| c)
        .expect("a tcp entry");
    for (name, v) in [
        ("alpha_us", tcp.alpha_us),
        ("beta_us_per_byte", tcp.beta_us_per_byte),
        ("gamma_us_per_byte", tcp.gamma_us_per_byte),
    ] {
        assert!(v.is_finite() && v > 0.0, "{name} = {v}");
    }
    assert!(tcp.alpha_oversub_us.is_finite() && tcp.alpha_oversub_us >= 0.0);
    // Loopback TCP between two processes: between 100 ns and 10 ms one way, between 1 MB/s
    // and 1 TB/s; a kernel between 10 MB/s and 10 TB/s. Anything outside is a unit error.
    assert!((0.1..10_000.0).contains(&tcp.alpha_us), "{tcp:?}");
    assert!((1e-6..1.0).contains(&tcp.beta_us_per_byte), "{tcp:?}");
    assert!((1e-7..0.1).contains(&tcp.gamma_us_per_byte), "{tcp:?}");
    assert_eq!(
        entries.iter().find(|(m, _)| *m == Medium::Shm).map(|e| e.1),
        Some(shm),
        "the shm entry of the earlier file is kept"
    );

    // A communicator initialised with the file reports its constants and their source.
    let o = bench_8_bytes(&[("DSPARK_TUNE_FILE", out_s)]);
    let (so, se) = text(&o);
    assert!(o.status.success(), "bench failed:\n{so}\n{se}");
    let line = so
        .lines()
        .find(|l| l.starts_with("# model"))
        .unwrap_or_else(|| panic!("no model line in:\n{so}"));
    assert!(
        line.contains(&format!("α={:.2} µs", tcp.alpha_us)),
        "{line} vs {tcp:?}"
    );
    assert!(
        line.contains(&format!("β={:.2} GB/s", 1e-3 / tcp.beta_us_per_byte)),
        "{line} vs {tcp:?}"
    );
    assert!(line.contains(&format!("(from {out_s})")), "{line}");
    // Without it, the defaults.
    let o = bench_8_bytes(&[(
        "DSPARK_TUNE_FILE",
        dir.0.join("none.json").to_str().unwrap(),
    )]);
    let (so, _) = text(&o);
    assert!(
        so.lines()
            .any(|l| l.starts_with("# model") && l.contains("defaults")),
        "{so}"
    );
}

#[test]
fn tune_says_why_it_cannot_write_and_writes_nothing() {
    let dir = TempDir::new("bad");
    let file = dir.0.join("a-file");
    std::fs::write(&file, "x").unwrap();
    // The parent of --out is a file.
    let out = file.join("tune.json");
    let o = run(
        env!("CARGO_BIN_EXE_dspark"),
        &["tune", "--quick", "--out", out.to_str().unwrap()],
        &[],
    );
    let (so, se) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{so}\n{se}");
    assert!(se.contains("dspark tune: cannot create"), "{se}");
    assert!(!se.contains("panicked"), "{se}");
}

/// Over shared memory the smallest all_reduces run one-shot through the slots, a choice made
/// before the cost model: the table's choice says so up to the communicator's bound
/// (`tests/shm.rs` checks that bound against a communicator's), and the model's choice above.
#[test]
fn model_over_shm_shows_the_one_shot_sizes_the_library_runs() {
    let o = run(
        env!("CARGO_BIN_EXE_dspark"),
        &[
            "model",
            "--transport",
            "shm",
            "--ranks",
            "1,2",
            "-b",
            "8",
            "-e",
            "16K",
            "-f",
            "2",
        ],
        &[],
    );
    let (so, se) = text(&o);
    assert!(o.status.success(), "{so}\n{se}");
    let bound = dspark::internals::choice::one_shot_max_bytes(dspark::TransportKind::Shm);
    assert_eq!(bound, 4096);
    let (tab, _) = so.split_once("# crossovers").expect("a crossover section");
    let rows: Vec<Vec<&str>> = tab
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    // 8 B .. 16 KiB by 2: 12 sizes, for 1 rank then 2.
    assert_eq!(rows.len(), 24, "{so}");
    for (i, row) in rows.iter().enumerate() {
        let bytes = 8usize << (i % 12);
        let one_shot = i >= 12 && bytes <= bound;
        assert_eq!(
            row.last() == Some(&"one_shot"),
            one_shot,
            "row {i} ({bytes} B): {row:?}"
        );
    }
    assert!(so.contains("one_shot 8–4K | "), "{so}");
}

#[test]
fn model_prints_the_choice_the_library_makes_at_every_size() {
    let dir = TempDir::new("model");
    let path = dir.0.join("t.json");
    let c = Costs {
        alpha_us: 20.0,
        beta_us_per_byte: 1e-3,
        gamma_us_per_byte: 1e-4,
        alpha_oversub_us: 9.0,
    };
    std::fs::write(&path, format_tune_file(&[(Medium::Tcp, c)], &[])).unwrap();
    let o = run(
        env!("CARGO_BIN_EXE_dspark"),
        &[
            "model",
            "--ranks",
            "2,64,4096",
            "-b",
            "8",
            "-e",
            "1G",
            "--tune-file",
            path.to_str().unwrap(),
        ],
        &[],
    );
    let (so, se) = text(&o);
    assert!(o.status.success(), "{so}\n{se}");
    assert!(so.contains(&format!("(from {})", path.display())), "{so}");
    let m = CostModel::new(Medium::Tcp, c);
    // The table: one row per size per world (×4 steps from 8 B to 1 GiB), whose last column
    // is what the library's choice is.
    let (tab, cross) = so.split_once("# crossovers").expect("a crossover section");
    let table: Vec<Vec<&str>> = tab
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(table.len(), 3 * 14, "{so}");
    let mut i = 0;
    for n in [2usize, 64, 4096] {
        let mut b = 8usize;
        while b <= 1 << 30 {
            let want = m.choose(Collective::AllReduce, b, n, 0);
            assert_eq!(
                table[i].last().copied(),
                Some(want.name()),
                "{n} ranks at {b}: {:?}",
                table[i]
            );
            // The ring's predicted time, in the first time column.
            let t: f64 = table[i][1].parse().unwrap();
            let p = m
                .predict(Collective::AllReduce, Algorithm::Ring, b, n, 0)
                .unwrap();
            assert!(
                (t - p).abs() <= 0.05 + p * 1e-3,
                "{n} ranks at {b}: {t} vs {p}"
            );
            i += 1;
            b *= 4;
        }
    }
    // The crossover summary: one line per world, whose ranges start where the choice changes.
    for n in [2usize, 64, 4096] {
        let line = cross
            .lines()
            .find(|l| !l.starts_with('#') && l.split_whitespace().next() == Some(&n.to_string()))
            .unwrap_or_else(|| panic!("no crossover line for {n}:\n{so}"));
        let mut changes = 0;
        let mut b = 16usize;
        while b <= 1 << 30 {
            if m.choose(Collective::AllReduce, b, n, 0)
                != m.choose(Collective::AllReduce, b / 2, n, 0)
            {
                changes += 1;
            }
            b *= 2;
        }
        assert_eq!(line.matches('|').count(), changes, "{n}: {line}");
    }
    // A tune file that is not one is an error that names it.
    std::fs::write(&path, "{").unwrap();
    let o = run(
        env!("CARGO_BIN_EXE_dspark"),
        &["model", "--tune-file", path.to_str().unwrap()],
        &[],
    );
    let (_, se) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{se}");
    assert!(se.contains(path.to_str().unwrap()), "{se}");
}
