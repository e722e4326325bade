"""The benchmarks' random shapes (CPU): ``tools/bench.py membound --random N --seed S`` draws
hidden sizes in every access class and sizes over the whole range, the same for a seed;
``grouped_gemm --random`` draws MoE expert GEMMs over every layer and T from decode to prefill."""
import os
import sys

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)

import bench_grouped_gemm as grouped  # noqa: E402
import bench_membound as membound  # noqa: E402
import bench_phased_rows as phased  # noqa: E402
import pytest  # noqa: E402


def _access_class(d: int) -> int:
    """The widest access (bytes) a 16-bit row of ``d`` elements admits."""
    return next(w for w in (16, 8, 4, 2) if d % (w // 2) == 0)


def test_membound_draws_every_access_class_over_the_whole_range():
    shapes = membound.random_shapes(400, seed=11)
    assert shapes == membound.random_shapes(400, seed=11) != membound.random_shapes(400, seed=12)
    classes = [_access_class(d) for d, _ in shapes]
    assert classes[:4] == [16, 8, 4, 2] and {classes.count(w) for w in (16, 8, 4, 2)} == {100}
    hidden, mib = [d for d, _ in shapes], [m for _, m in shapes]
    assert min(hidden) >= 1 and max(hidden) <= membound.RANDOM_HIDDEN[1] + 8
    assert min(hidden) < 128 and max(hidden) > 8192          # log-uniform: both ends are reached
    assert membound.RANDOM_MIB[0] <= min(mib) < 8 and 2048 < max(mib) <= membound.RANDOM_MIB[1]
    for d, m in shapes:   # each op's rows move the drawn bytes, within the row clamp
        rows = membound.shape_rows("silu_mul_quant", d, m)
        assert 1 <= rows <= membound.MAX_ROWS
        if rows < membound.MAX_ROWS:
            moved = rows * membound._bytes_per_row("silu_mul_quant", d, 2) / 2**20
            assert abs(moved - m) <= membound._bytes_per_row("silu_mul_quant", d, 2) / 2**20


def test_membound_counts_an_fp32_residual_stream_in_its_own_bytes():
    # rmsnorm_add moves x and the residual in, y and the new residual out: with bf16 x and an fp32
    # residual that is 2 + 4 + 2 + 4 bytes an element, not the 8 of an all-bf16 call
    assert membound._bytes_per_row("rmsnorm_add", 1000, 2) == 8000
    assert membound._bytes_per_row("rmsnorm_add", 1000, 2, 4) == 12000
    assert membound._bytes_per_row("rmsnorm", 1000, 2, 4) == 4000     # no residual: unchanged
    rows = membound.shape_rows("rmsnorm_add", 1000, 120.0, 2, 4)
    assert abs(rows * 12000 / 2**20 - 120.0) <= 12000 / 2**20
    assert (membound.sizes("rmsnorm_add", (64,), 2, 4)[0][0] * 3
            == pytest.approx(membound.sizes("rmsnorm_add", (64,), 2)[0][0] * 2, rel=1e-3))


def test_membound_summary_names_the_worst_shapes():
    rows = [{"op": "rmsnorm", "rows": r, "hidden": 4096, "MiB": 4.0 * r, "% copy": pct, "vs peer": vs,
             "best peer": "quack"} for r, pct, vs in ((1, 90.0, 1.10), (2, 40.0, 0.80), (3, 95.0, 0.0))]
    lines = membound.summary(rows, worst=1)
    assert lines[0].startswith("rmsnorm: 3 shapes") and "min 40.0" in lines[0]
    assert "behind at 1 of 2" in lines[0] and "min 0.800" in lines[0]
    assert lines[1].strip().startswith("2 x 4096") and len(lines) == 2
    # the goal bands: 4-12 MiB is in none; 16-64 MiB holds all three at 16 MiB a row (goal 85,
    # missed); no point reaches 256 MiB
    assert "MiB min" not in lines[0]
    banded = membound.summary([{**r, "MiB": 16.0 * r["rows"]} for r in rows])[0]
    assert "[16-64 MiB min 40.0 of 3 (missed 85)]" in banded and "256 MiB" not in banded
    big = [{**rows[0], "MiB": 300.0, "% copy": 96.0}]
    assert "[>= 256 MiB min 96.0 of 1 (met 95)]" in membound.summary(big)[0]


def test_membound_summary_compares_the_heuristic_with_the_configs_timed():
    rows = [{"op": "rmsnorm", "rows": 100, "hidden": h, "MiB": 1.0, "% copy": 90.0, "vs peer": None,
             "best peer": None, "us graph": us, "configs": {"a": fastest, "b": 50.0}}
            for h, us, fastest in ((75, 10.0, 10.0), (93, 10.05, 10.0), (163, 12.0, 10.0))]
    lines = membound.summary(rows, worst=0)
    assert lines[1] == ("    heuristic within 1% of the fastest config near the row at 2 of 3; "
                        "furthest behind: 100 x 163 1.200x (a)")
    assert len(membound.summary([{**r, "configs": {}} for r in rows], worst=0)) == 1


def test_grouped_draws_cover_the_layers_decode_and_prefill():
    cases = grouped.draw(300, seed=5)
    assert cases == grouped.draw(300, seed=5) != grouped.draw(300, seed=6)
    layers = {name: (experts, top_k, d, h) for name, experts, top_k, d, h in grouped.MOE_LAYERS}
    assert {c[0] for c in cases} == set(layers)
    for name, tokens, experts, top_k, proj, n, k in cases:
        e, t, d, h = layers[name]
        assert (experts, top_k) == (e, t) and (n, k) == ((2 * h, d) if proj == "gate_up" else (d, h))
        assert 1 <= tokens <= grouped.T_MAX and n % 8 == 0 and k % 16 == 0   # the ops' alignment
    tokens = [c[1] for c in cases]
    assert min(tokens) < 4 and max(tokens) > grouped.T_MAX // 2         # log-uniform: both ends
    assert sum(t <= 128 for t in tokens) > 100                          # about half is decode
    assert min(c[1] for c in grouped.draw(100, seed=5, t_min=256)) >= 256
    # sorted so that one layer's weights are made once
    keys = [(c[0], c[4]) for c in cases]
    assert keys == sorted(keys)


def test_membound_configs_near_a_row_are_ones_its_call_accepts():
    """``membound --configs`` times each config by calling the op with it on fresh rows, so every
    config it names must be valid for the signature that call computes: on rows of 8- or 4-byte
    accesses that the op runs phased (elementwise.runs_phased), the one-element configs."""
    from mslk_dsl import registry
    from mslk_dsl.ops.elementwise import runs_phased
    from mslk_dsl.templates._kernel_limits import contiguous_vector_bytes

    for op in ("silu_mul", "quantize_fp8_row", "silu_mul_quant", "rmsnorm"):
        (template,) = registry.get_templates(op=op, backend="cute")
        for d in (4096, 4098, 4100, 4097, 8194, 10054, 30002, 50002):
            width = contiguous_vector_bytes(d, 2)
            if runs_phased(op, d, 2, width):
                width = 2
            sig = next(s for s in template.all_signatures() if s["dtype"] == "bfloat16" and s["vec_bytes"] == width
                       and not s.get("has_scale_ub") and not s.get("fp32_weight"))
            near = membound._configs_near(op, d)
            assert near or d > 16384, (op, d)   # (past 16K a quantizer may have no tile of 0.4-2.5x the row)
            assert all(template.valid(c, "sm90a", sig) for c in near), (op, d)


def test_membound_configs_near_a_row_for_every_op():
    """Every op of the sweep can name its configs near a row (the MoE ops' configs are no row
    tiles), and silu_mul's include its flat tiles whatever the row."""
    from mslk_dsl.templates import _rowwise_plan as plan

    for op in membound.OPS + membound.EXTRA_OPS:
        for d in (69, 700, 4096):
            near = membound._configs_near(op, d)
            assert near or op == "gather_quant_k2", (op, d)   # (no tile of its within 2.5x a 69-element row)
            if op == "silu_mul":
                assert any(plan.RowTile.of(c).flat for c in near), d


def test_phased_rows_draws_word_rows_in_range_and_keeps_the_routing_table():
    """``phased_rows --random`` draws only rows of 8- or 4-byte accesses (K even, not a multiple of
    8) in --k-range, both widths, the same for a seed; its cut side empties the routing table only
    while it runs; a K the comparison does not apply to is refused before anything runs."""
    from mslk_dsl.ops import elementwise

    shapes = phased.random_shapes(200, seed=3, k_range=(2049, 8192))
    assert shapes == phased.random_shapes(200, seed=3, k_range=(2049, 8192)) != phased.random_shapes(200, 4, (2049, 8192))
    assert all(k % 2 == 0 and k % 8 and 2049 <= k <= 8192 and rows >= 1 for rows, k in shapes)
    assert {k % 8 for _, k in shapes} == {2, 4, 6}          # 4-byte (2, 6) and 8-byte (4) rows
    for rows, k in shapes:
        mib = rows * k * 2 * 3 / 2**20
        assert phased.RANDOM_MIB[0] * 0.99 <= mib <= phased.RANDOM_MIB[1] * 1.01
    table = dict(elementwise.PHASED_WORD_ROWS)
    with phased.routing_off():
        assert elementwise.PHASED_WORD_ROWS == {}
    assert elementwise.PHASED_WORD_ROWS == table
    for argv in (["--sizes", "100x4096"], ["--sizes", "100x4097"], ["--ops", "gemm", "--sizes", "9x4098"], []):
        with pytest.raises(SystemExit):
            phased.main(argv)


def test_grouped_summary_lines_give_the_geomean_and_the_minimum(capsys):
    rows = [{"ratio": 0.8, "pick_vs_best": 0.9}, {"ratio": 1.25}]
    grouped._summarize("bf16 one 64-row tile", rows)
    grouped._summarize("bf16 DRAM model", [])
    assert capsys.readouterr().out == ("bf16 one 64-row tile: geomean ratio 1.000 (min 0.800) over 2 shapes; "
                                       "default pick / fastest config 0.900 (min 0.900)\n")


def test_gemm_space_summary_compares_the_pick_with_the_fastest_config():
    import bench_gemm_space

    row = {"torch_ms": 0.040, "pick": "a", "configs": {"a": 0.050, "b": 0.044, "c": 0.060}}
    s = bench_gemm_space.summary(row)
    assert s["fastest"] == "b" and abs(s["pick_ratio"] - 0.8) < 1e-9
    assert abs(s["fastest_ratio"] - 0.040 / 0.044) < 1e-9 and abs(s["pick_vs_fastest"] - 0.88) < 1e-9
    gone = bench_gemm_space.summary({**row, "pick": "wrong-results"})   # the pick left out of the sweep
    assert gone["fastest"] == "b" and gone["pick_ratio"] != gone["pick_ratio"]


def test_attention_draws_cover_lengths_heads_and_head_dims():
    """``attention --random``: a seed gives the same calls; lengths reach both ends of their
    range, query heads are a multiple of the KV heads (MQA included), head dims are served pairs
    and padded ones, causal and not."""
    import bench_attention as attention
    from mslk_dsl.templates._attention_limits import HEAD_DIM_PAIRS

    cases = attention.random_cases(300, seed=3)
    assert cases == attention.random_cases(300, seed=3) != attention.random_cases(300, seed=4)
    lengths = [c["S"] for c in cases]
    assert attention.RANDOM_SEQ[0] <= min(lengths) < 200 and 8192 < max(lengths) <= attention.RANDOM_SEQ[1]
    assert all(c["Hq"] % c["Hkv"] == 0 for c in cases) and any(c["Hkv"] == 1 for c in cases)
    dims = {(c["D"], c["Dv"]) for c in cases}
    assert dims & set(HEAD_DIM_PAIRS) and dims - set(HEAD_DIM_PAIRS)
    assert {c["causal"] for c in cases} == {True, False}
    assert all(c["B"] * c["S"] <= attention.RANDOM_ROWS[1] or c["B"] == 1 for c in cases)
