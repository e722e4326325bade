"""FlyDSL device helpers for row-wise memory-bound kernels on CDNA (gfx942, gfx950; wave64).

A block is split into ``rows_per_block`` groups; each group owns one row of a [M, K] tensor (M
and K are dynamic). A group is whole waves, or for short rows 16 or 32 lanes of one (2-4 rows per
wave, so rows of a few hundred elements do not leave most lanes idle).

A row of a whole-wave group is reached through its own AMD buffer descriptor whose size is exactly
the row's bytes (zero for a row past M): loads past the end return zeros and stores past it are
dropped by the hardware, so K and M tails need no branches. The descriptor is built from the
row's 64-bit address, so tensors may exceed 4 GiB; only a row must fit in 2 GiB.

A descriptor must be wave-uniform (it lives in scalar registers; a per-lane one would make the
compiler loop over the lanes' values), so the rows of a wave's sub-wave groups share one,
starting at the wave's first row (see WaveRows). Each lane then bounds its own accesses: a
vector past its row's end or of a row past M gets an offset past the descriptor (zeros read,
stores dropped). Those rows are consecutive rows of one tensor, so sub-wave groups serve
row-wise ops, not gathers; the wave's rows must fit in 1 GiB (rows up to 256 MiB).

Row statistics (absmax here, sums for norms) reduce inside each wave with DPP and across the
waves of a group through one LDS slot per wave, so every lane of a group gets the same value.

FP8 follows the target: e4m3fnuz (max 240) on gfx942, e4m3fn (max 448) on gfx950, converted
with v_cvt_pk_fp8_f32 after an explicit clamp, matching torch's round-to-nearest-even casts;
the quantizer's arithmetic is that of MSLK's Triton quantize_fp8_row, bit for bit.
"""
import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import arith, const_expr, gpu, range_constexpr
from flydsl.expr import math as fmath
from flydsl.expr.typing import ReductionOp, T
from flydsl.expr.utils.arith import fastmath

from mslk_dsl.errors import ConfigError
from mslk_dsl.targets import get_target
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _rowwise_space as space

WAVE = space.WAVE
LOG2E = 1.4426950408889634
# A byte offset past the end of the row-scale descriptor (M * 4 bytes, for M < 2^28) that
# stays a positive i32 and cannot wrap around 2^32 when the access size is added.
OOB_BYTES = 1 << 30
# Floor of the row absmax before the FP8 scale is taken (MSLK's default eps for rowwise FP8).
FP8_EPS = 1.0 / 512.0

_ELEM = {
    "bfloat16": fx.BFloat16,
    "float16": fx.Float16,
    "float32": fx.Float32,
    "float8_e4m3fn": fx.Float8E4M3FN,
    "float8_e4m3fnuz": fx.Float8E4M3FNUZ,
}


def elem_type(dtype: str):
    """The FlyDSL numeric type of a torch dtype name ("bfloat16", "float8_e4m3fnuz", ...)."""
    return _ELEM[dtype]


class Fp8Format:
    """The target's FP8 flavour: torch dtype name, FlyDSL type, largest finite value, and
    whether it is the fnuz flavour (no negative zero: 0x80 is its only NaN)."""

    def __init__(self, target: str):
        t = get_target(target)
        self.dtype = t.fp8_dtype_name
        self.type = elem_type(self.dtype)
        self.max = t.fp8_max
        self.fnuz = t.fp8 == "e4m3fnuz"


class RowGroups:
    """Thread coordinates of a block of ``threads`` threads holding ``rows`` rows.

    Call inside a kernel. A group of whole waves: ``group`` (the block's row slot) is made
    wave-uniform with readfirstlane, so rows and their descriptors stay in scalar registers. A
    sub-wave group (``shared``: 16 or 32 lanes, several rows per wave): ``group`` differs
    between the lanes of a wave, and ``view`` gives the wave one descriptor over its rows."""

    def __init__(self, threads: int, rows: int):
        if not space.whole_groups({"threads": threads, "rows_per_block": rows}):
            raise ConfigError(f"FlyDSL row-wise config threads={threads}, rows_per_block={rows}: a row needs whole "
                              f"waves of {WAVE} or {' or '.join(map(str, space.SUBWAVE_WIDTHS))} lanes of one")
        self.threads = threads
        self.width = width = threads // rows  # threads per row
        self.shared = width < WAVE  # several rows per wave
        self.waves = max(1, width // WAVE)  # waves per row
        tid = fx.thread_idx.x
        self.wave = fx.Int32(fx.rocdl.readfirstlane(T.i32, tid // WAVE))
        self.group = tid // width if self.shared else self.wave // self.waves
        self.lane = tid % width

    def view(self, tensor, row, vec: int):
        """Row ``row`` of ``tensor`` as a bounds-checked view of ``vec``-element vectors for
        ``load`` / ``store``: the row's own descriptor (:func:`row_view`), or the wave's shared one
        (:class:`WaveRows`) in sub-wave groups."""
        return WaveRows(tensor, row, vec) if self.shared else row_view(tensor, row, vec)


def counted_row(row, tensor, count):
    """``row``, or past ``tensor``'s last row (a zero-size descriptor: nothing read or written)
    when row >= count[0] (MSLK's valid_token_count, a [1] int32 tensor). The count is made
    wave-uniform so that rows and descriptors stay in scalar registers."""
    rows, _ = tensor.shape.unpack()
    n = fx.Int32(fx.rocdl.readfirstlane(T.i32, fx.get_iter(count).load()))
    return (row < n).select(row, rows)


def row_view(tensor, row, vec: int):
    """Row ``row`` of a 2-D tensor (unit column stride) as a bounds-checked buffer view of
    ``vec``-element vectors: ``load(view, j, vec)`` reads columns [j*vec, j*vec + vec)."""
    rows, cols = tensor.shape.unpack()
    row_stride, _ = tensor.stride.unpack()
    elem_bytes = tensor.element_type.width // 8
    base = fx.get_iter(tensor) + fx.Int64(row) * fx.Int64(row_stride)
    nbytes = (row < rows).select(fx.Int64(cols) * elem_bytes, fx.Int64(0))
    buf = fx.rocdl.make_buffer_ptr(base, num_records_bytes=nbytes)
    return fx.logical_divide(fx.make_view(buf, fx.make_layout(cols, 1)), fx.make_layout(vec, 1))


class WaveRows:
    """The rows of a wave's sub-wave groups (consecutive rows of one [M, K] tensor, unit column
    stride) behind one buffer descriptor, for ``load`` / ``store``.

    The descriptor starts at the wave's first row (lane 0's ``row``: rows grow with the lane, and
    a row past M, also one past a valid_token_count, is given as M) and is OOB_BYTES long. Vector
    ``j`` of a lane's row is at (row - first) * stride + j * vec elements; a vector past the
    row's end, or any of a row at or past M, is sent to OOB_BYTES instead, past the descriptor:
    its load gives zeros, its store is dropped (so a lane never reads or writes its neighbour
    row's columns, nor anything past the tensor)."""

    def __init__(self, tensor, row, vec: int):
        rows, cols = tensor.shape.unpack()
        row_stride, _ = tensor.stride.unpack()
        elem_bytes = tensor.element_type.width // 8
        first = fx.Int32(fx.rocdl.readfirstlane(T.i32, row))
        base = fx.get_iter(tensor) + fx.Int64(first) * fx.Int64(row_stride)
        # Every lane bounds its own accesses (index), so the descriptor needs no bound of the
        # tensor's: its size is OOB_BYTES, which also spares the scalar registers of one.
        buf = fx.rocdl.make_buffer_ptr(base, num_records_bytes=fx.Int64(OOB_BYTES))
        self.vectors = fx.logical_divide(fx.make_view(buf, fx.make_layout(OOB_BYTES // elem_bytes, 1)),
                                         fx.make_layout(vec, 1))
        self.live = row < rows
        self.start = (row - first) * (row_stride // vec)  # the row's first vector in the view
        self.row_vectors = cols // vec
        self.outside = fx.Int32(OOB_BYTES // (vec * elem_bytes))

    def index(self, j):
        """The view index of vector ``j`` of this lane's row (``outside`` when it is not there)."""
        inside = self.live & (j < self.row_vectors)
        return inside.select(self.start + j, self.outside)


def _located(view, j):
    """(view, index) of vector ``j``: sub-wave rows (WaveRows) and phased rows (PhasedView) map
    it into their descriptor's view."""
    if isinstance(view, (WaveRows, PhasedView)):
        return view.vectors, view.index(j)
    return view, j


def _atom(vec: int, dtype):
    return fx.make_copy_atom(fx.rocdl.BufferCopy(vec * dtype.width), dtype.width)


def load(view, j, vec: int):
    """Vector ``j`` of a row view (zeros past the row end)."""
    view, j = _located(view, j)
    dtype = view.element_type
    r = fx.make_rmem_tensor(vec, dtype)
    fx.copy(_atom(vec, dtype), fx.slice(view, (None, j)), r)
    return fx.memref_load_vec(r)


def store(view, j, value, vec: int):
    """Write vector ``j`` of a row view (dropped past the row end)."""
    view, j = _located(view, j)
    dtype = view.element_type
    r = fx.make_rmem_tensor(vec, dtype)
    fx.memref_store_vec(value, r)
    fx.copy(_atom(vec, dtype), r, fx.slice(view, (None, j)))


# ----------------------------------------------------------------------------------------------
# Phased rows: one-element rows with an aligned middle.
#
# A row of an odd number of 16-bit elements admits one element per access as a whole, but from
# its first 16-byte boundary on it is plain 16-byte vectors: a head of fewer than 8 elements, a
# middle of whole vectors, a tail of fewer than 8 (as the CuTe templates' phased rows,
# _cute_rowwise.PhasedRow). When every [M, K] tensor of a call (compact rows, as the op layer
# passes them) starts at the same phase, the phase of row r is (phase - r * K) mod vec in every
# tensor, so all tensors split each row at the same columns. The one-element kernels then load
# and store the middle in 16-byte vectors and only the edges (head and tail, at most
# 2 * (vec - 1) elements, at most one per lane of a group of 16 or more) one element at a time.
# The test is made once per kernel from the base addresses (kernel arguments, so it is the same
# in every wave and the LDS reductions' barriers stay uniform); a call whose tensors are not
# congruent runs one element per access.


def phase_vec(sig) -> int:
    """Elements of a phased row's middle vectors: 16 bytes of the signature's dtype."""
    return limits.VECTOR_BYTES // limits.ELEM_BYTES[sig["dtype"]]


def _phase(tensor, vec: int):
    """Elements from the start of ``tensor`` to the first address a ``vec``-element vector of it
    may start on (at most 16 bytes of alignment); an Int32 the same in every lane."""
    low = fx.Int32(fx.Int64(fx.ptrtoint(fx.get_iter(tensor))) & fx.Int64(limits.VECTOR_BYTES - 1))
    return space.phase_of(low, vec, tensor.element_type.width // 8)


def congruent(tensors, vec: int):
    """Whether the [M, K] ``tensors`` (one row length, compact rows) start at one phase, and with
    it the phase of the first. A wave-uniform Boolean. A tensor of wider elements than the
    first (an fp32 residual beside 16-bit x) is congruent when its phase is the first's modulo
    its own 16-byte vectors (``space.congruent_phases``)."""
    first = _phase(tensors[0], vec)
    first_bytes = tensors[0].element_type.width // 8
    same = [space.congruent_phases(first, first_bytes, _phase(t, vec), t.element_type.width // 8, vec)
            for t in tensors[1:]]
    for other in same[1:]:
        same[0] = same[0] & other
    return same[0], first


@flyc.jit
def by_phase(phased, tensors, vec: int, phased_body, plain_body):
    """The dispatch of a one-element row-wise kernel: ``phased_body(phase)`` when the kernel has
    a phased path (``phased``, known at compile time) and ``tensors`` are congruent (a scalar
    branch, the same in every wave), else ``plain_body()``."""
    if const_expr(phased):
        same, phase = congruent(tensors, vec)
        if same:
            phased_body(phase)
        else:
            plain_body()
    else:
        plain_body()


def _where(cond, a, b):
    return cond.select(a, b)


class PhasedRow:
    """Row ``row`` of congruent [M, K] tensors (compact rows) of which ``tensor`` is one, the first
    starting at ``phase``: a head of ``head`` elements, ``nmid`` aligned ``vec``-element vectors
    and a tail (``_rowwise_space.phased_split``). The head and tail, at most 2 * (vec - 1)
    elements, go one to a lane of the row's group: ``edge_col`` is this lane's (K for the lanes
    without one; none at all where ``with_edges`` is False, e.g. in the column tiles after a
    row's first). ``view`` gives a tensor's row in these terms."""

    def __init__(self, groups: RowGroups, tensor, row, phase, vec: int, with_edges=None):
        if groups.width < 2 * (vec - 1):
            raise ConfigError(f"phased rows of {vec}-element vectors need groups of at least {2 * (vec - 1)} lanes")
        rows, cols = tensor.shape.unpack()
        self.groups, self.row, self.cols, self.vec, self.phase = groups, row, cols, vec, phase
        self.live = row < rows
        self.head, self.nmid, edge_col = space.phased_split(phase, row, cols, vec, groups.lane, _where)
        if with_edges is not None:
            edge_col = with_edges.select(edge_col, cols)
        self.edge_col = edge_col

    def view(self, tensor, parts: int = 1):
        """``tensor``'s row as a :class:`PhasedView` (of ``parts`` accesses per middle vector)."""
        return PhasedView(tensor, self, parts)


class PhasedView:
    """A phased row of one tensor behind one buffer descriptor, for ``load`` / ``store`` of its
    middle vectors (vector ``j`` is columns [head + j*vec, head + (j+1)*vec)) and
    ``load_edge`` / ``store_edge`` of this lane's edge element.

    The descriptor starts at the 16-byte boundary at or before the start of the wave's first row
    (the group's row in whole-wave groups; several consecutive rows in sub-wave groups, as
    :class:`WaveRows`): every middle vector of every row of the wave is then a whole number of
    vectors past it, and the edges' elements are inside it too, so middle and edges share it.
    Each lane bounds its own accesses: one past its row's middle or edges, or of a row at or past
    M, goes to OOB_BYTES (zeros read, stores dropped), so the descriptor's size is OOB_BYTES,
    whatever the tensor's (its base may also precede the tensor: nothing outside a row is
    accessed). Rows of a wave span at most OOB_BYTES.

    A tensor of wider elements than the row's middle vectors fit in 16 bytes (an fp32 residual
    under 16-bit x: 32 bytes under 8 elements) takes ``parts`` accesses per middle vector: its
    view's vectors are ``vec // parts`` elements, and middle vector ``j`` of the row is its
    vectors ``j * parts`` to ``j * parts + parts - 1`` (congruent tensors put them on 16-byte
    boundaries: see congruent)."""

    def __init__(self, tensor, pr: PhasedRow, parts: int = 1):
        elem_bytes = tensor.element_type.width // 8
        vec, cols = pr.vec, pr.cols
        first = fx.Int32(fx.rocdl.readfirstlane(T.i32, pr.row))
        lead, offset, start = space.phased_offsets(pr.phase, first, pr.row, pr.head, cols, vec)
        base = fx.get_iter(tensor) + (fx.Int64(first) * fx.Int64(cols) - fx.Int64(lead))
        buf = fx.rocdl.make_buffer_ptr(base, num_records_bytes=fx.Int64(OOB_BYTES))
        whole = fx.make_view(buf, fx.make_layout(OOB_BYTES // elem_bytes, 1))
        self.vectors = fx.logical_divide(whole, fx.make_layout(vec // parts, 1))
        self.elements = fx.logical_divide(whole, fx.make_layout(1, 1))
        self.live, self.nmid, self.start = pr.live, pr.nmid * parts, start * parts
        self.outside = fx.Int32(OOB_BYTES // (vec // parts * elem_bytes))
        has_edge = pr.live & (pr.edge_col < cols)
        self.edge = has_edge.select(offset + pr.edge_col, fx.Int32(OOB_BYTES // elem_bytes))

    def index(self, j):
        """The view index of middle access ``j`` of this lane's row (past the descriptor when it is
        not there)."""
        inside = self.live & (j < self.nmid)
        return inside.select(self.start + j, self.outside)

    def load_edge(self):
        """This lane's edge element (a 1-element vector; zero for a lane without one)."""
        return load(self.elements, self.edge, 1)

    def store_edge(self, value):
        """Write this lane's edge element (a 1-element vector; dropped without one)."""
        store(self.elements, self.edge, value, 1)


def silu_mul(a, b):
    """silu(a) * b on fp32 vectors, as a * (1 / (1 + 2^(-a*log2(e)))) * b.

    Uses the hardware exp2 and reciprocal (v_exp_f32, v_rcp_f32, ~1 ulp each). Saturates the
    way torch does: silu(-inf) is NaN, large negative a gives -0, large positive a gives a."""
    with fastmath(arith.FastMathFlags.afn):
        e = fmath.exp2(a * (-LOG2E))
        r = 1.0 / (e + 1.0)
    return a * r * b


def _abs_bits(value):
    """|value| of a bf16/fp16/fp32 vector as same-width integers. For non-negative floats the
    integer order is the float order (NaN above inf), so an integer max is an exact,
    NaN-propagating absmax (v_pk_max_u16 on pairs of 16-bit values)."""
    width = value.dtype.width
    itype = fx.Int16 if width == 16 else fx.Int32
    return value.bitcast(itype) & itype((1 << (width - 1)) - 1)


def _packed(bits):
    # Carry pairs of 16-bit lanes as 32-bit words: a vector<Nxi16> loop variable would be
    # split into N registers, the packed form keeps v_pk_max_u16 inside loops.
    return bits.bitcast(fx.Int32) if bits.dtype is fx.Int16 and len(bits) % 2 == 0 else bits


def _unpacked(acc, width):
    return acc.bitcast(fx.Int16) if width == 16 and acc.dtype is fx.Int32 else acc


def absmax_start(value):
    """Running absmax of a thread's values (lane-wise integer bits, packed for loops)."""
    return _packed(_abs_bits(value))


def absmax_update(acc, value):
    width = value.dtype.width
    return _packed(fx.max(_unpacked(acc, width), _abs_bits(value)))


def absmax_finish(acc, width: int):
    """The thread's absmax as the Int32 bits of its ``width``-bit float."""
    return fx.Int32(_unpacked(acc, width).reduce(ReductionOp.MAX))


def bits_to_float(bits, dtype):
    """The fp32 value of a non-negative ``dtype`` number held as integer bits (an Int32)."""
    if dtype is fx.Float32:
        return bits.bitcast(fx.Float32)
    if dtype is fx.BFloat16:
        return (bits << 16).bitcast(fx.Float32)
    return fx.Int16(bits).bitcast(fx.Float16).to(fx.Float32)


# DPP controls (gfx9 encoding): row_shr:n reads lane i-n of the same 16-lane row;
# row_bcast:15 / row_bcast:31 hand lane 15 / 31 of a row to the rows above it.
_ROW_SHR = (0x111, 0x112, 0x114, 0x118)
_ROW_BCAST15, _ROW_BCAST31 = 0x142, 0x143


def _combine(op, a, b):
    return a + b if op is ReductionOp.ADD else fx.max(a, b)


def _dpp(value, neutral, ctrl, row_mask):
    # bound_ctrl off: lanes a move does not reach read ``neutral``, the identity of the fold.
    moved = fx.rocdl.update_dpp(value.dtype.ir_type, neutral.ir_value(), value.ir_value(), ctrl, row_mask,
                                0xF, False)
    return value.dtype(moved)


def wave_reduce(value, op, width: int = WAVE):
    """Reduce a 32-bit scalar (Int32 or Float32) over each group of ``width`` lanes of a wave (64,
    or 16 / 32 for sub-wave groups); every lane of a group gets its group's value.

    Four row_shr steps fold each 16-lane row into its last lane (a 16-lane group stops there),
    row_bcast:15 folds pairs of rows into lanes 31 and 63 (a 32-lane group stops there),
    row_bcast:31 folds the two halves into lane 63; v_readlane_b32 then broadcasts the last lane
    of each group. The moves fuse into the combining instruction (v_max_i32_dpp, v_add_f32_dpp).
    The fold order is fixed, so sums are deterministic."""
    dtype = value.dtype
    if op is ReductionOp.ADD:
        neutral = dtype(0)
    else:
        neutral = dtype(float("-inf")) if dtype is fx.Float32 else dtype(-(1 << 31))
    acc = value
    for ctrl in _ROW_SHR:
        acc = _combine(op, acc, _dpp(acc, neutral, ctrl, 0xF))
    if width >= 32:
        acc = _combine(op, acc, _dpp(acc, neutral, _ROW_BCAST15, 0xA))
    if width >= WAVE:
        acc = _combine(op, acc, _dpp(acc, neutral, _ROW_BCAST31, 0xC))
        return dtype(fx.rocdl.readlane(dtype.ir_type, acc, WAVE - 1))
    # Sub-wave groups: group g's value is in its last lane, (g + 1) * width - 1.
    lane = fx.thread_idx.x % WAVE
    total = dtype(fx.rocdl.readlane(dtype.ir_type, acc, width - 1))
    for g in range_constexpr(1, WAVE // width):
        other = dtype(fx.rocdl.readlane(dtype.ir_type, acc, (g + 1) * width - 1))
        total = (lane >= g * width).select(other, total)
    return total


def reduce_storage(threads: int, dtype=fx.Float32):
    """LDS for :func:`group_reduce`: one slot per wave of the block."""
    nwaves = threads // WAVE

    @fx.struct
    class Partials:
        slots: fx.Array[dtype, nwaves, 16]

    return Partials


def reduction_slots(storage, groups: RowGroups):
    """The LDS slots of :func:`group_reduce` (``storage`` from :func:`reduce_storage`), or None
    for groups of one wave or less (DPP alone). Call once, at the top of the kernel: a kernel
    has one shared-memory allocator, and both paths of a phased kernel reduce."""
    if groups.width <= WAVE:
        return None
    smem = fx.SharedAllocator().allocate(storage).peek()
    return smem.slots.view(fx.make_layout(groups.threads // WAVE, 1))


def group_reduce(value, op, groups: RowGroups, slots=None):
    """Reduce a 32-bit scalar over each row group (ReductionOp.MAX or ADD); every lane of the
    group gets the result. Waves and sub-wave groups reduce with DPP (row_shr, row_bcast,
    readlane); wider groups add one LDS round through ``slots`` (:func:`reduction_slots`): each
    wave writes its slot, then each lane folds its group's slots in order (no branch, one
    barrier; call once per kernel unless the caller adds a barrier)."""
    value = wave_reduce(value, op, min(groups.width, WAVE))
    if groups.width <= WAVE:
        return value
    # After the wave reduce every lane holds the same value; all of them store it.
    fx.memref_store(value, slots, groups.wave)
    gpu.barrier()
    first = groups.group * groups.waves
    total = fx.memref_load(slots, first)
    for w in range_constexpr(1, groups.waves):
        other = fx.memref_load(slots, first + w)
        total = _combine(op, total, other)
    return total


def fp8_row_scale(amax, scale_ub, fp8: Fp8Format):
    """(scale, inverse) of a row from its fp32 absmax, with the arithmetic of MSLK's Triton
    quantize_fp8_row: amax is clamped to [FP8_EPS, scale_ub] (no upper bound without scale_ub),
    scale = amax / fp8_max is the stored dequant scale, inverse = 1 / scale feeds to_fp8. Both
    divisions are correctly rounded (once per row); NaN propagates."""
    amax = fx.max(amax, fx.Float32(FP8_EPS))
    if scale_ub is not None:
        amax = fx.min(amax, scale_ub)
    scale = amax / fx.Float32(fp8.max)
    return scale, fx.Float32(1.0) / scale


def to_fp8(value, scale, inverse, fp8: Fp8Format, bounded: bool):
    """fp8(clamp(value / scale, -max, max)) for an fp32 vector of 1, 2 or 4k elements, the
    quotient correctly rounded as Triton's div_rn, without a division per element.

    With ``inverse`` the correctly rounded 1 / scale, q = value * inverse is about an ulp from
    the quotient, and one residual step q - (q * scale - value) * inverse (two FMAs, the residual
    exact) rounds it correctly: the fast path of IEEE division, checked against exact rational
    arithmetic on random bf16 and fp32 rows. The residual is q * scale - value so that -0 stays
    -0. ``bounded``: |value| <= the row's amax
    (no scale_ub), so |q| <= max; otherwise q is first clamped to +-2 max, which keeps the step
    finite and the final clamp saturating.

    v_cvt_pk_fp8_f32 rounds to nearest even like torch. On the fnuz flavour it would encode a
    result that rounds to -0 as 0x80 (NaN there); torch gives +0, so values with
    |v| <= 2^-11 (half the smallest subnormal, which round to zero) are replaced by +0 first."""
    n = len(value)

    def splat(c):
        return fx.Vector.filled(n, c, fx.Float32)

    def clamp(v, bound):
        # minnum/maxnum fold into v_med3_f32. A NaN gives an unspecified finite byte, but then
        # the row's scale is NaN too (the absmax propagates NaN).
        return fx.arith.minnumf(fx.arith.maxnumf(v, splat(-bound)), splat(bound))

    scale_v, inverse_v = splat(scale), splat(inverse)
    q = value * inverse_v
    if not bounded:
        q = clamp(q, 2.0 * fp8.max)
    residual = fmath.fma(q, scale_v, -value)
    v = clamp(fmath.fma(-residual, inverse_v, q), fp8.max)
    if fp8.fnuz:
        v = (fmath.absf(v) <= splat(2.0**-11)).select(splat(0.0), v)
    words = []
    for i in range_constexpr(0, n, 4):
        lo_b = v[i + 1] if i + 1 < n else v[i]
        w = fx.rocdl.cvt_pk_fp8_f32(T.i32, v[i], lo_b, v[i].bitcast(fx.Int32), False)
        if i + 2 < n:
            w = fx.rocdl.cvt_pk_fp8_f32(T.i32, v[i + 2], v[i + 3], w, True)
        words.append(fx.Int32(w))
    if n >= 4:
        return fx.Vector.from_elements(words, fx.Int32).bitcast(fp8.type)
    narrow = fx.Int8 if n == 1 else fx.Int16
    return fx.Vector.from_elements([words[0].to(narrow)], narrow).bitcast(fp8.type)


def store_row_scalar(tensor, row, value, groups: RowGroups):
    """Write one fp32 per row into a 1-D tensor (e.g. the row scales), from lane 0 of the row's
    group; rows past the tensor's end and the other lanes land out of the descriptor's bounds."""
    n = tensor.shape.unpack()  # rank 1: a single size
    buf = fx.rocdl.make_buffer_ptr(fx.get_iter(tensor), num_records_bytes=fx.Int64(n) * 4)
    view = fx.logical_divide(fx.make_view(buf, fx.make_layout(n, 1)), fx.make_layout(1, 1))
    index = (groups.lane == 0).select(row, fx.Int32(OOB_BYTES // 4))
    store(view, index, fx.Vector.from_elements([value], fx.Float32), 1)


@flyc.jit
def quantize_row(values, groups, row, cols, vec, per_thread, dtype, out, scale_out, scale_ub, fp8, slots,
                 edge=None):
    """Quantize one row per group to FP8 with its dequant scale (see fp8_row_scale, to_fp8).

    ``values(j)`` returns column-vector ``j`` of the row in ``dtype`` (zeros past the row end),
    ``out`` is the row of xq as a view of ``vec``-element vectors (``RowGroups.view``), ``cols``
    bounds the row's length, ``slots`` are the row reduction's (:func:`reduction_slots`). The
    first ``groups.width * per_thread`` vectors stay in registers between the absmax pass and the
    quantize pass, so rows up to that length are read once; longer rows read the rest twice (the
    second time mostly from L2 / Infinity Cache). A phased row gives its middle as ``values`` and
    ``out`` (a :class:`PhasedView` of xq) and this lane's edge element as ``edge`` (in ``dtype``)."""
    chunk = groups.width * per_thread  # vectors per chunk
    width = dtype.width

    def chunk_values(c):
        # All loads of a chunk are issued before any use: stores in between would make the
        # compiler wait for each load in turn (vmcnt also counts stores).
        return [values(c * chunk + groups.lane + u * groups.width) for u in range_constexpr(per_thread)]

    cached = chunk_values(0)
    acc = absmax_start(cached[0])
    for u in range_constexpr(1, per_thread):
        acc = absmax_update(acc, cached[u])
    nchunks = (cols + (chunk * vec - 1)) // (chunk * vec)
    for c in range(fx.Int32(1), nchunks, fx.Int32(1)):
        vals = chunk_values(c)
        for u in range_constexpr(per_thread):
            acc = absmax_update(acc, vals[u])
    bits = absmax_finish(acc, width)
    if edge is not None:
        bits = fx.max(bits, absmax_finish(absmax_start(edge), width))
    amax = group_reduce(bits, ReductionOp.MAX, groups, slots)
    scale, inverse = fp8_row_scale(bits_to_float(amax, dtype), scale_ub, fp8)
    store_row_scalar(scale_out, row, scale, groups)
    bounded = scale_ub is None
    if edge is not None:
        out.store_edge(to_fp8(edge.to(fx.Float32), scale, inverse, fp8, bounded))
    for u in range_constexpr(per_thread):
        q = to_fp8(cached[u].to(fx.Float32), scale, inverse, fp8, bounded)
        store(out, groups.lane + u * groups.width, q, vec)
    for c in range(fx.Int32(1), nchunks, fx.Int32(1)):
        vals = chunk_values(c)
        for u in range_constexpr(per_thread):
            j = c * chunk + groups.lane + u * groups.width
            store(out, j, to_fp8(vals[u].to(fx.Float32), scale, inverse, fp8, bounded), vec)


def _quantize_plain(tensors, combine, xq, scale_out, scale_ub, groups, slots, row, cols, vec, per_thread, dtype, fp8):
    views = [groups.view(t, row, vec) for t in tensors]

    def values(j):
        return combine(*[load(v, j, vec) for v in views])

    quantize_row(values, groups, row, cols, vec, per_thread, dtype, groups.view(xq, row, vec), scale_out, scale_ub,
                 fp8, slots)


def _quantize_phased(tensors, combine, xq, scale_out, scale_ub, groups, slots, row, cols, phase, vec, per_thread,
                     dtype, fp8):
    pr = PhasedRow(groups, tensors[0], row, phase, vec)
    views = [pr.view(t) for t in tensors]
    edge = combine(*[v.load_edge() for v in views])   # issued ahead of the middle's loads

    def values(j):
        return combine(*[load(v, j, vec) for v in views])

    quantize_row(values, groups, row, cols, vec, per_thread, dtype, pr.view(xq), scale_out, scale_ub, fp8, slots,
                 edge)


def quantize_rows(tensors, combine, xq, scale_out, scale_ub, groups, slots, row, vec, per_thread, phased_per_thread,
                  dtype, fp8):
    """Kernel body of the row-wise FP8 quantizers: row ``row`` of combine(*tensors) ([M, K]
    tensors; ``combine`` maps their vectors to one of ``dtype``) quantized into xq, its scale into
    scale_out (see quantize_row), in ``vec``-element vectors, ``per_thread`` of them per thread.
    With ``phased_per_thread`` (one-element configs, see quantize_setup) a call whose tensors are
    congruent runs phased rows (:class:`PhasedRow`), that many 16-byte vectors per thread."""
    _, cols = tensors[0].shape.unpack()
    args = (tensors, combine, xq, scale_out, scale_ub, groups, slots, row, cols)
    pvec = limits.VECTOR_BYTES * 8 // dtype.width  # phase_vec: 16 bytes of the input dtype
    by_phase(phased_per_thread > 0, (*tensors, xq), pvec,
             lambda phase: _quantize_phased(*args, phase, pvec, phased_per_thread, dtype, fp8),
             lambda: _quantize_plain(*args, vec, per_thread, dtype, fp8))


def quantize_setup(template: str, config, target: str, sig):
    """What the row-wise FP8 quantizers (quantize_fp8_row, silu_mul_quant) build alike:
    (threads, rows per block, vec, dtype, Fp8Format, has scale_ub, vectors per thread, LDS of
    the row reductions, phased: vectors per thread of phased rows or 0 for a config that has
    none). Plain values on purpose: the kernels' closures hold them, and FlyDSL's compile cache
    key covers a closure's scalars (not an object's fields)."""
    space.check(template, config, sig)
    threads = config["threads"]
    per_thread = space.vectors_per_thread(config, sig, space.QUANT_REGISTER_BYTES)
    # One-element configs run congruent rows phased: the same elements per thread, in vectors.
    phased_per_thread = max(1, per_thread // phase_vec(sig)) if space.phased_rows(config, sig) else 0
    return (threads, config["rows_per_block"], config["vec"], elem_type(sig["dtype"]), Fp8Format(target),
            sig["has_scale_ub"], per_thread, reduce_storage(threads, fx.Int32), phased_per_thread)
