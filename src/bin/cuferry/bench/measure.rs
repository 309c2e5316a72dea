//! Timing helpers: warm-up, repeats, median.

use std::time::Instant;

use cuferry::{copy, DeviceBuffer, Event, Result, Stream};

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
/// `repeats` runs; returns the median device time in seconds. `before` is queued on `stream`
/// ahead of every run and waited for, outside the timed interval (an L2 flush: [`L2Flush`]).
/// Each run starts on an idle device, so host launch gaps count as they do without `before`
/// (work queued behind a busy stream would hide them: the seed's 40 launches measured 134 us
/// that way, 210 us without).
pub fn median_device_secs_after(
    stream: &Stream,
    repeats: usize,
    before: impl FnMut() -> Result<()>,
    op: impl FnMut() -> Result<()>,
) -> Result<f64> {
    median_event_secs(stream, repeats, before, op, BeforeRun::Waited)
}

/// Whether a timed run waits for the work queued ahead of it before its start event.
#[derive(Clone, Copy, PartialEq, Eq)]
enum BeforeRun {
    Waited,
    Queued,
}

/// The median of `repeats` event-timed runs of `op`, each behind `before`, after one warm-up.
fn median_event_secs(
    stream: &Stream,
    repeats: usize,
    mut before: impl FnMut() -> Result<()>,
    mut op: impl FnMut() -> Result<()>,
    mode: BeforeRun,
) -> Result<f64> {
    let (start, end) = (Event::with_timing(stream.device())?, Event::with_timing(stream.device())?);
    before()?;
    op()?;
    stream.synchronize()?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        before()?;
        if mode == BeforeRun::Waited {
            stream.synchronize()?;
        }
        start.record(stream)?;
        op()?;
        end.record(stream)?;
        end.synchronize()?;
        times.push(f64::from(start.elapsed_ms(&end)?) / 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// As [`median_device_secs_after`], but each run's start event is recorded right behind
/// `before` (an [`L2Flush`], about 90 us of device work on an H100), without waiting for it:
/// the host queues `op` while the device still flushes, so the interval holds `op`'s device
/// time alone, not the host's submission and launch latency. The rate of a kernel against a
/// copy is taken this way (a single-launch op's fixed costs would otherwise weigh as much as
/// several microseconds of its transfer); call-to-completion comparisons, where launch gaps
/// are the point (the seed's many launches), use [`median_device_secs_after`]. With a
/// `before` that queues nothing (the host backend) both are the same.
pub fn median_device_secs_queued(
    stream: &Stream,
    repeats: usize,
    before: impl FnMut() -> Result<()>,
    op: impl FnMut() -> Result<()>,
) -> Result<f64> {
    median_event_secs(stream, repeats, before, op, BeforeRun::Queued)
}

/// Bytes an [`L2Flush`] reads and writes: more than twice the L2 of any Hopper part (50-60 MB).
const FLUSH_BYTES: usize = 128 << 20;

/// Evicts a GPU's L2 by copying [`FLUSH_BYTES`] between two buffers of its own. Timed runs
/// over the same small buffers otherwise measure the cache (METHOD.md: "repeated runs over one
/// buffer measure the cache"), which flatters a small contiguous copy against a kernel whose
/// reads spread over large arrays.
pub struct L2Flush {
    src: DeviceBuffer<u8>,
    dst: DeviceBuffer<u8>,
}

impl L2Flush {
    /// Two buffers of [`FLUSH_BYTES`] on `stream`'s device; `None` on the host backend.
    pub fn new(stream: &Stream) -> Result<Option<Self>> {
        if stream.device().is_host() {
            return Ok(None);
        }
        Ok(Some(L2Flush {
            src: DeviceBuffer::zeroed(stream, FLUSH_BYTES)?,
            dst: DeviceBuffer::zeroed(stream, FLUSH_BYTES)?,
        }))
    }

    /// Queues the flush on `stream`.
    pub fn queue(&mut self, stream: &Stream) -> Result<()> {
        copy(stream, &self.src, &mut self.dst).map(drop)
    }
}
