"""Benchmark the MoE layer (mslk_dsl.moe.MoE, bf16 and FP8 row-wise) against torch pipelines of
the same layer on the same data, and gather_scale_quant_dense_tokens against the copy roofline.

Layer pipelines (no shared expert, sigmoid router, top-k, SwiGLU experts; ms per layer):
  mslk_dsl  the layer: index_shuffling -> gather_scale_dense_tokens (FP8: gather_scale_quant_dense_
            tokens) -> grouped gate, grouped up -> silu_mul (silu_mul_quant) -> grouped down ->
            scatter_add_dense_tokens; mslk_dsl's grouped GEMMs
  torch     routing by topk (ties to the lower expert) + stable argsort (counts by index_add_, no host sync), index_select
            gather times the scores, torch._grouped_mm over the concatenated gate|up weights (FP8:
            rows quantized in torch, torch._scaled_grouped_mm), F.silu(gate) * up, grouped down,
            index_add_ scatter
  mixed     mslk_dsl's routing, gather(_quant), silu_mul(_quant) and scatter around torch's grouped
            GEMMs (gate and up as two GEMMs, as the layer)
Configs: DeepSeek-V3-like (E 128, top-8, D 7168, H 2048), Llama-4-Scout-like (E 16, top-1, D 5120,
H 8192), Mixtral-like (E 8, top-2, D 4096, H 14336), each at its prefill T (4096 / 8192 / 4096)
and at decode T in {1, 16, 128}. Times are medians of triton.testing.do_bench (CUDA events) of
eager calls; --graph also times each pipeline replayed from a CUDA graph (launch costs gone).

gather_scale_quant_dense_tokens: bandwidth (read A*D bf16, write A*D FP8 + A scales) against
y.copy_(x) of A x D bf16 (the copy roofline, 2 bytes each way), and time against the torch
composite (index_select, score multiply, absmax, divide, FP8 cast).

  python tools/bench_moe_layer.py [--config deepseek|llama4|mixtral|all] [--decode-only] [--graph]
                                  [--skip-gather | --gather-only] [--json PATH]
"""
from __future__ import annotations

import argparse
import sys

from bench_common import geomean, parse_with_gpu, save_json, table

# name: (E, top_k, D, H, prefill T)
CONFIGS = {"deepseek": (128, 8, 7168, 2048, 4096), "llama4": (16, 1, 5120, 8192, 8192),
           "mixtral": (8, 2, 4096, 14336, 4096)}
DECODE_T = (1, 16, 128)
FP8_MAX = 448.0


def _offsets(torch, counts):
    return torch.cumsum(counts, 0, dtype=torch.int32)


def _quantize_rows(torch, x):
    """Row-wise FP8 in torch ops (quantize_fp8_row's arithmetic)."""
    amax = x.float().abs().amax(dim=1).clamp(min=1 / 512)
    scale = amax / FP8_MAX
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class Pipelines:
    """The three pipelines over one layer's weights (bf16, and their FP8 row-wise copies)."""

    def __init__(self, torch, ops, layer, fp8: bool):
        self.torch, self.ops, self.layer, self.fp8 = torch, ops, layer, fp8
        self.E, self.K, self.H = layer.num_experts, layer.top_k, layer.hidden_dim
        w_gate, w_up, w_down = layer.w_gate, layer.w_up, layer.w_down
        w13 = torch.cat([w_gate, w_up], dim=1)            # [E, 2H, D]: torch's one gate|up GEMM
        if fp8:
            self.w13q, self.w13s = ops.quantize_fp8_row(w13)
            self.gq, self.gs = ops.quantize_fp8_row(w_gate)
            self.uq, self.us = ops.quantize_fp8_row(w_up)
            self.dq, self.ds = ops.quantize_fp8_row(w_down)
        else:
            self.w13, self.w_gate, self.w_up, self.w_down = w13, w_gate, w_up, w_down

    def scores(self, tokens):
        return self.torch.sigmoid(tokens @ self.layer.router)

    # -- torch --------------------------------------------------------------------------------
    def torch_pipeline(self, tokens):
        torch, F = self.torch, self.torch.nn.functional
        scores = self.scores(tokens)
        # Ties (frequent among bf16 sigmoid scores) to the lower expert, as index_shuffling, so
        # that the pipelines route alike and their outputs can be compared: top-k of exact integer
        # keys (the bits of a positive bf16 order as its value), then the expert, reversed.
        lower_first = self.E - 1 - torch.arange(self.E, device=tokens.device, dtype=torch.int32)
        keys = scores.view(torch.int16).to(torch.int32) * self.E + lower_first
        top_i = torch.topk(keys, self.K, dim=1).indices
        top_v = scores.gather(1, top_i)
        flat = top_i.flatten()
        order = torch.argsort(flat, stable=True)
        tok = order // self.K
        counts = torch.zeros(self.E, dtype=torch.int32, device=tokens.device).index_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = _offsets(torch, counts)
        rows = (tokens.index_select(0, tok).float() * top_v.flatten()[order].float()[:, None]).to(tokens.dtype)
        if self.fp8:
            xq, xs = _quantize_rows(torch, rows)
            y = torch._scaled_grouped_mm(xq, self.w13q.transpose(1, 2), xs, self.w13s, offs=offs,
                                         out_dtype=torch.bfloat16)
            z = F.silu(y[:, : self.H]) * y[:, self.H:]
            zq, zs = _quantize_rows(torch, z)
            out_rows = torch._scaled_grouped_mm(zq, self.dq.transpose(1, 2), zs, self.ds, offs=offs,
                                                out_dtype=torch.bfloat16)
        else:
            y = torch._grouped_mm(rows, self.w13.transpose(1, 2), offs=offs)
            z = F.silu(y[:, : self.H]) * y[:, self.H:]
            out_rows = torch._grouped_mm(z, self.w_down.transpose(1, 2), offs=offs)
        return torch.zeros_like(tokens).index_add_(0, tok, out_rows)

    # -- mslk_dsl ops around torch's grouped GEMMs ---------------------------------------------
    def mixed_pipeline(self, tokens):
        torch, ops = self.torch, self.ops
        scores = self.scores(tokens)
        counts, exp, tok = ops.index_shuffling(scores, top_k=self.K)
        offs = _offsets(torch, counts[: self.E])
        if self.fp8:
            xq, xs = ops.gather_scale_quant_dense_tokens(tokens, tok, exp, scores)

            def gemm(a, a_scale, wq, w_scale):
                return torch._scaled_grouped_mm(a, wq.transpose(1, 2), a_scale, w_scale, offs=offs,
                                                out_dtype=torch.bfloat16)

            zq, zs = ops.silu_mul_quant(gemm(xq, xs, self.gq, self.gs), gemm(xq, xs, self.uq, self.us))
            out_rows = gemm(zq, zs, self.dq, self.ds)
        else:
            rows = ops.gather_scale_dense_tokens(tokens, tok, exp, scores)

            def gemm(a, w):
                return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)

            out_rows = gemm(ops.silu_mul(gemm(rows, self.w_gate), gemm(rows, self.w_up)), self.w_down)
        out = torch.zeros_like(tokens)
        ops.scatter_add_dense_tokens(out, out_rows, tok)
        return out


def _graphed(torch, fn, x):
    """fn(x) captured in a CUDA graph (after a warm-up on a side stream); returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x)
    return graph.replay


def bench_layer(torch, ops, do_bench, name, t, fp8, graph, have_grouped):
    from mslk_dsl.moe import MoE

    E, K, D, H, _ = CONFIGS[name]
    torch.manual_seed(0)
    layer = MoE(D, H, num_experts=E, top_k=K, shared_expert=False, device="cuda")
    x = torch.randn(t, D, device="cuda").to(torch.bfloat16)
    pipes = Pipelines(torch, ops, layer, fp8)
    if fp8:
        layer.quantize_fp8_rowwise_()
    fns = {"torch": pipes.torch_pipeline, "mixed": pipes.mixed_pipeline}
    if have_grouped:
        fns["mslk_dsl"] = layer
    row = {"config": name, "T": t, "precision": "fp8" if fp8 else "bf16"}
    outs = {}
    for label, fn in fns.items():
        outs[label] = fn(x)
        torch.cuda.synchronize()
        row[f"{label} ms"] = do_bench(lambda: fn(x), return_mode="median")
        if graph:
            replay = _graphed(torch, fn, x)
            row[f"{label} graph ms"] = do_bench(replay, return_mode="median")
    ref = outs["torch"].float()
    for label in fns:   # the pipelines compute the same layer: a wiring error shows here
        row[f"{label} rel err"] = float((outs[label].float() - ref).norm() / ref.norm())
    flops = 2 * t * K * D * H * 3
    for label in fns:
        row[f"{label} TFLOP/s"] = flops / row[f"{label} ms"] * 1e-9
    if have_grouped:
        row["vs torch"] = row["torch ms"] / row["mslk_dsl ms"]
        row["vs mixed"] = row["mixed ms"] / row["mslk_dsl ms"]
    del layer, pipes
    torch.cuda.empty_cache()
    return row


def bench_gather_quant(torch, ops, do_bench, t, k, d, e):
    scores = torch.sigmoid(torch.randn(t, e, device="cuda")).to(torch.bfloat16)
    _, exp, tok = ops.index_shuffling(scores, top_k=k)
    x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
    ops.gather_scale_quant_dense_tokens(x, tok, exp, scores)
    torch.cuda.synchronize()
    ms = do_bench(lambda: ops.gather_scale_quant_dense_tokens(x, tok, exp, scores), return_mode="median")
    tok_l, exp_l = tok.long(), exp.long()

    def composite():
        rows = (x.index_select(0, tok_l).float() * scores[tok_l, exp_l].float()[:, None]).to(x.dtype)
        return _quantize_rows(torch, rows)

    torch_ms = do_bench(composite, return_mode="median")
    a = t * k
    src = torch.randn(a, d, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() * 2 / do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-6
    gbps = (a * d * 3 + a * 4) / ms * 1e-6
    return {"op": "gather_scale_quant_dense_tokens", "T": t, "top_k": k, "D": d, "ms": ms, "GB/s": gbps,
            "copy GB/s": copy_gbps, "fraction of copy": gbps / copy_gbps, "torch ms": torch_ms,
            "speedup vs torch": torch_ms / ms}


def _grouped_ops_registered(torch) -> bool:
    return all(hasattr(torch.ops.mslk_dsl, n) for n in ("bf16bf16bf16_grouped_stacked",
                                                         "f8f8bf16_rowwise_grouped_stacked"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=(*CONFIGS, "all"), default="all")
    parser.add_argument("--decode-only", action="store_true", help="T in {1, 16, 128} only")
    parser.add_argument("--graph", action="store_true", help="also time CUDA-graph replays")
    parser.add_argument("--skip-gather", action="store_true", help="no gather_scale_quant rows")
    parser.add_argument("--gather-only", action="store_true", help="only the gather_scale_quant rows")
    found = parse_with_gpu(parser, argv, "bench_moe_layer")
    if found is None:
        return 2
    args, torch, do_bench = found
    from mslk_dsl import ops

    results = []
    names = list(CONFIGS) if args.config == "all" else [args.config]
    print(f"\nMoE layer on {torch.cuda.get_device_name()}")
    if not args.skip_gather:
        rows = [bench_gather_quant(torch, ops, do_bench, CONFIGS[n][4], CONFIGS[n][1], CONFIGS[n][2], CONFIGS[n][0])
                for n in names]
        rows.append(bench_gather_quant(torch, ops, do_bench, 128, 8, 7168, 128))
        print("\n### gather_scale_quant_dense_tokens (bf16 -> FP8 rows) vs copy and the torch composite\n")
        table(rows, ["T", "top_k", "D", "ms", "GB/s", "copy GB/s", "fraction of copy", "torch ms",
                     "speedup vs torch"])
        results += rows
    if args.gather_only:
        names = []
    have_grouped = _grouped_ops_registered(torch)
    if names and not have_grouped:
        print("\n(mslk_dsl's grouped GEMM ops are not registered: the layer itself is not timed)")
    labels = ["mslk_dsl", "torch", "mixed"] if have_grouped else ["torch", "mixed"]
    cols = ["config", "T", "precision"] + [f"{lb} ms" for lb in labels]
    cols += [f"{lb} graph ms" for lb in labels] if args.graph else []
    cols += ["vs torch", "vs mixed"] if have_grouped else []
    cols += [f"{lb} TFLOP/s" for lb in labels] + [f"{lb} rel err" for lb in labels if lb != "torch"]
    rows = []
    for name in names:
        ts = list(DECODE_T) + ([] if args.decode_only else [CONFIGS[name][4]])
        for t in ts:
            for fp8 in (False, True):
                rows.append(bench_layer(torch, ops, do_bench, name, t, fp8, args.graph, have_grouped))
    if rows:
        print("\n### MoE layer, ms per layer (no shared expert)\n")
        table(rows, cols)
    if have_grouped and rows:
        for precision, goal in (("bf16", 1.4), ("fp8", 2.0)):
            sel = [r["vs torch"] for r in rows if r["precision"] == precision]
            geo = geomean(sel)
            print(f"\n{precision}: geometric mean {geo:.2f}x the torch pipeline (goal {goal}x), "
                  f"min {min(sel):.2f}x")
    results += rows
    save_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
