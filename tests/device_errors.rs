//! No driver, no device, bad ordinals and host-only builds are typed errors, never panics.

mod common;

use cuferry::{
    Device, DeviceBuffer, DeviceSpec, Error, Event, HostRegistration, HostWait, PinnedBuffer, Stream,
};

fn is_absence(err: &Error) -> bool {
    matches!(err, Error::NoDriver { .. } | Error::NoDevice { .. } | Error::Unsupported { .. })
}

/// When CI asks for CUDA, the CUDA library must really have been compiled in.
#[test]
fn required_cuda_build_is_real() {
    if std::env::var("CUFERRY_REQUIRE_CUDA").as_deref() == Ok("1") {
        assert!(
            cuferry::cuda_built(),
            "CUFERRY_REQUIRE_CUDA=1 but built without nvcc: {}",
            cuferry::cuda_build_note()
        );
        assert!(cuferry::cuda_runtime_version().unwrap().major >= 13);
    }
    // scripts/test.sh sets this for its build with the toolkit hidden.
    if std::env::var("CUFERRY_EXPECT_HOST_ONLY").as_deref() == Ok("1") {
        assert!(
            !cuferry::cuda_built(),
            "the toolkit was hidden but CUDA got compiled: {}",
            cuferry::cuda_build_note()
        );
    }
    assert!(!cuferry::cuda_build_note().is_empty());
}

#[test]
fn cuda_count_never_fails() {
    let n = Device::cuda_count();
    assert_eq!(n, Device::try_cuda_count().unwrap_or(0));
    if !cuferry::cuda_built() {
        assert!(matches!(Device::try_cuda_count(), Err(Error::Unsupported { .. })));
        assert!(cuferry::cuda_runtime_version().is_err());
    }
}

/// Without a usable device every CUDA constructor reports the absence as a typed error.
#[test]
fn absent_cuda_is_a_typed_error() {
    if Device::cuda_count() > 0 {
        println!("SKIP: a CUDA device is present (this checks machines without one)");
        return;
    }
    let d = Device::Cuda(0);
    let errors = [
        Stream::new(d).err(),
        Event::new(d).err(),
        Event::with_timing(d).err(),
        PinnedBuffer::<u8>::zeroed(d, 16).err(),
        // SAFETY: never read; the allocation is expected to fail.
        unsafe { DeviceBuffer::<u8>::uninit(d, 16) }.err(),
        HostRegistration::new(d, vec![0u8; 16]).err(),
        d.properties().err(),
        d.memory_info().err(),
        d.check_available().err(),
        d.l2_fetch_granularity().err(),
        d.set_l2_fetch_granularity(32).err(),
    ];
    // Peer queries check their devices even when the answer needs no driver (a device and
    // itself, a device and the host).
    let peers = [
        cuferry::can_access_peer(d, d).err(),
        cuferry::can_access_peer(d, Device::Host).err(),
        cuferry::can_access_peer(Device::Host, d).err(),
        cuferry::enable_peer_access(d, d).err(),
        cuferry::enable_peer_access(d, Device::Host).err(),
    ];
    for (i, err) in errors.iter().chain(&peers).enumerate() {
        let err = err.as_ref().unwrap_or_else(|| panic!("call {i} succeeded without a CUDA device"));
        assert!(is_absence(err), "call {i}: expected an absence error, got {err:?}");
        assert!(!err.to_string().is_empty());
    }
    if cuferry::cuda_built() {
        // The runtime is linked statically: its version is known even without a driver.
        assert!(cuferry::cuda_runtime_version().unwrap().major >= 13);
        assert!(matches!(cuferry::cuda_driver_version(), Ok(None) | Ok(Some(_))));
    }
}

#[test]
fn bad_ordinal_is_an_error() {
    let Some(gpu) = common::cuda_device() else { return };
    let bad = Device::Cuda(Device::cuda_count() + 3);
    assert!(matches!(bad.check_available(), Err(Error::InvalidArgument { .. })));
    for (a, b) in [(bad, bad), (bad, Device::Host), (gpu, bad)] {
        let query = cuferry::can_access_peer(a, b);
        assert!(matches!(query, Err(Error::InvalidArgument { .. })), "{a} -> {b}: {query:?}");
        let enable = cuferry::enable_peer_access(a, b);
        assert!(matches!(enable, Err(Error::InvalidArgument { .. })), "{a} -> {b}: {enable:?}");
    }
    assert!(cuferry::can_access_peer(gpu, gpu).unwrap(), "a device reaches its own memory");
    match Stream::new(bad) {
        Err(Error::Cuda { name, .. }) => assert_eq!(name, "cudaErrorInvalidDevice"),
        other => panic!("expected cudaErrorInvalidDevice, got {other:?}"),
    }
    assert!(bad.properties().is_err());
    let props = Device::Cuda(0).properties().unwrap();
    assert!(!props.name.is_empty() && props.total_memory > 0 && props.compute_capability.0 >= 7);
}

#[test]
fn host_device_rules() {
    assert!(Device::Host.check_available().is_ok());
    assert!(matches!(Device::Host.properties(), Err(Error::Unsupported { .. })));
    assert!(matches!(Device::Host.l2_fetch_granularity(), Err(Error::Unsupported { .. })));
    assert!(matches!(Device::Host.set_l2_fetch_granularity(32), Err(Error::Unsupported { .. })));
    assert!(matches!(Device::Host.host_wait(), Err(Error::Unsupported { .. })));
    assert!(matches!(Device::Host.set_host_wait(HostWait::Block), Err(Error::Unsupported { .. })));
    assert!(!cuferry::can_access_peer(Device::Host, Device::Host).unwrap());
    assert!(matches!(
        cuferry::enable_peer_access(Device::Host, Device::Host),
        Err(Error::Unsupported { .. })
    ));
    if Device::cuda_count() > 0 {
        // (Without a device, the CUDA side's absence is reported first: see above.)
        assert!(matches!(
            cuferry::enable_peer_access(Device::Host, Device::Cuda(0)),
            Err(Error::Unsupported { .. })
        ));
    }
    let s = Stream::new(Device::Host).unwrap();
    assert!(DeviceSpec::with_streams(Device::Host, s.clone(), Some(s.clone())).is_ok());
    assert!(matches!(DeviceSpec::with_streams(Device::Cuda(0), s, None), Err(Error::InvalidArgument { .. })));
}

/// The L2 fetch granularity reads back what was asked for (or CUDA's rounding of it, never
/// more than the largest value), out-of-range requests are refused before CUDA sees them and
/// change nothing, and the old value goes back.
#[test]
fn l2_fetch_granularity_is_set_read_back_and_restored() {
    let Some(device) = common::cuda_device() else { return };
    let old = device.l2_fetch_granularity().unwrap();
    assert!(old <= cuferry::MAX_L2_FETCH_GRANULARITY, "granularity {old} above CUDA's range");
    println!("default L2 fetch granularity: {old} bytes");
    let refused = device.set_l2_fetch_granularity(cuferry::MAX_L2_FETCH_GRANULARITY + 1);
    assert!(matches!(refused, Err(Error::InvalidArgument { .. })), "{refused:?}");
    assert_eq!(device.l2_fetch_granularity().unwrap(), old, "a refused request changed the setting");
    let mut applied = 0;
    for bytes in [32, 64, 128] {
        // Put back on drop, a failed assertion included.
        let Some(setting) = common::L2FetchSetting::set(device, bytes) else { continue };
        applied += 1;
        let now = setting.applied;
        assert_eq!(now, device.l2_fetch_granularity().unwrap());
        assert!(now > 0 && now <= cuferry::MAX_L2_FETCH_GRANULARITY, "asked {bytes}, got {now}");
        drop(setting);
        assert_eq!(device.l2_fetch_granularity().unwrap(), old, "the guard put the old value back");
    }
    if applied == 0 {
        // The H100 takes every one of these: refusing all of them there is a lost setting.
        common::skip_missing(&format!("{device} refused every L2 fetch granularity"));
    }
    assert_eq!(device.set_l2_fetch_granularity(old).unwrap(), old);
    let bad = Device::Cuda(Device::cuda_count() + 3);
    assert!(bad.l2_fetch_granularity().is_err());
}

/// Sets a CUDA device's host wait mode for the life of the guard and puts the old one back
/// on drop, panics included (the mode is process-wide).
struct HostWaitSetting {
    device: Device,
    old: HostWait,
}

impl HostWaitSetting {
    fn set(device: Device, wait: HostWait) -> HostWaitSetting {
        let old = device.host_wait().expect("reading the host wait mode");
        device.set_host_wait(wait).expect("setting the host wait mode");
        HostWaitSetting { device, old }
    }
}

impl Drop for HostWaitSetting {
    fn drop(&mut self) {
        if let Err(e) = self.device.set_host_wait(self.old) {
            eprintln!("could not restore the host wait mode of {}: {e}", self.device);
        }
    }
}

/// The calling thread's CPU time.
fn thread_cpu_time() -> std::time::Duration {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid out-pointer; CLOCK_THREAD_CPUTIME_ID exists on Linux.
    assert_eq!(unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) }, 0);
    std::time::Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Waits `hold` behind a gate, in `Stream::synchronize` or (`on_event`) in
/// `Event::synchronize` on an event made and recorded after the gate; returns (wall, this
/// thread's CPU).
fn timed_wait(
    device: Device,
    hold: std::time::Duration,
    on_event: bool,
) -> (std::time::Duration, std::time::Duration) {
    let stream = Stream::new(device).unwrap();
    let gate = std::sync::Arc::new(common::Gate::hold(&stream));
    let event = Event::new(device).unwrap();
    event.record(&stream).unwrap();
    let opener = std::sync::Arc::clone(&gate);
    let opening = std::thread::spawn(move || {
        std::thread::sleep(hold);
        opener.open();
    });
    let (wall, cpu) = (std::time::Instant::now(), thread_cpu_time());
    if on_event {
        event.synchronize().unwrap();
    } else {
        stream.synchronize().unwrap();
    }
    let waited = (wall.elapsed(), thread_cpu_time() - cpu);
    opening.join().unwrap();
    assert!(gate.passed());
    waited
}

/// Every mode reads back as set, and the old one goes back. Under `HostWait::Block` a thread
/// waiting in `Stream::synchronize`, or in `Event::synchronize` on an event made under it,
/// spends next to no CPU time: this checks that the mode reaches a context already in use,
/// not only one created afterwards. (Spin's figure is
/// printed for comparison, not asserted: a loaded host may deschedule a spinning thread.)
#[test]
fn host_wait_is_set_read_back_and_blocks_waiters() {
    let Some(device) = common::cuda_device() else { return };
    // A context in use before the mode changes.
    Stream::new(device).unwrap().synchronize().unwrap();
    let old = device.host_wait().unwrap();
    println!("default host wait mode: {old}");
    for wait in [HostWait::Spin, HostWait::Yield, HostWait::Block, HostWait::Auto] {
        let setting = HostWaitSetting::set(device, wait);
        assert_eq!(device.host_wait().unwrap(), wait);
        drop(setting);
        assert_eq!(device.host_wait().unwrap(), old, "the guard put the old mode back");
    }
    let hold = std::time::Duration::from_millis(300);
    // A stream's wait, then an event's (CUDA spins in an event's wait unless the event was
    // made blocking: the events made under Block must be).
    for on_event in [false, true] {
        let what = if on_event { "Event::synchronize" } else { "Stream::synchronize" };
        let spin = {
            let _setting = HostWaitSetting::set(device, HostWait::Spin);
            timed_wait(device, hold, on_event)
        };
        let block = {
            let _setting = HostWaitSetting::set(device, HostWait::Block);
            timed_wait(device, hold, on_event)
        };
        println!(
            "{what}, waiting {hold:?}: spin {:?} CPU in {:?}, block {:?} CPU in {:?}",
            spin.1, spin.0, block.1, block.0
        );
        assert!(block.0 >= hold / 2, "{what}: the wait ended before the gate opened: {:?}", block.0);
        // Not a speed assert: the documented behaviour is that a blocking waiter sleeps. A
        // spinning one burns the whole hold on the CPU (see `spin` above); half is the line.
        assert!(
            block.1 < block.0 / 2,
            "{what}: a blocked waiter spent {:?} of CPU in {:?}",
            block.1,
            block.0
        );
    }
    let bad = Device::Cuda(Device::cuda_count() + 3);
    assert!(bad.host_wait().is_err() && bad.set_host_wait(HostWait::Block).is_err());
}

/// Set by gpu-bundle/run.sh's sanitizer steps: the fault child below faults on purpose.
const UNDER_SANITIZER: &str = "CUFERRY_UNDER_SANITIZER";
/// Tells `device_fault_child` that the parent test started it.
const FAULT_CHILD: &str = "CUFERRY_FAULT_CHILD";

/// A host function queued before a device fault is still released exactly once: CUDA calls it
/// back with the error (cudaStreamAddCallback), the closure is dropped unrun, so what it owns is
/// freed. The fault poisons the CUDA context for good, so it happens in a child process.
#[test]
fn host_fn_queued_before_a_device_fault_is_released() {
    let Some(_) = common::cuda_device() else { return };
    if std::env::var(UNDER_SANITIZER).as_deref() == Ok("1") {
        println!("SKIP: the child faults on purpose, which a sanitizer reports");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args(["--ignored", "--exact", "device_fault_child", "--nocapture", "--test-threads=1"])
        .env(FAULT_CHILD, "1")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the fault child failed:\n{text}");
    assert!(text.contains("device_fault_child: released once"), "the child did not run its checks:\n{text}");
}

/// The child of `host_fn_queued_before_a_device_fault_is_released`; does nothing on its own.
#[test]
#[ignore = "run by host_fn_queued_before_a_device_fault_is_released in its own process"]
fn device_fault_child() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    struct DropCount(Arc<AtomicUsize>);
    impl Drop for DropCount {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    if std::env::var(FAULT_CHILD).as_deref() != Ok("1") {
        println!("SKIP: started by host_fn_queued_before_a_device_fault_is_released only");
        return;
    }
    let stream = Stream::new(Device::Cuda(0)).unwrap();
    // Hold the stream in a host function until the fault has happened, so the next host
    // function is queued before it and called after it.
    let (release, gate) = std::sync::mpsc::channel::<()>();
    stream.host_fn(move || _ = gate.recv_timeout(Duration::from_secs(10))).unwrap();
    let (ran, drops) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
    let (r, guard) = (Arc::clone(&ran), DropCount(Arc::clone(&drops)));
    stream
        .host_fn(move || {
            let _guard = guard;
            r.store(true, Ordering::SeqCst);
        })
        .unwrap();

    // Fault on a second stream: a kernel writing through a pointer no allocation owns.
    let mut raw: cuferry::sys::cuferry_stream = std::ptr::null_mut();
    // SAFETY: `raw` is a valid out-pointer.
    assert_eq!(unsafe { cuferry::sys::cuferry_cuda_stream_create(0, 0, &mut raw) }, 0);
    let wild = 0x1000 as *mut u32;
    // SAFETY: not sound on purpose: the kernel faults on the device, which is what this tests;
    // the host never touches `wild`.
    let launched = unsafe { cuferry::sys::cuferry_cuda_fill_pattern_u32(wild, 1 << 20, 1, raw) };
    assert_eq!(launched, 0, "the faulting kernel did not launch");
    // SAFETY: `raw` is live.
    let faulted = unsafe { cuferry::sys::cuferry_cuda_stream_synchronize(raw) };
    assert_ne!(faulted, 0, "writing through {wild:?} did not fault");
    release.send(()).unwrap();

    assert!(stream.synchronize().is_err(), "the stream must report the context's fault");
    let deadline = Instant::now() + Duration::from_secs(10);
    while drops.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(drops.load(Ordering::SeqCst), 1, "the queued closure was never released");
    println!(
        "device_fault_child: released once (fault status {faulted}, ran: {})",
        ran.load(Ordering::SeqCst)
    );
}

/// A failure another library left in the thread's last CUDA error is neither reported as the
/// failure of a cuferry kernel launch nor cleared by it: launches return their own status
/// (cudaLaunchKernelEx), where `<<<>>>` followed by cudaGetLastError took the foreign error.
#[cfg(cuferry_cuda)]
#[test]
fn a_foreign_last_error_is_not_taken_for_a_launch_failure() {
    use cuferry::kernels::{fill_pattern_u32, pattern_value, sum_u32};

    extern "C" {
        // The CUDA runtime linked into cuferry (cudart_static), called as another library would.
        fn cudaSetDevice(device: i32) -> i32;
    }
    let Some(device) = common::cuda_device() else { return };
    let stream = Stream::new(device).unwrap();
    let mut buf = DeviceBuffer::<u32>::zeroed(&stream, 5000).unwrap();
    // SAFETY: a runtime call with an invalid ordinal: it fails and sets this thread's last
    // error (cudaErrorInvalidDevice), changing nothing else.
    let foreign = unsafe { cudaSetDevice(-1) };
    assert_ne!(foreign, 0, "cudaSetDevice(-1) succeeded");
    fill_pattern_u32(&stream, &mut buf, 9).expect("the launch took the foreign error for its own");
    let want: u64 = (0..5000).map(|i| u64::from(pattern_value(9, i))).sum();
    assert_eq!(sum_u32(&stream, &buf).unwrap(), want);
    // SAFETY: reads and clears this thread's last error; no arguments.
    let left = unsafe { cuferry::sys::cuferry_cuda_take_last_error() };
    assert_eq!(left, foreign, "the foreign error was cleared (or replaced) by cuferry's launches");
}
