"""MoE routing: top-k experts per token and the token indices grouped by expert, for ROCm
(FlyDSL), gfx942 / gfx950.

Same op, semantics, calling convention and algorithm as index_shuffling_cute.py (which follows
meta-pytorch/MSLK ``torch.ops.mslk.index_shuffling``):

    kernel(scores, valid_count, counts, expert_indices, token_indices, ws_slots, ws_hist,
           top_k, expert_start, expert_end)

scores [T, E] bf16/fp32; valid_count [1] int32 (a dummy unless sig["has_valid_count"]);
counts [E + 2], expert_indices / token_indices [T * top_k] int32 outputs; ws_slots [T * top_k]
and ws_hist [MAX_CHUNKS * E] int32 workspaces (torch.empty; the limits are in _kernel_limits);
int32 scalars top_k (1..min(MAX_TOP_K, E)), expert_start, expert_end.
E <= config["max_experts"] <= MAX_EXPERTS. Outputs as in
the CuTe template: deterministic, tokens ascending within each expert.
Difference from the CuTe template: scores must have a unit column stride (row-major; the op layer
makes column-major scores contiguous), since FlyDSL specializes a kernel on its unit-stride dim;
for the same reason E >= 2 (torch gives a [T, 1] tensor unit strides on both dimensions; the op
layer adds a second expert scored -inf, outside the routed range, for E = 1).

Route: a group of ``lanes`` threads of a 64-wide wave holds a token's packed keys
(orderable score bits << bits | 2^bits - 1 - e; bits 8, or 9 for 512 experts) and takes k rounds of butterfly max; each wave ranks its
selections per expert in token order in its own LDS histogram; the waves' counts are scanned.
Place: per-expert prefix sums over the chunks, then the scatter of the ranked slots.

The kernels are the class ``_flydsl_index_shuffling.IndexShuffling``; this module declares the
template (configs, heuristic) without importing the DSL.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _index_shuffling_space as space

NAME = "index_shuffling_flydsl"
TARGETS = ("gfx942", "gfx950")
# lanes: threads per token (>= top_k); keys per lane = max_experts / lanes; waves: of a route block.
CONFIGS = space.FLYDSL_CONFIGS


def _heuristic(target, sig, problem):
    return space.heuristic(CONFIGS, problem)


def build(config, target, sig):
    import torch

    from mslk_dsl.templates import _flydsl_kernels as fk
    from mslk_dsl.templates._flydsl_index_shuffling import IndexShuffling

    scores = torch.zeros(5, 16, dtype=getattr(torch, sig["score_dtype"]))  # sizes stay dynamic
    ints = [torch.zeros(n, dtype=torch.int32) for n in (1, 18, 10, 10, 10, limits.MAX_CHUNKS * 16)]
    return fk.specialize(IndexShuffling, config, sig, NAME), [scores, *ints, 2, 0, 16]


TEMPLATE = Template(op="index_shuffling", backend="flydsl", targets=TARGETS, signatures=space.SIGNATURES,
                    configs=CONFIGS, heuristic=_heuristic, build=build,
                    occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR)
