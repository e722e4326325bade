"""The import graph of mslk_dsl is layered (README, Architecture): every import, at module level
or inside a function, goes to a module of the same layer or a layer above it. Read from the
source with ast, so a lazy import counts as much as one at the top."""
import ast
import os

import mslk_dsl
import mslk_dsl.templates

ROOT = os.path.dirname(mslk_dsl.__file__)
# The built-in templates ship as mslk_dsl.templates from the checkout's templates/ folder.
TEMPLATES = os.path.dirname(mslk_dsl.templates.__file__)

# Top to bottom; a module may import its own layer and the layers above it.
LAYERS = [
    {"errors", "env"},
    {"targets", "device", "template", "fs", "binaries", "compile_errors", "testing", "templates"},
    {"keys", "template_index", "registry", "tuning"},
    {"cache", "backends", "resources"},
    {"jit"},
    {"native"},
    {"ops"},
    {"attention", "moe"},
    {"autotune", "aot", "explain", "cli"},
]


def _layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and to the README's table")


def _modules() -> dict[str, str]:
    found = {}
    for directory, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = "mslk_dsl." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[module.removesuffix(".__init__")] = path
    for name in os.listdir(TEMPLATES):
        if name.endswith(".py"):
            found[f"mslk_dsl.templates.{name[:-3]}".removesuffix(".__init__")] = os.path.join(TEMPLATES, name)
    return found


def _imports(module: str, path: str) -> set[str]:
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("mslk_dsl"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if base == "mslk_dsl":  # from mslk_dsl import x: the module x (or the package's __version__)
                out.update(f"mslk_dsl.{a.name}" for a in node.names if a.name != "__version__")
            elif base.startswith("mslk_dsl"):
                out.add(base)
    return out


def test_every_import_goes_to_the_same_layer_or_above():
    modules = _modules()
    upward = []
    for module, path in modules.items():
        if module == "mslk_dsl":  # the package root registers the ops (see its docstring)
            continue
        here = _layer_of(module)
        for target in _imports(module, path):
            if target == "mslk_dsl":
                continue  # the version
            if target.split(".")[1] == module.split(".")[1]:
                continue  # a package may import its own modules
            if _layer_of(target) > here:
                upward.append(f"{module} (layer {here}) imports {target} (layer {_layer_of(target)})")
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_every_module_has_a_layer():
    for module in _modules():
        if module != "mslk_dsl":
            _layer_of(module)


def test_the_templates_are_scanned_too():
    """The templates (and the DSL-free limits the ops share with them) sit below the registry and
    the ops: a template importing the op layer or the cache would be an upward arrow."""
    modules = _modules()
    assert {"mslk_dsl.templates._kernel_limits", "mslk_dsl.templates.silu_mul_cute"} <= set(modules)
    assert "mslk_dsl.template" in _imports("mslk_dsl.templates.silu_mul_cute", modules["mslk_dsl.templates.silu_mul_cute"])


def test_the_reader_sees_lazy_imports():
    """The check reads imports inside functions too (jit imports the backends lazily here and
    there; cli imports nearly everything inside its commands)."""
    modules = _modules()
    assert {"mslk_dsl.cache", "mslk_dsl.backends"} <= _imports("mslk_dsl.jit", modules["mslk_dsl.jit"])
    assert "mslk_dsl.aot" in _imports("mslk_dsl.cli", modules["mslk_dsl.cli"])
