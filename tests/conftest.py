"""Shared test set-up.

Every test process sees the framework-test templates in tests/fixtures/user_templates (they are
also the proof that MSLK_DSL_TEMPLATE_PATH works) and a private cache directory, so tests never
touch a user's cache. A test process compiles CuTe in-process and FlyDSL only in child processes,
so it never imports both DSLs.
"""
import os
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
USER_TEMPLATES = os.path.join(HERE, "fixtures", "user_templates")
os.environ["MSLK_DSL_TEMPLATE_PATH"] = USER_TEMPLATES
os.environ.setdefault("MSLK_DSL_CACHE_DIR", tempfile.mkdtemp(prefix="mslk-dsl-test-cache-"))
os.environ.pop("MSLK_DSL_DISABLE_JIT", None)
os.environ.pop("MSLK_DSL_AOT_PATH", None)


@pytest.fixture(autouse=True)
def _no_launch_plans_across_tests():
    """Tests stand in kernels for ops; a Python launch plan made under one test's stand-in must
    not serve a later test's call of the same layout."""
    yield
    import sys

    call = sys.modules.get("mslk_dsl.ops.call")
    if call is not None:
        call.clear_python_plans()


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    """The native launcher, built for the module's tests into a cache of their own (a C++
    compiler and tvm_ffi are test requirements)."""
    from mslk_dsl import native

    mp = pytest.MonkeyPatch()
    mp.setenv("MSLK_DSL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    mp.delenv("MSLK_DSL_NO_NATIVE", raising=False)
    module = native.load()
    mp.undo()
    if module is None:
        pytest.fail("the native launcher did not build; a C++ compiler and tvm_ffi are test requirements")
    return module


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh, empty writable cache for one test (and a clean in-process memo)."""
    from mslk_dsl import jit

    root = tmp_path / "cache"
    monkeypatch.setenv("MSLK_DSL_CACHE_DIR", str(root))
    monkeypatch.delenv("MSLK_DSL_AOT_PATH", raising=False)
    jit._memo.clear()
    jit.stats.clear()
    jit._bundle_roots.cache_clear()
    yield root
    jit._memo.clear()
    jit._bundle_roots.cache_clear()
