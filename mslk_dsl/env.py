"""Every environment variable mslk-dsl reads, in one place.

Values are read when asked for (not at import), so a test or a launcher script can set them
late. The README lists each variable; keep that table in sync with ``VARIABLES``.
"""
from __future__ import annotations

import contextlib
import os
import warnings

from mslk_dsl.errors import MslkDslError

# name -> one-line description (the README's table is generated from the same text).
VARIABLES = {
    "MSLK_DSL_CACHE_DIR": "writable kernel cache root (default: the platform's user cache dir / mslk-dsl)",
    "MSLK_DSL_AOT_PATH": "read-only AOT bundle directories, separated by os.pathsep, searched before the cache",
    "MSLK_DSL_DISABLE_JIT": "1: never compile; a kernel missing from bundles and cache raises KernelNotPrebuiltError",
    "MSLK_DSL_AOT_WORKERS": "worker processes for `mslk-dsl aot build` (default: CPU count)",
    "MSLK_DSL_LOG_LEVEL": "log level of the `mslk_dsl` logger (DEBUG, INFO, WARNING; default WARNING)",
    "MSLK_DSL_TEMPLATE_PATH": "extra template directories, separated by os.pathsep, discovered beside templates/",
    "MSLK_DSL_TARGET": "force the target name (e.g. sm90a) instead of detecting it from the device",
    "MSLK_DSL_CACHE_MAX_SIZE": "if set (e.g. 2G), prune the cache to this size after each compile",
    "MSLK_DSL_CUTE_RUNTIME_LIB": "path of libcute_dsl_runtime.so for loading CuTe artifacts (default: found in site-packages)",
    "MSLK_DSL_LLD": "ld.lld used to link FlyDSL code objects (default: /opt/rocm/llvm/bin/ld.lld, ld.lld on PATH, /usr/lib/llvm-*/bin/ld.lld)",
    "MSLK_DSL_KEEP_ISA": "1 (or a comma list of targets): keep the final ISA (kernel.s) beside FlyDSL artifacts (each compile ~1.4x as long)",
    "MSLK_DSL_NO_BUNDLED": "1: ignore bundles shipped inside the package and installed bundle wheels",
    "MSLK_DSL_NO_PREFETCH": "1: do not import the kernel loader (tvm_ffi) in a background thread when mslk_dsl.ops is imported",
    "MSLK_DSL_NO_NATIVE": "1: never build or use the native launch path (mslk_dsl/native); every call takes the Python path",
}

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class SettingError(MslkDslError, ValueError):
    """A setting (an environment variable, or a command-line value parsed here) has the wrong
    form; the message names the setting, the value found and the expected form."""


# Warnings already given in this process (each bad setting is reported once, not per call).
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def _get(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def aot_path_setting() -> str:
    """MSLK_DSL_AOT_PATH as set (the key under which the installed bundles' scan is cached)."""
    return _get("MSLK_DSL_AOT_PATH")


def cxx() -> str | None:
    """The C++ compiler named by CXX (the toolchain's variable, not one of mslk-dsl's settings),
    for the native launcher's build; None where unset."""
    return _get("CXX") or None


def _flag(name: str) -> bool:
    return _get(name).strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> str:
    explicit = _get("MSLK_DSL_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    import platformdirs

    return platformdirs.user_cache_dir("mslk-dsl", appauthor=False)


def aot_paths() -> list[str]:
    """MSLK_DSL_AOT_PATH's directories; one that does not exist is kept (it may appear later) and
    reported once, since a typo there otherwise only shows as kernels that are not found."""
    paths = [os.path.abspath(p) for p in _get("MSLK_DSL_AOT_PATH").split(os.pathsep) if p]
    for path in paths:
        if not os.path.isdir(path):
            _warn_once(f"mslk-dsl: MSLK_DSL_AOT_PATH names {path}, which is not a directory; "
                       "fix the path or remove it from MSLK_DSL_AOT_PATH")
    return paths


def describe_aot_path() -> str:
    """One line on where bundles were looked for, for a kernel that was not found: each
    MSLK_DSL_AOT_PATH entry, the missing ones marked."""
    paths = [os.path.abspath(p) for p in _get("MSLK_DSL_AOT_PATH").split(os.pathsep) if p]
    if not paths:
        return "MSLK_DSL_AOT_PATH is not set (no bundle directories besides the installed ones)"
    shown = [p if os.path.isdir(p) else f"{p} (does not exist)" for p in paths]
    return "bundle directories searched (MSLK_DSL_AOT_PATH): " + ", ".join(shown)


def no_native() -> bool:
    return _flag("MSLK_DSL_NO_NATIVE")


def jit_disabled() -> bool:
    return _flag("MSLK_DSL_DISABLE_JIT")


def aot_workers() -> int:
    value = _get("MSLK_DSL_AOT_WORKERS").strip()
    if not value:
        return os.cpu_count() or 1
    try:
        workers = int(value)
    except ValueError:
        workers = 0
    if workers < 1:
        raise SettingError(f"MSLK_DSL_AOT_WORKERS={value!r}: expected a positive whole number of worker "
                           "processes (e.g. MSLK_DSL_AOT_WORKERS=4); unset it to use one per CPU")
    return workers


def log_level() -> str:
    """MSLK_DSL_LOG_LEVEL, or WARNING (with one warning) when it names no level: a typo in a
    logging switch must not stop the package from importing."""
    value = _get("MSLK_DSL_LOG_LEVEL", "WARNING").strip().upper()
    if value not in LOG_LEVELS:
        _warn_once(f"mslk-dsl: MSLK_DSL_LOG_LEVEL={value!r} is not a log level; expected one of "
                   f"{', '.join(LOG_LEVELS)}; using WARNING")
        return "WARNING"
    return value


def template_paths() -> list[str]:
    return [os.path.abspath(p) for p in _get("MSLK_DSL_TEMPLATE_PATH").split(os.pathsep) if p]


def forced_target() -> str:
    return _get("MSLK_DSL_TARGET")


def cache_max_size() -> int | None:
    value = _get("MSLK_DSL_CACHE_MAX_SIZE")
    return parse_size(value, "MSLK_DSL_CACHE_MAX_SIZE") if value else None


def cute_runtime_lib() -> str:
    return _get("MSLK_DSL_CUTE_RUNTIME_LIB")


def lld() -> str:
    return _get("MSLK_DSL_LLD")


def keep_isa(target: str) -> bool:
    value = _get("MSLK_DSL_KEEP_ISA").strip().lower()
    return _flag("MSLK_DSL_KEEP_ISA") or target in value.split(",")


def prefetch_enabled() -> bool:
    return not _flag("MSLK_DSL_NO_PREFETCH")


def use_bundled() -> bool:
    return not _flag("MSLK_DSL_NO_BUNDLED")


def values_of(names) -> dict[str, str]:
    """The values of those of ``names`` that are set (the DSL variables a KernelKey records;
    keys.py says which)."""
    return {k: os.environ[k] for k in names if k in os.environ}


def parse_size(text: str, what: str = "size") -> int:
    """'512M', '2G', '1.5GiB', '4096' -> bytes; SettingError naming ``what`` otherwise."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        size = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        size = -1
    if size < 0:
        raise SettingError(f"{what} {text!r}: expected a size in bytes, optionally with a unit K, M, G or T "
                           "(e.g. 4096, 500M, 2G, 1.5GiB)")
    return size


@contextlib.contextmanager
def overridden(values: dict[str, str]):
    """Set ``values`` in the process environment for the ``with`` block, then put back what was
    there (or remove what was not). For a DSL that reads its settings from the environment; the
    caller serializes threads that could race on the same variables."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

