//! `dspark doctor`: what this machine can do for collectives, and for every fast path that is
//! missing, why and what to do. The report is built and rendered section by section, a file
//! per part of the machine: [`rdma`] (verbs devices, locked memory), [`gpu`] (CUDA,
//! nvidia-peermem, NVRTC), [`pairs`] (GPU/NIC pairs and the path device buffers take),
//! [`fast_paths`] (the verdicts), [`cpus`] (whether a spinning rank keeps its core),
//! [`cores`] (how far apart the CPUs are for a cache line),
//! [`summary`] (notes and `--require`), [`trust`] (how a job
//! launched here would authenticate its ranks); [`fixes`] holds the
//! advice they share. This file holds the arguments, the report that `--json` prints (its
//! field names and nesting are what tools read), and the order of the human report.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use dspark::internals::gpu::sysfs::{PeermemStatus, Sysfs};
use dspark::path;
use serde::Serialize;

mod cores;
mod cpus;
mod fast_paths;
mod fixes;
mod gpu;
mod pairs;
mod rdma;
mod summary;
mod trust;

use fast_paths::FastPath;
use gpu::{CudaSection, NvrtcSection};
use pairs::PairReport;
use rdma::{MemlockSection, RdmaSection};
use summary::RequirementResult;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Requirement {
    /// GPUDirect RDMA usable for at least one GPU/NIC pair.
    GpuDirect,
    /// The RDMA verbs transport (rdma-core and an active port).
    Verbs,
    /// A CUDA driver with at least one GPU.
    Cuda,
    /// NVRTC loadable (GPU reduction kernels can be compiled).
    Nvrtc,
}

#[derive(Args, Debug)]
pub(crate) struct DoctorArgs {
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Compile every reduction kernel with NVRTC (no GPU needed) and report the result; warms
    /// the kernel cache.
    #[arg(long)]
    compile_kernels: bool,
    /// Architecture(s) for --compile-kernels (sm_90, sm_80, compute_90, ...). Default: each GPU's
    /// own, or sm_90 without a GPU.
    #[arg(long, value_name = "ARCH", requires = "compile_kernels")]
    arch: Vec<String>,
    /// Exit with status 1, saying why, unless this is available (repeatable).
    #[arg(long, value_enum, value_name = "WHAT")]
    require: Vec<Requirement>,
    /// Read sysfs and library directories below this root instead of / (for tests).
    #[arg(long, hide = true, default_value = "/")]
    root: PathBuf,
}

#[derive(Debug, Serialize)]
struct Report {
    rdma: RdmaSection,
    memlock: MemlockSection,
    cuda: CudaSection,
    peermem: PeermemStatus,
    nvrtc: NvrtcSection,
    pairs: Vec<PairReport>,
    tcp_device_path: String,
    fast_paths: Vec<FastPath>,
    cpus: cpus::CpuSection,
    cores: cores::CoreSection,
    notes: Vec<String>,
    requirements: Vec<RequirementResult>,
    auth: trust::AuthSection,
}

/// The doctor's own byte sizes, with one decimal (`8.0 MiB`, `1.0 GiB`, `139.8 GiB`): limits
/// and GPU memory are rarely whole binary units, where [`dspark::types::human_bytes`] prints
/// exact multiples (`8 MiB`) and anything else in plain bytes.
fn rounded_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// A limit in [`rounded_bytes`], or `unlimited`.
fn limit_text(v: Option<u64>) -> String {
    v.map_or("unlimited".to_string(), rounded_bytes)
}

/// Probes every section, in the order the report lists them.
fn build_report(args: &DoctorArgs) -> Result<Report, String> {
    let sysfs = Sysfs::new(&args.root);
    let on_real_root = args.root == Path::new("/");
    let rdma = rdma::probe_rdma(&sysfs, &args.root, on_real_root);
    let memlock = rdma::probe_memlock();
    let cuda = gpu::probe_cuda_section(&sysfs);
    let devices = cuda.devices();
    let peermem = sysfs.peermem();
    let nvrtc = gpu::probe_nvrtc(args, &devices)?;
    let pairs = pairs::gpu_nic_pairs(&sysfs, &rdma, &cuda, &devices, &peermem)?;
    let fast = fast_paths::fast_paths(&rdma, &memlock, &cuda, &devices, &peermem, &nvrtc);
    let notes = summary::notes(&args.root, on_real_root, &pairs, &fast);
    let requirements = summary::requirements(&args.require, &fast, &pairs);
    // Not in a job prologue (`--require`): the probes take every allowed core for 300 ms,
    // then two at a time.
    let skip = if !on_real_root {
        Some("--root: not this machine")
    } else if !args.require.is_empty() {
        Some("--require: run `dspark doctor` alone to measure it")
    } else {
        None
    };
    let (cpus, cores) = match skip {
        Some(why) => (cpus::not_measured(why), cores::not_measured(why)),
        None => {
            let allowed = cpus::allowed_cpus();
            (cpus::probe_cpus(&allowed), cores::probe_cores(&allowed))
        }
    };
    Ok(Report {
        rdma,
        memlock,
        cuda,
        peermem,
        nvrtc,
        pairs,
        tcp_device_path: format!("tcp/staged: {}", path::TCP_STAGED_REASON),
        fast_paths: fast,
        cpus,
        cores,
        notes,
        requirements,
        auth: trust::probe_auth(),
    })
}

/// One `label ..... value` line of the human report.
fn kv(out: &mut String, label: &str, value: impl AsRef<str>) {
    let dots = 36usize.saturating_sub(label.chars().count() + 1);
    out.push_str(&format!(
        "  {label} {} {}\n",
        ".".repeat(dots.max(2)),
        value.as_ref()
    ));
}

/// The human report: each section in turn.
fn render_human(r: &Report) -> String {
    let mut o = String::new();
    o.push_str("dspark doctor: what this machine can do for collectives, and why not\n\n");
    rdma::render_rdma(&mut o, &r.rdma);
    rdma::render_memlock(&mut o, &r.memlock);
    gpu::render_cuda(&mut o, &r.cuda);
    gpu::render_peermem(&mut o, &r.peermem);
    gpu::render_nvrtc(&mut o, &r.nvrtc);
    pairs::render_pairs(&mut o, &r.pairs);
    fast_paths::render_fast_paths(&mut o, &r.fast_paths);
    pairs::render_data_path(&mut o, &r.tcp_device_path, &r.pairs);
    summary::render_notes(&mut o, &r.notes);
    cpus::render_cpus(&mut o, &r.cpus);
    cores::render_cores(&mut o, &r.cores);
    trust::render_auth(&mut o, &r.auth);
    summary::render_requirements(&mut o, &r.requirements);
    o
}

/// `dspark doctor`: the report (human or `--json`); exit 1 when a `--require` is not met or
/// a `--compile-kernels` compile failed, 2 when the report cannot be made.
pub(crate) fn run(args: &DoctorArgs) -> ExitCode {
    let report = match build_report(args) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("dspark doctor: {e}");
            return ExitCode::from(2);
        }
    };
    if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("dspark doctor: cannot serialise the report: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        print!("{}", render_human(&report));
    }
    let mut failed = false;
    for q in report.requirements.iter().filter(|q| !q.met) {
        eprintln!(
            "dspark doctor: requirement {} not met: {}",
            q.name(),
            q.reason
        );
        failed = true;
    }
    for c in report.nvrtc.compile.iter().filter(|c| !c.ok) {
        eprintln!(
            "dspark doctor: compiling the kernels for {} failed: {}",
            c.arch,
            c.error.as_deref().unwrap_or("?")
        );
        failed = true;
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
