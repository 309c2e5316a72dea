//! Timing helpers: warm-up, repeats, median.

use std::time::Instant;

use cuferry::Result;

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
