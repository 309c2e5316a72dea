//! Helpers shared by the linop tests (included with `#[path]`; as its own test target it is
//! empty). References here are independent of the crate: inner products and random data.
#![allow(dead_code, unused_imports)]

#[path = "../common/mod.rs"]
mod common;

pub use common::{cuda_device, two_cuda_devices, Rng};
use cuferry::linop::{Array, Field, Linop};
use cuferry::DeviceSpec;

/// A uniform value in [-1, 1).
pub fn uniform(rng: &mut Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
}

/// `n` random values (complex types get a random imaginary part).
pub fn random_vec<T: Field>(rng: &mut Rng, n: usize) -> Vec<T> {
    (0..n).map(|_| T::from_parts(uniform(rng), uniform(rng))).collect()
}

/// A random array shaped like `sizes` on `spec`.
pub fn random_array<T: Field>(rng: &mut Rng, spec: &DeviceSpec, sizes: &[usize]) -> Array<T> {
    let n = sizes.iter().product();
    Array::from_slice(spec, sizes, &random_vec::<T>(rng, n)).unwrap()
}

/// `<a, b> = sum conj(a_i) b_i`, as (re, im).
pub fn inner<T: Field>(a: &[T], b: &[T]) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold((0.0, 0.0), |(re, im), (&x, &y)| {
        let p = x.conj() * y;
        (re + p.re(), im + p.im())
    })
}

/// The dot test: `|<Ax, y> - <x, A^H y>| <= 1e-5 |<Ax, y>|` on random `x`, `y`.
pub fn dot_test<T: Field>(op: &dyn Linop<T>, spec: &DeviceSpec, rng: &mut Rng) {
    let x = random_array::<T>(rng, spec, op.idims().sizes());
    let y = random_array::<T>(rng, spec, op.odims().sizes());
    let ax = op.apply(&x).unwrap().to_vec().unwrap();
    let ahy = op.adjoint().apply(&y).unwrap().to_vec().unwrap();
    let lhs = inner(&ax, &y.to_vec().unwrap());
    let rhs = inner(&x.to_vec().unwrap(), &ahy);
    let diff = ((lhs.0 - rhs.0).powi(2) + (lhs.1 - rhs.1).powi(2)).sqrt();
    let scale = (lhs.0 * lhs.0 + lhs.1 * lhs.1).sqrt();
    assert!(
        diff <= 1e-5 * scale,
        "dot test failed for {op:?}: <Ax,y> = {lhs:?}, <x,A^H y> = {rhs:?} (type {})",
        T::NAME
    );
}

/// Asserts `a` and `b` agree within `tol` relative to the largest modulus.
pub fn assert_close<T: Field>(a: &[T], b: &[T], tol: f64) {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let scale = a.iter().chain(b).map(|v| v.abs()).fold(1e-300, f64::max);
    for (k, (&x, &y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * scale, "element {k}: {x:?} vs {y:?} (scale {scale})");
    }
}
