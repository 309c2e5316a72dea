//! The pool of packed buffers, keyed by (device, size in bytes), shared by every packer.
//!
//! Rules:
//! - A packer takes its buffers from the pool (or allocates new ones) and gives them back when
//!   dropped, with work possibly still queued on them: the buffer's use tracker orders the
//!   next user's work after it, and host reads wait for it, so no synchronisation is needed.
//!   A buffer whose work has all finished comes back without its record of uses, so a pooled
//!   buffer does not keep its last packer's stream (a host stream's thread) alive.
//! - A loan starts zeroed, pooled or new: a pooled buffer is zeroed on the taker's stream
//!   (after its earlier owner's work), so one packer's bytes never reach another packer's
//!   arrays through an unpack that ran before anything was received.
//! - The pool keeps at most [`MAX_PER_KEY`] buffers per key; extra buffers are freed (their
//!   drop waits for their queued work). [`clear_buffer_pool`] frees every pooled buffer.
//! - Buffers are freed outside the pool's lock, so a slow free never blocks other packers.
//! - A loaned buffer is handed out as `&mut DeviceBuffer`, which a caller can replace with
//!   another buffer: every shared access (`get`, which the packer's jobs and copies use) checks
//!   it is still of the loan's device and size, so a packer never runs over a buffer its plan
//!   does not fit (`copy_pack_to_unpack` writes the loan through a length-checked copy, and
//!   the next `unpack` checks its device).

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, MutexGuard};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::DeviceBuffer;
use crate::stream::Stream;

/// Buffers kept per (device, size).
pub const MAX_PER_KEY: usize = 8;

type Key = (Device, usize);

static POOL: LazyLock<Mutex<HashMap<Key, Vec<DeviceBuffer<u8>>>>> = LazyLock::new(Mutex::default);

fn lock() -> MutexGuard<'static, HashMap<Key, Vec<DeviceBuffer<u8>>>> {
    // A poisoned lock only means a panic elsewhere; the map itself is always consistent.
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A buffer on loan from the pool; goes back on drop.
#[derive(Debug)]
pub(crate) struct PooledBuffer {
    buf: Option<DeviceBuffer<u8>>,
    /// The device and size the loan was made for.
    key: Key,
}

impl PooledBuffer {
    /// A zeroed buffer of `bytes` bytes on `stream`'s device: a pooled one or a new one, the
    /// zeroing queued on `stream` (a pooled buffer whose zeroing cannot be queued is freed).
    pub(crate) fn take(stream: &Stream, bytes: usize) -> Result<Self> {
        let key = (stream.device(), bytes);
        let pooled = if bytes == 0 { None } else { lock().get_mut(&key).and_then(Vec::pop) };
        let buf = match pooled {
            Some(buf) => {
                buf.queue_zeroing(stream)?;
                buf
            }
            None => DeviceBuffer::zeroed(stream, bytes)?,
        };
        Ok(PooledBuffer { buf: Some(buf), key })
    }

    /// The buffer (always there until the drop), checked to be of the loan's device and size.
    pub(crate) fn get(&self) -> Result<&DeviceBuffer<u8>> {
        let buf = self.buf.as_ref().ok_or_else(gone)?;
        check_key(self.key, buf)?;
        Ok(buf)
    }

    /// Leaks the buffer: never freed, never pooled (memory another party may still use).
    #[cfg(feature = "mpi")]
    pub(crate) fn leak(&mut self) {
        if let Some(buf) = self.buf.take() {
            buf.leak();
        }
    }

    /// The buffer, writable. Not checked: a caller who replaced it with one that does not fit
    /// can put a fitting one back; every [`PooledBuffer::get`] checks.
    pub(crate) fn get_mut(&mut self) -> Result<&mut DeviceBuffer<u8>> {
        self.buf.as_mut().ok_or_else(gone)
    }
}

/// Errors when `buf` is not of `key`'s device and size (a caller replaced it through `&mut`).
fn check_key(key: Key, buf: &DeviceBuffer<u8>) -> Result<()> {
    if (buf.device(), buf.len()) == key {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "the packer's buffer was replaced by one of {} bytes on {:?}; it must stay {} bytes on {:?}",
            buf.len(),
            buf.device(),
            key.1,
            key.0
        )))
    }
}

fn gone() -> Error {
    Error::invalid("the pooled buffer was already returned")
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        let Some(mut buf) = self.buf.take() else { return };
        if buf.is_empty() {
            return;
        }
        // Outside the lock: dropping the last handle of a stream may wait for its worker.
        buf.forget_finished_uses();
        let key = (buf.device(), buf.len());
        let extra = {
            let mut pool = lock();
            let list = pool.entry(key).or_default();
            if list.len() < MAX_PER_KEY {
                list.push(buf);
                None
            } else {
                Some(buf)
            }
        };
        drop(extra); // outside the lock: waits for the buffer's queued work, then frees
    }
}

/// Number of buffers waiting in the pool.
///
/// # Examples
///
/// ```
/// let _ = cuferry::halo::pooled_buffers();
/// ```
pub fn pooled_buffers() -> usize {
    lock().values().map(Vec::len).sum()
}

/// Frees every pooled buffer (each drop waits for the buffer's queued work) and returns how
/// many there were. Buffers on loan to live packers are not affected.
///
/// # Examples
///
/// ```
/// use cuferry::halo::{clear_buffer_pool, pooled_buffers};
/// clear_buffer_pool();
/// # // Other doctests run in other processes, so the pool is empty now.
/// assert_eq!(pooled_buffers(), 0);
/// ```
pub fn clear_buffer_pool() -> usize {
    let drained: Vec<DeviceBuffer<u8>> = lock().drain().flat_map(|(_, list)| list).collect();
    drained.len()
}

/// Frees the pooled buffers of one key (for tests that must not clear other tests' keys).
#[cfg(test)]
pub(crate) fn clear_key(device: Device, bytes: usize) -> usize {
    let drained = lock().remove(&(device, bytes)).unwrap_or_default();
    drained.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::sealed::Sealed;

    /// Buffers pooled under `key` now.
    fn pooled_under(key: Key) -> usize {
        lock().get(&key).map_or(0, Vec::len)
    }

    /// The pool keeps at most `MAX_PER_KEY` buffers of one key, frees the rest, and lends a
    /// kept buffer again; sizes of their own (no other test uses them) keep parallel tests apart.
    #[test]
    fn keeps_at_most_the_cap_per_key_and_reuses_kept_buffers() {
        let stream = Stream::new(Device::Host).unwrap();
        let bytes = 40_961;
        let key = (Device::Host, bytes);
        let loans: Vec<PooledBuffer> =
            (0..MAX_PER_KEY + 3).map(|_| PooledBuffer::take(&stream, bytes).unwrap()).collect();
        let pointers: Vec<*const u8> = loans.iter().map(|l| l.get().unwrap().as_ptr()).collect();
        assert_eq!(pooled_under(key), 0);
        drop(loans);
        assert_eq!(pooled_under(key), MAX_PER_KEY, "the pool kept more (or fewer) than its cap");
        let again = PooledBuffer::take(&stream, bytes).unwrap();
        assert!(pointers.contains(&again.get().unwrap().as_ptr()), "a new buffer instead of a pooled one");
        assert_eq!(pooled_under(key), MAX_PER_KEY - 1);
        drop(again);
        assert_eq!(clear_key(Device::Host, bytes), MAX_PER_KEY);
    }

    /// A buffer whose uses have finished goes back to the pool without them: it keeps no
    /// stream (a host stream's worker thread) of its last packer alive.
    #[test]
    fn an_idle_returned_buffer_keeps_no_stream() {
        let stream = Stream::new(Device::Host).unwrap();
        let bytes = 40_971;
        let loan = PooledBuffer::take(&stream, bytes).unwrap();
        loan.get().unwrap().queue_zeroing(&stream).unwrap();
        assert_eq!(loan.get().unwrap().raw_parts().tracker.remembered(), 1);
        stream.synchronize().unwrap();
        drop(loan);
        let remembered = lock()
            .get(&(Device::Host, bytes))
            .and_then(|list| list.last().map(|b| b.raw_parts().tracker.remembered()));
        assert_eq!(remembered, Some(0), "the pooled buffer kept its finished use and its stream");
        assert_eq!(clear_key(Device::Host, bytes), 1);
    }

    /// Empty loans are never pooled; a replaced buffer fails `get` and goes back under its own
    /// device and size, not the loan's.
    #[test]
    fn empty_and_replaced_buffers() {
        let stream = Stream::new(Device::Host).unwrap();
        drop(PooledBuffer::take(&stream, 0).unwrap());
        assert_eq!(pooled_under((Device::Host, 0)), 0);
        let (bytes, other) = (40_963, 40_967);
        let mut loan = PooledBuffer::take(&stream, bytes).unwrap();
        *loan.get_mut().unwrap() = DeviceBuffer::zeroed(&stream, other).unwrap();
        assert!(matches!(loan.get(), Err(Error::InvalidArgument { .. })));
        drop(loan);
        assert_eq!(pooled_under((Device::Host, bytes)), 0);
        assert_eq!(clear_key(Device::Host, other), 1);
    }
}
