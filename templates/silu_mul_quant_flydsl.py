"""silu_mul_quant for AMD CDNA (FlyDSL): quantize_fp8_row(silu_mul(x0, x1)) in one pass.

Calling convention: ``kernel(x0, x1, scale_ub, xq, scale, count)``; x0, x1 [M, K] bf16/fp16/fp32
(unit column stride), scale_ub [1] fp32 (read only when the signature has ``has_scale_ub``), xq
[M, K] in the target's FP8 flavour, scale [M] fp32 (dequant multiplier), count [1] int32 (rows
from count[0] on are neither read nor written: MSLK's valid_token_count; 2^31 - 1 without one).

Bit-identical to silu_mul followed by quantize_fp8_row: silu(x0) * x1 is computed by the same
device code as silu_mul, rounded to the input dtype, then quantized exactly as
quantize_fp8_row does (see its docstring for the FP8 semantics).
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
        "silu_mul_quant_flydsl", config, target, sig)

    def swiglu(a, b):
        return rw.silu_mul(a.to(fx.Float32), b.to(fx.Float32)).to(dtype)

    @flyc.kernel(known_block_size=[threads, 1, 1])
    def silu_mul_quant_kernel(x0: fx.Tensor, x1: fx.Tensor, scale_ub: fx.Tensor, xq: fx.Tensor,
                              scale: fx.Tensor, count: fx.Tensor):
        groups = rw.RowGroups(threads, rows)
        slots = rw.reduction_slots(storage, groups)
        row = rw.counted_row(fx.block_idx.x * rows + groups.group, xq, count)
        ub = fx.get_iter(scale_ub).load() if has_ub else None
        rw.quantize_rows((x0, x1), swiglu, xq, scale, ub, groups, slots, row, vec, per_thread, phased_per_thread,
                         dtype, fp8)

    @flyc.jit
    def silu_mul_quant(x0: fx.Tensor, x1: fx.Tensor, scale_ub: fx.Tensor, xq: fx.Tensor, scale: fx.Tensor,
                       count: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        m, _ = x0.shape.unpack()
        silu_mul_quant_kernel(x0, x1, scale_ub, xq, scale, count).launch(
            grid=(space.row_blocks(m, rows), 1, 1), block=(threads, 1, 1), stream=stream)

    k = space.placeholder_cols(sig)
    x = torch.empty(2, k, dtype=getattr(torch, sig["dtype"]))
    args = [x, x.clone(), torch.ones(1), torch.empty(2, k, dtype=getattr(torch, fp8.dtype)), torch.empty(2),
            torch.ones(1, dtype=torch.int32)]
    return silu_mul_quant, args


TEMPLATE = Template(op="silu_mul_quant", backend="flydsl", targets=("gfx942", "gfx950"), build=build,
                    **space.quant_template_rules())
