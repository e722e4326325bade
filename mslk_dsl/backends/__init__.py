"""Compiler backends. Each module exposes
  ``compile(template, config, target, signature, out_dir) -> dict``: write the artifact files into
      out_dir and return the load information kept in meta.json;
  ``compile_many(items) -> [dict | Exception]``: the same for several (template, config, target,
      signature, out_dir) items, sharing compiler processes where the backend can;
  ``load(entry) -> callable``.
Backends import their DSL lazily, inside compile/load."""
from __future__ import annotations

import importlib

BACKENDS = ("cute", "flydsl")


def get_backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {BACKENDS}")
    return importlib.import_module(f"mslk_dsl.backends.{name}")
