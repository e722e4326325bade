"""The log-sum-exp merge of partial attentions for NVIDIA GPUs, in CuTe DSL, as a kernel class
(the contract is in ``merge_attentions_cute``'s docstring). The decode kernel class launches its
``merge_kernel`` too, to combine its split-KV partials (fp32 in, the output dtype out).

Imported only from a template's ``build()`` (it imports ``cutlass`` at module level).
"""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from mslk_dsl.templates._kernel_limits import ELEM_BYTES, VECTOR_BYTES

DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
THREADS = 256
# Partials are read once: keep them out of L1 (the LSEs, read by every thread of a row, stay).
STREAM = cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE


class MergeAttentions:
    """out[b, m, h] = sum_s exp(lse_s - lse) * parts[s, b, m, h]; lse = log sum_s exp(lse_s).

    One thread per ``vec`` elements of an output row (vec: 16 bytes of the partials when the rows
    are aligned, else 1); rows are (b, m, h) in memory order, so a warp reads whole rows. The
    thread reads the S LSEs of its row (L1 broadcasts), then its S vector loads in groups of
    ``unroll``, each group issued before any of it is used (the chunks of a decode can number
    ~100: one load at a time would make the merge latency-bound).
    """

    def __init__(self, in_dtype: str, out_dtype: str, aligned: bool, unroll: int = 8):
        self.in_t, self.out_t = DTYPES[in_dtype], DTYPES[out_dtype]
        self.vec = VECTOR_BYTES // ELEM_BYTES[in_dtype] if aligned else 1
        self.aligned = aligned
        self.unroll = unroll

    @cute.kernel
    def merge_kernel(self, mParts: cute.Tensor, mLse: cute.Tensor, mOut: cute.Tensor, mLseOut: cute.Tensor):
        VEC, UNROLL = self.vec, self.unroll
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        S, B, M, H, K = mParts.shape
        nvec = K // VEC
        i = bidx * THREADS + tidx
        rows = B * M * H
        if i < rows * nvec:
            r, j = i // nvec, i % nvec
            h = r % H
            m = (r // H) % M
            b = r // (H * M)
            # log2 domain: the largest LSE, then the weights' sum.
            top = -Float32.inf
            for s in cutlass.range(S, unroll=self.unroll):
                top = cute.arch.fmax(top, mLse[s, b, h, m])
            safe = top
            if top == -Float32.inf:
                safe = Float32(0.0)
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            total = Float32(0.0)
            for s0 in cutlass.range(0, S, UNROLL):
                # Every load of the group is issued before the first is used: UNROLL in flight.
                parts = []
                for u in cutlass.range_constexpr(UNROLL):
                    part = cute.make_rmem_tensor((VEC,), self.in_t)
                    vecs = cute.zipped_divide(mParts[cutlass.min(s0 + u, S - 1), b, m, h, None], (VEC,))
                    cute.autovec_copy(vecs[None, j], part, l1c_evict_priority=STREAM)
                    parts.append(part)
                for u in cutlass.range_constexpr(UNROLL):
                    if s0 + u < S:
                        w = cute.arch.exp2((mLse[s0 + u, b, h, m] - safe) * Float32(LOG2E))
                        # An empty chunk (weight 0) adds nothing, even where its partial holds NaN.
                        if w > Float32(0.0):
                            total = total + w
                            acc.store(acc.load() + parts[u].load().to(Float32) * w)
            inv = Float32(0.0)
            if total > Float32(0.0):
                inv = cute.arch.rcp_approx(total)
            res = cute.make_rmem_tensor((VEC,), self.out_t)
            res.store((acc.load() * inv).to(self.out_t))
            cute.autovec_copy(res, cute.zipped_divide(mOut[b, m, h, None], (VEC,))[None, j])
            if j == 0:
                lse = -Float32.inf
                if total > Float32(0.0):
                    lse = safe + cute.math.log2(total, fastmath=True) * Float32(LN2)
                mLseOut[b, h, m] = lse

    def grid(self, mParts: cute.Tensor):
        S, B, M, H, K = mParts.shape
        return (cute.ceil_div(B * M * H * (K // self.vec), THREADS), 1, 1)

    def launch(self, mParts, mLse, mOut, mLseOut, stream):
        self.merge_kernel(mParts, mLse, mOut, mLseOut).launch(
            grid=self.grid(mParts), block=(THREADS, 1, 1), stream=stream)

    @cute.jit
    def __call__(self, mParts: cute.Tensor, mLse: cute.Tensor, mOut: cute.Tensor, mLseOut: cute.Tensor, stream):
        self.launch(mParts, mLse, mOut, mLseOut, stream)

    def fake_args(self):
        """Compile-time stand-ins for ``__call__``'s arguments (compact tensors, sizes dynamic)."""
        s, b, m, h = (cute.sym_int() for _ in range(4))
        k = cute.sym_int(divisibility=self.vec)
        align_in = VECTOR_BYTES if self.aligned else self.in_t.width // 8
        align_out = VECTOR_BYTES if self.aligned else self.out_t.width // 8
        return [row_major(self.in_t, (s, b, m, h, k), align_in), row_major(Float32, (s, b, h, m)),
                row_major(self.out_t, (b, m, h, k), align_out), row_major(Float32, (b, h, m)),
                make_fake_stream(use_tvm_ffi_env_stream=True)]


def row_major(dtype, shape, align=None):
    """A fake compact row-major tensor (the last mode has stride 1)."""
    n = len(shape)
    return make_fake_compact_tensor(dtype, shape, stride_order=tuple(range(n - 1, -1, -1)), assumed_align=align)

