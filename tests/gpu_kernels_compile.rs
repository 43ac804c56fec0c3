//! The reduction kernels compile with NVRTC for sm_90 and sm_80 without register spills, use
//! 16-byte vector accesses, are cached, and — compiled for the host CPU with an emulated grid —
//! compute exactly what the independent reference computes. None of this needs a GPU.
//!
//! The NVRTC tests need libnvrtc; without it they print a skip reason and pass. To run them on
//! a machine without CUDA (this is what `.ci/run` does):
//!
//! ```sh
//! export LD_LIBRARY_PATH="$(bash tests/gpu/install_nvrtc.sh | tail -n1)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
//! DSPARK_REQUIRE_NVRTC=1 cargo test --test gpu_kernels_compile -- --nocapture
//! ```
//!
//! With `DSPARK_REQUIRE_NVRTC=1` a missing libnvrtc is a failure instead of a skip. The
//! host-emulation test needs a C++17 compiler (`c++`, or `$CXX`) and the harness source; it
//! skips without them (printing `SUMMARY: host emulation: SKIPPED ...`), and fails instead
//! under `DSPARK_REQUIRE_NVRTC=1` too.

#[path = "gpu/reference.rs"]
mod reference;

use std::path::{Path, PathBuf};
use std::process::Command;

use dspark::internals::gpu::kernels::{self, KernelKind};
use dspark::internals::gpu::nvrtc::{self, CacheOrigin, DiskCache, GpuArch, ImageKind};
use dspark::{DataType, Error, ReduceOp};
use reference::SplitMix64;

const HOW_TO_RUN: &str =
    "export LD_LIBRARY_PATH=\"$(bash tests/gpu/install_nvrtc.sh | tail -n1)\" \
     and rerun (DSPARK_REQUIRE_NVRTC=1 turns this skip into a failure)";

/// Whether `DSPARK_REQUIRE_NVRTC=1`: every test of this file must run, none may skip.
fn nvrtc_required() -> bool {
    std::env::var("DSPARK_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

/// Whether libnvrtc can be used; prints why not (or panics when it is required).
fn nvrtc_or_skip(test: &str) -> bool {
    if nvrtc::libnvrtc_present() {
        return true;
    }
    let msg = format!("{test}: SKIPPED: libnvrtc.so could not be loaded. To run it: {HOW_TO_RUN}");
    if nvrtc_required() {
        panic!("{msg}");
    }
    eprintln!("{msg}");
    false
}

#[test]
fn every_kernel_compiles_for_sm_90_and_sm_80_with_no_register_spills() {
    if !nvrtc_or_skip("every_kernel_compiles_for_sm_90_and_sm_80_with_no_register_spills") {
        return;
    }
    let (maj, min) = nvrtc::version().unwrap();
    for arch in [GpuArch::sm(9, 0), GpuArch::sm(8, 0)] {
        let build =
            kernels::compile_all(arch, &DiskCache::Off).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(build.compiled.kind, ImageKind::Cubin);
        assert_eq!(build.expected, kernels::all_kernels().len());
        assert_eq!(build.found, build.expected);
        assert_eq!(
            build.compiled.functions.len(),
            build.expected,
            "ptxas reported every kernel"
        );
        let spilling: Vec<String> = build
            .compiled
            .spilling()
            .iter()
            .map(|f| {
                format!(
                    "{} ({} B stores, {} B loads)",
                    f.name, f.spill_store_bytes, f.spill_load_bytes
                )
            })
            .collect();
        assert!(
            spilling.is_empty(),
            "{arch}: register spills: {spilling:?}\n{}",
            build.compiled.log
        );
        let (stores, loads) = build.spill_bytes();
        eprintln!(
            "SUMMARY: NVRTC {maj}.{min} {arch}: {}/{} kernels compiled, spill stores {stores} B, spill loads {loads} B, \
             max {} registers/thread, {} KiB CUBIN, {:.2?}",
            build.found,
            build.expected,
            build.max_registers().unwrap_or(0),
            build.compiled.image.len() / 1024,
            build.compiled.compile_time
        );
    }
}

#[test]
fn the_bit_wise_f16_fallback_compiles_without_spills_too() {
    if !nvrtc_or_skip("the_bit_wise_f16_fallback_compiles_without_spills_too") {
        return;
    }
    let arch = GpuArch::sm(9, 0);
    let mut opts = kernels::compile_options(arch);
    opts.push("-DDSPARK_F16_BITWISE".to_string());
    let c = nvrtc::compile(kernels::SOURCE, "bitwise.cu", arch, &opts, &DiskCache::Off).unwrap();
    assert_eq!(c.functions.len(), kernels::all_kernels().len());
    assert!(c.spilling().is_empty(), "{}", c.log);
}

/// The PTX of one `.entry` (from its line to the next entry).
fn ptx_body<'a>(ptx: &'a str, name: &str) -> &'a str {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("{name} not in PTX"));
    let rest = &ptx[start + 1..];
    let end = rest.find(".entry ").map_or(rest.len(), |e| e);
    &rest[..end]
}

#[test]
fn kernels_move_data_with_16_byte_vector_loads_and_stores() {
    if !nvrtc_or_skip("kernels_move_data_with_16_byte_vector_loads_and_stores") {
        return;
    }
    let build = kernels::compile_all(GpuArch::compute(9, 0), &DiskCache::Off).unwrap();
    assert_eq!(build.compiled.kind, ImageKind::Ptx);
    let ptx = String::from_utf8_lossy(&build.compiled.image).into_owned();
    assert!(
        ptx.ends_with('\0'),
        "PTX for cuModuleLoadData must be NUL-terminated"
    );
    for (kind, dtype, op, name) in kernels::all_kernels() {
        let body = ptx_body(&ptx, &name);
        // 16 bytes: four 32-bit lanes, or two 64-bit lanes for 8-byte types.
        let wide = |l: &str| l.contains(".v4.") || (l.contains(".v2.") && l.contains("64"));
        let vec_load = body
            .lines()
            .filter(|l| l.contains("ld.global") && wide(l))
            .count();
        let vec_store = body
            .lines()
            .filter(|l| l.contains("st.global") && wide(l))
            .count();
        let loads_wanted = if kind == KernelKind::Finalize { 1 } else { 2 };
        assert!(
            vec_load >= loads_wanted && vec_store >= 1,
            "{name} ({dtype:?} {op:?}): {vec_load} vector loads, {vec_store} vector stores"
        );
    }
}

#[test]
fn a_compile_error_is_reported_with_the_full_nvrtc_log() {
    if !nvrtc_or_skip("a_compile_error_is_reported_with_the_full_nvrtc_log") {
        return;
    }
    let src =
        "extern \"C\" __global__ void broken(float* x) {\n  x[0] = undefined_helper_42(x[1]);\n}\n";
    let e = nvrtc::compile_uncached(src, "broken.cu", GpuArch::sm(9, 0), &[]).unwrap_err();
    let Error::Cuda { op, what, .. } = &e else {
        panic!("expected Error::Cuda, got {e:?}")
    };
    assert!(op.contains("broken.cu") && op.contains("sm_90"), "{op}");
    assert!(what.contains("NVRTC_ERROR_COMPILATION"), "{what}");
    assert!(
        what.contains("undefined_helper_42") && what.contains("broken.cu(2)"),
        "the log names the line: {what}"
    );
}

#[test]
fn compiled_images_are_cached_on_disk_keyed_by_architecture() {
    if !nvrtc_or_skip("compiled_images_are_cached_on_disk_keyed_by_architecture") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("dspark-kernel-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let disk = DiskCache::Dir(dir.clone());
    // A small source unique to this test (fast to compile; no other test shares its key).
    let src = format!(
        "extern \"C\" __global__ void cache_probe(float* x) {{ x[threadIdx.x] += 1.0f; }}\n// {}\n",
        std::process::id()
    );
    let opts = kernels::compile_options(GpuArch::sm(9, 0));
    let first = nvrtc::compile(&src, "cache_test.cu", GpuArch::sm(9, 0), &opts, &disk).unwrap();
    assert_eq!(first.origin, CacheOrigin::Compiled);
    let files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let second = nvrtc::compile(&src, "cache_test.cu", GpuArch::sm(9, 0), &opts, &disk).unwrap();
    assert_eq!(second.origin, CacheOrigin::Process);
    nvrtc::clear_process_cache();
    let third = nvrtc::compile(&src, "cache_test.cu", GpuArch::sm(9, 0), &opts, &disk).unwrap();
    assert_eq!(third.origin, CacheOrigin::Disk(files[0].clone()));
    assert_eq!(third.image, first.image);
    assert_eq!(
        third.functions, first.functions,
        "spill report survives the disk cache"
    );
    let other = nvrtc::compile(
        &src,
        "cache_test.cu",
        GpuArch::sm(8, 0),
        &kernels::compile_options(GpuArch::sm(8, 0)),
        &disk,
    )
    .unwrap();
    assert_eq!(
        other.origin,
        CacheOrigin::Compiled,
        "another architecture is another key"
    );
    std::fs::remove_dir_all(&dir).unwrap();

    // An unwritable cache directory is skipped, not an error.
    let file =
        std::env::temp_dir().join(format!("dspark-kernel-cache-file-{}", std::process::id()));
    std::fs::write(&file, b"not a directory").unwrap();
    nvrtc::clear_process_cache();
    let c = nvrtc::compile(
        &src,
        "cache_test.cu",
        GpuArch::sm(9, 0),
        &opts,
        &DiskCache::Dir(file.join("sub")),
    )
    .unwrap();
    assert_eq!(c.origin, CacheOrigin::Compiled);
    std::fs::remove_file(&file).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Host emulation: the CUDA source compiled by the C++ compiler, every kernel run on the CPU.

fn cxx() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".to_string())
}

/// The repository root: `$DSPARK_REPO` (set by tests/gpu/run_all.sh when the test binary runs
/// from another checkout than the one it was built in), else the build-time manifest directory.
fn repo_root() -> PathBuf {
    std::env::var_os("DSPARK_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// Reports why the host-emulation test cannot run: a `SUMMARY:` line (collected by
/// tests/gpu/run_all.sh), and a panic under `DSPARK_REQUIRE_NVRTC=1`.
fn host_emulation_skipped(reason: &str) {
    eprintln!("SUMMARY: host emulation: SKIPPED {reason}");
    if nvrtc_required() {
        panic!("host emulation cannot run (DSPARK_REQUIRE_NVRTC=1 forbids skipping): {reason}");
    }
}

fn build_harness(dir: &Path) -> Option<PathBuf> {
    let manifest = repo_root();
    let src = manifest.join("tests/gpu/host_harness.cpp");
    if !src.exists() {
        host_emulation_skipped(&format!(
            "{} not found (set DSPARK_REPO to the repository root)",
            src.display()
        ));
        return None;
    }
    let exe = dir.join("dspark_host_harness");
    let out = Command::new(cxx())
        .args([
            "-std=c++17",
            "-O1",
            "-ffp-contract=off",
            "-fno-fast-math",
            "-Wall",
            "-Wextra",
            "-Wno-unknown-pragmas",
        ])
        .arg("-rdynamic")
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .arg("-ldl")
        .output();
    match out {
        Err(e) => {
            host_emulation_skipped(&format!(
                "no C++ compiler ({}: {e}); install g++ or set CXX",
                cxx()
            ));
            None
        }
        Ok(o) if !o.status.success() => {
            panic!(
                "the kernel source does not compile as host C++:\n{}",
                String::from_utf8_lossy(&o.stderr)
            )
        }
        Ok(o) => {
            let warnings = String::from_utf8_lossy(&o.stderr);
            assert!(
                warnings.trim().is_empty(),
                "host compiler warnings in the kernel source:\n{warnings}"
            );
            Some(exe)
        }
    }
}

struct Case {
    name: String,
    kind: u64,
    dtype: DataType,
    op: Option<ReduceOp>,
    n: usize,
    offs: (usize, usize, usize),
    world: u64,
    grid: u64,
    block: u64,
    dst: Vec<u8>,
    a: Vec<u8>,
    b: Vec<u8>,
}

impl Case {
    fn expected(&self) -> Vec<u8> {
        let es = self.dtype.size();
        let (od, oa, ob) = self.offs;
        let range = |o: usize| o * es..(o + self.n) * es;
        let mut out = self.dst.clone();
        let result = match self.kind {
            0 => reference::apply(
                self.dtype,
                self.op.unwrap(),
                &self.dst[range(od)],
                &self.b[range(ob)],
            ),
            1 => reference::apply(
                self.dtype,
                self.op.unwrap(),
                &self.a[range(oa)],
                &self.b[range(ob)],
            ),
            3 => reference::apply(
                self.dtype,
                self.op.unwrap(),
                &self.dst[range(od)],
                &self.b[range(ob)],
            ),
            _ => reference::finalize(self.dtype, &self.dst[range(od)], self.world),
        };
        out[range(od)].copy_from_slice(&result);
        out
    }

    /// The same case through the crate's CPU kernels (src/reduce), which the GPU kernels must
    /// match bit for bit (NaN payloads of Sum/Prod aside).
    fn expected_by_cpu_kernels(&self) -> Vec<u8> {
        let es = self.dtype.size();
        let (od, oa, ob) = self.offs;
        let range = |o: usize| o * es..(o + self.n) * es;
        let mut out = self.dst.clone();
        match self.kind {
            0 | 3 => dspark::internals::reduce::reduce_inplace(
                self.dtype,
                self.op.unwrap(),
                &mut out[range(od)],
                &self.b[range(ob)],
            ),
            1 => dspark::internals::reduce::reduce_into(
                self.dtype,
                self.op.unwrap(),
                &mut out[range(od)],
                &self.a[range(oa)],
                &self.b[range(ob)],
            ),
            _ => dspark::internals::reduce::finalize(
                self.dtype,
                ReduceOp::Avg,
                &mut out[range(od)],
                self.world as usize,
            ),
        }
        out
    }

    fn encode(&self, w: &mut Vec<u8>) {
        let u = |w: &mut Vec<u8>, v: u64| w.extend_from_slice(&v.to_le_bytes());
        u(w, self.name.len() as u64);
        w.extend_from_slice(self.name.as_bytes());
        for v in [
            self.kind,
            self.dtype.size() as u64,
            self.n as u64,
            self.offs.0 as u64,
            self.offs.1 as u64,
            self.offs.2 as u64,
            self.world,
            self.grid,
            self.block,
        ] {
            u(w, v);
        }
        for buf in [&self.dst, &self.a, &self.b] {
            u(w, buf.len() as u64);
            w.extend_from_slice(buf);
        }
    }
}

fn cases() -> Vec<Case> {
    let mut rng = SplitMix64(0x5eed_d5a7);
    let mut out = Vec::new();
    let lengths = [
        0usize, 1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 64, 100, 257, 1000,
    ];
    for dtype in DataType::ALL {
        let es = dtype.size();
        let per_vec = 16 / es;
        // (dst, a, b) offsets in elements: aligned, equally misaligned, differently misaligned.
        let offsets = [
            (0, 0, 0),
            (1, 1, 1),
            (per_vec - 1, per_vec - 1, per_vec - 1),
            (1, 0, 2),
            (0, 3, 0),
            (2, 2, 1),
        ];
        let mut kinds: Vec<(u64, Option<ReduceOp>)> = Vec::new();
        for op in kernels::STEP_OPS {
            for k in [0, 1, 3] {
                kinds.push((k, Some(op)));
            }
        }
        kinds.push((2, None));
        for (kind, op) in kinds {
            for (li, &n) in lengths.iter().enumerate() {
                for (oi, &offs) in offsets.iter().enumerate() {
                    // Every length with the first two offset patterns, the rest on a subset.
                    if oi >= 2 && li % 3 != oi % 3 {
                        continue;
                    }
                    // Geometries: tiny blocks (many grid-stride rounds), one 256-thread block, the
                    // launch geometry the library uses on a 2-SM device.
                    let geometries = [
                        (3u64, 4u64),
                        (1, 256),
                        (u64::from(kernels::grid_size(n as u64, es, 2)), 256),
                    ];
                    let (grid, block) = geometries[(li + oi) % geometries.len()];
                    let len = |o: usize| (o + n + per_vec) * es;
                    let world = [1u64, 2, 3, 7, 300][(li + oi) % 5];
                    let name = match kind {
                        0 => kernels::kernel_name(KernelKind::ReduceInplace, dtype, op.unwrap()),
                        1 | 3 => kernels::kernel_name(KernelKind::ReduceInto, dtype, op.unwrap()),
                        _ => kernels::kernel_name(KernelKind::Finalize, dtype, ReduceOp::Avg),
                    };
                    out.push(Case {
                        name,
                        kind,
                        dtype,
                        op,
                        n,
                        offs,
                        world,
                        grid,
                        block,
                        dst: rng.elements(dtype, len(offs.0) / es),
                        a: rng.elements(dtype, len(offs.1) / es),
                        b: rng.elements(dtype, len(offs.2) / es),
                    });
                }
            }
        }
    }
    out
}

#[test]
fn kernel_source_run_on_the_cpu_matches_the_reference_bit_for_bit() {
    reference::self_check();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("host-harness-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let Some(exe) = build_harness(&dir) else {
        return;
    };
    let cases = cases();
    let mut input = Vec::new();
    for c in &cases {
        c.encode(&mut input);
    }
    let (inp, outp) = (dir.join("cases.bin"), dir.join("results.bin"));
    std::fs::write(&inp, &input).unwrap();
    let st = Command::new(&exe).arg(&inp).arg(&outp).status().unwrap();
    assert!(st.success(), "harness failed: {st}");
    let results = std::fs::read(&outp).unwrap();
    let mut at = 0usize;
    let mut failures = Vec::new();
    let mut cpu_failures: Vec<String> = Vec::new();
    let mut per_kernel = std::collections::BTreeSet::new();
    for c in &cases {
        let len = u64::from_le_bytes(results[at..at + 8].try_into().unwrap()) as usize;
        let got = &results[at + 8..at + 8 + len];
        at += 8 + len;
        let want = c.expected();
        per_kernel.insert(c.name.clone());
        let cpu = c.expected_by_cpu_kernels();
        if let Some(i) = reference::first_mismatch(c.dtype, got, &cpu, reference::exact_nan(c.op)) {
            let es = c.dtype.size();
            cpu_failures.push(format!(
                "{} kind {} n {} offs {:?}: element {i} kernel {:02x?} src/reduce {:02x?}",
                c.name,
                c.kind,
                c.n,
                c.offs,
                &got[i * es..(i + 1) * es],
                &cpu[i * es..(i + 1) * es]
            ));
        }
        if let Some(i) = reference::first_mismatch(c.dtype, got, &want, reference::exact_nan(c.op))
        {
            let es = c.dtype.size();
            failures.push(format!(
                "{} kind {} n {} offs {:?} grid {}x{} world {}: element {} (buffer index) got {:02x?} want {:02x?}",
                c.name,
                c.kind,
                c.n,
                c.offs,
                c.grid,
                c.block,
                c.world,
                i,
                &got[i * es..(i + 1) * es],
                &want[i * es..(i + 1) * es]
            ));
        }
    }
    assert_eq!(at, results.len());
    eprintln!(
        "SUMMARY: host emulation: {} cases over {} kernels, {} mismatches",
        cases.len(),
        per_kernel.len(),
        failures.len()
    );
    assert_eq!(
        per_kernel.len(),
        kernels::all_kernels().len(),
        "every kernel was run"
    );
    eprintln!(
        "SUMMARY: host emulation vs src/reduce CPU kernels: {} mismatches",
        cpu_failures.len()
    );
    assert!(
        cpu_failures.is_empty(),
        "the kernels and the CPU kernels (src/reduce) disagree in {} cases:\n{}",
        cpu_failures.len(),
        cpu_failures[..cpu_failures.len().min(20)].join("\n")
    );
    assert!(
        failures.is_empty(),
        "{} mismatches, first ones:\n{}",
        failures.len(),
        failures[..failures.len().min(20)].join("\n")
    );
    let _ = std::fs::remove_dir_all(&dir);
}
