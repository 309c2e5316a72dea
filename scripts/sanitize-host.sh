#!/usr/bin/env bash
# Runs the test suite on the host backend under a Rust sanitizer, and fails on any report.
#
# Usage: scripts/sanitize-host.sh thread|address [NAME...]
#   thread:  ThreadSanitizer (data races, in the crate's unsafe code and between its threads);
#   address: AddressSanitizer with LeakSanitizer (out-of-bounds and use-after-free accesses,
#            memory never freed when the process ends).
#   NAME:    test targets to run: `lib` (the library's unit tests), `bin` (the command-line
#            tool's), or an integration test's name (`ring`, `stress_ring`); all by default.
#
# Rules:
# - The build is host-only (the toolkit hidden): cudart and nvcc's code cannot be
#   instrumented, and the host backend runs the same stream, event, slot and cache protocol.
#   The Python tests load an uninstrumented library; they run, but are not checked.
# - The sanitizers need the nightly toolchain with its standard library rebuilt instrumented
#   (-Zbuild-std, from the rust-src component); both are installed through rustup when
#   missing. The stable build is untouched: the target directory is target/sanitize-KIND.
# - A build failure fails the script before anything runs, and so does a NAME that names no
#   test target.
# - Every test binary runs (ThreadSanitizer reports and goes on; AddressSanitizer stops a
#   binary at its first report), each within CUFERRY_SANITIZE_TIMEOUT seconds (1800 unless
#   set); the script fails if any binary failed, timed out or printed a sanitizer report.
#   The logs stay in target/sanitize-KIND/logs.
# - The leaks cuferry makes on purpose outside tests are listed, each with its reason, in
#   scripts/lsan-suppressions.txt; tests keep what they leak on purpose reachable
#   (memory::leaked_on_purpose). Any other leak fails the run.
# - The tests run without RUSTFLAGS: those that build the C library themselves (c_abi,
#   python_ctypes) build it with the stable toolchain, uninstrumented.
# - The stress tests run CUFERRY_STRESS_ITERS rounds (30 unless set): instrumented code runs
#   several times slower.
set -euo pipefail
cd "$(dirname "$0")/.."

kind=${1:-}
case "$kind" in
  thread) report='WARNING: ThreadSanitizer|ERROR: ThreadSanitizer' ;;
  address) report='ERROR: (Address|Leak)Sanitizer' ;;
  *)
    echo "usage: $0 thread|address [NAME...]" >&2
    exit 2
    ;;
esac
shift

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  rustup toolchain install nightly --profile minimal
fi
rustup component add rust-src --toolchain nightly >/dev/null

target=$(rustc -vV | sed -n 's/^host: //p')
export CARGO_TARGET_DIR="$PWD/target/sanitize-$kind"
export RUSTFLAGS="-Zsanitizer=$kind"
# The host-only build (as scripts/test.sh's): no nvcc anywhere it looks.
path_without_nvcc=$(printf '%s\n' "$PATH" | tr ':' '\n' | while IFS= read -r d; do
  if [ -n "$d" ] && [ ! -x "$d/nvcc" ]; then printf '%s:' "$d"; fi; done)
export PATH="${path_without_nvcc%:}" CUFERRY_TOOLKIT_DIR=/nonexistent CUFERRY_REQUIRE_CUDA=0
unset NVCC CUDA_HOME CUDA_PATH

# "name executable" for every test target, from cargo's own report of what it built. (Written
# to a file first: a process substitution's exit status would be lost.)
mkdir -p "$CARGO_TARGET_DIR"
artifacts="$CARGO_TARGET_DIR/test-artifacts.json"
if ! cargo +nightly test -Zbuild-std --target "$target" --tests --no-run --message-format=json \
  >"$artifacts"; then
  echo "the $kind-sanitized build failed" >&2
  exit 1
fi
mapfile -t built < <(python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    kinds = m["target"]["kind"]
    name = "bin" if "bin" in kinds else "lib" if "test" not in kinds else m["target"]["name"]
    print(name, m["executable"])
' <"$artifacts")
for wanted in "$@"; do
  if ! printf '%s\n' "${built[@]}" | cut -d' ' -f1 | grep -qx "$wanted"; then
    echo "no test target is named $wanted (names: lib, bin, or a file of tests/ without .rs)" >&2
    exit 2
  fi
done

# allocator_may_return_null: the out-of-memory tests ask for exabytes and expect a refusal.
export TSAN_OPTIONS="halt_on_error=0 second_deadlock_stack=1 allocator_may_return_null=1"
export ASAN_OPTIONS="detect_leaks=1 allocator_may_return_null=1 detect_stack_use_after_return=1"
export LSAN_OPTIONS="suppressions=$PWD/scripts/lsan-suppressions.txt print_suppressions=0"
export CUFERRY_STRESS_ITERS="${CUFERRY_STRESS_ITERS:-30}"
logs="$CARGO_TARGET_DIR/logs"
mkdir -p "$logs"
failed=0
ran=0
for entry in "${built[@]}"; do
  name=${entry%% *}
  exe=${entry#* }
  if [ $# -gt 0 ] && ! printf '%s\n' "$@" | grep -qx "$name"; then continue; fi
  log="$logs/$name.log"
  status=0
  env -u RUSTFLAGS timeout "${CUFERRY_SANITIZE_TIMEOUT:-1800}" "$exe" >"$log" 2>&1 || status=$?
  reports=$(grep -cE "$report" "$log" || true)
  echo "$name: exit $status, $reports sanitizer reports ($log)"
  ran=$((ran + 1))
  if [ "$status" != 0 ] || [ "$reports" != 0 ]; then failed=$((failed + 1)); fi
done
if [ "$ran" = 0 ]; then
  echo "the build listed no test target" >&2
  exit 1
fi
echo "$ran test targets under the $kind sanitizer, $failed with failures or reports"
[ "$failed" = 0 ]
