#!/usr/bin/env bash
# Halo exchange over MPI on this machine: time per step for 1..6 ranks, split into pack,
# transfer+unpack (unpacks run as messages land) and the unpack tail
# (examples/mpi_halo_bench.rs). Installs Open MPI from Debian when root and missing.
#
#   scripts/bench-mpi.sh [--time-limit S] [--steps N] [--json FILE]
#
# --time-limit S stops each mpirun (one rank count) after S seconds (default 120): TERM, then
# KILL 10 s later; the script then stops and fails (exit 124, or 137 after the KILL). A
# rank that fails aborts them all (the example calls MPI_Abort), so the limit is for hangs.
# Other arguments go to the example.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
limit=120
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --time-limit)
      [ $# -ge 2 ] || { echo "--time-limit needs a value (seconds)" >&2; exit 2; }
      limit=$2
      shift
      ;;
    *) args+=("$1") ;;
  esac
  shift
done
case "$limit" in
  '' | *[!0-9]* | 0) echo "--time-limit must be a whole number of seconds, at least 1: $limit" >&2; exit 2 ;;
esac
scripts/install-mpi.sh
cargo build --release --quiet --features mpi --example mpi_halo_bench
exe="${CARGO_TARGET_DIR:-target}/release/examples/mpi_halo_bench"
echo "cubed sphere, 6 tiles of 48x48+halo 3 x 79 levels, 10 f64 arrays per tile, host backend;"
echo "median over the steps of the slowest rank; $(nproc) cores on $(hostname); each run limited to ${limit} s"
echo "transfer+unpack: until every message was sent and received, with the unpacks run as they"
echo "landed; unpack tail: the unpacks still running after that. MB (all) counts messages a rank"
echo "sends itself (every one with 1 rank); GB/s is MB (all) over the step."
echo
echo "| ranks | pack ms | transfer+unpack ms | unpack tail ms | step ms | MB sent per step (all) | MB to other ranks | GB/s |"
echo "|------:|--------:|-------------------:|---------------:|--------:|-----------------------:|------------------:|-----:|"
for np in 1 2 3 4 5 6; do
  status=0
  timeout -k 10 "$limit" mpirun --allow-run-as-root --oversubscribe -np "$np" "$exe" ${args[@]+"${args[@]}"} || status=$?
  if [ "$status" != 0 ]; then
    if [ "$status" = 124 ] || [ "$status" = 137 ]; then
      echo "bench-mpi: $np ranks ran past the ${limit} s limit and were stopped" >&2
    else
      echo "bench-mpi: $np ranks failed (exit $status)" >&2
    fi
    exit "$status"
  fi
done
