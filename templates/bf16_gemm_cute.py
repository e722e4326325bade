"""bf16_gemm on Hopper: out[M, N] = x[M, K] @ w[N, K]^T, bf16 or fp16 in and out, fp32 accumulation.

Runtime args: kernel(x, w, out), all row-major and 16-byte aligned; M, N and K are dynamic, with
K and N multiples of 8 (16-byte rows for TMA; the op layer rejects other sizes). Split-K configs
(config["split_k"] > 1) take an fp32 partials buffer of gemm_configs.partials_elements(config,
M, N) (< 2**31) elements, kernel(x, w, out, partials), and with 128-row tiles (fixed up in
place) int32 tile counters too, kernel(x, w, out, partials, counters), one per output tile
(gemm_configs.counters_needed), zero at the launch (the kernel leaves them zero). Stream-K
configs (config["stream_k"]) take kernel(x, w, out, partials), with
gemm_configs.stream_k_partials(config) elements. The kernel is the
persistent warp-specialized TMA + wgmma GEMM of ``_cute_gemm_sm90`` with no epilogue hook.
Config space, heuristic and validity are shared with the FP8 GEMM (``_cute_gemm_configs``).
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _cute_gemm_configs as gemm_configs

DTYPES = ("bfloat16", "float16")


def _heuristic(target, sig, problem):
    return gemm_configs.heuristic(problem, fp8=False)


def build(config, target, sig):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from mslk_dsl.templates import _cute_gemm_sm90 as sm90

    dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[sig["dtype"]]
    gemm = sm90.HopperGemm(**gemm_configs.kernel_args(config), template="bf16_gemm_cute")

    m, n, k = cute.sym_int(), cute.sym_int(divisibility=8), cute.sym_int(divisibility=8)
    args = [make_fake_compact_tensor(dtype, shape, stride_order=(1, 0), assumed_align=16)
            for shape in ((m, k), (n, k), (m, n))]
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    partials = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(divisibility=4),), assumed_align=16)
    if gemm_configs.fixes_up_in_place(config):  # split-K fixed up in place: tile counters
        @cute.jit
        def bf16_gemm_split_k(x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, partials: cute.Tensor,
                              counters: cute.Tensor, stream):
            gemm(x, w, out, (), stream, partials, counters)
        counters = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
        return bf16_gemm_split_k, [*args, partials, counters, stream]
    if config.get("stream_k") or config.get("split_k", 1) > 1:
        @cute.jit
        def bf16_gemm_partials(x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, partials: cute.Tensor, stream):
            gemm(x, w, out, (), stream, partials)
        return bf16_gemm_partials, [*args, partials, stream]

    @cute.jit
    def bf16_gemm(x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, stream):
        gemm(x, w, out, (), stream)
    return bf16_gemm, [*args, stream]


TEMPLATE = Template(op="bf16_gemm", backend="cute", targets=("sm90a",),
                    signatures={"dtype": DTYPES}, configs=gemm_configs.BF16_CONFIGS,
                    heuristic=_heuristic, serves=gemm_configs.serves, build=build,
                    occupancy_floor=limits.GEMM_OCCUPANCY_FLOOR,
                    instructions={"ptx": [r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(bf16\.bf16|f16\.f16)",
                                         r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global|cp\.async\.bulk\.tensor\.2d\.shared::cta\.global",
                                         r"setmaxnreg"],
                                  "sass": [r"HGMMA\.64x\d+x16\.F32",
                                          r"UTMALDG\.2D"]})
