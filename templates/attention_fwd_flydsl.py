"""attention_fwd on ROCm (FlyDSL, MFMA): flash-attention forward with the fp32 log-sum-exp.

Calling convention (the op's, see mslk_dsl/ops/attention.py):
  kernel(q, k, v, out, lse, seqstart_q, seqstart_k, scale, window_left, window_right, max_ctas)
  dense:   q [B, Mq, Hq, D], k [B, Mk, Hkv, D], v [B, Mk, Hkv, Dv], out [B, Mq, Hq, Dv],
           lse fp32 [B, Hq, Mq]
  varlen:  q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], out [Tq, Hq, Dv], lse fp32 [Hq, Tq],
           seqstart_q / seqstart_k int32 [n + 1] (unread placeholders when dense)
  scale: the softmax scale; window_left / window_right: the band -left <= j - i - (Mk - Mq) <=
  right around each sequence's bottom-right diagonal (WINDOW_NONE where unbounded), read by the
  configs whose mask family compares that side. max_ctas (the CU count, which bounds the CuTe
  kernel's persistent grid) is unread here.
Hq is a multiple of Hkv: the Hq / Hkv query heads of a KV head share its blocks, K / V are never
expanded. Last dims contiguous, other strides multiples of 8 elements, each batch's (sequence's)
slice of a tensor under 1 GiB. Every size is dynamic: one kernel per (dtype, head dims, config); the head dims (D, Dv) as the
CuTe template's (_attention_limits.HEAD_DIM_PAIRS).

A config fixes the KV tile (block_n), the waves (16 query rows each), the mask family and dense
vs packed sequences; ``serves`` matches the last two to the call, as the CuTe template does.
Kernel: templates/_flydsl_attention.py.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _attention_limits as attention_limits
from mslk_dsl.templates import _kernel_limits as limits

from mslk_dsl.templates import _flydsl_attention as attn

DTYPES = ("bfloat16", "float16")
TARGETS = ("gfx942", "gfx950")
BLOCK_N = (32, 64, 128)

# Four waves (64 query rows per block); eight spilled with bf16, whose fp32 -> bf16 rounding is
# VALU code on gfx942. Every (mask family, dense / packed) with each KV tile width; ``valid``
# keeps the widest tile that fits the head dim and target (fewer barriers and rescales per key),
# so a (target, dtype, head dim) has six kernels, as many as the CuTe template's.
CONFIGS = tuple(dict(waves=4, block_n=n, mask=mask, varlen=varlen)
                for n in BLOCK_N for mask in attn.MASKS for varlen in (False, True))


def _widest(target, sig) -> int:
    return max(n for n in BLOCK_N
               if attn.check_config({"waves": 4, "block_n": n}, target, sig["head_dim"], sig["head_dim_v"]) is None)


def _signature_valid(sig):
    return attention_limits.head_dims_served(sig["head_dim"], sig["head_dim_v"])


def _valid(config, target, sig):
    return (target in TARGETS and attn.check_config(config, target, sig["head_dim"], sig["head_dim_v"]) is None
            and config["block_n"] == _widest(target, sig))


def _wanted(problem) -> tuple[str, bool]:
    """(mask family, packed) of a call; a generic problem means dense with no mask."""
    return attn.MASKS[int(problem.get("mask", 0))], bool(problem.get("varlen", 0))


def _serves(config, problem):
    return (config["mask"], config["varlen"]) == _wanted(problem)


def _heuristic(target, sig, problem):
    """The call's mask family and layout with the widest KV tile that fits LDS and registers:
    128 keys at head dims 64 and 96 (and at 128 on gfx950), 64 at 128 and 192, 32 at 256."""
    mask, varlen = _wanted(problem)
    return dict(waves=4, block_n=_widest(target, sig), mask=mask, varlen=varlen)


def build(config, target, sig):
    import torch
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    varlen = config["varlen"]
    kernel, rows, threads = attn.make_attention_kernel(
        target=target, dtype=sig["dtype"], head_dim=sig["head_dim"], head_dim_v=sig["head_dim_v"],
        waves=config["waves"], block_n=config["block_n"], mask=config["mask"], varlen=varlen)

    @flyc.jit
    def attention_fwd(q: fx.Tensor, k: fx.Tensor, v: fx.Tensor, out: fx.Tensor, lse: fx.Tensor,
                      seqstart_q: fx.Tensor, seqstart_k: fx.Tensor, scale: fx.Float32, window_left: fx.Int32,
                      window_right: fx.Int32, max_ctas: fx.Int32, stream: fx.Stream = fx.Stream(None)):
        # the block table and paged flag of the decode variant are unread here
        kernel(q, k, v, out, lse, seqstart_q, seqstart_k, seqstart_k, scale, window_left, window_right,
               fx.Int32(0)).launch(grid=attn.grid_for(q, k, seqstart_q, rows, varlen),
                                   block=(threads, 1, 1), stream=stream)

    t = getattr(torch, sig["dtype"])
    d, dv = sig["head_dim"], sig["head_dim_v"]
    lead = () if varlen else (2,)
    q, out = torch.empty(*lead, 48, 8, d, dtype=t), torch.empty(*lead, 48, 8, dv, dtype=t)
    k, v = torch.empty(*lead, 80, 2, d, dtype=t), torch.empty(*lead, 80, 2, dv, dtype=t)
    lse = torch.empty(*lead, 8, 48, dtype=torch.float32)
    starts = torch.tensor([0, 20, 48] if varlen else [0], dtype=torch.int32)
    kstarts = torch.tensor([0, 30, 80] if varlen else [0], dtype=torch.int32)
    return attention_fwd, (q, k, v, out, lse, starts, kstarts, 0.125, attn.WINDOW_NONE, 0, 1)


TEMPLATE = Template(op="attention_fwd", backend="flydsl", targets=TARGETS,
                    signatures={"dtype": DTYPES, "head_dim": attention_limits.HEAD_DIMS,
                                "head_dim_v": attention_limits.HEAD_DIMS_V},
                    signature_valid=_signature_valid, configs=CONFIGS, valid=_valid, heuristic=_heuristic, serves=_serves, build=build,
                    block_threads=attn.threads_of,
                    # LDS-bound work-groups: two or three per CU, as the GEMMs' tiles.
                    occupancy_floor=limits.GEMM_OCCUPANCY_FLOOR,
                    instructions={"isa": [r"v_mfma_f32_16x16x16_?(bf16|f16)\b",
                                         r"buffer_load_dwordx4",
                                         r"v_exp_f32"]})
