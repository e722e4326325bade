"""attention_fwd on ROCm (FlyDSL, MFMA): flash-attention forward with fp32 log-sum-exp.

Calling convention: kernel(q, k, v, out, lse, seq_q, seq_k, num_splits, scale, window_left,
window_right, bottom_right, max_seqlen_q)
  q [B, Mq, H, D], k / v [B, Mk, Hkv, D] (H % Hkv == 0: GQA / MQA served without expanding K/V),
  out [B, Mq, H, D] of q's dtype, lse [B, H, Mq] fp32 (natural log);
  seq_q / seq_k: int32 [nseq + 1] sequence starts for packed varlen sequences (B = 1), or empty
  int32 tensors for dense batches; num_splits: 1;
  scale: the softmax scale (fp32); keys a query row may see: key - diag in
  [-window_left, window_right] with diag = query (+ Mk - Mq when bottom_right != 0), clipped to
  the sequence. No mask: both windows WINDOW_NONE (1 << 30); causal (top-left or bottom-right):
  window_right 0; local windows: both bounded;
  max_seqlen_q: the longest query sequence (Mq when dense), which sizes the grid.
The last dim of every tensor is contiguous, other strides are multiples of 8 elements, and each
batch's (sequence's) slice of a tensor stays under 1 GiB; sizes are dynamic (one binary per
config, dtype and head dim). Kernel: templates/_flydsl_attention.py.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits

from mslk_dsl.templates import _flydsl_attention as attn

DTYPES = ("bfloat16", "float16")
TARGETS = ("gfx942", "gfx950")

# (waves, block_n): 64 query rows per block (16 per wave), KV tiles of 32-128 keys. Eight waves
# (128 rows) spilled with bf16 (its fp32 -> bf16 rounding is VALU code on gfx942) and are left out.
CONFIGS = [dict(waves=4, block_n=n) for n in (32, 64, 128)]


def _valid(config, target, sig):
    return target in TARGETS and attn.check_config(config, target, sig["head_dim"]) is None


def _heuristic(target, sig, problem):
    """The widest KV tile that fits in LDS and registers (fewer barriers and softmax rescales
    per key): 128 keys at head dim 64 (and 128 on gfx950), 64 at 128, 32 at 256."""
    fits = [c for c in CONFIGS if _valid(c, target, sig)]
    return dict(max(fits, key=lambda c: c["block_n"]))


def build(config, target, sig):
    import torch
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    kernel, rows, threads = attn.make_attention_kernel(dtype=sig["dtype"], head_dim=sig["head_dim"],
                                                       waves=config["waves"], block_n=config["block_n"])

    @flyc.jit
    def attention_fwd(q: fx.Tensor, k: fx.Tensor, v: fx.Tensor, out: fx.Tensor, lse: fx.Tensor,
                      seq_q: fx.Tensor, seq_k: fx.Tensor, num_splits: fx.Int32, scale: fx.Float32,
                      window_left: fx.Int32, window_right: fx.Int32, bottom_right: fx.Int32,
                      max_seqlen_q: fx.Int32, stream: fx.Stream = fx.Stream(None)):
        kernel(q, k, v, out, lse, seq_q, seq_k, num_splits, scale, window_left, window_right,
               bottom_right).launch(grid=attn.grid_for(q, k, seq_q, max_seqlen_q, num_splits, rows),
                                    block=(threads, 1, 1), stream=stream)

    t = getattr(torch, sig["dtype"])
    d = sig["head_dim"]
    q = torch.empty(2, 48, 8, d, dtype=t)
    kv = torch.empty(2, 80, 2, d, dtype=t)
    starts = torch.empty(0, dtype=torch.int32)
    return attention_fwd, (q, kv, kv.clone(), torch.empty_like(q), torch.empty(2, 8, 48, dtype=torch.float32),
                           starts, starts.clone(), 1, 0.125, attn.WINDOW_NONE, 0, 0, 48)


TEMPLATE = Template(op="attention_fwd", backend="flydsl", targets=TARGETS,
                    signatures={"dtype": DTYPES, "head_dim": attn.HEAD_DIMS},
                    configs=CONFIGS, valid=_valid, heuristic=_heuristic, build=build,
                    block_threads=attn.threads_of, occupancy_floor=limits.GEMM_OCCUPANCY_FLOOR)
