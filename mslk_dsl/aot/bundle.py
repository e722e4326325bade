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

import mslk_dsl
from mslk_dsl import resources
from mslk_dsl.cache import CorruptEntry, KernelCache, sha256_of

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
    tmp = os.path.join(root, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(root, MANIFEST))
    return manifest


def read_bundle_manifest(root: str) -> dict:
    with open(os.path.join(root, MANIFEST)) as f:
        return json.load(f)


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
        path = os.path.join(root, record["path"])
        listed.add(os.path.normpath(path))
        for name, info in record["files"].items():
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                problems.append(f"{record['path']}/{name}: missing")
            elif os.path.getsize(file) != info["size"]:
                problems.append(f"{record['path']}/{name}: size {os.path.getsize(file)} != {info['size']}")
            elif sha256_of(file) != info["sha256"]:
                problems.append(f"{record['path']}/{name}: sha256 mismatch")
        try:
            KernelCache(root, writable=False)._verify(path, record["digest"])
        except CorruptEntry as e:
            problems.append(f"{record['path']}: {e}")
    for path in KernelCache(root, writable=False)._entry_dirs():
        if os.path.normpath(path) not in listed:
            problems.append(f"{os.path.relpath(path, root)}: not listed in {MANIFEST}")
    return sorted(set(problems))


def merge_bundles(out: str, sources: list[str]) -> dict:
    """Copy every verified entry of ``sources`` into ``out`` (existing entries are kept) and write
    the merged manifest. Shards of one build merge into exactly the unsharded bundle."""
    os.makedirs(out, exist_ok=True)
    for source in sources:
        for entry in KernelCache(source, writable=False).entries():
            dest = os.path.join(out, os.path.relpath(entry.path, source))
            if os.path.exists(os.path.join(dest, "meta.json")):
                continue
            staging = dest + ".merging"
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(entry.path, staging)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.rename(staging, dest)
    return write_bundle_manifest(out)
