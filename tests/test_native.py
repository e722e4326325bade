"""The native launch path (mslk_dsl/native): plans keyed by exact input layouts, outputs allocated
by torch, kernel arguments mapped to inputs / outputs / views / held tensors, misses for anything
else. CPU tensors and TVM-FFI functions written in Python stand in for GPU tensors and kernels
(the GPU tests run the real ops through it)."""
import ctypes

import pytest
import torch

from mslk_dsl import native
from mslk_dsl.errors import KernelLaunchError, MslkDslError

tvm_ffi = pytest.importorskip("tvm_ffi")


def as_torch(t, dtype):
    """A torch view of a TVM-FFI tensor argument's memory (CPU)."""
    n = 1
    for s in t.shape:
        n *= s
    buf = (ctypes.c_uint8 * (n * torch.empty((), dtype=dtype).element_size())).from_address(t.data_ptr())
    return torch.frombuffer(buf, dtype=dtype).view(tuple(t.shape)) if n else torch.empty(tuple(t.shape), dtype=dtype)


def add_into(out, y):
    """A stand-in in-place kernel: out += y (CPU, fp32)."""
    ot = as_torch(out, torch.float32)
    ot += as_torch(y, torch.float32)


def test_repeat_call_runs_the_plan(launcher):
    calls = []

    def scale_add(x, y, held, out, alpha):   # out = x * alpha + y + held[0]
        calls.append((tuple(x.shape), tuple(out.shape), alpha))
        xt, yt, ot = (as_torch(t, torch.float32) for t in (x, y, out))
        ot.copy_(xt * alpha + yt + as_torch(held, torch.float32)[0])

    kernel = tvm_ffi.convert(scale_add)
    fast = native.fast_op("test_scale_add")
    fast.clear()
    held = torch.full((1,), 10.0)
    x, y = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    assert fast(x, y, 2.0) is native.MISS
    # The op ran the kernel on 2-D views of its 3-D tensors; the plan remembers the views.
    out = torch.empty(3, 4, 8)
    args = (x.view(12, 8), y.view(12, 8), held, out.view(12, 8), 2.0)
    kernel(*args)
    assert native.remember("test_scale_add", (x, y, 2.0), (out,), args, (0,), kernel, held=(held,))
    assert fast.plans() == 1
    x2, y2 = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    result = fast(x2, y2, 0.5)                        # the scalar is the call's, not the plan's
    assert result.shape == (3, 4, 8) and result.dtype == torch.float32
    torch.testing.assert_close(result, x2 * 0.5 + y2 + 10.0)
    assert calls[-1] == ((12, 8), (12, 8), 0.5)
    # Any other layout, type or arity misses.
    for other in [(x.double(), y, 2.0), (x[:2], y[:2], 2.0), (x.transpose(0, 1), y, 2.0), (x, y, 2),
                  (x, y), (x, y, 2.0, 1.0), (x, y, "2.0")]:
        assert fast(*other) is native.MISS, other
    unaligned = torch.randn(3 * 4 * 8 + 1)[1:].view(3, 4, 8)
    assert fast(unaligned, y, 2.0) is native.MISS     # the address modulo 16 is part of the layout
    # A plan made at one misaligned address does not serve another: rows 8 bytes past a 16-byte
    # boundary admit 8-byte accesses, rows 4 bytes past it only 4-byte ones.
    base = torch.randn(3 * 4 * 8 + 2)
    at8, at4 = base[2:].view(3, 4, 8), base[1:-1].view(3, 4, 8)
    assert fast(at8, y, 2.0) is native.MISS
    args8 = (at8.view(12, 8), y.view(12, 8), held, out.view(12, 8), 2.0)
    assert native.remember("test_scale_add", (at8, y, 2.0), (out,), args8, (0,), kernel, held=(held,))
    assert fast(at8, y, 2.0) is not native.MISS
    assert fast(at4, y, 2.0) is native.MISS

    class Sub(torch.Tensor):
        pass

    assert fast(x.as_subclass(Sub), y, 2.0) is native.MISS  # e.g. FakeTensor: the Python path decides
    assert fast(torch.nn.Parameter(x), y, 2.0) is not native.MISS  # weights are often Parameters
    assert fast(x, y, 2.0, key=1) is native.MISS


def test_several_outputs_none_returned_and_scratch(launcher):
    def split(x, a, b, scratch):
        xt = as_torch(x, torch.float32)
        as_torch(scratch, torch.float32).copy_(xt.sum(dim=1))
        as_torch(a, torch.float32).copy_(xt[:, :2])
        as_torch(b, torch.float32).copy_(as_torch(scratch, torch.float32))

    kernel = tvm_ffi.convert(split)
    x = torch.randn(5, 4)
    a, b, scratch = torch.empty(5, 2), torch.empty(5), torch.empty(5)
    kernel(x, a, b, scratch)
    assert native.remember("test_split", (x,), (a, b, scratch), (x, a, b, scratch), (1, 0), kernel)
    x2 = torch.randn(5, 4)
    got_b, got_a = native.fast_op("test_split")(x2)
    torch.testing.assert_close(got_a, x2[:, :2])
    torch.testing.assert_close(got_b, x2.sum(dim=1))

    kernel = tvm_ffi.convert(add_into)
    out, y = torch.zeros(4), torch.ones(4)
    kernel(out, y)
    assert native.remember("test_add_into", (out, y), (), (out, y), (), kernel)
    assert native.fast_op("test_add_into")(out, y) is None   # in place: returns None
    assert out.tolist() == [2.0] * 4


def test_calls_into_the_callers_out(launcher):
    """out= calls: the caller's tensors are inputs the kernel writes; a later call whose out shares
    memory with another input misses (the op's Python path raises), any other runs in place."""
    def double(x, out):
        as_torch(out, torch.float32).copy_(as_torch(x, torch.float32) * 2)

    kernel = tvm_ffi.convert(double)
    x, out = torch.randn(4, 8), torch.empty(4, 8)
    kernel(x, out)
    assert native.remember_into("test_double", (x,), (out,), (x, out), kernel)
    assert native.fast_op("test_double.out").plans() == 1
    x2, out2 = torch.randn(4, 8), torch.empty(4, 8)
    assert native.run_into("test_double", (x2,), (out2,))
    torch.testing.assert_close(out2, x2 * 2)
    assert not native.run_into("test_double", (x2,), out2)     # outputs come as a tuple
    assert not native.run_into("test_double", (x2,), (x2,))    # out is x: overlap
    buf = torch.randn(64)
    assert not native.run_into("test_double", (buf[:32].view(4, 8),), (buf[16:48].view(4, 8),))  # partial overlap
    assert native.run_into("test_double", (buf[:32].view(4, 8),), (buf[32:].view(4, 8),))  # adjacent: fine
    torch.testing.assert_close(buf[32:], buf[:32] * 2)
    assert not native.run_into("test_double", (x2,), (torch.empty(4, 9),))  # another layout


def test_unsafe_launches_are_not_remembered(launcher):
    kernel = tvm_ffi.convert(lambda *args: None)
    x = torch.randn(4, 8)
    out = torch.empty(4, 8)
    copy = x.clone()   # the op copied its input: the plan would keep reading the copy
    assert not native.remember("test_unsafe", (x,), (out,), (copy, out), (0,), kernel)
    assert not native.remember("test_unsafe", (x,), (out,), (x, out, 1e-6), (0,), kernel)  # a scalar not passed in
    assert not native.remember("test_unsafe", (x,), (out,), (x, out), (0,), lambda *args: None)  # not TVM-FFI
    # Inputs sharing memory (f(x, x)): a later f(p, q) must not be given p twice.
    assert not native.remember("test_unsafe", (x, x), (out,), (x, x, out), (0,), kernel)
    assert not native.remember("test_unsafe", (x, x.view(8, 4)), (out,), (x, x.view(8, 4), out), (0,), kernel)
    assert native.fast_op("test_unsafe").plans() == 0


def test_kernel_errors_raise(launcher):
    def fails(x, out):
        raise ValueError("bad launch")

    kernel = tvm_ffi.convert(fails)
    x, out = torch.randn(2, 2), torch.empty(2, 2)
    assert native.fast_op("test_fails").add((x,), (out,), (x, out), (0,), kernel)
    # The project's own error (also a RuntimeError), with the runtime's kind and message.
    with pytest.raises(KernelLaunchError, match="^test_fails: the kernel call failed: ValueError: bad launch"):
        native.fast_op("test_fails")(x)


def _quantize_layout(x):
    """The Python plan key of quantize_fp8_row(x): its layout with every schema argument's default."""
    from mslk_dsl.ops import call

    return call._layout((x, None, None, True, None, None))


def test_kernel_errors_are_kernel_launch_errors_on_the_python_path(monkeypatch):
    """A kernel call that fails (the checked path, a plan still offered to the launcher, the bare
    replay) raises KernelLaunchError naming the op, the runtime's error as its cause."""
    from mslk_dsl.ops import call, declaration, elementwise, validate

    failing = []

    def quantize_kernel(x, ub, xq, scale):
        if failing:
            raise RuntimeError("an illegal memory access was encountered")

    monkeypatch.setattr(validate, "gpu", lambda *args: None)
    monkeypatch.setattr(declaration.get("quantize_fp8_row").kernels, "selection", lambda *args: (quantize_kernel, {}))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    for answer in (None, False, "checked"):   # the launcher may still load; never will; no plan at all
        call.clear_python_plans()
        failing.clear()
        monkeypatch.setattr(native, "remember", lambda *args, **kw: None if answer == "checked" else answer)
        with native.bypassed():
            if answer != "checked":
                elementwise.quantize_fp8_row(x), elementwise.quantize_fp8_row(x)   # plans made
                plan = call._plans["quantize_fp8_row"][_quantize_layout(x)]
                # The failing call below runs the plan object (offered again) or the bare replay.
                assert (getattr(plan, "__name__", None) == "replay") == (answer is False), (answer, plan)
            failing.append(True)
            with pytest.raises(KernelLaunchError, match="^quantize_fp8_row: the kernel call failed: RuntimeError: "
                                                        "an illegal memory access") as raised:
                elementwise.quantize_fp8_row(x, config={} if answer == "checked" else None)
    assert isinstance(raised.value, MslkDslError) and isinstance(raised.value, RuntimeError)
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_plans_are_bounded(launcher):
    kernel = tvm_ffi.convert(lambda x, out: None)
    fast = native.fast_op("test_bounded")
    for n in range(1, 1200):
        x, out = torch.empty(n), torch.empty(n)
        assert native.remember("test_bounded", (x,), (out,), (x, out), (0,), kernel)
        assert 0 < fast.plans() <= 1024
    assert fast(torch.empty(1199)) is not native.MISS


def test_op_layer_serves_repeat_calls_natively(launcher, monkeypatch):
    """silu_mul's second call with a layout skips the Python path (no validation runs)."""
    from mslk_dsl.ops import call, declaration, elementwise, validate

    def silu_mul_kernel(x0, x1, out, count):
        a, b, o = (as_torch(t, torch.float32) for t in (x0, x1, out))
        o.copy_(torch.nn.functional.silu(a) * b)

    kernel = tvm_ffi.convert(silu_mul_kernel)
    monkeypatch.setattr(validate, "gpu", lambda *args: None)   # CPU tensors stand in for GPU ones
    monkeypatch.setattr(declaration.get("silu_mul").kernels, "selection", lambda *args: (kernel, {}))
    native.fast_op("silu_mul").clear()
    call.clear_python_plans()
    checked = []
    monkeypatch.setattr(validate, "tensor", lambda *args, **kw: checked.append(args[1]))
    x0, x1 = torch.randn(6, 16), torch.randn(6, 16)
    first = elementwise.silu_mul(x0, x1)
    assert checked == ["x0", "x1"]
    second = elementwise.silu_mul(x0, x1)
    assert checked == ["x0", "x1"]          # served by the plan: validation did not run again
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(second, torch.nn.functional.silu(x0) * x1)
    # silu_mul(x, x) adds no plan of either kind (its inputs share memory: which kernel argument
    # is which input would be ambiguous for a later call with two tensors), so it is not offered.
    native.fast_op("silu_mul").clear()
    call.clear_python_plans()
    offered = []
    remember = native.remember
    monkeypatch.setattr(native, "remember", lambda *args, **kw: offered.append(args[0]) or remember(*args, **kw))
    for _ in range(3):
        torch.testing.assert_close(elementwise.silu_mul(x0, x0), torch.nn.functional.silu(x0) * x0)
    assert offered == [] and native.fast_op("silu_mul").plans() == 0
    # A later call of that layout with two tensors is right, and gets its plan.
    torch.testing.assert_close(elementwise.silu_mul(x0, x1), torch.nn.functional.silu(x0) * x1)
    assert offered == ["silu_mul"] and native.fast_op("silu_mul").plans() == 1
    monkeypatch.undo()   # real validation again: another layout takes the Python path, which checks it
    with pytest.raises(TypeError, match="x1 has dtype torch.float64"):
        elementwise.silu_mul(x0, x1.double())


def test_python_plans_serve_where_the_launcher_cannot(monkeypatch):
    """Without the native launcher (ROCm's FlyDSL kernels are not TVM-FFI functions; or it is
    still loading), a repeat layout is served by a Python plan: no validation, the same result,
    views of inputs and outputs rebuilt for the new tensors, placeholders held, and an offer to
    the launcher on each replay while it may still load."""
    from mslk_dsl.ops import call, declaration, elementwise, validate

    seen = []

    def quantize_kernel(x, ub, xq, scale):   # stands in for the FlyDSL kernel: torch tensors in
        seen.append((tuple(x.shape), tuple(xq.shape), ub.numel()))
        ref_q, ref_s = elementwise._quantize_reference(x)
        xq.copy_(ref_q), scale.copy_(ref_s)

    monkeypatch.setattr(validate, "gpu", lambda *args: None)
    monkeypatch.setattr(declaration.get("quantize_fp8_row").kernels, "selection",
                        lambda *args: (quantize_kernel, {}))
    offers = []
    monkeypatch.setattr(native, "remember", lambda *args, **kw: offers.append(args[0]))  # None: "still loading"
    call.clear_python_plans()
    checked = []
    tensor_check = validate.tensor
    monkeypatch.setattr(validate, "tensor", lambda *a, **kw: checked.append(a[1]) or tensor_check(*a, **kw))
    with native.bypassed():   # as if no launcher were loaded
        x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
        first = elementwise.quantize_fp8_row(x)
        assert checked == ["x"] and offers == ["quantize_fp8_row"]
        y = torch.randn(2, 3, 64, dtype=torch.bfloat16)
        xq, scale = elementwise.quantize_fp8_row(y)
        assert checked == ["x"]                                       # the plan served it
        assert offers == ["quantize_fp8_row"] * 2                     # and offered it to the launcher again
        assert seen == [((6, 64), (6, 64), 1)] * 2                    # the kernel saw [rows, K] views
        ref_q, ref_s = elementwise._quantize_reference(y)
        assert xq.shape == (2, 3, 64) and scale.shape == (2, 3)
        assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_s)
        assert first[0].data_ptr() != xq.data_ptr()                   # fresh outputs per call
        # Another layout is checked again.
        elementwise.quantize_fp8_row(torch.randn(5, 64, dtype=torch.bfloat16))
        assert checked == ["x", "x"]
        # Once the launcher says no (False: it never will), the plan table holds the bare replay.
        monkeypatch.setattr(native, "remember", lambda *args, **kw: offers.append(args[0]) or False)
        elementwise.quantize_fp8_row(y)
        replay = call._plans["quantize_fp8_row"][_quantize_layout(y)]
        assert replay.__name__ == "replay" and len(offers) == 4   # (the 5 x 64 call offered one)
        xq2, scale2 = elementwise.quantize_fp8_row(y)
        assert len(offers) == 4 and checked == ["x", "x"]             # no offer, no checks
        assert torch.equal(xq2.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale2, ref_s)
        assert xq2.is_contiguous() and scale2.is_contiguous() and xq2.data_ptr() != xq.data_ptr()


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv("MSLK_DSL_NO_NATIVE", "1")
    assert not native.enabled()


def test_jit_off_loads_only_a_prebuilt_launcher(tmp_path, launcher):
    """With JIT off nothing is compiled at run time; `mslk-dsl native` builds the launcher ahead."""
    import os
    import subprocess
    import sys

    from support import run_python

    env = {"MSLK_DSL_CACHE_DIR": str(tmp_path), "MSLK_DSL_DISABLE_JIT": "1"}
    probe = "from mslk_dsl import native; print(native.load())"
    assert run_python(probe, env).stdout.strip() == "None"
    native_dir = tmp_path / "native"
    assert not native_dir.exists() or not any(p.endswith(".so") for p in os.listdir(native_dir))
    built = subprocess.run([sys.executable, "-m", "mslk_dsl.cli", "native"], env={**os.environ, **env},
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    assert os.path.exists(built.stdout.strip())
    assert "module 'mslk_dsl._launcher'" in run_python(probe, env).stdout


def test_none_inputs_are_part_of_the_layout(launcher):
    """An optional input left out (None) is matched as such: a plan made with it absent serves
    only calls where it is absent, and None is never passed to a kernel."""
    def copy(x, out):
        as_torch(out, torch.float32).copy_(as_torch(x, torch.float32))

    kernel = tvm_ffi.convert(copy)
    fast = native.fast_op("test_optional")
    fast.clear()
    x = torch.randn(4, 8)
    out = torch.empty_like(x)
    kernel(x, out)
    assert native.remember("test_optional", (x, None), (out,), (x, out), (0,), kernel)
    y = torch.randn(4, 8)
    torch.testing.assert_close(fast(y, None), y)
    assert fast(y, torch.randn(1)) is native.MISS
    assert fast(y) is native.MISS
    # a None kernel argument is refused (it could not be passed on)
    assert not native.remember("test_optional", (x, None), (out,), (x, out, None), (0,), kernel)


def test_a_fast_call_serves_from_plans_and_else_calls_its_fallback(launcher):
    def double(x, out):
        as_torch(out, torch.float32).copy_(as_torch(x, torch.float32) * 2)

    kernel = tvm_ffi.convert(double)
    fast = native.fast_op("test_fallback")
    fast.clear()
    fallen = []
    call = fast.with_fallback(lambda *args, **kwargs: fallen.append((args, kwargs)) or "fallback")
    assert call.op is fast
    x = torch.randn(4, 8)
    assert call(x) == "fallback" and fallen == [((x,), {})]      # no plan yet: the same arguments on
    out = torch.empty_like(x)
    kernel(x, out)
    assert native.remember("test_fallback", (x,), (out,), (x, out), (0,), kernel)
    y = torch.randn(4, 8)
    torch.testing.assert_close(call(y), y * 2)                   # a plan: no fallback
    assert call(y, key=1) == "fallback" and call(torch.randn(3, 8)) == "fallback"
    assert len(fallen) == 3 and fallen[1] == ((y,), {"key": 1})
    with pytest.raises(TypeError, match="callable"):
        fast.with_fallback(1)


def test_eager_functions_are_bound_to_their_plans(launcher):
    """An eager op calls its FastOp (falling back to its Python path) as a global of its own;
    bypassed() takes the launcher away from every eager function and gives it back."""
    import mslk_dsl.ops as ops

    names = ops.silu_mul.__globals__
    assert names["FAST"].op is native.fast_op("silu_mul") and names["FAST"].fallback is names["python_step"]
    assert names["FAST_OUT"] is native.fast_op("silu_mul.out")
    with native.bypassed():
        assert names["FAST"] is names["python_step"] and names["FAST_OUT"](1) is not None
        assert native.fast_op("silu_mul") is None
        assert native.remember("silu_mul", (), (), (), (), None) is False   # no plan is added
    assert names["FAST"].op is native.fast_op("silu_mul")


def test_plans_keyed_by_values_hold_their_fixed_scalars(launcher):
    """An op with plan_values (attention's mask flags and scale, decode's split count): its plans
    are keyed by those arguments' values, hold the scalars derived from them (declaration.Fixed)
    as constants, even where such a constant is the same Python object as an argument, and take
    tensors of up to 6 dimensions."""
    seen = []

    def kernel(x, out, scale, flag, count):
        seen.append((tuple(x.shape), scale, flag, count))
        as_torch(out, torch.float32).copy_(as_torch(x, torch.float32) * scale + flag)

    kernel = tvm_ffi.convert(kernel)
    native.key_by_values("test_keyed", (1, 2))
    fast = native.fast_op("test_keyed")
    fast.clear()
    x = torch.randn(2, 1, 3, 1, 2, 4)          # 6-D
    out = torch.empty_like(x)
    count = 5
    args = (x, out, 0.5, count, count)         # arg 3 is a constant that is the same object as count
    kernel(*args)
    assert native.remember("test_keyed", (x, 2.0, True, count), (out,), args, (0,), kernel, constants=(2, 3))
    y = torch.randn(2, 1, 3, 1, 2, 4)
    torch.testing.assert_close(fast(y, 2.0, True, 7), y * 0.5 + 5)
    assert seen[-1] == ((2, 1, 3, 1, 2, 4), 0.5, 5, 7)     # the constants, and the call's own count
    for other in [(y, 3.0, True, 7), (y, 2.0, False, 7), (y, 2, True, 7), (y, 2.0, True, 2.0 ** 70),
                  (y, 2.0, True, 1 << 70)]:
        assert fast(*other) is native.MISS, other
    # A second plan for other values; both serve.
    kernel(x, out, 0.25, 1, count)
    assert native.remember("test_keyed", (x, 3.0, True, count), (out,), (x, out, 0.25, 1, count), (0,), kernel,
                           constants=(2, 3))
    torch.testing.assert_close(fast(y, 3.0, True, 1), y * 0.25 + 1)
    torch.testing.assert_close(fast(y, 2.0, True, 1), y * 0.5 + 5)
    assert fast.plans() == 2
    # A scalar argument neither an input nor a constant still adds no plan.
    assert not native.remember("test_keyed", (x, 2.0, True, count), (out,), (x, out, 0.5, 1, count), (0,), kernel,
                               constants=(2,))
    with pytest.raises(RuntimeError, match="key them by values before"):
        native.key_by_values("test_keyed", (1,))
    too_deep = torch.randn(1, 1, 1, 1, 1, 1, 2)
    assert fast(too_deep, 2.0, True, 7) is native.MISS


def test_in_place_and_stream_bound_plans(launcher):
    """An op writing an input in place (scatter_add): the plan misses when that input overlaps
    another one, so the Python path decides. A stream-bound plan (split-K counters) serves the
    stream it was made on: on the CPU there is none, so every call."""
    kernel = tvm_ffi.convert(add_into)
    out, y = torch.zeros(8), torch.ones(8)
    kernel(out, y)
    assert native.remember("test_in_place", (out, y), (), (out, y), (), kernel, written=(0,), stream_bound=True)
    fast = native.fast_op("test_in_place")
    assert fast(out, y) is None and out.tolist() == [2.0] * 8
    both = torch.zeros(16)
    assert fast(both[:8], both[4:12]) is native.MISS      # overlapping: not served
    assert fast(both[:8], both[8:]) is None               # side by side: served
