//! The element types of linear operators: `f32`, `f64`, `Complex<f32>`, `Complex<f64>`.
//!
//! Rules:
//! - [`Field`] is sealed: the four types above are the only ones; kernels rely on them being
//!   plain data ([`Element`]) with the usual arithmetic.
//! - `conj` is the identity for real types, so one code path serves both (the adjoint of a
//!   real operator is its transpose, of a complex one its conjugate transpose).
//! - `abs` is the modulus as `f64`, used for tolerances (`|<Ax, y> - <x, A^H y>|`).
//!
//! # Examples
//!
//! ```
//! use cuferry::linop::Field;
//! use num_complex::Complex;
//!
//! let z = Complex::new(3.0f64, 4.0);
//! assert_eq!(z.conj(), Complex::new(3.0, -4.0));
//! assert_eq!(Field::abs(z), 5.0);
//! assert_eq!(<f32 as Field>::from_parts(2.0, 7.0), 2.0); // the imaginary part is dropped
//! ```

use std::fmt::Debug;
use std::ops::{Add, AddAssign, Mul, Neg, Sub};

use num_complex::Complex;

use crate::memory::Element;

mod sealed {
    /// Restricts [`Field`](super::Field) to the four supported types.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for num_complex::Complex<f32> {}
    impl Sealed for num_complex::Complex<f64> {}
}

/// A scalar type of linear operators (sealed: `f32`, `f64`, `Complex<f32>`, `Complex<f64>`).
pub trait Field:
    Element
    + Debug
    + PartialEq
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + sealed::Sealed
    + 'static
{
    /// Whether the type is complex.
    const IS_COMPLEX: bool;
    /// A short name for messages, e.g. `"c64"` for `Complex<f32>`.
    const NAME: &'static str;
    /// The element code of the CUDA kernels (`CUFERRY_LINOP_*` of csrc/cuferry_cuda.h).
    #[doc(hidden)]
    const KERNEL_CODE: i32;

    /// The additive identity.
    fn zero() -> Self;
    /// The multiplicative identity.
    fn one() -> Self;
    /// The complex conjugate (the value itself for real types).
    fn conj(self) -> Self;
    /// The value `re + i im`; real types drop `im`.
    fn from_parts(re: f64, im: f64) -> Self;
    /// The real value `v`.
    fn from_f64(v: f64) -> Self {
        Self::from_parts(v, 0.0)
    }
    /// The real part as `f64`.
    fn re(self) -> f64;
    /// The imaginary part as `f64` (0 for real types).
    fn im(self) -> f64;
    /// The modulus as `f64`.
    fn abs(self) -> f64 {
        self.norm_sqr().sqrt()
    }
    /// The squared modulus as `f64`.
    fn norm_sqr(self) -> f64 {
        let (re, im) = (self.re(), self.im());
        re * re + im * im
    }
}

macro_rules! real_field {
    ($t:ty, $name:literal, $code:expr) => {
        impl Field for $t {
            const IS_COMPLEX: bool = false;
            const NAME: &'static str = $name;
            const KERNEL_CODE: i32 = $code;
            fn zero() -> Self {
                0.0
            }
            fn one() -> Self {
                1.0
            }
            #[inline(always)]
            fn conj(self) -> Self {
                self
            }
            fn from_parts(re: f64, _im: f64) -> Self {
                re as $t
            }
            fn re(self) -> f64 {
                self as f64
            }
            fn im(self) -> f64 {
                0.0
            }
            fn abs(self) -> f64 {
                (self as f64).abs()
            }
        }
    };
}

macro_rules! complex_field {
    ($t:ty, $name:literal, $code:expr) => {
        impl Field for Complex<$t> {
            const IS_COMPLEX: bool = true;
            const NAME: &'static str = $name;
            const KERNEL_CODE: i32 = $code;
            fn zero() -> Self {
                Complex::new(0.0, 0.0)
            }
            fn one() -> Self {
                Complex::new(1.0, 0.0)
            }
            #[inline(always)]
            fn conj(self) -> Self {
                Complex::conj(&self)
            }
            fn from_parts(re: f64, im: f64) -> Self {
                Complex::new(re as $t, im as $t)
            }
            fn re(self) -> f64 {
                self.re as f64
            }
            fn im(self) -> f64 {
                self.im as f64
            }
        }
    };
}

real_field!(f32, "f32", crate::sys::CUFERRY_LINOP_F32);
real_field!(f64, "f64", crate::sys::CUFERRY_LINOP_F64);
complex_field!(f32, "c64", crate::sys::CUFERRY_LINOP_C32);
complex_field!(f64, "c128", crate::sys::CUFERRY_LINOP_C64);
