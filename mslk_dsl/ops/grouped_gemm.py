"""Grouped GEMMs over stacked rows, MSLK's ``*_grouped_stacked`` ops: the rows of x are G groups
stacked in order (M_sizes[g] rows each, e.g. tokens sorted by expert) and group g multiplies
its rows by its own weight w[g] [N, K].

M_sizes stays on the device: the kernels read it there (no host sync), so calls capture in CUDA
graphs and trace with torch.compile fullgraph. Semantics, as MSLK's (the CUTLASS grouped kernels
behind mslk::bf16bf16bf16_grouped_stacked and f8f8bf16_rowwise_grouped_stacked):
  * empty groups do no work (a negative size counts as empty); a group of one row is an
    ordinary group;
  * rows past sum(M_sizes) are neither read into a result nor written: the output is allocated
    with torch.empty, so they hold whatever the allocation held (MSLK's too);
  * total_M = 0 returns an empty [0, N] result without a launch.
Deliberate differences: M_sizes may be int32 or int64 (MSLK's kernels take int64); if
sum(M_sizes) > total_M (which needs a host sync to detect), the groups are cut at total_M and
nothing outside x and out is touched; K = 0 gives zeros everywhere.
"""
from __future__ import annotations

import random

import torch

from mslk_dsl.errors import InputError, InputTypeError
from mslk_dsl.ops import random_problems as draw
from mslk_dsl.ops import validate as check
from mslk_dsl.ops.declaration import Launch, OpDecl, declare
from mslk_dsl.ops.dispatch import dtype_name
from mslk_dsl.ops.elementwise import _quantize_reference, fp8_dtype_for
from mslk_dsl.templates import _kernel_limits as limits

_INDEX_DTYPES = tuple(getattr(torch, name) for name in limits.GROUPED_INDEX_DTYPES)
_ALIGN_BYTES = limits.VECTOR_BYTES
_OUT_ROW_ELEMENTS = 8  # 16-byte rows of the bf16 output for TMA stores


def _check_grouped(op: str, x, w, M_sizes, dtypes, names=("x", "w")) -> None:
    xn, wn = names
    check.tensor(op, xn, x, dtypes, ndim=2)
    check.tensor(op, wn, w, dtypes, ndim=3)
    check.same_dtype(op, wn, w, x.dtype, xn)
    check.tensor(op, "M_sizes", M_sizes, _INDEX_DTYPES, ndim=1, unit_last_stride=False)
    check.same_device(op, xn, x, **{wn: w, "M_sizes": M_sizes})
    G, N, K = w.shape
    if M_sizes.shape[0] != G:
        raise InputError(f"{op}: M_sizes has {M_sizes.shape[0]} groups but {wn} has G={G}; {wn} must be [G, N, K]")
    if x.shape[1] != K:
        raise InputError(f"{op}: {wn} has shape {tuple(w.shape)} but {xn} has K={x.shape[1]}; {wn} must be [G, N, K]")
    k_per = _ALIGN_BYTES // x.element_size()
    if K % k_per:
        raise InputError(f"{op}: K={K} must be a multiple of {k_per} for {x.dtype} (16-byte aligned rows for "
                         f"TMA); pad K")
    if N % _OUT_ROW_ELEMENTS:
        raise InputError(f"{op}: N={N} must be a multiple of {_OUT_ROW_ELEMENTS} (16-byte rows of the bf16 "
                         f"output); pad the weight")


def _no_launch_needed(y: torch.Tensor, G: int, K: int) -> bool:
    """True when no kernel is needed: an empty result or no groups (nothing written), or K = 0."""
    if y.numel() == 0 or G == 0:
        return True
    if K == 0:
        y.zero_()
        return True
    return False


def _store_target(y: torch.Tensor):
    """TMA stores need a 16-byte aligned start: a caller's unaligned ``out`` gets a temporary."""
    if y.data_ptr() % _ALIGN_BYTES == 0:
        return y, None
    temporary = torch.empty_like(y)
    return temporary, lambda: y.copy_(temporary)


def _grouped_launch(select, outputs, x, w, M_sizes, scales=(), parts=()) -> Launch | None:
    """The launch of a grouped kernel, kernel(x, w viewed as [G * N, K], *scales flattened, out,
    M_sizes), or None when none is needed; ``parts``: the signature parts after index_dtype."""
    (y,) = outputs
    G, N, K = w.shape
    if _no_launch_needed(y, G, K):
        return None
    a, b = check.tma_operand(x), check.tma_operand(w).view(G * N, K)
    kernel, _ = select((dtype_name(M_sizes.dtype), *parts), (a.shape[0], N, K, G))
    target, finish = _store_target(y)
    flat_scales = tuple(s.contiguous().view(-1) for s in scales)
    return Launch(kernel, (a, b, *flat_scales, target, M_sizes.contiguous()), finish=finish)


def _grouped_reference(x, w, M_sizes, x_scale=None, w_scale=None) -> torch.Tensor:
    """fp32 per-group products (scaled by x_scale rows and w_scale[g] columns when given),
    rounded once to bf16; rows past sum(M_sizes) stay 0."""
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    for g, (start, end) in enumerate(_group_bounds(M_sizes, x.shape[0])):
        if end > start:
            part = x[start:end].float() @ w[g].float().T
            if x_scale is not None:
                part = part * x_scale[start:end, None] * w_scale[g][None, :]
            y[start:end] = part
    return y.to(torch.bfloat16)


def split_rows(total: int, groups: int, seed: int, empty_every: int = 0) -> list[int]:
    """A random split of ``total`` rows into ``groups`` sizes (every ``empty_every``-th group
    empty when set): the examples' and the tests' group sizes (plain Python: no tensor, so it
    also runs under a fake tensor mode)."""
    if groups == 0:
        return []
    rng = random.Random(seed)
    weights = [0.0 if empty_every and g % empty_every == 0 else rng.random() + 0.05 for g in range(groups)]
    if sum(weights) == 0.0:
        weights[-1] = 1.0
    sizes = [int(wt / sum(weights) * total) for wt in weights]
    sizes[weights.index(max(weights))] += total - sum(sizes)
    return sizes


def _group_bounds(M_sizes: torch.Tensor, total_m: int) -> list[tuple[int, int]]:
    """(first row, end row) of each group, cut at total_m (host sync: references only)."""
    ends = torch.cumsum(M_sizes.long().cpu().clamp(min=0), 0).tolist()
    starts = [0] + ends[:-1]
    return [(min(s, total_m), min(e, total_m)) for s, e in zip(starts, ends)]


def _random_problem(k_multiple: int):
    """G to 128 groups, M to 16384 rows in all (fewer than G included: empty groups), N and K to
    8192 in the multiples the ops take; weights of at most 2**28 elements, at most 2**36
    multiply-adds."""
    def random_problem(rng) -> dict:
        return draw.within(rng, lambda r: {"M": draw.log_int(r, 1, 16384), "N": draw.log_int(r, 8, 8192, 8),
                                           "K": draw.log_int(r, k_multiple, 8192, k_multiple),
                                           "G": draw.log_int(r, 1, 128)},
                           lambda p: max(p["M"] * p["N"] * p["K"] >> 8, p["G"] * p["N"] * p["K"]), 1 << 28)
    return random_problem


def _example(fp8: bool):
    def example(problem: dict, sig: dict, device) -> tuple:
        M, N, K, G = problem["M"], problem["N"], problem["K"], problem.get("G", 4)
        sizes = torch.tensor(split_rows(M, G, seed=M * 31 + N * 7 + K + G), dtype=getattr(torch, sig.get("index_dtype", "int64")),
                             device=device)
        x = torch.randn(M, K, device=device)
        w = torch.randn(G, N, K, device=device)
        if not fp8:
            return x.to(torch.bfloat16), w.to(torch.bfloat16), sizes
        xq, xs = _quantize_reference(x.to(torch.bfloat16))
        wq, ws = _quantize_reference(w.to(torch.bfloat16))
        return xq, wq, xs, ws, sizes, sig.get("fast_accum", True)
    return example


# -- bf16bf16bf16_grouped_stacked -----------------------------------------------------------------
bf16bf16bf16_grouped_stacked = declare(OpDecl(
    name="bf16bf16bf16_grouped_stacked",
    schema="(Tensor x, Tensor w, Tensor M_sizes) -> Tensor",
    doc="""out[rows of group g] = x[rows of group g] @ w[g].T, bf16 in and out, fp32 accumulation.
    x [total_M, K] holds the groups' rows stacked in order, M_sizes [G] (int32 or int64, on the
    device) their counts, w [G, N, K] -> out [total_M, N]. K a multiple of 8, N of 8. Rows past
    sum(M_sizes) are not written (as MSLK's); see the module docstring.""",
    check=lambda x, w, M_sizes: _check_grouped("bf16bf16bf16_grouped_stacked", x, w, M_sizes,
                                               (torch.bfloat16,)),
    outputs=lambda x, w, M_sizes: [((x.shape[0], w.shape[1]), torch.bfloat16)],
    prepare=_grouped_launch, signature=("index_dtype",), problem=("M", "N", "K", "G"),
    example=_example(fp8=False), reference=_grouped_reference,
    small_problem={"M": 37, "N": 64, "K": 64, "G": 4}, random_problem=_random_problem(8), long_sums=True))


# -- f8f8bf16_rowwise_grouped_stacked --------------------------------------------------------------
def _check_f8_grouped(xq, wq, x_scale, w_scale, M_sizes, use_fast_accum=True):
    op = "f8f8bf16_rowwise_grouped_stacked"
    if not isinstance(use_fast_accum, bool):
        raise InputTypeError(f"{op}: use_fast_accum must be a bool, got {type(use_fast_accum).__name__}")
    _check_grouped(op, xq, wq, M_sizes, check.FP8_DTYPES, names=("xq", "wq"))
    fp8 = fp8_dtype_for(xq.device)
    if xq.dtype != fp8:
        raise InputTypeError(f"{op}: xq has dtype {xq.dtype} but this device's FP8 flavour is {fp8}")
    if xq.shape[1] % 16:
        raise InputError(f"{op}: K={xq.shape[1]} must be a multiple of 16 (16-byte aligned FP8 rows for TMA)")
    check.tensor(op, "x_scale", x_scale, (torch.float32,), ndim=1, unit_last_stride=False)
    check.tensor(op, "w_scale", w_scale, (torch.float32,), ndim=2, unit_last_stride=False)
    check.shape(op, "x_scale", x_scale, (xq.shape[0],), "one scale per row of xq")
    check.shape(op, "w_scale", w_scale, tuple(wq.shape[:2]), "one scale per group and row of wq")
    check.same_device(op, "xq", xq, x_scale=x_scale, w_scale=w_scale)


def _prepare_f8_grouped(select, outputs, xq, wq, x_scale, w_scale, M_sizes, use_fast_accum=True):
    return _grouped_launch(select, outputs, xq, wq, M_sizes, scales=(x_scale, w_scale), parts=(use_fast_accum,))


def _f8_grouped_reference(xq, wq, x_scale, w_scale, M_sizes, use_fast_accum=True):
    """The op's arguments in its own order (M_sizes last) to the shared reference."""
    return _grouped_reference(xq, wq, M_sizes, x_scale, w_scale)


f8f8bf16_rowwise_grouped_stacked = declare(OpDecl(
    name="f8f8bf16_rowwise_grouped_stacked",
    schema="(Tensor xq, Tensor wq, Tensor x_scale, Tensor w_scale, Tensor M_sizes, "
           "bool use_fast_accum=True) -> Tensor",
    doc="""out[rows of group g] = (xq[rows] @ wq[g].T) * x_scale[rows, None] * w_scale[g][None, :],
    bf16 out; FP8 rowwise scales as quantize_fp8_row returns them. xq [total_M, K], wq [G, N, K],
    x_scale [total_M] and w_scale [G, N] fp32, M_sizes [G] (int32 or int64, on the device) ->
    out [total_M, N]. K a multiple of 16, N of 8. Rows past sum(M_sizes) are not written (as
    MSLK's); see the module docstring. ``use_fast_accum`` as f8f8bf16_rowwise's: True (the
    default; MSLK's grouped kernels always accumulate so) accumulates in the FP8 MMA across all
    of K, False promotes the partial sums into fp32 every 512 products.""",
    check=_check_f8_grouped,
    outputs=lambda xq, wq, x_scale, w_scale, M_sizes, use_fast_accum=True: [
        ((xq.shape[0], wq.shape[1]), torch.bfloat16)],
    prepare=_prepare_f8_grouped, signature=("index_dtype", "fast_accum"), problem=("M", "N", "K", "G"),
    example=_example(fp8=True), reference=_f8_grouped_reference,
    # As f8f8bf16_rowwise's: only fast (default) calls make and take plans.
    plan_when="use_fast_accum is True",
    small_problem={"M": 37, "N": 64, "K": 128, "G": 4}, random_problem=_random_problem(16), long_sums=True))
