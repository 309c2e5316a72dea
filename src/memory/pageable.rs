//! `PageableSlice`: a borrowed host slice used as a copy endpoint by the synchronous helpers.
//!
//! Rule: the owner must call `wait` (or drop it) before the borrow ends; `Drop` waits too, so an
//! early return cannot leave a copy running into freed memory. Crate-internal because a leaked
//! (forgotten) value would end the borrow with a copy pending.

use std::marker::PhantomData;

use super::sealed::{RawParts, Sealed};
use super::tracker::UseTracker;
use super::{Element, Memory, MemoryKind};
use crate::error::{record_drop_error, Result};

/// A borrowed slice of ordinary host memory.
pub(crate) struct PageableSlice<'a, T: Element> {
    ptr: *mut u8,
    len: usize,
    tracker: UseTracker,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T: Element> PageableSlice<'a, T> {
    /// A read-only endpoint (copy source only; the crate never writes through it).
    pub(crate) fn new(data: &'a [T]) -> Self {
        PageableSlice {
            ptr: data.as_ptr().cast_mut().cast(),
            len: data.len(),
            tracker: UseTracker::default(),
            _borrow: PhantomData,
        }
    }

    /// A writable endpoint.
    pub(crate) fn new_mut(data: &'a mut [T]) -> Self {
        PageableSlice {
            ptr: data.as_mut_ptr().cast(),
            len: data.len(),
            tracker: UseTracker::default(),
            _borrow: PhantomData,
        }
    }

    /// Blocks until every copy queued on the slice has finished.
    pub(crate) fn wait(&self) -> Result<()> {
        self.tracker.wait_idle()
    }
}

impl<T: Element> Drop for PageableSlice<'_, T> {
    fn drop(&mut self) {
        if let Err(err) = self.tracker.wait_idle() {
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
