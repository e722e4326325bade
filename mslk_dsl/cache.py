"""The on-disk kernel store: one directory per KernelKey, ``<root>/<target>/<op>/<digest>/``.

An entry holds the artifact files and ``meta.json`` (the key's parts, each file's size and sha256,
toolchain versions, build time). It is published by building a staging directory and renaming it
into place, with meta.json written last inside it, so a reader sees a whole entry or none. A
per-key file lock makes concurrent processes compile a key once. The same class serves read-only
layers (AOT bundles): those are never written, locked or repaired.

Housekeeping (prune, verify, clear) may run while other processes build and load: an entry that
vanishes under it was removed by someone else and counts as gone, never as an error or as damage.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import time
import warnings
from dataclasses import dataclass

from mslk_dsl import fs
from mslk_dsl.errors import CacheError, DamagedEntryWarning, MslkDslError
from mslk_dsl.keys import KernelKey

log = logging.getLogger(__name__)

META = "meta.json"
STAGING, TRASH, LOCKS = ".staging", ".trash", ".locks"
# A staging directory whose key lock is free, or older than this, belongs to a build that died.
STALE_STAGING_SECONDS = 3600
# An atomic write takes milliseconds; a temp file this old belongs to a killed writer.
STALE_TEMP_SECONDS = 600


@dataclass
class Entry:
    """A verified cache entry: where it is and what meta.json says."""

    path: str
    meta: dict

    @property
    def key_parts(self) -> dict:
        return self.meta["key"]

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.meta["files"].values())


class CorruptEntry(MslkDslError):
    """An entry fails its checks (meta.json missing or malformed, an artifact's size or sha256
    wrong). Raised to be caught here and by jit and the bundle code, which remove or skip the
    entry; an MslkDslError all the same, should one escape a caller."""


def sha256_of(path: str) -> str:
    return fs.sha256_file(path)


def check_meta(meta) -> None:
    """Raise CorruptEntry unless ``meta`` has the shape the loader and the tools rely on."""
    if not isinstance(meta, dict):
        raise CorruptEntry(f"meta.json holds a {type(meta).__name__}, not an object")
    if not isinstance(meta.get("key"), dict):
        raise CorruptEntry("meta.json has no key object")
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        raise CorruptEntry("meta.json lists no artifact")
    for name, info in files.items():
        if (not isinstance(info, dict) or not isinstance(info.get("size"), int)
                or not isinstance(info.get("sha256"), str)):
            raise CorruptEntry(f"meta.json's record of {name} lacks an integer size or a sha256")
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise CorruptEntry(f"meta.json names a file outside the entry: {name!r}")


def disk_full_error(root: str, doing: str, elsewhere: str = "set MSLK_DSL_CACHE_DIR to") -> CacheError:
    err = CacheError(f"cannot {doing} in {root}: the disk is full{fs.free_space_hint(root)}; free space "
                     f"(e.g. `mslk-dsl cache prune --max-size SIZE`) or {elsewhere} a directory on another disk")
    err.errno = errno.ENOSPC
    return err


def store_error(root: str, doing: str, e: OSError, elsewhere: str = "set MSLK_DSL_CACHE_DIR to") -> CacheError:
    """One line for an OS error on a store: what failed, where, and what to do about it
    (``elsewhere`` says how to choose another directory: an environment variable, an option)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return disk_full_error(root, doing, elsewhere)
    where = f" ({e.filename})" if getattr(e, "filename", None) and e.filename != root else ""
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"it is not writable: fix its permissions or {elsewhere} a writable directory"
    elif e.errno in (errno.ENOTDIR, errno.EEXIST) or os.path.isfile(root):
        fix = f"a file is in the way of a directory: remove it or {elsewhere} a directory"
    else:
        fix = f"{e.strerror or e}; {elsewhere} a usable directory"
    err = CacheError(f"cannot {doing} in {root}{where}: {fix}")
    err.errno = e.errno
    return err


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) is a full disk, as the compiler saw it."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


class KernelCache:
    def __init__(self, root: str, writable: bool = True):
        self.root = os.path.abspath(root)
        self.writable = writable

    def __repr__(self):
        return f"KernelCache({self.root!r}, writable={self.writable})"

    # -- lookup -------------------------------------------------------------------------------
    def entry_dir(self, key: KernelKey) -> str:
        return os.path.join(self.root, key.target, key.op, key.digest)

    def lookup(self, key: KernelKey) -> Entry | None:
        """The verified entry for ``key``, or None. A damaged entry is removed (writable cache)
        or skipped (read-only layer), with a warning either way."""
        path = self.entry_dir(key)
        if not os.path.isdir(path):
            return None
        try:
            return self._verify(path, key.digest)
        except CorruptEntry as e:
            if os.path.isdir(path):  # else removed by another process meanwhile: just a miss
                self.discard(path, f"{e}")
            return None

    def _verify(self, path: str, digest: str | None = None) -> Entry:
        meta_path = os.path.join(path, META)
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except FileNotFoundError:
            raise CorruptEntry("meta.json is missing") from None
        except (OSError, ValueError) as e:
            raise CorruptEntry(f"meta.json is unreadable ({e})") from None
        check_meta(meta)
        if digest is not None and meta.get("digest") != digest:
            raise CorruptEntry(f"meta.json names digest {meta.get('digest')!r}, not {digest!r}")
        for name, info in meta["files"].items():
            file = os.path.join(path, name)
            try:
                size = os.path.getsize(file)
                if size != info["size"]:
                    raise CorruptEntry(f"artifact {name} has {size} bytes, meta.json says {info['size']}")
                if sha256_of(file) != info["sha256"]:
                    raise CorruptEntry(f"artifact {name} fails its sha256 check")
            except (FileNotFoundError, IsADirectoryError):
                raise CorruptEntry(f"artifact {name} is missing") from None
        return Entry(path, meta)

    def discard(self, path: str, reason: str) -> None:
        """Drop a damaged entry so it is rebuilt (read-only layers are only warned about)."""
        if not self.writable:
            warnings.warn(f"mslk-dsl: ignoring damaged entry {path} in read-only bundle: {reason}",
                          DamagedEntryWarning, stacklevel=3)
            return
        warnings.warn(f"mslk-dsl: removing damaged cache entry {path} ({reason}); it will be rebuilt",
                      DamagedEntryWarning, stacklevel=3)
        self._remove(path)

    def _remove(self, path: str) -> bool:
        """Remove an entry (False when another process removed it first). Renamed away first, so
        a concurrent reader sees no entry rather than half of one."""
        return fs.remove_tree(path, trash_dir=os.path.join(self.root, TRASH))

    def touch(self, entry: Entry) -> None:
        """Mark an entry used now (for LRU pruning)."""
        if self.writable:
            try:
                os.utime(os.path.join(entry.path, META))
            except OSError:
                pass

    # -- publish --------------------------------------------------------------------------------
    def _lock_path(self, digest: str) -> str:
        return os.path.join(self.root, LOCKS, f"{digest}.lock")

    @contextlib.contextmanager
    def lock(self, key: KernelKey):
        """Hold ``key``'s build lock (a store we cannot write raises CacheError, naming it)."""
        try:
            held = fs.lock(self._lock_path(key.digest))
            held.acquire()
        except OSError as e:
            raise store_error(self.root, "take a build lock", e) from None
        try:
            yield held
        finally:
            held.release()

    def ensure_writable(self, elsewhere: str = "set MSLK_DSL_CACHE_DIR to") -> None:
        """Raise CacheError (one line, with the fix) unless files can be created in this store."""
        try:
            os.makedirs(os.path.join(self.root, LOCKS), exist_ok=True)
            fs.atomic_write(os.path.join(self.root, LOCKS, ".writable"), "")
        except OSError as e:
            raise store_error(self.root, "write", e, elsewhere) from None

    def staging_dir(self, key: KernelKey) -> str:
        """A fresh, private directory to compile ``key`` into (the caller holds its lock)."""
        path = os.path.join(self.root, STAGING, f"{key.digest}-{os.getpid()}-{os.urandom(4).hex()}")
        try:
            os.makedirs(path)
        except OSError as e:
            raise store_error(self.root, "create a build directory", e) from None
        return path

    def publish(self, key: KernelKey, staging: str, info: dict) -> Entry:
        """Seal ``staging`` (hash its files, write meta.json last) and rename it into place. On
        any failure (a full disk) the staging directory is removed: nothing finished stays hidden."""
        if not self.writable:
            raise CacheError(f"{self.root} is a read-only layer (a bundle): kernels are published into the cache")
        try:
            files = {}
            for name in sorted(os.listdir(staging)):
                p = os.path.join(staging, name)
                if os.path.isfile(p):
                    files[name] = {"size": os.path.getsize(p), "sha256": sha256_of(p)}
            meta = {
                "digest": key.digest,
                "key": key.parts(),
                "files": files,
                "toolchain": key.dsl_versions,
                "build_host": socket.gethostname(),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **info,
            }
            fs.atomic_write(os.path.join(staging, META), json.dumps(meta, indent=1, sort_keys=True), fsync=True)
            final = self.entry_dir(key)
            fs.publish_dir(staging, final)  # replaces a damaged leftover (callers hold the key's lock)
        except BaseException as e:
            fs.remove_tree(staging)
            if isinstance(e, OSError) and not isinstance(e, CacheError):
                raise store_error(self.root, f"publish {key.describe()}", e) from None
            raise
        return Entry(final, meta)

    def copy_entry(self, key: KernelKey, source: Entry) -> Entry:
        """Publish a copy of ``source`` (a verified entry of another store) under ``key``, with
        its meta.json as it is; the copy is verified before it is renamed into place. The caller
        holds the key's lock."""
        staging = self.staging_dir(key)
        try:
            for name in source.meta["files"]:
                shutil.copyfile(source.file(name), os.path.join(staging, name))
            fs.atomic_write(os.path.join(staging, META), json.dumps(source.meta, indent=1, sort_keys=True),
                            fsync=True)
            entry = self._verify(staging, key.digest)
            fs.publish_dir(staging, self.entry_dir(key))
        except BaseException as e:
            fs.remove_tree(staging)
            if isinstance(e, OSError) and not isinstance(e, CacheError):
                raise store_error(self.root, f"copy {key.describe()}", e) from None
            raise
        return Entry(self.entry_dir(key), entry.meta)

    # -- housekeeping ----------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every entry that verifies (damaged ones are skipped; ``verify_all`` reports them)."""
        out = []
        for path in self._entry_dirs():
            try:
                out.append(self._verify(path, os.path.basename(path)))
            except CorruptEntry:
                continue
        return out

    def _entry_dirs(self) -> list[str]:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise CacheError(f"kernel cache {self.root} is a file, not a directory: remove it or set "
                             "MSLK_DSL_CACHE_DIR to a directory")
        out = []
        for target in _listdir(self.root):
            if target.startswith("."):
                continue
            tdir = os.path.join(self.root, target)
            for op in _listdir(tdir):
                odir = os.path.join(tdir, op)
                out.extend(os.path.join(odir, d) for d in _listdir(odir))
        return out

    def verify_all(self, repair: bool = False) -> list[tuple[str, str]]:
        """[(path, problem)] for every damaged entry and every stale leftover of a dead build;
        removed when ``repair``. Entries removed by another process meanwhile are not damage."""
        problems = []
        for path in self._entry_dirs():
            try:
                self._verify(path, os.path.basename(path))
            except CorruptEntry as e:
                if not os.path.isdir(path):
                    continue  # pruned or repaired by another process while we looked
                problems.append((path, str(e)))
                if repair and self.writable:
                    self._remove(path)
        for path, why in self.leftovers(stale_only=True):
            problems.append((path, why))
            if repair and self.writable:
                fs.remove_tree(path)
        return problems

    def leftovers(self, stale_only: bool = False) -> list[tuple[str, str]]:
        """Unfinished builds in ``.staging`` and half-removed trees in ``.trash``: [(path, why)].
        A staging directory is stale when no process holds its key's lock or it is over an hour
        old; with ``stale_only`` a build still in progress is not listed."""
        out = []
        for name in _listdir(self.root):  # e.g. manifest.json's temp file, if its writer was killed
            path = os.path.join(self.root, name)
            if fs.TEMP_MARK in name and _age(path) > STALE_TEMP_SECONDS:
                out.append((path, "temporary file left by a process that died"))
        for name in _listdir(os.path.join(self.root, TRASH)):
            out.append((os.path.join(self.root, TRASH, name), "left over from an interrupted removal"))
        staging_root = os.path.join(self.root, STAGING)
        for name in _listdir(staging_root):
            path = os.path.join(staging_root, name)
            age = _age(path)
            live = age < STALE_STAGING_SECONDS and fs.is_locked(self._lock_path(name.split("-")[0]))
            if not live:
                out.append((path, "unfinished build left by a process that died"))
            elif not stale_only:
                out.append((path, "build in progress"))
        return out

    def sweep(self) -> int:
        """Remove stale leftovers (see ``leftovers``); the number removed."""
        if not self.writable:
            return 0
        return sum(fs.remove_tree(path) for path, _ in self.leftovers(stale_only=True))

    def last_used(self, entry: Entry) -> float:
        try:
            return os.path.getmtime(os.path.join(entry.path, META))
        except FileNotFoundError:
            return 0.0  # removed meanwhile: the oldest there is

    def prune(self, max_bytes: int, keep: tuple[str, ...] = ()) -> list[Entry]:
        """Remove least-recently-used entries until the total size is within ``max_bytes``.

        Entries whose path is in ``keep`` (the one a caller just built or loaded) are never
        removed and count first. Stale build leftovers are swept too."""
        self.sweep()
        keep_paths = {os.path.abspath(p) for p in keep}
        entries = sorted(self.entries(), key=lambda e: (e.path in keep_paths, self.last_used(e)), reverse=True)
        removed, total = [], 0
        for e in entries:
            total += e.size
            if e.path in keep_paths:
                continue
            if total > max_bytes or removed:  # strict LRU: once over, every older entry goes
                if self._remove(e.path):
                    removed.append(e)
        return removed

    def clear(self) -> int:
        """Remove every entry and stale leftover. Locks stay, and so do builds in progress (their
        staging directories): a running build may hold one."""
        count = len(self._entry_dirs())
        for name in _listdir(self.root):
            if name not in (LOCKS, STAGING):
                fs.remove_tree(os.path.join(self.root, name))
        self.sweep()
        return count


def _age(path: str) -> float:
    """Seconds since ``path`` was modified (0 when it is gone: not stale, nothing to remove)."""
    try:
        return time.time() - os.path.getmtime(path)
    except FileNotFoundError:
        return 0.0


def _listdir(path: str) -> list[str]:
    """Sorted names in ``path``; empty when it is gone or not a directory (removed meanwhile)."""
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
