"""Discovers templates: every public module of ``templates/`` and of the directories named by
``MSLK_DSL_TEMPLATE_PATH``. A module defines ``TEMPLATE`` or ``TEMPLATES``.

Importing a template module is cheap (no DSL import, see template.py), so discovery runs in any
process. A template's digest covers its file and the private ``_*.py`` modules of the same folder
that it imports, transitively, so editing shared device code invalidates every user of it.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import os
import re
import sys

from mslk_dsl import env
from mslk_dsl.template import Template


@functools.cache
def _discover() -> tuple[Template, ...]:
    import mslk_dsl.templates as builtin

    found: list[Template] = []
    for directory in [*builtin.__path__, *env.template_paths()]:
        for filename in sorted(os.listdir(directory)):
            if not filename.endswith(".py") or filename.startswith("_"):
                continue
            try:
                module = _import_template_module(directory, filename[:-3], builtin=directory in builtin.__path__)
            except Exception as e:
                raise ImportError(f"template file {os.path.join(directory, filename)} failed to import: "
                                  f"{type(e).__name__}: {e}") from e
            found.extend(_templates_of(module))
    names = [(t.op, t.backend, t.name) for t in found]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise RuntimeError(f"duplicate template names: {sorted(duplicates)}")
    return tuple(found)


def _import_template_module(directory: str, stem: str, builtin: bool):
    if builtin:
        return importlib.import_module(f"mslk_dsl.templates.{stem}")
    # User templates: a private package name per directory so two folders may share file names.
    package = "mslk_dsl_user_templates_" + hashlib.sha1(directory.encode()).hexdigest()[:10]
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(package, os.path.join(directory, "__init__.py"),
                                                      submodule_search_locations=[directory])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[package] = pkg
        if os.path.exists(os.path.join(directory, "__init__.py")):
            spec.loader.exec_module(pkg)
    return importlib.import_module(f"{package}.{stem}")


def _templates_of(module) -> list[Template]:
    declared = getattr(module, "TEMPLATES", None) or [getattr(module, "TEMPLATE", None)]
    stem = module.__name__.rsplit(".", 1)[-1]
    out = []
    for t in declared:
        if t is None:
            continue
        if not isinstance(t, Template):
            raise TypeError(f"{module.__file__}: TEMPLATE(S) must be mslk_dsl.template.Template objects")
        name = t.name or (stem if len(declared) == 1 else f"{stem}.{t.op}")
        out.append(dataclasses.replace(t, name=name, source=module.__file__))
    return out


def get_templates(op: str | None = None, backend: str | None = None) -> list[Template]:
    return [t for t in _discover() if (op is None or t.op == op) and (backend is None or t.backend == backend)]


def get_template(name: str) -> Template:
    for t in _discover():
        if t.name == name:
            return t
    raise KeyError(f"no template named {name!r}; known: {[t.name for t in _discover()]}")


def ops() -> list[str]:
    return sorted({t.op for t in _discover()})


def templates_for(op: str, target: str) -> list[Template]:
    return [t for t in get_templates(op=op) if target in t.targets]


def reload() -> None:
    """Forget discovered templates and digests (after editing a template in a live process)."""
    _discover.cache_clear()
    template_digest.cache_clear()


@functools.cache
def template_digest(source: str) -> str:
    """sha256 over the template file and the private sibling modules it imports (transitively)."""
    directory = os.path.dirname(source)
    seen: dict[str, bytes] = {}
    pending = [source]
    while pending:
        path = pending.pop()
        if path in seen or not os.path.exists(path):
            continue
        with open(path, "rb") as f:
            seen[path] = f.read()
        pending.extend(os.path.join(directory, f"{m}.py") for m in _local_imports(seen[path]))
    h = hashlib.sha256()
    for path in sorted(seen):
        h.update(os.path.basename(path).encode() + b"\0" + seen[path] + b"\0")
    return h.hexdigest()


def _local_imports(source: bytes) -> set[str]:
    """Names of private sibling modules (``_x``) imported as ``from . import _x``, ``from ._x import``,
    ``from mslk_dsl.templates import _x`` or ``import mslk_dsl.templates._x``.

    Read from the text, not with ``ast``: this runs on the first call of every op, and parsing
    the larger templates cost tens of milliseconds. Text that merely looks like such an import
    (a line of a docstring) counts too: that can only add a file to the digest, never leave an
    imported one out. tests/test_cache.py checks that the result equals the syntax tree's
    reading for every template file.
    """
    names = set()
    for level, module, imported in _import_statements(source.decode("utf-8", errors="replace")):
        if module is None:  # import a.b, c
            names.update(n.split(".")[2] for n in imported if n.startswith("mslk_dsl.templates."))
        elif level and not module:
            names.update(imported)
        elif level:
            names.add(module.split(".")[0])
        elif module == "mslk_dsl.templates":
            names.update(imported)
        elif module.startswith("mslk_dsl.templates."):
            names.add(module.split(".")[2])
    return {n for n in names if n.startswith("_")}


# Statements are found from their ``import`` keyword: a pattern that starts with a literal is
# scanned for at memchr speed, ten times faster than one that tries every line start.
_IMPORT_KEYWORD = re.compile(r"import\b")
_FROM_HEAD = re.compile(r"[ \t]*from\b[ \t]*(\.*)[ \t]*([\w.]*)[ \t]*")
# The name list: to the end of the line (backslash continuations included), or in parentheses.
_NAME_LIST = re.compile(r"[ \t]*(\([^)]*\)|(?:[^\n;#\\]|\\\n)*)")


def _import_statements(text: str):
    """(level, module, names) of each ``from <dots><module> import <names>`` statement, and
    (0, None, names) of each ``import <names>``, in the order they appear."""
    for keyword in _IMPORT_KEYWORD.finditer(text):
        at = keyword.start()
        if at and (text[at - 1].isalnum() or text[at - 1] == "_"):
            continue  # the end of a longer word
        head = text[_statement_start(text, at):at].replace("\\\n", " ")
        names = _imported_names(_NAME_LIST.match(text, keyword.end()).group(1))
        if not head.strip(" \t"):
            yield 0, None, names
        elif (from_head := _FROM_HEAD.fullmatch(head)) is not None:
            yield len(from_head[1]), from_head[2], names


def _statement_start(text: str, at: int) -> int:
    """Where the statement around ``at`` starts: its line (joined to the lines before it that end
    in a backslash), after the last ";" or ":" on it before ``at``."""
    line = text.rfind("\n", 0, at) + 1
    while line >= 2 and text[line - 2] == "\\":
        line = text.rfind("\n", 0, line - 2) + 1
    return max(line, text.rfind(";", line, at) + 1, text.rfind(":", line, at) + 1)


def _imported_names(name_list: str) -> list[str]:
    """The imported names of an import's name list: 'a as b, c' -> ['a', 'c'] (also in
    parentheses over several lines, with comments, or with backslash continuations)."""
    name_list = re.sub(r"#[^\n]*", "", name_list).replace("\\\n", " ").strip("() \t\n")
    return [item.split()[0] for item in name_list.split(",") if item.strip()]
