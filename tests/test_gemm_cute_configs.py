"""CPU checks of the Hopper CuTe GEMM templates' plain-Python parts: the persistent tile order the
kernel uses and the default-config heuristic (the kernels themselves are compiled by the
generated compile tests and run by tests/gpu/test_gemm_cute.py)."""
import itertools

import pytest

from mslk_dsl import registry
from mslk_dsl.templates import _cute_gemm_configs as gemm_configs

OPS = {"bf16_gemm": [{"dtype": "bfloat16"}, {"dtype": "float16"}],
       "f8f8bf16_rowwise": [{"bias": b, "fast_accum": f} for f in (True, False)
                            for b in ("none", "bfloat16", "float32")]}
M_VALUES = (1, 7, 16, 64, 65, 128, 129, 512, 1000, 2048, 8192, 16384)
NK_VALUES = ((128, 128), (4096, 4096), (8192, 8192), (10240, 8192), (57344, 8192), (8192, 28672),
             (14336, 4096))


@pytest.mark.parametrize("raster_m", [True, False])
@pytest.mark.parametrize("group", [0, 1, 3, 8])
def test_tile_order_visits_every_tile_once(raster_m, group):
    for clusters_m, clusters_n in itertools.product((1, 2, 5, 17), (1, 3, 8, 33)):
        seen = [gemm_configs.tile_of_work(w, clusters_m, clusters_n, raster_m, group)
                for w in range(clusters_m * clusters_n)]
        assert sorted(seen) == list(itertools.product(range(clusters_m), range(clusters_n)))


def test_tile_order_groups_bands():
    # Bands of 2 clusters along M: M moves first inside a band, then N, then the next band.
    order = [gemm_configs.tile_of_work(w, 4, 3, True, 2) for w in range(12)]
    assert order[:6] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert order[6:8] == [(2, 0), (3, 0)]


@pytest.mark.parametrize("op", OPS)
def test_heuristic_picks_a_valid_config(op):
    (template,) = registry.get_templates(op=op, backend="cute")
    for sig in OPS[op]:
        valid = template.valid_configs("sm90a", sig)
        for m, (n, k) in itertools.product(M_VALUES, NK_VALUES):
            config = template.heuristic("sm90a", sig, {"M": m, "N": n, "K": k})
            assert config in valid, (op, sig, m, n, k, config)
            large = (128, 192, 256) if op == "f8f8bf16_rowwise" and sig.get("fast_accum") else (128, 192)
            k_bytes = k * (1 if op == "f8f8bf16_rowwise" else 2)
            width = gemm_configs.swap_64_width(m, n, k_bytes, op == "f8f8bf16_rowwise", sig.get("fast_accum", False))
            if width:
                # swapped 64-row tiles, one per SM: M rounded up to 16, or M over a few of them
                assert (config["tile_m"], config["tile_n"], config.get("swap")) == (64, width, 1)
                assert width == -(-m // 16) * 16 or (m > gemm_configs.SWAP_64_M_MAX and 128 <= width <= 224)
                continue
            assert config["tile_m"] in ((64,) if m <= 64 else large), (m, config)
            if m <= 64:
                assert config["cluster_m"] == 1, (m, config)


def test_heuristic_uses_the_big_tile_for_large_problems():
    (template,) = registry.get_templates(op="bf16_gemm", backend="cute")
    for m in (2048, 8192, 16384):
        config = template.heuristic("sm90a", {"dtype": "bfloat16"}, {"M": m, "N": 8192, "K": 8192})
        assert (config["tile_m"], config["tile_n"], config["cluster_m"]) == (128, 256, 2)


def test_fp8_promotion_only_on_tiles_with_room_for_two_accumulators():
    (template,) = registry.get_templates(op="f8f8bf16_rowwise", backend="cute")
    configs = template.all_configs()
    assert {c["promote"] for c in configs} == {0, 1, 4}
    for config in configs:
        if config["promote"]:
            # 64 fp32 accumulators per thread per tile_m / 64 rows: tile_n <= 128 keeps 2 sets.
            assert config["tile_n"] <= 128, config
    promoted = template.heuristic("sm90a", {"bias": "none", "fast_accum": False}, {"M": 4096, "N": 8192, "K": 8192})
    assert promoted["promote"] == gemm_configs.FP8_PROMOTE
    fast = template.heuristic("sm90a", {"bias": "none", "fast_accum": True}, {"M": 4096, "N": 8192, "K": 8192})
    # fast accumulation takes tiles wider than 128 (here, past PINGPONG_ALWAYS_M, ping-pong 128 x 192)
    assert fast == {**gemm_configs._config(128, 192, 2, pingpong=True), "promote": 0}


def test_fp8_fast_accum_signature_picks_the_accumulation():
    """use_fast_accum=True (MSLK's default) is exactly the configs without promotion, False
    exactly those with it; every bias dtype has the same configs."""
    (template,) = registry.get_templates(op="f8f8bf16_rowwise", backend="cute")
    for sig in OPS["f8f8bf16_rowwise"]:
        valid = template.valid_configs("sm90a", sig)
        assert valid and all((c["promote"] == 0) == sig["fast_accum"] for c in valid), sig
        assert len(valid) == sum((c["promote"] == 0) == sig["fast_accum"] for c in template.all_configs())
        for m, (n, k) in itertools.product(M_VALUES, NK_VALUES):
            config = template.heuristic("sm90a", sig, {"M": m, "N": n, "K": k})
            assert (config["promote"] == 0) == sig["fast_accum"], (sig, m, n, config)


@pytest.mark.parametrize("split_k", [1, 2, 4, 8])
def test_split_k_ranges_cover_every_k_tile_once(split_k):
    for k_tiles in (0, 1, 2, 3, 7, 8, 9, 64, 127, 448):
        covered = []
        for split in range(split_k):
            begin, count = gemm_configs.k_range(split, k_tiles, split_k)
            assert count >= 0 and begin + count <= k_tiles
            covered += range(begin, begin + count)
        assert covered == list(range(k_tiles)), (split_k, k_tiles)


def _takes_decode_swap(n, k):
    return (gemm_configs.DECODE_SWAP_TILES_MIN <= -(-n // 64) <= gemm_configs.NUM_SMS
            and 2 * k <= gemm_configs.SWAP_64_SHORT_K_BYTES)


def test_decode_takes_one_swapped_64_row_tile_per_sm_on_a_wave_of_them_at_a_short_k():
    """M <= 16 (16-bit) on a layer of 44-132 weight tiles of 64 rows with K <= 8192: one swapped
    64 x 32 tile each, unsplit; both sides of each bound keep the split 256-wide tiles."""
    (template,) = registry.get_templates(op="bf16_gemm", backend="cute")
    swap = gemm_configs.DECODE_SWAP_CONFIG
    assert swap in template.configs and swap["swap"] and swap["tile_m"] == 64 and swap["tile_n"] == 32
    for dtype in ("bfloat16", "float16"):
        sig = {"dtype": dtype}
        for m in (1, 9, 16):
            for n, k in ((2816, 4096), (7168, 2048), (8448, 8192), (6144, 5120)):
                assert template.heuristic("sm90a", sig, {"M": m, "N": n, "K": k}) == swap, (m, n, k)
            # 43 tiles, 133 tiles (past one wave), K past 8192: the split or unsplit 256-wide tiles
            for n, k in ((2752, 4096), (8456, 4096), (6144, 8200), (4096, 14336)):
                config = template.heuristic("sm90a", sig, {"M": m, "N": n, "K": k})
                assert config["tile_n"] == 256 and not config.get("swap"), (m, n, k, config)
        assert template.heuristic("sm90a", sig, {"M": 17, "N": 6144, "K": 4096}) != swap
    (fp8,) = registry.get_templates(op="f8f8bf16_rowwise", backend="cute")
    assert fp8.heuristic("sm90a", {"bias": "none", "fast_accum": True}, {"M": 4, "N": 6144, "K": 4096})["tile_n"] != 32


def test_decode_heuristic_splits_k_when_few_tiles_would_leave_sms_idle():
    (template,) = registry.get_templates(op="bf16_gemm", backend="cute")
    sig = {"dtype": "bfloat16"}
    for m, (n, k) in itertools.product((1, 7, 16), NK_VALUES):
        config = template.heuristic("sm90a", sig, {"M": m, "N": n, "K": k})
        tiles = -(-n // 256)
        if _takes_decode_swap(n, k):
            assert config == gemm_configs.DECODE_SWAP_CONFIG, (m, n, k, config)
        elif k >= gemm_configs.DECODE_SPLIT_K_MIN and tiles < gemm_configs.DECODE_TILES_MIN:
            # Few 256-wide tiles: split until the units about fill the SMs, never past them.
            units = tiles * config["split_k"]
            assert config["tile_n"] == 256 and gemm_configs.NUM_SMS // 2 < units <= gemm_configs.NUM_SMS, (
                m, n, k, config)
        elif tiles > gemm_configs.NUM_SMS and 0 < tiles % gemm_configs.NUM_SMS <= gemm_configs.DECODE_TAIL_MAX:
            assert config["split_k"] == gemm_configs.DECODE_TAIL_SPLIT, (m, n, k, config)
        else:
            assert "split_k" not in config, (m, n, k, config)
    # A last wave of a few tiles is split (N = 34816-36864: 4-12 of 136-144); one of 28 or more
    # is not (40960, 51200, 57344), nor one at a short K.
    for m, n in itertools.product((1, 16), (34816, 36864, 69632)):
        assert template.heuristic("sm90a", sig, {"M": m, "N": n, "K": 7168}).get("split_k") == 4, (m, n)
    for n in (40960, 51200, 57344):
        assert "split_k" not in template.heuristic("sm90a", sig, {"M": 1, "N": n, "K": 7168}), n
    assert "split_k" not in template.heuristic("sm90a", sig, {"M": 1, "N": 36864, "K": 1024})
    # Decode tiles split only up to M = 16, and never for FP8 (it has 16-row x boxes there);
    # M > 64 is the model's (below), which never splits a call of many waves.
    for m in (17, 64, 4096):
        assert "split_k" not in template.heuristic("sm90a", sig, {"M": m, "N": 8192, "K": 8192})
    (fp8,) = registry.get_templates(op="f8f8bf16_rowwise", backend="cute")
    assert all(c["tile_m"] == 128 for c in fp8.all_configs() if "split_k" in c)
    for m, fast in itertools.product((1, 16, 64, 4096), (True, False)):
        sig8 = {"bias": "none", "fast_accum": fast}
        assert "split_k" not in fp8.heuristic("sm90a", sig8, {"M": m, "N": 8192, "K": 8192})



# Microseconds per call of the unsplit 64-row tiles by width, timed on the H200 (bf16 at M = 32,
# 64; FP8 promote4 at M = 1-64; docs/results/gemm_sweep_64_row_tiles.json). The x-box term of the
# heuristic's cost (x's 64-row box is reloaded per tile) is what makes it pick these.
SWEEP_64_ROW_TILES = {
    ('bf16', 32, 8192, 8192): {64: 48.4, 128: 48.8, 256: 58.9},
    ('bf16', 64, 8192, 8192): {64: 44.8, 128: 46.9, 256: 57.3},
    ('bf16', 32, 10240, 8192): {64: 64.5, 128: 57.4, 256: 62.1},
    ('bf16', 64, 10240, 8192): {64: 60.0, 128: 55.9, 256: 60.1},
    ('bf16', 32, 57344, 8192): {64: 267.3, 128: 239.6, 256: 234.4},
    ('bf16', 64, 57344, 8192): {64: 240.6, 128: 233.1, 256: 234.9},
    ('bf16', 32, 8192, 28672): {64: 136.2, 128: 149.6, 256: 177.3},
    ('bf16', 64, 8192, 28672): {64: 121.4, 128: 133.5, 256: 169.0},
    ('bf16', 32, 4096, 4096): {64: 20.1, 128: 20.3, 256: 29.3},
    ('bf16', 64, 4096, 4096): {64: 18.6, 128: 20.7, 256: 28.9},
    ('bf16', 32, 14336, 4096): {64: 44.6, 128: 41.2, 256: 42.6},
    ('bf16', 64, 14336, 4096): {64: 40.8, 128: 40.7, 256: 42.5},
    ('fp8', 1, 8192, 8192): {64: 29.9, 128: 31.9},
    ('fp8', 16, 8192, 8192): {64: 28.3, 128: 29.2},
    ('fp8', 32, 8192, 8192): {64: 28.1, 128: 29.6},
    ('fp8', 64, 8192, 8192): {64: 27.9, 128: 29.9},
    ('fp8', 1, 10240, 8192): {64: 41.2, 128: 37.8},
    ('fp8', 16, 10240, 8192): {64: 38.5, 128: 34.9},
    ('fp8', 32, 10240, 8192): {64: 38.4, 128: 34.7},
    ('fp8', 64, 10240, 8192): {64: 38.0, 128: 35.2},
    ('fp8', 1, 57344, 8192): {64: 174.0, 128: 137.2},
    ('fp8', 16, 57344, 8192): {64: 158.2, 128: 132.5},
    ('fp8', 32, 57344, 8192): {64: 144.0, 128: 130.0},
    ('fp8', 64, 57344, 8192): {64: 127.5, 128: 130.9},
    ('fp8', 1, 8192, 28672): {64: 88.1, 128: 92.9},
    ('fp8', 16, 8192, 28672): {64: 82.4, 128: 84.2},
    ('fp8', 32, 8192, 28672): {64: 77.3, 128: 80.8},
    ('fp8', 64, 8192, 28672): {64: 68.5, 128: 71.7},
    ('fp8', 1, 4096, 4096): {64: 14.6, 128: 14.4},
    ('fp8', 16, 4096, 4096): {64: 13.7, 128: 13.3},
    ('fp8', 32, 4096, 4096): {64: 12.9, 128: 13.8},
    ('fp8', 64, 4096, 4096): {64: 11.8, 128: 13.1},
    ('fp8', 1, 14336, 4096): {64: 29.6, 128: 26.4},
    ('fp8', 16, 14336, 4096): {64: 27.9, 128: 25.4},
    ('fp8', 32, 14336, 4096): {64: 26.5, 128: 25.9},
    ('fp8', 64, 14336, 4096): {64: 25.1, 128: 26.0},
}


def test_heuristic_picks_a_64_row_width_within_4_percent_of_the_sweeps_best():
    (bf16,) = registry.get_templates(op="bf16_gemm", backend="cute")
    (fp8,) = registry.get_templates(op="f8f8bf16_rowwise", backend="cute")
    for (op, m, n, k), us in SWEEP_64_ROW_TILES.items():
        if op == "bf16":
            config = bf16.heuristic("sm90a", {"dtype": "bfloat16"}, {"M": m, "N": n, "K": k})
        else:
            config = fp8.heuristic("sm90a", {"bias": "none", "fast_accum": False}, {"M": m, "N": n, "K": k})
        if "split_k" in config:  # bf16 decode sizes take split-K tiles (tested above)
            continue
        assert config["tile_m"] == 64 and us[config["tile_n"]] <= 1.04 * min(us.values()), (op, m, n, k, config)


@pytest.mark.parametrize("ctas", [66, 132])
def test_stream_k_pieces_cover_every_shared_k_tile_once(ctas):
    """The kernel's walk (each CTA's range cut at tile edges into pieces) and the reduction's
    lookup (first and last CTA of a tile, piece = tile - first tile of the CTA's range) agree:
    every k-tile of every shared tile is summed exactly once, from at most two pieces per CTA."""
    for tiles, k_tiles in itertools.product((1, 5, ctas - 1, ctas, ctas + 1, 2 * ctas + 34, 1024),
                                            (1, 2, 3, 17, 128, 448)):
        whole, shared = gemm_configs.stream_k_tiles(tiles, ctas)
        assert whole % ctas == 0 and 0 <= shared < ctas and whole + shared == tiles
        stored = {}  # (cta, piece) -> (tile, first k, count), as the consumer warps store them
        for cta in range(ctas):
            k, end = (gemm_configs.stream_k_begin(c, shared, k_tiles, ctas) for c in (cta, cta + 1))
            piece = 0
            while k < end:
                tile = k // k_tiles
                count = min(k_tiles - (k - tile * k_tiles), end - k)
                stored[cta, piece] = (tile, k - tile * k_tiles, count)
                k, piece = k + count, piece + 1
            assert piece <= gemm_configs.STREAM_K_PIECES
        for tile in range(shared):  # what reduce_stream_k adds up
            first = gemm_configs.stream_k_first_cta(tile * k_tiles, shared, k_tiles, ctas)
            last = gemm_configs.stream_k_first_cta(tile * k_tiles + k_tiles - 1, shared, k_tiles, ctas)
            covered = []
            for cta in range(first, last + 1):
                begin = gemm_configs.stream_k_begin(cta, shared, k_tiles, ctas)
                if gemm_configs.stream_k_begin(cta + 1, shared, k_tiles, ctas) == begin:
                    assert (cta, 0) not in stored
                    continue
                piece_tile, k0, count = stored.pop((cta, tile - begin // k_tiles))
                assert piece_tile == tile
                covered += range(k0, k0 + count)
            assert sorted(covered) == list(range(k_tiles)), (tiles, k_tiles, tile)
        assert not stored  # no piece left unread


def test_stream_k_partials_hold_every_slot():
    for config in gemm_configs.STREAM_K_CONFIGS:
        ctas = gemm_configs.NUM_SMS // config["cluster_m"]
        last_slot = ((ctas - 1) * gemm_configs.STREAM_K_PIECES + 1) * config["cluster_m"] + config["cluster_m"] - 1
        assert (last_slot + 1) * config["tile_m"] * config["tile_n"] == gemm_configs.stream_k_partials(config)


def test_partials_elements_by_config_kind():
    plain, split = gemm_configs._config(128, 256, 2), gemm_configs._config(64, 256, split_k=4)
    stream = gemm_configs._config(128, 128, stream_k=True)
    assert gemm_configs.partials_elements(plain, 1000, 4096) == 0
    # 64-row split-K: [split_k, M, N] for the second kernel, no counters.
    assert gemm_configs.partials_elements(split, 7, 4096) == 4 * 7 * 4096
    assert gemm_configs.counters_needed(split, 7, 4096) == 0 == gemm_configs.counters_needed(plain, 7, 4096)
    # 128-row split-K, fixed up in place: a 128 x 128 slot per output tile (2 x 8) and split,
    # and a counter per tile.
    mid = gemm_configs._config(128, 128, split_k=3)
    assert gemm_configs.partials_elements(mid, 129, 1000) == 2 * 8 * 3 * 128 * 128
    assert gemm_configs.counters_needed(mid, 129, 1000) == 16
    assert gemm_configs.partials_elements(stream, 7, 4096) == gemm_configs.stream_k_partials(stream) > 0


@pytest.mark.parametrize("op", OPS)
def test_x_rows_configs_serve_decode_only(op, monkeypatch):
    """Configs that load only x_rows rows of x: the heuristic picks them for M <= X_ROWS and never
    above, the tuner offers them only for M <= x_rows, and the op refuses a larger M."""
    from mslk_dsl import autotune
    from mslk_dsl.ops import declaration

    (template,) = registry.get_templates(op=op, backend="cute")
    sig = OPS[op][0]
    # FP8: 16-row boxes; 16-bit: also 32- and 48-row ones for 64-row tiles at 16 < M <= 48.
    rows_max = gemm_configs.X_ROWS if op == "f8f8bf16_rowwise" else max(gemm_configs.X_ROWS_MID)
    for m, (n, k) in itertools.product(M_VALUES + (17, 32, 33, 48, 49), NK_VALUES):
        config = template.heuristic("sm90a", sig, {"M": m, "N": n, "K": k})
        assert config.get("x_rows", m) >= m, (m, n, k, config)
        if m > rows_max:
            assert "x_rows" not in config, (m, n, k, config)
        elif op == "f8f8bf16_rowwise" or config["tile_n"] == 256 or m > gemm_configs.X_ROWS:
            if config["tile_m"] == 64:  # the box: M rounded up to 16
                assert config.get("x_rows") == -(-m // 16) * 16, (m, n, k, config)
        candidates = autotune._candidates(template, "sm90a", sig, {"M": m, "N": n, "K": k})
        assert all(c.get("x_rows", m) >= m for c in candidates)
        assert any("x_rows" in c for c in candidates) == (m <= rows_max)
    # The op layer's choice (explicit config here) refuses an x_rows config for a larger M.
    kernel_op = declaration.get(op).kernels
    x_rows_config = next(c for c in template.valid_configs("sm90a", sig) if c.get("x_rows") == gemm_configs.X_ROWS)
    signature = tuple(sig[f] for f in kernel_op.sig_fields)
    assert kernel_op.choose("sm90a", signature, (gemm_configs.X_ROWS, 64, 64), x_rows_config)[1] == x_rows_config
    with pytest.raises(ValueError, match=r"x_rows16 does not serve a call of sizes \{'M': 17"):
        kernel_op.choose("sm90a", signature, (gemm_configs.X_ROWS + 1, 64, 64), x_rows_config)
    # A stored tuning result that cannot serve the call is passed over for the heuristic.
    from mslk_dsl import tuning

    monkeypatch.setattr(tuning, "lookup", lambda *args: x_rows_config)
    assert kernel_op.choose("sm90a", signature, (gemm_configs.X_ROWS, 64, 64), None)[1] == x_rows_config
    passed_over = kernel_op.choose("sm90a", signature, (gemm_configs.X_ROWS + 1, 64, 64), None)[1]
    assert passed_over != x_rows_config and passed_over.get("x_rows", 64) > gemm_configs.X_ROWS


# -- the model of M > 64 calls, re-derived here from its statement in the heuristic's docstring:
#   time = waves x (k_steps / split_k x tile_cost + fix-up)
#   tile_cost = tile_m x tile_n + LOAD_WEIGHT x (tile_m + tile_n / cluster_m)
#   fix-up = FIXUP_WEIGHT x (split_k + 1) x tile_m x tile_n   (none unsplit)
#   waves = ceil(clusters of output tiles x split_k / (NUM_SMS / cluster_m)), M tiles in whole clusters
#   split-K only where tiles x split_k <= NUM_SMS (one wave of units)
#   swapped configs (fast accumulation or 16-bit, at least SWAP_MIN_WIDTH tokens wide): the same
#   on the kernel's N x M (tile_m along N, tile_n along M, the cluster rule on N's tiles)
# k_steps: the bf16-equivalent depth of K in whole 128-byte k-tiles, each split a whole number.
LAYERS_N = (1024, 2112, 2560, 4096, 5120, 6144, 7168, 8192, 13824, 14336, 28672, 57344, 72, 1000, 8200)
LARGE_M = (65, 100, 128, 129, 200, 257, 333, 640, 1000, 1500, 2048, 3000, 4096, 8192, 16384)


def _model_time(m, n, k_bytes, tile_m, tile_n, cluster_m, split_k, smem_bound=False):
    m_tiles = -(-m // tile_m)
    units = -(-m_tiles // cluster_m) * -(-n // tile_n) * split_k
    waves = -(-units // (gemm_configs.NUM_SMS // cluster_m))
    k_tiles = -(-k_bytes // 128)
    k_steps = -(-k_tiles // split_k) * 64
    # 16-bit: narrow wgmma tiles are bound by their shared-memory reads (SMEM_READ_FACTOR)
    smem = max(1.0, (64 + tile_n) / (2 * tile_n) * gemm_configs.SMEM_READ_FACTOR) if smem_bound else 1
    tile_cost = tile_m * tile_n * smem + gemm_configs.LOAD_WEIGHT * (tile_m + tile_n / cluster_m)
    fixup = gemm_configs.FIXUP_WEIGHT * (split_k + 1) * tile_m * tile_n if split_k > 1 else 0
    return waves * (k_steps * tile_cost + fixup)


def _least_modelled(times, k_bytes):
    """The tile of least modelled time, near-ties (TIE) going to no split (at a K of more than
    SPLIT_TIE_K_BYTES per row: to a split one), then the unswapped, then a tile of at most 128
    rows, then the larger tile, then the larger cluster; and the near-ties."""
    best = min(times.values())
    near = [s for s in times if times[s] <= best * (1 + gemm_configs.TIE)]
    split = [s for s in near if s[3] > 1]
    if k_bytes > gemm_configs.SPLIT_TIE_K_BYTES and split:
        same_split = split
    else:
        same_split = [s for s in near if s[3] == min(s[3] for s in near)]
    swap = all(s[4] for s in same_split)
    alike = [s for s in same_split if s[4] == swap]
    preferred = [s for s in alike if s[0] <= 128] or alike
    area = max(s[0] * s[1] for s in preferred)
    return max((s for s in preferred if s[0] * s[1] == area), key=lambda s: s[2]), near


@pytest.mark.parametrize("op,sig", [("bf16_gemm", {"dtype": "bfloat16"}),
                                    ("f8f8bf16_rowwise", {"bias": "none", "fast_accum": True}),
                                    ("f8f8bf16_rowwise", {"bias": "none", "fast_accum": False})])
def test_large_m_heuristic_is_the_model_s_best(op, sig):
    """For M > 64 the default is the tile and K split of least modelled time among the op's
    128-row configs and, but for promoted FP8, its 192-row ones (FP8's modelled time scaled by
    TALL_FP8_FACTOR) and its swapped 128-row ones of at least SWAP_MIN_WIDTH tokens (no stream-K or
    x_rows; promoted FP8: promote 4; not 128x64 in a 2x1 cluster; split-K unswapped only for
    promoted FP8), near-ties going to no split, then the unswapped, then the 128-row tile, then
    the larger tile; FP8 fast accumulation at M >= PINGPONG_M_MIN then takes the ping-pong tile
    of least modelled time (times PINGPONG_FACTOR) where it costs less than the pick charged
    EPILOGUE_WEIGHT per output element and wave (beyond a TIE), and always from
    PINGPONG_ALWAYS_M rows, or else, at M >= WIDE_M_MIN, chooses again with the 256-row tiles
    in."""
    (template,) = registry.get_templates(op=op, backend="cute")
    fast = sig == {"bias": "none", "fast_accum": True}
    shapes = {(c["tile_m"], c["tile_n"], c["cluster_m"], c.get("split_k", 1), bool(c.get("swap")))
              for c in template.valid_configs("sm90a", sig)
              if not ({"stream_k", "x_rows", "pingpong"} & c.keys()) and c.get("promote", 0) in (0, 4)
              and (c["tile_m"] in (128, 192) or (c["tile_m"] == 256 and fast))
              and not (c["tile_m"] in (192, 256) and c.get("swap"))  # the tuner's, not the model's
              and (c.get("swap") or c.get("split_k", 1) == 1 or sig == {"bias": "none", "fast_accum": False})
              and (c["tile_n"] >= gemm_configs.SWAP_MIN_WIDTH if c.get("swap")
                   else (c["tile_n"], c["cluster_m"]) != (64, 2))}
    assert any(s[4] for s in shapes) == (sig != {"bias": "none", "fast_accum": False})
    assert any(s[0] == 192 for s in shapes) == (sig != {"bias": "none", "fast_accum": False})
    assert any(s[0] == 256 for s in shapes) == fast
    k_bytes_per = 2 if op == "bf16_gemm" else 1
    factor = {192: gemm_configs.TALL_FP8_FACTOR, 256: gemm_configs.WIDE_FP8_FACTOR} if op == "f8f8bf16_rowwise" else {}
    for m, n, k in itertools.product(LARGE_M, LAYERS_N, (1024, 4096, 28672)):
        if gemm_configs.swap_64_width(m, n, k * k_bytes_per, op == "f8f8bf16_rowwise", sig.get("fast_accum", False)):
            continue  # the swapped 64-row rule decides (its own tests, below)
        config = template.heuristic("sm90a", sig, {"M": m, "N": n, "K": k})
        chosen = (config["tile_m"], config["tile_n"], config["cluster_m"], config.get("split_k", 1),
                  bool(config.get("swap")))
        times = {}
        for s in shapes:
            rows, cols = (n, m) if s[4] else (m, n)  # the kernel's M x N
            row_tiles = -(-rows // s[0])  # a 2x1 cluster needs an even number of row tiles, or many
            if s[2] == 2 and row_tiles % 2 and row_tiles < 8:
                continue
            # Split-K at most up to one wave of units.
            if s[3] > 1 and row_tiles * -(-cols // s[1]) * s[3] > gemm_configs.NUM_SMS:
                continue
            times[s] = _model_time(rows, cols, k * k_bytes_per, *s[:4], smem_bound=op == "bf16_gemm") \
                * factor.get(s[0], 1)
        wide = {s: t for s, t in times.items() if s[0] == 256}
        pick, near = _least_modelled({s: t for s, t in times.items() if s[0] != 256}, k * k_bytes_per)
        # FP8 fast accumulation at M >= PINGPONG_M_MIN: a ping-pong tile where the pick's
        # epilogues (EPILOGUE_WEIGHT per output element and wave) make the pick dearer.
        expected = pick + (False,)
        pingpong = False
        if fast and m >= gemm_configs.PINGPONG_M_MIN:
            rows, cols = (n, m) if pick[4] else (m, n)
            row_tiles = -(-rows // pick[0])
            clusters = -(-row_tiles // pick[2]) * -(-cols // pick[1]) * pick[3]
            waves = -(-clusters // (gemm_configs.NUM_SMS // pick[2]))
            charged = (times[pick] + waves * gemm_configs.EPILOGUE_WEIGHT * pick[0] * pick[1]) * (1 - gemm_configs.TIE)
            pp = {(128, tn, c): _model_time(m, n, k * k_bytes_per, 128, tn, c, 1) * gemm_configs.PINGPONG_FACTOR
                  for tn, c in ((128, 1), (128, 2), (160, 1), (160, 2), (192, 1), (192, 2))
                  if c == 1 or -(-m // 128) % 2 == 0 or -(-m // 128) >= 8}
            winner = min(pp, key=pp.get)
            if pp[winner] < charged or m >= gemm_configs.PINGPONG_ALWAYS_M:
                expected = winner + (1, False, True)
                pingpong = True
        # ... or else, at M >= WIDE_M_MIN, the choice again with the 256-row tiles in.
        if wide and not pingpong and m >= gemm_configs.WIDE_M_MIN:
            pick, near = _least_modelled(times, k * k_bytes_per)
            expected = pick + (False,)
        assert chosen + (bool(config.get("pingpong")),) == expected, (m, n, k, config, near)


def test_model_prefers_widths_that_fit_the_layer():
    """What the model buys on real layers: N = 2112 at large M takes a width that splits it into
    whole tiles (11 x 192 or 10 x 224 wasting less than 256's 9 tiles' last wave); a mid-sized M
    that 128-row tiles would pad takes swapped tiles (the weight along the kernel's M, the tokens
    along its N in steps of 16), whose token width fits M; large M keeps the unswapped big tile.
    M > 64 takes 128-row tiles (64-row ones measured slower there), or 192-row ones where their
    fewer tiles fill whole waves: M = 1522 at 2880 x 4096 is 8 x 15 = 120 tiles of 192 x 192,
    one wave, against 12 x 18 = 216 of 128 x 160 (two waves); M = 2272 at 2112 x 7168 is
    12 x 11 = 132 of them, exactly one wave (both measured 1.10-1.19x faster on the H200)."""
    (bf16,) = registry.get_templates(op="bf16_gemm", backend="cute")
    sig = {"dtype": "bfloat16"}

    def pick(m, n, k=1024):
        c = bf16.heuristic("sm90a", sig, {"M": m, "N": n, "K": k})
        return c["tile_m"], c["tile_n"], c["cluster_m"], c.get("split_k", 1), bool(c.get("swap"))

    assert pick(8192, 2112)[1] in (192, 224) and not pick(8192, 2112)[4]
    assert pick(8192, 8192, 8192) == (128, 256, 2, 1, False)  # 8192^3 keeps the big tile
    assert pick(2048, 8192, 8192) == (128, 256, 2, 1, False)
    # M = 333: 3 x 128 rows pad 15%, 3 x 112 swapped columns 1%; 40 weight tiles in 2x1
    # clusters x 3 = 120 CTAs, one wave.
    assert pick(333, 5120) == (128, 112, 2, 1, True)
    # 4 x 96 = 384 > 324 > 3 x 96: tiles x waves (the model's pick; the call itself takes two
    # swapped 64-row tiles per weight tile, see swap_64_width)
    assert gemm_configs._large_m(324, 4096, 2048, False, False)[:5] == (128, 96, 2, 1, True)
    assert pick(324, 4096) == (64, 176, 1, 1, True)
    assert pick(256, 8192) == (128, 128, 2, 1, False)  # M a multiple of 128: unswapped
    # Split-K where the tiles leave SMs idle and K is long: M = 129 at 4096 x 14336 is one
    # swapped 160-token tile by 32 weight tiles, split in 4 (128 units); with a short K it is
    # one swapped 64-row tile per SM, 144 tokens wide (see swap_64_width).
    assert pick(129, 4096, 14336) == (128, 160, 1, 4, True)
    assert pick(129, 4096, 4096) == (64, 144, 1, 1, True)
    assert pick(1522, 2880, 4096) == (192, 192, 2, 1, False)
    assert pick(2272, 2112, 7168) == (192, 192, 2, 1, False)
    for m, n, k in itertools.product(LARGE_M, LAYERS_N, (1024, 8192)):
        if gemm_configs.swap_64_width(m, n, 2 * k):
            continue
        tile_m, tile_n, cluster_m, split_k, swap = pick(m, n, k)
        rows, cols = (n, m) if swap else (m, n)
        assert tile_m in (128, 192) and 64 <= tile_n <= 256
        assert tile_m == 128 or (split_k == 1 and not swap)
        assert (tile_n % 16 == 0 and tile_n >= gemm_configs.SWAP_MIN_WIDTH if swap
                else tile_n % 32 == 0 and (tile_n, cluster_m) != (64, 2))
        assert split_k == 1 or (cluster_m == 1 and -(-rows // 128) * -(-cols // tile_n) * split_k
                                <= gemm_configs.NUM_SMS)


@pytest.mark.parametrize("op,sig", [("bf16_gemm", {"dtype": "bfloat16"}),
                                    ("f8f8bf16_rowwise", {"bias": "none", "fast_accum": True})])
def test_mid_m_takes_one_swapped_64_row_tile_per_sm(op, sig):
    """64 < M <= SWAP_64_M_MAX on a layer of 64..132 weight tiles of 64 rows (96.. at a long K):
    a swapped 64-row tile as wide as M rounded up to 16, unsplit, one CTA (measured faster than
    split-K over swapped 128-row tiles there; docs/benchmarks.md "Swapped 64-row tiles")."""
    (template,) = registry.get_templates(op=op, backend="cute")
    per = 2 if op == "bf16_gemm" else 1

    def pick(m, n, k):
        c = template.heuristic("sm90a", sig, {"M": m, "N": n, "K": k})
        return c["tile_m"], c["tile_n"], c["cluster_m"], c.get("split_k", 1), bool(c.get("swap"))

    assert pick(65, 7168, 5120) == (64, 80, 1, 1, True)
    assert pick(208, 8192, 28672) == (64, 208, 1, 1, True)   # 128 tiles: HBM-bound at any K
    assert pick(209, 8192, 5120)[0] != 64                      # past SWAP_64_M_MAX
    assert pick(110, 8448, 4096)[:2] == (64, 112)              # 132 tiles: one wave
    assert pick(110, 8512, 4096)[0] != 64                      # 133: a second, near-empty wave
    assert pick(110, 2112, 7168)[0] != 64                      # 33 tiles: too few SMs stream
    short_k, long_k = 16384 // per, 16384 // per + 16
    assert pick(110, 4096, short_k)[:2] == (64, 112)           # 64 tiles, short K
    assert pick(110, 4096, long_k)[0] != 64                    # 64 tiles, long K: split-K
    assert pick(110, 6144, 4 * long_k)[:2] == (64, 112)        # 96 tiles: any K
    for m in (64, 65, 100, 208, 209):
        for n in (4096, 6144, 8448, 8512):
            assert (pick(m, n, 4096)[0] == 64 and m > 64) == bool(gemm_configs.swap_64_width(m, n, 4096 * per))
    # Promoted FP8 has no swapped tiles.
    assert not gemm_configs.swap_64_width(110, 8192, 4096, fp8=True, fast_accum=False)
    assert not gemm_configs.swap_64_width(341, 2112, 7168, fp8=True, fast_accum=False)


@pytest.mark.parametrize("op,sig", [("bf16_gemm", {"dtype": "bfloat16"}),
                                    ("f8f8bf16_rowwise", {"bias": "none", "fast_accum": True})])
def test_larger_m_on_narrow_layers_takes_a_few_swapped_64_row_tiles(op, sig):
    """Past SWAP_64_M_MAX, a layer of few 64-row weight tiles takes M over as many swapped 64-row
    tiles, 128-224 tokens wide (three of them: up to 256 where nothing narrower fits), as make one
    wave (cuBLAS's 64 x 168 at M = 324 on 4096 x 7168; measured faster than the model's swapped
    128-row picks, docs/benchmarks.md)."""
    (template,) = registry.get_templates(op=op, backend="cute")
    per = 2 if op == "bf16_gemm" else 1

    def pick(m, n, k):
        c = template.heuristic("sm90a", sig, {"M": m, "N": n, "K": k})
        return c["tile_m"], c["tile_n"], c["cluster_m"], c.get("split_k", 1), bool(c.get("swap"))

    assert pick(324, 4096, 7168) == (64, 176, 1, 1, True)      # 2 x 64 weight tiles
    assert pick(800, 2112, 7168) == (64, 208, 1, 1, True)      # 4 x 33: 132 tiles
    assert pick(352, 2112, 7168) == (64, 128, 1, 1, True)      # 3 x 33 (4 would be 96 wide)
    assert pick(250, 3584, 8192)[:2] == (64, 128)              # 2 x 56
    assert pick(493, 4096, 14336)[0] != 64                     # 2 x 256 tokens: too wide for two
    assert pick(724, 2112, 7168)[:2] == (64, 256)              # 4 x 192 only 77% full: 3 x 256
    assert pick(705, 2112, 7168)[:2] == (64, 240)              # 4 x 192 only 61% full: 3 x 240
    assert pick(740, 2816, 4096)[0] != 64                      # 3 x 44 tiles 256 wide: measured slower
    assert pick(741, 2880, 4096)[0] != 64                      # 3 x 45 = 135 tiles: past one wave
    assert pick(293, 5120, 32768)[0] != 64                     # 2 x 80 tiles
    assert pick(220, 4096, 4096)[0] != 64                      # 2 x 112 tokens: too narrow
    for m in range(209, 1000, 7):
        for n in (2112, 2880, 4096, 4224, 4288):
            width = gemm_configs.swap_64_width(m, n, 4096 * per)
            if width:
                tiles = -(-n // 64) * -(-m // width)
                most = gemm_configs.SWAP_64_WIDE_MAX if -(-m // width) == 3 and n <= 2112 else 224
                assert 128 <= width <= most and width % 16 == 0 and tiles <= gemm_configs.NUM_SMS
                assert pick(m, n, 4096)[:2] == (64, width)
    assert not any(gemm_configs.swap_64_width(m, 4288, 4096) for m in range(209, 2000))  # 67 x 2 > 132
    # The last token tile full enough (SWAP_64_LAST_FILL): four tiles at least 5/6 full, three at
    # least 2/3, else fewer tiles or the model (each case timed, docs/benchmarks.md).
    assert pick(574, 2112, 7168)[:2] == (64, 144)              # 4 x 144, the last 142 rows: 99%
    assert pick(684, 2112, 7168)[:2] == (64, 176)              # 4 x 176, 156 rows: 89%
    assert pick(544, 2112, 7168)[:2] == (64, 192)              # 4 x 144 only 78%: 3 x 192, 83%
    assert pick(473, 2112, 7168)[:2] == (64, 160)              # 4 x 128 only 70%: 3 x 160
    assert pick(350, 2112, 7168)[:2] == (64, 128)              # 3 x 128, the last 94 rows: 73%
    assert pick(338, 2112, 7168)[:2] == (64, 176)              # 3 x 128 only 64%: 2 x 176
    assert pick(777, 2112, 7168)[0] != 64                      # 4 x 208 only 74%, 3 x 272 too wide
    def width_of(m, tiles):  # M over ``tiles`` token tiles, rounded up to 16
        per_tile = (m + tiles - 1) // tiles
        return (per_tile + 15) // 16 * 16

    for m in range(209, 1000):  # past 224 only where no width in 128-224 fits
        width = gemm_configs.swap_64_width(m, 2112, 7168 * per)
        if width > 224:
            assert -(-m // width) == 3
            assert not any(128 <= width_of(m, t) <= 224 and gemm_configs._last_tile_fits(m, width_of(m, t))
                           for t in (2, 3, 4))
    for m in range(209, 1000):
        width = gemm_configs.swap_64_width(m, 2112, 7168 * per)
        if width:
            tiles = -(-m // width)
            num, den = gemm_configs.SWAP_64_LAST_FILL.get(tiles, (0, 1))
            assert den * (m - (tiles - 1) * width) >= num * width, (m, width)


def test_fp8_fast_accum_takes_192_row_tiles_the_model_puts_within_5_percent():
    """FP8 192-row tiles (fast accumulation) were measured faster than the 128-row pick where
    the model put them up to 8% behind (M = 3434 at 27648 x 5120: 805 -> 763 us; M = 4602 at
    5120 x 8192: 301 -> 284) and slower where it put them 11% behind (M = 2368 at 51200 x 5120:
    980 -> 1014); promoted accumulation never takes them."""
    (fp8,) = registry.get_templates(op="f8f8bf16_rowwise", backend="cute")

    def pick(m, n, k, fast=True):
        c = fp8.heuristic("sm90a", {"bias": "none", "fast_accum": fast}, {"M": m, "N": n, "K": k})
        return c["tile_m"], c["tile_n"], c["cluster_m"], c.get("split_k", 1), bool(c.get("swap"))

    assert pick(3434, 27648, 5120) == (192, 192, 2, 1, False)
    # (M = 4602 at 5120 x 8192 is past PINGPONG_ALWAYS_M: ping-pong now; at M = 6359 on the same
    # layer ping-pong measured 2.6% slower than the 192-row tile, the one loss of its fresh check)
    assert pick(4602, 5120, 8192) == (128, 160, 2, 1, False)
    assert pick(2368, 51200, 5120)[0] == 128
    for m, n, k in itertools.product(LARGE_M, LAYERS_N, (1024, 8192)):
        assert pick(m, n, k, fast=False)[0] == 128


def test_model_picks_within_half_a_percent_of_the_sweep_s_fastest():
    """The M > 64 model, restricted to the configs a sweep timed (every 128-row data-parallel
    config at M = 128-8192 on six (N, K), bf16 on the H200: docs/results/gemm_sweep_stream_k.json.gz),
    picks one at most 0.5% slower than the fastest at every point."""
    import gzip
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "docs", "results", "gemm_sweep_stream_k.json.gz")
    with gzip.open(path, "rt") as f:
        sweep = json.load(f)
    assert len(sweep) >= 40
    for point in sweep:
        us = {(128, int(name.split("c")[0]), int(name.split("c")[1])): t
              for name, t in point["us"].items() if not name.endswith("sk")}
        pick = min(us, key=lambda s: (gemm_configs.call_time(point["M"], point["N"], *s), -s[1]))
        assert us[pick] <= 1.005 * min(us.values()), (point["M"], point["N"], point["K"], pick, us)


def test_split_k_model_against_the_sweep():
    """The M > 64 model with split-K, restricted to the candidates a sweep timed with the
    in-place fix-up (bf16 on the H200, M = 72-513 at 4096 x 4096 and 5120 x 32768:
    docs/results/gemm_sweep_split_k.json.gz, "second_visit"): on the long K it picks the fastest
    (split 2-3 there, 1.2-1.45x faster than any unsplit tile); at K = 4096 its picks are at most
    20% slower than the fastest (the misses are unsplit cluster choices, not split-K)."""
    import gzip
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "docs", "results", "gemm_sweep_split_k.json.gz")
    with gzip.open(path, "rt") as f:
        points = json.load(f)["second_visit"]
    assert len(points) >= 9
    for point in points:
        m, n, k = point["M"], point["N"], point["K"]
        us = {}
        for name, t in point["us"].items():
            tile_n, rest = name.split("c")
            cluster_m, split_k = rest.split("s")
            us[(128, int(tile_n), int(cluster_m), int(split_k))] = t
        options = [c for c in us if gemm_configs._cluster_fits(m, 128, c[2])
                   and gemm_configs._split_fits(m, n, 128, c[1], c[3])]
        cost = {c: gemm_configs.call_time(m, n, *c, k_bytes=2 * k) for c in options}
        best = min(cost.values())
        pick = max((c for c in options if cost[c] <= best * (1 + gemm_configs.TIE)),
                   key=lambda c: (-c[3], c[1], c[2]))
        fastest = min(us.values())
        assert us[pick] <= (1.01 if k >= 16384 else 1.2) * fastest, (m, n, k, pick, us)
        if k >= 16384 and m < 513:
            assert pick[3] > 1, (m, n, k, pick)


MID_NK = [(n, k) for n in (2112, 2880, 4096, 5120, 5376, 6144, 7168, 7680, 8192, 10240, 27648, 57344)
          for k in (2048, 2880, 4096, 8192, 13824, 21504, 32768)]


def test_x_box_fits_m_at_16_to_48_rows():
    """16-bit 64-row tiles at 16 < M <= 48 load M rounded up to 16 rows of x per k-tile (N = 5120
    at M = 18-29 on a long K: 0.73-0.84x cuBLAS with the 64-row box on the H200; 1.05x at
    M = 27 with the 32-row one); FP8 keeps its 64-row box there, M > 48 the whole box."""
    (bf16,) = registry.get_templates(op="bf16_gemm", backend="cute")
    (fp8,) = registry.get_templates(op="f8f8bf16_rowwise", backend="cute")
    for m, (n, k) in itertools.product((17, 26, 32, 33, 48, 49, 64), MID_NK):
        c = bf16.heuristic("sm90a", {"dtype": "bfloat16"}, {"M": m, "N": n, "K": k})
        assert c["tile_m"] == 64 and "split_k" not in c, (m, n, k, c)
        assert c.get("x_rows") == (32 if m <= 32 else 48 if m <= 48 else None), (m, n, k, c)
        c8 = fp8.heuristic("sm90a", {"bias": "none", "fast_accum": True}, {"M": m, "N": n, "K": k})
        assert "x_rows" not in c8, (m, n, k, c8)


def test_fp8_fast_accum_takes_ping_pong_where_the_pick_s_epilogues_cost_more():
    """Ping-pong FP8 tiles, as timed on the H200 against the heuristic's earlier pick (every
    ping-pong config at 30 shapes; docs/benchmarks.md "FP8 ping-pong"): taken at M = 5010 on
    7168 x 2048 (123.7 -> 108.7 us), 8192^3 (806 -> 780) and M = 2018 on 28672 x 4096 (373.8 ->
    350.3); not at long K (M = 3162 on 5120 x 32768: 0.91x the pick), nor below
    PINGPONG_M_MIN (M = 907 on 4096 x 8192: 0.77x the pick), nor for 16-bit or promoted FP8 (slower
    nearly everywhere there)."""
    (fp8,) = registry.get_templates(op="f8f8bf16_rowwise", backend="cute")
    (bf16,) = registry.get_templates(op="bf16_gemm", backend="cute")

    def pick(m, n, k, fast=True):
        return fp8.heuristic("sm90a", {"bias": "none", "fast_accum": fast}, {"M": m, "N": n, "K": k})

    assert pick(5010, 7168, 2048) == {**gemm_configs._config(128, 160, 2, pingpong=True), "promote": 0}
    assert pick(8192, 8192, 8192) == {**gemm_configs._config(128, 192, 2, pingpong=True), "promote": 0}
    assert pick(2018, 28672, 4096)["pingpong"] == 1
    # From PINGPONG_ALWAYS_M rows always (timed on fresh draws, docs/benchmarks.md "FP8 at large M:
    # ping-pong from 4096 rows"): M = 11000 on 4096 x 14336 1013 -> 912 us, M = 12573 on
    # 27648 x 5120 2753 -> 2496 (the 192-row picks before), M = 9693 on 7168 x 18432 1924 -> 1864
    # (a 256-row pick before).
    assert pick(11000, 4096, 14336) == {**gemm_configs._config(128, 160, 2, pingpong=True), "promote": 0}
    assert pick(12573, 27648, 5120) == {**gemm_configs._config(128, 192, 2, pingpong=True), "promote": 0}
    assert pick(9693, 7168, 18432)["pingpong"] == 1
    assert "pingpong" not in pick(3162, 5120, 32768)
    assert "pingpong" not in pick(907, 4096, 8192)
    for m, n, k in itertools.product(LARGE_M, LAYERS_N, (1024, 8192)):
        assert "pingpong" not in pick(m, n, k, fast=False)
        assert "pingpong" not in bf16.heuristic("sm90a", {"dtype": "bfloat16"}, {"M": m, "N": n, "K": k})
        if m < gemm_configs.PINGPONG_M_MIN:
            assert "pingpong" not in pick(m, n, k)


def test_fp8_fast_accum_takes_256_row_tiles_where_measured_faster():
    """256-row FP8 tiles, as timed on the H200 against the earlier pick (docs/benchmarks.md
    "256-row tiles"): taken at M = 1481 on 57344 x 8192 (1133 -> 1031 us) and, before ping-pong
    took every FP8 call from PINGPONG_ALWAYS_M rows, at M = 7105 on 36864 x 7168 (2999 -> 2849);
    not below WIDE_M_MIN (M = 774 on 5120 x 8192: 0.87x the old pick), not over a ping-pong pick
    (M = 5096 on 57344 x 8192 and 11262 on 5120 x 8192: 0.95x and 0.94x; from PINGPONG_ALWAYS_M
    rows ping-pong was faster than 7 of the 8 256-row picks timed against it, 0.2% slower than the
    eighth), never for 16-bit or promoted FP8."""
    (fp8,) = registry.get_templates(op="f8f8bf16_rowwise", backend="cute")
    (bf16,) = registry.get_templates(op="bf16_gemm", backend="cute")

    def pick(m, n, k, fast=True):
        return fp8.heuristic("sm90a", {"bias": "none", "fast_accum": fast}, {"M": m, "N": n, "K": k})

    assert pick(1481, 57344, 8192)["tile_m"] == 256
    assert pick(7105, 36864, 7168)["pingpong"] == 1
    assert pick(774, 5120, 8192)["tile_m"] != 256
    assert pick(5096, 57344, 8192)["pingpong"] == 1
    assert pick(11262, 5120, 8192)["pingpong"] == 1
    for m, n, k in itertools.product(LARGE_M, LAYERS_N, (1024, 8192)):
        assert pick(m, n, k, fast=False)["tile_m"] != 256
        assert bf16.heuristic("sm90a", {"dtype": "bfloat16"}, {"M": m, "N": n, "K": k})["tile_m"] != 256
        if m < gemm_configs.WIDE_M_MIN:
            assert pick(m, n, k)["tile_m"] != 256


def test_long_k_near_ties_go_to_split_k():
    """A split-K tile the model puts within TIE of an unsplit one wins at more than
    SPLIT_TIE_K_BYTES of K per row (measured on the H200 at M = 204-234 on 5120-wide layers,
    docs/benchmarks.md "Near-ties at a long K")."""
    def pick(m, n, k, fp8=False):
        c = gemm_configs.heuristic({"M": m, "N": n, "K": k}, fp8, fp8)
        return c["tile_m"], c["tile_n"], c["cluster_m"], c.get("split_k", 1), bool(c.get("swap"))

    assert pick(201, 5120, 17920) == (128, 256, 1, 3, True)
    assert pick(215, 5120, 17920) == (128, 256, 1, 3, True)
    assert pick(195, 5120, 32768, fp8=True) == (128, 256, 1, 3, True)


def test_short_k_near_ties_stay_unsplit(monkeypatch):
    """A near-tie at no more than SPLIT_TIE_K_BYTES of K per row goes to the unsplit tile (the
    FP8 one above, with the threshold raised past its K)."""
    monkeypatch.setattr(gemm_configs, "SPLIT_TIE_K_BYTES", 32768)
    config = gemm_configs.heuristic({"M": 195, "N": 5120, "K": 32768}, True, True)
    assert config.get("split_k", 1) == 1 and config.get("swap")


def test_narrow_16_bit_tiles_pay_for_their_shared_memory_reads():
    """A 16-bit wgmma narrower than ~96 columns is bound by its shared-memory reads: the model
    charges it (SMEM_READ_FACTOR), so bf16 mid-M picks that were swapped 128 x 80 tiles (measured
    5-18% slower on the H200) take wider ones; FP8 keeps its narrow picks."""
    assert gemm_configs.wgmma_smem_bound(64) == pytest.approx(1.2)
    assert gemm_configs.wgmma_smem_bound(80) == pytest.approx(1.08)
    assert gemm_configs.wgmma_smem_bound(96) == gemm_configs.wgmma_smem_bound(256) == 1.0

    def pick(m, n, k, fp8=False):
        c = gemm_configs.heuristic({"M": m, "N": n, "K": k}, fp8, fp8)
        return c["tile_m"], c["tile_n"], c["cluster_m"], c.get("split_k", 1), bool(c.get("swap"))

    for m, n, k in ((528, 7168, 5120), (552, 7168, 16384), (146, 36864, 7168), (516, 7168, 16384)):
        assert pick(m, n, k)[1] > 80, (m, n, k)
    assert pick(217, 2880, 4096, fp8=True)[1] == 64
