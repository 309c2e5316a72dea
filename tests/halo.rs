//! Halo pack/unpack against a plain scalar reference written here, element by element, from
//! the conventions stated in `src/halo/mod.rs` (rotation formula, lone-axis flips, vector rule,
//! pack order), independently of the crate's code.
//!
//! Random layouts (1-wide and non-square shapes, padded and permuted strides, every rotation,
//! lone-axis arrays), scalar and vector quantities of f32/f64/i32 and u8/raw scalars (atoms of
//! 1, 2 and 4 bytes); large exchanges split over the helper threads at every turn; errors for
//! bad specs and arrays; drop safety while work is queued; packers used from several threads
//! at once and from inside a host job; the buffer pool; the seed baseline.
//! Each case runs on the host backend and, with a GPU, on CUDA, where it must also equal the
//! host result bit for bit.

// Regions are one Range per dim, so a one-dim region is a one-element array on purpose.
#![allow(clippy::single_range_in_vec_init)]

mod common;

use std::ops::Range;
use std::time::Duration;

use common::{Gate, Rng};
use cuferry::halo::baseline::SeedBaseline;
use cuferry::halo::{
    Component, DescriptorPlacement, ElementType, HaloExchange, HaloPacker, HaloSpec, HorizontalDims,
    MAX_INLINE_DESCRIPTORS,
};
use cuferry::managed::{ManagedBuffer, ManagedPool, ManagedPoolOptions};
use cuferry::{Device, DeviceBuffer, Element, Error, ForeignBuffer, Memory, PinnedBuffer, Stream};

// ---- the reference ---------------------------------------------------------------------------

/// Values the reference can negate and draw.
trait Val: Element + PartialEq + std::fmt::Debug {
    fn neg(self) -> Self;
    fn random(rng: &mut Rng) -> Self;
}

impl Val for f64 {
    fn neg(self) -> Self {
        -self
    }
    fn random(rng: &mut Rng) -> Self {
        (rng.next_u64() >> 20) as f64 / 1024.0 - 4.0e9
    }
}

impl Val for f32 {
    fn neg(self) -> Self {
        -self
    }
    fn random(rng: &mut Rng) -> Self {
        (rng.next_u64() >> 44) as f32 / 16.0 - 3.0e4
    }
}

impl Val for i32 {
    fn neg(self) -> Self {
        self.wrapping_neg()
    }
    fn random(rng: &mut Rng) -> Self {
        let v = rng.next_u64() as i32;
        if rng.below(50) == 0 {
            i32::MIN
        } else {
            v
        }
    }
}

impl Val for u8 {
    fn neg(self) -> Self {
        self // never asked: vectors of u8 are rejected
    }
    fn random(rng: &mut Rng) -> Self {
        rng.next_u64() as u8
    }
}

/// Raw elements of `N` bytes: the crate moves them as atoms of the largest power of two
/// dividing `N` (4 for 12 bytes, 2 for 6, 1 for 3), several per element.
impl<const N: usize> Val for [u8; N]
where
    [u8; N]: Element,
{
    fn neg(self) -> Self {
        self // never asked: vectors of raw elements are rejected
    }
    fn random(rng: &mut Rng) -> Self {
        let mut v = [0u8; N];
        v.iter_mut().for_each(|b| *b = rng.next_u64() as u8);
        v
    }
}

/// An array layout as the test sees it.
#[derive(Clone, Debug)]
struct Layout {
    shape: Vec<usize>,
    strides: Vec<usize>,
    x: Option<usize>,
    y: Option<usize>,
}

impl Layout {
    fn at(&self, idx: &[usize]) -> usize {
        idx.iter().zip(&self.strides).map(|(i, s)| i * s).sum()
    }

    fn required(&self) -> usize {
        if self.shape.contains(&0) {
            return 0;
        }
        self.shape.iter().zip(&self.strides).map(|(n, s)| (n - 1) * s).sum::<usize>() + 1
    }

    fn spec<T: Element>(&self) -> HaloSpec {
        HaloSpec::new(
            ElementType::of::<T>(),
            &self.shape,
            &self.strides,
            HorizontalDims { x: self.x, y: self.y },
        )
        .unwrap()
    }
}

/// A dense row-major block of values.
#[derive(Clone, Debug, PartialEq)]
struct Block<T> {
    shape: Vec<usize>,
    vals: Vec<T>,
}

/// Calls `f` on every multi-index of `shape` in row-major order.
fn each_index(shape: &[usize], mut f: impl FnMut(&[usize])) {
    if shape.contains(&0) {
        return;
    }
    let mut idx = vec![0usize; shape.len()];
    loop {
        f(&idx);
        let mut d = shape.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

impl<T: Val> Block<T> {
    fn get(&self, idx: &[usize]) -> T {
        let mut flat = 0;
        for (i, n) in idx.iter().zip(&self.shape) {
            flat = flat * n + i;
        }
        self.vals[flat]
    }

    fn extract(layout: &Layout, data: &[T], region: &[Range<usize>]) -> Self {
        let shape: Vec<usize> = region.iter().map(|r| r.len()).collect();
        let mut vals = Vec::new();
        each_index(&shape, |idx| {
            let abs: Vec<usize> = idx.iter().zip(region).map(|(i, r)| r.start + i).collect();
            vals.push(data[layout.at(&abs)]);
        });
        Block { shape, vals }
    }

    fn write(&self, layout: &Layout, data: &mut [T], region: &[Range<usize>]) {
        let shape: Vec<usize> = region.iter().map(|r| r.len()).collect();
        assert_eq!(shape, self.shape, "reference: the block does not fit the region");
        let mut k = 0;
        each_index(&shape, |idx| {
            let abs: Vec<usize> = idx.iter().zip(region).map(|(i, r)| r.start + i).collect();
            data[layout.at(&abs)] = self.vals[k];
            k += 1;
        });
    }

    /// Element (i, j) of the result is element (nx-1-j, i) of `self` (one clockwise turn).
    fn quarter_turn(&self, x: usize, y: usize) -> Self {
        let nx = self.shape[x];
        let mut shape = self.shape.clone();
        shape.swap(x, y);
        let mut vals = Vec::new();
        each_index(&shape, |r| {
            let mut s = r.to_vec();
            s[x] = nx - 1 - r[y];
            s[y] = r[x];
            vals.push(self.get(&s));
        });
        Block { shape, vals }
    }

    fn flip(&self, d: usize) -> Self {
        let n = self.shape[d];
        let mut vals = Vec::new();
        each_index(&self.shape, |r| {
            let mut s = r.to_vec();
            s[d] = n - 1 - r[d];
            vals.push(self.get(&s));
        });
        Block { shape: self.shape.clone(), vals }
    }

    /// k clockwise turns, numpy's lone-axis rule when one horizontal dim is missing.
    fn rotate(&self, x: Option<usize>, y: Option<usize>, k: u32) -> Self {
        match (x, y) {
            (Some(x), Some(y)) => (0..k).fold(self.clone(), |b, _| b.quarter_turn(x, y)),
            (Some(x), None) if k == 1 || k == 2 => self.flip(x),
            (None, Some(y)) if k == 3 || k == 2 => self.flip(y),
            _ => self.clone(),
        }
    }

    fn negated(&self) -> Self {
        Block { shape: self.shape.clone(), vals: self.vals.iter().map(|v| v.neg()).collect() }
    }
}

/// Elements from bytes (copied, so alignment does not matter).
fn from_bytes<T: Element>(bytes: &[u8]) -> Vec<T> {
    let mut out = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(bytes);
    out
}

// ---- random cases ----------------------------------------------------------------------------

/// One quantity: its layout(s), data and exchange.
#[derive(Clone, Debug)]
struct Quantity<T> {
    layout_x: Layout,
    layout_y: Layout,
    src_x: Vec<T>,
    src_y: Vec<T>,
    dst_x: Vec<T>,
    dst_y: Vec<T>,
    pack: Vec<Range<usize>>,
    unpack: Vec<Range<usize>>,
    k: u32,
}

impl Quantity<f64> {
    /// An f64 quantity whose x and y arrays share `layout`, filled with random values.
    fn filled(
        rng: &mut Rng,
        layout: &Layout,
        pack: Vec<Range<usize>>,
        k: u32,
        unpack: Vec<Range<usize>>,
    ) -> Self {
        let mut fill = || (0..layout.required()).map(|_| f64::random(rng)).collect::<Vec<_>>();
        let (src_x, src_y, dst_x, dst_y) = (fill(), fill(), fill(), fill());
        Quantity {
            layout_x: layout.clone(),
            layout_y: layout.clone(),
            src_x,
            src_y,
            dst_x,
            dst_y,
            pack,
            unpack,
            k,
        }
    }
}

fn random_strides(rng: &mut Rng, shape: &[usize]) -> Vec<usize> {
    let nd = shape.len();
    let mut order: Vec<usize> = (0..nd).collect();
    for i in (1..nd).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut strides = vec![0; nd];
    let mut acc = 1 + rng.below(2) * rng.below(3); // sometimes the innermost stride is > 1
    let mut span = 1; // elements from the first to one past the last of the dims so far
    for &d in order.iter().rev() {
        strides[d] = acc;
        span += (shape[d].max(1) - 1) * acc;
        // Sometimes the next dim starts right after this one's last element, inside the gaps
        // of a padded or strided dim below (interleaved rows); else padded or dense.
        acc = if rng.below(4) == 0 { span } else { acc * (shape[d].max(1) + rng.below(3) * rng.below(2)) };
    }
    strides
}

fn random_quantity<T: Val>(rng: &mut Rng, horizontal_always: bool) -> Quantity<T> {
    // 1 to 6 dims (MAX_DIMS); arrays of 5 and 6 dims keep their dims short.
    let nd = 1 + rng.below(6);
    let longest = if nd > 4 { 3 } else { 6 };
    let shape: Vec<usize> = (0..nd).map(|_| 1 + rng.below(longest)).collect();
    let pick = |rng: &mut Rng| rng.below(nd);
    // Now and then an array of any rank with no horizontal dim (turns leave it as it is).
    let no_horizontal = !horizontal_always && nd > 1 && rng.below(10) == 0;
    let (x, y) = match (nd, rng.below(6)) {
        _ if no_horizontal => (None, None),
        (1, 0) if !horizontal_always => (None, None),
        (1, c) => {
            if c % 2 == 0 {
                (Some(0), None)
            } else {
                (None, Some(0))
            }
        }
        (_, 0) => (Some(pick(rng)), None),
        (_, 1) => (None, Some(pick(rng))),
        _ => {
            let a = pick(rng);
            let b = (a + 1 + rng.below(nd - 1)) % nd;
            (Some(a), Some(b))
        }
    };
    let layout_x = Layout { shape: shape.clone(), strides: random_strides(rng, &shape), x, y };
    let layout_y = Layout { shape: shape.clone(), strides: random_strides(rng, &shape), x, y };
    let k = rng.below(4) as u32;
    let both = x.zip(y);
    let mut pack = Vec::new();
    let mut ext = Vec::new();
    for (d, &n) in shape.iter().enumerate() {
        let limit = match both {
            Some((a, b)) if d == a || d == b => shape[a].min(shape[b]),
            _ => n,
        };
        let e = if rng.below(20) == 0 { 0 } else { 1 + rng.below(limit) };
        let s = rng.below(n - e + 1);
        pack.push(s..s + e);
        ext.push(e);
    }
    if let (Some((a, b)), 1 | 3) = (both, k) {
        ext.swap(a, b);
    }
    let unpack: Vec<Range<usize>> = ext
        .iter()
        .zip(&shape)
        .map(|(&e, &n)| {
            let s = rng.below(n - e + 1);
            s..s + e
        })
        .collect();
    let fill = |rng: &mut Rng, l: &Layout| (0..l.required()).map(|_| T::random(rng)).collect::<Vec<T>>();
    Quantity {
        src_x: fill(rng, &layout_x),
        src_y: fill(rng, &layout_y),
        dst_x: fill(rng, &layout_x),
        dst_y: fill(rng, &layout_y),
        layout_x,
        layout_y,
        pack,
        unpack,
        k,
    }
}

/// The reference pack buffer and the reference destinations after unpacking it.
fn reference<T: Val>(qs: &[Quantity<T>], vector: bool) -> (Vec<T>, Vec<Vec<T>>, Vec<Vec<T>>) {
    let mut packed = Vec::new();
    let (mut out_x, mut out_y) = (Vec::new(), Vec::new());
    for q in qs {
        let (x, y) = (q.layout_x.x, q.layout_x.y);
        let u = Block::extract(&q.layout_x, &q.src_x, &q.pack).rotate(x, y, q.k);
        let (slot_x, slot_y) = if vector {
            let v = Block::extract(&q.layout_y, &q.src_y, &q.pack).rotate(x, y, q.k);
            match q.k {
                0 => (u, Some(v)),
                1 => (v, Some(u.negated())),
                2 => (u.negated(), Some(v.negated())),
                _ => (v.negated(), Some(u)),
            }
        } else {
            (u, None)
        };
        let mut dx = q.dst_x.clone();
        let unpack_shape: Vec<usize> = q.unpack.iter().map(|r| r.len()).collect();
        Block { shape: unpack_shape.clone(), vals: slot_x.vals.clone() }.write(
            &q.layout_x,
            &mut dx,
            &q.unpack,
        );
        packed.extend_from_slice(&slot_x.vals);
        out_x.push(dx);
        if let Some(sy) = slot_y {
            let mut dy = q.dst_y.clone();
            Block { shape: unpack_shape, vals: sy.vals.clone() }.write(&q.layout_y, &mut dy, &q.unpack);
            packed.extend_from_slice(&sy.vals);
            out_y.push(dy);
        }
    }
    (packed, out_x, out_y)
}

/// What the crate produced: the pack buffer and the destinations.
#[derive(Debug, PartialEq)]
struct Outcome<T> {
    packed: Vec<u8>,
    dst_x: Vec<Vec<T>>,
    dst_y: Vec<Vec<T>>,
}

/// Where `run_crate` puts the arrays.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Placing {
    /// Every array a `DeviceBuffer`.
    Device,
    /// Arrays in turn in device, managed, (host backend only) pinned and wrapped memory (a
    /// `ForeignBuffer` over a `Vec` on the host, over a device allocation on CUDA), passed to
    /// the packer together as `&dyn Memory<T>`.
    Mixed,
}

/// Memory a `ForeignBuffer` wraps: a `Vec` on the host, a device allocation on CUDA (standing
/// in for another library's).
enum Owner<T: Element> {
    Host(Vec<T>),
    Device(DeviceBuffer<T>),
}

/// One array of `run_crate`, in the memory `Placing` chose.
enum Array<T: Element> {
    Device(DeviceBuffer<T>),
    Managed(ManagedBuffer<T>),
    Pinned(PinnedBuffer<T>),
    /// The wrapper is dropped (waiting for its uses) before the memory it wraps.
    Foreign(ForeignBuffer<T>, Owner<T>),
}

impl<T: Element> Array<T> {
    /// `data` in memory of kind `k` (0 device, 1 managed, 2 pinned, 3 wrapped) for `stream`'s
    /// device.
    fn new(stream: &Stream, pool: Option<&ManagedPool>, k: usize, data: &[T]) -> Self {
        match (k, pool) {
            (1, Some(pool)) => {
                let mut m = pool.alloc::<T>(data.len().max(1), stream).unwrap();
                m.as_mut_slice().unwrap()[..data.len()].copy_from_slice(data);
                Array::Managed(m)
            }
            (2, _) => Array::Pinned(PinnedBuffer::from_slice(stream.device(), data).unwrap()),
            (3, _) => {
                let mut owner = match stream.device() {
                    Device::Host => Owner::Host(data.to_vec()),
                    Device::Cuda(_) => {
                        let d = DeviceBuffer::from_slice(stream, data).unwrap();
                        d.synchronize().unwrap(); // the wrapper's tracker does not see the upload
                        Owner::Device(d)
                    }
                };
                let (ptr, len) = match &mut owner {
                    Owner::Host(v) => (v.as_mut_ptr(), v.len()),
                    Owner::Device(d) => (d.as_mut_ptr(), d.len()),
                };
                // SAFETY: the owner lives in the same variant, after the wrapper, so it is
                // dropped only once the wrapper has waited for its uses; nothing else touches
                // the memory until then (`read` synchronizes the wrapper first).
                let wrapped = unsafe { ForeignBuffer::wrap(stream.device(), ptr, len) }.unwrap();
                Array::Foreign(wrapped, owner)
            }
            _ => Array::Device(DeviceBuffer::from_slice(stream, data).unwrap()),
        }
    }

    fn memory(&self) -> &dyn Memory<T> {
        match self {
            Array::Device(d) => d,
            Array::Managed(m) => m,
            Array::Pinned(p) => p,
            Array::Foreign(w, _) => w,
        }
    }

    /// The first `len` elements, read after the queued work on them.
    fn read(&self, stream: &Stream, len: usize) -> Vec<T> {
        match self {
            Array::Device(d) => d.to_vec(stream).unwrap(),
            Array::Managed(m) => m.as_slice().unwrap()[..len].to_vec(),
            Array::Pinned(p) => p.as_slice().unwrap().to_vec(),
            Array::Foreign(w, owner) => {
                w.synchronize().unwrap();
                match owner {
                    Owner::Host(v) => v.clone(),
                    Owner::Device(d) => d.to_vec(stream).unwrap(),
                }
            }
        }
    }
}

/// Packs and unpacks `qs` with the crate on `device`, the CUDA kernel reading its descriptors
/// from `placement`, a host packer using `host_threads` threads when given, the arrays placed
/// as `placing` says.
fn run_crate<T: Val>(
    device: Device,
    qs: &[Quantity<T>],
    vector: bool,
    placement: DescriptorPlacement,
    host_threads: Option<usize>,
    placing: Placing,
) -> Outcome<T> {
    let ex_x: Vec<HaloExchange> = qs
        .iter()
        .map(|q| HaloExchange::new(&q.layout_x.spec::<T>(), &q.pack, q.k, &q.unpack).unwrap())
        .collect();
    let ex_y: Vec<HaloExchange> = qs
        .iter()
        .map(|q| HaloExchange::new(&q.layout_y.spec::<T>(), &q.pack, q.k, &q.unpack).unwrap())
        .collect();
    let mut packer = HaloPacker::new(device, &ex_x, vector.then_some(&ex_y[..])).unwrap();
    packer.set_descriptor_placement(placement).unwrap();
    if let Some(threads) = host_threads {
        packer.set_host_threads(threads);
        if device.is_host() && packer.buffer_bytes() > 4 << 20 {
            // The large cases split over every thread asked for (one per 128 KiB past 512 KiB).
            assert_eq!(packer.host_job_threads(), threads.min(16), "the job is not split as asked");
        }
    }
    assert_eq!(packer.launches_per_call(), usize::from(packer.buffer_bytes() > 0));
    let stream = packer.stream().clone();
    let pool =
        (placing == Placing::Mixed).then(|| ManagedPool::new(device, ManagedPoolOptions::default()).unwrap());
    // Pinned memory (2) is out of a CUDA kernel's reach.
    let kinds: &[usize] = if device.is_host() { &[0, 1, 2, 3] } else { &[0, 1, 3] };
    // List `arrays` takes the kinds in turn from the `first`: the destinations start two
    // kinds on from the sources, the y arrays one more, so that one- and two-quantity cases
    // reach the later kinds too.
    let place = |first: usize, arrays: &mut dyn Iterator<Item = &Vec<T>>| -> Vec<Array<T>> {
        let kind = |i: usize| if placing == Placing::Mixed { kinds[(first + i) % kinds.len()] } else { 0 };
        arrays.enumerate().map(|(i, v)| Array::new(&stream, pool.as_ref(), kind(i), v)).collect()
    };
    let src_x = place(0, &mut qs.iter().map(|q| &q.src_x));
    let src_y = place(1, &mut qs.iter().map(|q| &q.src_y));
    let dst_x = place(2, &mut qs.iter().map(|q| &q.dst_x));
    let dst_y = place(3, &mut qs.iter().map(|q| &q.dst_y));
    fn refs<T: Element>(v: &[Array<T>]) -> Vec<&dyn Memory<T>> {
        v.iter().map(Array::memory).collect()
    }
    let (sx, sy, dx, dy) = (refs(&src_x), refs(&src_y), refs(&dst_x), refs(&dst_y));
    packer.pack(&sx, vector.then_some(&sy[..])).unwrap();
    let packed = packer.pack_buffer().unwrap().to_vec(&stream).unwrap();
    packer.copy_pack_to_unpack().unwrap();
    // SAFETY: no host view of an array is used before the reads below, which wait for the
    // unpack through the arrays' trackers (`to_vec`, `as_slice`).
    unsafe { packer.unpack_unchecked(&dx, vector.then_some(&dy[..])) }.unwrap();
    // No synchronize: reading the arrays is ordered after the unpack by their trackers.
    let down = |v: &[Array<T>], lens: &mut dyn Iterator<Item = usize>| {
        v.iter().zip(lens).map(|(a, len)| a.read(&stream, len)).collect::<Vec<_>>()
    };
    let dst_x = down(&dst_x, &mut qs.iter().map(|q| q.dst_x.len()));
    let dst_y = if vector { down(&dst_y, &mut qs.iter().map(|q| q.dst_y.len())) } else { Vec::new() };
    let out = Outcome { packed, dst_x, dst_y };
    assert!(packer.ready().unwrap());
    out
}

/// Checks the crate against the reference on the host, and on CUDA (bit for bit equal to the
/// host) when a device is present.
fn check_case<T: Val>(qs: &[Quantity<T>], vector: bool) {
    let (packed, ref_x, ref_y) = reference(qs, vector);
    let host = run_crate(Device::Host, qs, vector, DescriptorPlacement::DeviceMemory, None, Placing::Device);
    assert_eq!(
        host.packed,
        bytemuck::cast_slice::<T, u8>(&packed),
        "pack buffer differs from the reference: {qs:?}"
    );
    assert_eq!(host.dst_x, ref_x, "unpacked x arrays differ from the reference");
    assert_eq!(host.dst_y, ref_y, "unpacked y arrays differ from the reference");
    if let Some(gpu) = common::cuda_device() {
        for placement in [DescriptorPlacement::DeviceMemory, DescriptorPlacement::LaunchParameters] {
            let cuda = run_crate(gpu, qs, vector, placement, None, Placing::Device);
            assert_eq!(cuda, host, "CUDA ({placement:?}) and host results differ");
        }
    }
}

/// As `check_case`, with the arrays in device, managed and (host) pinned memory in one call:
/// the same bytes as the reference on the host and, bit for bit, on CUDA.
fn check_case_in_mixed_memory<T: Val>(qs: &[Quantity<T>], vector: bool) {
    let (packed, ref_x, ref_y) = reference(qs, vector);
    let host = run_crate(Device::Host, qs, vector, DescriptorPlacement::DeviceMemory, None, Placing::Mixed);
    assert_eq!(host.packed, bytemuck::cast_slice::<T, u8>(&packed), "mixed memory: pack buffer differs");
    assert_eq!(
        (host.dst_x.as_slice(), host.dst_y.as_slice()),
        (&ref_x[..], &ref_y[..]),
        "mixed memory: unpack differs"
    );
    if let Some(gpu) = common::cuda_device() {
        let cuda = run_crate(gpu, qs, vector, DescriptorPlacement::DeviceMemory, None, Placing::Mixed);
        assert_eq!(cuda, host, "CUDA and host results differ with the arrays in mixed memory");
    }
}

fn random_cases<T: Val>(seed: u64, cases: usize, vector: bool) {
    random_cases_checked(seed, cases, vector, check_case::<T>);
}

/// `cases` random exchange sets of one to three quantities, each given to `check`.
fn random_cases_checked<T: Val>(seed: u64, cases: usize, vector: bool, check: fn(&[Quantity<T>], bool)) {
    let mut rng = Rng::new(seed);
    for _ in 0..cases {
        let n = 1 + rng.below(3);
        let qs: Vec<Quantity<T>> = (0..n).map(|_| random_quantity(&mut rng, false)).collect();
        check(&qs, vector);
    }
}

/// Arrays need not be device buffers: managed and (host) pinned memory, mixed in one call,
/// pack and unpack as the reference says.
#[test]
fn scalar_f64_arrays_in_mixed_memory() {
    random_cases_checked::<f64>(0x3a11, 24, false, check_case_in_mixed_memory);
}

#[test]
fn vector_f32_arrays_in_mixed_memory() {
    random_cases_checked::<f32>(0x3a12, 24, true, check_case_in_mixed_memory);
}

// ---- scalar and vector quantities ------------------------------------------------------------

#[test]
fn scalar_f64_random_layouts() {
    random_cases::<f64>(1, 150, false);
}

#[test]
fn scalar_f32_random_layouts() {
    random_cases::<f32>(2, 150, false);
}

#[test]
fn scalar_i32_random_layouts() {
    random_cases::<i32>(3, 100, false);
}

#[test]
fn scalar_u8_random_layouts() {
    random_cases::<u8>(4, 100, false);
}

#[test]
fn scalar_raw_12_byte_random_layouts() {
    random_cases::<[u8; 12]>(5, 100, false);
}

#[test]
fn scalar_raw_6_byte_random_layouts() {
    random_cases::<[u8; 6]>(21, 60, false);
}

#[test]
fn scalar_raw_3_byte_random_layouts() {
    random_cases::<[u8; 3]>(22, 60, false);
}

#[test]
fn vector_f64_random_layouts() {
    random_cases::<f64>(6, 150, true);
}

#[test]
fn vector_f32_random_layouts() {
    random_cases::<f32>(7, 150, true);
}

#[test]
fn vector_i32_random_layouts() {
    random_cases::<i32>(8, 100, true);
}

/// Every rotation of a 3 x 4 non-square block, scalar and vector, one by one.
#[test]
fn every_rotation_of_a_non_square_block() {
    let mut rng = Rng::new(9);
    for k in 0..4u32 {
        for vector in [false, true] {
            let layout = Layout { shape: vec![2, 6, 7], strides: vec![64, 9, 1], x: Some(2), y: Some(1) };
            let unpack = if k % 2 == 1 { vec![0..2, 2..6, 1..4] } else { vec![0..2, 1..4, 3..7] };
            let q = Quantity::filled(&mut rng, &layout, vec![0..2, 2..5, 1..5], k, unpack);
            check_case(&[q], vector);
        }
    }
}

/// f32 regions whose access units are 4 bytes (x-faces 3 columns wide), 16 (whole rows) and
/// 8 (x-faces 2 columns wide, 16 bytes into each row), few enough units for one block of the
/// CUDA kernel: the block passes between unit sizes, whose shared-memory stage bytes belong to
/// different threads (the GPU bundle runs this test under racecheck).
#[test]
fn units_of_several_sizes_in_one_block() {
    let mut rng = Rng::new(12);
    let layout = Layout { shape: vec![2, 12, 12], strides: vec![144, 12, 1], x: Some(2), y: Some(1) };
    let regions = [
        (vec![0..2, 0..12, 0..3], vec![0..2, 0..12, 9..12]),
        (vec![0..2, 0..3, 0..12], vec![0..2, 9..12, 0..12]),
        (vec![0..2, 0..12, 4..6], vec![0..2, 0..12, 6..8]),
    ];
    for vector in [false, true] {
        let mut fill = || (0..layout.required()).map(|_| f32::random(&mut rng)).collect::<Vec<_>>();
        let qs: Vec<Quantity<f32>> = regions
            .iter()
            .map(|(pack, unpack)| Quantity {
                layout_x: layout.clone(),
                layout_y: layout.clone(),
                src_x: fill(),
                src_y: fill(),
                dst_x: fill(),
                dst_y: fill(),
                pack: pack.clone(),
                unpack: unpack.clone(),
                k: 0,
            })
            .collect();
        check_case(&qs, vector);
    }
}

/// The reference itself, checked on numbers worked out by hand: a 3 (x) by 2 (y) block
/// stored as (y, x), values 10 y + x.
#[test]
fn the_reference_turns_clockwise() {
    let b = Block { shape: vec![2, 3], vals: vec![0.0f64, 1.0, 2.0, 10.0, 11.0, 12.0] };
    // Clockwise: the west column (x = 0: 0 at the south, 10 at the north) becomes the north
    // row read west to east as 0, 10; the result is 2 (x) by 3 (y).
    let r = b.rotate(Some(1), Some(0), 1);
    assert_eq!(r.shape, vec![3, 2]);
    assert_eq!(r.vals, vec![2.0, 12.0, 1.0, 11.0, 0.0, 10.0]);
    assert_eq!(b.rotate(Some(1), Some(0), 2).vals, vec![12.0, 11.0, 10.0, 2.0, 1.0, 0.0]);
    assert_eq!(b.rotate(Some(1), Some(0), 3).vals, vec![10.0, 0.0, 11.0, 1.0, 12.0, 2.0]);
    assert_eq!(b.rotate(Some(1), Some(0), 4).vals, b.vals);
}

/// Lone-axis arrays: the x-only array flips at k = 1, 2; the y-only one at k = 2, 3.
#[test]
fn lone_axis_arrays_flip_like_numpy() {
    let stream = Stream::new(Device::Host).unwrap();
    let data: Vec<i32> = (0..8).collect(); // (z, h) = (2, 4), h the lone axis
    for (dims, flips) in [
        (HorizontalDims::x_only(1), [false, true, true, false]),
        (HorizontalDims::y_only(1), [false, false, true, true]),
    ] {
        let spec = HaloSpec::contiguous(ElementType::I32, &[2, 4], dims).unwrap();
        for k in 0..4u32 {
            let ex = HaloExchange::new(&spec, &[0..2, 0..3], k, &[0..2, 1..4]).unwrap();
            let mut packer = HaloPacker::new(Device::Host, &[ex], None).unwrap();
            let a = DeviceBuffer::from_slice(&stream, &data).unwrap();
            packer.pack(&[&a], None).unwrap();
            let packed: Vec<i32> = from_bytes(&packer.pack_buffer().unwrap().to_vec(&stream).unwrap());
            let expect = if flips[k as usize] { vec![2, 1, 0, 6, 5, 4] } else { vec![0, 1, 2, 4, 5, 6] };
            assert_eq!(packed, expect, "{dims:?} k={k}");
        }
    }
}

/// Several quantities in one buffer, mixed layouts, in the given order; slots report it.
#[test]
fn slots_follow_the_pack_order() {
    let mut rng = Rng::new(10);
    let qs: Vec<Quantity<f32>> = (0..4).map(|_| random_quantity(&mut rng, true)).collect();
    let ex: Vec<HaloExchange> = qs
        .iter()
        .map(|q| HaloExchange::new(&q.layout_x.spec::<f32>(), &q.pack, q.k, &q.unpack).unwrap())
        .collect();
    let packer = HaloPacker::new(Device::Host, &ex, Some(&ex)).unwrap();
    let mut offset = 0;
    for (i, slot) in packer.slots().iter().enumerate() {
        assert_eq!(
            (slot.quantity, slot.component),
            (i / 2, if i % 2 == 0 { Component::X } else { Component::Y })
        );
        assert_eq!(slot.offset, offset);
        assert_eq!(slot.bytes, ex[i / 2].elements() * 4);
        offset += slot.bytes;
    }
    assert_eq!(packer.buffer_bytes(), offset);
    check_case(&qs, true);
}

/// `check_case` for scalars and vectors, then the host path with its work split over 2, 3, 5
/// and 16 threads (whatever the machine's core count) against the reference.
fn check_over_thread_counts(qs: &[Quantity<f64>]) {
    for vector in [false, true] {
        check_case(qs, vector);
        let (packed, ref_x, ref_y) = reference(qs, vector);
        for threads in [2, 3, 5, 16] {
            let got = run_crate(
                Device::Host,
                qs,
                vector,
                DescriptorPlacement::DeviceMemory,
                Some(threads),
                Placing::Device,
            );
            assert!(got.packed == bytemuck::cast_slice::<f64, u8>(&packed), "{threads} threads: pack buffer");
            assert!(got.dst_x == ref_x && got.dst_y == ref_y, "{threads} threads: unpacked arrays");
        }
    }
}

/// More than 4 MiB (the host threads jobs above 512 KiB): the work is split over the helper
/// threads, rows cut in the middle included, with 2, 3, 5 and 16 threads whatever the
/// machine's core count (the default budget is the core count: one on a one-core runner).
#[test]
fn large_exchange_uses_threads_and_stays_exact() {
    let mut rng = Rng::new(11);
    let layout =
        Layout { shape: vec![20, 150, 151], strides: vec![152 * 151, 152, 1], x: Some(2), y: Some(1) };
    let mut qs = Vec::new();
    for k in [0u32, 1] {
        let unpack = if k == 1 { vec![0..20, 3..150, 0..150] } else { vec![0..20, 0..150, 1..148] };
        qs.push(Quantity::filled(&mut rng, &layout, vec![0..20, 0..150, 2..149], k, unpack));
    }
    check_over_thread_counts(&qs);
}

/// `host_job_threads` follows the documented rule: one thread up to 512 KiB, then one per
/// 128 KiB up to the budget (the halo bench splits its threaded memcpy by it).
#[test]
fn host_job_threads_follow_the_byte_rule() {
    let spec = HaloSpec::contiguous(ElementType::U8, &[4 << 20], HorizontalDims::none()).unwrap();
    for (bytes, budget, threads) in [
        (1usize, 16usize, 1usize),
        (512 << 10, 16, 1),
        ((512 << 10) + 1, 16, 4),
        ((512 << 10) + 1, 3, 3),
        (1_820_160, 16, 13),
        (1_820_160, 4, 4),
        (1_820_160, 1, 1),
        (4 << 20, 64, 16),
    ] {
        let ex = HaloExchange::new(&spec, &[0..bytes], 0, &[0..bytes]).unwrap();
        let mut packer = HaloPacker::new(Device::Host, &[ex], None).unwrap();
        packer.set_host_threads(budget);
        assert_eq!(packer.host_job_threads(), threads, "{bytes} bytes, budget {budget}");
    }
}

/// The threaded split of turned exchanges (a half turn reverses every horizontal run, a
/// three-quarter turn transposes and flips): more than 4 MiB turned by 2 and 3, cut between
/// 2, 3, 5 and 16 threads (so parts start in the middle of rows and of transposed panels,
/// whatever the machine's core count), stays exact. 31 levels of 147 x 146 f64: 5.3 MB.
#[test]
fn large_exchanges_turned_by_two_and_three_use_threads_and_stay_exact() {
    let mut rng = Rng::new(12);
    let layout =
        Layout { shape: vec![19, 149, 151], strides: vec![150 * 153, 153, 1], x: Some(2), y: Some(1) };
    // Pack levels by 147 y by 146 x; a half turn keeps that shape, a three-quarter turn swaps
    // the horizontal extents. Unequal level counts keep the cuts off the transfers' ends.
    let cases = [
        (2u32, vec![0..19, 2..149, 0..146], vec![0..19, 1..148, 5..151]),
        (3, vec![3..15, 2..149, 0..146], vec![4..16, 0..146, 3..150]),
    ];
    let qs: Vec<Quantity<f64>> = cases
        .into_iter()
        .map(|(k, pack, unpack)| Quantity::filled(&mut rng, &layout, pack, k, unpack))
        .collect();
    check_over_thread_counts(&qs);
}

// ---- the seed baseline -----------------------------------------------------------------------

/// The seed strategy (index arrays, one gather per exchange) packs the same bytes.
#[test]
fn seed_baseline_packs_the_same_bytes() {
    let mut rng = Rng::new(12);
    for _ in 0..30 {
        let qs: Vec<Quantity<f64>> = (0..3).map(|_| random_quantity(&mut rng, false)).collect();
        let (packed, _, _) = reference(&qs, false);
        let ex: Vec<HaloExchange> = qs
            .iter()
            .map(|q| HaloExchange::new(&q.layout_x.spec::<f64>(), &q.pack, q.k, &q.unpack).unwrap())
            .collect();
        let mut devices = vec![Device::Host];
        devices.extend(common::cuda_device());
        for device in devices {
            let stream = Stream::new(device).unwrap();
            let mut seed = SeedBaseline::new(&stream, &ex).unwrap();
            let src: Vec<DeviceBuffer<f64>> =
                qs.iter().map(|q| DeviceBuffer::from_slice(&stream, &q.src_x).unwrap()).collect();
            seed.pack(&src.iter().collect::<Vec<_>>()).unwrap();
            assert_eq!(
                seed.packed().unwrap().to_vec(&stream).unwrap(),
                bytemuck::cast_slice::<f64, u8>(&packed)
            );
        }
    }
}

/// The benchmark's cubed-sphere case (10 arrays of 48 x 48 x 79 f64 with a halo of 3, all four
/// edges) packed once by the packer and once by the seed strategy, on every device, against a
/// scalar loop over the edges. On CUDA the GPU bundle runs this test under Nsight Compute and
/// counts the kernels it launched (scripts/gpu-run.sh, `ncu:halo_launches`): one `halo_kernel`
/// for the pack, 40 `seed_gather_kernel`s for the seed. Keep the test to one pack and one seed
/// pack, or update that count.
#[test]
fn ten_arrays_of_edges_pack_in_one_launch() {
    const N: usize = 48;
    const H: usize = 3;
    const Z: usize = 79;
    const W: usize = N + 2 * H;
    let layout = Layout { shape: vec![Z, W, W], strides: vec![W * W, W, 1], x: Some(2), y: Some(1) };
    let spec = layout.spec::<f64>();
    // (y range, x range) packed per edge, each into the opposite halo: west, east, south, north.
    let edges = [(H..H + N, H..2 * H), (H..H + N, N..N + H), (H..2 * H, H..H + N), (N..N + H, H..H + N)];
    let halo_of = |r: &Range<usize>| {
        if r.start == H && r.len() == H {
            N + H..W
        } else if r.len() == H {
            0..H
        } else {
            r.clone()
        }
    };
    let mut rng = Rng::new(40);
    let arrays: Vec<Vec<f64>> =
        (0..10).map(|_| (0..Z * W * W).map(|_| f64::random(&mut rng)).collect()).collect();
    let mut exchanges = Vec::new();
    let mut expected: Vec<f64> = Vec::new();
    for a in &arrays {
        for (ys, xs) in &edges {
            exchanges.push(
                HaloExchange::new(
                    &spec,
                    &[0..Z, ys.clone(), xs.clone()],
                    0,
                    &[0..Z, halo_of(ys), halo_of(xs)],
                )
                .unwrap(),
            );
            for z in 0..Z {
                for y in ys.clone() {
                    for x in xs.clone() {
                        expected.push(a[(z * W + y) * W + x]);
                    }
                }
            }
        }
    }
    let mut devices = vec![Device::Host];
    devices.extend(common::cuda_device());
    for device in devices {
        let stream = Stream::new(device).unwrap();
        let bufs: Vec<DeviceBuffer<f64>> =
            arrays.iter().map(|a| DeviceBuffer::from_slice(&stream, a).unwrap()).collect();
        let list: Vec<&DeviceBuffer<f64>> = (0..exchanges.len()).map(|i| &bufs[i / edges.len()]).collect();
        let mut packer = HaloPacker::with_stream(&stream, &exchanges, None).unwrap();
        assert_eq!(packer.launches_per_call(), 1);
        packer.pack(&list, None).unwrap();
        let packed = packer.pack_buffer().unwrap().to_vec(&stream).unwrap();
        assert_eq!(from_bytes::<f64>(&packed), expected, "packer on {device}");
        let mut seed = SeedBaseline::new(&stream, &exchanges).unwrap();
        seed.pack(&list).unwrap();
        assert_eq!(seed.launches_per_pack(), 40);
        let seed_packed = seed.packed().unwrap().to_vec(&stream).unwrap();
        assert_eq!(from_bytes::<f64>(&seed_packed), expected, "seed strategy on {device}");
    }
}

/// Descriptors in the launch's parameters: a packer switched back and forth between the two
/// placements packs the same bytes each time (the device table is uploaded when first needed),
/// and more regions than the parameters hold are refused, leaving the placement as it was.
#[test]
fn descriptor_placements_switch_and_the_parameter_limit_is_checked() {
    let Some(device) = common::cuda_device() else { return };
    let q = one_quantity(41, [4, 9, 9]);
    let (packed, _, _) = reference(std::slice::from_ref(&q), false);
    let stream = Stream::new(device).unwrap();
    let mut packer = HaloPacker::with_stream(&stream, &[exchange_of(&q)], None).unwrap();
    let a = DeviceBuffer::from_slice(&stream, &q.src_x).unwrap();
    for placement in [
        DescriptorPlacement::LaunchParameters,
        DescriptorPlacement::DeviceMemory,
        DescriptorPlacement::LaunchParameters,
    ] {
        packer.set_descriptor_placement(placement).unwrap();
        assert_eq!(packer.descriptor_placement(), placement);
        packer.pack(&[&a], None).unwrap();
        let got = packer.pack_buffer().unwrap().to_vec(&stream).unwrap();
        assert_eq!(got, bytemuck::cast_slice::<f64, u8>(&packed), "{placement:?}");
    }
    let many: Vec<HaloExchange> = (0..=MAX_INLINE_DESCRIPTORS).map(|_| exchange_of(&q)).collect();
    let mut big = HaloPacker::with_stream(&stream, &many, None).unwrap();
    assert_invalid(big.set_descriptor_placement(DescriptorPlacement::LaunchParameters), "too many regions");
    assert_eq!(big.descriptor_placement(), DescriptorPlacement::DeviceMemory);
}

/// Tables of every parameter capacity (the kernels for up to 8, 16, 32 and 64 descriptors,
/// and each block's first descriptor computed on the host): 8 to 64 regions, every third one
/// large enough that a launch has tens of blocks starting in different descriptors, pack and
/// unpack equal to the reference on the host and, bit for bit, to the host on CUDA with the
/// descriptors in device memory and in the launch's parameters.
#[test]
fn launch_parameter_tables_of_every_capacity_match_the_reference() {
    let gpu = common::cuda_device().is_some();
    let mut rng = Rng::new(77);
    for regions in [8, 9, 16, 17, 32, 33, MAX_INLINE_DESCRIPTORS] {
        let qs: Vec<Quantity<f64>> = (0..regions)
            .map(|i| {
                if i % 3 == 0 {
                    one_quantity(1000 + i as u64, [6, 96 + i % 5, 96])
                } else {
                    random_quantity(&mut rng, false)
                }
            })
            .collect();
        check_case(&qs, false);
    }
    if !gpu {
        println!("(host only: the launch-parameter kernels need a GPU)");
    }
}

/// More descriptors than a block's threads (256): with the table in device memory the kernel
/// finds each block's first descriptor on the device, in rounds of 256 (launch parameters
/// hold at most 64, and there the host computes it). 300 regions, every seventh large enough
/// that blocks start in descriptors past the first round: pack and unpack equal the reference
/// on the host and, bit for bit, the host on CUDA.
#[test]
fn tables_longer_than_a_block_find_their_first_descriptor_on_the_device() {
    let mut rng = Rng::new(78);
    let qs: Vec<Quantity<f64>> = (0..300)
        .map(|i| {
            if i % 7 == 6 {
                one_quantity(2000 + i as u64, [4, 64 + i % 5, 64])
            } else {
                random_quantity(&mut rng, false)
            }
        })
        .collect();
    check_case(&qs, false);
}

/// x-faces (24-byte runs at a 3120-byte pitch) pack the same bytes whatever the device's L2
/// fetch granularity, a hint that changes only the DRAM traffic. The GPU bundle's
/// `ncu:halo_xface_dram` step runs this test under Nsight Compute and reports the DRAM bytes
/// each pack read: the first at the device's default granularity, the second at 32 bytes.
#[test]
fn x_faces_pack_the_same_at_every_l2_fetch_granularity() {
    let Some(device) = common::cuda_device() else { return };
    const N: usize = 384;
    const H: usize = 3;
    const Z: usize = 79;
    const W: usize = N + 2 * H;
    let layout = Layout { shape: vec![Z, W, W], strides: vec![W * W, W, 1], x: Some(2), y: Some(1) };
    let spec = layout.spec::<f64>();
    let mut rng = Rng::new(42);
    let arrays: Vec<Vec<f64>> =
        (0..2).map(|_| (0..Z * W * W).map(|_| f64::random(&mut rng)).collect()).collect();
    // West and east interior columns, each into the opposite halo.
    let faces = [(H..2 * H, N + H..W), (N..N + H, 0..H)];
    let mut exchanges = Vec::new();
    let mut expected: Vec<f64> = Vec::new();
    for a in &arrays {
        for (xs, halo) in &faces {
            let region = [0..Z, H..H + N, xs.clone()];
            exchanges.push(HaloExchange::new(&spec, &region, 0, &[0..Z, H..H + N, halo.clone()]).unwrap());
            for z in 0..Z {
                for y in H..H + N {
                    for x in xs.clone() {
                        expected.push(a[(z * W + y) * W + x]);
                    }
                }
            }
        }
    }
    let stream = Stream::new(device).unwrap();
    let bufs: Vec<DeviceBuffer<f64>> =
        arrays.iter().map(|a| DeviceBuffer::from_slice(&stream, a).unwrap()).collect();
    let list: Vec<&DeviceBuffer<f64>> = (0..exchanges.len()).map(|i| &bufs[i / faces.len()]).collect();
    let mut packer = HaloPacker::with_stream(&stream, &exchanges, None).unwrap();
    let default = device.l2_fetch_granularity().unwrap();
    for bytes in [default, 32] {
        // Put back on drop, a failed assertion included; a refused setting packs at the default.
        let setting = common::L2FetchSetting::set(device, bytes);
        let applied = setting.as_ref().map_or(default, |s| s.applied);
        packer.pack(&list, None).unwrap();
        let packed = packer.pack_buffer().unwrap().to_vec(&stream).unwrap();
        println!("packed at an L2 fetch granularity of {applied} bytes");
        assert_eq!(from_bytes::<f64>(&packed), expected, "L2 fetch granularity {applied}");
    }
}

// ---- errors ----------------------------------------------------------------------------------

fn assert_invalid<T: std::fmt::Debug>(r: Result<T, Error>, what: &str) {
    match r {
        Err(Error::InvalidArgument { .. }) => {}
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn bad_specs_are_invalid_arguments() {
    let xy = HorizontalDims::xy(0, 1);
    assert_invalid(HaloSpec::new(ElementType::F64, &[], &[], HorizontalDims::none()), "no dims");
    assert_invalid(HaloSpec::new(ElementType::F64, &[2; 7], &[1; 7], xy), "7 dims");
    assert_invalid(HaloSpec::new(ElementType::F64, &[2, 2], &[1], xy), "stride count");
    assert_invalid(
        HaloSpec::new(ElementType::F64, &[2, 2], &[2, 1], HorizontalDims::xy(0, 2)),
        "y out of range",
    );
    assert_invalid(HaloSpec::new(ElementType::F64, &[2, 2], &[2, 1], HorizontalDims::xy(1, 1)), "x == y");
    assert_invalid(HaloSpec::new(ElementType::F64, &[4, 4], &[1, 1], xy), "overlapping dims");
    assert_invalid(HaloSpec::new(ElementType::F64, &[4, 4], &[3, 1], xy), "rows overlap");
    assert_invalid(HaloSpec::new(ElementType::F64, &[4, 1], &[0, 1], xy), "zero stride");
    assert_invalid(HaloSpec::new(ElementType::Raw { size: 0 }, &[2], &[1], xy), "raw size 0");
    assert_invalid(HaloSpec::new(ElementType::F64, &[usize::MAX, 2], &[2, 1], xy), "overflow");
    assert!(HaloSpec::new(ElementType::F64, &[4, 1], &[1, 1], xy).is_ok(), "1-wide dims may share strides");
    // An empty array whose other extents multiply past usize is fine, given its strides or not.
    let big = 1usize << 40;
    assert!(HaloSpec::new(ElementType::F64, &[big, big, 0], &[big, 1, 1], xy).is_ok());
    for shape in [[big, big, 0, 3], [0, big, big, big], [big, 0, big, big]] {
        let empty = HaloSpec::contiguous(ElementType::F64, &shape, xy);
        assert!(empty.is_ok(), "{shape:?}: {empty:?}");
    }
    assert_invalid(HaloSpec::contiguous(ElementType::F64, &[big, big, 2], xy), "size overflow");
    // Rows of stride 2 whose next row starts in the last row's gaps: offsets 0, 2, 4 | 5, 7, 9.
    assert!(HaloSpec::new(ElementType::F64, &[3, 3], &[5, 2], xy).is_ok(), "interleaved rows are distinct");
    assert_invalid(
        HaloSpec::new(ElementType::F64, &[3, 3], &[4, 2], xy),
        "a row starting on another's element",
    );

    let spec = HaloSpec::contiguous(ElementType::F64, &[6, 5], xy).unwrap();
    assert_invalid(HaloExchange::new(&spec, &[0..1], 0, &[0..1, 0..1]), "pack range count");
    assert_invalid(HaloExchange::new(&spec, &[0..1, 0..1], 0, &[0..1, 0..1, 0..1]), "unpack range count");
    assert_invalid(HaloExchange::new(&spec, &[0..7, 0..1], 0, &[0..7, 0..1]), "outside the array");
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = HaloExchange::new(&spec, &[3..1, 0..1], 0, &[0..2, 0..1]);
    assert!(reversed.as_ref().is_err_and(|e| e.to_string().contains("reversed")), "{reversed:?}");
    assert_invalid(reversed, "reversed range");
    assert_invalid(HaloExchange::new(&spec, &[0..2, 0..3], 4, &[0..2, 0..3]), "rotation 4");
    assert_invalid(HaloExchange::new(&spec, &[0..2, 0..3], 1, &[0..2, 0..3]), "turned shape");
    assert_invalid(HaloExchange::new(&spec, &[0..2, 0..3], 0, &[0..3, 0..2]), "same count, other shape");
    assert!(HaloExchange::new(&spec, &[0..2, 0..3], 3, &[0..3, 0..2]).is_ok());
    assert!(HaloExchange::vector_component(&spec, &[0..2, 0..3], 1, &[0..2, 0..3]).is_ok());
}

#[test]
fn bad_packers_are_invalid_arguments() {
    let xy = HorizontalDims::xy(0, 1);
    let f64s = HaloSpec::contiguous(ElementType::F64, &[4, 4], xy).unwrap();
    let f32s = HaloSpec::contiguous(ElementType::F32, &[4, 4], xy).unwrap();
    let u8s = HaloSpec::contiguous(ElementType::U8, &[4, 4], xy).unwrap();
    let raws = HaloSpec::contiguous(ElementType::Raw { size: 8 }, &[4, 4], xy).unwrap();
    let ex = |s: &HaloSpec, k| HaloExchange::new(s, &[0..1, 0..2], k, &[0..2, 0..1]).unwrap();
    let (a, b) = (ex(&f64s, 1), ex(&f32s, 1));
    assert_invalid(HaloPacker::new(Device::Host, &[a.clone(), b], None), "mixed element types");
    assert_invalid(HaloPacker::new(Device::Host, std::slice::from_ref(&a), Some(&[])), "y list length");
    assert_invalid(HaloPacker::new(Device::Host, &[ex(&u8s, 1)], Some(&[ex(&u8s, 1)])), "u8 vector");
    assert_invalid(HaloPacker::new(Device::Host, &[ex(&raws, 1)], Some(&[ex(&raws, 1)])), "raw vector");
    assert_invalid(
        HaloPacker::new(Device::Host, &[ex(&f64s, 1)], Some(&[ex(&f64s, 3)])),
        "rotation mismatch",
    );
    // Staggered components: each slot's shape is checked against the component filling it.
    let cx = HaloExchange::vector_component(&f64s, &[0..1, 0..2], 1, &[0..1, 0..2]).unwrap();
    let cy = HaloExchange::vector_component(&f64s, &[0..1, 0..2], 1, &[0..2, 0..1]).unwrap();
    assert_invalid(
        HaloPacker::new(Device::Host, std::slice::from_ref(&cx), Some(std::slice::from_ref(&cy))),
        "slot shapes",
    );
    // x slot <- y pack (2 x 1) turned = 1 x 2; y slot <- x pack (1 x 2) turned = 2 x 1.
    let cy2 = HaloExchange::vector_component(&f64s, &[0..2, 0..1], 1, &[0..2, 0..1]).unwrap();
    assert_invalid(HaloExchange::new(&f64s, &[0..1, 0..2], 1, &[0..1, 0..2]), "x alone does not fit");
    assert!(HaloPacker::new(Device::Host, &[cx], Some(&[cy2])).is_ok(), "staggered components fit");
}

/// A packer takes the arrays its work reaches, and names the one it cannot: a CUDA packer's
/// kernel reaches device and managed memory of its device, not host memory; a host packer
/// reaches host memory, not CUDA device memory. Nothing is queued on a refusal.
#[test]
fn arrays_out_of_a_packers_reach_are_refused() {
    let Some(gpu) = common::cuda_device() else { return };
    let spec = HaloSpec::contiguous(ElementType::F64, &[4, 4], HorizontalDims::xy(0, 1)).unwrap();
    let ex = HaloExchange::new(&spec, &[0..1, 0..4], 0, &[3..4, 0..4]).unwrap();
    let mut on_gpu = HaloPacker::new(gpu, std::slice::from_ref(&ex), None).unwrap();
    let mut on_host = HaloPacker::new(Device::Host, std::slice::from_ref(&ex), None).unwrap();
    let pinned = PinnedBuffer::<f64>::zeroed(gpu, 16).unwrap();
    let device = DeviceBuffer::<f64>::zeroed(on_gpu.stream(), 16).unwrap();
    for (result, says) in [
        (on_gpu.pack(&[&pinned], None), "reaches device or managed memory"),
        (on_host.pack(&[&device], None), "host packer cannot reach"),
        (on_host.unpack(&[&device], None), "host packer cannot reach"),
    ] {
        match result {
            Err(Error::InvalidArgument { what }) => assert!(what.contains(says), "{what}"),
            other => panic!("expected InvalidArgument ({says}), got {other:?}"),
        }
    }
    let pool = ManagedPool::new(gpu, ManagedPoolOptions::default()).unwrap();
    let managed = pool.alloc::<f64>(16, on_gpu.stream()).unwrap();
    on_gpu.pack(&[&managed], None).unwrap();
    on_gpu.synchronize().unwrap();
}

/// Strides the spec accepts (any stride on a dim of extent 1, a stride that is in range for
/// its extent but not one step further) build a packer without arithmetic overflow (a panic
/// under overflow checks, as in `cargo test`).
#[test]
fn huge_accepted_strides_build_a_packer() {
    let xy = HorizontalDims::xy(0, 1);
    let cases = [
        (ElementType::U8, [2usize, 2], [1usize, 1 << 62]),
        (ElementType::Raw { size: 12 }, [1, 4], [1 << 62, 1]),
        (ElementType::F64, [1, 3], [usize::MAX / 2, 1]),
    ];
    for (element, shape, strides) in cases {
        let spec = HaloSpec::new(element, &shape, &strides, xy).unwrap();
        let whole = [0..shape[0], 0..shape[1]];
        let ex = HaloExchange::new(&spec, &whole, 0, &whole).unwrap();
        let packer = HaloPacker::new(Device::Host, &[ex], None).unwrap();
        assert_eq!(packer.buffer_bytes(), shape[0] * shape[1] * element.size(), "{element:?} {strides:?}");
    }
}

/// A stride the spec accepts on a dim of extent 1 (any value, here 2^63) does not overflow
/// when a turn flips that dim (debug builds panicked negating it), and the pack matches a
/// scalar loop: the lone row reversed by a half turn, kept by an x-only quarter turn (its x
/// dim is the flipped one, of extent 1).
#[test]
fn turning_a_dim_of_extent_one_with_a_huge_stride() {
    let src = [1.0f64, 2.0, 3.0];
    for (dims, k) in [(HorizontalDims::xy(0, 1), 2), (HorizontalDims::x_only(0), 1)] {
        let spec = HaloSpec::new(ElementType::F64, &[1, 3], &[1 << 63, 1], dims).unwrap();
        let ex = HaloExchange::new(&spec, &[0..1, 0..3], k, &[0..1, 0..3]).unwrap();
        let mut packer = HaloPacker::new(Device::Host, &[ex], None).unwrap();
        let stream = packer.stream().clone();
        let array = DeviceBuffer::from_slice(&stream, &src).unwrap();
        packer.pack(&[&array], None).unwrap();
        let got: Vec<f64> = from_bytes(&packer.pack_buffer().unwrap().to_vec(&stream).unwrap());
        let mut want = Vec::new();
        for j in 0..3 {
            want.push(if k == 2 { src[2 - j] } else { src[j] });
        }
        assert_eq!(got, want, "turn {k}");
    }
}

/// Interleaved rows (stride 2, the next row starting in the last row's gaps) pack and unpack
/// every element where a scalar loop over `i * 5 + j * 2` puts it, on both backends.
fn interleaved_rows_round_trip(device: Device) {
    let spec = HaloSpec::new(ElementType::F64, &[3, 3], &[5, 2], HorizontalDims::xy(0, 1)).unwrap();
    let at = |i: usize, j: usize| i * 5 + j * 2;
    let src: Vec<f64> = (0..15).map(|v| v as f64 + 0.5).collect();
    // Rows 0..2 turned once clockwise into the 3 x 2 block at columns 1..3.
    let ex = HaloExchange::new(&spec, &[0..2, 0..3], 1, &[0..3, 1..3]).unwrap();
    let mut packer = HaloPacker::new(device, std::slice::from_ref(&ex), None).unwrap();
    let stream = packer.stream().clone();
    let array = DeviceBuffer::from_slice(&stream, &src).unwrap();
    packer.pack(&[&array], None).unwrap();
    let packed: Vec<f64> = from_bytes(&packer.pack_buffer().unwrap().to_vec(&stream).unwrap());
    // A clockwise turn: result (i, j) = source (nx - 1 - j, i), nx = 2 rows packed.
    let mut want = Vec::new();
    for i in 0..3 {
        for j in 0..2 {
            want.push(src[at(1 - j, i)]);
        }
    }
    assert_eq!(packed, want, "pack on {device}");
    // The receiver's buffer gets what was sent.
    let sent = DeviceBuffer::from_slice(&stream, bytemuck::cast_slice::<f64, u8>(&want)).unwrap();
    cuferry::copy(&stream, &sent, packer.unpack_buffer_mut().unwrap()).unwrap();
    let out = DeviceBuffer::from_slice(&stream, &[-1.0f64; 15]).unwrap();
    packer.unpack(&[&out], None).unwrap();
    let got = out.to_vec(&stream).unwrap();
    let mut expected = vec![-1.0f64; 15];
    for i in 0..3 {
        for j in 0..2 {
            expected[at(i, 1 + j)] = want[i * 2 + j];
        }
    }
    assert_eq!(got, expected, "unpack on {device}");
}

#[test]
fn interleaved_rows_round_trip_on_the_host() {
    interleaved_rows_round_trip(Device::Host);
}

#[test]
fn interleaved_rows_round_trip_on_cuda() {
    if let Some(device) = common::cuda_device() {
        interleaved_rows_round_trip(device);
    }
}

/// An array with a zero extent skips the size checks, so its other extents may be huge: the
/// packer still builds (an empty exchange) without overflowing an element count (debug builds
/// panicked in the rotation's element count).
#[test]
fn a_zero_extent_with_huge_other_extents_builds_an_empty_packer() {
    let big = 1usize << 40;
    let spec = HaloSpec::new(ElementType::F64, &[big, big, 0], &[1, 1, 1], HorizontalDims::xy(0, 1)).unwrap();
    let region = [0..big, 0..big, 0..0];
    for rotation in 0..4 {
        let ex = HaloExchange::new(&spec, &region, rotation, &region).unwrap();
        assert_eq!(ex.elements(), 0);
        let packer = HaloPacker::new(Device::Host, &[ex], None).unwrap();
        assert_eq!(packer.buffer_bytes(), 0, "rotation {rotation}");
    }
}

#[test]
fn bad_arrays_are_invalid_arguments_and_queue_nothing() {
    let stream = Stream::new(Device::Host).unwrap();
    let spec = HaloSpec::new(ElementType::F64, &[4, 4], &[5, 1], HorizontalDims::xy(1, 0)).unwrap();
    let ex = HaloExchange::new(&spec, &[0..1, 0..4], 1, &[0..4, 3..4]).unwrap();
    let mut scalar = HaloPacker::with_stream(&stream, std::slice::from_ref(&ex), None).unwrap();
    let mut vector =
        HaloPacker::with_stream(&stream, std::slice::from_ref(&ex), Some(std::slice::from_ref(&ex))).unwrap();
    let good = DeviceBuffer::<f64>::zeroed(&stream, 19).unwrap();
    let short = DeviceBuffer::<f64>::zeroed(&stream, 18).unwrap();
    let wrong = DeviceBuffer::<f32>::zeroed(&stream, 40).unwrap();
    let bytes = DeviceBuffer::<u8>::zeroed(&stream, 200).unwrap();
    assert_invalid(scalar.pack(&[&good, &good], None), "two arrays, one exchange");
    assert_invalid(scalar.pack::<f64, DeviceBuffer<f64>>(&[], None), "no array");
    assert_invalid(scalar.pack(&[&good], Some(&[&good])), "y arrays to a scalar packer");
    assert_invalid(vector.pack(&[&good], None), "no y arrays to a vector packer");
    assert_invalid(vector.pack(&[&good], Some(&[])), "too few y arrays");
    assert_invalid(scalar.pack(&[&short], None), "short array");
    assert_invalid(vector.unpack(&[&good], Some(&[&short])), "short y array");
    assert_invalid(scalar.pack(&[&wrong], None), "f32 array for an f64 spec");
    assert_invalid(scalar.unpack(&[&bytes], None), "u8 array for an f64 spec");
    assert!(scalar.ready().unwrap());
    scalar.pack(&[&good], None).unwrap();
    vector.unpack(&[&good], Some(&[&good])).unwrap_err(); // one array, overlapping slots
    scalar.synchronize().unwrap();
}

#[test]
fn one_array_may_take_several_disjoint_unpack_regions() {
    let stream = Stream::new(Device::Host).unwrap();
    let spec = HaloSpec::contiguous(ElementType::I32, &[3, 3], HorizontalDims::xy(1, 0)).unwrap();
    let west = HaloExchange::new(&spec, &[0..3, 0..1], 0, &[0..3, 2..3]).unwrap();
    let east = HaloExchange::new(&spec, &[0..3, 2..3], 0, &[0..3, 0..1]).unwrap();
    let mut packer = HaloPacker::with_stream(&stream, &[west.clone(), east], None).unwrap();
    let a = DeviceBuffer::from_slice(&stream, &[1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap();
    packer.pack(&[&a, &a], None).unwrap();
    packer.copy_pack_to_unpack().unwrap();
    packer.unpack(&[&a, &a], None).unwrap(); // swaps the west and east columns
    assert_eq!(a.to_vec(&stream).unwrap(), vec![3, 2, 1, 6, 5, 4, 9, 8, 7]);
    let mut twice = HaloPacker::with_stream(&stream, &[west.clone(), west], None).unwrap();
    assert_invalid(twice.unpack(&[&a, &a], None), "overlapping unpack regions of one array");
    let b = DeviceBuffer::<i32>::zeroed(&stream, 9).unwrap();
    twice.unpack(&[&a, &b], None).unwrap(); // distinct arrays: fine
    twice.synchronize().unwrap();
}

// ---- asynchrony and drops --------------------------------------------------------------------

fn one_quantity(seed: u64, shape: [usize; 3]) -> Quantity<f64> {
    let mut rng = Rng::new(seed);
    let layout = Layout {
        shape: shape.to_vec(),
        strides: vec![shape[1] * (shape[2] + 1), shape[2] + 1, 1],
        x: Some(2),
        y: Some(1),
    };
    let pack = vec![0..shape[0], 0..2, 0..shape[2]];
    Quantity::filled(&mut rng, &layout, pack, 3, vec![0..shape[0], 0..shape[2], shape[2] - 2..shape[2]])
}

fn exchange_of(q: &Quantity<f64>) -> HaloExchange {
    HaloExchange::new(&q.layout_x.spec::<f64>(), &q.pack, q.k, &q.unpack).unwrap()
}

/// `ready` is false while the pack waits behind slow work, and dropping the source array
/// waits for the pack (the array is not freed under it).
#[test]
fn dropping_an_array_while_a_pack_is_queued_waits_for_it() {
    let q = one_quantity(13, [3, 7, 7]);
    let (packed, _, _) = reference(std::slice::from_ref(&q), false);
    let stream = Stream::new(Device::Host).unwrap();
    let mut packer = HaloPacker::with_stream(&stream, &[exchange_of(&q)], None).unwrap();
    let a = DeviceBuffer::from_slice(&stream, &q.src_x).unwrap();
    let gate = Gate::hold(&stream);
    packer.pack(&[&a], None).unwrap();
    assert!(!packer.ready().unwrap(), "the pack cannot have run yet");
    let opener = gate.open_after(Duration::from_millis(50));
    drop(a);
    assert!(packer.ready().unwrap(), "dropping the array waited for the pack");
    opener.join().unwrap();
    assert_eq!(
        packer.pack_buffer().unwrap().to_vec(&stream).unwrap(),
        bytemuck::cast_slice::<f64, u8>(&packed)
    );
}

/// Dropping the packer with a pack queued does not block, and the pack still completes into
/// its buffer, which went back to the pool: the next packer of that size receives it.
#[test]
fn dropping_the_packer_while_a_pack_is_queued_is_safe() {
    let q = one_quantity(14, [7, 41, 37]); // a buffer size no other test uses
    let (packed, _, _) = reference(std::slice::from_ref(&q), false);
    let stream = Stream::new(Device::Host).unwrap();
    let mut packer = HaloPacker::with_stream(&stream, &[exchange_of(&q)], None).unwrap();
    let a = DeviceBuffer::from_slice(&stream, &q.src_x).unwrap();
    let buffer_at = packer.pack_buffer().unwrap().as_ptr();
    let gate = Gate::hold(&stream);
    packer.pack(&[&a], None).unwrap();
    drop(packer);
    // Had the drop waited for the pack, it would have waited for the gate (which opens by
    // itself after 10 s) and the gate would show passed.
    assert!(!gate.passed(), "dropping the packer waited for its queued pack");
    gate.open();
    drop(a); // waits for the pack
    let again = HaloPacker::with_stream(&stream, &[exchange_of(&q)], None).unwrap();
    let (p, u) = (again.pack_buffer().unwrap(), again.unpack_buffer().unwrap());
    let buf = [p, u].into_iter().find(|b| b.as_ptr() == buffer_at).expect("the buffer went back to the pool");
    // The new loan is zeroed after the queued pack: zeros, not the packed bytes, had the
    // zeroing run first (or not at all).
    assert!(packed.iter().any(|&v| v != 0.0));
    assert!(buf.to_vec(&stream).unwrap().iter().all(|&b| b == 0), "the pooled buffer kept the pack's bytes");
}

/// A pooled buffer's earlier owner may still have work queued on it on another stream: the
/// buffer accessors wait for that work too, not just for the packer's own stream, so bytes
/// written through the pointer they return (a receive, a C caller) are not overwritten. The
/// loan's zeroing runs after that work: the accessor sees zeros, not the earlier pack.
#[test]
fn buffer_accessors_wait_for_a_pooled_buffers_earlier_owner() {
    let q = one_quantity(16, [5, 43, 31]); // a buffer size no other test uses
    let (packed, _, _) = reference(std::slice::from_ref(&q), false);
    let (first, second) = (Stream::new(Device::Host).unwrap(), Stream::new(Device::Host).unwrap());
    let mut earlier = HaloPacker::with_stream(&first, &[exchange_of(&q)], None).unwrap();
    let a = DeviceBuffer::from_slice(&first, &q.src_x).unwrap();
    let buffer_at = earlier.pack_buffer().unwrap().as_ptr();
    let gate = Gate::hold(&first);
    earlier.pack(&[&a], None).unwrap();
    let opener = gate.open_after(Duration::from_millis(50));
    drop(earlier); // its buffers go back to the pool with the pack still queued on `first`
    let mut later = HaloPacker::with_stream(&second, &[exchange_of(&q)], None).unwrap();
    let unpack_at = later.unpack_buffer_mut().unwrap().as_ptr();
    let buf =
        if unpack_at == buffer_at { later.unpack_buffer().unwrap() } else { later.pack_buffer().unwrap() };
    assert_eq!(buf.as_ptr(), buffer_at, "the earlier packer's pack buffer went back to the pool");
    // SAFETY: host memory of `buf.len()` bytes; the accessor waited for every queued use of it.
    let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr(), buf.len()) };
    assert!(packed.iter().any(|&v| v != 0.0));
    assert!(
        bytes.iter().all(|&b| b == 0),
        "the accessor returned before the earlier pack and the loan's zeroing had both run"
    );
    drop(a);
    opener.join().unwrap();
}

/// A new packer unpacking before anything was received writes zeros, never the bytes an
/// earlier packer of the same buffer size left in its pooled buffers.
#[test]
fn a_new_packers_unpack_buffer_holds_no_earlier_packers_bytes() {
    let q = one_quantity(18, [3, 29, 11]); // a buffer size no other test uses
    let stream = Stream::new(Device::Host).unwrap();
    let src = DeviceBuffer::from_slice(&stream, &q.src_x).unwrap();
    let mut earlier = HaloPacker::with_stream(&stream, &[exchange_of(&q)], None).unwrap();
    let earlier_bufs = [earlier.pack_buffer().unwrap().as_ptr(), earlier.unpack_buffer().unwrap().as_ptr()];
    earlier.pack(&[&src], None).unwrap();
    earlier.copy_pack_to_unpack().unwrap();
    drop(earlier);
    let mut later = HaloPacker::with_stream(&stream, &[exchange_of(&q)], None).unwrap();
    let later_bufs = [later.pack_buffer().unwrap().as_ptr(), later.unpack_buffer().unwrap().as_ptr()];
    assert!(later_bufs.iter().all(|b| earlier_bufs.contains(b)), "the buffers did not come from the pool");
    let zeros = vec![0.0; q.dst_x.len()];
    let dst = DeviceBuffer::from_slice(&stream, &zeros).unwrap();
    later.unpack(&[&dst], None).unwrap();
    assert_eq!(dst.to_vec(&stream).unwrap(), zeros, "an earlier packer's bytes were unpacked");
    assert!(later.pack_buffer().unwrap().to_vec(&stream).unwrap().iter().all(|&b| b == 0));
}

/// The unpack buffer is handed out as `&mut DeviceBuffer`: one put in its place that does not
/// fit the plan is refused by every later use instead of being read or written past its end.
#[test]
fn a_replaced_unpack_buffer_that_does_not_fit_is_refused() {
    let q = one_quantity(17, [3, 7, 7]);
    let stream = Stream::new(Device::Host).unwrap();
    let mut packer = HaloPacker::with_stream(&stream, &[exchange_of(&q)], None).unwrap();
    let dst = DeviceBuffer::from_slice(&stream, &q.dst_x).unwrap();
    *packer.unpack_buffer_mut().unwrap() = DeviceBuffer::zeroed(&stream, 1).unwrap();
    assert_invalid(packer.unpack(&[&dst], None), "unpack from a 1-byte buffer");
    assert_invalid(packer.unpack_buffer(), "unpack_buffer");
    match packer.copy_pack_to_unpack() {
        // The same words as every other use, not a copy's length mismatch.
        Err(Error::InvalidArgument { what }) => assert!(what.contains("was replaced"), "{what}"),
        other => panic!("copy_pack_to_unpack: {other:?}"),
    }
    assert_eq!(dst.to_vec(&stream).unwrap(), q.dst_x, "a refused unpack wrote something");
    // Putting back a buffer of the right size and device repairs the packer.
    let src = DeviceBuffer::from_slice(&stream, &q.src_x).unwrap();
    *packer.unpack_buffer_mut().unwrap() = DeviceBuffer::zeroed(&stream, packer.buffer_bytes()).unwrap();
    packer.pack(&[&src], None).unwrap();
    packer.copy_pack_to_unpack().unwrap();
    packer.unpack(&[&dst], None).unwrap();
    packer.synchronize().unwrap();
}

/// The host thread limit is what the helpers can give: at most 16, at least 1.
#[test]
fn host_threads_are_clamped_to_what_a_job_can_use() {
    let q = one_quantity(17, [3, 7, 7]);
    let mut packer = HaloPacker::new(Device::Host, &[exchange_of(&q)], None).unwrap();
    packer.set_host_threads(64);
    assert_eq!(packer.host_threads(), 16);
    packer.set_host_threads(0);
    assert_eq!(packer.host_threads(), 1);
    packer.set_host_threads(5);
    assert_eq!(packer.host_threads(), 5);
}

/// Dropping destination arrays and the packer while an unpack is queued: the arrays wait, and
/// a read queued before the drop sees the unpacked data.
#[test]
fn dropping_while_an_unpack_is_queued_is_safe() {
    let q = one_quantity(15, [4, 6, 6]);
    let (_, ref_x, _) = reference(std::slice::from_ref(&q), false);
    let stream = Stream::new(Device::Host).unwrap();
    let other = Stream::new(Device::Host).unwrap();
    let mut packer = HaloPacker::with_stream(&stream, &[exchange_of(&q)], None).unwrap();
    let src = DeviceBuffer::from_slice(&stream, &q.src_x).unwrap();
    let dst = DeviceBuffer::from_slice(&stream, &q.dst_x).unwrap();
    let gate = Gate::hold(&stream);
    let opener = gate.open_after(Duration::from_millis(50));
    packer.pack(&[&src], None).unwrap();
    packer.copy_pack_to_unpack().unwrap();
    packer.unpack(&[&dst], None).unwrap();
    drop(packer);
    drop(src);
    // Read on another stream: ordered after the unpack by the array's tracker.
    assert_eq!(dst.to_vec(&other).unwrap(), ref_x[0]);
    drop(dst);
    stream.synchronize().unwrap();
    opener.join().unwrap();
}

/// An exchange of one 20 x 150 x 151 array (padded) moving 20 x 30 x 147 f64 (706 KB, over
/// the 512 KiB a host job moves on one thread): a quarter turn of a 30-row strip.
fn large_quantity(seed: u64) -> Quantity<f64> {
    let mut rng = Rng::new(seed);
    let layout =
        Layout { shape: vec![20, 150, 151], strides: vec![150 * 152, 152, 1], x: Some(2), y: Some(1) };
    Quantity::filled(&mut rng, &layout, vec![0..20, 0..30, 2..149], 1, vec![0..20, 1..148, 120..150])
}

/// Packs and unpacks `q` with `packer` (on its own stream), from arrays uploaded on `stream`;
/// returns the pack buffer and the unpacked array.
fn pack_and_unpack(packer: &mut HaloPacker, stream: &Stream, q: &Quantity<f64>) -> (Vec<u8>, Vec<f64>) {
    let src = DeviceBuffer::from_slice(stream, &q.src_x).unwrap();
    let dst = DeviceBuffer::from_slice(stream, &q.dst_x).unwrap();
    packer.pack(&[&src], None).unwrap();
    packer.copy_pack_to_unpack().unwrap();
    packer.unpack(&[&dst], None).unwrap();
    let packed = packer.pack_buffer().unwrap().to_vec(stream).unwrap();
    (packed, dst.to_vec(stream).unwrap())
}

/// Several packers used at once from four threads, each thread with its own streams and
/// arrays, packers of one buffer size made and dropped every round (so pooled buffers pass
/// between threads), and two threads' exchanges large enough to share the helper threads:
/// every pack and unpack equals the reference.
fn several_packers_on_several_threads(device: Device) {
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..4u64)
            .map(|t| {
                scope.spawn(move || {
                    let q =
                        if t % 2 == 0 { large_quantity(40 + t) } else { one_quantity(40 + t, [5, 30, 30]) };
                    let (packed, ref_x, _) = reference(std::slice::from_ref(&q), false);
                    let packed = bytemuck::cast_slice::<f64, u8>(&packed);
                    let stream = Stream::new(device).unwrap();
                    for round in 0..6 {
                        let mut packer = HaloPacker::new(device, &[exchange_of(&q)], None).unwrap();
                        let (got_packed, got_x) = pack_and_unpack(&mut packer, &stream, &q);
                        assert!(got_packed == packed, "thread {t} round {round}: pack buffer");
                        assert!(got_x == ref_x[0], "thread {t} round {round}: unpacked array");
                    }
                })
            })
            .collect();
        for w in workers {
            if let Err(panic) = w.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
}

on_both_backends! {
    several_packers_used_at_once_from_several_threads => several_packers_on_several_threads;
}

/// Packs run from inside a host stream's job. On another stream's packer the pack runs at
/// once (inline on the job's thread, with the helper threads for this large exchange) and the
/// job can wait for it and read the results; on the job's own stream it is queued behind the
/// job (it never waits for itself) and runs after. Every result equals the reference.
#[test]
fn packs_from_inside_a_host_job() {
    let q = large_quantity(50);
    let (packed, ref_x, _) = reference(std::slice::from_ref(&q), false);
    let packed = bytemuck::cast_slice::<f64, u8>(&packed).to_vec();
    let jobs = Stream::new(Device::Host).unwrap();
    let other = Stream::new(Device::Host).unwrap();
    let mut on_other = HaloPacker::with_stream(&other, &[exchange_of(&q)], None).unwrap();
    let mut on_jobs = HaloPacker::with_stream(&jobs, &[exchange_of(&q)], None).unwrap();
    let src = DeviceBuffer::from_slice(&other, &q.src_x).unwrap();
    let (report, outcome) = std::sync::mpsc::channel();
    let (want_packed, want_x) = (packed.clone(), ref_x[0].clone());
    jobs.host_fn(move || {
        let ran_inside = pack_and_unpack(&mut on_other, &other, &q) == (want_packed, want_x);
        let queued = on_jobs.pack(&[&src], None);
        let _ = report.send((ran_inside, queued, on_jobs, src));
    })
    .unwrap();
    let Ok((ran_inside, queued, on_jobs, src)) = outcome.recv_timeout(Duration::from_secs(20)) else {
        panic!("the job did not finish: a pack inside it waited for itself");
    };
    assert!(
        ran_inside,
        "a pack and unpack on another stream's packer, inside a job, differ from the reference"
    );
    assert!(queued.is_ok(), "{queued:?}");
    assert_eq!(on_jobs.pack_buffer().unwrap().to_vec(&jobs).unwrap(), packed);
    drop(src);
    jobs.synchronize().unwrap();
}

/// A packer over no exchanges (or empty regions) queues nothing and hands out empty buffers.
#[test]
fn empty_exchange_sets_move_nothing() {
    let mut packer = HaloPacker::new(Device::Host, &[], None).unwrap();
    packer.pack::<f64, DeviceBuffer<f64>>(&[], None).unwrap();
    assert_eq!((packer.buffer_bytes(), packer.launches_per_call(), packer.element()), (0, 0, None));
    assert!(packer.pack_buffer().unwrap().is_empty());
    let spec = HaloSpec::contiguous(ElementType::F32, &[3, 3], HorizontalDims::xy(0, 1)).unwrap();
    let ex = HaloExchange::new(&spec, &[1..1, 0..3], 1, &[0..3, 2..2]).unwrap();
    let mut packer = HaloPacker::new(Device::Host, &[ex], None).unwrap();
    let stream = packer.stream().clone();
    let a = DeviceBuffer::<f32>::zeroed(&stream, 9).unwrap();
    packer.pack(&[&a], None).unwrap();
    packer.unpack(&[&a], None).unwrap();
    assert_eq!(packer.buffer_bytes(), 0);
}

// ---- property test ---------------------------------------------------------------------------

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config { cases: 64, ..Default::default() })]

    /// Any layout, region and rotation: pack and unpack equal the reference (vectors too).
    #[test]
    fn pack_and_unpack_match_the_reference(seed in proptest::prelude::any::<u64>(), vector: bool, n in 1usize..4) {
        let mut rng = Rng::new(seed);
        let qs: Vec<Quantity<f64>> = (0..n).map(|_| random_quantity(&mut rng, false)).collect();
        check_case(&qs, vector);
    }
}

// ---- CUDA-only checks ------------------------------------------------------------------------

/// On a GPU: one launch per call, and arrays of another device are rejected.
#[test]
fn cuda_packer_checks_devices() {
    let Some(device) = common::cuda_device() else { return };
    let q = one_quantity(16, [3, 5, 5]);
    let mut packer = HaloPacker::new(device, &[exchange_of(&q)], None).unwrap();
    assert_eq!(packer.launches_per_call(), 1);
    let host_stream = Stream::new(Device::Host).unwrap();
    let host_array = DeviceBuffer::from_slice(&host_stream, &q.src_x).unwrap();
    assert_invalid(packer.pack(&[&host_array], None), "a host array for a CUDA packer");
}
