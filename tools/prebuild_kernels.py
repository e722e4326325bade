"""Compile, in parallel, the kernels a command would compile one after another.

  python tools/prebuild_kernels.py [--workers N] -- pytest ARGS...
  python tools/prebuild_kernels.py [--workers N] -- tools/bench.py membound --sweep --warm-only

Runs the command (pytest, or a Python script with its arguments) once in this process with every
kernel compile replaced by a stand-in that records the kernel's key and launches nothing, then
compiles the recorded kernels into the kernel cache with ``mslk_dsl.aot.build`` and ``N``
workers. Run the command again afterwards: it finds every kernel in the cache. The recording run
launches no kernel of ours (its assertions may fail; its exit status is ignored), so for a
benchmark or a few test files it takes seconds to a minute; a GPU test visit then spends its
time on compiles spread over the machine's cores instead of one compile after another. The
tests' torch references still run, one test after another in one process: recording the whole
of tests/gpu took 231 s on an H100 host (2026-12-07) and found 1607 kernels, of which 16 workers
built 210 in the next 6 minutes (58 attention_fwd kernels among them), so for the
whole suite let pytest-xdist compile side by side instead (tools/gpu_session.sh). Bound this
script with SIGKILL (`timeout -s KILL`): a SIGINT during that build did not stop it.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys


def record(command: list[str]) -> dict:
    """{key digest: aot.Job} of the kernels ``command`` would have compiled."""
    from mslk_dsl import aot, jit

    jobs: dict = {}

    def stand_in(key, template, target):
        jobs.setdefault(key.digest, aot.Job(key, template.name))
        return lambda *args, **kwargs: None

    jit.build_and_load = stand_in
    argv = sys.argv
    try:
        if command[0] == "pytest":
            import pytest

            pytest.main(command[1:] + ["-q", "--no-header", "-p", "no:cacheprovider"])
        else:
            sys.argv = command
            sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
            try:
                runpy.run_path(command[0], run_name="__main__")
            except SystemExit:
                pass
    finally:
        sys.argv = argv
    return jobs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to prebuild for after --")
    jobs = record(command)
    from mslk_dsl import aot, env

    print(f"prebuild: {len(jobs)} kernels to compile with {args.workers} workers", flush=True)
    report = aot.build(list(jobs.values()), env.cache_dir(), workers=args.workers, progress=False)
    print(f"prebuild: {len(report.built)} compiled, {len(report.failed)} failed in {report.seconds:.0f}s", flush=True)
    for text in report.failed.values():
        print("  " + text.splitlines()[0][:300])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
