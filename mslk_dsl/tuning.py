"""Stored tuning results: the winning config per (GPU, toolchain, op, signature, shape bucket).

The database is a JSON file under the cache dir. Entries recorded on another GPU or toolchain
are ignored. Populated by ``mslk-dsl tune`` (see autotune.py); read by the op layer.
"""
from __future__ import annotations

import functools
import json
import os

from mslk_dsl import env


def db_path() -> str:
    return os.path.join(env.cache_dir(), "tuning.json")


def bucket(problem: dict) -> str:
    """Sizes rounded up to a power of two: one tuning result serves a range of shapes."""
    return ",".join(f"{k}{1 << max(0, int(v) - 1).bit_length()}" for k, v in sorted(problem.items()))


def entry_key(op: str, target: str, sig: dict, problem: dict) -> str:
    return f"{op}|{target}|{json.dumps(sig, sort_keys=True)}|{bucket(problem)}"


@functools.cache
def _load(path: str, mtime: float) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def lookup(op: str, target: str, sig: dict, problem: dict) -> dict | None:
    path = db_path()
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        return None
    db = _load(path, mtime)
    record = db.get("entries", {}).get(entry_key(op, target, sig, problem))
    if not record or record.get("context") != context():
        return None
    return record["config"]


@functools.cache
def context() -> dict:
    """What a tuning result is valid for: the GPU model and the toolchain versions."""
    import torch

    from mslk_dsl.keys import dsl_versions

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return {"gpu": gpu, "torch": torch.__version__, **dsl_versions("cute"), **dsl_versions("flydsl")}
