//! `cuferry bench`: bandwidth of cuferry's paths, each next to the ceiling and the baseline a
//! user would otherwise use, all measured in the same run on the same device.
//!
//! Rules:
//! - Every figure is a median of repeats after a warm-up; device work is timed to completion.
//! - Ratios are only ever taken between figures of one run (the project's rule); absolute
//!   figures are reported with the device named.
//! - Without a GPU the same sections run on the host backend, against memcpy.
//! - Sections add rows as they measure them, and each row goes to stdout (one line) and into
//!   the JSON file as it is added ([`output`]): a run killed mid-section keeps every row it
//!   finished. Each section's table and the plot of every row so far are written as the
//!   section ends, also when it failed: a failing case loses only the rows after it.

mod copies;
mod halo;
mod linop;
mod managed;
mod measure;
mod output;
mod plot;
mod report;
mod ring;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use cuferry::Device;
use output::Rows;

/// Which parts to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Section {
    /// Copies against size: H2D/D2H pinned and pageable, D2D, peer, small-copy latency.
    Copy,
    /// The slot ring: pinned and pageable sources, slot sizes, depths, fill threads.
    Ring,
    /// Managed memory: pool allocation, prefetch, bulk, migration, advice.
    Managed,
    /// Halo pack: one launch against the seed's strategy and a same-bytes copy.
    Halo,
    /// Batched linear operator: tiles on the device against unsplit, and the overlap of
    /// transfers with compute.
    Linop,
}

/// Options of `cuferry bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Device to measure: `host`, `cuda:N`, or `auto` (the first CUDA device, else host).
    #[arg(long, default_value = "auto")]
    device: String,
    /// Sections to run (all when none is given).
    #[arg(long, value_enum)]
    section: Vec<Section>,
    /// A shorter sweep (fewer sizes, depths and threads, smaller totals).
    #[arg(long)]
    quick: bool,
    /// Write every figure as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw bandwidth against size into this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// The `--device` argument: `host`, `auto` or `cuda:N` of a device that exists here (one that
/// does not is an argument error, before any section runs).
fn parse_device(text: &str) -> Result<Device, String> {
    match text {
        "auto" => Ok(if Device::cuda_count() > 0 { Device::Cuda(0) } else { Device::Host }),
        "host" => Ok(Device::Host),
        other => {
            let device = other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device {other:?}: use host, cuda:N or auto"))?;
            device.check_available().map_err(|e| format!("device {other}: {e}"))?;
            Ok(device)
        }
    }
}

/// Opens each given output path for writing (creating it, keeping what it holds), so a path
/// that cannot be written is reported before any section runs.
fn check_writable(paths: &[&Option<PathBuf>]) -> Result<(), String> {
    for path in paths.iter().filter_map(|p| p.as_ref()) {
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}

/// Runs the chosen sections, printing each row as it is measured and each section's table as
/// it ends.
pub fn run(args: &BenchArgs) -> ExitCode {
    let device = match parse_device(&args.device) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("cuferry bench: {e}");
            return ExitCode::from(2);
        }
    };
    // An output file that cannot be written fails now, not after minutes of measuring.
    if let Err(e) = check_writable(&[&args.json, &args.plot]) {
        eprintln!("cuferry bench: {e}");
        return ExitCode::from(2);
    }
    let sections = if args.section.is_empty() {
        vec![Section::Copy, Section::Ring, Section::Managed, Section::Halo, Section::Linop]
    } else {
        args.section.clone()
    };
    let device_name = match device {
        Device::Host => {
            format!("host backend ({} threads)", std::thread::available_parallelism().map_or(1, |n| n.get()))
        }
        Device::Cuda(_) => {
            device.properties().map_or_else(|e| format!("{device} ({e})"), |p| format!("{device} {}", p.name))
        }
    };
    println!("cuferry bench on {device_name}");
    println!("rows as measured: {}; each section's table follows as it ends", report::line_header());
    let mut rows = Rows::new(&device_name, args.json.clone());
    let mut failed = false;
    for section in sections {
        rows.start_section();
        let result = match section {
            Section::Copy => copies::run(device, args.quick, &mut rows),
            Section::Ring => ring::run(device, args.quick, &mut rows),
            Section::Managed => managed::run(device, args.quick, &mut rows),
            Section::Halo => halo::run(device, args.quick, &mut rows),
            Section::Linop => linop::run(device, args.quick, &mut rows),
        };
        // Every row is already out (stdout and the JSON); the section's table and the plot so
        // far follow as soon as it ends, failed or not.
        let section_rows = rows.end_section();
        if !section_rows.is_empty() {
            println!("{}", report::table(section_rows));
        }
        if let Err(e) = result {
            eprintln!("cuferry bench: section {section:?} failed after {} rows: {e}", section_rows.len());
            failed = true;
        }
        if let Some(path) = &args.plot {
            let partial = report::partial_path(path);
            let drawn = plot::draw(&partial, &format!("cuferry bench on {device_name}"), rows.all())
                .and_then(|()| std::fs::rename(&partial, path).map_err(|e| e.to_string()));
            if let Err(e) = drawn {
                eprintln!("cuferry bench: cannot draw {}: {e}", path.display());
                failed = true;
            }
        }
    }
    failed |= rows.json_error().is_some();
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cuda_device_that_does_not_exist_is_an_argument_error() {
        let err = parse_device("cuda:4096").unwrap_err();
        assert!(err.contains("cuda:4096"), "{err}");
        assert!(parse_device("cuda:x").is_err() && parse_device("gpu").is_err());
        assert_eq!(parse_device("host"), Ok(Device::Host));
    }

    #[test]
    fn unwritable_outputs_are_found_before_measuring() {
        let dir = std::env::temp_dir().join(format!("cuferry-bench-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = Some(dir.join("out.json"));
        let bad = Some(dir.join("no-such-dir").join("out.svg"));
        assert!(check_writable(&[&good, &None]).is_ok());
        let err = check_writable(&[&good, &bad]).unwrap_err();
        assert!(err.contains("no-such-dir"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn outputs_are_written_beside_themselves_first() {
        let partial = report::partial_path(std::path::Path::new("/out/bench.json"));
        assert_eq!(partial, std::path::Path::new("/out/bench.json.partial"));
    }
}
