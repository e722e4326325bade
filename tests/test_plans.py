"""Launch plans of the attention and routing ops on the CPU (stand-in kernels, no GPU): a repeat call with a
layout (and, for these ops, the values of their ``plan_values``) seen before skips the checks and
the kernel choice, gets fresh outputs and scratch, and passes the kernel the same derived scalars;
a call the plan does not cover (another mask, split count or scale; a copied input) takes the
checked path; a plan holds none of a call's tensors."""
import contextlib
import gc
import importlib
import math
import weakref

import pytest
import torch

from mslk_dsl import ops
from mslk_dsl.ops import call, declaration, validate

bf16 = torch.bfloat16
decode_module = importlib.import_module("mslk_dsl.ops.attention_decode")  # ops.attention_decode is the op
prefill_module = importlib.import_module("mslk_dsl.ops.attention")


PLANNED_OPS = ("attention_decode", "merge_attentions", "attention_fwd", "index_shuffling",
               "gather_scale_dense_tokens", "scatter_add_dense_tokens")


@pytest.fixture(params=["python", "native"])
def stand_in(request, monkeypatch):
    """Every kernel is a recorder of what it was given (shapes and scalars, never the tensors);
    ``chosen`` counts kernel choices per op, ``checked`` argument checks. Run twice: with the
    Python path's plans (the launcher bypassed, as on ROCm) and with the native launcher's (the
    recorder a TVM-FFI function, as CuTe kernels are)."""
    from mslk_dsl import native

    launched, chosen, checked = [], [], []

    def record(*args):
        launched.append(tuple(tuple(a.shape) if hasattr(a, "shape") else a for a in args))

    kernel = record
    if request.param == "native":
        request.getfixturevalue("launcher")
        kernel = pytest.importorskip("tvm_ffi").convert(record)
        for name in PLANNED_OPS:
            native.fast_op(name).clear()
            native.fast_op(name + ".out").clear()

    def selection_of(name):
        def selection(device, signature, problem, config):
            chosen.append((name, signature, problem))
            return kernel, {}
        return selection

    monkeypatch.setattr(validate, "gpu", lambda *args: None)   # CPU tensors stand in for GPU ones
    for name in PLANNED_OPS:
        monkeypatch.setattr(declaration.get(name).kernels, "selection", selection_of(name))
    for module in (decode_module, prefill_module):
        monkeypatch.setattr(module, "sm_count", lambda device: 132)   # an H200's SMs
    tensor_check = validate.tensor
    monkeypatch.setattr(validate, "tensor", lambda *a, **kw: checked.append(a[1]) or tensor_check(*a, **kw))
    call.clear_python_plans()
    with (native.bypassed() if request.param == "python" else contextlib.nullcontext()):
        yield launched, chosen, checked
    call.clear_python_plans()
    if request.param == "native":
        # The launcher, not the Python path, holds the plans of every op that ran.
        assert all(native.fast_op(name).plans() + native.fast_op(name + ".out").plans() >= 1
                   for name in {c[0] for c in chosen})
        for name in PLANNED_OPS:
            native.fast_op(name).clear()
            native.fast_op(name + ".out").clear()


def _decode_args(B=3, Mq=2, Hq=8, Hkv=2, D=64, L=256):
    return (torch.randn(B, Mq, Hq, D, dtype=bf16), torch.randn(B, L, Hkv, D, dtype=bf16),
            torch.randn(B, L, Hkv, D, dtype=bf16), torch.full((B,), L, dtype=torch.int32))


def test_attention_decode_repeat_layout_skips_checks_and_choice(stand_in):
    launched, chosen, checked = stand_in
    first = ops.attention_decode(*_decode_args())
    assert len(chosen) == 1 and "q" in checked
    checks = len(checked)
    args = _decode_args()
    out, lse = ops.attention_decode(*args)
    assert len(chosen) == 1 and len(checked) == checks            # the plan served it
    assert launched[1] == launched[0]                              # same shapes, same scalars
    q, k, v, lengths, table, o, l_, o_part, lse_part, counters, scale, causal, paged = launched[1]
    assert (scale, causal, paged) == (1 / math.sqrt(64), 1, 0) and table == (1, 1)
    assert o == (3, 2, 8, 64) and o_part[1:] == (3, 2, 8, 64) and lse_part[1:] == (3, 8, 2)
    assert out.shape == (3, 2, 8, 64) and lse.shape == (3, 8, 2)
    assert out.data_ptr() != first[0].data_ptr()                   # fresh outputs per call


@pytest.mark.parametrize("change,kernel_sees", [
    ({"causal": False}, lambda launch: launch[11] == 0),
    ({"num_splits": 3}, lambda launch: launch[7][0] == 3),
    ({"scale": 0.5}, lambda launch: launch[10] == 0.5),
])
def test_attention_decode_values_the_plan_does_not_cover_are_checked(stand_in, change, kernel_sees):
    """causal, num_splits and scale key the plans by value: another value is checked and chosen
    for (then planned in turn); a bad value is refused even after a good one was planned."""
    launched, chosen, checked = stand_in
    defaults = {"block_table": None, "scale": None, "causal": True, "num_splits": 0}
    ops.attention_decode(*_decode_args(), **defaults)
    ops.attention_decode(*_decode_args(), **{**defaults, **change})
    assert len(chosen) == 2 and kernel_sees(launched[-1])
    ops.attention_decode(*_decode_args(), **{**defaults, **change})
    assert len(chosen) == 2 and kernel_sees(launched[-1])          # now planned too
    bad = {"causal": {"num_splits": -1}, "num_splits": {"num_splits": -2}, "scale": {"scale": -0.5}}
    with pytest.raises(ValueError):
        ops.attention_decode(*_decode_args(), **{**defaults, **bad[next(iter(change))]})


def test_attention_decode_paged_plan(stand_in):
    launched, chosen, _ = stand_in
    pages = (torch.randn(12, 16, 2, 64, dtype=bf16), torch.randn(12, 16, 2, 64, dtype=bf16))
    table = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    q, _, _, lengths = _decode_args()
    for _ in range(2):
        ops.attention_decode(q.clone(), *pages, lengths.clone(), table.clone())
    assert len(chosen) == 1 and launched[1][4] == (3, 4) and launched[1][12] == 1


def test_a_plan_holds_no_tensor_of_a_call(stand_in):
    args = list(_decode_args())
    ops.attention_decode(*args)
    results = ops.attention_decode(*args)           # served by the plan
    refs = [weakref.ref(t) for t in (*args, *results)]
    del args, results
    gc.collect()
    assert all(r() is None for r in refs)


def test_merge_attentions_plans_and_copied_inputs(stand_in):
    launched, chosen, _ = stand_in
    parts, lses = torch.randn(3, 2, 1, 4, 64), torch.randn(3, 2, 4, 1)
    ops.merge_attentions(parts, lses)
    out, lse = ops.merge_attentions(parts.clone(), lses.clone())
    assert len(chosen) == 1 and launched[1] == ((3, 2, 1, 4, 64), (3, 2, 4, 1), (2, 1, 4, 64), (2, 4, 1))
    assert out.shape == (2, 1, 4, 64) and lse.shape == (2, 4, 1)
    # Partials the op copies for the kernel (not contiguous) keep no plan: each call chooses.
    strided = torch.randn(3, 2, 1, 4, 128)[..., :64]
    ops.merge_attentions(strided, lses)
    ops.merge_attentions(strided, lses)
    assert len(chosen) == 3


def test_attention_fwd_plans_per_mask(stand_in):
    launched, chosen, _ = stand_in
    q, k, v = (torch.randn(2, 17, 4, 64, dtype=bf16) for _ in range(3))
    for _ in range(2):
        ops.attention_fwd(q, k, v, causal=True)
    assert len(chosen) == 1
    *_, scale, left, right, max_ctas = launched[1]    # max_ctas: the persistent grid's bound
    assert scale == pytest.approx(64 ** -0.5) and right == 0 and max_ctas == 132
    ops.attention_fwd(q, k, v)                     # no mask: another kernel choice, other scalars
    assert len(chosen) == 2 and chosen[1][2] != chosen[0][2] and launched[2][-2] != 0
    ops.attention_fwd(q, k, v, window_left=4, window_right=0)
    ops.attention_fwd(q, k, v, window_left=4, window_right=0)
    assert len(chosen) == 3 and launched[-1][-3:-1] == (4, 0)


def test_index_shuffling_plans_per_top_k(stand_in):
    """top_k sizes the outputs and the expert range is a kernel scalar: both key the plans."""
    launched, chosen, _ = stand_in
    scores = torch.rand(6, 16)
    for _ in range(2):
        counts, experts, tokens = ops.index_shuffling(scores.clone(), None, None, None, 2)
    assert len(chosen) == 1 and experts.shape == (12,) and launched[1][-3:] == (2, 0, 16)
    counts, experts, tokens = ops.index_shuffling(scores.clone(), 4, 8, None, 3)
    assert len(chosen) == 2 and experts.shape == (18,) and launched[2][-3:] == (3, 4, 8)
    with pytest.raises(ValueError, match="top_k"):
        ops.index_shuffling(scores, None, None, None, 17)


def test_gather_plans_int32_indices_only(stand_in):
    """int32 routing indices go to the kernel as given (a plan replays); int64 ones are converted
    per call (no plan)."""
    launched, chosen, _ = stand_in
    x, scores = torch.randn(4, 32, dtype=bf16), torch.rand(4, 8)
    tok, exp = torch.randint(0, 4, (6,), dtype=torch.int32), torch.randint(0, 8, (6,), dtype=torch.int32)
    for _ in range(2):
        ops.gather_scale_dense_tokens(x.clone(), tok.clone(), exp.clone(), scores.clone())
    assert len(chosen) == 1
    for _ in range(2):
        ops.gather_scale_dense_tokens(x, tok.long(), exp.long(), scores)
    assert len(chosen) == 3


def test_an_unhashable_value_gets_the_checks_message(stand_in):
    """A plan_values argument of a wrong, unhashable type reaches the op's checks, not a hashing
    error of the plan lookup."""
    ops.attention_decode(*_decode_args())                 # a plan exists
    with pytest.raises(ValueError, match="scale must be a positive finite float"):
        ops.attention_decode(*_decode_args(), None, [0.5])


@pytest.mark.parametrize("split_k", [1, 2])
def test_split_k_gemm_python_plans_serve_their_own_stream(monkeypatch, split_k):
    """A split-K tile counter buffer belongs to the stream of the call that took it: the launch
    is stream-bound, so its Python plan is keyed by the current stream too and a call on another
    stream is checked and chosen for again (the GPU test test_split_k_plans_serve_their_own_stream
    checks the native plans). An unsplit launch serves every stream."""
    chosen = []

    def selection(device, signature, problem, config):
        chosen.append(problem)
        return (lambda *args: None), {"tile_m": 128, "tile_n": 128, "cluster_m": 1, "raster": "m", "group": 8,
                                      "split_k": split_k}

    stream = [1]
    monkeypatch.setattr(validate, "gpu", lambda *args: None)
    monkeypatch.setattr(declaration.get("bf16_gemm").kernels, "selection", selection)
    monkeypatch.setattr(call, "current_stream", lambda inputs: stream[0])
    call.clear_python_plans()
    x, w = torch.randn(200, 256, dtype=bf16), torch.randn(384, 256, dtype=bf16)
    with native_bypassed():
        for s in (1, 1, 1, 2, 2, 1):
            stream[0] = s
            ops.bf16_gemm(x, w)
    call.clear_python_plans()
    assert len(chosen) == (1 if split_k == 1 else 2)


def native_bypassed():
    from mslk_dsl import native
    return native.bypassed()


def test_out_calls_plan_natively_only_and_in_place_ops_on_both_paths(stand_in, request):
    """out= calls of a value-keyed op are served by native plans only (on the Python path each is
    checked); an op that updates an input in place is planned on both paths."""
    launched, chosen, checked = stand_in
    native_run = request.node.callspec.params["stand_in"] == "native"
    args = _decode_args()
    out = (torch.empty(3, 2, 8, 64, dtype=bf16), torch.empty(3, 8, 2))
    for _ in range(3):
        assert ops.attention_decode(*args, out=out) is out
    assert len(chosen) == (1 if native_run else 3)
    overlapping = (out[0], out[0].view(-1).view(torch.float32)[:48].view(3, 8, 2))   # lse inside out: refused
    with pytest.raises(ValueError, match="share"):
        ops.attention_decode(*args, out=overlapping)
    tokens, rows = torch.zeros(5, 64, dtype=bf16), torch.randn(7, 64, dtype=bf16)
    index = torch.randint(0, 5, (7,), dtype=torch.int32)
    checks = len(checked)
    for _ in range(3):
        assert ops.scatter_add_dense_tokens(tokens, rows, index) is None
    assert len(checked) - checks == 3                                    # 3 tensor checks, once
    assert launched[-1][:3] == ((5, 64), (7, 64), (7,))


def test_an_in_place_plan_refuses_overlapping_inputs(stand_in):
    """A planned in-place op still refuses a call whose written input overlaps another input
    (the plan's overlap test sends it to the checks, which name the overlap); a call that
    overlaps nothing is served again."""
    launched, chosen, _ = stand_in
    tokens = torch.zeros(16, 64, dtype=bf16)
    index = torch.randint(0, 8, (8,), dtype=torch.int32)
    for _ in range(2):
        ops.scatter_add_dense_tokens(tokens[:8], tokens[8:].clone(), index)
    assert len(chosen) == 1
    launches = len(launched)
    with pytest.raises(ValueError, match="out_tokens is updated in place and shares memory with in_tokens"):
        ops.scatter_add_dense_tokens(tokens[:8], tokens[4:12], index)    # rows 4-7 are both
    assert len(launched) == launches
    ops.scatter_add_dense_tokens(tokens[:8], tokens[8:], index)           # adjacent, not overlapping
    assert len(chosen) == 1 and len(launched) == launches + 1


def test_stream_bound_decode_python_plans_follow_the_stream(stand_in, monkeypatch, request):
    """attention_decode's fused merge counts splits in counters of the calling stream: on the
    Python path its plans are keyed by the stream (the native launcher reads the stream itself)."""
    if request.node.callspec.params["stand_in"] == "native":
        pytest.skip("the native launcher reads the current stream itself: GPU test "
                    "test_split_k_plans_serve_their_own_stream")
    _, chosen, _ = stand_in
    kernels = declaration.get("attention_decode").kernels
    select = kernels.selection
    monkeypatch.setattr(kernels, "selection", lambda *a: (select(*a)[0], {"merge": "fused"}))
    stream = [7]
    monkeypatch.setattr(call, "current_stream", lambda inputs: stream[0])
    for s in (7, 7, 9, 9, 7):
        stream[0] = s
        ops.attention_decode(*_decode_args())
    assert len(chosen) == 2


@pytest.mark.parametrize("merge", ["fused", "kernel"])
def test_attention_decode_splits_follow_the_chosen_merge(stand_in, monkeypatch, merge):
    """The split count comes from the config that runs: a kernel merging its splits itself (the
    CuTe default) takes the heuristic's fused-merge count, one leaving them to the merge kernel
    the wave model's (B 1, GQA 8, 32k keys: 33 against 65 splits on 132 SMs)."""
    launched, _, _ = stand_in
    kernels = declaration.get("attention_decode").kernels
    select = kernels.selection
    monkeypatch.setattr(kernels, "selection", lambda *a: (select(*a)[0], {"merge": merge}))
    plan = decode_module.plan
    want = {m: plan.num_splits(1, 4, 1, 8, 32768, 132, 64, fused_merge=m == "fused") for m in ("fused", "kernel")}
    assert want["fused"] != want["kernel"]
    ops.attention_decode(*_decode_args(B=1, Mq=1, Hq=32, Hkv=4, L=32768))
    assert launched[-1][7][0] == want[merge]


@pytest.mark.parametrize("config", [
    {"tile_m": 64, "tile_n": 128, "cluster_m": 1, "raster": "m", "group": 8, "split_k": 4},    # second kernel
    {"tile_m": 128, "tile_n": 128, "cluster_m": 1, "raster": "m", "group": 8, "split_k": 3},   # in place
    {"tile_m": 128, "tile_n": 128, "cluster_m": 1, "raster": "m", "group": 8, "stream_k": 1}])
def test_gemm_partials_come_from_the_streams_scratch(monkeypatch, config):
    """Split-K and stream-K partials are written before they are read within a call: repeat calls
    take the stream's reusable scratch (no allocation), and the launch is stream-bound."""
    from mslk_dsl.ops import dispatch, gemm
    from mslk_dsl.templates import _cute_gemm_configs as gemm_configs

    monkeypatch.setattr(dispatch, "_placeholders", {})
    prepared = []
    x, w = torch.randn(40, 64).to(bf16), torch.randn(256, 64).to(bf16)
    for _ in range(2):
        launch = gemm._prepare_bf16_gemm(lambda sig, problem: (None, config), [torch.empty(40, 256, dtype=bf16)],
                                         x, w)
        prepared.append(launch)
    elements = gemm_configs.partials_elements(config, 40, 256)
    first, second = (next(a for a in launch.args[3:] if a.dtype == torch.float32) for launch in prepared)
    assert first is second and first.numel() == elements and dispatch.is_placeholder(first)
    assert all(launch.stream_bound and launch.scratch == () for launch in prepared)


def test_sorted_scatter_workspace_comes_from_the_streams_scratch(monkeypatch):
    from mslk_dsl.ops import dispatch, moe

    monkeypatch.setattr(dispatch, "_placeholders", {})
    out, y, tok = torch.zeros(5, 16, dtype=bf16), torch.randn(12, 16).to(bf16), torch.randint(0, 5, (12,), dtype=torch.int32)
    launches = [moe._prepare_scatter(lambda sig, problem: (None, {"method": "sorted"}), [], out, y, tok, None)
                for _ in range(2)]
    assert launches[0].args[-1] is launches[1].args[-1] and launches[0].args[-1].numel() == 3 * 5 + 1 + 2 * 12
    assert all(launch.stream_bound and launch.scratch == () for launch in launches)


def test_stream_scratch_is_reused_per_stream_and_shapes(monkeypatch):
    """dispatch.stream_scratch: the same tensors for the same shapes on the same stream (a plan may
    hold them), 16-byte aligned and apart within one call; a larger call gets a new buffer and the
    old views are no longer handed out, nor are they after calls of many shapes; none past the
    byte limit."""
    from mslk_dsl.ops import dispatch

    monkeypatch.setattr(dispatch, "_placeholders", {})   # no buffer left by other tests' calls
    device = torch.device("cpu")
    first = dispatch.stream_scratch(device, torch.float32, ((3, 5), (7,)))
    assert [t.shape for t in first] == [(3, 5), (7,)] and all(t.is_contiguous() for t in first)
    assert all(t.data_ptr() % 16 == 0 for t in first)
    assert first[1].data_ptr() >= first[0].data_ptr() + 15 * 4      # apart
    again = dispatch.stream_scratch(device, torch.float32, ((3, 5), (7,)))
    assert all(a is b for a, b in zip(first, again)) and all(dispatch.is_placeholder(t) for t in first)
    other = dispatch.stream_scratch(device, torch.int32, ((3, 5),))
    assert not other[0].untyped_storage().data_ptr() == first[0].untyped_storage().data_ptr()
    bigger = dispatch.stream_scratch(device, torch.float32, ((1000, 100),))
    assert not dispatch.is_placeholder(first[0])                      # dropped with the old buffer
    assert dispatch.stream_scratch(device, torch.float32, ((3, 5), (7,)))[0] is not first[0]
    assert dispatch.is_placeholder(bigger[0])
    monkeypatch.setattr(dispatch, "STREAM_SCRATCH_VIEWS", 4)  # calls of many shapes: the cache is emptied
    views = [dispatch.stream_scratch(device, torch.float32, ((n,),))[0] for n in range(1, 6)]
    assert not dispatch.is_placeholder(views[0]) and dispatch.is_placeholder(views[-1])
    monkeypatch.setattr(dispatch, "STREAM_SCRATCH_LIMIT", 1024)
    assert dispatch.stream_scratch(device, torch.float32, ((257,),)) is None


def test_stream_scratch_grows_in_few_generations(monkeypatch):
    """Plans keep the views they were made with, so every buffer a plan saw stays allocated:
    sizes that creep up (split-K partials follow M) must leave a few buffers, not one per size."""
    from mslk_dsl.ops import dispatch

    monkeypatch.setattr(dispatch, "_placeholders", {})
    held = [dispatch.stream_scratch(torch.device("cpu"), torch.float32, ((n * 1000,),))[0] for n in range(1, 65)]
    storages = {t.untyped_storage().data_ptr() for t in held}
    assert len(storages) <= 8, len(storages)       # 1000 .. 64000 elements: powers of two from 1024
    assert sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in held}.values()) \
        <= 2 * 65536 * 4


def test_a_constant_placeholder_first_asked_for_during_a_capture_is_not_cached(monkeypatch):
    """A CUDA graph capture records a new tensor's fill without running it: a constant placeholder
    (a row count of "all rows") made then would hold garbage for eager calls. It serves that call
    only and is no placeholder (no plan holds it); the next call outside a capture makes and caches
    one. Unread placeholders (fill 0) are cached either way."""
    from mslk_dsl.ops import dispatch

    monkeypatch.setattr(dispatch, "_placeholders", {})
    cpu = torch.device("cpu")
    monkeypatch.setattr(dispatch, "_capturing", lambda device: True)
    during = dispatch.placeholder(cpu, torch.int32, fill=2**31 - 1)
    unread = dispatch.placeholder(cpu, torch.int32)
    assert not dispatch.is_placeholder(during) and dispatch.is_placeholder(unread)
    assert dispatch.placeholder(cpu, torch.int32, fill=2**31 - 1) is not during
    monkeypatch.setattr(dispatch, "_capturing", lambda device: False)
    after = dispatch.placeholder(cpu, torch.int32, fill=2**31 - 1)
    assert after is not during and dispatch.is_placeholder(after) and int(after) == 2**31 - 1
    assert dispatch.placeholder(cpu, torch.int32, fill=2**31 - 1) is after
