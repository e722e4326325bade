"""CuTe DSL device helpers for row-wise memory-bound kernels (elementwise maps, row reductions,
row-wise FP8 quantization) over compact row-major [M, K] tensors with dynamic M and K.

Imported only from a template's ``build()`` (it imports ``cutlass`` at module level). The tile
geometry (threads per row, vectors, chunks) is described in ``_rowwise_plan``; in short, row
``row`` of a CTA is handled by ``tpr`` consecutive threads, and lane ``l`` of the row touches the
row's vectors ``l, l + tpr, l + 2 tpr, ...`` so every warp instruction is one contiguous access.

Predication is per vector: with aligned rows K is a multiple of ``vec`` so a vector is either
wholly inside the row or wholly outside; unaligned rows use ``vec == 1``. Rows past the end of
the tensor get a vector count of 0, so they load and store nothing but still take part in
block-wide barriers.
"""

import dataclasses
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from mslk_dsl.templates import _rowwise_space as space
from mslk_dsl.templates._kernel_limits import VECTOR_BYTES

WARP_SIZE = 32

DSL_DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float32": cutlass.Float32,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
}

# L1 policy of the global loads, also of data read exactly once: with L1::no_allocate on the
# single-use loads, silu_mul took 266-272 us per GiB moved at hidden 2880-14336 on the H200
# against 250-252 us with the default policy (Liger's swiglu, plain loads: 250-251 us), and
# rmsnorm_add 276-281 against 263-266 us at 4000-14336.
KEEP = cute.nvgpu.CacheEvictionPriority.EVICT_NORMAL
# The FP8 row quantizers (``quantize_row``) take the policy of their single-use loads from the
# config (``l1``: "keep" = KEEP, "stream" = NO_ALLOCATE).
NO_ALLOCATE = cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE


def dsl_dtype(name: str):
    return DSL_DTYPES[name]


# ----------------------------------------------------------------------------------------------
# Compile-time stand-ins (fake tensors) with dynamic sizes.


def dynamic_rows_cols(k_divisibility: int = 1):
    """Symbolic (M, K): any M, K a multiple of ``k_divisibility`` (promised by the signature)."""
    return cute.sym_int(), cute.sym_int(divisibility=k_divisibility)


def fake_rows(dtype, m, k, align_bytes: int):
    """A compact row-major [m, k] tensor. The row stride is a 64-bit symbol (offsets of large
    tensors do not overflow) that inherits k's divisibility, so a row of an aligned tensor keeps
    its 16-byte alignment and its vector accesses stay 128-bit."""
    return make_fake_compact_tensor(dtype, (m, k), stride_order=(1, 0), assumed_align=align_bytes)


def fake_vector(dtype, n, align_bytes: int = 4):
    """A 1-D tensor of ``n`` (int or symbol) elements, e.g. per-row scales or a [1] scalar."""
    return make_fake_compact_tensor(dtype, (n,), assumed_align=align_bytes)


def row_alignment(sig):
    """(elements every row length is a multiple of, bytes every row of the row dtype starts on)
    for the signature's ``vec_bytes``: one vector of the narrowest access the rows admit."""
    from mslk_dsl.templates._kernel_limits import vector_elems

    return vector_elems(sig), sig["vec_bytes"]


def fake_quantize_args(dtype, fp8_dtype, n_inputs: int, sig):
    """Stand-ins for ``(*inputs, scale_ub, xq, scale, stream)`` of the row-wise FP8 quantizers:
    inputs and xq [M, K] (K a multiple of the signature's vector, each row of the inputs and of
    xq starting on one), scale_ub [1] and scale [M] fp32."""
    v, align = row_alignment(sig)
    m, k = dynamic_rows_cols(v)
    inputs = [fake_rows(dtype, m, k, align) for _ in range(n_inputs)]
    return inputs + [fake_vector(cutlass.Float32, 1), fake_rows(fp8_dtype, m, k, v),
                     fake_vector(cutlass.Float32, m), env_stream()]


def quantize_setup(template: str, config, target: str, sig, arrays: int):
    """What the row-wise FP8 quantizers (quantize_fp8_row, silu_mul_quant) build alike: the
    checked tile, the target's FP8 format, and the input and FP8 DSL dtypes."""
    from mslk_dsl.targets import get_target
    from mslk_dsl.templates import _rowwise_plan as plan

    tile = plan.check(template, config, sig, arrays)
    fp8 = get_target(target)
    return tile, fp8, dsl_dtype(sig["dtype"]), dsl_dtype(fp8.fp8_dtype_name)


def fake_count():
    """Stand-in for a [1] int32 row count (MSLK's valid_token_count)."""
    return fake_vector(cutlass.Int32, 1)


def env_stream():
    """The launch stream: the caller's current torch stream (TVM-FFI environment stream)."""
    return make_fake_stream(use_tvm_ffi_env_stream=True)


def launch_hints(tile, regs_per_thread: int = 64) -> dict:
    """Launch keywords that cap registers at ``regs_per_thread`` (``.minnctapersm``): left alone,
    ptxas spends registers on hoisting every conversion of a tile, which halves the CTAs per SM
    that keep loads in flight. (The carveout hint is the driver default; giving one keeps the
    compile from querying a device for the SM's shared memory size.)"""
    return {"min_blocks_per_mp": max(1, 65536 // (tile.threads * regs_per_thread)),
            "preferred_smem_carveout": -1}


def row_launch(tile, rows) -> dict:
    """Grid, block and cluster of a row-wise kernel over ``rows`` rows: one CTA per
    ``rows_per_block`` rows, or ``tile.cluster`` CTAs (one cluster) per row."""
    launch = {"grid": (cute.ceil_div(rows, tile.rows_per_block) * tile.cluster, 1, 1),
              "block": (tile.threads, 1, 1)}
    if tile.cluster > 1:
        launch["cluster"] = (tile.cluster, 1, 1)
    return launch


# ----------------------------------------------------------------------------------------------
# Thread geometry, row views, predicated vector copies.


def thread_row(tile):
    """(row of this thread's group inside the CTA, lane inside the group)."""
    tidx, _, _ = cute.arch.thread_idx()
    return tidx // tile.tpr, tidx % tile.tpr


@cute.jit
def cluster_row(tile: cutlass.Constexpr, m: Int32, k: Int32):
    """(row, base, end) of this CTA in a clustered tile (``tile.cluster`` CTAs per row, the
    grid's x being rows * cluster): CTA rank r of row ``row`` holds the row's vectors
    [base, end) = [r * share, min((r + 1) * share, k // vec)), share = ceil(vectors / cluster).
    A row past ``m`` gets end = base: nothing read or written, the barriers still taken."""
    bidx, _, _ = cute.arch.block_idx()
    rank = bidx % tile.cluster
    row = bidx // tile.cluster
    total = k // tile.vec
    share = cute.ceil_div(total, tile.cluster)
    base = rank * share
    end = cutlass.min(base + share, total)
    if row >= m:
        end = base
    return row, base, end


@cute.jit
def cta_row(tile: cutlass.Constexpr, m: Int32, k: Int32):
    """(row, row_in_cta, lane, nvec) of this thread: its row of the tensor, its group in the CTA,
    its lane in the group and the row's vector count (0 for a row past ``m``)."""
    row_in_cta, lane = thread_row(tile)
    bidx, _, _ = cute.arch.block_idx()
    row = bidx * tile.rows_per_block + row_in_cta
    nvec = k // tile.vec
    if row >= m:
        nvec = 0
    return row, row_in_cta, lane, nvec


def rows_to_write(t: cute.Tensor, mCount: cute.Tensor):
    """The rows of ``t`` a kernel computes: the first min(rows, mCount[0]) (MSLK's
    valid_token_count; the rest are neither read nor written)."""
    return cutlass.min(t.shape[0], cutlass.max(mCount[0], Int32(0)))


def row_vectors(t: cute.Tensor, row, vec: int) -> cute.Tensor:
    """Row ``row`` of a row-major [M, K] tensor as ``vec``-element vectors: ``v[None, j]`` is
    elements ``[j*vec, (j+1)*vec)``. The row offset is computed with the 64-bit stride."""
    return cute.zipped_divide(t[row, None], (vec,))


def _atom(load: bool, dtype, vec: int, evict):
    """A ``vec``-element global access; the compile fails (rather than silently splitting the
    access) if the alignment the layout proves is smaller than the access."""
    op = cute.nvgpu.CopyG2ROp() if load else cute.nvgpu.CopyR2GOp()
    return cute.make_copy_atom(op, dtype, num_bits_per_copy=vec * dtype.width, l1c_evict_priority=evict)


def weight_atom(dtype, vec: int):
    """A ``vec``-element global load of a per-column operand read by every row (a norm's weight):
    kept in L1 (see ``_atom``)."""
    return _atom(True, dtype, vec, KEEP)


@cute.jit
def copy_vectors(src: cute.Tensor, dst: cute.Tensor, first: Int32, step: cutlass.Constexpr[int],
                 count: Int32, load: cutlass.Constexpr[bool], evict: cutlass.Constexpr = KEEP):
    """Predicated vector copies between a ``row_vectors`` view and a register tile (vec, n). A
    load sets dst[:, i] <- vector ``first + i*step`` of ``src``, a store sets vector
    ``first + i*step`` of ``dst`` <- src[:, i], for every i whose vector index is below
    ``count``; the other columns are left as they are. ``evict`` applies to loads; stores keep
    their lines."""
    regs, view = (dst, src) if const_expr(load) else (src, dst)
    vec = cute.size(regs, mode=[0])
    # A vector wider than 16 bytes (an fp32 row beside a 16-bit one: 8 values, 32 bytes) moves
    # as ``parts`` 16-byte accesses, the widest a thread has.
    parts = max(1, vec * view.element_type.width // (8 * VECTOR_BYTES))
    atom = _atom(load, view.element_type, vec // parts, evict if const_expr(load) else KEEP)
    for i in cutlass.range_constexpr(cute.size(regs, mode=[1])):
        j = first + i * step
        if j < count:
            if const_expr(parts == 1):
                if const_expr(load):
                    cute.copy(atom, src[None, j], dst[None, i])
                else:
                    cute.copy(atom, src[None, i], dst[None, j])
            else:
                s, d = (src[None, j], dst[None, i]) if const_expr(load) else (src[None, i], dst[None, j])
                s, d = cute.zipped_divide(s, (vec // parts,)), cute.zipped_divide(d, (vec // parts,))
                for p in cutlass.range_constexpr(parts):
                    cute.copy(atom, s[None, p], d[None, p])


def tile_fragments(tile, dtypes):
    """Zero-filled register tiles (vec, chunks), one per dtype. The zeros make the lanes of a
    partial tile neutral for max/sum reductions, and in a loop they keep the predicated loads
    from carrying the previous iteration's values (which would force the tile into local
    memory)."""
    frags = []
    for dt in dtypes:
        f = cute.make_rmem_tensor((tile.vec, tile.chunks), dt)
        f.fill(0)
        frags.append(f)
    return frags


@cute.jit
def store_tile(values, dst: cute.Tensor, first: Int32, step: cutlass.Constexpr[int], count: Int32):
    """A ``copy_vectors`` store of a tile's values (a TensorSSA of shape (vec, chunks))."""
    frag = cute.make_rmem_tensor(values.shape, dst.element_type)
    frag.store(values)
    copy_vectors(frag, dst, first, step, count, load=False)


@cute.jit
def load_tile(srcs, frags, first: Int32, step: cutlass.Constexpr[int], count: Int32,
              evict: cutlass.Constexpr = KEEP):
    """``copy_vectors`` loads for several same-shaped inputs; every load is issued before any use."""
    for s, f in zip(srcs, frags):
        copy_vectors(s, f, first, step, count, load=True, evict=evict)


# ----------------------------------------------------------------------------------------------
# Phased rows: one-element rows with an aligned middle.
#
# A row of an odd number of 16-bit elements admits one element per access as a whole, but from
# its first 16-byte boundary on it is plain 128-bit vectors: a head of fewer than 8 elements, a
# middle of whole vectors, a tail of fewer than 8. When every [M, K] tensor of a call sits at the
# same offset from such a boundary ("congruent": same row length, bases equal modulo 16 bytes in
# elements; e.g. a strided input beside a fresh output is not), every row of every tensor splits
# at the same columns, and the one-element kernels run the middle as the vector kernels do and
# only the edges one element at a time (``plan.phased_tile``; ``edge_slots`` per lane). The
# test is made once per launch, on the host side, on the base addresses (``launch_rows``), which
# then launches one of two kernels: the phased one, or the one-element one for a call that is not
# congruent. A kernel holding both paths took the registers of the larger (the one-element
# path's addresses and predicates): 110 against 58 per thread for rmsnorm's 512 x 32 tile, one
# CTA per SM where the phased path alone fits two.


def _phase(t: cute.Tensor, row, vec: int) -> Int32:
    """Elements from the start of row ``row`` of ``t`` to the first address a ``vec``-element
    vector of ``t`` may start on (at most 16 bytes of alignment)."""
    return Int32(space.phase_of(t[row, None].iterator.toint(), vec, t.element_type.width // 8))


def congruent(tensors, vec: int):
    """Whether the [M, K] ``tensors`` (one row length) start at one phase (see above): then
    every row of each shares it. A dynamic Boolean, computed on the host side of the launch
    (``launch_rows``) from the base addresses, the phases counted in elements. A tensor whose
    vectors align on fewer elements than the first's (an fp32 residual beside 16-bit x) matches
    the first's phase modulo its own (``_rowwise_space.congruent_phases``, shared with the
    FlyDSL kernels)."""
    first = _phase(tensors[0], 0, vec)
    first_bytes = tensors[0].element_type.width // 8
    mismatches = Int32(0)
    for t in tensors[1:]:
        same = space.congruent_phases(first, first_bytes, _phase(t, 0, vec), t.element_type.width // 8, vec)
        mismatches = mismatches + Int32(1) - Int32(same)
    return mismatches == 0


@dataclass(frozen=True)   # frozen: the DSL passes it into dynamic ifs and loops as a read-only value
class PhasedRow:
    """Row ``row`` of congruent [M, k] tensors as a head of ``head`` elements, ``nmid`` aligned
    ``vec``-element vectors and a tail; ``nedge`` = head + tail elements, at most 2 (vec - 1).
    Made by ``phased_row``."""
    row: Int32
    vec: int
    head: Int32
    nmid: Int32
    nedge: Int32

    def middle(self, t: cute.Tensor) -> cute.Tensor:
        """The row's aligned vectors in ``t`` as a ``row_vectors`` view: ``v[None, j]`` is elements
        [head + j*vec, head + (j+1)*vec), on a pointer whose alignment the vector accesses see."""
        start = (t[self.row, None].iterator + self.head).toint()
        esize = t.element_type.width // 8
        ptr = cute.make_ptr(t.element_type, start, cute.AddressSpace.gmem, assumed_align=min(self.vec * esize, 16))
        return cute.make_tensor(ptr, cute.make_layout((self.vec, self.nmid), stride=(1, self.vec)))

    def elements(self, t: cute.Tensor) -> cute.Tensor:
        """The row of ``t`` one element per vector (for the edges)."""
        return row_vectors(t, self.row, 1)


def phased_row(first: cute.Tensor, row, k, vec: int, live) -> PhasedRow:
    """Row ``row`` of the congruent tensors whose first is ``first``, rows of ``k`` elements;
    ``live`` False (a row past the end) gives no vectors and no edges."""
    head = cutlass.min(_phase(first, row, vec), k)
    nmid = (k - head) // vec
    live = Int32(live)
    return PhasedRow(row, vec, head, nmid * live, (k - nmid * vec) * live)


def phased_vec(tile, elem_bytes: int):
    """The vector width of ``tile``'s phased rows where its kernels take them (one element per
    access, a single CTA per row), else None."""
    from mslk_dsl.templates import _rowwise_plan as plan

    if tile.vec != 1 or tile.cluster != 1:
        return None
    return plan.phased_tile(tile, elem_bytes).vec


@cute.jit
def launch_rows(rows, vec: cutlass.Constexpr, plain: cutlass.Constexpr, phased: cutlass.Constexpr, args,
                launch: cutlass.Constexpr, plain_launch: cutlass.Constexpr = None):
    """Host side of a row-wise launch: ``phased(*args)`` where ``vec`` is not None and the [M, K]
    ``rows`` tensors are congruent, else ``plain(*args)``, each launched with ``launch`` (the
    plain kernel with ``plain_launch`` where given: a tile of its own, e.g. ``plan.plain_tile``)."""
    if const_expr(plain_launch is None):
        plain_launch = launch
    if const_expr(vec is None):
        plain(*args).launch(**plain_launch)
    else:
        if congruent(rows, vec):
            phased(*args).launch(**launch)
        else:
            plain(*args).launch(**plain_launch)


def select_word(cond, a, b):
    """``_word_shift.shifted_words``' select, on 32-bit words."""
    return Int32(cutlass.select_(cond, a, b))


def funnel_right(lo, hi, bits):
    """``_word_shift.shifted_words``' funnel shift: the low word of (hi:lo) >> bits (PTX shf.r:
    its first operand is the low word)."""
    return cute.arch.shf(lo, hi, bits, "r")


def edge_fragments(tile, dtypes):
    """Zero-filled register tiles (1, edge_slots) for the edges of a row, one per dtype."""
    from mslk_dsl.templates import _rowwise_plan as plan

    frags = []
    for dt in dtypes:
        f = cute.make_rmem_tensor((1, plan.edge_slots(tile)), dt)
        f.fill(0)
        frags.append(f)
    return frags


@cute.jit
def copy_edges(src: cute.Tensor, dst: cute.Tensor, pr: PhasedRow, lane: Int32, tpr: cutlass.Constexpr[int],
               load: cutlass.Constexpr[bool], evict: cutlass.Constexpr = KEEP):
    """One-element copies between an ``elements`` view and a (1, slots) register tile: slot s of
    lane l is edge e = l + s*tpr, column e of the row in the head (e < head), else column
    e + nmid*vec in the tail; edges past ``nedge`` are left alone."""
    regs, view = (dst, src) if const_expr(load) else (src, dst)
    atom = _atom(load, view.element_type, 1, evict if const_expr(load) else KEEP)
    for s in cutlass.range_constexpr(cute.size(regs, mode=[1])):
        e = lane + s * tpr
        if e < pr.nedge:
            col = e
            if e >= pr.head:
                col = e + pr.nmid * pr.vec
            if const_expr(load):
                cute.copy(atom, src[None, col], dst[None, s])
            else:
                cute.copy(atom, src[None, s], dst[None, col])


@cute.jit
def store_edges(values, dst: cute.Tensor, pr: PhasedRow, lane: Int32, tpr: cutlass.Constexpr[int]):
    """A ``copy_edges`` store of the edges' values (a TensorSSA of shape (1, slots))."""
    frag = cute.make_rmem_tensor(values.shape, dst.element_type)
    frag.store(values)
    copy_edges(frag, dst, pr, lane, tpr, load=False)


@cute.jit
def map_row_phased(tensors, combine: cutlass.Constexpr, out: cute.Tensor, tile: cutlass.Constexpr,
                   pr: PhasedRow, lane: Int32, first_tile: Int32, tile_step: Int32):
    """``map_row`` of a phased row (``tile`` the phased tile): the middle over tiles
    first_tile, first_tile + tile_step, ...; the edges by the CTAs of the first tile, their
    loads issued ahead of the middle's so that both are in flight at once (a CTA of one tile
    would otherwise wait for memory twice)."""
    ins = edge_fragments(tile, [t.element_type for t in tensors])
    if first_tile == 0:
        for t, f in zip(tensors, ins):
            copy_edges(pr.elements(t), f, pr, lane, tile.tpr, load=True)
    map_row(tuple(pr.middle(t) for t in tensors), combine, pr.middle(out), tile, lane, pr.nmid, first_tile,
            tile_step)
    if first_tile == 0:
        store_edges(combine(*ins), pr.elements(out), pr, lane, tile.tpr)


# ----------------------------------------------------------------------------------------------
# Reductions.


def tree_reduce(vals, op):
    """Pairwise reduction of a Python list of scalars (a log-depth dependency chain)."""
    vals = list(vals)
    while len(vals) > 1:
        vals = [op(vals[i], vals[i + 1]) if i + 1 < len(vals) else vals[i] for i in range(0, len(vals), 2)]
    return vals[0]


def absmax(values, init):
    """max(init, max |values|) of a tile's values (a TensorSSA), as fp32. NaN propagates (as
    torch's amax). Computed on the bit patterns: with the sign bit cleared, the integer order of
    IEEE floats is their magnitude order, and every NaN is above inf. Staying out of the float
    domain also keeps the compiler from converting the whole resident tile to fp32 ahead of the
    row reduction (twice the registers held across the barrier)."""
    int_type = {16: cutlass.Int16, 32: cutlass.Int32}[values.dtype.width]
    bits = values.bitcast(int_type)
    mags = cute.make_rmem_tensor(bits.shape, int_type)
    mags.store(bits & cute.full_like(bits, (1 << (values.dtype.width - 1)) - 1))
    m = tree_reduce([mags[i] for i in range(cute.size(mags))], cutlass.max)
    return cute.arch.fmax(init, int_type(m).bitcast(values.dtype).to(Float32), nan=True)


def nan_max(a, b):
    """fp32 max that propagates NaN (a NaN in a row makes its absmax NaN everywhere)."""
    return cute.arch.fmax(a, b, nan=True)


def reduction_buffer(smem, tile):
    """Shared-memory slots (warps_per_row, rows_per_block) for the per-warp partials of every row
    of the CTA; None when a row's group fits in one warp (the shuffles are then enough)."""
    if tile.tpr <= WARP_SIZE:
        return None
    return smem.allocate_tensor(Float32, cute.make_layout((tile.warps_per_row, tile.rows_per_block)),
                                byte_alignment=16)


@cute.jit
def row_allreduce(val: Float32, op: cutlass.Constexpr, tpr: cutlass.Constexpr[int], buf,
                  row_in_cta: Int32, lane: Int32) -> Float32:
    """Reduce ``val`` over the ``tpr`` threads of a row; all of them get the same bits (a fixed
    combination order). Groups wider than a warp meet in ``buf`` behind one CTA-wide barrier,
    so every thread of the CTA must call this exactly as often."""
    val = cute.arch.warp_reduction(val, op, threads_in_group=min(tpr, WARP_SIZE))
    if const_expr(tpr > WARP_SIZE):
        if lane % WARP_SIZE == 0:
            buf[lane // WARP_SIZE, row_in_cta] = val
        cute.arch.barrier()
        val = buf[0, row_in_cta]
        for w in cutlass.range_constexpr(1, tpr // WARP_SIZE):
            val = op(val, buf[w, row_in_cta])
    return val


# ----------------------------------------------------------------------------------------------
# Elementwise math.

LOG2E = 1.4426950408889634


def silu_mul_tile(a: cute.Tensor, b: cute.Tensor, out_dtype):
    """silu(a) * b for two register tiles: fp32 math with the fast exp2 and reciprocal units (a
    few fp32 ulps; ample for results rounded to bf16/fp16), rounded to ``out_dtype``. Returns a
    TensorSSA. Both silu_mul and silu_mul_quant call this, so their values are the same bits."""
    x = a.load().to(Float32)
    d = cute.make_rmem_tensor(a.layout, Float32)
    d.store(cute.math.exp2(x * Float32(-LOG2E), fastmath=True) + Float32(1.0))
    for i in range(cute.size(d)):  # rcp.approx.ftz: 1 + exp2(.) is never a denormal
        d[i] = cute.arch.rcp_approx(d[i])
    return (x * d.load() * b.load().to(Float32)).to(out_dtype)


# Row-wise FP8 scaling with the arithmetic of MSLK's Triton ``quantize_fp8_row``:
#
#     amax  = clamp(max|x|, eps, scale_ub)                 (no upper clamp without scale_ub)
#     scale = amax / fp8_max                               (IEEE division; the stored dequant scale)
#     xq    = fp8(clamp(x / scale, -fp8_max, fp8_max))     (fp8 rounding: nearest even)
#
# ``x / scale`` is evaluated without a division per element: with ``rcp`` the reciprocal of
# ``scale`` refined by one Newton step, ``q = x * rcp`` followed by one exact-residual correction
# ``q - (q * scale - x) * rcp`` is the correctly rounded quotient. It is the fast path of the
# hardware's IEEE fp32 division (MUFU.RCP, two FFMA, then the same three steps), with the
# reciprocal hoisted out of the row; its slow path only matters for denormal quotients, which
# round to an fp8 zero anyway. The residual is taken as ``q * scale - x`` so that x = -0 gives
# -0. Without scale_ub |x| <= amax, so |q| <= fp8_max (1 + 2^-23); with scale_ub the quotient can
# be huge, so ``q`` is clamped to +-2 fp8_max before the correction (keeps it finite: no inf - inf)
# and the result still saturates. The final clamp to +-fp8_max is the conversion's own
# saturation (cvt.rn.satfinite: out-of-range values become +-fp8_max, as clamp-then-convert).


def fp8_row_scale(amax, eps: float, fp8_max: float, scale_ub=None):
    """(scale, rcp) of a row from its absmax: the dequant scale and its refined reciprocal."""
    amax = cute.arch.fmax(amax, Float32(eps), nan=True)
    if scale_ub is not None:
        amax = cute.arch.fmin(amax, scale_ub, nan=True)
    scale = amax / Float32(fp8_max)
    y0 = cute.arch.rcp_approx(scale)
    return scale, cute.math.fma(y0, cute.math.fma(-scale, y0, Float32(1.0)), y0)


def fp8_quantize_tile(values, scale, rcp, fp8_max: float, fp8_dtype, bounded: bool):
    """fp8(clamp(values / scale, -fp8_max, fp8_max)) of a tile's values (a TensorSSA), the
    quotient correctly rounded (see above); a TensorSSA (packed conversions). ``bounded``: every
    |value| <= the row's amax (no scale_ub), so the quotient needs no pre-clamp."""
    x = values.to(Float32)
    s, r = cute.full_like(x, scale), cute.full_like(x, rcp)
    q = x * r
    if not bounded:
        c = cute.full_like(x, 2.0 * fp8_max)
        q = cute.math.max(cute.math.min(q, c, propagate_nan=True), -c, propagate_nan=True)
    q = cute.math.fma(-cute.math.fma(q, s, -x), r, q)
    return q.to(fp8_dtype)


# ----------------------------------------------------------------------------------------------
# Row drivers: the loop structure shared by the templates; ``combine`` maps the register tiles
# of the inputs to the values of the row (plain elementwise code, no control flow).


@cute.jit
def map_row(srcs, combine: cutlass.Constexpr, dst: cute.Tensor, tile: cutlass.Constexpr, lane: Int32,
            nvec: Int32, first_tile: Int32, tile_step: Int32):
    """dst = combine(*srcs) over tiles first_tile, first_tile + tile_step, ... of one row."""
    for t in cutlass.range(first_tile, cute.ceil_div(nvec, tile.tile_vecs), tile_step):
        first = t * tile.tile_vecs + lane
        ins = tile_fragments(tile, [s.element_type for s in srcs])
        load_tile(srcs, ins, first, tile.tpr, nvec)
        store_tile(combine(*ins), dst, first, tile.tpr, nvec)


def stage_buffers(smem, tile, dtypes):
    """Shared memory of a staged tile (``tile.staged``), one tensor per input dtype: (vec, threads,
    chunks), chunk c of thread t at [:, t, c], so a warp's vectors of one chunk are contiguous
    (16-byte accesses without bank conflicts)."""
    layout = cute.make_layout((tile.vec, tile.threads, tile.chunks), stride=(1, tile.vec, tile.vec * tile.threads))
    return tuple(smem.allocate_tensor(dt, layout, byte_alignment=16) for dt in dtypes)


@cute.jit
def stage_tile(srcs, bufs, first: Int32, step: cutlass.Constexpr[int], count: Int32, slot: Int32,
               stream: cutlass.Constexpr[bool]):
    """cp.async of vectors first + c*step (every chunk c whose vector is below ``count``) of each
    ``row_vectors`` view in ``srcs`` into slot [:, slot, c] of its buffer (``stage_buffers``), as
    one commit group. ``stream``: 16-byte copies bypass L1 (cp.async.cg, the single-use loads'
    "stream" policy); narrower ones cannot and keep the default."""
    from cutlass.cute.nvgpu import cpasync

    for src, buf in zip(srcs, bufs):
        bits = cute.size(buf, mode=[0]) * src.element_type.width
        mode = cpasync.LoadCacheMode.GLOBAL if const_expr(stream and bits == 128) else cpasync.LoadCacheMode.ALWAYS
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=mode), src.element_type, num_bits_per_copy=bits)
        for c in cutlass.range_constexpr(cute.size(buf, mode=[2])):
            j = first + c * step
            if j < count:
                cute.copy(atom, src[None, j], buf[None, slot, c])
    cute.arch.cp_async_commit_group()


@cute.jit
def staged_absmax(combine: cutlass.Constexpr, bufs, first: Int32, step: cutlass.Constexpr[int], count: Int32,
                  slot: Int32, amax: Float32) -> Float32:
    """Pass 1 over a staged tile (its copies waited for): the row values combine(*inputs) of each
    chunk, their absmax folded into ``amax``, written over the first input's slot (the values
    have its dtype) for pass 2. One chunk at a time, so no register holds more than a vector."""
    for c in cutlass.range_constexpr(cute.size(bufs[0], mode=[2])):
        j = first + c * step
        ins = []
        for buf in bufs:
            f = cute.make_rmem_tensor((cute.size(buf, mode=[0]), 1), buf.element_type)
            f.fill(0)   # a vector past the row stays neutral for the absmax
            if j < count:
                f[None, 0].store(buf[None, slot, c].load())
            ins.append(f)
        vals = cute.make_rmem_tensor(ins[0].layout, bufs[0].element_type)
        vals.store(combine(*ins))
        amax = absmax(vals.load(), amax)
        if j < count:
            bufs[0][None, slot, c].store(vals[None, 0].load())
    return amax


@cute.jit
def quantize_row(srcs, combine: cutlass.Constexpr, dst: cute.Tensor, tile: cutlass.Constexpr, lane: Int32,
                 nvec: Int32, row_in_cta: Int32, buf, scale_ub, eps: cutlass.Constexpr[float],
                 fp8_max: cutlass.Constexpr[float], base: Int32 = 0, cslots=None, edges=None,
                 bufs=None) -> Float32:
    """Row-wise FP8 quantization of the row values combine(*srcs) into ``dst``; returns the row's
    dequant scale (the same in every thread of the row).

    The CTA handles the row's vectors [base, nvec) (all of them unless the row is split over a
    cluster: then the absmax meets in ``cslots``, a ``ClusterSlots`` already started).
    The first tile of that range stays on chip from the absmax pass to the quantize pass, so a
    row of up to ``tile.row_k`` elements is read from DRAM once: in registers, or for a staged
    tile (``tile.staged``; one row per CTA, ``lane`` its thread) in ``bufs`` (``stage_buffers``),
    loaded by cp.async. Longer rows stream the other vectors twice (absmax, then quantize); the
    second read mostly hits L2. Every thread of the CTA must call this (one barrier when a row
    spans several warps, a cluster reduction when it spans several CTAs). ``edges`` (a phased
    row: ``srcs`` and ``dst`` are its middle): (the inputs' and dst's ``elements`` views, the
    PhasedRow); the edges are read with the first tile and stay in registers."""
    tpr, tv = tile.tpr, tile.tile_vecs
    once = NO_ALLOCATE if const_expr(tile.l1 == "stream") else KEEP   # L1 policy of single-use loads
    bounded = scale_ub is None
    dtypes = [s.element_type for s in srcs]
    if const_expr(tile.staged):
        stage_tile(srcs, bufs, base + lane, tpr, nvec, lane, tile.l1 == "stream")
    else:
        ins = tile_fragments(tile, dtypes)
        load_tile(srcs, ins, base + lane, tpr, nvec, once)
    if const_expr(edges is not None):
        edge_srcs, edge_dst, pr = edges
        edge_ins = edge_fragments(tile, dtypes)
        for s, f in zip(edge_srcs, edge_ins):
            copy_edges(s, f, pr, lane, tpr, load=True, evict=once)
    if const_expr(tile.staged):
        cute.arch.cp_async_wait_group(0)
        amax = staged_absmax(combine, bufs, base + lane, tpr, nvec, lane, Float32(0.0))
    else:
        held = combine(*ins)  # an SSA value: lives in registers until the quantize pass
        amax = absmax(held, Float32(0.0))
    if const_expr(edges is not None):
        edge_held = combine(*edge_ins)
        amax = absmax(edge_held, amax)

    # The rest of a longer row: a tile at a time, or one vector per thread after a staged tile
    # (whose chunks are shared memory, not registers).
    rest = dataclasses.replace(tile, chunks=1, stage="registers")
    ntiles = cute.ceil_div(nvec - base, tv)
    if const_expr(tile.staged):
        for j in cutlass.range(base + tv + lane, nvec, tpr):
            part = tile_fragments(rest, dtypes)
            load_tile(srcs, part, j, tpr, nvec, KEEP)
            amax = absmax(combine(*part), amax)
    else:
        for t in cutlass.range(1, ntiles):
            part = tile_fragments(tile, dtypes)
            load_tile(srcs, part, base + t * tv + lane, tpr, nvec, KEEP)
            amax = absmax(combine(*part), amax)

    if const_expr(tile.cluster > 1):
        amax = cluster_row_allreduce(amax, nan_max, 0.0, cslots)
    else:
        amax = row_allreduce(amax, nan_max, tpr, buf, row_in_cta, lane)
    scale, rcp = fp8_row_scale(amax, eps, fp8_max, scale_ub)
    if const_expr(tile.staged):
        # a vector past the row quantizes stale shared memory; its store is predicated off
        for c in cutlass.range_constexpr(tile.chunks):
            staged_q = cute.make_rmem_tensor((tile.vec, 1), dst.element_type)
            staged_q[None, 0].store(fp8_quantize_tile(bufs[0][None, lane, c].load(), scale, rcp, fp8_max,
                                                      dst.element_type, bounded))
            copy_vectors(staged_q, dst, base + lane + c * tpr, tpr, nvec, load=False)
    else:
        store_tile(fp8_quantize_tile(held, scale, rcp, fp8_max, dst.element_type, bounded), dst, base + lane, tpr,
                   nvec)
    if const_expr(edges is not None):
        store_edges(fp8_quantize_tile(edge_held, scale, rcp, fp8_max, dst.element_type, bounded), edge_dst, pr,
                    lane, tpr)
    if const_expr(tile.staged):
        for j in cutlass.range(base + tv + lane, nvec, tpr):
            part = tile_fragments(rest, dtypes)
            load_tile(srcs, part, j, tpr, nvec, once)
            store_tile(fp8_quantize_tile(combine(*part), scale, rcp, fp8_max, dst.element_type, bounded), dst, j,
                       tpr, nvec)
    else:
        for t in cutlass.range(1, ntiles):
            part = tile_fragments(tile, dtypes)
            load_tile(srcs, part, base + t * tv + lane, tpr, nvec, once)
            q = fp8_quantize_tile(combine(*part), scale, rcp, fp8_max, dst.element_type, bounded)
            store_tile(q, dst, base + t * tv + lane, tpr, nvec)
    return scale


# ----------------------------------------------------------------------------------------------
# Row reductions over a thread-block cluster (a row split over ``tile.cluster`` CTAs).
#
# Each warp pushes its partial into a slot of every CTA of the cluster (st.async to distributed
# shared memory, counted by a transaction barrier of the receiving CTA); each CTA waits on its
# own barrier until every slot has landed, then combines the slots. No CTA reads another's shared
# memory, so none has to wait for the others before it exits: a CTA leaves as soon as its own
# rows are stored. (Reading the other CTAs' partials instead took a second cluster barrier before
# exit, which kept each CTA's slot on the SM until the slowest CTA of its cluster was done.) The
# barrier's initialization is published by a cluster arrive at the start, waited for right before
# the first push, so the wait overlaps the row's loads.


class ClusterSlots:
    """Shared memory of one CTA for a cluster row reduction: a slot per warp of the cluster's
    CTAs (warp w of CTA rank r at r * warps + w) and the transaction barrier counting them."""

    def __init__(self, smem, tile):
        self.tile = tile
        self.slots = smem.allocate_tensor(Float32, cute.make_layout(tile.warps_per_row * tile.cluster),
                                          byte_alignment=16)
        self.mbar = smem.allocate_array(cutlass.Int64, num_elems=1)


@cute.jit
def cluster_reduction_start(cs: ClusterSlots):
    """Initialize the CTA's transaction barrier and announce it to the cluster (the matching wait
    is in ``cluster_row_allreduce``). Every thread of the CTA calls this once, before its loads."""
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        cute.arch.mbarrier_init(cs.mbar, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.cluster_arrive_relaxed()


def store_remote_f32(val: Float32, slot_ptr, mbar_ptr, rank) -> None:
    """``*slot_ptr = val`` in the shared memory of the cluster's CTA ``rank``, credited (4 bytes)
    to that CTA's transaction barrier at ``mbar_ptr`` (st.async; the DSL has no op for it)."""
    slot = Int32(cute.arch.map_dsmem_ptr(slot_ptr, rank).toint())
    mbar = Int32(cute.arch.map_dsmem_ptr(mbar_ptr, rank).toint())
    cute.arch.inline_ptx("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [{$r0}], {$r1}, [{$r2}];",
                         read_only_args=[slot, val, mbar])


@cute.jit
def cluster_row_allreduce(val: Float32, op: cutlass.Constexpr, init: cutlass.Constexpr[float],
                          cs: ClusterSlots) -> Float32:
    """``op`` (sum, max) of ``val`` over every thread of the row's CTAs (one row per CTA); every
    thread of the cluster gets the same bits: the slots are combined in the same order
    everywhere (lane-strided, then a butterfly, whose pairs combine commutatively). ``init`` is
    the identity of ``op`` on these values (0 for a sum, and for a max of magnitudes). Every
    thread of the CTA calls this once, after ``cluster_reduction_start``."""
    tile = cs.tile
    nslots = tile.warps_per_row * tile.cluster
    tidx, _, _ = cute.arch.thread_idx()
    warp, lane = tidx // WARP_SIZE, tidx % WARP_SIZE
    val = cute.arch.warp_reduction(val, op, threads_in_group=WARP_SIZE)
    if tidx == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(cs.mbar, nslots * 4)
    cute.arch.cluster_wait()   # every CTA's barrier is initialized: the pushes may start
    if lane < tile.cluster:
        rank = cute.arch.block_idx_in_cluster()
        store_remote_f32(val, cs.slots.iterator + (rank * tile.warps_per_row + warp), cs.mbar, lane)
    cute.arch.mbarrier_wait(cs.mbar, 0)
    acc = Float32(init)
    for i in cutlass.range_constexpr(cute.ceil_div(nslots, WARP_SIZE)):
        if lane + i * WARP_SIZE < nslots:
            acc = op(acc, cs.slots[lane + i * WARP_SIZE])
    return cute.arch.warp_reduction(acc, op, threads_in_group=WARP_SIZE)


@cute.jit
def _quantize_vectors(inputs, combine: cutlass.Constexpr, mQ: cute.Tensor, mS: cute.Tensor, tile: cutlass.Constexpr,
                      row: Int32, row_in_cta: Int32, lane: Int32, nvec: Int32, buf, ub,
                      eps: cutlass.Constexpr[float], fp8_max: cutlass.Constexpr[float], bufs):
    """``quantize_row`` of this thread's row of a single-CTA tile, in the tile's own vectors."""
    srcs = tuple(row_vectors(t, row, tile.vec) for t in inputs)
    scale = quantize_row(srcs, combine, row_vectors(mQ, row, tile.vec), tile, lane, nvec, row_in_cta, buf,
                         ub, eps, fp8_max, bufs=bufs)
    if lane == 0 and nvec > 0:
        mS[row] = scale


@cute.jit
def quantize_rows(inputs, combine: cutlass.Constexpr, mUB: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor,
                  tile: cutlass.Constexpr, has_ub: cutlass.Constexpr, eps: cutlass.Constexpr[float],
                  fp8_max: cutlass.Constexpr[float], rows=None, phased: cutlass.Constexpr[bool] = False):
    """Kernel body of the row-wise FP8 quantizers: the CTA's rows of combine(*inputs) (inputs
    [M, K]) quantized into mQ, their dequant scales into mS; scale_ub read from mUB[0] when
    ``has_ub``. ``rows``: how many rows to compute (default all of mQ's); the others are
    neither read nor written. A clustered tile (``tile.cluster`` CTAs per row, the grid's x
    being rows * cluster) gives CTA rank r of a row the vectors [r * share, (r + 1) * share).
    ``phased``: the tensors are congruent one-element rows (``launch_rows``), run as a PhasedRow.
    A staged tile (``tile.staged``) holds its first tile in shared memory; a one-element one
    stages the phased middle, and runs its register tile (``plan.plain_tile``) otherwise."""
    from mslk_dsl.templates import _rowwise_plan as plan

    if const_expr(rows is None):
        rows = mQ.shape[0]
    ub = mUB[0] if const_expr(has_ub) else None
    smem = cutlass.memory.SmemAllocator()
    dtypes = [t.element_type for t in inputs]
    if const_expr(tile.cluster == 1):
        buf = reduction_buffer(smem, tile)
        row, row_in_cta, lane, nvec = cta_row(tile, rows, mQ.shape[1])
        if const_expr(phased):
            ptile = plan.phased_tile(tile, inputs[0].element_type.width // 8)
            bufs = stage_buffers(smem, ptile, dtypes) if const_expr(ptile.staged) else None
            pr = phased_row(inputs[0], row, mQ.shape[1], ptile.vec, nvec > 0)
            scale = quantize_row(tuple(pr.middle(t) for t in inputs), combine, pr.middle(mQ), ptile, lane,
                                 pr.nmid, row_in_cta, buf, ub, eps, fp8_max,
                                 edges=(tuple(pr.elements(t) for t in inputs), pr.elements(mQ), pr), bufs=bufs)
            if lane == 0 and nvec > 0:
                mS[row] = scale
        else:
            vtile = plan.plain_tile(tile)
            bufs = stage_buffers(smem, vtile, dtypes) if const_expr(vtile.staged) else None
            _quantize_vectors(inputs, combine, mQ, mS, vtile, row, row_in_cta, lane, nvec, buf, ub, eps, fp8_max,
                              bufs)
    else:
        cslots = ClusterSlots(smem, tile)
        cluster_reduction_start(cslots)
        lane, _, _ = cute.arch.thread_idx()
        row, base, end = cluster_row(tile, rows, mQ.shape[1])
        srcs = tuple(row_vectors(t, cutlass.min(row, mQ.shape[0] - 1), tile.vec) for t in inputs)
        scale = quantize_row(srcs, combine, row_vectors(mQ, cutlass.min(row, mQ.shape[0] - 1), tile.vec), tile,
                             lane, end, Int32(0), None, ub, eps, fp8_max, base, cslots)
        if lane == 0 and base == 0 and row < rows:
            mS[row] = scale
