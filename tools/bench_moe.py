"""Benchmark the MoE routing ops against torch on the same N(0, 1) data.

  gather_scale_dense_tokens  bandwidth (read A*D + write A*D elements) vs y.copy_(x) of an [A, D]
                             tensor (the copy roofline), A = T * top_k rows; time vs the eager
                             composite (index_select, multiply by the gathered scores in fp32)
  scatter_add_dense_tokens   bandwidth (read A*D of y, read + write T*D of out) vs the same copy,
                             per method (heuristic, atomic, sorted), and time vs out.index_add_;
                             also a.add_(b) on [T, D] (scatter's access mix at top_k 1)
  index_shuffling            time vs the composite torch.topk + argsort (+ bincount for counts)

Rows are routed as in a model: token_indices / expert_indices come from index_shuffling on
sigmoid(N(0, 1)) scores, so rows are read (gather) or accumulated (scatter) in expert order.
Times are medians of triton.testing.do_bench (CUDA events).

  python tools/bench_moe.py [--op gather|scatter|index_shuffling|all] [--quick]
                            [--dtype bfloat16|float16|float32] [--json PATH]
"""
from __future__ import annotations

import argparse
import sys

from bench_common import geomean, parse_with_gpu, save_json, table

# (T tokens, top_k, D hidden): A = T * top_k rows of D elements.
ROW_SHAPES = ((65536, 1, 5120), (16384, 4, 5120), (8192, 8, 7168), (8192, 8, 8192), (1024, 8, 5120))
QUICK_ROW_SHAPES = ((16384, 4, 5120),)
# Scatter adds the issue's T x hidden sizes at top_k 1 and 8, to place the methods' crossover.
SCATTER_SHAPES = ((65536, 1, 5120), (65536, 4, 5120), (65536, 8, 5120), (16384, 1, 8192), (16384, 4, 5120),
                  (16384, 8, 8192), (8192, 8, 7168), (1024, 1, 8192), (1024, 8, 8192), (1024, 8, 5120),
                  (128, 8, 5120))
# (T, E, top_k)
ROUTE_SHAPES = ((16384, 128, 1), (16384, 128, 4), (16384, 128, 8), (16384, 16, 1), (16384, 256, 8),
                (65536, 128, 8), (1024, 128, 8), (128, 16, 2))
QUICK_ROUTE_SHAPES = ((16384, 128, 1), (16384, 128, 8))


def _routing(torch, ops, t, e, k):
    scores = torch.sigmoid(torch.randn(t, e, device="cuda"))
    _, exp_idx, tok_idx = ops.index_shuffling(scores, top_k=k)
    return scores, tok_idx, exp_idx


def _copy_gbps(torch, do_bench, rows, d, dtype):
    src = torch.randn(rows, d, device="cuda").to(dtype)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / ms * 1e-6


def bench_gather(torch, ops, do_bench, t, k, d, dtype):
    scores, tok, exp = _routing(torch, ops, t, 16, k)
    x = torch.randn(t, d, device="cuda").to(dtype)
    ops.gather_scale_dense_tokens(x, tok, exp, scores)
    torch.cuda.synchronize()
    ms = do_bench(lambda: ops.gather_scale_dense_tokens(x, tok, exp, scores), return_mode="median")
    tok_long, exp_long = tok.long(), exp.long()
    eager_ms = do_bench(lambda: (x.index_select(0, tok_long).float()
                                 * scores[tok_long, exp_long].float()[:, None]).to(dtype), return_mode="median")
    rows = t * k
    gbps = 2 * rows * d * x.element_size() / ms * 1e-6
    copy = _copy_gbps(torch, do_bench, rows, d, dtype)
    return {"op": "gather_scale_dense_tokens", "T": t, "top_k": k, "D": d, "dtype": str(dtype)[6:],
            "ms": ms, "GB/s": gbps, "copy GB/s": copy, "fraction of copy": gbps / copy,
            "eager ms": eager_ms, "speedup vs eager": eager_ms / ms}


def bench_scatter(torch, ops, do_bench, t, k, d, dtype):
    """One row per method: the heuristic's choice, then each method forced (same unroll)."""
    from mslk_dsl import registry

    _, tok, _ = _routing(torch, ops, t, 16, k)
    y = torch.randn(t * k, d, device="cuda").to(dtype)
    out = torch.randn(t, d, device="cuda").to(dtype)
    (tpl,) = registry.get_templates(op="scatter_add_dense_tokens", backend="cute")
    sig = {"dtype": str(dtype)[6:], "vec_bytes": 16, "has_valid_count": False}
    chosen = tpl.heuristic("sm90a", sig, {"A": t * k, "D": d, "T": t})
    # Each method with the unroll the heuristic gives it (a width that forces the method).
    forced = {"atomic": tpl.heuristic("sm90a", sig, {"A": t * k, "D": 1, "T": t}),
              "sorted": tpl.heuristic("sm90a", sig, {"A": t * k, "D": 1 << 40, "T": t})}
    tok_long = tok.long()
    eager_ms = do_bench(lambda: out.index_add_(0, tok_long, y), return_mode="median")
    copy = _copy_gbps(torch, do_bench, t * k, d, dtype)
    # A second roofline with scatter's access mix (two read streams, one write): in-place add.
    a2, b2 = torch.randn(t, d, device="cuda").to(dtype), torch.randn(t, d, device="cuda").to(dtype)
    add_gbps = 3 * a2.numel() * a2.element_size() / do_bench(lambda: a2.add_(b2), return_mode="median") * 1e-6
    rows = []
    for label, config in ((f"heuristic ({chosen['method']})", None),
                          ("atomic", forced["atomic"]), ("sorted", forced["sorted"])):
        ops.scatter_add_dense_tokens(out, y, tok, config=config)
        torch.cuda.synchronize()
        ms = do_bench(lambda: ops.scatter_add_dense_tokens(out, y, tok, config=config), return_mode="median")
        gbps = (t * k + 2 * t) * d * y.element_size() / ms * 1e-6
        rows.append({"op": "scatter_add_dense_tokens", "method": label, "T": t, "top_k": k, "D": d,
                     "dtype": str(dtype)[6:], "ms": ms, "GB/s": gbps, "copy GB/s": copy,
                     "fraction of copy": gbps / copy, "add_ GB/s": add_gbps, "eager index_add_ ms": eager_ms,
                     "speedup vs eager": eager_ms / ms})
    return rows


def scatter_unroll_sweep(torch, ops, do_bench, t, k, d, dtype):
    """The sorted method at every unroll, to check the heuristic's choice at one shape."""
    _, tok, _ = _routing(torch, ops, t, 16, k)
    y = torch.randn(t * k, d, device="cuda").to(dtype)
    out = torch.randn(t, d, device="cuda").to(dtype)
    rows = []
    for unroll in (1, 2, 4, 8):
        config = {"unroll": unroll, "method": "sorted"}
        ops.scatter_add_dense_tokens(out, y, tok, config=config)
        ms = do_bench(lambda: ops.scatter_add_dense_tokens(out, y, tok, config=config), return_mode="median")
        rows.append({"op": "scatter_add_dense_tokens sweep", "T": t, "top_k": k, "D": d, "unroll": unroll,
                     "ms": ms, "GB/s": (t * k + 2 * t) * d * y.element_size() / ms * 1e-6})
    return rows


def bench_index_shuffling(torch, ops, do_bench, t, e, k):
    scores = torch.randn(t, e, device="cuda").to(torch.bfloat16)

    def composite():
        top = torch.topk(scores, k, dim=1).indices.flatten()
        order = torch.argsort(top, stable=True)
        return torch.bincount(top, minlength=e), top[order], order // k

    ops.index_shuffling(scores, top_k=k)
    torch.cuda.synchronize()
    ms = do_bench(lambda: ops.index_shuffling(scores, top_k=k), return_mode="median")
    torch_ms = do_bench(composite, return_mode="median")
    return {"op": "index_shuffling", "T": t, "E": e, "top_k": k, "ms": ms, "torch ms": torch_ms,
            "speedup": torch_ms / ms}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=("gather", "scatter", "index_shuffling", "all"), default="all")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="one or two shapes per op")
    found = parse_with_gpu(parser, argv, "bench_moe")
    if found is None:
        return 2
    args, torch, do_bench = found

    from mslk_dsl import ops

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    row_shapes = QUICK_ROW_SHAPES if args.quick else ROW_SHAPES
    route_shapes = QUICK_ROUTE_SHAPES if args.quick else ROUTE_SHAPES
    results = []
    print(f"\nMoE routing ops on {torch.cuda.get_device_name()}")
    if args.op in ("gather", "all"):
        rows = [bench_gather(torch, ops, do_bench, t, k, d, dtype) for t, k, d in row_shapes]
        print(f"\n### gather_scale_dense_tokens ({args.dtype})\n")
        table(rows, ["T", "top_k", "D", "ms", "GB/s", "copy GB/s", "fraction of copy", "eager ms",
                     "speedup vs eager"])
        results += rows
    if args.op in ("scatter", "all"):
        shapes = QUICK_ROW_SHAPES if args.quick else SCATTER_SHAPES
        rows = [r for t, k, d in shapes for r in bench_scatter(torch, ops, do_bench, t, k, d, dtype)]
        print(f"\n### scatter_add_dense_tokens ({args.dtype}) vs out.index_add_(0, token_indices, y)\n")
        table(rows, ["T", "top_k", "D", "method", "ms", "GB/s", "copy GB/s", "fraction of copy", "add_ GB/s",
                      "eager index_add_ ms", "speedup vs eager"])
        results += rows
        if not args.quick:
            sweep = [r for t, k, d in ((65536, 1, 5120), (65536, 8, 5120))
                     for r in scatter_unroll_sweep(torch, ops, do_bench, t, k, d, dtype)]
            print("\n#### sorted scatter, every unroll\n")
            table(sweep, ["T", "top_k", "D", "unroll", "ms", "GB/s"])
            results += sweep
    if args.op in ("index_shuffling", "all"):
        rows = [bench_index_shuffling(torch, ops, do_bench, t, e, k) for t, e, k in route_shapes]
        print("\n### index_shuffling (bf16 scores) vs torch.topk + argsort + bincount\n")
        table(rows, ["T", "E", "top_k", "ms", "torch ms", "speedup"])
        geo = geomean(r["speedup"] for r in rows)
        print(f"\ngeometric mean speedup: {geo:.2f}x")
        results += rows
    save_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
