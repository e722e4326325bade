"""RMSNorm / fused residual-add RMSNorm FlyDSL kernels against a torch reference (ROCm GPUs).

Every valid config of both templates runs on shapes that stress its paths: row tails (M not a
multiple of the rows per block), rows shorter than a chunk, longer than every chunk (several
passes), odd N (unaligned, scalar configs only) and the common hidden sizes.
"""
import pytest
import torch
from norm_reference import ref_rmsnorm, ref_rmsnorm_add

from mslk_dsl import ops, registry
from mslk_dsl.testing import skipUnlessRocm

OPS = ("rmsnorm", "rmsnorm_add")
# N % 8 == 0 (16-byte rows): every config. 24576 exceeds every config's chunk.
ALIGNED_SHAPES = [(1, 8), (3, 256), (67, 1024), (130, 2048), (5, 4096), (33, 5120), (9, 7168),
                  (4, 16384), (2, 24576)]
# Any N: the scalar (vec 1) configs only.
UNALIGNED_SHAPES = [(1, 1), (7, 1), (5, 13), (3, 4097), (4, 5121), (2, 16383), (2, 20001)]
# N even, not a multiple of 8: 4-byte accesses.
WORD_SHAPES = [(1, 2), (5, 14), (3, 4098), (2, 16382)]
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2), torch.float16: dict(atol=4e-3, rtol=2e-3)}


def _configs(op):
    """(config, any_n) for every bf16 config: 16-byte configs on aligned rows, scalar configs on
    aligned and unaligned rows (both signatures)."""
    (t,) = registry.get_templates(op=op, backend="flydsl")
    bf16 = {"vec_bytes": 16, "dtype": "bfloat16", "fp32_weight": False}
    return [(c, c["vec"] == 1) for c in t.all_configs() if t.valid(c, "gfx942", bf16)]


def _name(case):
    c, any_n = case
    return f"t{c['threads']}r{c['rows']}v{c['vec']}x{c['tiles']}"


def _run(op, x, weight, eps, config=None, residual=None):
    if op == "rmsnorm":
        return ops.rmsnorm(x, weight, eps, config=config), None
    return ops.rmsnorm_add(x, residual, weight, eps, config=config)


def _check(op, m, n, dtype, config=None, eps=1e-6, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed + 7 * m + n)
    x = torch.randn(m, n, device="cuda", dtype=dtype, generator=g)
    residual = torch.randn(m, n, device="cuda", dtype=dtype, generator=g)
    weight = torch.randn(n, device="cuda", dtype=dtype, generator=g)
    x0, r0 = x.clone(), residual.clone()
    y, new_residual = _run(op, x, weight, eps, config, residual)
    torch.cuda.synchronize()
    assert torch.equal(x, x0) and torch.equal(residual, r0), "inputs were modified"
    if op == "rmsnorm":
        want = ref_rmsnorm(x, weight, eps)
    else:
        want, want_residual = ref_rmsnorm_add(x, residual, weight, eps)
        # The add is rounded once from fp32 on both sides: bit-exact.
        assert torch.equal(new_residual, want_residual), f"new_residual differs for {m}x{n}"
    assert y.shape == (m, n) and y.dtype == dtype
    torch.testing.assert_close(y, want, **TOL[dtype], msg=lambda s: f"{op} {m}x{n} {config}: {s}")


@skipUnlessRocm
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", _configs("rmsnorm"), ids=_name)
def test_every_config_bf16(op, case):
    config, any_n = case
    # 16-byte configs serve rows of 4-byte accesses too (N even), cut into pairs of elements.
    for m, n in ALIGNED_SHAPES + WORD_SHAPES + (UNALIGNED_SHAPES if any_n else []):
        _check(op, m, n, torch.bfloat16, config)


@skipUnlessRocm
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (64, 128), (17, 4096), (9, 5121), (8, 7168),
                                   (3, 16384), (2, 33000)], ids=str)
def test_heuristic(op, dtype, shape):
    _check(op, *shape, dtype)


@skipUnlessRocm
@pytest.mark.parametrize("op", OPS)
def test_eps_and_large_values(op):
    # eps matters when the rows are tiny; large values must not overflow the fp32 sum.
    _check(op, 5, 4096, torch.bfloat16, eps=1e-2, seed=3)
    x = torch.full((3, 5120), 200.0, device="cuda", dtype=torch.float16)
    w = torch.ones(5120, device="cuda", dtype=torch.float16)
    y, _ = _run(op, x, w, 1e-6, residual=torch.zeros_like(x))
    torch.testing.assert_close(y, torch.ones_like(y), atol=2e-3, rtol=0)


@skipUnlessRocm
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 8), (5, 13), (64, 4096), (9, 5121), (8, 7168), (3, 65536)], ids=str)
def test_fp32_weight_and_fp32_x(op, dtype, shape):
    """An fp32 weight (read as two 16-byte vectors under 8 bf16 / fp16 values; fp32 x is the
    plain fp32 kernel), results in x's dtype, against the fp32 formula rounded once."""
    m, n = shape
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x, residual = (torch.randn(m, n, device="cuda", generator=g).to(dtype) for _ in range(2))
    weight = torch.rand(n, device="cuda", generator=g) + 0.5
    y, new_residual = _run(op, x, weight, 1e-6, residual=residual)
    h = x if op == "rmsnorm" else (x.float() + residual.float()).to(dtype)
    hf = h.float()
    want = (hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + 1e-6) * weight).to(dtype)
    assert y.dtype == dtype
    tol = TOL.get(dtype, dict(atol=2e-5, rtol=2e-5))
    torch.testing.assert_close(y, want, **tol)
    if new_residual is not None:
        assert torch.equal(new_residual, h)


def test_configs_cover_every_vector_width():
    # Runs on the CPU: every unaligned signature has a config and the heuristic picks valid ones.
    for op in OPS:
        (t,) = registry.get_templates(op=op, backend="flydsl")
        for target in t.targets:
            for sig in t.all_signatures():
                assert t.valid_configs(target, sig), (op, target, sig)
                for n in (1, 8, 1000, 5120, 7168, 16384, 65536):
                    c = t.heuristic(target, sig, {"M": 4, "N": n})
                    assert t.valid(c, target, sig) and c in t.all_configs(), (op, sig, n, c)
