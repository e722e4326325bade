"""Sizes and limits that the ops and the templates must agree on, stated once.

Plain Python with no import at all: the op layer (mslk_dsl/ops) sizes its checks and scratch
buffers from these, and the templates (which the registry imports in processes that must not
load a DSL) size their kernels from the same values. It lives among the templates so that the
digest of every template that imports it covers it: changing a limit recompiles those kernels.
"""

# Bytes per element of the floating-point dtypes the memory-bound templates take, by torch name.
ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# One 128-bit global access: the widest a thread's load or store moves.
VECTOR_BYTES = 16

# -- row vector widths (the memory-bound templates) ----------------------------------------------
# The signature part ``vec_bytes`` of a row-wise call: the widest of these accesses, in bytes of
# the row's dtype, that every row of every tensor of the call admits. A width w (w / element-size
# elements a vector) is admitted when each tensor starts on a multiple of its own w-element
# vector and its rows are a whole number of them. 16 is a full 128-bit access; a row of an odd
# number of 16-bit elements admits only its element size (one element per access). bf16 rows of
# 4096 take 16, of 4100 take 8, of 4098 take 4, of 4097 take 2; fp32 rows of 1026 take 8, of
# 1025 take 4 (one element). The kernels run their 128-bit configs on rows of 8 or 4 bytes with
# each vector cut into 2 or 4 accesses (see _rowwise_plan): the same tile and bytes per thread.
# 8 is its own class because it halves the accesses of 4 (quack's norms take it on such rows).
VECTOR_WIDTHS = (16, 8, 4, 2)


def contiguous_vector_bytes(row_elems: int, elem_bytes: int) -> int:
    """``vec_bytes`` of contiguous rows of ``row_elems`` elements from a 16-byte aligned start (a
    fresh tensor): the widest width of more than one element that each row is a whole number of
    (then so are the rows of any other dtype of the same length), else one element."""
    return next((w for w in VECTOR_WIDTHS if w > elem_bytes and row_elems * elem_bytes % w == 0), elem_bytes)


def vector_signature(sig: dict) -> bool:
    """A width no narrower than one element of the row's dtype (fp32 rows: 16 and 4)."""
    return sig["vec_bytes"] >= ELEM_BYTES[sig["dtype"]]


def vector_elems(sig: dict) -> int:
    """Elements of the row's dtype in one access of the signature's width."""
    return sig["vec_bytes"] // ELEM_BYTES[sig["dtype"]]


def one_element(sig: dict) -> bool:
    """Rows that admit only one element per access."""
    return sig["vec_bytes"] == ELEM_BYTES[sig["dtype"]]


# Streaming multiprocessors (sm90a) or compute units (gfx942, gfx950) of the part each target's
# templates are sized for: the H100 / H200 SXM, the MI300X and the MI355X. The persistent GEMM
# grids are this many CTAs, and the heuristics count waves and "fewer rows than SMs" with it
# before a device is at hand (where a count must match the device, the op layer reads the
# device's own: attention's split counts and persistent grids).
MULTIPROCESSORS = {"sm90a": 132, "gfx942": 304, "gfx950": 256}

# -- rmsnorm, rmsnorm_add ----------------------------------------------------------------------
def mixed_weight_signature(sig: dict) -> bool:
    """The norms' ``fp32_weight`` flag marks an fp32 weight beside 16-bit x; with fp32 x an fp32
    weight is the plain case, so that combination is no call's signature (the op layer never
    sets the flag there) and is not built."""
    return not (sig.get("fp32_weight") and sig.get("dtype") == "float32")


def fp32_residual_signature(sig: dict) -> bool:
    """rmsnorm_add's ``fp32_residual`` flag marks an fp32 residual stream (residual and
    new_residual fp32) beside 16-bit x, in every vector width of x (16-, 8- or 4-byte accesses,
    the residual's twice as wide: a 16-byte vector of x meets two 16-byte accesses of the
    residual; one element per access, the residual's one fp32 element)."""
    return not sig.get("fp32_residual") or ELEM_BYTES[sig["dtype"]] == 2


def norm_signature(sig: dict) -> bool:
    """The norms' signatures: a vector width of the dtype, the fp32-weight flag only beside 16-bit x,
    the fp32-residual flag (rmsnorm_add) only beside 16-bit x."""
    return vector_signature(sig) and mixed_weight_signature(sig) and fp32_residual_signature(sig)


# -- grouped GEMMs -----------------------------------------------------------------------------
# The dtypes of M_sizes (the rows of each group) the grouped GEMMs take, by torch name.
GROUPED_INDEX_DTYPES = ("int32", "int64")

# -- index_shuffling --------------------------------------------------------------------------
# Router score dtypes, by torch name.
SCORE_DTYPES = ("bfloat16", "float32")
# A routing key packs the expert as (2^bits - 1) - e in its low bits: 8 bits up to 256 experts,
# 9 for the 512-expert configs (E = 320, one of MSLK's expert counts).
MAX_EXPERTS = 512
# The narrowest config gives a token 8 lanes and each lane keeps one of the token's winners.
MAX_TOP_K = 8
# The route kernel runs at most this many blocks (chunks of tokens); its per-chunk, per-expert
# histogram is a workspace of MAX_CHUNKS * E int32 that the op allocates.
MAX_CHUNKS = 128


def index_shuffling_hist_ints(experts: int) -> int:
    """int32 elements of index_shuffling's histogram workspace for ``experts`` experts."""
    return MAX_CHUNKS * experts


# -- scatter_add_dense_tokens -----------------------------------------------------------------
def scatter_workspace_ints(tokens: int, rows: int) -> int:
    """int32 elements of the sorted scatter's workspace for ``tokens`` out rows and ``rows`` input
    rows: counts [T], offsets [T + 1], positions [A], row lists [A] and first rows [T]."""
    return 3 * tokens + 1 + 2 * rows


# -- occupancy floors (checked over every compiled kernel: mslk_dsl.resources) ------------------
# The lowest occupancy (resident warps / waves over the SM's / CU's maximum) a template's
# kernels may have. The GEMMs run one large CTA (work-group) per SM (CU) by design (persistent
# wgmma kernels on Hopper; LDS-bound MFMA tiles on gfx942: 12.5%); the row-wise and routing
# kernels need warps in flight to keep memory busy (their kernels measured 37.5% and up).
GEMM_OCCUPANCY_FLOOR = 0.12
ROWWISE_OCCUPANCY_FLOOR = 0.25
