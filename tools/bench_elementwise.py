"""Benchmark silu_mul, quantize_fp8_row and silu_mul_quant against a device copy and torch eager,
on the same N(0, 1) data.

  silu_mul          moves x0, x1 in, out back          (3 M K elements of the dtype)
  quantize_fp8_row  moves x in, xq (fp8) and scale out  (M K dtype + M K bytes + 4 M)
  silu_mul_quant    moves x0, x1 in, xq and scale out   (2 M K dtype + M K bytes + 4 M)

For each shape the table gives our time and GB/s, the GB/s of ``dst.copy_(src)`` moving the same
number of bytes in the same run (the bandwidth roofline: "% copy"), and the speedup over the torch
eager composite: ``F.silu(x0) * x1``; MSLK's torch fallback for quantize_fp8_row (row absmax,
clamp, ``fp8_max / amax``, multiply, cast, reciprocal); and the two in sequence for
silu_mul_quant. ``--compile`` also times torch.compile of the same composites. Times are medians
of triton.testing.do_bench (CUDA events).

  python tools/bench_elementwise.py [--op silu_mul|quantize_fp8_row|silu_mul_quant|all]
      [--dtype bfloat16|float16|float32] [--shapes 1024x4096,8192x8192,65536x8192]
      [--scale-ub] [--compile] [--config NAME | --sweep] [--json PATH]

--config forces one config (its name as in mslk_dsl.template.config_name, e.g.
chunks4_rows_per_block1_threads256_vec8); --sweep times every valid config of each shape (for
tuning the heuristics) instead of the heuristic's choice.
"""
from __future__ import annotations

import argparse
import json
import sys

from bench_common import parse_shapes, parse_with_gpu, row_vec_bytes, rowwise_label

OPS = ("silu_mul", "quantize_fp8_row", "silu_mul_quant")
SHAPES = ((1024, 4096), (8192, 8192), (65536, 8192))
FP8_EPS = 1.0 / 512.0


def _template(op):
    from mslk_dsl import registry

    (t,) = registry.get_templates(op=op, backend="cute")
    return t


def _signature(op, k, dtype, has_ub):
    """The op layer's signature for fresh [M, K] tensors, as a dict and in its field order."""
    from mslk_dsl.ops import declaration
    from mslk_dsl.ops.dispatch import dtype_name

    sig = {"vec_bytes": row_vec_bytes(k, dtype_name(dtype)), "dtype": dtype_name(dtype)}
    if op != "silu_mul":
        sig["has_scale_ub"] = has_ub
    kernel_op = declaration.get(op).kernels
    return sig, kernel_op, tuple(sig[f] for f in kernel_op.sig_fields)


def _configs_to_time(op, args, target, sig):
    """[None] (the heuristic's choice), [the forced config], or every valid config."""
    from mslk_dsl.template import config_name

    t = _template(op)
    if args.sweep:
        return t.valid_configs(target, sig)
    if args.config:
        for c in t.all_configs():
            if config_name(c) == args.config:
                return [c]
        raise SystemExit(f"{op}: no config named {args.config}; known: {[config_name(c) for c in t.all_configs()]}")
    return [None]


def _torch_composites(torch, fp8):
    """Eager torch versions of the three ops (MSLK's torch path for the quantization)."""
    import torch.nn.functional as F

    fp8_max = torch.finfo(fp8).max

    def quantize(a, scale_ub=None):
        row_max = torch.max(torch.abs(a), dim=-1)[0]
        if scale_ub is not None:
            row_max = torch.clamp(row_max, min=FP8_EPS, max=scale_ub.item())
        else:
            row_max = torch.clamp(row_max, min=FP8_EPS)
        a_scale = fp8_max / row_max.to(torch.float32)
        a_scale[a_scale == float("inf")] = 1.0
        a_fp8 = (a * a_scale[..., None]).to(fp8)
        return a_fp8, 1 / a_scale

    return {"silu_mul": lambda x0, x1, ub: F.silu(x0) * x1,
            "quantize_fp8_row": lambda x0, x1, ub: quantize(x0, ub),
            "silu_mul_quant": lambda x0, x1, ub: quantize(F.silu(x0) * x1, ub)}


def _bench_shape(op, m, k, dtype, args, target, torch, ops, do_bench, composites):
    from mslk_dsl.ops.elementwise import fp8_dtype_for

    x0 = torch.randn(m, k, device="cuda", dtype=dtype)
    x1 = torch.randn(m, k, device="cuda", dtype=dtype) if op != "quantize_fp8_row" else None
    ub = torch.tensor([4.0], device="cuda") if args.scale_ub and op != "silu_mul" else None
    e = x0.element_size()
    nbytes = {"silu_mul": 3 * m * k * e, "quantize_fp8_row": m * k * (e + 1) + 4 * m,
              "silu_mul_quant": m * k * (2 * e + 1) + 4 * m}[op]
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)

    def timed(fn):
        fn()  # compile / load / warm up outside the timed region
        torch.cuda.synchronize()
        return do_bench(fn, return_mode="median")

    base = {"copy": timed(lambda: dst.copy_(src)),
            "eager": timed(lambda: composites[op](x0, x1, ub))}
    if args.compile:
        compiled = torch.compile(composites[op])
        base["compiled"] = timed(lambda: compiled(x0, x1, ub))
    sig, kernel_op, sig_tuple = _signature(op, k, dtype, ub is not None)
    rows = []
    for config in _configs_to_time(op, args, target, sig):
        if op == "silu_mul":
            fn = lambda: ops.silu_mul(x0, x1, config=config)  # noqa: E731
        elif op == "quantize_fp8_row":
            fn = lambda: ops.quantize_fp8_row(x0, ub, config=config)  # noqa: E731
        else:
            fn = lambda: ops.silu_mul_quant(x0, x1, ub, config=config)  # noqa: E731
        ms = timed(fn)
        chosen = config or kernel_op.choose(target, sig_tuple, (m, k), None)[1]
        rows.append({"op": op, "M": m, "K": k, "dtype": str(dtype).removeprefix("torch."),
                     "fp8": str(fp8_dtype_for(x0.device)).removeprefix("torch."), "scale_ub": ub is not None,
                     "config": chosen, "ms": ms, "bytes": nbytes, "gbps": nbytes / ms * 1e-6,
                     "copy_gbps": nbytes / base["copy"] * 1e-6, "pct_copy": 100.0 * base["copy"] / ms,
                     "baseline_ms": base, "speedup": {n: v / ms for n, v in base.items() if n != "copy"}})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=(*OPS, "all"), default="all")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--shapes", help="comma-separated MxK list (default: %(default)s)",
                        default=",".join(f"{m}x{k}" for m, k in SHAPES))
    parser.add_argument("--scale-ub", action="store_true", help="pass scale_ub to the quantizing ops")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the composites")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--config", help="force this config (by name) for every shape")
    group.add_argument("--sweep", action="store_true", help="time every valid config")
    found = parse_with_gpu(parser, argv, "bench_elementwise")
    if found is None:
        return 2
    args, torch, do_bench = found

    from mslk_dsl import ops
    from mslk_dsl.device import target_of
    from mslk_dsl.ops.elementwise import fp8_dtype_for

    device = torch.device("cuda")
    target = target_of(device).name
    dtype = getattr(torch, args.dtype)
    composites = _torch_composites(torch, fp8_dtype_for(device))
    shapes = parse_shapes(args.shapes)
    results = []
    for op in (OPS if args.op == "all" else (args.op,)):
        print(f"\n### {op} {args.dtype}{' scale_ub' if args.scale_ub and op != 'silu_mul' else ''} "
              f"on {torch.cuda.get_device_name()} ({target})\n")
        extra = " vs compiled |" if args.compile else ""
        print(f"| M x K | config | ms | GB/s | copy GB/s | % copy | vs eager |{extra}")
        print("| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if args.compile else ""))
        for m, k in shapes:
            for r in _bench_shape(op, m, k, dtype, args, target, torch, ops, do_bench, composites):
                results.append(r)
                s = r["speedup"]
                tail = f" {s['compiled']:.2f}x |" if args.compile else ""
                print(f"| {m}x{k} | {rowwise_label(r['config'])} | {r['ms']:.4f} | {r['gbps']:.0f} | "
                      f"{r['copy_gbps']:.0f} | {r['pct_copy']:.1f} | {s['eager']:.2f}x |{tail}", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "device": torch.cuda.get_device_name(), "target": target}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
