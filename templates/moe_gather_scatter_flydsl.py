"""MoE token gather (scaled by the router score) and scatter-add for ROCm (FlyDSL), gfx942 / gfx950.

Same ops, semantics and calling conventions as moe_gather_scatter_cute.py (which follows
meta-pytorch/MSLK mslk/moe/gather_scatter.py):

gather_scale_dense_tokens: kernel(x, token_indices, expert_indices, scores, valid_count, out)
    out[i] = (x[t].float() * scores[t, e].float()).to(dtype), t, e = token_indices[i],
    expert_indices[i], for i < n (n = A, or min(valid_count[0], A) when sig["has_valid_count"]).
scatter_add_dense_tokens:  kernel(out, y, token_indices, valid_count, workspace)
    out[token_indices[i]] += y[i] for i < n, in place; rows whose token index is outside [0, T)
    are skipped. workspace [3 * T + 1 + 2 * A] int32 (torch.empty; used by method "sorted" only):
    counts [T], offsets [T + 1], positions [A], row lists [A], first rows [T] at offsets 0, T,
    2T+1, 2T+1+A, 2T+1+2A, the CuTe template's layout. Two methods (config["method"]), chosen as in the CuTe template (sorted
    once A * D * itemsize >= _gather_scatter_space.SORTED_MIN_BYTES):
    "sorted": group the rows by token, then add each token's rows in fp32 and write its out row
        once (rounded once; no data atomics). Five kernels on the stream: zero the counts; count
        (an int32 atomic add with return per row, global_atomic_add ... sc0, also gives the row's
        position among its token's rows, and position 0 is recorded per token, so the reduce
        fetches a token's first row without waiting for its offsets); exclusive scan of the
        counts (one block of 1024: each wave scans coalesced chunks of 64 with shuffles, on top
        of its offset from the 16 wave totals); place each row index in its token's list; reduce
        (block (t, c): token t's column chunk c, split like the gather). Tokens with no rows
        are not written. A token's rows are summed in the order the count atomics gave them, so
        sums of more than two rows may differ in the last fp32 bit between runs.
    "atomic": atomic adds in an unspecified order, each rounding to the dtype (as MSLK).

x, y, out [rows, D] contiguous; indices int32 [A]; valid_count [1] int32 (a dummy when unused).
Difference from the CuTe template: scores must have a unit column stride (row-major [T, E]; the
op layer makes column-major scores contiguous), since FlyDSL specializes a compiled kernel on
which dimension has unit stride; for the same reason D must be >= 2 (torch gives a [rows, 1]
tensor unit strides on both dimensions; the op layer runs one-column inputs as two columns).

Work split as in the CuTe template: block (i, c) handles row i, vectors [c*chunk, (c+1)*chunk)
with chunk = threads * unroll; threads is chosen at launch from D (whole waves of 64, at most
1024). Rows are reached through buffer descriptors sized to the row, so a vector past the row
end loads zeros and stores nothing: no branches in the tails. Loads are issued before stores.
The sorted reduce reads the out row and each of its token's rows with the same vectors (16-byte
buffer_load_dwordx4 on aligned rows) and keeps the sums in fp32 registers.
Atomic scatter: block (i, c) adds chunk c of row i (the CuTe template's column slices are not
ported). Atomics (relaxed, agent scope): aligned 16-bit rows add element pairs with
global_atomic_pk_add_bf16 / _f16 (gfx942 has no packed bf16 buffer atomic), fp32 rows use
global_atomic_add_f32, and 16-bit rows that are not 4-byte aligned fall back to one
compare-and-swap loop per element (LLVM's expansion of atomicrmw fadd on a 2-byte location).
"""
import functools

from mslk_dsl.template import Template
from mslk_dsl.templates import _gather_scatter_space as shared

TARGETS = ("gfx942", "gfx950")
WAVE = 64
MAX_THREADS = 1024
INDEX_THREADS = 256                 # sorted scatter: threads of the zero / count / place kernels
SCAN_THREADS, SCAN_ITEMS = 1024, 16  # sorted scatter: the one-block scan of the per-token counts


def _heuristic(target, sig, problem):
    rows = int(problem.get("A", 65536))
    return {"unroll": 1 if rows < 304 else 4}   # few rows: spread each over more blocks


def _scatter_heuristic(target, sig, problem):
    # The method by size, as the CuTe template (shared.scatter_method); the unroll as the gather's.
    return {**_heuristic(target, sig, problem), "method": shared.scatter_method(sig, problem)}


def _device_code(op, config, sig):
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl._mlir.dialects import llvm
    from flydsl.expr import const_expr, gpu, range_constexpr

    dtype = {"bfloat16": fx.BFloat16, "float16": fx.Float16, "float32": fx.Float32}[sig["dtype"]]
    VEC, UNROLL = shared.vec(sig), config["unroll"]
    HAS_N = bool(sig["has_valid_count"])
    WIDE = sig["dtype"] == "float32"
    # Atomic granule: fp32 one element; 16-bit two (packed) when rows are aligned, else one (CAS).
    PAIR = 1 if WIDE or VEC == 1 else 2
    SORTED = config.get("method") == "sorted"
    SCAN_WAVES = SCAN_THREADS // WAVE
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

    # -- method "sorted": group rows by token, then one fp32 reduction per out row ----------------
    def workspace(Ws, t, a):
        """Pointers to counts [t], offsets [t + 1], positions [a], row lists [a], first rows [t]
        in the workspace (the CuTe template's layout)."""
        base = fx.get_iter(Ws)
        return base, base + t, base + (2 * t + 1), base + (2 * t + 1 + a), base + (2 * t + 1 + 2 * a)

    def flat_index():
        return fx.block_idx.x * INDEX_THREADS + fx.thread_idx.x

    def lds_ints(*sizes):
        """int32 arrays in LDS (one allocator per kernel), as pointers."""
        fields = {f"a{i}": fx.Array[fx.Int32, n, 16] for i, n in enumerate(sizes)}
        storage = fx.struct(type("LdsInts", (), {"__annotations__": fields}))
        lds = fx.SharedAllocator().allocate(storage).peek()
        return [getattr(lds, f"a{i}").ptr for i in range(len(sizes))]

    def wave_inclusive_scan(x, lane, width):
        """Inclusive prefix sum over lanes [0, width) of the wave (shuffles up)."""
        for d in range_constexpr(width.bit_length() - 1):
            up = fx.Int32(gpu.shuffle_up(x, 1 << d, WAVE))
            x = x + (lane >= (1 << d)).select(up, fx.Int32(0))
        return x

    @flyc.kernel(name=NAME + "_zero", known_block_size=[INDEX_THREADS, 1, 1])
    def zero_kernel(Ws: fx.Tensor, t: fx.Int32):
        counts = fx.get_iter(Ws)
        i = flat_index()
        if i < t:
            counts[i] = fx.Int32(0)

    @flyc.kernel(name=NAME + "_count", known_block_size=[INDEX_THREADS, 1, 1])
    def count_kernel(Tok: fx.Tensor, N: fx.Tensor, Ws: fx.Tensor, t: fx.Int32):
        a = Tok.shape.unpack()      # a 1-D shape unpacks to a scalar
        counts, _, pos, _, first = workspace(Ws, t, a)
        i = flat_index()
        if i < rows_to_do(N, a):
            tok = fx.get_iter(Tok)[i]
            if fx.Uint32(tok) < fx.Uint32(t):   # out-of-range tokens (either end) are skipped
                # The old count is this row's position among its token's rows; position 0 is
                # also recorded per token, so the reduction fetches that row without the offsets.
                p = fx.atomic_add(counts + tok, fx.Int32(1), syncscope=fx.rocdl.SyncScope.Agent)
                pos[i] = p
                if p == 0:
                    first[tok] = i

    @flyc.kernel(name=NAME + "_scan", known_block_size=[SCAN_THREADS, 1, 1])
    def scan_kernel(Ws: fx.Tensor, t: fx.Int32, a: fx.Int32):
        # One block: offsets = exclusive prefix sum of counts, offsets[t] = total. Tiles of
        # SCAN_THREADS * items counts (items = SCAN_ITEMS, fewer when t is small, so that small
        # inputs spread over every wave); wave w owns `items` consecutive chunks of WAVE, so every
        # load and store is a coalesced wave access, and all of a tile's loads are issued before
        # the first is used (one block is latency-bound). Wave totals are scanned in LDS; each
        # chunk is scanned with shuffles on top of the running sum; a carry runs across tiles.
        counts, offsets, _, _, _ = workspace(Ws, t, a)
        tid = fx.thread_idx.x
        wave, lane = tid // WAVE, tid % WAVE
        s_wave, s_total = lds_ints(SCAN_WAVES, 1)
        items = (t + SCAN_THREADS - 1) // SCAN_THREADS
        items = (items < SCAN_ITEMS).select(items, fx.Int32(SCAN_ITEMS))
        carry = fx.Int32(0)
        for tile in range(0, t, SCAN_THREADS * items):
            seg = tile + wave * (WAVE * items) + lane
            vals = []
            total = fx.Int32(0)
            for u in range_constexpr(SCAN_ITEMS):   # clamped loads (all in flight), then masked
                i = seg + u * WAVE
                v = counts[(i < t).select(i, t - 1)]
                vals.append(((u < items) & (i < t)).select(v, fx.Int32(0)))
                total = total + vals[u]
            for d in range_constexpr(WAVE.bit_length() - 1):   # the wave's total, in every lane
                total = total + fx.Int32(gpu.shuffle_xor(total, 1 << d, WAVE))
            if lane == 0:
                s_wave[wave] = total
            gpu.barrier()
            if wave == 0:
                w = s_wave[(lane < SCAN_WAVES).select(lane, 0)]
                w = (lane < SCAN_WAVES).select(w, fx.Int32(0))
                w_incl = wave_inclusive_scan(w, lane, SCAN_WAVES)
                if lane < SCAN_WAVES:
                    s_wave[lane] = w_incl - w       # exclusive: the waves before this one
                if lane == SCAN_WAVES - 1:
                    s_total[0] = w_incl             # the tile's total
            gpu.barrier()
            run = carry + s_wave[wave]
            for u in range_constexpr(SCAN_ITEMS):
                # Chunks past `items` hold zeros: scanning them keeps the loop free of
                # data-dependent branches around the shuffles and adds nothing.
                i = seg + u * WAVE
                incl = wave_inclusive_scan(vals[u], lane, WAVE)
                if (u < items) & (i < t):
                    offsets[i] = run + incl - vals[u]
                run = run + fx.Int32(gpu.shuffle_idx(incl, WAVE - 1, WAVE))   # the chunk's total
            carry = carry + s_total[0]
            gpu.barrier()   # the next tile rewrites s_wave and s_total
        if tid == 0:
            offsets[t] = carry

    @flyc.kernel(name=NAME + "_place", known_block_size=[INDEX_THREADS, 1, 1])
    def place_kernel(Tok: fx.Tensor, N: fx.Tensor, Ws: fx.Tensor, t: fx.Int32):
        a = Tok.shape.unpack()
        _, offsets, pos, rows, _ = workspace(Ws, t, a)
        i = flat_index()
        if i < rows_to_do(N, a):
            tok = fx.get_iter(Tok)[i]
            if fx.Uint32(tok) < fx.Uint32(t):
                rows[offsets[tok] + pos[i]] = i

    @flyc.kernel(name=NAME + "_reduce")
    def reduce_kernel(Out: fx.Tensor, Y: fx.Tensor, Ws: fx.Tensor, nthr: fx.Int32):
        # Block (t, c): out[t] chunk c += the chunk of each of token t's rows, summed in fp32 and
        # rounded once. A token with no rows is not touched. Vectors past the row end load zeros
        # and store nothing (buffer bounds), as in the gather.
        t = fx.block_idx.x
        _, offsets, _, rows, first = workspace(Ws, Out.shape.unpack()[0], Y.shape.unpack()[0])
        start = offsets[t]
        count = offsets[t + 1] - start
        row0 = first[t]     # the first row, beside the offsets (read only when count > 0)
        if count > 0:
            ids = vector_ids(nthr)
            out = row_view(Out, t, VEC)
            # Register arrays (not Python values): the loop over the rows updates them in place.
            acc = [fx.make_rmem_tensor(VEC, fx.Float32) for _ in range(UNROLL)]
            firsts = load_vectors(row_view(Y, row0, VEC), ids)
            for j, r in enumerate(load_vectors(out, ids)):
                total = fx.memref_load_vec(r).to(fx.Float32) + fx.memref_load_vec(firsts[j]).to(fx.Float32)
                fx.memref_store_vec(total, acc[j])
            # Unrolled twice: two rows' loads in flight where the registers allow (unroll 8 of
            # 16-bit rows fills 128 VGPRs with one row's loads and the fp32 sums).
            for k in range(1, count, unroll=2):
                ys = load_vectors(row_view(Y, rows[start + k], VEC), ids)
                for j in range_constexpr(UNROLL):
                    total = fx.memref_load_vec(acc[j]) + fx.memref_load_vec(ys[j]).to(fx.Float32)
                    fx.memref_store_vec(total, acc[j])
            atom = fx.make_copy_atom(fx.rocdl.BufferCopy(VEC * dtype.width), dtype.width)
            for j in range_constexpr(UNROLL):
                r = fx.make_rmem_tensor(VEC, dtype)
                fx.memref_store_vec(fx.memref_load_vec(acc[j]).to(dtype), r)
                fx.copy(atom, r, fx.slice(out, (None, ids[j])))

    # Kernels launched with a block size chosen at run time (up to MAX_THREADS) must say so: with
    # no static block size the code object declares at most 256 work-items per workgroup, and a
    # larger launch is undefined behavior (the register budget assumes 256).
    ANY_BLOCK = {"rocdl.max_flat_work_group_size": MAX_THREADS}

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
            gather_kernel(X, Tok, Exp, S, N, Out, block[0], value_attrs=ANY_BLOCK).launch(
                grid=grid, block=block, stream=stream)
        return gather_scale_dense_tokens

    @flyc.jit
    def scatter_add_dense_tokens(Out: fx.Tensor, Y: fx.Tensor, Tok: fx.Tensor, N: fx.Tensor, Ws: fx.Tensor,
                                 stream: fx.Stream = fx.Stream(None)):
        t = Out.shape.unpack()[0]
        a, d = Y.shape.unpack()
        if const_expr(SORTED):
            t_blocks = ((t + INDEX_THREADS - 1) // INDEX_THREADS, 1, 1)
            a_blocks = ((a + INDEX_THREADS - 1) // INDEX_THREADS, 1, 1)
            index_block = (INDEX_THREADS, 1, 1)
            zero_kernel(Ws, t).launch(grid=t_blocks, block=index_block, stream=stream)
            count_kernel(Tok, N, Ws, t).launch(grid=a_blocks, block=index_block, stream=stream)
            scan_kernel(Ws, t, a).launch(grid=(1, 1, 1), block=(SCAN_THREADS, 1, 1), stream=stream)
            place_kernel(Tok, N, Ws, t).launch(grid=a_blocks, block=index_block, stream=stream)
            grid, block = grid_and_block(t, d)
            reduce_kernel(Out, Y, Ws, block[0], value_attrs=ANY_BLOCK).launch(
                grid=grid, block=block, stream=stream)
        else:
            grid, block = grid_and_block(a, d)
            scatter_kernel(Out, Y, Tok, N, block[0], value_attrs=ANY_BLOCK).launch(
                grid=grid, block=block, stream=stream)
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
    workspace = torch.zeros(3 * 3 + 1 + 2 * 6, dtype=torch.int32)
    return [torch.zeros(3, d, dtype=dtype), torch.zeros(6, d, dtype=dtype), idx, count, workspace]


def _build(config, target, sig, op):
    return _device_code(op, config, sig), _placeholders(op, sig)


def _template(op, signatures, space, heuristic):
    return Template(op=op, backend="flydsl", targets=TARGETS, signatures=signatures, space=space,
                    heuristic=heuristic, build=functools.partial(_build, op=op))


UNROLLS = (1, 2, 4, 8)
TEMPLATES = [
    _template("gather_scale_dense_tokens", {**shared.SIGNATURES, "score_dtype": shared.SCORE_DTYPES},
              {"unroll": UNROLLS}, _heuristic),
    _template("scatter_add_dense_tokens", shared.SIGNATURES, {"unroll": UNROLLS, "method": ("atomic", "sorted")},
              _scatter_heuristic),
]
