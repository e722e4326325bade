"""The row-wise ops' vector width (the signature part ``vec_bytes``): what the op layer computes
from the call's tensors, what the templates accept for it, and the tile a 128-bit config runs on
rows that admit only 8- or 4-byte accesses. CPU only (nothing is launched)."""
import functools
import random

import pytest
import torch

from mslk_dsl import registry
from mslk_dsl.errors import ConfigError
from mslk_dsl.ops import validate as check
from mslk_dsl.targets import get_target
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _rowwise_plan as plan
from mslk_dsl.templates import _rowwise_space as rowwise_space

bf16, fp32 = torch.bfloat16, torch.float32
ROW_OPS = ("silu_mul", "quantize_fp8_row", "silu_mul_quant", "rmsnorm", "rmsnorm_add", "gather_scale_dense_tokens",
           "scatter_add_dense_tokens", "gather_scale_quant_dense_tokens")


def _at(offset: int, rows: int, cols: int, dtype) -> torch.Tensor:
    """A compact [rows, cols] tensor starting ``offset`` elements past a 64-byte aligned start."""
    return torch.zeros(rows * cols + offset, dtype=dtype)[offset:].view(rows, cols)


@pytest.mark.parametrize("cols, want", [(4096, 16), (4104, 16), (4100, 8), (4, 8), (4098, 4), (2, 4), (4097, 2), (1, 2)])
def test_16_bit_rows_take_the_widest_access_every_row_admits(cols, want):
    assert check.vector_bytes(_at(0, 3, cols, bf16)) == want
    assert limits.contiguous_vector_bytes(cols, 2) == want


def test_the_start_address_counts_as_much_as_the_row_length():
    assert check.vector_bytes(_at(8, 3, 4096, bf16)) == 16
    assert check.vector_bytes(_at(4, 3, 4096, bf16)) == 8       # 8 bytes past a 16-byte boundary
    assert check.vector_bytes(_at(2, 3, 4096, bf16)) == 4       # 4 bytes past it
    assert check.vector_bytes(_at(4, 3, 4100, bf16), _at(2, 3, 4100, bf16)) == 4
    assert check.vector_bytes(_at(1, 3, 4096, bf16)) == 2       # 2 bytes past it: one element
    assert check.vector_bytes(_at(0, 3, 4096, bf16), _at(1, 3, 4096, bf16)) == 2   # every tensor counts


def test_fp32_rows_take_16_or_8_bytes_or_one_element():
    assert check.vector_bytes(_at(0, 3, 1028, fp32)) == 16
    assert check.vector_bytes(_at(0, 3, 1026, fp32)) == 8       # 8-byte rows: two elements per access
    assert check.vector_bytes(_at(2, 3, 1028, fp32)) == 8
    assert check.vector_bytes(_at(1, 3, 1028, fp32)) == 4       # 4 bytes off: one element per access
    assert check.vector_bytes(_at(0, 3, 1025, fp32)) == 4
    assert limits.contiguous_vector_bytes(1026, 4) == 8
    assert limits.contiguous_vector_bytes(1025, 4) == 4


def test_tensors_of_other_dtypes_need_the_same_number_of_elements_per_vector():
    x = _at(0, 3, 4098, bf16)                                   # 4-byte rows: vectors of 2 elements
    assert check.vector_bytes(x, torch.zeros(4098, dtype=fp32)) == 4           # an fp32 weight: 8 bytes each
    assert check.vector_bytes(_at(0, 3, 4100, bf16), torch.zeros(4100, dtype=fp32)) == 8   # 16 bytes each
    assert check.vector_bytes(_at(0, 3, 4100, bf16), torch.zeros(4104, dtype=fp32)[4:]) == 8
    assert check.vector_bytes(_at(0, 3, 4100, bf16), torch.zeros(4102, dtype=fp32)[2:]) == 4   # 8 bytes off
    assert check.vector_bytes(x, torch.zeros(4099, dtype=fp32)[1:]) == 2       # one 4 bytes off: 1 element
    assert check.vector_bytes(x, _at(0, 3, 4098, torch.float8_e4m3fn)) == 4    # FP8 rows: 2 bytes each
    assert check.vector_bytes(_at(0, 3, 4104, bf16), _at(8, 3, 4104, torch.float8_e4m3fn)) == 16
    # 16-byte rows: an fp32 weight is read 16 bytes at a time, so a 16-byte start is enough (no
    # tensor needs more than the address modulo 16 that keys the launch plans).
    assert check.vector_bytes(_at(0, 3, 4096, bf16), torch.zeros(4096 + 4, dtype=fp32)[4:]) == 16
    assert check.vector_bytes(_at(0, 3, 4096, bf16), torch.zeros(4096 + 2, dtype=fp32)[2:]) == 4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_fresh_tensors_get_the_width_the_benchmarks_and_tests_assume(dtype):
    t = getattr(torch, dtype)
    for cols in range(1, 70):
        assert check.vector_bytes(_at(0, 2, cols, t)) == limits.contiguous_vector_bytes(cols, t.itemsize), cols


def test_a_128_bit_config_runs_on_8_and_4_byte_rows_in_more_narrower_accesses():
    config = plan.config(256, 1, 8, 4)
    full = plan.access_tile(config, {"dtype": "bfloat16", "vec_bytes": 16})
    half = plan.access_tile(config, {"dtype": "bfloat16", "vec_bytes": 8})
    word = plan.access_tile(config, {"dtype": "bfloat16", "vec_bytes": 4})
    assert (full.vec, full.chunks) == (8, 4) and (half.vec, half.chunks) == (4, 8) and (word.vec, word.chunks) == (2, 16)
    assert word.tile_k == half.tile_k == full.tile_k and word.tpr == half.tpr == full.tpr
    assert plan.cut_into_words(config, {"dtype": "bfloat16", "vec_bytes": 8})
    assert not plan.cut_into_words(config, {"dtype": "bfloat16", "vec_bytes": 16})
    assert plan.check("silu_mul_cute", config, {"dtype": "bfloat16", "vec_bytes": 4}, arrays=2) == word
    # One element per access takes the one-element configs only, 4-byte rows the 128-bit ones.
    assert not plan.valid(config, {"dtype": "bfloat16", "vec_bytes": 2})
    assert plan.valid(plan.config(256, 1, 1, 8), {"dtype": "bfloat16", "vec_bytes": 2})
    assert not plan.valid(plan.config(256, 1, 1, 8), {"dtype": "bfloat16", "vec_bytes": 4})
    # fp32 rows of 8 bytes cut the config's 4-element vectors in two; of 4 bytes are one element per access.
    assert plan.access_tile(plan.config(256, 1, 4, 4), {"dtype": "float32", "vec_bytes": 8}).vec == 2
    assert plan.valid(plan.config(256, 1, 1, 8), {"dtype": "float32", "vec_bytes": 4})
    assert not plan.valid(plan.config(256, 1, 4, 4), {"dtype": "float32", "vec_bytes": 4})


@pytest.mark.parametrize("op", ["silu_mul", "quantize_fp8_row", "silu_mul_quant", "rmsnorm", "rmsnorm_add"])
def test_one_element_configs_run_phased_rows_in_16_byte_vectors(op):
    """Every single-CTA one-element config (flat tiles aside: they do not read rows) of the CuTe
    templates that take phased rows (_cute_rowwise.PhasedRow) runs their middle in the same tile
    as vectors of at most 16 bytes, and its row groups hold a row's edges (at most 2 (vec - 1)
    elements)."""
    template = _cute(op)
    for dtype in ("bfloat16", "float16", "float32"):
        esize = limits.ELEM_BYTES[dtype]
        sig = {**template.all_signatures()[0], "dtype": dtype, "vec_bytes": esize}
        configs = [c for c in template.all_configs()
                   if template.valid(c, "sm90a", sig) and "cluster" not in c and not plan.RowTile.of(c).flat]
        assert configs, (op, dtype)
        for c in configs:
            tile = plan.access_tile(c, sig)
            phased = plan.phased_tile(tile, esize)
            assert phased.tile_k == tile.tile_k and phased.tpr == tile.tpr, (op, c)
            assert phased.vec * phased.chunks == tile.chunks and 1 < phased.vec * esize <= 16, (op, c)
            assert plan.edge_slots(phased) * phased.tpr >= 2 * (phased.vec - 1), (op, c)
    full = plan.phased_tile(plan.RowTile.of(plan.config(128, 4, 1, 16)), 2)
    assert (full.vec, full.chunks, plan.edge_slots(full)) == (8, 2, 1)
    short = plan.phased_tile(plan.RowTile.of(plan.config(128, 16, 1, 4)), 2)
    assert (short.vec, short.chunks, plan.edge_slots(short)) == (4, 1, 1)


def test_flydsl_row_configs_take_the_rows_widest_vector_or_one_element():
    def ok(vec, vec_bytes, dtype="bfloat16"):
        return rowwise_space.valid({"threads": 256, "rows_per_block": 1, "vec": vec}, "gfx942",
                                   {"dtype": dtype, "vec_bytes": vec_bytes})
    assert ok(8, 16) and ok(1, 16) and not ok(2, 16)
    assert ok(4, 8) and ok(1, 8) and not ok(2, 8) and not ok(8, 8)
    assert ok(2, 4) and ok(1, 4) and not ok(8, 4)
    assert ok(1, 2) and not ok(2, 2)
    assert ok(4, 16, "float32") and ok(1, 4, "float32") and not ok(2, 4, "float32")


@pytest.mark.parametrize("op", ROW_OPS)
def test_every_row_template_serves_every_width_of_its_dtypes(op):
    """Each template declares the widths, leaves out those narrower than an element (fp32 has no
    2-byte rows), and has a valid heuristic pick for every signature it keeps."""
    for template in registry.get_templates(op=op):
        assert template.signatures["vec_bytes"] == limits.VECTOR_WIDTHS, template.name
        sigs = template.all_signatures()
        assert not [s for s in sigs if s["vec_bytes"] < limits.ELEM_BYTES[s["dtype"]]], template.name
        for sig in sigs:
            for target in template.targets:
                problem = {"M": 7, "K": 4098, "N": 4098, "D": 4098, "A": 64, "T": 32}
                config = template.heuristic(target, sig, problem)
                assert template.valid(config, target, sig), (template.name, target, sig, config)


def _cute(op):
    (template,) = registry.get_templates(op=op, backend="cute")
    return template


def test_narrow_rows_take_their_measured_picks():
    """The heuristics' rules for rows of 8- and 4-byte accesses (docs/benchmarks.md, "Rows of
    8-byte accesses" and "MoE gather and scatter on one-element rows: phased"): the quantizers
    read no rest twice; the gather and the linked scatter run such rows phased."""
    big = {"A": 60000, "T": 30000, "D": 5000}
    gather, scatter = _cute("gather_scale_dense_tokens"), _cute("scatter_add_dense_tokens")

    def sig(vec_bytes, dtype="bfloat16", **extra):
        return {"dtype": dtype, "vec_bytes": vec_bytes, "has_valid_count": False, **extra}

    # Rows narrower than 16-byte accesses run phased: the gather at unroll 4, the linked
    # reduction at 2; their atomics keep vector accesses (unroll 4, 1 for few rows)
    for vec_bytes in (2, 4, 8):
        assert gather.heuristic("sm90a", sig(vec_bytes, score_dtype="float32"), big)["unroll"] == 4
        assert gather.heuristic("sm90a", sig(vec_bytes, score_dtype="float32"), {**big, "A": 7})["unroll"] == 1
        assert scatter.heuristic("sm90a", sig(vec_bytes), big) == {"unroll": 2, "method": "linked", "pdl": True}
    assert scatter.heuristic("sm90a", sig(8, "float32"), big)["unroll"] == 2
    assert scatter.heuristic("sm90a", sig(16), big)["unroll"] == 4
    small = {"A": 3000, "T": 3000, "D": 2052}
    assert scatter.heuristic("sm90a", sig(8), small) == {"unroll": 4, "method": "atomic", "pdl": False}
    # Rows of one element per access (phased): the size rule's method, linked at unroll 2 and
    # atomic at unroll 1, every top-k and dtype
    for dtype, vec_bytes in (("bfloat16", 2), ("float16", 2), ("float32", 4)):
        for rows, tokens in ((60000, 30000), (60000, 60000), (80000, 10000)):
            assert scatter.heuristic("sm90a", sig(vec_bytes, dtype), {"A": rows, "T": tokens, "D": 4887}) == {
                "unroll": 2, "method": "linked", "pdl": True}
        assert scatter.heuristic("sm90a", sig(vec_bytes, dtype), {"A": 3000, "T": 3000, "D": 2049}) == {
            "unroll": 1, "method": "atomic", "pdl": False}
    for op in ("quantize_fp8_row", "silu_mul_quant"):
        t = _cute(op)
        qsig = {"dtype": "bfloat16", "vec_bytes": 8, "has_scale_ub": False}
        # 1084 is 6% past the 1024-element tile: the 2048 tile of 2 rows in one pass (the short-row
        # rule), not the 1024 one with its rest read again, nor the 3072 one.
        assert plan.RowTile.of(t.heuristic("sm90a", qsig, {"M": 9000, "K": 1084})).row_k == 2048
        # No streamed rest: 4100, 0.1% past the 4096 tile of 2 rows, takes the fitted 5120 tile,
        # 7248 the 8192 one (not 7168 and its rest read in both passes).
        assert plan.RowTile.of(t.heuristic("sm90a", qsig, {"M": 9000, "K": 4100})).row_k == 5120
        wide = {**qsig, "vec_bytes": 16}
        fitted_4496 = {**plan.config(160, 1, 8, 4), "l1": "keep"}
        if op == "silu_mul_quant":   # staged there (test_silu_mul_quant_stages_16_byte_rows_of_4097_to_5119)
            fitted_4496 = {**plan.config(224, 1, 8, 4), "stage": "smem", "l1": "keep"}
        assert t.heuristic("sm90a", wide, {"M": 9000, "K": 4496}) == fitted_4496
        assert plan.RowTile.of(t.heuristic("sm90a", wide, {"M": 2411, "K": 7248})).row_k >= 7248
        assert plan.RowTile.of(t.heuristic("sm90a", qsig, {"M": 9000, "K": 2404})).row_k == 3072
    # Rows of one element per access keep their own picks: 1030 is 0.6% past a 1024 tile.
    one = {"dtype": "bfloat16", "vec_bytes": 2}
    assert plan.streamed_rest(list(plan.expand([(128, 4, 4)], [(128, 4, 8), (256, 1, 4)])), one, 1030) is None
    assert plan.streamed_rest(list(plan.expand([(128, 4, 4)], [(256, 1, 4)])), {**one, "vec_bytes": 4}, 1030)
    # A cluster's tile streams its rest slowly: 15340 takes the 16384 cluster, not 14336 + rest.
    smq = _cute("silu_mul_quant").heuristic("sm90a", {"dtype": "bfloat16", "vec_bytes": 8, "has_scale_ub": False},
                                            {"M": 9000, "K": 15340})
    assert plan.RowTile.of(smq).row_k == 16384


def test_short_rows_take_their_measured_tiles():
    """Rows of a few hundred to 2000 elements run in the short-row tiles of 2, 4, 8 or 16 rows
    per CTA (docs/benchmarks.md, "Short rows"), not in a 2048-4096-element tile of idle lanes."""
    def tile(op, n, vec_bytes, **extra):
        t = _cute(op)
        sig = {"dtype": "bfloat16", "vec_bytes": vec_bytes, **extra}
        problem = {"M": 100000, "N": n, "K": n}
        c = t.heuristic("sm90a", sig, problem)
        assert c in t.all_configs() and t.valid(c, "sm90a", sig), (op, n, c)
        return (c["threads"], c["rows_per_block"], c["chunks"], c["vec"])

    for op in ("rmsnorm", "rmsnorm_add"):
        norm = functools.partial(tile, op, fp32_weight=False)
        assert norm(128, 16) == (128, 16, 2, 8)      # per-head q / k norms
        assert norm(512, 16) == (128, 8, 4, 8)
        assert norm(722, 4) == (128, 4, 4, 8)
        assert norm(1538, 4) == (128, 4, 8, 8)       # the 2048 tile, not a 1536 one plus a rest
        assert norm(971, 2) == (128, 4, 32, 1)
        assert norm(2100, 16) == (128, 4, 8, 8)      # 2048 plus a streamed rest, as before
    # One element per access at most a quarter past 1024: rmsnorm streams the rest, rmsnorm_add
    # (two inputs read again) takes the 2048 tile.
    assert tile("rmsnorm", 1250, 2, fp32_weight=False) == (128, 4, 32, 1)
    assert tile("rmsnorm", 1309, 2, fp32_weight=False) == (128, 2, 32, 1)
    assert tile("rmsnorm_add", 1250, 2, fp32_weight=False) == (128, 2, 32, 1)
    assert tile("rmsnorm", 1500, 2, fp32_weight=False) == (128, 2, 32, 1)
    # silu_mul maps rows of at most 2 KiB flat (test_flat_configs_read_every_row_width_...)
    for n, vec_bytes in ((128, 16), (722, 4), (826, 4), (379, 2)):
        assert tile("silu_mul", n, vec_bytes) == (256, 1, 4, 8)
    assert tile("silu_mul", 1408, 16) == (128, 2, 3, 8)
    assert tile("silu_mul", 1309, 2) == (128, 1, 16, 1)
    for op in ("quantize_fp8_row", "silu_mul_quant"):
        quant = functools.partial(tile, op, has_scale_ub=False)
        assert quant(96, 16) == (128, 16, 2, 8)
        assert quant(250, 4) == (128, 8, 2, 8)
        assert quant(1826, 4) == (128, 2, 4, 8)     # one pass over a 2048 tile, not the 3072 one
        # silu_mul_quant: MIDDLE_ONE_ELEMENT_PICKS (the test below)
        assert quant(887, 2) == ((128, 4, 16, 1) if op == "silu_mul_quant" else (128, 4, 32, 1))
        assert quant(1987, 2) == (128, 4, 32, 1)     # one element per access: 1024 and the rest
        assert quant(1104, 16) == (128, 2, 4, 8)     # one pass, not the 1024 tile and its rest


def test_short_one_element_rows_take_the_group_tiles():
    """One-element rows of a few hundred elements or fewer (odd per-head and MoE widths) take
    tiles of 8 or 16 lanes a row and 8 or 16 rows per CTA, not a whole warp of idle lanes
    (_rowwise_plan.short_group_pick; docs/benchmarks.md "One-element rows of at most 256
    elements" and "... 8 lanes a row"): (lanes a row, rows per CTA, tile) by row length."""
    eight = {64: (8, 16, 64), 128: (8, 16, 128), 256: (8, 16, 256), 512: (16, 8, 512)}
    sixteen = {64: (8, 16, 64), 128: (16, 8, 128), 256: (16, 8, 256)}
    want = {   # op: (signature extras, tiles by the length they cover, the 64 tile up to 80)
        "rmsnorm": ({"fp32_weight": False}, eight, True),
        "rmsnorm_add": ({"fp32_weight": False}, sixteen, False),
        "quantize_fp8_row": ({"has_scale_ub": False}, eight, True),
        "silu_mul_quant": ({"has_scale_ub": False}, {**eight, 256: (16, 8, 256), 512: None}, True),
    }
    for op, (extra, tiles, rest_past_64) in want.items():
        t = _cute(op)
        for dtype in ("bfloat16", "float16"):
            sig = {"dtype": dtype, "vec_bytes": 2, **extra}
            for n in (1, 45, 64, 65, 75, 80, 81, 128, 129, 201, 256, 257, 423, 512, 513):
                c = t.heuristic("sm90a", sig, {"M": 131072, "N": n, "K": n})
                assert t.valid(c, "sm90a", sig) and c in t.all_configs(), (op, n, c)
                tile = plan.RowTile.of(c)
                covering = min((k for k in tiles if k >= n), default=None)
                expected = tiles[64] if rest_past_64 and n <= 80 else tiles.get(covering) if covering else None
                if expected is None:   # past the group tiles: the template's earlier tiles
                    if op == "silu_mul_quant" and n > 512:   # its rows of 513-1024: the test below
                        continue
                    assert not plan.short_scalar_groups(c), (op, n, c)
                else:
                    assert (tile.tpr, tile.rows_per_block, tile.row_k) == expected, (op, n, c)
    # 16-byte rows of 128 elements keep their vector tiles
    vec = _cute("rmsnorm").heuristic("sm90a", {"dtype": "bfloat16", "vec_bytes": 16, "fp32_weight": False},
                                     {"M": 131072, "N": 128})
    assert vec["vec"] == 8


def test_one_element_rows_take_their_measured_tiles():
    """Rows of one element per access past 1024 elements (docs/benchmarks.md, "One-element rows:
    the phased path in a kernel of its own"): tiles of at most 256 threads, the rest of a longer
    row read again, rather than the covering tile of a 512-thread CTA."""
    def tile(op, n, **extra):
        t = _cute(op)
        sig = {"dtype": "bfloat16", "vec_bytes": 2, **extra}
        c = t.heuristic("sm90a", sig, {"M": 10000, "N": n, "K": n})
        assert c in t.all_configs() and t.valid(c, "sm90a", sig), (op, n, c)
        return (c["threads"], c["rows_per_block"], c["chunks"])

    norm = functools.partial(tile, "rmsnorm", fp32_weight=False)
    assert norm(3631) == (128, 2, 32)        # 2048 and the rest, not the covering 4096 tile
    assert norm(4853) == (128, 2, 32)
    assert norm(5911) == (256, 1, 32)        # 8192 in 256 threads, not 512
    assert norm(15885) == (256, 1, 32)       # 8192 and the rest, not 16384 in 512 threads
    assert norm(20001) == (512, 1, 32)       # past 16384: the single CTA / cluster rule as before
    add = functools.partial(tile, "rmsnorm_add", fp32_weight=False)
    assert add(3631) == (256, 1, 16)         # two inputs read again: the covering tiles
    assert add(5911) == (256, 1, 32)
    assert add(15885) == (512, 1, 32)
    assert tile("silu_mul", 4279) == (160, 1, 32)    # the fitted 5120 tile in one pass (FITTED_ROWS)
    assert tile("silu_mul", 8625) == (128, 1, 16)    # past them: 5 x 2048 leaves 1615 lanes idle, 3 x 4096 3663
    assert tile("silu_mul", 15885) == (256, 1, 16)   # 499 idle in both: the 4096 tile
    quant = functools.partial(tile, "quantize_fp8_row", has_scale_ub=False)
    assert quant(1085) == (128, 4, 16)
    assert quant(1633) == (128, 4, 32)
    assert quant(3631) == (128, 2, 32)
    smq = functools.partial(tile, "silu_mul_quant", has_scale_ub=False)
    assert smq(1129) == (128, 4, 16)
    assert smq(2043) == (128, 4, 32)
    assert smq(3631) == (256, 1, 16)
    # silu_mul_quant, 2049-4096: the staged 4096 tile (four CTAs per SM against three)
    staged = _cute("silu_mul_quant").heuristic("sm90a", {"dtype": "bfloat16", "vec_bytes": 2, "has_scale_ub": False},
                                               {"M": 10000, "K": 2051})
    assert staged == plan.config(256, 1, 1, 16) | {"stage": "smem", "l1": "keep"}
    assert quant(2051) == (128, 2, 32)       # quantize_fp8_row keeps its 2-row 2048 tile there

    # 4097-16384: the staged tile covering the row with the fewest idle lanes (docs/benchmarks.md,
    # "Staged tiles"); past that the register tiles as before
    assert quant(5711) == smq(5711) == (256, 1, 32)
    assert quant(8625) == (256, 1, 64)
    assert smq(8625) == (256, 1, 48)
    assert quant(14461) == smq(14461) == (256, 1, 64)
    assert quant(20001) == (256, 1, 16)      # 5 x 4096 leaves 479 lanes idle, 3 x 8192 4575
    assert smq(20001) == (256, 1, 16)


def test_silu_mul_quant_stages_16_byte_rows_of_4097_to_5119():
    """silu_mul_quant's 16-bit rows of 16-byte accesses of 4097-5119 elements take the staged 224 x 4
    tile with the default L1 policy (STAGED_MIDDLE_ROWS); 5120 (the register tile's whole row), the
    rows past it, fp32 rows and quantize_fp8_row keep their picks."""
    from mslk_dsl.templates import silu_mul_quant_cute

    pick = silu_mul_quant_cute.STAGED_MIDDLE_PICK
    assert pick == plan.config(224, 1, 8, 4) | {"stage": "smem", "l1": "keep"}
    smq, quant = _cute("silu_mul_quant"), _cute("quantize_fp8_row")
    for dtype in ("bfloat16", "float16"):
        sig = {"dtype": dtype, "vec_bytes": 16, "has_scale_ub": False}
        for k in (4104, 4200, 4496, 5112):
            assert smq.heuristic("sm90a", sig, {"M": 1000, "K": k}) == pick, (dtype, k)
            assert smq.valid(pick, "sm90a", sig)
            assert quant.heuristic("sm90a", sig, {"M": 1000, "K": k}) != pick, (dtype, k)
        for k in (4096, 5120, 5336, 7160, 8192):
            assert smq.heuristic("sm90a", sig, {"M": 1000, "K": k}) != pick, (dtype, k)
    fp32 = {"dtype": "float32", "vec_bytes": 16, "has_scale_ub": False}
    assert smq.heuristic("sm90a", fp32, {"M": 1000, "K": 4496}) != pick


def test_fewest_idle_lanes_counts_every_pass():
    tiles = [plan.config(256, 1, 1, 32), plan.config(256, 1, 1, 16)]   # 8192, 4096
    assert plan.fewest_idle_lanes(tiles, 8625) == tiles[1]
    assert plan.fewest_idle_lanes(tiles, 14461) == tiles[0]          # a tie: the first listed
    assert plan.fewest_idle_lanes(tiles, 8192) == tiles[0]
    assert plan.fewest_idle_lanes(tiles, 4000) == tiles[1]


def _flydsl(op):
    (template,) = registry.get_templates(op=op, backend="flydsl")
    return template


def _lanes_per_row(config) -> int:
    return config["threads"] // config.get("rows_per_block", config.get("rows"))


@pytest.mark.parametrize("op", ["silu_mul", "quantize_fp8_row", "silu_mul_quant", "rmsnorm", "rmsnorm_add"])
def test_flydsl_short_rows_take_sub_wave_groups(op):
    """Rows of a few hundred elements get 16 or 32 lanes of a wave each (several rows per wave),
    not a whole wave with most lanes idle; rows of 2048 elements and more keep whole waves."""
    template = _flydsl(op)
    for sig in template.all_signatures():
        lanes_per_vector = limits.vector_elems(sig)
        for n in (64, 96, 128, 200, 256, 300, 512, 1024, 2048, 4096):
            for target in template.targets:
                config = template.heuristic(target, sig, {"M": 4096, "K": n, "N": n})
                assert template.valid(config, target, sig), (op, sig, n, config)
                lanes = _lanes_per_row(config)
                if n >= 2048:
                    assert lanes >= 64, (op, sig, n, config)
                elif n <= 128 and lanes_per_vector > 1:
                    assert lanes == 16, (op, sig, n, config)   # 16 lanes of 4-8 elements per vector cover 128


def test_gathered_rows_keep_whole_waves():
    """A wave's sub-wave groups share one buffer descriptor over consecutive rows, so the gather
    quantizer, whose rows are token rows picked by index, never takes them."""
    template = _flydsl("gather_scale_quant_dense_tokens")
    assert all(_lanes_per_row(c) >= 64 for c in template.all_configs())
    for sig in template.all_signatures():
        for d in (64, 128, 300, 4096):
            config = template.heuristic("gfx942", sig, {"D": d})
            assert _lanes_per_row(config) >= 64 and template.valid(config, "gfx942", sig), (sig, d, config)
    assert not rowwise_space.whole_groups({"threads": 256, "rows_per_block": 8 * 4})   # 8 lanes a row
    assert rowwise_space.whole_groups({"threads": 512, "rows_per_block": 16})          # 32 lanes a row


def _pick(cond, a, b):
    return a if cond else b


@pytest.mark.parametrize("in_bytes, out_bytes", [(2, 2), (2, 1), (4, 4), (4, 1), (2, 4)])
@pytest.mark.parametrize("group", [16, 32, 64])
def test_flydsl_phased_rows_cover_every_column_once_in_aligned_vectors(in_bytes, out_bytes, group):
    """The FlyDSL phased rows' index arithmetic (``_rowwise_space.phased_split`` /
    ``phased_offsets`` / ``phase_of`` / ``congruent_phases``, which the kernels call on Int32
    values), replayed on Python ints for the waves of a grid: every column of every row is
    reached exactly once, each middle vector at a 16-byte aligned address of its own row, each
    edge element at its own column, with descriptors shared by a wave's rows and accesses only
    inside the rows. Tensors of different element sizes (bf16 -> fp8; an fp32 residual beside
    bf16 x, whose 32-byte middle vectors are two 16-byte accesses) split each row at the same
    columns."""
    rng = random.Random(in_bytes * 100 + out_bytes * 10 + group)
    vec = limits.VECTOR_BYTES // in_bytes
    for _ in range(60):
        cols = rng.choice([1, 3, vec - 1, vec + 1, 2 * vec - 1, rng.randint(1, 700)])
        rows = rng.randint(1, 9)
        shift = rng.randrange(16 // in_bytes)  # elements past a 16-byte boundary: any phase
        tensors = {"in": (4096 + shift * in_bytes, in_bytes), "out": (8192 + shift * out_bytes, out_bytes)}
        phases = {name: rowwise_space.phase_of(addr, vec, size) for name, (addr, size) in tensors.items()}
        phase = phases["in"]
        # fresh tensors at one offset are congruent (modulo a wider element's 16-byte vectors)
        assert rowwise_space.congruent_phases(phase, in_bytes, phases["out"], out_bytes, vec), phases
        for name, (addr, size) in tensors.items():
            seen = []
            rows_per_wave = max(1, 64 // group)
            for wave_first in range(0, rows, rows_per_wave):
                wave_rows = range(wave_first, min(rows, wave_first + rows_per_wave))
                for row in wave_rows:
                    for lane in range(group):
                        head, nmid, edge_col = rowwise_space.phased_split(phase, row, cols, vec, lane, _pick)
                        lead, offset, start = rowwise_space.phased_offsets(phase, wave_first, row, head, cols, vec)
                        base = addr + (wave_first * cols - lead) * size  # the wave's descriptor
                        wave_start = addr + wave_first * cols * size
                        assert base % min(vec * size, 16) == 0 and wave_start - vec * size < base <= wave_start
                        assert edge_col == cols or (edge_col < head or edge_col >= head + nmid * vec)
                        if edge_col < cols:
                            at = base + (offset + edge_col) * size
                            assert at == addr + (row * cols + edge_col) * size
                            seen.append((row, edge_col))
                        # a tensor of wider elements takes `parts` 16-byte accesses per middle
                        # vector: PhasedView(parts) numbers them from start * parts
                        parts = max(1, vec * size // 16)
                        for j in range(lane, nmid, group):   # this lane's middle vectors
                            at = base + (start * parts + j * parts) * (vec // parts) * size
                            assert at % min(vec * size, 16) == 0
                            col = (at - addr) // size - row * cols
                            assert col == head + j * vec and col + vec <= cols
                            for p in range(parts):
                                assert (at + p * (vec // parts) * size) % 16 == 0 or vec * size < 16
                            seen.extend((row, col + i) for i in range(vec))
            assert sorted(seen) == [(r, c) for r in range(rows) for c in range(cols)], (name, cols, phase)


def test_staged_tiles_hold_a_row_in_shared_memory_within_the_budget():
    """A staged tile (the ``stage`` key): one CTA per row, not a cluster, its inputs within
    STAGED_SMEM_BYTES; its registers are those its CTAs per SM leave; a one-element staged
    config's kernel for rows that are not congruent runs a register tile of at most 16 elements."""
    bf16, fp32 = {"dtype": "bfloat16", "vec_bytes": 16}, {"dtype": "float32", "vec_bytes": 16}
    c = {**plan.config(256, 1, 8, 8), "stage": "smem"}
    assert plan.valid(c, bf16, arrays=2)                   # 16384 x 2 inputs x 2 bytes = 64 KiB
    assert plan.valid({**plan.config(256, 1, 4, 8), "stage": "smem"}, fp32, arrays=2)    # 8192 fp32: 64 KiB
    assert not plan.valid({**plan.config(256, 1, 4, 16), "stage": "smem"}, fp32, arrays=2)   # 128 KiB
    assert not plan.valid({**c, "cluster": 2}, bf16, arrays=2)
    assert not plan.valid({**plan.config(256, 2, 8, 4), "stage": "smem"}, bf16, arrays=2)
    assert not plan.valid({**c, "stage": "tmem"}, bf16, arrays=2)
    tile = plan.RowTile.of(c)
    assert tile.staged and plan.plain_tile(tile) == tile
    sm90 = get_target("sm90a").limits
    assert plan.staged_registers(tile, 2, 2, sm90) == 80          # 64 KiB: three CTAs of 256 per SM
    assert plan.staged_registers(plan.RowTile.of({**plan.config(256, 1, 8, 4), "stage": "smem"}), 2, 2, sm90) == 64
    scalar = plan.RowTile.of({**plan.config(256, 1, 1, 64), "stage": "smem"})
    assert plan.plain_tile(scalar) == plan.RowTile(256, 1, 1, 16)
    assert plan.phased_tile(scalar, 2).staged and plan.phased_tile(scalar, 2).tile_k == 16384
    one = {"dtype": "bfloat16", "vec_bytes": 2}
    picks = [{**plan.config(256, 1, 1, 32), "stage": "smem"}, {**plan.config(256, 1, 1, 64), "stage": "smem"}]
    assert plan.staged_pick(picks, one, 4096, 1, 4097) is None       # below the threshold
    assert plan.staged_pick(picks, one, 5000, 1, 4097) == picks[0]
    assert plan.staged_pick(picks, one, 9000, 1, 4097) == picks[1]
    assert plan.staged_pick(picks, one, 16385, 1, 4097) is None      # no staged tile covers it
    # thresholds: vector rows by their bytes (fp32: half the elements), one-element rows by elements
    assert plan.staged_from(bf16, 7168, 4097) == 7168 and plan.staged_from(fp32, 7168, 4097) == 3584
    assert plan.staged_from(fp32, 8193, 4097) == 4097
    assert plan.staged_from(one, 7168, 4097) == plan.staged_from({"dtype": "float32", "vec_bytes": 4}, 7168, 4097) == 4097



@pytest.mark.parametrize("element_bytes, weight_bytes", [(2, 16), (2, 32), (4, 32), (4, 16)])
def test_shifted_words_move_any_offset_into_place(element_bytes, weight_bytes):
    """Bytes at a run-time offset read as 16-byte loads and moved into place
    (``_word_shift.shifted_words``: rmsnorm's "vectors" weight, the MoE gather's phased rows),
    run on integers with the kernel's select and funnel shift: for every offset an element can
    start at, the words are the bytes from that offset. 16-byte loads of 2-byte elements (16
    bytes under a vector of 8 bf16) and of 4-byte ones (an fp32 weight: 32 bytes under 8 bf16
    values; an fp32 gather row: 16 bytes under 4)."""
    from mslk_dsl.templates._word_shift import shifted_words

    def select(cond, a, b):
        return a if cond else b

    def funnel_right(lo, hi, bits):   # PTX shf.r.wrap.b32 d, lo, hi, bits
        return ((hi << 32 | lo) >> bits) & 0xFFFFFFFF

    rng = random.Random(7)
    loads = weight_bytes // 16 + 1
    for _ in range(20):
        data = bytes(rng.randrange(256) for _ in range(16 * loads))
        words = [int.from_bytes(data[4 * i:4 * i + 4], "little") for i in range(4 * loads)]
        for offset in range(0, 16, element_bytes):
            got = shifted_words(words, offset, weight_bytes // 4, select,
                                       funnel_right if element_bytes == 2 else None)
            want = [int.from_bytes(data[offset + 4 * m:offset + 4 * m + 4], "little")
                    for m in range(weight_bytes // 4)]
            assert got == want, (offset, got, want)


def test_weight_vector_configs_are_valid_where_their_twins_are_and_rmsnorm_takes_them():
    """The "vectors" weight configs (rmsnorm, rmsnorm_add: single-CTA one-element tiles of 16-bit
    rows; the 8192 and 16384 tiles also with a register cap, same-dtype weight only) are valid
    where their plain twins are. rmsnorm's heuristic takes the twin of its pick on one-element rows
    of a 16-bit x and a same-dtype weight where the tile holds 2048 elements or more (the 8192
    tile capped); rmsnorm_add, fp32 rows, an fp32 weight and vector rows never take one."""
    from mslk_dsl.templates import _rowwise_plan as plan

    for op in ("rmsnorm", "rmsnorm_add"):
        (t,) = registry.get_templates(op=op, backend="cute")
        vectors = [c for c in t.all_configs() if c.get("weight") == "vectors"]
        assert vectors and all(c["vec"] == 1 and "cluster" not in c for c in vectors)
        for sig in t.all_signatures():
            for c in vectors:
                plain = {k: v for k, v in c.items() if k not in ("weight", "regs")}
                assert t.valid(c, "sm90a", sig) == (t.valid(plain, "sm90a", sig)
                                                    and limits.ELEM_BYTES[sig["dtype"]] == 2
                                                    and not ("regs" in c and sig["fp32_weight"])), (op, sig, c)
                assert t.valid(plain | {"regs": 64}, "sm90a", sig) is False   # a cap only with the key
            takes = (op == "rmsnorm" and limits.one_element(sig) and limits.ELEM_BYTES[sig["dtype"]] == 2
                     and not sig["fp32_weight"])
            for n in (1, 9, 771, 1037, 1085, 3631, 4097, 4853, 5911, 6001, 7929, 12289, 16383, 33001):
                config = t.heuristic("sm90a", sig, {"M": 30000, "N": n})
                assert t.valid(config, "sm90a", sig), (op, sig, n, config)
                plain = {k: v for k, v in config.items() if k not in ("weight", "regs")}
                twin_wanted = (takes and "cluster" not in config and plan.RowTile.of(plain).row_k >= 2048)
                assert (config.get("weight") == "vectors") == twin_wanted, (op, sig, n, config)
                if twin_wanted and plain["threads"] == 256 and plain["chunks"] == 32:
                    assert config.get("regs") == 64, (op, sig, n, config)


def test_word_rows_in_the_phased_range_run_the_one_element_kernels_on_cute(monkeypatch):
    """silu_mul, quantize_fp8_row and silu_mul_quant give rows of 8- or 4-byte accesses of a 16-bit
    dtype the one-element signature (the CuTe kernels run them phased) where K is in the op's
    PHASED_WORD_ROWS range and every [M, K] tensor is 16-byte aligned; outside it, unaligned,
    fp32 or on a FlyDSL target they keep the widest access."""
    from mslk_dsl.ops import elementwise

    fp8 = torch.float8_e4m3fn
    target = {"name": "sm90a"}
    monkeypatch.setattr(elementwise, "target_of", lambda device: get_target(target["name"]))

    def width(op, k, offset=0, dtype=bf16):
        x = _at(offset, 3, k, dtype)
        rows = (x, _at(0, 3, k, fp8)) if op == "quantize_fp8_row" else (x, _at(0, 3, k, dtype), _at(0, 3, k, dtype))
        if op == "silu_mul_quant":
            rows = rows[:2] + (_at(0, 3, k, fp8),)
        return elementwise._access_bytes(op, *rows)

    for op, (low, high) in elementwise.PHASED_WORD_ROWS.items():
        inside = [k for k in (low + 1, low + 3, (low + high) // 2, high - 2, high - 4) if k % 2 == 0 and k % 8]
        outside = [k for k in (low - 3, low - 7, high + 2, high + 4) if k % 2 == 0 and k % 8]
        assert inside and outside
        for k in inside:
            assert width(op, k) == 2, (op, k)
            assert width(op, k, offset=2) == 4, (op, k)            # x 4 bytes past a 16-byte boundary
            assert width(op, k, dtype=fp32) == limits.contiguous_vector_bytes(k, 4), (op, k)
        for k in outside:
            assert width(op, k) == limits.contiguous_vector_bytes(k, 2) in (4, 8), (op, k)
        assert width(op, low + 7 - (low + 7) % 8 + 8) == 16         # 16-byte rows keep 16
        assert width(op, low | 1) == 2                              # odd rows: one element anyway
        target["name"] = "gfx942"
        assert width(op, inside[0]) == limits.contiguous_vector_bytes(inside[0], 2)
        target["name"] = "sm90a"


def test_silu_mul_takes_its_fitted_one_element_tiles_for_16_bit_rows_of_2049_to_8192():
    """silu_mul's FITTED_SCALAR_ROWS (32 single elements a thread) are valid configs for one-element
    rows of every dtype; the heuristic takes the one that covers a 16-bit row of FITTED_ROWS in one
    pass with the fewest idle lanes, and none of them for other rows or for fp32."""
    from mslk_dsl.templates import silu_mul_cute

    t = _cute("silu_mul")
    fitted = [plan.config(threads, rows, 1, chunks) for threads, rows, chunks in silu_mul_cute.FITTED_SCALAR_ROWS]
    assert all(c in t.all_configs() for c in fitted)
    low, high = silu_mul_cute.FITTED_ROWS
    for sig in t.all_signatures():
        assert all(t.valid(c, "sm90a", sig) == limits.one_element(sig) for c in fitted), sig
        takes_fitted = limits.one_element(sig) and sig["dtype"] != "float32"
        for k in (1, 13, 2047, 2048, 2049, 3001, 3072, 3073, 4279, 5699, 7929, 8192, 8193, 16383, 40001):
            pick = t.heuristic("sm90a", sig, {"M": 100, "K": k})
            if not (takes_fitted and low <= k <= high):
                assert pick not in fitted, (sig, k)
                continue
            row_k = plan.RowTile.of(pick).row_k
            assert pick in fitted and row_k >= k, (sig, k, pick)
            # the smallest covering one: 32 elements a thread, whole warps of 32 threads
            assert row_k - k < 1024, (sig, k, pick)
    assert plan.RowTile.of(t.heuristic("sm90a", {"dtype": "bfloat16", "vec_bytes": 2}, {"M": 8, "K": 4279})).row_k == 5120


def test_silu_mul_quant_takes_16_lanes_on_one_element_rows_of_513_to_1024():
    """silu_mul_quant_cute.MIDDLE_ONE_ELEMENT_PICKS: 16-bit one-element rows of 513-768 take the
    256 tile of 8 rows a CTA, 769-1024 the 512 tile of 4, not the one-warp 1024 tile; the rows
    around them and fp32 rows keep their picks."""
    t = _cute("silu_mul_quant")
    shape = lambda c: (c["threads"], c["rows_per_block"], c["chunks"], c["vec"])  # noqa: E731
    for dtype in ("bfloat16", "float16"):
        sig = {"dtype": dtype, "vec_bytes": 2, "has_scale_ub": False}
        for k, want in ((513, (128, 8, 16, 1)), (757, (128, 8, 16, 1)), (768, (128, 8, 16, 1)),
                        (769, (128, 4, 16, 1)), (1019, (128, 4, 16, 1))):
            assert shape(t.heuristic("sm90a", sig, {"M": 50000, "K": k})) == want, (dtype, k)
        assert shape(t.heuristic("sm90a", sig, {"M": 50000, "K": 511})) == (128, 4, 16, 1)
    fp32 = {"dtype": "float32", "vec_bytes": 4, "has_scale_ub": False}
    assert shape(t.heuristic("sm90a", fp32, {"M": 50000, "K": 757})) == (128, 4, 32, 1)


def test_flat_configs_read_every_row_width_in_16_byte_vectors():
    """silu_mul's flat tiles serve every signature (odd rows included: the flat array is read in
    16-byte vectors whatever the row length), are never cut into narrower accesses, and their
    launches fall back to a row config that serves the signature. The heuristic takes them for
    rows of at most 2 KiB."""
    template = _cute("silu_mul")
    flat = [c for c in template.all_configs() if plan.RowTile.of(c).flat]
    assert flat
    for sig in template.all_signatures():
        elem = limits.ELEM_BYTES[sig["dtype"]]
        served = [c for c in flat if template.valid(c, "sm90a", sig)]
        assert served, sig
        for c in served:
            tile = plan.check(template.name, c, sig, 2)
            assert tile.flat and tile.vec * elem == 16, c
        fallback = plan.flat_fallback(sig)
        assert plan.valid(fallback, sig, 2) and not plan.RowTile.of(fallback).flat, sig
    bf16_odd = {"dtype": "bfloat16", "vec_bytes": 2}
    for k in (1, 69, 1023, 1024):
        assert plan.RowTile.of(template.heuristic("sm90a", bf16_odd, {"M": 9, "K": k})).flat, k
    assert not plan.RowTile.of(template.heuristic("sm90a", bf16_odd, {"M": 9, "K": 1025})).flat
    assert plan.RowTile.of(template.heuristic("sm90a", {"dtype": "float32", "vec_bytes": 16}, {"M": 9, "K": 512})).flat
    assert not plan.RowTile.of(template.heuristic("sm90a", {"dtype": "float32", "vec_bytes": 16}, {"M": 9, "K": 516})).flat


def test_a_wider_tensor_is_congruent_with_x_where_its_phase_is_x_phase_modulo_its_own():
    """The congruence of the phased rows (CuTe and FlyDSL) for tensors of wider elements than
    x's (``_rowwise_space.congruent_phases``: an fp32 residual beside 16-bit x, its phase
    compared with x's modulo the 4 fp32 elements of 16 bytes), replayed on addresses: where it
    holds, the fp32 tensor's element at the head of every row's middle (x's first 16-byte
    boundary of that row) and at every middle vector after it sits on a 16-byte boundary; where
    it does not, some row's middle is misaligned in it, so a test on equal phases would have
    refused calls that the phased kernels serve (x 8 bytes past a boundary, the residual on
    one). A tensor whose vectors align on more elements than the first's is refused."""
    def phase(addr, esize, vec=8):
        return rowwise_space.phase_of(addr, vec, esize)

    def rule(x_addr, r_addr):
        return rowwise_space.congruent_phases(phase(x_addr, 2), 2, phase(r_addr, 4), 4, 8)

    with pytest.raises(ConfigError, match="never congruent"):   # fp32 first, 16-bit other: never
        rowwise_space.congruent_phases(0, 4, 0, 2, 8)
    for x_shift in range(8):               # x's elements past a 16-byte boundary
        for r_shift in range(4):           # the fp32 tensor's
            x_addr, r_addr = 4096 + 2 * x_shift, 8192 + 4 * r_shift
            congruent = rule(x_addr, r_addr)
            for cols in (1, 3, 7, 8, 13, 4097):
                aligned = True
                for row in range(9):
                    head = phase(x_addr + 2 * row * cols, 2)
                    nmid = max(0, cols - head) // 8
                    for j in range(nmid):
                        assert (x_addr + 2 * (row * cols + head + 8 * j)) % 16 == 0
                        aligned &= (r_addr + 4 * (row * cols + head + 8 * j)) % 16 == 0
                if cols >= 16:                # rows long enough for middles in every row
                    assert aligned == congruent, (x_shift, r_shift, cols)
                else:
                    assert aligned or not congruent, (x_shift, r_shift, cols)
    # the layouts of the GPU test (ODD_ROW_LAYOUTS): congruent at offsets (0, 0), (4, 0), (1, 1)
    assert [rule(4096 + 2 * x, 4096 + 4 * r)
            for x, r in ((0, 0), (4, 0), (1, 1), (0, 1), (2, 3))] == [True, True, True, False, False]
