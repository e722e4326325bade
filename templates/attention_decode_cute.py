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
(``_cute_merge_attentions``).
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _attention_decode_plan as plan

DTYPES = ("bfloat16", "float16")
SHARED_LIMIT = 227 * 1024
# Stages per head dim: three CTAs per SM at D = 64 (4 stages, 66 KB), two at D = 128 (3 stages,
# 100 KB), one at D = 256 (3 stages, 204 KB: two blocks ahead per warp, 128 KB in flight per SM).
DEFAULT_STAGES = {64: 4, 128: 3, 256: 3}


def _shared_bytes(config, sig) -> int:
    d, w, s = int(sig["head_dim"]), config["warps"], config["stages"]
    return (plan.ROWS * d + 2 * w * s * plan.BLOCK_KEYS * d) * 2 + w * plan.ROWS * 4 + 2048


def _valid(config, target, sig):
    return _shared_bytes(config, sig) <= SHARED_LIMIT


def _heuristic(target, sig, problem):
    return {"warps": 4, "stages": DEFAULT_STAGES[int(sig["head_dim"])], "merge": "fused"}


def _build(config, target, sig):
    from mslk_dsl.templates._cute_attention_decode import AttentionDecode

    kernel = AttentionDecode(sig["dtype"], int(sig["head_dim"]), config["warps"], config["stages"],
                             fused_merge=config["merge"] == "fused")
    return kernel, kernel.fake_args()


TEMPLATE = Template(op="attention_decode", backend="cute", targets=("sm90a",),
                    signatures={"dtype": DTYPES, "head_dim": plan.HEAD_DIMS},
                    space={"warps": (4,), "stages": (2, 3, 4), "merge": ("fused", "kernel")}, valid=_valid, heuristic=_heuristic,
                    build=_build, block_threads=lambda config: 32 * config["warps"], occupancy_floor=0.06,
                    instructions={"ptx": [r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16\.bf16|f16\.f16)\.f32",
                                         r"cp\.async\.cg\.shared\.global",
                                         r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans"]})
