"""Hopper (sm_90a) attention forward: FlashAttention's FA3-recipe CuTe DSL kernel as one of our
kernel classes.

The device code is FlashAttention-4's ``FlashAttentionForwardSm90`` (the ``flash-attn-4`` package,
``flash_attn/cute/flash_fwd_sm90.py``; BSD-3-Clause, Copyright (c) 2025 Jay Shah, Ganesh
Bikshandi, Ying Zhang, Vijay Thakkar, Pradeep Ramani, Tri Dao), used as a library:
  * one producer warp issues TMA loads of Q and of K / V blocks into a ring of shared-memory
    stages (mbarrier pipelines);
  * tile_m // 64 consumer warpgroups (setmaxnreg: 240 registers each) run the QK^T and PV wgmma,
    and with ``overlap`` each warpgroup issues the next block's QK^T before the softmax of the
    current one (intra-warpgroup overlap) while a named-barrier schedule alternates the two
    warpgroups' GEMMs (ping-pong);
  * blocks wholly outside a causal / local mask are never loaded; only the blocks that cross its
    diagonal are masked element-wise; causal grids walk the longest tiles first (LPT order);
  * packed sequences: tiles are mapped to sequences by the device-side offsets.
What this module adds is the part FA4 leaves to its Python interface: dynamic sizes (one compiled
kernel serves every batch, length and head count), our calling convention, and GQA by a run-time
head ratio: FA4 specialises a kernel on Hq // Hkv (its packed-GQA layout, made for decode); here
query head h reads key/value head h // (Hq // Hkv), computed on the device from the two tensors'
head counts, so one kernel serves MHA, every GQA ratio and MQA. ``_RuntimeGqaForward.load`` is FA4's
producer (``FlashAttentionForwardSm90.load``) reduced to the TMA, non-paged, dense path with that
one change. And a persistent schedule, which FA4 does not run on Hopper: a grid of at most one
CTA per SM walks the (m block, head, batch) tiles in FA4's L2-swizzled order, longest first
(LPT) when causal, so that one tile's epilogue overlaps the next tile's K / V loads and no SM
idles in a last partial wave. FA4 stores O through the shared memory of Q, which it releases
before the epilogue: a persistent CTA must not load the next Q until that store has read it,
so the epilogue's storing warp signals a named barrier the producer waits on (``_Q_FREE``).

FA4's modules are imported without running the ``quack`` and ``flash_attn.cute`` package
initialisers, which load FA4's whole Python interface and quack's Triton-based autotuner: neither
is needed to build this kernel, and a compile machine need not have Triton.
"""
import importlib.util
import sys
import types

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from mslk_dsl.errors import ConfigError, TemplateImportError


def _import_without_initialiser(package: str) -> None:
    """Make ``package``'s submodules importable without executing its ``__init__``."""
    if package in sys.modules:
        return
    spec = importlib.util.find_spec(package)
    if spec is None or spec.submodule_search_locations is None:
        raise TemplateImportError(f"the attention kernels need the package {package!r} (pip install flash-attn-4)")
    module = types.ModuleType(package)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    sys.modules[package] = module


_import_without_initialiser("quack")
_import_without_initialiser("flash_attn.cute")
import quack.dsl  # noqa: E402,F401  (CuTe tensor-indexing sugar that FA4's device code uses)
from flash_attn.cute.flash_fwd import FlashAttentionForwardBase  # noqa: E402
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90  # noqa: E402
from flash_attn.cute.named_barrier import NamedBarrierFwd  # noqa: E402
from flash_attn.cute.tile_scheduler import (  # noqa: E402
    SingleTileLPTScheduler, SingleTileScheduler, SingleTileVarlenScheduler, TileSchedulerArguments)
from flash_attn.cute.cute_dsl_utils import assume_tensor_aligned  # noqa: E402
from flash_attn.cute import utils as fa_utils  # noqa: E402
from flash_attn.cute.utils import AuxData  # noqa: E402
from quack import copy_utils, layout_utils  # noqa: E402
from quack import sm90_utils  # noqa: E402
from cutlass import pipeline  # noqa: E402
from cutlass.cute.nvgpu import cpasync  # noqa: E402
from cutlass.utils import LayoutEnum  # noqa: E402

# Consumer threads (tile_m // 64 warpgroups) plus one producer warpgroup.
THREADS_PER_WARPGROUP = 128


def block_threads(tile_m: int) -> int:
    return (tile_m // 64 + 1) * THREADS_PER_WARPGROUP


# Named barrier (after FA4's, NamedBarrierFwd) between the epilogue's storing warp and the
# producer warp: "the O store has read shared memory, Q may be loaded over it".
_Q_FREE = max(int(b) for b in NamedBarrierFwd) + 1
_Q_FREE_THREADS = 2 * cute.arch.WARP_SIZE


class _PersistentTileScheduler(SingleTileLPTScheduler):
    """FA4's static tile order (L2-swizzled heads, m blocks reversed when ``lpt``) walked by a
    persistent grid: CTA c takes tiles c, c + grid, c + 2 grid, ... (FA4's own class takes one
    tile per CTA)."""

    @staticmethod
    def create(params, ctx=None, *, loc=None, ip=None):
        return _PersistentTileScheduler(params, cute.arch.block_idx()[0], Int32(0), loc=loc, ip=ip)

    def advance_to_next_work(self, *, loc=None, ip=None):
        self._tile_idx += cute.arch.grid_dim()[0]
        return self.get_current_work()


class _RuntimeGqaForward(FlashAttentionForwardSm90):
    """FA4's Hopper forward with the key/value head of a query head computed at run time, and
    optionally a persistent grid (see the module's docstring)."""

    def __init__(self, *args, persistent: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.persistent = persistent

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 softmax_scale: Float32, mCuSeqlensQ, mCuSeqlensK, window_size_left, window_size_right,
                 max_ctas: Int32, stream):
        """FA4's ``FlashAttentionForwardSm90.__call__`` reduced to this module's calls (TMA loads
        and store, no paged KV, packed GQA, sink, score mod or block sparsity), with the tile
        scheduler chosen here: persistent, FA4's longest-first one for causal / local, or one
        tile per CTA. The offsets are None for dense calls, the window bounds None unless local."""
        self._check_type(*(t.element_type if t is not None else None
                           for t in (mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, None, None)))
        self.varlen_q = mCuSeqlensQ is not None
        mQ, mK, mV, mO = [assume_tensor_aligned(t) for t in (mQ, mK, mV, mO)]
        # To FA4's (rows, d, heads[, batch]) views.
        QO_layout_transpose = [1, 3, 2, 0] if const_expr(mCuSeqlensQ is None) else [0, 2, 1]
        mQ, mO = [layout_utils.select(t, QO_layout_transpose) for t in (mQ, mO)]
        KV_layout_transpose = [1, 3, 2, 0] if const_expr(mCuSeqlensK is None) else [0, 2, 1]
        mK, mV = [layout_utils.select(t, KV_layout_transpose) for t in (mK, mV)]
        mLSE = layout_utils.select(mLSE, [2, 1, 0] if const_expr(mCuSeqlensQ is None) else [1, 0])

        tiled_mma_qk, tiled_mma_pv = self._get_tiled_mma()
        self.num_mma_threads = tiled_mma_qk.size
        self.num_threads_per_warp_group = THREADS_PER_WARPGROUP
        self.num_wg_mma = self.num_mma_threads // self.num_threads_per_warp_group
        if const_expr(self.num_wg_mma not in (1, 2, 3)):   # tile_m 64, 128 or 192
            raise ConfigError(f"attention_fwd_cute: tile_m {self.tile_m} gives {self.num_wg_mma} MMA "
                              "warpgroups; the kernel runs 1, 2 or 3 (tile_m 64, 128 or 192)")
        self.num_threads = self.num_threads_per_warp_group * (self.num_wg_mma + 1)
        self.num_producer_threads = cute.arch.WARP_SIZE
        self.num_Q_load_threads = self.num_threads_per_warp_group
        self.num_epilogue_threads = self.num_mma_threads
        self.num_mma_regs, self.num_producer_regs = {1: (256, 56), 2: (240, 24), 3: (160, 32)}[self.num_wg_mma]
        self.use_block_sparsity = False
        self.use_scheduler_barrier = ((self.num_wg_mma >= 2 and self.tile_hdim <= 128)
                                      if const_expr(self.intra_wg_overlap) else (self.num_wg_mma == 2))
        self.use_tma_Q = True
        self.use_tma_O = True
        self.rescale_O_before_gemm = self.tile_hdimv > 128 and self.intra_wg_overlap
        self._setup_attributes()
        self.sQ_layout, self.sK_layout, self.sV_layout, self.sO_layout = [
            sm90_utils.make_smem_layout(mX.element_type, LayoutEnum.ROW_MAJOR, shape, stage)
            for mX, shape, stage in [(mQ, (self.tile_m, self.tile_hdim), None),
                                     (mK, (self.tile_n, self.tile_hdim), self.num_stages),
                                     (mV, (self.tile_n, self.tile_hdimv), self.num_stages),
                                     (mO, (self.tile_m, self.tile_hdimv), None)]]
        self.sP_layout = None
        if const_expr(not self.mma_pv_is_rs):
            self.sP_layout = sm90_utils.make_smem_layout(mV.element_type, LayoutEnum.ROW_MAJOR,
                                                         (self.tile_m, self.tile_n))
        SharedStorage = self._get_shared_storage_cls()

        self.tma_copy_bytes = {
            name: cute.size_in_bytes(mX.element_type, cute.select(layout, mode=[0, 1]))
            for name, mX, layout in [("Q", mQ, self.sQ_layout), ("K", mK, self.sK_layout),
                                     ("V", mV, self.sV_layout)]}
        tma_atom_Q, tma_tensor_Q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, self.sQ_layout, (self.tile_m, self.tile_hdim))
        tma_atom_K, tma_tensor_K = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.select(self.sK_layout, mode=[0, 1]),
            (self.tile_n, self.tile_hdim), 1)
        tma_atom_V, tma_tensor_V = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mV, cute.select(self.sV_layout, mode=[0, 1]),
            (self.tile_n, self.tile_hdimv), 1)
        mO_tma = mO
        if const_expr(self.varlen_q):
            mO_tma = copy_utils.create_ragged_tensor_for_tma(mO_tma, ragged_dim=0, ptr_shift=True)
        tma_atom_O, tma_tensor_O = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO_tma, self.sO_layout, (self.tile_m, self.tile_hdimv))

        masked = self.is_causal or self.is_local
        if const_expr(mCuSeqlensQ is not None):
            TileScheduler = SingleTileVarlenScheduler
        elif const_expr(self.persistent):
            TileScheduler = _PersistentTileScheduler
        elif const_expr(masked):
            TileScheduler = SingleTileLPTScheduler
        else:
            TileScheduler = SingleTileScheduler
        num_block = cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m)
        num_batch = cute.size(mQ.shape[3]) if const_expr(mCuSeqlensQ is None) else cute.size(mCuSeqlensQ.shape[0] - 1)
        tile_sched_args = TileSchedulerArguments(
            num_block, cute.size(mQ.shape[2]), num_batch, 1, cute.size(mK.shape[0]), mQ.shape[1], mV.shape[1],
            total_q=cute.size(mQ.shape[0]) if const_expr(mCuSeqlensQ is not None)
            else cute.size(mQ.shape[0]) * cute.size(mQ.shape[3]),
            tile_shape_mn=(self.tile_m, self.tile_n), mCuSeqlensQ=mCuSeqlensQ, mSeqUsedQ=None,
            qhead_per_kvhead_packgqa=1, element_size=self.dtype.width // 8, is_persistent=self.persistent,
            lpt=masked)
        tile_sched_params = TileScheduler.to_underlying_arguments(tile_sched_args)
        if const_expr(self.persistent):
            grid_dim = (cutlass.min(num_block * cute.size(mQ.shape[2]) * num_batch, max_ctas), Int32(1), Int32(1))
        else:
            grid_dim = TileScheduler.get_grid_shape(tile_sched_params)
        softmax_scale_log2, softmax_scale = fa_utils.compute_softmax_scale_log2(softmax_scale, self.score_mod)
        window_size_left = Int32(window_size_left) if window_size_left is not None else None
        window_size_right = Int32(window_size_right) if window_size_right is not None else None
        fastdiv_mods = fa_utils.compute_fastdiv_mods(mQ, mK, self.qhead_per_kvhead, self.pack_gqa, None, None)
        self.kernel(
            tma_tensor_Q, tma_tensor_K, tma_tensor_V, tma_tensor_O, mLSE, mCuSeqlensQ, mCuSeqlensK, None, None,
            None, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O, softmax_scale_log2, softmax_scale,
            window_size_left, window_size_right, None, None, self.sQ_layout, self.sK_layout, self.sV_layout,
            self.sO_layout, self.sP_layout, self.gmem_tiled_copy_Q, self.gmem_tiled_copy_K, self.gmem_tiled_copy_V,
            self.gmem_tiled_copy_O, tiled_mma_qk, tiled_mma_pv, tile_sched_params, TileScheduler, SharedStorage,
            AuxData(), fastdiv_mods,
        ).launch(grid=grid_dim, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.jit
    def epilogue(self, acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O, tiled_mma, tidx, m_block,
                 head_idx, batch_idx):
        FlashAttentionForwardBase.epilogue(self, acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O,
                                           tiled_mma, tidx, m_block, head_idx, batch_idx)
        if const_expr(self.persistent):
            # Warp 4 issued the TMA store of O and waited until it read sO (= sQ).
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 4:
                cute.arch.barrier_arrive(barrier_id=_Q_FREE, number_of_threads=_Q_FREE_THREADS)

    @cute.jit
    def load(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor,
             sV: cute.Tensor, tma_atom_Q, tma_atom_K, tma_atom_V, pipeline_k: pipeline.PipelineAsync,
             pipeline_v: pipeline.PipelineAsync, pipeline_q: pipeline.PipelineAsync, gmem_tiled_copy_Q,
             mPageTable, blocksparse_tensors, block_info, SeqlenInfoCls, TileSchedulerCls):
        warp_idx_in_wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4
        # Query heads per key/value head; mQ / mK are (rows, d, heads[, batch]).
        q_per_kv = cute.size(mQ.shape[2]) // cute.size(mK.shape[2])
        if warp_idx_in_wg == 0:
            q_producer_phase = Int32(1)
            kv_producer_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
            tile_scheduler = TileSchedulerCls()
            work_tile = tile_scheduler.initial_work_tile_info()
            tiles_done = Int32(0)
            while work_tile.is_valid_tile:
                m_block, head_idx, batch_idx, _ = work_tile.tile_idx
                seqlen = SeqlenInfoCls(batch_idx)
                mQ_cur = seqlen.offset_batch_Q(mQ, batch_idx, dim=3)[None, None, head_idx]
                head_idx_kv = head_idx // q_per_kv
                gQ = cute.local_tile(mQ_cur, (self.tile_m, self.tile_hdim), (m_block, 0))
                load_Q, _, _ = copy_utils.tma_get_copy_fn(tma_atom_Q, 0, cute.make_layout(1), gQ, sQ,
                                                          single_stage=True)
                mK_cur = seqlen.offset_batch_K(mK, batch_idx, dim=3)[None, None, head_idx_kv]
                mV_cur = seqlen.offset_batch_K(mV, batch_idx, dim=3)[None, None, head_idx_kv]
                gK = cute.local_tile(mK_cur, (self.tile_n, self.tile_hdim), (None, 0))
                gV = cute.local_tile(mV_cur, (self.tile_n, self.tile_hdimv), (None, 0))
                load_K, _, _ = copy_utils.tma_get_copy_fn(tma_atom_K, 0, cute.make_layout(1), gK, sK)
                load_K = copy_utils.tma_producer_copy_fn(load_K, pipeline_k)
                load_V, _, _ = copy_utils.tma_get_copy_fn(tma_atom_V, 0, cute.make_layout(1), gV, sV)
                load_V = copy_utils.tma_producer_copy_fn(load_V, pipeline_v)

                # K/V blocks are loaded from the last (the one crossing a causal diagonal) down.
                n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
                n_block = n_block_max - 1
                self._produce(pipeline_k, load_K, n_block, kv_producer_state)
                if const_expr(self.persistent):
                    if tiles_done > 0:  # the last tile's O store has left sQ
                        cute.arch.barrier(barrier_id=_Q_FREE, number_of_threads=_Q_FREE_THREADS)
                    tiles_done += 1
                pipeline_q.producer_acquire_w_index_phase(0, q_producer_phase)
                load_Q(tma_bar_ptr=pipeline_q.sync_object_full.get_barrier(0))
                q_producer_phase ^= 1
                if const_expr(not self.intra_wg_overlap):
                    self._produce(pipeline_v, load_V, n_block, kv_producer_state)
                    kv_producer_state.advance()
                    for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                        n_block = n_block_max - 1 - i - 1
                        self._produce(pipeline_k, load_K, n_block, kv_producer_state)
                        self._produce(pipeline_v, load_V, n_block, kv_producer_state)
                        kv_producer_state.advance()
                else:
                    # With overlap the consumers want K of block n - 1 before V of block n.
                    for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                        n_block_prev = n_block_max - i - 1
                        n_block = n_block_prev - 1
                        kv_producer_state_prev = kv_producer_state.clone()
                        kv_producer_state.advance()
                        self._produce(pipeline_k, load_K, n_block, kv_producer_state)
                        self._produce(pipeline_v, load_V, n_block_prev, kv_producer_state_prev)
                    n_block = n_block_min
                    self._produce(pipeline_v, load_V, n_block, kv_producer_state)
                    kv_producer_state.advance()

                tile_scheduler.prefetch_next_work()
                tile_scheduler.advance_to_next_work()
                work_tile = tile_scheduler.get_current_work()
            if const_expr(self.persistent):
                if tiles_done > 0:  # match the last epilogue's arrival
                    cute.arch.barrier(barrier_id=_Q_FREE, number_of_threads=_Q_FREE_THREADS)
            pipeline_v.producer_tail(kv_producer_state)

    @cute.jit
    def _produce(self, pipe: pipeline.PipelineAsync, load, n_block, state):
        """One K or V block into the stage of ``state``: acquire the stage, issue its TMA load
        (``load``: load_K or load_V), commit."""
        pipe.producer_acquire(state)
        load(src_idx=n_block, producer_state=state)
        pipe.producer_commit(state)


def _pv_from_registers(head_dim: int) -> bool:
    """Whether the PV GEMM takes P from registers (wgmma's RS form) rather than from shared
    memory: FA4's choice (``_tile_size_fwd_sm90``), RS except at head dim 96, where FA4 measured it
    "catastrophic" in its 192-row tiles (~300 against ~600 TFLOP/s on an H100)."""
    return not 64 < head_dim <= 96


class HopperAttentionForward:
    """One attention kernel configuration (all compile-time).

    head_dim, head_dim_v: the head dims of q / k and of v / out (_attention_limits.HEAD_DIM_PAIRS).
    tile_m:    query rows per CTA (a multiple of 64; tile_m // 64 consumer warpgroups).
    tile_n:    key rows per pipeline stage.
    stages:    K / V shared-memory stages.
    overlap:   intra-warpgroup overlap of softmax with the next block's GEMMs, and the ping-pong
               schedule between the consumer warpgroups.
    mask:      "none", "causal" or "local" (see _attention_limits.MASKS); local takes its band at
               run time.
    varlen:    packed sequences: q / k / v / out are [total, H, K or Kv] and lse [H, total], with the
               int32 offsets seqstart_q / seqstart_k.
    persistent: a grid of min(tiles, max_ctas) CTAs, each walking tiles in FA4's L2-swizzled
               order, longest first when masked (dense only; packed sequences keep FA4's one
               tile per CTA).

    Call: kernel(q, k, v, out, lse, seqstart_q, seqstart_k, scale, window_left, window_right,
    max_ctas), the offsets ignored unless varlen (any int32 tensor then), the window unless mask
    is local, max_ctas (the device's SM count) unless persistent.
    """

    def __init__(self, dtype, head_dim: int, head_dim_v: int, tile_m: int, tile_n: int, stages: int,
                 overlap: bool, mask: str, varlen: bool, persistent: bool = False):
        if persistent and varlen:
            raise ConfigError(f"attention_fwd_cute: config persistent=True, varlen=True (head_dim {head_dim}, "
                              f"tile {tile_m}x{tile_n}): the persistent schedule serves dense batches only")
        self.dtype, self.head_dim, self.head_dim_v = dtype, head_dim, head_dim_v
        self.tile_m, self.tile_n, self.stages, self.overlap = tile_m, tile_n, stages, overlap
        self.mask, self.varlen, self.persistent = mask, varlen, persistent

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mSeqstartQ: cute.Tensor, mSeqstartK: cute.Tensor, scale: Float32, window_left: Int32,
                 window_right: Int32, max_ctas: Int32, stream):
        # Built while tracing, so FA4 reads the target from the compile's --gpu-arch.
        fa = _RuntimeGqaForward(
            self.dtype, self.head_dim, self.head_dim_v, 1, is_causal=self.mask == "causal",
            is_local=self.mask == "local", pack_gqa=False, tile_m=self.tile_m, tile_n=self.tile_n,
            num_stages=self.stages, num_threads=block_threads(self.tile_m), Q_in_regs=False,
            intra_wg_overlap=self.overlap, mma_pv_is_rs=_pv_from_registers(self.head_dim),
            persistent=self.persistent)
        local = const_expr(self.mask == "local")
        fa(mQ, mK, mV, mO, mLSE, scale,
           mSeqstartQ if const_expr(self.varlen) else None, mSeqstartK if const_expr(self.varlen) else None,
           window_left if local else None, window_right if local else None, max_ctas, stream)
