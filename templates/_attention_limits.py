"""What the attention ops and their kernels agree on, stated once (plain Python, no import).

The op layer (mslk_dsl/ops/attention.py) checks calls against these values and the attention
templates build their kernels from them; living among the templates puts this file into the
digest of every template that imports it.
"""

# Element types of q, k, v and out, by torch name.
DTYPES = ("bfloat16", "float16")
# Head dimensions the kernels are built for (q, k and v share one).
HEAD_DIMS = (64, 128, 256)
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
