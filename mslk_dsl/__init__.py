"""mslk-dsl: GPU kernels for transformer workloads, written as CuTe DSL and FlyDSL templates.

Importing this package is cheap: no DSL compiler is imported until a kernel has to be compiled.
"""
__version__ = "0.1.0"

from mslk_dsl.errors import KernelNotPrebuiltError  # noqa: E402
