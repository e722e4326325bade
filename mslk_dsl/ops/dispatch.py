"""Choosing and caching the kernel for one call: device -> target -> template -> config -> kernel.

The first call for a (device, signature, problem, config) pays for the lookup (and maybe a
compile); later calls are one dict lookup, so the per-call host cost stays near a native op.
"""
from __future__ import annotations

import torch

from mslk_dsl import jit, registry
from mslk_dsl.device import target_of
from mslk_dsl.errors import UnsupportedDeviceError
from mslk_dsl.template import Template

_DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in (
    torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e4m3fnuz,
    torch.int32, torch.int64)}


_placeholders: dict = {}


def placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor passed for an absent optional input (scale_ub=None, bias=None): the
    kernel, compiled for the absent case, never reads it. Cached so calls allocate nothing."""
    t = _placeholders.get((device, dtype))
    if t is None:
        t = _placeholders[(device, dtype)] = torch.zeros(1, dtype=dtype, device=device)
    return t


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


class KernelOp:
    """Kernel selection for one op. ``signature`` is a tuple of values in ``sig_fields`` order;
    ``problem`` a tuple of the sizes in ``problem_fields`` order (fed to the heuristic)."""

    MAX_MEMO = 4096

    def __init__(self, op: str, sig_fields: tuple[str, ...], problem_fields: tuple[str, ...]):
        self.op = op
        self.sig_fields = sig_fields
        self.problem_fields = problem_fields
        self._memo: dict = {}

    def kernel(self, device: torch.device, signature: tuple, problem: tuple, config: dict | None = None):
        return self.selection(device, signature, problem, config)[0]

    def selection(self, device: torch.device, signature: tuple, problem: tuple, config: dict | None = None):
        """(kernel, its config) for a call, memoized: for ops whose arguments depend on the config."""
        memo_key = (device, signature, problem, None if config is None else tuple(sorted(config.items())))
        selected = self._memo.get(memo_key)
        if selected is None:
            selected = self._select(device, signature, problem, config)
            if len(self._memo) >= self.MAX_MEMO:
                self._memo.clear()
            self._memo[memo_key] = selected
        return selected

    def template_for(self, target: str) -> Template:
        templates = registry.templates_for(self.op, target)
        if not templates:
            supported = sorted({t for tpl in registry.get_templates(op=self.op) for t in tpl.targets})
            raise UnsupportedDeviceError(f"{self.op}: no template for target {target}; supported targets: "
                                         f"{', '.join(supported) or 'none'}")
        return templates[0]

    def choose(self, target: str, signature: tuple, problem: tuple, config: dict | None):
        """(template, config, signature dict) for a call: explicit config, stored tuning, or heuristic."""
        template = self.template_for(target)
        sig = dict(zip(self.sig_fields, signature))
        sizes = dict(zip(self.problem_fields, problem))
        if config is not None:
            return template, template.check_config(config, target, sig, sizes), sig
        from mslk_dsl import tuning

        tuned = tuning.lookup(self.op, target, sig, sizes)
        if tuned is not None and tuned in template.valid_configs(target, sig) and template.serves(tuned, sizes):
            return template, tuned, sig
        chosen = template.heuristic(target, sig, sizes)
        return template, template.check_config(chosen, target, sig, sizes), sig

    def _select(self, device, signature, problem, config):
        target = target_of(device)
        template, config, sig = self.choose(target.name, signature, problem, config)
        return jit.get_kernel(template, config, target, sig), config


class Plan:
    """The kernels for one validated input layout (shapes, strides, dtypes, devices) of an op.

    A repeat call with the same layout skips validation and kernel selection: it only checks the
    data pointers' alignment and launches. ``rows_aligned`` says whether the rows are a multiple
    of 16 bytes; the 16-byte-vector kernel is used when the pointers are aligned too. Each kernel
    is looked up on first use.
    """

    __slots__ = ("op", "device", "sig_tail", "problem", "rows_aligned", "shape", "out_dtype", "scratch",
                 "native_done", "_kernels")

    def __init__(self, op: KernelOp, device: torch.device, sig_tail: tuple, problem: tuple,
                 rows_aligned: bool | None, shape: tuple = (), out_dtype: torch.dtype | None = None,
                 scratch: int = 0):
        self.op, self.device, self.sig_tail, self.problem = op, device, sig_tail, problem
        self.rows_aligned = rows_aligned  # None: the op's signature has no alignment part
        self.shape, self.out_dtype = shape, out_dtype  # of the output the op allocates
        self.scratch = scratch  # elements of the scratch buffer the chosen kernel takes (0: none)
        # Whether the native launcher has had this layout offered (mslk_dsl.native.remember): a
        # layout it refuses must not cost that check on every call of this path.
        self.native_done = False
        self._kernels: dict = {}

    def kernel(self, pointers_aligned: bool = True):
        aligned = bool(self.rows_aligned and pointers_aligned) if self.rows_aligned is not None else None
        kernel = self._kernels.get(aligned)
        if kernel is None:
            sig = self.sig_tail if aligned is None else (aligned, *self.sig_tail)
            kernel = self._kernels[aligned] = self.op.kernel(self.device, sig, self.problem, None)
        return kernel


class PlanCache(dict):
    """Plans of one op keyed by the inputs' layout; bounded, since shapes vary in serving."""

    MAX = 1024

    def add(self, key, plan: Plan) -> Plan:
        if len(self) >= self.MAX:
            self.clear()
        self[key] = plan
        return plan
