//! The host backend's event: generations of records, each completed by a stream job.
//!
//! Rules:
//! - Each `record` starts a new generation; the event's state is that of its latest one.
//! - A wait captures a generation and returns once that generation has completed, whatever
//!   is recorded later (the `cudaStreamWaitEvent` rule).
//! - A generation whose job could not be queued is completed at once, so no one waits forever.
//! - A generation becomes visible (to `pending_generation`, hence to `wait_event`) only with
//!   its completion job already queued: the record holds the event's lock through the submit.
//!   A wait queued on the same stream in between would sit in front of that job and block the
//!   stream's worker forever. Lock order: the event's lock, then the queue's.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use crate::error::Result;
use crate::monitor::{Monitor, MonitorGuard};
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
    /// Generations recorded and not yet completed.
    pending: BTreeSet<u64>,
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
    /// The queue's, when the job cannot be queued (the generation is completed then).
    pub(crate) fn record_on(self: &Arc<Self>, queue: &HostQueue) -> Result<()> {
        let mut g = self.lock();
        g.recorded += 1;
        let generation = g.recorded;
        if queue.is_idle() {
            g.latest_completed_at = Some(Instant::now());
            return Ok(());
        }
        g.pending.insert(generation);
        g.latest_completed_at = None;
        let state = Arc::clone(self);
        let queued = queue.submit(Box::new(move || {
            state.complete(generation);
            Ok(())
        }));
        if queued.is_err() {
            g.pending.remove(&generation);
            g.latest_completed_at = Some(Instant::now());
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
        g.pending.contains(&g.recorded).then_some(g.recorded)
    }

    /// Blocks until `generation` has completed.
    pub(crate) fn wait(&self, generation: u64) {
        drop(self.state.wait_while(self.lock(), |g| g.pending.contains(&generation)));
    }

    /// Whether the event was ever recorded, and when its latest record completed.
    pub(crate) fn timing(&self) -> (bool, Option<Instant>) {
        let g = self.lock();
        (g.recorded > 0, g.latest_completed_at)
    }
}
