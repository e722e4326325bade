"""SwiGLU and row-wise FP8 quantization: silu_mul, quantize_fp8_row, dequantize_fp8_row,
silu_mul_quant. MSLK's names, argument order and semantics."""
from __future__ import annotations

import torch

from mslk_dsl import native
from mslk_dsl.device import target_of
from mslk_dsl.ops import validate as check
from mslk_dsl.ops.dispatch import KernelOp, Plan, PlanCache, dtype_name, placeholder

_SILU_MUL = KernelOp("silu_mul", ("aligned", "dtype"), ("M", "K"))
_QUANT = KernelOp("quantize_fp8_row", ("aligned", "dtype", "has_scale_ub"), ("M", "K"))
_SILU_MUL_QUANT = KernelOp("silu_mul_quant", ("aligned", "dtype", "has_scale_ub"), ("M", "K"))

_SILU_MUL_PLANS, _QUANT_PLANS, _SILU_MUL_QUANT_PLANS = PlanCache(), PlanCache(), PlanCache()

_FP8 = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}


def fp8_dtype_for(device: torch.device) -> torch.dtype:
    """The FP8 flavour of the device's target (e4m3fnuz on gfx942, e4m3fn elsewhere)."""
    try:
        return _FP8[target_of(device).fp8 or "e4m3fn"]
    except (NotImplementedError, RuntimeError, AssertionError):
        # No GPU to ask (tracing with fake/meta tensors on a CPU machine): the OCP flavour.
        return torch.float8_e4m3fn


def _pair(op: str, x0, x1) -> None:
    check.tensor(op, "x0", x0, check.FLOAT_DTYPES)
    check.tensor(op, "x1", x1, check.FLOAT_DTYPES)
    check.same_dtype(op, "x1", x1, x0.dtype, "x0")
    check.shape(op, "x1", x1, x0.shape, "x0 and x1 must have the same shape")
    check.same_device(op, "x0", x0, x1=x1)


def _scale_ub(op: str, scale_ub, x: torch.Tensor, x_name: str) -> torch.Tensor | None:
    if scale_ub is None:
        return None
    check.tensor(op, "scale_ub", scale_ub, (torch.float32,), min_ndim=0)
    if scale_ub.numel() != 1:
        raise ValueError(f"{op}: scale_ub must hold one element, got shape {tuple(scale_ub.shape)}")
    check.same_device(op, x_name, x, scale_ub=scale_ub)
    return scale_ub.reshape(1)


def silu_mul(x0: torch.Tensor, x1: torch.Tensor, *, out: torch.Tensor | None = None,
             config: dict | None = None) -> torch.Tensor:
    """silu(x0) * x1 elementwise (fp32 math, result in the input dtype); any leading dims.
    ``out``: a contiguous tensor of x0's shape and dtype to write into instead of allocating."""
    if out is not None:
        if config is None and native.run_into("silu_mul", (x0, x1), (out,)):
            return out
    else:
        fast = native.fast_op("silu_mul") if config is None else None
        if fast is not None:  # a layout seen before: one native call (see mslk_dsl.native)
            y = fast(x0, x1)
            if y is not native.MISS:
                return y
    try:  # the layout of the inputs, for the plan cache
        key = (x0.shape, x0.stride(), x0.dtype, x0.device, x1.shape, x1.stride(), x1.dtype, x1.device)
    except AttributeError:  # not tensors: the checks below say so
        key = None
    plan = _SILU_MUL_PLANS.get(key) if config is None and out is None else None
    if plan is not None:  # seen and validated before: launch
        y = torch.empty_like(x0)  # no shape, dtype or device arguments to parse
        kernel = plan.kernel(not (x0.data_ptr() | x1.data_ptr()) & 15)
        kernel(x0, x1, y)
        if not plan.native_done:
            plan.native_done = native.remember("silu_mul", (x0, x1), (y,), (x0, x1, y), (0,), kernel) is not None
        return y
    _pair("silu_mul", x0, x1)
    check.gpu("silu_mul", "x0", x0)
    (y,) = check.outputs("silu_mul", out, [(x0.shape, x0.dtype)], x0.device, {"x0": x0, "x1": x1})
    if y.numel() == 0:
        return y
    a, b = check.rows(x0), check.rows(x1)
    o = y.view(a.shape)
    sig = (check.aligned16(a, b, o), dtype_name(a.dtype))
    kernel = _SILU_MUL.kernel(a.device, sig, a.shape, config)
    kernel(a, b, o)
    if config is None and out is not None:
        native.remember_into("silu_mul", (x0, x1), (y,), (a, b, o), kernel)
    elif config is None:
        native.remember("silu_mul", (x0, x1), (y,), (a, b, o), (0,), kernel)
        if a is x0 and b is x1 and check.compact_rows(a):
            _SILU_MUL_PLANS.add(key, Plan(_SILU_MUL, a.device, sig[1:], a.shape, check.aligned16(o), tuple(a.shape)))
    return y


def quantize_fp8_row(x: torch.Tensor, scale_ub: torch.Tensor | None = None, *,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None,
                     config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax FP8 quantization. Returns (xq [..., K] fp8, scale [...] fp32) where
    ``x ~= xq.float() * scale[..., None]``; rows of zeros give xq = 0 and a finite scale.
    ``out``: contiguous (xq, scale) tensors to write into instead of allocating."""
    op = "quantize_fp8_row"
    inputs = (x,) if scale_ub is None else (x, scale_ub)
    if out is not None:
        if config is None and native.run_into(op, inputs, out):
            return out
    else:
        fast = native.fast_op(op) if config is None else None
        if fast is not None:  # a layout seen before: one native call (see mslk_dsl.native)
            result = fast(x) if scale_ub is None else fast(x, scale_ub)
            if result is not native.MISS:
                return result
    try:  # the layout of the inputs, for the plan cache
        key = (x.shape, x.stride(), x.dtype, x.device)
    except AttributeError:  # not tensors: the checks below say so
        key = None
    plan = _QUANT_PLANS.get(key) if config is None and scale_ub is None and out is None else None
    if plan is not None:  # seen and validated before: launch
        xq = torch.empty_like(x, dtype=plan.out_dtype)
        scale = x.new_empty(plan.shape[0], dtype=torch.float32)
        kernel, ub = plan.kernel(not x.data_ptr() & 15), placeholder(x.device, torch.float32)
        kernel(x, ub, xq, scale)
        if not plan.native_done:
            plan.native_done = native.remember(op, (x,), (xq, scale), (x, ub, xq, scale), (0, 1), kernel,
                                               held=(ub,)) is not None
        return xq, scale
    check.tensor(op, "x", x, check.FLOAT_DTYPES)
    check.nonempty_rows(op, "x", x)
    ub = _scale_ub(op, scale_ub, x, "x")
    check.gpu(op, "x", x)
    xq, scale = check.outputs(op, out, _quant_specs(x), x.device, {"x": x, "scale_ub": scale_ub})
    if x.numel() == 0:
        return xq, scale
    a = check.rows(x)
    q = xq.view(a.shape)
    sig = (check.aligned16(a, q), dtype_name(a.dtype), ub is not None)
    ub = ub if ub is not None else placeholder(a.device, torch.float32)
    kernel = _QUANT.kernel(a.device, sig, a.shape, config)
    kernel(a, ub, q, scale.view(-1))
    _remember_quant(op, config, inputs, out, (xq, scale), (a, ub, q, scale.view(-1)), kernel, ub)
    if config is None and scale_ub is None and out is None and a is x and check.compact_rows(a):
        _QUANT_PLANS.add(key, Plan(_QUANT, a.device, sig[1:], a.shape, check.aligned16(q), tuple(a.shape), q.dtype))
    return xq, scale


def _quant_specs(x: torch.Tensor) -> list:
    """(shape, dtype) of quantize's outputs xq and scale for input ``x``."""
    return [(x.shape, fp8_dtype_for(x.device)), (x.shape[:-1], torch.float32)]


def _remember_quant(op, config, inputs, out, outputs, args, kernel, ub) -> None:
    """Native plan for a quantizing call: into the caller's ``out``, or allocating (xq, scale)."""
    if config is not None:
        return
    if out is not None:
        native.remember_into(op, inputs, outputs, args, kernel, held=(ub,))
    else:
        native.remember(op, inputs, outputs, args, (0, 1), kernel, held=(ub,))


def silu_mul_quant(x0: torch.Tensor, x1: torch.Tensor, scale_ub: torch.Tensor | None = None, *,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None,
                   config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_row(silu_mul(x0, x1), scale_ub), fused: one read of x0/x1, one write of xq.
    ``out``: contiguous (xq, scale) tensors to write into instead of allocating."""
    op = "silu_mul_quant"
    inputs = (x0, x1) if scale_ub is None else (x0, x1, scale_ub)
    if out is not None:
        if config is None and native.run_into(op, inputs, out):
            return out
    else:
        fast = native.fast_op(op) if config is None else None
        if fast is not None:  # a layout seen before: one native call (see mslk_dsl.native)
            result = fast(x0, x1) if scale_ub is None else fast(x0, x1, scale_ub)
            if result is not native.MISS:
                return result
    try:  # the layout of the inputs, for the plan cache
        key = (x0.shape, x0.stride(), x0.dtype, x0.device, x1.shape, x1.stride(), x1.dtype, x1.device)
    except AttributeError:  # not tensors: the checks below say so
        key = None
    plan = _SILU_MUL_QUANT_PLANS.get(key) if config is None and scale_ub is None and out is None else None
    if plan is not None:  # seen and validated before: launch
        xq = torch.empty_like(x0, dtype=plan.out_dtype)
        scale = x0.new_empty(plan.shape[0], dtype=torch.float32)
        kernel, ub = plan.kernel(not (x0.data_ptr() | x1.data_ptr()) & 15), placeholder(x0.device, torch.float32)
        kernel(x0, x1, ub, xq, scale)
        if not plan.native_done:
            plan.native_done = native.remember(op, (x0, x1), (xq, scale), (x0, x1, ub, xq, scale), (0, 1), kernel,
                                               held=(ub,)) is not None
        return xq, scale
    _pair(op, x0, x1)
    check.nonempty_rows(op, "x0", x0)
    ub = _scale_ub(op, scale_ub, x0, "x0")
    check.gpu(op, "x0", x0)
    xq, scale = check.outputs(op, out, _quant_specs(x0), x0.device, {"x0": x0, "x1": x1, "scale_ub": scale_ub})
    if x0.numel() == 0:
        return xq, scale
    a, b = check.rows(x0), check.rows(x1)
    q = xq.view(a.shape)
    sig = (check.aligned16(a, b, q), dtype_name(a.dtype), ub is not None)
    ub = ub if ub is not None else placeholder(a.device, torch.float32)
    kernel = _SILU_MUL_QUANT.kernel(a.device, sig, a.shape, config)
    kernel(a, b, ub, q, scale.view(-1))
    _remember_quant(op, config, inputs, out, (xq, scale), (a, b, ub, q, scale.view(-1)), kernel, ub)
    if config is None and scale_ub is None and out is None and a is x0 and b is x1 and check.compact_rows(a):
        plan = Plan(_SILU_MUL_QUANT, a.device, sig[1:], a.shape, check.aligned16(q), tuple(a.shape), q.dtype)
        _SILU_MUL_QUANT_PLANS.add(key, plan)
    return xq, scale


def dequantize_fp8_row(xq: torch.Tensor, scale: torch.Tensor,
                       out_dtype: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    """Inverse of quantize_fp8_row: xq.float() * scale[..., None], in ``out_dtype``."""
    op = "dequantize_fp8_row"
    check.tensor(op, "xq", xq, check.FP8_DTYPES)
    check.tensor(op, "scale", scale, (torch.float32,), min_ndim=0)
    check.shape(op, "scale", scale, xq.shape[:-1], "one scale per row of xq")
    check.same_device(op, "xq", xq, scale=scale)
    return (xq.float() * scale.unsqueeze(-1)).to(out_dtype or torch.bfloat16)
