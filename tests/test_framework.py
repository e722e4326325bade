"""Targets, device queries, skip decorators, the template API and the registry, import cost."""
import dataclasses
import json
import os
import sys
import textwrap
import unittest

import pytest
from conftest import USER_TEMPLATES as USER_TEMPLATES_DIR
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
    assert device.memory_bandwidth() is None


class _FakeDriver:
    """The three CUDA driver calls memory_bandwidth makes, answering as an H100 SXM's driver does
    (memory clock 2619 MHz, 5120-bit bus), or failing one of them."""

    def __init__(self, failing=None):
        self.failing = failing

    def _answer(self, name, out=None, value=0):
        if name == self.failing:
            return 100  # CUDA_ERROR_NO_DEVICE
        if out is not None:
            out._obj.value = value
        return 0

    def cuInit(self, flags):
        return self._answer("cuInit")

    def cuDeviceGet(self, out, index):
        return self._answer("cuDeviceGet", out, index)

    def cuDeviceGetAttribute(self, out, attribute, handle):
        return self._answer("cuDeviceGetAttribute", out, {36: 2_619_000, 37: 5120}[attribute])


@pytest.mark.parametrize("failing", [None, "cuInit", "cuDeviceGetAttribute"])
def test_memory_bandwidth_from_the_driver(monkeypatch, failing):
    monkeypatch.setattr(device, "is_cuda", lambda: True)
    monkeypatch.setattr(device.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(device.ctypes, "CDLL", lambda name: _FakeDriver(failing))
    device._memory_bandwidth_of.cache_clear()
    try:
        got = device.memory_bandwidth()
    finally:
        device._memory_bandwidth_of.cache_clear()
    assert got == (None if failing else 2 * 2_619_000e3 * 5120 / 8)   # 3.35 TB/s


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
    with pytest.raises(ValueError, match=r"config threads128_vec8 is not valid for target sm90a and signature "
                                         r"\{'dtype': 'float32'\} \(template 'demo'\)"):
        t.check_config({"vec": 8, "threads": 128}, "sm90a", {"dtype": "float32"})
    with pytest.raises(ValueError, match="not in the space"):
        t.check_config({"vec": 2, "threads": 128}, "sm90a", {"dtype": "float32"})
    with pytest.raises(ValueError, match="does not support target"):
        t.check_config({"vec": 4, "threads": 128}, "gfx942", {"dtype": "float32"})
    # signature combinations no call has are left out, so nothing builds or lists them
    t2 = dataclasses.replace(t, signatures={"dtype": ("bfloat16", "float32"), "wide": (False, True)},
                             signature_valid=lambda sig: not (sig["wide"] and sig["dtype"] == "float32"))
    assert t2.all_signatures() == [{"dtype": "bfloat16", "wide": False}, {"dtype": "bfloat16", "wide": True},
                                   {"dtype": "float32", "wide": False}]
    with pytest.raises(ValueError, match="is no call's"):
        t2.check_config({"vec": 4, "threads": 128}, "sm90a", {"dtype": "float32", "wide": True})
    # the instructions a template's code must contain name the code the compile tests read
    with pytest.raises(ValueError, match=r"template 'demo': instructions name \['isa'\]; a cute template's code "
                                         r"is checked as \['ptx', 'sass'\]"):
        Template(op="demo", backend="cute", targets=("sm90a",), signatures={}, heuristic=None, build=None,
                 instructions={"isa": [r"v_mfma"]}, name="demo")


def test_template_config_checks_name_the_template_and_config():
    from mslk_dsl.template import require

    require(True, "demo", {"vec": 8}, "never raised")
    with pytest.raises(ValueError, match=r"template 'demo', config threads64_vec8: threads must be a multiple of 128"):
        require(False, "demo", {"vec": 8, "threads": 64}, "threads must be a multiple of 128")


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


# -- lazy discovery: each folder's index of which file defines which templates -------------------
# Children write indexes (as bytecode) under a private pycache prefix, never into the checkout.
INDEXING = "import sys; sys.dont_write_bytecode = False\n"


def _child(code: str, tmp_path, template_path: str = USER_TEMPLATES_DIR) -> str:
    env = {"PYTHONPYCACHEPREFIX": str(tmp_path / "pycache"), "MSLK_DSL_TEMPLATE_PATH": template_path}
    return run_python(INDEXING + textwrap.dedent(code), env=env).stdout


def test_per_op_discovery_imports_only_that_op_and_equals_full_discovery(tmp_path):
    full = json.loads(_child("""
        import json
        from mslk_dsl import registry
        print(json.dumps([[t.op, t.backend, t.name, t.source] for t in registry.get_templates()]))
    """, tmp_path).splitlines()[-1])  # imports every file and writes the indexes
    lazy = json.loads(_child("""
        import json, sys
        import torch  # so `import mslk_dsl` registers the ops (which import the shared tables)
        from mslk_dsl import registry
        # what the op layer itself imports (DSL-free shared tables) is there before discovery
        before = {m for m in sys.modules if m.startswith("mslk_dsl.templates.")}
        found = registry.get_templates("silu_mul")
        imported = sorted(m.rsplit(".", 1)[-1] for m in sys.modules
                          if m.startswith("mslk_dsl.templates.") and m not in before)
        per_op = {op: [[t.op, t.backend, t.name, t.source] for t in registry.get_templates(op)]
                  for op in registry.ops()}
        lazy = [t for op in registry.ops() for t in registry.get_templates(op)]
        everything = registry.get_templates()
        print(json.dumps({"imported": imported, "per_op": per_op,
                          "same_objects": all(any(t is u for u in everything) for t in lazy),
                          "one": [t.name for t in registry.get_templates("silu_mul", "cute")],
                          "by_name": registry.get_template("rmsnorm_cute.rmsnorm_add").op}))
    """, tmp_path).splitlines()[-1])
    assert lazy["imported"] == ["_rowwise_plan", "_rowwise_space", "silu_mul_cute", "silu_mul_flydsl"]
    assert [t for op in sorted(lazy["per_op"]) for t in lazy["per_op"][op]] == sorted(full, key=lambda t: t[0])
    for op, templates in lazy["per_op"].items():
        assert templates == [t for t in full if t[0] == op], op
    assert lazy["same_objects"] and lazy["one"] == ["silu_mul_cute"] and lazy["by_name"] == "rmsnorm_add"


def _user_folder(tmp_path, files: dict) -> str:
    folder = tmp_path / "user"
    folder.mkdir(exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(textwrap.dedent(text))
    return str(folder)


def _template_file(op: str, extra: str = "") -> str:
    return (f"from mslk_dsl.template import Template\n{extra}\n"
            f"TEMPLATE = Template(op={op!r}, backend='cute', targets=('sm90a',), signatures={{}},\n"
            f"                    space={{'threads': (128,)}}, heuristic=lambda t, s, p: {{'threads': 128}},\n"
            f"                    build=None)\n")


LIST_OPS = """
    import json, sys
    from mslk_dsl import registry
    print(json.dumps({op: [t.name for t in registry.get_templates(op)] for op in ("alpha", "beta", "gamma")}))
"""


def test_index_follows_edits_new_files_and_helpers(tmp_path):
    folder = _user_folder(tmp_path, {"a.py": _template_file("alpha"), "b.py": _template_file("beta"),
                                     "_helper.py": "X = 1\n"})
    first = json.loads(_child(LIST_OPS, tmp_path, folder).splitlines()[-1])
    assert first == {"alpha": ["a"], "beta": ["b"], "gamma": []}
    # The index answers the next process (b.py is not imported for "alpha").
    out = _child("""
        import sys
        from mslk_dsl import registry
        registry.get_templates("alpha")
        print(sorted(m.split(".")[1] for m in sys.modules if m.startswith("mslk_dsl_user_templates_") and "." in m))
    """, tmp_path, folder)
    assert out.splitlines()[-1] == "['a']"
    # Edit a template to define another op, add a file: the index is stale and rebuilt. (Every
    # edit changes the file's size: Python itself would reuse the bytecode of a same-size file
    # rewritten within the same second.)
    (tmp_path / "user" / "a.py").write_text(_template_file("gamma", "# edited"))
    (tmp_path / "user" / "c.py").write_text(_template_file("alpha"))
    assert json.loads(_child(LIST_OPS, tmp_path, folder).splitlines()[-1]) == {
        "alpha": ["c"], "beta": ["b"], "gamma": ["a"]}
    # A helper whose value decides the op: editing it re-indexes the folder too.
    (tmp_path / "user" / "_helper.py").write_text("OP = 'beta'\n")
    (tmp_path / "user" / "c.py").write_text(_template_file("OP", "from ._helper import OP").replace("'OP'", "OP"))
    assert json.loads(_child(LIST_OPS, tmp_path, folder).splitlines()[-1])["beta"] == ["b", "c"]
    (tmp_path / "user" / "_helper.py").write_text("OP = 'gamma'\n")
    assert json.loads(_child(LIST_OPS, tmp_path, folder).splitlines()[-1]) == {
        "alpha": [], "beta": ["b"], "gamma": ["a", "c"]}


def test_a_wrong_index_is_caught_when_a_file_is_imported(tmp_path, monkeypatch):
    from mslk_dsl import template_index

    folder = _user_folder(tmp_path, {"a.py": _template_file("alpha"), "b.py": _template_file("beta")})
    _child(LIST_OPS, tmp_path, folder)
    # An index that matches the files' stamp but not what they define (as when a file's templates
    # depend on something outside its folder): a.py is said to define "beta".
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "pycache"))
    with open(template_index.path(folder)) as f:
        saved = json.load(f)
    saved["files"]["a"] = [["beta", "cute", "a"]]
    with open(template_index.path(folder), "w") as f:
        json.dump(saved, f)
    out = _child("""
        from mslk_dsl import registry
        print([t.name for t in registry.get_templates("beta")], [t.name for t in registry.get_templates("alpha")])
    """, tmp_path, folder)
    assert out.splitlines()[-1] == "['b'] ['a']"


def test_broken_template_file_raises_a_clear_import_error(tmp_path):
    folder = _user_folder(tmp_path, {"a.py": _template_file("alpha"), "b.py": _template_file("beta")})
    _child(LIST_OPS, tmp_path, folder)  # indexed while whole
    (tmp_path / "user" / "a.py").write_text(_template_file("alpha", "import no_such_module_here"))
    for op in ("alpha", "beta"):  # the edit makes the folder's index stale: every file is imported
        with pytest.raises(AssertionError, match=r"ImportError: template file .*a\.py failed to import: "
                                                 r"ModuleNotFoundError: No module named 'no_such_module_here'"):
            _child(f"from mslk_dsl import registry; registry.get_templates({op!r})", tmp_path, folder)


def test_duplicate_template_names_are_refused(tmp_path):
    first = _user_folder(tmp_path, {"a.py": _template_file("alpha")})
    second = tmp_path / "second"
    second.mkdir()
    (second / "a.py").write_text(_template_file("alpha"))
    for _ in range(2):  # without and with indexes
        with pytest.raises(AssertionError, match="DuplicateTemplateError: template name 'a' is defined by both ") as err:
            _child("from mslk_dsl import registry; registry.get_templates('alpha')", tmp_path,
                   os.pathsep.join([first, str(second)]))
        assert os.path.join(first, "a.py") in str(err.value) and str(second / "a.py") in str(err.value)


def test_a_second_template_for_an_op_and_target_is_named_as_ignored(tmp_path):
    """Two templates (other names) for one op and target: the op uses the first; the warning
    says which template serves and which is ignored."""
    first = _user_folder(tmp_path, {"a.py": _template_file("alpha")})
    second = tmp_path / "second"
    second.mkdir()
    (second / "b.py").write_text(_template_file("alpha"))
    done = run_python("import warnings; warnings.simplefilter('always')\n"
                      "from mslk_dsl import registry\n"
                      "print(registry.templates_for('alpha', 'sm90a')[0].name)\n"
                      "registry.templates_for('alpha', 'sm90a')",
                      env={"MSLK_DSL_TEMPLATE_PATH": os.pathsep.join([first, str(second)])})
    assert done.stdout.strip() == "a"
    assert done.stderr.count("is served by template 'a'") == 1, done.stderr
    assert "'b' (" in done.stderr and "will be ignored" in done.stderr


def test_index_is_written_like_bytecode(tmp_path, monkeypatch):
    from mslk_dsl import template_index

    folder = _user_folder(tmp_path, {"a.py": _template_file("alpha")})
    stamp = template_index.stamp(folder)
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "pycache"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    template_index.save(folder, stamp, {"a": [("alpha", "cute", "a")]})
    assert template_index.load(folder, stamp) is None, "PYTHONDONTWRITEBYTECODE: nothing written"
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    template_index.save(folder, stamp, {"a": [("alpha", "cute", "a")]})
    assert template_index.path(folder).startswith(str(tmp_path / "pycache"))
    assert template_index.load(folder, stamp) == {"a": [("alpha", "cute", "a")]}
    assert template_index.load(folder, "another stamp") is None
    with open(template_index.path(folder), "w") as f:
        f.write("{not json")
    assert template_index.load(folder, stamp) is None


def test_importing_the_package_is_light():
    out = run_python(textwrap.dedent("""
        import json, sys, time
        import torch
        t0 = time.perf_counter()
        import mslk_dsl, mslk_dsl.ops
        seconds = time.perf_counter() - t0
        heavy = [m for m in ("cutlass", "flydsl", "tvm_ffi", "triton") if m in sys.modules]
        print(json.dumps({"seconds": seconds, "heavy": heavy}))
    """), env={"MSLK_DSL_NO_PREFETCH": "1"})
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["heavy"] == [], "import mslk_dsl must not import a compiler or tvm_ffi"


def test_kernel_loader_prefetch_imports_tvm_ffi_in_the_background_and_no_compiler():
    out = run_python(textwrap.dedent("""
        import json, sys
        from mslk_dsl.backends import cute
        cute.prefetch_runtime()
        thread = cute._prefetch
        thread.join(60)
        print(json.dumps({"daemon": thread.daemon, "finished": not thread.is_alive(),
                          "loaded": [m for m in ("tvm_ffi", "cutlass", "flydsl") if m in sys.modules]}))
    """))
    result = json.loads(out.stdout.splitlines()[-1])
    assert result == {"daemon": True, "finished": True, "loaded": ["tvm_ffi"]}


# Modules that touch os.environ outside env.py, and why: none of them reads an mslk-dsl setting.
ENVIRONMENT_WRITERS = {
    "mslk_dsl/backends/flydsl.py": "builds the FlyDSL compile child's environment from this one",
    "mslk_dsl/backends/flydsl_child.py": "the compile child sets FlyDSL's own cache and ISA-dump switches",
    "mslk_dsl/backends/flydsl_abi.py": "the compile child lifts FlyDSL's COMPILE_ONLY while it records an ABI",
}


def test_every_environment_variable_is_read_in_env():
    """Settings come from env.py (documented, checked, one place); elsewhere only the FlyDSL
    compile child's set-up touches the environment."""
    import ast

    root = os.path.join(os.path.dirname(__file__), "..")
    found = set()
    for top in ("mslk_dsl", "templates"):
        for directory, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                path = os.path.join(directory, name)
                rel = os.path.relpath(path, root)
                if not name.endswith(".py") or rel == os.path.join("mslk_dsl", "env.py"):
                    continue
                for node in ast.walk(ast.parse(open(path).read())):
                    if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv")
                            and isinstance(node.value, ast.Name) and node.value.id == "os"):
                        found.add(rel.replace(os.sep, "/"))
    assert found == set(ENVIRONMENT_WRITERS), ("read settings through mslk_dsl/env.py", sorted(found))


def test_env_documents_every_variable():
    from mslk_dsl import env

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    for name in env.VARIABLES:
        assert name in readme, f"{name} is not documented in the README"
