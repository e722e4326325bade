"""MoE routing: top-k experts per token and the token indices grouped by expert, for NVIDIA
Hopper, in CuTe DSL.

Semantics follow meta-pytorch/MSLK ``torch.ops.mslk.index_shuffling`` (csrc/moe/index_shuffling.cu).

    kernel(scores, valid_count, counts, expert_indices, token_indices, ws_slots, ws_hist,
           top_k, expert_start, expert_end)

    scores          [T, E] bf16/fp32 (sig["score_dtype"]), any strides; E <= config["max_experts"]
    valid_count     [1] int32: tokens >= valid_count[0] are not routed; read only if
                    sig["has_valid_count"] (else any 1-element int32 tensor)
    counts          [E + 2] int32 out: counts[e] = tokens routed to expert e for e in
                    [expert_start, expert_end), 0 for other e; counts[E] = T; counts[E + 1] =
                    sum(counts[:E]). Fully written by the kernel (no zero-fill needed).
    expert_indices  [T * top_k] int32 out: the first counts[E + 1] entries hold
                    e - expert_start, grouped by expert in increasing e; the rest is unspecified.
    token_indices   [T * top_k] int32 out: the token of each of those entries.
    ws_slots        [T * top_k] int32 workspace (torch.empty).
    ws_hist         [MAX_CHUNKS * E] int32 workspace (torch.empty), MAX_CHUNKS = 128.
    top_k, expert_start, expert_end: int32 scalars; 1 <= top_k <= min(8, E),
                    0 <= expert_start <= expert_end <= E.

A token's experts are the top_k largest scores; ties go to the lower expert index (MSLK's merge
keeps the left, lower-index operand on ties too; torch.topk does not specify). Within an expert,
tokens are in increasing order, so the output is deterministic and equals a stable sort of the
(expert, token) pairs. Deliberate differences from MSLK: deterministic order (MSLK's atomics
give an arbitrary order within an expert); any E <= 256 and top_k <= 8 (MSLK: E in {16, 32, 128,
320}, so no 320 here; top_k in {1, 2, 4}); no cooperative launch or zero-filled counts; -0.0
ranks below +0.0 and NaN scores are unspecified. T < 2^23 (ranks are packed as rank << 8 | e).

Two kernels, no grid-wide barrier:
  route  (one block per chunk of tokens; each warp owns a contiguous run of the chunk): a group
         of ``lanes`` threads finds a token's top-k by k rounds of max over packed keys
         (orderable score bits << 8 | 255 - e: one integer max compares score, then index).
         Each warp ranks its selections per expert in token order with a private histogram in
         shared memory; the warps' counts are then scanned so the rank is the position within
         the chunk, written to ws_slots as rank << 8 | e (-1: not routed), and the chunk's
         per-expert counts go to ws_hist.
  place  (one block per chunk): prefix-sums ws_hist over chunks and experts to the chunk's
         base per expert and writes expert_indices / token_indices. Block 0 writes counts.
"""
from mslk_dsl.template import Template

SCORE_DTYPES = ("bfloat16", "float32")
MAX_CHUNKS = 128
PLACE_THREADS = 1024
UNROLL = 4                      # slots per place thread in flight


# lanes: threads per token (>= top_k); keys per lane = max_experts / lanes; warps: of a route block.
CONFIGS = (
    dict(max_experts=32, lanes=8, warps=32),
    dict(max_experts=64, lanes=8, warps=32),
    dict(max_experts=128, lanes=8, warps=32),
    dict(max_experts=128, lanes=16, warps=32),
    dict(max_experts=256, lanes=8, warps=16),
    dict(max_experts=256, lanes=16, warps=32),
)


def _valid(config, target, sig):
    keys = config["max_experts"] // config["lanes"]
    regs = keys * (2 if sig["score_dtype"] == "float32" else 1)
    # 1024 threads leave 64 registers per thread, 512 leave 128.
    return regs <= (32 if config["warps"] == 32 else 64)


def _heuristic(target, sig, problem):
    e = int(problem.get("E", 128))
    return dict(CONFIGS[0] if e <= 32 else CONFIGS[1] if e <= 64 else CONFIGS[2] if e <= 128 else CONFIGS[5])


def _device_code(config, sig):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64, const_expr

    MAX_E, LANES, NWARPS = config["max_experts"], config["lanes"], config["warps"]
    V = MAX_E // LANES              # keys per lane
    P = 32 // LANES                 # tokens per warp step
    NT = NWARPS * 32
    PB = PLACE_THREADS // MAX_E     # place: threads per expert for the chunk prefix sums
    EPL = max(MAX_E // 32, 1)       # place: experts per lane in the expert scan
    HAS_N = bool(sig["has_valid_count"])
    WIDE = sig["score_dtype"] == "float32"
    score_t = cutlass.Float32 if WIDE else cutlass.BFloat16
    KeyT = Int64 if WIDE else Int32
    BITS_T = Int32 if WIDE else cutlass.Int16
    SIGN_FREE = 0x7FFFFFFF if WIDE else 0x7FFF
    KEY_MIN = -(2 ** 63) if WIDE else -(2 ** 31)

    def n_routed(mN, t_total):
        n = t_total
        if const_expr(HAS_N):
            n = cutlass.min(mN[0], t_total)
        return n

    def token_keys(mScore, t, g):
        """This lane's packed keys of token t: experts g, g + LANES, ... (MIN where absent)."""
        n_tok, n_exp = mScore.shape
        raw = cute.make_rmem_tensor((V,), score_t)
        for j in range(V):
            raw[j] = mScore[cutlass.min(t, n_tok - 1), cutlass.min(j * LANES + g, n_exp - 1)]
        bits = cute.recast_tensor(raw, BITS_T)
        keys = cute.make_rmem_tensor((V,), KeyT)
        for j in range(V):
            e = j * LANES + g
            b = Int32(bits[j])
            ordered = b ^ ((b >> 31) & SIGN_FREE)      # float order as signed-integer order
            key = (KeyT(ordered) << 8) | KeyT(255 - e)
            keys[j] = KeyT(cutlass.select_((t < n_tok) & (e < n_exp), key, KeyT(KEY_MIN)))
        return keys

    def group_max(keys):
        m = keys[0]
        for j in range(1, V):
            m = cutlass.max(m, keys[j])
        off = LANES // 2
        while off >= 1:   # butterflies with offsets < LANES stay inside the group
            m = cutlass.max(m, cute.arch.shuffle_sync_bfly(m, offset=off))
            off //= 2
        return m

    @cute.kernel
    def route_kernel(mScore: cute.Tensor, mN: cute.Tensor, mSlots: cute.Tensor, mHist: cute.Tensor,
                     top_k: Int32, e_start: Int32, e_end: Int32, tpw: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        chunk, _, _ = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        grp, g = lane // LANES, lane % LANES
        n_tok, n_exp = mScore.shape
        n_valid = n_routed(mN, n_tok)
        smem = cutlass.memory.SmemAllocator()
        # whist[e + MAX_E * w]: warp w's count of expert e so far, later its offset in the chunk.
        whist = smem.allocate_tensor(Int32, cute.make_layout(MAX_E * NWARPS), byte_alignment=16)
        for i in cutlass.range_constexpr((MAX_E * NWARPS + NT - 1) // NT):
            if i * NT + tidx < MAX_E * NWARPS:
                whist[i * NT + tidx] = 0
        cute.arch.sync_threads()

        t_warp = (chunk * NWARPS + warp) * tpw
        for step in range(tpw // P):
            t = t_warp + step * P + grp
            keys = token_keys(mScore, t, g)
            win = KeyT(KEY_MIN)
            for r in range(top_k):
                m = group_max(keys)
                if g == r:
                    win = m
                for j in cutlass.range_constexpr(V):
                    if keys[j] == m:
                        keys[j] = KeyT(KEY_MIN)
            e = 255 - Int32(win & 255)
            routed = (g < top_k) & (t < n_valid) & (win != KeyT(KEY_MIN)) & (e >= e_start) & (e < e_end)
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
                    slot = (rank << 8) | e
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
                        mSlots[t * top_k + g] = slot + (whist[(slot & 255) + MAX_E * warp] << 8)

    @cute.kernel
    def place_kernel(mSlots: cute.Tensor, mHist: cute.Tensor, mCounts: cute.Tensor, mExpOut: cute.Tensor,
                     mTokOut: cute.Tensor, n_tok: Int32, top_k: Int32, e_start: Int32, e_end: Int32,
                     tpc: Int32, n_chunks: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        chunk, _, _ = cute.arch.block_idx()
        n_exp = mCounts.shape[0] - 2
        smem = cutlass.memory.SmemAllocator()
        s_pre = smem.allocate_tensor(Int32, cute.make_layout(PLACE_THREADS), byte_alignment=16)
        s_tot = smem.allocate_tensor(Int32, cute.make_layout(PLACE_THREADS), byte_alignment=16)
        s_base = smem.allocate_tensor(Int32, cute.make_layout(MAX_E), byte_alignment=16)

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
                    ee = slots[u] & 255
                    pos = s_base[ee] + (slots[u] >> 8)
                    mExpOut[pos] = ee - e_start
                    mTokOut[pos] = (t0 * top_k + s) // top_k

    @cute.jit
    def index_shuffling(mScore: cute.Tensor, mN: cute.Tensor, mCounts: cute.Tensor, mExpOut: cute.Tensor,
                        mTokOut: cute.Tensor, mSlots: cute.Tensor, mHist: cute.Tensor, top_k: Int32,
                        e_start: Int32, e_end: Int32, stream):
        n_tok = mScore.shape[0]
        step = NWARPS * P
        n_chunks = cutlass.min((n_tok + step - 1) // step, MAX_CHUNKS)
        tpw = ((n_tok + n_chunks - 1) // n_chunks + step - 1) // step * P   # tokens per warp
        tpc = tpw * NWARPS                                                   # tokens per chunk
        n_chunks = (n_tok + tpc - 1) // tpc
        route_kernel(mScore, mN, mSlots, mHist, top_k, e_start, e_end, tpw).launch(
            grid=(n_chunks, 1, 1), block=(NT, 1, 1), stream=stream)
        place_kernel(mSlots, mHist, mCounts, mExpOut, mTokOut, n_tok, top_k, e_start, e_end, tpc,
                     n_chunks).launch(grid=(n_chunks, 1, 1), block=(PLACE_THREADS, 1, 1), stream=stream)

    return index_shuffling, score_t


def build(config, target, sig):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    launcher, score_t = _device_code(config, sig)
    t, e, tk = cute.sym_int(), cute.sym_int(), cute.sym_int()

    def ints(*shape):
        return make_fake_compact_tensor(Int32, shape)

    scores = make_fake_tensor(score_t, (t, e), stride=(cute.sym_int(), cute.sym_int()))
    return launcher, [scores, ints(1), ints(cute.sym_int()), ints(tk), ints(tk), ints(tk),
                      ints(cute.sym_int()), Int32(1), Int32(0), Int32(8),
                      make_fake_stream(use_tvm_ffi_env_stream=True)]


TEMPLATE = Template(op="index_shuffling", backend="cute", targets=("sm90a",),
                    signatures={"score_dtype": SCORE_DTYPES, "has_valid_count": (False, True)},
                    configs=CONFIGS,
                    valid=_valid, heuristic=_heuristic, build=build)
