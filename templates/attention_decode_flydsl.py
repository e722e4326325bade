"""attention_decode on ROCm (FlyDSL, MFMA): split-KV attention over a paged (or dense) KV cache.

Calling convention: kernel(q, k_cache, v_cache, out, lse, kv_lens, block_table, out_parts,
lse_parts, num_splits, scale, window_left, window_right, bottom_right)
  q [B, Mq, H, D] (Mq small, e.g. <= 16), k_cache / v_cache [pages, page_size, Hkv, D],
  out [B, Mq, H, D] of q's dtype, lse [B, H, Mq] fp32;
  kv_lens int32 [B] and block_table int32 [B, max_pages] on the device, so a graph of the call
  replays with new lengths and pages (no host sync); a dense cache [B, Mk, Hkv, D] is the case
  page_size = Mk with block_table [[0], [1], ...];
  out_parts [num_splits, B, Mq, H, D] and lse_parts [num_splits, B, H, Mq] fp32 workspaces;
  num_splits >= 1 (see ``splits_for``); scale and the window / bottom_right mask arguments as
  in attention_fwd (decode with Mq > 1 is causal bottom-right: window_right 0, bottom_right 1).
Two kernels: each (sequence, KV head, split) block runs the attention kernel of
_flydsl_attention.py over its share of the sequence's KV tiles into fp32 partials, then the
merge kernel combines the splits by log-sum-exp (templates/merge_attentions_flydsl.py). The G q
heads of a KV head share its block (rows are (query, head) pairs), so each K/V byte is read once
per split. A page holds whole KV tiles: page_size % block_n == 0 (``serves``), or one page per
sequence.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits

from mslk_dsl.templates import _flydsl_attention as attn

DTYPES = ("bfloat16", "float16")
TARGETS = ("gfx942", "gfx950")
MERGE_WAVES = 4

# (waves, block_n): 16-key tiles serve 16-key pages; 4 waves load each tile with 256 threads.
CONFIGS = [dict(waves=w, block_n=n) for w, n in ((2, 16), (4, 16), (4, 32), (4, 64))]


def _valid(config, target, sig):
    return target in TARGETS and attn.check_config(config, target, sig["head_dim"]) is None


def _serves(config, problem):
    page = int(problem.get("page_size", 0))
    return page <= 0 or page % config["block_n"] == 0 or int(problem.get("pages_per_seq", 0)) == 1


def splits_for(batch: int, kv_heads: int, max_kv: int, cus: int, block_n: int) -> int:
    """KV splits for a decode call: enough (sequence, KV head, split) blocks to fill every CU
    twice, each split keeping at least 4 KV tiles so the merge stays small; at most 64."""
    blocks = max(batch * kv_heads, 1)
    tiles = max(-(-max_kv // block_n), 1)
    want = -(-2 * cus // blocks)
    return max(1, min(want, tiles // 4 or 1, 64))


def _heuristic(target, sig, problem):
    """The widest KV tile the pages allow (fewer barriers per key); 4 waves for the loads."""
    fits = [c for c in CONFIGS if _valid(c, target, sig) and _serves(c, problem)]
    return dict(max(fits, key=lambda c: (c["block_n"], c["waves"])))


def build(config, target, sig):
    import torch
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    dtype, d = sig["dtype"], sig["head_dim"]
    kernel, rows, threads = attn.make_attention_kernel(dtype=dtype, head_dim=d, waves=config["waves"],
                                                       block_n=config["block_n"], partial=True, paged=True)
    merge, merge_rows = attn.make_merge_kernel(partial_dtype="float32", dtype=dtype, waves=MERGE_WAVES)

    @flyc.jit
    def attention_decode(q: fx.Tensor, k_cache: fx.Tensor, v_cache: fx.Tensor, out: fx.Tensor, lse: fx.Tensor,
                         kv_lens: fx.Tensor, block_table: fx.Tensor, out_parts: fx.Tensor, lse_parts: fx.Tensor,
                         num_splits: fx.Int32, scale: fx.Float32, window_left: fx.Int32, window_right: fx.Int32,
                         bottom_right: fx.Int32, stream: fx.Stream = fx.Stream(None)):
        batch, mq, heads, _ = q.shape.unpack()
        _, _, kv_heads, _ = k_cache.shape.unpack()
        group = heads // kv_heads
        kernel(q, k_cache, v_cache, out_parts, lse_parts, kv_lens, block_table, num_splits, scale, window_left,
               window_right, bottom_right).launch(grid=((mq * group + (rows - 1)) // rows, kv_heads, batch * num_splits),
                                                  block=(threads, 1, 1), stream=stream)
        merge(out_parts, lse_parts, out, lse).launch(grid=((batch * mq * heads + (merge_rows - 1)) // merge_rows, 1, 1),
                                                     block=(attn.WAVE * merge_rows, 1, 1), stream=stream)

    t = getattr(torch, dtype)
    q = torch.empty(2, 1, 8, d, dtype=t)
    cache = torch.empty(6, 64, 2, d, dtype=t)
    splits = 2
    return attention_decode, (q, cache, cache.clone(), torch.empty_like(q), torch.empty(2, 8, 1),
                              torch.empty(2, dtype=torch.int32), torch.empty(2, 3, dtype=torch.int32),
                              torch.empty(splits, 2, 1, 8, d), torch.empty(splits, 2, 8, 1), splits, 0.125,
                              attn.WINDOW_NONE, 0, 1)


TEMPLATE = Template(op="attention_decode", backend="flydsl", targets=TARGETS,
                    signatures={"dtype": DTYPES, "head_dim": attn.HEAD_DIMS},
                    configs=CONFIGS, valid=_valid, heuristic=_heuristic, serves=_serves, build=build,
                    block_threads=attn.threads_of, occupancy_floor=limits.GEMM_OCCUPANCY_FLOOR)
