"""MoE routing with MSLK's semantics: index_shuffling (top-k experts per token, tokens grouped by
expert), gather_scale_dense_tokens and scatter_add_dense_tokens. The templates' docstrings give
the kernels' exact contracts and the deliberate differences from MSLK.

index_shuffling and gather_scale_dense_tokens keep launch plans (index_shuffling's keyed by the
values of top_k and the expert range too: top_k sizes its outputs); routing indices the op
converts to int32 for the kernel (int64 ones) keep none. scatter_add_dense_tokens writes an input
in place: its plans check on every call that out_tokens overlaps no other input."""
from __future__ import annotations

import torch

from mslk_dsl.device import target_of
from mslk_dsl.errors import InputError
from mslk_dsl.ops import random_problems as draw
from mslk_dsl.ops import validate as check
from mslk_dsl.ops.declaration import Fixed, Launch, OpDecl, declare
from mslk_dsl.ops.dispatch import Scratch, call_scratch, dtype_name, placeholder
from mslk_dsl.templates import _kernel_limits as limits  # what the ops and the kernels agree on

MAX_EXPERTS, MAX_TOP_K = limits.MAX_EXPERTS, limits.MAX_TOP_K
SCORE_DTYPES = tuple(getattr(torch, name) for name in limits.SCORE_DTYPES)


def _check_valid_count(op: str, valid_token_count, like: torch.Tensor, like_name: str) -> None:
    check.one_element(op, "valid_token_count", valid_token_count, torch.int32, like, like_name)


def _valid_arg(valid_token_count, device) -> torch.Tensor:
    """The kernel's valid-count argument: the caller's one element, or the unread placeholder."""
    if valid_token_count is None:
        return placeholder(device, torch.int32)
    return valid_token_count.reshape(1)


def _one_column_needs_padding(t: torch.Tensor) -> bool:
    """Whether a [rows, 1] input must run as [rows, 2]: FlyDSL specializes a compiled kernel on
    which dimension has unit stride, and torch gives a one-column tensor unit strides on both, so
    the ROCm templates take two columns or more (rare shapes: the copies cost nothing that matters)."""
    return t.shape[1] == 1 and target_of(t.device).backend == "flydsl"


def _two_columns(t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """[rows, 1] -> [rows, 2]: t, then a column of ``fill``."""
    return torch.cat([t, t.new_full((t.shape[0], 1), fill)], dim=1)


def _check_indices(op: str, name: str, t) -> None:
    check.tensor(op, name, t, (torch.int32, torch.int64), ndim=1, unit_last_stride=False)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()  # a no-op for contiguous int32 (the kernels take int32)


def _random_routing(rng) -> dict:
    """T to 65536 tokens over any E of 1..MAX_EXPERTS, top_k of 1..min(MAX_TOP_K, E), a valid
    token count of 0..T, half the time a range of experts."""
    T, E = draw.log_int(rng, 1, 65536), draw.log_int(rng, 1, MAX_EXPERTS)
    problem = {"T": T, "E": E, "top_k": rng.randint(1, min(MAX_TOP_K, E)), "valid": rng.randint(0, T)}
    if rng.random() < 0.5:                             # a range of local experts (expert parallelism)
        problem["start"] = rng.randint(0, E)
        problem["end"] = rng.randint(problem["start"], E)
    return problem


def random_token_rows(rng) -> dict:
    """A routed rows of D elements from / into T tokens' rows (A up to 262144, T to 65536, D to
    16384), at most 2**26 elements on either side; a valid row count of 0..A (the scatter's)."""
    problem = draw.within(rng, lambda r: {"A": draw.log_int(r, 1, 262144), "T": draw.log_int(r, 1, 65536),
                                          "D": draw.log_int(r, 1, 16384)},
                          lambda p: max(p["A"], p["T"]) * p["D"], 1 << 26)
    return {**problem, "valid": rng.randint(0, problem["A"])}


def _valid_count(sig: dict, count: int, device) -> torch.Tensor | None:
    """The examples' valid_token_count: ``count`` where the signature has one, else None."""
    return torch.full((1,), count, device=device, dtype=torch.int32) if sig.get("has_valid_count") else None


def _routing_example(problem: dict, sig: dict, device) -> tuple:
    """Scores for T tokens over E experts; top_k from the problem (default 2), and its expert
    range ("start", "end") and valid token count ("valid", with the signature's
    has_valid_count) where it has them."""
    dtype = getattr(torch, sig.get("score_dtype", "float32"))
    T, E = problem["T"], problem["E"]
    scores = torch.rand(T, E, device=device).to(dtype)
    return (scores, problem.get("start"), problem.get("end"), _valid_count(sig, problem.get("valid", T), device),
            min(problem.get("top_k", 2), E))


# -- index_shuffling ------------------------------------------------------------------------------------
def _check_index_shuffling(scores, expert_index_start, expert_index_end, valid_token_count, top_k):
    op = "index_shuffling"
    check.tensor(op, "scores", scores, SCORE_DTYPES, ndim=2, unit_last_stride=False)
    E = scores.shape[1]
    if not 1 <= E <= MAX_EXPERTS:
        raise InputError(f"{op}: scores has E={E} experts; supported: 1..{MAX_EXPERTS}")
    if not 1 <= top_k <= min(MAX_TOP_K, E):
        raise InputError(f"{op}: top_k={top_k} must be in 1..{min(MAX_TOP_K, E)} for E={E}")
    start = 0 if expert_index_start is None else int(expert_index_start)
    end = E if expert_index_end is None else int(expert_index_end)
    if not 0 <= start <= end <= E:
        raise InputError(f"{op}: expert_index_start={start}, expert_index_end={end} must satisfy "
                         f"0 <= start <= end <= E={E}")
    _check_valid_count(op, valid_token_count, scores, "scores")


def _index_shuffling_outputs(scores, expert_index_start=None, expert_index_end=None, valid_token_count=None,
                             top_k=1):
    T, E = scores.shape
    return [((E + 2,), torch.int32), ((T * top_k,), torch.int32), ((T * top_k,), torch.int32)]


def _prepare_index_shuffling(select, outputs, scores, expert_index_start, expert_index_end, valid_token_count,
                             top_k):
    counts, expert_indices, token_indices = outputs
    T, E = scores.shape
    start = 0 if expert_index_start is None else int(expert_index_start)
    end = E if expert_index_end is None else int(expert_index_end)
    if T == 0:
        counts.zero_()
        return None
    if _one_column_needs_padding(scores):
        # A second expert scored -inf and outside [start, end): never chosen over expert 0
        # (ties go to the lower expert), never routed; its count is dropped.
        padded_counts, padded_experts, padded_tokens = index_shuffling(
            _two_columns(scores, float("-inf")), start, end, valid_token_count, top_k)
        counts.copy_(torch.cat([padded_counts[:1], padded_counts[2:]]))
        expert_indices.copy_(padded_experts)
        token_indices.copy_(padded_tokens)
        return None
    dev = scores.device
    # Workspaces the two kernels write and read within the call: the stream's reusable scratch
    # (dispatch.call_scratch; the launch is then bound to the stream), else allocated.
    work = call_scratch(dev, torch.int32, ((T * top_k,), (limits.index_shuffling_hist_ints(E),)))
    slots, histogram = work.tensors
    kernel, _ = select((valid_token_count is not None, dtype_name(scores.dtype)), (T, E))
    # top_k and the expert range are plan_values: a plan holds them (see Fixed).
    return Launch(kernel, (scores, _valid_arg(valid_token_count, dev), counts, expert_indices, token_indices,
                           slots, histogram, Fixed(top_k), Fixed(start), Fixed(end)),
                  scratch=work.per_call, stream_bound=work.stream_bound)


def _index_shuffling_reference(scores, expert_index_start=None, expert_index_end=None, valid_token_count=None,
                               top_k=1):
    """Top-k experts per token (ties to the lower expert), pairs grouped by expert, tokens in
    order within an expert; the counts and indices of routed pairs (valid tokens, experts in
    [start, end)), the indices padded with zeros to T * top_k (the op leaves that tail
    unspecified)."""
    T, E = scores.shape
    start = 0 if expert_index_start is None else expert_index_start
    end = E if expert_index_end is None else expert_index_end
    valid = T if valid_token_count is None else int(valid_token_count.reshape(()))
    experts = torch.topk(scores[:valid].float(), top_k, dim=1).indices
    tokens = torch.arange(valid, device=scores.device).repeat_interleave(top_k)
    experts = experts.reshape(-1)
    keep = (experts >= start) & (experts < end)
    experts, tokens = experts[keep], tokens[keep]
    order = torch.argsort(experts * T + tokens)
    counts = torch.bincount(experts, minlength=E).to(torch.int32)
    routed = torch.tensor([T, experts.numel()], dtype=torch.int32, device=scores.device)
    padding = T * top_k - experts.numel()
    expert_indices = torch.nn.functional.pad((experts[order] - start).to(torch.int32), (0, padding))
    token_indices = torch.nn.functional.pad(tokens[order].to(torch.int32), (0, padding))
    return torch.cat([counts, routed]), expert_indices, token_indices


def _routed_prefix(results: tuple) -> tuple:
    """index_shuffling's defined results: the counts, and the first counts[E + 1] routed pairs."""
    counts, experts, tokens = results
    routed = int(counts[-1])
    return counts, experts[:routed], tokens[:routed]


index_shuffling = declare(OpDecl(
    name="index_shuffling",
    schema="(Tensor scores, int? expert_index_start=None, int? expert_index_end=None, "
           "Tensor? valid_token_count=None, int top_k=1) -> (Tensor, Tensor, Tensor)",
    doc="""Route each of T tokens to its top_k experts (by score, ties to the lower expert) and group
    the (token, expert) pairs by expert. Returns (counts [E + 2] int32: per-expert counts, then T,
    then the routed total; expert_indices [T * top_k] int32 (minus expert_index_start);
    token_indices [T * top_k] int32). Only the first counts[E + 1] entries are meaningful.""",
    check=_check_index_shuffling, outputs=_index_shuffling_outputs, prepare=_prepare_index_shuffling,
    signature=("has_valid_count", "score_dtype"), problem=("T", "E"), example=_routing_example,
    reference=_index_shuffling_reference, defined=_routed_prefix,
    plan_values=("expert_index_start", "expert_index_end", "top_k"), small_problem={"T": 5, "E": 16},
    random_problem=_random_routing))


# -- gather_scale_dense_tokens --------------------------------------------------------------------------------
def _check_gather_inputs(op, x, x_dtypes, token_indices, expert_indices, scores):
    """The checks every gather op makes of x, the gathered (token, expert) pairs and the scores."""
    check.tensor(op, "x", x, x_dtypes, ndim=2)
    _check_indices(op, "token_indices", token_indices)
    _check_indices(op, "expert_indices", expert_indices)
    check.shape(op, "expert_indices", expert_indices, token_indices.shape, "one expert per gathered row")
    check.tensor(op, "scores", scores, SCORE_DTYPES, ndim=2, unit_last_stride=False)
    if scores.shape[0] != x.shape[0]:
        raise InputError(f"{op}: scores has {scores.shape[0]} rows but x has {x.shape[0]} tokens")


def _check_gather(x, token_indices, expert_indices, scores, valid_token_count):
    op = "gather_scale_dense_tokens"
    _check_gather_inputs(op, x, check.FLOAT_DTYPES, token_indices, expert_indices, scores)
    check.same_device(op, "x", x, token_indices=token_indices, expert_indices=expert_indices, scores=scores)
    _check_valid_count(op, valid_token_count, x, "x")


def _prepare_gather(select, outputs, x, token_indices, expert_indices, scores, valid_token_count):
    (out,) = outputs
    if out.numel() == 0:
        return None
    tok, exp = _int32(token_indices), _int32(expert_indices)
    if _one_column_needs_padding(x):
        out.copy_(gather_scale_dense_tokens(_two_columns(x), tok, exp, scores, valid_token_count)[:, :1])
        return None
    x = check.rows(x)
    A, D = tok.shape[0], x.shape[1]
    sig = (check.vector_bytes(x, out), dtype_name(x.dtype), valid_token_count is not None, dtype_name(scores.dtype))
    kernel, _ = select(sig, (A, D))
    return Launch(kernel, (x, tok, exp, scores, _valid_arg(valid_token_count, x.device), out))


def _gather_example(problem: dict, sig: dict, device) -> tuple:
    dtype = getattr(torch, sig.get("dtype", "bfloat16"))
    T, D, A = problem.get("T", problem["A"]), problem["D"], problem["A"]
    x = torch.randn(T, D, device=device, dtype=dtype)
    token_indices = torch.randint(0, T, (A,), device=device, dtype=torch.int32)
    expert_indices = torch.randint(0, 8, (A,), device=device, dtype=torch.int32)
    scores = torch.rand(T, 8, device=device).to(getattr(torch, sig.get("score_dtype", "float32")))
    # Every row valid: the op leaves rows past a smaller count uninitialized.
    return x, token_indices, expert_indices, scores, _valid_count(sig, A, device)


def _gather_reference(x, token_indices, expert_indices, scores, valid_token_count=None):
    tok, exp = token_indices.long(), expert_indices.long()
    return (x[tok].float() * scores[tok, exp].float().unsqueeze(1)).to(x.dtype)


gather_scale_dense_tokens = declare(OpDecl(
    name="gather_scale_dense_tokens",
    schema="(Tensor x, Tensor token_indices, Tensor expert_indices, Tensor scores, "
           "Tensor? valid_token_count=None) -> Tensor",
    doc="""out[i] = x[token_indices[i]] * scores[token_indices[i], expert_indices[i]] for the first
    valid_token_count (default: all) rows; later rows are left uninitialized, as in MSLK.""",
    check=_check_gather,
    outputs=lambda x, token_indices, expert_indices, scores, valid_token_count=None: [
        ((token_indices.shape[0], x.shape[1]), x.dtype)],
    prepare=_prepare_gather, signature=("vec_bytes", "dtype", "has_valid_count", "score_dtype"),
    problem=("A", "D"), example=_gather_example, reference=_gather_reference,
    small_problem={"A": 10, "D": 64}, random_problem=random_token_rows))


# -- scatter_add_dense_tokens ------------------------------------------------------------------------------------
def _check_scatter(out_tokens, in_tokens, token_indices, valid_token_count):
    op = "scatter_add_dense_tokens"
    check.tensor(op, "out_tokens", out_tokens, check.FLOAT_DTYPES, ndim=2)
    check.tensor(op, "in_tokens", in_tokens, check.FLOAT_DTYPES, ndim=2)
    check.same_dtype(op, "in_tokens", in_tokens, out_tokens.dtype, "out_tokens")
    _check_indices(op, "token_indices", token_indices)
    if in_tokens.shape[1] != out_tokens.shape[1]:
        raise InputError(f"{op}: in_tokens has {in_tokens.shape[1]} columns but out_tokens has "
                         f"{out_tokens.shape[1]}")
    check.shape(op, "token_indices", token_indices, in_tokens.shape[:1], "one destination token per input row")
    if not out_tokens.is_contiguous():
        raise InputError(f"{op}: out_tokens is updated in place and must be contiguous, got strides "
                         f"{out_tokens.stride()}")
    check.same_device(op, "out_tokens", out_tokens, in_tokens=in_tokens, token_indices=token_indices)
    _check_valid_count(op, valid_token_count, out_tokens, "out_tokens")


def _prepare_scatter(select, outputs, out_tokens, in_tokens, token_indices, valid_token_count):
    A, D = in_tokens.shape
    if A == 0 or D == 0 or out_tokens.shape[0] == 0:
        return None
    tok = _int32(token_indices)
    if _one_column_needs_padding(out_tokens):
        padded = _two_columns(out_tokens)
        scatter_add_dense_tokens(padded, _two_columns(in_tokens), tok, valid_token_count)
        out_tokens.copy_(padded[:, :1])
        return None
    y = check.rows(in_tokens)
    sig = (check.vector_bytes(out_tokens, y), dtype_name(y.dtype), valid_token_count is not None)
    kernel, chosen = select(sig, (A, D, out_tokens.shape[0]))
    # Per-token counts, offsets, positions, row lists and first rows, which only the sorted
    # method uses (the linked one, CuTe only, takes its heads and next rows from the same space;
    # see the CuTe template); the atomic method gets the cached placeholder.
    # The kernels fill the workspace before they read it, so the stream's reusable scratch serves.
    if chosen.get("method") in ("sorted", "linked"):
        work = call_scratch(y.device, torch.int32, ((limits.scatter_workspace_ints(out_tokens.shape[0], A),),))
    else:
        work = Scratch((placeholder(y.device, torch.int32),), (), False)
    return Launch(kernel, (out_tokens, y, tok, _valid_arg(valid_token_count, y.device), *work.tensors),
                  scratch=work.per_call, stream_bound=work.stream_bound)


def _scatter_example(problem: dict, sig: dict, device) -> tuple:
    dtype = getattr(torch, sig.get("dtype", "bfloat16"))
    A, D, T = problem["A"], problem["D"], problem.get("T", problem["A"])
    return (torch.randn(T, D, device=device, dtype=dtype), torch.randn(A, D, device=device, dtype=dtype),
            torch.randint(0, T, (A,), device=device, dtype=torch.int32),
            _valid_count(sig, problem.get("valid", A), device))


def _scatter_reference(out_tokens, in_tokens, token_indices, valid_token_count=None):
    """The updated out_tokens (the op itself updates in place and returns nothing)."""
    valid = in_tokens.shape[0] if valid_token_count is None else int(valid_token_count.reshape(()))
    tok = token_indices[:valid].long()
    keep = (tok >= 0) & (tok < out_tokens.shape[0])
    return out_tokens.float().index_add(0, tok[keep], in_tokens[:valid][keep].float()).to(out_tokens.dtype)


scatter_add_dense_tokens = declare(OpDecl(
    name="scatter_add_dense_tokens",
    schema="(Tensor(a!) out_tokens, Tensor in_tokens, Tensor token_indices, Tensor? valid_token_count=None) -> ()",
    doc="""out_tokens[token_indices[i]] += in_tokens[i] for the first valid_token_count (default: all)
    rows, in place. Large inputs, and inputs whose tokens get 16 or more rows each on average,
    are grouped by token and each token's rows summed in fp32 (one rounding per out element);
    other small ones use atomic adds, like MSLK. Either way the order of a
    token's additions is unspecified, so results are order-independent only where the sums are
    exact. Rows whose token index is outside [0, T) are skipped.""",
    check=_check_scatter, outputs=lambda *args: [], prepare=_prepare_scatter,
    signature=("vec_bytes", "dtype", "has_valid_count"), problem=("A", "D", "T"), example=_scatter_example,
    # bf16 atomic adds round after every addition (the small-input method), the reference once.
    reference=_scatter_reference, tolerance=(2e-2, 8e-2), small_problem={"A": 10, "D": 64},
    # a token's sum over its rows: a token of many rows adds many roundings (the fuzz tests then
    # measure the error against the result's scale)
    random_problem=random_token_rows, long_sums=True))
