//! Test helpers shared by the CPU and CUDA implementations' unit tests: a scalar reference
//! for one transfer and a generator of random layouts.
//!
//! Rules: the reference moves one atom at a time straight from a transfer's extents and
//! strides, with bounds-checked indexing, and shares no code with either implementation.

use super::cpu::Direction;
use super::plan::Transfer;
use super::spec::{ElemKind, ElementType, HaloExchange, HaloSpec, HorizontalDims};

/// A small deterministic generator (xorshift64*).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The transfer's bytes moved one atom at a time, in its own row-major order, straight
/// from its extents and strides: the reference for every nest kind.
pub(crate) fn reference(t: &Transfer, direction: Direction, src: &[u8], dst: &mut [u8]) {
    let (src_first, src_strides, dst_first, dst_strides) = match direction {
        Direction::Pack => (t.array_offset * t.atom, &t.array_strides, t.packed_offset, &t.packed_strides),
        Direction::Unpack => (t.packed_offset, &t.packed_strides, t.array_offset * t.atom, &t.array_strides),
    };
    let negate = direction == Direction::Pack && t.negate;
    let mut index = vec![0usize; t.extent.len()];
    for _ in 0..t.atoms() {
        let off = |strides: &[isize]| index.iter().zip(strides).map(|(&i, &s)| i as isize * s).sum::<isize>();
        let s = (src_first as isize + off(src_strides) * t.atom as isize) as usize;
        let d = (dst_first as isize + off(dst_strides) * t.atom as isize) as usize;
        let mut atom = src[s..s + t.atom].to_vec();
        if negate {
            match t.kind {
                ElemKind::I32 => {
                    let v = i32::from_ne_bytes([atom[0], atom[1], atom[2], atom[3]]).wrapping_neg();
                    atom.copy_from_slice(&v.to_ne_bytes());
                }
                // The sign bit is the top bit of the last byte on little-endian machines.
                _ => {
                    let top = if cfg!(target_endian = "little") { t.atom - 1 } else { 0 };
                    atom[top] ^= 0x80;
                }
            }
        }
        dst[d..d + t.atom].copy_from_slice(&atom);
        for k in (0..index.len()).rev() {
            index[k] += 1;
            if index[k] < t.extent[k] {
                break;
            }
            index[k] = 0;
        }
    }
}

/// A random array layout and one exchange on it.
pub(crate) struct Layout {
    pub(crate) spec: HaloSpec,
    pub(crate) ex: HaloExchange,
    /// Whether the quantity is a vector (its exchange given for x and y).
    pub(crate) vector: bool,
}

/// A random layout of 2 to `max_dims` dims (the element type cycles with `case`): permuted,
/// sometimes padded strides, a random rotation, random pack and unpack regions.
pub(crate) fn random_layout(rng: &mut Rng, case: usize, max_dims: usize) -> Layout {
    let element =
        [ElementType::F64, ElementType::F32, ElementType::I32, ElementType::U8, ElementType::Raw { size: 6 }]
            [case % 5];
    let nd = 2 + rng.below(max_dims - 1);
    let most = if nd > 3 { 7 } else { 24 };
    let shape: Vec<usize> = (0..nd).map(|_| 1 + rng.below(most)).collect();
    // Permuted, sometimes padded strides.
    let mut order: Vec<usize> = (0..nd).collect();
    for i in (1..nd).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut strides = vec![0; nd];
    let mut acc = 1 + usize::from(rng.below(4) == 0);
    for &d in order.iter().rev() {
        strides[d] = acc;
        acc *= shape[d] + rng.below(2);
    }
    let (x, y) = (nd - 1, nd - 2);
    let spec = HaloSpec::new(element, &shape, &strides, HorizontalDims::xy(x, y)).unwrap();
    let k = rng.below(4) as u32;
    let side = shape[x].min(shape[y]);
    let mut pack = Vec::new();
    let mut ext = Vec::new();
    for (d, &n) in shape.iter().enumerate() {
        let limit = if d == x || d == y { side } else { n };
        let e = 1 + rng.below(limit);
        let s = rng.below(n - e + 1);
        pack.push(s..s + e);
        ext.push(e);
    }
    if k % 2 == 1 {
        ext.swap(x, y);
    }
    let unpack: Vec<std::ops::Range<usize>> = ext
        .iter()
        .zip(&shape)
        .map(|(&e, &n)| {
            let s = rng.below(n - e + 1);
            s..s + e
        })
        .collect();
    let ex = HaloExchange::new(&spec, &pack, k, &unpack).unwrap();
    let vector = element.is_signed() && rng.below(2) == 0;
    Layout { spec, ex, vector }
}
