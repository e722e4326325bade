"""What the CuTe and FlyDSL gather/scatter templates share: signatures, vector width, and the
rule that picks the scatter method (plain Python: the registry runs heuristics without a DSL)."""

DTYPES = ("bfloat16", "float16", "float32")
SCORE_DTYPES = ("bfloat16", "float32")
SIGNATURES = {"dtype": DTYPES, "aligned": (True, False), "has_valid_count": (False, True)}
# Scatter inputs at least this large use the sorted method: its four index passes (~10 us on the
# H200) cost more than atomics save on smaller ones (not re-measured on CDNA: no AMD GPU).
SORTED_MIN_BYTES = 32 << 20


def vec(sig) -> int:
    """Elements one access moves: 16 bytes on aligned rows, else one element."""
    itemsize = 4 if sig["dtype"] == "float32" else 2
    return 16 // itemsize if sig["aligned"] else 1


def scatter_method(sig, problem) -> str:
    """"sorted" once the rows to add (A x D) reach SORTED_MIN_BYTES, else "atomic"."""
    rows, width = int(problem.get("A", 65536)), int(problem.get("D", 8192))
    itemsize = 4 if sig["dtype"] == "float32" else 2
    return "sorted" if rows * width * itemsize >= SORTED_MIN_BYTES else "atomic"
