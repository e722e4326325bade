"""bf16bf16bf16_grouped_stacked on Hopper: out[rows of g] = x[rows of g] @ w[g]^T, bf16, fp32 accumulation.

Runtime args: kernel(x, w, out, M_sizes): x [total_M, K] and out [total_M, N] row-major bf16,
w the [G, N, K] weights viewed as [G * N, K], M_sizes [G] int32 or int64 (sig["index_dtype"]),
read on the device. total_M, N, K and G are dynamic; K and N multiples of 8 (16-byte rows for
TMA; the op layer checks). The kernel is ``_cute_grouped_gemm_sm90.GroupedHopperGemm``: the dense
GEMM's warp-specialized TMA + wgmma main loop over a device-side list of the groups' tiles.
Config space and heuristic: ``_grouped_gemm_space``.
"""
from mslk_dsl import device
from mslk_dsl.template import Template
from mslk_dsl.templates import _grouped_gemm_space as space
from mslk_dsl.templates import _kernel_limits as limits

INDEX_DTYPES = limits.GROUPED_INDEX_DTYPES


def _heuristic(target, sig, problem):
    # the 2x1-cluster choice weighs DRAM traffic at this GPU's bandwidth (an H100's or an H200's)
    return space.heuristic(problem, fp8=False, device_bandwidth=device.memory_bandwidth())


def build(config, target, sig):
    import cutlass
    import cutlass.cute as cute

    from mslk_dsl.templates import _cute_grouped_gemm_sm90 as grouped

    gemm = grouped.GroupedHopperGemm((config["tile_m"], config["tile_n"]), cluster_m=config.get("cluster_m", 1),
                                     swap_ab=bool(config.get("swap")),
                                     pingpong=config.get("pingpong", False),
                                     template="bf16bf16bf16_grouped_stacked_cute")

    @cute.jit
    def bf16bf16bf16_grouped_stacked(x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, m_sizes: cute.Tensor,
                                     stream):
        gemm(x, w, out, m_sizes, (), stream)

    args = grouped.fake_args(cutlass.BFloat16, 8, sig["index_dtype"], scales=False)
    return bf16bf16bf16_grouped_stacked, args


TEMPLATE = Template(op="bf16bf16bf16_grouped_stacked", backend="cute", targets=("sm90a",),
                    signatures={"index_dtype": INDEX_DTYPES}, configs=space.BF16_CONFIGS,
                    heuristic=_heuristic, build=build, occupancy_floor=limits.GEMM_OCCUPANCY_FLOOR,
                    instructions={"ptx": [r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16",
                                         r"cp\.async\.bulk\.tensor\.2d\.shared::(cluster|cta)\.global",
                                         r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta",
                                         r"vote\.sync\.ballot",
                                         r"shfl\.sync\.up",
                                         r"setmaxnreg"]})
