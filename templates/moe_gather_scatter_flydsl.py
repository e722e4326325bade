"""MoE token gather (scaled by the router score) and scatter-add for ROCm (FlyDSL), gfx942 / gfx950.

Same ops, semantics and calling conventions as moe_gather_scatter_cute.py (which follows
meta-pytorch/MSLK mslk/moe/gather_scatter.py):

gather_scale_dense_tokens: kernel(x, token_indices, expert_indices, scores, valid_count, out)
    out[i] = (x[t].float() * scores[t, e].float()).to(dtype), t, e = token_indices[i],
    expert_indices[i], for i < n (n = A, or min(valid_count[0], A) when sig["has_valid_count"]).
scatter_add_dense_tokens:  kernel(out, y, token_indices, valid_count, workspace)
    out[token_indices[i]] += y[i] for i < n, in place; rows whose token index is outside [0, T)
    are skipped. workspace [3 * T + 1 + 2 * A] int32 (torch.empty; used by method "sorted" only):
    counts [T], offsets [T + 1], positions [A], row lists [A], first rows [T] at offsets 0, T,
    2T+1, 2T+1+A, 2T+1+2A, the CuTe template's layout. Two methods (config["method"]), chosen as in the CuTe template (sorted
    once A * D * itemsize >= _gather_scatter_space.SORTED_MIN_BYTES or A >= DEEP_ROWS_PER_TOKEN * T):
    "sorted": group the rows by token, then add each token's rows in fp32 and write its out row
        once (rounded once; no data atomics). Five kernels on the stream: zero the counts; count
        (an int32 atomic add with return per row, global_atomic_add ... sc0, also gives the row's
        position among its token's rows, and position 0 is recorded per token, so the reduce
        fetches a token's first row without waiting for its offsets); exclusive scan of the
        counts (one block of 1024: each wave scans coalesced chunks of 64 with shuffles, on top
        of its offset from the 16 wave totals); place each row index in its token's list; reduce
        (block (t, c): token t's column chunk c, split like the gather). Tokens with no rows
        are not written. A token's rows are summed in the order the count atomics gave them, so
        sums of more than two rows may differ in the last fp32 bit between runs.
    "atomic": atomic adds in an unspecified order, each rounding to the dtype (as MSLK).

x, y, out [rows, D] contiguous; indices int32 [A]; valid_count [1] int32 (a dummy when unused).
Difference from the CuTe template: scores must have a unit column stride (row-major [T, E]; the
op layer makes column-major scores contiguous), since FlyDSL specializes a compiled kernel on
which dimension has unit stride; for the same reason D must be >= 2 (torch gives a [rows, 1]
tensor unit strides on both dimensions; the op layer runs one-column inputs as two columns).

Work split as in the CuTe template: row i takes vectors [c*chunk, (c+1)*chunk) in grid column c
with chunk = threads * unroll; threads is chosen at launch from D (whole waves of 64, at most
``block_threads``, or the power of two that covers a row needing fewer than a wave), and rows
narrower than 256 threads share a block, one per thread row (grid_and_block).
Two kinds of rows. A block's own rows (the gather's out rows, the atomic scatter's y rows, the
reduction's out rows) are consecutive and grow with the lane: one buffer descriptor per wave
covers them (``_flydsl_rowwise.WaveRows``), and a vector past a row's end loads zeros and stores
nothing. Gathered rows (x[token], y[a token's row]) lie anywhere in their tensor and differ
between the lanes of a wave: they are read with global loads from per-lane 64-bit addresses
(global_load_dwordx4 on 16-byte rows), a vector past the row end loading the row's vector 0,
unused. A buffer access through a per-lane descriptor would compile into a readfirstlane loop
over the wave's distinct descriptors (tests/test_moe_gather_scatter_code.py checks there is
none). Every load of a thread is issued before its first store.
The sorted reduce reads the out row and each of its token's rows with the same vectors and keeps
the sums in fp32 registers.
Atomic scatter: row i adds its chunk c, with the same work split (the CuTe template's column
slices are not ported). Atomics (relaxed, agent scope): aligned 16-bit rows add element pairs with
global_atomic_pk_add_bf16 / _f16 (gfx942 has no packed bf16 buffer atomic), fp32 rows use
global_atomic_add_f32, and 16-bit rows that are not 4-byte aligned add the aligned 4-byte words
of the out row with the same packed atomic (a half outside the row adds -0.0, the exact
identity), as the CuTe template: LLVM expands atomicrmw fadd on a 2-byte location into a
compare-and-swap loop.

The kernels are the classes ``_flydsl_moe_gather_scatter.Gather`` and ``.Scatter``; this module
declares the templates (config spaces, heuristics) without importing the DSL.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _gather_scatter_space as shared
from mslk_dsl.templates import _rowwise_space as rowwise

TARGETS = ("gfx942", "gfx950")
MAX_THREADS = 1024


def block_threads(config, sig) -> int:
    """The most threads a block of the row kernels takes (grid_and_block; the code objects
    declare it). The sorted reduction at 64 elements a thread (8 vectors of 16-bit rows at
    unroll 8) holds 64 fp32 sums and two rows' loads in flight: more than the 128 VGPRs of a
    1024-thread block (17-19 spilled on gfx942), within the 256 of a 512-thread one; longer
    rows take more chunks of the grid."""
    if config.get("method") == "sorted" and config["unroll"] * shared.vec(sig) >= 64:
        return 512
    return MAX_THREADS


def _heuristic(target, sig, problem):
    rows = int(problem.get("A", 65536))
    return {"unroll": 1 if rows < limits.MULTIPROCESSORS[target] else 4}   # few rows: spread each over more blocks


def _scatter_heuristic(target, sig, problem):
    # The method by size, as the CuTe template (shared.scatter_method); the unroll as the gather's.
    return {**_heuristic(target, sig, problem), "method": shared.scatter_method(sig, problem)}


def _placeholders(sig, scatter: bool):
    import torch

    dtype = getattr(torch, sig["dtype"])
    d = rowwise.placeholder_cols(sig)         # placeholder sizes only; every size stays dynamic
    idx = torch.zeros(6, dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int32)
    if not scatter:
        scores = torch.zeros(3, 5, dtype=getattr(torch, sig["score_dtype"]))
        return [torch.zeros(3, d, dtype=dtype), idx, idx.clone(), scores, count, torch.zeros(6, d, dtype=dtype)]
    workspace = torch.zeros(3 * 3 + 1 + 2 * 6, dtype=torch.int32)
    return [torch.zeros(3, d, dtype=dtype), torch.zeros(6, d, dtype=dtype), idx, count, workspace]


def _build_gather(config, target, sig):
    from mslk_dsl.templates import _flydsl_kernels as fk
    from mslk_dsl.templates._flydsl_moe_gather_scatter import Gather

    return fk.specialize(Gather, config, sig), _placeholders(sig, scatter=False)


def _build_scatter(config, target, sig):
    from mslk_dsl.templates import _flydsl_kernels as fk
    from mslk_dsl.templates._flydsl_moe_gather_scatter import Scatter

    return fk.specialize(Scatter, config, sig), _placeholders(sig, scatter=True)


TEMPLATES = [
    Template(op="gather_scale_dense_tokens", backend="flydsl", targets=TARGETS,
             signatures=shared.GATHER_SIGNATURES, signature_valid=shared.signature_valid, space={"unroll": shared.UNROLLS},
             heuristic=_heuristic, build=_build_gather, occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR),
    Template(op="scatter_add_dense_tokens", backend="flydsl", targets=TARGETS, signatures=shared.SIGNATURES,
             signature_valid=shared.signature_valid,
             space=shared.SCATTER_SPACE, heuristic=_scatter_heuristic, build=_build_scatter,
    occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR),
]
