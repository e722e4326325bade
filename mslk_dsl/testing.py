"""Skip decorators with MSLK's semantics, for unittest and pytest alike.

A CUDA-specific decorator (capability, CUDA version) is transparent on ROCm: the test's own
``skipUnlessCuda`` / ``skipUnlessRocm`` decide there. Every skip carries a reason.
"""
from __future__ import annotations

import unittest

from mslk_dsl import device


def skipUnlessCuda(obj):
    return unittest.skipUnless(device.is_cuda(), "needs an NVIDIA GPU (CUDA)")(obj)


def skipUnlessRocm(obj):
    return unittest.skipUnless(device.is_rocm(), "needs an AMD GPU (ROCm)")(obj)


def skipUnlessGpu(obj):
    return unittest.skipUnless(device.is_cuda() or device.is_rocm(), "needs a CUDA or ROCm GPU")(obj)


def skipUnlessCudaCapability(capability: tuple[int, int]):
    """Skip on CUDA devices below ``capability``; no GPU skips; ROCm passes through."""
    def decorate(obj):
        if device.is_rocm():
            return obj
        ok = device.compute_capability_at_least(capability)
        return unittest.skipUnless(ok, f"needs CUDA compute capability >= {capability[0]}.{capability[1]}")(obj)
    return decorate


def skipUnlessCudaVersion(version: str):
    """Skip where torch's CUDA is older than ``version``; ROCm passes through."""
    def decorate(obj):
        if device.is_rocm():
            return obj
        return unittest.skipUnless(device.cuda_version_at_least(version), f"needs CUDA >= {version}")(obj)
    return decorate


def skipUnlessGfxArch(*archs: str):
    """Skip unless the ROCm GPU is one of ``archs``; CUDA passes through (as MSLK does)."""
    def decorate(obj):
        if device.is_cuda():
            return obj
        return unittest.skipUnless(device.gfx_arch_in(*archs), f"needs an AMD GPU in {archs}")(obj)
    return decorate
