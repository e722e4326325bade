"""bf16bf16bf16_grouped_stacked on ROCm (FlyDSL): out[rows of g] = x[rows of g] @ w[g].T, fp32 accumulation.

Calling convention: kernel(x, w, out, M_sizes); x [total_M, K] and out [total_M, N] bf16 row-major,
w the [G, N, K] weights viewed as [G * N, K], M_sizes [G] int32 or int64 (sig["index_dtype"]), read
on the device. Sizes are dynamic; K % 8 == 0, N % 8 == 0 and 16-byte aligned data (the op layer
checks). Kernel: templates/_flydsl_grouped_gemm.py over templates/_flydsl_gemm.py.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits

from mslk_dsl.templates import _flydsl_gemm as gemm
from mslk_dsl.templates import _flydsl_grouped_gemm as grouped

INDEX_DTYPES = limits.GROUPED_INDEX_DTYPES
CONFIGS, _valid, _heuristic = grouped.template_rules(tile_k_scale=1, elem_bytes=2)


def build(config, target, sig):
    import torch
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    kernel, tile_m, tile_n, threads = grouped.kernel_for(config, target=target, ab_dtype="bfloat16", scaled=False)

    @flyc.jit
    def bf16bf16bf16_grouped_stacked(x: fx.Tensor, w: fx.Tensor, out: fx.Tensor, m_sizes: fx.Tensor,
                                     stream: fx.Stream = fx.Stream(None)):
        grouped.launch(kernel, x, w, out, (m_sizes,), tile_m, tile_n, threads, stream)

    bf16, index = torch.bfloat16, getattr(torch, sig["index_dtype"])
    return bf16bf16bf16_grouped_stacked, (torch.empty(40, 64, dtype=bf16), torch.empty(3 * 48, 64, dtype=bf16),
                                          torch.empty(40, 48, dtype=bf16), torch.empty(3, dtype=index))


TEMPLATE = Template(op="bf16bf16bf16_grouped_stacked", backend="flydsl", targets=("gfx942", "gfx950"),
                    signatures={"index_dtype": INDEX_DTYPES}, configs=CONFIGS, valid=_valid,
                    heuristic=_heuristic, build=build, spills_allowed=gemm.spills_sgprs,
                    occupancy_floor=limits.GEMM_OCCUPANCY_FLOOR,
                    instructions={"isa": [r"v_mfma_f32_\w+_bf16\b"]})
