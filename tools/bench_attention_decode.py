"""Benchmark decode attention (one query per sequence, GQA) against the copy roofline and peers.

For each batch B and KV length: q [B, 1, Hq, D], a contiguous cache k, v [B, KV, Hkv, D] and the
same cache paged (pages of --page keys in a random order, a block table per sequence), all
sequences at full length. The table gives our time, the KV bytes read per second (2 * B * KV *
Hkv * D * itemsize over the time) and that as a percentage of ``dst.copy_(src)`` moving the same
number of bytes in the same run ("% copy"), then the peers on the contiguous cache: torch SDPA
with each backend that serves the case (cuDNN, flash, efficient; enable_gqa, K/V not expanded)
and FlashAttention-4 (``flash_attn.cute.flash_attn_func``) where it is installed. Times are
medians of triton.testing.do_bench (CUDA events, L2 flushed between runs).

  python tools/bench_attention_decode.py [--batches 1,32,128] [--kv 4096,32768,131072]
      [--hq 32] [--hkv 4] [--d 128] [--page 64] [--splits N] [--peers sdpa,fa4] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import sys

from bench_common import cuda_or_exit, table


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


def _bench_case(torch, ops, timed, B, L, args) -> list[dict]:
    q = torch.randn(B, 1, args.hq, args.d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, L, args.hkv, args.d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    seqlen = torch.full((B,), L, dtype=torch.int32, device="cuda")
    nbytes = 2 * k.numel() * k.element_size()
    # The copy roofline: read + write of up to 8 GB (its bandwidth is flat past a few hundred MB).
    copy_bytes = min(nbytes, 8 << 30)
    src = torch.empty(copy_bytes // 4, device="cuda", dtype=torch.int16)
    dst = torch.empty_like(src)
    copy_tbps = copy_bytes / timed(lambda: dst.copy_(src)) * 1e-9
    src = dst = None
    base = {name: timed(fn) for name, fn in _peers(torch, q, k, v, args.peers.split(",")).items()}
    ours = {"contiguous": timed(lambda: ops.attention_decode(q, k, v, seqlen, None, None, True, args.splits))}
    kp, vp, tbl = _paged(torch, k, v, args.page)
    ours["paged"] = timed(lambda: ops.attention_decode(q, kp, vp, seqlen, tbl, None, True, args.splits))
    rows = []
    for layout, ms in ours.items():
        tbps = nbytes / ms * 1e-9
        row = {"B": B, "KV": L, "layout": layout, "splits": _splits(q, k if layout == "contiguous" else kp,
                                                                     None if layout == "contiguous" else tbl, args),
               "ms": ms, "TB/s": tbps, "copy TB/s": copy_tbps, "% copy": 100.0 * tbps / copy_tbps}
        for name, peer_ms in base.items():
            row[f"{name} TB/s"] = nbytes / peer_ms * 1e-9
        rows.append(row)
    return rows


def _splits(q, k, table, args) -> int:
    from mslk_dsl.ops.attention_decode import splits_for

    return splits_for(q, k, table, args.splits)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--kv", default="4096,32768,131072")
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=4)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--splits", type=int, default=0)
    p.add_argument("--peers", default="sdpa,fa4", help="comma-separated: sdpa, fa4")
    p.add_argument("--json")
    args = p.parse_args(argv)
    found = cuda_or_exit("bench_attention_decode")
    if found is None:
        return 0
    torch, do_bench = found
    from mslk_dsl import ops

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, return_mode="median")

    rows = []
    for B in (int(x) for x in args.batches.split(",")):
        for L in (int(x) for x in args.kv.split(",")):
            case = _bench_case(torch, ops, timed, B, L, args)
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
