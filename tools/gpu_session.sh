#!/usr/bin/env bash
# One visit to a GPU machine with no package index: install the CuTe DSL wheels carried in .whl
# (see ../shared/tools/device-wheels.sh), install this project, prebuild every sm90a kernel in
# parallel, run the GPU tests, then the benchmarks named in $BENCH. Logs and JSON go to $OUT.
#   OUT=/tmp/out BENCH="elementwise norm" tools/gpu_session.sh [pytest args...]
set -uo pipefail
OUT=${OUT:-/tmp/mslk-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  && tar xJf .whl/cutlass_dsl_cu13.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || echo "editable install failed; using PYTHONPATH"
export MSLK_DSL_CACHE_DIR=${MSLK_DSL_CACHE_DIR:-/tmp/mslk-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -m mslk_dsl.cli aot build --target sm90a --workers "${WORKERS:-16}" --progress lines > "$OUT/aot.log" 2>&1
tail -3 "$OUT/aot.log"
timeout "${TEST_TIMEOUT:-480}" python3 -m pytest "${@:-tests/gpu}" -q -rs --durations=10 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
for b in ${BENCH:-}; do
  timeout "${BENCH_TIMEOUT:-300}" python3 tools/bench.py "$b" --json "$OUT/bench_$b.json" 2>&1 | tee "$OUT/bench_$b.log" | tail -40
done
