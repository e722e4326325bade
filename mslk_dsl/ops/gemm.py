"""GEMMs in MSLK's convention: x [M, K] activations, w [N, K] weights, out = x @ w.T."""
from __future__ import annotations

import torch

from mslk_dsl.errors import ConfigError, InputError, InputTypeError
from mslk_dsl.ops import random_problems as draw
from mslk_dsl.ops import validate as check
from mslk_dsl.ops.declaration import Launch, OpDecl, declare
from mslk_dsl.ops.dispatch import Scratch, call_scratch, dtype_name, placeholder, zeroed_counters
from mslk_dsl.ops.elementwise import _quantize_reference, fp8_dtype_for
from mslk_dsl.templates import _cute_gemm_configs as gemm_configs
from mslk_dsl.templates import _kernel_limits as limits

# TMA (and the MFMA loaders) need 16-byte aligned rows: K and N elements must be multiples of this.
_ALIGN_BYTES = limits.VECTOR_BYTES
# The output is 16-bit: N a multiple of 8 keeps its rows 16-byte aligned for TMA stores.
_OUT_ROW_ELEMENTS = 8
# Split-K kernels index their fp32 partials (a slot per output tile and split) with 32-bit offsets.
_MAX_PARTIALS = 2**31


def _check_operands(op: str, x, w, dtypes, names=("x", "w")) -> None:
    xn, wn = names
    check.tensor(op, xn, x, dtypes, min_ndim=2)  # leading dims are batch: [..., M, K] -> [..., M, N]
    check.tensor(op, wn, w, dtypes, ndim=2)
    check.same_dtype(op, wn, w, x.dtype, xn)
    check.same_device(op, xn, x, **{wn: w})
    if w.shape[1] != x.shape[-1]:
        raise InputError(f"{op}: {wn} has shape {tuple(w.shape)} but {xn} has K={x.shape[-1]}; "
                         f"{wn} must be [N, K]")
    # TMA loads 16-byte rows of x and w (K), and stores 16-byte rows of the bf16/fp16 output (N).
    k_per = _ALIGN_BYTES // x.element_size()
    if x.shape[-1] % k_per:
        raise InputError(f"{op}: K={x.shape[-1]} must be a multiple of {k_per} for {x.dtype} "
                         f"(16-byte aligned rows for TMA); pad K")
    if w.shape[0] % _OUT_ROW_ELEMENTS:
        raise InputError(f"{op}: N={w.shape[0]} must be a multiple of {_OUT_ROW_ELEMENTS} (16-byte rows of "
                         f"the 16-bit output); pad the weight")


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    """x [..., M, K] as the kernel's compact [M_total, K] matrix (a view when it can be)."""
    return check.tma_operand(x.reshape(x.shape[:-1].numel(), x.shape[-1]) if x.dim() != 2 else x)


def _output_shape(x: torch.Tensor, w: torch.Tensor) -> tuple[int, ...]:
    return (*x.shape[:-1], w.shape[0])


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


def _random_problem(k_multiple: int):
    """M to 16384 (any), N and K to 16384 in the multiples the ops take, at most 2**36
    multiply-adds."""
    def random_problem(rng) -> dict:
        return draw.within(rng, lambda r: {"M": draw.log_int(r, 1, 16384), "N": draw.log_int(r, 8, 16384, 8),
                                           "K": draw.log_int(r, k_multiple, 16384, k_multiple)},
                           lambda p: p["M"] * p["N"] * p["K"], 1 << 36)
    return random_problem


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
        bias_dtype = sig.get("bias", "none")
        bias = None if bias_dtype == "none" else torch.randn(N, device=device, dtype=getattr(torch, bias_dtype))
        return xq, wq, xs, ws, bias, sig.get("fast_accum", True)
    return example


# -- bf16_gemm ----------------------------------------------------------------------------------------
def _prepare_bf16_gemm(select, outputs, x, w):
    (y,) = outputs
    a, b = _rows_2d(x), check.tma_operand(w)
    (M, K), N = a.shape, b.shape[0]
    if _no_launch_needed(y, K):
        return None
    y = y.view(M, N)
    kernel, chosen = select((dtype_name(a.dtype),), (M, N, K))
    partials, counters = _work_buffers("bf16_gemm", chosen, M, N, a.device)
    target, finish = _store_target(y)
    return Launch(kernel, (a, b, target, *partials.tensors, *counters), scratch=partials.per_call, finish=finish,
                  stream_bound=partials.stream_bound or bool(counters))


def _work_buffers(op: str, chosen: dict, M: int, N: int, device) -> tuple[Scratch, tuple]:
    """(partials, counters) the chosen config's kernel takes after its output: split-K configs
    fp32 partials (a slot per output tile and split, or split x M x N for 64-row tiles) and,
    fixed up in place, the tile counters (zero, shared across calls: the kernel leaves them
    zero); stream-K configs a fixed-size fp32 buffer for the last wave's tile pieces. The
    partials are written before they are read, so the stream's reusable scratch serves them
    (dispatch.call_scratch); the counters belong to the stream too. Either binds the launch to
    the stream: its plan serves calls on this stream only."""
    scratch = gemm_configs.partials_elements(chosen, M, N)
    if scratch >= _MAX_PARTIALS:
        raise ConfigError(f"{op}: config split_k={chosen.get('split_k', 1)} needs fewer than 2**31 fp32 partials "
                          f"(M={M}, N={N}); split-K is for small and mid-sized M, use a config without it")
    partials = call_scratch(device, torch.float32, ((scratch,),)) if scratch else Scratch((), (), False)
    count = gemm_configs.counters_needed(chosen, M, N)
    counters = (zeroed_counters(device, count),) if count else ()
    return partials, counters


bf16_gemm = declare(OpDecl(
    name="bf16_gemm", schema="(Tensor x, Tensor w) -> Tensor",
    doc="""out = x @ w.T for bf16 or fp16 inputs (fp32 accumulation, output in the input dtype).
    x [..., M, K] (leading dims are batch), w [N, K] -> [..., M, N]; K a multiple of 8, N of 8;
    K = 0 gives zeros. ``out``: a contiguous tensor of the result's shape and x's dtype to write
    into instead of allocating.""",
    check=lambda x, w: _check_operands("bf16_gemm", x, w, check.HALF_DTYPES),
    outputs=lambda x, w: [(_output_shape(x, w), x.dtype)],
    prepare=_prepare_bf16_gemm, signature=("dtype",), problem=("M", "N", "K"),
    example=_gemm_example(fp8=False),
    reference=lambda x, w: (x.float() @ w.float().T).to(x.dtype),
    small_problem={"M": 5, "N": 32, "K": 64}, random_problem=_random_problem(8), long_sums=True))


# -- f8f8bf16_rowwise ---------------------------------------------------------------------------------------
# MSLK takes the bias in bf16 or fp32; the epilogue adds it in fp32 either way.
_BIAS_DTYPES = (torch.bfloat16, torch.float32)


def _check_f8f8bf16_rowwise(xq, wq, x_scale, w_scale, bias, use_fast_accum):
    op = "f8f8bf16_rowwise"
    if not isinstance(use_fast_accum, bool):
        raise InputTypeError(f"{op}: use_fast_accum must be a bool, got {type(use_fast_accum).__name__}")
    _check_operands(op, xq, wq, check.FP8_DTYPES, names=("xq", "wq"))
    fp8 = fp8_dtype_for(xq.device)
    if xq.dtype != fp8:
        raise InputTypeError(f"{op}: xq has dtype {xq.dtype} but this device's FP8 flavour is {fp8}")
    rows, N = xq.shape[:-1], wq.shape[0]
    check.tensor(op, "x_scale", x_scale, (torch.float32,), min_ndim=1)
    check.tensor(op, "w_scale", w_scale, (torch.float32,), ndim=1)
    if tuple(x_scale.shape) not in (tuple(rows), (rows.numel(),)):
        raise InputError(f"{op}: x_scale has shape {tuple(x_scale.shape)}, expected {tuple(rows)} or "
                         f"({rows.numel()},) (one scale per row of xq)")
    check.shape(op, "w_scale", w_scale, (N,), "one scale per row of wq")
    check.same_device(op, "xq", xq, x_scale=x_scale, w_scale=w_scale)
    if bias is not None:
        check.tensor(op, "bias", bias, _BIAS_DTYPES, ndim=1)
        check.shape(op, "bias", bias, (N,), "one bias per output column")
        check.same_device(op, "xq", xq, bias=bias)


def _prepare_f8f8bf16_rowwise(select, outputs, xq, wq, x_scale, w_scale, bias, use_fast_accum):
    (y,) = outputs
    a, b = _rows_2d(xq), check.tma_operand(wq)
    (M, K), N = a.shape, b.shape[0]
    if _no_launch_needed(y, K, bias):
        return None
    y = y.view(M, N)
    x_scale = x_scale.reshape(M)
    bias_kind = "none" if bias is None else dtype_name(bias.dtype)
    kernel, chosen = select((bias_kind, use_fast_accum), (M, N, K))
    bias_arg = bias.contiguous() if bias is not None else placeholder(a.device, torch.bfloat16)
    partials, counters = _work_buffers("f8f8bf16_rowwise", chosen, M, N, a.device)
    target, finish = _store_target(y)
    return Launch(kernel, (a, b, x_scale.contiguous(), w_scale.contiguous(), bias_arg, target, *partials.tensors,
                           *counters), scratch=partials.per_call, finish=finish,
                  stream_bound=partials.stream_bound or bool(counters))


def _f8f8bf16_rowwise_reference(xq, wq, x_scale, w_scale, bias=None, use_fast_accum=True):
    y = (xq.float() @ wq.float().T) * x_scale.reshape(*xq.shape[:-1], 1) * w_scale
    return (y + bias.float() if bias is not None else y).to(torch.bfloat16)


f8f8bf16_rowwise = declare(OpDecl(
    name="f8f8bf16_rowwise",
    schema="(Tensor xq, Tensor wq, Tensor x_scale, Tensor w_scale, Tensor? bias=None, "
           "bool use_fast_accum=True) -> Tensor",
    doc="""out = (xq @ wq.T) * x_scale[:, None] * w_scale[None, :] (+ bias), bf16 out; the scales are
    the ones quantize_fp8_row returns. xq [..., M, K] (leading dims are batch; x_scale of shape
    xq.shape[:-1] or flattened), wq [N, K] -> [..., M, N]; K a multiple of 16, N of 8; K = 0
    gives zeros (or the bias). ``bias``: [N], bf16 or fp32, added in fp32 before the one rounding
    to bf16. ``use_fast_accum`` (MSLK's argument and default): True accumulates in the FP8 MMA's
    own accumulator across all of K (fastest; on Hopper its ~13-bit adds drift by up to ~1e-2
    relative at long K); False promotes the partial sums into fp32 every 512 products (error
    below bf16 rounding). ROCm's MFMAs accumulate in fp32 either way. ``out``: a contiguous bf16 tensor of the result's shape to write
    into instead of allocating.""",
    check=_check_f8f8bf16_rowwise,
    outputs=lambda xq, wq, x_scale, w_scale, bias=None, use_fast_accum=True: [
        (_output_shape(xq, wq), torch.bfloat16)],
    prepare=_prepare_f8f8bf16_rowwise, signature=("bias", "fast_accum"), problem=("M", "N", "K"),
    example=_gemm_example(fp8=True), reference=_f8f8bf16_rowwise_reference,
    # Plans are keyed by the inputs' layout, and a bool's layout is its type: only fast (default)
    # calls make and take plans, so a promoted launch never replays for a fast call or the reverse.
    plan_when="use_fast_accum is True",
    small_problem={"M": 5, "N": 32, "K": 64}, random_problem=_random_problem(16), long_sums=True))
