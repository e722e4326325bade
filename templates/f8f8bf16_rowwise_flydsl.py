"""f8f8bf16_rowwise on ROCm (FlyDSL): FP8 GEMM with per-row scales and optional bias, fused.

Calling convention: kernel(xq, wq, x_scale, w_scale, bias, out); xq [M, K] and wq [N, K] in the
target's FP8 flavour (float8_e4m3fnuz on gfx942, float8_e4m3fn on gfx950), x_scale [M] and
w_scale [N] fp32, bias [N] of dtype sig["bias"] ("bfloat16" or "float32"; "none": any 1-element
bf16 tensor, never read), out [M, N] bf16:
    out = bf16((xq.float() @ wq.float().T) * x_scale[:, None] * w_scale[None, :] (+ bias))
with fp32 accumulation; the scale (and bias) epilogue runs on the fp32 accumulators. M, N, K are
dynamic; needs K % 16 == 0 and 16-byte aligned data pointers. The weight is used as stored
([N, K] row-major, no pre-shuffle). Kernel: templates/_flydsl_gemm.py.

``fast_accum`` (MSLK's use_fast_accum) is a signature part because the CuTe template's
accumulation depends on it; CDNA's FP8 MFMAs accumulate in full fp32 either way (MSLK's ROCm
kernels ignore the flag too), so both values build the same kernel.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits

from mslk_dsl.templates import _flydsl_gemm as gemm

BIAS = ("none", "bfloat16", "float32")  # the bias argument's dtype, or no bias


# As bf16_gemm, with K tiles twice as long (same bytes per row). gfx950's fp8 MFMAs take
# 128 (16x16) or 64 (32x32) K per step, which rules out the shorter tiles there.
CONFIGS, _valid, _heuristic = gemm.template_rules(tile_k_scale=2, elem_bytes=1)


def build(config, target, sig):
    import torch
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    kernel, tile_m, tile_n, threads = gemm.kernel_for(
        config, target=target, ab_dtype=gemm.FP8[target], out_dtype="bfloat16",
        epilogue="rowwise" if sig["bias"] == "none" else "rowwise_bias")

    @flyc.jit
    def f8f8bf16_rowwise(xq: fx.Tensor, wq: fx.Tensor, x_scale: fx.Tensor, w_scale: fx.Tensor,
                         bias: fx.Tensor, out: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        M, _ = xq.shape.unpack()
        N, _ = wq.shape.unpack()
        kernel(xq, wq, out, (x_scale, w_scale, bias)).launch(
            grid=gemm.grid_for(M, N, tile_m, tile_n), block=(threads, 1, 1), stream=stream)

    f8 = getattr(torch, gemm.FP8[target])
    return f8f8bf16_rowwise, (
        torch.empty(32, 128, dtype=f8), torch.empty(48, 128, dtype=f8),
        torch.empty(32, dtype=torch.float32), torch.empty(48, dtype=torch.float32),
        torch.empty(1, dtype=torch.bfloat16) if sig["bias"] == "none" else
        torch.empty(48, dtype=getattr(torch, sig["bias"])),
        torch.empty(32, 48, dtype=torch.bfloat16))


TEMPLATE = Template(op="f8f8bf16_rowwise", backend="flydsl", targets=("gfx942", "gfx950"),
                    signatures={"bias": BIAS, "fast_accum": (True, False)}, configs=CONFIGS, valid=_valid,
                    heuristic=_heuristic, build=build, spills_allowed=gemm.spills_sgprs,
                    occupancy_floor=limits.GEMM_OCCUPANCY_FLOOR,
                    instructions={"isa": [r"v_mfma_f32_\w+fp8"]})
