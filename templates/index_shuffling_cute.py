"""MoE routing: top-k experts per token and the token indices grouped by expert, for NVIDIA
Hopper, in CuTe DSL.

Semantics follow meta-pytorch/MSLK ``torch.ops.mslk.index_shuffling`` (csrc/moe/index_shuffling.cu).

    kernel(scores, valid_count, counts, expert_indices, token_indices, ws_slots, ws_hist,
           top_k, expert_start, expert_end)

    scores          [T, E] bf16/fp32 (sig["score_dtype"]), any strides; E <= config["max_experts"]
    valid_count     [1] int32: tokens >= valid_count[0] are not routed; read only if
                    sig["has_valid_count"] (else any 1-element int32 tensor)
    counts          [E + 2] int32 out: counts[e] = tokens routed to expert e for e in
                    [expert_start, expert_end), 0 for other e; counts[E] = T; counts[E + 1] =
                    sum(counts[:E]). Fully written by the kernel (no zero-fill needed).
    expert_indices  [T * top_k] int32 out: the first counts[E + 1] entries hold
                    e - expert_start, grouped by expert in increasing e; the rest is unspecified.
    token_indices   [T * top_k] int32 out: the token of each of those entries.
    ws_slots        [T * top_k] int32 workspace (torch.empty).
    ws_hist         [MAX_CHUNKS * E] int32 workspace (torch.empty); MAX_CHUNKS and the other
                    limits the op layer checks are in _kernel_limits.
    top_k, expert_start, expert_end: int32 scalars; 1 <= top_k <= min(MAX_TOP_K = 8, E),
                    0 <= expert_start <= expert_end <= E.

A token's experts are the top_k largest scores; ties go to the lower expert index (MSLK's merge
keeps the left, lower-index operand on ties too; torch.topk does not specify). Within an expert,
tokens are in increasing order, so the output is deterministic and equals a stable sort of the
(expert, token) pairs. Deliberate differences from MSLK: deterministic order (MSLK's atomics
give an arbitrary order within an expert); any E <= 512 and top_k <= 8 (MSLK: E in {16, 32, 128,
320}; top_k in {1, 2, 4}); no cooperative launch or zero-filled counts; -0.0 ranks below +0.0
and NaN scores are unspecified. The expert takes the low ``bits`` of a key or slot: 8 for
max_experts <= 256, 9 for 512; T < 2^(31 - bits) (ranks are packed as rank << bits | e).

Two kernels, no grid-wide barrier:
  route  (one block per chunk of tokens; each warp owns a contiguous run of the chunk): a group
         of ``lanes`` threads finds a token's top-k by k rounds of max over packed keys
         (orderable score bits << bits | 2^bits - 1 - e: one integer max compares score, then index).
         Each warp ranks its selections per expert in token order with a private histogram in
         shared memory; the warps' counts are then scanned so the rank is the position within
         the chunk, written to ws_slots as rank << bits | e (-1: not routed), and the chunk's
         per-expert counts go to ws_hist.
  place  (one block per chunk): prefix-sums ws_hist over chunks and experts to the chunk's
         base per expert and writes expert_indices / token_indices. Block 0 writes counts.
A ``single`` config runs both steps in one block of 1024 threads over all T tokens (one chunk),
one launch instead of two; the heuristic takes it where the two kernels would route the tokens
in one chunk anyway (T <= 1024 / lanes: decode), so the work is the same.

The kernels are the class ``_cute_index_shuffling.IndexShuffling``; this module declares the
template (configs, checks, heuristic) without importing the DSL.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _index_shuffling_space as space

NAME = "index_shuffling_cute"
# lanes: threads per token (>= top_k); keys per lane = max_experts / lanes; warps: of a route block.
CONFIGS = space.CUTE_CONFIGS


def _valid(config, target, sig):
    keys = config["max_experts"] // config["lanes"]
    regs = keys * (2 if sig["score_dtype"] == "float32" else 1)
    # 1024 threads leave 64 registers per thread, 512 leave 128.
    return regs <= (32 if config["warps"] == 32 else 64)


def _heuristic(target, sig, problem):
    return space.heuristic(CONFIGS, problem)


def build(config, target, sig):
    from mslk_dsl.templates._cute_index_shuffling import IndexShuffling

    kernel = IndexShuffling(config, sig, NAME)
    return kernel, kernel.fake_args()


TEMPLATE = Template(op="index_shuffling", backend="cute", targets=("sm90a",), signatures=space.SIGNATURES,
                    configs=CONFIGS, valid=_valid, heuristic=_heuristic, build=build,
                    occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR,
                    instructions={"ptx": [r"shfl\.sync"]})
