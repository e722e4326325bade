"""RMSNorm and the fused residual-add RMSNorm (bf16/fp16 in, fp32 math)."""
from __future__ import annotations

import torch

from mslk_dsl import native
from mslk_dsl.ops import validate as check
from mslk_dsl.ops.dispatch import KernelOp, Plan, PlanCache, dtype_name

_RMSNORM = KernelOp("rmsnorm", ("aligned", "dtype"), ("M", "N"))
_RMSNORM_ADD = KernelOp("rmsnorm_add", ("aligned", "dtype"), ("M", "N"))

_RMSNORM_PLANS, _RMSNORM_ADD_PLANS = PlanCache(), PlanCache()

MAX_HIDDEN = 16384


def _check(op: str, x, weight, eps) -> None:
    check.tensor(op, "x", x, check.HALF_DTYPES)
    check.tensor(op, "weight", weight, check.HALF_DTYPES, ndim=1)
    check.same_dtype(op, "weight", weight, x.dtype, "x")
    check.shape(op, "weight", weight, x.shape[-1:], "one weight per hidden element of x")
    check.same_device(op, "x", x, weight=weight)
    check.nonempty_rows(op, "x", x)
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"{op}: hidden size {x.shape[-1]} of x exceeds the supported {MAX_HIDDEN}")
    if not isinstance(eps, (float, int)) or eps < 0:
        raise ValueError(f"{op}: eps must be a non-negative float, got {eps!r}")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None,
            config: dict | None = None) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim. ``out``: a contiguous tensor of
    x's shape and dtype to write into instead of allocating."""
    plain = config is None and type(eps) is float and eps >= 0  # what native plans are kept for
    if out is not None:
        if plain and native.run_into("rmsnorm", (x, weight, eps), (out,)):
            return out
    else:
        fast = native.fast_op("rmsnorm") if plain else None
        if fast is not None:  # a layout seen before: one native call (see mslk_dsl.native)
            y = fast(x, weight, eps)
            if y is not native.MISS:
                return y
    try:  # the layout of the inputs, for the plan cache
        key = (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype, weight.device)
    except AttributeError:  # not tensors: the checks below say so
        key = None
    plan = _RMSNORM_PLANS.get(key) if plain and out is None else None
    if plan is not None:  # seen and validated before: launch
        y = torch.empty_like(x)  # no shape, dtype or device arguments to parse
        kernel = plan.kernel(not (x.data_ptr() | weight.data_ptr()) & 15)
        kernel(x, weight, y, eps)
        if not plan.native_done:
            plan.native_done = native.remember("rmsnorm", (x, weight, eps), (y,), (x, weight, y, eps), (0,),
                                               kernel) is not None
        return y
    _check("rmsnorm", x, weight, eps)
    check.gpu("rmsnorm", "x", x)
    (y,) = check.outputs("rmsnorm", out, [(x.shape, x.dtype)], x.device, {"x": x, "weight": weight})
    if y.numel() == 0:
        return y
    a = check.rows(x)
    o = y.view(a.shape)
    sig = (check.aligned16(a, weight, o), dtype_name(a.dtype))
    kernel = _RMSNORM.kernel(a.device, sig, a.shape, config)
    kernel(a, weight, o, float(eps))
    # (an int eps becomes a new float object: no native plan for it)
    if config is None and out is not None:
        native.remember_into("rmsnorm", (x, weight, eps), (y,), (a, weight, o, float(eps)), kernel)
    elif config is None:
        native.remember("rmsnorm", (x, weight, eps), (y,), (a, weight, o, float(eps)), (0,), kernel)
        if a is x and check.compact_rows(a):
            _RMSNORM_PLANS.add(key, Plan(_RMSNORM, a.device, sig[1:], a.shape, check.aligned16(o), tuple(a.shape)))
    return y


def rmsnorm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                out: tuple[torch.Tensor, torch.Tensor] | None = None,
                config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual; y = rmsnorm(new_residual, weight, eps). Returns (y, new_residual).
    ``out``: contiguous (y, new_residual) tensors of x's shape and dtype to write into."""
    op = "rmsnorm_add"
    plain = config is None and type(eps) is float and eps >= 0  # what native plans are kept for
    if out is not None:
        if plain and native.run_into(op, (x, residual, weight, eps), out):
            return out
    else:
        fast = native.fast_op(op) if plain else None
        if fast is not None:  # a layout seen before: one native call (see mslk_dsl.native)
            result = fast(x, residual, weight, eps)
            if result is not native.MISS:
                return result
    try:  # the layout of the inputs, for the plan cache
        key = (x.shape, x.stride(), x.dtype, x.device, residual.shape, residual.stride(), residual.dtype,
               residual.device, weight.shape, weight.stride(), weight.dtype, weight.device)
    except AttributeError:  # not tensors: the checks below say so
        key = None
    plan = _RMSNORM_ADD_PLANS.get(key) if plain and out is None else None
    if plan is not None:  # seen and validated before: launch
        y, new_residual = torch.empty_like(x), torch.empty_like(x)
        aligned = not (x.data_ptr() | residual.data_ptr() | weight.data_ptr()) & 15
        kernel = plan.kernel(aligned)
        kernel(x, residual, weight, y, new_residual, eps)
        if not plan.native_done:
            plan.native_done = native.remember(op, (x, residual, weight, eps), (y, new_residual),
                                               (x, residual, weight, y, new_residual, eps), (0, 1), kernel) is not None
        return y, new_residual
    _check(op, x, weight, eps)
    check.tensor(op, "residual", residual, check.HALF_DTYPES)
    check.same_dtype(op, "residual", residual, x.dtype, "x")
    check.shape(op, "residual", residual, x.shape, "residual must have the shape of x")
    check.same_device(op, "x", x, residual=residual)
    check.gpu(op, "x", x)
    y, new_residual = check.outputs(op, out, [(x.shape, x.dtype)] * 2, x.device,
                                    {"x": x, "residual": residual, "weight": weight})
    if y.numel() == 0:
        return y, new_residual
    a, r = check.rows(x), check.rows(residual)
    o, res = y.view(a.shape), new_residual.view(a.shape)
    sig = (check.aligned16(a, r, weight, o, res), dtype_name(a.dtype))
    kernel = _RMSNORM_ADD.kernel(a.device, sig, a.shape, config)
    kernel(a, r, weight, o, res, float(eps))
    inputs, args = (x, residual, weight, eps), (a, r, weight, o, res, float(eps))
    if config is None and out is not None:
        native.remember_into(op, inputs, (y, new_residual), args, kernel)
    elif config is None:
        native.remember(op, inputs, (y, new_residual), args, (0, 1), kernel)
        if a is x and r is residual and check.compact_rows(a):
            plan = Plan(_RMSNORM_ADD, a.device, sig[1:], a.shape, check.aligned16(o), tuple(a.shape))
            _RMSNORM_ADD_PLANS.add(key, plan)
    return y, new_residual
