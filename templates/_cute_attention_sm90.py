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
one change.

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


def _import_without_initialiser(package: str) -> None:
    """Make ``package``'s submodules importable without executing its ``__init__``."""
    if package in sys.modules:
        return
    spec = importlib.util.find_spec(package)
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"the attention kernels need the package {package!r} (pip install flash-attn-4)")
    module = types.ModuleType(package)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    sys.modules[package] = module


_import_without_initialiser("quack")
_import_without_initialiser("flash_attn.cute")
import quack.dsl  # noqa: E402,F401  (CuTe tensor-indexing sugar that FA4's device code uses)
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90  # noqa: E402
from flash_attn.cute.utils import AuxData  # noqa: E402
from quack import copy_utils  # noqa: E402
from cutlass import pipeline  # noqa: E402

# Consumer threads (tile_m // 64 warpgroups) plus one producer warpgroup.
THREADS_PER_WARPGROUP = 128


def block_threads(tile_m: int) -> int:
    return (tile_m // 64 + 1) * THREADS_PER_WARPGROUP


class _RuntimeGqaForward(FlashAttentionForwardSm90):
    """FA4's Hopper forward with the key/value head of a query head computed at run time."""

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
            pipeline_v.producer_tail(kv_producer_state)

    @cute.jit
    def _produce(self, pipe: pipeline.PipelineAsync, load, n_block, state):
        """One K or V block into the stage of ``state``: acquire the stage, issue its TMA load
        (``load``: load_K or load_V), commit."""
        pipe.producer_acquire(state)
        load(src_idx=n_block, producer_state=state)
        pipe.producer_commit(state)


class HopperAttentionForward:
    """One attention kernel configuration (all compile-time).

    head_dim:  64, 128 or 256 (q, k and v alike).
    tile_m:    query rows per CTA (a multiple of 64; tile_m // 64 consumer warpgroups).
    tile_n:    key rows per pipeline stage.
    stages:    K / V shared-memory stages.
    overlap:   intra-warpgroup overlap of softmax with the next block's GEMMs, and the ping-pong
               schedule between the consumer warpgroups.
    mask:      "none", "causal" or "local" (see _attention_limits.MASKS); local takes its band at
               run time.
    varlen:    packed sequences: q / k / v / out are [total, H, K] and lse [H, total], with the
               int32 offsets seqstart_q / seqstart_k.

    Call: kernel(q, k, v, out, lse, seqstart_q, seqstart_k, scale, window_left, window_right), the
    offsets ignored unless varlen (any int32 tensor then), the window unless mask is local.
    """

    def __init__(self, dtype, head_dim: int, tile_m: int, tile_n: int, stages: int, overlap: bool,
                 mask: str, varlen: bool):
        self.dtype, self.head_dim = dtype, head_dim
        self.tile_m, self.tile_n, self.stages, self.overlap = tile_m, tile_n, stages, overlap
        self.mask, self.varlen = mask, varlen

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mSeqstartQ: cute.Tensor, mSeqstartK: cute.Tensor, scale: Float32, window_left: Int32,
                 window_right: Int32, stream):
        # Built while tracing, so FA4 reads the target from the compile's --gpu-arch.
        fa = _RuntimeGqaForward(
            self.dtype, self.head_dim, self.head_dim, 1, is_causal=self.mask == "causal",
            is_local=self.mask == "local", pack_gqa=False, tile_m=self.tile_m, tile_n=self.tile_n,
            num_stages=self.stages, num_threads=block_threads(self.tile_m), Q_in_regs=False,
            intra_wg_overlap=self.overlap, mma_pv_is_rs=True)
        local = const_expr(self.mask == "local")
        fa(mQ, mK, mV, mO, mLSE, scale,
           mSeqstartQ if const_expr(self.varlen) else None, mSeqstartK if const_expr(self.varlen) else None,
           None, None, None, window_left if local else None, window_right if local else None,
           None, None, AuxData(), None, None, stream)
