"""What both backends' GEMM tests share: seeded inputs, MSLK's rowwise FP8 quantization, the
fp32 references, the tolerances, and a fixture that keeps the reference free of TF32.

Tolerances (the reference is fp32 math on the same inputs, TF32 off):
  bf16 out: |out - ref| <= 1e-2 + 1e-2 |ref|  (bf16 rounding is 2^-9 relative)
  fp16 out: |out - ref| <= 1e-2 + 2e-3 |ref|  (fp16 rounding is 2^-11 relative)
  the absolute part grows like sqrt(K / 4096) past K = 4096: both sides accumulate in fp32, in
  different orders (and Hopper's tensor cores truncate rather than round inside a wgmma).
"""
import pytest
import torch

from mslk_dsl import ops

TOL = {torch.bfloat16: dict(atol=1e-2, rtol=1e-2), torch.float16: dict(atol=1e-2, rtol=2e-3)}


@pytest.fixture(autouse=True)
def exact_fp32_reference():
    """Import into a test module to make its fp32 references exact (no TF32)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


def randn(*shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g)


def check_bf16(m, n, k, dtype, config=None):
    x = randn(m, k, seed=m * 31 + k).to(dtype)
    w = randn(n, k, seed=n * 17 + k + 1).to(dtype)
    out = ops.bf16_gemm(x, w, config=config)
    ref = x.float() @ w.float().T
    assert out.shape == (m, n) and out.dtype == dtype
    tol = dict(TOL[dtype], atol=TOL[dtype]["atol"] * max(1.0, (k / 4096) ** 0.5))
    torch.testing.assert_close(out.float(), ref, **tol,
                               msg=lambda s: f"bf16_gemm {m}x{n}x{k} {dtype} {config}: {s}")


def quantize_rowwise(t, fp8, fp8_max):
    """MSLK's rowwise FP8 quantization: scale = absmax / fp8_max per row (the dequant multiplier)."""
    scale = t.abs().amax(dim=1).clamp(min=1e-12) / fp8_max
    q = (t / scale[:, None]).clamp(-fp8_max, fp8_max).to(fp8)
    return q, scale.float()


def fp8_case(m, n, k, has_bias, fp8, fp8_max, bias_dtype=torch.bfloat16):
    """Quantized operands, their scales, a bias of ``bias_dtype`` (or None) and the fp32
    reference output."""
    xq, x_scale = quantize_rowwise(randn(m, k, seed=m * 31 + k), fp8, fp8_max)
    wq, w_scale = quantize_rowwise(randn(n, k, seed=n * 17 + k + 1), fp8, fp8_max)
    bias = randn(n, seed=n).to(bias_dtype) if has_bias else None
    ref = (xq.float() @ wq.float().T) * x_scale[:, None] * w_scale[None, :]
    if has_bias:
        ref = ref + bias.float()
    return (xq, wq, x_scale, w_scale, bias), ref
