"""Skip decorators with MSLK's semantics, for unittest and pytest alike.

Each decorator works on a test function or class (unittest skip), and as a module-level
``pytestmark`` (it carries a pytest mark). A CUDA-specific decorator (capability, CUDA version)
is transparent on ROCm, and a gfx one on CUDA: the test's own ``skipUnlessCuda`` /
``skipUnlessRocm`` decide there. Every skip carries a reason.
"""
from __future__ import annotations

import unittest
from collections.abc import Callable

from mslk_dsl import device


class SkipUnless:
    """Skips what it decorates unless ``condition()`` holds (evaluated when applied)."""

    def __init__(self, condition: Callable[[], bool], reason: str):
        self.condition = condition
        self.reason = reason

    def __call__(self, obj):
        return unittest.skipUnless(self.condition(), self.reason)(obj)

    @property
    def mark(self):
        """The pytest mark, so ``pytestmark = skipUnlessCuda`` works too."""
        import pytest

        return pytest.mark.skipif(not self.condition(), reason=self.reason).mark


skipUnlessCuda = SkipUnless(device.is_cuda, "needs an NVIDIA GPU (CUDA)")
skipUnlessRocm = SkipUnless(device.is_rocm, "needs an AMD GPU (ROCm)")
skipUnlessGpu = SkipUnless(lambda: device.is_cuda() or device.is_rocm(), "needs a CUDA or ROCm GPU")


def skipUnlessCudaCapability(capability: tuple[int, int]) -> SkipUnless:
    """Skip on CUDA devices below ``capability`` and where there is no GPU; ROCm passes through."""
    return SkipUnless(lambda: device.is_rocm() or device.compute_capability_at_least(capability),
                      f"needs CUDA compute capability >= {capability[0]}.{capability[1]}")


def skipUnlessCudaVersion(version: str) -> SkipUnless:
    """Skip where torch's CUDA is older than ``version``; ROCm passes through."""
    return SkipUnless(lambda: device.is_rocm() or device.cuda_version_at_least(version),
                      f"needs CUDA >= {version}")


def skipUnlessGfxArch(*archs: str) -> SkipUnless:
    """Skip unless the ROCm GPU is one of ``archs``; CUDA passes through (as MSLK does)."""
    return SkipUnless(lambda: device.is_cuda() or device.gfx_arch_in(*archs), f"needs an AMD GPU in {archs}")
