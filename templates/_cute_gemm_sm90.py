"""Hopper (sm_90a) GEMM machinery shared by the CuTe DSL GEMM templates.

    D[M, N] = epilogue(A[M, K] @ B[N, K]^T)      A, B K-major; D N-major; fp32 accumulators

The kernel is NVIDIA's persistent warp-specialized design (CuTe DSL example
hopper/kernel/dense_gemm/dense_gemm_persistent.py, BSD-3-Clause), reduced to what the
templates need, with its own tile order and an epilogue hook:
  * warpgroup 0 is the producer: one warp issues TMA loads of A/B k-tiles into a ring of
    shared-memory stages (mbarrier pipeline; with a 2x1 cluster the B tile is multicast
    to both CTAs, which work on the same N tile);
  * tile_m // 64 consumer warpgroups each own 64 rows of the tile (256-row tiles: two that own
    128 rows each, two 64-row wgmma blocks apiece, CUTLASS's cooperative 256-row layout) and
    issue wgmma from shared memory, keeping one k-tile of wgmma in flight while the next stage
    lands;
  * the epilogue walks the tile in (tile_m x 32) sub-tiles (x 16 where tile_n is an odd multiple
    of 16, or where the narrower store buffers buy a 256-row tile an A/B stage): optional hook on the fp32
    values, conversion, stmatrix into shared memory, TMA store (which clips rows and
    columns past M / N);
  * ping-pong (``pingpong``, 128-row tiles): the two consumer warpgroups take alternate tiles
    of the CTA's sequence, each a whole 128-row tile (two 64-row wgmma blocks, tile_n fp32
    registers per thread), so one warpgroup's epilogue runs while the other's mainloop keeps
    the tensor cores busy (CUTLASS's KernelTmaWarpSpecializedPingpong). The k-tiles of both
    come through the one ring of stages in tile order: a warpgroup steps its pipeline states
    over the other's tile. Each warpgroup has its own store buffers, epilogue words and barrier;
  * the grid is persistent, one CTA per SM (``NUM_SMS``), each CTA walking output tiles in
    a grouped raster order so the CTAs running together share A and B panels in L2;
  * split-K (``split_k`` > 1, where the output tiles cannot keep every SM busy: decode-sized
    and mid-sized M): each output tile is ``split_k`` units of work over consecutive K ranges.
    64-row (decode) tiles: a unit stores its fp32 sums (rows < M only) into a partials buffer
    [split_k, M, N], and a second kernel adds the split_k partials in a fixed order and rounds
    once to the output dtype (deterministic, no atomics; launched early, see second_kernel). 128-row tiles fix up in place: a unit
    stores its fp32 sums into its slot of the tile in a partials buffer
    [tile, split, tile_m x tile_n] (threads holding only rows past M store nothing) and counts itself in the tile's counter
    (an atomic add after a release fence); the unit that finds the count complete is the
    tile's last: it resets the counter to zero for the next call, adds the tile's slots in
    split order (deterministic whoever comes last) and runs the epilogue as an unsplit tile
    does. One kernel, no spin-waits (CUTLASS's in-place split-K fix-up, without its waits);
  * swap_ab (the templates pass the weight as A, the activations as B and D^T): tokens run along
    the wgmma N, which takes any multiple of 8 (so a tile of 16-row granularity fits a mid-sized
    M that 64-row wgmma M tiles pad), D^T is M-major and the epilogue stores it transposed
    (transposing stmatrix, TMA store of (tile_m x 16|32) column blocks of D^T);
  * stream-K (``stream_k``, for grids whose last wave would be partial): the full waves of
    tiles run as above; the k-tiles of the remaining tiles are shared out evenly between all
    CTAs (gemm_configs.stream_k_*: a CTA's range touches at most two tiles), each CTA stores
    the fp32 sums of its (at most two) pieces into a partials buffer [CTA, piece, tile], and a
    second kernel adds every tile's pieces in CTA order (deterministic) into D.
TMA zero-fills loads past M / N / K, so the mainloop needs no predication: any M works (up to
x_rows with an x_rows box), and any K and N that keep rows 16-byte aligned (what TMA requires of
the row strides).
"""
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator, get_smem_capacity_in_bytes
from cutlass.tensor_utils import LayoutEnum

from mslk_dsl.errors import ConfigError
from mslk_dsl.templates import _cute_gemm_configs as gemm_configs

# SMs of an H100 / H200 SXM. The persistent grid is sized from this because the kernel's
# calling convention carries no device query; on a part with fewer SMs the extra CTAs
# simply start when the first ones finish (correct, slower).
NUM_SMS = gemm_configs.NUM_SMS
_SMEM_BYTES = get_smem_capacity_in_bytes("sm_90")
_EPI_TILE_N = 32  # epilogue sub-tile width (CUTLASS's choice for 16-bit outputs)
_EPI_TILE_N_MIN = 16  # swap_ab tiles of an odd number of 16 columns store 16-wide sub-tiles
_REDUCE_THREADS = 256  # 64-row split-K: threads per block of the partials reduction (4 columns each)
_EARLY_BLOCKS_PER_IDLE_SM = 4  # at most this many per SM the GEMM leaves idle launch early
_PRODUCER_REGS, _CONSUMER_REGS = 40, 232  # setmaxnreg split; 40*128 + 232*256 <= 64K
_CONSUMER_REGS_3WG = 152  # three consumer warpgroups (192-row tiles): 40*128 + 152*384 <= 64K
_PINGPONG_MAX_N = 192  # a ping-pong warpgroup holds a 128 x tile_n fp32 tile: tile_n registers
_WIDE_MAX_N = 192  # a 256-row tile's warpgroup holds 128 x tile_n fp32 values too
# Swapped 192-row tiles (the weight's rows along the three 64-row warpgroups, tokens along
# tile_n): at most this wide, so tile_n / 2 fp32 accumulators per thread fit 152 registers.
_TALL_SWAP_MAX_N = 192
# Named barriers: 1 all consumer threads (split-K fix-up), _EPI_GROUP_BARRIER + g the epilogue of
# ping-pong group g, _MMA_ORDER_BARRIER + g ping-pong group g's turn to issue its mainloop.
_EPI_GROUP_BARRIER, _MMA_ORDER_BARRIER = 2, 4


def epilogue_order(tiled_mma, tiled_r2s, tile_mn, epi_tile, thread=0):
    """The epilogue's register order: for each (tile_m x epi_n) sub-tile j, the accumulator
    index of each value the register -> shared copy takes, matched by tile coordinate (the
    order is the same for every thread; a test checks it against a spread of them). Plain Python run
    while the kernel is traced. The accumulators' own order is not the sub-tiles': a warpgroup
    holding two 64-row blocks (ping-pong) keeps each block's columns together, so sub-tile j
    is not a contiguous run of the accumulators."""
    tile = cute.make_identity_tensor(tile_mn)
    acc_coords = tiled_mma.get_slice(thread).partition_C(tile)
    index = {tuple(acc_coords[i]): i for i in range(cute.size(acc_coords))}
    thr_r2s = tiled_r2s.get_slice(thread)
    order = []
    for j in range(tile_mn[1] // epi_tile[1]):
        sub = thr_r2s.partition_S(cute.local_tile(tile, epi_tile, (0, j)))
        order.append(tuple(index[tuple(sub[v])] for v in range(cute.size(sub))))
    return tuple(order)


class _ConsumerState:
    """What a consumer thread sets up once and reads for every tile (HopperGemm._consumer_setup):
    a plain attribute holder, filled while the kernel is traced."""


class HopperGemm:
    """One GEMM kernel configuration (all arguments are compile-time).

    tile_mn:      CTA tile, (64 | 128 | 192 | 256, a multiple of 32 from 64 to 256: the
                  epilogue's sub-tile width; wgmma takes any multiple of 8); tile_m // 64
                  consumer warpgroups (three for 192 rows: 152 registers each instead of 232,
                  so the 192-row tiles run unsplit, without stream-K, x_rows or promotion, at
                  most _TALL_SWAP_MAX_N wide when swapped: fewer, larger tiles, for layers they
                  split into whole waves), but
                  two of 128 rows for 256-row tiles (tile_n fp32 registers each, so at most
                  _WIDE_MAX_N wide; unswapped, unsplit, unpromoted like the 192-row ones).
    cluster_m:    1 or 2 CTAs along M per cluster (2: the B tile is TMA-multicast).
    raster_m:     walk output tiles with M fastest (True) or N fastest (False) ...
    group:        ... inside bands of ``group`` clusters (0: the whole dimension).
    promote_every: FP8: 0, or sum every ``promote_every`` k-tiles (128 deep each) in a
                  temporary that is then added into fp32 registers (CUTLASS's 2x accumulation,
                  for Hopper's FP8 wgmma adds into its accumulator with ~13-bit precision);
                  the second warpgroup's chunks are offset by half a chunk, so the warpgroups
                  never wait for their wgmma to drain at the same time.
    split_k:      1, or the number of K ranges each output tile is split into (no cluster;
                  64-row tiles: no epilogue hook); the call then takes an fp32 partials buffer
                  of at least gemm_configs.partials_elements(config, M, N) elements (< 2**31)
                  and, with 128-row tiles (fixed up in place), an int32 tile counter per output
                  tile (gemm_configs.counters_needed), zero at the launch and left zero by it.
    x_rows:       0, or (64-row tiles, decode) load only this many rows of A per k-tile (a
                  multiple of 8): the call must have M <= x_rows. wgmma still reads 64 rows of
                  shared memory; rows past x_rows hold stale data, which only reaches output
                  rows >= M, never stored. (TMA fills a box's rows past M with zeros, but a
                  64-row box with 63 such rows streams ~15% slower than one of 64 real rows.)
    swap_ab:      the caller passes A = the weight [N, K], B = the activations [M, K] and
                  D = the output's transpose (an M-major [N, M] view): the kernel's tile_n then
                  runs along the tokens and may be any multiple of 16 from 32 to 256 (192 for
                  192- and 256-row tiles); the
                  epilogue stores D^T's (tile_m x 16 or 32) column blocks. No 64-row split-K
                  (its second kernel writes row-major D) and no stream-K.
    stream_k:     share the last partial wave's tiles out by k-tiles (no epilogue hook, no
                  promotion); the call then takes an fp32 partials buffer of at least
                  gemm_configs.stream_k_partials(config) elements (16-byte aligned).
    pingpong:     (128-row tiles, at most _PINGPONG_MAX_N wide) one consumer warpgroup per tile,
                  the two taking alternate tiles (see above); unswapped, unsplit, without
                  stream-K, x_rows or promotion.
    epilogue:     None, or an object built for this tile shape that sees every output tile:
        smem_words, num_regs                    fp32 words of shared memory / registers it needs
        prefetch(regs, epi_args, m0, n0, tidx)  at tile start: global loads whose latency the
                                                 mainloop hides (m0, n0: the tile's origin)
        stage(regs, smem, tidx)                 after the mainloop, e.g. registers -> smem
        apply(acc, coords, smem)                per sub-tile: ``acc`` fp32 registers,
                                                 ``coords[i]`` the (m, n) of acc[i] in the tile
      (@cute.jit methods; tidx numbers the consumer threads of the tile: 2 * tile_m, or 128
      under ping-pong; a barrier separates stage and apply).
    """

    def __init__(self, tile_mn, cluster_m=1, raster_m=True, group=8, promote_every=0,
                 split_k=1, stream_k=False, x_rows=0, swap_ab=False, pingpong=False, epilogue=None,
                 template="HopperGemm"):
        self.tile_m, self.tile_n = tile_mn
        big = self.tile_m > 128  # 192 rows (three 64-row warpgroups) or 256 (two 128-row ones)
        problems = [why for bad, why in (
            (not swap_ab and (self.tile_m not in (64, 128, gemm_configs.TALL_TILE_M, gemm_configs.WIDE_TILE_M)
                              or self.tile_n % _EPI_TILE_N or not 64 <= self.tile_n <= 256),
             f"tile_m must be 64, 128, {gemm_configs.TALL_TILE_M} or {gemm_configs.WIDE_TILE_M}, tile_n a multiple "
             f"of {_EPI_TILE_N} from 64 to 256"),
            (big and (split_k != 1 or stream_k or x_rows or promote_every),
             f"{gemm_configs.TALL_TILE_M}- and {gemm_configs.WIDE_TILE_M}-row tiles run without split-K, "
             "stream-K, x_rows or promotion"),
            (self.tile_m == gemm_configs.WIDE_TILE_M and self.tile_n > _WIDE_MAX_N,
             f"{gemm_configs.WIDE_TILE_M}-row tiles are at most {_WIDE_MAX_N} wide"),
            (swap_ab and (self.tile_m not in (64, 128, gemm_configs.TALL_TILE_M, gemm_configs.WIDE_TILE_M)
                          or self.tile_n % _EPI_TILE_N_MIN
                          or not 2 * _EPI_TILE_N_MIN <= self.tile_n <= (_TALL_SWAP_MAX_N if big else 256)
                          or stream_k or (split_k > 1 and self.tile_m == 64) or x_rows),
             f"swap_ab: tile_m 64, 128, {gemm_configs.TALL_TILE_M} or {gemm_configs.WIDE_TILE_M}, tile_n a multiple "
             f"of {_EPI_TILE_N_MIN} from 32 to 256 ({_TALL_SWAP_MAX_N} for {gemm_configs.TALL_TILE_M} and "
             f"{gemm_configs.WIDE_TILE_M} rows), no stream-K, x_rows or 64-row split-K"),
            (cluster_m not in (1, 2) or group < 0, "cluster_m must be 1 or 2 and group >= 0"),
            (split_k < 1 or (split_k > 1 and (cluster_m != 1 or (self.tile_m == 64 and epilogue is not None))),
             "split_k >= 1, and split-K runs with cluster_m 1 (64-row tiles: and no epilogue)"),
            (stream_k and (split_k != 1 or epilogue is not None or promote_every != 0),
             "stream-K runs without split-K, epilogue or promotion"),
            (x_rows != 0 and (self.tile_m != 64 or x_rows % 8 or x_rows >= 64),
             "x_rows needs tile_m 64 and is a multiple of 8 below 64"),
            (pingpong and (self.tile_m != 128 or self.tile_n > _PINGPONG_MAX_N or swap_ab or split_k != 1
                           or stream_k or x_rows or promote_every),
             f"ping-pong needs 128-row tiles at most {_PINGPONG_MAX_N} wide, without swap_ab, split-K, "
             "stream-K, x_rows or promotion"),
        ) if bad]
        if problems:
            config = dict(tile_mn=tile_mn, cluster_m=cluster_m, group=group, split_k=split_k, stream_k=stream_k,
                          x_rows=x_rows, promote_every=promote_every, pingpong=pingpong)
            raise ConfigError(f"{template}: config {config} is not usable: " + "; ".join(problems))
        self.template = template
        self.cluster_m, self.raster_m, self.group = cluster_m, raster_m, group
        self.split_k, self.stream_k = split_k, stream_k
        self.swap_ab = swap_ab
        # D's layout as the kernel sees it: D^T (M-major) under swap_ab.
        self.d_layout = LayoutEnum.COL_MAJOR if swap_ab else LayoutEnum.ROW_MAJOR
        self.epi_n = _EPI_TILE_N if self.tile_n % _EPI_TILE_N == 0 else _EPI_TILE_N_MIN
        # 128-row split-K tiles are fixed up in place by the last unit of each tile; 64-row
        # (decode) ones are summed by a second kernel: measured faster there on the H200
        # (docs/benchmarks.md), where one warp of the last unit would read split_k slots.
        self.fix_up_in_place = split_k > 1 and self.tile_m == 128
        # 64-row split-K and stream-K add a second kernel (the partials' reduction). It is a
        # programmatic dependent launch: its blocks may be scheduled as soon as every CTA of the
        # GEMM has started and wait (griddepcontrol.wait) for the GEMM's grid to finish and its
        # writes to be visible, so the reduction starts without a kernel launch's gap.
        self.second_kernel = (split_k > 1 and not self.fix_up_in_place) or stream_k
        self.x_rows = x_rows or self.tile_m  # rows of A each TMA load brings in
        self.promote_every, self.epilogue = promote_every, epilogue
        self.pingpong = pingpong
        # consumer warpgroups of the CTA: one per 64 rows, but two of 128 rows for 256-row tiles
        self.num_mma_wg = gemm_configs.consumer_warpgroups(self.tile_m)
        # ... of one tile: all of them, or one under ping-pong (then each has its own tiles,
        # store buffers, epilogue words and barrier: `tile_groups` of each)
        self.tile_wg = 1 if pingpong else self.num_mma_wg
        self.tile_groups = self.num_mma_wg // self.tile_wg
        self.tile_threads = 128 * self.tile_wg
        self.consumer_regs = _CONSUMER_REGS_3WG if self.num_mma_wg == 3 else _CONSUMER_REGS
        self.num_mma_threads = 128 * self.num_mma_wg
        self.threads = 128 + self.num_mma_threads
        # Split-K's fix-up counts the tile's units with all consumer threads (never ping-pong).
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)
        self.epi_group_words = epilogue.smem_words if epilogue is not None else 1
        self.epi_words = self.epi_group_words * self.tile_groups

    # ---------------------------------------------------------------- host side
    def _setup(self, a_dtype, b_dtype, d_dtype):
        self.a_dtype, self.b_dtype, self.d_dtype = a_dtype, b_dtype, d_dtype
        # Two copies of the MMA: one accumulates, the other overwrites its accumulators (it
        # starts each promotion chunk, so no other instruction ever writes them; ptxas
        # serializes every wgmma of a kernel that does, warning C7515).
        self.tiled_mma, self.tiled_mma_zero = (sm90_utils.make_trivial_tiled_mma(
            a_dtype, b_dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            (self.tile_wg, 1, 1), tiler_mn=(64, self.tile_n)) for _ in range(2))
        # 4 wgmma k-blocks per stage = 128 bytes of K per row, one 128B-swizzle atom.
        self.tile_k = cute.size(self.tiled_mma.shape_mnk, mode=[2]) * 4
        self.tile_mnk = (self.tile_m, self.tile_n, self.tile_k)
        self.epi_tile = (self.tile_m, self.epi_n)
        # As many A/B stages as fit beside 2 store buffers (per tile group: two under ping-pong);
        # leftover bytes buy up to 4 of those.
        # The head (mbarriers of <= 32 stages, epilogue words) is padded to sA's 1 KB alignment.
        ab_bytes = (self.tile_m * a_dtype.width + self.tile_n * b_dtype.width) * self.tile_k // 8
        # (+1 word: the split-K fix-up's flag; other kernels keep the 4 bytes in the head's slack)
        head = -(-(16 * 32 + 4 * (self.epi_words + self.fix_up_in_place)) // 1024) * 1024

        def stages_beside(epi_n):
            d_bytes = self.tile_m * epi_n * d_dtype.width // 8 * self.tile_groups
            return min((_SMEM_BYTES - head - 2 * d_bytes) // ab_bytes, 32), d_bytes

        self.stages, d_bytes = stages_beside(self.epi_n)
        # A 256-row tile's 32-column store buffers (16 KB each) can cost it an A/B stage (3 instead
        # of 4 at 160 columns): it then stores 16-column sub-tiles. Timed on the H200 at 256 x 160
        # in 2x1 clusters (graph replays, docs/benchmarks.md "Swapped 256-row tiles"): faster at 7
        # of 8 shapes (1-7%, bf16 and FP8), level at the other.
        if self.tile_m == gemm_configs.WIDE_TILE_M and stages_beside(_EPI_TILE_N_MIN)[0] > self.stages:
            self.epi_n = _EPI_TILE_N_MIN
            self.epi_tile = (self.tile_m, self.epi_n)
            self.stages, d_bytes = stages_beside(self.epi_n)
        free = _SMEM_BYTES - head - 2 * d_bytes
        self.epi_stages = 2 + min(2, (free - self.stages * ab_bytes) // d_bytes)  # per tile group
        row_major = LayoutEnum.ROW_MAJOR  # A, B K-major; D N-major
        self.a_smem = sm90_utils.make_smem_layout_a(row_major, self.tile_mnk, a_dtype, self.stages)
        self.b_smem = sm90_utils.make_smem_layout_b(row_major, self.tile_mnk, b_dtype, self.stages)
        self.d_smem = sm90_utils.make_smem_layout_epi(d_dtype, self.d_layout, self.epi_tile,
                                                      self.epi_stages * self.tile_groups)
        # One stage of the A box: the first x_rows rows of an A stage (same swizzle pattern).
        self.a_box_smem = sm90_utils.make_smem_layout_a(
            row_major, (self.x_rows, self.tile_n, self.tile_k), a_dtype, 1)

    def _make_tma_atoms(self, a: cute.Tensor, b: cute.Tensor, d: cute.Tensor):
        """(tma_a, gA, tma_b, gB, tma_d, gD): TMA loads of x_rows x tile_k boxes of A and
        tile_n x tile_k boxes of B (multicast to the cluster's CTAs), TMA stores of the
        epilogue's sub-tiles of D (``d``: whatever view of D the kernel stores through)."""
        tma_a, gA = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), a,
            cute.slice_(self.a_box_smem, (None, None, 0)), (self.x_rows, self.tile_k))
        b_op = (cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_m > 1)
                else cpasync.CopyBulkTensorTileG2SOp())
        tma_b, gB = cpasync.make_tiled_tma_atom(
            b_op, b, cute.slice_(self.b_smem, (None, None, 0)), (self.tile_n, self.tile_k),
            num_multicast=self.cluster_m)
        tma_d, gD = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), d,
            cute.slice_(self.d_smem, (None, None, 0)), self.epi_tile)
        return tma_a, gA, tma_b, gB, tma_d, gD

    def _define_shared_storage(self) -> None:
        """The kernel's shared memory (self.shared_storage): the A/B pipeline's mbarriers, the
        epilogue hook's words, the A / B stages and the D store buffers. A plain method, run
        while __call__ is traced: the DSL refuses a raise inside the staged __call__ itself."""

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sEpi: cute.struct.MemRange[Float32, self.epi_words]
            last_flag: cute.struct.MemRange[Int32, 1]  # split-K: the tile counter's old value
            sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(self.d_smem)], 1024]

        size = SharedStorage.size_in_bytes()
        if size > _SMEM_BYTES:
            raise ConfigError(f"{self.template}: tile {self.tile_m}x{self.tile_n} with {self.stages} stages needs "
                              f"{size} bytes of shared memory, more than {_SMEM_BYTES}")
        self.shared_storage = SharedStorage

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, d: cute.Tensor, epi_args, stream,
                 partials: cute.Tensor = None, counters: cute.Tensor = None):
        """Launch D = A @ B^T; ``partials`` (fp32, 1-D) is the split-K or stream-K buffer, only
        with split_k > 1 or stream_k; ``counters`` (int32, 1-D) the split-K tile counters."""
        a, b, d = self._operands(a, b, d)
        self._setup(a.element_type, b.element_type, d.element_type)
        tma_a, gA, tma_b, gB, tma_d, gD = self._make_tma_atoms(a, b, d)

        # Persistent grid (cluster_m, 1, clusters): at most one CTA per SM.
        clusters_m = cute.ceil_div(cute.ceil_div(d.shape[0], self.tile_m), self.cluster_m)
        clusters_n = cute.ceil_div(d.shape[1], self.tile_n)
        num_clusters = cutlass.min(clusters_m * clusters_n * self.split_k, NUM_SMS // self.cluster_m)
        if const_expr(self.stream_k):  # every CTA takes a share of the last wave
            num_clusters = NUM_SMS // self.cluster_m
        self._define_shared_storage()
        # Without split-K or stream-K the kernel never reads the partials or counters: D stands in.
        mP = partials if const_expr(self.split_k > 1 or self.stream_k) else d
        mC = counters if const_expr(self.fix_up_in_place) else d
        self.kernel(tma_a, gA, tma_b, gB, tma_d, gD, self.tiled_mma, self.tiled_mma_zero, self.a_smem,
                    self.b_smem, self.d_smem, clusters_m, clusters_n, epi_args, mP, mC).launch(
            grid=(self.cluster_m, 1, num_clusters), block=(self.threads, 1, 1),
            cluster=(self.cluster_m, 1, 1), min_blocks_per_mp=1, stream=stream)
        # The reductions are programmatic dependent launches (see second_kernel).
        if const_expr(self.split_k > 1 and not self.fix_up_in_place):
            vectors = d.shape[0] * (d.shape[1] // 4)
            blocks = (vectors + _REDUCE_THREADS - 1) // _REDUCE_THREADS
            self.reduce_partials(partials, d).launch(
                grid=(blocks, 1, 1), block=(_REDUCE_THREADS, 1, 1), stream=stream,
                use_pdl=Int32(self._launch_early(blocks, num_clusters)))
        if const_expr(self.stream_k):
            ctas = NUM_SMS // self.cluster_m
            _, shared = gemm_configs.stream_k_tiles(clusters_m * clusters_n, ctas)
            k_tiles = (a.shape[1] + self.tile_k - 1) // self.tile_k
            # One block per shared tile (and CTA of the cluster), one thread per consumer thread
            # of the GEMM; at least one block: a grid of none is a launch error.
            self.reduce_stream_k(self.tiled_mma, partials, d, clusters_m, clusters_n, k_tiles).launch(
                grid=(cutlass.max(shared * self.cluster_m, 1), 1, 1),
                block=(self.num_mma_threads, 1, 1), stream=stream, use_pdl=True)

    def _launch_early(self, blocks, ctas):
        """Whether the split-K reduction's ``blocks`` may launch while the GEMM's ``ctas`` run.
        Its blocks cannot share an SM with a GEMM CTA (the stages fill shared memory), so early
        ones crowd onto the SMs the GEMM leaves idle, up to 8 per SM, and each such SM then reads
        the partials of all of them: on the H200, 10-16 blocks per idle SM made the call up to
        1.3 us slower than a plain launch, 1-2.3 made it 1-1.5 us faster (docs/benchmarks.md).
        With no idle SM they start as GEMM CTAs finish, spread like a plain launch."""
        idle = NUM_SMS - ctas
        no_idle = 1 - cutlass.min(idle, 1)
        return blocks <= _EARLY_BLOCKS_PER_IDLE_SM * idle + no_idle * blocks

    def _operands(self, a, b, d):
        """(A, B, D) as the kernel multiplies them: under swap_ab the weight (b) is A, the
        activations B, and D the output's transpose (its modes swapped: an M-major view).
        Plain Python, run while __call__ is traced."""
        if not self.swap_ab:
            return a, b, d
        return b, a, cute.make_tensor(d.iterator, cute.select(d.layout, mode=[1, 0]))

    # -------------------------------------------------------------- device side
    @cute.jit
    def _tile_coord(self, work: Int32, clusters_m: Int32, clusters_n: Int32, cta_m: Int32):
        """Work index -> (tile_m, tile_n) of this CTA (see gemm_configs.tile_of_work)."""
        cm, cn = gemm_configs.tile_of_work(work, clusters_m, clusters_n, self.raster_m,
                                           self.group, cutlass.min)
        return cm * self.cluster_m + cta_m, cn

    @cute.jit
    def _work_unit(self, work: Int32, clusters_m: Int32, clusters_n: Int32, cta_m: Int32, k_tiles: Int32):
        """Work index -> (tile_m, tile_n, split, first k-tile, k-tiles to do). The split is the
        slow index, so the units running together cover different tiles of the same K range."""
        tiles = clusters_m * clusters_n
        split = work // tiles
        tile_m, tile_n = self._tile_coord(work - split * tiles, clusters_m, clusters_n, cta_m)
        k_begin, k_count = gemm_configs.k_range(split, k_tiles, self.split_k, cutlass.min)
        return tile_m, tile_n, split, k_begin, k_count

    @cute.jit
    def _stream_k_range(self, clusters_m: Int32, clusters_n: Int32, k_tiles: Int32):
        """Stream-K: (tiles done whole, tiles shared, this CTA's first and end shared k-tile)."""
        ctas = cute.arch.grid_dim()[2]
        cta = cute.arch.block_idx()[2]
        whole, shared = gemm_configs.stream_k_tiles(clusters_m * clusters_n, ctas)
        begin = gemm_configs.stream_k_begin(cta, shared, k_tiles, ctas)
        end = gemm_configs.stream_k_begin(cta + 1, shared, k_tiles, ctas)
        return whole, shared, begin, end

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
               mB: cute.Tensor, tma_d: cute.CopyAtom, mD: cute.Tensor,
               tiled_mma: cute.TiledMma, tiled_mma_zero: cute.TiledMma, a_smem: cute.ComposedLayout,
               b_smem: cute.ComposedLayout, d_smem: cute.ComposedLayout,
               clusters_m: Int32, clusters_n: Int32, epi_args, mP: cute.Tensor, mC: cute.Tensor):
        tidx, warp_idx = self._kernel_start(tma_a, tma_b, tma_d)
        if const_expr(self.second_kernel):
            # The reduction kernel after this one may launch now: its blocks wait in
            # griddepcontrol.wait until this grid is done, so no launch gap separates the two.
            cute.arch.griddepcontrol_launch_dependents()

        # CTA rank in the (cluster_m, 1) cluster == its M offset inside the cluster.
        cta_m = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        b_mcast_mask = cute.make_layout_image_mask(
            cute.make_layout((self.cluster_m, 1, 1)), (cta_m, 0, 0), mode=0)

        ab_pipeline, sA, sB, sD, sEpi, sFlag = self._allocate_shared(a_smem, b_smem, d_smem)
        # (bM, bK, RestM, RestK) / (bN, bK, RestN, RestK)
        gA = cute.local_tile(mA, (self.x_rows, self.tile_k), (None, None))
        gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (None, None))
        # The A box: the first x_rows rows of each stage (all of it unless x_rows is set).
        sA_box = sA if const_expr(self.x_rows == self.tile_m) else \
            cute.logical_divide(sA, (self.x_rows,))[((None, 0), None, None)]
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                           cute.group_modes(sA_box, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, cta_m, cute.make_layout(self.cluster_m),
                                           cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        k_tiles = cute.size(gA, mode=[3])
        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_m, 1))

        if cute.arch.make_warp_uniform(tidx // 128) == 0:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                units = clusters_m * clusters_n * self.split_k
                if const_expr(self.stream_k):
                    units, _, sk_begin, sk_end = self._stream_k_range(clusters_m, clusters_n, k_tiles)
                work = cute.arch.block_idx()[2]
                while work < units:
                    tile_m, tile_n, _, k_begin, k_count = self._work_unit(
                        work, clusters_m, clusters_n, cta_m, k_tiles)
                    state = self._load(ab_pipeline, state, tma_a, tma_b, tAgA[(None, tile_m, None)], tAsA,
                                       tBgB[(None, tile_n, None)], tBsB, b_mcast_mask, k_begin, k_count)
                    work += cute.arch.grid_dim()[2]
                if const_expr(self.stream_k):
                    # This CTA's share of the last wave: pieces of one or two tiles.
                    k = sk_begin
                    while k < sk_end:
                        tile = k // k_tiles
                        k_begin = k - tile * k_tiles
                        k_count = cutlass.min(k_tiles - k_begin, sk_end - k)
                        tile_m, tile_n = self._tile_coord(units + tile, clusters_m, clusters_n, cta_m)
                        state = self._load(ab_pipeline, state, tma_a, tma_b, tAgA[(None, tile_m, None)], tAsA,
                                           tBgB[(None, tile_n, None)], tBsB, b_mcast_mask, k_begin, k_count)
                        k += k_count
                ab_pipeline.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self._consume(ab_pipeline, tiled_mma, tiled_mma_zero, sA, sB, sD, sEpi, sFlag, tma_d, mD, k_tiles,
                          tidx - 128, warp_idx, cta_m, clusters_m, clusters_n, epi_args, mP, mC)

    @cute.jit
    def _kernel_start(self, tma_a: cute.CopyAtom, tma_b: cute.CopyAtom, tma_d: cute.CopyAtom):
        """(thread index, warp index); warp 0 prefetches the TMA descriptors."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_d)
        return tidx, warp_idx

    @cute.jit
    def _allocate_shared(self, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
                         d_smem: cute.ComposedLayout):
        """Kernel start: the shared storage, its A/B pipeline (initialized; the caller waits
        with pipeline_init_wait) and tensors: (ab_pipeline, sA, sB, sD, sEpi, sFlag)."""
        storage = SmemAllocator().allocate(self.shared_storage)
        # A consumer releases a stage to every CTA that multicasts into it: one arrive per
        # consumer warp of the stage's tile per CTA of the cluster.
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_mbar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.cluster_m * self.tile_wg * 4),
            tx_count=(self.x_rows * self.a_dtype.width + self.tile_n * self.b_dtype.width) * self.tile_k // 8,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, 1, 1)), defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sD = storage.sD.get_tensor(d_smem.outer, swizzle=d_smem.inner)
        sEpi = storage.sEpi.get_tensor(cute.make_layout(self.epi_words))
        sFlag = storage.last_flag.get_tensor(cute.make_layout(1))
        return ab_pipeline, sA, sB, sD, sEpi, sFlag

    @cute.jit
    def _load(self, ab_pipeline, state, tma_a, tma_b, tAgA_t, tAsA, tBgB_t, tBsB, b_mcast_mask,
              k_begin: Int32, k_count: Int32):
        """Producer: TMA loads of k-tiles [k_begin, k_begin + k_count) of one tile's A and B.
        Returns the advanced pipeline state: the caller assigns it, which is what makes the DSL
        carry it through the caller's own loops (a state only passed to a method is not)."""
        for k in cutlass.range(k_begin, k_begin + k_count, unroll=1):
            ab_pipeline.producer_acquire(state)
            bar = ab_pipeline.producer_get_barrier(state)
            cute.copy(tma_a, tAgA_t[(None, k)], tAsA[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_b, tBgB_t[(None, k)], tBsB[(None, state.index)], tma_bar_ptr=bar,
                      mcast_mask=b_mcast_mask if const_expr(self.cluster_m > 1) else 0)
            ab_pipeline.producer_commit(state)
            state.advance()
        return state

    @cute.jit
    def _mma_k_tile(self, ab_pipeline, read_state, first_mma, tiled_mma, tCrA, tCrB, acc):
        """Wait for one k-tile in shared memory and issue its wgmma (4 k-blocks, one group);
        the first k-block uses ``first_mma`` (accumulating or overwriting). The fence orders
        earlier register accesses to the accumulators (zeroing, promotion adds) before them."""
        ab_pipeline.consumer_wait(read_state)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            cute.gemm(first_mma if const_expr(kb == 0) else tiled_mma, acc,
                      tCrA[(None, None, kb, read_state.index)], tCrB[(None, None, kb, read_state.index)], acc)
        warpgroup.commit_group()

    @cute.jit
    def _mainloop(self, ab_pipeline, read_state, release_state, tiled_mma, tCrA, tCrB, acc, k_tiles: Int32,
                  issued_barrier=None):
        """Sum k_tiles k-tiles into acc (from zero): one k-tile of wgmma stays in flight; a stage
        is released once the wgmma that read it has retired (wait_group(1) after the next commit).
        ``issued_barrier`` (ping-pong): the named barrier to arrive on once every k-tile has been
        waited for and issued, the other group's turn. Returns the advanced pipeline states (see
        _load: the caller must assign them)."""
        acc.fill(0.0)
        prologue = cutlass.min(k_tiles, 1)
        for k in cutlass.range(prologue, unroll=1):
            self._mma_k_tile(ab_pipeline, read_state, tiled_mma, tiled_mma, tCrA, tCrB, acc)
            read_state.advance()
        for k in cutlass.range(prologue, k_tiles, unroll=1):
            self._mma_k_tile(ab_pipeline, read_state, tiled_mma, tiled_mma, tCrA, tCrB, acc)
            read_state.advance()
            warpgroup.wait_group(1)
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
        if const_expr(issued_barrier is not None):
            cute.arch.barrier_arrive(barrier_id=issued_barrier, number_of_threads=2 * self.tile_threads)
        warpgroup.wait_group(0)
        for k in cutlass.range(prologue, unroll=1):
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
        return read_state, release_state

    @cute.jit
    def _promoted_chunk(self, ab_pipeline, read_state, release_state, tiled_mma, tiled_mma_zero, tCrA, tCrB,
                        acc, acc_tmp, count: Int32):
        """FP8 promotion: sum the next ``count`` (>= 1) k-tiles into acc_tmp from zero, wait for
        them to retire and add acc_tmp into acc. Returns the advanced pipeline states."""
        self._mma_k_tile(ab_pipeline, read_state, tiled_mma_zero, tiled_mma, tCrA, tCrB, acc_tmp)
        read_state.advance()
        for k in cutlass.range(1, count, unroll=1):
            self._mma_k_tile(ab_pipeline, read_state, tiled_mma, tiled_mma, tCrA, tCrB, acc_tmp)
            read_state.advance()
            warpgroup.wait_group(1)
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
        warpgroup.wait_group(0)
        ab_pipeline.consumer_release(release_state)
        release_state.advance()
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = acc[i] + acc_tmp[i]
        return read_state, release_state

    @cute.jit
    def _consume(self, ab_pipeline, tiled_mma, tiled_mma_zero, sA, sB, sD, sEpi, sFlag, tma_d, mD, all_k_tiles,
                 mma_tidx, warp_idx, cta_m, clusters_m, clusters_n, epi_args, mP, mC):
        """Consumer warpgroups: for each tile, the wgmma mainloop and then the epilogue. Under
        ping-pong each warpgroup takes every other tile of the CTA's sequence and steps its
        pipeline states over the k-tiles of the other's tiles."""
        c, read_state, release_state = self._consumer_setup(tiled_mma, tiled_mma_zero, sA, sB, sD, mma_tidx)
        tiles_done = Int32(0)
        units = clusters_m * clusters_n * self.split_k
        if const_expr(self.stream_k):
            units, _, sk_begin, sk_end = self._stream_k_range(clusters_m, clusters_n, all_k_tiles)
        work = cute.arch.block_idx()[2] + c.group * cute.arch.grid_dim()[2]
        if const_expr(self.pingpong):
            # Group 1 starts at the CTA's second tile: past the first one's k-tiles.
            skip = c.group * all_k_tiles
            read_state.advance(skip)
            release_state.advance(skip)
            if c.group == 0:  # group 0's first mainloop waits for no one
                cute.arch.barrier_arrive(barrier_id=_MMA_ORDER_BARRIER, number_of_threads=2 * self.tile_threads)
        while work < units:
            tile_m, tile_n, split, _, k_tiles = self._work_unit(work, clusters_m, clusters_n, cta_m,
                                                                all_k_tiles)
            if const_expr(self.epilogue is not None):
                self.epilogue.prefetch(c.epi_regs, epi_args, tile_m * self.tile_m,
                                       tile_n * self.tile_n, c.tidx)
            if const_expr(self.pingpong):  # the other group has issued its mainloop
                cute.arch.barrier(barrier_id=_MMA_ORDER_BARRIER + c.group, number_of_threads=2 * self.tile_threads)
            read_state, release_state = self._accumulate_tile(ab_pipeline, read_state, release_state, tiled_mma,
                                                              tiled_mma_zero, c, k_tiles, mma_tidx)
            if const_expr(self.pingpong):
                # The other group's next tile (unsplit: every tile has all_k_tiles k-tiles).
                read_state.advance(all_k_tiles)
                release_state.advance(all_k_tiles)
            # An unsplit tile is complete here; a split one once its last unit has added the
            # others' sums (then acc holds the whole tile).
            complete = True
            if const_expr(self.split_k > 1 and not self.fix_up_in_place):
                # ---- 64-row split-K: fp32 sums straight to this split's partials block.
                self._store_partials(c.acc, c.thr_mma, mP, mD.shape[0], mD.shape[1],
                                     tile_m * self.tile_m, tile_n * self.tile_n, split)
                complete = False
            if const_expr(self.fix_up_in_place):
                complete = self._fix_up(c.acc, c.thr_mma, mma_tidx, mP, mC, sFlag, mD.shape[0], tile_m,
                                        work - split * clusters_m * clusters_n, split)
            if complete:
                self._stage_epilogue(c, sEpi)
                self._store_tile(c, tma_d, sD, sEpi,
                                 cute.local_tile(mD, (self.tile_m, self.tile_n), (tile_m, tile_n)),
                                 tiles_done, warp_idx)
                tiles_done += 1
            work += cute.arch.grid_dim()[2] * self.tile_groups
        if const_expr(self.stream_k):
            # This CTA's share of the last wave: the sums of its pieces (one or two tiles) go to
            # its partials slots, piece by piece; reduce_stream_k adds them up.
            k = sk_begin
            piece = Int32(0)
            slot0 = (cute.arch.block_idx()[2] * gemm_configs.STREAM_K_PIECES) * self.cluster_m + cta_m
            while k < sk_end:
                tile = k // all_k_tiles
                k_count = cutlass.min(all_k_tiles - (k - tile * all_k_tiles), sk_end - k)
                read_state, release_state = self._mainloop(ab_pipeline, read_state, release_state, tiled_mma,
                                                           c.tCrA, c.tCrB, c.acc, k_count)
                self._store_tile_partials(c.acc, mma_tidx, mP, slot0 + piece * self.cluster_m)
                k += k_count
                piece += 1
        c.store_pipeline.producer_tail()

    @cute.jit
    def _consumer_setup(self, tiled_mma, tiled_mma_zero, sA, sB, sD, mma_tidx):
        """A consumer thread's loop-invariant state (its MMA fragments and accumulators, the
        epilogue's register -> shared copy and TMA store pipeline, the hook's registers, its
        tile group: see _group_setup) as one object ``c``, and the A/B pipeline's read and
        release states."""
        c = _ConsumerState()
        self._group_setup(c, mma_tidx)
        mma_tidx = c.tidx
        c.thr_mma = tiled_mma.get_slice(mma_tidx)
        c.tCrA = tiled_mma.make_fragment_A(c.thr_mma.partition_A(sA))
        c.tCrB = tiled_mma.make_fragment_B(c.thr_mma.partition_B(sB))
        acc_shape = c.thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))).shape
        c.acc = cute.make_rmem_tensor(acc_shape, Float32)
        c.acc_tmp = cute.make_rmem_tensor(acc_shape, Float32) if const_expr(self.promote_every) else None
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        tiled_mma_zero.set(warpgroup.Field.ACCUMULATE, False)

        # Register -> shared copy of the epilogue (stmatrix), partitioned like the MMA's C.
        # (transposing under swap_ab: D^T is M-major)
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.swap_ab, 4), self.d_dtype)
        c.tiled_r2s = cute.make_tiled_copy_S(
            sm90_utils.get_smem_store_op(self.d_layout, self.d_dtype, Float32),
            cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))
        c.thr_r2s = c.tiled_r2s.get_slice(mma_tidx)
        c.tRS_sD = c.thr_r2s.partition_D(sD)  # (R2S, R2S_M, R2S_N, EPI_STAGE)
        sub_layout = cute.make_layout(cute.shape(c.thr_r2s.partition_S(sD))[:3])
        c.sub_size = cute.size(sub_layout)
        c.sub_order = epilogue_order(tiled_mma, c.tiled_r2s, (self.tile_m, self.tile_n), self.epi_tile)
        c.tRS_sub = cute.make_rmem_tensor(sub_layout.shape, Float32)
        c.tRS_out = cute.make_rmem_tensor(sub_layout.shape, self.d_dtype)
        c.cTile = cute.make_identity_tensor((self.tile_m, self.tile_n))  # tile-local (m, n)
        c.store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.tile_threads))
        c.epi_regs = None
        if const_expr(self.epilogue is not None):
            c.epi_regs = cute.make_rmem_tensor(self.epilogue.num_regs, Float32)

        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        return c, read_state, release_state

    @cute.jit
    def _group_setup(self, c, mma_tidx):
        """The consumer thread's tile group (c.group: 0, or its warpgroup under ping-pong) and
        what belongs to the group: c.tidx (the thread's index among the tile's consumer
        threads), c.epi_barrier (those threads' barrier), c.store_warp (the warp that issues
        the group's TMA stores) and c.first_buf (its first store buffer)."""
        c.group = Int32(0)
        c.tidx = mma_tidx
        c.epi_barrier = self.epi_barrier
        c.issued_barrier = None
        if const_expr(self.pingpong):
            c.group = cute.arch.make_warp_uniform(mma_tidx // self.tile_threads)
            c.tidx = mma_tidx - c.group * self.tile_threads
            c.epi_barrier = pipeline.NamedBarrier(barrier_id=_EPI_GROUP_BARRIER + c.group,
                                                  num_threads=self.tile_threads)
            # The groups issue their mainloops in turn. A group's pipeline states step over the
            # other's tiles, and an mbarrier's parity wait tells only one phase from the next:
            # waiting for a stage more than one ring of stages ahead (a tile of more k-tiles
            # than stages) would pass on an earlier phase and read the other group's k-tiles.
            # So group g waits on barrier _MMA_ORDER_BARRIER + g until the other has waited for
            # (and issued) every k-tile of its tile, then runs its own, and arrives on the
            # other's (CUTLASS's ordered math warpgroups).
            c.issued_barrier = _MMA_ORDER_BARRIER + 1 - c.group
        c.store_warp = 4 + c.group * (self.tile_threads // 32)  # warps 0-3: the producer warpgroup
        c.first_buf = c.group * self.epi_stages

    @cute.jit
    def _group_epi_smem(self, c, sEpi):
        """The tile group's share of the epilogue hook's words."""
        if const_expr(self.tile_groups == 1):
            return sEpi
        return cute.make_tensor(sEpi.iterator + c.group * self.epi_group_words,
                                cute.make_layout(self.epi_group_words))

    @cute.jit
    def _accumulate_tile(self, ab_pipeline, read_state, release_state, tiled_mma, tiled_mma_zero, c,
                         k_tiles: Int32, mma_tidx):
        """The mainloop of one tile: c.acc = the sum of its k_tiles k-tiles, with FP8 promotion
        when configured. Returns the advanced pipeline states (see _load)."""
        if const_expr(self.promote_every == 0):
            read_state, release_state = self._mainloop(ab_pipeline, read_state, release_state, tiled_mma,
                                                       c.tCrA, c.tCrB, c.acc, k_tiles, c.issued_barrier)
        else:
            # Chunks of promote_every k-tiles: the wgmma sum of a chunk starts from zero
            # (scale-d = 0) in acc_tmp and is added into the fp32 acc once it has retired.
            # That add waits for every wgmma of the warpgroup to retire; the warpgroups
            # promote at different k-tiles (the second one's first chunk is shorter), so
            # the other's wgmma keep the tensor cores busy meanwhile.
            c.acc.fill(0.0)
            wg = cute.arch.make_warp_uniform(mma_tidx // 128)
            head = cutlass.min(wg * (self.promote_every // self.num_mma_wg), k_tiles)
            for _ in cutlass.range(cutlass.min(head, 1), unroll=1):
                read_state, release_state = self._promoted_chunk(
                    ab_pipeline, read_state, release_state, tiled_mma, tiled_mma_zero, c.tCrA, c.tCrB,
                    c.acc, c.acc_tmp, head)
            for k0 in cutlass.range(head, k_tiles, self.promote_every, unroll=1):
                read_state, release_state = self._promoted_chunk(
                    ab_pipeline, read_state, release_state, tiled_mma, tiled_mma_zero, c.tCrA, c.tCrB,
                    c.acc, c.acc_tmp, cutlass.min(self.promote_every, k_tiles - k0))
        return read_state, release_state

    @cute.jit
    def _stage_epilogue(self, c, sEpi):
        """After the mainloop: the hook moves its tile data to shared memory (then a barrier)."""
        if const_expr(self.epilogue is not None):
            self.epilogue.stage(c.epi_regs, self._group_epi_smem(c, sEpi), c.tidx)
            c.epi_barrier.arrive_and_wait()

    @cute.jit
    def _store_tile(self, c, tma_d, sD, sEpi, gD_tile, tiles_done: Int32, warp_idx):
        """Epilogue of one tile: c.acc in (tile_m x 32) sub-tiles through the hook, shared memory
        and TMA stores into ``gD_tile`` (the tile's tile_m x tile_n view of the TMA tensor of D,
        whose bounds clip the stores). ``tiles_done``: tiles this tile group stored before (it
        picks the store buffers)."""
        gD_sub = cute.zipped_divide(gD_tile, self.epi_tile)
        bSG_sD, bSG_gD = cpasync.tma_partition(tma_d, 0, cute.make_layout(1),
                                               cute.group_modes(sD, 0, 2), gD_sub)
        num_sub = self.tile_n // self.epi_n
        store_pipeline = c.store_pipeline  # a local: the DSL refuses attribute calls inside a dynamic if
        epi_barrier = c.epi_barrier
        epi_smem = self._group_epi_smem(c, sEpi)
        for j in cutlass.range_constexpr(num_sub):
            for v in cutlass.range_constexpr(c.sub_size):
                c.tRS_sub[v] = c.acc[c.sub_order[j][v]]
            if const_expr(self.epilogue is not None):
                # partition_S: the coordinates of the values this thread holds.
                coords = c.thr_r2s.partition_S(cute.local_tile(c.cTile, self.epi_tile, (0, j)))
                self.epilogue.apply(c.tRS_sub, coords, epi_smem)
            c.tRS_out.store(c.tRS_sub.load().to(self.d_dtype))
            buf = c.first_buf + (tiles_done * num_sub + j) % self.epi_stages
            cute.copy(c.tiled_r2s, c.tRS_out, c.tRS_sD[(None, None, None, buf)])
            # Generic-proxy smem writes must be visible to the TMA (async proxy).
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_barrier.arrive_and_wait()
            if warp_idx == c.store_warp:  # the group's first warp issues the store
                cute.copy(tma_d, bSG_sD[(None, buf)], bSG_gD[(None, (0, j))])
                store_pipeline.producer_commit()
                store_pipeline.producer_acquire()  # the next buffer's old store has read it
            epi_barrier.arrive_and_wait()

    @cute.jit
    def _store_partials(self, acc, thr_mma, mP, m_size, n_size, m0, n0, split):
        """Split-K: this thread's fp32 sums to partials[split, m, n] for m < M, n < N. Decode
        tiles are mostly rows past M, which store nothing; the stores are a sliver of the
        weight bytes the unit streams."""
        coords = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        base = split * m_size
        for i in cutlass.range_constexpr(cute.size(acc)):
            m, n = coords[i]
            if m0 + m < m_size and n0 + n < n_size:
                mP[(base + m0 + m) * n_size + n0 + n] = acc[i]

    @cute.jit
    def _fix_up(self, acc, thr_mma, mma_tidx, mP, mC, sFlag, m_size, tile_m, tile, split):
        """Split-K: store this unit's sums in its slot of the tile, count the unit in the tile's
        counter and, if it is the last of the tile's split_k units, sum every slot of the tile
        into acc in split order (deterministic) and reset the counter. Returns whether acc now
        holds the whole tile. A thread none of whose rows is < M (most of a decode tile) neither
        stores nor reads; the others move all their values unpredicated (a slot is a whole tile,
        so every address is inside the buffer; values past M or N are never stored to D), so
        the loads go out back to back instead of one predicated load waiting for the last."""
        coords = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        low = coords[0][0]  # this thread's first row in the tile (wgmma: rows r and r + 8)
        for i in cutlass.range_constexpr(1, cute.size(acc)):
            low = cutlass.min(low, coords[i][0])
        has_rows = tile_m * self.tile_m + low < m_size
        slot_size = self.tile_m * self.tile_n
        # Register order: value i of thread t at i * threads + t (a warp's store is 128
        # contiguous bytes); the last unit reads it back in the same order.
        if has_rows:
            base = (tile * self.split_k + split) * slot_size + mma_tidx
            for i in cutlass.range_constexpr(cute.size(acc)):
                mP[base + i * self.num_mma_threads] = acc[i]
        # Release: every thread's stores are visible GPU-wide before the count that announces
        # them; the acq_rel add orders the last unit's reads after all the others' stores.
        cute.arch.fence_acq_rel_gpu()
        self.epi_barrier.arrive_and_wait()
        if mma_tidx == 0:
            counter = (mC.iterator + tile).llvm_ptr
            arrived = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
            if arrived == self.split_k - 1:  # the last unit: no other unit of this tile remains
                cute.arch.store(counter, Int32(0), sem="relaxed", scope="gpu")
            sFlag[0] = arrived
        self.epi_barrier.arrive_and_wait()
        last = sFlag[0] == self.split_k - 1
        if last:
            cute.arch.fence_acq_rel_gpu()
            if has_rows:
                acc.fill(0.0)
                first = tile * self.split_k * slot_size + mma_tidx
                for s in cutlass.range(self.split_k, unroll=1):
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        acc[i] = acc[i] + mP[first + s * slot_size + i * self.num_mma_threads]
        return last

    @cute.jit
    def _store_tile_partials(self, acc, mma_tidx, mP, slot):
        """Stream-K: this thread's fp32 sums to partials slot ``slot`` in register order: value i
        of thread t at i * threads + t, so each store instruction of a warp writes 128
        contiguous bytes. reduce_stream_k reads them back in the same order."""
        base = slot * (self.tile_m * self.tile_n) + mma_tidx
        for i in cutlass.range_constexpr(cute.size(acc)):
            mP[base + i * self.num_mma_threads] = acc[i]

    @cute.kernel
    def reduce_stream_k(self, tiled_mma: cute.TiledMma, mP: cute.Tensor, mD: cute.Tensor, clusters_m: Int32,
                        clusters_n: Int32, k_tiles: Int32):
        """Stream-K: D of each shared tile = the sum of its pieces, CTA by CTA in order. Block b
        takes shared tile b // cluster_m (CTA b % cluster_m of the cluster); thread t adds the
        values consumer thread t stored (_store_tile_partials) and writes them where the MMA's
        accumulator layout puts them."""
        cute.arch.griddepcontrol_wait()  # the GEMM's partials are complete and visible
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        ctas = NUM_SMS // self.cluster_m
        whole, shared = gemm_configs.stream_k_tiles(clusters_m * clusters_n, ctas)
        if bidx < shared * self.cluster_m:
            tile = bidx // self.cluster_m
            cta_m = bidx - tile * self.cluster_m
            tile_m, tile_n = self._tile_coord(whole + tile, clusters_m, clusters_n, cta_m)
            coords = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
            acc = cute.make_rmem_tensor(coords.shape, Float32)
            acc.fill(0.0)
            first = gemm_configs.stream_k_first_cta(tile * k_tiles, shared, k_tiles, ctas)
            last = gemm_configs.stream_k_first_cta(tile * k_tiles + k_tiles - 1, shared, k_tiles, ctas)
            for cta in cutlass.range(first, last + 1, unroll=1):
                begin = gemm_configs.stream_k_begin(cta, shared, k_tiles, ctas)
                # A CTA with an empty range (fewer shared k-tiles than CTAs) stored nothing.
                for _ in cutlass.range(cutlass.min(gemm_configs.stream_k_begin(cta + 1, shared, k_tiles, ctas)
                                                   - begin, 1), unroll=1):
                    piece = tile - begin // k_tiles  # 0: the range starts in this tile
                    slot = (cta * gemm_configs.STREAM_K_PIECES + piece) * self.cluster_m + cta_m
                    base = slot * (self.tile_m * self.tile_n) + tidx
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        acc[i] = acc[i] + mP[base + i * self.num_mma_threads]
            m_size, n_size = mD.shape
            for i in cutlass.range_constexpr(cute.size(acc)):
                m, n = coords[i]
                gm, gn = tile_m * self.tile_m + m, tile_n * self.tile_n + n
                if gm < m_size and gn < n_size:
                    mD[gm, gn] = acc[i].to(self.d_dtype)

    @cute.kernel
    def reduce_partials(self, mP: cute.Tensor, mD: cute.Tensor):
        """Split-K: D[m, n] = sum over splits of partials[s, m, n], in split order, four columns
        per thread (N is a multiple of 8, so every vector is 16-byte aligned in mP)."""
        cute.arch.griddepcontrol_wait()  # the GEMM's partials are complete and visible
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        m_size, n_size = mD.shape
        nvec = n_size // 4
        i = bidx * _REDUCE_THREADS + tidx
        if i < m_size * nvec:
            m = i // nvec
            v = i - m * nvec
            p_vecs = cute.zipped_divide(mP, (4,))
            acc = cute.make_rmem_tensor((4,), Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor((4,), Float32)
            for s in cutlass.range_constexpr(self.split_k):
                cute.autovec_copy(p_vecs[None, (s * m_size + m) * nvec + v], part)
                acc.store(acc.load() + part.load())
            out = cute.make_rmem_tensor((4,), self.d_dtype)
            out.store(acc.load().to(self.d_dtype))
            cute.autovec_copy(out, cute.zipped_divide(mD[m, None], (4,))[None, v])
