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
/// segments' worth, int32 (exact) and half: every row checked.
#[test]
fn all_to_all_v_with_skewed_blocks_checks_out_over_shm_and_tcp() {
    for (transport, skew, dtype, api) in [
        ("shm", "1", "int32", "blocking"),
        ("shm", "0.37", "half", "nonblocking"),
        ("tcp", "0.37", "int32", "blocking"),
        ("tcp", "1", "float", "nonblocking"),
    ] {
        let what = format!("{transport} skew {skew} {dtype} {api}");
        let (code, text) = bench(&[
            "all_to_all_v",
            "--ranks",
            "3",
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
        // 8 B … 512 KiB by 8: seven rows, each showing the collective's algorithm.
        let rows = text
            .lines()
            .filter(|l| !l.starts_with('#') && l.contains(" pairwise "))
            .count();
        assert_eq!(rows, 7, "{what}: rows:\n{text}");
    }
}

#[test]
fn all_to_all_v_refuses_a_skew_outside_0_to_1_and_device_memory() {
    let (code, text) = bench(&["all_to_all_v", "--skew", "1.5"]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("not a fraction from 0 to 1"), "{text}");
    let (code, text) = bench(&["all_to_all_v", "--mem", "device"]);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("all_to_all_v runs on host memory only"),
        "{text}"
    );
}
