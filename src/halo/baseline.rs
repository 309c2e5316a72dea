//! The seed's pack strategy, kept as the baseline that benchmarks measure [`HaloPacker`]
//! against in the same run (not meant for production use).
//!
//! Rules:
//! - Like the seed's GPU transformer: at construction, one flat `i32` index array per exchange
//!   (the rotated region's elements in pack order, as indices into the array) is computed and
//!   uploaded; each pack then queues one gather per exchange (`packed[i] = array[index[i]]`):
//!   one kernel launch each on CUDA, one host job each on the host backend.
//! - Scalar quantities only, element sizes 1, 2, 4 or 8; the packed layout equals
//!   [`HaloPacker`]'s for the same exchanges.
//! - The gathers of one pack are tracked as one operation (one ordering record for all of
//!   them, as the packer's one launch has), so drops are safe while they are queued and the
//!   baseline's time is the seed's launches, not cuferry's bookkeeping per launch.
//!
//! [`HaloPacker`]: super::HaloPacker

use std::os::raw::c_void;

use super::spec::HaloExchange;
use crate::cuda::halo::{self as raw, SeedElement};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::sealed::Sealed;
use crate::memory::tracker::{Access, UseTracker};
use crate::memory::{DeviceBuffer, Element};
use crate::stream::Stream;

/// One exchange's index array and slot.
#[derive(Debug)]
struct SeedEdge {
    indices: DeviceBuffer<i32>,
    /// Byte offset of the slot.
    offset: usize,
}

/// The seed's strategy: an index array per exchange, one gather launch per exchange.
///
/// # Examples
///
/// ```
/// use cuferry::halo::baseline::SeedBaseline;
/// use cuferry::halo::{ElementType, HaloExchange, HaloSpec, HorizontalDims};
/// use cuferry::{Device, DeviceBuffer, Stream};
///
/// let stream = Stream::new(Device::Host)?;
/// let spec = HaloSpec::contiguous(ElementType::I32, &[2, 3], HorizontalDims::xy(1, 0))?;
/// let ex = HaloExchange::new(&spec, &[0..2, 0..1], 2, &[0..2, 2..3])?;
/// let mut seed = SeedBaseline::new(&stream, &[ex])?;
/// let a = DeviceBuffer::from_slice(&stream, &[1i32, 2, 3, 4, 5, 6])?;
/// seed.pack(&[&a])?;
/// assert_eq!(seed.packed()?.to_vec(&stream)?, [4, 0, 0, 0, 1, 0, 0, 0]); // 4 then 1, as bytes
/// assert_eq!(seed.launches_per_pack(), 1);
/// # Ok::<(), cuferry::Error>(())
/// ```
#[derive(Debug)]
pub struct SeedBaseline {
    stream: Stream,
    exchanges: Vec<HaloExchange>,
    edges: Vec<SeedEdge>,
    packed: DeviceBuffer<u8>,
    elem_size: usize,
    kind: i32,
}

impl SeedBaseline {
    /// Computes and uploads the index arrays of `exchanges` (scalar quantities) on `stream`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the exchanges mix element types, an element is not 1, 2,
    /// 4 or 8 bytes, or an index does not fit `i32`; allocation and copy errors.
    pub fn new(stream: &Stream, exchanges: &[HaloExchange]) -> Result<Self> {
        let elem_size = exchanges.first().map_or(1, |e| e.spec().element().size());
        let element = exchanges.first().map(|e| e.spec().element());
        if exchanges.iter().any(|e| Some(e.spec().element()) != element) || ![1, 2, 4, 8].contains(&elem_size)
        {
            return Err(Error::invalid("the seed baseline needs one element type of 1, 2, 4 or 8 bytes"));
        }
        let kind = match element.map(|e| e.kind()) {
            Some(k) => super::gpu::kind_code(k),
            None => 0,
        };
        let mut edges = Vec::with_capacity(exchanges.len());
        let mut offset = 0usize;
        for ex in exchanges {
            let indices = flat_indices(ex)?;
            let n = indices.len();
            edges.push(SeedEdge { indices: DeviceBuffer::from_slice(stream, &indices)?, offset });
            offset += n * elem_size;
        }
        let packed = DeviceBuffer::zeroed(stream, offset)?;
        Ok(SeedBaseline {
            stream: stream.clone(),
            exchanges: exchanges.to_vec(),
            edges,
            packed,
            elem_size,
            kind,
        })
    }

    /// Gathers launched (or host jobs queued) per [`SeedBaseline::pack`]: one per non-empty
    /// exchange.
    pub fn launches_per_pack(&self) -> usize {
        self.edges.iter().filter(|e| !e.indices.is_empty()).count()
    }

    /// Queues one gather per exchange from `arrays[i]` (the array of exchange `i`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a wrong number of arrays, a wrong element size, another
    /// device or a short array; CUDA launch errors.
    pub fn pack<T: Element>(&mut self, arrays: &[&DeviceBuffer<T>]) -> Result<()> {
        if arrays.len() != self.edges.len() {
            return Err(Error::invalid(format!(
                "{} arrays for {} exchanges",
                arrays.len(),
                self.edges.len()
            )));
        }
        for (a, ex) in arrays.iter().zip(&self.exchanges) {
            let spec = ex.spec();
            let bytes = a.len() * std::mem::size_of::<T>();
            if !spec.element().accepts::<T>()
                || a.device() != self.stream.device()
                || bytes < spec.required_bytes()
            {
                return Err(Error::invalid(
                    "an array does not match its exchange's spec or the stream's device",
                ));
            }
        }
        // One ordering record for the whole pack (the seed has no such bookkeeping; one per
        // launch made the baseline slower than the seed's own 40 launches), then the launches.
        let packed = self.packed.raw_parts();
        // The gathers write the packed buffer and read the arrays and index lists (each listed
        // once: named twice it would count as written).
        let mut trackers: Vec<(&UseTracker, Access)> = vec![(packed.tracker, Access::Write)];
        let mut gathers = Vec::with_capacity(self.edges.len());
        for (edge, array) in self.edges.iter().zip(arrays) {
            let n = edge.indices.len();
            if n == 0 {
                continue;
            }
            let (src, idx) = (array.raw_parts(), edge.indices.raw_parts());
            for t in [src.tracker, idx.tracker] {
                if !trackers.iter().any(|(known, _)| std::ptr::eq(*known, t)) {
                    trackers.push((t, Access::Read));
                }
            }
            gathers.push(Gather {
                src: src.ptr,
                indices: idx.ptr.cast::<i32>(),
                n,
                dst: packed.ptr.wrapping_add(edge.offset),
                elem_size: self.elem_size,
            });
        }
        if gathers.is_empty() {
            return Ok(());
        }
        let (stream, kind) = (&self.stream, self.kind);
        // A failed launch leaves the ones before it queued: the tracker records them anyway.
        UseTracker::use_on(stream, &trackers, || {
            for gather in gathers {
                match stream.device() {
                    Device::Host => stream.host_fn(move || gather.run_host())?,
                    Device::Cuda(ordinal) => {
                        let element = SeedElement { size: gather.elem_size as i32, kind, negate: false };
                        // SAFETY: the indices address elements inside the array (checked length),
                        // the slot is inside the packed buffer, and the launches are recorded on
                        // every tracker, which keep them alive until they have run.
                        unsafe {
                            raw::seed_pack_launch(
                                ordinal,
                                gather.src.cast::<c_void>(),
                                gather.indices,
                                gather.n,
                                gather.dst.cast::<c_void>(),
                                element,
                                stream.cuda_raw()?,
                            )?
                        }
                    }
                }
            }
            Ok(())
        })?;
        Ok(())
    }

    /// The packed buffer, after waiting for the stream.
    ///
    /// # Errors
    ///
    /// As [`Stream::synchronize`].
    pub fn packed(&self) -> Result<&DeviceBuffer<u8>> {
        self.stream.synchronize()?;
        Ok(&self.packed)
    }
}

/// The rotated pack region's elements, in pack order, as indices into the array.
fn flat_indices(ex: &HaloExchange) -> Result<Vec<i32>> {
    let view = ex.pack_view();
    let n = super::spec::box_elements(view.shape.iter().copied());
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return Ok(out);
    }
    let nd = view.shape.len();
    let mut idx = vec![0usize; nd];
    for _ in 0..n {
        let at = view.offset as isize
            + idx.iter().zip(&view.strides).map(|(&i, &s)| i as isize * s).sum::<isize>();
        out.push(
            i32::try_from(at)
                .map_err(|_| Error::invalid("an index of the seed baseline does not fit i32"))?,
        );
        for d in (0..nd).rev() {
            idx[d] += 1;
            if idx[d] < view.shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(out)
}

/// One gather, carried to the host worker or handed to the kernel.
#[derive(Clone, Copy)]
struct Gather {
    src: *const u8,
    indices: *const i32,
    n: usize,
    dst: *mut u8,
    elem_size: usize,
}

// SAFETY: the pointers name buffers whose trackers record this gather, so they stay alive and
// unraced until it has run; sending the addresses to the worker is the tracker protocol's job.
unsafe impl Send for Gather {}

impl Gather {
    fn run_host(self) {
        // SAFETY: `indices` holds `n` valid indices into `src` (computed from the checked
        // spec), `dst` has room for `n` elements, and the trackers keep all three alive and
        // unraced (see the Send impl).
        unsafe {
            match self.elem_size {
                8 => self.gather::<u64>(),
                4 => self.gather::<u32>(),
                2 => self.gather::<u16>(),
                _ => self.gather::<u8>(),
            }
        }
    }

    /// # Safety
    ///
    /// As [`Gather::run_host`]'s comment, with `size_of::<E>() == elem_size`.
    unsafe fn gather<E: Copy>(self) {
        let (src, dst) = (self.src.cast::<E>(), self.dst.cast::<E>());
        for i in 0..self.n {
            // SAFETY: the caller's precondition.
            unsafe {
                let at = *self.indices.add(i) as usize;
                dst.add(i).write_unaligned(src.add(at).read_unaligned());
            }
        }
    }
}
