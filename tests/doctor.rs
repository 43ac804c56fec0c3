//! `dspark doctor` runs cleanly on a machine without GPU or RDMA, says why each fast path is
//! unavailable and what to do, prints JSON that parses, fails `--require gpu-direct` with a
//! reason, and reads a fake sysfs tree (`--root`) the way it reads the real one.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn doctor(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dspark"));
    c.arg("doctor").args(args);
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().expect("run dspark")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

struct Tree(PathBuf);

impl Tree {
    fn new(tag: &str) -> Tree {
        let p = std::env::temp_dir().join(format!("dspark-doctor-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Tree(p)
    }
    fn write(&self, rel: &str, content: &str) {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content).unwrap();
    }
    fn link(&self, rel: &str, target: &str) {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(target, p).unwrap();
    }
    fn root(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn libcuda_here() -> bool {
    dspark::internals::gpu::libcuda_present()
}

#[test]
fn doctor_exits_zero_and_names_why_each_fast_path_is_unavailable_and_the_fix() {
    let o = doctor(&[], &[]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "exit {:?}\n{out}\n{err}", o.status);
    for section in [
        "RDMA (verbs)",
        "Locked memory",
        "CUDA",
        "nvidia-peermem",
        "NVRTC",
        "GPU <-> NIC",
        "Fast paths",
    ] {
        assert!(out.contains(section), "missing section {section}:\n{out}");
    }
    let fast: Vec<&str> = out
        .lines()
        .skip_while(|l| *l != "Fast paths")
        .skip(1)
        .take_while(|l| !l.is_empty())
        .collect();
    let names = [
        "RDMA verbs transport",
        "locked memory",
        "CUDA GPUs",
        "GPUDirect RDMA via dma-buf",
        "GPUDirect RDMA via nvidia-peermem",
        "GPU reduction kernels (NVRTC)",
    ];
    for name in names {
        let i = fast
            .iter()
            .position(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("{name} not listed:\n{out}"));
        let line = fast[i];
        assert!(
            line.contains(" OK: ") || line.contains(" UNAVAILABLE: "),
            "{line}"
        );
        if line.contains("UNAVAILABLE: ") {
            let reason = line.split("UNAVAILABLE: ").nth(1).unwrap();
            assert!(reason.len() > 10, "a reason is given: {line}");
            assert!(
                fast.get(i + 1)
                    .is_some_and(|l| l.trim_start().starts_with("-> ")),
                "a fix follows {line}"
            );
        }
    }
    assert!(
        out.contains("over TCP") && out.contains("staged through pinned host memory"),
        "{out}"
    );
    if !libcuda_here() {
        let cuda = fast.iter().find(|l| l.contains("CUDA GPUs")).unwrap();
        assert!(
            cuda.contains("UNAVAILABLE") && cuda.contains("libcuda"),
            "{cuda}"
        );
        let gdr = fast.iter().find(|l| l.contains("via dma-buf")).unwrap();
        assert!(gdr.contains("UNAVAILABLE"), "{gdr}");
    }
}

#[test]
fn json_report_parses_and_every_unavailable_fast_path_has_a_reason_and_a_fix() {
    let o = doctor(&["--json"], &[]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}):\n{out}"));
    for key in [
        "rdma",
        "memlock",
        "cuda",
        "peermem",
        "nvrtc",
        "pairs",
        "fast_paths",
        "tcp_device_path",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    let fast = v["fast_paths"].as_array().unwrap();
    assert_eq!(fast.len(), 6);
    for f in fast {
        assert!(
            f["name"].is_string() && f["ok"].is_boolean() && f["detail"].is_string(),
            "{f}"
        );
        if f["ok"] == false {
            assert!(!f["detail"].as_str().unwrap().is_empty());
            assert!(!f["fixes"].as_array().unwrap().is_empty(), "{f}");
        }
    }
    assert_eq!(v["peermem"]["checked"].as_array().unwrap().len(), 3);
    assert_eq!(v["cuda"]["libcuda_loadable"], libcuda_here());
}

#[test]
fn require_gpu_direct_fails_with_the_reason_where_it_is_unavailable() {
    // An empty root has no RDMA device, so GPUDirect is impossible whatever this machine has.
    let t = Tree::new("empty");
    let o = doctor(&["--root", t.root(), "--require", "gpu-direct"], &[]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
    assert!(err.contains("requirement gpu-direct not met"), "{err}");
    assert!(
        err.contains("no RDMA device") && err.contains("libibverbs.so.1 is not installed"),
        "every reason is named: {err}"
    );
    assert!(out.contains("require gpu-direct: NOT MET"), "{out}");

    // Requirements that hold do not fail the run.
    let o = doctor(
        &["--root", t.root(), "--require", "gpu-direct", "--json"],
        &[],
    );
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["requirements"][0]["requirement"], "gpu-direct");
    assert_eq!(v["requirements"][0]["met"], false);
}

/// Fake machine: an NVIDIA GPU and a RoCE NIC below the same PCIe switch port, nvidia-peermem
/// loaded, rdma-core installed — but no CUDA driver.
fn fake_machine() -> Tree {
    let t = Tree::new("machine");
    let sw = "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0";
    for (bdf, vendor, class) in [
        ("0000:03:00.0", "0x10de", "0x030200"),
        ("0000:03:00.1", "0x15b3", "0x020700"),
    ] {
        let dir = format!("sys/devices/{sw}/{bdf}");
        t.write(&format!("{dir}/vendor"), vendor);
        t.write(&format!("{dir}/class"), class);
        t.write(&format!("{dir}/numa_node"), "0");
        t.link(
            &format!("sys/bus/pci/devices/{bdf}"),
            &format!("../../../devices/{sw}/{bdf}"),
        );
    }
    let ib = format!("sys/devices/{sw}/0000:03:00.1/infiniband/mlx5_0");
    t.link(&format!("{ib}/device"), "../../../0000:03:00.1");
    t.link(
        "sys/class/infiniband/mlx5_0",
        &format!("../../devices/{sw}/0000:03:00.1/infiniband/mlx5_0"),
    );
    let port = format!("{ib}/ports/1");
    t.write(&format!("{port}/state"), "4: ACTIVE");
    t.write(&format!("{port}/phys_state"), "5: LinkUp");
    t.write(&format!("{port}/link_layer"), "Ethernet");
    t.write(&format!("{port}/rate"), "100 Gb/sec (4X EDR)");
    t.write(
        &format!("{port}/gids/3"),
        "0000:0000:0000:0000:0000:ffff:c0a8:0102",
    );
    t.write(&format!("{port}/gid_attrs/types/3"), "RoCE v2");
    t.write(&format!("{port}/gid_attrs/ndevs/3"), "ens1f1");
    t.write("sys/class/net/ens1f1/mtu", "9000");
    t.write("sys/module/nvidia_peermem/version", "550.54.15");
    t.write("usr/lib64/libibverbs.so.1", "");
    t
}

#[test]
fn a_fake_sysfs_tree_shows_ports_gids_distance_and_why_the_pair_is_staged() {
    if libcuda_here() {
        eprintln!(
            "skipped: a CUDA driver is present, so GPUs come from the driver, not the fake tree"
        );
        return;
    }
    let t = fake_machine();
    let o = doctor(&["--root", t.root()], &[]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains("device mlx5_0") && out.contains("PCI 0000:03:00.1"),
        "{out}"
    );
    assert!(
        out.contains("state 4: ACTIVE") && out.contains("link layer Ethernet"),
        "{out}"
    );
    assert!(
        out.contains("0000:0000:0000:0000:0000:ffff:c0a8:0102 RoCE v2 (ens1f1)"),
        "{out}"
    );
    assert!(
        out.contains("4096 (RoCE: derived from ens1f1 MTU 9000"),
        "{out}"
    );
    assert!(out.contains("PCI GPU 0000:03:00.0"), "{out}");
    assert!(
        out.contains("PCI GPU 0000:03:00.0 <-> mlx5_0") && out.contains("PIX"),
        "{out}"
    );
    assert!(
        out.contains("loaded (/sys/module/nvidia_peermem/version, 550.54.15)"),
        "{out}"
    );
    let fast = |name: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap()
            .to_string()
    };
    assert!(
        fast("RDMA verbs transport").contains("OK: active port(s): mlx5_0:1"),
        "{out}"
    );
    let peermem = fast("GPUDirect RDMA via nvidia-peermem");
    assert!(
        peermem.contains("UNAVAILABLE")
            && peermem.contains("CUDA")
            && !peermem.contains("not loaded"),
        "{peermem}"
    );
    // The pair's resulting path: staged, because there is no driver.
    let path_line = out
        .lines()
        .skip_while(|l| !l.starts_with("Resulting data path"))
        .find(|l| l.contains("<-> mlx5_0"))
        .unwrap();
    assert!(
        path_line.contains("verbs/staged") && path_line.contains("no usable CUDA driver"),
        "{path_line}"
    );

    let o = doctor(&["--root", t.root(), "--json"], &[]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["pairs"][0]["distance"], "Pix");
    assert_eq!(v["pairs"][0]["verbs_path"], "verbs/staged");
    assert_eq!(v["pairs"][0]["capability"]["kind"], "unavailable");
    assert_eq!(v["rdma"]["devices"][0]["ports"][0]["active_mtu"], 4096);
    assert_eq!(v["peermem"]["loaded"], true);
}

#[test]
fn compile_kernels_reports_every_kernel_or_says_why_it_cannot() {
    let cache = std::env::temp_dir().join(format!("dspark-doctor-cache-{}", std::process::id()));
    let cache_s = cache.to_str().unwrap();
    let o = doctor(
        &["--compile-kernels", "--arch", "sm_90"],
        &[("DSPARK_CACHE_DIR", cache_s)],
    );
    let (out, err) = text(&o);
    let total = dspark::internals::gpu::kernels::all_kernels().len();
    if dspark::internals::gpu::libnvrtc_present() {
        assert!(o.status.success(), "{out}\n{err}");
        let line = out.lines().find(|l| l.contains("compile sm_90")).unwrap();
        assert!(
            line.contains(&format!("{total}/{total} kernels compiled")),
            "{line}"
        );
        assert!(line.contains("spill stores 0 B, spill loads 0 B"), "{line}");
        assert!(out.contains(&format!("{cache_s} (writable)")), "{out}");
        // The second run finds the disk cache.
        let o = doctor(
            &["--compile-kernels", "--arch", "sm_90", "--json"],
            &[("DSPARK_CACHE_DIR", cache_s)],
        );
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(
            v["nvrtc"]["compile"][0]["origin"]
                .as_str()
                .unwrap()
                .starts_with("disk cache"),
            "{v}"
        );
    } else {
        eprintln!("libnvrtc not loadable here: checking the failure report instead (see tests/gpu_kernels_compile.rs to enable)");
        assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
        assert!(
            err.contains("compiling the kernels for sm_90 failed") && err.contains("libnvrtc"),
            "{err}"
        );
        assert!(
            out.contains("compile sm_90") && out.contains("FAILED"),
            "{out}"
        );
    }
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn a_bad_architecture_is_a_usage_error_naming_the_option() {
    let o = doctor(&["--compile-kernels", "--arch", "gfx90a"], &[]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--arch") && err.contains("gfx90a"), "{err}");
    // --arch without --compile-kernels is refused by the argument parser.
    let o = doctor(&["--arch", "sm_90"], &[]);
    assert_eq!(o.status.code(), Some(2));
}

/// `dspark doctor` says how a job launched with its environment would authenticate: open
/// (with the fix), a private token file by name, a token file that others may read refused
/// naming the variable.
#[test]
fn doctor_says_how_a_job_launched_here_would_authenticate() {
    use std::os::unix::fs::PermissionsExt;
    let section = |envs: &[(&str, &str)]| {
        let mut all = vec![("DSPARK_JOB_TOKEN", ""), ("DSPARK_RENDEZVOUS", "")];
        all.extend_from_slice(envs);
        let o = doctor(&[], &all);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{out}\n{err}");
        out.split("Job authentication")
            .nth(1)
            .unwrap_or_else(|| panic!("no authentication section:\n{out}"))
            .to_string()
    };
    let open = section(&[("DSPARK_JOB_TOKEN_FILE", "")]);
    assert!(
        open.contains("open: any host") && open.contains("DSPARK_JOB_TOKEN_FILE="),
        "{open}"
    );
    let tree = Tree::new("token");
    let file = tree.0.join("token");
    std::fs::write(&file, "s3cret\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let f = file.to_str().unwrap();
    let ok = section(&[("DSPARK_JOB_TOKEN_FILE", f)]);
    assert!(ok.contains(&format!("token file {f}")), "{ok}");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let shared = section(&[("DSPARK_JOB_TOKEN_FILE", f)]);
    assert!(
        shared.contains("refused") && shared.contains("DSPARK_JOB_TOKEN_FILE"),
        "{shared}"
    );
}

/// The CPU steadiness section watches every CPU this process may use, and a CPU that another
/// busy thread shares (half its time gone, in scheduler slices of milliseconds) is named
/// unsteady, with what to do.
#[test]
fn a_cpu_shared_with_a_busy_thread_is_reported_unsteady() {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    use std::sync::atomic::{AtomicBool, Ordering};
    let set = sched_getaffinity(Pid::from_raw(0)).unwrap();
    let allowed: Vec<usize> = (0..CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect();
    let busy_cpu = *allowed.last().unwrap();
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        // Also when the doctor's run panics: the scope must not wait on the spinner forever.
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let stop = AtomicBool::new(false);
    let out = std::thread::scope(|s| {
        let _stop = Stop(&stop);
        s.spawn(|| {
            let mut one = CpuSet::new();
            one.set(busy_cpu).unwrap();
            sched_setaffinity(Pid::from_raw(0), &one).unwrap();
            while !stop.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        doctor(&["--json"], &[])
    });
    let (stdout, stderr) = text(&out);
    let v: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    let c = &v["cpus"];
    assert_eq!(c["probe_ms"], 300);
    let cpus = c["cpus"].as_array().unwrap();
    let ids: Vec<u64> = cpus.iter().map(|x| x["cpu"].as_u64().unwrap()).collect();
    let want: Vec<u64> = allowed.iter().take(256).map(|&x| x as u64).collect();
    assert_eq!(ids, want, "one entry per allowed CPU");
    let busy = cpus.iter().find(|x| x["cpu"] == busy_cpu as u64).unwrap();
    let lost = busy["lost_pct"].as_f64().unwrap();
    assert!(
        lost > 10.0,
        "cpu {busy_cpu} shared with a busy thread lost {lost}%: {busy}"
    );
    assert_eq!(c["steady"], false, "{c}");
    let verdict = c["verdict"].as_str().unwrap();
    assert!(
        verdict.starts_with("UNSTEADY") && verdict.contains(&format!("cpu {busy_cpu} lost")),
        "{verdict}"
    );
    assert!(
        verdict.contains("a core with nothing else on it"),
        "{verdict}"
    );
}

/// A job prologue (`--require`) does not take every core for the probe: the section says it
/// was not measured, and `steady` is null, not a pass.
#[test]
fn the_cpu_probe_is_skipped_under_require() {
    let out = doctor(&["--json", "--require", "verbs"], &[]);
    let (stdout, stderr) = text(&out);
    let v: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    assert_eq!(v["cpus"]["steady"], Value::Null, "{}", v["cpus"]);
    // Both probes: nothing measured, and the verdict says why.
    for (section, list) in [("cpus", "cpus"), ("cores", "pairs")] {
        let sec = &v[section];
        assert_eq!(sec[list].as_array().map(Vec::len), Some(0), "{sec}");
        assert!(
            sec["verdict"]
                .as_str()
                .unwrap()
                .starts_with("not measured (--require"),
            "{sec}"
        );
    }
}

/// The core-to-core section measures a cache line's round trip between every pair of the
/// allowed CPUs (up to 8 of them), each a plausible time, and says what the distances mean.
#[test]
fn every_pair_of_cpus_gets_a_cache_line_round_trip() {
    use nix::sched::{sched_getaffinity, CpuSet};
    use nix::unistd::Pid;
    let set = sched_getaffinity(Pid::from_raw(0)).unwrap();
    let allowed: Vec<u64> = (0..CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .map(|c| c as u64)
        .collect();
    let out = doctor(&["--json"], &[]);
    let (stdout, stderr) = text(&out);
    let v: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    let c = &v["cores"];
    let pairs = c["pairs"].as_array().unwrap();
    let verdict = c["verdict"].as_str().unwrap();
    if allowed.len() < 2 {
        assert!(pairs.is_empty(), "{c}");
        assert_eq!(verdict, "not measured (fewer than 2 CPUs)");
        return;
    }
    let n = allowed.len().min(8);
    let want = if allowed.len() <= 8 {
        n * (n - 1) / 2
    } else {
        (allowed.len() - 1).min(64)
    };
    assert_eq!(pairs.len(), want, "{c}");
    assert_eq!(
        (pairs[0]["a"].as_u64(), pairs[0]["b"].as_u64()),
        (Some(allowed[0]), Some(allowed[1]))
    );
    for p in pairs {
        let us = p["round_trip_us"].as_f64();
        assert!(us.is_some_and(|x| x > 0.0 && x < 1000.0), "{p}");
    }
    let levels = c["levels"].as_array().unwrap();
    let in_levels: u64 = levels.iter().map(|l| l["pairs"].as_u64().unwrap()).sum();
    assert_eq!(in_levels, want as u64, "{c}");
    assert!(
        verdict.starts_with("near: ")
            || verdict.starts_with("every pair is far apart")
            || verdict.contains(" distances, "),
        "{verdict}"
    );
    let human = doctor(&[], &[]);
    let (h, _) = text(&human);
    assert!(h.contains("Core-to-core distance"), "{h}");
    assert!(
        h.contains(&format!("cpu {} - cpu {}", allowed[0], allowed[1])),
        "{h}"
    );
}
