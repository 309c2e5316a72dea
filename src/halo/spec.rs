//! Array layouts ([`HaloSpec`]) and exchanges ([`HaloExchange`]): what a halo packer moves.
//!
//! Rules:
//! - Everything is checked when the value is made, and a bad value is an
//!   [`Error::InvalidArgument`] naming the problem; nothing here panics.
//! - A layout has 1 to [`MAX_DIMS`] dims, a stride per dim in elements (padded and permuted
//!   layouts are fine), and dims that do not overlap in memory: sorted by stride, each stride
//!   is at least the span of the dims below it (from their first element to one past their
//!   last; a row may start inside the padding after the row below). So distinct indices are
//!   distinct elements, which is what lets several threads or GPU blocks unpack at once.
//! - Rotation (the [halo module](super) rules): a clockwise quarter turn maps element (i, j) of the
//!   result to element (nx-1-j, i) of the source, (i, j) indexing the x and y dims; k turns are k
//!   applications. An array with one horizontal dim flips like numpy's lone axis: a quarter turn
//!   flips an x-only array along x (k=1) or a y-only array along y (k=3) and leaves the other case
//!   as is; a half turn flips every horizontal dim present. Other dims never move.
//! - An exchange is one transfer: its pack region, rotated, has exactly the shape of its unpack
//!   region. Sender and receiver build their packers from the same exchange list, so they agree
//!   on the packed layout; the rotation is applied once, by the sender's pack.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::memory::Element;

/// Most dims a [`HaloSpec`] may have.
pub const MAX_DIMS: usize = 6;

/// The element type of an array: the typed ones can be negated (vector quantities), `U8` and
/// `Raw` cannot.
///
/// # Examples
///
/// ```
/// use cuferry::halo::ElementType;
/// assert_eq!(ElementType::of::<f64>(), ElementType::F64);
/// assert_eq!(ElementType::of::<[u8; 12]>(), ElementType::Raw { size: 12 });
/// assert!(ElementType::F32.is_signed() && !ElementType::U8.is_signed());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementType {
    /// `f32`.
    F32,
    /// `f64`.
    F64,
    /// `i32` (negated with wrap-around: `i32::MIN` stays `i32::MIN`).
    I32,
    /// `u8`.
    U8,
    /// Opaque elements of `size` bytes, moved as bytes.
    Raw {
        /// Bytes per element (> 0).
        size: usize,
    },
}

/// How an element is negated; the C ABI's `CUFERRY_HALO_KIND_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ElemKind {
    /// Never negated.
    Bits,
    F32,
    F64,
    I32,
}

impl ElementType {
    /// The element type of `T`: `F32`, `F64`, `I32` and `U8` for those types, `Raw` otherwise.
    pub fn of<T: Element>() -> Self {
        use std::any::TypeId;
        let id = TypeId::of::<T>();
        if id == TypeId::of::<f32>() {
            ElementType::F32
        } else if id == TypeId::of::<f64>() {
            ElementType::F64
        } else if id == TypeId::of::<i32>() {
            ElementType::I32
        } else if id == TypeId::of::<u8>() {
            ElementType::U8
        } else {
            ElementType::Raw { size: std::mem::size_of::<T>() }
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ElementType::F32 | ElementType::I32 => 4,
            ElementType::F64 => 8,
            ElementType::U8 => 1,
            ElementType::Raw { size } => size,
        }
    }

    /// Whether elements can be negated (needed by vector quantities).
    pub fn is_signed(self) -> bool {
        !matches!(self.kind(), ElemKind::Bits)
    }

    pub(crate) fn kind(self) -> ElemKind {
        match self {
            ElementType::F32 => ElemKind::F32,
            ElementType::F64 => ElemKind::F64,
            ElementType::I32 => ElemKind::I32,
            ElementType::U8 | ElementType::Raw { .. } => ElemKind::Bits,
        }
    }

    /// Whether arrays of `T` hold elements of this type: the same type for the typed variants;
    /// for `Raw { size }`, any `T` whose size divides `size` (so `u8` always fits).
    pub fn accepts<T: Element>(self) -> bool {
        match self {
            ElementType::Raw { size } => {
                let t = std::mem::size_of::<T>();
                t != 0 && size % t == 0
            }
            typed => ElementType::of::<T>() == typed,
        }
    }
}

/// Which dims of an array are the horizontal x and y; either may be absent (a lone-axis array,
/// or a column with neither).
///
/// # Examples
///
/// ```
/// use cuferry::halo::HorizontalDims;
/// let d = HorizontalDims::xy(2, 1); // a (z, y, x) array
/// assert_eq!((d.x, d.y), (Some(2), Some(1)));
/// assert_eq!(HorizontalDims::x_only(0).y, None);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HorizontalDims {
    /// The x dim (increasing eastward), if the array has one.
    pub x: Option<usize>,
    /// The y dim (increasing northward), if the array has one.
    pub y: Option<usize>,
}

impl HorizontalDims {
    /// Both horizontal dims.
    pub const fn xy(x: usize, y: usize) -> Self {
        HorizontalDims { x: Some(x), y: Some(y) }
    }

    /// Only an x dim.
    pub const fn x_only(x: usize) -> Self {
        HorizontalDims { x: Some(x), y: None }
    }

    /// Only a y dim.
    pub const fn y_only(y: usize) -> Self {
        HorizontalDims { x: None, y: Some(y) }
    }

    /// No horizontal dim: rotations leave the array as is.
    pub const fn none() -> Self {
        HorizontalDims { x: None, y: None }
    }
}

/// The memory layout of one array: element type, shape, strides in elements and horizontal
/// dims. See the [module docs](crate::halo) for the rules it enforces.
///
/// # Examples
///
/// ```
/// use cuferry::halo::{ElementType, HaloSpec, HorizontalDims};
/// // 79 levels of a 54 x 54 tile stored as (z, y, x), rows padded to 56 elements.
/// let spec = HaloSpec::new(ElementType::F64, &[79, 54, 54], &[54 * 56, 56, 1], HorizontalDims::xy(2, 1))?;
/// assert_eq!(spec.required_len(), 78 * 54 * 56 + 53 * 56 + 53 + 1);
/// assert!(HaloSpec::new(ElementType::F64, &[4, 4], &[1, 1], HorizontalDims::xy(1, 0)).is_err()); // overlap
/// # Ok::<(), cuferry::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HaloSpec {
    element: ElementType,
    shape: Vec<usize>,
    strides: Vec<usize>,
    dims: HorizontalDims,
    /// Elements an array must hold: the last element's index + 1 (0 when empty).
    required_len: usize,
}

impl HaloSpec {
    /// A layout with explicit strides (in elements).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the dim count is 0 or above [`MAX_DIMS`], strides and
    /// shape differ in length, a horizontal dim is out of range or x == y, a raw element has
    /// size 0, dims overlap in memory, or sizes overflow.
    pub fn new(
        element: ElementType,
        shape: &[usize],
        strides: &[usize],
        dims: HorizontalDims,
    ) -> Result<Self> {
        let n = shape.len();
        if n == 0 || n > MAX_DIMS {
            return Err(Error::invalid(format!("a halo spec needs 1 to {MAX_DIMS} dims, got {n}")));
        }
        if strides.len() != n {
            return Err(Error::invalid(format!("{} strides given for {n} dims", strides.len())));
        }
        if element.size() == 0 {
            return Err(Error::invalid("raw elements of 0 bytes"));
        }
        for (name, dim) in [("x", dims.x), ("y", dims.y)] {
            if let Some(d) = out_of_range(dim, n) {
                return Err(Error::invalid(format!("{name} dim {d} is out of range for {n} dims")));
            }
        }
        if dims.x.is_some() && dims.x == dims.y {
            return Err(Error::invalid("the x and y dims must differ"));
        }
        let required_len = required_len(shape, strides)?;
        required_len
            .checked_mul(element.size())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| Error::invalid("the array's byte size overflows"))?;
        check_no_overlap(shape, strides)?;
        Ok(HaloSpec { element, shape: shape.to_vec(), strides: strides.to_vec(), dims, required_len })
    }

    /// A row-major (C order) contiguous layout: the last dim has stride 1. An empty array
    /// (an extent of 0) whose other extents multiply past `usize` gets strides that saturate
    /// at `usize::MAX` where the product overflows (no element is ever addressed through them).
    ///
    /// # Errors
    ///
    /// As [`HaloSpec::new`].
    pub fn contiguous(element: ElementType, shape: &[usize], dims: HorizontalDims) -> Result<Self> {
        // An empty array holds no element: its strides saturate (as `new` accepts any strides
        // for it) instead of failing on extents whose product overflows.
        let empty = shape.contains(&0);
        let mut strides = vec![0usize; shape.len()];
        let mut acc = 1usize;
        for (d, &e) in shape.iter().enumerate().rev() {
            strides[d] = acc;
            acc = match acc.checked_mul(e.max(1)) {
                Some(next) => next,
                None if empty => usize::MAX,
                // The product past the outermost dim is no stride; `new` refuses the array
                // (its length overflows) with its own message.
                None if d == 0 => acc,
                None => return Err(Error::invalid("the array's size overflows")),
            };
        }
        Self::new(element, shape, &strides, dims)
    }

    /// The element type.
    pub fn element(&self) -> ElementType {
        self.element
    }

    /// Extent of each dim.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Stride of each dim, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// The horizontal dims.
    pub fn dims(&self) -> HorizontalDims {
        self.dims
    }

    /// Number of dims.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Elements an array with this layout must hold (index of the last element + 1).
    pub fn required_len(&self) -> usize {
        self.required_len
    }

    /// Bytes an array with this layout must hold.
    pub fn required_bytes(&self) -> usize {
        self.required_len * self.element.size()
    }

    /// Checks that `region` has one range per dim, each ordered and inside the array.
    fn check_region(&self, what: &str, region: &[Range<usize>]) -> Result<()> {
        if region.len() != self.ndim() {
            return Err(Error::invalid(format!(
                "the {what} region has {} ranges for an array of {} dims",
                region.len(),
                self.ndim()
            )));
        }
        for (d, (r, &n)) in region.iter().zip(&self.shape).enumerate() {
            if r.start > r.end {
                return Err(Error::invalid(format!(
                    "the {what} region's range {}..{} in dim {d} is reversed (start after end)",
                    r.start, r.end
                )));
            }
            if r.end > n {
                return Err(Error::invalid(format!(
                    "the {what} region's range {}..{} in dim {d} is not inside 0..{n}",
                    r.start, r.end
                )));
            }
        }
        Ok(())
    }
}

/// Elements of a box with these extents: 0 when one is 0 (an array with a zero extent skips
/// the size checks, so its other extents may be huge: their product is never taken), else
/// their product, which fits: a non-empty box lies inside an array whose size was checked.
pub(crate) fn box_elements(extents: impl IntoIterator<Item = usize>) -> usize {
    let (empty, product) =
        extents.into_iter().fold((false, 1usize), |(empty, p), e| (empty || e == 0, p.saturating_mul(e)));
    if empty {
        0
    } else {
        product
    }
}

/// `Some(d)` when `dim` is out of range.
fn out_of_range(dim: Option<usize>, n: usize) -> Option<usize> {
    dim.filter(|&d| d >= n)
}

fn required_len(shape: &[usize], strides: &[usize]) -> Result<usize> {
    if shape.contains(&0) {
        return Ok(0);
    }
    let mut last = 0usize;
    for (&e, &s) in shape.iter().zip(strides) {
        last = (e - 1)
            .checked_mul(s)
            .and_then(|span| last.checked_add(span))
            .ok_or_else(|| Error::invalid("the array's size overflows"))?;
    }
    last.checked_add(1).ok_or_else(|| Error::invalid("the array's size overflows"))
}

/// Dims with more than one element, sorted by stride, must each start past the span of the
/// ones below: the elements from their first to one past their last, `(e - 1) * s` plus the
/// span below. Then distinct indices are distinct elements (at the highest dim where two
/// indices differ, the stride outweighs any difference below it), rows that interleave with
/// another's padding included.
fn check_no_overlap(shape: &[usize], strides: &[usize]) -> Result<()> {
    if shape.contains(&0) {
        return Ok(());
    }
    let mut dims: Vec<(usize, usize)> =
        shape.iter().zip(strides).filter(|(&e, _)| e > 1).map(|(&e, &s)| (s, e)).collect();
    dims.sort_unstable();
    let mut span = 1usize; // elements covered by the dims so far
    for (s, e) in dims {
        if s < span {
            return Err(Error::invalid(format!(
                "dims overlap in memory: stride {s} is inside the span {span} of the smaller-stride dims \
                 (shape {shape:?}, strides {strides:?})"
            )));
        }
        span = (e - 1)
            .checked_mul(s)
            .and_then(|last| last.checked_add(span))
            .ok_or_else(|| Error::invalid("the array's size overflows"))?;
    }
    Ok(())
}

/// One transfer of one array: the region to pack, the clockwise quarter turns (0..=3) that
/// bring it into the receiver's frame, and the region it is unpacked into. See the
/// [module docs](crate::halo) for the rotation rule.
///
/// # Examples
///
/// ```
/// use cuferry::halo::{ElementType, HaloExchange, HaloSpec, HorizontalDims};
/// let spec = HaloSpec::contiguous(ElementType::F64, &[10, 8], HorizontalDims::xy(0, 1))?;
/// // A 3 x 5 block turned once clockwise lands in a 5 x 3 block.
/// let ex = HaloExchange::new(&spec, &[0..3, 0..5], 1, &[4..9, 5..8])?;
/// assert_eq!(ex.rotated_pack_shape(), vec![5, 3]);
/// assert!(HaloExchange::new(&spec, &[0..3, 0..5], 1, &[4..7, 3..8]).is_err()); // 3 x 5
/// # Ok::<(), cuferry::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HaloExchange {
    spec: HaloSpec,
    pack: Vec<Range<usize>>,
    rotation: u32,
    unpack: Vec<Range<usize>>,
}

impl HaloExchange {
    /// An exchange whose rotated pack region has the unpack region's shape.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when a region has the wrong number of ranges, a range is
    /// reversed or outside the array, `rotation > 3`, or the rotated pack shape differs from
    /// the unpack shape.
    pub fn new(
        spec: &HaloSpec,
        pack: &[Range<usize>],
        rotation: u32,
        unpack: &[Range<usize>],
    ) -> Result<Self> {
        let ex = Self::vector_component(spec, pack, rotation, unpack)?;
        let (rotated, target) = (ex.rotated_pack_shape(), ex.unpack_shape());
        if rotated != target {
            return Err(Error::invalid(format!(
                "the pack region {pack:?} turned {rotation} time(s) has shape {rotated:?}, but the unpack \
                 region {unpack:?} has shape {target:?}"
            )));
        }
        Ok(ex)
    }

    /// One component of a vector quantity whose components have different layouts (staggered
    /// grids): like [`HaloExchange::new`] but without the shape check, because an odd rotation
    /// sends the other component's pack region into this unpack region. The packer checks the
    /// shapes of each slot against the component that actually fills it.
    ///
    /// # Errors
    ///
    /// As [`HaloExchange::new`], without the shape mismatch.
    pub fn vector_component(
        spec: &HaloSpec,
        pack: &[Range<usize>],
        rotation: u32,
        unpack: &[Range<usize>],
    ) -> Result<Self> {
        if rotation > 3 {
            return Err(Error::invalid(format!(
                "rotation {rotation} is not a number of quarter turns in 0..=3"
            )));
        }
        spec.check_region("pack", pack)?;
        spec.check_region("unpack", unpack)?;
        Ok(HaloExchange { spec: spec.clone(), pack: pack.to_vec(), rotation, unpack: unpack.to_vec() })
    }

    /// The array layout.
    pub fn spec(&self) -> &HaloSpec {
        &self.spec
    }

    /// The region packed, one range per dim.
    pub fn pack_region(&self) -> &[Range<usize>] {
        &self.pack
    }

    /// Clockwise quarter turns applied while packing (0..=3).
    pub fn rotation(&self) -> u32 {
        self.rotation
    }

    /// The region unpacked into, one range per dim.
    pub fn unpack_region(&self) -> &[Range<usize>] {
        &self.unpack
    }

    /// Whether this exchange's unpack region and `other`'s share an index (both on arrays of
    /// one spec): two unpacks into one array must not, or the later would win.
    pub(crate) fn unpack_overlaps(&self, other: &HaloExchange) -> bool {
        self.unpack.iter().zip(&other.unpack).all(|(r, s)| r.start < s.end && s.start < r.end)
    }

    /// Number of elements unpacked: the size of the unpack region. For exchanges made by
    /// [`HaloExchange::new`] it is also the number packed; a
    /// [`vector_component`](HaloExchange::vector_component) turned an odd number of times packs
    /// its own pack region (which may differ in size) into the slot the other component
    /// unpacks from.
    pub fn elements(&self) -> usize {
        box_elements(self.unpack.iter().map(|r| r.end - r.start))
    }

    /// Shape of the pack region after the rotation.
    pub fn rotated_pack_shape(&self) -> Vec<usize> {
        let mut shape: Vec<usize> = self.pack.iter().map(|r| r.end - r.start).collect();
        if let (Some(x), Some(y)) = (self.spec.dims.x, self.spec.dims.y) {
            if self.rotation % 2 == 1 {
                shape.swap(x, y);
            }
        }
        shape
    }

    /// Shape of the unpack region.
    pub fn unpack_shape(&self) -> Vec<usize> {
        self.unpack.iter().map(|r| r.end - r.start).collect()
    }

    /// The pack region as a strided view with the rotation folded in (output order).
    pub(crate) fn pack_view(&self) -> View {
        View::region(&self.spec, &self.pack).rotated(self.spec.dims, self.rotation)
    }

    /// The unpack region as a strided view.
    pub(crate) fn unpack_view(&self) -> View {
        View::region(&self.spec, &self.unpack)
    }
}

/// A strided view into an array: element `o` (a multi-index over `shape`) is at element
/// `offset + sum(o[d] * strides[d])` of the array. Signed strides express flips and turns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct View {
    pub(crate) offset: usize,
    pub(crate) shape: Vec<usize>,
    pub(crate) strides: Vec<isize>,
}

impl View {
    /// The region of a spec'd array (ranges already checked against the spec).
    fn region(spec: &HaloSpec, region: &[Range<usize>]) -> View {
        let empty = region.iter().any(|r| r.start == r.end);
        // Inside the array (checked), so the sum is below required_len and fits.
        let offset =
            if empty { 0 } else { region.iter().zip(&spec.strides).map(|(r, &s)| r.start * s).sum() };
        View {
            offset,
            shape: region.iter().map(|r| r.end - r.start).collect(),
            // Strides fit in isize: required_len * element size fits (checked by the spec).
            strides: spec.strides.iter().map(|&s| s as isize).collect(),
        }
    }

    fn elements(&self) -> usize {
        box_elements(self.shape.iter().copied())
    }

    /// Flips dim `d`: index i reads what index n-1-i read. A dim of at most one element reads
    /// the same either way and is left alone: its stride is unchecked (any value is accepted
    /// for it), so negating it could overflow.
    fn flip(&mut self, d: usize) {
        let n = self.shape[d];
        if n <= 1 {
            return;
        }
        self.offset = (self.offset as isize + (n as isize - 1) * self.strides[d]) as usize;
        self.strides[d] = -self.strides[d];
    }

    /// The view turned `k` times clockwise (see the module docs), in output order.
    fn rotated(mut self, dims: HorizontalDims, k: u32) -> View {
        if self.elements() == 0 {
            // Nothing is read; only the shape matters.
            if let (Some(x), Some(y), 1 | 3) = (dims.x, dims.y, k) {
                self.shape.swap(x, y);
                self.strides.swap(x, y);
            }
            return self;
        }
        match (dims.x, dims.y, k) {
            (_, _, 0) | (None, None, _) => {}
            (Some(x), Some(y), 1) => {
                // R(i, j) = S(nx-1-j, i): output x walks source y, output y walks source x back.
                self.flip(x);
                self.shape.swap(x, y);
                self.strides.swap(x, y);
            }
            (Some(x), Some(y), 3) => {
                // R(i, j) = S(j, ny-1-i).
                self.flip(y);
                self.shape.swap(x, y);
                self.strides.swap(x, y);
            }
            (x, y, 2) => {
                for d in [x, y].into_iter().flatten() {
                    self.flip(d);
                }
            }
            (Some(x), None, 1) => self.flip(x),
            (None, Some(y), 3) => self.flip(y),
            _ => {}
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(v: &View, o: &[usize]) -> usize {
        (v.offset as isize + o.iter().zip(&v.strides).map(|(&i, &s)| i as isize * s).sum::<isize>()) as usize
    }

    #[test]
    fn quarter_turn_matches_the_formula() {
        // 4 x 3 (x, y) array, x stride 1, y stride 4: element (i, j) is at i + 4 j.
        let spec = HaloSpec::new(ElementType::U8, &[4, 3], &[1, 4], HorizontalDims::xy(0, 1)).unwrap();
        let ex = HaloExchange::new(&spec, &[0..4, 0..3], 1, &[0..3, 0..3]);
        assert!(ex.is_err()); // 3 x 4 does not fit 3 x 3
        let v = View::region(&spec, &[0..4, 0..3]).rotated(spec.dims, 1);
        assert_eq!(v.shape, vec![3, 4]);
        for i in 0..3 {
            for j in 0..4 {
                assert_eq!(at(&v, &[i, j]), (3 - j) + 4 * i);
            }
        }
        let v3 = View::region(&spec, &[0..4, 0..3]).rotated(spec.dims, 3);
        for i in 0..3 {
            for j in 0..4 {
                assert_eq!(at(&v3, &[i, j]), j + 4 * (2 - i));
            }
        }
    }
}
