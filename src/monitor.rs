//! A state behind a mutex with a condition variable that is signalled only when a thread
//! waits on it (the host stream's job counters and the host event's generations use it).
//!
//! Rules:
//! - `std`'s `Condvar::notify_all` makes a futex syscall whether or not anyone waits. Jobs on
//!   a host stream finish, and events complete, far more often than anyone waits for them:
//!   the two syscalls were most of a small host job's cost (a 2 KiB halo pack and wait took
//!   1.04 us with them, 0.37 us without, on the 2-core CI machine). So waiters count
//!   themselves, under the lock, and [`Monitor::update`] notifies only when the count is not
//!   zero.
//! - No wake-up is lost: a waiter counts itself and checks its condition under the lock, and
//!   `update` changes the state and reads the count under that same lock. A waiter counted
//!   before the change is notified; one that comes after sees the change.
//! - Every change a waiter may wait for goes through [`Monitor::update`]; changes made through
//!   [`Monitor::lock`] wake no one.
//! - A waiter whose condition panics is counted out again as it unwinds.
//! - A poisoned lock only means a panic elsewhere while holding it; it is taken over as is
//!   (the users keep their state consistent at every step).

use std::ops::{Deref, DerefMut};
use std::sync::{Condvar, Mutex, MutexGuard};

/// See the [module docs](self).
#[derive(Default)]
pub(crate) struct Monitor<T> {
    state: Mutex<Counted<T>>,
    changed: Condvar,
}

#[derive(Default)]
struct Counted<T> {
    value: T,
    /// Threads inside [`Monitor::wait_while`].
    waiters: usize,
}

/// The locked state of a [`Monitor`].
pub(crate) struct MonitorGuard<'a, T>(MutexGuard<'a, Counted<T>>);

impl<T> Deref for MonitorGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0.value
    }
}

impl<T> DerefMut for MonitorGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0.value
    }
}

impl<T> std::fmt::Debug for Monitor<T> {
    /// The type alone: formatting never takes the lock (whose holder might be the formatter).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor").finish_non_exhaustive()
    }
}

impl<T> Monitor<T> {
    /// Locks the state (changes made through the guard wake no one).
    pub(crate) fn lock(&self) -> MonitorGuard<'_, T> {
        MonitorGuard(self.state.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Applies `change` under the lock, then wakes every waiter if there are any.
    pub(crate) fn update<R>(&self, change: impl FnOnce(&mut T) -> R) -> R {
        let mut guard = self.lock();
        let out = change(&mut guard);
        let waiting = guard.0.waiters > 0;
        drop(guard);
        if waiting {
            self.changed.notify_all();
        }
        out
    }

    /// Threads waiting now (tests use it to know a waiter has taken its snapshot).
    #[cfg(test)]
    pub(crate) fn waiters(&self) -> usize {
        self.lock().0.waiters
    }

    /// Blocks while `condition` holds for the state; returns the guard once it does not.
    pub(crate) fn wait_while<'a>(
        &'a self,
        guard: MonitorGuard<'a, T>,
        mut condition: impl FnMut(&mut T) -> bool,
    ) -> MonitorGuard<'a, T> {
        let mut inner = guard.0;
        if !condition(&mut inner.value) {
            return MonitorGuard(inner);
        }
        inner.waiters += 1;
        let uncount = UncountOnUnwind(self);
        // Bound after `uncount`, so a panicking `condition` unlocks (drops) it before
        // `uncount` takes the lock back to lower the count.
        let mut inner = inner;
        // Not `Condvar::wait_while`: once the lock is poisoned it returns at the first wake-up
        // (spurious ones included) without checking the condition again.
        while condition(&mut inner.value) {
            inner = self.changed.wait(inner).unwrap_or_else(|e| e.into_inner());
        }
        inner.waiters -= 1;
        std::mem::forget(uncount);
        MonitorGuard(inner)
    }
}

/// Lowers the waiter count of a [`Monitor::wait_while`] whose condition panicked, so that
/// [`Monitor::update`] stops notifying a waiter that is gone. Forgotten on a normal return.
struct UncountOnUnwind<'a, T>(&'a Monitor<T>);

impl<T> Drop for UncountOnUnwind<'_, T> {
    fn drop(&mut self) {
        self.0.lock().0.waiters -= 1;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::thread;

    use super::Monitor;

    #[test]
    fn waiters_see_every_update_across_threads() {
        // Ping-pong a counter between two threads many times: a lost wake-up hangs the test.
        let m = Arc::new(Monitor::<u64>::default());
        let other = Arc::clone(&m);
        let rounds = 20_000;
        let t = thread::spawn(move || {
            for i in 0..rounds {
                let g = other.wait_while(other.lock(), |v| *v != 2 * i + 1);
                drop(g);
                other.update(|v| *v += 1);
            }
        });
        for i in 0..rounds {
            m.update(|v| *v += 1);
            let g = m.wait_while(m.lock(), |v| *v != 2 * i + 2);
            assert_eq!(*g, 2 * i + 2);
        }
        t.join().unwrap();
        assert_eq!(*m.lock(), 2 * rounds);
        assert_eq!(m.lock().0.waiters, 0);
    }

    #[test]
    fn many_waiters_are_all_woken() {
        let m = Arc::new(Monitor::<bool>::default());
        let waiters: Vec<_> = (0..4)
            .map(|_| {
                let m = Arc::clone(&m);
                thread::spawn(move || *m.wait_while(m.lock(), |open| !*open))
            })
            .collect();
        while m.lock().0.waiters < 4 {
            thread::yield_now();
        }
        m.update(|open| *open = true);
        for w in waiters {
            assert!(w.join().unwrap());
        }
    }

    #[test]
    fn a_poisoned_lock_does_not_end_a_wait_early() {
        let m = Arc::new(Monitor::<u32>::default());
        let poisoner = Arc::clone(&m);
        let _ = thread::spawn(move || poisoner.update(|_| panic!("poison the lock"))).join();
        let w = Arc::clone(&m);
        let waiter = thread::spawn(move || *w.wait_while(w.lock(), |v| *v < 2));
        while m.lock().0.waiters == 0 {
            thread::yield_now();
        }
        // A wake-up whose change does not meet the condition: the waiter must wait on.
        m.update(|v| *v = 1);
        thread::sleep(std::time::Duration::from_millis(50));
        m.update(|v| *v = 2);
        assert_eq!(waiter.join().unwrap(), 2, "wait_while returned with its condition still true");
    }

    #[test]
    fn a_panicking_condition_is_counted_out() {
        let m = Monitor::<u32>::default();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut calls = 0;
            drop(m.wait_while(m.lock(), |_| {
                calls += 1;
                // True at the first check, so the waiter counts itself; panics at the second.
                assert!(calls < 2, "condition panicked");
                true
            }));
        }));
        assert!(caught.is_err());
        assert_eq!(m.waiters(), 0, "a waiter that panicked out is still counted");
    }

    #[test]
    fn changes_through_lock_keep_the_count() {
        let m = Monitor::<u32>::default();
        *m.lock() += 3;
        assert_eq!(m.update(|v| *v), 3);
        // A condition already false returns at once, without counting a waiter.
        assert_eq!(*m.wait_while(m.lock(), |v| *v != 3), 3);
        assert_eq!(m.lock().0.waiters, 0);
    }
}
