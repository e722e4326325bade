"""The MoE and index_shuffling templates as kernel classes: config checks, the limits shared with
the op layer, and compiles of a few configs per backend (the full matrix is in
test_compile_templates.py). FlyDSL keys its compile caches on the class of ``self``, so several
configs of one FlyDSL kernel class compiled in one process must still each get their own kernel:
the FlyDSL test builds two configs of each class in one child and reads each one's ISA."""
import re
import textwrap

import pytest
from support import have_lld, run_python

from mslk_dsl import aot, registry
from mslk_dsl.cache import KernelCache
from mslk_dsl.keys import KernelKey
from mslk_dsl.ops import moe
from mslk_dsl.templates import _gather_scatter_space as gather_scatter
from mslk_dsl.templates import _index_shuffling_space as space
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _rowwise_plan as plan
from mslk_dsl.templates import _rowwise_space as rowwise_space


@pytest.mark.parametrize("configs, wave", [(space.CUTE_CONFIGS, 32), (space.FLYDSL_CONFIGS, 64)])
def test_every_listed_index_shuffling_config_passes_its_checks(configs, wave):
    for config in configs:
        space.check("t", config, wave)


@pytest.mark.parametrize("config, why", [
    ({"max_experts": 48, "lanes": 8, "warps": 32}, "max_experts must be a power of two"),
    ({"max_experts": 1024, "lanes": 8, "warps": 32}, "max_experts must be a power of two"),
    ({"max_experts": 64, "lanes": 4, "warps": 32}, "lanes must be a power of two"),
    ({"max_experts": 128, "lanes": 64, "warps": 32}, "lanes must be a power of two"),
    ({"max_experts": 512, "lanes": 16, "warps": 16, "single": True}, "single runs both steps in one block"),
])
def test_an_index_shuffling_config_check_names_the_template_and_config(config, why):
    with pytest.raises(ValueError, match=why) as raised:
        space.check("index_shuffling_cute", config, 32)
    assert "index_shuffling_cute" in str(raised.value) and str(config) in str(raised.value)


def test_rowwise_config_checks_name_the_template_and_config():
    unaligned = {"dtype": "bfloat16", "vec_bytes": 2}
    with pytest.raises(ValueError, match=r"^quantize_fp8_row_cute: config \{.*'vec': 8"):
        plan.check("quantize_fp8_row_cute", plan.config(256, 1, 8, 4), unaligned, arrays=1)
    assert plan.check("silu_mul_cute", plan.config(256, 1, 1, 8), unaligned, arrays=2).tile_k == 2048
    with pytest.raises(ValueError, match=r"^silu_mul_quant_flydsl: config \{.*'vec': 8"):
        rowwise_space.check("silu_mul_quant_flydsl", {"threads": 256, "rows_per_block": 1, "vec": 8}, unaligned)


def test_rowwise_fitted_and_clustered_tiles():
    """Rows held by any whole number of warps only with one row per CTA; clusters of 2 or 4 CTAs
    only with one row per CTA; the L1 policy is "keep" or "stream"; row_k counts every CTA."""
    bf16 = {"dtype": "bfloat16", "vec_bytes": 16}
    for threads in (96, 160, 224):
        assert plan.valid(plan.config(threads, 1, 8, 4), bf16)
    assert not plan.valid(plan.config(160, 2, 8, 4), bf16)        # 80 threads per row
    assert not plan.valid(plan.config(100, 1, 8, 4), bf16)        # not whole warps
    assert plan.valid({**plan.config(224, 1, 8, 4), "cluster": 2, "l1": "stream"}, bf16)
    assert not plan.valid({**plan.config(256, 2, 8, 4), "cluster": 2}, bf16)
    assert not plan.valid({**plan.config(256, 1, 8, 4), "cluster": 3}, bf16)
    assert not plan.valid({**plan.config(256, 1, 8, 4), "l1": "evict_first"}, bf16)
    assert plan.RowTile.of({**plan.config(224, 1, 8, 4), "cluster": 2}).row_k == 14336


def test_pick_fitted_reads_a_row_in_the_fewest_most_even_passes():
    bf16 = {"dtype": "bfloat16", "vec_bytes": 16}
    c96, c256x3 = plan.config(96, 1, 8, 4), plan.config(256, 2, 8, 3)
    c224, c256 = plan.config(224, 1, 8, 4), plan.config(256, 1, 8, 4)
    assert plan.pick_fitted([c96, c256x3, c256], bf16, 2880) == c96          # a tie: list order
    assert plan.pick_fitted([c256x3, c96, c256], bf16, 2880) == c256x3
    assert plan.pick_fitted([c256, c224], bf16, 14336) == c224               # 2 x 7168, not 8192 + 6144
    assert plan.pick_fitted([c256, c224], bf16, 16384) == c256
    assert plan.pick_fitted([c256, c224], bf16, 8000) == c256                # one pass beats two


def test_memory_bound_heuristics_take_the_measured_configs():
    """The configs docs/benchmarks.md measured fastest (H200, bf16): the default L1 policy, the
    fitted one-row CTAs, the quantizers' staged tiles up to 16384, silu_mul_quant's 2-CTA
    cluster past them (80 registers), rmsnorm's
    clusters of 256-thread CTAs for rows past 16K, the linked scatter with pdl."""
    def pick(op, sig, problem):
        (t,) = registry.get_templates(op=op, backend="cute")
        return t.heuristic("sm90a", sig, problem)

    q = {"dtype": "bfloat16", "vec_bytes": 16, "has_scale_ub": False}
    for op in ("quantize_fp8_row", "silu_mul_quant"):
        for k, threads in ((2880, 96), (5120, 160)):
            assert pick(op, q, {"M": 8, "K": k}) == {**plan.config(threads, 1, 8, 4), "l1": "keep"}
    assert pick("silu_mul_quant", q, {"M": 8, "K": 7168}) == {**plan.config(224, 1, 8, 4), "l1": "keep"}
    # longer rows: staged tiles (the first tile in shared memory; quantize_fp8_row's from 7168,
    # silu_mul_quant's past 8192 in 16-byte accesses, with cp.async.cg: "stream")
    staged = {"stage": "smem"}
    for k, threads, chunks in ((7168, 224, 4), (14336, 224, 8), (16384, 256, 8)):
        assert pick("quantize_fp8_row", q, {"M": 8, "K": k}) == {**plan.config(threads, 1, 8, chunks), **staged,
                                                                 "l1": "keep"}
    for k, threads, chunks in ((11008, 256, 6), (14336, 224, 8)):
        assert pick("silu_mul_quant", q, {"M": 8, "K": k}) == {**plan.config(threads, 1, 8, chunks), **staged,
                                                               "l1": "stream"}
    words = {**q, "vec_bytes": 8}   # rows of 8-byte accesses: staged from 7168, with .ca copies
    assert pick("silu_mul_quant", words, {"M": 8, "K": 7628}) == {**plan.config(256, 1, 8, 4), **staged, "l1": "keep"}
    e = {"dtype": "bfloat16", "vec_bytes": 16}
    for k, threads, chunks in ((2880, 96, 4), (4608, 160, 4), (5120, 160, 4), (6144, 192, 4), (7168, 128, 7),
                               (14336, 256, 7)):
        assert pick("silu_mul", e, {"M": 8, "K": k}) == plan.config(threads, 1, 8, chunks), k
    assert pick("silu_mul_quant", q, {"M": 8, "K": 16392}) == {**plan.config(224, 1, 8, 4), "cluster": 2, "l1": "keep"}
    for op in ("rmsnorm", "rmsnorm_add"):
        for dtype, k, cluster in (("bfloat16", 21184, 2), ("bfloat16", 32768, 2), ("bfloat16", 65536, 4),
                                  ("bfloat16", 131072, 8), ("bfloat16", 262144, 16), ("float32", 16384, 2),
                                  ("bfloat16", 33256, 2), ("bfloat16", 37448, 2), ("bfloat16", 37456, 4)):
            n = {"dtype": dtype, "vec_bytes": 16, "fp32_weight": False}
            assert pick(op, n, {"M": 1, "N": k}) == {**plan.config(256, 1, 16 // plan.ELEM_BYTES[dtype], 8),
                                                      "cluster": cluster}, (op, dtype, k)
        # A row at most 1/8 past a tile takes that tile and streams the rest (16-byte rows and
        # rows of 4-byte accesses alike); further past it, the next tile up.
        for vec_bytes, k, (threads, rows) in ((16, 4104, (128, 2)), (4, 4098, (128, 2)), (16, 8200, (128, 1)),
                                              (16, 16568, (256, 1)), (4, 16898, (256, 1)), (16, 16728, (256, 1)),
                                              (16, 5120, (128, 1)), (4, 5122, (128, 1)), (4, 4690, (128, 1))):
            n = {"dtype": "bfloat16", "vec_bytes": vec_bytes, "fp32_weight": False}
            assert pick(op, n, {"M": 8, "N": k}) == plan.config(threads, rows, 8, 8), (op, vec_bytes, k)
        for k in (23980, 18434 + 2048):   # rests of 32% and 20%: the 2-CTA cluster
            n = {"dtype": "bfloat16", "vec_bytes": 4, "fp32_weight": False}
            assert pick(op, n, {"M": 8, "N": k}) == {**plan.config(256, 1, 8, 8), "cluster": 2}, (op, k)
    # Unaligned rows past 16K: a cluster of 2 or 4 512-thread CTAs where its capacity (32K or 64K)
    # is less than what the single CTA streams (the row, plus the rest past 16K read again per
    # input: x, and rmsnorm_add's residual), or where the rows are fewer than the SMs.
    u = {"dtype": "bfloat16", "vec_bytes": 2, "fp32_weight": False}
    cases = {"rmsnorm": ((2009, 16898, 1), (1524, 24576, 1), (1524, 24577, 2), (1524, 40960, 1),
                         (1524, 40961, 4), (34, 16898, 2), (411, 70001, 4)),
             "rmsnorm_add": ((2009, 16898, 1), (804, 21845, 1), (804, 21846, 2), (1524, 32771, 4),
                             (34, 16898, 2), (411, 50985, 4))}
    # rmsnorm's single CTAs read the weight in 16-byte loads, capped at 64 registers
    # (rmsnorm_cute.WEIGHT_VECTOR_FROM); rmsnorm_add's do not.
    vectors = {"weight": "vectors"}
    capped = {**vectors, "regs": 64}
    for op, shapes in cases.items():
        for rows, k, cluster in shapes:
            want = {**plan.config(512, 1, 1, 32), **({"cluster": cluster} if cluster > 1 else {})}
            if op == "rmsnorm" and cluster == 1:
                want |= capped
            assert pick(op, u, {"M": rows, "N": k}) == want, (op, rows, k)
    # Up to 16K: rmsnorm streams the rest from 2048 / 8192 tiles of at most 256 threads, rmsnorm_add
    # (two inputs read again) takes the covering tile (rmsnorm_cute.SCALAR_STREAMED_TILES).
    assert pick("rmsnorm", u, {"M": 2, "N": 16383}) == {**plan.config(256, 1, 1, 32), **capped}
    assert pick("rmsnorm", u, {"M": 5, "N": 4095}) == {**plan.config(128, 2, 1, 32), **vectors}
    assert pick("rmsnorm", u, {"M": 5, "N": 1085}) == plan.config(128, 4, 1, 32)   # 1024: no gain measured
    assert pick("rmsnorm", u | {"fp32_weight": True}, {"M": 5, "N": 4095}) == plan.config(128, 2, 1, 32)
    assert pick("rmsnorm_add", u, {"M": 2, "N": 16383}) == plan.config(512, 1, 1, 32)
    assert pick("rmsnorm_add", u, {"M": 5, "N": 4095}) == plan.config(256, 1, 1, 16)
    g = {"dtype": "bfloat16", "vec_bytes": 16, "score_dtype": "float32"}
    assert pick("gather_scale_quant_dense_tokens", g, {"A": 8, "D": 5120}) == {**plan.config(160, 1, 8, 4),
                                                                                "l1": "keep"}
    s = {"dtype": "bfloat16", "vec_bytes": 16, "has_valid_count": False}
    assert pick("scatter_add_dense_tokens", s, {"A": 23300, "D": 2880, "T": 11650}) == {
        "unroll": 4, "method": "linked", "pdl": True}
    assert pick("scatter_add_dense_tokens", s, {"A": 200, "D": 2880, "T": 100})["method"] == "atomic"
    # Just under 32 MiB of rows: linked for top-2 (tokens of two rows), atomic for top-1; under
    # 20 MiB atomic for both.
    assert pick("scatter_add_dense_tokens", s, {"A": 3276, "D": 5120, "T": 1638})["method"] == "linked"
    assert pick("scatter_add_dense_tokens", s, {"A": 3276, "D": 5120, "T": 3276})["method"] == "atomic"
    assert pick("scatter_add_dense_tokens", s, {"A": 1312, "D": 5120, "T": 164})["method"] == "atomic"
    # Tokens of 16 or more rows each take the fp32 sums at any size (atomics would round after
    # every one of the additions meeting on an element): two random calls that missed by 1.75 / 4.5
    assert pick("scatter_add_dense_tokens", s, {"A": 56424, "D": 1, "T": 1})["method"] == "linked"
    assert pick("scatter_add_dense_tokens", s, {"A": 257923, "D": 34, "T": 336})["method"] == "linked"
    assert pick("scatter_add_dense_tokens", s, {"A": 150, "D": 64, "T": 9})["method"] == "linked"
    assert pick("scatter_add_dense_tokens", s, {"A": 150, "D": 64, "T": 10})["method"] == "atomic"
    fly = registry.get_template("moe_gather_scatter_flydsl.scatter_add_dense_tokens")
    assert fly.heuristic("gfx942", s, {"A": 257923, "D": 34, "T": 336})["method"] == "sorted"
    assert fly.heuristic("gfx942", s, {"A": 150, "D": 64, "T": 10})["method"] == "atomic"


def test_rmsnorm_add_with_an_fp32_residual_halves_the_vectors_of_4_byte_rows():
    """rmsnorm_add's fp32-residual kernels on rows of 4-byte accesses of x take the same row tile
    in twice the threads, 4 vectors each (rmsnorm_cute.HALVED_TWINS: the tiles of 8 vectors spilled
    there); rows of 8- and 16-byte accesses and the same-dtype form keep their tiles; the twins
    serve no other signature."""
    from mslk_dsl.templates import rmsnorm_cute

    (t,) = registry.get_templates(op="rmsnorm_add", backend="cute")
    base = {"dtype": "bfloat16", "fp32_weight": False}
    for n, plain, twin in ((7170, (128, 1, 8), (256, 1, 4)), (2050, (128, 4, 8), (256, 4, 4)),
                           (3074, (128, 2, 8), (256, 2, 4)), (14338, (256, 1, 8), (512, 1, 4)),
                           (1538, (128, 4, 8), (256, 4, 4))):
        for vec_bytes, residual, want in ((4, True, twin), (4, False, plain), (8, True, plain)):
            sig = {**base, "vec_bytes": vec_bytes, "fp32_residual": residual}
            got = t.heuristic("sm90a", sig, {"M": 4096, "N": n + vec_bytes - 4})
            assert (got["threads"], got["rows_per_block"], got["chunks"]) == want, (n, vec_bytes, residual, got)
            assert t.valid(got, "sm90a", sig)
    for config in rmsnorm_cute.FP32_RESIDUAL_CONFIGS:
        assert not t.valid(config, "sm90a", {**base, "vec_bytes": 16, "fp32_residual": False})
        assert t.valid(config, "sm90a", {**base, "vec_bytes": 16, "fp32_residual": True})
    (plain_norm,) = registry.get_templates(op="rmsnorm", backend="cute")
    assert not set(map(str, rmsnorm_cute.FP32_RESIDUAL_CONFIGS)) & set(map(str, plain_norm.all_configs()))


def test_a_cute_gemm_config_check_names_the_template_and_config():
    run_python(textwrap.dedent("""
        from mslk_dsl.templates import _cute_gemm_sm90 as sm90
        try:
            sm90.HopperGemm((64, 80), split_k=2, cluster_m=2, template="bf16_gemm_cute")
        except ValueError as e:
            message = str(e)
        assert message.startswith("bf16_gemm_cute: config {'tile_mn': (64, 80), 'cluster_m': 2"), message
        assert "tile_n a multiple of 32 from 64 to 256" in message and "split-K runs with cluster_m 1" in message, message
        sm90.HopperGemm((64, 128), template="bf16_gemm_cute")
        sm90.HopperGemm((128, 224), cluster_m=2, template="bf16_gemm_cute")
    """), env={"CUTE_DSL_ARCH": "sm_90a"})


def test_split_k_reduction_launches_early_unless_it_would_crowd_the_idle_sms():
    """The 64-row split-K reduction starts while the GEMM runs only where its blocks would land at
    most 4 to an SM the GEMM leaves idle, or where the GEMM leaves none idle (then they start as
    its CTAs finish); both sides of the bound."""
    run_python(textwrap.dedent("""
        from mslk_dsl.templates import _cute_gemm_sm90 as sm90
        gemm = sm90.HopperGemm((64, 256), split_k=4, x_rows=16, template="bf16_gemm_cute")
        assert gemm.second_kernel and not gemm.fix_up_in_place
        early = {(blocks, ctas): bool(gemm._launch_early(blocks, ctas))
                 for blocks, ctas in ((16, 128), (17, 128), (1, 131), (8, 131), (144, 96), (145, 96),
                                      (64, 132), (5000, 132))}
        assert early == {(16, 128): True, (17, 128): False, (1, 131): True, (8, 131): False,
                         (144, 96): True, (145, 96): False, (64, 132): True, (5000, 132): True}, early
        assert not sm90.HopperGemm((128, 128), split_k=2, template="bf16_gemm_cute").second_kernel
        assert sm90.HopperGemm((128, 256), cluster_m=2, stream_k=True, template="bf16_gemm_cute").second_kernel
    """), env={"CUTE_DSL_ARCH": "sm_90a"})


def test_index_shuffling_heuristics_pick_the_smallest_size_that_holds_e():
    picks = {name: [registry.get_template(name).heuristic("x", {}, {"E": e})["max_experts"]
                    for e in (1, 32, 33, 64, 65, 128, 129, 256, 257, 320, 512)]
             for name in ("index_shuffling_cute", "index_shuffling_flydsl")}
    assert picks["index_shuffling_cute"] == picks["index_shuffling_flydsl"] == \
        [32, 32, 64, 64, 128, 128, 256, 256, 512, 512, 512]
    # At 256 experts the CuTe template takes 16 lanes of 32 warps, the FlyDSL one 16 lanes of 8 waves.
    assert registry.get_template("index_shuffling_cute").heuristic("x", {}, {"E": 256}) == \
        {"max_experts": 256, "lanes": 16, "warps": 32}
    assert registry.get_template("index_shuffling_flydsl").heuristic("x", {}, {"E": 256}) == \
        {"max_experts": 256, "lanes": 16, "waves": 8}


def test_index_shuffling_takes_one_launch_where_its_tokens_fit_one_route_step():
    """The CuTe heuristic's single-block twin (both steps in one launch) where the two kernels would
    route every token in one chunk: T up to 32 warps x 32 / lanes; past that, and where the
    size's config has no twin (16-warp blocks) or the template none (FlyDSL), the two kernels."""
    cute_t, fly_t = (registry.get_template(n) for n in ("index_shuffling_cute", "index_shuffling_flydsl"))
    for e, lanes in ((16, 8), (128, 8), (256, 16)):
        step = 1024 // lanes
        assert cute_t.heuristic("x", {}, {"T": 1, "E": e}).get("single") is True
        assert cute_t.heuristic("x", {}, {"T": step, "E": e}) == {
            **cute_t.heuristic("x", {}, {"T": step + 1, "E": e}), "single": True}
        assert "single" not in cute_t.heuristic("x", {}, {"T": step + 1, "E": e})
    assert "single" not in cute_t.heuristic("x", {}, {"T": 1, "E": 320})
    assert not any("single" in fly_t.heuristic("x", {}, {"T": t, "E": 128}) for t in (1, 100))
    singles = [c for c in space.CUTE_CONFIGS if c.get("single")]
    assert singles and all(c["warps"] == 32 for c in singles)


def test_the_op_layer_takes_its_moe_limits_from_the_templates():
    assert (moe.MAX_EXPERTS, moe.MAX_TOP_K) == (limits.MAX_EXPERTS, limits.MAX_TOP_K)
    assert [str(d).removeprefix("torch.") for d in moe.SCORE_DTYPES] == list(limits.SCORE_DTYPES)
    # The biggest listed config covers the op's expert limit; the narrowest gives top_k lanes.
    for configs in (space.CUTE_CONFIGS, space.FLYDSL_CONFIGS):
        assert max(c["max_experts"] for c in configs) == limits.MAX_EXPERTS
        assert min(c["lanes"] for c in configs) >= limits.MAX_TOP_K
    assert limits.scatter_workspace_ints(5, 12) == 3 * 5 + 1 + 2 * 12
    assert gather_scatter.vec({"dtype": "bfloat16", "vec_bytes": 16}) * 2 == limits.VECTOR_BYTES


def _build(jobs, out):
    report = aot.build(jobs, str(out), workers=1, progress=False)
    assert report.ok, "failed to compile:\n" + "\n".join(report.failed.values())
    return [KernelCache(str(out)).lookup(j.key) for j in jobs]


def _jobs(name, target, configs, sig):
    t = registry.get_template(name)
    return [aot.Job(KernelKey.make(t, c, target, sig), t.name) for c in configs]


def test_cute_kernel_classes_compile(tmp_path):
    bf16 = {"dtype": "bfloat16", "vec_bytes": 16, "has_valid_count": True}
    jobs = (_jobs("index_shuffling_cute", "sm90a", space.CUTE_CONFIGS[:2],
                  {"score_dtype": "float32", "has_valid_count": True})
            + _jobs("moe_gather_scatter_cute.gather_scale_dense_tokens", "sm90a", [{"unroll": 4}],
                    {**bf16, "score_dtype": "bfloat16"})
            + _jobs("moe_gather_scatter_cute.scatter_add_dense_tokens", "sm90a",
                    [{"unroll": 2, "method": "atomic", "pdl": False}, {"unroll": 2, "method": "sorted", "pdl": False},
                     {"unroll": 2, "method": "sorted", "pdl": True}, {"unroll": 2, "method": "linked", "pdl": True}],
                    bf16))
    for job, entry in zip(jobs, _build(jobs, tmp_path)):
        ptx = open(entry.file("kernel.ptx")).read()
        kernels = len(re.findall(r"\.entry\s", ptx))
        op, method = job.key.parts()["op"], job.key.parts()["config"].get("method")
        assert kernels == {"index_shuffling": 2, "gather_scale_dense_tokens": 1}.get(
            op, {"sorted": 5, "linked": 3}.get(method, 1)), (job.label, kernels)
        if op == "index_shuffling":
            assert re.search(r"shfl\.sync\.bfly", ptx) and re.search(r"shfl\.sync\.up", ptx), job.label
        elif method == "atomic":   # 128-bit vector reductions on aligned bf16 rows
            assert re.search(r"(red|atom)\.global(\.\w+)*\.add(\.noftz)?\.v8\.bf16", ptx), job.label
        else:
            assert re.search(r"ld\.global(\.[\w:]+)*\.v4\.(b32|u32|f32)", ptx), job.label
            # With programmatic dependent launch, kernels 2-5 wait for their predecessor and
            # kernels 1-4 let their successor launch; without it, neither.
            pdl, chained = job.key.parts()["config"].get("pdl", False), kernels - 1
            assert len(re.findall(r"griddepcontrol\.wait", ptx)) == (chained if pdl else 0), job.label
            assert len(re.findall(r"griddepcontrol\.launch_dependents", ptx)) == (chained if pdl else 0), job.label


@pytest.mark.skipif(not have_lld(), reason="FlyDSL needs ld.lld (apt-get install -y lld-19)")
def test_flydsl_kernel_classes_compile_one_kernel_per_config(tmp_path, monkeypatch):
    monkeypatch.setenv("MSLK_DSL_KEEP_ISA", "gfx942")
    bf16 = {"dtype": "bfloat16", "vec_bytes": 16, "has_valid_count": False}
    jobs = (_jobs("index_shuffling_flydsl", "gfx942", space.FLYDSL_CONFIGS[:2],
                  {"score_dtype": "bfloat16", "has_valid_count": True})
            + _jobs("moe_gather_scatter_flydsl.scatter_add_dense_tokens", "gfx942",
                    [{"unroll": 1, "method": "atomic"}, {"unroll": 2, "method": "atomic"},
                     {"unroll": 2, "method": "sorted"}], bf16))
    entries = _build(jobs, tmp_path)   # one child compiles all five, two or three per class
    names = []
    for job, entry in zip(jobs, entries):
        isa = open(entry.file("kernel.s")).read()
        config = job.key.parts()["config"]
        kernels = sorted(re.findall(r"\.name:\s+(\S+)", isa))
        names.append(kernels)
        if "max_experts" in config:
            prefix = f"mslk_index_shuffling_bfloat16_e{config['max_experts']}_l{config['lanes']}"
            assert kernels == [f"{prefix}_w{config['waves']}_n_place", f"{prefix}_w{config['waves']}_n_route"]
            assert re.search(r"\bds_bpermute_b32|\bv_mov_b32_dpp|\bds_swizzle", isa), job.label
        elif config["method"] == "atomic":
            assert kernels == [f"mslk_scatter_add_dense_tokens_bfloat16_v8_u{config['unroll']}_scatter"]
            assert re.search(r"global_atomic_pk_add_bf16", isa), job.label
        else:
            assert [k.rsplit("_", 1)[1] for k in kernels] == ["count", "place", "reduce", "scan", "zero"]
            assert not re.search(r"_atomic_pk_add", isa), job.label
    assert len({tuple(n) for n in names}) == len(jobs)


def test_cute_gemm_epilogue_order_matches_every_consumer_thread(tmp_path):
    """The epilogue takes sub-tile j's values from the accumulators by tile coordinate
    (_cute_gemm_sm90.epilogue_order, derived from thread 0): for every tile layout of the
    config space (cooperative 64/128/192/256 rows, swapped, ping-pong) each consumer thread's
    sub-tile values must sit at the coordinates the store copy writes. Warpgroups of 128 rows
    (ping-pong, 256-row tiles) are the layouts whose order is not the accumulators' own."""
    # From a file: the DSL reads a traced function's source.
    script = tmp_path / "epilogue_order.py"
    script.write_text(textwrap.dedent("""
        import cutlass
        import cutlass.cute as cute
        from mslk_dsl.templates import _cute_gemm_configs as configs
        from mslk_dsl.templates import _cute_gemm_sm90 as sm90

        every = {(c["tile_m"], c["tile_n"], bool(c.get("swap")), bool(c.get("pingpong")))
                 for c in configs.BF16_CONFIGS}
        # Per kind of tile: its narrowest and widest, and one width between the powers of two.
        shapes = set()
        for kind in {(m, swap, pingpong) for m, _, swap, pingpong in every}:
            widths = sorted(n for m, n, swap, pingpong in every if (m, swap, pingpong) == kind)
            odd = [n for n in widths if n & (n - 1)]
            for n in {widths[0], widths[-1], *odd[:1]}:
                shapes.add((kind[0], n, kind[1], kind[2]))
        assert any(pingpong for *_, pingpong in shapes)

        def check():
            for tile_m, tile_n, swap, pingpong in sorted(shapes):
                gemm = sm90.HopperGemm((tile_m, tile_n), swap_ab=swap, pingpong=pingpong)
                gemm._setup(cutlass.BFloat16, cutlass.BFloat16, cutlass.BFloat16)
                stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(swap, 4), cutlass.BFloat16)
                r2s = cute.make_tiled_copy_S(
                    sm90.sm90_utils.get_smem_store_op(gemm.d_layout, cutlass.BFloat16, cutlass.Float32),
                    cute.make_tiled_copy_C_atom(stmatrix, gemm.tiled_mma))
                order = sm90.epilogue_order(gemm.tiled_mma, r2s, (tile_m, tile_n), gemm.epi_tile)
                assert sorted(i for sub in order for i in sub) == list(range(tile_m * tile_n // gemm.tile_threads))
                # Thread indices enter the layouts bit by bit: each bit, and a few mixes.
                threads = {t for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 37, 90, 127, gemm.tile_threads - 1)
                           if t < gemm.tile_threads}
                for thread in sorted(threads):
                    assert sm90.epilogue_order(gemm.tiled_mma, r2s, (tile_m, tile_n), gemm.epi_tile,
                                               thread) == order, (tile_m, tile_n, swap, pingpong, thread)
                natural = tuple(tuple(range(j * len(sub), (j + 1) * len(sub))) for j, sub in enumerate(order))
                # A warpgroup holding two 64-row blocks (ping-pong, 256-row tiles) takes its
                # sub-tiles out of the accumulators' order; one block per warpgroup does not.
                two_blocks = pingpong or tile_m == configs.WIDE_TILE_M
                assert (order == natural) == (not two_blocks), (tile_m, tile_n, swap, pingpong)

        @cute.jit
        def trace():
            check()

        trace()
    """))
    run_python(f"import runpy; runpy.run_path({str(script)!r})", env={"CUTE_DSL_ARCH": "sm_90a"})
