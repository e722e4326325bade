"""Split-KV decode attention (few queries per sequence, long KV cache), CuTe DSL (Hopper).

    kernel(q, k, v, kv_seqlen, block_table, out, lse, out_partials, lse_partials, counters, scale, causal,
           paged)
    q [B, Mq, Hq, D] dtype (any strides, unit last); k, v [N, Lk, Hkv, D] dtype, strides multiples of
    8 elements, 16-byte aligned: the contiguous cache (N = B, Lk = max_kv; paged = 0) or the pages
    (N = num_pages, Lk = page_size, a multiple of 16; paged = 1, block_table [B, max_pages] int32,
    any strides; unread when paged = 0); kv_seqlen [B] int32 on the device; out [B, Mq, Hq, D]
    dtype, lse [B, Hq, Mq] fp32; out_partials [S, B, Mq, Hq, D] fp32 and lse_partials [S, B, Hq, Mq]
    fp32 scratch, S the split count (its leading size); counters int32, at least B x Hkv x row tiles,
    zero (the fused merge counts each row's splits in them and leaves them zero again; read by
    no other config); scale fp32; causal 0/1 (bottom-right: query
    i sees keys j <= kv_seqlen[b] - Mq + i). Every size but D is dynamic; the grid is sized from
    the tensors' shapes, never from the lengths, so a CUDA graph replays any lengths.

The decode kernel (grid S x (Hkv * row tiles) x B; see ``_attention_decode_plan`` for the work
split and ``_cute_attention_decode`` for the pipeline) writes one fp32 partial per split. Config
``merge``: "fused" (the default) merges them in the same kernel: each CTA counts itself in its
row's counter (an atomic add after a release fence) and the row's last CTA adds the S partials in
split order (deterministic whichever CTA comes last) into out / lse and resets the counter: one
kernel, no spin-waits. "kernel": a second kernel on the stream merges them
(``_cute_merge_attentions``). Config ``merge_loads`` (fused only): the partial loads each thread of
the merging CTA keeps in flight. ``warps`` 8 (fused only): twice the K/V blocks in flight per CTA,
for the few-row calls that run one CTA per SM.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _attention_decode_plan as plan

DTYPES = ("bfloat16", "float16")
SHARED_LIMIT = 227 * 1024
# Stages per head dim: three CTAs per SM at D = 64 (4 stages, 66 KB), two at D = 96 (4 stages,
# 101 KB) and D = 128 (3 stages, 100 KB), one at D = 192 (4 stages, 200 KB) and D = 256 (3
# stages, 204 KB): 96-144 KB of K / V in flight per SM at each (two or three blocks ahead per warp).
DEFAULT_STAGES = {64: 4, 96: 4, 128: 3, 192: 4, 256: 3}
# The fused merge's 16-byte partial loads in flight per thread (the last CTA of a row reads S
# partials in about S * vectors per thread / merge_loads dependent rounds).
MERGE_LOADS = 32
# By head dim: 16 at D = 64 (32 take 214 registers a thread, and three CTAs of 128 threads per
# SM need at most 168) and D = 192 / 256 (their 96 / 128 accumulators a thread already; 32 spill
# at 256).
DEFAULT_MERGE_LOADS = {64: 16, 96: MERGE_LOADS, 128: MERGE_LOADS, 192: 16, 256: 16}


def _shared_bytes(config, sig) -> int:
    d, w, s = int(sig["head_dim"]), config["warps"], config["stages"]
    return (plan.ROWS * d + 2 * w * s * plan.BLOCK_KEYS * d) * 2 + w * plan.ROWS * 4 + 2048


def _valid(config, target, sig):
    # merge_loads and 8 warps are the fused merge's (8 warps: one CTA per SM, the few-row case)
    if config["merge"] == "kernel" and (config["merge_loads"] != MERGE_LOADS or config["warps"] != 4):
        return False
    # One merge_loads per head dim (registers): 16 and 32 timed the same at D 128 once every load
    # of a group is in flight (H200, B = 1), so the AOT build carries only the default.
    if config["merge"] == "fused" and config["merge_loads"] != DEFAULT_MERGE_LOADS[int(sig["head_dim"])]:
        return False
    return _shared_bytes(config, sig) <= SHARED_LIMIT


def _heuristic(target, sig, problem):
    """Four warps, the head dim's stages and merge loads; at D = 128, 8 warps and 2 stages (as
    many K/V bytes in flight per CTA, over twice the warps, and twice the threads for the merge)
    where the fused merge's split count leaves at most one CTA on each SM (B 1 - 4 at 32k keys,
    B 1 at 128k, GQA 8 with 4 KV heads): measured on the H200 (graph replay, B 1 / 2 / 4 at 32k
    keys) 25.1 / 40.1 / 70.3 us against 26.9 / 40.6 / 70.8 with 4 warps and 3 stages; where more
    CTAs than SMs run (B 2 at 128k: 144.1 against 136.2 us), 4 warps, two CTAs per SM."""
    d = int(sig["head_dim"])
    config = {"warps": 4, "stages": DEFAULT_STAGES[d], "merge": "fused", "merge_loads": DEFAULT_MERGE_LOADS[d]}
    sizes = [problem.get(k) for k in ("B", "Mq", "Hq", "Hkv", "L")]
    if d == 128 and all(isinstance(x, int) and x > 0 for x in sizes):
        B, Mq, Hq, Hkv, L = sizes
        if Hq % Hkv == 0 and plan.one_cta_per_sm(B, Hkv, Mq, Hq // Hkv, L, plan.NOMINAL_SMS, d, 8, MERGE_LOADS):
            config.update(warps=8, stages=2)
    return config


def _build(config, target, sig):
    from mslk_dsl.templates._cute_attention_decode import AttentionDecode

    kernel = AttentionDecode(sig["dtype"], int(sig["head_dim"]), config["warps"], config["stages"],
                             fused_merge=config["merge"] == "fused", merge_loads=config["merge_loads"])
    return kernel, kernel.fake_args()


TEMPLATE = Template(op="attention_decode", backend="cute", targets=("sm90a",),
                    signatures={"dtype": DTYPES, "head_dim": plan.HEAD_DIMS},
                    space={"warps": (4, 8), "stages": (2, 3, 4), "merge": ("fused", "kernel"),
                           "merge_loads": (16, MERGE_LOADS)}, valid=_valid, heuristic=_heuristic,
                    build=_build, block_threads=lambda config: 32 * config["warps"], occupancy_floor=0.06,
                    instructions={"ptx": [r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16\.bf16|f16\.f16)\.f32",
                                         r"cp\.async\.cg\.shared\.global",
                                         r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans"]})
