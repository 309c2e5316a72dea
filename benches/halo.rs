//! Halo pack throughput, as ratios to the ceiling measured in the same run.
//!
//! Cases: 1, 4 and 10 arrays of 48 x 48 x 79 f64 with a halo of 3 (the cubed-sphere tile),
//! stored (z, y, x) with x contiguous, packing all four edges, the x-faces only (rows of 3
//! elements, 24 bytes: the worst case) or the y-faces only (rows of 48 elements, 384 bytes);
//! the 10-array edges and y-faces also turned once (a transpose); and 4 arrays of
//! 384 x 384 x 79 (12 MB packed; y-face rows of 3 KB).
//!
//! Host backend: `HaloPacker::pack` + `synchronize` (queue, use tracking, completion wait
//! included; the job runs on the stream's worker, or on the caller when it is at most 1 MiB
//! and the stream is idle) against `copy_from_slice` of the same number of bytes (the memcpy
//! ceiling: glibc's `memcpy`, which on x86 copies more than ~2 KiB with `rep movsb`), and the
//! seed's strategy (index arrays, one gather per array per edge) for the 10-array case. The
//! ratio table runs every case with one thread and, above 512 KiB (threaded by default), also
//! threaded; criterion adds a one-thread line above 4 MiB. Target: pack >= 70% of the
//! memcpy rate for rows >= 128 B, one thread against one memcpy, and threaded against a
//! memcpy split over as many threads as the pack uses (`HaloPacker::host_job_threads`, shown
//! in the row). Before 2026-11-23's fourth session the threaded column was compared with one
//! memcpy thread, and until 2026-11-24's twenty-sixth session with a memcpy split by the
//! executor's own rule (256 KiB pieces: about half the pack's threads below 4 MiB); both
//! flattered it.
//!
//! The `halo_cpu_ratio_cold` table printed before it times single calls, each right after a
//! flush of the CPU caches (both the pack and the memcpy start cold, as a halo exchange does
//! after a time step's compute, and as the CUDA rows of `cuferry bench --section halo` start
//! with a flushed L2; this file's CUDA rows are warm). The warm table
//! measures a memcpy whose buffers stay in L2 while the pack reads rows spread over the
//! arrays; the cold one measures what a time step sees.
//!
//! Criterion measures each line in its own steady state. The `halo_cpu_ratio` table printed
//! after the cold one measures pack and memcpy of each case in alternating batches (the order flips every
//! round, each batch after one untimed call), and reports the median batch time of each and
//! the median of the per-round ratios: on a busy machine that is the number to quote.
//!
//! CUDA, when a device is present: the one-launch kernel against the seed baseline (one launch
//! per array per edge) and a same-bytes device-to-device copy, each timed over back-to-back
//! calls with one wait at the end. Without a device it prints `SKIP: no CUDA device`.
//!
//! Criterion reports bytes per second; compare the lines of one group (one run).

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use cuferry::halo::baseline::SeedBaseline;
use cuferry::halo::{ElementType, HaloExchange, HaloPacker, HaloSpec, HorizontalDims};
use cuferry::ring::PackExecutor;
use cuferry::{copy, Device, DeviceBuffer, Stream};

const HALO: usize = 3;
const LEVELS: usize = 79;

#[derive(Clone, Copy, Debug)]
enum Faces {
    All,
    OnlyX,
    OnlyY,
}

impl Faces {
    fn name(self) -> &'static str {
        match self {
            Faces::All => "edges",
            Faces::OnlyX => "xfaces",
            Faces::OnlyY => "yfaces",
        }
    }
}

/// One case: the spec of each array and its exchanges.
struct Case {
    name: String,
    spec: HaloSpec,
    exchanges: Vec<HaloExchange>,
    arrays: usize,
}

/// `arrays` tiles of n x n x LEVELS (plus halo), packing `faces`; `turned`: each edge turned a
/// quarter clockwise into the halo of the next side (as across a cube edge).
fn case(n: usize, arrays: usize, faces: Faces, turned: bool) -> Case {
    let w = n + 2 * HALO;
    let spec =
        HaloSpec::contiguous(ElementType::F64, &[LEVELS, w, w], HorizontalDims::xy(2, 1)).expect("spec");
    let (lo, hi, mid) = (HALO..2 * HALO, n..n + HALO, HALO..HALO + n);
    let (halo_lo, halo_hi) = (0..HALO, n + HALO..w);
    let z = 0..LEVELS;
    // (pack y, pack x, unpack y, unpack x) per edge, unturned: each edge into the opposite halo.
    let west = (mid.clone(), lo.clone(), mid.clone(), halo_hi.clone());
    let east = (mid.clone(), hi.clone(), mid.clone(), halo_lo.clone());
    let south = (lo, mid.clone(), halo_hi.clone(), mid.clone());
    let north = (hi, mid.clone(), halo_lo.clone(), mid.clone());
    let edges = match faces {
        Faces::All => vec![west, east, south, north],
        Faces::OnlyX => vec![west, east],
        Faces::OnlyY => vec![south, north],
    };
    let mut per_array = Vec::new();
    for (py, px, uy, ux) in edges {
        let ex = if turned {
            // A quarter turn swaps the strip's extents: unpack into the halo of the next side.
            let (uy, ux) = if px.len() == HALO {
                (halo_lo.clone(), mid.clone())
            } else {
                (mid.clone(), halo_lo.clone())
            };
            HaloExchange::new(&spec, &[z.clone(), py, px], 1, &[z.clone(), uy, ux])
        } else {
            HaloExchange::new(&spec, &[z.clone(), py, px], 0, &[z.clone(), uy, ux])
        };
        per_array.push(ex.expect("exchange"));
    }
    let exchanges: Vec<HaloExchange> = (0..arrays).flat_map(|_| per_array.iter().cloned()).collect();
    let name = format!("{arrays}x{n}^2x{LEVELS}_{}{}", faces.name(), if turned { "_turned" } else { "" });
    Case { name, spec, exchanges, arrays }
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for arrays in [1, 4, 10] {
        for faces in [Faces::All, Faces::OnlyX, Faces::OnlyY] {
            out.push(case(48, arrays, faces, false));
        }
    }
    out.push(case(48, 10, Faces::All, true));
    out.push(case(48, 10, Faces::OnlyY, true));
    for faces in [Faces::All, Faces::OnlyX, Faces::OnlyY] {
        out.push(case(384, 4, faces, false));
    }
    out
}

/// The arrays of a case (filled), and the per-exchange array list.
fn arrays_of(stream: &Stream, c: &Case) -> Vec<DeviceBuffer<f64>> {
    let len = c.spec.required_len();
    (0..c.arrays)
        .map(|a| {
            let data: Vec<f64> = (0..len).map(|i| (i * 7 + a) as f64).collect();
            DeviceBuffer::from_slice(stream, &data).expect("array")
        })
        .collect()
}

fn per_exchange<'a>(c: &Case, arrays: &'a [DeviceBuffer<f64>]) -> Vec<&'a DeviceBuffer<f64>> {
    let per = c.exchanges.len() / c.arrays;
    (0..c.exchanges.len()).map(|i| &arrays[i / per]).collect()
}

/// Whether every packed row of a case is at least 128 bytes (the target's scope): y-faces only,
/// not turned.
fn long_rows(c: &Case) -> bool {
    // Turned y-faces are a transpose: their packed rows are 3 elements (24 bytes).
    c.name.contains("yfaces") && !c.name.contains("turned")
}

/// Median of `v` (not empty).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The per-round (or per-sample) times of one case in a ratio table: memcpy, one-thread pack,
/// parallel memcpy, threaded pack, and the two ratios of each round.
#[derive(Default)]
struct RatioSamples {
    memcpy: Vec<f64>,
    pack_1: Vec<f64>,
    memcpy_thr: Vec<f64>,
    pack_thr: Vec<f64>,
    ratio_1: Vec<f64>,
    ratio_thr: Vec<f64>,
}

impl RatioSamples {
    fn print_header() {
        println!(
            "{:<30} {:>10} {:>8} {:>12} {:>9} {:>6}  {:>3} {:>10} {:>9} {:>6}",
            "case", "bytes", "memcpy", "pack 1 thr", "", "", "thr", "memcpy thr", "pack thr", ""
        );
    }

    fn push(&mut self, memcpy: f64, pack_1: f64, memcpy_thr: f64, pack_thr: f64) {
        self.memcpy.push(memcpy);
        self.pack_1.push(pack_1);
        self.memcpy_thr.push(memcpy_thr);
        self.pack_thr.push(pack_thr);
        self.ratio_1.push(memcpy / pack_1);
        self.ratio_thr.push(memcpy_thr / pack_thr);
    }

    /// Prints the medians of a case: rates, ratios, and a verdict for cases in the target's
    /// scope (rows >= 128 B); the threaded columns (after their thread count) only when the
    /// case runs on `threads` > 1.
    fn print_row(mut self, c: &Case, bytes: usize, threads: usize) {
        let gbs = |t: f64| bytes as f64 / t / 1e9;
        let (m, p1) = (median(&mut self.memcpy), median(&mut self.pack_1));
        let (mp, pt) = (median(&mut self.memcpy_thr), median(&mut self.pack_thr));
        let (q1, qt) = (median(&mut self.ratio_1), median(&mut self.ratio_thr));
        let verdict = |q: f64| match (long_rows(c), q >= 0.7) {
            (false, _) => "",
            (true, true) => "ok",
            (true, false) => "MISS",
        };
        let thr = if threads > 1 {
            format!("{threads:>3} {:>5.1} GB/s {:>6.1} GB/s {qt:>5.2}x {}", gbs(mp), gbs(pt), verdict(qt))
        } else {
            String::new()
        };
        println!(
            "{:<30} {bytes:>10} {:>5.1} GB/s {:>7.1} GB/s {q1:>5.2}x {:<4}  {thr}",
            c.name,
            gbs(m),
            gbs(p1),
            verdict(q1)
        );
    }
}

/// Seconds per call of `f`, over `iters` calls after one untimed call.
fn batch(iters: u32, mut f: impl FnMut()) -> f64 {
    f();
    let t0 = Instant::now();
    for _ in 0..iters {
        f();
    }
    t0.elapsed().as_secs_f64() / f64::from(iters)
}

/// What both ratio tables build per case: the packer and its arrays, and the memcpy pool
/// with as many threads as the packer's threaded job uses.
struct RatioSetup {
    packer: HaloPacker,
    arrays: Vec<DeviceBuffer<f64>>,
    bytes: usize,
    /// The packer's thread budget (`host_threads`, the default).
    budget: usize,
    /// The threads a pack uses under that budget; above 1 the threaded columns run, against
    /// a memcpy split into as many pieces.
    threads: usize,
    pool: PackExecutor,
}

impl RatioSetup {
    fn new(c: &Case) -> Self {
        let packer = HaloPacker::new(Device::Host, &c.exchanges, None).expect("packer");
        let arrays = arrays_of(&packer.stream().clone(), c);
        let bytes = packer.buffer_bytes();
        let budget = packer.host_threads();
        let threads = packer.host_job_threads();
        let pool = PackExecutor::new(threads).expect("pack executor");
        RatioSetup { packer, arrays, bytes, budget, threads, pool }
    }
}

/// The same-run ratio table: pack + synchronize against memcpy of the same bytes, in
/// alternating batches (see the module docs), single-threaded against one memcpy and, above
/// 512 KiB, threaded against a parallel memcpy with as many threads (a persistent
/// [`PackExecutor`], as the packer's helpers are persistent).
fn host_ratios(_: &mut Criterion) {
    const ROUNDS: usize = 31;
    println!("halo_cpu_ratio: pack+sync vs memcpy of the same bytes, alternating batches, {ROUNDS} rounds");
    println!("(pack 1 thr against one memcpy; pack thr against a memcpy with as many threads)");
    RatioSamples::print_header();
    for c in cases() {
        let RatioSetup { mut packer, arrays, bytes, budget, threads, pool } = RatioSetup::new(&c);
        let threaded = threads > 1;
        let list = per_exchange(&c, &arrays);
        let (src, mut dst) = (vec![1.5f64; bytes / 8], vec![0.0f64; bytes / 8]);
        let (src_bytes, mut dst_bytes) = (vec![1u8; bytes], vec![0u8; bytes]);
        // About 5 ms of memcpy per batch at 20 GB/s.
        let iters = u32::try_from((100_000_000 / bytes.max(1)).clamp(2, 10_000)).unwrap_or(2);
        let mut samples = RatioSamples::default();
        for round in 0..ROUNDS {
            let mut memcpy = || {
                batch(iters, || {
                    dst.copy_from_slice(std::hint::black_box(&src));
                    std::hint::black_box(&mut dst);
                })
            };
            let mut parallel_memcpy = || {
                batch(iters, || {
                    pool.copy_in_pieces(std::hint::black_box(&src_bytes), &mut dst_bytes, threads)
                        .expect("copy");
                    std::hint::black_box(&mut dst_bytes);
                })
            };
            let mut pack = |n: usize| {
                packer.set_host_threads(n);
                batch(iters, || {
                    packer.pack(&list, None).expect("pack");
                    packer.synchronize().expect("sync");
                })
            };
            let (m, p1, mp, pt) = if round % 2 == 0 {
                let m = memcpy();
                let p1 = pack(1);
                if threaded {
                    let mp = parallel_memcpy();
                    (m, p1, mp, pack(budget))
                } else {
                    (m, p1, m, p1)
                }
            } else {
                let (pt, mp) =
                    if threaded { (pack(budget), parallel_memcpy()) } else { (f64::NAN, f64::NAN) };
                let p1 = pack(1);
                let m = memcpy();
                if threaded {
                    (m, p1, mp, pt)
                } else {
                    (m, p1, m, p1)
                }
            };
            samples.push(m, p1, mp, pt);
        }
        samples.print_row(&c, bytes, threads);
    }
}

/// Fewest bytes a [`CacheFlush`] reads: eight times the 32 MiB L3 of the development VM.
const MIN_FLUSH_BYTES: usize = 256 << 20;

/// The largest CPU cache sysfs reports for cpu0 (0 when it reports none).
fn largest_cache_bytes() -> usize {
    let Ok(dirs) = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache") else { return 0 };
    dirs.filter_map(|d| std::fs::read_to_string(d.ok()?.path().join("size")).ok())
        .filter_map(|s| {
            let s = s.trim();
            let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
            let n: usize = digits.parse().ok()?;
            Some(match unit {
                "K" => n << 10,
                "M" => n << 20,
                _ => n,
            })
        })
        .max()
        .unwrap_or(0)
}

/// Evicts the CPU caches by reading a buffer of [`MIN_FLUSH_BYTES`] or three times the largest
/// cache (the GPU machine's host has a 300 MiB L3), whichever is more: the host counterpart of
/// the CUDA bench's L2 flush. A halo exchange runs once per time step, after the model's
/// compute has swept the caches, so neither its arrays nor a memcpy's buffers are cached when
/// it starts.
struct CacheFlush {
    lines: Vec<u64>,
}

impl CacheFlush {
    fn new() -> CacheFlush {
        let bytes = MIN_FLUSH_BYTES.max(3 * largest_cache_bytes());
        // Written once, so every page is backed (a never-written page reads the zero page).
        CacheFlush { lines: (0..bytes as u64 / 8).collect() }
    }

    /// Reads one word of every 64-byte line.
    fn flush(&self) {
        let mut sum = 0u64;
        for chunk in self.lines.chunks_exact(8) {
            sum = sum.wrapping_add(chunk[0]);
        }
        std::hint::black_box(sum);
    }
}

/// Seconds of one call of `f` right after a cache flush (outside the timed interval).
fn cold(flush: &CacheFlush, mut f: impl FnMut()) -> f64 {
    flush.flush();
    let t0 = Instant::now();
    f();
    t0.elapsed().as_secs_f64()
}

/// The cold-cache ratio table: as [`host_ratios`], but every timed call (pack + synchronize,
/// memcpy) starts after a [`CacheFlush`], one call per sample; each pair (one thread, then
/// threaded) runs in the order that flips every sample.
fn host_ratios_cold(_: &mut Criterion) {
    const SAMPLES: usize = 41;
    let flusher = CacheFlush::new();
    println!(
        "halo_cpu_ratio_cold: one call after a {} MiB cache flush, median of {SAMPLES} samples",
        (flusher.lines.len() * 8) >> 20
    );
    println!("(both sides cold, as after a time step's compute; pack 1 thr against one memcpy,");
    println!(" pack thr against a memcpy with as many threads)");
    RatioSamples::print_header();
    for c in cases() {
        let RatioSetup { mut packer, arrays, bytes, budget, threads, pool } = RatioSetup::new(&c);
        let threaded = threads > 1;
        let list = per_exchange(&c, &arrays);
        let (src, mut dst) = (vec![1u8; bytes], vec![0u8; bytes]);
        let mut samples = RatioSamples::default();
        for sample in 0..SAMPLES {
            let mut memcpy = || {
                cold(&flusher, || {
                    dst.copy_from_slice(std::hint::black_box(&src));
                    std::hint::black_box(&mut dst);
                })
            };
            let mut pack = |n: usize| {
                packer.set_host_threads(n);
                cold(&flusher, || {
                    packer.pack(&list, None).expect("pack");
                    packer.synchronize().expect("sync");
                })
            };
            let (m, p1) = if sample % 2 == 0 {
                let m = memcpy();
                (m, pack(1))
            } else {
                let p1 = pack(1);
                (memcpy(), p1)
            };
            let (mp, pt) = if !threaded {
                (m, p1)
            } else if sample % 2 == 0 {
                let mp = cold(&flusher, || {
                    pool.copy_in_pieces(std::hint::black_box(&src), &mut dst, threads).expect("copy");
                });
                (mp, pack(budget))
            } else {
                let pt = pack(budget);
                let mp = cold(&flusher, || {
                    pool.copy_in_pieces(std::hint::black_box(&src), &mut dst, threads).expect("copy");
                });
                (mp, pt)
            };
            samples.push(m, p1, mp, pt);
        }
        samples.print_row(&c, bytes, threads);
    }
}

fn host_pack(cr: &mut Criterion) {
    let mut group = cr.benchmark_group("halo_cpu");
    group.sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    for c in cases() {
        let mut packer = HaloPacker::new(Device::Host, &c.exchanges, None).expect("packer");
        let stream = packer.stream().clone();
        let arrays = arrays_of(&stream, &c);
        let list = per_exchange(&c, &arrays);
        let bytes = packer.buffer_bytes();
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(BenchmarkId::new("pack", &c.name), |b| {
            b.iter(|| {
                packer.pack(&list, None).expect("pack");
                packer.synchronize().expect("sync");
            })
        });
        let (src, mut dst) = (vec![1.5f64; bytes / 8], vec![0.0f64; bytes / 8]);
        group.bench_function(BenchmarkId::new("memcpy", &c.name), |b| {
            b.iter(|| {
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&mut dst);
            })
        });
        if bytes > 4 << 20 {
            packer.set_host_threads(1);
            group.bench_function(BenchmarkId::new("pack_1thread", &c.name), |b| {
                b.iter(|| {
                    packer.pack(&list, None).expect("pack");
                    packer.synchronize().expect("sync");
                })
            });
        }
        if c.name == "10x48^2x79_edges" {
            let mut seed = SeedBaseline::new(&stream, &c.exchanges).expect("seed baseline");
            group.bench_function(BenchmarkId::new("seed_index_gather", &c.name), |b| {
                b.iter(|| {
                    seed.pack(&list).expect("seed pack");
                    stream.synchronize().expect("sync");
                })
            });
        }
    }
    group.finish();
}

/// Times `iters` back-to-back calls of `f` with one wait at the end.
fn timed(iters: u64, mut f: impl FnMut(), wait: impl Fn()) -> Duration {
    let t0 = Instant::now();
    for _ in 0..iters {
        f();
    }
    wait();
    t0.elapsed()
}

fn cuda_pack(cr: &mut Criterion) {
    if Device::cuda_count() == 0 {
        println!("SKIP: no CUDA device (halo_cuda benches)");
        return;
    }
    let device = Device::Cuda(0);
    let mut group = cr.benchmark_group("halo_cuda");
    group.sample_size(30).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    for c in cases() {
        let mut packer = HaloPacker::new(device, &c.exchanges, None).expect("packer");
        let stream = packer.stream().clone();
        let arrays = arrays_of(&stream, &c);
        let list = per_exchange(&c, &arrays);
        let bytes = packer.buffer_bytes();
        group.throughput(Throughput::Bytes(bytes as u64));
        packer.pack(&list, None).expect("first pack (uploads the table)");
        packer.synchronize().expect("sync");
        group.bench_function(BenchmarkId::new("one_launch", &c.name), |b| {
            b.iter_custom(|iters| {
                timed(
                    iters,
                    || packer.pack(&list, None).expect("pack"),
                    || stream.synchronize().expect("sync"),
                )
            })
        });
        let mut seed = SeedBaseline::new(&stream, &c.exchanges).expect("seed baseline");
        group.bench_function(
            BenchmarkId::new(format!("seed_{}_launches", seed.launches_per_pack()), &c.name),
            |b| {
                b.iter_custom(|iters| {
                    timed(iters, || seed.pack(&list).expect("seed"), || stream.synchronize().expect("sync"))
                })
            },
        );
        let src = DeviceBuffer::<u8>::zeroed(&stream, bytes).expect("src");
        let mut dst = DeviceBuffer::<u8>::zeroed(&stream, bytes).expect("dst");
        group.bench_function(BenchmarkId::new("d2d_copy", &c.name), |b| {
            b.iter_custom(|iters| {
                timed(
                    iters,
                    || {
                        copy(&stream, &src, &mut dst).expect("d2d");
                    },
                    || stream.synchronize().expect("sync"),
                )
            })
        });
    }
    group.finish();
}

criterion_group!(benches, host_ratios_cold, host_ratios, host_pack, cuda_pack);
criterion_main!(benches);
