#!/usr/bin/env bash
# Runs the GPU bundle on a machine with a CUDA device (copied into gpu-bundle/run.sh by
# scripts/gpu-bundle.sh). Every test runs with CUFERRY_REQUIRE_GPU=1, so a missing device is
# a failure, not a skip.
#
#   run.sh              all tests (and the MPI tests under mpirun when the bundle has them),
#                       then `cuferry info`
#   run.sh --sanitize   also compute-sanitizer memcheck, racecheck and synccheck over each test
#   run.sh --bench      also `cuferry bench` (table in the log, bench.json and bench.svg beside
#                       the logs) and every criterion bench executable
#
# Logs go to $OUT/logs when OUT is set (the device tool brings $OUT back), else ./logs. The
# last lines printed are a pass/fail table; the exit code is non-zero when anything failed.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
logs=${OUT:-$here}/logs
mkdir -p "$logs"
export CUFERRY_REQUIRE_GPU=1
# The C ABI and Python tests find the cdylib and their sources here.
export CUFERRY_CDYLIB_DIR="$here/lib" CUFERRY_C_SOURCES="$here/src"
sanitize=0
bench=0
for arg in "$@"; do
  case "$arg" in
    --sanitize) sanitize=1 ;;
    --bench) bench=1 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

rows=()
failed=0
run() {
  local label=$1; shift
  local log="$logs/${label//[^A-Za-z0-9_.-]/_}.log"
  local start=$SECONDS status
  if "$@" >"$log" 2>&1; then status=pass; else status="FAIL (exit $?)"; failed=1; fi
  local detail
  detail=$(grep -E '^test result:|ERROR SUMMARY|^backend:' "$log" | tail -n 1)
  rows+=("$(printf '%-40s %-14s %4ss  %s' "$label" "$status" "$((SECONDS - start))" "$detail")")
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
run "info" "$here/bin/cuferry" info
for t in "$here"/tests/*; do
  run "test:$(basename "$t")" "$t"
done
# The MPI tests (built with the mpi feature) need mpirun and a loadable libmpi here.
for t in "$here"/mpi/*; do
  [ -e "$t" ] || continue
  if ! command -v mpirun >/dev/null 2>&1 || ldd "$t" | grep -q 'not found'; then
    rows+=("$(printf '%-40s %-14s' "mpi:$(basename "$t")" "SKIP (no mpirun or libmpi)")")
    continue
  fi
  run "mpi:$(basename "$t")" env CUFERRY_REQUIRE_MPI=1 "$t"
done
if [ "$sanitize" = 1 ]; then
  for tool in memcheck racecheck synccheck; do
    for t in "$here"/tests/*; do
      run "$tool:$(basename "$t")" compute-sanitizer --tool "$tool" --error-exitcode 99 "$t"
    done
  done
fi
if [ "$bench" = 1 ]; then
  out=${OUT:-$here}
  run "cuferry bench" "$here/bin/cuferry" bench --json "$out/bench.json" --plot "$out/bench.svg"
  for b in "$here"/benches/*; do
    [ -e "$b" ] || continue
    run "bench:$(basename "$b")" "$b" --bench --warm-up-time 1 --measurement-time 2
  done
fi

echo
echo "== cuferry GPU bundle: $(date -u +%Y-%m-%dT%H:%MZ)"
printf '%s\n' "${rows[@]}"
exit "$failed"
