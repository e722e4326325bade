"""The GEMMs on random shapes of real layers, against torch in the same run.

  python tools/bench.py gemm --random N --seed S [--op ...] [--promoted] [--json PATH]

Draws N shapes: M log-uniform over 1..16384 (any integer), (N, K) uniform over LAYERS, the
linear layers of current open models (fused projections as served). Each shape is timed for
  bf16_gemm         against torch.mm(x, w.T) (cuBLAS), bf16
  f8f8bf16_rowwise  against torch._scaled_mm with rowwise scales, bf16 out, the same accumulation:
                    MSLK's default use_fast_accum=True (or False with --promoted)
with the default kernel choice (tuned or heuristic), ours and torch's alternating ROUNDS times
(power-limited clocks depend on what ran before). Prints per op the geometric mean and the
minimum of torch time / our time (> 1: ours is faster), the ten worst shapes with the config
chosen, and the worst at M >= 64. The kernels the draws need are compiled first, in parallel.
Use fresh seeds: a set of shapes tuned for is no longer a test.
"""
from __future__ import annotations

import math
import random
import statistics

from bench_common import build_jobs, geomean, quantize_rowwise

# (N, K, where) of y = x @ w.T for w [N, K]; fused QKV / gate-up as served.
LAYERS = (
    (6144, 4096, "Llama-3.1-8B qkv"), (4096, 4096, "Llama-3.1-8B o"), (28672, 4096, "Llama-3.1-8B gate_up"),
    (4096, 14336, "Llama-3.1-8B down"), (10240, 8192, "Llama-3.3-70B qkv"), (8192, 8192, "Llama-3.3-70B o"),
    (57344, 8192, "Llama-3.3-70B gate_up"), (8192, 28672, "Llama-3.3-70B down"),
    (2112, 7168, "DeepSeek-V3 q_a+kv_a"), (7168, 16384, "DeepSeek-V3 o"), (36864, 7168, "DeepSeek-V3 dense gate_up"),
    (7168, 18432, "DeepSeek-V3 dense down"), (4096, 7168, "DeepSeek-V3 shared gate_up"),
    (7168, 2048, "DeepSeek-V3 shared down"), (7168, 5120, "Qwen2.5-14B qkv"), (27648, 5120, "Qwen2.5-14B gate_up"),
    (5120, 13824, "Qwen2.5-14B down"), (10240, 5120, "Qwen3-32B qkv"), (5120, 8192, "Qwen3-32B o"),
    (51200, 5120, "Qwen3-32B gate_up"), (5120, 25600, "Qwen3-32B down"), (9216, 4096, "Qwen3-235B qkv"),
    (4096, 8192, "Qwen3-235B o"), (6144, 5120, "Mistral-Small-24B qkv"), (65536, 5120, "Mistral-Small-24B gate_up"),
    (5120, 32768, "Mistral-Small-24B down"), (8192, 5376, "Gemma-3-27B qkv"), (5376, 21504, "Gemma-3-27B down"),
    (5120, 2880, "gpt-oss-120b qkv"), (2880, 4096, "gpt-oss-120b o"), (16384, 5120, "Llama-4-Scout shared gate_up"),
    (5120, 8192, "Llama-4-Scout shared down"), (7680, 5120, "Phi-4 qkv"), (5120, 17920, "Phi-4 down"),
)
M_MAX = 16384
ROUNDS = 3


def draw(count: int, seed: int) -> list[tuple[int, int, int]]:
    """``count`` shapes (M, N, K): M = floor(exp(u)), u uniform on [0, ln(M_MAX + 1)), so every
    integer in 1..M_MAX can come up and each octave equally often; (N, K) a uniform layer."""
    rng = random.Random(seed)
    shapes = []
    for _ in range(count):
        m = min(M_MAX, int(math.exp(rng.uniform(0.0, math.log(M_MAX + 1)))))
        n, k, _ = rng.choice(LAYERS)
        shapes.append((max(m, 1), n, k))
    return shapes


def _signature(op: str, fast: bool) -> tuple:
    return ("bfloat16",) if op == "bf16_gemm" else ("none", fast)


def prebuild(ops_: list[str], shapes, target: str, fast: bool) -> None:
    """Compile the kernels the default choice takes for ``shapes``, in parallel (one worker per
    CPU), so the timing loop only loads them."""
    from mslk_dsl.aot.manifest import Job
    from mslk_dsl.keys import KernelKey
    from mslk_dsl.ops import declaration

    jobs = {}
    for op in ops_:
        kernels = declaration.get(op).kernels
        for m, n, k in shapes:
            template, config, sig = kernels.choose(target, _signature(op, fast), (m, n, k), None)
            key = KernelKey.make(template, config, target, sig)
            jobs.setdefault(key.digest, Job(key, template.name))
    build_jobs(jobs)


def _time_pair(ours, theirs, do_bench):
    t_ours, t_torch = [], []
    for _ in range(ROUNDS):
        t_ours.append(do_bench(ours, warmup=5, rep=20, return_mode="median"))
        t_torch.append(do_bench(theirs, warmup=5, rep=20, return_mode="median"))
    return statistics.median(t_ours), statistics.median(t_torch)


def bench_shape(op, target, m, n, k, fast, torch, do_bench):
    from mslk_dsl import ops
    from mslk_dsl.ops import declaration
    from mslk_dsl.ops.elementwise import fp8_dtype_for

    chosen = declaration.get(op).kernels.choose(target, _signature(op, fast), (m, n, k), None)[1]
    x = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda")
    if op == "bf16_gemm":
        x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
        ours = lambda: ops.bf16_gemm(x, w)  # noqa: E731
        theirs = lambda: torch.mm(x, w.T)  # noqa: E731
    else:
        fp8 = fp8_dtype_for(x.device)
        (xq, x_scale), (wq, w_scale) = quantize_rowwise(x, fp8, torch), quantize_rowwise(w, fp8, torch)
        scale_a, scale_b = x_scale[:, None].contiguous(), w_scale[None, :].contiguous()
        ours = lambda: ops.f8f8bf16_rowwise(xq, wq, x_scale, w_scale, None, fast)  # noqa: E731
        theirs = lambda: torch._scaled_mm(xq, wq.T, scale_a=scale_a, scale_b=scale_b,  # noqa: E731
                                          out_dtype=torch.bfloat16, use_fast_accum=fast)
    ours()
    torch.cuda.synchronize()
    t_ours, t_torch = _time_pair(ours, theirs, do_bench)
    flop = 2.0 * m * n * k
    return {"op": op, "M": m, "N": n, "K": k, "config": chosen, "ms": t_ours, "torch_ms": t_torch,
            "tflops": flop / t_ours * 1e-9, "torch_tflops": flop / t_torch * 1e-9, "ratio": t_torch / t_ours}


def summarize(op: str, rows: list[dict]) -> dict:
    from mslk_dsl.template import config_name

    ratios = [r["ratio"] for r in rows]
    geo = geomean(ratios)
    large = [r["ratio"] for r in rows if r["M"] >= 64]
    print(f"\n{op}: {len(rows)} shapes, geometric mean {geo:.3f}, minimum {min(ratios):.3f}"
          + (f", minimum at M >= 64 {min(large):.3f}" if large else ""))
    print("ten worst:\n| M | N | K | config | ms | torch ms | ratio |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: r["ratio"])[:10]:
        print(f"| {r['M']} | {r['N']} | {r['K']} | {config_name(r['config'])} | {r['ms']:.4f} | "
              f"{r['torch_ms']:.4f} | {r['ratio']:.3f} |")
    return {"geomean": geo, "min": min(ratios), "min_m64": min(large) if large else None}


def run(count: int, seed: int, op_names: list[str], fast: bool, json_path: str | None, torch, do_bench) -> int:
    import json

    from mslk_dsl import device
    from mslk_dsl.template import config_name

    target = device.current_target().name
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = draw(count, seed)
    prebuild(op_names, shapes, target, fast)
    results, summary = [], {}
    for op in op_names:
        print(f"\n### {op} on {count} random shapes (seed {seed}), {torch.cuda.get_device_name()} ({target})"
              + (f", use_fast_accum={fast}" if op != "bf16_gemm" else "") + "\n")
        print("| M | N | K | config | ms | torch ms | ratio |\n| --- | --- | --- | --- | --- | --- | --- |")
        rows = []
        for m, n, k in shapes:
            try:
                r = bench_shape(op, target, m, n, k, fast, torch, do_bench)
            except Exception as e:  # reported and left out, so one failure does not lose the run
                print(f"| {m} | {n} | {k} | FAILED: {type(e).__name__}: {e} | | | |", flush=True)
                continue
            rows.append(r)
            print(f"| {m} | {n} | {k} | {config_name(r['config'])} | {r['ms']:.4f} | {r['torch_ms']:.4f} | "
                  f"{r['ratio']:.3f} |", flush=True)
            torch.cuda.empty_cache()
        results += rows
        summary[op] = summarize(op, rows)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"random": {"count": count, "seed": seed, "use_fast_accum": fast}, "results": results,
                       "summary": summary, "geomean_ratio": {op: s["geomean"] for op, s in summary.items()},
                       "target": target, "device": torch.cuda.get_device_name()}, f, indent=1)
    return 0
