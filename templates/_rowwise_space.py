"""Config space shared by the FlyDSL row-wise templates (silu_mul, quantize_fp8_row, ...).

DSL-free on purpose: the registry evaluates validity and heuristics in processes that must not
import a DSL. A config is ``threads`` per block, ``rows_per_block`` (each row gets
threads / rows_per_block threads, whole waves of 64) and ``vec``, the elements one load moves:
at most the signature's ``vec_bytes`` (the widest access every row admits: 16, 8 or 4 bytes, else
one element).
"""
from mslk_dsl.errors import ConfigError
from mslk_dsl.templates._kernel_limits import (ELEM_BYTES, ROWWISE_OCCUPANCY_FLOOR, VECTOR_WIDTHS, vector_elems,
                                               vector_signature)

SPACE = {"threads": (256, 512), "rows_per_block": (1, 4), "vec": (8, 4, 2, 1)}
# The row signature part every FlyDSL row-wise template declares (see _kernel_limits).
ROW_SIGNATURE = {"vec_bytes": VECTOR_WIDTHS}
WAVE = 64
# Register bytes of a row each thread keeps between the two passes of the FP8 row quantizers
# (quantize_fp8_row, silu_mul_quant): rows up to about threads_per_row * this are read once.
QUANT_REGISTER_BYTES = 64


def valid(config, target, sig) -> bool:
    # The widest vector the rows admit, or one element.
    return (vector_signature(sig) and config["vec"] in (vector_elems(sig), 1)
            and config["threads"] % (config["rows_per_block"] * WAVE) == 0)


def check(template: str, config, sig) -> None:
    """Raise ConfigError (a ValueError), naming the template and the config, unless ``valid``."""
    if not valid(config, None, sig):
        raise ConfigError(f"{template}: config {dict(config)} does not serve signature {dict(sig)}: vectors "
                          f"of the rows' vec_bytes or one element, whole waves of {WAVE} per row")


def quant_heuristic(target, sig, problem) -> dict:
    """The FP8 row quantizers' config: the smallest that keeps a whole row in registers."""
    return smallest_covering(sig, problem["K"], QUANT_REGISTER_BYTES)


def quant_template_rules() -> dict:
    """The Template arguments the FlyDSL FP8 row quantizers share: signatures (input dtype,
    16-byte aligned rows, whether scale_ub is read), config space, validity, heuristic and
    occupancy floor."""
    return dict(signatures={"dtype": tuple(ELEM_BYTES), **ROW_SIGNATURE, "has_scale_ub": (True, False)},
                signature_valid=vector_signature, space=SPACE, valid=valid, heuristic=quant_heuristic, occupancy_floor=ROWWISE_OCCUPANCY_FLOOR)


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


def smallest_covering(sig, cols: int, register_bytes: int) -> dict:
    """The config with the fewest threads per row that covers ``cols`` columns in one go, each
    thread holding ``register_bytes`` of registers of the widest vectors (else the widest
    config): short rows pack 4 rows per block, long rows get a whole block."""
    vec = widest_vec(sig)
    cols_per_thread = vectors_per_thread({"vec": vec}, sig, register_bytes) * vec
    for threads, rows in ((256, 4), (256, 1), (512, 1)):
        if (threads // rows) * cols_per_thread >= cols:
            break
    return {"threads": threads, "rows_per_block": rows, "vec": vec}
