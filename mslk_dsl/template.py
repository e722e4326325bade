"""The template API: what a kernel template declares about itself.

A template file in ``templates/`` (or a directory on ``MSLK_DSL_TEMPLATE_PATH``) defines a
module-level ``TEMPLATE = Template(...)`` (or ``TEMPLATES = [...]``). Importing a template file
must stay cheap and must not import a DSL: ``cutlass`` / ``flydsl`` are imported inside
``build`` only, which runs in a compile process. That keeps discovery, keys, the cache and
the run path free of compilers, and keeps the two DSLs out of one process.

``build(config, target, sig)`` returns ``(launcher, compile_args)``:
  * CuTe DSL: ``launcher`` is a ``@cute.jit`` function, or a kernel class instance whose
    ``__call__`` is one (config in ``__init__``, one ``@cute.kernel`` method per kernel, as in
    NVIDIA's CuTe DSL examples), and ``compile_args`` its fake arguments
    (``cute.runtime.make_fake_compact_tensor`` with ``cute.sym_int`` sizes, and
    ``make_fake_stream(use_tvm_ffi_env_stream=True)`` last). The backend compiles it with
    TVM-FFI, so at run time the kernel takes torch tensors (and Python scalars) directly.
  * FlyDSL: ``launcher`` is a ``@flyc.jit`` function or such an instance (one class per config:
    see templates/_flydsl_kernels.py), ``compile_args`` CPU torch tensors (and scalars) used as
    placeholders; sizes stay dynamic.
At run time the op layer calls the loaded kernel with the op's calling convention (the same
for every template of an op), e.g. ``silu_mul``: ``kernel(x0, x1, out)``.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mslk_dsl.errors import ConfigError

Config = Mapping[str, Any]
Signature = Mapping[str, Any]


def config_name(config: Config) -> str:
    """A stable, human-readable name for a config: ``threads128_vec8``."""
    return "_".join(f"{k}{_short(v)}" for k, v in sorted(config.items()))


def _short(v: Any) -> str:
    if isinstance(v, (tuple, list)):
        return "x".join(_short(x) for x in v)
    return str(v)


@dataclass(frozen=True)
class Template:
    """One kernel template: an op, a backend, and a space of configs over targets.

    op:          op name, e.g. "silu_mul" (several templates may implement one op).
    backend:     "cute" or "flydsl".
    targets:     target names this template supports (see arch/*.toml).
    space:       config parameter -> allowed values; configs are the Cartesian product,
                 filtered by ``valid``. Use ``configs`` instead for an explicit list.
    signatures:  static signature part -> allowed values (e.g. dtype, alignment class).
                 Every value here becomes part of the KernelKey; dynamic sizes never do.
    signature_valid: (sig) -> bool, false for combinations of those values that no call has
                 (rmsnorm's fp32-weight flag with fp32 x, which is the plain case): they are
                 left out of ``all_signatures``, so nothing builds or lists them.
    valid:       (config, target, sig) -> bool, rejects configs a target or signature
                 cannot run (shared memory, vector width vs. alignment, ...).
    heuristic:   (target, sig, problem) -> config, the default choice for a problem
                 (a dict of the call's sizes). Must return a valid config.
    serves:      (config, problem) -> bool, false for the sizes a config cannot run (e.g. a
                 GEMM config that loads only 16 rows of x and so serves M <= 16); the op layer
                 refuses such a config for the call and the tuner does not offer it.
    build:       (config, target, sig) -> (launcher, compile_args); see module docstring.
    block_threads: (config) -> threads per block the config launches; without it a config's
                 ``threads`` value is taken. A config over the target's limit is not valid.
    occupancy_floor: the lowest occupancy (resident warps / waves over the SM's / CU's maximum)
                 its compiled kernels may have; checked over every compiled kernel.
    spills_allowed: its compiled kernels may spill (scratch memory, or AMD registers spilled): True,
                 or ``(config, target, sig) -> bool`` for the kernels that do, with the reason beside it.
    instructions: what the compiled code must contain, by the code the CPU compile tests read:
                 "ptx" and "sass" (CuTe, for sm90a), "isa" (FlyDSL, for gfx942); each a list of
                 regexes (the warpgroup MMAs, TMA copies or MFMAs the kernel is written to use),
                 so a change that loses one fails a CPU test (tests/test_compile_templates.py).
    name:        template name, unique per (op, backend); defaults to the module name.
    entry:       symbol name of the exported function (CuTe), defaults to the op name.
    """

    op: str
    backend: str
    targets: Sequence[str]
    signatures: Mapping[str, Sequence[Any]]
    heuristic: Callable[[str, Signature, Mapping[str, int]], Config]
    build: Callable[[Config, str, Signature], tuple]
    space: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    configs: Sequence[Config] = ()
    valid: Callable[[Config, str, Signature], bool] = lambda config, target, sig: True
    signature_valid: Callable[[Signature], bool] = lambda sig: True
    serves: Callable[[Config, Mapping[str, int]], bool] = lambda config, problem: True
    block_threads: Callable[[Config], int] | None = None
    occupancy_floor: float = 0.0
    spills_allowed: bool | Callable[[Config, str, Signature], bool] = False
    instructions: Mapping[str, Sequence[str]] = field(default_factory=dict)
    name: str = ""
    # Filled in by the registry: the file the template came from (for the key's digest).
    source: str = ""

    def __post_init__(self):
        code_kinds = {"cute": {"ptx", "sass"}, "flydsl": {"isa"}}.get(self.backend, set())
        unknown = set(self.instructions) - code_kinds
        if unknown:
            raise ConfigError(f"template {self.name or self.op!r}: instructions name {sorted(unknown)}; a "
                              f"{self.backend} template's code is checked as {sorted(code_kinds)}")

    def all_configs(self) -> list[dict]:
        if self.configs:
            return [dict(c) for c in self.configs]
        keys = sorted(self.space)
        return [dict(zip(keys, vals)) for vals in itertools.product(*(self.space[k] for k in keys))]

    def all_signatures(self) -> list[dict]:
        keys = sorted(self.signatures)
        every = (dict(zip(keys, vals)) for vals in itertools.product(*(self.signatures[k] for k in keys)))
        return [sig for sig in every if self.signature_valid(sig)]

    def valid_configs(self, target: str, sig: Signature) -> list[dict]:
        return [c for c in self.all_configs() if self.valid(c, target, sig) and not self.launch_problem(c, target)]

    def threads_of(self, config: Config) -> int | None:
        """Threads per block ``config`` launches: the template's ``block_threads``, else the
        config's ``threads`` (None where neither says)."""
        if self.block_threads is not None:
            return self.block_threads(config)
        threads = config.get("threads")
        return threads if isinstance(threads, int) else None

    def launch_problem(self, config: Config, target: str) -> str | None:
        """Why a GPU of ``target`` would refuse to launch ``config`` (more threads per block than
        it takes), or None: checked with validity, before anything is compiled."""
        from mslk_dsl.targets import get_target

        threads = self.threads_of(config)
        limit = get_target(target).limits.get("max_threads_per_block")
        if threads and limit and threads > limit:
            return f"{threads} threads per block, over the target's {limit}"
        return None

    def check_config(self, config: Config, target: str, sig: Signature,
                     problem: Mapping[str, int] | None = None) -> dict:
        """Validate an explicit config (for a call of sizes ``problem``, if given); raise
        ConfigError (a ValueError) naming what is wrong."""
        config = dict(config)
        known = self.all_configs()
        if config not in known:
            raise ConfigError(
                f"{self.op}: config {config} is not in the space of template {self.name!r}; "
                f"known configs: {[config_name(c) for c in known]}")
        if target not in self.targets:
            raise ConfigError(f"{self.op}: template {self.name!r} does not support target {target!r} "
                              f"(supports {list(self.targets)})")
        if not self.signature_valid(sig):
            raise ConfigError(f"{self.op}: signature {dict(sig)} is no call's (template {self.name!r} leaves it "
                              "out of its signatures)")
        if not self.valid(config, target, sig):
            raise ConfigError(f"{self.op}: config {config_name(config)} is not valid for target {target} and "
                              f"signature {dict(sig)} (template {self.name!r})")
        problem_text = self.launch_problem(config, target)
        if problem_text:
            raise ConfigError(f"{self.op}: config {config_name(config)} cannot launch on {target}: {problem_text} "
                              f"(template {self.name!r})")
        if problem is not None and not self.serves(config, problem):
            raise ConfigError(f"{self.op}: config {config_name(config)} does not serve a call of sizes "
                              f"{dict(problem)} (template {self.name!r}); use another config")
        return config


def require(condition: bool, template: str, config: Config, why: str) -> None:
    """A template's check of a config it is built with: ConfigError (a ValueError) naming the
    template and the config when ``condition`` is false. Use it, not ``assert``, which ``python -O`` removes and
    whose message names neither."""
    if not condition:
        raise ConfigError(f"template {template!r}, config {config_name(config)}: {why}")
