//! The allocation cache: memory given up by linop's temporaries (operator outputs, transfer
//! results and their pinned staging), kept for the next allocation of the same place and size
//! class instead of being freed.
//!
//! An `apply` allocates its outputs and, across devices, a pinned staging buffer per transfer;
//! on CUDA, `cudaMalloc`, `cudaHostAlloc` (which pins page by page) and their frees (which may
//! synchronise the device) would otherwise run on every call, between the launches and copies
//! a pipeline overlaps.
//!
//! Rules:
//! - Only allocations made through the cache ([`TrackedAllocation::cached`]) come back to it.
//!   They are sized up to their [`size_class`], so an allocation of a nearby size can reuse
//!   them; one whose class is larger than the byte cap is made exactly as large as asked and
//!   freed when dropped (it could never be cached).
//! - An allocation enters the cache only once every queued use has finished: at its drop when
//!   its tracker is already idle; from the [reaper](super::reaper) once its work has run; or,
//!   when the reaper's caps refuse it, at its drop after waiting for that work. An
//!   allocation that finds its class empty here also takes one the reaper still holds whose
//!   work has finished (the reaper's `reclaim`), rather than wait for the reaper's next poll.
//!   Its tracker is then reset, so a reused allocation waits for no event and keeps no former
//!   user's stream alive. A tracker that cannot be queried means the work's fate is unknown: that memory is
//!   leaked, never cached.
//! - A reused allocation holds stale bytes of its former user. `DeviceBuffer::zeroed_cached`
//!   zeroes it and `from_slice_cached` overwrites it; with `uninit_cached` and
//!   `PinnedBuffer::staging` the caller writes every element before anything reads it (linop's
//!   transfers copy into the whole buffer).
//! - The cache holds at most [`CacheLimits`] per place (by default [`MAX_CACHED_BYTES`] and
//!   [`MAX_CACHED`] allocations; [`set_cache_limits`] changes them at any time): to
//!   make room it evicts that place's longest-cached allocations (a working set that changed
//!   replaces the old one), which the reaper thread frees, so the dropping thread never waits
//!   in `cudaFree`; an allocation larger than the byte cap by itself is freed. The
//!   most recently cached allocation of a class is reused first (its lines may still be in a
//!   CPU cache). Freed allocations, evicted or released, never come back to the cache.
//!   Lowered limits evict at once what no longer fits; an allocation whose size class is over
//!   the byte limit when it is made is made exactly as large as asked, and one over the limit
//!   when it is given back (the limit was lowered meanwhile) is freed. Limits of 0 turn the
//!   cache off: every allocation is then freed once its work has finished.
//! - An allocation of cuferry's (a buffer, or a managed pool's) failing for lack of memory
//!   releases the cache's memory of the kind it draws on (after the reaper's pending frees)
//!   and is tried once more, so cuferry never mistakes cached memory for memory in use; a
//!   device running out leaves the host's and other devices' cached memory in place. Other allocations in the process (a
//!   user's own `cudaMalloc`, another library's) do not: [`release_cached_memory`] frees the
//!   cache on request. Allocations are freed outside the cache's lock.
//! - Allocations taken off the shelves to be freed (evicted or released) are counted as
//!   [`Leaving`] the cache, under its lock, until they have been freed or handed to the reaper:
//!   in between they are neither cached nor pending there, and an allocation failing for lack
//!   of memory waits for them ([`Cache::wait_for_leaving`]) instead of failing while another
//!   thread is about to free that memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};

use super::allocation::TrackedAllocation;
use super::reaper;
use crate::monitor::Monitor;

/// The most bytes cached per place unless [`set_cache_limits`] says otherwise.
pub const MAX_CACHED_BYTES: usize = 1 << 30;

/// The most allocations cached per place unless [`set_cache_limits`] says otherwise.
pub const MAX_CACHED: usize = 512;

/// How much the process's allocation cache keeps per place (each CUDA device's memory, each
/// device's pinned memory, and host memory are places of their own). See
/// [`set_cache_limits`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLimits {
    /// The most bytes cached per place (counted by size class). An allocation whose size
    /// class is larger is never cached: it is made exactly as large as asked.
    pub bytes_per_place: usize,
    /// The most allocations cached per place.
    pub allocations_per_place: usize,
}

impl Default for CacheLimits {
    /// [`MAX_CACHED_BYTES`] and [`MAX_CACHED`].
    fn default() -> Self {
        CacheLimits { bytes_per_place: MAX_CACHED_BYTES, allocations_per_place: MAX_CACHED }
    }
}

/// Sizes up to this are one class (a host allocation takes a page anyway).
const MIN_CLASS: usize = 4096;

/// Where an allocation's memory lives, and so which allocations may reuse it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Place {
    /// Page-aligned host memory (the host backend's device and pinned memory).
    Host,
    /// `cudaMalloc` memory of this ordinal.
    CudaDevice(u32),
    /// Portable `cudaHostAlloc` memory, allocated with this ordinal current.
    CudaPinned(u32),
}

/// The size an allocation of `bytes` is given: `bytes` rounded up to a multiple of an eighth
/// of the power of two above it, or of [`MIN_CLASS`] when that is more (so at most 25% or
/// less than [`MIN_CLASS`] bytes more); 0 for 0, and `bytes` itself where the rounding would
/// overflow.
pub(crate) fn size_class(bytes: usize) -> usize {
    if bytes == 0 {
        return 0;
    }
    let Some(power) = bytes.checked_next_power_of_two() else { return bytes };
    let step = (power / 8).max(MIN_CLASS);
    bytes.checked_next_multiple_of(step).unwrap_or(bytes)
}

/// Counts of one place's cached allocations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Held {
    count: usize,
    bytes: usize,
}

/// The cached allocations, by place and size class (each shelf oldest first, with the stamp
/// it was cached at), and what each place holds.
#[derive(Debug, Default)]
struct Shelves {
    free: HashMap<(Place, usize), Vec<(u64, TrackedAllocation)>>,
    held: HashMap<Place, Held>,
    next_stamp: u64,
}

impl Shelves {
    /// Takes the longest-cached allocation of `place` off its shelf.
    fn pop_oldest(&mut self, place: Place) -> Option<TrackedAllocation> {
        let key = self
            .free
            .iter()
            .filter(|((p, _), shelf)| *p == place && !shelf.is_empty())
            .min_by_key(|(_, shelf)| shelf[0].0)
            .map(|(key, _)| *key)?;
        let (_, alloc) = self.free.get_mut(&key)?.remove(0);
        let held = self.held.entry(place).or_default();
        held.count -= 1;
        held.bytes -= key.1;
        Some(alloc)
    }
}

/// Caps on what a cache holds per place.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caps {
    pub(crate) count: usize,
    pub(crate) bytes: usize,
}

/// A cache of idle allocations (the process has one, [`global`]; tests make their own).
#[derive(Debug)]
pub(crate) struct Cache {
    shelves: Mutex<Shelves>,
    caps: AtomicCaps,
    counts: Counts,
    /// Allocations [`Leaving`] the cache, by place (places with none are absent). Counted up
    /// under the shelves' lock (the order is shelves, then this), counted down by
    /// [`Monitor::update`], which wakes [`Cache::wait_for_leaving`].
    leaving: Monitor<HashMap<Place, usize>>,
}

/// Allocations taken off a cache's shelves to be freed (evicted, or released), each counted
/// as leaving that cache from the moment it is taken, under the cache's lock, until this
/// guard's drop has freed it or handed it to the reaper (as [`Then`] says). Until then the
/// memory is neither cached nor pending in the reaper, so an allocation failing for lack of
/// memory waits for it ([`Cache::wait_for_leaving`]) before trying again.
pub(crate) struct Leaving<'a> {
    cache: &'a Cache,
    then: Then,
    allocs: Vec<TrackedAllocation>,
    /// The place of each of `allocs`, as counted.
    places: Vec<Place>,
}

/// What dropping a [`Leaving`] does with its allocations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Then {
    /// Frees them on the dropping thread (the reaper's own evictions, and releases).
    Free,
    /// Hands them to the reaper thread, which frees them off the dropping thread (a free may
    /// wait for the whole device).
    Reap,
}

impl<'a> Leaving<'a> {
    /// None yet, of `cache`.
    pub(crate) fn new(cache: &'a Cache, then: Then) -> Self {
        Leaving { cache, then, allocs: Vec::new(), places: Vec::new() }
    }

    /// Takes `alloc`, just taken off `self.cache`'s shelves (whose lock the caller holds),
    /// marked to be freed rather than cached again, and counts it as leaving.
    fn push(&mut self, alloc: TrackedAllocation) {
        if let Some(place) = alloc.place() {
            *self.cache.leaving.lock().entry(place).or_default() += 1;
            self.places.push(place);
        }
        self.allocs.push(alloc.uncached());
    }

    /// Bytes taken (size classes).
    fn bytes(&self) -> usize {
        self.allocs.iter().map(TrackedAllocation::capacity).sum()
    }
}

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        // Most gives evict nothing: no hand-over then (nor a reaper thread started for it).
        if self.allocs.is_empty() {
            return;
        }
        let allocs = std::mem::take(&mut self.allocs);
        match self.then {
            Then::Free => drop(allocs),
            Then::Reap => reaper::free_later(allocs),
        }
        // Only now: freed, or pending in the reaper (which counted them first).
        self.cache.leaving.update(|leaving| {
            for place in self.places.drain(..) {
                if let Some(n) = leaving.get_mut(&place) {
                    *n -= 1;
                    if *n == 0 {
                        leaving.remove(&place);
                    }
                }
            }
        });
    }
}

/// A cache's [`Caps`], changeable while the cache is used. They are read without the
/// shelves' lock where a stale value only decides an allocation's size, and changed, and read
/// for admission and eviction, under it.
#[derive(Debug)]
struct AtomicCaps {
    count: AtomicUsize,
    bytes: AtomicUsize,
}

impl AtomicCaps {
    fn load(&self) -> Caps {
        Caps { count: self.count.load(Ordering::Relaxed), bytes: self.bytes.load(Ordering::Relaxed) }
    }
}

impl Caps {
    /// Whether an allocation of size class `class` could ever be cached under these caps.
    fn admit(self, class: usize) -> bool {
        class > 0 && class <= self.bytes && self.count > 0
    }

    /// Whether a place holding `held` is within these caps.
    fn fit(self, held: Held) -> bool {
        held.count <= self.count && held.bytes <= self.bytes
    }

    /// Whether a place holding `held` has room for one more allocation of `class` bytes.
    fn room(self, held: Held, class: usize) -> bool {
        held.count < self.count && held.bytes.saturating_add(class) <= self.bytes
    }
}

/// What a cache's allocations were served by (see [`CacheStats`]).
#[derive(Debug, Default)]
struct Counts {
    reused: AtomicU64,
    reclaimed: AtomicU64,
    allocated: AtomicU64,
}

/// What served one allocation made through a cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ServedBy {
    /// Memory the cache held.
    Cache,
    /// Memory reclaimed from the reaper's pending frees, its work finished.
    PendingFree,
    /// A fresh allocation.
    Fresh,
}

/// How the allocations made through the process's allocation cache (linop's arrays, their
/// transfer results and staging) were served, counted since the process started. A reused
/// allocation skipped a `cudaMalloc` or `cudaHostAlloc` (on the host backend, an allocation)
/// and its later free.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Allocations served by memory the cache held, or by memory whose work had finished
    /// while it waited to be released (counted in `reclaimed` too).
    pub reused: u64,
    /// Of `reused`, those taken from memory still waiting to be released after its work had
    /// finished (dropped while work was queued on it).
    pub reclaimed: u64,
    /// Allocations made fresh: nothing of their place and size class was idle.
    pub allocated: u64,
}

/// The process's cache.
pub(crate) fn global() -> &'static Cache {
    static CACHE: LazyLock<Cache> =
        LazyLock::new(|| Cache::new(Caps { count: MAX_CACHED, bytes: MAX_CACHED_BYTES }));
    &CACHE
}

impl Cache {
    /// An empty cache holding at most `caps` per place.
    pub(crate) fn new(caps: Caps) -> Cache {
        let caps = AtomicCaps { count: AtomicUsize::new(caps.count), bytes: AtomicUsize::new(caps.bytes) };
        Cache { shelves: Mutex::default(), caps, counts: Counts::default(), leaving: Monitor::default() }
    }

    fn lock(&self) -> MutexGuard<'_, Shelves> {
        // A poisoned lock only means a panic elsewhere; the shelves are always consistent.
        self.shelves.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A cached allocation of `bytes`' size class at `place`, made `bytes` long; `None` when
    /// there is none (or `bytes` is 0). The most recently cached one is reused first.
    pub(crate) fn take(&self, place: Place, bytes: usize) -> Option<TrackedAllocation> {
        let class = size_class(bytes);
        if class == 0 {
            return None;
        }
        let mut shelves = self.lock();
        let (_, mut alloc) = shelves.free.get_mut(&(place, class)).and_then(Vec::pop)?;
        let held = shelves.held.entry(place).or_default();
        held.count -= 1;
        held.bytes -= class;
        drop(shelves);
        alloc.reuse_for(bytes);
        Some(alloc)
    }

    /// Keeps `alloc` (whose tracker must be idle) for reuse, first evicting the place's
    /// longest-cached allocations while it would not fit under the caps (the reaper thread
    /// frees them: a free may wait for the whole device). Hands it back when it is not a
    /// cached allocation or is larger than the byte cap by itself (the caller frees it).
    pub(crate) fn give(&self, alloc: TrackedAllocation) -> Result<(), TrackedAllocation> {
        self.give_collecting(alloc, &mut Leaving::new(self, Then::Reap))
    }

    /// [`Cache::give`], but the allocations evicted to make room are pushed onto `evicted`
    /// (a [`Leaving`] of this cache), to be freed when it is dropped: the reaper gives under
    /// its own lock and frees outside it.
    pub(crate) fn give_collecting(
        &self,
        mut alloc: TrackedAllocation,
        evicted: &mut Leaving<'_>,
    ) -> Result<(), TrackedAllocation> {
        debug_assert!(std::ptr::eq(evicted.cache, self), "a Leaving of another cache");
        let Some(place) = alloc.place().filter(|_| alloc.is_recycled()) else { return Err(alloc) };
        let class = alloc.capacity();
        if size_class(class) != class || !self.admits(class) {
            return Err(alloc);
        }
        // Outside the lock: forgetting drops the uses' event and stream handles, which may be
        // their last (a `cudaEventDestroy` or `cudaStreamDestroy`), calls every take and give
        // would otherwise wait behind.
        alloc.forget_uses();
        let mut shelves = self.lock();
        // Again under the lock, which `set_caps` changes them under.
        let caps = self.caps.load();
        if !caps.admit(class) {
            drop(shelves);
            return Err(alloc);
        }
        while !caps.room(shelves.held.get(&place).copied().unwrap_or_default(), class) {
            match shelves.pop_oldest(place) {
                Some(old) => evicted.push(old),
                None => break,
            }
        }
        let held = shelves.held.entry(place).or_default();
        held.count += 1;
        held.bytes += class;
        let stamp = shelves.next_stamp;
        shelves.next_stamp += 1;
        shelves.free.entry((place, class)).or_default().push((stamp, alloc));
        Ok(())
    }

    /// Frees every cached allocation (outside the lock); returns their bytes.
    pub(crate) fn release(&self) -> usize {
        self.release_where(|_| true)
    }

    /// Frees the cached allocations of the places `pick` chooses (outside the lock); returns
    /// their bytes.
    pub(crate) fn release_where(&self, pick: impl Fn(Place) -> bool) -> usize {
        let mut freed = Leaving::new(self, Then::Free);
        let mut shelves = self.lock();
        shelves.held.retain(|&place, _| !pick(place));
        let keys: Vec<_> = shelves.free.keys().copied().filter(|&(place, _)| pick(place)).collect();
        for shelf in keys.iter().filter_map(|key| shelves.free.remove(key)) {
            shelf.into_iter().for_each(|(_, alloc)| freed.push(alloc));
        }
        drop(shelves);
        freed.bytes()
    }

    /// Blocks until no allocation of a place `pick` chooses is [`Leaving`] this cache (each
    /// has been freed, or handed to the reaper).
    pub(crate) fn wait_for_leaving(&self, pick: impl Fn(Place) -> bool) {
        let waited = self.leaving.wait_while(self.leaving.lock(), |leaving| leaving.keys().any(|&p| pick(p)));
        drop(waited);
    }

    /// How many allocations of the places `pick` chooses are [`Leaving`] this cache.
    #[cfg(test)]
    pub(crate) fn leaving_where(&self, pick: impl Fn(Place) -> bool) -> usize {
        self.leaving.lock().iter().filter(|(&p, _)| pick(p)).map(|(_, n)| n).sum()
    }

    /// How many allocations of size class `class` at `place` are cached.
    #[cfg(test)]
    fn count_of(&self, place: Place, class: usize) -> usize {
        self.lock().free.get(&(place, class)).map_or(0, Vec::len)
    }

    /// Whether an allocation of size class `class` could be cached here under the present
    /// caps.
    pub(crate) fn admits(&self, class: usize) -> bool {
        self.caps.load().admit(class)
    }

    /// The caps as last set: read under the lock they are set under, so never one of a pair
    /// with the other of another.
    fn caps(&self) -> Caps {
        let _shelves = self.lock();
        self.caps.load()
    }

    /// Sets the caps and evicts, oldest first, what no longer fits (pushed onto `evicted`, a
    /// [`Leaving`] of this cache, to be freed outside the lock); returns the former caps.
    pub(crate) fn set_caps(&self, caps: Caps, evicted: &mut Leaving<'_>) -> Caps {
        debug_assert!(std::ptr::eq(evicted.cache, self), "a Leaving of another cache");
        let mut shelves = self.lock();
        let former = self.caps.load();
        self.caps.count.store(caps.count, Ordering::Relaxed);
        self.caps.bytes.store(caps.bytes, Ordering::Relaxed);
        let places: Vec<Place> = shelves.held.keys().copied().collect();
        for place in places {
            while !caps.fit(shelves.held.get(&place).copied().unwrap_or_default()) {
                match shelves.pop_oldest(place) {
                    Some(old) => evicted.push(old),
                    None => break,
                }
            }
        }
        former
    }

    /// Counts an allocation this cache served, by what served it.
    pub(crate) fn count(&self, served: ServedBy) {
        let counter = match served {
            ServedBy::Cache | ServedBy::PendingFree => &self.counts.reused,
            ServedBy::Fresh => &self.counts.allocated,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if served == ServedBy::PendingFree {
            self.counts.reclaimed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What this cache's allocations were served by.
    pub(crate) fn stats(&self) -> CacheStats {
        CacheStats {
            reused: self.counts.reused.load(Ordering::Relaxed),
            reclaimed: self.counts.reclaimed.load(Ordering::Relaxed),
            allocated: self.counts.allocated.load(Ordering::Relaxed),
        }
    }

    /// Bytes cached, over every place.
    pub(crate) fn held_bytes(&self) -> usize {
        self.held_bytes_where(|_| true)
    }

    /// Bytes cached at the places `pick` chooses.
    pub(crate) fn held_bytes_where(&self, pick: impl Fn(Place) -> bool) -> usize {
        self.lock().held.iter().filter(|(&place, _)| pick(place)).map(|(_, h)| h.bytes).sum()
    }
}

/// Frees every allocation the process's cache holds (memory that linop's arrays gave up,
/// kept for their successors; see the [memory module](crate::memory)) and returns how many
/// bytes that was. Nothing in use is touched: only memory whose work has finished is cached.
/// Allocations that fail for lack of memory do this by themselves before trying again.
///
/// # Examples
///
/// ```
/// use cuferry::linop::Array;
/// use cuferry::memory::{cached_memory_bytes, release_cached_memory};
/// use cuferry::{Device, DeviceSpec};
///
/// let spec = DeviceSpec::new(Device::Host)?;
/// let x = Array::<f64>::zeros(&spec, &[1024])?;
/// x.synchronize()?;
/// drop(x); // its work is done: the memory is cached, not freed
/// assert!(cached_memory_bytes() >= 8192);
/// release_cached_memory();
/// # Ok::<(), cuferry::Error>(())
/// ```
pub fn release_cached_memory() -> usize {
    global().release()
}

/// Bytes the process's allocation cache holds (see [`release_cached_memory`]).
pub fn cached_memory_bytes() -> usize {
    global().held_bytes()
}

/// How the process's allocation cache has served its allocations so far (see [`CacheStats`]):
/// in a loop of `apply`, `allocated` should stop growing after the first calls.
///
/// # Examples
///
/// ```
/// use cuferry::linop::Array;
/// use cuferry::memory::cache_stats;
/// use cuferry::{Device, DeviceSpec};
///
/// let spec = DeviceSpec::new(Device::Host)?;
/// let before = cache_stats();
/// for _ in 0..3 {
///     let x = Array::<f64>::zeros(&spec, &[1000])?;
///     x.synchronize()?;
/// }
/// let after = cache_stats();
/// assert_eq!((after.reused + after.allocated) - (before.reused + before.allocated), 3);
/// # Ok::<(), cuferry::Error>(())
/// ```
pub fn cache_stats() -> CacheStats {
    global().stats()
}

/// How much the process's allocation cache keeps per place at present (see
/// [`set_cache_limits`]).
pub fn cache_limits() -> CacheLimits {
    let caps = global().caps();
    CacheLimits { bytes_per_place: caps.bytes, allocations_per_place: caps.count }
}

/// Sets how much the process's allocation cache (the memory linop's arrays give up, kept for
/// their successors; see [`release_cached_memory`]) keeps per place, and returns the former
/// limits.
///
/// The default, [`CacheLimits::default`], keeps up to 1 GiB and 512 allocations per device.
/// A loop of `apply` whose temporaries add up to more than the byte limit on one device
/// evicts part of its working set on every call, and on CUDA pays a `cudaMalloc` and a
/// `cudaFree` for each eviction: raise the limit to its working set, or lower it to leave
/// memory to other allocators. Lowered limits take effect at once: the longest-cached
/// allocations that no longer fit are freed (by cuferry's reaper thread, so this call does not
/// wait for them). Limits of 0 bytes or 0 allocations turn caching off.
///
/// # Examples
///
/// ```
/// use cuferry::linop::Array;
/// use cuferry::memory::{cached_memory_bytes, set_cache_limits, CacheLimits};
/// use cuferry::{Device, DeviceSpec};
///
/// let spec = DeviceSpec::new(Device::Host)?;
/// let former = set_cache_limits(CacheLimits { bytes_per_place: 0, allocations_per_place: 0 });
/// let x = Array::<f64>::zeros(&spec, &[1024])?;
/// x.synchronize()?;
/// drop(x); // freed, not cached
/// assert_eq!(cached_memory_bytes(), 0);
/// set_cache_limits(former);
/// # Ok::<(), cuferry::Error>(())
/// ```
pub fn set_cache_limits(limits: CacheLimits) -> CacheLimits {
    let cache = global();
    let mut evicted = Leaving::new(cache, Then::Reap);
    let former = cache
        .set_caps(Caps { count: limits.allocations_per_place, bytes: limits.bytes_per_place }, &mut evicted);
    drop(evicted);
    CacheLimits { bytes_per_place: former.bytes, allocations_per_place: former.count }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::{
        global, size_class, Cache, Caps, Leaving, Place, Then, MAX_CACHED, MAX_CACHED_BYTES, MIN_CLASS,
    };
    use crate::copy::copy;
    use crate::memory::allocation::TrackedAllocation;
    use crate::memory::reaper;
    use crate::memory::sealed::Sealed;
    use crate::memory::tracker::{Access, UseTracker};
    use crate::memory::{DeviceBuffer, PinnedBuffer};
    use crate::stream::test_gate::Gate;
    use crate::stream::Stream;
    use crate::Device;

    /// Classes hold their sizes, waste at most a quarter, and are classes of themselves.
    #[test]
    fn size_classes_round_up_by_at_most_a_quarter() {
        assert_eq!(size_class(0), 0);
        assert_eq!(size_class(1), MIN_CLASS);
        assert_eq!(size_class(MIN_CLASS), MIN_CLASS);
        assert_eq!(size_class((1 << 20) + 1), (1 << 20) + (1 << 18));
        assert_eq!(size_class(usize::MAX), usize::MAX);
        let mut x: usize = 1;
        while x < 1 << 40 {
            for bytes in [x, x + 1, x + x / 3, 2 * x - 1] {
                let c = size_class(bytes);
                assert!(c >= bytes, "{bytes} -> {c}");
                assert!(c - bytes < MIN_CLASS || c - bytes <= bytes / 4, "{bytes} -> {c}");
                assert_eq!(size_class(c), c, "the class of {bytes} is not a class");
            }
            x *= 2;
        }
    }

    /// An allocation given back is reused by a take of its class at its place (the same
    /// memory, made the new length), not by another class or place.
    #[test]
    fn a_given_allocation_is_reused_within_its_class_and_place() {
        let cache = Cache::new(Caps { count: 8, bytes: 1 << 20 });
        let (alloc, reused) = TrackedAllocation::cached_in(&cache, Place::Host, 10_000).unwrap();
        assert!(!reused);
        assert_eq!((alloc.bytes(), alloc.capacity()), (10_000, size_class(10_000)));
        let ptr = alloc.ptr();
        drop_into(&cache, alloc);
        assert_eq!(cache.held_bytes(), size_class(10_000));
        assert!(cache.take(Place::Host, 20_000).is_none(), "another class was served");
        assert!(cache.take(Place::CudaDevice(0), 10_000).is_none(), "another place was served");
        let (again, reused) = TrackedAllocation::cached_in(&cache, Place::Host, 9_000).unwrap();
        assert!(reused);
        assert_eq!((again.ptr(), again.bytes()), (ptr, 9_000));
        assert_eq!(cache.held_bytes(), 0);
        drop_into(&cache, again);
        assert_eq!(cache.release(), size_class(10_000));
        assert_eq!(cache.held_bytes(), 0);
        let stats = cache.stats();
        assert_eq!((stats.reused, stats.reclaimed, stats.allocated), (1, 0, 1), "{stats:?}");
    }

    /// Gives `alloc` to `cache` (it must take it).
    fn drop_into(cache: &Cache, alloc: TrackedAllocation) {
        assert!(cache.give(alloc).is_ok(), "the cache refused an allocation under its caps");
    }

    /// Past its count or byte cap a cache frees its longest-cached allocations to make room;
    /// it hands back an allocation larger than its byte cap, or one not made through a cache.
    /// Released or evicted allocations are freed, not given to the process's cache.
    #[test]
    fn past_its_caps_a_cache_frees_its_oldest_allocations() {
        let _serial = global_cache_lock();
        let cache = Cache::new(Caps { count: 2, bytes: 3 * ODD_CLASS });
        let in_global = [1, 2].map(|k| global().count_of(Place::Host, k * ODD_CLASS));
        let make = |bytes| TrackedAllocation::cached_in(&cache, Place::Host, bytes).unwrap().0;
        let [a, b, c] = [0, 1, 2].map(|_| make(ODD_LEN));
        let ptrs = [a.ptr(), b.ptr(), c.ptr()];
        for x in [a, b, c] {
            drop_into(&cache, x);
        }
        assert_eq!(cache.count_of(Place::Host, ODD_CLASS), 2, "the count cap was passed");
        assert_eq!(
            global().count_of(Place::Host, ODD_CLASS),
            in_global[0],
            "an evicted allocation was cached again"
        );
        // The newest first; the oldest was evicted.
        let (again_c, again_b) = (make(ODD_LEN), make(ODD_LEN));
        assert_eq!([again_c.ptr(), again_b.ptr()], [ptrs[2], ptrs[1]]);
        drop_into(&cache, again_b);
        drop_into(&cache, again_c);
        // A class twice as large needs the room of one: the older one goes.
        let big = make(2 * ODD_CLASS);
        drop_into(&cache, big);
        assert_eq!(cache.count_of(Place::Host, ODD_CLASS), 1, "the byte cap was passed");
        assert_eq!(cache.held_bytes(), 3 * ODD_CLASS);
        assert_eq!(make(ODD_LEN).ptr(), ptrs[2], "the newer one was evicted");
        assert!(cache.give(make(4 * ODD_CLASS)).is_err(), "taken past the byte cap alone");
        let plain = TrackedAllocation::host_zeroed(MIN_CLASS).unwrap();
        assert!(cache.give(plain).is_err(), "an allocation made outside the cache was taken");
        assert_eq!(cache.release(), 2 * ODD_CLASS);
        assert_eq!(cache.held_bytes(), 0);
        assert_eq!(
            global().count_of(Place::Host, 2 * ODD_CLASS),
            in_global[1],
            "a released allocation was cached again"
        );
    }

    /// Lowered caps evict at once, oldest first, what no longer fits; caps of 0 refuse every
    /// allocation and make new ones exactly as large as asked; raised caps take them again.
    #[test]
    fn lowered_caps_evict_at_once_and_zero_caps_turn_caching_off() {
        let cache = Cache::new(Caps { count: 8, bytes: 8 * ODD_CLASS });
        let make = |cache: &Cache| TrackedAllocation::cached_in(cache, Place::Host, ODD_LEN).unwrap().0;
        let allocs = [0, 1, 2, 3].map(|_| make(&cache));
        let ptrs = allocs.each_ref().map(TrackedAllocation::ptr);
        for alloc in allocs {
            drop_into(&cache, alloc);
        }
        let mut evicted = Leaving::new(&cache, Then::Free);
        let former = cache.set_caps(Caps { count: 8, bytes: 2 * ODD_CLASS + 1 }, &mut evicted);
        assert_eq!((former.count, former.bytes), (8, 8 * ODD_CLASS));
        assert_eq!(
            evicted.allocs.iter().map(TrackedAllocation::ptr).collect::<Vec<_>>(),
            ptrs[..2],
            "not the oldest"
        );
        assert_eq!(cache.held_bytes(), 2 * ODD_CLASS, "the byte cap was not applied at once");
        cache.set_caps(Caps { count: 1, bytes: 8 * ODD_CLASS }, &mut evicted);
        assert_eq!(evicted.allocs.len(), 3, "the count cap was not applied at once");
        assert_eq!(cache.count_of(Place::Host, ODD_CLASS), 1);
        cache.set_caps(Caps { count: 0, bytes: 8 * ODD_CLASS }, &mut evicted);
        assert_eq!((evicted.allocs.len(), cache.held_bytes()), (4, 0), "zero caps kept an allocation");
        assert_eq!(cache.leaving_where(|p| p == Place::Host), 4, "evictions not counted as leaving");
        drop(evicted);
        assert_eq!(cache.leaving_where(|_| true), 0, "freed evictions still counted as leaving");
        let exact = make(&cache);
        assert_eq!(
            (exact.capacity(), exact.is_recycled()),
            (ODD_LEN, false),
            "sized for a cache that is off"
        );
        assert!(cache.give(exact).is_err());
        // Made under the old caps, given back under caps of 0 bytes: refused.
        cache.set_caps(Caps { count: 8, bytes: 8 * ODD_CLASS }, &mut Leaving::new(&cache, Then::Free));
        let made_before = make(&cache);
        cache.set_caps(Caps { count: 8, bytes: 0 }, &mut Leaving::new(&cache, Then::Free));
        assert!(cache.give(made_before).is_err(), "taken past a byte cap of 0");
        cache.set_caps(Caps { count: 8, bytes: 8 * ODD_CLASS }, &mut Leaving::new(&cache, Then::Free));
        drop_into(&cache, make(&cache));
        assert_eq!(cache.release(), ODD_CLASS);
    }

    /// `set_cache_limits` changes the process's cache: it returns the former limits, and
    /// memory it no longer fits leaves the cache.
    #[test]
    fn set_cache_limits_evicts_from_the_process_cache() {
        let _serial = global_cache_lock();
        let staging = PinnedBuffer::<u8>::staging(Device::Host, ODD_LEN).unwrap();
        drop(staging);
        assert!(global().count_of(Place::Host, ODD_CLASS) >= 1);
        let small = super::CacheLimits { bytes_per_place: ODD_CLASS - 1, allocations_per_place: MAX_CACHED };
        let former = super::set_cache_limits(small);
        assert_eq!(former, super::CacheLimits::default());
        assert_eq!(super::cache_limits(), small);
        assert_eq!(global().count_of(Place::Host, ODD_CLASS), 0, "the lowered limit kept the memory");
        let again = PinnedBuffer::<u8>::staging(Device::Host, ODD_LEN).unwrap();
        drop(again);
        assert_eq!(global().count_of(Place::Host, ODD_CLASS), 0, "cached past the limit");
        assert_eq!(super::set_cache_limits(former), small);
    }

    /// `cache_limits` never reports a pair of limits nobody set (one limit of one call with
    /// the other of another) while `set_cache_limits` runs on another thread.
    #[test]
    fn cache_limits_never_reports_a_pair_never_set() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let _serial = global_cache_lock();
        let a = super::CacheLimits { bytes_per_place: 1 << 20, allocations_per_place: 1 };
        let b = super::CacheLimits { bytes_per_place: 2 << 20, allocations_per_place: 2 };
        let former = super::set_cache_limits(a);
        let stop = AtomicBool::new(false);
        let mut reads = 0u64;
        std::thread::scope(|scope| {
            scope.spawn(|| {
                for i in 0..100_000 {
                    super::set_cache_limits(if i % 2 == 0 { b } else { a });
                }
                stop.store(true, Ordering::SeqCst);
            });
            while !stop.load(Ordering::SeqCst) {
                let seen = super::cache_limits();
                reads += 1;
                assert!(seen == a || seen == b, "read {seen:?}, set were {a:?} and {b:?}");
            }
        });
        super::set_cache_limits(former);
        assert!(reads > 0);
    }

    /// Serialises the tests that use the process's cache with those that release it (by an
    /// out-of-memory retry).
    pub(crate) fn global_cache_lock() -> std::sync::MutexGuard<'static, ()> {
        static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
        LOCK.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A size class no other test of this binary allocates (3.5 MiB), so the process's cache
    /// hands its memory to these tests alone.
    const ODD_LEN: usize = (3 << 20) + (1 << 19) - 100;

    /// The size class of [`ODD_LEN`].
    const ODD_CLASS: usize = (3 << 20) + (1 << 19);

    /// A cached buffer dropped while its work waits is not reused until that work has run
    /// (the reaper then gives it to the cache), and a reused one asked for zeroed comes
    /// zeroed although its former user filled it.
    #[test]
    fn cached_memory_is_reused_only_after_its_work_and_zeroed_when_asked() {
        let _serial = global_cache_lock();
        let stream = Stream::new(Device::Host).unwrap();
        let ones = DeviceBuffer::from_slice(&stream, &vec![0xffu8; ODD_LEN]).unwrap();
        let mut first = DeviceBuffer::<u8>::zeroed_cached(&stream, ODD_LEN).unwrap();
        let first_ptr = first.raw_parts().ptr;
        let held = Stream::new(Device::Host).unwrap();
        let gate = Gate::hold(&held);
        copy(&held, &ones, &mut first).unwrap();
        drop(first); // its copy waits behind the gate: deferred, not cached
        let second = DeviceBuffer::<u8>::zeroed_cached(&stream, ODD_LEN).unwrap();
        assert_ne!(second.raw_parts().ptr, first_ptr, "memory was reused while its copy was queued");
        assert!(!gate.passed());
        gate.open_after(std::time::Duration::ZERO).join().unwrap();
        reaper::drain(); // the copy ran, and the reaper gave the memory to the cache
        let third = DeviceBuffer::<u8>::zeroed_cached(&stream, ODD_LEN).unwrap();
        assert_eq!(third.raw_parts().ptr, first_ptr, "idle cached memory was not reused");
        let got = third.to_vec(&stream).unwrap();
        assert!(got.iter().all(|&b| b == 0), "reused memory kept its former user's bytes");
        drop((second, third));
    }

    /// Memory dropped while its work waits is reused by the next allocation of its class as
    /// soon as that work has finished, without waiting for the reaper's next poll (which the
    /// held work has backed off to its longest sleep).
    #[test]
    fn memory_whose_work_finished_is_reused_before_the_reapers_next_poll() {
        let _serial = global_cache_lock();
        let stream = Stream::new(Device::Host).unwrap();
        let held = Stream::new(Device::Host).unwrap();
        let ones = DeviceBuffer::from_slice(&stream, &vec![1u8; ODD_LEN]).unwrap();
        for round in 0..10 {
            let mut buf = DeviceBuffer::<u8>::zeroed_cached(&stream, ODD_LEN).unwrap();
            let ptr = buf.raw_parts().ptr;
            let gate = Gate::hold(&held);
            copy(&held, &ones, &mut buf).unwrap();
            global().release(); // nothing else of its class to reuse
            drop(buf); // its copy waits behind the gate: handed to the reaper
            gate.open_after(std::time::Duration::from_millis(5)).join().unwrap();
            held.synchronize().unwrap();
            let again = DeviceBuffer::<u8>::zeroed_cached(&stream, ODD_LEN).unwrap();
            assert_eq!(again.raw_parts().ptr, ptr, "round {round}: idle memory waited for the reaper's poll");
            assert!(again.to_vec(&stream).unwrap().iter().all(|&b| b == 0), "round {round}: not zeroed");
        }
    }

    /// Threads that fill cached buffers, copy them on a second stream into buffers dropped
    /// with the copy still queued (so that the reaper holds them and misses reclaim them; in
    /// every fourth round the copy waits behind a gate until the next buffer is allocated and
    /// filled), and read everything back, while another thread keeps releasing the cache,
    /// never get the same memory at once: each reads back exactly what it wrote.
    #[test]
    fn concurrent_reuse_never_hands_memory_to_two_owners() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let _serial = global_cache_lock();
        const LEN: usize = 3000; // one size class for every thread
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    global().release();
                    std::thread::sleep(std::time::Duration::from_micros(300));
                }
            });
            let workers: Vec<_> = (0..4u32)
                .map(|t| {
                    scope.spawn(move || {
                        let (stream, other) =
                            (Stream::new(Device::Host).unwrap(), Stream::new(Device::Host).unwrap());
                        let pattern = |i: u32| -> Vec<u32> {
                            (0..LEN as u32).map(|k| (t << 28) ^ (i << 12) ^ k).collect()
                        };
                        for i in 0..300u32 {
                            let data = pattern(2 * i);
                            let buf = DeviceBuffer::from_slice_cached(&stream, &data).unwrap();
                            let gate = (i % 4 == 0).then(|| Gate::hold(&other));
                            let mut tmp = DeviceBuffer::<u32>::zeroed_cached(&other, LEN).unwrap();
                            copy(&other, &buf, &mut tmp).unwrap();
                            if i % 3 == 1 && gate.is_none() {
                                assert_eq!(tmp.to_vec(&other).unwrap(), data, "thread {t} round {i}: copy");
                            }
                            drop(tmp); // often with its copy still queued
                            let next_data = pattern(2 * i + 1);
                            let next = DeviceBuffer::from_slice_cached(&stream, &next_data).unwrap();
                            if let Some(gate) = gate {
                                gate.open_after(std::time::Duration::ZERO).join().unwrap();
                                other.synchronize().unwrap();
                            }
                            assert_eq!(buf.to_vec(&stream).unwrap(), data, "thread {t} round {i}: source");
                            assert_eq!(
                                next.to_vec(&stream).unwrap(),
                                next_data,
                                "thread {t} round {i}: next"
                            );
                        }
                    })
                })
                .collect();
            let results: Vec<_> = workers.into_iter().map(|w| w.join()).collect();
            stop.store(true, Ordering::Relaxed);
            for r in results {
                if let Err(panic) = r {
                    std::panic::resume_unwind(panic);
                }
            }
        });
    }

    /// Staging buffers come from the cache too; an allocation failing for lack of memory
    /// releases the cache before its second try; an allocation the cache could never keep is
    /// made exactly as large as asked.
    #[test]
    fn out_of_memory_releases_the_cache() {
        let _serial = global_cache_lock();
        let staging = PinnedBuffer::<u8>::staging(Device::Host, ODD_LEN + 1).unwrap();
        let ptr = staging.raw_parts().ptr;
        drop(staging);
        assert!(global().count_of(Place::Host, ODD_CLASS) >= 1);
        // A petabyte: its class is itself, over the cap, and no host has it. The host
        // allocator refuses it for lack of memory (not as a bad layout), so the retry runs.
        let huge = DeviceBuffer::<u8>::zeroed_cached(&Stream::new(Device::Host).unwrap(), 1 << 50);
        assert!(matches!(huge, Err(crate::Error::OutOfMemory { .. })), "{huge:?}");
        assert_eq!(global().count_of(Place::Host, ODD_CLASS), 0, "the failure did not release the cache");
        let again = PinnedBuffer::<u8>::staging(Device::Host, ODD_LEN).unwrap();
        assert!(again.as_slice().is_ok());
        drop((ptr, again));
        // Over the cap: exact, and never cached.
        let big = MAX_CACHED_BYTES + 1;
        let (alloc, _) = TrackedAllocation::cached(Place::Host, big).unwrap();
        assert_eq!((alloc.bytes(), alloc.capacity(), alloc.is_recycled()), (big, big, false));
    }

    /// A host managed pool's allocation failing for lack of memory releases the cache before
    /// its second try, as the host backend's buffers do (it failed at once, the cache kept).
    #[test]
    fn a_host_managed_pool_out_of_memory_releases_the_cache() {
        let _serial = global_cache_lock();
        drop(PinnedBuffer::<u8>::staging(Device::Host, ODD_LEN + 1).unwrap());
        assert!(global().count_of(Place::Host, ODD_CLASS) >= 1);
        let pool = crate::managed::ManagedPool::new(Device::Host, Default::default()).unwrap();
        let huge = pool.alloc::<u8>(1 << 50, &Stream::new(Device::Host).unwrap()).map(drop);
        assert!(matches!(huge, Err(crate::Error::OutOfMemory { .. })), "{huge:?}");
        assert_eq!(global().count_of(Place::Host, ODD_CLASS), 0, "the failure did not release the cache");
    }

    /// A reused allocation keeps no trace of its former uses: its tracker is fresh.
    #[test]
    fn a_cached_allocation_forgets_its_former_uses() {
        let cache = Cache::new(Caps { count: 8, bytes: 1 << 20 });
        let stream = Stream::new(Device::Host).unwrap();
        let (alloc, _) = TrackedAllocation::cached_in(&cache, Place::Host, 64).unwrap();
        UseTracker::use_on(&stream, &[(&alloc.tracker, Access::Write)], || Ok(())).unwrap();
        alloc.tracker.wait_idle().unwrap();
        let handles = stream.handle_count();
        drop_into(&cache, alloc);
        assert!(stream.handle_count() < handles, "the cached tracker still holds its stream");
        let (again, reused) = TrackedAllocation::cached_in(&cache, Place::Host, 64).unwrap();
        assert!(reused);
        assert_eq!(stream.handle_count(), handles - 1);
        drop_into(&cache, again);
        cache.release();
    }
}
