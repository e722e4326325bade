"""Targets, device queries, skip decorators, the template API and the registry, import cost."""
import json
import os
import textwrap
import unittest

import pytest
from support import run_python

from mslk_dsl import device, registry, testing
from mslk_dsl.targets import all_targets, get_target, target_for_cuda_capability, target_for_gfx
from mslk_dsl.template import Template, config_name


def test_arch_descriptors_load_as_data():
    targets = all_targets()
    assert set(targets) == {"sm80", "sm90a", "sm100a", "sm120a", "gfx942", "gfx950"}
    assert get_target("sm90a").dsl_arch == "sm_90a" and get_target("sm90a").backend == "cute"
    assert get_target("gfx942").fp8_dtype_name == "float8_e4m3fnuz" and get_target("gfx942").fp8_max == 240
    assert get_target("gfx950").fp8_dtype_name == "float8_e4m3fn" and get_target("gfx950").warp_size == 64
    assert target_for_cuda_capability(9, 0).name == "sm90a"
    assert target_for_cuda_capability(8, 6).name == "sm80"
    assert target_for_gfx("gfx942:sramecc+:xnack-").name == "gfx942"
    with pytest.raises(NotImplementedError):
        target_for_cuda_capability(7, 5)
    with pytest.raises(ValueError, match="unknown target"):
        get_target("sm91")


def test_device_queries_without_a_gpu():
    assert device.is_cuda() is False and device.is_rocm() is False
    assert device.compute_capability_in((9, 0)) is False and device.compute_capability_at_least((8, 0)) is False
    assert device.get_gfx_arch_name() == "" and device.is_gfx942() is False and device.is_gfx950() is False
    assert device.supports_float8_fnuz() is False and device.cuda_version_at_least("12.0") is False
    assert device.current_target() is None


def test_forced_target(monkeypatch):
    monkeypatch.setenv("MSLK_DSL_TARGET", "gfx942")
    assert device.current_target().name == "gfx942"


def _skipped(decorator, monkeypatch, **flags):
    for name, value in flags.items():
        monkeypatch.setattr(device, name, lambda *a, _v=value, **k: _v)

    class Case(unittest.TestCase):
        @decorator
        def test_it(self):
            pass

    result = unittest.TestResult()
    Case("test_it").run(result)
    return bool(result.skipped)


def test_skip_decorators_follow_mslk_semantics(monkeypatch):
    cap90 = testing.skipUnlessCudaCapability((9, 0))
    # No GPU: every GPU decorator skips.
    assert _skipped(testing.skipUnlessCuda, monkeypatch, is_cuda=False, is_rocm=False)
    assert _skipped(testing.skipUnlessRocm, monkeypatch, is_cuda=False, is_rocm=False)
    # A CUDA capability decorator is transparent on ROCm, and a gfx decorator on CUDA.
    assert not _skipped(testing.skipUnlessCudaCapability((9, 0)), monkeypatch, is_rocm=True, is_cuda=False)
    assert not _skipped(testing.skipUnlessGfxArch("gfx950"), monkeypatch, is_cuda=True, is_rocm=False)
    assert _skipped(testing.skipUnlessGfxArch("gfx950"), monkeypatch, is_cuda=False, is_rocm=True,
                    gfx_arch_in=False)
    assert not _skipped(testing.skipUnlessGfxArch("gfx942"), monkeypatch, is_cuda=False, is_rocm=True,
                        gfx_arch_in=True)
    # On CUDA the capability decides.
    assert _skipped(testing.skipUnlessCudaCapability((9, 0)), monkeypatch, is_rocm=False,
                    compute_capability_at_least=False)
    assert not _skipped(testing.skipUnlessCudaCapability((9, 0)), monkeypatch, is_rocm=False,
                        compute_capability_at_least=True)
    assert not _skipped(testing.skipUnlessCudaVersion("12.0"), monkeypatch, is_rocm=False,
                        cuda_version_at_least=True)
    # As a pytest mark (pytestmark = ...), with the same decision and reason.
    monkeypatch.setattr(device, "is_rocm", lambda: False)
    monkeypatch.setattr(device, "compute_capability_at_least", lambda c: False)
    mark = cap90.mark
    assert mark.name == "skipif" and mark.args == (True,) and "9.0" in mark.kwargs["reason"]


def test_template_api_configs_and_validation():
    t = Template(op="demo", backend="cute", targets=("sm90a",), signatures={"dtype": ("bfloat16", "float32")},
                 space={"vec": (8, 4), "threads": (128, 256)},
                 valid=lambda c, target, sig: not (sig["dtype"] == "float32" and c["vec"] == 8),
                 heuristic=lambda target, sig, problem: {"vec": 4, "threads": 128}, build=None, name="demo")
    assert len(t.all_configs()) == 4 and len(t.all_signatures()) == 2
    assert len(t.valid_configs("sm90a", {"dtype": "float32"})) == 2
    assert config_name({"vec": 8, "threads": 128, "tile": (128, 256)}) == "threads128_tile128x256_vec8"
    with pytest.raises(ValueError, match="not valid"):
        t.check_config({"vec": 8, "threads": 128}, "sm90a", {"dtype": "float32"})
    with pytest.raises(ValueError, match="not in the space"):
        t.check_config({"vec": 2, "threads": 128}, "sm90a", {"dtype": "float32"})
    with pytest.raises(ValueError, match="does not support target"):
        t.check_config({"vec": 4, "threads": 128}, "gfx942", {"dtype": "float32"})


def test_registry_discovers_builtin_and_user_templates():
    templates = registry.get_templates()
    assert any(t.name == "scale_copy_cute" and t.source.endswith("scale_copy_cute.py") for t in templates)
    for t in templates:
        assert t.backend in ("cute", "flydsl") and t.targets and t.all_configs(), t.name
        for target in t.targets:
            get_target(target)  # every declared target exists
            assert get_target(target).backend == t.backend, (t.name, target)
        # The heuristic returns a valid config for every signature on every target.
        for target in t.targets:
            for sig in t.all_signatures():
                for problem in ({"M": 1, "N": 4096, "K": 4096, "T": 1},
                                {"M": 8192, "N": 8192, "K": 8192, "T": 8192}):
                    t.check_config(t.heuristic(target, sig, problem), target, sig)


def test_every_op_has_a_cute_and_a_flydsl_template():
    by_op = {}
    for t in registry.get_templates():
        by_op.setdefault(t.op, set()).add(t.backend)
    missing = {op: backends for op, backends in by_op.items() if backends != {"cute", "flydsl"}}
    assert not missing, f"ops missing a backend: {missing}"


def test_importing_the_package_is_light():
    out = run_python(textwrap.dedent("""
        import json, sys, time
        import torch
        t0 = time.perf_counter()
        import mslk_dsl, mslk_dsl.ops
        seconds = time.perf_counter() - t0
        heavy = [m for m in ("cutlass", "flydsl", "tvm_ffi", "triton") if m in sys.modules]
        print(json.dumps({"seconds": seconds, "heavy": heavy}))
    """))
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["heavy"] == [], "import mslk_dsl must not import a compiler or tvm_ffi"


def test_env_documents_every_variable():
    from mslk_dsl import env

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    for name in env.VARIABLES:
        assert name in readme, f"{name} is not documented in the README"
