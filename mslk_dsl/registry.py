"""Discovers templates: every public module of ``templates/`` and of the directories named by
``MSLK_DSL_TEMPLATE_PATH``. A module defines ``TEMPLATE`` or ``TEMPLATES``.

Importing a template module is cheap (no DSL import, see template.py), so discovery runs in any
process. Still, a process that needs one op imports only the files that define it: each folder's
index (template_index.py) says which file defines which templates, and a folder without a current
index is imported whole, as a full discovery does. Either way the answer is the same, in the same
order: folders in order, files sorted by name, templates in the order a file declares them.

Template digests (what of a template's source goes into its kernels' keys) live in keys.py.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable

from mslk_dsl import env, template_index
from mslk_dsl.errors import MslkDslError, TemplateImportError, UnknownTemplateError
from mslk_dsl.keys import template_digest
from mslk_dsl.template import Template


class DuplicateTemplateError(MslkDslError, RuntimeError):
    """Two template files define a template of the same name."""


# Each folder's index, once loaded or built in this process (see _index).
_indexes: dict[str, template_index.Index] = {}


def get_templates(op: str | None = None, backend: str | None = None) -> list[Template]:
    return _find(lambda t_op, t_backend, _name: (op is None or t_op == op)
                 and (backend is None or t_backend == backend))


def get_template(name: str) -> Template:
    found = _find(lambda _op, _backend, t_name: t_name == name)
    if not found:
        raise UnknownTemplateError(f"no template named {name!r}; known: {[n for _, _, n in _identities()]}")
    return found[0]


def ops() -> list[str]:
    return sorted({op for op, _, _ in _identities()})


def templates_for(op: str, target: str) -> list[Template]:
    """The templates of ``op`` for ``target`` in discovery order; the op layer uses the first."""
    found = [t for t in get_templates(op=op) if target in t.targets]
    if len(found) > 1 and (op, target) not in _warned_shadowed:
        # A second template for the same op and target (typically a user template for a built-in
        # op) is compiled by `aot build` but never called: say so once.
        _warned_shadowed.add((op, target))
        ignored = ", ".join(f"{t.name!r} ({t.source})" for t in found[1:])
        warnings.warn(f"mslk-dsl: op {op!r} on {target} is served by template {found[0].name!r} "
                      f"({found[0].source}); {ignored} also implement(s) it and will be ignored for "
                      f"{target} (templates are tried in discovery order: built-in first, then "
                      "MSLK_DSL_TEMPLATE_PATH in order)", stacklevel=2)
    return found


# (op, target) pairs already warned about in this process.
_warned_shadowed: set[tuple[str, str]] = set()


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
    they are current); raises if two templates share a name (a kernel key and the compile
    workers find a template by its name alone)."""
    where: dict[str, list[tuple[tuple[str, str, str], str]]] = {}
    for directory, builtin in _folders():
        for stem, of_file in _index(directory, builtin).items():
            for identity in of_file:
                where.setdefault(identity[2], []).append((identity, os.path.join(directory, stem + ".py")))
    clashes = {name: found for name, found in where.items() if len(found) > 1}
    if clashes:
        raise DuplicateTemplateError("; ".join(
            f"template name {name!r} is defined by both {' and '.join(file for _, file in found)}"
            for name, found in sorted(clashes.items()))
            + ": rename one (Template(name=...) or its file) or take its folder off MSLK_DSL_TEMPLATE_PATH")
    return [identity for found in where.values() for identity, _ in found]


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
        raise TemplateImportError(f"template file {os.path.join(directory, stem + '.py')} failed to import: "
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
        if spec is None or spec.loader is None:
            raise TemplateImportError(f"cannot import templates from {directory}")
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
            raise TemplateImportError(f"{module.__file__}: TEMPLATE(S) must be mslk_dsl.template.Template objects")
        name = t.name or (stem if len(declared) == 1 else f"{stem}.{t.op}")
        out.append(dataclasses.replace(t, name=name, source=module.__file__))
    return out
