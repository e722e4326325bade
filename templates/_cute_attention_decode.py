# Portions adapted from NVIDIA CUTLASS, examples/python/CuTeDSL/ampere/flash_attention_v2.py
# (the shared-memory layouts, the ldmatrix / mma.sync partitioning, the accumulator's row view and
# the quad reductions of the online softmax):
# Copyright (c) 2025 - 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
# SPDX-License-Identifier: BSD-3-Clause
# Redistribution and use in source and binary forms, with or without modification, are permitted
# provided that the following conditions are met: 1. Redistributions of source code must retain the
# above copyright notice, this list of conditions and the following disclaimer. 2. Redistributions in
# binary form must reproduce the above copyright notice, this list of conditions and the following
# disclaimer in the documentation and/or other materials provided with the distribution. 3. Neither
# the name of the copyright holder nor the names of its contributors may be used to endorse or promote
# products derived from this software without specific prior written permission.
# THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS" AND ANY EXPRESS OR
# IMPLIED WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE IMPLIED WARRANTIES OF MERCHANTABILITY AND
# FITNESS FOR A PARTICULAR PURPOSE ARE DISCLAIMED. IN NO EVENT SHALL THE COPYRIGHT HOLDER OR
# CONTRIBUTORS BE LIABLE FOR ANY DIRECT, INDIRECT, INCIDENTAL, SPECIAL, EXEMPLARY, OR CONSEQUENTIAL
# DAMAGES (INCLUDING, BUT NOT LIMITED TO, PROCUREMENT OF SUBSTITUTE GOODS OR SERVICES; LOSS OF USE,
# DATA, OR PROFITS; OR BUSINESS INTERRUPTION) HOWEVER CAUSED AND ON ANY THEORY OF LIABILITY, WHETHER
# IN CONTRACT, STRICT LIABILITY, OR TORT (INCLUDING NEGLIGENCE OR OTHERWISE) ARISING IN ANY WAY OUT OF
# THE USE OF THIS SOFTWARE, EVEN IF ADVISED OF THE POSSIBILITY OF SUCH DAMAGE.
"""Split-KV decode attention for NVIDIA Hopper, in CuTe DSL, as a kernel class (the contract and
the work split are in ``attention_decode_cute``'s docstring).

Each warp is a small flash-attention of its own: it streams its 16-key blocks of K and V into
its own ring of shared-memory stages with cp.async (``stages - 1`` blocks in flight per warp,
so 4 warps x 2-3 blocks of 4-8 KB per CTA), and runs S = Q K^T and O += P V on mma.sync
(m16n8k16, fp32 accumulators) with the CTA's 16 query rows (the GQA group) as M: K and V are read
once per KV head. Warps never wait for each other in the loop (a warp-level sync guards its own
stages); at the end the CTA merges its warps' (max, sum, O) through shared memory and writes one
fp32 partial and its LSE per split. With the fused merge the CTA then counts itself in its row's
counter, and the row's last CTA adds every split's partial in split order into out / lse
(``merge_splits``: ``merge_loads`` partial loads in flight per thread, spent on the tile's valid
rows only, a CTA barrier between a group's loads and their use so that the code scheduler keeps
them all in flight); otherwise ``MergeAttentions.merge_kernel`` combines them in a second kernel.
Each warp's first K/V blocks go out before Q is stored to shared memory (Q's loads are in flight
meanwhile): the K/V stream starts one round trip and a barrier earlier.
"""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from mslk_dsl.templates._attention_decode_plan import BLOCK_KEYS, ROWS, merge_share
from mslk_dsl.templates._cute_merge_attentions import DTYPES, MergeAttentions, row_major

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def smem_cols(head_dim: int) -> int:
    """Columns of the shared-memory swizzle atom: 128-byte rows (Swizzle<3,3,3>) where the head
    dim is a multiple of 64, else 64-byte rows (Swizzle<2,3,3>: head dim 96), as
    CUTLASS's flash_attention_v2 example picks them; both keep ldmatrix free of bank conflicts."""
    return 64 if head_dim % 64 == 0 else 32


# The fused merge: 16-byte partial loads each thread keeps in flight (its valid vectors x splits).
MERGE_LOADS = 32
MERGE_VEC = 4  # fp32 partial elements per 16-byte load
# Partials are read once, by the row's last CTA: kept out of L1.
STREAM = cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE


class AttentionDecode:
    def __init__(self, dtype: str, head_dim: int, warps: int, stages: int, fused_merge: bool = True,
                 merge_loads: int = MERGE_LOADS):
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self.D = head_dim
        self.warps = warps
        self.stages = stages
        self.threads = 32 * warps
        self.fused_merge = fused_merge
        self.merge_loads = merge_loads
        self.merge = MergeAttentions("float32", dtype, aligned=True)

    # -- host ---------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mLen: cute.Tensor, mTable: cute.Tensor,
                 mO: cute.Tensor, mLse: cute.Tensor, mOp: cute.Tensor, mLsep: cute.Tensor, mCount: cute.Tensor,
                 scale: Float32, causal: Int32, paged: Int32, stream):
        D, W, NS = self.D, self.warps, self.stages
        cols = smem_cols(D)
        atom = cute.make_composed_layout(cute.make_swizzle(3 if cols == 64 else 2, 3, 3), 0,
                                         cute.make_layout((8, cols), stride=(cols, 1)))
        sQ_layout = cute.tile_to_shape(atom, (ROWS, D), (0, 1))
        sKV_layout = cute.tile_to_shape(atom, (BLOCK_KEYS, D, W * NS), (0, 1, 2))

        @cute.struct
        class SharedStorage:
            sLse: cute.struct.MemRange[Float32, W * ROWS]
            sFlag: cute.struct.MemRange[Int32, 4]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]

        # One warp's cp.async of a 16 x D block: a lane per 16 bytes of an atom's row.
        copy_elems = 128 // self.dtype.width
        async_atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                         self.dtype, num_bits_per_copy=128)
        lanes_per_row = cols // copy_elems
        gmem_copy = cute.make_tiled_copy_tv(async_atom,
                                            cute.make_layout((32 // lanes_per_row, lanes_per_row),
                                                             stride=(lanes_per_row, 1)),
                                            cute.make_layout((1, copy_elems)))
        tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)), (1, 1, 1),
                                        permutation_mnk=(16, 16, 16))
        B, Mq, Hq, _ = mQ.shape
        Hkv = mK.shape[2]
        tiles = cute.ceil_div(Mq * (Hq // Hkv), ROWS)
        self.decode_kernel(mQ, mK, mV, mLen, mTable, mO, mLse, mOp, mLsep, mCount, scale * Float32(LOG2E), causal,
                           paged, sQ_layout, sKV_layout, gmem_copy, tiled_mma, SharedStorage).launch(
            grid=(mOp.shape[0], Hkv * tiles, B), block=(self.threads, 1, 1), stream=stream)
        if cutlass.const_expr(not self.fused_merge):
            self.merge.launch(mOp, mLsep, mO, mLse, stream)

    # -- device -------------------------------------------------------------------------------------
    @cute.kernel
    def decode_kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mLen: cute.Tensor,
                      mTable: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, mOp: cute.Tensor,
                      mLsep: cute.Tensor, mCount: cute.Tensor, scale_log2: Float32,
                      causal: Int32, paged: Int32, sQ_layout: cute.ComposedLayout,
                      sKV_layout: cute.ComposedLayout, gmem_copy: cute.TiledCopy, tiled_mma: cute.TiledMma,
                      SharedStorage: cutlass.Constexpr):
        D, W, NS, BK = self.D, self.warps, self.stages, BLOCK_KEYS
        tidx, _, _ = cute.arch.thread_idx()
        split, head_tile, b = cute.arch.block_idx()
        wid = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        S = mOp.shape[0]
        _, Mq, Hq, _ = mQ.shape
        Hkv = mK.shape[2]
        G = Hq // Hkv
        rows_total = Mq * G
        tiles = (rows_total + ROWS - 1) // ROWS
        hkv = head_tile // tiles
        row0 = (head_tile % tiles) * ROWS

        # This CTA's blocks of 16 keys: split `split` of the sequence's; warp w takes every W-th.
        L = mLen[b]
        nblk = (L + BK - 1) // BK
        per_split = (nblk + S - 1) // S
        blk_lo = split * per_split
        blk_hi = cutlass.min(blk_lo + per_split, nblk)
        n_mine = Int32(0)
        if blk_lo + wid < blk_hi:
            n_mine = (blk_hi - blk_lo - wid + W - 1) // W

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sVt = cute.composition(sV, cute.make_layout((D, BK, W * NS), stride=(BK, 1, BK * D)))
        sLse = storage.sLse.get_tensor(cute.make_layout((W, ROWS), stride=(ROWS, 1)))

        # Q rows of this tile: row r is query r // G of q head hkv * G + r % G; zeros past the group.
        # Loaded into registers first and stored after the K/V prologue below: the CTA's first
        # K/V blocks go out as soon as the length is in, not after Q's round trip and a barrier.
        q_vals = []
        for i in cutlass.range_constexpr(ROWS * D // self.threads):
            idx = tidx + i * self.threads
            row, col = idx // D, idx % D
            r = row0 + row
            val = self.dtype(0.0)
            if r < rows_total:
                val = mQ[b, r // G, hkv * G + r % G, col]
            q_vals.append(val)

        gthr = gmem_copy.get_slice(lane)
        tKVc = gthr.partition_S(cute.make_identity_tensor((BK, D)))
        tKs, tVs = gthr.partition_D(sK), gthr.partition_D(sV)
        seq = (b, hkv, L, causal, paged, Mq, G, row0)
        for i in cutlass.range_constexpr(NS - 1):  # prologue: the first NS - 1 blocks in flight
            if i < n_mine:
                self.load_block(mK, mV, mTable, seq, blk_lo + wid + i * W, wid * NS + i, gmem_copy, gthr, tKVc,
                                tKs, tVs)
            cute.arch.cp_async_commit_group()

        for i in cutlass.range_constexpr(ROWS * D // self.threads):
            idx = tidx + i * self.threads
            sQ[idx // D, idx % D] = q_vals[i]

        thr_mma = tiled_mma.get_slice(lane)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, D)), Float32)
        acc_O.fill(0.0)
        ldm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        tc_Q = cute.make_tiled_copy_A(ldm, tiled_mma)
        tc_K = cute.make_tiled_copy_B(ldm, tiled_mma)
        tc_V = cute.make_tiled_copy_B(ldm_t, tiled_mma)
        copy_Q, copy_K, copy_V = tc_Q.get_slice(lane), tc_K.get_slice(lane), tc_V.get_slice(lane)
        smem = (tc_Q, copy_Q.partition_S(sQ), copy_Q.retile(tSrQ), tc_K, copy_K.partition_S(sK),
                copy_K.retile(tSrK), tc_V, copy_V.partition_S(sVt), copy_V.retile(tOrVt))

        row_max = cute.make_rmem_tensor(acc_O.shape[0][0] * acc_O.shape[1], Float32)
        row_sum = cute.make_rmem_tensor(acc_O.shape[0][0] * acc_O.shape[1], Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        cute.arch.barrier()  # sQ written

        for i in cutlass.range(n_mine):
            ahead = i + NS - 1
            if ahead < n_mine:
                self.load_block(mK, mV, mTable, seq, blk_lo + wid + ahead * W, wid * NS + ahead % NS, gmem_copy,
                                gthr, tKVc, tKs, tVs)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(NS - 1)
            cute.arch.sync_warp()  # the other lanes' pieces of this block have landed
            self.attend_block(seq, blk_lo + wid + i * W, wid * NS + i % NS, thr_mma, tiled_mma, smem, tSrQ, tSrK,
                              tOrVt, acc_O, row_max, row_sum, scale_log2)
            cute.arch.sync_warp()  # every lane is done with the stage before it is refilled
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()  # every warp is done with its stages: sK becomes the merge buffer

        self.merge_warps(storage, sLse, thr_mma, acc_O, row_max, row_sum, scale_log2, wid, lane)
        cute.arch.barrier()
        self.store_partial(storage, sLse, mOp, mLsep, split, b, hkv, G, rows_total, row0, tidx)
        if cutlass.const_expr(self.fused_merge):
            # Release: this CTA's partial is visible GPU-wide before the count that announces it;
            # the acq_rel add orders the last CTA's reads after every other split's stores.
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier()
            sFlag = storage.sFlag.get_tensor(cute.make_layout((4,)))
            if tidx == 0:
                counter = (mCount.iterator + (b * Hkv * tiles + head_tile)).llvm_ptr
                arrived = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
                if arrived == S - 1:  # the row's last split: reset the counter for the next call
                    cute.arch.store(counter, Int32(0), sem="relaxed", scope="gpu")
                sFlag[0] = arrived
            cute.arch.barrier()
            if sFlag[0] == S - 1:
                cute.arch.fence_acq_rel_gpu()
                self.merge_splits(mOp, mLsep, mO, mLse, b, hkv, G, rows_total, row0, tidx)

    @cute.jit
    def load_block(self, mK: cute.Tensor, mV: cute.Tensor, mTable: cute.Tensor, seq, blk: Int32, stage: Int32,
                   gmem_copy: cute.TiledCopy, gthr, tKVc: cute.Tensor, tKs: cute.Tensor, tVs: cute.Tensor):
        """cp.async of block ``blk``'s K and V rows below the sequence's length into ``stage``; rows
        past it are zeroed (the stage may hold anything there, NaN bit patterns included)."""
        b, hkv, L, causal, paged, Mq, G, row0 = seq
        key0 = blk * BLOCK_KEYS
        page = b
        first = key0
        if paged != 0:  # a block never straddles a page (page sizes are multiples of 16 keys)
            page_size = mK.shape[1]
            page = mTable[b, key0 // page_size]
            first = key0 % page_size
        gK = cute.local_tile(mK[page, None, hkv, None], (BLOCK_KEYS, self.D), (first // BLOCK_KEYS, 0))
        gV = cute.local_tile(mV[page, None, hkv, None], (BLOCK_KEYS, self.D), (first // BLOCK_KEYS, 0))
        tKg, tVg = gthr.partition_S(gK), gthr.partition_S(gV)
        for n in cutlass.range_constexpr(cute.size(tKs.shape[1])):
            if key0 + tKVc[0, n, 0][0] < L:
                cute.copy(gmem_copy, tKg[None, n, None], tKs[None, n, None, stage])
                cute.copy(gmem_copy, tVg[None, n, None], tVs[None, n, None, stage])
            else:
                # Zeros past the end: a masked key's P is 0, and 0 * V must not meet a NaN there.
                tKs[None, n, None, stage].fill(0)
                tVs[None, n, None, stage].fill(0)

    @cute.jit
    def attend_block(self, seq, blk: Int32, stage: Int32, thr_mma, tiled_mma: cute.TiledMma, smem,
                     tSrQ: cute.Tensor, tSrK: cute.Tensor, tOrVt: cute.Tensor, acc_O: cute.Tensor,
                     row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: Float32):
        """S = Q K^T over the block, masked; the online softmax; O += P V."""
        b, hkv, L, causal, paged, Mq, G, row0 = seq
        tc_Q, tSsQ, tSrQ_v, tc_K, tSsK, tSrK_v, tc_V, tOsVt, tOrVt_v = smem
        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, BLOCK_KEYS)), Float32)
        acc_S.fill(0.0)
        for k in cutlass.range_constexpr(cute.size(tSsQ.shape[2])):
            cute.copy(tc_Q, tSsQ[None, None, k], tSrQ_v[None, None, k])
            cute.copy(tc_K, tSsK[None, None, k, stage], tSrK_v[None, None, k])
            cute.gemm(tiled_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)

        # Keys at or past the sequence's end, and (causal) past the query's own position, are -inf.
        key0 = blk * BLOCK_KEYS
        tScS = mn_view(thr_mma.partition_C(cute.make_identity_tensor((ROWS, BLOCK_KEYS))))
        s_mn = mn_view(acc_S)
        o_mn = mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_max)):
            limit = L
            if causal != 0:
                limit = cutlass.min(L, L - Mq + (row0 + tScS[r, 0][0]) // G + 1)
            for c in cutlass.range_constexpr(cute.size(tScS.shape[1])):
                if key0 + tScS[0, c][1] >= limit:
                    s_mn[r, c] = -Float32.inf
            row = s_mn[r, None].load()
            top = quad_reduce(row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0), cute.arch.fmax)
            top = cute.arch.fmax(top, row_max[r])
            # A row with no key yet keeps max -inf; exponents then use 0 (every term is 0 anyway).
            safe = top
            if top == -Float32.inf:
                safe = Float32(0.0)
            p = cute.math.exp2(row * scale_log2 - safe * scale_log2, fastmath=True)
            keep = cute.math.exp2(row_max[r] * scale_log2 - safe * scale_log2, fastmath=True)
            row_sum[r] = row_sum[r] * keep + p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
            o_mn[r, None] = o_mn[r, None].load() * keep
            row_max[r] = top
            s_mn[r, None] = p

        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        # The m16n8k16 accumulator (4, M, N) read as the A operand ((4, 2), M, N / 2).
        div = cute.logical_divide(rP.layout, (None, None, 2))
        tOrS = cute.make_tensor(rP.iterator, cute.make_layout(
            ((div.shape[0], div.shape[2][0]), div.shape[1], div.shape[2][1]),
            stride=((div.stride[0], div.stride[2][0]), div.stride[1], div.stride[2][1])))
        for k in cutlass.range_constexpr(cute.size(tOrS.shape[2])):
            cute.copy(tc_V, tOsVt[None, None, k, stage], tOrVt_v[None, None, k])
            cute.gemm(tiled_mma, acc_O, tOrS[None, None, k], tOrVt[None, None, k], acc_O)

    @cute.jit
    def merge_warps(self, storage, sLse: cute.Tensor, thr_mma, acc_O: cute.Tensor, row_max: cute.Tensor,
                    row_sum: cute.Tensor, scale_log2: Float32, wid: Int32, lane: Int32):
        """Each warp's O, scaled to the CTA's common LSE, into the fp32 buffer (over the K stages)."""
        W = self.warps
        tOcO = mn_view(thr_mma.partition_C(cute.make_identity_tensor((ROWS, self.D))))
        o_mn = mn_view(acc_O)
        # log2-domain LSE of this warp's rows: max * scale + log2(sum), -inf for no key.
        for r in cutlass.range_constexpr(cute.size(row_max)):
            total = quad_reduce(row_sum[r], lambda x, y: x + y)
            lse = -Float32.inf
            if total > Float32(0.0):
                lse = row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)
            if lane % 4 == 0:
                sLse[wid, tOcO[r, 0][0]] = lse
        cute.arch.barrier()
        sO = cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr(), dtype=Float32),
                              cute.make_layout((W, ROWS, self.D), stride=(ROWS * self.D, self.D, 1)))
        for r in cutlass.range_constexpr(cute.size(row_max)):
            row = tOcO[r, 0][0]
            everything = cta_lse(sLse, row, W)
            # exp2(lse_w - lse) / sum_w = exp2(max_w * scale - lse): 0 for a warp without keys.
            factor = Float32(0.0)
            if everything != -Float32.inf:
                factor = cute.math.exp2(row_max[r] * scale_log2 - everything, fastmath=True)
            for c in cutlass.range_constexpr(cute.size(tOcO.shape[1])):
                sO[wid, row, tOcO[0, c][1]] = o_mn[r, c] * factor

    @cute.jit
    def store_partial(self, storage, sLse: cute.Tensor, mOp: cute.Tensor, mLsep: cute.Tensor, split: Int32,
                      b: Int32, hkv: Int32, G: Int32, rows_total: Int32, row0: Int32, tidx: Int32):
        """Sum the warps' scaled O into this split's partial; the CTA's LSE (natural log) beside it."""
        W, D = self.warps, self.D
        sO = cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr(), dtype=Float32),
                              cute.make_layout((W, ROWS, D), stride=(ROWS * D, D, 1)))
        for i in cutlass.range_constexpr(ROWS * D // self.threads):
            idx = tidx + i * self.threads
            row, col = idx // D, idx % D
            r = row0 + row
            if r < rows_total:
                acc = Float32(0.0)
                for w in cutlass.range_constexpr(W):
                    acc = acc + sO[w, row, col]
                mOp[split, b, r // G, hkv * G + r % G, col] = acc
        if tidx < ROWS:
            r = row0 + tidx
            if r < rows_total:
                everything = cta_lse(sLse, tidx, W)
                mLsep[split, b, hkv * G + r % G, r // G] = everything * Float32(LN2)

    @cute.jit
    def merge_splits(self, mOp: cute.Tensor, mLsep: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, b: Int32,
                     hkv: Int32, G: Int32, rows_total: Int32, row0: Int32, tidx: Int32):
        """The row's last CTA: out and lse of this CTA's query rows from every split's partial
        (``merge_group``), with as many vectors per thread as the tile's valid rows need: a tile
        of 8 rows (GQA 8, one query) spends its ``merge_loads`` loads in flight on twice the
        splits of a full tile, instead of on repeats of its last vector."""
        per_row = self.D // MERGE_VEC
        vectors = cutlass.min(rows_total - row0, ROWS) * per_row
        self.merge_tiers(mOp, mLsep, mO, mLse, b, hkv, G, row0, tidx, vectors, 1)

    @cute.jit
    def merge_tiers(self, mOp: cute.Tensor, mLsep: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, b: Int32,
                    hkv: Int32, G: Int32, row0: Int32, tidx: Int32, vectors: Int32, slots: cutlass.Constexpr):
        """``merge_group`` with the fewest vectors per thread (1, 2, 4, ...) that cover ``vectors``."""
        most = merge_share(self.D, self.threads)
        if cutlass.const_expr(slots >= most):
            self.merge_group(mOp, mLsep, mO, mLse, b, hkv, G, row0, tidx, vectors, most)
        else:
            if vectors <= self.threads * slots:
                self.merge_group(mOp, mLsep, mO, mLse, b, hkv, G, row0, tidx, vectors, slots)
            else:
                self.merge_tiers(mOp, mLsep, mO, mLse, b, hkv, G, row0, tidx, vectors, slots * 2)

    @cute.jit
    def merge_group(self, mOp: cute.Tensor, mLsep: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, b: Int32,
                    hkv: Int32, G: Int32, row0: Int32, tidx: Int32, vectors: Int32, slots: cutlass.Constexpr):
        """Thread t takes the 16-byte vectors t, t + threads, ... (``slots`` of them) of the
        tile's valid rows (D / 4 vectors per row); a vector past them loads the last one (in
        bounds, so each group of loads goes out unpredicated, back to back; a warp's such loads
        are of one address) and stores nothing. The splits come in groups of ``merge_loads //
        slots``, every load of a group issued before the first is used; a group is added in split
        order after one rescale to the group's max LSE (the exponentials of a group are
        independent: no chain of exp2 from split to split), so the arithmetic is the same
        whichever split's CTA comes last: deterministic. Partials are read once: kept out of L1."""
        VEC = MERGE_VEC
        per_row = self.D // VEC
        unroll = max(1, self.merge_loads // slots)
        S = mOp.shape[0]
        tops = cute.make_rmem_tensor((slots,), Float32)
        totals = cute.make_rmem_tensor((slots,), Float32)
        accs = []
        coords = []
        for i in cutlass.range_constexpr(slots):
            idx = tidx + i * self.threads
            at = cutlass.min(idx, vectors - 1)
            r = row0 + at // per_row
            coords.append((r // G, hkv * G + r % G, at % per_row, idx < vectors))
            tops[i] = -Float32.inf
            totals[i] = Float32(0.0)
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            accs.append(acc)
        for s0 in cutlass.range(0, S, unroll):
            parts = []
            lses = []
            for u in cutlass.range_constexpr(unroll):
                s = cutlass.min(s0 + u, S - 1)
                for i in cutlass.range_constexpr(slots):
                    m, hq, j, _ = coords[i]
                    part = cute.make_rmem_tensor((VEC,), Float32)
                    cute.autovec_copy(cute.zipped_divide(mOp[s, b, m, hq, None], (VEC,))[None, j], part,
                                      l1c_evict_priority=STREAM)
                    parts.append(part)
                    lses.append(mLsep[s, b, hq, m])
            # Every load of the group (partials and LSEs) is out before the first is used: the code
            # scheduler would otherwise interleave them with their uses, a few loads in flight at
            # a time. (A CTA barrier, which it does not move loads across; every thread of the CTA
            # is here.)
            cute.arch.barrier()
            for i in cutlass.range_constexpr(slots):
                # The group's max (a clamped repeat of the last split is one of the splits: it
                # leaves the max as it is), then every weight at once against it.
                candidates = [tops[i]]
                for u in cutlass.range_constexpr(unroll):
                    candidates.append(lses[u * slots + i])
                top = tree_reduce(candidates, cute.arch.fmax)
                safe = top
                if top == -Float32.inf:
                    safe = Float32(0.0)
                keep = cute.math.exp2((tops[i] - safe) * Float32(LOG2E), fastmath=True)
                totals[i] = totals[i] * keep
                accs[i].store(accs[i].load() * keep)
                for u in cutlass.range_constexpr(unroll):
                    lse = lses[u * slots + i]
                    # The clamped repeat of the last split weighs 0, and so does an empty split
                    # (LSE -inf; its partial is 0, as every partial is finite). The weight is
                    # chosen, not the add: a load used under a branch is sunk into it by the
                    # compiler, one load in flight at a time.
                    w = Float32(0.0)
                    if s0 + u < S:
                        if lse != -Float32.inf:
                            w = cute.math.exp2((lse - safe) * Float32(LOG2E), fastmath=True)
                    totals[i] = totals[i] + w
                    accs[i].store(accs[i].load() + parts[u * slots + i].load() * w)
                tops[i] = top
        for i in cutlass.range_constexpr(slots):
            m, hq, j, valid = coords[i]
            if valid:
                total = totals[i]
                inv = Float32(0.0)
                if total > Float32(0.0):
                    inv = cute.arch.rcp_approx(total)
                res = cute.make_rmem_tensor((VEC,), self.dtype)
                res.store((accs[i].load() * inv).to(self.dtype))
                cute.autovec_copy(res, cute.zipped_divide(mO[b, m, hq, None], (VEC,))[None, j])
                if j == 0:
                    lse = -Float32.inf
                    if total > Float32(0.0):
                        lse = tops[i] + cute.math.log2(total, fastmath=True) * Float32(LN2)
                    mLse[b, hq, m] = lse

    def fake_args(self):
        """Compile-time stand-ins for ``__call__``'s arguments: every size but D dynamic; q, k, v with
        any strides (K/V strides multiples of 8 elements, 16-byte aligned: cp.async pieces)."""
        D, dt = self.D, self.dtype
        b, mq, hq, hkv, n, p, s = (cute.sym_int() for _ in range(7))

        def strided(shape, div, align, wide=False):
            # wide: a 64-bit leading stride, so a sequence's or page's offset in a cache of more
            # than 2^31 elements (e.g. 128 sequences x 128k keys x 4 heads x 128) does not wrap
            lead = cute.sym_int64(divisibility=div) if wide else cute.sym_int(divisibility=div)
            return make_fake_tensor(dt, shape, stride=(lead, *(cute.sym_int(divisibility=div) for _ in shape[1:-1]), 1),
                                    assumed_align=align)

        return [strided((b, mq, hq, D), 1, dt.width // 8), strided((cute.sym_int(), n, hkv, D), 8, 16, wide=True),
                strided((cute.sym_int(), n, hkv, D), 8, 16, wide=True), row_major(Int32, (b,)),
                make_fake_tensor(Int32, (cute.sym_int(), p), stride=(cute.sym_int(), cute.sym_int())),
                row_major(dt, (b, mq, hq, D), 16), row_major(Float32, (b, hq, mq)),
                row_major(Float32, (s, b, mq, hq, D), 16), row_major(Float32, (s, b, hq, mq)),
                row_major(Int32, (cute.sym_int(),)), Float32(1.0), Int32(1), Int32(0), make_fake_stream(use_tvm_ffi_env_stream=True)]


@cute.jit
def cta_lse(sLse: cute.Tensor, row, warps: cutlass.Constexpr):
    """log2 of the sum over the warps of 2^lse_w for one row: -inf when no warp saw a key."""
    top = -Float32.inf
    for w in cutlass.range_constexpr(warps):
        top = cute.arch.fmax(top, sLse[w, row])
    result = -Float32.inf
    if top != -Float32.inf:
        total = Float32(0.0)
        for w in cutlass.range_constexpr(warps):
            total = total + cute.math.exp2(sLse[w, row] - top, fastmath=True)
        result = top + cute.math.log2(total, fastmath=True)
    return result


def tree_reduce(vals: list, op):
    """``op`` over ``vals`` as a balanced tree (depth log2 of the count, not a chain)."""
    while len(vals) > 1:
        vals = [op(vals[k], vals[k + 1]) if k + 1 < len(vals) else vals[k] for k in range(0, len(vals), 2)]
    return vals[0]


def quad_reduce(val, op):
    """``op`` over the 4 lanes that hold one row of an mma.sync accumulator."""
    val = op(val, cute.arch.shuffle_sync_bfly(val, offset=2, mask=-1, mask_and_clamp=31))
    return op(val, cute.arch.shuffle_sync_bfly(val, offset=1, mask=-1, mask_and_clamp=31))


def mn_view(acc: cute.Tensor) -> cute.Tensor:
    """An m16n8 accumulator partition ((2, 2), M, N) viewed as (rows, columns) of this thread."""
    col_major = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((col_major.shape[0][1], col_major.shape[1]), (col_major.shape[0][0], col_major.shape[2])),
        stride=((col_major.stride[0][1], col_major.stride[1]), (col_major.stride[0][0], col_major.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))

