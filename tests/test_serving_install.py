"""A serving install (the project + the [serve-cute] extra, no compiler metapackage) finds the
kernels of a bundle built by a compiling install ([cute]): both compute the same keys.

The serving environment is a fresh venv whose site-packages holds, as links to this install's
files, exactly the distributions that `pip install mslk-dsl[serve-cute]` resolves to (read from
the installed packages' requirements), so nothing of [cute] that [serve-cute] lacks is visible.
The bundle holds stand-in entries published under real keys: matching keys is what this proves
(loading a CuTe kernel needs a GPU; tests/gpu covers that).
"""
import json
import os
import re
import site
import subprocess
import sys
import venv
from importlib import metadata

import pytest
from packaging.requirements import Requirement

from mslk_dsl import registry
from mslk_dsl.aot.bundle import write_bundle_manifest
from mslk_dsl.cache import KernelCache
from mslk_dsl.keys import KernelKey

PROJECT = "mslk-dsl"
EXTRA = "serve-cute"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def serving_distributions() -> list[metadata.Distribution]:
    """The project and everything `pip install mslk-dsl[serve-cute]` pulls in, transitively."""
    found: dict[str, metadata.Distribution] = {}
    pending = [(PROJECT, EXTRA)]
    while pending:
        name, extra = pending.pop()
        if _canonical(name) in found:
            continue
        # Installed distributions only: a checkout's build leaves mslk_dsl.egg-info in the
        # working directory, which is on sys.path under pytest and would shadow the install.
        dist = next(iter(metadata.distributions(name=name, path=site.getsitepackages())), None)
        if dist is None:
            pytest.skip(f"{name} is not installed here, so the serving set cannot be assembled")
        found[_canonical(name)] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": extra or ""}):
                pending.append((req.name, ""))
    return list(found.values())


def make_serving_venv(root) -> str:
    """A venv with links to the serving distributions' top-level files; its python's path."""
    venv.EnvBuilder(with_pip=False).create(str(root))
    site = next(root.glob("lib/python*/site-packages"))
    for dist in serving_distributions():
        home = str(dist.locate_file(""))
        for top in sorted({str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}):
            source, link = os.path.join(home, top), site / top
            if top != "__pycache__" and os.path.exists(source) and not link.exists():
                link.symlink_to(source)
    return str(root / "bin" / "python")


SERVE = """
import json, sys
from importlib import metadata
from mslk_dsl import jit, registry
from mslk_dsl.keys import KernelKey
present = {}
for name in ("nvidia-cutlass-dsl", "flydsl"):
    try:
        present[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
t = registry.get_template("scale_copy_cute")
hits = []
for config in t.all_configs():
    for sig in t.all_signatures():
        key = KernelKey.make(t, config, "sm90a", sig)
        found = jit.find_entry(key)
        hits.append(found is not None and not found[0].writable)
print(json.dumps({"present": present, "hits": hits, "modules": sorted(m for m in ("cutlass", "flydsl") if m in sys.modules)}))
"""


def test_serving_install_hits_a_bundle_built_by_the_compiling_install(tmp_path):
    # The bundle, as the compiling install (this process) keys it.
    bundle = tmp_path / "bundle"
    store = KernelCache(str(bundle), writable=True)
    template = registry.get_template("scale_copy_cute")
    count = 0
    for config in template.all_configs():
        for sig in template.all_signatures():
            key = KernelKey.make(template, config, "sm90a", sig)
            staging = store.staging_dir(key)
            with open(os.path.join(staging, "kernel.so"), "wb") as f:
                f.write(b"stand-in")
            store.publish(key, staging, {"load": {"library": "kernel.so", "symbol": "mslk_scale_copy"}})
            count += 1
    write_bundle_manifest(str(bundle))

    python = make_serving_venv(tmp_path / "serve")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(MSLK_DSL_AOT_PATH=str(bundle), MSLK_DSL_CACHE_DIR=str(tmp_path / "empty-cache"),
               MSLK_DSL_DISABLE_JIT="1")
    done = subprocess.run([python, "-c", SERVE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["present"] == {}, "the serving venv must not hold the compiler metapackage or FlyDSL"
    assert result["modules"] == [], "serving must not import a DSL"
    assert result["hits"] == [True] * count, "the serving install computes other keys than the compiling one"


def test_the_serving_set_is_what_the_readme_says():
    """README's deployment section lists what [serve-cute] installs; keep it true."""
    names = {_canonical(d.metadata["Name"]) for d in serving_distributions()}
    assert {"apache-tvm-ffi", "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-base",
            "nvidia-cutlass-dsl-libs-core"} <= names
    assert "nvidia-cutlass-dsl" not in names and "flydsl" not in names
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    for name in ("apache-tvm-ffi", "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-base",
                 "nvidia-cutlass-dsl-libs-core"):
        assert name in readme, f"README does not say that [serve-cute] installs {name}"
    assert sys.version_info >= (3, 11)
