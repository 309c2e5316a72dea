#!/usr/bin/env bash
# The whole test suite, with the CUDA sources compiled by nvcc. What a new user runs, and what
# .ci/run runs (with CUFERRY_REQUIRE_CUDA=1).
#
# Steps:
#   1. install the CUDA 13.0 toolkit from PyPI into .toolkit/ when no nvcc is found;
#   2. install libclang (Debian libclang-dev) for the bindings drift test, when root and missing;
#   3. build and test with the toolkit hidden: the host-only build must compile and pass;
#   4. rustfmt, clippy (with the `mpi` feature too) and rustdoc warnings, then every test
#      (unit, integration, doc) with CUDA compiled in;
#   5. the `mpi` feature's tests under mpirun (Open MPI installed from Debian when root).
# GPU tests print SKIP here unless a CUDA device is present (CUFERRY_REQUIRE_GPU=1 makes
# them fail instead; scripts/gpu-bundle.sh builds them for a GPU machine).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

step() { printf '\n== %s\n' "$*"; }

# Disk: CI machines may have little free space (one run ran out during the MPI step). Builds
# here keep line tables but no full debug info, and no incremental caches, which together
# take about two thirds of a full debug build's target/.
export CARGO_INCREMENTAL=0
export CARGO_PROFILE_DEV_DEBUG=line-tables-only
step "disk"
df -h . | tail -n 1

step "CUDA toolkit"
cuda_home=$(scripts/install-cuda-toolkit.sh | tail -n 1)
echo "CUDA toolkit: $cuda_home"

step "libclang (bindings drift test)"
has_libclang() { ldconfig -p 2>/dev/null | grep -qE 'libclang(-[0-9.]+)?\.so'; }
if has_libclang; then
  echo "libclang present"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  # Two commands, not an `&&` list: under `set -e` a failing first half of a list is ignored.
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libclang-dev >/dev/null
  echo "installed libclang-dev"
else
  echo "libclang missing and not root: the drift test will print SKIP"
fi
# With libclang here, the drift test must run rather than skip.
if has_libclang; then export CUFERRY_REQUIRE_LIBCLANG=1; fi

step "host-only build (toolkit hidden)"
# Every PATH entry without nvcc (the last one too: each line ends with a newline; an `if`, so
# the loop's status is 0 whatever the last entry was).
path_without_nvcc=$(printf '%s\n' "$PATH" | tr ':' '\n' | while IFS= read -r d; do
  if [ -n "$d" ] && [ ! -x "$d/nvcc" ]; then printf '%s:' "$d"; fi; done)
env -u NVCC -u CUDA_HOME -u CUDA_PATH \
  PATH="${path_without_nvcc%:}" CUFERRY_TOOLKIT_DIR=/nonexistent CUFERRY_REQUIRE_CUDA=0 \
  CUFERRY_EXPECT_HOST_ONLY=1 cargo test --tests --quiet

step "Open MPI (feature mpi)"
mpi=0
if [ "$(id -u)" = 0 ]; then
  # Root (CI) can install it: a failure there is a failure, not a reason to skip the MPI tests.
  scripts/install-mpi.sh
  mpi=1
elif scripts/install-mpi.sh; then
  mpi=1
else
  echo "no MPI (not root, not installed): the mpi feature is not built or tested"
fi

step "rustfmt, clippy and rustdoc"
cargo fmt --all -- --check
cargo clippy --all-targets --quiet -- -D warnings
if [ "$mpi" = 1 ]; then cargo clippy --all-targets --features mpi --quiet -- -D warnings; fi
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet

step "all tests with CUDA compiled in"
cargo test

if [ "$mpi" = 1 ]; then
  step "MPI tests (mpirun on loopback)"
  CUFERRY_REQUIRE_MPI=1 cargo test --features mpi --lib --test mpi_halo --test mpi_linop
fi

step "disk used by the build"
du -sh target 2>/dev/null || true
df -h . | tail -n 1
