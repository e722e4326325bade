"""Benchmark the RMSNorm ops against a device copy and torch eager on the same N(0, 1) data.

  rmsnorm      moves x in, y out (+ the weight once)
  rmsnorm_add  moves x, residual in, y, new_residual out (+ the weight once)

For each shape (T tokens x hidden) the table gives our time and GB/s, the GB/s of
``dst.copy_(src)`` moving the same number of bytes (the bandwidth roofline: "% copy"), and the
speedup over torch eager: F.rms_norm and the written-out fp32 composite (for rmsnorm_add, after
``x + residual``). quack's rmsnorm_fwd is timed too when the quack package is installed. Times
are medians of triton.testing.do_bench (CUDA events), all in the same run.

  python tools/bench_norm.py [--op rmsnorm|rmsnorm_add|all] [--dtype bfloat16|float16]
                             [--shapes 1024x8192,16384x8192,65536x5120] [--config NAME | --sweep]
                             [--residual-dtype float32] [--json PATH]
--config forces one config (its name as in mslk_dsl.template.config_name, e.g.
chunks8_rows_per_block1_threads128_vec8); --sweep times every valid config of each shape (for
tuning the heuristic) instead of the heuristic's choice. --residual-dtype float32 times
rmsnorm_add with an fp32 residual stream (16-bit x; new_residual fp32) against quack's
rmsnorm_fwd with the same residual and the fp32 torch composite (with --sweep: the configs of
the fused fp32-residual kernels, odd rows' included).
"""
from __future__ import annotations

import argparse
import json
import sys

from bench_common import parse_shapes, parse_with_gpu, row_vec_bytes, rowwise_label

SHAPES = ((1024, 8192), (16384, 8192), (65536, 5120))
EPS = 1e-6


def _template(op):
    from mslk_dsl import registry

    (t,) = registry.get_templates(op=op, backend="cute")
    return t


def _config_by_name(op, name):
    from mslk_dsl.template import config_name

    for config in _template(op).all_configs():
        if config_name(config) == name:
            return config
    raise SystemExit(f"{op}: no config named {name}; known: "
                     f"{[config_name(c) for c in _template(op).all_configs()]}")


def _configs_to_time(op, args, n, dtype_name):
    """[None] (the heuristic's choice), [the forced config], or every valid config (of the fused
    fp32-residual signature with --residual-dtype float32)."""
    if args.sweep:
        sig = {"vec_bytes": row_vec_bytes(n, dtype_name), "dtype": dtype_name, "fp32_weight": False}
        if op == "rmsnorm_add":
            sig["fp32_residual"] = args.residual_dtype == "float32"
        return _template(op).valid_configs("sm90a", sig)
    return [_config_by_name(op, args.config) if args.config else None]


def _quack():
    try:
        from quack.rmsnorm import rmsnorm_fwd
    except Exception:  # not installed, or an incompatible version
        return None
    return rmsnorm_fwd


def _bench_shape(op, t, n, dtype, configs, torch, ops, do_bench, residual_dtype=None):
    import torch.nn.functional as F

    x = torch.randn(t, n, device="cuda", dtype=dtype)
    residual = torch.randn(t, n, device="cuda", dtype=residual_dtype or dtype)
    weight = torch.randn(n, device="cuda", dtype=dtype)
    # x in, y out; rmsnorm_add also residual in, new_residual out (in residual's dtype)
    row_bytes = 2 * x.element_size() + (0 if op == "rmsnorm" else 2 * residual.element_size())
    nbytes = t * n * row_bytes + n * weight.element_size()
    src = torch.empty(nbytes // 2 // x.element_size(), device="cuda", dtype=dtype).normal_()
    dst = torch.empty_like(src)

    def manual(h):
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).to(dtype)

    if op == "rmsnorm":
        torch_fns = {"F.rms_norm": lambda: F.rms_norm(x, (n,), weight, EPS), "manual": lambda: manual(x)}
    else:
        def add_then(norm):
            def run():
                h = x + residual        # fp32 with an fp32 residual (type promotion)
                return norm(h).to(dtype), h
            return run
        w_sum = weight.to(torch.promote_types(x.dtype, residual.dtype))   # cast once, not in the timed call
        torch_fns = {"F.rms_norm": add_then(lambda h: F.rms_norm(h, (n,), w_sum, EPS)),
                     "manual": add_then(manual)}
    quack = _quack()
    if quack is not None:
        res = None if op == "rmsnorm" else residual
        torch_fns["quack"] = lambda: quack(x, weight, residual=res, eps=EPS)

    def timed(fn):
        fn()  # compile / load / warm up outside the timed region
        torch.cuda.synchronize()
        return do_bench(fn, return_mode="median")

    base = {"copy": timed(lambda: dst.copy_(src))}
    for name, fn in torch_fns.items():
        if name != "quack":
            base[name] = timed(fn)
            continue
        try:   # quack refuses some shapes (its kernels compile per call): the row shows "-"
            base[name] = timed(fn)
        except Exception as e:
            print(f"quack at {t}x{n}: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}", file=sys.stderr)
    rows = []
    for config in configs:
        if op == "rmsnorm":
            fn = lambda: ops.rmsnorm(x, weight, EPS, config=config)  # noqa: E731
        else:
            fn = lambda: ops.rmsnorm_add(x, residual, weight, EPS, config=config)  # noqa: E731
        ms = timed(fn)
        rows.append({"op": op, "T": t, "N": n, "dtype": str(dtype).removeprefix("torch."),
                     "residual_dtype": str(residual.dtype).removeprefix("torch.") if op == "rmsnorm_add" else None,
                     "config": config or _chosen(op, (x, residual, weight, EPS) if op == "rmsnorm_add" else (x, weight, EPS)),
                     "ms": ms,
                     "bytes": nbytes,
                     "gbps": nbytes / ms * 1e-6, "copy_gbps": nbytes / base["copy"] * 1e-6,
                     "pct_copy": 100.0 * base["copy"] / ms,
                     "baseline_ms": base, "speedup": {k: v / ms for k, v in base.items() if k != "copy"}})
    return rows


def _chosen(op, args):
    """The config the op itself picks for ``args``: its declaration's prepare, run with a select
    that records the choice and launches nothing (so the op's own signature rules decide, not
    a copy of them)."""
    import torch

    from mslk_dsl import device
    from mslk_dsl.ops import declaration

    decl = declaration.get(op)
    chosen = []

    def select(signature, problem):
        _, config, _ = decl.kernels.choose(device.current_target().name, signature, problem, None)
        chosen.append(config)
        return None, config

    outputs = [torch.empty(shape, dtype=dtype, device=args[0].device) for shape, dtype in decl.outputs(*args)]
    decl.prepare(select, outputs, *args)
    return chosen[-1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=("rmsnorm", "rmsnorm_add", "all"), default="all")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--shapes", help="comma-separated TxN list (default: %(default)s)",
                        default=",".join(f"{t}x{n}" for t, n in SHAPES))
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--config", help="force this config (by name) for every shape")
    group.add_argument("--sweep", action="store_true", help="time every valid config")
    parser.add_argument("--residual-dtype", choices=("float32",),
                        help="rmsnorm_add with a residual stream of this dtype (x stays --dtype)")
    found = parse_with_gpu(parser, argv, "bench_norm")
    if found is None:
        return 2
    args, torch, do_bench = found

    from mslk_dsl import ops

    dtype = getattr(torch, args.dtype)
    shapes = parse_shapes(args.shapes)
    op_names = ("rmsnorm", "rmsnorm_add") if args.op == "all" else (args.op,)
    residual_dtype = getattr(torch, args.residual_dtype) if args.residual_dtype else None
    if residual_dtype is not None:
        if args.op != "rmsnorm_add":
            parser.error("--residual-dtype goes with --op rmsnorm_add")
    results = []
    for op in op_names:
        residual_note = f" (residual {args.residual_dtype})" if residual_dtype is not None else ""
        print(f"\n### {op} {args.dtype}{residual_note} on {torch.cuda.get_device_name()}\n")
        print("| T x N | config | ms | GB/s | copy GB/s | % copy | vs F.rms_norm | vs manual | vs quack |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for t, n in shapes:
            configs = _configs_to_time(op, args, n, args.dtype)
            for r in _bench_shape(op, t, n, dtype, configs, torch, ops, do_bench, residual_dtype):
                results.append(r)
                s = r["speedup"]
                quack = f"{s['quack']:.2f}x" if "quack" in s else "-"
                print(f"| {t}x{n} | {rowwise_label(r['config'])} | {r['ms']:.4f} | {r['gbps']:.0f} | "
                      f"{r['copy_gbps']:.0f} | {r['pct_copy']:.1f} | {s['F.rms_norm']:.2f}x | "
                      f"{s['manual']:.2f}x | {quack} |", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "device": torch.cuda.get_device_name()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
