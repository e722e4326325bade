"""GEMMs in MSLK's convention: x [M, K] activations, w [N, K] weights, out = x @ w.T."""
from __future__ import annotations

import torch

from mslk_dsl.ops import validate as check
from mslk_dsl.ops.declaration import Launch, OpDecl, declare
from mslk_dsl.ops.dispatch import dtype_name, placeholder
from mslk_dsl.ops.elementwise import _quantize_reference, fp8_dtype_for
from mslk_dsl.templates import _cute_gemm_configs as gemm_configs

# TMA (and the MFMA loaders) need 16-byte aligned rows: K and N elements must be multiples of this.
_ALIGN_BYTES = 16
# Split-K kernels index their fp32 partials [split_k, M, N] with 32-bit offsets.
_MAX_PARTIALS = 2**31


def _check_operands(op: str, x, w, dtypes, names=("x", "w")) -> None:
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


def _store_target(y: torch.Tensor) -> tuple[torch.Tensor, object]:
    """(the tensor the kernel writes, what to run after it): TMA stores need a 16-byte aligned
    start, so a caller's ``out`` that is not gets an aligned temporary, copied into it after."""
    if y.data_ptr() % _ALIGN_BYTES == 0:
        return y, None
    temporary = torch.empty_like(y)
    return temporary, lambda: y.copy_(temporary)


def _no_launch_needed(y: torch.Tensor, K: int, bias: torch.Tensor | None = None) -> bool:
    """True when the result needs no kernel: nothing to compute, or K = 0 (zeros, or the bias
    broadcast, as MSLK returns); ``y`` then holds it."""
    if y.numel() == 0:
        return True
    if K == 0:
        y.copy_(bias.expand(y.shape)) if bias is not None else y.zero_()
        return True
    return False


def _gemm_example(fp8: bool):
    def example(problem: dict, sig: dict, device) -> tuple:
        M, N, K = problem["M"], problem["N"], problem["K"]
        x = torch.randn(M, K, device=device)
        w = torch.randn(N, K, device=device)
        if not fp8:
            dtype = getattr(torch, sig.get("dtype", "bfloat16"))
            return x.to(dtype), w.to(dtype)
        xq, xs = _quantize_reference(x.to(torch.bfloat16))
        wq, ws = _quantize_reference(w.to(torch.bfloat16))
        bias = torch.randn(N, device=device, dtype=torch.bfloat16) if sig.get("has_bias") else None
        return xq, wq, xs, ws, bias
    return example


# -- bf16_gemm ----------------------------------------------------------------------------------------
def _prepare_bf16_gemm(select, outputs, x, w):
    (y,) = outputs
    (M, K), N = x.shape, w.shape[0]
    if _no_launch_needed(y, K):
        return None
    a, b = _compact(x), _compact(w)
    kernel, chosen = select((dtype_name(a.dtype),), (M, N, K))
    # Split-K configs (decode-sized M) sum K ranges in an fp32 partials buffer [split_k, M, N];
    # stream-K configs sum the last wave's tile pieces in one of a fixed size per config.
    scratch = gemm_configs.partials_elements(chosen, M, N)
    if scratch >= _MAX_PARTIALS:
        raise ValueError(f"bf16_gemm: config split_k={chosen.get('split_k', 1)} needs split_k * M * N < 2**31 "
                         f"(M={M}, N={N}); split-K is for small M, use a config without it")
    partials = (torch.empty(scratch, dtype=torch.float32, device=a.device),) if scratch else ()
    target, finish = _store_target(y)
    return Launch(kernel, (a, b, target, *partials), scratch=partials, finish=finish)


bf16_gemm = declare(OpDecl(
    name="bf16_gemm", schema="(Tensor x, Tensor w) -> Tensor",
    doc="""out = x @ w.T for bf16 or fp16 inputs (fp32 accumulation, output in the input dtype).
    ``out``: a contiguous [M, N] tensor of x's dtype to write into instead of allocating.""",
    check=lambda x, w: _check_operands("bf16_gemm", x, w, check.HALF_DTYPES),
    outputs=lambda x, w: [((x.shape[0], w.shape[0]), x.dtype)],
    prepare=_prepare_bf16_gemm, signature=("dtype",), problem=("M", "N", "K"),
    example=_gemm_example(fp8=False),
    reference=lambda x, w: (x.float() @ w.float().T).to(x.dtype),
    small_problem={"M": 5, "N": 32, "K": 64}))


# -- f8f8bf16_rowwise ---------------------------------------------------------------------------------------
def _check_f8f8bf16_rowwise(xq, wq, x_scale, w_scale, bias):
    op = "f8f8bf16_rowwise"
    _check_operands(op, xq, wq, check.FP8_DTYPES, names=("xq", "wq"))
    fp8 = fp8_dtype_for(xq.device)
    if xq.dtype != fp8:
        raise TypeError(f"{op}: xq has dtype {xq.dtype} but this device's FP8 flavour is {fp8}")
    M, N = xq.shape[0], wq.shape[0]
    check.tensor(op, "x_scale", x_scale, (torch.float32,), ndim=1)
    check.tensor(op, "w_scale", w_scale, (torch.float32,), ndim=1)
    check.shape(op, "x_scale", x_scale, (M,), "one scale per row of xq")
    check.shape(op, "w_scale", w_scale, (N,), "one scale per row of wq")
    check.same_device(op, "xq", xq, x_scale=x_scale, w_scale=w_scale)
    if bias is not None:
        check.tensor(op, "bias", bias, (torch.bfloat16,), ndim=1)
        check.shape(op, "bias", bias, (N,), "one bias per output column")
        check.same_device(op, "xq", xq, bias=bias)


def _prepare_f8f8bf16_rowwise(select, outputs, xq, wq, x_scale, w_scale, bias):
    (y,) = outputs
    (M, K), N = xq.shape, wq.shape[0]
    if _no_launch_needed(y, K, bias):
        return None
    a, b = _compact(xq), _compact(wq)
    kernel, _ = select((bias is not None,), (M, N, K))
    bias_arg = bias.contiguous() if bias is not None else placeholder(a.device, torch.bfloat16)
    target, finish = _store_target(y)
    return Launch(kernel, (a, b, x_scale.contiguous(), w_scale.contiguous(), bias_arg, target), finish=finish)


def _f8f8bf16_rowwise_reference(xq, wq, x_scale, w_scale, bias=None):
    y = (xq.float() @ wq.float().T) * x_scale.unsqueeze(1) * w_scale.unsqueeze(0)
    return (y + bias.float() if bias is not None else y).to(torch.bfloat16)


f8f8bf16_rowwise = declare(OpDecl(
    name="f8f8bf16_rowwise",
    schema="(Tensor xq, Tensor wq, Tensor x_scale, Tensor w_scale, Tensor? bias=None) -> Tensor",
    doc="""out = (xq @ wq.T) * x_scale[:, None] * w_scale[None, :] (+ bias), bf16 out; the scales are
    the ones quantize_fp8_row returns. ``out``: a contiguous [M, N] bf16 tensor to write into
    instead of allocating.""",
    check=_check_f8f8bf16_rowwise,
    outputs=lambda xq, wq, x_scale, w_scale, bias=None: [((xq.shape[0], wq.shape[0]), torch.bfloat16)],
    prepare=_prepare_f8f8bf16_rowwise, signature=("has_bias",), problem=("M", "N", "K"),
    example=_gemm_example(fp8=True), reference=_f8f8bf16_rowwise_reference,
    small_problem={"M": 5, "N": 32, "K": 64}))
