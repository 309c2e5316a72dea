//! A stream's pending errors, reachable without keeping the stream: linop arrays remember the
//! streams upstream of them by these handles.
//!
//! Rules:
//! - A handle keeps no worker thread and no CUDA stream alive: it holds the stream weakly and,
//!   for a host stream, the queue's job counters and kept error (a few words).
//! - [`StreamErrors::take`] reports a pending error once, as [`Stream::query`] does: through
//!   the stream while it exists; after it is gone, a host queue's kept error (its worker
//!   finishes the queued jobs after the drop). A CUDA stream's errors after it is gone are not
//!   reported here; a sticky device error still fails the next CUDA call.
//! - A handle is spent when nothing more can come of it: the stream is gone and, for a host
//!   stream, its queued jobs have all finished and no error is kept. Lists of handles drop
//!   spent ones, so they stay as short as the live streams they name.

use std::sync::{Arc, Weak};

use super::host::HostErrors;
use super::{Stream, StreamBackend, StreamShared};
use crate::error::Result;

/// See the [module docs](self).
#[derive(Clone)]
pub(crate) struct StreamErrors {
    id: u64,
    stream: Weak<StreamShared>,
    host: Option<HostErrors>,
}

impl Stream {
    /// A handle to this stream's pending errors (see [`StreamErrors`]).
    pub(crate) fn errors(&self) -> StreamErrors {
        let host = match &self.shared.backend {
            StreamBackend::Host(q) => Some(q.errors()),
            StreamBackend::Cuda(_) => None,
        };
        StreamErrors { id: self.shared.id, stream: Arc::downgrade(&self.shared), host }
    }
}

impl StreamErrors {
    /// The stream's id.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Takes a pending error of the stream (see the module rules).
    pub(crate) fn take(&self) -> Result<()> {
        if let Some(shared) = self.stream.upgrade() {
            return Stream { shared }.query().map(drop);
        }
        self.host.as_ref().map_or(Ok(()), |h| h.query().map(drop))
    }

    /// Whether nothing more can be reported (see the module rules).
    pub(crate) fn is_spent(&self) -> bool {
        self.stream.strong_count() == 0 && self.host.as_ref().map_or(true, HostErrors::is_settled)
    }
}

#[cfg(test)]
mod tests {
    use crate::device::Device;
    use crate::error::Error;
    use crate::stream::Stream;

    /// A handle keeps no stream alive, still reports a host job's error after the stream is
    /// gone (once), and is spent after that.
    #[test]
    fn a_handle_outlives_its_stream_without_keeping_it() {
        let stream = Stream::new(Device::Host).unwrap();
        let errors = stream.errors();
        assert_eq!(stream.handle_count(), 1, "the handle keeps the stream");
        stream.host_fn(|| panic!("a job bug")).unwrap();
        stream.wait_idle().unwrap();
        assert!(!errors.is_spent(), "spent while the stream lives");
        drop(stream);
        assert!(!errors.is_spent(), "spent with an error kept");
        let r = errors.take();
        assert!(
            matches!(&r, Err(Error::HostFnPanicked { message }) if message.contains("a job bug")),
            "{r:?}"
        );
        assert_eq!(errors.take(), Ok(()), "reported twice");
        assert!(errors.is_spent());
    }

    /// Through a live stream, `take` is the stream's `query`: the error is taken from it.
    #[test]
    fn take_through_a_live_stream_takes_its_error() {
        let stream = Stream::new(Device::Host).unwrap();
        stream.host_fn(|| panic!("another bug")).unwrap();
        stream.wait_idle().unwrap();
        assert!(matches!(stream.errors().take(), Err(Error::HostFnPanicked { .. })));
        assert_eq!(stream.synchronize(), Ok(()));
    }
}
