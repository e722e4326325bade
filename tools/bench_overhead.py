"""Per-call host time of each op on tiny tensors: the eager path (mslk_dsl.ops.<op>) and the
torch.ops path (torch.ops.mslk_dsl.<op>), next to torch.add(x, y, out=z) in the same run.

Each figure is the median over --runs runs of (wall time of --calls back-to-back calls) / calls,
after a warm-up; tensors are tiny, so the GPU finishes each kernel before the host issues the next
and the figure is the host cost of validation, kernel lookup and launch.

  python tools/bench.py overhead [--calls 10000] [--runs 5] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def _per_call_us(fn, calls: int, runs: int) -> float:
    import torch

    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def cases():
    import torch

    import mslk_dsl.ops as ops

    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(1, 256, device=dev, dtype=bf16)
    w = torch.randn(128, 256, device=dev, dtype=bf16)
    weight = torch.ones(256, device=dev, dtype=bf16)
    xq, xs = ops.quantize_fp8_row(x)
    wq, ws = ops.quantize_fp8_row(w)
    t = torch.ops.mslk_dsl
    return {
        "silu_mul": (lambda: ops.silu_mul(x, x), lambda: t.silu_mul(x, x)),
        "quantize_fp8_row": (lambda: ops.quantize_fp8_row(x), lambda: t.quantize_fp8_row(x)),
        "silu_mul_quant": (lambda: ops.silu_mul_quant(x, x), lambda: t.silu_mul_quant(x, x)),
        "rmsnorm": (lambda: ops.rmsnorm(x, weight, 1e-6), lambda: t.rmsnorm(x, weight, 1e-6)),
        "rmsnorm_add": (lambda: ops.rmsnorm_add(x, x, weight, 1e-6), lambda: t.rmsnorm_add(x, x, weight, 1e-6)),
        "bf16_gemm": (lambda: ops.bf16_gemm(x, w), lambda: t.bf16_gemm(x, w)),
        "f8f8bf16_rowwise": (lambda: ops.f8f8bf16_rowwise(xq, wq, xs, ws), lambda: t.f8f8bf16_rowwise(xq, wq, xs, ws)),
    }


def _launch_floor(calls: int, runs: int) -> dict:
    """The pieces of silu_mul's eager path, each timed alone: the compiled kernel called through
    TVM-FFI with a preallocated output (no checks, no lookup), and torch.empty of the output."""
    import torch

    import mslk_dsl.ops as ops
    from mslk_dsl.ops import elementwise

    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    ops.silu_mul(x, x)
    (plan,) = [p for k, p in elementwise._SILU_MUL_PLANS.items() if k[0] == x.shape and k[3] == x.device]
    kernel = plan.kernel(True)
    return {
        "eager ops.silu_mul (all of it)": _per_call_us(lambda: ops.silu_mul(x, x), calls, runs),
        "TVM-FFI kernel call, output preallocated": _per_call_us(lambda: kernel(x, x, out), calls, runs),
        "torch.empty(shape, dtype=, device=) of the output": _per_call_us(
            lambda: torch.empty((1, 256), dtype=x.dtype, device=x.device), calls, runs),
        "x.new_empty(shape)": _per_call_us(lambda: x.new_empty((1, 256)), calls, runs),
        "torch.empty_like(x)": _per_call_us(lambda: torch.empty_like(x), calls, runs),
    }


def main(argv: list[str]) -> int:
    import torch

    p = argparse.ArgumentParser(prog="bench.py overhead")
    p.add_argument("--calls", type=int, default=10000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    a, b, z = (torch.randn(4096, device="cuda") for _ in range(3))
    baseline = _per_call_us(lambda: torch.add(a, b, out=z), args.calls, args.runs)
    rows = []
    print(f"torch.add(x, y, out=z): {baseline:.2f} us/call\n")
    print("| op | eager us/call | x torch.add | torch.ops us/call | x torch.add |")
    print("| --- | --- | --- | --- | --- |")
    for name, (eager, via_ops) in cases().items():
        e = _per_call_us(eager, args.calls, args.runs)
        o = _per_call_us(via_ops, args.calls, args.runs)
        rows.append({"op": name, "eager_us": e, "torch_ops_us": o, "torch_add_us": baseline})
        print(f"| {name} | {e:.2f} | {e / baseline:.2f} | {o:.2f} | {o / baseline:.2f} |", flush=True)
    floor = _launch_floor(args.calls, args.runs)
    print("\nWhere silu_mul's eager time goes (same run):\n")
    print("| part | us/call | x torch.add |")
    print("| --- | --- | --- |")
    for part, us in floor.items():
        print(f"| {part} | {us:.2f} | {us / baseline:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch_add_us": baseline, "rows": rows, "silu_mul_parts_us": floor}, f, indent=1)
    return 0
