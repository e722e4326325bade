"""Hopper (sm_90a) grouped GEMM over stacked rows, shared by the CuTe grouped GEMM templates.

    out[rows of group g] = epilogue(x[rows of group g] @ w[g]^T)
    x [total_M, K] (groups' rows stacked in order, M_sizes[g] rows each), w [G, N, K], out [total_M, N]

The kernel is ``_cute_gemm_sm90.HopperGemm`` (persistent, warp-specialized: a TMA producer warp,
tile_m // 64 wgmma consumer warpgroups, the same main loop, FP8 promotion and epilogue hook) with
a different unit of work. The output tiles of all groups form one list, group by group (inside a
group the M tiles move fastest, so the CTAs running together share the group's weight panel);
CTA c takes tiles c, c + grid, c + 2 * grid, ... A group of m rows has ceil(m / tile_m) * N-tiles
tiles, an empty group none. Nothing about the sizes is known on the host: every warp that walks
the list (the producer warp and each consumer warp) reads M_sizes on the device, 32 groups at a
time (one per lane, a warp prefix sum of their tiles and rows), and finds a tile's group with a
ballot, moving forward only since a CTA's tiles only grow. So the call never synchronizes with
the host and captures in a CUDA graph.

Rows of a group start anywhere in x and out, so tiles are addressed from the group's first row:
  * x: a 2D TMA over the stacked rows, offset to the group's first row; a tile's rows past the
    group end load the next group's rows (or TMA's zeros past total_M), whose products only reach
    output rows that are never stored;
  * w: [G, N, K] viewed as [G * N, K], offset to the group's first weight row; the last N tile's
    rows past N belong to the next group and reach only columns past N, never stored;
  * out: the TMA store clips at the group's end with quack's ragged-tensor descriptor
    (Dao-AILab/quack copy_utils.create_ragged_tensor_for_tma / offset_ragged_tensor, Apache-2.0;
    after Triton's ragged_tma): out gets a third mode and the pointer is shifted back so that,
    for a group of ``length`` rows, the coordinates (BIG - length + r, n, start + length) address
    row start + r and every r >= length is out of bounds. A tile never writes another group's
    rows, and no store path needs a predicate.
Rows past sum(M_sizes) are neither read into any stored result nor written. If sum(M_sizes)
exceeds total_M (a caller error that cannot be checked without a host sync), groups are cut at
total_M: nothing outside x and out is touched.

The grid: min(NUM_SMS, an upper bound of the tiles known on the host), the bound being
(total_M // tile_m + min(G, total_M)) N-tiles (each non-empty group adds at most one partial M
tile); a CTA whose first index is past the real tile count does nothing.
"""
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from mslk_dsl.templates import _cute_gemm_sm90 as sm90
from mslk_dsl.templates._cute_gemm_sm90 import HopperGemm

NUM_SMS = sm90.NUM_SMS
_BIG = 2**30  # rows of the ragged output mode (see the module docstring)
_MAX_INT = 2**31 - 1
_LANES = 32


def ragged_rows(t: cute.Tensor) -> cute.Tensor:
    """[rows, N] -> the TMA-store view [BIG, N, MAX_INT] (after quack's ptr_shift variant)."""
    shifted = cute.domain_offset((-_BIG, None), t).iterator
    return cute.make_tensor(shifted, cute.make_layout((_BIG, t.shape[1], _MAX_INT),
                                                      stride=(t.stride[0], t.stride[1], t.stride[0])))


def ragged_group(t: cute.Tensor, start: Int32, length: Int32) -> cute.Tensor:
    """The [length, N] rows from ``start`` of a ragged_rows view (coordinates of a TMA tensor):
    rows >= length are out of bounds."""
    return cute.domain_offset((_BIG - length, None), t[None, None, start + length])


class GroupedHopperGemm(HopperGemm):
    """One grouped GEMM configuration: HopperGemm's tile, FP8 promotion and epilogue hook; no
    cluster, split-K, stream-K or x_rows (each tile's unit of work is one whole group tile).
    The epilogue hook's prefetch sees m0 = the tile's first row of x / out and n0 = its first
    row of w viewed as [G * N, K] (so per-group column data, e.g. scales [G, N], flattens)."""

    def __init__(self, tile_mn, raster_m=True, promote_every=0, epilogue=None, template="GroupedHopperGemm"):
        super().__init__(tile_mn, cluster_m=1, raster_m=raster_m, group=0, promote_every=promote_every,
                         epilogue=epilogue, template=template)

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, d: cute.Tensor, m_sizes: cute.Tensor, epi_args, stream):
        """a [total_M, K], b [G * N, K], d [total_M, N], m_sizes [G] (int32 or int64)."""
        self._setup(a.element_type, b.element_type, d.element_type)
        tma_a, gA = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), a,
            cute.slice_(self.a_smem, (None, None, 0)), (self.tile_m, self.tile_k))
        tma_b, gB = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), b,
            cute.slice_(self.b_smem, (None, None, 0)), (self.tile_n, self.tile_k))
        tma_d, gD = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), ragged_rows(d),
            cute.slice_(self.d_smem, (None, None, 0)), self.epi_tile)

        groups = m_sizes.shape[0]
        total_m = d.shape[0]
        n_tiles = cute.ceil_div(d.shape[1], self.tile_n)
        tiles_bound = (total_m // self.tile_m + cutlass.min(groups, total_m)) * n_tiles
        num_ctas = cutlass.max(cutlass.min(tiles_bound, NUM_SMS), 1)

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sEpi: cute.struct.MemRange[Float32, self.epi_words]
            sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(self.d_smem)], 1024]

        self._check_shared_memory(SharedStorage.size_in_bytes())
        self.shared_storage = SharedStorage
        self.grouped_kernel(tma_a, gA, tma_b, gB, tma_d, gD, self.tiled_mma, self.tiled_mma_zero,
                            self.a_smem, self.b_smem, self.d_smem, m_sizes, total_m, d.shape[1],
                            epi_args).launch(
            grid=(1, 1, num_ctas), block=(self.threads, 1, 1), min_blocks_per_mp=1, stream=stream)

    # -------------------------------------------------------------- device side
    @cute.jit
    def _load_chunk(self, m_sizes: cute.Tensor, chunk: Int32, n_tiles: Int32):
        """Groups [chunk, chunk + 32), one per lane: (the lane's rows, tiles, and inclusive prefix
        sums of both over the chunk, the chunk's total rows and tiles). Past the last group the
        chunk's tile total is BIG, which stops every search there."""
        lane = cute.arch.lane_idx()
        g = chunk + lane
        rows = Int32(0)
        if g < m_sizes.shape[0]:
            rows = Int32(m_sizes[g])
        rows = cutlass.max(rows, Int32(0))
        tiles = (rows + self.tile_m - 1) // self.tile_m * n_tiles
        incl_rows, incl_tiles = rows, tiles
        for d in cutlass.range_constexpr(5):
            up_rows = cute.arch.shuffle_sync_up(incl_rows, 1 << d)
            up_tiles = cute.arch.shuffle_sync_up(incl_tiles, 1 << d)
            if lane >= (1 << d):
                incl_rows = incl_rows + up_rows
                incl_tiles = incl_tiles + up_tiles
        chunk_rows = cute.arch.shuffle_sync(incl_rows, _LANES - 1)
        chunk_tiles = cute.arch.shuffle_sync(incl_tiles, _LANES - 1)
        if chunk >= m_sizes.shape[0]:
            chunk_tiles = Int32(_BIG)
        return rows, tiles, incl_rows, incl_tiles, chunk_rows, chunk_tiles

    @cute.jit
    def _find_tile(self, work: Int32, tiles_base: Int32, rows_base: Int32, chunk: Int32, rows: Int32,
                   tiles: Int32, incl_rows: Int32, incl_tiles: Int32, n_tiles: Int32):
        """Work index (inside the current chunk) -> (group, its first row, its rows, M tile, N tile).
        The group is the lane whose inclusive tile sum first exceeds the index: the count of
        lanes at or below it (prefix sums only grow), by ballot."""
        local = work - tiles_base
        lane = cute.arch.popc(cute.arch.vote_ballot_sync(incl_tiles <= local))
        first_tile = cute.arch.shuffle_sync(incl_tiles - tiles, lane)
        first_row = rows_base + cute.arch.shuffle_sync(incl_rows - rows, lane)
        group_rows = cute.arch.shuffle_sync(rows, lane)
        t = local - first_tile
        m_tiles = (group_rows + self.tile_m - 1) // self.tile_m
        tile_n = t // m_tiles
        return chunk + lane, first_row, group_rows, t - tile_n * m_tiles, tile_n

    @cute.kernel
    def grouped_kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                       tma_d: cute.CopyAtom, mD: cute.Tensor, tiled_mma: cute.TiledMma,
                       tiled_mma_zero: cute.TiledMma, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
                       d_smem: cute.ComposedLayout, m_sizes: cute.Tensor, total_m: Int32, n_size: Int32,
                       epi_args):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_d)

        storage = SmemAllocator().allocate(self.shared_storage)
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_mbar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_wg * 4),
            tx_count=(self.tile_m * self.a_dtype.width + self.tile_n * self.b_dtype.width) * self.tile_k // 8,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sD = storage.sD.get_tensor(d_smem.outer, swizzle=d_smem.inner)
        sEpi = storage.sEpi.get_tensor(cute.make_layout(self.epi_words))
        k_tiles = cute.ceil_div(mA.shape[1], self.tile_k)
        n_tiles = (n_size + self.tile_n - 1) // self.tile_n
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if cute.arch.make_warp_uniform(tidx // 128) == 0:
            cute.arch.setmaxregister_decrease(sm90._PRODUCER_REGS)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                work = cute.arch.block_idx()[2]
                chunk, tiles_base, rows_base = Int32(0), Int32(0), Int32(0)
                rows, tiles, incl_rows, incl_tiles, chunk_rows, chunk_tiles = self._load_chunk(
                    m_sizes, chunk, n_tiles)
                while work >= tiles_base + chunk_tiles:
                    tiles_base, rows_base, chunk = tiles_base + chunk_tiles, rows_base + chunk_rows, chunk + _LANES
                    rows, tiles, incl_rows, incl_tiles, chunk_rows, chunk_tiles = self._load_chunk(
                        m_sizes, chunk, n_tiles)
                while chunk < m_sizes.shape[0]:
                    group, first_row, _, tile_m, tile_n = self._find_tile(
                        work, tiles_base, rows_base, chunk, rows, tiles, incl_rows, incl_tiles, n_tiles)
                    gA = cute.local_tile(cute.domain_offset((first_row, None), mA),
                                         (self.tile_m, self.tile_k), (tile_m, None))
                    gB = cute.local_tile(cute.domain_offset((group * n_size, None), mB),
                                         (self.tile_n, self.tile_k), (tile_n, None))
                    tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                                       cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
                    tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                                       cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
                    state = self._load(ab_pipeline, state, tma_a, tma_b, tAgA, tAsA, tBgB, tBsB, 0,
                                       Int32(0), k_tiles)
                    work += cute.arch.grid_dim()[2]
                    while work >= tiles_base + chunk_tiles:
                        tiles_base, rows_base, chunk = (tiles_base + chunk_tiles, rows_base + chunk_rows,
                                                        chunk + _LANES)
                        rows, tiles, incl_rows, incl_tiles, chunk_rows, chunk_tiles = self._load_chunk(
                            m_sizes, chunk, n_tiles)
                ab_pipeline.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(sm90._CONSUMER_REGS)
            self._consume_groups(ab_pipeline, tiled_mma, tiled_mma_zero, sA, sB, sD, sEpi, tma_d, mD,
                                 k_tiles, tidx - 128, warp_idx, m_sizes, total_m, n_size, n_tiles, epi_args)

    @cute.jit
    def _consume_groups(self, ab_pipeline, tiled_mma, tiled_mma_zero, sA, sB, sD, sEpi, tma_d, mD, k_tiles,
                        mma_tidx, warp_idx, m_sizes, total_m, n_size, n_tiles, epi_args):
        """Consumer warpgroups: HopperGemm._consume's main loop and epilogue over the group tiles."""
        thr_mma = tiled_mma.get_slice(mma_tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc_shape = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))).shape
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        acc_tmp = cute.make_rmem_tensor(acc_shape, Float32) if const_expr(self.promote_every) else None
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        tiled_mma_zero.set(warpgroup.Field.ACCUMULATE, False)

        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.d_dtype)
        tiled_r2s = cute.make_tiled_copy_S(
            sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.d_dtype, Float32),
            cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))
        thr_r2s = tiled_r2s.get_slice(mma_tidx)
        tRS_sD = thr_r2s.partition_D(sD)
        tRS_acc = tiled_r2s.retile(acc)
        sub_layout = cute.make_layout(cute.shape(thr_r2s.partition_S(sD))[:3])
        sub_size = cute.size(sub_layout)
        tRS_sub = cute.make_rmem_tensor(sub_layout.shape, Float32)
        tRS_out = cute.make_rmem_tensor(sub_layout.shape, self.d_dtype)
        cTile = cute.make_identity_tensor((self.tile_m, self.tile_n))
        num_sub = self.tile_n // sm90._EPI_TILE_N
        store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads))
        epi_regs = None
        if const_expr(self.epilogue is not None):
            epi_regs = cute.make_rmem_tensor(self.epilogue.num_regs, Float32)

        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        tiles_done = Int32(0)
        work = cute.arch.block_idx()[2]
        chunk, tiles_base, rows_base = Int32(0), Int32(0), Int32(0)
        rows, tiles, incl_rows, incl_tiles, chunk_rows, chunk_tiles = self._load_chunk(m_sizes, chunk, n_tiles)
        while work >= tiles_base + chunk_tiles:
            tiles_base, rows_base, chunk = tiles_base + chunk_tiles, rows_base + chunk_rows, chunk + _LANES
            rows, tiles, incl_rows, incl_tiles, chunk_rows, chunk_tiles = self._load_chunk(
                m_sizes, chunk, n_tiles)
        while chunk < m_sizes.shape[0]:
            group, first_row, group_rows, tile_m, tile_n = self._find_tile(
                work, tiles_base, rows_base, chunk, rows, tiles, incl_rows, incl_tiles, n_tiles)
            if const_expr(self.epilogue is not None):
                self.epilogue.prefetch(epi_regs, epi_args, first_row + tile_m * self.tile_m,
                                       group * n_size + tile_n * self.tile_n, mma_tidx)
            # ---- mainloop (HopperGemm's, with FP8 promotion when configured)
            if const_expr(self.promote_every == 0):
                read_state, release_state = self._mainloop(ab_pipeline, read_state, release_state, tiled_mma,
                                                           tCrA, tCrB, acc, k_tiles)
            else:
                acc.fill(0.0)
                wg = cute.arch.make_warp_uniform(mma_tidx // 128)
                head = cutlass.min(wg * (self.promote_every // self.num_mma_wg), k_tiles)
                for _ in cutlass.range(cutlass.min(head, 1), unroll=1):
                    read_state, release_state = self._promoted_chunk(
                        ab_pipeline, read_state, release_state, tiled_mma, tiled_mma_zero, tCrA, tCrB,
                        acc, acc_tmp, head)
                for k0 in cutlass.range(head, k_tiles, self.promote_every, unroll=1):
                    read_state, release_state = self._promoted_chunk(
                        ab_pipeline, read_state, release_state, tiled_mma, tiled_mma_zero, tCrA, tCrB,
                        acc, acc_tmp, cutlass.min(self.promote_every, k_tiles - k0))

            # ---- epilogue: (tile_m x 32) sub-tiles through shared memory and TMA stores that
            # clip at the group's last row (and at total_M).
            if const_expr(self.epilogue is not None):
                self.epilogue.stage(epi_regs, sEpi, mma_tidx)
                self.epi_barrier.arrive_and_wait()
            length = cutlass.max(cutlass.min(group_rows, total_m - first_row), Int32(0))
            gD_sub = cute.zipped_divide(
                cute.local_tile(ragged_group(mD, first_row, length), (self.tile_m, self.tile_n),
                                (tile_m, tile_n)), self.epi_tile)
            bSG_sD, bSG_gD = cpasync.tma_partition(tma_d, 0, cute.make_layout(1),
                                                   cute.group_modes(sD, 0, 2), gD_sub)
            for j in cutlass.range_constexpr(num_sub):
                for v in cutlass.range_constexpr(sub_size):
                    tRS_sub[v] = tRS_acc[j * sub_size + v]
                if const_expr(self.epilogue is not None):
                    coords = thr_r2s.partition_S(cute.local_tile(cTile, self.epi_tile, (0, j)))
                    self.epilogue.apply(tRS_sub, coords, sEpi)
                tRS_out.store(tRS_sub.load().to(self.d_dtype))
                buf = (tiles_done * num_sub + j) % self.epi_stages
                cute.copy(tiled_r2s, tRS_out, tRS_sD[(None, None, None, buf)])
                cute.arch.fence_proxy("async.shared", space="cta")
                self.epi_barrier.arrive_and_wait()
                if warp_idx == 4:
                    cute.copy(tma_d, bSG_sD[(None, buf)], bSG_gD[(None, (0, j))])
                    store_pipeline.producer_commit()
                    store_pipeline.producer_acquire()
                self.epi_barrier.arrive_and_wait()
            tiles_done += 1
            work += cute.arch.grid_dim()[2]
            while work >= tiles_base + chunk_tiles:
                tiles_base, rows_base, chunk = tiles_base + chunk_tiles, rows_base + chunk_rows, chunk + _LANES
                rows, tiles, incl_rows, incl_tiles, chunk_rows, chunk_tiles = self._load_chunk(
                    m_sizes, chunk, n_tiles)
        store_pipeline.producer_tail()
