"""f8f8bf16_rowwise_grouped_stacked on ROCm (FlyDSL): per group, FP8 GEMM with rowwise scales, fused.

Calling convention: kernel(xq, wq, x_scale, w_scale, out, M_sizes); xq [total_M, K] and wq (the
[G, N, K] weights viewed as [G * N, K]) in the target's FP8 flavour (float8_e4m3fnuz on gfx942,
float8_e4m3fn on gfx950), x_scale [total_M] and w_scale [G * N] fp32, out [total_M, N] bf16,
M_sizes [G] int32 or int64 (sig["index_dtype"]):
    out[rows of g] = bf16((xq[rows].float() @ wq[g].float().T) * x_scale[rows, None] * w_scale[g][None, :])
with fp32 accumulation; the scales apply to the fp32 accumulators. Sizes are dynamic; K % 16 == 0,
N % 8 == 0. Kernel: templates/_flydsl_grouped_gemm.py over templates/_flydsl_gemm.py.

``fast_accum`` (the op's use_fast_accum) is a signature part because the CuTe template's
accumulation depends on it; CDNA's FP8 MFMAs accumulate in full fp32 either way, so both values
build the same kernel (as f8f8bf16_rowwise_flydsl's).
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits

from mslk_dsl.templates import _flydsl_gemm as gemm
from mslk_dsl.templates import _flydsl_grouped_gemm as grouped

INDEX_DTYPES = limits.GROUPED_INDEX_DTYPES
CONFIGS, _valid, _heuristic = grouped.template_rules(tile_k_scale=2, elem_bytes=1)


def build(config, target, sig):
    import torch
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    kernel, tile_m, tile_n, threads = grouped.kernel_for(config, target=target, ab_dtype=gemm.FP8[target], scaled=True)

    @flyc.jit
    def f8f8bf16_rowwise_grouped_stacked(xq: fx.Tensor, wq: fx.Tensor, x_scale: fx.Tensor, w_scale: fx.Tensor,
                                         out: fx.Tensor, m_sizes: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        grouped.launch(kernel, xq, wq, out, (x_scale, w_scale, m_sizes), tile_m, tile_n, threads, stream)

    f8, index = getattr(torch, gemm.FP8[target]), getattr(torch, sig["index_dtype"])
    return f8f8bf16_rowwise_grouped_stacked, (
        torch.empty(40, 128, dtype=f8), torch.empty(3 * 48, 128, dtype=f8),
        torch.empty(40, dtype=torch.float32), torch.empty(3 * 48, dtype=torch.float32),
        torch.empty(40, 48, dtype=torch.bfloat16), torch.empty(3, dtype=index))


TEMPLATE = Template(op="f8f8bf16_rowwise_grouped_stacked", backend="flydsl", targets=("gfx942", "gfx950"),
                    signatures={"index_dtype": INDEX_DTYPES, "fast_accum": (True, False)}, configs=CONFIGS,
                    valid=_valid,
                    heuristic=_heuristic, build=build, spills_allowed=gemm.spills_sgprs,
                    occupancy_floor=limits.GEMM_OCCUPANCY_FLOOR,
                    instructions={"isa": [r"v_mfma_f32_\w+fp8"]})
