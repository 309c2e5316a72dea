#!/usr/bin/env bash
# Regenerates src/sys/bindings.rs from csrc/cuferry_cuda.h with bindgen (needs libclang:
# Debian's libclang-dev). The drift test in tests/sys_bindings.rs does the generating.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CUFERRY_BLESS_BINDINGS=1 cargo test --test sys_bindings -- --nocapture
