"""What the attention ops and their kernels agree on, stated once (plain Python, no import).

The op layer (mslk_dsl/ops/attention.py) checks calls against these values and the attention
templates build their kernels from them; living among the templates puts this file into the
digest of every template that imports it.
"""

# Element types of q, k, v and out, by torch name.
DTYPES = ("bfloat16", "float16")
# Head dimensions of q and k the prefill kernels are built for: FA3's set (64 and 128 for most
# models, 96 for Phi-style ones, 192 for DeepSeek's MLA prefill, 256 for Gemma).
HEAD_DIMS = (64, 96, 128, 192, 256)
# (q / k head dim, v head dim) pairs: v's equals q's, or DeepSeek-V2/V3's MLA prefill with
# q / k 192 = 128 + 64 (the latent part and the decoupled RoPE part) and v 128, as FA3 builds.
HEAD_DIM_PAIRS = tuple((d, d) for d in HEAD_DIMS) + ((192, 128),)
HEAD_DIMS_V = tuple(sorted({dv for _, dv in HEAD_DIM_PAIRS}))


def head_dims_served(head_dim: int, head_dim_v: int) -> bool:
    """Whether a kernel is built for q / k rows of ``head_dim`` and v rows of ``head_dim_v``."""
    return (head_dim, head_dim_v) in HEAD_DIM_PAIRS


def covering_head_dims(head_dim: int, head_dim_v: int) -> tuple[int, int] | None:
    """The served pair with the fewest columns that holds q / k rows of ``head_dim`` and v rows
    of ``head_dim_v`` (the pair itself when served), or None past the largest (256): the op pads
    other head dims with zeros up to it."""
    if (head_dim, head_dim_v) in HEAD_DIM_PAIRS:   # the usual call: no search
        return head_dim, head_dim_v
    fits = [(d, dv) for d, dv in HEAD_DIM_PAIRS if d >= head_dim and dv >= head_dim_v]
    return min(fits, key=lambda pair: (pair[0] + pair[1], pair)) if fits else None
# Mask families a kernel is specialised on. "none": every key; "causal": key j is visible to
# query i when j - i <= Mk - Mq (the diagonal through the bottom-right corner); "local": a band
# lo <= j - i - (Mk - Mq) <= hi around that diagonal, its two bounds given at run time.
MASKS = ("none", "causal", "local")
# A band side without a bound, as the kernels take it at run time: larger than any sequence
# (the op refuses longer ones), small enough that position arithmetic stays inside int32.
UNBOUNDED_WINDOW = 1 << 30
MAX_SEQLEN = UNBOUNDED_WINDOW
# q, k, v rows: every stride but the last's must keep rows 16-byte aligned for TMA.
STRIDE_ALIGN_BYTES = 16
