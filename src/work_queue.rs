//! A first-in, first-out queue of work shared by a pool of sleeping threads, built for cheap
//! wake-ups (the ring's pack executor and the halo helper threads both use it).
//!
//! Rules:
//! - Waking a sleeping thread is a futex syscall, microseconds in a VM. [`WorkQueue::push`]
//!   wakes the sleepers a batch needs with one call (a sender paying one per item spent 45 us
//!   queueing a 1 MiB ring slot as 16 chunks on the H100 machine), and a thread that takes an
//!   item and leaves others behind wakes one more sleeper.
//! - Items run outside the lock: a panicking item cannot leave the queue half-updated, so a
//!   poisoned lock is taken over as is.
//! - After [`WorkQueue::close`] pushes are refused (the items come back) and [`WorkQueue::pop`]
//!   returns the items left, then `None`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

/// See the [module docs](self).
pub(crate) struct WorkQueue<T> {
    state: Mutex<State<T>>,
    /// Signalled when items arrive or the queue closes.
    arrived: Condvar,
    /// Items queued and not yet taken: lets pollers skip the lock while the queue is empty.
    queued: AtomicUsize,
    /// Set by `close`: lets pollers stop polling without the lock.
    closed: AtomicBool,
}

struct State<T> {
    items: VecDeque<T>,
    /// Threads waiting in `pop`.
    sleepers: usize,
    closed: bool,
}

impl<T> WorkQueue<T> {
    pub(crate) fn new() -> Self {
        WorkQueue {
            state: Mutex::new(State { items: VecDeque::new(), sleepers: 0, closed: false }),
            arrived: Condvar::new(),
            queued: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `items` and wakes sleepers in one call: one for a single item, all of them for
    /// a batch meeting two or more (those that find the queue empty sleep again); hands the
    /// items back once closed.
    pub(crate) fn push(&self, items: Vec<T>) -> Result<(), Vec<T>> {
        let wake = {
            let mut state = self.lock();
            if state.closed {
                return Err(items);
            }
            let count = items.len();
            state.items.extend(items);
            self.queued.store(state.items.len(), Ordering::Release);
            count.min(state.sleepers)
        };
        // One syscall either way; sleepers that find the queue empty go back to sleep.
        match wake {
            0 => {}
            1 => self.arrived.notify_one(),
            _ => self.arrived.notify_all(),
        }
        Ok(())
    }

    /// Takes the oldest item from the locked queue and passes the wake-up on when items remain.
    fn take(&self, mut state: MutexGuard<'_, State<T>>) -> Option<T> {
        let item = state.items.pop_front()?;
        self.queued.store(state.items.len(), Ordering::Release);
        let wake = !state.items.is_empty() && state.sleepers > 0;
        drop(state);
        if wake {
            self.arrived.notify_one();
        }
        Some(item)
    }

    /// The oldest item, if one is queued; does not block.
    pub(crate) fn try_pop(&self) -> Option<T> {
        if self.queued.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.take(self.lock())
    }

    /// The oldest item, sleeping until one is queued; `None` once closed and empty.
    pub(crate) fn pop(&self) -> Option<T> {
        let mut state = self.lock();
        loop {
            if !state.items.is_empty() {
                return self.take(state);
            }
            if state.closed {
                return None;
            }
            state.sleepers += 1;
            state = self.arrived.wait(state).unwrap_or_else(|e| e.into_inner());
            state.sleepers -= 1;
        }
    }

    /// Refuses new items and wakes every sleeper to drain the queue and stop.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.closed.store(true, Ordering::Release);
        self.arrived.notify_all();
    }

    /// Whether [`WorkQueue::close`] was called (pollers stop polling then: `pop` drains).
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn sleepers_get_every_item_once_then_stop_on_close() {
        let queue = Arc::new(WorkQueue::<usize>::new());
        let takers: Vec<_> = (0..4)
            .map(|_| {
                let queue = Arc::clone(&queue);
                std::thread::spawn(move || std::iter::from_fn(|| queue.pop()).collect::<Vec<_>>())
            })
            .collect();
        for batch in 0..100 {
            queue.push((batch * 7..batch * 7 + 7).collect()).unwrap();
        }
        queue.close();
        assert_eq!(queue.push(vec![1]), Err(vec![1]), "a closed queue hands items back");
        let mut all: Vec<usize> = takers.into_iter().flat_map(|t| t.join().unwrap()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..700).collect::<Vec<_>>());
        assert_eq!(queue.try_pop(), None);
        assert!(queue.is_closed());
    }
}
