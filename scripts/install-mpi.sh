#!/usr/bin/env bash
# Open MPI and the headers the `mpi` feature builds against (Debian: openmpi-bin,
# libopenmpi-dev; libclang-dev for rsmpi's bindgen). Does nothing when mpicc and mpirun are
# there; needs root and apt-get otherwise.
set -euo pipefail
if command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev libclang-dev >/dev/null
  echo "installed Open MPI (openmpi-bin libopenmpi-dev)"
else
  echo "Open MPI is missing and this is not root with apt-get: install openmpi-bin and libopenmpi-dev" >&2
  exit 1
fi
