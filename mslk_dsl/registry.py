"""Discovers templates: every public module of ``templates/`` and of the directories named by
``MSLK_DSL_TEMPLATE_PATH``. A module defines ``TEMPLATE`` or ``TEMPLATES``.

Importing a template module is cheap (no DSL import, see template.py), so discovery runs in any
process. Still, a process that needs one op imports only the files that define it: each folder's
index (template_index.py) says which file defines which templates, and a folder without a current
index is imported whole, as a full discovery does. Either way the answer is the same, in the same
order: folders in order, files sorted by name, templates in the order a file declares them.

A template's digest covers its file and the private ``_*.py`` modules of the same folder that it
imports, transitively, so editing shared device code invalidates every user of it.
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
from typing import Callable

from mslk_dsl import env, template_index
from mslk_dsl.template import Template

# Each folder's index, once loaded or built in this process (see _index).
_indexes: dict[str, template_index.Index] = {}


def get_templates(op: str | None = None, backend: str | None = None) -> list[Template]:
    return _find(lambda t_op, t_backend, _name: (op is None or t_op == op)
                 and (backend is None or t_backend == backend))


def get_template(name: str) -> Template:
    found = _find(lambda _op, _backend, t_name: t_name == name)
    if not found:
        raise KeyError(f"no template named {name!r}; known: {[n for _, _, n in _identities()]}")
    return found[0]


def ops() -> list[str]:
    return sorted({op for op, _, _ in _identities()})


def templates_for(op: str, target: str) -> list[Template]:
    return [t for t in get_templates(op=op) if target in t.targets]


def reload() -> None:
    """Forget discovered templates and digests (after editing a template in a live process)."""
    _indexes.clear()
    _file_templates.cache_clear()
    template_digest.cache_clear()


# -- discovery ------------------------------------------------------------------------------------
def _find(wanted: Callable[[str, str, str], bool]) -> list[Template]:
    """The templates whose (op, backend, name) is ``wanted``, in discovery order, importing only
    the files that define one."""
    _identities()  # every folder indexed, names unique
    found: list[Template] = []
    for directory, builtin in _folders():
        index = _index(directory, builtin)
        for stem, identities in index.items():
            if not any(wanted(*identity) for identity in identities):
                continue
            templates = _file_templates(directory, stem, builtin)
            if [_identity(t) for t in templates] != identities:
                # What the file defines depends on something outside its folder, so the index
                # is wrong: index the folder again, by importing all of it, and start over.
                _indexes[directory] = _import_folder(directory, builtin, template_index.stamp(directory))
                return _find(wanted)
            found.extend(t for t in templates if wanted(*_identity(t)))
    return found


def _identities() -> list[tuple[str, str, str]]:
    """(op, backend, name) of every template, from the folders' indexes (no file imported when
    they are current); raises if two templates share one."""
    identities = [identity for directory, builtin in _folders()
                  for of_file in _index(directory, builtin).values() for identity in of_file]
    duplicates = {i for i in identities if identities.count(i) > 1}
    if duplicates:
        raise RuntimeError(f"duplicate template names: {sorted(duplicates)}")
    return identities


def _folders() -> list[tuple[str, bool]]:
    """The template folders in discovery order, each with whether it is the built-in one."""
    import mslk_dsl.templates as builtin

    return [*((d, True) for d in builtin.__path__), *((d, False) for d in env.template_paths())]


def _index(directory: str, builtin: bool) -> template_index.Index:
    """stem -> identities of the templates of each public file of the folder: the saved index if
    it is current, else learned by importing every file (and saved for the next process)."""
    index = _indexes.get(directory)
    if index is None:
        stamp = template_index.stamp(directory)
        index = template_index.load(directory, stamp)
        if index is None:
            index = _import_folder(directory, builtin, stamp)
        _indexes[directory] = index
    return index


def _import_folder(directory: str, builtin: bool, stamp: str) -> template_index.Index:
    stems = [f[:-3] for f in sorted(os.listdir(directory)) if f.endswith(".py") and not f.startswith("_")]
    index = {stem: [_identity(t) for t in _file_templates(directory, stem, builtin)] for stem in stems}
    template_index.save(directory, stamp, index)
    return index


def _identity(t: Template) -> tuple[str, str, str]:
    return t.op, t.backend, t.name


@functools.cache
def _file_templates(directory: str, stem: str, builtin: bool) -> tuple[Template, ...]:
    """The templates one file defines (imported once per process, so every caller gets the same
    objects)."""
    try:
        module = _import_template_module(directory, stem, builtin)
    except Exception as e:
        raise ImportError(f"template file {os.path.join(directory, stem + '.py')} failed to import: "
                          f"{type(e).__name__}: {e}") from e
    return tuple(_templates_of(module))


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


# -- digests --------------------------------------------------------------------------------------
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
