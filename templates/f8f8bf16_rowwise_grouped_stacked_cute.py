"""f8f8bf16_rowwise_grouped_stacked on Hopper:
out[rows of g] = (xq[rows of g] @ wq[g]^T) * x_scale[rows, None] * w_scale[g][None, :], bf16 out.

Runtime args: kernel(xq, wq, x_scale, w_scale, out, M_sizes): xq [total_M, K] float8_e4m3fn, wq
the [G, N, K] FP8 weights viewed as [G * N, K], x_scale [total_M] and w_scale [G * N] (the [G, N]
scales flattened) fp32, out [total_M, N] bf16, M_sizes [G] int32 or int64 (sig["index_dtype"]).
K a multiple of 16 and N of 8 (16-byte rows for TMA; the op layer checks).

The kernel is ``_cute_grouped_gemm_sm90.GroupedHopperGemm`` with FP8 wgmma (128-deep k-tiles)
and the dense FP8 GEMM's scale epilogue, fused: each tile's x_scale rows and w_scale columns are
loaded when the tile starts (hidden under the main loop), staged in shared memory, and applied to
the fp32 accumulators before the one rounding to bf16. ``promote`` as in f8f8bf16_rowwise_cute:
0 accumulates in the wgmma over all of K (MSLK's fast accumulation), 4 (the default) adds every
4 k-tiles into fp32 registers (error below bf16 rounding; tiles of <= 128 columns).
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _grouped_gemm_space as space
from mslk_dsl.templates import _kernel_limits as limits

INDEX_DTYPES = ("int32", "int64")


def _heuristic(target, sig, problem):
    return space.heuristic(problem, fp8=True)


def build(config, target, sig):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from mslk_dsl.templates import _cute_grouped_gemm_sm90 as grouped

    class RowwiseScale:
        """The tile's x_scale rows and w_scale columns (m0: the tile's first row of x, n0: its
        first row of the [G * N, K] weights, which indexes the flattened w_scale the same way):
        registers at tile start, shared memory after the main loop, read per output value."""

        def __init__(self, tile_m, tile_n):
            self.tile_m, self.tile_n = tile_m, tile_n
            self.threads = 2 * tile_m  # consumer threads: 128 per 64 rows
            self.segments = ((0, tile_m), (tile_m, tile_n))  # (smem offset, length): x_scale, w_scale
            self.smem_words = tile_m + tile_n
            self.num_regs = sum(self._per_thread(length) for _, length in self.segments)

        def _per_thread(self, length):
            return -(-length // self.threads)

        @cute.jit
        def prefetch(self, regs, epi_args, m0, n0, tidx):
            # Rows / columns past the ends read the last scale: their outputs are never stored.
            r = 0
            for seg in cutlass.range_constexpr(2):
                src, length = epi_args[seg], self.segments[seg][1]
                origin = m0 if cutlass.const_expr(seg == 0) else n0
                for i in cutlass.range_constexpr(self._per_thread(length)):
                    j = tidx + i * self.threads
                    if j < length:
                        regs[r + i] = src[cutlass.min(origin + j, src.shape[0] - 1)]
                r += self._per_thread(length)

        @cute.jit
        def stage(self, regs, smem, tidx):
            r = 0
            for seg in cutlass.range_constexpr(2):
                offset, length = self.segments[seg]
                for i in cutlass.range_constexpr(self._per_thread(length)):
                    j = tidx + i * self.threads
                    if j < length:
                        smem[offset + j] = regs[r + i]
                r += self._per_thread(length)

        @cute.jit
        def apply(self, acc, coords, smem):
            for i in cutlass.range_constexpr(cute.size(acc)):
                m, n = coords[i]
                acc[i] = acc[i] * smem[m] * smem[self.tile_m + n]

    gemm = grouped.GroupedHopperGemm((config["tile_m"], config["tile_n"]), promote_every=config["promote"],
                                     epilogue=RowwiseScale(config["tile_m"], config["tile_n"]),
                                     template="f8f8bf16_rowwise_grouped_stacked_cute")

    @cute.jit
    def f8f8bf16_rowwise_grouped_stacked(xq: cute.Tensor, wq: cute.Tensor, x_scale: cute.Tensor,
                                         w_scale: cute.Tensor, out: cute.Tensor, m_sizes: cute.Tensor, stream):
        gemm(xq, wq, out, m_sizes, (x_scale, w_scale), stream)

    m, gn, n, k = cute.sym_int(), cute.sym_int(divisibility=8), cute.sym_int(divisibility=8), \
        cute.sym_int(divisibility=16)
    fp8 = cutlass.Float8E4M3FN
    index = {"int32": cutlass.Int32, "int64": cutlass.Int64}[sig["index_dtype"]]
    args = [make_fake_compact_tensor(fp8, (m, k), stride_order=(1, 0), assumed_align=16),
            make_fake_compact_tensor(fp8, (gn, k), stride_order=(1, 0), assumed_align=16),
            make_fake_compact_tensor(Float32, (m,), assumed_align=4),
            make_fake_compact_tensor(Float32, (gn,), assumed_align=4),
            make_fake_compact_tensor(cutlass.BFloat16, (m, n), stride_order=(1, 0), assumed_align=16),
            make_fake_compact_tensor(index, (cute.sym_int(),), assumed_align=4),
            make_fake_stream(use_tvm_ffi_env_stream=True)]
    return f8f8bf16_rowwise_grouped_stacked, args


TEMPLATE = Template(op="f8f8bf16_rowwise_grouped_stacked", backend="cute", targets=("sm90a",),
                    signatures={"index_dtype": INDEX_DTYPES}, configs=space.FP8_CONFIGS,
                    heuristic=_heuristic, build=build, occupancy_floor=limits.GEMM_OCCUPANCY_FLOOR,
                    instructions={"ptx": [r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3",
                                         r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta",
                                         r"vote\.sync\.ballot",
                                         r"setmaxnreg"]})
