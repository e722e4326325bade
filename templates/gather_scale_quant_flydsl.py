"""gather_scale_quant_dense_tokens for AMD CDNA (FlyDSL), gfx942 / gfx950: the MoE gather scaled by
the router score, quantized row-wise to FP8 in the same pass.

Same contract as gather_scale_quant_cute.py: kernel(x, token_indices, expert_indices, scores,
valid_count, scale_ub, xq, scale); x bf16/fp16; row i < n = min(valid_count[0], A) of xq / scale is
quantize_fp8_row((x[t].float() * scores[t, e].float()).to(x.dtype), scale_ub), bit for bit, in
the target's FP8 flavour (e4m3fnuz on gfx942, e4m3fn on gfx950); rows at and past n are not
written. As the other FlyDSL MoE kernels: scores need a unit column stride (the op makes them
contiguous otherwise) and D >= 2 (the op runs one-column inputs as two columns).

quantize_fp8_row's structure (``_flydsl_rowwise.quantize_row``): one group of whole waves per
output row, its first chunk held in registers between the absmax and the quantize pass. A row
past n gets an out-of-range source row (loads give zeros) and an out-of-range output row (stores
are dropped by the buffer descriptors), so it moves no data and needs no branch.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _rowwise_space as space


def _heuristic(target, sig, problem):
    return space.smallest_covering(sig, int(problem.get("D", 4096)), space.QUANT_REGISTER_BYTES, shared_waves=False)


def build(config, target, sig):
    import torch
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    from mslk_dsl.templates import _flydsl_rowwise as rw

    threads, rows, vec, dtype, fp8, _, per_thread, storage, _ = rw.quantize_setup(
        "gather_scale_quant_flydsl", {**config}, target, {**sig, "has_scale_ub": True})

    @flyc.kernel(known_block_size=[threads, 1, 1])
    def gather_scale_quant_kernel(x: fx.Tensor, tok: fx.Tensor, exp: fx.Tensor, scores: fx.Tensor,
                                  valid_count: fx.Tensor, scale_ub: fx.Tensor, xq: fx.Tensor, scale: fx.Tensor):
        groups = rw.RowGroups(threads, rows)
        slots = rw.reduction_slots(storage, groups)
        row = fx.block_idx.x * rows + groups.group
        a, cols = xq.shape.unpack()
        n = fx.get_iter(valid_count).load()
        live = row < (n < a).select(n, a)
        i = (row < a).select(row, a - 1)
        t = (fx.get_iter(tok) + i).load()
        e = (fx.get_iter(exp) + i).load()
        t = live.select(t, fx.Int32(0))
        e = live.select(e, fx.Int32(0))
        s_stride, _ = scores.stride.unpack()
        s = (fx.get_iter(scores) + fx.Int64(t) * fx.Int64(s_stride) + e).load().to(fx.Float32)
        x_rows, _ = x.shape.unpack()
        src = rw.row_view(x, live.select(t, x_rows), vec)
        ub = fx.get_iter(scale_ub).load()

        def values(j):
            return (rw.load(src, j, vec).to(fx.Float32) * s).to(dtype)

        # Gathered rows keep one element per access on rows that admit no wider one: a source
        # row and its destination row sit at different phases.
        out_row = live.select(row, a)
        rw.quantize_row(values, groups, out_row, cols, vec, per_thread, dtype, rw.row_view(xq, out_row, vec), scale,
                        ub, fp8, slots)

    @flyc.jit
    def gather_scale_quant(x: fx.Tensor, tok: fx.Tensor, exp: fx.Tensor, scores: fx.Tensor,
                           valid_count: fx.Tensor, scale_ub: fx.Tensor, xq: fx.Tensor, scale: fx.Tensor,
                           stream: fx.Stream = fx.Stream(None)):
        a, _ = xq.shape.unpack()
        gather_scale_quant_kernel(x, tok, exp, scores, valid_count, scale_ub, xq, scale).launch(
            grid=((a + rows - 1) // rows, 1, 1), block=(threads, 1, 1), stream=stream)

    k = space.placeholder_cols(sig)  # placeholder sizes only; T, A, D, E stay dynamic
    idx = torch.zeros(6, dtype=torch.int32)
    args = [torch.empty(3, k, dtype=getattr(torch, sig["dtype"])), idx, idx.clone(),
            torch.zeros(3, 5, dtype=getattr(torch, sig["score_dtype"])), torch.ones(1, dtype=torch.int32),
            torch.ones(1), torch.empty(6, k, dtype=getattr(torch, fp8.dtype)), torch.empty(6)]
    return gather_scale_quant, args


TEMPLATE = Template(
    op="gather_scale_quant_dense_tokens", backend="flydsl", targets=("gfx942", "gfx950"),
    signatures={"dtype": ("bfloat16", "float16"), **space.ROW_SIGNATURE, "score_dtype": limits.SCORE_DTYPES},
    signature_valid=limits.vector_signature, space=space.GATHER_SPACE, valid=space.valid, heuristic=_heuristic, build=build,
    occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR)
