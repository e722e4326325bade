"""The native launch path: a small C++ extension that repeats a validated call in one C call.

An op's first call with a given input layout takes the Python path (validation, kernel choice,
launch) and then ``remember``s the launch as a plan of the op's ``FastOp`` (launcher.cpp): the
inputs' layout, the outputs to allocate, which kernel argument is which input, output or held
tensor (a placeholder), and the TVM-FFI function. A later call with the same layout (same dtypes,
devices, shapes, strides and addresses modulo 16) is matched, allocated, launched on the current
stream and returned inside that one C call: the per-call host cost of a native torch op, where
the Python path pays for building a layout key, allocating through torch's Python API and the
TVM-FFI argument conversion.

The extension is compiled from launcher.cpp with the host C++ compiler on first use (~20-30 s,
mostly torch's headers) into ``<cache dir>/native/``, named by a hash of the source and the
Python, torch and tvm_ffi builds. The compile runs in a child process (``python -m
mslk_dsl.native``, its own session: it finishes for the next process even if this one exits),
watched by a daemon thread started when mslk_dsl.ops is imported or at the first call, which
loads the result; so no call waits for it and the build never holds this process's GIL.
`mslk-dsl native` builds it ahead (with JIT off, MSLK_DSL_DISABLE_JIT=1, nothing is compiled at
run time: only a prebuilt one is loaded). Where there is none (no compiler, no tvm_ffi,
MSLK_DSL_NO_NATIVE=1) every call takes the Python path, which is correct and about 1.5x
slower per call.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading

from mslk_dsl import env
from mslk_dsl.errors import BackendUnavailableError, StateError

log = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.cpp")

MISS = object()  # replaced by the extension's sentinel once it is loaded
_module = None
_failed = False
_fast_ops: dict = {}
_lock = threading.Lock()
_builder: threading.Thread | None = None
_bindings: list = []       # (op name, eager function's namespace, fallback): see bind()
_bind_lock = threading.Lock()
_bypassed = False
_value_positions: dict[str, tuple[int, ...]] = {}  # op -> its arguments whose values key its plans


def enabled() -> bool:
    return not env.no_native()


def library_path() -> str | None:
    """Where the compiled extension for this Python, torch, tvm_ffi and source lives (None: no
    tvm_ffi). Reads versions from package metadata: importing tvm_ffi here would cost ~60 ms."""
    try:
        tvm_ffi_version = importlib.metadata.version("apache-tvm-ffi")
    except importlib.metadata.PackageNotFoundError:
        return None
    with open(SOURCE, "rb") as f:
        source = f.read()
    import torch

    # It links libtorch (C++ ABI): one build per torch build as well.
    versions = f"|{sys.version}|{tvm_ffi_version}|{torch.__version__}|{torch._C._GLIBCXX_USE_CXX11_ABI}|{sys.platform}"
    tag = hashlib.sha256(source + versions.encode()).hexdigest()[:16]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return os.path.join(env.cache_dir(), "native", f"_launcher-{tag}{suffix}")


def build(path: str) -> None:
    """Compile launcher.cpp into ``path`` (atomically; concurrent builders compile once)."""
    import torch
    import tvm_ffi
    from torch.utils import cpp_extension

    from mslk_dsl import fs

    compiler = env.cxx() or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise BackendUnavailableError("the native launcher needs a C++ compiler: none found (set CXX)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with fs.lock(path + ".lock"):
        if os.path.exists(path):
            return
        lib_dirs = [os.path.dirname(tvm_ffi.libinfo.find_libtvm_ffi()), *cpp_extension.library_paths()]
        with fs.replacing(path) as tmp:
            cmd = [compiler, "-O2", "-std=c++17", "-w", "-shared", "-fPIC", SOURCE, "-o", tmp,
                   f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                   "-I" + sysconfig.get_paths()["include"], "-I" + tvm_ffi.libinfo.find_include_path(),
                   *("-I" + d for d in cpp_extension.include_paths()),
                   *("-L" + d for d in lib_dirs), *("-Wl,-rpath," + d for d in lib_dirs),
                   "-ltvm_ffi", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
            if torch.version.cuda is not None:  # outputs allocated through libtorch_cuda directly
                cmd += ["-DMSLK_WITH_CUDA", "-ltorch_cuda"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise BackendUnavailableError(f"compiling the native launcher failed:\n{' '.join(cmd)}\n"
                                              f"{result.stderr[-4000:]}")


def _build_in_child(path: str) -> None:
    """build(path) in a child process of its own session, logging to ``path``.log."""
    with open(path + ".log", "w") as log:
        child = subprocess.Popen([sys.executable, "-m", "mslk_dsl.native"], stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    if child.wait() != 0 or not os.path.exists(path):
        raise BackendUnavailableError(f"building the native launcher failed (log: {path}.log)")


def _load(path: str):
    spec = importlib.util.spec_from_file_location("mslk_dsl._launcher", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(wait: bool = True):
    """The extension module, building it first if needed; None if it cannot be had here."""
    global _module, _failed, MISS
    if _module is not None or _failed or not enabled():
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        try:
            import torch

            if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
                raise BackendUnavailableError(f"torch {torch.__version__} has no DLPack C exchange API")
            path = library_path()
            if path is None:
                raise BackendUnavailableError("tvm_ffi is not installed")
            if not os.path.exists(path):
                if env.jit_disabled():   # JIT off compiles nothing: `mslk-dsl native` builds it ahead
                    raise BackendUnavailableError(f"JIT is off and {path} is not built (run `mslk-dsl native`)")
                if not wait:
                    return None
                os.makedirs(os.path.dirname(path), exist_ok=True)
                _build_in_child(path)
            module = _load(path)
        except Exception as e:  # noqa: BLE001 - any failure leaves the (correct) Python path
            _failed = True
            log.info("mslk-dsl: native launch path unavailable, using the Python path: %s", e)
            return None
        MISS = module.MISS
        _module = module
    _rebind_all()
    return module


def load_in_background() -> None:
    """Load (building first if needed) the extension in a daemon thread: compiling must not delay
    the caller; calls take the Python path until it is there."""
    global _builder
    if _module is not None or _failed or _builder is not None or not enabled():
        return
    # The thread imports nothing and only waits on the child's compile: nothing for an exiting
    # interpreter to wait for.
    _builder = threading.Thread(target=load, name="mslk-dsl-native", daemon=True)
    _builder.start()


def wait_until_loaded(timeout: float | None = None):
    """The extension once the background load is done (for tests and benchmarks)."""
    if _builder is not None:
        _builder.join(timeout)
    return load()


@functools.cache
def _serves_tvm_ffi_kernels() -> bool:
    """A CUDA build of torch: the kernels are CuTe's TVM-FFI functions (FlyDSL's on ROCm are not,
    and a CPU build runs no kernel), so only there is the launcher worth building."""
    import torch

    return torch.version.cuda is not None


def fast_op(name: str):
    """The FastOp holding ``name``'s launch plans, or None while the extension is not loaded
    (the first such call starts loading it in the background, if importing mslk_dsl.ops did not)
    or is bypassed."""
    if _bypassed:
        return None
    fast = _fast_ops.get(name)
    if fast is None and _module is None:
        if _builder is None and not _failed and _serves_tvm_ffi_kernels():
            load_in_background()
        return None
    if fast is None:
        import torch

        positions = _value_positions.get(name.removesuffix(".out"), ())
        fast = _fast_ops[name] = _module.FastOp(torch.Tensor.__dlpack_c_exchange_api__,
                                                (torch.Tensor, torch.nn.Parameter), positions,
                                                name.removesuffix(".out"))
    return fast


def key_by_values(name: str, positions: tuple[int, ...]) -> None:
    """Key ``name``'s plans (and its out= plans) by the values of the scalar arguments at
    ``positions`` too, not only by their types (the op's plan_values). Set before its first plan."""
    if _fast_ops.get(name) is not None and _value_positions.get(name) != tuple(positions):
        raise StateError(f"native plans of {name} exist already: key them by values before the first")
    _value_positions[name] = tuple(positions)


def _may_load() -> bool:
    return enabled() and not _failed and _serves_tvm_ffi_kernels()


def _miss(*args):
    """FAST_OUT of an eager function while no launcher serves it: every call misses."""
    return MISS


def bind(name: str, namespace: dict, fallback) -> None:
    """Give an eager function (its globals ``namespace``) the op's plans, as two names it calls:
    ``FAST(*inputs)`` returns a plan's result in one C call, or else ``fallback(*inputs)`` (the
    op's Python path); ``FAST_OUT(*inputs, *out)`` runs the ``<name>.out`` plan and returns None,
    or misses (anything else). Until the launcher is loaded, FAST is the fallback (its first call
    starts loading the launcher) and FAST_OUT misses; loading rebinds both."""
    with _bind_lock:
        _bindings.append((name, namespace, fallback))
        _bind(name, namespace, fallback)


def _bind(name: str, namespace: dict, fallback) -> None:
    if _module is not None and not _bypassed:
        namespace["FAST"] = fast_op(name).with_fallback(fallback)
        namespace["FAST_OUT"] = fast_op(name + ".out")
        return
    namespace["FAST_OUT"] = _miss
    if _bypassed or _builder is not None or not _may_load():
        namespace["FAST"] = fallback
        return

    def first_call(*inputs):   # start loading the launcher; the fallback serves until it is there
        with _bind_lock:
            if namespace.get("FAST") is first_call:   # (not yet rebound by a finished load)
                namespace["FAST"] = fallback
        load_in_background()
        return fallback(*inputs)

    namespace["FAST"] = first_call


def _rebind_all() -> None:
    with _bind_lock:
        for name, namespace, fallback in _bindings:
            _bind(name, namespace, fallback)


@contextlib.contextmanager
def bypassed():
    """Within this, eager calls take the Python path as if no launcher were loaded: no plan
    serves them and none is added (tests and benchmarks of that path)."""
    global _bypassed
    _bypassed = True
    _rebind_all()
    try:
        yield
    finally:
        _bypassed = False
        _rebind_all()


def remember(name: str, inputs: tuple, outputs: tuple, args: tuple, returns: tuple, kernel,
             held: tuple = (), written: tuple = (), constants: tuple = (), stream_bound: bool = False
             ) -> bool | None:
    """Add a launch plan to ``name``'s FastOp after a call validated and launched by Python:
    ``inputs`` as the op received them, ``outputs`` every tensor it allocated for the call (in
    the order ``returns`` indexes), ``args`` what the kernel was given, ``held`` the tensors the
    plan may keep and pass on every call (placeholders). Every tensor argument must be an input,
    an output or a view of one (same data pointer), or held; a scalar must be one of the inputs
    or, where ``constants`` indexes it, a value the plan holds (one that follows from the layout
    and the keyed values: declaration.Fixed). A call that copied an input (a layout the kernel
    cannot take), or whose inputs share memory, therefore adds no plan. ``written`` indexes the
    inputs the kernel writes (see remember_into). ``stream_bound``: the launch holds a buffer of
    the current stream (split-K counters), so the plan serves calls on that stream only.
    Returns whether a plan was added, or None while the launcher is not
    loaded but may still be (a caller that repeats the launch, like a cached Python plan, asks
    again only then)."""
    fast = fast_op(name)
    if fast is None:
        return None if not _bypassed and _may_load() else False
    if not hasattr(kernel, "__chandle__"):  # FlyDSL callables are not TVM-FFI functions
        return False
    import torch

    # The plan maps each kernel argument to an input or output by its data pointer, so inputs
    # that share memory (silu_mul(x, x)) would make that ambiguous for later, unaliased calls.
    input_pointers = [t.data_ptr() for t in inputs if isinstance(t, torch.Tensor)]
    if len(set(input_pointers)) != len(input_pointers):
        return False
    pointers = {*input_pointers, *(t.data_ptr() for t in outputs if isinstance(t, torch.Tensor))}
    for a, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            if not (arg.data_ptr() in pointers or any(arg is h for h in held)):
                return False
        elif a in constants:
            continue
        elif arg is None or not any(arg is i for i in inputs):
            return False
    return fast.add(tuple(inputs), tuple(outputs), tuple(args), tuple(returns), kernel, tuple(written),
                    tuple(constants), stream_bound)


def run_into(name: str, inputs: tuple, outs) -> bool:
    """Launch ``name``'s plan for a call that writes into the caller's output tensors ``outs``
    (a tuple, one per output; see remember_into). False when no plan matches or ``outs`` is not
    a tuple: the op takes its Python path (which raises for a bad ``out``)."""
    fast = fast_op(name + ".out")
    if fast is None or type(outs) is not tuple:
        return False
    return fast(*inputs, *outs) is None


def remember_into(name: str, inputs: tuple, out: tuple, args: tuple, kernel, held: tuple = (),
                  scratch: tuple = (), constants: tuple = (), stream_bound: bool = False) -> bool | None:
    """remember() for a call that wrote into the caller's ``out`` tensors instead of allocating:
    they are inputs of the plan that the kernel writes, so a later call in which one of them
    shares memory with another input misses. ``scratch``: tensors the op allocated for the
    kernel alone (allocated anew by every call, not returned)."""
    first = len(inputs)
    return remember(name + ".out", (*inputs, *out), scratch, args, (), kernel, held,
                    written=tuple(range(first, first + len(out))), constants=constants,
                    stream_bound=stream_bound)
