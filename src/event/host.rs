//! The host backend's event: generations of records, each completed by a stream job.
//!
//! Rules:
//! - Each `record` starts a new generation; the event's state is that of its latest one.
//! - A wait captures a generation and returns once that generation has completed, whatever
//!   is recorded later (the `cudaStreamWaitEvent` rule).
//! - A generation whose job could not be queued is completed at once, so no one waits forever.

use std::collections::BTreeSet;
use std::time::Instant;

use crate::monitor::{Monitor, MonitorGuard};

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

    /// Starts a new generation and returns it.
    pub(crate) fn begin_record(&self) -> u64 {
        let mut g = self.lock();
        g.recorded += 1;
        let generation = g.recorded;
        g.pending.insert(generation);
        g.latest_completed_at = None;
        generation
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
