"""Decode attention and merge_attentions (CuTe, sm_90 GPUs) against a torch fp32 reference.

- merge_attentions over 2-8 key chunks (fp32 and bf16 partials, an empty chunk whose partial is
  NaN) equals one-shot attention and its LSE;
- decode over awkward lengths (1, 17, 1000, 4097 in one batch; 0; 128k), GQA 1/4/8 and MQA, head
  dims 64/96/128/192/256, bf16 and fp16, causal with several queries and not; every config at
  head dims 96 and 192 (64-byte shared-memory rows at 96, a merge share of three vectors);
- split-KV equals unsplit; paged equals contiguous bit for bit (random block tables, page sizes
  16..256, same splits);
- a CUDA graph of decode replays to eager's bytes, with lengths changed on the device between
  replays.

Tolerances: out is compared with the fp32 reference rounded to the dtype within 2e-2 (P is
rounded to bf16 / fp16 before P V, as every flash kernel does), lse within 2e-3 (fp32 scores,
hardware exp2 / log2).
"""
import contextlib
import math

import pytest
import torch

from mslk_dsl import jit, ops, registry
from mslk_dsl.ops.attention_decode import decode_reference
from mslk_dsl.testing import skipUnlessCudaCapability

SM90 = skipUnlessCudaCapability((9, 0))
OUT_TOL = 2e-2
LSE_TOL = 2e-3


def _partial_reference(q, k, v, scale):
    """fp32 attention of q [B, M, H, D] over k, v [B, N, H, D]: (out [B, M, H, D], lse [B, H, M])."""
    s = torch.einsum("bmhd,bnhd->bhmn", q.float(), k.float()) * scale
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhmn,bnhd->bmhd", torch.softmax(s, dim=-1), v.float())
    return out, lse


@SM90
@pytest.mark.parametrize("chunks", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_equals_one_shot(chunks, dtype):
    torch.manual_seed(chunks)
    B, M, H, D, N = 3, 5, 4, 128, 1000
    q, k, v = (torch.randn(B, n, H, D, device="cuda") for n in (M, N, N))
    bounds = sorted(torch.randperm(N - 1)[: chunks - 1].add(1).tolist())
    edges = [0, *bounds, N]
    parts = [_partial_reference(q, k[:, a:b], v[:, a:b], 0.1) for a, b in zip(edges, edges[1:])]
    outs = torch.stack([p[0] for p in parts]).to(dtype)
    lses = torch.stack([p[1] for p in parts])
    out, lse = ops.merge_attentions(outs, lses)
    want_out, want_lse = _partial_reference(q, k, v, 0.1)
    assert out.dtype == dtype and out.shape == (B, M, H, D) and lse.shape == (B, H, M)
    tol = 1e-5 if dtype == torch.float32 else OUT_TOL
    torch.testing.assert_close(out.float(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)


@SM90
def test_merge_skips_empty_chunks():
    S, B, M, H, D = 4, 2, 3, 2, 64
    outs = torch.randn(S, B, M, H, D, device="cuda")
    lses = torch.randn(S, B, H, M, device="cuda")
    outs[1] = float("nan")
    lses[1] = float("-inf")
    lses[:, 1] = float("-inf")           # sequence 1: every chunk empty
    out, lse = ops.merge_attentions(outs, lses)
    keep = [0, 2, 3]
    w = torch.softmax(lses[keep, 0], dim=0)                       # [3, H, M]
    want = (outs[keep, 0] * w.permute(0, 2, 1)[..., None]).sum(0)
    torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[0], torch.logsumexp(lses[keep, 0], dim=0), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isneginf(lse[1]).all()


def _cache(B, L, Hkv, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype, generator=g)
    return k, v


def _check(got, want):
    out, lse = got
    want_out, want_lse = want
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), want_out.float(), atol=OUT_TOL, rtol=OUT_TOL)
    torch.testing.assert_close(lse, want_lse, atol=LSE_TOL, rtol=LSE_TOL)


@SM90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (32, 4), (16, 1)], ids=["mha", "gqa4", "gqa8", "mqa"])
@pytest.mark.parametrize("Mq,causal", [(1, True), (4, True), (16, False)])
def test_decode_matches_reference(dtype, D, heads, Mq, causal):
    if D != 128 and (heads != (32, 4) or Mq != 1):
        pytest.skip("other head dims run one GQA 8 case each")
    Hq, Hkv = heads
    lengths = [1, 17, 1000, 4097, 0] if not causal else [17, 1000, 4097, 300]
    B, Lmax = len(lengths), 4200
    torch.manual_seed(D + Mq)
    q = torch.randn(B, Mq, Hq, D, device="cuda", dtype=dtype)
    k, v = _cache(B, Lmax, Hkv, D, dtype, seed=D)
    seqlen = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    got = ops.attention_decode(q, k, v, seqlen, None, None, causal, 0)
    _check(got, decode_reference(q, k, v, seqlen, None, None, causal))


# Tens of GB each: one worker runs these one after another, so parallel workers (-n 4)
# never hold two at once.
@pytest.mark.xdist_group("gpu-memory")
@SM90
def test_decode_128k():
    Hq, Hkv, D, L = 32, 4, 128, 131072
    q = torch.randn(1, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = _cache(1, L, Hkv, D, torch.bfloat16, seed=3)
    seqlen = torch.tensor([L - 5], dtype=torch.int32, device="cuda")
    _check(ops.attention_decode(q, k, v, seqlen), decode_reference(q, k, v, seqlen))


@SM90
@pytest.mark.parametrize("splits", [2, 7, 64])
def test_split_kv_equals_unsplit(splits):
    B, Mq, Hq, Hkv, D, L = 3, 2, 32, 4, 128, 5000
    q = torch.randn(B, Mq, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = _cache(B, L, Hkv, D, torch.bfloat16, seed=splits)
    seqlen = torch.tensor([4999, 1000, 33], dtype=torch.int32, device="cuda")
    one = ops.attention_decode(q, k, v, seqlen, None, None, True, 1)
    many = ops.attention_decode(q, k, v, seqlen, None, None, True, splits)
    torch.testing.assert_close(many[0].float(), one[0].float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(many[1], one[1], atol=1e-4, rtol=1e-4)
    _check(many, decode_reference(q, k, v, seqlen))


def _paged(k, v, page, generator):
    """The contiguous cache k, v [B, L, H, D] cut into pages of ``page`` keys, stored in a random
    order (with spare pages), and the block table that finds them."""
    B, L, H, D = k.shape
    per_seq = -(-L // page)
    total = B * per_seq + 3
    order = torch.randperm(total, generator=generator, device="cpu")[: B * per_seq].to("cuda")
    kp = torch.randn(total, page, H, D, device="cuda", dtype=k.dtype)
    vp = torch.randn(total, page, H, D, device="cuda", dtype=k.dtype)
    pad = per_seq * page - L
    kpad = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).reshape(B * per_seq, page, H, D)
    vpad = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).reshape(B * per_seq, page, H, D)
    kp[order], vp[order] = kpad, vpad
    return kp, vp, order.reshape(B, per_seq).to(torch.int32)


@SM90
@pytest.mark.parametrize("page", [16, 32, 64, 128, 256])
def test_paged_equals_contiguous(page):
    B, Mq, Hq, Hkv, D, L = 4, 1, 32, 8, 128, 4100
    g = torch.Generator().manual_seed(page)
    q = torch.randn(B, Mq, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = _cache(B, L, Hkv, D, torch.bfloat16, seed=page)
    seqlen = torch.tensor([1, 17, 4097, 1000], dtype=torch.int32, device="cuda")
    kp, vp, table = _paged(k, v, page, g)
    contiguous = ops.attention_decode(q, k, v, seqlen, None, None, True, 5)
    paged = ops.attention_decode(q, kp, vp, seqlen, table, None, True, 5)
    assert torch.equal(paged[0], contiguous[0]) and torch.equal(paged[1], contiguous[1])
    _check(paged, decode_reference(q, kp, vp, seqlen, table))


def _decode_configs(D):
    template = registry.get_template("attention_decode_cute")
    return template.valid_configs("sm90a", {"dtype": "bfloat16", "head_dim": D})


@SM90
@pytest.mark.parametrize("D", [96, 192])
@pytest.mark.parametrize("page", [0, 16, 64])
def test_every_config_at_head_dims_96_and_192(D, page):
    """Each config (warps, stages, fused or kernel merge) at the head dims added after 64 / 128
    / 256: 96 keeps 64-byte shared-memory rows, and its fused merge takes three vectors a thread
    of 4 warps (one and a half of 8), a share that is not a power of two. Full and partial row
    tiles (GQA 8 with 2 queries, MQA with 1), odd and empty lengths, a contiguous and a paged
    cache, a forced split count and the heuristic's."""
    B, L = 4, 3000
    g = torch.Generator().manual_seed(D + page)
    seqlen = torch.tensor([2999, 17, 0, 1000], dtype=torch.int32, device="cuda")
    for Mq, Hq, Hkv in ((2, 32, 4), (1, 8, 8)):
        q = torch.randn(B, Mq, Hq, D, device="cuda", dtype=torch.bfloat16)
        k, v = _cache(B, L, Hkv, D, torch.bfloat16, seed=D + Mq)
        table = None
        if page:
            k, v, table = _paged(k, v, page, g)
        want = decode_reference(q, k, v, seqlen, table)
        for config in _decode_configs(D):
            for splits in (0, 7):
                _check(ops.attention_decode(q, k, v, seqlen, table, None, True, splits, config=config), want)


@SM90
def test_cuda_graph_replays_eager_bytes():
    B, Mq, Hq, Hkv, D, L, page = 8, 1, 32, 4, 128, 8192, 64
    q = torch.randn(B, Mq, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = _cache(B, L, Hkv, D, torch.bfloat16, seed=11)
    kp, vp, table = _paged(k, v, page, torch.Generator().manual_seed(1))
    seqlen = torch.randint(1, L, (B,), dtype=torch.int32, device="cuda")
    for cache in ((k, v, None), (kp, vp, table)):
        ops.attention_decode(q, *cache[:2], seqlen, cache[2])  # compile / load outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with jit.jit_disabled(), torch.cuda.graph(graph):
            out, lse = ops.attention_decode(q, *cache[:2], seqlen, cache[2])
        for lengths in (torch.randint(1, L, (B,)), torch.tensor([L, 1, 2, 3, 4097, 17, 1000, 64])):
            seqlen.copy_(lengths.to(torch.int32))
            graph.replay()
            eager = ops.attention_decode(q, *cache[:2], seqlen, cache[2])
            torch.cuda.synchronize()
            assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])


@SM90
@pytest.mark.parametrize("kv", ["shared", "per_call"])
@pytest.mark.parametrize("path", ["native", "python"])
def test_cuda_graph_of_several_calls_replays_every_call(path, kv):
    """Several decode calls in one graph, after warm-up calls on a side stream (as a serving
    engine, and bench attention_decode's graph columns, capture): the first captured call makes
    the plans of the capture stream, the next ones are served by them; every call's output must
    be recomputed on each replay. The calls share one KV cache or each have their own."""
    from mslk_dsl import native

    B, Hq, Hkv, D, L, calls = 2, 32, 4, 128, 8192, 4
    if kv == "shared":
        caches = [_cache(B, L, Hkv, D, torch.bfloat16, seed=3)] * calls
    else:
        caches = [_cache(B, L, Hkv, D, torch.bfloat16, seed=3 + i) for i in range(calls)]
    qs = [torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16) for _ in range(calls)]
    seqlen = torch.full((B,), L, dtype=torch.int32, device="cuda")
    with native.bypassed() if path == "python" else contextlib.nullcontext():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for q, (k, v) in zip(qs, caches):
                ops.attention_decode(q, k, v, seqlen)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with jit.jit_disabled(), torch.cuda.graph(graph):
            outs = [ops.attention_decode(q, k, v, seqlen) for q, (k, v) in zip(qs, caches)]
        # One decode kernel per captured call runs in a replay (what the profiler sees of it).
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        launched = [e.name for e in prof.events() if str(e.device_type).endswith("CUDA")]
        assert sum("decode_kernel" in name for name in launched) == calls, launched
        for lengths in ([L, 1], [4097, L - 3]):
            seqlen.copy_(torch.tensor(lengths, dtype=torch.int32))
            for q in qs:
                q.normal_()
            graph.replay()
            torch.cuda.synchronize()
            for q, (k, v), (out, lse) in zip(qs, caches, outs):
                _check((out, lse), decode_reference(q, k, v, seqlen))


@SM90
def test_scale_and_strided_q():
    B, Mq, Hq, Hkv, D, L = 2, 3, 16, 2, 64, 700
    q = torch.randn(B, Hq, Mq, D, device="cuda", dtype=torch.float16).transpose(1, 2)  # head-major q
    k, v = _cache(B, L, Hkv, D, torch.float16, seed=5)
    seqlen = torch.tensor([700, 3], dtype=torch.int32, device="cuda")
    scale = 0.3 / math.sqrt(D)
    _check(ops.attention_decode(q, k, v, seqlen, None, scale, True, 0),
           decode_reference(q, k, v, seqlen, None, scale, True))


FUSED = {"warps": 4, "stages": 3, "merge": "fused", "merge_loads": 32}
SEPARATE = {"warps": 4, "stages": 3, "merge": "kernel", "merge_loads": 32}
# The fused merge's 8-warp configs (one CTA per SM; the heuristic's at D 128 for few rows).
FUSED_VARIANTS = [dict(FUSED, warps=8), dict(FUSED, warps=8, stages=2)]


@SM90
@pytest.mark.parametrize("B,Mq,lengths,splits", [
    (1, 1, [1], 0), (1, 1, [17], 7), (1, 1, [32769], 0), (1, 1, [32769], 300),
    (3, 2, [33, 4999, 1], 64), (8, 1, [32769, 1, 17, 0, 5000, 32768, 100, 2048], 0),
])
def test_fused_merge_equals_separate_merge(B, Mq, lengths, splits):
    """The decode kernel's fused merge (the last CTA of each row adds the splits' partials) gives
    the merge kernel's results, for one split or hundreds, odd and empty lengths; it leaves the
    split counters zero."""
    from mslk_dsl.ops.dispatch import zeroed_counters

    _fused_against_separate(B, Mq, lengths, splits, FUSED, seed=B + max(lengths))
    torch.cuda.synchronize()
    assert not zeroed_counters(torch.device("cuda", torch.cuda.current_device()), B * 4).any()


def _fused_against_separate(B, Mq, lengths, splits, config, seed):
    """The fused merge of ``config`` against the merge kernel (SEPARATE) and the reference, on a
    GQA 8, D 128 cache holding ``lengths`` keys."""
    Hq, Hkv, D = 32, 4, 128
    L = max(lengths)
    torch.manual_seed(seed)
    q = torch.randn(B, Mq, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = _cache(B, L, Hkv, D, torch.bfloat16, seed=L)
    seqlen = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    fused = ops.attention_decode(q, k, v, seqlen, None, None, True, splits, config=config)
    separate = ops.attention_decode(q, k, v, seqlen, None, None, True, splits, config=SEPARATE)
    torch.testing.assert_close(fused[0].float(), separate[0].float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(fused[1], separate[1], atol=1e-5, rtol=1e-5)
    _check(fused, decode_reference(q, k, v, seqlen))


@SM90
@pytest.mark.parametrize("splits", [0, 1, 65, 512])
def test_decode_repeats_bit_for_bit(splits):
    """Repeat calls give the same bytes whichever split's CTA finishes last (fixed merge order);
    B = 1 with an odd length, up to hundreds of splits."""
    Hq, Hkv, D, L = 32, 4, 128, 32769
    q = torch.randn(1, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = _cache(1, L, Hkv, D, torch.bfloat16, seed=splits)
    seqlen = torch.tensor([L], dtype=torch.int32, device="cuda")
    first = ops.attention_decode(q, k, v, seqlen, None, None, True, splits)
    for _ in range(5):
        again = ops.attention_decode(q, k, v, seqlen, None, None, True, splits)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    _check(first, decode_reference(q, k, v, seqlen))


@SM90
def test_fused_merge_on_two_streams():
    """Calls on two streams at once each count their splits in their own stream's counters."""
    Hq, Hkv, D, L = 32, 4, 128, 20000
    q = torch.randn(2, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = _cache(2, L, Hkv, D, torch.bfloat16, seed=7)
    seqlen = torch.tensor([L, 12345], dtype=torch.int32, device="cuda")
    want = ops.attention_decode(q, k, v, seqlen, None, None, True, 40)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    results = [[], []]
    torch.cuda.synchronize()
    for _ in range(20):
        for s, got in zip(streams, results):
            with torch.cuda.stream(s):
                got.append(ops.attention_decode(q, k, v, seqlen, None, None, True, 40))
    torch.cuda.synchronize()
    for got in results:
        for out, lse in got:
            assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@SM90
@pytest.mark.parametrize("config", FUSED_VARIANTS, ids=["warps8", "warps8_stages2"])
@pytest.mark.parametrize("B,Mq,lengths,splits", [
    (1, 1, [32769], 0), (1, 1, [32769], 300), (3, 2, [33, 4999, 1], 64), (2, 16, [5000, 17], 0),
])
def test_fused_merge_configs_equal_separate_merge(config, B, Mq, lengths, splits):
    """Every fused-merge config gives the merge kernel's results: full and partial row tiles
    (8, 16 and 2 x 8 rows), one split to hundreds, short and empty splits."""
    _fused_against_separate(B, Mq, lengths, splits, config, seed=B + max(lengths) + Mq)
