//! Moving arrays between placements: the transfer-stream registry and the copy protocol that
//! [`ToDevice`](super::ToDevice) and [`Linop::place_on`](super::Linop::place_on) use.
//!
//! Rules:
//! - A transfer from spec `a` to spec `b` runs on a *transfer stream*: `b`'s
//!   `transfer_stream`, else `a`'s, when that stream can do the copy; otherwise the stream
//!   registered for the pair `(a, b)`. The registry is global and keeps one stream per pair
//!   (a placement is a device plus its compute stream, so several host "devices" get
//!   separate streams), reused while any operator holds it; a pair nobody uses any more is
//!   forgotten, so its worker goes away. Inbound and outbound copies of a device are two pairs
//!   and never queue behind each other (a spec's own `transfer_stream`, when set, carries
//!   both directions: its copies run in the order they were queued).
//! - Both specs' streams must be on their specs' devices (an
//!   [`Error::InvalidArgument`](crate::Error::InvalidArgument) otherwise), and the stream a
//!   copy runs on must be able to run it.
//! - Ordering is by events, never by blocking the caller: the copy waits for the event the
//!   source buffer recorded after the work that produced it (on the source's compute stream,
//!   or wherever it was produced), and every later use of the result (on the target's compute
//!   stream or elsewhere) waits for the event recorded after the copy. These are the buffers'
//!   use trackers (see [`crate::memory`]). Whole-stream waits would be weaker: they would
//!   order each tile's inbound copy after the previous tile's outbound copy and serialise a
//!   batched operator.
//! - Within one device (two placements of the same device, e.g. two host "devices"): no copy;
//!   the result shares the buffer under the new placement, ordered by its tracker, and no
//!   transfer stream is made for it. CUDA to another CUDA device: a peer copy on the transfer
//!   stream; peer access is enabled once per pair when [`can_access_peer`] allows it,
//!   otherwise the driver stages the copy. Host and CUDA: through a pinned staging buffer,
//!   which goes back to the allocation cache once the copies through it finished (the
//!   transfer does not wait for them, unless the reaper's caps on pending frees are
//!   reached). Host to CUDA: host memory -> pinned -> device, both
//!   steps on the CUDA side's stream (a CUDA stream can wait for host work only by blocking
//!   the caller, which the first step already does). CUDA to host: device -> pinned on the
//!   CUDA side's stream, then pinned -> host memory on the target's compute stream, whose job
//!   waits for the first copy's event. A host-to-host copy queued on a CUDA stream would be
//!   synchronous for the caller (CUDA's API synchronization rules), so `apply` would wait for
//!   the device's whole queue.
//!
//! # Examples
//!
//! ```
//! use cuferry::linop::{transfer_stream, Array};
//! use cuferry::{Device, DeviceSpec};
//!
//! let (a, b) = (DeviceSpec::new(Device::Host)?, DeviceSpec::new(Device::Host)?);
//! let s1 = transfer_stream(&a, &b)?;
//! let s2 = transfer_stream(&a, &b)?;
//! assert_eq!(s1.id(), s2.id()); // one stream per pair, reused
//! assert_ne!(transfer_stream(&b, &a)?.id(), s1.id()); // the reverse pair has its own
//! # Ok::<(), cuferry::Error>(())
//! ```

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::array::{check_spec, Array};
use super::field::Field;
use crate::copy::{copy, copy_range};
use crate::device::{can_access_peer, enable_peer_access, Device, DeviceSpec};
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, PinnedBuffer};
use crate::stream::Stream;

/// A placement: a device and the id of its compute stream.
type Placement = (Device, u64);

/// One transfer stream per (source, target) placement pair, held weakly.
type Registry = Mutex<HashMap<(Placement, Placement), Weak<Stream>>>;

/// The global registry.
fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Whether a stream on `stream` can copy from `src` memory to `dst` memory.
fn can_run(stream: Device, src: Device, dst: Device) -> bool {
    match stream {
        Device::Host => src.is_host() && dst.is_host(),
        Device::Cuda(_) => src == stream || dst == stream,
    }
}

/// The device whose stream runs a copy from `src` to `dst`: the CUDA side (the source for
/// CUDA to CUDA), or the host for host to host.
fn stream_device(src: Device, dst: Device) -> Device {
    match (src, dst) {
        (Device::Cuda(_), _) => src,
        (Device::Host, other) => other,
    }
}

/// Enables peer access both ways between two CUDA devices where [`can_access_peer`] allows
/// it, once per process and pair (later calls read a set); nothing for other pairs.
fn enable_peer_access_once(src: Device, dst: Device) -> Result<()> {
    static ENABLED: OnceLock<Mutex<HashSet<(Device, Device)>>> = OnceLock::new();
    let (Device::Cuda(a), Device::Cuda(b)) = (src, dst) else { return Ok(()) };
    if a == b {
        return Ok(());
    }
    let pair = if a < b { (src, dst) } else { (dst, src) };
    let mut enabled = ENABLED.get_or_init(Mutex::default).lock().unwrap_or_else(|e| e.into_inner());
    if enabled.contains(&pair) {
        return Ok(());
    }
    for (x, y) in [(src, dst), (dst, src)] {
        if can_access_peer(x, y)? {
            enable_peer_access(x, y)?;
        }
    }
    enabled.insert(pair);
    Ok(())
}

/// The transfer stream for copies from `ispec` to `ospec` (see the [module docs](crate::linop)).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when a spec's streams are on
/// another device than the spec's `device`; errors of [`Stream::new`] for a new stream; CUDA
/// errors of enabling peer access.
pub fn transfer_stream(ispec: &DeviceSpec, ospec: &DeviceSpec) -> Result<Arc<Stream>> {
    check_spec(ispec)?;
    check_spec(ospec)?;
    let (src, dst) = (ispec.device, ospec.device);
    // Before either stream is chosen: a spec's own transfer stream copies peer to peer too.
    enable_peer_access_once(src, dst)?;
    for s in [&ospec.transfer_stream, &ispec.transfer_stream].into_iter().flatten() {
        if can_run(s.device(), src, dst) {
            return Ok(Arc::new(s.clone()));
        }
    }
    let key = ((src, ispec.compute_stream.id()), (dst, ospec.compute_stream.id()));
    let mut map = registry().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(stream) = map.get(&key).and_then(Weak::upgrade) {
        return Ok(stream);
    }
    let stream = Arc::new(Stream::new(stream_device(src, dst))?);
    map.retain(|_, w| w.strong_count() > 0);
    map.insert(key, Arc::downgrade(&stream));
    Ok(stream)
}

/// `x` copied to `ospec` on the registry's stream for `(x.spec(), ospec)`; within one device
/// no copy and no stream (see [`relabel`]).
pub(crate) fn transfer<T: Field>(x: &Array<T>, ospec: &DeviceSpec) -> Result<Array<T>> {
    if x.device() == ospec.device {
        return relabel(x, ospec);
    }
    let stream = transfer_stream(x.spec(), ospec)?;
    transfer_on(x, ospec, &stream)
}

/// `x` under `ospec`, a spec of the same device: no copy. The buffer's tracker orders every
/// later use (on the target's streams or anywhere) after the work that produced it.
pub(crate) fn relabel<T: Field>(x: &Array<T>, ospec: &DeviceSpec) -> Result<Array<T>> {
    x.with_spec(ospec)
}

/// `x` copied to `ospec` on `stream` (which must be able to run the copy). Returns at once,
/// unless the reaper's caps on pending frees are reached (then the staging buffer's drop waits
/// for its copies); the copy is ordered by the buffers' trackers.
pub(crate) fn transfer_on<T: Field>(x: &Array<T>, ospec: &DeviceSpec, stream: &Stream) -> Result<Array<T>> {
    if x.device() == ospec.device {
        return relabel(x, ospec);
    }
    check_spec(ospec)?;
    if !can_run(stream.device(), x.device(), ospec.device) {
        return Err(Error::invalid(format!(
            "a stream of {} cannot copy from {} to {}",
            stream.device(),
            x.device(),
            ospec.device
        )));
    }
    let src = x.contiguous()?;
    let n = src.len();
    // SAFETY: every element is written by the copies below before anyone can read it: later
    // uses of the buffer, on any stream, are ordered after the last copy by its tracker.
    let mut out = unsafe { DeviceBuffer::<T>::uninit_cached(ospec.device, n)? };
    if n == 0 {
        return Ok(Array::from_owned(ospec, out, src.shape()).produced_from([&src], None));
    }
    let buf = &**src.buffer();
    let staged = match (src.device(), ospec.device) {
        (Device::Host, Device::Cuda(_)) => {
            let mut stage = PinnedBuffer::<T>::staging(ospec.device, n)?;
            copy_range(stream, buf, src.offset(), &mut stage, 0, n)?;
            copy(stream, &stage, &mut out)?;
            Some(stage)
        }
        (Device::Cuda(_), Device::Host) => {
            let mut stage = PinnedBuffer::<T>::staging(src.device(), n)?;
            copy_range(stream, buf, src.offset(), &mut stage, 0, n)?;
            // On the target's host stream, whose job waits for the first copy's event: a
            // host-to-host copy queued on a CUDA stream is synchronous for the caller.
            copy(&ospec.compute_stream, &stage, &mut out)?;
            Some(stage)
        }
        _ => {
            copy_range(stream, buf, src.offset(), &mut out, 0, n)?;
            None
        }
    };
    // The staging buffer is dropped here with its copies queued: it goes back to the cache
    // once they finished (its drop hands it to the reaper), rather than living as long as the
    // result (a weight placed on a GPU would hold pinned host memory of its size for good).
    drop(staged);
    Ok(Array::from_owned(ospec, out, src.shape()).produced_from([&src], Some(stream)))
}
