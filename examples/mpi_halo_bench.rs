//! Halo exchange time per step over MPI ranks (feature `mpi`): the cubed sphere of the halo
//! tests (6 tiles of 48 x 48 + halo 3, 79 levels, f64, edges and corners) with 10 scalar
//! arrays per tile, tiles dealt round-robin to the ranks. Run by `scripts/bench-mpi.sh` for
//! 1..6 ranks:
//!
//! ```text
//! mpirun -np 4 target/release/examples/mpi_halo_bench [--steps 30] [--json FILE]
//! ```
//!
//! Each step is timed by every rank (`HaloCommunicator::exchange_tiles` splits it into three
//! consecutive intervals); each of the step's four figures is the slowest rank's for that
//! interval (taken separately, so the three parts need not add up to the step's total), and
//! the table shows the median over the steps (after 5 warm-up steps). The intervals:
//! - pack: until every link packed (each message is posted as soon as its pack is done);
//! - transfer+unpack: until every message was sent and received; a message's unpack runs as
//!   it lands (on the polling thread for host unpacks under 1 MiB), so most unpacking is here;
//! - unpack tail: until the unpacks still running after the last message finished.
//!
//! Bytes are counted twice: every message (a tile's neighbour on the same rank is sent to the
//! rank itself, through MPI too; with one rank that is every message) and the messages to
//! other ranks only. GB/s is every message's bytes over the step's median.
//!
//! Rank 0 prints one markdown row, and appends a JSON line to FILE. `--steps` is at least 1.
//! A rank that fails after MPI is initialised prints its error and aborts every rank
//! (`MPI_Abort`): returning would leave its peers blocked in the step's reductions and its own
//! `MPI_Finalize` waiting for them.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/cubed_sphere/mod.rs"]
mod cubed_sphere;

use std::error::Error;
use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use common::Rng;
use cubed_sphere::*;
use cuferry::distributed::{ExchangeOptions, ExchangeTiming, HaloCommunicator, HaloLink, TileArrays};
use cuferry::halo::{ElementType, HaloExchange, HaloPacker, HaloSpec, HorizontalDims};
use cuferry::{Device, DeviceBuffer, Stream};
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

const ARRAYS: usize = 10;
const WARMUP: usize = 5;

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| -> Result<Option<String>, String> {
        match args.iter().position(|a| a == name) {
            None => Ok(None),
            Some(i) => args.get(i + 1).cloned().map(Some).ok_or_else(|| format!("{name} needs a value")),
        }
    };
    let steps: usize = arg("--steps")?.map_or(Ok(30), |s| s.parse())?;
    if steps == 0 {
        return Err("--steps must be at least 1 (the figures are medians over the steps)".into());
    }
    let json = arg("--json")?;

    let universe = mpi::initialize().ok_or("MPI was already initialised")?;
    let world = universe.world();
    // From here on a failing rank aborts them all (see the module docs); a panic too, after
    // its message is printed.
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| bench(&world, steps, json.as_deref())));
    match outcome {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => {
            eprintln!("mpi_halo_bench: rank {}: {e}; aborting every rank", world.rank());
            world.abort(1)
        }
        Err(_) => {
            eprintln!("mpi_halo_bench: rank {} panicked; aborting every rank", world.rank());
            world.abort(1)
        }
    }
}

/// The benchmark on `world`: every rank runs it; rank 0 prints the row and writes the JSON.
fn bench(world: &SimpleCommunicator, steps: usize, json: Option<&str>) -> Result<(), Box<dyn Error>> {
    let (me, size) = (world.rank() as usize, world.size() as usize);
    let owner = |f: usize| (f % size) as i32;
    let mine: Vec<usize> = (0..6).filter(|f| f % size == me).collect();
    let tile_of = |f: usize| mine.iter().position(|&m| m == f).unwrap_or(0);

    let spec = HaloSpec::contiguous(ElementType::F64, &[NZ, W, W], HorizontalDims::xy(2, 1))?;
    let packer = |a: usize, b: usize| -> cuferry::Result<HaloPacker> {
        let ex = exchanges_between(&spec, a, b);
        let list: Vec<HaloExchange> = (0..ARRAYS).flat_map(|_| ex.iter().cloned()).collect();
        HaloPacker::new(Device::Host, &list, None)
    };
    let (mut sends, mut recvs) = (Vec::new(), Vec::new());
    // Bytes this rank sends per step to other ranks (messages to itself left out).
    let mut remote = 0usize;
    for b in 0..6 {
        for a in senders_to(b) {
            let tag = (a * 6 + b) as i32;
            if owner(a) == me as i32 {
                let send = packer(a, b)?;
                if owner(b) != me as i32 {
                    remote += send.buffer_bytes();
                }
                sends.push(HaloLink::new(owner(b), tag, tile_of(a), send));
            }
            if owner(b) == me as i32 {
                recvs.push(HaloLink::new(owner(a), tag, tile_of(b), packer(a, b)?));
            }
        }
    }
    let mut remote_total = 0usize;
    world.all_reduce_into(&remote, &mut remote_total, SystemOperation::sum());
    let mut comm = HaloCommunicator::new(world, sends, recvs, ExchangeOptions::default())?;
    let stream = Stream::new(Device::Host)?;
    let mut rng = Rng::new(1);
    let arrays: Vec<Vec<DeviceBuffer<f64>>> = mine
        .iter()
        .map(|_| {
            (0..ARRAYS)
                .map(|_| {
                    let data: Vec<f64> = (0..NZ * W * W).map(|_| rng.below(1000) as f64).collect();
                    DeviceBuffer::from_slice(&stream, &data)
                })
                .collect::<cuferry::Result<Vec<_>>>()
        })
        .collect::<cuferry::Result<_>>()?;
    let refs: Vec<Vec<&DeviceBuffer<f64>>> = arrays.iter().map(|t| t.iter().collect()).collect();
    let tiles: Vec<TileArrays<'_, f64>> = refs.iter().map(|t| TileArrays { x: &t[..], y: None }).collect();

    let mut per_step: Vec<[f64; 4]> = Vec::with_capacity(steps);
    let mut bytes = 0usize;
    for step in 0..WARMUP + steps {
        world.barrier();
        let t: ExchangeTiming = comm.exchange_tiles(&tiles)?;
        let mine = [secs(t.pack), secs(t.transfer), secs(t.unpack), secs(t.total())];
        let mut slowest = [0.0f64; 4];
        world.all_reduce_into(&mine[..], &mut slowest[..], SystemOperation::max());
        let mut sent = 0usize;
        world.all_reduce_into(&t.bytes_sent, &mut sent, SystemOperation::sum());
        if step >= WARMUP {
            per_step.push(slowest);
            bytes = sent;
        }
    }
    if me == 0 {
        let med: Vec<f64> = (0..4).map(|k| median(per_step.iter().map(|s| s[k]).collect())).collect();
        let ms = |s: f64| s * 1e3;
        println!(
            "| {size} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} |",
            ms(med[0]),
            ms(med[1]),
            ms(med[2]),
            ms(med[3]),
            bytes as f64 / 1e6,
            remote_total as f64 / 1e6,
            bytes as f64 / med[3] / 1e9
        );
        if let Some(path) = json {
            let line = serde_json::json!({
                "ranks": size, "arrays": ARRAYS, "steps": steps,
                "pack_s": med[0], "transfer_unpack_s": med[1], "unpack_tail_s": med[2],
                "total_s": med[3], "bytes_per_step": bytes,
                "bytes_to_other_ranks_per_step": remote_total,
            });
            let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
            writeln!(f, "{line}")?;
        }
    }
    Ok(())
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
