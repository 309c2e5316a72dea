//! Managed memory: pool reuse and statistics, concurrent allocation from several threads and
//! streams, bad arguments, bulk deduplication, and data through prefetches and kernels. Each
//! check runs on the host backend and, when a GPU is present, on CUDA.

mod common;

use cuferry::kernels::{fill_pattern_u32, pattern_value, sum_u32};
use cuferry::managed::{
    advise_all, discard_all, discard_and_prefetch_all, prefetch_all, prefetch_each, Advice, Location,
    ManagedPool, ManagedPoolOptions, PoolKind, DISCARDED_BYTE,
};
use cuferry::{copy, Device, DeviceBuffer, Error, Memory, Stream};

fn pool(device: Device) -> ManagedPool {
    ManagedPool::new(device, ManagedPoolOptions::default()).unwrap()
}

/// A pool of `cudaMallocManaged` memory on CUDA (memory that must take advice).
fn malloc_managed_pool(device: Device) -> ManagedPool {
    ManagedPool::new(device, ManagedPoolOptions { use_malloc_managed: true, ..Default::default() }).unwrap()
}

/// Checks one piece of advice on `pool`'s memory: the exact bytes, or, only for the memory of a
/// CUDA managed memory pool (whose driver may refuse advice), `Error::Unsupported` saying so.
/// Returns whether the advice was taken.
fn advice_taken(pool: &ManagedPool, got: Result<usize, Error>, want: usize) -> bool {
    match got {
        Ok(n) => {
            assert_eq!(n, want);
            true
        }
        Err(Error::Unsupported { what }) if pool.kind() == PoolKind::ManagedPool => {
            assert!(what.contains("managed memory pool") && what.contains("use_malloc_managed"), "{what}");
            false
        }
        Err(e) => panic!("advice failed on a {:?} pool: {e:?}", pool.kind()),
    }
}

/// Allocations count in the stats; frees give the bytes back; the high-water mark stays.
fn stats_and_reuse(device: Device) {
    let pool = pool(device);
    let stream = Stream::new(device).unwrap();
    let before = pool.stats().unwrap();
    let a = pool.alloc::<u64>(1 << 16, &stream).unwrap();
    let b = pool.alloc::<u8>(12_345, &stream).unwrap();
    let s = pool.stats().unwrap();
    assert!(s.used_current >= before.used_current + (8 << 16) + 12_345, "{s:?}");
    assert!(s.used_high >= s.used_current && s.reserved_current >= s.used_current, "{s:?}");
    drop(a);
    drop(b);
    stream.synchronize().unwrap();
    let after = pool.stats().unwrap();
    assert_eq!(after.used_current, before.used_current, "{after:?}");
    assert!(after.used_high >= s.used_current);
    // Reuse: many allocations of the same size in a row come back zeroed every time.
    for round in 0..20u32 {
        let mut buf = pool.alloc::<u32>(4096, &stream).unwrap();
        assert!(buf.as_slice().unwrap().iter().all(|&x| x == 0), "round {round}: not zeroed");
        buf.as_mut_slice().unwrap().fill(round);
    }
}

/// Several threads allocate, write, check and free at once, each on its own stream.
fn concurrent_threads(device: Device) {
    let pool = pool(device);
    let handles: Vec<_> = (0..6u32)
        .map(|t| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let stream = Stream::new(device).unwrap();
                for round in 0..25u32 {
                    let n = 1000 + (t * 37 + round * 11) as usize;
                    let mut buf = pool.alloc::<u32>(n, &stream).unwrap();
                    fill_pattern_u32(&stream, &mut buf, t * 1000 + round).unwrap();
                    let got = buf.as_slice().unwrap();
                    assert!(got.iter().enumerate().all(|(i, &v)| v == pattern_value(t * 1000 + round, i)));
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(pool.stats().unwrap().used_current, 0);
}

/// Bad arguments are typed errors.
fn bad_arguments(device: Device) {
    let pool = pool(device);
    let stream = Stream::new(device).unwrap();
    assert!(matches!(pool.alloc::<u8>(0, &stream), Err(Error::InvalidArgument { .. })));
    assert!(matches!(pool.alloc::<u64>(usize::MAX / 4, &stream), Err(Error::InvalidArgument { .. })));
    let other = if device.is_host() { None } else { Some(Stream::new(Device::Host).unwrap()) };
    if let Some(other) = other {
        assert!(matches!(pool.alloc::<u8>(16, &other), Err(Error::InvalidArgument { .. })));
    }
    let buf = pool.alloc::<u16>(100, &stream).unwrap();
    assert!(matches!(buf.subrange(50..101), Err(Error::InvalidArgument { .. })));
    assert!(matches!(buf.subrange(5..5), Err(Error::InvalidArgument { .. })));
    if device.is_host() {
        assert!(matches!(buf.prefetch(Location::Device(0), &stream), Err(Error::Unsupported { .. })));
        assert!(matches!(buf.advise_preferred_location(Location::Device(0)), Err(Error::Unsupported { .. })));
    }
    // What CUDA refuses whatever the memory is refused on every backend: accessed-by advice
    // naming a NUMA node, and a negative NUMA node anywhere.
    for numa in [Location::HostNuma(0), Location::HostNumaCurrent] {
        let got = buf.advise_accessed_by(numa);
        assert!(matches!(got, Err(Error::InvalidArgument { .. })), "{numa:?}: {got:?}");
        let got = buf.advise(Advice::UnsetAccessedBy(numa));
        assert!(matches!(got, Err(Error::InvalidArgument { .. })), "{numa:?}: {got:?}");
    }
    let got = buf.advise_preferred_location(Location::HostNuma(-1));
    assert!(matches!(got, Err(Error::InvalidArgument { .. })), "{got:?}");
    let got = buf.prefetch(Location::HostNuma(-1), &stream);
    assert!(matches!(got, Err(Error::InvalidArgument { .. })), "{got:?}");
    let got = prefetch_each(&[(buf.range(), Location::HostNuma(-2))], &stream);
    assert!(matches!(got, Err(Error::InvalidArgument { .. })), "{got:?}");
}

/// Views of one allocation count once; distinct allocations add up; grouping by location works.
fn bulk_dedup(device: Device) {
    bulk_dedup_in(&pool(device));
    bulk_dedup_in(&malloc_managed_pool(device));
}

fn bulk_dedup_in(pool: &ManagedPool) {
    let device = pool.device();
    let stream = Stream::new(device).unwrap();
    let a = pool.alloc::<u32>(1024, &stream).unwrap();
    let b = pool.alloc::<u32>(256, &stream).unwrap();
    let here = Location::of(device);
    let n =
        prefetch_all(&[a.range(), a.subrange(10..20).unwrap(), a.range(), b.range()], here, &stream).unwrap();
    assert_eq!(n, 4096 + 1024);
    let n = prefetch_all(
        &[a.subrange(0..10).unwrap(), a.subrange(5..30).unwrap(), a.subrange(100..110).unwrap()],
        here,
        &stream,
    )
    .unwrap();
    assert_eq!(n, 4 * 30 + 4 * 10, "overlapping views merge, disjoint ones add");
    // A pool's small allocations may share a CPU page (CUDA pools pack them at 256-512 byte
    // alignment), and sending one page to two locations is refused: `a` to the host and `b`
    // to the device go through exactly when their pages are apart (always on the host
    // backend, where both locations are the host).
    // SAFETY: sysconf reads a system constant.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap();
    let pages = |p: *const u32, bytes: usize| (p as usize / page, (p as usize + bytes - 1) / page);
    let ((a_first, a_last), (b_first, b_last)) = (pages(a.as_ptr(), a.bytes()), pages(b.as_ptr(), b.bytes()));
    let shared = a_first <= b_last && b_first <= a_last && here != Location::Host;
    let sent = prefetch_each(&[(a.range(), Location::Host), (b.range(), here)], &stream);
    if shared {
        assert!(
            matches!(&sent, Err(Error::InvalidArgument { what }) if what.contains("two locations")),
            "{sent:?}"
        );
    } else {
        assert_eq!(sent.unwrap(), 4096 + 1024);
    }
    let advised = advise_all(&[a.range(), a.range(), b.subrange(0..1).unwrap()], Advice::SetReadMostly);
    advice_taken(pool, advised, 4096 + 4);
    assert_eq!(prefetch_all(&[], here, &stream).unwrap(), 0);
}

/// Host writes -> prefetch to the device -> a kernel reads the exact values; device writes ->
/// prefetch to the host -> the host reads them; advice in between keeps the data.
fn data_through_prefetch(device: Device) {
    data_through_prefetch_in(&pool(device));
    data_through_prefetch_in(&malloc_managed_pool(device));
}

fn data_through_prefetch_in(pool: &ManagedPool) {
    let device = pool.device();
    let stream = Stream::new(device).unwrap();
    let n = 3 << 20;
    let mut buf = pool.alloc::<u32>(n, &stream).unwrap();
    let expected: u64 = {
        let s = buf.as_mut_slice().unwrap();
        for (i, v) in s.iter_mut().enumerate() {
            *v = (i as u32).wrapping_mul(2_246_822_519) ^ 0x5bd1_e995;
        }
        s.iter().map(|&v| u64::from(v)).sum()
    };
    let here = Location::of(device);
    assert_eq!(buf.prefetch(here, &stream).unwrap(), 4 * n);
    assert_eq!(sum_u32(&stream, &buf).unwrap(), expected, "the device read other values");
    fill_pattern_u32(&stream, &mut buf, 99).unwrap();
    buf.prefetch(Location::Host, &stream).unwrap();
    let got = buf.as_slice().unwrap();
    assert!(got.iter().enumerate().all(|(i, &v)| v == pattern_value(99, i)), "the host read other values");
    for advice in [
        Advice::SetPreferredLocation(here),
        Advice::SetAccessedBy(here),
        Advice::SetReadMostly,
        Advice::UnsetReadMostly,
        Advice::UnsetAccessedBy(here),
        Advice::UnsetPreferredLocation,
    ] {
        advice_taken(pool, buf.advise(advice), 4 * n);
    }
    assert_eq!(sum_u32(&stream, &buf).unwrap(), (0..n).map(|i| u64::from(pattern_value(99, i))).sum::<u64>());
    // Copies to and from ordinary device memory.
    let mut dev = DeviceBuffer::<u32>::zeroed(&stream, n).unwrap();
    copy(&stream, &buf, &mut dev).unwrap();
    let back = dev.to_vec(&stream).unwrap();
    assert!(back.iter().enumerate().all(|(i, &v)| v == pattern_value(99, i)));
    assert_eq!(buf.len(), n);
}

/// Many buffers prefetched in one batched call each way keep their data.
fn bulk_round_trip(device: Device) {
    let pool = pool(device);
    let stream = Stream::new(device).unwrap();
    let mut bufs: Vec<_> = (0..64).map(|i| pool.alloc::<u32>(1000 + i * 13, &stream).unwrap()).collect();
    for (k, b) in bufs.iter_mut().enumerate() {
        fill_pattern_u32(&stream, b, k as u32).unwrap();
    }
    let ranges: Vec<_> = bufs.iter().map(|b| b.range()).collect();
    let total: usize = bufs.iter().map(|b| b.bytes()).sum();
    assert_eq!(prefetch_all(&ranges, Location::Host, &stream).unwrap(), total);
    assert_eq!(prefetch_all(&ranges, Location::of(device), &stream).unwrap(), total);
    for (k, b) in bufs.iter().enumerate() {
        let want: u64 = (0..b.len()).map(|i| u64::from(pattern_value(k as u32, i))).sum();
        assert_eq!(sum_u32(&stream, b).unwrap(), want);
    }
}

/// A stats snapshot taken while other threads allocate and free never shows more in use than
/// its high-water mark (the two counters move in separate steps).
fn stats_snapshots_are_consistent(device: Device) {
    let pool = pool(device);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (pool, stop) = (pool.clone(), std::sync::Arc::clone(&stop));
            std::thread::spawn(move || {
                let stream = Stream::new(device).unwrap();
                let mut len = 4096usize;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // SAFETY: the buffer is dropped unread.
                    drop(unsafe { pool.alloc_uninit::<u8>(len, &stream) }.unwrap());
                    len = if len >= 64 << 20 { 4096 } else { len + 4096 };
                }
            })
        })
        .collect();
    let started = std::time::Instant::now();
    let mut torn = None;
    while torn.is_none() && started.elapsed() < std::time::Duration::from_secs(2) {
        let s = pool.stats().unwrap();
        if s.used_current > s.used_high
            || s.reserved_current > s.reserved_high
            || s.used_current > s.reserved_current
        {
            torn = Some(s);
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    assert!(
        torn.is_none(),
        "a snapshot shows more in use than its high-water mark or than reserved: {torn:?}"
    );
}

/// A pool's size limit holds where cuferry keeps it (the host backend, `cudaMallocManaged`)
/// and where the driver does (a managed pool): allocations past it fail as out of memory,
/// freed bytes can be allocated again, and threads allocating at once never pass it together.
fn a_size_limit_is_kept(device: Device) {
    const LIMIT: usize = 64 << 20; // well above any driver's reservation granularity
    for use_malloc_managed in [false, true] {
        let options = ManagedPoolOptions { max_size: LIMIT, use_malloc_managed, ..Default::default() };
        let pool = match ManagedPool::new(device, options) {
            Ok(pool) => pool,
            Err(e) => {
                // A driver without managed pools refuses a limit rather than drop it.
                assert!(matches!(e, Error::Unsupported { .. }), "{e:?}");
                let caps = pool(device).capabilities();
                assert!(
                    !caps.memory_pools_supported,
                    "a limited pool refused on a device with memory pools: {e}"
                );
                continue;
            }
        };
        let stream = Stream::new(device).unwrap();
        let half = pool.alloc::<u8>(LIMIT / 2, &stream).unwrap();
        let over = pool.alloc::<u8>(LIMIT, &stream).map(drop);
        let over = over.expect_err("a pool allocated past its limit");
        assert!(over.is_out_of_memory(), "{:?} pool past its limit: {over:?}", pool.kind());
        drop(half);
        stream.synchronize().unwrap();
        let whole = pool.alloc::<u8>(LIMIT / 2, &stream).unwrap();
        drop(whole);
        stream.synchronize().unwrap();
        if pool.kind() == PoolKind::ManagedPool {
            continue; // the driver's limit counts reserved bytes, which the threads below blur
        }
        let peak = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    let stream = Stream::new(device).unwrap();
                    for _ in 0..20 {
                        if let Ok(buf) = pool.alloc::<u8>(24 << 20, &stream) {
                            let used = pool.stats().unwrap().used_current as usize;
                            peak.fetch_max(used, std::sync::atomic::Ordering::Relaxed);
                            drop(buf);
                        }
                    }
                    stream.synchronize().unwrap();
                });
            }
        });
        let peak = peak.into_inner();
        assert!((24 << 20..=LIMIT).contains(&peak), "{:?} pool: {peak} bytes in use at once", pool.kind());
        assert!(pool.stats().unwrap().used_high as usize <= LIMIT);
    }
}

/// The same bytes, or the same CPU page, sent to two locations in one call are refused: CUDA
/// rounds each prefetch out to whole pages and leaves the order within a batch undefined.
/// Parts of one allocation on different pages may go to two locations.
fn the_same_page_to_two_locations_is_refused(device: Device) {
    let pool = pool(device);
    let stream = Stream::new(device).unwrap();
    let here = Location::of(device);
    let elsewhere = if device.is_host() { Location::HostNumaCurrent } else { Location::Host };
    if !pool.capabilities().concurrent_managed_access && !device.is_host() {
        common::skip_missing(&format!("{device} lacks concurrentManagedAccess"));
        return;
    }
    // SAFETY: sysconf reads a system constant.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap();
    let a = pool.alloc::<u8>(3 * page, &stream).unwrap();
    let both = prefetch_each(&[(a.range(), here), (a.subrange(1000..1024).unwrap(), elsewhere)], &stream);
    assert!(matches!(both, Err(Error::InvalidArgument { .. })), "{both:?}");
    // The first page boundary inside `a`, and a split of one page on either side of it.
    let boundary = (a.as_ptr() as usize).next_multiple_of(page) - a.as_ptr() as usize;
    let near = prefetch_each(
        &[
            (a.subrange(boundary..boundary + 8).unwrap(), here),
            (a.subrange(boundary + 8..boundary + 16).unwrap(), elsewhere),
        ],
        &stream,
    );
    assert!(matches!(near, Err(Error::InvalidArgument { .. })), "disjoint bytes of one page: {near:?}");
    let split = prefetch_each(
        &[
            (a.subrange(0..boundary + page).unwrap(), here),
            (a.subrange(boundary + page..3 * page).unwrap(), elsewhere),
        ],
        &stream,
    );
    assert_eq!(split.unwrap(), 3 * page, "parts on different pages to two locations");
    stream.synchronize().unwrap();
}

/// `device`'s pool and a stream for the discard tests, or None (after `skip_missing`) on a
/// device without `concurrentManagedAccess`, which discards need.
fn discard_pool(device: Device) -> Option<(ManagedPool, Stream)> {
    let pool = pool(device);
    if !device.is_host() && !pool.capabilities().concurrent_managed_access {
        common::skip_missing(&format!("discard needs concurrentManagedAccess, which {device} lacks"));
        return None;
    }
    Some((pool, Stream::new(device).unwrap()))
}

/// Discarding a buffer, or part of one, leaves the bytes around the range intact: the rest of
/// the buffer, and small neighbours from the same pool (likely on the same page: CUDA may round
/// a discard out to whole pages, which would wipe them). The discarded range, written again,
/// holds what was written.
fn discard_keeps_the_bytes_around_the_range(device: Device) {
    let Some((pool, stream)) = discard_pool(device) else { return };
    let n = 300; // 1200 bytes: several such buffers share a 4 KiB page
    let mut bufs: Vec<_> = (0..6).map(|_| pool.alloc::<u32>(n, &stream).unwrap()).collect();
    for (k, b) in bufs.iter_mut().enumerate() {
        fill_pattern_u32(&stream, b, k as u32).unwrap();
    }
    let sum = |k: usize, range: std::ops::Range<usize>| -> u64 {
        range.map(|i| u64::from(pattern_value(k as u32, i))).sum()
    };
    // The whole of buffer 2, and elements 10..20 of buffer 4.
    // SAFETY: both ranges are written again below before they are read (the host backend's
    // check reads bytes it defines); no slice of either buffer is alive.
    let discarded =
        unsafe { discard_all(&[bufs[2].range(), bufs[4].subrange(10..20).unwrap()], &stream) }.unwrap();
    assert_eq!(discarded, 4 * (n + 10));
    for k in [0, 1, 3, 5] {
        assert_eq!(sum_u32(&stream, &bufs[k]).unwrap(), sum(k, 0..n), "buffer {k}, a neighbour, changed");
    }
    let host = bufs[4].as_slice().unwrap();
    for (i, &v) in host.iter().enumerate().filter(|(i, _)| !(10..20).contains(i)) {
        assert_eq!(v, pattern_value(4, i), "element {i} of buffer 4, outside the discarded part, changed");
    }
    if device.is_host() {
        // The host backend overwrites discarded bytes, so a read before a write shows.
        let poisoned = u32::from_ne_bytes([DISCARDED_BYTE; 4]);
        assert!(host[10..20].iter().all(|&v| v == poisoned), "{:?}", &host[10..20]);
        assert!(bufs[2].as_slice().unwrap().iter().all(|&v| v == poisoned));
    }
    fill_pattern_u32(&stream, &mut bufs[2], 77).unwrap();
    assert_eq!(sum_u32(&stream, &bufs[2]).unwrap(), sum(77, 0..n), "the discarded buffer, written again");
}

/// `discard_and_prefetch_all` over parts of two buffers: the bytes around the ranges stay, the
/// ranges written again (by a kernel job or a kernel, after the discard in stream order) hold
/// what was written, and on the host backend the discarded bytes read as `DISCARDED_BYTE`
/// until then.
fn discard_and_prefetch_then_write(device: Device) {
    let Some((pool, stream)) = discard_pool(device) else { return };
    let n = 1000;
    let mut a = pool.alloc::<u32>(n, &stream).unwrap();
    let mut b = pool.alloc::<u32>(n, &stream).unwrap();
    fill_pattern_u32(&stream, &mut a, 1).unwrap();
    fill_pattern_u32(&stream, &mut b, 2).unwrap();
    // SAFETY: every discarded byte is written again below before it is read (the host
    // backend's check reads bytes it defines); no slice of either buffer is alive.
    let bytes = unsafe {
        discard_and_prefetch_all(
            &[a.range(), b.subrange(100..300).unwrap(), b.subrange(250..400).unwrap()],
            Location::of(device),
            &stream,
        )
    }
    .unwrap();
    assert_eq!(bytes, 4 * (n + 300), "b's two overlapping views count once");
    let host_b = b.as_slice().unwrap();
    for (i, &v) in host_b.iter().enumerate().filter(|(i, _)| !(100..400).contains(i)) {
        assert_eq!(v, pattern_value(2, i), "element {i} of b, outside the discarded part, changed");
    }
    if device.is_host() {
        let poisoned = u32::from_ne_bytes([DISCARDED_BYTE; 4]);
        assert!(host_b[100..400].iter().all(|&v| v == poisoned));
        assert!(a.as_slice().unwrap().iter().all(|&v| v == poisoned));
    }
    fill_pattern_u32(&stream, &mut a, 9).unwrap();
    let expected: u64 = (0..n).map(|i| u64::from(pattern_value(9, i))).sum();
    assert_eq!(sum_u32(&stream, &a).unwrap(), expected, "a, written after its discard");
    let host_b = b.as_mut_slice().unwrap();
    host_b[100..400].iter_mut().enumerate().for_each(|(k, v)| *v = k as u32);
    let host_b = b.as_slice().unwrap();
    assert!(host_b[100..400].iter().enumerate().all(|(k, &v)| v == k as u32));
    assert_eq!(host_b[99], pattern_value(2, 99));
    assert_eq!(host_b[400], pattern_value(2, 400));
}

/// Discards spanning many whole pages, with partial pages at both ends (on CUDA only the
/// whole pages are discarded: the small buffers above may not reach one): the bytes outside
/// the ranges stay, and the ranges written again hold what was written.
fn discard_whole_pages_of_large_buffers(device: Device) {
    let Some((pool, stream)) = discard_pool(device) else { return };
    let n = 1 << 16; // 256 KiB each
    let part = 1000..41_000; // 160,000 bytes: dozens of whole 4 KiB pages, partial ones at the ends
    let mut a = pool.alloc::<u32>(n, &stream).unwrap();
    let mut b = pool.alloc::<u32>(n, &stream).unwrap();
    fill_pattern_u32(&stream, &mut a, 3).unwrap();
    fill_pattern_u32(&stream, &mut b, 4).unwrap();
    // SAFETY: both parts are written again below before they are read; no slice is alive.
    let discarded = unsafe { discard_all(&[a.subrange(part.clone()).unwrap()], &stream) }.unwrap();
    assert_eq!(discarded, 4 * part.len());
    // SAFETY: as above.
    let moved = unsafe {
        discard_and_prefetch_all(&[b.subrange(part.clone()).unwrap()], Location::of(device), &stream)
    }
    .unwrap();
    assert_eq!(moved, 4 * part.len());
    for (k, buf) in [(3, &mut a), (4, &mut b)] {
        let host = buf.as_slice().unwrap();
        for (i, &v) in host.iter().enumerate().filter(|(i, _)| !part.contains(i)) {
            assert_eq!(v, pattern_value(k, i), "element {i} outside the discarded part changed");
        }
        if device.is_host() {
            let poisoned = u32::from_ne_bytes([DISCARDED_BYTE; 4]);
            assert!(host[part.clone()].iter().all(|&v| v == poisoned));
        }
        buf.as_mut_slice().unwrap()[part.clone()].iter_mut().for_each(|v| *v = 7 * k);
        let expected: u64 = (0..n)
            .map(|i| if part.contains(&i) { u64::from(7 * k) } else { u64::from(pattern_value(k, i)) })
            .sum();
        assert_eq!(sum_u32(&stream, buf).unwrap(), expected, "written again after the discard");
    }
}

on_both_backends! {
    discard_keeps_the_bytes_around_the_range => discard_keeps_the_bytes_around_the_range;
    discard_and_prefetch_then_write => discard_and_prefetch_then_write;
    discard_whole_pages_of_large_buffers => discard_whole_pages_of_large_buffers;
    stats_and_reuse => stats_and_reuse;
    concurrent_threads => concurrent_threads;
    bad_arguments => bad_arguments;
    bulk_dedup => bulk_dedup;
    data_through_prefetch => data_through_prefetch;
    bulk_round_trip => bulk_round_trip;
    stats_snapshots_are_consistent => stats_snapshots_are_consistent;
    a_size_limit_is_kept => a_size_limit_is_kept;
    the_same_page_to_two_locations_is_refused => the_same_page_to_two_locations_is_refused;
}

#[test]
fn host_pool_kind_and_memory_kind() {
    let pool = pool(Device::Host);
    assert_eq!(pool.kind(), PoolKind::Host);
    let stream = Stream::new(Device::Host).unwrap();
    let buf = pool.alloc::<u8>(8, &stream).unwrap();
    assert!(buf.kind().host_accessible());
}

/// A size limit is kept or refused, never dropped: a pool with `max_size` is a managed pool
/// (whose driver keeps to the limit) or an error, not the `cudaMallocManaged` fallback.
#[test]
fn cuda_pool_with_a_size_limit_is_never_unbounded() {
    let Some(device) = common::cuda_device() else { return };
    let options = ManagedPoolOptions { max_size: 1, ..ManagedPoolOptions::default() };
    match ManagedPool::new(device, options) {
        Ok(pool) => assert_eq!(pool.kind(), PoolKind::ManagedPool, "a limited pool fell back"),
        Err(e) => println!("a 1-byte managed pool was refused: {e}"),
    }
}

#[test]
fn cuda_pool_uses_managed_pools_when_supported() {
    let Some(device) = common::cuda_device() else { return };
    let pool = pool(device);
    let caps = pool.capabilities();
    let expected = if caps.memory_pools_supported { PoolKind::ManagedPool } else { PoolKind::MallocManaged };
    // A driver may still refuse managed pools; then the fallback is the only right answer, but
    // not on the GPU machine, whose driver takes them (a fallback there is a lost path).
    assert!(pool.kind() == expected || pool.kind() == PoolKind::MallocManaged, "{:?} {caps:?}", pool.kind());
    if common::gpu_required() {
        assert_eq!(pool.kind(), expected, "{caps:?}");
    }
    println!("managed pool kind on {device}: {:?}, {caps:?}", pool.kind());
}

#[test]
fn absent_cuda_pool_is_a_typed_error() {
    if Device::cuda_count() > 0 {
        println!("SKIP: a CUDA device is present");
        return;
    }
    match ManagedPool::new(Device::Cuda(0), ManagedPoolOptions::default()) {
        Err(Error::NoDriver { .. } | Error::NoDevice { .. } | Error::Unsupported { .. }) => {}
        other => panic!("expected an absence error, got {other:?}"),
    }
}

/// Dropped CUDA managed pools are recycled, never destroyed (the H100's driver crashed
/// destroying one while other threads used the device): pools made and dropped on several
/// threads at once, each allocating and checking data, stay sound, and a pool taken over from
/// an earlier owner starts with nothing in use and fresh high-water marks.
#[test]
fn cuda_pools_recycle_under_load() {
    let Some(device) = common::cuda_device() else { return };
    let handles: Vec<_> = (0..4u32)
        .map(|t| {
            std::thread::spawn(move || {
                let stream = Stream::new(device).unwrap();
                for round in 0..10u32 {
                    let pool = pool(device);
                    let fresh = pool.stats().unwrap();
                    assert_eq!((fresh.used_current, fresh.used_high), (0, 0), "round {round}: {fresh:?}");
                    let seed = t * 100 + round;
                    let mut buf = pool.alloc::<u32>((1 << 16) + round as usize, &stream).unwrap();
                    fill_pattern_u32(&stream, &mut buf, seed).unwrap();
                    let got = buf.as_slice().unwrap();
                    assert!(got.iter().enumerate().all(|(i, &v)| v == pattern_value(seed, i)));
                    assert!(pool.stats().unwrap().used_high >= 4 << 16);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

/// Host-pool and CUDA-pool ranges never mix in one batch, also when each location's group is
/// of one backend only.
#[test]
fn cuda_and_host_pool_ranges_do_not_mix_across_locations() {
    let Some(device) = common::cuda_device() else { return };
    let Device::Cuda(ordinal) = device else { unreachable!() };
    let stream = Stream::new(device).unwrap();
    let (host_pool, cuda_pool) = (pool(Device::Host), pool(device));
    let host_stream = Stream::new(Device::Host).unwrap();
    let h = host_pool.alloc::<u8>(4096, &host_stream).unwrap();
    let c = cuda_pool.alloc::<u8>(4096, &stream).unwrap();
    let mixed =
        prefetch_each(&[(h.range(), Location::Host), (c.range(), Location::Device(ordinal))], &stream);
    assert!(matches!(mixed, Err(Error::InvalidArgument { .. })), "{mixed:?}");
}

/// A managed-pool buffer last used on a host stream (managed memory is host-accessible) is
/// freed when dropped: the pool's use goes back to zero and no drop error is left.
#[test]
fn cuda_pool_buffer_last_used_on_a_host_stream_is_freed() {
    let Some(device) = common::cuda_device() else { return };
    let stream = Stream::new(device).unwrap();
    let host_stream = Stream::new(Device::Host).unwrap();
    let pool = pool(device);
    let buf = pool.alloc::<u8>(1 << 20, &stream).unwrap();
    let mut out = cuferry::PinnedBuffer::<u8>::zeroed(Device::Host, 1 << 20).unwrap();
    cuferry::copy(&host_stream, &buf, &mut out).unwrap();
    drop(buf);
    stream.synchronize().unwrap();
    assert_eq!(pool.stats().unwrap().used_current, 0);
    assert!(cuferry::take_drop_error().is_none(), "the drop failed");
}

/// The tests' expected values come from `pattern_value`, which the host backend's fill also
/// uses: pin it to the formula written out here, so a change to it (one ignoring the index,
/// say) cannot hide shifted or aliased copies by changing both sides.
#[test]
fn the_pattern_is_the_written_formula() {
    for (seed, i) in [(0u32, 0usize), (1, 0), (1, 1), (7, 999), (u32::MAX, 123_456), (77, 299)] {
        let written = seed.wrapping_mul(2_654_435_761).wrapping_add(i as u32);
        assert_eq!(pattern_value(seed, i), written, "seed {seed}, element {i}");
    }
    assert_ne!(pattern_value(3, 1), pattern_value(3, 2), "elements differ");
    assert_ne!(pattern_value(3, 1), pattern_value(4, 1), "seeds differ");
}

/// A host-pool buffer allocated, read and dropped inside a job of its allocation stream: no
/// work was ever queued on it, so the read succeeds and the drop frees it. It used to wait for
/// the stream's "allocation point" (the job itself): the read failed, and the drop leaked the
/// memory and recorded a `DropFailed` (a review's reproduction).
#[test]
fn a_host_pool_buffer_is_usable_in_a_job_of_its_stream() {
    let stream = Stream::new(Device::Host).unwrap();
    let pool = pool(Device::Host);
    let (report, outcome) = std::sync::mpsc::channel();
    let (own, in_job) = (stream.clone(), pool.clone());
    stream
        .host_fn(move || {
            let result = (|| -> cuferry::Result<(usize, Option<String>)> {
                let b = in_job.alloc::<u32>(16, &own)?;
                let read = b.as_slice()?.iter().filter(|&&x| x == 0).count();
                drop(b);
                let leaked = cuferry::take_drop_error()
                    .filter(|e| matches!(e, Error::InvalidArgument { what } if what.contains("wait forever")))
                    .map(|e| e.to_string());
                Ok((read, leaked))
            })();
            let _ = report.send(result);
        })
        .unwrap();
    let (read, leaked) = outcome.recv_timeout(std::time::Duration::from_secs(10)).unwrap().unwrap();
    stream.synchronize().unwrap();
    assert_eq!(read, 16, "the zeroed buffer read back");
    assert!(leaked.is_none(), "the drop leaked the buffer: {leaked:?}");
    assert_eq!(pool.stats().unwrap().used_current, 0, "the pool still counts the dropped buffer");
}
