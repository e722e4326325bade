"""gather_scale_dense_tokens and scatter_add_dense_tokens for ROCm (FlyDSL), as kernel classes: the
config in ``__init__``, the host launcher in ``__call__``, one kernel method per kernel, the
device helpers as plain methods. The contracts and the work split are in
``moe_gather_scatter_flydsl``'s docstring; ``_flydsl_kernels`` says why the methods are marked
rather than decorated and the instances come from ``_flydsl_kernels.specialize``.

``MoeRows`` holds what both ops share (the two kinds of rows, vector loads, the valid-row
count); ``Gather`` and ``Scatter`` add their kernels. Imported only from the template's ``build()`` (it imports
``flydsl`` at module level).
"""
import flydsl.expr as fx
from flydsl._mlir.dialects import llvm
from flydsl.expr import const_expr, gpu, range_constexpr

from mslk_dsl.templates import _flydsl_kernels as fk
from mslk_dsl.templates import _flydsl_rowwise as rw
from mslk_dsl.templates import _gather_scatter_space as shared
from mslk_dsl.templates import moe_gather_scatter_flydsl as declared

WAVE = 64
INDEX_THREADS = 256                 # sorted scatter: threads of the zero / count / place kernels
SCAN_THREADS, SCAN_ITEMS = 1024, 16  # sorted scatter: the one-block scan of the per-token counts
SCAN_WAVES = SCAN_THREADS // WAVE
DTYPES = {"bfloat16": fx.BFloat16, "float16": fx.Float16, "float32": fx.Float32}
# Rows narrower than a block's worth of threads share one (grid_and_block): four waves.
ROW_GROUP_THREADS = 256


class MoeRows:
    """Row access shared by the gather and the scatter kernels."""

    def __init__(self, op, config, sig):
        self.dtype = DTYPES[sig["dtype"]]
        self.vec, self.unroll = shared.vec(sig), config["unroll"]
        # Every row starts on a multiple of the signature's vector width.
        self.vector_bytes = self.vec * self.dtype.width // 8
        self.has_n = bool(sig["has_valid_count"])
        self.max_threads = declared.block_threads(config, sig)   # a row's threads at most (grid_and_block)
        self.name = f"mslk_{op}_{sig['dtype']}_v{self.vec}_u{self.unroll}{'_n' if self.has_n else ''}"

    def rows_to_do(self, n_tensor, a):
        if const_expr(self.has_n):
            n = fx.get_iter(n_tensor).load()
            return (n < a).select(n, a)
        return a

    def vector_ids(self, nthr):
        # The block size comes as an argument: reading blockDim would link ROCm's device library.
        tid = fx.thread_idx.x
        c = fx.block_idx.y
        return [(c * self.unroll + j) * nthr + tid for j in range(self.unroll)]

    # Two kinds of rows (moe_gather_scatter_flydsl's docstring): the block's own, consecutive
    # rows behind one descriptor per wave, and gathered rows through per-lane global addresses.
    def block_rows(self, tensor, row):
        """This thread's row ``row`` among the block's consecutive rows, for rw.load / rw.store."""
        return rw.WaveRows(tensor, row, self.vec)

    def load_block_row(self, view, ids):
        return [rw.load(view, j, self.vec) for j in ids]   # all loads first (memory-level parallelism)

    def load_gathered(self, tensor, row, ids, nvec):
        """Vectors ``ids`` of row ``row`` of ``tensor`` (unit column stride; ``nvec`` >= 1
        vectors a row), all loads first. A vector past the row's end loads vector 0 instead
        (inside the row): its value must not be used."""
        row_stride, _ = tensor.stride.unpack()
        base = fx.get_iter(tensor) + fx.Int64(row) * fx.Int64(row_stride)
        vector = fx.Vector.make_type(self.vec, self.dtype)
        return [fx.Vector(llvm.LoadOp(vector, fx.to_llvm_ptr(base + (j < nvec).select(j, 0) * self.vec),
                                      alignment=self.vector_bytes).result, (self.vec,), self.dtype)
                for j in ids]

    def grid_and_block(self, a, d, nvec=None):
        """Grid and block for ``a`` rows of width ``d`` (``nvec`` slots each, default its vectors):
        block (b, c) takes rows b * R .. b * R + R - 1 (thread row y is row b * R + y) and chunk c
        of their slots. A row takes whole waves
        (its vectors / unroll rounded up to 64 threads, at most ``max_threads``), or the power of two
        that covers it when it needs fewer than a wave; rows then share a block of up to
        ROW_GROUP_THREADS threads (as the CuTe kernels, where a block per short row ran at the
        block scheduler's rate; not timed on CDNA: no AMD GPU here)."""
        nvec = d // self.vec if nvec is None else nvec
        need = (nvec + self.unroll - 1) // self.unroll
        threads = (need + WAVE - 1) // WAVE * WAVE
        threads = (threads < self.max_threads).select(threads, self.max_threads)
        for lanes in (32, 16, 8, 4, 2, 1):   # plain Python: the smallest power of two >= need, below a wave
            threads = (need <= lanes).select(fx.Int32(lanes), threads)
        rows = ROW_GROUP_THREADS // threads
        rows = (rows > 1).select(rows, 1)
        return ((a + rows - 1) // rows, (nvec + threads * self.unroll - 1) // (threads * self.unroll), 1), \
            (threads, rows, 1)

    def any_block(self):
        """Kernel attributes of a launch whose block size is chosen at run time (up to
        ``max_threads``): with no static block size the code object declares at most 256
        work-items per workgroup, and a larger launch is undefined behavior (the register budget
        assumes 256)."""
        return {"rocdl.max_flat_work_group_size": self.max_threads}

    def block_row(self, rows):
        """The row (gather, atomic scatter) or token (reduction) of this thread's row of the
        block; ``rows`` (rows per block) comes as an argument, as the block width does."""
        return fx.block_idx.x * rows + fx.thread_idx.y


class Gather(MoeRows):
    def __init__(self, config, sig):
        super().__init__("gather_scale_dense_tokens", config, sig)

    @fk.kernel(lambda self: {"name": self.name + "_gather"})
    def gather_kernel(self, X: fx.Tensor, Tok: fx.Tensor, Exp: fx.Tensor, S: fx.Tensor, N: fx.Tensor,
                      Out: fx.Tensor, nthr: fx.Int32, rows: fx.Int32):
        row = self.block_row(rows)
        a = Out.shape.unpack()[0]
        if row < self.rows_to_do(N, a):
            t = (fx.get_iter(Tok) + row).load()
            e = (fx.get_iter(Exp) + row).load()
            s_stride, _ = S.stride.unpack()
            s = (fx.get_iter(S) + fx.Int64(t) * fx.Int64(s_stride) + e).load().to(fx.Float32)
            ids = self.vector_ids(nthr)
            xs = self.load_gathered(X, t, ids, X.shape.unpack()[1] // self.vec)
            out = self.block_rows(Out, row)
            for j in range_constexpr(self.unroll):
                rw.store(out, ids[j], (xs[j].to(fx.Float32) * s).to(self.dtype), self.vec)

    @fk.jit
    def __call__(self, X: fx.Tensor, Tok: fx.Tensor, Exp: fx.Tensor, S: fx.Tensor,
                 N: fx.Tensor, Out: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        grid, block = self.grid_and_block(Out.shape.unpack()[0], X.shape.unpack()[1])
        self.gather_kernel(X, Tok, Exp, S, N, Out, block[0], block[1], value_attrs=self.any_block()).launch(
            grid=grid, block=block, stream=stream)


class Scatter(MoeRows):
    def __init__(self, config, sig):
        super().__init__("scatter_add_dense_tokens", config, sig)
        # Atomic granule: fp32 one element; 16-bit two (packed): pairs of a vector on aligned
        # rows, and on rows of one element per access one aligned 4-byte word of the out row
        # (word_pairs), as the CuTe template: a lone 16-bit atomic add is a compare-and-swap loop.
        self.pair = 1 if sig["dtype"] == "float32" else 2
        self.word_pairs = self.pair == 2 and self.vec == 1
        self.sorted = config.get("method") == "sorted"

    # -- method "atomic" -------------------------------------------------------------------------
    @fk.kernel(lambda self: {"name": self.name + "_scatter"})
    def scatter_kernel(self, Out: fx.Tensor, Y: fx.Tensor, Tok: fx.Tensor, N: fx.Tensor, nthr: fx.Int32,
                       rows: fx.Int32):
        row = self.block_row(rows)
        a, d = Y.shape.unpack()
        if row < self.rows_to_do(N, a):
            t = (fx.get_iter(Tok) + row).load()
            ids = self.vector_ids(nthr)
            # A token index outside [0, T) skips the row (an unsigned compare covers both ends).
            valid = fx.Uint32(t) < fx.Uint32(Out.shape.unpack()[0])
            dst = fx.get_iter(Out) + fx.Int64(t) * fx.Int64(Out.stride.unpack()[0])
            if const_expr(self.word_pairs):
                words = self.word_halves(Y, row, dst, ids, d)
                for j in range_constexpr(self.unroll):
                    if valid & words[j][2]:
                        llvm.atomicrmw(llvm.AtomicBinOp.fadd, fx.to_llvm_ptr(words[j][0]), words[j][1],
                                       llvm.AtomicOrdering.monotonic, syncscope="agent", alignment=4)
            else:
                nvec = d // self.vec
                ys = self.load_block_row(self.block_rows(Y, row), ids)
                for j in range_constexpr(self.unroll):
                    if valid & (ids[j] < nvec):
                        vals = ys[j]
                        for p in range_constexpr(self.vec // self.pair):
                            piece = [vals[p * self.pair + q] for q in range(self.pair)]
                            value = fx.Vector.from_elements(piece, self.dtype).ir_value() if const_expr(self.pair == 2) \
                                else self.dtype(piece[0]).ir_value()
                            # llvm atomicrmw fadd: <2 x bf16/f16> -> global_atomic_pk_add_*, f32 ->
                            # global_atomic_add_f32.
                            llvm.atomicrmw(llvm.AtomicBinOp.fadd,
                                           fx.to_llvm_ptr(dst + fx.Int64(ids[j]) * self.vec + p * self.pair), value,
                                           llvm.AtomicOrdering.monotonic, syncscope="agent",
                                           alignment=self.pair * self.dtype.width // 8)

    def word_halves(self, Y, row, dst, ids, d):
        """Per slot w of ``ids``: (the element pointer of out word w's low half, the two halves
        to add as a <2 x dtype>, whether the word holds an element of the row). The low half is
        element 2 * w - phase of the row (phase 1 when the out row starts mid-word); a half
        outside the row adds -0.0, the exact identity of IEEE addition."""
        phase = fx.Int32(fx.ptrtoint(dst) >> 1) & 1
        firsts = [2 * w - phase for w in ids]
        # Both halves of every word, all loads first (vec is 1 here); past the row's end the
        # loads give 0, and a low half before the row start loads element 0 instead.
        elems = []
        for e0 in firsts:
            elems += [(e0 < 0).select(fx.Int32(0), e0), e0 + 1]
        halves = self.load_block_row(self.block_rows(Y, row), elems)
        minus_zero = self.dtype(-0.0)
        words = []
        for j, e0 in enumerate(firsts):
            lo = (e0 >= 0).select(halves[2 * j][0], minus_zero)
            hi = (e0 + 1 < d).select(halves[2 * j + 1][0], minus_zero)
            words.append((dst + fx.Int64(e0), fx.Vector.from_elements([lo, hi], self.dtype).ir_value(), e0 < d))
        return words

    # -- method "sorted": group rows by token, then one fp32 reduction per out row ----------------
    def workspace(self, Ws, t, a):
        """Pointers to counts [t], offsets [t + 1], positions [a], row lists [a], first rows [t]
        in the workspace (the CuTe template's layout)."""
        base = fx.get_iter(Ws)
        return base, base + t, base + (2 * t + 1), base + (2 * t + 1 + a), base + (2 * t + 1 + 2 * a)

    def flat_index(self):
        return fx.block_idx.x * INDEX_THREADS + fx.thread_idx.x

    def wave_inclusive_scan(self, x, lane, width):
        """Inclusive prefix sum over lanes [0, width) of the wave (shuffles up)."""
        for d in range_constexpr(width.bit_length() - 1):
            up = fx.Int32(gpu.shuffle_up(x, 1 << d, WAVE))
            x = x + (lane >= (1 << d)).select(up, fx.Int32(0))
        return x

    @fk.kernel(lambda self: {"name": self.name + "_zero", "known_block_size": [INDEX_THREADS, 1, 1]})
    def zero_kernel(self, Ws: fx.Tensor, t: fx.Int32):
        counts = fx.get_iter(Ws)
        i = self.flat_index()
        if i < t:
            counts[i] = fx.Int32(0)

    @fk.kernel(lambda self: {"name": self.name + "_count", "known_block_size": [INDEX_THREADS, 1, 1]})
    def count_kernel(self, Tok: fx.Tensor, N: fx.Tensor, Ws: fx.Tensor, t: fx.Int32):
        a = Tok.shape.unpack()      # a 1-D shape unpacks to a scalar
        counts, _, pos, _, first = self.workspace(Ws, t, a)
        i = self.flat_index()
        if i < self.rows_to_do(N, a):
            tok = fx.get_iter(Tok)[i]
            if fx.Uint32(tok) < fx.Uint32(t):   # out-of-range tokens (either end) are skipped
                # The old count is this row's position among its token's rows; position 0 is
                # also recorded per token, so the reduction fetches that row without the offsets.
                p = fx.atomic_add(counts + tok, fx.Int32(1), syncscope=fx.rocdl.SyncScope.Agent)
                pos[i] = p
                if p == 0:
                    first[tok] = i

    @fk.kernel(lambda self: {"name": self.name + "_scan", "known_block_size": [SCAN_THREADS, 1, 1]})
    def scan_kernel(self, Ws: fx.Tensor, t: fx.Int32, a: fx.Int32):
        # One block: offsets = exclusive prefix sum of counts, offsets[t] = total. Tiles of
        # SCAN_THREADS * items counts (items = SCAN_ITEMS, fewer when t is small, so that small
        # inputs spread over every wave); wave w owns `items` consecutive chunks of WAVE, so every
        # load and store is a coalesced wave access, and all of a tile's loads are issued before
        # the first is used (one block is latency-bound). Wave totals are scanned in LDS; each
        # chunk is scanned with shuffles on top of the running sum; a carry runs across tiles.
        counts, offsets, _, _, _ = self.workspace(Ws, t, a)
        tid = fx.thread_idx.x
        wave, lane = tid // WAVE, tid % WAVE
        s_wave, s_total = fk.lds_ints(SCAN_WAVES, 1)
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
                w_incl = self.wave_inclusive_scan(w, lane, SCAN_WAVES)
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
                incl = self.wave_inclusive_scan(vals[u], lane, WAVE)
                if (u < items) & (i < t):
                    offsets[i] = run + incl - vals[u]
                run = run + fx.Int32(gpu.shuffle_idx(incl, WAVE - 1, WAVE))   # the chunk's total
            carry = carry + s_total[0]
            gpu.barrier()   # the next tile rewrites s_wave and s_total
        if tid == 0:
            offsets[t] = carry

    @fk.kernel(lambda self: {"name": self.name + "_place", "known_block_size": [INDEX_THREADS, 1, 1]})
    def place_kernel(self, Tok: fx.Tensor, N: fx.Tensor, Ws: fx.Tensor, t: fx.Int32):
        a = Tok.shape.unpack()
        _, offsets, pos, rows, _ = self.workspace(Ws, t, a)
        i = self.flat_index()
        if i < self.rows_to_do(N, a):
            tok = fx.get_iter(Tok)[i]
            if fx.Uint32(tok) < fx.Uint32(t):
                rows[offsets[tok] + pos[i]] = i

    @fk.kernel(lambda self: {"name": self.name + "_reduce"})
    def reduce_kernel(self, Out: fx.Tensor, Y: fx.Tensor, Ws: fx.Tensor, nthr: fx.Int32, block_rows: fx.Int32):
        # Token t (a thread row of the block, grid_and_block), chunk c: out[t] chunk c += the chunk
        # of each of token t's rows, summed in fp32 and rounded once. A token with no rows is not
        # touched. Vectors past the row end store nothing, as in the gather. A block's rows past
        # the last token repeat it and add nothing.
        n_tok = Out.shape.unpack()[0]
        mine = self.block_row(block_rows)
        t = (mine < n_tok).select(mine, n_tok - 1)
        _, offsets, _, rows, first = self.workspace(Ws, n_tok, Y.shape.unpack()[0])
        start = offsets[t]
        count = offsets[t + 1] - start
        count = (mine < n_tok).select(count, 0)
        row0 = first[t]     # the first row, beside the offsets (read only when count > 0)
        if count > 0:
            ids = self.vector_ids(nthr)
            nvec = Y.shape.unpack()[1] // self.vec
            out = self.block_rows(Out, t)
            # Register arrays (not Python values): the loop over the rows updates them in place.
            acc = [fx.make_rmem_tensor(self.vec, fx.Float32) for _ in range(self.unroll)]
            firsts = self.load_gathered(Y, row0, ids, nvec)
            for j, r in enumerate(self.load_block_row(out, ids)):
                fx.memref_store_vec(r.to(fx.Float32) + firsts[j].to(fx.Float32), acc[j])
            # Unrolled twice: two rows' loads in flight.
            for k in range(1, count, unroll=2):
                ys = self.load_gathered(Y, rows[start + k], ids, nvec)
                for j in range_constexpr(self.unroll):
                    fx.memref_store_vec(fx.memref_load_vec(acc[j]) + ys[j].to(fx.Float32), acc[j])
            for j in range_constexpr(self.unroll):
                rw.store(out, ids[j], fx.memref_load_vec(acc[j]).to(self.dtype), self.vec)

    # -- host launcher ---------------------------------------------------------------------------
    @fk.jit
    def __call__(self, Out: fx.Tensor, Y: fx.Tensor, Tok: fx.Tensor, N: fx.Tensor, Ws: fx.Tensor,
                 stream: fx.Stream = fx.Stream(None)):
        t = Out.shape.unpack()[0]
        a, d = Y.shape.unpack()
        if const_expr(self.sorted):
            t_blocks = ((t + INDEX_THREADS - 1) // INDEX_THREADS, 1, 1)
            a_blocks = ((a + INDEX_THREADS - 1) // INDEX_THREADS, 1, 1)
            index_block = (INDEX_THREADS, 1, 1)
            self.zero_kernel(Ws, t).launch(grid=t_blocks, block=index_block, stream=stream)
            self.count_kernel(Tok, N, Ws, t).launch(grid=a_blocks, block=index_block, stream=stream)
            self.scan_kernel(Ws, t, a).launch(grid=(1, 1, 1), block=(SCAN_THREADS, 1, 1), stream=stream)
            self.place_kernel(Tok, N, Ws, t).launch(grid=a_blocks, block=index_block, stream=stream)
            grid, block = self.grid_and_block(t, d)
            self.reduce_kernel(Out, Y, Ws, block[0], block[1], value_attrs=self.any_block()).launch(
                grid=grid, block=block, stream=stream)
        else:
            grid, block = self.grid_and_block(a, d, d // 2 + 1 if const_expr(self.word_pairs) else None)
            self.scatter_kernel(Out, Y, Tok, N, block[0], block[1], value_attrs=self.any_block()).launch(
                grid=grid, block=block, stream=stream)
