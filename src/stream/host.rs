//! The host backend's stream: an in-order queue of jobs served by one worker thread.
//!
//! Rules:
//! - Jobs run one at a time, in the order they were submitted.
//! - A job that fails or panics does not stop the queue: its error (the first since the last
//!   check) is kept and returned by the next `query`, or by the next `synchronize` that waited
//!   for that job (one called before the job was submitted leaves it for a later check).
//! - Dropping the queue closes the channel; the worker finishes every job already queued and
//!   exits on its own (like `cudaStreamDestroy`, the drop does not wait).
//! - Fast path for short jobs (`submit_or_run`): on an idle queue (every submitted job
//!   finished) the job runs at once on the calling thread, counted as submitted and completed
//!   like any other, so `synchronize`, `query` and event records see it in queue order. Jobs
//!   run under the queue's execution lock (the worker takes it for each job too), so a job
//!   submitted while an inline one runs waits for it: queue order holds across threads. This
//!   spares two thread hand-offs (worker wake-up, waiter wake-up), which cost more than a short
//!   job itself. A job is counted finished before its runner lets go of the execution lock, so
//!   jobs are counted in the order they ran even when an inline runner and the worker take
//!   turns (the counter numbers the failed job its error belongs to). A thread whose
//!   thread-locals are being destroyed (a user's thread-local dropping cuferry objects at
//!   thread exit) never runs a job inline: it could not mark itself as running it.
//! - A thread knows when it is running a job ([`in_job`]), and of which queues
//!   ([`QueueId::runs_on_this_thread`]), so code that would wait for queued work (a deferred
//!   free past its caps) can avoid waiting for work behind itself. A job that waits for its
//!   own queue (its `synchronize`, or an event recorded on it after the job) would wait
//!   forever: those waits fail at once instead ([`Error::InvalidArgument`]), as CUDA refuses
//!   stream calls from inside a host function.

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard};

use crossbeam_channel::{unbounded, Receiver, Sender};

use crate::error::{Error, Result};
use crate::monitor::{Monitor, MonitorGuard};

/// One unit of queued work.
pub(crate) type Job = Box<dyn FnOnce() -> Result<()> + Send + 'static>;

/// Counters shared by the queue handle and its worker.
#[derive(Default)]
struct Progress {
    /// Jobs submitted and jobs finished, and the first unreported job error; waiters are
    /// woken whenever a job finishes.
    state: Monitor<ProgressState>,
    /// Held while a job runs, by the worker or by an inline caller: one job at a time.
    exec: Mutex<()>,
}

#[derive(Default)]
struct ProgressState {
    submitted: u64,
    completed: u64,
    /// The failed job's number (jobs finish in submission order, so the `n`-th to finish is
    /// the `n`-th submitted) and its error.
    error: Option<(u64, Error)>,
}

impl Progress {
    fn lock(&self) -> MonitorGuard<'_, ProgressState> {
        self.state.lock()
    }

    fn exec(&self) -> MutexGuard<'_, ()> {
        self.exec.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// True when every submitted job has finished; returns a kept job error first.
    fn query(&self) -> Result<bool> {
        let mut st = self.lock();
        if let Some((_, err)) = st.error.take() {
            return Err(err);
        }
        Ok(st.completed == st.submitted)
    }

    /// Runs one job (panics caught) under the execution lock and counts it finished.
    fn run(&self, job: Job) {
        self.run_holding(job, self.exec());
    }

    /// Runs one job (panics caught) while `running` (the execution lock) is held, counts the
    /// job finished, and releases the lock. In that order: released first, the next job (run
    /// by another thread) could be counted before this one and take its number, so a failed
    /// job's error would go to the wrong `synchronize`. Taking the state lock here, under the
    /// execution lock, cannot deadlock with `submit_or_run`, which takes them the other way
    /// round only on an idle queue: there the execution lock is free, or held by a runner
    /// that has counted its job and takes neither lock again before letting it go.
    fn run_holding(&self, job: Job, running: MutexGuard<'_, ()>) {
        let id = QueueId::of(self);
        // Unmarked only on a thread whose thread-locals are being destroyed, which runs no job
        // inline (see `submit_or_run`): a worker's are destroyed after its last job.
        let marked = RUNNING.try_with(|r| r.borrow_mut().push(id)).is_ok();
        let outcome = catch_unwind(AssertUnwindSafe(job))
            .unwrap_or_else(|panic| Err(Error::HostFnPanicked { message: take_panic_message(panic) }));
        if marked {
            let _ = RUNNING.try_with(|r| r.borrow_mut().pop());
        }
        self.state.update(|st| {
            st.completed += 1;
            if let Err(err) = outcome {
                let job = st.completed;
                st.error.get_or_insert((job, err));
            }
        });
        drop(running);
        #[cfg(test)]
        let _ = AFTER_RELEASE.try_with(|hook| {
            if let Some(hook) = hook.borrow_mut().as_mut() {
                hook();
            }
        });
    }
}

#[cfg(test)]
thread_local! {
    /// Test hook: runs on the thread that ran a job, right after it released the execution
    /// lock (another thread may run the next job meanwhile).
    static AFTER_RELEASE: RefCell<Option<Box<dyn FnMut()>>> = const { RefCell::new(None) };
    /// Test hook: runs in `submit` on the submitting thread, after the job was counted and
    /// before it is sent.
    static BEFORE_SEND: RefCell<Option<Box<dyn FnMut()>>> = const { RefCell::new(None) };
}

thread_local! {
    /// The queues whose jobs the current thread is running, innermost last (several when a
    /// job runs another queue's job inline). Read with `try_with`: a buffer or stream kept in a
    /// user's thread-local may be dropped (and wait, or run a job inline) after this one was
    /// destroyed at thread exit, where `with` panics and so aborts the process. A thread
    /// there runs no job: [`HostQueue::submit_or_run`] queues it for the worker instead.
    static RUNNING: RefCell<Vec<QueueId>> = const { RefCell::new(Vec::new()) };
}

/// Whether the current thread is running a host-stream job (on a worker, or inline): a wait
/// here for work queued behind the job would never end.
pub(crate) fn in_job() -> bool {
    RUNNING.try_with(|r| !r.borrow().is_empty()).unwrap_or(false)
}

/// Names one host queue (the address of its shared counters, unique while the queue's worker
/// or any handle lives: a queue running a job is alive).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QueueId(usize);

impl QueueId {
    fn of(progress: &Progress) -> Self {
        QueueId(progress as *const Progress as usize)
    }

    /// Whether the current thread is running a job of this queue: anything queued on it now
    /// runs after that job, so waiting for it here would never end.
    pub(crate) fn runs_on_this_thread(self) -> bool {
        RUNNING.try_with(|r| r.borrow().contains(&self)).unwrap_or(false)
    }

    /// [`Error::InvalidArgument`] when the current thread runs a job of this queue (see
    /// [`QueueId::runs_on_this_thread`]); `what` names the wait.
    pub(crate) fn refuse_wait_from_own_job(self, what: &str) -> Result<()> {
        if self.runs_on_this_thread() {
            return Err(Error::invalid(format!(
                "{what} from a job of the same host stream would wait forever (the stream runs its \
                 jobs in order, and this one is still running)"
            )));
        }
        Ok(())
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
            .map_err(|e| Error::thread_refused("a host stream worker thread", e))?;
        Ok(HostQueue { sender, progress })
    }

    /// Queues `job` after everything submitted before.
    pub(crate) fn submit(&self, job: Job) -> Result<()> {
        // Counted and sent under one lock, so that jobs are numbered in the order the worker
        // gets them (a failed job's error goes to the `synchronize` whose count includes its
        // number). Counted, then sent after the lock was released, a job another thread
        // submitted in between would run first under this one's number: a `synchronize`
        // counting only up to this job would take that later job's error, and return before
        // this one ran. The channel is unbounded, so the send never blocks.
        let mut st = self.progress.lock();
        st.submitted += 1;
        #[cfg(test)]
        let _ = BEFORE_SEND.try_with(|hook| {
            if let Some(hook) = hook.borrow_mut().as_mut() {
                hook();
            }
        });
        let Err(unsent) = self.sender.send(job) else { return Ok(()) };
        // No one saw the count (the lock was held throughout): take it back.
        st.submitted -= 1;
        drop(st);
        // The job is dropped here, with the lock released: what it owns may use the stream.
        drop(unsent);
        Err(Error::unsupported("the host stream's worker thread is gone"))
    }

    /// Runs `job` now on the calling thread when every submitted job has finished, else queues
    /// it (see the module rules). For short jobs that touch only memory: the caller runs them,
    /// possibly while holding locks.
    /// On a thread whose thread-locals are being destroyed the job is always queued: run
    /// inline there it could not be marked as running, and a wait in it for its own stream
    /// would never end instead of failing.
    pub(crate) fn submit_or_run(&self, job: Job) -> Result<()> {
        if RUNNING.try_with(|_| ()).is_err() {
            return self.submit(job);
        }
        let mut st = self.progress.lock();
        if st.completed != st.submitted {
            drop(st);
            return self.submit(job);
        }
        st.submitted += 1;
        // Claimed in queue order: a job submitted after this point waits for the execution
        // lock taken here (taken before the state lock is released, so it cannot slip ahead).
        let running = self.progress.exec();
        drop(st);
        self.progress.run_holding(job, running);
        Ok(())
    }

    /// A queue whose worker is gone (every submit fails), with `unfinished` jobs counted as
    /// submitted and never finishing.
    #[cfg(test)]
    pub(crate) fn dead(unfinished: u64) -> HostQueue {
        let (sender, receiver) = unbounded();
        drop(receiver);
        let progress = Arc::new(Progress::default());
        progress.lock().submitted = unfinished;
        HostQueue { sender, progress }
    }

    /// True when every submitted job has finished (errors are left for `synchronize`).
    pub(crate) fn is_idle(&self) -> bool {
        let st = self.progress.lock();
        st.completed == st.submitted
    }

    /// This queue's name.
    pub(crate) fn id(&self) -> QueueId {
        QueueId::of(&self.progress)
    }

    /// Waits for every job submitted before the call; returns the first job error since the
    /// last check.
    ///
    /// # Errors
    ///
    /// The job error; [`Error::InvalidArgument`] at once from a job of this queue.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.id().refuse_wait_from_own_job("synchronizing a host stream")?;
        let (mut st, target) = self.wait_submitted();
        match st.error.take() {
            Some((job, err)) if job <= target => Err(err),
            later => {
                // A job submitted after this call failed: its own waiter reports it.
                st.error = later;
                Ok(())
            }
        }
    }

    /// Waits for every job submitted before the call, leaving a job error for the next
    /// `synchronize` or `query`.
    pub(crate) fn wait_idle(&self) {
        drop(self.wait_submitted().0);
    }

    /// Waits until every job submitted before the call has finished; returns the state,
    /// locked, and the number of the last job waited for.
    fn wait_submitted(&self) -> (MonitorGuard<'_, ProgressState>, u64) {
        let st = self.progress.lock();
        let target = st.submitted;
        (self.progress.state.wait_while(st, |st| st.completed < target), target)
    }

    /// True when every submitted job has finished; returns a pending job error first.
    pub(crate) fn query(&self) -> Result<bool> {
        self.progress.query()
    }

    /// A handle to the queue's kept job error that outlives the queue without keeping its
    /// worker thread.
    pub(crate) fn errors(&self) -> HostErrors {
        HostErrors(Arc::clone(&self.progress))
    }
}

/// The job counters and kept error of a host queue, readable after the queue is dropped (its
/// worker finishes the queued jobs and exits; this keeps only the counters).
#[derive(Clone)]
pub(crate) struct HostErrors(Arc<Progress>);

impl HostErrors {
    /// As [`HostQueue::query`].
    pub(crate) fn query(&self) -> Result<bool> {
        self.0.query()
    }

    /// Whether every submitted job has finished and no error is kept.
    pub(crate) fn is_settled(&self) -> bool {
        let st = self.0.lock();
        st.completed == st.submitted && st.error.is_none()
    }
}

/// The worker: runs jobs until the queue is dropped and drained.
fn serve(receiver: Receiver<Job>, progress: Arc<Progress>) {
    for job in receiver {
        progress.run(job);
    }
}

/// The text of a caught panic's payload, when it has one; the payload is then discarded
/// ([`discard_panic`]).
pub(crate) fn take_panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    let message = panic_message(payload.as_ref());
    discard_panic(payload);
    message
}

/// Drops a caught panic's payload where its own drop cannot unwind any further: a payload
/// whose drop panics again (user code can panic with any value) is leaked, not allowed to
/// kill a worker thread or cross a C boundary.
pub(crate) fn discard_panic(payload: Box<dyn std::any::Any + Send>) {
    if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
        std::mem::forget(again);
    }
}

/// The text of a panic payload, when it has one.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::sync::{Arc, Mutex};
    use std::thread;
    use std::time::Duration;

    use super::HostQueue;
    use crate::error::Error;

    fn log_job(log: &Arc<Mutex<Vec<(&'static str, thread::ThreadId)>>>, name: &'static str) -> super::Job {
        let log = Arc::clone(log);
        Box::new(move || {
            log.lock().unwrap().push((name, thread::current().id()));
            Ok(())
        })
    }

    /// Waits racing submits that fail (the worker is gone) all return: a waiter that counted a
    /// job whose submit then failed is not left waiting for it.
    #[test]
    fn waits_racing_failed_submits_return() {
        let q = Arc::new(HostQueue::dead(0));
        let (done, finished) = mpsc::channel();
        let waiter = {
            let q = Arc::clone(&q);
            thread::spawn(move || {
                for _ in 0..100_000 {
                    q.wait_idle();
                }
                let _ = done.send(());
            })
        };
        let mut returned = false;
        for _ in 0..100_000 {
            assert!(q.submit(Box::new(|| Ok(()))).is_err());
            if finished.try_recv().is_ok() {
                returned = true;
                break;
            }
        }
        returned = returned || finished.recv_timeout(Duration::from_secs(20)).is_ok();
        assert!(returned, "a wait counted a job whose submit failed and never returned");
        waiter.join().unwrap();
        assert!(q.is_idle());
    }

    #[test]
    fn short_jobs_run_inline_only_on_an_idle_queue() {
        let q = HostQueue::new(9001).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        // Idle: runs on this thread, and the queue counts it.
        q.submit_or_run(log_job(&log, "inline")).unwrap();
        assert!(q.is_idle());
        // Busy (a job waits on a channel): the short job is queued behind it.
        let (release, gate) = mpsc::channel::<()>();
        q.submit(Box::new(move || {
            let _ = gate.recv();
            Ok(())
        }))
        .unwrap();
        q.submit_or_run(log_job(&log, "queued")).unwrap();
        assert!(!q.is_idle());
        release.send(()).unwrap();
        q.synchronize().unwrap();
        let log = log.lock().unwrap();
        assert_eq!(log.iter().map(|e| e.0).collect::<Vec<_>>(), ["inline", "queued"]);
        assert_eq!(log[0].1, thread::current().id());
        assert_ne!(log[1].1, thread::current().id());
    }

    #[test]
    fn a_job_submitted_during_an_inline_job_runs_after_it() {
        let q = Arc::new(HostQueue::new(9002).unwrap());
        let log = Arc::new(Mutex::new(Vec::new()));
        let (started, wait_started) = mpsc::channel::<()>();
        let inline_log = Arc::clone(&log);
        let q2 = Arc::clone(&q);
        let runner = thread::spawn(move || {
            q2.submit_or_run(Box::new(move || {
                started.send(()).unwrap();
                thread::sleep(Duration::from_millis(30));
                inline_log.lock().unwrap().push(("inline", thread::current().id()));
                Ok(())
            }))
            .unwrap();
        });
        wait_started.recv().unwrap();
        // The inline job is running: this one is queued and must not overtake it.
        q.submit_or_run(log_job(&log, "later")).unwrap();
        q.synchronize().unwrap();
        runner.join().unwrap();
        assert_eq!(log.lock().unwrap().iter().map(|e| e.0).collect::<Vec<_>>(), ["inline", "later"]);
    }

    /// A `synchronize` reports only errors of jobs submitted before it: a job submitted while
    /// it waits fails, and that error is left for the next check, not taken by the earlier
    /// waiter (whose own job succeeded). Deterministic with the rule; without it the early
    /// waiter takes the error whenever the later job finishes before it wakes (most rounds).
    #[test]
    fn synchronize_leaves_the_error_of_a_later_job() {
        let q = Arc::new(HostQueue::new(9005).unwrap());
        for round in 0..20 {
            let (release, gate) = mpsc::channel::<()>();
            q.submit(Box::new(move || {
                let _ = gate.recv();
                Ok(())
            }))
            .unwrap();
            let early = {
                let q = Arc::clone(&q);
                thread::spawn(move || q.synchronize())
            };
            // Counted as waiting: it has taken its target (the gated job) under the lock.
            let started = std::time::Instant::now();
            while q.progress.state.waiters() == 0 {
                assert!(started.elapsed() < Duration::from_secs(10), "the early waiter never waited");
                thread::yield_now();
            }
            q.submit(Box::new(|| Err(Error::invalid("the later job failed")))).unwrap();
            release.send(()).unwrap();
            let early = early.join().unwrap();
            assert!(early.is_ok(), "round {round}: the early waiter took a later job's error: {early:?}");
            let later = q.synchronize();
            assert!(
                matches!(&later, Err(Error::InvalidArgument { what }) if what.contains("later job")),
                "round {round}: {later:?}"
            );
        }
    }

    /// An inline job fails while a `synchronize` waits for it and the worker waits to run the
    /// next job: when the inline runner lets go of the execution lock, the worker runs that
    /// job at once (the hook holds the runner until then). The waiter still gets the inline
    /// job's error: the next job, finished first in time, must not be counted as the one
    /// waited for.
    #[test]
    fn an_inline_jobs_error_reaches_its_waiter_when_the_worker_runs_the_next_job_at_once() {
        let q = Arc::new(HostQueue::new(9006).unwrap());
        let (next_ran, next_done) = mpsc::channel::<()>();
        let (release, gate) = mpsc::channel::<()>();
        let (started, inline_started) = mpsc::channel::<()>();
        let runner = {
            let q = Arc::clone(&q);
            thread::spawn(move || {
                // On this thread only: once the inline job released the lock, wait for the
                // worker to run (and count) the next job before this thread goes on.
                super::AFTER_RELEASE.with(|hook| {
                    *hook.borrow_mut() = Some(Box::new(move || {
                        let _ = next_done.recv_timeout(Duration::from_secs(10));
                        thread::sleep(Duration::from_millis(20));
                    }));
                });
                q.submit_or_run(Box::new(move || {
                    started.send(()).unwrap();
                    let _ = gate.recv();
                    Err(Error::invalid("the inline job failed"))
                }))
            })
        };
        inline_started.recv().unwrap();
        let waiter = {
            let q = Arc::clone(&q);
            thread::spawn(move || q.synchronize())
        };
        let since = std::time::Instant::now();
        while q.progress.state.waiters() == 0 {
            assert!(since.elapsed() < Duration::from_secs(10), "the waiter never waited");
            thread::yield_now();
        }
        q.submit(Box::new(move || {
            next_ran.send(()).unwrap();
            Ok(())
        }))
        .unwrap();
        release.send(()).unwrap();
        let waited = waiter.join().unwrap();
        assert!(
            matches!(&waited, Err(Error::InvalidArgument { what }) if what.contains("inline job")),
            "the waiter of the failed inline job got {waited:?}"
        );
        runner.join().unwrap().unwrap();
        q.synchronize().unwrap();
    }

    #[test]
    fn wait_idle_waits_and_leaves_the_error_for_synchronize() {
        let q = HostQueue::new(9004).unwrap();
        let (release, gate) = mpsc::channel::<()>();
        q.submit(Box::new(move || {
            let _ = gate.recv();
            Err(Error::invalid("job failed"))
        }))
        .unwrap();
        let waiter = thread::spawn(move || {
            q.wait_idle();
            q
        });
        thread::sleep(Duration::from_millis(20));
        assert!(!waiter.is_finished(), "wait_idle returned before the job ran");
        release.send(()).unwrap();
        let q = waiter.join().unwrap();
        assert!(q.is_idle());
        assert!(matches!(q.synchronize(), Err(Error::InvalidArgument { .. })));
        q.synchronize().unwrap();
    }

    /// A submit is held between counting its job and sending it (the hook) while a
    /// `synchronize` starts and another thread submits a failing job. The `synchronize`,
    /// whose count includes the held job, must not return before that job ran: counted and
    /// sent apart, the later job ran under the held one's number and the `synchronize` took
    /// its error at once.
    #[test]
    fn a_synchronize_returns_after_every_job_it_counted_despite_racing_submits() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let q = Arc::new(HostQueue::new(9006).unwrap());
        let held_ran = Arc::new(AtomicBool::new(false));
        let (counted, on_counted) = mpsc::channel::<()>();
        let (release, gate) = mpsc::channel::<()>();
        let held = {
            let (q, ran) = (Arc::clone(&q), Arc::clone(&held_ran));
            thread::spawn(move || {
                super::BEFORE_SEND.with(|hook| {
                    *hook.borrow_mut() = Some(Box::new(move || {
                        let _ = counted.send(());
                        let _ = gate.recv();
                    }))
                });
                q.submit(Box::new(move || {
                    ran.store(true, Ordering::SeqCst);
                    Ok(())
                }))
            })
        };
        on_counted.recv().unwrap();
        let waiter = {
            let (q, ran) = (Arc::clone(&q), Arc::clone(&held_ran));
            thread::spawn(move || {
                let got = q.synchronize();
                (got, ran.load(Ordering::SeqCst))
            })
        };
        thread::sleep(Duration::from_millis(50));
        let later = {
            let q = Arc::clone(&q);
            thread::spawn(move || q.submit(Box::new(|| Err(Error::invalid("the later job failed")))))
        };
        thread::sleep(Duration::from_millis(50));
        release.send(()).unwrap();
        held.join().unwrap().unwrap();
        later.join().unwrap().unwrap();
        let (got, ran_first) = waiter.join().unwrap();
        assert!(ran_first, "synchronize returned ({got:?}) before a job it counted had run");
        // Whichever of the two the waiter counted, the later job's error is reported once.
        if got.is_ok() {
            assert!(q.synchronize().is_err());
        }
        q.synchronize().unwrap();
    }

    /// A buffer kept in a user's thread-local is dropped at thread exit, after cuferry's own
    /// thread-locals may have been destroyed: its drop (which asks whether the thread runs a
    /// job) and a stream's `synchronize` there must work, not panic (which aborts the
    /// process from a thread-local destructor).
    #[test]
    fn buffers_and_streams_in_a_thread_local_are_dropped_at_thread_exit() {
        use std::cell::RefCell;
        struct Kept(Option<(crate::Stream, crate::PinnedBuffer<u8>)>);
        impl Drop for Kept {
            fn drop(&mut self) {
                if let Some((stream, buffer)) = self.0.take() {
                    stream.synchronize().unwrap();
                    drop(buffer);
                }
            }
        }
        thread_local! {
            static KEPT: RefCell<Kept> = const { RefCell::new(Kept(None)) };
        }
        let t = thread::spawn(|| {
            // Registered first, so destroyed after the thread-locals cuferry touches below.
            KEPT.with(|_| {});
            let stream = crate::Stream::new(crate::Device::Host).unwrap();
            let buffer = crate::PinnedBuffer::<u8>::zeroed(crate::Device::Host, 64).unwrap();
            stream.host_fn(|| ()).unwrap();
            stream.synchronize().unwrap();
            KEPT.with(|k| k.borrow_mut().0 = Some((stream, buffer)));
        });
        assert!(t.join().is_ok(), "the thread panicked");
    }

    /// A job submitted from a user's thread-local destructor, after cuferry's own were
    /// destroyed, runs on the worker, where it is marked as running: its wait for its own
    /// queue fails at once. Run inline there, unmarked, that wait would never end.
    #[test]
    fn a_job_submitted_at_thread_exit_waiting_for_its_own_queue_fails_instead_of_hanging() {
        use std::cell::RefCell;
        struct SubmitOnDrop(Option<(Arc<HostQueue>, mpsc::Sender<crate::Result<()>>)>);
        impl Drop for SubmitOnDrop {
            fn drop(&mut self) {
                if let Some((q, tx)) = self.0.take() {
                    let own = Arc::clone(&q);
                    q.submit_or_run(Box::new(move || {
                        let _ = tx.send(own.synchronize());
                        Ok(())
                    }))
                    .unwrap();
                }
            }
        }
        thread_local! {
            static KEPT: RefCell<SubmitOnDrop> = const { RefCell::new(SubmitOnDrop(None)) };
        }
        let (tx, rx) = mpsc::channel();
        let q = Arc::new(HostQueue::new(9004).unwrap());
        thread::spawn(move || {
            // Registered first, so destroyed after `RUNNING`, which the job below touches.
            KEPT.with(|_| {});
            q.submit_or_run(Box::new(|| Ok(()))).unwrap();
            q.synchronize().unwrap();
            KEPT.with(|k| k.borrow_mut().0 = Some((q, tx)));
        });
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(Err(Error::InvalidArgument { what })) => assert!(what.contains("wait forever"), "{what}"),
            other => panic!("the job's wait for its own queue gave {other:?} (a timeout: it hung)"),
        }
    }

    #[test]
    fn a_panicking_inline_job_is_reported_by_synchronize() {
        let q = HostQueue::new(9003).unwrap();
        q.submit_or_run(Box::new(|| panic!("inline boom"))).unwrap();
        match q.synchronize() {
            Err(Error::HostFnPanicked { message }) => assert!(message.contains("inline boom")),
            other => panic!("expected the panic, got {other:?}"),
        }
        q.submit_or_run(Box::new(|| Ok(()))).unwrap();
        q.synchronize().unwrap();
    }
}
