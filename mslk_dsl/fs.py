"""Filesystem steps that must be all-or-nothing for other processes: the one place that writes.

Every file another process may read while we write it (meta.json, manifest.json, tuning.json, the
template index) goes through ``atomic_write``: a temp file with a name unique to this writer in
the same directory, then ``os.replace``. A directory is published by building it elsewhere on the
same filesystem and renaming it into place (``publish_dir``). ``remove_tree`` renames before
deleting, so a reader sees the whole tree or nothing, and tolerates another process removing the
same tree at the same time. Locks are ``filelock`` file locks (``lock``).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from filelock import FileLock

# Leftovers of a killed writer carry this mark so sweeps can recognise them.
TEMP_MARK = ".tmp-"


def temp_name(path: str) -> str:
    """A sibling of ``path`` no other writer (process or thread) will choose."""
    return f"{path}{TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def atomic_write(path: str, data: bytes | str, mode: int = 0o666, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the new one, never a part.

    The file is created like any other (``mode`` less the umask). ``fsync`` forces the bytes to
    disk before the rename, for files whose loss after a crash would be worse than a rebuild."""
    tmp = temp_name(path)
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def replacing(path: str):
    """For a file another program writes (a compiler's output, a zip): yields a temporary sibling
    to write, then renames it to ``path`` if the block finished, else removes it. Readers see the
    old file or the whole new one, never a part (a killed ``aot package`` leaves no half wheel)."""
    tmp = temp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def publish_dir(staging: str, final: str) -> None:
    """Rename the finished directory ``staging`` to ``final`` (same filesystem). A directory
    already at ``final`` is removed first; the caller holds the lock that makes that safe."""
    os.makedirs(os.path.dirname(final), exist_ok=True)
    if os.path.lexists(final):
        remove_tree(final)
    os.rename(staging, final)


def remove_tree(path: str, trash_dir: str | None = None) -> bool:
    """Remove the directory (or file) ``path``; False when it was already gone (another process
    removed it first).

    With ``trash_dir`` (on the same filesystem), the tree is renamed there first, so readers of
    ``path`` see it whole or absent, never half deleted."""
    target = path
    if trash_dir is not None:
        target = os.path.join(trash_dir, uuid.uuid4().hex)
        try:
            os.makedirs(trash_dir, exist_ok=True)
            os.rename(path, target)
        except FileNotFoundError:
            return False
    elif not os.path.lexists(path):
        return False
    if os.path.islink(target) or not os.path.isdir(target):  # a file (a temp file, a lock)
        try:
            os.unlink(target)
        except FileNotFoundError:
            return False
        return True
    # Files vanishing under rmtree are another remover's work, not an error.
    if sys.version_info >= (3, 12):
        shutil.rmtree(target, onexc=_ignore_vanished)
    else:
        shutil.rmtree(target, onerror=lambda function, p, info: _ignore_vanished(function, p, info[1]))
    return True


def _ignore_vanished(function, path, exc) -> None:
    if not isinstance(exc, FileNotFoundError):
        raise exc


def lock(path: str, timeout: float = -1) -> FileLock:
    """An inter-process lock on ``path`` (its directory is created); use it as a context manager."""
    from filelock import FileLock  # imported here: template discovery writes files without it

    os.makedirs(os.path.dirname(path), exist_ok=True)
    return FileLock(path, timeout=timeout)


def is_locked(path: str) -> bool:
    """Whether another holder has ``path``'s lock right now (a free or absent lock is False)."""
    from filelock import FileLock

    if not os.path.exists(path):
        return False
    probe = FileLock(path, timeout=0)
    try:
        probe.acquire()
    except Exception:  # Timeout, or a lock file we cannot open: treat as held
        return True
    probe.release()
    return False


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def free_space_hint(path: str) -> str:
    """' (N MiB free)' for the filesystem holding ``path``, or '' where it cannot be told."""
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe or "/")
    except OSError:
        return ""
    return f" ({st.f_bavail * st.f_frsize / 2**20:.0f} MiB free)"
