"""The op layer: typed Python functions (the fast eager path) and ``torch.ops.mslk_dsl.*``.

Each op is one declaration (declaration.py) in the module of its family; declaring it registers
the torch op, and one call path (call.py) serves every op: launch plans for layouts seen before,
else validation (clear errors, nothing launched), the kernel for the device's target, and a launch
on the current stream. ``config=`` forces a config of the op's template (for kernel authors).
Importing ``mslk_dsl`` imports this module: every torch op exists after ``import mslk_dsl``.
"""
from mslk_dsl.ops.attention import attention_fwd
from mslk_dsl.ops.attention_decode import attention_decode, merge_attentions
from mslk_dsl.ops.declaration import declarations
from mslk_dsl.ops.elementwise import dequantize_fp8_row, quantize_fp8_row, silu_mul, silu_mul_quant
from mslk_dsl.ops.gemm import bf16_gemm, f8f8bf16_rowwise
from mslk_dsl.ops.grouped_gemm import bf16bf16bf16_grouped_stacked, f8f8bf16_rowwise_grouped_stacked
from mslk_dsl.ops.moe import gather_scale_dense_tokens, index_shuffling, scatter_add_dense_tokens
from mslk_dsl.ops.moe_quant import gather_scale_quant_dense_tokens
from mslk_dsl.ops.norm import rmsnorm, rmsnorm_add

__all__ = ["attention_decode", "attention_fwd", "bf16_gemm", "bf16bf16bf16_grouped_stacked", "declarations",
           "dequantize_fp8_row", "f8f8bf16_rowwise", "f8f8bf16_rowwise_grouped_stacked", "gather_scale_dense_tokens",
           "gather_scale_quant_dense_tokens", "index_shuffling", "merge_attentions", "prefetch", "quantize_fp8_row",
           "rmsnorm", "rmsnorm_add", "scatter_add_dense_tokens",
           "silu_mul", "silu_mul_quant"]


def prefetch() -> None:
    """Start loading what the first op call would otherwise wait for, in the background: on a
    CUDA build of torch, the CuTe kernel loader (mslk_dsl.backends.cute.prefetch_runtime) and the
    native launch path (mslk_dsl.native; built on first use). Call it at start-up to overlap
    that with loading a model; the first op call starts the native launcher's load anyway."""
    import torch

    from mslk_dsl import env, native

    if torch.version.cuda is not None and env.prefetch_enabled():
        from mslk_dsl.backends import cute

        cute.prefetch_runtime()
        native.load_in_background()
