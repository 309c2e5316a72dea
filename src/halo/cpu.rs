//! The CPU implementation: runs a plan's transfers on the host, as one job on a host stream.
//!
//! Rules:
//! - Each transfer gets a loop nest once, when the packer is built ([`HostSchedule`]): rows
//!   contiguous on both sides (forwards, or backwards after a flip) are copied in 64-byte
//!   blocks, rows of 1 to 8 atoms by a loop specialised on the length; a turn whose source and
//!   destination are contiguous along different dims is a tiled transpose (8 x 8 atom blocks,
//!   read as source runs, written as destination runs); anything else is a strided loop. No
//!   index arrays, and no `memcpy` call per row.
//! - The loops are compiled twice, for the baseline CPU and for AVX2; the AVX2 copy is used
//!   when the CPU has it (checked at run time).
//! - Row nests with rows of at least 128 bytes ask for the source lines of the plane two
//!   planes ahead (a prefetch hint: nothing is read early, no address is checked).
//! - Jobs above [`PARALLEL_MIN_BYTES`] are split into byte-balanced parts (ranges of atoms of
//!   row nests, ranges of `8`-wide panels of transposes) and run on the process's halo helper
//!   threads (one part on the calling worker; see `threads`). Parts never write the same bytes: pack parts write disjoint slot
//!   ranges; unpack parts write distinct elements because spec dims never overlap and the
//!   packer rejects overlapping unpack regions of one array.
//! - Negation flips the sign bit of floats (what `-x` does, bit for bit) and wraps `i32`.

mod kernels;

use std::sync::{Arc, OnceLock};

use super::threads;

use super::plan::{Plan, Transfer};
use super::spec::{ElemKind, MAX_DIMS};
use kernels::TILE;

/// Jobs moving more bytes than this use several threads.
///
/// Measured on the 16-core H100 host with the helper threads (`threads`): from 512 KiB, a
/// thread per 128 KiB took ten 48x48x79 y-face exchanges (1.8 MB of 384-byte rows) to 2.1x a
/// same-bytes single-thread memcpy and 4 x 384^2 y-faces to 4.1x. Below 512 KiB waking the
/// helpers costs what the copy does (one 48^2 array's edges, 364 KB: 0.43x threaded, 0.47x
/// alone).
pub(crate) const PARALLEL_MIN_BYTES: usize = 512 << 10;

/// Bytes per thread that make another thread worth starting.
const BYTES_PER_THREAD: usize = 128 << 10;

/// Most threads one job uses.
pub(crate) const MAX_THREADS: usize = 16;

/// Most dims of a transfer: the spec's, plus the atoms of a raw element.
const MAX_NEST_DIMS: usize = MAX_DIMS + 1;

/// Which way a job copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Arrays -> packed buffer (rotating, negating).
    Pack,
    /// Packed buffer -> arrays.
    Unpack,
}

/// What happens to each atom on its way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    /// Copied as is.
    Copy,
    /// The sign bit of an `f64` flipped.
    NegF64,
    /// The sign bit of an `f32` flipped.
    NegF32,
    /// An `i32` negated with wrap-around.
    NegI32,
}

/// One dim of a loop nest: extent and strides in atoms, source and destination side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Dim {
    n: usize,
    src: isize,
    dst: isize,
}

/// The innermost loops of a nest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Inner {
    /// Runs along `row` (the last dim), contiguous on both sides; the source runs backwards
    /// when its stride is -1. Units are atoms, in the transfer's (row-major) order.
    Rows { row: Dim },
    /// A transpose: `a` is contiguous on the destination (stride 1), `b` on the source
    /// (stride +-1, at least [`TILE`] long). Units are panels: `TILE` atoms of `b` (fewer in
    /// the last) by all of `a`, for each index of the outer dims.
    Tiles { a: Dim, b: Dim },
    /// Strided runs along `row` (the last dim). Units are atoms, in the transfer's order.
    Strided { row: Dim },
}

/// The loop nest of one transfer in one direction: outer dims walked by an odometer, and the
/// innermost loops.
#[derive(Clone, Debug)]
struct Nest {
    /// Byte offset of the view's first element in its array.
    array_offset: usize,
    /// Byte offset of the slot in the packed buffer.
    packed_offset: usize,
    /// Bytes per atom: 1, 2, 4 or 8.
    atom: usize,
    op: Op,
    /// The dims outside the innermost loops, outermost first (at most [`MAX_NEST_DIMS`]).
    outer: Vec<Dim>,
    inner: Inner,
    /// Units of work (see [`Inner`]) and bytes moved.
    units: usize,
    bytes: usize,
    /// Whether source lines are prefetched [`PREFETCH_AHEAD`] planes ahead: row nests whose
    /// rows are at least [`PREFETCH_MIN_ROW`] bytes (shorter rows measured slower with it).
    prefetch: bool,
}

impl Nest {
    fn new(t: &Transfer, direction: Direction) -> Nest {
        let dims: Vec<Dim> = t
            .extent
            .iter()
            .zip(t.array_strides.iter().zip(&t.packed_strides))
            .map(|(&n, (&array, &packed))| match direction {
                Direction::Pack => Dim { n, src: array, dst: packed },
                Direction::Unpack => Dim { n, src: packed, dst: array },
            })
            .collect();
        let op = match (direction, t.negate, t.kind) {
            (Direction::Pack, true, ElemKind::F64) => Op::NegF64,
            (Direction::Pack, true, ElemKind::F32) => Op::NegF32,
            (Direction::Pack, true, ElemKind::I32) => Op::NegI32,
            _ => Op::Copy,
        };
        let atoms = t.atoms();
        let last = dims.len().saturating_sub(1);
        let row = dims.get(last).copied().unwrap_or(Dim { n: 1, src: 1, dst: 1 });
        let a = dims.iter().position(|d| d.dst == 1);
        // Transposes narrower than a block stay strided gathers along the last dim (blocks
        // measured no faster there: 48 x 3 x-face turns run at 10 GB/s either way).
        let b = dims.iter().position(|d| d.src.abs() == 1 && d.n >= TILE);
        let (outer, inner, units) = match (a, b) {
            _ if row.dst == 1 && row.src.abs() == 1 => (dims[..last].to_vec(), Inner::Rows { row }, atoms),
            (Some(a), Some(b)) if a != b => {
                let outer: Vec<Dim> =
                    dims.iter().enumerate().filter(|&(i, _)| i != a && i != b).map(|(_, d)| *d).collect();
                let panels = outer.iter().map(|d| d.n).product::<usize>() * dims[b].n.div_ceil(TILE);
                (outer, Inner::Tiles { a: dims[a], b: dims[b] }, panels)
            }
            _ => (dims[..last].to_vec(), Inner::Strided { row }, atoms),
        };
        Nest {
            array_offset: t.array_offset * t.atom,
            packed_offset: t.packed_offset,
            atom: t.atom,
            op,
            outer,
            inner,
            units,
            bytes: t.bytes(),
            prefetch: matches!(inner, Inner::Rows { row } if row.n * t.atom >= PREFETCH_MIN_ROW),
        }
    }

    /// Bytes per unit of work, rounded up (for balancing threads).
    fn unit_bytes(&self) -> usize {
        self.bytes.div_ceil(self.units.max(1))
    }
}

/// The loop nests of a plan, both directions; built once per packer.
#[derive(Debug)]
pub(crate) struct HostSchedule {
    pack: Vec<Nest>,
    unpack: Vec<Nest>,
}

impl HostSchedule {
    pub(crate) fn new(plan: &Plan) -> HostSchedule {
        HostSchedule {
            pack: plan.pack.iter().map(|t| Nest::new(t, Direction::Pack)).collect(),
            unpack: plan.unpack.iter().map(|t| Nest::new(t, Direction::Unpack)).collect(),
        }
    }

    fn nests(&self, direction: Direction) -> &[Nest] {
        match direction {
            Direction::Pack => &self.pack,
            Direction::Unpack => &self.unpack,
        }
    }
}

/// A pack or unpack bound to memory, carried to a host stream's worker.
pub(crate) struct HostJob {
    pub(crate) schedule: Arc<HostSchedule>,
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
// SAFETY: shared only between the tasks of `run` (on helper threads that finish them before
// `run` returns), which write disjoint bytes (see the module rules) and only read the rest.
unsafe impl Sync for HostJob {}

/// A range of units of one nest.
#[derive(Clone, Copy, Debug)]
struct Part {
    nest: usize,
    start: usize,
    end: usize,
}

/// The threads a job moving `total` bytes uses under a budget of `max_threads`: one up to
/// [`PARALLEL_MIN_BYTES`], else one per [`BYTES_PER_THREAD`] up to the budget.
pub(crate) fn threads_for(total: usize, max_threads: usize) -> usize {
    if total > PARALLEL_MIN_BYTES {
        max_threads.min(total / BYTES_PER_THREAD).max(1)
    } else {
        1
    }
}

/// The default thread budget: the machine's parallelism, at most [`MAX_THREADS`].
pub(crate) fn thread_budget() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_THREADS))
}

impl HostJob {
    fn nests(&self) -> &[Nest] {
        self.schedule.nests(self.direction)
    }

    /// Runs every transfer, on several threads when the job is large.
    pub(crate) fn run(&self) {
        let nests = self.nests();
        let total: usize = nests.iter().map(|n| n.bytes).sum();
        let threads = threads_for(total, self.max_threads);
        if threads <= 1 {
            for (i, n) in nests.iter().enumerate() {
                self.run_part(Part { nest: i, start: 0, end: n.units });
            }
            return;
        }
        let tasks: Vec<Box<dyn FnOnce() + Send + '_>> = split(nests, total, threads)
            .into_iter()
            .map(|group| Box::new(move || group.into_iter().for_each(|p| self.run_part(p))) as Box<_>)
            .collect();
        threads::run_scoped(tasks);
    }

    fn run_part(&self, part: Part) {
        let nest = &self.nests()[part.nest];
        let array = self.arrays[part.nest].wrapping_add(nest.array_offset);
        let packed = self.packed.wrapping_add(nest.packed_offset);
        let (src, dst) = match self.direction {
            Direction::Pack => (array, packed),
            Direction::Unpack => (packed, array),
        };
        // SAFETY: the packer checked that every array holds its spec's extent and that the
        // packed buffer holds every slot, so each view element is inside its allocation; the
        // trackers keep both alive, the threads' parts are disjoint (module rules), and an
        // array is never the packed buffer (that one is the packer's own).
        unsafe { copy_part(nest, part.start, part.end, src, dst) };
    }
}

/// Splits the units of all nests into `threads` byte-balanced groups.
fn split(nests: &[Nest], total: usize, threads: usize) -> Vec<Vec<Part>> {
    let per_group = total.div_ceil(threads).max(1);
    let mut groups: Vec<Vec<Part>> = vec![Vec::new()];
    let mut room = per_group;
    for (i, nest) in nests.iter().enumerate() {
        let unit = nest.unit_bytes().max(1);
        let mut start = 0;
        while start < nest.units {
            let take = (room / unit).clamp(1, nest.units - start);
            if let Some(group) = groups.last_mut() {
                group.push(Part { nest: i, start, end: start + take });
            }
            start += take;
            room = room.saturating_sub(take * unit);
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

/// Copies units `start..end` of `nest` from the view at `src` to the view at `dst`.
///
/// # Safety
///
/// 1. Every element of the nest's views, `src` and `dst` being the addresses of their first
///    elements, is inside a live allocation, readable on the `src` side and writable on the
///    `dst` side; the two sides do not overlap.
/// 2. No other thread writes the bytes read, or touches the bytes written, during the call.
unsafe fn copy_part(nest: &Nest, start: usize, end: usize, src: *const u8, dst: *mut u8) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above); preconditions 1 and 2 are passed on.
        unsafe { copy_part_avx2(nest, start, end, src, dst) };
        return;
    }
    // SAFETY: preconditions 1 and 2 are passed on.
    unsafe { copy_part_any(nest, start, end, src, dst) };
}

/// [`copy_part_any`] compiled for AVX2.
///
/// # Safety
///
/// 1. As [`copy_part`].
/// 2. The CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_part_avx2(nest: &Nest, start: usize, end: usize, src: *const u8, dst: *mut u8) {
    // SAFETY: precondition 1.
    unsafe { copy_part_any(nest, start, end, src, dst) };
}

/// Picks the atom type and the map of `nest`, then walks it.
///
/// # Safety
///
/// As [`copy_part`].
#[inline(always)]
unsafe fn copy_part_any(nest: &Nest, start: usize, end: usize, src: *const u8, dst: *mut u8) {
    let w = Walk { nest, start, end };
    // SAFETY (every arm): preconditions 1 and 2, with the atom type matching `nest.atom`.
    unsafe {
        match (nest.atom, nest.op) {
            (8, Op::NegF64) => w.run::<u64, 8, _>(src, dst, |x| x ^ (1 << 63)),
            (8, _) => w.run::<u64, 8, _>(src, dst, |x| x),
            (4, Op::NegF32) => w.run::<u32, 16, _>(src, dst, |x| x ^ (1 << 31)),
            (4, Op::NegI32) => w.run::<u32, 16, _>(src, dst, u32::wrapping_neg),
            (4, _) => w.run::<u32, 16, _>(src, dst, |x| x),
            (2, _) => w.run::<u16, 32, _>(src, dst, |x| x),
            _ => w.run::<u8, 64, _>(src, dst, |x| x),
        }
    }
}

/// Units `start..end` of one nest.
struct Walk<'a> {
    nest: &'a Nest,
    start: usize,
    end: usize,
}

impl Walk<'_> {
    /// Walks the units with atoms of type `E` (`C` of them make a 64-byte block).
    ///
    /// # Safety
    ///
    /// As [`copy_part`], with `size_of::<E>()` the nest's atom.
    #[inline(always)]
    unsafe fn run<E: Copy, const C: usize, F: Fn(E) -> E + Copy>(&self, src: *const u8, dst: *mut u8, f: F) {
        let (src, dst) = (src.cast::<E>(), dst.cast::<E>());
        // SAFETY (every walk): the kernels touch the atoms of the nest's views at the offsets
        // its dims give (precondition 1), unraced (precondition 2).
        unsafe {
            match self.nest.inner {
                Inner::Rows { row } if row.src == -1 => {
                    self.rows(row, &Contiguous::<E, F, C, true> { src, dst, n: row.n, f })
                }
                Inner::Rows { row } => {
                    self.rows(row, &Contiguous::<E, F, C, false> { src, dst, n: row.n, f })
                }
                Inner::Strided { row } => self.rows(row, &Strided { src, dst, row, f }),
                Inner::Tiles { a, b } if b.src == -1 => {
                    self.panels(b, &Transpose::<E, F, true> { src, dst, a, b, f })
                }
                Inner::Tiles { a, b } => self.panels(b, &Transpose::<E, F, false> { src, dst, a, b, f }),
            }
        }
    }

    /// Walks atoms `start..end` of a row nest (rows along `row`, the last dim; the outer dims
    /// in row-major order): parts of rows cut by the unit range, and full rows along the
    /// innermost outer dim.
    ///
    /// # Safety
    ///
    /// The offsets handed to `copy` (the nest's) are valid for it.
    #[inline(always)]
    unsafe fn rows(&self, row: Dim, copy: &impl RowCopy) {
        let n = row.n;
        if n == 0 || self.start >= self.end {
            return;
        }
        let (planes, inner) = match self.nest.outer.split_last() {
            Some((inner, planes)) => (planes, *inner),
            None => (&[][..], Dim { n: 1, src: 0, dst: 0 }),
        };
        let first_row = self.start / n;
        let mut odometer = Odometer::new(planes, first_row / inner.n);
        // The plane PREFETCH_AHEAD planes on, whose source lines are requested early: planes
        // are short runs far apart (a y-face level is 3 rows of 384 bytes, the next one 23 KiB
        // away), so each one otherwise starts with a cache miss the CPU waits for.
        let plane_atoms = inner.n * n;
        let mut ahead = Odometer::new(planes, first_row / inner.n + PREFETCH_AHEAD);
        let mut r = first_row % inner.n;
        let mut col = self.start % n;
        let mut remaining = self.end - self.start;
        loop {
            let (sp, dp) = odometer.offsets();
            if self.nest.prefetch && remaining > PREFETCH_AHEAD * plane_atoms {
                copy.prefetch(ahead.offsets().0, (inner.n, inner.src));
            }
            while r < inner.n && remaining > 0 {
                let (s, d) = (sp + r as isize * inner.src, dp + r as isize * inner.dst);
                if col > 0 || remaining < n {
                    let len = (n - col).min(remaining);
                    // SAFETY: atoms col..col + len of row r (the caller's precondition).
                    unsafe { copy.part(s + col as isize * row.src, d + col as isize * row.dst, len) };
                    remaining -= len;
                    col = 0;
                    r += 1;
                } else {
                    let m = (inner.n - r).min(remaining / n);
                    // SAFETY: rows r..r + m of this plane (the caller's precondition).
                    unsafe { copy.rows(s, d, (m, inner.src, inner.dst)) };
                    remaining -= m * n;
                    r += m;
                }
            }
            if remaining == 0 {
                return;
            }
            r = 0;
            odometer.advance();
            ahead.advance();
        }
    }

    /// Walks panels `start..end` of a transpose nest: for each index of the outer dims, the
    /// `TILE`-wide panels along `b` (the last one narrower when `TILE` does not divide it).
    ///
    /// # Safety
    ///
    /// The offsets handed to `copy` (the nest's) are valid for it.
    #[inline(always)]
    unsafe fn panels(&self, b: Dim, copy: &impl PanelCopy) {
        let per = b.n.div_ceil(TILE);
        let full = b.n / TILE;
        if per == 0 || self.start >= self.end {
            return;
        }
        let mut odometer = Odometer::new(&self.nest.outer, self.start / per);
        let mut c = self.start % per;
        let mut remaining = self.end - self.start;
        loop {
            let (sp, dp) = odometer.offsets();
            let last = (c + remaining).min(per);
            let at = |c: usize| (sp + (c * TILE) as isize * b.src, dp + (c * TILE) as isize * b.dst);
            if c < full {
                let (s, d) = at(c);
                // SAFETY: full panels c..min(last, full) of this outer index (the caller's
                // precondition).
                unsafe { copy.panels(s, d, last.min(full) - c) };
            }
            if last > full {
                let (s, d) = at(full);
                // SAFETY: the narrow last panel of this outer index (the caller's precondition).
                unsafe { copy.narrow(s, d, b.n - full * TILE) };
            }
            remaining -= last - c;
            if remaining == 0 {
                return;
            }
            c = 0;
            odometer.advance();
        }
    }
}

/// The copy of the runs of a row nest; offsets are in atoms from the views' first elements.
trait RowCopy {
    /// Copies `n` atoms of one row, starting at the given offsets.
    ///
    /// # Safety
    ///
    /// 1. The atoms are elements of the views (the offsets come from the nest's dims).
    unsafe fn part(&self, s: isize, d: isize, n: usize);

    /// Copies full rows: count, source step and destination step in atoms.
    ///
    /// # Safety
    ///
    /// As [`RowCopy::part`].
    unsafe fn rows(&self, s: isize, d: isize, steps: (usize, isize, isize));

    /// Asks for the source lines of full rows (count, step in atoms) starting at offset `s`
    /// to be brought into the cache (a hint: nothing is read, no address is checked).
    fn prefetch(&self, s: isize, rows: (usize, isize));
}

/// Planes of a row nest (runs of rows along the innermost outer dim) that source lines are
/// prefetched ahead of the copy.
const PREFETCH_AHEAD: usize = 2;

/// Most cache lines prefetched per plane; the hardware streams longer runs by itself.
const PREFETCH_LINES: usize = 64;

/// Shortest rows (bytes) whose planes are prefetched.
const PREFETCH_MIN_ROW: usize = 128;

/// Asks for the cache line holding byte `p`. A hint: it never faults and reads nothing.
#[inline(always)]
fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch has no preconditions: it never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Rows contiguous on both sides (read backwards with `REV`).
struct Contiguous<E, F, const C: usize, const REV: bool> {
    src: *const E,
    dst: *mut E,
    /// Atoms per row.
    n: usize,
    f: F,
}

impl<E: Copy, F: Fn(E) -> E + Copy, const C: usize, const REV: bool> RowCopy for Contiguous<E, F, C, REV> {
    #[inline(always)]
    unsafe fn part(&self, s: isize, d: isize, n: usize) {
        // SAFETY: precondition 1.
        unsafe {
            kernels::run::<E, C, REV>(self.src.wrapping_offset(s), self.dst.wrapping_offset(d), n, self.f)
        }
    }

    #[inline(always)]
    unsafe fn rows(&self, s: isize, d: isize, steps: (usize, isize, isize)) {
        let (src, dst) = (self.src.wrapping_offset(s), self.dst.wrapping_offset(d));
        // SAFETY: precondition 1.
        unsafe { kernels::rows::<E, C, REV>(src, dst, self.n, steps, self.f) }
    }

    #[inline(always)]
    fn prefetch(&self, s: isize, (rows, step): (usize, isize)) {
        // Every other line: the CPU fetches lines in aligned pairs.
        let bytes = self.n * std::mem::size_of::<E>();
        let pairs = bytes.div_ceil(128) + 1;
        let rows = rows.min(PREFETCH_LINES / (2 * pairs)).max(1);
        for r in 0..rows as isize {
            // The lowest byte of the row (it runs down from its first atom when reversed).
            let first = self.src.wrapping_offset(s + r * step).cast::<u8>();
            let low = if REV { first.wrapping_sub(bytes - std::mem::size_of::<E>()) } else { first };
            for pair in 0..pairs {
                prefetch_line(low.wrapping_add((pair * 128).min(bytes - 1)));
            }
        }
    }
}

/// Rows with any strides.
struct Strided<E, F> {
    src: *const E,
    dst: *mut E,
    row: Dim,
    f: F,
}

impl<E: Copy, F: Fn(E) -> E + Copy> RowCopy for Strided<E, F> {
    #[inline(always)]
    unsafe fn part(&self, s: isize, d: isize, n: usize) {
        let (src, dst) = (self.src.wrapping_offset(s), self.dst.wrapping_offset(d));
        // SAFETY: precondition 1.
        unsafe { kernels::strided(src, dst, n, (self.row.src, self.row.dst), self.f) }
    }

    #[inline(always)]
    unsafe fn rows(&self, s: isize, d: isize, (rows, s_step, d_step): (usize, isize, isize)) {
        for r in 0..rows as isize {
            // SAFETY: precondition 1, row by row.
            unsafe { self.part(s + r * s_step, d + r * d_step, self.row.n) };
        }
    }

    #[inline(always)]
    fn prefetch(&self, _: isize, _: (usize, isize)) {}
}

/// The copy of the panels of a transpose nest; offsets are in atoms from the views' first
/// elements.
trait PanelCopy {
    /// Copies `count` full panels, the first at the given offsets.
    ///
    /// # Safety
    ///
    /// 1. The atoms are elements of the views (the offsets come from the nest's dims).
    unsafe fn panels(&self, s: isize, d: isize, count: usize);

    /// Copies one panel `width < TILE` atoms wide.
    ///
    /// # Safety
    ///
    /// As [`PanelCopy::panels`].
    unsafe fn narrow(&self, s: isize, d: isize, width: usize);
}

/// A transpose: `a` contiguous on the destination, `b` on the source (backwards with `REV`).
struct Transpose<E, F, const REV: bool> {
    src: *const E,
    dst: *mut E,
    a: Dim,
    b: Dim,
    f: F,
}

impl<E: Copy, F: Fn(E) -> E + Copy, const REV: bool> PanelCopy for Transpose<E, F, REV> {
    #[inline(always)]
    unsafe fn panels(&self, s: isize, d: isize, count: usize) {
        let (src, dst) = (self.src.wrapping_offset(s), self.dst.wrapping_offset(d));
        // SAFETY: precondition 1.
        unsafe { kernels::panels::<E, REV>(src, dst, (self.a.n, count), (self.a.src, self.b.dst), self.f) }
    }

    #[inline(always)]
    unsafe fn narrow(&self, s: isize, d: isize, width: usize) {
        let (src, dst) = (self.src.wrapping_offset(s), self.dst.wrapping_offset(d));
        let (a, b) = (self.a, self.b);
        for i in 0..width as isize {
            let (s, d) = (src.wrapping_offset(i * b.src), dst.wrapping_offset(i * b.dst));
            // SAFETY: precondition 1: strided gathers along `a`, as in narrow nests.
            unsafe { kernels::strided(s, d, a.n, (a.src, a.dst), self.f) };
        }
    }
}

/// A multi-index over some dims (row-major), with its source and destination offsets.
#[derive(Clone)]
struct Odometer<'a> {
    dims: &'a [Dim],
    index: [usize; MAX_NEST_DIMS],
    src: isize,
    dst: isize,
}

impl<'a> Odometer<'a> {
    /// At the `linear`-th index.
    fn new(dims: &'a [Dim], mut linear: usize) -> Self {
        let mut o = Odometer { dims, index: [0; MAX_NEST_DIMS], src: 0, dst: 0 };
        for (i, d) in dims.iter().enumerate().rev() {
            let k = linear % d.n.max(1);
            linear /= d.n.max(1);
            o.index[i] = k;
            o.src += k as isize * d.src;
            o.dst += k as isize * d.dst;
        }
        o
    }

    fn offsets(&self) -> (isize, isize) {
        (self.src, self.dst)
    }

    /// The next index (row-major).
    fn advance(&mut self) {
        for (i, d) in self.dims.iter().enumerate().rev() {
            self.index[i] += 1;
            self.src += d.src;
            self.dst += d.dst;
            if self.index[i] < d.n {
                return;
            }
            self.src -= d.n as isize * d.src;
            self.dst -= d.n as isize * d.dst;
            self.index[i] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::halo::reference::{random_layout, reference, Layout, Rng};
    use crate::halo::spec::{ElementType, HaloExchange, HaloSpec, HorizontalDims};

    fn nest(
        shape: &[usize],
        pack: &[std::ops::Range<usize>],
        k: u32,
        unpack: &[std::ops::Range<usize>],
    ) -> Nest {
        let spec = HaloSpec::contiguous(ElementType::F64, shape, HorizontalDims::xy(2, 1)).unwrap();
        let ex = HaloExchange::new(&spec, pack, k, unpack).unwrap();
        let plan = Plan::new(&[ex], None).unwrap();
        Nest::new(&plan.pack[0], Direction::Pack)
    }

    #[test]
    fn faces_get_row_and_tile_nests() {
        // y-face, unturned: rows of 48.
        let y = nest(&[79, 54, 54], &[0..79, 3..6, 3..51], 0, &[0..79, 51..54, 3..51]);
        assert!(matches!(y.inner, Inner::Rows { row } if row.n == 48 && row.src == 1));
        // y-face turned once: 3 x 48 transposes, the source running backwards along b.
        let t = nest(&[79, 54, 54], &[0..79, 3..6, 3..51], 1, &[0..79, 3..51, 0..3]);
        assert!(matches!(t.inner, Inner::Tiles { a, b } if a.n == 3 && b.n == 48 && b.src == -1));
        assert_eq!(t.units, 79 * 6);
        // Half turn: rows read backwards.
        let h = nest(&[79, 54, 54], &[0..79, 3..6, 3..51], 2, &[0..79, 51..54, 3..51]);
        assert!(matches!(h.inner, Inner::Rows { row } if row.src == -1));
        // x-face turned: the b side is 3 wide, so strided gathers along y.
        let x = nest(&[79, 54, 54], &[0..79, 3..51, 3..6], 1, &[0..79, 0..3, 3..51]);
        assert!(matches!(x.inner, Inner::Strided { row } if row.n == 48 && row.src == 54));
    }

    /// Random layouts large enough for every nest kind (tiles need 8 contiguous source atoms),
    /// every rotation, scalar and vector, each element type, both directions, whole and cut
    /// into random parts: each equals the reference byte for byte.
    #[test]
    fn every_nest_kind_matches_the_reference() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut kinds = [0usize; 3];
        for case in 0..1000 {
            let Layout { spec, ex, vector } = random_layout(&mut rng, case, 3);
            let element = spec.element();
            let k = ex.rotation();
            let ys = [ex.clone()];
            let plan = Plan::new(std::slice::from_ref(&ex), vector.then_some(&ys[..])).unwrap();
            let schedule = HostSchedule::new(&plan);
            let array_bytes = spec.required_bytes();
            for direction in [Direction::Pack, Direction::Unpack] {
                let transfers = match direction {
                    Direction::Pack => &plan.pack,
                    Direction::Unpack => &plan.unpack,
                };
                for (t, nest) in transfers.iter().zip(schedule.nests(direction)) {
                    kinds[match nest.inner {
                        Inner::Rows { .. } => 0,
                        Inner::Tiles { .. } => 1,
                        Inner::Strided { .. } => 2,
                    }] += 1;
                    let (src_len, dst_len) = match direction {
                        Direction::Pack => (array_bytes, plan.bytes),
                        Direction::Unpack => (plan.bytes, array_bytes),
                    };
                    let src: Vec<u8> = (0..src_len).map(|_| rng.next() as u8).collect();
                    let init: Vec<u8> = (0..dst_len).map(|_| rng.next() as u8).collect();
                    let mut want = init.clone();
                    reference(t, direction, &src, &mut want);
                    let (src_first, dst_first) = match direction {
                        Direction::Pack => (nest.array_offset, nest.packed_offset),
                        Direction::Unpack => (nest.packed_offset, nest.array_offset),
                    };
                    // Whole, then in up to 5 random parts.
                    let mut cuts = vec![0, nest.units];
                    for _ in 0..rng.below(5) {
                        cuts.push(rng.below(nest.units + 1));
                    }
                    cuts.sort_unstable();
                    // Both compilations: AVX2 where the CPU has it, and the baseline one.
                    for (pieces, avx2) in
                        [(vec![0, nest.units], true), (vec![0, nest.units], false), (cuts, true)]
                    {
                        let mut got = init.clone();
                        for w in pieces.windows(2) {
                            let (s, d) = (
                                src.as_ptr().wrapping_add(src_first),
                                got.as_mut_ptr().wrapping_add(dst_first),
                            );
                            // SAFETY: both buffers hold the views (the reference indexes them
                            // with bounds checks), and they are distinct allocations.
                            unsafe {
                                if avx2 {
                                    copy_part(nest, w[0], w[1], s, d)
                                } else {
                                    copy_part_any(nest, w[0], w[1], s, d)
                                }
                            };
                        }
                        assert!(
                            got == want,
                            "case {case}: {element:?} k={k} {direction:?} {:?} avx2={avx2}",
                            nest.inner
                        );
                    }
                }
            }
        }
        println!("nests by kind (rows, tiles, strided): {kinds:?}");
        assert!(kinds.iter().all(|&n| n > 20), "every nest kind is exercised: {kinds:?}");
    }

    #[test]
    fn parts_cover_every_unit_once() {
        let t = nest(&[79, 54, 54], &[0..79, 3..6, 3..51], 1, &[0..79, 3..51, 0..3]);
        let r = nest(&[79, 54, 54], &[0..79, 3..6, 3..51], 0, &[0..79, 51..54, 3..51]);
        let nests = vec![t, r];
        let total = nests.iter().map(|n| n.bytes).sum();
        let groups = split(&nests, total, 3);
        assert_eq!(groups.len(), 3);
        for (i, n) in nests.iter().enumerate() {
            let mut parts: Vec<Part> = groups.iter().flatten().filter(|p| p.nest == i).copied().collect();
            parts.sort_by_key(|p| p.start);
            assert_eq!(parts.first().map(|p| p.start), Some(0));
            assert!(parts.windows(2).all(|w| w[0].end == w[1].start));
            assert_eq!(parts.last().map(|p| p.end), Some(n.units));
        }
    }
}
