//! CPU reduction kernels: `dst += src` (in place, Sum) at a cache-resident size (64 KiB) and a
//! gradient-bucket size (64 MiB).
//!
//! The limit is single-thread memory bandwidth: `../shared/peers/memcpy_bw.c`'s `reduce_add`
//! (the same `dst[i] += src[i]` on f32, compiled by the C compiler with `-march=native`).
//! Throughput follows its convention: **bytes of one buffer per operation**, although each
//! operation reads two buffers and writes one. `benches/reduce_vs_limits.sh` runs both in
//! one interleaved session and prints the ratio.
//!
//! Groups:
//! * `reduce_inplace/<dtype>/<size>`: the dispatched kernel for f32, f16, bf16, f64, i32;
//! * `reduce_level/<level>/<size>`: f32 at every SIMD level this CPU supports;
//! * `reduce_into/f32/<size>`: `dst = a + b`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dspark::internals::reduce::{
    reduce_inplace, reduce_inplace_at, reduce_into, simd_level, SimdLevel,
};
use dspark::{DataType, ReduceOp};
use std::hint::black_box;
use std::time::Duration;

const SIZES: [(usize, &str); 2] = [(64 << 10, "64KiB"), (64 << 20, "64MiB")];

/// `src[i] = i % 97 + 1` and `dst = 0`, like memcpy_bw.c, encoded as `dtype`.
fn buffers(dtype: DataType, bytes: usize) -> (Vec<u8>, Vec<u8>) {
    let n = bytes / dtype.size();
    let mut src = Vec::with_capacity(bytes);
    for i in 0..n {
        let v = (i % 97 + 1) as u8;
        match dtype {
            DataType::F32 => src.extend_from_slice(&f32::from(v).to_ne_bytes()),
            DataType::F64 => src.extend_from_slice(&f64::from(v).to_ne_bytes()),
            DataType::F16 => src.extend_from_slice(&half::f16::from(v).to_ne_bytes()),
            DataType::BF16 => src.extend_from_slice(&half::bf16::from(v).to_ne_bytes()),
            DataType::I32 => src.extend_from_slice(&i32::from(v).to_ne_bytes()),
            _ => src.resize(src.len() + dtype.size(), v),
        }
    }
    (vec![0u8; bytes], src)
}

fn configure(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    bytes: usize,
) {
    g.throughput(Throughput::Bytes(bytes as u64));
    if bytes >= 1 << 20 {
        g.sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3));
    } else {
        g.sample_size(50)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
    }
}

fn bench_inplace(c: &mut Criterion) {
    eprintln!("reduce kernels: simd level {}", simd_level());
    for (bytes, label) in SIZES {
        let mut g = c.benchmark_group("reduce_inplace");
        configure(&mut g, bytes);
        for dtype in [
            DataType::F32,
            DataType::F16,
            DataType::BF16,
            DataType::F64,
            DataType::I32,
        ] {
            let (mut dst, src) = buffers(dtype, bytes);
            g.bench_function(BenchmarkId::new(dtype.rust_name(), label), |b| {
                b.iter(|| {
                    reduce_inplace(dtype, ReduceOp::Sum, black_box(&mut dst), black_box(&src))
                })
            });
        }
        g.finish();
    }
}

fn bench_levels(c: &mut Criterion) {
    for (bytes, label) in SIZES {
        let mut g = c.benchmark_group("reduce_level");
        configure(&mut g, bytes);
        for level in SimdLevel::ALL.into_iter().filter(|l| l.is_supported()) {
            let (mut dst, src) = buffers(DataType::F32, bytes);
            g.bench_function(BenchmarkId::new(level.name(), label), |b| {
                b.iter(|| {
                    reduce_inplace_at(
                        level,
                        DataType::F32,
                        ReduceOp::Sum,
                        black_box(&mut dst),
                        &src,
                    )
                })
            });
        }
        g.finish();
    }
}

fn bench_into(c: &mut Criterion) {
    for (bytes, label) in SIZES {
        let mut g = c.benchmark_group("reduce_into");
        configure(&mut g, bytes);
        let (a, b) = buffers(DataType::F32, bytes);
        let mut dst = vec![0u8; bytes];
        g.bench_function(BenchmarkId::new("f32", label), |bch| {
            bch.iter(|| reduce_into(DataType::F32, ReduceOp::Sum, black_box(&mut dst), &a, &b))
        });
        g.finish();
    }
}

criterion_group!(benches, bench_inplace, bench_levels, bench_into);
criterion_main!(benches);
