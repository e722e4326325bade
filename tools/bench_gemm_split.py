"""The GEMMs' 128-row candidates at mid-sized M, split-K included, against torch in the same run.

  python tools/bench.py gemm --split-sweep [--op ...] [--json PATH]

For each shape (M in SWEEP_M x (N, K) in SWEEP_NK: few output tiles per wave, short and long K)
and op (bf16_gemm against torch.mm; f8f8bf16_rowwise with fast accumulation against
torch._scaled_mm), times every (tile_n, cluster_m, split_k) of SWEEP_CANDIDATES with the config
forced, and torch once; prints per shape the fastest, the heuristic's pick and how much slower
it is. What the heuristic's split-K model is checked against (a CPU test reads the JSON).
"""
from __future__ import annotations


SWEEP_M = (72, 129, 311, 513, 800)
SWEEP_NK = ((4096, 4096), (5120, 32768), (8192, 8192), (2112, 7168), (28672, 4096), (7168, 2048))
# (tile_n, cluster_m, split_k) of 128-row tiles: the unsplit widths the heuristic takes at mid M
# and the split-K configs.
SWEEP_CANDIDATES = ((64, 1, 1), (128, 1, 1), (128, 2, 1), (192, 1, 1), (256, 1, 1), (256, 2, 1),
                    (128, 1, 2), (128, 1, 3), (128, 1, 4), (256, 1, 2), (256, 1, 3), (256, 1, 4))


def _config(op: str, tile_n: int, cluster_m: int, split_k: int) -> dict:
    from mslk_dsl.templates import _cute_gemm_configs as gemm_configs

    config = gemm_configs._config(128, tile_n, cluster_m, split_k=split_k)
    return config if op == "bf16_gemm" else {**config, "promote": 0}


def _signature(op: str) -> dict:
    return {"dtype": "bfloat16"} if op == "bf16_gemm" else {"bias": "none", "fast_accum": True}


def prebuild(op_names) -> None:
    from bench_common import build_jobs

    from mslk_dsl import registry
    from mslk_dsl.aot.manifest import Job
    from mslk_dsl.keys import KernelKey

    jobs = {}
    for op in op_names:
        (template,) = registry.get_templates(op=op, backend="cute")
        for candidate in SWEEP_CANDIDATES:
            key = KernelKey.make(template, _config(op, *candidate), "sm90a", _signature(op))
            jobs.setdefault(key.digest, Job(key, template.name))
    build_jobs(jobs)


def _calls(op, m, n, k, torch):
    from bench_common import quantize_rowwise

    from mslk_dsl import ops
    from mslk_dsl.ops.elementwise import fp8_dtype_for

    x = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda")
    if op == "bf16_gemm":
        x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
        return (lambda config: lambda: ops.bf16_gemm(x, w, config=config)), lambda: torch.mm(x, w.T)
    fp8 = fp8_dtype_for(x.device)
    (xq, x_scale), (wq, w_scale) = quantize_rowwise(x, fp8, torch), quantize_rowwise(w, fp8, torch)
    scale_a, scale_b = x_scale[:, None].contiguous(), w_scale[None, :].contiguous()
    return ((lambda config: lambda: ops.f8f8bf16_rowwise(xq, wq, x_scale, w_scale, None, True, config=config)),
            lambda: torch._scaled_mm(xq, wq.T, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                                     use_fast_accum=True))


def run(op_names, json_path, torch, do_bench) -> int:
    from bench_common import save_json

    from mslk_dsl.templates import _cute_gemm_configs as gemm_configs

    torch.backends.cuda.matmul.allow_tf32 = False
    prebuild(op_names)
    results = []
    for op in op_names:
        print(f"\n### {op}: 128-row candidates (tile_n, cluster_m, split_k), us; torch us\n")
        for n, k in SWEEP_NK:
            for m in SWEEP_M:
                ours, theirs = _calls(op, m, n, k, torch)
                us = {}
                for candidate in SWEEP_CANDIDATES:
                    call = ours(_config(op, *candidate))
                    call()
                    us[candidate] = do_bench(call, warmup=3, rep=10, return_mode="median") * 1e3
                torch_us = do_bench(theirs, warmup=3, rep=10, return_mode="median") * 1e3
                pick = gemm_configs.heuristic({"M": m, "N": n, "K": k}, fp8=op != "bf16_gemm", fast_accum=True)
                picked = (pick["tile_n"], pick["cluster_m"], pick.get("split_k", 1))
                best = min(us, key=us.get)
                print(f"M={m} N={n} K={k}: best {best} {us[best]:.1f}, pick {picked} "
                      f"{us.get(picked, float('nan')):.1f} ({us.get(picked, float('nan')) / us[best]:.3f}x), "
                      f"torch {torch_us:.1f} | " + " ".join(f"{c[0]}c{c[1]}s{c[2]}={t:.1f}" for c, t in us.items()),
                      flush=True)
                results.append({"op": op, "M": m, "N": n, "K": k, "torch_us": torch_us,
                                "us": {f"{c[0]}c{c[1]}s{c[2]}": t for c, t in us.items()}})
                torch.cuda.empty_cache()
    save_json(json_path, {"candidates": SWEEP_CANDIDATES, "results": results,
                          "device": torch.cuda.get_device_name()})
    return 0
