//! `PageableSlice`: a borrowed host slice used as a copy endpoint by the synchronous helpers.
//!
//! Rules:
//! - The owner must call `wait` (or drop it) before the borrow ends; `Drop` waits too, so an
//!   early return cannot leave a copy running into freed memory. Crate-internal because a
//!   leaked (forgotten) value would end the borrow with a copy pending.
//! - An endpoint is made for one stream, and refused from a job of that host stream: its copy
//!   would queue behind the running job, and the wait for it fail, so the borrow would end
//!   with the copy still to run.
//! - Should a wait fail anyway while a copy is known to be pending (a host job queued and not
//!   run), `Drop` aborts the process: the borrow ends there, and neither leaking the memory nor
//!   letting the copy run into it is possible.

use std::marker::PhantomData;

use super::sealed::{RawParts, Sealed};
use super::tracker::UseTracker;
use super::{Element, Memory, MemoryKind};
use crate::error::{record_drop_error, Result};
use crate::stream::Stream;

/// A borrowed slice of ordinary host memory.
pub(crate) struct PageableSlice<'a, T: Element> {
    ptr: *mut u8,
    len: usize,
    tracker: UseTracker,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T: Element> PageableSlice<'a, T> {
    /// A read-only endpoint for copies through `stream` (copy source only; the crate never
    /// writes through it).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) from a job of `stream` (module
    /// rules).
    pub(crate) fn new(stream: &Stream, data: &'a [T]) -> Result<Self> {
        refuse_from_own_job(stream)?;
        Ok(PageableSlice {
            ptr: data.as_ptr().cast_mut().cast(),
            len: data.len(),
            tracker: UseTracker::default(),
            _borrow: PhantomData,
        })
    }

    /// A writable endpoint for copies through `stream`.
    ///
    /// # Errors
    ///
    /// As [`PageableSlice::new`].
    pub(crate) fn new_mut(stream: &Stream, data: &'a mut [T]) -> Result<Self> {
        refuse_from_own_job(stream)?;
        Ok(PageableSlice {
            ptr: data.as_mut_ptr().cast(),
            len: data.len(),
            tracker: UseTracker::default(),
            _borrow: PhantomData,
        })
    }

    /// Blocks until every copy queued on the slice has finished.
    pub(crate) fn wait(&self) -> Result<()> {
        self.tracker.wait_idle()
    }
}

fn refuse_from_own_job(stream: &Stream) -> Result<()> {
    stream
        .refuse_blocking_call_from_own_job("a synchronous copy to or from host memory through a host stream")
}

impl<T: Element> Drop for PageableSlice<'_, T> {
    fn drop(&mut self) {
        if let Err(err) = self.tracker.wait_idle() {
            if matches!(self.tracker.is_idle(), Ok(false)) {
                // A copy is still queued and will use memory whose borrow ends here (module
                // rules): stopping is the only sound way on.
                eprintln!("cuferry: a copy into borrowed host memory is pending and cannot be waited for ({err}); aborting");
                std::process::abort();
            }
            record_drop_error(err);
        }
    }
}

impl<T: Element> Sealed for PageableSlice<'_, T> {
    fn raw_parts(&self) -> RawParts<'_> {
        RawParts { ptr: self.ptr, bytes: self.len * std::mem::size_of::<T>(), tracker: &self.tracker }
    }
}

impl<T: Element> Memory<T> for PageableSlice<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn kind(&self) -> MemoryKind {
        MemoryKind::Pageable
    }
}
