//! The crate's one error type.
//!
//! Rules:
//! - Every fallible function returns [`Result`]; nothing panics on bad input.
//! - A failed CUDA call becomes [`Error::Cuda`] carrying the call's name and the CUDA error name,
//!   read from static cudart at the failure site, so `Display` never calls CUDA. CUDA errors 35
//!   (insufficient driver) and 100 (no device) become [`Error::NoDriver`] and
//!   [`Error::NoDevice`]; a build without nvcc reports [`Error::Unsupported`].
//! - Memory running out is recognisable without reading messages: [`Error::is_out_of_memory`]
//!   is true for CUDA's out-of-memory ([`Error::Cuda`] with `cudaErrorMemoryAllocation`) and
//!   for [`Error::OutOfMemory`] (host memory, or a pool's own size limit).
//! - `Drop` never panics. A failure while freeing is kept (the first one) and handed back by
//!   [`take_drop_error`] and by the next [`Stream::synchronize`](crate::Stream::synchronize).

use std::sync::Mutex;

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in cuferry.
///
/// New kinds of failure may be added, so a `match` needs a wildcard arm.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A CUDA runtime call failed.
    #[error("{call} failed with {name} ({code}): {description}")]
    Cuda {
        /// The CUDA (or cuferry C ABI) call that failed, e.g. `cudaMalloc`.
        call: &'static str,
        /// The numeric `cudaError_t`.
        code: i32,
        /// CUDA's name for the code, e.g. `cudaErrorMemoryAllocation`.
        name: &'static str,
        /// CUDA's description of the code.
        description: &'static str,
    },
    /// No NVIDIA driver is loaded, or it is older than the CUDA runtime cuferry was built with.
    #[error("{call}: no usable NVIDIA driver (cudaErrorInsufficientDriver)")]
    NoDriver {
        /// The call that found out.
        call: &'static str,
    },
    /// The driver is there but reports no CUDA device.
    #[error("{call}: no CUDA device is present (cudaErrorNoDevice)")]
    NoDevice {
        /// The call that found out.
        call: &'static str,
    },
    /// The operation is not available here: CUDA not compiled in, a device capability missing,
    /// or a backend that cannot do it.
    #[error("unsupported: {what}")]
    Unsupported {
        /// What is missing, naming the capability or build setting.
        what: String,
    },
    /// An allocation did not fit: host memory ran out (the host backend's buffers, host slots
    /// and managed memory), a managed pool reached the size limit it was made with, or the
    /// system had no resources left for a worker thread. CUDA's own out-of-memory stays
    /// [`Error::Cuda`], naming its call; [`Error::is_out_of_memory`] recognises both.
    #[error("out of memory: {what}")]
    OutOfMemory {
        /// What was being allocated, and how much.
        what: String,
    },
    /// An argument was rejected before any work was queued.
    #[error("invalid argument: {what}")]
    InvalidArgument {
        /// What was wrong with it.
        what: String,
    },
    /// A host function queued on a stream panicked; the stream kept running.
    #[error("a host function on a stream panicked: {message}")]
    HostFnPanicked {
        /// The panic message, when it was a string.
        message: String,
    },
    /// A non-blocking call found nothing to take right now (no free slot, nothing ready); try
    /// again later.
    #[error("would block: {what}")]
    WouldBlock {
        /// What was not available.
        what: &'static str,
    },
    /// A blocking call with a deadline gave up.
    #[error("timed out after {waited:?}: {what}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// How long it waited.
        waited: std::time::Duration,
    },
    /// The object was closed; with the error that closed it, when one did.
    #[error("closed{}", match reason { Some(r) => format!(" by an error: {r}"), None => String::new() })]
    Closed {
        /// The error that closed it, if it was closed by a failure rather than on purpose.
        reason: Option<Box<Error>>,
    },
    /// An MPI call failed (feature `mpi`).
    #[error("{call} failed with MPI error class {class}: {message}")]
    Mpi {
        /// The MPI function.
        call: &'static str,
        /// The MPI error class (`MPI_Error_class` of the returned code).
        class: i32,
        /// The library's description of the error.
        message: String,
    },
    /// Another process of a collective operation failed or reported a failure (feature
    /// `mpi`): this process stopped waiting for it instead of hanging.
    #[error("rank {rank} failed: {what}")]
    PeerFailed {
        /// The rank that failed (its rank in the communicator of the operation).
        rank: i32,
        /// What it reported, or what was seen of it.
        what: String,
    },
    /// Freeing a resource in `Drop` failed earlier; reported at the next checked call.
    #[error("an earlier drop failed: {0}")]
    DropFailed(Box<Error>),
}

impl Error {
    /// Whether this is an allocation failing for lack of memory: [`Error::OutOfMemory`], or a
    /// CUDA allocation refused with `cudaErrorMemoryAllocation` (device memory, pinned host
    /// memory, a memory pool at its limit). Where memory ran out, cuferry freed its own cached
    /// memory and tried again before returning either, so what helps now is freeing the
    /// caller's; a managed pool at the size limit it was made with fails at once.
    ///
    /// # Examples
    ///
    /// ```
    /// use cuferry::Error;
    ///
    /// assert!(Error::OutOfMemory { what: "4 GiB of host slots".into() }.is_out_of_memory());
    /// assert!(!Error::InvalidArgument { what: "zero-length slot".into() }.is_out_of_memory());
    /// ```
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::OutOfMemory { .. } => true,
            Error::Cuda { code, .. } => *code == CUDA_ERROR_MEMORY_ALLOCATION,
            _ => false,
        }
    }

    /// Shorthand for [`Error::InvalidArgument`].
    pub(crate) fn invalid(what: impl Into<String>) -> Self {
        Error::InvalidArgument { what: what.into() }
    }

    /// Shorthand for [`Error::Unsupported`].
    pub(crate) fn unsupported(what: impl Into<String>) -> Self {
        Error::Unsupported { what: what.into() }
    }

    /// Shorthand for [`Error::OutOfMemory`].
    pub(crate) fn out_of_memory(what: impl Into<String>) -> Self {
        Error::OutOfMemory { what: what.into() }
    }

    /// A worker thread the system refused to start (`pthread_create`'s `EAGAIN`: no memory
    /// for its stack, or a thread limit reached): [`Error::OutOfMemory`] naming `what`.
    pub(crate) fn thread_refused(what: &str, err: std::io::Error) -> Self {
        Error::out_of_memory(format!("cannot start {what}: {err}"))
    }
}

/// `cudaErrorMemoryAllocation`, the CUDA runtime's code for out of memory (stable since CUDA
/// 1.0; the driver API's `CUDA_ERROR_OUT_OF_MEMORY` has the same value).
const CUDA_ERROR_MEMORY_ALLOCATION: i32 = 2;

/// The first failure seen while dropping a resource, waiting to be reported.
static DROP_ERROR: Mutex<Option<Error>> = Mutex::new(None);

/// Keeps `err` (if it is the first) for [`take_drop_error`]; used by `Drop` impls.
pub(crate) fn record_drop_error(err: Error) {
    if let Ok(mut slot) = DROP_ERROR.lock() {
        slot.get_or_insert(err);
    }
}

/// Returns, and clears, the first error that happened while dropping a stream, event or buffer
/// since the last call. `Drop` cannot return errors, so they wait here.
///
/// # Examples
///
/// ```
/// // Nothing has failed in this process.
/// assert!(cuferry::take_drop_error().is_none());
/// ```
pub fn take_drop_error() -> Option<Error> {
    DROP_ERROR.lock().ok().and_then(|mut slot| slot.take())
}
