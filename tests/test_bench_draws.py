"""The benchmarks' random shapes (CPU): ``tools/bench.py membound --random N --seed S`` draws
hidden sizes in every access class and sizes over the whole range, the same for a seed."""
import os
import sys

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)

import bench_membound as membound  # noqa: E402


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


def test_membound_summary_names_the_worst_shapes():
    rows = [{"op": "rmsnorm", "rows": r, "hidden": 4096, "MiB": 4.0 * r, "% copy": pct, "vs peer": vs,
             "best peer": "quack"} for r, pct, vs in ((1, 90.0, 1.10), (2, 40.0, 0.80), (3, 95.0, 0.0))]
    lines = membound.summary(rows, worst=1)
    assert lines[0].startswith("rmsnorm: 3 shapes") and "min 40.0" in lines[0]
    assert "behind at 1 of 2" in lines[0] and "min 0.800" in lines[0]
    assert lines[1].strip().startswith("2 x 4096") and len(lines) == 2
