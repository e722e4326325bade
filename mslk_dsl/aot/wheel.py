"""``mslk-dsl aot package``: turn a bundle into an installable, pure-data wheel.

The wheel holds one top-level package ``mslk_dsl_bundle_<name>`` whose folder is the bundle, and
an entry point in the ``mslk_dsl.bundles`` group pointing at it; the runtime serves every installed
bundle read-only with no environment variable. Wheels of different names install side by side.
The zip is written directly (a wheel is a zip with dist-info), with fixed timestamps so the same
bundle gives the same wheel.
"""
from __future__ import annotations

import base64
import hashlib
import os
import re
import zipfile

from mslk_dsl import fs
from mslk_dsl.aot.bundle import verify_bundle
from mslk_dsl.errors import InputError

_EPOCH = (2020, 1, 1, 0, 0, 0)


def package_bundle(bundle: str, name: str, out_dir: str, version: str = "1.0.0") -> str:
    """Write ``mslk_dsl_bundle_<name>-<version>-py3-none-any.whl`` into out_dir; return its path."""
    problems = verify_bundle(bundle)
    if problems:
        raise InputError(f"bundle {bundle} does not verify: " + "; ".join(problems[:5]))
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise InputError(f"bundle name {name!r}: use lowercase letters, digits and underscores")
    package = f"mslk_dsl_bundle_{name}"
    dist = package
    dist_info = f"{dist}-{version}.dist-info"
    files: dict[str, bytes] = {
        f"{package}/__init__.py": b'"""A prebuilt mslk-dsl kernel bundle; its folder is the bundle."""\n',
    }
    for dirpath, _, names in os.walk(bundle):
        for n in sorted(names):
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, bundle)
            if rel.startswith(".") or "/." in rel or fs.TEMP_MARK in n:
                continue  # locks, staging, a killed writer's temp file
            with open(p, "rb") as f:
                files[f"{package}/{rel}"] = f.read()
    files[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
        f"Summary: Prebuilt mslk-dsl kernels ({name})\nRequires-Dist: mslk-dsl\n").encode()
    files[f"{dist_info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: mslk-dsl\nRoot-Is-Purelib: true\n"
                                   b"Tag: py3-none-any\n")
    files[f"{dist_info}/entry_points.txt"] = f"[mslk_dsl.bundles]\n{name} = {package}\n".encode()
    record = [f"{path},sha256={_b64(hashlib.sha256(data).digest())},{len(data)}"
              for path, data in sorted(files.items())]
    files[f"{dist_info}/RECORD"] = ("\n".join(record + [f"{dist_info}/RECORD,,"]) + "\n").encode()
    os.makedirs(out_dir, exist_ok=True)
    wheel = os.path.join(out_dir, f"{dist}-{version}-py3-none-any.whl")
    with fs.replacing(wheel) as tmp, zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for path, data in sorted(files.items()):
            info = zipfile.ZipInfo(path, date_time=_EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return wheel


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
