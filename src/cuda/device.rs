//! Device queries, versions and peer access (runtime.cu).

use super::{check, ordinal};
use crate::error::Result;
use crate::sys;

/// `cudaRuntimeGetVersion`.
pub(crate) fn runtime_version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: `v` is a valid out-pointer for the duration of the call.
    check("cudaRuntimeGetVersion", unsafe { sys::cuferry_cuda_runtime_version(&mut v) })?;
    Ok(v)
}

/// `cudaDriverGetVersion`: 0 when no driver is installed.
pub(crate) fn driver_version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: `v` is a valid out-pointer for the duration of the call.
    check("cudaDriverGetVersion", unsafe { sys::cuferry_cuda_driver_version(&mut v) })?;
    Ok(v)
}

/// `cudaGetDeviceCount`.
pub(crate) fn count() -> Result<u32> {
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer for the duration of the call.
    check("cudaGetDeviceCount", unsafe { sys::cuferry_cuda_device_count(&mut n) })?;
    Ok(u32::try_from(n).unwrap_or(0))
}

/// `cudaGetDeviceProperties` plus the attributes cuferry reports.
pub(crate) fn properties(device: u32) -> Result<sys::cuferry_device_props> {
    let dev = ordinal(device)?;
    let mut props = std::mem::MaybeUninit::<sys::cuferry_device_props>::zeroed();
    // SAFETY: `props` points to writable memory of the struct's size; the call writes it whole
    // on success only.
    check("cudaGetDeviceProperties", unsafe {
        sys::cuferry_cuda_device_properties(dev, props.as_mut_ptr())
    })?;
    // SAFETY: zero-initialised plain C data (ints and a char array) is a valid value, and the
    // successful call filled it.
    Ok(unsafe { props.assume_init() })
}

/// Whether `device` has `concurrentManagedAccess`, from [`properties`], cached per device for
/// the first 64 devices (the answer never changes while the process runs).
pub(crate) fn concurrent_managed_access(device: u32) -> Result<bool> {
    const CACHED: usize = 64;
    static CACHE: [std::sync::OnceLock<bool>; CACHED] = [const { std::sync::OnceLock::new() }; CACHED];
    let lookup = || properties(device).map(|p| p.concurrent_managed_access != 0);
    match CACHE.get(device as usize) {
        Some(cell) => match cell.get() {
            Some(&v) => Ok(v),
            None => {
                let v = lookup()?;
                Ok(*cell.get_or_init(|| v))
            }
        },
        None => lookup(),
    }
}

/// `cudaMemGetInfo`: (free, total) bytes.
pub(crate) fn mem_info(device: u32) -> Result<(usize, usize)> {
    let dev = ordinal(device)?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both out-pointers are valid for the duration of the call.
    check("cudaMemGetInfo", unsafe { sys::cuferry_cuda_device_mem_info(dev, &mut free, &mut total) })?;
    Ok((free, total))
}

/// `cudaDeviceCanAccessPeer`.
pub(crate) fn can_access_peer(device: u32, peer: u32) -> Result<bool> {
    let (dev, peer) = (ordinal(device)?, ordinal(peer)?);
    let mut v = 0;
    // SAFETY: `v` is a valid out-pointer for the duration of the call.
    check("cudaDeviceCanAccessPeer", unsafe { sys::cuferry_cuda_device_can_access_peer(dev, peer, &mut v) })?;
    Ok(v != 0)
}

/// `cudaDeviceEnablePeerAccess`; already enabled counts as success.
pub(crate) fn enable_peer_access(device: u32, peer: u32) -> Result<()> {
    let (dev, peer) = (ordinal(device)?, ordinal(peer)?);
    // SAFETY: plain integer arguments.
    check("cudaDeviceEnablePeerAccess", unsafe { sys::cuferry_cuda_device_enable_peer_access(dev, peer) })
}

/// `cudaDeviceSynchronize` on `device`: every queued operation of every stream has run.
pub(crate) fn synchronize(device: u32) -> Result<()> {
    let dev = ordinal(device)?;
    // SAFETY: plain value arguments.
    check("cudaDeviceSynchronize", unsafe { sys::cuferry_cuda_device_synchronize(dev) })
}

/// Makes `device` current on the calling thread (`cudaSetDevice`), before CUDA calls that would
/// otherwise run with no current device and so create a context on device 0: on cuferry's own
/// threads (the reaper, host-stream workers) and, by the device rule that cuferry leaves its
/// device current, on the user's thread when it drops or releases CUDA memory.
pub(crate) fn make_current(device: u32) -> Result<()> {
    let dev = ordinal(device)?;
    // SAFETY: a plain value argument.
    check("cudaSetDevice", unsafe { sys::cuferry_cuda_set_device(dev) })
}

/// Makes `device` current only when the calling thread has no current context, before a
/// CUDA call on an object of `device` (an event's query, wait or destroy) that may run on a
/// thread that never chose a device: a host stream's worker, the reaper, a user's new thread
/// dropping host memory that CUDA streams used. There the runtime would otherwise create a
/// context on device 0, about 500 MiB of a GPU the process may never use. A thread with a
/// current context keeps it: the caller's device choice is not changed.
pub(crate) fn ensure_context(device: u32) -> Result<()> {
    if thread_has_context()? {
        return Ok(());
    }
    make_current(device)
}

/// The lowest device whose primary context is active, if any (asking creates none).
pub(crate) fn active_device() -> Result<Option<u32>> {
    let mut device = -1;
    // SAFETY: `device` is a valid out-pointer.
    check("cuDevicePrimaryCtxGetState", unsafe { sys::cuferry_cuda_active_device(&mut device) })?;
    Ok(u32::try_from(device).ok())
}

/// Before a CUDA call whose device is not known yet (a pointer probe, which needs a context
/// and finds out the memory's device): on a thread with no context, makes current a device
/// whose primary context is already active, so that the call creates none on device 0. With
/// none active (or the state unreadable) it does nothing: the call then creates device 0's,
/// as it would have. A thread with a context keeps it.
pub(crate) fn ensure_some_context() -> Result<()> {
    if thread_has_context()? {
        return Ok(());
    }
    match active_device()? {
        Some(device) => make_current(device),
        None => Ok(()),
    }
}

/// The calling thread's current device, made current again when dropped (for C entry points
/// that other libraries call implicitly, such as PyTorch's allocator pair, whose callers
/// rely on their current device: cuferry's own calls may make another device current).
pub(crate) struct DeviceScope {
    restore: Option<i32>,
}

impl DeviceScope {
    /// Makes `device` current for the scope (no call when it already is). A thread that had
    /// no current context keeps `device` current after the scope: `cudaGetDevice` answered 0
    /// there, and making 0 current again would create device 0's context, which a process
    /// using only other GPUs never asked for.
    pub(crate) fn enter(device: u32) -> Result<Self> {
        let dev = ordinal(device)?;
        let mut current = 0;
        // SAFETY: `current` is a valid out-pointer.
        check("cudaGetDevice", unsafe { sys::cuferry_cuda_get_device(&mut current) })?;
        if current == dev {
            return Ok(DeviceScope { restore: None });
        }
        // Unknown (the lookup failed): restore, as before the check existed.
        let had_context = thread_has_context().unwrap_or(true);
        make_current(device)?;
        Ok(DeviceScope { restore: had_context.then_some(current) })
    }
}

/// Whether the calling thread has a current CUDA context (asking creates none).
pub(crate) fn thread_has_context() -> Result<bool> {
    let mut has = 0;
    // SAFETY: `has` is a valid out-pointer.
    check("cuCtxGetCurrent", unsafe { sys::cuferry_cuda_thread_has_context(&mut has) })?;
    Ok(has != 0)
}

impl Drop for DeviceScope {
    fn drop(&mut self) {
        if let Some(device) = self.restore {
            // SAFETY: a plain value argument. A failure leaves the scope's device current;
            // it is recorded for `take_drop_error` (a drop cannot return it).
            if let Err(err) = check("cudaSetDevice", unsafe { sys::cuferry_cuda_set_device(device) }) {
                crate::error::record_drop_error(err);
            }
        }
    }
}

/// `cudaDeviceGetLimit(cudaLimitMaxL2FetchGranularity)` on `device`, in bytes.
pub(crate) fn l2_fetch_granularity(device: u32) -> Result<usize> {
    let dev = ordinal(device)?;
    let mut bytes = 0usize;
    // SAFETY: `bytes` is a valid out-pointer for the duration of the call.
    check("cudaDeviceGetLimit", unsafe {
        sys::cuferry_cuda_device_get_l2_fetch_granularity(dev, &mut bytes)
    })?;
    Ok(bytes)
}

/// `cudaDeviceSetLimit(cudaLimitMaxL2FetchGranularity, bytes)` on `device`.
pub(crate) fn set_l2_fetch_granularity(device: u32, bytes: usize) -> Result<()> {
    let dev = ordinal(device)?;
    // SAFETY: plain value arguments.
    check("cudaDeviceSetLimit", unsafe { sys::cuferry_cuda_device_set_l2_fetch_granularity(dev, bytes) })
}

/// `cudaGetDeviceFlags & cudaDeviceScheduleMask` on `device`: a `CUFERRY_HOST_WAIT_*` value.
pub(crate) fn host_wait(device: u32) -> Result<u32> {
    let dev = ordinal(device)?;
    let mut schedule = 0u32;
    // SAFETY: `schedule` is a valid out-pointer for the duration of the call.
    check("cudaGetDeviceFlags", unsafe { sys::cuferry_cuda_device_get_host_wait(dev, &mut schedule) })?;
    Ok(schedule)
}

/// `cudaSetDeviceFlags` on `device` with the scheduling bits `schedule` (a
/// `CUFERRY_HOST_WAIT_*` value).
pub(crate) fn set_host_wait(device: u32, schedule: u32) -> Result<()> {
    let dev = ordinal(device)?;
    // SAFETY: plain value arguments.
    check("cudaSetDeviceFlags", unsafe { sys::cuferry_cuda_device_set_host_wait(dev, schedule) })
}

/// The CUDA device count, or `None` after printing SKIP when there is none (failing
/// instead under `CUFERRY_REQUIRE_GPU=1`): for unit tests that need a device.
#[cfg(test)]
pub(crate) fn devices_or_skip() -> Option<u32> {
    let devices = count().unwrap_or(0);
    if devices == 0 {
        assert!(
            std::env::var("CUFERRY_REQUIRE_GPU").as_deref() != Ok("1"),
            "CUFERRY_REQUIRE_GPU=1 but no CUDA device is usable"
        );
        println!("SKIP: no CUDA device");
        return None;
    }
    Some(devices)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new thread has no current context, and asking makes none; making a device current
    /// gives it one. A scope entered there leaves its device current instead of setting device
    /// 0 back (which would create device 0's context). Without a usable device the question
    /// fails or answers no, never panics. The GPU part is compiled, not run without a GPU.
    #[test]
    fn a_new_thread_has_no_context_and_a_scope_does_not_restore_one() {
        let devices = count().unwrap_or(0);
        std::thread::spawn(move || {
            let before = thread_has_context();
            if devices == 0 {
                assert!(matches!(before, Err(_) | Ok(false)), "{before:?}");
                // Fails here under CUFERRY_REQUIRE_GPU=1: the GPU part below did not run.
                devices_or_skip();
                return;
            }
            assert_eq!(before, Ok(false), "a new thread had a context, or asking made one");
            assert_eq!(thread_has_context(), Ok(false), "asking made a context");
            if devices >= 2 {
                // cudaGetDevice answers 0 here: a scope for device 1 must not set 0 back.
                let scope = DeviceScope::enter(1).unwrap();
                assert!(scope.restore.is_none(), "a scope would set device 0 back on a thread that had none");
            } else {
                make_current(0).unwrap();
            }
            assert_eq!(thread_has_context(), Ok(true));
        })
        .join()
        .unwrap();
    }

    fn current_device() -> i32 {
        let mut current = -1;
        // SAFETY: `current` is a valid out-pointer.
        check("cudaGetDevice", unsafe { sys::cuferry_cuda_get_device(&mut current) }).unwrap();
        current
    }

    /// A CUDA event queried, waited on and timed (and a CUDA stream waited on) on a thread
    /// that chose no device makes its own device current there (so that no context is
    /// created on device 0); a thread that chose a device keeps it. The event is of the last
    /// device, so only a machine with two GPUs tells the two apart. Compiled, not run without a GPU.
    #[test]
    fn event_calls_on_a_thread_without_a_device_use_the_events_device() {
        let Some(devices) = devices_or_skip() else { return };
        let last = devices - 1;
        let device = crate::Device::Cuda(last);
        let stream = crate::Stream::new(device).unwrap();
        let (start, end) =
            (crate::Event::with_timing(device).unwrap(), crate::Event::with_timing(device).unwrap());
        start.record(&stream).unwrap();
        end.record(&stream).unwrap();
        let events = std::sync::Arc::new((start, end));
        let shared = std::sync::Arc::clone(&events);
        std::thread::spawn(move || {
            assert_eq!(thread_has_context(), Ok(false));
            shared.1.synchronize().unwrap();
            assert_eq!(thread_has_context(), Ok(true));
            assert_eq!(current_device(), last as i32, "the wait made another device current");
            assert!(shared.0.query().unwrap());
            assert!(shared.0.elapsed_ms(&shared.1).unwrap() >= 0.0);
            assert_eq!(current_device(), last as i32);
        })
        .join()
        .unwrap();
        let queue = stream.clone();
        std::thread::spawn(move || {
            assert_eq!(thread_has_context(), Ok(false));
            queue.synchronize().unwrap();
            assert_eq!(current_device(), last as i32, "a stream's wait made another device current");
            assert!(queue.query().unwrap());
        })
        .join()
        .unwrap();
        if devices >= 2 {
            std::thread::spawn(move || {
                make_current(0).unwrap();
                assert!(events.1.query().unwrap());
                drop(events);
                assert_eq!(current_device(), 0, "an event call changed a chosen device");
            })
            .join()
            .unwrap();
        }
    }

    /// Work queued on a CUDA stream from a thread that chose no device (a copy, an event
    /// record and wait, a host function, a kernel) makes the stream's device current there
    /// first, each on a fresh thread; a pointer probe's `ensure_some_context` takes an already
    /// active device's context, and asking which one is active creates none. The stream is of
    /// the last device, so only a machine with two GPUs tells device 0 apart. Compiled, not
    /// run without a GPU.
    #[test]
    fn work_queued_from_a_thread_without_a_device_uses_the_streams_device() {
        let Some(devices) = devices_or_skip() else { return };
        let last = devices - 1;
        let device = crate::Device::Cuda(last);
        let stream = crate::Stream::new(device).unwrap();
        let src = crate::PinnedBuffer::<u32>::zeroed(device, 1024).unwrap();
        let dst = std::sync::Mutex::new(crate::DeviceBuffer::<u32>::zeroed(&stream, 1024).unwrap());
        let event = crate::Event::new(device).unwrap();
        let on_a_fresh_thread = |what: &str, work: &(dyn Fn() + Sync)| {
            std::thread::scope(|s| {
                s.spawn(|| {
                    assert_eq!(thread_has_context(), Ok(false), "{what}: a new thread had a context");
                    work();
                    assert_eq!(current_device(), last as i32, "{what} made another device current");
                });
            });
        };
        on_a_fresh_thread("a copy", &|| {
            crate::copy(&stream, &src, &mut *dst.lock().unwrap()).unwrap();
        });
        on_a_fresh_thread("an event record", &|| event.record(&stream).unwrap());
        on_a_fresh_thread("an event wait", &|| stream.wait_event(&event).unwrap());
        on_a_fresh_thread("a host function", &|| stream.host_fn(|| ()).unwrap());
        on_a_fresh_thread("a kernel", &|| {
            crate::kernels::fill_pattern_u32(&stream, &mut *dst.lock().unwrap(), 7).unwrap();
        });
        stream.synchronize().unwrap();
        let active = active_device().unwrap();
        assert!(active.is_some_and(|d| d < devices), "{active:?}: the stream's device is in use");
        std::thread::spawn(move || {
            // Other tests may make a lower device active meanwhile: some device is, still.
            assert!(active_device().unwrap().is_some_and(|d| d < devices));
            assert_eq!(thread_has_context(), Ok(false), "asking which device is active made a context");
            ensure_some_context().unwrap();
            assert_eq!(thread_has_context(), Ok(true));
            assert!((current_device() as u32) < devices);
        })
        .join()
        .unwrap();
    }
}
