"""MoE token gather (scaled by the router score) and scatter-add for NVIDIA Hopper, in CuTe DSL.

Semantics follow meta-pytorch/MSLK (mslk/moe/gather_scatter.py, its Triton kernels
``_mslk_gather_scale_dense_tokens`` and ``_mslk_scatter_add_dense_tokens``).

gather_scale_dense_tokens:
    kernel(x, token_indices, expert_indices, scores, valid_count, out)
    x [T, D] dtype; token_indices, expert_indices [A] int32; scores [T, E] bf16/fp32, any strides
    (row- or column-major, as MSLK); valid_count [1] int32, read only if sig["has_valid_count"]
    (else any 1-element int32 tensor); out [A, D] dtype, preallocated (torch.empty).
    For every row i < n (n = A, or min(valid_count[0], A)):
        t, e = token_indices[i], expert_indices[i]
        out[i] = (x[t].float() * scores[t, e].float()).to(dtype)
    Rows at and past n are not written (MSLK leaves them uninitialized too).
scatter_add_dense_tokens:
    kernel(out, y, token_indices, valid_count, workspace)
    out [T, D] dtype, updated in place; y [A, D] dtype; token_indices [A] int32; valid_count as
    above; workspace [3 * T + 1 + 2 * A] int32 (torch.empty; used by method "sorted" only).
    For every row i < n: out[token_indices[i]] += y[i]. Rows whose token index is outside
    [0, T) are skipped (MSLK writes out of bounds).
    Two methods (config["method"]):
    "sorted" (large problems): group the rows by token first, then add each token's rows in
        fp32 and write its out row once; no data atomics, so out crosses DRAM once each way and
        bf16/fp16 sums round once (MSLK's tl.atomic_add rounds after every addition). Five
        kernels on the stream: zero the per-token counts; count (an int32 atomic per row also
        gives the row's position among its token's rows, and the row at position 0 is recorded
        per token); exclusive scan of the counts (one block); place each row index in its
        token's list; reduce (block (t, c): token t's column chunk c, like the gather; the first
        row comes from the per-token record, so its loads wait for one index load, not two).
        The order of a token's rows in its list follows the count atomics, so it is unspecified: sums of more than two rows may differ in the last
        fp32 bit between runs (exact whenever the fp32 sums are exact).
    "atomic" (small problems, where the four extra launches would cost more than they save):
        atomic adds, like MSLK: 128-bit vector reductions (REDG.ADD.BF16x8 / F16x8 / F32x4) on
        aligned rows, scalar atomics otherwise (a compare-and-swap loop for a lone bf16/fp16). A
        token that receives several rows (top_k > 1) gets them in an unspecified order and, for
        bf16/fp16, each addition rounds to the output dtype (as MSLK); fp32 atomic adds flush
        subnormals (hardware semantics, as CUDA's atomicAdd).

Gather: token indices must lie in [0, T) for rows below n (not checked on the device, as MSLK). Sizes T,
A, D, E are dynamic. ``sig["aligned"]``: every row starts 16-byte aligned and D * itemsize is a
multiple of 16; then one access moves 16 bytes, else one element.

Work split, gather: block (i, c) handles row i, vectors [c * chunk, (c + 1) * chunk) with
chunk = threads * unroll vectors. The block size is chosen at launch from D
(threads = ceil(vectors per row / unroll), rounded up to a warp, at most 1024), so 5120-, 7168-
and 8192-wide bf16 rows are covered exactly by 160, 224 and 256 threads with unroll 4.
Atomic scatter: in MoE order (rows grouped by expert) the top_k rows of a token arrive far apart, so
whole-row updates re-read and re-write each out row from DRAM top_k times (measured: 35-43% of
the copy roofline at top_k 4-8). Blocks therefore take column slices: block (b, c) adds slice c
(a power-of-two number of vectors, >= 256 bytes) of 256 * unroll / slice consecutive input rows,
and blockIdx.x runs over all rows of a slice before the next slice starts. The slice is chosen at
launch so that 2 * T * slice bytes (the data touched between two updates of one out slice) stays
under 16 MB: the out slice stays in L2 and every out element crosses DRAM once each way.
Each thread issues all its loads before any store or atomic (memory-level parallelism); lanes past
the data re-load a valid vector and store nothing, so there are no out-of-bounds accesses.
Differences from MSLK: any D (MSLK needs D % 1024 == 0, or 512 for few rows); int32 indices
only (the op layer converts int64 ones).
"""
import functools

from mslk_dsl.template import Template
from mslk_dsl.templates import _gather_scatter_space as shared

MAX_THREADS = 1024
SCATTER_THREADS = 256
# Scatter works on column slices narrow enough that the rows of `out` a slice touches stay in L2
# while the input rows stream by: reuse distance ~ 2 * T * slice bytes kept under REUSE_BYTES
# (Hopper's L2 is 50 MB, in two partitions).
REUSE_BYTES = 16 << 20
MIN_SLICE_BYTES = 256
INDEX_THREADS = 256                 # sorted scatter: threads of the count / place kernels
SCAN_THREADS, SCAN_ITEMS = 1024, 32  # sorted scatter: the one-block scan of the per-token counts


def _heuristic(target, sig, problem):
    # Few rows: shorter chunks spread a row over more blocks (MSLK splits D likewise).
    rows = int(problem.get("A", 65536))
    return {"unroll": 1 if rows < 132 else 4}


def _scatter_heuristic(target, sig, problem):
    # The method by size (shared.scatter_method). The sorted reduction wants more, lighter threads
    # the more rows each token sums (measured on the H200 at T = 65536, D = 5120: unroll 4 best
    # for 1 row per token, unroll 1 for 8, unroll 2 within 3% of the best for both).
    if shared.scatter_method(sig, problem) == "atomic":
        return {**_heuristic(target, sig, problem), "method": "atomic"}
    rows = int(problem.get("A", 65536))
    per_token = rows / max(int(problem.get("T", rows)), 1)
    return {"unroll": 1 if per_token >= 6 else 2 if per_token >= 2 else 4, "method": "sorted"}


def _device_code(op, config, sig):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr

    dt = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}
    dtype = dt[sig["dtype"]]
    VEC, UNROLL = shared.vec(sig), config["unroll"]
    HAS_N = bool(sig["has_valid_count"])
    SORTED = config.get("method") == "sorted"
    ELEM_BYTES = dtype.width // 8
    SLOTS = SCATTER_THREADS * UNROLL                                 # vectors per scatter block
    K_MIN = (MIN_SLICE_BYTES // (VEC * ELEM_BYTES)).bit_length() - 1
    K_MAX = SLOTS.bit_length() - 1
    # Inputs read once: keep them out of L1.
    STREAM = cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE

    def rows_to_do(valid_count, a):
        n = a
        if const_expr(HAS_N):
            n = cutlass.min(valid_count[0], a)
        return n

    def vector_ids(nvec):
        """This thread's vector indices in its block's chunk, and whether each is in the row."""
        tidx, _, _ = cute.arch.thread_idx()
        _, c, _ = cute.arch.block_idx()
        nthr, _, _ = cute.arch.block_dim()
        ids, ok = [], []
        for j in range(UNROLL):  # plain Python (helpers are not preprocessed): unrolled
            v = (c * UNROLL + j) * nthr + tidx
            ids.append(cutlass.min(v, nvec - 1))
            ok.append(v < nvec)
        return ids, ok

    def load_row(src_vecs, ids):
        frags = []
        for j in range(UNROLL):
            f = cute.make_rmem_tensor((VEC,), dtype)
            cute.autovec_copy(src_vecs[None, ids[j]], f, l1c_evict_priority=STREAM)
            frags.append(f)
        return frags

    @cute.kernel
    def gather_kernel(mX: cute.Tensor, mTok: cute.Tensor, mExp: cute.Tensor, mScore: cute.Tensor,
                      mN: cute.Tensor, mOut: cute.Tensor):
        row, _, _ = cute.arch.block_idx()
        if row < rows_to_do(mN, mOut.shape[0]):
            t = mTok[row]
            s = mScore[t, mExp[row]].to(Float32)
            nvec = mX.shape[1] // VEC
            ids, ok = vector_ids(nvec)
            frags = load_row(cute.zipped_divide(mX[t, None], (VEC,)), ids)
            out_vecs = cute.zipped_divide(mOut[row, None], (VEC,))
            r = cute.make_rmem_tensor((VEC,), dtype)
            for j in cutlass.range_constexpr(UNROLL):
                if ok[j]:
                    r.store((frags[j].load().to(Float32) * s).to(dtype))
                    cute.autovec_copy(r, out_vecs[None, ids[j]])

    @cute.kernel
    def scatter_kernel(mOut: cute.Tensor, mY: cute.Tensor, mTok: cute.Tensor, mN: cute.Tensor,
                       log2_slice: Int32):
        # Block (b, c): slice c (vectors [c * slice, (c + 1) * slice)) of rows_per_block rows.
        tidx, _, _ = cute.arch.thread_idx()
        rb, c, _ = cute.arch.block_idx()
        a, d = mY.shape
        n = rows_to_do(mN, a)
        nvec = d // VEC
        slice_vecs = Int32(1) << log2_slice
        rows_per_block = Int32(SLOTS) >> log2_slice
        frags, toks, vs, ok = [], [], [], []
        for j in cutlass.range_constexpr(UNROLL):   # every load first (clamped in bounds), then atomics
            slot = j * SCATTER_THREADS + tidx
            row = rb * rows_per_block + (slot >> log2_slice)
            v = c * slice_vecs + (slot & (slice_vecs - 1))
            row_c, v_c = cutlass.min(row, a - 1), cutlass.min(v, nvec - 1)
            f = cute.make_rmem_tensor((VEC,), dtype)
            cute.autovec_copy(cute.zipped_divide(mY[row_c, None], (VEC,))[None, v_c], f,
                              l1c_evict_priority=STREAM)
            frags.append(f)
            tok = mTok[row_c]
            ok.append((row < n) & (v < nvec) & (tok >= 0) & (tok < mOut.shape[0]))
            toks.append(tok)
            vs.append(v_c)
        for j in cutlass.range_constexpr(UNROLL):
            if ok[j]:
                dst = cute.zipped_divide(mOut[toks[j], None], (VEC,))[None, vs[j]].iterator
                if const_expr(VEC == 1):
                    cute.arch.atomic_add(dst, frags[j][0], sem="relaxed", scope="gpu")
                else:
                    cute.arch.atomic_add(dst, frags[j].load().ir_value(), sem="relaxed", scope="gpu")

    # -- method "sorted": group rows by token, then one fp32 reduction per out row ----------------
    def workspace_views(mWs, t, a):
        """counts [t], offsets [t + 1], positions [a], row lists [a], first rows [t] inside the
        workspace."""
        base = mWs.iterator
        return (cute.make_tensor(base, cute.make_layout(t)),
                cute.make_tensor(base + t, cute.make_layout(t + 1)),
                cute.make_tensor(base + (2 * t + 1), cute.make_layout(a)),
                cute.make_tensor(base + (2 * t + 1 + a), cute.make_layout(a)),
                cute.make_tensor(base + (2 * t + 1 + 2 * a), cute.make_layout(t)))

    def flat_index():
        tidx, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        return b * INDEX_THREADS + tidx

    @cute.kernel
    def zero_kernel(mWs: cute.Tensor, t: Int32, a: Int32):
        counts, _, _, _, _ = workspace_views(mWs, t, a)
        i = flat_index()
        if i < t:
            counts[i] = 0

    def routed_row(mTok, mN, t):
        """This thread's input row i, its token, and whether it is added (i < n, token in [0, t))."""
        a = mTok.shape[0]
        i = flat_index()
        tok = mTok[cutlass.min(i, a - 1)]
        return i, tok, (i < rows_to_do(mN, a)) & (tok >= 0) & (tok < t)

    @cute.kernel
    def count_kernel(mTok: cute.Tensor, mN: cute.Tensor, mWs: cute.Tensor, t: Int32):
        counts, _, pos, _, first = workspace_views(mWs, t, mTok.shape[0])
        i, tok, routed = routed_row(mTok, mN, t)
        if routed:
            # The old count is this row's position among its token's rows; position 0 is also
            # recorded per token, so the reduction can fetch that row without the offsets.
            p = cute.arch.atomic_add((counts.iterator + tok).llvm_ptr, Int32(1), sem="relaxed", scope="gpu")
            pos[i] = p
            if p == 0:
                first[tok] = i

    def warp_inclusive_scan(x, lane):
        """Inclusive prefix sum of x over the 32 lanes of a warp (every lane must take part)."""
        incl = x
        for d in (1, 2, 4, 8, 16):
            up = cute.arch.shuffle_sync_up(incl, offset=d)
            incl = cutlass.select_(lane >= d, incl + up, incl)
        return incl

    @cute.kernel
    def scan_kernel(mWs: cute.Tensor, t: Int32, a: Int32):
        # One block: offsets = exclusive prefix sum of counts, offsets[t] = total. Tiles of
        # SCAN_THREADS * items counts (items = SCAN_ITEMS, fewer when t is small, so that small
        # inputs spread over every warp); warp w owns `items` consecutive chunks of 32, so every
        # load and store is a coalesced 128-byte warp access, and all of a tile's loads are
        # issued before the first is used (a single block is latency-bound: one load round trip
        # per tile). Warp totals are scanned through shared memory; each chunk is scanned with
        # shuffles on top of the running sum; a carry runs across tiles.
        counts, offsets, _, _, _ = workspace_views(mWs, t, a)
        tidx, _, _ = cute.arch.thread_idx()
        warp, lane = tidx // 32, tidx % 32
        smem = cutlass.memory.SmemAllocator()
        # [0, warps): the warps' exclusive offsets in the tile; [warps]: the tile's total
        s_warp = smem.allocate_tensor(Int32, cute.make_layout(SCAN_THREADS // 32 + 1), byte_alignment=16)
        items = cutlass.min((t + SCAN_THREADS - 1) // SCAN_THREADS, SCAN_ITEMS)
        carry = Int32(0)
        for tile in range(0, t, SCAN_THREADS * items):
            seg = tile + warp * (32 * items) + lane
            vals = cute.make_rmem_tensor((SCAN_ITEMS,), Int32)
            total = Int32(0)
            for u in cutlass.range_constexpr(SCAN_ITEMS):
                v = counts[cutlass.min(seg + u * 32, t - 1)]
                vals[u] = Int32(cutlass.select_((u < items) & (seg + u * 32 < t), v, Int32(0)))
                total = total + vals[u]
            for d in (16, 8, 4, 2, 1):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=d)
            if lane == 0:
                s_warp[warp] = total
            cute.arch.sync_threads()
            if warp == 0:
                w = s_warp[lane]
                w_incl = warp_inclusive_scan(w, lane)
                s_warp[lane] = w_incl - w
                if lane == 31:
                    s_warp[SCAN_THREADS // 32] = w_incl
            cute.arch.sync_threads()
            run = carry + s_warp[warp]
            for u in cutlass.range_constexpr(SCAN_ITEMS):
                if u < items:   # the same for the whole block: no divergence around the shuffles
                    x = vals[u]
                    incl = warp_inclusive_scan(x, lane)
                    if seg + u * 32 < t:
                        offsets[seg + u * 32] = run + incl - x
                    run = run + cute.arch.shuffle_sync(incl, offset=31)
            carry = carry + s_warp[SCAN_THREADS // 32]
            cute.arch.sync_threads()   # s_warp is rewritten by the next tile
        if tidx == 0:
            offsets[t] = carry

    @cute.kernel
    def place_kernel(mTok: cute.Tensor, mN: cute.Tensor, mWs: cute.Tensor, t: Int32):
        _, offsets, pos, rows, _ = workspace_views(mWs, t, mTok.shape[0])
        i, tok, routed = routed_row(mTok, mN, t)
        if routed:
            rows[offsets[tok] + pos[i]] = i

    @cute.kernel
    def reduce_kernel(mOut: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor):
        # Block (t, c): out[t] chunk c += the chunk of each of token t's rows, summed in fp32.
        t, _, _ = cute.arch.block_idx()
        n_tok = mOut.shape[0]
        _, offsets, _, rows, first = workspace_views(mWs, n_tok, mY.shape[0])
        # The token's first row comes straight from first[t], loaded beside its offsets (only
        # read when the token has rows): its data loads wait for one index load, as the
        # gather's do, instead of two (offsets, then the list).
        start = offsets[t]
        count = offsets[t + 1] - start
        row0 = first[t]
        if count > 0:
            nvec = mOut.shape[1] // VEC
            ids, ok = vector_ids(nvec)
            out_vecs = cute.zipped_divide(mOut[t, None], (VEC,))
            frags = load_row(out_vecs, ids)
            ys = load_row(cute.zipped_divide(mY[row0, None], (VEC,)), ids)
            acc = []
            for j in cutlass.range_constexpr(UNROLL):
                f = cute.make_rmem_tensor((VEC,), Float32)
                f.store(frags[j].load().to(Float32) + ys[j].load().to(Float32))
                acc.append(f)
            for k in cutlass.range(1, count, unroll=2):
                row = rows[start + k]
                ys = load_row(cute.zipped_divide(mY[row, None], (VEC,)), ids)
                for j in cutlass.range_constexpr(UNROLL):
                    acc[j].store(acc[j].load() + ys[j].load().to(Float32))
            r = cute.make_rmem_tensor((VEC,), dtype)
            for j in cutlass.range_constexpr(UNROLL):
                if ok[j]:
                    r.store(acc[j].load().to(dtype))
                    cute.autovec_copy(r, out_vecs[None, ids[j]])

    def scatter_launch(t, a, d):
        """(grid, log2 of the slice in vectors) for out rows t, input rows a, width d."""
        nvec = d // VEC
        # The largest power of two with 2 * t * slice * vec_bytes <= REUSE_BYTES, at least
        # MIN_SLICE_BYTES, at most a block's slots, and no wider than the row rounded up.
        fits = Int32(REUSE_BYTES // (2 * VEC * ELEM_BYTES)) // t
        k = Int32(K_MIN)
        for kk in range(K_MIN + 1, K_MAX + 1):   # plain Python: unrolled at trace time
            k = Int32(cutlass.select_((fits >= (1 << kk)) & (nvec > (1 << (kk - 1))), Int32(kk), k))
        rows_per_block = Int32(SLOTS) >> k
        slices = (nvec + (Int32(1) << k) - 1) >> k
        return ((a + rows_per_block - 1) // rows_per_block, slices, 1), k

    def grid_and_block(a, d):
        nvec = d // VEC
        threads = cutlass.min((nvec + UNROLL * 32 - 1) // (UNROLL * 32) * 32, MAX_THREADS)
        chunks = (nvec + threads * UNROLL - 1) // (threads * UNROLL)
        return (a, chunks, 1), (threads, 1, 1)

    if op == "gather_scale_dense_tokens":
        @cute.jit
        def gather_scale_dense_tokens(mX: cute.Tensor, mTok: cute.Tensor, mExp: cute.Tensor,
                                      mScore: cute.Tensor, mN: cute.Tensor, mOut: cute.Tensor, stream):
            grid, block = grid_and_block(mOut.shape[0], mX.shape[1])
            gather_kernel(mX, mTok, mExp, mScore, mN, mOut).launch(grid=grid, block=block, stream=stream)
        return gather_scale_dense_tokens, dtype

    @cute.jit
    def scatter_add_dense_tokens(mOut: cute.Tensor, mY: cute.Tensor, mTok: cute.Tensor, mN: cute.Tensor,
                                 mWs: cute.Tensor, stream):
        t, (a, d) = mOut.shape[0], mY.shape
        if const_expr(SORTED):
            t_blocks = ((t + INDEX_THREADS - 1) // INDEX_THREADS, 1, 1)
            a_blocks = ((a + INDEX_THREADS - 1) // INDEX_THREADS, 1, 1)
            index_block = (INDEX_THREADS, 1, 1)
            zero_kernel(mWs, t, a).launch(grid=t_blocks, block=index_block, stream=stream)
            count_kernel(mTok, mN, mWs, t).launch(grid=a_blocks, block=index_block, stream=stream)
            scan_kernel(mWs, t, a).launch(grid=(1, 1, 1), block=(SCAN_THREADS, 1, 1), stream=stream)
            place_kernel(mTok, mN, mWs, t).launch(grid=a_blocks, block=index_block, stream=stream)
            grid, block = grid_and_block(t, d)
            reduce_kernel(mOut, mY, mWs).launch(grid=grid, block=block, stream=stream)
        else:
            grid, log2_slice = scatter_launch(t, a, d)
            scatter_kernel(mOut, mY, mTok, mN, log2_slice).launch(
                grid=grid, block=(SCATTER_THREADS, 1, 1), stream=stream)
    return scatter_add_dense_tokens, dtype


def _build(config, target, sig, op):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    launcher, dtype = _device_code(op, config, sig)
    vec = shared.vec(sig)
    align = 16 if sig["aligned"] else dtype.width // 8
    t, a, d = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=vec)

    def rows(m):
        return make_fake_compact_tensor(dtype, (m, d), stride_order=(1, 0), assumed_align=align)

    def index():
        return make_fake_compact_tensor(cutlass.Int32, (a,))

    count = make_fake_compact_tensor(cutlass.Int32, (1,))
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    if op == "gather_scale_dense_tokens":
        score_dt = cutlass.BFloat16 if sig["score_dtype"] == "bfloat16" else cutlass.Float32
        scores = make_fake_tensor(score_dt, (t, cute.sym_int()), stride=(cute.sym_int(), cute.sym_int()))
        return launcher, [rows(t), index(), index(), scores, count, rows(a), stream]
    workspace = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),))
    return launcher, [rows(t), rows(a), index(), count, workspace, stream]


def _valid(config, target, sig):
    return True


TEMPLATES = [
    Template(op="gather_scale_dense_tokens", backend="cute", targets=("sm90a",),
             signatures={**shared.SIGNATURES, "score_dtype": shared.SCORE_DTYPES}, space={"unroll": (1, 2, 4, 8)},
             valid=_valid, heuristic=_heuristic, build=functools.partial(_build, op="gather_scale_dense_tokens")),
    Template(op="scatter_add_dense_tokens", backend="cute", targets=("sm90a",), signatures=shared.SIGNATURES,
             space={"unroll": (1, 2, 4, 8), "method": ("atomic", "sorted")},
             valid=_valid, heuristic=_scatter_heuristic,
             build=functools.partial(_build, op="scatter_add_dense_tokens")),
]
