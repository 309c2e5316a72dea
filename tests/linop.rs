//! Linear operators: each operator against a scalar loop written here, the dot test for every
//! operator and for composed ones (f64 and Complex<f64>), ToDevice between host "devices"
//! (and CUDA when present), and the errors for bad graphs.

#[path = "linop_common/mod.rs"]
mod util;

use std::sync::Arc;

use cuferry::linop::{
    create_batched_linop, dim_role, split_linop, tile_ranges, transfer_stream, Add, Array, BatchSpec, Chain,
    Concat, Dense, DeviceMatrix, Diagonal, DimRole, Dims, Field, Identity, Linop, LinopRef, Scalar, ToDevice,
    Zero,
};
use cuferry::num_complex::Complex;
use cuferry::{Device, DeviceSpec, Error, Stream};
use util::{assert_close, dot_test, random_array, random_vec, Gate, Rng};

type C64 = Complex<f64>;

fn host() -> DeviceSpec {
    DeviceSpec::new(Device::Host).unwrap()
}

fn dims(d: &[(&str, usize)]) -> Dims {
    Dims::new(d).unwrap()
}

/// `y[b,o] = sum_i W[o,i] x[b,i]` against a triple loop; the adjoint against its own loop.
fn dense_matches_triple_loop<T: Field>(seed: u64) {
    let mut rng = Rng::new(seed);
    let spec = host();
    let (nb, ni, no) = (1 + rng.below(4), 1 + rng.below(9), 1 + rng.below(9));
    let w: Vec<T> = random_vec(&mut rng, no * ni);
    let x: Vec<T> = random_vec(&mut rng, nb * ni);
    let wa = Array::from_slice(&spec, &[no, ni], &w).unwrap();
    let a =
        Dense::new(wa, &["o", "i"], dims(&[("b", nb), ("i", ni)]), dims(&[("b", nb), ("o", no)])).unwrap();
    let got = a.apply(&Array::from_slice(&spec, &[nb, ni], &x).unwrap()).unwrap().to_vec().unwrap();
    let mut want = vec![T::zero(); nb * no];
    for b in 0..nb {
        for o in 0..no {
            for i in 0..ni {
                want[b * no + o] += w[o * ni + i] * x[b * ni + i];
            }
        }
    }
    assert_close(&got, &want, 1e-12);
    // Adjoint: x'[b,i] = sum_o conj(W[o,i]) y[b,o].
    let y: Vec<T> = random_vec(&mut rng, nb * no);
    let got = a.adjoint().apply(&Array::from_slice(&spec, &[nb, no], &y).unwrap()).unwrap().to_vec().unwrap();
    let mut want = vec![T::zero(); nb * ni];
    for b in 0..nb {
        for i in 0..ni {
            for o in 0..no {
                want[b * ni + i] += w[o * ni + i].conj() * y[b * no + o];
            }
        }
    }
    assert_close(&got, &want, 1e-12);
}

#[test]
fn dense_f64_matches_loops() {
    for seed in 0..8 {
        dense_matches_triple_loop::<f64>(seed);
    }
}

#[test]
fn dense_complex_matches_loops() {
    for seed in 0..8 {
        dense_matches_triple_loop::<C64>(seed);
    }
}

#[test]
fn dense_f32_and_c64_run() {
    dense_matches_triple_loop::<f32>(1);
    dense_matches_triple_loop::<Complex<f32>>(2);
}

/// A batch-varying weight `W[b,o,i]` on a permuted (strided) input view.
#[test]
fn dense_batched_weight_on_strided_input() {
    let mut rng = Rng::new(3);
    let spec = host();
    let (nb, ni, no) = (3, 4, 2);
    let w: Vec<f64> = random_vec(&mut rng, nb * no * ni);
    // x stored as [i, b]; the operator sees it permuted to [b, i].
    let xs: Vec<f64> = random_vec(&mut rng, ni * nb);
    let x = Array::from_slice(&spec, &[ni, nb], &xs).unwrap().permute(&[1, 0]).unwrap();
    assert!(!x.is_contiguous());
    let a = Dense::new(
        Array::from_slice(&spec, &[nb, no, ni], &w).unwrap(),
        &["b", "o", "i"],
        dims(&[("b", nb), ("i", ni)]),
        dims(&[("b", nb), ("o", no)]),
    )
    .unwrap();
    let got = a.apply(&x).unwrap().to_vec().unwrap();
    let mut want = vec![0.0; nb * no];
    for b in 0..nb {
        for o in 0..no {
            for i in 0..ni {
                want[b * no + o] += w[(b * no + o) * ni + i] * xs[i * nb + b];
            }
        }
    }
    assert_close(&got, &want, 1e-12);
}

/// Names of the any-order test: `b` is a batch dim (input and output), `i` and `j` are
/// contracted (input only), `o` and `p` are produced (output only).
const EINSUM_NAMES: [&str; 5] = ["b", "i", "j", "o", "p"];

/// `names` in a random order (Fisher-Yates).
fn shuffled<'a>(rng: &mut Rng, names: &[&'a str]) -> Vec<&'a str> {
    let mut v = names.to_vec();
    for k in (1..v.len()).rev() {
        v.swap(k, rng.below(k + 1));
    }
    v
}

/// The row-major flat index of `order` (dim names) under the full assignment `at` (one index
/// per name of `EINSUM_NAMES`), with `size` giving each name's extent.
fn flat_index(order: &[&str], at: &[usize; 5], size: &[usize; 5]) -> usize {
    order.iter().fold(0, |acc, name| {
        let k = EINSUM_NAMES.iter().position(|n| n == name).unwrap();
        acc * size[k] + at[k]
    })
}

/// Every assignment of the five names, in any order (a plain odometer).
fn every_assignment(size: &[usize; 5]) -> Vec<[usize; 5]> {
    let mut all = vec![];
    let mut at = [0usize; 5];
    'outer: loop {
        all.push(at);
        for k in (0..5).rev() {
            at[k] += 1;
            if at[k] < size[k] {
                continue 'outer;
            }
            at[k] = 0;
        }
        break;
    }
    all
}

/// Dense weights whose dims come in any order (input dims first, batch dims in the middle,
/// some dims absent) over inputs and outputs whose dims are also in any order: forward and
/// adjoint against `y[odims] += W[wdims] * x[idims]` summed over every assignment of the
/// names, on the host and, when present, on CUDA.
fn dense_in_any_axis_order<T: Field>(seed: u64) {
    let mut rng = Rng::new(seed);
    let spec = host();
    let size: [usize; 5] = std::array::from_fn(|_| 1 + rng.below(4));
    let extent = |name: &str| size[EINSUM_NAMES.iter().position(|n| *n == name).unwrap()];
    let named = |order: &[&str]| dims(&order.iter().map(|n| (*n, extent(n))).collect::<Vec<_>>());
    let iorder = shuffled(&mut rng, &["b", "i", "j"]);
    let oorder = shuffled(&mut rng, &["b", "o", "p"]);
    let mut worder: Vec<&str> =
        shuffled(&mut rng, &EINSUM_NAMES).into_iter().filter(|_| rng.below(4) > 0).collect();
    if worder.is_empty() {
        worder.push("i");
    }
    let wshape: Vec<usize> = worder.iter().map(|n| extent(n)).collect();
    let (ishape, oshape): (Vec<usize>, Vec<usize>) =
        (iorder.iter().map(|n| extent(n)).collect(), oorder.iter().map(|n| extent(n)).collect());
    let w: Vec<T> = random_vec(&mut rng, wshape.iter().product());
    let x: Vec<T> = random_vec(&mut rng, ishape.iter().product());
    let y: Vec<T> = random_vec(&mut rng, oshape.iter().product());
    let op: LinopRef<T> = Arc::new(
        Dense::new(Array::from_slice(&spec, &wshape, &w).unwrap(), &worder, named(&iorder), named(&oorder))
            .unwrap(),
    );
    let mut want_y = vec![T::zero(); y.len()];
    let mut want_x = vec![T::zero(); x.len()];
    for at in every_assignment(&size) {
        let (wk, ik, ok) = (
            flat_index(&worder, &at, &size),
            flat_index(&iorder, &at, &size),
            flat_index(&oorder, &at, &size),
        );
        want_y[ok] += w[wk] * x[ik];
        want_x[ik] += w[wk].conj() * y[ok];
    }
    // Shown with a failure's output (the harness captures it otherwise).
    eprintln!("seed {seed}: weight {worder:?}, input {iorder:?}, output {oorder:?}, sizes {size:?}");
    let xa = Array::from_slice(&spec, &ishape, &x).unwrap();
    let ya = Array::from_slice(&spec, &oshape, &y).unwrap();
    assert_close(&op.apply(&xa).unwrap().to_vec().unwrap(), &want_y, 1e-5);
    assert_close(&op.adjoint().apply(&ya).unwrap().to_vec().unwrap(), &want_x, 1e-5);
    let Some(dev) = util::cuda_device() else { return };
    let c = DeviceSpec::new(dev).unwrap();
    let on_gpu = op.place_on(&c).unwrap();
    let up = |a: &Array<T>, d: &Dims| ToDevice::new(spec.clone(), c.clone(), d.clone()).apply(a).unwrap();
    let got = on_gpu.apply(&up(&xa, op.idims())).unwrap().to_vec().unwrap();
    assert_close(&got, &want_y, 1e-5);
    let got = on_gpu.adjoint().apply(&up(&ya, op.odims())).unwrap().to_vec().unwrap();
    assert_close(&got, &want_x, 1e-5);
}

#[test]
fn dense_weights_in_any_axis_order_match_named_loops() {
    for seed in 0..40 {
        dense_in_any_axis_order::<f64>(seed);
        dense_in_any_axis_order::<C64>(100 + seed);
    }
    dense_in_any_axis_order::<f32>(200);
}

#[test]
fn diagonal_broadcasts_over_other_dims() {
    let mut rng = Rng::new(5);
    let spec = host();
    let (nx, ny) = (3, 5);
    let w: Vec<C64> = random_vec(&mut rng, nx);
    let x: Vec<C64> = random_vec(&mut rng, nx * ny);
    let d =
        Diagonal::new(Array::from_slice(&spec, &[nx], &w).unwrap(), &["x"], dims(&[("x", nx), ("y", ny)]))
            .unwrap();
    let xa = Array::from_slice(&spec, &[nx, ny], &x).unwrap();
    let got = d.apply(&xa).unwrap().to_vec().unwrap();
    let want: Vec<C64> = (0..nx * ny).map(|k| w[k / ny] * x[k]).collect();
    assert_close(&got, &want, 1e-14);
    let got = d.adjoint().apply(&xa).unwrap().to_vec().unwrap();
    let want: Vec<C64> = (0..nx * ny).map(|k| w[k / ny].conj() * x[k]).collect();
    assert_close(&got, &want, 1e-14);
    let got = d.normal().apply(&xa).unwrap().to_vec().unwrap();
    let want: Vec<C64> = (0..nx * ny).map(|k| C64::from(w[k / ny].norm_sqr()) * x[k]).collect();
    assert_close(&got, &want, 1e-14);
}

#[test]
fn scalar_identity_add_chain_match_loops() {
    let mut rng = Rng::new(9);
    let spec = host();
    let d = dims(&[("x", 4), ("y", 3)]);
    let x: Vec<C64> = random_vec(&mut rng, 12);
    let xa = Array::from_slice(&spec, &[4, 3], &x).unwrap();
    let alpha = C64::new(0.5, -2.0);
    let s: LinopRef<C64> = Arc::new(Scalar::new(alpha, d.clone()));
    let i: LinopRef<C64> = Arc::new(Identity::new(d.clone()));
    assert_eq!(i.apply(&xa).unwrap().to_vec().unwrap(), x);
    let want: Vec<C64> = x.iter().map(|&v| alpha * v).collect();
    assert_close(&s.apply(&xa).unwrap().to_vec().unwrap(), &want, 1e-15);
    let want: Vec<C64> = x.iter().map(|&v| alpha.conj() * v).collect();
    assert_close(&s.adjoint().apply(&xa).unwrap().to_vec().unwrap(), &want, 1e-15);
    let sum = Add::new(vec![Arc::clone(&s), Arc::clone(&i), Arc::clone(&s)]).unwrap();
    let want: Vec<C64> = x.iter().map(|&v| alpha * v + v + alpha * v).collect();
    assert_close(&sum.apply(&xa).unwrap().to_vec().unwrap(), &want, 1e-14);
    let chain = Chain::new(vec![Arc::clone(&s), Arc::clone(&s), i]).unwrap();
    let want: Vec<C64> = x.iter().map(|&v| alpha * alpha * v).collect();
    assert_close(&chain.apply(&xa).unwrap().to_vec().unwrap(), &want, 1e-14);
}

/// The three kinds of Concat against slices computed by hand.
#[test]
fn concat_kinds_match_loops() {
    let mut rng = Rng::new(13);
    let spec = host();
    let (n1, n2) = (2, 3);
    let w1: Vec<f64> = random_vec(&mut rng, n1);
    let w2: Vec<f64> = random_vec(&mut rng, n2);
    let diag = |w: &[f64], n: usize| -> LinopRef<f64> {
        Arc::new(
            Diagonal::new(Array::from_slice(&spec, &[n], w).unwrap(), &["x"], dims(&[("x", n)])).unwrap(),
        )
    };
    let x: Vec<f64> = random_vec(&mut rng, n1 + n2);
    let xa = Array::from_slice(&spec, &[n1 + n2], &x).unwrap();
    // Block diagonal.
    let bd = Concat::new(vec![diag(&w1, n1), diag(&w2, n2)], Some("x"), Some("x")).unwrap();
    let want: Vec<f64> =
        (0..n1 + n2).map(|k| if k < n1 { w1[k] * x[k] } else { w2[k - n1] * x[k] }).collect();
    assert_close(&bd.apply(&xa).unwrap().to_vec().unwrap(), &want, 1e-15);
    // Over the output: dense rows stacked; over the input: dense columns summed.
    let m = 4;
    let wa: Vec<f64> = random_vec(&mut rng, 2 * m);
    let wb: Vec<f64> = random_vec(&mut rng, 3 * m);
    let dense = |w: &[f64], no: usize| -> LinopRef<f64> {
        Arc::new(
            Dense::new(
                Array::from_slice(&spec, &[no, m], w).unwrap(),
                &["o", "i"],
                dims(&[("i", m)]),
                dims(&[("o", no)]),
            )
            .unwrap(),
        )
    };
    let xm: Vec<f64> = random_vec(&mut rng, m);
    let rows = Concat::new(vec![dense(&wa, 2), dense(&wb, 3)], None, Some("o")).unwrap();
    let got = rows.apply(&Array::from_slice(&spec, &[m], &xm).unwrap()).unwrap().to_vec().unwrap();
    let mut want = vec![0.0; 5];
    for o in 0..5 {
        for i in 0..m {
            want[o] += if o < 2 { wa[o * m + i] } else { wb[(o - 2) * m + i] } * xm[i];
        }
    }
    assert_close(&got, &want, 1e-14);
    let cols = rows.adjoint();
    assert_eq!(dim_role(cols.as_ref(), "o"), DimRole::Input);
    let y: Vec<f64> = random_vec(&mut rng, 5);
    let got = cols.apply(&Array::from_slice(&spec, &[5], &y).unwrap()).unwrap().to_vec().unwrap();
    let mut want = vec![0.0; m];
    for i in 0..m {
        for o in 0..5 {
            want[i] += if o < 2 { wa[o * m + i] } else { wb[(o - 2) * m + i] } * y[o];
        }
    }
    assert_close(&got, &want, 1e-14);
}

/// Operators over shared dims, built on `spec`: Dense with a plain and a batch-varying weight,
/// a Dense pair through an inner dim `m`, a Diagonal and a Scalar.
struct Zoo<T: Field> {
    a: LinopRef<T>,
    a2: LinopRef<T>,
    f: LinopRef<T>,
    g: LinopRef<T>,
    diag: LinopRef<T>,
    scalar: LinopRef<T>,
    bi: Dims,
    bo: Dims,
}

fn zoo<T: Field>(rng: &mut Rng, spec: &DeviceSpec, (nb, ni, no, nm): (usize, usize, usize, usize)) -> Zoo<T> {
    let dense = |rng: &mut Rng, wd: &[&str], ws: &[usize], i: Dims, o: Dims| -> LinopRef<T> {
        Arc::new(Dense::new(random_array::<T>(rng, spec, ws), wd, i, o).unwrap())
    };
    let bi = dims(&[("b", nb), ("i", ni)]);
    let bm = dims(&[("b", nb), ("m", nm)]);
    let bo = dims(&[("b", nb), ("o", no)]);
    let a = dense(rng, &["o", "i"], &[no, ni], bi.clone(), bo.clone());
    let a2 = dense(rng, &["b", "o", "i"], &[nb, no, ni], bi.clone(), bo.clone());
    let f = dense(rng, &["m", "i"], &[nm, ni], bi.clone(), bm.clone());
    let g = dense(rng, &["o", "m", "b"], &[no, nm, nb], bm, bo.clone());
    let diag: LinopRef<T> =
        Arc::new(Diagonal::new(random_array::<T>(rng, spec, &[ni]), &["i"], bi.clone()).unwrap());
    let scalar: LinopRef<T> = Arc::new(Scalar::new(T::from_parts(0.3, -1.1), bo.clone()));
    Zoo { a, a2, f, g, diag, scalar, bi, bo }
}

/// Every operator and some compositions pass the dot test.
fn dot_tests<T: Field>(seed: u64) {
    let mut rng = Rng::new(seed);
    let spec = host();
    let other = host();
    let sizes = (2 + rng.below(3), 1 + rng.below(6), 1 + rng.below(6), 1 + rng.below(5));
    let Zoo { a, a2, f, g, diag, scalar, bi, bo } = zoo::<T>(&mut rng, &spec, sizes);
    let ident: LinopRef<T> = Arc::new(Identity::new(bi.clone()));
    let move_there: LinopRef<T> = Arc::new(ToDevice::new(spec.clone(), other.clone(), bi.clone()));
    let move_back: LinopRef<T> = Arc::new(ToDevice::new(other.clone(), spec.clone(), bo.clone()));
    let ops: Vec<LinopRef<T>> = vec![
        Arc::clone(&a),
        Arc::clone(&a2),
        Arc::clone(&diag),
        Arc::clone(&scalar),
        Arc::clone(&ident),
        Arc::new(ToDevice::new(spec.clone(), spec.clone(), bi.clone())),
        Arc::new(
            Chain::new(vec![Arc::clone(&diag), Arc::clone(&f), Arc::clone(&g), Arc::clone(&scalar)]).unwrap(),
        ),
        Arc::new(
            Add::new(vec![Arc::clone(&a), Arc::clone(&a2), Arc::new(Chain::new(vec![f, g]).unwrap())])
                .unwrap(),
        ),
        Arc::new(Concat::new(vec![Arc::clone(&a), Arc::clone(&a2)], None, Some("o")).unwrap()),
        Arc::new(Concat::new(vec![Arc::clone(&a), Arc::clone(&a2)], Some("i"), None).unwrap()),
        Arc::new(Concat::new(vec![Arc::clone(&a), Arc::clone(&a2)], Some("b"), Some("b")).unwrap()),
        Arc::new(Chain::new(vec![move_there, a.place_on(&other).unwrap(), move_back]).unwrap()),
        a.normal(),
        Arc::new(Chain::new(vec![Arc::clone(&a), a.adjoint()]).unwrap()),
    ];
    for op in &ops {
        dot_test(op.as_ref(), &spec, &mut rng);
        dot_test(op.adjoint().as_ref(), &spec, &mut rng);
    }
}

#[test]
fn dot_test_f64() {
    for seed in 0..4 {
        dot_tests::<f64>(seed);
    }
}

#[test]
fn dot_test_complex() {
    for seed in 10..14 {
        dot_tests::<C64>(seed);
    }
}

#[test]
fn to_device_between_host_devices() {
    let mut rng = Rng::new(21);
    let (a, b) = (
        host(),
        DeviceSpec::with_streams(Device::Host, cuferry::Stream::new(Device::Host).unwrap(), None).unwrap(),
    );
    let d = dims(&[("x", 1000), ("y", 33)]);
    let t = ToDevice::new(a.clone(), b.clone(), d.clone());
    let x: Array<C64> = random_array(&mut rng, &a, &[1000, 33]);
    let y = t.apply(&x).unwrap();
    assert_eq!(y.spec().compute_stream.id(), b.compute_stream.id());
    assert_eq!(y.to_vec().unwrap(), x.to_vec().unwrap());
    let back = Linop::<C64>::adjoint(&t).apply(&y).unwrap();
    assert_eq!(back.spec().compute_stream.id(), a.compute_stream.id());
    assert_eq!(back.to_vec().unwrap(), x.to_vec().unwrap());
    // The normal of a transfer is the identity on its source: a transfer from there to there.
    let n = Linop::<C64>::normal(&t);
    assert_eq!(n.name(), "ToDevice");
    let nx = n.apply(&x).unwrap();
    assert_eq!(nx.spec().compute_stream.id(), a.compute_stream.id());
    assert_eq!(nx.to_vec().unwrap(), x.to_vec().unwrap());
    // A view (slice) moves as its elements.
    let v = x.slice(1, 3..10).unwrap();
    let tv = ToDevice::new(a.clone(), b.clone(), dims(&[("x", 1000), ("y", 7)]));
    let moved = tv.apply(&v).unwrap();
    let want: Vec<C64> = x.to_vec().unwrap().chunks(33).flat_map(|r| r[3..10].to_vec()).collect();
    assert_eq!(moved.to_vec().unwrap(), want);
}

/// Many transfers queued back to back and consumed on the target's stream keep their order
/// and values (the pipelined path).
#[test]
fn pipelined_transfers_keep_values() {
    let mut rng = Rng::new(23);
    let (a, b) = (host(), host());
    let d = dims(&[("x", 4096)]);
    let there = ToDevice::new(a.clone(), b.clone(), d.clone());
    let back = ToDevice::new(b.clone(), a.clone(), d.clone());
    let scale = Scalar::new(2.0f64, d);
    let xs: Vec<Array<f64>> = (0..16).map(|_| random_array(&mut rng, &a, &[4096])).collect();
    let ys: Vec<Array<f64>> = xs
        .iter()
        .map(|x| {
            Linop::<f64>::apply(&back, &scale.apply(&Linop::<f64>::apply(&there, x).unwrap()).unwrap())
                .unwrap()
        })
        .collect();
    for (x, y) in xs.iter().zip(&ys) {
        let want: Vec<f64> = x.to_vec().unwrap().iter().map(|v| 2.0 * v).collect();
        assert_eq!(y.to_vec().unwrap(), want);
    }
}

#[test]
fn errors_for_bad_graphs() {
    let spec = host();
    let d3 = dims(&[("x", 3)]);
    let d4 = dims(&[("x", 4)]);
    let i3: LinopRef<f64> = Arc::new(Identity::new(d3.clone()));
    let i4: LinopRef<f64> = Arc::new(Identity::new(d4.clone()));
    let y3: LinopRef<f64> = Arc::new(Identity::new(dims(&[("y", 3)])));
    let invalid = |r: Result<(), Error>| assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    invalid(Chain::new(vec![Arc::clone(&i3), Arc::clone(&i4)]).map(drop));
    invalid(Chain::new(vec![Arc::clone(&i3), Arc::clone(&y3)]).map(drop));
    invalid(Chain::<f64>::new(vec![]).map(drop));
    invalid(Add::new(vec![Arc::clone(&i3), Arc::clone(&i4)]).map(drop));
    invalid(Concat::new(vec![Arc::clone(&i3), Arc::clone(&y3)], Some("x"), Some("x")).map(drop));
    invalid(Concat::new(vec![Arc::clone(&i3), Arc::clone(&i4)], None, None).map(drop));
    invalid(Concat::new(vec![Arc::clone(&i3), Arc::clone(&i4)], Some("x"), None).map(drop));
    invalid(Dims::new(&[("x", 1), ("x", 2)]).map(drop));
    // Unknown dim names.
    invalid(i3.split("nope", 0..1).map(drop));
    invalid(i3.split("x", 2..5).map(drop));
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = i3.split("x", 2..1).map(drop);
    match reversed {
        Err(Error::InvalidArgument { what }) => assert!(what.contains("reversed"), "{what}"),
        other => panic!("a reversed range: {other:?}"),
    }
    let w = Array::from_slice(&spec, &[3], &[1.0f64, 2.0, 3.0]).unwrap();
    invalid(Diagonal::new(w.clone(), &["z"], d3.clone()).map(drop));
    invalid(Dense::new(w.clone(), &["q"], d3.clone(), dims(&[("o", 3)])).map(drop));
    invalid(Dense::new(w.clone(), &["x"], d4.clone(), dims(&[("o", 3)])).map(drop));
    // Wrong input shape.
    let x4 = Array::from_slice(&spec, &[4], &[0.0f64; 4]).unwrap();
    invalid(i3.apply(&x4).map(drop));
    invalid(Array::<f64>::from_slice(&spec, &[2, 2], &[1.0; 3]).map(drop));
    invalid(x4.slice(1, 0..1).map(drop));
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = x4.slice(0, 3..1);
    assert!(reversed.as_ref().is_err_and(|e| e.to_string().contains("reversed")), "{reversed:?}");
    let past = x4.slice(0, 2..5);
    assert!(past.as_ref().is_err_and(|e| e.to_string().contains("past its size 4")), "{past:?}");
    invalid(x4.permute(&[0, 0]).map(drop));
    // A chain that consumes a dim and produces it again cannot be split along it.
    let wx = Array::from_slice(&spec, &[3, 2], &[1.0f64; 6]).unwrap();
    let down: LinopRef<f64> =
        Arc::new(Dense::new(wx.clone(), &["x", "k"], d3.clone(), dims(&[("k", 2)])).unwrap());
    let up: LinopRef<f64> = Arc::new(Dense::new(wx, &["x", "k"], dims(&[("k", 2)]), d3.clone()).unwrap());
    let round = Chain::new(vec![down, up]).unwrap();
    invalid(round.split("x", 0..1).map(drop));
    assert!(round.split("k", 0..1).is_ok());
}

fn assert_invalid<T: std::fmt::Debug>(r: Result<T, Error>) {
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
}

/// `DeviceSpec`'s fields are public, so a spec can claim a device its streams are not on;
/// linop used to allocate on the stream's device and label the memory with the claimed one.
#[test]
fn spec_whose_stream_is_on_another_device_is_rejected() {
    let h = host();
    let bad = DeviceSpec {
        device: Device::Cuda(0),
        compute_stream: Stream::new(Device::Host).unwrap(),
        transfer_stream: None,
    };
    assert_invalid(Array::<f64>::from_slice(&bad, &[2], &[1.0, 2.0]));
    assert_invalid(Array::<f64>::zeros(&bad, &[2]));
    let x = Array::from_slice(&h, &[2], &[1.0f64, 2.0]).unwrap();
    assert_invalid(Array::from_buffer(&bad, std::sync::Arc::clone(x.buffer()), 0, &[2], &[1]));
    assert_invalid(DeviceMatrix::from_specs(vec![bad.clone()]));
    assert_invalid(transfer_stream(&h, &bad));
    let t = ToDevice::new(h.clone(), bad.clone(), dims(&[("x", 2)]));
    assert_invalid(Linop::<f64>::apply(&t, &x));
    // The same literal with the device its stream is on is fine.
    let good = DeviceSpec { device: Device::Host, ..bad };
    assert_eq!(Array::<f64>::zeros(&good, &[2]).unwrap().to_vec().unwrap(), [0.0, 0.0]);
}

/// A view past the end of its buffer (offset, shape and strides that reach further than its
/// elements, or whose reach overflows) is refused; the view that fits is fine.
#[test]
fn array_views_past_their_buffer_are_rejected() {
    let h = host();
    let x = Array::from_slice(&h, &[4], &[1.0f64, 2.0, 3.0, 4.0]).unwrap();
    let buf = x.buffer();
    assert_invalid(Array::from_buffer(&h, Arc::clone(buf), 1, &[4], &[1]));
    assert_invalid(Array::from_buffer(&h, Arc::clone(buf), 0, &[2, 2], &[3, 1]));
    assert_invalid(Array::from_buffer(&h, Arc::clone(buf), 0, &[2, 2], &[1]));
    assert_invalid(Array::from_buffer(&h, Arc::clone(buf), usize::MAX, &[1], &[1]));
    assert_invalid(Array::from_buffer(&h, Arc::clone(buf), 0, &[2, 2], &[usize::MAX, 1]));
    let fits = Array::from_buffer(&h, Arc::clone(buf), 0, &[2, 2], &[1, 2]).unwrap();
    assert_eq!(fits.to_vec().unwrap(), [1.0, 3.0, 2.0, 4.0]);
}

/// A name on both sides of `Zero` is a batch dim: one size.
#[test]
fn zero_rejects_a_batch_dim_with_two_sizes() {
    assert_invalid(Zero::new(dims(&[("a", 2)]), dims(&[("a", 3)])));
    let z = Zero::new(dims(&[("a", 2)]), dims(&[("a", 2), ("b", 3)])).unwrap();
    let x = Array::from_slice(&host(), &[2], &[1.0f64, 2.0]).unwrap();
    assert_eq!(Linop::<f64>::apply(&z, &x).unwrap().to_vec().unwrap(), vec![0.0; 6]);
}

/// A chain consuming `x` (2) and producing `x` (3): a name on both sides is one batch dim
/// with one size, so the chain is refused (the old code accepted it, and a split along `x`
/// gave tiles whose output ranges were the input's).
#[test]
fn chain_rejects_a_batch_dim_with_two_sizes() {
    let spec = host();
    let w = Array::from_slice(&spec, &[4, 2], &[1.0f64; 8]).unwrap();
    let f: LinopRef<f64> =
        Arc::new(Dense::new(w, &["m", "x"], dims(&[("x", 2)]), dims(&[("m", 4)])).unwrap());
    let w = Array::from_slice(&spec, &[3, 4], &[1.0f64; 12]).unwrap();
    let g: LinopRef<f64> =
        Arc::new(Dense::new(w, &["x", "m"], dims(&[("m", 4)]), dims(&[("x", 3)])).unwrap());
    assert_invalid(Chain::new(vec![Arc::clone(&f), Arc::clone(&g)]));
    // Consumed and produced again with the same size is one batch dim: accepted.
    let w = Array::from_slice(&spec, &[2, 4], &[1.0f64; 8]).unwrap();
    let back: LinopRef<f64> =
        Arc::new(Dense::new(w, &["x", "m"], dims(&[("m", 4)]), dims(&[("x", 2)])).unwrap());
    let round = Chain::new(vec![f, back]).unwrap();
    let y = round.apply(&Array::from_slice(&spec, &[2], &[1.0, 2.0]).unwrap()).unwrap();
    assert_eq!(y.to_vec().unwrap(), vec![12.0, 12.0]);
}

/// `apply` of a composite queues its work and returns while the streams are busy: dropping
/// its intermediates does not wait for the work reading them (the old code waited, so the
/// gate timed out before `apply` returned).
#[test]
fn composite_apply_returns_while_the_stream_is_busy() {
    let spec = host();
    let d = dims(&[("x", 4)]);
    let s2: LinopRef<f64> = Arc::new(Scalar::new(2.0, d.clone()));
    let s3: LinopRef<f64> = Arc::new(Scalar::new(3.0, d.clone()));
    let chain = Chain::new(vec![Arc::clone(&s2), Arc::clone(&s3)]).unwrap();
    let sum = Add::new(vec![Arc::new(chain.clone()) as LinopRef<f64>, Arc::clone(&s2)]).unwrap();
    let op: LinopRef<f64> =
        Arc::new(Concat::new(vec![Arc::new(sum.clone()), s3], Some("x"), Some("x")).unwrap());
    let devices = DeviceMatrix::from_devices(&[2], &[Device::Host; 2]).unwrap();
    let tiles = devices.specs().to_vec();
    let batched = create_batched_linop(
        Arc::clone(&op),
        &[BatchSpec::new(&[("x", 3)]).devices(devices).base(spec.clone())],
    )
    .unwrap();
    let x = Array::from_slice(&spec, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
    let x8 = Array::from_slice(&spec, &[8], &[1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]).unwrap();
    x8.synchronize().unwrap();
    let mut gates = vec![Gate::hold(&spec.compute_stream)];
    gates.extend(tiles.iter().map(|t| Gate::hold(&t.compute_stream)));
    let ys = [chain.apply(&x), sum.apply(&x), op.apply(&x8), batched.apply(&x8)].map(Result::unwrap);
    for gate in &gates {
        assert!(!gate.passed(), "apply waited for the work queued behind a gate");
    }
    gates.iter().for_each(Gate::open);
    let want_chain = vec![6.0, 12.0, 18.0, 24.0];
    let want_sum: Vec<f64> = want_chain.iter().zip([2.0, 4.0, 6.0, 8.0]).map(|(a, b)| a + b).collect();
    let want_cat: Vec<f64> = want_sum.iter().copied().chain([3.0, 6.0, 9.0, 12.0]).collect();
    assert_eq!(ys[0].to_vec().unwrap(), want_chain);
    assert_eq!(ys[1].to_vec().unwrap(), want_sum);
    assert_eq!(ys[2].to_vec().unwrap(), want_cat);
    assert_eq!(ys[3].to_vec().unwrap(), want_cat);
}

/// Sizes whose sum or product overflows `usize` are errors, never wrapped values.
#[test]
fn size_overflow_is_an_error() {
    let huge: LinopRef<f64> = Arc::new(Identity::new(dims(&[("x", usize::MAX)])));
    let one: LinopRef<f64> = Arc::new(Identity::new(dims(&[("x", 1)])));
    assert_invalid(Concat::new(vec![Arc::clone(&huge), Arc::clone(&one)], Some("x"), Some("x")));
    assert_invalid(Concat::new(vec![one, huge], Some("x"), None));
    // 2^64 tiles.
    let wide: LinopRef<f64> =
        Arc::new(Identity::new(dims(&[("a", 1 << 16), ("b", 1 << 16), ("c", 1 << 16), ("d", 1 << 16)])));
    assert_invalid(split_linop(wide.as_ref(), &[("a", 1), ("b", 1), ("c", 1), ("d", 1)]));
    // 2^58 tiles: a list past isize::MAX bytes (a bad request); 2^43: a valid list that no
    // memory holds (out of memory).
    let tall: LinopRef<f64> = Arc::new(Identity::new(dims(&[("x", 1 << 58)])));
    assert_invalid(split_linop(tall.as_ref(), &[("x", 1)]));
    let long: LinopRef<f64> = Arc::new(Identity::new(dims(&[("x", 1 << 43)])));
    let err = split_linop(long.as_ref(), &[("x", 1)]).map(drop).unwrap_err();
    assert!(matches!(err, cuferry::Error::OutOfMemory { .. }), "{err:?}");
    // Device matrices whose shape product wraps to the number of specs given.
    assert_invalid(DeviceMatrix::new(&[(1 << (usize::BITS - 1)) + 1, 2], vec![host(), host()]));
    // A last tile near usize::MAX ends at the dim's end, not at a wrapped offset.
    let half = 1usize << (usize::BITS - 1);
    assert_eq!(tile_ranges(usize::MAX, half).unwrap(), vec![0..half, half..usize::MAX]);
}

/// An empty array whose other axes multiply past `usize` (no memory behind it) reads back.
#[test]
fn empty_array_with_huge_axes_reads_back() {
    let a = Array::<f64>::zeros(&host(), &[0, 1 << 40, 1 << 40]).unwrap();
    assert!(a.is_contiguous());
    assert_eq!(a.to_vec().unwrap(), Vec::<f64>::new());
    assert_eq!(a.permute(&[2, 1, 0]).unwrap().to_vec().unwrap(), Vec::<f64>::new());
}

/// An empty, non-contiguous view of 9 dims (past the CUDA kernels' 8, and not mergeable)
/// reads back as nothing on the host and, when present, on CUDA (which refused it before).
#[test]
fn empty_permuted_view_of_nine_dims_reads_back() {
    let mut specs = vec![host()];
    if let Some(dev) = util::cuda_device() {
        specs.push(DeviceSpec::new(dev).unwrap());
    }
    for spec in specs {
        let a = Array::<f64>::zeros(&spec, &[2, 3, 2, 3, 0, 2, 3, 2, 3]).unwrap();
        let p = a.permute(&[8, 7, 6, 5, 4, 3, 2, 1, 0]).unwrap();
        assert!(!p.is_contiguous());
        assert_eq!(p.to_vec().unwrap(), Vec::<f64>::new(), "{:?}", spec.device);
        assert_eq!(p.contiguous().unwrap().shape(), &[3, 2, 3, 2, 0, 3, 2, 3, 2]);
    }
}

/// Joining empty outputs whose other axes multiply past `usize` (a Concat of `Zero`s, and a
/// batched `Zero` reassembled over its split dim) gives the empty array, not an overflow in
/// the offsets of the parts.
#[test]
fn concat_of_empty_outputs_with_huge_axes() {
    let big = 1usize << 62;
    let zero = |s: usize| -> LinopRef<f64> {
        Arc::new(Zero::new(dims(&[("x", 1)]), dims(&[("z", 0), ("s", s), ("w", big)])).unwrap())
    };
    let x = Array::from_slice(&host(), &[1], &[1.0]).unwrap();
    let joined = Concat::new(vec![zero(4), zero(1)], None, Some("s")).unwrap();
    let y = joined.apply(&x).unwrap();
    assert_eq!(y.shape(), &[0, 5, big]);
    assert!(y.to_vec().unwrap().is_empty());
    let batched = create_batched_linop(zero(5), &[BatchSpec::new(&[("s", 4)])]).unwrap();
    let y = batched.apply(&x).unwrap();
    assert_eq!(y.shape(), &[0, 5, big]);
    assert!(y.to_vec().unwrap().is_empty());
}

#[test]
fn to_device_rejects_wrong_shape() {
    let t = ToDevice::new(host(), host(), dims(&[("x", 2)]));
    let x = Array::from_slice(&host(), &[3], &[1.0f64; 3]).unwrap();
    assert!(matches!(Linop::<f64>::apply(&t, &x), Err(Error::InvalidArgument { .. })));
}

/// host -> cuda -> host through ToDevice; arithmetic on CUDA reports the missing kernels.
#[test]
fn cuda_to_device_round_trip() {
    let Some(dev) = util::cuda_device() else { return };
    let mut rng = Rng::new(31);
    let (h, c) = (host(), DeviceSpec::new(dev).unwrap());
    let d = dims(&[("x", 300), ("y", 1001)]);
    let up = ToDevice::new(h.clone(), c.clone(), d.clone());
    let x: Array<C64> = random_array(&mut rng, &h, &[300, 1001]);
    let on_gpu = up.apply(&x).unwrap();
    assert_eq!(on_gpu.device(), dev);
    assert_eq!(on_gpu.to_vec().unwrap(), x.to_vec().unwrap());
    let back = Linop::<C64>::adjoint(&up).apply(&on_gpu).unwrap();
    assert_eq!(back.device(), Device::Host);
    assert_eq!(back.to_vec().unwrap(), x.to_vec().unwrap());
    let s = Scalar::new(C64::new(2.0, -1.0), d.clone());
    let want: Vec<C64> = x.to_vec().unwrap().iter().map(|v| v * C64::new(2.0, -1.0)).collect();
    assert_close(&s.apply(&on_gpu).unwrap().to_vec().unwrap(), &want, 1e-14);
    // Identity works anywhere; a strided CUDA view moves back as its elements.
    assert_eq!(
        Linop::<C64>::apply(&Identity::new(d), &on_gpu).unwrap().to_vec().unwrap(),
        x.to_vec().unwrap()
    );
    // A transfer from the host refuses an array already on the GPU, and so does its normal.
    assert!(matches!(up.apply(&on_gpu), Err(Error::InvalidArgument { .. })));
    let normal = Linop::<C64>::normal(&up);
    assert!(matches!(normal.apply(&on_gpu), Err(Error::InvalidArgument { .. })));
    assert_eq!(normal.apply(&x).unwrap().device(), Device::Host);
    let view = on_gpu.slice(1, 5..9).unwrap();
    let down = ToDevice::new(c.clone(), h.clone(), dims(&[("x", 300), ("y", 4)]));
    let want: Vec<C64> = x.to_vec().unwrap().chunks(1001).flat_map(|r| r[5..9].to_vec()).collect();
    assert_eq!(Linop::<C64>::apply(&down, &view).unwrap().to_vec().unwrap(), want);
}

/// Every operator kind computed on CUDA (placed there with `place_on`) matches the same
/// operator on the host, forward and adjoint, for real and complex data.
fn cuda_matches_host<T: Field>(seed: u64) {
    let Some(dev) = util::cuda_device() else { return };
    let mut rng = Rng::new(seed);
    let (h, c) = (host(), DeviceSpec::new(dev).unwrap());
    let Zoo { a, a2, f, g, diag, scalar, .. } = zoo::<T>(&mut rng, &h, (3, 7, 5, 4));
    let ops: Vec<LinopRef<T>> = vec![
        Arc::clone(&a),
        Arc::clone(&a2),
        Arc::clone(&diag),
        Arc::new(
            Chain::new(vec![Arc::clone(&diag), Arc::clone(&f), Arc::clone(&g), Arc::clone(&scalar)]).unwrap(),
        ),
        Arc::new(Add::new(vec![Arc::clone(&a), Arc::clone(&a2)]).unwrap()),
        Arc::new(Concat::new(vec![Arc::clone(&a), Arc::clone(&a2)], None, Some("o")).unwrap()),
        Arc::new(Concat::new(vec![Arc::clone(&a), Arc::clone(&a2)], Some("i"), None).unwrap()),
        Arc::new(Concat::new(vec![Arc::clone(&a), Arc::clone(&a2)], Some("b"), Some("b")).unwrap()),
        a.normal(),
    ];
    for op in &ops {
        for op in [Arc::clone(op), op.adjoint()] {
            let shape: Vec<usize> = op.idims().sizes().to_vec();
            let x: Array<T> = random_array(&mut rng, &h, &shape);
            let want = op.apply(&x).unwrap().to_vec().unwrap();
            let up = ToDevice::new(h.clone(), c.clone(), op.idims().clone());
            let on_gpu = op.place_on(&c).unwrap().apply(&up.apply(&x).unwrap()).unwrap();
            assert_eq!(on_gpu.device(), dev);
            assert_close(&on_gpu.to_vec().unwrap(), &want, 1e-5);
        }
    }
}

#[test]
fn cuda_operators_match_host() {
    cuda_matches_host::<f64>(51);
    cuda_matches_host::<C64>(52);
    cuda_matches_host::<f32>(53);
}

/// A Dense over 8 batch dims and one summed dim (10 loop dims with the output dim) runs on
/// CUDA, whose kernels take 8 loop dims: the batch dims merge into one. It matches the host,
/// forward and adjoint.
#[test]
fn cuda_kernels_take_layouts_past_eight_dims() {
    let Some(dev) = util::cuda_device() else { return };
    let mut rng = Rng::new(57);
    let (h, c) = (host(), DeviceSpec::new(dev).unwrap());
    let batch: Vec<(String, usize)> = (0..8).map(|k| (format!("b{k}"), 2)).collect();
    let mut inputs: Vec<(&str, usize)> = batch.iter().map(|(n, s)| (n.as_str(), *s)).collect();
    inputs.push(("x", 3));
    let w: Array<f64> = random_array(&mut rng, &h, &[3, 4]);
    let op: LinopRef<f64> = Arc::new(Dense::new(w, &["x", "o"], dims(&inputs), dims(&[("o", 4)])).unwrap());
    for op in [Arc::clone(&op), op.adjoint()] {
        let shape: Vec<usize> = op.idims().sizes().to_vec();
        let x: Array<f64> = random_array(&mut rng, &h, &shape);
        let want = op.apply(&x).unwrap().to_vec().unwrap();
        let up = ToDevice::new(h.clone(), c.clone(), op.idims().clone());
        let on_gpu = op.place_on(&c).unwrap().apply(&up.apply(&x).unwrap()).unwrap();
        assert_close(&on_gpu.to_vec().unwrap(), &want, 1e-12);
    }
}

/// Empty arrays on CUDA: a permuted empty array reads back (a map over no elements), and a
/// Dense over an empty input dim gives zeros (a contraction over an empty reduction, whose
/// input and weight buffers have no address), forward and adjoint, as on the host.
#[test]
fn cuda_kernels_take_empty_arrays() {
    let Some(dev) = util::cuda_device() else { return };
    let (h, c) = (host(), DeviceSpec::new(dev).unwrap());
    let empty = Array::<f64>::zeros(&c, &[0, 3]).unwrap();
    assert_eq!(empty.permute(&[1, 0]).unwrap().to_vec().unwrap(), Vec::<f64>::new());
    let w = Array::<f64>::zeros(&h, &[0, 4]).unwrap();
    let op: LinopRef<f64> =
        Arc::new(Dense::new(w, &["x", "o"], dims(&[("x", 0)]), dims(&[("o", 4)])).unwrap());
    for (op, input) in [(Arc::clone(&op), vec![0]), (op.adjoint(), vec![4])] {
        let x = Array::<f64>::zeros(&h, &input).unwrap();
        let want = op.apply(&x).unwrap().to_vec().unwrap();
        let up = ToDevice::new(h.clone(), c.clone(), op.idims().clone());
        let on_gpu = op.place_on(&c).unwrap().apply(&up.apply(&x).unwrap()).unwrap();
        assert_eq!(on_gpu.to_vec().unwrap(), want);
    }
}

/// cuda:0 -> cuda:1 -> host when two devices exist.
#[test]
fn cuda_to_cuda_transfer() {
    let Some((d0, d1)) = util::two_cuda_devices() else { return };
    let mut rng = Rng::new(37);
    let (h, c0, c1) = (host(), DeviceSpec::new(d0).unwrap(), DeviceSpec::new(d1).unwrap());
    let d = dims(&[("x", 1 << 18)]);
    let x: Array<f64> = random_array(&mut rng, &h, &[1 << 18]);
    let chain = Chain::new(vec![
        Arc::new(ToDevice::new(h.clone(), c0.clone(), d.clone())) as LinopRef<f64>,
        Arc::new(ToDevice::new(c0, c1.clone(), d.clone())),
        Arc::new(ToDevice::new(c1, h, d)),
    ])
    .unwrap();
    assert_eq!(chain.apply(&x).unwrap().to_vec().unwrap(), x.to_vec().unwrap());
}
