"""Attention biases with MSLK's names and semantics (``mslk/attention/fmha/attn_bias.py``).

A bias is never materialised by the kernels: each class says which mask of the attention op
(mslk_dsl/ops/attention.py) it is, through ``fwd_args(q, k)``: keyword arguments of
``attention_fwd`` (seqstarts for packed sequences, causal, bottom_right, window_left /
window_right). ``materialize(shape)`` builds the additive bias (0 / -inf) for tests and
debugging, as MSLK's does.

With i a query row and j a key row of one sequence (Mq / Mk its lengths):
  LowerTriangularMask                   j <= i (aligned top-left)
  LowerTriangularFromBottomRightMask    j <= i + Mk - Mq (aligned bottom-right)
  LocalAttentionFromBottomRightMask(wl, wr)
                                        -wl <= j - i - (Mk - Mq) <= wr
  LowerTriangularFromBottomRightLocalAttentionMask(window_size)
                                        -(window_size - 1) <= j - i - (Mk - Mq) <= 0
  BlockDiagonalMask                     packed sequences (B = 1), each attends only to itself
  BlockDiagonalCausalMask               ... causal, aligned top-left in each sequence
  BlockDiagonalCausalLocalAttentionMask(window_size)
                                        ... and i - window_size < j (top-left)
  BlockDiagonalCausalFromBottomRightMask  ... causal, aligned bottom-right in each sequence
  BlockDiagonalCausalLocalAttentionFromBottomRightMask(window_size)
                                        ... and the causal band of the local mask above
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mslk_dsl.errors import InputError, UnsupportedError
from mslk_dsl.ops.attention import visible_keys


class AttentionBias:
    """Base class of the biases (MSLK's name)."""

    def fwd_args(self, q: torch.Tensor, k: torch.Tensor) -> dict:
        """The mask as keyword arguments of ``attention_fwd`` for q / k of these shapes."""
        raise UnsupportedError(f"{type(self).__name__} has no prefill kernel")

    def materialize(self, shape: tuple[int, ...], dtype=torch.float32, device="cpu") -> torch.Tensor:
        """The additive bias [..., Mq, Mk]: 0 where a key is visible, -inf elsewhere."""
        *lead, mq, mk = shape
        visible = torch.zeros(mq, mk, dtype=torch.bool, device=device)
        for (q0, q1), (k0, k1), args in self._blocks(mq, mk):
            visible[q0:q1, k0:k1] = visible_keys(q1 - q0, k1 - k0, device=device, **args)
        bias = torch.zeros(mq, mk, dtype=dtype, device=device).masked_fill(~visible, -math.inf)
        return bias.expand(*lead, mq, mk) if lead else bias

    def _blocks(self, mq: int, mk: int):
        """((q0, q1), (k0, k1), mask kwargs) of each sequence."""
        args = {key: value for key, value in self.fwd_args(torch.empty(1, mq, 1, 1), torch.empty(1, mk, 1, 1)).items()
                if key in ("causal", "bottom_right", "window_left", "window_right")}
        return [((0, mq), (0, mk), args)]


class LowerTriangularMask(AttentionBias):
    """Causal, aligned with the top-left corner: query i sees keys j <= i."""

    def fwd_args(self, q, k) -> dict:
        return {"causal": True, "bottom_right": False}


class LowerTriangularFromBottomRightMask(AttentionBias):
    """Causal, aligned with the bottom-right corner: the last query sees the last key."""

    def fwd_args(self, q, k) -> dict:
        return {"causal": True, "bottom_right": True}

    def make_local_attention(self, window_size: int) -> LowerTriangularFromBottomRightLocalAttentionMask:
        return LowerTriangularFromBottomRightLocalAttentionMask(window_size)


@dataclass
class LocalAttentionFromBottomRightMask(AttentionBias):
    """Query i sees key j when i - window_left <= j + Mq - Mk <= i + window_right."""

    window_left: int
    window_right: int

    def __post_init__(self) -> None:
        if self.window_left < 0 or self.window_right < 0:
            raise InputError(f"LocalAttentionFromBottomRightMask: windows must be >= 0, got "
                             f"window_left={self.window_left}, window_right={self.window_right}")

    def fwd_args(self, q, k) -> dict:
        return {"bottom_right": True, "window_left": self.window_left, "window_right": self.window_right}


@dataclass
class LowerTriangularFromBottomRightLocalAttentionMask(LowerTriangularFromBottomRightMask):
    """Bottom-right causal, and a key at least ``window_size`` rows before the diagonal is hidden."""

    _window_size: int

    def __post_init__(self) -> None:
        if self._window_size <= 0:
            raise InputError(f"expected window_size > 0, got {self._window_size}")

    def fwd_args(self, q, k) -> dict:
        return {"causal": True, "bottom_right": True, "window_left": self._window_size - 1}


@dataclass
class _SeqLenInfo:
    """Packed sequences: their start offsets (on the host and the device) and longest length."""

    seqstart: torch.Tensor
    seqstart_py: list[int]
    max_seqlen: int
    min_seqlen: int

    @classmethod
    def from_seqlens(cls, seqlens: Sequence[int], *, device=None) -> _SeqLenInfo:
        lengths = [int(n) for n in seqlens]
        if not lengths or min(lengths) < 0:
            raise InputError(f"sequence lengths must be a non-empty list of non-negative ints, got {lengths}")
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        device = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(torch.tensor(starts, dtype=torch.int32, device=device), starts, max(lengths), min(lengths))

    def intervals(self):
        return list(zip(self.seqstart_py, self.seqstart_py[1:]))


@dataclass
class BlockDiagonalMask(AttentionBias):
    """Packed sequences (q [1, sum(Mq_s), H, K]): queries of sequence s see only its keys."""

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _SeqLenInfo

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_seqlen: Sequence[int] | None = None, *, device=None):
        if kv_seqlen is not None and len(kv_seqlen) != len(q_seqlen):
            raise InputError(f"{cls.__name__}: {len(q_seqlen)} query lengths but {len(kv_seqlen)} key lengths")
        q_info = _SeqLenInfo.from_seqlens(q_seqlen, device=device)
        if kv_seqlen is None or list(kv_seqlen) == list(q_seqlen):
            return cls(q_seqinfo=q_info, k_seqinfo=q_info)
        k_info = _SeqLenInfo.from_seqlens(kv_seqlen, device=device)
        return cls(q_seqinfo=q_info, k_seqinfo=k_info)

    def _mask(self) -> dict:
        return {}

    def _equal_lengths(self) -> bool:
        return all(q1 - q0 == k1 - k0 for (q0, q1), (k0, k1) in zip(self.q_seqinfo.intervals(),
                                                                    self.k_seqinfo.intervals()))

    def fwd_args(self, q, k) -> dict:
        total_q, total_k = self.q_seqinfo.seqstart_py[-1], self.k_seqinfo.seqstart_py[-1]
        if q.shape[0] != 1 or q.shape[1] != total_q or k.shape[1] != total_k:
            raise InputError(f"{type(self).__name__}: q and k must be [1, {total_q}, ...] and [1, {total_k}, ...] "
                             f"(the packed sequences), got {tuple(q.shape)} and {tuple(k.shape)}")
        return {"seqstart_q": self.q_seqinfo.seqstart.to(q.device), "seqstart_k": self.k_seqinfo.seqstart.to(q.device),
                "max_seqlen_q": self.q_seqinfo.max_seqlen, "max_seqlen_k": self.k_seqinfo.max_seqlen,
                **self._mask()}

    def _blocks(self, mq, mk):
        return [(qi, ki, self._mask()) for qi, ki in zip(self.q_seqinfo.intervals(), self.k_seqinfo.intervals())]

    def make_causal(self) -> BlockDiagonalCausalMask:
        return BlockDiagonalCausalMask(self.q_seqinfo, self.k_seqinfo)

    def make_causal_from_bottomright(self) -> BlockDiagonalCausalFromBottomRightMask:
        return BlockDiagonalCausalFromBottomRightMask(self.q_seqinfo, self.k_seqinfo)

    def make_local_attention(self, window_size: int) -> BlockDiagonalCausalLocalAttentionMask:
        return BlockDiagonalCausalLocalAttentionMask(self.q_seqinfo, self.k_seqinfo, window_size)

    def make_local_attention_from_bottomright(self, window_size: int):
        return BlockDiagonalCausalLocalAttentionFromBottomRightMask(self.q_seqinfo, self.k_seqinfo, window_size)


@dataclass
class BlockDiagonalCausalMask(BlockDiagonalMask):
    """Packed sequences, each causal aligned top-left. The kernels align packed masks bottom-right,
    the same where a sequence's q and k lengths are equal (the usual prefill): other lengths are
    refused."""

    def _mask(self) -> dict:
        return {"causal": True, "bottom_right": True}

    def fwd_args(self, q, k) -> dict:
        if not self._equal_lengths():
            raise UnsupportedError(f"{type(self).__name__} with query and key lengths that differ within a "
                                   "sequence (top-left alignment) has no kernel; use the FromBottomRight form "
                                   "of the mask if that is what is meant")
        return super().fwd_args(q, k)

    def _blocks(self, mq, mk):
        return [(qi, ki, {"causal": True}) for qi, ki in zip(self.q_seqinfo.intervals(), self.k_seqinfo.intervals())]


@dataclass
class _CausalBand:
    """The causal band of the packed local masks: each query sees the ``_window_size`` keys up to
    its diagonal (MSLK's field name; a dataclass field after the sequence infos)."""

    _window_size: int = 0

    def __post_init__(self) -> None:
        if self._window_size <= 0:
            raise InputError(f"expected window_size > 0, got {self._window_size}")

    def _mask(self) -> dict:
        return {"causal": True, "bottom_right": True, "window_left": self._window_size - 1}


@dataclass
class BlockDiagonalCausalLocalAttentionMask(_CausalBand, BlockDiagonalCausalMask):
    """Packed sequences, each causal aligned top-left with a band: query i of a sequence sees its
    keys j with i - window_size < j <= i. As BlockDiagonalCausalMask, for sequences whose q and k
    lengths are equal (other lengths are refused)."""

    def _blocks(self, mq, mk):
        return [(qi, ki, {"causal": True, "window_left": self._window_size - 1})
                for qi, ki in zip(self.q_seqinfo.intervals(), self.k_seqinfo.intervals())]


@dataclass
class BlockDiagonalCausalFromBottomRightMask(BlockDiagonalMask):
    """Packed sequences, each causal aligned bottom-right."""

    def _mask(self) -> dict:
        return {"causal": True, "bottom_right": True}


@dataclass
class BlockDiagonalCausalLocalAttentionFromBottomRightMask(_CausalBand, BlockDiagonalMask):
    """Packed sequences, each with the causal band of LowerTriangularFromBottomRightLocalAttentionMask."""


# The KV-cache biases of decode (few queries per sequence against a long, padded or paged cache):
# served by attention_decode (decode.py), not by the prefill kernel.

def _lengths(values, device=None) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values if values.dtype == torch.int32 else values.to(torch.int32)
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def _query_length(q_seqlen) -> int:
    lengths = set(q_seqlen.tolist() if isinstance(q_seqlen, torch.Tensor) else q_seqlen)
    if len(lengths) != 1:
        raise InputError(f"decode needs the same number of queries in every sequence, got {sorted(lengths)}")
    return lengths.pop()


@dataclass
class BlockDiagonalCausalWithOffsetPaddedKeysMask(AttentionBias):
    """Sequence b: ``q_len`` queries, the last positions of its ``kv_seqlen[b]`` keys (causal,
    bottom-right), keys padded to ``kv_padding`` per sequence in the cache."""
    q_len: int
    kv_padding: int
    kv_seqlen: torch.Tensor  # [B] int32, on the cache's device for graph capture

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_padding: int, kv_seqlen) -> BlockDiagonalCausalWithOffsetPaddedKeysMask:
        return cls(_query_length(q_seqlen), kv_padding, _lengths(kv_seqlen))


@dataclass
class PagedBlockDiagonalCausalWithOffsetPaddedKeysMask(AttentionBias):
    """As above, with the keys in pages of ``page_size``: ``block_tables`` [B, max_pages] int32."""
    q_len: int
    kv_seqlen: torch.Tensor
    block_tables: torch.Tensor
    page_size: int

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_seqlen, block_tables: torch.Tensor,
                     page_size: int) -> PagedBlockDiagonalCausalWithOffsetPaddedKeysMask:
        if page_size <= 0 or page_size % 16:
            raise InputError(f"page_size must be a positive multiple of 16, got {page_size}")
        return cls(_query_length(q_seqlen), _lengths(kv_seqlen, block_tables.device), block_tables, page_size)

    @property
    def kv_padding(self) -> int:
        return self.block_tables.shape[1] * self.page_size
