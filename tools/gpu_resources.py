"""What the GPU reports for each sm90a default kernel, next to what mslk-dsl read from the cubin.

For every op's default config on sm90a (``mslk-dsl resources --defaults``), compiled into the
cache if missing, this loads the entry's kernel.cubin with the CUDA driver and asks each kernel
for the numbers ``cudaFuncGetAttributes`` gives (registers, static shared memory, local memory,
max threads per block) and for the driver's occupancy (``cuOccupancyMaxActiveBlocksPerMultiprocessor``
at the launch's block size and dynamic shared memory). Each is printed beside the CPU-side
report and occupancy; the JSON goes to $OUT/gpu_resources.json (or --out). One kernel's failure
is recorded and the rest go on.

    python tools/gpu_resources.py [--cache DIR] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

FIELDS = {  # CUfunction_attribute name -> report field it should equal
    "CU_FUNC_ATTRIBUTE_NUM_REGS": "registers",
    "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES": "static_shared_bytes",
    "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES": "scratch_bytes",
}
# The driver's most threads per block for the function (its registers allow): the report's block
# size must not exceed it (the two differ by design: 256 compiled vs 896 launchable, say).
MAX_THREADS = "CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK"


def driver_ok(result):
    """cuda-python returns (error, *values): raise on an error, return the value(s)."""
    from cuda.bindings import driver

    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {err}")
    return values[0] if len(values) == 1 else values


def gpu_numbers(cubin_path: str, kernel: dict) -> dict:
    from cuda.bindings import driver

    with open(cubin_path, "rb") as f:
        module = driver_ok(driver.cuModuleLoadData(f.read()))
    try:
        function = driver_ok(driver.cuModuleGetFunction(module, kernel["name"].encode()))
        out = {name: driver_ok(driver.cuFuncGetAttribute(getattr(driver.CUfunction_attribute, name), function))
               for name in (*FIELDS, MAX_THREADS)}
        threads = kernel.get("threads")
        dynamic = kernel.get("dynamic_shared_bytes") or 0
        if threads:
            driver_ok(driver.cuFuncSetAttribute(
                function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic))
            out["occupancy_blocks_per_sm"] = driver_ok(
                driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, threads, dynamic))
        return out
    finally:
        driver.cuModuleUnload(module)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", help="kernel cache to use (default: MSLK_DSL_CACHE_DIR or $OUT/cache)")
    parser.add_argument("--out", help="JSON output (default: $OUT/gpu_resources.json)")
    args = parser.parse_args()
    out_dir = os.environ.get("OUT", ".")
    if args.cache or not os.environ.get("MSLK_DSL_CACHE_DIR"):
        os.environ["MSLK_DSL_CACHE_DIR"] = args.cache or os.path.join(out_dir, "cache")
    out_file = args.out or os.path.join(out_dir, "gpu_resources.json")

    from cuda.bindings import driver

    from mslk_dsl import aot, env, jit, resources
    from mslk_dsl.cli import resource_default_jobs
    from mslk_dsl.targets import get_target

    # Compile first (in worker processes), then bring the driver up in this one.
    jobs = resource_default_jobs(targets=["sm90a"])
    build = aot.build(jobs, env.cache_dir(), workers=1, progress=False)
    results = [{"job": digest, "error": error} for digest, error in build.failed.items()]
    driver_ok(driver.cuInit(0))
    device = driver_ok(driver.cuDeviceGet(0))
    context = driver_ok(driver.cuDevicePrimaryCtxRetain(device))
    driver_ok(driver.cuCtxSetCurrent(context))
    target = get_target("sm90a")
    store = jit.cache()
    for job in jobs:
        entry = store.lookup(job.key)
        if entry is None:
            continue
        report = resources.report_of_entry(entry)
        for kernel in report.get("kernels", []):
            row = {"op": job.key.op, "config": job.key.config, "kernel": kernel["name"], "cpu": kernel,
                   "cpu_occupancy": resources.occupancy(kernel, target)}
            try:
                row["gpu"] = gpu_numbers(entry.file("kernel.cubin"), kernel)
                row["mismatches"] = {field: [kernel.get(field), row["gpu"][name]] for name, field in FIELDS.items()
                                     if kernel.get(field) is not None and kernel.get(field) != row["gpu"][name]}
                if (kernel.get("threads") or 0) > row["gpu"][MAX_THREADS]:
                    row["mismatches"]["threads"] = [kernel.get("threads"), row["gpu"][MAX_THREADS]]
                blocks = row["gpu"].get("occupancy_blocks_per_sm")
                if blocks is not None and blocks != row["cpu_occupancy"]["blocks"]:
                    row["mismatches"]["blocks_per_sm"] = [row["cpu_occupancy"]["blocks"], blocks]
            except Exception as e:  # noqa: BLE001 - one kernel's failure must not stop the rest
                row["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
            results.append(row)
            gpu = row.get("gpu", {})
            print(f"{job.key.op:26s} {resources._short_name(kernel['name']):40s} "
                  f"regs {kernel.get('registers')}/{gpu.get('CU_FUNC_ATTRIBUTE_NUM_REGS')} "
                  f"smem {kernel.get('static_shared_bytes')}/{gpu.get('CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES')} "
                  f"local {kernel.get('scratch_bytes')}/{gpu.get('CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES')} "
                  f"threads {kernel.get('threads')}/max {gpu.get(MAX_THREADS)} "
                  f"blocks/SM {row['cpu_occupancy']['blocks']}/{gpu.get('occupancy_blocks_per_sm')}"
                  f"{'  MISMATCH ' + json.dumps(row.get('mismatches')) if row.get('mismatches') else ''}"
                  f"{'  ERROR ' + row['error'].splitlines()[0] if 'error' in row else ''}", flush=True)
    with open(out_file, "w") as f:
        json.dump(results, f, indent=1, default=str)
    bad = [r for r in results if r.get("error") or r.get("mismatches")]
    print(f"{len(results)} kernels, {len(bad)} with a mismatch or error -> {out_file}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
