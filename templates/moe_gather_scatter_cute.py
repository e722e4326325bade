"""MoE token gather (scaled by the router score) and scatter-add for NVIDIA Hopper, in CuTe DSL.

Semantics follow meta-pytorch/MSLK (mslk/moe/gather_scatter.py, its Triton kernels
``_mslk_gather_scale_dense_tokens`` and ``_mslk_scatter_add_dense_tokens``).

gather_scale_dense_tokens:
    kernel(x, token_indices, expert_indices, scores, valid_count, out)
    x [T, D] dtype; token_indices, expert_indices [A] int32; scores [T, E] bf16/fp32, any strides
    (row- or column-major, as MSLK); valid_count [1] int32, read only if sig["has_valid_count"]
    (else any 1-element int32 tensor); out [A, D] dtype, preallocated (torch.empty).
    For every row i < n (n = A, or min(valid_count[0], A)):
        t, e = token_indices[i], expert_indices[i]
        out[i] = (x[t].float() * scores[t, e].float()).to(dtype)
    Rows at and past n are not written (MSLK leaves them uninitialized too).
scatter_add_dense_tokens:
    kernel(out, y, token_indices, valid_count, workspace)
    out [T, D] dtype, updated in place; y [A, D] dtype; token_indices [A] int32; valid_count as
    above; workspace [3 * T + 1 + 2 * A] int32 (_kernel_limits.scatter_workspace_ints; torch.empty;
    used by methods "sorted" and "linked" only).
    For every row i < n: out[token_indices[i]] += y[i]. Rows whose token index is outside
    [0, T) are skipped (MSLK writes out of bounds).
    Three methods (config["method"]):
    "linked" (large problems, the default there): one list of rows per token, built with one
        atomic exchange per row (heads [T] start at -1, next [A]), walked by the reduction of
        "sorted" below (a row's next index is loaded with its data). Three kernels: set the
        heads, link, reduce. The order of a token's rows follows the exchanges (unspecified);
        fp32 sums and one rounding, as "sorted".
    "sorted" (selectable): group the rows by token first, then add each token's rows in
        fp32 and write its out row once; no data atomics, so out crosses DRAM once each way and
        bf16/fp16 sums round once (MSLK's tl.atomic_add rounds after every addition). Five
        kernels on the stream: zero the per-token counts; count (an int32 atomic per row also
        gives the row's position among its token's rows, and the row at position 0 is recorded
        per token); exclusive scan of the counts (one block); place each row index in its
        token's list; reduce (block (t, c): token t's column chunk c, like the gather; the first
        row comes from the per-token record, so its loads wait for one index load, not two).
        The order of a token's rows in its list follows the count atomics, so it is unspecified: sums of more than two rows may differ in the last
        fp32 bit between runs (exact whenever the fp32 sums are exact).
    With config["pdl"], the kernels after the first of "sorted" and "linked" use programmatic
    dependent launch: each starts while its predecessor runs and waits (griddepcontrol.wait)
    before it reads anything, which hides the launch gaps of the chain.
    "atomic" (small problems, where the extra launches would cost more than they save, unless
        the tokens receive _gather_scatter_space.DEEP_ROWS_PER_TOKEN rows each on average):
        atomic adds, like MSLK: vector reductions as wide as the rows admit (REDG.ADD.BF16x8 /
        F16x8 / F32x4 on 16-byte rows, BF16x4 / F16x4 / F32x2 on 8-byte ones, BF16x2 / F16x2 on
        4-byte ones); rows of one element per access run phased (below), their edges adding
        aligned 4-byte words of the out row, BF16x2 / F16x2 with -0.0 (the exact identity) in a
        half outside the row, as torch's index_add_ (Hopper's lone bf16 / fp16 atomic add is a
        compare-and-swap loop), or single fp32 elements.
        A token that receives several rows (top_k > 1) gets them in an unspecified order and,
        for bf16/fp16, each addition rounds to the output dtype (as MSLK); fp32 atomic adds
        flush subnormals (hardware semantics, as CUDA's atomicAdd).

Rows that admit no 16-byte access (odd widths, widths that are not a multiple of 16 bytes, bases
off a 16-byte boundary) are phased in the gather and the linked reduction, and rows of one
element per access also in the atomic scatter: each out row is cut into a head, a middle of
aligned 16-byte vectors and a tail (fewer than 16 bytes each); a middle vector's source bytes sit
at another offset in their row (one per row), so they are read as the two aligned 16-byte loads
around them and moved into place in registers (``_word_shift.shifted_words``), and the head and
tail go one element (or, in the atomic scatter's 16-bit rows, one word) at a time. The sorted
reduction and the atomic scatter on rows of 4- and 8-byte accesses keep their access width.

Gather: token indices must lie in [0, T) for rows below n (not checked on the device, as MSLK). Sizes T,
A, D, E are dynamic. ``sig["vec_bytes"]``: every row starts on a multiple of it and D * itemsize
is one; then one access moves that many bytes (16, 8 or 4), else one element.

Work split, gather (and the reductions of "sorted" and "linked", by token): a row takes
threads x unroll vectors of one chunk, [c * chunk, (c + 1) * chunk) for grid column c, with
threads = ceil(vectors per row / unroll) rounded up to a warp (at most 1024; phased rows at most
512 or 256 by unroll, for their registers) and chosen at launch from D, so 5120-, 7168- and
8192-wide bf16 rows are covered exactly by 160, 224 and 256 threads with unroll 4; a longer row
is split into chunks of equal share. Rows that need fewer than 32 threads take the power of two
that covers them (phased rows at least a vector's worth, for their edges), and
rows narrower than 128 threads share a block (one per thread row y): a block per short row ran
at the block scheduler's rate, not the memory's. On rows of one element per access the reductions
take a one-token block's token from the block index (a uniform register), elsewhere from the
thread row (``Scatter.uniform_single_tokens``: each was faster where it is used).
Atomic scatter: in MoE order (rows grouped by expert) the top_k rows of a token arrive far apart, so
whole-row updates re-read and re-write each out row from DRAM top_k times (measured: 35-43% of
the copy roofline at top_k 4-8). Blocks therefore take column slices: block (b, c) adds slice c
(a power-of-two number of slots, >= 256 bytes) of 256 * unroll / slice consecutive input rows,
and blockIdx.x runs over all rows of a slice before the next slice starts. The slice is chosen at
launch so that 2 * T * slice bytes (the data touched between two updates of one out slice) stays
under 16 MB: the out slice stays in L2 and every out element crosses DRAM once each way.
Each thread issues all its loads before any store or atomic (memory-level parallelism); lanes past
the data re-load a valid vector and store nothing, so there are no out-of-bounds accesses.
Differences from MSLK: any D (MSLK needs D % 1024 == 0, or 512 for few rows); int32 indices
only (the op layer converts int64 ones).

The kernels are the classes ``_cute_moe_gather_scatter.Gather`` and ``.Scatter``; this module
declares the templates (config spaces, heuristics) without importing the DSL.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _gather_scatter_space as shared


def _unroll(target, problem) -> int:
    # Few rows: shorter chunks spread a row over more blocks (MSLK splits D likewise).
    rows = int(problem.get("A", 65536))
    return 1 if rows < limits.MULTIPROCESSORS[target] else 4


def _heuristic(target, sig, problem):
    # Rows narrower than 16-byte accesses run phased at unroll 4 too: 1.04-1.18x the 4- and
    # 8-byte accesses they replaced, each at its fastest unroll (H100, bf16, top-2, 9 rows of
    # 66-11342 elements; docs/benchmarks.md "MoE gather and scatter on one-element rows:
    # phased"), which had taken unroll 8 on 4-byte rows.
    return {"unroll": _unroll(target, problem)}


# Tokens that receive two or more rows each (A >= 2 T: top_k >= 2) leave the atomic method at a
# smaller size: their rows' atomic adds meet on the same out rows (and round after each one),
# while the linked method's index passes cost the same fixed few us. Measured on the H200 (bf16,
# D 2880-7168, CUDA-graph replays): top-2 at A x D just under 32 MiB, linked + pdl 25.4-25.8 us
# against 26.7-28.3 us for atomics; at 8 MiB 12.5 against 11.2 us; top-8 at 13 MiB 13.4-13.6
# against 12.6 us. Top-1 keeps SORTED_MIN_BYTES (at 21 MiB its atomics are 0.5-0.8 us faster).
MULTI_ROW_MIN_BYTES = 20 << 20


# Rows narrower than 16-byte accesses run phased in the linked reduction, and so do rows of one
# element per access (odd widths) in the atomic kernel (``_cute_moe_gather_scatter``: the out
# row's aligned middle in 16-byte accesses); the size rule picks their method as for vector rows.
# Unroll 2 in the phased linked reduction (its fp32 sums take 48 / 64 / 96 registers a thread at
# unroll 1 / 2 / 4), 1 in the phased atomic kernel (32 registers against 74 at unroll 4).
# H100, bf16, top-1 / 2 / 8, CUDA-graph replays, every method timed (docs/benchmarks.md "MoE
# gather and scatter on one-element rows: phased"):
#  - one-element rows of 75-7001: linked + pdl was the fastest method at every point of 20 MiB
#    and more; its unroll 2 within 1% of the best unroll at 21 of 30 points and at most 5.7%
#    behind (unroll 4 at 20000 x 4887, top-8), unroll 4 up to 1.35x slower than 2 on rows of
#    75-333; atomic unroll 1 the fastest atomic config at every point. The phased linked
#    reduction is 1.06-1.62x faster than the phased atomics at top-1 and top-2 from 20 MiB up
#    (20000 x 4887: 262.0 -> 204.1 us at top-1, 374.4 -> 273.2 at top-2); the one-element linked
#    reduction before it lost to packed-word atomics there.
#  - rows of 4- and 8-byte accesses (66-11342): the phased linked reduction at its fastest unroll
#    against the 4- and 8-byte one at its own, faster at 23 of 27 points (by up to 1.19x: 20559 x
#    8206 at top-1, 354.8 against 422.9 us), at most 3.3% slower (93365 x 84, top-8). Their
#    atomic kernel keeps its vector accesses: phased it ran up to 1.56x slower on short rows
#    (93365 x 84 at top-2: 54.4 against 34.8 us).
# fp32 rows take the same rule (not timed).
PHASED_LINKED_UNROLL, PHASED_ATOMIC_UNROLL = 2, 1


def _scatter_heuristic(target, sig, problem):
    # The method by size (shared.scatter_method): small problems take the atomic method, larger
    # ones the linked method with programmatic dependent launch and unroll 4. Measured on the
    # H200 (bf16, top-2 and top-8, D 2880 and 5120, 256 MiB moved): linked + pdl 74-77 us against
    # 84-86 us for the sorted method (the earlier choice), 81-83 us for sorted + pdl; unroll 4
    # within 1% of the best unroll at every point. The sorted method stays selectable.
    rows, tokens = int(problem.get("A", 65536)), int(problem.get("T", 65536))
    several = 0 < tokens and 2 * tokens <= rows
    min_bytes = MULTI_ROW_MIN_BYTES if several else shared.SORTED_MIN_BYTES
    if shared.scatter_method(sig, problem, min_bytes) == "atomic":
        unroll = PHASED_ATOMIC_UNROLL if limits.one_element(sig) else _unroll(target, problem)
        return {"unroll": unroll, "method": "atomic", "pdl": False}
    return {"unroll": PHASED_LINKED_UNROLL if sig["vec_bytes"] < 16 else 4, "method": "linked", "pdl": True}


def _build_gather(config, target, sig):
    from mslk_dsl.templates._cute_moe_gather_scatter import Gather

    kernel = Gather(config, sig)
    return kernel, kernel.fake_args()


def _build_scatter(config, target, sig):
    from mslk_dsl.templates._cute_moe_gather_scatter import Scatter

    kernel = Scatter(config, sig)
    return kernel, kernel.fake_args()


TEMPLATES = [
    Template(op="gather_scale_dense_tokens", backend="cute", targets=("sm90a",),
             signatures=shared.GATHER_SIGNATURES, signature_valid=shared.signature_valid, space={"unroll": shared.UNROLLS},
             heuristic=_heuristic, build=_build_gather, occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR),
    Template(op="scatter_add_dense_tokens", backend="cute", targets=("sm90a",), signatures=shared.SIGNATURES,
             signature_valid=shared.signature_valid,
             space=shared.CUTE_SCATTER_SPACE, valid=shared.scatter_valid, heuristic=_scatter_heuristic,
             build=_build_scatter,
             occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR,
             # Data atomics (atomic), count atomics (sorted) or link exchanges (linked).
             instructions={"ptx": [r"(red|atom)\.global(\.\w+)*\.(add|exch)"]}),
]
