"""The memory-bound sweep: every row-wise and MoE data-movement op against its best peer and the
copy roofline, over sizes from 4 MiB to 4 GiB moved.

  python tools/bench.py membound --sweep [--ops silu_mul,rmsnorm,...] [--peers liger,quack,eager,compile]
                                 [--dtype bfloat16|float16|float32] [--weight-dtype float32] [--residual-dtype float32]
                                 [--quick] [--warm-only] [--json PATH] [--sizes ROWSxHIDDEN,...]
                                 [--random N --seed S] [--configs [--configs-matching REGEX]]

For each op and hidden size the rows are chosen so that the op moves about 4, 16, 64, 256, 1024
and 4096 MiB (rows clamped to 1..131072); rmsnorm also runs rows of 64K, 128K and 256K elements.
Hidden sizes: 2880, 3584, 5120, 7168, 14336, 4000 (a multiple of 8, not of 64) and 4095 (rows
that are not a multiple of 16 bytes: the one-element-per-access path); the MoE ops 2880, 5120,
7168 and 4000. ``--weight-dtype float32`` gives the norms an fp32 weight beside 16-bit x (the
peers get the same weight); ``--residual-dtype float32`` gives rmsnorm_add an fp32 residual stream
beside 16-bit x (residual in and new residual out in fp32; quack's ``residual_dtype``). Bytes
moved count every input read and output written once (the weight and row scales included):

  silu_mul           x0, x1 in, out             quantize_fp8_row   x in, xq + scales out
  silu_mul_quant     x0, x1 in, xq + scales out rmsnorm            x in, y out
  rmsnorm_add        x, residual in, y, new_residual out (the residual's in its own dtype)
  gather k2          A = 2T rows of D gathered and scaled (read A D, write A D)
  gather_quant k2    the same, quantized to FP8 (read A D, write A D FP8 + A scales)
  scatter_add k1..8  A = kT rows added into T rows (read A D + T D, write T D)

"% copy" is the op's bytes / time over the bandwidth of ``dst.copy_(src)`` moving the same
bytes in the same run. Peers, where installed: Liger (liger-kernel: swiglu, rms_norm,
fused_add_rms_norm; Triton), quack (rmsnorm_fwd, with its residual form; CuTe DSL), torch eager
and torch.compile of the same composite (``--peers`` picks them; compile costs a compile per op
and shape family). The table gives ours and the best peer at each size; the JSON has every
timing. Times: medians of triton.testing.do_bench (CUDA events; L2 flushed between runs).
``--warm-only`` calls each op once per size and times nothing (for tools/prebuild_kernels.py).
``--sizes`` replaces the sweep's sizes; ``--random N --seed S`` replaces them with N drawn shapes
(``random_shapes``: hidden sizes log-uniform over 64..16384 in each class of access width, 16-,
8-, 4-byte vectors or one element, bytes moved log-uniform over 4 MiB..4 GiB; the same draw for
every op, whose rows follow from its bytes per row), and a summary per op closes the run (% of
copy and the ratio to the best peer: geometric mean, minimum, the worst shapes). ``--configs``
also times, at each size, every config of
the op's CuTe template for 128-bit rows whose tile is within 0.4-2.5x the row (row-wise ops; the
JSON's "configs" maps each config's name to its time).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys

from bench_common import graph_timed as graph_replay_timed, parse_shapes, parse_with_gpu, row_vec_bytes, rowwise_label, table

HIDDEN = (2880, 3584, 5120, 7168, 14336, 4000, 4095)
MOE_HIDDEN = (2880, 5120, 7168, 4000)
TARGET_MIB = (4, 16, 64, 256, 1024, 4096)
QUICK_MIB = (16, 256)
MAX_ROWS = 131072
LONG_ROWS = (65536, 131072, 262144)  # rmsnorm / rmsnorm_add hidden sizes past the old 16K limit
OPS = ("silu_mul", "quantize_fp8_row", "silu_mul_quant", "rmsnorm", "rmsnorm_add", "gather_k2",
       "scatter_add_k1", "scatter_add_k2", "scatter_add_k8")
EXTRA_OPS = ("gather_quant_k2",)   # with --ops only
EPS = 1e-6


def _liger(name):
    try:
        if name == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction
            return LigerSiLUMulFunction.apply
        if name == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            return LigerRMSNormFunction.apply
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        return LigerFusedAddRMSNormFunction.apply
    except Exception:  # not installed, or an incompatible version
        return None


def _quack():
    try:
        from quack.rmsnorm import rmsnorm_fwd
    except Exception:  # not installed, or an incompatible version
        return None
    return rmsnorm_fwd


class Case:
    """One op at one size: ``ours`` runs the op, ``peers`` maps a peer's name to its call."""

    def __init__(self, op, rows, hidden, nbytes, ours, peers):
        self.op, self.rows, self.hidden, self.nbytes, self.ours, self.peers = op, rows, hidden, nbytes, ours, peers


def _bytes_per_row(op, d, elem, residual_elem=None):
    """Bytes an op moves per row (per token T for the MoE ops); ``residual_elem``: the bytes of
    rmsnorm_add's residual elements where they differ from x's."""
    if op == "silu_mul":
        return 3 * d * elem
    if op == "quantize_fp8_row":
        return d * (elem + 1) + 4
    if op == "silu_mul_quant":
        return d * (2 * elem + 1) + 4
    if op == "rmsnorm":
        return 2 * d * elem
    if op == "rmsnorm_add":
        return 2 * d * (elem + (residual_elem or elem))
    k = int(op.rsplit("k", 1)[1])
    if op.startswith("gather_quant"):
        return k * (d * (elem + 1) + 4)
    if op.startswith("gather"):
        return 2 * k * d * elem
    return (k + 2) * d * elem


def _make_case(op, rows, d, dtype, peers_wanted, torch, ops, weight_dtype=None, residual_dtype=None):
    """Inputs and calls of ``op`` at [rows, d] (rows = tokens for the MoE ops); the norms' weight
    in ``weight_dtype`` and rmsnorm_add's residual in ``residual_dtype`` (x's dtype by default)."""
    import torch.nn.functional as F

    elem = torch.tensor([], dtype=dtype).element_size()
    weight_dtype = weight_dtype or dtype
    residual_dtype = residual_dtype or dtype
    weight_elem = torch.tensor([], dtype=weight_dtype).element_size()
    residual_elem = torch.tensor([], dtype=residual_dtype).element_size()
    nbytes = rows * _bytes_per_row(op, d, elem, residual_elem) + (d * weight_elem if op.startswith("rmsnorm") else 0)
    dev = "cuda"
    peers = {}

    def compiled(fn):
        return torch.compile(fn, dynamic=True)

    if op in ("silu_mul", "silu_mul_quant", "quantize_fp8_row"):
        a, b = torch.randn(rows, d, device=dev, dtype=dtype), torch.randn(rows, d, device=dev, dtype=dtype)
        fp8 = torch.float8_e4m3fn

        def quant(v):
            vf = v.float()
            amax = vf.abs().amax(-1).clamp(min=1.0 / 512)
            scale = amax / 448.0
            return (vf / scale[:, None]).clamp(-448.0, 448.0).to(fp8), scale

        def swiglu(p, q):
            return (F.silu(p.float()) * q.float()).to(dtype)

        if op == "silu_mul":
            ours = lambda config=None: ops.silu_mul(a, b, config=config)  # noqa: E731
            composite = lambda p, q: F.silu(p) * q  # noqa: E731
            liger = _liger("swiglu") if "liger" in peers_wanted else None
            if liger is not None:
                peers["liger"] = lambda: liger(a, b)
            if "eager" in peers_wanted:
                peers["eager"] = lambda: composite(a, b)
        elif op == "quantize_fp8_row":
            ours = lambda config=None: ops.quantize_fp8_row(a, config=config)  # noqa: E731
            composite = lambda p, q: quant(p)  # noqa: E731
            if "eager" in peers_wanted:
                peers["eager"] = lambda: quant(a)
        else:
            ours = lambda config=None: ops.silu_mul_quant(a, b, config=config)  # noqa: E731
            composite = lambda p, q: quant(swiglu(p, q))  # noqa: E731
            if "eager" in peers_wanted:
                peers["eager"] = lambda: composite(a, b)
        if "compile" in peers_wanted:
            fn = compiled(composite)
            peers["torch.compile"] = lambda: fn(a, b)
        return Case(op, rows, d, nbytes, ours, peers)

    if op.startswith("rmsnorm"):
        x, r = torch.randn(rows, d, device=dev, dtype=dtype), torch.randn(rows, d, device=dev, dtype=residual_dtype)
        w = torch.randn(d, device=dev, dtype=weight_dtype)
        fused = op == "rmsnorm_add"
        quack = _quack() if "quack" in peers_wanted else None
        liger = _liger("fused_add_rms_norm" if fused else "rms_norm") if "liger" in peers_wanted else None
        if fused:
            ours = lambda config=None: ops.rmsnorm_add(x, r, w, EPS, config=config)  # noqa: E731
            # an fp32 residual makes the sum fp32 (type promotion): the weight cast to it once,
            # outside the timed call
            w_sum = w.to(torch.promote_types(dtype, residual_dtype))

            def composite(p, q):
                h = p + q
                return F.rms_norm(h, (d,), w_sum, EPS).to(dtype), h
            if quack is not None:
                peers["quack"] = lambda: quack(x, w, residual=r, eps=EPS)
            if liger is not None:
                peers["liger"] = lambda: liger(x, r, w, EPS, 0.0, "llama", False)
        else:
            ours = lambda config=None: ops.rmsnorm(x, w, EPS, config=config)  # noqa: E731
            composite = lambda p, q: F.rms_norm(p, (d,), w, EPS)  # noqa: E731
            if quack is not None:
                peers["quack"] = lambda: quack(x, w, eps=EPS)
            if liger is not None:
                peers["liger"] = lambda: liger(x, w, EPS, 0.0, "llama", False)
        if "eager" in peers_wanted:
            peers["eager"] = lambda: composite(x, r)
        if "compile" in peers_wanted:
            fn = compiled(composite)
            peers["torch.compile"] = lambda: fn(x, r)
        return Case(op, rows, d, nbytes, ours, peers)

    k = int(op.rsplit("k", 1)[1])
    scores = torch.sigmoid(torch.randn(rows, 16, device=dev))
    _, exp_idx, tok_idx = ops.index_shuffling(scores, top_k=k)
    tok_long, exp_long = tok_idx.long(), exp_idx.long()
    if op.startswith("gather_quant"):
        x = torch.randn(rows, d, device=dev, dtype=dtype)
        ours = lambda config=None: ops.gather_scale_quant_dense_tokens(  # noqa: E731
            x, tok_idx, exp_idx, scores, config=config)
    elif op.startswith("gather"):
        x = torch.randn(rows, d, device=dev, dtype=dtype)
        ours = lambda config=None: ops.gather_scale_dense_tokens(x, tok_idx, exp_idx, scores,  # noqa: E731
                                                                  config=config)

        def composite(t, e):
            return (x.index_select(0, t).float() * scores[t, e].float()[:, None]).to(dtype)
        if "eager" in peers_wanted:
            peers["eager"] = lambda: composite(tok_long, exp_long)
        if "compile" in peers_wanted:
            fn = compiled(composite)
            peers["torch.compile"] = lambda: fn(tok_long, exp_long)
    else:
        y = torch.randn(rows * k, d, device=dev, dtype=dtype)
        out = torch.randn(rows, d, device=dev, dtype=dtype)
        ours = lambda config=None: ops.scatter_add_dense_tokens(out, y, tok_idx, config=config)  # noqa: E731
        if "eager" in peers_wanted:
            peers["index_add_"] = lambda: out.index_add_(0, tok_long, y)
    return Case(op, rows, d, nbytes, ours, peers)


def _configs_near(op, d, dtype: str = "bfloat16", fp32_weight: bool = False, fp32_residual: bool = False):
    """The configs of ``op``'s CuTe template for ``dtype`` rows of ``d`` elements (128-bit
    accesses, or one element per access where a row is not a multiple of 16 bytes) whose tile
    (the share of all the CTAs of a row) is 0.4-2.5x the row (at most 2.5x for silu_mul, whose
    tiles loop over a longer row, and for rows of one element per access); for scatter_add, every method
    (with and without programmatic dependent launch) at unroll 1, 2 and 4; for the gather, every
    unroll; and silu_mul's flat tiles, whatever the row."""
    from mslk_dsl import registry
    from mslk_dsl.ops.elementwise import runs_phased
    from mslk_dsl.templates import _rowwise_plan as plan
    from mslk_dsl.templates._kernel_limits import ELEM_BYTES

    name = {"gather_quant": "gather_scale_quant_dense_tokens", "scatter_add": "scatter_add_dense_tokens",
            "gather": "gather_scale_dense_tokens"}
    base = op.rsplit("_k", 1)[0] if "_k" in op else op
    if base not in name and "_k" in op:
        return []
    template = next(t for t in registry.get_templates(backend="cute") if t.op == name.get(base, base))
    vec_bytes = row_vec_bytes(d, dtype)
    if runs_phased(template.op, d, ELEM_BYTES[dtype], vec_bytes):   # the op takes the one-element kernels
        vec_bytes = ELEM_BYTES[dtype]
    sigs = [s for s in template.all_signatures() if s["dtype"] == dtype and s["vec_bytes"] == vec_bytes
            and not s.get("has_scale_ub") and bool(s.get("fp32_weight")) == fp32_weight and not s.get("has_valid_count")
            and bool(s.get("fp32_residual")) == fp32_residual
            and s.get("score_dtype", "float32") == "float32"]
    valid = [c for c in template.all_configs() if template.valid(c, "sm90a", sigs[0])]
    if base == "scatter_add":
        return [c for c in valid if c["unroll"] in (1, 2, 4)]
    if base == "gather":
        return valid
    flat = [c for c in valid if plan.RowTile.of(c).flat]   # silu_mul's flat tiles: any row length
    valid = [c for c in valid if not plan.RowTile.of(c).flat]
    if base == "silu_mul" or vec_bytes == ELEM_BYTES[dtype]:
        # silu_mul's tiles loop over a longer row; rows of one element per access have few
        # configs, and their tiles that read the rest again can win far below the row's length
        return [c for c in valid if plan.RowTile.of(c).row_k <= 2.5 * d] + flat
    return [c for c in valid if 0.4 * d <= plan.RowTile.of(c).row_k <= 2.5 * d] + flat


def sizes(op, mibs, elem: int = 2, residual_elem: int | None = None):
    """(rows, hidden) of ``op``'s sweep: per hidden size, the rows that move each target size
    with ``elem``-byte elements (rmsnorm_add's residual in ``residual_elem``-byte ones)."""
    hidden = MOE_HIDDEN if "_k" in op else HIDDEN
    out = []
    for d in hidden:
        per_row = _bytes_per_row(op, d, elem, residual_elem)
        for mib in mibs:
            rows = max(1, min(MAX_ROWS, round(mib * 2**20 / per_row)))
            if (rows, d) not in out:
                out.append((rows, d))
    out.append((1, 7168))   # one row (a decode step's token)
    if op.startswith("rmsnorm"):
        out += [(rows, d) for d in LONG_ROWS for rows in (1, 64, 2048)]
    return out


# Access classes of a drawn hidden size (random_shapes): the widest access of a 16-bit row.
ACCESS_CLASSES = (16, 8, 4, 2)
RANDOM_HIDDEN = (64, 16384)
RANDOM_MIB = (4, 4096)


def random_shapes(n: int, seed: int) -> list[tuple[int, float]]:
    """``n`` drawn (hidden, MiB moved) pairs: an access class of 16-bit rows (16-, 8-, 4-byte
    vectors or one element, in turn), a hidden size log-uniform over RANDOM_HIDDEN put in that
    class (a multiple of 8 / of 4 but not 8 / of 2 but not 4 / odd), and the bytes moved
    log-uniform over RANDOM_MIB. Rows come from each op's bytes per row (``shape_rows``)."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        width = ACCESS_CLASSES[i % len(ACCESS_CLASSES)]
        d = round(math.exp(rng.uniform(*(math.log(v) for v in RANDOM_HIDDEN))))
        elems = width // 2
        d = max(elems, d - d % elems)
        if width < 16 and d % (2 * elems) == 0:   # not of the wider class
            d += elems
        mib = math.exp(rng.uniform(*(math.log(v) for v in RANDOM_MIB)))
        out.append((d, mib))
    return out


def shape_rows(op: str, d: int, mib: float, elem: int = 2, residual_elem: int | None = None) -> int:
    """The rows of ``op`` at hidden size ``d`` that move about ``mib`` MiB (1..MAX_ROWS)."""
    return max(1, min(MAX_ROWS, round(mib * 2**20 / _bytes_per_row(op, d, elem, residual_elem))))


# The memory-bound goals' bands: (label, lowest MiB moved, highest, the least % of copy asked there).
GOAL_BANDS = ((">= 256 MiB", 256, math.inf, 95.0), ("16-64 MiB", 16, 64, 85.0))


def goal_bands(rows: list[dict]) -> str:
    """Each GOAL_BANDS band that ``rows`` (one op's) has points in: its minimum % of copy, the
    points it holds, and whether the band's goal is met."""
    parts = []
    for label, low, high, goal in GOAL_BANDS:
        pct = [r["% copy"] for r in rows if low <= r["MiB"] <= high]
        if pct:
            parts.append(f"{label} min {min(pct):.1f} of {len(pct)} ({'met' if min(pct) >= goal else 'missed'} {goal:.0f})")
    return ", ".join(parts)


def heuristic_against_configs(rows: list[dict], within: float = 1.01) -> str:
    """For ``rows`` timed with --configs (one op's): at how many the heuristic's pick was the
    fastest config near the row or within ``within`` of it, and the rows where it was furthest
    behind (graph replays on both sides); "" where no row has configs."""
    timed = [r for r in rows if r.get("configs") and r.get("us graph")]
    if not timed:
        return ""
    behind = sorted(((r["us graph"] / min(r["configs"].values()), r) for r in timed), key=lambda x: -x[0])
    close = sum(ratio <= within for ratio, _ in behind)
    worst = ", ".join(f"{r['rows']} x {r['hidden']} {ratio:.3f}x ({min(r['configs'], key=r['configs'].get)})"
                      for ratio, r in behind[:3] if ratio > within)
    return (f"heuristic within {100 * (within - 1):.0f}% of the fastest config near the row at {close} of {len(timed)}"
            + (f"; furthest behind: {worst}" if worst else ""))


def summary(results: list[dict], worst: int = 5) -> list[str]:
    """Per op: the points measured, % of copy (geometric mean, minimum; the minimum in each goal
    band) and, where a peer ran, ours against the best peer (geometric mean, minimum), then the
    ``worst`` shapes by % of copy."""

    lines = []
    for op in dict.fromkeys(r["op"] for r in results):
        rows = [r for r in results if r["op"] == op]
        pct = [r["% copy"] for r in rows]
        line = (f"{op}: {len(rows)} shapes, % of copy geomean {math.exp(sum(map(math.log, pct)) / len(pct)):.1f}, "
                f"min {min(pct):.1f}")
        if bands := goal_bands(rows):
            line += f" [{bands}]"
        vs = [r["vs peer"] for r in rows if r["vs peer"]]
        if vs:
            line += (f"; vs best peer geomean {math.exp(sum(map(math.log, vs)) / len(vs)):.3f}, min {min(vs):.3f}, "
                     f"behind at {sum(v < 1 for v in vs)} of {len(vs)}")
        lines.append(line)
        if heuristic := heuristic_against_configs(rows):
            lines.append("    " + heuristic)
        for r in sorted(rows, key=lambda r: r["% copy"])[:worst]:
            lines.append(f"    {r['rows']} x {r['hidden']} ({r['MiB']:.0f} MiB): {r['% copy']:.1f}% of copy"
                         + (f", {r['vs peer']:.3f}x {r['best peer']}" if r["vs peer"] else ""))
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="the size sweep (the only mode)")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--peers", default="liger,quack,eager,compile")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--weight-dtype", choices=("float32",),
                        help="the norms' weight dtype (default: x's): an fp32 weight beside 16-bit x")
    parser.add_argument("--residual-dtype", choices=("float32",),
                        help="rmsnorm_add's residual dtype (default: x's): an fp32 residual stream beside 16-bit x")
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK_MIB} MiB")
    parser.add_argument("--warm-only", action="store_true", help="call each op once per size; time nothing")
    parser.add_argument("--rep-ms", type=float, default=40.0)
    parser.add_argument("--sizes", help="ROWSxHIDDEN,... instead of the sweep's sizes")
    parser.add_argument("--random", type=int, metavar="N", help="N drawn shapes instead of the sweep's sizes")
    parser.add_argument("--seed", type=int, default=0, help="the draw's seed (with --random; use a fresh one)")
    parser.add_argument("--configs", action="store_true",
                        help="also time the configs near each row's width (and the heuristic's) in CUDA graphs")
    parser.add_argument("--configs-matching", metavar="REGEX",
                        help="with --configs: only the configs whose name matches (e.g. stagesmem)")
    found = parse_with_gpu(parser, argv, "bench_membound")
    if found is None:
        return 1
    args, torch, do_bench = found
    from mslk_dsl import ops
    from mslk_dsl.errors import InputError, InputTypeError

    dtype = getattr(torch, args.dtype)
    weight_dtype = getattr(torch, args.weight_dtype) if args.weight_dtype else None
    residual_dtype = getattr(torch, args.residual_dtype) if args.residual_dtype else None
    residual_elem = residual_dtype.itemsize if residual_dtype is not None else None
    peers_wanted = set(args.peers.split(",")) - {""}
    copy_cache: dict[int, float] = {}

    def timed(fn):
        return do_bench(fn, warmup=max(5.0, args.rep_ms / 4), rep=args.rep_ms, return_mode="median")

    def graph_timed(fn):
        return graph_replay_timed(torch, timed, fn)

    def copy_gbps(nbytes):
        key = nbytes // 2**16   # sizes within 64 KiB share a copy measurement
        if key not in copy_cache:
            src = torch.empty(max(1, nbytes // 4), device="cuda", dtype=torch.float16).normal_()
            dst = torch.empty_like(src)
            copy_cache[key] = 2 * src.numel() * 2 / timed(lambda: dst.copy_(src)) * 1e-6
        return copy_cache[key]

    results = []
    for op in args.ops.split(","):
        if args.random:
            points = [(shape_rows(op, d, mib, dtype.itemsize, residual_elem), d)
                      for d, mib in random_shapes(args.random, args.seed)]
        elif args.sizes:
            points = parse_shapes(args.sizes)
        else:
            points = sizes(op, QUICK_MIB if args.quick else TARGET_MIB, dtype.itemsize, residual_elem)
        for rows, d in points:
            with torch.no_grad():
                try:
                    case = _make_case(op, rows, d, dtype, set() if args.warm_only else peers_wanted, torch, ops,
                                      weight_dtype, residual_dtype)
                    case.ours()
                except (InputError, InputTypeError) as e:   # an op that does not take this dtype (MoE ops, fp32)
                    print(f"{op} {rows}x{d}: skipped: {e}", file=sys.stderr)
                    continue
                near = _configs_near(op, d, args.dtype, weight_dtype is not None and dtype != weight_dtype
                                     and op.startswith("rmsnorm"),
                                     residual_dtype is not None and dtype != residual_dtype
                                     and op == "rmsnorm_add") if args.configs else []
                if args.configs_matching:
                    from mslk_dsl.template import config_name
                    near = [c for c in near if re.search(args.configs_matching, config_name(c))]
                for config in near:
                    case.ours(config)
                torch.cuda.synchronize()
                if args.warm_only:
                    continue
                row = {"op": op, "rows": rows, "hidden": d, "MiB": case.nbytes / 2**20}
                ours_ms = timed(case.ours)
                copy = copy_gbps(case.nbytes)
                row["us"] = ours_ms * 1e3
                row["% copy"] = 100 * case.nbytes / ours_ms * 1e-6 / copy
                if near:
                    from mslk_dsl.template import config_name
                    run = case.ours
                    row["us graph"] = graph_timed(run) * 1e3
                    row["configs"] = {config_name(c): graph_timed(lambda c=c: run(c)) * 1e3 for c in near}
                    best_name = min(row["configs"], key=row["configs"].get)
                    print(f"{op} {rows}x{d} (graph replays): heuristic {row['us graph']:.1f} us; " + ", ".join(
                        f"{rowwise_label(c)} {row['configs'][config_name(c)]:.1f}" for c in near)
                        + f"; best {best_name}", flush=True)
                row["peers"] = {}
                for name, fn in case.peers.items():
                    try:
                        fn()
                        row["peers"][name] = timed(fn) * 1e3
                    except Exception as e:  # a peer that refuses a shape (Liger, quack limits)
                        row["peers"][name] = None
                        print(f"{op} {rows}x{d}: {name} failed: {type(e).__name__}: {str(e)[:120]}",
                              file=sys.stderr)
                timed_peers = {k: v for k, v in row["peers"].items() if v}
                best = min(timed_peers, key=timed_peers.get) if timed_peers else None
                row["best peer"] = best or "-"
                row["peer % copy"] = 100 * case.nbytes / (timed_peers[best] * 1e-3) * 1e-6 / copy if best else 0.0
                row["vs peer"] = timed_peers[best] / row["us"] if best else 0.0
                row["copy GB/s"] = copy
                results.append(row)
            del case
            torch.cuda.empty_cache()
        if args.json and not args.warm_only:   # after every op: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"dtype": args.dtype, "weight_dtype": args.weight_dtype,
                           "residual_dtype": args.residual_dtype, "results": results}, f, indent=1)
    if not args.warm_only:
        table(results, ["op", "rows", "hidden", "MiB", "us", "% copy", "best peer", "peer % copy", "vs peer"])
        if results:
            print("\n".join(summary(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
