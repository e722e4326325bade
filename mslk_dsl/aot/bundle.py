"""Bundles: a kernel store directory (cache layout) plus ``manifest.json`` describing every entry.

A bundle is what an AOT build ships. It is served read-only (MSLK_DSL_AOT_PATH, the package's own
bundle, or an installed bundle wheel) and never written at run time.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import time
import warnings

import mslk_dsl
from mslk_dsl import fs, resources
from mslk_dsl.cache import STAGING, CorruptEntry, KernelCache, check_meta, sha256_of, store_error
from mslk_dsl.errors import DamagedEntryWarning, MslkDslError

MANIFEST = "manifest.json"


def write_bundle_manifest(root: str) -> dict:
    """Describe every verified entry under ``root`` in root/manifest.json (written atomically)."""
    store = KernelCache(root, writable=False)
    kernels = []
    for entry in store.entries():
        kernels.append({
            "digest": entry.meta["digest"],
            "path": os.path.relpath(entry.path, root),
            "key": entry.meta["key"],
            "files": entry.meta["files"],
            "toolchain": entry.meta.get("toolchain", {}),
            "build_host": entry.meta.get("build_host", ""),
            "built_at": entry.meta.get("built_at", ""),
            "resources": resources.summary(entry),
        })
    manifest = {
        "format": 1,
        "framework_version": mslk_dsl.__version__,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "created_on": f"{socket.gethostname()} ({platform.platform()})",
        "kernels": sorted(kernels, key=lambda k: k["path"]),
    }
    path = os.path.join(root, MANIFEST)
    try:
        fs.atomic_write(path, json.dumps(manifest, indent=1, sort_keys=True))
    except OSError as e:
        raise store_error(root, f"write {MANIFEST}", e, "choose (with --out) another,") from None
    return manifest


class BundleManifestError(MslkDslError, ValueError):
    """A bundle's manifest.json is missing or not of the bundle manifest's form."""


def read_bundle_manifest(root: str) -> dict:
    """The bundle's manifest: an object with a "kernels" list of objects; BundleManifestError (a
    ValueError naming the file and the fix) otherwise."""
    path = os.path.join(root, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError as e:
        raise BundleManifestError(f"{path} does not exist: {root} is not a bundle (build one with "
                                  "`mslk-dsl aot build --out DIR`)") from e
    except (OSError, ValueError) as e:
        raise BundleManifestError(f"{path}: cannot be read as JSON ({e}); rebuild the bundle") from e
    kernels = manifest.get("kernels", []) if isinstance(manifest, dict) else None
    if not isinstance(kernels, list) or not all(isinstance(k, dict) for k in kernels):
        raise BundleManifestError(f"{path} is not a bundle manifest (an object with a \"kernels\" list of "
                                  f"objects); rebuild the bundle (`mslk-dsl aot build --out {root}` or `aot merge`)")
    return manifest


def verify_bundle(root: str) -> list[str]:
    """Problems found (empty when the bundle is sound): every manifest entry must exist and match
    its sizes and sha256; entries the manifest does not list are reported too."""
    problems = []
    try:
        manifest = read_bundle_manifest(root)
    except (OSError, ValueError) as e:
        return [f"{MANIFEST}: unreadable ({e})"]
    listed = set()
    for record in manifest.get("kernels", []):
        try:
            path = os.path.join(root, record["path"])
            files, digest = dict(record["files"]), record["digest"]
            check_meta({"key": record["key"], "files": files})
        except (KeyError, TypeError, ValueError, CorruptEntry) as e:
            problems.append(f"{MANIFEST}: malformed kernel record {str(record)[:120]} ({e})")
            continue
        listed.add(os.path.normpath(path))
        for name, info in files.items():
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                problems.append(f"{record['path']}/{name}: missing")
            elif os.path.getsize(file) != info["size"]:
                problems.append(f"{record['path']}/{name}: size {os.path.getsize(file)} != {info['size']}")
            elif sha256_of(file) != info["sha256"]:
                problems.append(f"{record['path']}/{name}: sha256 mismatch")
        try:
            KernelCache(root, writable=False)._verify(path, digest)
        except CorruptEntry as e:
            problems.append(f"{record['path']}: {e}")
    for path in KernelCache(root, writable=False)._entry_dirs():
        if os.path.normpath(path) not in listed:
            problems.append(f"{os.path.relpath(path, root)}: not listed in {MANIFEST}")
    return sorted(set(problems))


def merge_bundles(out: str, sources: list[str], problems: list[str] | None = None) -> dict:
    """Copy every verified entry of ``sources`` into ``out`` and write the merged manifest. Shards
    of one build merge into exactly the unsharded bundle.

    A damaged entry is never copied: a good copy from another source wins, and one already in
    ``out`` is replaced by a good copy (or removed when no source has one), so the result always
    passes ``verify_bundle``. Each damaged entry is reported (warned, and appended to
    ``problems``)."""
    os.makedirs(out, exist_ok=True)
    dest_store = KernelCache(out, writable=True)
    found: set[str] = set()  # relative entry paths with a good copy in out
    damaged: dict[str, str] = {}  # relative entry path -> why (damaged where it was found)
    for root in [out, *sources]:
        store = KernelCache(root, writable=False)
        for path in store._entry_dirs():
            rel = os.path.relpath(path, root)
            try:
                entry = store._verify(path, os.path.basename(path))
            except CorruptEntry as e:
                damaged.setdefault(rel, f"{path}: {e}")
                continue
            if rel in found:
                continue
            dest = os.path.join(out, rel)
            if root != out:
                staging = os.path.join(out, STAGING, f"{os.path.basename(rel)}-{os.getpid()}-merge")
                fs.remove_tree(staging)
                shutil.copytree(entry.path, staging)
                fs.publish_dir(staging, dest)  # replaces a damaged copy already in out
            found.add(rel)
    for rel, why in sorted(damaged.items()):
        fate = ("a good copy from another source was used" if rel in found
                else "no source has a good copy; it is left out of the merged bundle")
        message = f"damaged entry {why}: {fate}"
        warnings.warn(f"mslk-dsl: {message}", DamagedEntryWarning, stacklevel=2)
        if problems is not None:
            problems.append(message)
        if rel not in found:
            fs.remove_tree(os.path.join(out, rel))
    dest_store.sweep()
    return write_bundle_manifest(out)
