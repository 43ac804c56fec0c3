//! `Communicator::init(Config)` takes every setting from the `Config` it is given and reads no
//! environment (#11 item 6): a child process of this test binary runs with `DSPARK_*`
//! variables that would be refused if anything under `init` read them, and must initialise
//! and run a collective all the same. (`from_env` is where the environment is read.)

use std::process::Command;

use dspark::{Communicator, Config, ReduceOp};

const CHILD: &str = "DSPARK_TEST_CONFIG_ENV_CHILD";

/// The child's body; in a normal test run (no `CHILD` variable) it returns at once.
#[test]
fn child_process() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let comm = Communicator::init(Config::new(0, 1, "")).unwrap_or_else(|e| {
        eprintln!("CHILD-FAILED: init read the environment: {e}");
        std::process::exit(3)
    });
    let mut v = [1.5f32, 2.0, 3.0];
    comm.all_reduce(&mut v, ReduceOp::Sum).unwrap_or_else(|e| {
        eprintln!("CHILD-FAILED: all_reduce: {e}");
        std::process::exit(4)
    });
    assert_eq!(v, [1.5, 2.0, 3.0]);
    println!("CHILD-OK");
}

#[test]
fn init_with_a_config_reads_no_environment() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        // Each of these is out of range: `from_env` refuses it, so a read under `init` fails.
        .env("DSPARK_IB_SLOTS", "1")
        .env("DSPARK_IB_TIMEOUT", "99")
        .env("DSPARK_IB_RETRY_CNT", "8")
        .env("DSPARK_IB_SLOT_BYTES", "junk")
        .env("DSPARK_IB_SPIN_US", "-1")
        .env("DSPARK_IB_ZERO_COPY_MIN", "junk")
        .env("DSPARK_CHUNK_BYTES", "0")
        .env("DSPARK_TRANSPORT", "carrier-pigeon")
        .env("DSPARK_CACHE_DIR", "/proc/nonexistent/cache")
        // A trace file cannot be created there: init would fail if it read this.
        .env("DSPARK_TRACE", "/proc/nonexistent/trace")
        .output()
        .expect("spawn the child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("CHILD-OK"),
        "child: {:?}\n{text}",
        out.status
    );
    // And `from_env` does read them, naming the first bad one.
    let e = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "from_env_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("DSPARK_RANK", "0")
        .env("DSPARK_WORLD_SIZE", "1")
        .env("DSPARK_IB_SLOTS", "1")
        .output()
        .expect("spawn the child");
    let text = String::from_utf8_lossy(&e.stdout);
    assert!(
        text.contains("FROM-ENV-ERR") && text.contains("DSPARK_IB_SLOTS"),
        "{text}"
    );
}

#[test]
fn from_env_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    match Config::from_env() {
        Ok(c) => println!("FROM-ENV-OK {}", c.world_size),
        Err(e) => println!("FROM-ENV-ERR {e}"),
    }
}
