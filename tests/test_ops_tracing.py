"""Every torch op has a schema and a fake: shapes and dtypes under FakeTensorMode, and a chain
of ops traces into a single graph under torch.compile(fullgraph=True) with no GPU."""
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mslk_dsl.ops  # noqa: F401  (registers torch.ops.mslk_dsl.*)
from mslk_dsl import registry

from mslk_dsl.ops import declarations

bf16 = torch.bfloat16
DECLARED = list(declarations())


def test_every_template_op_is_a_torch_op():
    for op in registry.ops():
        if op == "scale_copy":  # the framework-test template is not a library op
            continue
        assert op in DECLARED, f"{op} has templates but no op declaration"
        assert hasattr(torch.ops.mslk_dsl, op), f"{op} has templates but no torch op"
        assert getattr(torch.ops.mslk_dsl, op).__doc__, f"{op} has no docstring"


def _small_args(decl, device: str):
    """The declaration's example call at its small problem size (same values on any device)."""
    torch.manual_seed(0)
    return decl.example(dict(decl.small_problem), {}, torch.device(device))


@pytest.mark.parametrize("name", DECLARED)
def test_fake_matches_the_reference(name):
    """The torch op's fake (from the declaration's outputs), traced on fake CUDA tensors, gives the
    shapes and dtypes that the op's plain-torch reference computes on the same CPU inputs."""
    decl = declarations()[name]
    assert decl.example is not None and decl.reference is not None, f"{name}: declare example and reference"
    with FakeTensorMode():
        got = getattr(torch.ops.mslk_dsl, name)(*_small_args(decl, "cuda"))
    args = _small_args(decl, "cpu")
    want = decl.reference(*args)
    if not decl.outputs(*args):   # in place: the reference returns the updated first argument
        assert got is None
        return
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert [(tuple(o.shape), o.dtype) for o in got] == [(tuple(o.shape), o.dtype) for o in want], name
    assert all(o.device.type == "cuda" for o in got)


@pytest.mark.parametrize("name", DECLARED)
def test_fakes_match_the_references_at_random_sizes(name):
    """Bounded fuzz, driven by the declarations (seed printed): each op's example at random sizes
    of its problem (1 .. 2 x its small size + 3; sizes its checks refuse are skipped) gives, through
    the torch op's fake, the shapes and dtypes of the reference on the same CPU inputs. Each size is
    drawn as any integer or, as often, as a multiple of 16: the GEMMs need aligned N and K, and
    drawing only free integers left a grouped FP8 problem acceptable about once in 300 draws, so the
    search could find none to check."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import assume, given, settings, strategies as st

    from mslk_dsl.ops import call

    decl = declarations()[name]
    def size(small: int):
        free = st.integers(1, 2 * small + 3)
        if 2 * small + 3 < 16:
            return free
        return st.one_of(free, st.integers(1, (2 * small + 3) // 16).map(lambda m: 16 * m))

    sizes = {k: size(v) for k, v in decl.small_problem.items()}
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"fuzz seed {seed}")

    @settings(max_examples=15, deadline=None, database=None,
              suppress_health_check=list(hypothesis.HealthCheck))
    @given(problem=st.fixed_dictionaries(sizes))
    def check(problem):
        torch.manual_seed(0)
        args = decl.example(dict(problem), {}, torch.device("cpu"))
        if decl.composite is None:
            defaults = [a.default_value for a in call._schema(decl).arguments[len(args):]]
            try:
                decl.check(*args, *defaults)
            except (ValueError, TypeError):
                assume(False)
        want = decl.reference(*args)
        with FakeTensorMode():
            torch.manual_seed(0)
            got = getattr(torch.ops.mslk_dsl, name)(*decl.example(dict(problem), {}, torch.device("cuda")))
        if not decl.outputs(*args):
            assert got is None
            return
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        assert [(tuple(o.shape), o.dtype) for o in got] == [(tuple(o.shape), o.dtype) for o in want], (name, problem)

    hypothesis.seed(seed)(check)()


def test_the_references_run_on_the_cpu():
    """Each reference computes on real (CPU) tensors: the GPU tests and the fuzz test compare the
    kernels against them."""
    for name, decl in declarations().items():
        args = decl.example(dict(decl.small_problem), {}, torch.device("cpu"))
        result = decl.reference(*args)
        results = result if isinstance(result, tuple) else (result,)
        assert all(isinstance(r, torch.Tensor) and r.numel() > 0 for r in results), name


def test_scatter_add_is_declared_as_mutating_its_output():
    schema = torch.ops.mslk_dsl.scatter_add_dense_tokens.default._schema
    assert schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write
    assert len(schema.returns) == 0
    with FakeTensorMode():
        out = torch.empty(4, 8, dtype=bf16, device="cuda")
        assert torch.ops.mslk_dsl.scatter_add_dense_tokens(out, out, torch.empty(4, dtype=torch.int32,
                                                                                     device="cuda")) is None


def test_meta_tensors_use_the_fakes():
    x = torch.empty(3, 16, dtype=bf16, device="meta")
    y, res = torch.ops.mslk_dsl.rmsnorm_add(x, x, torch.empty(16, dtype=bf16, device="meta"))
    assert y.shape == (3, 16) and res.device.type == "meta"
    # an fp32 residual stream: new_residual stays fp32, y takes x's dtype
    y, res = torch.ops.mslk_dsl.rmsnorm_add(x, x.float(), None)
    assert (y.dtype, res.dtype) == (bf16, torch.float32) and res.shape == (3, 16)


def test_compile_chain_is_one_graph():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(x, residual, weight, w_gate, w_up, w_down):
        h, residual = torch.ops.mslk_dsl.rmsnorm_add(x, residual, weight, 1e-6)
        gate = torch.ops.mslk_dsl.bf16_gemm(h, w_gate)
        up = torch.ops.mslk_dsl.bf16_gemm(h, w_up)
        q, s = torch.ops.mslk_dsl.silu_mul_quant(gate, up)
        wq, ws = torch.ops.mslk_dsl.quantize_fp8_row(w_down)
        return torch.ops.mslk_dsl.f8f8bf16_rowwise(q, wq, s, ws), residual

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    meta = dict(device="meta", dtype=bf16)
    out, res = compiled(torch.empty(8, 64, **meta), torch.empty(8, 64, **meta), torch.empty(64, **meta),
                        torch.empty(128, 64, **meta), torch.empty(128, 64, **meta), torch.empty(64, 128, **meta))
    assert len(graphs) == 1
    called = " ".join(str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function")
    for op in ("rmsnorm_add", "bf16_gemm", "silu_mul_quant", "quantize_fp8_row", "f8f8bf16_rowwise"):
        assert f"mslk_dsl.{op}" in called, called
    assert out.shape == (8, 64) and out.dtype == bf16 and res.shape == (8, 64)


@pytest.mark.parametrize("name", DECLARED)
def test_the_result_check_passes_the_reference_and_catches_a_changed_result(name):
    """``OpDecl.mismatch`` / ``max_error`` (what the GPU tests and the autotuner judge kernels by)
    on each op's CPU reference: it matches itself, and a result changed by far more than rounding
    (a float result scaled, an integer one shifted, within the defined parts) is reported."""
    decl = declarations()[name]
    args = _small_args(decl, "cpu")

    def reference():
        fresh = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        out = decl.reference(*fresh)
        return fresh[0] if not decl.outputs(*args) else out

    want = reference()
    assert decl.mismatch(reference(), want) is None and decl.max_error(reference(), want) == 0.0
    changed = list(reference()) if isinstance(want, tuple) else [reference()]
    i = next(i for i, t in enumerate(decl.defined_results(want)) if t.numel())   # a result with defined parts
    t = changed[i]
    changed[i] = (t.float() * 3 + 1).to(t.dtype) if t.is_floating_point() else t + 1
    got = tuple(changed) if isinstance(want, tuple) else changed[0]
    assert decl.mismatch(got, want) is not None
    assert decl.max_error(got, want) > 0
