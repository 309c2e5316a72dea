//! The CPU implementation: runs a plan's transfers on the host, as one job on a host stream.
//!
//! Rules:
//! - Rows contiguous on both sides and not negated are copied with `memcpy`; every other row
//!   (turned, flipped, negated, strided) with a typed strided loop. No index arrays.
//! - Jobs above [`PARALLEL_MIN_BYTES`] are split into byte-balanced parts of the output order and
//!   run on scoped threads (one part on the calling worker). Parts never write the same bytes:
//!   pack parts write disjoint slot ranges; unpack parts write distinct elements because spec
//!   dims never overlap and the packer rejects overlapping unpack regions of one array.
//! - Negation flips the sign bit of floats (what `-x` does, bit for bit) and wraps `i32`.

use std::sync::{Arc, OnceLock};

use super::plan::{Plan, Transfer};
use super::spec::ElemKind;

/// Jobs moving more bytes than this use several threads.
pub(crate) const PARALLEL_MIN_BYTES: usize = 4 << 20;

/// Bytes per thread that make another thread worth starting.
const BYTES_PER_THREAD: usize = 2 << 20;

/// Most threads one job uses.
const MAX_THREADS: usize = 16;

/// Which way a job copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Arrays -> packed buffer (rotating, negating).
    Pack,
    /// Packed buffer -> arrays.
    Unpack,
}

/// A pack or unpack bound to memory, carried to a host stream's worker.
pub(crate) struct HostJob {
    pub(crate) plan: Arc<Plan>,
    pub(crate) direction: Direction,
    /// The array base of each transfer, in transfer order.
    pub(crate) arrays: Vec<*mut u8>,
    /// The packed buffer.
    pub(crate) packed: *mut u8,
    /// Most threads to use (1: the worker alone).
    pub(crate) max_threads: usize,
}

// SAFETY: the pointers name the arrays and the packed buffer, whose trackers record this job
// (so they stay allocated and untouched by other queued work until it has run); moving the
// addresses to the worker thread is what the tracker protocol exists for.
unsafe impl Send for HostJob {}
// SAFETY: shared only between the scoped threads of `run`, which write disjoint bytes (see the
// module rules) and only read the rest.
unsafe impl Sync for HostJob {}

/// A range of atoms of one transfer, in output (row-major) order.
#[derive(Clone, Copy, Debug)]
struct Part {
    transfer: usize,
    start: usize,
    end: usize,
}

/// The default thread budget: the machine's parallelism, at most [`MAX_THREADS`].
pub(crate) fn thread_budget() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_THREADS))
}

impl HostJob {
    fn transfers(&self) -> &[Transfer] {
        match self.direction {
            Direction::Pack => &self.plan.pack,
            Direction::Unpack => &self.plan.unpack,
        }
    }

    /// Runs every transfer, on several threads when the job is large.
    pub(crate) fn run(&self) {
        let transfers = self.transfers();
        let total: usize = transfers.iter().map(Transfer::bytes).sum();
        let threads =
            if total > PARALLEL_MIN_BYTES { self.max_threads.min(total / BYTES_PER_THREAD) } else { 1 };
        if threads <= 1 {
            for (i, t) in transfers.iter().enumerate() {
                self.run_part(Part { transfer: i, start: 0, end: t.atoms() });
            }
            return;
        }
        let groups = split(transfers, total, threads);
        std::thread::scope(|scope| {
            let mut groups = groups.into_iter();
            let mine = groups.next().unwrap_or_default();
            for group in groups {
                scope.spawn(move || group.into_iter().for_each(|p| self.run_part(p)));
            }
            mine.into_iter().for_each(|p| self.run_part(p));
        });
    }

    fn run_part(&self, part: Part) {
        let t = &self.transfers()[part.transfer];
        let array_first = self.arrays[part.transfer].wrapping_add(t.array_offset * t.atom);
        let packed_first = self.packed.wrapping_add(t.packed_offset);
        let (src, src_strides, dst, dst_strides, negate) = match self.direction {
            Direction::Pack => (array_first, &t.array_strides, packed_first, &t.packed_strides, t.negate),
            Direction::Unpack => (packed_first, &t.packed_strides, array_first, &t.array_strides, false),
        };
        let negate = if negate { t.kind } else { ElemKind::Bits };
        // SAFETY: the packer checked that every array holds its spec's extent and that the
        // packed buffer holds every slot, so each view element is inside its allocation; the
        // trackers keep both alive and the threads' parts are disjoint (module rules).
        unsafe { copy_part(t, part.start, part.end, (src, src_strides), (dst, dst_strides), negate) };
    }
}

/// Splits the output order of all transfers into `threads` byte-balanced groups.
fn split(transfers: &[Transfer], total: usize, threads: usize) -> Vec<Vec<Part>> {
    let per_group = total.div_ceil(threads).max(1);
    let mut groups: Vec<Vec<Part>> = vec![Vec::new()];
    let mut room = per_group;
    for (i, t) in transfers.iter().enumerate() {
        let atoms = t.atoms();
        let mut start = 0;
        while start < atoms {
            let take = (room / t.atom).clamp(1, atoms - start);
            if let Some(group) = groups.last_mut() {
                group.push(Part { transfer: i, start, end: start + take });
            }
            start += take;
            room = room.saturating_sub(take * t.atom);
            if room == 0 {
                if groups.len() < threads {
                    groups.push(Vec::new());
                    room = per_group;
                } else {
                    room = usize::MAX; // the last group takes the rest
                }
            }
        }
    }
    groups
}

/// Elements a strided or negating row loop loads before it stores them: element-by-element
/// load/store interleaving makes the CPU serialise loads behind possibly-aliasing stores
/// (measured 2x slower than `memcpy` on 24-byte rows), batches keep several loads in flight.
const BATCH: usize = 8;

/// The geometry of one part: atoms `start..end` (output order) of a transfer, between two
/// strided sides.
struct Walk<'a> {
    extent: &'a [usize],
    src: *const u8,
    src_strides: &'a [isize],
    dst: *mut u8,
    dst_strides: &'a [isize],
    start: usize,
    end: usize,
}

/// Copies atoms `start..end` (output order) of transfer `t` from `src` to `dst`.
///
/// # Safety
///
/// 1. For every index of `t.extent`, `src + sum(i * src_strides) * atom` and the same on the
///    `dst` side are inside live allocations, readable and writable respectively.
/// 2. No other thread writes the bytes read, or touches the bytes written, during the call.
unsafe fn copy_part(
    t: &Transfer,
    start: usize,
    end: usize,
    (src, src_strides): (*const u8, &[isize]),
    (dst, dst_strides): (*mut u8, &[isize]),
    negate: ElemKind,
) {
    let w = Walk { extent: &t.extent, src, src_strides, dst, dst_strides, start, end };
    // SAFETY (every arm): preconditions 1 and 2, with the element type matching `t.atom`.
    unsafe {
        match (t.atom, negate) {
            (8, ElemKind::F64) => walk::<u64>(&w, false, |x| x ^ (1 << 63)),
            (4, ElemKind::F32) => walk::<u32>(&w, false, |x| x ^ (1 << 31)),
            (4, ElemKind::I32) => walk::<u32>(&w, false, u32::wrapping_neg),
            (8, _) => walk::<u64>(&w, true, |x| x),
            (4, _) => walk::<u32>(&w, true, |x| x),
            (2, _) => walk::<u16>(&w, true, |x| x),
            _ => walk::<u8>(&w, true, |x| x),
        }
    }
}

/// Walks the rows of a part, copying each with `f` applied to every element (`plain`: `f` is
/// the identity, so contiguous rows use `memcpy`). Full rows run in a tight loop
/// along the second-innermost dim; the odometer over the outer dims moves once per plane.
///
/// # Safety
///
/// As [`copy_part`], with `size_of::<E>()` the transfer's atom.
#[inline(always)]
unsafe fn walk<E: Copy>(w: &Walk<'_>, plain: bool, f: impl Fn(E) -> E + Copy) {
    let nd = w.extent.len();
    let inner = w.extent[nd - 1];
    if inner == 0 || w.start >= w.end {
        return;
    }
    let (ss, ds) = (w.src_strides[nd - 1], w.dst_strides[nd - 1]);
    let row = RowCopy { ss, ds, memcpy: plain && ss == 1 && ds == 1, f };
    // Rows as seen from the second-innermost dim (a lone dim is one row of `inner`).
    let (rows_per_plane, s_step, d_step) =
        if nd >= 2 { (w.extent[nd - 2], w.src_strides[nd - 2], w.dst_strides[nd - 2]) } else { (1, 0, 0) };
    let planes_dims = nd.saturating_sub(2);
    // The multi-index of the first plane, the first row within it, and their offsets.
    let mut plane = [0usize; 8];
    let first_row = w.start / inner;
    let mut r_in_plane = first_row % rows_per_plane;
    let mut rest = first_row / rows_per_plane;
    let (mut s_plane, mut d_plane) = (0isize, 0isize);
    for d in (0..planes_dims).rev() {
        plane[d] = rest % w.extent[d];
        rest /= w.extent[d];
        s_plane += plane[d] as isize * w.src_strides[d];
        d_plane += plane[d] as isize * w.dst_strides[d];
    }
    let mut col = w.start % inner;
    let mut remaining = w.end - w.start;
    let (src, dst) = (w.src.cast::<E>(), w.dst.cast::<E>());
    while remaining > 0 {
        let mut s_row = s_plane + r_in_plane as isize * s_step;
        let mut d_row = d_plane + r_in_plane as isize * d_step;
        while r_in_plane < rows_per_plane && remaining > 0 {
            let n = (inner - col).min(remaining);
            // SAFETY: the row's atoms are inside the views (precondition 1), unraced (2).
            unsafe {
                row.copy(
                    src.wrapping_offset(s_row + col as isize * ss),
                    dst.wrapping_offset(d_row + col as isize * ds),
                    n,
                )
            };
            remaining -= n;
            col = 0;
            r_in_plane += 1;
            s_row += s_step;
            d_row += d_step;
        }
        r_in_plane = 0;
        // Next plane: odometer over the outer dims.
        let mut d_idx = planes_dims;
        while d_idx > 0 {
            d_idx -= 1;
            plane[d_idx] += 1;
            s_plane += w.src_strides[d_idx];
            d_plane += w.dst_strides[d_idx];
            if plane[d_idx] < w.extent[d_idx] {
                break;
            }
            s_plane -= w.extent[d_idx] as isize * w.src_strides[d_idx];
            d_plane -= w.extent[d_idx] as isize * w.dst_strides[d_idx];
            plane[d_idx] = 0;
        }
    }
}

/// How one row is copied.
#[derive(Clone, Copy)]
struct RowCopy<F> {
    ss: isize,
    ds: isize,
    /// Contiguous on both sides and not transformed: rows are copied with `memcpy`.
    memcpy: bool,
    f: F,
}

impl<F> RowCopy<F> {
    /// Copies `n` atoms of the row starting at `s` to `d`.
    ///
    /// # Safety
    ///
    /// 1. Atoms `s + i * ss` are readable and `d + i * ds` writable (i < n), unraced.
    #[inline(always)]
    unsafe fn copy<E: Copy>(&self, s: *const E, d: *mut E, n: usize)
    where
        F: Fn(E) -> E,
    {
        let f = &self.f;
        // SAFETY: precondition 1.
        unsafe {
            if self.memcpy {
                // Short rows (x-faces are 3 atoms) go through fixed-size copies the compiler
                // inlines: a `memcpy` call per 24-byte row costs more than the copy.
                match n {
                    1 => std::ptr::copy_nonoverlapping(s, d, 1),
                    2 => std::ptr::copy_nonoverlapping(s, d, 2),
                    3 => std::ptr::copy_nonoverlapping(s, d, 3),
                    4 => std::ptr::copy_nonoverlapping(s, d, 4),
                    5 => std::ptr::copy_nonoverlapping(s, d, 5),
                    6 => std::ptr::copy_nonoverlapping(s, d, 6),
                    7 => std::ptr::copy_nonoverlapping(s, d, 7),
                    8 => std::ptr::copy_nonoverlapping(s, d, 8),
                    _ => std::ptr::copy_nonoverlapping(s, d, n),
                }
                return;
            }
            let (ss, ds) = (self.ss, self.ds);
            let mut i = 0isize;
            let n = n as isize;
            while i + BATCH as isize <= n {
                let v: [E; BATCH] =
                    std::array::from_fn(|k| f(s.offset((i + k as isize) * ss).read_unaligned()));
                for (k, &x) in v.iter().enumerate() {
                    d.offset((i + k as isize) * ds).write_unaligned(x);
                }
                i += BATCH as isize;
            }
            while i < n {
                d.offset(i * ds).write_unaligned(f(s.offset(i * ss).read_unaligned()));
                i += 1;
            }
        }
    }
}
