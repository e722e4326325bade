"""index_shuffling's kernels for NVIDIA Hopper, in CuTe DSL, as one kernel class: the config in
``__init__``, the host launcher in ``__call__``, one ``@cute.kernel`` method per kernel (route,
place) and the device helpers as plain methods. The contract and the algorithm are in
``index_shuffling_cute``'s docstring.

Imported only from that template's ``build()`` (it imports ``cutlass`` at module level).
Helpers that are not ``@cute.kernel`` / ``@cute.jit`` are not preprocessed: their Python loops
unroll at trace time.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from mslk_dsl.templates._kernel_limits import MAX_CHUNKS
from mslk_dsl.templates import _index_shuffling_space as space
from mslk_dsl.templates._index_shuffling_space import PLACE_THREADS, UNROLL

WARP = 32


class IndexShuffling(space.RouteGeometry):
    def __init__(self, config, sig, template: str = "index_shuffling_cute"):
        super().__init__(template, config, sig, WARP, "warps")
        self.score_t = cutlass.Float32 if self.wide else cutlass.BFloat16
        self.key_t = Int64 if self.wide else Int32
        self.bits_t = Int32 if self.wide else cutlass.Int16

    # -- helpers ---------------------------------------------------------------------------------
    def n_routed(self, mN, t_total):
        n = t_total
        if const_expr(self.has_n):
            n = cutlass.min(mN[0], t_total)
        return n

    def token_keys(self, mScore, t, g):
        """This lane's packed keys of token t: experts g, g + lanes, ... (MIN where absent)."""
        V, LANES, KeyT = self.keys_per_lane, self.lanes, self.key_t
        n_tok, n_exp = mScore.shape
        raw = cute.make_rmem_tensor((V,), self.score_t)
        for j in range(V):
            raw[j] = mScore[cutlass.min(t, n_tok - 1), cutlass.min(j * LANES + g, n_exp - 1)]
        bits = cute.recast_tensor(raw, self.bits_t)
        keys = cute.make_rmem_tensor((V,), KeyT)
        for j in range(V):
            e = j * LANES + g
            b = Int32(bits[j])
            ordered = b ^ ((b >> 31) & self.sign_free)      # float order as signed-integer order
            key = (KeyT(ordered) << self.expert_bits) | KeyT(self.expert_mask - e)
            keys[j] = KeyT(cutlass.select_((t < n_tok) & (e < n_exp), key, KeyT(self.key_min)))
        return keys

    def group_max(self, keys):
        m = keys[0]
        for j in range(1, self.keys_per_lane):
            m = cutlass.max(m, keys[j])
        off = self.lanes // 2
        while off >= 1:   # butterflies with offsets < lanes stay inside the group
            m = cutlass.max(m, cute.arch.shuffle_sync_bfly(m, offset=off))
            off //= 2
        return m

    def route_smem(self, smem):
        """whist[e + MAX_E * w]: warp w's count of expert e so far, later its offset in the chunk."""
        return smem.allocate_tensor(Int32, cute.make_layout(self.max_e * self.route_waves), byte_alignment=16)

    def place_smem(self, smem):
        """The place step's per-thread prefix and total counts, and the experts' bases."""
        return (smem.allocate_tensor(Int32, cute.make_layout(PLACE_THREADS), byte_alignment=16),
                smem.allocate_tensor(Int32, cute.make_layout(PLACE_THREADS), byte_alignment=16),
                smem.allocate_tensor(Int32, cute.make_layout(self.max_e), byte_alignment=16))

    # -- the two steps, each the work of one block on one chunk of tokens ---------------------------
    @cute.jit
    def route_chunk(self, mScore: cute.Tensor, mN: cute.Tensor, mSlots: cute.Tensor, mHist: cute.Tensor,
                    top_k: Int32, e_start: Int32, e_end: Int32, tpw: Int32, chunk: Int32, whist: cute.Tensor):
        MAX_E, LANES, NWARPS, NT = self.max_e, self.lanes, self.route_waves, self.threads
        P, V, KeyT = self.tokens_per_step, self.keys_per_lane, self.key_t
        tidx, _, _ = cute.arch.thread_idx()
        warp, lane = tidx // 32, tidx % 32
        grp, g = lane // LANES, lane % LANES
        n_tok, n_exp = mScore.shape
        n_valid = self.n_routed(mN, n_tok)
        for i in cutlass.range_constexpr((MAX_E * NWARPS + NT - 1) // NT):
            if i * NT + tidx < MAX_E * NWARPS:
                whist[i * NT + tidx] = 0
        cute.arch.sync_threads()

        t_warp = (chunk * NWARPS + warp) * tpw
        for step in range(tpw // P):
            t = t_warp + step * P + grp
            keys = self.token_keys(mScore, t, g)
            win = KeyT(self.key_min)
            for r in range(top_k):
                m = self.group_max(keys)
                if g == r:
                    win = m
                for j in cutlass.range_constexpr(V):
                    if keys[j] == m:
                        keys[j] = KeyT(self.key_min)
            e = self.expert_mask - Int32(win & self.expert_mask)
            routed = (g < top_k) & (t < n_valid) & (win != KeyT(self.key_min)) & (e >= e_start) & (e < e_end)
            # Rank in token order: the step's tokens take their turns (their experts are distinct).
            rank = Int32(0)
            for p in cutlass.range_constexpr(P):
                if routed & (grp == p):
                    rank = whist[e + MAX_E * warp]
                    whist[e + MAX_E * warp] = rank + 1
                cute.arch.sync_warp()
            if (g < top_k) & (t < n_tok):
                slot = Int32(-1)
                if routed:
                    slot = (rank << self.expert_bits) | e
                mSlots[t * top_k + g] = slot
        cute.arch.sync_threads()

        # Exclusive scan over warps per expert: warp offsets within the chunk, chunk totals.
        for i in cutlass.range_constexpr((MAX_E + NT - 1) // NT):
            e = i * NT + tidx
            if e < n_exp:
                acc = Int32(0)
                for w in cutlass.range_constexpr(NWARPS):
                    cnt = whist[e + MAX_E * w]
                    whist[e + MAX_E * w] = acc
                    acc = acc + cnt
                mHist[chunk * n_exp + e] = acc
        cute.arch.sync_threads()

        # Add the warp offsets to the ranks (each thread rereads the slots it wrote).
        if warp > 0:
            for step in range(tpw // P):
                t = t_warp + step * P + grp
                if (g < top_k) & (t < n_tok):
                    slot = mSlots[t * top_k + g]
                    if slot >= 0:
                        mSlots[t * top_k + g] = slot + (whist[(slot & self.expert_mask) + MAX_E * warp] << self.expert_bits)

    @cute.jit
    def place_chunk(self, mSlots: cute.Tensor, mHist: cute.Tensor, mCounts: cute.Tensor, mExpOut: cute.Tensor,
                    mTokOut: cute.Tensor, n_tok: Int32, top_k: Int32, e_start: Int32, e_end: Int32,
                    tpc: Int32, n_chunks: Int32, chunk: Int32, s_pre: cute.Tensor, s_tot: cute.Tensor,
                    s_base: cute.Tensor):
        MAX_E, PB, EPL = self.max_e, self.place_parts, self.experts_per_lane
        tidx, _, _ = cute.arch.thread_idx()
        n_exp = mCounts.shape[0] - 2

        # Per expert: the count of earlier chunks and of all chunks, PB threads per expert. The
        # loads are clamped rather than predicated so that all of them are in flight at once.
        e, part = tidx % MAX_E, tidx // MAX_E
        e_ld = cutlass.min(e, n_exp - 1)
        pre, tot = Int32(0), Int32(0)
        for i in cutlass.range_constexpr(MAX_CHUNKS // PB):
            c = part + i * PB
            v = mHist[cutlass.min(c, n_chunks - 1) * n_exp + e_ld]
            v = Int32(cutlass.select_((c < n_chunks) & (e < n_exp), v, Int32(0)))
            tot = tot + v
            pre = pre + Int32(cutlass.select_(c < chunk, v, Int32(0)))
        s_pre[tidx] = pre
        s_tot[tidx] = tot
        cute.arch.sync_threads()

        # Warp 0: exclusive scan over the selected experts; lane l owns experts l*EPL ... + EPL-1.
        if tidx < 32:
            local = cute.make_rmem_tensor((EPL,), Int32)
            lsum = Int32(0)
            for i in cutlass.range_constexpr(EPL):
                ee = tidx * EPL + i
                cnt = Int32(0)
                if (ee < n_exp) & (ee >= e_start) & (ee < e_end) & (ee < MAX_E):
                    for q in cutlass.range_constexpr(PB):
                        cnt = cnt + s_tot[ee + MAX_E * q]
                local[i] = cnt
                lsum = lsum + cnt
            incl = lsum
            for d in (1, 2, 4, 8, 16):
                up = cute.arch.shuffle_sync_up(incl, offset=d)
                if tidx >= d:
                    incl = incl + up
            run = incl - lsum
            for i in cutlass.range_constexpr(EPL):
                ee = tidx * EPL + i
                if ee < MAX_E:
                    before = run
                    for q in cutlass.range_constexpr(PB):
                        before = before + s_pre[ee + MAX_E * q]
                    s_base[ee] = before
                    if (chunk == 0) & (ee < n_exp):
                        mCounts[ee] = local[i]
                run = run + local[i]
            if (chunk == 0) & (tidx == 31):
                mCounts[n_exp] = n_tok
                mCounts[n_exp + 1] = incl
        cute.arch.sync_threads()

        t0 = chunk * tpc
        n_slots = cutlass.min(tpc, n_tok - t0) * top_k    # >= 1: no chunk is empty
        for s0 in range(tidx, n_slots, PLACE_THREADS * UNROLL):
            slots = []
            for u in cutlass.range_constexpr(UNROLL):   # loads first, then the dependent stores
                slots.append(mSlots[t0 * top_k + cutlass.min(s0 + u * PLACE_THREADS, n_slots - 1)])
            for u in cutlass.range_constexpr(UNROLL):
                s = s0 + u * PLACE_THREADS
                if (s < n_slots) & (slots[u] >= 0):
                    ee = slots[u] & self.expert_mask
                    pos = s_base[ee] + (slots[u] >> self.expert_bits)
                    mExpOut[pos] = ee - e_start
                    mTokOut[pos] = (t0 * top_k + s) // top_k

    # -- kernels ---------------------------------------------------------------------------------
    @cute.kernel
    def route_kernel(self, mScore: cute.Tensor, mN: cute.Tensor, mSlots: cute.Tensor, mHist: cute.Tensor,
                     top_k: Int32, e_start: Int32, e_end: Int32, tpw: Int32):
        chunk, _, _ = cute.arch.block_idx()
        whist = self.route_smem(cutlass.memory.SmemAllocator())
        self.route_chunk(mScore, mN, mSlots, mHist, top_k, e_start, e_end, tpw, chunk, whist)

    @cute.kernel
    def place_kernel(self, mSlots: cute.Tensor, mHist: cute.Tensor, mCounts: cute.Tensor, mExpOut: cute.Tensor,
                     mTokOut: cute.Tensor, n_tok: Int32, top_k: Int32, e_start: Int32, e_end: Int32,
                     tpc: Int32, n_chunks: Int32):
        chunk, _, _ = cute.arch.block_idx()
        s_pre, s_tot, s_base = self.place_smem(cutlass.memory.SmemAllocator())
        self.place_chunk(mSlots, mHist, mCounts, mExpOut, mTokOut, n_tok, top_k, e_start, e_end, tpc, n_chunks,
                         chunk, s_pre, s_tot, s_base)

    @cute.kernel
    def single_kernel(self, mScore: cute.Tensor, mN: cute.Tensor, mSlots: cute.Tensor, mHist: cute.Tensor,
                      mCounts: cute.Tensor, mExpOut: cute.Tensor, mTokOut: cute.Tensor, top_k: Int32,
                      e_start: Int32, e_end: Int32, tpw: Int32):
        """Both steps in one block over all tokens (one chunk): one launch where the two kernels
        take two. The place step reads what the route step wrote to the workspaces once the
        block's barrier has made those writes visible to every thread of the block."""
        smem = cutlass.memory.SmemAllocator()
        whist = self.route_smem(smem)
        s_pre, s_tot, s_base = self.place_smem(smem)
        self.route_chunk(mScore, mN, mSlots, mHist, top_k, e_start, e_end, tpw, Int32(0), whist)
        cute.arch.sync_threads()
        self.place_chunk(mSlots, mHist, mCounts, mExpOut, mTokOut, mScore.shape[0], top_k, e_start, e_end,
                         tpw * self.route_waves, Int32(1), Int32(0), s_pre, s_tot, s_base)

    # -- host launcher ---------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mScore: cute.Tensor, mN: cute.Tensor, mCounts: cute.Tensor, mExpOut: cute.Tensor,
                 mTokOut: cute.Tensor, mSlots: cute.Tensor, mHist: cute.Tensor, top_k: Int32,
                 e_start: Int32, e_end: Int32, stream):
        n_tok = mScore.shape[0]
        step = self.route_waves * self.tokens_per_step
        if const_expr(self.single):  # one block, one chunk of every token
            tpw = (n_tok + step - 1) // step * self.tokens_per_step
            self.single_kernel(mScore, mN, mSlots, mHist, mCounts, mExpOut, mTokOut, top_k, e_start, e_end,
                               tpw).launch(grid=(1, 1, 1), block=(self.threads, 1, 1), stream=stream)
        else:
            n_chunks = cutlass.min((n_tok + step - 1) // step, MAX_CHUNKS)
            tpw = ((n_tok + n_chunks - 1) // n_chunks + step - 1) // step * self.tokens_per_step  # per warp
            tpc = tpw * self.route_waves                                                        # per chunk
            n_chunks = (n_tok + tpc - 1) // tpc
            self.route_kernel(mScore, mN, mSlots, mHist, top_k, e_start, e_end, tpw).launch(
                grid=(n_chunks, 1, 1), block=(self.threads, 1, 1), stream=stream)
            self.place_kernel(mSlots, mHist, mCounts, mExpOut, mTokOut, n_tok, top_k, e_start, e_end, tpc,
                              n_chunks).launch(grid=(n_chunks, 1, 1), block=(PLACE_THREADS, 1, 1), stream=stream)

    def fake_args(self):
        """Compile-time stand-ins for ``__call__``'s arguments, every size dynamic."""
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

        t, e, tk = cute.sym_int(), cute.sym_int(), cute.sym_int()

        def ints(*shape):
            return make_fake_compact_tensor(Int32, shape)

        scores = make_fake_tensor(self.score_t, (t, e), stride=(cute.sym_int(), cute.sym_int()))
        return [scores, ints(1), ints(cute.sym_int()), ints(tk), ints(tk), ints(tk),
                ints(cute.sym_int()), Int32(1), Int32(0), Int32(8),
                make_fake_stream(use_tvm_ffi_env_stream=True)]
