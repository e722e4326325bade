"""gather_scale_quant_dense_tokens: MoE's gather with the router-score scale and the row-wise FP8
quantization fused (MSLK's name, argument order and semantics), so the FP8 expert path reads x
once and never writes bf16 activations. The templates' docstrings give the kernels' contract.

Unlike gather_scale_dense_tokens, the kernels always read scale_ub and valid_token_count: an
absent one is passed as a cached constant (scale_ub = +inf, valid_token_count = INT32_MAX) that
leaves the result unchanged. That keeps the templates' signatures to dtype x alignment x score
dtype (the CI compiles every signature), at the cost of one load per row."""
from __future__ import annotations

import torch

from mslk_dsl.device import target_of
from mslk_dsl.errors import InputError
from mslk_dsl.ops import validate as check
from mslk_dsl.ops.declaration import Launch, OpDecl, declare
from mslk_dsl.ops.dispatch import dtype_name, placeholder
from mslk_dsl.ops.elementwise import _check_scale_ub, _quantize_reference, fp8_dtype_for
from mslk_dsl.ops.moe import (_check_gather_inputs, _check_valid_count, _gather_example,
                              _gather_reference, _int32, _one_column_needs_padding, _two_columns,
                              random_token_rows)

OP = "gather_scale_quant_dense_tokens"
# The activations of an FP8 MoE; fp32 ones can take gather_scale_dense_tokens, then quantize_fp8_row.
X_DTYPES = (torch.bfloat16, torch.float16)
def _check(x, token_indices, expert_indices, scores, scale_ub, valid_token_count):
    _check_gather_inputs(OP, x, X_DTYPES, token_indices, expert_indices, scores)
    if x.shape[1] == 0 and token_indices.shape[0] > 0:
        raise InputError(f"{OP}: x has no columns (shape {tuple(x.shape)}); a row-wise FP8 scale needs at "
                         f"least one element per row")
    check.same_device(OP, "x", x, token_indices=token_indices, expert_indices=expert_indices, scores=scores)
    _check_scale_ub(OP, scale_ub, x, "x")
    _check_valid_count(OP, valid_token_count, x, "x")


def _outputs(x, token_indices, expert_indices, scores, scale_ub=None, valid_token_count=None):
    rows = token_indices.shape[0]
    return [((rows, x.shape[1]), fp8_dtype_for(x.device)), ((rows,), torch.float32)]


def _prepare(select, outputs, x, token_indices, expert_indices, scores, scale_ub, valid_token_count):
    xq, scale = outputs
    if xq.shape[0] == 0:
        return None
    tok, exp = _int32(token_indices), _int32(expert_indices)
    if _one_column_needs_padding(x):
        # A zero column leaves every row's absmax, hence its scale and first column, unchanged.
        padded_q, padded_scale = gather_scale_quant_dense_tokens(_two_columns(x), tok, exp, scores, scale_ub,
                                                                 valid_token_count)
        xq.copy_(padded_q[:, :1])
        scale.copy_(padded_scale)
        return None
    if scores.stride(1) != 1 and scores.shape[1] > 1 and target_of(x.device).backend == "flydsl":
        scores = scores.contiguous()  # FlyDSL kernels are specialized on a unit column stride
    x = check.rows(x)
    dev = x.device
    # Cached constants (placeholders with a fill: launch plans hold them).
    ub = placeholder(dev, torch.float32, fill=float("inf")) if scale_ub is None else scale_ub.reshape(1)
    valid = placeholder(dev, torch.int32, fill=2**31 - 1) if valid_token_count is None else valid_token_count.reshape(1)
    kernel, _ = select((check.vector_bytes(x, xq), dtype_name(x.dtype), dtype_name(scores.dtype)),
                       (xq.shape[0], x.shape[1]))
    return Launch(kernel, (x, tok, exp, scores, valid, ub, xq, scale))


def _example(problem: dict, sig: dict, device) -> tuple:
    return (*_gather_example(problem, sig, device)[:4], None, None)


def _reference(x, token_indices, expert_indices, scores, scale_ub=None, valid_token_count=None):
    """gather_scale_dense_tokens (the scaled row rounded to x's dtype), then quantize_fp8_row;
    rows at and past valid_token_count come back as zeros (the op leaves them unwritten)."""
    xq, scale = _quantize_reference(_gather_reference(x, token_indices, expert_indices, scores), scale_ub)
    if valid_token_count is not None:
        n = int(valid_token_count.reshape(()))
        xq[n:] = 0
        scale[n:] = 0
    return xq, scale


gather_scale_quant_dense_tokens = declare(OpDecl(
    name=OP,
    schema="(Tensor x, Tensor token_indices, Tensor expert_indices, Tensor scores, Tensor? scale_ub=None, "
           "Tensor? valid_token_count=None) -> (Tensor, Tensor)",
    doc="""quantize_fp8_row(gather_scale_dense_tokens(x, token_indices, expert_indices, scores),
    scale_ub) in one pass: row i is x[t] * scores[t, e] (t, e = token_indices[i],
    expert_indices[i]; fp32 product rounded to x's dtype), quantized with its own scale. Returns
    (xq [A, D] fp8, scale [A] fp32), x[t] * s ~= xq[i] * scale[i]. Rows at and past
    valid_token_count (default: all rows valid) are left unwritten, as in MSLK.""",
    check=_check, outputs=_outputs, prepare=_prepare, signature=("vec_bytes", "dtype", "score_dtype"),
    problem=("A", "D"), example=_example, reference=_reference,
    small_problem={"A": 10, "D": 64}, random_problem=random_token_rows))
