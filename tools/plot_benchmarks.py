"""Plots for docs/benchmarks.md from the JSON files that tools/bench.py writes.

  python tools/plot_benchmarks.py docs/results docs/img [PLOT ...]

PLOT names the plots to draw (gemm, gemm_random, memory_bound, moe_layer, membound,
membound_random, attention_random); all by default.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import re
import sys


def _load(folder, name):
    """bench_NAME.json, or its gzipped copy (large result files are kept gzipped in docs/results)."""
    path = os.path.join(folder, f"bench_{name}.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    if os.path.exists(path + ".gz"):
        with gzip.open(path + ".gz", "rt") as f:
            return json.load(f)
    return None


def _save(fig, path, dpi):
    """``fig`` as a PNG of at most 256 colours (a third of a full-colour file's bytes; the plots
    are flat colours and lines, so nothing visible is lost): the docs travel with the checkout."""
    from PIL import Image

    fig.savefig(path, dpi=dpi)
    with Image.open(path) as image:
        flat = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT,
                                             dither=Image.Dither.NONE)
    flat.save(path, optimize=True)


def plot_gemm(data, out):
    import matplotlib.pyplot as plt

    ops = ["bf16_gemm", "f8f8bf16_rowwise"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, op in zip(axes, ops):
        rows = [r for r in data["results"] if r["op"] == op]
        for nk in sorted({(r["N"], r["K"]) for r in rows}):
            pts = sorted((r["M"], r["ratio"]) for r in rows if (r["N"], r["K"]) == nk)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"N={nk[0]} K={nk[1]}")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        ax.set_title(f"{op} vs {'torch.mm' if op == 'bf16_gemm' else 'torch._scaled_mm'}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speed ratio (torch time / ours)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    _save(fig, os.path.join(out, "gemm_ratio.png"), 110)


def plot_gemm_random(data, out):
    """bench_gemm_random's draw: each shape's ratio against M, both ops, with the goals."""
    import matplotlib.pyplot as plt

    goals = {"bf16_gemm": (0.95, "0.95 (M >= 64)"), "f8f8bf16_rowwise": (1.0, "1.0")}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, op in zip(axes, goals):
        rows = [r for r in data["results"] if r["op"] == op]
        ax.scatter([r["M"] for r in rows], [r["ratio"] for r in rows], s=14, c="tab:blue")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(goals[op][0], color="red", lw=0.8, ls="--", label=f"goal {goals[op][1]}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        summary = data.get("summary", {}).get(op, {})
        ax.set_title(f"{op} vs {'torch.mm' if op == 'bf16_gemm' else 'torch._scaled_mm'}: geomean "
                     f"{summary.get('geomean', float('nan')):.2f}, min {summary.get('min', float('nan')):.2f}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel(f"speed ratio (torch time / ours), {data['random']['count']} shapes, "
                       f"seed {data['random']['seed']}")
    fig.tight_layout()
    _save(fig, os.path.join(out, "gemm_random_ratio.png"), 110)


def plot_memory_bound(folder, out):
    import matplotlib.pyplot as plt

    bars = []
    for name in ("elementwise", "norm"):
        data = _load(folder, name)
        for r in (data or {}).get("results", []):
            rows = r.get("M", r.get("T"))
            cols = r.get("K", r.get("N"))
            bars.append((f"{r['op']}\n{rows}x{cols}", r["pct_copy"]))
    moe = _load(folder, "moe") or []
    for r in moe:
        # Scatter rows come per method; the heuristic's row is the one the op runs.
        if "fraction of copy" in r and r.get("method", "heuristic").startswith("heuristic"):
            bars.append((f"{r['op'].split('_')[0]} k{r['top_k']}\n{r['T']}x{r['D']}", 100 * r["fraction of copy"]))
    fig, ax = plt.subplots(figsize=(max(8, len(bars) * 0.55), 4.2))
    ax.bar(range(len(bars)), [b[1] for b in bars], color="tab:blue")
    ax.axhline(90, color="red", lw=0.8, ls="--", label="90% of copy")
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=90, fontsize=7)
    ax.set_ylabel("% of y.copy_(x) bandwidth, same bytes")
    ax.legend()
    fig.tight_layout()
    _save(fig, os.path.join(out, "memory_bound.png"), 110)


def _op_panels(rows, panel_height):
    """A figure of one "% of copy" panel per op of ``rows``, three a line, and its (axes, op)
    pairs."""
    import matplotlib.pyplot as plt

    op_names = list(dict.fromkeys(r["op"] for r in rows))
    cols = 3
    lines = (len(op_names) + cols - 1) // cols
    fig, axes = plt.subplots(lines, cols, figsize=(15, panel_height * lines), sharey=True, squeeze=False)
    for ax in axes[:, 0]:
        ax.set_ylabel("% of copy bandwidth")
    for ax in list(axes.flat)[len(op_names):]:
        ax.set_visible(False)
    return fig, list(zip(axes.flat, op_names))


def _copy_panel(ax, title):
    """A panel's goal lines (bench_membound.GOAL_BANDS: 95% and 85% of copy), log2 bytes axis,
    title, grid and legend."""
    from bench_membound import GOAL_BANDS

    for (_, _, _, goal), colour in zip(GOAL_BANDS, ("red", "orange")):
        ax.axhline(goal, color=colour, lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("MiB moved")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)


def plot_membound_sweep(data, out):
    """% of copy against bytes moved, one panel per op: ours (solid) and the best peer (dashed),
    one colour per hidden size (tools/bench.py membound --sweep --json bench_membound.json)."""
    rows = data["results"]
    fig, panels = _op_panels(rows, 3.6)
    for ax, op in panels:
        mine = [r for r in rows if r["op"] == op]
        for i, d in enumerate(sorted({r["hidden"] for r in mine})):
            pts = sorted((r["MiB"], r["% copy"], r["peer % copy"]) for r in mine if r["hidden"] == d)
            colour = f"C{i}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=colour, label=f"D={d}")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], ls="--", lw=0.8, color=colour)
        _copy_panel(ax, f"{op} (dashed: best peer)")
    fig.tight_layout()
    _save(fig, os.path.join(out, "membound_sweep.png"), 100)


def latest_random_sweep(folder):
    """The newest drawn sweep in ``folder`` (bench_membound_random_SEED_GPU_DATE.json[.gz], by its
    date), as (data, the part of its name after "bench_membound_random_"), or None."""
    paths = glob.glob(os.path.join(folder, "bench_membound_random_*.json*"))
    dated = [(m.group(1), p) for p in paths if (m := re.search(r"(\d{4}-\d{2}-\d{2})\.json", p))]
    if not dated:
        return None
    path = max(dated)[1]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f), os.path.basename(path).split(".json")[0].removeprefix("bench_membound_random_")


def plot_membound_random(data, label, out):
    """A drawn sweep (tools/bench.py membound --sweep --random N --seed S): % of copy against bytes
    moved, one panel per op, ours as dots and the best peer as rings on the same shapes; each
    shape has one hidden size, so points, not lines."""
    rows = data["results"]
    fig, panels = _op_panels(rows, 3.4)
    for ax, op in panels:
        mine = [r for r in rows if r["op"] == op]
        ahead = [r for r in mine if r["vs peer"] >= 1.0]
        behind = [r for r in mine if r["vs peer"] < 1.0]
        for part, colour, name in ((ahead, "C0", "ours, ahead of the peer"), (behind, "C3", "ours, behind")):
            ax.scatter([r["MiB"] for r in part], [r["% copy"] for r in part], s=14, color=colour, label=name)
        ax.scatter([r["MiB"] for r in mine], [r["peer % copy"] for r in mine], s=22, facecolors="none",
                   edgecolors="grey", lw=0.8, label="best peer")
        ax.set_ylim(0, 140)
        _copy_panel(ax, op)
    fig.suptitle(f"memory-bound ops on drawn shapes ({label})", fontsize=10)
    fig.tight_layout()
    _save(fig, os.path.join(out, "membound_random.png"), 90)


def plot_attention_random(data, out):
    """bench_attention_random (tools/bench.py attention --random N --seed S --json ...): each drawn
    call's speed ratio against the best SDPA backend and against FA4, by sequence length, one
    colour per (q / k, v) head dims, open markers for causal calls, with the goals."""
    import matplotlib.pyplot as plt

    rows = [r for r in data["results"] if "draw" in r]
    goals = {"vs_best_sdpa": (1.1, "the best SDPA backend"), "vs_fa4": (1.0, "FA4")}
    dims = sorted({(r["draw"]["D"], r["draw"]["Dv"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, (col, (goal, peer)) in zip(axes, goals.items()):
        for i, (d, dv) in enumerate(dims):
            for causal in (False, True):
                pts = [(r["draw"]["S"], r[col]) for r in rows if isinstance(r.get(col), float)
                       and (r["draw"]["D"], r["draw"]["Dv"]) == (d, dv) and r["draw"]["causal"] == causal]
                if pts:
                    colour = f"C{i % 10}"
                    ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=16, color=colour if not causal else "none",
                               edgecolors=colour, label=f"D {d}{'' if d == dv else f' / {dv}'}{' causal' if causal else ''}")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(goal, color="red", lw=0.8, ls="--", label=f"goal {goal}x")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (queries = keys)")
        ax.set_title(f"attention_fwd against {peer}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    axes[0].set_ylabel(f"speed ratio (peer time / ours), {len(rows)} drawn calls, seed {data.get('seed')}")
    fig.tight_layout()
    _save(fig, os.path.join(out, "attention_random.png"), 110)


def plot_moe_layer(data, out):
    """bench_moe_layer: the whole layer's speed-up over the torch pipeline per config and T, bf16
    and FP8, with the goals (tools/bench.py moe_layer --json bench_moe_layer.json)."""
    import matplotlib.pyplot as plt

    goals = {"bf16": 1.4, "fp8": 2.0}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, precision in zip(axes, goals):
        for config in sorted({r["config"] for r in data}):
            pts = sorted((r["T"], r["vs torch"]) for r in data if r["config"] == config and r["precision"] == precision)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=config)
        ax.axhline(goals[precision], color="red", lw=0.8, ls="--", label=f"goal {goals[precision]}x")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (tokens)")
        ax.set_title(f"MoE layer, {precision}: torch pipeline time / mslk_dsl time")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("speed-up")
    fig.tight_layout()
    _save(fig, os.path.join(out, "moe_layer.png"), 110)


def main(argv):
    folder, out, only = argv[0], argv[1], set(argv[2:])
    os.makedirs(out, exist_ok=True)

    def wanted(name):
        return not only or name in only

    gemm = _load(folder, "gemm_tuned") or _load(folder, "gemm")  # the tuned run when there is one
    if gemm and wanted("gemm"):
        plot_gemm(gemm, out)
    random_draw = _load(folder, "gemm_random")
    if random_draw and wanted("gemm_random"):
        plot_gemm_random(random_draw, out)
    if wanted("memory_bound"):
        plot_memory_bound(folder, out)
    moe_layer = _load(folder, "moe_layer")
    if moe_layer and wanted("moe_layer"):
        plot_moe_layer(moe_layer, out)
    sweep = _load(folder, "membound")
    if sweep and wanted("membound"):
        plot_membound_sweep(sweep, out)
    attention_draw = _load(folder, "attention_random")
    if attention_draw and wanted("attention_random"):
        plot_attention_random(attention_draw, out)
    drawn = latest_random_sweep(folder)
    if drawn and wanted("membound_random"):
        plot_membound_random(*drawn, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
