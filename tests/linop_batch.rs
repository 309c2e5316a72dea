//! Splitting and batching: `split_linop` tile rules, `create_batched_linop(A, specs)(x) ==
//! A(x)` for random operator graphs, random batch sizes (dividing or not), device matrices of
//! host "devices" (each spec with its own streams) and, with a GPU, of CUDA specs mixed with a
//! host one; nested specs; the dot test on batched
//! operators; and the errors for bad batch sizes and device matrices.

#[path = "linop_common/mod.rs"]
mod util;

use std::sync::Arc;

use cuferry::linop::{
    create_batched_linop, dim_role, split_linop, tile_ranges, Add, Array, BatchSpec, Chain, Concat, Dense,
    DeviceMatrix, Diagonal, DimRole, Dims, Field, Identity, Linop, LinopRef, Scalar, Zero,
};
use cuferry::num_complex::Complex;
use cuferry::{Device, DeviceSpec, Error, Stream};
use util::{assert_close, dense, dot_test, random_array, random_batches, random_graph, Gate, Rng, Sizes};

type C64 = Complex<f64>;

fn host() -> DeviceSpec {
    DeviceSpec::new(Device::Host).unwrap()
}

/// A host "device" with its own compute stream and, sometimes, its own transfer stream.
fn host_device(rng: &mut Rng) -> DeviceSpec {
    let transfer = (rng.below(2) == 0).then(|| Stream::new(Device::Host).unwrap());
    DeviceSpec::with_streams(Device::Host, Stream::new(Device::Host).unwrap(), transfer).unwrap()
}

fn dims(d: &[(&str, usize)]) -> Dims {
    Dims::new(d).unwrap()
}

#[test]
fn tile_ranges_follow_the_rules() {
    assert_eq!(tile_ranges(10, 3).unwrap(), vec![0..3, 3..6, 6..9, 9..10]);
    assert_eq!(tile_ranges(6, 3).unwrap(), vec![0..3, 3..6]);
    assert_eq!(tile_ranges(2, 5).unwrap(), vec![0..2]);
    assert_eq!(tile_ranges(0, 5).unwrap(), vec![0..0]);
    assert_eq!(tile_ranges(0, 0).unwrap(), vec![0..0]);
    assert!(matches!(tile_ranges(5, 0), Err(Error::InvalidArgument { .. })), "no tiles cover the dim");
}

#[test]
fn split_linop_grid_and_slices() {
    let op: LinopRef<f64> = Arc::new(Identity::new(dims(&[("x", 7), ("y", 4), ("z", 2)])));
    let grid = split_linop(op.as_ref(), &[("y", 3), ("x", 4)]).unwrap();
    assert_eq!(grid.dims, vec!["y", "x"]);
    assert_eq!(grid.shape, vec![2, 2]);
    let t = grid.tile(&[1, 0]).unwrap();
    assert_eq!(t.index, vec![1, 0]);
    assert_eq!(t.islices, vec![0..4, 3..4, 0..2]);
    assert_eq!(t.oslices, t.islices);
    assert_eq!(t.linop.idims(), &dims(&[("x", 4), ("y", 1), ("z", 2)]));
    assert!(grid.tile(&[2, 0]).is_none());
    // Dims not listed are one whole tile.
    let whole = split_linop(op.as_ref(), &[] as &[(&str, usize)]).unwrap();
    assert_eq!(whole.tiles.len(), 1);
}

/// A `Concat` over `o` of two chains whose internal dim `m` has sizes 3 and 5: split along
/// `o` first, a tile keeps one chain, whose `m` is smaller than the operator's. The grid is
/// the same whichever order the dims are listed in, and so is the result (the old code
/// rejected `(o, m)`: the last `m` range lay outside the smaller chain).
#[test]
fn split_order_never_decides_whether_a_grid_is_accepted() {
    let spec = host();
    let mut rng = Rng::new(41);
    let mut chain = |o: usize, m: usize| -> LinopRef<f64> {
        let f = dense(&mut rng, &spec, &["m", "i"], dims(&[("i", 4)]), dims(&[("m", m)]));
        let g = dense(&mut rng, &spec, &["o", "m"], dims(&[("m", m)]), dims(&[("o", o)]));
        Arc::new(Chain::new(vec![f, g]).unwrap())
    };
    let (a, b) = (chain(2, 3), chain(2, 5));
    let op: LinopRef<f64> = Arc::new(Concat::new(vec![a, b], None, Some("o")).unwrap());
    let x = random_array::<f64>(&mut rng, &spec, &[4]);
    let want = op.apply(&x).unwrap().to_vec().unwrap();
    for order in [[("m", 2), ("o", 2)], [("o", 2), ("m", 2)], [("o", 1), ("m", 4)]] {
        let grid = split_linop(op.as_ref(), &order).unwrap();
        let m_axis = grid.dims.iter().position(|d| d == "m").unwrap();
        assert_eq!(grid.shape[m_axis], 5usize.div_ceil(order[m_axis].1), "{order:?}");
        let batched = create_batched_linop(Arc::clone(&op), &[BatchSpec::new(&order)]).unwrap();
        assert_close(&batched.apply(&x).unwrap().to_vec().unwrap(), &want, 1e-12);
        // The tiles, applied one by one and added into their output ranges, give the result.
        let mut sum = vec![0.0f64; want.len()];
        for tile in &grid.tiles {
            let xi = x.slice(0, tile.islices[0].clone()).unwrap().contiguous().unwrap();
            let yi = tile.linop.apply(&xi).unwrap().to_vec().unwrap();
            assert_eq!(yi.len(), tile.oslices[0].len(), "{order:?} tile {:?}", tile.index);
            for (k, v) in tile.oslices[0].clone().zip(yi) {
                sum[k] += v;
            }
        }
        assert_close(&sum, &want, 1e-12);
    }
}

/// A user operator whose queued job fails (panics) on its input's compute stream before the
/// job writing its output.
#[derive(Clone, Debug)]
struct FailingJob {
    dims: Dims,
}

impl Linop<f64> for FailingJob {
    fn name(&self) -> &'static str {
        "FailingJob"
    }
    fn idims(&self) -> &Dims {
        &self.dims
    }
    fn odims(&self) -> &Dims {
        &self.dims
    }
    fn apply(&self, x: &Array<f64>) -> Result<Array<f64>, Error> {
        x.spec().compute_stream.host_fn(|| panic!("the tile's job failed"))?;
        // The output is written after the failed job, in stream order.
        Scalar::new(0.0, self.dims.clone()).apply(x)
    }
    fn adjoint(&self) -> LinopRef<f64> {
        Arc::new(self.clone())
    }
    fn split(&self, dim: &str, r: std::ops::Range<usize>) -> Result<LinopRef<f64>, Error> {
        Ok(Arc::new(FailingJob { dims: self.dims.with_size(dim, r.len()) }))
    }
    fn place_on(&self, _spec: &DeviceSpec) -> Result<LinopRef<f64>, Error> {
        Ok(Arc::new(self.clone()))
    }
}

/// An operator written outside the crate mapping `x` of one size to `x` of another.
#[derive(Clone, Debug)]
struct Resizes {
    idims: Dims,
    odims: Dims,
}

impl Linop<f64> for Resizes {
    fn name(&self) -> &'static str {
        "Resizes"
    }
    fn idims(&self) -> &Dims {
        &self.idims
    }
    fn odims(&self) -> &Dims {
        &self.odims
    }
    fn apply(&self, _x: &Array<f64>) -> Result<Array<f64>, Error> {
        Err(Error::InvalidArgument { what: "never applied".into() })
    }
    fn adjoint(&self) -> LinopRef<f64> {
        Arc::new(Resizes { idims: self.odims.clone(), odims: self.idims.clone() })
    }
    fn split(&self, _dim: &str, _r: std::ops::Range<usize>) -> Result<LinopRef<f64>, Error> {
        Err(Error::InvalidArgument { what: "never split".into() })
    }
    fn place_on(&self, _spec: &DeviceSpec) -> Result<LinopRef<f64>, Error> {
        Ok(Arc::new(self.clone()))
    }
}

/// A block-diagonal `Concat` over one name needs each block's input and output sizes to
/// agree: blocks 2 -> 3 and 2 -> 1 join to 4 -> 4, which the totals alone accepted, but the
/// blocks' stretches of `x` differ on the two sides.
#[test]
fn a_block_diagonal_concat_refuses_blocks_that_resize_the_dim() {
    let resize = |i: usize, o: usize| -> LinopRef<f64> {
        Arc::new(Resizes { idims: dims(&[("x", i)]), odims: dims(&[("x", o)]) })
    };
    let r = Concat::new(vec![resize(2, 3), resize(2, 1)], Some("x"), Some("x"));
    assert!(
        matches!(&r, Err(Error::InvalidArgument { what }) if what.contains("operator 0")),
        "{:?}",
        r.err()
    );
    Concat::new(vec![resize(2, 2), resize(1, 1)], Some("x"), Some("x")).unwrap();
}

/// A sum whose part knows an internal dim with size 0 counts that part's own dim-less parts
/// once when split along the dim, not once per tile: `T + (P + I)` with `P` knowing `k` at
/// size 0 and `T` at size 4, split into two tiles of `k`, stays `T + I` (it was `T + 2 I`),
/// for every tile size.
#[test]
fn a_part_of_size_zero_in_a_split_sum_counts_once() {
    let spec = host();
    let xd = dims(&[("x", 2)]);
    // x -> k -> x through zeros: an operator that knows the internal dim k at size n.
    let via_k = |n: usize| -> LinopRef<f64> {
        let k = dims(&[("k", n)]);
        Arc::new(
            Chain::new(vec![
                Arc::new(Zero::new(xd.clone(), k.clone()).unwrap()) as LinopRef<f64>,
                Arc::new(Zero::new(k, xd.clone()).unwrap()),
            ])
            .unwrap(),
        )
    };
    let identity: LinopRef<f64> = Arc::new(Identity::new(xd.clone()));
    let inner: LinopRef<f64> = Arc::new(Add::new(vec![via_k(0), identity]).unwrap());
    let op: LinopRef<f64> = Arc::new(Add::new(vec![via_k(4), inner]).unwrap());
    let x = Array::from_slice(&spec, &[2], &[1.0, 2.0]).unwrap();
    assert_eq!(op.apply(&x).unwrap().to_vec().unwrap(), [1.0, 2.0]);
    for batch in [1, 2, 3] {
        let batched = create_batched_linop(Arc::clone(&op), &[BatchSpec::new(&[("k", batch)])]).unwrap();
        assert_eq!(batched.apply(&x).unwrap().to_vec().unwrap(), [1.0, 2.0], "tiles of {batch}");
    }
}

/// A tile's job that fails on another device's stream is reported by the batched result
/// (the old code read back zeros with `Ok`: only the base spec's stream was checked), once.
#[test]
fn a_tile_job_error_reaches_the_batched_result() {
    let base = host();
    let op: LinopRef<f64> = Arc::new(FailingJob { dims: dims(&[("x", 4)]) });
    let x = Array::from_slice(&base, &[4], &[1.0; 4]).unwrap();
    let devices = DeviceMatrix::from_devices(&[2], &[Device::Host; 2]).unwrap();
    let spec = BatchSpec::new(&[("x", 2)]).devices(devices).base(base.clone());
    let batched = create_batched_linop(op, &[spec]).unwrap();
    let y = batched.apply(&x).unwrap();
    let r = y.to_vec();
    assert!(
        matches!(&r, Err(Error::HostFnPanicked { message }) if message.contains("the tile's job failed")),
        "{r:?}"
    );
    // Each failure is reported once: two tiles failed, so at most one more report.
    let again = y.synchronize();
    assert!(again.is_ok() || matches!(again, Err(Error::HostFnPanicked { .. })), "{again:?}");
    assert_eq!(y.to_vec().unwrap(), vec![0.0; 4]);
    // An operator applied to the result carries the tiles' streams along too.
    let y = batched.apply(&x).unwrap();
    let z = Scalar::new(2.0, dims(&[("x", 4)])).apply(&y).unwrap();
    assert!(matches!(z.to_vec(), Err(Error::HostFnPanicked { .. })));
}

/// Tiles reading one input on two host devices run at once: with device A's stream held by
/// a gate, tile 1 on device B finishes (the old tracker ordered every read after the last
/// one, so tile 1 waited for tile 0 behind the gate).
#[test]
fn tiles_reading_one_input_run_at_once() {
    let base = host();
    let mut rng = Rng::new(3);
    let w = random_array::<f64>(&mut rng, &base, &[4]);
    let op: LinopRef<f64> = Arc::new(Diagonal::new(w, &["x"], dims(&[("x", 4)])).unwrap());
    let devices = DeviceMatrix::from_devices(&[2], &[Device::Host; 2]).unwrap();
    let (a, b) = (devices.specs()[0].clone(), devices.specs()[1].clone());
    let spec = BatchSpec::new(&[("x", 2)]).devices(devices).base(base.clone());
    let batched = create_batched_linop(Arc::clone(&op), &[spec]).unwrap();
    let x = random_array::<f64>(&mut rng, &base, &[4]);
    let want = op.apply(&x).unwrap().to_vec().unwrap();
    let gate = Gate::hold(&a.compute_stream);
    let y = batched.apply(&x).unwrap();
    b.compute_stream.synchronize().unwrap();
    assert!(!gate.passed(), "tile 1 on device B waited for tile 0 behind device A's gate");
    gate.open();
    assert_close(&y.to_vec().unwrap(), &want, 1e-12);
}

#[test]
fn bad_batch_sizes_and_device_matrices() {
    let base = host();
    let op: LinopRef<f64> = Arc::new(Identity::new(dims(&[("x", 7), ("y", 4)])));
    let invalid =
        |r: Result<LinopRef<f64>, Error>| assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    invalid(create_batched_linop(Arc::clone(&op), &[BatchSpec::new(&[("x", 0)])]));
    invalid(create_batched_linop(Arc::clone(&op), &[BatchSpec::new(&[("nope", 2)])]));
    invalid(create_batched_linop(Arc::clone(&op), &[BatchSpec::new(&[("x", 2), ("x", 3)])]));
    // x=7 by 4 gives 2 tiles: 3 devices along that axis is too many.
    let three = DeviceMatrix::from_devices(&[3], &[Device::Host; 3]).unwrap();
    invalid(create_batched_linop(
        Arc::clone(&op),
        &[BatchSpec::new(&[("x", 4)]).devices(three.clone()).base(base.clone())],
    ));
    // More axes than the grid.
    let square = DeviceMatrix::from_devices(&[1, 1], &[Device::Host]).unwrap();
    invalid(create_batched_linop(
        Arc::clone(&op),
        &[BatchSpec::new(&[("x", 4)]).devices(square).base(base.clone())],
    ));
    // A device matrix needs a base device.
    let two = DeviceMatrix::from_devices(&[2], &[Device::Host; 2]).unwrap();
    invalid(create_batched_linop(Arc::clone(&op), &[BatchSpec::new(&[("x", 4)]).devices(two)]));
    // Matrices that do not hold their shape.
    let short = DeviceMatrix::new(&[2, 2], vec![base.clone()]);
    assert!(
        short.as_ref().is_err_and(|e| e.to_string().contains("holds 4 specs, but 1 were given")),
        "{short:?}"
    );
    let empty = DeviceMatrix::from_specs(vec![]);
    assert!(empty.as_ref().is_err_and(|e| e.to_string().contains("is empty")), "{empty:?}");
    // Fewer devices than tiles is fine (repeated).
    let x = Array::from_slice(&base, &[7, 4], &[1.0; 28]).unwrap();
    let ok = create_batched_linop(Arc::clone(&op), &[BatchSpec::new(&[("x", 1)]).devices(three).base(base)])
        .unwrap();
    assert_eq!(ok.apply(&x).unwrap().to_vec().unwrap(), vec![1.0; 28]);
}

/// Random sizes for the dims b, i, o, m.
fn random_matrix(rng: &mut Rng, grid_axes: usize, pool: &[DeviceSpec]) -> Option<DeviceMatrix> {
    if rng.below(4) == 0 || grid_axes == 0 {
        return None;
    }
    let n = 1 + rng.below(pool.len());
    Some(DeviceMatrix::from_specs(pool[..n].to_vec()).unwrap())
}

/// `create_batched_linop(A, specs)(x) == A(x)` for a random graph and random specs over host
/// "devices"; the batched operator's adjoint matches too and passes the dot test.
fn batched_equals_unsplit<T: Field>(seed: u64) {
    batched_equals_unsplit_over::<T>(seed, &|rng| (0..3).map(|_| host_device(rng)).collect());
}

/// As [`batched_equals_unsplit`], with the device matrices drawn from `pool`'s specs.
fn batched_equals_unsplit_over<T: Field>(seed: u64, pool: &dyn Fn(&mut Rng) -> Vec<DeviceSpec>) {
    let mut rng = Rng::new(seed);
    let base = host();
    let pool = pool(&mut rng);
    let s = Sizes { b: 1 + rng.below(6), i: 1 + rng.below(7), o: 1 + rng.below(7), m: 1 + rng.below(5) };
    let op = random_graph::<T>(&mut rng, &base, &s, 2);
    let mut specs = Vec::new();
    let levels = 1 + rng.below(2);
    for level in 0..levels {
        let batches = random_batches(&mut rng, op.as_ref(), &["b", "i", "o", "m", "s"]);
        // Device matrices only where they fit: each axis at most the tile count.
        let grid: Vec<usize> =
            batches.iter().map(|(d, b)| op.dim_size(d).unwrap().div_ceil(*b).max(1)).collect();
        let mut spec = BatchSpec::new(&batches);
        // Nested levels see ragged tiles with fewer tiles: one device there.
        let pool_here = if level == 0 { &pool[..] } else { &pool[..1] };
        if let Some(m) = random_matrix(&mut rng, grid.len(), pool_here) {
            if m.shape()[0] <= grid[0] {
                spec = spec.devices(m);
            }
        }
        if level == 0 {
            spec = spec.base(base.clone());
        }
        specs.push(spec);
    }
    let batched = match create_batched_linop(Arc::clone(&op), &specs) {
        Ok(b) => b,
        Err(e) => panic!("seed {seed}: {e} for {op:?} with {specs:?}"),
    };
    assert_eq!(batched.idims(), op.idims());
    assert_eq!(batched.odims(), op.odims());
    let x = random_array::<T>(&mut rng, &base, op.idims().sizes());
    let want = op.apply(&x).unwrap().to_vec().unwrap();
    let got = batched.apply(&x).unwrap();
    assert_eq!(got.spec().compute_stream.id(), base.compute_stream.id());
    assert_close(&got.to_vec().unwrap(), &want, 1e-11);
    let y = random_array::<T>(&mut rng, &base, op.odims().sizes());
    let want = op.adjoint().apply(&y).unwrap().to_vec().unwrap();
    assert_close(&batched.adjoint().apply(&y).unwrap().to_vec().unwrap(), &want, 1e-11);
    dot_test(batched.as_ref(), &base, &mut rng);
}

#[test]
fn batched_equals_unsplit_f64() {
    for seed in 0..40 {
        batched_equals_unsplit::<f64>(seed);
    }
}

#[test]
fn batched_equals_unsplit_complex() {
    for seed in 100..140 {
        batched_equals_unsplit::<C64>(seed);
    }
}

/// Tiles on CUDA: device matrices mix two specs of the first GPU (each with its own compute
/// and transfer streams, so tiles overlap) with a host "device"; the input and output stay on
/// the host, so every CUDA tile goes through ToDevice both ways.
#[test]
fn batched_equals_unsplit_with_cuda_tiles() {
    let Some(gpu) = util::cuda_device() else { return };
    let cuda_spec = |_: &mut Rng| {
        DeviceSpec::with_streams(gpu, Stream::new(gpu).unwrap(), Some(Stream::new(gpu).unwrap())).unwrap()
    };
    let pool = |rng: &mut Rng| vec![cuda_spec(rng), cuda_spec(rng), host_device(rng)];
    for seed in 200..220 {
        batched_equals_unsplit_over::<f64>(seed, &pool);
    }
    for seed in 300..310 {
        batched_equals_unsplit_over::<C64>(seed, &pool);
    }
}

/// The reassembly rule for each role of the batched dim, checked on the structure.
#[test]
fn reassembly_follows_the_dim_role() {
    let mut rng = Rng::new(77);
    let base = host();
    let f =
        dense::<f64>(&mut rng, &base, &["m", "i"], dims(&[("b", 4), ("i", 5)]), dims(&[("b", 4), ("m", 3)]));
    let g =
        dense::<f64>(&mut rng, &base, &["o", "m"], dims(&[("b", 4), ("m", 3)]), dims(&[("b", 4), ("o", 6)]));
    let op: LinopRef<f64> = Arc::new(Chain::new(vec![f, g]).unwrap());
    for (d, role, name) in [
        ("b", DimRole::Both, "Concat"),
        ("i", DimRole::Input, "Concat"),
        ("o", DimRole::Output, "Concat"),
        ("m", DimRole::Internal, "Add"),
    ] {
        assert_eq!(dim_role(op.as_ref(), d), role);
        let b = create_batched_linop(Arc::clone(&op), &[BatchSpec::new(&[(d, 2)])]).unwrap();
        assert_eq!(b.name(), name, "dim {d}");
        let x = random_array::<f64>(&mut rng, &base, &[4, 5]);
        assert_close(
            &b.apply(&x).unwrap().to_vec().unwrap(),
            &op.apply(&x).unwrap().to_vec().unwrap(),
            1e-12,
        );
    }
}

/// Nested specs: the outer level places tiles on host devices, the inner one splits each tile
/// again and places the pieces on other host devices (base inherited from the outer tile).
#[test]
fn nested_specs_place_and_split_again() {
    let mut rng = Rng::new(91);
    let base = host();
    let outer: Vec<DeviceSpec> = (0..2).map(|_| host_device(&mut rng)).collect();
    let inner: Vec<DeviceSpec> = (0..3).map(|_| host_device(&mut rng)).collect();
    let op = dense::<C64>(
        &mut rng,
        &base,
        &["b", "o", "i"],
        dims(&[("b", 7), ("i", 9)]),
        dims(&[("b", 7), ("o", 5)]),
    );
    let specs = [
        BatchSpec::new(&[("b", 3)]).devices(DeviceMatrix::from_specs(outer).unwrap()).base(base.clone()),
        BatchSpec::new(&[("o", 2), ("i", 4)]).devices(DeviceMatrix::new(&[3, 1], inner).unwrap()),
    ];
    let batched = create_batched_linop(Arc::clone(&op), &specs).unwrap();
    let x = random_array::<C64>(&mut rng, &base, &[7, 9]);
    assert_close(
        &batched.apply(&x).unwrap().to_vec().unwrap(),
        &op.apply(&x).unwrap().to_vec().unwrap(),
        1e-12,
    );
    dot_test(batched.as_ref(), &base, &mut rng);
    // The normal of the batched operator equals the normal of the original.
    assert_close(
        &batched.normal().apply(&x).unwrap().to_vec().unwrap(),
        &op.normal().apply(&x).unwrap().to_vec().unwrap(),
        1e-12,
    );
}

fn hosts(n: usize) -> DeviceMatrix {
    DeviceMatrix::from_devices(&[n], &vec![Device::Host; n]).unwrap()
}

/// A nested spec's device matrix serves every tile of the spec before it: x=5 split by 4
/// gives a tile of 4 (two inner tiles, both devices) and a ragged tile of 1 (one inner tile,
/// the first device). Both are placed, and the result is the diagonal's, element by element.
#[test]
fn nested_device_matrix_serves_ragged_tiles() {
    let base = host();
    let w = [1.5f64, -2.0, 3.0, 0.5, 4.0];
    let x = [2.0f64, 1.0, -1.0, 8.0, 0.25];
    let op: LinopRef<f64> = Arc::new(
        Diagonal::new(Array::from_slice(&base, &[5], &w).unwrap(), &["x"], dims(&[("x", 5)])).unwrap(),
    );
    let specs =
        [BatchSpec::new(&[("x", 4)]).base(base.clone()), BatchSpec::new(&[("x", 2)]).devices(hosts(2))];
    let batched = create_batched_linop(Arc::clone(&op), &specs).unwrap();
    let xa = Array::from_slice(&base, &[5], &x).unwrap();
    let want: Vec<f64> = w.iter().zip(&x).map(|(a, b)| a * b).collect();
    assert_eq!(batched.apply(&xa).unwrap().to_vec().unwrap(), want);
    assert_eq!(op.apply(&xa).unwrap().to_vec().unwrap(), want);
    assert_eq!(batched.adjoint().apply(&xa).unwrap().to_vec().unwrap(), want);
    // A device the largest inner grid (2 tiles) cannot reach is still an error.
    let specs =
        [BatchSpec::new(&[("x", 4)]).base(base.clone()), BatchSpec::new(&[("x", 2)]).devices(hosts(3))];
    let r = create_batched_linop(Arc::clone(&op), &specs);
    assert!(matches!(&r, Err(Error::InvalidArgument { what }) if what.contains("places no tile")), "{r:?}");
    // A matrix two deep for a one-dim spec, too.
    let square = DeviceMatrix::from_devices(&[1, 1], &[Device::Host]).unwrap();
    let specs = [BatchSpec::new(&[("x", 4)]).base(base), BatchSpec::new(&[("x", 2)]).devices(square)];
    assert!(matches!(create_batched_linop(op, &specs), Err(Error::InvalidArgument { .. })));
}

/// A nested spec along an internal dim that only some tiles have: `[A; B]` stacked over the
/// output, `A` a chain through an internal dim `m` (3), `B` without it. Split by output rows
/// the first tile is `A` (3 tiles along `m`), the second `B` (one whole tile); two devices
/// along `m` fit. Checked against loops over the weights.
#[test]
fn nested_device_matrix_serves_tiles_lacking_the_dim() {
    let base = host();
    let mut rng = Rng::new(5);
    let (ni, nm, no) = (4, 3, 2);
    let wf = util::random_vec::<f64>(&mut rng, nm * ni);
    let wg = util::random_vec::<f64>(&mut rng, no * nm);
    let wb = util::random_vec::<f64>(&mut rng, no * ni);
    let arr = |shape: &[usize], v: &[f64]| Array::from_slice(&base, shape, v).unwrap();
    let f: LinopRef<f64> = Arc::new(
        Dense::new(arr(&[nm, ni], &wf), &["m", "i"], dims(&[("i", ni)]), dims(&[("m", nm)])).unwrap(),
    );
    let g: LinopRef<f64> = Arc::new(
        Dense::new(arr(&[no, nm], &wg), &["o", "m"], dims(&[("m", nm)]), dims(&[("o", no)])).unwrap(),
    );
    let b: LinopRef<f64> = Arc::new(
        Dense::new(arr(&[no, ni], &wb), &["o", "i"], dims(&[("i", ni)]), dims(&[("o", no)])).unwrap(),
    );
    let a: LinopRef<f64> = Arc::new(Chain::new(vec![f, g]).unwrap());
    let op: LinopRef<f64> = Arc::new(Concat::new(vec![a, b], None, Some("o")).unwrap());
    let specs =
        [BatchSpec::new(&[("o", no)]).base(base.clone()), BatchSpec::new(&[("m", 1)]).devices(hosts(2))];
    let batched = create_batched_linop(Arc::clone(&op), &specs).unwrap();
    let x = util::random_vec::<f64>(&mut rng, ni);
    let mut want = vec![0.0f64; 2 * no];
    for o in 0..no {
        for m in 0..nm {
            let fm: f64 = (0..ni).map(|i| wf[m * ni + i] * x[i]).sum();
            want[o] += wg[o * nm + m] * fm;
        }
        want[no + o] = (0..ni).map(|i| wb[o * ni + i] * x[i]).sum();
    }
    let xa = Array::from_slice(&base, &[ni], &x).unwrap();
    assert_close(&batched.apply(&xa).unwrap().to_vec().unwrap(), &want, 1e-12);
    assert_close(&op.apply(&xa).unwrap().to_vec().unwrap(), &want, 1e-12);
    dot_test(batched.as_ref(), &base, &mut rng);
    // Four devices along m: the largest grid has 3 tiles, so one device would be dropped.
    let specs = [BatchSpec::new(&[("o", no)]).base(base), BatchSpec::new(&[("m", 1)]).devices(hosts(4))];
    assert!(matches!(create_batched_linop(op, &specs), Err(Error::InvalidArgument { .. })));
}

/// Back-to-back applies of a batched `Dense` over three host "devices", none read until all
/// are queued, and with the first results dropped while later ones are still queued: the
/// intermediates of each apply go back to the allocation cache and are reused by the next
/// ones, and every result still equals a scalar loop over the weight. Then the cache is
/// released (its memory freed) and the operator still works.
#[test]
fn pipelined_applies_reusing_cached_memory_match_a_scalar_loop() {
    let (n_i, n_o, rows) = (24, 20, 6);
    let mut rng = Rng::new(7);
    let base = host();
    let w: Vec<f64> = (0..n_o * n_i).map(|_| util::uniform(&mut rng)).collect();
    let weight = Array::from_slice(&base, &[n_o, n_i], &w).unwrap();
    let op: LinopRef<f64> =
        Arc::new(Dense::new(weight, &["o", "i"], dims(&[("i", n_i)]), dims(&[("o", n_o)])).unwrap());
    let matrix = DeviceMatrix::from_specs((0..3).map(|_| host_device(&mut rng)).collect()).unwrap();
    let spec = BatchSpec::new(&[("o", rows)]).devices(matrix).base(base.clone());
    let batched = create_batched_linop(op, &[spec]).unwrap();
    let reference =
        |x: &[f64]| -> Vec<f64> { (0..n_o).map(|o| (0..n_i).map(|i| w[o * n_i + i] * x[i]).sum()).collect() };
    let inputs: Vec<Vec<f64>> =
        (0..40).map(|_| (0..n_i).map(|_| util::uniform(&mut rng)).collect()).collect();
    for round in 0..3 {
        let mut results = Vec::new();
        for (k, x) in inputs.iter().enumerate() {
            let x = Array::from_slice(&base, &[n_i], x).unwrap();
            let y = batched.apply(&x).unwrap();
            // Every third result is dropped unread, while later applies are queued.
            if k % 3 != 2 {
                results.push((k, y));
            }
        }
        for (k, y) in results {
            assert_close(&y.to_vec().unwrap(), &reference(&inputs[k]), 1e-12);
            // Read, so its work is done: its memory goes to the cache now, for the next round.
            drop(y);
            assert!(cuferry::memory::cached_memory_bytes() > 0, "a read result's memory was not cached");
        }
        if round == 1 {
            cuferry::memory::release_cached_memory();
        }
    }
}
