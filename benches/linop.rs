//! Overhead of a batched operator over the same unsplit operator on the host backend.
//!
//! A `Dense` map `y[b,o] = sum_i W[o,i] x[b,i]` (f64, b = 4096, i = 256, o = 64: 8 MiB in,
//! 2 MiB out) is applied unsplit and as `create_batched_linop` with tiles along `b` of at
//! least 1 MiB of input, over 1 or 2 host "devices" (each a `DeviceSpec` with its own
//! streams). Every sample applies the operator and waits for the result. Compare the
//! `batched/*` lines to `unsplit` of the same run; the target is <= 5% overhead (with two
//! devices the tiles run concurrently and may be faster than unsplit on a machine with free
//! cores).

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use cuferry::linop::{create_batched_linop, Array, BatchSpec, Dense, DeviceMatrix, Dims, LinopRef};
use cuferry::{Device, DeviceSpec};

const B: usize = 4096;
const I: usize = 256;
const O: usize = 64;

fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 2000) as f64 / 1000.0 - 1.0
        })
        .collect()
}

fn batched_overhead(c: &mut Criterion) {
    let base = DeviceSpec::new(Device::Host).expect("host spec");
    let w = Array::from_slice(&base, &[O, I], &values(O * I, 1)).expect("weight");
    let idims = Dims::new(&[("b", B), ("i", I)]).expect("dims");
    let odims = Dims::new(&[("b", B), ("o", O)]).expect("dims");
    let op: LinopRef<f64> = Arc::new(Dense::new(w, &["o", "i"], idims, odims).expect("dense"));
    let x = Array::from_slice(&base, &[B, I], &values(B * I, 2)).expect("x");
    let mut group = c.benchmark_group("linop_dense_host");
    group.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    group.throughput(Throughput::Bytes((B * I * 8) as u64));
    group.bench_function("unsplit", |bch| {
        bch.iter(|| op.apply(&x).expect("apply").synchronize().expect("sync"));
    });
    for tiles in [2usize, 4, 8] {
        for devices in [1usize, 2] {
            let matrix =
                DeviceMatrix::from_devices(&[devices], &vec![Device::Host; devices]).expect("devices");
            let spec = BatchSpec::new(&[("b", B / tiles)]).devices(matrix).base(base.clone());
            let batched = create_batched_linop(Arc::clone(&op), &[spec]).expect("batched");
            let tile_mib = (B / tiles * I * 8) as f64 / (1 << 20) as f64;
            let id = BenchmarkId::new("batched", format!("{tiles}tiles_{tile_mib}MiB_{devices}dev"));
            group.bench_function(id, |bch| {
                bch.iter(|| batched.apply(&x).expect("apply").synchronize().expect("sync"));
            });
        }
    }
    group.finish();
}

criterion_group!(benches, batched_overhead);
criterion_main!(benches);
