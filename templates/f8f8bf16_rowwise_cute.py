"""f8f8bf16_rowwise on Hopper: out = (xq @ wq^T) * x_scale[:, None] * w_scale[None, :] (+ bias).

Runtime args: kernel(xq, wq, x_scale, w_scale, bias, out): xq [M, K] and wq [N, K] float8_e4m3fn,
x_scale [M] and w_scale [N] fp32, bias [N] of dtype sig["bias"] ("bfloat16" or "float32", as
MSLK accepts; "none": a 1-element bf16 placeholder, never read), out [M, N] bf16. M, N, K dynamic; K a multiple of 16 and N of 8
(16-byte rows for TMA; the op layer rejects other sizes). Split-K configs (config["split_k"] > 1)
take kernel(xq, wq, x_scale, w_scale, bias, out, partials, counters), as bf16_gemm's do.

The GEMM is ``_cute_gemm_sm90`` with FP8 wgmma (128-deep k-tiles) and the epilogue hook of
``_cute_rowwise_scale``, which scales the fp32 accumulators in registers before the single
rounding to bf16: acc * x_scale[m] * w_scale[n] + bias[n], all in fp32 (MSLK's CUTLASS epilogue
rounds to bf16 before adding a bf16 bias).

Accumulation. Hopper's FP8 wgmma adds into its fp32 accumulator with a ~13-bit mantissa
(truncating), so an accumulator carried over all of K drifts by up to ~1e-2 relative at
K = 8192 and more beyond. The signature part ``fast_accum`` (MSLK's use_fast_accum, default
True) picks the kind: its valid configs are those with promote 0, the others those with
promote > 0. Config key ``promote``:
  0  fast accumulation across all of K (MSLK's default, use_fast_accum=True): fastest, any tile;
  4  the default: each chunk of 4 k-tiles (512 products deep) starts from zero in a second set
     of accumulators (scale-d = 0 on its first wgmma) and is added into fp32 registers once
     it retires; error stays below bf16 rounding; needs tiles of <= 128 columns (two sets
     of accumulators) and costs one wgmma drain and one FADD per accumulator per chunk
     (the two warpgroups of a 128-row tile drain at different k-tiles, so the other one's
     wgmma keep the tensor cores busy: 2-5% faster than draining together on the H200);
  1  CUTLASS's 2x accumulation (mma_promotion_interval = 4 wgmma k-blocks), for comparison.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _cute_gemm_configs as gemm_configs

BIAS = ("none", "bfloat16", "float32")  # the bias argument's dtype, or no bias


def _heuristic(target, sig, problem):
    return gemm_configs.heuristic(problem, fp8=True, fast_accum=sig["fast_accum"])


def _valid(config, target, sig):
    return gemm_configs.fp8_valid(config, sig["fast_accum"])


def build(config, target, sig):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from mslk_dsl.templates import _cute_gemm_sm90 as sm90
    from mslk_dsl.templates._cute_rowwise_scale import RowwiseScale

    has_bias = sig["bias"] != "none"
    epilogue = RowwiseScale(config["tile_m"], config["tile_n"], has_bias, swapped=bool(config.get("swap")),
                            threads=gemm_configs.epilogue_threads(config))
    gemm = sm90.HopperGemm(**gemm_configs.kernel_args(config), epilogue=epilogue, template="f8f8bf16_rowwise_cute")


    m, n, k = cute.sym_int(), cute.sym_int(divisibility=8), cute.sym_int(divisibility=16)
    fp8, bf16 = cutlass.Float8E4M3FN, cutlass.BFloat16
    args = [
        make_fake_compact_tensor(fp8, (m, k), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(fp8, (n, k), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(Float32, (m,), assumed_align=4),
        make_fake_compact_tensor(Float32, (n,), assumed_align=4),
        make_fake_compact_tensor(Float32 if sig["bias"] == "float32" else bf16,
                                 (n if has_bias else cute.sym_int(),), assumed_align=2),
        make_fake_compact_tensor(bf16, (m, n), stride_order=(1, 0), assumed_align=16),
    ]
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    if config.get("split_k", 1) > 1:
        @cute.jit
        def f8f8bf16_rowwise_split_k(xq: cute.Tensor, wq: cute.Tensor, x_scale: cute.Tensor, w_scale: cute.Tensor,
                                     bias: cute.Tensor, out: cute.Tensor, partials: cute.Tensor,
                                     counters: cute.Tensor, stream):
            gemm(xq, wq, out, (x_scale, w_scale, bias), stream, partials, counters)
        return f8f8bf16_rowwise_split_k, [
            *args, make_fake_compact_tensor(Float32, (cute.sym_int(divisibility=4),), assumed_align=16),
            make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4), stream]

    @cute.jit
    def f8f8bf16_rowwise(xq: cute.Tensor, wq: cute.Tensor, x_scale: cute.Tensor, w_scale: cute.Tensor,
                         bias: cute.Tensor, out: cute.Tensor, stream):
        gemm(xq, wq, out, (x_scale, w_scale, bias), stream)
    return f8f8bf16_rowwise, [*args, stream]


TEMPLATE = Template(op="f8f8bf16_rowwise", backend="cute", targets=("sm90a",),
                    signatures={"bias": BIAS, "fast_accum": (True, False)}, configs=gemm_configs.FP8_CONFIGS,
                    valid=_valid, heuristic=_heuristic, serves=gemm_configs.serves, build=build,
                    occupancy_floor=limits.GEMM_OCCUPANCY_FLOOR,
                    instructions={"ptx": [r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3",
                                         r"cp\.async\.bulk\.tensor\.2d",
                                         r"setmaxnreg"],
                                  "sass": [r"QGMMA\.64x\d+x32\.F32\.E4M3\.E4M3",
                                          r"UTMALDG\.2D"]})
