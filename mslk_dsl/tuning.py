"""Stored tuning results: the winning config per (GPU, toolchain, op, signature, shape bucket).

The database is a JSON file under the cache dir. Entries recorded on another GPU or toolchain
are ignored. Populated by ``mslk-dsl tune`` (see autotune.py); read by the op layer.
"""
from __future__ import annotations

import functools
import json
import os
import warnings

from mslk_dsl import env


def db_path() -> str:
    return os.path.join(env.cache_dir(), "tuning.json")


def bucket(problem: dict) -> str:
    """Sizes rounded up to a power of two: one tuning result serves a range of shapes."""
    return ",".join(f"{k}{1 << max(0, int(v) - 1).bit_length()}" for k, v in sorted(problem.items()))


def entry_key(op: str, target: str, sig: dict, problem: dict) -> str:
    return f"{op}|{target}|{json.dumps(sig, sort_keys=True)}|{bucket(problem)}"


def read_db(path: str) -> dict:
    """The database at ``path`` as {"entries": {key: record}}; empty where the file is missing.
    A file that is not such a JSON object (hand-edited, or written by something else) is
    ignored with one warning: tuning only ever picks among valid configs, so the heuristic
    serves instead, and the next ``mslk-dsl tune`` replaces it."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {"entries": {}}
    except (OSError, ValueError) as e:
        return _malformed(path, f"cannot be read as JSON ({e})")
    entries = data.get("entries", {}) if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        return _malformed(path, f"holds a {type(data).__name__}, not an object with an \"entries\" object")
    return {**data, "entries": {k: r for k, r in entries.items()
                                if isinstance(r, dict) and isinstance(r.get("config"), dict)}}


def _malformed(path: str, why: str) -> dict:
    warnings.warn(f"mslk-dsl: ignoring the tuning database {path}: it {why}; delete it (or rerun "
                  "`mslk-dsl tune`, which rewrites it) to silence this", stacklevel=4)
    return {"entries": {}}


@functools.cache
def _load(path: str, mtime: float) -> dict:
    return read_db(path)  # once per version of the file: the warning, too, comes once


def lookup(op: str, target: str, sig: dict, problem: dict) -> dict | None:
    path = db_path()
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        return None
    record = _load(path, mtime)["entries"].get(entry_key(op, target, sig, problem))
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
