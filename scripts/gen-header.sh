#!/usr/bin/env bash
# Regenerates include/cuferry.h (the public C header) from src/ffi.rs with cbindgen. The drift
# test in tests/c_header.rs does the generating.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CUFERRY_BLESS_HEADER=1 cargo test --test c_header -- --nocapture
