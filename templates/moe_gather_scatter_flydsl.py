"""MoE token gather (scaled by the router score) and scatter-add for ROCm (FlyDSL), gfx942 / gfx950.

Same ops, semantics and calling conventions as moe_gather_scatter_cute.py (which follows
meta-pytorch/MSLK mslk/moe/gather_scatter.py):

gather_scale_dense_tokens: kernel(x, token_indices, expert_indices, scores, valid_count, out)
    out[i] = (x[t].float() * scores[t, e].float()).to(dtype), t, e = token_indices[i],
    expert_indices[i], for i < n (n = A, or min(valid_count[0], A) when sig["has_valid_count"]).
scatter_add_dense_tokens:  kernel(out, y, token_indices, valid_count, workspace)
    out[token_indices[i]] += y[i] for i < n, in place, with atomic adds in an unspecified order
    (the CuTe template's "atomic" method; the workspace, for its "sorted" method, is unused).

x, y, out [rows, D] contiguous; indices int32 [A]; valid_count [1] int32 (a dummy when unused).
Difference from the CuTe template: scores must have a unit column stride (row-major [T, E]; the
op layer makes column-major scores contiguous), since FlyDSL specializes a compiled kernel on
which dimension has unit stride; for the same reason D must be >= 2 (torch gives a [rows, 1]
tensor unit strides on both dimensions).

Work split as in the CuTe template: block (i, c) handles row i, vectors [c*chunk, (c+1)*chunk)
with chunk = threads * unroll; threads is chosen at launch from D (whole waves of 64, at most
1024). Rows are reached through buffer descriptors sized to the row, so a vector past the row
end loads zeros and stores nothing: no branches in the tails. Loads are issued before stores.
Atomics (relaxed, agent scope): aligned 16-bit rows add element pairs with
global_atomic_pk_add_bf16 / _f16 (gfx942 has no packed bf16 buffer atomic), fp32 rows use
global_atomic_add_f32, and 16-bit rows that are not 4-byte aligned fall back to one
compare-and-swap loop per element (LLVM's expansion of atomicrmw fadd on a 2-byte location).
"""
import functools

from mslk_dsl.template import Template

DTYPES = ("bfloat16", "float16", "float32")
SCORE_DTYPES = ("bfloat16", "float32")
TARGETS = ("gfx942", "gfx950")
WAVE = 64
MAX_THREADS = 1024


def _vec(sig):
    itemsize = 4 if sig["dtype"] == "float32" else 2
    return 16 // itemsize if sig["aligned"] else 1


def _heuristic(target, sig, problem):
    rows = int(problem.get("A", 65536))
    return {"unroll": 1 if rows < 304 else 4}   # few rows: spread each over more blocks


def _device_code(op, config, sig):
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl._mlir.dialects import llvm
    from flydsl.expr import const_expr, range_constexpr

    dtype = {"bfloat16": fx.BFloat16, "float16": fx.Float16, "float32": fx.Float32}[sig["dtype"]]
    VEC, UNROLL = _vec(sig), config["unroll"]
    HAS_N = bool(sig["has_valid_count"])
    WIDE = sig["dtype"] == "float32"
    # Atomic granule: fp32 one element; 16-bit two (packed) when rows are aligned, else one (CAS).
    PAIR = 1 if WIDE or VEC == 1 else 2
    NAME = f"mslk_{op}_{sig['dtype']}_v{VEC}_u{UNROLL}{'_n' if HAS_N else ''}"

    def rows_to_do(n_tensor, a):
        if const_expr(HAS_N):
            n = fx.get_iter(n_tensor).load()
            return (n < a).select(n, a)
        return a

    def row_view(tensor, row, group):
        """Row ``row`` as a buffer view of ``group``-element pieces, bounded by the row."""
        _, cols = tensor.shape.unpack()
        row_stride, _ = tensor.stride.unpack()
        base = fx.get_iter(tensor) + fx.Int64(row) * fx.Int64(row_stride)
        buf = fx.rocdl.make_buffer_ptr(base, num_records_bytes=fx.Int64(cols) * (dtype.width // 8))
        return fx.logical_divide(fx.make_view(buf, fx.make_layout(cols, 1)), fx.make_layout(group, 1))

    def vector_ids(nthr):
        # The block size comes as an argument: reading blockDim would link ROCm's device library.
        tid = fx.thread_idx.x
        c = fx.block_idx.y
        return [(c * UNROLL + j) * nthr + tid for j in range(UNROLL)]

    def load_vectors(view, ids):
        atom = fx.make_copy_atom(fx.rocdl.BufferCopy(VEC * dtype.width), dtype.width)
        regs = []
        for j in ids:   # all loads first (memory-level parallelism)
            r = fx.make_rmem_tensor(VEC, dtype)
            fx.copy(atom, fx.slice(view, (None, j)), r)
            regs.append(r)
        return regs

    @flyc.kernel(name=NAME + "_gather")
    def gather_kernel(X: fx.Tensor, Tok: fx.Tensor, Exp: fx.Tensor, S: fx.Tensor, N: fx.Tensor,
                      Out: fx.Tensor, nthr: fx.Int32):
        row = fx.block_idx.x
        a = Out.shape.unpack()[0]
        if row < rows_to_do(N, a):
            t = (fx.get_iter(Tok) + row).load()
            e = (fx.get_iter(Exp) + row).load()
            s_stride, _ = S.stride.unpack()
            s = (fx.get_iter(S) + fx.Int64(t) * fx.Int64(s_stride) + e).load().to(fx.Float32)
            ids = vector_ids(nthr)
            regs = load_vectors(row_view(X, t, VEC), ids)
            out = row_view(Out, row, VEC)
            atom = fx.make_copy_atom(fx.rocdl.BufferCopy(VEC * dtype.width), dtype.width)
            for j in range_constexpr(UNROLL):
                v = (fx.memref_load_vec(regs[j]).to(fx.Float32) * s).to(dtype)
                fx.memref_store_vec(v, regs[j])
                fx.copy(atom, regs[j], fx.slice(out, (None, ids[j])))

    @flyc.kernel(name=NAME + "_scatter")
    def scatter_kernel(Out: fx.Tensor, Y: fx.Tensor, Tok: fx.Tensor, N: fx.Tensor, nthr: fx.Int32):
        row = fx.block_idx.x
        a = Y.shape.unpack()[0]
        if row < rows_to_do(N, a):
            t = (fx.get_iter(Tok) + row).load()
            ids = vector_ids(nthr)
            regs = load_vectors(row_view(Y, row, VEC), ids)
            nvec = Y.shape.unpack()[1] // VEC
            # A token index outside [0, T) skips the row (an unsigned compare covers both ends).
            valid = fx.Uint32(t) < fx.Uint32(Out.shape.unpack()[0])
            dst = fx.get_iter(Out) + fx.Int64(t) * fx.Int64(Out.stride.unpack()[0])
            for j in range_constexpr(UNROLL):
                if valid & (ids[j] < nvec):
                    vals = fx.memref_load_vec(regs[j])
                    for p in range_constexpr(VEC // PAIR):
                        piece = [vals[p * PAIR + q] for q in range(PAIR)]
                        value = fx.Vector.from_elements(piece, dtype).ir_value() if const_expr(PAIR == 2) \
                            else dtype(piece[0]).ir_value()
                        # llvm atomicrmw fadd: <2 x bf16/f16> -> global_atomic_pk_add_*, f32 ->
                        # global_atomic_add_f32, a lone 16-bit element -> compare-and-swap loop.
                        llvm.atomicrmw(llvm.AtomicBinOp.fadd,
                                       fx.to_llvm_ptr(dst + fx.Int64(ids[j]) * VEC + p * PAIR), value,
                                       llvm.AtomicOrdering.monotonic, syncscope="agent",
                                       alignment=PAIR * dtype.width // 8)

    def grid_and_block(a, d):
        nvec = d // VEC
        threads = (nvec + UNROLL * WAVE - 1) // (UNROLL * WAVE) * WAVE
        threads = (threads < MAX_THREADS).select(threads, MAX_THREADS)
        return (a, (nvec + threads * UNROLL - 1) // (threads * UNROLL), 1), (threads, 1, 1)

    if op == "gather_scale_dense_tokens":
        @flyc.jit
        def gather_scale_dense_tokens(X: fx.Tensor, Tok: fx.Tensor, Exp: fx.Tensor, S: fx.Tensor,
                                      N: fx.Tensor, Out: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
            grid, block = grid_and_block(Out.shape.unpack()[0], X.shape.unpack()[1])
            gather_kernel(X, Tok, Exp, S, N, Out, block[0]).launch(grid=grid, block=block, stream=stream)
        return gather_scale_dense_tokens

    @flyc.jit
    def scatter_add_dense_tokens(Out: fx.Tensor, Y: fx.Tensor, Tok: fx.Tensor, N: fx.Tensor, Ws: fx.Tensor,
                                 stream: fx.Stream = fx.Stream(None)):
        grid, block = grid_and_block(Y.shape.unpack()[0], Y.shape.unpack()[1])
        scatter_kernel(Out, Y, Tok, N, block[0]).launch(grid=grid, block=block, stream=stream)
    return scatter_add_dense_tokens


def _placeholders(op, sig):
    import torch

    dtype = getattr(torch, sig["dtype"])
    d = 64 if sig["aligned"] else 63          # placeholder sizes only; every size stays dynamic
    idx = torch.zeros(6, dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int32)
    if op == "gather_scale_dense_tokens":
        scores = torch.zeros(3, 5, dtype=getattr(torch, sig["score_dtype"]))
        return [torch.zeros(3, d, dtype=dtype), idx, idx.clone(), scores, count, torch.zeros(6, d, dtype=dtype)]
    workspace = torch.zeros(2 * 3 + 1 + 2 * 6, dtype=torch.int32)
    return [torch.zeros(3, d, dtype=dtype), torch.zeros(6, d, dtype=dtype), idx, count, workspace]


def _build(config, target, sig, op):
    return _device_code(op, config, sig), _placeholders(op, sig)


def _template(op, signatures):
    return Template(op=op, backend="flydsl", targets=TARGETS, signatures=signatures,
                    space={"unroll": (1, 2, 4, 8)}, heuristic=_heuristic,
                    build=functools.partial(_build, op=op))


_COMMON = {"dtype": DTYPES, "aligned": (True, False), "has_valid_count": (False, True)}
TEMPLATES = [
    _template("gather_scale_dense_tokens", {**_COMMON, "score_dtype": SCORE_DTYPES}),
    _template("scatter_add_dense_tokens", _COMMON),
]
