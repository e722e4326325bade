"""Targets as data: the arch/*.toml descriptors and the code that reads them."""
from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass, field
from importlib import resources

from mslk_dsl.errors import InputError, UnsupportedDeviceError


@dataclass(frozen=True)
class Target:
    """What a compile target is. ``name`` is the key used everywhere (``sm90a``, ``gfx942``)."""

    name: str
    vendor: str            # "nvidia" | "amd"
    backend: str           # the DSL that compiles for it: "cute" | "flydsl"
    dsl_arch: str          # the DSL's own arch string: "sm_90a", "gfx942"
    compute_capability: tuple[int, ...]
    warp_size: int
    smem_per_block: int
    fp8: str               # "e4m3fn" | "e4m3fnuz" | "" (no FP8)
    matrix_instructions: tuple[str, ...]
    # [limits]: what an SM / CU holds, for mslk_dsl.resources (occupancy and launch checks).
    limits: dict = field(default_factory=dict, compare=False)

    @property
    def fp8_dtype_name(self) -> str:
        return f"float8_{self.fp8}" if self.fp8 else ""

    @property
    def fp8_max(self) -> float:
        return {"e4m3fn": 448.0, "e4m3fnuz": 240.0}.get(self.fp8, 0.0)

    def __str__(self) -> str:
        return self.name


@functools.cache
def all_targets() -> dict[str, Target]:
    found = {}
    for item in resources.files("mslk_dsl.arch").iterdir():
        if not item.name.endswith(".toml"):
            continue
        data = tomllib.loads(item.read_text())
        data["compute_capability"] = tuple(data.get("compute_capability", ()))
        data["matrix_instructions"] = tuple(data.get("matrix_instructions", ()))
        target = Target(**data)
        found[target.name] = target
    return dict(sorted(found.items()))


def get_target(name: str) -> Target:
    targets = all_targets()
    if name not in targets:
        raise InputError(f"unknown target {name!r}; known targets: {', '.join(targets)}")
    return targets[name]


def target_for_cuda_capability(major: int, minor: int) -> Target:
    """The most specific target whose compute capability matches (sm_90 runs sm90a code)."""
    for t in all_targets().values():
        if t.vendor == "nvidia" and t.compute_capability == (major, minor):
            return t
    for t in all_targets().values():  # same major, any minor: e.g. sm_86 runs sm80 code
        if t.vendor == "nvidia" and t.compute_capability[:1] == (major,):
            return t
    raise UnsupportedDeviceError(f"no mslk-dsl target for CUDA compute capability {major}.{minor}; "
                                 f"known: {[t.name for t in all_targets().values() if t.vendor == 'nvidia']}")


def target_for_gfx(arch: str) -> Target:
    base = arch.split(":")[0]
    t = all_targets().get(base)
    if t is None or t.vendor != "amd":
        raise UnsupportedDeviceError(f"no mslk-dsl target for AMD GPU {arch!r}; "
                                     f"known: {[t.name for t in all_targets().values() if t.vendor == 'amd']}")
    return t
