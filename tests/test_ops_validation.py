"""Bad inputs raise a clear ValueError / TypeError naming the argument, before any launch; each is
an MslkDslError (InputError, InputTypeError, ...) too.

These run on the CPU: every check that does not need a GPU happens before the device check,
and CPU tensors themselves are refused with an error naming the supported targets.
"""
import pytest
import torch

from mslk_dsl import ops
from mslk_dsl.errors import MslkDslError, UnsupportedDeviceError
from mslk_dsl.templates._kernel_limits import contiguous_vector_bytes

bf16, f32 = torch.bfloat16, torch.float32


def t(*shape, dtype=bf16):
    return torch.randn(*shape).to(dtype)


def strided_last(*shape, dtype=bf16):
    return torch.randn(*shape[:-1], shape[-1] * 2).to(dtype)[..., ::2]


fp8 = torch.float8_e4m3fn
CASES = [
    # (id, call, exception, words the message must contain)
    ("silu_mul dtype", lambda: ops.silu_mul(t(4, 8, dtype=torch.int32), t(4, 8)), TypeError, ["x0", "dtype"]),
    ("silu_mul dtype mismatch", lambda: ops.silu_mul(t(4, 8), t(4, 8, dtype=f32)), TypeError, ["x1", "dtype"]),
    ("silu_mul shapes", lambda: ops.silu_mul(t(4, 8), t(4, 9)), ValueError, ["x1", "shape"]),
    ("silu_mul last-dim stride", lambda: ops.silu_mul(strided_last(4, 8), t(4, 8)), ValueError, ["x0", "stride"]),
    ("silu_mul rank 0", lambda: ops.silu_mul(torch.tensor(1.0), torch.tensor(1.0)), ValueError, ["x0", "dimension"]),
    ("silu_mul not a tensor", lambda: ops.silu_mul([1.0], t(1)), TypeError, ["x0", "torch.Tensor"]),
    ("silu_mul cpu", lambda: ops.silu_mul(t(4, 8), t(4, 8)), ValueError, ["x0", "cpu", "sm90a"]),
    ("quantize dtype", lambda: ops.quantize_fp8_row(t(4, 8, dtype=torch.int8)), TypeError, ["x", "dtype"]),
    ("quantize stride", lambda: ops.quantize_fp8_row(strided_last(4, 8)), ValueError, ["x", "stride"]),
    ("quantize empty rows", lambda: ops.quantize_fp8_row(t(4, 0)), ValueError, ["x", "empty"]),
    ("quantize scale_ub dtype", lambda: ops.quantize_fp8_row(t(4, 8), scale_ub=t(1)), TypeError, ["scale_ub"]),
    ("quantize scale_ub shape", lambda: ops.quantize_fp8_row(t(4, 8), scale_ub=t(2, dtype=f32)), ValueError,
     ["scale_ub", "one element"]),
    ("quantize cpu", lambda: ops.quantize_fp8_row(t(4, 8)), ValueError, ["x", "cpu"]),
    ("quantize zero_start_index_M count", lambda: ops.quantize_fp8_row(
        t(3, 4, 8), zero_start_index_M=torch.zeros(4, dtype=torch.int64)), ValueError,
     ["zero_start_index_M", "3", "matrix"]),
    ("quantize zero_start_index_M dtype", lambda: ops.quantize_fp8_row(
        t(3, 4, 8), zero_start_index_M=torch.zeros(3)), TypeError, ["zero_start_index_M", "dtype"]),
    ("quantize output_device", lambda: ops.quantize_fp8_row(t(4, 8), output_device=torch.device("meta")),
     ValueError, ["output_device", "x's device"]),
    ("quantize use_triton", lambda: ops.quantize_fp8_row(t(4, 8), use_triton="yes"), TypeError, ["use_triton"]),
    ("quantize align_rows_to", lambda: ops.quantize_fp8_row(t(4, 8), align_rows_to=0), ValueError, ["align_rows_to"]),
    ("silu_mul_quant shapes", lambda: ops.silu_mul_quant(t(4, 8), t(3, 8)), ValueError, ["x1"]),
    ("dequantize dtype", lambda: ops.dequantize_fp8_row(t(4, 8), t(4, dtype=f32)), TypeError, ["xq"]),
    ("dequantize scale shape", lambda: ops.dequantize_fp8_row(t(4, 8).to(fp8), t(3, dtype=f32)), ValueError,
     ["scale", "shape"]),
    ("rmsnorm weight rank", lambda: ops.rmsnorm(t(4, 8), t(1, 8)), ValueError, ["weight", "1-D"]),
    ("rmsnorm weight size", lambda: ops.rmsnorm(t(4, 8), t(7)), ValueError, ["weight", "shape"]),
    ("rmsnorm fp64", lambda: ops.rmsnorm(t(4, 8, dtype=torch.float64), t(8, dtype=f32)), TypeError, ["x", "dtype"]),
    ("rmsnorm fp16 weight, bf16 x", lambda: ops.rmsnorm(t(4, 8), t(8, dtype=torch.float16)), TypeError,
     ["weight", "torch.float32"]),
    ("rmsnorm bf16 weight, fp32 x", lambda: ops.rmsnorm(t(4, 8, dtype=f32), t(8)), TypeError, ["weight", "dtype"]),
    ("rmsnorm hidden too big", lambda: ops.rmsnorm(t(1, 262152), t(262152)), ValueError, ["hidden", "262144"]),
    ("silu_mul valid_token_count dtype", lambda: ops.silu_mul(t(4, 8), t(4, 8), torch.tensor([2])), TypeError,
     ["valid_token_count", "dtype"]),
    ("silu_mul valid_token_count shape", lambda: ops.silu_mul(t(4, 8), t(4, 8), torch.tensor([2, 3], dtype=torch.int32)),
     ValueError, ["valid_token_count", "one element"]),
    ("silu_mul_quant valid_token_count dtype",
     lambda: ops.silu_mul_quant(t(4, 8), t(4, 8), None, torch.tensor([2.0])), TypeError, ["valid_token_count"]),
    ("rmsnorm eps", lambda: ops.rmsnorm(t(4, 8), t(8), eps=-1.0), ValueError, ["eps"]),
    ("rmsnorm_add residual shape", lambda: ops.rmsnorm_add(t(4, 8), t(5, 8), t(8)), ValueError, ["residual"]),
    ("rmsnorm_add residual dtype", lambda: ops.rmsnorm_add(t(4, 8), t(4, 8, dtype=torch.float16), t(8)),
     TypeError, ["residual", "dtype"]),
    ("bf16_gemm rank", lambda: ops.bf16_gemm(t(8), t(16, 8)), ValueError, ["x", "at least 2"]),
    ("bf16_gemm weight rank", lambda: ops.bf16_gemm(t(4, 8), t(2, 16, 8)), ValueError, ["w", "2-D"]),
    ("bf16_gemm K mismatch", lambda: ops.bf16_gemm(t(4, 16), t(16, 8)), ValueError, ["w", "[N, K]"]),
    ("bf16_gemm K alignment", lambda: ops.bf16_gemm(t(4, 12), t(16, 12)), ValueError, ["K=12", "multiple of 8"]),
    ("bf16_gemm N alignment", lambda: ops.bf16_gemm(t(4, 16), t(12, 16)), ValueError, ["N=12"]),
    ("bf16_gemm fp32", lambda: ops.bf16_gemm(t(4, 16, dtype=f32), t(16, 16, dtype=f32)), TypeError, ["x"]),
    ("fp8 gemm dtype", lambda: ops.f8f8bf16_rowwise(t(4, 16), t(16, 16), t(4, dtype=f32), t(16, dtype=f32)),
     TypeError, ["xq", "dtype"]),
    ("fp8 gemm cpu", lambda: ops.f8f8bf16_rowwise(t(4, 16).to(fp8), t(16, 16).to(fp8), t(4, dtype=f32),
                                                  t(16, dtype=f32)), ValueError, ["cpu"]),
]


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_with_the_argument_named(call, exc, words):
    with pytest.raises(exc) as err:
        call()
    assert isinstance(err.value, MslkDslError), f"{type(err.value).__name__} is not an MslkDslError"
    for word in words:
        assert word in str(err.value), f"{word!r} not in: {err.value}"


def test_cpu_tensors_raise_not_implemented_naming_targets():
    with pytest.raises(NotImplementedError) as err:
        ops.silu_mul(t(2, 8), t(2, 8))
    assert isinstance(err.value, UnsupportedDeviceError) and "silu_mul" in str(err.value)
    with pytest.raises(NotImplementedError) as err:
        torch.ops.mslk_dsl.silu_mul(t(2, 8), t(2, 8))
    assert "silu_mul" in str(err.value)


def test_dequantize_inverts_on_any_device():
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    scale = torch.tensor([2.0 / 448, 4.0 / 448])
    xq = (x / scale[:, None]).to(fp8)
    back = ops.dequantize_fp8_row(xq, scale, out_dtype=torch.float32)
    torch.testing.assert_close(back, x, rtol=0.07, atol=0)
    assert torch.ops.mslk_dsl.dequantize_fp8_row(xq, scale).dtype == torch.bfloat16


@pytest.mark.parametrize("method", ["atomic", "sorted"])
def test_scatter_allocates_its_workspace_only_for_the_sorted_method(method, monkeypatch):
    """The sorted method gets counts, offsets, positions, lists and first rows (3T + 1 + 2A
    int32); the atomic method gets the cached one-element placeholder (no allocation per call)."""
    from mslk_dsl.ops import declaration, dispatch, validate

    launched = []
    monkeypatch.setattr(validate, "gpu", lambda *args: None)   # CPU tensors stand in for GPU ones
    monkeypatch.setattr(declaration.get("scatter_add_dense_tokens").kernels, "selection",
                        lambda *args: (lambda *tensors: launched.append(tensors), {"method": method}))
    out, y, tok = t(5, 16), t(12, 16), torch.randint(0, 5, (12,), dtype=torch.int32)
    ops.scatter_add_dense_tokens(out, y, tok)
    (args,) = launched
    workspace = args[-1]
    if method == "sorted":
        assert workspace.dtype == torch.int32 and workspace.numel() == 3 * 5 + 1 + 2 * 12
    else:
        assert workspace is dispatch.placeholder(out.device, torch.int32)


def _launched_with(monkeypatch, op: str) -> list:
    """Stand in for ``op``'s kernel choice on CPU tensors: each call records (signature, args)."""
    from mslk_dsl.ops import declaration, validate

    launched = []
    monkeypatch.setattr(validate, "gpu", lambda *args: None)   # CPU tensors stand in for GPU ones
    monkeypatch.setattr(declaration.get(op).kernels, "selection",
                        lambda device, sig, problem, config=None: (lambda *a: launched.append((sig, a)), {}))
    return launched


@pytest.mark.parametrize("x_dtype, w_dtype, fp32_weight", [
    (bf16, bf16, False), (bf16, f32, True), (torch.float16, f32, True), (f32, f32, False)])
def test_rmsnorm_picks_the_weight_signature(monkeypatch, x_dtype, w_dtype, fp32_weight):
    """An fp32 weight with 16-bit x selects the fp32_weight kernels; fp32 x with an fp32 weight is
    the plain fp32 kernel. The results take x's dtype."""
    launched = _launched_with(monkeypatch, "rmsnorm")
    y = ops.rmsnorm(t(3, 64, dtype=x_dtype), t(64, dtype=w_dtype), config=None)
    ((sig, args),) = launched
    assert sig == (16, str(x_dtype).removeprefix("torch."), fp32_weight)
    assert y.dtype == x_dtype and args[1].dtype == w_dtype


@pytest.mark.parametrize("op", ["rmsnorm", "rmsnorm_add"])
@pytest.mark.parametrize("x_dtype", [bf16, torch.float16, f32], ids=str)
def test_a_norm_without_weight_gets_a_cached_weight_of_ones(monkeypatch, op, x_dtype):
    """weight=None (torch's F.rms_norm and quack's rmsnorm without a weight): the kernels of x's
    dtype (not the fp32-weight ones) get ones of x's dtype and width, cached, so every call (and
    a launch plan) passes the same tensor; another width gets its own."""
    from mslk_dsl.ops import dispatch

    launched = _launched_with(monkeypatch, op)
    rest = (t(3, 72, dtype=x_dtype),) if op == "rmsnorm_add" else ()
    for _ in range(2):
        getattr(ops, op)(t(3, 72, dtype=x_dtype), *rest, None)
    getattr(ops, op)(t(2, 40, dtype=x_dtype), *(r[:2, :40] for r in rest), None)
    (sig, first), (_, second), (_, narrower) = launched
    w = first[1 + len(rest)]
    # (rmsnorm_add's fourth part: no fp32 residual)
    assert sig == (16, str(x_dtype).removeprefix("torch."), False, *([False] if rest else []))
    assert w.dtype == x_dtype and w.shape == (72,) and torch.equal(w, torch.ones(72, dtype=x_dtype))
    assert second[1 + len(rest)] is w and dispatch.is_placeholder(w)
    assert narrower[1 + len(rest)].shape == (40,)


@pytest.mark.parametrize("x_dtype", [bf16, torch.float16], ids=str)
@pytest.mark.parametrize("w_dtype", [None, "x", f32])
@pytest.mark.parametrize("shape", [(5, 24), (2, 3, 40), (1, 7), (3, 36), (4, 6)])
def test_rmsnorm_add_keeps_an_fp32_residual_in_fp32(monkeypatch, x_dtype, w_dtype, shape):
    """16-bit x with an fp32 residual (quack's residual_dtype, flash-attn's residual_in_fp32):
    every row length, odd ones (one element per access) included, goes to the fused kernels'
    fp32_residual signature (x, y in x's dtype, residual and new_residual fp32, the caller's
    weight). The op returns y in x's dtype and the fp32 sum, equal to the reference's, into
    ``out=`` tensors too."""
    from mslk_dsl.ops import declaration, validate

    decl = declaration.get("rmsnorm_add")
    monkeypatch.setattr(validate, "gpu", lambda *args: None)
    launched = []

    def selection(device, sig, problem, config=None):
        def kernel(x, r, w, y, res, eps):
            launched.append((sig, (x.dtype, r.dtype, w.dtype, y.dtype, res.dtype)))
            want_y, want_res = decl.reference(x, r, w, eps)
            y.copy_(want_y)
            res.copy_(want_res)
        return kernel, {}

    monkeypatch.setattr(decl.kernels, "selection", selection)
    x, r = torch.randn(shape).to(x_dtype), torch.randn(shape) * 100
    w = None if w_dtype is None else torch.randn(shape[-1]).to(x_dtype if w_dtype == "x" else w_dtype)
    want_y, want_res = decl.reference(x, r, w, 1e-6)
    assert want_y.dtype == x_dtype and want_res.dtype == f32
    assert torch.equal(want_res, x.float() + r)          # the sum is not rounded to x's dtype
    for _ in range(2):
        y, res = ops.rmsnorm_add(x, r, w, 1e-6)
        assert y.dtype == x_dtype and res.dtype == f32 and y.shape == res.shape == x.shape
        assert torch.equal(y, want_y) and torch.equal(res, want_res)
    out = (torch.empty(shape, dtype=x_dtype), torch.empty(shape, dtype=f32))
    assert ops.rmsnorm_add(x, r, w, 1e-6, out=out) is not None
    assert torch.equal(out[0], want_y) and torch.equal(out[1], want_res)
    w_kernel = x_dtype if w_dtype in (None, "x") else f32
    x_name = str(x_dtype).removeprefix("torch.")
    vec_bytes = contiguous_vector_bytes(shape[-1], 2)      # 2 for odd rows: one element per access
    assert set(launched) == {((vec_bytes, x_name, w_kernel == f32, True), (x_dtype, f32, w_kernel, x_dtype, f32))}
    with pytest.raises(TypeError, match="residual"):
        ops.rmsnorm_add(x.float(), r.to(x_dtype), None)      # fp32 x with a 16-bit residual
    with pytest.raises(TypeError, match="out"):
        ops.rmsnorm_add(x, r, w, 1e-6, out=(out[0], out[1].to(x_dtype)))


def test_a_norm_without_weight_equals_a_weight_of_ones_in_the_reference():
    from mslk_dsl.ops import declaration

    x, r = t(5, 24), t(5, 24)
    decl, add = declaration.get("rmsnorm"), declaration.get("rmsnorm_add")
    assert torch.equal(decl.reference(x, None), decl.reference(x, torch.ones(24, dtype=bf16)))
    for a, b in zip(add.reference(x, r, None), add.reference(x, r, torch.ones(24, dtype=bf16))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape, starts", [((20, 30), [7]), ((6, 4, 2, 3), [0, 1, 2, 5] * 6), ((5, 17), [-1]),
                                            ((4, 2, 9), [2, 0, 1, 9]), ((33,), [0]), ((33,), [1])])
@pytest.mark.parametrize("ub_value", [None, 0.5, 1e-3])
def test_quantize_rows_past_zero_start_index_m_come_out_as_zero_rows(monkeypatch, shape, starts, ub_value):
    """MSLK's zero_start_index_M: one row count per [N, K] matrix of x; the rows from it on give
    what a row of zeros gives (xq 0, the floor's scale, capped by scale_ub), whatever they hold
    (NaN here), the others their own quantization. The kernel (stood in for by the reference)
    quantizes every row; the op then sets the rows past on the device."""
    from mslk_dsl.ops import declaration, validate

    decl = declaration.get("quantize_fp8_row")
    monkeypatch.setattr(validate, "gpu", lambda *args: None)

    def kernel(a, ub, q, s):
        want_q, want_s = decl.reference(a, ub if ub_value is not None else None)
        q.copy_(want_q)
        s.copy_(want_s)

    monkeypatch.setattr(decl.kernels, "selection", lambda device, sig, problem, config=None: (kernel, {}))
    x = torch.randn(shape).to(bf16)
    counts = torch.tensor(starts, dtype=torch.int64)
    past = (torch.arange(x.shape[-2] if x.dim() > 1 else 1).view(1, -1) >= counts.view(-1, 1)).view(*shape[:-1], 1)
    x = x.masked_fill(past, float("nan"))
    ub = torch.tensor([ub_value]) if ub_value is not None else None
    xq, scale = ops.quantize_fp8_row(x, ub, counts, True, None)
    want_q, want_s = decl.reference(x.masked_fill(past, 0.0), ub)
    assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_s)
    assert torch.equal(decl.reference(x, ub, counts)[1], want_s)
    floor = torch.tensor(min(1 / 512, ub_value or 1.0), dtype=f32) / torch.tensor(448.0)
    assert torch.all(scale[past.squeeze(-1)] == floor)


@pytest.mark.parametrize("shape, align, starts", [((2, 13), 8, None), ((4, 2, 13), 16, [1, 0, 2, 1]),
                                                   ((3, 16), 8, None), ((20, 30), 16, [7]), ((5, 1), 4, None)])
def test_quantize_align_rows_to_pads_xq_with_zeros(monkeypatch, shape, align, starts):
    """MSLK's align_rows_to: xq's rows padded with zero bytes to a multiple of it (the scales and
    the values as without it); with zero_start_index_M too, the rows past the counts are zero
    rows in full. The kernel (stood in for by the reference) writes compact rows."""
    from mslk_dsl.ops import declaration, validate

    decl = declaration.get("quantize_fp8_row")
    monkeypatch.setattr(validate, "gpu", lambda *args: None)
    launched = []

    def kernel(a, ub, q, s):
        launched.append(q.shape)
        want_q, want_s = decl.reference(a)
        q.copy_(want_q)
        s.copy_(want_s)

    monkeypatch.setattr(decl.kernels, "selection", lambda device, sig, problem, config=None: (kernel, {}))
    x = torch.randn(shape).to(bf16)
    counts = None if starts is None else torch.tensor(starts, dtype=torch.int32)
    xq, scale = ops.quantize_fp8_row(x, zero_start_index_M=counts, align_rows_to=align)
    k = shape[-1]
    padded = -(-k // align) * align
    assert xq.shape == (*shape[:-1], padded) and scale.shape == shape[:-1]
    assert launched == [(x.numel() // k, k)]                      # the kernel's rows stay compact
    want_q, want_s = decl.reference(x, None, counts, True, None, align)
    assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_s)
    assert not xq.view(torch.uint8)[..., k:].any()
    plain_q, _ = decl.reference(x, None, counts)
    assert torch.equal(xq.view(torch.uint8)[..., :k], plain_q.view(torch.uint8))


@pytest.mark.parametrize("n, w_dtype, x_offset, want", [
    (64, bf16, 0, 16), (4098, bf16, 0, 4), (4097, bf16, 0, 2), (64, bf16, 2, 4), (64, bf16, 1, 2),
    (4098, f32, 0, 4), (64, f32, 0, 16)])
def test_row_ops_pick_the_widest_access_their_tensors_admit(monkeypatch, n, w_dtype, x_offset, want):
    """The norms' vec_bytes from x's rows (length and start) and the weight; silu_mul's and the
    FP8 quantizer's from all their tensors alike."""
    base = t(3 * n + x_offset, dtype=bf16)
    x = base[x_offset:].view(3, n)
    launched = _launched_with(monkeypatch, "rmsnorm")
    ops.rmsnorm(x, t(n, dtype=w_dtype))
    assert launched[0][0][0] == want
    launched = _launched_with(monkeypatch, "silu_mul")
    ops.silu_mul(x, t(3, n, dtype=bf16))
    assert launched[0][0][0] == want
    launched = _launched_with(monkeypatch, "quantize_fp8_row")
    ops.quantize_fp8_row(x)
    assert launched[0][0][0] == want


@pytest.mark.parametrize("target, want", [("sm90a", 2), ("gfx942", 4)])
def test_word_rows_in_the_phased_range_take_one_element_per_access_on_cute(monkeypatch, target, want):
    """quantize_fp8_row and silu_mul on fresh rows of 4098 bf16 (4-byte accesses, in their
    PHASED_WORD_ROWS ranges): the one-element signature on a CuTe target, the 4-byte one on a
    FlyDSL target; rows of 2046, below silu_mul's range, keep 4 bytes on both."""
    monkeypatch.setenv("MSLK_DSL_TARGET", target)
    x = t(3, 4098, dtype=bf16)
    launched = _launched_with(monkeypatch, "quantize_fp8_row")
    ops.quantize_fp8_row(x)
    assert launched[0][0][0] == want
    launched = _launched_with(monkeypatch, "silu_mul")
    ops.silu_mul(x, t(3, 4098, dtype=bf16))
    assert launched[0][0][0] == want
    launched = _launched_with(monkeypatch, "silu_mul")
    ops.silu_mul(t(3, 2046, dtype=bf16), t(3, 2046, dtype=bf16))
    assert launched[0][0][0] == 4


def test_the_gpu_every_config_test_calls_each_config_on_a_signature_it_serves(monkeypatch):
    """tests/gpu/test_elementwise_cute.py::test_every_config calls silu_mul, quantize_fp8_row and
    silu_mul_quant with each config, on rows around its tile, with and without scale_ub. The
    signature the op makes of those inputs on sm90a (its routing of word rows to the one-element
    kernels included) must be one the config serves, else that GPU test fails with a ConfigError.
    Here the same inputs, made on the CPU, go through the op and its own config check (no kernel
    is built)."""
    import importlib.util
    import os

    from mslk_dsl.ops import declaration, validate
    from mslk_dsl.templates._rowwise_plan import RowTile

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu", "test_elementwise_cute.py")
    spec = importlib.util.spec_from_file_location("gpu_test_elementwise_cute", path)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    monkeypatch.setenv("MSLK_DSL_TARGET", "sm90a")
    monkeypatch.setattr(validate, "gpu", lambda *args: None)   # CPU tensors stand in for GPU ones
    for op in gpu.OPS:
        kernels = declaration.get(op).kernels
        # the explicit config checked as the op's kernel choice checks it; the kernel stands in
        monkeypatch.setattr(kernels, "selection", lambda device, sig, problem, config=None, kernels=kernels: (
            lambda *args: None, kernels.choose("sm90a", sig, problem, config)[1]))
    made, calls = {}, 0
    for op, dtype, config in gpu._config_cases():
        template = gpu._template(op)
        for m, k in gpu._shapes_for(config, RowTile.of(config).row_k):
            for ub in ((None,) if op == "silu_mul" else (None, 0.5)):
                if not template.valid(config, gpu.TARGET, gpu._sig(op, k, dtype, ub is not None)):
                    continue
                key = (op, dtype, m, k, config["vec"] > 1)
                if key not in made:
                    made[key] = gpu.inputs(op, m, k, dtype, config, device="cpu")
                x0, x1 = made[key]
                scale_ub = None if ub is None else torch.tensor([ub])
                if op == "silu_mul":
                    ops.silu_mul(x0, x1, config=config)
                elif op == "quantize_fp8_row":
                    ops.quantize_fp8_row(x0, scale_ub, config=config)
                else:
                    ops.silu_mul_quant(x0, x1, scale_ub, config=config)
                calls += 1
    assert calls > 1000


@pytest.mark.parametrize("op", ["silu_mul", "quantize_fp8_row", "silu_mul_quant"])
def test_the_phased_rows_benchmark_times_the_cut_and_the_one_element_kernels(monkeypatch, op):
    """``tools/bench.py phased_rows`` on a row of 4098 (4-byte accesses, in every op's routing
    range): its cut side, under ``routing_off``, reaches the 4-byte signature, also after a routed
    call of the same layout made its plan, and leaves no plan that would serve a routed call
    later; its other side, one element past a 16-byte boundary, the one-element signature; the
    routing table is whole afterwards."""
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import bench_phased_rows as phased

    from mslk_dsl.ops import elementwise

    monkeypatch.setenv("MSLK_DSL_TARGET", "sm90a")
    table = dict(elementwise.PHASED_WORD_ROWS)
    launched = _launched_with(monkeypatch, op)
    cut, one_element, _ = phased.calls(op, 3, 4098, torch, ops, device="cpu")
    cut()                      # routed: the one-element signature, and a plan for this layout
    with phased.routing_off():
        cut()
    cut()
    one_element()
    assert [sig[0] for sig, _ in launched] == [2, 4, 2, 2]
    assert elementwise.PHASED_WORD_ROWS == table


@pytest.mark.parametrize("op", ["rmsnorm", "rmsnorm_add"])
@pytest.mark.parametrize("n", [16385, 65536, 262144])
def test_long_rows_reach_the_kernel_and_the_heuristic_serves_them(monkeypatch, op, n):
    """Rows past the single CTA's 16K elements, up to 262144, pass the checks and reach the
    kernel choice with their length; the CuTe heuristic has a valid config for them."""
    from mslk_dsl import registry
    from mslk_dsl.ops import declaration

    launched = _launched_with(monkeypatch, op)
    x = t(2, n)
    if op == "rmsnorm":
        ops.rmsnorm(x, t(n))
    else:
        ops.rmsnorm_add(x, t(2, n), t(n))
    ((sig, _),) = launched
    template = next(tp for tp in registry.get_templates(backend="cute") if tp.op == op)
    full = dict(zip(declaration.get(op).signature, sig))
    template.check_config(template.heuristic("sm90a", full, {"M": 2, "N": n}), "sm90a", full)


def test_320_experts_reach_the_routing_kernel(monkeypatch):
    """MSLK's E = 320 passes the checks, gets a histogram workspace of MAX_CHUNKS x 320 and the
    heuristic's 512-expert config."""
    from mslk_dsl import registry
    from mslk_dsl.ops import declaration
    from mslk_dsl.templates import _kernel_limits as limits

    launched = _launched_with(monkeypatch, "index_shuffling")
    ops.index_shuffling(torch.rand(7, 320, dtype=bf16), top_k=4)
    ((sig, args),) = launched
    assert any(isinstance(a, torch.Tensor) and a.numel() == limits.index_shuffling_hist_ints(320) for a in args)
    template = next(tp for tp in registry.get_templates(backend="cute") if tp.op == "index_shuffling")
    full = dict(zip(declaration.get("index_shuffling").signature, sig))
    assert template.heuristic("sm90a", full, {"T": 7, "E": 320})["max_experts"] == 512


@pytest.mark.parametrize("op", ["silu_mul", "silu_mul_quant"])
def test_valid_token_count_reaches_the_kernel(monkeypatch, op):
    """valid_token_count is passed to the same kernels as a [1] int32 tensor; without it the
    kernels get a cached placeholder holding 2^31 - 1 (every row)."""
    from mslk_dsl.ops import dispatch

    launched = _launched_with(monkeypatch, op)
    call = getattr(ops, op)
    count = torch.tensor(3, dtype=torch.int32)
    call(t(5, 16), t(5, 16), valid_token_count=count)
    call(t(5, 16), t(5, 16))
    (with_sig, with_args), (without_sig, without_args) = launched
    assert with_sig == without_sig
    assert with_args[-1].shape == (1,) and int(with_args[-1]) == 3
    all_rows = dispatch.placeholder(torch.device("cpu"), torch.int32, fill=2**31 - 1)
    assert without_args[-1] is all_rows and int(all_rows) == 2**31 - 1 and dispatch.is_placeholder(all_rows)


def test_one_column_moe_inputs_run_as_two_columns_on_rocm(monkeypatch):
    """FlyDSL kernels cannot take [rows, 1] tensors (unit strides on both dimensions): on a ROCm
    target the MoE ops pad them to two columns and return the first. Stand-in kernels, written
    in torch, check what they are given."""
    from mslk_dsl.ops import declaration, validate

    monkeypatch.setenv("MSLK_DSL_TARGET", "gfx942")
    monkeypatch.setattr(validate, "gpu", lambda *args: None)   # CPU tensors stand in for GPU ones
    widths = []

    def gather(x, tok, exp, scores, valid, out):
        widths.append(x.shape[1])
        out.copy_(x[tok.long()] * scores[tok.long(), exp.long()][:, None].to(x.dtype))

    def scatter(out, y, tok, valid, workspace):
        widths.append(out.shape[1])
        out.index_add_(0, tok.long(), y)

    def route(scores, valid, counts, expert_indices, token_indices, ws_slots, ws_hist, top_k, start, end):
        widths.append(scores.shape[1])
        e = scores.float().argmax(dim=1)                  # top_k = 1, ties to the lower expert
        order = torch.argsort(e, stable=True)
        counts[:-2] = torch.bincount(e, minlength=scores.shape[1])
        counts[-2:] = torch.tensor([scores.shape[0], scores.shape[0]])
        expert_indices.copy_(e[order]), token_indices.copy_(order)

    kernels = {"gather_scale_dense_tokens": gather, "scatter_add_dense_tokens": scatter, "index_shuffling": route}
    for name, kernel in kernels.items():
        monkeypatch.setattr(declaration.get(name).kernels, "selection",
                            lambda *args, kernel=kernel: (kernel, {"method": "atomic"}))

    tokens, x = torch.tensor([2, 0, 2, 1], dtype=torch.int32), t(3, 1)
    scores = torch.rand(3, 1)
    counts, expert_indices, token_indices = ops.index_shuffling(scores, top_k=1)
    assert counts.tolist() == [3, 3, 3] and expert_indices.tolist() == [0, 0, 0]
    assert token_indices.tolist() == [0, 1, 2]
    gathered = ops.gather_scale_dense_tokens(x, tokens, torch.zeros(4, dtype=torch.int32), scores)
    torch.testing.assert_close(gathered, x[tokens.long()] * scores[tokens.long()].to(bf16))
    out = t(3, 1)
    expected = out.float().index_add(0, tokens.long(), gathered.float()).to(bf16)
    ops.scatter_add_dense_tokens(out, gathered, tokens)
    torch.testing.assert_close(out, expected)
    assert widths == [2, 2, 2]
    # CUDA targets take one-column tensors as they are.
    monkeypatch.setenv("MSLK_DSL_TARGET", "sm90a")
    ops.gather_scale_dense_tokens(x, tokens, torch.zeros(4, dtype=torch.int32), scores)
    assert widths[-1] == 1


# -- out=: the caller's output tensors (checked by one helper for every op) -------------------------
def _outputs(out, inputs=None):
    from mslk_dsl.ops import validate

    x = inputs if inputs is not None else t(4, 8)
    return validate.outputs("quantize_fp8_row", out, [(x.shape, fp8), (x.shape[:-1], f32)], x.device, {"x": x})


OUT_CASES = [
    ("not a tuple", lambda: _outputs(torch.empty(4, 8, dtype=fp8)), TypeError, ["out", "tuple of 2"]),
    ("one tensor short", lambda: _outputs((torch.empty(4, 8, dtype=fp8),)), TypeError, ["out", "tuple of 2"]),
    ("dtype", lambda: _outputs((torch.empty(4, 8, dtype=bf16), torch.empty(4))), TypeError, ["out[0]", "dtype"]),
    ("shape", lambda: _outputs((torch.empty(4, 8, dtype=fp8), torch.empty(5))), ValueError, ["out[1]", "shape"]),
    ("device", lambda: _outputs((torch.empty(4, 8, dtype=fp8), torch.empty(4, device="meta"))), ValueError,
     ["out[1]", "meta"]),
    ("not contiguous", lambda: _outputs((torch.empty(8, 4, dtype=fp8).t(), torch.empty(4))), ValueError,
     ["out[0]", "contiguous"]),
    ("overlaps an input", lambda: _outputs((torch.empty(4, 8, dtype=fp8), (x := t(4, 8)).view(-1).view(f32)[:4]), x),
     ValueError, ["out[1]", "shares memory with x"]),
    ("outputs overlap", lambda: _outputs(((b := torch.empty(64, dtype=torch.uint8))[:32].view(fp8).view(4, 8),
                                          b[16:32].view(f32))), ValueError, ["out[1]", "shares memory with out[0]"]),
]


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in OUT_CASES], ids=[c[0] for c in OUT_CASES])
def test_bad_out_is_rejected_with_the_argument_named(call, exc, words):
    with pytest.raises(exc) as err:
        call()
    assert isinstance(err.value, MslkDslError), f"{type(err.value).__name__} is not an MslkDslError"
    for word in words:
        assert word in str(err.value), f"{word!r} not in: {err.value}"


def test_good_out_is_returned_and_none_allocates():
    xq, scale = torch.empty(4, 8, dtype=fp8), torch.empty(4)
    got = _outputs((xq, scale))
    assert got[0] is xq and got[1] is scale
    new = _outputs(None)
    assert [(o.shape, o.dtype) for o in new] == [((4, 8), fp8), ((4,), f32)]
    # Bytes next to each other but not shared (one buffer, two halves) are fine.
    b = torch.empty(64, dtype=torch.uint8)
    _outputs((b[:32].view(fp8).view(4, 8), b[32:48].view(f32)))


def test_one_output_takes_a_tensor_not_a_tuple():
    from mslk_dsl.ops import validate

    x = t(4, 8)
    with pytest.raises(TypeError, match="out must be a tensor"):
        validate.outputs("silu_mul", (torch.empty(4, 8, dtype=bf16),), [(x.shape, bf16)], x.device, {"x0": x})


def test_gemm_leading_dims_zero_sizes_and_n_multiple_of_8(monkeypatch):
    """MSLK's GEMM contract on the CPU with a stand-in kernel: x / xq [..., M, K] -> [..., M, N]
    (the kernel sees [M_total, K]), x_scale as xq.shape[:-1] or flattened, N any multiple of 8,
    and M, N or K of 0 answered without a launch (K = 0: zeros, or the bias)."""
    from mslk_dsl.ops import declaration, validate

    seen = []

    def gemm(a, b, *rest):
        seen.append((tuple(a.shape), tuple(b.shape)))
        out = rest[-1] if len(rest) in (1, 5) else rest[0]
        if len(rest) == 4:   # fp8: x_scale, w_scale, bias, out
            xs, ws, _, out = rest
            out.copy_(((a.float() @ b.float().T) * xs[:, None] * ws[None, :]).to(out.dtype))
        else:
            out.copy_((a.float() @ b.float().T).to(out.dtype))

    monkeypatch.setattr(validate, "gpu", lambda *args: None)
    for name in ("bf16_gemm", "f8f8bf16_rowwise"):
        monkeypatch.setattr(declaration.get(name).kernels, "selection", lambda *args: (gemm, {}))
    x, w = t(2, 3, 16), t(24, 16)                       # N = 24: a multiple of 8, not of 16
    y = ops.bf16_gemm(x, w)
    assert y.shape == (2, 3, 24) and seen[-1] == ((6, 16), (24, 16))
    torch.testing.assert_close(y.float(), (x.float() @ w.float().T), rtol=1e-2, atol=1e-2)
    xq, wq = t(2, 3, 32).to(fp8), t(24, 32).to(fp8)
    xs, ws = torch.rand(2, 3) + 0.5, torch.rand(24) + 0.5
    for x_scale in (xs, xs.reshape(6)):
        y = ops.f8f8bf16_rowwise(xq, wq, x_scale, ws)
        assert y.shape == (2, 3, 24) and y.dtype == bf16
        ref = (xq.float() @ wq.float().T) * xs[..., None] * ws
        torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="x_scale has shape"):
        ops.f8f8bf16_rowwise(xq, wq, xs.reshape(3, 2), ws)
    calls = len(seen)
    assert ops.bf16_gemm(t(0, 16), w).shape == (0, 24)                      # M = 0
    assert ops.bf16_gemm(t(5, 16), t(0, 16)).shape == (5, 0)               # N = 0
    assert torch.equal(ops.bf16_gemm(t(5, 0), t(24, 0)), torch.zeros(5, 24, dtype=bf16))  # K = 0
    bias = t(24)
    k0 = ops.f8f8bf16_rowwise(t(5, 0).to(fp8), t(24, 0).to(fp8), torch.ones(5), torch.ones(24), bias)
    assert torch.equal(k0, bias.expand(5, 24))
    assert len(seen) == calls                                               # none launched
    with pytest.raises(ValueError, match="N=20"):
        ops.bf16_gemm(t(4, 16), t(20, 16))

