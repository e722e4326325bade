"""The grouped GEMM templates' config space and heuristic model (CPU, no DSL), and the group
sizes the examples and tests draw."""
import pytest

from mslk_dsl import registry
from mslk_dsl.ops.grouped_gemm import split_rows
from mslk_dsl.templates import _flydsl_grouped_gemm as fly_grouped
from mslk_dsl.templates import _grouped_gemm_space as space

PREFILL = [dict(M=32768, N=4096, K=7168, G=128), dict(M=32768, N=7168, K=2048, G=128),
           dict(M=8192, N=16384, K=5120, G=16), dict(M=8192, N=4096, K=14336, G=8)]
DECODE = [dict(M=8, N=4096, K=7168, G=128), dict(M=128, N=4096, K=7168, G=128), dict(M=16, N=28672, K=4096, G=8)]


@pytest.mark.parametrize("problem", PREFILL + DECODE, ids=str)
@pytest.mark.parametrize("op", ["bf16bf16bf16_grouped_stacked", "f8f8bf16_rowwise_grouped_stacked"])
def test_heuristic_picks_a_valid_config(op, problem):
    for template in registry.get_templates(op=op):
        for target in template.targets:
            sig = template.all_signatures()[0]
            config = template.heuristic(target, sig, problem)
            assert config in template.valid_configs(target, sig), (template.name, target, config)


def test_decode_groups_get_64_row_tiles_and_fp8_is_promoted():
    for problem in DECODE:
        assert space.heuristic(problem, fp8=False)["tile_m"] == 64
        assert space.heuristic(problem, fp8=True)["tile_m"] == 64
    for problem in PREFILL:
        assert space.heuristic(problem, fp8=False)["tile_m"] == 128
        fp8 = space.heuristic(problem, fp8=True)
        assert fp8["promote"] == space.FP8_PROMOTE and fp8["tile_n"] <= 128


def test_promoted_fp8_prefill_runs_in_clusters_where_k_is_long_and_groups_large():
    """2x1 clusters (the weight tile multicast to two M tiles of a group): promoted FP8 at K >=
    CLUSTER_K_MIN with >= CLUSTER_GROUP_ROWS rows per busy group (DeepSeek-V3 gate_up, the
    Llama-4-Scout and Mixtral GEMMs); not at K = 2048 (DeepSeek-V3 down: 0.87x the single CTA on
    the H200), not at decode (a pair's second tile would hold no rows), and for 16-bit only where
    DRAM decides (not at these GEMMs on an H200: the next test)."""
    deepseek_gate_up, deepseek_down, scout_gate_up, mixtral_down = PREFILL
    for problem in (deepseek_gate_up, scout_gate_up, mixtral_down):
        assert space.heuristic(problem, fp8=True) == {"tile_m": 128, "tile_n": 128, "promote": 4, "cluster_m": 2}
    assert "cluster_m" not in space.heuristic(deepseek_down, fp8=True)
    for problem in PREFILL[:3] + DECODE:
        assert "cluster_m" not in space.heuristic(problem, fp8=False)
    for problem in DECODE:
        assert "cluster_m" not in space.heuristic(problem, fp8=True)


H100_BANDWIDTH, H200_BANDWIDTH = 3.35e12, 4.8e12


@pytest.mark.parametrize("fp8", [False, True])
def test_pairs_where_the_weight_stream_decides(fp8):
    """2x1 clusters read each weight tile once per pair of M tiles. Timed on an H100 (a draw over
    16 MoE models, docs/benchmarks.md "Grouped GEMMs on drawn MoE shapes"), the pair ran 1.33x
    the single CTA at a DeepSeek-V3-like down GEMM of ~197 rows per expert (256 experts, 7.5 GB
    of bf16 weights read about 1.5 times over by single CTAs); on the H200 the single CTA was
    1.15x the pair at 256 rows per expert over 128 experts (compute decides there)."""
    h100_case, h200_case = dict(M=50416, N=7168, K=2048, G=256), dict(M=32768, N=7168, K=2048, G=128)
    assert space.heuristic(h100_case, fp8, H100_BANDWIDTH).get("cluster_m") == 2
    for problem in (h100_case, h200_case):
        assert "cluster_m" not in space.heuristic(problem, fp8, H200_BANDWIDTH), problem
        assert space.heuristic(problem, fp8) == space.heuristic(problem, fp8, H200_BANDWIDTH)
    # the pair reads the weights once where single CTAs read them again; its compute pays for
    # the odd last tiles of the groups
    single, pair = {"tile_m": 128, "tile_n": 256}, {"tile_m": 128, "tile_n": 256, "cluster_m": 2}
    slow_dram = space.seconds(single, h100_case, fp8, 1e11), space.seconds(pair, h100_case, fp8, 1e11)
    assert slow_dram[1] < 0.8 * slow_dram[0]
    fast_dram = space.seconds(single, h200_case, fp8, 1e16), space.seconds(pair, h200_case, fp8, 1e16)
    assert fast_dram[1] > fast_dram[0]
    assert space.seconds(pair, dict(M=0, N=7168, K=2048, G=8), fp8) == 0.0
    # decode never pairs, whatever the bandwidth
    for problem in DECODE:
        assert "cluster_m" not in space.heuristic(problem, fp8, H100_BANDWIDTH), problem


def test_the_templates_read_the_gpu_bandwidth(monkeypatch):
    """The CuTe grouped templates hand the current GPU's DRAM bandwidth to the model: an H100's
    makes the DeepSeek-V3-like down GEMM a pair, no GPU (None) leaves the H200 default's single CTA."""
    from mslk_dsl import device

    problem = dict(M=50416, N=7168, K=2048, G=256)
    for op in ("bf16bf16bf16_grouped_stacked", "f8f8bf16_rowwise_grouped_stacked"):
        (template,) = registry.get_templates(op=op, backend="cute")
        sig = template.all_signatures()[0]
        for bandwidth, pair in ((H100_BANDWIDTH, True), (None, False)):
            monkeypatch.setattr(device, "memory_bandwidth", lambda b=bandwidth: b)
            assert (template.heuristic("sm90a", sig, problem).get("cluster_m") == 2) is pair, (op, bandwidth)


def test_active_groups():
    # Rows fall on the groups at random: 16 rows over 16 groups fill about 10.3 of them.
    assert space.active_groups(0, 8) == 0 and space.active_groups(8, 128) == 8
    assert space.active_groups(16, 16) == 11 and space.active_groups(1, 128) == 1
    assert space.active_groups(32768, 128) == 128 and space.active_groups(128, 128) == 82


def test_the_flydsl_templates_tile_decode_groups_by_one_average_group():
    assert fly_grouped.grouped_problem(dict(M=128, N=64, K=64, G=128))["M"] == 1
    assert fly_grouped.grouped_problem(dict(M=32768, N=64, K=64, G=128))["M"] == 32768


# Drawn grouped GEMMs (M, N, K, G) whose busy groups fit one M tile, every config timed (H100,
# docs/benchmarks.md "Grouped GEMMs: groups of one M tile"). 34-53 expected rows per busy expert:
# 64 x 128 ran 0.979-1.000 of the fastest config, the earlier 64 x 256 pick 0.962-0.991.
ONE_64_ROW_TILE = [dict(M=15448, N=7168, K=2048, G=384), dict(M=336, N=32768, K=6144, G=8),
                   dict(M=6800, N=3072, K=4096, G=128), dict(M=637, N=5120, K=8192, G=16),
                   dict(M=11928, N=4096, K=7168, G=256), dict(M=3020, N=2048, K=1408, G=60),
                   dict(M=4416, N=3072, K=4096, G=128), dict(M=2400, N=2048, K=1024, G=64),
                   dict(M=4792, N=2048, K=768, G=128)]
# 58-111 rows: 128 x 128 ran 0.984-1.000, the DRAM model's 128 x 256 (single or paired) 0.922-0.992.
ONE_128_ROW_TILE = [dict(M=1848, N=2880, K=2880, G=32), dict(M=1004, N=21504, K=6144, G=16),
                    dict(M=1086, N=4096, K=6400, G=16), dict(M=4272, N=2816, K=2048, G=60),
                    dict(M=20192, N=4096, K=7168, G=256), dict(M=2868, N=5760, K=2880, G=32),
                    dict(M=5744, N=2048, K=1024, G=64), dict(M=7112, N=3584, K=2560, G=64)]
# 120-128 rows, where about half the groups overflow a 128-row tile and 128 x 256 tiles, mostly
# in 2x1 pairs, won (128 x 128: 0.76-0.98 of the fastest): left to the DRAM model.
OVERFLOWING = [dict(M=32728, N=7168, K=2048, G=256), dict(M=31880, N=4096, K=7168, G=256),
               dict(M=3908, N=5760, K=2880, G=32), dict(M=1992, N=16384, K=5120, G=16),
               dict(M=16288, N=2048, K=768, G=128), dict(M=1978, N=4096, K=6400, G=16)]


@pytest.mark.parametrize("fp8", [False, True])
def test_groups_of_one_m_tile_take_that_tile_128_wide(fp8):
    """Past the swapped decode tiles, where a busy group's rows (spread about r by about sqrt(r))
    fit one 64-row tile, 64 x 128; where they fit one 128-row tile, 128 x 128; promoted or not as
    the call's accumulation asks. Larger groups go to the DRAM model, at either bandwidth."""
    for fast in ((False, True) if fp8 else (False,)):
        promote = ({"promote": 0 if fast else space.FP8_PROMOTE} if fp8 else {})
        for tile_m, problems in ((64, ONE_64_ROW_TILE + [dict(M=0, N=4096, K=4096, G=8)]), (128, ONE_128_ROW_TILE)):
            for problem in problems:
                for bandwidth in (H100_BANDWIDTH, H200_BANDWIDTH):
                    pick = space.heuristic(problem, fp8, bandwidth, fast_accum=fast)
                    assert pick == {"tile_m": tile_m, "tile_n": 128, **promote}, (problem, pick)
        for problem in OVERFLOWING:
            rows = problem["M"] / space.active_groups(problem["M"], problem["G"])
            assert space.one_tile(rows) is None and space.band(problem["M"], problem["G"]) == "DRAM model", problem
            # on the H100 the pairs the sweeps found fastest there
            assert space.heuristic(problem, fp8, H100_BANDWIDTH, fast_accum=fast).get("cluster_m") == 2, problem
    op = "f8f8bf16_rowwise_grouped_stacked" if fp8 else "bf16bf16bf16_grouped_stacked"
    (template,) = registry.get_templates(op=op, backend="cute")
    for sig in template.all_signatures():
        for problem in (ONE_64_ROW_TILE[0], ONE_128_ROW_TILE[0]):
            assert template.heuristic("sm90a", sig, problem) in template.valid_configs("sm90a", sig), (sig, problem)
    assert [space.one_tile(r) for r in (33, 56, 57, 117, 118)] == [64, 64, 128, 128, None]
    assert space.band(16, 16) == "swapped" and space.band(0, 8) == "one 64-row tile"
    assert [space.band(p["M"], p["G"]) for p in (ONE_64_ROW_TILE[0], ONE_128_ROW_TILE[0])] == [
        "one 64-row tile", "one 128-row tile"]


@pytest.mark.parametrize("total,groups,empty_every", [(0, 3, 0), (1, 1, 0), (37, 4, 0), (777, 8, 3), (5, 128, 0),
                                                      (4096, 128, 4), (10, 3, 1)])
def test_split_rows(total, groups, empty_every):
    sizes = split_rows(total, groups, seed=total + groups, empty_every=empty_every)
    assert len(sizes) == groups and sum(sizes) == total and min(sizes) >= 0
    if empty_every > 1:
        assert all(sizes[g] == 0 for g in range(0, groups, empty_every))


# The three MoE layers' decode GEMMs (T 16 and 128: rows, G, gate_up N / K) timed for the swapped
# tiles, and the token tile each took: 32 at 1.5-8 expected rows per busy expert, 64 at 32.
MEASURED_DECODE = [(dict(M=128, N=4096, K=7168, G=128), 32), (dict(M=1024, N=7168, K=2048, G=128), 32),
                   (dict(M=16, N=16384, K=5120, G=16), 32), (dict(M=128, N=5120, K=8192, G=16), 32),
                   (dict(M=32, N=28672, K=4096, G=8), 32), (dict(M=256, N=4096, K=14336, G=8), 64)]


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_takes_swapped_64_row_tiles(fp8):
    """Swapped tiles are in both CuTe templates' spaces (single CTAs, token tiles of 32 or 64 rows;
    FP8 promoted and not, each serving its accumulation). The heuristic takes the 64-row one where
    a busy group expects at most SWAP_GROUP_ROWS rows, with the token tile measured fastest at the
    decode GEMMs timed, and never at prefill or past that (48 rows per group: an unswapped 64-row
    tile mostly full)."""
    op = "f8f8bf16_rowwise_grouped_stacked" if fp8 else "bf16bf16bf16_grouped_stacked"
    swapped = space.FP8_SWAP_CONFIGS if fp8 else space.BF16_SWAP_CONFIGS
    (template,) = registry.get_templates(op=op, backend="cute")
    assert {c["tile_n"] for c in swapped} == {32, 64} and all("cluster_m" not in c for c in swapped)
    for sig in template.all_signatures():
        served = [c for c in swapped if not fp8 or (c["promote"] == 0) == sig["fast_accum"]]
        assert served and all(c in template.valid_configs("sm90a", sig) for c in served), sig
    for fast in ((False, True) if fp8 else (False,)):
        for problem, tokens in MEASURED_DECODE + [(dict(M=1, N=5120, K=8192, G=16), 32),
                                                  (dict(M=8, N=4096, K=7168, G=128), 32)]:
            pick = space.heuristic(problem, fp8, fast_accum=fast)
            assert pick.get("swap") and (pick["tile_m"], pick["tile_n"]) == (64, tokens), (problem, pick)
            assert pick.get("promote") == ((0 if fast else space.FP8_PROMOTE) if fp8 else None)
        for problem in PREFILL + [dict(M=384, N=4096, K=4096, G=8)]:
            assert not space.heuristic(problem, fp8, fast_accum=fast).get("swap"), problem


def test_model_ties_go_to_the_pair():
    """Where compute decides both and the groups hold whole pairs, a 2x1 cluster and a single CTA
    model the same time; the pair, which moves half the weight bytes from L2, takes the tie: the
    Mixtral-like down GEMM (K 14336, 1024 rows per expert), in bf16 and with fast FP8 accumulation."""
    mixtral_down = PREFILL[3]
    single, pair = {"tile_m": 128, "tile_n": 256}, {"tile_m": 128, "tile_n": 256, "cluster_m": 2}
    for fp8 in (False, True):
        assert space.seconds(single, mixtral_down, fp8) == space.seconds(pair, mixtral_down, fp8)
    assert space.heuristic(mixtral_down, fp8=False) == pair
    assert space.heuristic(mixtral_down, fp8=True, fast_accum=True) == {**pair, "promote": 0}
    # where the pair's odd last tiles cost compute, the single CTA stays
    assert space.heuristic(dict(mixtral_down, M=1500), fp8=False) == single


def test_fast_accumulation_takes_unpromoted_tiles():
    """use_fast_accum (MSLK's grouped FP8 kernels always accumulate so) serves only unpromoted
    configs, and promoted calls only promoted ones. At the three MoE layers' prefill GEMMs the
    fast pick is the unpromoted 128 x 256 tile (in a 2x1 cluster at Mixtral's down, a model tie),
    the fastest config at 4 of the 6 on the H200 (docs/benchmarks.md "Grouped GEMMs: fast
    accumulation"); promoted calls keep their picks."""
    (template,) = registry.get_templates(op="f8f8bf16_rowwise_grouped_stacked", backend="cute")
    for sig in template.all_signatures():
        for config in template.valid_configs("sm90a", sig):
            assert (config["promote"] == 0) == sig["fast_accum"], (sig, config)
    for problem in PREFILL:
        pair = {"cluster_m": 2} if problem is PREFILL[3] else {}
        assert space.heuristic(problem, fp8=True, fast_accum=True) == {"tile_m": 128, "tile_n": 256, "promote": 0,
                                                                      **pair}
        fast = template.heuristic("sm90a", {"index_dtype": "int32", "fast_accum": True}, problem)
        slow = template.heuristic("sm90a", {"index_dtype": "int32", "fast_accum": False}, problem)
        assert fast["promote"] == 0 and slow == space.heuristic(problem, fp8=True), (fast, slow)


def test_a_swapped_tile_in_a_cluster_is_a_config_error():
    pytest.importorskip("cutlass")
    from mslk_dsl.errors import ConfigError

    (template,) = registry.get_templates(op="bf16bf16bf16_grouped_stacked", backend="cute")
    with pytest.raises(ConfigError, match="bf16bf16bf16_grouped_stacked_cute: swapped tiles run in single CTAs"):
        template.build({"tile_m": 64, "tile_n": 32, "swap": 1, "cluster_m": 2}, "sm90a", {"index_dtype": "int32"})
