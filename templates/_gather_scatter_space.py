"""What the CuTe and FlyDSL gather/scatter templates share: signatures, config spaces, vector
width, and the rule that picks the scatter method (plain Python: the registry runs heuristics
without a DSL)."""
from mslk_dsl.templates._kernel_limits import ELEM_BYTES, SCORE_DTYPES, VECTOR_WIDTHS, vector_elems, vector_signature

DTYPES = tuple(ELEM_BYTES)
SIGNATURES = {"dtype": DTYPES, "vec_bytes": VECTOR_WIDTHS, "has_valid_count": (False, True)}
# Vector widths narrower than one element are no call's (fp32 rows: 16, 8, 4 bytes).
signature_valid = vector_signature
GATHER_SIGNATURES = {**SIGNATURES, "score_dtype": SCORE_DTYPES}
UNROLLS = (1, 2, 4, 8)
SCATTER_SPACE = {"unroll": UNROLLS, "method": ("atomic", "sorted")}
# The CuTe scatter also has the method "linked" (a list of rows per token built with one atomic
# exchange per row: two index kernels instead of four) and chooses whether the kernels of the
# sorted and linked methods use programmatic dependent launch (Hopper); see scatter_valid.
CUTE_SCATTER_SPACE = {"unroll": UNROLLS, "method": ("atomic", "sorted", "linked"), "pdl": (False, True)}
# Scatter inputs at least this large use the sorted method: its four index passes (~10 us on the
# H200) cost more than atomics save on smaller ones (not re-measured on CDNA: no AMD GPU).
SORTED_MIN_BYTES = 32 << 20


def vec(sig) -> int:
    """Elements one access moves: the widest vector every row admits (16, 8 or 4 bytes), else
    one element."""
    return vector_elems(sig)


# Tokens that receive this many rows each on average (A >= 16 T) leave the atomic method at any
# size. Their atomic adds meet on the same out elements, where they serialize in L2 and round
# after every addition: a bf16 element summed from n rows carries an error growing like sqrt(n)
# half-steps of its partial sums (a random call with ~530 rows per token was off by 4.5 at 106).
# The grouped methods sum each token's rows in fp32 and round once. MoE routing gives a token at
# most top_k (<= 8 in current models) rows, so model calls keep the size rule.
DEEP_ROWS_PER_TOKEN = 16


def scatter_method(sig, problem, min_bytes: int = SORTED_MIN_BYTES) -> str:
    """"sorted" once the rows to add (A x D) reach ``min_bytes`` or the tokens receive
    DEEP_ROWS_PER_TOKEN rows each on average, else "atomic"."""
    rows, width, tokens = int(problem.get("A", 65536)), int(problem.get("D", 8192)), int(problem.get("T", 0))
    if 0 < tokens and rows >= DEEP_ROWS_PER_TOKEN * tokens:
        return "sorted"
    return "sorted" if rows * width * ELEM_BYTES[sig["dtype"]] >= min_bytes else "atomic"


def scatter_valid(config, target, sig) -> bool:
    """Programmatic dependent launch ("pdl") chains the kernels of the sorted (five) and linked
    (three) methods; the atomic method is one kernel."""
    return not (config.get("pdl") and config.get("method") == "atomic")
