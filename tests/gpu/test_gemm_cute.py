"""Hopper CuTe GEMMs (bf16_gemm, f8f8bf16_rowwise) against an fp32 torch reference (sm_90 GPUs).

Every config of both templates runs on a few awkward shapes (M = 1 and M not a multiple of the
tile, N and K not multiples of the tile, K shorter than one k-tile, several persistent waves);
the default (heuristic) config runs over M in {1, 7, 128, 1000, 4096} x (N, K) up to
(8192, 28672). The op layer must reject N / K that break TMA's 16-byte row alignment.

Tolerances: bf16 / fp16 as in gemm_checks.py;
  fp8 rowwise, bf16 out: |out - ref| <= atol + 1.6e-2 |ref| with atol = 1e-2 * rms(ref) for
  promoted accumulation (partial sums of <= 512 products) and atol = 4e-2 * rms(ref) plus a
  relative Frobenius error <= 2e-2 for fast accumulation (Hopper's FP8 wgmma keeps ~13 bits
  in its accumulator: error grows with K).
"""
import pytest
import torch
from gemm_checks import check_bf16, exact_fp32_reference, fp8_case, quantize_rowwise, randn  # noqa: F401

from mslk_dsl import device, ops, registry
from mslk_dsl.template import config_name
from mslk_dsl.testing import SkipUnless

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Every config: M = 1, M and N tails, K tails and K shorter than a k-tile (64 deep for 16-bit,
# 128 for FP8), several persistent waves (2100 x 2064). N and K are multiples of 16 (the FP8
# op's alignment rule; the 16-bit op needs 8).
CONFIG_SHAPES = [(1, 64, 64), (3, 48, 16), (7, 144, 208), (130, 272, 1040), (257, 528, 80),
                 (2100, 2064, 256)]
DEFAULT_M = (1, 7, 128, 1000, 4096)
DEFAULT_NK = ((128, 128), (4096, 4096), (8192, 8192), (10240, 8192), (8192, 28672))

# The templates target sm90a only (wgmma, TMA multicast, setmaxnreg).
pytestmark = SkipUnless(lambda: device.is_cuda() and device.compute_capability_in((9, 0)),
                        "needs an sm_90 (Hopper) GPU")


def _template(op):
    (t,) = registry.get_templates(op=op, backend="cute")
    return t


def _cases(op, sigs):
    t = _template(op)
    return [(sig, c) for sig in sigs for c in t.valid_configs("sm90a", sig)]


def _case_id(case):
    sig, config = case
    return "-".join(str(v) for v in sig.values()) + "-" + config_name(config)


# ------------------------------------------------------------------ bf16_gemm
@pytest.mark.parametrize("case", _cases("bf16_gemm", [{"dtype": "bfloat16"}, {"dtype": "float16"}]),
                         ids=_case_id)
def test_bf16_gemm_every_config(case):
    sig, config = case
    dtype = getattr(torch, sig["dtype"])
    for m, n, k in _shapes_for(config):
        check_bf16(m, n, k, dtype, config)
    _x_rows_rejects_larger_m("bf16_gemm", config, dtype)


# Ping-pong: ~8 tiles per CTA (its two warpgroups alternate several times, odd counts leave one
# a tile more) with a k-tile count that is no multiple of the pipeline's stages (the warpgroups
# step their pipeline states over each other's tiles: phases wrap mid-tile). 256-row tiles (two
# 64-row blocks per warpgroup, like ping-pong's) run them too: several tiles per CTA, M and N tails.
LONG_SHAPES = [(4100, 4112, 1040), (1000, 2064, 4112)]


def _shapes_for(config):
    """CONFIG_SHAPES (and LONG_SHAPES for ping-pong and 256-row tiles), and for a decode config
    that loads only x_rows rows of x, the M <= x_rows cases (every M from 1 to x_rows on two
    sizes, one with 3 waves of split-K units)."""
    x_rows = config.get("x_rows")
    if config.get("pingpong") or config["tile_m"] == 256:
        return CONFIG_SHAPES + LONG_SHAPES
    if x_rows is None:
        return CONFIG_SHAPES
    return [s for s in CONFIG_SHAPES if s[0] <= x_rows] + [(m, 528, 1040) for m in range(1, x_rows + 1)] + \
        [(x_rows, 8192 + 16, 2048)]


def _x_rows_rejects_larger_m(op, config, dtype):
    if "x_rows" not in config:
        return
    m = config["x_rows"] + 1
    with pytest.raises(ValueError, match=f"x_rows{m - 1} does not serve"):
        if op == "bf16_gemm":
            ops.bf16_gemm(randn(m, 64, seed=1).to(dtype), randn(64, 64, seed=2).to(dtype), config=config)
        else:
            xq = torch.zeros(m, 128, device="cuda", dtype=FP8)
            wq = torch.zeros(64, 128, device="cuda", dtype=FP8)
            fast = config.get("promote", 0) == 0   # a promoting config serves use_fast_accum=False only
            ops.f8f8bf16_rowwise(xq, wq, torch.ones(m, device="cuda"), torch.ones(64, device="cuda"),
                                 use_fast_accum=fast, config=config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("nk", DEFAULT_NK, ids=lambda nk: f"N{nk[0]}K{nk[1]}")
def test_bf16_gemm_default_config(nk, dtype):
    for m in DEFAULT_M:
        check_bf16(m, *nk, dtype)


def test_bf16_gemm_rejects_unaligned_sizes():
    x = torch.randn(4, 100, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 100, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K=100"):
        ops.bf16_gemm(x, w)
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(100, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="N=100"):
        ops.bf16_gemm(x, w)


def test_bf16_gemm_strided_input_and_stream():
    """A column slice (not contiguous) is copied by the op layer; a side stream is honoured."""
    big = randn(300, 512, seed=3).to(torch.bfloat16)
    x = big[:, :256]
    w = randn(384, 256, seed=4).to(torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())   # x and w were made on the default stream
    with torch.cuda.stream(stream):
        out = ops.bf16_gemm(x, w)
    stream.synchronize()
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, atol=1e-2, rtol=1e-2)


def test_bf16_gemm_split_k_is_deterministic_and_matches_unsplit():
    """Decode sizes take split-K by default: repeat calls (the second through the plan cache,
    which allocates the partials itself) are bit-identical, and every split agrees with the
    unsplit kernel to rounding."""
    for m in (1, 16, 64):
        x = randn(m, 8192, seed=m).to(torch.bfloat16)
        w = randn(4096, 8192, seed=m + 1).to(torch.bfloat16)
        first, second = ops.bf16_gemm(x, w), ops.bf16_gemm(x, w)
        assert torch.equal(first, second), m
        plain = ops.bf16_gemm(x, w, config={"tile_m": 64, "tile_n": 128, "cluster_m": 1, "raster": "m",
                                            "group": 8})
        for split in (2, 4, 8):
            config = {"tile_m": 64, "tile_n": 256, "cluster_m": 1, "raster": "m", "group": 8, "split_k": split}
            torch.testing.assert_close(ops.bf16_gemm(x, w, config=config), plain, atol=2e-2, rtol=1e-2)


# Mid-sized M with few output tiles: odd M (a last M tile of 1, 77 and 1 rows), N not a multiple
# of the tile (2112, 72, 1000), K long and short of whole splits.
MID_SPLIT_SHAPES = ((129, 2112, 4096), (333, 72, 2048), (513, 1000, 1040), (200, 4096, 8192))


def _check_repeatable_and_like_plain(x, w, config, option):
    """bf16_gemm with ``config`` twice gives the same bits, and agrees to rounding with the same
    tile without ``option`` (split_k or stream_k: the K sums are only regrouped)."""
    first, second = ops.bf16_gemm(x, w, config=config), ops.bf16_gemm(x, w, config=config)
    assert torch.equal(first, second), (tuple(x.shape), tuple(w.shape), config)
    plain = ops.bf16_gemm(x, w, config={c: v for c, v in config.items() if c != option})
    torch.testing.assert_close(first, plain, atol=2e-2, rtol=1e-2)


def test_split_k_at_mid_m_is_deterministic_and_matches_unsplit():
    """128-row split-K tiles (the last unit of a tile adds the others' fp32 partials in place and
    runs the epilogue): repeat calls are bit-identical (the tile counters are left at zero, so
    the second call finds its last units again) and agree with the unsplit tile to rounding;
    FP8 with an fp32 bias, fast and promoted, against the fp32 reference (every config with a
    bf16 bias or none: test_f8f8bf16_rowwise_every_config)."""
    from mslk_dsl.templates import _cute_gemm_configs as gemm_configs

    fp8_configs = _template("f8f8bf16_rowwise").all_configs()
    for m, n, k in MID_SPLIT_SHAPES:
        x = randn(m, k, seed=m).to(torch.bfloat16)
        w = randn(n, k, seed=n).to(torch.bfloat16)
        for config in gemm_configs.MID_SPLIT_CONFIGS:
            _check_repeatable_and_like_plain(x, w, config, "split_k")
        for config in fp8_configs:
            if config.get("split_k", 1) > 1 and config["tile_m"] == 128:
                _check_fp8(m, n, k, True, config, bias_dtype=torch.float32)


def test_split_k_counters_are_per_stream_and_left_zero():
    """Two split-K GEMMs of different sizes on two streams, then again on one: each stream has
    its own tile counters, and every call leaves them zero."""
    from mslk_dsl.ops import dispatch

    config = {"tile_m": 128, "tile_n": 128, "cluster_m": 1, "raster": "m", "group": 8, "split_k": 3}
    cases = [(randn(m, 2048, seed=m).to(torch.bfloat16), randn(n, 2048, seed=n).to(torch.bfloat16))
             for m, n in ((300, 4096), (129, 1000))]
    plain = {c: v for c, v in config.items() if c != "split_k"}
    expected = [ops.bf16_gemm(x, w, config=plain) for x, w in cases]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    outs = []
    for (x, w), stream in zip(cases, streams):
        with torch.cuda.stream(stream):
            outs.append(ops.bf16_gemm(x, w, config=config))
    torch.cuda.synchronize()
    for out, want in zip(outs, expected):
        torch.testing.assert_close(out, want, atol=2e-2, rtol=1e-2)
    counters = [dispatch.zeroed_counters(torch.device("cuda", torch.cuda.current_device()), 1)]
    for stream in streams:
        with torch.cuda.stream(stream):
            counters.append(dispatch.zeroed_counters(torch.device("cuda", torch.cuda.current_device()), 1))
    assert len({c.data_ptr() for c in counters}) == 3
    assert all(int(c.abs().sum()) == 0 for c in counters)


def test_split_k_graphs_captured_without_counters_replay_in_any_order():
    """Split-K graphs captured on a stream that has no tile counters yet each get counters of
    their own, cleared by the graph on every replay (the graph's memory is not zero before its
    first replay, and a counter another graph cleared only when it replayed would be garbage):
    the graph captured last replays right before the first one ever has, and nothing the
    captures made is kept for later calls."""
    from mslk_dsl.ops import dispatch

    config = {"tile_m": 128, "tile_n": 128, "cluster_m": 1, "raster": "m", "group": 8, "split_k": 3}
    x, w = randn(300, 2048, seed=5).to(torch.bfloat16), randn(4096, 2048, seed=6).to(torch.bfloat16)
    want = ops.bf16_gemm(x, w, config={c: v for c, v in config.items() if c != "split_k"})
    ops.bf16_gemm(x, w, config=config)              # compiled and loaded before the captures
    capture = torch.cuda.Stream()
    cached = set(dispatch._placeholders)
    graphs, outs = [], []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture):
            outs.append(ops.bf16_gemm(x, w, config=config))
        graphs.append(graph)
    assert set(dispatch._placeholders) == cached
    for graph in (graphs[1], graphs[0], graphs[1]):
        graph.replay()
    torch.cuda.synchronize()
    for got in outs:
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)


def test_split_k_plans_serve_their_own_stream(monkeypatch):
    """A split-K launch holds its stream's tile counters, so its native plan serves that stream
    only: a call on another stream takes the checked path (its own counters), and every result
    is right and every counter left zero."""
    from mslk_dsl import native
    from mslk_dsl.ops import declaration, dispatch

    if native.wait_until_loaded(timeout=300) is None:
        pytest.skip("no native launcher here")
    config = {"tile_m": 128, "tile_n": 128, "cluster_m": 1, "raster": "m", "group": 8, "split_k": 3}
    x, w = randn(300, 2048, seed=3).to(torch.bfloat16), randn(4096, 2048, seed=4).to(torch.bfloat16)
    want = ops.bf16_gemm(x, w, config={c: v for c, v in config.items() if c != "split_k"})
    kernels = declaration.get("bf16_gemm").kernels
    select, chosen = kernels.selection, []
    monkeypatch.setattr(kernels, "selection", lambda dev, sig, problem, cfg: chosen.append(problem)
                        or select(dev, sig, problem, config))   # the heuristic "picks" split-K here
    fast = native.fast_op("bf16_gemm")
    fast.clear()
    results = [ops.bf16_gemm(x, w), ops.bf16_gemm(x, w)]
    assert len(chosen) == 1 and fast.plans() == 1              # the second call: the plan
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        results += [ops.bf16_gemm(x, w), ops.bf16_gemm(x, w)]   # checked once, then its own plan
    torch.cuda.current_stream().wait_stream(side)
    assert len(chosen) == 2
    results.append(ops.bf16_gemm(x, w))                        # back on the first stream: checked
    assert len(chosen) == 3
    torch.cuda.synchronize()
    for got in results:
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
    dev = torch.device("cuda", torch.cuda.current_device())
    counters = [dispatch.zeroed_counters(dev, 1)]
    with torch.cuda.stream(side):
        counters.append(dispatch.zeroed_counters(dev, 1))
    assert counters[0].data_ptr() != counters[1].data_ptr()
    assert all(int(c.abs().sum()) == 0 for c in counters)
    fast.clear()


def test_bf16_gemm_stream_k_is_deterministic_and_matches_data_parallel():
    """Stream-K configs on sizes with a partial last wave (and with fewer tiles than CTAs): repeat
    calls are bit-identical and agree with the same tile's data-parallel kernel to rounding."""
    from mslk_dsl.templates import _cute_gemm_configs as gemm_configs

    for m, n, k in ((2100, 2064, 4096), (256, 10240, 8192), (1000, 4096, 1040), (3, 400, 4104)):
        x = randn(m, k, seed=m).to(torch.bfloat16)
        w = randn(n, k, seed=n).to(torch.bfloat16)
        for config in gemm_configs.STREAM_K_CONFIGS:
            _check_repeatable_and_like_plain(x, w, config, "stream_k")


SECOND_KERNEL_CONFIGS = (
    {"tile_m": 64, "tile_n": 256, "cluster_m": 1, "raster": "m", "group": 8, "split_k": 4, "x_rows": 16},
    {"tile_m": 64, "tile_n": 128, "cluster_m": 1, "raster": "m", "group": 8, "split_k": 8},
    {"tile_m": 128, "tile_n": 256, "cluster_m": 2, "raster": "m", "group": 8, "stream_k": 1},
)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_reductions_launched_early_keep_the_order_of_the_kernels_around_them(graph):
    """The partials' reduction of 64-row split-K and of stream-K is a programmatic dependent
    launch that may start while the GEMM runs. Kernels around it keep stream order: an input
    rewritten right after one call feeds the next call, each output is read right after its call
    by another kernel, in eager calls and replayed as one CUDA graph."""
    for config in SECOND_KERNEL_CONFIGS:
        m = 9 if config.get("x_rows") else 300
        x = randn(m, 4096, seed=m).to(torch.bfloat16)
        w = randn(2112, 4096, seed=7).to(torch.bfloat16)
        x_next = (x * 2).contiguous()
        plain = {c: v for c, v in config.items() if c not in ("split_k", "stream_k", "x_rows")}
        want = [ops.bf16_gemm(x, w, config=plain).float() * 3, ops.bf16_gemm(x_next, w, config=plain).float() * 3]
        source = x.clone()

        def calls():
            first = ops.bf16_gemm(source, w, config=config)
            tripled = [first.float() * 3]            # reads the output at once
            source.mul_(2)                           # rewrites the input the GEMM just read
            second = ops.bf16_gemm(source, w, config=config)
            tripled.append(second.float() * 3)
            return tripled

        if graph:
            calls()                                  # kernels loaded, counters made
            source.copy_(x)
            capture = torch.cuda.Stream()
            capture.wait_stream(torch.cuda.current_stream())
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=capture):
                got = calls()
            source.copy_(x)
            g.replay()
        else:
            got = calls()
        torch.cuda.synchronize()
        for out, ref in zip(got, want):
            torch.testing.assert_close(out, ref, atol=6e-2, rtol=1e-2, msg=lambda s, c=config: f"{c}: {s}")


def test_split_k_rejects_partials_past_int32():
    x = torch.zeros(65536, 16, device="cuda", dtype=torch.bfloat16)
    w = torch.zeros(4096, 16, device="cuda", dtype=torch.bfloat16)
    config = {"tile_m": 64, "tile_n": 128, "cluster_m": 1, "raster": "m", "group": 8, "split_k": 8}
    with pytest.raises(ValueError, match="split_k"):
        ops.bf16_gemm(x, w, config=config)
    xq, wq = x.to(FP8), torch.zeros(16384, 16, device="cuda", dtype=FP8)  # 65536 tiles of 128 x 128
    with pytest.raises(ValueError, match="split_k"):
        ops.f8f8bf16_rowwise(xq, wq, torch.ones(65536, device="cuda"), torch.ones(16384, device="cuda"),
                             config={**config, "tile_m": 128, "split_k": 4, "promote": 0})


# ----------------------------------------------------------- f8f8bf16_rowwise
def _check_fp8(m, n, k, has_bias, config=None, bias_dtype=torch.bfloat16, fast=None):
    """One call against the fp32 reference; ``fast`` (use_fast_accum) defaults to what the
    config is (promote 0), or MSLK's default True without a config."""
    args, ref = fp8_case(m, n, k, has_bias, FP8, FP8_MAX, bias_dtype)
    if fast is None:
        fast = config is None or config["promote"] == 0
    out = ops.f8f8bf16_rowwise(*args, fast, config=config)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    rms = ref.pow(2).mean().sqrt().item()
    what = f"f8f8bf16_rowwise {m}x{n}x{k} bias={has_bias and bias_dtype} fast={fast} {config}"
    torch.testing.assert_close(out.float(), ref, atol=(4e-2 if fast else 1e-2) * rms, rtol=1.6e-2,
                               msg=lambda s: f"{what}: {s}")
    if fast:
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel <= 2e-2, f"{what}: relative Frobenius error {rel}"


FP8_SIGS = [{"bias": bias, "fast_accum": fast} for fast in (True, False) for bias in ("bfloat16", "none")]


@pytest.mark.parametrize("case", _cases("f8f8bf16_rowwise", FP8_SIGS), ids=_case_id)
def test_f8f8bf16_rowwise_every_config(case):
    sig, config = case
    for m, n, k in _shapes_for(config):
        _check_fp8(m, n, k, sig["bias"] != "none", config)
    _x_rows_rejects_larger_m("f8f8bf16_rowwise", config, FP8)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "promoted"])
@pytest.mark.parametrize("bias", [None, torch.bfloat16, torch.float32], ids=["nobias", "bf16bias", "fp32bias"])
@pytest.mark.parametrize("nk", DEFAULT_NK, ids=lambda nk: f"N{nk[0]}K{nk[1]}")
def test_f8f8bf16_rowwise_default_config(nk, bias, fast):
    for m in DEFAULT_M:
        _check_fp8(m, *nk, bias is not None, bias_dtype=bias, fast=fast)


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_f8f8bf16_rowwise_bias_dtypes(bias_dtype):
    """MSLK takes the bias in bf16 or fp32: both are added in fp32 before the one rounding to
    bf16, against the fp32 reference, fast and promoted; a bias that dominates the product lands
    in every column."""
    for m, n, k in ((1, 72, 128), (300, 1000, 512), (4096, 2112, 2048)):
        for fast in (True, False):
            _check_fp8(m, n, k, True, bias_dtype=bias_dtype, fast=fast)
    (xq, wq, x_scale, w_scale, _), ref = fp8_case(64, 256, 128, False, FP8, FP8_MAX)
    bias = torch.full((256,), 1000.0, device="cuda") + torch.arange(256, device="cuda") / 64
    out = ops.f8f8bf16_rowwise(xq, wq, x_scale * 1e-3, w_scale, bias.to(bias_dtype))
    expected = (ref * 1e-3 + bias.to(bias_dtype).float()).to(torch.bfloat16)
    torch.testing.assert_close(out.float(), expected.float(), atol=4.0, rtol=0)  # bf16's ulp at 1000 is 4
    with pytest.raises(TypeError, match="bias"):
        ops.f8f8bf16_rowwise(xq, wq, x_scale, w_scale, bias.half())


def test_f8f8bf16_rowwise_fast_accum_tolerances():
    """use_fast_accum=True meets the fast-accumulation tolerance of _check_fp8 (Frobenius <= 2e-2)
    at long K; use_fast_accum=False is tighter (<= 4e-3) and closer to the reference than fast
    on the same inputs (Hopper's FP8 wgmma drifts in its ~13-bit accumulator)."""
    m, n, k = 512, 1024, 28672
    xq, x_scale = quantize_rowwise(randn(m, k, seed=5), FP8, FP8_MAX)
    wq, w_scale = quantize_rowwise(randn(n, k, seed=6), FP8, FP8_MAX)
    ref = (xq.float() @ wq.float().T) * x_scale[:, None] * w_scale[None, :]
    error = {}
    for fast in (True, False):
        out = ops.f8f8bf16_rowwise(xq, wq, x_scale, w_scale, None, fast)
        error[fast] = ((out.float() - ref).norm() / ref.norm()).item()
        torch.testing.assert_close(out.float(), ref, atol=(4e-2 if fast else 1e-2) * ref.pow(2).mean().sqrt().item(),
                                   rtol=1.6e-2)
        assert torch.equal(out, ops.f8f8bf16_rowwise(xq, wq, x_scale, w_scale, None, fast)), fast
    assert error[True] <= 2e-2 and error[False] <= 4e-3 and error[False] < error[True], error
    # The positional and keyword forms and torch.ops agree; the default is fast accumulation.
    out = ops.f8f8bf16_rowwise(xq, wq, x_scale, w_scale)
    assert torch.equal(out, ops.f8f8bf16_rowwise(xq, wq, x_scale, w_scale, use_fast_accum=True))
    assert torch.equal(torch.ops.mslk_dsl.f8f8bf16_rowwise(xq, wq, x_scale, w_scale, None, False),
                       ops.f8f8bf16_rowwise(xq, wq, x_scale, w_scale, use_fast_accum=False))
    with pytest.raises(TypeError, match="use_fast_accum"):
        ops.f8f8bf16_rowwise(xq, wq, x_scale, w_scale, None, 1)


def test_f8f8bf16_rowwise_promotion_is_accurate():
    """With promotion the long-K error stays at bf16 rounding level (a few 1e-3 of rms)."""
    m, n, k = 256, 512, 28672
    xq, x_scale = quantize_rowwise(randn(m, k, seed=1), FP8, FP8_MAX)
    wq, w_scale = quantize_rowwise(randn(n, k, seed=2), FP8, FP8_MAX)
    ref = (xq.float() @ wq.float().T) * x_scale[:, None] * w_scale[None, :]
    for config in _template("f8f8bf16_rowwise").valid_configs("sm90a", {"bias": "none", "fast_accum": False}):
        if config["promote"]:
            rows = config.get("x_rows", m)  # decode configs serve M <= x_rows
            out = ops.f8f8bf16_rowwise(xq[:rows], wq, x_scale[:rows], w_scale, use_fast_accum=False, config=config)
            rel = ((out.float() - ref[:rows]).norm() / ref[:rows].norm()).item()
            assert rel <= 4e-3, f"{config_name(config)}: relative Frobenius error {rel}"


def test_f8f8bf16_rowwise_promotion_chunks_cover_k():
    """The two warpgroups of a 128-row tile promote at different k-tiles (the second one's first
    chunk is half a chunk): every k-tile count from 1 to 10 (the last one partial) sums each
    k-tile exactly once in both halves of the tile."""
    for config in _template("f8f8bf16_rowwise").valid_configs("sm90a", {"bias": "none", "fast_accum": False}):
        if config["promote"] and config["tile_m"] == 128:
            for k_tiles in range(1, 11):
                _check_fp8(130, 144, 128 * k_tiles - 16, False, config)


def test_f8f8bf16_rowwise_rejects_unaligned_sizes():
    xq = torch.zeros(4, 100, device="cuda", dtype=FP8)
    wq = torch.zeros(64, 100, device="cuda", dtype=FP8)
    ones = torch.ones(64, device="cuda")
    with pytest.raises(ValueError, match="K=100"):
        ops.f8f8bf16_rowwise(xq, wq, ones[:4], ones)
    xq = torch.zeros(4, 64, device="cuda", dtype=FP8)
    wq = torch.zeros(100, 64, device="cuda", dtype=FP8)
    with pytest.raises(ValueError, match="N=100"):
        ops.f8f8bf16_rowwise(xq, wq, ones[:4], torch.ones(100, device="cuda"))


# ----------------------------------------------------------- MSLK's contract: N % 8, batch dims, zero sizes
@pytest.mark.parametrize("n", [72, 1000, 8200])
def test_gemms_take_any_n_multiple_of_8(n):
    """N = 72, 1000, 8200: not multiples of 16 (16-byte output rows are all TMA needs)."""
    for m in (1, 37, 300):
        check_bf16(m, n, 256, torch.bfloat16)
        for fast in (True, False):
            _check_fp8(m, n, 256, has_bias=n != 1000, bias_dtype=torch.float32 if n == 8200 else torch.bfloat16,
                       fast=fast)


def test_gemms_take_leading_batch_dims():
    x = randn(3, 50, 256, seed=1).to(torch.bfloat16)
    w = randn(136, 256, seed=2).to(torch.bfloat16)
    y = ops.bf16_gemm(x, w)
    assert y.shape == (3, 50, 136)
    torch.testing.assert_close(y.float(), x.float() @ w.float().T, atol=1e-2, rtol=1e-2)
    (xq, wq, x_scale, w_scale, bias), ref = fp8_case(150, 136, 256, True, FP8, FP8_MAX)
    for scale, fast in ((x_scale, True), (x_scale.view(3, 50), True), (x_scale.view(3, 50), False)):
        out = ops.f8f8bf16_rowwise(xq.view(3, 50, 256), wq, scale, w_scale, bias, fast)
        assert out.shape == (3, 50, 136)
        torch.testing.assert_close(out.float().view(150, 136), ref, atol=1e-2 * ref.abs().max().item(), rtol=1.6e-2)
    out = ops.f8f8bf16_rowwise(xq.view(3, 50, 256), wq, x_scale, w_scale, bias.float(), False)
    torch.testing.assert_close(out.float().view(150, 136), ref, atol=1e-2 * ref.abs().max().item(), rtol=1.6e-2)


def test_gemms_zero_sizes_give_zeros_or_the_bias():
    w = randn(64, 128, seed=3).to(torch.bfloat16)
    assert ops.bf16_gemm(torch.empty(0, 128, device="cuda", dtype=torch.bfloat16), w).shape == (0, 64)
    assert ops.bf16_gemm(randn(5, 128, seed=4).to(torch.bfloat16),
                         torch.empty(0, 128, device="cuda", dtype=torch.bfloat16)).shape == (5, 0)
    k0 = ops.bf16_gemm(torch.empty(5, 0, device="cuda", dtype=torch.bfloat16),
                       torch.empty(64, 0, device="cuda", dtype=torch.bfloat16))
    assert torch.equal(k0, torch.zeros(5, 64, device="cuda", dtype=torch.bfloat16))
    bias = randn(64, seed=5).to(torch.bfloat16)
    empty_q = torch.empty(5, 0, device="cuda", dtype=FP8)
    for b, fast in ((bias, True), (bias, False), (bias.float(), True)):
        out = ops.f8f8bf16_rowwise(empty_q, torch.empty(64, 0, device="cuda", dtype=FP8),
                                   torch.ones(5, device="cuda"), torch.ones(64, device="cuda"), b, fast)
        assert torch.equal(out, b.to(torch.bfloat16).expand(5, 64))
    rows0 = ops.f8f8bf16_rowwise(torch.empty(2, 0, 128, device="cuda", dtype=FP8), torch.zeros(64, 128, device="cuda",
                                 dtype=FP8), torch.ones(2, 0, device="cuda"), torch.ones(64, device="cuda"), None, False)
    assert rows0.shape == (2, 0, 64)
