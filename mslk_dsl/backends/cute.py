"""CuTe DSL backend: cross-compile with ``--gpu-arch``, TVM-FFI calling convention, export to an
object file, link a shared library, and load it with ``tvm_ffi`` alone.

Compiling imports ``cutlass`` (seconds); loading imports only ``tvm_ffi`` and preloads the CuTe
runtime library, so a process that serves prebuilt kernels never pays for the compiler.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import glob
import importlib.util
import os
import shutil
import subprocess
import threading
import warnings

from mslk_dsl import env, resources
from mslk_dsl.errors import BackendUnavailableError, CompileError

LIBRARY = "kernel.so"


def symbol_name(op: str) -> str:
    return f"mslk_{op}"


@functools.cache
def _compiler_runtime_libs() -> tuple[str, ...]:
    import cutlass.cute as cute

    libs = tuple(cute.runtime.find_runtime_libraries(enable_tvm_ffi=True))
    # Exporting a cross-compiled (engine-less) function resolves the host launch wrappers in this
    # process, so the runtime libraries must be loaded globally first.
    for path in libs:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return libs


# Notes the DSL emits as Python warnings on every compile of a kernel whose block size is a
# runtime value; they say nothing the kernel author can act on, and `aot build` printed one
# block per kernel among its progress lines.
BENIGN_DSL_WARNINGS = (r"Dynamic variable in block size .*, cannot auto-generate `nvvm\.reqntid`",)


@contextlib.contextmanager
def quiet_dsl_notes():
    """Drop the DSL's benign per-compile notes; every other warning and error passes through."""
    with warnings.catch_warnings():
        for pattern in BENIGN_DSL_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern)
        yield


def compile_options(dsl_arch: str, dump_dir: str) -> str:
    """cute.compile's options: the target, the codegen options every key records
    (keys.COMPILE_OPTIONS), and where to keep the PTX and cubin (not codegen)."""
    from mslk_dsl.keys import COMPILE_OPTIONS

    return " ".join(["--gpu-arch", dsl_arch, *COMPILE_OPTIONS["cute"], "--keep-ptx", "--keep-cubin",
                     "--dump-dir", dump_dir])


def compile(template, config, target, signature, out_dir) -> dict:
    import cutlass.cute as cute

    libs = _compiler_runtime_libs()
    launcher, args = template.build(dict(config), target.name, dict(signature))
    # Beside the staging directory and named after it, so the cache's sweep removes it with that
    # build's leftovers if this process is killed.
    dump = f"{os.path.normpath(out_dir)}-cute-dump"
    os.makedirs(dump)
    try:
        options = compile_options(target.dsl_arch, dump)
        try:
            with quiet_dsl_notes():
                compiled = cute.compile(launcher, *args, options=options)
        except Exception as e:  # the DSL raises many types; keep the message, name the config
            raise CompileError(f"CuTe DSL failed to compile {template.name} {config} for {target.name} "
                               f"{signature}: {type(e).__name__}: {e}") from e
        symbol = symbol_name(template.op)
        obj = os.path.join(dump, "kernel.o")
        compiled.export_to_c(obj, function_name=symbol)
        # Link by soname only (no rpath): the loader preloads the runtime libraries of whatever
        # installation serves the kernel, which need not be where it was built.
        lib_dirs = sorted({os.path.dirname(p) for p in libs})
        cmd = ["gcc", "-shared", "-o", os.path.join(out_dir, LIBRARY), obj,
               *[f"-L{d}" for d in lib_dirs], *[f"-l:{os.path.basename(p)}" for p in libs]]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise CompileError(f"linking {template.name} failed: {' '.join(cmd)}\n{done.stderr}")
        for pattern, name in (("*.ptx", "kernel.ptx"), ("*.cubin", "kernel.cubin")):
            found = sorted(glob.glob(os.path.join(dump, "**", pattern), recursive=True))
            if found:
                shutil.copyfile(found[-1], os.path.join(out_dir, name))
        report = resources.safe_report("cute", out_dir, str(getattr(compiled, "ir_module", "") or ""))
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    return {"load": {"library": LIBRARY, "symbol": symbol}, "resources": report}


def compile_many(items) -> list:
    """CuTe compiles in this process: one after the other, each failure kept apart."""
    results = []
    for item in items:
        try:
            results.append(compile(*item))
        except Exception as e:
            results.append(e)
    return results


@functools.cache
def _preload_runtime() -> None:
    """Load libcute_dsl_runtime.so globally so kernel libraries linked against it resolve."""
    path = env.cute_runtime_lib() or _find_runtime_lib()
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def _find_runtime_lib() -> str:
    # Found without importing cutlass: the library wheels install into the nvidia_cutlass_dsl
    # folder. Prefer the newest CUDA flavour installed, as the DSL itself does.
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for flavour in ("cu13", "cu12"):
        for root in roots:
            candidate = os.path.join(root, flavour, "lib", "libcute_dsl_runtime.so")
            if os.path.exists(candidate):
                return candidate
    raise BackendUnavailableError("libcute_dsl_runtime.so not found: install nvidia-cutlass-dsl-libs-cu12 or -cu13 "
                       "(pip install 'mslk-dsl[cute]'), or set MSLK_DSL_CUTE_RUNTIME_LIB")


_prefetch: threading.Thread | None = None


def prefetch_runtime() -> None:
    """Import tvm_ffi and load the CuTe runtime library in a background thread.

    The first kernel load pays for both (~50 ms on the H200 host, nearly all of it the tvm_ffi
    package import) unless they are done already; a program spends longer than that between
    importing the op layer and its first call (CUDA context, weights), so the thread is done by
    then. load() needs nothing from it: an ``import tvm_ffi`` that finds the thread's import in
    progress waits for it (Python's per-module import lock), and an error here is left for
    load() to report. Off with MSLK_DSL_NO_PREFETCH=1."""
    global _prefetch
    if _prefetch is not None or importlib.util.find_spec("tvm_ffi") is None:
        return

    def work():
        try:
            import tvm_ffi  # noqa: F401

            _preload_runtime()
        except Exception:
            pass

    _prefetch = threading.Thread(target=work, name="mslk-dsl-prefetch", daemon=True)
    _prefetch.start()
    # A process that exits at once must not tear the interpreter down under a running import.
    atexit.register(_prefetch.join, 5.0)


def load(entry):
    try:
        import tvm_ffi

        _preload_runtime()
    except (ImportError, OSError, RuntimeError) as e:
        raise BackendUnavailableError(f"cannot load CuTe kernels here: {e} (pip install 'mslk-dsl[serve-cute]')") from e
    info = entry.meta["load"]
    module = tvm_ffi.load_module(entry.file(info["library"]))
    function = module[info["symbol"]]
    _MODULES.append(module)
    return function


# Loaded libraries stay mapped for the life of the process (functions reference their code).
_MODULES: list = []
