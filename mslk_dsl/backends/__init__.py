"""Compiler backends. Each module exposes ``compile(template, config, target, signature, out_dir)
-> dict`` (writes artifact files into out_dir, returns the load information kept in meta.json) and
``load(entry) -> callable``. Backends import their DSL lazily, inside compile/load."""
from __future__ import annotations

import importlib

BACKENDS = ("cute", "flydsl")


def get_backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {BACKENDS}")
    return importlib.import_module(f"mslk_dsl.backends.{name}")
