#!/usr/bin/env bash
# One command for a GPU machine: build with every core, run the tests, run compute-sanitizer on
# the small cases of every kernel, benchmark. Logs go to $OUT (else ./gpu_check_logs).
#
#   scripts/gpu_check.sh [STAGES] [PYTEST_ARGS...]
#   STAGES: comma-separated subset of build,cmake,test,sanitize,variants,sweep,bench,bench-full
#   (default: build,test,sanitize,bench); variants = bench/launcher/variants.sh on the list in
#   $VARIANTS (launcher timing of kernel-file variants side by side); sweep = fusedops alone at
#   every N (bench/sweep.py)
#   PYTEST_ARGS replace the default test selection (tests/); BENCH_TIMEOUT caps the benchmark
#   (seconds; the report's tables are saved after every case, so a capped run keeps what it measured);
#   BENCH_FAMILIES and BENCH_STEM pass bench.run's --families and --stem.
#
# Liger (a benchmark peer) is installed from wheels in .whl/ when they are there (.whl/ is
# git-ignored: a device call carries it explicitly; the report header says whether Liger ran).
set -uo pipefail
cd "$(dirname "$0")/.."
stages=",${1:-build,test,sanitize,bench},"
shift || true
out="${OUT:-$PWD/gpu_check_logs}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
status=0
step() { echo "== $1 ($(date +%T))"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

if [[ $stages == *,build,* ]]; then
  step "build (MAX_JOBS=$MAX_JOBS, archs $TORCH_CUDA_ARCH_LIST)"
  python3 setup.py build_ext --inplace >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  python3 -c "import fusedops; print(fusedops.build_info())"
fi

if [[ $stages == *,cmake,* ]]; then
  step "cmake build + ctest"
  { cmake -B build/cmake -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')" \
    && cmake --build build/cmake -j "$MAX_JOBS" && (cd build/cmake && ctest --output-on-failure) \
    && (cd build/cmake/python && python3 -c "import fusedops; print(fusedops.__file__, fusedops.build_info())"); } \
    >"$out/cmake.log" 2>&1
  rc=$?; tail -5 "$out/cmake.log"; [[ $rc == 0 ]] || status=1
fi

if [[ $stages == *,test,* ]]; then
  step "pytest (all tests, GPU included)"
  python3 -m pytest -q -rfEs -p no:cacheprovider "${@:-tests}" 2>&1 | tee "$out/tests.log" | tail -40
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi

if [[ $stages == *,sanitize,* ]]; then
  for tool in memcheck racecheck; do
    step "compute-sanitizer $tool on the sanitizer-marked cases"
    # Only fusedops kernels are checked: the tests also run PyTorch's own kernels (cuDNN SDPA
    # reports races of its own).
    compute-sanitizer --tool "$tool" --kernel-name kns=fusedops --error-exitcode 99 --target-processes all \
      python3 -m pytest tests -q -m sanitizer -p no:cacheprovider >"$out/sanitizer_$tool.log" 2>&1
    rc=$?; tail -4 "$out/sanitizer_$tool.log"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitizer_$tool.log" | tail -2
    [[ $rc == 0 ]] || status=1
  done
fi

if [[ $stages == *,variants,* ]]; then
  step "launcher variants (${VARIANTS:-VARIANTS unset})"
  if [[ -f ${VARIANTS:-} ]]; then
    bench/launcher/variants.sh "$VARIANTS" "$out/variants" >"$out/variants.log" 2>&1
    rc=$?; cat "$out/variants"/*_table.md 2>/dev/null || tail -20 "$out/variants.log"
    [[ $rc == 0 ]] || status=1
  else
    echo "VARIANTS must name a variant list (bench/launcher/variants.sh)"; status=1
  fi
fi

if [[ $stages == *,sweep,* ]]; then
  step "sweep (fusedops alone at every N)"
  python3 -m bench.sweep 2>&1 | tee "$out/sweep.txt"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi

for mode in bench bench-full; do
  if [[ $stages == *,$mode,* ]]; then
    step "$mode"
    flag=$([[ $mode == bench ]] && echo --quick)
    timeout "${BENCH_TIMEOUT:-3000}" python3 -m bench.run $flag ${BENCH_FAMILIES:+--families "$BENCH_FAMILIES"} \
      ${BENCH_STEM:+--stem "$BENCH_STEM"} 2>"$out/$mode.err" | tee "$out/$mode.md"
    [[ ${PIPESTATUS[0]} == 0 ]] || { status=1; tail -20 "$out/$mode.err"; }
    tar czf "$out/results.tar.gz" bench/results
  fi
done
step "done, status $status"
exit $status
