#!/usr/bin/env bash
# Halo exchange over MPI on this machine: time per step for 1..6 ranks, split into pack,
# transfer and unpack (examples/mpi_halo_bench.rs). Installs Open MPI from Debian when root
# and missing. Usage: scripts/bench-mpi.sh [--steps N] [--json FILE]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/install-mpi.sh
cargo build --release --quiet --features mpi --example mpi_halo_bench
exe="${CARGO_TARGET_DIR:-target}/release/examples/mpi_halo_bench"
echo "cubed sphere, 6 tiles of 48x48+halo 3 x 79 levels, 10 f64 arrays per tile, host backend;"
echo "median over the steps of the slowest rank; $(nproc) cores on $(hostname)"
echo
echo "| ranks | pack ms | transfer ms | unpack ms | step ms | MB sent per step | GB/s |"
echo "|------:|--------:|------------:|----------:|--------:|-----------------:|-----:|"
for np in 1 2 3 4 5 6; do
  mpirun --allow-run-as-root --oversubscribe -np "$np" "$exe" "$@"
done
