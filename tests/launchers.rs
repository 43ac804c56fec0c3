//! The launcher lines of the README, run as typed: `torchrun --standalone`, torchrun's
//! static rendezvous, Open MPI's `mpirun` and Slurm's `srun` inside an allocation, each
//! starting `dspark-bench` as its ranks. torchrun comes from the torch venv
//! (`bash tests/torch/venv.sh`; `DSPARK_TORCH_PYTHON` names its python), mpirun from
//! Debian's `openmpi-bin`, srun from a one-node Slurm cluster that
//! `tests/slurm/local-cluster.sh` starts (`SLURM_CONF` names it). Without them the tests
//! print why and pass, unless `DSPARK_REQUIRE_TORCH=1` / `DSPARK_REQUIRE_MPI=1` /
//! `DSPARK_REQUIRE_SLURM=1` (as in CI).

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BENCH: &str = env!("CARGO_BIN_EXE_dspark-bench");
/// A bench run that only has to start and say who is where: 8 bytes over shared memory.
const TINY_SHM_RUN: [&str; 10] = [
    "--transport",
    "shm",
    "-b",
    "8",
    "-e",
    "8",
    "-n",
    "5",
    "-w",
    "2",
];

use common::procs::free_port;

fn torchrun() -> Option<PathBuf> {
    let python = std::env::var_os("DSPARK_TORCH_PYTHON")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/dspark/torch-venv/bin/python"))
        })?;
    let t = python.parent()?.join("torchrun");
    if t.exists() {
        return Some(t);
    }
    if std::env::var_os("DSPARK_REQUIRE_TORCH").is_some() {
        panic!(
            "DSPARK_REQUIRE_TORCH is set but {} does not exist",
            t.display()
        );
    }
    eprintln!(
        "SKIP: no torchrun at {} (run bash tests/torch/venv.sh)",
        t.display()
    );
    None
}

fn mpirun() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("mpirun"))
            .find(|c| c.exists())
    });
    if found.is_none() {
        if std::env::var_os("DSPARK_REQUIRE_MPI").is_some() {
            panic!(
                "DSPARK_REQUIRE_MPI is set but mpirun is not on PATH (apt-get install openmpi-bin)"
            );
        }
        eprintln!("SKIP: mpirun not found (apt-get install openmpi-bin)");
    }
    found
}

/// Runs `cmd` with a deadline; returns its stdout+stderr after asserting it succeeded.
fn run(mut cmd: Command, what: &str) -> String {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    // A rank that hangs must not hang the test: dspark's own deadline, then ours.
    cmd.env("DSPARK_TIMEOUT", "60");
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    let start = Instant::now();
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            break;
        }
        if start.elapsed() > Duration::from_secs(150) {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{text}",
        out.status
    );
    text
}

fn bench_args(cmd: &mut Command) {
    cmd.args([
        BENCH,
        "all_reduce",
        "-b",
        "8",
        "-e",
        "1M",
        "-f",
        "32",
        "-n",
        "5",
        "-w",
        "2",
    ]);
}

fn assert_bench_ok(text: &str, ranks: usize, what: &str) {
    assert!(
        text.contains(&format!("# dspark-bench all_reduce: {ranks} ranks")),
        "{what}: no bench header for {ranks} ranks:\n{text}"
    );
    assert!(
        text.contains("Out of bounds values : 0 OK"),
        "{what}: results not checked OK:\n{text}"
    );
}

#[test]
fn torchrun_standalone_runs_dspark_bench_through_the_agent_store() {
    let Some(t) = torchrun() else { return };
    let mut cmd = Command::new(t);
    cmd.args(["--standalone", "--nproc-per-node", "2", "--no-python"]);
    bench_args(&mut cmd);
    let text = run(cmd, "torchrun --standalone");
    assert_bench_ok(&text, 2, "torchrun --standalone");
    assert!(
        text.contains("TORCHELASTIC_USE_AGENT_STORE"),
        "the header should say the rendezvous went through torchrun's agent store:\n{text}"
    );
    // Without a token, rank 0 published a secret in the agent's store (torch's own TCPStore
    // server: compare-and-set, then the secret).
    assert!(
        text.contains("# auth      : secret published in the store"),
        "the header should say the ranks proved the store's secret:\n{text}"
    );
}

#[test]
fn torchrun_static_rendezvous_as_in_the_readme_works() {
    let Some(t) = torchrun() else { return };
    let port = free_port().to_string();
    let mut cmd = Command::new(t);
    cmd.args([
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "static",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port,
        "--no-python",
    ]);
    bench_args(&mut cmd);
    let text = run(cmd, "torchrun static");
    assert_bench_ok(&text, 2, "torchrun static");
}

#[test]
fn mpirun_as_in_the_readme_works() {
    let Some(m) = mpirun() else { return };
    let addr = format!("DSPARK_ROOT_ADDR=127.0.0.1:{}", free_port());
    let mut cmd = Command::new(m);
    cmd.args(["-np", "3", "--oversubscribe", "-x", &addr]);
    if is_root() {
        cmd.arg("--allow-run-as-root");
    }
    bench_args(&mut cmd);
    let text = run(cmd, "mpirun");
    assert_bench_ok(&text, 3, "mpirun");
}

#[test]
fn srun_inside_an_allocation_as_in_the_readme_works() {
    let Some(conf) = std::env::var_os("SLURM_CONF").filter(|c| PathBuf::from(c).exists()) else {
        if std::env::var_os("DSPARK_REQUIRE_SLURM").is_some() {
            panic!("DSPARK_REQUIRE_SLURM is set but SLURM_CONF names no cluster (bash tests/slurm/local-cluster.sh)");
        }
        eprintln!("SKIP: no Slurm cluster (export SLURM_CONF=$(bash tests/slurm/local-cluster.sh | tail -n1))");
        return;
    };
    // The README's two lines, inside an allocation; 3 tasks on this machine's cores need
    // --overcommit.
    let script = format!(
        "export DSPARK_ROOT_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1):{}\n\
         srun --ntasks 3 --overcommit {BENCH} all_reduce -b 8 -e 1M -f 32 -n 5 -w 2\n",
        free_port()
    );
    let mut cmd = Command::new("salloc");
    cmd.env("SLURM_CONF", conf)
        .args(["--ntasks", "3", "--overcommit", "bash", "-c", &script]);
    let text = run(cmd, "salloc + srun");
    assert_bench_ok(&text, 3, "srun");
}

/// Whether this process runs as root (Open MPI refuses to, unless told).
fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    // /proc/self is owned by the process's effective user.
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// `dspark-bench --ranks 2` (its own spawner, bound one core per rank) says in its header how
/// far apart rank 0's and rank 1's CPUs are — a cache line's round trip, measured by the
/// spawner before the ranks start (a VM's host may put two vCPUs on cores sharing a cache or
/// on different dies, and the small shared-memory times follow); without a binding there is
/// no pair of CPUs to measure, and no line.
#[test]
fn the_spawned_benchs_header_says_how_far_apart_its_ranks_cpus_are() {
    let allowed = {
        use nix::sched::{sched_getaffinity, CpuSet};
        let set = sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
        (0..CpuSet::count())
            .filter(|&c| set.is_set(c).unwrap_or(false))
            .count()
    };
    if allowed < 2 {
        eprintln!("SKIP: fewer than 2 CPUs allowed, so 2 ranks are not bound apart");
        return;
    }
    let bench = |bind: &str| {
        let mut cmd = Command::new(BENCH);
        cmd.args(["--ranks", "2", "--bind", bind])
            .args(TINY_SHM_RUN);
        run(cmd, &format!("dspark-bench --ranks 2 --bind {bind}"))
    };
    let text = bench("core");
    assert_bench_ok(&text, 2, "--ranks 2");
    let binding = text
        .lines()
        .find(|l| l.starts_with("# binding   : --bind core: rank 0 cpu "))
        .unwrap_or_else(|| panic!("no binding line:\n{text}"));
    let cpu = |r: usize| {
        let key = format!("rank {r} cpu ");
        let at = binding.find(&key).unwrap() + key.len();
        binding[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .to_string()
    };
    let (c0, c1) = (cpu(0), cpu(1));
    assert_ne!(c0, c1, "{binding}");
    let line = text
        .lines()
        .find(|l| l.starts_with("# distance  : "))
        .unwrap_or_else(|| panic!("no distance line:\n{text}"));
    let want = format!(
        "# distance  : cache-line round trip from rank 0's cpu {c0} (before the ranks started): \
         rank 1 cpu {c1} "
    );
    assert!(line.starts_with(&want), "{line}\nwant {want}");
    let us: f64 = line[want.len()..]
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no time in {line}"));
    assert!(us > 0.0 && us < 1000.0, "{line}");
    assert!(
        line.contains(" µs (near: ") || line.contains(" µs (far: "),
        "{line}"
    );
    let unbound = bench("none");
    assert_bench_ok(&unbound, 2, "--ranks 2 --bind none");
    assert!(!unbound.contains("# distance"), "{unbound}");
}

/// Ranks started by hand (as a launcher does), ranks 0 and 1 on one CPU and rank 2 alone on
/// another (`taskset`): the header rank 0 prints shows every rank's CPU sharing, not its own
/// alone — rank 2 spins without yielding where ranks 0 and 1 yield, and a slow collective is
/// often one rank's crowd.
#[test]
fn the_header_shows_ranks_that_share_their_cpus_unlike_rank_0() {
    use nix::sched::{sched_getaffinity, CpuSet};
    let set = sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
    let cpus: Vec<usize> = (0..CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect();
    if cpus.len() < 2 {
        eprintln!("SKIP: fewer than 2 CPUs allowed, so rank 2 cannot sit apart");
        return;
    }
    if Command::new("taskset").arg("-V").output().is_err() {
        eprintln!("SKIP: no taskset (apt-get install util-linux)");
        return;
    }
    let (a, b) = (cpus[0], cpus[1]);
    let port = free_port();
    let ranks: Vec<_> = (0..3)
        .map(|r| {
            let mut cmd = Command::new("taskset");
            cmd.args(["-c", &(if r == 2 { b } else { a }).to_string(), BENCH])
                .args(TINY_SHM_RUN)
                .env("DSPARK_RANK", r.to_string())
                .env("DSPARK_WORLD_SIZE", "3")
                .env_remove("DSPARK_SPIN_US")
                .env("DSPARK_ROOT_ADDR", format!("127.0.0.1:{port}"));
            std::thread::spawn(move || run(cmd, &format!("rank {r}")))
        })
        .collect();
    let texts: Vec<String> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    let text = &texts[0];
    assert_bench_ok(text, 3, "by hand");
    let line = |start: &str| {
        text.lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no line starting {start:?}:\n{text}"))
    };
    assert!(
        line("# ranks     : 3 on 1 host(s)")
            .contains("; CPU sharing and spin differ between ranks (below);"),
        "{text}"
    );
    // (Under a cgroup CPU quota the words go on with the quota before `; spin`.)
    let shared = line("#   CPU sharing of ranks 0-1 (");
    assert!(
        shared.contains(&format!("): 2 ranks on CPU {a}: oversubscribed")),
        "{shared}"
    );
    assert!(shared.contains("; spin 100 µs yielding"), "{shared}");
    let alone = line("#   CPU sharing of rank 2 (");
    assert!(
        alone.contains(&format!("): no other rank on its CPUs ({b})")),
        "{alone}"
    );
    assert!(alone.contains("; spin "), "{alone}");
    assert!(!alone.contains(" µs yielding"), "{alone}");
    // The others print no header.
    assert!(!texts[1].contains("# ranks"), "{}", texts[1]);
}
