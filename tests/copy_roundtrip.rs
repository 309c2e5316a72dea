//! Copies: round trips for random sizes (0, 1, odd, multi-MiB) through pinned, registered,
//! pageable and device memory (managed memory's copies are in tests/managed.rs), sub-range
//! copies against a scalar reference, directions, peer copies on either device's stream
//! before and after peer access is enabled, and bad arguments.
//! Each check runs on the host backend and, when a GPU is present, on CUDA.

mod common;

use common::Rng;
use cuferry::{
    copy, copy_range, CopyDirection, Device, DeviceBuffer, Error, HostRegistration, Memory, MemoryKind,
    PinnedBuffer, Stream,
};
use proptest::prelude::*;

/// Sizes the issue names: empty, one, odd, and several MiB.
const SIZES: &[usize] = &[0, 1, 3, 4097, 65_537, 3 * (1 << 20) + 5];

/// pinned -> device -> device -> pinned, and pageable -> device -> pageable, byte-exact.
fn round_trip_bytes(device: Device, data: &[u8]) {
    let stream = Stream::new(device).unwrap();
    let src = PinnedBuffer::from_slice(device, data).unwrap();
    let mut d1 = DeviceBuffer::<u8>::zeroed(&stream, data.len()).unwrap();
    let mut d2 = DeviceBuffer::<u8>::zeroed(&stream, data.len()).unwrap();
    let mut back = PinnedBuffer::<u8>::zeroed(device, data.len()).unwrap();
    let up = copy(&stream, &src, &mut d1).unwrap();
    let across = copy(&stream, &d1, &mut d2).unwrap();
    let down = copy(&stream, &d2, &mut back).unwrap();
    assert_eq!(back.as_slice().unwrap(), data);
    if device.is_host() {
        assert_eq!(
            (up, across, down),
            (CopyDirection::HostToHost, CopyDirection::DeviceToDevice, CopyDirection::HostToHost)
        );
    } else {
        assert_eq!(
            (up, across, down),
            (CopyDirection::HostToDevice, CopyDirection::DeviceToDevice, CopyDirection::DeviceToHost)
        );
    }
    // The synchronous pageable helpers.
    let d3 = DeviceBuffer::from_slice(&stream, data).unwrap();
    assert_eq!(d3.to_vec(&stream).unwrap(), data);
}

fn round_trips_for_listed_sizes(device: Device) {
    let mut rng = Rng::new(7);
    for &n in SIZES {
        round_trip_bytes(device, &rng.bytes(n));
    }
}

/// Wider element types keep their values (f64, u32) through the same path.
fn round_trip_typed(device: Device) {
    let stream = Stream::new(device).unwrap();
    let floats: Vec<f64> = (0..10_001).map(|i| (i as f64).sin() * 1e300).collect();
    let dev = DeviceBuffer::from_slice(&stream, &floats).unwrap();
    let mut back = PinnedBuffer::<f64>::zeroed(device, floats.len()).unwrap();
    copy(&stream, &dev, &mut back).unwrap();
    assert_eq!(back.as_slice().unwrap(), &floats[..]);
}

/// Registered caller memory round-trips and comes back intact.
fn registered_memory(device: Device) {
    let stream = Stream::new(device).unwrap();
    let mut rng = Rng::new(11);
    let data = rng.bytes(2 * (1 << 20) + 13);
    let reg = HostRegistration::new(device, data.clone()).unwrap();
    assert_eq!(reg.kind(), if reg.is_pinned() { MemoryKind::Pinned } else { MemoryKind::Pageable });
    let mut dev = DeviceBuffer::<u8>::zeroed(&stream, data.len()).unwrap();
    copy(&stream, &reg, &mut dev).unwrap();
    let mut out = HostRegistration::new(device, vec![0u8; data.len()]).unwrap();
    copy(&stream, &dev, &mut out).unwrap();
    assert_eq!(out.as_slice().unwrap(), &data[..]);
    assert_eq!(out.into_inner().unwrap(), data);
    assert_eq!(reg.into_inner().unwrap(), data);
    let empty = HostRegistration::<u8>::new(device, Vec::new()).unwrap();
    assert!(empty.is_empty());
}

/// Two registrations of heap neighbours on one page: CUDA does not document whether the
/// second is refused (a driver tracking whole pages) or taken (one tracking byte ranges).
/// Either way both copy right; on a GPU the test prints which the driver does (the ring's
/// caller slots handle both, `ring/caller_slots.rs`).
fn registered_neighbours_on_one_page(device: Device) {
    let stream = Stream::new(device).unwrap();
    let (a, b) = (vec![0x5au8; 200], vec![0xa5u8; 200]);
    let pages = |v: &[u8]| {
        let at = v.as_ptr() as usize;
        (at / 4096, (at + v.len() - 1) / 4096)
    };
    let ((a0, a1), (b0, b1)) = (pages(&a), pages(&b));
    let shared = a0 <= b1 && b0 <= a1;
    let (ra, rb) = (HostRegistration::new(device, a).unwrap(), HostRegistration::new(device, b).unwrap());
    if !device.is_host() {
        println!(
            "PROBE {device:?}: two registrations on one page (shared: {shared}): first pinned {}, second pinned {}",
            ra.is_pinned(),
            rb.is_pinned()
        );
    }
    for (reg, byte) in [(&ra, 0x5au8), (&rb, 0xa5u8)] {
        let mut dev = DeviceBuffer::<u8>::zeroed(&stream, 200).unwrap();
        copy(&stream, reg, &mut dev).unwrap();
        assert_eq!(dev.to_vec(&stream).unwrap(), vec![byte; 200]);
    }
    assert_eq!(rb.into_inner().unwrap(), vec![0xa5u8; 200]);
    assert_eq!(ra.into_inner().unwrap(), vec![0x5au8; 200]);
}

/// Range copies agree with a scalar loop over the same ranges.
#[allow(clippy::manual_memcpy)] // the reference is an element-by-element loop on purpose
fn ranges_match_scalar_reference(device: Device, seed: u64) {
    let stream = Stream::new(device).unwrap();
    let mut rng = Rng::new(seed);
    let (n_src, n_dst) = (1 + rng.below(5000), 1 + rng.below(5000));
    let src_data: Vec<u32> = (0..n_src).map(|_| rng.next_u64() as u32).collect();
    let dst_init: Vec<u32> = (0..n_dst).map(|_| rng.next_u64() as u32).collect();
    let src = DeviceBuffer::from_slice(&stream, &src_data).unwrap();
    let mut dst = DeviceBuffer::from_slice(&stream, &dst_init).unwrap();
    let mut expected = dst_init.clone();
    for _ in 0..8 {
        let len = rng.below(n_src.min(n_dst) + 1);
        let so = rng.below(n_src - len + 1);
        let d_o = rng.below(n_dst - len + 1);
        copy_range(&stream, &src, so, &mut dst, d_o, len).unwrap();
        for i in 0..len {
            expected[d_o + i] = src_data[so + i];
        }
    }
    assert_eq!(dst.to_vec(&stream).unwrap(), expected);
}

fn ranges(device: Device) {
    for seed in 0..10 {
        ranges_match_scalar_reference(device, seed);
    }
}

/// Bad arguments are typed errors and queue nothing.
fn bad_arguments(device: Device) {
    let stream = Stream::new(device).unwrap();
    let a = DeviceBuffer::from_slice(&stream, &[1u8, 2, 3]).unwrap();
    let mut b = DeviceBuffer::<u8>::zeroed(&stream, 4).unwrap();
    assert!(matches!(copy(&stream, &a, &mut b), Err(Error::InvalidArgument { .. })));
    assert!(matches!(copy_range(&stream, &a, 2, &mut b, 0, 2), Err(Error::InvalidArgument { .. })));
    assert!(matches!(copy_range(&stream, &a, 0, &mut b, 3, 2), Err(Error::InvalidArgument { .. })));
    assert!(matches!(copy_range(&stream, &a, usize::MAX, &mut b, 0, 2), Err(Error::InvalidArgument { .. })));
    let mut out = [0u8; 2];
    assert!(matches!(a.copy_to_slice(&stream, &mut out), Err(Error::InvalidArgument { .. })));
    assert!(matches!(
        DeviceBuffer::<u64>::zeroed(&stream, usize::MAX / 4),
        Err(Error::InvalidArgument { .. })
    ));
    if device.is_host() {
        // Past isize::MAX bytes without overflowing usize: refused in cuferry's words.
        let huge = DeviceBuffer::<u64>::zeroed(&stream, usize::MAX / 16);
        let said = huge.as_ref().map_err(|e| e.to_string());
        assert!(said.is_err_and(|m| m.contains("larger than any allocation")), "{huge:?}");
    }
    // A size that is valid but fits nowhere: out of memory, recognisably so on every device
    // (the host's own variant; CUDA's cudaErrorMemoryAllocation), not a missing capability.
    let unservable = (isize::MAX as usize - 4095) / 8;
    for err in [
        DeviceBuffer::<u64>::zeroed(&stream, unservable).map(drop),
        PinnedBuffer::<u64>::zeroed(device, unservable).map(drop),
    ] {
        let err = err.expect_err("an allocation of 8 EiB succeeded");
        assert!(err.is_out_of_memory(), "{err:?}");
        assert_eq!(device.is_host(), matches!(err, Error::OutOfMemory { .. }), "{err:?}");
    }
    assert_eq!(b.to_vec(&stream).unwrap(), vec![0; 4], "a rejected copy wrote something");
    // Zero-sized elements would make non-empty buffers of zero bytes (a null pointer).
    assert!(matches!(DeviceBuffer::<()>::zeroed(&stream, 3), Err(Error::InvalidArgument { .. })));
    assert!(matches!(PinnedBuffer::<()>::zeroed(device, 3), Err(Error::InvalidArgument { .. })));
    assert!(matches!(PinnedBuffer::from_slice(device, &[(); 3]), Err(Error::InvalidArgument { .. })));
}

/// The offset slice helpers write and read exactly the named range, against a scalar loop, and
/// refuse ranges past either end without touching the buffer.
#[allow(clippy::manual_memcpy)] // the reference is an element-by-element loop on purpose
fn slice_offsets(device: Device) {
    let stream = Stream::new(device).unwrap();
    let mut rng = Rng::new(23);
    let n = 3001;
    let init: Vec<u32> = (0..n).map(|_| rng.next_u64() as u32).collect();
    let mut buf = DeviceBuffer::from_slice(&stream, &init).unwrap();
    let mut expected = init.clone();
    for _ in 0..12 {
        let len = rng.below(n + 1);
        let offset = rng.below(n - len + 1);
        let data: Vec<u32> = (0..len).map(|_| rng.next_u64() as u32).collect();
        buf.copy_from_slice_at(&stream, offset, &data).unwrap();
        for i in 0..len {
            expected[offset + i] = data[i];
        }
        let mut out = vec![0u32; rng.below(n - offset + 1)];
        buf.copy_to_slice_at(&stream, offset, &mut out).unwrap();
        for (i, value) in out.iter().enumerate() {
            assert_eq!(*value, expected[offset + i], "read at {offset} + {i}");
        }
    }
    assert_eq!(buf.to_vec(&stream).unwrap(), expected);
    for (offset, len) in [(n, 1), (n - 1, 2), (1, n), (usize::MAX, 1)] {
        let data = vec![7u32; len];
        assert!(matches!(buf.copy_from_slice_at(&stream, offset, &data), Err(Error::InvalidArgument { .. })));
        let mut out = vec![0u32; len];
        assert!(matches!(
            buf.copy_to_slice_at(&stream, offset, &mut out),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(out.iter().all(|&v| v == 0), "a refused read wrote into the output");
    }
    assert_eq!(buf.to_vec(&stream).unwrap(), expected, "a refused write changed the buffer");
    // An empty slice at the very end is a valid (empty) range.
    buf.copy_from_slice_at(&stream, n, &[]).unwrap();
    buf.copy_to_slice_at(&stream, n, &mut []).unwrap();
}

on_both_backends! {
    round_trips_for_listed_sizes => round_trips_for_listed_sizes;
    round_trip_typed => round_trip_typed;
    registered_memory => registered_memory;
    registered_neighbours_on_one_page => registered_neighbours_on_one_page;
    ranges => ranges;
    bad_arguments => bad_arguments;
    slice_offsets => slice_offsets;
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random sizes and contents round-trip on the host backend.
    #[test]
    fn host_round_trip_random(data in proptest::collection::vec(any::<u8>(), 0..200_000)) {
        round_trip_bytes(Device::Host, &data);
    }
}

/// The same random round trips on CUDA (skipped without a GPU).
#[test]
fn cuda_round_trip_random() {
    let Some(device) = common::cuda_device() else { return };
    let mut rng = Rng::new(99);
    for _ in 0..24 {
        let n = rng.below(300_000);
        round_trip_bytes(device, &rng.bytes(n));
    }
}

/// A host stream cannot reach CUDA device memory, and a CUDA stream of an uninvolved device
/// is refused.
#[test]
fn cuda_memory_needs_a_cuda_stream() {
    let Some(gpu) = common::cuda_device() else { return };
    let cuda_stream = Stream::new(gpu).unwrap();
    let host_stream = Stream::new(Device::Host).unwrap();
    let dev = DeviceBuffer::from_slice(&cuda_stream, &[5u8; 16]).unwrap();
    let mut host = PinnedBuffer::<u8>::zeroed(gpu, 16).unwrap();
    assert!(matches!(copy(&host_stream, &dev, &mut host), Err(Error::InvalidArgument { .. })));
    // Host-backend memory works with a CUDA stream as pageable memory.
    let mut plain = DeviceBuffer::<u8>::zeroed(&host_stream, 16).unwrap();
    assert_eq!(copy(&cuda_stream, &dev, &mut plain).unwrap(), CopyDirection::DeviceToHost);
    assert_eq!(plain.to_vec(&host_stream).unwrap(), vec![5u8; 16]);
}

/// Peer copies between two devices (skipped on one-GPU machines).
#[test]
fn cuda_peer_round_trip() {
    let Some((d0, d1)) = common::two_cuda_devices() else { return };
    let (s0, s1) = (Stream::new(d0).unwrap(), Stream::new(d1).unwrap());
    let data = Rng::new(5).bytes(1 << 20);
    let a = DeviceBuffer::from_slice(&s0, &data).unwrap();
    let mut b = DeviceBuffer::<u8>::zeroed(&s1, data.len()).unwrap();
    assert_eq!(copy(&s0, &a, &mut b).unwrap(), CopyDirection::Peer);
    assert_eq!(b.to_vec(&s1).unwrap(), data);
    // Back on the destination's stream, then again both ways once peer access is enabled
    // (the direct path, where the hardware has one).
    let back = |stream: &Stream, seed: u64| {
        let other = Rng::new(seed).bytes(data.len());
        let mut here = DeviceBuffer::from_slice(&s1, &other).unwrap();
        let mut there = DeviceBuffer::<u8>::zeroed(&s0, data.len()).unwrap();
        assert_eq!(copy(stream, &here, &mut there).unwrap(), CopyDirection::Peer);
        assert_eq!(there.to_vec(&s0).unwrap(), other, "peer copy to {d0} differs");
        assert_eq!(copy(stream, &there, &mut here).unwrap(), CopyDirection::Peer);
        assert_eq!(here.to_vec(&s1).unwrap(), other, "peer copy back to {d1} differs");
    };
    back(&s1, 6);
    if cuferry::can_access_peer(d1, d0).unwrap() && cuferry::can_access_peer(d0, d1).unwrap() {
        cuferry::enable_peer_access(d1, d0).unwrap();
        cuferry::enable_peer_access(d1, d0).unwrap(); // twice is fine
        cuferry::enable_peer_access(d0, d1).unwrap();
        back(&s0, 7);
        back(&s1, 8);
    }
}

/// An element type aligned past what the allocators guarantee (256 bytes on CUDA) is refused
/// by every buffer, so no slice of it can be misaligned.
#[test]
fn over_aligned_element_types_are_refused() {
    #[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
    #[repr(C, align(8192))]
    struct TwoPages([[u8; 4096]; 2]);
    #[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
    #[repr(C, align(256))]
    struct Line([u8; 256]);
    let stream = Stream::new(Device::Host).unwrap();
    assert!(matches!(PinnedBuffer::<TwoPages>::zeroed(Device::Host, 1), Err(Error::InvalidArgument { .. })));
    assert!(matches!(DeviceBuffer::<TwoPages>::zeroed(&stream, 1), Err(Error::InvalidArgument { .. })));
    let pool = cuferry::managed::ManagedPool::new(Device::Host, Default::default()).unwrap();
    assert!(matches!(pool.alloc::<TwoPages>(1, &stream), Err(Error::InvalidArgument { .. })));
    let registered = HostRegistration::new(Device::Host, vec![TwoPages([[0; 4096]; 2]); 1]);
    assert!(matches!(registered, Err(Error::InvalidArgument { .. })));
    // Zero-sized elements too: a registration of 5 of them would be 5 elements over 0 bytes.
    assert!(matches!(HostRegistration::new(Device::Host, vec![(); 5]), Err(Error::InvalidArgument { .. })));
    // At the limit, buffers work and their slices are aligned.
    let lines = PinnedBuffer::<Line>::zeroed(Device::Host, 3).unwrap();
    let slice = lines.as_slice().unwrap();
    assert_eq!(slice.as_ptr() as usize % std::mem::align_of::<Line>(), 0);
    assert_eq!(std::mem::align_of::<Line>(), cuferry::MAX_ELEMENT_ALIGN);
}
