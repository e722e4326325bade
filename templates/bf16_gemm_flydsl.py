"""bf16_gemm on ROCm (FlyDSL): out = x @ w.T with fp32 accumulation.

Calling convention: kernel(x, w, out); x [M, K], w [N, K], out [M, N], all row-major and of one
dtype (bfloat16 or float16). M, N and K are dynamic (one binary per config and dtype). Needs
K % 8 == 0 and 16-byte aligned data pointers (the op layer rejects other inputs); M, N >= 1 any.
The weight is used as stored ([N, K] row-major, no pre-shuffle). Kernel: templates/_flydsl_gemm.py.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits

from mslk_dsl.templates import _flydsl_gemm as gemm

DTYPES = ("bfloat16", "float16")


# Small-M tiles for decode-like shapes, square tiles, and 256-wide tiles for large GEMMs; both
# MFMA sizes, 4 or 8 waves, one LDS stage (two barriers per K tile) or two (one barrier).
CONFIGS, _valid, _heuristic = gemm.template_rules(tile_k_scale=1, elem_bytes=2)


def build(config, target, sig):
    import torch
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    dtype = sig["dtype"]
    kernel, tile_m, tile_n, threads = gemm.kernel_for(config, target=target, ab_dtype=dtype, out_dtype=dtype,
                                                      epilogue="none")

    @flyc.jit
    def bf16_gemm(x: fx.Tensor, w: fx.Tensor, out: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        M, _ = x.shape.unpack()
        N, _ = w.shape.unpack()
        kernel(x, w, out, ()).launch(grid=gemm.grid_for(M, N, tile_m, tile_n),
                                     block=(threads, 1, 1), stream=stream)

    t = getattr(torch, dtype)
    return bf16_gemm, (torch.empty(32, 64, dtype=t), torch.empty(48, 64, dtype=t),
                       torch.empty(32, 48, dtype=t))


TEMPLATE = Template(op="bf16_gemm", backend="flydsl", targets=("gfx942", "gfx950"),
                    signatures={"dtype": DTYPES}, configs=CONFIGS, valid=_valid, heuristic=_heuristic,
                    build=build, spills_allowed=gemm.spills_sgprs,
                    occupancy_floor=limits.GEMM_OCCUPANCY_FLOOR,
                    instructions={"isa": [r"v_mfma_f32_\w+_(bf16|f16)\b"]})
