"""silu_mul_quant, CuTe DSL: quantize_fp8_row(silu_mul(x0, x1)) fused, bit-identical to the two
ops in sequence (silu_mul rounded to the input dtype, then the row-wise FP8 quantization).

kernel(x0, x1, scale_ub, xq, scale, count): x0, x1 [M, K] bf16/fp16/fp32; scale_ub [1] fp32, read
only when sig["has_scale_ub"]; xq [M, K] FP8 of the target's flavour; scale [M] fp32 dequant
scales; count [1] int32: rows from count[0] on are neither read nor written, their xq and scale
left untouched (MSLK's valid_token_count; the op passes 2^31 - 1 without one).
The silu_mul values come from the same device code as silu_mul_cute, so they are the same bits.
Same structure as quantize_fp8_row_cute: the first ``tile_k`` silu_mul values of a row stay on
chip (x0 and x1 read once), in registers or, for a staged tile, in shared memory; the rest of a
longer row recomputes them from a second read.
"""
from mslk_dsl.targets import get_target
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _rowwise_plan as plan

DTYPES = ("bfloat16", "float16", "float32")
# Registers per thread: 80 (3 CTAs of 256 threads per SM; 64 spills in the silu math) up to 4
# chunks; 5 chunks get 128 (REGS_LONG gives 2 CTAs of 256 per SM: no spill).
REGS, REGS_LONG = 80, 104

# (threads, rows_per_block, chunks): resident row length tile_k = 1K, 4K, 8K, 8K, 16K, 16K, 5K
# elements of a 16-bit dtype for the vector shapes (half for fp32). The 5K tile fits rows of 5120
# (all lanes with data, against 62% in an 8K tile: 41936 x 5120 took 292 us in 5K tiles, 302 us
# in 8K; H200, bf16). A 3K tile for 2880 did not help here (289 against 285 us in 4K tiles).
# Rows fitted with whole warps (one row per CTA): 96 x 4 chunks of 8 holds 3072 elements (2880
# fills 94%: 250 against 285 us for 256 x 2 rows x 4 chunks at 74545 x 2880, 70.9 against 78.0 us
# at 18636 x 2880; H200, bf16), 160 x 4 5120, 224 x 4 7168; split over a cluster of 2 CTAs,
# 224 x 4 holds 14336 and 256 x 4 16384, 160 x 2 5120 (the row resident in registers with no CTA
# above 256 threads; the absmax meets over DSMEM).
# The scalar shapes (unaligned rows) hold 256, 4096 and 8192 elements (see SCALAR_TILES).
# Every shape comes with both L1 policies of its single-use loads (``l1``).
SHAPES = plan.expand(
    vector_shapes=[(96, 1, 4), (160, 1, 4), (224, 1, 4), (128, 4, 4), (256, 2, 4), (256, 1, 4), (512, 1, 2), (1024, 1, 2),
                   (512, 1, 4), (256, 2, 5)],
    scalar_shapes=[(128, 4, 8), (256, 1, 16), (256, 1, 32)],
) + plan.clustered(plan.expand(vector_shapes=[(224, 1, 4), (256, 1, 4), (160, 1, 2)], scalar_shapes=[]), 2)
# 224-thread CTAs with a lower register cap (``regs``): 72 registers instead of 80, 4 CTAs per SM
# (28 warps, quantize_fp8_row's occupancy with the same tile at 64 registers) instead of 3; ptxas
# then keeps 8 bytes per thread in local memory (L1). Not the heuristic's (see below). (96
# threads at 72 registers, 9 CTAs instead of 8, ran slower at every size timed, and 160 threads
# at 64 registers spills 176 bytes: neither is a config.)
TRIMMED_REGS = 72
TRIMMED = [{**c, "regs": TRIMMED_REGS} for c in SHAPES if c["threads"] == 224 and c["vec"] == 8 and c["chunks"] == 4]
# Short rows (MoE expert widths of 700-2000, head-sized rows): the tiles of
# plan.QUANT_SHORT_VECTOR_ROWS / QUANT_SHORT_SCALAR_ROWS, with the default L1 policy only (the one
# the heuristic takes). H200, bf16 (docs/benchmarks.md, "Short rows"): 701538 x 250 246 against 614 us,
# 65536 x 96 17.1 against 58.1, 7680 x 887 (one element per access) 25.6 against 58.6.
SHORT_ROWS = plan.expand(vector_shapes=plan.QUANT_SHORT_VECTOR_ROWS, scalar_shapes=plan.QUANT_SHORT_SCALAR_ROWS)
# Staged tiles (plan's ``stage`` key): the first tile of a row in shared memory, loaded by
# cp.async, one row per CTA: 7168-16384 elements of a 16-bit dtype in CTAs of 160-256 threads
# (half for fp32; 64 KiB of shared memory at most), one-element rows 4096-16384.
STAGED = plan.staged(plan.expand(vector_shapes=[(224, 1, 4), (256, 1, 4), (160, 1, 8), (256, 1, 6), (224, 1, 8),
                                                (256, 1, 8)],
                                 scalar_shapes=[(256, 1, 16), (256, 1, 32), (256, 1, 48), (256, 1, 64)]))
CONFIGS = plan.with_l1(TRIMMED + SHAPES + STAGED) + plan.with_l1(SHORT_ROWS + plan.expand([], plan.SHORT_SCALAR_GROUP_ROWS), ("keep",))
_valid, _ = plan.rules(CONFIGS, arrays=2)

# Rows of 7168-16384 elements (and one-element rows of 4097-16384) take a staged tile first
# (STAGED_PICKS, below); for the others: the heuristic takes CTAs of at most 256 threads: each row ends in a CTA-wide barrier (its
# absmax), and a CTA of 512 or 1024 threads is one or two per SM at these register counts, so
# each row's barrier leaves the SM with no loads in flight (14979 x 14336, H200, bf16: 256 x 4
# 306 us, 512 x 4 361 us, 1024 x 2 with the row resident 373 us). Among those it takes the tile
# that reads the row in the fewest, most evenly filled passes (plan.pick_fitted; the one-CTA
# fitted shapes first, so they win ties with the clusters), with the default L1 policy. Measured
# (H200, bf16, docs/benchmarks.md): 41936 x 5120 160 x 4 258 us (256 x 2 rows x 5 chunks: 292;
# no_allocate loads: 271); 14979 x 14336 the 2-CTA cluster of 224 x 4 298 us, 3745 x 14336 82.0
# us (256 x 4, the rest of the row read again from L2: 313 and 86.9 us; 224 x 4 in two passes:
# 299 and 84.1 us). No 72-register cap: one CTA holding the row was slower with it (224 x 4 at
# 7168 255 against 251 us at 1 GiB, 74.0 against 71.0 us at 256 MiB; 96 x 4 at 2880 256 against
# 250 us at 1 GiB, 74.5 against 70.9 us at 256 MiB), and so is the cluster since its CTAs meet
# by pushing their absmax to each other (no cluster barrier before exit): at 14336 271.1 against
# 273.2 us at 1 GiB, 76.4 against 82.0 us at 256 MiB, 26.3 against 28.5 us at 64 MiB (H200,
# bf16, CUDA-graph replays, one run; with the old cluster barrier the cap had been faster).
# No row takes a tile shorter than itself and reads the rest twice (plan.streamed_rest, which
# rmsnorm keeps): a quantizer reads that rest in both of its passes (absmax, then quantize), for
# two inputs here. H100 (no H200 was lent for it; bf16, CUDA-graph replays of every config near
# the row, one run; docs/benchmarks.md "The quantizers' rows past a tile"): 50018 x 4496 471 us
# in the 4096 tile of 2 rows with its rest against 376 in the fitted 5120 one, 2411 x 7248 51 us
# in the 7168 tile against 39 in the 8192 one, 2460 x 8152 55 against 44; on the H200 3745 x
# 14336 86.9 us in 256 x 4 with the rest against 84.1 in 224 x 4 in two passes (above). Where it
# was measured winning on the H200 (28700 x 1056 71.7 us in the 1024 tile against 77.9 in the
# 3072 one, 98950 x 1084 225.7 against 253.9), the 2-row 2048 tile in one pass, which
# pick_fitted takes, beat both. Nor a cluster's tile: its CTAs stream the rest slowly (35055 x
# 15340, 8-byte rows: the 14336 cluster with the rest 1375 us, the 16384 cluster holding the row
# 704 us). H200, bf16, CUDA-graph replays, docs/benchmarks.md "Rows of 8-byte accesses".
HEURISTIC_L1 = "keep"
HEURISTIC_CONFIGS = [c for c in CONFIGS if c["threads"] <= 256 and c["l1"] == HEURISTIC_L1 and "regs" not in c
                     and "stage" not in c and not plan.short_scalar_groups(c)]


# Rows of one element per access past 1024 elements: the 512 tile of 4 rows reading the rest
# again up to 1280 elements (164.4 against 199.7 us in the covering 2-row 2048 tile at 79096 x
# 1085, 358.4 / 430.1 at 178728 x 1129), the one-warp 1024 tile up to 2048 (226.3 / 242.8 at
# 82721 x 1633, 150.0 / 152.4 at 47953 x 2043), the covering 4096 tile, then that tile reading the rest
# again rather than the 8192 one (120 registers per thread in its phased kernel against 74: two
# CTAs per SM instead of three): 356.4 against 366.6 us at 32045 x 5911, 128.3 / 139.9 at 10615 x
# 6783, 194.6 / 211.9 at 15788 x 8113, 183.8 / 215.0 at 9984 x 8625 (within 2% the other way at
# 14333 and 14461, so the 8192 tile stays a config the tuner may take). H200, bf16, CUDA-graph
# replays (docs/benchmarks.md, "One-element rows: the phased path in a kernel of its own").
SCALAR_TILES = ((plan.config(128, 4, 1, 16) | {"l1": HEURISTIC_L1}, 1280),
                (plan.config(128, 4, 1, 32) | {"l1": HEURISTIC_L1}, 2048),
                (plan.config(256, 1, 1, 16) | {"l1": HEURISTIC_L1}, 1 << 31))


# Rows of 8193-16384 16-bit elements in 16-byte accesses (16-32 KiB per input row; fp32 half as
# many), of 7168-16384 in 8- or 4-byte accesses, and of 2049-16384 elements of one element per
# access take the staged tile (the first tile of the row in shared memory: no register holds it)
# that covers the row with the fewest idle lanes (plan.staged_pick), 16-byte accesses with
# cp.async.cg ("stream"; 3-15% faster than .ca at 6-8 chunks, level at 4), others with .ca (cg
# moves only 16 bytes); CTAs of 224 or 256 threads (160 x 8 was slower at every row timed).
# H200, bf16, CUDA-graph replays (docs/benchmarks.md, "Staged tiles"): 3745 x 14336 86.2 -> 76.1
# us (224 x 8), 14979 x 14336 293.4 -> 265.7, 4876 x 11008 97.6 -> 72.9 (256 x 6), 3883 x 13824
# 86.9 -> 75.8, 3276 x 16384 82.7 -> 75.6 (256 x 8); rows of 8-byte accesses 9123 x 7628 166.1 ->
# 94.0 (256 x 4); one element per access 10246 x 8467 213.8 -> 128.2 (256 x 48 stream), 11566 x
# 6421 169.5 -> 98.8, 9885 x 5711 143.6 -> 81.0 (256 x 32). At 7168 and 8192 in 16-byte accesses
# the register tiles were as fast (71.9 against 72.0 us, 71.2 against 71.8). One-element rows of
# 2049-4096 take the staged 4096 tile (four CTAs per SM against the register tile's three) since
# an H100 run (bf16, CUDA-graph replays of every config near the row, 13 rows, 9 of them drawn
# with seed 20261212; docs/benchmarks.md "silu_mul_quant: one-element rows of 2049-4096 staged"):
# 1.01-1.14x the register 4096 tile at every row (40000 x 2051 181.5 against 206.7 us, 25164 x
# 2167 122.5 / 134.7, 17036 x 3525 109.1 / 114.8, 9000 x 4095 71.0 / 71.8).
STAGED_FROM = {16: 8193, 8: 7168, 4: 7168}   # by the rows' access width; plan.staged_from
STAGED_SCALAR_FROM = 2049
STAGED_PICKS = ([{**c, "l1": l1} for l1 in ("stream", "keep") for c in STAGED if c["vec"] > 1 and c["threads"] >= 224]
                + [plan.config(256, 1, 1, 16) | {"stage": "smem", "l1": "keep"},
                   plan.config(256, 1, 1, 32) | {"stage": "smem", "l1": "keep"},
                   plan.config(256, 1, 1, 48) | {"stage": "smem", "l1": "stream"},
                   plan.config(256, 1, 1, 64) | {"stage": "smem", "l1": "stream"}])


# 16-bit rows of 4097-5119 elements in 16-byte accesses (the fitted register tile: 160 x 4, 5120
# elements, lanes idle) take the staged 224 x 4 tile (7168 elements, the default L1 policy). Every
# config near the row in CUDA-graph replays, bf16 (docs/benchmarks.md "silu_mul_quant: 16-byte
# rows of 4097-5119 staged"): H200 16061 x 4200 99.8 against 106.5 us, 50018 x 4496 296.0 /
# 304.3; H100 16061 x 4200 119.6 / 123.6, 9079 x 4512 77.9 / 79.1, 50018 x 4496 370.9 / 374.7,
# and on rows drawn afterwards 9986 x 4408 82.4 / 84.8, 13216 x 4344 104.0 / 106.1. Longer rows
# keep the register tiles: on the H100 the staged tile ran 0.965-1.00x them at 5336-7072 (7 rows),
# though 1.12x at 23184 x 5336 on the H200 (one row: not enough to set a rule by); at 5120 (160 x 4,
# no lane idle) the two were level (H100, 175.3 against 175.6 us). The "stream" policy ran 1-3% slower
# at these rows (4 chunks). quantize_fp8_row's staged tile was slower at 4200 and 4496 on both
# GPUs, so it keeps its rule.
STAGED_MIDDLE_ROWS = (4097, 5119)
STAGED_MIDDLE_PICK = plan.config(224, 1, limits.VECTOR_BYTES // 2, 4) | {"stage": "smem", "l1": "keep"}


# One-element rows of at most 256 elements: the group tiles of _rowwise_plan.short_group_pick
# (measured there), 8 lanes a row to 128 elements, 16 lanes for 256 (two inputs a row: the
# 8-lane 256 tile lost at 163 and 251); rows of 257-512 keep the one-warp 512 tile.
SHORT_GROUP_PICKS = [(128, 16, 8), (128, 16, 16), (128, 8, 16)]
# 16-bit one-element rows of 513-1024 elements: 16 lanes a row, 8 rows a CTA (the 256 tile, the rest of
# the row streamed: up to three passes) to 768 elements, 4 (the 512 tile) past it, rather than
# the one-warp 1024 tile with a quarter or more of its lanes idle. H100, bf16, every config near
# the row, CUDA-graph replays, us, one-warp tile -> this pick (docs/benchmarks.md "silu_mul_quant
# on one-element rows of 513-1024"): 14603 x 597 30.8 -> 29.1, 50000 x 613 79.5 -> 70.3, 131072 x
# 757 197.7 -> 178.2 (the 512 tile 30.5, 76.8, 193.3), 80000 x 883 136.2 -> 133.1, 30000 x 1019
# 64.0 -> 62.1 (the 256 tile 141.4, 67.4).
MIDDLE_ONE_ELEMENT_PICKS = ((768, (128, 8, 16)), (1024, (128, 4, 16)))


def _heuristic(target, sig, problem):
    k = problem["K"]
    short = plan.short_group_pick(CONFIGS, sig, k, 2, SHORT_GROUP_PICKS, rest_past_64=True)
    if short is not None:
        return short
    if limits.one_element(sig) and limits.ELEM_BYTES[sig["dtype"]] == 2 and 512 < k <= MIDDLE_ONE_ELEMENT_PICKS[-1][0]:
        shape = next(shape for top, shape in MIDDLE_ONE_ELEMENT_PICKS if k <= top)
        return plan.pick([c for c in CONFIGS if plan.has_shape(c, [], [shape])], sig, k, 2)
    if (sig["vec_bytes"] == limits.VECTOR_BYTES and limits.ELEM_BYTES[sig["dtype"]] == 2
            and STAGED_MIDDLE_ROWS[0] <= k <= STAGED_MIDDLE_ROWS[1]):
        return STAGED_MIDDLE_PICK
    from_k = plan.staged_from(sig, STAGED_FROM.get(sig["vec_bytes"], 0), STAGED_SCALAR_FROM)
    return (plan.staged_pick(STAGED_PICKS, sig, k, 2, from_k)
            or plan.scalar_tile(SCALAR_TILES, sig, k)
            or plan.pick_fitted(HEURISTIC_CONFIGS, sig, k, arrays=2))


def _registers(config, tile, target, sig) -> int:
    if tile.staged:   # no data held in registers across the row: as many as its CTAs per SM allow
        return plan.staged_registers(tile, 2, limits.ELEM_BYTES[sig["dtype"]], get_target(target).limits)
    return config.get("regs", REGS if config["chunks"] <= 4 else REGS_LONG)


def build(config, target, sig):
    import cutlass.cute as cute

    from mslk_dsl.templates import _cute_rowwise as rw

    tile, fp8, dtype, fp8_dtype = rw.quantize_setup("silu_mul_quant_cute", config, target, sig, arrays=2)

    def values(a, b):
        return rw.silu_mul_tile(a, b, dtype)

    def body(mX0, mX1, mUB, mQ, mS, mCount, phased):
        rw.quantize_rows((mX0, mX1), values, mUB, mQ, mS, tile, sig["has_scale_ub"], plan.FP8_ROW_EPS,
                         fp8.fp8_max, rows=rw.rows_to_write(mQ, mCount), phased=phased)

    # One-element rows: the phased path in a kernel of its own (rw.launch_rows).
    @cute.kernel
    def kernel(mX0: cute.Tensor, mX1: cute.Tensor, mUB: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor,
               mCount: cute.Tensor):
        body(mX0, mX1, mUB, mQ, mS, mCount, False)

    @cute.kernel
    def phased_kernel(mX0: cute.Tensor, mX1: cute.Tensor, mUB: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor,
                      mCount: cute.Tensor):
        body(mX0, mX1, mUB, mQ, mS, mCount, True)

    @cute.jit
    def silu_mul_quant(mX0: cute.Tensor, mX1: cute.Tensor, mUB: cute.Tensor, mQ: cute.Tensor,
                       mS: cute.Tensor, mCount: cute.Tensor, stream):
        launch = {**rw.row_launch(tile, mX0.shape[0]), "stream": stream}
        rw.launch_rows((mX0, mX1, mQ), rw.phased_vec(tile, dtype.width // 8), kernel, phased_kernel,
                       (mX0, mX1, mUB, mQ, mS, mCount), {**launch, **rw.launch_hints(tile, _registers(config, tile, target, sig))},
                       {**launch, **rw.launch_hints(tile, _registers(config, plan.plain_tile(tile), target, sig))})

    args = rw.fake_quantize_args(dtype, fp8_dtype, 2, sig)
    return silu_mul_quant, args[:-1] + [rw.fake_count(), args[-1]]


def _may_spill(config, target, sig) -> bool:
    """sm100a's ptxas spills 8 bytes per thread at 80 registers when a thread keeps 32 values of
    its row resident (vec 8 x 4 chunks; resource reports); sm90a does not, except in CTAs of 160
    threads (5 per SM at 80 registers: 72 and 8 bytes of local memory, which stays in L1), the
    224-thread CTAs capped at 72 registers (8 bytes), the short-row tiles of 32 single
    elements per input (48 bytes at 104 registers) and the short-row tile of 8 rows of 4 16-bit
    vectors per thread in 128 threads (40-48 bytes at 80 registers, 16-bit rows; so since it was
    added, its timings in docs/benchmarks.md "Short rows" included). sm100a's ptxas also spills
    16 bytes in some staged fp32 tiles at their register budget (plan.staged_registers); sm90a's
    does not."""
    resident = config["vec"] * config["chunks"] >= 32
    staged_sm100 = target == "sm100a" and config.get("stage") == "smem" and sig["dtype"] == "float32"
    short_8_rows = config["threads"] == 128 and config["rows_per_block"] == 8
    return (resident and (target == "sm100a" or config["threads"] == 160 or "regs" in config
                          or config["vec"] == 1 or short_8_rows)) or plan.cut_into_words(config, sig) \
        or staged_sm100


TEMPLATE = Template(op="silu_mul_quant", backend="cute", targets=("sm90a", "sm100a"),
                    signatures={"dtype": DTYPES, "vec_bytes": limits.VECTOR_WIDTHS, "has_scale_ub": (True, False)},
                    signature_valid=limits.vector_signature,
                    configs=CONFIGS, valid=_valid, heuristic=_heuristic, build=build,
                    spills_allowed=_may_spill, occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR)
