"""Compiler backends: one module per DSL, each implementing ``Backend``.

Backends import their DSL lazily, inside compile/load, so a process that only serves kernels never
imports a compiler. ``jit`` is their only caller for building; it owns locks, staging and publish.
"""
from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
from typing import Any, Protocol
from collections.abc import Callable, Sequence

from mslk_dsl.errors import InputError

BACKENDS = ("cute", "flydsl")

# (template, config, target, signature, out_dir): one kernel to compile into out_dir.
CompileItem = tuple[Any, dict, Any, dict, str]


class Backend(Protocol):
    def compile(self, template, config: dict, target, signature: dict, out_dir: str) -> dict:
        """Compile one kernel: write (export) its artifact files into ``out_dir`` and return the
        load information kept in meta.json under "load"."""

    def compile_many(self, items: Sequence[CompileItem]) -> list:
        """The same for several items, sharing compiler processes where the backend can: a dict
        or the exception, per item (one failure never hides the others)."""

    def load(self, entry) -> Callable:
        """The callable kernel of a verified cache entry, without compiling anything."""


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise InputError(f"unknown backend {name!r}; known: {BACKENDS}")
    return importlib.import_module(f"mslk_dsl.backends.{name}")  # type: ignore[return-value]


def die_with_parent(parent_pid: int) -> None:
    """Make this compile process exit when ``parent_pid`` dies (a killed `aot build`, a killed
    worker), instead of compiling on as an orphan: Linux's parent-death signal where there is
    one, and a watchdog thread in any case (the signal follows the parent *thread* that spawned
    us, which a pool may not keep)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            PR_SET_PDEATHSIG = 1
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # died before the signal was armed
        os._exit(1)

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="mslk-dsl-parent-watch", daemon=True).start()
