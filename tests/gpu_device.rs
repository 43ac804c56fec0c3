//! GPU checks (need an NVIDIA GPU, its driver and libnvrtc): the reduction kernels against the
//! independent CPU reference for every op × type, odd lengths and misaligned offsets, fresh
//! random inputs and poisoned outputs; reduction bandwidth against a device-to-device copy
//! measured in the same run; dma-buf export of device memory; the direct (GPUDirect RDMA) device's
//! copies and reductions out of a region of GPU memory, with the host standing in for the NIC.
//!
//! Without a GPU each test prints why it is skipped and passes; `DSPARK_REQUIRE_GPU=1` (set by
//! `tests/gpu/run_all.sh`) turns a skip into a failure. Lines starting with `SUMMARY:` are
//! collected by `run_all.sh` into its table.
//!
//! Run everything with `bash tests/gpu/run_all.sh` (build and run here, or build here and run the
//! prebuilt binaries on the GPU machine: see the script).

#[allow(dead_code)]
#[path = "common/procs.rs"]
mod procs;
#[path = "gpu/reference.rs"]
mod reference;

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{sys, CudaContext, CudaStream, DeviceRepr};
use dspark::internals::gpu::device::{self, DeviceAllocation, GpuReducer};
use dspark::internals::gpu::kernels::STEP_OPS;
use dspark::internals::gpu::{libcuda_present, libnvrtc_present, probe};
use dspark::{DataType, Element, Error, ReduceOp};
use half::{bf16, f16};
use reference::SplitMix64;

fn required() -> bool {
    std::env::var("DSPARK_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

fn skip(test: &str, why: &str) {
    let msg = format!("{test}: SKIPPED: {why}");
    if required() {
        panic!("{msg} (DSPARK_REQUIRE_GPU=1)");
    }
    eprintln!("{msg}");
}

/// The first GPU's context, or `None` after printing why there is none.
fn gpu(test: &str) -> Option<Arc<CudaContext>> {
    if !libcuda_present() {
        skip(test, "libcuda.so not loadable (no NVIDIA driver)");
        return None;
    }
    match device::open_context(0) {
        Ok(c) => Some(c),
        Err(e) => {
            skip(test, &e.to_string());
            None
        }
    }
}

fn reducer(test: &str) -> Option<(Arc<CudaContext>, GpuReducer)> {
    let ctx = gpu(test)?;
    if !libnvrtc_present() {
        skip(
            test,
            "libnvrtc.so not loadable (see tests/gpu/install_nvrtc.sh)",
        );
        return None;
    }
    let r =
        GpuReducer::new(&ctx).unwrap_or_else(|e| panic!("{test}: loading the kernels failed: {e}"));
    Some((ctx, r))
}

fn seed() -> u64 {
    let s = std::env::var("DSPARK_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("seed {s} (rerun with DSPARK_SEED={s})");
    s
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Inplace,
    Into,
    Finalize,
}

struct Outcome {
    cases: usize,
    failures: Vec<String>,
}

/// Runs `kind` for element type `T` on the GPU over `n` elements at element offsets `offs`
/// (dst, a, b) with fresh random inputs and a poisoned destination, and compares the whole
/// destination buffer (poison included) with the reference.
#[allow(clippy::too_many_arguments)]
fn run_case<T: Element + DeviceRepr>(
    r: &GpuReducer,
    stream: &Arc<CudaStream>,
    rng: &mut SplitMix64,
    kind: Kind,
    op: ReduceOp,
    n: usize,
    offs: (usize, usize, usize),
    world: u64,
    out: &mut Outcome,
) {
    let dtype = T::DATA_TYPE;
    let es = dtype.size();
    let slack = 16 / es + 3;
    let elems = |o: usize| o + n + slack;
    let to_t =
        |bytes: Vec<u8>| -> Vec<T> { bytes.chunks(es).map(bytemuck::pod_read_unaligned).collect() };
    let dst0 = rng.elements(dtype, elems(offs.0)); // random contents double as poison
    let a0 = rng.elements(dtype, elems(offs.1));
    let b0 = rng.elements(dtype, elems(offs.2));
    let mut dst = stream.clone_htod(&to_t(dst0.clone())).unwrap();
    let a = stream.clone_htod(&to_t(a0.clone())).unwrap();
    let b = stream.clone_htod(&to_t(b0.clone())).unwrap();
    let res = {
        let mut dv = dst.slice_mut(offs.0..offs.0 + n);
        match kind {
            Kind::Inplace => r.reduce_inplace(stream, &mut dv, &b.slice(offs.2..offs.2 + n), op),
            Kind::Into => r.reduce_into(
                stream,
                &mut dv,
                &a.slice(offs.1..offs.1 + n),
                &b.slice(offs.2..offs.2 + n),
                op,
            ),
            Kind::Finalize => r.finalize(stream, &mut dv, world as usize),
        }
    };
    res.unwrap_or_else(|e| panic!("{kind:?} {dtype} {op}: launch failed: {e}"));
    let got: Vec<T> = stream.clone_dtoh(&dst).unwrap();
    let got: Vec<u8> = bytemuck::cast_slice(&got).to_vec();
    let range = |o: usize| o * es..(o + n) * es;
    let mut want = dst0.clone();
    let result = match kind {
        Kind::Inplace => reference::apply(dtype, op, &dst0[range(offs.0)], &b0[range(offs.2)]),
        Kind::Into => reference::apply(dtype, op, &a0[range(offs.1)], &b0[range(offs.2)]),
        Kind::Finalize => reference::finalize(dtype, &dst0[range(offs.0)], world),
    };
    want[range(offs.0)].copy_from_slice(&result);
    let exact_nan = kind != Kind::Finalize && matches!(op, ReduceOp::Min | ReduceOp::Max);
    // The crate's CPU kernels on the same inputs: the GPU must agree with them too.
    let mut cpu = dst0.clone();
    match kind {
        Kind::Inplace => dspark::internals::reduce::reduce_inplace(
            dtype,
            op,
            &mut cpu[range(offs.0)],
            &b0[range(offs.2)],
        ),
        Kind::Into => dspark::internals::reduce::reduce_into(
            dtype,
            op,
            &mut cpu[range(offs.0)],
            &a0[range(offs.1)],
            &b0[range(offs.2)],
        ),
        Kind::Finalize => dspark::internals::reduce::finalize(
            dtype,
            ReduceOp::Avg,
            &mut cpu[range(offs.0)],
            world as usize,
        ),
    }
    if let Some(i) = reference::first_mismatch(dtype, &got, &cpu, exact_nan) {
        out.failures.push(format!(
            "{kind:?} {dtype} {op} n={n} offs={offs:?} world={world}: element {i} GPU {:02x?} src/reduce {:02x?}",
            &got[i * es..(i + 1) * es],
            &cpu[i * es..(i + 1) * es]
        ));
    }
    out.cases += 1;
    if let Some(i) = reference::first_mismatch(dtype, &got, &want, exact_nan) {
        out.failures.push(format!(
            "{kind:?} {dtype} {op} n={n} offs={offs:?} world={world}: element {i} (of the whole buffer; \
             range starts at {}) got {:02x?} want {:02x?}",
            offs.0,
            &got[i * es..(i + 1) * es],
            &want[i * es..(i + 1) * es]
        ));
    }
}

fn run_type<T: Element + DeviceRepr>(
    r: &GpuReducer,
    stream: &Arc<CudaStream>,
    rng: &mut SplitMix64,
    out: &mut Outcome,
) {
    let per_vec = 16 / T::DATA_TYPE.size();
    let lengths = [1usize, 2, 3, 17, 255, 1001, 65_537, (1 << 20) + 3];
    let offsets = [
        (0, 0, 0),
        (1, 1, 1),
        (per_vec - 1, per_vec - 1, per_vec - 1),
        (1, 0, 2),
        (0, 3, 1),
    ];
    for (li, &n) in lengths.iter().enumerate() {
        for (oi, &offs) in offsets.iter().enumerate() {
            // The largest length only with two offset patterns, to bound the CPU reference time.
            if n > 100_000 && oi > 1 {
                continue;
            }
            for op in STEP_OPS {
                run_case::<T>(r, stream, rng, Kind::Inplace, op, n, offs, 1, out);
                run_case::<T>(r, stream, rng, Kind::Into, op, n, offs, 1, out);
            }
            let world = [1u64, 2, 3, 7, 300][(li + oi) % 5];
            run_case::<T>(
                r,
                stream,
                rng,
                Kind::Finalize,
                ReduceOp::Avg,
                n,
                offs,
                world,
                out,
            );
        }
    }
}

#[test]
fn kernels_match_the_cpu_reference_for_every_op_and_type_on_the_gpu() {
    let Some((ctx, r)) =
        reducer("kernels_match_the_cpu_reference_for_every_op_and_type_on_the_gpu")
    else {
        return;
    };
    reference::self_check();
    let stream = ctx.new_stream().unwrap();
    let mut rng = SplitMix64(seed());
    let mut out = Outcome {
        cases: 0,
        failures: Vec::new(),
    };
    let start = Instant::now();
    for dtype in DataType::ALL {
        let before = (out.cases, out.failures.len());
        match dtype {
            DataType::I8 => run_type::<i8>(&r, &stream, &mut rng, &mut out),
            DataType::U8 => run_type::<u8>(&r, &stream, &mut rng, &mut out),
            DataType::I32 => run_type::<i32>(&r, &stream, &mut rng, &mut out),
            DataType::U32 => run_type::<u32>(&r, &stream, &mut rng, &mut out),
            DataType::I64 => run_type::<i64>(&r, &stream, &mut rng, &mut out),
            DataType::U64 => run_type::<u64>(&r, &stream, &mut rng, &mut out),
            DataType::F16 => run_type::<f16>(&r, &stream, &mut rng, &mut out),
            DataType::BF16 => run_type::<bf16>(&r, &stream, &mut rng, &mut out),
            DataType::F32 => run_type::<f32>(&r, &stream, &mut rng, &mut out),
            DataType::F64 => run_type::<f64>(&r, &stream, &mut rng, &mut out),
        }
        eprintln!(
            "SUMMARY: kernels {}: {} cases, {} wrong",
            dtype.rust_name(),
            out.cases - before.0,
            out.failures.len() - before.1
        );
    }
    let (s, l) = r.build().spill_bytes();
    eprintln!(
        "SUMMARY: kernels: {} cases over 10 types x (4 ops x 2 kinds + finalize), {} wrong, arch {} ({}), \
         spills {s}/{l} B, {:.1} s",
        out.cases,
        out.failures.len(),
        r.arch(),
        if r.is_cubin() { "CUBIN" } else { "PTX JIT" },
        start.elapsed().as_secs_f64()
    );
    assert!(
        out.failures.is_empty(),
        "{} wrong:\n{}",
        out.failures.len(),
        out.failures[..out.failures.len().min(20)].join("\n")
    );
}

fn gbps(bytes: f64, ms: f64) -> f64 {
    bytes / (ms * 1e-3) / 1e9
}

/// Mean milliseconds per call of `f` over `iters` calls after `warm` warm-up calls, timed with
/// CUDA events on `stream`.
fn time_ms(stream: &Arc<CudaStream>, warm: usize, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..warm {
        f();
    }
    let start = stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    for _ in 0..iters {
        f();
    }
    let end = stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    f64::from(start.elapsed_ms(&end).unwrap()) / iters as f64
}

/// Bandwidth of `dst += src` and `dst = a + b` on `T` over `bytes`, and of a device-to-device
/// copy of the same size, as bytes moved per second (copy: read + write; reductions: two reads
/// and a write). Returns (copy, inplace, into) in GB/s.
fn measure<T: Element + DeviceRepr>(
    r: &GpuReducer,
    stream: &Arc<CudaStream>,
    bytes: usize,
) -> (f64, f64, f64) {
    let n = bytes / T::DATA_TYPE.size();
    let zeros = vec![T::default(); n];
    let a = stream.clone_htod(&zeros).unwrap();
    let mut b = stream.clone_htod(&zeros).unwrap();
    let mut c = stream.clone_htod(&zeros).unwrap();
    drop(zeros);
    let iters = ((4usize << 30) / bytes).clamp(5, 200);
    let copy_ms = time_ms(stream, 3, iters, || stream.memcpy_dtod(&a, &mut b).unwrap());
    let inplace_ms = time_ms(stream, 3, iters, || {
        r.reduce_inplace(stream, &mut b, &a, ReduceOp::Sum).unwrap()
    });
    let into_ms = time_ms(stream, 3, iters, || {
        r.reduce_into(stream, &mut c, &a, &b, ReduceOp::Sum)
            .unwrap()
    });
    (
        gbps(2.0 * bytes as f64, copy_ms),
        gbps(3.0 * bytes as f64, inplace_ms),
        gbps(3.0 * bytes as f64, into_ms),
    )
}

#[test]
fn reduction_bandwidth_reaches_85_percent_of_a_device_copy_at_64_mib_and_above() {
    let Some((ctx, r)) =
        reducer("reduction_bandwidth_reaches_85_percent_of_a_device_copy_at_64_mib_and_above")
    else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let mut worst: f64 = f64::INFINITY;
    eprintln!(
        "{:>10} {:>5} {:>11} {:>14} {:>11} {:>6}",
        "size", "type", "copy GB/s", "inplace GB/s", "into GB/s", "ratio"
    );
    for mib in [1usize, 16, 64, 256, 1024] {
        let bytes = mib << 20;
        for dtype in [DataType::F32, DataType::BF16, DataType::F16] {
            let (copy, inplace, into) = match dtype {
                DataType::F32 => measure::<f32>(&r, &stream, bytes),
                DataType::BF16 => measure::<bf16>(&r, &stream, bytes),
                _ => measure::<f16>(&r, &stream, bytes),
            };
            let ratio = inplace.min(into) / copy;
            let name = dtype.rust_name();
            eprintln!(
                "{mib:>6} MiB {name:>5} {copy:>11.0} {inplace:>14.0} {into:>11.0} {:>5.0}%",
                ratio * 100.0
            );
            eprintln!(
                "SUMMARY: bandwidth {mib} MiB {name} sum: copy {copy:.0} GB/s, inplace {inplace:.0} GB/s, \
                 into {into:.0} GB/s = {:.0}% of copy",
                ratio * 100.0
            );
            if mib >= 64 {
                worst = worst.min(ratio);
            }
        }
    }
    eprintln!(
        "SUMMARY: bandwidth: worst at >= 64 MiB {:.0}% of a device copy (goal >= 85%)",
        worst * 100.0
    );
    assert!(
        worst >= 0.85,
        "reduction bandwidth {:.0}% of a device copy at >= 64 MiB (goal 85%)",
        worst * 100.0
    );
}

#[test]
fn device_memory_exports_as_a_dma_buf_of_the_right_size() {
    let Some(ctx) = gpu("device_memory_exports_as_a_dma_buf_of_the_right_size") else {
        return;
    };
    let cuda = probe::probe_cuda().unwrap();
    let info = &cuda.devices[0];
    let mem = DeviceAllocation::new(&ctx, 64 << 20).unwrap();
    match mem.export_dmabuf() {
        Ok(fd) => {
            use std::os::fd::AsRawFd;
            let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            let size: i64 = nix::unistd::lseek(&fd, 0, nix::unistd::Whence::SeekEnd).unwrap_or(-1);
            eprintln!(
                "SUMMARY: dma-buf: exported {} MiB of device memory as fd {} ({link}), size by lseek {size} \
                 (DMA_BUF_SUPPORTED={:?})",
                mem.len() >> 20,
                fd.as_raw_fd(),
                info.dma_buf_supported
            );
            assert!(
                link.contains("dmabuf"),
                "the descriptor is a dma-buf: {link}"
            );
            assert_eq!(size, mem.len() as i64, "dma-buf size");
        }
        Err(e @ Error::Unavailable { .. }) => {
            eprintln!(
                "SUMMARY: dma-buf: UNAVAILABLE on this GPU/driver: {e} (DMA_BUF_SUPPORTED={:?})",
                info.dma_buf_supported
            );
            assert_ne!(
                info.dma_buf_supported,
                Some(true),
                "the attribute says dma-buf is supported, but export failed: {e}"
            );
        }
        Err(e) => panic!("dma-buf export failed: {e}"),
    }
    let flush = device::flush_gpudirect_writes(&ctx);
    eprintln!(
        "SUMMARY: flush GPUDirect writes: {}",
        flush.map_or_else(|e| format!("not available: {e}"), |_| "ok".into())
    );
}

/// Times `f` once (wall clock, milliseconds).
fn wall_ms(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e3
}

/// One rank of the staged all-reduce check: correctness on the first call, then the staged
/// all-reduce time and each stage alone over the same bytes (device→host copies of every
/// segment, host all-reduce over TCP, host→device copies plus the reduction kernel), all ranks
/// running each measurement together. Returns (total, d2h, wire, h2d+reduce) in ms.
fn staged_rank(
    comm: &dspark::Communicator,
    ctx: &Arc<CudaContext>,
    r: &GpuReducer,
    count: usize,
    seg: usize,
) -> Result<(f64, f64, f64, f64), String> {
    use dspark::internals::engine::staged::{DevRange, StagedDevice};
    use dspark::internals::engine::Call;
    use dspark::internals::gpu::staged::{CudaStagedDevice, StagingPool};
    use dspark::internals::plan::{Buf, Collective};
    let e = |w: &'static str| move |x: Error| format!("{w}: {x}");
    let rank = comm.rank();
    let world = comm.world_size();
    let stream = ctx.new_stream().map_err(|x| format!("stream: {x:?}"))?;
    let mut pool = StagingPool::new(ctx, 4, 4, seg).map_err(e("staging pool"))?;
    // Exactly representable inputs: small integers, so every order of summation agrees.
    let input: Vec<f32> = (0..count).map(|i| ((i % 1000) + rank) as f32).collect();
    let want: Vec<f32> = (0..count)
        .map(|i| (0..world).map(|q| ((i % 1000) + q) as f32).sum())
        .collect();
    let mut buf = stream
        .clone_htod(&input)
        .map_err(|x| format!("htod: {x:?}"))?;
    let mut call = Call::new(Collective::AllReduce, Some(ReduceOp::Sum), count, 0, false);
    call.dtype = DataType::F32;
    let mut run = |buf: &mut cudarc::driver::CudaSlice<f32>| -> Result<(), String> {
        // SAFETY: the device is a local, dropped in this scope (never leaked).
        let mut dev = unsafe {
            CudaStagedDevice::new::<f32, cudarc::driver::CudaSlice<f32>, _>(
                r,
                &stream,
                None,
                Some(buf),
                &mut pool,
            )
        }
        .map_err(e("staged device"))?;
        comm.run_staged(call, &mut dev).map_err(e("run_staged"))
    };
    run(&mut buf)?;
    let got: Vec<f32> = stream
        .clone_dtoh(&buf)
        .map_err(|x| format!("dtoh: {x:?}"))?;
    if let Some(i) = (0..count).find(|&i| got[i] != want[i]) {
        return Err(format!(
            "rank {rank}: element {i} is {} instead of {}",
            got[i], want[i]
        ));
    }
    // Timed: the staged all-reduce (values keep growing but stay exact for a few calls).
    comm.barrier().map_err(e("barrier"))?;
    // The timed call's result is checked: an erroring run would finish early and make the
    // overlap ratio look good.
    let mut timed = Ok(());
    let total = wall_ms(|| timed = run(&mut buf));
    timed.map_err(|x| format!("timed staged all-reduce: {x}"))?;
    // Stage: device -> pinned host, every segment.
    let bytes = count * 4;
    let mut scratch_dst = stream
        .clone_htod(&input)
        .map_err(|x| format!("htod: {x:?}"))?;
    comm.barrier().map_err(e("barrier"))?;
    let d2h = {
        // SAFETY: the device is a local, dropped in this scope (never leaked).
        let mut dev = unsafe {
            CudaStagedDevice::new::<f32, cudarc::driver::CudaSlice<f32>, _>(
                r,
                &stream,
                None,
                Some(&mut scratch_dst),
                &mut pool,
            )
        }
        .map_err(e("staged device"))?;
        let t = Instant::now();
        for (k, start) in (0..bytes).step_by(seg).enumerate() {
            let range = DevRange {
                buf: Buf::Dst,
                bytes: start..(start + seg).min(bytes),
            };
            dev.d2h(&range, k % 4).map_err(e("d2h"))?;
        }
        dev.synchronize(Instant::now() + std::time::Duration::from_secs(60))
            .map_err(e("sync"))?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        // Stage: pinned host -> device plus the reduction kernel, every segment.
        comm.barrier().map_err(e("barrier"))?;
        let t = Instant::now();
        for (k, start) in (0..bytes).step_by(seg).enumerate() {
            let end = (start + seg).min(bytes);
            let acc = DevRange {
                buf: Buf::Dst,
                bytes: start..end,
            };
            dev.h2d_reduce(4 + k % 4, start..end, &acc, DataType::F32, ReduceOp::Sum)
                .map_err(e("h2d_reduce"))?;
        }
        dev.synchronize(Instant::now() + std::time::Duration::from_secs(60))
            .map_err(e("sync"))?;
        (ms, t.elapsed().as_secs_f64() * 1e3)
    };
    // Stage: the wire (host all-reduce of the same bytes over the same transport).
    let mut host = input.clone();
    comm.barrier().map_err(e("barrier"))?;
    let mut wired = Ok(());
    let wire = wall_ms(|| wired = comm.all_reduce(&mut host, ReduceOp::Sum));
    wired.map_err(e("wire all-reduce"))?;
    Ok((total, d2h.0, wire, d2h.1))
}

#[test]
fn staged_all_reduce_over_tcp_between_two_ranks_on_one_gpu_overlaps_its_stages() {
    let name = "staged_all_reduce_over_tcp_between_two_ranks_on_one_gpu_overlaps_its_stages";
    let Some((ctx, r)) = reducer(name) else {
        return;
    };
    let mut worst: f64 = 0.0;
    for mib in [16usize, 256] {
        let count = (mib << 20) / 4;
        let port = procs::free_port();
        let results: Vec<Result<(f64, f64, f64, f64), String>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|rank| {
                    let (ctx, r) = (&ctx, &r);
                    s.spawn(move || {
                        let mut cfg = dspark::Config::new(rank, 2, format!("127.0.0.1:{port}"));
                        cfg.transport = dspark::config::TransportChoice::Tcp;
                        cfg.timeout = std::time::Duration::from_secs(120);
                        let seg = cfg.segment_bytes;
                        let comm =
                            dspark::Communicator::init(cfg).map_err(|e| format!("init: {e}"))?;
                        staged_rank(&comm, ctx, r, count, seg)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("rank panicked".into())))
                .collect()
        });
        for res in &results {
            if let Err(e) = res {
                panic!("{mib} MiB: {e}");
            }
        }
        let (total, d2h, wire, h2d) = results[0].clone().unwrap();
        let slowest = d2h.max(wire).max(h2d);
        let ratio = total / slowest;
        worst = worst.max(ratio);
        eprintln!(
            "SUMMARY: staged all_reduce {mib} MiB f32, 2 ranks on one GPU over TCP: total {total:.1} ms; \
             stages alone: d2h {d2h:.1} ms, wire (host all_reduce) {wire:.1} ms, h2d+reduce {h2d:.1} ms; \
             total = {ratio:.2}x the slowest stage (goal <= 1.2x)"
        );
    }
    assert!(worst <= 1.2, "staged all-reduce took {worst:.2}x its slowest stage (goal <= 1.2x: the stages do not overlap)");
}

/// One case of the direct device check: `n` elements of `dtype` "land" (written by the host in
/// place of the NIC) in landing slot 1 of peer 1, then are consumed three ways into `Dst` —
/// copied, reduced with an accumulator in `Src`, reduced in place with `Dst` — and the copied
/// range is sent (copied into send slot 1). A fourth range of `Dst` must keep its poison.
#[allow(clippy::too_many_arguments)]
fn direct_case(
    r: &GpuReducer,
    stream: &Arc<CudaStream>,
    region: &dspark::internals::gpu::direct::DirectRegion,
    rng: &mut SplitMix64,
    dtype: DataType,
    op: ReduceOp,
    n: usize,
    failures: &mut Vec<String>,
) {
    use dspark::internals::engine::staged::{DevRange, StagedDevice};
    use dspark::internals::gpu::direct::CudaDirectDevice;
    use dspark::internals::plan::Buf;
    let es = dtype.size();
    let b = n * es;
    let layout = region.layout();
    assert!(b <= layout.slot_bytes, "case larger than a slot");
    let landing = layout.landing(1, 1);
    let incoming = rng.elements(dtype, n);
    let acc = rng.elements(dtype, n);
    let dst0 = rng.elements(dtype, 4 * n); // [copy | reduce | in place (acc) | poison]
    region.write_from_host(landing, &incoming).unwrap();
    let src = stream.clone_htod(&acc).unwrap();
    let mut dst = stream.clone_htod(&dst0).unwrap();
    let case = format!("{dtype} {op} n={n}");
    {
        // SAFETY: the device is a local, dropped in this scope (never leaked).
        let mut dev = unsafe {
            CudaDirectDevice::new::<u8, cudarc::driver::CudaSlice<u8>, _>(
                r,
                stream,
                Some(&src),
                Some(&mut dst),
                region,
                2,
            )
        }
        .unwrap_or_else(|e| panic!("{case}: direct device: {e}"));
        assert!(dev.direct());
        assert_eq!((dev.send_slots(), dev.recv_slots()), (2, 0));
        assert_eq!(dev.slot_bytes(), layout.slot_bytes);
        assert_eq!(dev.buffer_bytes(), (b, 4 * b));
        let range = |k: usize| k * b..(k + 1) * b;
        dev.land(landing, range(0), None, dtype, op).unwrap();
        let a = DevRange {
            buf: Buf::Src,
            bytes: 0..b,
        };
        dev.land(landing, range(1), Some(&a), dtype, op).unwrap();
        let a = DevRange {
            buf: Buf::Dst,
            bytes: range(2),
        };
        dev.land(landing, range(2), Some(&a), dtype, op).unwrap();
        let landed = dev.mark().unwrap();
        let sent = DevRange {
            buf: Buf::Dst,
            bytes: range(0),
        };
        dev.d2h(&sent, 1).unwrap();
        // Misuse is a typed error, never a panic or an out-of-bounds access.
        assert!(dev
            .land(region.len() - es, 0..2 * es, None, dtype, op)
            .is_err());
        assert!(
            dev.d2h(&sent, 2).is_err(),
            "send slot beyond the device's 2"
        );
        assert!(dev.h2d(0, 0..es).is_err(), "no host slots in direct mode");
        assert!(dev.slot(0).is_empty());
        dev.synchronize(Instant::now() + std::time::Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{case}: synchronize: {e}"));
        assert!(dev.reached(landed).unwrap());
    }
    let got: Vec<u8> = stream.clone_dtoh(&dst).unwrap();
    let mut sent = vec![0u8; b];
    region.read_to_host(layout.send(1), &mut sent).unwrap();
    // The crate's CPU kernels, and the independent reference, on the same inputs.
    let mut want = dst0.clone();
    want[..b].copy_from_slice(&incoming);
    dspark::internals::reduce::reduce_into(dtype, op, &mut want[b..2 * b], &acc, &incoming);
    let in_place = dst0[2 * b..3 * b].to_vec();
    dspark::internals::reduce::reduce_into(
        dtype,
        op,
        &mut want[2 * b..3 * b],
        &in_place,
        &incoming,
    );
    let mut independent = want.clone();
    independent[b..2 * b].copy_from_slice(&reference::apply(dtype, op, &acc, &incoming));
    independent[2 * b..3 * b].copy_from_slice(&reference::apply(dtype, op, &in_place, &incoming));
    let exact_nan = reference::exact_nan(Some(op));
    for (what, want) in [("src/reduce", &want), ("reference", &independent)] {
        if let Some(i) = reference::first_mismatch(dtype, &got, want, exact_nan) {
            failures.push(format!(
                "{case}: element {i} of Dst ({}) GPU {:02x?} {what} {:02x?}",
                ["copied", "reduced with Src", "reduced in place", "poison"][i / n.max(1)],
                &got[i * es..(i + 1) * es],
                &want[i * es..(i + 1) * es]
            ));
        }
    }
    if sent != incoming {
        failures.push(format!(
            "{case}: send slot 1 does not hold the copied payload"
        ));
    }
}

#[test]
fn direct_device_lands_reduces_and_sends_from_a_region_of_gpu_memory() {
    use dspark::internals::gpu::direct::{CudaDirectDevice, DirectRegion};
    use dspark::internals::transport::DirectLayout;
    let name = "direct_device_lands_reduces_and_sends_from_a_region_of_gpu_memory";
    let Some((ctx, r)) = reducer(name) else {
        return;
    };
    let layout = DirectLayout {
        world: 2,
        slots: 2,
        slot_bytes: 256 << 10,
        send_slots: 2,
    };
    let region = match DirectRegion::new(&ctx, layout) {
        Ok(region) => region,
        Err(e @ Error::Unavailable { .. }) => {
            skip(name, &format!("no direct region on this GPU/driver: {e}"));
            return;
        }
        Err(e) => panic!("direct region: {e}"),
    };
    let mut zeros = vec![0xffu8; region.len()];
    region.read_to_host(0, &mut zeros).unwrap();
    assert!(zeros.iter().all(|&x| x == 0), "the region starts zeroed");
    let (kinds, why_not) = region.registration_candidates();
    eprintln!(
        "SUMMARY: direct region: {} KiB on GPU {}; NIC registration candidates {kinds:?}; not: {}",
        region.len() >> 10,
        region.ctx().ordinal(),
        if why_not.is_empty() {
            "-".to_string()
        } else {
            why_not.join("; ")
        }
    );
    assert_eq!(kinds.len() + why_not.len(), 2, "one verdict per mechanism");
    // Asking the same twice gives the same descriptor (exported once, kept by the region).
    assert_eq!(region.registration_candidates().0, kinds);
    let stream = ctx.new_stream().unwrap();
    let mut rng = SplitMix64(seed());
    let mut failures = Vec::new();
    let mut cases = 0;
    for (dtype, op, lengths) in [
        (DataType::F32, ReduceOp::Sum, [1usize, 3, 1001, 50_001]),
        (DataType::BF16, ReduceOp::Max, [1, 3, 1001, 100_003]),
    ] {
        for n in lengths {
            direct_case(&r, &stream, &region, &mut rng, dtype, op, n, &mut failures);
            cases += 1;
        }
    }
    // A stream of another GPU is refused by name (only checkable with two GPUs).
    if let Ok(other) = device::open_context(1) {
        let s1 = other.new_stream().unwrap();
        let mut buf = s1.alloc_zeros::<f32>(16).unwrap();
        // SAFETY: the device is a local, dropped in this scope (never leaked).
        let e = unsafe {
            CudaDirectDevice::new::<f32, cudarc::driver::CudaSlice<f32>, _>(
                &r,
                &s1,
                None,
                Some(&mut buf),
                &region,
                1,
            )
        }
        .unwrap_err();
        assert!(
            e.to_string().contains("GPU 0") && e.to_string().contains("GPU 1"),
            "{e}"
        );
    }
    eprintln!(
        "SUMMARY: direct device: {cases} cases (f32 sum, bf16 max; copy, reduce, reduce in place, \
         send), {} wrong",
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// #11 item 4: the safe `slot`/`slot_mut` of the staged device never show pinned memory that
/// a queued asynchronous copy may still be writing: empty until the mark after the copy is
/// reached, the copied bytes after it.
#[test]
fn a_staging_slot_is_hidden_while_a_copy_into_it_may_run() {
    use dspark::internals::engine::staged::{DevRange, StagedDevice};
    use dspark::internals::gpu::staged::{CudaStagedDevice, StagingPool};
    use dspark::internals::plan::Buf;
    let test = "a_staging_slot_is_hidden_while_a_copy_into_it_may_run";
    let Some((ctx, r)) = reducer(test) else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let seg = 1 << 20;
    let mut pool = StagingPool::new(&ctx, 2, 2, seg).unwrap();
    let input: Vec<u8> = (0..seg).map(|i| (i % 251) as u8).collect();
    let mut buf = stream.clone_htod(&input).unwrap();
    // SAFETY: the device is a local, dropped in this scope (never leaked).
    let mut dev = unsafe {
        CudaStagedDevice::new::<u8, cudarc::driver::CudaSlice<u8>, _>(
            &r,
            &stream,
            None,
            Some(&mut buf),
            &mut pool,
        )
    }
    .unwrap();
    assert_eq!(dev.slot(0).len(), seg, "an untouched slot is visible");
    let range = DevRange {
        buf: Buf::Dst,
        bytes: 0..seg,
    };
    dev.d2h(&range, 0).unwrap();
    assert!(
        dev.slot(0).is_empty(),
        "a slot under a queued copy must be hidden"
    );
    assert!(
        dev.slot_mut(0).is_empty(),
        "a slot under a queued copy must be hidden"
    );
    assert_eq!(dev.slot(1).len(), seg, "other slots stay visible");
    let m = dev.mark().unwrap();
    dev.synchronize(Instant::now() + std::time::Duration::from_secs(60))
        .unwrap();
    assert!(dev.reached(m).unwrap());
    assert_eq!(dev.slot(0), &input[..], "after the mark: the copied bytes");
}

/// Two ranks (threads, one GPU each on the same device, TCP between them) through
/// `f(comm, ctx)`; returns each rank's result.
fn two_ranks_on_one_gpu(
    ctx: &Arc<CudaContext>,
    timeout: std::time::Duration,
    f: impl Fn(&dspark::Communicator, &Arc<CudaContext>) -> Result<String, String> + Sync,
) -> Vec<Result<String, String>> {
    let tcp = dspark::config::TransportChoice::Tcp;
    two_ranks_on_one_gpu_over(ctx, timeout, tcp, f)
}

/// [`two_ranks_on_one_gpu`] over `transport`.
fn two_ranks_on_one_gpu_over(
    ctx: &Arc<CudaContext>,
    timeout: std::time::Duration,
    transport: dspark::config::TransportChoice,
    f: impl Fn(&dspark::Communicator, &Arc<CudaContext>) -> Result<String, String> + Sync,
) -> Vec<Result<String, String>> {
    let port = procs::free_port();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let f = &f;
                s.spawn(move || {
                    let mut cfg = dspark::Config::new(rank, 2, format!("127.0.0.1:{port}"));
                    cfg.transport = transport;
                    cfg.timeout = timeout;
                    let comm = dspark::Communicator::init(cfg).map_err(|e| format!("init: {e}"))?;
                    f(&comm, ctx)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("rank panicked".into())))
            .collect()
    })
}

/// #8: non-blocking device collectives are queued on the caller's stream and return at
/// once; work queued on that stream afterwards (here: copies back to the host, issued before
/// anybody waits for a `Work`) sees their results; a leaked `Work` (its buffer forgotten too,
/// as `enqueue`'s contract asks) is harmless; ranks that disagree fail both `Work`s with a
/// mismatch and leave no stream waiting forever.
#[test]
fn enqueued_device_collectives_are_ordered_on_the_callers_stream_and_return_at_once() {
    let name = "enqueued_device_collectives_are_ordered_on_the_callers_stream_and_return_at_once";
    let Some((ctx, _r)) = reducer(name) else {
        return;
    };
    // Both ranks have issued their calls before either blocks in a copy to or from its
    // stream: the two ranks are threads of one process here, sharing the CUDA context, and
    // a thread blocked in such a copy (seen on an H200, driver 580: cuMemcpyDtoHAsync into
    // pageable memory) holds a context lock that creating an event (cudarc makes events for
    // each buffer it allocates) waits for; so one rank's copy, waiting for a collective,
    // would stall the other rank's issue of it. Ranks in separate processes (the real case)
    // share no such lock, and the library's progress thread makes no event or allocation
    // while a call runs (what this test checks: it used to make events, and stalled so).
    let issued_all = (std::sync::Mutex::new(0usize), std::sync::Condvar::new());
    let results = two_ranks_on_one_gpu(&ctx, std::time::Duration::from_secs(60), |comm, ctx| {
        let rank = comm.rank();
        let e = |w: &'static str| move |x: Error| format!("rank {rank}: {w}: {x}");
        let d = |w: &'static str| {
            move |x: cudarc::driver::DriverError| format!("rank {rank}: {w}: {x:?}")
        };
        let meet = || -> Result<(), String> {
            let (count, cv) = &issued_all;
            let mut n = count.lock().unwrap();
            *n += 1;
            cv.notify_all();
            let (n, t) = cv
                .wait_timeout_while(n, std::time::Duration::from_secs(60), |n| *n < 2)
                .unwrap();
            drop(n);
            if t.timed_out() {
                return Err(format!(
                    "rank {rank}: the other rank never issued its calls"
                ));
            }
            Ok(())
        };
        let stream = ctx.new_stream().map_err(d("stream"))?;
        // Large enough that the collective is still in flight when the copies are queued.
        let big = (8 << 20) + 3; // elements: 32 MiB + 12 B of f32, an odd count
        let a: Vec<f32> = (0..big).map(|i| ((i % 977) * (rank + 1)) as f32).collect();
        let want_a: Vec<f32> = (0..big).map(|i| ((i % 977) * 3) as f32).collect();
        // The buffers of the calls are freed only after every call succeeded: an early
        // return (a failed check) leaks them, as `enqueue`'s contract asks while calls may
        // still run on them.
        use std::mem::ManuallyDrop;
        let mut buf_a = ManuallyDrop::new(stream.clone_htod(&a).map_err(d("htod"))?);
        let g: Vec<i32> = (0..13).map(|i| i * 10 + rank as i32).collect();
        let send_g = ManuallyDrop::new(stream.clone_htod(&g).map_err(d("htod"))?);
        let mut recv_g = ManuallyDrop::new(stream.alloc_zeros::<i32>(26).map_err(d("alloc"))?);
        let mut bc = ManuallyDrop::new(
            stream
                .clone_htod(&vec![rank as u64 * 7 + 1; 1001])
                .map_err(d("htod"))?,
        );
        // Uploaded before the first call: a copy from pageable host memory into a stream
        // that waits for a collective blocks until the stream gets there (see `meet`).
        let mut tmp = stream.clone_htod(&vec![1.5f32; 4099]).map_err(d("htod"))?;
        let t0 = Instant::now();
        let q = || {
            // SAFETY: every call made through it below keeps its buffers until its Work
            // succeeded (`ManuallyDrop`, freed only after the waits; `x` only when its Work
            // says no device work is left), and `tmp`, whose Work is forgotten, is forgotten.
            unsafe { comm.enqueue() }
        };
        let w1 = q()
            .all_reduce(&mut *buf_a, ReduceOp::Sum, &stream)
            .map_err(e("enqueue all_reduce"))?;
        let w2 = q()
            .all_gather(&*send_g, &mut *recv_g, &stream)
            .map_err(e("enqueue all_gather"))?;
        let w3 = q()
            .broadcast(&mut *bc, 1, &stream)
            .map_err(e("enqueue broadcast"))?;
        // A leaked Work: the call still runs, and the stream still waits for it. Its buffer
        // must then never be freed (the contract of `enqueue`): dropping it here made cudarc
        // free it before the progress thread issued its copies, which an H200 refused
        // (CUDA_ERROR_INVALID_VALUE), poisoning the communicator.
        {
            let w = q()
                .all_reduce(&mut tmp, ReduceOp::Max, &stream)
                .map_err(e("enqueue"))?;
            std::mem::forget(w);
            std::mem::forget(tmp);
        }
        let issued = t0.elapsed();
        if let Some(why) = comm.enqueue_blocks(ctx.ordinal()) {
            return Err(format!(
                "rank {rank}: non-blocking device calls block here: {why}"
            ));
        }
        meet()?;
        // Queued on the stream after the collectives, before any wait.
        let got_a: Vec<f32> = stream.clone_dtoh(&*buf_a).map_err(d("dtoh"))?;
        let got_g: Vec<i32> = stream.clone_dtoh(&*recv_g).map_err(d("dtoh"))?;
        let got_b: Vec<u64> = stream.clone_dtoh(&*bc).map_err(d("dtoh"))?;
        let done = t0.elapsed();
        if let Some(i) = (0..big).find(|&i| got_a[i] != want_a[i]) {
            return Err(format!("rank {rank}: all_reduce element {i} is {} instead of {} (the copy did not wait for the collective?)", got_a[i], want_a[i]));
        }
        let want_g: Vec<i32> = (0..2)
            .flat_map(|q| (0..13).map(move |i| i * 10 + q))
            .collect();
        if got_g != want_g {
            return Err(format!("rank {rank}: all_gather gave {got_g:?}"));
        }
        if got_b.iter().any(|&v| v != 8) {
            return Err(format!("rank {rank}: broadcast gave {:?}", &got_b[..4]));
        }
        for w in [w1, w2, w3] {
            w.wait().map_err(e("wait"))?;
        }
        drop(ManuallyDrop::into_inner(buf_a));
        drop(ManuallyDrop::into_inner(send_g));
        drop(ManuallyDrop::into_inner(recv_g));
        drop(ManuallyDrop::into_inner(bc));
        // Disagreeing calls: both fail with a mismatch, and the stream goes on (the doorbell
        // rang).
        let n = if rank == 0 { 1000 } else { 999 };
        let mut x = stream.alloc_zeros::<f32>(n).map_err(d("alloc"))?;
        let w = q()
            .all_reduce(&mut x, ReduceOp::Sum, &stream)
            .map_err(e("enqueue"))?;
        // `wait_timeout` borrows the Work (as `wait` does), so whether device work was left
        // on `x` can be read after it.
        let failed = w.wait_timeout(std::time::Duration::from_secs(120));
        let stuck = w.buffers_may_be_in_use() || matches!(w.test(), Ok(false));
        let t = Instant::now();
        stream
            .synchronize()
            .map_err(d("synchronize after a failed call"))?;
        if stuck {
            std::mem::forget(x);
            return Err(format!(
                "rank {rank}: a mismatched call is still running or left device work on its \
                 buffer: {failed:?}"
            ));
        }
        match &failed {
            Ok(()) => return Err(format!("rank {rank}: a mismatched call succeeded")),
            Err(Error::Mismatch { .. }) => {}
            Err(other) => {
                return Err(format!(
                    "rank {rank}: a mismatched call failed, but not with a mismatch: {other}"
                ))
            }
        }
        drop(x);
        drop(w);
        Ok(format!(
            "issue of 4 calls {:.3} ms, results on the stream after {:.1} ms; failed call: {}, stream free after {:.1} ms",
            issued.as_secs_f64() * 1e3,
            done.as_secs_f64() * 1e3,
            failed.unwrap_err(),
            t.elapsed().as_secs_f64() * 1e3
        ))
    });
    for (rank, r) in results.iter().enumerate() {
        match r {
            Ok(s) => eprintln!("SUMMARY: enqueue rank {rank}: {s}"),
            Err(e) => panic!("{e}"),
        }
    }
}

/// Small all_reduces between a rank whose buffer is device memory and a host rank over shared
/// memory: the host rank runs them one-shot through the transport's slots, so the device rank
/// must too (a host copy of its buffer, the slots protocol, the copy back); before, it sent
/// the one-shot schedule's frames and both failed with a mismatch. Each rank on the device in
/// turn, then both; f32 at 1, 2, 7, 13, 1016, 1024 (4096 bytes, the one-shot bound) and
/// 1025 elements (frames), i64 and f64 at a few counts (512: the bound; 513: frames); every operator; exact integer-valued
/// inputs against a reference computed here.
#[test]
fn small_device_all_reduces_run_one_shot_with_a_host_rank_over_shared_memory() {
    let name = "small_device_all_reduces_run_one_shot_with_a_host_rank_over_shared_memory";
    let Some((ctx, _r)) = reducer(name) else {
        return;
    };
    let shm = dspark::config::TransportChoice::Shm;
    for on_device in [[true, false], [false, true], [true, true]] {
        let results = two_ranks_on_one_gpu_over(
            &ctx,
            std::time::Duration::from_secs(60),
            shm,
            |comm, ctx| {
                let rank = comm.rank();
                let dev = on_device[rank];
                let algo = comm.algorithm(dspark::internals::plan::Collective::AllReduce, 4096);
                if algo != dspark::internals::plan::Algorithm::OneShot {
                    return Err(format!(
                        "rank {rank}: 4096 bytes run {algo}, not one_shot over shm"
                    ));
                }
                let stream = ctx
                    .new_stream()
                    .map_err(|e| format!("rank {rank}: stream: {e:?}"))?;
                let mut calls = 0;
                for op in ReduceOp::ALL {
                    for count in [1, 2, 7, 13, 1016, 1024, 1025] {
                        small_case::<f32>(comm, &stream, dev, op, count)?;
                        calls += 1;
                    }
                    for count in [1, 7, 508, 512, 513] {
                        small_case::<i64>(comm, &stream, dev, op, count)?;
                        small_case::<f64>(comm, &stream, dev, op, count)?;
                        calls += 2;
                    }
                }
                Ok(format!(
                    "{calls} calls exact, {}",
                    if dev { "device" } else { "host" }
                ))
            },
        );
        for (rank, r) in results.iter().enumerate() {
            match r {
                Ok(s) => eprintln!("SUMMARY: one-shot device/host {on_device:?} rank {rank}: {s}"),
                Err(e) => panic!("{e}"),
            }
        }
    }
}

/// `Communicator::all_to_all_v_device` (torch's all_to_all on CUDA tensors): uneven blocks,
/// empty ones, and blocks of several segments (up to ~1.2 MiB of f32 between a pair), with the
/// other rank on device or host memory (the same frames), three calls each; against the
/// blocks computed here.
#[test]
fn device_all_to_all_v_delivers_uneven_blocks_with_a_device_or_host_peer() {
    let name = "device_all_to_all_v_delivers_uneven_blocks_with_a_device_or_host_peer";
    let Some((ctx, _r)) = reducer(name) else {
        return;
    };
    let elem = |from: usize, to: usize, k: usize| ((from * 7 + to * 13 + k) % 1021) as f32;
    for on_device in [[true, false], [true, true]] {
        let results =
            two_ranks_on_one_gpu(&ctx, std::time::Duration::from_secs(60), |comm, ctx| {
                let (rank, n) = (comm.rank(), comm.world_size());
                let stream = ctx.new_stream().map_err(|e| format!("stream: {e:?}"))?;
                for scale in [0usize, 1, 300_001] {
                    let count =
                        |from: usize, to: usize| (from * 3 + to * 5 + scale) % 7 * (scale + 1) / 2;
                    let sends: Vec<usize> = (0..n).map(|j| count(rank, j)).collect();
                    let recvs: Vec<usize> = (0..n).map(|i| count(i, rank)).collect();
                    let mine: Vec<f32> = (0..n)
                        .flat_map(|j| (0..sends[j]).map(move |k| elem(rank, j, k)))
                        .collect();
                    let want: Vec<f32> = (0..n)
                        .flat_map(|i| (0..recvs[i]).map(move |k| elem(i, rank, k)))
                        .collect();
                    let ctx_s = format!("rank {rank} scale {scale} device {}", on_device[rank]);
                    let got = if on_device[rank] {
                        let src = stream
                            .clone_htod(&mine)
                            .map_err(|e| format!("{ctx_s}: htod: {e:?}"))?;
                        let mut dst = stream
                            .clone_htod(&vec![-1.0f32; want.len()])
                            .map_err(|e| format!("{ctx_s}: htod: {e:?}"))?;
                        comm.all_to_all_v_device(&src, &sends, &mut dst, &recvs, &stream)
                            .map_err(|e| format!("{ctx_s}: {e}"))?;
                        stream
                            .clone_dtoh(&dst)
                            .map_err(|e| format!("{ctx_s}: dtoh: {e:?}"))?
                    } else {
                        let mut got = vec![-1.0f32; want.len()];
                        comm.all_to_all_v(&mine, &sends, &mut got, &recvs)
                            .map_err(|e| format!("{ctx_s}: {e}"))?;
                        got
                    };
                    if got != want {
                        let i = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                        return Err(format!(
                            "{ctx_s}: element {i} of {} is {:?}, expected {:?}",
                            want.len(),
                            got.get(i),
                            want.get(i)
                        ));
                    }
                }
                Ok("3 calls exact".into())
            });
        for (rank, r) in results.iter().enumerate() {
            match r {
                Ok(s) => eprintln!("SUMMARY: all_to_all_v device {on_device:?} rank {rank}: {s}"),
                Err(e) => panic!("{e}"),
            }
        }
    }
}

/// One all_reduce of `count` elements of `T` on this rank's device (`dev`) or host memory,
/// checked against the sum, product, min, max or average of both ranks' inputs.
fn small_case<T: Element + DeviceRepr + bytemuck::Pod + num_like::Small>(
    comm: &dspark::Communicator,
    stream: &Arc<CudaStream>,
    dev: bool,
    op: ReduceOp,
    count: usize,
) -> Result<(), String> {
    let rank = comm.rank();
    let input = |r: usize| -> Vec<f64> {
        (0..count)
            .map(|i| ((i * 7 + r * 3) % 5) as f64 + 1.0)
            .collect()
    };
    let want: Vec<f64> = input(0)
        .iter()
        .zip(input(1))
        .map(|(&a, b)| match op {
            ReduceOp::Sum => a + b,
            ReduceOp::Prod => a * b,
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::Avg => (a + b) / 2.0,
        })
        .collect();
    let mine: Vec<T> = input(rank).into_iter().map(T::from_f64).collect();
    let ctx = format!("rank {rank} {} {op} count {count}", T::DATA_TYPE);
    let got: Vec<T> = if dev {
        let mut buf = stream
            .clone_htod(&mine)
            .map_err(|e| format!("{ctx}: htod: {e:?}"))?;
        comm.all_reduce_device(&mut buf, op, stream)
            .map_err(|e| format!("{ctx}: {e}"))?;
        stream
            .clone_dtoh(&buf)
            .map_err(|e| format!("{ctx}: dtoh: {e:?}"))?
    } else {
        let mut b = mine;
        comm.all_reduce(&mut b, op)
            .map_err(|e| format!("{ctx}: {e}"))?;
        b
    };
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let w = T::from_f64(*w);
        if bytemuck::bytes_of(g) != bytemuck::bytes_of(&w) {
            return Err(format!(
                "{ctx}: element {i} is {} instead of {}",
                g.to_f64(),
                w.to_f64()
            ));
        }
    }
    Ok(())
}

/// The element types of [`small_case`], from and to `f64` (exact for its small integer-valued
/// inputs; the integer average truncates, as the library's does).
mod num_like {
    pub(crate) trait Small: Sized {
        fn from_f64(v: f64) -> Self;
        fn to_f64(&self) -> f64;
    }
    impl Small for f32 {
        fn from_f64(v: f64) -> Self {
            v as f32
        }
        fn to_f64(&self) -> f64 {
            f64::from(*self)
        }
    }
    impl Small for f64 {
        fn from_f64(v: f64) -> Self {
            v
        }
        fn to_f64(&self) -> f64 {
            *self
        }
    }
    impl Small for i64 {
        fn from_f64(v: f64) -> Self {
            v as i64
        }
        fn to_f64(&self) -> f64 {
            *self as f64
        }
    }
}
