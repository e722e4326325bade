"""The on-disk kernel store: one directory per KernelKey, ``<root>/<target>/<op>/<digest>/``.

An entry holds the artifact files and ``meta.json`` (the key's parts, each file's size and sha256,
toolchain versions, build time). It is published by building a staging directory and renaming it
into place, with meta.json written last inside it, so a reader sees a whole entry or none. A
per-key file lock makes concurrent processes compile a key once. The same class serves read-only
layers (AOT bundles): those are never written, locked or repaired.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass

from filelock import FileLock

from mslk_dsl.keys import KernelKey

log = logging.getLogger("mslk_dsl")

META = "meta.json"


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


class CorruptEntry(Exception):
    pass


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
        if digest is not None and meta.get("digest") != digest:
            raise CorruptEntry(f"meta.json names digest {meta.get('digest')!r}, not {digest!r}")
        for name, info in meta.get("files", {}).items():
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise CorruptEntry(f"artifact {name} is missing")
            size = os.path.getsize(file)
            if size != info["size"]:
                raise CorruptEntry(f"artifact {name} has {size} bytes, meta.json says {info['size']}")
            if sha256_of(file) != info["sha256"]:
                raise CorruptEntry(f"artifact {name} fails its sha256 check")
        if not meta.get("files"):
            raise CorruptEntry("meta.json lists no artifact")
        return Entry(path, meta)

    def discard(self, path: str, reason: str) -> None:
        """Drop a damaged entry so it is rebuilt (read-only layers are only warned about)."""
        if not self.writable:
            log.warning("mslk-dsl: ignoring damaged entry %s in read-only bundle: %s", path, reason)
            return
        log.warning("mslk-dsl: removing damaged cache entry %s (%s); it will be rebuilt", path, reason)
        self._remove(path)

    def _remove(self, path: str) -> None:
        # Rename first: a concurrent reader then sees no entry rather than half of one.
        trash = os.path.join(self.root, ".trash", uuid.uuid4().hex)
        os.makedirs(os.path.dirname(trash), exist_ok=True)
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def touch(self, entry: Entry) -> None:
        """Mark an entry used now (for LRU pruning)."""
        if self.writable:
            try:
                os.utime(os.path.join(entry.path, META))
            except OSError:
                pass

    # -- publish --------------------------------------------------------------------------------
    def lock(self, key: KernelKey) -> FileLock:
        os.makedirs(os.path.join(self.root, ".locks"), exist_ok=True)
        return FileLock(os.path.join(self.root, ".locks", f"{key.digest}.lock"))

    def staging_dir(self, key: KernelKey) -> str:
        path = os.path.join(self.root, ".staging", f"{key.digest}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(path)
        return path

    def publish(self, key: KernelKey, staging: str, info: dict) -> Entry:
        """Seal ``staging`` (hash its files, write meta.json last) and rename it into place."""
        assert self.writable, "cannot publish into a read-only layer"
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
        tmp = os.path.join(staging, META + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(staging, META))
        final = self.entry_dir(key)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        if os.path.exists(final):
            self._remove(final)  # a damaged leftover (callers hold the key's lock)
        os.rename(staging, final)
        return Entry(final, meta)

    # -- housekeeping ----------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every entry that verifies (damaged ones are reported and skipped)."""
        out = []
        for path in self._entry_dirs():
            try:
                out.append(self._verify(path, os.path.basename(path)))
            except CorruptEntry:
                continue
        return out

    def _entry_dirs(self) -> list[str]:
        out = []
        if not os.path.isdir(self.root):
            return out
        for target in sorted(os.listdir(self.root)):
            tdir = os.path.join(self.root, target)
            if target.startswith(".") or not os.path.isdir(tdir):
                continue
            for op in sorted(os.listdir(tdir)):
                odir = os.path.join(tdir, op)
                if os.path.isdir(odir):
                    out.extend(os.path.join(odir, d) for d in sorted(os.listdir(odir)))
        return out

    def verify_all(self, repair: bool = False) -> list[tuple[str, str]]:
        """[(entry path, problem)] for every damaged entry; removed when ``repair``."""
        problems = []
        for path in self._entry_dirs():
            try:
                self._verify(path, os.path.basename(path))
            except CorruptEntry as e:
                problems.append((path, str(e)))
                if repair and self.writable:
                    self._remove(path)
        return problems

    def last_used(self, entry: Entry) -> float:
        return os.path.getmtime(os.path.join(entry.path, META))

    def prune(self, max_bytes: int) -> list[Entry]:
        """Remove least-recently-used entries until the total size is within ``max_bytes``."""
        entries = sorted(self.entries(), key=self.last_used, reverse=True)
        removed, total = [], 0
        for e in entries:
            total += e.size
            if total > max_bytes or removed:  # strict LRU: once over, every older entry goes
                removed.append(e)
                self._remove(e.path)
        return removed

    def clear(self) -> int:
        count = len(self._entry_dirs())
        if os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name != ".locks":
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        return count
