"""Input checks shared by every op: each raises InputError (a ValueError) or InputTypeError (a
TypeError) naming the argument, before anything is launched. Kept cheap: they run on every call."""
from __future__ import annotations

import torch

from mslk_dsl.errors import InputError, InputTypeError, UnsupportedDeviceError
from mslk_dsl.templates._kernel_limits import VECTOR_BYTES, VECTOR_WIDTHS

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HALF_DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def tensor(op: str, name: str, t, dtypes=None, ndim: int | None = None, min_ndim: int = 1,
           unit_last_stride: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise InputTypeError(f"{op}: {name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if ndim is not None and t.dim() != ndim:
        raise InputError(f"{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dim() < min_ndim:
        raise InputError(f"{op}: {name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")
    if unit_last_stride and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise InputError(f"{op}: {name} must be contiguous in its last dimension (stride(-1) == 1), "
                         f"got strides {t.stride()}")


def nonempty_rows(op: str, name: str, t: torch.Tensor) -> None:
    """Row-wise reductions (absmax, mean square) are undefined over an empty row."""
    if t.dim() and t.shape[-1] == 0 and t.numel() == 0 and t.shape[:-1].numel() > 0:
        raise InputError(f"{op}: {name} has an empty last dimension (shape {tuple(t.shape)}); "
                         f"a row-wise reduction needs at least one element per row")


def same_device(op: str, first: str, t0: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.device != t0.device:
            raise InputError(f"{op}: {name} is on {t.device} but {first} is on {t0.device}")


def one_element(op: str, name: str, t, dtype: torch.dtype, like: torch.Tensor, like_name: str) -> None:
    """An optional one-element tensor the kernel reads on the device (MSLK's ``scale_ub``,
    ``valid_token_count``): absent, or of ``dtype``, one element, on ``like``'s device."""
    if t is None:
        return
    tensor(op, name, t, (dtype,), min_ndim=0)
    if t.numel() != 1:
        raise InputError(f"{op}: {name} must hold one element, got shape {tuple(t.shape)}")
    same_device(op, like_name, like, **{name: t})


def gpu(op: str, name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise UnsupportedDeviceError(f"{op}: {name} is on {t.device}; mslk-dsl kernels run on CUDA or ROCm "
                                     f"GPU tensors (targets with a template: {supported_targets(op)})")


def supported_targets(op: str) -> str:
    from mslk_dsl import registry

    return ", ".join(sorted({t for tpl in registry.get_templates(op=op) for t in tpl.targets})) or "none"


def shape(op: str, name: str, t: torch.Tensor, expected: tuple, why: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise InputError(f"{op}: {name} has shape {tuple(t.shape)}, expected {tuple(expected)} ({why})")


def same_dtype(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, like: str) -> None:
    if t.dtype != dtype:
        raise InputTypeError(f"{op}: {name} has dtype {t.dtype} but {like} has {dtype}; they must match")


def rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a compact [rows, cols] matrix: a view when it can be, else a copy (the kernels
    take compact row-major tensors; padded or permuted leading dims are copied, never misread)."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.is_contiguous() else t2.contiguous()


def tma_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` row-major from a 16-byte aligned address, as TMA loads it: ``t`` itself when it is,
    else a copy. (``contiguous()`` would return a contiguous tensor that starts off the boundary
    as it is, and the kernel's launcher would refuse it.)"""
    if t.is_contiguous() and t.data_ptr() % VECTOR_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def compact_rows(t: torch.Tensor) -> bool:
    """True for a 2-D tensor laid out exactly row-major (stride (cols, 1)); then torch.empty_like
    of it is row-major too. Plans that allocate outputs with empty_like require it."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == t.shape[1]


def vector_bytes(*tensors: torch.Tensor) -> int:
    """The row-wise templates' signature part ``vec_bytes``: the widest access (16, 8 or 4
    bytes of the first tensor's elements, else one element) that every row of every tensor admits. A
    width of v elements needs each tensor's rows to be a whole number of v elements, and each
    tensor to start on a multiple of v of its own elements, or of 16 bytes where those are wider
    (an fp32 weight under 8 bf16 values is read as two 16-byte accesses). No tensor needs more
    than 16-byte alignment, so the address modulo 16 that keys the launch plans decides it."""
    elem = tensors[0].element_size()
    for width in VECTOR_WIDTHS:
        v = width // elem
        if v > 1 and all(t.data_ptr() % min(v * t.element_size(), VECTOR_BYTES) == 0 and t.shape[-1] % v == 0
                         for t in tensors):
            return width
    return elem


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) of the bytes ``t``'s elements occupy ((0, 0) when it has none)."""
    if t.numel() == 0:
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the bytes a's elements span and b's intersect."""
    (a0, a1), (b0, b1) = byte_range(a), byte_range(b)
    return a0 < b1 and b0 < a1


def outputs(op: str, out, specs, device: torch.device, inputs: dict) -> tuple[torch.Tensor, ...]:
    """The op's output tensors: new ones when ``out`` is None, else the caller's ``out`` (a
    tensor for one output, a tuple for several) checked against ``specs``, one (shape, dtype)
    per output: exact dtype and shape, the inputs' device, contiguous, and no memory shared
    with an input (named in ``inputs``) or another output (the kernel reads its inputs while
    it writes)."""
    if out is None:
        return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs)
    if len(specs) == 1 and isinstance(out, torch.Tensor):
        given = (out,)
    elif len(specs) > 1 and isinstance(out, tuple) and len(out) == len(specs):
        given = out
    else:
        want = "a tensor" if len(specs) == 1 else f"a tuple of {len(specs)} tensors"
        raise InputTypeError(f"{op}: out must be {want}, got {type(out).__name__}")
    names = ["out"] if len(specs) == 1 else [f"out[{i}]" for i in range(len(specs))]
    for i, (name, t, (shape, dtype)) in enumerate(zip(names, given, specs)):
        tensor(op, name, t, (dtype,), min_ndim=0)
        if tuple(t.shape) != tuple(shape):
            raise InputError(f"{op}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if t.device != device:
            raise InputError(f"{op}: {name} is on {t.device} but the inputs are on {device}")
        if not t.is_contiguous():
            raise InputError(f"{op}: {name} must be contiguous, got strides {t.stride()}")
        for other, x in list(inputs.items()) + list(zip(names[:i], given[:i])):
            if x is not None and overlap(t, x):
                raise InputError(f"{op}: {name} shares memory with {other}")
    return given
