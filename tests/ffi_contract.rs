//! The C ABI's promises checked by calling its functions from Rust, on the host backend:
//! out-parameters are written only on success, and no call aborts the process, even from a
//! C library's thread-exit cleanup.

mod common;

use std::ffi::{c_void, CStr};
use std::ptr;

use common::exchange_1d;
use cuferry::ffi::*;

#[test]
fn halo_buffer_queries_write_nothing_when_they_fail() {
    let exchange = exchange_1d();
    let mut packer: *mut CuferryHaloPacker = ptr::null_mut();
    // SAFETY: one valid exchange and a writable out-parameter.
    assert_eq!(
        unsafe { cuferry_halo_packer_create(CUFERRY_HOST, &exchange, 1, &mut packer) },
        CuferryStatus::Ok
    );
    let sentinel = 0x1234usize as *mut c_void;
    let (mut pack_ptr, mut unpack_ptr) = (sentinel, sentinel);
    // SAFETY: a live packer; `bytes` NULL on purpose (allowed, and reported).
    let statuses = unsafe {
        (
            cuferry_halo_pack_buffer(packer, &mut pack_ptr, ptr::null_mut()),
            cuferry_halo_unpack_buffer(packer, &mut unpack_ptr, ptr::null_mut()),
        )
    };
    assert_eq!(statuses, (CuferryStatus::InvalidArgument, CuferryStatus::InvalidArgument));
    assert_eq!(pack_ptr, sentinel, "cuferry_halo_pack_buffer wrote ptr although it failed");
    assert_eq!(unpack_ptr, sentinel, "cuferry_halo_unpack_buffer wrote ptr although it failed");
    let mut bytes = 0usize;
    // SAFETY: as above, both out-parameters writable this time.
    assert_eq!(unsafe { cuferry_halo_pack_buffer(packer, &mut pack_ptr, &mut bytes) }, CuferryStatus::Ok);
    assert!(pack_ptr != sentinel && bytes == 8, "{pack_ptr:?}, {bytes}");
    // SAFETY: the packer is live and not used again.
    assert_eq!(unsafe { cuferry_halo_packer_destroy(packer) }, CuferryStatus::Ok);
}

/// A wrapper of the caller's own memory is a halo array: packed from (read-only too), and
/// unpacked into unless read-only, which is refused with the memory left as it was.
#[test]
fn halo_packers_take_wrapped_arrays() {
    let exchange = exchange_1d();
    let mut packer: *mut CuferryHaloPacker = ptr::null_mut();
    let mut field: Vec<f32> = (0..8).map(|i| i as f32 + 0.5).collect();
    let mut constant = field.clone();
    let (mut writable, mut read_only): (*mut CuferryBuffer, *mut CuferryBuffer) =
        (ptr::null_mut(), ptr::null_mut());
    // SAFETY: one valid exchange; both vectors outlive their wrappers; writable out-parameters.
    unsafe {
        assert_eq!(cuferry_halo_packer_create(CUFERRY_HOST, &exchange, 1, &mut packer), CuferryStatus::Ok);
        let (w, r) = (field.as_mut_ptr().cast(), constant.as_mut_ptr().cast());
        assert_eq!(cuferry_buffer_wrap(CUFERRY_HOST, w, 32, 0, &mut writable), CuferryStatus::Ok);
        assert_eq!(
            cuferry_buffer_wrap(CUFERRY_HOST, r, 32, CUFERRY_WRAP_READ_ONLY, &mut read_only),
            CuferryStatus::Ok
        );
    }
    let (writable_list, read_only_list) = ([writable.cast_const()], [read_only.cast_const()]);
    // SAFETY: a live packer and live handles; the memory is read only after the frees below.
    unsafe {
        assert_eq!(cuferry_halo_pack(packer, read_only_list.as_ptr(), 1), CuferryStatus::Ok);
        assert_eq!(cuferry_halo_loopback(packer), CuferryStatus::Ok);
        assert_eq!(cuferry_halo_unpack(packer, read_only_list.as_ptr(), 1), CuferryStatus::InvalidArgument);
        let message = CStr::from_ptr(cuferry_last_error_message()).to_string_lossy().into_owned();
        assert!(message.contains("read-only"), "{message}");
        assert_eq!(cuferry_halo_unpack(packer, writable_list.as_ptr(), 1), CuferryStatus::Ok);
        assert_eq!(cuferry_buffer_free(writable), CuferryStatus::Ok);
        assert_eq!(cuferry_buffer_free(read_only), CuferryStatus::Ok);
        assert_eq!(cuferry_halo_packer_destroy(packer), CuferryStatus::Ok);
    }
    // Elements 0..2 packed from the read-only copy, unpacked into 6..8 of the field.
    assert_eq!(field, [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 0.5, 1.5]);
    assert_eq!(constant, [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5]);
}

/// A C library's pthread key destructor, run at thread exit after Rust's thread-locals are
/// gone, makes a failing call and reads the message.
extern "C" fn failing_cleanup(_: *mut c_void) {
    // SAFETY: NULL is an allowed (and reported) stream.
    let status = unsafe { cuferry_stream_synchronize(ptr::null()) };
    assert_eq!(status, CuferryStatus::InvalidArgument);
    // SAFETY: the function always returns a NUL-terminated string.
    let _ = unsafe { CStr::from_ptr(cuferry_last_error_message()) };
}

#[test]
fn a_failing_call_during_thread_teardown_does_not_abort() {
    // Run in a child process: on the old code the process aborts.
    if std::env::var_os("CUFERRY_TEARDOWN_CHILD").is_some() {
        std::thread::spawn(|| {
            // SAFETY: NULL is an allowed stream; this sets the thread's last error first.
            let _ = unsafe { cuferry_stream_synchronize(ptr::null()) };
            let mut key: libc::pthread_key_t = 0;
            // SAFETY: a fresh key with a destructor that takes any value.
            unsafe {
                assert_eq!(libc::pthread_key_create(&mut key, Some(failing_cleanup)), 0);
                assert_eq!(libc::pthread_setspecific(key, 1 as *const c_void), 0);
            }
        })
        .join()
        .unwrap();
        return;
    }
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["a_failing_call_during_thread_teardown_does_not_abort", "--exact", "--test-threads=1"])
        .env("CUFERRY_TEARDOWN_CHILD", "1")
        .output()
        .unwrap();
    assert!(
        child.status.success(),
        "the child died: {:?}\n{}",
        child.status,
        String::from_utf8_lossy(&child.stderr)
    );
}

/// Garbage ring sizes come back as `CUFERRY_STATUS_INVALID_ARGUMENT`, with `*out` untouched:
/// no abort from a huge thread-handle allocation, no memory exhausted by a huge depth.
#[test]
fn ring_create_refuses_garbage_sizes() {
    let sentinel = 0x1234usize as *mut CuferryRing;
    for (depth, slot_bytes, fill_threads) in [
        (2, 1024, usize::MAX),
        (2, 1024, usize::MAX / 8),
        (2, 1024, 0),
        (usize::MAX, 1024, 1),
        (1 << 20, 1024, 1),
        (4096, usize::MAX / 2, 1),
        (0, 1024, 1),
        // A bad depth with many threads: refused before any thread starts.
        (0, 1024, 1024),
    ] {
        let mut out = sentinel;
        // SAFETY: a writable out-parameter.
        let status = unsafe { cuferry_ring_create(CUFERRY_HOST, depth, slot_bytes, fill_threads, &mut out) };
        assert_eq!(
            status,
            CuferryStatus::InvalidArgument,
            "depth {depth}, {slot_bytes} bytes, {fill_threads} threads"
        );
        assert_eq!(out, sentinel, "cuferry_ring_create wrote *out although it failed");
    }
}

/// A produce whose length is garbage (a negative size from C or Python, or just more than a
/// slot) is refused before any byte is read or any slot is published.
#[test]
fn ring_produce_refuses_garbage_lengths() {
    let mut ring: *mut CuferryRing = ptr::null_mut();
    // SAFETY: a writable out-parameter.
    assert_eq!(unsafe { cuferry_ring_create(CUFERRY_HOST, 2, 1024, 1, &mut ring) }, CuferryStatus::Ok);
    let source = [7u8; 16];
    let sources = [source.as_ptr().cast::<c_void>()];
    for length in [usize::MAX, isize::MAX as usize + 1, 1025] {
        // SAFETY: live handle; one readable sequence, source pointer and length each (the
        // length lies, which is what is tested: it must be refused, not read).
        let status = unsafe { cuferry_ring_produce(ring, &0u64, sources.as_ptr(), &length, 1, 1) };
        assert_eq!(status, CuferryStatus::InvalidArgument, "length {length}");
    }
    let mut stats = CuferryRingStats::default();
    // SAFETY: live handle, writable out-parameter.
    assert_eq!(unsafe { cuferry_ring_stats(ring, &mut stats) }, CuferryStatus::Ok);
    assert_eq!((stats.published, stats.occupancy), (0, 0));
    // SAFETY: live handle, destroyed once.
    assert_eq!(unsafe { cuferry_ring_destroy(ring) }, CuferryStatus::Ok);
}

/// A garbage range count to a batched managed call is refused (INVALID_ARGUMENT), not a
/// capacity-overflow panic or an aborted allocation.
#[test]
fn managed_batches_refuse_garbage_counts() {
    // SAFETY: a plain allocation on the host pool.
    let p = unsafe { cuferry_managed_malloc(64, CUFERRY_HOST, ptr::null_mut()) };
    assert!(!p.is_null());
    let (ptrs, sizes) = ([p.cast_const()], [64usize]);
    let host = CuferryLocation { kind: CUFERRY_LOCATION_HOST, id: 0 };
    for count in [usize::MAX, usize::MAX / 8, 1 << 40, CUFERRY_MANAGED_MAX_BATCH + 1] {
        // SAFETY: the count is refused before the arrays are read.
        let status = unsafe {
            cuferry_managed_prefetch_batch(ptrs.as_ptr(), sizes.as_ptr(), count, host, ptr::null_mut())
        };
        assert_eq!(status, CuferryStatus::InvalidArgument, "count {count}");
    }
    // SAFETY: one valid range.
    let status =
        unsafe { cuferry_managed_prefetch_batch(ptrs.as_ptr(), sizes.as_ptr(), 1, host, ptr::null_mut()) };
    assert_eq!(status, CuferryStatus::Ok);
    // SAFETY: allocated above, no use pending.
    unsafe { cuferry_managed_free(p, 64, CUFERRY_HOST, ptr::null_mut()) };
}

/// Advice and locations CUDA refuses whatever the memory are refused on the host pool too
/// (INVALID_ARGUMENT), so a C program tested without a GPU does not pass code that fails on
/// one: accessed-by naming a NUMA node, a negative NUMA node.
#[test]
fn managed_advice_is_checked_as_cuda_checks_it() {
    // SAFETY: a plain allocation on the host pool.
    let p = unsafe { cuferry_managed_malloc(64, CUFERRY_HOST, ptr::null_mut()) };
    assert!(!p.is_null());
    let numa = |id| CuferryLocation { kind: CUFERRY_LOCATION_HOST_NUMA, id };
    let host = CuferryLocation { kind: CUFERRY_LOCATION_HOST, id: 0 };
    let advise = |advice, location| {
        // SAFETY: the range is the live allocation above.
        unsafe { cuferry_managed_advise(p.cast_const(), 64, advice, location) }
    };
    for advice in [CUFERRY_ADVISE_SET_ACCESSED_BY, CUFERRY_ADVISE_UNSET_ACCESSED_BY] {
        assert_eq!(advise(advice, numa(0)), CuferryStatus::InvalidArgument, "advice {advice}");
        assert_eq!(advise(advice, host), CuferryStatus::Ok, "advice {advice}");
    }
    assert_eq!(advise(CUFERRY_ADVISE_SET_PREFERRED_LOCATION, numa(-1)), CuferryStatus::InvalidArgument);
    assert_eq!(advise(CUFERRY_ADVISE_SET_PREFERRED_LOCATION, numa(0)), CuferryStatus::Ok);
    // SAFETY: the range is the live allocation above.
    let status = unsafe { cuferry_managed_prefetch(p.cast_const(), 64, numa(-1), ptr::null_mut()) };
    assert_eq!(status, CuferryStatus::InvalidArgument);
    // SAFETY: allocated above, no use pending.
    unsafe { cuferry_managed_free(p, 64, CUFERRY_HOST, ptr::null_mut()) };
}

/// The same empty exchange through the C ABI: a zero extent with huge other extents builds a
/// packer (status OK), not a caught overflow panic (debug builds).
#[test]
fn halo_packer_of_a_zero_extent_exchange_is_ok() {
    let mut e = exchange_1d();
    e.ndim = 3;
    e.shape[..3].copy_from_slice(&[1 << 40, 1 << 40, 0]);
    e.strides[..3].copy_from_slice(&[1, 1, 1]);
    e.x_dim = 0;
    e.y_dim = 1;
    e.pack_start = [0; CUFERRY_HALO_MAX_DIMS];
    e.unpack_start = [0; CUFERRY_HALO_MAX_DIMS];
    e.pack_end = e.shape;
    e.unpack_end = e.shape;
    let mut packer: *mut CuferryHaloPacker = ptr::null_mut();
    // SAFETY: one valid exchange and a writable out-parameter.
    let status = unsafe { cuferry_halo_packer_create(CUFERRY_HOST, &e, 1, &mut packer) };
    assert_eq!(status, CuferryStatus::Ok);
    // SAFETY: the packer is live and not used again.
    assert_eq!(unsafe { cuferry_halo_packer_destroy(packer) }, CuferryStatus::Ok);
}

/// `cuferry_stream_cuda_handle` leaves `*out` alone when the stream is NULL, and writes NULL
/// for a host-backend stream (its documented exception), with UNSUPPORTED.
#[test]
fn stream_cuda_handle_writes_only_what_it_documents() {
    let sentinel = 0x1234usize as *mut c_void;
    let mut out = sentinel;
    // SAFETY: a NULL stream on purpose and a writable out-parameter.
    assert_eq!(unsafe { cuferry_stream_cuda_handle(ptr::null(), &mut out) }, CuferryStatus::InvalidArgument);
    assert_eq!(out, sentinel, "cuferry_stream_cuda_handle wrote *out for a NULL stream");
    let mut stream: *mut CuferryStream = ptr::null_mut();
    // SAFETY: a writable out-parameter.
    assert_eq!(unsafe { cuferry_stream_create(CUFERRY_HOST, &mut stream) }, CuferryStatus::Ok);
    // SAFETY: a live stream and a writable out-parameter.
    assert_eq!(unsafe { cuferry_stream_cuda_handle(stream, &mut out) }, CuferryStatus::Unsupported);
    assert!(out.is_null(), "a host stream's handle reads as NULL");
    // SAFETY: the stream is live and not used again.
    assert_eq!(unsafe { cuferry_stream_destroy(stream) }, CuferryStatus::Ok);
}

/// The host wait mode: an unknown mode is refused before the device is looked at, the host
/// backend has none (UNSUPPORTED, `*mode` untouched), and a NULL out-parameter is refused.
#[test]
fn host_wait_refuses_bad_modes_and_the_host_backend() {
    for bad in [3, 5, -1, i32::MAX] {
        assert_eq!(cuferry_device_set_host_wait(0, bad), CuferryStatus::InvalidArgument, "mode {bad}");
    }
    for mode in
        [CUFERRY_HOST_WAIT_AUTO, CUFERRY_HOST_WAIT_SPIN, CUFERRY_HOST_WAIT_YIELD, CUFERRY_HOST_WAIT_BLOCK]
    {
        assert_eq!(cuferry_device_set_host_wait(CUFERRY_HOST, mode), CuferryStatus::Unsupported);
    }
    let mut mode = 77;
    // SAFETY: a writable out-parameter.
    assert_eq!(unsafe { cuferry_device_host_wait(CUFERRY_HOST, &mut mode) }, CuferryStatus::Unsupported);
    assert_eq!(mode, 77, "cuferry_device_host_wait wrote *mode although it failed");
    // SAFETY: NULL on purpose.
    assert_eq!(unsafe { cuferry_device_host_wait(0, ptr::null_mut()) }, CuferryStatus::InvalidArgument);
}

/// `cuferry_managed_free(NULL)` is a no-op, as every `_free` call's NULL is: it leaves the
/// last error message as it was (it used to replace it with "not a live allocation").
#[test]
fn managed_free_of_null_is_a_no_op() {
    let message = || {
        // SAFETY: the message is a NUL-terminated string owned by this thread.
        unsafe { CStr::from_ptr(cuferry_last_error_message()) }.to_string_lossy().into_owned()
    };
    let mut out = ptr::null_mut();
    // SAFETY: `out` is valid for writing; device -5 is refused.
    assert_eq!(unsafe { cuferry_pinned_alloc(-5, 4, &mut out) }, CuferryStatus::InvalidArgument);
    let before = message();
    assert!(before.contains("-5"), "{before}");
    // SAFETY: NULL, which the call documents as a no-op.
    unsafe { cuferry_managed_free(ptr::null_mut(), 0, CUFERRY_HOST, ptr::null_mut()) };
    assert_eq!(message(), before);
}

/// `cuferry_managed_pool_configure` on the host pool: the options it was made with (the
/// defaults here, whether this test or another made it) succeed again, flags are ignored there,
/// and other options once it exists are refused with a message naming the pool. Bad flags and
/// devices are refused before any pool is looked at.
#[test]
fn managed_pool_configure_keeps_the_first_options() {
    let message = || {
        // SAFETY: the message is a NUL-terminated string owned by this thread.
        unsafe { CStr::from_ptr(cuferry_last_error_message()) }.to_string_lossy().into_owned()
    };
    // Other tests of this process make the host pool on first use, with the defaults.
    assert_eq!(cuferry_managed_pool_configure(CUFERRY_HOST, 0, 0), CuferryStatus::Ok);
    let mut kind = -1;
    // SAFETY: a writable out-parameter.
    assert_eq!(unsafe { cuferry_managed_pool_kind(CUFERRY_HOST, &mut kind) }, CuferryStatus::Ok);
    assert_eq!(kind, 0);
    assert_eq!(cuferry_managed_pool_configure(CUFERRY_HOST, 0, 0), CuferryStatus::Ok);
    let all = CUFERRY_MANAGED_POOL_MALLOC_MANAGED | CUFERRY_MANAGED_POOL_NO_PREFERRED_LOCATION;
    assert_eq!(cuferry_managed_pool_configure(CUFERRY_HOST, all, 0), CuferryStatus::Ok, "{}", message());
    assert_eq!(cuferry_managed_pool_configure(CUFERRY_HOST, 0, 1 << 20), CuferryStatus::InvalidArgument);
    let refused = message();
    assert!(refused.contains("already exists") && refused.contains("host memory"), "{refused}");
    assert!(refused.contains("max_size 0") && refused.contains("max_size 1048576"), "{refused}");
    assert_eq!(cuferry_managed_pool_configure(CUFERRY_HOST, 4, 0), CuferryStatus::InvalidArgument);
    assert!(message().contains("CUFERRY_MANAGED_POOL_"), "{}", message());
    for device in [-2, i32::MIN] {
        assert_eq!(cuferry_managed_pool_configure(device, 0, 0), CuferryStatus::InvalidArgument);
    }
}

/// `cuferry_status_name` knows every status of the header's enum by the header's own name (a
/// status added without a name would print as UNKNOWN).
#[test]
fn every_status_of_the_header_has_its_name() {
    let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/cuferry.h")).unwrap();
    let start = header.find("typedef enum CuferryStatus {").expect("the status enum");
    let end = start + header[start..].find("} CuferryStatus;").expect("the enum's end");
    let mut seen = 0;
    for line in header[start..end].lines().map(str::trim) {
        let Some((name, value)) = line.strip_suffix(',').and_then(|l| l.split_once(" = ")) else { continue };
        let value: i32 = value.parse().unwrap();
        // SAFETY: any integer is accepted; the result is a static NUL-terminated string.
        let got = unsafe { CStr::from_ptr(cuferry_status_name(value)) }.to_str().unwrap();
        assert_eq!(got, name, "status {value}");
        seen += 1;
    }
    assert!(seen >= 13, "only {seen} statuses parsed from the header");
}

/// Host memory running out is `CUFERRY_STATUS_OUT_OF_MEMORY` (not UNSUPPORTED, which says a
/// capability is missing), with a message saying how much, and `*out` untouched.
#[test]
fn host_memory_running_out_is_its_own_status() {
    let sentinel = 0x1234usize as *mut CuferryBuffer;
    let mut out = sentinel;
    let bytes = isize::MAX as usize - 4095; // a valid layout no allocator can serve
                                            // SAFETY: a writable out-parameter.
    let status = unsafe { cuferry_pinned_alloc(CUFERRY_HOST, bytes, &mut out) };
    assert_eq!(status, CuferryStatus::OutOfMemory);
    assert_eq!(out, sentinel, "cuferry_pinned_alloc wrote *out although it failed");
    // SAFETY: the message is a NUL-terminated string owned by this thread.
    let message = unsafe { CStr::from_ptr(cuferry_last_error_message()) }.to_string_lossy().into_owned();
    assert!(message.contains("out of memory") && message.contains(&bytes.to_string()), "{message}");
    assert_eq!(cuferry_last_error_status(), CuferryStatus::OutOfMemory);
}

/// `cuferry_last_error_status` is the status of the failure the message describes: OK on a
/// thread that has had none, then each failure's own status (kept across later successes,
/// as the message is), including for `cuferry_managed_malloc`, which returns only NULL, and
/// the mismatch `cuferry_managed_free` reports.
#[test]
fn the_last_error_has_a_status() {
    std::thread::spawn(|| {
        assert_eq!(cuferry_last_error_status(), CuferryStatus::Ok, "a fresh thread has no error");
        let mut out: *mut CuferryBuffer = ptr::null_mut();
        // SAFETY: a writable out-parameter.
        assert_eq!(unsafe { cuferry_pinned_alloc(-7, 16, &mut out) }, CuferryStatus::InvalidArgument);
        assert_eq!(cuferry_last_error_status(), CuferryStatus::InvalidArgument);
        // SAFETY: a writable out-parameter; the buffer is freed once below.
        assert_eq!(unsafe { cuferry_pinned_alloc(CUFERRY_HOST, 16, &mut out) }, CuferryStatus::Ok);
        assert_eq!(cuferry_last_error_status(), CuferryStatus::InvalidArgument, "kept across a success");
        // SAFETY: a live buffer, freed once.
        assert_eq!(unsafe { cuferry_buffer_free(out) }, CuferryStatus::Ok);
        // SAFETY: a plain allocation request on the host pool (4 EiB cannot fit).
        let p = unsafe { cuferry_managed_malloc(1 << 62, CUFERRY_HOST, ptr::null_mut()) };
        assert!(p.is_null());
        assert_eq!(cuferry_last_error_status(), CuferryStatus::OutOfMemory);
        // SAFETY: as above, a size that fits.
        let p = unsafe { cuferry_managed_malloc(64, CUFERRY_HOST, ptr::null_mut()) };
        assert!(!p.is_null());
        // SAFETY: the allocation above, freed once (with a wrong size, which is reported).
        unsafe { cuferry_managed_free(p, 32, CUFERRY_HOST, ptr::null_mut()) };
        assert_eq!(cuferry_last_error_status(), CuferryStatus::InvalidArgument);
    })
    .join()
    .unwrap();
}
