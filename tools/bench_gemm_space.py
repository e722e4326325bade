"""Every config of a GEMM op at a few shapes, against torch: does the best of the config space
reach cuBLAS, and how far is the heuristic's pick from that best?

  python tools/bench.py gemm_space --shapes 208x4096x8192,871x5376x21504 [--op bf16_gemm] [--json PATH]

For each M x N x K: every config the autotuner would try (``autotune._candidates``: the configs
of the target's template that serve the shape) is checked against the op's reference on the
shape's N(0, 1) data as the autotuner checks them (``autotune.ResultCheck``) and timed once (median of triton's do_bench), torch.mm before, between
and after (its median is the baseline). The table gives torch's time, the heuristic's pick as
timed in the same sweep, and the fastest configs; ratio = torch time / ours (> 1: ours faster).
Single timings move by a few percent with the clocks (up to 7% seen on an H100), so a config a
few percent ahead is a lead to time again (``tools/bench.py gemm_pairs``), not a result.
bf16_gemm only: FP8 configs also differ in accumulation, which ``gemm --promoted`` covers.
"""
from __future__ import annotations

import argparse
import json
import statistics

from bench_common import cuda_or_exit, parse_shapes, table

TORCH_EVERY = 20   # configs timed between two timings of torch
SHOWN = 5          # fastest configs printed per shape


def summary(row: dict) -> dict:
    """The pick's and the fastest config's times and ratios of one shape's sweep (``row``: the
    JSON row, times in ms)."""
    fastest, fastest_ms = min(row["configs"].items(), key=lambda kv: kv[1])
    pick_ms = row["configs"].get(row["pick"])
    return {"pick_ratio": row["torch_ms"] / pick_ms if pick_ms else float("nan"),
            "fastest": fastest, "fastest_ratio": row["torch_ms"] / fastest_ms,
            "pick_vs_fastest": fastest_ms / pick_ms if pick_ms else float("nan")}


def _sweep(m, n, k, torch, do_bench) -> dict:
    from mslk_dsl import autotune, device, ops
    from mslk_dsl.ops import declaration
    from mslk_dsl.template import config_name

    target = device.current_target().name
    decl = declaration.get("bf16_gemm")
    template = decl.kernels.template_for(target)
    sig = autotune.tuning_signature(template, None)
    problem = {"M": m, "N": n, "K": k}
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    default = template.heuristic(target, sig, problem)
    # Judged as the tuner judges configs: against the reference, with the default config's error
    # as slack where long sums outgrow the declared tolerance.
    judge = autotune.ResultCheck("bf16_gemm", (x, w), default=lambda a: ops.bf16_gemm(*a, config=default))
    theirs = lambda: torch.mm(x, w.T)  # noqa: E731
    torch_ms, times = [], {}
    for i, config in enumerate(autotune._candidates(template, target, sig, problem)):
        if i % TORCH_EVERY == 0:
            torch_ms.append(do_bench(theirs, warmup=10, rep=40, return_mode="median"))
        name = config_name(config)
        why = judge(lambda a: ops.bf16_gemm(*a, config=config))
        if why is not None:
            print(f"  {name}: wrong results ({why}); left out")
            continue
        times[name] = do_bench(lambda: ops.bf16_gemm(x, w, config=config), warmup=10, rep=40, return_mode="median")
    torch_ms.append(do_bench(theirs, warmup=10, rep=40, return_mode="median"))
    pick = config_name(default)
    return {"op": "bf16_gemm", "M": m, "N": n, "K": k, "torch_ms": statistics.median(torch_ms), "pick": pick,
            "configs": times}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", required=True, type=parse_shapes, help="MxNxK,... (e.g. 208x4096x8192)")
    parser.add_argument("--op", choices=("bf16_gemm",), default="bf16_gemm")
    parser.add_argument("--json", metavar="PATH", help="write the rows here (every config's time)")
    args = parser.parse_args(argv)
    gpu = cuda_or_exit("bench_gemm_space")
    if gpu is None:
        return 2
    torch, do_bench = gpu
    torch.backends.cuda.matmul.allow_tf32 = False
    rows, lines = [], []
    for m, n, k in args.shapes:
        row = _sweep(m, n, k, torch, do_bench)
        rows.append(row)
        s = summary(row)
        fastest = sorted(row["configs"].items(), key=lambda kv: kv[1])[:SHOWN]
        lines.append({"M": m, "N": n, "K": k, "torch us": row["torch_ms"] * 1e3, "pick": row["pick"],
                      "pick ratio": s["pick_ratio"],
                      "fastest (ratio)": "; ".join(f"{name} {row['torch_ms'] / ms:.3f}" for name, ms in fastest)})
        print(f"M={m} N={n} K={k}: {len(row['configs'])} configs, pick {s['pick_ratio']:.3f}x torch, "
              f"fastest {s['fastest_ratio']:.3f}x ({s['fastest']})", flush=True)
    table(lines, ["M", "N", "K", "torch us", "pick", "pick ratio", "fastest (ratio)"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
