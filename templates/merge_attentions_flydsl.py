"""merge_attentions on ROCm (FlyDSL): the exact log-sum-exp merge of partial attentions.

Calling convention (the op's, see mslk_dsl/ops/attention_decode.py): kernel(parts, lses, out, lse)
  parts [S, B, M, H, D] (fp32, bf16 or fp16), lses [S, B, H, M] fp32 (natural log; -inf for a
  partial that saw no key, whatever its out holds), out [B, M, H, D] of the partials' dtype,
  lse [B, H, M] fp32:
    lse = log(sum_s exp(lses[s]))      out = sum_s exp(lses[s] - lse) * parts[s]  (fp32, rounded once)
  A row whose partials are all -inf gets out = 0 and lse = -inf. Rows start 16-byte aligned and
  are a multiple of 16 bytes long (the op checks D and copies misaligned tensors): a lane loads 4
  elements at a time. Any strides with a unit last one; every size is dynamic.
Kernel: make_merge_kernel in templates/_flydsl_attention.py (the decode template launches it too).
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits

from mslk_dsl.templates import _flydsl_attention as attn

DTYPES = ("float32", "bfloat16", "float16")
TARGETS = ("gfx942", "gfx950")
# Rows (one per wave) per work-group.
CONFIGS = [dict(waves=4)]


def _heuristic(target, sig, problem):
    return dict(CONFIGS[0])


def build(config, target, sig):
    import torch
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    merge_kernel, rows = attn.make_merge_kernel(dtype=sig["dtype"], out_dtype=sig["dtype"], waves=config["waves"])
    threads = attn.WAVE * rows

    @flyc.jit
    def merge_attentions(parts: fx.Tensor, lses: fx.Tensor, out: fx.Tensor, lse: fx.Tensor,
                         stream: fx.Stream = fx.Stream(None)):
        _, batch, mq, heads, _ = parts.shape.unpack()
        merge_kernel(parts, lses, out, lse).launch(grid=((batch * mq * heads + (rows - 1)) // rows, 1, 1),
                                                   block=(threads, 1, 1), stream=stream)

    t = getattr(torch, sig["dtype"])
    d = 128
    return merge_attentions, (torch.empty(3, 2, 5, 4, d, dtype=t), torch.empty(3, 2, 4, 5),
                              torch.empty(2, 5, 4, d, dtype=t), torch.empty(2, 4, 5))


TEMPLATE = Template(op="merge_attentions", backend="flydsl", targets=TARGETS,
                    signatures={"dtype": DTYPES},
                    configs=CONFIGS, heuristic=_heuristic, build=build,
                    block_threads=lambda config: attn.WAVE * config["waves"],
                    occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR,
                    instructions={"isa": [r"v_exp_f32",
                                         r"v_rcp_f32"]})
