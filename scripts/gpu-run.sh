#!/usr/bin/env bash
# Runs the GPU bundle on a machine with a CUDA device (copied into gpu-bundle/run.sh by
# scripts/gpu-bundle.sh). Every test runs with CUFERRY_REQUIRE_GPU=1, so a missing device is
# a failure, not a skip.
#
#   run.sh                 all tests (and the MPI tests under mpirun when the bundle has them),
#                          the halo pack's kernel launches counted by ncu, then `cuferry info`
#   run.sh --sanitize      also compute-sanitizer memcheck, racecheck and synccheck over each test
#                          binary in tests/ (the MPI tests launch mpirun themselves; their CUDA
#                          paths, pinned staging and copies, are sanitized through the others)
#   run.sh --bench         also `cuferry bench` (table in the log, bench.json and bench.svg beside
#                          the logs)
#   run.sh --criterion     also every criterion bench executable (host paths, on this machine)
#   run.sh --no-tests      skip the plain test runs (with --sanitize or --bench)
#   run.sh --only REGEX    run only the tests whose names match REGEX
#   run.sh --deadline S    start nothing new once S seconds have passed (the table still prints)
#   run.sh --timeout S     kill any one step after S seconds (default 240)
#   run.sh --bench-timeout S      kill the bench after S seconds (default: --timeout)
#   run.sh --bench-reserve S      with --bench: steps before the bench start only while S
#                          seconds are left before the deadline, so a hung test costs tests,
#                          not the figures (default 0)
#   run.sh --hard-limit S  no step runs past S seconds (each step's timeout is cut to fit, with
#                          15 s left for the kill and the final table): set it below the
#                          outside limit on the whole command
#
# Logs go to a temporary folder, packed at the end as $OUT/logs.tar.gz (the device tool brings
# $OUT back, at most 8 files); without $OUT to ./logs. The last lines printed are a pass/fail
# table, written to summary.txt; with $OUT, $OUT/summary.txt is rewritten after every step
# and the bench writes its output straight to $OUT/bench.log, so a run killed from outside
# still brings back its table so far and what the bench printed. A check that cannot run here
# (no ncu, no mpirun, MPI tests not in the bundle) fails the run: the GPU machine has them.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${OUT:-$here}
if [ -n "${OUT:-}" ]; then logs=$(mktemp -d)/logs; else logs=$here/logs; fi
mkdir -p "$logs"
export CUFERRY_REQUIRE_GPU=1
# The C ABI and Python tests find the cdylib and their sources here.
export CUFERRY_CDYLIB_DIR="$here/lib" CUFERRY_C_SOURCES="$here/src"
sanitize=0
bench=0
criterion=0
tests=1
only=.
deadline=100000
step_timeout=240
bench_timeout=
bench_reserve=0
hard_limit=100000
while [ $# -gt 0 ]; do
  case "$1" in
    --sanitize) sanitize=1 ;;
    --bench) bench=1 ;;
    --criterion) criterion=1 ;;
    --no-tests) tests=0 ;;
    --only) only=$2; shift ;;
    --deadline) deadline=$2; shift ;;
    --timeout) step_timeout=$2; shift ;;
    --bench-timeout) bench_timeout=$2; shift ;;
    --bench-reserve) bench_reserve=$2; shift ;;
    --hard-limit) hard_limit=$2; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

[ -n "$bench_timeout" ] || bench_timeout=$step_timeout
# Steps start only before `limit`: before the bench, the deadline less the bench's reserve.
limit=$deadline
if [ "$bench" = 1 ]; then limit=$((deadline - bench_reserve)); fi

rows=()
failed=0
# The table so far, to $OUT/summary.txt (a run killed from outside still brings it back).
save_rows() {
  if [ -n "${OUT:-}" ]; then printf '%s\n' "${rows[@]}" >"$OUT/summary.txt"; fi
}
# A row for a check that could not run here: a failure (the GPU machine has every tool).
missing_row() {
  rows+=("$(printf '%-40s %-14s' "$1" "FAIL ($2)")")
  failed=1
  save_rows
}
# Runs one step (label, command...) under `step_timeout` (or `STEP_TIMEOUT` when set), cut to
# end 15 s before `hard_limit`, unless `limit` has passed; its output goes to `STEP_LOG` when
# set, else to a log named after the label.
run() {
  local label=$1; shift
  local budget=${STEP_TIMEOUT:-$step_timeout}
  local left=$((hard_limit - SECONDS - 15))
  if [ "$left" -lt "$budget" ]; then budget=$left; fi
  if [ "$SECONDS" -ge "$limit" ] || [ "$left" -lt 5 ]; then
    rows+=("$(printf '%-40s %-14s' "$label" "NOT RUN (deadline)")")
    failed=1
    save_rows
    return
  fi
  local log=${STEP_LOG:-"$logs/${label//[^A-Za-z0-9_.-]/_}.log"}
  local start=$SECONDS status code
  timeout --kill-after=10 "$budget" "$@" >"$log" 2>&1
  code=$?
  case "$code" in
    0) status=pass ;;
    124|137) status="FAIL (timeout)"; failed=1 ;;
    *) status="FAIL (exit $code)"; failed=1 ;;
  esac
  local detail
  detail=$(grep -E '^test result:|ERROR SUMMARY|^backend:|^launches counted' "$log" | tail -n 1)
  rows+=("$(printf '%-40s %-14s %4ss  %s' "$label" "$status" "$((SECONDS - start))" "$detail")")
  echo "${rows[-1]}" >&2
  save_rows
}
selected() { [[ "$(basename "$1")" =~ $only ]]; }

# Bounded: a device wedged by an earlier run can block nvidia-smi.
timeout 15 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
run "info" "$here/bin/cuferry" info
if [ "$tests" = 1 ]; then
  for t in "$here"/tests/*; do
    selected "$t" || continue
    run "test:$(basename "$t")" "$t"
  done
  # The MPI tests (built with the mpi feature) need mpirun and a loadable libmpi here.
  if [ "$only" = . ] && ! compgen -G "$here/mpi/*" >/dev/null; then
    missing_row "mpi" "not in the bundle: build it where MPI is installed"
  fi
  for t in "$here"/mpi/*; do
    [ -e "$t" ] || continue
    selected "$t" || continue
    if ! command -v mpirun >/dev/null 2>&1 || ldd "$t" | grep -q 'not found'; then
      missing_row "mpi:$(basename "$t")" "no mpirun or libmpi"
      continue
    fi
    run "mpi:$(basename "$t")" env CUFERRY_REQUIRE_MPI=1 "$t"
  done
fi
# Runs test $2 of binary $1 under ncu (clocks left alone, CSV) with the remaining arguments,
# prints ncu's output, and, when ncu and the test succeeded, runs the Python check $3 over it
# with `rows` bound to the CSV's data rows (dicts keyed by the header): its exit code is the
# step's.
ncu_check() {
  local exe=$1 test=$2 check=$3 text code
  shift 3
  # Streamed to the step's log as it comes (a step killed by its timeout keeps what it printed).
  text=$(mktemp)
  ncu --clock-control none --csv "$@" "$exe" "$test" --exact --nocapture 2>&1 | tee "$text"
  code=${PIPESTATUS[0]}
  [ "$code" = 0 ] || return "$code"
  python3 -c '
import csv, sys
rows, header = [], None
for row in csv.reader(l for l in sys.stdin if l.startswith("\"")):
    if "Kernel Name" in row:
        header = row
    elif header and len(row) == len(header):
        rows.append(dict(zip(header, row)))
'"$check" <"$text"
}
export -f ncu_check
# The launches of one pack, counted by Nsight Compute rather than taken from the packer: the
# halo test `ten_arrays_of_edges_pack_in_one_launch` packs the benchmark's 10-array edges once
# with the packer and once with the seed strategy, so ncu must see exactly 1 halo_kernel and
# 40 seed_gather_kernel launches. Clocks are left alone (--clock-control none, METHOD.md).
count_launches() {
  ncu_check "$1" ten_arrays_of_edges_pack_in_one_launch '
ids = {}
for r in rows:
    ids.setdefault(r["Kernel Name"], set()).add(r["ID"])
def count(part):
    return sum(len(v) for k, v in ids.items() if part in k)
halo, seed = count("halo_kernel"), count("seed_gather_kernel")
print(f"launches counted by ncu: halo_kernel {halo} (expected 1), seed_gather_kernel {seed} (expected 40)")
sys.exit(0 if (halo, seed) == (1, 40) else 1)
' --metrics launch__grid_size
}
export -f count_launches
# The DRAM bytes of an x-face pack (two 384^2 x 79 arrays, 24-byte runs at a 3120-byte pitch)
# at the device's default L2 fetch granularity and at 32 bytes: the halo test
# `x_faces_pack_the_same_at_every_l2_fetch_granularity` packs once at each (bit-exact both
# times), and ncu, flushing the caches before each kernel, reports what each launch read. The
# step fails when the test fails or ncu did not see the two launches; the bytes are for the
# log (the bench times the same setting).
xface_dram() {
  ncu_check "$1" x_faces_pack_the_same_at_every_l2_fetch_granularity '
launches = {}
for r in rows:
    value = float(r["Metric Value"].replace(",", ""))
    launches.setdefault(int(r["ID"]), {})[r["Metric Name"]] = value
payload = 2 * 2 * 79 * 384 * 3 * 8
for i, (lid, m) in enumerate(sorted(launches.items())):
    read, write = m.get("dram__bytes_read.sum", 0), m.get("dram__bytes_write.sum", 0)
    which = "default granularity" if i == 0 else "32-byte granularity"
    print(f"x-face pack {lid} ({which}): DRAM read {read/1e6:.2f} MB, written {write/1e6:.2f} MB, "
          f"for {payload/1e6:.2f} MB packed ({read/payload:.2f}x read amplification)")
reads = [m.get("dram__bytes_read.sum", 0) for _, m in sorted(launches.items())]
if len(reads) == 2 and abs(reads[1] - reads[0]) <= 0.02 * max(reads[0], 1):
    # The limit is a hint (CUDA may ignore or clamp it), or the default is already 32 bytes.
    print("32-byte granularity: DRAM reads unchanged (within 2%): the setting had no effect")
sys.exit(0 if len(launches) == 2 else 1)
' --print-units base --kernel-name regex:halo_kernel --metrics dram__bytes_read.sum,dram__bytes_write.sum
}
export -f xface_dram
if [ "$tests" = 1 ] && [ -x "$here/tests/halo" ] && selected "$here/tests/halo"; then
  if command -v ncu >/dev/null 2>&1; then
    run "ncu:halo_launches" bash -c 'count_launches "$1"' _ "$here/tests/halo"
    run "ncu:halo_xface_dram" bash -c 'xface_dram "$1"' _ "$here/tests/halo"
  else
    missing_row "ncu:halo_launches" "no ncu"
    missing_row "ncu:halo_xface_dram" "no ncu"
  fi
fi

# The benchmark runs before the sanitizers, which take most of a run's time: a deadline that
# cuts the run short then costs sanitizer steps (each reported NOT RUN), not the figures.
limit=$deadline
bench_log=$logs/cuferry_bench.log
if [ -n "${OUT:-}" ]; then bench_log=$OUT/bench.log; fi
if [ "$bench" = 1 ]; then
  # Anything else on the GPU (a test's leftover process) would skew the figures: logged.
  timeout 15 nvidia-smi --query-compute-apps=pid,name,used_memory --format=csv >"$logs/gpu_apps_before_bench.txt" 2>&1
  STEP_TIMEOUT=$bench_timeout STEP_LOG=$bench_log run "cuferry bench" \
    "$here/bin/cuferry" bench --json "$out/bench.json" --plot "$out/bench.svg"
fi

# One sanitizer over one test binary. API errors are not reported: the tests provoke them on
# purpose (bad arguments, refused advice) and check the typed errors. A test binary that never
# calls CUDA ("terminated before first instrumented API call") passes when its tests passed.
sanitize_test() {
  local tool=$1 exe=$2; shift 2
  local text code
  # Streamed to the step's log as it comes: a run killed by its timeout keeps what it printed
  # (which test was running). CUFERRY_UNDER_SANITIZER: tests that fault a child process on
  # purpose skip that part.
  text=$(mktemp)
  CUFERRY_UNDER_SANITIZER=1 compute-sanitizer --tool "$tool" --report-api-errors no \
    --error-exitcode 99 "$exe" "$@" 2>&1 | tee "$text"
  code=${PIPESTATUS[0]}
  # Filters that match no test (a renamed one) would pass without sanitizing anything.
  if [ $# -gt 0 ] && grep -q '^test result: ok\. 0 passed' "$text"; then
    echo "no test matched the filters: $*"
    return 1
  fi
  if [ "$code" = 255 ] && grep -q 'terminated before first instrumented API call' "$text" \
    && grep -q '^test result: ok' "$text"; then
    echo "backend: no CUDA call in this binary; nothing to sanitize"
    return 0
  fi
  return "$code"
}
export -f sanitize_test
# Racecheck instruments every shared-memory access: over the large random cases of these two
# binaries it outlasts the step limit, so it runs the named subset (the same kernels). Since
# the halo kernel stages its loads in shared memory, the whole halo binary ran past 400 s
# under racecheck (its 150-case subset was not timed), so the subset is one small test of
# every rotation and one of a block passing between staged unit sizes (4, 16 and 8 bytes);
# halo_cubed_sphere runs whole (every edge, turned, scalar and vector).
declare -A racecheck_subset=([halo]="every_rotation_of_a_non_square_block units_of_several_sizes_in_one_block"
  [managed]=bulk_round_trip)
if [ "$sanitize" = 1 ]; then
  for tool in memcheck racecheck synccheck; do
    for t in "$here"/tests/*; do
      selected "$t" || continue
      # PyTorch's start-up under the sanitizer outlasts any step limit; the C ABI it drives
      # is sanitized through c_abi and python_ctypes.
      [ "$(basename "$t")" = python_torch ] && continue
      subset=()
      if [ "$tool" = racecheck ] && [ -n "${racecheck_subset[$(basename "$t")]:-}" ]; then
        read -ra subset <<<"${racecheck_subset[$(basename "$t")]}"  # test-name filters
      fi
      run "$tool:$(basename "$t")" bash -c 'sanitize_test "$@"' _ "$tool" "$t" "${subset[@]}"
    done
  done
fi
if [ "$criterion" = 1 ]; then
  for b in "$here"/benches/*; do
    [ -e "$b" ] || continue
    run "bench:$(basename "$b")" "$b" --bench --warm-up-time 1 --measurement-time 2
  done
fi

{
  if [ "$bench" = 1 ] && [ -f "$bench_log" ]; then
    echo "== cuferry bench"
    cat "$bench_log"
  fi
  echo
  echo "== cuferry GPU bundle: $(date -u +%Y-%m-%dT%H:%MZ)"
  printf '%s\n' "${rows[@]}"
} | tee "$logs/summary.txt"
if [ -n "${OUT:-}" ]; then
  cp "$logs/summary.txt" "$OUT/summary.txt"
  tar -czf "$OUT/logs.tar.gz" -C "$(dirname "$logs")" logs
fi
exit "$failed"
