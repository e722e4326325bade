"""RMSNorm and fused residual-add RMSNorm for ROCm (FlyDSL), gfx942 / gfx950.

rmsnorm:      kernel(x, weight, y, eps)
              y = (x.float() * rsqrt(mean(x.float()^2) + eps) * weight.float()).to(dtype)
rmsnorm_add:  kernel(x, residual, weight, y, new_residual, eps)
              new_residual = (x.float() + residual.float()).to(dtype); y = rmsnorm(new_residual)
x, residual, y, new_residual: contiguous [M, N] bf16, fp16 or fp32; weight [N] of x's dtype, or
fp32 with sig["fp32_weight"] (read as two 16-byte vectors under 8 values of x); eps an fp32 scalar.
With sig["fp32_residual"] (16-bit x) residual and new_residual are fp32: new_residual =
x.float() + residual unrounded, y normalized from it; the residual under a vector of x moves in
accesses twice as wide as x's (two 16-byte ones under a 16-byte vector of x, the middle of a
phased row included; one fp32 element under one element of x).
M and N are dynamic: one artifact serves every shape. Each element is read, then written, by one
thread only, so new_residual may alias x or residual and y may alias x (the op layer allocates
fresh outputs, so this is not exercised).

A block holds ``rows`` rows, each owned by ``threads // rows`` threads (whole waves, or 16 / 32
lanes of one for short rows; rows and their bounds-checked buffer descriptors come from
_flydsl_rowwise). The group walks its row in
chunks of ``group * vec * tiles`` elements, each thread holding ``tiles`` vectors of ``vec``
elements. The last chunk stays in registers across the reduction; earlier chunks (rows longer
than one chunk) are read again afterwards, so every config is correct for every N, while the
heuristic picks one whose chunk covers N (x is read once). ``vec`` 8 (16-bit dtypes) and 4
(fp32) are 16-byte accesses; rows that admit only 8- or 4-byte ones (the signature's
``vec_bytes``) run the same chunk in narrower accesses; ``vec`` 1 serves any N. Rows past 16K elements
take a 16K-element chunk (512 threads for aligned 16-bit rows, the fewest that hold it; 1024 for
fp32 and unaligned rows): the re-read of the earlier chunks then mostly hits L2 / MALL. One-element
configs run a call whose row tensors start at one offset from a 16-byte boundary as phased rows
(_flydsl_rowwise.PhasedRow; not rmsnorm_add in sub-wave groups, see phased_rows): the same
chunk as 16-byte vectors of each row's aligned middle, the head and tail one element to a lane,
the weight one element at a time (its columns start at the row's head). Every
chunk issues all its loads before its first store: a store in between would make each load wait
for the previous one (vmcnt counts both).
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _rowwise_space as rw_space

DTYPES = ("bfloat16", "float16", "float32")
TARGETS = ("gfx942", "gfx950")

# (threads, rows per block, elements per access, vectors per thread per chunk). 16 rows per
# block are sub-wave groups (16 lanes a row at 256 threads, 32 at 512): short rows such as
# per-head q / k norms (64-256 elements) without most lanes idle.
_CONFIGS = [
    (256, 16, 8, 1),    # 16 lanes per row, chunk 128
    (256, 16, 8, 2),    # 16 lanes per row, chunk 256
    (256, 4, 8, 1),     # a wave per row, chunk 512
    (256, 4, 8, 2),     # a wave per row, chunk 1024
    (256, 1, 8, 1),     # chunk 2048
    (256, 1, 8, 2),     # chunk 4096
    (256, 1, 8, 4),     # chunk 8192 (5120, 7168, 8192)
    (512, 1, 8, 4),     # chunk 16384
    (1024, 1, 8, 2),    # chunk 16384, more waves per row
    (256, 16, 4, 1),    # fp32: 16 lanes per row, chunk 64
    (256, 16, 4, 2),    # fp32: 16 lanes per row, chunk 128
    (256, 4, 4, 1),     # fp32: a wave per row, chunk 256
    (256, 4, 4, 2),     # fp32: a wave per row, chunk 512
    (256, 1, 4, 2),     # fp32: chunk 2048
    (256, 1, 4, 4),     # fp32: chunk 4096
    (512, 1, 4, 4),     # fp32: chunk 8192
    (1024, 1, 4, 4),    # fp32: chunk 16384
    (256, 16, 1, 16),   # any N: 16 lanes per row, chunk 256
    (512, 16, 1, 16),   # any N: 32 lanes per row, chunk 512
    (256, 4, 1, 16),    # any N: a wave per row, chunk 1024
    (512, 1, 1, 16),    # any N: chunk 8192
    (1024, 1, 1, 16),   # any N: chunk 16384
]
CONFIGS = [dict(threads=t, rows=r, vec=v, tiles=k) for t, r, v, k in _CONFIGS]


def chunk(config) -> int:
    """Elements of a row that one pass of a config holds in registers."""
    return config["threads"] // config["rows"] * config["vec"] * config["tiles"]


def _wide(sig) -> int:
    """Elements of a 16-byte vector of x."""
    return limits.VECTOR_BYTES // limits.ELEM_BYTES[sig["dtype"]]


def _valid(config, target, sig):
    # Single elements serve any row; 16-byte vectors any row that admits a vector (cut into
    # 8- or 4-byte accesses where the rows need it: see _access).
    return (target in TARGETS and limits.vector_signature(sig)
            and (config["vec"] == 1 or (not limits.one_element(sig) and config["vec"] == _wide(sig))))


def _access(config, sig) -> tuple[int, int]:
    """(elements per access, vectors per thread per chunk) the kernel runs: the config's, or, on
    rows that admit only 8- or 4-byte accesses, each 16-byte vector cut into that many narrower
    ones (the same chunk of the row, more accesses)."""
    vec, tiles = config["vec"], config["tiles"]
    narrow = limits.vector_elems(sig)
    if vec > narrow:
        return narrow, tiles * (vec // narrow)
    return vec, tiles


def phased_rows(config, sig, fused_add: bool) -> bool:
    """Whether the kernel of a one-element config runs congruent rows phased (the row's middle
    in 16-byte vectors, _flydsl_rowwise.PhasedRow; an fp32 residual stream in two 16-byte
    accesses under each). Not rmsnorm_add in sub-wave groups: its four row tensors' descriptors
    in both paths of one kernel exceed the scalar registers (SGPR spills), and rows of a few
    hundred elements with a residual stream are rare."""
    sub_wave = config["threads"] // config["rows"] < rw_space.WAVE
    return rw_space.phased_rows(config, sig) and not (fused_add and sub_wave)


def _heuristic(target, sig, problem):
    # The smallest chunk that holds the whole row (one read of x, fewest idle lanes), then the
    # fewest threads; rows longer than every chunk take the largest.
    n = int(problem.get("N", 4096))
    fits = [c for c in CONFIGS if c["vec"] == (1 if limits.one_element(sig) else _wide(sig))]
    covering = [c for c in fits if chunk(c) >= n]
    if covering:
        return dict(min(covering, key=lambda c: (chunk(c), c["threads"])))
    return dict(max(fits, key=lambda c: (chunk(c), -c["threads"])))


def _make_launcher(config, sig, fused_add: bool):
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl.expr import arith, const_expr, range_constexpr
    from flydsl.expr import math as fmath
    from flydsl.expr.typing import ReductionOp

    from mslk_dsl.templates import _flydsl_reduce as red
    from mslk_dsl.templates import _flydsl_rowwise as rw

    # Plain scalars: FlyDSL keys its cache on the closure's scalar values.
    THREADS, ROWS = config["threads"], config["rows"]
    VEC, TILES = _access(config, sig)
    FUSED = bool(fused_add)
    DTYPE = sig["dtype"]
    W32 = bool(sig.get("fp32_weight"))
    # The weight under a vector of x: WPARTS accesses of WVEC elements (at most 16 bytes).
    WVEC = min(VEC, 4) if W32 else VEC
    WPARTS = VEC // WVEC
    # An fp32 residual stream: the residual under a vector of x in residual_parts(vec) accesses.
    R32 = FUSED and bool(sig.get("fp32_residual"))
    GROUP = THREADS // ROWS           # threads per row
    # One-element configs run congruent rows phased (_flydsl_rowwise.PhasedRow): the same
    # elements per thread and chunk, PTILES vectors of PVEC elements.
    PHASED = phased_rows(config, sig, fused_add)
    PVEC = rw.phase_vec(sig)
    PTILES = max(1, TILES // PVEC)
    NAME = (f"mslk_{'rmsnorm_add' if FUSED else 'rmsnorm'}_{DTYPE}{'_w32' if W32 else ''}{'_r32' if R32 else ''}"
            f"_t{THREADS}r{ROWS}v{VEC}x{TILES}")
    storage = rw.reduce_storage(THREADS)

    def residual_parts(vec: int) -> int:
        """Accesses of the residual stream under a vector of ``vec`` elements of x: two 16-byte
        ones under a 16-byte vector of 16-bit x when the residual is fp32, else one."""
        return vec // min(vec, 4) if R32 else 1

    def load_joined(view, j, parts, part_vec):
        """Vector j of ``parts * part_vec`` elements (an fp32 weight or residual under a vector of
        16-bit x), loaded in ``parts`` (1 or 2) accesses of ``part_vec`` and joined."""
        loaded = [rw.load(view, j * parts + p, part_vec) for p in range_constexpr(parts)]
        return loaded[0] if const_expr(parts == 1) else loaded[0].shuffle(loaded[1], list(range(parts * part_vec)))

    @flyc.jit
    def normalize_row(views, groups, slots, N, eps, vec, tiles, weight_of, edge_weight=None):
        """The row of ``views`` = (x, residual, y, new_residual) (residual and new_residual None
        unless FUSED), its vectors of ``vec`` elements, ``tiles`` of them per thread per chunk;
        ``weight_of(j)`` gives the weight under vector j as a vector of ``vec``. The views are
        RowGroups views, or PhasedViews of a phased row: then each lane also normalizes its
        edge element, under the weight ``edge_weight()``."""
        elem = rw.elem_type(DTYPE)
        relem = fx.Float32 if const_expr(R32) else elem   # the residual stream's element type
        xv, rv, yv, hv = views
        again = hv if const_expr(FUSED) else xv      # where pass 2 reads a row again

        rparts = residual_parts(vec)
        rvec = vec // rparts

        def load_res(view, j):
            # Vector j of the residual stream, as one vector of vec elements.
            return load_joined(view, j, rparts, rvec)

        def load_again(j):
            return load_res(again, j) if const_expr(FUSED) else rw.load(again, j, vec)
        chunk_v = GROUP * tiles                      # vectors per chunk of a row
        last = ((N + vec - 1) // vec + chunk_v - 1) // chunk_v - 1   # chunks before the last

        def columns(c):
            # This thread's vectors of chunk c: contiguous across the group's lanes.
            return [c * chunk_v + t * GROUP + groups.lane for t in range_constexpr(tiles)]

        def load_chunk(c):
            # Issue the loads of chunk c: x, and the residual when fused.
            js = columns(c)
            xs = [rw.load(xv, j, vec) for j in js]
            rs = [load_res(rv, j) for j in js] if const_expr(FUSED) else None
            return js, xs, rs

        def row_values(js, xs, rs, store):
            # The row's values: x, or h = x + residual rounded to the residual's dtype (stored to
            # new_residual).
            if const_expr(not FUSED):
                return xs
            hs = [(a.to(fx.Float32) + b.to(fx.Float32)).to(relem) for a, b in zip(xs, rs)]
            for t in range_constexpr(len(js)):
                store(js[t], hs[t])
            return hs

        def store_h(j, h):
            if const_expr(rparts == 1):
                rw.store(hv, j, h, vec)
            else:
                for p in range_constexpr(rparts):
                    rw.store(hv, j * rparts + p, h.shuffle(h, list(range(p * rvec, (p + 1) * rvec))), rvec)

        def sum_sq(vs):
            total = fx.Float32(0.0)
            for v in vs:
                f = v.to(fx.Float32)
                total = total + (f * f).reduce(ReductionOp.ADD)
            return total

        def normalized(v, w, rstd):
            return ((v.to(fx.Float32) * rstd) * w.to(fx.Float32)).to(elem)

        def write_y(c, vs, ws, rstd):
            js = columns(c)
            for t in range_constexpr(tiles):
                rw.store(yv, js[t], normalized(vs[t], ws[t], rstd), vec)

        if const_expr(edge_weight is not None):
            # The edge element's loads go first, ahead of the middle's.
            edge_in = [xv.load_edge()] + ([rv.load_edge()] if const_expr(FUSED) else [])
            edge_w = edge_weight()
        # Pass 1: chunks before the last only feed the sum (rows longer than one chunk).
        acc = fx.Float32(0.0)
        for c in range(last):
            js, xs, rs = load_chunk(c)
            acc = acc + sum_sq(row_values(js, xs, rs, store_h))
        js, xs, rs = load_chunk(last)
        weights = [weight_of(j) for j in js]   # in flight across the reduction
        cached = row_values(js, xs, rs, store_h)
        acc = acc + sum_sq(cached)
        if const_expr(edge_weight is not None):
            edge = row_values([0], edge_in[:1], edge_in[1:], lambda _, h: hv.store_edge(h))[0]
            acc = acc + sum_sq([edge])
        total = rw.group_reduce(acc, ReductionOp.ADD, groups, slots)
        rstd = fmath.rsqrt(total / fx.Float32(N) + eps, fastmath=arith.FastMathFlags.fast)
        # Pass 2: the last chunk from registers, then earlier chunks read again (h from
        # new_residual, which this same thread wrote in pass 1).
        write_y(last, cached, weights, rstd)
        if const_expr(edge_weight is not None):
            yv.store_edge(normalized(edge, edge_w, rstd))
        for c in range(last):
            js = columns(c)
            vs = [load_again(j) for j in js]
            ws = [weight_of(j) for j in js]
            write_y(c, vs, ws, rstd)

    class PhasedWeight:
        """The weight under a phased row: its middle vectors start at the row's head, at any
        offset from the weight's own alignment, so they are read one element at a time (the
        weight is small and stays in cache); likewise the lane's edge element."""

        def __init__(self, W, pr):
            self.view, self.pr = red.vector_view(W, 1), pr

        def under(self, j):
            first = self.pr.head + j * PVEC
            parts = [rw.load(self.view, first + i, 1) for i in range_constexpr(PVEC)]
            return fx.Vector.from_elements([p[0] for p in parts], parts[0].dtype)

        def edge(self):
            return rw.load(self.view, self.pr.edge_col, 1)

    def plain_row(X, R, W, Y, H, eps, groups, slots, row, N):
        views = [groups.view(X, row, VEC), None, groups.view(Y, row, VEC), None]
        if const_expr(FUSED):
            rvec = VEC // residual_parts(VEC)
            views[1], views[3] = groups.view(R, row, rvec), groups.view(H, row, rvec)
        wv = red.vector_view(W, WVEC)

        def weight_of(j):
            # The weight under vector j of x, as one vector of VEC elements.
            return load_joined(wv, j, WPARTS, WVEC)

        normalize_row(views, groups, slots, N, eps, VEC, TILES, weight_of)

    def phased_row(X, R, W, Y, H, eps, groups, slots, row, N, phase):
        pr = rw.PhasedRow(groups, X, row, phase, PVEC)
        views = [pr.view(X), None, pr.view(Y), None]
        if const_expr(FUSED):
            views[1], views[3] = pr.view(R, residual_parts(PVEC)), pr.view(H, residual_parts(PVEC))
        weight = PhasedWeight(W, pr)
        normalize_row(views, groups, slots, N, eps, PVEC, PTILES, weight.under, weight.edge)

    @flyc.kernel(name=NAME, known_block_size=[THREADS, 1, 1])
    def rmsnorm_kernel(X: fx.Tensor, R: fx.Tensor, W: fx.Tensor, Y: fx.Tensor, H: fx.Tensor,
                       eps: fx.Float32):
        groups = rw.RowGroups(THREADS, ROWS)
        slots = rw.reduction_slots(storage, groups)
        row = fx.block_idx.x * ROWS + groups.group
        N = X.shape.unpack()[1]
        rw.by_phase(PHASED, (X, R, Y, H) if FUSED else (X, Y), PVEC,
                    lambda phase: phased_row(X, R, W, Y, H, eps, groups, slots, row, N, phase),
                    lambda: plain_row(X, R, W, Y, H, eps, groups, slots, row, N))

    def launch_kernel(X, R, W, Y, H, eps, stream):
        M = X.shape.unpack()[0]
        rmsnorm_kernel(X, R, W, Y, H, eps).launch(
            grid=((M + ROWS - 1) // ROWS, 1, 1), block=(THREADS, 1, 1), stream=stream)

    if FUSED:
        @flyc.jit
        def rmsnorm_add(X: fx.Tensor, R: fx.Tensor, W: fx.Tensor, Y: fx.Tensor, H: fx.Tensor,
                        eps: fx.Float32, stream: fx.Stream = fx.Stream(None)):
            launch_kernel(X, R, W, Y, H, eps, stream)
        return rmsnorm_add

    @flyc.jit
    def rmsnorm(X: fx.Tensor, W: fx.Tensor, Y: fx.Tensor, eps: fx.Float32,
                stream: fx.Stream = fx.Stream(None)):
        # R and H are never touched without FUSED; x and y fill their slots.
        launch_kernel(X, X, W, Y, Y, eps, stream)
    return rmsnorm


def _placeholders(sig, fused_add: bool):
    import torch

    dtype = getattr(torch, sig["dtype"])
    v = limits.vector_elems(sig)   # N one vector past a 16-byte multiple unless the rows take 16 bytes
    m, n = 3, (4096 if v == _wide(sig) else 4096 + v)
    x = torch.zeros(m, n, dtype=dtype)
    w = torch.zeros(n, dtype=torch.float32 if sig.get("fp32_weight") else dtype)
    if fused_add:
        r = torch.zeros(m, n, dtype=torch.float32) if sig.get("fp32_residual") else x.clone()
        return [x, r, w, x.clone(), r.clone(), 1e-6]
    return [x, w, x.clone(), 1e-6]


def _builder(fused_add: bool):
    def build(config, target, sig):
        return _make_launcher(config, sig, fused_add), _placeholders(sig, fused_add)
    return build


def _template(op: str, fused_add: bool) -> Template:
    parts = {"dtype": DTYPES, "vec_bytes": limits.VECTOR_WIDTHS, "fp32_weight": (False, True)}
    return Template(op=op, backend="flydsl", targets=TARGETS,
                    signatures={**parts, "fp32_residual": (False, True)} if fused_add else parts,
                    signature_valid=limits.norm_signature,
                    configs=CONFIGS, valid=_valid, heuristic=_heuristic, build=_builder(fused_add),
                    occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR,
                    instructions={"isa": [r"v_rsq_f32"]})


TEMPLATES = [_template("rmsnorm", False), _template("rmsnorm_add", True)]
