"""Key completeness: every input that reaches code generation is part of a KernelKey.

The DSL environment variables are enumerated here independently of keys.py, from the installed
packages' source (the variables CuTe DSL and FlyDSL declare or read), and each must change the
key or be excluded on purpose with a reason.
"""
import ast
import dataclasses
import fnmatch
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest

from mslk_dsl import keys, registry, targets
from mslk_dsl.keys import KernelKey

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _key(backend: str, target: str) -> KernelKey:
    template = registry.get_template(f"scale_copy_{backend}")
    return KernelKey.make(template, template.all_configs()[0], target, template.all_signatures()[0])


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    return list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None


def _python_files(root: str):
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), encoding="utf-8", errors="replace") as fh:
                    yield fh.read()


# Direct reads: os.environ["X"], os.environ.get("X"), os.getenv("X"), get_*_env_var("X").
_DIRECT_READ = re.compile(r'(?:os\.environ(?:\.get)?\s*[\(\[]|os\.getenv\(|get_(?:str|bool|int|int_or_none)_env_var\(|'
                          r'has_env_var\()\s*f?"([^"]+)"')


def cute_variables() -> set[str]:
    """Every CUTE_DSL_* variable CuTe DSL declares (``env_var("X", ...)`` settings of its manager,
    prefix CUTE_DSL) or reads directly, with its ``{prefix}`` placeholders filled in."""
    root = _package_dir("cutlass")
    if root is None:
        pytest.skip("CuTe DSL is not installed")
    names = set()
    for text in _python_files(root):
        names.update("CUTE_DSL_" + n for n in re.findall(r'\benv_var\(\s*"([A-Z0-9_]+)"', text))
        for raw in _DIRECT_READ.findall(text):
            raw = raw.replace("{prefix}", "CUTE_DSL").replace("{self.prefix}", "CUTE_DSL").replace("{dsl_name}", "CUTE_DSL")
            if "{switch}" in raw:
                switches = re.search(r"_DEPRECATED_KEEP_SWITCHES[^=]*=\s*(\(.*?\n\))", text, re.S)
                names.update(raw.replace("{switch}", s) for s, _ in ast.literal_eval(switches[1]))
            elif raw.startswith("CUTE_DSL_"):
                names.add(raw)
    return names


def flydsl_variables() -> set[str]:
    """Every variable FlyDSL declares (its EnvManager options in flydsl/utils/env.py, names formed
    as FlyDSL's metaclass forms them) or reads directly, read from the source without importing
    FlyDSL."""
    root = _package_dir("flydsl")
    if root is None:
        pytest.skip("FlyDSL is not installed")
    names = set()
    with open(os.path.join(root, "utils", "env.py")) as f:
        tree = ast.parse(f.read())
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        prefix = next((s.value.value for s in cls.body if isinstance(s, ast.Assign)
                       and getattr(s.targets[0], "id", "") == "env_prefix"), None)
        for stmt in cls.body:
            if not (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)
                    and getattr(stmt.value.func, "id", "").startswith("Opt")):
                continue
            explicit = next((k.value.value for k in stmt.value.keywords if k.arg == "env_var"), None)
            attribute = stmt.targets[0].id
            names.add(explicit or f"FLYDSL_{prefix}_{attribute.upper()}")
    for text in _python_files(root):
        names.update(n for n in _DIRECT_READ.findall(text) if "{" not in n)
    # FlyDSL's own cache-invalidating list (all of these must be keyed, see below).
    general, by_arch = keys.flydsl_declared_env()
    names.update(general, *by_arch.values())
    return names


def _excluded(name: str) -> str | None:
    return next((why for pattern, why in keys.EXCLUDED_ENV.items() if fnmatch.fnmatchcase(name, pattern)), None)


def _changes_key(monkeypatch, backend: str, target: str, name: str) -> bool:
    base = _key(backend, target).digest
    monkeypatch.setenv(name, "mslk-dsl-test-value")
    changed = _key(backend, target).digest != base
    monkeypatch.delenv(name)
    return changed


@pytest.mark.parametrize("backend,target,enumerate_", [("cute", "sm90a", cute_variables),
                                                       ("flydsl", "gfx942", flydsl_variables)])
def test_every_dsl_variable_changes_the_key_or_is_excluded_with_a_reason(monkeypatch, backend, target, enumerate_):
    names = enumerate_()
    assert len(names) > 10, f"found only {sorted(names)}: the enumeration no longer reads the package"
    arch = targets.get_target(target).dsl_arch
    unaccounted = []
    for name in sorted(names):
        if name in keys.codegen_env_names(backend, arch):
            assert _changes_key(monkeypatch, backend, target, name), name
        elif _excluded(name) is None and not any(name in per_arch for per_arch in
                                                 (keys.flydsl_declared_env() or ((), {}))[1].values()):
            unaccounted.append(name)
    assert not unaccounted, f"{backend} variables neither in the key nor in keys.EXCLUDED_ENV: {unaccounted}"


def test_variables_the_dsls_say_change_codegen_are_in_the_key():
    # CuTe DSL's affects_compile=True settings and FlyDSL's cache-invalidating list, as each states them.
    for name in keys.cute_declared_env()[True]:
        assert name in keys.codegen_env_names("cute", "sm_90a")
    general, _ = keys.flydsl_declared_env()
    assert {"FLYDSL_DEBUG_ENABLE_DEBUG_INFO", "FLYDSL_KTRACE_ENABLE", "FLYDSL_COMPILE_OPT_LEVEL"} <= set(general)
    assert set(general) <= set(keys.codegen_env_names("flydsl", "gfx942"))
    # A name the DSL never reads has no place in the key.
    assert "FLYDSL_COMPILE_FLAGS" not in keys.codegen_env_names("flydsl", "gfx942")
    # Nothing excluded is keyed, and every exclusion says why.
    for backend, arch in (("cute", "sm_90a"), ("flydsl", "gfx942")):
        assert not [n for n in keys.codegen_env_names(backend, arch) if _excluded(n)]
    assert all(why.strip() for why in keys.EXCLUDED_ENV.values())


def test_flydsl_debug_info_and_ktrace_change_the_flydsl_key(monkeypatch):
    for name in ("FLYDSL_DEBUG_ENABLE_DEBUG_INFO", "FLYDSL_KTRACE_ENABLE"):
        assert _changes_key(monkeypatch, "flydsl", "gfx942", name), name
        assert not _changes_key(monkeypatch, "cute", "sm90a", name), f"{name} is FlyDSL's, not CuTe's"


def test_target_specific_flydsl_variables_only_enter_that_targets_key():
    assert "LLVM_GFX1250_ANY_XNACK_CODEGEN" in keys.codegen_env_names("flydsl", "gfx1250")
    assert "LLVM_GFX1250_ANY_XNACK_CODEGEN" not in keys.codegen_env_names("flydsl", "gfx942")


def test_fallback_lists_match_the_installed_packages():
    """Where a DSL's source cannot be read the key uses the fallback lists; they must be the
    pinned versions' lists, so a key is the same whether or not the source is present."""
    assert set(keys.cute_declared_env()[True]) == set(keys.CUTE_CODEGEN_ENV_FALLBACK)
    general, by_arch = keys.flydsl_declared_env()
    assert set(general) == set(keys.FLYDSL_CODEGEN_ENV_FALLBACK)
    assert by_arch == keys.FLYDSL_TARGET_CODEGEN_ENV_FALLBACK


def test_compile_options_the_backends_pass_are_the_keys(monkeypatch):
    """The backends take their codegen options from keys.COMPILE_OPTIONS: what cute.compile is
    given and what the FlyDSL compile child runs with, less the target and the dump switches."""
    from mslk_dsl.backends import cute, flydsl

    options = cute.compile_options("sm_90a", "/tmp/dump").split()
    not_codegen = {"--gpu-arch", "sm_90a", "--keep-ptx", "--keep-cubin", "--dump-dir", "/tmp/dump"}
    assert [o for o in options if o not in not_codegen] == list(keys.COMPILE_OPTIONS["cute"])
    monkeypatch.setenv("ARCH", "x86_64")          # a stray ARCH must not reach the child
    monkeypatch.setenv("FLYDSL_RUNTIME_RUN_ONLY", "1")
    child = flydsl.child_environment("gfx942", "/opt/rocm-shim")
    for option in keys.COMPILE_OPTIONS["flydsl"]:
        name, value = option.split("=", 1)
        assert child[name] == value
    assert child["ARCH"] == "gfx942" and child["ROCM_PATH"] == "/opt/rocm-shim"
    assert "FLYDSL_RUNTIME_RUN_ONLY" not in child


def test_key_changes_with_compile_options_and_every_target_field(monkeypatch):
    base = _key("cute", "sm90a").digest
    monkeypatch.setitem(keys.COMPILE_OPTIONS, "cute", ("--enable-tvm-ffi", "--another"))
    assert _key("cute", "sm90a").digest != base
    monkeypatch.undo()
    real = targets.all_targets()
    for name, value in (("smem_per_block", 1), ("fp8", "e5m2"), ("warp_size", 64), ("dsl_arch", "sm_90")):
        changed = dict(real, sm90a=dataclasses.replace(real["sm90a"], **{name: value}))
        monkeypatch.setattr(keys, "get_target", lambda n, changed=changed: changed[n])
        keys._target_spec.cache_clear()
        assert _key("cute", "sm90a").digest != base, f"target field {name} is not in the key"
        monkeypatch.undo()
        keys._target_spec.cache_clear()
    assert _key("cute", "sm90a").digest == base


def test_key_dsl_versions_are_packages_a_serving_install_has():
    """The [serve-cute] extra installs the CuTe library wheels, not nvidia-cutlass-dsl: a key that
    named the latter would never match in a serving install."""
    assert "nvidia-cutlass-dsl" not in keys.DSL_PACKAGES["cute"]
    assert set(keys.DSL_PACKAGES["cute"]) >= {"nvidia-cutlass-dsl-libs-base", "apache-tvm-ffi"}


def test_package_set_difference_names_the_packages():
    text = keys.package_set_difference({"a": "1", "b": ""}, {"a": "1", "b": "2"})
    assert "b 2 in the bundle, not installed here" in text and "install" in text
    assert keys.package_set_difference({"a": "1"}, {"a": "1"}) == ""


def test_keys_does_not_import_the_registry():
    done = subprocess.run([sys.executable, "-c", "import sys, mslk_dsl.keys; "
                           "print('mslk_dsl.registry' in sys.modules)"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


# -- template digests -------------------------------------------------------------------------------
def _write(path, text):
    path.write_text(textwrap.dedent(text))


def test_template_outside_the_package_hashes_the_package_modules_it_imports(tmp_path, monkeypatch):
    package, user = tmp_path / "package_templates", tmp_path / "user"
    package.mkdir()
    user.mkdir()
    _write(package / "_rowwise.py", "from mslk_dsl.templates import _inner\nX = 1\n")
    _write(package / "_inner.py", "Y = 1\n")
    _write(package / "public_helper.py", "Z = 1\n")
    _write(user / "mine.py", """\
        from mslk_dsl.templates import _rowwise as rw
        import mslk_dsl.templates.public_helper
        from . import _own
        """)
    _write(user / "_own.py", "W = 1\n")
    _write(user / "_inner.py", "unrelated = 1\n")  # same name as a package helper: not imported
    monkeypatch.setattr(keys, "_package_templates_dir", lambda: str(package))

    def digest():
        keys.template_digest.cache_clear()
        return keys.template_digest(str(user / "mine.py"))

    seen = {digest()}
    for path, text in ((package / "_rowwise.py", "from mslk_dsl.templates import _inner\nX = 2\n"),
                       (package / "_inner.py", "Y = 2\n"),  # imported by the helper: transitive
                       (package / "public_helper.py", "Z = 2\n"),
                       (user / "_own.py", "W = 2\n")):
        path.write_text(text)
        seen.add(digest())
    assert len(seen) == 5, "each edit of an imported module must change the digest"
    (user / "_inner.py").write_text("unrelated = 2\n")
    assert digest() in seen, "a file the template does not import must not change its digest"
    keys.template_digest.cache_clear()
