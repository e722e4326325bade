#!/usr/bin/env bash
# One visit to a GPU machine with no package index: install the CuTe DSL wheels carried in .whl
# (see ../shared/tools/device-wheels.sh), install this project, run the GPU tests (compiling their
# kernels in parallel; PREBUILD=1 first builds every sm90a kernel of the manifest), then the
# benchmarks named in $BENCH. Logs and JSON end up in
# $OUT/results.tgz (few files come back from such machines), the test log also as $OUT/gpu_tests.log.
#   OUT=/tmp/out BENCH="elementwise;norm" tools/gpu_session.sh [pytest args...]
# (BENCH is ;-separated when a benchmark takes options: BENCH="overhead;gemm --tune"); AFTER, if
# set, is one more command run last in the same environment (its output goes to $OUT/after.log).
set -uo pipefail
FINAL=${OUT:-/tmp/mslk-out}; OUT=$FINAL/work; mkdir -p "$OUT"
trap 'tar czf "$FINAL/results.tgz" -C "$OUT" . ; cp "$OUT/gpu_tests.log" "$FINAL/" 2>/dev/null' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  && tar xJf .whl/cutlass_dsl_cu13.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
# Like a pip install, with bytecode: start-up times then measure what a deployment pays.
unset PYTHONDONTWRITEBYTECODE
python3 -m compileall -q -j 0 /tmp/site mslk_dsl templates >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || echo "editable install failed; using PYTHONPATH"
# pyproject.toml maps templates/, arch/ and aot/ into the package; without the editable install,
# links give the checkout on PYTHONPATH the same import names (git-ignored).
if ! python3 -c "import mslk_dsl.templates, mslk_dsl.arch, mslk_dsl.manifests" >/dev/null 2>&1; then
  ln -sfn ../templates mslk_dsl/templates && ln -sfn ../arch mslk_dsl/arch && ln -sfn ../aot mslk_dsl/manifests
fi
export MSLK_DSL_CACHE_DIR=${MSLK_DSL_CACHE_DIR:-/tmp/mslk-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
if [ "${PREBUILD:-0}" = 1 ]; then   # every sm90a kernel of the manifest (benchmarks of many configs)
  python3 -m mslk_dsl.cli aot build --target sm90a --workers "${WORKERS:-16}" --progress lines > "$OUT/aot.log" 2>&1
  tail -3 "$OUT/aot.log"
fi
# The tests compile their kernels on first use, pytest-xdist's processes side by side: the whole
# of tests/gpu took 275-400 s from an empty kernel cache with 14 processes on a 16-core H100 host.
# Together that many processes can run an 80 GB GPU out of memory, so what failed runs once more
# with 3 (its kernels compiled by then). A first pass cut short by TEST_TIMEOUT (SIGINT: pytest
# still reports and saves what it ran) is followed by the whole suite with 4 processes (100 s
# with every kernel cached), since the tests it never reached are not among the failed. The
# largest tests (full-size MoE layers, long-KV decode) share the xdist group "gpu-memory", which
# `--dist loadgroup` runs on one worker, one after another (a full-size FP8 layer beside five other
# workers ran an 80 GB H100 out of memory under plain `-n 6`).
# pytest-xdist workers of a pass cut short can outlive it and keep their GPU memory (2026-12-07:
# ~60 GB held by the workers of a killed pass, and every memory-hungry test of the next pass ran
# out of memory). A visit's machine runs nothing else, so before each pass every process still
# on the GPU is ended.
free_gpu() {
  nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9 2>/dev/null
  sleep 2
}
free_gpu
timeout -s INT -k 30 "${TEST_TIMEOUT:-480}" python3 -m pytest -n "${TEST_WORKERS:-14}" --dist loadgroup "${@:-tests/gpu}" \
  -q -rfEs --durations=10 > "$OUT/gpu_tests.log" 2>&1
first=$?
tail -25 "$OUT/gpu_tests.log"
if [ "$first" = 1 ]; then
  again=(-n 3 --dist loadgroup --lf)
elif [ "$first" != 0 ] && [ "$first" != 5 ]; then
  again=(-n 4 --dist loadgroup)
fi
if [ -n "${again+x}" ]; then
  echo "first pass: pytest exit $first; again with ${again[*]}"
  free_gpu
  timeout -s INT -k 30 "${TEST_TIMEOUT:-480}" python3 -m pytest "${again[@]}" "${@:-tests/gpu}" -q -rfEs \
    > "$OUT/gpu_tests_rerun.log" 2>&1
  tail -25 "$OUT/gpu_tests_rerun.log"
fi
free_gpu   # the benchmarks time an otherwise idle GPU
IFS=';' read -r -a benches <<< "${BENCH:-}"
for b in "${benches[@]}"; do
  name=${b//[^a-z_]/_}; read -r -a argv <<< "$b"
  timeout "${BENCH_TIMEOUT:-300}" python3 tools/bench.py "${argv[@]}" --json "$OUT/bench_$name.json" 2>&1 \
    | tee "$OUT/bench_$name.log" | tail -12
done
if [ -n "${AFTER:-}" ]; then
  timeout "${BENCH_TIMEOUT:-300}" bash -c "$AFTER" 2>&1 | tee "$OUT/after.log" | tail -40
fi
