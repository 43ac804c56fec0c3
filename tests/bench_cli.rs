//! `dspark-bench` as a user types it, where a collective of its own needs more than the
//! launcher tests' all_reduce: all_to_all_v with blocks skewed between every pair, over
//! shared memory and TCP, blocking and non-blocking, every result checked by the bench
//! against the blocks each sender's counts say it sent (`Out of bounds values : 0 OK`), and
//! the arguments it refuses.

use std::process::Command;

const BENCH: &str = env!("CARGO_BIN_EXE_dspark-bench");

/// Runs the bench with `args`; returns its exit code and its output, both streams.
fn bench(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(BENCH)
        .args(args)
        // A rank that hangs fails its run at this deadline instead of hanging the test.
        .env("DSPARK_TIMEOUT", "60")
        .output()
        .expect("dspark-bench starts");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// Three ranks (blocks of an odd world), skews that leave some blocks empty (1) and cut
/// the rest unevenly (0.37), sizes from below the world's element count to several 64 KiB
/// segments' worth, int32 (exact) and half: every row checked. Also through the staged
/// device pipeline (`--mem emulated`: host memory driven as device memory, copies completing
/// late), every row on the staged path: the device all_to_all_v as a user runs it.
#[test]
fn all_to_all_v_with_skewed_blocks_checks_out_over_shm_and_tcp_and_the_emulated_device() {
    for (transport, skew, dtype, api, mem) in [
        ("shm", "1", "int32", "blocking", "host"),
        ("shm", "0.37", "half", "nonblocking", "host"),
        ("tcp", "0.37", "int32", "blocking", "host"),
        ("tcp", "1", "float", "nonblocking", "host"),
        ("shm", "0.37", "float", "blocking", "emulated"),
        ("tcp", "1", "int32", "blocking", "emulated"),
    ] {
        let what = format!("{transport} skew {skew} {dtype} {api} {mem}");
        let (code, text) = bench(&[
            "all_to_all_v",
            "--ranks",
            "3",
            "--mem",
            mem,
            "--transport",
            transport,
            "--skew",
            skew,
            "-d",
            dtype,
            "--api",
            api,
            "-b",
            "8",
            "-e",
            "512K",
            "-f",
            "8",
            "-n",
            "5",
            "-w",
            "2",
        ]);
        assert_eq!(code, Some(0), "{what}:\n{text}");
        assert!(
            text.contains(&format!(
                "# dspark-bench all_to_all_v: 3 ranks, {dtype}, skew {skew}"
            )),
            "{what}: no header naming the skew:\n{text}"
        );
        assert!(
            text.contains("Out of bounds values : 0 OK"),
            "{what}: results not checked OK:\n{text}"
        );
        // 8 B … 512 KiB by 8: seven rows, each showing the collective's algorithm (and on
        // the emulated device, the staged path).
        let path = if mem == "emulated" { " staged" } else { "" };
        let rows = text
            .lines()
            .filter(|l| !l.starts_with('#') && l.contains(" pairwise ") && l.ends_with(path))
            .count();
        assert_eq!(rows, 7, "{what}: rows:\n{text}");
    }
}

/// `--csv` names a skewed run's rows after its skew, so that runs of different skews stay
/// apart in one file.
#[test]
fn all_to_all_v_csv_rows_name_the_skew() {
    let (code, text) = bench(&[
        "all_to_all_v",
        "--ranks",
        "3",
        "--skew",
        "0.5",
        "--csv",
        "-b",
        "4K",
        "-e",
        "4K",
        "-n",
        "5",
        "-w",
        "1",
    ]);
    assert_eq!(code, Some(0), "{text}");
    let row = text
        .lines()
        .find(|l| l.starts_with("all_to_all_v"))
        .unwrap_or_else(|| panic!("no row:\n{text}"));
    assert!(
        row.starts_with("all_to_all_v/skew=0.5,float,none,3,"),
        "{row}"
    );
}

#[test]
fn all_to_all_v_refuses_a_skew_it_cannot_make() {
    for (args, code, why) in [
        (
            &["all_to_all_v", "--skew", "1.5"][..],
            2,
            "not a fraction from 0 to 1",
        ),
        (
            &["all_reduce", "--skew", "0.5"],
            2,
            "--skew is all_to_all_v's",
        ),
        (
            &["all_to_all_v", "--ranks", "2", "--skew", "0.5"],
            1,
            "needs 3 ranks or more",
        ),
    ] {
        let (got, text) = bench(args);
        assert_eq!(got, Some(code), "{args:?}: {text}");
        assert!(text.contains(why), "{args:?}: {text}");
    }
}
