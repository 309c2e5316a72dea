#!/usr/bin/env bash
# Regenerates src/sys/bindings.rs from csrc/cuferry_cuda.h with bindgen (needs libclang:
# Debian's libclang-dev). tools/gen-bindings is its own crate so that it builds while the
# bindings are stale; tests/sys_bindings.rs uses the same configuration to check for drift.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo run --quiet --manifest-path tools/gen-bindings/Cargo.toml --target-dir target/gen-bindings -- "$PWD"
