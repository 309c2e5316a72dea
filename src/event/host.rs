//! The host backend's event: generations of records, each completed by a stream job.
//!
//! Rules:
//! - Each `record` starts a new generation; the event's state is that of its latest one.
//! - A wait captures a generation and returns once that generation has completed, whatever
//!   is recorded later (the `cudaStreamWaitEvent` rule).
//! - A record whose job could not be queued is undone (the event stays as it was, as after a
//!   failed `cudaEventRecord`), so no one waits for it and an earlier pending record still
//!   counts.
//! - A generation becomes visible (to `pending_generation`, hence to `wait_event`) only with
//!   its completion job already queued: the record holds the event's lock through the submit.
//!   A wait queued on the same stream in between would sit in front of that job and block the
//!   stream's worker forever. Lock order: the event's lock, then the queue's.
//! - A pending generation remembers its queue: a host wait for it from a job of that queue
//!   (behind which its completion job sits) fails at once instead of waiting forever.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use crate::error::Result;
use crate::monitor::{Monitor, MonitorGuard};
use crate::stream::host::QueueId;
use crate::stream::HostQueue;

/// Shared state of one host event.
#[derive(Default)]
pub(crate) struct HostEventState {
    /// The generations; waiters are woken whenever one completes.
    state: Monitor<Generations>,
}

#[derive(Default)]
struct Generations {
    /// The latest generation handed out (0: never recorded).
    recorded: u64,
    /// Generations recorded and not yet completed, with the queue that completes each.
    pending: BTreeMap<u64, QueueId>,
    /// When the latest generation completed (timing).
    latest_completed_at: Option<Instant>,
}

impl HostEventState {
    fn lock(&self) -> MonitorGuard<'_, Generations> {
        self.state.lock()
    }

    /// Records a new generation at the end of `queue`: complete at once when the queue is
    /// idle (everything before the record has finished; work queued later is after it), else
    /// completed by a job queued now (see the module rules).
    ///
    /// # Errors
    ///
    /// The queue's, when the job cannot be queued (the record is undone then).
    pub(crate) fn record_on(self: &Arc<Self>, queue: &HostQueue) -> Result<()> {
        let mut g = self.lock();
        g.recorded += 1;
        let generation = g.recorded;
        if queue.is_idle() {
            g.latest_completed_at = Some(Instant::now());
            return Ok(());
        }
        g.pending.insert(generation, queue.id());
        let former_completed_at = g.latest_completed_at.take();
        let state = Arc::clone(self);
        let queued = queue.submit(Box::new(move || {
            state.complete(generation);
            Ok(())
        }));
        if queued.is_err() {
            // Undone, as a failed `cudaEventRecord` leaves the event as it was: completing the
            // new generation instead would hide a record still pending on another stream.
            // Nobody saw it: the lock was held throughout.
            g.pending.remove(&generation);
            g.recorded -= 1;
            g.latest_completed_at = former_completed_at;
        }
        queued
    }

    /// Marks `generation` complete and wakes waiters.
    pub(crate) fn complete(&self, generation: u64) {
        self.state.update(|g| {
            g.pending.remove(&generation);
            if generation == g.recorded {
                g.latest_completed_at = Some(Instant::now());
            }
        });
    }

    /// The latest generation if it has not completed yet.
    pub(crate) fn pending_generation(&self) -> Option<u64> {
        let g = self.lock();
        g.pending.contains_key(&g.recorded).then_some(g.recorded)
    }

    /// Blocks until `generation` has completed.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) at once when the current
    /// thread runs a job of the queue that completes it (see the module rules).
    pub(crate) fn wait(&self, generation: u64) -> Result<()> {
        let g = self.lock();
        if let Some(queue) = g.pending.get(&generation) {
            queue.refuse_wait_from_own_job("waiting on the host for an event recorded on its host stream")?;
        }
        drop(self.state.wait_while(g, |g| g.pending.contains_key(&generation)));
        Ok(())
    }

    /// Whether the event was ever recorded, and when its latest record completed.
    pub(crate) fn timing(&self) -> (bool, Option<Instant>) {
        let g = self.lock();
        (g.recorded > 0, g.latest_completed_at)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{mpsc, Arc};

    use super::HostEventState;
    use crate::stream::HostQueue;

    /// A record that cannot be queued leaves the event as it was: a record still pending on
    /// another queue stays pending (waits and queries still cover its work), and the failed
    /// one is not waited for.
    #[test]
    fn a_failed_record_leaves_an_earlier_pending_one() {
        let live = HostQueue::new(9101).unwrap();
        let (open, gate) = mpsc::channel::<()>();
        live.submit(Box::new(move || {
            let _ = gate.recv();
            Ok(())
        }))
        .unwrap();
        let event = Arc::new(HostEventState::default());
        event.record_on(&live).unwrap();
        assert_eq!(event.pending_generation(), Some(1));
        let dead = HostQueue::dead(1); // busy, so the record needs a job, which fails
        assert!(event.record_on(&dead).is_err());
        assert_eq!(event.pending_generation(), Some(1), "the failed record hid the pending one");
        assert_eq!(event.timing(), (true, None), "the event read as complete");
        open.send(()).unwrap();
        live.synchronize().unwrap();
        assert_eq!(event.pending_generation(), None);
        assert!(event.timing().1.is_some());
    }
}
