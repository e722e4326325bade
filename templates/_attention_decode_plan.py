"""The decode kernels' work split, stated once for the op layer and every decode template.

Plain Python (no DSL): the op layer sizes the split-KV scratch from it, and the CuTe and
FlyDSL templates size their grids from the same numbers.

A decode CTA (work-group) owns one KV head, ``ROWS`` query rows of that head's group (the GQA
group's heads times the queries of the sequence, so K/V are read once per KV head) and one
split of the sequence's keys. Its warps take ``BLOCK_KEYS``-key blocks of the split in turn,
each warp a flash-attention of its own over its blocks; the CTA merges its warps at the end,
and the splits are merged by LSE: on Hopper by the last CTA of each row, in the decode kernel
(CuTe template, config ``merge="fused"``), else by the LSE-combine kernel.
"""

import functools

from mslk_dsl.templates import _kernel_limits as limits

# Query rows per CTA: one 16-row MMA tile (mma.sync m16n8k16 on Hopper).
ROWS = 16
# Keys per block: a block never straddles a page (page sizes are multiples of it).
BLOCK_KEYS = 16
# Queries per sequence the decode op takes (MSLK's decode limit as well).
MAX_QUERIES = 16
HEAD_DIMS = (64, 96, 128, 192, 256)
# A split gets at least this many blocks per warp: fewer and its fixed costs (the Q load, the
# in-CTA merge, the partial's write and read) outweigh the keys it reads.
MIN_BLOCKS_PER_WARP = 4
# CTAs of the decode kernel an SM holds at once, by head dim (its shared memory: 66, 101, 100,
# 200 and 204 KB per CTA with the CuTe template's default stages, of 227 KB).
CTAS_PER_SM = {64: 3, 96: 2, 128: 2, 192: 1, 256: 1}
# A CTA's fixed cost, in blocks' worth of time (measured nowhere yet: a modest guess).
SPLIT_COST_BLOCKS = 4
# The fused merge's cost per split in the row's last CTA, in blocks' worth of time (H200, B = 1:
# 0.22-0.27 us a split, from 33 against 65 splits at 32k and 128k keys; a block ~0.3 us per SM).
MERGE_COST_BLOCKS = 0.75
# Split-KV partials are indexed with 32-bit offsets.
MAX_PARTIAL_ELEMENTS = 2**31
# The SM count a template's heuristic plans a config for, before a device is at hand (the split
# count itself always comes from the device's).
NOMINAL_SMS = limits.MULTIPROCESSORS["sm90a"]


def row_tiles(queries: int, group: int) -> int:
    """CTAs per KV head: the group's query rows (queries x heads per KV head) in ROWS-row tiles."""
    return -(-queries * group // ROWS)


def merge_share(head_dim: int, threads: int) -> int:
    """16-byte vectors of fp32 partials each thread of the merging CTA takes at most: a full row
    tile's (ROWS rows of head_dim / 4 vectors) over the threads, rounded up (1.5 at head dim 96
    with 8 warps is 2, or a third of each row would never be merged)."""
    return -(-ROWS * head_dim // 4 // threads)


def merge_group(queries: int, group: int, head_dim: int, warps: int, merge_loads: int) -> int:
    """Splits the fused merge (the CuTe template's, by the row's last CTA) reads per round of
    loads: ``merge_loads`` 16-byte loads in flight per thread over the vectors each thread takes
    of a full row tile's valid rows (a power of two, as the kernel's tiers, but never more
    than a full tile's share)."""
    rows = min(queries * group, ROWS)
    threads = 32 * warps
    vectors = rows * head_dim // 4
    most = merge_share(head_dim, threads)
    slots = 1
    while slots < most and vectors > threads * slots:
        slots *= 2
    return max(merge_loads // min(slots, most), 1)


@functools.lru_cache(maxsize=4096)
def num_splits(batch: int, kv_heads: int, queries: int, group: int, max_keys: int, sms: int,
               head_dim: int = 128, warps: int = 4, fused_merge: bool = False, merge_group: int = 0) -> int:
    """Split count for a decode call, from static sizes only (``max_keys``: the cache's capacity
    per sequence), so the choice needs no look at the device lengths.

    Model: CTAs run in waves of CTAS_PER_SM[head_dim] * sms, and a CTA's time is its blocks plus a fixed
    cost of about SPLIT_COST_BLOCKS blocks (Q load, in-CTA merge, the partial's write and read):
    time(S) = waves(S) * (blocks / S + cost). The fewest splits within 2% of the best time win;
    no split is shorter than ``warps * MIN_BLOCKS_PER_WARP`` blocks.

    ``fused_merge`` (the CuTe kernel's merge in the row's last CTA): the last CTA reads every
    split's partial one after the other (MERGE_COST_BLOCKS a split), and one CTA per SM already
    reads K/V at the full rate, so where the rows are few enough for one CTA per SM to hold two or
    more splits of each, sms // rows splits (one CTA per SM) replace the choice above when that
    is at least 2% faster per SM. Measured on the H200 (B = 1, 32k / 128k keys, GQA 8, D 128, in
    a CUDA graph): 33 splits took 32.7 / 76.5 us where 65 took 39.8 / 85.2. That count is then
    rounded down to a whole number of the merge's rounds (``merge_group`` splits a round, see
    ``merge_group``) where that gives up at most 1/16 of the splits: 32 rather than 33 at B = 1
    took 25.1 against 26.4 us at 32k keys (8 warps, 2 stages; one round of 32 against two)."""
    ctas = max(batch * kv_heads * row_tiles(queries, group), 1)
    slots = CTAS_PER_SM.get(head_dim, 1) * sms
    blocks = max(-(-max_keys // BLOCK_KEYS), 1)
    most = max(blocks // (warps * MIN_BLOCKS_PER_WARP), 1)

    def time(s: int) -> float:
        return -(-ctas * s // slots) * (blocks / s + SPLIT_COST_BLOCKS)

    best = min(time(s) for s in range(1, most + 1))
    chosen = next(s for s in range(1, most + 1) if time(s) <= 1.02 * best)
    if fused_merge and 2 * ctas <= sms and sms // ctas < chosen:
        # One CTA per SM against the wave model's choice, each timed per SM (the busiest SM's
        # blocks and fixed costs: the SM's read rate is shared by its CTAs) plus the merge.
        def per_sm(s: int) -> float:
            return -(-ctas * s // sms) * (blocks / s + SPLIT_COST_BLOCKS) + MERGE_COST_BLOCKS * s

        if per_sm(sms // ctas) <= 0.98 * per_sm(chosen):
            chosen = sms // ctas
            if merge_group and chosen > merge_group and chosen % merge_group:
                rounded = chosen - chosen % merge_group
                if 16 * rounded >= 15 * chosen:
                    chosen = rounded
    return chosen


def one_cta_per_sm(batch: int, kv_heads: int, queries: int, group: int, max_keys: int, sms: int,
                   head_dim: int, warps: int, merge_loads: int) -> bool:
    """Whether the fused merge's split count for these sizes puts at most one CTA on each SM."""
    splits = num_splits(batch, kv_heads, queries, group, max_keys, sms, head_dim, warps, True,
                        merge_group(queries, group, head_dim, warps, merge_loads))
    return batch * kv_heads * row_tiles(queries, group) * splits <= sms
