//! Use tracking: the ordering and lifetime protocol every buffer follows.
//!
//! Rules:
//! - Each buffer remembers an event recorded right after the last operation queued on it; the
//!   buffers of one operation share that event (one record per operation).
//! - An operation queued on a stream other than the last one first makes that stream wait for
//!   the remembered event, so operations on one buffer run in the order they were queued,
//!   whichever streams they were queued on.
//! - Before host code touches the memory, and before the memory is freed, the host waits for
//!   the remembered event. Freeing therefore never races queued work.
//! - The tracker's lock is held from the wait through the record, so two threads queueing on
//!   one buffer cannot interleave between an operation and its record.
//! - An operation whose queueing failed is recorded too (it may have queued part of its work
//!   before failing); when even the record fails, the host waits for the stream instead.
//! - An operation locks its buffers' trackers in address order, whatever order the caller
//!   lists them in: two threads queueing on the same buffers cannot deadlock.
//! - Memory allocated in stream order (managed pools) names its allocation stream: the first
//!   use on another stream waits for that stream first.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::Result;
use crate::event::Event;
use crate::stream::Stream;

/// The last queued use of one buffer.
#[derive(Debug)]
struct LastUse {
    /// Recorded on `stream` right after the operation; shared by every buffer the operation
    /// used (one record per operation, not one per buffer).
    event: Arc<Event>,
    /// The stream the operation was queued on.
    stream: Stream,
}

/// Orders and tracks the asynchronous uses of one buffer.
#[derive(Debug, Default)]
pub(crate) struct UseTracker {
    last: Mutex<Option<LastUse>>,
    /// For stream-ordered allocations: the stream the memory was allocated on. The first use
    /// on another stream waits for that stream's work so far (the allocation included).
    origin: Option<Stream>,
}

impl UseTracker {
    /// A tracker for memory allocated in stream order on `origin`.
    pub(crate) fn with_origin(origin: Stream) -> Self {
        UseTracker { last: Mutex::new(None), origin: Some(origin) }
    }

    /// The allocation stream of stream-ordered memory.
    pub(crate) fn origin(&self) -> Option<&Stream> {
        self.origin.as_ref()
    }

    /// The stream of the last queued use, else the allocation stream, if any.
    pub(crate) fn last_stream(&self) -> Option<Stream> {
        self.lock().as_ref().map(|l| l.stream.clone()).or_else(|| self.origin.clone())
    }

    fn lock(&self) -> MutexGuard<'_, Option<LastUse>> {
        self.last.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues an operation on `stream` that uses every buffer in `trackers`: orders it after
    /// their earlier uses, runs `enqueue` (which queues the operation), and records the use.
    ///
    /// `trackers` must not hold the same tracker twice (callers pass one per distinct buffer).
    pub(crate) fn use_on(
        stream: &Stream,
        trackers: &[&UseTracker],
        enqueue: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        // Locked in one global order (by address): two operations naming the same buffers in
        // different orders, on two threads, would otherwise deadlock. Nothing below depends on
        // the caller's order.
        let mut trackers: Vec<&UseTracker> = trackers.to_vec();
        trackers.sort_unstable_by_key(|t| std::ptr::from_ref::<UseTracker>(t) as usize);
        let mut guards: Vec<MutexGuard<'_, Option<LastUse>>> = trackers.iter().map(|t| t.lock()).collect();
        let mut waited: Vec<&Arc<Event>> = Vec::new();
        for (tracker, guard) in trackers.iter().zip(&guards) {
            match (guard.as_ref(), &tracker.origin) {
                // Buffers used together last time share one event: wait for it once.
                (Some(last), _)
                    if last.stream.id() != stream.id()
                        && !waited.iter().any(|e| Arc::ptr_eq(e, &last.event)) =>
                {
                    stream.wait_event(&last.event)?;
                    waited.push(&last.event);
                }
                (None, Some(origin)) if origin.id() != stream.id() => {
                    // First use away from the allocation stream: order after it.
                    let allocated = Event::new(origin.device())?;
                    allocated.record(origin)?;
                    stream.wait_event(&allocated)?;
                }
                _ => {}
            }
        }
        drop(waited);
        // A failed `enqueue` may have queued part of its work (several launches, the first
        // ones accepted): the use is recorded all the same, so nothing is freed under it.
        let enqueued = enqueue();
        let recorded = reusable_event(&guards, stream)
            .map_or_else(|| Event::new(stream.device()).map(Arc::new), Ok)
            .and_then(|event| event.record(stream).map(|()| event));
        match recorded {
            Ok(event) => {
                for guard in guards.iter_mut() {
                    **guard = Some(LastUse { event: Arc::clone(&event), stream: stream.clone() });
                }
                enqueued
            }
            Err(err) => {
                // The operation may be queued but is untracked: wait for it here so nothing is
                // freed under it, then report the first failure.
                let _ = stream.wait_idle();
                enqueued.and(Err(err))
            }
        }
    }

    /// Blocks until every operation queued on the buffer so far has finished (for stream-ordered
    /// memory never used yet: until its allocation stream reached the allocation).
    pub(crate) fn wait_idle(&self) -> Result<()> {
        match self.last_event()? {
            Some(event) => event.synchronize(),
            None => Ok(()),
        }
    }

    /// True when no queued operation on the buffer is still pending; does not block.
    pub(crate) fn is_idle(&self) -> Result<bool> {
        match self.last_event()? {
            Some(event) => event.query(),
            None => Ok(true),
        }
    }

    /// The event the host waits for: the last use's, or, for stream-ordered memory not used
    /// yet, one recorded now on the allocation stream, which becomes the buffer's last use
    /// (the host must not touch the memory before the stream reached the allocation).
    fn last_event(&self) -> Result<Option<Arc<Event>>> {
        let mut guard = self.lock();
        if let Some(last) = guard.as_ref() {
            return Ok(Some(Arc::clone(&last.event)));
        }
        let Some(origin) = &self.origin else { return Ok(None) };
        let event = Arc::new(Event::new(origin.device())?);
        event.record(origin)?;
        *guard = Some(LastUse { event: Arc::clone(&event), stream: origin.clone() });
        Ok(Some(event))
    }
}

/// An event of these buffers that may be recorded again for this use: one of `stream`'s
/// device that no buffer outside `guards` still names (re-recording moves it later, which only
/// the buffers being updated here may see).
fn reusable_event(guards: &[MutexGuard<'_, Option<LastUse>>], stream: &Stream) -> Option<Arc<Event>> {
    guards.iter().filter_map(|g| g.as_ref()).find_map(|last| {
        let holders =
            guards.iter().filter_map(|g| g.as_ref()).filter(|l| Arc::ptr_eq(&l.event, &last.event)).count();
        (last.event.device() == stream.device() && Arc::strong_count(&last.event) == holders)
            .then(|| Arc::clone(&last.event))
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc};
    use std::thread;
    use std::time::Duration;

    use super::UseTracker;
    use crate::device::Device;
    use crate::stream::Stream;

    /// Two operations on buffers `a` and `b`, listed in opposite orders, on two threads,
    /// while a third use holds `b`: locked in list order, one held `a` waiting for `b` and
    /// the other got `b` and waited for `a`, for good.
    #[test]
    fn trackers_listed_in_opposite_orders_never_deadlock() {
        let (a, b) = (Arc::new(UseTracker::default()), Arc::new(UseTracker::default()));
        for round in 0..10 {
            let (done, finished) = mpsc::channel::<()>();
            let holder = {
                let b = Arc::clone(&b);
                thread::spawn(move || {
                    let stream = Stream::new(Device::Host).unwrap();
                    UseTracker::use_on(&stream, &[&b], || {
                        thread::sleep(Duration::from_millis(30));
                        Ok(())
                    })
                    .unwrap();
                })
            };
            let users: Vec<_> = [false, true]
                .into_iter()
                .map(|reversed| {
                    let (a, b, done) = (Arc::clone(&a), Arc::clone(&b), done.clone());
                    thread::spawn(move || {
                        thread::sleep(Duration::from_millis(10));
                        let stream = Stream::new(Device::Host).unwrap();
                        let list: [&UseTracker; 2] = if reversed { [&b, &a] } else { [&a, &b] };
                        UseTracker::use_on(&stream, &list, || Ok(())).unwrap();
                        done.send(()).unwrap();
                    })
                })
                .collect();
            for _ in 0..2 {
                assert!(
                    finished.recv_timeout(Duration::from_secs(10)).is_ok(),
                    "round {round}: two uses of the same buffers deadlocked"
                );
            }
            holder.join().unwrap();
            users.into_iter().for_each(|u| u.join().unwrap());
        }
    }

    /// An operation that queues work and then fails (the seed baseline's launches, the first
    /// ones accepted) is still recorded: waiting for the buffer waits for the queued part,
    /// and the failure is returned.
    #[test]
    fn a_failed_operation_still_tracks_what_it_queued() {
        let stream = Stream::new(Device::Host).unwrap();
        let tracker = UseTracker::default();
        let ran = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&ran);
        let result = UseTracker::use_on(&stream, &[&tracker], || {
            stream.host_fn(move || {
                thread::sleep(Duration::from_millis(100));
                flag.store(true, Ordering::SeqCst);
            })?;
            Err(crate::error::Error::invalid("the second launch was refused"))
        });
        assert!(
            matches!(result, Err(crate::error::Error::InvalidArgument { .. })),
            "the failure is returned: {result:?}"
        );
        tracker.wait_idle().unwrap();
        assert!(ran.load(Ordering::SeqCst), "wait_idle returned before the queued part ran");
    }

    /// Stream-ordered memory never used yet: the host waits for the allocation stream's work
    /// queued before it (a reused block may still be read there), not for nothing.
    #[test]
    fn host_access_to_unused_stream_ordered_memory_waits_for_its_stream() {
        let origin = Stream::new(Device::Host).unwrap();
        let earlier_done = Arc::new(AtomicBool::new(false));
        let (release, gate) = mpsc::channel::<()>();
        let flag = Arc::clone(&earlier_done);
        origin
            .host_fn(move || {
                let _ = gate.recv_timeout(Duration::from_secs(10));
                flag.store(true, Ordering::SeqCst);
            })
            .unwrap();
        let tracker = UseTracker::with_origin(origin.clone());
        assert!(!tracker.is_idle().unwrap(), "the allocation stream is still busy");
        let releaser = thread::spawn(move || {
            thread::sleep(Duration::from_millis(20));
            release.send(()).unwrap();
        });
        tracker.wait_idle().unwrap();
        releaser.join().unwrap();
        assert!(
            earlier_done.load(Ordering::SeqCst),
            "wait_idle returned before the allocation stream's work"
        );
        assert!(tracker.is_idle().unwrap());
        // A plain tracker has nothing to wait for.
        let plain = UseTracker::default();
        assert!(plain.is_idle().unwrap());
        plain.wait_idle().unwrap();
    }
}
