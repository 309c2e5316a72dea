//! A test helper: a host function that holds a stream until the test lets it through.
//!
//! Rules:
//! - The gate is the first job queued after [`Gate::hold`]: work queued later on that stream
//!   waits behind it.
//! - It opens after the delay given to [`Gate::open_after`], when the gate is dropped, or after 10 s at most, so a test
//!   whose assertion fails does not hang; [`Gate::passed`] turns true once the job has run.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use super::Stream;

/// A held stream. See the [module docs](self).
pub(crate) struct Gate {
    open: mpsc::Sender<()>,
    passed: Arc<AtomicBool>,
}

impl Gate {
    /// Queues the gate on `stream`.
    pub(crate) fn hold(stream: &Stream) -> Self {
        let (open, gate) = mpsc::channel::<()>();
        let passed = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&passed);
        stream
            .host_fn(move || {
                let _ = gate.recv_timeout(Duration::from_secs(10));
                flag.store(true, Ordering::SeqCst);
            })
            .expect("queue the gate");
        Gate { open, passed }
    }

    /// Lets the stream through from another thread after `delay` (for a test that blocks
    /// meanwhile); join the handle at the end.
    pub(crate) fn open_after(&self, delay: Duration) -> JoinHandle<()> {
        let open = self.open.clone();
        thread::spawn(move || {
            thread::sleep(delay);
            let _ = open.send(());
        })
    }

    /// Whether the gate's job has run (the stream went past it).
    pub(crate) fn passed(&self) -> bool {
        self.passed.load(Ordering::SeqCst)
    }
}
