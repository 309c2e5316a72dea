//! The copy section, like nvbandwidth: bandwidth against size for H2D and D2H (pinned and
//! pageable sources), D2D and peer (the same device when there is only one), with the latency
//! of small copies. Asynchronous copies are timed with timing events on the stream, each run's
//! start event queued behind device work so that the interval is the copy's alone; the
//! pageable ones (synchronous by nature) by wall clock to completion. Ratios are to the largest
//! pinned copy of the same direction in the same run, timed first so that every row goes out
//! with its ratio. The latency of small copies (64 KiB and
//! less) is wall clock for every kind, from the call to the copy's completion seen by the host
//! (for asynchronous copies: queue, then synchronize), so its rows compare with each other.
//! GB/s count each byte once (the payload); a D2D copy moves twice that through device memory
//! (read + write), the convention of the project's D2D ceiling. On CUDA the D2D and peer
//! copies are timed each behind an L2 flush, queued so that the interval holds the copy alone:
//! copied again and again, sizes up to about 16 MiB would otherwise run from the 50 MB L2.
//! The batch rows move 1024 scattered pieces as one batch, by wall time from the call to
//! completion, against one copy of the same bytes and a loop of single copies, in one run.

use cuferry::{
    copy::copy_ranges_one_by_one, copy_range, copy_ranges, CopyRange, Device, DeviceBuffer, Memory,
    PinnedBuffer, Result, Stream,
};

use super::measure::{gbps, median_device_secs_queued, median_secs, L2Flush};
use super::output::Rows;
use super::report::{size, Row};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// Copies of at most this many bytes also report their latency.
const LATENCY_MAX_BYTES: usize = 64 * KIB;

fn sizes(quick: bool) -> Vec<usize> {
    if quick {
        vec![4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB]
    } else {
        vec![4 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1 << 30]
    }
}

fn repeats(bytes: usize) -> usize {
    if bytes <= MIB {
        50
    } else if bytes <= 64 * MIB {
        10
    } else {
        3
    }
}

/// Runs the section, adding its rows to `rows` as they are measured.
pub fn run(device: Device, quick: bool, rows: &mut Rows) -> Result<()> {
    let stream = Stream::new(device)?;
    let peer = match device {
        Device::Cuda(i) if Device::cuda_count() > 1 => Device::Cuda((i + 1) % Device::cuda_count()),
        other => other,
    };
    let peer_stream = Stream::new(peer)?;
    let sizes = sizes(quick);
    let largest = *sizes.last().unwrap_or(&MIB);
    let mut pinned = PinnedBuffer::<u8>::zeroed(device, largest)?;
    let mut pageable = vec![1u8; largest];
    let mut dev = DeviceBuffer::<u8>::zeroed(&stream, largest)?;
    let mut dev2 = DeviceBuffer::<u8>::zeroed(&stream, largest)?;
    let mut far = DeviceBuffer::<u8>::zeroed(&peer_stream, largest)?;
    let mut flusher = L2Flush::new(&stream)?;
    // The ceilings first: the largest pinned copy each way, timed as the rows below are, so
    // that every row goes out with its ratio as it is measured (a run cut short keeps both).
    let n_top = repeats(largest);
    let (h2d_top, d2h_top) = {
        let mut flush = || flusher.as_mut().map_or(Ok(()), |f| f.queue(&stream));
        let h2d = median_device_secs_queued(&stream, n_top, &mut flush, || {
            copy_range(&stream, &pinned, 0, &mut dev, 0, largest).map(drop)
        })?;
        let d2h = median_device_secs_queued(&stream, n_top, &mut flush, || {
            copy_range(&stream, &dev, 0, &mut pinned, 0, largest).map(drop)
        })?;
        (h2d, d2h)
    };
    let ceilings = [("H2D", gbps(largest, h2d_top)), ("D2H", gbps(largest, d2h_top))];
    let ceiling_of = |case: &str| {
        let (dir, value) = ceilings.iter().find(|(dir, _)| case.starts_with(dir))?;
        Some((format!("{dir} pinned {}", size(largest)), *value))
    };
    let push = |rows: &mut Rows, case: &'static str, bytes: usize, secs: f64, wall: Option<f64>| {
        let mut measured = row(device, peer, case, bytes, secs, wall);
        measured.ceiling = ceiling_of(case);
        rows.push(measured);
    };
    for &bytes in &sizes {
        let n = repeats(bytes);
        let small = bytes <= LATENCY_MAX_BYTES;
        // For small copies, the wall time of queue + synchronize (the latency a caller sees, as
        // the pageable rows' wall time is).
        let small_wall = |stream: &Stream, op: &mut dyn FnMut() -> Result<()>| -> Result<Option<f64>> {
            if !small {
                return Ok(None);
            }
            median_secs(n, || {
                op()?;
                stream.synchronize()
            })
            .map(Some)
        };
        let mut flush = || flusher.as_mut().map_or(Ok(()), |f| f.queue(&stream));
        // An asynchronous copy: event time, its start event queued behind device work (the
        // flush) so that the interval holds the copy alone, not the call that submits it (as
        // the D2D rows below; a start event on an idle stream counted the submission too); and
        // the small copies' wall time.
        let mut timed_async =
            |stream: &Stream, op: &mut dyn FnMut() -> Result<()>| -> Result<(f64, Option<f64>)> {
                let device_secs = median_device_secs_queued(stream, n, &mut flush, &mut *op)?;
                Ok((device_secs, small_wall(stream, op)?))
            };
        // At the largest size the row is its direction's ceiling, timed above: reused, so it
        // reads exactly 1.00x of itself (a second timing would differ by the spread).
        let (s, w) = if bytes == largest {
            (h2d_top, None)
        } else {
            timed_async(&stream, &mut || copy_range(&stream, &pinned, 0, &mut dev, 0, bytes).map(drop))?
        };
        push(rows, "H2D pinned", bytes, s, w);
        let s = median_secs(n, || dev.copy_from_slice_at(&stream, 0, &pageable[..bytes]))?;
        push(rows, "H2D pageable", bytes, s, small.then_some(s));
        let (s, w) = if bytes == largest {
            (d2h_top, None)
        } else {
            timed_async(&stream, &mut || copy_range(&stream, &dev, 0, &mut pinned, 0, bytes).map(drop))?
        };
        push(rows, "D2H pinned", bytes, s, w);
        let s = median_secs(n, || dev.copy_to_slice_at(&stream, 0, &mut pageable[..bytes]))?;
        push(rows, "D2H pageable", bytes, s, small.then_some(s));
        // Device to device: event time from a cold L2 (see the module's rules), and for small
        // copies the wall time of queue + synchronize.
        let mut flush = || flusher.as_mut().map_or(Ok(()), |f| f.queue(&stream));
        for (case, to) in [("D2D", &mut dev2), ("peer", &mut far)] {
            let mut op = || copy_range(&stream, &dev, 0, &mut *to, 0, bytes).map(drop);
            let s = median_device_secs_queued(&stream, n, &mut flush, &mut op)?;
            let wall = small_wall(&stream, &mut op)?;
            push(rows, case, bytes, s, wall);
        }
    }
    let pieces: &[usize] = if quick { &[64 * KIB] } else { &[4 * KIB, 64 * KIB] };
    for &piece in pieces {
        let ranges = scattered_pieces(piece);
        let n = repeats(BATCH_PIECES * piece);
        rows.push(batched(device, "batch H2D pinned", &stream, &pinned, &mut dev, &ranges, n)?);
        rows.push(batched(device, "batch D2H pinned", &stream, &dev, &mut pinned, &ranges, n)?);
        rows.push(batched(device, "batch D2D", &stream, &dev, &mut dev2, &ranges, n)?);
    }
    Ok(())
}

/// Pieces in a batch row: a paged cache's blocks moved at once (the design notes measured a
/// batch of 1024 x 64 KiB at twice the rate of a loop of `cudaMemcpyAsync`).
const BATCH_PIECES: usize = 1024;

/// [`BATCH_PIECES`] ranges of `piece` bytes: source piece k goes to destination piece
/// 7919 k mod 1024 (a scatter, as a page table makes; 7919 is prime, so no two collide).
fn scattered_pieces(piece: usize) -> Vec<CopyRange> {
    (0..BATCH_PIECES).map(|k| CopyRange::new(k * piece, (k * 7919 % BATCH_PIECES) * piece, piece)).collect()
}

/// One batch row: the wall time from the call to the completion of `ranges` as one batch
/// (`copy_ranges`, one `cudaMemcpyBatchAsync` on CUDA), against one copy of the same bytes
/// (the ceiling) and the loop of `copy_range` calls a user would otherwise write (the
/// baseline), all in this run; the params add the same ranges as one `cudaMemcpyAsync` each
/// under one ordering record (`copy_ranges_one_by_one`: the API's own gain, without
/// cuferry's bookkeeping per call). Wall time, because what a batch saves is the host's cost per
/// call.
fn batched<S: Memory<u8>, D: Memory<u8>>(
    device: Device,
    case: &'static str,
    stream: &Stream,
    src: &S,
    dst: &mut D,
    ranges: &[CopyRange],
    n: usize,
) -> Result<Row> {
    let total: usize = ranges.iter().map(|r| r.len).sum();
    let batch = median_secs(n, || {
        copy_ranges(stream, src, &mut *dst, ranges)?;
        stream.synchronize()
    })?;
    let one_copy = median_secs(n, || {
        copy_range(stream, src, 0, &mut *dst, 0, total)?;
        stream.synchronize()
    })?;
    let loop_of_copies = median_secs(n, || {
        for r in ranges {
            copy_range(stream, src, r.src_offset, &mut *dst, r.dst_offset, r.len)?;
        }
        stream.synchronize()
    })?;
    let one_by_one = median_secs(n, || {
        copy_ranges_one_by_one(stream, src, &mut *dst, ranges)?;
        stream.synchronize()
    })?;
    // Not behind an L2 flush: the three timings share the cache state (4 MiB of 4 KiB pieces
    // fit an H100's L2), so they compare with each other, not with the flushed D2D rows.
    let on = if device.is_host() { "one host job" } else { "one cudaMemcpyBatchAsync, L2 not flushed" };
    Ok(Row {
        section: "copy",
        case: case.into(),
        bytes: ranges.first().map_or(0, |r| r.len),
        params: format!(
            "{} pieces scattered, {on}; wall time, call to completion; one call per range \
             (copy_ranges_one_by_one): {:.1} GB/s, the batch {:.2}x that",
            ranges.len(),
            gbps(total, one_by_one),
            one_by_one / batch,
        ),
        value: gbps(total, batch),
        unit: "GB/s",
        ceiling: Some(("one copy of the same bytes".into(), gbps(total, one_copy))),
        baseline: Some(("a loop of copy_range".into(), gbps(total, loop_of_copies))),
        same_threads: None,
    })
}

/// One copy row, without its ceiling (the caller's, for H2D and D2H rows).
fn row(device: Device, peer: Device, case: &'static str, bytes: usize, secs: f64, wall: Option<f64>) -> Row {
    let mut params = match case {
        "peer" if device.is_host() => format!("{device} -> {peer}"),
        "peer" => format!("{device} -> {peer}, cold L2"),
        "D2D" if !device.is_host() => "cold L2; device memory moves 2x (read + write)".into(),
        _ => String::new(),
    };
    if let Some(wall) = wall {
        let sep = if params.is_empty() { "" } else { ", " };
        params = format!("{params}{sep}latency {:.1} us (wall, call to completion)", wall * 1e6);
    }
    Row {
        section: "copy",
        case: case.into(),
        bytes,
        params,
        value: gbps(bytes, secs),
        unit: "GB/s",
        ceiling: None,
        baseline: None,
        same_threads: None,
    }
}
