//! `dspark-bench` as a user types it, where a collective of its own needs more than the
//! launcher tests' all_reduce: all_to_all_v with blocks skewed between every pair, over
//! shared memory and TCP, blocking and non-blocking, every result checked by the bench
//! against the blocks each sender's counts say it sent (`Out of bounds values : 0 OK`), and
//! the arguments it refuses.

#[path = "common/bench.rs"]
mod bench;
#[allow(dead_code)]
#[path = "common/procs.rs"]
mod procs;
use bench::bench_cmd;

/// Runs the bench with `args`; returns its exit code and its output, both streams.
fn bench(args: &[&str]) -> (Option<i32>, String) {
    bench_with(args, &[])
}

/// [`bench`] with `env` set as well.
fn bench_with(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let out = bench_cmd()
        .args(args)
        // A rank that hangs fails its run at this deadline instead of hanging the test.
        .env("DSPARK_TIMEOUT", "60")
        .envs(env.iter().copied())
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

/// Combinations that would measure something other than what they name are refused before
/// any rank starts, saying why: each of these ran before and printed numbers of another
/// case (the blocking device calls under "api: non-blocking", host all_reduce f32 rows for
/// all_gather or the GPU, an empty send_recv read as 10^7 GB/s).
#[test]
fn combinations_that_would_measure_another_thing_are_refused() {
    for (args, why) in [
        (
            &["all_reduce", "--mem", "emulated", "--api", "nonblocking"][..],
            "--api nonblocking times host buffers only",
        ),
        (
            &["all_reduce", "--mem", "device", "--api", "nonblocking"],
            "--api nonblocking times host buffers only",
        ),
        (
            &["all_gather", "--peer-rows", "x"],
            "cannot take a collective other than all_reduce",
        ),
        (
            &["--mem", "device", "--peer-rows", "x"],
            "cannot take device or emulated memory",
        ),
        (&["-d", "half", "--peer-rows", "x"], "a data type other"),
        (&["--algo", "all", "--peer-rows", "x"], "--algo all"),
        (
            &["send_recv", "--ranks", "1"],
            "send_recv needs 2 ranks or more",
        ),
    ] {
        let (got, text) = bench(args);
        assert_eq!(got, Some(2), "{args:?}: {text}");
        assert!(text.contains(why), "{args:?}: {text}");
        assert!(!text.contains("panicked"), "{args:?}: {text}");
    }
}

/// A size range or an iteration count under which nothing would be measured is refused,
/// saying which flag (a swapped range printed an empty table with a garbled header and
/// exited 0; `-n 0` timed one unwarmed call per size under "0 iterations"), and so is a flag
/// that `--peer-rows` or `--sizes` would ignore (`--peer-rows x -b 8 -e 4K` timed 8 B to
/// 256 MiB).
#[test]
fn ranges_and_counts_that_measure_nothing_or_would_be_ignored_are_refused() {
    for (args, why) in [
        (
            &["--ranks", "2", "-b", "1M", "-e", "8"][..],
            "-b 1M is larger than -e 8: no size to measure",
        ),
        (&["-b", "64K", "-e", "1K"], "-b 64K is larger than -e 1K"),
        (&["--ranks", "2", "-n", "0"], "-n 0 times no call"),
        (
            &["--ranks", "2", "-f", "1"],
            "the step factor is a whole number of 2 or more",
        ),
        (
            &["--ranks", "2", "--peer-rows", "x", "-b", "9", "-e", "1000"],
            "none of theirs (8, 1K, 64K, 1M, 16M, 64M, 256M) lies between -b 9 and -e 1000",
        ),
        (
            &["--ranks", "2", "--peer-rows", "x", "-f", "2"],
            "'--peer-rows <NAME>' cannot be used with '--stepfactor",
        ),
        (
            &["--ranks", "2", "--peer-rows", "x", "-n", "5"],
            "cannot be used with '--iters",
        ),
        (
            &["--ranks", "2", "--peer-rows", "x", "-w", "0"],
            "cannot be used with '--warmup_iters",
        ),
        (
            &["--ranks", "2", "--sizes", "8,64", "-e", "1K"],
            "'--sizes <SIZES>' cannot be used with '--maxbytes",
        ),
    ] {
        let (got, text) = bench(args);
        assert_eq!(got, Some(2), "{args:?}: {text}");
        assert!(text.contains(why), "{args:?}: {text}");
        assert!(!text.contains("panicked"), "{args:?}: {text}");
    }
    // No warm-up is a run like any other.
    let (got, text) = bench(&["--ranks", "2", "-b", "8", "-e", "8", "-w", "0", "-n", "3"]);
    assert_eq!(got, Some(0), "{text}");
    // Over shared memory 8 B runs one-shot, which the cost model does not predict (it said
    // 1.5 µs of a 0.29 µs call): no number for it.
    if text.contains("one_shot") {
        assert!(
            text.contains("# predicted : µs, 8 B - (-: one_shot, outside the cost model)"),
            "{text}"
        );
    }
    assert!(
        text.contains("3 iterations timed in 3 windows, 0 warm-up"),
        "{text}"
    );
}

/// `--peer-rows` times the peers' sizes from `-b` to `-e` (it ignored them and timed all
/// seven, up to 256 MiB).
#[test]
fn peer_rows_take_the_peers_sizes_from_b_to_e() {
    let (code, text) = bench(&["--ranks", "2", "--peer-rows", "x", "-b", "8", "-e", "4K"]);
    assert_eq!(code, Some(0), "{text}");
    let sizes: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("x,"))
        .filter_map(|l| l.split(',').nth(2))
        .collect();
    assert_eq!(sizes, ["8", "1024"], "{text}");
}

/// Under a launcher, each process is one rank: `--ranks` there would make every rank spawn a
/// job of its own (`mpirun -np 2 dspark-bench --ranks 2` ran two unrelated 2-rank jobs), so
/// it is refused, naming the launcher's variables; a launcher's job of one rank may spawn.
#[test]
fn ranks_under_a_launcher_are_refused() {
    let run = |env: &[(&str, &str)]| {
        bench_with(
            &["--ranks", "2", "-b", "8", "-e", "8", "-n", "3", "-w", "1"],
            env,
        )
    };
    for (env, names) in [
        (
            &[
                ("OMPI_COMM_WORLD_RANK", "1"),
                ("OMPI_COMM_WORLD_SIZE", "2"),
                ("DSPARK_ROOT_ADDR", "127.0.0.1:29561"),
            ][..],
            "OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2",
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
            ],
            "RANK=0, WORLD_SIZE=2",
        ),
        (
            &[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "4"),
                ("SLURM_STEP_ID", "0"),
            ],
            "SLURM_PROCID=0, SLURM_NTASKS=4",
        ),
    ] {
        let (code, text) = run(env);
        assert_eq!(code, Some(2), "{env:?}: {text}");
        assert!(
            text.contains(&format!(
                "--ranks 2: a launcher started this process as one of its ranks ({names})"
            )),
            "{env:?}: {text}"
        );
        assert!(!text.contains("# dspark-bench"), "{env:?}: {text}");
    }
    // srun -n 1 (and a batch script's SLURM_PROCID=0 outside any step): the spawner's job.
    for env in [
        &[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_STEP_ID", "0"),
        ][..],
        &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "3")],
    ] {
        let (code, text) = run(env);
        assert_eq!(code, Some(0), "{env:?}: {text}");
        assert!(
            text.contains("# dspark-bench all_reduce: 2 ranks"),
            "{text}"
        );
    }
}

/// The header's rendezvous line of the ranks the bench spawns names the spawner, which
/// picked the address and set DSPARK_ROOT_ADDR over the user's, not the user's variable.
#[test]
fn the_rendezvous_line_of_spawned_ranks_names_the_spawner() {
    let out = bench_cmd()
        .args(["--ranks", "2", "-b", "8", "-e", "8", "-n", "3", "-w", "1"])
        .env("DSPARK_TIMEOUT", "60")
        .env("DSPARK_ROOT_ADDR", "127.0.0.1:1")
        .output()
        .expect("dspark-bench starts");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let line = text
        .lines()
        .find(|l| l.starts_with("# rendezvous:"))
        .unwrap_or_else(|| panic!("no rendezvous line: {text}"));
    assert!(
        line.starts_with("# rendezvous: rank 0 at 127.0.0.1:")
            && line.ends_with(" from dspark-bench's spawner (a free port it picked)")
            && !line.contains("127.0.0.1:1 "),
        "{line}"
    );
}

/// `--peer-rows` skips sizes under one float as the peers do (a size of 0 divided by zero
/// on every rank), and runs the rest.
#[test]
fn peer_rows_skip_a_size_under_one_element() {
    let (code, text) = bench(&["--ranks", "2", "--peer-rows", "x", "--sizes", "0,3,8"]);
    assert_eq!(code, Some(0), "{text}");
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("x,")).collect();
    assert_eq!(rows.len(), 1, "{text}");
    assert!(rows[0].starts_with("x,2,8,"), "{text}");
}

/// `--algo all --csv` is CSV: the header, then every algorithm's rows named in the collective
/// column, and nothing else on stdout (it printed the human tables).
#[test]
fn algo_all_with_csv_prints_a_row_per_algorithm_and_size() {
    let out = bench_cmd()
        .args([
            "all_reduce",
            "--ranks",
            "2",
            "--algo",
            "all",
            "--csv",
            "-b",
            "8",
            "-e",
            "1K",
            "-f",
            "32",
            "-n",
            "5",
            "-w",
            "1",
        ])
        .env("DSPARK_TIMEOUT", "60")
        .output()
        .expect("dspark-bench starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let all = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{all}");
    let mut lines = stdout.lines();
    let head = lines.next().unwrap_or_default();
    assert!(
        head.starts_with("collective,dtype,op,ranks,bytes,"),
        "{all}"
    );
    let rows: Vec<&str> = lines.collect();
    let width = head.split(',').count();
    assert!(rows.iter().all(|r| r.split(',').count() == width), "{all}");
    for algo in ["ring", "recursive_doubling"] {
        let of: Vec<&&str> = rows
            .iter()
            .filter(|r| r.starts_with(&format!("all_reduce/algo={algo},float,sum,2,")))
            .collect();
        // 8 B, 256 B (-f 32) and the largest, 1 KiB, each checked: wrong column 0.
        assert_eq!(of.len(), 3, "{algo}: {all}");
        assert!(of.iter().all(|r| r.split(',').nth(9) == Some("0")), "{all}");
    }
}

/// A flag given beats the environment and the environment beats the default, in the ranks
/// the bench spawns as in a launcher's (the spawned ranks had every variable overwritten
/// with the flags' defaults: DSPARK_TRANSPORT=tcp ran shared memory).
#[test]
fn the_transport_flag_beats_the_environment_which_beats_the_default() {
    for (env, flag, want) in [
        (Some("tcp"), None, "tcp"),
        (Some("tcp"), Some("shm"), "shm"),
        (None, Some("tcp"), "tcp"),
    ] {
        let mut cmd = bench_cmd();
        cmd.args(["--ranks", "2", "-b", "8", "-e", "8", "-n", "5", "-w", "1"])
            .env("DSPARK_TIMEOUT", "60")
            .env_remove("DSPARK_TRANSPORT");
        if let Some(t) = flag {
            cmd.args(["--transport", t]);
        }
        if let Some(t) = env {
            cmd.env("DSPARK_TRANSPORT", t);
        }
        let out = cmd.output().expect("dspark-bench starts");
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{text}");
        let row = text
            .lines()
            .find(|l| !l.starts_with('#') && l.contains(" 8 "))
            .unwrap_or_else(|| panic!("no row: {text}"));
        assert!(
            row.split_whitespace().nth(10) == Some(want),
            "env {env:?} flag {flag:?}: {row}\n{text}"
        );
    }
}

/// Under a launcher (ranks started by hand, as torchrun or srun start them) the same rule: a
/// flag given beats DSPARK_TRANSPORT, which beats the default (the launcher's ranks let the
/// variable win over the flag).
#[test]
fn under_a_launcher_the_transport_flag_beats_the_environment_too() {
    for (flag, want) in [(Some("shm"), "shm"), (None, "tcp")] {
        let port = procs::free_port();
        let children: Vec<_> = (0..2)
            .map(|r| {
                let mut cmd = bench_cmd();
                cmd.args(["-b", "8", "-e", "8", "-n", "5", "-w", "1"])
                    .env("DSPARK_TIMEOUT", "60")
                    .env("DSPARK_RANK", r.to_string())
                    .env("DSPARK_WORLD_SIZE", "2")
                    .env("DSPARK_ROOT_ADDR", format!("127.0.0.1:{port}"))
                    .env("DSPARK_JOB_TOKEN", "bench-cli-launcher-test")
                    .env("DSPARK_TRANSPORT", "tcp")
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped());
                if let Some(t) = flag {
                    cmd.args(["--transport", t]);
                }
                cmd.spawn().expect("dspark-bench starts")
            })
            .collect();
        let outs: Vec<_> = children
            .into_iter()
            .map(|c| c.wait_with_output().expect("rank ends"))
            .collect();
        let text = String::from_utf8_lossy(&outs[0].stdout).to_string();
        for (r, o) in outs.iter().enumerate() {
            assert!(
                o.status.success(),
                "flag {flag:?} rank {r}: {}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        let row = text
            .lines()
            .find(|l| !l.starts_with('#') && l.contains(" 8 "))
            .unwrap_or_else(|| panic!("no row: {text}"));
        assert_eq!(
            row.split_whitespace().nth(10),
            Some(want),
            "flag {flag:?}: {row}\n{text}"
        );
    }
}
