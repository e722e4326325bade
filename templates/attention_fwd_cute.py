"""attention_fwd on Hopper: FlashAttention's FA3-recipe forward (TMA, wgmma, warp-specialised
producer and consumer warpgroups, intra-warpgroup overlap, ping-pong), see _cute_attention_sm90.

Runtime args: kernel(q, k, v, out, lse, seqstart_q, seqstart_k, scale, window_left, window_right,
                     max_ctas)
  dense:   q [B, Mq, Hq, K], k [B, Mk, Hkv, K], v [B, Mk, Hkv, Kv], out [B, Mq, Hq, Kv],
           lse fp32 [B, Hq, Mq]
  varlen:  q [total_q, Hq, K], k [total_k, Hkv, K], v [total_k, Hkv, Kv], out [total_q, Hq, Kv],
           lse fp32 [Hq, total_q],
           seqstart_q / seqstart_k int32 [n + 1] (placeholders when dense)
q, k, v and out: any strides with a unit last one and the others multiples of 8 elements
(16-byte aligned rows for TMA); lse contiguous. Every size, the batch, the sequence count and
the head counts are dynamic (Hq a multiple of Hkv): one kernel per (dtype, head dims, config).
Head dims (K, Kv): (d, d) for d in 64, 96, 128, 192, 256, and DeepSeek's MLA prefill (192, 128)
(_attention_limits.HEAD_DIM_PAIRS).
scale: fp32 softmax scale; window_left / window_right: the local band (_attention_limits.MASKS),
read only by local configs; max_ctas: the device's SM count, read only by persistent configs.

A config fixes the tile (tile_m x tile_n), the K / V stages, the overlap / ping-pong switch, the
persistent schedule, the mask family and dense vs packed sequences; ``serves`` matches the last
two to the call.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _attention_limits as limits
from mslk_dsl.templates import _kernel_limits as kernel_limits


def _config(dims, tile_m, tile_n, mask, varlen, overlap=True, stages=2, persistent=False):
    head_dim, head_dim_v = dims
    return {"head_dim": head_dim, "head_dim_v": head_dim_v, "tile_m": tile_m, "tile_n": tile_n, "stages": stages,
            "overlap": overlap, "persistent": persistent, "mask": mask, "varlen": varlen}


def _default_tile(dims: tuple[int, int], mask: str) -> tuple[int, int]:
    """FA4's Hopper tile choices (``_tile_size_fwd_sm90``, benchmarked there on an H100): three
    consumer warpgroups for head dims 64 and 96 (96: 144-key blocks unmasked); at 192, 128-key
    blocks with a v of 128 (112 with 192, 96 with a local band) and at 256 80-key blocks (64
    with a local band), so that two K / V stages fit in shared memory beside the Q tile."""
    head_dim, head_dim_v = dims
    if head_dim == 64:
        return 192, 128
    if head_dim == 96:
        return 192, 128 if mask != "none" else 144
    if head_dim == 128:
        return 128, 128
    if head_dim == 192:
        return 128, 96 if mask == "local" else (128 if head_dim_v <= 128 else 112)
    return 128, 64 if mask == "local" else 80


# Every (head dims, mask, dense / packed) with its default tile, one tile per CTA (FA4's own
# schedule on Hopper); for dense calls the same tile on a persistent grid (_PERSISTENT_MASKS: every
# mask family at head dims 64, 128 and 256; at 96 causal only, the one the heuristic takes; none
# at 192, which the heuristic never runs persistent); and for dense causal calls at head dim 64 a
# 128-row tile, one tile per CTA or persistent (1024 rows are 8 blocks of 128 but 6 of 192, the
# last a third full). Measured on the H200 and dropped: the default tiles without
# intra-warpgroup overlap / ping-pong (6-13% slower on every prefill shape), and FA3's 128 x 176
# tile at head dim 128 (never faster than 128 x 128). (Each config costs a compile in the CPU
# tests and the AOT build, 4-40 s.)
_PERSISTENT_MASKS = {(64, 64): limits.MASKS, (128, 128): limits.MASKS, (256, 256): limits.MASKS, (96, 96): ("causal",)}
CONFIGS = tuple(
    [_config(dims, *_default_tile(dims, mask), mask, varlen)
     for dims in limits.HEAD_DIM_PAIRS for mask in limits.MASKS for varlen in (False, True)]
    + [_config(dims, *_default_tile(dims, mask), mask, False, persistent=True)
       for dims, masks in _PERSISTENT_MASKS.items() for mask in masks]
    + [_config((64, 64), 128, 128, "causal", False, persistent=persistent) for persistent in (False, True)])

# Query rows per sequence up to which a causal dense call at head dim <= 128 runs persistent,
# with FA4's longest-first order: at most 8 query tiles per head, so the tiles
# are few and short (the causal ones shorter still), each CTA's prologue (Q load) and epilogue
# (O store) weigh most, and a persistent CTA overlaps them with the next tile's K / V loads.
# Measured on the H200 (B 16, 1024 rows, two runs): 5-8% faster causal at head dims 64 / 128,
# level or 6% slower at 256, level or slower unmasked; at 4096 rows and more one tile per CTA is
# 2-20% faster (causal or not), so longer sequences keep it. (Local bands: persistent configs
# exist and are tested, but no speed was measured, so the heuristic leaves them out.)
PERSISTENT_MAX_ROWS = 1024


def _signature_valid(sig):
    return limits.head_dims_served(sig["head_dim"], sig["head_dim_v"])


def _valid(config, target, sig):
    return (config["head_dim"], config["head_dim_v"]) == (sig["head_dim"], sig["head_dim_v"])


def _wanted(problem) -> tuple[str, bool]:
    """(mask family, packed) of a call; sizes without them (a generic problem) mean dense, no mask."""
    return limits.MASKS[problem.get("mask", 0)], bool(problem.get("varlen", 0))


def _heuristic(target, sig, problem):
    """FA4's tile for the head dim; for short causal dense sequences at head dim <= 128
    (PERSISTENT_MAX_ROWS) the persistent grid, and at head dim 64 causal also the 128-row tile
    (5-8% faster there than 192 rows). A problem without sizes (a generic one) counts as long."""
    mask, varlen = _wanted(problem)
    dims = (sig["head_dim"], sig["head_dim_v"])
    d = dims[0]
    short = problem.get("Mq", limits.MAX_SEQLEN) <= PERSISTENT_MAX_ROWS
    persistent = short and d <= 128 and mask == "causal" and not varlen
    tile = (128, 128) if d == 64 and mask == "causal" and persistent else _default_tile(dims, mask)
    return _config(dims, *tile, mask, varlen, persistent=persistent)


def _serves(config, problem):
    return (config["mask"], config["varlen"]) == _wanted(problem)


def _block_threads(config):
    """tile_m // 64 consumer warpgroups and one producer warpgroup."""
    return (config["tile_m"] // 64 + 1) * 128


def build(config, target, sig):
    import cutlass
    import cutlass.cute as cute

    from mslk_dsl.templates import _cute_attention_sm90 as sm90
    from quack.compile_utils import make_fake_tensor

    dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[sig["dtype"]]
    d, dv = sig["head_dim"], sig["head_dim_v"]
    kernel = sm90.HopperAttentionForward(dtype, d, dv, config["tile_m"], config["tile_n"], config["stages"],
                                         config["overlap"], config["mask"], config["varlen"],
                                         config["persistent"])
    rows = 8  # elements per 16 bytes: TMA needs 16-byte aligned rows
    sq, sk, hq, hkv = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    if config["varlen"]:
        q, o = (make_fake_tensor(dtype, (sq, hq, n), divisibility=rows) for n in (d, dv))
        k, v = (make_fake_tensor(dtype, (sk, hkv, n), divisibility=rows) for n in (d, dv))
        lse = make_fake_tensor(cutlass.Float32, (hq, sq))
    else:
        b = cute.sym_int()
        q, o = (make_fake_tensor(dtype, (b, sq, hq, n), divisibility=rows) for n in (d, dv))
        k, v = (make_fake_tensor(dtype, (b, sk, hkv, n), divisibility=rows) for n in (d, dv))
        lse = make_fake_tensor(cutlass.Float32, (b, hq, sq))
    n = cute.sym_int()
    seqstarts = [cute.runtime.make_fake_tensor(cutlass.Int32, (n,), stride=(1,), assumed_align=4) for _ in range(2)]
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return kernel, [q, k, v, o, lse, *seqstarts, cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0),
                    cutlass.Int32(1), stream]


TEMPLATE = Template(op="attention_fwd", backend="cute", targets=("sm90a",),
                    signatures={"dtype": limits.DTYPES, "head_dim": limits.HEAD_DIMS,
                                "head_dim_v": limits.HEAD_DIMS_V},
                    signature_valid=_signature_valid, configs=CONFIGS, valid=_valid, heuristic=_heuristic, serves=_serves, build=build,
                    block_threads=_block_threads,
                    # One large CTA per SM by design, as the GEMMs.
                    occupancy_floor=kernel_limits.GEMM_OCCUPANCY_FLOOR,
                    instructions={"ptx": [r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(bf16\.bf16|f16\.f16)",
                                         r"cp\.async\.bulk\.tensor\.\dd",
                                         r"setmaxnreg"],
                                  "sass": [r"HGMMA\.64x\d+x16\.F32",
                                          r"UTMALDG\.\dD"]})
