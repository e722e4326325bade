"""Every torch op has a schema and a fake: shapes and dtypes under FakeTensorMode, and a chain
of ops traces into a single graph under torch.compile(fullgraph=True) with no GPU."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mslk_dsl.ops  # noqa: F401  (registers torch.ops.mslk_dsl.*)
from mslk_dsl import registry

bf16, f32, fp8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
M, K, N, E = 5, 64, 32, 16


def fake_calls():
    """(op name, call) pairs on fake CUDA tensors, with the expected output (shape, dtype)s."""
    x = torch.empty(M, K, dtype=bf16, device="cuda")
    w = torch.empty(N, K, dtype=bf16, device="cuda")
    xq, wq = x.to(fp8), w.to(fp8)
    xs, ws = torch.empty(M, dtype=f32, device="cuda"), torch.empty(N, dtype=f32, device="cuda")
    hidden = torch.empty(K, dtype=bf16, device="cuda")
    scores = torch.empty(M, E, dtype=f32, device="cuda")
    tok = torch.empty(M * 2, dtype=torch.int32, device="cuda")
    ops = torch.ops.mslk_dsl
    return [
        ("silu_mul", lambda: ops.silu_mul(x, x), [((M, K), bf16)]),
        ("quantize_fp8_row", lambda: ops.quantize_fp8_row(x), [((M, K), fp8), ((M,), f32)]),
        ("silu_mul_quant", lambda: ops.silu_mul_quant(x, x), [((M, K), fp8), ((M,), f32)]),
        ("dequantize_fp8_row", lambda: ops.dequantize_fp8_row(xq, xs), [((M, K), bf16)]),
        ("rmsnorm", lambda: ops.rmsnorm(x, hidden, 1e-6), [((M, K), bf16)]),
        ("rmsnorm_add", lambda: ops.rmsnorm_add(x, x, hidden, 1e-6), [((M, K), bf16), ((M, K), bf16)]),
        ("bf16_gemm", lambda: ops.bf16_gemm(x, w), [((M, N), bf16)]),
        ("f8f8bf16_rowwise", lambda: ops.f8f8bf16_rowwise(xq, wq, xs, ws), [((M, N), bf16)]),
        ("index_shuffling", lambda: ops.index_shuffling(scores, top_k=2),
         [((E + 2,), torch.int32), ((M * 2,), torch.int32), ((M * 2,), torch.int32)]),
        ("gather_scale_dense_tokens", lambda: ops.gather_scale_dense_tokens(x, tok, tok, scores),
         [((M * 2, K), bf16)]),
    ]


def test_every_template_op_is_a_torch_op():
    for op in registry.ops():
        if op == "scale_copy":  # the framework-test template is not a library op
            continue
        assert hasattr(torch.ops.mslk_dsl, op), f"{op} has templates but no torch op"
        assert getattr(torch.ops.mslk_dsl, op).__doc__, f"{op} has no docstring"


@pytest.mark.parametrize("index", range(10))
def test_fake_shapes_and_dtypes(index):
    with FakeTensorMode():
        name, call, expected = fake_calls()[index]
        out = call()
        outs = out if isinstance(out, tuple) else (out,)
        assert [(tuple(o.shape), o.dtype) for o in outs] == expected, name
        assert all(o.device.type == "cuda" for o in outs)


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
