"""A compiled FlyDSL launcher as data: its call ABI recorded at compile time, and the callable
rebuilt from the artifact and that record at load time, without the template.

FlyDSL's compiled artifact (a pickled ``CompiledArtifact``: host code with the GPU code object
embedded) is called through a packed ``void **`` array: one slot per tensor data pointer, per
tensor's dynamic sizes and strides (a packed struct), per scalar and for the stream. Which slots
a launcher has is its ABI, the same one ``CompiledFunction.export_to_c`` writes into an exported
object's metadata. ``describe`` reads it in the compile child (from ``flyc.compile``'s result,
validated against the lowered entry); ``load`` unpickles the artifact and hands FlyDSL's own
``CompiledFunction`` the slot fills made from the record. Loading therefore builds no template,
reads no FlyDSL cache directory and sets no environment variable; the GPU code object is loaded
on the first call (FlyDSL's lazy runtime start), so loading itself touches no GPU.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import struct
from typing import Any

from mslk_dsl.errors import InputTypeError, UnsupportedError

# The scalar C types FlyDSL's export ABI names (flydsl/compiler/_aot.py, _leaf_semantic_slots).
_SCALAR_CTYPES = {"bool": ctypes.c_bool, "int8": ctypes.c_int8, "int16": ctypes.c_int16,
                  "int32": ctypes.c_int32, "int64": ctypes.c_int64, "uint8": ctypes.c_uint8,
                  "uint16": ctypes.c_uint16, "uint32": ctypes.c_uint32, "uint64": ctypes.c_uint64,
                  "float": ctypes.c_float, "double": ctypes.c_double}


def describe(launcher, args) -> dict:
    """The ABI of ``launcher`` compiled for ``args`` (already compiled into FlyDSL's cache by this
    process): {"backend", "params", "defaults", "slots"}. ``slots`` are FlyDSL's export ABI slots
    (kind, argument index, dynamic dims, sizes); ``defaults`` the values of the trailing
    parameters a caller may leave out (a stream left out is the default stream). ``launcher`` is a
    ``@flyc.jit`` function or an instance of a kernel class whose ``__call__`` is one (the
    instance is then bound as ``self``; FlyDSL's slots already count the arguments after it)."""
    import inspect

    import flydsl.compiler as flyc
    from flydsl.expr.typing import Stream

    bound = not hasattr(launcher, "func")   # a kernel-class instance, not a @flyc.jit function
    target = launcher.__call__ if bound else launcher
    jit_function: Any = type(launcher).__call__ if bound else launcher
    func = jit_function.func   # the undecorated launcher
    params = list(inspect.signature(func).parameters.values())[int(bound):]
    saved = os.environ.pop("COMPILE_ONLY", None)   # (this is the compile child's own environment)
    try:
        compiled = flyc.compile(target, *args)   # a cache hit: CPU placeholders run nothing
    finally:
        if saved is not None:
            os.environ["COMPILE_ONLY"] = saved
    slots = [slot._to_dict() for slot in compiled._get_aot_compiled()._abi]
    defaults = []
    for param in params:
        if param.default is inspect.Parameter.empty:
            defaults = []
            continue
        value = param.default
        if isinstance(value, Stream):
            value = value.value
        if value is not None and not isinstance(value, (bool, int, float)):
            raise InputTypeError(f"launcher parameter {param.name!r} has a default that cannot be recorded: {value!r}")
        defaults.append(value)
    return {"backend": compiled._backend, "params": len(params), "defaults": defaults, "slots": slots}


def slot_specs(slots: list[dict]) -> tuple:
    """FlyDSL's call spec, (argument index, C type, fill(argument, storage)) per slot, made from
    recorded ABI slots. The fills read torch tensors, Python scalars and streams directly."""
    specs = []
    for slot in slots:
        kind, index = slot["kind"], slot.get("arg_index")
        if slot.get("field") is not None:   # a field of a struct argument
            raise UnsupportedError(f"FlyDSL ABI slot {slot} (a struct field) is not supported by this loader")
        if kind == "stream" and index is None:   # no stream parameter: FlyDSL's NULL slot
            specs.append((-1, ctypes.c_void_p, None))
        elif kind == "stream":
            specs.append((index, ctypes.c_void_p, _fill_stream))
        elif kind in ("tensor_data", "pointer"):
            specs.append((index, ctypes.c_void_p, _fill_data if kind == "tensor_data" else _fill_pointer))
        elif kind == "tensor_layout":
            specs.append((index, *_layout_fill(slot)))
        elif kind == "scalar" and slot["ctype"] in _SCALAR_CTYPES and "encoding" not in slot:
            specs.append((index, _SCALAR_CTYPES[slot["ctype"]], _fill_scalar))
        else:
            raise UnsupportedError(f"FlyDSL ABI slot {slot} is not supported by this loader")
    return tuple(specs)


def _fill_data(a, s):
    s.value = a.data_ptr()


def _fill_pointer(a, s):
    s.value = int(a)


def _fill_scalar(a, s):
    s.value = a


def _fill_stream(a, s):
    s.value = 0 if a is None else a if isinstance(a, int) else a.cuda_stream


def _layout_fill(slot: dict):
    """The packed dynamic sizes then strides of one tensor (FlyDSL's _LayoutPlan contract: 32-bit
    sizes, 32- or 64-bit strides, no padding), as a straight-line fill."""
    shape_dims, stride_dims = slot["shape_dims"], slot["stride_dims"]
    size_code = {32: "i", 64: "q"}
    codec = struct.Struct("<" + size_code[slot.get("shape_bits", 32)] * len(shape_dims)
                          + size_code[slot.get("stride_bits", 64)] * len(stride_dims))
    if codec.size != slot["size"]:
        raise UnsupportedError(f"FlyDSL layout slot {slot} packs {codec.size} bytes, not {slot['size']}")
    terms = [f"a.shape[{d}]" for d in shape_dims] + [f"a.stride({d})" for d in stride_dims]
    namespace = {"pack": codec.pack_into}
    exec(f"def fill(a, s):\n    pack(s, 0, {', '.join(terms)})\n", namespace)
    return ctypes.c_byte * codec.size, namespace["fill"]


class LoadedKernel:
    """A FlyDSL kernel loaded from its artifact: called with the launcher's arguments (trailing
    defaults may be left out), it launches through FlyDSL's packed-argument dispatch."""
    __slots__ = ("compiled", "params", "defaults")

    def __init__(self, compiled, params: int, defaults: tuple):
        self.compiled, self.params, self.defaults = compiled, params, defaults

    def __call__(self, *args):
        missing = self.params - len(args)
        if missing > 0:
            if missing > len(self.defaults):
                raise InputTypeError(f"the kernel takes {self.params} arguments ({len(self.defaults)} with "
                                     f"defaults), got {len(args)}")
            args = (*args, *self.defaults[len(self.defaults) - missing:])
        return self.compiled(*args)


def load(artifact_path: str, abi: dict) -> LoadedKernel:
    """The callable kernel of a compiled artifact and its recorded ABI (see ``describe``)."""
    from flydsl.compiler import CompiledFunction

    with open(artifact_path, "rb") as f:
        artifact = pickle.load(f)   # flydsl's CompiledArtifact (IR text; no engine until called)
    compiled = CompiledFunction(None, artifact)   # as flyc.compile returns it for CPU arguments
    compiled._call_spec = slot_specs(abi["slots"])
    compiled._backend = abi["backend"]
    return LoadedKernel(compiled, abi["params"], tuple(abi["defaults"]))
