//! `ForeignBuffer`: memory another owner allocated (here a `Vec`, and on a GPU memory of a
//! device buffer standing in for another library's `cudaMalloc`) as a source and destination
//! of copies, batches and halo packs, on both backends, checked against plain loops written
//! here; and the refusals (read-only wrappers written by any operation, misaligned and bad
//! ranges, overlapping wrappers), which leave the memory untouched.

mod common;

use common::Rng;
use cuferry::halo::{ElementType, HaloExchange, HaloPacker, HaloSpec, HorizontalDims};
use cuferry::kernels::fill_pattern_u32;
use cuferry::{
    copy, copy_range, copy_ranges, CopyBatch, CopyRange, Device, DeviceBuffer, Element, Error, ForeignBuffer,
    Memory, MemoryKind, Stream,
};

/// Memory the test owns, of the kind a wrapper for `device` reaches from its kernels: host
/// memory (a `Vec`) on the host backend, device memory on CUDA.
enum Owned<T: Element> {
    Host(Vec<T>),
    Device(DeviceBuffer<T>),
}

impl<T: Element> Owned<T> {
    fn new(stream: &Stream, data: &[T]) -> Self {
        match stream.device() {
            Device::Host => Owned::Host(data.to_vec()),
            Device::Cuda(_) => {
                let buffer = DeviceBuffer::from_slice(stream, data).unwrap();
                // The wrapper's tracker will not see this upload: finish it first.
                buffer.synchronize().unwrap();
                Owned::Device(buffer)
            }
        }
    }

    /// A wrapper of the memory; the caller releases it before reading or dropping `self`.
    fn wrap(&mut self, device: Device, read_only: bool) -> cuferry::Result<ForeignBuffer<T>> {
        let (ptr, len) = match self {
            Owned::Host(v) => (v.as_mut_ptr(), v.len()),
            Owned::Device(d) => (d.as_mut_ptr(), d.len()),
        };
        // SAFETY: `self` outlives the wrapper (every caller releases it first), and nothing
        // else touches the memory meanwhile.
        unsafe {
            if read_only {
                ForeignBuffer::wrap_read_only(device, ptr, len)
            } else {
                ForeignBuffer::wrap(device, ptr, len)
            }
        }
    }

    fn read(&self, stream: &Stream) -> Vec<T> {
        match self {
            Owned::Host(v) => v.clone(),
            Owned::Device(d) => d.to_vec(stream).unwrap(),
        }
    }
}

fn random_f64(rng: &mut Rng, n: usize) -> Vec<f64> {
    (0..n).map(|_| rng.next_u64() as f64 / 7.0).collect()
}

/// Whole and ranged copies through wrappers, one each way, against a loop.
fn round_trip(device: Device) {
    let stream = Stream::new(device).unwrap();
    let mut rng = Rng::new(11);
    let data = random_f64(&mut rng, 10_000);
    let mut src = Owned::new(&stream, &data);
    let mut dst = Owned::new(&stream, &vec![0.0; data.len()]);
    let source = src.wrap(device, true).unwrap();
    let mut destination = dst.wrap(device, false).unwrap();
    let expected_kind = match device {
        Device::Host => MemoryKind::Pageable,
        Device::Cuda(_) => MemoryKind::Device(device),
    };
    assert_eq!((source.kind(), source.len()), (expected_kind, data.len()));
    assert!(source.is_read_only() && !destination.is_read_only());

    let mut middle = DeviceBuffer::<f64>::zeroed(&stream, data.len()).unwrap();
    copy(&stream, &source, &mut middle).unwrap();
    copy_range(&stream, &middle, 100, &mut destination, 2000, 3000).unwrap();
    copy_range(&stream, &source, 9000, &mut destination, 0, 1000).unwrap();
    destination.release().unwrap();
    source.release().unwrap();

    let mut expected = vec![0.0; data.len()];
    for (i, e) in expected.iter_mut().enumerate() {
        if i < 1000 {
            *e = data[9000 + i];
        } else if (2000..5000).contains(&i) {
            *e = data[i - 1900];
        }
    }
    assert_eq!(dst.read(&stream), expected);
    assert_eq!(src.read(&stream), data, "the read-only source changed");
}

/// A batch gathers scattered items of a wrapped store into a device buffer, and scatters
/// them back into a second wrapped store, as a replay buffer or a paged cache does.
fn batch_gather(device: Device) {
    let stream = Stream::new(device).unwrap();
    let mut rng = Rng::new(5);
    let store: Vec<u32> = (0..64 * 256).map(|_| rng.next_u64() as u32).collect();
    let mut owned = Owned::new(&stream, &store);
    let mut back = Owned::new(&stream, &vec![0u32; store.len()]);
    let wrapped = owned.wrap(device, true).unwrap();
    let mut wrapped_back = back.wrap(device, false).unwrap();
    // 40 distinct items of 256 elements, in a random order.
    let mut items: Vec<usize> = (0..64).collect();
    for i in (1..items.len()).rev() {
        items.swap(i, rng.below(i + 1));
    }
    items.truncate(40);
    let gather: Vec<CopyRange> =
        items.iter().enumerate().map(|(slot, &item)| CopyRange::new(item * 256, slot * 256, 256)).collect();
    let mut gathered = DeviceBuffer::<u32>::zeroed(&stream, 40 * 256).unwrap();
    copy_ranges(&stream, &wrapped, &mut gathered, &gather).unwrap();
    let scatter: Vec<CopyRange> =
        gather.iter().map(|r| CopyRange::new(r.dst_offset, r.src_offset, r.len)).collect();
    let mut batch = CopyBatch::new(&stream);
    batch.add(&gathered, &mut wrapped_back, &scatter).unwrap();
    batch.submit().unwrap();
    let got = gathered.to_vec(&stream).unwrap();
    wrapped_back.release().unwrap();
    wrapped.release().unwrap();

    let mut expected_back = vec![0u32; store.len()];
    for (slot, &item) in items.iter().enumerate() {
        for e in 0..256 {
            assert_eq!(got[slot * 256 + e], store[item * 256 + e], "item {item} in slot {slot}");
            expected_back[item * 256 + e] = store[item * 256 + e];
        }
    }
    assert_eq!(back.read(&stream), expected_back);
}

fn is_read_only_refusal<T: std::fmt::Debug>(result: &cuferry::Result<T>) -> bool {
    matches!(result, Err(Error::InvalidArgument { what }) if what.contains("read-only"))
}

/// Every operation that writes memory refuses a read-only wrapper before queueing anything:
/// the memory keeps its bytes, and a refused batch pair leaves the batch empty.
fn read_only_is_never_written(device: Device) {
    let stream = Stream::new(device).unwrap();
    let data: Vec<u32> = (0..1024).map(|i| i * 3 + 1).collect();
    let mut owned = Owned::new(&stream, &data);
    let mut wrapped = owned.wrap(device, true).unwrap();
    let source = DeviceBuffer::<u32>::zeroed(&stream, data.len()).unwrap();

    assert!(is_read_only_refusal(&copy(&stream, &source, &mut wrapped)));
    assert!(is_read_only_refusal(&copy_range(&stream, &source, 0, &mut wrapped, 8, 8)));
    assert!(is_read_only_refusal(&copy_ranges(&stream, &source, &mut wrapped, &[CopyRange::new(0, 0, 4)])));
    let mut batch = CopyBatch::new(&stream);
    assert!(is_read_only_refusal(&batch.add(&source, &mut wrapped, &[CopyRange::new(0, 0, 4)])));
    assert!(batch.is_empty());
    drop(batch);
    assert!(is_read_only_refusal(&fill_pattern_u32(&stream, &mut wrapped, 9)));

    let spec =
        HaloSpec::contiguous(ElementType::Raw { size: 4 }, &[32, 32], HorizontalDims::xy(0, 1)).unwrap();
    let exchange = HaloExchange::new(&spec, &[0..2, 0..32], 0, &[30..32, 0..32]).unwrap();
    let mut packer = HaloPacker::new(device, &[exchange], None).unwrap();
    assert!(is_read_only_refusal(&packer.unpack(&[&wrapped], None)));

    // As a source it serves.
    let mut copied = DeviceBuffer::<u32>::zeroed(&stream, data.len()).unwrap();
    copy(&stream, &wrapped, &mut copied).unwrap();
    assert_eq!(copied.to_vec(&stream).unwrap(), data);
    wrapped.release().unwrap();
    assert_eq!(owned.read(&stream), data, "a refused write touched the memory");
}

/// A pack from wrapped arrays and a (safe) unpack into wrapped arrays, against the scalar
/// reference of a half turn: row `nx-h+i`, column `j` of the target takes row `h-1-i`,
/// column `ny-1-j` of the source.
fn halo_through_wrapped_arrays(device: Device) {
    let stream = Stream::new(device).unwrap();
    let (nx, ny, h) = (12usize, 20usize, 3usize);
    let mut rng = Rng::new(17);
    let spec = HaloSpec::contiguous(ElementType::F64, &[nx, ny], HorizontalDims::xy(0, 1)).unwrap();
    let exchange = HaloExchange::new(&spec, &[0..h, 0..ny], 2, &[nx - h..nx, 0..ny]).unwrap();
    let mut packer = HaloPacker::new(device, &[exchange.clone(), exchange], None).unwrap();
    let sources: Vec<Vec<f64>> = (0..2).map(|_| random_f64(&mut rng, nx * ny)).collect();
    let targets: Vec<Vec<f64>> = (0..2).map(|_| random_f64(&mut rng, nx * ny)).collect();
    let mut src_owned: Vec<Owned<f64>> = sources.iter().map(|s| Owned::new(&stream, s)).collect();
    let mut dst_owned: Vec<Owned<f64>> = targets.iter().map(|t| Owned::new(&stream, t)).collect();
    let src: Vec<ForeignBuffer<f64>> = src_owned.iter_mut().map(|o| o.wrap(device, true).unwrap()).collect();
    let dst: Vec<ForeignBuffer<f64>> = dst_owned.iter_mut().map(|o| o.wrap(device, false).unwrap()).collect();
    packer.pack(&[&src[0], &src[1]], None).unwrap();
    packer.copy_pack_to_unpack().unwrap();
    packer.unpack(&[&dst[0], &dst[1]], None).unwrap();
    for wrapper in src.into_iter().chain(dst) {
        wrapper.release().unwrap();
    }
    for (q, owned) in dst_owned.iter().enumerate() {
        let mut expected = targets[q].clone();
        for i in 0..h {
            for j in 0..ny {
                expected[(nx - h + i) * ny + j] = sources[q][(h - 1 - i) * ny + (ny - 1 - j)];
            }
        }
        assert_eq!(owned.read(&stream), expected, "array {q}");
    }
}

/// Misaligned pointers, NULL with elements, element counts whose bytes overflow and ranges a
/// live wrapper (of any element type) holds are refused; an empty wrapper has no pointer.
fn bad_wraps_are_refused(device: Device) {
    let mut words = vec![0u64; 64];
    let base = words.as_mut_ptr();
    let refused = |result: cuferry::Result<ForeignBuffer<f64>>, says: &str| match result {
        Err(Error::InvalidArgument { what }) => assert!(what.contains(says), "{what}"),
        other => panic!("expected InvalidArgument naming {says:?}, got {other:?}"),
    };
    // SAFETY: each is refused before the memory is touched.
    unsafe {
        refused(ForeignBuffer::wrap(device, base.cast::<u8>().wrapping_add(4).cast(), 8), "not aligned");
        refused(ForeignBuffer::wrap(device, std::ptr::null_mut(), 1), "NULL");
        refused(ForeignBuffer::wrap(device, base.cast(), usize::MAX / 4), "overflow");
    }
    // SAFETY: `words` outlives the wrapper, which no operation uses.
    let bytes = unsafe { ForeignBuffer::<u8>::wrap(device, base.cast(), 64) }.unwrap();
    // SAFETY: refused before the memory is touched.
    refused(unsafe { ForeignBuffer::wrap(device, base.wrapping_add(7).cast(), 4) }, "live wrapper");
    // SAFETY: `words` outlives the wrapper, which no operation uses; it starts where `bytes` ends.
    let next = unsafe { ForeignBuffer::<f64>::wrap(device, base.wrapping_add(8).cast(), 8) }.unwrap();
    bytes.release().unwrap();
    next.release().unwrap();
    // SAFETY: no bytes.
    let empty = unsafe { ForeignBuffer::<f64>::wrap(device, base.cast(), 0) }.unwrap();
    assert!(empty.as_ptr().is_null() && empty.is_empty());
    drop(words);
}

/// A wrapper crosses threads: a copy queued from another thread is waited for by the release.
#[test]
fn a_wrapper_is_send_and_sync() {
    fn shared<T: Send + Sync>(_: &T) {}
    let stream = Stream::new(Device::Host).unwrap();
    let mut data = vec![0u16; 4096];
    // SAFETY: `data` outlives the wrapper, released below before it is read.
    let mut wrapped = unsafe { ForeignBuffer::wrap(Device::Host, data.as_mut_ptr(), data.len()) }.unwrap();
    shared(&wrapped);
    let source = DeviceBuffer::from_slice(&stream, &vec![9u16; 4096]).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| copy(&stream, &source, &mut wrapped).unwrap());
    });
    wrapped.release().unwrap();
    assert!(data.iter().all(|&x| x == 9));
}

on_both_backends! {
    round_trip_through_device_memory => round_trip;
    a_batch_gathers_and_scatters_wrapped_items => batch_gather;
    a_read_only_wrapper_is_never_written => read_only_is_never_written;
    halo_packs_and_unpacks_wrapped_arrays => halo_through_wrapped_arrays;
    bad_wraps_are_refused_and_wrappers_never_overlap => bad_wraps_are_refused;
}
