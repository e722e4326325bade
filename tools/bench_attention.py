"""Benchmark attention prefill (attention_fwd) against torch SDPA's backends and FlashAttention-4.

For each case (B sequences of S rows, H heads, head dim D, causal or not; or packed sequences of
mixed lengths) the table gives TFLOP/s of mslk-dsl's kernel, of each torch SDPA backend that serves
the case (flash, cuDNN, efficient: torch.nn.attention.sdpa_kernel), and of FA4
(flash_attn.cute.flash_attn_func / flash_attn_varlen_func) when it is importable, then our
speedup over the best SDPA backend and over FA4. All on the same N(0, 1) bf16 data, in one run;
times are medians of triton.testing.do_bench over 100 ms of calls. FLOPs: 2 * B * H * S^2 * (D + Dv)
(halved for causal, as FA's benchmarks count), for packed sequences summed over the sequences.
A head dim "192x128" is q / k rows of 192 and v rows of 128 (DeepSeek's MLA prefill).

  python tools/bench.py attention [--heads 32] [--dims 64,96,128,192x128,256] [--shapes 16x1024,4x4096,1x16384]
                                  [--fa4-dims 128] [--sdpa flash,cudnn,efficient] [--sweep] [--json PATH]
--sweep also times every config of the template that serves each dense case (for tuning the
heuristic), one row per config.

``--random N --seed S`` replaces the fixed cases with N drawn dense prefill calls
(``random_cases``): sequence lengths log-uniform over 100..16384 (any integer), batches that
make 2k-64k query rows, 8-64 query heads with GQA ratios 1, 2, 4, 8 or MQA, the kernels' head
dims and (one draw in five) a head dim they run padded, causal or not. It prints the geometric
mean and minimum of the ratio to the best SDPA backend and to FA4 and the ten worst cases. SDPA
takes GQA with ``enable_gqa=True`` (a backend that refuses it shows its error). Use fresh seeds;
``--json docs/results/bench_attention_random.json`` feeds tools/plot_benchmarks.py's
``attention_random`` plot (ratios against sequence length).
"""
from __future__ import annotations

import argparse
import json
import random
import sys

from bench_common import geomean, parse_shapes, parse_with_gpu, table

SHAPES = ((16, 1024), (4, 4096), (1, 16384))
VARLEN_LENGTHS = (17, 1000, 4097, 2048, 513)


# Head dims of random_cases: the served pairs (prefill models' common ones weighted up) and, one
# draw in five, a head dim the op runs on zero-padded copies.
RANDOM_DIMS = ((128, 128),) * 4 + ((64, 64),) * 2 + ((96, 96), (192, 128), (192, 192), (256, 256))
RANDOM_PADDED_DIMS = ((80, 80), (112, 112), (72, 72), (160, 160), (128, 64))
RANDOM_SEQ = (100, 16384)
RANDOM_ROWS = (2048, 65536)


def random_cases(n: int, seed: int) -> list[dict]:
    """``n`` dense prefill calls: S log-uniform over RANDOM_SEQ, B so that B * S is log-uniform
    over RANDOM_ROWS (at least 1), Hq of 8-64 with Hkv = Hq / ratio for a ratio of 1, 2, 4, 8
    or Hq (MQA), head dims from RANDOM_DIMS or (one in five) RANDOM_PADDED_DIMS, causal or not."""
    from mslk_dsl.ops.random_problems import log_int

    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        S = log_int(rng, *RANDOM_SEQ)
        B = max(1, log_int(rng, *RANDOM_ROWS) // S)
        Hq = rng.choice((8, 16, 24, 32, 40, 48, 64))
        ratio = rng.choice([r for r in (1, 2, 4, 8, Hq) if Hq % r == 0])
        dims = rng.choice(RANDOM_PADDED_DIMS if rng.random() < 0.2 else RANDOM_DIMS)
        cases.append({"B": B, "S": S, "Hq": Hq, "Hkv": Hq // ratio, "D": dims[0], "Dv": dims[1],
                      "causal": rng.random() < 0.5})
    return cases


def _sdpa_backends(torch):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _fa4():
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception:  # not installed, or not for this GPU
        return None
    return flash_attn_func, flash_attn_varlen_func


def _time(do_bench, fn):
    try:
        fn()
        # 100 ms: a 16k-row call takes ~13 ms, and a median of three was seen 10-20% off.
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as e:  # a backend that does not serve the case
        return f"{type(e).__name__}"


def _head_dims(text: str) -> tuple[int, int]:
    """"128" -> (128, 128); "192x128" -> (192, 128): q / k's head dim, v's."""
    d, _, dv = text.partition("x")
    return int(d), int(dv or d)


def _dense_case(torch, do_bench, ops, fa4, B, S, H, dims, causal, with_fa4, sdpa, Hkv=None):
    """(FLOPs, times) of one dense call: B sequences of S rows, H query heads and Hkv key/value
    heads (GQA; H by default), head dims (D, Dv), on ours, each SDPA backend in ``sdpa`` (GQA
    through ``enable_gqa``) and FA4 when ``with_fa4``."""
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F

    D, Dv = dims
    Hkv = H if Hkv is None else Hkv
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, S, Hkv, Dv, device="cuda", dtype=torch.bfloat16)
    flops = 2 * B * H * S * S * (D + Dv) / (2 if causal else 1)
    times = {"mslk_dsl": _time(do_bench, lambda: ops.attention_fwd(q, k, v, causal=causal))}
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA's [B, H, S, D], as views
    for name, backend in _sdpa_backends(torch).items():
        if name not in sdpa:
            continue

        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=H != Hkv)
        times[f"sdpa_{name}"] = _time(do_bench, run)
    if fa4 is not None and with_fa4:
        times["fa4"] = _time(do_bench, lambda: fa4[0](q, k, v, causal=causal))
    return flops, times


def random_summary(rows: list[dict], worst: int = 10) -> list[str]:
    """Geometric mean and minimum of the ratio to the best SDPA backend and to FA4 over the
    rows that have one, then the ``worst`` cases by the SDPA ratio."""
    lines = []
    for col in ("vs_best_sdpa", "vs_fa4"):
        vals = [r[col] for r in rows if isinstance(r.get(col), float)]
        if vals:
            lines.append(f"{col}: geomean {geomean(vals):.3f}, min {min(vals):.3f}, below 1.0 at "
                         f"{sum(v < 1.0 for v in vals)} of {len(vals)}")
    ranked = sorted((r for r in rows if isinstance(r.get("vs_best_sdpa"), float)), key=lambda r: r["vs_best_sdpa"])
    lines += [f"  {r['case']}: {r['vs_best_sdpa']:.3f}x best SDPA, mslk_dsl {r['mslk_dsl']:.1f} TFLOP/s"
              for r in ranked[:worst]]
    return lines


def _sweep_rows(torch, do_bench, ops, B, S, H, D, causal):
    """One row per template config that serves the dense case (the heuristic's included)."""
    from mslk_dsl import registry
    from mslk_dsl.ops.attention import MASK_CAUSAL, MASK_NONE
    from mslk_dsl.template import config_name

    (t,) = registry.get_templates(op="attention_fwd", backend="cute")
    problem = {"mask": MASK_CAUSAL if causal else MASK_NONE, "varlen": 0}
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    rows = []
    default_out = ops.attention_fwd(q, k, v, causal=causal)[0].float()
    for config in t.valid_configs("sm90a", {"dtype": "bfloat16", "head_dim": D, "head_dim_v": D}):
        if t.serves(config, problem):
            ms = _time(do_bench, lambda: ops.attention_fwd(q, k, v, causal=causal, config=config))
            # A tuning candidate must agree with the default kernel (same math, other tiling).
            diff = (ops.attention_fwd(q, k, v, causal=causal, config=config)[0].float() - default_out).abs().max()
            rows.append({"case": f"B{B} S{S} H{H} D{D}{' causal' if causal else ''}", "config": config_name(config),
                         "mslk_dsl": flops / ms / 1e9 if isinstance(ms, float) else ms,
                         "max_diff_vs_default": diff.item()})
            print(rows[-1], flush=True)
    return rows


def _varlen_case(torch, do_bench, ops, fa4, H, D, n, seed):
    rng = random.Random(seed)
    lengths = [rng.choice(VARLEN_LENGTHS) for _ in range(n)]
    starts = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    total = sum(lengths)
    q, k, v = (torch.randn(1, total, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = sum(4 * H * m * m * D / 2 for m in lengths)
    times = {"mslk_dsl": _time(do_bench, lambda: ops.attention_fwd(
        q, k, v, starts, starts, max(lengths), max(lengths), causal=True, bottom_right=True))}
    if fa4 is not None:
        times["fa4"] = _time(do_bench, lambda: fa4[1](q[0], k[0], v[0], cu_seqlens_q=starts, cu_seqlens_k=starts,
                                                      max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
                                                      causal=True))
    return flops, times, lengths


def _row(label, flops, times):
    row = {"case": label}
    for name, t in times.items():
        row[name] = flops / t / 1e9 if isinstance(t, float) else t
    best_sdpa = max((row[n] for n in row if n.startswith("sdpa_") and isinstance(row[n], float)), default=None)
    ours = row["mslk_dsl"]
    row["vs_best_sdpa"] = ours / best_sdpa if isinstance(ours, float) and best_sdpa else "-"
    row["vs_fa4"] = ours / row["fa4"] if isinstance(ours, float) and isinstance(row.get("fa4"), float) else "-"
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--shapes", default=",".join(f"{b}x{s}" for b, s in SHAPES))
    parser.add_argument("--fa4-dims", default="64,128,256",
                        help="head dims to time FA4 at (it compiles each variant on first use)")
    parser.add_argument("--sdpa", default="flash,cudnn,efficient",
                        help="torch SDPA backends to time (cuDNN is the fastest on the H200)")
    parser.add_argument("--sweep", action="store_true", help="also time every config serving each dense case")
    parser.add_argument("--random", type=int, metavar="N", help="N drawn dense prefill calls instead of the cases")
    parser.add_argument("--seed", type=int, default=0, help="the draw's seed (with --random; use a fresh one)")
    found = parse_with_gpu(parser, argv, "bench attention")
    if found is None:
        return 1
    args, torch, do_bench = found
    from mslk_dsl import ops

    fa4 = _fa4()
    fa4_dims = {int(d) for d in args.fa4_dims.split(",") if d}
    cols = ["case", "mslk_dsl", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "fa4", "vs_best_sdpa", "vs_fa4"]
    rows, sweep = [], []
    for case in random_cases(args.random, args.seed) if args.random else ():
        torch.manual_seed(0)
        dims = (case["D"], case["Dv"])
        flops, times = _dense_case(torch, do_bench, ops, fa4, case["B"], case["S"], case["Hq"], dims,
                                   case["causal"], True, args.sdpa.split(","), Hkv=case["Hkv"])
        label = (f"B{case['B']} S{case['S']} H{case['Hq']}/{case['Hkv']} D{case['D']}"
                 f"{'' if case['Dv'] == case['D'] else 'x' + str(case['Dv'])}{' causal' if case['causal'] else ''}")
        rows.append({**_row(label, flops, times), "draw": case})
        print(rows[-1], flush=True)
    for text in args.dims.split(",") if not args.random else ():
        dims = _head_dims(text)
        for B, S in parse_shapes(args.shapes):
            for causal in (False, True):
                torch.manual_seed(0)
                flops, times = _dense_case(torch, do_bench, ops, fa4, B, S, args.heads, dims, causal,
                                           dims[0] in fa4_dims, args.sdpa.split(","))
                rows.append(_row(f"B{B} S{S} H{args.heads} D{text}{' causal' if causal else ''}", flops, times))
                print(rows[-1], flush=True)
                if args.sweep and dims[0] == dims[1]:
                    sweep += _sweep_rows(torch, do_bench, ops, B, S, args.heads, dims[0], causal)
    if not args.random:
        flops, times, lengths = _varlen_case(torch, do_bench, ops, fa4, args.heads, 128, 24, seed=0)
        rows.append(_row(f"packed {len(lengths)} seqs ({sum(lengths)} rows) H{args.heads} D128 causal", flops, times))
    for r in rows:
        for c in cols:
            r.setdefault(c, "-")
    print(f"TFLOP/s, bf16, {torch.cuda.get_device_name()}" + (f", seed {args.seed}" if args.random else ""))
    table(rows, cols)
    if args.random:
        print("\n".join(random_summary(rows)))
    if sweep:
        print("Configs (TFLOP/s):")
        table(sweep, ["case", "config", "mslk_dsl", "max_diff_vs_default"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": rows, "sweep": sweep, "seed": args.seed if args.random else None,
                       "device": torch.cuda.get_device_name()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
