"""attention_fwd's Hopper kernel (and the mslk_dsl.attention API over it) against the fp32 reference.

Cases: head dims 64 / 96 / 128 / 192 / 256 and (192, 128) (q / k, v: DeepSeek's MLA prefill);
no mask, causal aligned top-left and bottom-right with Mq < Mk
and Mq > Mk (bottom-right then leaves the first Mq - Mk rows with no key: out 0, lse -inf),
sliding windows; GQA ratios 1 / 4 / 8 and MQA; packed sequences (1 to 64 of them, lengths drawn
from {1, 17, 1000, 4097}, q and k lengths drawn apart); q / k / v as strided views (a packed qkv
buffer, a padded batch); fp16; the partial API's LSE; every config, and the persistent ones on more
tiles than SMs.

Tolerance: out within 2.5e-2 (bf16) / 1e-2 (fp16) absolute of the reference computed in fp32 and
rounded once, which is what the rounding of P to 16 bits before the PV product costs on N(0, 1)
data (FA's own tests allow twice torch's low-precision error); mean error under 2e-3; LSE within
1e-3 absolute (fp32 sums; the kernel's exp2 and the reference's exp differ by ulps).
"""
import random

import pytest
import torch

from mslk_dsl import ops
from mslk_dsl.ops.attention import attention_reference, kernel_head_dims
from mslk_dsl.testing import skipUnlessCudaCapability

SM90 = skipUnlessCudaCapability((9, 0))
ATOL = {torch.bfloat16: 2.5e-2, torch.float16: 1e-2}
LENGTHS = (1, 17, 1000, 4097)


def _rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def check_against_reference(q, k, v, **mask):
    out, lse = ops.attention_fwd(q, k, v, **mask)
    torch.cuda.synchronize()
    ref_out, ref_lse = attention_reference(q, k, v, **mask)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    empty = torch.isinf(ref_lse)  # rows with no visible key: [B, H, M]
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), "rows without keys differ"
    assert torch.isfinite(out).all()
    err = (out.float() - ref_out.float()).abs()
    assert err.max().item() <= ATOL[q.dtype], f"out: max error {err.max().item():.3g}"
    assert err.mean().item() <= 2e-3, f"out: mean error {err.mean().item():.3g}"
    assert torch.equal(out.float().permute(0, 2, 1, 3)[empty], torch.zeros_like(out.float().permute(0, 2, 1, 3)[empty]))
    lse_err = (lse[~empty] - ref_lse[~empty]).abs()
    assert lse_err.numel() == 0 or lse_err.max().item() <= 1e-3, f"lse: max error {lse_err.max().item():.3g}"
    return out, lse


MASKS = {
    "none": {},
    "causal_top_left": {"causal": True},
    "causal_bottom_right": {"causal": True, "bottom_right": True},
    "local_bottom_right": {"bottom_right": True, "window_left": 100, "window_right": 0},
    "local_two_sided": {"bottom_right": True, "window_left": 37, "window_right": 129},
    "local_top_left": {"window_left": 64, "window_right": 64},
}


HEAD_DIMS = {f"d{d}" if d == dv else f"d{d}v{dv}": (d, dv) for d, dv in
             ((64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (256, 256))}


@SM90
@pytest.mark.parametrize("dims", HEAD_DIMS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("mq,mk", ((300, 517), (517, 300)))
def test_dense_masks(dims, mask, mq, mk):
    torch.manual_seed(0)
    d, dv = HEAD_DIMS[dims]
    q, k, v = _rand(2, mq, 8, d), _rand(2, mk, 2, d), _rand(2, mk, 2, dv)
    check_against_reference(q, k, v, **MASKS[mask])


@SM90
def test_mla_prefill_views():
    """DeepSeek's MLA prefill layout: k is the latent part (128) and the shared RoPE part (64)
    side by side, v a view of the decompressed kv buffer ([.., 256] per head, v its last 128),
    q a view of a [B, M, H, 192 + 64] projection; head and row strides that are not compact."""
    torch.manual_seed(9)
    kv = _rand(2, 700, 8, 256)
    k = _rand(2, 700, 8, 192)
    v = kv[..., 128:]
    q = _rand(2, 650, 8, 256)[..., :192]
    assert not v.is_contiguous() and not q.is_contiguous()
    out, _ = check_against_reference(q, k, v, causal=True, bottom_right=True)
    assert out.shape == (2, 650, 8, 128)


@SM90
@pytest.mark.parametrize("hq,hkv", ((8, 8), (8, 2), (32, 4), (16, 1)))
def test_gqa_ratios_and_mqa(hq, hkv):
    torch.manual_seed(1)
    q, k, v = _rand(2, 1000, hq, 128), _rand(2, 1000, hkv, 128), _rand(2, 1000, hkv, 128)
    check_against_reference(q, k, v, causal=True)


@SM90
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("causal", (False, True))
def test_dtypes_one_row_and_long(dtype, causal):
    torch.manual_seed(2)
    for b, m in ((1, 1), (3, 129), (1, 4097)):
        q, k, v = (_rand(b, m, 4, 128, dtype=dtype) for _ in range(3))
        check_against_reference(q, k, v, causal=causal)


@SM90
def test_strided_views():
    """q / k / v as views of a packed [B, M, 3, H, K] buffer (head and batch strides that are not
    the compact ones) and of a batch padded along M; nothing is copied."""
    torch.manual_seed(3)
    qkv = _rand(2, 333, 3, 8, 128)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    check_against_reference(q, k, v, causal=True)
    padded = _rand(3, 600, 4, 64)
    k, v = padded[:, :517], _rand(3, 517, 8, 64)[:, :, ::2]
    check_against_reference(_rand(3, 200, 8, 64), k, v, causal=True, bottom_right=True)


@SM90
@pytest.mark.parametrize("d,dv", ((8, 8), (33, 33), (72, 72), (80, 80), (128, 64), (160, 100), (256, 40)))
@pytest.mark.parametrize("mask", ("none", "causal_bottom_right", "local_top_left"))
def test_padded_head_dims(d, dv, mask):
    """Head dims no kernel is built for run on zero-padded copies (the next served pair): odd
    ones, v narrower than q / k; a tensor the op copies as a view off 16-byte strides (q where
    its head dim is padded, v always), the others as they are."""
    torch.manual_seed(d + dv)
    padded_q = kernel_head_dims("test", d, dv)[0] != d
    q = _rand(2, 211, 8, d + 3)[..., :d] if padded_q else _rand(2, 211, 8, d)
    k, v = _rand(2, 300, 2, d), _rand(2, 300, 2, dv + 3)[..., :dv]
    out, _ = check_against_reference(q, k, v, **MASKS[mask])
    assert out.shape == (2, 211, 8, dv) and out.is_contiguous()


@SM90
def test_padded_head_dims_packed_and_through_the_api():
    q, k, v, sq, sk, mq, mk = _packed(6, 4, 2, 80, same_lengths=False, seed=11, head_dim_v=48)
    check_against_reference(q, k, v, seqstart_q=sq, seqstart_k=sk, max_seqlen_q=mq, max_seqlen_k=mk,
                            causal=True, bottom_right=True)
    _check_block_diagonal_causal_api(112)


@SM90
@pytest.mark.parametrize("dims", ("d96", "d192v128"))
def test_partials_over_kv_chunks_merge_to_full(dims):
    """attention_fwd over 4 chunks of the keys, merged by merge_attentions, is attention over all
    of them (out and LSE), at the new head dims."""
    torch.manual_seed(10)
    d, dv = HEAD_DIMS[dims]
    q, k, v = _rand(2, 90, 8, d), _rand(2, 1111, 2, d), _rand(2, 1111, 2, dv)
    edges = [0, 5, 400, 1000, 1111]
    parts = [ops.attention_fwd(q, k[:, a:b], v[:, a:b]) for a, b in zip(edges, edges[1:])]
    out, lse = ops.merge_attentions(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    ref_out, ref_lse = attention_reference(q, k, v)
    assert out.shape == (2, 90, 8, dv)
    assert (out.float() - ref_out.float()).abs().max().item() <= ATOL[q.dtype]
    assert (lse - ref_lse).abs().max().item() <= 1e-3


def _packed(n, hq, hkv, head_dim, same_lengths, seed, head_dim_v=None):
    rng = random.Random(seed)
    lq = [rng.choice(LENGTHS) for _ in range(n)]
    lk = lq if same_lengths else [rng.choice(LENGTHS) for _ in range(n)]
    starts = [torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32) for lengths in (lq, lk)]
    q = _rand(1, sum(lq), hq, head_dim)
    k, v = _rand(1, sum(lk), hkv, head_dim), _rand(1, sum(lk), hkv, head_dim_v or head_dim)
    return q, k, v, starts[0], starts[1], max(lq), max(lk)


@SM90
@pytest.mark.parametrize("n", (1, 7, 64))
@pytest.mark.parametrize("mask", ("none", "causal_bottom_right", "local_bottom_right"))
def test_packed_sequences(n, mask):
    q, k, v, sq, sk, mq, mk = _packed(n, 4, 2, 128, same_lengths=False, seed=n)
    check_against_reference(q, k, v, seqstart_q=sq, seqstart_k=sk, max_seqlen_q=mq, max_seqlen_k=mk,
                            **MASKS[mask])


@SM90
@pytest.mark.parametrize("dims", ("d64", "d96", "d192", "d192v128", "d256"))
def test_packed_sequences_head_dims(dims):
    d, dv = HEAD_DIMS[dims]
    q, k, v, sq, sk, _, _ = _packed(9, 4, 1, d, same_lengths=True, seed=d + dv, head_dim_v=dv)
    check_against_reference(q, k, v, seqstart_q=sq, seqstart_k=sk, causal=True, bottom_right=True)


@SM90
def test_api_biases_and_partial_lse():
    """The MSLK-named API: each bias class reaches the kernel with its documented mask, and the
    partial op's LSE is the reference's."""
    from mslk_dsl import attention
    from mslk_dsl.attention import attn_bias as ab

    torch.manual_seed(4)
    q, k, v = _rand(2, 77, 8, 128), _rand(2, 150, 2, 128), _rand(2, 150, 2, 128)
    cases = [(None, {}), (ab.LowerTriangularMask(), {"causal": True}),
             (ab.LowerTriangularFromBottomRightMask(), {"causal": True, "bottom_right": True}),
             (ab.LocalAttentionFromBottomRightMask(window_left=20, window_right=5),
              {"bottom_right": True, "window_left": 20, "window_right": 5}),
             (ab.LowerTriangularFromBottomRightLocalAttentionMask(33),
              {"causal": True, "bottom_right": True, "window_left": 32})]
    for bias, mask in cases:
        out, lse = attention.memory_efficient_attention_partial(q, k, v, attn_bias=bias)
        ref_out, ref_lse = attention_reference(q, k, v, **mask)
        assert (out.float() - ref_out.float()).abs().max().item() <= ATOL[q.dtype], bias
        assert (lse - ref_lse).abs().max().item() <= 1e-3, bias
        full = attention.memory_efficient_attention_forward(q, k, v, attn_bias=bias)
        assert torch.equal(full, out)
    _check_block_diagonal_causal_api(64)


@SM90
def test_api_layouts_of_mslk():
    """memory_efficient_attention_forward / _partial on MSLK's [B, M, K] and [B, M, G, H, K]
    layouts (k / v expanded across H: GQA; or full heads) and with output_dtype, against the
    reference on the same data in [B, M, H, K]."""
    from mslk_dsl import attention
    from mslk_dsl.attention import attn_bias as ab

    torch.manual_seed(12)
    q, k, v = _rand(2, 130, 64), _rand(2, 200, 64), _rand(2, 200, 64)
    out, lse = attention.memory_efficient_attention_partial(q, k, v, ab.LowerTriangularFromBottomRightMask())
    ref_out, ref_lse = attention_reference(q[:, :, None], k[:, :, None], v[:, :, None], causal=True, bottom_right=True)
    assert out.shape == (2, 130, 64) and lse.shape == (2, 1, 130)
    assert (out.float() - ref_out[:, :, 0].float()).abs().max().item() <= ATOL[q.dtype]
    assert (lse - ref_lse).abs().max().item() <= 1e-3

    q = _rand(2, 150, 2, 4, 128)
    k, v = _rand(2, 300, 2, 1, 128).expand(2, 300, 2, 4, 128), _rand(2, 300, 2, 1, 128).expand(2, 300, 2, 4, 128)
    out = attention.memory_efficient_attention_forward(q, k, v, output_dtype=torch.float32)
    ref, _ = attention_reference(q.reshape(2, 150, 8, 128), k[:, :, :, 0], v[:, :, :, 0])
    assert out.shape == (2, 150, 2, 4, 128) and out.dtype == torch.float32
    assert (out.reshape(2, 150, 8, 128) - ref.float()).abs().max().item() <= ATOL[q.dtype]

    k, v = _rand(2, 300, 2, 4, 128), _rand(2, 300, 2, 4, 128)
    out, lse = attention.memory_efficient_attention_partial(q, k, v, ab.LowerTriangularMask())
    ref, ref_lse = attention_reference(q.reshape(2, 150, 8, 128), k.reshape(2, 300, 8, 128),
                                       v.reshape(2, 300, 8, 128), causal=True)
    assert lse.shape == (2, 2, 4, 150)
    assert (out.reshape(2, 150, 8, 128).float() - ref.float()).abs().max().item() <= ATOL[q.dtype]
    assert (lse.reshape(2, 8, 150) - ref_lse).abs().max().item() <= 1e-3


def _check_block_diagonal_causal_api(head_dim):
    """memory_efficient_attention_forward with a BlockDiagonalCausalMask of three packed
    sequences (5, 300 and 17 rows), and its banded form (make_local_attention), against the
    reference."""
    from mslk_dsl import attention
    from mslk_dsl.attention import attn_bias as ab

    causal = ab.BlockDiagonalCausalMask.from_seqlens([5, 300, 17])
    q, k, v = (_rand(1, 322, 4, head_dim) for _ in range(3))
    starts = torch.tensor([0, 5, 305, 322], device="cuda", dtype=torch.int32)
    for bias, window in ((causal, -1), (causal.make_local_attention(64), 63)):
        out = attention.memory_efficient_attention_forward(q, k, v, attn_bias=bias)
        ref, _ = attention_reference(q, k, v, seqstart_q=starts, seqstart_k=starts, causal=True,
                                     bottom_right=True, window_left=window)
        assert (out.float() - ref.float()).abs().max().item() <= ATOL[q.dtype], type(bias).__name__


def _all_configs():
    from mslk_dsl import registry
    from mslk_dsl.template import config_name

    (t,) = registry.get_templates(op="attention_fwd", backend="cute")
    return [pytest.param(c, id=config_name(c)) for c in t.all_configs()]


@SM90
@pytest.mark.parametrize("config", _all_configs())
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_every_config(config, dtype):
    """Each config of the template (the tuning candidates too), forced with config=, on a call it
    serves: GQA 4, lengths that are not multiples of the tiles."""
    torch.manual_seed(5)
    d, dv = config["head_dim"], config["head_dim_v"]
    mask = {"none": {}, "causal": {"causal": True, "bottom_right": True},
            "local": {"bottom_right": True, "window_left": 70, "window_right": 9}}
    kwargs = dict(mask[config["mask"]])
    if config["varlen"]:
        q, k, v, sq, sk, mq, mk = _packed(5, 8, 2, d, same_lengths=False, seed=7, head_dim_v=dv)
        kwargs.update(seqstart_q=sq, seqstart_k=sk, max_seqlen_q=mq, max_seqlen_k=mk)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    else:
        q, k, v = _rand(2, 333, 8, d, dtype=dtype), _rand(2, 470, 2, d, dtype=dtype), _rand(2, 470, 2, dv, dtype=dtype)
    out, lse = ops.attention_fwd(q, k, v, config=config, **kwargs)
    ref_out, ref_lse = attention_reference(q, k, v, **kwargs)
    assert (out.float() - ref_out.float()).abs().max().item() <= ATOL[dtype]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - ref_lse[finite]).abs().max().item() <= 1e-3


def _persistent_configs():
    from mslk_dsl import registry
    from mslk_dsl.template import config_name

    (t,) = registry.get_templates(op="attention_fwd", backend="cute")
    return [pytest.param(c, id=config_name(c)) for c in t.all_configs() if c["persistent"]]


@SM90
@pytest.mark.parametrize("config", _persistent_configs())
def test_persistent_grid_walks_many_tiles(config):
    """A persistent config on more tiles than the GPU has SMs (3 x 16 heads x 9+ m blocks): each
    CTA computes several tiles one after another, reusing its shared memory and barriers."""
    torch.manual_seed(6)
    d, dv = config["head_dim"], config["head_dim_v"]
    mask = {"none": {}, "causal": {"causal": True},
            "local": {"bottom_right": True, "window_left": 300, "window_right": 40}}
    q, k, v = _rand(3, 1100, 16, d), _rand(3, 1100, 4, d), _rand(3, 1100, 4, dv)
    tiles = 3 * 16 * -(-1100 // config["tile_m"])
    assert tiles > torch.cuda.get_device_properties(0).multi_processor_count
    out, lse = ops.attention_fwd(q, k, v, config=config, **mask[config["mask"]])
    ref_out, ref_lse = attention_reference(q, k, v, **mask[config["mask"]])
    assert (out.float() - ref_out.float()).abs().max().item() <= ATOL[q.dtype]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - ref_lse[finite]).abs().max().item() <= 1e-3
