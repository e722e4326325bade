"""quantize_fp8_row for AMD CDNA (FlyDSL): row-wise FP8 quantization with one scale per row.

Calling convention: ``kernel(x, scale_ub, xq, scale)``; x [M, K] bf16/fp16/fp32 (unit column
stride), scale_ub [1] fp32 (read only when the signature has ``has_scale_ub``), xq [M, K] in the
target's FP8 flavour (e4m3fnuz on gfx942, e4m3fn on gfx950), scale [M] fp32 (the dequant
multiplier: x ~ xq * scale).

Semantics (MSLK's Triton quantize_fp8_row, eps_opt = 1/512): amax = max |x| over the row,
clamped to [1/512, scale_ub]; scale = amax / fp8_max; xq = fp8(clamp(x / scale, -fp8_max,
fp8_max)). All fp32 with correctly rounded divisions and round-to-nearest-even FP8 casts, so the
result is bit-identical to torch doing the same tensor ops (see _flydsl_rowwise.to_fp8).

One row per group of ``threads / rows_per_block`` threads; 64 register bytes of the row per
thread (four 16-byte vectors, or 16 scalars) stay in registers between the absmax pass and the
quantize pass (see _flydsl_rowwise.quantize_row).
One-element configs run a call whose tensors start at one offset from a 16-byte boundary as
phased rows (_flydsl_rowwise.PhasedRow): the same columns per thread as 16-byte vectors of each
row's aligned middle (8-byte FP8 stores), the head and tail one element to a lane.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _rowwise_space as space


def build(config, target, sig):
    import torch
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    from mslk_dsl.templates import _flydsl_rowwise as rw

    threads, rows, vec, dtype, fp8, has_ub, per_thread, storage, phased_per_thread = rw.quantize_setup(
        "quantize_fp8_row_flydsl", config, target, sig)

    def as_loaded(x):
        return x

    @flyc.kernel(known_block_size=[threads, 1, 1])
    def quantize_fp8_row_kernel(x: fx.Tensor, scale_ub: fx.Tensor, xq: fx.Tensor, scale: fx.Tensor):
        groups = rw.RowGroups(threads, rows)
        slots = rw.reduction_slots(storage, groups)
        row = fx.block_idx.x * rows + groups.group
        ub = fx.get_iter(scale_ub).load() if has_ub else None
        rw.quantize_rows((x,), as_loaded, xq, scale, ub, groups, slots, row, vec, per_thread, phased_per_thread,
                         dtype, fp8)

    @flyc.jit
    def quantize_fp8_row(x: fx.Tensor, scale_ub: fx.Tensor, xq: fx.Tensor, scale: fx.Tensor,
                         stream: fx.Stream = fx.Stream(None)):
        m, _ = x.shape.unpack()
        quantize_fp8_row_kernel(x, scale_ub, xq, scale).launch(
            grid=(space.row_blocks(m, rows), 1, 1), block=(threads, 1, 1), stream=stream)

    k = space.placeholder_cols(sig)
    args = [torch.empty(2, k, dtype=getattr(torch, sig["dtype"])), torch.ones(1),
            torch.empty(2, k, dtype=getattr(torch, fp8.dtype)), torch.empty(2)]
    return quantize_fp8_row, args


TEMPLATE = Template(op="quantize_fp8_row", backend="flydsl", targets=("gfx942", "gfx950"), build=build,
                    **space.quant_template_rules())
