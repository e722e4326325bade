"""gather_scale_dense_tokens and scatter_add_dense_tokens for NVIDIA Hopper, in CuTe DSL, as kernel
classes: the config in ``__init__``, the host launcher in ``__call__``, one ``@cute.kernel``
method per kernel, the device helpers as plain methods. The contracts, the work split and the
two scatter methods are in ``moe_gather_scatter_cute``'s docstring.

``MoeRows`` holds what both ops share (the row vectors, the valid-row count); ``Gather`` and
``Scatter`` add their kernels. Imported only from the template's ``build()`` (it imports
``cutlass`` at module level). Helpers that are not ``@cute.kernel`` / ``@cute.jit`` are not
preprocessed: their Python loops unroll at trace time.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from mslk_dsl.templates._kernel_limits import ELEM_BYTES
from mslk_dsl.templates import _cute_rowwise as rw
from mslk_dsl.templates import _gather_scatter_space as shared
from mslk_dsl.templates._word_shift import shifted_words

MAX_THREADS = 1024
# A phased gather row's head and tail (at most 2 * (vector elements - 1)) are copied one element
# per slot, EDGE_SLOTS slots a thread, so such a row takes at least a vector's worth of threads.
EDGE_SLOTS = 2
# Threads a block of phased rows (gather, linked reduction) may take, by unroll: their registers
# grow with it (sm90a, bf16: gather 28 / 40 / 56 / 96 at unroll 1 / 2 / 4 / 8, linked reduction
# 48 / 64 / 96 / 142), and a block must fit the SM's 65536. Longer rows take more chunks.
PHASED_MAX_THREADS = {1: 1024, 2: 512, 4: 512, 8: 256}
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


@dataclass(frozen=True)   # frozen: the DSL passes it into dynamic ifs as a read-only value
class EdgeSlot:
    """An edge slot of a phased scatter row (``Scatter.edge_slot``): the out byte address its
    atomic add goes to, the row columns of its values (one or two; a column outside the row adds
    -0.0), and how many edge slots the row has."""
    addr: Int64
    cols: tuple
    count: Int32

    @property
    def width(self) -> int:
        return len(self.cols)


class MoeRows:
    """Row-vector access shared by the gather and the scatter kernels."""

    def __init__(self, config, sig):
        self.dtype = DTYPES[sig["dtype"]]
        self.vec, self.unroll = shared.vec(sig), config["unroll"]
        self.has_n = bool(sig["has_valid_count"])
        self.vec_bytes = sig["vec_bytes"]
        self.elem_bytes = ELEM_BYTES[sig["dtype"]]
        # Elements of a phased row's aligned vector (16 bytes), or None: rows of 16-byte accesses.
        self.phased_vec = 16 // self.elem_bytes if self.vec_bytes < 16 else None

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

    def grid_and_block(self, a, d, vec=None):
        """Grid and block for ``a`` rows of width ``d`` in vectors of ``vec`` elements (default: the
        signature's; else phased rows: at least one vector and ``vec`` threads a row, for the
        edges): block (b, c) takes rows b * R .. b * R + R - 1
        (thread row y of the block is row b * R + y) and chunk c of their vectors.

        A row takes whole warps (threads = its vectors / unroll rounded up to 32, at most
        MAX_THREADS, or PHASED_MAX_THREADS for phased rows; a longer row is split into chunks of
        equal share); a row that needs fewer than 32 threads takes the power
        of two that covers it. Rows then share a block of up to ROW_GROUP_THREADS threads
        (R = ROW_GROUP_THREADS // threads): a block per row of 72 bf16 (3 threads, rounded to a
        warp) launched 262144 blocks for 131072 tokens at top-2 and ran at the block scheduler's
        rate, ~0.6 ns a block on an H100, whatever the row width."""
        nvec = d // self.vec if const_expr(vec is None) else cutlass.max(d // vec, 1)
        need = (nvec + self.unroll - 1) // self.unroll
        cap = MAX_THREADS if const_expr(vec is None) else PHASED_MAX_THREADS[self.unroll]
        # A row longer than a block of `cap` threads takes chunks of equal share (a 1026-vector
        # phased row at unroll 2 took a 512-thread chunk and a chunk of one vector, each walking
        # the token's rows: 65-72% of copy at 8207 elements).
        parts = (need + cap - 1) // cap
        share = (need + parts - 1) // parts
        threads = cutlass.min((share + 31) // 32 * 32, cap)
        for lanes in (16, 8, 4, 2, 1):   # plain Python: the smallest power of two >= need, below a warp
            threads = Int32(cutlass.select_(need <= lanes, Int32(lanes), threads))
        if const_expr(vec is not None):
            threads = cutlass.max(threads, Int32(vec))
        rows = Int32(cutlass.max(ROW_GROUP_THREADS // threads, 1))
        chunks = (nvec + threads * self.unroll - 1) // (threads * self.unroll)
        return ((a + rows - 1) // rows, chunks, 1), (threads, rows, 1)

    def block_row(self):
        """The row (gather) or token (reductions) of this thread's row of the block."""
        b, _, _ = cute.arch.block_idx()
        _, y, _ = cute.arch.thread_idx()
        _, rows, _ = cute.arch.block_dim()
        return b * rows + y

    # -- phased rows (one element per access): see Gather --------------------------------------
    def load16(self, addr, dst):
        """One 16-byte load from byte address ``addr`` (16-byte aligned) into the 4 Int32 of ``dst``."""
        w128 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Int32, num_bits_per_copy=128,
                                   l1c_evict_priority=rw.KEEP)
        ptr = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=16)
        cute.copy(w128, cute.make_tensor(ptr, cute.make_layout(4)), dst)

    def phased_source(self, mSrc, r, pr):
        """Where row ``r`` of ``mSrc`` holds the bytes under the middle vectors of the phased out
        row ``pr``, as (wbase, woff, second): vector v's 16 bytes start woff bytes past wbase +
        16 v and are read as the aligned loads at wbase + 16 v and wbase + 16 v + second (second
        is 0 where woff is, since that block may lie past the row). A row with no middle aims
        its unused loads at the first aligned block of its row."""
        start = mSrc[r, None].iterator.toint()
        first = cutlass.select_(pr.nmid > 0, (mSrc[r, None].iterator + pr.head).toint(), start)
        woff = Int32(first % 16)
        return first - Int64(woff), woff, Int64(cutlass.select_(woff != 0, Int32(16), Int32(0)))

    def load_source(self, src, v, words):
        """The two loads under middle vector ``v`` (clamped to 0 and up) of a ``phased_source``
        into ``words`` (a (4, 2) Int32 register tensor)."""
        wbase, _, second = src
        at = wbase + Int64(16) * Int64(cutlass.max(v, 0))
        self.load16(at, words[None, 0])
        self.load16(at + second, words[None, 1])

    def source_values(self, words, woff):
        """The vector's phased_vec elements (dtype values) from its ``load_source`` words, moved
        into place (``shifted_words``; fp32 offsets are whole words, no funnel shift)."""
        funnel = rw.funnel_right if const_expr(self.elem_bytes == 2) else None
        flat = [words[e % 4, e // 4] for e in range(8)]
        packed = cute.make_rmem_tensor(4, Int32)
        for m, word in enumerate(shifted_words(flat, woff, 4, rw.select_word, funnel)):
            packed[m] = word
        return cute.recast_tensor(packed, self.dtype).load()

    def edge_slots(self, pr):
        """This thread's EDGE_SLOTS head / tail elements of the phased row ``pr``: (columns, which
        are its to do). Edge e goes to lane e % threads of the row's chunk-0 block, which has at
        least phased_vec lanes (grid_and_block), so 2 slots cover the 2 * (phased_vec - 1) edges."""
        tidx, _, _ = cute.arch.thread_idx()
        _, c, _ = cute.arch.block_idx()
        nthr, _, _ = cute.arch.block_dim()
        cols, mine = [], []
        for k in range(EDGE_SLOTS):   # plain Python: unrolled
            e = tidx + k * nthr
            cols.append(Int32(cutlass.select_(e >= pr.head, e + pr.nmid * self.phased_vec, e)))
            mine.append((c == 0) & (e < pr.nedge))
        return cols, mine

    def fake_rows(self, m, d):
        align = self.vec_bytes
        return make_fake_compact_tensor(self.dtype, (m, d), stride_order=(1, 0), assumed_align=align)


class Gather(MoeRows):
    """out[i] = x[token[i]] * score, a row per thread row of a block (``grid_and_block``).

    Rows narrower than 16-byte accesses (odd widths; 4- and 8-byte rows) are gathered phased: an
    out row and its source row sit at different offsets from a 16-byte boundary, so no one
    access width serves both.
    The out row is cut as ``_cute_rowwise.PhasedRow`` (a head, a middle of aligned 16-byte
    vectors, a tail); each middle vector's source is read as the two aligned 16-byte loads around
    it and moved into place in registers (``_word_shift.shifted_words``: selects and funnel
    shifts, the offset being one for the whole row), and the head and tail, at most 2 * (16 /
    element bytes - 1) elements, are copied one element at a time. One element per access moved
    2 bytes a load and ran at 44-60% of the copy roofline at 0.4-1 GiB (H200); the phased rows
    run at 98-99% there (H100), 4- and 8-byte rows 1.04-1.18x faster than in their own width."""

    def __init__(self, config, sig):
        super().__init__(config, sig)
        self.score_t = cutlass.BFloat16 if sig["score_dtype"] == "bfloat16" else cutlass.Float32

    @cute.kernel
    def gather_kernel(self, mX: cute.Tensor, mTok: cute.Tensor, mExp: cute.Tensor, mScore: cute.Tensor,
                      mN: cute.Tensor, mOut: cute.Tensor):
        row = self.block_row()
        if row < self.rows_to_do(mN, mOut.shape[0]):
            t = mTok[row]
            s = mScore[t, mExp[row]].to(Float32)
            if const_expr(self.phased_vec is None):
                self.gather_vectors(row, t, s, mX, mOut)
            else:
                self.gather_phased(row, t, s, mX, mOut)

    @cute.jit
    def gather_vectors(self, row, t, s, mX: cute.Tensor, mOut: cute.Tensor):
        """out row ``row`` = x row ``t`` * s in the signature's vectors."""
        VEC, dtype = self.vec, self.dtype
        ids, ok = self.vector_ids(mX.shape[1] // VEC)
        frags = self.load_row(cute.zipped_divide(mX[t, None], (VEC,)), ids)
        out_vecs = cute.zipped_divide(mOut[row, None], (VEC,))
        r = cute.make_rmem_tensor((VEC,), dtype)
        for j in cutlass.range_constexpr(self.unroll):
            if ok[j]:
                r.store((frags[j].load().to(Float32) * s).to(dtype))
                cute.autovec_copy(r, out_vecs[None, ids[j]])

    @cute.jit
    def gather_phased(self, row, t, s, mX: cute.Tensor, mOut: cute.Tensor):
        """out row ``row`` = x row ``t`` * s, phased (see the class docstring)."""
        PV, dtype = self.phased_vec, self.dtype
        d = mX.shape[1]
        pr = rw.phased_row(mOut, row, d, PV, True)
        src = self.phased_source(mX, t, pr)
        ids, ok = self.vector_ids(pr.nmid)
        # The head and the tail: loaded with the middle, stored after it.
        cols, mine = self.edge_slots(pr)
        edges = cute.make_rmem_tensor((EDGE_SLOTS,), dtype)
        for k in cutlass.range_constexpr(EDGE_SLOTS):
            edges[k] = mX[t, cutlass.min(cols[k], d - 1)]
        words = [cute.make_rmem_tensor((4, 2), Int32) for _ in range(self.unroll)]
        for j in cutlass.range_constexpr(self.unroll):   # every load first
            self.load_source(src, ids[j], words[j])
        mid = pr.middle(mOut)
        r = cute.make_rmem_tensor((PV,), dtype)
        for j in cutlass.range_constexpr(self.unroll):
            r.store((self.source_values(words[j], src[1]).to(Float32) * s).to(dtype))
            if ok[j]:
                cute.autovec_copy(r, mid[None, ids[j]])
        for k in cutlass.range_constexpr(EDGE_SLOTS):
            if mine[k]:
                mOut[row, cols[k]] = (edges[k].to(Float32) * s).to(dtype)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mTok: cute.Tensor, mExp: cute.Tensor, mScore: cute.Tensor,
                 mN: cute.Tensor, mOut: cute.Tensor, stream):
        grid, block = self.grid_and_block(mOut.shape[0], mX.shape[1], self.phased_vec)
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
        # Atomic method on rows of one element per access (odd widths): phased, as the gather.
        # The out row's aligned middle takes 16-byte vector atomics (REDG.ADD.BF16x8 / F16x8 /
        # F32x4) of the input row's bytes, read as the two aligned 16-byte loads around them and
        # shifted into place; the head and tail take one slot each per edge word or element:
        # 16-bit rows add aligned 4-byte words of the out row, both halves at once (BF16x2 /
        # F16x2: Hopper's lone bf16 / fp16 atomic add is a compare-and-swap loop, as torch's
        # index_add_ knows, fastAtomicAdd), a half outside the row adding -0.0, the exact
        # identity of IEEE addition (x + -0.0 == x for every x, -0.0 included); fp32 rows add
        # single elements.
        # The atomic kernel is phased on rows of one element per access only: rows of 4- and
        # 8-byte accesses keep their vector atomics (faster on short rows, moe_gather_scatter_cute).
        self.atomic_phased = self.vec == 1
        self.slot_bytes = 16 if self.atomic_phased else self.vec * self.elem_bytes
        self.slots = SCATTER_THREADS * self.unroll                       # slots per scatter block
        self.k_min = (MIN_SLICE_BYTES // self.slot_bytes).bit_length() - 1
        self.k_max = self.slots.bit_length() - 1

    # -- method "atomic" -------------------------------------------------------------------------
    @cute.kernel
    def scatter_kernel(self, mOut: cute.Tensor, mY: cute.Tensor, mTok: cute.Tensor, mN: cute.Tensor,
                       log2_slice: Int32):
        # Block (b, c): slice c (slots [c * slice, (c + 1) * slice)) of rows_per_block rows
        # (slot_of); a slot is a vector of the row, or, phased, see scatter_phased.
        tidx, _, _ = cute.arch.thread_idx()
        n = self.rows_to_do(mN, mY.shape[0])
        if const_expr(self.atomic_phased):
            self.scatter_phased(tidx, n, mOut, mY, mTok, log2_slice)
        else:
            self.scatter_vectors(tidx, n, mOut, mY, mTok, log2_slice)

    @cute.jit
    def scatter_vectors(self, tidx, n, mOut: cute.Tensor, mY: cute.Tensor, mTok: cute.Tensor, log2_slice: Int32):
        VEC, dtype = self.vec, self.dtype
        t, (a, d) = mOut.shape[0], mY.shape
        nslots = d // VEC
        frags, dsts, ok = [], [], []
        for j in cutlass.range_constexpr(self.unroll):   # every load first (clamped in bounds), then atomics
            row, v = self.slot_of(j * SCATTER_THREADS + tidx, log2_slice)
            row_c, v_c = cutlass.min(row, a - 1), cutlass.min(v, nslots - 1)
            tok = mTok[row_c]
            ok.append((row < n) & (v < nslots) & (tok >= 0) & (tok < t))
            tok_c = cutlass.max(cutlass.min(tok, t - 1), 0)
            f = cute.make_rmem_tensor((VEC,), dtype)
            cute.autovec_copy(cute.zipped_divide(mY[row_c, None], (VEC,))[None, v_c], f, l1c_evict_priority=STREAM)
            frags.append(f)
            dsts.append(cute.zipped_divide(mOut[tok_c, None], (VEC,))[None, v_c].iterator)
        for j in cutlass.range_constexpr(self.unroll):
            if ok[j]:
                cute.arch.atomic_add(dsts[j], frags[j].load().ir_value(), sem="relaxed", scope="gpu")

    def slot_of(self, slot, log2_slice):
        """(input row, slot of the row) of a block's ``slot``: block (b, c) takes slice c (slots
        [c * slice, (c + 1) * slice)) of its rows_per_block rows."""
        rb, c, _ = cute.arch.block_idx()
        rows_per_block = Int32(self.slots) >> log2_slice
        slice_slots = Int32(1) << log2_slice
        return rb * rows_per_block + (slot >> log2_slice), c * slice_slots + (slot & (slice_slots - 1))

    @cute.jit
    def scatter_phased(self, tidx, n, mOut: cute.Tensor, mY: cute.Tensor, mTok: cute.Tensor, log2_slice: Int32):
        """The atomic method on one-element rows: slot v of a row is the out row's middle vector v
        (v < nmid), else its edge slot v - nmid (an edge word or element; see __init__)."""
        PV, dtype = self.phased_vec, self.dtype
        t, (a, d) = mOut.shape[0], mY.shape
        words = [cute.make_rmem_tensor((4, 2), Int32) for _ in range(self.unroll)]
        edge_vals = cute.make_rmem_tensor((2, self.unroll), dtype)
        slots = []
        for j in cutlass.range_constexpr(self.unroll):   # every load first (clamped in bounds), then atomics
            row, v = self.slot_of(j * SCATTER_THREADS + tidx, log2_slice)
            row_c = cutlass.min(row, a - 1)
            tok = mTok[row_c]
            tok_c = cutlass.max(cutlass.min(tok, t - 1), 0)
            pr = rw.phased_row(mOut, tok_c, d, PV, True)
            edge = self.edge_slot(mOut, tok_c, pr, v - pr.nmid, d)
            mid = v < pr.nmid
            ok = (row < n) & (tok >= 0) & (tok < t) & (v < pr.nmid + edge.count)
            src = self.phased_source(mY, row_c, pr)
            vm = cutlass.max(cutlass.min(v, pr.nmid - 1), 0)
            if mid:
                self.load_source(src, vm, words[j])
            else:
                for h in cutlass.range_constexpr(edge.width):
                    col = edge.cols[h]
                    x = mY[row_c, cutlass.max(cutlass.min(col, d - 1), 0)]
                    edge_vals[h, j] = cutlass.select_((col >= 0) & (col < d), x, dtype(-0.0))
            # One address a slot, kept across the loads: the middle vector's or the edge slot's.
            dst = cutlass.select_(mid, (pr.middle(mOut)[None, vm].iterator).toint(), edge.addr)
            slots.append((ok & mid, ok & ~mid, src[1], dst))
        r = cute.make_rmem_tensor((PV,), dtype)
        f = cute.make_rmem_tensor((2,), dtype)
        for j in cutlass.range_constexpr(self.unroll):
            add_mid, add_edge, woff, dst = slots[j]
            if add_mid:
                r.store(self.source_values(words[j], woff))
                ptr = cute.make_ptr(dtype, dst, cute.AddressSpace.gmem, assumed_align=16)
                cute.arch.atomic_add(ptr, r.load().ir_value(), sem="relaxed", scope="gpu")
            if add_edge:
                ptr = cute.make_ptr(dtype, dst, cute.AddressSpace.gmem, assumed_align=4)
                if const_expr(self.elem_bytes == 2):
                    f[0], f[1] = edge_vals[0, j], edge_vals[1, j]
                    cute.arch.atomic_add(ptr, f.load().ir_value(), sem="relaxed", scope="gpu")
                else:
                    cute.arch.atomic_add(ptr, edge_vals[0, j], sem="relaxed", scope="gpu")

    def edge_slot(self, mOut, tok, pr, q, d):
        """Edge slot ``q`` of out row ``tok`` (a PhasedRow ``pr`` of width d): 16-bit rows, the
        q-th aligned 4-byte word of the row outside its middle (head words, then tail words;
        every word of a row with no middle), fp32 rows, the q-th head or tail element."""
        base = mOut[tok, None].iterator.toint()                         # Int64 byte address
        if const_expr(self.elem_bytes == 2):
            phase = Int32(base >> 1) & 1                                # the row starts mid-word
            words = (2 * phase + 2 * d + 3) // 4
            head_words = Int32(cutlass.select_(pr.nmid > 0, (phase + pr.head) // 2, words))
            w = Int32(cutlass.select_(q < head_words, q, q + 4 * pr.nmid))
            e0 = 2 * w - phase
            addr = base - Int64(2) * Int64(phase) + Int64(4) * Int64(w)
            return EdgeSlot(addr, (e0, e0 + 1), words - 4 * pr.nmid)
        col = Int32(cutlass.select_(q < pr.head, q, q + self.phased_vec * pr.nmid))
        return EdgeSlot(base + Int64(4) * Int64(col), (col,), pr.nedge)

    def row_slots(self, d):
        """Slots of a row of width d: its vectors, or (phased atomics) the most middle vectors a
        row can have plus the most edge slots (16-bit: 8 words; fp32: 6 elements)."""
        if const_expr(not self.atomic_phased):
            return d // self.vec
        return d // self.phased_vec + (8 if const_expr(self.elem_bytes == 2) else 6)

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
        if linked and self.phased_vec is not None:
            self.linked_reduce_token_phased(mine, mOut, mY, mWs)
        elif linked:
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

    @cute.jit
    def linked_reduce_token_phased(self, mine, mOut: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor):
        """``linked_reduce_token`` on rows of one element per access, phased: out row t's aligned
        middle in 16-byte vectors, each added row's bytes under it from the two aligned 16-byte
        loads around them, shifted into place (its own offset per row), the head and tail one
        element per slot (edge_slots); fp32 sums, one rounding, as the other rows."""
        PV, dtype = self.phased_vec, self.dtype
        n_tok, d = mOut.shape[0], mOut.shape[1]
        t = cutlass.min(mine, n_tok - 1)   # a block's rows past the last token repeat it
        heads, nxt = self.link_views(mWs, n_tok, mY.shape[0])
        row = Int32(cutlass.select_(mine < n_tok, heads[t], Int32(-1)))
        if row >= 0:
            pr = rw.phased_row(mOut, t, d, PV, True)
            ids, ok = self.vector_ids(pr.nmid)
            cols, mine_e = self.edge_slots(pr)
            # out's middle (aligned: one load a vector) and edges, beside the first row's.
            out_base, _, _ = self.phased_source(mOut, t, pr)
            out_words = [cute.make_rmem_tensor(4, Int32) for _ in range(self.unroll)]
            for j in cutlass.range_constexpr(self.unroll):
                self.load16(out_base + Int64(16) * Int64(cutlass.max(ids[j], 0)), out_words[j])
            sums_e = cute.make_rmem_tensor((EDGE_SLOTS,), Float32)
            for k in cutlass.range_constexpr(EDGE_SLOTS):
                sums_e[k] = mOut[t, cutlass.min(cols[k], d - 1)].to(Float32)
            words = [cute.make_rmem_tensor((4, 2), Int32) for _ in range(self.unroll)]
            vals_e = cute.make_rmem_tensor((EDGE_SLOTS,), dtype)
            src = self.phased_source(mY, row, pr)
            self.load_phased_row(mY, row, src, ids, cols, d, words, vals_e)
            row = nxt[row]
            sums = [cute.make_rmem_tensor((PV,), Float32) for _ in range(self.unroll)]
            for j in cutlass.range_constexpr(self.unroll):
                sums[j].store(cute.recast_tensor(out_words[j], dtype).load().to(Float32)
                              + self.source_values(words[j], src[1]).to(Float32))
            for k in cutlass.range_constexpr(EDGE_SLOTS):
                sums_e[k] = sums_e[k] + vals_e[k].to(Float32)
            while row >= 0:
                src = self.phased_source(mY, row, pr)
                self.load_phased_row(mY, row, src, ids, cols, d, words, vals_e)
                row = nxt[row]
                for j in cutlass.range_constexpr(self.unroll):
                    sums[j].store(sums[j].load() + self.source_values(words[j], src[1]).to(Float32))
                for k in cutlass.range_constexpr(EDGE_SLOTS):
                    sums_e[k] = sums_e[k] + vals_e[k].to(Float32)
            mid = pr.middle(mOut)
            r = cute.make_rmem_tensor((PV,), dtype)
            for j in cutlass.range_constexpr(self.unroll):
                if ok[j]:
                    r.store(sums[j].load().to(dtype))
                    cute.autovec_copy(r, mid[None, ids[j]])
            for k in cutlass.range_constexpr(EDGE_SLOTS):
                if mine_e[k]:
                    mOut[t, cols[k]] = sums_e[k].to(dtype)

    def load_phased_row(self, mY, row, src, ids, cols, d, words, vals_e):
        """Issue the loads of input row ``row`` under this thread's middle vectors (``src`` its
        phased_source) and edge slots."""
        for j in range(self.unroll):   # plain Python: unrolled
            self.load_source(src, ids[j], words[j])
        for k in range(EDGE_SLOTS):
            vals_e[k] = mY[row, cutlass.min(cols[k], d - 1)]

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
            grid, block = self.grid_and_block(t, d, self.phased_vec)
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
