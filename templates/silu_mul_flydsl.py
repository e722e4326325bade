"""silu_mul for AMD CDNA (FlyDSL): out = silu(x0) * x1, computed in fp32, rounded to the dtype.

Calling convention: ``kernel(x0, x1, out, count)``; x0, x1, out [M, K] of one dtype
(bf16/fp16/fp32, unit column stride); count [1] int32: rows from count[0] on are neither read
nor written (MSLK's valid_token_count; the op passes 2^31 - 1 without one). M and K are
dynamic; M and K tails are bounds-checked by the buffer descriptors (see _flydsl_rowwise), so no
size needs padding.

Grid: (row blocks, column blocks). A block holds ``rows_per_block`` rows; each of its threads
loads 32 register bytes of each input (two 16-byte vectors, or eight scalars when vec is 1),
all loads issued before any math. One-element configs run a call whose tensors start at one
offset from a 16-byte boundary as phased rows (_flydsl_rowwise.PhasedRow): the same eight
columns per thread as one 16-byte vector of each row's aligned middle, the head and tail (under
eight elements each) one element to a lane of the first column tile.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _rowwise_space as space

REGISTER_BYTES = 32  # per input and thread: two 16-byte vectors, or eight scalars


def _heuristic(target, sig, problem):
    return space.smallest_covering(sig, problem["K"], REGISTER_BYTES)


def build(config, target, sig):
    import torch
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl.expr import range_constexpr

    from mslk_dsl.templates import _flydsl_rowwise as rw

    threads, rows, vec = config["threads"], config["rows_per_block"], config["vec"]
    dtype = rw.elem_type(sig["dtype"])
    per_thread = space.vectors_per_thread(config, sig, REGISTER_BYTES)
    cols_per_block = threads // rows * per_thread * vec
    # One-element configs run congruent rows phased (_flydsl_rowwise.PhasedRow): the same columns
    # per thread, as 16-byte vectors where the row's middle allows.
    phased = space.phased_rows(config, sig)
    pvec = rw.phase_vec(sig)
    phased_per_thread = max(1, per_thread // pvec)

    def silu_mul_columns(views, groups, vec, per_thread):
        # Columns [j * vec, j * vec + vec) of this thread's vectors j of the block's column tile.
        a_view, b_view = views[:2]
        first = fx.block_idx.y * (groups.width * per_thread) + groups.lane
        js = [first + u * groups.width for u in range_constexpr(per_thread)]
        a = [rw.load(a_view, j, vec) for j in js]
        b = [rw.load(b_view, j, vec) for j in js]
        return js, a, b

    def silu_mul_store(out_view, js, a, b, vec):
        for u in range_constexpr(len(js)):
            y = rw.silu_mul(a[u].to(fx.Float32), b[u].to(fx.Float32))
            rw.store(out_view, js[u], y.to(dtype), vec)

    def phased_rows(tensors, groups, row, phase):
        # The edges go with the first column tile, their loads issued with its vectors'.
        pr = rw.PhasedRow(groups, tensors[0], row, phase, pvec, with_edges=fx.block_idx.y == 0)
        views = [pr.view(t) for t in tensors]
        ea, eb = views[0].load_edge(), views[1].load_edge()
        js, a, b = silu_mul_columns(views, groups, pvec, phased_per_thread)
        silu_mul_store(views[2], js, a, b, pvec)
        views[2].store_edge(rw.silu_mul(ea.to(fx.Float32), eb.to(fx.Float32)).to(dtype))

    def plain_rows(tensors, groups, row):
        views = [groups.view(t, row, vec) for t in tensors]
        js, a, b = silu_mul_columns(views, groups, vec, per_thread)
        silu_mul_store(views[2], js, a, b, vec)

    @flyc.kernel(known_block_size=[threads, 1, 1])
    def silu_mul_kernel(x0: fx.Tensor, x1: fx.Tensor, out: fx.Tensor, count: fx.Tensor):
        groups = rw.RowGroups(threads, rows)
        row = rw.counted_row(fx.block_idx.x * rows + groups.group, out, count)
        tensors = (x0, x1, out)
        rw.by_phase(phased, tensors, pvec, lambda phase: phased_rows(tensors, groups, row, phase),
                    lambda: plain_rows(tensors, groups, row))

    @flyc.jit
    def silu_mul(x0: fx.Tensor, x1: fx.Tensor, out: fx.Tensor, count: fx.Tensor,
                 stream: fx.Stream = fx.Stream(None)):
        m, k = x0.shape.unpack()
        silu_mul_kernel(x0, x1, out, count).launch(
            grid=((m + rows - 1) // rows, (k + cols_per_block - 1) // cols_per_block, 1),
            block=(threads, 1, 1), stream=stream)

    k = space.placeholder_cols(sig)  # placeholder sizes only; M and K stay dynamic
    args = [torch.empty(2, k, dtype=getattr(torch, sig["dtype"])) for _ in range(3)] + [torch.ones(1, dtype=torch.int32)]
    return silu_mul, args


TEMPLATE = Template(
    op="silu_mul", backend="flydsl", targets=("gfx942", "gfx950"),
    signatures={"dtype": tuple(space.ELEM_BYTES), **space.ROW_SIGNATURE},
    signature_valid=limits.vector_signature, space=space.SPACE, valid=space.valid, heuristic=_heuristic, build=build,
    occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR)
