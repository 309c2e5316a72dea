//! Copy throughput, as ratios to the ceiling measured in the same run.
//!
//! Host backend: `copy` between two host-backend buffers on a host stream (queue, use
//! tracking, completion wait; the copy runs on the stream's worker, or on the caller when it
//! is at most 256 KiB and the stream is idle, as the 64 KiB line does) against a plain `copy_from_slice` of the same bytes
//! (the memcpy ceiling). CUDA, when a device is present: pinned H2D and D2H through `copy` and
//! D2D within the device, each timed including its completion wait. Throughput is reported by
//! criterion in bytes per second; compare the `cuferry` and `memcpy` lines of one run.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use cuferry::{copy, Device, DeviceBuffer, PinnedBuffer, Stream};

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

criterion_group!(benches, host_copies, cuda_copies);
criterion_main!(benches);
