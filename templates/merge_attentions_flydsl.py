"""merge_attentions on ROCm (FlyDSL): the exact log-sum-exp merge of attention partials.

Calling convention: kernel(parts, lses, out, lse)
  parts [S, B, M, H, D] (fp32, bf16 or fp16: the partial_dtype), lses [S, B, H, M] fp32 (natural
  log; -inf for a partial that saw no key), out [B, M, H, D] (dtype), lse [B, H, M] fp32:
    lse = log(sum_s exp(lses[s]))      out = sum_s exp(lses[s] - lse) * parts[s]
  A row whose partials are all -inf gets out = 0 and lse = -inf. Strides are free except the last
  (contiguous) and a multiple of 4 elements; D <= 256 and D % 4 == 0. All sizes are dynamic.

One wave merges one (b, m, h) row: lane l holds elements [4 l, 4 l + 4) of D, and the splits are
folded in order with a running max, so each partial is read once (online softmax over splits).
Every (row, split) slice has its own buffer descriptor of exactly D elements, from a 64-bit
address: lanes past D read zeros and store nothing, and no size limit applies to the tensors.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits

from mslk_dsl.templates import _flydsl_attention as attn

OUT_DTYPES = ("bfloat16", "float16", "float32")
# Partials in fp32, as the split attention kernels write them.
PARTIAL_DTYPES = ("float32",)
TARGETS = ("gfx942", "gfx950")

CONFIGS = [dict(waves=4), dict(waves=8)]


def _heuristic(target, sig, problem):
    return dict(CONFIGS[0])


def build(config, target, sig):
    import torch
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    merge_kernel, rows = attn.make_merge_kernel(partial_dtype=sig["partial_dtype"], dtype=sig["dtype"],
                                                waves=config["waves"])
    threads = attn.WAVE * rows

    @flyc.jit
    def merge_attentions(parts: fx.Tensor, lses: fx.Tensor, out: fx.Tensor, lse: fx.Tensor,
                         stream: fx.Stream = fx.Stream(None)):
        _, batch, mq, heads, _ = parts.shape.unpack()
        merge_kernel(parts, lses, out, lse).launch(grid=((batch * mq * heads + (rows - 1)) // rows, 1, 1),
                                                   block=(threads, 1, 1), stream=stream)

    parts = torch.empty(3, 2, 5, 4, 128, dtype=getattr(torch, sig["partial_dtype"]))
    return merge_attentions, (parts, torch.empty(3, 2, 4, 5), torch.empty(2, 5, 4, 128, dtype=getattr(torch, sig["dtype"])),
                              torch.empty(2, 4, 5))


TEMPLATE = Template(op="merge_attentions", backend="flydsl", targets=TARGETS,
                    signatures={"dtype": OUT_DTYPES, "partial_dtype": PARTIAL_DTYPES},
                    configs=CONFIGS, heuristic=_heuristic, build=build,
                    block_threads=lambda config: attn.WAVE * config["waves"],
                    occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR)
