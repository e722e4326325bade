"""f8f8bf16_rowwise's MSLK arguments on the CPU, with stand-in kernels: the bias in bf16 or fp32
and ``use_fast_accum`` reach the kernel choice as the signature parts ``bias`` and
``fast_accum``, in MSLK's argument order; a fast and a promoted call of the same layout never
replay each other's launch plan. The GEMMs and grouped GEMMs hand their kernels 16-byte aligned
operands. (The kernels themselves: tests/gpu/test_gemm_cute.py.)"""
import pytest
import torch

from mslk_dsl import ops

bf16, f32, fp8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn


@pytest.fixture
def stand_in(monkeypatch):
    """Every f8f8bf16_rowwise kernel choice returns a stand-in that computes the op in torch and
    records (signature, which kernel ran)."""
    from mslk_dsl.ops import call, declaration, validate

    ran = []

    def kernel_for(signature):
        def kernel(a, b, xs, ws, bias, out):
            ran.append(signature)
            y = (a.float() @ b.float().T) * xs[:, None] * ws[None, :]
            if signature[0] != "none":
                y = y + bias.float()
            out.copy_(y.to(out.dtype))
        return kernel

    kernels = {}
    monkeypatch.setattr(validate, "gpu", lambda *args: None)
    monkeypatch.setattr(declaration.get("f8f8bf16_rowwise").kernels, "selection",
                        lambda device, signature, problem, config: (kernels.setdefault(signature,
                                                                                       kernel_for(signature)), {}))
    call.clear_python_plans()
    yield ran
    call.clear_python_plans()


def _operands():
    g = torch.Generator().manual_seed(0)
    xq = torch.randn(6, 32, generator=g).to(fp8)
    wq = torch.randn(24, 32, generator=g).to(fp8)
    return xq, wq, torch.rand(6, generator=g) + 0.5, torch.rand(24, generator=g) + 0.5


def test_bias_dtype_and_fast_accum_pick_the_kernel(stand_in):
    xq, wq, xs, ws = _operands()
    product = (xq.float() @ wq.float().T) * xs[:, None] * ws
    bias = torch.linspace(-3, 3, 24)
    ops.f8f8bf16_rowwise(xq, wq, xs, ws)                       # MSLK's defaults: no bias, fast
    ops.f8f8bf16_rowwise(xq, wq, xs, ws, bias.to(bf16), False)  # MSLK's order: bias, use_fast_accum
    y = ops.f8f8bf16_rowwise(xq, wq, xs, ws, bias, use_fast_accum=True)
    assert stand_in == [("none", True), ("bfloat16", False), ("float32", True)]
    torch.testing.assert_close(y.float(), product + bias, rtol=1e-2, atol=1e-2)
    # torch's op has MSLK's schema: (XQ, WQ, x_scale, w_scale, bias=None, use_fast_accum=True).
    schema = torch.ops.mslk_dsl.f8f8bf16_rowwise.default._schema
    assert [(a.name, str(a.type), a.default_value) for a in schema.arguments][4:] == [
        ("bias", "Optional[Tensor]", None), ("use_fast_accum", "bool", True)]


def test_fast_and_promoted_calls_never_share_a_plan(stand_in):
    """Plans are keyed by layout and a bool's layout is its type: only fast calls are planned,
    and a promoted call's launch is never remembered, in either order."""
    xq, wq, xs, ws = _operands()
    order = [True, False, True, False, False, True, True]
    for fast in order:
        ops.f8f8bf16_rowwise(xq, wq, xs, ws, None, fast)
    assert stand_in == [("none", fast) for fast in order]


def test_bad_bias_and_fast_accum_arguments(stand_in):
    xq, wq, xs, ws = _operands()
    with pytest.raises(TypeError, match="bias has dtype torch.float16"):
        ops.f8f8bf16_rowwise(xq, wq, xs, ws, torch.zeros(24, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias"):
        ops.f8f8bf16_rowwise(xq, wq, xs, ws, torch.zeros(16, dtype=f32))
    with pytest.raises(TypeError, match="use_fast_accum must be a bool"):
        ops.f8f8bf16_rowwise(xq, wq, xs, ws, None, 1)
    assert stand_in == []
    # K = 0: the bias (either dtype) broadcast, as MSLK returns, without a launch.
    bias = torch.linspace(-3, 3, 24)
    for b in (bias, bias.to(bf16)):
        y = ops.f8f8bf16_rowwise(torch.zeros(5, 0).to(fp8), torch.zeros(24, 0).to(fp8), torch.ones(5),
                                 torch.ones(24), b, False)
        assert torch.equal(y, b.to(bf16).expand(5, 24))
    assert stand_in == []


@pytest.mark.parametrize("name", ["bf16_gemm", "f8f8bf16_rowwise", "bf16bf16bf16_grouped_stacked",
                                  "f8f8bf16_rowwise_grouped_stacked"])
def test_operands_off_a_16_byte_boundary_reach_the_kernel_aligned(name, monkeypatch):
    """TMA loads x and w from 16-byte aligned addresses, and the kernels' launchers refuse others.
    A contiguous operand that starts one element past such an address (a view into a larger
    buffer) reaches the kernel as an aligned copy of the same values; torch's contiguous() would
    have handed it over as it is."""
    from mslk_dsl.ops import call, declaration, validate

    decl = declaration.get(name)
    launched = []
    monkeypatch.setattr(validate, "gpu", lambda *args: None)
    monkeypatch.setattr(decl.kernels, "selection", lambda device, signature, problem, config: (
        lambda *args: launched.append(args), {}))
    call.clear_python_plans()
    args = decl.example(decl.small_problem, {}, torch.device("cpu"))

    def off_boundary(t):
        return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t)

    x, w = off_boundary(args[0]), off_boundary(args[1])
    assert x.is_contiguous() and x.data_ptr() % 16 and w.data_ptr() % 16
    getattr(ops, name)(x, w, *args[2:])
    a, b = launched[0][:2]
    assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    assert torch.equal(a.view(torch.uint8), x.view(torch.uint8))
    assert torch.equal(b.view(torch.uint8).reshape(-1), w.view(torch.uint8).reshape(-1))
    call.clear_python_plans()
