//! The linop section: a Dense f64 operator `y[b,o] = sum_i W[o,i] x[b,i]` (b = 4096, i = 256,
//! o = 64: 8 MiB in, 2 MiB out) with its data on the host, applied
//! - unsplit (on the host: the baseline of the tiling overhead);
//! - batched along `b` into 8 tiles of 1 MiB placed on the device (the host backend: two host
//!   "devices"): ToDevice in, Dense, ToDevice out per tile, pipelined by events;
//! - and, for the same tiles, the serial sum of the parts (each tile's transfer in, compute
//!   and transfer out timed one after another): on a GPU, pipelined / serial shows how much
//!   transfer overlaps compute. The row also counts, per apply after a first untimed one, the
//!   allocations made fresh and those served by the allocation cache.
//!
//! - the allocation of a 1 MiB array on the device and its drop, `ARRAY_CYCLES` in a row then
//!   one wait: through the allocation cache (`Array::zeros`, what every apply's outputs and
//!   transfer staging use) against a fresh `DeviceBuffer::zeroed` freed at its drop (on CUDA,
//!   `cudaMalloc` + memset + `cudaFree`). The row says how many of the cached cycles reused
//!   memory, and how many of those reclaimed memory still waiting in the reaper after its
//!   memset (`memory::cache_stats`).
//!
//! Figures are times per apply (median of repeats, waits included), reported as GB/s of input,
//! and microseconds per allocation cycle.

use std::sync::Arc;
use std::time::Instant;

use cuferry::linop::{
    create_batched_linop, Array, BatchSpec, Dense, DeviceMatrix, Dims, Linop, LinopRef, ToDevice,
};
use cuferry::memory::cache_stats;
use cuferry::{Device, DeviceBuffer, DeviceSpec, Result};

use super::measure::{gbps, median_secs};
use super::output::Rows;
use super::report::Row;

const B: usize = 4096;
const I: usize = 256;
const O: usize = 64;
const TILES: usize = 8;

/// Allocation cycles per timed repeat of the array-allocation row.
const ARRAY_CYCLES: usize = 200;

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

fn dense(spec: &DeviceSpec, rows: usize) -> Result<LinopRef<f64>> {
    let w = Array::from_slice(spec, &[O, I], &values(O * I, 1))?;
    let idims = Dims::new(&[("b", rows), ("i", I)])?;
    let odims = Dims::new(&[("b", rows), ("o", O)])?;
    Ok(Arc::new(Dense::new(w, &["o", "i"], idims, odims)?))
}

/// Runs the section, adding its rows to `out` as they are measured.
pub fn run(device: Device, quick: bool, out: &mut Rows) -> Result<()> {
    let repeats = if quick { 3 } else { 7 };
    let base = DeviceSpec::new(Device::Host)?;
    let op = dense(&base, B)?;
    let x = Array::from_slice(&base, &[B, I], &values(B * I, 2))?;
    let bytes = B * I * 8;
    let unsplit = median_secs(repeats, || op.apply(&x)?.synchronize())?;
    out.push(Row {
        section: "linop",
        case: "Dense f64 unsplit (host)".into(),
        bytes,
        params: format!("{:.2} ms", unsplit * 1e3),
        value: gbps(bytes, unsplit),
        unit: "GB/s",
        ceiling: None,
        baseline: None,
        same_threads: None,
    });

    // Tiles on the device (two host "devices" on the host backend).
    let devices = if device.is_host() { vec![Device::Host; 2] } else { vec![device] };
    let matrix = DeviceMatrix::from_devices(&[devices.len()], &devices)?;
    let spec = BatchSpec::new(&[("b", B / TILES)]).devices(matrix).base(base.clone());
    let batched = create_batched_linop(Arc::clone(&op), &[spec])?;
    // The first apply allocates its temporaries; later ones should reuse them.
    batched.apply(&x)?.synchronize()?;
    let (before, mut applies) = (cache_stats(), 0u64);
    let pipelined = median_secs(repeats, || {
        applies += 1;
        batched.apply(&x)?.synchronize()
    })?;
    let after = cache_stats();
    let per_apply = |count: u64| count as f64 / applies.max(1) as f64;
    let (fresh_per_apply, reused_per_apply) =
        (per_apply(after.allocated - before.allocated), per_apply(after.reused - before.reused));

    // The same tile's parts, one after another.
    let rows = B / TILES;
    let target = DeviceSpec::new(device)?;
    let tile_op = dense(&base, rows)?.place_on(&target)?;
    let tile_x = x.slice(0, 0..rows)?;
    let up = ToDevice::new(base.clone(), target.clone(), Dims::new(&[("b", rows), ("i", I)])?);
    let down = ToDevice::new(target.clone(), base.clone(), Dims::new(&[("b", rows), ("o", O)])?);
    let (mut t_in, mut t_compute, mut t_out) = (Vec::new(), Vec::new(), Vec::new());
    // Round 0 warms up (first allocations, module load): not timed.
    for round in 0..repeats + 1 {
        let t = Instant::now();
        let on = up.apply(&tile_x)?;
        on.synchronize()?;
        let secs_in = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let y = tile_op.apply(&on)?;
        y.synchronize()?;
        let secs_compute = t.elapsed().as_secs_f64();
        let t = Instant::now();
        down.apply(&y)?.synchronize()?;
        if round > 0 {
            t_in.push(secs_in);
            t_compute.push(secs_compute);
            t_out.push(t.elapsed().as_secs_f64());
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let serial = TILES as f64 * (median(&mut t_in) + median(&mut t_compute) + median(&mut t_out));
    let place = if device.is_host() { "2 host devices".to_string() } else { device.to_string() };
    // Each row pushed once measured: a failure in the next measurement keeps it.
    out.push(Row {
            section: "linop",
            case: format!("batched, {TILES} tiles of 1 MiB on {place}, pipelined"),
            bytes,
            params: format!(
                "{:.2} ms; serial parts {:.2} ms; overlap {:.2}x; per apply {:.1} fresh, {:.1} reused allocations",
                pipelined * 1e3,
                serial * 1e3,
                serial / pipelined,
                fresh_per_apply,
                reused_per_apply,
            ),
            value: gbps(bytes, pipelined),
            unit: "GB/s",
            // The serial sum of the parts is no ceiling (overlap beats it), so it stays in the
            // params with the overlap ratio, not in the ceiling column or the plot's levels.
            ceiling: None,
            baseline: Some(("unsplit on the host".into(), gbps(bytes, unsplit))),
            same_threads: None,
    });
    let (cached_us, fresh_us, served) = array_cycles_us(&target, repeats)?;
    out.push(Row {
            section: "linop",
            case: format!("alloc+zero+free of a 1 MiB array on {device}, allocation cache"),
            bytes: 1 << 20,
            params: format!(
                "{ARRAY_CYCLES} in a row, then one wait; reused {:.0}% (reclaimed {:.0}%); fresh buffer {fresh_us:.2} us",
                served.percent(served.reused),
                served.percent(served.reclaimed),
            ),
            value: cached_us,
            unit: "us",
            ceiling: None,
            baseline: Some(("DeviceBuffer::zeroed + drop".into(), fresh_us)),
            same_threads: None,
    });
    Ok(())
}

/// How the cached cycles' allocations were served, over every repeat.
struct Served {
    reused: u64,
    reclaimed: u64,
    total: u64,
}

impl Served {
    /// `count` as a percentage of the allocations.
    fn percent(&self, count: u64) -> f64 {
        100.0 * count as f64 / self.total.max(1) as f64
    }
}

/// Microseconds per allocation cycle of a 1 MiB f64 array on `spec`: through the allocation
/// cache (`Array::zeros`, dropped at once) and as a fresh `DeviceBuffer::zeroed` (dropped at
/// once, which waits for its memset and frees); and how the cache served the first. Each
/// repeat runs [`ARRAY_CYCLES`] cycles and then waits for the spec's compute stream.
fn array_cycles_us(spec: &DeviceSpec, repeats: usize) -> Result<(f64, f64, Served)> {
    let len = (1 << 20) / 8;
    let per_cycle = |secs: f64| secs * 1e6 / ARRAY_CYCLES as f64;
    let before = cache_stats();
    let cached = median_secs(repeats, || {
        for _ in 0..ARRAY_CYCLES {
            drop(Array::<f64>::zeros(spec, &[len])?);
        }
        spec.compute_stream.synchronize()
    })?;
    let after = cache_stats();
    let served = Served {
        reused: after.reused - before.reused,
        reclaimed: after.reclaimed - before.reclaimed,
        total: (after.reused + after.allocated) - (before.reused + before.allocated),
    };
    let fresh = median_secs(repeats, || {
        for _ in 0..ARRAY_CYCLES {
            drop(DeviceBuffer::<f64>::zeroed(&spec.compute_stream, len)?);
        }
        spec.compute_stream.synchronize()
    })?;
    Ok((per_cycle(cached), per_cycle(fresh), served))
}
