//! Caller memory as a ring's host slots ([`TransferBackend::register_host_slots`]), page-locked
//! with `cudaHostRegister`.
//!
//! Rules:
//! - Each slot is registered alone first, as exactly its own bytes. CUDA documents only that a
//!   range "already registered" is refused (`cudaErrorHostMemoryAlreadyRegistered`), not at
//!   what granularity: a driver that tracks byte ranges takes two `Vec`s side by side on one
//!   page, one that tracks the whole pages it locks refuses the second. Heap `Vec`s often
//!   share a page (the allocator puts blocks side by side, multi-MiB ones too once its mmap
//!   threshold has grown), and one pageable slot makes every upload of the ring synchronous.
//!   So when a slot sharing a page with another slot is refused, the registrations of its
//!   group (the slots whose pages touch, through a chain of neighbours) are undone and the
//!   group is registered as one range, from its first byte to its last. The bytes between
//!   two of its slots lie in a page both share, so the range stays mapped while the slots
//!   live; a byte-range driver never gets such a range, so no bytes but the slots' are
//!   locked there.
//! - A group the driver refuses as one range too (another registration holds some of its
//!   bytes; "not supported") is registered slot by slot again, each slot pageable when
//!   refused. Any other error is returned, and the ranges registered so far are unregistered.
//! - The slots are never handed back: one slot's memory could not be freed while the range
//!   registered with it still covers a neighbour.
//! - `Drop` waits for every slot's queued uploads, then unregisters each range. When a wait or
//!   an unregister fails, every slot's memory is leaked instead (a copy may still read it, or
//!   CUDA still holds a registration over it).
//! - On the host backend nothing is registered and every slot is pageable.
//!
//! [`TransferBackend::register_host_slots`]: super::TransferBackend::register_host_slots

use std::os::raw::c_void;

use crate::cuda::memory as raw;
use crate::device::Device;
use crate::error::{record_drop_error, Result};
use crate::memory::sealed::RawParts;
use crate::memory::tracker::UseTracker;
use crate::memory::MemoryKind;

/// One slot: caller memory, whether it is page-locked, and its queued uses.
#[derive(Debug)]
pub(super) struct CallerSlot {
    data: Vec<u8>,
    pinned: bool,
    tracker: UseTracker,
}

impl CallerSlot {
    /// Bytes in the slot.
    pub(super) fn len(&self) -> usize {
        self.data.len()
    }

    /// Pinned when its range was registered, pageable otherwise.
    pub(super) fn kind(&self) -> MemoryKind {
        if self.pinned {
            MemoryKind::Pinned
        } else {
            MemoryKind::Pageable
        }
    }

    /// The raw view the copy engine works on.
    pub(super) fn raw_parts(&self) -> RawParts<'_> {
        RawParts { ptr: self.data.as_ptr().cast_mut(), bytes: self.data.len(), tracker: &self.tracker }
    }

    /// The slot's first address and its length.
    fn span(&self) -> (usize, usize) {
        (self.data.as_ptr() as usize, self.data.len())
    }
}

/// What page-locks host memory: CUDA's `cudaHostRegister` and `cudaHostUnregister` for a
/// device, or a test's model of them.
trait Registrar: Send + Sync + std::fmt::Debug {
    /// Registers `ptr..ptr+bytes`; `Ok(false)` when the driver refuses the range as already
    /// registered or unsupported (the memory stays pageable).
    ///
    /// # Safety
    ///
    /// 1. The range is mapped host memory that stays mapped until [`Registrar::unregister`].
    unsafe fn register(&self, ptr: *mut c_void, bytes: usize) -> Result<bool>;

    /// Unregisters the range registered at `ptr`.
    ///
    /// # Safety
    ///
    /// 1. `ptr` is the base of a range registered here, and no queued work uses it.
    unsafe fn unregister(&self, ptr: *mut c_void) -> Result<()>;

    /// Called before the slots' waits at release (CUDA makes its device current there, so
    /// that waiting on a thread with no current device does not create a context on device 0).
    fn before_release(&self) {}
}

/// [`Registrar`] for CUDA device `ordinal`.
#[derive(Debug)]
struct CudaRegistrar {
    ordinal: u32,
}

impl Registrar for CudaRegistrar {
    unsafe fn register(&self, ptr: *mut c_void, bytes: usize) -> Result<bool> {
        // SAFETY: the range stays mapped until it is unregistered (Safety 1).
        unsafe { raw::host_register_if_allowed(self.ordinal, ptr, bytes) }
    }

    unsafe fn unregister(&self, ptr: *mut c_void) -> Result<()> {
        // SAFETY: `ptr` was registered by `register` and no queued work uses it (Safety 1).
        unsafe { raw::host_unregister(self.ordinal, ptr) }
    }

    fn before_release(&self) {
        // A failure leaves the waits and the unregister to report it.
        let _ = crate::cuda::device::make_current(self.ordinal);
    }
}

/// Caller memory given as host slots, registered slot by slot, or as one range for
/// page-sharing neighbours the driver refuses one by one (see the module rules).
#[derive(Debug)]
pub(super) struct CallerSlots {
    /// `None` on the host backend, which registers nothing.
    registrar: Option<Box<dyn Registrar>>,
    slots: Vec<CallerSlot>,
    /// The registered ranges, each named by the slot it starts at.
    ranges: Vec<usize>,
}

impl CallerSlots {
    /// Takes `slots` as host slots for uploads to `device`, registering them where the driver
    /// allows.
    ///
    /// # Errors
    ///
    /// As [`Device::check_available`]; CUDA errors of `cudaHostRegister` other than "already
    /// registered" and "not supported".
    pub(super) fn new(device: Device, slots: Vec<Vec<u8>>) -> Result<Self> {
        device.check_available()?;
        let registrar =
            device.cuda_ordinal().map(|ordinal| Box::new(CudaRegistrar { ordinal }) as Box<dyn Registrar>);
        Self::with_registrar(registrar, slots, crate::memory::cpu_page_size())
    }

    /// [`CallerSlots::new`] with the registrar and the page size given.
    fn with_registrar(
        registrar: Option<Box<dyn Registrar>>,
        slots: Vec<Vec<u8>>,
        page: usize,
    ) -> Result<Self> {
        let slots = slots
            .into_iter()
            .map(|data| CallerSlot { data, pinned: false, tracker: UseTracker::default() })
            .collect();
        let mut caller = CallerSlots { registrar, slots, ranges: Vec::new() };
        if caller.registrar.is_some() {
            let spans: Vec<(usize, usize)> = caller.slots.iter().map(CallerSlot::span).collect();
            for group in page_groups(&spans, page) {
                // On an error `caller` drops, unregistering the ranges made so far.
                caller.register_group(&group)?;
            }
        }
        Ok(caller)
    }

    /// The slots, in the caller's order.
    pub(super) fn slots(&self) -> &[CallerSlot] {
        &self.slots
    }

    /// Registers one group (slot indices sorted by address) slot by slot; when the driver
    /// refuses a slot of a group of several, undoes the group's registrations and registers
    /// it as one range, or slot by slot again when that is refused too (module rules).
    fn register_group(&mut self, group: &[usize]) -> Result<()> {
        let mark = self.ranges.len();
        let mut all = true;
        for &slot in group {
            all &= self.register_range(&[slot])?;
        }
        if all || group.len() == 1 {
            return Ok(());
        }
        self.undo_ranges(mark, group)?;
        if self.register_range(group)? {
            return Ok(());
        }
        for &slot in group {
            self.register_range(&[slot])?;
        }
        Ok(())
    }

    /// Unregisters the ranges registered since `self.ranges` had `mark` entries, all within
    /// `group`, whose slots are then pageable. A range that fails to unregister stays listed
    /// (so `release` leaks the memory rather than freeing it while registered).
    fn undo_ranges(&mut self, mark: usize, group: &[usize]) -> Result<()> {
        let Some(registrar) = &self.registrar else { return Ok(()) };
        while self.ranges.len() > mark {
            let first = self.ranges[self.ranges.len() - 1];
            let ptr = self.slots[first].data.as_ptr().cast_mut().cast::<c_void>();
            // SAFETY: `ptr` is the base of a range `register_range` registered, and nothing
            // was queued on the slots yet (they are still being set up).
            unsafe { registrar.unregister(ptr) }?;
            self.ranges.pop();
        }
        for &i in group {
            self.slots[i].pinned = false;
        }
        Ok(())
    }

    /// Registers the range from the first byte of `group[0]` to the last byte of any slot in
    /// `group` (sorted by address); false when the driver refuses it as already registered or
    /// unsupported.
    fn register_range(&mut self, group: &[usize]) -> Result<bool> {
        let (Some(registrar), Some(&first)) = (&self.registrar, group.first()) else { return Ok(false) };
        let (start, _) = self.slots[first].span();
        let end =
            group.iter().map(|&i| self.slots[i].span()).map(|(at, len)| at + len).max().unwrap_or(start);
        let ptr = self.slots[first].data.as_ptr().cast_mut().cast::<c_void>();
        // SAFETY: `ptr..ptr+(end-start)` covers the group's slots and the bytes between them,
        // which lie in pages the slots share (`page_groups`), so the whole range is mapped
        // while the slots live; the slots are owned here and neither freed nor moved until
        // `release` unregisters the range.
        if !unsafe { registrar.register(ptr, end - start) }? {
            return Ok(false);
        }
        self.ranges.push(first);
        for &i in group {
            self.slots[i].pinned = true;
        }
        Ok(true)
    }

    /// Waits for every slot's queued uploads and unregisters every range (once).
    fn release(&mut self) -> Result<()> {
        let Some(registrar) = self.registrar.take().filter(|_| !self.ranges.is_empty()) else {
            return self.wait_all();
        };
        registrar.before_release();
        self.wait_all()?;
        let mut failed = None;
        for first in std::mem::take(&mut self.ranges) {
            let ptr = self.slots[first].data.as_ptr().cast_mut().cast::<c_void>();
            // SAFETY: `ptr` is the base of a range `register_range` registered, and no queued
            // upload reads any slot any more (`wait_all`).
            if let Err(err) = unsafe { registrar.unregister(ptr) } {
                failed.get_or_insert(err);
            }
        }
        match failed {
            Some(err) => {
                // Still registered: freeing the memory would leave CUDA a registration over
                // memory the allocator hands out again.
                self.leak_slots();
                Err(err)
            }
            None => Ok(()),
        }
    }

    /// Waits for every slot's queued uses; on a failure leaks every slot (a copy may still
    /// read one) and its registrations, and returns the first error.
    fn wait_all(&mut self) -> Result<()> {
        let failed = self.slots.iter().find_map(|s| s.tracker.wait_idle().err());
        match failed {
            Some(err) => {
                self.ranges.clear();
                self.leak_slots();
                Err(err)
            }
            None => Ok(()),
        }
    }

    /// Leaks every slot's memory.
    fn leak_slots(&mut self) {
        for slot in self.slots.drain(..) {
            std::mem::forget(slot.data);
        }
    }
}

impl Drop for CallerSlots {
    fn drop(&mut self) {
        if let Err(err) = self.release() {
            record_drop_error(err);
        }
    }
}

/// Groups the non-empty `spans` (`(address, bytes)`) whose pages of `page` bytes (a power of
/// two) touch, through a chain of neighbours: each group lists span indices sorted by
/// address. A span sharing no page with another is a group of its own; empty spans are in no
/// group.
pub(super) fn page_groups(spans: &[(usize, usize)], page: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..spans.len()).filter(|&i| spans[i].1 > 0).collect();
    order.sort_by_key(|&i| spans[i].0);
    let last_page = |(at, len): (usize, usize)| (at + (len - 1)) / page;
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut reach = 0; // the last page the current group covers
    for i in order {
        let (first, last) = (spans[i].0 / page, last_page(spans[i]));
        match groups.last_mut() {
            Some(group) if first <= reach => {
                group.push(i);
                reach = reach.max(last);
            }
            _ => {
                groups.push(vec![i]);
                reach = last;
            }
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    const PAGE: usize = 4096;

    #[test]
    fn spans_sharing_a_page_are_one_group() {
        // Two heap blocks side by side: the first ends in the page the second starts in.
        let spans = [(PAGE + 16, 3 * PAGE), (4 * PAGE + 32, 2 * PAGE)];
        assert_eq!(page_groups(&spans, PAGE), vec![vec![0, 1]]);
    }

    #[test]
    fn spans_in_different_pages_are_separate_groups() {
        // Ends exactly at a page boundary: the next span's page is a new one.
        let spans = [(PAGE, PAGE), (2 * PAGE, 8), (5 * PAGE + 100, 50)];
        assert_eq!(page_groups(&spans, PAGE), vec![vec![0], vec![1], vec![2]]);
    }

    #[test]
    fn groups_chain_through_neighbours_in_address_order() {
        // Given out of order: 2 shares a page with 0, 0 with 1; 3 stands alone; 4 is empty.
        let spans = [(PAGE + 200, PAGE), (2 * PAGE + 300, 10), (100, PAGE + 50), (9 * PAGE, 1), (PAGE, 0)];
        assert_eq!(page_groups(&spans, PAGE), vec![vec![2, 0, 1], vec![3]]);
    }

    #[test]
    fn a_long_span_holds_the_group_open_past_a_short_one() {
        // 0 covers pages 0..=9; 1 sits inside page 3; 2 starts in page 9: all one group.
        let spans = [(0, 10 * PAGE - 1), (3 * PAGE + 8, 8), (9 * PAGE + 4000, 64)];
        assert_eq!(page_groups(&spans, PAGE), vec![vec![0, 1, 2]]);
    }

    proptest::proptest! {
        /// Every span sharing a page with another is in its group, the groups are disjoint in
        /// pages and sorted by address, and no group reaches a page none of its spans touches:
        /// checked against a plain pairwise page comparison.
        #[test]
        fn groups_match_a_pairwise_page_overlap(
            spans in proptest::collection::vec((0..16 * PAGE, 0..3 * PAGE), 1..8)
        ) {
            let groups = page_groups(&spans, PAGE);
            let pages = |i: usize| {
                let (at, len) = spans[i];
                (at / PAGE, (at + len - 1) / PAGE)
            };
            let group_of = |i: usize| groups.iter().position(|g| g.contains(&i));
            for i in 0..spans.len() {
                proptest::prop_assert_eq!(group_of(i).is_some(), spans[i].1 > 0);
                for j in 0..spans.len() {
                    if i != j && spans[i].1 > 0 && spans[j].1 > 0 {
                        let ((a0, a1), (b0, b1)) = (pages(i), pages(j));
                        if a0 <= b1 && b0 <= a1 {
                            proptest::prop_assert_eq!(group_of(i), group_of(j));
                        }
                    }
                }
            }
            let union = |g: &Vec<usize>| {
                let lo = g.iter().map(|&i| pages(i).0).min().unwrap_or(0);
                let hi = g.iter().map(|&i| pages(i).1).max().unwrap_or(0);
                (lo, hi)
            };
            for (x, gx) in groups.iter().enumerate() {
                proptest::prop_assert!(gx.windows(2).all(|w| spans[w[0]].0 <= spans[w[1]].0));
                // No page between a group's first byte and its last without bytes of one of
                // its spans: the range registered for it is mapped wherever its spans are.
                let (lo, hi) = union(gx);
                for page in lo..=hi {
                    proptest::prop_assert!(gx.iter().any(|&i| pages(i).0 <= page && page <= pages(i).1));
                }
                for gy in &groups[x + 1..] {
                    let ((a0, a1), (b0, b1)) = (union(gx), union(gy));
                    proptest::prop_assert!(a1 < b0 || b1 < a0);
                }
            }
        }
    }

    #[test]
    fn host_slots_are_pageable_and_keep_their_contents() {
        let caller =
            CallerSlots::new(Device::Host, vec![vec![1u8; 100], vec![2u8; 5000], Vec::new()]).unwrap();
        let slots = caller.slots();
        assert_eq!(slots.iter().map(CallerSlot::len).collect::<Vec<_>>(), vec![100, 5000, 0]);
        assert!(slots.iter().all(|s| s.kind() == MemoryKind::Pageable));
        assert!(caller.ranges.is_empty());
        // SAFETY: nothing is queued on the slots; the view is read while `caller` lives.
        let second = unsafe { std::slice::from_raw_parts(slots[1].raw_parts().ptr, 5000) };
        assert!(second.iter().all(|&b| b == 2));
    }

    /// A model of the driver's registrations, both kinds the module rules allow for: one that
    /// locks and tracks whole pages of `page` bytes, refusing a range that reaches a page
    /// already registered (as CUDA's "already registered"), or (`by_byte`) one that tracks
    /// byte ranges; plus injected refusals and failures.
    #[derive(Debug, Default)]
    struct ModelState {
        page: usize,
        by_byte: bool,
        /// Live registrations: base address and the pages they lock.
        live: Vec<(usize, std::ops::RangeInclusive<usize>)>,
        /// Ranges registered, in order, as (base, bytes).
        registered: Vec<(usize, usize)>,
        register_calls: usize,
        /// Refuse (as unsupported) any range longer than this.
        refuse_longer_than: Option<usize>,
        /// Fail the register call of this number (1-based) with a hard error.
        fail_call: Option<usize>,
        /// Fail this many unregister calls, from the next one on.
        fail_unregisters: usize,
    }

    #[derive(Debug, Clone)]
    struct ModelDriver(std::sync::Arc<std::sync::Mutex<ModelState>>);

    impl ModelDriver {
        fn new(page: usize) -> Self {
            ModelDriver(std::sync::Arc::new(std::sync::Mutex::new(ModelState { page, ..Default::default() })))
        }

        fn state(&self) -> std::sync::MutexGuard<'_, ModelState> {
            self.0.lock().unwrap()
        }

        fn slots(&self, slots: Vec<Vec<u8>>) -> Result<CallerSlots> {
            let page = self.state().page;
            CallerSlots::with_registrar(Some(Box::new(self.clone())), slots, page)
        }
    }

    impl Registrar for ModelDriver {
        unsafe fn register(&self, ptr: *mut c_void, bytes: usize) -> Result<bool> {
            let mut m = self.state();
            m.register_calls += 1;
            if m.fail_call == Some(m.register_calls) {
                return Err(Error::invalid("injected register failure"));
            }
            if m.refuse_longer_than.is_some_and(|most| bytes > most) {
                return Ok(false);
            }
            let at = ptr as usize;
            let unit = if m.by_byte { 1 } else { m.page };
            let pages = at / unit..=(at + bytes - 1) / unit;
            if m.live.iter().any(|(_, p)| p.start() <= pages.end() && pages.start() <= p.end()) {
                return Ok(false);
            }
            m.live.push((at, pages));
            m.registered.push((at, bytes));
            Ok(true)
        }

        unsafe fn unregister(&self, ptr: *mut c_void) -> Result<()> {
            let mut m = self.state();
            if m.fail_unregisters > 0 {
                m.fail_unregisters -= 1;
                return Err(Error::invalid("injected unregister failure"));
            }
            let at = m.live.iter().position(|(base, _)| *base == ptr as usize);
            let at = at.ok_or_else(|| Error::invalid("unregister of a range never registered"))?;
            m.live.remove(at);
            Ok(())
        }
    }

    fn spans_of(slots: &[Vec<u8>]) -> Vec<(usize, usize)> {
        slots.iter().map(|v| (v.as_ptr() as usize, v.len())).collect()
    }

    /// Small heap blocks side by side in one page, under a driver that tracks whole pages:
    /// the first registered alone holds the page and the next is refused, so the group is
    /// registered again as one range and every slot is pinned. Registered only one by one,
    /// all but the first would stay pageable.
    #[test]
    fn heap_neighbours_sharing_a_page_are_all_pinned_by_one_range() {
        const PAGE: usize = 1 << 30;
        let slots: Vec<Vec<u8>> = (0..6).map(|i| vec![i as u8; 100]).collect();
        let spans = spans_of(&slots);
        // All in one 1 GiB page, unless the allocator placed them across a boundary.
        assert_eq!(page_groups(&spans, PAGE).len(), 1, "{spans:?}");
        let driver = ModelDriver::new(PAGE);
        let caller = driver.slots(slots).unwrap();
        assert!(caller.slots().iter().all(|s| s.kind() == MemoryKind::Pinned));
        let lo = spans.iter().map(|s| s.0).min().unwrap();
        let hi = spans.iter().map(|s| s.0 + s.1).max().unwrap();
        {
            let m = driver.state();
            assert_eq!(m.registered.last(), Some(&(lo, hi - lo)), "{m:?}");
            assert_eq!(m.live.len(), 1, "{m:?}");
        }
        for (slot, i) in caller.slots().iter().zip(0u8..) {
            // SAFETY: nothing is queued on the slots; read while `caller` lives.
            let bytes = unsafe { std::slice::from_raw_parts(slot.raw_parts().ptr, slot.len()) };
            assert!(bytes.iter().all(|&b| b == i));
        }
        drop(caller);
        assert!(driver.state().live.is_empty(), "{:?}", driver.state());
    }

    /// Under a driver that tracks byte ranges, neighbours on one page register alone: exactly
    /// their own bytes, never the heap bytes between them.
    #[test]
    fn a_byte_range_driver_registers_each_slot_alone() {
        const PAGE: usize = 1 << 30;
        let slots: Vec<Vec<u8>> = (0..6).map(|_| vec![0u8; 100]).collect();
        let mut spans = spans_of(&slots);
        assert_eq!(page_groups(&spans, PAGE).len(), 1, "{spans:?}");
        let driver = ModelDriver::new(PAGE);
        driver.state().by_byte = true;
        let caller = driver.slots(slots).unwrap();
        assert!(caller.slots().iter().all(|s| s.kind() == MemoryKind::Pinned));
        spans.sort();
        assert_eq!(driver.state().registered, spans);
        drop(caller);
        assert!(driver.state().live.is_empty());
    }

    /// A group refused as one range too is registered slot by slot again: here the first
    /// (lowest address) is registered and the others, in its page, are refused and pageable.
    #[test]
    fn a_group_refused_as_one_range_falls_back_slot_by_slot() {
        const PAGE: usize = 1 << 30;
        let slots: Vec<Vec<u8>> = (0..4).map(|_| vec![7u8; 100]).collect();
        let spans = spans_of(&slots);
        assert_eq!(page_groups(&spans, PAGE).len(), 1, "{spans:?}");
        let lowest = (0..4).min_by_key(|&i| spans[i].0).unwrap();
        let driver = ModelDriver::new(PAGE);
        driver.state().refuse_longer_than = Some(100);
        let caller = driver.slots(slots).unwrap();
        let kinds: Vec<MemoryKind> = caller.slots().iter().map(CallerSlot::kind).collect();
        for (i, kind) in kinds.iter().enumerate() {
            let want = if i == lowest { MemoryKind::Pinned } else { MemoryKind::Pageable };
            assert_eq!(*kind, want, "{kinds:?}");
        }
        let m = driver.state();
        // Slot by slot, the refused group range, slot by slot again.
        assert_eq!(m.register_calls, 4 + 1 + 4, "{m:?}");
        assert_eq!(m.registered, vec![spans[lowest]; 2], "{m:?}");
        assert_eq!(m.live.len(), 1, "{m:?}");
        drop(m);
        drop(caller);
        assert!(driver.state().live.is_empty());
    }

    /// An unregister failing while a group's registrations are undone is returned, and the
    /// range stays listed: released with the rest (here the second try succeeds), never
    /// forgotten while registered.
    #[test]
    fn an_undo_failure_is_returned_and_its_range_kept() {
        const PAGE: usize = 1 << 30;
        let slots: Vec<Vec<u8>> = (0..2).map(|_| vec![5u8; 100]).collect();
        assert_eq!(page_groups(&spans_of(&slots), PAGE).len(), 1);
        let driver = ModelDriver::new(PAGE);
        driver.state().fail_unregisters = 1;
        let err = driver.slots(slots).unwrap_err();
        assert!(err.to_string().contains("injected unregister failure"), "{err}");
        let m = driver.state();
        assert_eq!((m.registered.len(), m.fail_unregisters), (1, 0), "{m:?}");
        assert!(m.live.is_empty(), "the range was dropped from the list: {m:?}");
    }

    /// A hard error while registering undoes the ranges registered before it.
    #[test]
    fn a_register_failure_unregisters_what_was_registered() {
        // With 16-byte pages, distinct heap blocks never share one: each slot is its own group.
        const PAGE: usize = 16;
        let slots: Vec<Vec<u8>> = (0..3).map(|_| vec![1u8; 100]).collect();
        assert_eq!(page_groups(&spans_of(&slots), PAGE).len(), 3);
        let driver = ModelDriver::new(PAGE);
        driver.state().fail_call = Some(3);
        let err = driver.slots(slots).unwrap_err();
        assert!(err.to_string().contains("injected register failure"), "{err}");
        let m = driver.state();
        assert_eq!(m.registered.len(), 2);
        assert!(m.live.is_empty(), "{m:?}");
    }

    /// A failed unregister is returned and the memory leaked, never freed while registered.
    #[test]
    fn an_unregister_failure_is_reported_and_the_memory_leaked() {
        let driver = ModelDriver::new(4096);
        let mut caller = driver.slots(vec![vec![3u8; 64], vec![4u8; 64]]).unwrap();
        assert!(!caller.ranges.is_empty());
        for slot in caller.slots() {
            // Leaked on purpose below: kept reachable for LeakSanitizer.
            crate::memory::leaked_on_purpose::keep(slot.raw_parts().ptr);
        }
        driver.state().fail_unregisters = usize::MAX;
        let err = caller.release().unwrap_err();
        assert!(err.to_string().contains("injected unregister failure"), "{err}");
        assert!(caller.slots().is_empty());
        drop(caller); // nothing left to release
    }
}
