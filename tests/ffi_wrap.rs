//! `cuferry_buffer_wrap`: the caller's own memory as a copy's source and destination through
//! the C ABI, on both backends, against plain loops written here; and the refusals (bad
//! ranges, flags and devices, writes into read-only memory, two handles of one memory in one
//! halo unpack), which leave the memory untouched and write no out-parameter; and a code's own
//! fields as halo arrays.

mod common;

use std::ffi::{c_void, CStr};
use std::ptr;

use common::Rng;
use cuferry::ffi::*;
use cuferry::Device;

fn ordinal(device: Device) -> i32 {
    match device {
        Device::Host => CUFERRY_HOST,
        Device::Cuda(i) => i as i32,
    }
}

fn last_error() -> String {
    // SAFETY: the function always returns a NUL-terminated string.
    unsafe { CStr::from_ptr(cuferry_last_error_message()) }.to_string_lossy().into_owned()
}

/// Asserts OK, with the library's message otherwise.
fn ok(status: CuferryStatus, what: &str) {
    assert_eq!(status, CuferryStatus::Ok, "{what}: {}", last_error());
}

/// Wraps `data` for `device`; the caller keeps `data` alive and unused until `free`.
fn wrap(device: Device, data: &mut [u8], flags: u32) -> *mut CuferryBuffer {
    let mut out = ptr::null_mut();
    // SAFETY: `data` outlives the wrapper (each test frees it first); `out` is writable.
    ok(
        unsafe {
            cuferry_buffer_wrap(ordinal(device), data.as_mut_ptr().cast(), data.len(), flags, &mut out)
        },
        "wrap",
    );
    out
}

fn free(buffer: *mut CuferryBuffer) {
    // SAFETY: a live handle, not used again.
    ok(unsafe { cuferry_buffer_free(buffer) }, "free");
}

fn stream(device: Device) -> *mut CuferryStream {
    let mut out = ptr::null_mut();
    // SAFETY: `out` is writable.
    ok(unsafe { cuferry_stream_create(ordinal(device), &mut out) }, "stream");
    out
}

fn device_buffer(stream: *mut CuferryStream, bytes: usize) -> *mut CuferryBuffer {
    let mut out = ptr::null_mut();
    // SAFETY: a live stream; `out` is writable.
    ok(unsafe { cuferry_device_alloc(stream, bytes, &mut out) }, "device_alloc");
    out
}

/// Bytes up to device memory and back, from and into plain `Vec`s: the read-only wrapper as
/// the source, a writable one as the destination, both page-locked on CUDA by the wrap.
fn a_round_trip_through_device_memory(device: Device) {
    let mut rng = Rng::new(11);
    let bytes = (1 << 20) + 3;
    let mut src = rng.bytes(bytes);
    let mut back = vec![0u8; bytes];
    let s = stream(device);
    let on_device = device_buffer(s, bytes);
    let (from, to) = (wrap(device, &mut src, CUFERRY_WRAP_READ_ONLY), wrap(device, &mut back, 0));
    // SAFETY: live handles; C touches neither memory until the frees below.
    unsafe {
        assert_eq!(cuferry_buffer_size(from), bytes);
        assert_eq!(cuferry_buffer_ptr(to), back.as_mut_ptr().cast::<c_void>());
        ok(cuferry_copy(s, from, 0, on_device, 0, bytes), "copy up");
        ok(cuferry_copy(s, on_device, 0, to, 0, bytes), "copy back");
    }
    // Freeing the wrappers waits for both copies: no synchronize before reading `back`.
    free(from);
    free(to);
    assert!(back == src, "the bytes came back changed");
    free(on_device);
    // SAFETY: a live stream, not used again.
    ok(unsafe { cuferry_stream_destroy(s) }, "stream_destroy");
}

/// A replay store in a plain `Vec`, wrapped read-only: one batch gathers randomly chosen
/// items into a device buffer, a second copies them into a wrapped output, checked against
/// a gather written as a loop here.
fn a_batch_gathers_items_from_wrapped_memory(device: Device) {
    let mut rng = Rng::new(29);
    let (items, item_bytes, picked) = (200, 3000, 64);
    let mut store = rng.bytes(items * item_bytes);
    let mut out = vec![0u8; picked * item_bytes];
    let indices: Vec<usize> = (0..picked).map(|_| rng.below(items)).collect();
    let s = stream(device);
    let batch = device_buffer(s, picked * item_bytes);
    let (from, to) = (wrap(device, &mut store, CUFERRY_WRAP_READ_ONLY), wrap(device, &mut out, 0));
    let ranges: Vec<CuferryCopyRange> = indices
        .iter()
        .enumerate()
        .map(|(k, &i)| CuferryCopyRange {
            src_offset: i * item_bytes,
            dst_offset: k * item_bytes,
            bytes: item_bytes,
        })
        .collect();
    // SAFETY: live handles and `ranges.len()` readable ranges; C touches neither memory
    // until the frees below.
    unsafe {
        ok(cuferry_copy_batch(s, from, batch, ranges.as_ptr(), ranges.len()), "gather");
        ok(cuferry_copy(s, batch, 0, to, 0, picked * item_bytes), "copy out");
    }
    free(from);
    free(to);
    for (k, &i) in indices.iter().enumerate() {
        let (got, want) = (&out[k * item_bytes..][..item_bytes], &store[i * item_bytes..][..item_bytes]);
        assert!(got == want, "item {k} (store item {i}) differs");
    }
    free(batch);
    // SAFETY: a live stream, not used again.
    ok(unsafe { cuferry_stream_destroy(s) }, "stream_destroy");
}

/// A read-only wrapper is refused as the destination of a copy and of a batch, and its
/// memory keeps its bytes; as a source it is fine.
fn read_only_memory_is_never_written(device: Device) {
    let mut kept = vec![0x5au8; 4096];
    let s = stream(device);
    let mut src_bytes = vec![0xa5u8; 4096];
    let src = wrap(device, &mut src_bytes, 0);
    let read_only = wrap(device, &mut kept, CUFERRY_WRAP_READ_ONLY);
    let range = CuferryCopyRange { src_offset: 0, dst_offset: 0, bytes: 4096 };
    // SAFETY: live handles; one readable range.
    let statuses = unsafe {
        let copy = cuferry_copy(s, src, 0, read_only, 0, 4096);
        let message = last_error();
        (copy, message, cuferry_copy_batch(s, src, read_only, &range, 1))
    };
    assert_eq!(statuses.0, CuferryStatus::InvalidArgument);
    assert!(statuses.1.contains("read-only"), "{}", statuses.1);
    assert_eq!(statuses.2, CuferryStatus::InvalidArgument);
    // SAFETY: live handles: the read-only wrapper as a source is fine.
    ok(unsafe { cuferry_copy(s, read_only, 0, src, 0, 4096) }, "copy from read-only");
    free(read_only);
    free(src);
    assert!(kept.iter().all(|&b| b == 0x5a), "read-only memory was written");
    assert!(src_bytes.iter().all(|&b| b == 0x5a), "the copy from read-only memory did not run");
    // SAFETY: a live stream, not used again.
    ok(unsafe { cuferry_stream_destroy(s) }, "stream_destroy");
}

/// Bad arguments are refused with INVALID_ARGUMENT and a message, and `*out` is not written.
fn bad_wraps_are_refused(device: Device) {
    let mut data = vec![0u8; 64];
    let p = data.as_mut_ptr().cast::<c_void>();
    let sentinel = 0x1000usize as *mut CuferryBuffer;
    let d = ordinal(device);
    let cases: [(i32, *mut c_void, usize, u32, &str); 6] = [
        (d, ptr::null_mut(), 16, 0, "NULL pointer with 16 bytes"),
        (d, ptr::null_mut(), usize::MAX, 0, "NULL pointer with"),
        (d, usize::MAX as *mut c_void, 2, 0, "address space"),
        (d, p, isize::MAX as usize + 1, 0, "address space"),
        (d, p, 64, 2, "flags"),
        (d, p, 64, CUFERRY_WRAP_READ_ONLY | 4, "flags"),
    ];
    for (dev, ptr, bytes, flags, says) in cases {
        let mut out = sentinel;
        // SAFETY: each call is refused before the memory is used; `out` is writable.
        let status = unsafe { cuferry_buffer_wrap(dev, ptr, bytes, flags, &mut out) };
        let message = last_error();
        assert_eq!(status, CuferryStatus::InvalidArgument, "{dev} {ptr:?}+{bytes} flags {flags}: {message}");
        assert!(message.contains(says), "expected {says:?} in {message:?}");
        assert_eq!(out, sentinel, "a refused wrap wrote its out-parameter");
    }
    // A device past the last: INVALID_ARGUMENT with a driver, NO_DRIVER without one.
    let mut out = sentinel;
    // SAFETY: refused before the memory is used; `out` is writable.
    assert_ne!(unsafe { cuferry_buffer_wrap(4096, p, 64, 0, &mut out) }, CuferryStatus::Ok);
    assert_eq!(out, sentinel, "a refused wrap wrote its out-parameter");
    // SAFETY: `out` NULL on purpose (reported).
    assert_eq!(unsafe { cuferry_buffer_wrap(d, p, 64, 0, ptr::null_mut()) }, CuferryStatus::InvalidArgument);
    // NULL with no bytes is an empty buffer.
    let mut empty = ptr::null_mut();
    // SAFETY: no memory to keep alive; `empty` is writable.
    ok(unsafe { cuferry_buffer_wrap(d, ptr::null_mut(), 0, 0, &mut empty) }, "empty wrap");
    // SAFETY: a live handle.
    assert_eq!(unsafe { (cuferry_buffer_size(empty), cuferry_buffer_ptr(empty)) }, (0, ptr::null_mut()));
    free(empty);
    // An empty wrapper has no address, as every empty buffer, whatever pointer it was given.
    // SAFETY: no bytes to keep alive; `empty` is writable.
    ok(unsafe { cuferry_buffer_wrap(d, p, 0, 0, &mut empty) }, "empty wrap at an address");
    // SAFETY: a live handle.
    assert_eq!(unsafe { cuferry_buffer_ptr(empty) }, ptr::null_mut());
    free(empty);
}

/// On CUDA, memory another allocator made on the device (here a cuferry device buffer's,
/// through its pointer) is wrapped as device memory; the host backend refuses it.
fn device_memory_is_wrapped_for_its_device_only(device: Device) {
    let Device::Cuda(i) = device else { return };
    let s = stream(device);
    let bytes = 1 << 16;
    let allocation = device_buffer(s, bytes);
    // SAFETY: a live handle; the zeroing is waited for before the wrapper's copy reads it.
    let raw = unsafe {
        ok(cuferry_buffer_synchronize(allocation), "synchronize");
        cuferry_buffer_ptr(allocation)
    };
    let (mut foreign, mut refused) = (ptr::null_mut(), ptr::null_mut());
    // SAFETY: the allocation outlives the wrapper and is not written meanwhile.
    unsafe {
        ok(
            cuferry_buffer_wrap(i as i32, raw, bytes, CUFERRY_WRAP_READ_ONLY, &mut foreign),
            "wrap device memory",
        );
        assert_eq!(
            cuferry_buffer_wrap(CUFERRY_HOST, raw, bytes, 0, &mut refused),
            CuferryStatus::InvalidArgument
        );
    }
    let message = last_error();
    assert!(message.contains("cuda:"), "{message}");
    let mut back = vec![0xffu8; bytes];
    let to = wrap(Device::Host, &mut back, 0);
    // SAFETY: live handles.
    ok(unsafe { cuferry_copy(s, foreign, 0, to, 0, bytes) }, "copy from wrapped device memory");
    free(to);
    free(foreign);
    assert!(back.iter().all(|&b| b == 0), "the zeroed device memory did not arrive");
    free(allocation);
    // SAFETY: a live stream, not used again.
    ok(unsafe { cuferry_stream_destroy(s) }, "stream_destroy");
}

/// A code's own fields as halo arrays, no copy into cuferry buffers first: on CUDA memory it
/// allocated on the device (here a device buffer's, through its pointer), on the host backend
/// a `Vec`. Elements 0..2 of one field packed, looped back and unpacked into 6..8 of another.
fn own_fields_are_halo_arrays(device: Device) {
    let s = stream(device);
    let values: Vec<f32> = (0..8).map(|i| i as f32 * 1.25).collect();
    let (mut host_a, mut host_b) = (values.clone(), vec![0f32; 8]);
    let mut allocations = Vec::new();
    let mut field = |host: &mut Vec<f32>| -> *mut c_void {
        if device.is_host() {
            return host.as_mut_ptr().cast();
        }
        let allocation = device_buffer(s, 32);
        let staging = wrap(Device::Host, bytemuck::cast_slice_mut(host), 0);
        // SAFETY: live handles; the copy is waited for by the staging wrapper's free.
        unsafe { ok(cuferry_copy(s, staging, 0, allocation, 0, 32), "fill") };
        free(staging);
        allocations.push(allocation);
        // SAFETY: a live handle; its copy finished (the staging free waited for it).
        unsafe { cuferry_buffer_ptr(allocation) }
    };
    let (raw_a, raw_b) = (field(&mut host_a), field(&mut host_b));
    let (mut a, mut b, mut packer) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
    let exchange = common::exchange_1d();
    // SAFETY: the fields outlive their wrappers; cuferry's own copies into them have finished;
    // every out-parameter is writable; the packer and handles are live where used.
    unsafe {
        ok(cuferry_buffer_wrap(ordinal(device), raw_a, 32, CUFERRY_WRAP_READ_ONLY, &mut a), "wrap a");
        ok(cuferry_buffer_wrap(ordinal(device), raw_b, 32, 0, &mut b), "wrap b");
        ok(cuferry_halo_packer_create(ordinal(device), &exchange, 1, &mut packer), "packer");
        ok(cuferry_halo_pack(packer, [a.cast_const()].as_ptr(), 1), "pack");
        ok(cuferry_halo_loopback(packer), "loopback");
        ok(cuferry_halo_unpack(packer, [b.cast_const()].as_ptr(), 1), "unpack");
        ok(cuferry_halo_synchronize(packer), "synchronize");
        ok(cuferry_halo_packer_destroy(packer), "destroy");
    }
    free(a);
    free(b);
    let mut got = vec![0f32; 8];
    if device.is_host() {
        got.copy_from_slice(&host_b);
    } else {
        let back = wrap(Device::Host, bytemuck::cast_slice_mut(&mut got), 0);
        // SAFETY: live handles.
        unsafe { ok(cuferry_copy(s, allocations[1], 0, back, 0, 32), "read back") };
        free(back);
    }
    let mut want = vec![0f32; 8];
    want[6..].copy_from_slice(&values[..2]);
    assert_eq!(got, want, "the unpacked field");
    allocations.into_iter().for_each(free);
    // SAFETY: a live stream, not used again.
    ok(unsafe { cuferry_stream_destroy(s) }, "stream_destroy");
}

/// A buffer and a wrapper of its own memory at an offset are two handles of one memory:
/// unpacking both in one call is refused (their regions cannot be compared, and two threads
/// or blocks would write the shared bytes), packing from both is fine.
fn two_handles_of_one_memory_are_not_unpacked_together(device: Device) {
    let s = stream(device);
    let allocation = device_buffer(s, 64);
    // SAFETY: a live handle; its zeroing is waited for before the wrapper is used.
    let raw = unsafe {
        ok(cuferry_buffer_synchronize(allocation), "synchronize");
        cuferry_buffer_ptr(allocation)
    };
    let (mut shifted, mut packer) = (ptr::null_mut(), ptr::null_mut());
    let exchanges = [common::exchange_1d(), common::exchange_1d()];
    // SAFETY: the allocation outlives the wrapper; writable out-parameters; live handles.
    unsafe {
        ok(cuferry_buffer_wrap(ordinal(device), raw.cast::<u8>().add(8).cast(), 32, 0, &mut shifted), "wrap");
        ok(cuferry_halo_packer_create(ordinal(device), exchanges.as_ptr(), 2, &mut packer), "packer");
        let arrays = [allocation.cast_const(), shifted.cast_const()];
        ok(cuferry_halo_pack(packer, arrays.as_ptr(), 2), "pack");
        assert_eq!(cuferry_halo_unpack(packer, arrays.as_ptr(), 2), CuferryStatus::InvalidArgument);
        let message = last_error();
        assert!(message.contains("share memory"), "{message}");
        ok(cuferry_halo_packer_destroy(packer), "destroy");
    }
    free(shifted);
    free(allocation);
    // SAFETY: a live stream, not used again.
    ok(unsafe { cuferry_stream_destroy(s) }, "stream_destroy");
}

on_both_backends! {
    round_trip_through_device_memory => a_round_trip_through_device_memory;
    batch_gathers_items_from_wrapped_memory => a_batch_gathers_items_from_wrapped_memory;
    read_only_memory_is_never_written => read_only_memory_is_never_written;
    bad_wraps_are_refused => bad_wraps_are_refused;
    device_memory_is_wrapped_for_its_device_only => device_memory_is_wrapped_for_its_device_only;
    own_fields_are_halo_arrays => own_fields_are_halo_arrays;
    two_handles_of_one_memory_are_not_unpacked_together => two_handles_of_one_memory_are_not_unpacked_together;
}
