"""gather_scale_dense_tokens and scatter_add_dense_tokens for NVIDIA Hopper, in CuTe DSL, as kernel
classes: the config in ``__init__``, the host launcher in ``__call__``, one ``@cute.kernel``
method per kernel, the device helpers as plain methods. The contracts, the work split and the
two scatter methods are in ``moe_gather_scatter_cute``'s docstring.

``MoeRows`` holds what both ops share (the row vectors, the valid-row count); ``Gather`` and
``Scatter`` add their kernels. Imported only from the template's ``build()`` (it imports
``cutlass`` at module level). Helpers that are not ``@cute.kernel`` / ``@cute.jit`` are not
preprocessed: their Python loops unroll at trace time.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from mslk_dsl.templates._kernel_limits import ELEM_BYTES
from mslk_dsl.templates import _gather_scatter_space as shared

MAX_THREADS = 1024
# Rows narrower than a block's worth of threads share one (grid_and_block).
ROW_GROUP_THREADS = 128
SCATTER_THREADS = 256
# Scatter works on column slices narrow enough that the rows of `out` a slice touches stay in L2
# while the input rows stream by: reuse distance ~ 2 * T * slice bytes kept under REUSE_BYTES
# (Hopper's L2 is 50 MB, in two partitions).
REUSE_BYTES = 16 << 20
MIN_SLICE_BYTES = 256
INDEX_THREADS = 256                 # sorted scatter: threads of the count / place kernels
SCAN_THREADS, SCAN_ITEMS = 1024, 32  # sorted scatter: the one-block scan of the per-token counts
# Inputs read once: keep them out of L1.
STREAM = cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}


class MoeRows:
    """Row-vector access shared by the gather and the scatter kernels."""

    def __init__(self, config, sig):
        self.dtype = DTYPES[sig["dtype"]]
        self.vec, self.unroll = shared.vec(sig), config["unroll"]
        self.has_n = bool(sig["has_valid_count"])
        self.vec_bytes = sig["vec_bytes"]

    def rows_to_do(self, valid_count, a):
        n = a
        if const_expr(self.has_n):
            n = cutlass.min(valid_count[0], a)
        return n

    def vector_ids(self, nvec):
        """This thread's vector indices in its block's chunk, and whether each is in the row."""
        tidx, _, _ = cute.arch.thread_idx()
        _, c, _ = cute.arch.block_idx()
        nthr, _, _ = cute.arch.block_dim()
        ids, ok = [], []
        for j in range(self.unroll):  # plain Python (helpers are not preprocessed): unrolled
            v = (c * self.unroll + j) * nthr + tidx
            ids.append(cutlass.min(v, nvec - 1))
            ok.append(v < nvec)
        return ids, ok

    def load_row(self, src_vecs, ids):
        frags = []
        for j in range(self.unroll):
            f = cute.make_rmem_tensor((self.vec,), self.dtype)
            cute.autovec_copy(src_vecs[None, ids[j]], f, l1c_evict_priority=STREAM)
            frags.append(f)
        return frags

    def start_sums(self, frags, ys):
        """fp32 sums, one register vector per vector of the chunk: out's values plus a first row's."""
        acc = []
        for j in range(self.unroll):
            f = cute.make_rmem_tensor((self.vec,), Float32)
            f.store(frags[j].load().to(Float32) + ys[j].load().to(Float32))
            acc.append(f)
        return acc

    def add_to_sums(self, acc, ys):
        """Add one more row's vectors to the fp32 sums."""
        for j in range(self.unroll):
            acc[j].store(acc[j].load() + ys[j].load().to(Float32))

    @cute.jit
    def store_sums(self, acc, out_vecs, ids, ok):
        """The sums, rounded to the output dtype, into the chunk's vectors that are in the row
        (a jit helper: its test of ``ok`` is a run-time branch)."""
        r = cute.make_rmem_tensor((self.vec,), self.dtype)
        for j in cutlass.range_constexpr(self.unroll):
            if ok[j]:
                r.store(acc[j].load().to(self.dtype))
                cute.autovec_copy(r, out_vecs[None, ids[j]])

    def grid_and_block(self, a, d):
        """Grid and block for ``a`` rows of width ``d``: block (b, c) takes rows b * R .. b * R + R - 1
        (thread row y of the block is row b * R + y) and chunk c of their vectors.

        A row takes whole warps (threads = its vectors / unroll rounded up to 32, at most
        MAX_THREADS, chunks for the rest); a row that needs fewer than 32 threads takes the power
        of two that covers it. Rows then share a block of up to ROW_GROUP_THREADS threads
        (R = ROW_GROUP_THREADS // threads): a block per row of 72 bf16 (3 threads, rounded to a
        warp) launched 262144 blocks for 131072 tokens at top-2 and ran at the block scheduler's
        rate, ~0.6 ns a block on an H100, whatever the row width."""
        nvec = d // self.vec
        need = (nvec + self.unroll - 1) // self.unroll
        threads = cutlass.min((need + 31) // 32 * 32, MAX_THREADS)
        for lanes in (16, 8, 4, 2, 1):   # plain Python: the smallest power of two >= need, below a warp
            threads = Int32(cutlass.select_(need <= lanes, Int32(lanes), threads))
        rows = Int32(cutlass.max(ROW_GROUP_THREADS // threads, 1))
        chunks = (nvec + threads * self.unroll - 1) // (threads * self.unroll)
        return ((a + rows - 1) // rows, chunks, 1), (threads, rows, 1)

    def block_row(self):
        """The row (gather) or token (reductions) of this thread's row of the block."""
        b, _, _ = cute.arch.block_idx()
        _, y, _ = cute.arch.thread_idx()
        _, rows, _ = cute.arch.block_dim()
        return b * rows + y

    def fake_rows(self, m, d):
        align = self.vec_bytes
        return make_fake_compact_tensor(self.dtype, (m, d), stride_order=(1, 0), assumed_align=align)


class Gather(MoeRows):
    def __init__(self, config, sig):
        super().__init__(config, sig)
        self.score_t = cutlass.BFloat16 if sig["score_dtype"] == "bfloat16" else cutlass.Float32

    @cute.kernel
    def gather_kernel(self, mX: cute.Tensor, mTok: cute.Tensor, mExp: cute.Tensor, mScore: cute.Tensor,
                      mN: cute.Tensor, mOut: cute.Tensor):
        self.gather_row(self.block_row(), mX, mTok, mExp, mScore, mN, mOut)

    @cute.jit
    def gather_row(self, row, mX: cute.Tensor, mTok: cute.Tensor, mExp: cute.Tensor, mScore: cute.Tensor,
                   mN: cute.Tensor, mOut: cute.Tensor):
        VEC, dtype = self.vec, self.dtype
        if row < self.rows_to_do(mN, mOut.shape[0]):
            t = mTok[row]
            s = mScore[t, mExp[row]].to(Float32)
            nvec = mX.shape[1] // VEC
            ids, ok = self.vector_ids(nvec)
            frags = self.load_row(cute.zipped_divide(mX[t, None], (VEC,)), ids)
            out_vecs = cute.zipped_divide(mOut[row, None], (VEC,))
            r = cute.make_rmem_tensor((VEC,), dtype)
            for j in cutlass.range_constexpr(self.unroll):
                if ok[j]:
                    r.store((frags[j].load().to(Float32) * s).to(dtype))
                    cute.autovec_copy(r, out_vecs[None, ids[j]])

    @cute.jit
    def __call__(self, mX: cute.Tensor, mTok: cute.Tensor, mExp: cute.Tensor, mScore: cute.Tensor,
                 mN: cute.Tensor, mOut: cute.Tensor, stream):
        grid, block = self.grid_and_block(mOut.shape[0], mX.shape[1])
        self.gather_kernel(mX, mTok, mExp, mScore, mN, mOut).launch(grid=grid, block=block, stream=stream)

    def fake_args(self):
        """Compile-time stand-ins for ``__call__``'s arguments, every size dynamic."""
        t, a, d = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=self.vec)
        index = make_fake_compact_tensor(Int32, (a,))
        scores = make_fake_tensor(self.score_t, (t, cute.sym_int()), stride=(cute.sym_int(), cute.sym_int()))
        return [self.fake_rows(t, d), index, make_fake_compact_tensor(Int32, (a,)), scores,
                make_fake_compact_tensor(Int32, (1,)), self.fake_rows(a, d),
                make_fake_stream(use_tvm_ffi_env_stream=True)]


class Scatter(MoeRows):
    def __init__(self, config, sig):
        super().__init__(config, sig)
        self.sorted = config.get("method") == "sorted"
        self.linked = config.get("method") == "linked"
        # Programmatic dependent launch of the sorted method's kernels 2-5: each may start while
        # its predecessor runs and waits for it (griddepcontrol.wait) before reading anything.
        self.pdl = bool(config.get("pdl", False))
        # The reductions' token: the block index (uniform) in blocks of one token, or each
        # thread row's own (grid_and_block). Timed on an H100 (linked method, bf16, the same
        # kernels but for this; docs/benchmarks.md "MoE gather / scatter: short rows share a
        # block"): on rows of one element per access the uniform token is 1.2-1.3x faster
        # (6835 wide: 274 against 366 us at top-1, 963 against 1153 at top-8), on rows of 4-byte
        # accesses the per-thread one is 1.28-1.38x faster at top-8 (9758, 1690, 1182 wide) and
        # level at top-1; 16- and 8-byte rows time the same either way.
        self.uniform_single_tokens = self.vec == 1
        self.elem_bytes = ELEM_BYTES[sig["dtype"]]
        # Atomic method, 16-bit rows of one element per access: Hopper has no scalar bf16 / fp16
        # atomic add (ptxas turns atom.add.noftz.bf16 into a compare-and-swap loop), but it has
        # the packed one. So a slot is one aligned 4-byte word of the out row, both its halves
        # added at once (BF16x2 / F16x2), as torch's index_add_ does (fastAtomicAdd); a half
        # outside the row adds -0.0, the exact identity of IEEE addition (x + -0.0 == x for
        # every x, -0.0 included).
        self.word_pairs = self.vec == 1 and self.elem_bytes == 2
        self.slot_bytes = 4 if self.word_pairs else self.vec * self.elem_bytes
        self.slots = SCATTER_THREADS * self.unroll                       # slots per scatter block
        self.k_min = (MIN_SLICE_BYTES // self.slot_bytes).bit_length() - 1
        self.k_max = self.slots.bit_length() - 1

    # -- method "atomic" -------------------------------------------------------------------------
    @cute.kernel
    def scatter_kernel(self, mOut: cute.Tensor, mY: cute.Tensor, mTok: cute.Tensor, mN: cute.Tensor,
                       log2_slice: Int32):
        # Block (b, c): slice c (slots [c * slice, (c + 1) * slice)) of rows_per_block rows; a
        # slot is a vector, or an out word of two halves (word_pairs).
        VEC, dtype = self.vec, self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        rb, c, _ = cute.arch.block_idx()
        t, (a, d) = mOut.shape[0], mY.shape
        n = self.rows_to_do(mN, a)
        nslots = self.row_slots(d)
        slice_slots = Int32(1) << log2_slice
        rows_per_block = Int32(self.slots) >> log2_slice
        frags, dsts, ok = [], [], []
        for j in cutlass.range_constexpr(self.unroll):   # every load first (clamped in bounds), then atomics
            slot = j * SCATTER_THREADS + tidx
            row = rb * rows_per_block + (slot >> log2_slice)
            v = c * slice_slots + (slot & (slice_slots - 1))
            row_c, v_c = cutlass.min(row, a - 1), cutlass.min(v, nslots - 1)
            tok = mTok[row_c]
            ok_j = (row < n) & (v < nslots) & (tok >= 0) & (tok < t)
            tok_c = cutlass.max(cutlass.min(tok, t - 1), 0)
            if const_expr(self.word_pairs):
                f, dst, in_row = self.load_word_halves(mOut, mY, row_c, tok_c, v_c, d)
                ok_j = ok_j & in_row
            else:
                f = cute.make_rmem_tensor((VEC,), dtype)
                cute.autovec_copy(cute.zipped_divide(mY[row_c, None], (VEC,))[None, v_c], f,
                                  l1c_evict_priority=STREAM)
                dst = cute.zipped_divide(mOut[tok_c, None], (VEC,))[None, v_c].iterator
            frags.append(f)
            dsts.append(dst)
            ok.append(ok_j)
        for j in cutlass.range_constexpr(self.unroll):
            if ok[j]:
                if const_expr(VEC == 1 and not self.word_pairs):
                    cute.arch.atomic_add(dsts[j], frags[j][0], sem="relaxed", scope="gpu")
                else:
                    cute.arch.atomic_add(dsts[j], frags[j].load().ir_value(), sem="relaxed", scope="gpu")

    def row_slots(self, d):
        """Slots of a row of width d: its vectors, or (word_pairs) the most 4-byte words an out
        row of d 16-bit elements can overlap, d // 2 + 1 (all of them at an odd d; at an even d
        a row that starts on a word boundary leaves the last slot empty, and it adds nothing)."""
        return d // 2 + 1 if const_expr(self.word_pairs) else d // self.vec

    def load_word_halves(self, mOut, mY, row, tok, w, d):
        """(the two halves to add, as a 2-element fragment; the pointer of word w of out row tok;
        whether the word holds an element of the row). The word's low half is element
        2 * w - phase of the row, phase 1 when the row starts in the middle of a word; a half
        outside the row adds -0.0."""
        base = mOut[tok, None].iterator.toint()                         # Int64 byte address
        phase = Int32(base >> 1) & 1
        e0 = 2 * w - phase
        e1 = e0 + 1
        src = cute.zipped_divide(mY[row, None], (1,))
        halves = []
        for e in (cutlass.max(e0, 0), cutlass.min(e1, d - 1)):   # plain Python: unrolled
            h = cute.make_rmem_tensor((1,), self.dtype)
            cute.autovec_copy(src[None, e], h, l1c_evict_priority=STREAM)
            halves.append(h[0])
        f = cute.make_rmem_tensor((2,), self.dtype)
        f[0] = cutlass.select_(e0 >= 0, halves[0], self.dtype(-0.0))
        f[1] = cutlass.select_(e1 < d, halves[1], self.dtype(-0.0))
        word = cute.make_ptr(self.dtype, base - Int64(2) * Int64(phase) + Int64(4) * Int64(w),
                             cute.AddressSpace.gmem, assumed_align=4)
        return f, word, e0 < d

    def scatter_launch(self, t, a, d):
        """(grid, log2 of the slice in slots) for out rows t, input rows a, width d."""
        nvec = self.row_slots(d)
        # The largest power of two with 2 * t * slice * slot bytes <= REUSE_BYTES, at least
        # MIN_SLICE_BYTES, at most a block's slots, and no wider than the row rounded up.
        fits = Int32(REUSE_BYTES // (2 * self.slot_bytes)) // t
        k = Int32(self.k_min)
        for kk in range(self.k_min + 1, self.k_max + 1):   # plain Python: unrolled at trace time
            k = Int32(cutlass.select_((fits >= (1 << kk)) & (nvec > (1 << (kk - 1))), Int32(kk), k))
        rows_per_block = Int32(self.slots) >> k
        slices = (nvec + (Int32(1) << k) - 1) >> k
        return ((a + rows_per_block - 1) // rows_per_block, slices, 1), k

    # -- method "sorted": group rows by token, then one fp32 reduction per out row ----------------
    def workspace_views(self, mWs, t, a):
        """counts [t], offsets [t + 1], positions [a], row lists [a], first rows [t] inside the
        workspace (_kernel_limits.scatter_workspace_ints(t, a) int32)."""
        base = mWs.iterator
        return (cute.make_tensor(base, cute.make_layout(t)),
                cute.make_tensor(base + t, cute.make_layout(t + 1)),
                cute.make_tensor(base + (2 * t + 1), cute.make_layout(a)),
                cute.make_tensor(base + (2 * t + 1 + a), cute.make_layout(a)),
                cute.make_tensor(base + (2 * t + 1 + 2 * a), cute.make_layout(t)))

    def after_predecessor(self):
        """PDL: let the next kernel launch, then wait for the previous one (no-op without PDL)."""
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()

    def flat_index(self):
        tidx, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        return b * INDEX_THREADS + tidx

    def routed_row(self, mTok, mN, t):
        """This thread's input row i, its token, and whether it is added (i < n, token in [0, t))."""
        a = mTok.shape[0]
        i = self.flat_index()
        tok = mTok[cutlass.min(i, a - 1)]
        return i, tok, (i < self.rows_to_do(mN, a)) & (tok >= 0) & (tok < t)

    def warp_inclusive_scan(self, x, lane):
        """Inclusive prefix sum of x over the 32 lanes of a warp (every lane must take part)."""
        incl = x
        for d in (1, 2, 4, 8, 16):
            up = cute.arch.shuffle_sync_up(incl, offset=d)
            incl = cutlass.select_(lane >= d, incl + up, incl)
        return incl

    @cute.kernel
    def zero_kernel(self, mWs: cute.Tensor, t: Int32, a: Int32):
        counts, _, _, _, _ = self.workspace_views(mWs, t, a)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        i = self.flat_index()
        if i < t:
            counts[i] = 0

    @cute.kernel
    def count_kernel(self, mTok: cute.Tensor, mN: cute.Tensor, mWs: cute.Tensor, t: Int32):
        counts, _, pos, _, first = self.workspace_views(mWs, t, mTok.shape[0])
        self.after_predecessor()
        i, tok, routed = self.routed_row(mTok, mN, t)
        if routed:
            # The old count is this row's position among its token's rows; position 0 is also
            # recorded per token, so the reduction can fetch that row without the offsets.
            p = cute.arch.atomic_add((counts.iterator + tok).llvm_ptr, Int32(1), sem="relaxed", scope="gpu")
            pos[i] = p
            if p == 0:
                first[tok] = i

    @cute.kernel
    def scan_kernel(self, mWs: cute.Tensor, t: Int32, a: Int32):
        # One block: offsets = exclusive prefix sum of counts, offsets[t] = total. Tiles of
        # SCAN_THREADS * items counts (items = SCAN_ITEMS, fewer when t is small, so that small
        # inputs spread over every warp); warp w owns `items` consecutive chunks of 32, so every
        # load and store is a coalesced 128-byte warp access, and all of a tile's loads are
        # issued before the first is used (a single block is latency-bound: one load round trip
        # per tile). Warp totals are scanned through shared memory; each chunk is scanned with
        # shuffles on top of the running sum; a carry runs across tiles.
        counts, offsets, _, _, _ = self.workspace_views(mWs, t, a)
        self.after_predecessor()
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
                w_incl = self.warp_inclusive_scan(w, lane)
                s_warp[lane] = w_incl - w
                if lane == 31:
                    s_warp[SCAN_THREADS // 32] = w_incl
            cute.arch.sync_threads()
            run = carry + s_warp[warp]
            for u in cutlass.range_constexpr(SCAN_ITEMS):
                if u < items:   # the same for the whole block: no divergence around the shuffles
                    x = vals[u]
                    incl = self.warp_inclusive_scan(x, lane)
                    if seg + u * 32 < t:
                        offsets[seg + u * 32] = run + incl - x
                    run = run + cute.arch.shuffle_sync(incl, offset=31)
            carry = carry + s_warp[SCAN_THREADS // 32]
            cute.arch.sync_threads()   # s_warp is rewritten by the next tile
        if tidx == 0:
            offsets[t] = carry

    @cute.kernel
    def place_kernel(self, mTok: cute.Tensor, mN: cute.Tensor, mWs: cute.Tensor, t: Int32):
        _, offsets, pos, rows, _ = self.workspace_views(mWs, t, mTok.shape[0])
        self.after_predecessor()
        i, tok, routed = self.routed_row(mTok, mN, t)
        if routed:
            rows[offsets[tok] + pos[i]] = i

    @cute.kernel
    def reduce_kernel(self, mOut: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor):
        # Token t (a thread row of the block, grid_and_block), chunk c: out[t] chunk c += the chunk
        # of each of token t's rows, summed in fp32.
        self.reduce_block_tokens(False, mOut, mY, mWs)

    @cute.jit
    def reduce_block_tokens(self, linked: cutlass.Constexpr, mOut: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor):
        """The reductions' common entry: wait for the index kernels (PDL), then reduce this thread
        row's token, which is the block index itself (uniform) in a block of one token when
        uniform_single_tokens, else the thread row's own (block_row)."""
        _, rows_per_block, _ = cute.arch.block_dim()
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        if const_expr(self.uniform_single_tokens):
            if rows_per_block == 1:
                b, _, _ = cute.arch.block_idx()
                self.reduce_one_token(linked, b, mOut, mY, mWs)
            else:
                self.reduce_one_token(linked, self.block_row(), mOut, mY, mWs)
        else:
            self.reduce_one_token(linked, self.block_row(), mOut, mY, mWs)

    def reduce_one_token(self, linked, mine, mOut, mY, mWs):
        """The sorted or the linked method's reduction of token ``mine`` (chosen at trace time)."""
        if linked:
            self.linked_reduce_token(mine, mOut, mY, mWs)
        else:
            self.reduce_token(mine, mOut, mY, mWs)

    @cute.jit
    def reduce_token(self, mine, mOut: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor):
        VEC = self.vec
        n_tok = mOut.shape[0]
        t = cutlass.min(mine, n_tok - 1)   # a block's rows past the last token repeat it, add nothing
        _, offsets, _, rows, first = self.workspace_views(mWs, n_tok, mY.shape[0])
        # The token's first row comes straight from first[t], loaded beside its offsets (only
        # read when the token has rows): its data loads wait for one index load, as the
        # gather's do, instead of two (offsets, then the list).
        start = offsets[t]
        count = offsets[t + 1] - start
        row0 = first[t]
        if (count > 0) & (mine < n_tok):
            nvec = mOut.shape[1] // VEC
            ids, ok = self.vector_ids(nvec)
            out_vecs = cute.zipped_divide(mOut[t, None], (VEC,))
            frags = self.load_row(out_vecs, ids)
            ys = self.load_row(cute.zipped_divide(mY[row0, None], (VEC,)), ids)
            acc = self.start_sums(frags, ys)
            for k in cutlass.range(1, count, unroll=2):
                row = rows[start + k]
                ys = self.load_row(cute.zipped_divide(mY[row, None], (VEC,)), ids)
                self.add_to_sums(acc, ys)
            self.store_sums(acc, out_vecs, ids, ok)

    # -- method "linked": one list of rows per token (heads [t], next [a]), walked by the reduction --
    def link_views(self, mWs, t, a):
        """heads [t] (the last row linked per token, -1 for none) and next [a] (the row linked
        before each row, -1 at a list's end) inside the workspace."""
        base = mWs.iterator
        return cute.make_tensor(base, cute.make_layout(t)), cute.make_tensor(base + t, cute.make_layout(a))

    @cute.kernel
    def head_kernel(self, mWs: cute.Tensor, t: Int32, a: Int32):
        heads, _ = self.link_views(mWs, t, a)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        i = self.flat_index()
        if i < t:
            heads[i] = -1

    @cute.kernel
    def link_kernel(self, mTok: cute.Tensor, mN: cute.Tensor, mWs: cute.Tensor, t: Int32):
        heads, nxt = self.link_views(mWs, t, mTok.shape[0])
        self.after_predecessor()
        i, tok, routed = self.routed_row(mTok, mN, t)
        if routed:
            nxt[i] = cute.arch.atomic_exch((heads.iterator + tok).llvm_ptr, Int32(i), sem="relaxed", scope="gpu")

    @cute.kernel
    def linked_reduce_kernel(self, mOut: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor):
        # Token t (a thread row of the block), chunk c: out[t] chunk c += the chunk of each row on
        # token t's list, summed in fp32; each row's next index is loaded with its data, so one
        # index load separates two rows.
        self.reduce_block_tokens(True, mOut, mY, mWs)

    @cute.jit
    def linked_reduce_token(self, mine, mOut: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor):
        VEC = self.vec
        t = cutlass.min(mine, mOut.shape[0] - 1)   # a block's rows past the last token repeat it
        heads, nxt = self.link_views(mWs, mOut.shape[0], mY.shape[0])
        row = Int32(cutlass.select_(mine < mOut.shape[0], heads[t], Int32(-1)))
        if row >= 0:
            nvec = mOut.shape[1] // VEC
            ids, ok = self.vector_ids(nvec)
            out_vecs = cute.zipped_divide(mOut[t, None], (VEC,))
            frags = self.load_row(out_vecs, ids)
            ys = self.load_row(cute.zipped_divide(mY[row, None], (VEC,)), ids)
            row = nxt[row]
            acc = self.start_sums(frags, ys)
            while row >= 0:
                ys = self.load_row(cute.zipped_divide(mY[row, None], (VEC,)), ids)
                row = nxt[row]
                self.add_to_sums(acc, ys)
            self.store_sums(acc, out_vecs, ids, ok)

    # -- host launcher ---------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mOut: cute.Tensor, mY: cute.Tensor, mTok: cute.Tensor, mN: cute.Tensor,
                 mWs: cute.Tensor, stream):
        t, (a, d) = mOut.shape[0], mY.shape
        if const_expr(self.sorted):
            t_blocks = ((t + INDEX_THREADS - 1) // INDEX_THREADS, 1, 1)
            a_blocks = ((a + INDEX_THREADS - 1) // INDEX_THREADS, 1, 1)
            index_block = (INDEX_THREADS, 1, 1)
            pdl = {"use_pdl": True} if const_expr(self.pdl) else {}
            self.zero_kernel(mWs, t, a).launch(grid=t_blocks, block=index_block, stream=stream)
            self.count_kernel(mTok, mN, mWs, t).launch(grid=a_blocks, block=index_block, stream=stream, **pdl)
            self.scan_kernel(mWs, t, a).launch(grid=(1, 1, 1), block=(SCAN_THREADS, 1, 1), stream=stream, **pdl)
            self.place_kernel(mTok, mN, mWs, t).launch(grid=a_blocks, block=index_block, stream=stream, **pdl)
            grid, block = self.grid_and_block(t, d)
            self.reduce_kernel(mOut, mY, mWs).launch(grid=grid, block=block, stream=stream, **pdl)
        elif const_expr(self.linked):
            pdl = {"use_pdl": True} if const_expr(self.pdl) else {}
            index_block = (INDEX_THREADS, 1, 1)
            self.head_kernel(mWs, t, a).launch(grid=((t + INDEX_THREADS - 1) // INDEX_THREADS, 1, 1),
                                               block=index_block, stream=stream)
            self.link_kernel(mTok, mN, mWs, t).launch(grid=((a + INDEX_THREADS - 1) // INDEX_THREADS, 1, 1),
                                                      block=index_block, stream=stream, **pdl)
            grid, block = self.grid_and_block(t, d)
            self.linked_reduce_kernel(mOut, mY, mWs).launch(grid=grid, block=block, stream=stream, **pdl)
        else:
            grid, log2_slice = self.scatter_launch(t, a, d)
            self.scatter_kernel(mOut, mY, mTok, mN, log2_slice).launch(
                grid=grid, block=(SCATTER_THREADS, 1, 1), stream=stream)

    def fake_args(self):
        """Compile-time stand-ins for ``__call__``'s arguments, every size dynamic."""
        t, a, d = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=self.vec)
        return [self.fake_rows(t, d), self.fake_rows(a, d), make_fake_compact_tensor(Int32, (a,)),
                make_fake_compact_tensor(Int32, (1,)), make_fake_compact_tensor(Int32, (cute.sym_int(),)),
                make_fake_stream(use_tvm_ffi_env_stream=True)]
