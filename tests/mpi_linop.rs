//! Distributed batched linops (feature `mpi`), run by `mpirun -np 4` on loopback:
//! - `create_distributed_linop(A, spec)(x) == A(x)` for random operator graphs, random batch
//!   sizes (ragged included), random rank matrices (1-d and 2-d), random base ranks and nested
//!   local specs, in f64, complex and f32; the result on every rank with `apply_all`; the
//!   distributed adjoint matches `A^H` and passes the dot test; both assemblies (reduce and
//!   gather) occur;
//! - errors are agreed on: the rank that fails returns its error, the others `PeerFailed`
//!   naming it, and the operator keeps working afterwards; a check failing on one rank only
//!   is agreed on too, and ranks passing different specs all get `InvalidArgument`;
//! - `local` specs are checked as `create_batched_linop` checks nested specs, on every rank
//!   alike: unknown dims are errors, and a local device matrix serves ragged tiles.

mod mpi_common;
#[path = "linop_common/mod.rs"]
mod util;

use std::sync::Arc;

use cuferry::distributed::{create_distributed_linop, DistributedBatchSpec, RankDevice, RankMatrix};
use cuferry::linop::{Array, BatchSpec, DeviceMatrix, Diagonal, Dims, Field, LinopRef};
use cuferry::num_complex::Complex;
use cuferry::{Device, DeviceSpec, Error};
use mpi::traits::*;
use util::{assert_close, inner, random_array, random_batches, random_graph, random_vec, Rng, Sizes};

/// One random case: every rank draws the same graph, spec and input from `seed`. Returns
/// whether the operator reduced (rather than gathered) and whether it scattered its input.
fn distributed_equals_unsplit<T: Field>(world: &impl Communicator, seed: u64, tol: f64) -> (bool, bool) {
    let (me, size) = (world.rank(), world.size());
    let mut rng = Rng::new(seed);
    let host = DeviceSpec::new(Device::Host).unwrap();
    let s = Sizes { b: 1 + rng.below(6), i: 1 + rng.below(7), o: 1 + rng.below(7), m: 1 + rng.below(5) };
    let op: LinopRef<T> = random_graph::<T>(&mut rng, &host, &s, 2);
    let batches = random_batches(&mut rng, op.as_ref(), &["b", "i", "o", "m", "s"]);
    let grid: Vec<usize> = batches.iter().map(|(d, b)| op.dim_size(d).unwrap().div_ceil(*b).max(1)).collect();
    // A rank matrix that fits the grid: 1-d, or 2-d when there are two axes.
    let shape: Vec<usize> = if grid.len() >= 2 && rng.below(2) == 0 {
        vec![1 + rng.below(grid[0]), 1 + rng.below(grid[1])]
    } else {
        vec![1 + rng.below(grid[0].min(size as usize * 2))]
    };
    let entries: Vec<RankDevice> = (0..shape.iter().product::<usize>())
        .map(|_| RankDevice::new(rng.below(size as usize) as i32, Device::Host))
        .collect();
    let mut spec = DistributedBatchSpec::new(&batches, RankMatrix::new(&shape, entries).unwrap())
        .base_rank(rng.below(size as usize) as i32);
    if rng.below(3) == 0 {
        // Each rank splits its tiles further over two host "devices" along b.
        let local = DeviceMatrix::from_devices(&[1], &[Device::Host]).unwrap();
        spec = spec.local(vec![BatchSpec::new(&[("b", 2)]).devices(local)]);
    }
    let dist = match create_distributed_linop(Arc::clone(&op), &spec, world) {
        Ok(d) => d,
        Err(e) => panic!("rank {me} seed {seed}: {e} for {op:?} with {spec:?}"),
    };
    assert_eq!(dist.idims(), op.idims());
    let x = random_array::<T>(&mut rng, &host, op.idims().sizes());
    let y = random_array::<T>(&mut rng, &host, op.odims().sizes());
    let base = spec.base_rank;
    let got = dist.apply((me == base).then_some(&x)).unwrap();
    let want = op.apply(&x).unwrap().to_vec().unwrap();
    match got {
        Some(got) => {
            assert_eq!(me, base, "only the base rank gets the result");
            assert_close(&got.to_vec().unwrap(), &want, tol);
        }
        None => assert_ne!(me, base),
    }
    // Everywhere, without passing x off the base rank.
    let all = dist.apply_all((me == base).then_some(&x)).unwrap();
    assert_close(&all.to_vec().unwrap(), &want, tol);
    // The adjoint, distributed by the same spec, against A^H y; and the dot test.
    let adj = dist.adjoint().unwrap();
    let ahy = adj.apply_all((me == base).then_some(&y)).unwrap().to_vec().unwrap();
    assert_close(&ahy, &op.adjoint().apply(&y).unwrap().to_vec().unwrap(), tol);
    let lhs = inner(&all.to_vec().unwrap(), &y.to_vec().unwrap());
    let rhs = inner(&x.to_vec().unwrap(), &ahy);
    let scale = (lhs.0 * lhs.0 + lhs.1 * lhs.1).sqrt();
    assert!(((lhs.0 - rhs.0).powi(2) + (lhs.1 - rhs.1).powi(2)).sqrt() <= 1e-5 * scale.max(1e-30));
    (dist.reduces(), dist.scatters_input())
}

#[test]
fn distributed_equals_unsplit_for_random_graphs() {
    if !mpi_common::ranks("distributed_equals_unsplit_for_random_graphs", 4) {
        return;
    }
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let mut modes = [0usize; 2];
    let mut inputs = [0usize; 2];
    let mut count = |(reduced, scattered): (bool, bool)| {
        modes[usize::from(reduced)] += 1;
        inputs[usize::from(scattered)] += 1;
    };
    for seed in 0..30 {
        count(distributed_equals_unsplit::<f64>(&world, seed, 1e-11));
    }
    for seed in 100..120 {
        count(distributed_equals_unsplit::<Complex<f64>>(&world, seed, 1e-11));
    }
    for seed in 200..210 {
        distributed_equals_unsplit::<f32>(&world, seed, 1e-4);
        distributed_equals_unsplit::<Complex<f32>>(&world, seed, 1e-4);
    }
    assert!(modes[0] > 0 && modes[1] > 0, "both assemblies occur: gather {} reduce {}", modes[0], modes[1]);
    assert!(
        inputs[0] > 0 && inputs[1] > 0,
        "both input paths occur: broadcast {} scatter {}",
        inputs[0],
        inputs[1]
    );
    println!(
        "rank {}: gathered {} and reduced {} cases; broadcast {} and scattered {} inputs",
        world.rank(),
        modes[0],
        modes[1],
        inputs[0],
        inputs[1]
    );
}

#[test]
fn distributed_errors_are_agreed_on_every_rank() {
    if !mpi_common::ranks("distributed_errors_are_agreed_on_every_rank", 4) {
        return;
    }
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let me = world.rank();
    let host = DeviceSpec::new(Device::Host).unwrap();
    let mut rng = Rng::new(7);
    let s = Sizes { b: 4, i: 5, o: 6, m: 3 };
    let op: LinopRef<f64> = random_graph::<f64>(&mut rng, &host, &s, 1);
    let ranks = RankMatrix::one_per_rank(4, Device::Host).unwrap();

    // A rank outside the communicator: every rank sees it.
    let bad = RankMatrix::new(&[2], vec![RankDevice::new(0, Device::Host), RankDevice::new(9, Device::Host)])
        .unwrap();
    let r = create_distributed_linop(Arc::clone(&op), &DistributedBatchSpec::new(&[("b", 2)], bad), &world);
    assert!(matches!(&r, Err(Error::InvalidArgument { what }) if what.contains("rank 9")), "{r:?}");

    // A device rank 1 cannot use: rank 1 fails placing its tile, the others hear of it.
    let mut entries: Vec<RankDevice> = (0..4).map(|r| RankDevice::new(r, Device::Host)).collect();
    entries[1].device = Device::Cuda(99);
    let spec = DistributedBatchSpec::new(&[("b", 1)], RankMatrix::new(&[4], entries).unwrap());
    let r = create_distributed_linop(Arc::clone(&op), &spec, &world);
    match me {
        1 => assert!(r.is_err() && !matches!(r, Err(Error::PeerFailed { .. })), "{r:?}"),
        _ => assert!(matches!(r, Err(Error::PeerFailed { rank: 1, .. })), "{r:?}"),
    }

    // Bad input on the base rank (2): it gets the error, the others PeerFailed; then the
    // same operator still works.
    let spec = DistributedBatchSpec::new(&[("b", 1)], ranks).base_rank(2);
    let dist = create_distributed_linop(Arc::clone(&op), &spec, &world).unwrap();
    let wrong = random_array::<f64>(&mut rng, &host, &[3, 3]);
    for input in [None, Some(&wrong)] {
        let r = dist.apply(if me == 2 { input } else { None });
        match me {
            2 => assert!(matches!(&r, Err(Error::InvalidArgument { .. })), "{r:?}"),
            _ => assert!(matches!(r, Err(Error::PeerFailed { rank: 2, .. })), "{r:?}"),
        }
    }
    let x = cuferry::linop::Array::from_slice(&host, &[4, 5], &random_vec::<f64>(&mut rng, 20)).unwrap();
    let got = dist.apply_all((me == 2).then_some(&x)).unwrap();
    assert_close(&got.to_vec().unwrap(), &op.apply(&x).unwrap().to_vec().unwrap(), 1e-11);
    println!("rank {me}: errors agreed on");
}

/// The weights of [`diagonal_of_five`].
const FIVE_WEIGHTS: [f64; 5] = [1.5, -2.0, 3.0, 0.5, 4.0];

/// A diagonal operator of [`FIVE_WEIGHTS`] over one dim `x` of size 5 (ragged when split by 4).
fn diagonal_of_five(host: &DeviceSpec) -> LinopRef<f64> {
    Arc::new(
        Diagonal::new(
            Array::from_slice(host, &[5], &FIVE_WEIGHTS).unwrap(),
            &["x"],
            Dims::new(&[("x", 5)]).unwrap(),
        )
        .unwrap(),
    )
}

/// `local` specs follow `create_batched_linop`'s rules on every rank: a dim the operator does
/// not know is an error everywhere (it used to be ignored), and a local device matrix is
/// judged by all the tiles it serves, so the rank holding the ragged tile places it too.
#[test]
fn local_specs_are_checked_like_batched_ones() {
    if !mpi_common::ranks("local_specs_are_checked_like_batched_ones", 2) {
        return;
    }
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let me = world.rank();
    let host = DeviceSpec::new(Device::Host).unwrap();
    let x = [2.0f64, 1.0, -1.0, 8.0, 0.25];
    let op = diagonal_of_five(&host);
    let ranks = RankMatrix::one_per_rank(2, Device::Host).unwrap();
    let hosts = |n: usize| DeviceMatrix::from_devices(&[n], &vec![Device::Host; n]).unwrap();
    let spec = |local: Vec<BatchSpec>| DistributedBatchSpec::new(&[("x", 4)], ranks.clone()).local(local);
    let invalid = |r: Result<_, Error>, what: &str| match r {
        Err(Error::InvalidArgument { what: w }) => assert!(w.contains(what), "rank {me}: {w}"),
        other => panic!("rank {me}: expected InvalidArgument about {what:?}, got {:?}", other.map(drop)),
    };
    // A typo in a local dim, with and without a device matrix; a local batch size of 0.
    invalid(
        create_distributed_linop(Arc::clone(&op), &spec(vec![BatchSpec::new(&[("xx", 2)])]), &world),
        "\"xx\"",
    );
    invalid(
        create_distributed_linop(
            Arc::clone(&op),
            &spec(vec![BatchSpec::new(&[("xx", 2)]).devices(hosts(1))]),
            &world,
        ),
        "\"xx\"",
    );
    invalid(create_distributed_linop(Arc::clone(&op), &spec(vec![BatchSpec::new(&[("x", 0)])]), &world), "0");
    // x=5 by 4: rank 0 holds a tile of 4 (two local tiles of 2), rank 1 the ragged tile of 1.
    let dist = create_distributed_linop(
        Arc::clone(&op),
        &spec(vec![BatchSpec::new(&[("x", 2)]).devices(hosts(2))]),
        &world,
    )
    .unwrap_or_else(|e| panic!("rank {me}: {e}"));
    let xa = Array::from_slice(&host, &[5], &x).unwrap();
    let got = dist.apply_all((me == 0).then_some(&xa)).unwrap().to_vec().unwrap();
    let want: Vec<f64> = FIVE_WEIGHTS.iter().zip(&x).map(|(a, b)| a * b).collect();
    assert_eq!(got, want, "rank {me}");
    // Three local devices: no tile has three local tiles, on any rank.
    invalid(
        create_distributed_linop(
            Arc::clone(&op),
            &spec(vec![BatchSpec::new(&[("x", 2)]).devices(hosts(3))]),
            &world,
        ),
        "places no tile",
    );
    println!("rank {me}: local specs checked");
}

/// Checks that can fail on one rank only (its own `local` specs) are agreed on: that rank
/// returns its error and the other `PeerFailed`, where the other used to block for good in the
/// first collective call. Ranks that pass different batch sizes, base ranks or element types
/// (of one size) all get `InvalidArgument` (their messages would not match). Then an operator
/// is still made.
#[test]
fn checks_failing_on_one_rank_and_mismatched_specs_are_agreed_on() {
    if !mpi_common::ranks("checks_failing_on_one_rank_and_mismatched_specs_are_agreed_on", 2) {
        return;
    }
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let me = world.rank();
    let host = DeviceSpec::new(Device::Host).unwrap();
    let op = diagonal_of_five(&host);
    let ranks = RankMatrix::one_per_rank(2, Device::Host).unwrap();
    let hosts = |n: usize| DeviceMatrix::from_devices(&[n], &vec![Device::Host; n]).unwrap();
    // Rank 1's local matrix has three devices, which no tile fills; rank 0's two are fine.
    let local = vec![BatchSpec::new(&[("x", 2)]).devices(hosts(if me == 1 { 3 } else { 2 }))];
    let spec = DistributedBatchSpec::new(&[("x", 4)], ranks.clone()).local(local);
    let r = create_distributed_linop(Arc::clone(&op), &spec, &world);
    match me {
        1 => assert!(
            matches!(&r, Err(Error::InvalidArgument { what }) if what.contains("places no tile")),
            "rank 1: {:?}",
            r.map(drop)
        ),
        _ => assert!(matches!(&r, Err(Error::PeerFailed { rank: 1, .. })), "rank 0: {:?}", r.map(drop)),
    }
    // Different batch sizes (two tiles either way), then different base ranks; then
    // mismatches that also fail one rank's own checks (a batch size of 0, a base rank outside
    // the communicator), which are reported as the mismatch on both ranks all the same.
    let mismatched = [
        DistributedBatchSpec::new(&[("x", if me == 0 { 4 } else { 3 })], ranks.clone()),
        DistributedBatchSpec::new(&[("x", 4)], ranks.clone()).base_rank(me),
        DistributedBatchSpec::new(&[("x", if me == 0 { 2 } else { 0 })], ranks.clone()),
        DistributedBatchSpec::new(&[("x", 4)], ranks.clone()).base_rank(if me == 1 { 7 } else { 0 }),
    ];
    for spec in &mismatched {
        let r = create_distributed_linop(Arc::clone(&op), spec, &world);
        assert!(
            matches!(&r, Err(Error::InvalidArgument { what }) if what.contains("different")),
            "rank {me}: {:?}",
            r.map(drop)
        );
    }
    // Element types of one size (f64 and Complex<f32>): rank 1 would read rank 0's f64 values
    // as pairs of f32.
    let spec = DistributedBatchSpec::new(&[("x", 4)], ranks.clone());
    let r = if me == 0 {
        create_distributed_linop(Arc::clone(&op), &spec, &world).map(drop)
    } else {
        let w: Vec<Complex<f32>> = FIVE_WEIGHTS.iter().map(|&v| Complex::new(v as f32, 0.0)).collect();
        let c: LinopRef<Complex<f32>> = Arc::new(
            Diagonal::new(
                Array::from_slice(&host, &[5], &w).unwrap(),
                &["x"],
                Dims::new(&[("x", 5)]).unwrap(),
            )
            .unwrap(),
        );
        create_distributed_linop(c, &spec, &world).map(drop)
    };
    assert!(
        matches!(&r, Err(Error::InvalidArgument { what }) if what.contains("element types")),
        "rank {me}: {r:?}"
    );
    // Different local specs are each rank's own business.
    let local = vec![BatchSpec::new(&[("x", if me == 0 { 2 } else { 1 })])];
    let dist = create_distributed_linop(
        Arc::clone(&op),
        &DistributedBatchSpec::new(&[("x", 4)], ranks).local(local),
        &world,
    )
    .unwrap_or_else(|e| panic!("rank {me}: {e}"));
    let x = [2.0f64, 1.0, -1.0, 8.0, 0.25];
    let xa = Array::from_slice(&host, &[5], &x).unwrap();
    let got = dist.apply_all((me == 0).then_some(&xa)).unwrap().to_vec().unwrap();
    let want: Vec<f64> = FIVE_WEIGHTS.iter().zip(&x).map(|(a, b)| a * b).collect();
    assert_eq!(got, want, "rank {me}");
    println!("rank {me}: one-rank failures and mismatched specs agreed on");
}

/// A rank matrix whose shape product wraps to the number of entries given is an error.
#[test]
fn rank_matrix_shape_overflow_is_an_error() {
    let entries = vec![RankDevice::new(0, Device::Host), RankDevice::new(1, Device::Host)];
    let r = RankMatrix::new(&[(1 << (usize::BITS - 1)) + 1, 2], entries);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
}
