"""GEMM configs per shape, timed against each other and torch in the same run.

  python tools/bench.py gemm_pairs --cases CASES.json [--op f8f8bf16_rowwise] [--json PATH]

bf16_gemm (the default) against torch.mm(x, w.T); f8f8bf16_rowwise with fast accumulation
(MSLK's default use_fast_accum=True) against torch._scaled_mm with rowwise scales, likewise.

CASES.json is a list of {"M", "N", "K", "configs": {label: config}} (e.g. the configs an old and a
new heuristic pick for the same shape). The kernels are compiled first, in parallel; then per
shape every config and torch's call take turns ROUNDS times (power-limited clocks depend on
what ran before) and each keeps its median. Each is timed replaying a CUDA graph of one call: a
call with an explicit config takes the op's checked path, whose host time would otherwise be
what a small shape measures. Prints per shape the microseconds of each label and torch's, and
per label the geometric mean of torch time / its time; the JSON also names the kernels torch's
call ran (cuBLAS's names carry its tile shape), where the profiler can see them.
"""
from __future__ import annotations

import argparse
import json
import statistics

from bench_common import build_jobs, geomean, graph_timed, parse_with_gpu, quantize_rowwise

ROUNDS = 3


def _prebuild(op, cases, target):
    from mslk_dsl.aot.manifest import Job
    from mslk_dsl.keys import KernelKey
    from mslk_dsl.ops import declaration

    kernels = declaration.get(op).kernels
    parts = ("bfloat16",) if op == "bf16_gemm" else ("none", True)
    jobs = {}
    for case in cases:
        for config in case["configs"].values():
            template, chosen, sig = kernels.choose(target, parts, (case["M"], case["N"], case["K"]), config)
            key = KernelKey.make(template, chosen, target, sig)
            jobs.setdefault(key.digest, Job(key, template.name))
    build_jobs(jobs)


def _kernel_names(torch, call) -> list[str]:
    """The GPU kernels one ``call`` runs, by name ([] where the profiler sees none)."""
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    except Exception as e:  # profiler unavailable: the timings stand without the names
        return [f"(profiler: {e})"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", required=True, help="JSON list of {M, N, K, configs: {label: config}}")
    parser.add_argument("--op", choices=("bf16_gemm", "f8f8bf16_rowwise"), default="bf16_gemm")
    found = parse_with_gpu(parser, argv, "bench_gemm_pairs")
    if found is None:
        return 2
    args, torch, do_bench = found

    from mslk_dsl import device, ops

    with open(args.cases) as f:
        cases = json.load(f)
    target = device.current_target().name
    torch.backends.cuda.matmul.allow_tf32 = False
    _prebuild(args.op, cases, target)
    results = []
    for case in cases:
        m, n, k = case["M"], case["N"], case["K"]
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        if args.op == "bf16_gemm":
            calls = {label: (lambda c=config: ops.bf16_gemm(x, w, config=c)) for label, config in case["configs"].items()}
            calls["torch"] = lambda: torch.mm(x, w.T)
        else:
            (xq, xs), (wq, ws) = quantize_rowwise(x, torch.float8_e4m3fn, torch), quantize_rowwise(w, torch.float8_e4m3fn, torch)
            calls = {label: (lambda c=config: ops.f8f8bf16_rowwise(xq, wq, xs, ws, None, True, config=c))
                     for label, config in case["configs"].items()}
            calls["torch"] = lambda: torch._scaled_mm(xq, wq.T, scale_a=xs[:, None], scale_b=ws[None, :],
                                                      out_dtype=torch.bfloat16, use_fast_accum=True)
        for call in calls.values():
            call()
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {label: [] for label in calls}
        for _ in range(ROUNDS):
            for label, call in calls.items():
                times[label].append(graph_timed(torch, lambda f: do_bench(f, warmup=5, rep=20, return_mode="median"),
                                                call) * 1e3)
        us = {label: statistics.median(t) for label, t in times.items()}
        results.append({**case, "us": us, "torch_kernels": _kernel_names(torch, calls["torch"])})
        print(f"| {m} | {n} | {k} | " + " | ".join(f"{label} {t:.1f}" for label, t in us.items()) + " |", flush=True)
        torch.cuda.empty_cache()
    labels = sorted({label for r in results for label in r["us"] if label != "torch"})
    for label in labels:
        ratios = [r["us"]["torch"] / r["us"][label] for r in results if label in r["us"]]
        print(f"{label}: {len(ratios)} shapes, geometric mean against torch {geomean(ratios):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"op": args.op, "rounds": ROUNDS, "device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    return 0
