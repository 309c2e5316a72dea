//! Halo exchange across processes (feature `mpi`), each test run by `mpirun` on loopback:
//! - the cubed sphere (6 tiles, edges and corners, every rotation, scalar and vector
//!   quantities) over 6 ranks and over 4 ranks (two tiles on some ranks, messages to self)
//!   matches the single-process pack-then-unpack bit for bit, two steps in a row; on CUDA
//!   (when a GPU is present) through pinned staging, equal to the host result bit for bit;
//! - a rank failing mid-exchange makes every other rank return `PeerFailed` naming it (not
//!   hang, not time out), and a silent rank makes its peers time out;
//! - bad links are rejected on the rank that has them and reported to the others, and links
//!   whose two ends do not match across ranks (tag, size) are rejected when built.

mod common;
mod cubed_sphere;
mod mpi_common;

use std::time::Duration;

use common::Rng;
use cubed_sphere::*;
use cuferry::distributed::{
    ExchangeOptions, ExchangeTiming, HaloCommunicator, HaloLink, Staging, TileArrays,
};
use cuferry::halo::{ElementType, HaloExchange, HaloPacker, HaloSpec, HorizontalDims};
use cuferry::{Device, DeviceBuffer, Error, Stream};
use mpi::traits::*;

fn sphere_spec() -> HaloSpec {
    HaloSpec::contiguous(ElementType::F64, &[NZ, W, W], HorizontalDims::xy(2, 1)).unwrap()
}

/// A packer from face `a` to face `b` on `device`: quantity-major, vector (x and y lists) or
/// scalar.
fn sphere_packer_on(
    device: Device,
    spec: &HaloSpec,
    a: usize,
    b: usize,
    quantities: usize,
    vector: bool,
) -> HaloPacker {
    let ex = exchanges_between(spec, a, b);
    let list: Vec<HaloExchange> = (0..quantities).flat_map(|_| ex.iter().cloned()).collect();
    HaloPacker::new(device, &list, vector.then_some(&list[..])).unwrap()
}

fn sphere_packer(spec: &HaloSpec, a: usize, b: usize, quantities: usize, vector: bool) -> HaloPacker {
    sphere_packer_on(Device::Host, spec, a, b, quantities, vector)
}

/// The single-process result: every face packs to every neighbour, then every neighbour
/// unpacks (one loopback packer per pair).
fn reference(data: &[Vec<Vec<f64>>], vector: bool) -> Vec<Vec<Vec<f64>>> {
    let spec = sphere_spec();
    let stream = Stream::new(Device::Host).unwrap();
    let arrays: Vec<Vec<DeviceBuffer<f64>>> = data
        .iter()
        .map(|f| f.iter().map(|a| DeviceBuffer::from_slice(&stream, a).unwrap()).collect())
        .collect();
    let quantities = if vector { 1 } else { 2 };
    let mut packers = Vec::new();
    for b in 0..6 {
        for a in senders_to(b) {
            let mut p = sphere_packer(&spec, a, b, quantities, vector);
            let (x, y) = face_arrays(&arrays[a], quantities, vector, p.quantities());
            p.pack(&x, y.as_deref()).unwrap();
            packers.push((b, p));
        }
    }
    for (b, p) in &mut packers {
        p.copy_pack_to_unpack().unwrap();
        let (x, y) = face_arrays(&arrays[*b], quantities, vector, p.quantities());
        p.unpack(&x, y.as_deref()).unwrap();
    }
    arrays.iter().map(|f| f.iter().map(|a| a.to_vec(&stream).unwrap()).collect()).collect()
}

/// A face's arrays expanded to a packer's quantity-major exchange list.
#[allow(clippy::type_complexity)]
fn face_arrays(
    face: &[DeviceBuffer<f64>],
    quantities: usize,
    vector: bool,
    exchanges: usize,
) -> (Vec<&DeviceBuffer<f64>>, Option<Vec<&DeviceBuffer<f64>>>) {
    let regions = exchanges / quantities;
    let comp = |q: usize, c: usize| if vector { &face[2 * q + c] } else { &face[q] };
    let x = (0..exchanges).map(|i| comp(i / regions, 0)).collect();
    let y = vector.then(|| (0..exchanges).map(|i| comp(i / regions, 1)).collect());
    (x, y)
}

/// The cubed sphere over the ranks of the world: face f on rank f % size, arrays and packers
/// on `device` (CUDA buffers reach MPI per `staging`); the result must equal the host
/// backend's single-process exchange bit for bit.
fn cubed_sphere_over_world(device: Device, staging: Staging) {
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let (me, size) = (world.rank() as usize, world.size() as usize);
    let owner = |f: usize| (f % size) as i32;
    let mine: Vec<usize> = (0..6).filter(|f| f % size == me).collect();
    let tile_of = |f: usize| mine.iter().position(|&m| m == f).unwrap();
    let spec = sphere_spec();
    for vector in [false, true] {
        let quantities = if vector { 1 } else { 2 };
        let tag = |a: usize, b: usize| (a * 6 + b) as i32;
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for b in 0..6 {
            for a in senders_to(b) {
                if owner(a) == me as i32 {
                    let p = sphere_packer_on(device, &spec, a, b, quantities, vector);
                    sends.push(HaloLink::new(owner(b), tag(a, b), tile_of(a), p));
                }
                if owner(b) == me as i32 {
                    let p = sphere_packer_on(device, &spec, a, b, quantities, vector);
                    recvs.push(HaloLink::new(owner(a), tag(a, b), tile_of(b), p));
                }
            }
        }
        let options = ExchangeOptions { staging, ..Default::default() };
        let mut comm = HaloCommunicator::new(&world, sends, recvs, options).unwrap();
        if staging == Staging::Host {
            assert!(!comm.direct_cuda());
        }
        let stream = Stream::new(device).unwrap();
        let mut arrays: Vec<Vec<DeviceBuffer<f64>>> = mine
            .iter()
            .map(|_| (0..2).map(|_| DeviceBuffer::zeroed(&stream, NZ * W * W).unwrap()).collect())
            .collect();
        for step in 0..2u64 {
            // Every rank draws the same fields for all faces; each loads its own.
            let data = fields(&mut Rng::new(100 + step + u64::from(vector) * 10), 2);
            for (t, &f) in mine.iter().enumerate() {
                for (q, a) in arrays[t].iter_mut().enumerate() {
                    a.copy_from_slice(&stream, &data[f][q]).unwrap();
                }
            }
            let refs: Vec<Vec<&DeviceBuffer<f64>>> = arrays.iter().map(|f| f.iter().collect()).collect();
            let ys: Vec<Vec<&DeviceBuffer<f64>>> = refs.iter().map(|f| f[1..].to_vec()).collect();
            let tiles: Vec<TileArrays<'_, f64>> = refs
                .iter()
                .zip(&ys)
                .map(|(f, y)| {
                    if vector {
                        TileArrays { x: &f[..1], y: Some(&y[..]) }
                    } else {
                        TileArrays { x: &f[..], y: None }
                    }
                })
                .collect();
            let timing = comm.exchange_tiles(&tiles).unwrap();
            assert_eq!(timing.bytes_sent, comm.bytes_sent());
            let want = reference(&data, vector);
            for (t, &f) in mine.iter().enumerate() {
                for q in 0..2 {
                    let got = arrays[t][q].to_vec(&stream).unwrap();
                    assert!(
                        got == want[f][q],
                        "face {f} array {q} differs from the single-process exchange (step {step})"
                    );
                }
            }
        }
    }
    println!("rank {me}: cubed sphere matches the single-process exchange");
}

#[test]
fn cubed_sphere_over_six_ranks_matches_single_process() {
    if mpi_common::ranks("cubed_sphere_over_six_ranks_matches_single_process", 6) {
        cubed_sphere_over_world(Device::Host, Staging::Auto);
    }
}

#[test]
fn cubed_sphere_over_four_ranks_with_two_tiles_on_some() {
    if mpi_common::ranks("cubed_sphere_over_four_ranks_with_two_tiles_on_some", 4) {
        cubed_sphere_over_world(Device::Host, Staging::Auto);
    }
}

#[test]
fn cubed_sphere_on_cuda_through_pinned_staging() {
    // Checked in the launcher: without a GPU no job starts (SKIP, or a failure under
    // CUFERRY_REQUIRE_GPU=1).
    let in_rank = std::env::var("CUFERRY_MPI_RANK_OF").is_ok();
    if !in_rank && common::cuda_device().is_none() {
        return;
    }
    if mpi_common::ranks("cubed_sphere_on_cuda_through_pinned_staging", 3) {
        cubed_sphere_over_world(Device::Cuda(0), Staging::Host);
    }
}

/// The 4 x 6 f64 array (y, x) of the small ring and error tests.
fn column_spec() -> HaloSpec {
    HaloSpec::contiguous(ElementType::F64, &[4, 6], HorizontalDims::xy(1, 0)).unwrap()
}

/// A host packer of one exchange.
fn host_packer(ex: &HaloExchange) -> HaloPacker {
    HaloPacker::new(Device::Host, std::slice::from_ref(ex), None).unwrap()
}

/// A ring of ranks, each with one 4 x 6 array (y, x): column 4 goes east into the neighbour's
/// column 0, column 1 goes west into the neighbour's column 5. Sends pack from tile 0; the
/// receives unpack into tile `recv_tile`.
fn ring_links(me: i32, size: i32, recv_tile: usize) -> (Vec<HaloLink>, Vec<HaloLink>) {
    let spec = column_spec();
    let east = HaloExchange::new(&spec, &[0..4, 4..5], 0, &[0..4, 0..1]).unwrap();
    let west = HaloExchange::new(&spec, &[0..4, 1..2], 0, &[0..4, 5..6]).unwrap();
    let packer = host_packer;
    let (right, left) = ((me + 1) % size, (me + size - 1) % size);
    let sends = vec![HaloLink::new(right, 0, 0, packer(&east)), HaloLink::new(left, 1, 0, packer(&west))];
    // The message from the east neighbour travels west (tag 1) into column 5.
    let recvs = vec![
        HaloLink::new(left, 0, recv_tile, packer(&east)),
        HaloLink::new(right, 1, recv_tile, packer(&west)),
    ];
    (sends, recvs)
}

/// The ring's data on `size` ranks: every rank's halo columns hold its neighbours' edge
/// columns after each of three steps, also where one rank is both neighbours (2 ranks) or its
/// own (1 rank), so that the two messages to one peer are told apart by their tags alone.
fn periodic_ring_delivers_the_neighbours_columns() {
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let (me, size) = (world.rank(), world.size());
    let (sends, mut recvs) = ring_links(me, size, 0);
    // Receives listed in the other order than their sends: only the tags can pair them.
    recvs.reverse();
    // `Duration::MAX` waits forever (it used to overflow the deadline and panic).
    let options = ExchangeOptions { timeout: Duration::MAX, ..Default::default() };
    let mut comm = HaloCommunicator::new(&world, sends, recvs, options).unwrap();
    let stream = Stream::new(Device::Host).unwrap();
    let value =
        |rank: i32, step: i32, y: usize, x: usize| f64::from(rank * 1000 + step * 100) + (y * 6 + x) as f64;
    let (left, right) = ((me + size - 1) % size, (me + 1) % size);
    for step in 0..3 {
        let data: Vec<f64> = (0..24).map(|i| value(me, step, i / 6, i % 6)).collect();
        let a = DeviceBuffer::from_slice(&stream, &data).unwrap();
        comm.exchange(&[&a], None).unwrap();
        let got = a.to_vec(&stream).unwrap();
        for y in 0..4 {
            assert_eq!(got[y * 6], value(left, step, y, 4), "rank {me} step {step}: column 0, row {y}");
            assert_eq!(got[y * 6 + 5], value(right, step, y, 1), "rank {me} step {step}: column 5, row {y}");
            for x in 1..5 {
                assert_eq!(got[y * 6 + x], value(me, step, y, x), "rank {me}: inner ({y}, {x}) changed");
            }
        }
    }
    world.barrier();
}

#[test]
fn periodic_ring_on_one_rank() {
    if mpi_common::ranks("periodic_ring_on_one_rank", 1) {
        periodic_ring_delivers_the_neighbours_columns();
    }
}

#[test]
fn periodic_ring_on_two_ranks() {
    if mpi_common::ranks("periodic_ring_on_two_ranks", 2) {
        periodic_ring_delivers_the_neighbours_columns();
    }
}

#[test]
fn a_rank_failing_mid_exchange_is_reported_to_every_rank() {
    if !mpi_common::ranks("a_rank_failing_mid_exchange_is_reported_to_every_rank", 4) {
        return;
    }
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let (me, size) = (world.rank(), world.size());
    let options = ExchangeOptions { timeout: Duration::from_secs(60), ..Default::default() };
    // Rank 2 unpacks into a second tile, whose array is too short: its receives are posted and
    // its sends go out, then the first unpack (queued when a message landed) fails.
    let (sends, recvs) = ring_links(me, size, usize::from(me == 2));
    let mut comm = HaloCommunicator::new(&world, sends, recvs, options).unwrap();
    let stream = Stream::new(Device::Host).unwrap();
    let a = DeviceBuffer::from_slice(&stream, &[1.0f64; 24]).unwrap();
    let short = DeviceBuffer::from_slice(&stream, &[1.0f64; 12]).unwrap();
    let (tile, short_tile) = ([&a], [&short]);
    let tiles = [TileArrays { x: &tile[..], y: None }, TileArrays { x: &short_tile[..], y: None }];
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(if me == 2 { comm.exchange_tiles(&tiles) } else { comm.exchange(&[&a], None) });
    }
    if me == 2 {
        assert!(
            matches!(&seen[0], Err(Error::InvalidArgument { what }) if what.contains("96 bytes")),
            "{:?}",
            seen[0]
        );
        assert!(seen[1..].iter().all(|r| matches!(r, Err(Error::Closed { .. }))), "{seen:?}");
    } else {
        let first_err = seen.iter().position(Result::is_err).expect("a peer's failure reaches every rank");
        assert!(
            matches!(&seen[first_err], Err(Error::PeerFailed { rank: 2, .. })),
            "rank {me}: {:?}",
            seen[first_err]
        );
        assert!(seen[first_err + 1..].iter().all(|r| matches!(r, Err(Error::Closed { .. }))));
    }
    assert!(comm.closed_by().is_some());
    world.barrier();
    println!(
        "rank {me}: saw {:?}",
        seen.iter().map(|r| r.as_ref().err().map(|e| e.to_string())).collect::<Vec<_>>()
    );
}

/// Both ends of every message are matched when the communicator is built: a message longer
/// than its receive (rank 1 sends two columns west where rank 0 unpacks one), a send that no
/// receive takes (it would pile up unread every step) and a receive that no send feeds (it
/// would wait out the deadline) fail `new` on the receiving rank and on its peers.
#[test]
fn links_that_do_not_match_across_ranks_are_rejected_when_built() {
    if !mpi_common::ranks("links_that_do_not_match_across_ranks_are_rejected_when_built", 2) {
        return;
    }
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let (me, size) = (world.rank(), world.size());
    let options = ExchangeOptions::default();
    let refused_by_rank_0 = |r: Result<HaloCommunicator, Error>, text: &str| match me {
        0 => assert!(matches!(&r, Err(Error::InvalidArgument { what }) if what.contains(text)), "{r:?}"),
        _ => assert!(matches!(r, Err(Error::PeerFailed { rank: 0, .. })), "{r:?}"),
    };
    // Too long.
    let (mut sends, recvs) = ring_links(me, size, 0);
    if me == 1 {
        let wide_west = HaloExchange::new(&column_spec(), &[0..4, 1..3], 0, &[0..4, 4..6]).unwrap();
        sends[1] = HaloLink::new(0, 1, 0, host_packer(&wide_west));
    }
    refused_by_rank_0(HaloCommunicator::new(&world, sends, recvs, options), "unpacks");
    // Rank 1 sends with tag 7, which rank 0 does not receive.
    let (mut sends, recvs) = ring_links(me, size, 0);
    if me == 1 {
        let ex = HaloExchange::new(&column_spec(), &[0..4, 1..2], 0, &[0..4, 5..6]).unwrap();
        sends.push(HaloLink::new(0, 7, 0, host_packer(&ex)));
    }
    refused_by_rank_0(HaloCommunicator::new(&world, sends, recvs, options), "pile up");
    // Rank 0 receives with tag 9, which rank 1 never sends.
    let (sends, mut recvs) = ring_links(me, size, 0);
    if me == 0 {
        let ex = HaloExchange::new(&column_spec(), &[0..4, 1..2], 0, &[0..4, 5..6]).unwrap();
        recvs.push(HaloLink::new(1, 9, 0, host_packer(&ex)));
    }
    refused_by_rank_0(HaloCommunicator::new(&world, sends, recvs, options), "tag 9");
    // And matching links still build and exchange.
    let (sends, recvs) = ring_links(me, size, 0);
    let mut comm = HaloCommunicator::new(&world, sends, recvs, options).unwrap();
    let stream = Stream::new(Device::Host).unwrap();
    let a = DeviceBuffer::from_slice(&stream, &[1.0f64; 24]).unwrap();
    comm.exchange(&[&a], None).unwrap();
    world.barrier();
}

/// A rank whose messages all complete at once (small sends, no receives) still reads a peer's
/// failure notice instead of returning `Ok` for good.
#[test]
fn a_rank_that_only_sends_hears_of_a_peers_failure() {
    if !mpi_common::ranks("a_rank_that_only_sends_hears_of_a_peers_failure", 2) {
        return;
    }
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let me = world.rank();
    let spec = column_spec();
    let ex = HaloExchange::new(&spec, &[0..4, 4..5], 0, &[0..4, 0..1]).unwrap();
    let packer = || host_packer(&ex);
    // Rank 0 only sends; rank 1 only receives, into a tile that is not passed: it fails.
    let (sends, recvs) = if me == 0 {
        (vec![HaloLink::new(1, 0, 0, packer())], vec![])
    } else {
        (vec![], vec![HaloLink::new(0, 0, 1, packer())])
    };
    let mut comm = HaloCommunicator::new(&world, sends, recvs, ExchangeOptions::default()).unwrap();
    let stream = Stream::new(Device::Host).unwrap();
    let a = DeviceBuffer::from_slice(&stream, &[1.0f64; 24]).unwrap();
    let first = comm.exchange(&[&a], None);
    world.barrier(); // rank 1 has failed and sent its notice
    if me == 1 {
        assert!(
            matches!(&first, Err(Error::InvalidArgument { what }) if what.contains("tile 1")),
            "{first:?}"
        );
    } else {
        assert_hears_of_failure(&mut comm, &a, first, 1);
    }
    world.barrier();
}

/// Exchanges again until one fails, at most 200 times (a rank whose messages all complete at
/// once hears of a peer's failure only in a later exchange): that error is `PeerFailed`
/// naming rank `failed`.
fn assert_hears_of_failure(
    comm: &mut HaloCommunicator,
    a: &DeviceBuffer<f64>,
    first: Result<ExchangeTiming, Error>,
    failed: i32,
) {
    let mut seen = vec![first];
    for _ in 0..200 {
        if seen.last().is_some_and(Result::is_err) {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
        seen.push(comm.exchange(&[a], None));
    }
    let err = seen.iter().find(|r| r.is_err());
    assert!(
        matches!(err, Some(Err(Error::PeerFailed { rank, .. })) if *rank == failed),
        "rank {}: never heard of rank {failed}'s failure: {seen:?}",
        comm.rank()
    );
}

/// Rank 0 receives column 0 from rank 1 and from rank 2: the result would depend on which
/// message landed last, so the exchange is refused on rank 0 (as one packer refuses two
/// overlapping unpack regions), and the senders hear of it. Disjoint columns from two links
/// are fine (the ring tests).
#[test]
fn receive_links_overlapping_on_one_array_are_refused() {
    if !mpi_common::ranks("receive_links_overlapping_on_one_array_are_refused", 3) {
        return;
    }
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let me = world.rank();
    let east = HaloExchange::new(&column_spec(), &[0..4, 4..5], 0, &[0..4, 0..1]).unwrap();
    let (sends, recvs) = if me == 0 {
        (vec![], vec![HaloLink::new(1, 0, 0, host_packer(&east)), HaloLink::new(2, 0, 0, host_packer(&east))])
    } else {
        (vec![HaloLink::new(0, 0, 0, host_packer(&east))], vec![])
    };
    let mut comm = HaloCommunicator::new(&world, sends, recvs, ExchangeOptions::default()).unwrap();
    let stream = Stream::new(Device::Host).unwrap();
    let a = DeviceBuffer::from_slice(&stream, &[1.0f64; 24]).unwrap();
    let first = comm.exchange(&[&a], None);
    world.barrier(); // rank 0 has failed and sent its notices
    if me == 0 {
        assert!(
            matches!(&first, Err(Error::InvalidArgument { what }) if what.contains("overlapping")),
            "{first:?}"
        );
    } else {
        assert_hears_of_failure(&mut comm, &a, first, 0);
    }
    world.barrier();
}

/// A failure with messages in flight leaks only the buffers MPI may still use: the links'
/// packers and their streams (a worker thread each on the host backend) are freed, so a rank
/// that rebuilds its communicator after each failure does not pile up threads. Rank 1 fails
/// before posting anything; rank 0's receives are then pending when it hears of it.
#[test]
fn failures_with_messages_in_flight_do_not_pile_up_threads() {
    if !mpi_common::ranks("failures_with_messages_in_flight_do_not_pile_up_threads", 2) {
        return;
    }
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let me = world.rank();
    let peer = 1 - me;
    let threads = || std::fs::read_dir("/proc/self/task").map(Iterator::count).unwrap_or(0);
    let stream = Stream::new(Device::Host).unwrap();
    let mut start = 0;
    for round in 0..4 {
        // An array per round: an array read by packs on the links' streams and never written
        // (the unpacks did not run) remembers those reads, streams included, until dropped.
        let a = DeviceBuffer::from_slice(&stream, &[1.0f64; 24]).unwrap();
        if round == 1 {
            // After a first round: whatever MPI and the host packers start once is running.
            // Pooled packer buffers whose last work was still queued when returned keep that
            // stream (a thread) until reused: a bounded retention this test does not count.
            cuferry::halo::clear_buffer_pool();
            start = threads();
        }
        // Six links each way, one column each (receives into one array must not overlap).
        let links = || {
            (0..6)
                .map(|c| {
                    let column = HaloExchange::new(&column_spec(), &[0..4, c..c + 1], 0, &[0..4, c..c + 1]);
                    HaloLink::new(peer, c as i32, 0, host_packer(&column.unwrap()))
                })
                .collect()
        };
        let mut comm = HaloCommunicator::new(&world, links(), links(), ExchangeOptions::default()).unwrap();
        let r = if me == 1 { comm.exchange_tiles::<f64>(&[]) } else { comm.exchange(&[&a], None) };
        match me {
            1 => assert!(
                matches!(&r, Err(Error::InvalidArgument { what }) if what.contains("tile 0")),
                "{r:?}"
            ),
            _ => assert!(matches!(r, Err(Error::PeerFailed { rank: 1, .. })), "{r:?}"),
        }
        drop(comm);
        world.barrier();
    }
    // A dropped stream's worker finishes its queue and exits on its own: wait for them.
    cuferry::halo::clear_buffer_pool();
    let since = std::time::Instant::now();
    while threads() > start + 2 && since.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let names = || -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .map(|d| d.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok()).collect())
            .unwrap_or_default()
    };
    assert!(
        threads() <= start + 2,
        "rank {me}: {} threads after three failures, {start} before: {:?}",
        threads(),
        names()
    );
    world.barrier();
}

#[test]
fn a_silent_rank_makes_its_peers_time_out() {
    if !mpi_common::ranks("a_silent_rank_makes_its_peers_time_out", 3) {
        return;
    }
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let (me, size) = (world.rank(), world.size());
    let options = ExchangeOptions { timeout: Duration::from_millis(500), ..Default::default() };
    let (sends, recvs) = ring_links(me, size, 0);
    let mut comm = HaloCommunicator::new(&world, sends, recvs, options).unwrap();
    let stream = Stream::new(Device::Host).unwrap();
    let a = DeviceBuffer::from_slice(&stream, &[1.0f64; 24]).unwrap();
    if me == 2 {
        // Never exchanges; waits until the others gave up.
        world.barrier();
    } else {
        let r = comm.exchange(&[&a], None);
        assert!(matches!(r, Err(Error::Timeout { .. }) | Err(Error::PeerFailed { .. })), "rank {me}: {r:?}");
        world.barrier();
        println!("rank {me}: {}", r.err().map(|e| e.to_string()).unwrap_or_default());
    }
}

#[test]
fn bad_links_fail_on_every_rank() {
    if !mpi_common::ranks("bad_links_fail_on_every_rank", 2) {
        return;
    }
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let me = world.rank();
    let spec = column_spec();
    let ex = HaloExchange::new(&spec, &[0..4, 4..5], 0, &[0..4, 0..1]).unwrap();
    let packer = || host_packer(&ex);
    let opts = ExchangeOptions::default();
    // Rank 1 names a rank that does not exist.
    let bad_peer = if me == 1 { 5 } else { 1 };
    let r = HaloCommunicator::new(&world, vec![HaloLink::new(bad_peer, 0, 0, packer())], vec![], opts);
    match me {
        1 => assert!(matches!(&r, Err(Error::InvalidArgument { what }) if what.contains("rank 5")), "{r:?}"),
        _ => assert!(matches!(r, Err(Error::PeerFailed { rank: 1, .. })), "{r:?}"),
    }
    // A tag outside the range, on every rank.
    let r = HaloCommunicator::new(&world, vec![HaloLink::new(0, -1, 0, packer())], vec![], opts);
    assert!(matches!(&r, Err(Error::InvalidArgument { what }) if what.contains("tag")), "{r:?}");
    // The same (peer, tag) twice among the receives, on rank 0.
    let recvs = if me == 0 {
        vec![HaloLink::new(1, 3, 0, packer()), HaloLink::new(1, 3, 0, packer())]
    } else {
        vec![]
    };
    let r = HaloCommunicator::new(&world, vec![], recvs, opts);
    match me {
        0 => {
            assert!(matches!(&r, Err(Error::InvalidArgument { what }) if what.contains("ambiguous")), "{r:?}")
        }
        _ => assert!(matches!(r, Err(Error::PeerFailed { rank: 0, .. })), "{r:?}"),
    }
    // Messages to self of two sizes (MPI may deliver the longer one cut short), a receive from
    // self that no send feeds, and a send to self that no receive takes: rejected when the
    // links are built.
    let wide = HaloExchange::new(&spec, &[0..4, 3..5], 0, &[0..4, 0..2]).unwrap();
    let wide_packer = || host_packer(&wide);
    let r = HaloCommunicator::new(
        &world,
        vec![HaloLink::new(me, 2, 0, packer())],
        vec![HaloLink::new(me, 2, 0, wide_packer())],
        opts,
    );
    assert!(matches!(&r, Err(Error::InvalidArgument { what }) if what.contains("sends itself")), "{r:?}");
    let r = HaloCommunicator::new(&world, vec![], vec![HaloLink::new(me, 2, 0, packer())], opts);
    assert!(matches!(&r, Err(Error::InvalidArgument { what }) if what.contains("itself nothing")), "{r:?}");
    // A send to self that no receive takes: it would never be delivered.
    let r = HaloCommunicator::new(&world, vec![HaloLink::new(me, 2, 0, packer())], vec![], opts);
    assert!(matches!(&r, Err(Error::InvalidArgument { what }) if what.contains("receives nothing")), "{r:?}");
    // A tile that is not passed, and arrays that do not fit the packer: the rank's exchange
    // fails and tells its peer.
    let peer = 1 - me;
    let mut comm = HaloCommunicator::new(
        &world,
        vec![HaloLink::new(peer, 0, if me == 0 { 1 } else { 0 }, packer())],
        vec![HaloLink::new(peer, 0, 0, packer())],
        opts,
    )
    .unwrap();
    let stream = Stream::new(Device::Host).unwrap();
    let a = DeviceBuffer::from_slice(&stream, &[0.0f64; 24]).unwrap();
    let r = comm.exchange(&[&a], None);
    match me {
        0 => assert!(matches!(&r, Err(Error::InvalidArgument { what }) if what.contains("tile 1")), "{r:?}"),
        _ => assert!(matches!(r, Err(Error::PeerFailed { rank: 0, .. })), "{r:?}"),
    }
    world.barrier();
}
