"""Choosing the kernel for one call: device -> target -> template -> config -> kernel.

The first call for a (device, signature, problem, config) pays for the lookup (and maybe a
compile); later calls are one dict lookup. Launch plans (call.py, mslk_dsl.native) skip even that.
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from mslk_dsl.device import target_of
from mslk_dsl.errors import InputError, UnsupportedDeviceError

if TYPE_CHECKING:
    from mslk_dsl.template import Template

# jit (the cache, file locks, keys) and registry (template discovery) are imported on the first
# kernel choice, not with the op layer: `import mslk_dsl` stays cheap.

_DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in (
    torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e4m3fnuz,
    torch.int32, torch.int64)}


_placeholders: dict = {}


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (CUs on ROCm) of ``device``: split and persistent-grid sizes."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def placeholder(device: torch.device, dtype: torch.dtype, fill: int | float = 0,
                shape: tuple[int, ...] = (1,)) -> torch.Tensor:
    """A one-element tensor passed for an absent optional input (scale_ub=None, bias=None): the
    kernel, compiled for the absent case, never reads it; or, with ``fill``, a constant a kernel
    reads in place of the absent input (a row count of "all rows"). ``shape``: for a kernel that
    takes the input with more dimensions (a [1, 1] block table). Cached so calls allocate
    nothing (and launch plans may hold it).

    A constant first asked for while the stream captures a CUDA graph is made for that call
    only: the capture records its fill without running it (the graph fills it at each replay),
    so, cached, it would hold garbage for every eager call and every other graph. Not cached, it
    is no placeholder either (is_placeholder), so no launch plan holds it. An unread placeholder
    (fill 0) may be cached whatever it holds."""
    key = (device, dtype) if fill == 0 and shape == (1,) else (device, dtype, fill, shape)
    t = _placeholders.get(key)
    if t is None:
        t = torch.full(shape, fill, dtype=dtype, device=device)
        if fill == 0 or not _capturing(device):
            _placeholders[key] = t
    return t


def _stream(device: torch.device) -> int:
    """The current stream's handle on ``device`` (0 off the GPU): what per-stream buffers are keyed by."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def zeroed_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 counters, zero, for kernels that count arrivals in them and
    leave them zero again (split-K GEMM tiles, decode's fused merge): cached per device and
    stream, grown when a call needs more, so calls allocate and clear nothing. Kept with the
    placeholders, so a launch plan may hold them. One set per stream: kernels that run at the
    same time on different streams must not share counters; kernels of one stream run one after
    another.

    While the stream is capturing a CUDA graph, new counters' zeroing is only recorded, not run:
    they would hold garbage for every other graph or eager call until this graph replays. So a
    capturing call that finds no counters of the stream (made by an eager call before the
    capture) gets counters of its own, zeroed on every replay and kept by nobody else (not
    cached, so no launch plan holds them either)."""
    key = (device, torch.int32, "counters", _stream(device))
    t = _placeholders.get(key)
    if t is None or t.numel() < count:
        if _capturing(device):
            return torch.zeros(count, dtype=torch.int32, device=device)
        t = _placeholders[key] = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
    return t


# The most bytes of reusable scratch (stream_scratch) kept per device, stream and dtype; a call
# needing more allocates its own.
STREAM_SCRATCH_LIMIT = 64 << 20
STREAM_SCRATCH_VIEWS = 256  # cached views per device, stream and dtype before the cache is emptied


def stream_scratch(device: torch.device, dtype: torch.dtype, shapes: tuple) -> tuple | None:
    """Compact tensors of ``shapes`` (each 16-byte aligned) over one buffer of the current stream,
    for a launch that writes and reads them within the call (decode's split partials, routing
    workspaces): cached per device, stream and shapes, so later calls allocate nothing and a
    launch plan may hold them; such a launch must be stream-bound (declaration.Launch), as its
    plan then serves this stream only. Kernels of one stream run one after another, so calls on
    it may share the buffer; different shapes share it too. None (the caller allocates its own)
    past STREAM_SCRATCH_LIMIT bytes, and while the stream captures a CUDA graph: the graph keeps
    scratch of its own. A captured call served by a plan made before the capture uses the plan's
    scratch, as it uses the stream's counters (zeroed_counters): such a graph must not replay
    while the stream runs other work that holds them."""
    if _capturing(device):
        return None
    stream = _stream(device)
    key = (device, dtype, "scratch", stream, shapes)
    if (key, 0) in _placeholders:
        return tuple(_placeholders[(key, i)] for i in range(len(shapes)))
    align = max(16 // dtype.itemsize, 1)  # elements per 16 bytes
    sizes = [-(-math.prod(shape) // align) * align for shape in shapes]
    if sum(sizes) * dtype.itemsize > STREAM_SCRATCH_LIMIT:
        return None
    buffer_key = (device, dtype, "scratch buffer", stream)
    buffer = _placeholders.get(buffer_key)
    cached = [k for k in _placeholders if isinstance(k[0], tuple) and k[0][:4] == key[:4]]
    if buffer is None or buffer.numel() < sum(sizes) or len(cached) >= STREAM_SCRATCH_VIEWS:
        # Views no longer handed out (they stay valid for the plans that hold them, and are
        # freed with those plans): all of them when the buffer grows, and when calls of many
        # shapes (token counts of a server) have filled the cache.
        for k in cached:
            del _placeholders[k]
    if buffer is None or buffer.numel() < sum(sizes):
        # Grown to a power of two (at most the limit): plans keep views of every buffer they
        # were made with, so sizes that creep up with the token count (split-K partials follow M)
        # leave a few generations (under twice the limit in all), not one per size.
        elements = 1 << (max(sum(sizes), 1) - 1).bit_length()
        elements = max(sum(sizes), min(elements, STREAM_SCRATCH_LIMIT // dtype.itemsize))
        buffer = _placeholders[buffer_key] = torch.empty(elements, dtype=dtype, device=device)
    views, offset = [], 0
    for i, (shape, size) in enumerate(zip(shapes, sizes)):
        views.append(buffer[offset:offset + math.prod(shape)].view(shape))
        _placeholders[(key, i)] = views[-1]
        offset += size
    return tuple(views)


class Scratch(NamedTuple):
    """Scratch tensors of one launch (call_scratch): ``tensors`` for the kernel's arguments,
    ``per_call`` for Launch.scratch (those a plan must allocate afresh for every call: none when
    the stream's reusable scratch serves), ``stream_bound`` for Launch.stream_bound."""
    tensors: tuple
    per_call: tuple
    stream_bound: bool


def call_scratch(device: torch.device, dtype: torch.dtype, shapes: tuple, reuse: bool = True) -> Scratch:
    """Scratch a launch writes and reads within the call: with ``reuse`` the stream's reusable
    scratch (stream_scratch: repeat calls allocate nothing, and the launch is bound to the
    stream), else, or where that declines (a capture, past its size limit), tensors of this call.
    The caching allocator hands a freed block to the next call on the stream in the same way, so
    reuse orders nothing that allocation did not."""
    reused = stream_scratch(device, dtype, shapes) if reuse else None
    if reused is not None:
        return Scratch(reused, (), True)
    made = tuple(torch.empty(shape, dtype=dtype, device=device) for shape in shapes)
    return Scratch(made, made, False)


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is one of the placeholders (a launch plan may hold it for every call)."""
    return _placeholders.get((t.device, t.dtype)) is t or any(p is t for p in _placeholders.values())


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
        from mslk_dsl import registry

        templates = registry.templates_for(self.op, target)
        if not templates:
            supported = sorted({t for tpl in registry.get_templates(op=self.op) for t in tpl.targets})
            raise UnsupportedDeviceError(f"{self.op}: no template for target {target}; supported targets: "
                                         f"{', '.join(supported) or 'none'}")
        return templates[0]

    def choose(self, target: str, signature: tuple, problem: tuple, config: dict | None):
        """(template, config, signature dict) for a call: explicit config, stored tuning, or heuristic."""
        template = self.template_for(target)
        if len(signature) != len(self.sig_fields) or len(problem) != len(self.problem_fields):
            # a caller building the tuple by hand (a benchmark) that missed a part would get
            # some other signature's kernel: refuse (this runs on a selection miss only)
            raise InputError(f"{self.op}: a selection takes the signature {self.sig_fields} and the sizes "
                             f"{self.problem_fields}; got {signature} and {problem}")
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
        from mslk_dsl import jit

        target = target_of(device)
        template, config, sig = self.choose(target.name, signature, problem, config)
        return jit.get_kernel(template, config, target, sig), config
