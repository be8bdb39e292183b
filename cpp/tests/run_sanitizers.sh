#!/usr/bin/env bash
# Build and run the C++ tests (cpp/tests) in three configurations, one after the other:
#   plain, address+undefined (ASan+UBSan), thread (TSan).
# Usage: cpp/tests/run_sanitizers.sh [BUILD_ROOT]    (default: build/sanitizers)
# Environment: JOBS (parallel build and test jobs, default: nproc), CONFIGS (a subset, e.g.
# "plain tsan"), BUILD_TYPE (CMAKE_BUILD_TYPE, default: none, as a plain `cmake -S . -B ...`).
# Prints a summary; exits nonzero if any configuration fails to configure, build or pass.
set -u
cd "$(dirname "$0")/../.."
root=${1:-build/sanitizers}
jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}
configs=${CONFIGS:-"plain asan-ubsan tsan"}

sanitize_for() {
  case $1 in
    plain) echo "" ;;
    asan-ubsan) echo "address,undefined" ;;
    tsan) echo "thread" ;;
    *) echo "unknown configuration: $1" >&2; return 1 ;;
  esac
}

# TSan maps its shadow memory at fixed addresses; on kernels with a large mmap ASLR entropy
# (vm.mmap_rnd_bits > 28) older runtimes fail with "unexpected memory mapping". Run TSan
# without ASLR there if setarch is available.
tsan_prefix=()
rnd_bits=$(cat /proc/sys/vm/mmap_rnd_bits 2>/dev/null || echo 0)
if [ "$rnd_bits" -gt 28 ] && command -v setarch >/dev/null 2>&1; then
  tsan_prefix=(setarch "$(uname -m)" -R)
fi

build_type=${BUILD_TYPE:-}
mkdir -p "$root"
declare -A result seconds
status=0
for c in $configs; do
  san=$(sanitize_for "$c") || { status=1; continue; }
  dir=$root/$c
  start=$(date +%s)
  echo "=== $c: configure (EMMPOOL_SANITIZE='${san}') in $dir"
  if ! cmake -S . -B "$dir" "-DCMAKE_BUILD_TYPE=${build_type}" -DEMMPOOL_BUILD_PYTHON=OFF \
      -DEMMPOOL_BUILD_TESTS=ON -DEMMPOOL_WARNINGS_AS_ERRORS=ON "-DEMMPOOL_SANITIZE=${san}" \
      >"$dir.configure.log" 2>&1; then
    cat "$dir.configure.log"; result[$c]="CONFIGURE FAILED"; status=1
    seconds[$c]=$(( $(date +%s) - start )); continue
  fi
  echo "=== $c: build"
  if ! cmake --build "$dir" -j "$jobs" >"$dir.build.log" 2>&1; then
    tail -n 60 "$dir.build.log"; result[$c]="BUILD FAILED"; status=1
    seconds[$c]=$(( $(date +%s) - start )); continue
  fi
  echo "=== $c: test"
  prefix=()
  [ "$c" = tsan ] && prefix=("${tsan_prefix[@]}")
  "${prefix[@]}" ctest --test-dir "$dir" --output-on-failure -j "$jobs" 2>&1 | tee "$dir.ctest.log"
  if [ "${PIPESTATUS[0]}" -eq 0 ]; then
    result[$c]="passed"
  else
    result[$c]="TESTS FAILED"; status=1
  fi
  seconds[$c]=$(( $(date +%s) - start ))
  summary=$(grep -E "tests passed|tests failed" "$dir.ctest.log" | tail -n 1)
  [ -n "$summary" ] && result[$c]="${result[$c]} (${summary})"
done

echo
echo "=== summary (${root})"
for c in $configs; do
  printf '  %-11s %s  [%ss]\n' "$c" "${result[$c]:-not run}" "${seconds[$c]:-?}"
done
if [ $status -eq 0 ]; then echo "ALL CONFIGURATIONS PASSED"; else echo "SOME CONFIGURATIONS FAILED"; fi
exit $status
