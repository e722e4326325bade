"""attention_decode on ROCm (FlyDSL, MFMA): split-KV attention over a contiguous or paged cache.

Calling convention (the op's, see mslk_dsl/ops/attention_decode.py):
  kernel(q, k, v, kv_seqlen, block_table, out, lse, out_partials, lse_partials, counters, scale, causal,
         paged)
  q [B, Mq, Hq, D] (Mq <= 16); k / v [N, Lk, Hkv, D]: the contiguous cache (N = B, Lk = max_kv,
  paged = 0) or the pages (N pages of Lk = page_size keys, a multiple of 16; paged = 1,
  block_table [B, max_pages] int32, unread when paged = 0); kv_seqlen [B] int32 on the device;
  out [B, Mq, Hq, D] of q's dtype, lse [B, Hq, Mq] fp32; out_partials [S, B, Mq, Hq, D] and
  lse_partials [S, B, Hq, Mq] fp32 scratch, S (their leading size) the split count; counters int32
  (the CuTe template's fused merge counts splits in them; unread here); scale fp32;
  causal 0 / 1 (bottom-right: query i sees keys j <= kv_seqlen[b] - Mq + i).
Nothing is sized from the lengths on the host, so a graph of the call replays any lengths.

Two kernels on the stream: the attention kernel of _flydsl_attention.py in decode mode (grid:
row tiles x Hkv x (B * S); each block takes one split of its sequence's KV tiles and writes an
fp32 partial with its LSE; the Hq / Hkv heads of a KV head are the rows of one block, so K / V
are read once per KV head and split), then the log-sum-exp merge of the S partials
(templates/merge_attentions_flydsl.py's kernel).
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits

from mslk_dsl.templates import _attention_decode_plan as plan
from mslk_dsl.templates import _flydsl_attention as attn

DTYPES = ("bfloat16", "float16")
TARGETS = ("gfx942", "gfx950")
MERGE_WAVES = 4

# (waves, block_n): four waves share the loads of each KV tile (256 threads, 8-16 KiB of K / V
# in flight per block); the decode rows (Mq x the GQA group) fill the first waves' columns.
CONFIGS = tuple(dict(waves=4, block_n=n) for n in (32, 64))


def _fits(config, target, sig):
    return target in TARGETS and attn.check_config(config, target, sig["head_dim"]) is None


def _heuristic(target, sig, problem):
    """Four waves (256 threads move each KV tile) and the widest tile that fits."""
    return dict(max((c for c in CONFIGS if _fits(c, target, sig)), key=lambda c: c["block_n"]))


def _valid(config, target, sig):
    # one kernel per (target, dtype, head dim): the heuristic's
    return config == _heuristic(target, sig, {})


def build(config, target, sig):
    import torch
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    dtype, d = sig["dtype"], sig["head_dim"]
    kernel, rows, threads = attn.make_attention_kernel(target=target, dtype=dtype, head_dim=d, waves=config["waves"],
                                                       block_n=config["block_n"], mask="causal", decode=True)
    merge, merge_rows = attn.make_merge_kernel(dtype="float32", out_dtype=dtype, waves=MERGE_WAVES)

    @flyc.jit
    def attention_decode(q: fx.Tensor, k: fx.Tensor, v: fx.Tensor, kv_seqlen: fx.Tensor, block_table: fx.Tensor,
                         out: fx.Tensor, lse: fx.Tensor, out_partials: fx.Tensor, lse_partials: fx.Tensor,
                         counters: fx.Tensor, scale: fx.Float32, causal: fx.Int32, paged: fx.Int32,
                         stream: fx.Stream = fx.Stream(None)):
        batch, mq, heads, _ = q.shape.unpack()
        _, _, kv_heads, _ = k.shape.unpack()
        splits = out_partials.shape.unpack()[0]
        # causal: the band's right side at the diagonal; else unbounded (the left one never is)
        window_right = (1 - causal) * attn.WINDOW_NONE
        kernel(q, k, v, out_partials, lse_partials, q, kv_seqlen, block_table, scale, fx.Int32(attn.WINDOW_NONE),
               window_right, paged).launch(
                   grid=((mq * (heads // kv_heads) + (rows - 1)) // rows, kv_heads, batch * splits),
                   block=(threads, 1, 1), stream=stream)
        merge(out_partials, lse_partials, out, lse).launch(
            grid=((batch * mq * heads + (merge_rows - 1)) // merge_rows, 1, 1),
            block=(attn.WAVE * merge_rows, 1, 1), stream=stream)

    t = getattr(torch, dtype)
    q = torch.empty(2, 1, 8, d, dtype=t)
    cache = torch.empty(6, 64, 2, d, dtype=t)
    splits = 2
    return attention_decode, (q, cache, cache.clone(), torch.empty(2, dtype=torch.int32),
                              torch.empty(2, 3, dtype=torch.int32), torch.empty_like(q), torch.empty(2, 8, 1),
                              torch.empty(splits, 2, 1, 8, d), torch.empty(splits, 2, 8, 1),
                              torch.zeros(1024, dtype=torch.int32), 0.125, 1, 1)


TEMPLATE = Template(op="attention_decode", backend="flydsl", targets=TARGETS,
                    signatures={"dtype": DTYPES, "head_dim": plan.HEAD_DIMS},
                    configs=CONFIGS, valid=_valid, heuristic=_heuristic, build=build,
                    block_threads=attn.threads_of, occupancy_floor=limits.GEMM_OCCUPANCY_FLOOR,
                    instructions={"isa": [r"v_mfma_f32_16x16x16_?(bf16|f16)\b",
                                         r"buffer_load_dwordx4",
                                         r"v_exp_f32"]})
