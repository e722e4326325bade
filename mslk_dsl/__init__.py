"""mslk-dsl: GPU kernels for transformer workloads, written as CuTe DSL and FlyDSL templates.

Importing this package registers every op as ``torch.ops.mslk_dsl.<name>`` (``mslk_dsl.ops``):
at once where torch is imported, else the moment torch is, so a process that only compiles
kernels (an AOT worker, a FlyDSL compile child) never pays for importing torch. It imports no
DSL compiler and starts no thread until an op is called (or ``mslk_dsl.ops.prefetch()`` is).
"""
import sys

__version__ = "0.1.0"

from mslk_dsl.errors import KernelNotPrebuiltError  # noqa: E402,F401


def _one_of_ours_is_importing() -> bool:
    """Whether a module of this package is half-imported (torch was imported from inside it):
    importing mslk_dsl.ops then would find that module incomplete."""
    return any(getattr(getattr(m, "__spec__", None), "_initializing", False)
               for name, m in list(sys.modules.items()) if name.startswith("mslk_dsl."))


def _register_on_first_use(torch) -> None:
    """Make ``torch.ops.mslk_dsl`` import mslk_dsl.ops (which registers every op) the first time
    an op is looked up in it."""
    from torch._ops import _OpNamespace

    class RegisteringNamespace(_OpNamespace):
        def __getattr__(self, name):
            if not name.startswith("__"):
                import mslk_dsl.ops  # noqa: F401
            return super().__getattr__(name)

    torch.ops.mslk_dsl = RegisteringNamespace("mslk_dsl")


class _RegisterOpsAfterTorch:
    """A meta-path finder for the top-level ``torch`` module only: it lets the usual finders find
    it and, once its module has run, registers the ops (at once, or on first use of
    ``torch.ops.mslk_dsl`` when torch was imported from inside one of this package's modules)."""

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
                if _one_of_ours_is_importing():
                    _register_on_first_use(module)
                else:
                    import mslk_dsl.ops  # noqa: F401

            spec.loader.exec_module = exec_module
        return spec


if "torch" in sys.modules:
    from mslk_dsl import ops  # noqa: E402,F401
else:
    sys.meta_path.insert(0, _RegisterOpsAfterTorch())
