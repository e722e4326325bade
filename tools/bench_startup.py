"""Start-up costs, each in a fresh process on the GPU machine:
  - `import mslk_dsl` (and mslk_dsl.ops) beyond `import torch`;
  - the first call of silu_mul served from an AOT bundle with JIT off (call to result, minus the
    same for a warm call), and which compilers were imported;
  - the first call with an empty cache (JIT compile: DSL import + compile + export + link + load);
  - the first call from a warm disk cache.
The op layer imports the kernel loader (tvm_ffi) in a background thread; the probe creates its
CUDA inputs between the import and the first call, as a program would, and one scenario turns the
prefetch off (MSLK_DSL_NO_PREFETCH=1) to show what it saves.
A second table splits each first call into its stages (see STAGES), timed by wrapping the
framework's functions in the probe process only.

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

from bench_common import save_json

# Wraps the functions each stage of a first call runs in, in the probe process only (nothing is
# imported ahead of the first call, so its cost is unchanged), and adds up each stage's own
# seconds: a stage running inside another (discovery inside choosing the config, importing tvm_ffi
# inside loading) is subtracted from it, so the stages add up to the whole kernel selection.
INSTRUMENT = textwrap.dedent("""
    import builtins, contextlib, functools, sys, time
    from collections import defaultdict
    from mslk_dsl import jit, keys, registry
    from mslk_dsl.cache import KernelCache
    from mslk_dsl.ops import dispatch

    spent, running = defaultdict(float), []  # stage -> own seconds; [stage, seconds in inner stages]

    @contextlib.contextmanager
    def stage(name):
        running.append([name, 0.0])
        start = time.perf_counter()
        try:
            yield
        finally:
            total = time.perf_counter() - start
            spent[name] += total - running.pop()[1]
            if running:
                running[-1][1] += total
            else:
                spent["whole selection"] += total

    def timed(owner, attr, name):
        real = getattr(owner, attr)
        @functools.wraps(real)
        def wrapper(*args, **kwargs):
            with stage(name):
                return real(*args, **kwargs)
        setattr(owner, attr, wrapper)

    timed(dispatch.KernelOp, "selection", "other")      # the whole selection, less the stages below
    timed(dispatch, "target_of", "target")
    timed(dispatch.KernelOp, "choose", "config")
    timed(registry, "templates_for", "discover")
    timed(keys.KernelKey, "make", "key")
    timed(KernelCache, "lookup", "lookup")
    timed(jit, "_bundle_roots", "bundle wheels")
    timed(jit, "compile_and_publish", "compile")
    timed(jit, "_try_load", "load, rest")

    backend_of = jit.get_backend
    def get_backend(name):                              # wrap the backend once it is imported
        module = backend_of(name)
        if not getattr(module, "_probe_timed", False):
            module._probe_timed = True
            timed(module, "load", "load, rest")
            if hasattr(module, "_preload_runtime"):
                timed(module, "_preload_runtime", "preload runtime")
        return module
    jit.get_backend = get_backend

    real_import = builtins.__import__
    def probe_import(name, *args, **kwargs):            # `import tvm_ffi`, then its load_module
        if name != "tvm_ffi" or "tvm_ffi" in sys.modules:
            return real_import(name, *args, **kwargs)
        with stage("import tvm_ffi"):
            module = real_import(name, *args, **kwargs)
        timed(module, "load_module", "load_module")
        return module
    builtins.__import__ = probe_import

    def stages_ms(first_minus_warm_ms):
        out = {k: v * 1e3 for k, v in spent.items() if k != "whole selection"}
        out["first launch"] = first_minus_warm_ms - spent["whole selection"] * 1e3
        return out
""")

PROBE = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    import mslk_dsl, mslk_dsl.ops as ops
    t2 = time.perf_counter()
    INSTRUMENT
    x0 = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); x1 = torch.randn_like(x0)
    torch.cuda.synchronize()
    def timed_call():
        s = time.perf_counter(); ops.silu_mul(x0, x1); torch.cuda.synchronize(); return time.perf_counter() - s
    first = timed_call()
    warm = min(timed_call() for _ in range(20))
    print(json.dumps({"import_torch_s": t1 - t0, "import_mslk_dsl_s": t2 - t1, "first_call_s": first,
                      "warm_call_s": warm, "first_minus_warm_ms": (first - warm) * 1e3,
                      "stages_ms": stages_ms((first - warm) * 1e3),
                      "compilers_imported": [m for m in ("cutlass", "flydsl") if m in sys.modules]}))
""").replace("INSTRUMENT\n", INSTRUMENT)

# The columns of the breakdown table, in the order a first call runs them.
STAGES = ("target", "discover", "config", "key", "lookup", "bundle wheels", "compile", "import tvm_ffi",
          "preload runtime", "load_module", "load, rest", "other", "first launch")


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
        # The same without the background import of the kernel loader (what the first call
        # costs when it comes right after `import mslk_dsl.ops`, with nothing in between).
        "bundle, JIT off, no prefetch": lambda i: {
            "MSLK_DSL_AOT_PATH": bundle, "MSLK_DSL_DISABLE_JIT": "1", "MSLK_DSL_NO_PREFETCH": "1",
            "MSLK_DSL_CACHE_DIR": os.path.join(work, f"nopf{i}")},
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
        row["stages_ms"] = {k: statistics.median(r["stages_ms"].get(k, 0.0) for r in runs) for k in STAGES}
        print(f"| {name} | {row['import_mslk_dsl_s']:.3f} | {row['first_minus_warm_ms']:.1f} | "
              f"{', '.join(row['compilers_imported']) or 'none'} |", flush=True)
    print("\nFirst call - warm call by stage (ms, medians; `first launch` is what the first launch costs "
          "beyond a warm one):\n")
    print("| scenario | " + " | ".join(STAGES) + " |")
    print("| --- |" + " ---: |" * len(STAGES))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row['stages_ms'][k]:.1f}" for k in STAGES) + " |")
    save_json(args.json, results)
    return 0
