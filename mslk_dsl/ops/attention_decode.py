"""Attention decode (few queries per sequence against a long KV cache) and the exact merge of
partial attentions, in MSLK's layout: q [B, M, H, K], out [B, M, H, K], lse fp32 [B, H, M].

merge_attentions(out_partials [S, B, M, H, K], lse_partials [S, B, H, M]) -> (out, lse):
    lse = log(sum_s exp(lse_s)); out = sum_s exp(lse_s - lse) * out_s; a chunk with lse -inf
    (no keys) contributes nothing whatever its out holds; a row whose chunks are all empty gets
    out 0 and lse -inf. out has the partials' dtype.

attention_decode(q, k, v, kv_seqlen, block_table=None, scale=None, causal=True, num_splits=0)
    -> (out [B, Mq, Hq, D] q.dtype, lse [B, Hq, Mq] fp32)
    q [B, Mq, Hq, D], Mq <= 16; sequence b has kv_seqlen[b] keys (int32 on the device, never
    read by the host: the call captures in CUDA graphs).
    Contiguous cache (block_table None): k, v [B, max_kv, Hkv, D], keys 0..kv_seqlen[b]-1 of row b.
    Paged cache: k, v [num_pages, page_size, Hkv, D] (page_size a multiple of 16), block_table
    [B, max_pages] int32: key j of sequence b is in page block_table[b, j // page_size], slot
    j % page_size.
    Hq a multiple of Hkv (GQA; Hkv = 1 is MQA): q head h reads KV head h // (Hq // Hkv).
    causal: the queries are the sequence's last Mq positions (bottom-right aligned, MSLK's
    BlockDiagonalCausalWithOffsetPaddedKeysMask): query i sees keys j <= kv_seqlen[b] - Mq + i.
    num_splits: KV splits per sequence (0: chosen from the sizes and the SM count; the partials
    are merged in fixed split order, by the decode kernel's last CTA of each row on CUDA, by
    merge_attentions' kernel on ROCm: deterministic either way). scale: default 1 / sqrt(D).
    A query that sees no key (kv_seqlen 0) gets out 0 and lse -inf. kv_seqlen[b] must not exceed
    the keys the cache holds for b (max_kv, or the pages its block table row names): the lengths
    stay on the device, so this is not checked.
"""
from __future__ import annotations

import math

import torch

from mslk_dsl.errors import InputError
from mslk_dsl.ops import random_problems as draw
from mslk_dsl.ops import validate as check
from mslk_dsl.ops.declaration import Fixed, Launch, OpDecl, declare
from mslk_dsl.ops.dispatch import call_scratch, dtype_name, placeholder, sm_count, zeroed_counters
from mslk_dsl.templates import _attention_decode_plan as plan

_ALIGN = 16  # cp.async moves 16-byte pieces of K/V rows


# -- merge_attentions ------------------------------------------------------------------------------
def _check_merge(out_partials, lse_partials):
    op = "merge_attentions"
    check.tensor(op, "out_partials", out_partials, check.FLOAT_DTYPES, ndim=5)
    check.tensor(op, "lse_partials", lse_partials, (torch.float32,), ndim=4, unit_last_stride=False)
    check.same_device(op, "out_partials", out_partials, lse_partials=lse_partials)
    S, B, M, H, _ = out_partials.shape
    check.shape(op, "lse_partials", lse_partials, (S, B, H, M), "one LSE per chunk, sequence, head and query")
    if S == 0:
        raise InputError(f"{op}: there must be at least one partial attention (out_partials has S=0)")
    if (out_partials.shape[-1] * out_partials.element_size()) % _ALIGN:
        raise InputError(f"{op}: rows of out_partials must be a multiple of 16 bytes (K = {out_partials.shape[-1]} "
                         f"{out_partials.dtype} elements); pad K")
    if out_partials.numel() >= 2**31:
        raise InputError(f"{op}: out_partials has {out_partials.numel()} elements; at most 2**31 - 1")


def _merge_outputs(out_partials, lse_partials):
    S, B, M, H, K = out_partials.shape
    return [((B, M, H, K), out_partials.dtype), ((B, H, M), torch.float32)]


def _prepare_merge(select, outputs, out_partials, lse_partials):
    out, lse = outputs
    if out.numel() == 0 and lse.numel() == 0:
        return None
    # The kernel moves 16-byte pieces: partials that start off a 16-byte boundary are copied.
    parts = out_partials.contiguous()
    if parts.data_ptr() % _ALIGN:
        parts = parts.clone()
    lses = lse_partials.contiguous()
    target, finish = out, None
    if out.data_ptr() % _ALIGN:  # a caller's out= view off a 16-byte boundary: write a temporary
        target = torch.empty_like(out)
        finish = lambda: out.copy_(target)  # noqa: E731
    S, B, M, H, K = parts.shape
    kernel, _ = select((dtype_name(parts.dtype),), (S, B * M * H, K))
    return Launch(kernel, (parts, lses, target, lse), finish=finish)


def _merge_reference(out_partials, lse_partials):
    lse = torch.logsumexp(lse_partials.float(), dim=0)                   # [B, H, M]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(lse_partials.float() - safe)                            # [S, B, H, M]
    w = torch.where(torch.isneginf(lse_partials), torch.zeros_like(w), w)
    parts = torch.where(w.permute(0, 1, 3, 2)[..., None] > 0, out_partials.float(), 0.0)
    out = (parts * w.permute(0, 1, 3, 2)[..., None]).sum(0)
    return out.to(out_partials.dtype), lse


def _random_merge(rng) -> dict:
    """S of 1-8 partials of R rows (to 4096) of K (8-512, 16-byte rows) values."""
    return {"S": rng.randint(1, 8), "R": draw.log_int(rng, 1, 4096), "K": draw.log_int(rng, 8, 512, 8)}


def _merge_example(problem: dict, sig: dict, device) -> tuple:
    S, R, K = problem["S"], problem["R"], problem["K"]
    dtype = getattr(torch, sig.get("dtype", "float32"))
    parts = torch.randn(S, 1, R, 1, K, device=device).to(dtype)
    lses = torch.randn(S, 1, 1, R, device=device) * 3
    return parts, lses


merge_attentions = declare(OpDecl(
    name="merge_attentions", schema="(Tensor out_partials, Tensor lse_partials) -> (Tensor, Tensor)",
    doc="""Exact log-sum-exp merge of S partial attentions over disjoint key sets: out_partials
    [S, B, M, H, K] (fp32, bf16 or fp16; rows a multiple of 16 bytes), lse_partials [S, B, H, M] fp32
    -> (out [B, M, H, K] of the partials' dtype, lse [B, H, M] fp32). Chunks with LSE -inf are empty.""",
    check=_check_merge, outputs=_merge_outputs, prepare=_prepare_merge,
    signature=("dtype",), problem=("S", "R", "K"),
    example=_merge_example, reference=_merge_reference, tolerance=(1e-3, 1e-3),
    small_problem={"S": 3, "R": 5, "K": 64}, random_problem=_random_merge))


# -- attention_decode --------------------------------------------------------------------------------
def _strides_aligned(t: torch.Tensor) -> bool:
    per = _ALIGN // t.element_size()
    return t.data_ptr() % _ALIGN == 0 and all(s % per == 0 for s in t.stride()[:-1])


def _check_decode(q, k, v, kv_seqlen, block_table, scale, causal, num_splits):
    op = "attention_decode"
    check.tensor(op, "q", q, check.HALF_DTYPES, ndim=4)
    check.tensor(op, "k", k, check.HALF_DTYPES, ndim=4)
    check.tensor(op, "v", v, check.HALF_DTYPES, ndim=4)
    check.same_dtype(op, "k", k, q.dtype, "q")
    check.same_dtype(op, "v", v, q.dtype, "q")
    check.tensor(op, "kv_seqlen", kv_seqlen, (torch.int32,), ndim=1)
    check.same_device(op, "q", q, k=k, v=v, kv_seqlen=kv_seqlen)
    B, Mq, Hq, D = q.shape
    if k.shape != v.shape:
        raise InputError(f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
    if D not in plan.HEAD_DIMS or k.shape[3] != D:
        raise InputError(f"{op}: head dim of q ({D}) and k ({k.shape[3]}) must match and be one of {plan.HEAD_DIMS}")
    if not 1 <= Mq <= plan.MAX_QUERIES and B > 0:
        raise InputError(f"{op}: q has {Mq} queries per sequence; decode takes 1..{plan.MAX_QUERIES} "
                         f"(use memory_efficient_attention_forward for prefill)")
    Hkv = k.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise InputError(f"{op}: q's {Hq} heads must be a multiple of k's {Hkv} heads (GQA)")
    check.shape(op, "kv_seqlen", kv_seqlen, (B,), "one KV length per sequence")
    for name, t in (("k", k), ("v", v)):
        if not _strides_aligned(t):
            raise InputError(f"{op}: {name} must start 16-byte aligned with strides that are multiples "
                             f"of {_ALIGN // t.element_size()} elements (got strides {t.stride()})")
    if block_table is None:
        if k.shape[0] != B:
            raise InputError(f"{op}: a contiguous cache has one row per sequence: k has {k.shape[0]}, q has {B}")
    else:
        check.tensor(op, "block_table", block_table, (torch.int32,), ndim=2, unit_last_stride=False)
        check.same_device(op, "q", q, block_table=block_table)
        if block_table.shape[0] != B:
            raise InputError(f"{op}: block_table has {block_table.shape[0]} rows, q has {B} sequences")
        page = k.shape[1]
        if page % plan.BLOCK_KEYS or page == 0:
            raise InputError(f"{op}: page size {page} (k.shape[1]) must be a positive multiple of {plan.BLOCK_KEYS}")
    # The kernel masks scores with -inf before scaling: a scale <= 0 would turn them into +inf / NaN.
    if scale is not None and not (isinstance(scale, (float, int)) and math.isfinite(scale) and scale > 0):
        raise InputError(f"{op}: scale must be a positive finite float or None, got {scale!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise InputError(f"{op}: num_splits must be an int >= 0 (0: chosen for you), got {num_splits!r}")


def _decode_outputs(q, k, v, kv_seqlen, block_table=None, scale=None, causal=True, num_splits=0):
    B, Mq, Hq, D = q.shape
    return [((B, Mq, Hq, D), q.dtype), ((B, Hq, Mq), torch.float32)]


def max_keys(k: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """The most keys a sequence can hold: the cache row, or the pages its block table names."""
    return k.shape[1] if block_table is None else block_table.shape[1] * k.shape[1]


def splits_for(q, k, block_table, num_splits: int = 0, fused_merge: bool = False, warps: int = 4,
               merge_loads: int = 0) -> int:
    """The split count a call uses: ``num_splits`` if given, else the heuristic's for a kernel
    of ``warps`` warps that merges the splits itself (``fused_merge``: the CuTe config
    merge="fused", with ``merge_loads`` partial loads in flight per thread; 0: not said) or
    leaves them to the merge kernel."""
    B, Mq, Hq, D = q.shape
    Hkv = k.shape[2]
    if num_splits:
        return num_splits
    group = plan.merge_group(Mq, Hq // Hkv, D, warps, merge_loads) if fused_merge and merge_loads else 0
    return plan.num_splits(B, Hkv, Mq, Hq // Hkv, max_keys(k, block_table), sm_count(q.device), D, warps,
                           fused_merge=fused_merge, merge_group=group)


def _prepare_decode(select, outputs, q, k, v, kv_seqlen, block_table, scale, causal, num_splits):
    out, lse = outputs
    B, Mq, Hq, D = q.shape
    if out.numel() == 0:
        return None
    Hkv = k.shape[2]
    kernel, chosen = select((dtype_name(q.dtype), D), (B, Mq, Hq, Hkv, max_keys(k, block_table)))
    fused_merge = chosen.get("merge") == "fused"
    S = splits_for(q, k, block_table, num_splits, fused_merge, chosen.get("warps", 4), chosen.get("merge_loads", 0))
    if S * out.numel() >= plan.MAX_PARTIAL_ELEMENTS:
        raise InputError(f"attention_decode: {S} splits of an output of {out.numel()} elements exceed the "
                         f"2**31 elements of the split-KV partials; pass a smaller num_splits")
    # The split partials, written and read within the call: with the fused merge (a launch bound
    # to the stream anyway) the stream's reusable scratch, so a repeat call allocates nothing.
    partials = call_scratch(q.device, torch.float32, ((S, B, Mq, Hq, D), (S, B, Hq, Mq)), reuse=fused_merge)
    o_part, lse_part = partials.tensors
    paged = block_table is not None
    # The kernel reads the block table only when paged; a contiguous cache gets a stand-in.
    table = block_table if paged else placeholder(q.device, torch.int32, shape=(1, 1))
    # One counter per (sequence, KV head, row tile): the CuTe kernel's fused merge counts a row's
    # splits in it and leaves it zero. They belong to the calling stream (dispatch.zeroed_counters),
    # so a launch that reads them is stream-bound; the other kernels take them unread.
    counters = zeroed_counters(q.device, B * Hkv * plan.row_tiles(Mq, Hq // Hkv))
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    # The scalars follow from the layout (D, paged) and the plan_values (scale, causal): see Fixed.
    return Launch(kernel, (q, k, v, kv_seqlen, table, out, lse, o_part, lse_part, counters, Fixed(scale),
                           Fixed(int(bool(causal))), Fixed(int(paged))),
                  scratch=partials.per_call, stream_bound=fused_merge)


def decode_reference(q, k, v, kv_seqlen, block_table=None, scale=None, causal=True, num_splits=0):
    """fp32 attention with the decode op's semantics, sequence by sequence (host loop: tests)."""
    B, Mq, Hq, D = q.shape
    Hkv = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, Mq, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq, Mq), float("-inf"), dtype=torch.float32, device=q.device)
    lengths = kv_seqlen.tolist()
    for b in range(B):
        L = lengths[b]
        if L == 0:
            continue
        if block_table is None:
            kb, vb = k[b, :L], v[b, :L]
        else:
            page = k.shape[1]
            pages = block_table[b, :-(-L // page)].long()
            kb = k[pages].reshape(-1, Hkv, D)[:L]
            vb = v[pages].reshape(-1, Hkv, D)[:L]
        kb = kb.float().repeat_interleave(Hq // Hkv, dim=1)       # [L, Hq, D]
        vb = vb.float().repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("mhd,lhd->hml", q[b].float(), kb) * scale  # [Hq, Mq, L]
        if causal:
            qpos = torch.arange(Mq, device=q.device)[:, None] + (L - Mq)
            s = s.masked_fill(torch.arange(L, device=q.device)[None, :] > qpos, float("-inf"))
        lse[b] = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out[b] = torch.einsum("hml,lhd->mhd", p, vb)
    return out.to(q.dtype), lse


def _random_decode(rng) -> dict:
    """B to 64 sequences of L keys (Mq to L, to 32768; half the time each its own length of Mq..L),
    Mq of 1..MAX_QUERIES queries, Hkv of 1-8 key heads and 1-8 query heads per key head, a
    contiguous or (5 in 7) paged cache of 16-256-key pages; at most 2**19 key rows over all
    heads."""
    def one(r):
        hkv, mq = r.choice((1, 2, 4, 8)), r.randint(1, plan.MAX_QUERIES)
        return {"B": draw.log_int(r, 1, 64), "Mq": mq, "Hkv": hkv, "Hq": hkv * r.choice((1, 2, 4, 8)),
                "L": draw.log_int(r, mq, 32768), "ragged": r.randrange(2),
                "page": r.choice((0, 0, 16, 32, 64, 128, 256))}
    return draw.within(rng, one, lambda p: p["B"] * p["L"] * p["Hkv"], 1 << 19)


def _decode_example(problem: dict, sig: dict, device) -> tuple:
    """q for B sequences of Mq queries against L keys each, N(0, 1) values, causal. Where the
    problem says: "ragged" sequences hold Mq..L keys each (drawn), and "page" (a page size) keeps
    the keys in a paged cache of shuffled pages and a block table."""
    B, Mq, Hq, Hkv, L = problem["B"], problem["Mq"], problem["Hq"], problem["Hkv"], problem["L"]
    D = int(sig.get("head_dim", 128))
    dtype = getattr(torch, sig.get("dtype", "bfloat16"))
    page = problem.get("page", 0)
    q = torch.randn(B, Mq, Hq, D, device=device, dtype=dtype)
    if problem.get("ragged"):
        lengths = torch.randint(min(Mq, L), L + 1, (B,), device=device, dtype=torch.int32)
    else:
        lengths = torch.full((B,), L, dtype=torch.int32, device=device)
    if not page:
        k = torch.randn(B, L, Hkv, D, device=device, dtype=dtype)
        v = torch.randn(B, L, Hkv, D, device=device, dtype=dtype)
        return q, k, v, lengths, None, None, True, 0
    per_sequence = -(-L // page)
    k = torch.randn(B * per_sequence, page, Hkv, D, device=device, dtype=dtype)
    v = torch.randn(B * per_sequence, page, Hkv, D, device=device, dtype=dtype)
    table = torch.randperm(B * per_sequence, device=device).to(torch.int32).view(B, per_sequence)
    return q, k, v, lengths, table, None, True, 0


attention_decode = declare(OpDecl(
    name="attention_decode",
    schema="(Tensor q, Tensor k, Tensor v, Tensor kv_seqlen, Tensor? block_table=None, float? scale=None, "
           "bool causal=True, int num_splits=0) -> (Tensor, Tensor)",
    doc="""Decode attention against a contiguous or paged KV cache with split-KV; see the module
    docstring for the layouts. Returns (out [B, Mq, Hq, D], lse [B, Hq, Mq] fp32).""",
    check=_check_decode, outputs=_decode_outputs, prepare=_prepare_decode,
    signature=("dtype", "head_dim"), problem=("B", "Mq", "Hq", "Hkv", "L"),
    example=_decode_example, reference=decode_reference, tolerance=(2e-2, 2e-2),
    # The split count (num_splits, or the heuristic's from the layout and the device) sizes the
    # scratch partials; scale and causal are kernel scalars.
    plan_values=("scale", "causal", "num_splits"),
    small_problem={"B": 2, "Mq": 1, "Hq": 8, "Hkv": 2, "L": 100}, random_problem=_random_decode, long_sums=True))
