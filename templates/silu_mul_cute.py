"""silu_mul, CuTe DSL: out = silu(x0) * x1 (SwiGLU gate), fp32 math rounded to the dtype.

kernel(x0, x1, out, count): x0, x1, out [M, K] bf16/fp16/fp32, compact row-major; count [1]
int32: rows from count[0] on are neither read nor written (MSLK's valid_token_count; the op
passes 2^31 - 1 without one).

A CTA owns ``rows_per_block`` rows x one tile of ``tile_k`` columns; grid = (row groups, column
tiles), the column tiles looping when a row has more than 65535 of them. Each thread issues all
its 2 * ``chunks`` vector loads (as wide as the rows admit: 16, 8 or 4 bytes, else one element) before computing, then stores.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _rowwise_plan as plan

DTYPES = ("bfloat16", "float16", "float32")
MAX_GRID_Y = 65535
# Registers per thread: 64 (4 CTAs of 256 threads per SM) up to 4 chunks per input; a thread
# holding more (two inputs of 7 chunks: 56 registers of data) gets REGS_LONG instead of spilling.
REGS, REGS_LONG = 64, 80

# (threads, rows_per_block, chunks): tile_k = 512, 4096, 8192, 7168, 14336 bf16 elements for the
# vector shapes; the first suits rows of a few hundred elements (4 rows per CTA), the 7-chunk
# tiles rows of 7168 and 14336: no idle lanes in the row's last tile (H200, bf16: 250 against
# 252 us at 24966 x 7168 and 252 against 258 us at 12483 x 14336 for 8192-element tiles).
# Rows fitted with whole warps (one row per CTA, 4 chunks, 64 registers): 96-224 threads hold
# 3072-7168 elements, so a row of 2880-6144 is one tile whose threads all have data (the
# heuristic's smallest covering tile). H200, bf16, CUDA-graph replays at 64 / 256 MiB: 4608
# 22.9 / 69.5 us in 160 x 4 against 24.4 / 72.0 in 128 x 7; 5120 23.1 / 69.8 against 23.9 /
# 71.2; 6144 23.1 / 69.7 (192 x 4) against 23.8 / 69.9 (docs/benchmarks.md).
# Short rows (MoE expert widths such as 768 and 1408, head-sized rows): 2, 4, 8 or 16 rows per CTA
# of 128 threads, tiles of 128-2048 elements (one element per access: 256-1024; longer rows: see
# SCALAR_LONG_ROWS), so a row of a few hundred elements does not leave most lanes of a 3072-element
# tile idle. H200, bf16 (docs/benchmarks.md, "Short rows"): 65536 x 768 76 against 113 us, 183700 x
# 722 192 against 322, 82344 x 379 (one element per access) 61 against 154.
SHORT_ROWS = [(128, 16, 2), (128, 8, 2), (128, 4, 3), (128, 4, 4), (128, 2, 3), (128, 2, 4)]
SHORT_SCALAR_ROWS = [(128, 4, 8), (128, 4, 16), (128, 2, 16)]
# Phased rows (one element per access, every tensor at one offset from a 16-byte boundary;
# rw.PhasedRow) take 128-bit vectors only in tiles of at least this many vectors per thread. In
# one-vector tiles they lost to one element per access (H200, bf16, same run, % of copy:
# 33600 x 1389 75.7 against 84.9, 33132 x 1309 73.1 / 83.4, 109392 x 129 55.8 / 81.1; a thread's
# single vector is fewer loads in flight than its 8 elements were), and won in two-vector tiles
# (52376 x 771 93.2 / 86.7, 7680 x 887 95.5 / 91.6; docs/benchmarks.md, "Phased rows"). Those
# timings are from kernels that held both paths; the one-vector phased path in a kernel of its
# own has not been timed.
PHASED_MIN_VECTORS = 2
# One-element rows fitted with whole warps, as the vector rows above: one row per CTA of 96-256
# threads x 32 elements (3072-8192 elements; phased, four vectors per thread), so a 16-bit row of
# 2049-8192 is one tile whose threads all have data, with twice the loads in flight of the
# two-vector tiles. The heuristic takes the one that reads the row in one pass with the fewest
# idle lanes (plan.pick_fitted) for 16-bit rows of FITTED_ROWS (fp32 rows were not timed). Timed
# on an H100 (bf16, CUDA-graph replays; docs/benchmarks.md "silu_mul: one-element rows fitted
# with whole warps"): the fitted tile ran within 0.7% of the fastest config at 7 rows of
# 2501-7929 and 1.00-1.12x the two-vector tiles it replaces (8192 x 4279 78.2 against 85.0 us).
FITTED_SCALAR_ROWS = [(96, 1, 32), (128, 1, 32), (160, 1, 32), (192, 1, 32), (224, 1, 32), (256, 1, 32)]
FITTED_ROWS = (2049, 8192)
CONFIGS = plan.expand(
    vector_shapes=[(128, 4, 2), (128, 1, 4), (256, 1, 4), (128, 1, 7), (256, 1, 7),
                   (96, 1, 4), (160, 1, 4), (192, 1, 4), (224, 1, 4), *SHORT_ROWS],
    scalar_shapes=[(128, 4, 4), (128, 1, 16), (256, 1, 8), (256, 1, 16), *SHORT_SCALAR_ROWS, *FITTED_SCALAR_ROWS],
)
# Flat tiles (plan's ``layout`` "flat"; _cute_flat_rows.map_flat): compact tensors mapped as one
# flat array of 16-byte vectors, whatever the row length (odd included), 2K-8K elements a CTA.
FLAT = plan.flat(plan.expand(vector_shapes=[(256, 1, 4), (256, 1, 2), (128, 1, 4), (512, 1, 2)], scalar_shapes=[]))
CONFIGS = CONFIGS + FLAT
_valid, _ = plan.rules(CONFIGS, arrays=2)
_, _pick = plan.rules([c for c in CONFIGS if "layout" not in c], arrays=2)   # the row tiles' smallest cover

# Rows of one element per access: the tiles of one row per CTA holding two vectors per thread
# (phased), 2048 elements in 128 threads or 4096 in 256. Rows up to 2048 take the smallest
# covering tile (the 2048 one of 128 threads first: 151.0 against 170.8 us at 79096 x 1085 in
# the one-vector 2048 tile of 256 threads); longer rows (fp32 rows past 2048, 16-bit ones past
# FITTED_ROWS) the one that leaves the fewest lanes idle
# in the row's last column tile, ties to the 4096 one. H200, bf16, CUDA-graph replays
# (docs/benchmarks.md, "One-element rows: the phased path in a kernel of its own"): 28384 x 4279
# 205.5 against 232.6 us in the 2048 tile (3 column tiles, 1865 idle lanes, against 2 and 3913),
# 9984 x 8625 138.5 / 146.7; 11092 x 15885 263.4 against 270.2 in the 4096 tile (a tie: 499
# idle lanes in both).
SCALAR_LONG_ROWS = [plan.config(256, 1, 1, 16), plan.config(128, 1, 1, 16)]
FITTED_PICKS = [plan.config(threads, rows, 1, chunks) for threads, rows, chunks in FITTED_SCALAR_ROWS]


# Rows of at most 2 KiB (FLAT_ROW_BYTES) take the flat tile of 256 threads x 4 vectors (FLAT_SHAPE): a
# compact call is mapped as one flat array of 16-byte vectors, every lane busy, odd rows
# included (a call that is not compact runs the tile's fallback rows, plan.flat_fallback). H100,
# bf16, CUDA-graph replays, every config near the row in one run (docs/benchmarks.md "Flat
# tiles"): this tile against the fastest row tile 25.1 against 28.7 us at 131072 x 70, 24.9 /
# 30.7 at 131072 x 69, 24.5 / 26.8 at 14603 x 597, 17.8 / 20.0 at 9654 x 575, level or 1-3%
# faster at the other rows of 76-1000 elements, 5% slower at 4000 x 300 (7 MiB); level at
# 20000 x 2000, 3000 x 14336 and 8192 x 4095, so rows past 2 KiB keep their row tiles.
FLAT_ROW_BYTES = (2, 2048)
FLAT_SHAPE = (256, 1, 4)


def _heuristic(target, sig, problem):
    k = problem["K"]
    flat = plan.flat_pick(CONFIGS, sig, k, 2, FLAT_SHAPE, FLAT_ROW_BYTES)
    if flat is not None:
        return flat
    if (limits.one_element(sig) and limits.ELEM_BYTES[sig["dtype"]] == 2
            and FITTED_ROWS[0] <= k <= FITTED_ROWS[1]):
        return plan.pick_fitted(FITTED_PICKS, sig, k, arrays=2)
    if limits.one_element(sig) and k > plan.RowTile.of(SCALAR_LONG_ROWS[1]).row_k:
        return plan.fewest_idle_lanes(SCALAR_LONG_ROWS, k)
    return _pick(target, sig, problem)


def build(config, target, sig):
    import cutlass
    import cutlass.cute as cute

    from mslk_dsl.templates import _cute_flat_rows as flat
    from mslk_dsl.templates import _cute_rowwise as rw

    tile = plan.check("silu_mul_cute", config, sig, arrays=2)
    # A flat config's row kernels (calls the flat kernel does not serve) run its fallback config.
    rows_config = plan.flat_fallback(sig) if tile.flat else config
    rows_tile = plan.access_tile(rows_config, sig) if tile.flat else tile
    dtype = rw.dsl_dtype(sig["dtype"])

    def values(a, b):
        return rw.silu_mul_tile(a, b, dtype)

    # Rows of one element per access run their aligned middle in vectors where the three
    # tensors are congruent (rw.PhasedRow), in this tile, if it holds PHASED_MIN_VECTORS per
    # thread; in a kernel of its own (rw.launch_rows).
    phased = plan.phased_tile(rows_tile, limits.ELEM_BYTES[sig["dtype"]]) if rows_tile.vec == 1 else None
    take_phased = phased is not None and phased.chunks >= PHASED_MIN_VECTORS

    @cute.kernel
    def kernel(mX0: cute.Tensor, mX1: cute.Tensor, mO: cute.Tensor, mCount: cute.Tensor):
        row, _, lane, nvec = rw.cta_row(rows_tile, rw.rows_to_write(mO, mCount), mO.shape[1])
        _, bidy, _ = cute.arch.block_idx()
        _, gdimy, _ = cute.arch.grid_dim()
        rw.map_row((rw.row_vectors(mX0, row, rows_tile.vec), rw.row_vectors(mX1, row, rows_tile.vec)), values,
                   rw.row_vectors(mO, row, rows_tile.vec), rows_tile, lane, nvec, bidy, gdimy)

    @cute.kernel
    def phased_kernel(mX0: cute.Tensor, mX1: cute.Tensor, mO: cute.Tensor, mCount: cute.Tensor):
        row, _, lane, nvec = rw.cta_row(rows_tile, rw.rows_to_write(mO, mCount), mO.shape[1])
        _, bidy, _ = cute.arch.block_idx()
        _, gdimy, _ = cute.arch.grid_dim()
        pr = rw.phased_row(mX0, row, mO.shape[1], phased.vec, nvec > 0)
        rw.map_row_phased((mX0, mX1), values, mO, phased, pr, lane, bidy, gdimy)

    @cute.kernel
    def flat_kernel(mX0: cute.Tensor, mX1: cute.Tensor, mO: cute.Tensor, mCount: cute.Tensor):
        flat.map_flat((mX0, mX1), values, mO, tile, rw.rows_to_write(mO, mCount))

    @cute.jit
    def launch_row_kernels(mX0: cute.Tensor, mX1: cute.Tensor, mO: cute.Tensor, mCount: cute.Tensor, stream):
        col_tiles = cute.ceil_div(mX0.shape[1], rows_tile.tile_k)
        grid = (cute.ceil_div(mX0.shape[0], rows_tile.rows_per_block), min(col_tiles, MAX_GRID_Y), 1)
        rw.launch_rows((mX0, mX1, mO), phased.vec if take_phased else None, kernel, phased_kernel,
                       (mX0, mX1, mO, mCount),
                       {"grid": grid, "block": (rows_tile.threads, 1, 1), "stream": stream,
                        **rw.launch_hints(rows_tile, REGS if rows_config["chunks"] <= 4 else REGS_LONG)})

    @cute.jit
    def silu_mul(mX0: cute.Tensor, mX1: cute.Tensor, mO: cute.Tensor, mCount: cute.Tensor, stream):
        if cutlass.const_expr(tile.flat):
            if flat.flat_serves((mX0, mX1, mO)):
                flat_kernel(mX0, mX1, mO, mCount).launch(**flat.flat_launch(tile, mX0.shape[0], mX0.shape[1]),
                                                         stream=stream, **rw.launch_hints(tile, REGS))
            else:
                launch_row_kernels(mX0, mX1, mO, mCount, stream)
        else:
            launch_row_kernels(mX0, mX1, mO, mCount, stream)

    v, align = rw.row_alignment(sig)
    m, k = rw.dynamic_rows_cols(v)
    args = [rw.fake_rows(dtype, m, k, align) for _ in range(3)] + [rw.fake_count(), rw.env_stream()]
    return silu_mul, args


def _spills_at_7_chunks(config, target, sig) -> bool:
    """Two inputs of 7 chunks spill 16 bytes per thread at 80 registers on sm100a, and for fp16
    on sm90a (resource reports; bf16 on sm90a, the one timed, does not). Kept: a few stores per
    thread that stay in L1, against a CTA per SM fewer at the next register step (96)."""
    return config["chunks"] > 4 or plan.cut_into_words(config, sig)


TEMPLATE = Template(op="silu_mul", backend="cute", targets=("sm90a", "sm100a"),
                    signatures={"dtype": DTYPES, "vec_bytes": limits.VECTOR_WIDTHS},
                    signature_valid=limits.vector_signature,
                    configs=CONFIGS, valid=_valid, heuristic=_heuristic, build=build,
                    spills_allowed=_spills_at_7_chunks, occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR)
