"""Hopper CuTe GEMMs (bf16_gemm, f8f8bf16_rowwise) against an fp32 torch reference (sm_90 GPUs).

Every config of both templates runs on a few awkward shapes (M = 1 and M not a multiple of the
tile, N and K not multiples of the tile, K shorter than one k-tile, several persistent waves);
the default (heuristic) config runs over M in {1, 7, 128, 1000, 4096} x (N, K) up to
(8192, 28672). The op layer must reject N / K that break TMA's 16-byte row alignment.

Tolerances (the reference is fp32 math on the same inputs, TF32 off):
  bf16 out: |out - ref| <= 1e-2 + 1e-2 |ref|  (bf16 rounding is 2^-9 relative)
  fp16 out: |out - ref| <= 1e-2 + 2e-3 |ref|  (fp16 rounding is 2^-11 relative)
  fp8 rowwise, bf16 out: |out - ref| <= atol + 1.6e-2 |ref| with atol = 1e-2 * rms(ref) for
  promoted accumulation (partial sums of <= 512 products) and atol = 4e-2 * rms(ref) plus a
  relative Frobenius error <= 2e-2 for fast accumulation (Hopper's FP8 wgmma keeps ~13 bits
  in its accumulator: error grows with K).
"""
import pytest
import torch

from mslk_dsl import device, ops, registry
from mslk_dsl.template import config_name
from mslk_dsl.testing import SkipUnless

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Every config: M = 1, M and N tails, K tails and K shorter than a k-tile (64 deep for 16-bit,
# 128 for FP8), several persistent waves (2100 x 2064). N and K are multiples of 16 (the FP8
# op's alignment rule; the 16-bit op needs 8).
CONFIG_SHAPES = [(1, 64, 64), (3, 48, 16), (7, 144, 208), (130, 272, 1040), (257, 528, 80),
                 (2100, 2064, 256)]
DEFAULT_M = (1, 7, 128, 1000, 4096)
DEFAULT_NK = ((128, 128), (4096, 4096), (8192, 8192), (10240, 8192), (8192, 28672))
TOL = {torch.bfloat16: dict(atol=1e-2, rtol=1e-2), torch.float16: dict(atol=1e-2, rtol=2e-3)}

# The templates target sm90a only (wgmma, TMA multicast, setmaxnreg).
pytestmark = SkipUnless(lambda: device.is_cuda() and device.compute_capability_in((9, 0)),
                        "needs an sm_90 (Hopper) GPU")


@pytest.fixture(autouse=True)
def _exact_fp32_reference():
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


def _template(op):
    (t,) = registry.get_templates(op=op, backend="cute")
    return t


def _cases(op, sigs):
    t = _template(op)
    return [(sig, c) for sig in sigs for c in t.valid_configs("sm90a", sig)]


def _case_id(case):
    sig, config = case
    return "-".join(str(v) for v in sig.values()) + "-" + config_name(config)


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
    # Both sides accumulate in fp32, in different orders (and Hopper's tensor cores truncate
    # rather than round inside a wgmma): the absolute error grows like sqrt(K).
    tol = dict(TOL[dtype], atol=TOL[dtype]["atol"] * max(1.0, (k / 4096) ** 0.5))
    torch.testing.assert_close(out.float(), ref, **tol,
                               msg=lambda s: f"bf16_gemm {m}x{n}x{k} {dtype} {config}: {s}")


@pytest.mark.parametrize("case", _cases("bf16_gemm", [{"dtype": "bfloat16"}, {"dtype": "float16"}]),
                         ids=_case_id)
def test_bf16_gemm_every_config(case):
    sig, config = case
    dtype = getattr(torch, sig["dtype"])
    for m, n, k in CONFIG_SHAPES:
        _check_bf16(m, n, k, dtype, config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("nk", DEFAULT_NK, ids=lambda nk: f"N{nk[0]}K{nk[1]}")
def test_bf16_gemm_default_config(nk, dtype):
    for m in DEFAULT_M:
        _check_bf16(m, *nk, dtype)


def test_bf16_gemm_rejects_unaligned_sizes():
    x = torch.randn(4, 100, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 100, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K=100"):
        ops.bf16_gemm(x, w)
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(100, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="N=100"):
        ops.bf16_gemm(x, w)


def test_bf16_gemm_strided_input_and_stream():
    """A column slice (not contiguous) is copied by the op layer; a side stream is honoured."""
    big = _randn(300, 512, seed=3).to(torch.bfloat16)
    x = big[:, :256]
    w = _randn(384, 256, seed=4).to(torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = ops.bf16_gemm(x, w)
    stream.synchronize()
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, **TOL[torch.bfloat16])


# ----------------------------------------------------------- f8f8bf16_rowwise
def _quantize_rowwise(t):
    """MSLK's rowwise FP8 quantization: scale = absmax / 448 per row (the dequant multiplier)."""
    scale = t.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    q = (t / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.float()


def _check_fp8(m, n, k, has_bias, config=None):
    xq, x_scale = _quantize_rowwise(_randn(m, k, seed=m * 31 + k))
    wq, w_scale = _quantize_rowwise(_randn(n, k, seed=n * 17 + k + 1))
    bias = _randn(n, seed=n).to(torch.bfloat16) if has_bias else None
    out = ops.f8f8bf16_rowwise(xq, wq, x_scale, w_scale, bias, config=config)
    ref = (xq.float() @ wq.float().T) * x_scale[:, None] * w_scale[None, :]
    if has_bias:
        ref = ref + bias.float()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    rms = ref.pow(2).mean().sqrt().item()
    fast = (config or {}).get("promote", 1) == 0
    what = f"f8f8bf16_rowwise {m}x{n}x{k} bias={has_bias} {config}"
    torch.testing.assert_close(out.float(), ref, atol=(4e-2 if fast else 1e-2) * rms, rtol=1.6e-2,
                               msg=lambda s: f"{what}: {s}")
    if fast:
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel <= 2e-2, f"{what}: relative Frobenius error {rel}"


@pytest.mark.parametrize("case", _cases("f8f8bf16_rowwise", [{"has_bias": True}, {"has_bias": False}]),
                         ids=_case_id)
def test_f8f8bf16_rowwise_every_config(case):
    sig, config = case
    for m, n, k in CONFIG_SHAPES:
        _check_fp8(m, n, k, sig["has_bias"], config)


@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("nk", DEFAULT_NK, ids=lambda nk: f"N{nk[0]}K{nk[1]}")
def test_f8f8bf16_rowwise_default_config(nk, has_bias):
    for m in DEFAULT_M:
        _check_fp8(m, *nk, has_bias)


def test_f8f8bf16_rowwise_promotion_is_accurate():
    """With promotion the long-K error stays at bf16 rounding level (a few 1e-3 of rms)."""
    m, n, k = 256, 512, 28672
    xq, x_scale = _quantize_rowwise(_randn(m, k, seed=1))
    wq, w_scale = _quantize_rowwise(_randn(n, k, seed=2))
    ref = (xq.float() @ wq.float().T) * x_scale[:, None] * w_scale[None, :]
    for config in _template("f8f8bf16_rowwise").valid_configs("sm90a", {"has_bias": False}):
        if config["promote"]:
            out = ops.f8f8bf16_rowwise(xq, wq, x_scale, w_scale, config=config)
            rel = ((out.float() - ref).norm() / ref.norm()).item()
            assert rel <= 4e-3, f"{config_name(config)}: relative Frobenius error {rel}"


def test_f8f8bf16_rowwise_rejects_unaligned_sizes():
    xq = torch.zeros(4, 100, device="cuda", dtype=FP8)
    wq = torch.zeros(64, 100, device="cuda", dtype=FP8)
    ones = torch.ones(64, device="cuda")
    with pytest.raises(ValueError, match="K=100"):
        ops.f8f8bf16_rowwise(xq, wq, ones[:4], ones)
    xq = torch.zeros(4, 64, device="cuda", dtype=FP8)
    wq = torch.zeros(100, 64, device="cuda", dtype=FP8)
    with pytest.raises(ValueError, match="N=100"):
        ops.f8f8bf16_rowwise(xq, wq, ones[:4], torch.ones(100, device="cuda"))
