"""Every environment variable mslk-dsl reads, in one place.

Values are read when asked for (not at import), so a test or a launcher script can set them
late. The README lists each variable; keep that table in sync with ``VARIABLES``.
"""
from __future__ import annotations

import os

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
    "MSLK_DSL_KEEP_ISA": "1 (or a comma list of targets): keep the final ISA (kernel.s) beside FlyDSL artifacts (costs a second compile)",
    "MSLK_DSL_NO_BUNDLED": "1: ignore bundles shipped inside the package and installed bundle wheels",
    "MSLK_DSL_NO_PREFETCH": "1: do not import the kernel loader (tvm_ffi) in a background thread when mslk_dsl.ops is imported",
    "MSLK_DSL_NO_NATIVE": "1: never build or use the native launch path (mslk_dsl/native); every call takes the Python path",
}

# Environment variables of the DSLs that change generated code: their values are part of every
# KernelKey of that backend. Paths, logging and dump switches are left out on purpose.
CODEGEN_ENV = {
    "cute": ("CUTE_DSL_ARCH", "CUTE_DSL_OPT_LEVEL", "CUTE_DSL_ENABLE_TVM_FFI", "CUTE_DSL_LINEINFO",
             "CUTE_DSL_DISABLE_FAST_MATH"),
    "flydsl": ("FLYDSL_COMPILE_OPT_LEVEL", "FLYDSL_COMPILE_FLAGS"),
}


def _get(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def _flag(name: str) -> bool:
    return _get(name).strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> str:
    explicit = _get("MSLK_DSL_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    import platformdirs

    return platformdirs.user_cache_dir("mslk-dsl", appauthor=False)


def aot_paths() -> list[str]:
    return [os.path.abspath(p) for p in _get("MSLK_DSL_AOT_PATH").split(os.pathsep) if p]


def no_native() -> bool:
    return _flag("MSLK_DSL_NO_NATIVE")


def jit_disabled() -> bool:
    return _flag("MSLK_DSL_DISABLE_JIT")


def aot_workers() -> int:
    value = _get("MSLK_DSL_AOT_WORKERS")
    return int(value) if value else (os.cpu_count() or 1)


def log_level() -> str:
    return _get("MSLK_DSL_LOG_LEVEL", "WARNING").upper()


def template_paths() -> list[str]:
    return [os.path.abspath(p) for p in _get("MSLK_DSL_TEMPLATE_PATH").split(os.pathsep) if p]


def forced_target() -> str:
    return _get("MSLK_DSL_TARGET")


def cache_max_size() -> int | None:
    value = _get("MSLK_DSL_CACHE_MAX_SIZE")
    return parse_size(value) if value else None


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


def codegen_env(backend: str) -> dict[str, str]:
    return {k: os.environ[k] for k in CODEGEN_ENV.get(backend, ()) if k in os.environ}


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GiB', '4096' -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)
