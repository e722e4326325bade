"""Decode in MSLK's terms: the forward that serves the two KV-cache bias classes of attn_bias.py
(MSLK's ``mslk.attention.fmha.attn_bias`` ones that inference engines use) with ``ops.attention_decode``, and
``merge_attentions`` with MSLK's argument forms.

MSLK packs the batch into one sequence: q [1, B * Mq, Hq, D] (every sequence the same Mq), and
k / v [1, B * kv_padding, Hkv, D] (sequence b's keys at rows b * kv_padding ...) or, paged,
[1, num_pages * page_size, Hkv, D] with a block table. Both packed and batched ([B, Mq, Hq, D],
[B, kv_padding, Hkv, D], [num_pages, page_size, Hkv, D]) tensors are taken; the output has q's
form. Unlike MSLK the KV lengths may stay on the device (a tensor): nothing here reads them on
the host, so a decode step captures in a CUDA graph.
"""
from __future__ import annotations

import torch

from mslk_dsl import ops
from mslk_dsl.attention.attn_bias import (BlockDiagonalCausalWithOffsetPaddedKeysMask,
                                          PagedBlockDiagonalCausalWithOffsetPaddedKeysMask)
from mslk_dsl.errors import InputTypeError


DECODE_BIASES = (BlockDiagonalCausalWithOffsetPaddedKeysMask, PagedBlockDiagonalCausalWithOffsetPaddedKeysMask)


def decode_partial(q, k, v, attn_bias, scale: float | None = None, num_splits: int = 0):
    """(out, lse fp32 [B, Hq, Mq]) of decode attention under one of DECODE_BIASES."""
    if not isinstance(attn_bias, DECODE_BIASES):
        raise InputTypeError(f"decode_partial takes {[c.__name__ for c in DECODE_BIASES]}, got {type(attn_bias).__name__}")
    B = attn_bias.kv_seqlen.shape[0]
    Mq = attn_bias.q_len
    packed = q.dim() == 4 and q.shape[0] == 1 and B * Mq == q.shape[1] and B > 1
    qb = q.reshape(B, Mq, *q.shape[2:]) if packed else q
    table = None
    rows = attn_bias.kv_padding
    if isinstance(attn_bias, PagedBlockDiagonalCausalWithOffsetPaddedKeysMask):
        table, rows = attn_bias.block_tables, attn_bias.page_size
    if k.shape[0] == 1 and (table is not None or B > 1):
        k = k.reshape(-1, rows, *k.shape[2:])
        v = v.reshape(-1, rows, *v.shape[2:])
    lengths = attn_bias.kv_seqlen
    if lengths.device != q.device:  # host lists: copied once to the device (no read back)
        lengths = lengths.to(q.device)
    out, lse = ops.traceable("attention_decode")(qb, k, v, lengths, table, scale, True, num_splits)
    return (out.reshape(q.shape[:-1] + out.shape[-1:]) if packed else out), lse


def decode_forward(q, k, v, attn_bias, scale: float | None = None):
    """The attention output of ``decode_partial``."""
    return decode_partial(q, k, v, attn_bias, scale)[0]


def merge_attentions(attn_split, lse_split, write_lse: bool = True, output_dtype: torch.dtype | None = None):
    """MSLK's merge_attentions: chunks [S, B, M, (G,) H, K] (a stacked tensor or a list of
    [B, M, (G,) H, K]) and their LSEs [S, B, (G,) H, M] -> (out [B, M, (G,) H, K], lse or None)."""
    outs = torch.stack(list(attn_split)) if not isinstance(attn_split, torch.Tensor) else attn_split
    lses = torch.stack(list(lse_split)) if not isinstance(lse_split, torch.Tensor) else lse_split
    grouped = outs.dim() == 6
    if grouped:
        S, B, M, G, H, K = outs.shape
        outs, lses = outs.reshape(S, B, M, G * H, K), lses.reshape(S, B, G * H, M)
    out, lse = ops.traceable("merge_attentions")(outs, lses.float())
    if grouped:
        out, lse = out.reshape(B, M, G, H, K), lse.reshape(B, G, H, M)
    if output_dtype is not None and out.dtype != output_dtype:
        out = out.to(output_dtype)
    return out, (lse if write_lse else None)
