"""Rows of 8- or 4-byte accesses: the cut-vector kernels against the one-element (phased) kernels.

  python tools/bench.py phased_rows [--ops OP,...] (--sizes ROWSxK,... | --random N --seed S)
                                    [--k-range LO,HI] [--rounds 3] [--warm-only] [--json PATH]

A 16-bit row of an even K that is not a multiple of 8 admits 8- or 4-byte accesses. The CuTe
kernels can run it two ways, and elementwise.PHASED_WORD_ROWS says which the op takes:
  cut          the 128-bit tiles with each vector cut into two or four accesses (vec_bytes 8 or 4);
  one-element  the one-element kernels, whose rows are congruent when every [M, K] tensor is at
               the same offset from a 16-byte boundary: each row's middle runs in 16-byte vectors
               and only its head and tail one element at a time ("Phased rows").
This times both on the same values, each with the op's heuristic pick: the cut side on 16-byte
aligned tensors with the op's routing switched off for its calls (PHASED_WORD_ROWS emptied), the
one-element side on tensors placed one element past a 16-byte boundary (outputs given with out=).
CUDA-graph replays, alternating rounds, medians; the outputs of the two sides are compared.
Sizes: --sizes, or --random N rows of even K in --k-range that is not a multiple of 8 (log-uniform),
each moving 32-512 MiB (log-uniform); bf16.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import random

from bench_common import parse_shapes

OPS = ("quantize_fp8_row", "silu_mul_quant", "silu_mul", "rmsnorm", "rmsnorm_add")
RANDOM_MIB = (32.0, 512.0)


def random_shapes(n: int, seed: int, k_range: tuple[int, int]) -> list[tuple[int, int]]:
    """``n`` (rows, K): K even, not a multiple of 8, log-uniform over ``k_range``; rows so that
    silu_mul moves a log-uniform 32-512 MiB (two bf16 inputs, one output)."""
    rng = random.Random(seed)
    low, high = k_range
    shapes = []
    while len(shapes) < n:
        k = int(math.exp(rng.uniform(math.log(low), math.log(high)))) // 2 * 2
        if k % 8 == 0 or not low <= k <= high:
            continue
        mib = math.exp(rng.uniform(*map(math.log, RANDOM_MIB)))
        shapes.append((max(1, int(mib * 2**20 / (3 * 2 * k))), k))
    return shapes


@contextlib.contextmanager
def routing_off():
    """The op layer's word-row routing switched off: rows of 8- or 4-byte accesses keep them. A
    launch plan replays the choice its layout got when it was made, so no plan serves the calls
    within (native ones bypassed, Python ones cleared) and none made within outlives them."""
    from mslk_dsl import native
    from mslk_dsl.ops import call, elementwise

    saved = dict(elementwise.PHASED_WORD_ROWS)
    with native.bypassed():
        call.clear_python_plans()
        elementwise.PHASED_WORD_ROWS.clear()
        try:
            yield
        finally:
            elementwise.PHASED_WORD_ROWS.update(saved)
            call.clear_python_plans()


def _shifted(torch, shape, dtype, values=None, device="cuda"):
    """A compact [M, K] tensor one element past a 16-byte boundary (``values`` copied in)."""
    buf = torch.empty(shape[0] * shape[1] + 16, dtype=dtype, device=device)
    t = buf[1:1 + shape[0] * shape[1]].view(shape)
    if values is not None:
        t.copy_(values)
    return t


def calls(op, rows, k, torch, ops, device="cuda"):
    """(cut call, one-element call, the [M, K] tensors of each side): the same values. The cut
    call is to be made under ``routing_off``."""
    bf, fp8 = torch.bfloat16, torch.float8_e4m3fn
    shape = (rows, k)

    def shifted(dtype, values=None):
        return _shifted(torch, shape, dtype, values, device)

    def pair():
        x = torch.randn(shape, dtype=bf, device=device)
        return x, shifted(bf, x)

    (x, xs), scale = pair(), torch.empty(rows, dtype=torch.float32, device=device)
    if op == "quantize_fp8_row":
        xq = shifted(fp8)
        return (lambda: ops.quantize_fp8_row(x), lambda: ops.quantize_fp8_row(xs, out=(xq, scale)),
                ((x,), (xs, xq)))
    if op in ("silu_mul", "silu_mul_quant"):
        b, bs = pair()
        if op == "silu_mul":
            out = shifted(bf)
            return lambda: ops.silu_mul(x, b), lambda: ops.silu_mul(xs, bs, out=out), ((x, b), (xs, bs, out))
        xq = shifted(fp8)
        return (lambda: ops.silu_mul_quant(x, b), lambda: ops.silu_mul_quant(xs, bs, out=(xq, scale)),
                ((x, b), (xs, bs, xq)))
    w = torch.randn(k, dtype=bf, device=device)
    if op == "rmsnorm":
        out = shifted(bf)
        return lambda: ops.rmsnorm(x, w, 1e-6), lambda: ops.rmsnorm(xs, w, 1e-6, out=out), ((x,), (xs, out))
    r, rs = pair()
    outs = (shifted(bf), shifted(bf))
    return (lambda: ops.rmsnorm_add(x, r, w, 1e-6), lambda: ops.rmsnorm_add(xs, rs, w, 1e-6, out=outs),
            ((x, r), (xs, rs, *outs)))


def _max_difference(a, b) -> float:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return max(float((p.float() - q.float()).abs().max()) for p, q in zip(a, b))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--sizes", help="ROWSxK,... (K even, not a multiple of 8)")
    parser.add_argument("--random", type=int, metavar="N", help="N drawn sizes instead of --sizes")
    parser.add_argument("--seed", type=int, default=0, help="the draw's seed (with --random; use a fresh one)")
    parser.add_argument("--k-range", default="1000,40000", help="LO,HI: the drawn K (with --random)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side (median)")
    parser.add_argument("--rep-ms", type=float, default=10.0)
    parser.add_argument("--warm-only", action="store_true", help="call each op once per size; time nothing")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    ops_wanted = [op for op in args.ops.split(",") if op]
    unknown = sorted(set(ops_wanted) - set(OPS))
    if unknown:
        parser.error(f"unknown op(s) {unknown}; choose from {list(OPS)}")
    if args.random:
        low, high = (int(v) for v in args.k_range.split(","))
        shapes = random_shapes(args.random, args.seed, (low, high))
    elif args.sizes:
        shapes = parse_shapes(args.sizes)
    else:
        parser.error("give --sizes or --random")
    bad = [k for _, k in shapes if k % 2 or k % 8 == 0]
    if bad:
        parser.error(f"K must be even and not a multiple of 8 (rows of 8- or 4-byte accesses): {bad}")

    import torch
    from bench_common import graph_timed
    from triton.testing import do_bench

    from mslk_dsl import ops
    from mslk_dsl.ops.validate import vector_bytes

    def timed(fn):
        return graph_timed(torch, lambda f: do_bench(f, warmup=5, rep=args.rep_ms, return_mode="median"), fn)

    def cut_side(call):
        def run():
            with routing_off():
                return call()
        return run

    results = []
    for op in ops_wanted:
        for rows, k in shapes:
            cut, one_element, tensors = calls(op, rows, k, torch, ops)
            cut = cut_side(cut)
            widths = (vector_bytes(*tensors[0]), vector_bytes(*tensors[1]))
            difference = _max_difference(cut(), one_element())
            torch.cuda.synchronize()
            if args.warm_only:
                continue
            cut_us, one_us = [], []
            for _ in range(args.rounds):
                cut_us.append(timed(cut) * 1e3)
                one_us.append(timed(one_element) * 1e3)
            cut_t, one_t = sorted(cut_us)[len(cut_us) // 2], sorted(one_us)[len(one_us) // 2]
            row = {"op": op, "rows": rows, "hidden": k, "vec_bytes": widths, "cut_us": cut_t,
                   "one_element_us": one_t, "one_element_over_cut": one_t / cut_t, "max_diff": difference}
            results.append(row)
            print(f"{op} {rows}x{k} vec {widths}: cut {cut_t:.1f} us, one-element {one_t:.1f} us, "
                  f"ratio {one_t / cut_t:.3f}, max diff {difference:.3g}", flush=True)
            torch.cuda.empty_cache()
    if args.json and results:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0
