#!/usr/bin/env bash
# Builds every test and bench executable and the CLI with CUDA compiled in, strips them, and
# puts them with scripts/gpu-run.sh into gpu-bundle/, packed as gpu-bundle.tgz (both
# git-ignored; the archive is what travels: the device tool carries at most 64 MiB, which the
# unpacked folder outgrew), ready for a GPU machine that has no cargo:
#
#   scripts/gpu-bundle.sh                                              # here
#   tar xzf gpu-bundle.tgz && gpu-bundle/run.sh [--sanitize] [--bench] # there (carry gpu-bundle.tgz)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/install-cuda-toolkit.sh >/dev/null
export CUFERRY_REQUIRE_CUDA=1

bundle=gpu-bundle
rm -rf "$bundle" "$bundle.tgz"
mkdir -p "$bundle/tests" "$bundle/benches" "$bundle/bin"

list_executables() {
  # Reads cargo's JSON messages; prints "kind name path" for each executable built, and every
  # compiler error's text on stderr (cargo's own stderr is silenced below).
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    if msg.get("reason") == "compiler-message" and msg["message"].get("level") == "error":
        print(msg["message"].get("rendered") or msg["message"].get("message"), file=sys.stderr)
    exe = msg.get("executable")
    if msg.get("reason") == "compiler-artifact" and exe:
        target = msg["target"]
        kinds = target["kind"]
        if "example" in kinds:
            continue
        if "bench" in kinds:
            print("bench", target["name"], exe)
        elif kinds == ["bin"] and not msg["profile"]["test"]:
            print("bin", target["name"], exe)
        elif "lib" in kinds or "rlib" in kinds:
            print("test", "unit-lib", exe)
        elif kinds == ["bin"]:
            print("test", "unit-bin-" + target["name"], exe)
        else:
            print("test", target["name"], exe)
'
}

{
  cargo test --release --no-run --message-format=json 2>/dev/null
  cargo bench --no-run --message-format=json 2>/dev/null
  cargo build --release --bin cuferry --message-format=json 2>/dev/null
} | list_executables | sort -u | while read -r kind name path; do
  case "$kind" in
    test) dest="$bundle/tests/$name" ;;
    bench) dest="$bundle/benches/$name" ;;
    bin) dest="$bundle/bin/$name" ;;
  esac
  cp "$path" "$dest"
  strip "$dest"
done
# The MPI tests (the cubed sphere through pinned staging on CUDA; the distributed linop), when
# MPI is here to build them; run.sh runs them under the GPU machine's mpirun when libmpi loads
# there.
mpi_tests=(mpi_halo mpi_linop)
# Installed here if missing (as scripts/test.sh does): a bundle without them fails its run.
scripts/install-mpi.sh >/dev/null || echo "gpu-bundle: no MPI here: the bundle has no MPI tests" >&2
if command -v mpicc >/dev/null 2>&1; then
  mkdir -p "$bundle/mpi"
  cargo test --release --no-run --features mpi "${mpi_tests[@]/#/--test=}" --message-format=json 2>/dev/null \
    | list_executables | while read -r kind name path; do
      if [ "$kind" = test ] && [[ " ${mpi_tests[*]} " == *" $name "* ]]; then
        cp "$path" "$bundle/mpi/$name"
        strip "$bundle/mpi/$name"
      fi
    done
fi
# The drift tests need the sources; they have nothing to do on a GPU.
rm -f "$bundle/tests/sys_bindings" "$bundle/tests/c_header"
# Every integration test must travel: a test binary missing here would never run on a GPU.
missing=()
for source in tests/*.rs; do
  name=$(basename "$source" .rs)
  case "$name" in
    sys_bindings | c_header) continue ;;
    mpi_*) command -v mpicc >/dev/null 2>&1 || continue; where=mpi ;;
    *) where=tests ;;
  esac
  [ -x "$bundle/$where/$name" ] || missing+=("$where/$name")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "gpu-bundle: test executables missing from the bundle: ${missing[*]}" >&2
  exit 1
fi
# The C and Python consumers: the cdylib, the public header and their sources.
cargo build --release --lib --quiet
mkdir -p "$bundle/lib" "$bundle/src/include" "$bundle/src/tests"
# Where cargo put it (CARGO_TARGET_DIR honoured, as for the executables above).
cp "${CARGO_TARGET_DIR:-target}/release/libcuferry.so" "$bundle/lib/"
strip "$bundle/lib/libcuferry.so"
cp include/cuferry.h "$bundle/src/include/"
cp -r tests/c tests/python "$bundle/src/tests/"
cp -r python "$bundle/src/"
cp scripts/gpu-run.sh "$bundle/run.sh"
chmod +x "$bundle/run.sh"
ls -l "$bundle"/*/
tar czf "$bundle.tgz" "$bundle"
size=$(du -sm "$bundle" | cut -f1)
packed=$(du -sm "$bundle.tgz" | cut -f1)
echo "gpu-bundle: ${size} MiB, packed into $bundle.tgz: ${packed} MiB"
# The device tool carries the tracked files too (a few MiB) within its 64 MiB.
if [ "$packed" -ge 56 ]; then
  echo "$bundle.tgz is too close to the 64 MiB the device tool carries" >&2
  exit 1
fi
