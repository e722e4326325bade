"""Tile geometry, validity and size heuristics of the row-wise memory-bound templates.

Plain Python (no DSL import): the template files read it when the registry loads them, the
device helpers (``_cute_rowwise``) read it inside ``build()``.

A config is ``{"threads", "rows_per_block", "vec", "chunks"}``, and for the FP8 row quantizers also
``"l1"`` and optionally ``"cluster"``:
  * a CTA of ``threads`` threads owns ``rows_per_block`` consecutive rows; each row is handled by
    ``tpr = threads // rows_per_block`` consecutive threads (a power of two: a group of at most
    32 threads lives inside one warp, a larger one spans whole warps);
  * a row is cut into vectors of ``vec`` elements, one global access each (128 bits when
    ``vec * element size == 16``); lane ``l`` of a row touches vectors ``l, l + tpr, ...`` so a
    warp's accesses are contiguous. A config names 128-bit vectors or single elements; rows that
    admit only 8- or 4-byte accesses (the signature's ``vec_bytes``) run a 128-bit config with
    each vector cut into 16 / vec_bytes accesses (``access_tile``): the same tile, the same
    bytes per thread, more loads;
  * a tile is ``tpr * chunks`` vectors (``tile_k`` elements) of one row: what a thread group
    keeps in registers at once. Every load of a tile is issued before the first use, which is
    what keeps enough bytes in flight per SM;
  * ``l1`` ("keep" or "stream"): the L1 policy of the loads of data read once, the default policy
    or L1::no_allocate (absent: "keep");
  * ``cluster`` (absent: 1): a row is split over that many CTAs of a thread-block cluster, each
    holding ``tile_k`` of it (its share, ``row_k`` = tile_k * cluster in all); the row reduction
    meets over distributed shared memory. Only with ``rows_per_block == 1``; 2, 4, 8 or 16 CTAs;
  * ``stage`` (absent: registers; the FP8 row quantizers): "smem" holds the row's first tile in
    shared memory instead of registers, loaded by cp.async, so no register is held by the data in
    flight or across the row reduction and a CTA of 256 threads holds a row of up to 16K
    elements (``STAGED_SMEM_BYTES``); one CTA per row. On one-element rows it applies to the
    phased kernel (its aligned middle); the other kernel of such a config (rows that are not
    congruent) runs ``plain_tile``.
  * ``layout`` (absent: "rows"; silu_mul): "flat" maps compact [M, K] tensors as one flat array
    of 16-byte vectors, whatever K is (odd included), ``threads * chunks * vec`` elements a CTA
    (``_cute_flat_rows``); a call it does not serve (padded rows, a base off a 16-byte boundary)
    runs ``flat_fallback``'s row tile instead, picked at launch. (The op layer copies padded rows
    compact, so through the ops only a base off 16 bytes falls back.)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mslk_dsl.errors import ConfigError
from mslk_dsl.templates._kernel_limits import ELEM_BYTES, VECTOR_BYTES, one_element, vector_signature

FLOAT_DTYPES = tuple(ELEM_BYTES)

# Floor of a row's absmax in the FP8 row quantization, as MSLK's quantize_fp8_row
# (eps_opt = 1/512, which matches its CUDA kernels' minimum scaling factor).
FP8_ROW_EPS = 1.0 / 512.0

# Register budget for the data one thread holds per tile, in bytes (inputs in flight or the
# resident row): 64 registers leaves room for addresses and the fp32 math at 512 threads.
MAX_TILE_BYTES_PER_THREAD = 256
# Shared-memory budget of a staged tile (the ``stage`` key), all its inputs together: 64 KiB
# keeps three CTAs per SM (227 KiB of shared memory on sm_90).
STAGED_SMEM_BYTES = 64 * 1024
# The CTAs per SM a staged tile's register budget aims at (staged_registers).
STAGED_CTAS = 4
# The register tile of a staged one-element config's kernel for rows that are not congruent:
# at most this many single elements per thread and input (the quantizers' 4096 tile).
UNSTAGED_SCALAR_CHUNKS = 16


@dataclass(frozen=True)
class RowTile:
    threads: int
    rows_per_block: int
    vec: int
    chunks: int
    l1: str = "keep"
    cluster: int = 1
    stage: str = "registers"
    layout: str = "rows"

    @classmethod
    def of(cls, config) -> RowTile:
        return cls(config["threads"], config["rows_per_block"], config["vec"], config["chunks"],
                   config.get("l1", "keep"), config.get("cluster", 1), config.get("stage", "registers"),
                   config.get("layout", "rows"))

    @property
    def flat(self) -> bool:
        """The tensors are read as one flat array of vectors (the ``layout`` key)."""
        return self.layout == "flat"

    @property
    def staged(self) -> bool:
        """The first tile of a row waits in shared memory (the ``stage`` key)."""
        return self.stage == "smem"

    @property
    def tpr(self) -> int:
        """Threads per row."""
        return self.threads // self.rows_per_block

    @property
    def tile_vecs(self) -> int:
        return self.tpr * self.chunks

    @property
    def tile_k(self) -> int:
        return self.tile_vecs * self.vec

    @property
    def row_k(self) -> int:
        """Elements of a row held at once by all the CTAs that share it."""
        return self.tile_k * self.cluster

    @property
    def warps_per_row(self) -> int:
        return max(self.tpr // 32, 1)


def config(threads: int, rows_per_block: int, vec: int, chunks: int) -> dict:
    return {"threads": threads, "rows_per_block": rows_per_block, "vec": vec, "chunks": chunks}


def expand(vector_shapes, scalar_shapes) -> list[dict]:
    """Configs from (threads, rows_per_block, chunks) shapes: the vector shapes with every vector
    width (8 for 16-bit dtypes, 4 for fp32: one 128-bit access), the scalar ones with vec=1."""
    return ([config(t, r, v, c) for (t, r, c) in vector_shapes for v in (8, 4)]
            + [config(t, r, 1, c) for (t, r, c) in scalar_shapes])


def has_shape(config: dict, vector_shapes, scalar_shapes) -> bool:
    """Whether ``config`` (not a cluster) is one of the (threads, rows_per_block, chunks) shapes
    given, as ``expand`` takes them: the vector shapes for 128-bit configs, the scalar ones for
    one-element configs."""
    shape = (config["threads"], config["rows_per_block"], config["chunks"])
    return "cluster" not in config and shape in (scalar_shapes if config["vec"] == 1 else vector_shapes)


L1_POLICIES = ("keep", "stream")
STAGES = ("registers", "smem")
LAYOUTS = ("rows", "flat")
FLAT_THREADS = (128, 256, 512)


def with_l1(configs, policies=L1_POLICIES) -> list[dict]:
    """Every config once per L1 policy of its single-use loads (the ``l1`` key)."""
    return [{**c, "l1": p} for p in policies for c in configs]


def clustered(configs, cluster: int) -> list[dict]:
    """The configs with a row split over ``cluster`` CTAs (the ``cluster`` key)."""
    return [{**c, "cluster": cluster} for c in configs]


def staged(configs) -> list[dict]:
    """The configs with the first tile of a row held in shared memory (the ``stage`` key)."""
    return [{**c, "stage": "smem"} for c in configs]


def flat(configs) -> list[dict]:
    """The configs read as one flat array of vectors (the ``layout`` key)."""
    return [{**c, "layout": "flat"} for c in configs]


def flat_fallback(sig: dict) -> dict:
    """The config of the row kernels a flat config's launch runs where the flat kernel does not
    serve the call (padded rows, a base off 16 bytes): 8 rows per CTA of 128 threads, 256
    elements a pass (2 vectors or 16 single elements per lane), as short rows are what the
    heuristics pick flat configs for."""
    vec = 1 if one_element(sig) else VECTOR_BYTES // ELEM_BYTES[sig["dtype"]]
    return config(128, 8, vec, 16 if vec == 1 else 2)


def flat_pick(configs: list[dict], sig: dict, k: int, arrays: int, shape, row_bytes: tuple[int, int]) -> dict | None:
    """The flat config of ``shape`` ((threads, rows_per_block, chunks)) for the rows of ``sig``
    where a row of ``k`` elements is ``row_bytes[0]`` to ``row_bytes[1]`` bytes long; else None.
    The templates that take it say where it was measured."""
    if not row_bytes[0] <= k * ELEM_BYTES[sig["dtype"]] <= row_bytes[1]:
        return None
    return next((c for c in configs if RowTile.of(c).flat and valid(c, sig, arrays)
                 and (c["threads"], c["rows_per_block"], c["chunks"]) == tuple(shape)), None)


def plain_tile(tile: RowTile) -> RowTile:
    """The tile of a config's plain kernel (not the phased one): a staged one-element config's
    register tile (tensors that are not congruent have no common aligned middle to copy), at most
    UNSTAGED_SCALAR_CHUNKS elements per thread and input (the rest of a longer row is read again,
    as any tile's); any other config's own tile."""
    if not (tile.staged and tile.vec == 1):
        return tile
    return dataclasses.replace(tile, stage="registers", chunks=min(tile.chunks, UNSTAGED_SCALAR_CHUNKS))


def staged_registers(tile: RowTile, arrays: int, elem_bytes: int, limits: dict) -> int:
    """Registers per thread for a staged tile: as many as the CTAs per SM its shared memory
    allows (at most STAGED_CTAS) leave room for, at most 128 (a multiple of 8). ``limits``: the
    target's (arch/*.toml ``[limits]``, ``mslk_dsl.targets``). On sm_90 a 64 KiB tile of 256
    threads gets 80 (three CTAs), a 32 KiB one 64 (four)."""
    # the tile, 1 KiB of reduction slots, the shared memory the system reserves per CTA
    smem = arrays * tile.tile_k * elem_bytes + 1024 + limits["shared_memory_reserved_per_block"]
    ctas = max(1, min(STAGED_CTAS, limits["shared_memory_per_sm"] // smem))
    return min(128, limits["registers_per_sm"] // (tile.threads * ctas) // 8 * 8)


def valid(config: dict, sig: dict, arrays: int = 1) -> bool:
    """Rows that admit only one element per access take the one-element configs, every other
    row the 128-bit ones (cut into narrower accesses by ``access_tile`` where the rows need it);
    ``arrays`` inputs of one tile must fit the register budget."""
    if not vector_signature(sig):
        return False
    tile = RowTile.of(config)
    elem = ELEM_BYTES[sig["dtype"]]
    if tile.layout not in LAYOUTS:
        return False
    if tile.flat:
        # 16-byte vectors of the flat array whatever the rows admit, one "row" of threads per CTA
        return (tile.vec == VECTOR_BYTES // elem and tile.rows_per_block == 1 and tile.cluster == 1
                and tile.threads in FLAT_THREADS and not tile.staged and tile.l1 == L1_POLICIES[0]
                and arrays * tile.chunks * tile.vec * elem <= MAX_TILE_BYTES_PER_THREAD)
    if tile.vec != (1 if one_element(sig) else VECTOR_BYTES // elem):
        return False
    tpr = tile.tpr
    if tile.threads % tile.rows_per_block or not 8 <= tpr <= 1024:
        return False
    # Threads per row: a power of two, or whole warps when the CTA holds one row (e.g. 160 or
    # 224 threads: 5120 and 7168 elements in 4 chunks of 8).
    if tpr & (tpr - 1) and (tile.rows_per_block != 1 or tpr % 32):
        return False
    if tile.cluster != 1 and (tile.rows_per_block != 1 or tile.cluster not in (2, 4, 8, 16)):
        return False
    if tile.l1 not in L1_POLICIES or tile.stage not in STAGES:
        return False
    # Rows cut into 8- or 4-byte accesses take the default L1 policy only: the policies were timed on
    # 128-bit vectors, and a second set of kernels for rare rows would not pay for itself.
    if tile.l1 != L1_POLICIES[0] and not one_element(sig) and sig["vec_bytes"] != VECTOR_BYTES:
        return False
    if tile.staged:
        # one CTA per row, the tile within the shared-memory budget; its register tile (one-element
        # rows that are not congruent) within the register budget
        if tile.cluster != 1 or tile.rows_per_block != 1 or arrays * tile.tile_k * elem > STAGED_SMEM_BYTES:
            return False
        tile = plain_tile(tile) if tile.vec == 1 else dataclasses.replace(tile, chunks=1)
    return arrays * tile.chunks * tile.vec * elem <= MAX_TILE_BYTES_PER_THREAD


def access_tile(config: dict, sig: dict) -> RowTile:
    """The tile a kernel runs for ``config`` on rows of ``sig``: the config's own, or, where the
    rows admit only ``vec_bytes`` < 16 per access, each of its 128-bit vectors cut into
    16 / vec_bytes narrower ones (``chunks`` times as many, the same elements per thread, the
    same ``tile_k``)."""
    tile = RowTile.of(config)
    width = sig["vec_bytes"]
    if one_element(sig) or width == VECTOR_BYTES or tile.flat:
        return tile
    cut = VECTOR_BYTES // width
    return dataclasses.replace(tile, vec=tile.vec // cut, chunks=tile.chunks * cut)


def phased_tile(tile: RowTile, elem_bytes: int) -> RowTile:
    """The tile a one-element config runs on phased rows (every tensor of the call at the same
    offset from a 16-byte boundary; ``_cute_rowwise.PhasedRow``): the row's aligned middle in
    vectors of up to 16 bytes, the same elements per thread (``chunks`` single elements become
    chunks / vec vectors) and the same ``tile_k``."""
    vec = min(VECTOR_BYTES // elem_bytes, tile.chunks)
    return dataclasses.replace(tile, vec=vec, chunks=tile.chunks // vec)


def edge_slots(tile: RowTile) -> int:
    """Edge elements (a phased row's head and tail: fewer than ``tile.vec`` each) per lane of a
    row group: enough that the group's ``tpr`` lanes hold 2 * (vec - 1) of them."""
    return -(-2 * (tile.vec - 1) // tile.tpr)


def cut_into_words(config: dict, sig: dict) -> bool:
    """Whether the kernel of ``config`` on rows of ``sig`` runs its 128-bit vectors as several
    8- or 4-byte accesses (``access_tile``). Those kernels hold the same data in registers but
    two or four times the addresses and predicates; they get the config's register budget (its
    occupancy) and may spill a few words, which stay in L1: rows that admit 8 or 4 bytes and not
    16 are rarer, and a row of one-element accesses was the alternative."""
    return access_tile(config, sig).chunks != RowTile.of(config).chunks


def pick(configs: list[dict], sig: dict, k: int, arrays: int = 1) -> dict:
    """The valid config with the smallest tile that still covers a row of ``k`` elements (fewest
    idle threads, whole row in registers), else the one with the largest tile (the rest of the row
    is streamed). Ties keep list order, so list the preferred shape first. A clustered config's
    tile is the row share of all its CTAs (``row_k``)."""
    ok = [c for c in configs if valid(c, sig, arrays)]
    if not ok:
        raise ConfigError(f"row-wise heuristic: no config of the {len(configs)} given serves signature {sig}")
    covering = [c for c in ok if RowTile.of(c).row_k >= k]
    if covering:
        return min(covering, key=lambda c: RowTile.of(c).row_k)
    return max(ok, key=lambda c: RowTile.of(c).row_k)


# The FP8 row quantizers' (quantize_fp8_row, silu_mul_quant) short-row tiles: 2, 8 or 16 rows per
# CTA of 128 threads, 128-2048 elements (one element per access: 512-2048). A row a little past
# 1024 elements read in one pass of the 2-row 2048 tile beat the 1024 tile with its rest read
# again: quantize_fp8_row 22.0 against 24.0 us at 14355 x 1104, 50.8 / 55.1 at 40000 x 1100,
# 28.7 / 30.6 at 20000 x 1136, a tie at 60000 x 1064; silu_mul_quant 32.7 / 40.8, 85.2 / 98.6,
# 42.2 / 52.9, 109.7 / 138.0 (H200, bf16, CUDA-graph replays, docs/benchmarks.md "Short rows").
# The streamed rest's earlier wins at 1056 and 1084 were against the 3072 tile; the quantizers
# now take no streamed rest at all (their templates say why).
QUANT_SHORT_VECTOR_ROWS = [(128, 16, 2), (128, 8, 2), (128, 8, 4), (128, 2, 4)]
QUANT_SHORT_SCALAR_ROWS = [(128, 4, 16), (128, 4, 32), (128, 2, 32)]

# One-element rows of a few hundred elements or fewer (odd per-head and MoE widths) take group
# tiles of 8 or 16 lanes a row and 8 or 16 rows per CTA (short_group_pick; each template lists
# the shapes it takes), where the smallest one-element tiles of the other lists give a row a whole
# warp (256 elements in rmsnorm, 512 in the quantizers). H100 (no H200 was lent), bf16,
# CUDA-graph replays, every config near the row timed in two rounds (docs/benchmarks.md
# "One-element rows of at most 256 elements" and "... 8 lanes a row"):
# - First round, against the one-warp tiles: at 33-201 elements the group tiles took rmsnorm
#   from 41.3 to 25.9 us at 131072 x 75 (Liger 31.1), from 43.0 to 28.6 at 262144 x 45,
#   quantize_fp8_row from 39.7 to 23.5 at 131072 x 75, silu_mul_quant from 57.9 to 34.8; the
#   64-element tile of 8 lanes beat the one of 16 lanes of 4 at 18 of 20 (op, row) pairs; the
#   128 tile of 128 threads beat its 256-thread twin at 28 of 32.
# - Second round (the 8-lane 128 and 256 tiles and the 16-lane 512 one added): the 8-lane 128
#   tile beat the 16-lane one at 93 and 127 elements in all three ops timed (rmsnorm 25.7 against
#   27.3 us at 131072 x 93), the 8-lane 256 tile the 16-lane one at 163 in rmsnorm and
#   quantize_fp8_row (37.4 against 40.1; 32.5 / 35.1) and at 251 in quantize_fp8_row (33.3 /
#   35.0), not in silu_mul_quant (54.2 / 53.6, 55.5 / 52.0); at 301-509 the 16-lane 512 tile
#   beat the one-warp 512 one in rmsnorm and quantize_fp8_row (quantize 52.4 against 60.2 at
#   131072 x 301, 63.2 / 70.0 at 423, 40.4 / 43.8 at 65536 x 509), not in silu_mul_quant (86.3
#   / 93.7 at 301 but 107.9 / 106.8 at 423, 69.2 / 65.0 at 509). And rows a little past 64
#   elements ran fastest in the 64 tile reading the rest again (SHORT_REST_ROWS): at 131072 x 69
#   20.5 against 22.8 us in the 8-lane 128 tile (rmsnorm), 17.8 / 19.9 (quantize_fp8_row),
#   26.3 / 31.3 (silu_mul_quant); at 100000 x 75 19.3 / 21.5, 17.6 / 19.1, 27.6 / 28.1; at 93
#   level or behind.
# rmsnorm_add was timed in the first round only: it keeps the 16-lane tiles past 64.
SHORT_SCALAR_GROUP_ROWS = [(128, 16, 8), (128, 8, 4), (128, 8, 8), (128, 16, 16), (256, 16, 8), (128, 8, 16), (128, 16, 32),
                           (128, 8, 32)]
SHORT_REST_ROWS = 80       # rows of 65-80 elements: the 64 tile and its rest, where a template says so
SIXTY_FOUR = (128, 16, 8)  # the 64-element tile: 8 lanes of 8 elements, 16 rows per CTA


def short_scalar_groups(config) -> bool:
    """Whether ``config`` is one of the SHORT_SCALAR_GROUP_ROWS tiles."""
    return has_shape(config, [], SHORT_SCALAR_GROUP_ROWS)


def _shape_row_k(shape) -> int:
    threads, rows_per_block, chunks = shape
    return threads // rows_per_block * chunks


def short_group_pick(configs: list[dict], sig: dict, k: int, arrays: int, shapes, rest_past_64: bool) -> dict | None:
    """For a one-element row of ``k`` elements that the largest of ``shapes`` (a template's
    SHORT_SCALAR_GROUP_ROWS picks, smallest first) covers: the smallest of them that covers it,
    or, with ``rest_past_64``, the 64 tile for rows of at most SHORT_REST_ROWS; None for other
    rows."""
    if not one_element(sig) or k > max(_shape_row_k(s) for s in shapes):
        return None
    if rest_past_64 and k <= SHORT_REST_ROWS:
        shapes = [SIXTY_FOUR]
    return pick([c for c in configs if has_shape(c, [], shapes)], sig, k, arrays)


# A row at most 1 / STREAMED_REST longer than a tile (streamed_rest).
STREAMED_REST = 8


def streamed_rest(configs: list[dict], sig: dict, k: int, arrays: int = 1) -> dict | None:
    """The valid config with the longest tile (a cluster's: all its CTAs) not past a row of ``k``
    elements, where the rest of the row (k - tile) is at most k / STREAMED_REST; else None, and
    None for rows of one element per access (the rule was measured on vector rows only).
    Such a row runs in that tile and streams its rest (the kernels read the rest again, mostly
    from L2), rather than in the next tile up, whose lanes past the row idle (up to half of
    them just past a tile). The templates that take it say where it was measured."""
    if one_element(sig):
        return None
    fits = [c for c in configs if valid(c, sig, arrays) and RowTile.of(c).row_k <= k]
    if not fits:
        return None
    best = max(fits, key=lambda c: RowTile.of(c).row_k)
    return best if (k - RowTile.of(best).row_k) * STREAMED_REST <= k else None


def staged_pick(configs: list[dict], sig: dict, k: int, arrays: int, from_k: int) -> dict | None:
    """For a row of ``k`` >= ``from_k`` elements that a staged config among ``configs`` covers in
    one pass: the one of those (``pick_fitted``: fewest idle lanes, ties in list order); else None.
    The templates that take it say where it was measured."""
    if k < from_k:
        return None
    covering = [c for c in configs if valid(c, sig, arrays) and RowTile.of(c).row_k >= k]
    return pick_fitted(covering, sig, k, arrays) if covering else None


def staged_from(sig: dict, vector_rows: int, scalar_rows: int) -> int:
    """The shortest row (elements) a template stages: ``scalar_rows`` elements for rows of one
    element per access (their tiles count elements), else ``vector_rows`` 16-bit elements' bytes
    (an fp32 row of half as many elements)."""
    if one_element(sig):
        return scalar_rows
    return -(-vector_rows * 2 // ELEM_BYTES[sig["dtype"]])


# Rows of one element per access up to this long keep the short-row tiles' picks (scalar_tile).
SCALAR_TABLE_FROM = 1024


def scalar_tile(table, sig: dict, k: int) -> dict | None:
    """For rows of one element per access longer than SCALAR_TABLE_FROM: the config of the first
    entry of ``table`` ((config, the longest row it takes), shortest rows first) that takes a row
    of ``k`` elements; else None. A row longer than its tile reads the rest again. The templates
    that take it say where their tables were measured."""
    if not one_element(sig) or k <= SCALAR_TABLE_FROM:
        return None
    return next((config for config, longest in table if k <= longest), None)


def fewest_idle_lanes(configs: list[dict], k: int) -> dict:
    """Of ``configs`` (tiles a row of ``k`` elements runs through in passes), the one with the
    fewest idle lanes over its passes (ceil(k / row_k) * row_k - k), then the fewest passes:
    14461 = 4 x 4096 - 1923 = 2 x 8192 - 1923 takes the 8192 tile, 8625 the 4096 one (3 x 4096
    leaves 3663 lanes idle, 2 x 8192 7759)."""
    def cost(c):
        row_k = RowTile.of(c).row_k
        passes = -(-k // row_k)
        return passes * row_k - k, passes

    return min(configs, key=cost)


def pick_fitted(configs: list[dict], sig: dict, k: int, arrays: int = 1) -> dict:
    """The valid config that reads a row of ``k`` elements in the fewest tiles (passes), then
    with the fewest idle lanes over them (ceil(k / row_k) * row_k - k); ties keep list order.
    For a row that one tile covers this is ``pick``'s smallest covering tile; a longer row gets
    the tile that splits it most evenly (14336 = 2 x 7168 rather than 8192 + 6144)."""
    ok = [c for c in configs if valid(c, sig, arrays)]
    if not ok:
        raise ConfigError(f"row-wise heuristic: no config of the {len(configs)} given serves signature {sig}")

    def cost(c):
        row_k = RowTile.of(c).row_k
        passes = -(-k // row_k)
        return passes, passes * row_k - k

    return min(ok, key=cost)


def rules(configs: list[dict], arrays: int):
    """(valid, heuristic) of a row-wise template whose kernels read ``arrays`` inputs per tile."""
    def template_valid(config, target, sig):
        return valid(config, sig, arrays)

    def heuristic(target, sig, problem):
        return pick(configs, sig, problem["K"], arrays)

    return template_valid, heuristic


def check(template: str, config: dict, sig: dict, arrays: int) -> RowTile:
    """The tile the kernel runs (``access_tile``); ConfigError (a ValueError), naming the
    template and the config, unless ``valid``."""
    if not valid(config, sig, arrays):
        raise ConfigError(f"{template}: config {dict(config)} does not serve signature {dict(sig)}: see "
                          f"_rowwise_plan.valid (vector width vs. alignment, threads per row, register budget)")
    return access_tile(config, sig)
