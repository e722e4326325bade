"""The op layer: typed Python functions (the fast eager path) and ``torch.ops.mslk_dsl.*``.

Importing this module registers the torch ops. Each function validates its inputs (clear errors,
nothing launched), picks the kernel for the device's target, and launches it on the current
stream. ``config=`` forces a config of the op's template (for kernel authors).
"""
from mslk_dsl.ops.elementwise import dequantize_fp8_row, quantize_fp8_row, silu_mul, silu_mul_quant
from mslk_dsl.ops.gemm import bf16_gemm, f8f8bf16_rowwise
from mslk_dsl.ops.moe import gather_scale_dense_tokens, index_shuffling, scatter_add_dense_tokens
from mslk_dsl.ops.norm import rmsnorm, rmsnorm_add
from mslk_dsl.ops import library  # noqa: F401  (registers torch.ops.mslk_dsl.*)


def _prefetch_kernel_loader() -> None:
    """On a CUDA build of torch, start importing the CuTe kernel loader in the background, so
    the first call does not wait for it (see mslk_dsl.backends.cute.prefetch_runtime), and
    load (or build) the native launch path beside it (see mslk_dsl.native)."""
    import torch

    from mslk_dsl import env, native

    if torch.version.cuda is not None and env.prefetch_enabled():
        from mslk_dsl.backends import cute

        cute.prefetch_runtime()
        native.load_in_background()


_prefetch_kernel_loader()

__all__ = ["bf16_gemm", "dequantize_fp8_row", "f8f8bf16_rowwise", "gather_scale_dense_tokens",
           "index_shuffling", "quantize_fp8_row", "rmsnorm", "rmsnorm_add", "scatter_add_dense_tokens",
           "silu_mul", "silu_mul_quant"]
