//! Helpers shared by the linop tests (included with `#[path]`; as its own test target it is
//! empty). References here are independent of the crate: inner products and random data.
#![allow(dead_code, unused_imports)]

#[path = "../common/mod.rs"]
mod common;

pub use common::{cuda_device, two_cuda_devices, Gate, Rng};
use std::sync::Arc;

use cuferry::linop::{Add, Array, Chain, Concat, Dense, Diagonal, Dims, Field, Linop, LinopRef, Scalar};
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

fn dims(d: &[(&str, usize)]) -> Dims {
    Dims::new(d).unwrap()
}

/// Sizes of the dims of [`random_graph`]: batch `b`, input `i`, output `o`, internal `m`.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub b: usize,
    pub i: usize,
    pub o: usize,
    pub m: usize,
}

pub fn dense<T: Field>(rng: &mut Rng, spec: &DeviceSpec, wd: &[&str], i: Dims, o: Dims) -> LinopRef<T> {
    let shape: Vec<usize> = wd.iter().map(|d| i.size_of(d).or(o.size_of(d)).unwrap()).collect();
    Arc::new(Dense::new(random_array::<T>(rng, spec, &shape), wd, i, o).unwrap())
}

/// A random operator graph from (b, i) to (b, o), mixing every operator kind. Internal dim
/// `m` appears inside chains.
pub fn random_graph<T: Field>(rng: &mut Rng, spec: &DeviceSpec, s: &Sizes, depth: usize) -> LinopRef<T> {
    let bi = dims(&[("b", s.b), ("i", s.i)]);
    let bo = dims(&[("b", s.b), ("o", s.o)]);
    let bm = dims(&[("b", s.b), ("m", s.m)]);
    let kind = if depth == 0 { rng.below(3) } else { rng.below(7) };
    match kind {
        0 => dense(rng, spec, &["o", "i"], bi, bo),
        1 => dense(rng, spec, &["i", "b", "o"], bi, bo),
        2 => {
            let d: LinopRef<T> =
                Arc::new(Diagonal::new(random_array::<T>(rng, spec, &[s.i]), &["i"], bi.clone()).unwrap());
            let sc: LinopRef<T> = Arc::new(Scalar::new(T::from_parts(1.5, 0.25), bo.clone()));
            Arc::new(Chain::new(vec![d, dense(rng, spec, &["o", "i"], bi, bo), sc]).unwrap())
        }
        3 => {
            let f = dense::<T>(rng, spec, &["m", "i"], bi, bm.clone());
            let g = dense::<T>(rng, spec, &["b", "o", "m"], bm, bo);
            Arc::new(Chain::new(vec![f, g]).unwrap())
        }
        4 => {
            let a = random_graph(rng, spec, s, depth - 1);
            let b = random_graph(rng, spec, s, depth - 1);
            Arc::new(Add::new(vec![a, b]).unwrap())
        }
        5 => {
            // Block diagonal along b: two graphs on b-halves.
            let b1 = 1 + rng.below(s.b.max(2) - 1).min(s.b.saturating_sub(1));
            let (s1, s2) = (Sizes { b: b1, ..*s }, Sizes { b: s.b - b1, ..*s });
            if s2.b == 0 {
                return random_graph(rng, spec, s, depth - 1);
            }
            let a = random_graph(rng, spec, &s1, depth - 1);
            let b = random_graph(rng, spec, &s2, depth - 1);
            Arc::new(Concat::new(vec![a, b], Some("b"), Some("b")).unwrap())
        }
        _ => {
            // Two denses stacked over the output along s, then a dense from s to o.
            let s1 = 1 + rng.below(4);
            let s2 = 1 + rng.below(4);
            let top = dense::<T>(rng, spec, &["s", "i"], bi.clone(), dims(&[("b", s.b), ("s", s1)]));
            let bot = dense::<T>(rng, spec, &["s", "i"], bi, dims(&[("b", s.b), ("s", s2)]));
            let stacked: LinopRef<T> = Arc::new(Concat::new(vec![top, bot], None, Some("s")).unwrap());
            let w = dense::<T>(rng, spec, &["o", "s"], dims(&[("b", s.b), ("s", s1 + s2)]), bo);
            Arc::new(Chain::new(vec![stacked, w]).unwrap())
        }
    }
}

/// Random batch sizes over a random subset of the dims the operator knows.
pub fn random_batches<T: Field>(
    rng: &mut Rng,
    op: &dyn Linop<T>,
    candidates: &[&str],
) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for d in candidates {
        if let Some(n) = op.dim_size(d) {
            if rng.below(2) == 0 {
                out.push((d.to_string(), 1 + rng.below(n + 1)));
            }
        }
    }
    if out.is_empty() {
        if let Some(n) = op.dim_size("b") {
            out.push(("b".to_string(), 1 + rng.below(n)));
        }
    }
    out
}
