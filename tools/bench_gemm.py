"""Benchmark the GEMM ops against torch on the same N(0, 1) data, on the current GPU's target.

  bf16_gemm         vs torch.mm(x, w.T)                               (bf16 in and out)
  f8f8bf16_rowwise  vs torch._scaled_mm(xq, wq.T, scale_a [M, 1], scale_b [1, N], bf16 out)
                    with use_fast_accum as ours: MSLK's default True, False with --promoted
                    (a forced --config decides by its accumulation, promote == 0)

Both sides get the same inputs; the FP8 operands (the target's flavour) are rowwise quantized
(scale = absmax / fp8 max).
Times are medians of triton.testing.do_bench (CUDA events), ours and torch's taking turns three
times per shape (power-limited clocks depend on what ran before); the table gives TFLOP/s, the ratio
torch time / our time per shape (> 1: ours is faster) and the geometric mean of the ratios.

  python tools/bench_gemm.py [--op bf16_gemm|f8f8bf16_rowwise|all] [--quick] [--promoted]
                             [--config NAME] [--json PATH]
  python tools/bench_gemm.py --random N --seed S [--op ...] [--promoted] [--json PATH]
--split-sweep: the 128-row candidates, split-K included, at mid-sized M (bench_gemm_split).
--random: N shapes drawn from real layers with M log-uniform in 1..16384 (bench_gemm_random).
--config forces one config of the target's template (its name as in
mslk_dsl.template.config_name, e.g. cluster_m2_group8_rasterm_tile_m128_tile_n256 for the CuTe
bf16_gemm) instead of the default choice (tuned or heuristic) per shape.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

from bench_common import cuda_or_exit, geomean, quantize_rowwise

M_VALUES = (1, 16, 128, 512, 2048, 8192, 16384)
NK_VALUES = ((8192, 8192), (10240, 8192), (57344, 8192), (8192, 28672), (4096, 4096), (14336, 4096))
QUICK_SHAPES = ((16, 8192, 8192), (2048, 8192, 8192), (8192, 8192, 8192))
ROUNDS = 3  # alternating timings per side and shape


def _shapes(quick: bool):
    if quick:
        return list(QUICK_SHAPES)
    return [(m, n, k) for n, k in NK_VALUES for m in M_VALUES]


def _kernel_op(op: str):
    from mslk_dsl.ops import declaration

    return declaration.get(op).kernels


def _config_by_name(op: str, target: str, name: str | None):
    if name is None:
        return None
    from mslk_dsl.template import config_name

    template = _kernel_op(op).template_for(target)
    for config in template.all_configs():
        if config_name(config) == name:
            return config
    raise KeyError(f"{op}: no config named {name}; known: {[config_name(c) for c in template.all_configs()]}")


def _bench_shape(op, target, m, n, k, config, torch, ops, do_bench, promoted=False):
    from mslk_dsl.ops.elementwise import fp8_dtype_for

    x = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda")
    fast = not promoted if config is None else config.get("promote", 0) == 0
    sig = ("bfloat16",) if op == "bf16_gemm" else ("none", fast)
    chosen = _kernel_op(op).choose(target, sig, (m, n, k), config)[1]  # explicit, tuned or heuristic
    if op == "bf16_gemm":
        x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
        ours = lambda: ops.bf16_gemm(x, w, config=config)  # noqa: E731
        theirs = lambda: torch.mm(x, w.T)  # noqa: E731
    else:
        fp8 = fp8_dtype_for(x.device)
        (xq, x_scale), (wq, w_scale) = quantize_rowwise(x, fp8, torch), quantize_rowwise(w, fp8, torch)
        scale_a, scale_b = x_scale[:, None], w_scale[None, :]  # like with like: the same accumulation
        ours = lambda: ops.f8f8bf16_rowwise(xq, wq, x_scale, w_scale, None, fast, config=config)  # noqa: E731
        theirs = lambda: torch._scaled_mm(xq, wq.T, scale_a=scale_a, scale_b=scale_b,  # noqa: E731
                                          out_dtype=torch.bfloat16, use_fast_accum=fast)
    ours()  # compile / load outside the timed region
    torch.cuda.synchronize()
    # Large FP8 / bf16 GEMMs run into the H200's power limit, so clocks depend on what ran just
    # before: the two sides take turns (ours, torch, ours, torch, ...) and each keeps its median.
    t_ours, t_torch = [], []
    for _ in range(ROUNDS):
        t_ours.append(do_bench(ours, return_mode="median"))
        try:
            t_torch.append(do_bench(theirs, return_mode="median"))
        except RuntimeError as e:  # a baseline that rejects the shape: reported, left out of the mean
            print(f"torch baseline failed for {m}x{n}x{k}: {e}", file=sys.stderr)
            t_torch.append(float("nan"))
    t_ours, t_torch = statistics.median(t_ours), statistics.median(t_torch)
    flop = 2.0 * m * n * k
    return {"op": op, "M": m, "N": n, "K": k, "config": chosen, "ms": t_ours, "torch_ms": t_torch,
            "tflops": flop / t_ours * 1e-9, "torch_tflops": flop / t_torch * 1e-9, "ratio": t_torch / t_ours}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=("bf16_gemm", "f8f8bf16_rowwise", "all"), default="all")
    parser.add_argument("--config", help="force this config (by name) for every shape")
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK_SHAPES}")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--promoted", action="store_true",
                        help="f8f8bf16_rowwise with use_fast_accum=False (and _scaled_mm likewise)")
    parser.add_argument("--random", type=int, metavar="N", help="N random shapes of real layers instead of the grid")
    parser.add_argument("--seed", type=int, default=0, help="the --random draw's seed")
    parser.add_argument("--split-sweep", action="store_true",
                        help="time every 128-row candidate, split-K included, at mid-sized M (bench_gemm_split)")
    parser.add_argument("--tune", action="store_true",
                        help="first tune every shape (mslk_dsl.autotune, stored in the tuning DB), then time the "
                             "tuned choices")
    args = parser.parse_args(argv)

    gpu = cuda_or_exit("bench_gemm")
    if gpu is None:
        return 2
    torch, do_bench = gpu

    from mslk_dsl import device, ops
    from mslk_dsl.template import config_name

    op_names = ("bf16_gemm", "f8f8bf16_rowwise") if args.op == "all" else (args.op,)
    if args.split_sweep:
        import bench_gemm_split

        return bench_gemm_split.run(list(op_names), args.json, torch, do_bench)
    if args.random:
        import bench_gemm_random

        return bench_gemm_random.run(args.random, args.seed, list(op_names), not args.promoted, args.json,
                                     torch, do_bench)
    target = device.current_target().name

    torch.backends.cuda.matmul.allow_tf32 = False
    results, summary = [], {}
    for op in op_names:
        try:
            config = _config_by_name(op, target, args.config)
        except KeyError as e:
            if len(op_names) == 1:
                raise SystemExit(str(e.args[0]))
            print(f"\n{op}: skipped, it has no config named {args.config}")
            continue
        if args.tune and config is None:
            from mslk_dsl import autotune

            autotune.tune(op, [{"M": m, "N": n, "K": k} for m, n, k in _shapes(args.quick)])
        label = "config " + args.config if config else ("tuned config" if args.tune else "default config")
        print(f"\n### {op} ({label}) on "
              f"{torch.cuda.get_device_name()} ({target})\n")
        print("| M | N | K | config | ms | TFLOP/s | torch TFLOP/s | ratio |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        ratios = []
        for m, n, k in _shapes(args.quick):
            r = _bench_shape(op, target, m, n, k, config, torch, ops, do_bench, args.promoted)
            results.append(r)
            if not math.isnan(r["ratio"]):
                ratios.append(r["ratio"])
            print(f"| {m} | {n} | {k} | {config_name(r['config'])} | {r['ms']:.4f} | {r['tflops']:.1f} | "
                  f"{r['torch_tflops']:.1f} | {r['ratio']:.3f} |", flush=True)
            torch.cuda.empty_cache()
        summary[op] = geomean(ratios)
        print(f"\n{op}: geometric mean ratio (torch time / ours) = {summary[op]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "geomean_ratio": summary, "target": target,
                       "device": torch.cuda.get_device_name()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
