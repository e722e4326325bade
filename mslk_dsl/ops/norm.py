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


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
            config: dict | None = None) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim."""
    fast = native.fast_op("rmsnorm") if config is None and type(eps) is float and eps >= 0 else None
    if fast is not None:  # a layout seen before: one native call (see mslk_dsl.native)
        y = fast(x, weight, eps)
        if y is not native.MISS:
            return y
    try:  # the layout of the inputs, for the plan cache
        key = (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype, weight.device)
    except AttributeError:  # not tensors: the checks below say so
        key = None
    plan = _RMSNORM_PLANS.get(key) if config is None and type(eps) is float and eps >= 0 else None
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
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    a = check.rows(x)
    out = y.view(a.shape)
    sig = (check.aligned16(a, weight, out), dtype_name(a.dtype))
    kernel = _RMSNORM.kernel(a.device, sig, a.shape, config)
    kernel(a, weight, out, float(eps))
    if config is None:   # (an int eps becomes a new float object: no plan for it)
        native.remember("rmsnorm", (x, weight, eps), (y,), (a, weight, out, float(eps)), (0,), kernel)
    if config is None and a is x and check.compact_rows(a):
        _RMSNORM_PLANS.add(key, Plan(_RMSNORM, a.device, sig[1:], a.shape, check.aligned16(out), tuple(a.shape)))
    return y


def rmsnorm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual; y = rmsnorm(new_residual, weight, eps). Returns (y, new_residual)."""
    op = "rmsnorm_add"
    fast = native.fast_op(op) if config is None and type(eps) is float and eps >= 0 else None
    if fast is not None:  # a layout seen before: one native call (see mslk_dsl.native)
        result = fast(x, residual, weight, eps)
        if result is not native.MISS:
            return result
    try:  # the layout of the inputs, for the plan cache
        key = (x.shape, x.stride(), x.dtype, x.device, residual.shape, residual.stride(), residual.dtype,
               residual.device, weight.shape, weight.stride(), weight.dtype, weight.device)
    except AttributeError:  # not tensors: the checks below say so
        key = None
    plan = _RMSNORM_ADD_PLANS.get(key) if config is None and type(eps) is float and eps >= 0 else None
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
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y, new_residual
    a, r = check.rows(x), check.rows(residual)
    out, res = y.view(a.shape), new_residual.view(a.shape)
    sig = (check.aligned16(a, r, weight, out, res), dtype_name(a.dtype))
    kernel = _RMSNORM_ADD.kernel(a.device, sig, a.shape, config)
    kernel(a, r, weight, out, res, float(eps))
    if config is None:
        native.remember(op, (x, residual, weight, eps), (y, new_residual), (a, r, weight, out, res, float(eps)),
                        (0, 1), kernel)
    if config is None and a is x and r is residual and check.compact_rows(a):
        plan = Plan(_RMSNORM_ADD, a.device, sig[1:], a.shape, check.aligned16(out), tuple(a.shape))
        _RMSNORM_ADD_PLANS.add(key, plan)
    return y, new_residual
