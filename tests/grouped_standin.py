"""Torch stand-ins for the grouped expert GEMMs (torch._grouped_mm / torch._scaled_grouped_mm), for
tests of the MoE layer's routing and composition where mslk_dsl's own grouped ops are not
registered. ``grouped_ops(allow_standin)`` says which implementation a test runs, or why it
cannot run: the stand-ins are registered only when asked for (MSLK_DSL_TEST_GROUPED_STANDIN=1,
or a CPU test tracing on meta tensors), never silently in place of a missing op.

Same schemas as the real ops: bf16bf16bf16_grouped_stacked(x [M, K], w [G, N, K], M_sizes [G])
and f8f8bf16_rowwise_grouped_stacked(xq, wq [G, N, K], x_scale [M], w_scale [G, N], M_sizes)."""
from __future__ import annotations

import os

import torch

import mslk_dsl  # noqa: F401  (registers torch.ops.mslk_dsl)

NAMES = ("bf16bf16bf16_grouped_stacked", "f8f8bf16_rowwise_grouped_stacked")
_lib = None


def _registered() -> bool:
    return all(hasattr(torch.ops.mslk_dsl, name) for name in NAMES)


def _offsets(m_sizes: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(m_sizes, 0, dtype=torch.int32)


def _bf16(x, w, m_sizes):
    return torch._grouped_mm(x, w.transpose(1, 2), offs=_offsets(m_sizes))


def _fp8(xq, wq, x_scale, w_scale, m_sizes):
    return torch._scaled_grouped_mm(xq, wq.transpose(1, 2), x_scale, w_scale, offs=_offsets(m_sizes),
                                    out_dtype=torch.bfloat16)


def _register() -> None:
    global _lib
    _lib = torch.library.Library("mslk_dsl", "FRAGMENT")
    _lib.define("bf16bf16bf16_grouped_stacked(Tensor x, Tensor w, Tensor M_sizes) -> Tensor")
    _lib.define("f8f8bf16_rowwise_grouped_stacked(Tensor xq, Tensor wq, Tensor x_scale, Tensor w_scale, "
                "Tensor M_sizes) -> Tensor")
    _lib.impl("bf16bf16bf16_grouped_stacked", _bf16, "CUDA")
    _lib.impl("f8f8bf16_rowwise_grouped_stacked", _fp8, "CUDA")
    torch.library.register_fake("mslk_dsl::bf16bf16bf16_grouped_stacked", lib=_lib)(
        lambda x, w, m: x.new_empty(x.shape[0], w.shape[1]))
    torch.library.register_fake("mslk_dsl::f8f8bf16_rowwise_grouped_stacked", lib=_lib)(
        lambda xq, wq, xs, ws, m: xq.new_empty(xq.shape[0], wq.shape[1], dtype=torch.bfloat16))


def grouped_ops(allow_standin: bool | None = None) -> str | None:
    """"mslk_dsl" when the real grouped ops are registered; "standin" when they are not and the
    stand-ins are allowed (then registered); None otherwise (the caller skips)."""
    if _lib is not None:
        return "standin"
    if _registered():
        return "mslk_dsl"
    if allow_standin is None:
        allow_standin = os.environ.get("MSLK_DSL_TEST_GROUPED_STANDIN") == "1"
    if not allow_standin:
        return None
    _register()
    return "standin"


SKIP_REASON = ("torch.ops.mslk_dsl.bf16bf16bf16_grouped_stacked / f8f8bf16_rowwise_grouped_stacked are not "
               "registered (set MSLK_DSL_TEST_GROUPED_STANDIN=1 to test the layer over torch._grouped_mm "
               "stand-ins)")
