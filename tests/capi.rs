//! The C ABI (`src/capi`, `include/dspark.h`):
//!
//! * the checked-in header is what cbindgen generates from `src/capi/mod.rs` with
//!   `cbindgen.toml` (regenerate it with `DSPARK_BLESS=1 cargo test --test capi header`);
//! * the header compiles as C99 (and as C++ where a C++ compiler is installed) with every
//!   warning an error;
//! * `tests/c/capi_test.c`, which calls every entry point and checks the results against
//!   values computed in C, passes on 3 ranks (separate processes over TCP on 127.0.0.1);
//! * `examples/c/allreduce.c` builds, against the shared and the static library, and runs on
//!   3 ranks.
//!
//! The C programs link against the `libdspark.so` / `libdspark.a` that cargo builds for this
//! test's profile next to it (`target/<profile>/`): the library's crate types include
//! `cdylib` and `staticlib`, so `cargo test` builds them before it runs this test. A C
//! compiler (`cc`) is required; CI installs gcc.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long one multi-rank C run may take before its processes are killed.
const RUN_LIMIT: Duration = Duration::from_secs(120);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The header cbindgen generates from the sources now.
fn generated_header() -> String {
    let root = repo();
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml"))
        .unwrap_or_else(|e| panic!("reading cbindgen.toml: {e}"));
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(root.join("src/capi/mod.rs"))
        .generate()
        .unwrap_or_else(|e| panic!("cbindgen failed on src/capi/mod.rs: {e}"));
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).expect("cbindgen writes UTF-8")
}

#[test]
fn header_is_up_to_date() {
    let path = repo().join("include/dspark.h");
    let fresh = generated_header();
    if std::env::var_os("DSPARK_BLESS").is_some_and(|v| v == "1") {
        // Atomically: the other header test may be compiling it meanwhile.
        let tmp = path.with_extension(format!("h.{}", std::process::id()));
        std::fs::write(&tmp, &fresh).unwrap_or_else(|e| panic!("writing {tmp:?}: {e}"));
        std::fs::rename(&tmp, &path).unwrap_or_else(|e| panic!("writing {path:?}: {e}"));
        eprintln!("wrote {}", path.display());
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if checked_in != fresh {
        let first = checked_in
            .lines()
            .zip(fresh.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(checked_in.lines().count().min(fresh.lines().count()));
        panic!(
            "include/dspark.h is stale: it differs from what cbindgen generates from \
             src/capi/mod.rs (first at line {}).\n\
             Regenerate it with:  DSPARK_BLESS=1 cargo test --test capi header\n\
             and commit the result.",
            first + 1
        );
    }
}

/// The C compiler, or a clear failure.
fn cc() -> String {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    match Command::new(&cc).arg("--version").output() {
        Ok(o) if o.status.success() => cc,
        _ => panic!(
            "no C compiler: `{cc} --version` failed. The C ABI tests need one: install gcc \
             (apt-get install gcc) or set CC."
        ),
    }
}

/// Runs a compiler command, failing with its output.
fn compile(cmd: &mut Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {cmd:?}\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn header_compiles_as_c99_and_cxx() {
    let cc = cc();
    let dir = scratch().join("header");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let src = dir.join("use.c");
    std::fs::write(
        &src,
        "#include <dspark.h>\n#include <dspark.h>\n\
         int main(void) { dspark_dtype_t t = DSPARK_BF16; dspark_op_t o = DSPARK_AVG;\n\
         dspark_result_t r = DSPARK_ERR_INTERNAL; dspark_comm_t *c = 0; dspark_work_t *w = 0;\n\
         (void)c; (void)w; return (int)t + (int)o + (int)r - 16; }\n",
    )
    .expect("write use.c");
    let include = repo().join("include");
    for std in ["-std=c99", "-std=c11"] {
        compile(
            Command::new(&cc)
                .args([
                    std,
                    "-Wall",
                    "-Wextra",
                    "-Werror",
                    "-pedantic",
                    "-fsyntax-only",
                ])
                .arg("-I")
                .arg(&include)
                .arg(&src),
            &format!("compiling include/dspark.h as C ({std})"),
        );
    }
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    if Command::new(&cxx)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        compile(
            Command::new(&cxx)
                .args([
                    "-x",
                    "c++",
                    "-std=c++11",
                    "-Wall",
                    "-Wextra",
                    "-Werror",
                    "-fsyntax-only",
                ])
                .arg("-I")
                .arg(&include)
                .arg(&src),
            "compiling include/dspark.h as C++",
        );
    } else {
        eprintln!("note: no C++ compiler ({cxx}); the header's C++ guards were not compiled");
    }
}

/// This test's scratch directory: `target/tmp/capi-<profile>` (`target/tmp` is shared by
/// every profile).
fn scratch() -> PathBuf {
    let exe = std::env::current_exe().expect("own executable");
    let profile = exe
        .parent()
        .and_then(Path::parent)
        .and_then(Path::file_name)
        .map_or("unknown".into(), |n| n.to_string_lossy().into_owned());
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("capi-{profile}"))
}

/// A directory holding only this profile's `libdspark.so` and `libdspark.a`, fresh.
///
/// Cargo builds the library for this test with every crate type of `[lib]` in one rustc
/// run, writing `libdspark.so` and `libdspark.a` into `target/<profile>/deps/` next to the
/// rlib this test links (it copies them up to `target/<profile>/` only for `cargo build`).
/// Those are the ones to use: the copies in `target/<profile>/` may be older. They are
/// copied into a directory of their own so that `-L` finds nothing else.
fn lib_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(copy_libs).clone()
}

fn copy_libs() -> PathBuf {
    let exe = std::env::current_exe().expect("own executable");
    // target/<profile>/deps/capi-<hash>
    let deps = exe
        .parent()
        .expect("test binary in target/<profile>/deps")
        .to_path_buf();
    let profile = deps.parent().unwrap_or(&deps).to_path_buf();
    let out = scratch().join("lib");
    std::fs::create_dir_all(&out).expect("temp dir");
    for lib in ["libdspark.so", "libdspark.a"] {
        let src = [deps.join(lib), profile.join(lib)]
            .into_iter()
            .find(|p| p.is_file())
            .unwrap_or_else(|| {
                panic!(
                    "{lib} is neither in {} nor in {}: cargo builds it with the library \
                     (crate-type cdylib and staticlib in Cargo.toml's [lib]); build it with \
                     `cargo build --lib` for this profile",
                    deps.display(),
                    profile.display()
                )
            });
        // Replace, never overwrite in place: a rank of another test run may have it mapped.
        let tmp = out.join(format!("{lib}.{}", std::process::id()));
        std::fs::copy(&src, &tmp).unwrap_or_else(|e| panic!("copying {src:?}: {e}"));
        std::fs::rename(&tmp, out.join(lib)).unwrap_or_else(|e| panic!("renaming {tmp:?}: {e}"));
    }
    out
}

/// Compiles the C program `src` into `name`, dynamically (with an rpath) or statically.
fn build_c(src: &str, name: &str, link_static: bool) -> PathBuf {
    let cc = cc();
    let lib = lib_dir();
    let out = scratch().join("bin");
    std::fs::create_dir_all(&out).expect("temp dir");
    let exe = out.join(name);
    let mut cmd = Command::new(cc);
    cmd.args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-O1", "-g"])
        .arg("-I")
        .arg(repo().join("include"))
        .arg(repo().join(src))
        .arg("-o")
        .arg(&exe);
    if link_static {
        cmd.arg(lib.join("libdspark.a"))
            .args(["-lpthread", "-ldl", "-lm"]);
    } else {
        cmd.arg("-L")
            .arg(&lib)
            .arg("-ldspark")
            .arg(format!("-Wl,-rpath,{}", lib.display()))
            .args(["-pthread", "-lm"]);
    }
    compile(&mut cmd, &format!("building {src}"));
    exe
}

#[allow(dead_code)]
#[path = "common/procs.rs"]
mod procs;
use procs::free_port;

/// How one rank process ended.
struct Outcome {
    code: Option<i32>,
    out: String,
}

/// Collects a child's stdout and stderr on threads (so that a chatty rank never blocks on
/// a full pipe).
fn drain(child: &mut Child) -> Vec<std::thread::JoinHandle<String>> {
    let mut hs = Vec::new();
    if let Some(mut o) = child.stdout.take() {
        hs.push(std::thread::spawn(move || {
            let mut s = String::new();
            let _ = o.read_to_string(&mut s);
            s
        }));
    }
    if let Some(mut e) = child.stderr.take() {
        hs.push(std::thread::spawn(move || {
            let mut s = String::new();
            let _ = e.read_to_string(&mut s);
            s
        }));
    }
    hs
}

/// Runs `exe` as `world` ranks meeting on a fresh port; kills them all after `RUN_LIMIT`.
fn run_ranks(exe: &Path, world: usize) -> Vec<Outcome> {
    run_ranks_with(exe, world, &[])
}

/// [`run_ranks`] with `env` set for every rank.
fn run_ranks_with(exe: &Path, world: usize, env: &[(&str, &str)]) -> Vec<Outcome> {
    let port = free_port();
    let lib = lib_dir();
    let mut children: Vec<(Child, Vec<std::thread::JoinHandle<String>>)> = (0..world)
        .map(|r| {
            let mut child = Command::new(exe)
                .env("DSPARK_RANK", r.to_string())
                .env("DSPARK_WORLD_SIZE", world.to_string())
                .env("DSPARK_ROOT_ADDR", format!("127.0.0.1:{port}"))
                .env("DSPARK_TIMEOUT", "60")
                .env("LD_LIBRARY_PATH", &lib)
                .env_remove("RUST_LOG")
                .env_remove("DSPARK_NODE")
                .env_remove("DSPARK_LOG")
                .envs(env.iter().copied())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("starting {}: {e}", exe.display()));
            let hs = drain(&mut child);
            (child, hs)
        })
        .collect();
    let t0 = Instant::now();
    let mut codes: Vec<Option<Option<i32>>> = vec![None; world];
    while codes.iter().any(Option::is_none) {
        for (i, (c, _)) in children.iter_mut().enumerate() {
            if codes[i].is_none() {
                if let Ok(Some(st)) = c.try_wait() {
                    codes[i] = Some(st.code());
                }
            }
        }
        if t0.elapsed() > RUN_LIMIT {
            for (i, (c, _)) in children.iter_mut().enumerate() {
                if codes[i].is_none() {
                    let _ = c.kill();
                    let _ = c.wait();
                    codes[i] = Some(None);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    children
        .into_iter()
        .zip(codes)
        .map(|((_, hs), code)| Outcome {
            code: code.flatten(),
            out: hs
                .into_iter()
                .map(|h| h.join().unwrap_or_default())
                .collect(),
        })
        .collect()
}

/// Asserts every rank exited 0, and printed a line `N passed, 0 failed` with N > 0 when
/// `summary` is set.
fn assert_ranks_passed(outs: &[Outcome], what: &str, summary: bool) {
    for (r, o) in outs.iter().enumerate() {
        let line = o
            .out
            .lines()
            .find(|l| l.ends_with(" failed") && l.contains(" passed, "));
        assert!(
            o.code == Some(0),
            "{what}: rank {r} exited {} (limit {RUN_LIMIT:?}):\n{}",
            o.code
                .map_or("killed or by a signal".into(), |c| c.to_string()),
            o.out
        );
        if summary {
            let ok = line.is_some_and(|l| {
                l.ends_with(", 0 failed")
                    && l.split(' ')
                        .next()
                        .and_then(|n| n.parse::<u32>().ok())
                        .is_some_and(|n| n > 0)
            });
            assert!(
                ok,
                "{what}: rank {r} printed no `N passed, 0 failed`:\n{}",
                o.out
            );
        }
    }
}

#[test]
fn c_test_of_every_entry_point_on_three_ranks() {
    let exe = build_c("tests/c/capi_test.c", "capi_test", false);
    let outs = run_ranks(&exe, 3);
    assert_ranks_passed(&outs, "tests/c/capi_test.c", true);
    for (r, o) in outs.iter().enumerate() {
        let summary = o.out.lines().rfind(|l| l.contains(" passed, "));
        eprintln!("capi_test.c rank {r}: {}", summary.unwrap_or(""));
    }
}

/// The C ABI from an `atexit` handler (`tests/c/atexit.c`, 2 ranks): a wait, a free and a
/// destroy there once aborted the process (this thread's locals are gone by then).
#[test]
fn the_c_abi_works_from_an_atexit_handler() {
    let exe = build_c("tests/c/atexit.c", "atexit", false);
    let outs = run_ranks(&exe, 2);
    assert_ranks_passed(&outs, "tests/c/atexit.c", true);
}

/// A bounded wait from C (`tests/c/wait_timeout.c`, 2 ranks, rank 1 joining 1.5 s late):
/// `dspark_work_wait_timeout` gives up with `DSPARK_ERR_TIMEOUT` and the operation's
/// whereabouts, leaves the handle in flight, and completes it on a later wait;
/// `dspark_work_whereabouts` says the same, and nothing once the operation is complete.
#[test]
fn a_bounded_wait_from_c_times_out_says_where_and_completes_later() {
    let exe = build_c("tests/c/wait_timeout.c", "wait_timeout", false);
    let outs = run_ranks(&exe, 2);
    assert_ranks_passed(&outs, "tests/c/wait_timeout.c", true);
}

/// The other `DSPARK_ERR_TIMEOUT` of a bounded wait (`tests/c/wait_timeout.c`, case
/// `own_deadline`): the operation fails by its own deadline (`DSPARK_TIMEOUT=1`, the peer 3 s
/// late) inside a 30 s wait. Same code, but complete: `dspark_work_test` says done, so the
/// caller knows its buffers are free again.
#[test]
fn a_bounded_wait_on_an_operation_past_its_own_deadline_reports_it_complete() {
    let exe = build_c("tests/c/wait_timeout.c", "wait_timeout_own", false);
    let env = [
        ("WAIT_TIMEOUT_CASE", "own_deadline"),
        ("DSPARK_TIMEOUT", "1"),
    ];
    let outs = run_ranks_with(&exe, 2, &env);
    assert_ranks_passed(&outs, "tests/c/wait_timeout.c own_deadline", true);
}

/// dspark's warnings reach a C program's stderr, and `DSPARK_LOG=off` silences them: with
/// `DSPARK_ALGO=pairwise` (which all_reduce and broadcast do not implement) over TCP, each
/// rank warns for `tests/c/atexit.c`'s all_reduce and again for its broadcast, which runs in
/// an `atexit` handler (the thread's locals gone: a printer that kept its buffer in one
/// failed the call there). A C program has no tracing subscriber: before, every degraded path
/// went unseen there.
#[test]
fn warnings_reach_a_c_programs_stderr_and_dspark_log_filters_them() {
    // A name of its own: the atexit test builds and runs the same source at the same time.
    let exe = build_c("tests/c/atexit.c", "atexit_log", false);
    for log in ["warn", "off"] {
        let env = [
            ("DSPARK_ALGO", "pairwise"),
            ("DSPARK_TRANSPORT", "tcp"),
            ("DSPARK_LOG", log),
        ];
        let outs = run_ranks_with(&exe, 2, &env);
        assert_ranks_passed(&outs, "tests/c/atexit.c with DSPARK_ALGO=pairwise", true);
        for (r, o) in outs.iter().enumerate() {
            for coll in ["all_reduce", "broadcast"] {
                let warning = format!("does not implement {coll}");
                let warned = o.out.contains(&warning);
                assert_eq!(
                    warned,
                    log == "warn",
                    "rank {r}, DSPARK_LOG={log}: warning `{warning}` shown: {warned}\n{}",
                    o.out
                );
            }
        }
    }
}

#[test]
fn c_example_builds_and_runs_on_three_ranks() {
    for link_static in [false, true] {
        let name = if link_static {
            "allreduce_static"
        } else {
            "allreduce"
        };
        let exe = build_c("examples/c/allreduce.c", name, link_static);
        let outs = run_ranks(&exe, 3);
        assert_ranks_passed(&outs, name, false);
        for (r, o) in outs.iter().enumerate() {
            assert!(
                o.out.contains("allreduce ok"),
                "{name}: rank {r} did not report its result:\n{}",
                o.out
            );
        }
    }
}

/// Issue 22: absurd world sizes (0, 2^32 + 2, 2^40, `usize::MAX`) through the C ABI are a
/// `DSPARK_ERR_CONFIG` that names `DSPARK_WORLD_SIZE`, returned at once: the process neither
/// aborts on a huge allocation nor truncates the size to 32 bits and waits for ranks.
#[test]
fn absurd_world_sizes_through_the_c_abi_are_a_config_error_within_a_second() {
    let exe = build_c("tests/c/limits.c", "limits", false);
    let port = free_port();
    for world in ["0", "4294967298", "1099511627776", &usize::MAX.to_string()] {
        let t0 = Instant::now();
        let out = Command::new(&exe)
            .env("DSPARK_RANK", "0")
            .env("DSPARK_WORLD_SIZE", world)
            .env("DSPARK_ROOT_ADDR", format!("127.0.0.1:{port}"))
            .env("DSPARK_TIMEOUT", "3")
            .output()
            .expect("running tests/c/limits.c");
        let took = t0.elapsed();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(0),
            "DSPARK_WORLD_SIZE={world}: not a config error naming the variable: {text}"
        );
        assert!(
            took < Duration::from_secs(1),
            "DSPARK_WORLD_SIZE={world}: took {took:?}: {text}"
        );
    }
}

/// Issue 24: `dspark_comm_shrink` on 3 ranks (tests/c/shrink.c): rank 2 kills itself, the
/// others shrink without it (`DSPARK_SHRINK_DEFAULT`), check the new communicator, and shrink
/// that one again with `DSPARK_SHRINK_ABORT`; the argument errors are local.
#[test]
fn c_shrink_after_a_killed_rank_and_with_shrink_abort() {
    let exe = build_c("tests/c/shrink.c", "shrink", false);
    let outs = run_ranks(&exe, 3);
    assert_eq!(
        outs[2].code, None,
        "tests/c/shrink.c: rank 2 should have died by SIGKILL:\n{}",
        outs[2].out
    );
    assert_ranks_passed(&outs[..2], "tests/c/shrink.c", true);
}
