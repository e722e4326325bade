"""FlyDSL device helpers of the norm family beyond _flydsl_rowwise (row views, row reductions).

A per-column operand (e.g. an RMSNorm weight [N]) is read through a buffer descriptor whose size
is exactly the tensor's bytes, like the rows of _flydsl_rowwise: loads past its end return
zeros, so column tails need no branches.
"""
import flydsl.expr as fx


def vector_view(tensor, vec: int):
    """A 1-D tensor as a bounds-checked buffer view of ``vec``-element vectors, read with
    ``_flydsl_rowwise.load(view, j, vec)`` (columns [j * vec, j * vec + vec))."""
    buf = fx.rocdl.make_buffer_tensor(tensor, max_size=False)
    return fx.logical_divide(buf, fx.make_layout(vec, 1))
