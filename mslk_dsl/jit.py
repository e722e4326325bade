"""From a KernelKey to a callable kernel: memo -> read-only bundles -> disk cache -> compile.

The whole lifecycle is ``get_kernel``: look in memory, then in each read-only layer, then in the
writable cache; if the kernel is nowhere, ``build_and_load``: refuse when compiling is not
allowed, else take the key's file lock, look once more (another process may have built it while
we waited), compile into a staging directory, publish, and load. A damaged or unloadable entry is
removed and rebuilt. This module is the only one that builds: the AOT runner hands its batches to
``build_batch``.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from importlib import metadata

from mslk_dsl import env, fs
from mslk_dsl.backends import get_backend
from mslk_dsl.cache import CorruptEntry, Entry, KernelCache, check_meta, disk_full_error, is_disk_full
from mslk_dsl.errors import BackendUnavailableError, KernelNotPrebuiltError
from mslk_dsl.keys import KernelKey, diff_parts
from mslk_dsl.targets import Target, get_target
from mslk_dsl.template import Template

log = logging.getLogger(__name__)


def _show_logs_if_asked() -> None:
    """MSLK_DSL_LOG_LEVEL below WARNING (INFO, DEBUG) shows mslk-dsl's log lines on stderr. Only
    then is a handler added: by default a program's own logging set-up decides, and warnings
    about damaged entries reach users through ``warnings``."""
    level = logging.getLevelName(env.log_level())
    package_log = logging.getLogger("mslk_dsl")
    if isinstance(level, int) and level < logging.WARNING and not package_log.handlers:
        package_log.addHandler(logging.StreamHandler())
        package_log.setLevel(level)


_show_logs_if_asked()

# What happened in this process: compiles, loads from bundles / cache, memo hits. Tests and
# `mslk-dsl` report it; it is the only global state besides the memo.
stats: Counter = Counter()

_memo: dict[KernelKey, object] = {}
_build_lock = threading.Lock()
_jit_off = threading.local()


# -- where kernels live -------------------------------------------------------------------------
def cache() -> KernelCache:
    return KernelCache(env.cache_dir(), writable=True)


def bundle_layers() -> list[KernelCache]:
    """Read-only layers, searched in order: MSLK_DSL_AOT_PATH, then bundles shipped in the
    package and in installed bundle wheels (entry point group ``mslk_dsl.bundles``)."""
    return list(_bundle_layers())


def _layers():
    """Every layer in search order: the bundles, then the writable cache."""
    yield from _bundle_layers()
    yield cache()


def _bundle_layers():
    # Lazily: finding the bundle wheels scans every installed distribution, which a kernel
    # found in MSLK_DSL_AOT_PATH or in the package's own bundle never needs.
    aot_path, use_bundled = env.aot_path_setting(), env.use_bundled()
    local = _local_bundle_roots(use_bundled)
    for root in local:
        yield KernelCache(root, writable=False)
    for root in _bundle_roots(aot_path, use_bundled):
        if root not in local:
            yield KernelCache(root, writable=False)


def _local_bundle_roots(use_bundled: bool) -> tuple[str, ...]:
    """MSLK_DSL_AOT_PATH's directories, then the bundle shipped in the package."""
    roots = list(env.aot_paths())
    if use_bundled:
        shipped = os.path.join(os.path.dirname(__file__), "bundle")
        if os.path.isdir(shipped):
            roots.append(shipped)
    return tuple(dict.fromkeys(roots))


@functools.cache
def _bundle_roots(aot_path: str, use_bundled: bool) -> tuple[str, ...]:
    """Every bundle root: the local ones, then the installed bundle wheels' (cached per value of
    MSLK_DSL_AOT_PATH, which ``aot_path`` is)."""
    roots = list(_local_bundle_roots(use_bundled))
    if use_bundled:
        for ep in _bundle_entry_points():
            try:
                module = ep.load()
                roots.append(os.path.dirname(module.__file__))
            except Exception as e:  # a broken bundle wheel must not break serving the others
                log.warning("mslk-dsl: cannot load bundle %s: %s", ep.name, e)
    return tuple(dict.fromkeys(roots))


def _bundle_entry_points() -> list:
    """The installed bundle wheels' entry points. ``entry_points()`` parses the entry points of
    every installed distribution (milliseconds); most environments have no bundle wheel, and
    a distribution's file can only declare the group if it names it, so look for the name
    first."""
    if not any("mslk_dsl.bundles" in (dist.read_text("entry_points.txt") or "")
               for dist in metadata.distributions()):
        return []
    return list(metadata.entry_points(group="mslk_dsl.bundles"))


# -- JIT on / off ---------------------------------------------------------------------------------
def jit_allowed() -> bool:
    return not (env.jit_disabled() or getattr(_jit_off, "depth", 0))


@contextlib.contextmanager
def jit_disabled():
    """Within this block a kernel that is not prebuilt or cached raises KernelNotPrebuiltError
    instead of compiling (wrap CUDA-graph capture in it, after a warm-up run)."""
    _jit_off.depth = getattr(_jit_off, "depth", 0) + 1
    try:
        yield
    finally:
        _jit_off.depth -= 1


def _capturing() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:  # a process that never imported torch captures no CUDA graph
        return False
    try:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:
        return False


# -- the lifecycle ----------------------------------------------------------------------------------
def get_kernel(template: Template, config: dict, target: Target | str, signature: dict):
    """The kernel for (template, config, target, signature): from memory, a bundle or the cache,
    else compiled now (``build_and_load``)."""
    target = get_target(target) if isinstance(target, str) else target
    key = KernelKey.make(template, config, target.name, signature)
    kernel = _memo.get(key)
    if kernel is not None:
        stats["memo"] += 1
        return kernel
    kernel = _load_existing(key) or build_and_load(key, template, target)
    _memo[key] = kernel
    return kernel


def load_prebuilt(key: KernelKey):
    """Load a kernel by key from the bundles or the cache; never compiles (no template needed)."""
    kernel = _memo.get(key) or _load_existing(key)
    if kernel is None:
        raise KernelNotPrebuiltError(not_prebuilt_message(key))
    _memo[key] = kernel
    return kernel


def find_entry(key: KernelKey) -> tuple[KernelCache, Entry] | None:
    """The first layer holding a verified entry for ``key`` (bundles first, then the cache)."""
    for layer in _layers():
        entry = layer.lookup(key)
        if entry is not None:
            return layer, entry
    return None


def _load_existing(key: KernelKey):
    """Look in each layer in order; load the first entry that verifies and loads."""
    for layer in _layers():
        entry = layer.lookup(key)
        if entry is None:
            continue
        kernel = _try_load(layer, entry, key)
        if kernel is not None:
            stats["bundle" if not layer.writable else "disk"] += 1
            layer.touch(entry)
            return kernel
    return None


def _try_load(layer: KernelCache, entry: Entry, key: KernelKey):
    try:
        return get_backend(key.backend).load(entry)
    except BackendUnavailableError:
        raise
    except Exception as e:
        layer.discard(entry.path, f"cannot be loaded: {type(e).__name__}: {e}")
        return None


def build_and_load(key: KernelKey, template: Template, target: Target):
    """The one build path: refuse when compiling is not allowed -> take the key's lock -> look
    again (another process may have built it while we waited) -> compile and publish -> load ->
    prune to MSLK_DSL_CACHE_MAX_SIZE, never removing the entry just loaded."""
    if not jit_allowed() or _capturing():
        raise KernelNotPrebuiltError(not_prebuilt_message(key, capturing=_capturing()))
    store = cache()
    with _build_lock, store.lock(key):
        entry = store.lookup(key)
        if entry is None:
            outcome = compile_and_publish(store, [(key, template, target)])[0]
            if isinstance(outcome, BaseException):
                raise outcome
            entry = outcome
        else:
            stats["disk"] += 1
        try:
            kernel = get_backend(key.backend).load(entry)
        except Exception as gone:
            if os.path.isdir(entry.path):
                raise
            # Another process's size-bounded prune removed the entry between its publish (or
            # lookup) and this load: build it again, still under the key's lock.
            outcome = compile_and_publish(store, [(key, template, target)])[0]
            if isinstance(outcome, BaseException):
                raise outcome from gone
            entry = outcome
            kernel = get_backend(key.backend).load(entry)
    limit = env.cache_max_size()
    if limit is not None:
        store.prune(limit, keep=(entry.path,))
    return kernel


def build_batch(store: KernelCache, jobs: list[tuple[KernelKey, Template, Target]]) -> list[tuple[object, bool]]:
    """Build several keys of one backend into ``store`` (the AOT runner's unit of work): take
    every key's lock in one order (no deadlock between workers) -> look again -> compile the
    missing ones together -> publish each. Returns per job (an Entry or the exception, whether
    this call compiled it): False for a key another process published while this one waited."""
    keys = {key.digest: key for key, _, _ in jobs}
    with contextlib.ExitStack() as held:
        for digest in sorted(keys):
            held.enter_context(store.lock(keys[digest]))
        found = {key.digest: (store.lookup(key), False) for key, _, _ in jobs}
        missing = [job for job in jobs if found[job[0].digest][0] is None]
        if missing:
            for (key, _, _), outcome in zip(missing, compile_and_publish(store, missing)):
                found[key.digest] = (outcome, True)
    return [found[key.digest] for key, _, _ in jobs]


def compile_and_publish(store: KernelCache, jobs: list[tuple[KernelKey, Template, Target]]) -> list:
    """Compile keys of one backend at once (the backend may share a compiler process among them)
    into staging directories and publish each; an Entry or the exception, per job. The caller
    holds the keys' locks. A failed job's staging directory is removed, whatever the failure."""
    backend = get_backend(jobs[0][0].backend)
    stagings: list[str] = []
    try:
        for key, _, _ in jobs:
            stagings.append(store.staging_dir(key))
        start = time.perf_counter()
        infos = backend.compile_many([(template, key.config, target, key.signature, staging)
                                      for (key, template, target), staging in zip(jobs, stagings)])
    except BaseException:
        for staging in stagings:
            fs.remove_tree(staging)
        raise
    seconds = (time.perf_counter() - start) / len(jobs)
    results: list = []
    for (key, _, _), staging, info in zip(jobs, stagings, infos):
        if isinstance(info, BaseException):
            fs.remove_tree(staging)
            results.append(disk_full_error(store.root, f"build {key.describe()}") if is_disk_full(info) else info)
            continue
        try:
            results.append(store.publish(key, staging, {**info, "compile_seconds": round(seconds, 3)}))
        except Exception as e:  # publish removed the staging directory
            results.append(e)
            continue
        stats["compile"] += 1
        log.info("mslk-dsl: compiled %s (%.2fs)", key.describe(), seconds)
    return results


# -- explaining misses ---------------------------------------------------------------------------------
def nearest_entry(key: KernelKey) -> tuple[str, Entry, dict] | None:
    """The existing entry of the same op (any target, any layer) whose key differs from ``key``
    in the fewest parts: (layer root, entry, {part: (wanted, found)})."""
    best = None
    for layer in _layers():
        for meta_path in glob.glob(os.path.join(glob.escape(layer.root), "*", key.op, "*", "meta.json")):
            try:
                with open(meta_path) as f:
                    meta = json.load(f)
                check_meta(meta)
            except (OSError, ValueError, CorruptEntry):
                continue  # unreadable or malformed: `cache verify` reports it
            parts = meta["key"]
            diff = diff_parts(key.parts(), parts)
            if best is None or len(diff) < len(best[2]):
                best = (layer.root, Entry(os.path.dirname(meta_path), {"key": parts}), diff)
    return best


def build_command(key: KernelKey) -> str:
    sig = " ".join(f"--sig {k}={v}" for k, v in key.signature.items())
    return (f"mslk-dsl aot build --op {key.op} --target {key.target} --config {key.config_name} "
            f"{sig} --out DIR")


def not_prebuilt_message(key: KernelKey, capturing: bool = False) -> str:
    """What a KernelNotPrebuiltError says: the key, why nothing was compiled, where bundles were
    looked for, and the fix: the build command, or, when the closest entry was built with other
    DSL packages, the package set to install (compiling would not help a serving install)."""
    from mslk_dsl import env
    from mslk_dsl.keys import package_set_difference

    why = ("a CUDA graph is being captured (run the op once before capture so it is loaded)"
           if capturing else "JIT compilation is disabled (MSLK_DSL_DISABLE_JIT=1 or mslk_dsl.jit_disabled())")
    lines = [f"kernel not prebuilt: {key.describe()} (backend {key.backend}, key {key.digest}); {why}.",
             env.describe_aot_path() + "."]
    near = nearest_entry(key)
    packages = ""
    if near is not None:
        _, entry, diff = near
        lines.append(f"Closest entry: {entry.path} differs in {', '.join(diff)}: "
                     + "; ".join(f"{k}: wanted {w!r}, found {f!r}" for k, (w, f) in diff.items()))
        if "dsl_versions" in diff:
            packages = package_set_difference(*diff["dsl_versions"])
        elif "framework_version" in diff:
            lines.append("The bundle was built with another mslk-dsl version; kernels are only served to "
                         "the version that built them. Rebuild the bundle with this one.")
    if packages:
        lines.append(packages[0].upper() + packages[1:] + ".")
    else:
        lines.append(f"Build it with: {build_command(key)}  and add DIR to MSLK_DSL_AOT_PATH.")
    return "\n".join(lines)
