"""Deployment manifests (aot/*.toml) and their expansion into compile jobs.

A manifest names targets and kernels; each ``[[kernels]]`` table selects an op (or "*"), its
configs ("all", or a list of config names), a subset of signature values, and optionally its
own targets::

    targets = ["sm90a", "gfx942", "gfx950"]
    [[kernels]]
    op = "silu_mul"
    configs = "all"
    signatures = { dtype = ["bfloat16"], aligned = [true] }

Expansion is the Cartesian product (template x target x signature x config) minus configs the
template rejects for that target and signature; each job is one KernelKey, de-duplicated.
"""
from __future__ import annotations

import fnmatch
import os
import tomllib
from dataclasses import dataclass
from importlib import resources

from mslk_dsl import registry
from mslk_dsl.keys import KernelKey
from mslk_dsl.template import Template, config_name


@dataclass(frozen=True)
class Job:
    key: KernelKey
    template: str  # template name, resolved again in the worker process

    @property
    def label(self) -> str:
        return self.key.describe()


def load_manifest(path_or_name: str | None = None) -> dict:
    """A manifest by path, or by name from the package's aot/ folder (default: "default")."""
    name = path_or_name or "default"
    if os.path.exists(name):
        with open(name, "rb") as f:
            return tomllib.load(f)
    packaged = resources.files("mslk_dsl.manifests") / f"{name.removesuffix('.toml')}.toml"
    if not packaged.is_file():
        raise FileNotFoundError(f"no manifest {name!r} (not a file, nor one of the packaged manifests)")
    return tomllib.loads(packaged.read_text())


def expand(manifest: dict, targets: list[str] | None = None, ops: list[str] | None = None,
           overrides: dict | None = None) -> list[Job]:
    """Jobs of a manifest, optionally narrowed to ``targets`` / ``ops``. ``overrides`` replaces
    the kernels' selection for one-off builds: {"configs": [...], "signatures": {...}}."""
    jobs: dict[str, Job] = {}
    for spec in manifest.get("kernels", [{"op": "*"}]):
        spec = {**spec, **(overrides or {})}
        # Targets named on the command line replace the manifest's (a one-off build for sm80, say).
        wanted_targets = targets or spec.get("targets", manifest.get("targets", []))
        for template in registry.get_templates():
            if not fnmatch.fnmatchcase(template.op, spec.get("op", "*")):
                continue
            if ops and template.op not in ops:
                continue
            for target in template.targets:
                if target not in wanted_targets:
                    continue
                for sig in _signatures(template, spec.get("signatures", {})):
                    for config in _configs(template, target, sig, spec.get("configs", "all")):
                        key = KernelKey.make(template, config, target, sig)
                        jobs.setdefault(key.digest, Job(key, template.name))
    return sorted(jobs.values(), key=lambda j: (j.key.target, j.key.op, j.key.template, j.key.digest))


def _signatures(template: Template, selection: dict) -> list[dict]:
    unknown = set(selection) - set(template.signatures)
    if unknown and not set(selection) & set(template.signatures):
        return template.all_signatures()  # selection names other ops' parts: take all of ours
    return [s for s in template.all_signatures()
            if all(s[k] in _as_list(v) for k, v in selection.items() if k in s)]


def _configs(template: Template, target: str, sig: dict, selection) -> list[dict]:
    valid = template.valid_configs(target, sig)
    if selection == "all":
        return valid
    names = set(_as_list(selection))
    return [c for c in valid if config_name(c) in names]


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def shard(jobs: list[Job], index: int, count: int) -> list[Job]:
    """The ``index``-th (1-based) of ``count`` deterministic slices: by key digest, so every build
    machine computes the same split whatever order it listed the jobs in."""
    if not 1 <= index <= count:
        raise ValueError(f"shard {index}/{count}: index must be in 1..{count}")
    return [j for j in jobs if int(j.key.digest, 16) % count == index - 1]
