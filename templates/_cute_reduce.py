"""CuTe DSL device helpers for normalization-style row reductions (sum of squares, a row held
in registers across the reduction). They complement ``_cute_rowwise`` (row views,
predicated vector copies, the cross-thread row reduction).

Imported only from a template's ``build()`` (it imports ``cutlass`` at module level).
"""
import cutlass.cute as cute
from cutlass import Float32, Uint16, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def pairwise_sum(vals):
    """Sum of a Python list of scalars as a balanced tree (log-depth dependency chain)."""
    vals = list(vals)
    while len(vals) > 1:
        vals = [vals[i] + vals[i + 1] if i + 1 < len(vals) else vals[i] for i in range(0, len(vals), 2)]
    return vals[0]


def sum_squares(frag: cute.Tensor):
    """Sum of the squares of a (vec, chunks) register tile, in fp32: ``vec`` independent
    accumulators over the chunks (each square is consumed as soon as its load lands), then a
    pairwise sum of the accumulators."""
    acc = None
    for c in range(cute.size(frag, mode=[1])):
        f = frag[None, c].load().to(Float32)
        acc = f * f if acc is None else acc + f * f
    lanes = cute.make_rmem_tensor((cute.size(frag, mode=[0]),), Float32)
    lanes.store(acc)
    return pairwise_sum([lanes[i] for i in range(cute.size(lanes))])


@dsl_user_op
def after(packed: cute.TensorSSA, total: Float32, *, loc=None, ip=None) -> cute.TensorSSA:
    """``packed`` unchanged, but data-dependent on ``total``, a sum of squares.

    A row kept in registers between a reduction and a second pass is converted to fp32 in both
    passes; the compiler merges the two conversions and keeps the fp32 copy alive through the
    reduction: twice the registers of the packed 16-bit row, so fewer rows in flight per SM.
    OR-ing in the sign bit of ``total`` (0 for any sum of squares; for a NaN the row's result is
    NaN anyway) makes the second conversion a new value that exists only after the reduction."""
    sign = Uint32(llvm.bitcast(T.i32(), total.ir_value(loc=loc, ip=ip), loc=loc, ip=ip)) >> 31
    word = Uint32 if (packed.dtype.width * cute.size(packed.shape)) % 32 == 0 else Uint16
    return (packed.bitcast(word) | word(sign)).bitcast(packed.dtype)
