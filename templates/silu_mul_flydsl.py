"""silu_mul for AMD CDNA (FlyDSL): out = silu(x0) * x1, computed in fp32, rounded to the dtype.

Calling convention: ``kernel(x0, x1, out, count)``; x0, x1, out [M, K] of one dtype
(bf16/fp16/fp32, unit column stride); count [1] int32: rows from count[0] on are neither read
nor written (MSLK's valid_token_count; the op passes 2^31 - 1 without one). M and K are
dynamic; M and K tails are bounds-checked by the buffer descriptors (see _flydsl_rowwise), so no
size needs padding.

Grid: (row blocks, column blocks). A block holds ``rows_per_block`` rows; each of its threads
loads 32 register bytes of each input (two 16-byte vectors, or eight scalars when vec is 1),
all loads issued before any math.
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

    @flyc.kernel(known_block_size=[threads, 1, 1])
    def silu_mul_kernel(x0: fx.Tensor, x1: fx.Tensor, out: fx.Tensor, count: fx.Tensor):
        groups = rw.RowGroups(threads, rows)
        row = rw.counted_row(fx.block_idx.x * rows + groups.group, out, count)
        a_view, b_view, out_view = groups.view(x0, row, vec), groups.view(x1, row, vec), groups.view(out, row, vec)
        first = fx.block_idx.y * (groups.width * per_thread) + groups.lane
        js = [first + u * groups.width for u in range_constexpr(per_thread)]
        a = [rw.load(a_view, j, vec) for j in js]
        b = [rw.load(b_view, j, vec) for j in js]
        for u in range_constexpr(per_thread):
            y = rw.silu_mul(a[u].to(fx.Float32), b[u].to(fx.Float32))
            rw.store(out_view, js[u], y.to(dtype), vec)

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
