//! The CUDA implementation: a plan's transfers as a descriptor table in device memory, run by
//! one kernel launch (csrc/halo.cu).
//!
//! Rules:
//! - The table holds absolute array addresses, so it is built and uploaded when a packer first
//!   runs and again only when the arrays' addresses change (a time step passing the same arrays
//!   uploads nothing). The upload is a tracked copy, so it waits for launches still reading the
//!   old table.
//! - Access units: rows contiguous on both sides move in units of up to 16 bytes when the row
//!   length, every outer stride and both start addresses allow it; everything else element by
//!   element (atoms of 1 to 8 bytes).
//! - Limits checked here, before anything is queued: extents and units per transfer fit the
//!   kernel's 31-bit indices.

use std::os::raw::c_void;

use super::plan::Transfer;
use super::spec::ElemKind;
use crate::cuda::halo::{self as raw, HaloDirection};
use crate::error::{Error, Result};
use crate::memory::sealed::Sealed;
use crate::memory::DeviceBuffer;
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
);

/// Widest access unit in bytes.
const MAX_UNIT_BYTES: usize = 16;

/// A packer's descriptor table for one direction.
#[derive(Debug)]
pub(crate) struct DeviceTable {
    buf: DeviceBuffer<u8>,
    /// The array addresses and packed address the uploaded table was built for.
    bound: Option<(Vec<usize>, usize)>,
    n_desc: usize,
    total_units: u64,
}

impl DeviceTable {
    /// Room for `n_desc` descriptors on `stream`'s device (nothing uploaded yet).
    pub(crate) fn new(stream: &Stream, n_desc: usize) -> Result<Self> {
        let bytes =
            n_desc.checked_mul(DESC_BYTES).ok_or_else(|| Error::invalid("too many halo descriptors"))?;
        Ok(DeviceTable { buf: DeviceBuffer::zeroed(stream, bytes)?, bound: None, n_desc, total_units: 0 })
    }

    /// Makes the uploaded table describe `arrays` (one base address per transfer) and `packed`;
    /// uploads (and waits for the upload) only when they changed.
    pub(crate) fn bind(
        &mut self,
        stream: &Stream,
        transfers: &[Transfer],
        arrays: &[*mut u8],
        packed: *mut u8,
    ) -> Result<()> {
        let key: (Vec<usize>, usize) = (arrays.iter().map(|p| *p as usize).collect(), packed as usize);
        if self.bound.as_ref() == Some(&key) {
            return Ok(());
        }
        let (table, total_units) = build(transfers, arrays, packed)?;
        if table.len() != self.n_desc {
            return Err(Error::invalid("the halo descriptor table changed size"));
        }
        // SAFETY: `cuferry_halo_desc` is repr(C) with integer fields only and no padding (the
        // const assertion above), so every byte of the vector is initialised.
        let bytes =
            unsafe { std::slice::from_raw_parts(table.as_ptr().cast::<u8>(), table.len() * DESC_BYTES) };
        self.bound = None;
        self.buf.copy_from_slice(stream, bytes)?;
        self.bound = Some(key);
        self.total_units = total_units;
        Ok(())
    }

    /// The table's buffer (its tracker must record every launch that reads it).
    pub(crate) fn buffer(&self) -> &DeviceBuffer<u8> {
        &self.buf
    }

    /// Queues the one launch over the bound table.
    ///
    /// # Safety
    ///
    /// 1. [`DeviceTable::bind`] was last called with the arrays and packed buffer used now, and
    ///    they, with the table, **stay alive and unraced until the stream has run the kernel**
    ///    (the caller records the launch on all their trackers).
    pub(crate) unsafe fn launch(
        &self,
        stream: &Stream,
        ordinal: u32,
        packed: *mut u8,
        direction: HaloDirection,
    ) -> Result<()> {
        if self.total_units == 0 {
            return Ok(());
        }
        let table = self.buf.raw_parts().ptr.cast::<sys::cuferry_halo_desc>().cast_const();
        // SAFETY: the table was built for these addresses (precondition 1) by `build`, which
        // checked every limit; the caller keeps everything alive through the trackers.
        unsafe {
            raw::launch(
                ordinal,
                table,
                self.n_desc,
                self.total_units,
                packed.cast::<c_void>(),
                direction,
                stream.cuda_raw()?,
            )
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
        let array_first = base as usize + t.array_offset * t.atom;
        let packed_first = packed as usize + t.packed_offset;
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
        };
        for d in 0..nd {
            desc.array_stride[d] = t.array_strides[d] as i64;
            desc.packed_stride[d] = t.packed_strides[d] as i64;
            desc.extent[d] = i32::try_from(t.extent[d]).map_err(|_| too_large("an extent"))?;
        }
        next_unit += units as u64;
        table.push(desc);
    }
    Ok((table, next_unit))
}
