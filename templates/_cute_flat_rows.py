"""CuTe DSL device code of the flat row-wise kernels (``_rowwise_plan``'s ``layout`` "flat"): the
FP8 row quantizers and silu_mul over compact [M, K] tensors read as one flat array of 16-byte
vectors, whatever K is. (silu_mul, elementwise, is simply mapped over the flat array:
``map_flat``; the rest of this docstring is about the quantizers.)

Why: a row kernel gives each row its own group of lanes, so a short row leaves lanes idle in
its last vector round (a row of 70 bf16 elements is 9 vectors: 8 lanes take two rounds, the
second with one lane busy), and a row of an odd length admits no vector access at all. Read
flat, every warp access is 512 contiguous bytes and every lane holds data.

A CTA of T threads owns the rows that start in its E = T * chunks * vec elements of the flat
array (E a whole number of vectors, so each CTA's share starts on a vector; a row that starts in
it and ends past it is the CTA's, its last vectors read in one more round). Each thread loads
vectors ``tid, tid + T, ...`` of the CTA's span, every load issued before the first use, and
keeps them in registers through three phases split by two CTA barriers:

1. per vector, the absmax of the elements of the first row it holds and of the next one (a
   vector holds at most two rows when K >= vec) into two shared-memory slots;
2. a group of lanes per row combines its row's slots into the row's absmax, scale and
   reciprocal (the arithmetic of ``_cute_rowwise.fp8_row_scale``) and stores the scale;
3. per vector, each element quantized with its row's scale; whole vectors are stored as one
   access, the few vectors a CTA shares with a neighbour (or with the tensor's end) element by
   element.

The element at the tensor's very end may leave a last vector partly outside the tensor: that
vector is loaded element by element, so nothing past the tensor is read.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from mslk_dsl.templates import _cute_rowwise as rw


def _flat_view(t: cute.Tensor, first: Int64, vec: int, count: Int32, align: int) -> cute.Tensor:
    """``count`` vectors of ``vec`` elements of the compact tensor ``t`` from flat element
    ``first`` (a multiple of ``vec``): ``v[None, j]`` is elements [first + j*vec, ...)."""
    esize = t.element_type.width // 8
    addr = t.iterator.toint() + first * Int64(esize)
    ptr = cute.make_ptr(t.element_type, addr, cute.AddressSpace.gmem, assumed_align=align)
    return cute.make_tensor(ptr, cute.make_layout((vec, count), stride=(1, vec)))


@cute.jit
def _vector_rows(v: Int32, vec: cutlass.Constexpr[int], lead: Int32, owned: Int32, k: Int32):
    """(lo, hi, row, split) of vector ``v`` of a CTA's span: its elements [lo, hi) are the CTA's
    (``lead`` elements of the span precede the CTA's first row, ``owned`` elements are its rows),
    the first of them in the CTA's row ``row``; elements from ``split`` on are in row ``row + 1``."""
    a = v * vec - lead                       # the vector's first element, from the first row's start
    lo = cutlass.max(Int32(0), -a)
    hi = cutlass.min(Int32(vec), owned - a)
    row = (a + lo) // k
    split = (row + 1) * k - a
    return lo, hi, row, split


@cute.jit
def quantize_flat(inputs, combine: cutlass.Constexpr, mUB: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor,
                  tile: cutlass.Constexpr, has_ub: cutlass.Constexpr, eps: cutlass.Constexpr[float],
                  fp8_max: cutlass.Constexpr[float], rows: Int32):
    """Kernel body of a flat quantizer: the CTA's rows (of the first ``rows``) of combine(*inputs)
    (inputs [M, K], compact, 16-byte aligned, vec <= K <= tile.flat_k_max) quantized into mQ
    (compact, aligned likewise), their dequant scales into mS; scale_ub read from mUB[0] when
    ``has_ub``."""
    threads, vec, chunks = tile.threads, tile.vec, tile.chunks
    rounds = chunks + 1
    span = threads * chunks * vec                  # E: the flat elements whose rows a CTA owns
    ub = mUB[0] if const_expr(has_ub) else None
    bounded = not has_ub
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    k = mQ.shape[1]
    k64 = Int64(k)
    total = Int64(mQ.shape[0]) * k64               # elements of the tensor (all rows)
    start = Int64(bidx) * Int64(span)
    first_row = (start + k64 - Int64(1)) // k64
    end_row = cutlass.min((start + Int64(span) + k64 - Int64(1)) // k64, Int64(rows))
    smem = cutlass.memory.SmemAllocator()
    part0 = smem.allocate_tensor(Float32, cute.make_layout(threads * rounds), byte_alignment=16)
    part1 = smem.allocate_tensor(Float32, cute.make_layout(threads * rounds), byte_alignment=16)
    scales = smem.allocate_tensor(Float32, cute.make_layout(threads * chunks + 1), byte_alignment=16)
    rcps = smem.allocate_tensor(Float32, cute.make_layout(threads * chunks + 1), byte_alignment=16)
    if first_row < end_row:                        # the same for every thread of the CTA
        head = first_row * k64
        base = head // Int64(vec) * Int64(vec)     # the span's first vector starts here
        lead = Int32(head - base)
        owned = Int32((end_row - first_row) * k64)
        nvec = (lead + owned + (vec - 1)) // vec
        # vectors wholly inside the tensor; the one after them (if any) is its partial last
        whole = Int32(cutlass.min(Int64(nvec), (total - base) // Int64(vec)))
        rest = Int32(cutlass.min(total - base - Int64(whole) * Int64(vec), Int64(vec)))
        srcs = tuple(_flat_view(t, base, vec, nvec, 16) for t in inputs)
        dst = _flat_view(mQ, base, vec, nvec, vec)
        frags = []
        for t in inputs:
            f = cute.make_rmem_tensor((vec, rounds), t.element_type)
            f.fill(0)
            frags.append(f)
        for s, f in zip(srcs, frags):
            atom = rw._atom(True, s.element_type, vec, rw.KEEP)
            for r in cutlass.range_constexpr(rounds):
                v = tidx + r * threads
                if v < whole:
                    cute.copy(atom, s[None, v], f[None, r])
                elif v < nvec:
                    for j in cutlass.range_constexpr(vec):
                        if j < rest:
                            f[j, r] = s[j, v]
        held = cute.make_rmem_tensor((vec, rounds), inputs[0].element_type)
        held.store(combine(*frags))

        # 1. each vector's absmax of its first row's elements and of the next row's
        for r in cutlass.range_constexpr(rounds):
            v = tidx + r * threads
            if v < nvec:
                lo, hi, row, split = _vector_rows(v, vec, lead, owned, k)
                m0, m1 = Float32(0.0), Float32(0.0)
                for j in cutlass.range_constexpr(vec):
                    x = held[j, r].to(Float32)
                    x = cute.arch.fmax(x, -x, nan=True)
                    live = cutlass.and_(j >= lo, j < hi)
                    m0 = Float32(cutlass.select_(cutlass.and_(live, j < split), rw.nan_max(m0, x), m0))
                    m1 = Float32(cutlass.select_(cutlass.and_(live, j >= split), rw.nan_max(m1, x), m1))
                part0[v] = m0
                part1[v] = m1
        cute.arch.barrier()

        # 2. a group of lanes per row: the row's absmax over its vectors' slots, its scale and
        # reciprocal (8 lanes a row for rows of up to 64 vectors, a warp for longer ones)
        nrows = Int32(end_row - first_row)
        if k <= 64 * vec:
            _row_scales(part0, part1, scales, rcps, mS, Int32(first_row), nrows, lead, k, vec, threads, 8, ub, eps,
                        fp8_max)
        else:
            _row_scales(part0, part1, scales, rcps, mS, Int32(first_row), nrows, lead, k, vec, threads, 32, ub, eps,
                        fp8_max)
        cute.arch.barrier()

        # 3. quantize each vector with its rows' scales, and store it
        for r in cutlass.range_constexpr(rounds):
            v = tidx + r * threads
            if v < nvec:
                lo, hi, row, split = _vector_rows(v, vec, lead, owned, k)
                if hi > lo:
                    nxt = cutlass.min(row + 1, nrows - 1)
                    s_row = cute.make_rmem_tensor((vec,), Float32)
                    r_row = cute.make_rmem_tensor((vec,), Float32)
                    s0, s1, r0, r1 = scales[row], scales[nxt], rcps[row], rcps[nxt]
                    for j in cutlass.range_constexpr(vec):
                        s_row[j] = Float32(cutlass.select_(j < split, s0, s1))
                        r_row[j] = Float32(cutlass.select_(j < split, r0, r1))
                    q = cute.make_rmem_tensor((vec,), mQ.element_type)
                    q.store(rw.fp8_quantize_values(held[None, r].load(), s_row.load(), r_row.load(), fp8_max,
                                                   mQ.element_type, bounded))
                    if cutlass.and_(lo == 0, hi == vec):
                        cute.copy(rw._atom(False, mQ.element_type, vec, rw.KEEP), q, dst[None, v])
                    else:
                        for j in cutlass.range_constexpr(vec):
                            if cutlass.and_(j >= lo, j < hi):
                                dst[j, v] = q[j]


@cute.jit
def _row_scales(part0, part1, scales, rcps, mS: cute.Tensor, first_row: Int32, nrows: Int32, lead: Int32, k: Int32,
                vec: cutlass.Constexpr[int], threads: cutlass.Constexpr[int], group: cutlass.Constexpr[int], ub,
                eps: cutlass.Constexpr[float], fp8_max: cutlass.Constexpr[float]):
    """Phase 2 of ``quantize_flat``: ``group`` lanes per row (rows strided over the CTA's groups)
    combine the row's vector slots, lane-strided then by shuffles; lane 0 of the group stores the
    row's scale (global) and its scale and reciprocal (shared, for phase 3)."""
    tidx, _, _ = cute.arch.thread_idx()
    lane = tidx % group
    per_warp = rw.WARP_SIZE // group               # rows a warp takes at once
    warp = tidx // rw.WARP_SIZE
    # whole warps step together (the shuffles need every lane of the warp), so a row index
    # past the CTA's rows takes part with no slots
    for first in cutlass.range(warp * per_warp, nrows, threads // group):
        row = first + (tidx % rw.WARP_SIZE) // group
        row_head = row * k + lead              # the row's first element in the span
        first_vec = row_head // vec
        last_vec = Int32(cutlass.select_(row < nrows, (row_head + k - 1) // vec, first_vec - 1))
        # the row's first vector holds an earlier row first (slot 1 is then this row's) unless
        # the row starts it; every later vector starts inside the row (K >= vec)
        shared_first = cutlass.and_(row_head % vec != 0, row > 0)
        amax = Float32(0.0)
        for v in cutlass.range(first_vec + lane, last_vec + 1, group):
            slot = part0[v]
            if cutlass.and_(v == first_vec, shared_first):
                slot = part1[v]
            amax = rw.nan_max(amax, slot)
        amax = cute.arch.warp_reduction(amax, rw.nan_max, threads_in_group=group)
        if cutlass.and_(lane == 0, row < nrows):
            scale, rcp = rw.fp8_row_scale(amax, eps, fp8_max, ub)
            scales[row] = scale
            rcps[row] = rcp
            mS[first_row + row] = scale


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
            atom = rw._atom(True, src.element_type, vec, rw.KEEP)
            for r in cutlass.range_constexpr(chunks):
                v = tidx + r * threads
                if v < whole:
                    cute.copy(atom, src[None, v], f[None, r])
                elif v < nvec:
                    for j in cutlass.range_constexpr(vec):
                        if j < rest:
                            f[j, r] = src[j, v]
        out = cute.make_rmem_tensor((vec, chunks), mO.element_type)
        out.store(combine(*frags))
        store = rw._atom(False, mO.element_type, vec, rw.KEEP)
        for r in cutlass.range_constexpr(chunks):
            v = tidx + r * threads
            if v < whole:
                cute.copy(store, out[None, r], dst[None, v])
            elif v < nvec:
                for j in cutlass.range_constexpr(vec):
                    if j < rest:
                        dst[j, v] = out[j, r]


@cute.jit
def flat_serves(tensors, k_min: cutlass.Constexpr[int], k_max: cutlass.Constexpr[int]):
    """Whether a flat tile serves a call (host side of the launch): rows of ``k_min`` to
    ``k_max`` elements, every [M, K] tensor compact (row stride K) and on a 16-byte boundary."""
    k = tensors[0].shape[1]
    misfits = Int32(k < k_min) + Int32(k > k_max)
    for t in tensors:
        misfits = misfits + Int32(Int64(t.stride[0]) != Int64(k)) + Int32(t.iterator.toint() % 16 != 0)
    return misfits == 0


def flat_launch(tile, rows, cols) -> dict:
    """Grid and block of a flat kernel over [rows, cols] tensors: one CTA per
    ``threads * chunks * vec`` elements of the flat array (the quantizers: per the rows that
    start in them)."""
    span = tile.threads * tile.chunks * tile.vec
    return {"grid": (Int32((Int64(rows) * Int64(cols) + Int64(span - 1)) // Int64(span)), 1, 1),
            "block": (tile.threads, 1, 1)}
