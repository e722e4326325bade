"""FlyDSL MFMA GEMMs (bf16_gemm, f8f8bf16_rowwise) against an fp32 torch reference (ROCm GPUs).

Every config of both templates that is valid on this GPU runs on shapes that reach every bound:
M = 1, M and N not multiples of the tile (partial blocks, predicated stores), K shorter than one
K tile and K % tile_k != 0 (the predicated K tail), several K tiles (both LDS stages). The
heuristic's choice runs over M in {1, 7, 128, 1000, 4096} x common (N, K).

Tolerances: bf16 / fp16 as in gemm_checks.py;
  fp8 rowwise (exact products, fp32 accumulation, bf16 out): |out - ref| <= 1e-2 rms(ref) + 1e-2 |ref|
"""
import pytest
import torch
from gemm_checks import check_bf16, exact_fp32_reference, fp8_case  # noqa: F401

from mslk_dsl import ops, registry
from mslk_dsl.template import config_name
from mslk_dsl.testing import skipUnlessRocm

# (M, N, K): N, K multiples of 16 bytes as the op layer requires. K=24/48 < every tile_k,
# 200/400 leave a K tail, 1032/2064 run several K tiles plus a tail.
BF16_SHAPES = [(1, 8, 8), (1, 64, 24), (7, 136, 200), (130, 264, 1032), (257, 520, 64), (333, 72, 2056)]
FP8_SHAPES = [(1, 16, 16), (1, 64, 48), (7, 144, 400), (130, 272, 2064), (257, 528, 128), (333, 80, 4112)]
DEFAULT_M = (1, 7, 128, 1000, 4096)
DEFAULT_NK = ((128, 128), (4096, 4096), (8192, 8192), (1280, 8192), (8192, 1024))

pytestmark = skipUnlessRocm


def _target():
    from mslk_dsl.device import current_target
    return current_target().name


def _cases(op, sigs):
    (t,) = registry.get_templates(op=op, backend="flydsl")
    return [(sig, c) for sig in sigs for c in t.all_configs()]


def _case_id(case):
    sig, config = case
    return "-".join(str(v) for v in sig.values()) + "-" + config_name(config)


def _skip_invalid(op, sig, config):
    (t,) = registry.get_templates(op=op, backend="flydsl")
    if not t.valid(config, _target(), sig):
        pytest.skip(f"{config_name(config)} is not valid on {_target()}")


# ------------------------------------------------------------------ bf16_gemm
@pytest.mark.parametrize("case", _cases("bf16_gemm", [{"dtype": "bfloat16"}, {"dtype": "float16"}]),
                         ids=_case_id)
def test_bf16_gemm_every_config(case):
    sig, config = case
    _skip_invalid("bf16_gemm", sig, config)
    for m, n, k in BF16_SHAPES:
        check_bf16(m, n, k, getattr(torch, sig["dtype"]), config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("nk", DEFAULT_NK, ids=lambda nk: f"N{nk[0]}K{nk[1]}")
def test_bf16_gemm_default_config(nk, dtype):
    for m in DEFAULT_M:
        check_bf16(m, *nk, dtype)


# ----------------------------------------------------------- f8f8bf16_rowwise
def _fp8():
    from mslk_dsl.device import supports_float8_fnuz
    return (torch.float8_e4m3fnuz, 240.0) if supports_float8_fnuz() else (torch.float8_e4m3fn, 448.0)


def _check_fp8(m, n, k, has_bias, config=None, bias_dtype=torch.bfloat16, fast=True):
    args, ref = fp8_case(m, n, k, has_bias, *_fp8(), bias_dtype)
    out = ops.f8f8bf16_rowwise(*args, fast, config=config)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    rms = ref.pow(2).mean().sqrt().item()
    torch.testing.assert_close(out.float(), ref, atol=1e-2 * rms, rtol=1e-2,
                               msg=lambda s: f"f8f8bf16_rowwise {m}x{n}x{k} bias={has_bias and bias_dtype} "
                                                   f"fast={fast} {config}: {s}")


@pytest.mark.parametrize("case", _cases("f8f8bf16_rowwise", [{"bias": "bfloat16", "fast_accum": True},
                                                               {"bias": "none", "fast_accum": True}]),
                         ids=_case_id)
def test_f8f8bf16_rowwise_every_config(case):
    sig, config = case
    _skip_invalid("f8f8bf16_rowwise", sig, config)
    for m, n, k in FP8_SHAPES:
        _check_fp8(m, n, k, sig["bias"] != "none", config)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "promoted"])
@pytest.mark.parametrize("bias", [None, torch.bfloat16, torch.float32], ids=["nobias", "bf16bias", "fp32bias"])
@pytest.mark.parametrize("nk", DEFAULT_NK, ids=lambda nk: f"N{nk[0]}K{nk[1]}")
def test_f8f8bf16_rowwise_default_config(nk, bias, fast):
    """CDNA's MFMAs accumulate in fp32 whatever use_fast_accum says: both meet one tolerance."""
    for m in DEFAULT_M:
        _check_fp8(m, *nk, bias is not None, bias_dtype=bias, fast=fast)
