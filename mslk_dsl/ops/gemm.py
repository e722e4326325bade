"""GEMMs in MSLK's convention: x [M, K] activations, w [N, K] weights, out = x @ w.T."""
from __future__ import annotations

import torch

from mslk_dsl import native
from mslk_dsl.ops import validate as check
from mslk_dsl.ops.dispatch import KernelOp, Plan, PlanCache, dtype_name, placeholder
from mslk_dsl.ops.elementwise import fp8_dtype_for
from mslk_dsl.templates import _cute_gemm_configs as gemm_configs

_BF16_GEMM = KernelOp("bf16_gemm", ("dtype",), ("M", "N", "K"))
_F8F8BF16_ROWWISE = KernelOp("f8f8bf16_rowwise", ("has_bias",), ("M", "N", "K"))

_BF16_GEMM_PLANS, _F8F8BF16_ROWWISE_PLANS = PlanCache(), PlanCache()

# TMA (and the MFMA loaders) need 16-byte aligned rows: K and N elements must be multiples of this.
_ALIGN_BYTES = 16
# Split-K kernels index their fp32 partials [split_k, M, N] with 32-bit offsets.
_MAX_PARTIALS = 2**31


def _operands(op: str, x, w, dtypes, names=("x", "w")) -> None:
    xn, wn = names
    check.tensor(op, xn, x, dtypes, ndim=2)
    check.tensor(op, wn, w, dtypes, ndim=2)
    check.same_dtype(op, wn, w, x.dtype, xn)
    check.same_device(op, xn, x, **{wn: w})
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: {wn} has shape {tuple(w.shape)} but {xn} has K={x.shape[1]}; "
                         f"{wn} must be [N, K]")
    per = _ALIGN_BYTES // x.element_size()
    for name, size in (("K", x.shape[1]), ("N", w.shape[0])):
        if size % per:
            raise ValueError(f"{op}: {name}={size} must be a multiple of {per} for {x.dtype} "
                             f"(16-byte aligned rows for TMA); pad the weight")


def _compact(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() and t.data_ptr() % _ALIGN_BYTES == 0 else t.contiguous()


def _gemm_output(op: str, out, m: int, n: int, dtype: torch.dtype, device, inputs: dict):
    """(the caller's checked ``out`` or a new [M, N] tensor, the tensor the kernel writes): a
    caller's ``out`` whose start is not 16-byte aligned (TMA stores need it) gets an aligned
    temporary, copied into ``out`` afterwards."""
    (result,) = check.outputs(op, out, [((m, n), dtype)], device, inputs)
    if out is None or result.data_ptr() % _ALIGN_BYTES == 0:
        return result, result
    return result, torch.empty((m, n), dtype=dtype, device=device)


def bf16_gemm(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor | None = None,
              config: dict | None = None) -> torch.Tensor:
    """out = x @ w.T for bf16 or fp16 inputs (fp32 accumulation, output in the input dtype).
    ``out``: a contiguous [M, N] tensor of x's dtype to write into instead of allocating."""
    if out is not None:
        if config is None and native.run_into("bf16_gemm", (x, w), (out,)):
            return out
    else:
        fast = native.fast_op("bf16_gemm") if config is None else None
        if fast is not None:  # a layout seen before: one native call (see mslk_dsl.native)
            y = fast(x, w)
            if y is not native.MISS:
                return y
    try:  # the layout of the inputs, for the plan cache
        key = (x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype, w.device)
    except AttributeError:  # not tensors: the checks below say so
        key = None
    plan = _BF16_GEMM_PLANS.get(key) if config is None and out is None else None
    if plan is not None and not (x.data_ptr() | w.data_ptr()) & 15:  # seen and validated before
        y = x.new_empty(plan.shape)  # no dtype or device arguments to parse
        kernel = plan.kernel()
        outputs = (y, x.new_empty(plan.scratch, dtype=torch.float32)) if plan.scratch else (y,)
        kernel(x, w, *outputs)
        if not plan.native_done:
            plan.native_done = native.remember("bf16_gemm", (x, w), outputs, (x, w, *outputs), (0,), kernel) is not None
        return y
    _operands("bf16_gemm", x, w, check.HALF_DTYPES)
    check.gpu("bf16_gemm", "x", x)
    M, K = x.shape
    N = w.shape[0]
    y, target = _gemm_output("bf16_gemm", out, M, N, x.dtype, x.device, {"x": x, "w": w})
    if y.numel() == 0:
        return y
    if K == 0:
        return y.zero_()
    a, b = _compact(x), _compact(w)
    kernel, chosen = _BF16_GEMM.selection(a.device, (dtype_name(a.dtype),), (M, N, K), config)
    # Split-K configs (decode-sized M) sum K ranges in an fp32 partials buffer [split_k, M, N];
    # stream-K configs sum the last wave's tile pieces in one of a fixed size per config.
    scratch = gemm_configs.partials_elements(chosen, M, N)
    if scratch >= _MAX_PARTIALS:
        split = chosen.get("split_k", 1)
        raise ValueError(f"bf16_gemm: config split_k={split} needs split_k * M * N < 2**31 "
                         f"(M={M}, N={N}); split-K is for small M, use a config without it")
    partials = (torch.empty(scratch, dtype=torch.float32, device=a.device),) if scratch else ()
    kernel(a, b, target, *partials)
    if target is not y:
        y.copy_(target)
    if config is None and out is not None:
        native.remember_into("bf16_gemm", (x, w), (y,), (a, b, target, *partials), kernel, scratch=partials)
    elif config is None:
        native.remember("bf16_gemm", (x, w), (y, *partials), (a, b, y, *partials), (0,), kernel)
        if a is x and b is w:
            _BF16_GEMM_PLANS.add(key, Plan(_BF16_GEMM, a.device, (dtype_name(a.dtype),), (M, N, K), None, (M, N),
                                           scratch=scratch))
    return y


def f8f8bf16_rowwise(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                     config: dict | None = None) -> torch.Tensor:
    """out = (xq @ wq.T) * x_scale[:, None] * w_scale[None, :] (+ bias), bf16 out; the scales are
    the ones quantize_fp8_row returns. ``out``: a contiguous [M, N] bf16 tensor to write into
    instead of allocating."""
    op = "f8f8bf16_rowwise"
    inputs = (xq, wq, x_scale, w_scale) if bias is None else (xq, wq, x_scale, w_scale, bias)
    if out is not None:
        if config is None and native.run_into(op, inputs, (out,)):
            return out
    else:
        fast = native.fast_op(op) if config is None else None
        if fast is not None:  # a layout seen before: one native call (see mslk_dsl.native)
            y = fast(*inputs)
            if y is not native.MISS:
                return y
    try:  # the layout of the inputs, for the plan cache
        key = (xq.shape, xq.stride(), xq.dtype, xq.device, wq.shape, wq.stride(), wq.dtype, wq.device,
               x_scale.shape, x_scale.stride(), x_scale.dtype, x_scale.device,
               w_scale.shape, w_scale.stride(), w_scale.dtype, w_scale.device)
    except AttributeError:  # not tensors: the checks below say so
        key = None
    plan = _F8F8BF16_ROWWISE_PLANS.get(key) if config is None and bias is None and out is None else None
    if plan is not None and not (xq.data_ptr() | wq.data_ptr()) & 15:  # seen and validated before
        y = xq.new_empty(plan.shape, dtype=torch.bfloat16)
        kernel, no_bias = plan.kernel(), placeholder(xq.device, torch.bfloat16)
        kernel(xq, wq, x_scale, w_scale, no_bias, y)
        if not plan.native_done:
            plan.native_done = native.remember(op, (xq, wq, x_scale, w_scale), (y,),
                                               (xq, wq, x_scale, w_scale, no_bias, y), (0,), kernel,
                                               held=(no_bias,)) is not None
        return y
    _operands(op, xq, wq, check.FP8_DTYPES, names=("xq", "wq"))
    fp8 = fp8_dtype_for(xq.device)
    if xq.dtype != fp8:
        raise TypeError(f"{op}: xq has dtype {xq.dtype} but this device's FP8 flavour is {fp8}")
    M, K = xq.shape
    N = wq.shape[0]
    check.tensor(op, "x_scale", x_scale, (torch.float32,), ndim=1)
    check.tensor(op, "w_scale", w_scale, (torch.float32,), ndim=1)
    check.shape(op, "x_scale", x_scale, (M,), "one scale per row of xq")
    check.shape(op, "w_scale", w_scale, (N,), "one scale per row of wq")
    check.same_device(op, "xq", xq, x_scale=x_scale, w_scale=w_scale)
    if bias is not None:
        check.tensor(op, "bias", bias, (torch.bfloat16,), ndim=1)
        check.shape(op, "bias", bias, (N,), "one bias per output column")
        check.same_device(op, "xq", xq, bias=bias)
    check.gpu(op, "xq", xq)
    y, target = _gemm_output(op, out, M, N, torch.bfloat16, xq.device,
                             {"xq": xq, "wq": wq, "x_scale": x_scale, "w_scale": w_scale, "bias": bias})
    if y.numel() == 0:
        return y
    if K == 0:
        return y.copy_(bias.expand(M, N)) if bias is not None else y.zero_()
    a, b = _compact(xq), _compact(wq)
    sa, sb = x_scale.contiguous(), w_scale.contiguous()
    kernel = _F8F8BF16_ROWWISE.kernel(a.device, (bias is not None,), (M, N, K), config)
    bias_arg = bias.contiguous() if bias is not None else placeholder(a.device, torch.bfloat16)
    kernel(a, b, sa, sb, bias_arg, target)
    if target is not y:
        y.copy_(target)
    held = (bias_arg,) if bias is None else ()
    if config is None and out is not None:
        native.remember_into(op, inputs, (y,), (a, b, sa, sb, bias_arg, target), kernel, held=held)
    elif config is None:
        native.remember(op, inputs, (y,), (a, b, sa, sb, bias_arg, y), (0,), kernel, held=held)
        if bias is None and a is xq and b is wq and sa is x_scale and sb is w_scale:
            _F8F8BF16_ROWWISE_PLANS.add(key, Plan(_F8F8BF16_ROWWISE, a.device, (False,), (M, N, K), None, (M, N)))
    return y
