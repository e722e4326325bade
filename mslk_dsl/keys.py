"""KernelKey: everything that decides the bytes of a compiled kernel, and nothing else.

Its digest names the cache entry. Dynamic sizes (tokens, batch, K) are never part of it.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, field
from importlib import metadata

import mslk_dsl
from mslk_dsl import env
from mslk_dsl.registry import template_digest
from mslk_dsl.template import Template, config_name

# The packages whose versions change what a backend generates.
DSL_PACKAGES = {
    "cute": ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
             "apache-tvm-ffi"),
    "flydsl": ("flydsl",),
}


@functools.cache
def dsl_versions(backend: str) -> dict[str, str]:
    """Installed versions of the backend's DSL packages ("" where not installed)."""
    out = {}
    for pkg in DSL_PACKAGES[backend]:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = ""
    return out


@dataclass(frozen=True)
class KernelKey:
    op: str
    backend: str
    template: str
    template_digest: str
    config: dict = field(hash=False)
    target: str = ""
    signature: dict = field(default_factory=dict, hash=False)
    framework_version: str = ""
    dsl_versions: dict = field(default_factory=dict, hash=False)
    codegen_env: dict = field(default_factory=dict, hash=False)

    @classmethod
    def make(cls, template: Template, config: dict, target: str, signature: dict) -> "KernelKey":
        return cls(
            op=template.op,
            backend=template.backend,
            template=template.name,
            template_digest=template_digest(template.source),
            config=dict(sorted(config.items())),
            target=target,
            signature=dict(sorted(signature.items())),
            framework_version=mslk_dsl.__version__,
            dsl_versions=dsl_versions(template.backend),
            codegen_env=env.codegen_env(template.backend),
        )

    @classmethod
    def from_parts(cls, parts: dict) -> "KernelKey":
        return cls(**{k: parts[k] for k in cls.__dataclass_fields__})

    def parts(self) -> dict:
        return asdict(self)

    @functools.cached_property
    def digest(self) -> str:
        return hashlib.sha256(_canonical(self.parts()).encode()).hexdigest()[:32]

    @property
    def config_name(self) -> str:
        return config_name(self.config)

    def describe(self) -> str:
        return (f"op={self.op} target={self.target} template={self.template} "
                f"config={self.config_name} signature={_canonical(self.signature)}")

    def __hash__(self):
        return hash(self.digest)

    def __eq__(self, other):
        return isinstance(other, KernelKey) and self.digest == other.digest


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def diff_parts(a: dict, b: dict) -> dict[str, tuple]:
    """Which parts of two keys differ: {part: (a's value, b's value)}."""
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
