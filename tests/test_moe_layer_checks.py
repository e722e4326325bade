"""gather_scale_quant_dense_tokens' input checks and launch arguments, and the MoE layer's
construction, checks and tracing, on the CPU (meta and fake tensors; no GPU)."""
import pytest
import torch
from grouped_standin import grouped_ops

from mslk_dsl import ops
from mslk_dsl.moe import MoE

bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32


def _gather_args(a=6, t=4, d=32, e=8):
    return [torch.randn(t, d).to(bf16), torch.randint(0, t, (a,), dtype=i32), torch.randint(0, e, (a,), dtype=i32),
            torch.rand(t, e)]


def _with(index, value):
    args = _gather_args()
    args[index] = value
    return args


BAD_GATHER = [
    ("x fp32", _with(0, torch.randn(4, 32)), TypeError, ["x", "dtype"]),
    ("x 1-D", _with(0, torch.randn(32).to(bf16)), ValueError, ["x", "2-D"]),
    ("x no columns", _with(0, torch.randn(4, 0).to(bf16)), ValueError, ["x", "column"]),
    ("token_indices float", _with(1, torch.zeros(6)), TypeError, ["token_indices", "dtype"]),
    ("expert_indices length", _with(2, torch.zeros(5, dtype=i32)), ValueError, ["expert_indices", "shape"]),
    ("scores rows", _with(3, torch.rand(5, 8)), ValueError, ["scores", "rows"]),
    ("scores dtype", _with(3, torch.rand(4, 8).half()), TypeError, ["scores", "dtype"]),
    ("scale_ub shape", _gather_args() + [torch.ones(2)], ValueError, ["scale_ub", "one element"]),
    ("scale_ub dtype", _gather_args() + [torch.ones(1).to(bf16)], TypeError, ["scale_ub"]),
    ("valid count dtype", _gather_args() + [None, torch.ones(1)], TypeError, ["valid_token_count"]),
    ("valid count shape", _gather_args() + [None, torch.ones(2, dtype=i32)], ValueError,
     ["valid_token_count", "one element"]),
    ("cpu", _gather_args(), ValueError, ["cpu"]),
]


@pytest.mark.parametrize("args,exc,words", [c[1:] for c in BAD_GATHER], ids=[c[0] for c in BAD_GATHER])
def test_gather_scale_quant_rejects_bad_input_naming_the_argument(args, exc, words):
    with pytest.raises(exc) as err:
        ops.gather_scale_quant_dense_tokens(*args)
    for word in words:
        assert word in str(err.value), f"{word!r} not in: {err.value}"


def _launched_args(monkeypatch, *args):
    from mslk_dsl.ops import declaration, validate

    launched = []
    monkeypatch.setattr(validate, "gpu", lambda *a: None)   # CPU tensors stand in for GPU ones
    monkeypatch.setattr(declaration.get("gather_scale_quant_dense_tokens").kernels, "selection",
                        lambda *a: (lambda *tensors: launched.append(tensors), {}))
    outputs = ops.gather_scale_quant_dense_tokens(*args)
    return launched, outputs


def test_gather_scale_quant_passes_constants_for_absent_scale_ub_and_valid_count(monkeypatch):
    """The kernels always read both: +inf caps nothing, INT32_MAX keeps every row; they are cached
    (no allocation per call) and a given one is passed through."""
    from mslk_dsl.ops import call

    call.clear_python_plans()
    x, tok, exp, scores = _gather_args()
    launched, (xq, scale) = _launched_args(monkeypatch, x, tok, exp, scores)
    (first,) = launched
    assert xq.shape == (6, 32) and xq.dtype == torch.float8_e4m3fn and scale.shape == (6,) and scale.dtype == f32
    valid, ub = first[4], first[5]
    assert valid.dtype == i32 and valid.tolist() == [2**31 - 1]
    assert ub.dtype == f32 and ub.tolist() == [float("inf")]
    # a repeat call with that layout is served by the launch plan, which holds the constants
    _, (xq2, _) = _launched_args(monkeypatch, torch.randn_like(x), tok.clone(), exp.clone(), scores.clone())
    assert len(launched) == 2 and launched[1][4] is valid and launched[1][5] is ub and launched[1][6] is xq2
    call.clear_python_plans()
    given_ub, given_n = torch.full((1,), 3.0), torch.full((1,), 2, dtype=i32)
    (third,), _ = _launched_args(monkeypatch, x, tok, exp, scores, given_ub, given_n)
    assert third[4].data_ptr() == given_n.data_ptr() and third[5].data_ptr() == given_ub.data_ptr()


def test_gather_scale_quant_launches_nothing_for_no_rows(monkeypatch):
    x, _, _, scores = _gather_args()
    empty = torch.zeros(0, dtype=i32)
    launched, (xq, scale) = _launched_args(monkeypatch, x, empty, empty, scores)
    assert launched == [] and xq.shape == (0, 32) and scale.shape == (0,)


def test_gather_scale_quant_reference_is_gather_then_quantize():
    x, tok, exp, scores = _gather_args()
    from mslk_dsl.ops.declaration import get

    xq, scale = get("gather_scale_quant_dense_tokens").reference(x, tok, exp, scores)
    rows = (x[tok.long()].float() * scores[tok.long(), exp.long()].unsqueeze(1)).to(bf16).float()
    # Each element within FP8's relative step (2^-3 at most), or, in the subnormal range, within
    # the subnormal step (2^-9 of the row's scale): small values of a row are subnormal in FP8.
    error = (xq.float() * scale[:, None] - rows).abs()
    assert torch.all(error <= rows.abs() * 2**-3 + scale[:, None] * 2**-9)
    assert torch.equal(scale, torch.clamp(rows.abs().amax(1), min=1 / 512) / 448.0)


# -- the layer ------------------------------------------------------------------------------------
def test_layer_shapes_and_parameter_layouts():
    layer = MoE(64, 32, num_experts=8, top_k=2, device="meta")
    shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert shapes == {"router": (64, 8), "w_gate": (8, 32, 64), "w_up": (8, 32, 64), "w_down": (8, 64, 32),
                      "shared_w_gate": (32, 64), "shared_w_up": (32, 64), "shared_w_down": (64, 32)}
    assert "shared" not in " ".join(n for n, _ in MoE(64, 32, 8, 2, shared_expert=False, device="meta")
                                    .named_parameters())


@pytest.mark.parametrize("kwargs,exc,word", [
    ({"top_k": 9}, ValueError, "top_k"), ({"top_k": 0}, ValueError, "top_k"),
    ({"dim": 40}, ValueError, "dim"), ({"hidden_dim": 0}, ValueError, "hidden_dim"),
    ({"dtype": torch.float16}, TypeError, "dtype")])
def test_layer_rejects_bad_configuration(kwargs, exc, word):
    args = {"dim": 64, "hidden_dim": 32, "num_experts": 8, "top_k": 2, **kwargs}
    with pytest.raises(exc, match=word):
        MoE(args.pop("dim"), args.pop("hidden_dim"), args.pop("num_experts"), args.pop("top_k"), device="meta",
            **args)


def test_layer_rejects_bad_input():
    layer = MoE(64, 32, 8, 2, device="meta")
    with pytest.raises(ValueError, match="dim=64"):
        layer(torch.empty(3, 48, dtype=bf16, device="meta"))
    with pytest.raises(TypeError, match="bfloat16"):
        layer(torch.empty(3, 64, device="meta"))


def _as_fp8_on_meta(layer: MoE) -> None:
    """What quantize_fp8_rowwise_ leaves (it quantizes on the GPU), as meta buffers."""
    for name in layer.expert_weight_names():
        w = getattr(layer, name)
        delattr(layer, name)
        layer.register_buffer(name, torch.empty(w.shape, dtype=torch.float8_e4m3fn, device="meta"))
        layer.register_buffer(name + "_scale", torch.empty(w.shape[:-1], device="meta"))
    layer.precision = "fp8_rowwise"


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
def test_layer_traces_to_one_graph_of_the_ops(shared, fp8):
    """torch.compile fullgraph over meta tensors: a host sync or a data-dependent shape anywhere
    in the forward pass would break the graph (or fail on meta data). Grouped GEMMs: mslk_dsl's
    ops where registered, else the torch stand-ins' fakes."""
    assert grouped_ops(allow_standin=True)
    layer = MoE(64, 32, num_experts=8, top_k=2, shared_expert=shared, device="meta")
    if fp8:
        _as_fp8_on_meta(layer)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(layer, backend=backend, fullgraph=True)(torch.empty(2, 5, 64, dtype=bf16, device="meta"))
    assert out.shape == (2, 5, 64) and out.dtype == bf16
    assert len(graphs) == 1
    called = {str(n.target).removesuffix(".default") for n in graphs[0].graph.nodes if n.op == "call_function"}
    routed = ["index_shuffling", "scatter_add_dense_tokens"]
    if fp8:
        routed += ["gather_scale_quant_dense_tokens", "silu_mul_quant", "f8f8bf16_rowwise_grouped_stacked"]
        routed += ["quantize_fp8_row", "f8f8bf16_rowwise"] if shared else []
    else:
        routed += ["gather_scale_dense_tokens", "silu_mul", "bf16bf16bf16_grouped_stacked"]
        routed += ["bf16_gemm"] if shared else []
    for op in routed:
        assert f"mslk_dsl.{op}" in called, (op, called)


@pytest.mark.parametrize("fp8", [False, True])
def test_eager_layer_calls_every_op_through_its_eager_function(monkeypatch, fp8):
    """Outside torch.compile the layer reaches every op, the grouped GEMMs included, through
    ``moe._op`` (the eager functions and their launch plans, not the dispatcher). Here ``_op`` is
    replaced by one that records the name and runs the torch op's meta kernel."""
    from mslk_dsl import moe

    called = []

    def recording_op(name):
        called.append(name)
        return getattr(torch.ops.mslk_dsl, name)

    monkeypatch.setattr(moe, "_op", recording_op)
    layer = MoE(64, 32, num_experts=8, top_k=2, shared_expert=False, device="meta")
    if fp8:
        _as_fp8_on_meta(layer)
    out = layer(torch.empty(2, 5, 64, dtype=bf16, device="meta"))
    assert out.shape == (2, 5, 64)
    grouped = "f8f8bf16_rowwise_grouped_stacked" if fp8 else "bf16bf16bf16_grouped_stacked"
    assert called.count(grouped) == 3 and "index_shuffling" in called and "scatter_add_dense_tokens" in called
