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


def parse_with_gpu(parser, argv, name: str):
    """Add ``--json PATH``, parse ``argv``, then (args, torch, do_bench), or None when there is no
    CUDA GPU (after saying so)."""
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args(argv)
    gpu = cuda_or_exit(name)
    return None if gpu is None else (args, *gpu)


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """"4096x8192,1x5120" -> [(4096, 8192), (1, 5120)]."""
    return [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",")]


def row_vec_bytes(n: int, dtype: str) -> int:
    """The row-wise ops' signature part ``vec_bytes`` for contiguous rows of ``n`` ``dtype``
    elements from a 16-byte aligned base: the widest access (16, 8 or 4 bytes) of more than one
    element that every row is a whole number of, else one element."""
    from mslk_dsl.templates._kernel_limits import ELEM_BYTES, contiguous_vector_bytes

    return contiguous_vector_bytes(n, ELEM_BYTES[dtype])


def rowwise_label(config: dict) -> str:
    """A short name for a row-wise kernel config (threads, rows per block, vector, chunks; the
    cluster, register cap, staging in shared memory ("s"), a norm's weight read in 16-byte loads
    ("w") and L1 policy where given), or for a
    scatter config (method, unroll, pdl)."""
    if "threads" not in config:
        return f"{config.get('method', '')}{'+pdl' if config.get('pdl') else ''} u{config.get('unroll')}"
    label = f"t{config['threads']}r{config['rows_per_block']}v{config['vec']}c{config['chunks']}"
    if "cluster" in config:
        label += f"x{config['cluster']}"
    if "regs" in config:
        label += f"@{config['regs']}"
    if config.get("stage") == "smem":
        label += "s"
    if config.get("weight") == "vectors":
        label += "w"
    if "l1" in config:
        label += f" {config['l1']}"
    return label


def table(rows: list[dict], cols: list[str]) -> None:
    """Print rows as a Markdown table of the given columns (floats to 4 significant digits)."""
    print("| " + " | ".join(cols) + " |")
    print("| " + " | ".join("---" for _ in cols) + " |")
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


def graph_timed(torch, timed, fn):
    """``timed(replay)`` of ``fn`` captured in a CUDA graph: a call with an explicit config takes
    the op's checked path, whose host time (tens of us) would hide a small kernel's time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Captured on the stream of the warm-up call: launches that keep counters per stream
    # (dispatch.zeroed_counters) find the ones that call made, as eager calls do.
    with torch.cuda.graph(graph, stream=side):
        fn()
    return timed(graph.replay)


def quantize_rowwise(t, fp8, torch):
    """(t in ``fp8`` with one scale per row, the fp32 scales): the rowwise FP8 operands the GEMM
    benchmarks feed to both ours and torch._scaled_mm."""
    fp8_max = torch.finfo(fp8).max
    scale = t.abs().amax(dim=1).clamp(min=1e-12) / fp8_max
    return (t / scale[:, None]).clamp(-fp8_max, fp8_max).to(fp8), scale.float()


def build_jobs(jobs: dict) -> None:
    """Compile ``jobs`` (digest -> aot Job) into the cache, one worker per CPU, and say how it
    went: benchmarks build what they will time first, so the timing loop only loads kernels."""
    import os

    from mslk_dsl import env
    from mslk_dsl.aot import runner

    report = runner.build(list(jobs.values()), env.cache_dir(), workers=os.cpu_count() or 1, progress=False)
    print(f"compiled {len(report.built)} kernels ({len(jobs)} needed, {len(report.failed)} failed) "
          f"in {report.seconds:.0f} s", flush=True)
    for why in report.failed.values():
        print("  failed:", why, file=sys.stderr)


def geomean(values) -> float:
    """The geometric mean of positive numbers (nan for none): how speed ratios are summarized."""
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def save_json(path: str | None, results) -> None:
    """Write a run's results where --json asked (nothing without it)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
