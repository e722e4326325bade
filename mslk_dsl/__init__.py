"""mslk-dsl: GPU kernels for transformer workloads, written as CuTe DSL and FlyDSL templates.

Importing this package registers every op as ``torch.ops.mslk_dsl.<name>`` and stays cheap: no
DSL compiler is imported until a kernel has to be compiled, and no thread is started until an
op is called (or ``mslk_dsl.ops.prefetch()`` is).
"""
__version__ = "0.1.0"

from mslk_dsl.errors import KernelNotPrebuiltError  # noqa: E402
from mslk_dsl import ops  # noqa: E402,F401  (declares and registers every op)
