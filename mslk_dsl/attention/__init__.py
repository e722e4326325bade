"""Attention with MSLK's API (``mslk.attention.fmha``): q [B, Mq, Hq, K], k [B, Mk, Hkv, K], v
[B, Mk, Hkv, Kv], out [B, Mq, Hq, Kv]; the mask is an ``attn_bias`` object (see attn_bias.py).
GQA / MQA: Hkv may divide Hq, and k / v are read as they are (MSLK asks the caller to expand
them). MSLK's other layouts are taken too: [B, M, K] (one head) and [B, M, G, H, K] (G groups
of H query heads; k / v [B, Mk, G, H, K] expanded across H, as MSLK's GQA form has them, or
[B, Mk, G, 1, K], read as G KV heads without a copy); results come back in q's layout.

    out = memory_efficient_attention_forward(q, k, v, attn_bias=LowerTriangularMask())
    out, lse = memory_efficient_attention_partial(q, k, v, attn_bias=...)   # lse fp32 [B, Hq, Mq]
    out, lse = merge_attentions(outs, lses)                                  # exact LSE merge

The arguments are MSLK's, in its order: (query, key, value, attn_bias=None, p=0.0, scale=None,
*, op=None, output_dtype=None, deterministic=False). Dropout (p != 0) and MSLK's backend
choice (op) are refused with an error; the kernels are deterministic whatever
``deterministic`` says; ``output_dtype`` casts the output.

Both run the ``attention_fwd`` op (``torch.ops.mslk_dsl.attention_fwd``), or, under the KV-cache
biases of decode (BlockDiagonalCausalWithOffsetPaddedKeysMask and its paged form), the
``attention_decode`` op (split-KV; see decode.py). The ops validate the inputs before anything is
launched.
"""
from __future__ import annotations

import torch

from mslk_dsl.attention import attn_bias
from mslk_dsl.attention.attn_bias import (AttentionBias, BlockDiagonalCausalFromBottomRightMask,
                                          BlockDiagonalCausalLocalAttentionFromBottomRightMask,
                                          BlockDiagonalCausalLocalAttentionMask,
                                          BlockDiagonalCausalMask, BlockDiagonalCausalWithOffsetPaddedKeysMask,
                                          BlockDiagonalMask, LocalAttentionFromBottomRightMask,
                                          LowerTriangularFromBottomRightLocalAttentionMask,
                                          LowerTriangularFromBottomRightMask, LowerTriangularMask,
                                          PagedBlockDiagonalCausalWithOffsetPaddedKeysMask)
from mslk_dsl.attention.decode import DECODE_BIASES, decode_partial, merge_attentions
from mslk_dsl.errors import InputError, InputTypeError, UnsupportedError
from mslk_dsl.ops import traceable

__all__ = ["AttentionBias", "BlockDiagonalCausalFromBottomRightMask", "BlockDiagonalCausalLocalAttentionFromBottomRightMask",
           "BlockDiagonalCausalLocalAttentionMask",
           "BlockDiagonalCausalMask", "BlockDiagonalCausalWithOffsetPaddedKeysMask", "BlockDiagonalMask",
           "LocalAttentionFromBottomRightMask", "LowerTriangularFromBottomRightLocalAttentionMask",
           "LowerTriangularFromBottomRightMask", "LowerTriangularMask", "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask",
           "attn_bias", "memory_efficient_attention_forward", "memory_efficient_attention_partial", "merge_attentions"]


def _mask_args(attn_bias: AttentionBias | None, q: torch.Tensor, k: torch.Tensor) -> dict:
    if attn_bias is None:
        return {}
    if isinstance(attn_bias, torch.Tensor):
        raise UnsupportedError("tensor biases are not supported; pass an attn_bias class (attn_bias.py)")
    if not isinstance(attn_bias, AttentionBias):
        raise InputTypeError(f"attn_bias must be None or an mslk_dsl.attention.attn_bias class, got "
                             f"{type(attn_bias).__name__}")
    return attn_bias.fwd_args(q, k)


def _to_bmhk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(q, k, v) in the ops' [B, M, H, K] layout, and a function that gives (out, lse) back in
    q's layout, as MSLK does: [B, M, K] is one head (lse [B, 1, M]); [B, M, G, H, K] is G groups
    of H query heads, whose k / v, expanded across H (stride 0) or of one head per group, are G KV
    heads (GQA, not copied), and otherwise G * H heads of their own."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"attention: {name} must be a tensor, got {type(t).__name__}")
    if q.dim() != k.dim() or q.dim() != v.dim() or q.dim() not in (3, 4, 5):
        raise InputError(f"attention: q, k and v must all be [B, M, K], [B, M, H, K] or [B, M, G, H, K]; got "
                         f"shapes {tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")
    if q.dim() == 4:
        return q, k, v, lambda out, lse: (out, lse)
    if q.dim() == 3:
        # (MSLK reshapes out alone: lse stays [B, 1, M].)
        return q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), lambda out, lse: (out.squeeze(2), lse)
    B, M, G, H, _ = q.shape
    for name, t in (("k", k), ("v", v)):
        if t.shape[2] != G or t.shape[3] not in (1, H):
            raise InputError(f"attention: {name} has shape {tuple(t.shape)}; for q of shape {tuple(q.shape)} "
                             f"([B, M, G, H, K]) it must be [B, Mk, {G}, {H} or 1, K]")
    grouped = all(t.shape[3] == 1 or t.stride(3) == 0 for t in (k, v))
    if grouped:
        k4, v4 = k[:, :, :, 0], v[:, :, :, 0]
    else:   # full heads in the grouped layout (a k / v of one head per group is expanded first)
        k4, v4 = (t.expand(*t.shape[:3], H, t.shape[4]).reshape(t.shape[0], t.shape[1], G * H, t.shape[4])
                  for t in (k, v))
    return (q.reshape(B, M, G * H, q.shape[4]), k4, v4,
            lambda out, lse: (out.reshape(B, M, G, H, out.shape[-1]), lse.reshape(B, G, H, lse.shape[-1])))


def _refuse_what_mslk_dsl_does_not_do(p: float, op) -> None:
    if p != 0.0:
        raise UnsupportedError(f"attention: dropout is not supported (p={p!r}; mslk_dsl's attention is "
                               "inference only); the softmax scale is the keyword argument scale=")
    if op is not None:
        raise UnsupportedError(f"attention: op= picks one of MSLK's attention backends; mslk_dsl has its own "
                               f"kernels and takes op=None, got {op!r}")


def memory_efficient_attention_partial(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                       attn_bias: AttentionBias | None = None, p: float = 0.0,
                                       scale: float | None = None, *, op=None,
                                       output_dtype: torch.dtype | None = None, _allow_backward: bool = False,
                                       deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): softmax(q k^T * scale + bias) v and the log-sum-exp of each row's scaled,
    masked scores (fp32 [B, Hq, Mq], natural log; -inf for a row with no visible key, whose out
    is 0). Partial results over disjoint key sets merge exactly by their LSEs (merge_attentions).
    MSLK's arguments (see the module's docstring); ``_allow_backward`` is accepted and has no
    effect (there is no backward)."""
    _refuse_what_mslk_dsl_does_not_do(p, op)
    q, k, v, restore = _to_bmhk(query, key, value)
    if isinstance(attn_bias, DECODE_BIASES):   # a KV cache: the split-KV decode kernel
        out, lse = decode_partial(q, k, v, attn_bias, scale)
    else:
        out, lse = traceable("attention_fwd")(q, k, v, scale=scale, **_mask_args(attn_bias, q, k))
    if output_dtype is not None and out.dtype != output_dtype:
        out = out.to(output_dtype)
    return restore(out, lse)


def memory_efficient_attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                       attn_bias: AttentionBias | None = None, p: float = 0.0,
                                       scale: float | None = None, *, op=None,
                                       output_dtype: torch.dtype | None = None,
                                       deterministic: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v, in q's dtype (or ``output_dtype``); ``scale`` defaults
    to 1 / sqrt(K). MSLK's arguments (see the module's docstring)."""
    return memory_efficient_attention_partial(query, key, value, attn_bias, p, scale, op=op,
                                              output_dtype=output_dtype, deterministic=deterministic)[0]
