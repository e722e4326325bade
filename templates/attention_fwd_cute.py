"""attention_fwd on Hopper: FlashAttention's FA3-recipe forward (TMA, wgmma, warp-specialised
producer and consumer warpgroups, intra-warpgroup overlap, ping-pong), see _cute_attention_sm90.

Runtime args: kernel(q, k, v, out, lse, seqstart_q, seqstart_k, scale, window_left, window_right,
                     max_ctas)
  dense:   q [B, Mq, Hq, K], k / v [B, Mk, Hkv, K], out [B, Mq, Hq, K], lse fp32 [B, Hq, Mq]
  varlen:  q [total_q, Hq, K], k / v [total_k, Hkv, K], out [total_q, Hq, K], lse fp32 [Hq, total_q],
           seqstart_q / seqstart_k int32 [n + 1] (placeholders when dense)
q, k, v and out: any strides with a unit last one and the others multiples of 8 elements
(16-byte aligned rows for TMA); lse contiguous. Every size, the batch, the sequence count and
the head counts are dynamic (Hq a multiple of Hkv): one kernel per (dtype, head dim, config).
scale: fp32 softmax scale; window_left / window_right: the local band (_attention_limits.MASKS),
read only by local configs; max_ctas: the device's SM count, read only by persistent configs.

A config fixes the tile (tile_m x tile_n), the K / V stages, the overlap / ping-pong switch, the
persistent schedule, the mask family and dense vs packed sequences; ``serves`` matches the last
two to the call.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _attention_limits as limits
from mslk_dsl.templates import _kernel_limits as kernel_limits


def _config(head_dim, tile_m, tile_n, mask, varlen, overlap=True, stages=2, persistent=False):
    return {"head_dim": head_dim, "tile_m": tile_m, "tile_n": tile_n, "stages": stages, "overlap": overlap,
            "persistent": persistent, "mask": mask, "varlen": varlen}


def _default_tile(head_dim: int, mask: str) -> tuple[int, int]:
    """FA4's Hopper tile choices (benchmarked there on an H100): three consumer warpgroups for
    head dim 64; 80-row K / V blocks for 256 (64 with a local band), so that two stages fit in
    shared memory beside a 128 x 256 Q tile."""
    if head_dim == 64:
        return 192, 128
    if head_dim == 128:
        return 128, 128
    return 128, 64 if mask == "local" else 80


# Every (head dim, mask, dense / packed) with its default tile, one tile per CTA (FA4's own
# schedule on Hopper); for dense calls the same tile on a persistent grid; and for dense causal
# calls at head dim 64 a 128-row tile, one tile per CTA or persistent (1024 rows are 8 blocks
# of 128 but 6 of 192, the last a third full). Measured on the H200 and dropped: the default
# tiles without intra-warpgroup overlap / ping-pong (6-13% slower on every prefill shape), and
# FA3's 128 x 176 tile at head dim 128 (never faster than 128 x 128). (Each config costs a
# compile in the CPU tests and the AOT build, ~10-40 s.)
CONFIGS = tuple(
    [_config(d, *_default_tile(d, mask), mask, varlen)
     for d in limits.HEAD_DIMS for mask in limits.MASKS for varlen in (False, True)]
    + [_config(d, *_default_tile(d, mask), mask, False, persistent=True)
       for d in limits.HEAD_DIMS for mask in limits.MASKS]
    + [_config(64, 128, 128, "causal", False, persistent=persistent) for persistent in (False, True)])

# Query rows per sequence up to which a causal dense call at head dim <= 128 runs persistent,
# with FA4's longest-first order: at most 8 query tiles per head, so the tiles
# are few and short (the causal ones shorter still), each CTA's prologue (Q load) and epilogue
# (O store) weigh most, and a persistent CTA overlaps them with the next tile's K / V loads.
# Measured on the H200 (B 16, 1024 rows, two runs): 5-8% faster causal at head dims 64 / 128,
# level or 6% slower at 256, level or slower unmasked; at 4096 rows and more one tile per CTA is
# 2-20% faster (causal or not), so longer sequences keep it. (Local bands: persistent configs
# exist and are tested, but no speed was measured, so the heuristic leaves them out.)
PERSISTENT_MAX_ROWS = 1024


def _valid(config, target, sig):
    return config["head_dim"] == sig["head_dim"]


def _wanted(problem) -> tuple[str, bool]:
    """(mask family, packed) of a call; sizes without them (a generic problem) mean dense, no mask."""
    return limits.MASKS[problem.get("mask", 0)], bool(problem.get("varlen", 0))


def _heuristic(target, sig, problem):
    """FA4's tile for the head dim; for short causal dense sequences at head dim <= 128
    (PERSISTENT_MAX_ROWS) the persistent grid, and at head dim 64 causal also the 128-row tile
    (5-8% faster there than 192 rows). A problem without sizes (a generic one) counts as long."""
    mask, varlen = _wanted(problem)
    d = sig["head_dim"]
    short = problem.get("Mq", limits.MAX_SEQLEN) <= PERSISTENT_MAX_ROWS
    persistent = short and d <= 128 and mask == "causal" and not varlen
    tile = (128, 128) if d == 64 and mask == "causal" and persistent else _default_tile(d, mask)
    return _config(d, *tile, mask, varlen, persistent=persistent)


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
    d = sig["head_dim"]
    kernel = sm90.HopperAttentionForward(dtype, d, config["tile_m"], config["tile_n"], config["stages"],
                                         config["overlap"], config["mask"], config["varlen"],
                                         config["persistent"])
    rows = 8  # elements per 16 bytes: TMA needs 16-byte aligned rows
    sq, sk, hq, hkv = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    if config["varlen"]:
        q, o = (make_fake_tensor(dtype, (sq, hq, d), divisibility=rows) for _ in range(2))
        k, v = (make_fake_tensor(dtype, (sk, hkv, d), divisibility=rows) for _ in range(2))
        lse = make_fake_tensor(cutlass.Float32, (hq, sq))
    else:
        b = cute.sym_int()
        q, o = (make_fake_tensor(dtype, (b, sq, hq, d), divisibility=rows) for _ in range(2))
        k, v = (make_fake_tensor(dtype, (b, sk, hkv, d), divisibility=rows) for _ in range(2))
        lse = make_fake_tensor(cutlass.Float32, (b, hq, sq))
    n = cute.sym_int()
    seqstarts = [cute.runtime.make_fake_tensor(cutlass.Int32, (n,), stride=(1,), assumed_align=4) for _ in range(2)]
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return kernel, [q, k, v, o, lse, *seqstarts, cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0),
                    cutlass.Int32(1), stream]


TEMPLATE = Template(op="attention_fwd", backend="cute", targets=("sm90a",),
                    signatures={"dtype": limits.DTYPES, "head_dim": limits.HEAD_DIMS},
                    configs=CONFIGS, valid=_valid, heuristic=_heuristic, serves=_serves, build=build,
                    block_threads=_block_threads,
                    # One large CTA per SM by design, as the GEMMs.
                    occupancy_floor=kernel_limits.GEMM_OCCUPANCY_FLOOR,
                    instructions={"ptx": [r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(bf16\.bf16|f16\.f16)",
                                         r"cp\.async\.bulk\.tensor\.\dd",
                                         r"setmaxnreg"],
                                  "sass": [r"HGMMA\.64x\d+x16\.F32",
                                          r"UTMALDG\.\dD"]})
