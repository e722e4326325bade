"""Registers every op as ``torch.ops.mslk_dsl.<name>``: schema, GPU implementation (the eager
Python function of the same name), a fake for tracing, and a CPU implementation that says why
there is none.

``torch.library.Library`` + ``impl`` costs about a microsecond over a direct call (custom_op
costs ~10 us), so torch.ops is nearly as cheap as the eager functions in ``mslk_dsl.ops``.
"""
from __future__ import annotations

import torch

from mslk_dsl.errors import UnsupportedDeviceError
from mslk_dsl.ops import elementwise, gemm, moe, norm
from mslk_dsl.ops.validate import supported_targets

NAMESPACE = "mslk_dsl"
_LIB = torch.library.Library(NAMESPACE, "DEF")


def _cpu_impl(name: str):
    def refuse(*args, **kwargs):
        raise UnsupportedDeviceError(f"mslk_dsl.{name}: got CPU tensors; mslk-dsl kernels run on CUDA and "
                                     f"ROCm GPUs (targets with a template: {supported_targets(name)})")
    return refuse


def register(fn, schema: str, fake, composite: bool = False) -> None:
    """Define ``torch.ops.mslk_dsl.<fn name>`` with ``schema`` (arguments after the name).
    ``composite`` ops are plain torch code and run on every device."""
    name = fn.__name__
    _LIB.define(f"{name}{schema}")
    if composite:
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
    else:
        _LIB.impl(name, fn, "CUDA")
        _LIB.impl(name, _cpu_impl(name), "CPU")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    getattr(torch.ops.mslk_dsl, name).__doc__ = fn.__doc__


# -- fakes: output shapes and dtypes only -----------------------------------------------------------
def _quant_outputs(x: torch.Tensor):
    fp8 = elementwise.fp8_dtype_for(x.device)
    return (torch.empty(x.shape, dtype=fp8, device=x.device),
            torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device))


register(elementwise.silu_mul, "(Tensor x0, Tensor x1) -> Tensor",
         lambda x0, x1: torch.empty_like(x0))
register(elementwise.quantize_fp8_row, "(Tensor x, Tensor? scale_ub=None) -> (Tensor, Tensor)",
         lambda x, scale_ub=None: _quant_outputs(x))
register(elementwise.silu_mul_quant, "(Tensor x0, Tensor x1, Tensor? scale_ub=None) -> (Tensor, Tensor)",
         lambda x0, x1, scale_ub=None: _quant_outputs(x0))
register(elementwise.dequantize_fp8_row, "(Tensor xq, Tensor scale, ScalarType? out_dtype=None) -> Tensor",
         lambda xq, scale, out_dtype=None: torch.empty(xq.shape, dtype=out_dtype or torch.bfloat16,
                                                       device=xq.device), composite=True)
register(norm.rmsnorm, "(Tensor x, Tensor weight, float eps=1e-06) -> Tensor",
         lambda x, weight, eps=1e-6: torch.empty_like(x))
register(norm.rmsnorm_add, "(Tensor x, Tensor residual, Tensor weight, float eps=1e-06) -> (Tensor, Tensor)",
         lambda x, residual, weight, eps=1e-6: (torch.empty_like(x), torch.empty_like(x)))
register(gemm.bf16_gemm, "(Tensor x, Tensor w) -> Tensor",
         lambda x, w: x.new_empty((x.shape[0], w.shape[0])))
register(gemm.f8f8bf16_rowwise,
         "(Tensor xq, Tensor wq, Tensor x_scale, Tensor w_scale, Tensor? bias=None) -> Tensor",
         lambda xq, wq, x_scale, w_scale, bias=None: torch.empty((xq.shape[0], wq.shape[0]),
                                                                 dtype=torch.bfloat16, device=xq.device))
register(moe.index_shuffling,
         "(Tensor scores, int? expert_index_start=None, int? expert_index_end=None, "
         "Tensor? valid_token_count=None, int top_k=1) -> (Tensor, Tensor, Tensor)",
         lambda scores, expert_index_start=None, expert_index_end=None, valid_token_count=None, top_k=1: (
             scores.new_empty((scores.shape[1] + 2,), dtype=torch.int32),
             scores.new_empty((scores.shape[0] * top_k,), dtype=torch.int32),
             scores.new_empty((scores.shape[0] * top_k,), dtype=torch.int32)))
register(moe.gather_scale_dense_tokens,
         "(Tensor x, Tensor token_indices, Tensor expert_indices, Tensor scores, "
         "Tensor? valid_token_count=None) -> Tensor",
         lambda x, token_indices, expert_indices, scores, valid_token_count=None:
             x.new_empty((token_indices.shape[0], x.shape[1])))
register(moe.scatter_add_dense_tokens,
         "(Tensor(a!) out_tokens, Tensor in_tokens, Tensor token_indices, Tensor? valid_token_count=None) -> ()",
         lambda out_tokens, in_tokens, token_indices, valid_token_count=None: None)
