//! The helper threads of large host halo jobs: one process-wide pool that runs the parts of a
//! job next to the host stream's worker, so a job does not start threads of its own.
//!
//! Rules:
//! - [`run_scoped`] runs its first task on the calling thread and queues the rest for the
//!   helpers; it returns only after every task has run, on every path (a panicking task
//!   included), so tasks may borrow from the caller. A helper's panic is resumed on the caller
//!   once all tasks are done.
//! - Helpers start on first use, as many as the largest job has needed (at most
//!   [`MAX_HELPERS`]), and live for the process. A helper that cannot be started leaves its
//!   tasks to the caller, which runs queued tasks while it waits: nothing waits on a thread that
//!   does not exist.
//! - Starting threads per job cost tens of microseconds each on the GPU machine's VM, as much as
//!   packing a 1 MB exchange. The tasks go through a `WorkQueue` (crate::work_queue), which
//!   wakes the sleeping helpers a batch needs with one call.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use crate::stream::host::discard_panic;
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use crate::work_queue::WorkQueue;

/// Most helper threads (jobs use at most 16 threads, the caller's included).
pub(crate) const MAX_HELPERS: usize = 15;

/// A task for a helper, its borrows already checked by [`run_scoped`].
type Task = Box<dyn FnOnce() + Send + 'static>;

struct Helpers {
    tasks: WorkQueue<Task>,
    /// Helper threads started.
    started: Mutex<usize>,
}

fn helpers() -> &'static Helpers {
    static HELPERS: OnceLock<Helpers> = OnceLock::new();
    HELPERS.get_or_init(|| Helpers { tasks: WorkQueue::new(), started: Mutex::new(0) })
}

impl Helpers {
    /// Starts helpers until `wanted` exist (fewer if the system refuses a thread).
    fn ensure(&'static self, wanted: usize) {
        let wanted = wanted.min(MAX_HELPERS);
        let mut started = self.started.lock().unwrap_or_else(|e| e.into_inner());
        while *started < wanted {
            let spawned =
                std::thread::Builder::new().name(format!("cuferry-halo-{}", *started + 1)).spawn(move || {
                    // The queue is never closed: helpers live for the process.
                    while let Some(task) = self.tasks.pop() {
                        task();
                    }
                });
            if spawned.is_err() {
                break;
            }
            *started += 1;
        }
    }

    /// Runs one queued task on this thread; false when none was queued.
    fn run_one(&self) -> bool {
        match self.tasks.try_pop() {
            Some(task) => {
                task();
                true
            }
            None => false,
        }
    }
}

/// Counts a call's outstanding helper tasks and keeps the first panic.
struct Latch {
    state: Mutex<(usize, Option<Box<dyn Any + Send>>)>,
    done: Condvar,
}

impl Latch {
    fn count_down(&self, panic: Option<Box<dyn Any + Send>>) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.0 -= 1;
        let extra = if state.1.is_none() { std::mem::replace(&mut state.1, panic) } else { panic };
        if state.0 == 0 {
            self.done.notify_all();
        }
        drop(state);
        // A second panic's payload is dropped outside the lock, where its own drop cannot
        // unwind into the helper thread.
        if let Some(extra) = extra {
            discard_panic(extra);
        }
    }

    fn is_done(&self) -> bool {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).0 == 0
    }

    /// Waits for every task, running queued ones meanwhile; returns a helper's panic.
    fn wait(&self) -> Option<Box<dyn Any + Send>> {
        while !self.is_done() && helpers().run_one() {}
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while state.0 > 0 {
            state = self.done.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        state.1.take()
    }
}

/// Waits for the latch when dropped: the caller's own task may unwind, the helpers' borrows
/// must end first.
struct WaitOnDrop(Arc<Latch>);

impl Drop for WaitOnDrop {
    fn drop(&mut self) {
        if let Some(panic) = self.0.wait() {
            if std::thread::panicking() {
                discard_panic(panic);
            } else {
                resume_unwind(panic);
            }
        }
    }
}

/// Runs `tasks`: the first on this thread, the rest on the helpers. Returns when all have run.
///
/// # Panics
///
/// Resumes the first panic of a helper's task after every task has finished; a panic of the
/// caller's own task unwinds after the helpers' tasks finished.
pub(crate) fn run_scoped<'s>(tasks: Vec<Box<dyn FnOnce() + Send + 's>>) {
    let mut tasks = tasks.into_iter();
    let Some(mine) = tasks.next() else { return };
    let rest: Vec<_> = tasks.collect();
    if rest.is_empty() {
        mine();
        return;
    }
    let pool = helpers();
    pool.ensure(rest.len());
    let latch = Arc::new(Latch { state: Mutex::new((rest.len(), None)), done: Condvar::new() });
    let queued: Vec<Task> = rest
        .into_iter()
        .map(|task| {
            let latch = Arc::clone(&latch);
            let counted = move || latch.count_down(catch_unwind(AssertUnwindSafe(task)).err());
            let counted: Box<dyn FnOnce() + Send + 's> = Box::new(counted);
            // SAFETY: only the lifetime changes. The task runs before its latch count goes
            // down, and this call does not return or unwind past `_wait` (declared before the
            // caller's own task runs) until the count reaches zero, so every borrow of 's
            // outlives the task.
            unsafe { std::mem::transmute::<Box<dyn FnOnce() + Send + 's>, Task>(counted) }
        })
        .collect();
    let _wait = WaitOnDrop(Arc::clone(&latch));
    // Never closed, so the push cannot fail; were it to, the tasks run here.
    if let Err(returned) = pool.tasks.push(queued) {
        returned.into_iter().for_each(|task| task());
    }
    mine();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_task_runs_once_and_borrows_stay_valid() {
        for n in [1usize, 2, 5, 16, 40] {
            let mut out = vec![0usize; n];
            let tasks: Vec<Box<dyn FnOnce() + Send + '_>> = out
                .iter_mut()
                .enumerate()
                .map(|(i, slot)| Box::new(move || *slot += i + 1) as Box<dyn FnOnce() + Send + '_>)
                .collect();
            run_scoped(tasks);
            assert_eq!(out, (1..=n).collect::<Vec<_>>(), "{n} tasks");
        }
    }

    #[test]
    fn callers_on_several_threads_share_the_helpers() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..6 {
                s.spawn(|| {
                    for _ in 0..50 {
                        let tasks: Vec<Box<dyn FnOnce() + Send + '_>> = (0..7)
                            .map(|_| {
                                Box::new(|| {
                                    total.fetch_add(1, Ordering::Relaxed);
                                }) as Box<dyn FnOnce() + Send + '_>
                            })
                            .collect();
                        run_scoped(tasks);
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 6 * 50 * 7);
    }

    #[test]
    fn a_helper_panic_reaches_the_caller_after_every_task() {
        let ran = AtomicUsize::new(0);
        let result = catch_unwind(AssertUnwindSafe(|| {
            let mut tasks: Vec<Box<dyn FnOnce() + Send + '_>> = Vec::new();
            tasks.push(Box::new(|| {
                ran.fetch_add(1, Ordering::SeqCst);
            }));
            tasks.push(Box::new(|| panic!("helper task failed")));
            for _ in 0..4 {
                tasks.push(Box::new(|| {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    ran.fetch_add(1, Ordering::SeqCst);
                }));
            }
            run_scoped(tasks);
        }));
        let payload = result.expect_err("the helper's panic must reach the caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"helper task failed"));
        assert_eq!(ran.load(Ordering::SeqCst), 5, "every other task ran before the panic resumed");
    }

    #[test]
    fn the_callers_own_panic_waits_for_the_helpers() {
        let ran = AtomicUsize::new(0);
        let result = catch_unwind(AssertUnwindSafe(|| {
            let mut tasks: Vec<Box<dyn FnOnce() + Send + '_>> = vec![Box::new(|| panic!("own task failed"))];
            for _ in 0..3 {
                tasks.push(Box::new(|| {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    ran.fetch_add(1, Ordering::SeqCst);
                }));
            }
            run_scoped(tasks);
        }));
        assert!(result.is_err());
        assert_eq!(ran.load(Ordering::SeqCst), 3, "the helpers' tasks finished before unwinding on");
    }
}
