"""f8f8bf16_rowwise_grouped_stacked on Hopper:
out[rows of g] = (xq[rows of g] @ wq[g]^T) * x_scale[rows, None] * w_scale[g][None, :], bf16 out.

Runtime args: kernel(xq, wq, x_scale, w_scale, out, M_sizes): xq [total_M, K] float8_e4m3fn, wq
the [G, N, K] FP8 weights viewed as [G * N, K], x_scale [total_M] and w_scale [G * N] (the [G, N]
scales flattened) fp32, out [total_M, N] bf16, M_sizes [G] int32 or int64 (sig["index_dtype"]).
K a multiple of 16 and N of 8 (16-byte rows for TMA; the op layer checks).

The kernel is ``_cute_grouped_gemm_sm90.GroupedHopperGemm`` with FP8 wgmma (128-deep k-tiles)
and the dense FP8 GEMM's scale epilogue (``_cute_rowwise_scale``), fused: each tile's x_scale rows and w_scale columns are
loaded when the tile starts (hidden under the main loop), staged in shared memory, and applied to
the fp32 accumulators before the one rounding to bf16. ``promote`` as in f8f8bf16_rowwise_cute,
and the signature part ``fast_accum`` (the op's use_fast_accum) picks the kind as there: True
(the default, MSLK's grouped kernels are CUTLASS's FP8FastAccum schedules) serves promote 0, the
wgmma accumulating over all of K; False serves promote 4, every 4 k-tiles added into fp32
registers (error below bf16 rounding; tiles of <= 128 columns).
"""
from mslk_dsl import device
from mslk_dsl.template import Template
from mslk_dsl.templates import _cute_gemm_configs as gemm_configs
from mslk_dsl.templates import _grouped_gemm_space as space
from mslk_dsl.templates import _kernel_limits as limits

INDEX_DTYPES = limits.GROUPED_INDEX_DTYPES


def _heuristic(target, sig, problem):
    # the 2x1-cluster choice weighs DRAM traffic at this GPU's bandwidth (an H100's or an H200's)
    return space.heuristic(problem, fp8=True, device_bandwidth=device.memory_bandwidth(),
                           fast_accum=sig["fast_accum"])


def _valid(config, target, sig):
    return gemm_configs.fp8_valid(config, sig["fast_accum"])


def build(config, target, sig):
    import cutlass
    import cutlass.cute as cute

    from mslk_dsl.templates import _cute_grouped_gemm_sm90 as grouped
    from mslk_dsl.templates._cute_rowwise_scale import RowwiseScale

    gemm = grouped.GroupedHopperGemm((config["tile_m"], config["tile_n"]), cluster_m=config.get("cluster_m", 1),
                                     swap_ab=bool(config.get("swap")),
                                     promote_every=config["promote"],
                                     epilogue=RowwiseScale(config["tile_m"], config["tile_n"],
                                                           swapped=bool(config.get("swap"))),
                                     template="f8f8bf16_rowwise_grouped_stacked_cute")

    @cute.jit
    def f8f8bf16_rowwise_grouped_stacked(xq: cute.Tensor, wq: cute.Tensor, x_scale: cute.Tensor,
                                         w_scale: cute.Tensor, out: cute.Tensor, m_sizes: cute.Tensor, stream):
        gemm(xq, wq, out, m_sizes, (x_scale, w_scale), stream)

    args = grouped.fake_args(cutlass.Float8E4M3FN, 16, sig["index_dtype"], scales=True)
    return f8f8bf16_rowwise_grouped_stacked, args


TEMPLATE = Template(op="f8f8bf16_rowwise_grouped_stacked", backend="cute", targets=("sm90a",),
                    signatures={"index_dtype": INDEX_DTYPES, "fast_accum": (True, False)},
                    configs=space.FP8_CONFIGS, valid=_valid, heuristic=_heuristic, build=build, occupancy_floor=limits.GEMM_OCCUPANCY_FLOOR,
                    instructions={"ptx": [r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3",
                                         r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta",
                                         r"vote\.sync\.ballot",
                                         r"setmaxnreg"]})
