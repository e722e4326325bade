"""FlyDSL MFMA GEMMs (bf16_gemm, f8f8bf16_rowwise) against an fp32 torch reference (ROCm GPUs).

Every config of both templates that is valid on this GPU runs on shapes that reach every bound:
M = 1, M and N not multiples of the tile (partial blocks, predicated stores), K shorter than one
K tile and K % tile_k != 0 (the predicated K tail), several K tiles (both LDS stages). The
heuristic's choice runs over M in {1, 7, 128, 1000, 4096} x common (N, K).

Tolerances (reference: fp32 math on the same inputs, TF32 off):
  bf16 out: |out - ref| <= 1e-2 + 1e-2 |ref|;  fp16 out: |out - ref| <= 1e-2 + 2e-3 |ref|
  fp8 rowwise (exact products, fp32 accumulation, bf16 out): |out - ref| <= 1e-2 rms(ref) + 1e-2 |ref|
"""
import pytest
import torch

from mslk_dsl import ops, registry
from mslk_dsl.template import config_name
from mslk_dsl.testing import skipUnlessRocm

# (M, N, K): N, K multiples of 16 bytes as the op layer requires. K=24/48 < every tile_k,
# 200/400 leave a K tail, 1032/2064 run several K tiles plus a tail.
BF16_SHAPES = [(1, 8, 8), (1, 64, 24), (7, 136, 200), (130, 264, 1032), (257, 520, 64), (333, 72, 2056)]
FP8_SHAPES = [(1, 16, 16), (1, 64, 48), (7, 144, 400), (130, 272, 2064), (257, 528, 128), (333, 80, 4112)]
DEFAULT_M = (1, 7, 128, 1000, 4096)
DEFAULT_NK = ((128, 128), (4096, 4096), (8192, 8192), (1280, 8192), (8192, 1024))
TOL = {torch.bfloat16: dict(atol=1e-2, rtol=1e-2), torch.float16: dict(atol=1e-2, rtol=2e-3)}

pytestmark = skipUnlessRocm


@pytest.fixture(autouse=True)
def _exact_fp32_reference():
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


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


def _randn(*shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g)


# ------------------------------------------------------------------ bf16_gemm
def _check_bf16(m, n, k, dtype, config=None):
    x = _randn(m, k, seed=m * 31 + k).to(dtype)
    w = _randn(n, k, seed=n * 17 + k + 1).to(dtype)
    out = ops.bf16_gemm(x, w, config=config)
    ref = x.float() @ w.float().T
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **TOL[dtype],
                               msg=lambda s: f"bf16_gemm {m}x{n}x{k} {dtype} {config}: {s}")


@pytest.mark.parametrize("case", _cases("bf16_gemm", [{"dtype": "bfloat16"}, {"dtype": "float16"}]),
                         ids=_case_id)
def test_bf16_gemm_every_config(case):
    sig, config = case
    _skip_invalid("bf16_gemm", sig, config)
    for m, n, k in BF16_SHAPES:
        _check_bf16(m, n, k, getattr(torch, sig["dtype"]), config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("nk", DEFAULT_NK, ids=lambda nk: f"N{nk[0]}K{nk[1]}")
def test_bf16_gemm_default_config(nk, dtype):
    for m in DEFAULT_M:
        _check_bf16(m, *nk, dtype)


# ----------------------------------------------------------- f8f8bf16_rowwise
def _fp8():
    from mslk_dsl.device import supports_float8_fnuz
    return (torch.float8_e4m3fnuz, 240.0) if supports_float8_fnuz() else (torch.float8_e4m3fn, 448.0)


def _quantize_rowwise(t):
    """Rowwise FP8 quantization: scale = absmax / fp8_max per row (the dequant multiplier)."""
    fp8, fp8_max = _fp8()
    scale = t.abs().amax(dim=1).clamp(min=1e-12) / fp8_max
    q = (t / scale[:, None]).clamp(-fp8_max, fp8_max).to(fp8)
    return q, scale.float()


def _check_fp8(m, n, k, has_bias, config=None):
    xq, xs = _quantize_rowwise(_randn(m, k, seed=m * 13 + k))
    wq, ws = _quantize_rowwise(_randn(n, k, seed=n * 7 + k + 2))
    bias = _randn(n, seed=n).to(torch.bfloat16) if has_bias else None
    out = ops.f8f8bf16_rowwise(xq, wq, xs, ws, bias, config=config)
    ref = (xq.float() @ wq.float().T) * xs[:, None] * ws[None, :]
    if has_bias:
        ref = ref + bias.float()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    rms = ref.pow(2).mean().sqrt().item()
    torch.testing.assert_close(out.float(), ref, atol=1e-2 * rms, rtol=1e-2,
                               msg=lambda s: f"f8f8bf16_rowwise {m}x{n}x{k} bias={has_bias} {config}: {s}")


@pytest.mark.parametrize("case", _cases("f8f8bf16_rowwise", [{"has_bias": True}, {"has_bias": False}]),
                         ids=_case_id)
def test_f8f8bf16_rowwise_every_config(case):
    sig, config = case
    _skip_invalid("f8f8bf16_rowwise", sig, config)
    for m, n, k in FP8_SHAPES:
        _check_fp8(m, n, k, sig["has_bias"], config)


@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("nk", DEFAULT_NK, ids=lambda nk: f"N{nk[0]}K{nk[1]}")
def test_f8f8bf16_rowwise_default_config(nk, has_bias):
    for m in DEFAULT_M:
        _check_fp8(m, *nk, has_bias)
