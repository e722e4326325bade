"""attention_decode and merge_attentions without a GPU: bad input is refused before anything
launches, the split heuristic, the fakes, and the bias classes' contract."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mslk_dsl import ops
from mslk_dsl.attention import decode as api
from mslk_dsl.templates import _attention_decode_plan as plan

bf16 = torch.bfloat16


def _decode_args(B=2, Mq=1, Hq=8, Hkv=2, D=128, L=64, dtype=bf16):
    q = torch.randn(B, Mq, Hq, D, dtype=dtype)
    k = torch.randn(B, L, Hkv, D, dtype=dtype)
    v = torch.randn(B, L, Hkv, D, dtype=dtype)
    return q, k, v, torch.full((B,), L, dtype=torch.int32)


@pytest.mark.parametrize("change,match", [
    (lambda a: (a[0].float(), *a[1:]), "dtype"),
    (lambda a: (a[0], a[1].half(), *a[2:]), "dtype"),
    (lambda a: (a[0][..., :80], a[1][..., :80], a[2][..., :80], a[3]), "head dim"),
    (lambda a: (a[0][..., :96], a[1], a[2], a[3]), "head dim"),
    (lambda a: (torch.randn(2, 17, 8, 128, dtype=bf16), *a[1:]), "queries"),
    (lambda a: (torch.randn(2, 1, 7, 128, dtype=bf16), a[1], a[2], a[3]), "multiple"),
    (lambda a: (*a[:3], a[3].long()), "dtype"),
    (lambda a: (*a[:3], a[3][:1]), "kv_seqlen"),
    (lambda a: (a[0], a[1], a[2][:, :32], a[3]), "one shape"),
    (lambda a: (a[0], a[1][:1], a[2][:1], a[3]), "one row per sequence"),
])
def test_decode_refuses_bad_input(change, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ops.attention_decode(*change(_decode_args()))


def test_decode_refuses_bad_pages():
    q, _, _, lengths = _decode_args()
    k = torch.randn(10, 24, 2, 128, dtype=bf16)   # 24-key pages: not a multiple of 16
    table = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="page size"):
        ops.attention_decode(q, k, k, lengths, table)
    k = torch.randn(10, 32, 2, 128, dtype=bf16)
    with pytest.raises(ValueError, match="block_table has"):
        ops.attention_decode(q, k, k, lengths, table[:1])
    with pytest.raises(TypeError, match="dtype"):
        ops.attention_decode(q, k, k, lengths, table.long())


def test_decode_refuses_misaligned_cache():
    q, k, v, lengths = _decode_args()
    k = torch.randn(2, 64, 2, 129, dtype=bf16)[..., 1:]   # rows start 2 bytes off
    with pytest.raises(ValueError, match="16-byte"):
        ops.attention_decode(q, k, k, lengths)


def test_decode_refuses_bad_scalars():
    args = _decode_args()
    with pytest.raises(ValueError, match="num_splits"):
        ops.attention_decode(*args, None, None, True, -1)
    with pytest.raises(ValueError, match="scale"):
        ops.attention_decode(*args, None, float("nan"))


def test_merge_refuses_bad_input():
    outs = torch.randn(3, 2, 4, 8, 64)
    lses = torch.randn(3, 2, 8, 4)
    with pytest.raises(ValueError, match="lse_partials"):
        ops.merge_attentions(outs, lses[:, :, :, :3])
    with pytest.raises(TypeError, match="dtype"):
        ops.merge_attentions(outs, lses.half())
    with pytest.raises(ValueError, match="at least one"):
        ops.merge_attentions(outs[:0], lses[:0])
    with pytest.raises(ValueError, match="5-D"):
        ops.merge_attentions(outs[0], lses)
    with pytest.raises(ValueError, match="16 bytes"):
        ops.merge_attentions(torch.randn(3, 2, 4, 8, 66), lses)


def test_split_heuristic_fills_the_gpu_and_keeps_splits_long():
    sms = 132
    # One sequence, 4 KV heads, 32k keys: many splits, each at least 16 blocks of 16 keys.
    s = plan.num_splits(1, 4, 1, 8, 32768, sms)
    assert 16 <= s and 32768 / s >= 4 * plan.MIN_BLOCKS_PER_WARP * plan.BLOCK_KEYS
    # Enough CTAs already (128 sequences x 4 KV heads): no split.
    assert plan.num_splits(128, 4, 1, 8, 32768, sms) == 1
    # Short caches are not split below the minimum.
    assert plan.num_splits(1, 1, 1, 8, 100, sms) == 1
    # More query rows per KV head than one tile: more CTAs, fewer splits.
    assert plan.num_splits(1, 4, 16, 8, 131072, sms) < plan.num_splits(1, 4, 1, 8, 131072, sms)


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("keys", [4096, 32768, 131072])
def test_fused_merge_splits_stop_at_one_cta_per_sm(batch, keys):
    """With the merge fused into the decode kernel, few rows get either the wave model's choice or
    one CTA per SM (the H200's measured best at B = 1: 33 splits x 4 KV heads), never more splits
    than without it; many rows keep the wave model's choice."""
    sms = 132
    unfused = plan.num_splits(batch, 4, 1, 8, keys, sms)
    fused = plan.num_splits(batch, 4, 1, 8, keys, sms, fused_merge=True)
    assert fused in (unfused, sms // (batch * 4)) and fused <= unfused
    assert plan.num_splits(1, 4, 1, 8, 32768, sms, fused_merge=True) == 33
    assert plan.num_splits(1, 4, 1, 8, 131072, sms, fused_merge=True) == 33
    assert plan.num_splits(64, 4, 1, 8, keys, sms, fused_merge=True) == plan.num_splits(64, 4, 1, 8, keys, sms)


def test_fused_merge_splits_round_to_the_merge_rounds():
    """The one-CTA-per-SM count is rounded down to whole rounds of the merge's loads when that
    gives up at most 1/16 of the splits (B = 1, 4 KV heads on 132 SMs: 32 rather than 33)."""
    sms = 132
    # GQA 8, one query: 8 rows of D / 4 16-byte vectors; 8 warps take one each, 4 warps two.
    assert plan.merge_group(1, 8, 128, 8, 32) == 32
    assert plan.merge_group(1, 8, 128, 4, 32) == 16
    assert plan.merge_group(16, 8, 128, 4, 32) == 8       # a full 16-row tile: four vectors a thread
    assert plan.merge_group(1, 1, 64, 4, 16) == 16
    # D 96: a full tile is 384 vectors, three a thread of 4 warps (not a power of two) and one
    # and a half of 8 warps (two): the merge never takes more than that share
    assert plan.merge_group(16, 8, 96, 4, 32) == 32 // 3
    assert plan.merge_group(16, 8, 96, 8, 32) == 16
    assert plan.merge_group(1, 8, 96, 8, 32) == 32
    for group in (16, 32):
        assert plan.num_splits(1, 4, 1, 8, 32768, sms, 128, 8, fused_merge=True, merge_group=group) == 32
    assert plan.num_splits(1, 4, 1, 8, 32768, sms, 128, 8, fused_merge=True, merge_group=64) == 33
    assert plan.num_splits(1, 4, 1, 8, 32768, sms, 128, 8, fused_merge=True) == 33
    # 8 rows: 16 splits already fit one round; 2 KV heads: 66 splits rounded to 64
    assert plan.num_splits(2, 4, 1, 8, 32768, sms, 128, 8, fused_merge=True, merge_group=32) == 16
    assert plan.num_splits(1, 2, 1, 8, 131072, sms, 128, 8, fused_merge=True, merge_group=32) == 64


@pytest.mark.parametrize("batch,keys,warps", [(1, 32768, 8), (1, 131072, 8), (2, 32768, 8), (4, 32768, 8),
                                              (2, 131072, 4), (4, 131072, 4), (8, 32768, 4), (32, 131072, 4)])
def test_decode_config_takes_8_warps_at_one_cta_per_sm(batch, keys, warps):
    """D 128: 8 warps and 2 stages where the fused merge's splits leave at most one CTA per SM
    (132 SMs); 4 warps and 3 stages otherwise, and for a problem of no decode sizes."""
    from mslk_dsl.templates.attention_decode_cute import TEMPLATE

    sig = {"dtype": "bfloat16", "head_dim": 128}
    config = TEMPLATE.heuristic("sm90a", sig, {"B": batch, "Mq": 1, "Hq": 32, "Hkv": 4, "L": keys})
    assert (config["warps"], config["stages"]) == ((8, 2) if warps == 8 else (4, 3))
    assert config in TEMPLATE.valid_configs("sm90a", sig)
    assert TEMPLATE.heuristic("sm90a", sig, {"M": 4096})["warps"] == 4
    for d in (64, 256):
        assert TEMPLATE.heuristic("sm90a", dict(sig, head_dim=d), {"B": 1, "Mq": 1, "Hq": 32, "Hkv": 4,
                                                                   "L": 32768})["warps"] == 4


def test_fakes():
    with FakeTensorMode():
        q = torch.empty(3, 2, 32, 128, dtype=bf16, device="cuda")
        k = torch.empty(100, 64, 4, 128, dtype=bf16, device="cuda")
        lengths = torch.empty(3, dtype=torch.int32, device="cuda")
        table = torch.empty(3, 7, dtype=torch.int32, device="cuda")
        out, lse = torch.ops.mslk_dsl.attention_decode(q, k, k, lengths, table)
        assert out.shape == (3, 2, 32, 128) and out.dtype == bf16
        assert lse.shape == (3, 32, 2) and lse.dtype == torch.float32
        o, l2 = torch.ops.mslk_dsl.merge_attentions(torch.empty(4, 3, 2, 32, 128, device="cuda"),
                                                    torch.empty(4, 3, 32, 2, device="cuda"))
        assert o.shape == (3, 2, 32, 128) and l2.shape == (3, 32, 2)


def test_bias_classes():
    bias = api.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
        q_seqlen=[1, 1, 1], kv_padding=256, kv_seqlen=[5, 256, 0])
    assert bias.kv_seqlen.dtype == torch.int32 and bias.kv_seqlen.tolist() == [5, 256, 0]
    assert bias.q_len == 1 and bias.kv_padding == 256
    with pytest.raises(ValueError, match="same number of queries"):
        api.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 2], 256, [3, 4])
    table = torch.zeros(3, 4, dtype=torch.int32)
    paged = api.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
        q_seqlen=[2, 2, 2], kv_seqlen=[5, 9, 64], block_tables=table, page_size=16)
    assert paged.page_size == 16 and paged.block_tables is table
    with pytest.raises(ValueError, match="page_size"):
        api.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1], [3], table[:1], page_size=24)


def test_the_attention_api_sends_kv_cache_biases_to_decode(monkeypatch):
    """memory_efficient_attention_forward / _partial under a KV-cache bias run attention_decode
    (MSLK's packed q [1, B * Mq, H, D] comes back in that form), never the prefill op."""
    import mslk_dsl.attention as attention
    from mslk_dsl import ops

    calls = []

    def decode(q, k, v, lengths, table, scale, causal, splits):
        calls.append((q.shape, k.shape, table is not None))
        return q.new_zeros(q.shape), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def prefill(*args, **kwargs):
        raise AssertionError("a KV-cache bias reached the prefill op")

    monkeypatch.setattr(ops, "attention_decode", decode)
    monkeypatch.setattr(ops, "attention_fwd", prefill)
    q = torch.zeros(1, 3, 8, 64, dtype=torch.bfloat16)            # 3 sequences, one query each
    cache = torch.zeros(1, 3 * 32, 2, 64, dtype=torch.bfloat16)   # padded to 32 keys each
    bias = attention.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1, 1], 32, [5, 32, 1])
    out = attention.memory_efficient_attention_forward(q, cache, cache, attn_bias=bias)
    assert out.shape == q.shape and calls[-1] == ((3, 1, 8, 64), (3, 32, 2, 64), False)
    assert isinstance(bias, attention.AttentionBias)
    pages = torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16)
    paged = attention.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
        [1, 1, 1], [5, 32, 1], torch.zeros(3, 2, dtype=torch.int32), page_size=16)
    _, lse = attention.memory_efficient_attention_partial(q, pages, pages, attn_bias=paged)
    assert calls[-1][2] and lse.shape == (3, 8, 1)


def test_merge_attentions_takes_lists_and_grouped_heads(monkeypatch):
    """A list of chunks is stacked; the [.., G, H, ..] form folds G into the heads and back (the
    op itself is the plain-torch reference here: the kernel runs on GPUs)."""
    from mslk_dsl.ops.attention_decode import _merge_reference

    monkeypatch.setattr(api.ops, "merge_attentions", _merge_reference)
    outs = [torch.randn(2, 5, 3, 4, 64) for _ in range(3)]   # [B, M, G, H, K]
    lses = [torch.randn(2, 3, 4, 5) for _ in range(3)]       # [B, G, H, M]
    out, lse = api.merge_attentions(outs, lses)
    assert out.shape == (2, 5, 3, 4, 64) and lse.shape == (2, 3, 4, 5)
    want = torch.logsumexp(torch.stack(lses), dim=0)
    torch.testing.assert_close(lse, want)
    w = torch.softmax(torch.stack(lses), dim=0)               # [S, B, G, H, M]
    torch.testing.assert_close(out, (torch.stack(outs) * w.permute(0, 1, 4, 2, 3)[..., None]).sum(0))
    assert api.merge_attentions(outs, lses, write_lse=False)[1] is None


def test_decode_launch_follows_the_kernel_contract():
    """prepare() hands the kernel (q, k, v, kv_seqlen, table, out, lse, partials, partial LSEs,
    counters, scale, causal, paged), the partials sized by the split count, zero counters for
    every (sequence, KV head, row tile), and asks for the kernel by (dtype, head_dim) and the
    call's sizes."""
    from mslk_dsl.ops import declarations
    from mslk_dsl.ops.dispatch import is_placeholder, zeroed_counters

    decl = declarations()["attention_decode"]
    q, k, v, lengths = _decode_args(B=3, Mq=2, Hq=8, Hkv=2, D=64, L=4096)
    outputs = [torch.empty(shape, dtype=dtype) for shape, dtype in decl.outputs(q, k, v, lengths)]
    asked = []

    def select(sig, problem):
        asked.append((sig, problem))
        return "kernel", {}

    table = torch.zeros(3, 64, dtype=torch.int32)
    launch = decl.prepare(select, outputs, q, k, v, lengths, table, None, False, 6)
    assert asked == [(("bfloat16", 64), (3, 2, 8, 2, 64 * 4096))]
    (q2, k2, v2, len2, table2, out, lse, o_part, lse_part, counters, scale, causal, paged) = launch.args
    assert q2 is q and k2 is k and v2 is v and len2 is lengths and table2 is table
    assert out is outputs[0] and lse is outputs[1]
    assert o_part.shape == (6, 3, 2, 8, 64) and o_part.dtype == torch.float32
    assert lse_part.shape == (6, 3, 8, 2) and lse_part.dtype == torch.float32
    # 3 sequences x 2 KV heads x one 16-row tile (2 queries x 4 heads of a group)
    assert counters.dtype == torch.int32 and counters.numel() >= 3 * 2 and not counters.any()
    assert counters is zeroed_counters(q.device, 6)
    # scalars a launch plan may hold: they follow from the layout and the plan_values
    assert scale.value == pytest.approx(64 ** -0.5) and (causal.value, paged.value) == (0, 1)
    assert launch.scratch == (o_part, lse_part)
    # Only a kernel that counts in them (the CuTe template's fused merge) binds the launch to the stream.
    assert not launch.stream_bound
    fused = decl.prepare(lambda sig, problem: ("kernel", {"merge": "fused"}), outputs, q, k, v, lengths, table, None,
                         False, 6)
    assert fused.stream_bound and fused.args[9] is counters
    # The fused merge's partials are the stream's reusable scratch (no allocation per call, held
    # by its plans); the merge kernel's are allocated per call.
    assert fused.scratch == () and is_placeholder(fused.args[7]) and is_placeholder(fused.args[8])
    assert (fused.args[7].shape, fused.args[8].shape) == (o_part.shape, lse_part.shape)
    again = decl.prepare(lambda sig, problem: ("kernel", {"merge": "fused"}), outputs, q, k, v, lengths, table, None,
                         False, 6)
    assert again.args[7] is fused.args[7] and again.args[8] is fused.args[8]
    assert not is_placeholder(o_part)
