"""RMSNorm and the fused residual-add RMSNorm (bf16/fp16/fp32 in, fp32 math).

The weight has x's dtype or is fp32 (mixed-precision checkpoints keep norm weights in fp32); the
results take x's dtype either way, as quack's and MSLK's norms do. A weight of None normalizes
only (torch's ``F.rms_norm`` and quack's ``rmsnorm`` without a weight): the kernels get a cached
weight of ones (one per device, dtype and hidden size; read from L2), so no second set of kernels
exists for it."""
from __future__ import annotations

import torch

from mslk_dsl.errors import InputError, InputTypeError
from mslk_dsl.ops import random_problems as draw
from mslk_dsl.ops import validate as check
from mslk_dsl.ops.declaration import Launch, OpDecl, declare
from mslk_dsl.ops.dispatch import dtype_name, placeholder

# Rows up to quack's limit. Rows longer than a config's register tile are streamed and read again
# (mostly from L2); see the templates.
MAX_HIDDEN = 262144
WEIGHT_DTYPES = check.FLOAT_DTYPES

# Launch plans match layouts, not values: only a float eps the checks accepted may use them
# (an int eps is converted, a negative one refused, on the checked path).
_PLAIN_EPS = "type(eps) is float and eps >= 0"


def _check(op: str, x, weight, eps) -> None:
    check.tensor(op, "x", x, check.FLOAT_DTYPES)
    if weight is not None:
        check.tensor(op, "weight", weight, WEIGHT_DTYPES, ndim=1)
        if weight.dtype not in (x.dtype, torch.float32):
            raise InputTypeError(f"{op}: weight has dtype {weight.dtype}; it must be x's dtype ({x.dtype}), "
                                 "torch.float32 or None")
        check.shape(op, "weight", weight, x.shape[-1:], "one weight per hidden element of x")
        check.same_device(op, "x", x, weight=weight)
    check.nonempty_rows(op, "x", x)
    if x.shape[-1] > MAX_HIDDEN:
        raise InputError(f"{op}: hidden size {x.shape[-1]} of x exceeds the supported {MAX_HIDDEN}")
    if isinstance(eps, bool) or not isinstance(eps, (float, int)) or eps < 0:
        raise InputError(f"{op}: eps must be a non-negative float, got {eps!r}")


def _example(count: int):
    """``count`` N(0, 1) [M, N] activations (x, and the residual: fp32 where the signature says),
    then a weight (fp32 where the signature says) and eps."""
    def example(problem: dict, sig: dict, device) -> tuple:
        dtype = getattr(torch, sig.get("dtype", "bfloat16"))
        wdtype = torch.float32 if sig.get("fp32_weight") else dtype
        dtypes = [dtype, torch.float32 if sig.get("fp32_residual") else dtype][:count]
        xs = [torch.randn(problem["M"], problem["N"], device=device, dtype=dt) for dt in dtypes]
        return (*xs, torch.randn(problem["N"], device=device, dtype=wdtype), 1e-6)
    return example


def _weight_arg(weight, x: torch.Tensor) -> torch.Tensor:
    """The kernels' weight: the caller's, or for None the cached ones of x's dtype and width."""
    if weight is not None:
        return weight
    return placeholder(x.device, x.dtype, fill=1, shape=(x.shape[-1],))


def _signature(x: torch.Tensor, weight: torch.Tensor, *rows: torch.Tensor) -> tuple:
    """(vec_bytes, dtype, fp32_weight): the templates' signature of a call. An fp32 weight with fp32
    x is the plain case."""
    return (check.vector_bytes(*rows, weight), dtype_name(x.dtype),
            weight.dtype == torch.float32 and x.dtype != torch.float32)


def _random_problem(rng) -> dict:
    """M rows of N elements, N to 131072 (long rows span a thread-block cluster)."""
    return draw.rows(rng, "N", max_rows=65536, max_width=131072)


def _rmsnorm_reference(x, weight, eps=1e-6):
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight.float()).to(x.dtype)


def _rmsnorm_add_reference(x, residual, weight, eps=1e-6):
    new_residual = (x.float() + residual.float()).to(residual.dtype)
    y = _rmsnorm_reference(new_residual, weight, eps)
    return y.to(x.dtype), new_residual


# -- rmsnorm -------------------------------------------------------------------------------------------
def _prepare_rmsnorm(select, outputs, x, weight, eps):
    (y,) = outputs
    if y.numel() == 0:
        return None
    a = check.rows(x)
    o = y.view(a.shape)
    weight = _weight_arg(weight, a)
    kernel, _ = select(_signature(a, weight, a, o), tuple(a.shape))
    # An int eps becomes a new float object, which no plan may keep (see _PLAIN_EPS).
    return Launch(kernel, (a, weight, o, eps if type(eps) is float else float(eps)))


rmsnorm = declare(OpDecl(
    name="rmsnorm", schema="(Tensor x, Tensor? weight, float eps=1e-06) -> Tensor",
    doc="""y = x / sqrt(mean(x^2) + eps) * weight over the last dim, fp32 math; x bf16/fp16/fp32,
    weight of x's dtype or fp32 (None: no weight), y in x's dtype. ``out``: a contiguous tensor of x's shape and
    dtype to write into instead of allocating.""",
    check=lambda x, weight, eps: _check("rmsnorm", x, weight, eps),
    outputs=lambda x, weight, eps=1e-6: [(tuple(x.shape), x.dtype)],
    prepare=_prepare_rmsnorm, signature=("vec_bytes", "dtype", "fp32_weight"), problem=("M", "N"),
    example=_example(1), reference=_rmsnorm_reference, plan_when=_PLAIN_EPS, small_problem={"M": 5, "N": 64},
    random_problem=_random_problem))


# -- rmsnorm_add ---------------------------------------------------------------------------------------------
def _fp32_residual(x, residual) -> bool:
    """A 16-bit x with an fp32 residual stream (quack's residual_dtype=torch.float32, flash-attn's
    residual_in_fp32): the sum stays fp32, y takes x's dtype."""
    return residual.dtype == torch.float32 and x.dtype != torch.float32


def _check_rmsnorm_add(x, residual, weight, eps):
    op = "rmsnorm_add"
    _check(op, x, weight, eps)
    check.tensor(op, "residual", residual, check.FLOAT_DTYPES)
    if residual.dtype != x.dtype and not _fp32_residual(x, residual):
        raise InputTypeError(f"{op}: residual has dtype {residual.dtype}; it must be x's dtype ({x.dtype}) "
                             "or, for 16-bit x, torch.float32")
    check.shape(op, "residual", residual, x.shape, "residual must have the shape of x")
    check.same_device(op, "x", x, residual=residual)


def _prepare_rmsnorm_add(select, outputs, x, residual, weight, eps):
    y, new_residual = outputs
    if y.numel() == 0:
        return None
    a, r = check.rows(x), check.rows(residual)
    o, res = y.view(a.shape), new_residual.view(a.shape)
    eps = eps if type(eps) is float else float(eps)
    fp32_residual = _fp32_residual(a, r)
    w = _weight_arg(weight, a)
    sig = (*_signature(a, w, a, r, o, res), fp32_residual)
    kernel, _ = select(sig, tuple(a.shape))
    return Launch(kernel, (a, r, w, o, res, eps))


rmsnorm_add = declare(OpDecl(
    name="rmsnorm_add", schema="(Tensor x, Tensor residual, Tensor? weight, float eps=1e-06) -> (Tensor, Tensor)",
    doc="""new_residual = x + residual; y = rmsnorm(new_residual, weight, eps) (weight None: no
    weight). Returns (y, new_residual): y in x's dtype, new_residual in residual's. The residual
    has x's dtype or, with 16-bit x, is fp32 (a residual stream kept in fp32, as quack's
    residual_dtype and flash-attn's residual_in_fp32): the sum then stays fp32 and y is
    normalized from it, in one fused kernel at every row length.
    ``out``: contiguous (y, new_residual) tensors of x's shape and those dtypes to write into.""",
    check=_check_rmsnorm_add,
    outputs=lambda x, residual, weight, eps=1e-6: [(tuple(x.shape), x.dtype), (tuple(x.shape), residual.dtype)],
    prepare=_prepare_rmsnorm_add, signature=("vec_bytes", "dtype", "fp32_weight", "fp32_residual"), problem=("M", "N"),
    example=_example(2), reference=_rmsnorm_add_reference, plan_when=_PLAIN_EPS,
    small_problem={"M": 5, "N": 64}, random_problem=_random_problem))
