//! Batched copies (`CopyBatch`, `copy_ranges`): random batches over several sources and
//! destinations of every memory kind against a scalar loop, refused batches that leave their
//! buffers untouched, ordering with work on other streams (buffers dropped while the batch
//! waits behind held work), and pages of a managed cache gathered and scattered.
//! Each check runs on the host backend and, when a GPU is present, on CUDA (where the batch
//! is one `cudaMemcpyBatchAsync`).

mod common;

use common::{Gate, Rng};
use cuferry::copy::copy_ranges_one_by_one;
use cuferry::managed::{ManagedPool, ManagedPoolOptions};
use cuferry::{
    copy_range, copy_ranges, CopyBatch, CopyDirection, CopyRange, Device, DeviceBuffer, Error,
    HostRegistration, PinnedBuffer, Stream,
};
use proptest::prelude::*;

/// Random ranges into a destination of `n_dst` elements from a source of `n_src`: the
/// destination is cut into random segments, some of which become copies (so no two write the
/// same element), listed in a random order; a few are empty.
fn random_ranges(rng: &mut Rng, n_src: usize, n_dst: usize, max_copies: usize) -> Vec<CopyRange> {
    let mut cuts: Vec<usize> = (0..rng.below(max_copies + 1)).map(|_| rng.below(n_dst + 1)).collect();
    cuts.extend([0, n_dst]);
    cuts.sort_unstable();
    let mut ranges = Vec::new();
    for w in cuts.windows(2) {
        if rng.below(4) == 0 {
            continue;
        }
        let len = rng.below(w[1] - w[0] + 1).min(n_src);
        ranges.push(CopyRange::new(rng.below(n_src - len + 1), w[0], len));
    }
    for k in (1..ranges.len()).rev() {
        ranges.swap(k, rng.below(k + 1));
    }
    ranges
}

/// What a scalar loop makes of `dst` after copying `ranges` from `src`.
fn reference(src: &[u32], dst: &[u32], ranges: &[CopyRange]) -> Vec<u32> {
    let mut out = dst.to_vec();
    for r in ranges {
        for i in 0..r.len {
            out[r.dst_offset + i] = src[r.src_offset + i];
        }
    }
    out
}

fn random_words(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.next_u64() as u32).collect()
}

/// Random words, mostly a few thousand, a third of the time up to 300,000 (past the host
/// backend's 256 KiB inline limit).
fn random_buffer(rng: &mut Rng) -> Vec<u32> {
    let most = if rng.below(3) == 0 { 300_000 } else { 3000 };
    let n = 1 + rng.below(most);
    random_words(rng, n)
}

/// One batch of five pairs over two sources (one shared by three pairs) and five destinations
/// of every memory kind the device has, against the scalar reference.
fn batch_matches_scalar_reference(device: Device, seed: u64) {
    let stream = Stream::new(device).unwrap();
    let mut rng = Rng::new(seed);
    let a_data = random_buffer(&mut rng);
    let b_data = random_buffer(&mut rng);
    let a = DeviceBuffer::from_slice(&stream, &a_data).unwrap();
    let b = PinnedBuffer::from_slice(device, &b_data).unwrap();
    let inits: Vec<Vec<u32>> = (0..5).map(|_| random_buffer(&mut rng)).collect();
    let mut d0 = DeviceBuffer::from_slice(&stream, &inits[0]).unwrap();
    let mut d1 = PinnedBuffer::from_slice(device, &inits[1]).unwrap();
    let mut d2 = HostRegistration::new(device, inits[2].clone()).unwrap();
    let mut d3 = DeviceBuffer::from_slice(&stream, &inits[3]).unwrap();
    let mut d4 = PinnedBuffer::from_slice(device, &inits[4]).unwrap();
    let sources = [&a_data, &a_data, &b_data, &a_data, &b_data];
    let ranges: Vec<Vec<CopyRange>> =
        (0..5).map(|k| random_ranges(&mut rng, sources[k].len(), inits[k].len(), 40)).collect();
    let mut batch = CopyBatch::new(&stream);
    batch.add(&a, &mut d0, &ranges[0]).unwrap();
    batch.add(&a, &mut d1, &ranges[1]).unwrap();
    batch.add(&b, &mut d2, &ranges[2]).unwrap();
    batch.add(&a, &mut d3, &ranges[3]).unwrap();
    batch.add(&b, &mut d4, &ranges[4]).unwrap();
    let copies = ranges.iter().flatten().filter(|r| r.len > 0).count();
    assert_eq!(batch.len(), copies);
    assert_eq!(batch.bytes(), ranges.iter().flatten().map(|r| r.len * 4).sum::<usize>());
    batch.submit().unwrap();
    let got = [d0.to_vec(&stream).unwrap(), d1.as_slice().unwrap().to_vec(), d2.into_inner().unwrap()];
    for (k, got) in got.iter().enumerate() {
        assert_eq!(got, &reference(sources[k], &inits[k], &ranges[k]), "pair {k}, seed {seed}");
    }
    assert_eq!(d3.to_vec(&stream).unwrap(), reference(sources[3], &inits[3], &ranges[3]), "seed {seed}");
    assert_eq!(d4.as_slice().unwrap(), &reference(sources[4], &inits[4], &ranges[4])[..], "seed {seed}");
    assert_eq!(a.to_vec(&stream).unwrap(), a_data, "a source changed");
}

fn random_batches(device: Device) {
    for seed in 0..12 {
        batch_matches_scalar_reference(device, seed);
    }
}

/// `copy_ranges` names the direction, copies bytes as `u8` ranges, and takes no range, empty
/// ranges, and ranges touching both ends.
fn single_pair_and_edges(device: Device) {
    let stream = Stream::new(device).unwrap();
    let data: Vec<u8> = (0..=255).collect();
    let src = PinnedBuffer::from_slice(device, &data).unwrap();
    let mut dst = DeviceBuffer::<u8>::zeroed(&stream, 256).unwrap();
    let expected = if device.is_host() { CopyDirection::HostToHost } else { CopyDirection::HostToDevice };
    assert_eq!(copy_ranges(&stream, &src, &mut dst, &[]).unwrap(), expected);
    let ranges = [
        CopyRange::new(250, 0, 6),
        CopyRange::new(0, 250, 6),
        CopyRange::new(7, 100, 0),
        CopyRange::new(256, 256, 0),
    ];
    assert_eq!(copy_ranges(&stream, &src, &mut dst, &ranges).unwrap(), expected);
    let got = dst.to_vec(&stream).unwrap();
    assert_eq!(&got[..6], &data[250..]);
    assert_eq!(&got[250..], &data[..6]);
    assert!(got[6..250].iter().all(|&v| v == 0), "bytes outside the ranges were written");
}

/// Bad batches are typed errors: a range out of bounds leaves the batch as it was, and a
/// batch whose copies depend on each other queues nothing.
fn refused_batches(device: Device) {
    let stream = Stream::new(device).unwrap();
    let src = DeviceBuffer::from_slice(&stream, &[1u32, 2, 3, 4, 5, 6, 7, 8]).unwrap();
    let mut dst = DeviceBuffer::<u32>::zeroed(&stream, 8).unwrap();
    let mut other = DeviceBuffer::<u32>::zeroed(&stream, 8).unwrap();
    for bad in [
        [CopyRange::new(0, 0, 2), CopyRange::new(7, 0, 2)],
        [CopyRange::new(0, 7, 2), CopyRange::new(0, 0, 1)],
        [CopyRange::new(usize::MAX, 0, 1), CopyRange::new(0, 0, 1)],
    ] {
        let mut batch = CopyBatch::new(&stream);
        assert!(matches!(batch.add(&src, &mut other, &bad), Err(Error::InvalidArgument { .. })), "{bad:?}");
        assert!(batch.is_empty(), "a refused pair left copies behind");
        batch.submit().unwrap();
    }
    assert_eq!(other.to_vec(&stream).unwrap(), vec![0; 8], "a refused pair wrote something");
    let mut batch = CopyBatch::new(&stream);
    batch.add(&src, &mut dst, &[CopyRange::new(0, 0, 4), CopyRange::new(4, 3, 2)]).unwrap();
    let err = batch.submit().expect_err("two copies writing element 3 were queued");
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert_eq!(dst.to_vec(&stream).unwrap(), vec![0; 8], "a refused batch wrote something");
    // The same ranges into two destinations are independent.
    let mut batch = CopyBatch::new(&stream);
    batch.add(&src, &mut dst, &[CopyRange::new(0, 0, 4)]).unwrap();
    batch.add(&src, &mut other, &[CopyRange::new(0, 0, 4)]).unwrap();
    batch.submit().unwrap();
    assert_eq!(dst.to_vec(&stream).unwrap(), vec![1, 2, 3, 4, 0, 0, 0, 0]);
    assert_eq!(other.to_vec(&stream).unwrap(), vec![1, 2, 3, 4, 0, 0, 0, 0]);
}

/// A batch is ordered after the write to its source on another stream, and a later write to
/// its destination on a third stream waits for it; the buffers are dropped while the batch is
/// still held behind a gate, and its copies arrive intact.
fn ordered_with_other_streams_and_drops(device: Device) {
    let (writer, batcher, later) =
        (Stream::new(device).unwrap(), Stream::new(device).unwrap(), Stream::new(device).unwrap());
    let n = 1 << 20;
    let old: Vec<u32> = vec![7; n];
    let new: Vec<u32> = (0..n as u32).collect();
    let mut src = DeviceBuffer::from_slice(&writer, &old).unwrap();
    let staged = DeviceBuffer::from_slice(&writer, &new).unwrap();
    let mut dst = DeviceBuffer::<u32>::zeroed(&writer, n).unwrap();
    let mut out = PinnedBuffer::<u32>::zeroed(device, n).unwrap();
    let fill = DeviceBuffer::from_slice(&later, &[9u32; 4]).unwrap();
    let gate = Gate::hold(&writer);
    copy_range(&writer, &staged, 0, &mut src, 0, n).unwrap(); // held behind the gate
    let half = n / 2;
    let ranges = [CopyRange::new(0, half, half), CopyRange::new(half, 0, half)];
    copy_ranges(&batcher, &src, &mut dst, &ranges).unwrap();
    copy_ranges(&later, &dst, &mut out, &[CopyRange::new(0, 0, n)]).unwrap();
    copy_range(&later, &fill, 0, &mut dst, 0, 4).unwrap();
    assert!(!gate.passed(), "the gate opened early");
    let opener = gate.open_after(std::time::Duration::from_millis(50));
    drop(src);
    drop(staged);
    opener.join().unwrap();
    let mut expected: Vec<u32> = new[half..].iter().chain(&new[..half]).copied().collect();
    assert_eq!(out.as_slice().unwrap(), &expected[..], "the batch read the source before its write");
    expected[..4].fill(9);
    assert_eq!(dst.to_vec(&later).unwrap(), expected, "the later write ran before the batch");
}

/// Every pair's buffers are ordered, not only the first pair's: with a three-pair batch held
/// behind a gate, the host's read of the last pair's destination waits for the batch, and the
/// sources dropped meanwhile stay alive for it.
fn every_pair_is_ordered(device: Device) {
    let stream = Stream::new(device).unwrap();
    let a = DeviceBuffer::from_slice(&stream, &[1u32; 64]).unwrap();
    let b = PinnedBuffer::from_slice(device, &[2u32; 64]).unwrap();
    let mut d0 = DeviceBuffer::<u32>::zeroed(&stream, 64).unwrap();
    let mut d1 = DeviceBuffer::<u32>::zeroed(&stream, 64).unwrap();
    let mut d2 = PinnedBuffer::<u32>::zeroed(device, 64).unwrap();
    let gate = Gate::hold(&stream);
    let mut batch = CopyBatch::new(&stream);
    batch.add(&a, &mut d0, &[CopyRange::new(0, 0, 64)]).unwrap();
    batch.add(&a, &mut d1, &[CopyRange::new(0, 0, 64)]).unwrap();
    batch.add(&b, &mut d2, &[CopyRange::new(0, 32, 32), CopyRange::new(32, 0, 32)]).unwrap();
    batch.submit().unwrap();
    let opener = gate.open_after(std::time::Duration::from_millis(50));
    drop(b);
    let got = d2.as_slice().unwrap().to_vec();
    opener.join().unwrap();
    assert_eq!(got, vec![2u32; 64], "the last pair's destination was read before the batch ran");
    assert_eq!(d1.to_vec(&stream).unwrap(), vec![1u32; 64]);
}

/// A paged cache in managed memory: pages gathered through a page table into device memory
/// in one batch, overwritten there, and scattered from there to other pages in a second,
/// against a scalar model of the cache; on CUDA both batches go the managed way.
fn managed_cache_pages(device: Device) {
    const PAGE: usize = 1024;
    const PAGES: usize = 64;
    let stream = Stream::new(device).unwrap();
    let pool = ManagedPool::new(device, ManagedPoolOptions::default()).unwrap();
    let mut cache = pool.alloc::<u32>(PAGES * PAGE, &stream).unwrap();
    let mut model: Vec<u32> = (0..(PAGES * PAGE) as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    cache.as_mut_slice().unwrap().copy_from_slice(&model);
    let mut rng = Rng::new(41);
    let mut order: Vec<usize> = (0..PAGES).collect();
    for k in (1..PAGES).rev() {
        order.swap(k, rng.below(k + 1));
    }
    let (taken, returned) = (&order[..16], &order[16..32]);
    let mut working = DeviceBuffer::<u32>::zeroed(&stream, 16 * PAGE).unwrap();
    let gather: Vec<CopyRange> = taken
        .iter()
        .enumerate()
        .map(|(slot, &page)| CopyRange::new(page * PAGE, slot * PAGE, PAGE))
        .collect();
    let managed = if device.is_host() { CopyDirection::HostToHost } else { CopyDirection::Managed };
    assert_eq!(copy_ranges(&stream, &cache, &mut working, &gather).unwrap(), managed);
    let mut pages = working.to_vec(&stream).unwrap();
    for (slot, &page) in taken.iter().enumerate() {
        assert_eq!(
            &pages[slot * PAGE..(slot + 1) * PAGE],
            &model[page * PAGE..(page + 1) * PAGE],
            "page {page}"
        );
    }
    pages.iter_mut().for_each(|v| *v = !*v);
    working.copy_from_slice_at(&stream, 0, &pages).unwrap();
    let scatter: Vec<CopyRange> = returned
        .iter()
        .enumerate()
        .map(|(slot, &page)| CopyRange::new(slot * PAGE, page * PAGE, PAGE))
        .collect();
    assert_eq!(copy_ranges(&stream, &working, &mut cache, &scatter).unwrap(), managed);
    for r in &scatter {
        model[r.dst_offset..r.dst_offset + PAGE].copy_from_slice(&pages[r.src_offset..r.src_offset + PAGE]);
    }
    assert!(cache.as_slice().unwrap() == &model[..], "the managed cache differs from its model");
}

on_both_backends! {
    managed_cache_pages => managed_cache_pages;
    random_batches => random_batches;
    single_pair_and_edges => single_pair_and_edges;
    refused_batches => refused_batches;
    ordered_with_other_streams_and_drops => ordered_with_other_streams_and_drops;
    every_pair_is_ordered => every_pair_is_ordered;
}

/// A source shared by several pairs is only read by the batch: the batch runs while another
/// stream's read of it is held, and a later read of it on that stream does not wait for the
/// batch (a buffer listed twice would be taken as written, ordered against every read).
#[test]
fn a_shared_source_is_only_read() {
    // Polls for 5 s, well inside the 10 s after which a gate opens by itself.
    let finishes = |stream: &Stream| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !stream.query().unwrap() {
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        true
    };
    let (other, batcher) = (Stream::new(Device::Host).unwrap(), Stream::new(Device::Host).unwrap());
    let pool = DeviceBuffer::from_slice(&other, &(0..1024u32).collect::<Vec<_>>()).unwrap();
    let mut x = DeviceBuffer::<u32>::zeroed(&other, 1024).unwrap();
    let mut d0 = DeviceBuffer::<u32>::zeroed(&batcher, 512).unwrap();
    let mut d1 = DeviceBuffer::<u32>::zeroed(&batcher, 512).unwrap();
    let two_pairs = |d0: &mut DeviceBuffer<u32>, d1: &mut DeviceBuffer<u32>| {
        let mut batch = CopyBatch::new(&batcher);
        batch.add(&pool, d0, &[CopyRange::new(0, 0, 512)]).unwrap();
        batch.add(&pool, d1, &[CopyRange::new(512, 0, 512)]).unwrap();
        batch.submit().unwrap();
    };
    let gate = Gate::hold(&other);
    copy_range(&other, &pool, 0, &mut x, 0, 1024).unwrap(); // a read of the pool, held
    two_pairs(&mut d0, &mut d1);
    assert!(
        common::wait_until(|| batcher.query().unwrap()),
        "the batch waited for another read of its source"
    );
    gate.open();
    other.synchronize().unwrap();
    let gate = Gate::hold(&batcher);
    two_pairs(&mut d0, &mut d1);
    copy_range(&other, &pool, 0, &mut x, 0, 1024).unwrap();
    assert!(finishes(&other), "a later read waited for the batch");
    gate.open();
    batcher.synchronize().unwrap();
    assert_eq!(d1.to_vec(&batcher).unwrap(), (512..1024).collect::<Vec<u32>>());
}

/// A host stream cannot batch copies of CUDA memory: refused at `add`.
#[test]
fn cuda_memory_needs_a_cuda_stream() {
    let Some(gpu) = common::cuda_device() else { return };
    let cuda_stream = Stream::new(gpu).unwrap();
    let host_stream = Stream::new(Device::Host).unwrap();
    let dev = DeviceBuffer::from_slice(&cuda_stream, &[5u8; 16]).unwrap();
    let mut host = PinnedBuffer::<u8>::zeroed(gpu, 16).unwrap();
    let mut batch = CopyBatch::new(&host_stream);
    assert!(matches!(
        batch.add(&dev, &mut host, &[CopyRange::new(0, 0, 16)]),
        Err(Error::InvalidArgument { .. })
    ));
}

/// A batch with a peer pair and a same-device pair (skipped on one-GPU machines).
#[test]
fn cuda_peer_pairs_in_a_batch() {
    let Some((d0, d1)) = common::two_cuda_devices() else { return };
    let s0 = Stream::new(d0).unwrap();
    let s1 = Stream::new(d1).unwrap();
    let data: Vec<u32> = (0..4096).collect();
    let a = DeviceBuffer::from_slice(&s0, &data).unwrap();
    let mut on_1 = DeviceBuffer::<u32>::zeroed(&s1, 4096).unwrap();
    let mut on_0 = DeviceBuffer::<u32>::zeroed(&s0, 4096).unwrap();
    let ranges = [CopyRange::new(0, 2048, 2048), CopyRange::new(2048, 0, 2048)];
    let mut batch = CopyBatch::new(&s0);
    batch.add(&a, &mut on_1, &ranges).unwrap();
    batch.add(&a, &mut on_0, &ranges).unwrap();
    batch.submit().unwrap();
    let expected: Vec<u32> = data[2048..].iter().chain(&data[..2048]).copied().collect();
    assert_eq!(on_1.to_vec(&s1).unwrap(), expected);
    assert_eq!(on_0.to_vec(&s0).unwrap(), expected);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random batches of byte ranges on the host backend, against the scalar loop.
    #[test]
    fn host_random_byte_batches(seed in any::<u64>(), n_src in 1usize..5000, n_dst in 1usize..5000) {
        let stream = Stream::new(Device::Host).unwrap();
        let mut rng = Rng::new(seed);
        let src_data = random_words(&mut rng, n_src);
        let dst_data = random_words(&mut rng, n_dst);
        let src = DeviceBuffer::from_slice(&stream, &src_data).unwrap();
        let mut dst = DeviceBuffer::from_slice(&stream, &dst_data).unwrap();
        let mut dst_loop = DeviceBuffer::from_slice(&stream, &dst_data).unwrap();
        let ranges = random_ranges(&mut rng, n_src, n_dst, 64);
        copy_ranges(&stream, &src, &mut dst, &ranges).unwrap();
        copy_ranges_one_by_one(&stream, &src, &mut dst_loop, &ranges).unwrap();
        let expected = reference(&src_data, &dst_data, &ranges);
        prop_assert_eq!(dst.to_vec(&stream).unwrap(), expected.clone());
        prop_assert_eq!(dst_loop.to_vec(&stream).unwrap(), expected);
    }
}
