"""Hopper CuTe grouped GEMMs (bf16bf16bf16_grouped_stacked, f8f8bf16_rowwise_grouped_stacked) against
an fp32 torch reference and per-group torch.mm (sm_90 GPUs).

Every config of both templates runs on one awkward case (G = 8 with empty, one-row and odd-sized
groups; N and K not multiples of any tile). The default config runs over G in {1, 8, 16, 128},
all-empty-but-one and all-one-row groups, totals not a multiple of any tile, int32 and int64
M_sizes, the MoE layers' shapes (DeepSeek-V3-like, Llama-4-Scout-like and Mixtral-like gate_up
and down), rows past sum(M_sizes) (never written) and sum(M_sizes) > total_M (groups cut), CUDA-graph
capture (M_sizes changed between replays) and torch.compile fullgraph.

Tolerances (fp32 reference, TF32 off): bf16 out |out - ref| <= atol + 1e-2 |ref| with atol 1e-2 x
max(1, sqrt(K / 4096)) (gemm_checks.py's); the result must also be as close to per-group
torch.mm (bf16 cuBLAS) as that tolerance. FP8, promoted accumulation (use_fast_accum=False):
|out - ref| <= 1e-2 rms(ref) + 1.6e-2 |ref|; fast accumulation (promote 0, the default, MSLK's):
4e-2 rms(ref) + 1.6e-2 |ref| and a relative Frobenius error <= 2e-2 (f8f8bf16_rowwise's).
"""
import pytest
import torch
from gemm_checks import exact_fp32_reference, quantize_rowwise  # noqa: F401

from mslk_dsl import device, ops, registry
from mslk_dsl.ops.grouped_gemm import split_rows
from mslk_dsl.template import config_name
from mslk_dsl.testing import SkipUnless

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0

pytestmark = SkipUnless(lambda: device.is_cuda() and device.compute_capability_in((9, 0)),
                        "needs an sm_90 (Hopper) GPU")

# (name, T, E, top_k, D, H): gate_up is N = 2H, K = D; down is N = D, K = H.
MOE_CONFIGS = [("deepseek-v3", 4096, 128, 8, 7168, 2048), ("llama4-scout", 8192, 16, 1, 5120, 8192),
               ("mixtral", 4096, 8, 2, 4096, 14336)]


def _randn(*shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g)


def _sizes(total, groups, seed, empty_every=0, dtype=torch.int64):
    sizes = split_rows(total, groups, seed, empty_every)
    return torch.tensor(sizes, dtype=dtype, device="cuda")


def _bf16_case(sizes, n, k, seed=0):
    total = int(sizes.sum())
    x = _randn(total, k, seed=seed).to(torch.bfloat16)
    w = _randn(sizes.shape[0], n, k, seed=seed + 1).to(torch.bfloat16)
    return x, w


def _per_group(fn, sizes, total):
    """fn(g, start, end) for each non-empty group, in row order (cut at total)."""
    start = 0
    for g, m in enumerate(sizes.tolist()):
        end = min(start + m, total)
        if end > start:
            fn(g, start, end)
        start = end


def _check_bf16(x, w, sizes, out, label, rows=None):
    rows = x.shape[0] if rows is None else rows
    ref = torch.zeros(x.shape[0], w.shape[1], device="cuda")
    mm = torch.zeros_like(ref)

    def one(g, s, e):
        ref[s:e] = x[s:e].float() @ w[g].float().T
        mm[s:e] = (x[s:e] @ w[g].T).float()
    _per_group(one, sizes, rows)
    k = x.shape[1]
    tol = dict(atol=1e-2 * max(1.0, (k / 4096) ** 0.5), rtol=1e-2)
    got = out[:rows].float()
    torch.testing.assert_close(got, ref[:rows], **tol, msg=lambda s: f"{label} vs fp32: {s}")
    torch.testing.assert_close(got, mm[:rows], **tol, msg=lambda s: f"{label} vs torch.mm: {s}")


def _fp8_case(sizes, n, k, seed=0):
    total, groups = int(sizes.sum()), sizes.shape[0]
    xq, xs = quantize_rowwise(_randn(total, k, seed=seed), FP8, FP8_MAX)
    wq, ws = quantize_rowwise(_randn(groups * n, k, seed=seed + 1), FP8, FP8_MAX)
    return xq, wq.view(groups, n, k), xs, ws.view(groups, n)


def _check_fp8(xq, wq, xs, ws, sizes, out, label, promoted=False):
    """Against the fp32 reference; ``promoted``: the call asked for use_fast_accum=False."""
    ref = torch.zeros(xq.shape[0], wq.shape[1], device="cuda")

    def one(g, s, e):
        ref[s:e] = (xq[s:e].float() @ wq[g].float().T) * xs[s:e, None] * ws[g][None, :]
    _per_group(one, sizes, xq.shape[0])
    rms = float(ref.pow(2).mean().sqrt()) if ref.numel() else 1.0
    torch.testing.assert_close(out.float(), ref, atol=(1e-2 if promoted else 4e-2) * rms, rtol=1.6e-2,
                               msg=lambda s: f"{label}: {s}")
    if not promoted and ref.numel():
        rel = float((out.float() - ref).norm() / max(float(ref.norm()), 1e-30))
        assert rel <= 2e-2, f"{label}: relative Frobenius error {rel}"


def _configs(op):
    """Every config of the op's CuTe template (FP8: of both accumulations)."""
    (t,) = registry.get_templates(op=op, backend="cute")
    sigs = [{"index_dtype": "int32", "fast_accum": fast} for fast in (True, False)] if op.startswith("f8") \
        else [{"index_dtype": "int32"}]
    return [c for sig in sigs for c in t.valid_configs("sm90a", sig)]


# ------------------------------------------------------------------ every config
@pytest.mark.parametrize("config", _configs("bf16bf16bf16_grouped_stacked"), ids=config_name)
def test_bf16_every_config(config):
    # G = 8: an empty group, one-row groups, a group over two tiles, odd sizes.
    sizes = torch.tensor([3, 0, 1, 200, 1, 67, 0, 130], dtype=torch.int32, device="cuda")
    x, w = _bf16_case(sizes, 264, 200)
    out = ops.bf16bf16bf16_grouped_stacked(x, w, sizes, config=config)
    _check_bf16(x, w, sizes, out, f"config {config}")


@pytest.mark.parametrize("config", _configs("f8f8bf16_rowwise_grouped_stacked"), ids=config_name)
def test_fp8_every_config(config):
    sizes = torch.tensor([3, 0, 1, 200, 1, 67, 0, 130], dtype=torch.int32, device="cuda")
    xq, wq, xs, ws = _fp8_case(sizes, 264, 208)
    promoted = config["promote"] > 0
    out = ops.f8f8bf16_rowwise_grouped_stacked(xq, wq, xs, ws, sizes, not promoted, config=config)
    _check_fp8(xq, wq, xs, ws, sizes, out, f"config {config}", promoted=promoted)


@pytest.mark.parametrize("config", [c for c in _configs("bf16bf16bf16_grouped_stacked") if c.get("pingpong")],
                         ids=config_name)
def test_bf16_pingpong_warpgroups_alternate_over_many_tiles(config):
    """Ping-pong tiles with several units per CTA, so both consumer warpgroups take tiles and
    step over each other's k-tiles (K past the ring of stages: 32 k-tiles), over odd and empty
    groups; the every-config case above gives most CTAs one unit or none."""
    sizes = _sizes(24000, 16, seed=3, empty_every=5, dtype=torch.int32)
    x, w = _bf16_case(sizes, 1000, 2048, seed=4)
    _check_bf16(x, w, sizes, ops.bf16bf16bf16_grouped_stacked(x, w, sizes, config=config), f"config {config}")


_SWAPPED = [(op, c) for op in ("bf16bf16bf16_grouped_stacked", "f8f8bf16_rowwise_grouped_stacked")
            for c in _configs(op) if c.get("swap")]


@pytest.mark.parametrize("op,config", _SWAPPED, ids=lambda v: v if isinstance(v, str) else config_name(v))
def test_swapped_tiles_over_decode_groups(op, config):
    """Swapped tiles (the weight's rows along wgmma's M, a group's rows along its N) where they
    are meant to run: 200 rows over 128 groups (empty, one-row and few-row groups, ~1.6 rows per
    busy one), N not a multiple of any tile, K past the ring of stages, many units per CTA; rows
    of x and out past sum(M_sizes) neither read into a result nor written; and a group of 333 rows
    (11 token tiles) beside them."""
    sizes = _sizes(200, 128, seed=5, dtype=torch.int32)
    sizes[7] = 333
    total = int(sizes.sum())
    rows = total + 21
    out = torch.full((rows, 1000), 7.0, dtype=torch.bfloat16, device="cuda")
    if op.startswith("bf16"):
        x, w = _bf16_case(sizes, 1000, 2056, seed=6)
        x = torch.cat([x, _randn(21, 2056, seed=7).to(torch.bfloat16)])
        ops.bf16bf16bf16_grouped_stacked(x, w, sizes, out=out, config=config)
        _check_bf16(x, w, sizes, out, f"config {config}", rows=total)
    else:
        xq, wq, xs, ws = _fp8_case(sizes, 1000, 2064, seed=6)
        pad_q, pad_s = quantize_rowwise(_randn(21, 2064, seed=7), FP8, FP8_MAX)
        xq, xs = torch.cat([xq, pad_q]), torch.cat([xs, pad_s])
        promoted = config["promote"] > 0
        ops.f8f8bf16_rowwise_grouped_stacked(xq, wq, xs, ws, sizes, not promoted, out=out, config=config)
        _check_fp8(xq[:total], wq, xs[:total], ws, sizes, out[:total], f"config {config}", promoted=promoted)
    assert bool((out[total:] == 7.0).all()), f"config {config}: rows past sum(M_sizes) written"


# ------------------------------------------------------------------ default config
GROUP_CASES = [  # (total rows, G, every n-th group empty)
    (1, 1, 0), (300, 1, 0), (1000, 8, 0), (777, 8, 3), (4099, 16, 0), (333, 16, 2), (16 * 8, 128, 0),
    (4096, 128, 0), (5000, 128, 4), (128, 128, 0)]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: f"M{c[0]}-G{c[1]}-e{c[2]}")
def test_bf16_groups(case, index_dtype):
    total, groups, empty_every = case
    sizes = _sizes(total, groups, seed=total + groups, empty_every=empty_every, dtype=index_dtype)
    x, w = _bf16_case(sizes, 520, 328, seed=groups)
    _check_bf16(x, w, sizes, ops.bf16bf16bf16_grouped_stacked(x, w, sizes), f"case {case}")


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "promoted"])
@pytest.mark.parametrize("case", GROUP_CASES[::2], ids=lambda c: f"M{c[0]}-G{c[1]}-e{c[2]}")
def test_fp8_groups(case, fast):
    total, groups, empty_every = case
    sizes = _sizes(total, groups, seed=total + groups, empty_every=empty_every)
    xq, wq, xs, ws = _fp8_case(sizes, 520, 336, seed=groups)
    _check_fp8(xq, wq, xs, ws, sizes, ops.f8f8bf16_rowwise_grouped_stacked(xq, wq, xs, ws, sizes, fast),
               f"case {case} fast={fast}", promoted=not fast)


def test_fp8_fast_accumulation_is_the_default_and_promotion_is_tighter():
    """MSLK's grouped FP8 kernels accumulate fast (no promotion): so does the default here; at a
    long K (Mixtral's down, 14336) promoted accumulation is closer to the fp32 reference."""
    sizes = _sizes(3000, 8, seed=11, dtype=torch.int32)
    xq, wq, xs, ws = _fp8_case(sizes, 512, 14336, seed=12)
    default = ops.f8f8bf16_rowwise_grouped_stacked(xq, wq, xs, ws, sizes)
    fast = ops.f8f8bf16_rowwise_grouped_stacked(xq, wq, xs, ws, sizes, use_fast_accum=True)
    slow = torch.ops.mslk_dsl.f8f8bf16_rowwise_grouped_stacked(xq, wq, xs, ws, sizes, False)
    assert torch.equal(default, fast)
    _check_fp8(xq, wq, xs, ws, sizes, fast, "fast")
    _check_fp8(xq, wq, xs, ws, sizes, slow, "promoted", promoted=True)
    ref = torch.zeros_like(fast, dtype=torch.float32)

    def one(g, s, e):
        ref[s:e] = (xq[s:e].float() @ wq[g].float().T) * xs[s:e, None] * ws[g][None, :]
    _per_group(one, sizes, xq.shape[0])
    assert (slow.float() - ref).norm() < (fast.float() - ref).norm()
    with pytest.raises(TypeError, match="use_fast_accum"):
        ops.f8f8bf16_rowwise_grouped_stacked(xq, wq, xs, ws, sizes, 1)


def test_one_row_groups_and_a_single_busy_group():
    ones = torch.ones(128, dtype=torch.int32, device="cuda")
    x, w = _bf16_case(ones, 256, 512)
    _check_bf16(x, w, ones, ops.bf16bf16bf16_grouped_stacked(x, w, ones), "all one-row groups")
    busy = torch.zeros(16, dtype=torch.int64, device="cuda")
    busy[9] = 1031
    x, w = _bf16_case(busy, 136, 256)
    _check_bf16(x, w, busy, ops.bf16bf16bf16_grouped_stacked(x, w, busy), "one non-empty group")


# Tens of GB each: one worker runs these one after another, so parallel workers (-n 4)
# never hold two at once.
@pytest.mark.xdist_group("gpu-memory")
@pytest.mark.parametrize("layer", MOE_CONFIGS, ids=lambda c: c[0])
@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_moe_shapes(layer, proj):
    name, tokens, experts, top_k, d, h = layer
    n, k = (2 * h, d) if proj == "gate_up" else (d, h)
    sizes = _sizes(tokens * top_k, experts, seed=experts)
    x, w = _bf16_case(sizes, n, k)
    _check_bf16(x, w, sizes, ops.bf16bf16bf16_grouped_stacked(x, w, sizes), f"{name} {proj}")
    xq, xs = quantize_rowwise(x.float(), FP8, FP8_MAX)
    wq, ws = quantize_rowwise(w.view(-1, k).float(), FP8, FP8_MAX)
    wq, ws = wq.view(experts, n, k), ws.view(experts, n)
    _check_fp8(xq, wq, xs, ws, sizes, ops.f8f8bf16_rowwise_grouped_stacked(xq, wq, xs, ws, sizes),
               f"{name} {proj} fp8")


# ------------------------------------------------------------------ semantics at the edges
def test_rows_past_the_groups_are_not_written():
    sizes = torch.tensor([5, 0, 70], dtype=torch.int32, device="cuda")
    x = _randn(100, 64, seed=3).to(torch.bfloat16)  # 25 rows past sum(M_sizes) = 75
    w = _randn(3, 48, 64, seed=4).to(torch.bfloat16)
    out = torch.full((100, 48), 7.0, dtype=torch.bfloat16, device="cuda")
    ops.bf16bf16bf16_grouped_stacked(x, w, sizes, out=out)
    _check_bf16(x, w, sizes, out, "rows past the groups", rows=75)
    assert bool((out[75:] == 7.0).all())


def test_groups_past_total_m_are_cut():
    sizes = torch.tensor([30, 50, 40], dtype=torch.int64, device="cuda")  # sum 120 > 64 rows
    x = _randn(64, 64, seed=5).to(torch.bfloat16)
    w = _randn(3, 32, 64, seed=6).to(torch.bfloat16)
    _check_bf16(x, w, sizes, ops.bf16bf16bf16_grouped_stacked(x, w, sizes), "cut groups")


def test_empty_and_bad_inputs():
    w = torch.zeros(4, 32, 64, dtype=torch.bfloat16, device="cuda")
    sizes = torch.zeros(4, dtype=torch.int32, device="cuda")
    assert ops.bf16bf16bf16_grouped_stacked(torch.zeros(0, 64, dtype=torch.bfloat16, device="cuda"), w,
                                            sizes).shape == (0, 32)
    x = torch.zeros(8, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="groups"):
        ops.bf16bf16bf16_grouped_stacked(x, w, sizes[:3])
    with pytest.raises(TypeError, match="M_sizes"):
        ops.bf16bf16bf16_grouped_stacked(x, w, sizes.float())
    with pytest.raises(ValueError, match="K="):
        ops.bf16bf16bf16_grouped_stacked(x[:, :60], w[:, :, :60], sizes)
    with pytest.raises(ValueError, match="N="):
        ops.bf16bf16bf16_grouped_stacked(x, w[:, :30], sizes)


# ------------------------------------------------------------------ graphs and compile
def test_cuda_graph_replays_with_new_group_sizes():
    sizes = torch.tensor([10, 0, 300, 1], dtype=torch.int32, device="cuda")
    x, w = _bf16_case(sizes, 256, 256)
    xq, xs = quantize_rowwise(x.float(), FP8, FP8_MAX)
    wq, ws = quantize_rowwise(w.view(-1, 256).float(), FP8, FP8_MAX)
    wq, ws = wq.view(4, 256, 256), ws.view(4, 256)
    ops.bf16bf16bf16_grouped_stacked(x, w, sizes)  # compile / load outside the capture
    ops.f8f8bf16_rowwise_grouped_stacked(xq, wq, xs, ws, sizes)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.bf16bf16bf16_grouped_stacked(x, w, sizes)
        out8 = ops.f8f8bf16_rowwise_grouped_stacked(xq, wq, xs, ws, sizes)
    for new in ([10, 0, 300, 1], [0, 311, 0, 0], [100, 100, 100, 11], [1, 1, 1, 308]):
        sizes.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _check_bf16(x, w, sizes, out, f"graph replay {new}")
        _check_fp8(xq, wq, xs, ws, sizes, out8, f"graph replay fp8 {new}")


def test_torch_compile_fullgraph():
    sizes = torch.tensor([7, 0, 90, 31], dtype=torch.int64, device="cuda")
    x, w = _bf16_case(sizes, 128, 256)

    @torch.compile(fullgraph=True)
    def layer(x, w, sizes):
        return torch.ops.mslk_dsl.bf16bf16bf16_grouped_stacked(x, w, sizes) * 2.0

    got = layer(x, w, sizes)
    want = ops.bf16bf16bf16_grouped_stacked(x, w, sizes) * 2.0
    torch.testing.assert_close(got, want)


def test_opcheck():
    from mslk_dsl.ops import declarations

    for name in ("bf16bf16bf16_grouped_stacked", "f8f8bf16_rowwise_grouped_stacked"):
        decl = declarations()[name]
        args = decl.example(dict(decl.small_problem), {}, torch.device("cuda"))
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(getattr(torch.ops.mslk_dsl, name).default, args, test_utils=utils)
