//! The host backend's stream: an in-order queue of jobs served by one worker thread.
//!
//! Rules:
//! - Jobs run one at a time, in the order they were submitted.
//! - A job that fails or panics does not stop the queue: its error (the first since the last
//!   check) is kept and returned by the next `synchronize` or `query`.
//! - Dropping the queue closes the channel; the worker finishes every job already queued and
//!   exits on its own (like `cudaStreamDestroy`, the drop does not wait).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crossbeam_channel::{unbounded, Receiver, Sender};

use crate::error::{Error, Result};

/// One unit of queued work.
pub(crate) type Job = Box<dyn FnOnce() -> Result<()> + Send + 'static>;

/// Counters shared by the queue handle and its worker.
#[derive(Default)]
struct Progress {
    /// Jobs submitted and jobs finished, and the first unreported job error.
    state: Mutex<ProgressState>,
    /// Signalled whenever a job finishes.
    finished: Condvar,
}

#[derive(Default)]
struct ProgressState {
    submitted: u64,
    completed: u64,
    error: Option<Error>,
}

impl Progress {
    fn lock(&self) -> MutexGuard<'_, ProgressState> {
        // A poisoned lock only means a panic elsewhere while holding it; the counters are
        // still consistent (each update is a single assignment).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An in-order job queue with one worker thread.
pub(crate) struct HostQueue {
    sender: Sender<Job>,
    progress: Arc<Progress>,
}

impl HostQueue {
    /// Starts the worker thread.
    pub(crate) fn new(id: u64) -> Result<Self> {
        let (sender, receiver) = unbounded::<Job>();
        let progress = Arc::new(Progress::default());
        let worker_progress = Arc::clone(&progress);
        std::thread::Builder::new()
            .name(format!("cuferry-host-stream-{id}"))
            .spawn(move || serve(receiver, worker_progress))
            .map_err(|e| Error::unsupported(format!("cannot start a host stream worker thread: {e}")))?;
        Ok(HostQueue { sender, progress })
    }

    /// Queues `job` after everything submitted before.
    pub(crate) fn submit(&self, job: Job) -> Result<()> {
        self.progress.lock().submitted += 1;
        if self.sender.send(job).is_err() {
            let mut st = self.progress.lock();
            st.submitted -= 1;
            return Err(Error::unsupported("the host stream's worker thread is gone"));
        }
        Ok(())
    }

    /// Waits for every job submitted before the call; returns the first job error since the
    /// last check.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let mut st = self.progress.lock();
        let target = st.submitted;
        while st.completed < target {
            st = self.progress.finished.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.error.take().map_or(Ok(()), Err)
    }

    /// True when every submitted job has finished; returns a pending job error first.
    pub(crate) fn query(&self) -> Result<bool> {
        let mut st = self.progress.lock();
        if let Some(err) = st.error.take() {
            return Err(err);
        }
        Ok(st.completed == st.submitted)
    }
}

/// The worker: runs jobs until the queue is dropped and drained.
fn serve(receiver: Receiver<Job>, progress: Arc<Progress>) {
    for job in receiver {
        let outcome = catch_unwind(AssertUnwindSafe(job))
            .unwrap_or_else(|panic| Err(Error::HostFnPanicked { message: panic_message(panic.as_ref()) }));
        let mut st = progress.lock();
        st.completed += 1;
        if let Err(err) = outcome {
            st.error.get_or_insert(err);
        }
        drop(st);
        progress.finished.notify_all();
    }
}

/// The text of a panic payload, when it has one.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}
