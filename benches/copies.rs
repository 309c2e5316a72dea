//! Copy throughput, as ratios to the ceiling measured in the same run.
//!
//! Host backend: `copy` between two host-backend buffers on a host stream (queue, use
//! tracking, completion wait; the copy runs on the stream's worker, or on the caller when it
//! is at most 256 KiB and the stream is idle, as the 64 KiB line does) against a plain `copy_from_slice` of the same bytes
//! (the memcpy ceiling). CUDA, when a device is present: pinned H2D and D2H through `copy` and
//! D2D within the device, each timed including its completion wait. Throughput is reported by
//! criterion in bytes per second; compare the `cuferry` and `memcpy` lines of one run.
//!
//! Batches (`host_copy_batch`): 1024 scattered pieces of 4 KiB and 64 KiB as one `copy_ranges`
//! batch (one host job), as a loop of `copy_range` (a job or an inline copy each), and as a
//! loop of plain `copy_from_slice` over the same pieces (the ceiling).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use cuferry::{copy, copy_range, copy_ranges, CopyRange, Device, DeviceBuffer, PinnedBuffer, Stream};

const SIZES: &[usize] = &[64 << 10, 4 << 20, 64 << 20];

fn label(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{}MiB", bytes >> 20)
    } else {
        format!("{}KiB", bytes >> 10)
    }
}

fn host_copies(c: &mut Criterion) {
    let mut group = c.benchmark_group("host_copy");
    group.sample_size(20);
    let stream = Stream::new(Device::Host).expect("host stream");
    for &bytes in SIZES {
        group.throughput(Throughput::Bytes(bytes as u64));
        let src = DeviceBuffer::from_slice(&stream, &vec![7u8; bytes]).expect("src");
        let mut dst = DeviceBuffer::<u8>::zeroed(&stream, bytes).expect("dst");
        group.bench_with_input(BenchmarkId::new("cuferry", label(bytes)), &bytes, |b, _| {
            b.iter(|| {
                copy(&stream, &src, &mut dst).expect("copy");
                dst.synchronize().expect("sync");
            })
        });
        let a = vec![7u8; bytes];
        let mut z = vec![0u8; bytes];
        group.bench_with_input(BenchmarkId::new("memcpy", label(bytes)), &bytes, |b, _| {
            b.iter(|| {
                z.copy_from_slice(std::hint::black_box(&a));
                std::hint::black_box(&mut z);
            })
        });
    }
    group.finish();
}

/// Pieces per batch.
const PIECES: usize = 1024;

fn host_copy_batches(c: &mut Criterion) {
    let mut group = c.benchmark_group("host_copy_batch");
    group.sample_size(20);
    let stream = Stream::new(Device::Host).expect("host stream");
    for piece in [4 << 10, 64 << 10] {
        let bytes = PIECES * piece;
        group.throughput(Throughput::Bytes(bytes as u64));
        // Piece k goes to slot 7919 k mod 1024 (7919 is prime: a permutation).
        let ranges: Vec<CopyRange> =
            (0..PIECES).map(|k| CopyRange::new(k * piece, (k * 7919 % PIECES) * piece, piece)).collect();
        let src = DeviceBuffer::from_slice(&stream, &vec![7u8; bytes]).expect("src");
        let mut dst = DeviceBuffer::<u8>::zeroed(&stream, bytes).expect("dst");
        group.bench_function(BenchmarkId::new("batch", label(piece)), |b| {
            b.iter(|| {
                copy_ranges(&stream, &src, &mut dst, &ranges).expect("batch");
                dst.synchronize().expect("sync");
            })
        });
        group.bench_function(BenchmarkId::new("copy_range_loop", label(piece)), |b| {
            b.iter(|| {
                for r in &ranges {
                    copy_range(&stream, &src, r.src_offset, &mut dst, r.dst_offset, r.len).expect("copy");
                }
                dst.synchronize().expect("sync");
            })
        });
        let a = vec![7u8; bytes];
        let mut z = vec![0u8; bytes];
        group.bench_function(BenchmarkId::new("memcpy_loop", label(piece)), |b| {
            b.iter(|| {
                for r in &ranges {
                    z[r.dst_offset..r.dst_offset + r.len]
                        .copy_from_slice(std::hint::black_box(&a[r.src_offset..r.src_offset + r.len]));
                }
                std::hint::black_box(&mut z);
            })
        });
    }
    group.finish();
}

fn cuda_copies(c: &mut Criterion) {
    if Device::cuda_count() == 0 {
        println!("SKIP: no CUDA device (cuda_copy benches)");
        return;
    }
    let device = Device::Cuda(0);
    let stream = Stream::new(device).expect("cuda stream");
    let mut group = c.benchmark_group("cuda_copy");
    group.sample_size(20);
    for &bytes in SIZES {
        group.throughput(Throughput::Bytes(bytes as u64));
        let mut pinned = PinnedBuffer::<u8>::zeroed(device, bytes).expect("pinned");
        let mut dev = DeviceBuffer::<u8>::zeroed(&stream, bytes).expect("device");
        let mut dev2 = DeviceBuffer::<u8>::zeroed(&stream, bytes).expect("device");
        group.bench_function(BenchmarkId::new("h2d_pinned", label(bytes)), |b| {
            b.iter(|| {
                copy(&stream, &pinned, &mut dev).expect("h2d");
                dev.synchronize().expect("sync");
            })
        });
        group.bench_function(BenchmarkId::new("d2h_pinned", label(bytes)), |b| {
            b.iter(|| {
                copy(&stream, &dev, &mut pinned).expect("d2h");
                pinned.synchronize().expect("sync");
            })
        });
        group.bench_function(BenchmarkId::new("d2d", label(bytes)), |b| {
            b.iter(|| {
                copy(&stream, &dev, &mut dev2).expect("d2d");
                dev2.synchronize().expect("sync");
            })
        });
    }
    group.finish();
}

criterion_group!(benches, host_copies, host_copy_batches, cuda_copies);
criterion_main!(benches);
