"""The random calls of the GPU fuzz test (tests/gpu/test_fuzz_ops.py), on the CPU: every draw of
a declaration's ``random_problem`` is a call the op serves (its checks pass), and on every
target the op's whole call path (checks, outputs, ``prepare``) gets a config from the kernel
choice (tuning or heuristic) that the template's config check accepts; and every launch, for
inputs in other layouts too, hands each tensor the alignment its CuTe kernel assumes. A
stand-in replaces the compiled kernel, so no kernel is built; CPU tensors stand in for GPU ones."""
import inspect
import random

import pytest
import torch

from support import cpu_stands_in_for, relaid

from mslk_dsl import registry
from mslk_dsl.ops import declarations, eager_functions

SEED = 20261206


def _signatures(name: str) -> list[dict]:
    templates = registry.get_templates(op=name, backend="cute")
    return templates[0].all_signatures() if templates else [{}]


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_each_draw_passes_the_op_checks():
    """40 draws an op with random signatures, on fake CUDA tensors, through ``check`` and
    ``outputs``; each draw gives the sizes its ``example`` reads."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rng = random.Random(SEED)
    for name, decl in declarations().items():
        assert decl.random_problem is not None, f"{name} declares no random_problem"
        params = [p for p in inspect.signature(eager_functions()[name]).parameters.values()
                  if p.kind is p.POSITIONAL_OR_KEYWORD]
        for _ in range(40):
            problem, sig = decl.random_problem(rng), rng.choice(_signatures(name))
            assert set(decl.problem) - {"T"} <= set(problem), (name, problem)
            with FakeTensorMode():
                args = decl.example(problem, sig, torch.device("cuda"))
                # the schema's defaults for the arguments the example leaves out
                args = args + tuple(p.default for p in params[len(args):])
                if decl.composite is None:
                    decl.check(*args)
                for shape, _ in decl.outputs(*args):
                    assert all(s >= 0 for s in shape), (name, problem, shape)


@pytest.mark.parametrize("target", ["sm90a", "gfx942", "gfx950"])
def test_each_draw_gets_a_config_the_template_serves(target, monkeypatch):
    """8 draws an op through the op itself on CPU tensors, the target forced: the kernel
    choice of each call (its signature and sizes as the op's ``prepare`` makes them) is a config
    of that target's template that serves the call, or the call fails here with the
    ConfigError the GPU would raise."""
    import mslk_dsl.ops as ops

    cpu_stands_in_for(target, monkeypatch)
    rng = random.Random(f"{SEED}-{target}")
    calls = 0
    for name, decl in declarations().items():
        if decl.composite is not None:
            continue
        kernels = decl.kernels
        # the framework's choice (explicit config, tuning, heuristic) and its config check; the
        # kernel stands in
        monkeypatch.setattr(kernels, "selection", lambda device, sig, problem, config=None, kernels=kernels: (
            lambda *args: None, kernels.choose(target, sig, problem, config)[1]))
        for _ in range(8):
            problem, sig = decl.random_problem(rng), rng.choice(_signatures(name))
            getattr(ops, name)(*decl.example(problem, sig, torch.device("cpu")))
            calls += 1
    assert calls >= 8 * 15


def _assert_layout_fits(where: str, t: torch.Tensor, fake) -> None:
    """``t``'s element width, sizes and strides are what the kernel's fake tensor declares: a fixed
    value, or a multiple of a dynamic one's divisibility (strides of dims of one element are
    free)."""
    def fits(value: int, declared) -> bool:
        return value == declared if isinstance(declared, int) else value % declared.divisibility == 0

    width = fake.element_type.width
    assert t.element_size() * 8 == width, f"{where} is {t.dtype}; its kernel takes {fake.element_type}"
    shape, stride = tuple(fake.shape), tuple(fake.stride)
    if any(isinstance(d, tuple) for d in shape + stride):
        return                                       # a nested layout: not checked here
    assert t.dim() == len(shape), f"{where} has {t.dim()} dims; its kernel takes {len(shape)}"
    for d, (size, step) in enumerate(zip(shape, stride)):
        assert fits(t.shape[d], size), f"{where}: size {t.shape[d]} of dim {d} does not fit {size}"
        assert t.shape[d] <= 1 or fits(t.stride(d), step), (
            f"{where}: stride {t.stride(d)} of dim {d} does not fit {step}")


def test_every_launch_hands_each_tensor_the_alignment_its_kernel_declares(monkeypatch):
    """10 draws an op (sm90a), a third each with contiguous inputs, rows padded by 1-8 elements
    and inputs one element past an aligned address: each call either refuses (ValueError /
    TypeError, never for contiguous inputs) or launches its CuTe kernel with every tensor starting
    on the alignment the kernel was compiled to assume (the launcher refuses anything else at
    run time). The kernels' fake arguments (``Template.build``, no compile) say which alignment."""
    import mslk_dsl.ops as ops

    cpu_stands_in_for("sm90a", monkeypatch)
    fake_args: dict = {}
    launches: list = []

    def selection(device, sig, problem, config=None, *, kernels):
        template, config, sig_dict = kernels.choose("sm90a", sig, problem, config)
        key = (template.name, repr(config), repr(sig_dict))
        if key not in fake_args:
            fake_args[key] = template.build(config, "sm90a", sig_dict)[1]
        return (lambda *args: launches.append((args, fake_args[key]))), config

    rng = random.Random(f"{SEED}-alignment")
    launched = 0
    for name, decl in declarations().items():
        if decl.composite is not None:
            continue
        monkeypatch.setattr(decl.kernels, "selection",
                            lambda *a, kernels=decl.kernels, **k: selection(*a, **k, kernels=kernels))
        for _ in range(10):
            problem, sig = decl.random_problem(rng), rng.choice(_signatures(name))
            layout, pad = rng.choice(("contiguous", "padded", "offset")), rng.randint(1, 8)
            args = relaid(decl.example(problem, sig, torch.device("cpu")), layout, pad)
            launches.clear()
            try:
                getattr(ops, name)(*args)
            except (ValueError, TypeError):
                assert layout != "contiguous", (name, problem, sig)
                continue
            for given, fakes in launches:
                tensors = [a for a in given if isinstance(a, torch.Tensor)]
                # (_assumed_align: the alignment a CuTe fake tensor was made with)
                declared = [f for f in fakes if hasattr(f, "_assumed_align")]
                assert len(tensors) == len(declared), (name, len(tensors), len(declared))
                for i, (t, fake) in enumerate(zip(tensors, declared)):
                    where = f"{name} on {problem} {sig} ({layout} inputs, pad {pad}): tensor argument {i}"
                    assert t.numel() == 0 or t.data_ptr() % fake._assumed_align == 0, (
                        f"{where} starts {t.data_ptr() % 16} bytes past a 16-byte boundary; its kernel "
                        f"assumes {fake._assumed_align}-byte alignment")
                    _assert_layout_fits(where, t, fake)
                launched += 1
    assert launched >= 60
