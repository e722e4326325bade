"""gather_scale_quant_dense_tokens, CuTe DSL: the MoE gather scaled by the router score, quantized
row-wise to FP8 in the same pass (MSLK's ``_fbgemm_gather_scale_fp8_rowwise_quant_dense_tokens``).

kernel(x, token_indices, expert_indices, scores, valid_count, scale_ub, xq, scale):
    x [T, D] bf16/fp16 (fp32 activations: gather_scale_dense_tokens, then quantize_fp8_row);
    token_indices, expert_indices [A] int32; scores [T, E] bf16/fp32, any strides; valid_count [1]
    int32 and scale_ub [1] fp32, both always read (the op passes INT32_MAX / +inf when the caller
    gives none); xq [A, D] FP8 (e4m3fn); scale [A] fp32.
    For every row i < n = min(valid_count[0], A), with t, e = token_indices[i], expert_indices[i]:
        v        = (x[t].float() * scores[t, e].float()).to(x.dtype)   (gather_scale_dense_tokens)
        xq[i], scale[i] = quantize_fp8_row(v, scale_ub)                  (its arithmetic, bit for bit)
    Rows at and past n are not written. Token indices of rows below n must lie in [0, T) (not
    checked on the device, as MSLK and the gather).
Difference from MSLK: the scaled row is rounded to x's dtype before it is quantized (MSLK
quantizes the fp32 product), so the result is bit-identical to gather_scale_dense_tokens followed
by quantize_fp8_row, as silu_mul_quant is to its two ops; the two differ by at most one FP8 step
where the rounding moves a value across a rounding boundary. Any D (MSLK needs D % 256 == 0).

Row-wise machinery of quantize_fp8_row (``_cute_rowwise.quantize_row``): one group of threads per
output row, several rows per CTA for short rows; the first ``tile_k`` elements of the gathered row
stay in registers between the absmax and the quantize pass, so rows up to that length read x once.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _rowwise_plan as plan

DTYPES = ("bfloat16", "float16")  # the activations of an FP8 MoE (fp32 x: gather, then quantize_fp8_row)
REGS = 64  # registers per thread: 4 CTAs of 256 threads per SM, as quantize_fp8_row

# quantize_fp8_row's tile shapes (threads, rows_per_block, chunks); see its template. 160 x 4
# chunks of 8 (one row per CTA) holds a row of 5120. Both L1 policies of the single-use loads
# (``l1``).
CONFIGS = plan.with_l1(plan.expand(
    vector_shapes=[(160, 1, 4), (128, 4, 4), (256, 2, 4), (256, 1, 4), (512, 1, 4), (1024, 1, 2)],
    scalar_shapes=[(128, 4, 8), (256, 1, 16)],
))
# The heuristic: the default L1 policy, the tile that reads the row in the fewest, most evenly
# filled passes (plan.pick_fitted; 160 x 4 first, so it wins ties). H200, bf16, top-2 at D 5120
# (T 34944, 1 GiB moved): 160 x 4 302 us, 256 x 2 rows x 4 chunks 414 us, 256 x 1 x 4 (the
# earlier choice) 423 us; no_allocate loads 304 us.
HEURISTIC_L1 = "keep"
HEURISTIC_CONFIGS = [c for c in CONFIGS if c["l1"] == HEURISTIC_L1]


def _valid(config, target, sig) -> bool:
    return plan.valid(config, sig, arrays=1)


def _heuristic(target, sig, problem):
    return plan.pick_fitted(HEURISTIC_CONFIGS, sig, int(problem.get("D", 4096)), arrays=1)


def _spills_at_64_registers(config, target, sig) -> bool:
    """As quantize_fp8_row: a thread keeping 32 values of its row resident (vec 8 x 4 chunks)
    spills a few words to local memory (L1) at 64 registers; kept for the occupancy."""
    return config["vec"] * config["chunks"] >= 32 or plan.cut_into_words(config, sig)


def build(config, target, sig):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    from mslk_dsl.templates import _cute_rowwise as rw

    tile, fp8, dtype, fp8_dtype = rw.quantize_setup("gather_scale_quant_cute", config, target, sig, arrays=1)
    score_t = cutlass.BFloat16 if sig["score_dtype"] == "bfloat16" else cutlass.Float32
    vec = tile.vec

    @cute.kernel
    def kernel(mX: cute.Tensor, mTok: cute.Tensor, mExp: cute.Tensor, mScore: cute.Tensor, mN: cute.Tensor,
               mUB: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
        a = mQ.shape[0]
        row_in_cta, lane = rw.thread_row(tile)
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * tile.rows_per_block + row_in_cta
        live = row < cutlass.min(mN[0], a)
        # Rows past n keep every address in bounds (row a - 1, token 0) and move no data (nvec 0);
        # they still run the row reduction, whose barrier the whole CTA takes.
        i = cutlass.min(row, a - 1)
        t = Int32(cutlass.select_(live, mTok[i], Int32(0)))
        e = Int32(cutlass.select_(live, mExp[i], Int32(0)))
        s = mScore[t, e].to(Float32)
        nvec = Int32(cutlass.select_(live, mQ.shape[1] // vec, Int32(0)))

        def scaled(xs):
            return (xs.load().to(Float32) * s).to(dtype)

        buf = rw.reduction_buffer(cutlass.utils.SmemAllocator(), tile)
        scale = rw.quantize_row((rw.row_vectors(mX, t, vec),), scaled, rw.row_vectors(mQ, i, vec), tile, lane,
                                nvec, row_in_cta, buf, mUB[0], plan.FP8_ROW_EPS, fp8.fp8_max)
        if lane == 0 and nvec > 0:
            mS[i] = scale

    @cute.jit
    def gather_scale_quant(mX: cute.Tensor, mTok: cute.Tensor, mExp: cute.Tensor, mScore: cute.Tensor,
                           mN: cute.Tensor, mUB: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, stream):
        grid = (cute.ceil_div(mQ.shape[0], tile.rows_per_block), 1, 1)
        kernel(mX, mTok, mExp, mScore, mN, mUB, mQ, mS).launch(grid=grid, block=(tile.threads, 1, 1),
                                                               stream=stream, **rw.launch_hints(tile, REGS))

    v, align = rw.row_alignment(sig)
    t_rows, a_rows = cute.sym_int(), cute.sym_int()
    d = cute.sym_int(divisibility=v)
    index = make_fake_compact_tensor(Int32, (a_rows,))
    scores = make_fake_tensor(score_t, (t_rows, cute.sym_int()), stride=(cute.sym_int(), cute.sym_int()))
    args = [rw.fake_rows(dtype, t_rows, d, align), index,
            make_fake_compact_tensor(Int32, (a_rows,)), scores, rw.fake_vector(Int32, 1),
            rw.fake_vector(Float32, 1), rw.fake_rows(fp8_dtype, a_rows, d, v),
            rw.fake_vector(Float32, a_rows), rw.env_stream()]
    return gather_scale_quant, args


TEMPLATE = Template(op="gather_scale_quant_dense_tokens", backend="cute", targets=("sm90a",),
                    signatures={"dtype": DTYPES, "vec_bytes": limits.VECTOR_WIDTHS, "score_dtype": limits.SCORE_DTYPES},
                    signature_valid=limits.vector_signature,
                    configs=CONFIGS, valid=_valid, heuristic=_heuristic, build=build,
                    spills_allowed=_spills_at_64_registers, occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR)
