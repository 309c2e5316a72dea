//! The halo section: packing 1, 4 and 10 arrays of 48 x 48 x 79 f64 with a halo of 3 (all
//! edges, x-faces only, y-faces only, and the 10-array edges turned a quarter), and 4 arrays
//! of 384^2 x 79; on CUDA also 8 arrays of 384^2 x 79 (y-faces, x-faces: 11.6 MB each) and,
//! without --quick, 1 array of 1536^2 x 79. Per case, in one run: the packer
//! (launches per call, time), the seed's strategy (an index array per array per edge, one
//! launch or gather each), and a copy of the same bytes (D2D on CUDA; on the host a memcpy on
//! the calling thread, where the host pack of up to 1 MiB runs too, on one thread).
//! On CUDA the packer is also timed with its descriptors in the launch's parameters
//! ([`DescriptorPlacement::LaunchParameters`]; the ratio is default time / that time), and,
//! with the copy, with the L2 fetch granularity at one 32-byte sector (ratio: default / that),
//! the device's default put back after.
//! Arrays are stored (z, y, x), x contiguous. On CUDA every timed run of the three starts
//! with the L2 flushed ([`L2Flush`]): the copy's 2 x 11.6 MB would otherwise stay in the 50 MB
//! L2 between runs while the arrays the packer reads (up to 8 x 96 MB) cannot.
//! Each case's first row times from an idle device to completion (host submission and launch
//! gaps included: what the seed's many launches cost a caller, and the >= 12x target); on CUDA
//! a second row, "device time", times the pack and the copy queued behind the flush, so the
//! host's fixed costs (several microseconds, as much as an 11.6 MB copy's transfer takes) are
//! left out of the rates the >= 90% / >= 70% targets compare.

use cuferry::halo::baseline::SeedBaseline;
use cuferry::halo::{DescriptorPlacement, ElementType, HaloExchange, HaloPacker, HaloSpec, HorizontalDims};
use cuferry::{copy, Device, DeviceBuffer, Result, Stream};

use super::measure::{gbps, median_device_secs_after, median_device_secs_queued, median_secs, L2Flush};
use super::output::Rows;
use super::report::Row;

const HALO: usize = 3;
const LEVELS: usize = 79;

/// One case: a spec, the exchanges of every array, and the number of arrays.
struct Case {
    name: String,
    spec: HaloSpec,
    exchanges: Vec<HaloExchange>,
    arrays: usize,
}

/// `arrays` tiles of n x n x LEVELS (plus halo); `faces`: "edges", "x-faces" or "y-faces";
/// `turned`: each strip turned a quarter clockwise into the next side's halo.
fn case(n: usize, arrays: usize, faces: &str, turned: bool) -> Result<Case> {
    let w = n + 2 * HALO;
    let spec = HaloSpec::contiguous(ElementType::F64, &[LEVELS, w, w], HorizontalDims::xy(2, 1))?;
    let (lo, hi, mid) = (HALO..2 * HALO, n..n + HALO, HALO..HALO + n);
    let (halo_lo, halo_hi) = (0..HALO, n + HALO..w);
    // (pack y, pack x, unpack y, unpack x): each edge into the opposite halo.
    let x_faces = [
        (mid.clone(), lo.clone(), mid.clone(), halo_hi.clone()),
        (mid.clone(), hi.clone(), mid.clone(), halo_lo.clone()),
    ];
    let y_faces = [(lo, mid.clone(), halo_hi, mid.clone()), (hi, mid.clone(), halo_lo.clone(), mid.clone())];
    let edges: Vec<_> = match faces {
        "x-faces" => x_faces.to_vec(),
        "y-faces" => y_faces.to_vec(),
        _ => x_faces.iter().chain(&y_faces).cloned().collect(),
    };
    let z = 0..LEVELS;
    let mut per_array = Vec::new();
    for (py, px, uy, ux) in edges {
        let (rotation, uy, ux) = if turned {
            // A quarter turn swaps the strip's extents.
            if px.len() == HALO {
                (1, halo_lo.clone(), mid.clone())
            } else {
                (1, mid.clone(), halo_lo.clone())
            }
        } else {
            (0, uy, ux)
        };
        per_array.push(HaloExchange::new(&spec, &[z.clone(), py, px], rotation, &[z.clone(), uy, ux])?);
    }
    let exchanges = (0..arrays).flat_map(|_| per_array.iter().cloned()).collect();
    let name = format!("{arrays} x {n}^2 x {LEVELS}, {faces}{}", if turned { ", turned" } else { "" });
    Ok(Case { name, spec, exchanges, arrays })
}

fn cases(device: Device, quick: bool) -> Result<Vec<Case>> {
    let mut out = Vec::new();
    for arrays in [1, 4, 10] {
        for faces in ["edges", "x-faces", "y-faces"] {
            out.push(case(48, arrays, faces, false)?);
        }
    }
    out.push(case(48, 10, "edges", true)?);
    for faces in ["edges", "x-faces", "y-faces"] {
        out.push(case(384, 4, faces, false)?);
    }
    if !device.is_host() {
        // Regions of 11.6 MB with one kind of row each: the scope of the >= 10 MB targets.
        out.push(case(384, 8, "y-faces", false)?);
        out.push(case(384, 8, "x-faces", false)?);
        if !quick {
            out.push(case(1536, 1, "edges", false)?);
        }
    }
    Ok(out)
}

/// One DRAM sector: the L2 fetch granularity the sector rows ask for.
const SECTOR_BYTES: usize = 32;

/// The device's L2 fetch granularity changed for a measurement; put back on drop (errors
/// included) or by [`L2FetchSetting::restore`].
struct L2FetchSetting {
    device: Device,
    previous: usize,
    applied: usize,
    restored: bool,
}

impl L2FetchSetting {
    fn apply(device: Device, bytes: usize) -> Result<Self> {
        let previous = device.l2_fetch_granularity()?;
        let applied = device.set_l2_fetch_granularity(bytes)?;
        Ok(L2FetchSetting { device, previous, applied, restored: false })
    }

    fn restore(mut self) -> Result<()> {
        self.restored = true;
        self.device.set_l2_fetch_granularity(self.previous).map(drop)
    }
}

impl Drop for L2FetchSetting {
    fn drop(&mut self) {
        if !self.restored {
            // Best effort on an error path: the error being returned says more than this one.
            let _ = self.device.set_l2_fetch_granularity(self.previous);
        }
    }
}

/// How a case's runs are timed: on `stream`, the median of `repeats`, each after `flush`.
struct Timing<'a, F: FnMut() -> Result<()>> {
    stream: &'a Stream,
    repeats: usize,
    flush: &'a mut F,
}

impl<F: FnMut() -> Result<()>> Timing<'_, F> {
    fn median(&mut self, op: impl FnMut() -> Result<()>) -> Result<f64> {
        median_device_secs_after(self.stream, self.repeats, &mut *self.flush, op)
    }
}

/// The params note of the 32-byte L2 fetch: the pack with each descriptor placement and the
/// same-bytes copy, against `pack` (seconds at the default). A device that refuses the setting
/// gets a note saying so, not an error.
fn sector_fetch_note<F: FnMut() -> Result<()>>(
    mut timing: Timing<'_, F>,
    packer: &mut HaloPacker,
    list: &[&DeviceBuffer<f64>],
    bytes: usize,
    pack: f64,
) -> Result<String> {
    let fetch = match L2FetchSetting::apply(timing.stream.device(), SECTOR_BYTES) {
        Ok(fetch) => fetch,
        Err(e) => return Ok(format!("; L2 fetch {SECTOR_BYTES} B: not settable ({e})")),
    };
    let secs = timing.median(|| packer.pack(list, None))?;
    let both = if packer.set_descriptor_placement(DescriptorPlacement::LaunchParameters).is_ok() {
        let both = timing.median(|| packer.pack(list, None))?;
        packer.set_descriptor_placement(DescriptorPlacement::DeviceMemory)?;
        format!(", with descriptors as launch parameters {:.1} us ({:.2}x)", both * 1e6, pack / both)
    } else {
        String::new()
    };
    let src = DeviceBuffer::<u8>::zeroed(timing.stream, bytes)?;
    let mut dst = DeviceBuffer::<u8>::zeroed(timing.stream, bytes)?;
    let copy_secs = timing.median(|| copy(timing.stream, &src, &mut dst).map(drop))?;
    let note = format!(
        "; L2 fetch {} B (default {} B): {:.1} us ({:.2}x){both}, D2D same bytes {:.1} us",
        fetch.applied,
        fetch.previous,
        secs * 1e6,
        pack / secs,
        copy_secs * 1e6
    );
    fetch.restore()?;
    Ok(note)
}

/// Runs the section, adding its rows to `rows` as they are measured.
pub fn run(device: Device, quick: bool, rows: &mut Rows) -> Result<()> {
    let stream = Stream::new(device)?;
    let mut flusher = L2Flush::new(&stream)?;
    let repeats = if quick { 10 } else { 30 };
    for c in cases(device, quick)? {
        let len = c.spec.required_len();
        let arrays: Vec<DeviceBuffer<f64>> = (0..c.arrays)
            .map(|a| {
                let data: Vec<f64> = (0..len).map(|i| (i * 7 + a) as f64).collect();
                DeviceBuffer::from_slice(&stream, &data)
            })
            .collect::<Result<_>>()?;
        let per = c.exchanges.len() / c.arrays;
        let list: Vec<&DeviceBuffer<f64>> = (0..c.exchanges.len()).map(|i| &arrays[i / per]).collect();

        let mut packer = HaloPacker::with_stream(&stream, &c.exchanges, None)?;
        // The host ceiling is one memcpy thread, so the host pack runs on one thread too (the
        // threaded pack against a parallel memcpy is in the criterion bench's ratio table).
        packer.set_host_threads(1);
        let bytes = packer.buffer_bytes();
        // Every run starts with a cold L2 (on CUDA), the packer's, the seed's and the copy's.
        let mut flush = || flusher.as_mut().map_or(Ok(()), |f| f.queue(&stream));
        let pack = median_device_secs_after(&stream, repeats, &mut flush, || packer.pack(&list, None))?;
        // The same packer with its descriptors in the launch's parameters (CUDA, up to 64
        // regions): the variant that spares each block the table's loads.
        let inline = if !device.is_host()
            && packer.set_descriptor_placement(DescriptorPlacement::LaunchParameters).is_ok()
        {
            let secs = median_device_secs_after(&stream, repeats, &mut flush, || packer.pack(&list, None))?;
            packer.set_descriptor_placement(DescriptorPlacement::DeviceMemory)?;
            format!("; descriptors as launch parameters: {:.1} us ({:.2}x)", secs * 1e6, pack / secs)
        } else {
            String::new()
        };
        // The pack and the copy again with the L2 fetching one 32-byte sector per miss: sparse
        // rows (x-faces) then move less DRAM traffic.
        let sector = if device.is_host() {
            String::new()
        } else {
            let timing = Timing { stream: &stream, repeats, flush: &mut flush };
            sector_fetch_note(timing, &mut packer, &list, bytes, pack)?
        };
        let mut seed = SeedBaseline::new(&stream, &c.exchanges)?;
        let seed_secs = median_device_secs_after(&stream, repeats, &mut flush, || seed.pack(&list))?;
        // Not zeros (METHOD.md: zeros can run faster than real data).
        let pattern: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8 + 1).collect();
        let src = DeviceBuffer::<u8>::from_slice(&stream, &pattern)?;
        let mut dst = DeviceBuffer::<u8>::zeroed(&stream, bytes)?;
        let mut same_bytes_copy = || copy(&stream, &src, &mut dst).map(drop);
        // On the host backend the packer runs exchanges of up to 1 MiB on the calling thread,
        // but a stream copy hands anything over 256 KiB to the stream's worker: the ceiling
        // there is a plain memcpy on the calling thread, as in the criterion bench.
        let mut host_dst = vec![0u8; bytes];
        let mut host_memcpy = || -> Result<f64> {
            median_secs(repeats, || {
                host_dst.copy_from_slice(&pattern);
                std::hint::black_box(&mut host_dst);
                Ok(())
            })
        };
        let same_bytes = if device.is_host() {
            host_memcpy()?
        } else {
            median_device_secs_after(&stream, repeats, &mut flush, &mut same_bytes_copy)?
        };
        // Device time alone (each run queued behind the flush, so the host's submission and the
        // launch latency are hidden): the rates the >= 10 MB targets compare.
        // On the host there is no device time: the row above is the whole story.
        let device_time = if device.is_host() {
            None
        } else {
            let pack = median_device_secs_queued(&stream, repeats, &mut flush, || packer.pack(&list, None))?;
            Some((pack, median_device_secs_queued(&stream, repeats, &mut flush, &mut same_bytes_copy)?))
        };
        let copy_name = if device.is_host() { "memcpy same bytes" } else { "D2D same bytes" };
        rows.push(Row {
            section: "halo",
            case: c.name.clone(),
            bytes,
            params: format!(
                "call to completion: {} launch(es), {:.1} us; seed: {} launches, {:.1} us ({:.1}x); \
                 {copy_name} {:.1} us{inline}{sector}",
                packer.launches_per_call(),
                pack * 1e6,
                seed.launches_per_pack(),
                seed_secs * 1e6,
                seed_secs / pack,
                same_bytes * 1e6,
            ),
            value: gbps(bytes, pack),
            unit: "GB/s",
            ceiling: Some((copy_name.into(), gbps(bytes, same_bytes))),
            baseline: Some(("seed strategy".into(), gbps(bytes, seed_secs))),
            same_threads: None,
        });
        if let Some((pack_device, copy_device)) = device_time {
            rows.push(Row {
                section: "halo",
                case: format!("{}, device time", c.name),
                bytes,
                params: format!(
                    "queued behind the L2 flush: pack {:.1} us, {copy_name} {:.1} us",
                    pack_device * 1e6,
                    copy_device * 1e6
                ),
                value: gbps(bytes, pack_device),
                unit: "GB/s",
                ceiling: Some((copy_name.into(), gbps(bytes, copy_device))),
                baseline: None,
                same_threads: None,
            });
        }
    }
    Ok(())
}
