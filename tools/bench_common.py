"""Pieces every benchmark family shares: the GPU check, shape lists, config labels, tables,
geometric means and the JSON file."""
from __future__ import annotations

import json
import math
import sys


def cuda_or_exit(name: str):
    """(torch, triton's do_bench) when a CUDA GPU is present, else None after saying so."""
    import torch

    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU", file=sys.stderr)
        return None
    from triton.testing import do_bench

    return torch, do_bench


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """"4096x8192,1x5120" -> [(4096, 8192), (1, 5120)]."""
    return [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",")]


def rowwise_label(config: dict) -> str:
    """A short name for a row-wise kernel config (threads, rows per block, vector, chunks)."""
    return f"t{config['threads']}r{config['rows_per_block']}v{config['vec']}c{config['chunks']}"


def table(rows: list[dict], cols: list[str]) -> None:
    """Print rows as a Markdown table of the given columns (floats to 4 significant digits)."""
    print("| " + " | ".join(cols) + " |")
    print("| " + " | ".join("---" for _ in cols) + " |")
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


def geomean(values) -> float:
    """The geometric mean of positive numbers (nan for none): how speed ratios are summarized."""
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def save_json(path: str | None, results) -> None:
    """Write a run's results where --json asked (nothing without it)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
