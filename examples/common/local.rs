//! Shared by the examples: run as one rank of a launcher (torchrun, mpirun, srun, or
//! DSPARK_RANK/DSPARK_WORLD_SIZE/DSPARK_ROOT_ADDR set by hand), or, with none of those set,
//! start `DSPARK_EXAMPLE_RANKS` (default 2) local ranks of this same program on 127.0.0.1,
//! the way `dspark-bench --ranks N` does, with a random token per job (unless one is set) so
//! that nobody else who reaches the port can join.

use std::process::Command;

/// `true` in a rank process; `false` in the parent, after all its local ranks exited
/// successfully (it exits with the first failing rank's status otherwise).
pub(crate) fn as_rank() -> bool {
    let launched = [
        "DSPARK_RANK",
        "RANK",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some());
    if launched {
        return true;
    }
    let n: usize = std::env::var("DSPARK_EXAMPLE_RANKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1");
    let exe = std::env::current_exe().expect("the path of this program");
    // A secret only these ranks know (a process's environment is readable by its own user
    // only): 32 random bytes, in hex.
    let has_token = ["DSPARK_JOB_TOKEN", "DSPARK_JOB_TOKEN_FILE"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|t| !t.is_empty()));
    let token = (!has_token).then(|| {
        use std::io::Read;
        let mut b = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut b))
            .expect("random bytes from /dev/urandom");
        b.iter().map(|x| format!("{x:02x}")).collect::<String>()
    });
    let children: Vec<_> = (0..n)
        .map(|r| {
            let mut cmd = Command::new(&exe);
            if let Some(t) = &token {
                cmd.env("DSPARK_JOB_TOKEN", t);
            }
            cmd.args(std::env::args_os().skip(1))
                .env("DSPARK_RANK", r.to_string())
                .env("DSPARK_WORLD_SIZE", n.to_string())
                .env("DSPARK_ROOT_ADDR", format!("127.0.0.1:{port}"))
                .spawn()
                .expect("starting a local rank")
        })
        .collect();
    for (r, mut c) in children.into_iter().enumerate() {
        let st = c.wait().expect("waiting for a local rank");
        if !st.success() {
            eprintln!("rank {r} failed: {st}");
            std::process::exit(st.code().unwrap_or(1));
        }
    }
    false
}
