"""CuTe DSL device code of the flat row-wise kernels (``_rowwise_plan``'s ``layout`` "flat"):
silu_mul over compact [M, K] tensors mapped as one flat array of 16-byte vectors, whatever K is.

Why: a row kernel gives each row its own group of lanes, so a short row leaves lanes idle in
its last vector round (a row of 70 bf16 elements is 9 vectors: 8 lanes take two rounds, the
second with one lane busy), and a row of an odd length admits no vector access at all (the
phased rows of ``_cute_rowwise`` recover its middle, not its edges). An elementwise op has no
use for rows: read flat, every warp access is 512 contiguous bytes and every lane holds data.
The tensor's last vector, where it is partial, is read and written element by element, so
nothing past the tensor is touched.

The FP8 row quantizers were built this way too (a CTA owning the rows that start in its span,
per-vector partial maxima in shared memory, a scale per row): correct, and 1.3-1.6x slower than
their row tiles at rows of 69-1000 elements on an H100 (docs/benchmarks.md "Flat tiles"), so dropped.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from mslk_dsl.templates import _cute_rowwise as rw


def _flat_view(t: cute.Tensor, first: Int64, vec: int, count: Int32, align: int) -> cute.Tensor:
    """``count`` vectors of ``vec`` elements of the compact tensor ``t`` from flat element
    ``first`` (a multiple of ``vec``): ``v[None, j]`` is elements [first + j*vec, ...)."""
    esize = t.element_type.width // 8
    addr = t.iterator.toint() + first * Int64(esize)
    ptr = cute.make_ptr(t.element_type, addr, cute.AddressSpace.gmem, assumed_align=align)
    return cute.make_tensor(ptr, cute.make_layout((vec, count), stride=(1, vec)))


@cute.jit
def map_flat(inputs, combine: cutlass.Constexpr, mO: cute.Tensor, tile: cutlass.Constexpr, rows: Int32):
    """Kernel body of a flat elementwise map (silu_mul): mO = combine(*inputs) over the first
    ``rows`` rows of [M, K] tensors (compact, 16-byte aligned), the CTA's ``threads * chunks``
    vectors of the flat array; the tensor's last vector, where it is partial, element by
    element."""
    threads, vec, chunks = tile.threads, tile.vec, tile.chunks
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    total = Int64(rows) * Int64(mO.shape[1])       # elements to compute
    base = Int64(bidx) * Int64(threads * chunks * vec)
    if base < total:
        nvec = Int32(cutlass.min(Int64(threads * chunks), (total - base + Int64(vec - 1)) // Int64(vec)))
        whole = Int32(cutlass.min(Int64(nvec), (total - base) // Int64(vec)))
        rest = Int32(cutlass.min(total - base - Int64(whole) * Int64(vec), Int64(vec)))
        srcs = tuple(_flat_view(t, base, vec, nvec, 16) for t in inputs)
        dst = _flat_view(mO, base, vec, nvec, 16)
        frags = []
        for t in inputs:
            f = cute.make_rmem_tensor((vec, chunks), t.element_type)
            f.fill(0)
            frags.append(f)
        for src, f in zip(srcs, frags):
            _copy_flat(f, src, True, tidx, threads, whole, nvec, rest)
        out = cute.make_rmem_tensor((vec, chunks), mO.element_type)
        out.store(combine(*frags))
        _copy_flat(out, dst, False, tidx, threads, whole, nvec, rest)


@cute.jit
def _copy_flat(regs: cute.Tensor, view: cute.Tensor, load: cutlass.Constexpr[bool], first: Int32,
               step: cutlass.Constexpr[int], whole: Int32, nvec: Int32, rest: Int32):
    """Between a register tile (vec, n) and a ``_flat_view``: column ``i`` and vector
    ``first + i*step``, one access for vectors below ``whole``; the partial last vector (index
    ``whole``, below ``nvec``) element by element, its first ``rest`` elements only."""
    vec = cute.size(regs, mode=[0])
    atom = rw._atom(load, view.element_type, vec, rw.KEEP)
    for i in cutlass.range_constexpr(cute.size(regs, mode=[1])):
        v = first + i * step
        if v < whole:
            if cutlass.const_expr(load):
                cute.copy(atom, view[None, v], regs[None, i])
            else:
                cute.copy(atom, regs[None, i], view[None, v])
        elif v < nvec:
            for j in cutlass.range_constexpr(vec):
                if j < rest:
                    if cutlass.const_expr(load):
                        regs[j, i] = view[j, v]
                    else:
                        view[j, v] = regs[j, i]


@cute.jit
def flat_serves(tensors):
    """Whether a flat tile serves a call (host side of the launch): every [M, K] tensor compact
    (row stride K) and on a 16-byte boundary."""
    k = tensors[0].shape[1]
    misfits = Int32(0)
    for t in tensors:
        misfits = misfits + Int32(Int64(t.stride[0]) != Int64(k)) + Int32(t.iterator.toint() % 16 != 0)
    return misfits == 0


def flat_launch(tile, rows, cols) -> dict:
    """Grid and block of a flat kernel over [rows, cols] tensors: one CTA per
    ``threads * chunks * vec`` elements of the flat array."""
    span = tile.threads * tile.chunks * tile.vec
    return {"grid": (Int32((Int64(rows) * Int64(cols) + Int64(span - 1)) // Int64(span)), 1, 1),
            "block": (tile.threads, 1, 1)}
