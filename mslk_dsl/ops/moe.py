"""MoE routing with MSLK's semantics: index_shuffling (top-k experts per token, tokens grouped by
expert), gather_scale_dense_tokens and scatter_add_dense_tokens. The templates' docstrings give
the kernels' exact contracts and the deliberate differences from MSLK."""
from __future__ import annotations

import torch

from mslk_dsl.device import target_of
from mslk_dsl.ops import validate as check
from mslk_dsl.ops.dispatch import KernelOp, dtype_name, placeholder
from mslk_dsl.templates import _kernel_limits as limits

_INDEX_SHUFFLING = KernelOp("index_shuffling", ("has_valid_count", "score_dtype"), ("T", "E"))
_GATHER = KernelOp("gather_scale_dense_tokens", ("aligned", "dtype", "has_valid_count", "score_dtype"), ("A", "D"))
_SCATTER = KernelOp("scatter_add_dense_tokens", ("aligned", "dtype", "has_valid_count"), ("A", "D", "T"))

MAX_EXPERTS, MAX_TOP_K = limits.MAX_EXPERTS, limits.MAX_TOP_K
SCORE_DTYPES = tuple(getattr(torch, name) for name in limits.SCORE_DTYPES)


def _valid_count(op: str, valid_token_count, like: torch.Tensor, like_name: str):
    if valid_token_count is None:
        return None
    check.tensor(op, "valid_token_count", valid_token_count, (torch.int32,), min_ndim=0)
    if valid_token_count.numel() != 1:
        raise ValueError(f"{op}: valid_token_count must hold one element, got shape "
                         f"{tuple(valid_token_count.shape)}")
    check.same_device(op, like_name, like, valid_token_count=valid_token_count)
    return valid_token_count.reshape(1)


def _one_column_needs_padding(t: torch.Tensor) -> bool:
    """Whether a [rows, 1] input must run as [rows, 2]: FlyDSL specializes a compiled kernel on
    which dimension has unit stride, and torch gives a one-column tensor unit strides on both, so
    the ROCm templates take two columns or more (rare shapes: the copies cost nothing that matters)."""
    return t.shape[1] == 1 and target_of(t.device).backend == "flydsl"


def _two_columns(t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """[rows, 1] -> [rows, 2]: t, then a column of ``fill``."""
    return torch.cat([t, t.new_full((t.shape[0], 1), fill)], dim=1)


def _indices(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    check.tensor(op, name, t, (torch.int32, torch.int64), ndim=1, unit_last_stride=False)
    return t.to(torch.int32).contiguous()  # a no-op for contiguous int32 (the kernels take int32)


def index_shuffling(scores: torch.Tensor, expert_index_start: int | None = None,
                    expert_index_end: int | None = None, valid_token_count: torch.Tensor | None = None,
                    top_k: int = 1, *, config: dict | None = None):
    """Route each of T tokens to its top_k experts (by score, ties to the lower expert) and group
    the (token, expert) pairs by expert. Returns (counts [E + 2] int32: per-expert counts, then T,
    then the routed total; expert_indices [T * top_k] int32 (minus expert_index_start);
    token_indices [T * top_k] int32). Only the first counts[E + 1] entries are meaningful."""
    op = "index_shuffling"
    check.tensor(op, "scores", scores, SCORE_DTYPES, ndim=2, unit_last_stride=False)
    T, E = scores.shape
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"{op}: scores has E={E} experts; supported: 1..{MAX_EXPERTS}")
    if not 1 <= top_k <= min(MAX_TOP_K, E):
        raise ValueError(f"{op}: top_k={top_k} must be in 1..{min(MAX_TOP_K, E)} for E={E}")
    start = 0 if expert_index_start is None else int(expert_index_start)
    end = E if expert_index_end is None else int(expert_index_end)
    if not 0 <= start <= end <= E:
        raise ValueError(f"{op}: expert_index_start={start}, expert_index_end={end} must satisfy "
                         f"0 <= start <= end <= E={E}")
    valid = _valid_count(op, valid_token_count, scores, "scores")
    check.gpu(op, "scores", scores)
    if _one_column_needs_padding(scores):
        # A second expert scored -inf and outside [start, end): never chosen over expert 0
        # (ties go to the lower expert), never routed; its count is dropped.
        counts, expert_indices, token_indices = index_shuffling(
            _two_columns(scores, float("-inf")), start, end, valid, top_k, config=config)
        return torch.cat([counts[:1], counts[2:]]), expert_indices, token_indices
    dev = scores.device
    counts = torch.empty(E + 2, dtype=torch.int32, device=dev)
    expert_indices = torch.empty(T * top_k, dtype=torch.int32, device=dev)
    token_indices = torch.empty(T * top_k, dtype=torch.int32, device=dev)
    if T == 0:
        return counts.zero_(), expert_indices, token_indices
    workspace_slots = torch.empty(T * top_k, dtype=torch.int32, device=dev)
    workspace_hist = torch.empty(limits.index_shuffling_hist_ints(E), dtype=torch.int32, device=dev)
    sig = (valid is not None, dtype_name(scores.dtype))
    kernel = _INDEX_SHUFFLING.kernel(dev, sig, (T, E), config)
    kernel(scores, valid if valid is not None else placeholder(dev, torch.int32), counts, expert_indices,
           token_indices, workspace_slots, workspace_hist, top_k, start, end)
    return counts, expert_indices, token_indices


def gather_scale_dense_tokens(x: torch.Tensor, token_indices: torch.Tensor, expert_indices: torch.Tensor,
                              scores: torch.Tensor, valid_token_count: torch.Tensor | None = None, *,
                              config: dict | None = None) -> torch.Tensor:
    """out[i] = x[token_indices[i]] * scores[token_indices[i], expert_indices[i]] for the first
    valid_token_count (default: all) rows; later rows are left uninitialized, as in MSLK."""
    op = "gather_scale_dense_tokens"
    check.tensor(op, "x", x, check.FLOAT_DTYPES, ndim=2)
    tok = _indices(op, "token_indices", token_indices)
    exp = _indices(op, "expert_indices", expert_indices)
    check.shape(op, "expert_indices", exp, tok.shape, "one expert per gathered row")
    check.tensor(op, "scores", scores, SCORE_DTYPES, ndim=2, unit_last_stride=False)
    if scores.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: scores has {scores.shape[0]} rows but x has {x.shape[0]} tokens")
    check.same_device(op, "x", x, token_indices=tok, expert_indices=exp, scores=scores)
    valid = _valid_count(op, valid_token_count, x, "x")
    check.gpu(op, "x", x)
    A, D = tok.shape[0], x.shape[1]
    out = torch.empty((A, D), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if _one_column_needs_padding(x):
        return gather_scale_dense_tokens(_two_columns(x), tok, exp, scores, valid, config=config)[:, :1].contiguous()
    x = check.rows(x)
    sig = (check.aligned16(x, out), dtype_name(x.dtype), valid is not None, dtype_name(scores.dtype))
    kernel = _GATHER.kernel(x.device, sig, (A, D), config)
    kernel(x, tok, exp, scores, valid if valid is not None else placeholder(x.device, torch.int32), out)
    return out


def scatter_add_dense_tokens(out_tokens: torch.Tensor, in_tokens: torch.Tensor, token_indices: torch.Tensor,
                             valid_token_count: torch.Tensor | None = None, *, config: dict | None = None) -> None:
    """out_tokens[token_indices[i]] += in_tokens[i] for the first valid_token_count (default: all)
    rows, in place. Large inputs are grouped by token and each token's rows summed in fp32 (one
    rounding per out element); small ones use atomic adds, like MSLK. Either way the order of a
    token's additions is unspecified, so results are order-independent only where the sums are
    exact. Rows whose token index is outside [0, T) are skipped."""
    op = "scatter_add_dense_tokens"
    check.tensor(op, "out_tokens", out_tokens, check.FLOAT_DTYPES, ndim=2)
    check.tensor(op, "in_tokens", in_tokens, check.FLOAT_DTYPES, ndim=2)
    check.same_dtype(op, "in_tokens", in_tokens, out_tokens.dtype, "out_tokens")
    tok = _indices(op, "token_indices", token_indices)
    if in_tokens.shape[1] != out_tokens.shape[1]:
        raise ValueError(f"{op}: in_tokens has {in_tokens.shape[1]} columns but out_tokens has "
                         f"{out_tokens.shape[1]}")
    check.shape(op, "token_indices", tok, in_tokens.shape[:1], "one destination token per input row")
    if not out_tokens.is_contiguous():
        raise ValueError(f"{op}: out_tokens is updated in place and must be contiguous, got strides "
                         f"{out_tokens.stride()}")
    check.same_device(op, "out_tokens", out_tokens, in_tokens=in_tokens, token_indices=tok)
    valid = _valid_count(op, valid_token_count, out_tokens, "out_tokens")
    check.gpu(op, "out_tokens", out_tokens)
    A, D = in_tokens.shape
    if A == 0 or D == 0 or out_tokens.shape[0] == 0:
        return None
    if _one_column_needs_padding(out_tokens):
        out2 = _two_columns(out_tokens)
        scatter_add_dense_tokens(out2, _two_columns(in_tokens), tok, valid, config=config)
        out_tokens.copy_(out2[:, :1])
        return None
    y = check.rows(in_tokens)
    sig = (check.aligned16(out_tokens, y), dtype_name(y.dtype), valid is not None)
    kernel, chosen = _SCATTER.selection(y.device, sig, (A, D, out_tokens.shape[0]), config)
    # Per-token counts, offsets, positions, row lists and first rows, which only the sorted
    # method uses (see the CuTe template); the atomic method gets the cached placeholder.
    if chosen.get("method") == "sorted":
        workspace = torch.empty(limits.scatter_workspace_ints(out_tokens.shape[0], A), dtype=torch.int32,
                                device=y.device)
    else:
        workspace = placeholder(y.device, torch.int32)
    kernel(out_tokens, y, tok, valid if valid is not None else placeholder(y.device, torch.int32), workspace)
    return None
