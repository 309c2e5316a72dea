//! Checked wrappers over the few raw MPI calls the halo exchange needs: nonblocking byte
//! messages that can be tested, cancelled and abandoned, which rsmpi's scoped requests cannot
//! (they panic when dropped incomplete).
//!
//! Rules:
//! - Every call's return code is checked; a failure becomes [`Error::Mpi`] with the call's
//!   name, the error class and the library's message. The communicator given to these calls
//!   must have `MPI_ERRORS_RETURN` set ([`set_errors_return`]), or MPI aborts instead.
//! - A [`RawRequest`] owns one pending request. Dropping it while pending frees the handle
//!   with `MPI_Request_free`; the caller must then keep the message buffer alive for as long
//!   as MPI may touch it (the halo communicator leaks it, see its docs).
//! - Message sizes are `int` counts of bytes: larger messages are an
//!   [`Error::InvalidArgument`], never a truncated count.

use std::os::raw::{c_char, c_int};

use ::mpi::collective::{CommunicatorCollectives, SystemOperation};
use ::mpi::ffi;
use ::mpi::topology::{Communicator, SimpleCommunicator};

use crate::error::{Error, Result};

/// Maps an MPI return code to a result.
pub(crate) fn check(call: &'static str, code: c_int) -> Result<()> {
    // MPI_SUCCESS is 0 in every implementation (the standard fixes it).
    if code == 0 {
        return Ok(());
    }
    let mut class: c_int = code;
    let mut text = vec![0 as c_char; 1024];
    let mut len: c_int = 0;
    // SAFETY: plain out-parameters of the right types; the text buffer holds
    // MPI_MAX_ERROR_STRING (256 in Open MPI and MPICH) characters.
    unsafe {
        ffi::MPI_Error_class(code, &mut class);
        ffi::MPI_Error_string(code, text.as_mut_ptr(), &mut len);
    }
    let len = usize::try_from(len).unwrap_or(0).min(text.len());
    let bytes: Vec<u8> = text[..len].iter().map(|&c| c as u8).collect();
    Err(Error::Mpi { call, class, message: String::from_utf8_lossy(&bytes).into_owned() })
}

/// Makes failures on `comm` return codes instead of aborting the process.
pub(crate) fn set_errors_return(comm: ffi::MPI_Comm) -> Result<()> {
    // SAFETY: `comm` is a valid communicator handle owned by the caller.
    check("MPI_Comm_set_errhandler", unsafe { ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN) })
}

/// A private duplicate of the caller's communicator (Debug shows its rank and size).
pub(crate) struct PrivateComm(pub(crate) SimpleCommunicator);

impl PrivateComm {
    /// Duplicates `comm` (collective over it).
    pub(crate) fn duplicate(comm: &impl Communicator) -> Self {
        PrivateComm(comm.duplicate())
    }
}

impl std::ops::Deref for PrivateComm {
    type Target = SimpleCommunicator;
    fn deref(&self) -> &SimpleCommunicator {
        &self.0
    }
}

impl std::fmt::Debug for PrivateComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator").field("rank", &self.0.rank()).field("size", &self.0.size()).finish()
    }
}

/// Agrees over `comm` (collective, `MPI_Allreduce`) on whether every rank's `local` step
/// succeeded: this rank returns its own error, or [`Error::PeerFailed`] naming the lowest
/// failing rank with `what`.
pub(crate) fn agree(comm: &SimpleCommunicator, local: Option<&Error>, what: &str) -> Result<()> {
    let mine = if local.is_some() { comm.rank() } else { i32::MAX };
    let mut first = i32::MAX;
    comm.all_reduce_into(&mine, &mut first, SystemOperation::min());
    match local {
        Some(e) => Err(e.clone()),
        None if first == i32::MAX => Ok(()),
        None => Err(Error::PeerFailed { rank: first, what: what.to_owned() }),
    }
}

/// A byte count as MPI's `int`.
fn count(bytes: usize) -> Result<c_int> {
    c_int::try_from(bytes)
        .map_err(|_| Error::invalid(format!("an MPI message of {bytes} bytes exceeds the int count limit")))
}

/// One pending nonblocking operation.
#[derive(Debug)]
pub(crate) struct RawRequest {
    handle: ffi::MPI_Request,
    done: bool,
}

impl RawRequest {
    /// Starts sending `bytes` bytes at `ptr` to `dest` with `tag`.
    ///
    /// # Safety
    ///
    /// `ptr` is valid for reading `bytes` bytes, and stays so (unmodified) until the request
    /// completes or is abandoned with the buffer leaked.
    pub(crate) unsafe fn send(
        ptr: *const u8,
        bytes: usize,
        dest: i32,
        tag: i32,
        comm: ffi::MPI_Comm,
    ) -> Result<Self> {
        let n = count(bytes)?;
        // SAFETY: MPI_REQUEST_NULL is a plain handle constant.
        let mut handle = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the caller's contract on `ptr`; `comm` is a valid communicator.
        let code = unsafe { ffi::MPI_Isend(ptr.cast(), n, ffi::RSMPI_UINT8_T, dest, tag, comm, &mut handle) };
        check("MPI_Isend", code)?;
        Ok(RawRequest { handle, done: false })
    }

    /// Starts receiving up to `bytes` bytes into `ptr` from `source` with `tag`.
    ///
    /// # Safety
    ///
    /// `ptr` is valid for writing `bytes` bytes, not otherwise accessed, until the request
    /// completes or is abandoned with the buffer leaked.
    pub(crate) unsafe fn recv(
        ptr: *mut u8,
        bytes: usize,
        source: i32,
        tag: i32,
        comm: ffi::MPI_Comm,
    ) -> Result<Self> {
        let n = count(bytes)?;
        // SAFETY: MPI_REQUEST_NULL is a plain handle constant.
        let mut handle = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the caller's contract on `ptr`; `comm` is a valid communicator.
        let code =
            unsafe { ffi::MPI_Irecv(ptr.cast(), n, ffi::RSMPI_UINT8_T, source, tag, comm, &mut handle) };
        check("MPI_Irecv", code)?;
        Ok(RawRequest { handle, done: false })
    }

    /// Whether the operation finished (`MPI_Test`); with the received byte count, which the
    /// caller compares with what it expected.
    pub(crate) fn test(&mut self) -> Result<Option<usize>> {
        if self.done {
            return Ok(Some(0));
        }
        let mut flag: c_int = 0;
        // SAFETY: zeroed MPI_Status is a valid out-parameter (a plain C struct).
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: `handle` is a live request of this struct; out-parameters are valid.
        let code = unsafe { ffi::MPI_Test(&mut self.handle, &mut flag, &mut status) };
        // A request that failed (a message longer than the receive: MPI_ERR_TRUNCATE) may
        // have been completed and freed, its handle set to MPI_REQUEST_NULL: it is done, and
        // cancelling or freeing the null handle would be an error on MPI_COMM_WORLD (fatal).
        // SAFETY: MPI_REQUEST_NULL is a plain handle constant.
        if code != 0 && self.handle == unsafe { ffi::RSMPI_REQUEST_NULL } {
            self.done = true;
        }
        check("MPI_Test", code)?;
        if flag == 0 {
            return Ok(None);
        }
        self.done = true;
        let mut received: c_int = 0;
        // SAFETY: `status` was filled by the completed MPI_Test.
        let code = unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut received) };
        check("MPI_Get_count", code)?;
        Ok(Some(usize::try_from(received).unwrap_or(0)))
    }

    /// Whether the operation has finished (as last seen by [`RawRequest::test`]).
    pub(crate) fn is_done(&self) -> bool {
        self.done
    }
}

impl Drop for RawRequest {
    fn drop(&mut self) {
        // SAFETY: MPI_REQUEST_NULL is a plain handle constant.
        if self.done || self.handle == unsafe { ffi::RSMPI_REQUEST_NULL } {
            return;
        }
        // A pending request: ask for cancellation (receives; sends may not cancel) and free
        // the handle. The owner keeps the buffer alive (leaks it) when this happens.
        // SAFETY: `handle` is a live request; both calls accept any active request.
        unsafe {
            ffi::MPI_Cancel(&mut self.handle);
            ffi::MPI_Request_free(&mut self.handle);
        }
    }
}

/// Whether a message with `tag` is waiting from any source (`MPI_Iprobe`); its source rank.
pub(crate) fn probe_any(tag: i32, comm: ffi::MPI_Comm) -> Result<Option<i32>> {
    let mut flag: c_int = 0;
    // SAFETY: zeroed MPI_Status is a valid out-parameter.
    let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
    // SAFETY: `comm` is valid; out-parameters are valid.
    let code = unsafe { ffi::MPI_Iprobe(ffi::RSMPI_ANY_SOURCE, tag, comm, &mut flag, &mut status) };
    check("MPI_Iprobe", code)?;
    Ok((flag != 0).then_some(status.MPI_SOURCE))
}

/// Receives the message `probe_any` found from `source` with `tag` (blocking: it is there).
pub(crate) fn recv_probed(source: i32, tag: i32, comm: ffi::MPI_Comm) -> Result<Vec<u8>> {
    // SAFETY: zeroed MPI_Status is a valid out-parameter.
    let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
    // SAFETY: `comm` is valid; the probed message exists, so this returns at once.
    check("MPI_Probe", unsafe { ffi::MPI_Probe(source, tag, comm, &mut status) })?;
    let mut n: c_int = 0;
    // SAFETY: `status` was filled by MPI_Probe.
    check("MPI_Get_count", unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut n) })?;
    let mut data = vec![0u8; usize::try_from(n).unwrap_or(0)];
    // SAFETY: `data` has room for the `n` bytes of the probed message.
    let code = unsafe {
        ffi::MPI_Recv(
            data.as_mut_ptr().cast(),
            n,
            ffi::RSMPI_UINT8_T,
            source,
            tag,
            comm,
            ffi::RSMPI_STATUS_IGNORE,
        )
    };
    check("MPI_Recv", code)?;
    Ok(data)
}

/// Sends a small message and does not wait for it (`MPI_Isend` + `MPI_Request_free`): used to
/// tell peers this rank failed. `data` must be `'static` because MPI may read it later.
pub(crate) fn send_and_forget(data: &'static [u8], dest: i32, tag: i32, comm: ffi::MPI_Comm) -> Result<()> {
    // SAFETY: `data` lives forever and is never written.
    let mut request = unsafe { RawRequest::send(data.as_ptr(), data.len(), dest, tag, comm)? };
    // SAFETY: a live request handle; MPI completes a freed send in the background.
    let code = unsafe { ffi::MPI_Request_free(&mut request.handle) };
    // Handed to MPI either way: after a failed free the handle's state is MPI's, and the drop
    // must not cancel or free it a second time.
    request.done = true;
    check("MPI_Request_free", code)
}

/// `MPIX_Query_cuda_support()` when the MPI library exports it (Open MPI, MPICH), found with
/// `dlsym` so that builds against libraries without it still link; `None` when it is absent.
pub(crate) fn query_cuda_support() -> Option<bool> {
    const NAME: &[u8] = b"MPIX_Query_cuda_support\0";
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only looks a symbol up.
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, NAME.as_ptr().cast()) };
    if sym.is_null() {
        return None;
    }
    // SAFETY: the symbol is `int MPIX_Query_cuda_support(void)` in every MPI that defines it.
    let query: extern "C" fn() -> c_int = unsafe { std::mem::transmute(sym) };
    Some(query() != 0)
}
