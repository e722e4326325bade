"""Benchmarks on a GPU, each against torch in the same run. One entry point:

  python tools/bench.py elementwise|norm|moe|moe_layer|membound|gemm|grouped_gemm|attention|attention_decode|overhead|startup [options] [--json PATH]

Each family lives in tools/bench_<family>.py with a main(argv); run with --help for its options.
"""
from __future__ import annotations

import importlib
import os
import sys

FAMILIES = ("elementwise", "norm", "moe", "moe_layer", "membound", "gemm", "grouped_gemm", "attention", "attention_decode", "overhead", "startup")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in FAMILIES:
        print(__doc__)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    module = importlib.import_module(f"bench_{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
