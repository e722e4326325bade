"""RMSNorm / fused residual-add RMSNorm CuTe kernels against a torch fp32 reference (sm_90 GPUs).

Every valid config of both templates, both dtypes, runs T in {1, 3, 1000, 16384} x hidden in
{5120, 7168, 8192, 16384} (aligned rows: 128-bit configs) and hidden 4095 (unaligned rows: scalar
configs), plus short rows (fewer vectors than threads), rows longer than a config's register tile
(the streamed rest of the row; for a clustered config, of each CTA's share) and odd hidden sizes.
The heuristic's choice runs on all of them.

Tolerance: y within one unit in the last place of the dtype (bf16 2^-7, fp16 2^-10 relative
spacing) of the reference rounded from fp32 math. Both sides round the same fp32 formula once;
they differ only by the fp32 summation order and the hardware rsqrt (~1e-6 relative), which can
move a value across one rounding boundary, never two. new_residual is an fp32 add rounded once:
bit-exact.
"""
import itertools

import pytest
import torch
from norm_reference import ref_rmsnorm, ref_rmsnorm_add

from mslk_dsl import jit, ops, registry
from mslk_dsl.ops.norm import MAX_HIDDEN
from mslk_dsl.template import config_name
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates._rowwise_plan import RowTile
from mslk_dsl.testing import skipUnlessCudaCapability

SM90 = skipUnlessCudaCapability((9, 0))

OPS = ("rmsnorm", "rmsnorm_add")
DTYPES = (torch.bfloat16, torch.float16)
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
MIN_EXPONENT = {torch.bfloat16: -126, torch.float16: -14}
EPS = 1e-6

TOKENS = (1, 3, 1000, 16384)
# Aligned rows (N % 8 == 0): the model sizes, then short rows (fewer vectors than threads), and
# rows past the 2048 / 4096 / 8192 tiles of the smaller configs (their streamed rest).
ALIGNED = [(t, n) for t in TOKENS for n in (5120, 7168, 8192, 16384)] + [
    (1, 8), (5, 256), (67, 1032), (130, 2056), (7, 4104), (9, 12296),
    (1000, 128), (33, 512), (257, 768), (3, 64)]   # the short-row tiles (4, 8, 16 rows per CTA)
# Rows of 8-byte accesses (N a multiple of 4, not of 8) and of 4-byte ones (N even, not a multiple
# of 4): the 128-bit configs cut into quads or pairs of elements (also past their tiles); odd N:
# the one-element configs (also past their 4096 tile).
NARROW_ROWS = ([(t, 4100) for t in TOKENS] + [(1, 4), (7, 12), (67, 1036), (4, 5124), (9, 12300), (2, 16380)]
               + [(t, 4098) for t in TOKENS] + [(1, 2), (7, 14), (67, 1034), (4, 5122), (9, 12294), (2, 16382)]
               + [(65, 722), (9, 826), (17, 132)])
UNALIGNED = NARROW_ROWS + [(t, 4095) for t in TOKENS] + [(1, 1), (7, 13), (3, 4097), (4, 5121), (2, 16383),
                                                         (33, 379), (9, 1309), (5, 971)]


# Values compared at a time: the comparison's fp32 temporaries of a 16384 x 16384 output would
# take several GiB at once (enough to exhaust the GPU when test processes share it).
ULP_CHUNK = 1 << 24


def assert_within_one_ulp(got, want, what):
    """|got - want| <= one ulp of the dtype at max(|got|, |want|), elementwise; and at most 1%
    of the values inexact (a summation-order difference flips ~1e-4 of them; rounding twice,
    e.g. through the dtype before the weight multiply, flips ~25%)."""
    dtype = want.dtype
    got_flat, want_flat = got.reshape(-1), want.reshape(-1)
    assert got_flat.numel() == want_flat.numel(), f"{what}: {got_flat.numel()} values, want {want_flat.numel()}"
    compared = bad = inexact = 0
    first = None
    for start in range(0, want_flat.numel(), ULP_CHUNK):
        g, w = got_flat[start:start + ULP_CHUNK].float(), want_flat[start:start + ULP_CHUNK].float()
        assert torch.equal(torch.isnan(g), torch.isnan(w)), f"{what}: NaNs differ"
        ok = ~torch.isnan(w)
        g, w = g[ok], w[ok]
        exponent = torch.frexp(torch.maximum(g.abs(), w.abs())).exponent - 1
        ulp = torch.ldexp(torch.ones_like(w), exponent.clamp(min=MIN_EXPONENT[dtype]) - MANTISSA_BITS[dtype])
        err = (g - w).abs()
        over = err > ulp
        count = int(over.sum())
        if count and first is None:
            i = int(torch.nonzero(over)[0])
            first = f"got {g[i].item()}, want {w[i].item()} (ulp {ulp[i].item()})"
        compared, bad, inexact = compared + w.numel(), bad + count, inexact + int((err > 0).sum())
    if bad:
        raise AssertionError(f"{what}: {bad} of {compared} values off by more than one ulp; first: {first}")
    assert inexact <= 0.01 * compared + 4, f"{what}: {inexact} of {compared} values inexact"


def _inputs(m, n, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed + 7919 * m + n)
    x, residual, weight = (torch.randn(*s, device="cuda", generator=g).to(dtype) for s in ((m, n), (m, n), (n,)))
    return x, residual, weight


def _check(op, m, n, dtype, config=None, eps=EPS):
    x, residual, weight = _inputs(m, n, dtype)
    x0, r0 = x.clone(), residual.clone()
    what = f"{op} {dtype} {m}x{n} {config and config_name(config)}"
    if op == "rmsnorm":
        y = ops.rmsnorm(x, weight, eps, config=config)
        want = ref_rmsnorm(x, weight, eps)
    else:
        y, new_residual = ops.rmsnorm_add(x, residual, weight, eps, config=config)
        want, want_residual = ref_rmsnorm_add(x, residual, weight, eps)
        assert torch.equal(new_residual, want_residual), f"{what}: new_residual is not bit-exact"
    assert torch.equal(x, x0) and torch.equal(residual, r0), f"{what}: an input was modified"
    assert y.shape == (m, n) and y.dtype == dtype
    assert_within_one_ulp(y, want, what)


def _template(op):
    (t,) = registry.get_templates(op=op, backend="cute")
    return t


def _sig(n, dtype):
    return {"vec_bytes": limits.contiguous_vector_bytes(n, dtype.itemsize), "dtype": str(dtype).removeprefix("torch."),
            "fp32_weight": False}


def _cases():
    t = _template("rmsnorm")
    return [(dtype, c) for dtype in DTYPES for c in t.all_configs()
            if any(t.valid(c, "sm90a", _sig(n, dtype)) for n in (8, 9, 10))]


def _case_id(case):
    dtype, config = case
    return f"{str(dtype).removeprefix('torch.')}-{config_name(config)}"


@SM90
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", _cases(), ids=_case_id)
def test_every_config(op, case):
    dtype, config = case
    t = _template(op)
    # Tiles longer than the shapes above (the 1024-thread CTAs, clusters): also a row past the
    # whole tile, whose CTAs (each its share, in a cluster) stream the rest (up to the ops' limit).
    row_k = RowTile.of(config).row_k
    longer = [(2, min(row_k + n, MAX_HIDDEN)) for n in (1032, 1036, 1034)] if row_k > 16384 else []
    for m, n in ALIGNED + UNALIGNED + longer:
        if t.valid(config, "sm90a", _sig(n, dtype)):
            _check(op, m, n, dtype, config)


@SM90
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_heuristic(op, dtype):
    for m, n in ALIGNED + UNALIGNED:
        _check(op, m, n, dtype)


@SM90
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", _cases(), ids=_case_id)
def test_writes_stay_in_bounds(op, case):
    """Outputs placed between guard rows: rows past M in the last CTA and vectors past N must
    not be written (M = 5 leaves idle rows in 2- and 4-row CTAs)."""
    dtype, config = case
    t = _template(op)
    for n in (4104, 4100, 4098, 4095, 13):
        sig = _sig(n, dtype)
        if not t.valid(config, "sm90a", sig):
            continue
        m = 5
        kernel = jit.get_kernel(t, config, "sm90a", sig)
        x, residual, weight = _inputs(m, n, dtype, seed=1)
        guard = float("nan")
        y_buf = torch.full((m + 2, n), guard, device="cuda", dtype=dtype)
        r_buf = torch.full((m + 2, n), guard, device="cuda", dtype=dtype)
        y, new_residual = y_buf[1:-1], r_buf[1:-1]
        if op == "rmsnorm":
            kernel(x, weight, y, EPS)
            want = ref_rmsnorm(x, weight, EPS)
        else:
            kernel(x, residual, weight, y, new_residual, EPS)
            want, want_residual = ref_rmsnorm_add(x, residual, weight, EPS)
            assert torch.equal(new_residual, want_residual)
            assert r_buf[0].isnan().all() and r_buf[-1].isnan().all(), "new_residual written out of bounds"
        torch.cuda.synchronize()
        assert y_buf[0].isnan().all() and y_buf[-1].isnan().all(), f"y written out of bounds (N={n})"
        assert_within_one_ulp(y, want, f"{op} bounds {config_name(config)} N={n}")


@SM90
@pytest.mark.parametrize("op", OPS)
def test_special_values(op):
    # eps is added to the mean square (a large one moves every value by many ulps).
    _check(op, 5, 4104, torch.bfloat16, eps=0.5)
    _check(op, 3, 4095, torch.float16, eps=0.5)
    # Constant rows normalize to the weight; all-zero rows give zeros (rsqrt(eps) is finite);
    # large fp16 values must not overflow the fp32 sum of squares; a NaN poisons only its row.
    n = 5120
    x = torch.full((4, n), 200.0, device="cuda", dtype=torch.float16)
    x[1] = 0.0
    x[2] = 60000.0
    x[3, 17] = float("nan")
    w = torch.ones(n, device="cuda", dtype=torch.float16)
    if op == "rmsnorm":
        y = ops.rmsnorm(x, w, EPS)
    else:
        y, _ = ops.rmsnorm_add(x, torch.zeros_like(x), w, EPS)
    torch.testing.assert_close(y[0], torch.ones_like(y[0]), atol=1e-3, rtol=0)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    torch.testing.assert_close(y[2], torch.ones_like(y[2]), atol=1e-3, rtol=0)
    assert y[3].isnan().all()


# Rows of one element per access (odd N) whose tensors all sit at one offset from a 16-byte
# boundary run their aligned middle in 128-bit vectors and the edges (head and tail) one element
# at a time (_cute_rowwise.PhasedRow); tensors at different offsets run one element at a time
# throughout. (inputs' offset, outputs' offset) in elements: row r of a tensor at offset o starts
# o + r N elements past a boundary, so the 9 or more rows below meet every head length.
PHASE_OFFSETS = [(0, 0), (3, 3), (7, 7), (5, 0), (0, 1)]
PHASE_SHAPES = [(9, 1), (9, 7), (17, 13), (11, 1037), (3, 4097), (40, 379), (9, 771), (9, 2047), (5, 6001), (3, 12289), (2, 16383)]


def _at_offset(m, n, dtype, offset, values=None):
    """(a compact [m, n] tensor ``offset`` elements into a buffer, the buffer); the buffer's
    other elements are NaN guards."""
    buf = torch.full((offset + m * n + 8,), float("nan"), device="cuda", dtype=dtype)
    t = buf[offset:offset + m * n].view(m, n)
    if values is not None:
        t.copy_(values)
    return t, buf


def _guards_intact(buf, offset, count):
    return bool(buf[:offset].isnan().all() and buf[offset + count:].isnan().all())


@SM90
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp32_weight", [False, True], ids=["weight_as_x", "fp32_weight"])
def test_one_element_rows_at_every_offset(op, dtype, fp32_weight):
    for m, n in PHASE_SHAPES:
        x0, r0, w = _inputs(m, n, dtype, seed=3)
        if fp32_weight:
            w = torch.rand(n, device="cuda") + 0.5
        for x_off, out_off in PHASE_OFFSETS:
            what = f"{op} {dtype} {m}x{n} offsets {x_off}/{out_off} fp32_weight={fp32_weight}"
            x, _ = _at_offset(m, n, dtype, x_off, x0)
            r, _ = _at_offset(m, n, dtype, x_off, r0)
            y, y_buf = _at_offset(m, n, dtype, out_off)
            if op == "rmsnorm":
                ops.rmsnorm(x, w, EPS, out=y)
                want = ref_rmsnorm(x, w, EPS)
            else:
                new_residual, r_buf = _at_offset(m, n, dtype, out_off)
                ops.rmsnorm_add(x, r, w, EPS, out=(y, new_residual))
                want, want_residual = ref_rmsnorm_add(x, r, w, EPS)
                assert torch.equal(new_residual, want_residual), f"{what}: new_residual is not bit-exact"
                assert _guards_intact(r_buf, out_off, m * n), f"{what}: new_residual written out of bounds"
            assert _guards_intact(y_buf, out_off, m * n), f"{what}: y written out of bounds"
            assert_within_one_ulp(y, want, what)


WEIGHT_VECTOR_SHAPES = [(9, 7), (17, 13), (40, 379), (11, 1037), (9, 2047), (3, 4097), (5, 6001), (2, 16383),
                        (3, 20011)]   # the last longer than every tile: the weight of the streamed rest too


@SM90
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp32_weight", [False, True], ids=["weight_as_x", "fp32_weight"])
def test_weight_vector_configs_at_every_offset(op, dtype, fp32_weight):
    """The "vectors" weight configs (a phased row's weight read in 16-byte loads and moved into
    place in registers; some with the phased kernel's registers capped) at every offset of x from
    a 16-byte boundary and every offset of the weight (its own, independent of x's: 0-7
    elements), each config forced."""
    t = _template(op)
    sig = {"dtype": str(dtype).removeprefix("torch."), "vec_bytes": dtype.itemsize, "fp32_weight": fp32_weight}
    configs = [c for c in t.all_configs() if c.get("weight") == "vectors" and t.valid(c, "sm90a", sig)]
    assert configs
    for config, (m, n) in itertools.product(configs, WEIGHT_VECTOR_SHAPES):
        x0, r0, w0 = _inputs(m, n, dtype, seed=5)
        wdtype = torch.float32 if fp32_weight else dtype
        for x_off, w_off in ((0, 0), (3, 0), (0, 5), (7, 1), (5, 7), (2, 2), (1, 6), (6, 3), (4, 4)):
            what = f"{op} {dtype} {m}x{n} {config_name(config)} x offset {x_off} weight offset {w_off}"
            x, _ = _at_offset(m, n, dtype, x_off, x0)
            r, _ = _at_offset(m, n, dtype, x_off, r0)
            w, _ = _at_offset(1, n, wdtype, w_off, w0.to(wdtype).view(1, n))
            w = w.view(n)
            y, y_buf = _at_offset(m, n, dtype, x_off)
            if op == "rmsnorm":
                ops.rmsnorm(x, w, EPS, out=y, config=config)
                want = ref_rmsnorm(x, w, EPS)
            else:
                new_residual, _ = _at_offset(m, n, dtype, x_off)
                ops.rmsnorm_add(x, r, w, EPS, out=(y, new_residual), config=config)
                want, want_residual = ref_rmsnorm_add(x, r, w, EPS)
                assert torch.equal(new_residual, want_residual), f"{what}: new_residual is not bit-exact"
            assert _guards_intact(y_buf, x_off, m * n), f"{what}: y written out of bounds"
            assert_within_one_ulp(y, want, what)


def test_configs_cover_every_signature():
    # Runs on the CPU too: every signature has a config and the heuristic picks a valid one.
    for op in OPS:
        t = _template(op)
        for sig in t.all_signatures():
            assert t.valid_configs("sm90a", sig), (op, sig)
            for n, m in itertools.product((1, 8, 1000, 4095, 5120, 7168, 8192, 16384, 16385, 33001, 65536,
                                           131071, 262144), (1, 4, 200, 5000)):
                c = t.heuristic("sm90a", sig, {"M": m, "N": n})
                assert t.valid(c, "sm90a", sig) and c in t.all_configs(), (op, sig, n, c)
