//! No driver, no device, bad ordinals and host-only builds are typed errors, never panics.

mod common;

use cuferry::{Device, DeviceBuffer, DeviceSpec, Error, Event, HostRegistration, PinnedBuffer, Stream};

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
    ];
    for (i, err) in errors.iter().enumerate() {
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
    let Some(_) = common::cuda_device() else { return };
    let bad = Device::Cuda(Device::cuda_count() + 3);
    assert!(matches!(bad.check_available(), Err(Error::InvalidArgument { .. })));
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
    assert!(!cuferry::can_access_peer(Device::Host, Device::Host).unwrap());
    assert!(matches!(
        cuferry::enable_peer_access(Device::Host, Device::Cuda(0)),
        Err(Error::Unsupported { .. })
    ));
    let s = Stream::new(Device::Host).unwrap();
    assert!(DeviceSpec::with_streams(Device::Host, s.clone(), Some(s.clone())).is_ok());
    assert!(matches!(DeviceSpec::with_streams(Device::Cuda(0), s, None), Err(Error::InvalidArgument { .. })));
}
