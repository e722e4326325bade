"""Exceptions and warnings raised by mslk-dsl.

Every exception the project raises on purpose derives from ``MslkDslError``, so a caller (or the
command line) can catch them all in one place. Where an error was a built-in type before, it
stays one too (multiple inheritance), so existing ``except RuntimeError`` code keeps working.
"""


class MslkDslError(Exception):
    """Base of every error mslk-dsl raises on purpose. Its message says what went wrong, where,
    and how to fix it, in a form fit to print as one line without a traceback."""


class KernelNotPrebuiltError(MslkDslError, RuntimeError):
    """A kernel is in no bundle or cache, and compiling is not allowed here (JIT off, or CUDA
    graph capture in progress). The message names the key and the command that builds it."""


class CompileError(MslkDslError, RuntimeError):
    """The DSL compiler failed on a template config; the message carries the compiler's error."""


class UnsupportedDeviceError(MslkDslError, NotImplementedError, ValueError):
    """An op got tensors on a device it has no kernel for (CPU, or a GPU target with no template).
    Both a NotImplementedError (no implementation there) and a ValueError (bad input)."""


class BackendUnavailableError(MslkDslError, RuntimeError):
    """This process cannot load kernels of a backend (no ROCm for FlyDSL, no tvm_ffi or CuTe
    runtime library for CuTe). Not a damaged entry: the cache keeps it."""


class CacheError(MslkDslError, OSError):
    """A kernel store cannot be used as asked: the directory is a file, is read-only, or its disk
    is full. The message names the path and the fix (free space, or MSLK_DSL_CACHE_DIR)."""


class DamagedEntryWarning(UserWarning):
    """A cache or bundle entry failed its checks (missing or malformed meta.json, a size or sha256
    mismatch, an unloadable artifact). The cache removes and rebuilds it; a bundle skips it."""
