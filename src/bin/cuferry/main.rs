//! The `cuferry` command-line tool: `info` and `bench`.
//!
//! Rules: `cuferry info` always succeeds on a machine without a GPU, driver or CUDA build: it
//! then reports the host backend and the reason CUDA is absent. `cuferry bench` measures on the
//! device it is given (the first CUDA device, else the host backend) and reports ratios to the
//! ceilings and baselines measured in the same run.

mod bench;
mod info;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Moves data on and between NVIDIA GPUs.
#[derive(Parser)]
#[command(name = "cuferry", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Devices, memory, CUDA runtime and driver versions, or why only the host backend runs.
    Info,
    /// Bandwidth of cuferry's paths against the ceilings and baselines, measured in one run.
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Info => info::run(),
        Command::Bench(args) => bench::run(&args),
    }
}
