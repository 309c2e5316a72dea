//! The managed section: pool allocation against `cudaMallocManaged`, prefetch against the
//! pinned copy, bulk against a loop of calls, fault-driven migration, accessed-by zero-copy
//! reads, read-mostly duplicates, and device-resident managed memory copied to pinned memory,
//! all in one run on one device. On the host backend only allocation is measured (the other
//! cases need a GPU's page migration).

use std::time::Instant;

use cuferry::kernels::sum_u32;
use cuferry::managed::{prefetch_all, Advice, Location, ManagedBuffer, ManagedPool, ManagedPoolOptions};
use cuferry::{copy, Device, DeviceBuffer, Error, PinnedBuffer, Result, Stream};

use super::measure::{gbps, median_secs};
use super::output::Rows;
use super::report::Row;

const MIB: usize = 1 << 20;

fn row(case: &str, bytes: usize, params: &str, value: f64, unit: &'static str) -> Row {
    Row {
        section: "managed",
        case: case.into(),
        bytes,
        params: params.into(),
        value,
        unit,
        ceiling: None,
        baseline: None,
        same_threads: None,
    }
}

/// Microseconds per alloc+free of `bytes` from `pool`, `n` in a row then one synchronize.
fn alloc_free_us(pool: &ManagedPool, stream: &Stream, bytes: usize, n: usize) -> Result<f64> {
    let secs = median_secs(5, || {
        for _ in 0..n {
            // SAFETY: never read; the buffer is freed at once.
            let b = unsafe { pool.alloc_uninit::<u8>(bytes, stream)? };
            drop(b);
        }
        stream.synchronize()
    })?;
    Ok(secs * 1e6 / n as f64)
}

/// Samples of each migration case (after one untimed run); the median is reported.
const MIGRATION_SAMPLES: usize = 5;

/// Median wall seconds of `op` over [`MIGRATION_SAMPLES`] samples after one untimed run, each
/// preceded by `before` (which puts the pages back where the case starts; not timed).
fn median_after(mut before: impl FnMut() -> Result<()>, mut op: impl FnMut() -> Result<()>) -> Result<f64> {
    before()?;
    op()?;
    let mut times = Vec::with_capacity(MIGRATION_SAMPLES);
    for _ in 0..MIGRATION_SAMPLES {
        before()?;
        let t = Instant::now();
        op()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Runs the section, adding its rows to `rows` as they are measured.
pub fn run(device: Device, quick: bool, rows: &mut Rows) -> Result<()> {
    let stream = Stream::new(device)?;
    let pool = ManagedPool::new(device, ManagedPoolOptions::default())?;
    let n = if quick { 200 } else { 1000 };
    let pool_us = alloc_free_us(&pool, &stream, MIB, n)?;
    let mut r = row("alloc+free", MIB, &format!("{:?}", pool.kind()), pool_us, "us");
    if let Device::Cuda(_) = device {
        let plain =
            ManagedPool::new(device, ManagedPoolOptions { use_malloc_managed: true, ..Default::default() })?;
        let plain_us = alloc_free_us(&plain, &stream, MIB, n / 4)?;
        r.baseline = Some(("cudaMallocManaged+cudaFree".into(), plain_us));
    }
    rows.push(r);
    let Device::Cuda(ordinal) = device else {
        println!("managed: migration cases need a CUDA device; the host backend measured allocation only");
        return Ok(());
    };
    let gpu = Location::Device(ordinal);
    let big = if quick { 256 * MIB } else { 1 << 30 };

    // The ceiling: one pinned copy each way, same bytes.
    let mut pinned = PinnedBuffer::<u8>::zeroed(device, big)?;
    let mut dev = DeviceBuffer::<u8>::zeroed(&stream, big)?;
    let h2d = gbps(
        big,
        median_secs(3, || {
            copy(&stream, &pinned, &mut dev)?;
            dev.synchronize()
        })?,
    );
    let d2h = gbps(
        big,
        median_secs(3, || {
            copy(&stream, &dev, &mut pinned)?;
            pinned.synchronize()
        })?,
    );

    let mut buf: ManagedBuffer<u32> = pool.alloc(big / 4, &stream)?;
    buf.as_mut_slice()?.iter_mut().enumerate().for_each(|(i, v)| *v = i as u32);
    // Prefetch one way, timed on its own after moving the pages the other way.
    let timed = |to: Location, back: Location| -> Result<f64> {
        let mut best = Vec::new();
        // The first round warms up (its first touch of the destination is not timed).
        for round in 0..5 {
            buf.prefetch(back, &stream)?;
            stream.synchronize()?;
            let t = Instant::now();
            buf.prefetch(to, &stream)?;
            stream.synchronize()?;
            if round > 0 {
                best.push(t.elapsed().as_secs_f64());
            }
        }
        best.sort_by(f64::total_cmp);
        Ok(gbps(big, best[best.len() / 2]))
    };
    let mut r = row("prefetch H2D", big, "", timed(gpu, Location::Host)?, "GB/s");
    r.ceiling = Some(("pinned H2D".into(), h2d));
    rows.push(r);
    let mut r = row("prefetch D2H", big, "", timed(Location::Host, gpu)?, "GB/s");
    r.ceiling = Some(("pinned D2H".into(), d2h));
    rows.push(r);

    // Fault-driven migration: a kernel touches host-resident pages.
    let to_host = |b: &ManagedBuffer<u32>| -> Result<()> {
        b.prefetch(Location::Host, &stream)?;
        stream.synchronize()
    };
    let secs = median_after(|| to_host(&buf), || sum_u32(&stream, &buf).map(drop))?;
    let mut r = row("fault-driven migration (kernel reads host pages)", big, "", gbps(big, secs), "GB/s");
    r.ceiling = Some(("pinned H2D".into(), h2d));
    rows.push(r);

    // The advice cases run on the pool's memory where the driver takes advice there, else on
    // cudaMallocManaged memory (drivers may refuse advice on managed-pool memory).
    let plain_buf: ManagedBuffer<u32>;
    let (advised, memory) = match buf.advise(Advice::SetPreferredLocation(Location::Host)) {
        Ok(_) => (&buf, format!("{:?}", pool.kind())),
        Err(Error::Unsupported { .. }) => {
            let plain = ManagedPool::new(
                device,
                ManagedPoolOptions { use_malloc_managed: true, ..Default::default() },
            )?;
            let mut b: ManagedBuffer<u32> = plain.alloc(big / 4, &stream)?;
            b.as_mut_slice()?.iter_mut().enumerate().for_each(|(i, v)| *v = i as u32);
            b.advise(Advice::SetPreferredLocation(Location::Host))?;
            plain_buf = b;
            println!("managed: the driver refuses advice on managed-pool memory; advice cases use cudaMallocManaged memory");
            (&plain_buf, "MallocManaged (pool memory refuses advice)".to_string())
        }
        Err(e) => return Err(e),
    };
    // Accessed-by zero-copy: pages stay on the host, the device reads them over the link.
    advised.advise(Advice::SetAccessedBy(gpu))?;
    let secs = median_after(|| to_host(advised), || sum_u32(&stream, advised).map(drop))?;
    let mut r =
        row("accessed-by zero-copy read", big, &format!("preferred host; {memory}"), gbps(big, secs), "GB/s");
    r.ceiling = Some(("pinned H2D".into(), h2d));
    rows.push(r);
    advised.advise(Advice::UnsetAccessedBy(gpu))?;
    advised.advise(Advice::UnsetPreferredLocation)?;

    // Read-mostly: once duplicated, later prefetches either way cost ~nothing.
    advised.advise(Advice::SetReadMostly)?;
    let secs = median_after(
        || {
            advised.prefetch(gpu, &stream)?;
            stream.synchronize()
        },
        || {
            advised.prefetch(Location::Host, &stream)?;
            advised.prefetch(gpu, &stream)?;
            stream.synchronize()
        },
    )?;
    rows.push(row("read-mostly prefetch both ways (duplicated)", big, &memory, gbps(2 * big, secs), "GB/s"));
    advised.advise(Advice::UnsetReadMostly)?;

    // Device-resident managed memory copied to pinned host memory.
    buf.prefetch(gpu, &stream)?;
    stream.synchronize()?;
    let mut out = PinnedBuffer::<u32>::zeroed(device, big / 4)?;
    let secs = median_secs(3, || {
        copy(&stream, &buf, &mut out)?;
        out.synchronize()
    })?;
    let mut r = row("device-resident managed -> pinned copy", big, "", gbps(big, secs), "GB/s");
    r.ceiling = Some(("pinned D2H".into(), d2h));
    rows.push(r);
    drop(buf);

    // Bulk against a loop: 1024 x 1 MiB buffers to the device and back.
    let count = if quick { 256 } else { 1024 };
    let bufs: Vec<ManagedBuffer<u8>> =
        (0..count).map(|_| pool.alloc::<u8>(MIB, &stream)).collect::<Result<_>>()?;
    let ranges: Vec<_> = bufs.iter().map(|b| b.range()).collect();
    let time_bulk = |bulk: bool| -> Result<f64> {
        let mut times = Vec::new();
        // The first round warms up, as above.
        for round in 0..4 {
            prefetch_all(&ranges, Location::Host, &stream)?;
            stream.synchronize()?;
            let t = Instant::now();
            if bulk {
                prefetch_all(&ranges, gpu, &stream)?;
            } else {
                for b in &bufs {
                    b.prefetch(gpu, &stream)?;
                }
            }
            stream.synchronize()?;
            if round > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(gbps(count * MIB, times[1]))
    };
    let looped = time_bulk(false)?;
    let bulk = time_bulk(true)?;
    let mut r = row(
        "bulk prefetch H2D",
        MIB,
        &format!("{count} buffers, one call (spread over 4 streams)"),
        bulk,
        "GB/s",
    );
    r.baseline = Some((format!("loop of {count} calls"), looped));
    r.ceiling = Some(("pinned H2D".into(), h2d));
    rows.push(r);
    Ok(())
}
