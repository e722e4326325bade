"""The autotuner: time every valid config of an op on this GPU and store the winner.

Timing uses CUDA events with the L2 cache flushed before each run (triton.testing.do_bench), on
N(0, 1) inputs. Winners go to the tuning DB (tuning.py) under the current GPU name and toolchain
versions, per (op, signature, shape bucket); the op layer then prefers them over the heuristic.
"""
from __future__ import annotations

import json
import os

import torch

from mslk_dsl import registry, tuning
from mslk_dsl.device import target_of


def _gemm_inputs(problem, sig, fp8):
    M, N, K = problem["M"], problem["N"], problem["K"]
    x = torch.randn(M, K, device="cuda")
    w = torch.randn(N, K, device="cuda")
    if not fp8:
        dtype = getattr(torch, sig.get("dtype", "bfloat16"))
        return (x.to(dtype), w.to(dtype)), {}
    import mslk_dsl.ops as ops

    xq, xs = ops.quantize_fp8_row(x.to(torch.bfloat16))
    wq, ws = ops.quantize_fp8_row(w.to(torch.bfloat16))
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16) if sig.get("has_bias") else None
    return (xq, wq, xs, ws, bias), {}


def _rows_inputs(problem, sig, count):
    M, K = problem["M"], problem.get("K", problem.get("N"))
    dtype = getattr(torch, sig.get("dtype", "bfloat16"))
    return tuple(torch.randn(M, K, device="cuda", dtype=dtype) for _ in range(count)), {}


# op -> (function name in mslk_dsl.ops, input factory)
INPUTS = {
    "bf16_gemm": lambda p, s: _gemm_inputs(p, s, fp8=False),
    "f8f8bf16_rowwise": lambda p, s: _gemm_inputs(p, s, fp8=True),
    "silu_mul": lambda p, s: _rows_inputs(p, s, 2),
    "quantize_fp8_row": lambda p, s: _rows_inputs(p, s, 1),
    "silu_mul_quant": lambda p, s: _rows_inputs(p, s, 2),
}


def tune(op: str, problems: list[dict], sig: dict | None = None, store: bool = True) -> list[tuple[dict, float]]:
    """For each problem: (best config, its time in ms); stored in the tuning DB when ``store``."""
    from triton.testing import do_bench

    import mslk_dsl.ops as ops

    if op not in INPUTS:
        raise ValueError(f"tuning {op!r} is not supported; supported: {sorted(INPUTS)}")
    target = target_of(torch.device("cuda")).name
    template = registry.templates_for(op, target)[0]
    results = []
    for problem in problems:
        full_sig = {k: v[0] for k, v in template.signatures.items()}
        full_sig.update(sig or {})
        if "aligned" in full_sig:
            full_sig["aligned"] = True
        args, kwargs = INPUTS[op](problem, full_sig)
        fn = getattr(ops, op)
        timings = []
        for config in _candidates(template, target, full_sig, problem):
            try:
                ms = do_bench(lambda: fn(*args, config=config, **kwargs), warmup=10, rep=50)
            except Exception as e:  # a config that fails to build or run here is skipped, loudly
                print(f"  skip {config}: {type(e).__name__}: {e}")
                continue
            timings.append((ms, config))
        if not timings:
            raise RuntimeError(f"{op}: no config ran for {problem}")
        ms, best = min(timings, key=lambda t: t[0])
        results.append((best, ms))
        if store:
            _store(op, target, full_sig, problem, best, ms)
    return results


# GEMM split-K configs are decode tiles (64 rows): timed only up to this M, past which their
# partials buffer grows with M and the 128-row tiles win.
SPLIT_K_MAX_M = 128


def _candidates(template, target, sig, problem) -> list[dict]:
    """Every valid config, except that a precision knob (FP8 "promote": how often the tensor
    core's partial sums go to fp32) stays at the heuristic's value: tuning trades speed, never
    accuracy; split-K configs only for M <= SPLIT_K_MAX_M; and only configs that serve the
    problem (template.serves)."""
    default = template.heuristic(target, sig, problem)
    return [c for c in template.valid_configs(target, sig)
            if ("promote" not in c or c["promote"] == default.get("promote"))
            and ("split_k" not in c or problem.get("M", 0) <= SPLIT_K_MAX_M) and template.serves(c, problem)]


def _store(op, target, sig, problem, config, ms) -> None:
    from filelock import FileLock

    path = tuning.db_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with FileLock(path + ".lock"):
        db = tuning.read_db(path)  # a malformed file is replaced (with a warning), not a crash
        db["entries"][tuning.entry_key(op, target, sig, problem)] = {
            "config": config, "ms": ms, "problem": problem, "context": tuning.context()}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(db, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
