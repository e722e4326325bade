"""What GPU a process (or a tensor) is on, and its Target.

Mirrors MSLK's device helpers. Every query is cheap after the first call per device.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from mslk_dsl import env
from mslk_dsl.errors import UnsupportedDeviceError
from mslk_dsl.targets import Target, get_target, target_for_cuda_capability, target_for_gfx


def is_cuda() -> bool:
    """An NVIDIA GPU is usable (a ROCm build of torch also answers torch.cuda, so check hip)."""
    return torch.cuda.is_available() and torch.version.hip is None


def is_rocm() -> bool:
    return torch.cuda.is_available() and torch.version.hip is not None


def compute_capability(device: int | None = None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if is_cuda() else (0, 0)


def compute_capability_in(*capabilities: tuple[int, int]) -> bool:
    return is_cuda() and compute_capability() in capabilities


def compute_capability_at_least(capability: tuple[int, int]) -> bool:
    return is_cuda() and compute_capability() >= tuple(capability)


def cuda_version_at_least(version: str) -> bool:
    if not is_cuda() or torch.version.cuda is None:
        return False
    return _version_tuple(torch.version.cuda) >= _version_tuple(version)


def get_gfx_arch_name(device: int | None = None) -> str:
    """'gfx942' on an MI300X; '' where there is no ROCm GPU."""
    if not is_rocm():
        return ""
    return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]


def gfx_arch_in(*archs: str) -> bool:
    return get_gfx_arch_name() in archs


def is_gfx942() -> bool:
    return gfx_arch_in("gfx942")


def is_gfx950() -> bool:
    return gfx_arch_in("gfx950")


def supports_float8_fnuz() -> bool:
    """gfx942 uses the fnuz FP8 flavour; NVIDIA and gfx950 use the OCP e4m3fn flavour."""
    return is_gfx942()


@functools.cache
def _target_of_index(index: int) -> Target:
    if is_rocm():
        return target_for_gfx(torch.cuda.get_device_properties(index).gcnArchName)
    return target_for_cuda_capability(*torch.cuda.get_device_capability(index))


def target_of(device: torch.device) -> Target:
    """The Target for a tensor's device; UnsupportedDeviceError (a NotImplementedError) for devices with no
    GPU target."""
    forced = env.forced_target()
    if forced:
        return get_target(forced)
    if device.type != "cuda":
        raise UnsupportedDeviceError(f"mslk-dsl kernels run on CUDA or ROCm GPUs, not on {device.type!r}")
    return _target_of_index(device.index if device.index is not None else torch.cuda.current_device())


def current_target() -> Target | None:
    """The Target of the current GPU, or None where there is no GPU."""
    forced = env.forced_target()
    if forced:
        return get_target(forced)
    if not torch.cuda.is_available():
        return None
    return _target_of_index(torch.cuda.current_device())


# CUdevice_attribute values (cuda.h): the memory clock in kHz and the memory bus width in bits.
_CU_MEMORY_CLOCK_RATE, _CU_GLOBAL_MEMORY_BUS_WIDTH = 36, 37


def memory_bandwidth() -> float | None:
    """The current NVIDIA GPU's theoretical DRAM bandwidth in bytes/s (two transfers per memory
    clock over the bus width: 3.35e12 on an H100 SXM, ~4.9e12 on an H200), or None where there is
    no NVIDIA GPU or its driver does not say. Cost models of memory-bound choices read it (the
    grouped GEMMs' 2x1 clusters)."""
    if not is_cuda():
        return None
    return _memory_bandwidth_of(torch.cuda.current_device())


@functools.cache
def _memory_bandwidth_of(index: int) -> float | None:
    # torch's device properties do not carry the memory clock; the driver API does.
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    handle, clock_khz, bus_bits = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if (driver.cuInit(0) or driver.cuDeviceGet(ctypes.byref(handle), index)
            or driver.cuDeviceGetAttribute(ctypes.byref(clock_khz), _CU_MEMORY_CLOCK_RATE, handle)
            or driver.cuDeviceGetAttribute(ctypes.byref(bus_bits), _CU_GLOBAL_MEMORY_BUS_WIDTH, handle)):
        return None
    return 2 * clock_khz.value * 1e3 * bus_bits.value / 8 or None


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())
