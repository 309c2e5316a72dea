//! [`HaloPacker`]: packs many arrays into one buffer and unpacks them from one, asynchronously.
//!
//! Rules (see also the [halo module](super)):
//! - Built once per exchange set: the layout and the transfers are computed at construction
//!   (and on CUDA uploaded to the device at the first call, again only when the arrays'
//!   addresses change to ones not among the last two sets).
//! - Arrays are any cuferry memory the packer's work reaches: on CUDA, device and managed
//!   memory of the packer's device (a [`DeviceBuffer`], a [`ManagedBuffer`], a
//!   [`ForeignBuffer`](crate::ForeignBuffer) of another library's); on the host backend,
//!   memory host code may touch while kernels run (not CUDA device memory; managed memory of
//!   a CUDA device only with `concurrentManagedAccess`). One call mixes kinds as
//!   `&dyn Memory<T>`. `unpack` writes through shared references, so it takes only memory
//!   safe code sees through tracked work ([`WriteShared`]: device buffers, and foreign
//!   buffers, whose owner's views the wrap's contract holds off); cuferry's managed and host
//!   buffers, which hand out `&self` host views, are unpacked by the unsafe
//!   `unpack_unchecked`. A read-only foreign buffer is never unpacked into.
//! - `pack` and `unpack` check every array (element type, reach, length covering the spec's
//!   strided extent) before queueing anything, then queue the work on the packer's stream and
//!   return at once. On CUDA that is ONE kernel launch per call; on the host backend ONE job.
//! - The queued work is recorded on the tracker of every array and buffer it touches (pack
//!   reads the arrays and writes the pack buffer, unpack the reverse), so it is ordered after
//!   earlier work on them (any stream; for what it only reads, after their last write), later
//!   work waits for it as the tracker's rule says, and dropping an array or the packer while
//!   it is pending is safe. A dropped array waits for the work. The packer's packed buffers go
//!   back to the pool still tracked, without waiting (a buffer the full pool does not take
//!   waits, then is freed); on CUDA its descriptor tables wait for the launches reading them,
//!   so dropping a CUDA packer blocks until its queued work has run.
//! - `unpack` writes through shared references, like a copy queued on the stream: only tracked
//!   work (copies, `to_vec`, drops) can observe the arrays, and it runs after the unpack. One
//!   array may appear in several exchanges; their unpack regions must then be disjoint.
//! - Two arrays of one unpack sharing memory at different addresses are refused.
//! - The rotation is applied once, by `pack`. `unpack` writes each slot into its unpack region
//!   in row-major order, unturned and unnegated.
//!
//! [`ManagedBuffer`]: crate::managed::ManagedBuffer

use std::sync::Arc;

use super::cpu::{
    thread_budget, threads_for, Direction, HostJob, HostSchedule, MAX_THREADS as MAX_HOST_THREADS,
};
use super::gpu::{DescriptorPlacement, DeviceTable, MAX_INLINE_DESCRIPTORS};
use super::plan::{ArrayRef, Component, PackedSlot, Plan};
use super::pool::PooledBuffer;
use super::spec::{ElementType, HaloExchange};
use crate::copy::copy;
use crate::cuda::halo::HaloDirection;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::sealed::Sealed;
use crate::memory::tracker::{Access, UseTracker};
use crate::memory::{check_host_stream_access, DeviceBuffer, Element, Memory, MemoryKind, WriteShared};
use crate::stream::Stream;

/// Host-backend packs and unpacks of at most this many bytes run on the calling thread when
/// the packer's stream is idle.
const HOST_INLINE_BYTES: usize = 1 << 20;

/// Packs the regions of many arrays into one contiguous buffer and unpacks them from one.
///
/// Scalar quantities take one exchange list; vector quantities two (x and y components, in the
/// same order), and the rotation then also turns the components (module docs of
/// [`crate::halo`]). The packed layout is given by [`HaloPacker::slots`].
///
/// # Examples
///
/// Pack the east column of one array turned a quarter clockwise, and unpack it as the south row
/// of another:
///
/// ```
/// use cuferry::halo::{ElementType, HaloExchange, HaloPacker, HaloSpec, HorizontalDims};
/// use cuferry::{Device, DeviceBuffer, Stream};
///
/// // 3 x 3 arrays stored as (y, x): element (x, y) at index 3 y + x.
/// let spec = HaloSpec::contiguous(ElementType::F64, &[3, 3], HorizontalDims::xy(1, 0))?;
/// let east_to_south = HaloExchange::new(&spec, &[0..3, 2..3], 1, &[0..1, 0..3])?;
/// let mut packer = HaloPacker::new(Device::Host, &[east_to_south], None)?;
///
/// let stream = packer.stream().clone();
/// let a = DeviceBuffer::from_slice(&stream, &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])?;
/// let b = DeviceBuffer::<f64>::zeroed(&stream, 9)?;
/// packer.pack(&[&a], None)?;
/// packer.copy_pack_to_unpack()?; // what a communication library would do
/// packer.unpack(&[&b], None)?;
/// // The east column, north at the top (8, 5, 2 from y = 2 down), turned clockwise: north
/// // goes east, so the row reads 2, 5, 8 from west to east.
/// assert_eq!(b.to_vec(&stream)?[..3], [2.0, 5.0, 8.0]);
/// # Ok::<(), cuferry::Error>(())
/// ```
#[derive(Debug)]
pub struct HaloPacker {
    stream: Stream,
    plan: Arc<Plan>,
    pack_buf: PooledBuffer,
    unpack_buf: PooledBuffer,
    backend: Backend,
    /// The unpack arrays (address, bytes) whose aliasing was checked last (the check is skipped when
    /// the same arrays come again).
    unpack_checked: Option<Vec<(usize, usize)>>,
    /// Most threads a host job uses.
    host_threads: usize,
}

/// The one place where the two backends differ.
#[derive(Debug)]
enum Backend {
    /// The loop nests of every transfer, built once.
    Host(Arc<HostSchedule>),
    Cuda(Box<CudaTables>),
}

/// The CUDA backend's descriptor tables, one per direction.
#[derive(Debug)]
struct CudaTables {
    ordinal: u32,
    pack: DeviceTable,
    unpack: DeviceTable,
    placement: DescriptorPlacement,
}

impl HaloPacker {
    /// A packer with its own new stream on `device`.
    ///
    /// # Errors
    ///
    /// As [`HaloPacker::with_stream`], and the errors of [`Stream::new`].
    pub fn new(
        device: Device,
        exchanges_x: &[HaloExchange],
        exchanges_y: Option<&[HaloExchange]>,
    ) -> Result<Self> {
        Self::with_stream(&Stream::new(device)?, exchanges_x, exchanges_y)
    }

    /// A packer that queues its work on `stream` (a clone of the handle is kept). Its device
    /// is the stream's.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the exchanges mix element types, `exchanges_y` differs
    /// in length from `exchanges_x`, a vector quantity has an unsigned or raw element type, its
    /// two exchanges turn differently, a slot's rotated pack shape differs from the unpack
    /// shape it fills, or (on CUDA) a region exceeds the kernel's limits: 2^31 - 1 units, and
    /// as many along one dim, where a unit is the largest power of two up to 8 bytes dividing
    /// the element size (an element of 16 or 24 bytes counts 2 or 3); allocation errors of the
    /// buffers.
    pub fn with_stream(
        stream: &Stream,
        exchanges_x: &[HaloExchange],
        exchanges_y: Option<&[HaloExchange]>,
    ) -> Result<Self> {
        let plan = Arc::new(Plan::new(exchanges_x, exchanges_y)?);
        let pack_buf = PooledBuffer::take(stream, plan.bytes)?;
        let unpack_buf = PooledBuffer::take(stream, plan.bytes)?;
        let backend = match stream.device() {
            Device::Host => Backend::Host(Arc::new(HostSchedule::new(&plan))),
            Device::Cuda(ordinal) => Backend::Cuda(Box::new(CudaTables {
                ordinal,
                pack: DeviceTable::new(stream, &plan.pack)?,
                unpack: DeviceTable::new(stream, &plan.unpack)?,
                placement: DescriptorPlacement::default(),
            })),
        };
        Ok(HaloPacker {
            stream: stream.clone(),
            plan,
            pack_buf,
            unpack_buf,
            backend,
            unpack_checked: None,
            host_threads: thread_budget(),
        })
    }

    /// Sets the most threads one host-backend job may use, clamped to 1..=16 (default: the
    /// machine's parallelism, at most 16). Jobs under 512 KiB run on one thread (the caller's
    /// when the stream is idle and the job is at most 1 MiB, as the module rules say; else the
    /// stream's worker); larger ones add a thread per 128 KiB up to this limit. No effect on
    /// CUDA.
    pub fn set_host_threads(&mut self, threads: usize) {
        self.host_threads = threads.clamp(1, MAX_HOST_THREADS);
    }

    /// The most threads one host-backend job may use.
    pub fn host_threads(&self) -> usize {
        self.host_threads
    }

    /// The threads one host-backend pack or unpack of this packer uses, the caller's or the
    /// worker's included: 1 up to 512 KiB, else one per 128 KiB of
    /// [`buffer_bytes`](Self::buffer_bytes) up to [`host_threads`](Self::host_threads).
    pub fn host_job_threads(&self) -> usize {
        threads_for(self.plan.bytes, self.host_threads)
    }

    /// The stream the packer queues on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The device of the arrays and buffers.
    pub fn device(&self) -> Device {
        self.stream.device()
    }

    /// Whether the quantities are vectors (two exchange lists).
    pub fn is_vector(&self) -> bool {
        self.plan.exchanges_y.is_some()
    }

    /// Leaks the pack and unpack buffers (never freed, never pooled again): MPI may still read
    /// or write them after a failed exchange. Every later use of the packer fails.
    #[cfg(feature = "mpi")]
    pub(crate) fn leak_buffers(&mut self) {
        self.pack_buf.leak();
        self.unpack_buf.leak();
    }

    /// The exchanges of the x components (of every quantity, for scalars), one per quantity.
    pub fn exchanges_x(&self) -> &[HaloExchange] {
        &self.plan.exchanges_x
    }

    /// The exchanges of the y components of vector quantities (`None` for scalars).
    pub fn exchanges_y(&self) -> Option<&[HaloExchange]> {
        self.plan.exchanges_y.as_deref()
    }

    /// Number of quantities (exchanges per list).
    pub fn quantities(&self) -> usize {
        self.plan.exchanges_x.len()
    }

    /// The element type (`None` for an empty exchange list).
    pub fn element(&self) -> Option<ElementType> {
        self.plan.element
    }

    /// Size of the packed buffer (and of the unpack buffer) in bytes.
    pub fn buffer_bytes(&self) -> usize {
        self.plan.bytes
    }

    /// The slots of the packed buffer, in pack order.
    pub fn slots(&self) -> &[PackedSlot] {
        &self.plan.slots
    }

    /// Where the CUDA kernel reads the descriptors from (see [`DescriptorPlacement`]).
    /// [`DescriptorPlacement::DeviceMemory`] unless set; the host backend has no descriptors
    /// and always answers that.
    pub fn descriptor_placement(&self) -> DescriptorPlacement {
        match &self.backend {
            Backend::Cuda(tables) => tables.placement,
            Backend::Host(_) => DescriptorPlacement::DeviceMemory,
        }
    }

    /// Sets where the CUDA kernel reads the descriptors from, for the calls queued from now on
    /// (calls already queued keep theirs). Does nothing on the host backend.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for [`DescriptorPlacement::LaunchParameters`] when a
    /// direction has more than [`MAX_INLINE_DESCRIPTORS`] descriptors (array regions).
    pub fn set_descriptor_placement(&mut self, placement: DescriptorPlacement) -> Result<()> {
        let regions = self.plan.pack.len().max(self.plan.unpack.len());
        let Backend::Cuda(tables) = &mut self.backend else { return Ok(()) };
        if placement == DescriptorPlacement::LaunchParameters && regions > MAX_INLINE_DESCRIPTORS {
            return Err(Error::invalid(format!(
                "{regions} halo descriptors do not fit the launch's parameters (at most \
                 {MAX_INLINE_DESCRIPTORS})"
            )));
        }
        tables.placement = placement;
        Ok(())
    }

    /// Kernel launches (CUDA) or host jobs (host) one `pack` or `unpack` queues: 1, or 0 when
    /// there is nothing to move.
    pub fn launches_per_call(&self) -> usize {
        usize::from(!self.plan.pack.is_empty())
    }

    /// Queues the packing of every pack region (turned and, for vectors, with the components
    /// turned) into the pack buffer. `arrays_x[i]` is the array of `exchanges_x[i]`;
    /// `arrays_y` is given exactly when the packer was built with `exchanges_y`. Arrays are
    /// any memory the packer reaches (module rules): [`DeviceBuffer`]s,
    /// [`ManagedBuffer`](crate::managed::ManagedBuffer)s, or a mix of them as `&dyn Memory<T>`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the number of arrays is wrong, `arrays_y` is given to a
    /// scalar packer or missing for a vector one, an array's element type does not match its
    /// spec, its memory is out of the packer's reach, or it is shorter than its spec's strided
    /// extent; [`Error::Unsupported`] for a host packer's managed array of a CUDA device
    /// without `concurrentManagedAccess`; CUDA errors of the table upload and the launch.
    /// Nothing is queued on a validation error (on CUDA a failed launch may leave its table's
    /// upload queued, which is harmless).
    pub fn pack<T: Element, A: Memory<T> + ?Sized>(
        &mut self,
        arrays_x: &[&A],
        arrays_y: Option<&[&A]>,
    ) -> Result<()> {
        self.run(Direction::Pack, arrays_x, arrays_y)
    }

    /// Queues the unpacking of the unpack buffer into every unpack region (in row-major order,
    /// not turned: the rotation was applied by the pack). Arguments as for
    /// [`HaloPacker::pack`], of memory safe code sees only through tracked work
    /// ([`WriteShared`]: device buffers and [`ForeignBuffer`](crate::ForeignBuffer)s);
    /// [`HaloPacker::unpack_unchecked`] takes cuferry's managed and host buffers.
    ///
    /// # Errors
    ///
    /// As [`HaloPacker::pack`], and [`Error::InvalidArgument`] when one array is passed for two
    /// exchanges with different specs or overlapping unpack regions, two arrays share memory
    /// at different addresses, or an array is a read-only `ForeignBuffer`.
    pub fn unpack<T: Element, A: WriteShared<T> + ?Sized>(
        &mut self,
        arrays_x: &[&A],
        arrays_y: Option<&[&A]>,
    ) -> Result<()> {
        self.run(Direction::Unpack, arrays_x, arrays_y)
    }

    /// [`HaloPacker::unpack`] into any memory the packer reaches: managed buffers, and host
    /// memory on the host backend. The unpack writes through shared references, and those
    /// buffers also give host views through `&self` (`as_slice`), which the borrow checker
    /// cannot keep from overlapping the queued write.
    ///
    /// # Errors
    ///
    /// As [`HaloPacker::unpack`].
    ///
    /// # Safety
    ///
    /// 1. No host view of an array (`as_slice`, a raw pointer) is used from the call until the
    ///    unpack has finished (a tracked wait: `synchronize`, `as_slice` called afterwards,
    ///    or the packer's [`HaloPacker::synchronize`]).
    pub unsafe fn unpack_unchecked<T: Element, A: Memory<T> + ?Sized>(
        &mut self,
        arrays_x: &[&A],
        arrays_y: Option<&[&A]>,
    ) -> Result<()> {
        self.run(Direction::Unpack, arrays_x, arrays_y)
    }

    /// True when the queued pack and unpack work on the buffers has finished; does not block.
    ///
    /// # Errors
    ///
    /// CUDA errors of `cudaEventQuery`; [`Error::InvalidArgument`] when a buffer was replaced
    /// by one of another size or device (as [`HaloPacker::pack_buffer`] reports).
    pub fn ready(&self) -> Result<bool> {
        Ok(self.pack_buf.get()?.is_idle()? && self.unpack_buf.get()?.is_idle()?)
    }

    /// Blocks until everything queued on the packer's stream has finished (when the stream is
    /// shared, that includes other work on it).
    ///
    /// # Errors
    ///
    /// As [`Stream::synchronize`].
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize()
    }

    /// The pack buffer, after [`HaloPacker::synchronize`]: ready to be sent. Also waits for
    /// work queued on the buffer elsewhere (a pooled buffer's earlier owner may have used it on
    /// another stream).
    ///
    /// # Errors
    ///
    /// As [`HaloPacker::synchronize`] and [`DeviceBuffer::synchronize`];
    /// [`Error::InvalidArgument`] if the buffer was replaced by one of another size or device.
    pub fn pack_buffer(&self) -> Result<&DeviceBuffer<u8>> {
        self.synchronize()?;
        let buf = self.pack_buf.get()?;
        buf.synchronize()?;
        Ok(buf)
    }

    /// The unpack buffer, after [`HaloPacker::synchronize`] and the buffer's own queued work
    /// (as [`HaloPacker::pack_buffer`]).
    ///
    /// # Errors
    ///
    /// As [`HaloPacker::pack_buffer`].
    pub fn unpack_buffer(&self) -> Result<&DeviceBuffer<u8>> {
        self.synchronize()?;
        let buf = self.unpack_buf.get()?;
        buf.synchronize()?;
        Ok(buf)
    }

    /// The unpack buffer for receiving into, after [`HaloPacker::synchronize`] and the buffer's
    /// own queued work (as [`HaloPacker::pack_buffer`]). Write into it; a buffer put in its
    /// place must be of the same size and device, or the next `unpack` fails.
    ///
    /// # Errors
    ///
    /// As [`HaloPacker::pack_buffer`].
    pub fn unpack_buffer_mut(&mut self) -> Result<&mut DeviceBuffer<u8>> {
        self.synchronize()?;
        let buf = self.unpack_buf.get_mut()?;
        buf.synchronize()?;
        Ok(buf)
    }

    /// Queues a copy of the pack buffer into the unpack buffer on the packer's stream (a
    /// loopback: a periodic boundary on one rank, or a test).
    ///
    /// # Errors
    ///
    /// Errors of [`crate::copy()`]; [`Error::InvalidArgument`] if either buffer was replaced
    /// by one of another size or device.
    pub fn copy_pack_to_unpack(&mut self) -> Result<()> {
        let src = self.pack_buf.get()?;
        // Checked as every other use checks it (`get_mut` does not).
        self.unpack_buf.get()?;
        let dst = self.unpack_buf.get_mut()?;
        copy(&self.stream, src, dst).map(|_| ())
    }

    fn run<T: Element, A: Memory<T> + ?Sized>(
        &mut self,
        direction: Direction,
        arrays_x: &[&A],
        arrays_y: Option<&[&A]>,
    ) -> Result<()> {
        let arrays = Arrays { x: arrays_x, y: arrays_y };
        self.check_arrays(&arrays)?;
        if direction == Direction::Unpack {
            arrays.x.iter().chain(arrays.y.unwrap_or(&[])).try_for_each(|a| a.check_writable())?;
            self.check_unpack_aliasing(&arrays)?;
        }
        let plan = Arc::clone(&self.plan);
        let transfers = match direction {
            Direction::Pack => &plan.pack,
            Direction::Unpack => &plan.unpack,
        };
        if transfers.is_empty() {
            return Ok(());
        }
        let bases: Vec<*mut u8> = transfers.iter().map(|t| arrays.get(t.array).raw_parts().ptr).collect();
        let stream = self.stream.clone();
        let buffer = match direction {
            Direction::Pack => self.pack_buf.get()?,
            Direction::Unpack => self.unpack_buf.get()?,
        };
        let packed = buffer.raw_parts().ptr;
        // Pack reads the arrays and writes the buffer; unpack the reverse. Each array is
        // listed once (one may serve several exchanges; named twice it would count as written).
        let (array_access, buffer_access) = match direction {
            Direction::Pack => (Access::Read, Access::Write),
            Direction::Unpack => (Access::Write, Access::Read),
        };
        let mut trackers: Vec<(&UseTracker, Access)> = vec![(buffer.raw_parts().tracker, buffer_access)];
        for a in arrays.x.iter().chain(arrays.y.unwrap_or(&[])) {
            let tracker = a.raw_parts().tracker;
            if !trackers.iter().any(|(t, _)| std::ptr::eq(*t, tracker)) {
                trackers.push((tracker, array_access));
            }
        }
        match &mut self.backend {
            Backend::Host(schedule) => {
                let job = HostJob {
                    schedule: Arc::clone(schedule),
                    direction,
                    arrays: bases,
                    packed,
                    max_threads: self.host_threads,
                };
                // Short jobs on an idle stream run on the calling thread (no hand-off to the
                // worker and back, which costs more than a small pack).
                if self.plan.bytes <= HOST_INLINE_BYTES {
                    UseTracker::use_on(&stream, &trackers, || stream.host_fn_short(move || job.run()))
                } else {
                    UseTracker::use_on(&stream, &trackers, || stream.host_fn(move || job.run()))
                }
            }
            Backend::Cuda(tables) => {
                let CudaTables { ordinal, pack, unpack, placement } = &mut **tables;
                let (table, dir) = match direction {
                    Direction::Pack => (pack, HaloDirection::Pack),
                    Direction::Unpack => (unpack, HaloDirection::Unpack),
                };
                let (ordinal, placement) = (*ordinal, *placement);
                table.bind(&stream, transfers, &bases, packed, placement)?;
                let table: &DeviceTable = table;
                // The launch only reads the descriptor table (its uploads are tracked copies,
                // which write it and so wait for the launches reading it).
                trackers.push((table.buffer().raw_parts().tracker, Access::Read));
                UseTracker::use_on(&stream, &trackers, || {
                    // SAFETY: the table was just bound to these addresses and this placement,
                    // and the launch is recorded on the trackers of every array, the packed
                    // buffer and the table, which keep them alive and ordered until it has run.
                    unsafe { table.launch(&stream, ordinal, packed, dir, placement) }
                })
            }
        }
    }

    /// Checks that the packer's work reaches an array of memory `kind` named by `name`: on
    /// CUDA, device or managed memory of the packer's device (the kernel dereferences it); on
    /// the host backend, memory host code may touch while kernels run (not CUDA device memory;
    /// managed memory only with `concurrentManagedAccess`).
    fn check_reach(&self, kind: MemoryKind, name: impl Fn() -> String) -> Result<()> {
        match self.device() {
            Device::Cuda(i) => match kind {
                MemoryKind::Device(Device::Cuda(j)) | MemoryKind::Managed(Device::Cuda(j)) if j == i => {
                    Ok(())
                }
                _ => Err(Error::invalid(format!(
                    "{} is {kind:?} memory, but the packer's kernel runs on cuda:{i} and reaches \
                     device or managed memory of cuda:{i} only",
                    name()
                ))),
            },
            Device::Host if !kind.host_accessible() => Err(Error::invalid(format!(
                "{} is {kind:?} memory, which the host packer cannot reach: build the packer for \
                 that device",
                name()
            ))),
            Device::Host => check_host_stream_access(kind),
        }
    }

    /// Element type, device and length of every array; counts and vector-ness.
    fn check_arrays<T: Element, A: Memory<T> + ?Sized>(&self, arrays: &Arrays<'_, A>) -> Result<()> {
        let plan = &self.plan;
        if arrays.x.len() != plan.exchanges_x.len() {
            return Err(Error::invalid(format!(
                "{} arrays given for {} exchanges",
                arrays.x.len(),
                plan.exchanges_x.len()
            )));
        }
        match (&plan.exchanges_y, arrays.y) {
            (None, Some(_)) => return Err(Error::invalid("y arrays given to a packer of scalar quantities")),
            (Some(_), None) => {
                return Err(Error::invalid("a packer of vector quantities needs the y arrays"))
            }
            (Some(ys), Some(ay)) if ys.len() != ay.len() => {
                return Err(Error::invalid(format!(
                    "{} y arrays given for {} y exchanges",
                    ay.len(),
                    ys.len()
                )))
            }
            _ => {}
        }
        let components: &[Component] =
            if arrays.y.is_some() { &[Component::X, Component::Y] } else { &[Component::X] };
        for &component in components {
            for quantity in 0..arrays.x.len() {
                let at = ArrayRef { component, quantity };
                let (array, spec) = (arrays.get(at), plan.exchange(at).spec());
                // Named only on failure: formatting per array and call cost more than a small
                // pack (measured: 34k instructions per call for 40 arrays).
                let name = || format!("{component:?} array {quantity}");
                if !spec.element().accepts::<T>() {
                    return Err(Error::invalid(format!(
                        "{} holds {} but its spec is {:?}",
                        name(),
                        std::any::type_name::<T>(),
                        spec.element()
                    )));
                }
                self.check_reach(array.kind(), name)?;
                let bytes = array.len() * std::mem::size_of::<T>();
                if bytes < spec.required_bytes() {
                    return Err(Error::invalid(format!(
                        "{} has {bytes} bytes but its spec (shape {:?}, strides {:?}) needs {}",
                        name(),
                        spec.shape(),
                        spec.strides(),
                        spec.required_bytes()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Rejects one array passed for two slots with different specs or overlapping regions,
    /// and two arrays sharing memory at different addresses (two handles of one memory: a
    /// wrapper and the buffer it points into), whose regions cannot be compared.
    fn check_unpack_aliasing<A: Sealed + ?Sized>(&mut self, arrays: &Arrays<'_, A>) -> Result<()> {
        let plan = &self.plan;
        let targets: Vec<((usize, usize), ArrayRef)> = plan
            .unpack
            .iter()
            .map(|t| {
                let parts = arrays.get(t.array).raw_parts();
                ((parts.ptr as usize, parts.bytes), t.array)
            })
            .collect();
        let key: Vec<(usize, usize)> = targets.iter().map(|t| t.0).collect();
        if self.unpack_checked.as_ref() == Some(&key) {
            return Ok(());
        }
        for (i, &((addr_a, bytes_a), a)) in targets.iter().enumerate() {
            for &((addr_b, bytes_b), b) in &targets[i + 1..] {
                if addr_a != addr_b {
                    if addr_a < addr_b + bytes_b && addr_b < addr_a + bytes_a {
                        return Err(Error::invalid(format!(
                            "{:?} array {} and {:?} array {} share memory at different addresses: \
                             pass one handle of it",
                            a.component, a.quantity, b.component, b.quantity
                        )));
                    }
                    continue;
                }
                let (ea, eb) = (plan.exchange(a), plan.exchange(b));
                if ea.spec() != eb.spec() {
                    return Err(Error::invalid(format!(
                        "one array is passed as {:?} {} and {:?} {} with different specs",
                        a.component, a.quantity, b.component, b.quantity
                    )));
                }
                if ea.unpack_overlaps(eb) {
                    return Err(Error::invalid(format!(
                        "one array is unpacked twice into overlapping regions {:?} and {:?}",
                        ea.unpack_region(),
                        eb.unpack_region()
                    )));
                }
            }
        }
        self.unpack_checked = Some(key);
        Ok(())
    }
}

/// The arrays of one call.
struct Arrays<'a, A: ?Sized> {
    x: &'a [&'a A],
    y: Option<&'a [&'a A]>,
}

impl<A: ?Sized> Arrays<'_, A> {
    /// The array of a slot; callers checked the counts.
    fn get(&self, at: ArrayRef) -> &A {
        match (at.component, self.y) {
            (Component::Y, Some(ys)) => ys[at.quantity],
            _ => self.x[at.quantity],
        }
    }
}
