"""Every error mslk-dsl raises on purpose is an MslkDslError (mslk_dsl/errors.py).

A source scan holds the rule for every module of mslk_dsl/ and templates/ (a new bare
``raise ValueError(...)`` fails here with its file and line); a few representative bad calls
show the errors a user meets are MslkDslErrors and still the built-in types they used to be.
"""
import ast
import builtins
import os

import pytest
import torch

from mslk_dsl import env, ops, registry
from mslk_dsl.errors import ConfigError, InputError, InputTypeError, MslkDslError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("mslk_dsl", "templates")

BUILTIN_EXCEPTIONS = {name for name, value in vars(builtins).items()
                      if isinstance(value, type) and issubclass(value, BaseException)
                      and not issubclass(value, Warning)}

# (file, exception): where a built-in exception must stay built-in, and why.
ALLOWED = {
    # A module __getattr__ must raise AttributeError itself: hasattr(), getattr(..., default) and
    # `from mslk_dsl.ops import x` rely on exactly that type.
    ("mslk_dsl/ops/__init__.py", "AttributeError"),
}


def _sources():
    for top in SCANNED:
        for directory, _, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    yield os.path.relpath(path, ROOT), ast.parse(open(path).read(), path)


def _raised_name(node: ast.Raise) -> str | None:
    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    return exc.id if isinstance(exc, ast.Name) else None


def test_the_scan_sees_the_sources():
    """Guards the scan below against passing because it read nothing."""
    seen = {path for path, _ in _sources()}
    assert {"mslk_dsl/ops/validate.py", "mslk_dsl/template.py", "templates/_rowwise_space.py"} <= seen


def test_no_bare_builtin_exception_is_raised():
    found = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                name = _raised_name(node)
                if name in BUILTIN_EXCEPTIONS and (path, name) not in ALLOWED:
                    found.append(f"{path}:{node.lineno}: raise {name}")
    assert not found, ("raise an mslk_dsl.errors class instead (InputError, InputTypeError, ConfigError, "
                       "UnsupportedError, ...; each is also the built-in type):\n" + "\n".join(found))


def test_no_assert_checks_a_config_or_an_input():
    """``assert`` is removed by ``python -O`` and its message names neither the template nor the
    config: checks raise (mslk_dsl.template.require, or an mslk_dsl.errors class)."""
    found = [f"{path}:{node.lineno}: assert" for path, tree in _sources() for node in ast.walk(tree)
             if isinstance(node, ast.Assert)]
    assert not found, "raise a ConfigError / InputError instead:\n" + "\n".join(found)


def test_the_allow_list_has_no_stale_entries():
    present = {(path, _raised_name(node)) for path, tree in _sources() for node in ast.walk(tree)
               if isinstance(node, ast.Raise) and node.exc is not None}
    assert ALLOWED <= present


def test_project_exception_classes_derive_from_mslk_dsl_error():
    """A class the project defines on a built-in exception must also have a project base (in
    practice MslkDslError or one of its subclasses), or its raises escape the one base."""
    found = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and path != "mslk_dsl/errors.py":
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if bases and bases <= BUILTIN_EXCEPTIONS:
                    found.append(f"{path}:{node.lineno}: class {node.name}({', '.join(sorted(bases))})")
    assert not found, "derive these from MslkDslError as well:\n" + "\n".join(found)


def _silu_mul_template():
    return next(t for t in registry.get_templates(op="silu_mul") if "sm90a" in t.targets)


BAD_CALLS = [
    ("bad dtype to silu_mul", lambda: ops.silu_mul(torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4, 8)),
     InputTypeError, TypeError),
    ("misaligned K of a GEMM", lambda: ops.bf16_gemm(torch.zeros(4, 12, dtype=torch.bfloat16),
                                                     torch.zeros(16, 12, dtype=torch.bfloat16)),
     InputError, ValueError),
    ("unknown config to a template", lambda: _silu_mul_template().check_config(
        {"no_such_part": 1}, "sm90a", {"dtype": "bf16", "vec_bytes": 16}), ConfigError, ValueError),
    ("unknown template name", lambda: registry.get_template("no_such_template"), MslkDslError, KeyError),
    ("CPU tensors", lambda: ops.silu_mul(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)),
     MslkDslError, NotImplementedError),
]


@pytest.mark.parametrize("call, project_type, builtin_type", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_raise_mslk_dsl_errors_of_the_old_builtin_type(call, project_type, builtin_type):
    with pytest.raises(project_type) as err:
        call()
    assert isinstance(err.value, MslkDslError) and isinstance(err.value, builtin_type)


def test_a_bad_environment_setting_is_an_mslk_dsl_error(monkeypatch):
    monkeypatch.setenv("MSLK_DSL_AOT_WORKERS", "many")
    with pytest.raises(MslkDslError, match="MSLK_DSL_AOT_WORKERS='many'") as err:
        env.aot_workers()
    assert isinstance(err.value, ValueError)
