//! What a slot holds: several arrays at offsets, each with an element type and a shape.
//!
//! Rules:
//! - Offsets are aligned to [`SLOT_ALIGN`] bytes (device-friendly, and enough for every
//!   element type), in the order the arrays were pushed.
//! - A layout is checked against the slot size when it is published; an array never extends
//!   past the slot's byte length.

use crate::error::{Error, Result};

/// Alignment of every array inside a slot, in bytes.
pub const SLOT_ALIGN: usize = 256;

/// Element type of an array in a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `u8`
    U8,
    /// `i8`
    I8,
    /// `u16`
    U16,
    /// `i16`
    I16,
    /// `u32`
    U32,
    /// `i32`
    I32,
    /// `u64`
    U64,
    /// `i64`
    I64,
    /// `f32`
    F32,
    /// `f64`
    F64,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::U16 | DType::I16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }
}

/// Rust types that name a [`DType`].
pub trait HasDType: crate::Element {
    /// The matching element type.
    const DTYPE: DType;
}

macro_rules! has_dtype {
    ($($t:ty => $d:ident),*) => { $(impl HasDType for $t { const DTYPE: DType = DType::$d; })* };
}
has_dtype!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, u64 => U64, i64 => I64,
    f32 => F32, f64 => F64);

/// One array inside a slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArrayLayout {
    /// Byte offset from the start of the slot.
    pub offset: usize,
    /// Element type.
    pub dtype: DType,
    /// Shape (row-major, contiguous).
    pub shape: Vec<usize>,
}

impl ArrayLayout {
    /// Number of elements; `usize::MAX` when the shape's product overflows (possible only in a
    /// layout built by hand: it then fits no slot, and no data matches it).
    pub fn len(&self) -> usize {
        self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).unwrap_or(usize::MAX)
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size in bytes (`usize::MAX` on overflow, as [`ArrayLayout::len`]).
    pub fn bytes(&self) -> usize {
        self.len().saturating_mul(self.dtype.size())
    }

    /// Checks that `data` can be this array: element type `T` and the same length.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming both.
    pub fn check_data<T: HasDType>(&self, data: &[T]) -> Result<()> {
        if self.dtype != T::DTYPE || self.len() != data.len() {
            return Err(Error::invalid(format!(
                "array of {:?} x {} given for a layout of {:?} x {}",
                T::DTYPE,
                data.len(),
                self.dtype,
                self.len()
            )));
        }
        Ok(())
    }
}

/// The arrays of a slot, in order.
///
/// # Examples
///
/// ```
/// use cuferry::ring::{DType, SlotLayout};
/// let layout = SlotLayout::new().with::<f32>(&[4, 84, 84])?.with::<i64>(&[4])?;
/// assert_eq!(layout.arrays()[1].offset, 4 * 84 * 84 * 4); // already a multiple of 256
/// assert_eq!(layout.arrays()[1].dtype, DType::I64);
/// assert_eq!(layout.total_bytes(), 4 * 84 * 84 * 4 + 32);
/// # Ok::<(), cuferry::Error>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotLayout {
    arrays: Vec<ArrayLayout>,
}

impl SlotLayout {
    /// An empty layout.
    pub fn new() -> Self {
        Self::default()
    }

    /// A layout of one byte array of `bytes` bytes.
    pub fn bytes(bytes: usize) -> Self {
        SlotLayout { arrays: vec![ArrayLayout { offset: 0, dtype: DType::U8, shape: vec![bytes] }] }
    }

    /// Appends an array of `T` with `shape` at the next aligned offset.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the sizes overflow.
    pub fn with<T: HasDType>(self, shape: &[usize]) -> Result<Self> {
        self.with_dtype(T::DTYPE, shape)
    }

    /// Appends an array of `dtype` with `shape` at the next aligned offset.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the sizes overflow.
    pub fn with_dtype(mut self, dtype: DType, shape: &[usize]) -> Result<Self> {
        let overflow = || Error::invalid(format!("slot layout overflows with an array of shape {shape:?}"));
        let end = self.total_bytes();
        let offset = end.checked_next_multiple_of(SLOT_ALIGN).ok_or_else(overflow)?;
        let len = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(overflow)?;
        len.checked_mul(dtype.size()).and_then(|b| b.checked_add(offset)).ok_or_else(overflow)?;
        self.arrays.push(ArrayLayout { offset, dtype, shape: shape.to_vec() });
        Ok(self)
    }

    /// The arrays in order.
    pub fn arrays(&self) -> &[ArrayLayout] {
        &self.arrays
    }

    /// Bytes from the start of the slot to the end of the last array.
    pub fn total_bytes(&self) -> usize {
        self.arrays.last().map_or(0, |a| a.offset + a.bytes())
    }
}

/// What the producer says about a published slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotMeta {
    /// The producer's sequence id (any value; the ring does not reorder by it).
    pub sequence: u64,
    /// Bytes to upload, from the start of the slot.
    pub bytes: usize,
    /// The arrays in the slot.
    pub layout: SlotLayout,
}

impl SlotMeta {
    /// Metadata whose byte length is the layout's total.
    pub fn new(sequence: u64, layout: SlotLayout) -> Self {
        SlotMeta { sequence, bytes: layout.total_bytes(), layout }
    }

    /// Checks the metadata against a slot of `slot_bytes` bytes.
    pub(crate) fn validate(&self, slot_bytes: usize) -> Result<()> {
        if self.bytes > slot_bytes {
            return Err(Error::invalid(format!(
                "{} bytes published into a slot of {slot_bytes}",
                self.bytes
            )));
        }
        if self.layout.total_bytes() > self.bytes {
            return Err(Error::invalid(format!(
                "the layout spans {} bytes but only {} are uploaded",
                self.layout.total_bytes(),
                self.bytes
            )));
        }
        Ok(())
    }
}
