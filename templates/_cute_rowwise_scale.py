"""The FP8 rowwise-scale epilogue hook of the CuTe Hopper GEMMs (``_cute_gemm_sm90.HopperGemm``'s
``epilogue``), shared by the dense and the grouped FP8 GEMM templates:

    out[m, n] = acc[m, n] * x_scale[m] * w_scale[n] (+ bias[n]),  all in fp32

The tile's x_scale rows and w_scale (+ bias) columns are loaded into registers when the tile
starts (their latency hides under the mainloop), staged in shared memory after the mainloop, and
read per output value before the single rounding to the output dtype. The kernel's epi_args are
(x_scale, w_scale) or (x_scale, w_scale, bias), indexed from the tile's origin (m0, n0) as the
kernel passes it (the grouped kernel's n0 indexes the flattened [G * N] w_scale). With
``swapped`` (a swap_ab GEMM: the kernel's m runs along the weight's rows, its n along the
tokens) x_scale follows the kernel's n and w_scale and the bias its m.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr


class RowwiseScale:
    """The epilogue hook for one tile shape and the consumer threads that share a tile (2 *
    tile_m, or 128 under ping-pong: _cute_gemm_configs.epilogue_threads)."""

    def __init__(self, tile_m, tile_n, has_bias=False, swapped=False, threads=None):
        self.tile_m, self.tile_n, self.has_bias, self.swapped = tile_m, tile_n, has_bias, swapped
        self.threads = threads or 2 * tile_m
        # (smem offset, length, kernel axis: 0 m, 1 n) of x_scale, w_scale and bias inside the
        # staging buffer
        x_axis, w_axis = (1, 0) if swapped else (0, 1)
        x_len, w_len = (tile_m, tile_n)[x_axis], (tile_m, tile_n)[w_axis]
        self.segments = ([(0, x_len, x_axis), (x_len, w_len, w_axis)]
                         + [(x_len + w_len, w_len, w_axis)] * has_bias)
        self.smem_words = sum(length for _, length, _ in self.segments)
        self.num_regs = sum(self._per_thread(length) for _, length, _ in self.segments)

    def _per_thread(self, length):
        return -(-length // self.threads)

    @cute.jit
    def prefetch(self, regs, epi_args, m0, n0, tidx):
        # Clamp rows / columns past the ends to the last one: their outputs are never stored.
        r = 0
        for seg in cutlass.range_constexpr(len(self.segments)):
            src, length = epi_args[seg], self.segments[seg][1]
            origin = m0 if const_expr(self.segments[seg][2] == 0) else n0
            for i in cutlass.range_constexpr(self._per_thread(length)):
                j = tidx + i * self.threads
                if j < length:
                    regs[r + i] = src[cutlass.min(origin + j, src.shape[0] - 1)].to(Float32)
            r += self._per_thread(length)

    @cute.jit
    def stage(self, regs, smem, tidx):
        r = 0
        for seg in cutlass.range_constexpr(len(self.segments)):
            offset, length, _ = self.segments[seg]
            for i in cutlass.range_constexpr(self._per_thread(length)):
                j = tidx + i * self.threads
                if j < length:
                    smem[offset + j] = regs[r + i]
            r += self._per_thread(length)

    @cute.jit
    def apply(self, acc, coords, smem):
        x_off, w_off = self.segments[0][0], self.segments[1][0]
        b_off = x_off + self.tile_m + self.tile_n
        for i in cutlass.range_constexpr(cute.size(acc)):
            m, n = coords[i]
            x_i, w_i = (n, m) if const_expr(self.swapped) else (m, n)
            value = acc[i] * smem[x_off + x_i] * smem[w_off + w_i]
            if const_expr(self.has_bias):
                value = value + smem[b_off + w_i]
            acc[i] = value
