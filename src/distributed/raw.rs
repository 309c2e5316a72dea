//! Checked wrappers over the raw MPI calls the halo exchange needs: nonblocking byte
//! messages that can be tested, cancelled and abandoned, which rsmpi's scoped requests cannot
//! (they panic when dropped incomplete), and the few collectives run on a communicator with
//! `MPI_ERRORS_RETURN`, whose return codes rsmpi would ignore.
//!
//! Rules:
//! - Every call's return code is checked; a failure becomes [`Error::Mpi`] with the call's
//!   name, the error class and the library's message. The communicator given to these calls
//!   must have `MPI_ERRORS_RETURN` set ([`set_errors_return`]), or MPI aborts instead. rsmpi
//!   is not used for calls on such a communicator: it drops their return codes, so a failing
//!   call would go unnoticed and its output buffer be read as if it had been filled.
//! - Collectives ([`agree`], [`all_reduce_min_i32`], [`all_to_all_counts`],
//!   [`all_to_all_v_u64`]) validate their slices against the communicator's size (and their
//!   counts against each other) before any MPI call: a mismatch is an
//!   [`Error::InvalidArgument`], never a read or write past a slice. A rank that fails that
//!   way does not enter the collective, and its peers wait in it: callers make every rank's
//!   arguments valid, or agree on them first. A collective can return [`Error::Mpi`] on some ranks
//!   only (a truncated message fails its receiver), so the halo communicator's `new` joins
//!   the next agreement with the error on a failing rank: its peers, which went on to that
//!   agreement, fail with it instead of waiting for ever. `new` then fails on every rank and
//!   the communicator is not used again.
//! - A [`RawRequest`] owns one pending request. Dropping it while pending frees the handle
//!   with `MPI_Request_free`; the caller must then keep the message buffer alive for as long
//!   as MPI may touch it (the halo communicator leaks it, see its docs).
//! - Message sizes and counts are MPI `int`s: larger messages (and count lists whose total
//!   exceeds an `int`) are an [`Error::InvalidArgument`], never a truncated count.

use std::os::raw::{c_char, c_int};

use ::mpi::ffi;
use ::mpi::raw::AsRaw;
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
///
/// When the `MPI_Allreduce` itself fails (on a communicator with `MPI_ERRORS_RETURN`), this
/// rank returns that [`Error::Mpi`]: whether the other ranks agreed is then unknown, and the
/// caller must not go on as if they had. A local error is not lost: it is appended to the
/// `Error::Mpi` message ("this rank's own step had failed too: ..."), keeping the call and
/// class of the MPI failure.
pub(crate) fn agree(comm: &SimpleCommunicator, local: Option<&Error>, what: &str) -> Result<()> {
    let mine = if local.is_some() { comm.rank() } else { i32::MAX };
    agreement(local, what, all_reduce_min_i32(comm.as_raw(), mine))
}

/// What [`agree`] returns, given this rank's `local` error and the reduced lowest failing rank
/// (`i32::MAX` when none), or the reduction's own failure.
fn agreement(local: Option<&Error>, what: &str, first: Result<i32>) -> Result<()> {
    match (first, local) {
        (Err(Error::Mpi { call, class, message }), Some(e)) => Err(Error::Mpi {
            call,
            class,
            message: format!("{message}; this rank's own step had failed too: {e}"),
        }),
        (Err(e), _) => Err(e),
        (Ok(_), Some(e)) => Err(e.clone()),
        (Ok(i32::MAX), None) => Ok(()),
        (Ok(rank), None) => Err(Error::PeerFailed { rank, what: what.to_owned() }),
    }
}

/// The number of ranks of `comm` (`MPI_Comm_size`), as a length.
fn comm_size(comm: ffi::MPI_Comm) -> Result<usize> {
    let mut size: c_int = 0;
    // SAFETY: `comm` is a valid communicator handle; `size` is a plain out-parameter.
    check("MPI_Comm_size", unsafe { ffi::MPI_Comm_size(comm, &mut size) })?;
    usize::try_from(size).map_err(|_| Error::invalid(format!("MPI_Comm_size returned {size}")))
}

/// An [`Error::InvalidArgument`] unless `what` has one entry per rank (`len == size`).
fn per_rank(what: &str, len: usize, size: usize) -> Result<()> {
    if len != size {
        return Err(Error::invalid(format!(
            "{what} has {len} entries for a communicator of {size} ranks (one per rank needed)"
        )));
    }
    Ok(())
}

/// Where each rank's block starts when blocks of `counts` values lie back to back in rank
/// order (MPI displacements), and the total count.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a negative count, or a total past MPI's `int` (so every
/// displacement is an `int` too).
pub(crate) fn displacements(counts: &[c_int]) -> Result<(Vec<c_int>, usize)> {
    let mut at: c_int = 0;
    let mut displs = Vec::with_capacity(counts.len());
    for &c in counts {
        if c < 0 {
            return Err(Error::invalid(format!("an MPI count of {c} (counts are non-negative)")));
        }
        displs.push(at);
        at = at
            .checked_add(c)
            .ok_or_else(|| Error::invalid("MPI counts whose total exceeds the int count limit (i32::MAX)"))?;
    }
    // Non-negative: every count added was.
    Ok((displs, at as usize))
}

/// The minimum of `value` over every rank of `comm` (collective, `MPI_Allreduce` with
/// `MPI_MIN` of one `MPI_INT32_T`).
///
/// # Errors
///
/// [`Error::Mpi`] when the call fails (`comm` has `MPI_ERRORS_RETURN`).
pub(crate) fn all_reduce_min_i32(comm: ffi::MPI_Comm, value: i32) -> Result<i32> {
    let mut min = value;
    // SAFETY: one value to read at `&value` and one to write at `&mut min`, distinct
    // locals; `comm` is a valid communicator handle (the caller's).
    unsafe { all_reduce_min_i32_raw(&value, &mut min, 1, comm)? };
    Ok(min)
}

/// `MPI_Allreduce` with `MPI_MIN` of `count` `MPI_INT32_T`s, its return code checked.
///
/// # Safety
///
/// `send` is valid for reading and `recv` for writing `count` values, and they do not
/// overlap; `comm` is a valid communicator handle.
unsafe fn all_reduce_min_i32_raw(
    send: *const i32,
    recv: *mut i32,
    count: c_int,
    comm: ffi::MPI_Comm,
) -> Result<()> {
    // SAFETY: the caller's contract on the buffers and `comm`; the datatype and operation
    // are MPI's predefined handles, matching `i32`.
    let code = unsafe {
        ffi::MPI_Allreduce(send.cast(), recv.cast(), count, ffi::RSMPI_INT32_T, ffi::RSMPI_MIN, comm)
    };
    check("MPI_Allreduce", code)
}

/// Sends `values[r]` to each rank `r` of `comm` and returns what each rank sent this one, in
/// rank order (collective, `MPI_Alltoall` of one `MPI_INT32_T` per rank): how the halo
/// communicator tells each peer how many numbers [`all_to_all_v_u64`] will send it.
///
/// # Errors
///
/// [`Error::InvalidArgument`], before any MPI call, when `values` does not have one entry
/// per rank; [`Error::Mpi`] when a call fails.
pub(crate) fn all_to_all_counts(comm: ffi::MPI_Comm, values: &[i32]) -> Result<Vec<i32>> {
    let size = comm_size(comm)?;
    per_rank("an all-to-all list", values.len(), size)?;
    let mut received = vec![0; size];
    // SAFETY: `values` and `received` hold one value per rank of `comm` (checked above),
    // which is what MPI_Alltoall reads and writes with a count of 1; `comm` is valid.
    unsafe { all_to_all_i32_raw(values.as_ptr(), received.as_mut_ptr(), 1, comm)? };
    Ok(received)
}

/// `MPI_Alltoall` of `count` `MPI_INT32_T`s per rank, its return code checked.
///
/// # Safety
///
/// With `n` the size of `comm`, `send` is valid for reading and `recv` for writing
/// `n * count` values, and they do not overlap; `comm` is a valid communicator handle.
unsafe fn all_to_all_i32_raw(
    send: *const i32,
    recv: *mut i32,
    count: c_int,
    comm: ffi::MPI_Comm,
) -> Result<()> {
    // SAFETY: the caller's contract on the buffers and `comm`; the datatype is MPI's
    // predefined handle matching `i32`.
    let code = unsafe {
        ffi::MPI_Alltoall(
            send.cast(),
            count,
            ffi::RSMPI_INT32_T,
            recv.cast(),
            count,
            ffi::RSMPI_INT32_T,
            comm,
        )
    };
    check("MPI_Alltoall", code)
}

/// Sends each rank `r` of `comm` the next `send_counts[r]` values of `send` (blocks back to
/// back in rank order) and receives `recv_counts[r]` values from it; returns the received
/// blocks back to back in rank order (collective, `MPI_Alltoallv` of `MPI_UINT64_T`).
///
/// Each rank's `recv_counts[r]` must be rank `r`'s `send_counts` entry for it (exchange them
/// with [`all_to_all_counts`]); a longer message is MPI's error (`MPI_ERR_TRUNCATE`).
///
/// # Errors
///
/// [`Error::InvalidArgument`], before any MPI call, when a count list does not have one entry
/// per rank, a count is negative, a list's total exceeds an `int`, or `send` does not hold
/// exactly the total of `send_counts`; [`Error::Mpi`] when a call fails.
pub(crate) fn all_to_all_v_u64(
    comm: ffi::MPI_Comm,
    send: &[u64],
    send_counts: &[c_int],
    recv_counts: &[c_int],
) -> Result<Vec<u64>> {
    let size = comm_size(comm)?;
    per_rank("the send counts", send_counts.len(), size)?;
    per_rank("the receive counts", recv_counts.len(), size)?;
    let (send_displs, send_total) = displacements(send_counts)?;
    let (recv_displs, recv_total) = displacements(recv_counts)?;
    if send.len() != send_total {
        return Err(Error::invalid(format!(
            "{} values to send, but the send counts add up to {send_total}",
            send.len()
        )));
    }
    let mut received = vec![0u64; recv_total];
    // SAFETY: every list has one entry per rank of `comm`; the counts are non-negative and
    // their displacements lay the blocks back to back within `send` (which holds exactly
    // their total) and within `received` (made of exactly their total); `comm` is valid.
    unsafe {
        all_to_all_v_u64_raw(
            send.as_ptr(),
            send_counts.as_ptr(),
            send_displs.as_ptr(),
            received.as_mut_ptr(),
            recv_counts.as_ptr(),
            recv_displs.as_ptr(),
            comm,
        )?;
    }
    Ok(received)
}

/// `MPI_Alltoallv` of `MPI_UINT64_T`, its return code checked.
///
/// # Safety
///
/// With `n` the size of `comm`, the four count and displacement arrays hold `n` entries;
/// for each rank `r`, `send` is valid for reading `send_counts[r]` values from
/// `send_displs[r]` and `recv` for writing `recv_counts[r]` values from `recv_displs[r]`; the
/// receive blocks overlap neither each other nor the send buffer; `comm` is a valid
/// communicator handle.
unsafe fn all_to_all_v_u64_raw(
    send: *const u64,
    send_counts: *const c_int,
    send_displs: *const c_int,
    recv: *mut u64,
    recv_counts: *const c_int,
    recv_displs: *const c_int,
    comm: ffi::MPI_Comm,
) -> Result<()> {
    // SAFETY: the caller's contract on the buffers, the arrays and `comm`; the datatype is
    // MPI's predefined handle matching `u64`.
    let code = unsafe {
        ffi::MPI_Alltoallv(
            send.cast(),
            send_counts,
            send_displs,
            ffi::RSMPI_UINT64_T,
            recv.cast(),
            recv_counts,
            recv_displs,
            ffi::RSMPI_UINT64_T,
            comm,
        )
    };
    check("MPI_Alltoallv", code)
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

/// The launcher of the MPI integration tests: a test below runs in `mpirun` ranks too.
#[cfg(test)]
#[path = "../../tests/mpi_common/mod.rs"]
mod mpi_common;

#[cfg(test)]
mod tests {
    use super::*;

    /// Asserts `result` is the failure of `call` with error class `class`.
    fn assert_mpi_error<T: std::fmt::Debug>(result: Result<T>, call: &str, class: u32) {
        match result {
            Err(Error::Mpi { call: c, class: k, message }) => {
                assert_eq!((c, k), (call, class as i32), "{message}");
                println!("{call} reported: {message}");
            }
            other => panic!("expected {call} to fail with MPI error class {class}, got {other:?}"),
        }
    }

    /// The agreement's own failure is what a rank returns, with its local error kept in the
    /// message; without one, its own error or the lowest failing rank.
    #[test]
    fn a_failed_agreement_returns_the_mpi_error_and_keeps_the_local_one() {
        let mpi = || Error::Mpi { call: "MPI_Allreduce", class: 2, message: "MPI_ERR_COUNT".into() };
        let local = Error::invalid("bad links");
        assert_eq!(agreement(None, "x", Err(mpi())), Err(mpi()));
        match agreement(Some(&local), "x", Err(mpi())) {
            Err(Error::Mpi { call: "MPI_Allreduce", class: 2, message }) => {
                assert!(message.starts_with("MPI_ERR_COUNT; "), "{message}");
                assert!(message.contains("bad links"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(agreement(Some(&local), "x", Ok(0)), Err(local.clone()));
        assert_eq!(agreement(None, "x", Ok(i32::MAX)), Ok(()));
        assert_eq!(agreement(None, "x", Ok(3)), Err(Error::PeerFailed { rank: 3, what: "x".into() }));
    }

    /// Displacements lie blocks back to back; negative counts and totals past an `int` are
    /// refused.
    #[test]
    fn displacements_refuse_negative_counts_and_int_overflow() {
        assert_eq!(displacements(&[2, 0, 3]).unwrap(), (vec![0, 2, 2], 5));
        assert!(matches!(displacements(&[1, -1]), Err(Error::InvalidArgument { .. })));
        assert!(matches!(displacements(&[i32::MAX, 1]), Err(Error::InvalidArgument { .. })));
    }

    /// On a communicator with `MPI_ERRORS_RETURN` (two ranks): the checked collectives give
    /// the right results; slices that are not one per rank are refused before any MPI call;
    /// and a collective that fails returns [`Error::Mpi`] naming the call. rsmpi's calls drop
    /// the code: the same truncating exchange through `all_to_all_varcount_into` returns
    /// normally with the output still zeros, and these wrappers with their `check` removed
    /// fail this test.
    #[test]
    fn checked_collectives_report_their_failures() {
        if !mpi_common::ranks("distributed::raw::tests::checked_collectives_report_their_failures", 2) {
            return;
        }
        let universe = ::mpi::initialize().expect("MPI initialises once");
        let comm = PrivateComm::duplicate(&universe.world());
        set_errors_return(comm.as_raw()).unwrap();
        let raw = comm.as_raw();
        let (me, size) = (comm.rank(), comm.size());
        let n = size as usize;

        // Results.
        assert_eq!(all_reduce_min_i32(raw, 10 + me).unwrap(), 10);
        let values: Vec<i32> = (0..size).map(|r| 100 * me + r).collect();
        assert_eq!(
            all_to_all_counts(raw, &values).unwrap(),
            (0..size).map(|r| 100 * r + me).collect::<Vec<_>>()
        );
        // Rank `me` sends `me + 1` copies of `1000 * me + r` to each rank `r`.
        let send_counts = vec![me + 1; n];
        let send: Vec<u64> = (0..size).flat_map(|r| vec![(1000 * me + r) as u64; me as usize + 1]).collect();
        let recv_counts = all_to_all_counts(raw, &send_counts).unwrap();
        assert_eq!(recv_counts, (1..=size).collect::<Vec<_>>());
        let want: Vec<u64> = (0..size).flat_map(|r| vec![(1000 * r + me) as u64; r as usize + 1]).collect();
        assert_eq!(all_to_all_v_u64(raw, &send, &send_counts, &recv_counts).unwrap(), want);
        agree(&comm, None, "nothing").unwrap();

        // Refused before any call (on every rank alike, so none is left waiting in one).
        fn invalid<T: std::fmt::Debug>(r: Result<T>) {
            assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
        }
        invalid(all_to_all_counts(raw, &[0]));
        invalid(all_to_all_v_u64(raw, &[], &[0], &[0, 0]));
        invalid(all_to_all_v_u64(raw, &[], &[0, 0], &[0; 3]));
        invalid(all_to_all_v_u64(raw, &[7], &[1, -1], &[0, 0]));
        invalid(all_to_all_v_u64(raw, &[7], &[0, 0], &[0, 0]));

        // Failing calls. Each rank sends every rank two values but expects one: every receive
        // is truncated, which MPI reports as it matches the messages (no parameter check
        // needed), and MPI writes no more than the receive counts allow.
        assert_mpi_error(
            all_to_all_v_u64(raw, &[1, 2, 3, 4], &[2, 2], &[1, 1]),
            "MPI_Alltoallv",
            ffi::MPI_ERR_TRUNCATE,
        );
        // A failure on one rank only: rank 1 expects one value from rank 0, which sends two.
        // Rank 1's receive is truncated, rank 0's exchange succeeds, and the agreement after
        // it (what the halo communicator does) still works: each learns of the failure.
        let (counts_out, counts_in) = if me == 0 { ([1, 2], [1, 1]) } else { ([1, 1], [1, 1]) };
        let send = vec![9u64; counts_out.iter().sum::<i32>() as usize];
        let exchanged = all_to_all_v_u64(raw, &send, &counts_out, &counts_in);
        if me == 1 {
            let err = exchanged.unwrap_err();
            assert!(matches!(&err, Error::Mpi { call: "MPI_Alltoallv", .. }), "{err:?}");
            assert!(matches!(agree(&comm, Some(&err), "x"), Err(Error::Mpi { .. })));
        } else {
            assert_eq!(exchanged.unwrap(), vec![9, 9]);
            assert_eq!(agree(&comm, None, "x"), Err(Error::PeerFailed { rank: 1, what: "x".into() }));
        }
        // A negative count, refused by MPI's parameter checking (Open MPI's default) before
        // any buffer is touched, through the raw calls the wrappers make. Without parameter
        // checking MPI would be handed the negative count: skipped.
        if std::env::var("OMPI_MCA_mpi_param_check").is_ok_and(|v| v == "0") {
            println!("rank {me}: MPI parameter checking is off; negative counts not tried");
            return;
        }
        let (mut one, mut two, counts, displs) = ([0i32], [0i32; 2], [-1; 2], [0; 2]);
        // SAFETY: both buffers hold one value; MPI refuses the negative count outright.
        let r = unsafe { all_reduce_min_i32_raw(&me, one.as_mut_ptr(), -1, raw) };
        assert_mpi_error(r, "MPI_Allreduce", ffi::MPI_ERR_COUNT);
        // SAFETY: both buffers hold one value per rank; MPI refuses the negative count.
        let r = unsafe { all_to_all_i32_raw(values.as_ptr(), two.as_mut_ptr(), -1, raw) };
        assert_mpi_error(r, "MPI_Alltoall", ffi::MPI_ERR_COUNT);
        let mut out = [0u64; 2];
        // SAFETY: the arrays hold one entry per rank and the buffers two values; MPI refuses
        // the negative counts.
        let r = unsafe {
            all_to_all_v_u64_raw(
                [5u64; 2].as_ptr(),
                counts.as_ptr(),
                displs.as_ptr(),
                out.as_mut_ptr(),
                counts.as_ptr(),
                displs.as_ptr(),
                raw,
            )
        };
        assert_mpi_error(r, "MPI_Alltoallv", ffi::MPI_ERR_COUNT);
        assert_eq!((one, two, out), ([0], [0; 2], [0; 2]));
        println!("rank {me}: failing collectives were reported");
    }
}
