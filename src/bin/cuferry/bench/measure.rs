//! Timing helpers: warm-up, repeats, median.

use std::time::Instant;

use cuferry::{Event, Result, Stream};

/// Runs `f` once to warm up, then `repeats` times; returns the median wall time in seconds.
pub fn median_secs(repeats: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Gigabytes (1e9 bytes) per second.
pub fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// Times `op` (which queues work on `stream`) with timing events around it: one warm-up, then
/// `repeats` runs; returns the median device time in seconds.
pub fn median_device_secs(
    stream: &Stream,
    repeats: usize,
    mut op: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let (start, end) = (Event::with_timing(stream.device())?, Event::with_timing(stream.device())?);
    op()?;
    stream.synchronize()?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        start.record(stream)?;
        op()?;
        end.record(stream)?;
        end.synchronize()?;
        times.push(f64::from(start.elapsed_ms(&end)?) / 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}
