"""gather_scale_quant_dense_tokens and the MoE layer (mslk_dsl.moe.MoE) on Hopper, against torch
references written here (sm_90 GPUs).

gather_scale_quant_dense_tokens: bit-exact against gather-then-quantize in torch (the product in
fp32 rounded to x's dtype, then quantize_fp8_row's arithmetic: amax floored at 1/512 and capped
by scale_ub, scale = amax / 448, xq = fp8(x / scale) with IEEE division), over 1-row, odd-width
(unaligned), narrow and model-sized rows, top_k 1 / 2 / 8, E 16 / 128, fp16, bf16 / fp32 and
column-major scores, scale_ub and valid_token_count (rows at and past it stay unwritten).

The layer against a plain-torch reference layer (per-expert loops, fp32 math) with the same
weights, routing by the same bf16 scores (top-k by a stable sort: ties to the lower expert, as
index_shuffling; sigmoid scores rounded to bf16 tie often, and the reference computes them with
the same GEMM call, so the ties are the same bits). Tolerances, as a relative Frobenius error ||out - ref|| / ||ref||:
  * bf16 path vs the fp32 reference: 1e-2. The layer rounds to bf16 (u = 2^-9) after gate and
    up, after silu_mul, after down and in the scatter's adds: ~0.4% rms. A routing or composition
    error is far larger: the experts' outputs are uncorrelated, so a missing or wrong expert moves
    ~1 / sqrt(top_k) of a token's output norm (35% at top_k 8).
  * FP8 path vs a reference that quantizes where the layer does (the gathered rows, bit-identical
    to the layer's; silu_mul's output; the weights, dequantized to fp32 for the products): 3e-2.
    What remains is summation order and bf16 rounding of gate / up (2^-9), which moves silu_mul's
    output across an e4m3 rounding boundary in ~2^-9 / 2^-4 of its elements, each by one step
    (2^-3 relative): ~1% rms.
  * FP8 path vs the bf16 reference of the weights before quantization: 0.2, a sanity bound. e4m3
    keeps 3 mantissa bits (rms rounding error 2^-4 / sqrt(3) = 3.6% per quantized operand: x and
    the weights for gate / up, then silu_mul's output and w_down): ~8% rms expected.
torch.compile(fullgraph=True) and a CUDA-graph replay give the eager layer's output (same kernels),
up to the order of the scatter's bf16 atomic adds (a token's top_k rows land in any order, each
addition rounding: a few bf16 ulps of the output), while a replay that kept the captured routing
would be off by O(1).
Sizes: decode T in {1, 16, 128} and prefill-sized T at shrunk DeepSeek-V3-like (E 128, top-8),
Llama-4-Scout-like (E 16, top-1) and Mixtral-like (E 8, top-2) widths; the full widths (D 7168 /
5120 / 4096, H 2048 / 8192 / 14336) at T 4096 / 8192 / 4096 in test_layer_full_size.

The grouped GEMMs are torch.ops.mslk_dsl's; where they are not registered the layer tests skip,
unless MSLK_DSL_TEST_GROUPED_STANDIN=1 puts torch._grouped_mm stand-ins in their place (to test
the routing and composition alone; tests/grouped_standin.py).
"""
import pytest
import torch
from grouped_standin import SKIP_REASON, grouped_ops

from mslk_dsl import ops
from mslk_dsl.moe import MoE
from mslk_dsl.ops.declaration import get
from mslk_dsl.ops.elementwise import _quantize_reference
from mslk_dsl.testing import skipUnlessCudaCapability

hopper = skipUnlessCudaCapability((9, 0))
bf16 = torch.bfloat16


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


# ------------------------------------------------------------------ gather_scale_quant_dense_tokens
def _routing(t, e, k, seed):
    g = _gen(seed)
    tok = torch.randperm(t * k, device="cuda", generator=g) % t
    exp = torch.randint(0, e, (t * k,), device="cuda", generator=g)
    return tok.to(torch.int32), exp.to(torch.int32)


def _check_gather_quant(t, d, k, e, dtype=bf16, score_dtype=bf16, column_major=False, scale_ub=None,
                        n_valid=None):
    g = _gen(t * 13 + d)
    x = (torch.randn(t, d, device="cuda", generator=g) * 3).to(dtype)
    x[0, : min(d, 3)] = 0                                    # zeros and a spread of magnitudes
    scores = torch.rand(e, t, device="cuda", generator=g).to(score_dtype).t()
    if not column_major:
        scores = scores.contiguous()
    tok, exp = _routing(t, e, k, seed=t * 5 + d)
    a = t * k
    ub = None if scale_ub is None else torch.tensor([scale_ub], device="cuda")
    valid = None if n_valid is None else torch.tensor([n_valid], dtype=torch.int32, device="cuda")
    fp8 = torch.float8_e4m3fn
    sentinel_q = torch.full((a, d), 0x7E, dtype=torch.uint8, device="cuda").view(fp8)   # 448 in e4m3fn
    sentinel_s = torch.full((a,), -1.0, device="cuda")
    xq, scale = ops.gather_scale_quant_dense_tokens(x, tok, exp, scores, ub, valid, out=(sentinel_q, sentinel_s))
    what = f"T={t} D={d} k={k} E={e} {dtype} {score_dtype} cm={column_major} ub={scale_ub} n={n_valid}"
    assert xq.data_ptr() == sentinel_q.data_ptr() and xq.dtype == fp8 and scale.dtype == torch.float32, what
    n = a if n_valid is None else min(n_valid, a)
    ref_q, ref_s = get("gather_scale_quant_dense_tokens").reference(x, tok[:n], exp[:n], scores, ub)
    assert torch.equal(scale[:n], ref_s), what
    assert torch.equal(xq[:n].view(torch.uint8), ref_q.view(torch.uint8)), what
    assert bool((scale[n:] == -1.0).all()) and bool((xq[n:].view(torch.uint8) == 0x7E).all()), what + ": wrote rows past n"


GATHER_SHAPES = [  # (T, D, top_k, E): 1 token, odd / narrow / model widths, top-k 1 / 2 / 8, E 16 / 128
    (1, 7168, 1, 16), (1, 5120, 8, 128), (3, 4096, 2, 16), (1000, 7168, 8, 128), (2048, 2048, 1, 16),
    (333, 1001, 2, 16), (17, 8, 2, 16), (64, 16, 8, 128), (4096, 5120, 2, 128)]


@hopper
@pytest.mark.parametrize("t,d,k,e", GATHER_SHAPES, ids=lambda v: str(v))
def test_gather_scale_quant_shapes(t, d, k, e):
    _check_gather_quant(t, d, k, e)


@hopper
def test_gather_scale_quant_options():
    _check_gather_quant(100, 7168, 8, 128, score_dtype=torch.float32)
    _check_gather_quant(100, 5120, 2, 16, column_major=True)
    _check_gather_quant(100, 4096, 2, 16, dtype=torch.float16)
    _check_gather_quant(100, 7168, 8, 128, scale_ub=0.5)          # caps the absmax: saturates
    _check_gather_quant(100, 7168, 8, 128, n_valid=317)
    _check_gather_quant(100, 7168, 8, 128, n_valid=0)
    _check_gather_quant(100, 1001, 2, 16, n_valid=5000)            # beyond A: every row
    _check_gather_quant(100, 5124, 8, 16)                           # 8-byte accesses (D x4, not x8)
    _check_gather_quant(100, 5122, 8, 16)                           # 4-byte accesses (D even, not x4)
    _check_gather_quant(33, 138, 2, 16, dtype=torch.float16)


@hopper
def test_gather_scale_quant_matches_mslk_semantics_within_one_fp8_step():
    """MSLK quantizes the fp32 product x * score without rounding it to bf16 first: the results
    dequantize to within one e4m3 step (2^-3 relative) plus the bf16 rounding of each other."""
    t, d, k, e = 512, 7168, 8, 128
    x = torch.randn(t, d, device="cuda", generator=_gen(1)).to(bf16)
    scores = torch.rand(t, e, device="cuda", generator=_gen(2))
    tok, exp = _routing(t, e, k, seed=3)
    xq, scale = ops.gather_scale_quant_dense_tokens(x, tok, exp, scores)
    exact = x[tok.long()].float() * scores[tok.long(), exp.long()][:, None]
    back = xq.float() * scale[:, None]
    assert bool(((back - exact).abs() <= 2**-4 * exact.abs() + 2**-8 * exact.abs() + 2**-9 * scale[:, None]).all())


# ------------------------------------------------------------------ the layer
# name: (E, top_k, D, H) full size, shrunk (D, H), prefill T full, prefill T in tests
CONFIGS = {"deepseek": (128, 8, 7168, 2048, (1024, 256), 4096, 512),
           "llama4": (16, 1, 5120, 8192, (640, 1024), 8192, 2048),
           "mixtral": (8, 2, 4096, 14336, (512, 1792), 4096, 1024)}


def _need_grouped_ops():
    if grouped_ops() is None:
        pytest.skip(SKIP_REASON)


def _layer(e, k, d, h, shared, seed):
    torch.manual_seed(seed)
    layer = MoE(d, h, num_experts=e, top_k=k, shared_expert=shared, device="cuda")
    return layer, {n: p.detach().clone() for n, p in layer.named_parameters()}


def _experts_of(scores, k):
    """Top-k experts per token, ties to the lower expert (index_shuffling's rule)."""
    return torch.sort(scores.float(), dim=1, descending=True, stable=True).indices[:, :k]


def _quantized(t):
    q, s = _quantize_reference(t)
    return q.float() * s.unsqueeze(-1)


def _swiglu(x, w_gate, w_up, w_down, fp8):
    """One expert in fp32, rounding to bf16 where the layer's ops output bf16; with ``fp8``, the
    operands quantized where the layer quantizes them (weights come dequantized)."""
    if fp8:
        x = _quantized(x.to(bf16))
        g, u = (x @ w_gate.T).to(bf16).float(), (x @ w_up.T).to(bf16).float()
        return _quantized((torch.nn.functional.silu(g) * u).to(bf16)) @ w_down.T
    x, w_gate, w_up, w_down = x.float(), w_gate.float(), w_up.float(), w_down.float()
    return (torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def reference_layer(weights, x, top_k, fp8):
    """BaselineMoE's arithmetic in plain torch: sigmoid router, top-k, score-scaled inputs (rounded
    to bf16, as the gather), per-expert SwiGLU, summed with the shared expert in fp32."""
    d = x.shape[-1]
    tokens = x.reshape(-1, d)
    scores = torch.sigmoid(tokens @ weights["router"])
    experts = _experts_of(scores, top_k)
    out = torch.zeros(tokens.shape[0], d, device=x.device)
    for e in range(weights["w_gate"].shape[0]):
        tok = (experts == e).any(dim=1).nonzero().flatten()
        if tok.numel():
            rows = (tokens[tok].float() * scores[tok, e].float()[:, None]).to(bf16)
            out.index_add_(0, tok, _swiglu(rows, weights["w_gate"][e], weights["w_up"][e], weights["w_down"][e], fp8))
    if "shared_w_gate" in weights:
        out += _swiglu(tokens, weights["shared_w_gate"], weights["shared_w_up"], weights["shared_w_down"], fp8)
    return out.view(x.shape)


def _dequantized_weights(layer):
    w = {"router": layer.router.detach()}
    for name in layer.expert_weight_names():
        w[name] = getattr(layer, name).float() * getattr(layer, name + "_scale").unsqueeze(-1)
    return w


def _rel(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _check_layer(t, e, k, d, h, shared, fp8, seed=0):
    layer, bf16_weights = _layer(e, k, d, h, shared, seed)
    x = torch.randn(t, d, device="cuda", generator=_gen(seed + 1)).to(bf16)
    what = f"T={t} E={e} k={k} D={d} H={h} shared={shared} fp8={fp8}"
    if not fp8:
        out = layer(x)
        assert out.shape == x.shape and out.dtype == bf16, what
        err = _rel(out, reference_layer(bf16_weights, x, k, fp8=False))
        assert err < 1e-2, f"{what}: relative error {err:.2e}"
        return
    layer.quantize_fp8_rowwise_()
    out = layer(x)
    err = _rel(out, reference_layer(_dequantized_weights(layer), x, k, fp8=True))
    assert err < 3e-2, f"{what}: relative error {err:.2e} against the FP8 reference"
    err = _rel(out, reference_layer(bf16_weights, x, k, fp8=False))
    assert err < 0.2, f"{what}: relative error {err:.2e} against the bf16 reference"


@hopper
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("t", [1, 16, 128, "prefill"])
def test_layer_against_the_reference(t, config, fp8):
    _need_grouped_ops()
    e, k, _, _, (d, h), _, prefill = CONFIGS[config]
    _check_layer(prefill if t == "prefill" else t, e, k, d, h, shared=False, fp8=fp8)


@hopper
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_layer_with_shared_expert(fp8):
    _need_grouped_ops()
    _check_layer(200, 16, 2, 512, 256, shared=True, fp8=fp8)
    _check_layer(1, 16, 2, 512, 256, shared=True, fp8=fp8)


# Tens of GB each: one worker runs these one after another, so parallel workers (-n 4)
# never hold two at once.
@pytest.mark.xdist_group("gpu-memory")
@hopper
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_layer_full_size(config, fp8):
    _need_grouped_ops()
    e, k, d, h, _, t, _ = CONFIGS[config]
    _check_layer(t, e, k, d, h, shared=False, fp8=fp8)


def _same_up_to_atomic_order(out, expected):
    torch.testing.assert_close(out, expected, rtol=2**-6, atol=2**-6 * float(expected.abs().max()))


def _layer_and_input(fp8, t=64, shared=True):
    layer, _ = _layer(16, 2, 512, 256, shared, seed=5)
    if fp8:
        layer.quantize_fp8_rowwise_()
    return layer, torch.randn(t, 512, device="cuda", generator=_gen(6)).to(bf16)


@hopper
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_layer_under_torch_compile_fullgraph(fp8):
    _need_grouped_ops()
    layer, x = _layer_and_input(fp8)
    expected = layer(x)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    for _ in range(2):
        _same_up_to_atomic_order(compiled(x), expected)


@hopper
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_layer_replays_in_a_cuda_graph(fp8):
    """Captured once, replayed on new tokens (new routing, new per-expert counts): the counts stay
    on the GPU, so the replay routes the new tokens correctly."""
    _need_grouped_ops()
    layer, x = _layer_and_input(fp8)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            layer(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    for seed in (7, 8):
        new_x = torch.randn(x.shape, device="cuda", generator=_gen(seed)).to(bf16)
        static_x.copy_(new_x)
        graph.replay()
        _same_up_to_atomic_order(static_out, layer(new_x))
