"""The random calls of the GPU fuzz test (tests/gpu/test_fuzz_ops.py), on the CPU: every draw of
a declaration's ``random_problem`` is a call the op serves (its checks pass), and on every
target the op's whole call path (checks, outputs, ``prepare``) gets a config from the kernel
choice (tuning or heuristic) that the template's config check accepts. A stand-in replaces the
compiled kernel, so no kernel is built; CPU tensors stand in for GPU ones."""
import inspect
import random

import pytest
import torch

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
    import importlib

    import mslk_dsl.ops as ops
    from mslk_dsl.ops import validate

    monkeypatch.setenv("MSLK_DSL_TARGET", target)
    monkeypatch.setattr(validate, "gpu", lambda *args: None)   # CPU tensors stand in for GPU ones
    sms = 132 if target == "sm90a" else 304 if target == "gfx942" else 256
    for module in ("attention", "attention_decode"):   # (the package's names are the ops)
        monkeypatch.setattr(importlib.import_module(f"mslk_dsl.ops.{module}"), "sm_count", lambda device: sms)
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
