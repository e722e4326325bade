"""FlyDSL flash-attention forward for CDNA3 (gfx942) and CDNA4 (gfx950), with MFMA.

One kernel serves prefill (dense or packed sequences), the KV splits of decode over a
contiguous or paged cache, the masks and GQA:

  dense   q [B, Mq, H, D]  k [B, Mk, Hkv, D]  v [B, Mk, Hkv, Dv]  out [B, Mq, H, Dv]  lse [B, H, Mq] fp32
  varlen  q [Tq, H, D]     k [Tk, Hkv, D]     v [Tk, Hkv, Dv]     out [Tq, H, Dv]     lse [H, Tq]
          sequence s: query rows seqstart_q[s]:seqstart_q[s+1], keys seqstart_k[s]:seqstart_k[s+1]
  decode  q [B, Mq, H, D]  k, v [N, page, Hkv, D]  fp32 partials out [S, B, Mq, H, D], lse
          [S, B, H, Mq]; sequence b has kv_seqlen[b] keys, in pages block_table[b, j // page]
          (paged) or in row b of the cache (contiguous: N = B)
Dv is D but for DeepSeek's MLA prefill (D 192, Dv 128; prefill only, decode takes Dv = D).

A block serves one KV head (``block_idx.y``) of one sequence (``block_idx.z``) and 16 rows per
wave, where rows are (query, head of the KV head's group) pairs: row r is query r // G of q head
hk * G + r % G (G = H // Hkv). So the G q heads that share a KV head read each K/V tile once,
and a decode step (Mq = 1) still fills the MFMA's 16 columns with G heads.

Per KV tile of ``block_n`` keys (the pattern of FlashAttention-2, with ROCm/FlyDSL's trick of
computing the transposed scores, kernels/attention/flash_attn_generic.py):

  global --buffer_load_dwordx4--> registers (next tile, in flight during this tile's math)
         --ds_write--> LDS: K row-major, V transposed (Vt [D, block_n])
  S^T = K Q^T     MFMA: A = K rows from LDS, B = Q from registers (loaded once)
  online softmax  each lane holds 4 keys x 1 row of every 16 x 16 score tile, so a row's max
                  and sum are a lane's own values plus two cross-lane steps (lanes l ^ 16, ^ 32)
  O^T += Vt P^T   the scores' accumulator layout is exactly the B operand layout of the second
                  MFMA, so P goes from fp32 to bf16/fp16 in registers, never through LDS
The MFMA is v_mfma_f32_16x16x16 on gfx942 and v_mfma_f32_16x16x32 on gfx950 (twice the K per
instruction); both give the 16 x 16 fp32 tile the softmax works on.

Keys a row may see, per sequence of Mq queries and Mk keys (the op layer's convention, see
mslk_dsl/ops/attention.py): key j < Mk is visible to query i when
    -window_left <= j - i - (Mk - Mq) <= window_right
(a band around the bottom-right diagonal; the op shifts a top-left band by Mk - Mq; a side
without bound is WINDOW_NONE). The mask family is static ("none" compares nothing but the
sequence end, "causal" the right bound, "local" both). Only the KV tiles that some row of the
block can see are visited (causal and local blocks skip the rest); rows that see no key get
out = 0 and lse = -inf.

Out-of-range reads (rows past Mq or Mk, padding keys) come from buffer descriptors and read as
zero, out-of-range stores are dropped: every size is dynamic. Offsets within one batch (or one
varlen sequence's tensors) are 32-bit: a batch's slice of each tensor must stay under
SLICE_BYTES. The last dim must be contiguous and every other stride a multiple of 8 elements
(16-byte rows), the op layer checks both (decode's q may have any strides: it is read once).

flydsl is imported lazily inside the builders; config values reach the kernel as closure
scalars, which FlyDSL's cache key covers.
"""

from mslk_dsl.errors import ConfigError

WAVE = 64
MMA = 16  # v_mfma_f32_16x16x16_{bf16,f16}: a wave computes one 16 x 16 fp32 tile per K of 16
LDS_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
K_PAD = 8  # elements after each K row in LDS: rows start on different banks, 16-byte aligned
V_PAD = 4  # elements after each Vt row: 8-byte aligned reads, rows on different banks
# A mask bound that never binds: window_left / window_right of "unbounded".
WINDOW_NONE = 1 << 30
# Size of every buffer descriptor; an offset at or past it reads 0 and drops stores.
SLICE_BYTES = 1 << 30
# merge: a lane holds MERGE_VEC elements of an aligned row per pass
MERGE_VEC = 4
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Mask families a kernel is built for (the attention op's, in its order).
MASKS = ("none", "causal", "local")
_DTYPES = {"bfloat16": "BFloat16", "float16": "Float16"}


def threads_of(config) -> int:
    return WAVE * config["waves"]


def lds_bytes(config, head_dim: int, head_dim_v: int | None = None, elem_bytes: int = 2) -> int:
    bn, dv = config["block_n"], head_dim_v or head_dim
    return (bn * (head_dim + K_PAD) + dv * (bn + V_PAD)) * elem_bytes


def check_config(config, target: str, head_dim: int, head_dim_v: int | None = None) -> str | None:
    """Why ``config`` cannot run q / k rows of ``head_dim`` and v rows of ``head_dim_v`` (default:
    ``head_dim``) on ``target``, or None if it can."""
    bn, threads, dv = config["block_n"], threads_of(config), head_dim_v or head_dim
    if bn % MMA:
        return "block_n must be a multiple of 16"
    if (bn * head_dim // 8) % threads or (bn * dv // 8) % threads:
        return "a K/V tile must split into whole 16-byte chunks per thread"
    if lds_bytes(config, head_dim, dv) > LDS_BYTES[target]:
        return "the K and V tiles do not fit in LDS"
    # registers per lane: O^T accumulators (Dv / 16 x 4 fp32), Q (D / 16 x 2), scores
    # (block_n / 16 x 4, and their bf16 / fp16 copies), the next K/V tile in flight (chunks
    # x 4 each): at most 160 of them, which leaves room for addresses in 256 VGPRs
    in_flight = (bn * head_dim // 8 // threads + bn * dv // 8 // threads) * 4
    if head_dim // 16 * 2 + dv // 16 * 4 + bn // 16 * 6 + in_flight > 160:
        return "too many registers per lane"
    return None


def dsl_type(dtype: str):
    import flydsl.expr as fx
    return getattr(fx, _DTYPES[dtype])


def make_attention_kernel(*, target: str, dtype: str, head_dim: int, waves: int, block_n: int,
                          mask: str = "local", varlen: bool = False, decode: bool = False,
                          head_dim_v: int | None = None):
    """The ``@flyc.kernel`` and its launch geometry (rows per block, threads per block).

    Kernel arguments: (q, k, v, out, lse, seq_q, seq_k, table, scale, window_left, window_right,
    paged), on grid (ceil(Mq * G / rows), Hkv, sequences * splits), layouts as in the module
    docstring:
      prefill: seq_q / seq_k the int32 sequence starts (``varlen``; else unread placeholders),
               table and paged unread;
      decode:  seq_q unread, seq_k kv_seqlen [B], table the block table [B, max pages] (read when
               paged != 0), out / lse the fp32 partials; the S = out.shape[0] splits cut each
               sequence's KV tiles into near-equal chunks. A page holds a multiple of 16 keys.
    """
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl.expr import T, arith, const_expr, gpu, range_constexpr
    from flydsl.expr import math as fmath
    from flydsl.expr.utils.arith import fastmath
    from flydsl._mlir.dialects.rocdl import log as log2_hw

    if mask not in MASKS:
        raise ConfigError(f"FlyDSL attention kernel ({target}, head_dim {head_dim}, waves {waves}, block_n {block_n}): "
                          f"mask {mask!r} is not one of {MASKS}")
    D, DV, BN, W = head_dim, head_dim_v or head_dim, block_n, waves
    if decode and DV != D:
        raise ConfigError(f"FlyDSL attention kernel ({target}, head_dim {head_dim}, head_dim_v {head_dim_v}): "
                          "decode reads k and v through one page table walk and takes one head dim")
    THREADS, BM = WAVE * W, MMA * W
    D_TILES, N_TILES = DV // MMA, BN // MMA   # O^T's 16-row tiles (of v's head dim), key tiles
    # gfx950's v_mfma_f32_16x16x32 takes 8 elements per lane (twice the K of gfx942's 16x16x16,
    # at twice the rate): QK^T steps 32 head-dim values; PV pairs two 16-key tiles (see below)
    WIDE = target == "gfx950"
    MMA_K = 32 if WIDE else 16
    LANE_K = MMA_K // 4              # elements of one operand per lane
    K_STEPS = D // MMA_K
    CPR, CPR_V = D // 8, DV // 8     # 16-byte chunks per K row, per V row
    CHUNKS, CHUNKS_V = BN * CPR // THREADS, BN * CPR_V // THREADS   # per thread and tile
    K_ROW, V_ROW = D + K_PAD, BN + V_PAD
    DECODE, VARLEN = bool(decode), bool(varlen) and not decode
    LEFT, RIGHT = mask == "local", mask in ("causal", "local")   # which band sides to compare
    BF16 = dtype == "bfloat16"
    elem = dsl_type(dtype)
    out_elem = fx.Float32 if DECODE else elem
    OUT_VEC = 4
    OOB8 = SLICE_BYTES // 16         # an 8-element (16-byte) index past every descriptor
    OOB1 = SLICE_BYTES // 4
    OOB2 = SLICE_BYTES // 2
    OOB_Q = SLICE_BYTES // (LANE_K * elem.width // 8)
    OOB_OUT = SLICE_BYTES // (OUT_VEC * out_elem.width // 8)
    kind = "decode" if DECODE else ("varlen" if VARLEN else "fwd")
    name = f"mslk_attention_{kind}_{mask}_{dtype}_d{D}{'' if DV == D else f'v{DV}'}_w{W}_n{BN}"

    @fx.struct
    class Smem:
        k: fx.Array[elem, BN * K_ROW, 16]
        vt: fx.Array[elem, DV * V_ROW, 16]

    def view(ptr, vec, dt, nbytes=None):
        size = fx.Int64(SLICE_BYTES) if nbytes is None else nbytes
        buf = fx.rocdl.make_buffer_ptr(ptr, num_records_bytes=size)
        n = SLICE_BYTES // (dt.width // 8)
        return fx.logical_divide(fx.make_view(buf, fx.make_layout(n, 1)), fx.make_layout(vec, 1))

    def g_load(v, j, vec, dt, into=None):
        r = into if into is not None else fx.make_rmem_tensor(vec, dt)
        fx.copy(fx.make_copy_atom(fx.rocdl.BufferCopy(vec * dt.width), dt.width), fx.slice(v, (None, j)), r)
        return r

    def g_scalar(v, j):
        return fx.memref_load_vec(g_load(v, j, 1, fx.Int32))[0]

    def g_store(v, j, value, vec, dt):
        r = fx.make_rmem_tensor(vec, dt)
        fx.memref_store_vec(value, r)
        fx.copy(fx.make_copy_atom(fx.rocdl.BufferCopy(vec * dt.width), dt.width), r, fx.slice(v, (None, j)))

    def mma(a, b, c):
        if WIDE:
            op = fx.rocdl.mfma_f32_16x16x32_bf16 if BF16 else fx.rocdl.mfma_f32_16x16x32_f16
            return fx.Vector(op(T.vec(4, T.f32), [a, b, c]))
        a, b = a.bitcast(fx.Int16), b.bitcast(fx.Int16)
        if BF16:
            return fx.Vector(fx.rocdl.mfma_f32_16x16x16bf16_1k(T.vec(4, T.f32), [a, b, c]))
        return fx.Vector(fx.rocdl.mfma_f32_16x16x16f16(T.vec(4, T.f32), [a.bitcast(fx.Float16),
                                                                        b.bitcast(fx.Float16), c]))

    def concat(a, b):
        return fx.Vector.from_elements([a[i] for i in range(len(a))] + [b[i] for i in range(len(b))], elem)

    def uniform(x):
        return fx.Int32(fx.rocdl.readfirstlane(T.i32, fx.Int32(x)))

    def fmax(a, b):
        # maxnum (v_max_f32): scores are never NaN for finite inputs, and fx.max's NaN-propagating
        # maximum costs a compare and a select per call
        return fx.Float32(fx.arith.maxnumf(a, b))

    def base(tensor, *index_strides):
        """The tensor's address plus sum(index * stride), in 64 bits."""
        addr = fx.get_iter(tensor)
        for index, stride in index_strides:
            addr = addr + fx.Int64(index) * fx.Int64(stride)
        return addr

    @flyc.kernel(name=name, known_block_size=[THREADS, 1, 1])
    def attention(q: fx.Tensor, k: fx.Tensor, v: fx.Tensor, out: fx.Tensor, lse: fx.Tensor,
                  seq_q: fx.Tensor, seq_k: fx.Tensor, table: fx.Tensor, scale: fx.Float32,
                  window_left: fx.Int32, window_right: fx.Int32, paged: fx.Int32):
        tid = fx.thread_idx.x
        lane = tid % WAVE
        wave = uniform(tid // WAVE)
        col = lane % MMA             # the lane's row within its wave's 16 (an MFMA column)
        quad = lane // MMA           # which 4 of each 16 keys / head-dim values the lane holds
        hk = fx.block_idx.y
        q_strides, k_strides, v_strides = q.stride.unpack(), k.stride.unpack(), v.stride.unpack()
        o_strides, l_strides = out.stride.unpack(), lse.stride.unpack()
        if const_expr(VARLEN):
            mq_all, heads, _ = q.shape.unpack()
            mk_all, kv_heads, _ = k.shape.unpack()
        else:
            _, mq_all, heads, _ = q.shape.unpack()
            _, mk_all, kv_heads, _ = k.shape.unpack()   # decode: mk_all is the page size
        group = heads // kv_heads
        if const_expr(DECODE):
            splits = out.shape.unpack()[0]
            seq = fx.block_idx.z // splits
            split = fx.block_idx.z % splits
        else:
            seq = fx.block_idx.z
            split = fx.Int32(0)
            splits = fx.Int32(1)

        # -- the sequence: first query / key rows, lengths, and the 64-bit bases of its slices
        if const_expr(VARLEN):
            sq_view, sk_view = view(fx.get_iter(seq_q), 1, fx.Int32), view(fx.get_iter(seq_k), 1, fx.Int32)
            q_start, k_start = uniform(g_scalar(sq_view, seq)), uniform(g_scalar(sk_view, seq))
            mq = uniform(g_scalar(sq_view, seq + 1)) - q_start
            mk = uniform(g_scalar(sk_view, seq + 1)) - k_start
            sqm, sqh = q_strides[0], q_strides[1]
            skm, skh = k_strides[0], k_strides[1]
            svm, svh = v_strides[0], v_strides[1]
            som, soh = o_strides[0], o_strides[1]
            slh, slm = l_strides[0], l_strides[1]
            q_base, o_base = base(q, (q_start, sqm)), base(out, (q_start, som))
            k_base, v_base = base(k, (k_start, skm)), base(v, (k_start, svm))
            l_base = base(lse, (q_start, slm))
        else:
            mq = mq_all
            if const_expr(DECODE):
                mk = uniform(g_scalar(view(fx.get_iter(seq_k), 1, fx.Int32), seq * fx.Int32(seq_k.stride.unpack())))
            else:
                mk = mk_all
            sqm, sqh = q_strides[1], q_strides[2]
            skm, skh = k_strides[1], k_strides[2]
            svm, svh = v_strides[1], v_strides[2]
            som, soh = o_strides[-3], o_strides[-2]
            slh, slm = l_strides[-2], l_strides[-1]
            q_base = base(q, (seq, q_strides[0]))
            k_base, v_base = base(k, (seq, k_strides[0])), base(v, (seq, v_strides[0]))
            o_base = base(out, (seq, o_strides[-4]))
            l_base = base(lse, (seq, l_strides[-3]))
            if const_expr(DECODE):   # the split's slice of the partials
                o_base = o_base + fx.Int64(split) * fx.Int64(o_strides[0])
                l_base = l_base + fx.Int64(split) * fx.Int64(l_strides[0])
        # offsets inside a slice are 32-bit (slices stay under SLICE_BYTES)
        sqm, sqh, skm, skh = fx.Int32(sqm), fx.Int32(sqh), fx.Int32(skm), fx.Int32(skh)
        svm, svh, som, soh = fx.Int32(svm), fx.Int32(svh), fx.Int32(som), fx.Int32(soh)
        slh, slm = fx.Int32(slh), fx.Int32(slm)
        q_view, q_view1 = view(q_base, LANE_K, elem), view(q_base, 1, elem)
        k_view, v_view = view(k_base, 8, elem), view(v_base, 8, elem)
        o_view = view(o_base, OUT_VEC, out_elem)
        l_view = view(l_base, 1, fx.Float32)
        if const_expr(DECODE):
            # the block table, bounded by its own bytes (a contiguous cache passes a placeholder)
            t_rows, t_cols = table.shape.unpack()
            t_row_stride, t_col_stride = table.stride.unpack()
            table_view = view(fx.get_iter(table), 1, fx.Int32,
                              (fx.Int64(t_rows - 1) * fx.Int64(t_row_stride)
                               + fx.Int64(t_cols - 1) * fx.Int64(t_col_stride) + 1) * 4)
            table_row = seq * fx.Int32(t_row_stride)
            t_col_stride = fx.Int32(t_col_stride)
            is_paged = paged != 0

        # -- this lane's row: query m of q head h
        row0 = fx.block_idx.x * BM
        row = row0 + wave * MMA + col
        m = row // group
        h = hk * group + row % group
        row_ok = m < mq
        diag = m + (mk - mq)         # the row's key on the bottom-right diagonal
        row_lo, row_hi = fx.Int32(0), mk   # the keys [row_lo, row_hi) the row sees
        if const_expr(LEFT):
            row_lo = fx.max(diag - window_left, fx.Int32(0))
        if const_expr(RIGHT):
            row_hi = fx.min(diag + window_right + 1, mk)
        row_span = fx.Uint32(fx.max(row_hi - row_lo, fx.Int32(0)))

        # -- the KV tiles some row of the block can see, cut into the block's split
        m_first = row0 // group
        m_last = fx.min((row0 + (BM - 1)) // group, mq - 1)
        kv_lo = fx.Int32(0)
        kv_hi = mk
        if const_expr(LEFT):
            kv_lo = fx.max(m_first + (mk - mq) - window_left, fx.Int32(0))
        if const_expr(RIGHT):
            kv_hi = fx.min(m_last + (mk - mq) + window_right + 1, mk)
        kv_hi = (m_first < mq).select(kv_hi, fx.Int32(0))
        t_first = kv_lo // BN
        t_last = fx.max((kv_hi + (BN - 1)) // BN, t_first)
        per_split = (t_last - t_first + (splits - 1)) // splits
        t_begin = uniform(fx.min(t_first + split * per_split, t_last))
        t_end = uniform(fx.min(t_begin + per_split, t_last))

        # -- Q^T as the B operand of S^T = K Q^T, in registers for the whole loop
        q_frag = []
        for kk in range_constexpr(K_STEPS):
            q_at = m * sqm + h * sqh + kk * MMA_K + quad * LANE_K
            if const_expr(DECODE):
                # decode takes q with any strides: 2-byte loads (once per block)
                q_elems = [g_load(q_view1, row_ok.select(q_at + e, fx.Int32(OOB2)), 1, elem)
                           for e in range_constexpr(LANE_K)]
                q_frag.append(fx.Vector.from_elements([fx.memref_load_vec(x)[0] for x in q_elems], elem))
            else:
                q_idx = fx.Int32(q_at // LANE_K)
                q_frag.append(fx.memref_load_vec(g_load(q_view, row_ok.select(q_idx, fx.Int32(OOB_Q)), LANE_K,
                                                        elem)))

        lds = fx.SharedAllocator().allocate(Smem).peek()
        k_lds = fx.make_view(lds.k.ptr, fx.make_layout(BN * K_ROW, 1))
        vt_lds = fx.make_view(lds.vt.ptr, fx.make_layout(DV * V_ROW, 1))
        k_lds8 = fx.logical_divide(k_lds, fx.make_layout(8, 1))
        k_lds4 = fx.logical_divide(k_lds, fx.make_layout(4, 1))
        vt_lds4 = fx.logical_divide(vt_lds, fx.make_layout(4, 1))
        lds_copy128 = fx.make_copy_atom(fx.UniversalCopy128b(), elem.width)
        lds_copy64 = fx.make_copy_atom(fx.UniversalCopy64b(), elem.width)

        # -- K / V tile loads: chunk c of a tile is row c // CPR, 16-byte column c % CPR (V: CPR_V)
        k_regs = [fx.make_rmem_tensor(8, elem) for _ in range_constexpr(CHUNKS)]
        v_regs = [fx.make_rmem_tensor(8, elem) for _ in range_constexpr(CHUNKS_V)]

        def load_tile(t):
            for c in range_constexpr(max(CHUNKS, CHUNKS_V)):
                chunk = tid + c * THREADS
                key = t * BN + chunk // CPR
                ok = key < mk
                k_pass, v_pass, at = k_view, v_view, key
                if const_expr(DECODE):
                    # A wave's rows of one pass (64 / CPR <= 8 consecutive keys) lie in one
                    # 16-key block, so in one page: the page, its base and its descriptor are
                    # wave-uniform. Contiguous: page b is the sequence's row of the cache.
                    slot = is_paged.select(uniform(key) // mk_all, fx.Int32(0))
                    entry = is_paged.select(table_row + fx.min(slot, t_cols - 1) * t_col_stride, fx.Int32(OOB1))
                    page = is_paged.select(uniform(g_scalar(table_view, entry)), seq)
                    k_pass = view(base(k, (page, k_strides[0])), 8, elem)
                    v_pass = view(base(v, (page, v_strides[0])), 8, elem)
                    at = key - slot * mk_all
                if const_expr(c < CHUNKS):
                    jk = fx.Int32((at * skm + hk * skh + (chunk % CPR) * 8) // 8)
                    g_load(k_pass, ok.select(jk, fx.Int32(OOB8)), 8, elem, into=k_regs[c])
                if const_expr(c < CHUNKS_V):
                    v_at, v_ok = at, ok
                    if const_expr(CPR_V != CPR):   # v rows of another length (prefill only)
                        v_at = t * BN + chunk // CPR_V
                        v_ok = v_at < mk
                    jv = fx.Int32((v_at * svm + hk * svh + (chunk % CPR_V) * 8) // 8)
                    g_load(v_pass, v_ok.select(jv, fx.Int32(OOB8)), 8, elem, into=v_regs[c])

        def store_tile():
            for c in range_constexpr(CHUNKS):
                chunk = tid + c * THREADS
                r, c8 = chunk // CPR, chunk % CPR
                fx.copy(lds_copy128, k_regs[c], fx.slice(k_lds8, (None, r * (K_ROW // 8) + c8)))
            for c in range_constexpr(CHUNKS_V):
                chunk = tid + c * THREADS
                r, c8 = chunk // CPR_V, chunk % CPR_V
                vals = fx.memref_load_vec(v_regs[c])
                for e in range_constexpr(8):
                    fx.memref_store(vals[e], vt_lds, (c8 * 8 + e) * V_ROW + r)

        def lds_frag(v4, j):
            r = fx.make_rmem_tensor(4, elem)
            fx.copy(lds_copy64, fx.slice(v4, (None, j)), r)
            return fx.memref_load_vec(r)

        def lds_frag8(v8, j):
            r = fx.make_rmem_tensor(8, elem)
            fx.copy(lds_copy128, fx.slice(v8, (None, j)), r)
            return fx.memref_load_vec(r)

        o_acc = [fx.make_rmem_tensor(4, fx.Float32) for _ in range_constexpr(D_TILES)]
        for dt in range_constexpr(D_TILES):
            o_acc[dt].fill(0.0)
        stats = fx.make_rmem_tensor(2, fx.Float32)   # running max (log2 units), running sum
        stats[0] = fx.Float32(float("-inf"))
        stats[1] = fx.Float32(0.0)
        scale_log2 = scale * LOG2E
        neg_inf = fx.Float32(float("-inf"))

        load_tile(t_begin)
        for t in range(t_begin, t_end, 1):
            gpu.barrier()                # every wave is done reading the previous tile
            store_tile()
            gpu.barrier()
            load_tile(t + 1)             # in flight during this tile's math (past Mk: zeros)
            kv0 = t * BN

            # S^T tiles: lane holds keys kv0 + 16 j + 4 quad + i (i < 4) of its row. A key is
            # visible when key - row_lo < row_span as unsigned: one compare per score (three
            # compares each kept 16 mask pairs live and spilled SGPRs)
            rel0 = kv0 + quad * 4 - row_lo
            s = []
            for j in range_constexpr(N_TILES):
                acc = fx.Vector.filled(4, 0.0, fx.Float32)
                for kk in range_constexpr(K_STEPS):
                    if const_expr(WIDE):
                        k_part = lds_frag8(k_lds8, (j * MMA + col) * (K_ROW // 8) + kk * 4 + quad)
                    else:
                        k_part = lds_frag(k_lds4, (j * MMA + col) * (K_ROW // 4) + kk * 4 + quad)
                    acc = mma(k_part, q_frag[kk], acc)
                for i in range_constexpr(4):
                    ok = fx.Uint32(rel0 + (j * MMA + i)) < row_span
                    s.append(ok.select(acc[i] * scale_log2, neg_inf))

            # online softmax: the row's max over this tile, across the 4 lanes of the row
            mx = s[0]
            for x in s[1:]:
                mx = fmax(mx, x)
            mx = fmax(mx, mx.shuffle_xor(16, WAVE))
            mx = fmax(mx, mx.shuffle_xor(32, WAVE))
            m_old = stats[0]
            m_new = fmax(m_old, mx)
            m_use = (m_new == neg_inf).select(fx.Float32(0.0), m_new)   # no key seen yet
            with fastmath(arith.FastMathFlags.afn):
                corr = fmath.exp2(m_old - m_use)
                p = [fmath.exp2(x - m_use) for x in s]
            total = p[0]
            for x in p[1:]:
                total = total + x
            stats[0] = m_new
            stats[1] = stats[1] * corr + total

            # O^T = O^T * corr + Vt P^T; P^T's B layout is the scores' accumulator layout
            # wide: the K index 8 quad + i of step jj is key 32 jj + 4 quad + i, and 8 quad + 4 + i
            # is key 32 jj + 16 + 4 quad + i: the lane's scores of tiles 2 jj and 2 jj + 1 in order
            p_frag = [fx.Vector.from_elements(p[LANE_K * j:LANE_K * j + LANE_K], fx.Float32).to(elem)
                      for j in range_constexpr(BN // MMA_K)]
            for dt in range_constexpr(D_TILES):
                acc = fx.memref_load_vec(o_acc[dt]) * corr
                for j in range_constexpr(BN // MMA_K):
                    v_at = (dt * MMA + col) * (V_ROW // 4) + quad
                    if const_expr(WIDE):
                        v_part = concat(lds_frag(vt_lds4, v_at + 8 * j), lds_frag(vt_lds4, v_at + 8 * j + 4))
                    else:
                        v_part = lds_frag(vt_lds4, v_at + 4 * j)
                    acc = mma(v_part, p_frag[j], acc)
                fx.memref_store_vec(acc, o_acc[dt])

        # -- epilogue: the row's sum across its 4 lanes, out = O / l, lse = ln(sum exp(s))
        total = stats[1]
        total = total + total.shuffle_xor(16, WAVE)
        total = total + total.shuffle_xor(32, WAVE)
        seen = total > fx.Float32(0.0)
        # v_rcp_f32 / v_log_f32 (log2) directly: total >= 1 where a key was seen
        inv = seen.select(fx.Float32(fx.rocdl.rcp(T.f32, total)), fx.Float32(0.0))
        for dt in range_constexpr(D_TILES):
            o = fx.memref_load_vec(o_acc[dt]) * inv
            o_idx = fx.Int32((m * som + h * soh + dt * MMA + quad * 4) // 4)
            g_store(o_view, row_ok.select(o_idx, fx.Int32(OOB_OUT)), o.to(out_elem), OUT_VEC, out_elem)
        lse_val = seen.select((stats[0] + fx.Float32(log2_hw(T.f32, total.ir_value()))) * LN2, neg_inf)
        l_idx = fx.Int32(h * slh + m * slm)
        g_store(l_view, (row_ok & (quad == 0)).select(l_idx, fx.Int32(OOB1)),
                fx.Vector.from_elements([lse_val], fx.Float32), 1, fx.Float32)

    return attention, BM, THREADS


def make_merge_kernel(*, dtype: str, out_dtype: str, waves: int):
    """The ``@flyc.kernel`` merge(parts, lses, out, lse) of merge_attentions_flydsl.py and its rows
    (waves) per block; launch on ceil(B * M * H / waves) blocks of 64 * waves threads.

    One wave merges one (b, m, h) row, in passes over D of 64 lanes x MERGE_VEC elements (rows
    are 16-byte aligned multiples of 16 bytes), folding the splits in order with a running max
    (each partial read once). Every (row, split) slice has its own buffer descriptor
    of exactly D elements, from a 64-bit address: lanes past D read zeros and store nothing, the
    tensors have no size limit, and an empty split (lse -inf) gets a descriptor of 0 bytes, so
    whatever its partial holds reads as zeros."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl.expr import T, arith
    from flydsl.expr import math as fmath
    from flydsl.expr.utils.arith import fastmath
    from flydsl._mlir.dialects.rocdl import log as log2_hw

    from mslk_dsl.templates import _flydsl_rowwise as rw

    WAVES = waves
    THREADS = WAVE * WAVES
    VEC = MERGE_VEC
    in_t, out_t = rw.elem_type(dtype), rw.elem_type(out_dtype)
    name = f"mslk_merge_attentions_{dtype}_{out_dtype}_w{WAVES}"

    def row_view(base, nbytes, dt):
        buf = fx.rocdl.make_buffer_ptr(base, num_records_bytes=nbytes)
        n = SLICE_BYTES // (dt.width // 8)
        return fx.logical_divide(fx.make_view(buf, fx.make_layout(n, 1)), fx.make_layout(VEC, 1))

    def scalar_view(base, nbytes, n=1):
        """``n`` scalars (index 0 .. n - 1) from ``base``, bounded by ``nbytes``."""
        buf = fx.rocdl.make_buffer_ptr(base, num_records_bytes=nbytes)
        return fx.logical_divide(fx.make_view(buf, fx.make_layout(n, 1)), fx.make_layout(1, 1))

    @flyc.kernel(name=name, known_block_size=[THREADS, 1, 1])
    def merge_kernel(parts: fx.Tensor, lses: fx.Tensor, out: fx.Tensor, lse: fx.Tensor):
        lane = fx.thread_idx.x % WAVE
        wave = fx.Int32(fx.rocdl.readfirstlane(T.i32, fx.thread_idx.x // WAVE))
        splits, batch, mq, heads, dim = parts.shape.unpack()
        row = fx.block_idx.x * WAVES + wave
        h = row % heads
        m = (row // heads) % mq
        b = row // (heads * mq)
        ok = row < batch * mq * heads
        ps, ls, os_, lo = parts.stride.unpack(), lses.stride.unpack(), out.stride.unpack(), lse.stride.unpack()
        part_row = fx.Int64(b) * fx.Int64(ps[1]) + fx.Int64(m) * fx.Int64(ps[2]) + fx.Int64(h) * fx.Int64(ps[3])
        lse_row = fx.Int64(b) * fx.Int64(ls[1]) + fx.Int64(h) * fx.Int64(ls[2]) + fx.Int64(m) * fx.Int64(ls[3])
        out_row = fx.Int64(b) * fx.Int64(os_[0]) + fx.Int64(m) * fx.Int64(os_[1]) + fx.Int64(h) * fx.Int64(os_[2])
        row_bytes = ok.select(fx.Int64(dim) * (in_t.width // 8), fx.Int64(0))
        lse_bytes = ok.select(fx.Int64(4), fx.Int64(0))
        ov = row_view(fx.get_iter(out) + out_row, ok.select(fx.Int64(dim) * (out_t.width // 8), fx.Int64(0)), out_t)
        neg_inf = fx.Float32(float("-inf"))

        acc = fx.make_rmem_tensor(VEC, fx.Float32)
        stats = fx.make_rmem_tensor(2, fx.Float32)   # running max (log2 units), running sum
        for chunk in range(0, (dim + (WAVE * VEC - 1)) // (WAVE * VEC), 1):
            acc.fill(0.0)
            stats[0] = neg_inf
            stats[1] = fx.Float32(0.0)
            for s in range(0, splits, 1):
                lv = scalar_view(fx.get_iter(lses) + fx.Int64(s) * fx.Int64(ls[0]) + lse_row, lse_bytes)
                l_s = rw.load(lv, fx.Int32(0), 1)[0] * LOG2E
                live = row_bytes * (l_s != neg_inf).select(fx.Int64(1), fx.Int64(0))
                pv = row_view(fx.get_iter(parts) + fx.Int64(s) * fx.Int64(ps[0]) + part_row, live, in_t)
                o_s = rw.load(pv, chunk * WAVE + lane, VEC).to(fx.Float32)
                m_old = stats[0]
                m_new = fx.max(m_old, l_s)
                m_use = (m_new == neg_inf).select(fx.Float32(0.0), m_new)
                with fastmath(arith.FastMathFlags.afn):
                    keep = fmath.exp2(m_old - m_use)
                    weight = fmath.exp2(l_s - m_use)
                fx.memref_store_vec(fx.memref_load_vec(acc) * keep + o_s * weight, acc)
                stats[0] = m_new
                stats[1] = stats[1] * keep + weight
            total = stats[1]
            inv = (total > fx.Float32(0.0)).select(fx.Float32(fx.rocdl.rcp(T.f32, total)), fx.Float32(0.0))
            rw.store(ov, chunk * WAVE + lane, (fx.memref_load_vec(acc) * inv).to(out_t), VEC)

        # the row's LSE, from the last pass's statistics (every pass sees the same splits)
        total = stats[1]
        lse_val = (total > fx.Float32(0.0)).select(
            (stats[0] + fx.Float32(log2_hw(T.f32, total.ir_value()))) * LN2, neg_inf)
        lse_out = fx.Int64(b) * fx.Int64(lo[0]) + fx.Int64(h) * fx.Int64(lo[1]) + fx.Int64(m) * fx.Int64(lo[2])
        # Lane 0 stores it: the other lanes aim one element past the descriptor's 4 bytes (the
        # store is dropped). The descriptor stays wave-uniform; a size chosen per lane would make
        # the compiler loop over the wave's distinct descriptors (readfirstlane).
        lv_out = scalar_view(fx.get_iter(lse) + lse_out, lse_bytes, n=2)
        rw.store(lv_out, (lane == 0).select(fx.Int32(0), fx.Int32(1)), fx.Vector.from_elements([lse_val], fx.Float32), 1)

    return merge_kernel, WAVES


def grid_for(q, k, seqstart_q, rows, varlen: bool):
    """Prefill: (row tiles of q's rows, KV heads, sequences), inside a @flyc.jit. Packed
    sequences size the row tiles by all of q's rows (the longest sequence is not known on the
    host): the blocks past a sequence's end skip its keys and store nothing."""
    if varlen:
        m, heads, _ = q.shape.unpack()
        _, kv_heads, _ = k.shape.unpack()
        seqs = seqstart_q.shape.unpack() - 1
    else:
        seqs, m, heads, _ = q.shape.unpack()
        _, _, kv_heads, _ = k.shape.unpack()
    return ((m * (heads // kv_heads) + (rows - 1)) // rows, kv_heads, seqs)
