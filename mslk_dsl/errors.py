"""Exceptions and warnings raised by mslk-dsl.

Every exception the project raises on purpose derives from ``MslkDslError``, so a caller (or the
command line) can catch them all in one place. Where an error was a built-in type before, it
stays one too (multiple inheritance), so existing ``except ValueError`` / ``except RuntimeError``
code keeps working. tests/test_errors.py fails on any ``raise`` of a bare built-in exception in
mslk_dsl/ or templates/.

Which one to raise:
- a caller passed a bad value (shape, size, alignment, device, range, unknown name): InputError;
  a value of the wrong Python type or tensor dtype: InputTypeError;
- a template config cannot serve the target, signature or problem: ConfigError;
- a request mslk-dsl has no implementation for: UnsupportedError (UnsupportedDeviceError for a
  device or GPU with no kernels);
- the others below name one place each (compiling, the cache, backends, template files).
"""
from __future__ import annotations


class MslkDslError(Exception):
    """Base of every error mslk-dsl raises on purpose. Its message says what went wrong, where,
    and how to fix it, in a form fit to print as one line without a traceback."""


class KernelNotPrebuiltError(MslkDslError, RuntimeError):
    """A kernel is in no bundle or cache, and compiling is not allowed here (JIT off, or CUDA
    graph capture in progress). The message names the key and the command that builds it."""


class KernelLaunchError(MslkDslError, RuntimeError):
    """A compiled kernel's call failed in the DSL runtime or the driver (an error left by an
    earlier launch such as an illegal address, a lost device). Inputs were checked before the
    call, so this is not a bad argument. The message names the op and carries the runtime's own
    error kind and text; the original exception is its ``__cause__`` on the Python path."""

    @classmethod
    def of(cls, op: str, error: BaseException) -> KernelLaunchError:
        return cls(f"{op}: the kernel call failed: {type(error).__name__}: {error}")


class CompileError(MslkDslError, RuntimeError):
    """The DSL compiler failed on a template config; the message carries the compiler's error."""


class InputError(MslkDslError, ValueError):
    """An op or public function got an argument it cannot take: a shape, size or alignment out of
    what the kernels support, tensors on different devices, a value out of range, or the name of
    an op, target, backend or signature part that does not exist. The message names the op (or
    function) and the argument."""


class InputTypeError(MslkDslError, TypeError):
    """An argument has the wrong Python type or tensor dtype (bf16 where FP8 is needed, a float
    where a bool is, a mask object of the wrong class). The message names the argument, what it
    got and what is supported."""


class ConfigError(MslkDslError, ValueError):
    """A template config is not usable: its values fail the template's checks, it does not serve
    the signature, target or problem it was asked for, or no config of that name exists. The
    message names the template (or op) and the config."""


class UnsupportedError(MslkDslError, NotImplementedError):
    """A well-formed request that mslk-dsl has no implementation for (a mask with no prefill
    kernel, tensor attention biases, a FlyDSL call-ABI slot this loader cannot pack)."""


class UnsupportedDeviceError(UnsupportedError, ValueError):
    """An op got tensors on a device it has no kernel for (CPU, or a GPU target with no template).
    Both a NotImplementedError (no implementation there) and a ValueError (bad input)."""


class BackendUnavailableError(MslkDslError, RuntimeError):
    """This process cannot load kernels of a backend (no ROCm for FlyDSL, no tvm_ffi or CuTe
    runtime library for CuTe). Not a damaged entry: the cache keeps it."""


class StateError(MslkDslError, RuntimeError):
    """An operation cannot go on in the state it found: a template changed between planning and
    building an AOT batch, no config of a tuning run could run, a layer asked to do what its
    present weights cannot."""


class TemplateImportError(MslkDslError, ImportError):
    """A template file cannot be loaded: importing it failed, a package it needs is missing, or
    its TEMPLATE(S) are not Template objects. The message names the file (or the package)."""


class UnknownTemplateError(MslkDslError, KeyError):
    """No template has the name asked for; the message lists the known names. A KeyError, as the
    name is a lookup key."""


class CacheError(MslkDslError, OSError):
    """A kernel store cannot be used as asked: the directory is a file, is read-only, or its disk
    is full. The message names the path and the fix (free space, or MSLK_DSL_CACHE_DIR)."""


class DamagedEntryWarning(UserWarning):
    """A cache or bundle entry failed its checks (missing or malformed meta.json, a size or sha256
    mismatch, an unloadable artifact). The cache removes and rebuilds it; a bundle skips it."""
