//! The CUDA implementation: a plan's transfers as a descriptor table in device memory, run by
//! one kernel launch (csrc/halo.cu).
//!
//! Rules:
//! - The table holds absolute array addresses, so it is built (and, read from device memory,
//!   uploaded) when a packer first runs and again only when the arrays' addresses change (a
//!   time step passing the same arrays uploads nothing). Two tables stay in device memory, so
//!   alternating between two sets of arrays (double buffering) uploads nothing either once
//!   both are there. An upload is queued from pinned staging as a tracked copy, ordered after
//!   launches still reading the table it replaces; the host does not wait for those launches.
//! - [`DescriptorPlacement`] says where the kernel reads the table: device memory (the
//!   default) or, up to [`MAX_INLINE_DESCRIPTORS`], the launch's parameters (copied by each
//!   launch, with each block's first descriptor computed on the host: no upload, and a block
//!   reads its descriptor from the parameter bank at addresses uniform in the block, which
//!   the constant cache serves at once).
//! - Access units: rows contiguous on both sides move in units of up to 16 bytes when the row
//!   length, every outer stride and both start addresses allow it; everything else element by
//!   element (atoms of 1 to 8 bytes).
//! - Limits checked here when the packer is built: extents and units per transfer fit the
//!   kernel's 31-bit indices. Each descriptor carries the multiply-shift constants of its
//!   extents ([`divisor`]), so the kernel divides without a division instruction.

use std::os::raw::c_void;

use super::plan::Transfer;
use super::spec::ElemKind;
use crate::copy::copy_range;
use crate::cuda::halo::{self as raw, HaloDirection};
use crate::error::{Error, Result};
use crate::memory::sealed::Sealed;
use crate::memory::{DeviceBuffer, PinnedBuffer};
use crate::stream::Stream;
use crate::sys;

/// Bytes of one descriptor; every field is an integer and the sum of their sizes equals the
/// struct's size, so the struct has no padding bytes.
const DESC_BYTES: usize = std::mem::size_of::<sys::cuferry_halo_desc>();
const _: () = assert!(
    DESC_BYTES
        == 4 * 8
            + 2 * 8 * sys::CUFERRY_HALO_MAX_DIMS as usize
            + 4 * sys::CUFERRY_HALO_MAX_DIMS as usize
            + 6 * 4
            + 2 * 4 * sys::CUFERRY_HALO_MAX_DIMS as usize
);

/// Widest access unit in bytes.
const MAX_UNIT_BYTES: usize = 16;

/// Where the CUDA kernel of a [`HaloPacker`](super::HaloPacker) reads its descriptors (one
/// per array region: address, region, strides, rotation, sign) from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DescriptorPlacement {
    /// A table in device memory, uploaded at the first call and again only when the arrays'
    /// addresses change; every block loads its descriptors from it before its first data load.
    #[default]
    DeviceMemory,
    /// The launch's parameters (at most [`MAX_INLINE_DESCRIPTORS`] descriptors per direction;
    /// CUDA 12.1 or later on Volta or later): nothing is uploaded, and the kernel reads them
    /// from the parameter bank, which the launch fills, along with each block's first
    /// descriptor (for grids of up to 768 blocks; larger ones search as with device memory).
    LaunchParameters,
}

/// Most descriptors (array regions) per direction that
/// [`DescriptorPlacement::LaunchParameters`] takes.
pub const MAX_INLINE_DESCRIPTORS: usize = raw::INLINE_MAX_DESC;

/// The descriptors built for one set of addresses.
#[derive(Debug)]
struct Built {
    /// The array addresses and packed address they were built for.
    key: TableKey,
    table: Vec<sys::cuferry_halo_desc>,
    total_units: u64,
}

/// The array addresses (one per transfer) and the packed buffer's address of a table.
type TableKey = (Vec<usize>, usize);

/// One table in device memory, with the pinned staging its upload is copied from.
#[derive(Debug)]
struct TableCopy {
    buf: DeviceBuffer<u8>,
    /// Allocated at the first upload into this copy.
    staging: Option<PinnedBuffer<u8>>,
    /// The addresses of the table in `buf` (None: nothing valid uploaded).
    key: Option<TableKey>,
}

/// How many tables in device memory a [`DeviceTable`] keeps: two, so a caller alternating
/// between two sets of arrays (double buffering) uploads nothing once both are there.
const TABLE_COPIES: usize = 2;

/// A packer's descriptor table for one direction: built on the host for the addresses of the
/// last call, and copied to device memory when the kernel reads it from there.
#[derive(Debug)]
pub(crate) struct DeviceTable {
    /// At most [`TABLE_COPIES`]; the first is allocated with the table.
    copies: Vec<TableCopy>,
    /// The copy bound last (the one the next launch reads).
    current: usize,
    n_desc: usize,
    built: Option<Built>,
}

impl DeviceTable {
    /// Room for the descriptors of `transfers` on `stream`'s device (nothing uploaded yet).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when a transfer exceeds the kernel's 31-bit limits (checked
    /// here, at the packer's construction, for the narrowest access unit: any wider one
    /// divides the counts); allocation errors.
    pub(crate) fn new(stream: &Stream, transfers: &[Transfer]) -> Result<Self> {
        for t in transfers {
            check_limits(t)?;
        }
        let n_desc = transfers.len();
        Ok(DeviceTable { copies: vec![Self::copy(stream, n_desc)?], current: 0, n_desc, built: None })
    }

    fn copy(stream: &Stream, n_desc: usize) -> Result<TableCopy> {
        let bytes =
            n_desc.checked_mul(DESC_BYTES).ok_or_else(|| Error::invalid("too many halo descriptors"))?;
        Ok(TableCopy { buf: DeviceBuffer::zeroed(stream, bytes)?, staging: None, key: None })
    }

    /// Makes the table describe `arrays` (one base address per transfer) and `packed`: builds
    /// it when they changed and, for [`DescriptorPlacement::DeviceMemory`], selects the device
    /// copy holding it, or uploads it into the copy used least recently. The upload is queued
    /// (from pinned staging, a tracked copy ordered after launches still reading that copy);
    /// the host waits only for that copy's previous upload to finish before rewriting its
    /// staging.
    pub(crate) fn bind(
        &mut self,
        stream: &Stream,
        transfers: &[Transfer],
        arrays: &[*mut u8],
        packed: *mut u8,
        placement: DescriptorPlacement,
    ) -> Result<()> {
        let key: TableKey = (arrays.iter().map(|p| *p as usize).collect(), packed as usize);
        if self.built.as_ref().map(|b| &b.key) != Some(&key) {
            self.built = None;
            let (table, total_units) = build(transfers, arrays, packed)?;
            if table.len() != self.n_desc {
                return Err(Error::invalid("the halo descriptor table changed size"));
            }
            self.built = Some(Built { key: key.clone(), table, total_units });
        }
        if placement != DescriptorPlacement::DeviceMemory {
            return Ok(());
        }
        if let Some(i) = self.copies.iter().position(|c| c.key.as_ref() == Some(&key)) {
            self.current = i;
            return Ok(());
        }
        let Some(built) = &self.built else {
            return Err(Error::invalid("internal: no halo table built"));
        };
        // An empty copy, else a new one (the second is allocated the first time it is
        // needed), else the copy not bound last.
        let target = if let Some(empty) = self.copies.iter().position(|c| c.key.is_none()) {
            empty
        } else if self.copies.len() < TABLE_COPIES {
            self.copies.push(Self::copy(stream, self.n_desc)?);
            self.copies.len() - 1
        } else {
            (self.current + 1) % TABLE_COPIES
        };
        let copy = &mut self.copies[target];
        copy.key = None;
        // SAFETY: `cuferry_halo_desc` is repr(C) with integer fields only and no padding
        // (the const assertion above), so every byte of the vector is initialised.
        let bytes = unsafe {
            std::slice::from_raw_parts(built.table.as_ptr().cast::<u8>(), built.table.len() * DESC_BYTES)
        };
        let staging = match &mut copy.staging {
            Some(staging) => staging,
            None => copy.staging.insert(PinnedBuffer::zeroed(stream.device(), bytes.len())?),
        };
        // Waits for this staging's previous upload only.
        staging.as_mut_slice()?.copy_from_slice(bytes);
        copy_range(stream, &*staging, 0, &mut copy.buf, 0, bytes.len())?;
        copy.key = Some(key);
        self.current = target;
        Ok(())
    }

    /// The device buffer of the table bound last (its tracker must record every launch that
    /// reads it).
    pub(crate) fn buffer(&self) -> &DeviceBuffer<u8> {
        &self.copies[self.current].buf
    }

    /// Queues the one launch over the bound table, read from where `placement` says.
    ///
    /// # Safety
    ///
    /// 1. [`DeviceTable::bind`] was last called with the arrays, packed buffer and placement
    ///    used now, and they, with the table, **stay alive and unraced until the stream has
    ///    run the kernel** (the caller records the launch on all their trackers).
    pub(crate) unsafe fn launch(
        &self,
        stream: &Stream,
        ordinal: u32,
        packed: *mut u8,
        direction: HaloDirection,
        placement: DescriptorPlacement,
    ) -> Result<()> {
        let Some(built) = &self.built else { return Err(Error::invalid("internal: no halo table bound")) };
        if built.total_units == 0 {
            return Ok(());
        }
        let raw_stream = stream.cuda_raw()?;
        match placement {
            DescriptorPlacement::DeviceMemory => {
                let table = self.buffer().raw_parts().ptr.cast::<sys::cuferry_halo_desc>().cast_const();
                // SAFETY: the uploaded table was built for these addresses (precondition 1) by
                // `build`, which checked every limit; the caller keeps everything alive through
                // the trackers.
                unsafe {
                    raw::launch(
                        ordinal,
                        table,
                        self.n_desc,
                        built.total_units,
                        packed.cast::<c_void>(),
                        direction,
                        raw_stream,
                    )
                }
            }
            // SAFETY: as above; the host table is copied into the launch's parameters.
            DescriptorPlacement::LaunchParameters => unsafe {
                raw::launch_inline(
                    ordinal,
                    &built.table,
                    built.total_units,
                    packed.cast::<c_void>(),
                    direction,
                    raw_stream,
                )
            },
        }
    }
}

pub(crate) fn kind_code(kind: ElemKind) -> i32 {
    match kind {
        ElemKind::Bits => sys::CUFERRY_HALO_KIND_BITS,
        ElemKind::F32 => sys::CUFERRY_HALO_KIND_F32,
        ElemKind::F64 => sys::CUFERRY_HALO_KIND_F64,
        ElemKind::I32 => sys::CUFERRY_HALO_KIND_I32,
    }
}

/// Elements per access unit for a transfer starting at these addresses.
fn unit_elems(t: &Transfer, array_first: usize, packed_first: usize) -> usize {
    let nd = t.extent.len();
    if t.array_strides[nd - 1] != 1 || t.packed_strides[nd - 1] != 1 {
        return 1;
    }
    let mut w = MAX_UNIT_BYTES / t.atom;
    while w > 1 {
        let bytes = w * t.atom;
        let outer_ok = (0..nd - 1)
            .all(|d| t.array_strides[d] % w as isize == 0 && t.packed_strides[d] % w as isize == 0);
        if t.extent[nd - 1] % w == 0 && outer_ok && array_first % bytes == 0 && packed_first % bytes == 0 {
            break;
        }
        w /= 2;
    }
    w
}

/// The kernel's multiply-shift division by `e` (the header's `div_mul`, `div_shr`): for every
/// `n < 2^31`, `n / e == if mul == 0 { n } else { (n * mul) >> 32 >> shr }`.
fn divisor(e: u32) -> (u32, u32) {
    if e <= 1 {
        return (0, 0);
    }
    let l = 32 - (e - 1).leading_zeros(); // ceil(log2 e), 1..=32
    let p = 31 + l;
    // ceil(2^p / e) < 2^32 because e > 2^(l - 1).
    let mul = (1u64 << p).div_ceil(u64::from(e));
    (mul as u32, l - 1)
}

/// Whether the packed side of a transfer is row-major and contiguous (the kernel computes
/// packed addresses from the unit number alone).
fn packed_row_major(t: &Transfer) -> bool {
    let mut expect = 1isize;
    for d in (0..t.extent.len()).rev() {
        if t.packed_strides[d] != expect {
            return false;
        }
        expect *= t.extent[d] as isize;
    }
    true
}

/// The kernel's 31-bit limits for a transfer moved atom by atom, the most units it can take:
/// the unit count, a row's units and every extent fit an `i32`.
fn check_limits(t: &Transfer) -> Result<()> {
    let nd = t.extent.len();
    i32::try_from(t.atoms()).map_err(|_| too_large("units"))?;
    if let Some(&row) = t.extent.get(nd.wrapping_sub(1)) {
        i32::try_from(row).map_err(|_| too_large("a row"))?;
    }
    for &e in &t.extent {
        i32::try_from(e).map_err(|_| too_large("an extent"))?;
    }
    Ok(())
}

fn too_large(what: &str) -> Error {
    Error::invalid(format!("a halo region is too large for the CUDA kernel ({what} above 2^31 - 1)"))
}

/// The descriptor table of `transfers` over these addresses, and its total units.
fn build(
    transfers: &[Transfer],
    arrays: &[*mut u8],
    packed: *mut u8,
) -> Result<(Vec<sys::cuferry_halo_desc>, u64)> {
    let max_dims = sys::CUFERRY_HALO_MAX_DIMS as usize;
    let mut table = Vec::with_capacity(transfers.len());
    let mut next_unit = 0u64;
    for (t, &base) in transfers.iter().zip(arrays) {
        let nd = t.extent.len();
        if nd > max_dims {
            return Err(Error::invalid(format!(
                "a halo transfer has {nd} dims, the kernel at most {max_dims}"
            )));
        }
        if !packed_row_major(t) {
            return Err(Error::invalid("internal: a halo slot is not row-major (the kernel needs it)"));
        }
        let array_first = base as usize + t.array_offset * t.atom;
        let packed_first = packed as usize + t.packed_offset;
        // The kernel moves whole pieces of `atom` bytes (typed loads, `cp.async`), which a
        // misaligned address would fault on. Whole allocations are always aligned; a view at
        // an odd offset is not.
        if array_first % t.atom != 0 || packed_first % t.atom != 0 {
            return Err(Error::invalid(format!(
                "a halo array or buffer address is not aligned to its {}-byte element pieces",
                t.atom
            )));
        }
        let w = unit_elems(t, array_first, packed_first);
        let units = t.atoms() / w;
        let units_i32 = i32::try_from(units).map_err(|_| too_large("units"))?;
        let row_units = i32::try_from(t.extent[nd - 1] / w).map_err(|_| too_large("a row"))?;
        let mut desc = sys::cuferry_halo_desc {
            array: array_first as u64,
            packed_offset: t.packed_offset as i64,
            unit_first: next_unit as i64,
            units: i64::from(units_i32),
            array_stride: [0; sys::CUFERRY_HALO_MAX_DIMS as usize],
            packed_stride: [0; sys::CUFERRY_HALO_MAX_DIMS as usize],
            extent: [1; sys::CUFERRY_HALO_MAX_DIMS as usize],
            ndim: nd as i32,
            elem_size: t.atom as i32,
            elem_kind: kind_code(t.kind),
            negate: i32::from(t.negate),
            unit_elems: w as i32,
            row_units,
            div_mul: [0; sys::CUFERRY_HALO_MAX_DIMS as usize],
            div_shr: [0; sys::CUFERRY_HALO_MAX_DIMS as usize],
        };
        for d in 0..nd {
            desc.array_stride[d] = t.array_strides[d] as i64;
            desc.packed_stride[d] = t.packed_strides[d] as i64;
            desc.extent[d] = i32::try_from(t.extent[d]).map_err(|_| too_large("an extent"))?;
            let units_along = if d == nd - 1 { row_units } else { desc.extent[d] };
            (desc.div_mul[d], desc.div_shr[d]) = divisor(units_along as u32);
        }
        next_unit += units as u64;
        table.push(desc);
    }
    Ok((table, next_unit))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::halo::cpu::Direction;
    use crate::halo::plan::{Component, Plan};
    use crate::halo::reference::{random_layout, reference, Rng};
    use crate::halo::spec::{ElementType, HaloExchange, HaloSpec, HorizontalDims};

    #[test]
    fn multiply_shift_division_matches_division() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut divisors: Vec<u32> = (1..=4096).collect();
        for b in 1..31 {
            let p = 1u32 << b;
            divisors.extend([p - 1, p, p + 1]);
        }
        divisors.push(i32::MAX as u32);
        divisors.extend((0..2000).map(|_| 1 + (rng.next() % i32::MAX as u64) as u32));
        let top = i32::MAX as u32;
        for &e in &divisors {
            let (mul, shr) = divisor(e);
            let div =
                |n: u32| if mul == 0 { n } else { ((u64::from(n) * u64::from(mul)) >> 32) as u32 >> shr };
            let q_max = top / e;
            let mut ns = vec![0, 1, e - 1, e, e.saturating_add(1).min(top), top, top - 1];
            for q in [1, 2, 3, q_max / 2, q_max.saturating_sub(1), q_max] {
                let m = q.saturating_mul(e);
                ns.extend([m.saturating_sub(1), m, m.saturating_add(1)]);
            }
            ns.extend((0..16).map(|_| (rng.next() % (u64::from(top) + 1)) as u32));
            for n in ns.into_iter().filter(|&n| n <= top) {
                assert_eq!(div(n), n / e, "{n} / {e} (mul {mul}, shr {shr})");
            }
        }
    }

    /// Host memory aligned to 16 bytes, viewed from a byte shift.
    struct Block {
        words: Vec<u128>,
        shift: usize,
        len: usize,
    }

    impl Block {
        fn random(rng: &mut Rng, len: usize, shift: usize) -> Block {
            let mut b = Block { words: vec![0; (len + shift).div_ceil(16) + 1], shift, len };
            b.bytes_mut().iter_mut().for_each(|x| *x = rng.next() as u8);
            b
        }

        fn bytes(&self) -> &[u8] {
            // SAFETY: the words hold at least shift + len bytes, all initialised.
            let all = unsafe {
                std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.words.len() * 16)
            };
            &all[self.shift..self.shift + self.len]
        }

        fn bytes_mut(&mut self) -> &mut [u8] {
            // SAFETY: as in `bytes`, borrowed mutably.
            let all = unsafe {
                std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.words.len() * 16)
            };
            &mut all[self.shift..self.shift + self.len]
        }

        fn ptr(&mut self) -> *mut u8 {
            self.bytes_mut().as_mut_ptr()
        }
    }

    /// What the emulated runs of one exchange set exercised.
    #[derive(Default)]
    struct Seen {
        descs: usize,
        many_dims: usize,
        wide: usize,
        wide_negated: usize,
        most_units: i64,
        /// The most distinct staged unit sizes (4, 8 or 16 bytes) in one table.
        most_staged_sizes: usize,
    }

    /// Packs and unpacks the exchange set `xs` (with `xs` as the y exchanges too when
    /// `vector`) by the kernel's program on the CPU, for 1, 2, 4 and 8 loads in flight and
    /// several grid sizes, arrays and
    /// packed buffer at random atom-multiple shifts from a 16-byte boundary: every byte must
    /// equal the scalar reference, untouched bytes included.
    fn check_against_reference(
        rng: &mut Rng,
        xs: &[HaloExchange],
        vector: bool,
        what: &str,
        seen: &mut Seen,
    ) {
        let ys = xs.to_vec();
        let plan = Plan::new(xs, vector.then_some(&ys[..])).unwrap();
        let atom = plan.pack.first().map_or(1, |t| t.atom);
        let shift = |rng: &mut Rng| atom * rng.below(16 / atom);
        // One array per (quantity, component).
        let key = |c: Component, q: usize| q * 2 + usize::from(c == Component::Y);
        for direction in [Direction::Pack, Direction::Unpack] {
            let transfers = match direction {
                Direction::Pack => &plan.pack,
                Direction::Unpack => &plan.unpack,
            };
            if transfers.is_empty() {
                continue;
            }
            let mut arrays = Vec::new();
            for i in 0..xs.len() * 2 {
                let s = shift(rng);
                arrays.push(Block::random(rng, xs[i / 2].spec().required_bytes(), s));
            }
            let s = shift(rng);
            let mut packed = Block::random(rng, plan.bytes, s);
            let (arrays0, packed0): (Vec<Vec<u8>>, Vec<u8>) =
                (arrays.iter().map(|a| a.bytes().to_vec()).collect(), packed.bytes().to_vec());
            let (mut want_arrays, mut want_packed) = (arrays0.clone(), packed0.clone());
            for t in transfers {
                let a = key(t.array.component, t.array.quantity);
                match direction {
                    Direction::Pack => reference(t, direction, &arrays0[a], &mut want_packed),
                    Direction::Unpack => reference(t, direction, &packed0, &mut want_arrays[a]),
                }
            }
            let bases: Vec<*mut u8> =
                transfers.iter().map(|t| arrays[key(t.array.component, t.array.quantity)].ptr()).collect();
            let (table, total) = build(transfers, &bases, packed.ptr()).unwrap();
            seen.descs += table.len();
            seen.many_dims += table.iter().filter(|d| d.ndim > 3).count();
            let wide = |d: &&sys::cuferry_halo_desc| d.unit_elems * d.elem_size == 16;
            seen.wide += table.iter().filter(wide).count();
            seen.wide_negated += table.iter().filter(wide).filter(|d| d.negate != 0).count();
            seen.most_units = table.iter().map(|d| d.units).fold(seen.most_units, i64::max);
            let staged: std::collections::BTreeSet<i32> =
                table.iter().map(|d| d.unit_elems * d.elem_size).filter(|u| [4, 8, 16].contains(u)).collect();
            seen.most_staged_sizes = seen.most_staged_sizes.max(staged.len());
            let dir = match direction {
                Direction::Pack => HaloDirection::Pack,
                Direction::Unpack => HaloDirection::Unpack,
            };
            // Loads in flight and grid caps: one block per 256-unit row (i32::MAX), one block
            // for everything, and chunks that start and end inside descriptors.
            // (The third cap comes from the set's size, not from `rng`: the random cases stay
            // those the assertions on `seen` were written for.)
            let varied_cap = 2 + (total % 41) as i32;
            for (in_flight, max_blocks) in [(1, i32::MAX), (2, 1), (2, varied_cap), (4, 3), (8, i32::MAX)] {
                // Start each run from the initial bytes.
                packed.bytes_mut().copy_from_slice(&packed0);
                for (a, init) in arrays.iter_mut().zip(&arrays0) {
                    a.bytes_mut().copy_from_slice(init);
                }
                // SAFETY: the table names the arrays and packed buffer above, host memory that
                // lives through the call and holds every view (`build` checked the views
                // against the plan, which checked them against the specs).
                unsafe { raw::emulate(&table, total, packed.ptr().cast(), dir, in_flight, max_blocks) }
                    .unwrap();
                let what = format!("{what} {direction:?} in_flight {in_flight}, at most {max_blocks} blocks");
                assert!(packed.bytes() == &want_packed[..], "{what}: packed buffer differs");
                for (i, a) in arrays.iter().enumerate() {
                    assert!(a.bytes() == &want_arrays[i][..], "{what}: array {i} differs");
                }
            }
        }
    }

    /// Random exchange sets: 1 to 4 quantities of one element type, 2 to 5 dims, scalar or
    /// vector, every rotation (see [`check_against_reference`]).
    #[test]
    fn emulated_kernel_matches_the_reference() {
        if !crate::cuda::is_built() {
            println!("SKIP: built without nvcc (the kernel's program is in csrc/halo.cu)");
            return;
        }
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut seen = Seen::default();
        for case in 0..300 {
            let quantities = 1 + rng.below(4);
            let layouts: Vec<_> = (0..quantities).map(|_| random_layout(&mut rng, case, 5)).collect();
            let vector = layouts.iter().all(|l| l.vector);
            let xs: Vec<HaloExchange> = layouts.iter().map(|l| l.ex.clone()).collect();
            check_against_reference(&mut rng, &xs, vector, &format!("case {case}"), &mut seen);
        }
        println!(
            "descriptors {}, of more than 3 dims {}, with 16-byte units {}",
            seen.descs, seen.many_dims, seen.wide
        );
        assert!(seen.many_dims > 10 && seen.wide > 10, "both special paths are exercised");
    }

    /// Layouts random ones rarely give: 16-byte units that are negated (a vector's half turn
    /// of a region whose only long dim is contiguous and not horizontal), and descriptors of
    /// more than 2^17 units (the multiply-shift division at large quotients).
    #[test]
    fn emulated_kernel_negates_wide_units_and_runs_long_descriptors() {
        if !crate::cuda::is_built() {
            println!("SKIP: built without nvcc (the kernel's program is in csrc/halo.cu)");
            return;
        }
        let mut rng = Rng(0x51_7cc1_b727_220a);
        let mut seen = Seen::default();
        for element in [ElementType::F32, ElementType::F64, ElementType::I32] {
            // Dims (z, y, x) with z contiguous: a 1 x 1 horizontal region is a run along z.
            let spec =
                HaloSpec::new(element, &[64, 5, 6], &[1, 64 * 6, 64], HorizontalDims::xy(2, 1)).unwrap();
            let ex = HaloExchange::new(&spec, &[0..64, 2..3, 3..4], 2, &[0..64, 0..1, 5..6]).unwrap();
            check_against_reference(
                &mut rng,
                &[ex.clone(), ex],
                true,
                &format!("{element:?} half turn"),
                &mut seen,
            );
        }
        assert!(seen.wide_negated >= 3, "negated 16-byte units: {}", seen.wide_negated);
        // 1-byte elements turned a quarter: 192 x 250 x 3 single-byte units.
        let spec = HaloSpec::contiguous(ElementType::U8, &[192, 256, 256], HorizontalDims::xy(2, 1)).unwrap();
        let ex = HaloExchange::new(&spec, &[0..192, 3..253, 3..6], 1, &[0..192, 0..3, 3..253]).unwrap();
        check_against_reference(&mut rng, &[ex], false, "long quarter turn", &mut seen);
        assert!(seen.most_units > 1 << 17, "a long descriptor: {} units", seen.most_units);
    }

    /// A set whose segments stage units of 4, 16 and 8 bytes (f32 x-faces of 3 and 2 columns,
    /// and whole rows), so a block passes between unit sizes: the emulation's stage check
    /// fails unless the block meets a barrier there (on a GPU, a data race in shared memory).
    #[test]
    fn emulated_kernel_passes_between_unit_sizes_at_a_barrier() {
        if !crate::cuda::is_built() {
            println!("SKIP: built without nvcc (the kernel's program is in csrc/halo.cu)");
            return;
        }
        let spec =
            HaloSpec::new(ElementType::F32, &[2, 12, 12], &[144, 12, 1], HorizontalDims::xy(2, 1)).unwrap();
        let ex = |pack: [std::ops::Range<usize>; 3], unpack: [std::ops::Range<usize>; 3]| {
            HaloExchange::new(&spec, &pack, 0, &unpack).unwrap()
        };
        let xs = [
            ex([0..2, 0..12, 0..3], [0..2, 0..12, 9..12]),
            ex([0..2, 0..3, 0..12], [0..2, 9..12, 0..12]),
            ex([0..2, 0..12, 4..6], [0..2, 0..12, 6..8]),
        ];
        let (mut rng, mut seen) = (Rng(0x2b_992d_d4a1), Seen::default());
        // Each run places the arrays and the packed buffer at new shifts from a 16-byte
        // boundary, which decide the unit sizes.
        for run in 0..16 {
            check_against_reference(&mut rng, &xs, false, &format!("mixed unit sizes, run {run}"), &mut seen);
        }
        assert!(seen.most_staged_sizes >= 2, "no table mixed staged unit sizes");
    }

    /// The device copies of a table, run on the host backend (the table logic is the same; only
    /// the launch needs CUDA): each bound set of addresses is what the selected copy holds,
    /// alternating between two sets uploads nothing once both are there, and a third set
    /// replaces the copy bound least recently.
    #[test]
    fn tables_alternate_between_two_copies_and_hold_what_was_built() {
        let spec = HaloSpec::contiguous(ElementType::F64, &[6, 5], HorizontalDims::xy(1, 0)).unwrap();
        let xs = [
            HaloExchange::new(&spec, &[0..6, 0..1], 0, &[0..6, 4..5]).unwrap(),
            HaloExchange::new(&spec, &[0..1, 0..5], 2, &[5..6, 0..5]).unwrap(),
        ];
        let plan = Plan::new(&xs, None).unwrap();
        let stream = Stream::new(crate::device::Device::Host).unwrap();
        let mut table = DeviceTable::new(&stream, &plan.pack).unwrap();
        let sets: Vec<Vec<*mut u8>> = (1..=3usize)
            .map(|k| plan.pack.iter().enumerate().map(|(i, _)| (k << 20 | i << 12) as *mut u8).collect())
            .collect();
        let packed = (1usize << 30) as *mut u8;
        let placement = DescriptorPlacement::DeviceMemory;
        // (set bound, copy expected to hold it, whether an upload is expected)
        let steps = [
            (0, 0, true),
            (1, 1, true),
            (0, 0, false),
            (1, 1, false),
            (2, 0, true),
            (1, 1, false),
            (0, 0, true),
        ];
        for (step, &(set, copy, uploads)) in steps.iter().enumerate() {
            let before: Vec<Option<TableKey>> = table.copies.iter().map(|c| c.key.clone()).collect();
            table.bind(&stream, &plan.pack, &sets[set], packed, placement).unwrap();
            assert_eq!(table.current, copy, "step {step}: the copy bound");
            let after: Vec<Option<TableKey>> = table.copies.iter().map(|c| c.key.clone()).collect();
            assert_eq!(before != after, uploads, "step {step}: uploaded {before:?} -> {after:?}");
            let (want, _) = build(&plan.pack, &sets[set], packed).unwrap();
            // SAFETY: as in `bind`: integer fields, no padding.
            let want =
                unsafe { std::slice::from_raw_parts(want.as_ptr().cast::<u8>(), want.len() * DESC_BYTES) };
            assert!(table.buffer().to_vec(&stream).unwrap() == want, "step {step}: the bound copy's bytes");
        }
        assert_eq!(table.copies.len(), TABLE_COPIES);
    }

    /// A region past the kernel's 31-bit limits is refused when the table is made (the packer
    /// is built), not at its first launch.
    #[test]
    fn tables_refuse_regions_past_the_kernel_limits() {
        let big = (1usize << 31) + 8;
        let spec = HaloSpec::contiguous(ElementType::F64, &[big], HorizontalDims::none()).unwrap();
        let whole = [std::ops::Range { start: 0, end: big }];
        let ex = HaloExchange::new(&spec, &whole, 0, &whole).unwrap();
        let plan = Plan::new(&[ex], None).unwrap();
        let stream = Stream::new(crate::device::Device::Host).unwrap();
        let err = DeviceTable::new(&stream, &plan.pack).unwrap_err();
        assert!(format!("{err}").contains("2^31 - 1"), "{err}");
    }

    /// An address the kernel's element pieces would not be aligned to is refused when the
    /// table is built, on either side (the kernel's typed loads and `cp.async` would fault).
    #[test]
    fn tables_refuse_misaligned_addresses() {
        let spec = HaloSpec::contiguous(ElementType::F64, &[6, 5], HorizontalDims::xy(1, 0)).unwrap();
        let xs = [HaloExchange::new(&spec, &[0..6, 0..1], 0, &[0..6, 4..5]).unwrap()];
        let plan = Plan::new(&xs, None).unwrap();
        let aligned = 1usize << 20;
        for (base, packed, ok) in
            [(aligned, aligned, true), (aligned + 4, aligned, false), (aligned, aligned + 2, false)]
        {
            let bases: Vec<*mut u8> = plan.pack.iter().map(|_| base as *mut u8).collect();
            let built = build(&plan.pack, &bases, packed as *mut u8);
            assert_eq!(built.is_ok(), ok, "base {base:#x}, packed {packed:#x}: {:?}", built.map(drop));
        }
    }
}
