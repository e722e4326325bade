"""Which templates each file of a template folder defines, remembered between processes.

The registry can only learn a file's templates by importing it (a file may build them any way
it likes), and importing every template file cost the first call of an op tens of milliseconds.
So once a process has imported a whole folder, the registry saves what each file defined, and
later processes import only the files that define the op they need.

The index lives beside the folder's bytecode (its ``__pycache__``, or under
``sys.pycache_prefix``) and, like bytecode, is not written under PYTHONDONTWRITEBYTECODE or
where that place is read-only; discovery then imports every file, as before. It is used only
while its stamp matches: a hash over the size and modification time of every ``.py`` file of
the folder and the framework version, so editing, adding or removing a template or a helper
makes the registry import the whole folder again. It assumes that what a file defines depends
only on those files; the registry checks each file it imports against the index and re-indexes
the folder when they differ.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys

import mslk_dsl
from mslk_dsl import fs

# Bump when the registry changes how it names templates or what an index entry holds.
FORMAT = 1
FILENAME = "mslk-dsl-templates.json"

# file stem -> (op, backend, name) of each template the file defines, in its order
Index = dict[str, list[tuple[str, str, str]]]


def path(directory: str) -> str:
    """Where the index of ``directory`` lives: beside the bytecode of its modules."""
    bytecode = importlib.util.cache_from_source(os.path.join(directory, "__init__.py"))
    return os.path.join(os.path.dirname(bytecode), FILENAME)


def stamp(directory: str) -> str:
    """A hash over the framework version and the name, size and modification time of every .py
    file of the folder: Python's own rule for reusing bytecode, so the index is never staler than
    the code Python would run (and a stat costs a fraction of reading the files)."""
    h = hashlib.sha256(f"{FORMAT}\0{mslk_dsl.__version__}\0".encode())
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.endswith(".py"):
            st = entry.stat()
            h.update(f"{entry.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def load(directory: str, current_stamp: str) -> Index | None:
    """The saved index of ``directory`` if it was saved for ``current_stamp``, else None."""
    try:
        with open(path(directory)) as f:
            saved = json.load(f)
        if saved["stamp"] != current_stamp:
            return None
        return {stem: [(op, backend, name) for op, backend, name in templates]
                for stem, templates in saved["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, NotImplementedError):  # absent, or not ours
        return None


def save(directory: str, stamp_before_import: str, index: Index) -> None:
    """Save ``index`` under the stamp taken before the folder was imported (a file edited during
    the import then leaves a stale stamp, never a stale index). Best effort, like bytecode."""
    if sys.dont_write_bytecode:
        return
    try:
        target = path(directory)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        # Created like bytecode (0666 less the umask), so other users of an installation can read
        # it; readers see the old index or the new one, never half of one.
        fs.atomic_write(target, json.dumps({"stamp": stamp_before_import, "files": index}))
    except (OSError, NotImplementedError):  # read-only, or an interpreter without bytecode caching
        return
