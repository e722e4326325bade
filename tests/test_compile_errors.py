"""A compile error names the template file and line, with the DSL's own frames trimmed away."""
import os
import textwrap

from mslk_dsl import compile_errors, registry
from mslk_dsl.errors import CompileError


def _raise_from_template(tmp_path, monkeypatch):
    """An error raised inside a template file's code, wrapped as the backends wrap DSL errors."""
    folder = tmp_path / "tpl"
    folder.mkdir()
    (folder / "failing.py").write_text(textwrap.dedent("""\
        def helper():
            raise NameError("name 'undefined_name_here' is not defined")


        def build(config, target, sig):
            helper()
        """))
    monkeypatch.setenv("MSLK_DSL_TEMPLATE_PATH", str(folder))
    namespace: dict = {}
    path = str(folder / "failing.py")
    exec(compile(open(path).read(), path, "exec"), namespace)
    try:
        try:
            namespace["build"]({}, "sm90a", {})
        except Exception as e:
            raise CompileError(f"CuTe DSL failed to compile failing {{}} for sm90a: \x1b[91merror:\x1b[0m {e}") from e
    except CompileError as e:
        return e, path
    raise AssertionError("no error raised")


def test_frames_of_the_template_are_shown_and_the_rest_trimmed(tmp_path, monkeypatch):
    error, path = _raise_from_template(tmp_path, monkeypatch)
    text = compile_errors.describe_compile_error(error)
    lines = text.splitlines()
    assert lines[0].startswith("CompileError: CuTe DSL failed to compile failing") and "\x1b" not in lines[0]
    assert lines[1:] == [f"  at {path}:6 in build: helper()",
                         f"  at {path}:2 in helper: raise NameError(\"name 'undefined_name_here' is not defined\")"]
    assert __file__ not in text and "test_compile_errors" not in text  # not a template: trimmed


def test_a_child_traceback_carried_as_text_is_reduced_to_template_frames(monkeypatch):
    template = registry.get_template("scale_copy_flydsl").source
    child = (f"FlyDSL failed to compile scale_copy_flydsl {{}} for gfx942 {{}}:\nValueError: bad tile\n"
             f"Traceback (most recent call last):\n"
             f"  File \"/somewhere/flydsl/compiler/jit_function.py\", line 812, in __call__\n    return self._compile()\n"
             f"  File \"{template}\", line 20, in launch\n    kernel(x)\n"
             f"ValueError: bad tile\n")
    text = compile_errors.describe_compile_error(CompileError(child))
    assert text.splitlines() == [
        "CompileError: FlyDSL failed to compile scale_copy_flydsl {} for gfx942 {}: ValueError: bad tile "
        "ValueError: bad tile",
        f"  at {template}:20 in launch: kernel(x)"]
    assert "jit_function.py" not in text


def test_an_error_outside_templates_is_its_line_alone():
    text = compile_errors.describe_compile_error(CompileError("linking x failed:\nld: cannot find -lfoo"))
    assert text == "CompileError: linking x failed: ld: cannot find -lfoo"
    assert os.sep not in text.split(":")[0]
