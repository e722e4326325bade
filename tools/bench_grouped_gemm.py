"""Benchmark the grouped (stacked) GEMM ops against torch on the same data, at MoE layer shapes.

  bf16bf16bf16_grouped_stacked      vs torch._grouped_mm(x, w.transpose(1, 2), offs=cumsum(M_sizes))
  f8f8bf16_rowwise_grouped_stacked  vs torch._scaled_grouped_mm(xq, wq.transpose(1, 2), x_scale [total_M],
                                       w_scale [G, N], offs=cumsum(M_sizes), out_dtype=bf16)
  and a dense GEMM of the same rows (torch.mm / torch._scaled_mm rowwise against one expert's weight):
  the ceiling a grouped GEMM of that size could reach.

Shapes: the DeepSeek-V3-like (T 4096, E 128, top-8, D 7168, H 2048), Llama-4-Scout-like (T 8192,
E 16, top-1, D 5120, H 8192) and Mixtral-like (T 4096, E 8, top-2, D 4096, H 14336) layers'
gate_up (N = 2H, K = D) and down (N = D, K = H) GEMMs, at their prefill T and at decode
T in {1, 16, 128}. Routing: each token's top_k distinct experts drawn uniformly (seeded), so the
group sizes are what a balanced router gives, empty groups included at decode. Offsets for torch
are int32 (its grouped GEMMs take int32 end offsets); ours take M_sizes as is.
Times are medians of triton.testing.do_bench, ours and torch's taking turns; TFLOP/s counts
2 * total_M * N * K; ratio = torch time / our time (> 1: ours is faster).

At decode the GEMMs stream the routed experts' weights: weights_tbps is the bytes of the
non-empty groups' weights over our time (compare with the copy roofline, ~4.3 TB/s on an H200).

  python tools/bench.py grouped_gemm [--quick] [--op bf16|fp8|all] [--tokens T,...]
                                     [--sweep [prefill|decode|all]] [--json PATH]
--sweep also times every config of the target's template (ours only) at the prefill shapes (the
default), the decode shapes or both; --tokens keeps only those T.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

from bench_common import cuda_or_exit, table

LAYERS = (("deepseek-v3", 4096, 128, 8, 7168, 2048), ("llama4-scout", 8192, 16, 1, 5120, 8192),
          ("mixtral", 4096, 8, 2, 4096, 14336))
DECODE_T = (1, 16, 128)
ROUNDS = 2


def _sizes(torch, tokens, experts, top_k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    chosen = torch.rand(tokens, experts, device="cuda", generator=g).topk(top_k, dim=1).indices
    return torch.bincount(chosen.flatten(), minlength=experts).to(torch.int32)


def _quantize(torch, t):
    fp8 = torch.float8_e4m3fn
    scale = t.float().abs().amax(dim=-1).clamp(min=1e-12) / torch.finfo(fp8).max
    return (t.float() / scale.unsqueeze(-1)).to(fp8), scale


def _time(do_bench, fns):
    """Median time (ms) of each function, taking turns ROUNDS times."""
    times = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            times[name].append(do_bench(fn, warmup=5, rep=30))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _sweep(do_bench, op, flop, ops, x, w, sizes, xq, wq, xs, ws):
    """TFLOP/s of every config of our template for this shape, by config name."""
    from mslk_dsl.device import target_of
    from mslk_dsl.ops import declaration
    from mslk_dsl.template import config_name

    name = "bf16bf16bf16_grouped_stacked" if op == "bf16" else "f8f8bf16_rowwise_grouped_stacked"
    template = declaration.get(name).kernels.template_for(target_of(x.device).name)
    result = {}
    for config in template.all_configs():
        if op == "bf16":
            fn = lambda c=config: ops.bf16bf16bf16_grouped_stacked(x, w, sizes, config=c)  # noqa: E731
        else:
            fn = lambda c=config: ops.f8f8bf16_rowwise_grouped_stacked(xq, wq, xs, ws, sizes, config=c)  # noqa: E731
        result[config_name(config)] = flop / do_bench(fn, warmup=5, rep=30) * 1e-9
    print("   sweep: " + ", ".join(f"{k} {v:.0f}" for k, v in result.items()), flush=True)
    return result


def _cases(quick):
    for name, t_prefill, experts, top_k, d, h in LAYERS[:1] if quick else LAYERS:
        for tokens in (t_prefill, *DECODE_T):
            for proj, n, k in (("gate_up", 2 * h, d), ("down", d, h)):
                yield name, tokens, experts, top_k, proj, n, k


def main(argv: list[str]) -> int:
    found = cuda_or_exit("bench_grouped_gemm")
    if found is None:
        return 1
    torch, do_bench = found
    from mslk_dsl import ops

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the DeepSeek-V3-like layer only")
    parser.add_argument("--op", choices=("bf16", "fp8", "all"), default="all")
    parser.add_argument("--sweep", nargs="?", const="prefill", choices=("prefill", "decode", "all"),
                        help="also time every config at these shapes (default: prefill)")
    parser.add_argument("--tokens", type=lambda v: {int(t) for t in v.split(",")},
                        help="only these T (comma-separated)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)

    rows, weights = [], {}
    for name, tokens, experts, top_k, proj, n, k in _cases(args.quick):
        if args.tokens and tokens not in args.tokens:
            continue
        sizes = _sizes(torch, tokens, experts, top_k, seed=tokens + experts)
        offs = torch.cumsum(sizes, 0, dtype=torch.int32)
        total = tokens * top_k
        key = (name, proj)
        if key not in weights:
            weights.clear()  # one layer's weights at a time (DeepSeek-V3's gate_up is 7.5 GB)
            torch.cuda.empty_cache()
            w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16)
            wq, ws = _quantize(torch, w)
            weights[key] = (w, wq, ws)
        w, wq, ws = weights[key]
        x = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
        xq, xs = _quantize(torch, x)
        flop = 2.0 * total * n * k
        ops_to_run = ("bf16", "fp8") if args.op == "all" else (args.op,)
        for op in ops_to_run:
            if op == "bf16":
                fns = {"ours": lambda: ops.bf16bf16bf16_grouped_stacked(x, w, sizes),
                       "torch": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs),
                       "dense": lambda: torch.mm(x, w[0].T)}
            else:
                fns = {"ours": lambda: ops.f8f8bf16_rowwise_grouped_stacked(xq, wq, xs, ws, sizes),
                       "torch": lambda: torch._scaled_grouped_mm(xq, wq.transpose(1, 2), xs, ws, offs=offs,
                                                                 out_dtype=torch.bfloat16),
                       "dense": lambda: torch._scaled_mm(xq, wq[0].T, xs[:, None], ws[0][None, :],
                                                         out_dtype=torch.bfloat16)}
            try:
                fns["ours"]()
                torch.cuda.synchronize()
                t = _time(do_bench, fns)
            except Exception as e:  # report a failing side and go on
                print(f"{name} {proj} T={tokens} {op}: {type(e).__name__}: {e}")
                continue
            row = {"layer": name, "proj": proj, "T": tokens, "M": total, "N": n, "K": k, "op": op,
                   "ours_tflops": flop / t["ours"] * 1e-9, "torch_tflops": flop / t["torch"] * 1e-9,
                   "dense_tflops": flop / t["dense"] * 1e-9, "ours_us": t["ours"] * 1e3,
                   "torch_us": t["torch"] * 1e3, "ratio": t["torch"] / t["ours"],
                   "weights_tbps": int((sizes > 0).sum()) * n * k * (2 if op == "bf16" else 1) / t["ours"] * 1e-9}
            decode = tokens <= max(DECODE_T)
            if args.sweep == "all" or args.sweep == ("decode" if decode else "prefill"):
                row["sweep"] = _sweep(do_bench, op, flop, ops, x, w, sizes, xq, wq, xs, ws)
            rows.append(row)
            print(f"{name:12s} {proj:7s} T={tokens:5d} {op}: ours {row['ours_tflops']:7.1f} "
                  f"torch {row['torch_tflops']:7.1f} dense {row['dense_tflops']:7.1f} TFLOP/s "
                  f"({row['ours_us']:.1f} vs {row['torch_us']:.1f} us) x{row['ratio']:.2f}, weights "
                  f"{row['weights_tbps']:.2f} TB/s", flush=True)
    table(rows, ["layer", "proj", "T", "op", "ours_tflops", "torch_tflops", "dense_tflops", "ours_us",
                 "torch_us", "ratio", "weights_tbps"])
    for op in ("bf16", "fp8"):
        for phase, pick in (("prefill", lambda r: r["T"] > max(DECODE_T)), ("decode", lambda r: r["T"] <= max(DECODE_T))):
            ratios = [r["ratio"] for r in rows if r["op"] == op and pick(r)]
            if ratios:
                print(f"{op} {phase}: geomean ratio {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} "
                      f"(min {min(ratios):.3f}) over {len(ratios)} shapes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
