"""Config space and default choice of the grouped (stacked) GEMM templates (plain Python: no DSL).

A config names one persistent grouped kernel: tile_m x tile_n output tiles (tile_m // 64
consumer warpgroups), and for FP8 ``promote`` (0: the wgmma accumulates over all of K, MSLK's
fast accumulation; 4: every 4 k-tiles into fp32 registers, as the dense FP8 GEMM, needing
tile_n <= 128; the op's use_fast_accum picks which kind serves a call); with ``swap``,
tile_m weight rows by tile_n rows of a group (the operands exchanged, for decode).

The heuristic models one call: the problem is {"M": total_M, "N", "K", "G"}; the groups' sizes
live on the device, so it assumes the M rows fall on the G groups at random, as a balanced router
sends them: about A = G (1 - (1 - 1/G)^M) groups are non-empty (at decode fewer than min(G, M):
16 rows over 16 experts fill ~10.3 of them), r = M / A rows each. By r:
  * r <= SWAP_GROUP_ROWS (decode): a swapped tile, a rule measured apart from the models (see
    SWAP_GROUP_ROWS): these GEMMs stream the busy experts' weights.
  * r + sqrt(r) <= 64, else <= 128 (``one_tile``: a group's rows, spread about r by about
    sqrt(r), fit one M tile of 64, else 128 rows): that tile, 128 columns wide (see
    ONE_TILE_WIDTH). Every tile then reads its weights once and the weight stream decides, so
    finer units balance the grid better than wide tiles or pairs.
  * larger groups: ``seconds``, time in seconds, the larger of the tiles' compute (at the wgmma
    peak) and the bytes through DRAM at the device's bandwidth, where every further M tile of a
    group (or pair of tiles, in a 2x1 cluster that multicasts each weight tile to both) reads its
    weight tile from DRAM again at a rate of L2_REREAD. A group of a few hundred rows then
    streams its weights up to ~2x over in single CTAs and the pair halves that, which pays where
    DRAM decides (more often on an H100 than on an H200: 3.35 against 4.8 TB/s for the same wgmma
    peak); where compute decides, a pair only adds the waste of an odd last tile, and 64-row tiles
    their extra reads.
"""

import math

from mslk_dsl.templates import _kernel_limits as limits

NUM_SMS = limits.MULTIPROCESSORS["sm90a"]  # the persistent grid

# 64-wide tiles are left out: MoE GEMMs have N >= 1024, where they only add loads per FLOP (at
# decode too: 64 x 64 ran 0.73-0.98x the best tile at the three layers' decode GEMMs, T 16 and 128).
_TILES = ((128, 256), (128, 128), (64, 256), (64, 128))
# 128-row tiles in 2x1 clusters (``cluster_m`` 2): two M tiles of a group share the weight tile
# through TMA multicast (for groups of more than 128 rows: a pair's second tile past the group's
# end computes nothing that is stored).
_CLUSTER_TILES = ((128, 256), (128, 128))


def _tiles(**extra):
    return (tuple({"tile_m": m, "tile_n": n, **extra} for m, n in _TILES)
            + tuple({"tile_m": m, "tile_n": n, "cluster_m": 2, **extra} for m, n in _CLUSTER_TILES))


# 16-bit ping-pong tiles (``pingpong``: the two consumer warpgroups take alternate 128-row units,
# so one's epilogue runs under the other's mainloop; HopperGemm's KernelTmaWarpSpecializedPingpong
# form), single CTAs and 2x1 clusters, 128 or 192 columns (a warpgroup holds a whole 128 x tile_n
# fp32 tile). Groups of short K (DeepSeek-V3 down: 16 k-tiles a unit) spend the largest share of a
# unit in its epilogue. Not yet timed on a GPU: the heuristic does not take them (the tuner may).
PINGPONG_TILES = ((128, 192), (128, 128))
BF16_PINGPONG_CONFIGS = tuple({"tile_m": m, "tile_n": n, "pingpong": True, **cluster}
                              for cluster in ({}, {"cluster_m": 2}) for m, n in PINGPONG_TILES)
FP8_PROMOTE = 4
# Swapped decode tiles (``swap``: the weight's rows along wgmma's M, tile_m of them, the group's
# rows along its N, tile_n of them; single CTAs). At decode a group holds a few rows (16 tokens
# over Llama-4-Scout's 16 experts: ~1.6 rows per busy expert), and the unswapped 64-row tiles
# stream each weight tile under 64 mostly idle rows: 256-column units split a layer's weights into
# few units, so the last wave of the persistent grid is often far from full (Llama-4-Scout down at
# T = 16: 206 units on 132 SMs). A swapped unit is a 64- or 128-row slice of one expert's
# weights, so there are 2-4x as many, and the MMA and x loads shrink with the rows. FP8 tiles
# come promoted and unpromoted (fast accumulation); the heuristic takes the 64-row ones at decode
# (SWAP_GROUP_ROWS, below).
SWAP_TILES = ((64, 32), (64, 64), (128, 32), (128, 64))
BF16_SWAP_CONFIGS = tuple({"tile_m": m, "tile_n": n, "swap": 1} for m, n in SWAP_TILES)
FP8_SWAP_CONFIGS = tuple({"tile_m": m, "tile_n": n, "promote": promote, "swap": 1}
                         for promote in (FP8_PROMOTE, 0) for m, n in SWAP_TILES)
BF16_CONFIGS = _tiles() + BF16_PINGPONG_CONFIGS + BF16_SWAP_CONFIGS
FP8_CONFIGS = (_tiles(promote=0) + tuple(c for c in _tiles(promote=FP8_PROMOTE) if c["tile_n"] <= 128)
               + FP8_SWAP_CONFIGS)

# Relative throughput of a full tile in ``seconds`` (first guesses; the tuner measures the real ones).
_EFFICIENCY = {(128, 256): 1.0, (128, 128): 0.9, (64, 256): 0.8, (64, 128): 0.7}


def _ceil_div(a, b):
    return -(-a // b)


def active_groups(m, groups):
    """Expected non-empty groups when ``m`` rows fall on ``groups`` groups at random (rounded up)."""
    if not m:
        return 0
    groups = max(groups, 1)
    return max(math.ceil(groups * (1 - (1 - 1 / groups) ** m) - 1e-9), 1)


# The model of larger groups (``seconds``): the dense wgmma peak of an sm_90 part (bf16, FP8;
# FLOP/s), the share of it a full 128 x 256 tile of the grouped kernel reaches (~650 bf16 TFLOP/s
# at the compute-bound prefill GEMMs), and the share of a group's weight bytes each further M
# tile (or pair) reads again from DRAM. L2_REREAD is set from two sets of timings of every config
# (docs/benchmarks.md "Grouped GEMMs on drawn MoE shapes"): prefill GEMMs of a draw over 16 open
# MoE models on an H100, where single CTAs ran as if each further M tile read 50-100% of the
# weight again, and the three layers' prefill GEMMs on an H200, where pairs lost.
PEAK_FLOPS = {False: 989e12, True: 1979e12}
FULL_TILE_EFFICIENCY = 0.66
L2_REREAD = 0.75
# DRAM traffic runs at COPY_SHARE of the device's theoretical bandwidth (what a copy reaches on an
# H100 or H200); where the caller names no device (compiling, AOT, CPU tests), an H200's 4.8 TB/s.
COPY_SHARE = 0.9
DEFAULT_DEVICE_BANDWIDTH = 4.8e12


def seconds(config, problem, fp8, device_bandwidth=None):
    """Model time of a config in seconds: the larger of its tiles' compute and its DRAM traffic
    (the busy groups' weights, read again by each further M tile or pair at L2_REREAD, the x rows
    and the output) at COPY_SHARE of ``device_bandwidth`` (bytes/s; None: an H200's)."""
    tm, tn, pair = config["tile_m"], config["tile_n"], config.get("cluster_m", 1) == 2
    m, n, k = problem["M"], problem["N"], problem.get("K", 1)
    busy = active_groups(m, problem.get("G", 1))
    if not busy:
        return 0.0
    units = max(m / busy / tm + 0.5, 1.0)          # M tiles per busy group, the last half empty
    if pair:
        units = max(units / 2 + 0.25, 1.0)         # pairs of them: an odd last tile pays for two
    waves = _ceil_div(math.ceil(busy * units * _ceil_div(n, tn)), NUM_SMS // (2 if pair else 1))
    compute = waves * 2 * tm * tn * k / (PEAK_FLOPS[fp8] / NUM_SMS * FULL_TILE_EFFICIENCY * _EFFICIENCY[(tm, tn)])
    elem = 1 if fp8 else 2
    weights = busy * n * k * elem * (1 + (units - 1) * L2_REREAD)
    bandwidth = COPY_SHARE * (device_bandwidth or DEFAULT_DEVICE_BANDWIDTH)
    return max(compute, (weights + m * k * elem + m * n * 2) / bandwidth)


# Promoted FP8 128-row tiles also run in 2x1 clusters where K is at least CLUSTER_K_MIN and the groups
# hold at least two M tiles on average (CLUSTER_GROUP_ROWS rows per non-empty group). Every config
# at the three MoE layers' prefill GEMMs on the H200 (docs/benchmarks.md "Grouped GEMMs in 2x1
# clusters"): the promoted 128x128 tile in a 2x1 cluster ran 1.00-1.11x the single CTA at K =
# 4096-14336 (Mixtral down, K 14336: 1.11x; Llama-4-Scout down, K 8192: 1.04x; Mixtral gate_up,
# K 4096: 1.03x) but for 0.985x at Llama-4-Scout gate_up (K 5120), and 0.87x at K = 2048
# (DeepSeek-V3 down: 16 k-tiles a unit, too few to repay the cluster's set-up). DRAM does not
# decide there (``seconds`` keeps them single), so this is the FP8 mainloop's own gain: its wgmma
# eats shared memory twice as fast as bf16's, and the multicast halves the weight loads per CTA.
# 16-bit tiles in clusters won only at Mixtral down there (1.07x; 0.87-0.96x at four of the other
# five), so 16-bit takes a pair only where ``seconds`` says DRAM decides.
CLUSTER_K_MIN = 4096
CLUSTER_GROUP_ROWS = 256

# Decode: where the expected rows per non-empty group are at most SWAP_GROUP_ROWS (an unswapped
# 64-row tile at least half idle), the swapped tile of 64 weight rows, with 32 token rows where
# SWAP_TOKEN_MARGIN times the expected rows fit in 32 (a group's rows rarely exceed that), else
# 64. Every config at the three MoE layers' decode GEMMs, T 16 and 128 (H100, one run,
# docs/benchmarks.md "Swapped grouped tiles for decode"): swapped 64 x 32 ran 1.01-1.06x the
# unswapped pick at 1.5-8 expected rows per busy expert (20 GEMMs, bf16 and FP8), and 0.90-0.95x
# at 32 (Mixtral T 128, where about half the experts need two token tiles), where 64 x 64 ran
# 1.01-1.02x. 128-row swapped tiles were never the fastest.
SWAP_GROUP_ROWS = 32
SWAP_TOKEN_MARGIN = 1.5


# Groups that fit one M tile: where a busy group expects more than SWAP_GROUP_ROWS rows and its
# rows (spread about r by about sqrt(r) under a random router) fit one tile of 64 rows, else of
# 128 (ONE_TILE_ROWS), that tile with ONE_TILE_WIDTH columns. Every config was timed at the drawn
# grouped GEMMs of four draws over 16 MoE models (bf16 and unpromoted FP8, H100;
# docs/benchmarks.md "Grouped GEMMs: groups of one M tile"):
#   * 34-53 rows per busy expert (18 GEMMs): 64 x 128 ran 0.979-1.000 of the fastest config, the
#     64 x 256 of an earlier compute model 0.962-0.991;
#   * 58-111 rows (16 GEMMs): 128 x 128 ran 0.984-1.000, the DRAM model's 128 x 256 (single or
#     paired) 0.922-0.992; at 115 rows 128 x 128 ran 0.928 / 0.995 against the pair's 0.958 / 1.0;
#   * 120-128 rows, where about half the groups overflow a 128-row tile (hence the sqrt(r)
#     margin): 128 x 128 0.76-1.00, and 128 x 256 tiles, mostly in pairs, won.
# These GEMMs stream each busy expert's weights once at r (bf16) or 2r (FP8) FLOP per byte, below
# the ridge of an H100 or an H200, so the tile width shapes only how evenly the weight stream
# spreads over the grid: 128 columns make twice the units of 256.
ONE_TILE_WIDTH = 128
ONE_TILE_ROWS = (64, 128)


def one_tile(rows_per_group):
    """The smallest M tile of ONE_TILE_ROWS that a busy group of ``rows_per_group`` expected rows
    fits, its spread (about the square root, as the rows fall at random) included; None if none."""
    return next((t for t in ONE_TILE_ROWS if rows_per_group + math.sqrt(rows_per_group) <= t), None)


# The rules of ``heuristic``, by the expected rows per busy group (``band``); the one-tile rules
# with the M tile they take.
ONE_TILE_BANDS = {f"one {t}-row tile": t for t in ONE_TILE_ROWS}
BANDS = ("swapped", *ONE_TILE_BANDS, "DRAM model")


def band(m, groups):
    """Which rule of ``heuristic`` (one of BANDS) serves ``m`` rows over ``groups`` groups:
    "swapped" (decode), a one-tile rule, or the "DRAM model"."""
    busy = active_groups(m, groups)
    if busy and m / busy <= SWAP_GROUP_ROWS:
        return "swapped"
    tile_m = one_tile(m / busy) if busy else ONE_TILE_ROWS[0]
    return f"one {tile_m}-row tile" if tile_m else "DRAM model"


# TIES: where ``seconds`` gives a pair and a single CTA the same time, compute decides both and
# the groups hold whole pairs (no odd last tile to waste), and the pair multicasts each weight
# tile to two CTAs, so it moves half the weight bytes from L2; the pick is the pair. This happens
# at the long-K, 8-expert down GEMMs (Mixtral-like: K 14336, 1024+ rows per expert), where the
# H200 sweeps of every config ran the 2x1 128 x 256 tile 1.05-1.07x the single CTA with fast FP8
# accumulation and level in bf16 (docs/benchmarks.md "Grouped GEMMs: fast accumulation").


def heuristic(problem, fp8, device_bandwidth=None, fast_accum=False):
    """At decode (at most SWAP_GROUP_ROWS expected rows per non-empty group) the swapped 64-row
    tile (see SWAP_GROUP_ROWS); where a group fits one M tile of 64, else 128 rows, that tile
    128 columns wide (see ONE_TILE_WIDTH); past that the fastest config by ``seconds`` at the
    device's DRAM bandwidth (bytes/s; None: an H200's), 2x1 clusters included. FP8 with
    ``fast_accum`` (MSLK's FP8FastAccum kernels): unpromoted configs, any tile; else tiles of
    <= 128 columns promoted every 4 k-tiles (the error of unpromoted FP8 accumulation grows with
    K). Ties go to the larger tile, then the 2x1 cluster (see TIES). A promoted FP8 128-row tile
    then runs in a 2x1 cluster also where K >= CLUSTER_K_MIN and the expected rows per non-empty
    group reach CLUSTER_GROUP_ROWS (a gain of the promoted mainloop; unpromoted tiles ran fastest
    single at 4 of the three layers' 6 prefill GEMMs on the H200)."""
    m = problem["M"]
    promote = {"promote": 0 if fast_accum else FP8_PROMOTE} if fp8 else {}
    busy = active_groups(m, problem.get("G", 1))
    rule = band(m, problem.get("G", 1))
    if rule == "swapped":
        tokens = 32 if SWAP_TOKEN_MARGIN * m / busy <= 32 else 64
        return {"tile_m": 64, "tile_n": tokens, **promote, "swap": 1}
    if rule in ONE_TILE_BANDS:
        return {"tile_m": ONE_TILE_BANDS[rule], "tile_n": ONE_TILE_WIDTH, **promote}
    configs = [c for c in (FP8_CONFIGS if fp8 else BF16_CONFIGS)
               if (not fp8 or c["promote"] == promote["promote"]) and not c.get("pingpong") and not c.get("swap")]

    def model(c):
        return seconds(c, problem, fp8, device_bandwidth)
    pick = dict(min(configs, key=lambda c: (model(c), -c["tile_m"] * c["tile_n"], -c.get("cluster_m", 1))))
    if (fp8 and promote["promote"] and pick["tile_m"] == 128 and problem.get("K", 0) >= CLUSTER_K_MIN
            and m / busy >= CLUSTER_GROUP_ROWS):
        pick["cluster_m"] = 2
    return pick
