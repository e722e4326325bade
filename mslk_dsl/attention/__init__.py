"""Attention with MSLK's API (``mslk.attention.fmha``): q [B, Mq, Hq, K], k / v [B, Mk, Hkv, K],
out [B, Mq, Hq, K]; the mask is an ``attn_bias`` object (see attn_bias.py). GQA / MQA: Hkv may
divide Hq, and k / v are read as they are (MSLK asks the caller to expand them).

    out = memory_efficient_attention_forward(q, k, v, attn_bias=LowerTriangularMask())
    out, lse = memory_efficient_attention_partial(q, k, v, attn_bias=...)   # lse fp32 [B, Hq, Mq]
    out, lse = merge_attentions(outs, lses)                                  # exact LSE merge

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
                                          BlockDiagonalCausalMask, BlockDiagonalCausalWithOffsetPaddedKeysMask,
                                          BlockDiagonalMask, LocalAttentionFromBottomRightMask,
                                          LowerTriangularFromBottomRightLocalAttentionMask,
                                          LowerTriangularFromBottomRightMask, LowerTriangularMask,
                                          PagedBlockDiagonalCausalWithOffsetPaddedKeysMask)
from mslk_dsl.attention.decode import DECODE_BIASES, decode_partial, merge_attentions
from mslk_dsl.errors import InputTypeError, UnsupportedError

__all__ = ["AttentionBias", "BlockDiagonalCausalFromBottomRightMask", "BlockDiagonalCausalLocalAttentionFromBottomRightMask",
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


def memory_efficient_attention_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                       attn_bias: AttentionBias | None = None,
                                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): softmax(q k^T * scale + bias) v and the log-sum-exp of each row's scaled,
    masked scores (fp32 [B, Hq, Mq], natural log; -inf for a row with no visible key, whose out
    is 0). Partial results over disjoint key sets merge exactly by their LSEs."""
    from mslk_dsl.ops import attention_fwd

    if isinstance(attn_bias, DECODE_BIASES):   # a KV cache: the split-KV decode kernel
        return decode_partial(q, k, v, attn_bias, scale)
    return attention_fwd(q, k, v, scale=scale, **_mask_args(attn_bias, q, k))


def memory_efficient_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                       attn_bias: AttentionBias | None = None,
                                       scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v, in q's dtype; ``scale`` defaults to 1 / sqrt(K)."""
    return memory_efficient_attention_partial(q, k, v, attn_bias, scale)[0]
