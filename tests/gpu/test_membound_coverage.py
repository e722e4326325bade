"""The memory-bound ops' wider coverage on sm_90 GPUs and on ROCm ones (skipUnlessCudaCapability
passes ROCm through, so the same tests check the FlyDSL kernels there): fp32 norms, an fp32 weight
with bf16 / fp16 x, an fp32 residual with bf16 / fp16 x, no weight, rows of 32K to 256K elements, and MSLK's valid_token_count on
silu_mul / silu_mul_quant.

fp32 norms are compared with quack's reference formula (x / sqrt(mean(x^2) + eps) * w, all fp32;
its residual form normalizes x + residual, which is exact in fp32): the kernels' fp32 results
differ from it only by the summation order and the hardware rsqrt, ~1e-6 relative. 16-bit results
(mixed weight, long rows) are within one ulp of the fp32 formula rounded once (test_norm_cute).
"""
import pytest
import torch
from test_norm_cute import _at_offset, _guards_intact, assert_within_one_ulp

from mslk_dsl import ops
from mslk_dsl.template import config_name
from mslk_dsl.testing import skipUnlessCudaCapability

SM90 = skipUnlessCudaCapability((9, 0))
EPS = 1e-6


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def quack_rmsnorm_ref(x, w, residual=None, eps=EPS):
    """quack's rmsnorm_ref (quack/rmsnorm.py): fp32 math, results in x's dtype."""
    xf = x.float()
    if residual is not None:
        xf = xf + residual.float()
    out = xf / torch.sqrt(torch.mean(xf.square(), dim=-1, keepdim=True) + eps) * w.float()
    return out.to(x.dtype), xf.to(x.dtype)


def _run(op, x, residual, w):
    if op == "rmsnorm":
        return ops.rmsnorm(x, w, EPS), None
    return ops.rmsnorm_add(x, residual, w, EPS)


@SM90
@pytest.mark.parametrize("op", ["rmsnorm", "rmsnorm_add"])
@pytest.mark.parametrize("m, n", [(1, 8), (3, 4095), (1000, 4096), (257, 7168), (64, 20000), (5, 65536),
                                  (2, 131072),
                                  (7, 4098), (1, 2), (33, 20002),    # rows of 8-byte accesses: 2 elements each
                                  (3000, 128), (65, 722), (33, 1309),   # the short-row tiles
                                  # odd rows of one element per access: the 8- and 16-lane group tiles
                                  (17, 45), (1001, 69), (37, 75), (9, 201), (37, 301), (5, 509)])
def test_fp32_norms_match_quacks_formula(op, m, n):
    g = _gen(m * 31 + n)
    x, residual = (torch.randn(m, n, device="cuda", generator=g) for _ in range(2))
    w = torch.randn(n, device="cuda", generator=g)
    y, new_residual = _run(op, x, residual, w)
    want, want_residual = quack_rmsnorm_ref(x, w, residual if op == "rmsnorm_add" else None)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, want, rtol=2e-5, atol=2e-5)
    if new_residual is not None:
        assert torch.equal(new_residual, want_residual)


@SM90
@pytest.mark.parametrize("op", ["rmsnorm", "rmsnorm_add"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m, n", [(1, 8), (7, 13), (1000, 4096), (130, 5120), (33, 14336), (3, 4097),
                                  # long rows: clusters holding the two-part fp32 weight, aligned or not
                                  (3, 65536), (2, 131072), (2, 262144), (3, 65535), (5, 20001),
                                  # rows of 8-byte accesses: the fp32 weight read 16 bytes per 4 values
                                  (9, 4100), (2, 65540),
                                  # the short-row tiles (4-16 rows per CTA), of each access width
                                  (3000, 128), (65, 722), (257, 764), (33, 1309),
                                  # odd rows of one element per access: the 8- and 16-lane group tiles
                                  (17, 45), (1001, 69), (9, 201), (37, 301)])
def test_fp32_weight_with_16_bit_x(op, dtype, m, n):
    """Mixed-precision checkpoints: the weight stays fp32, y (and new_residual) take x's dtype."""
    g = _gen(m * 17 + n)
    x, residual = (torch.randn(m, n, device="cuda", generator=g).to(dtype) for _ in range(2))
    w = torch.rand(n, device="cuda", generator=g) + 0.5   # values a bf16 weight could not hold
    y, new_residual = _run(op, x, residual, w)
    h = x if op == "rmsnorm" else (x.float() + residual.float()).to(dtype)
    want, _ = quack_rmsnorm_ref(h, w)
    assert y.dtype == dtype
    assert_within_one_ulp(y, want, f"{op} {dtype} {m}x{n} fp32 weight")
    if new_residual is not None:
        assert torch.equal(new_residual, h)
    # The fp32 weight is used as such, not rounded to x's dtype first.
    rounded, _ = quack_rmsnorm_ref(h, w.to(dtype))
    assert not torch.equal(y, rounded) or n < 64


@SM90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("w_dtype", ["x", "float32", None])
@pytest.mark.parametrize("m, n", [(1, 8), (7, 13), (1000, 4096), (33, 14336), (3, 4097), (2, 65536), (5, 20001),
                                  (65, 722), (17, 45), (9, 4100), (3, 4098)])
def test_fp32_residual_with_16_bit_x(dtype, w_dtype, m, n):
    """A residual stream kept in fp32 (quack's residual_dtype=torch.float32): new_residual is the
    exact fp32 sum, y (x's dtype) is normalized from that sum, within one ulp of quack's formula
    on it, eager, through torch.ops and into out= tensors."""
    g = _gen(m * 13 + n)
    x = torch.randn(m, n, device="cuda", generator=g).to(dtype)
    residual = torch.randn(m, n, device="cuda", generator=g) * 30
    w = None if w_dtype is None else (torch.rand(n, device="cuda", generator=g) + 0.5).to(
        dtype if w_dtype == "x" else torch.float32)
    y, new_residual = ops.rmsnorm_add(x, residual, w, EPS)
    h = x.float() + residual
    want, _ = quack_rmsnorm_ref(h, torch.ones(n, device="cuda") if w is None else w)
    assert y.dtype == dtype and new_residual.dtype == torch.float32
    assert torch.equal(new_residual, h)
    assert_within_one_ulp(y, want.to(dtype), f"rmsnorm_add {dtype} {m}x{n} fp32 residual, weight {w_dtype}")
    y_op, res_op = torch.ops.mslk_dsl.rmsnorm_add(x, residual, w, EPS)
    assert torch.equal(y_op, y) and torch.equal(res_op, new_residual)
    out = (torch.empty_like(y), torch.empty_like(new_residual))
    ops.rmsnorm_add(x, residual, w, EPS, out=out)
    assert torch.equal(out[0], y) and torch.equal(out[1], new_residual)


@SM90
@pytest.mark.parametrize("op", ["rmsnorm", "rmsnorm_add"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m, n", [(3, 32768), (300, 65536), (17, 131072), (2, 262144), (5, 65544), (3, 65535)])
def test_long_rows(op, dtype, m, n):
    g = _gen(m + n)
    x, residual = (torch.randn(m, n, device="cuda", generator=g).to(dtype) for _ in range(2))
    w = torch.randn(n, device="cuda", generator=g).to(dtype)
    y, new_residual = _run(op, x, residual, w)
    h = x if op == "rmsnorm" else (x.float() + residual.float()).to(dtype)
    want, _ = quack_rmsnorm_ref(h, w)
    if dtype == torch.float32:
        torch.testing.assert_close(y, want, rtol=2e-5, atol=2e-5)
    else:
        assert_within_one_ulp(y, want, f"{op} {dtype} {m}x{n}")
    if new_residual is not None:
        assert torch.equal(new_residual, h)


@SM90
@pytest.mark.parametrize("op", ["rmsnorm", "rmsnorm_add"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m, n", [(1, 8), (1000, 4096), (33, 1309), (17, 45), (5, 65536), (7, 4098)])
def test_no_weight_is_a_weight_of_ones(op, dtype, m, n):
    """weight=None (torch's F.rms_norm, quack's rmsnorm without one): the same bytes as a weight of
    ones, eager and through torch.ops; torch's F.rms_norm agrees within one ulp."""
    g = _gen(m * 7 + n)
    x, residual = (torch.randn(m, n, device="cuda", generator=g).to(dtype) for _ in range(2))
    ones = torch.ones(n, device="cuda", dtype=dtype)
    got, got_residual = _run(op, x, residual, None)
    want, want_residual = _run(op, x, residual, ones)
    assert torch.equal(got, want)
    if op == "rmsnorm":
        assert torch.equal(torch.ops.mslk_dsl.rmsnorm(x, None, EPS), want)
        h = x
    else:
        assert torch.equal(got_residual, want_residual)
        h = want_residual
    torch_y = torch.nn.functional.rms_norm(h.float(), (n,), eps=EPS).to(dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got, torch_y, rtol=2e-5, atol=2e-5)
    else:
        assert_within_one_ulp(got, torch_y, f"{op} {dtype} {m}x{n} no weight")


def _silu_mul_ref(x0, x1):
    return (torch.nn.functional.silu(x0.float()) * x1.float()).to(x0.dtype)


@SM90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("m, k, n", [(1000, 4096, 617), (1000, 4096, 0), (1000, 4096, 1000), (64, 5120, 5000),
                                     (5, 13, 3), (3000, 14336, 1)])
def test_silu_mul_valid_token_count_leaves_later_rows_untouched(dtype, m, k, n):
    g = _gen(m + k + n)
    x0, x1 = (torch.randn(m, k, device="cuda", generator=g).to(dtype) for _ in range(2))
    count = torch.tensor([n], dtype=torch.int32, device="cuda")
    sentinel = torch.full((m, k), 12345.0, device="cuda", dtype=dtype)
    out = sentinel.clone()
    ops.silu_mul(x0, x1, count, out=out)
    v = min(n, m)
    torch.testing.assert_close(out[:v], _silu_mul_ref(x0[:v], x1[:v]), rtol=2e-2, atol=1e-5)
    assert torch.equal(out[v:], sentinel[v:]), "a row past valid_token_count was written"
    # Without the count every row is computed; the allocating form agrees on the valid rows.
    torch.testing.assert_close(ops.silu_mul(x0, x1)[:v], out[:v], rtol=0, atol=0)
    torch.testing.assert_close(ops.silu_mul(x0, x1, count)[:v], out[:v], rtol=0, atol=0)


@SM90
@pytest.mark.parametrize("m, k, n", [(1000, 4096, 617), (1000, 4096, 0), (64, 5120, 64), (3000, 14336, 2999),
                                     (7, 13, 2), (4, 20480, 3)])
@pytest.mark.parametrize("with_ub", [False, True])
def test_silu_mul_quant_valid_token_count_leaves_later_rows_untouched(m, k, n, with_ub):
    g = _gen(m + k + n)
    x0, x1 = (torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    ub = torch.tensor([1.5], device="cuda") if with_ub else None
    count = torch.tensor([n], dtype=torch.int32, device="cuda")
    want_q, want_s = ops.silu_mul_quant(x0, x1, ub)
    xq = torch.full_like(want_q.view(torch.uint8), 0x5A).view(want_q.dtype)
    scale = torch.full_like(want_s, -7.0)
    ops.silu_mul_quant(x0, x1, ub, count, out=(xq, scale))
    v = min(n, m)
    assert torch.equal(xq[:v].view(torch.uint8), want_q[:v].view(torch.uint8))
    assert torch.equal(scale[:v], want_s[:v])
    assert (xq[v:].view(torch.uint8) == 0x5A).all(), "an xq row past valid_token_count was written"
    assert (scale[v:] == -7.0).all(), "a scale past valid_token_count was written"


@SM90
@pytest.mark.parametrize("shape", [(20, 30), (6, 4, 2, 3), (8, 300, 4096), (3, 1000, 7168), (128, 16, 2880)])
@pytest.mark.parametrize("with_ub", [False, True])
def test_quantize_fp8_row_zero_start_index_m(shape, with_ub):
    """MSLK's zero_start_index_M (one row count per [N, K] matrix, int64 as MSLK's test makes it):
    the rows past it come out as rows of zeros, whatever they hold (NaN here); the other rows as
    without it; the call replays from a CUDA graph with new counts (no host sync)."""
    from mslk_dsl import jit
    from mslk_dsl.ops import declaration

    decl = declaration.get("quantize_fp8_row")
    g = _gen(sum(shape))
    clean = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
    matrices, rows = clean[..., 0, 0].numel(), clean.shape[-2]
    counts = torch.randint(0, rows + 1, (matrices,), device="cuda", generator=g)
    past = torch.arange(rows, device="cuda").view(1, -1) >= counts.view(-1, 1)
    x = clean.masked_fill(past.view(*shape[:-1], 1), float("nan"))
    ub = torch.tensor([1.5], device="cuda") if with_ub else None
    xq, scale = ops.quantize_fp8_row(x, scale_ub=ub, zero_start_index_M=counts, use_triton=True)
    want_q, want_s = decl.reference(x.masked_fill(past.view(*shape[:-1], 1), 0.0), ub)
    assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_s)
    ops_q, ops_s = torch.ops.mslk_dsl.quantize_fp8_row(x, ub, counts)
    assert torch.equal(ops_q.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(ops_s, scale)
    graph = torch.cuda.CUDAGraph()
    with jit.jit_disabled(), torch.cuda.graph(graph):
        gq, gs = ops.quantize_fp8_row(clean, ub, counts)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gs, want_s) and torch.equal(gq.view(torch.uint8), want_q.view(torch.uint8))
    counts.fill_(rows)          # every row counted now: the replay quantizes them all
    graph.replay()
    all_q, all_s = decl.reference(clean, ub)
    torch.cuda.synchronize()
    assert torch.equal(gs, all_s) and torch.equal(gq.view(torch.uint8), all_q.view(torch.uint8))


@SM90
@pytest.mark.parametrize("shape, align", [((2, 4001), 8), ((4, 2, 13), 16), ((300, 4096), 128), ((20, 30), 16)])
def test_quantize_fp8_row_align_rows_to(shape, align):
    """MSLK's align_rows_to: xq's rows padded with zero bytes to a multiple of it, the values and
    scales bit-equal to the unpadded call; with zero_start_index_M as well; in a CUDA graph."""
    from mslk_dsl import jit
    from mslk_dsl.ops import declaration

    decl = declaration.get("quantize_fp8_row")
    x = torch.randn(shape, device="cuda", generator=_gen(sum(shape))).to(torch.bfloat16)
    k = shape[-1]
    xq, scale = ops.quantize_fp8_row(x, align_rows_to=align)
    plain_q, plain_s = ops.quantize_fp8_row(x)
    assert xq.shape[-1] == -(-k // align) * align and torch.equal(scale, plain_s)
    assert torch.equal(xq.view(torch.uint8)[..., :k], plain_q.view(torch.uint8))
    assert not xq.view(torch.uint8)[..., k:].any()
    counts = torch.zeros(x[..., 0, 0].numel(), dtype=torch.int64, device="cuda") + 1
    jq, js = ops.quantize_fp8_row(x, None, counts, True, None, align)
    want_q, want_s = decl.reference(x, None, counts, True, None, align)
    assert torch.equal(jq.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(js, want_s)
    graph = torch.cuda.CUDAGraph()
    with jit.jit_disabled(), torch.cuda.graph(graph):
        gq, gs = ops.quantize_fp8_row(x, align_rows_to=align)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gq.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(gs, scale)


def _fp32_residual_configs(vec_bytes: int = 16):
    from mslk_dsl import registry

    (t,) = registry.get_templates(op="rmsnorm_add", backend="cute")
    sig = {"vec_bytes": vec_bytes, "dtype": "bfloat16", "fp32_weight": False, "fp32_residual": True}
    return [c for c in t.all_configs() if t.valid(c, "sm90a", sig)]


# Layouts of (x and y, residual and new_residual): the elements each starts past a 16-byte
# boundary. The phased kernels take the rows where the fp32 tensors' phase matches x's modulo 4
# (x's modulo 8: _cute_rowwise.congruent), else the one-element kernels run.
ODD_ROW_LAYOUTS = {"aligned": (0, 0), "x_off4": (4, 0), "all_off1": (1, 1), "residual_off1": (0, 1),
                   "x_off2_residual_off3": (2, 3)}


@SM90
@pytest.mark.parametrize("config", _fp32_residual_configs(vec_bytes=2), ids=config_name)
def test_every_one_element_fp32_residual_config(config):
    """The fused fp32-residual kernels on odd rows (one element of x per access, the residual's
    one fp32 element; the middle of congruent rows in 16-byte vectors of each), every config:
    rows shorter than its tile, as long and longer, and the layouts of ODD_ROW_LAYOUTS (y and
    new_residual given as out= tensors at the offsets of x and the residual, in buffers of NaN
    guards): new_residual is the exact fp32 sum, y within one ulp of quack's formula on it, and
    nothing is written outside the outputs."""
    from mslk_dsl.templates._rowwise_plan import RowTile

    row_k = RowTile.of(config).row_k
    cases = [((1, 7), "aligned"), ((7, 135), "aligned"), ((3, row_k - 1), "aligned"),
             ((2, min(row_k + 1031, 262143)), "aligned"), ((5, 4097), "aligned")]
    cases += [((9, 1001), layout) for layout in ODD_ROW_LAYOUTS]
    for i, ((m, n), layout) in enumerate(cases):
        dtype = torch.float16 if i == 3 else torch.bfloat16
        x_off, r_off = ODD_ROW_LAYOUTS[layout]
        g = _gen(m * 7 + n + 11 * x_off + r_off)
        x, _ = _at_offset(m, n, dtype, x_off, torch.randn(m, n, device="cuda", generator=g))
        residual, _ = _at_offset(m, n, torch.float32, r_off, torch.randn(m, n, device="cuda", generator=g) * 30)
        w32 = i == 3 and "regs" not in config   # (the capped weight-vector configs take x's weight dtype)
        w = (torch.rand(n, device="cuda", generator=g) + 0.5).to(torch.float32 if w32 else dtype)
        y, y_buf = _at_offset(m, n, dtype, x_off)
        new_residual, r_buf = _at_offset(m, n, torch.float32, r_off)
        ops.rmsnorm_add(x, residual, w, EPS, config=config, out=(y, new_residual))
        h = x.float() + residual
        want, _ = quack_rmsnorm_ref(h, w)
        what = f"rmsnorm_add {dtype} {m}x{n} {layout} fp32 residual {config}"
        assert torch.equal(new_residual, h), what
        assert_within_one_ulp(y, want.to(dtype), what)
        assert _guards_intact(y_buf, x_off, m * n) and _guards_intact(r_buf, r_off, m * n), f"{what}: out of bounds"


@SM90
@pytest.mark.parametrize("config", _fp32_residual_configs(), ids=config_name)
def test_every_fused_fp32_residual_config(config):
    """The fused fp32-residual kernels (bf16 x, fp32 residual and new_residual; rows of vectors
    of x), every config, on rows shorter than its tile, as long as it and longer
    (the rest streamed and read again): new_residual is the exact fp32 sum and y within one ulp
    of quack's formula on it; fp16 x and an fp32 weight on the longest row."""
    from mslk_dsl.templates._rowwise_plan import RowTile

    row_k = RowTile.of(config).row_k
    # (the last two: rows of 4- and 8-byte accesses of x, 8- and 16-byte ones of the residual)
    shapes = [(1, 8), (7, 136), (3, row_k), (2, min(row_k + 1032, 262144)), (33, 4096), (5, 4098), (3, 2052)]
    for i, (m, n) in enumerate(shapes):
        dtype = torch.float16 if i == 3 else torch.bfloat16
        g = _gen(m * 7 + n)
        x = torch.randn(m, n, device="cuda", generator=g).to(dtype)
        residual = torch.randn(m, n, device="cuda", generator=g) * 30
        w = (torch.rand(n, device="cuda", generator=g) + 0.5).to(torch.float32 if i == 3 else dtype)
        y, new_residual = ops.rmsnorm_add(x, residual, w, EPS, config=config)
        h = x.float() + residual
        want, _ = quack_rmsnorm_ref(h, w)
        assert new_residual.dtype == torch.float32 and torch.equal(new_residual, h), (m, n)
        assert_within_one_ulp(y, want.to(dtype), f"rmsnorm_add {dtype} {m}x{n} fp32 residual {config}")
