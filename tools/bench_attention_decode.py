"""Benchmark decode attention (one query per sequence, GQA) against the copy roofline and peers.

For each batch B and KV length: q [B, 1, Hq, D], a contiguous cache k, v [B, KV, Hkv, D] and the
same cache paged (pages of --page keys in a random order, a block table per sequence), all
sequences at full length. The table gives our time, the KV bytes read per second (2 * B * KV *
Hkv * D * itemsize over the time) and that as a percentage of ``dst.copy_(src)`` moving the same
number of bytes in the same run ("% copy"), then the peers on the contiguous cache: torch SDPA
with each backend that serves the case (cuDNN, flash, efficient; enable_gqa, K/V not expanded)
and FlashAttention-4 (``flash_attn.cute.flash_attn_func``) where it is installed. Times are
medians of triton.testing.do_bench (CUDA events, L2 flushed between runs).

Two timings of each: eager (back-to-back calls from Python: the host's launch cost included,
which is what small cases are bound by) and graph (``graph ms``, ``graph TB/s``, ``graph % copy``:
GRAPH_CALLS calls captured in one CUDA graph and replayed, the time divided by the calls; what a
serving engine that replays graphs sees). The graphed calls rotate over copies of q/k/v enough
to keep a call's KV out of L2 when the next call of the same copy runs.

  python tools/bench_attention_decode.py [--batches 1,32,128] [--kv 4096,32768,131072]
      [--hq 32] [--hkv 4] [--d 128] [--page 64] [--splits N] [--config merge=kernel,stages=3]
      [--layouts contiguous,paged] [--peers sdpa,fa4 | none] [--json PATH]

--config forces the template config (its keys override the heuristic's: merge=kernel times the
decode kernel followed by the separate merge kernel); eager calls with a config take the checked
path, graph replays time the kernels alone either way.
"""
from __future__ import annotations

import argparse
import json
import sys

from bench_common import cuda_or_exit, table

GRAPH_CALLS = 16
L2_CLEAR_BYTES = 256 << 20  # a call's KV is read again only after this many bytes of other KV


def _graph_ms(torch, do_bench, make_call, copies: int) -> float | None:
    """Milliseconds per call of GRAPH_CALLS calls replayed from one CUDA graph; ``make_call(i)``
    gives the i-th copy's call. None where a call cannot be captured."""
    calls = [make_call(i % copies) for i in range(GRAPH_CALLS)]
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm up off the default stream, as capture requires
            for fn in calls[:copies]:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:
        print(f"graph capture failed: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
        return None
    return do_bench(graph.replay, return_mode="median") / GRAPH_CALLS


def _peers(torch, q, k, v, which):
    """name -> callable for every peer in ``which`` that runs this case (q [B, 1, Hq, D], k/v
    [B, L, Hkv, D])."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    fns = {}
    backends = (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)) if "sdpa" in which else ()
    for name, backend in backends:
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        try:
            run()
            torch.cuda.synchronize()
            fns[name] = run
        except Exception:  # the backend does not serve this case
            pass
    if "fa4" not in which:
        return fns
    try:
        from flash_attn.cute import flash_attn_func

        def fa4():
            return flash_attn_func(q, k, v, causal=True)
        fa4()
        torch.cuda.synchronize()
        fns["fa4"] = fa4
    except Exception as e:  # not installed, or it refuses the case
        print(f"FA4 not timed: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
    return fns


def _paged(torch, k, v, page):
    B, L, H, D = k.shape
    per_seq = -(-L // page)
    order = torch.randperm(B * per_seq, device="cuda")
    kp = torch.empty(B * per_seq, page, H, D, device="cuda", dtype=k.dtype)
    vp = torch.empty_like(kp)
    kp[order] = k.reshape(B * per_seq, page, H, D)
    vp[order] = v.reshape(B * per_seq, page, H, D)
    return kp, vp, order.reshape(B, per_seq).to(torch.int32)


def _bench_case(torch, ops, timed, do_bench, B, L, args) -> list[dict]:
    q = torch.randn(B, 1, args.hq, args.d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, L, args.hkv, args.d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    seqlen = torch.full((B,), L, dtype=torch.int32, device="cuda")
    nbytes = 2 * k.numel() * k.element_size()
    copies = min(GRAPH_CALLS, -(-L2_CLEAR_BYTES // nbytes))
    qkv = [(q, k, v)] + [(q.clone(), k.clone(), v.clone()) for _ in range(copies - 1)]
    # The copy roofline: read + write of up to 8 GB (its bandwidth is flat past a few hundred MB).
    copy_bytes = min(nbytes, 8 << 30)
    src = torch.empty(copy_bytes // 4, device="cuda", dtype=torch.int16)
    dst = torch.empty_like(src)
    copy_tbps = copy_bytes / timed(lambda: dst.copy_(src)) * 1e-9
    src = dst = None
    which = args.peers.split(",")
    peers = [_peers(torch, *qkv[i], which) for i in range(copies)]
    base = {name: timed(fn) for name, fn in peers[0].items()}
    base_graph = {name: _graph_ms(torch, do_bench, lambda i, name=name: peers[i][name], copies) for name in base}

    config = _config(args, {"B": B, "Mq": 1, "Hq": args.hq, "Hkv": args.hkv, "L": L})

    def decode(i):
        qi, ki, vi = qkv[i]
        return lambda: ops.attention_decode(qi, ki, vi, seqlen, None, None, True, args.splits, config=config)

    ours = {"contiguous": (timed(decode(0)), _graph_ms(torch, do_bench, decode, copies))}
    paged = [_paged(torch, ki, vi, args.page) for _, ki, vi in qkv] if "paged" in args.layouts.split(",") else []

    def decode_paged(i):
        kp, vp, tbl = paged[i]
        return lambda: ops.attention_decode(qkv[i][0], kp, vp, seqlen, tbl, None, True, args.splits,
                                            config=config)

    if "paged" in args.layouts.split(","):
        ours["paged"] = (timed(decode_paged(0)), _graph_ms(torch, do_bench, decode_paged, copies))
    rows = []
    for layout, (ms, graph_ms) in ours.items():
        tbps = nbytes / ms * 1e-9
        kc, table_ = (k, None) if layout == "contiguous" else (paged[0][0], paged[0][2])
        row = {"B": B, "KV": L, "layout": layout, "splits": _splits(q, kc, table_, args, config),
               "ms": ms, "TB/s": tbps, "copy TB/s": copy_tbps, "% copy": 100.0 * tbps / copy_tbps}
        if graph_ms is not None:
            row["graph ms"] = graph_ms
            row["graph TB/s"] = nbytes / graph_ms * 1e-9
            row["graph % copy"] = 100.0 * row["graph TB/s"] / copy_tbps
        for name, peer_ms in base.items():
            row[f"{name} TB/s"] = nbytes / peer_ms * 1e-9
            if base_graph[name] is not None:
                row[f"{name} graph TB/s"] = nbytes / base_graph[name] * 1e-9
        rows.append(row)
    return rows


def _config(args, problem: dict) -> dict | None:
    """The heuristic's config for this case (``problem``: its sizes) with --config's keys over
    it, or None."""
    if not args.config:
        return None
    from mslk_dsl.templates.attention_decode_cute import TEMPLATE

    config = TEMPLATE.heuristic("sm90a", {"dtype": "bfloat16", "head_dim": args.d}, problem)
    for item in args.config.split(","):
        key, value = item.split("=")
        config[key] = int(value) if value.isdigit() else value
    return config


def _splits(q, k, table, args, config) -> int:
    """The split count the op used: from the config it ran (without --config, the CuTe
    template's heuristic for the call's sizes)."""
    from mslk_dsl.ops.attention_decode import max_keys, splits_for
    from mslk_dsl.templates.attention_decode_cute import TEMPLATE

    if config is None:
        B, Mq, Hq, D = q.shape
        problem = {"B": B, "Mq": Mq, "Hq": Hq, "Hkv": k.shape[2], "L": max_keys(k, table)}
        config = TEMPLATE.heuristic("sm90a", {"dtype": "bfloat16", "head_dim": D}, problem)
    return splits_for(q, k, table, args.splits, config.get("merge") == "fused", config.get("warps", 4),
                      config.get("merge_loads", 0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--kv", default="4096,32768,131072")
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=4)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--splits", type=int, default=0)
    p.add_argument("--config", default="", help="template config keys, e.g. merge=kernel,stages=4")
    p.add_argument("--layouts", default="contiguous,paged", help="contiguous, paged or both")
    p.add_argument("--peers", default="sdpa,fa4", help="comma-separated: sdpa, fa4 (none: no peers)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    found = cuda_or_exit("bench_attention_decode")
    if found is None:
        return 0
    torch, do_bench = found
    from mslk_dsl import native, ops

    # Eager times are of the served path: the native launcher's plans once it is built.
    native.load_in_background()
    native.wait_until_loaded(timeout=90)

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, return_mode="median")

    rows = []
    for B in (int(x) for x in args.batches.split(",")):
        for L in (int(x) for x in args.kv.split(",")):
            case = _bench_case(torch, ops, timed, do_bench, B, L, args)
            for r in case:  # as it goes: a run cut short still reports what it measured
                print({c: round(x, 4) if isinstance(x, float) else x for c, x in r.items()}, flush=True)
            rows += case
            torch.cuda.empty_cache()
    cols = sorted({c for r in rows for c in r}, key=lambda c: list(rows[0]).index(c) if c in rows[0] else 99)
    for r in rows:
        for c in cols:
            r.setdefault(c, "-")
    print(f"decode, Hq {args.hq}, Hkv {args.hkv}, D {args.d}, bf16, page {args.page}")
    table(rows, cols)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
