//! The ordering guarantee against a sequential model: random copies between a set of buffers,
//! each queued on a randomly chosen stream (several streams, no explicit events), must leave
//! every buffer exactly as the same copies applied one after another in program order would.
//! This is the use-tracking rule under real concurrency: a copy reads its source shared (after
//! the source's last write only) and writes its destination (after every earlier use of it),
//! so copies out of one buffer on several streams may run at once, yet any write to that
//! buffer waits for all of them. Bursts of such fan-out copies, each stream held up for a
//! while first, followed by a write into the shared source, probe that rule directly. Runs on
//! the host backend and, when a GPU is present, on CUDA (device buffers and pinned buffers
//! mixed).

mod common;

use common::Rng;
use cuferry::{copy_range, Device, DeviceBuffer, PinnedBuffer, Stream};
use proptest::prelude::*;

/// A buffer of either kind, so copies cross memory kinds.
enum Buf {
    Device(DeviceBuffer<u8>),
    Pinned(PinnedBuffer<u8>),
}

fn copy_between(stream: &Stream, bufs: &mut [Buf], src: usize, dst: usize, so: usize, d_o: usize, n: usize) {
    assert_ne!(src, dst);
    // Split the slice so the source is borrowed shared and the destination mutably.
    let (a, b) = if src < dst { bufs.split_at_mut(dst) } else { bufs.split_at_mut(src) };
    let (s, d) = if src < dst { (&a[src], &mut b[0]) } else { (&b[0], &mut a[dst]) };
    match (s, d) {
        (Buf::Device(s), Buf::Device(d)) => copy_range(stream, s, so, d, d_o, n),
        (Buf::Device(s), Buf::Pinned(d)) => copy_range(stream, s, so, d, d_o, n),
        (Buf::Pinned(s), Buf::Device(d)) => copy_range(stream, s, so, d, d_o, n),
        (Buf::Pinned(s), Buf::Pinned(d)) => copy_range(stream, s, so, d, d_o, n),
    }
    .unwrap();
}

/// Holds `stream` up for a while, so the other streams run ahead unless ordered.
fn slow_down(stream: &Stream) {
    stream.host_fn(|| std::thread::sleep(std::time::Duration::from_micros(500))).unwrap();
}

fn read(stream: &Stream, b: &Buf) -> Vec<u8> {
    match b {
        Buf::Device(d) => d.to_vec(stream).unwrap(),
        Buf::Pinned(p) => p.as_slice().unwrap().to_vec(),
    }
}

/// Runs `steps` random copies among `n_bufs` buffers of `len` bytes over `n_streams` streams
/// and compares with the sequential model.
fn run_model(device: Device, seed: u64, n_bufs: usize, n_streams: usize, steps: usize, len: usize) {
    let mut rng = Rng::new(seed);
    let streams: Vec<Stream> = (0..n_streams).map(|_| Stream::new(device).unwrap()).collect();
    let mut model: Vec<Vec<u8>> = (0..n_bufs).map(|_| rng.bytes(len)).collect();
    let mut bufs: Vec<Buf> = model
        .iter()
        .enumerate()
        .map(|(i, data)| {
            if i % 2 == 0 {
                Buf::Device(DeviceBuffer::from_slice(&streams[0], data).unwrap())
            } else {
                Buf::Pinned(PinnedBuffer::from_slice(device, data).unwrap())
            }
        })
        .collect();
    for step in 0..steps {
        if step % 5 == 2 {
            // A fan-out burst: one source copied out on several streams (shared reads, each
            // stream held up first), then a write into that source, which must wait for all.
            let src = rng.below(n_bufs);
            for k in 1..n_bufs.min(4) {
                let dst = (src + k) % n_bufs;
                let n = 1 + rng.below(len);
                let (so, d_o) = (rng.below(len - n + 1), rng.below(len - n + 1));
                let stream = &streams[(step + k) % n_streams];
                slow_down(stream);
                copy_between(stream, &mut bufs, src, dst, so, d_o, n);
                let chunk = model[src][so..so + n].to_vec();
                model[dst][d_o..d_o + n].copy_from_slice(&chunk);
            }
            let from = (src + 1 + rng.below(n_bufs - 1)) % n_bufs;
            let n = 1 + rng.below(len);
            let (so, d_o) = (rng.below(len - n + 1), rng.below(len - n + 1));
            copy_between(&streams[rng.below(n_streams)], &mut bufs, from, src, so, d_o, n);
            let chunk = model[from][so..so + n].to_vec();
            model[src][d_o..d_o + n].copy_from_slice(&chunk);
            continue;
        }
        let src = rng.below(n_bufs);
        let dst = (src + 1 + rng.below(n_bufs - 1)) % n_bufs;
        // Now and then an empty copy: ordered like any other, and it changes nothing.
        let n = if rng.below(16) == 0 { 0 } else { 1 + rng.below(len) };
        let (so, d_o) = (rng.below(len - n + 1), rng.below(len - n + 1));
        let stream = &streams[rng.below(n_streams)];
        if step % 4 == 0 {
            // Slow a stream down often, so the others run ahead unless ordered.
            slow_down(stream);
        }
        copy_between(stream, &mut bufs, src, dst, so, d_o, n);
        let chunk = model[src][so..so + n].to_vec();
        model[dst][d_o..d_o + n].copy_from_slice(&chunk);
    }
    for (i, (b, want)) in bufs.iter().zip(&model).enumerate() {
        let got = read(&streams[i % n_streams], b);
        assert!(got == *want, "seed {seed}: buffer {i} differs from the sequential model");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// Host backend: random programs over 2 to 5 buffers and 1 to 4 streams.
    #[test]
    fn host_copies_follow_program_order(seed in any::<u64>(), bufs in 2usize..6, streams in 1usize..5) {
        run_model(Device::Host, seed, bufs, streams, 60, 4096);
    }
}

#[test]
fn cuda_copies_follow_program_order() {
    let Some(device) = common::cuda_device() else { return };
    for seed in 0..8 {
        run_model(device, seed, 2 + (seed as usize % 4), 1 + (seed as usize % 4), 200, 1 << 16);
    }
}
