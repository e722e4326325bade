"""The AOT job runner: compile jobs in parallel spawned worker processes into an output store.

Workers are spawned (never forked) with ``max_tasks_per_child=1``, so no compiler state, DSL
import or FlyDSL target survives from one task to the next. CuTe jobs are grouped a few per task
to amortize the seconds of ``import cutlass``; FlyDSL jobs of one target share one compiler child
process per task. A failing job is reported with its key and the compiler's error; the rest still build.
Locking, looking again, compiling and publishing are ``jit.build_batch``'s: a worker only plans.
Kernels already in the user cache or a bundle are copied into the output, not compiled again.
Workers die with this process, so killing `aot build` leaves no compiler running.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

from mslk_dsl.aot.manifest import Job
from mslk_dsl.backends import die_with_parent
from mslk_dsl.cache import CorruptEntry, KernelCache
from mslk_dsl.compile_errors import describe_compile_error
from mslk_dsl.errors import StateError

# How an error message tells the user to pick another output directory.
OTHER_OUTPUT = "choose (with --out) another,"
CUTE_JOBS_PER_TASK = 6
FLYDSL_JOBS_PER_TASK = 24


@dataclass
class BuildReport:
    built: list[str] = field(default_factory=list)      # digests compiled now
    skipped: list[str] = field(default_factory=list)    # already in the output
    copied: list[str] = field(default_factory=list)     # copied from the user cache or a bundle
    failed: dict[str, str] = field(default_factory=dict)  # digest -> "key: error"
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def finished(self) -> int:
        """Jobs with an outcome so far."""
        return len(self.built) + len(self.skipped) + len(self.copied) + len(self.failed)


def _build_task(jobs: list[tuple[dict, str]], out_root: str) -> list[tuple[str, str | None, float, bool]]:
    """Worker: compile the jobs (key parts, template name) of one backend together through
    ``jit.build_batch``; returns (digest, error or None, seconds, whether this task compiled it)
    per job (not compiled: another process published it while this one waited for its lock)."""
    from mslk_dsl import jit, registry
    from mslk_dsl.keys import KernelKey
    from mslk_dsl.targets import get_target

    store = KernelCache(out_root, writable=True)
    results, todo = [], []
    start = time.perf_counter()
    for parts, template_name in jobs:
        key = KernelKey.from_parts(parts)
        try:
            template = registry.get_template(template_name)
            fresh = KernelKey.make(template, key.config, key.target, key.signature)
            if fresh.digest != key.digest:
                raise StateError("the key changed between planning and building (template edited?)")
            todo.append((key, template, get_target(key.target)))
        except Exception as e:
            results.append((key.digest, f"{key.describe()}: {_one_line(e)}", 0.0, False))
    outcomes = jit.build_batch(store, todo) if todo else []
    seconds = (time.perf_counter() - start) / max(1, len(todo))
    for (key, _, _), (outcome, compiled) in zip(todo, outcomes):
        # a compile error names the template file and line it came from (DSL frames trimmed)
        error = f"{key.describe()}: {describe_compile_error(outcome)}" if isinstance(outcome, BaseException) else None
        results.append((key.digest, error, seconds, compiled))
    return results


def _one_line(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()


def _tasks(jobs: list[Job], workers: int) -> list[list[Job]]:
    """Group jobs of one backend and target into tasks: few enough to amortize a worker's start
    (and, for FlyDSL, its compiler child), small enough to keep every worker busy."""
    groups: dict[tuple[str, str], list[Job]] = {}
    for j in jobs:
        groups.setdefault((j.key.backend, j.key.target), []).append(j)
    tasks = []
    for (backend, _), group in sorted(groups.items()):
        limit = CUTE_JOBS_PER_TASK if backend == "cute" else FLYDSL_JOBS_PER_TASK
        size = max(1, min(limit, -(-len(jobs) // (4 * max(1, workers)))))
        tasks += [group[i:i + size] for i in range(0, len(group), size)]
    return tasks


def build(jobs: list[Job], out_root: str, workers: int = 1, progress: bool | None = None) -> BuildReport:
    """Compile every job missing from ``out_root``; ``progress`` None means "bar on a terminal"."""
    start = time.perf_counter()
    store = KernelCache(out_root, writable=True)
    store.ensure_writable(OTHER_OUTPUT)
    report = BuildReport()
    todo = []
    for job in jobs:
        if store.lookup(job.key) is not None:
            report.skipped.append(job.key.digest)
        elif _copy_existing(store, job.key):
            report.copied.append(job.key.digest)
        else:
            todo.append(job)
    bar = _progress(len(todo), progress)
    labels = {j.key.digest: j.label for j in todo}
    pending = _tasks(todo, workers)
    while pending:
        finished_before = report.finished
        broken = _run_round(pending, out_root, workers, report, bar, labels)
        # A worker that crashes (a compiler segfault) breaks the whole pool: retry what did not
        # finish, one job per task, as long as each round makes progress.
        if broken and report.finished > finished_before:
            pending = [[j] for task in broken for j in task]
        else:
            for job in (j for task in broken for j in task):
                report.failed[job.key.digest] = f"{job.label}: the worker process died while compiling"
                bar.advance()
            pending = []
    bar.close()
    report.seconds = time.perf_counter() - start
    return report


def _copy_existing(store: KernelCache, key) -> bool:
    """Copy ``key``'s verified entry from the user cache or a bundle into ``store`` (an output
    other than the cache) instead of compiling it again; False when no other layer has it."""
    from mslk_dsl import jit

    for layer in jit.bundle_layers() + [jit.cache()]:
        if layer.root == store.root:
            continue
        entry = layer.lookup(key)
        if entry is None:
            continue
        with store.lock(key):
            if store.lookup(key) is None:
                try:
                    store.copy_entry(key, entry)
                except CorruptEntry:  # damaged since it was checked: build it instead
                    return False
        return True
    return False


def pool(workers: int) -> cf.ProcessPoolExecutor:
    """Spawned workers, one task each, that exit when this process dies (never orphans)."""
    ctx = multiprocessing.get_context("spawn")
    return cf.ProcessPoolExecutor(max_workers=max(1, workers), mp_context=ctx, max_tasks_per_child=1,
                                  initializer=die_with_parent, initargs=(os.getpid(),))


def _run_round(tasks, out_root, workers, report, bar, labels) -> list[list[Job]]:
    """Run ``tasks`` in one pool; record results; return the tasks lost to a broken pool."""
    broken = []
    with pool(workers) as executor:
        futures = {executor.submit(_build_task, [(j.key.parts(), j.template) for j in task], out_root): task
                   for task in tasks}
        for future in cf.as_completed(futures):
            try:
                results = future.result()
            except cf.process.BrokenProcessPool:
                broken.append(futures[future])
                continue
            for digest, error, seconds, compiled in results:
                if error is None and not compiled:
                    report.skipped.append(digest)
                    bar.line(f"found  {labels[digest]} (published by another build meanwhile)")
                elif error is None:
                    report.built.append(digest)
                    bar.line(f"built  {labels[digest]} ({seconds:.1f}s)")
                else:
                    report.failed[digest] = error
                    bar.line(f"FAILED {error}")
                bar.advance()
    return broken


class _progress:
    """A tqdm bar with counts and ETA on a terminal; plain lines (with counts) in CI logs."""

    def __init__(self, total: int, enabled: bool | None):
        self.total, self.done = total, 0
        self.tty = sys.stderr.isatty() if enabled is None else enabled
        self.bar = None
        if self.tty and total:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="kernel", dynamic_ncols=True)

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(f"[{self.done + 1}/{self.total}] {text}", flush=True)

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def default_workers() -> int:
    from mslk_dsl import env

    return env.aot_workers()

