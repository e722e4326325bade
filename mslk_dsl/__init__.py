"""mslk-dsl: GPU kernels for transformer workloads, written as CuTe DSL and FlyDSL templates.

Importing this package registers every op as ``torch.ops.mslk_dsl.<name>`` (``mslk_dsl.ops``):
at once where torch is imported, else the moment torch is, so a process that only compiles
kernels (an AOT worker, a FlyDSL compile child) never pays for importing torch. It imports no
DSL compiler and starts no thread until an op is called (or ``mslk_dsl.ops.prefetch()`` is).
"""
import sys

__version__ = "0.1.0"

from mslk_dsl.errors import KernelNotPrebuiltError  # noqa: E402,F401


class _RegisterOpsAfterTorch:
    """A meta-path finder for the top-level ``torch`` module only: it lets the usual finders find
    it and, once its module has run, imports mslk_dsl.ops (which registers the torch ops)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once, and never in the way of torch's own imports
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.loader is not None:
            run_torch = spec.loader.exec_module

            def exec_module(module):
                run_torch(module)
                import mslk_dsl.ops  # noqa: F401

            spec.loader.exec_module = exec_module
        return spec


if "torch" in sys.modules:
    from mslk_dsl import ops  # noqa: E402,F401
else:
    sys.meta_path.insert(0, _RegisterOpsAfterTorch())
