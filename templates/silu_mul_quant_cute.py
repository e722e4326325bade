"""silu_mul_quant, CuTe DSL: quantize_fp8_row(silu_mul(x0, x1)) fused, bit-identical to the two
ops in sequence (silu_mul rounded to the input dtype, then the row-wise FP8 quantization).

kernel(x0, x1, scale_ub, xq, scale): x0, x1 [M, K] bf16/fp16/fp32; scale_ub [1] fp32, read only
when sig["has_scale_ub"]; xq [M, K] FP8 of the target's flavour; scale [M] fp32 dequant scales.
The silu_mul values come from the same device code as silu_mul_cute, so they are the same bits.
Same structure as quantize_fp8_row_cute: the first ``tile_k`` silu_mul values of a row stay in
registers (x0 and x1 read once); the rest of a longer row recomputes them from a second read.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _rowwise_plan as plan

DTYPES = ("bfloat16", "float16", "float32")
REGS = 80  # registers per thread: 3 CTAs of 256 threads per SM (64 spills in the silu math)

# (threads, rows_per_block, chunks): resident row length tile_k = 1K, 4K, 8K, 16K, 16K elements
# of a 16-bit dtype for the vector shapes (half for fp32); 1024 threads x 2 chunks before
# 512 x 4 for 16K rows: the two inputs of 4 chunks need 123 registers, one CTA per SM.
CONFIGS = plan.expand(
    vector_shapes=[(128, 4, 4), (256, 2, 4), (256, 1, 4), (1024, 1, 2), (512, 1, 4)],
    scalar_shapes=[(128, 4, 8), (256, 1, 16)],
)


def _valid(config, target, sig):
    return plan.valid(config, sig, arrays=2)


def _heuristic(target, sig, problem):
    return plan.pick(CONFIGS, sig, problem["K"], arrays=2)


def build(config, target, sig):
    import cutlass
    import cutlass.cute as cute

    from mslk_dsl.targets import get_target
    from mslk_dsl.templates import _cute_rowwise as rw

    tile = plan.RowTile.of(config)
    fp8 = get_target(target)
    dtype, fp8_dtype = rw.dsl_dtype(sig["dtype"]), rw.dsl_dtype(fp8.fp8_dtype_name)
    has_ub = sig["has_scale_ub"]

    def values(a, b):
        return rw.silu_mul_tile(a, b, dtype)

    @cute.kernel
    def kernel(mX0: cute.Tensor, mX1: cute.Tensor, mUB: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
        row_in_cta, lane = rw.thread_row(tile)
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * tile.rows_per_block + row_in_cta
        nvec = mX0.shape[1] // tile.vec
        if row >= mX0.shape[0]:
            nvec = 0
        ub = mUB[0] if cutlass.const_expr(has_ub) else None
        buf = rw.reduction_buffer(cutlass.utils.SmemAllocator(), tile)
        srcs = (rw.row_vectors(mX0, row, tile.vec), rw.row_vectors(mX1, row, tile.vec))
        scale = rw.quantize_row(srcs, values, rw.row_vectors(mQ, row, tile.vec), tile, lane, nvec,
                                row_in_cta, buf, ub, plan.FP8_ROW_EPS, fp8.fp8_max)
        if lane == 0 and nvec > 0:
            mS[row] = scale

    @cute.jit
    def silu_mul_quant(mX0: cute.Tensor, mX1: cute.Tensor, mUB: cute.Tensor, mQ: cute.Tensor,
                       mS: cute.Tensor, stream):
        grid = (cute.ceil_div(mX0.shape[0], tile.rows_per_block), 1, 1)
        kernel(mX0, mX1, mUB, mQ, mS).launch(grid=grid, block=(tile.threads, 1, 1), stream=stream,
                  **rw.launch_hints(tile, REGS))

    # Aligned: rows of x0, x1 and xq are multiples of 16 bytes (K % 16 == 0) and start aligned.
    align = 16 if sig["aligned"] else plan.ELEM_BYTES[sig["dtype"]]
    m, k = rw.dynamic_rows_cols(16 if sig["aligned"] else 1)
    args = [rw.fake_rows(dtype, m, k, align), rw.fake_rows(dtype, m, k, align),
            rw.fake_vector(cutlass.Float32, 1), rw.fake_rows(fp8_dtype, m, k, 16 if sig["aligned"] else 1),
            rw.fake_vector(cutlass.Float32, m), rw.env_stream()]
    return silu_mul_quant, args


TEMPLATE = Template(op="silu_mul_quant", backend="cute", targets=("sm90a",),
                    signatures={"dtype": DTYPES, "aligned": (True, False), "has_scale_ub": (True, False)},
                    configs=CONFIGS, valid=_valid, heuristic=_heuristic, build=build)
