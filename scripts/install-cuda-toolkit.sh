#!/usr/bin/env bash
# Installs the CUDA 13.0 toolkit (nvcc, nvvm, crt headers, static cudart) from PyPI into
# .toolkit/ (git-ignored) when no nvcc is available. Idempotent: a second run with the toolkit
# present returns at once. Prints the CUDA_HOME it ends with on its last line.
#
# Where nvcc is looked for, in order (the same order build.rs uses):
#   $NVCC, $CUDA_HOME/bin/nvcc, $CUDA_PATH/bin/nvcc, the toolkit folder, nvcc on PATH.
# Variables: CUFERRY_TOOLKIT_DIR (default <repo>/.toolkit) moves the folder.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
toolkit_dir=${CUFERRY_TOOLKIT_DIR:-$repo/.toolkit}
venv=$toolkit_dir/venv
py_version=3.11
cuda_home=$venv/lib/python$py_version/site-packages/nvidia/cu13
# Pinned to the GPU machines' driver (580.159, CUDA 13.0): a newer toolkit would build code
# that driver refuses.
packages=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96
)

existing_nvcc() {
  if [ -n "${NVCC:-}" ] && [ -x "$NVCC" ]; then echo "$NVCC"; return 0; fi
  for home in "${CUDA_HOME:-}" "${CUDA_PATH:-}"; do
    if [ -n "$home" ] && [ -x "$home/bin/nvcc" ]; then echo "$home/bin/nvcc"; return 0; fi
  done
  if [ -x "$cuda_home/bin/nvcc" ]; then echo "$cuda_home/bin/nvcc"; return 0; fi
  command -v nvcc 2>/dev/null && return 0
  return 1
}

if found=$(existing_nvcc); then
  echo "install-cuda-toolkit: nvcc found at $found; nothing to install" >&2
  echo "$(dirname "$(dirname "$found")")"
  exit 0
fi

python=${PYTHON:-python$py_version}
command -v "$python" >/dev/null 2>&1 || python=python3
if ! "$python" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
  echo "install-cuda-toolkit: need Python $py_version (found $("$python" --version 2>&1)); set PYTHON" >&2
  exit 1
fi

echo "install-cuda-toolkit: installing ${packages[*]} into $venv" >&2
mkdir -p "$toolkit_dir"
# A half-made venv from an interrupted run is removed rather than trusted.
if [ ! -x "$venv/bin/pip" ]; then
  rm -rf "$venv"
  "$python" -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir "${packages[@]}"

if [ ! -x "$cuda_home/bin/nvcc" ]; then
  echo "install-cuda-toolkit: packages installed but $cuda_home/bin/nvcc is missing" >&2
  exit 1
fi
"$cuda_home/bin/nvcc" --version | tail -n 2 >&2
# A build made before this install is host-only, and cargo does not watch the toolkit folder:
# touching build.rs makes the next build look for nvcc again (and find this one).
touch "$repo/build.rs"
echo "$cuda_home"
