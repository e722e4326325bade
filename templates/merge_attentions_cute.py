"""The exact log-sum-exp merge of partial attentions (MSLK's ``merge_attentions``), CuTe DSL.

    kernel(out_partials, lse_partials, out, lse)
    out_partials [S, B, M, H, K] dtype (fp32, bf16 or fp16), lse_partials [S, B, H, M] fp32,
    out [B, M, H, K] dtype, lse [B, H, M] fp32; all compact row-major, every size dynamic.
    lse = log(sum_s exp(lse_s)); out = sum_s exp(lse_s - lse) * out_s in fp32, rounded once.
    Chunks with lse -inf (no keys) are skipped, whatever their partial holds; a row with no
    non-empty chunk gets out 0 and lse -inf.

Rows start 16-byte aligned and are a multiple of 16 bytes long (the op checks K and copies
misaligned tensors): a thread moves 16 bytes of a partial per load. Memory-bound: the partials
are read once (S * rows * K elements), the output written once.

The kernel is ``_cute_merge_attentions.MergeAttentions``; the decode template reuses it.
"""
from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits

DTYPES = ("float32", "bfloat16", "float16")


def _heuristic(target, sig, problem):
    return {"unroll": 8}


def _build(config, target, sig):
    from mslk_dsl.templates._cute_merge_attentions import MergeAttentions

    kernel = MergeAttentions(sig["dtype"], sig["dtype"], True, config["unroll"])
    return kernel, kernel.fake_args()


TEMPLATE = Template(op="merge_attentions", backend="cute", targets=("sm90a",),
                    signatures={"dtype": DTYPES}, space={"unroll": (8,)},
                    heuristic=_heuristic, build=_build, block_threads=lambda config: 256,
                    occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR)
