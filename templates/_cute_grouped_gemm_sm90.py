"""Hopper (sm_90a) grouped GEMM over stacked rows, shared by the CuTe grouped GEMM templates.

    out[rows of group g] = epilogue(x[rows of group g] @ w[g]^T)
    x [total_M, K] (groups' rows stacked in order, M_sizes[g] rows each), w [G, N, K], out [total_M, N]

The kernel is ``_cute_gemm_sm90.HopperGemm`` (persistent, warp-specialized: a TMA producer warp,
tile_m // 64 wgmma consumer warpgroups, the same main loop, FP8 promotion and epilogue hook) with
a different unit of work. The units of all groups form one list, group by group (inside a group
the M units move fastest, so the CTAs running together share the group's weight panel); cluster
c takes units c, c + grid, c + 2 * grid, ... A unit is one output tile, or with a 2x1 cluster
(``cluster_m`` 2) two M tiles of a group with the same N tile, whose weight tile is multicast to
both CTAs. A group of m rows has ceil(m / (tile_m * cluster_m)) * N-tiles units, an empty group
none. Nothing about the sizes is known on the host: every warp that walks
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
Swapped tiles (``swap_ab``, for decode: a few rows per group) run the same list with the
operands exchanged, as the dense GEMMs' swapped tiles do: the kernel's A is the group's weight
rows (tile_m of them along wgmma's M), its B the group's tokens (tile_n, a multiple of 16 from
32, along wgmma's N, which is where a handful of rows wastes least), and D the output's
transpose. A unit is then one (weight tile, token tile) pair of a group, token tiles fastest;
the store clips at the group's last row through the same ragged descriptor with the token mode
second (``ragged_rows_t``); the FP8 scale epilogue reads x_scale along the kernel's n.

Rows past sum(M_sizes) are neither read into any stored result nor written. If sum(M_sizes)
exceeds total_M (a caller error that cannot be checked without a host sync), groups are cut at
total_M: nothing outside x and out is touched.

The grid: min(NUM_SMS / cluster_m clusters, an upper bound of the units known on the host), the
bound being (total_M // (tile_m * cluster_m) + min(G, total_M)) N-tiles (each non-empty group
adds at most one partial M unit); a cluster whose first index is past the real unit count does
nothing.
"""
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from mslk_dsl.errors import ConfigError
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


def ragged_rows_t(t: cute.Tensor) -> cute.Tensor:
    """[rows, N] -> the TMA-store view of its transpose with the rows ragged: [N, BIG, MAX_INT]
    (ragged_rows with the two first modes exchanged; an M-major D^T for swapped tiles)."""
    shifted = cute.domain_offset((-_BIG, None), t).iterator
    return cute.make_tensor(shifted, cute.make_layout((t.shape[1], _BIG, _MAX_INT),
                                                      stride=(t.stride[1], t.stride[0], t.stride[0])))


def ragged_group_t(t: cute.Tensor, start: Int32, length: Int32) -> cute.Tensor:
    """The [N, length] columns from ``start`` of a ragged_rows_t view: columns >= length are out
    of bounds."""
    return cute.domain_offset((None, _BIG - length), t[None, None, start + length])


def fake_args(ab_dtype, k_multiple: int, index_dtype: str, scales: bool) -> list:
    """The compile-time stand-ins of a grouped template's arguments: x [total_M, K] and w [G * N, K]
    of ``ab_dtype`` (K a multiple of ``k_multiple``, N of 8), with ``scales`` x_scale [total_M] and
    w_scale [G * N] fp32, then out [total_M, N] bf16, M_sizes [G] of ``index_dtype`` and the stream."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    m, gn, n, k = cute.sym_int(), cute.sym_int(divisibility=8), cute.sym_int(divisibility=8), \
        cute.sym_int(divisibility=k_multiple)
    index = {"int32": cutlass.Int32, "int64": cutlass.Int64}[index_dtype]
    return [make_fake_compact_tensor(ab_dtype, (m, k), stride_order=(1, 0), assumed_align=16),
            make_fake_compact_tensor(ab_dtype, (gn, k), stride_order=(1, 0), assumed_align=16),
            *([make_fake_compact_tensor(cutlass.Float32, (m,), assumed_align=4),
               make_fake_compact_tensor(cutlass.Float32, (gn,), assumed_align=4)] if scales else []),
            make_fake_compact_tensor(cutlass.BFloat16, (m, n), stride_order=(1, 0), assumed_align=16),
            make_fake_compact_tensor(index, (cute.sym_int(),), assumed_align=4),
            make_fake_stream(use_tvm_ffi_env_stream=True)]


class GroupedHopperGemm(HopperGemm):
    """One grouped GEMM configuration: HopperGemm's tile, cluster, FP8 promotion, ping-pong and
    epilogue hook; no split-K, stream-K or x_rows (each tile's unit of work is one whole group tile).
    With a 2x1 cluster the unit of work is a pair of M tiles of one group with the same N tile:
    the weight tile is TMA-multicast to both CTAs (each loads half), and a CTA whose M tile lies
    past the group's rows computes rows that are never stored (its store clips to nothing).
    The epilogue hook's prefetch sees m0 = the tile's first row of x / out and n0 = its first
    row of w viewed as [G * N, K] (so per-group column data, e.g. scales [G, N], flattens); under
    ``swap_ab`` (single CTAs only) the two are exchanged, as the kernel's m and n are."""

    def __init__(self, tile_mn, cluster_m=1, raster_m=True, promote_every=0, swap_ab=False, pingpong=False,
                 epilogue=None, template="GroupedHopperGemm"):
        if swap_ab and cluster_m != 1:
            raise ConfigError(f"{template}: swapped tiles run in single CTAs (cluster_m 1), not {cluster_m}")
        super().__init__(tile_mn, cluster_m=cluster_m, raster_m=raster_m, group=0, promote_every=promote_every,
                         swap_ab=swap_ab, pingpong=pingpong, epilogue=epilogue, template=template)
        # A unit of work covers unit_rows rows of a group (x / out rows) and unit_cols of its
        # weight rows (out columns): the kernel's m and n, exchanged under swap_ab.
        self.unit_rows = self.tile_n if swap_ab else self.tile_m * self.cluster_m
        self.unit_cols = self.tile_m if swap_ab else self.tile_n

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, d: cute.Tensor, m_sizes: cute.Tensor, epi_args, stream):
        """a [total_M, K], b [G * N, K], d [total_M, N], m_sizes [G] (int32 or int64)."""
        # The kernel's operands: under swap_ab the weights are A, x is B and the store view D^T.
        mA, mB, mD = (b, a, ragged_rows_t(d)) if const_expr(self.swap_ab) else (a, b, ragged_rows(d))
        self._setup(mA.element_type, mB.element_type, mD.element_type)
        tma_a, gA, tma_b, gB, tma_d, gD = self._make_tma_atoms(mA, mB, mD)

        groups = m_sizes.shape[0]
        total_m = d.shape[0]
        n_tiles = cute.ceil_div(d.shape[1], self.unit_cols)
        units_bound = (total_m // self.unit_rows + cutlass.min(groups, total_m)) * n_tiles
        num_clusters = cutlass.max(cutlass.min(units_bound, NUM_SMS // self.cluster_m), 1)
        self._define_shared_storage()
        self.grouped_kernel(tma_a, gA, tma_b, gB, tma_d, gD, self.tiled_mma, self.tiled_mma_zero,
                            self.a_smem, self.b_smem, self.d_smem, m_sizes, total_m, d.shape[1],
                            epi_args).launch(
            grid=(self.cluster_m, 1, num_clusters), block=(self.threads, 1, 1), cluster=(self.cluster_m, 1, 1),
            min_blocks_per_mp=1, stream=stream)

    # -------------------------------------------------------------- device side
    @cute.jit
    def _load_chunk(self, m_sizes: cute.Tensor, chunk: Int32, n_tiles: Int32):
        """Groups [chunk, chunk + 32), one per lane: (the lane's rows, units of work ("tiles":
        one per output tile, or per cluster_m M tiles; ``n_tiles`` per unit_rows rows), and
        inclusive prefix sums of both over the chunk, the chunk's total rows and units). Past the
        last group the chunk's unit total is BIG, which stops every search there."""
        lane = cute.arch.lane_idx()
        g = chunk + lane
        rows = Int32(0)
        if g < m_sizes.shape[0]:
            rows = Int32(m_sizes[g])
        rows = cutlass.max(rows, Int32(0))
        tiles = (rows + self.unit_rows - 1) // self.unit_rows * n_tiles
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
    def _walk_start(self, m_sizes: cute.Tensor, n_tiles: Int32, work: Int32):
        """The walk over the group list (each warp walks it forward only) at the chunk of 32
        groups that holds tile ``work``: the tuple (chunk, tiles and rows of the chunks before it,
        then the chunk's _load_chunk values); walk[0] >= G once past the last group."""
        chunk, tiles_base, rows_base = Int32(0), Int32(0), Int32(0)
        rows, tiles, incl_rows, incl_tiles, chunk_rows, chunk_tiles = self._load_chunk(m_sizes, chunk, n_tiles)
        return self._walk_to(m_sizes, n_tiles, work,
                             (chunk, tiles_base, rows_base, rows, tiles, incl_rows, incl_tiles, chunk_rows,
                              chunk_tiles))

    @cute.jit
    def _walk_to(self, m_sizes: cute.Tensor, n_tiles: Int32, work: Int32, walk):
        """The walk moved forward to the chunk that holds tile ``work`` (or past the last group)."""
        chunk, tiles_base, rows_base, rows, tiles, incl_rows, incl_tiles, chunk_rows, chunk_tiles = walk
        while work >= tiles_base + chunk_tiles:
            tiles_base, rows_base, chunk = tiles_base + chunk_tiles, rows_base + chunk_rows, chunk + _LANES
            rows, tiles, incl_rows, incl_tiles, chunk_rows, chunk_tiles = self._load_chunk(
                m_sizes, chunk, n_tiles)
        return chunk, tiles_base, rows_base, rows, tiles, incl_rows, incl_tiles, chunk_rows, chunk_tiles

    @cute.jit
    def _find_tile(self, work: Int32, walk, n_tiles: Int32):
        """Work index (inside the walk's chunk) -> (group, its first row, its rows, row unit, column
        unit): the row unit's unit_rows rows of the group (cluster_m M tiles from M tile unit *
        cluster_m; swapped, one N tile), the column unit's unit_cols weight rows.
        The group is the lane whose inclusive tile sum first exceeds the index: the count of
        lanes at or below it (prefix sums only grow), by ballot."""
        chunk, tiles_base, rows_base, rows, tiles, incl_rows, incl_tiles, _, _ = walk
        local = work - tiles_base
        lane = cute.arch.popc(cute.arch.vote_ballot_sync(incl_tiles <= local))
        first_tile = cute.arch.shuffle_sync(incl_tiles - tiles, lane)
        first_row = rows_base + cute.arch.shuffle_sync(incl_rows - rows, lane)
        group_rows = cute.arch.shuffle_sync(rows, lane)
        t = local - first_tile
        m_units = (group_rows + self.unit_rows - 1) // self.unit_rows
        n_unit = t // m_units
        return chunk + lane, first_row, group_rows, t - n_unit * m_units, n_unit

    @cute.kernel
    def grouped_kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                       tma_d: cute.CopyAtom, mD: cute.Tensor, tiled_mma: cute.TiledMma,
                       tiled_mma_zero: cute.TiledMma, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
                       d_smem: cute.ComposedLayout, m_sizes: cute.Tensor, total_m: Int32, n_size: Int32,
                       epi_args):
        tidx, warp_idx = self._kernel_start(tma_a, tma_b, tma_d)
        # CTA rank in the (cluster_m, 1) cluster == its M tile inside the unit of work.
        cta_m = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        b_mcast_mask = cute.make_layout_image_mask(
            cute.make_layout((self.cluster_m, 1, 1)), (cta_m, 0, 0), mode=0)

        ab_pipeline, sA, sB, sD, sEpi, _ = self._allocate_shared(a_smem, b_smem, d_smem)
        k_tiles = cute.ceil_div(mA.shape[1], self.tile_k)
        n_tiles = (n_size + self.unit_cols - 1) // self.unit_cols
        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_m, 1))

        if cute.arch.make_warp_uniform(tidx // 128) == 0:
            cute.arch.setmaxregister_decrease(sm90._PRODUCER_REGS)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                work = cute.arch.block_idx()[2]
                walk = self._walk_start(m_sizes, n_tiles, work)
                while walk[0] < m_sizes.shape[0]:
                    group, first_row, _, m_unit, n_unit = self._find_tile(work, walk, n_tiles)
                    if const_expr(self.swap_ab):  # A: the group's weight rows; B: its rows of x
                        gA = cute.local_tile(cute.domain_offset((group * n_size, None), mA),
                                             (self.tile_m, self.tile_k), (n_unit, None))
                        gB = cute.local_tile(cute.domain_offset((first_row, None), mB),
                                             (self.tile_n, self.tile_k), (m_unit, None))
                    else:
                        gA = cute.local_tile(cute.domain_offset((first_row, None), mA),
                                             (self.tile_m, self.tile_k), (m_unit * self.cluster_m + cta_m, None))
                        gB = cute.local_tile(cute.domain_offset((group * n_size, None), mB),
                                             (self.tile_n, self.tile_k), (n_unit, None))
                    tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                                       cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
                    tBsB, tBgB = cpasync.tma_partition(tma_b, cta_m, cute.make_layout(self.cluster_m),
                                                       cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
                    state = self._load(ab_pipeline, state, tma_a, tma_b, tAgA, tAsA, tBgB, tBsB, b_mcast_mask,
                                       Int32(0), k_tiles)
                    work += cute.arch.grid_dim()[2]
                    walk = self._walk_to(m_sizes, n_tiles, work, walk)
                ab_pipeline.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(sm90._CONSUMER_REGS)
            self._consume_groups(ab_pipeline, tiled_mma, tiled_mma_zero, sA, sB, sD, sEpi, tma_d, mD,
                                 k_tiles, tidx - 128, warp_idx, cta_m, m_sizes, total_m, n_size, n_tiles, epi_args)

    @cute.jit
    def _consume_groups(self, ab_pipeline, tiled_mma, tiled_mma_zero, sA, sB, sD, sEpi, tma_d, mD, k_tiles,
                        mma_tidx, warp_idx, cta_m, m_sizes, total_m, n_size, n_tiles, epi_args):
        """Consumer warpgroups: HopperGemm's main loop and epilogue over the group tiles. Under
        ping-pong each warpgroup takes every other tile of the CTA's sequence (its own walk over
        the group list) and steps its pipeline states over the other's tiles, in the dense
        kernel's order (HopperGemm._consume): every unit has all K's k-tiles."""
        c, read_state, release_state = self._consumer_setup(tiled_mma, tiled_mma_zero, sA, sB, sD, mma_tidx)
        tiles_done = Int32(0)
        work = cute.arch.block_idx()[2]
        if const_expr(self.pingpong):
            # Group 1 starts at the CTA's second tile: past the first one's k-tiles.
            work += c.group * cute.arch.grid_dim()[2]
            read_state.advance(c.group * k_tiles)
            release_state.advance(c.group * k_tiles)
            if c.group == 0:  # group 0's first mainloop waits for no one
                cute.arch.barrier_arrive(barrier_id=sm90._MMA_ORDER_BARRIER, number_of_threads=2 * self.tile_threads)
        walk = self._walk_start(m_sizes, n_tiles, work)
        while walk[0] < m_sizes.shape[0]:
            group, first_row, group_rows, m_unit, n_unit = self._find_tile(work, walk, n_tiles)
            # The output tile in the kernel's (m, n) tiles of the store view, and its origin as
            # the epilogue hook indexes it (x rows / flattened weight rows; exchanged when swapped).
            if const_expr(self.swap_ab):
                tile_mn = (n_unit, m_unit)
                origin = (group * n_size + n_unit * self.tile_m, first_row + m_unit * self.tile_n)
            else:
                tile_mn = (m_unit * self.cluster_m + cta_m, n_unit)
                origin = (first_row + tile_mn[0] * self.tile_m, group * n_size + n_unit * self.tile_n)
            if const_expr(self.epilogue is not None):
                self.epilogue.prefetch(c.epi_regs, epi_args, origin[0], origin[1], c.tidx)
            if const_expr(self.pingpong):  # the other group has issued its mainloop
                cute.arch.barrier(barrier_id=sm90._MMA_ORDER_BARRIER + c.group,
                                  number_of_threads=2 * self.tile_threads)
            read_state, release_state = self._accumulate_tile(ab_pipeline, read_state, release_state, tiled_mma,
                                                              tiled_mma_zero, c, k_tiles, mma_tidx)
            if const_expr(self.pingpong):  # the other group's next tile
                read_state.advance(k_tiles)
                release_state.advance(k_tiles)
            # The TMA stores clip at the group's last row (and at total_M).
            self._stage_epilogue(c, sEpi)
            length = cutlass.max(cutlass.min(group_rows, total_m - first_row), Int32(0))
            group_out = (ragged_group_t if const_expr(self.swap_ab) else ragged_group)(mD, first_row, length)
            self._store_tile(c, tma_d, sD, sEpi, cute.local_tile(group_out, (self.tile_m, self.tile_n), tile_mn),
                             tiles_done, warp_idx)
            tiles_done += 1
            work += cute.arch.grid_dim()[2] * self.tile_groups
            walk = self._walk_to(m_sizes, n_tiles, work, walk)
        c.store_pipeline.producer_tail()
