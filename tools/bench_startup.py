"""Start-up costs, each in a fresh process on the GPU machine:
  - `import mslk_dsl` (and mslk_dsl.ops) beyond `import torch`;
  - the first call of silu_mul served from an AOT bundle with JIT off (call to result, minus the
    same for a warm call), and which compilers were imported;
  - the first call with an empty cache (JIT compile: DSL import + compile + export + link + load);
  - the first call from a warm disk cache.

  python tools/bench.py startup [--repeats 3] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

PROBE = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    import mslk_dsl, mslk_dsl.ops as ops
    t2 = time.perf_counter()
    x0 = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); x1 = torch.randn_like(x0)
    torch.cuda.synchronize()
    def timed():
        s = time.perf_counter(); ops.silu_mul(x0, x1); torch.cuda.synchronize(); return time.perf_counter() - s
    first = timed()
    warm = min(timed() for _ in range(20))
    print(json.dumps({"import_torch_s": t1 - t0, "import_mslk_dsl_s": t2 - t1, "first_call_s": first,
                      "warm_call_s": warm, "first_minus_warm_ms": (first - warm) * 1e3,
                      "compilers_imported": [m for m in ("cutlass", "flydsl") if m in sys.modules]}))
""")


def _probe(env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench.py startup")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    from mslk_dsl import aot

    work = tempfile.mkdtemp(prefix="mslk-startup-")
    bundle = os.path.join(work, "bundle")
    jobs = aot.expand({"targets": ["sm90a"], "kernels": [{"op": "silu_mul", "configs": "all"}]})
    assert aot.build(jobs, bundle, workers=8, progress=False).ok
    results = {}
    scenarios = {
        "bundle, JIT off": lambda i: {"MSLK_DSL_AOT_PATH": bundle, "MSLK_DSL_DISABLE_JIT": "1",
                                      "MSLK_DSL_CACHE_DIR": os.path.join(work, f"none{i}")},
        "empty cache (JIT compile)": lambda i: {"MSLK_DSL_CACHE_DIR": os.path.join(work, f"cold{i}")},
        "warm disk cache": lambda i: {"MSLK_DSL_CACHE_DIR": os.path.join(work, "cold0")},
    }
    print("| scenario | import mslk_dsl beyond torch (s) | first call - warm call (ms) | compilers imported |")
    print("| --- | --- | --- | --- |")
    for name, make_env in scenarios.items():
        runs = [_probe(make_env(i)) for i in range(args.repeats)]
        row = {k: statistics.median(r[k] for r in runs) for k in ("import_mslk_dsl_s", "first_minus_warm_ms",
                                                                  "import_torch_s", "warm_call_s")}
        row["compilers_imported"] = sorted({m for r in runs for m in r["compilers_imported"]})
        results[name] = row
        print(f"| {name} | {row['import_mslk_dsl_s']:.3f} | {row['first_minus_warm_ms']:.1f} | "
              f"{', '.join(row['compilers_imported']) or 'none'} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0
