"""Config space and default choice of the Hopper CuTe GEMM templates (plain Python: no DSL).

A config names one kernel of ``_cute_gemm_sm90.HopperGemm``:
  tile_m, tile_n  CTA tile; tile_m // 64 consumer warpgroups (64 suits decode-sized M); 192-row
                  tiles ("tall", TALL_TILE_M) and 256-row ones ("wide", WIDE_TILE_M: two
                  warpgroups of 128 rows; at most 192 wide) are unsplit and not promoted;
                  192- and 256-row ones are also swapped (at most 192 tokens wide)
  cluster_m       CTAs per cluster along M (2: the weight tile is TMA-multicast to both)
  raster, group   tile order: "m" or "n" moves first, inside bands of ``group`` clusters
                  (0: the whole dimension); only L2 reuse depends on it
  promote         (FP8 only) 0: wgmma accumulates across all of K ("fast accumulation");
                  p > 0: every p k-tiles (128 deep each) the wgmma partial sums are added
                  into separate fp32 registers (CUTLASS's 2x accumulation is p = 1). The
                  FP8 signature part ``fast_accum`` (MSLK's use_fast_accum) picks the kind:
                  a config is valid for it iff promote == 0 (see fp8_valid)
  split_k         (cluster_m 1 only; absent means 1) K is split into this many ranges, each
                  its own unit of work: with few output tiles (small or mid-sized M) it keeps
                  every SM busy. 128-row tiles (both ops): every unit stores its fp32 sums in
                  a partials slot of its tile and counts itself in the tile's counter; the
                  last to arrive adds the tile's slots in split order and runs the epilogue,
                  in the same kernel (CUTLASS's split-K "in-place fix-up"). 64-row decode
                  tiles (16-bit only): the units' sums of rows < M go to [split_k, M, N] and a
                  second kernel adds them (see _cute_gemm_sm90)
  stream_k        (bf16/fp16 128-row tiles only; absent means off) the tiles of the last,
                  partial wave of the persistent grid are not given whole to some CTAs while
                  the others idle: their k-tiles are shared out evenly between all CTAs (each
                  range touches at most two tiles), the pieces go to an fp32 partials buffer
                  and a second kernel adds them in a fixed order (CUTLASS's stream-K
                  "data-parallel + one stream-K wave")
  swap            (64-, 128- and 192-row tiles; absent means 0) 1: the kernel multiplies the weight by
                  the tokens (A = w, B = x, D^T stored transposed), so tile_m runs along N and
                  tile_n along M, in steps of 16 (64-256; 192-row tiles to 192): a mid-sized M is padded to 16 rows
                  instead of 128 (cuBLAS's own orientation: torch's row-major x @ w.T is its
                  column-major w @ x^T). Fast accumulation only for FP8
  pingpong        (128-row tiles up to 192 wide, unsplit, unswapped; 16-bit and fast-accumulation
                  FP8; absent means 0) 1: each of the CTA's two consumer warpgroups computes
                  whole tiles, taking turns, so one's epilogue runs under the other's mainloop
                  (CUTLASS's ping-pong schedule; cuBLAS's FP8 kernels at large M run 128x128
                  tiles so)
  x_rows          (64-row tiles; absent means all 64) rows of x each k-tile's TMA load brings in:
                  a config with x_rows serves M <= x_rows only (the op layer refuses larger M,
                  the tuner offers it only there). A 64-row box of x holding M = 1-16 rows loads
                  slower than the 16-row one, though the rows past M are only zeros
tile_n is any multiple of 32 from 64 to 256 (the epilogue stores 32-column sub-tiles): layers
are rarely powers of two, and a width that splits N into whole tiles and the tiles into whole
waves (2112 = 11 x 192, 5120 = 20 x 256 = 32 x 160) beats the nearest power of two.
Pipeline stages are derived from shared memory (as many A/B stages as fit beside the
epilogue buffers). Every config is correct for every M >= 1 (up to x_rows when it has one); N
and K must keep rows 16-byte aligned (the op layer checks).
"""

from mslk_dsl.templates import _kernel_limits as limits

NUM_SMS = limits.MULTIPROCESSORS["sm90a"]  # the persistent grid size and the heuristic's waves

# Tiles taller than 128 rows ("tall"; unsplit, unswapped, unpromoted: 16-bit and fast-accumulation
# FP8): 192 rows, three consumer warpgroups of 64 rows each (fewer registers per thread: see
# _cute_gemm_sm90).
TALL_TILE_M = 192
# Tiles of 256 rows ("wide"; unsplit, unswapped, unpromoted): two consumer warpgroups of 128 rows
# each (two 64-row wgmma blocks per warpgroup: CUTLASS's cooperative 256-row layout, and the tile
# height cuBLAS runs most at M >= 400 on the H200).
WIDE_TILE_M = 256


def consumer_warpgroups(tile_m):
    """Consumer warpgroups of a CTA whose tiles have ``tile_m`` rows: one per 64 rows, but two of
    128 rows each for 256-row tiles."""
    return 2 if tile_m == WIDE_TILE_M else tile_m // 64


def _config(tile_m, tile_n, cluster_m=1, raster="m", group=8, split_k=1, stream_k=False, x_rows=0, swap=False,
            pingpong=False):
    config = {"tile_m": tile_m, "tile_n": tile_n, "cluster_m": cluster_m, "raster": raster, "group": group}
    if swap:
        config["swap"] = 1
    if pingpong:
        config["pingpong"] = 1
    if split_k > 1:
        config["split_k"] = split_k
    if x_rows:
        config["x_rows"] = x_rows
    if stream_k:
        config["stream_k"] = 1
    return config


CONFIGS = (
    _config(128, 256, 2), _config(128, 256, 2, "m", 0), _config(128, 256, 2, "n"), _config(128, 256, 1),
    _config(128, 128, 2), _config(128, 128, 1),
    _config(128, 64, 2), _config(128, 64, 1),
    _config(64, 256), _config(64, 128), _config(64, 64),
)
# Decode tiles with split-K (16-bit; FP8 decode has its own x_rows tiles).
SPLIT_K = (2, 4, 8)
SPLIT_CONFIGS = tuple(_config(64, tile_n, split_k=s) for tile_n in (128, 256) for s in SPLIT_K)
# 128-row tiles with split-K, for mid-sized M whose output tiles fill less than a wave (both
# ops; promoted FP8 only 128 wide, see _PROMOTED).
MID_SPLIT_K = (2, 3, 4)
MID_SPLIT_WIDTHS = (128, 256)
MID_SPLIT_CONFIGS = tuple(_config(128, tile_n, split_k=s) for tile_n in MID_SPLIT_WIDTHS for s in MID_SPLIT_K)
# Stream-K variants of the 128-row tiles (16-bit only, like split-K).
STREAM_K_CONFIGS = tuple(_config(128, tile_n, cluster_m, stream_k=True)
                         for tile_n, cluster_m in ((256, 2), (256, 1), (128, 2), (128, 1), (64, 1)))
# Decode tiles that load only X_ROWS rows of x per k-tile (for M <= X_ROWS).
X_ROWS = 16
X_ROWS_CONFIGS = tuple(_config(64, 256, split_k=s, x_rows=X_ROWS) for s in (1, *SPLIT_K))
# 16-bit 64-row tiles for 16 < M <= 48: x boxes of M rounded up to 16 (a 64-row box with rows
# past M loads slower, though those rows are only TMA's zeros: 64x64 tiles on the same layer ran
# 10-25% slower at M = 18-37 than at M = 48-64 on the H200; the fitted box took 5120 x 32768 at
# M = 26 from 110.3 to 93.5 us and 5120 x 17920 at M = 27 from 70.4 to 55.6, docs/benchmarks.md).
X_ROWS_MID = (32, 48)
X_ROWS_MID_CONFIGS = tuple(_config(64, n, x_rows=r) for r in X_ROWS_MID for n in (64, 128, 256))
BF16_CONFIGS = CONFIGS + SPLIT_CONFIGS + STREAM_K_CONFIGS + X_ROWS_CONFIGS + X_ROWS_MID_CONFIGS
# Widths between the powers of two, for layers they split into whole tiles and waves (see the
# heuristic): 128-row tiles, both cluster shapes; 16-bit and FP8 fast accumulation.
FITTED_WIDTHS = (160, 192, 224)
FITTED_CONFIGS = tuple(_config(128, n, c) for n in FITTED_WIDTHS for c in (2, 1))
BF16_CONFIGS = BF16_CONFIGS + FITTED_CONFIGS + MID_SPLIT_CONFIGS
# Swapped operands (the weight is the kernel's A, the tokens its B: see kernel_args): tile_m runs
# along N (the weight's rows), tile_n along M in steps of 16, so a mid-sized M is padded to 16
# rows instead of 64 or 128.
# Unsplit ones run in 2x1 clusters (two weight tiles share the tokens' tile through multicast);
# split-K ones (no cluster) in steps of 32.
SWAP_WIDTHS = tuple(range(64, 257, 16))
SWAP_SPLIT_WIDTHS = (64, 96, 128, 160, 192, 256)
SWAP_CONFIGS = (tuple(_config(128, n, 2, swap=True) for n in SWAP_WIDTHS)
                + tuple(_config(128, n, split_k=s, swap=True) for n in SWAP_SPLIT_WIDTHS for s in MID_SPLIT_K))
BF16_CONFIGS = BF16_CONFIGS + SWAP_CONFIGS
# Swapped 64-row tiles, one CTA each (one consumer warpgroup): 64 weight rows per tile, so a
# mid-sized M's weight stream is split over up to one wave of CTAs without split-K (cuBLAS's own
# tiles there: 64 x 80-168 on the H200; see SWAP_64_M_MAX).
SWAP_64_CONFIGS = tuple(_config(64, n, swap=True) for n in SWAP_WIDTHS)
BF16_CONFIGS = BF16_CONFIGS + SWAP_64_CONFIGS
# A swapped 64-row tile 32 tokens wide, for decode-sized M (see DECODE_SWAP_TILES_MIN): a whole
# K per 64 weight rows, no split-K and no reduction kernel (cuBLAS's decode tiles on the H200
# are 64 x 8 and 64 x 16). 16-bit only: FP8 decode runs 1.2-1.5x torch with its x_rows tiles.
DECODE_SWAP_WIDTH = 32
DECODE_SWAP_CONFIG = _config(64, DECODE_SWAP_WIDTH, swap=True)
BF16_CONFIGS = BF16_CONFIGS + (DECODE_SWAP_CONFIG,)
# 192-row tiles: fewer, larger tiles, whose counts fit other layers into whole waves (cuBLAS's
# own picks on the H200 at M >= 400 are mostly 192x192 and 256-row tiles 88-160 wide).
TALL_CONFIGS = tuple(_config(TALL_TILE_M, n, c) for n in (128, 160, 192) for c in (1, 2))
BF16_CONFIGS = BF16_CONFIGS + TALL_CONFIGS
# Swapped 192-row tiles: 192 weight rows by 64-192 tokens in steps of 16, in 2x1 clusters
# (cuBLAS's own 192 x 40-208 tiles: 192 x 96 at M = 1098 on 2112 x 7168, 11 x 12 tiles in one
# wave; 192 x 80 at M = 147 on 10240 x 8192). For the tuner: the heuristic does not take them.
# Timed on the H200 against its picks on 48 fresh shapes (docs/benchmarks.md "Swapped 192-row
# tiles"), they were slower at nearly every M < 1000 and 1-9% faster at a few large ones
# (M = 2446 on 5376 x 21504: 813 -> 745 us), with no rule the model could state.
SWAP_TALL_WIDTHS = tuple(range(64, 193, 16))
SWAP_TALL_CONFIGS = tuple(_config(TALL_TILE_M, n, 2, swap=True) for n in SWAP_TALL_WIDTHS)
BF16_CONFIGS = BF16_CONFIGS + SWAP_TALL_CONFIGS
# 256-row tiles (16-bit and fast-accumulation FP8): two warpgroups of 128 rows, up to 192 wide
# (tile_n fp32 accumulators per thread).
WIDE_CONFIGS = tuple(_config(WIDE_TILE_M, n, c) for n in (128, 160, 192) for c in (1, 2))
BF16_CONFIGS = BF16_CONFIGS + WIDE_CONFIGS
# Swapped 256-row tiles: 256 weight rows (two warpgroups of 128) by 64-192 tokens in steps of 16,
# 1x1 and 2x1 clusters: cuBLAS's most frequent tile at mid-sized M on wide layers on the H200
# (256 x 88-136, e.g. 256 x 136 at M = 389 on 10240 x 8192: 40 x 3 tiles, one wave). For the
# tuner: the heuristic does not take them. Timed against its picks on 19 shapes (M = 189-2845 on
# layers 4096-27648 wide; docs/benchmarks.md "Swapped 256-row tiles"), the best of them was faster
# at 4 bf16 shapes (1-4%) and 5 FP8 ones (1.5-6.4%: 1565 x 10240 x 5120, 136.4 -> 128.2 us), and
# slower, mostly by far, at the rest: with few token tiles the 256-row weight tiles leave SMs idle.
SWAP_WIDE_WIDTHS = tuple(range(64, 193, 16))
SWAP_WIDE_CONFIGS = tuple(_config(WIDE_TILE_M, n, c, swap=True) for n in SWAP_WIDE_WIDTHS for c in (1, 2))
BF16_CONFIGS = BF16_CONFIGS + SWAP_WIDE_CONFIGS
# Ping-pong 128-row tiles (16-bit and fast-accumulation FP8): one consumer warpgroup per tile,
# the two of a CTA taking alternate tiles, so one's epilogue overlaps the other's mainloop.
PINGPONG_CONFIGS = tuple(_config(128, n, c, pingpong=True) for n in (128, 160, 192) for c in (1, 2))
BF16_CONFIGS = BF16_CONFIGS + PINGPONG_CONFIGS
FP8_PROMOTE = 4  # the default: 512-deep partial sums, error below bf16 rounding
# Promotion keeps a second set of accumulators: tiles of <= 64 fp32 registers per thread.
_PROMOTED = [_config(128, 128, 2), _config(128, 128, 1), _config(128, 64, 2), _config(128, 64, 1),
             _config(64, 128), _config(64, 64)]
FP8_CONFIGS = (tuple({**c, "promote": 0} for c in CONFIGS + FITTED_CONFIGS)
               + tuple({**c, "promote": 4} for c in _PROMOTED) + ({**_config(128, 128, 2), "promote": 1},)
               + tuple({**_config(64, n, x_rows=X_ROWS), "promote": 4} for n in (64, 128))
               + tuple({**_config(64, n, x_rows=X_ROWS), "promote": 0} for n in (64, 128, 256))
               + tuple({**c, "promote": 0} for c in MID_SPLIT_CONFIGS)
               + tuple({**_config(128, 128, split_k=s), "promote": FP8_PROMOTE} for s in MID_SPLIT_K)
               + tuple({**c, "promote": 0} for c in SWAP_CONFIGS + SWAP_64_CONFIGS)
               + tuple({**c, "promote": 0} for c in TALL_CONFIGS + SWAP_TALL_CONFIGS)
               + tuple({**c, "promote": 0} for c in WIDE_CONFIGS + SWAP_WIDE_CONFIGS)
               + tuple({**c, "promote": 0} for c in PINGPONG_CONFIGS))

# The cost model of calls with M > 64 (see heuristic): a tile's time per unit of K is its MMA
# work plus LOAD_WEIGHT times the operand rows it loads per k-step. Fit to the relative throughput
# of full 128-row tiles (2x1 cluster) of widths 256 / 128 / 64, 1.0 / 0.9 / 0.75 on the H200:
# per unit of work the cost is a + b (1/tile_n + 1/(2 tile_m)), which those three points fit
# exactly with LOAD_WEIGHT = b / a = 36 (0 or 100 picks up to 2.4x / 1.12x slower tiles on the
# sweep the heuristic's docstring names).
LOAD_WEIGHT = 36
# Modelled costs within this fraction of the best are ties, won by the larger tile (fewer tile
# prologues and epilogues, which the model leaves out).
TIE = 0.01
# ... but at more than this many bytes of K per row a near-tie between a split-K tile and an
# unsplit one goes to split-K: timed on the H200 (docs/benchmarks.md "Near-ties at a long K"),
# swapped 128 x 256 split 3 against the unsplit swapped 96-112-token pick at M = 204-234 on
# 5120-wide layers ran 8-22% faster at K = 13824-17920 (215 x 5120 x 17920: 101.4 -> 78.8 us)
# and level (within 3%) at K = 8192 in bf16.
SPLIT_TIE_K_BYTES = 16384
# A 192-row tile loses near-ties to 128-row ones. Timed on the H200 against the 128-row picks
# (docs/benchmarks.md, "192-row tiles"): bf16 192-row tiles ran 3-11% slower wherever the model
# saw a tie or a loss of up to 2% (M >= 988 on eight layers), and won where it gave them a clear
# lead (one wave instead of two: M = 1522 at 2880 x 4096, 62.6 -> 52.5 us; M = 2272 at
# 2112 x 7168, 100.7 -> 91.3).
# FP8 (fast accumulation) is the other way round: its 192-row tiles ran 0.1-6.4% faster than the
# 128-row pick at 12 of 14 large-M shapes where the model put them up to 8% behind, and slower
# only where it put them 11% or more behind (docs/benchmarks.md). Their modelled time is scaled
# by this factor, so they win wherever the model puts them within 5% of the best (a near-tie
# after the scaling still goes to the 128-row tile).
TALL_FP8_FACTOR = 0.95
# 256-row tiles (two 128-row warpgroups), timed against the picks on 28 H200 shapes (fresh draws,
# M = 150-16384; docs/benchmarks.md "256-row tiles"): slower at most (bf16 geomean 0.868 of the
# pick, FP8 0.885), faster by 2-10% at a few large ones. For bf16 the model could not tell those
# (the picks it would change ran 0.93-1.04x the old ones), so 16-bit never takes them. FP8 fast
# accumulation takes one at M >= WIDE_M_MIN where the model puts it this far ahead of the pick
# and the pick is not a ping-pong tile (the 256-row tiles lost to every ping-pong pick): on 24
# fresh shapes where an earlier form of the rule (any M, over ping-pong too) changed the pick,
# those it still changes ran 0.98-1.11x the old pick (geomean 1.04); the ones it no longer takes
# (M < 1024, ping-pong picks) 0.87-1.02x.
WIDE_FP8_FACTOR = 0.975
WIDE_M_MIN = 1024

# FP8 ping-pong (fast accumulation, M >= PINGPONG_M_MIN). The model above leaves the epilogue out:
# a cooperative tile stores its outputs while the tensor cores idle, a ping-pong one under the
# other warpgroup's mainloop. So the best of the model's picks is charged EPILOGUE_WEIGHT per
# output element of each wave of tiles, and a ping-pong tile (a 128-row tile, one warpgroup,
# whose mainloop runs a little slower: PINGPONG_FACTOR on its modelled time) wins where it then
# costs less (beyond a TIE). Fit on the H200 to 30 FP8 shapes (M = 175-13739 on real layers, each
# against every ping-pong config): ping-pong was up to 1.18x faster at M >= 1024 with K up to
# 8192 and slower at long K and M < 1024; the rule takes it at 9 of the 30, each a win or a tie
# (geomean against torch 1.018 -> 1.030, docs/benchmarks.md "FP8 ping-pong"). 16-bit GEMMs ran
# it slower than their picks nearly everywhere (0.93 geomean), so they never take it.
PINGPONG_M_MIN = 1024
EPILOGUE_WEIGHT = 512
PINGPONG_FACTOR = 1.04
# ... and from PINGPONG_ALWAYS_M rows on, the ping-pong tile of least modelled time, whatever the
# other tiles cost. Timed on the H200 on 24 FP8 shapes drawn fresh (M log-uniform in 1024-16384
# over the random draw's layers; docs/benchmarks.md "FP8 at large M: ping-pong from 4096 rows"):
# the model's ping-pong tile against the pick where they differ: below 4096 rows 0.89-1.06x (the
# pick faster at 5 of 8), from 4096 rows 1.00-1.07x (faster at 5 of 6 by 3-7%, 0.2% slower at the
# sixth); on the 16 worst large-M FP8 shapes of three draws the 128 x 160-192 ping-pong tiles beat
# the 192- and 256-row picks from 4096 rows by 2-9%; on 11 shapes drawn after the rule was fixed,
# 0.98-1.10x (faster at 10). (The same kernel timed twice in one run differed by up to 3.5%.)
PINGPONG_ALWAYS_M = 4096

# Decode (M <= 16, weight streaming) on the H200, from sweeps of every config at M = 1 and 16:
# 256-wide tiles stream best; with fewer than DECODE_TILES_MIN of them (N < 12288) split-K
# brings the units up to about one per SM (1.1-1.3x faster), past that splitting only adds its
# reduction. At M = 64 the unsplit 64-row tiles win.
DECODE_M_MAX, DECODE_TILES_MIN, DECODE_SPLIT_K_MIN = 16, 48, 2048
# ... but a layer whose tiles make a last wave of only a few (N = 34816-36864: 136-144 tiles, 4-12
# in the second wave) runs that wave on a few SMs, each streaming a whole tile at the rate one SM
# can pull, long after the others are done: split in DECODE_TAIL_SPLIT, the tail is a quarter as
# long. Timed on the H200 (graph replays, docs/benchmarks.md "Decode tails"): 160.0 -> 140.1 us at
# M = 1 and 161.1 -> 148.9 at M = 16 on 34816 x 7168, 160.2 -> 143.0 / 161.4 -> 152.4 on 36864 x
# 7168; with 28 tiles in the last wave (40960) it gained 4% at M = 1 and nothing at M = 16, with
# 44 or more (45056-57344) splitting was slower.
DECODE_TAIL_MAX, DECODE_TAIL_SPLIT = 24, 4
# ... and a layer of DECODE_SWAP_TILES_MIN to one wave of 64-row weight tiles with K of at most
# SWAP_64_SHORT_K_BYTES per row streams best as one swapped 64 x 32 tile per SM: no split-K, so
# no partials and no reduction kernel. Timed against the split 256-wide pick (graph replays, L2
# flushed, docs/benchmarks.md "Decode: one swapped 64-row tile per SM"): on layers of 45-128 such
# tiles 6% faster in geomean, up to 13% (17.9 -> 15.9 us at M = 6 on 7168 x 2048, 34.2 -> 30.9 at
# M = 11 on 7680 x 5120), at worst 1% slower (64 tiles at K = 7168-8192); slower past one wave
# (9216-10240 rows: 144-160 tiles, 2-5%) and at K >= 14336 with few tiles (2-3%), where only
# split-K puts every SM on the weight.
DECODE_SWAP_TILES_MIN = 44


def _ceil_div(a, b):
    return -(-a // b)


# A wgmma of 64 x tile_n x 16 reads its A block (64 x 16) and B block (tile_n x 16) from shared
# memory: (64 + tile_n) / (2 tile_n) of the time its MMA takes at the H200's 128 bytes per clock
# and SM (1.0 at 64 columns, 0.9 at 80, 0.75 at 128), and shared memory runs below its peak, so
# 16-bit tiles narrower than ~96 columns are bound by it: their MMA work is charged that share
# times SMEM_READ_FACTOR where it exceeds 1. Timed on the H200 at the 8 shapes of a 20000-shape
# draw where this changes the bf16 pick (docs/benchmarks.md "Narrow tiles and shared memory"):
# swapped 128 x 80 picks became 144-256 wide, 5-18% faster at 7, level at 1. FP8 is left out:
# its picks there are bound by HBM, and the same change made two of them 16-25% slower.
SMEM_READ_FACTOR = 1.2


def wgmma_smem_bound(tile_n):
    """The factor on a 16-bit tile's MMA work for its shared-memory reads (>= 1)."""
    return max(1.0, (64 + tile_n) / (2 * tile_n) * SMEM_READ_FACTOR)


def tile_time(tile_m, tile_n, cluster_m, smem_bound=False):
    """Model: time of one tile per unit of K. MMA work tile_m x tile_n (with ``smem_bound``, 16-bit
    operands, times wgmma_smem_bound), plus the operand rows loaded per k-step (tile_m of x,
    tile_n of w, the latter shared by a cluster's CTAs through TMA multicast) weighted by
    LOAD_WEIGHT."""
    mma = tile_m * tile_n * (wgmma_smem_bound(tile_n) if smem_bound else 1)
    return mma + LOAD_WEIGHT * (tile_m + tile_n / cluster_m)


def waves(m, n, tile_m, tile_n, cluster_m, split_k=1):
    """Waves of the persistent grid (NUM_SMS CTAs) over the units of work (output tiles times
    K splits); a cluster's CTAs run together, so M tiles count in whole clusters (a 2x1
    cluster on 3 M tiles runs 4)."""
    clusters = _ceil_div(_ceil_div(m, tile_m), cluster_m) * _ceil_div(n, tile_n) * split_k
    return _ceil_div(clusters, NUM_SMS // cluster_m)


# Split-K fix-up (see unit_time): an fp32 partial sum moves the bytes of two 16-bit operand
# elements, each loaded element weighs LOAD_WEIGHT.
FIXUP_WEIGHT = 2 * LOAD_WEIGHT
# bf16-equivalent depth of one k-tile (128 bytes of K per row, the kernels' k-tile for 16-bit
# and FP8 operands alike).
K_TILE_BYTES = 128


def unit_time(k_bytes, tile_m, tile_n, cluster_m, split_k=1, smem_bound=False):
    """Model: time of one unit of work, a tile over K / split_k (k_bytes: bytes of K per row,
    so an FP8 K counts half a bf16 one, as its MMA and loads take half the time): its k-tiles
    times the tile's time per k-step, plus with split-K the fix-up the last unit of a tile
    waits for: its own partials stored and the split_k slots read back, tile_m x tile_n fp32
    values each."""
    steps = _ceil_div(_ceil_div(k_bytes, K_TILE_BYTES), split_k) * (K_TILE_BYTES // 2)
    fixup = FIXUP_WEIGHT * (split_k + 1) * tile_m * tile_n if split_k > 1 else 0
    return steps * tile_time(tile_m, tile_n, cluster_m, smem_bound) + fixup


def call_time(m, n, tile_m, tile_n, cluster_m, split_k=1, k_bytes=K_TILE_BYTES, swap=False, smem_bound=False):
    """Model: waves x time per unit (k_bytes: bytes of K per row; unsplit candidates compare
    the same at any K; smem_bound: see tile_time). A swap config tiles the kernel's N x M
    (tile_m along N)."""
    if swap:
        m, n = n, m
    return (waves(m, n, tile_m, tile_n, cluster_m, split_k)
            * unit_time(k_bytes, tile_m, tile_n, cluster_m, split_k, smem_bound))


def candidates(fp8, fast_accum):
    """(tile_m, tile_n, cluster_m, split_k) the heuristic chooses from for M > 64: the 128-row
    configs of the op without stream-K (promoted FP8: those with room for two accumulator
    sets; the others: unsplit, as their split-K runs on swapped tiles) and, but for promoted
    FP8, the 192-row ones, less the 2x1 cluster of 64-wide tiles.
    Unswapped split-K at M > 64 was below 0.95x torch at every shape the model chose it in
    three random draws on the H200 (16 picks at M = 84-209, 0.48-0.94x, docs/benchmarks.md);
    on the config-space sweep the swapped split or an unsplit tile was up to 1.3x faster
    (M = 83 at 9216 x 4096: 41.8 -> 32.1 us; M = 205 at 5376 x 21504, the same 128 x 256 split 3
    swapped: 103.8 -> 93.9), which the model, costing a tile by its MMA and loads per SM,
    does not see.
    Measured on the H200 (docs/benchmarks.md): at M = 72-192, 64-row tiles ran at 0.53-0.80x
    cuBLAS where the sweeps at M >= 128 never found one fastest, and 128x64 tiles in 2x1
    clusters at 0.53-0.61x where one CTA per tile was faster at M = 128-256; the model below
    does not see either cost."""
    if not fp8:
        pool = CONFIGS + FITTED_CONFIGS + MID_SPLIT_CONFIGS + TALL_CONFIGS
    else:
        pool = [c for c in FP8_CONFIGS if (c["promote"] == 0) == fast_accum and c["promote"] in (0, FP8_PROMOTE)]
    # Unswapped split-K only where there are no swapped tiles (promoted FP8).
    split_ok = fp8 and not fast_accum
    return sorted({(c["tile_m"], c["tile_n"], c["cluster_m"], c.get("split_k", 1)) for c in pool
                   if "x_rows" not in c and "swap" not in c and c["tile_m"] in (128, TALL_TILE_M)
                   and (c["tile_n"], c["cluster_m"]) != (64, 2) and (split_ok or c.get("split_k", 1) == 1)})


# Swapped tiles the heuristic takes: tokens at least this many columns wide. A wgmma of N < 64
# columns reads its 64 x 16 A fragment from shared memory for fewer products than the tensor
# cores take in the time (shared memory, not the MMA, bounds it), which the model leaves out.
SWAP_MIN_WIDTH = 64


def swap_candidates(fp8, fast_accum):
    """(tile_m, tile_n, cluster_m, split_k) of the swapped configs the heuristic chooses from, in
    the kernel's terms (tile_m along N, tile_n along M): those of the op's accumulation, at
    least SWAP_MIN_WIDTH tokens wide."""
    if fp8 and not fast_accum:
        return []
    return sorted({(c["tile_m"], c["tile_n"], c["cluster_m"], c.get("split_k", 1)) for c in SWAP_CONFIGS
                   if c["tile_n"] >= SWAP_MIN_WIDTH})


# Mid-sized M on a layer whose 64-row weight tiles make up at most one wave: one swapped 64-row
# tile per SM, its tokens' tile covering all of M (M rounded up to 16), streams the weight with
# no split-K fix-up (cuBLAS runs such 64 x 80-152 tiles there). Timed on the H200 against the
# model's picks (mostly split-K over swapped 128-row tiles), graph replays next to cuBLAS
# (docs/benchmarks.md, "Swapped 64-row tiles"), it is the faster where
#   * M <= SWAP_64_M_MAX: past it one warpgroup's MMA work per SM outgrows the stream (tiles
#     224-256 wide ran 0.76-1.01x cuBLAS against the picks' 0.84-1.04x);
#   * at most NUM_SMS tiles: one more wave runs part-empty (N = 9216-10240: 0.66-0.89x against
#     0.98-0.99x);
#   * at least SWAP_64_TILES_FULL tiles, enough SMs streaming to keep up with HBM, or at least
#     SWAP_64_TILES_MIN with K of at most SWAP_64_SHORT_K_BYTES per row: with 64-84 tiles (N =
#     4096-5376) a long K is streamed faster by the split-K pick's ~130 units (5376 x 21504:
#     77 against 84 us), a short one without the fix-up (5120 x 2880, M = 115: 22.0 -> 17.1 us;
#     4096 x 4096, M = 88: 17.5 -> 12.6 us FP8); N = 2112 (33 tiles) keeps split-K.
# Past SWAP_64_M_MAX, on layers narrow enough (N <= 4224 for two token tiles, 2816 for three,
# 2112 for four), M splits into t token tiles of SWAP_64_SPLIT_WIDTHS (the most tiles that still
# make one wave; cuBLAS's own tiles there: 64 x 168 at M = 324 on 4096 x 7168, 64 x 120 at M = 452
# on 2112 x 7168, 4 x 33 tiles). Timed on the H200 against the model's picks (swapped 128 x 96-176
# tiles, split-K at N = 2112; docs/benchmarks.md "Swapped 64-row tiles over several token
# tiles"): on the 9 shapes that set it, 2-18% faster at 8, 0.4% slower at one (256 wide ran
# 0.4-3% slower, 64-96 wide, more tiles, up to 15% slower than 128); on 20 fresh ones, faster at
# 15 (up to 24%), level at 2, 9-12% slower at 3 bf16 ones (M = 260-418 on 2112 x 7168 and
# 4096 x 7168); geomean against torch bf16 0.857 -> 0.890, FP8 1.093 -> 1.176.
SWAP_64_M_MAX = 208
SWAP_64_TILES_MIN, SWAP_64_TILES_FULL = 64, 96
SWAP_64_SHORT_K_BYTES = 16384
SWAP_64_SPLIT_WIDTHS = (128, 224)  # least and most tokens per tile when M takes several tiles
# ... but three tiles may be up to SWAP_64_WIDE_MAX wide where no width of the range fits, on
# layers of at most SWAP_64_WIDE_TILES weight tiles (99 CTAs: a quarter of the SMs left free).
# Timed on the H200 against the model's pick (graph replays, docs/benchmarks.md "Swapped 64-row
# tiles: the last token tile"): on 2112 x 7168 (33 tiles) at six M = 674-733 (3 x 240-256 tokens),
# bf16 1.12-1.23x and FP8 1.07-1.18x faster (52.0 -> 43.0 us at M = 724); on 2816 x 4096-8192 (44
# tiles, 132 CTAs) mixed, bf16 0.79-1.06x (M = 740: 29.2 -> 36.8 us); two tiles of 240-256 (N =
# 2880-4096, M = 455-505) mixed too, 0.95-1.14x.
SWAP_64_WIDE_MAX, SWAP_64_WIDE_TILES = 256, 33
# ... the last of them at least SWAP_64_LAST_FILL[t] full: the CTAs of a last token tile whose box
# is partly past M (rows TMA fills with zeros) ran far behind the others, the more so the more
# tiles. Timed on the H200 on 2112 x 7168 at M = 338-888, both ops (docs/benchmarks.md "Swapped
# 64-row tiles: the last token tile"), bf16: three tiles 70-97% full 28.0-38.0 us, 55-64% full
# 34.5-50.5; four tiles 85-100% full 32.2-40.2 us (e.g. M = 574: 4 x 144, 32.2), 62-78% full
# 42.0-62.4 us where three tiles or the model took 32.0-53.7 (M = 473: 4 x 128, 43.6; 3 x 160,
# 32.4). Two tiles of a width rounded up to 16 are always over 87% full.
SWAP_64_LAST_FILL = {3: (2, 3), 4: (5, 6)}


def _last_tile_fits(m, width):
    """Whether the last of M's token tiles of ``width`` is full enough (SWAP_64_LAST_FILL)."""
    tiles = _ceil_div(m, width)
    num, den = SWAP_64_LAST_FILL.get(tiles, (0, 1))
    return den * (m - (tiles - 1) * width) >= num * width


def swap_64_width(m, n, k_bytes, fp8=False, fast_accum=False):
    """The tokens' tile width (a multiple of 16) of the swapped 64-row tile an M x N call with
    ``k_bytes`` of K per row takes, or 0 where it does not (see SWAP_64_M_MAX): M rounded up
    to 16 up to SWAP_64_M_MAX, past it M over the most token tiles (each SWAP_64_SPLIT_WIDTHS
    wide, three of them up to SWAP_64_WIDE_MAX on the narrowest layers, the last full enough:
    SWAP_64_LAST_FILL) that keep the tiles to one wave. Promoted FP8 has no swapped tiles."""
    if (fp8 and not fast_accum) or m <= 64:
        return 0
    weight_tiles = _ceil_div(n, 64)
    if m <= SWAP_64_M_MAX:
        width = _ceil_div(m, 16) * 16
    else:
        least, most = SWAP_64_SPLIT_WIDTHS
        widths = [(t, _ceil_div(_ceil_div(m, t), 16) * 16) for t in range(2, NUM_SMS // weight_tiles + 1)]
        fits = [w for t, w in widths
                if (least <= w <= most
                    or (t == 3 and weight_tiles <= SWAP_64_WIDE_TILES and most < w <= SWAP_64_WIDE_MAX))
                and weight_tiles * _ceil_div(m, w) <= NUM_SMS and _last_tile_fits(m, w)]
        if not fits:
            return 0
        # the narrowest: the most tiles that make one wave (a width past the range only where
        # no width in it fits, as a narrower one is always taken first)
        width = min(fits)
    tiles = weight_tiles * _ceil_div(m, width)
    streams = tiles >= SWAP_64_TILES_FULL or (tiles >= SWAP_64_TILES_MIN and k_bytes <= SWAP_64_SHORT_K_BYTES)
    return width if tiles <= NUM_SMS and streams else 0


# A 2x1 cluster over an odd number of M tiles pads the last cluster with a CTA that has no rows:
# measured far slower than the model says (M = 324-339 on 4096 x 7168-8192, 3 tiles: 0.59x
# cuBLAS; 1 tile at M = 128: 1.34x slower than one CTA per tile), so it is allowed only where
# the padding is a small share of the M tiles.
PADDED_CLUSTER_MIN_TILES = 8


def _cluster_fits(m, tile_m, cluster_m):
    tiles_m = _ceil_div(m, tile_m)
    return cluster_m == 1 or tiles_m % cluster_m == 0 or tiles_m >= PADDED_CLUSTER_MIN_TILES


def _split_fits(m, n, tile_m, tile_n, split_k):
    """Split-K only brings a grid of fewer output tiles than SMs up to at most one wave of
    units: past that the waves' quantization is the model's only gain, and the fix-up a cost
    it does not win back (measured on the H200: docs/benchmarks.md)."""
    return split_k == 1 or _ceil_div(m, tile_m) * _ceil_div(n, tile_n) * split_k <= NUM_SMS


def wide_candidates(fp8, fast_accum):
    """(tile_n, cluster_m) of the 256-row tiles the heuristic takes: FP8 fast accumulation only
    (see WIDE_FP8_FACTOR)."""
    if not (fp8 and fast_accum):
        return []
    return sorted({(c["tile_n"], c["cluster_m"]) for c in WIDE_CONFIGS})


def pingpong_candidates(fp8, fast_accum):
    """(tile_n, cluster_m) of the ping-pong tiles the heuristic takes: FP8 fast accumulation only
    (see PINGPONG_M_MIN)."""
    if not (fp8 and fast_accum):
        return []
    return sorted({(c["tile_n"], c["cluster_m"]) for c in PINGPONG_CONFIGS})


def _pingpong(m, n, k_bytes, fp8, fast_accum, pick, pick_cost):
    """The ping-pong (tile_n, cluster_m) that beats ``pick`` (of modelled cost ``pick_cost``) once
    the pick pays for its epilogues (see EPILOGUE_WEIGHT), or from PINGPONG_ALWAYS_M rows the
    ping-pong tile of least modelled time; else None."""
    if m < PINGPONG_M_MIN:
        return None
    tile_m, tile_n, cluster_m, split_k, swap = pick
    rows, cols = (n, m) if swap else (m, n)
    epilogues = waves(rows, cols, tile_m, tile_n, cluster_m, split_k) * EPILOGUE_WEIGHT * tile_m * tile_n
    options = [(call_time(m, n, 128, tn, c, k_bytes=k_bytes) * PINGPONG_FACTOR, (tn, c))
               for tn, c in pingpong_candidates(fp8, fast_accum) if _cluster_fits(m, 128, c)]
    if not options:
        return None
    cost, best = min(options)
    return best if m >= PINGPONG_ALWAYS_M or cost < (pick_cost + epilogues) * (1 - TIE) else None


def _large_m(m, n, k_bytes, fp8, fast_accum):
    """(tile_m, tile_n, cluster_m, split_k, swap, pingpong) of least modelled call time (FP8
    192-row tiles: scaled by TALL_FP8_FACTOR); near-ties go to the unsplit (at a K of more than
    SPLIT_TIE_K_BYTES per row: the split) tile, then the unswapped,
    then the 128-row tile (see TIE), then the larger tile. A swapped candidate is costed on the
    kernel's N x M (its tile_m along N). FP8 fast accumulation then takes a ping-pong tile where
    the pick's epilogues make it dearer (see _pingpong), or else, at M >= WIDE_M_MIN, chooses
    again with its 256-row tiles in (modelled time scaled by WIDE_FP8_FACTOR; in a near-tie a
    256-row tile wins over a 192-row one, the larger tile)."""
    def scale(tile_m):
        return TALL_FP8_FACTOR if fp8 and tile_m == TALL_TILE_M else 1

    smem_bound = not fp8  # see SMEM_READ_FACTOR
    options = [(call_time(m, n, *c, k_bytes=k_bytes, smem_bound=smem_bound) * scale(c[0]), (*c, False))
               for c in candidates(fp8, fast_accum)
               if _cluster_fits(m, c[0], c[2]) and _split_fits(m, n, c[0], c[1], c[3])]
    options += [(call_time(n, m, *c, k_bytes=k_bytes, smem_bound=smem_bound), (*c, True))
                for c in swap_candidates(fp8, fast_accum)
                if _cluster_fits(n, c[0], c[2]) and _split_fits(n, m, c[0], c[1], c[3])]

    def choose(options):
        costs = {c: cost for cost, c in options}
        best = min(costs.values())
        ties = [c for c, cost in costs.items() if cost <= best * (1 + TIE)]
        split_first = k_bytes > SPLIT_TIE_K_BYTES
        pick = max(ties, key=lambda c: ((c[3] > 1) if split_first else -c[3], not c[4], c[0] <= 128,
                                        c[0] * c[1], c[2]))
        return pick, costs[pick]

    pick, cost = choose(options)
    pingpong = _pingpong(m, n, k_bytes, fp8, fast_accum, pick, cost)
    if pingpong is not None:
        return (128, *pingpong, 1, False, True)
    if m >= WIDE_M_MIN:
        options += [(call_time(m, n, WIDE_TILE_M, tn, c, k_bytes=k_bytes) * WIDE_FP8_FACTOR,
                     (WIDE_TILE_M, tn, c, 1, False))
                    for tn, c in wide_candidates(fp8, fast_accum) if _cluster_fits(m, WIDE_TILE_M, c)]
        pick, _ = choose(options)
    return (*pick, False)


def heuristic(problem, fp8, fast_accum=False):
    """Default config for a call of size problem = {"M", "N", "K"}.

    64 < M <= SWAP_64_M_MAX on a layer of up to one wave of 64-row weight tiles (see
    swap_64_width): one swapped 64-row tile per SM, as wide as M rounded up to 16; larger M
    on narrow layers: M over as many swapped 64-row tiles, 128-224 tokens wide, as make one wave.
    M <= 64 (decode) is bound by streaming the weight: 64-row tiles of the width that minimises
    the bytes the busiest SM streams (the weight and, per tile, x's 64-row box); for 16-bit
    inputs with M <= DECODE_M_MAX, one swapped 64 x 32 tile per SM where the layer's 64-row
    tiles make one wave of at least DECODE_SWAP_TILES_MIN and K is short, else 256-wide tiles,
    split-K up to about one unit per SM when there are few of them (see DECODE_TILES_MIN), and in
    DECODE_TAIL_SPLIT when their last wave is only a few tiles (see DECODE_TAIL_MAX).
    Larger M: the model above, over the op's 128- and 192-row tiles (FP8 192-row ones scaled
    by TALL_FP8_FACTOR), cluster shapes and, for promoted FP8 only, K splits (see candidates):
        time = waves x (k_steps / split_k x tile_cost + fix-up)
        tile_cost = tile_m x tile_n [x wgmma_smem_bound(tile_n), 16-bit]
                    + LOAD_WEIGHT x (tile_m + tile_n / cluster_m)
        fix-up = FIXUP_WEIGHT x (split_k + 1) x tile_m x tile_n   (none unsplit)
        waves = ceil(clusters of tiles x split_k / clusters per wave), M tiles in whole clusters
    (split-K only up to one wave of units, see _split_fits)
    and, but for promoted FP8, the same over the swapped tiles on the kernel's N x M (the weight
    along the 128-row side, the tokens along tile_n in steps of 16, at least SWAP_MIN_WIDTH), so
    a mid-sized M is padded to 16 rows instead of 128, as cuBLAS's tiles do (it runs torch's
    x @ w.T as w @ x^T: its 72- to 176-wide N side is our M; docs/benchmarks.md)
    (a 2x1 cluster only on an even number of M tiles, or at least PADDED_CLUSTER_MIN_TILES)
    so a width that splits N into whole tiles and the tiles into whole waves wins over a wider
    one that leaves a wave part-empty, a partial last M tile (and an odd number of them under a
    2x1 cluster) is paid in full, and few output tiles take narrow ones. Over a sweep of every
    128-row config at M = 128-8192 on six (N, K) (docs/results/gemm_sweep_stream_k.json.gz) the
    model's pick is never more than 0.5% slower than the fastest. Split-K pays where few tiles
    leave SMs idle and K is long enough to amortize the fix-up (mid-sized M).
    FP8 fast accumulation at M >= PINGPONG_M_MIN then takes a ping-pong tile where that pick
    is dearer once charged for its epilogues (see EPILOGUE_WEIGHT), and always from
    PINGPONG_ALWAYS_M rows, or else, at M >= WIDE_M_MIN, a 256-row tile the model puts a margin
    ahead of the pick (see WIDE_FP8_FACTOR).
    FP8: ``fast_accum`` (promote 0) may take any tile; promoted accumulation every FP8_PROMOTE
    k-tiles (accurate to well below bf16 rounding) needs a tile of at most 128 columns. With
    M <= X_ROWS the tile loads only X_ROWS rows of x (where the tile has that variant): timed on
    the H200 at M = 1-16, never slower, up to 1.04x (bf16) and 1.3x (FP8) faster. 16-bit 64-row
    tiles at 16 < M <= 48 likewise load M rounded up to 16 rows (X_ROWS_MID).
    """
    m, n = problem["M"], problem["N"]
    promote = {"promote": 0 if fast_accum else FP8_PROMOTE} if fp8 else {}
    # the x box of 64-row tiles: M rounded up to 16 (see the docstring), where a variant has it
    decode_rows = next((r for r in (X_ROWS, *X_ROWS_MID) if m <= r), 0)
    k_bytes = problem.get("K", 0) * (1 if fp8 else 2)
    if m <= DECODE_M_MAX and not fp8:
        if DECODE_SWAP_TILES_MIN <= _ceil_div(n, 64) <= NUM_SMS and k_bytes <= SWAP_64_SHORT_K_BYTES:
            return dict(DECODE_SWAP_CONFIG)
        tiles = _ceil_div(n, 256)
        if tiles >= DECODE_TILES_MIN:
            tail = tiles % NUM_SMS
            short_tail = tiles > NUM_SMS and 0 < tail <= DECODE_TAIL_MAX
            split_k = DECODE_TAIL_SPLIT if short_tail and problem.get("K", 0) >= DECODE_SPLIT_K_MIN else 1
            return _config(64, 256, split_k=split_k, x_rows=decode_rows)
        if problem.get("K", 0) >= DECODE_SPLIT_K_MIN:
            split_k = max(s for s in (1, *SPLIT_K) if tiles * s <= NUM_SMS)
            return _config(64, 256, split_k=split_k, x_rows=decode_rows)
    swap_64 = swap_64_width(m, n, k_bytes, fp8, fast_accum)
    if swap_64:
        return {**_config(64, swap_64, swap=True), **promote}
    if m > 64:
        tile_m, tile_n, cluster_m, split_k, swap, pingpong = _large_m(m, n, k_bytes, fp8, fast_accum)
        return {**_config(tile_m, tile_n, cluster_m, split_k=split_k, swap=swap, pingpong=pingpong), **promote}
    # A 64-row tile streams its 64-row box of x along K beside the tile_n rows of w (the box is
    # loaded whole however few rows M has), so narrow tiles pay for x again and again (sweeps of
    # every 64-row config at M = 1-64, both ops: docs/benchmarks.md).
    def cost(tile_n):
        return _ceil_div(_ceil_div(n, tile_n), NUM_SMS) * (tile_n + 64)

    widths = (128, 64) if fp8 and not fast_accum else (256, 128, 64)
    tile_n = min(widths, key=lambda t: (cost(t), t))
    config = {**_config(64, tile_n), **promote}
    pool = FP8_CONFIGS if fp8 else BF16_CONFIGS
    with_rows = {**config, "x_rows": decode_rows}
    return with_rows if decode_rows and with_rows in pool else config


def fp8_valid(config, fast_accum):
    """An FP8 config serves the accumulation its signature asks for: fast_accum (MSLK's
    use_fast_accum=True) is promote 0, promoted accumulation any promote > 0."""
    return (config.get("promote", 0) == 0) == bool(fast_accum)


def serves(config, problem):
    """Whether ``config`` can run a call of size problem = {"M", ...}: an x_rows config serves
    M <= x_rows only. Tuning buckets round M up to a power of two: a config tuned at M = 33-48
    (x_rows 48) may meet M = 49-64 of its bucket, where the op layer passes it over for the
    heuristic."""
    return problem["M"] <= config.get("x_rows", problem["M"])


def tile_of_work(work, clusters_m, clusters_n, raster_m, group, minimum=min):
    """Persistent tile order: work index -> (cluster row, cluster column) of the output.

    Work moves along the fast dimension (M if raster_m) inside bands of ``group`` clusters
    (0: one band), Triton's GROUP_M order, so the CTAs running together share A and B panels
    in L2. Plain arithmetic: the kernel calls it with DSL integers (minimum=cutlass.min).
    """
    fast, slow = (clusters_m, clusters_n) if raster_m else (clusters_n, clusters_m)
    band = fast if group == 0 else group
    first = work // (band * slow) * band  # first fast index of this band
    width = minimum(fast - first, band)  # the last band may be narrower
    rest = work - first * slow
    f, s = first + rest % width, rest // width
    return (f, s) if raster_m else (s, f)


def k_range(split, k_tiles, split_k, minimum=min):
    """Split-K: the (first k-tile, number of k-tiles) of split ``split`` out of ``split_k``:
    consecutive ranges of ceil(k_tiles / split_k), the last ones shorter or empty. Plain
    arithmetic, called by the kernel with DSL integers (minimum=cutlass.min)."""
    per_split = (k_tiles + split_k - 1) // split_k
    begin = minimum(split * per_split, k_tiles)
    return begin, minimum(begin + per_split, k_tiles) - begin


def stream_k_tiles(tiles, ctas):
    """Stream-K: (tiles done whole, tiles shared out by k-tiles) of ``tiles`` output tiles (of
    clusters) on a persistent grid of ``ctas`` (clusters): the full waves, then the rest."""
    shared = tiles % ctas
    return tiles - shared, shared


def stream_k_begin(cta, shared_tiles, k_tiles, ctas):
    """Stream-K: the first of the shared tiles' k-tiles (numbered tile by tile, shared_tiles *
    k_tiles in all) that CTA ``cta`` does; it does up to stream_k_begin(cta + 1, ...). Fewer
    shared tiles than CTAs keeps every range shorter than one tile's K, so a range touches at
    most STREAM_K_PIECES tiles."""
    return cta * (shared_tiles * k_tiles) // ctas


def stream_k_first_cta(k_tile, shared_tiles, k_tiles, ctas):
    """Stream-K: the CTA whose range holds shared k-tile ``k_tile`` (the largest ``cta`` with
    stream_k_begin(cta) <= k_tile)."""
    total = shared_tiles * k_tiles
    return ((k_tile + 1) * ctas + total - 1) // total - 1


STREAM_K_PIECES = 2


def stream_k_partials(config):
    """Stream-K: fp32 elements of the partials buffer: a tile per CTA and piece."""
    ctas = NUM_SMS // config["cluster_m"] * config["cluster_m"]
    return ctas * STREAM_K_PIECES * config["tile_m"] * config["tile_n"]


def output_tiles(config, m, n):
    """Output tiles of an M x N call (split-K: the tile counters it takes); a swap config tiles
    the kernel's N x M."""
    if config.get("swap"):
        m, n = n, m
    return _ceil_div(m, config["tile_m"]) * _ceil_div(n, config["tile_n"])


def fixes_up_in_place(config):
    """Split-K on 128-row tiles: the last unit of each tile adds the others' partials (a tile
    counter each); 64-row split-K tiles leave that to a second kernel."""
    return config.get("split_k", 1) > 1 and config["tile_m"] == 128


def partials_elements(config, m, n):
    """fp32 elements of the partials buffer a config's kernel takes for an M x N output (0: it
    takes none): split-K fixed up in place a tile_m x tile_n slot per output tile and split,
    64-row split-K split_k * M * N, stream-K a fixed size."""
    if config.get("stream_k"):
        return stream_k_partials(config)
    split = config.get("split_k", 1)
    if fixes_up_in_place(config):
        return split * output_tiles(config, m, n) * config["tile_m"] * config["tile_n"]
    return split * m * n if split > 1 else 0


def counters_needed(config, m, n):
    """int32 tile counters a split-K kernel fixed up in place takes (0 for other configs); they
    must be zero at the launch, and the kernel leaves them zero."""
    return output_tiles(config, m, n) if fixes_up_in_place(config) else 0


def kernel_args(config):
    """HopperGemm keyword arguments for a config."""
    return {"tile_mn": (config["tile_m"], config["tile_n"]), "cluster_m": config["cluster_m"],
            "raster_m": config["raster"] == "m", "group": config["group"],
            "promote_every": config.get("promote", 0), "split_k": config.get("split_k", 1),
            "stream_k": bool(config.get("stream_k", 0)), "x_rows": config.get("x_rows", 0),
            "swap_ab": bool(config.get("swap", 0)), "pingpong": bool(config.get("pingpong", 0))}


def epilogue_threads(config):
    """Consumer threads that share an output tile (what an epilogue hook is built for): all of
    the CTA's consumer warpgroups (see consumer_warpgroups), or one warpgroup's 128 under
    ping-pong."""
    return 128 if config.get("pingpong") else 128 * consumer_warpgroups(config["tile_m"])
