//! Thin checked wrappers over the C ABI in `crate::sys`: one function per C call, grouped by
//! API area, each returning [`Result`].
//!
//! Rules:
//! - This layer and `sys` are the only places that touch raw CUDA handles; the capability
//!   modules above hold them in RAII types.
//! - A status is turned into an [`Error`] here, with the CUDA call's name and CUDA's error name
//!   read right away (static cudart, no driver needed).
//! - Handles are plain copyable wrappers; who destroys them is the caller's business (the RAII
//!   types do it in `Drop`).

pub(crate) mod device;
pub(crate) mod event;
pub(crate) mod halo;
pub(crate) mod linop;
pub(crate) mod managed;
pub(crate) mod memory;
pub(crate) mod stream;

use std::ffi::CStr;

use crate::error::{Error, Result};
use crate::sys;

/// Why CUDA calls fail in a build without nvcc.
pub(crate) const NOT_BUILT_REASON: &str = env!("CUFERRY_BUILD_CUDA_NOTE");

/// Whether the CUDA library was compiled in (nvcc was found at build time).
pub(crate) const fn is_built() -> bool {
    cfg!(cuferry_cuda)
}

/// Turns a C ABI status into a `Result`, naming `call` in the error.
pub(crate) fn check(call: &'static str, status: sys::cuferry_status) -> Result<()> {
    match status {
        sys::CUFERRY_STATUS_SUCCESS => Ok(()),
        sys::CUFERRY_STATUS_NOT_BUILT => Err(Error::unsupported(format!(
            "{call}: CUDA is not available in this build ({NOT_BUILT_REASON})"
        ))),
        // cuferry's own checks of the arguments, not CUDA failures.
        sys::CUFERRY_STATUS_NULL_ARGUMENT | sys::CUFERRY_STATUS_BAD_ENUM => {
            Err(Error::invalid(format!("{call}: {} ({status})", status_name(status))))
        }
        sys::CUFERRY_CUDA_INSUFFICIENT_DRIVER => Err(Error::NoDriver { call }),
        sys::CUFERRY_CUDA_NO_DEVICE => Err(Error::NoDevice { call }),
        code => Err(Error::Cuda { call, code, name: status_name(code), description: status_string(code) }),
    }
}

/// Like [`check`], but `Ok(false)` for CUDA's "not ready" (queries).
pub(crate) fn check_ready(call: &'static str, status: sys::cuferry_status) -> Result<bool> {
    if status == sys::CUFERRY_CUDA_NOT_READY {
        return Ok(false);
    }
    check(call, status).map(|()| true)
}

fn static_str(ptr: *const std::os::raw::c_char) -> &'static str {
    if ptr.is_null() {
        return "unknown";
    }
    // SAFETY: the C ABI returns pointers to static NUL-terminated strings (cudaGetErrorName and
    // string literals), never freed, so a 'static borrow is valid.
    let cstr = unsafe { CStr::from_ptr(ptr) };
    cstr.to_str().unwrap_or("non-UTF-8 CUDA error name")
}

/// CUDA's name for a status code.
pub(crate) fn status_name(status: sys::cuferry_status) -> &'static str {
    // SAFETY: takes a plain integer and returns a static string (see cuferry_cuda.h).
    static_str(unsafe { sys::cuferry_cuda_status_name(status) })
}

/// CUDA's description of a status code.
pub(crate) fn status_string(status: sys::cuferry_status) -> &'static str {
    // SAFETY: takes a plain integer and returns a static string (see cuferry_cuda.h).
    static_str(unsafe { sys::cuferry_cuda_status_string(status) })
}

/// Converts a device ordinal to the C ABI's `int32_t`.
pub(crate) fn ordinal(ordinal: u32) -> Result<i32> {
    i32::try_from(ordinal).map_err(|_| Error::invalid(format!("device ordinal {ordinal} is too large")))
}
