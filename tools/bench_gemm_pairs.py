"""bf16_gemm: several configs per shape, timed against each other and torch.mm in the same run.

  python tools/bench.py gemm_pairs --cases CASES.json [--json PATH]

CASES.json is a list of {"M", "N", "K", "configs": {label: config}} (e.g. the configs an old and a
new heuristic pick for the same shape). The kernels are compiled first, in parallel; then per
shape every config and torch.mm(x, w.T) take turns ROUNDS times (power-limited clocks depend on
what ran before) and each keeps its median. Prints per shape the microseconds of each label and
torch's, and per label the geometric mean of torch time / its time.
"""
from __future__ import annotations

import argparse
import json
import statistics

from bench_common import build_jobs, geomean, parse_with_gpu

ROUNDS = 3


def _prebuild(cases, target):
    from mslk_dsl.aot.manifest import Job
    from mslk_dsl.keys import KernelKey
    from mslk_dsl.ops import declaration

    kernels = declaration.get("bf16_gemm").kernels
    jobs = {}
    for case in cases:
        for config in case["configs"].values():
            template, chosen, sig = kernels.choose(target, ("bfloat16",), (case["M"], case["N"], case["K"]), config)
            key = KernelKey.make(template, chosen, target, sig)
            jobs.setdefault(key.digest, Job(key, template.name))
    build_jobs(jobs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", required=True, help="JSON list of {M, N, K, configs: {label: config}}")
    found = parse_with_gpu(parser, argv, "bench_gemm_pairs")
    if found is None:
        return 2
    args, torch, do_bench = found

    from mslk_dsl import device, ops

    with open(args.cases) as f:
        cases = json.load(f)
    target = device.current_target().name
    torch.backends.cuda.matmul.allow_tf32 = False
    _prebuild(cases, target)
    results = []
    for case in cases:
        m, n, k = case["M"], case["N"], case["K"]
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        calls = {label: (lambda c=config: ops.bf16_gemm(x, w, config=c)) for label, config in case["configs"].items()}
        calls["torch"] = lambda: torch.mm(x, w.T)
        for call in calls.values():
            call()
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {label: [] for label in calls}
        for _ in range(ROUNDS):
            for label, call in calls.items():
                times[label].append(do_bench(call, warmup=5, rep=20, return_mode="median") * 1e3)
        us = {label: statistics.median(t) for label, t in times.items()}
        results.append({**case, "us": us})
        print(f"| {m} | {n} | {k} | " + " | ".join(f"{label} {t:.1f}" for label, t in us.items()) + " |", flush=True)
        torch.cuda.empty_cache()
    labels = sorted({label for r in results for label in r["us"] if label != "torch"})
    for label in labels:
        ratios = [r["us"]["torch"] / r["us"][label] for r in results if label in r["us"]]
        print(f"{label}: {len(ratios)} shapes, geometric mean against torch {geomean(ratios):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": ROUNDS, "device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    return 0
