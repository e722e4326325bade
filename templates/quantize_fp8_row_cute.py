"""quantize_fp8_row, CuTe DSL: per-row absmax FP8 quantization.

kernel(x, scale_ub, xq, scale): x [M, K] bf16/fp16/fp32; scale_ub [1] fp32, read only when
sig["has_scale_ub"]; xq [M, K] FP8 of the target's flavour (e4m3fn on sm90a/sm100a); scale [M]
fp32, the dequant scale (x ~= xq * scale). The arithmetic of MSLK's Triton ``quantize_fp8_row``,
bit for bit: amax = clamp(max|x|, 1/512, scale_ub), scale = amax / fp8_max (IEEE division),
xq = fp8(clamp(x / scale, -fp8_max, fp8_max)) with a correctly rounded quotient (see
``_cute_rowwise``). Rows of zeros give a finite scale and xq = 0; a NaN makes its row's scale and
xq NaN (as torch's amax; MSLK's Triton max skips NaNs).

One group of threads per row, several rows per CTA for short rows; the first ``tile_k`` elements
of a row stay on chip between the absmax and the quantize pass (one DRAM read): in registers, or
for a staged tile (``stage``: "smem", rows of 7K-16K elements) in shared memory, loaded by
cp.async; the rest of a longer row is read twice (the second read mostly hits L2).
"""
from mslk_dsl.targets import get_target
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _rowwise_plan as plan

DTYPES = ("bfloat16", "float16", "float32")
# Registers per thread: 64 (4 CTAs of 256 threads per SM) up to 4 chunks, 80 (3 CTAs) for 5.
REGS, REGS_LONG = 64, 80


def _spills_at_64_registers(config, target, sig) -> bool:
    """A thread keeping 32 values of its row resident (vec 8 x 4 chunks) spills 40-56 bytes to
    local memory at 64 registers (resource reports). Kept: that local memory stays in L1, and on
    the H200 80 registers (no spill, 3 CTAs per SM) ran as fast or slower at every size timed, 67.6 against
    101% of copy at 3000 x 14336 and 72 against 86% at 65536 x 5120 (docs/benchmarks.md)."""
    return config["vec"] * config["chunks"] >= 32 or plan.cut_into_words(config, sig)


# (threads, rows_per_block, chunks): resident row length tile_k = threads/rows * vec * chunks;
# the power-of-two shapes hold 1K, 4K, 8K, 16K, 16K, 3K, 5K elements of a 16-bit dtype (half for
# fp32). The 3K and 5K tiles fit rows of 2880 and 5120 (94% and 100% of their lanes with data,
# against 70% and 62% in 4K and 8K tiles): on the H200 (bf16, 1 GiB moved) 280 against 299 us at
# 2880 and 272 against 296 us at 5120;
# the scalar shapes (unaligned rows) hold 256, 4096 and 8192 elements (see SCALAR_TILES).
# Rows fitted with whole warps (one row per CTA): 96 x 4 chunks of 8 holds 3072 elements (2880 fills
# 94% of its lanes), 160 x 4 5120, 224 x 4 7168 (14336 in two even tiles); split over a cluster of
# 2 CTAs, 224 x 4 holds 14336 (the absmax meets over DSMEM). Every shape comes with both L1
# policies of its single-use loads (``l1``).
SHAPES = plan.expand(
    vector_shapes=[(96, 1, 4), (160, 1, 4), (224, 1, 4), (128, 4, 4), (256, 2, 4), (256, 1, 4), (512, 1, 4),
                   (1024, 1, 2), (256, 2, 3), (256, 2, 5)],
    scalar_shapes=[(128, 4, 8), (256, 1, 16), (256, 1, 32)],
) + plan.clustered(plan.expand(vector_shapes=[(224, 1, 4), (256, 1, 4)], scalar_shapes=[]), 2)
# Short rows (MoE expert widths of 700-2000, head-sized rows): the tiles of
# plan.QUANT_SHORT_VECTOR_ROWS / QUANT_SHORT_SCALAR_ROWS, with the default L1 policy only (the one
# the heuristic takes). H200, bf16 (docs/benchmarks.md, "Short rows"): 701538 x 250 152 against 371 us,
# 65536 x 96 11.5 against 35.2, 7680 x 887 (one element per access) 16.6 against 29.2.
SHORT_ROWS = plan.expand(vector_shapes=plan.QUANT_SHORT_VECTOR_ROWS, scalar_shapes=plan.QUANT_SHORT_SCALAR_ROWS)
# Staged tiles (plan's ``stage`` key): the first tile of a row in shared memory, loaded by
# cp.async, one row per CTA: 7168-32768 elements of a 16-bit dtype (half for fp32; 64 KiB of
# shared memory at most), one-element rows 8192-32768, and 4096 for the tuner (rows of 2049-4096
# one-element accesses take the register tile, 77-99% of copy; its staged twin is not yet timed).
STAGED = plan.staged(plan.expand(vector_shapes=[(224, 1, 4), (224, 1, 8), (256, 1, 8), (256, 1, 16)],
                                 scalar_shapes=[(256, 1, 16), (256, 1, 32), (256, 1, 64), (256, 1, 128)]))
CONFIGS = plan.with_l1(SHAPES + STAGED) + plan.with_l1(SHORT_ROWS + plan.expand([], plan.SHORT_SCALAR_GROUP_ROWS), ("keep",))

# Rows of 7168-16384 elements (and one-element rows of 4097-16384) take a staged tile first
# (STAGED_PICKS, below). For the others the heuristic (H200, bf16, 1 GiB moved unless noted;
# docs/benchmarks.md): the default L1 policy
# (no_allocate: 266 against 251 us at 124218 x 2880, 265 against 252 us at 69887 x 5120; level at
# 14336), CTAs of at most 256 threads and no cluster, the tile that reads the row in the fewest,
# most evenly filled passes (plan.pick_fitted; the fitted shapes first, so they win ties):
# 124218 x 2880 96 x 4 251 us (256 x 2 rows x 3 chunks: 280), 69887 x 5120 160 x 4 252 us (256 x
# 2 x 5: 265), 24966 x 14336 224 x 4 in two passes 261 us (512 x 4 holding the row: 275; the
# 2-CTA cluster holding it: 333).
# No row takes a tile shorter than itself and reads the rest twice (plan.streamed_rest, which
# rmsnorm keeps): a quantizer reads that rest in both of its passes. H100 (bf16, CUDA-graph
# replays, one run; docs/benchmarks.md "The quantizers' rows past a tile"): 50018 x 4496 252 us
# in the 4096 tile of 2 rows with its rest against 226 in the fitted 5120 one. Where it was
# measured winning on the H200 (28700 x 1056 39.6 us in the 1024 tile against 46.7 in the
# fitted 3072 one, 98950 x 1084 122.3 against 150.3; docs/benchmarks.md "Rows of 8-byte
# accesses"), the 2-row 2048 tile in one pass, which pick_fitted takes, beat both.
HEURISTIC_L1 = "keep"
HEURISTIC_CONFIGS = [c for c in CONFIGS if c["l1"] == HEURISTIC_L1 and "cluster" not in c and c["threads"] <= 256
                     and "stage" not in c and not plan.short_scalar_groups(c)]
_valid, _ = plan.rules(CONFIGS, arrays=1)


# Rows of one element per access past 1024 elements take tiles of 512-2048 elements reading the
# rest again, rather than a covering tile, up to 2.5x the 2048 tile; longer rows the 4096 or 8192
# tile of 256 threads that leaves the fewest lanes idle over its passes, ties to the 8192 one
# (plan.fewest_idle_lanes). H200, bf16, CUDA-graph replays (docs/benchmarks.md, "One-element
# rows: the phased path in a kernel of its own"): the 512 tile of 4 rows at 79096 x 1085 82.0
# against 96.1 us in the covering 2048 one (at 178728 x 1129 175.2 against 206.9); the one-warp
# 1024 tile at 82721 x 1633 107.7 against 113.2; the 2-row 2048 tile at 35044 x 3631 100.1 against
# 128.2 in the covering 4096 one, at 1343 x 4853 12.4 against 13.4 in the 8192 one; at 9984 x 8625
# the 4096 tile 82.6 against 98.3 in the 8192 one, at 32045 x 5911 (a tie in idle lanes) the
# 8192 tile 181.9 against 197.0.
SCALAR_TILES = ((plan.config(128, 4, 1, 16) | {"l1": HEURISTIC_L1}, 1280),
                (plan.config(128, 4, 1, 32) | {"l1": HEURISTIC_L1}, 2048),
                (plan.config(128, 2, 1, 32) | {"l1": HEURISTIC_L1}, 5120))
SCALAR_LONG_ROWS = [plan.config(256, 1, 1, 32) | {"l1": HEURISTIC_L1}, plan.config(256, 1, 1, 16) | {"l1": HEURISTIC_L1}]


# Rows of 7168-16384 16-bit elements (14-32 KiB per row; fp32 half as many) and rows of one element
# per access of 4097-16384 elements (any dtype) take the staged tile (the first tile of the row in shared memory: no
# register holds it) that covers the row with the fewest idle lanes (plan.staged_pick), with
# .ca copies (.cg level or slower); CTAs of 224 or 256 threads (the 32768 tile was slower at 16384
# than the 16384 one and is a config for the tuner only). H200, bf16, CUDA-graph replays
# (docs/benchmarks.md, "Staged tiles"): 3745 x 14336 47.7 -> 44.7 us (224 x 8), 4876 x 11008 52.2
# -> 44.8, 3276 x 16384 55.5 -> 44.7 (256 x 8), 7489 x 7168 45.8 -> 43.9 (224 x 4), 6553 x 8192
# level (45.5 / 45.2); rows of 8-byte accesses 9123 x 7628 82.0 -> 66.2, of 4-byte accesses 3721 x
# 10054 54.7 -> 44.4; one element per access 10246 x 8467 87.0 -> 76.6 (256 x 64), 9885 x 5711
# 61.6 -> 53.6 (256 x 32). At 5120 the register tile stayed ahead (45.7 against 48.0).
STAGED_FROM, STAGED_SCALAR_FROM = 7168, 4097   # plan.staged_from
STAGED_PICKS = ([{**c, "l1": "keep"} for c in STAGED if c["vec"] > 1 and c["chunks"] <= 8]
                + [plan.config(256, 1, 1, 32) | {"stage": "smem", "l1": "keep"},
                   plan.config(256, 1, 1, 64) | {"stage": "smem", "l1": "keep"}])


# One-element rows of at most 512 elements: the group tiles of _rowwise_plan.short_group_pick
# (measured there), 8 lanes a row to 256 elements, 16 lanes for 512.
SHORT_GROUP_PICKS = [(128, 16, 8), (128, 16, 16), (128, 16, 32), (128, 8, 32)]


def _heuristic(target, sig, problem):
    k = problem["K"]
    short = plan.short_group_pick(CONFIGS, sig, k, 1, SHORT_GROUP_PICKS, rest_past_64=True)
    if short is not None:
        return short
    staged = plan.staged_pick(STAGED_PICKS, sig, k, 1, plan.staged_from(sig, STAGED_FROM, STAGED_SCALAR_FROM))
    if staged:
        return staged
    if limits.one_element(sig) and k > SCALAR_TILES[-1][1]:
        return plan.fewest_idle_lanes(SCALAR_LONG_ROWS, k)
    return plan.scalar_tile(SCALAR_TILES, sig, k) or plan.pick_fitted(HEURISTIC_CONFIGS, sig, k, arrays=1)


def _registers(config, tile, target, sig) -> int:
    if tile.staged:   # no data held in registers across the row: as many as its CTAs per SM allow
        return plan.staged_registers(tile, 1, limits.ELEM_BYTES[sig["dtype"]], get_target(target).limits)
    return REGS if config["chunks"] <= 4 else REGS_LONG


def build(config, target, sig):
    import cutlass.cute as cute

    from mslk_dsl.templates import _cute_rowwise as rw

    tile, fp8, dtype, fp8_dtype = rw.quantize_setup("quantize_fp8_row_cute", config, target, sig, arrays=1)

    def values(x):
        return x.load()

    def body(mX, mUB, mQ, mS, phased):
        rw.quantize_rows((mX,), values, mUB, mQ, mS, tile, sig["has_scale_ub"], plan.FP8_ROW_EPS,
                         fp8.fp8_max, phased=phased)

    # One-element rows: the phased path in a kernel of its own (rw.launch_rows).
    @cute.kernel
    def kernel(mX: cute.Tensor, mUB: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
        body(mX, mUB, mQ, mS, False)

    @cute.kernel
    def phased_kernel(mX: cute.Tensor, mUB: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
        body(mX, mUB, mQ, mS, True)

    @cute.jit
    def quantize_fp8_row(mX: cute.Tensor, mUB: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, stream):
        launch = {**rw.row_launch(tile, mX.shape[0]), "stream": stream}
        rw.launch_rows((mX, mQ), rw.phased_vec(tile, dtype.width // 8), kernel, phased_kernel, (mX, mUB, mQ, mS),
                       {**launch, **rw.launch_hints(tile, _registers(config, tile, target, sig))},
                       {**launch, **rw.launch_hints(tile, _registers(config, plan.plain_tile(tile), target, sig))})

    args = rw.fake_quantize_args(dtype, fp8_dtype, 1, sig)
    return quantize_fp8_row, args


TEMPLATE = Template(op="quantize_fp8_row", backend="cute", targets=("sm90a", "sm100a"),
                    signatures={"dtype": DTYPES, "vec_bytes": limits.VECTOR_WIDTHS, "has_scale_ub": (True, False)},
                    signature_valid=limits.vector_signature,
                    configs=CONFIGS, valid=_valid, heuristic=_heuristic, build=build,
                    spills_allowed=_spills_at_64_registers, occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR)
