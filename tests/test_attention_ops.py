"""attention_fwd on the CPU: bad input raises a clear error naming what is wrong before anything is
chosen or launched; the mask arguments map to the kernels' (family, band) as the reference reads
them; the bias classes match MSLK's documented masks; the template's heuristic and ``serves``."""
import pytest
import torch

from mslk_dsl.attention import attn_bias as ab
from mslk_dsl.ops import attention as attn
from mslk_dsl.ops.dispatch import KernelOp
from mslk_dsl import ops, registry

bf16 = torch.bfloat16


def _qkv(B=2, Mq=16, Mk=24, Hq=4, Hkv=2, K=64, dtype=bf16):
    return (torch.randn(B, Mq, Hq, K, dtype=dtype), torch.randn(B, Mk, Hkv, K, dtype=dtype),
            torch.randn(B, Mk, Hkv, K, dtype=dtype))


@pytest.fixture
def no_kernel(monkeypatch):
    """Fail the test if a call gets as far as choosing a kernel."""
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was chosen for input that should have been refused")
    monkeypatch.setattr(KernelOp, "selection", refuse)
    monkeypatch.setattr(KernelOp, "kernel", refuse)


def _seq(*lengths):
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)


q, k, v = _qkv()
BAD = [
    (lambda: ops.attention_fwd(q.float(), k, v), TypeError, "q has dtype torch.float32"),
    (lambda: ops.attention_fwd(q, k.half(), v), TypeError, "k has dtype"),
    (lambda: ops.attention_fwd(q[0], k, v), ValueError, "q must be 4-D"),
    (lambda: ops.attention_fwd(*_qkv(K=264)), ValueError, "head dims 264 (q, k) and 264 (v) are not supported: "
     "each must be 1 to 256; kernels are built for (q / k, v) (64, 64), (96, 96)"),
    (lambda: ops.attention_fwd(q, k, torch.randn(2, 24, 2, 320, dtype=bf16)), ValueError,
     "head dims 64 (q, k) and 320 (v) are not supported"),
    (lambda: ops.attention_fwd(*_qkv(K=0)), ValueError, "head dims 0 (q, k) and 0 (v)"),
    (lambda: ops.attention_fwd(*_qkv(Hq=6, Hkv=4)), ValueError, "multiple of the key/value heads"),
    (lambda: ops.attention_fwd(q, k, v[:, :5]), ValueError, "k has shape"),
    (lambda: ops.attention_fwd(q, k[:1], v[:1]), ValueError, "expected [B=2"),
    (lambda: ops.attention_fwd(q[..., ::2], k[..., ::2], v[..., ::2]), ValueError, "contiguous in its last"),
    (lambda: ops.attention_fwd(torch.randn(2, 16, 4, 68, dtype=bf16)[..., :64], k, v), ValueError,
     "multiples of 8 elements"),
    (lambda: ops.attention_fwd(torch.randn(2 * 16 * 4 * 64 + 1, dtype=bf16)[1:].view(2, 16, 4, 64), k, v),
     ValueError, "16-byte boundary"),
    (lambda: ops.attention_fwd(q[:1], k[:1], v[:1], _seq(16), None), ValueError, "go together"),
    (lambda: ops.attention_fwd(q, k, v, _seq(8, 8), _seq(12, 12)), ValueError, "B = 1"),
    (lambda: ops.attention_fwd(q[:1], k[:1], v[:1], _seq(8, 8).long(), _seq(12, 12)), TypeError,
     "seqstart_q has dtype"),
    (lambda: ops.attention_fwd(q[:1], k[:1], v[:1], _seq(8, 8), _seq(24)), ValueError, "n + 1 >= 2"),
    (lambda: ops.attention_fwd(q[:1], k[:1], v[:1], _seq(8, 8), _seq(12, 12), causal=True), ValueError,
     "bottom-right"),
    (lambda: ops.attention_fwd(q, k, v, scale=float("nan")), ValueError, "scale must be finite"),
]


@pytest.mark.parametrize("call,exc,words", BAD, ids=[b[2] for b in BAD])
def test_bad_input_is_refused_before_a_kernel_is_chosen(call, exc, words, no_kernel):
    with pytest.raises(exc, match=None) as info:
        call()
    assert words in str(info.value), str(info.value)


def test_head_dims_without_a_kernel_run_padded_to_the_smallest_that_holds_them():
    """Each (K, Kv) up to 256 maps to the served pair of fewest columns that holds it; served
    pairs map to themselves, and only those need 16-byte row strides (the others are copied)."""
    served = attn.limits.HEAD_DIM_PAIRS
    for d, dv in served:
        assert attn.kernel_head_dims("op", d, dv) == (d, dv)
    assert attn.kernel_head_dims("op", 80, 80) == (96, 96)
    assert attn.kernel_head_dims("op", 1, 1) == (64, 64)
    assert attn.kernel_head_dims("op", 160, 100) == (192, 128)
    assert attn.kernel_head_dims("op", 128, 64) == (128, 128)
    assert attn.kernel_head_dims("op", 64, 200) == (256, 256)
    for K in range(1, 257, 7):
        for Kv in range(1, 257, 11):
            d, dv = attn.kernel_head_dims("op", K, Kv)
            assert (d, dv) in served and d >= K and dv >= Kv
            assert not any(sd >= K and sdv >= Kv and sd + sdv < d + dv for sd, sdv in served)


def test_padded_head_dims_take_any_strides(no_kernel):
    """A tensor whose head dim the op pads is copied: rows off 16-byte strides pass the checks,
    whose last one on this machine is the GPU requirement. A tensor that reaches the kernel as
    it is (q and k of a served 128 beside a v of 60) still needs 16-byte rows."""
    odd = torch.randn(2, 16, 4, 40, dtype=bf16)[..., :33]
    with pytest.raises(Exception, match="CUDA or ROCm"):
        ops.attention_fwd(odd, torch.randn(2, 24, 2, 33, dtype=bf16), torch.randn(2, 24, 2, 33, dtype=bf16))
    q, k = torch.randn(2, 16, 4, 128, dtype=bf16), torch.randn(2, 24, 2, 128, dtype=bf16)
    odd_v = torch.randn(2, 24, 2, 63, dtype=bf16)[..., :60]
    with pytest.raises(Exception, match="CUDA or ROCm"):
        ops.attention_fwd(q, k, odd_v)
    with pytest.raises(ValueError, match="q must start on a 16-byte boundary"):
        ops.attention_fwd(torch.randn(2, 16, 4, 131, dtype=bf16)[..., :128], k, odd_v)


def test_good_input_on_the_cpu_names_the_gpu_requirement(no_kernel):
    with pytest.raises(Exception, match="CUDA or ROCm"):
        ops.attention_fwd(*_qkv(), causal=True)


@pytest.mark.parametrize("Mq,Mk", ((16, 24), (24, 16), (20, 20)))
@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(causal=True, bottom_right=True),
                                  dict(window_left=5, window_right=3), dict(bottom_right=True, window_left=4),
                                  dict(causal=True, window_left=6), dict(bottom_right=True, window_right=2)])
def test_kernel_band_is_the_reference_mask(Mq, Mk, mask):
    """The kernels see -left <= j - i - (Mk - Mq) <= right (their family and band); that band must
    be exactly the reference's visible set."""
    family, left, right = attn.kernel_window(mask.get("causal", False), mask.get("bottom_right", False),
                                             mask.get("window_left", -1), mask.get("window_right", -1), Mq, Mk)
    i, j = torch.arange(Mq)[:, None], torch.arange(Mk)[None, :]
    d = j - i - (Mk - Mq)
    kernel_sees = (d >= -left) & (d <= right)
    want = attn.visible_keys(Mq, Mk, **mask)
    assert torch.equal(kernel_sees, want)
    if family == attn.MASK_NONE:
        assert bool(want.all())
    if family == attn.MASK_CAUSAL:
        assert (left, right) == (attn.limits.UNBOUNDED_WINDOW, 0)


def test_biases_match_mslk_documented_masks():
    local = ab.LocalAttentionFromBottomRightMask(window_left=1, window_right=2).materialize((4, 5)).exp()
    assert local.tolist() == [[1, 1, 1, 1, 0], [0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]
    causal = ab.LowerTriangularMask().materialize((3, 4)).exp()
    assert causal.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    bottom_right = ab.LowerTriangularFromBottomRightMask().materialize((3, 4)).exp()
    assert bottom_right.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    band = ab.LowerTriangularFromBottomRightLocalAttentionMask(2).materialize((3, 3)).exp()
    assert band.tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    packed = ab.BlockDiagonalCausalMask.from_seqlens([2, 1], device="cpu").materialize((3, 3)).exp()
    assert packed.tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    # MSLK's BlockDiagonalCausalLocalAttentionMask: key j of query i's block when i - window < j <= i
    banded = ab.BlockDiagonalMask.from_seqlens([4, 2], device="cpu").make_local_attention(2)
    assert isinstance(banded, ab.BlockDiagonalCausalLocalAttentionMask)
    assert banded.materialize((6, 6)).exp().tolist() == [
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]]
    q, k = torch.empty(1, 6, 2, 64), torch.empty(1, 6, 2, 64)
    args = banded.fwd_args(q, k)
    assert (args["causal"], args["bottom_right"], args["window_left"]) == (True, True, 1)
    with pytest.raises(NotImplementedError, match="lengths that differ"):
        ab.BlockDiagonalMask.from_seqlens([4, 2], [5, 2], device="cpu").make_local_attention(2).fwd_args(
            q, torch.empty(1, 7, 2, 64))
    with pytest.raises(ValueError, match="window_size > 0"):
        ab.BlockDiagonalMask.from_seqlens([4, 2], device="cpu").make_local_attention(0)


def test_biases_give_the_op_its_mask_arguments():
    q1, k1 = torch.empty(1, 7, 2, 64), torch.empty(1, 9, 2, 64)
    packed = ab.BlockDiagonalCausalFromBottomRightMask.from_seqlens([3, 4], [4, 5], device="cpu")
    args = packed.fwd_args(q1, k1)
    assert args["seqstart_q"].tolist() == [0, 3, 7] and args["seqstart_k"].tolist() == [0, 4, 9]
    assert args["causal"] and args["bottom_right"] and args["max_seqlen_k"] == 5
    with pytest.raises(NotImplementedError, match="top-left"):
        ab.BlockDiagonalCausalMask.from_seqlens([3, 4], [4, 5], device="cpu").fwd_args(q1, k1)
    assert ab.BlockDiagonalCausalMask.from_seqlens([3, 4], device="cpu").fwd_args(q1, q1)["bottom_right"]
    with pytest.raises(ValueError, match="packed sequences"):
        packed.fwd_args(torch.empty(1, 8, 2, 64), k1)
    with pytest.raises(ValueError):
        ab.LocalAttentionFromBottomRightMask(-1, 0)


def test_template_heuristic_picks_a_valid_config_that_serves_the_call():
    (t,) = registry.get_templates(op="attention_fwd", backend="cute")
    for d, dv in attn.limits.HEAD_DIM_PAIRS:
        sig = {"dtype": "bfloat16", "head_dim": d, "head_dim_v": dv}
        for mask in range(len(attn.limits.MASKS)):
            for varlen in (0, 1):
                problem = {"B": 1, "Mq": 100, "Mk": 100, "Hq": 8, "Hkv": 1, "mask": mask, "varlen": varlen}
                config = t.heuristic("sm90a", sig, problem)
                assert config in t.valid_configs("sm90a", sig)
                assert t.serves(config, problem)
                other = dict(problem, mask=(mask + 1) % 3)
                assert not t.serves(config, other)
    # The AOT build stays modest: 6 head-dim pairs x (3 masks x dense / packed) and the persistent
    # configs the heuristic takes, ~20 s of compile each on a 2-core machine.
    assert len(t.all_configs()) * len(attn.limits.DTYPES) <= 100


@pytest.mark.parametrize("K,Kv", [(192, 128), (96, 96), (80, 48)])
def test_the_fake_takes_the_output_head_dim_from_v(K, Kv):
    """Under FakeTensorMode (torch.compile's tracing) out is [B, Mq, Hq, Kv], served head dims
    and padded ones alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 17, 4, K, dtype=bf16, device="cuda")
        k = torch.empty(2, 33, 2, K, dtype=bf16, device="cuda")
        v = torch.empty(2, 33, 2, Kv, dtype=bf16, device="cuda")
        out, lse = torch.ops.mslk_dsl.attention_fwd(q, k, v, causal=True)
    assert tuple(out.shape) == (2, 17, 4, Kv) and out.dtype == bf16
    assert tuple(lse.shape) == (2, 4, 17) and lse.dtype == torch.float32


def test_the_api_takes_mslks_layouts():
    """[B, M, K] is one head; [B, M, G, H, K] with k / v expanded across H (MSLK's GQA form) or of
    one head per group is G KV heads read in place; with full heads it is G * H heads. Results
    come back in q's layout."""
    from mslk_dsl.attention import _to_bmhk

    q, k, v = torch.randn(2, 7, 32), torch.randn(2, 9, 32), torch.randn(2, 9, 16)
    q4, k4, v4, restore = _to_bmhk(q, k, v)
    assert (q4.shape, k4.shape, v4.shape) == ((2, 7, 1, 32), (2, 9, 1, 32), (2, 9, 1, 16))
    out, lse = restore(torch.empty(2, 7, 1, 16), torch.empty(2, 1, 7))
    assert out.shape == (2, 7, 16) and lse.shape == (2, 1, 7)

    q = torch.randn(2, 7, 3, 4, 64)
    k = torch.randn(2, 9, 3, 1, 64).expand(2, 9, 3, 4, 64)
    v = torch.randn(2, 9, 3, 1, 64)
    q4, k4, v4, restore = _to_bmhk(q, k, v)
    assert (q4.shape, k4.shape, v4.shape) == ((2, 7, 12, 64), (2, 9, 3, 64), (2, 9, 3, 64))
    assert k4.data_ptr() == k.data_ptr() and torch.equal(k4, k[:, :, :, 0])
    assert torch.equal(q4[:, :, 5], q[:, :, 1, 1])   # query head g * H + h of group g
    out, lse = restore(torch.empty(2, 7, 12, 64), torch.empty(2, 12, 7))
    assert out.shape == (2, 7, 3, 4, 64) and lse.shape == (2, 3, 4, 7)

    k, v = torch.randn(2, 9, 3, 4, 64), torch.randn(2, 9, 3, 4, 64)   # every head its own
    _, k4, v4, _ = _to_bmhk(q, k, v)
    assert k4.shape == (2, 9, 12, 64) and torch.equal(k4[:, :, 7], k[:, :, 1, 3])
    with pytest.raises(ValueError, match=r"\[B, Mk, 3, 4 or 1, K\]"):
        _to_bmhk(q, torch.randn(2, 9, 2, 4, 64), v)
    with pytest.raises(ValueError, match="must all be"):
        _to_bmhk(q, k[..., 0, :], v)


def test_the_api_takes_mslks_arguments_in_mslks_order():
    """(query, key, value, attn_bias, p, scale): a p other than 0 (dropout) and an op are refused
    by name, never taken for the scale."""
    from mslk_dsl.attention import memory_efficient_attention_forward, memory_efficient_attention_partial

    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=r"dropout is not supported \(p=0.125.*scale="):
        memory_efficient_attention_forward(q, k, v, None, 0.125)
    with pytest.raises(NotImplementedError, match="op="):
        memory_efficient_attention_partial(q, k, v, op=object())
    with pytest.raises(Exception, match="CUDA or ROCm"):   # the rest is checked, then the device
        memory_efficient_attention_forward(q, k, v, None, 0.0, 0.1, output_dtype=torch.float32, deterministic=True)


def test_the_api_traces_into_one_graph_of_torch_ops():
    """torch.compile(fullgraph=True) over memory_efficient_attention_partial (a 5-D GQA call with
    a bias, and a decode call under a KV-cache bias) and merge_attentions, on meta tensors: the
    API calls the torch ops while tracing (not the eager call path, whose checks read pointers),
    so the graph holds them and nothing breaks it."""
    from mslk_dsl import attention

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(q, k, qd, cache, lengths):
        out, lse = attention.memory_efficient_attention_partial(q, k, k, ab.LowerTriangularFromBottomRightMask())
        bias = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask(q_len=1, kv_padding=cache.shape[1], kv_seqlen=lengths)
        dec, dec_lse = attention.memory_efficient_attention_partial(qd, cache, cache, bias)
        merged, merged_lse = attention.merge_attentions([dec, dec], [dec_lse, dec_lse])
        return out, lse, merged, merged_lse

    meta = dict(device="meta", dtype=bf16)
    q = torch.empty(2, 7, 3, 4, 64, **meta)
    k = torch.empty(2, 9, 3, 1, 64, **meta).expand(2, 9, 3, 4, 64)
    qd, cache = torch.empty(4, 1, 8, 128, **meta), torch.empty(4, 256, 2, 128, **meta)
    torch._dynamo.reset()
    out, lse, merged, merged_lse = torch.compile(layer, backend=backend, fullgraph=True)(
        q, k, qd, cache, torch.empty(4, dtype=torch.int32, device="meta"))
    assert len(graphs) == 1
    called = " ".join(str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function")
    for op in ("attention_fwd", "attention_decode", "merge_attentions"):
        assert f"mslk_dsl.{op}" in called, called
    assert out.shape == (2, 7, 3, 4, 64) and lse.shape == (2, 3, 4, 7)
    assert merged.shape == (4, 1, 8, 128) and merged_lse.shape == (4, 8, 1)
