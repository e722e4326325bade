"""Benchmarks on a GPU, each against torch in the same run. One entry point:

  python tools/bench.py FAMILY [options] [--json PATH]

Each family lives in tools/bench_<family>.py with a main(argv) (a new file is a new family; no
list to edit); run with --help for its options. ``overhead`` times every declared op that keeps
launch plans, on its declaration's example inputs.
"""
from __future__ import annotations

import glob
import importlib
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def families() -> list[str]:
    """The benchmark families: every tools/bench_<family>.py that defines main(argv) (the others,
    bench_common.py and bench_gemm_random.py, are helpers of the families)."""
    names = []
    for path in sorted(glob.glob(os.path.join(HERE, "bench_*.py"))):
        with open(path) as f:
            if re.search(r"^def main\(", f.read(), re.MULTILINE):
                names.append(os.path.basename(path)[len("bench_"):-len(".py")])
    return names


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in families():
        print(__doc__)
        print("families:", " ".join(families()))
        return 2
    sys.path.insert(0, HERE)
    module = importlib.import_module(f"bench_{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
