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
  python tools/bench.py grouped_gemm --random N --seed S [--t-min T] [--sweep all] [--op ...] [--json PATH]
--sweep also times every config of the target's template (ours only) at the prefill shapes (the
default), the decode shapes or both; --tokens keeps only those T.
--random draws N GEMMs instead of the three layers: a layer of MOE_LAYERS (the routed experts of
current open MoE models), T log-uniform over t_min..T_MAX (any integer: decode to prefill) and gate_up
or down. With --sweep all it also reports our default pick against the fastest config of the
sweep, both replayed from CUDA graphs (pick_vs_best < 1: the heuristic left that much on the
table). Use fresh seeds: a set of shapes tuned for is no longer a test.
Every row names the heuristic's rule for its call (``band``: swapped decode tiles, one 64- or
128-row tile, the DRAM model), and the summary ends with each rule's geometric means.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics

from bench_common import cuda_or_exit, geomean, graph_timed, table

LAYERS = (("deepseek-v3", 4096, 128, 8, 7168, 2048), ("llama4-scout", 8192, 16, 1, 5120, 8192),
          ("mixtral", 4096, 8, 2, 4096, 14336))
DECODE_T = (1, 16, 128)
ROUNDS = 2
# (name, experts, top_k, hidden D, expert intermediate H) of the routed experts of open MoE models.
MOE_LAYERS = (
    ("deepseek-v3", 256, 8, 7168, 2048), ("kimi-k2", 384, 8, 7168, 2048), ("glm-4.5", 160, 8, 5120, 1536),
    ("qwen3-235b-a22b", 128, 8, 4096, 1536), ("qwen3-30b-a3b", 128, 8, 2048, 768),
    ("qwen2-57b-a14b", 64, 8, 3584, 2560), ("qwen1.5-moe-a2.7b", 60, 4, 2048, 1408),
    ("olmoe-1b-7b", 64, 8, 2048, 1024), ("gpt-oss-120b", 128, 4, 2880, 2880), ("gpt-oss-20b", 32, 4, 2880, 2880),
    ("llama4-scout", 16, 1, 5120, 8192), ("llama4-maverick", 128, 1, 5120, 8192), ("dbrx", 16, 4, 6144, 10752),
    ("mixtral-8x7b", 8, 2, 4096, 14336), ("mixtral-8x22b", 8, 2, 6144, 16384), ("phi-3.5-moe", 16, 2, 4096, 6400),
)
T_MAX = 8192


def _sizes(torch, tokens, experts, top_k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    chosen = torch.rand(tokens, experts, device="cuda", generator=g).topk(top_k, dim=1).indices
    return torch.bincount(chosen.flatten(), minlength=experts).to(torch.int32)


def _quantize(torch, t):
    """Rowwise FP8 of ``t``; a stack of expert weights one expert at a time (an fp32 copy of
    Kimi-K2's gate_up stack alone would take 45 GB)."""
    fp8 = torch.float8_e4m3fn
    if t.dim() == 3:
        q = torch.empty_like(t, dtype=fp8)
        scale = torch.empty(t.shape[:2], device=t.device, dtype=torch.float32)
        for e in range(t.shape[0]):
            q[e], scale[e] = _quantize(torch, t[e])
        return q, scale
    scale = t.float().abs().amax(dim=-1).clamp(min=1e-12) / torch.finfo(fp8).max
    return (t.float() / scale.unsqueeze(-1)).to(fp8), scale


def _time(do_bench, fns):
    """Median time (ms) of each function, taking turns ROUNDS times."""
    times = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            times[name].append(do_bench(fn, warmup=5, rep=30))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _sweep(torch, do_bench, op, flop, ops, x, w, sizes, xq, wq, xs, ws):
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
            fn = lambda c=config: ops.f8f8bf16_rowwise_grouped_stacked(  # noqa: E731
                xq, wq, xs, ws, sizes, c["promote"] == 0, config=c)
        # replayed from a CUDA graph: an explicit config takes the op's checked path, whose host
        # time would hide the 25-150 us decode kernels
        result[config_name(config)] = flop / graph_timed(torch, lambda r: do_bench(r, warmup=5, rep=30), fn) * 1e-9
    print("   sweep: " + ", ".join(f"{k} {v:.0f}" for k, v in result.items()), flush=True)
    return result


def _pick(op, x, sizes, n, k):
    """The name of the config our op takes by default for this call (tuned or heuristic)."""
    from mslk_dsl.device import target_of
    from mslk_dsl.ops import declaration
    from mslk_dsl.ops.dispatch import dtype_name
    from mslk_dsl.template import config_name

    name = "bf16bf16bf16_grouped_stacked" if op == "bf16" else "f8f8bf16_rowwise_grouped_stacked"
    kernels = declaration.get(name).kernels
    problem = (x.shape[0], n, k, sizes.numel())
    parts = (dtype_name(sizes.dtype),) + (() if op == "bf16" else (True,))  # FP8: the default, fast accumulation
    _, config, _ = kernels.choose(target_of(x.device).name, parts, problem, None)
    return config_name(config)


def _cases(quick):
    for name, t_prefill, experts, top_k, d, h in LAYERS[:1] if quick else LAYERS:
        for tokens in (t_prefill, *DECODE_T):
            for proj, n, k in (("gate_up", 2 * h, d), ("down", d, h)):
                yield name, tokens, experts, top_k, proj, n, k


def draw(count, seed, t_min=1):
    """``count`` GEMMs (name, T, experts, top_k, proj, N, K): a uniform layer of MOE_LAYERS, T =
    floor(exp(u)) with u uniform on [ln(t_min), ln(T_MAX + 1)) (every integer can come up, each
    octave equally often), gate_up or down. Sorted by layer and projection, so that one layer's
    weights are made once."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        name, experts, top_k, d, h = rng.choice(MOE_LAYERS)
        tokens = max(t_min, min(T_MAX, int(math.exp(rng.uniform(math.log(t_min), math.log(T_MAX + 1))))))
        proj, n, k = rng.choice((("gate_up", 2 * h, d), ("down", d, h)))
        cases.append((name, tokens, experts, top_k, proj, n, k))
    return sorted(cases, key=lambda c: (c[0], c[4], c[1]))


def _summarize(label, rows):
    """One line for ``rows`` (if any): the geometric mean and minimum of torch time / ours, and of
    the default pick / the fastest config where the rows were swept."""
    if not rows:
        return
    ratios = [r["ratio"] for r in rows]
    regrets = [r["pick_vs_best"] for r in rows if "pick_vs_best" in r]
    regret = f"; default pick / fastest config {geomean(regrets):.3f} (min {min(regrets):.3f})" if regrets else ""
    print(f"{label}: geomean ratio {geomean(ratios):.3f} (min {min(ratios):.3f}) over {len(ratios)} shapes{regret}")


def main(argv: list[str]) -> int:
    found = cuda_or_exit("bench_grouped_gemm")
    if found is None:
        return 1
    torch, do_bench = found
    from mslk_dsl import ops
    from mslk_dsl.templates import _grouped_gemm_space as space

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the DeepSeek-V3-like layer only")
    parser.add_argument("--op", choices=("bf16", "fp8", "all"), default="all")
    parser.add_argument("--sweep", nargs="?", const="prefill", choices=("prefill", "decode", "all"),
                        help="also time every config at these shapes (default: prefill)")
    parser.add_argument("--tokens", type=lambda v: {int(t) for t in v.split(",")},
                        help="only these T (comma-separated)")
    parser.add_argument("--random", type=int, metavar="N", help="draw N GEMMs of MOE_LAYERS (see above)")
    parser.add_argument("--seed", type=int, default=0, help="the draw's seed (with --random)")
    parser.add_argument("--t-min", type=int, default=1, help="the draw's smallest T (with --random)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)

    rows, weights = [], {}
    cases = draw(args.random, args.seed, args.t_min) if args.random else _cases(args.quick)
    for name, tokens, experts, top_k, proj, n, k in cases:
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
            row = {"layer": name, "proj": proj, "T": tokens, "G": experts, "M": total, "N": n, "K": k, "op": op,
                   "ours_tflops": flop / t["ours"] * 1e-9, "torch_tflops": flop / t["torch"] * 1e-9,
                   "dense_tflops": flop / t["dense"] * 1e-9, "ours_us": t["ours"] * 1e3,
                   "torch_us": t["torch"] * 1e3, "ratio": t["torch"] / t["ours"], "pick": _pick(op, x, sizes, n, k),
                   "weights_tbps": int((sizes > 0).sum()) * n * k * (2 if op == "bf16" else 1) / t["ours"] * 1e-9,
                   "band": space.band(total, experts)}
            row["phase"] = "decode" if tokens <= max(DECODE_T) else "prefill"
            if args.sweep in ("all", row["phase"]):
                row["sweep"] = _sweep(torch, do_bench, op, flop, ops, x, w, sizes, xq, wq, xs, ws)
                best = max(row["sweep"], key=row["sweep"].get)
                row["best_config"], row["pick_vs_best"] = best, row["sweep"].get(row["pick"], row["ours_tflops"]) / row["sweep"][best]
            rows.append(row)
            print(f"{name:12s} {proj:7s} T={tokens:5d} {op}: ours {row['ours_tflops']:7.1f} "
                  f"torch {row['torch_tflops']:7.1f} dense {row['dense_tflops']:7.1f} TFLOP/s "
                  f"({row['ours_us']:.1f} vs {row['torch_us']:.1f} us) x{row['ratio']:.2f}, weights "
                  f"{row['weights_tbps']:.2f} TB/s", flush=True)
    table(rows, ["layer", "proj", "T", "op", "ours_tflops", "torch_tflops", "dense_tflops", "ours_us",
                 "torch_us", "ratio", "weights_tbps", "pick"]
          + (["best_config", "pick_vs_best"] if any("pick_vs_best" in r for r in rows) else []))
    # By phase, then by the heuristic's rule for the call (rows per busy expert: swapped decode
    # tiles, one 64- or 128-row tile, the DRAM model), so each rule's picks can be checked alone.
    for op in ("bf16", "fp8"):
        for label in ("prefill", "decode", *space.BANDS):
            _summarize(f"{op} {label}", [r for r in rows if r["op"] == op and label in (r["phase"], r["band"])])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
