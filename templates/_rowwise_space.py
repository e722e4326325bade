"""Config space shared by the FlyDSL row-wise templates (silu_mul, quantize_fp8_row, ...).

DSL-free on purpose: the registry evaluates validity and heuristics in processes that must not
import a DSL. A config is ``threads`` per block, ``rows_per_block`` (each row gets
threads / rows_per_block threads: whole waves of 64, or 16 / 32 lanes of one for short rows) and
``vec``, the elements one load moves: at most the signature's ``vec_bytes`` (the widest access
every row admits: 16, 8 or 4 bytes, else one element).
"""
from mslk_dsl.errors import ConfigError
from mslk_dsl.templates._kernel_limits import (ELEM_BYTES, ROWWISE_OCCUPANCY_FLOOR, VECTOR_BYTES, VECTOR_WIDTHS,
                                               one_element, vector_elems, vector_signature)

# 16 rows per block are sub-wave groups: 16 lanes a row at 256 threads, 32 at 512 (several rows
# share a wave's buffer descriptor: consecutive rows only, see _flydsl_rowwise.WaveRows).
SPACE = {"threads": (256, 512), "rows_per_block": (1, 4, 16), "vec": (8, 4, 2, 1)}
# Gathered rows (gather_scale_quant) are not consecutive: whole waves per row only.
GATHER_SPACE = {**SPACE, "rows_per_block": (1, 4)}
# Lanes of a row in a group smaller than a wave: DPP folds the wave's 16-lane rows, and a
# row_bcast step joins pairs of them (_flydsl_rowwise.wave_reduce).
SUBWAVE_WIDTHS = (16, 32)
# The row signature part every FlyDSL row-wise template declares (see _kernel_limits).
ROW_SIGNATURE = {"vec_bytes": VECTOR_WIDTHS}
WAVE = 64
# Register bytes of a row each thread keeps between the two passes of the FP8 row quantizers
# (quantize_fp8_row, silu_mul_quant): rows up to about threads_per_row * this are read once.
QUANT_REGISTER_BYTES = 64


def valid(config, target, sig) -> bool:
    # The widest vector the rows admit, or one element.
    return vector_signature(sig) and config["vec"] in (vector_elems(sig), 1) and whole_groups(config)


def whole_groups(config) -> bool:
    """Every row gets whole waves of 64 lanes, or 16 / 32 lanes of one."""
    threads, rows = config["threads"], config["rows_per_block"]
    width = threads // rows
    return threads % rows == 0 and (width % WAVE == 0 or width in SUBWAVE_WIDTHS)


def check(template: str, config, sig) -> None:
    """Raise ConfigError (a ValueError), naming the template and the config, unless ``valid``."""
    if not valid(config, None, sig):
        raise ConfigError(f"{template}: config {dict(config)} does not serve signature {dict(sig)}: vectors "
                          f"of the rows' vec_bytes or one element, whole waves of {WAVE} per row or "
                          f"{' or '.join(map(str, SUBWAVE_WIDTHS))} lanes of one")


def quant_heuristic(target, sig, problem) -> dict:
    """The FP8 row quantizers' config: the smallest that keeps a whole row in registers."""
    return smallest_covering(sig, problem["K"], QUANT_REGISTER_BYTES)


def quant_template_rules() -> dict:
    """The Template arguments the FlyDSL FP8 row quantizers share: signatures (input dtype,
    16-byte aligned rows, whether scale_ub is read), config space, validity, heuristic and
    occupancy floor."""
    return dict(signatures={"dtype": tuple(ELEM_BYTES), **ROW_SIGNATURE, "has_scale_ub": (True, False)},
                signature_valid=vector_signature, space=SPACE, valid=valid, heuristic=quant_heuristic, occupancy_floor=ROWWISE_OCCUPANCY_FLOOR)


def phased_rows(config, sig) -> bool:
    """Whether the kernel of ``config`` runs congruent rows phased: one-element configs on rows
    that admit no wider access (_flydsl_rowwise.PhasedRow)."""
    return config["vec"] == 1 and one_element(sig)


# Phased rows' index arithmetic, written once for the kernels (FlyDSL Int32 values, ``where`` a
# select) and for the tests (Python ints): see _flydsl_rowwise.PhasedRow / PhasedView.


def align_elems(vec: int, elem_bytes: int) -> int:
    """Elements between the boundaries ``vec``-element vectors of ``elem_bytes``-byte elements
    start on (at most 16 bytes of alignment): the modulus of their phase (phase_of)."""
    return min(vec * elem_bytes, VECTOR_BYTES) // elem_bytes


def phase_of(address, vec: int, elem_bytes: int):
    """Elements from ``address`` to the first address a ``vec``-element vector of
    ``elem_bytes``-byte elements may start on (at most 16 bytes of alignment). Only the low bits
    of ``address`` matter."""
    align = align_elems(vec, elem_bytes) * elem_bytes
    return ((align - (address & (align - 1))) & (align - 1)) // elem_bytes


def congruent_phases(first: int, first_bytes: int, other: int, other_bytes: int, vec: int):
    """Whether a tensor of ``other_bytes``-byte elements at phase ``other`` is congruent with the
    first tensor of a call (``first_bytes``-byte elements at phase ``first``), rows of ``vec``
    vectors: where the first's vectors start, its start on a boundary too. A tensor whose
    vectors align on fewer elements than the first's (an fp32 residual beside 16-bit x: 4 to 16
    bytes where x needs 8) matches the first's phase modulo its own. One that needs more would
    never be congruent (the rows' heads, set by the first, would not align it): a template
    that passes such tensors gets a ConfigError. Works on ints and on the kernels' Int32 phases
    (the moduli are compile-time ints)."""
    align, first_align = align_elems(vec, other_bytes), align_elems(vec, first_bytes)
    if align > first_align:
        raise ConfigError(f"phased rows: a tensor of {other_bytes}-byte elements aligns on more elements than "
                          f"the first ({first_bytes}-byte elements) and is never congruent with it; pass the "
                          "tensor of the widest alignment first")
    return other == (first & (align - 1))


def phased_split(phase, row, cols: int, vec: int, lane, where):
    """Row ``row`` of compact [M, cols] tensors, the first of which starts ``phase`` elements
    before a vector boundary: (head, nmid, edge_col). Columns [0, head) are the head, then
    ``nmid`` whole ``vec``-element vectors, then the tail; the edges (head and tail, fewer than
    2 * vec elements) go one to a lane: lane ``lane``'s column is ``edge_col``, or ``cols``
    for a lane without one. ``where(cond, a, b)`` picks a or b."""
    head = (phase - row * cols) & (vec - 1)  # row r starts r * cols elements after row 0
    head = where(head < cols, head, cols)
    nmid = (cols - head) // vec
    nedge = cols - nmid * vec
    col = where(lane < head, lane, lane + nmid * vec)
    return head, nmid, where(lane < nedge, col, cols)


def phased_offsets(phase, first, row, head, cols: int, vec: int):
    """Where a phased row sits behind a descriptor shared by the wave's rows: (lead, offset,
    start). The descriptor starts ``lead`` elements before the wave's first row ``first``, at
    the vector boundary at or before it; row ``row`` (its head ``head``) starts ``offset``
    elements past the descriptor and its middle ``start`` whole vectors past it."""
    lead = (first * cols - phase) & (vec - 1)
    offset = (row - first) * cols + lead
    return lead, offset, (offset + head) // vec


def placeholder_cols(sig) -> int:
    """The row length of a template's compile-time example tensors: 64 for 16-byte rows, else
    one vector short of it (60, 62, 63 for 16-bit rows of 8-, 4- and 2-byte vectors). Only a
    placeholder: the kernels take every size at run time."""
    v = vector_elems(sig)
    return 64 if sig["vec_bytes"] == VECTOR_WIDTHS[0] else 64 - v


def row_blocks(rows: int, rows_per_block: int) -> int:
    """Blocks of ``rows_per_block`` rows that cover ``rows`` (the grid of a row-wise kernel)."""
    return (rows + rows_per_block - 1) // rows_per_block


def widest_vec(sig) -> int:
    return vector_elems(sig)


def vectors_per_thread(config, sig, register_bytes: int) -> int:
    """How many vectors a thread holds at once when it may spend ``register_bytes`` of
    registers on them: a vector takes whole 4-byte registers (a lone bf16 takes 4 bytes)."""
    vec_bytes = config["vec"] * ELEM_BYTES[sig["dtype"]]
    return max(1, register_bytes // max(4, vec_bytes))


def smallest_covering(sig, cols: int, register_bytes: int, shared_waves: bool = True) -> dict:
    """The config with the fewest threads per row that covers ``cols`` columns in one go, each
    thread holding ``register_bytes`` of registers of the widest vectors (else the widest
    config): short rows pack 16 rows per block (16 or 32 lanes a row) or 4 (a wave a row), long
    rows get a whole block. ``shared_waves=False`` (gathered rows) keeps whole waves per row."""
    vec = widest_vec(sig)
    cols_per_thread = vectors_per_thread({"vec": vec}, sig, register_bytes) * vec
    shapes = ((256, 16), (512, 16)) if shared_waves else ()
    for threads, rows in shapes + ((256, 4), (256, 1), (512, 1)):
        if (threads // rows) * cols_per_thread >= cols:
            break
    return {"threads": threads, "rows_per_block": rows, "vec": vec}
