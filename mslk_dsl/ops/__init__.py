"""The op layer: typed Python functions (the fast eager path) and ``torch.ops.mslk_dsl.*``.

Each op is one declaration (declaration.py) in the module of its family; declaring it registers
the torch op, and one call path (call.py) serves every op: launch plans for layouts seen before,
else validation (clear errors, nothing launched), the kernel for the device's target, and a launch
on the current stream. ``config=`` forces a config of the op's template (for kernel authors).
Importing ``mslk_dsl`` imports this module: every torch op exists after ``import mslk_dsl``.
"""
import importlib
import pkgutil
import sys
from typing import Any

import torch

from mslk_dsl.ops.declaration import declarations, eager_functions

# Each module of this package that declares ops registers them when imported
# (declaration.declare): importing every module here means a new op, or a new module of ops,
# needs no edit in this file.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
del _module

# ``mslk_dsl.ops.<op>`` is the op's eager function (this also rebinds a name shared by an op and
# its module, attention_decode, to the op).
globals().update(eager_functions())
__all__ = [*declarations(), "declarations", "prefetch", "traceable"]


def __getattr__(name: str) -> Any:
    """An op declared after this module was imported (a kernel author's own declaration)."""
    found = eager_functions().get(name)
    if found is None:
        raise AttributeError(f"module 'mslk_dsl.ops' has no attribute {name!r} (declared ops: "
                             f"{', '.join(declarations())})")
    return found


def traceable(name: str):
    """The op ``name`` for code that torch.compile may trace (the model-level APIs: attention,
    the MoE layer): its eager function when called eagerly (no dispatcher on the way), its torch op
    while torch.compile traces, so dynamo sees one opaque node per op rather than the eager call
    path (whose checks read pointers and whose launch plans live in C++)."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.mslk_dsl, name)
    return getattr(sys.modules[__name__], name)   # this module's attribute: mslk_dsl.ops.<name>


def prefetch() -> None:
    """Start loading what the first op call would otherwise wait for, in the background: on a
    CUDA build of torch, the CuTe kernel loader (mslk_dsl.backends.cute.prefetch_runtime) and the
    native launch path (mslk_dsl.native; built on first use). Call it at start-up to overlap
    that with loading a model; the first op call starts the native launcher's load anyway."""
    import torch

    from mslk_dsl import env, native

    if torch.version.cuda is not None and env.prefetch_enabled():
        from mslk_dsl.backends import cute

        cute.prefetch_runtime()
        native.load_in_background()
