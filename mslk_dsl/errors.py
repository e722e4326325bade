"""Exceptions raised by mslk-dsl."""


class MslkDslError(Exception):
    """Base of the errors mslk-dsl raises on purpose: the message says what is wrong and how to
    fix it, so the command line prints it as one line."""


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
