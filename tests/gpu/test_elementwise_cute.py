"""silu_mul, quantize_fp8_row and silu_mul_quant CuTe kernels against torch references (sm_90).

References:
  * silu_mul: silu(x0) * x1 in fp32 rounded to the dtype. The kernel uses the fast exp2 and
    reciprocal units, so a value may land one ulp away (bf16/fp16); fp32 outputs within 64 ulps.
  * quantize_fp8_row: MSLK's Triton ``quantize_fp8_row`` op for op in fp32 (amax floored at 1/512
    and clamped by scale_ub, scale = amax / fp8_max by IEEE division, xq = fp8(clamp(x / scale)))
    -- bit for bit, xq and scale.
  * silu_mul_quant: bit-identical to quantize_fp8_row(silu_mul(x0, x1)).

Every valid config of the three templates runs on rows shorter than its tile, exactly one tile,
and longer than its tile (the streamed part of quantize), with a partial last CTA; the heuristic
runs on 1x1, 1x8191, 3x5000, 4096x4096, 16384x8192 and odd K. Special values: zero rows, scale_ub
below and above the row maxima, fp8 rounding ties, -0, a wide dynamic range, saturation, NaN.
"""
import pytest
import torch
import torch.nn.functional as F

from mslk_dsl import jit, ops, registry
from mslk_dsl.device import target_of
from mslk_dsl.ops import elementwise
from mslk_dsl.template import config_name
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates._rowwise_plan import RowTile
from mslk_dsl.testing import skipUnlessCudaCapability

SM90 = skipUnlessCudaCapability((9, 0))
TARGET = "sm90a"  # for the config space (validity does not depend on the target)
OPS = ("silu_mul", "quantize_fp8_row", "silu_mul_quant")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
FP8_EPS = 1.0 / 512.0  # MSLK's eps_opt default
SILU_MAX_ULPS = {torch.bfloat16: 1, torch.float16: 1, torch.float32: 64}

# The heuristic's shapes: tiny, one odd-length row, short odd rows, model-sized rows, rows of
# the short-row tiles.
SHAPES = [(1, 1), (1, 8191), (3, 5000), (4096, 4096), (16384, 8192), (7, 4097), (5, 13), (1000, 1040),
          (2, 16400), (3, 40000), (1000, 4100), (5, 4098), (2, 16388), (3, 30002),
          (3, 8194), (2, 24574), (2, 40958),   # rows of 4-byte accesses run phased (elementwise.PHASED_WORD_ROWS)
          (3000, 128), (257, 768), (65, 722), (9, 826), (33, 379), (9, 1309)]   # short rows


def _name(dtype):
    return str(dtype).removeprefix("torch.")


def COUNT():
    """The row-count argument of silu_mul / silu_mul_quant kernels without valid_token_count:
    every row."""
    return torch.full((1,), 2**31 - 1, dtype=torch.int32, device="cuda")


def _sig(op, k, dtype, ub=False):
    """The signature the op layer computes for fresh (16-byte aligned) [M, K] tensors."""
    sig = {"vec_bytes": limits.contiguous_vector_bytes(k, dtype.itemsize), "dtype": _name(dtype)}
    return sig if op == "silu_mul" else {**sig, "has_scale_ub": ub}


def _template(op):
    (t,) = registry.get_templates(op=op, backend="cute")
    return t


def _randn(m, k, dtype, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed * 1000003 + m * 7919 + k)
    return torch.randn(m, k, device=device, generator=g).to(dtype)


# ---------------------------------------------------------------------------------------------
# References.


def ref_silu_mul(x0, x1):
    return (F.silu(x0.float()) * x1.float()).to(x0.dtype)


def ref_quantize(x, scale_ub=None):
    """MSLK's Triton quantize_fp8_row, op for op in fp32. Divisions are tensor / tensor: torch
    evaluates ``tensor / python_scalar`` as a multiply by the reciprocal, Triton's div_rn does not."""
    xf = x.float()
    amax = torch.clamp(xf.abs().amax(dim=-1), min=FP8_EPS)   # tl.clamp(max|x|, EPS, ub)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.reshape(()))
    scale = amax / torch.full_like(amax, FP8_MAX)               # tl.div_rn(amax, MAX_FP8)
    xq = (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # tl.div_rn, clamp, RNE cast
    return xq, scale


# ---------------------------------------------------------------------------------------------
# Comparisons.


def ulp_distance(a, b):
    """Elementwise distance in units in the last place (+0 and -0 coincide)."""
    int_type, magnitude = {2: (torch.int16, 0x7FFF), 4: (torch.int32, 0x7FFFFFFF)}[a.element_size()]

    def ordered(t):
        i = t.contiguous().view(int_type).to(torch.int64)
        return torch.where(i < 0, -(i & magnitude), i)

    return (ordered(a) - ordered(b)).abs()


def assert_silu_close(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    d = ulp_distance(got, want)
    limit = SILU_MAX_ULPS[want.dtype]
    if (d > limit).any():
        i = int(torch.nonzero(d.flatten() > limit)[0])
        raise AssertionError(f"{what}: {int((d > limit).sum())} values more than {limit} ulp off; first: got "
                             f"{got.flatten()[i].item()}, want {want.flatten()[i].item()}")


def assert_same_bits(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype}"
    int_type = {1: torch.uint8, 4: torch.int32}[want.element_size()]
    g, w = got.contiguous().view(int_type), want.contiguous().view(int_type)
    bad = g != w
    if bad.any():
        i = tuple(int(v) for v in torch.nonzero(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {w.numel()} differ; first at {i}: got "
                             f"{got[i].float().item()} ({int(g[i])}), want {want[i].float().item()} ({int(w[i])})")


def _scale_ub(value):
    return None if value is None else torch.tensor([value], device="cuda", dtype=torch.float32)


def check(op, x0, x1=None, ub=None, config=None):
    """Run ``op`` through mslk_dsl.ops and compare with the reference (see the module docstring)."""
    m, k = x0.shape
    what = f"{op} {_name(x0.dtype)} {m}x{k} ub={ub} {config and config_name(config)}"
    inputs = [t.clone() for t in (x0, x1) if t is not None]
    ub_t = _scale_ub(ub)
    if op == "silu_mul":
        out = ops.silu_mul(x0, x1, config=config)
        assert_silu_close(out, ref_silu_mul(x0, x1), what)
    elif op == "quantize_fp8_row":
        xq, scale = ops.quantize_fp8_row(x0, ub_t, config=config)
        want_q, want_s = ref_quantize(x0, ub_t)
        assert_same_bits(scale, want_s, what + " scale")
        assert_same_bits(xq, want_q, what + " xq")
    else:
        xq, scale = ops.silu_mul_quant(x0, x1, ub_t, config=config)
        y = ops.silu_mul(x0, x1)
        assert_silu_close(y, ref_silu_mul(x0, x1), what + " silu_mul")
        two_q, two_s = ops.quantize_fp8_row(y, ub_t)
        assert_same_bits(scale, two_s, what + " scale vs quantize(silu_mul)")
        assert_same_bits(xq, two_q, what + " xq vs quantize(silu_mul)")
        want_q, want_s = ref_quantize(y, ub_t)
        assert_same_bits(xq, want_q, what + " xq vs reference")
    for before, after in zip(inputs, (x0, x1)):
        assert torch.equal(before, after), f"{what}: an input was modified"


def _inputs_off_16_bytes(x, width):
    """``x`` copied into a view that starts ``width`` bytes past a 16-byte boundary (its rows
    still admit ``width``-byte accesses)."""
    shift = width // x.element_size()
    flat = torch.empty(x.numel() + shift, device=x.device, dtype=x.dtype)
    view = flat[shift:].view(x.shape)
    view.copy_(x)
    return view


def inputs(op, m, k, dtype, config=None, seed=0, device="cuda"):
    """x0 and x1 (None for quantize_fp8_row) of [m, k] for a call of ``op`` with ``config``."""
    x0 = _randn(m, k, dtype, seed, device)
    x1 = _randn(m, k, dtype, seed + 1, device) if op != "quantize_fp8_row" else None
    width = limits.contiguous_vector_bytes(k, dtype.itemsize)
    if config is not None and config["vec"] > 1 and elementwise.runs_phased(op, k, dtype.itemsize, width):
        # Fresh (16-byte aligned) rows of this width run the one-element kernels on CuTe, which
        # refuse a vector config; rows off a 16-byte boundary take the vector kernels (as such a
        # call does), so the config still runs at this width.
        x0, x1 = (None if x is None else _inputs_off_16_bytes(x, width) for x in (x0, x1))
    return x0, x1


def _run(op, m, k, dtype, ub=None, config=None, seed=0):
    check(op, *inputs(op, m, k, dtype, config, seed), ub, config)


# ---------------------------------------------------------------------------------------------
# Every config.


def _config_cases():
    """Every config with every dtype; the quantizers' configs with no_allocate loads (``l1``
    "stream", the same arithmetic as "keep") with bfloat16 only."""
    cases = []
    for op in OPS:
        t = _template(op)
        for dtype in DTYPES:
            for c in t.all_configs():
                if c.get("l1") == "stream" and dtype != torch.bfloat16:
                    continue
                if any(t.valid(c, TARGET, _sig(op, k, dtype)) for k in (16, 17)):
                    cases.append((op, dtype, c))
    return cases


def _case_id(case):
    op, dtype, config = case
    shape = "fitted" if config["threads"] & (config["threads"] - 1) or "cluster" in config else "pow2"
    return f"{op}-{_name(dtype)}-{config_name(config)}-{shape}"


def _shapes_for(config, tile_k):
    """(M, K): a partial last CTA, rows shorter than the tile, one tile, longer than the tile."""
    m = 2 * config["rows_per_block"] + 1
    if config["vec"] > 1:  # 16-byte rows, rows of 8-byte accesses (16-bit K a multiple of 4, not 8;
        # fp32 K even, not a multiple of 4) and 16-bit rows of 4-byte accesses (K even, not a multiple of 4)
        return [(m, 48), (m, tile_k), (m, 2 * tile_k + 32), (1, 16),
                (m, 52), (m, tile_k - 4), (m, 2 * tile_k + 36), (1, 4),
                (m, 50), (m, tile_k - 6), (m, 2 * tile_k + 34), (1, 2)]
    return [(m, 13), (m, tile_k + 1), (m, 2 * tile_k + 3), (1, 1)]


@SM90
@pytest.mark.parametrize("case", _config_cases(), ids=_case_id)
def test_every_config(case):
    op, dtype, config = case
    t = _template(op)
    tile_k = RowTile.of(config).row_k   # all the CTAs of a row (cluster) together
    for m, k in _shapes_for(config, tile_k):
        for ub in ((None,) if op == "silu_mul" else (None, 0.5)):
            if t.valid(config, TARGET, _sig(op, k, dtype, ub is not None)):
                _run(op, m, k, dtype, ub, config)


@SM90
@pytest.mark.parametrize("case", _config_cases(), ids=_case_id)
def test_writes_stay_in_bounds(case):
    """Outputs placed between guard rows: rows past M in the last CTA and vectors past K must
    not be written (M = 5 leaves idle rows in 2-, 4- and 8-row CTAs)."""
    op, dtype, config = case
    t = _template(op)
    m = 5
    for k in (1040, 1044, 1042, 1037):
        sig = _sig(op, k, dtype, False)
        if not t.valid(config, TARGET, sig):
            continue
        kernel = jit.get_kernel(t, config, target_of(torch.device("cuda")), sig)
        x0, x1 = _randn(m, k, dtype, 1), _randn(m, k, dtype, 2)
        if op == "silu_mul":
            buf = torch.full((m + 2, k), float("nan"), device="cuda", dtype=dtype)
            kernel(x0, x1, buf[1:-1], COUNT())
            torch.cuda.synchronize()
            assert buf[0].isnan().all() and buf[-1].isnan().all(), f"{op} wrote out of bounds (K={k})"
            assert_silu_close(buf[1:-1], ref_silu_mul(x0, x1), f"{op} bounds K={k}")
            continue
        guard = 0x7F  # an fp8 NaN
        q_buf = torch.full((m + 2, k), guard, device="cuda", dtype=torch.uint8)
        s_buf = torch.full((m + 2,), float("nan"), device="cuda")
        ub = torch.zeros(1, device="cuda")
        args = (x0, ub) if op == "quantize_fp8_row" else (x0, x1, ub)
        count = () if op == "quantize_fp8_row" else (COUNT(),)
        kernel(*args, q_buf[1:-1].view(FP8), s_buf[1:-1], *count)
        torch.cuda.synchronize()
        assert (q_buf[0] == guard).all() and (q_buf[-1] == guard).all(), f"{op} xq written out of bounds (K={k})"
        assert s_buf[0].isnan() and s_buf[-1].isnan(), f"{op} scale written out of bounds"
        y = x0 if op == "quantize_fp8_row" else ops.silu_mul(x0, x1)
        want_q, want_s = ref_quantize(y)
        assert_same_bits(s_buf[1:-1], want_s, f"{op} bounds K={k} scale")
        assert_same_bits(q_buf[1:-1].view(FP8), want_q, f"{op} bounds K={k} xq")


# ---------------------------------------------------------------------------------------------
# Flat tiles (silu_mul's ``layout`` "flat"): compact tensors mapped as one flat array.


def _flat_cases():
    return [("silu_mul", dtype, c) for dtype in DTYPES for c in _template("silu_mul").all_configs()
            if c.get("layout") == "flat" and c["vec"] * dtype.itemsize == 16]


# (M, K): one element, one row, rows shorter than a vector, odd rows over many CTAs (the tensor
# ending inside a vector), long rows
FLAT_SHAPES = [(1, 1), (1, 8), (3, 4), (2, 9), (1000, 69), (4099, 70), (333, 127), (2000, 500), (97, 2048),
               (41, 2051), (7, 3), (3001, 13), (5, 1), (3, 9001)]


@SM90
@pytest.mark.parametrize("case", _flat_cases(), ids=_case_id)
def test_flat_configs(case):
    """Against the reference, on fresh tensors (the flat kernel), on padded rows (which the op
    layer hands over compact: the flat kernel) and on inputs one element off a 16-byte boundary
    (the flat kernel does not serve them: the fallback row kernel)."""
    op, dtype, config = case
    for m, k in FLAT_SHAPES:
        check(op, _randn(m, k, dtype, 3), _randn(m, k, dtype, 4), None, config)
    m, k = 300, 77
    padded = [_randn(m, k + 5, dtype, s)[:, :k] for s in (5, 6)]
    shifted = [_inputs_off_16_bytes(_randn(m, k, dtype, s), dtype.itemsize) for s in (7, 8)]
    for x0, x1 in (padded, shifted):
        check(op, x0, x1, None, config)


@SM90
@pytest.mark.parametrize("m, k, n", [(4099, 70, 2500), (1000, 69, 0), (333, 127, 333), (2000, 500, 1)])
def test_flat_tiles_leave_rows_past_the_count(m, k, n):
    """valid_token_count in a flat tile: the elements of rows from the count on (from the middle
    of a CTA's span or of a vector) are not written."""
    config = next(c for c in _template("silu_mul").all_configs() if c.get("layout") == "flat" and c["vec"] == 8)
    x0, x1 = _randn(m, k, torch.bfloat16, 9), _randn(m, k, torch.bfloat16, 10)
    count = torch.tensor([n], dtype=torch.int32, device="cuda")
    v = min(n, m)
    want = ops.silu_mul(x0, x1)
    out = torch.full_like(want, 12345.0)
    ops.silu_mul(x0, x1, count, out=out, config=config)
    assert torch.equal(out[:v], want[:v])
    assert (out[v:] == 12345.0).all(), "a row past valid_token_count was written"


# ---------------------------------------------------------------------------------------------
# The heuristic's choice on the listed shapes.


@SM90
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_heuristic_shapes(op, dtype):
    for m, k in SHAPES:
        for ub in ((None,) if op == "silu_mul" else (None, 1.0)):
            _run(op, m, k, dtype, ub)


# ---------------------------------------------------------------------------------------------
# Rows of one element per access at every offset from a 16-byte boundary.

# Odd-length rows whose tensors all sit at one offset from a 16-byte boundary (the FP8 output at
# the same offset in its own elements) run their aligned middle in 128-bit vectors and the edges
# one element at a time (_cute_rowwise.PhasedRow); tensors at different offsets run one element
# at a time throughout. (inputs' offset, outputs' offset) in elements: row r of a tensor at
# offset o starts o + r K elements past a boundary, so 9 or more rows meet every head length.
PHASE_OFFSETS = [(0, 0), (3, 3), (7, 7), (5, 0), (0, 1)]
PHASE_SHAPES = [(9, 1), (9, 7), (17, 13), (11, 1037), (7, 2051), (3, 4097), (40, 379), (13, 597), (9, 771),
                (9, 2047), (5, 6001), (3, 12289), (2, 16383)]


def _at_offset(m, k, dtype, offset, values=None):
    """(a compact [m, k] tensor ``offset`` elements into a buffer of guard bytes 0x7F, the
    buffer as bytes)."""
    esize = torch.empty(0, dtype=dtype).element_size()
    buf = torch.full(((offset + m * k + 16) * esize,), 0x7F, device="cuda", dtype=torch.uint8)
    t = buf.view(dtype)[offset:offset + m * k].view(m, k)
    if values is not None:
        t.copy_(values)
    return t, buf


def _guards_intact(buf, t):
    start = t.data_ptr() - buf.data_ptr()
    end = start + t.numel() * t.element_size()
    return bool((buf[:start] == 0x7F).all() and (buf[end:] == 0x7F).all())


@SM90
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_one_element_rows_at_every_offset(op, dtype):
    for m, k in PHASE_SHAPES:
        a0, b0 = _randn(m, k, dtype, 5), _randn(m, k, dtype, 6)
        for x_off, out_off in PHASE_OFFSETS:
            what = f"{op} {_name(dtype)} {m}x{k} offsets {x_off}/{out_off}"
            x0, _ = _at_offset(m, k, dtype, x_off, a0)
            x1, _ = _at_offset(m, k, dtype, x_off, b0)
            if op == "silu_mul":
                y, y_buf = _at_offset(m, k, dtype, out_off)
                ops.silu_mul(x0, x1, out=y)
                assert_silu_close(y, ref_silu_mul(x0, x1), what)
                assert _guards_intact(y_buf, y), f"{what}: written out of bounds"
                continue
            xq, q_buf = _at_offset(m, k, FP8, out_off)
            scale = torch.empty(m, device="cuda")
            if op == "quantize_fp8_row":
                ops.quantize_fp8_row(x0, out=(xq, scale))
                want_q, want_s = ref_quantize(x0)
            else:
                ops.silu_mul_quant(x0, x1, out=(xq, scale))
                want_q, want_s = ref_quantize(ops.silu_mul(x0, x1))
            assert_same_bits(scale, want_s, what + " scale")
            assert_same_bits(xq, want_q, what + " xq")
            assert _guards_intact(q_buf, xq), f"{what}: xq written out of bounds"


def _staged_cases():
    """The quantizers' staged configs (first tile in shared memory) of one-element rows, with
    every dtype they serve."""
    return [(op, dtype, c) for op in ("quantize_fp8_row", "silu_mul_quant") for dtype in DTYPES
            for c in _template(op).all_configs()
            if c.get("stage") == "smem" and c["vec"] == 1 and _template(op).valid(c, TARGET, _sig(op, 17, dtype))]


@SM90
@pytest.mark.parametrize("case", _staged_cases(), ids=_case_id)
def test_staged_one_element_configs_at_every_offset(case):
    """A staged one-element config stages the phased middle of congruent rows (cp.async), and runs
    a register tile of its own for rows at different offsets: both kernels, rows shorter and
    longer than the staged tile, every head length, with and without scale_ub; inputs untouched."""
    op, dtype, config = case
    tile_k = RowTile.of(config).tile_k
    for m, k in ((9, 771), (3, tile_k - 1), (2, tile_k + 9), (1, 2 * tile_k + 5)):
        a0, b0 = _randn(m, k, dtype, 7), _randn(m, k, dtype, 8)
        for x_off, out_off in PHASE_OFFSETS:
            what = f"{op} {_name(dtype)} {m}x{k} {config_name(config)} offsets {x_off}/{out_off}"
            x0, _ = _at_offset(m, k, dtype, x_off, a0)
            x1, _ = _at_offset(m, k, dtype, x_off, b0)
            for ub in (None, _scale_ub(0.5)):
                xq, q_buf = _at_offset(m, k, FP8, out_off)
                scale = torch.empty(m, device="cuda")
                if op == "quantize_fp8_row":
                    ops.quantize_fp8_row(x0, ub, out=(xq, scale), config=config)
                    want_q, want_s = ref_quantize(x0, ub)
                else:
                    ops.silu_mul_quant(x0, x1, ub, out=(xq, scale), config=config)
                    want_q, want_s = ref_quantize(ops.silu_mul(x0, x1), ub)
                assert_same_bits(scale, want_s, what + " scale")
                assert_same_bits(xq, want_q, what + " xq")
                assert _guards_intact(q_buf, xq), f"{what}: xq written out of bounds"
            assert torch.equal(x0, a0) and torch.equal(x1, b0), f"{what}: an input was modified"


# ---------------------------------------------------------------------------------------------
# Special values (quantize_fp8_row; silu_mul_quant shares the quantize code).


@SM90
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("k", (4096, 4097))
def test_quantize_zero_rows(dtype, k):
    x = _randn(6, k, dtype, 3)
    x[0] = 0
    x[4] = 0
    for ub in (None, 2.0):
        xq, scale = ops.quantize_fp8_row(x, _scale_ub(ub))
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert (xq[0].float() == 0).all() and (xq[4].float() == 0).all()
        check("quantize_fp8_row", x, ub=ub)


@SM90
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_quantize_scale_ub(dtype):
    x = _randn(64, 4096, dtype, 4) * 4
    for ub in (0.25, 1.0, 3.0):
        xq, scale = ops.quantize_fp8_row(x, _scale_ub(ub))
        assert (scale.double() <= ub / FP8_MAX * (1 + 2.0**-22)).all(), "scale_ub not respected"
        assert xq.float().abs().max().item() == FP8_MAX  # rows past ub saturate
        check("quantize_fp8_row", x, ub=ub)
    # An upper bound above every row's max changes nothing.
    a, sa = ops.quantize_fp8_row(x, _scale_ub(1e30))
    b, sb = ops.quantize_fp8_row(x)
    assert_same_bits(sa, sb, "ub above amax: scale")
    assert_same_bits(a, b, "ub above amax: xq")


@SM90
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_quantize_rounding_ties_and_signed_zero(dtype):
    # amax = 448 gives scale = 1 exactly, so x lands on e4m3 midpoints: round half to even.
    ties = torch.tensor([1.0625, 1.1875, 3.125, 3.875, 13.5, 15.5, 0.0029296875, 0.0048828125, 400.0, 432.0],
                        device="cuda")
    k = 64
    x = torch.zeros(4, k, device="cuda")
    x[:, 0] = 448.0
    x[0, 1:1 + ties.numel()] = ties
    x[1, 1:1 + ties.numel()] = -ties
    x[2, 1:] = -0.0
    x[3] = torch.linspace(-448, 448, k, device="cuda")
    check("quantize_fp8_row", x.to(dtype))
    xq, _ = ops.quantize_fp8_row(x.to(dtype))
    assert (xq[2, 1:].view(torch.uint8) == 0x80).all(), "-0 must quantize to fp8 -0"


@SM90
def test_quantize_wide_range_and_saturation():
    g = torch.Generator(device="cuda").manual_seed(5)
    m, k = 256, 2048
    for dtype, octaves in ((torch.float32, 60), (torch.bfloat16, 60), (torch.float16, 10)):
        mag = torch.randint(-octaves, octaves, (m, k), device="cuda", generator=g).float()
        x = torch.randn(m, k, device="cuda", generator=g) * torch.exp2(mag)
        x[::3] *= 1e-30 / x[::3].abs().amax(dim=1, keepdim=True)  # tiny rows: amax below the eps floor
        for ub in (None, 1.0, 1e-3):
            check("quantize_fp8_row", x.to(dtype), ub=ub)
    big = torch.full((2, 1024), 3e38, device="cuda")
    big[1] = -3e38
    xq, _ = ops.quantize_fp8_row(big, _scale_ub(1.0))
    assert (xq[0].float() == FP8_MAX).all() and (xq[1].float() == -FP8_MAX).all()
    check("quantize_fp8_row", big, ub=1.0)
    check("quantize_fp8_row", torch.full((3, 1024), 65504.0, device="cuda", dtype=torch.float16), ub=0.01)


@SM90
@pytest.mark.parametrize("op", ("quantize_fp8_row", "silu_mul_quant"))
def test_quantize_nan_poisons_only_its_row(op):
    x0, x1 = _randn(4, 4096, torch.bfloat16, 6), _randn(4, 4096, torch.bfloat16, 7)
    x0[2, 100] = float("nan")
    if op == "quantize_fp8_row":
        xq, scale = ops.quantize_fp8_row(x0)
        want_q, want_s = ref_quantize(x0)
    else:
        xq, scale = ops.silu_mul_quant(x0, x1)
        want_q, want_s = ref_quantize(ops.silu_mul(x0, x1))
    assert scale[2].isnan() and xq[2].float().isnan().all()
    keep = [0, 1, 3]
    assert_same_bits(scale[keep], want_s[keep], f"{op} NaN row: other scales")
    assert_same_bits(xq[keep], want_q[keep], f"{op} NaN row: other rows")


@SM90
def test_silu_mul_extremes():
    x0 = torch.linspace(-30, 30, 4096, device="cuda").reshape(2, 2048)
    x1 = torch.linspace(-2, 3, 4096, device="cuda").reshape(2, 2048)
    for dtype in DTYPES:
        check("silu_mul", x0.to(dtype), x1.to(dtype))
        check("silu_mul_quant", x0.to(dtype), x1.to(dtype), ub=None)


# ---------------------------------------------------------------------------------------------
# CPU: the config space and the heuristic.


def test_configs_cover_every_signature():
    for op in OPS:
        t = _template(op)
        for sig in t.all_signatures():
            assert t.valid_configs(TARGET, sig), (op, sig)
            for k in (1, 16, 1000, 4096, 5000, 8191, 8192, 16384, 65536):
                c = t.heuristic(TARGET, sig, {"M": 4, "K": k})
                assert t.valid(c, TARGET, sig) and c in t.all_configs(), (op, sig, k, c)
