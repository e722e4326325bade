"""How many thread-block clusters of each size the GPU keeps resident at once, for CTAs that
fill an SM as the persistent GEMMs do (384 threads, 200 KB of shared memory), and for a CTA of
half that shared memory.

A persistent kernel launches one CTA per SM and lets each walk its share of the tiles; if its
grid holds more clusters than can be resident together, the extra ones start only when a whole
cluster has finished all of its work, and the call takes about twice as long. Thread-block
clusters must fit inside one GPC, so a cluster size that does not divide a GPC's SM count strands
SMs: the driver's ``cuOccupancyMaxActiveClusters`` says how many fit (asked here for a trivial
kernel with the given block size and shared memory).

    python tools/cluster_occupancy.py
"""
from __future__ import annotations

from gpu_resources import driver_ok

PTX = b""".version 8.0
.target sm_90a
.address_size 64
.visible .entry probe() { ret; }
"""
CLUSTER_SIZES = (1, 2, 4, 8, 16)
SHAPES = ((200, 384), (200, 256), (100, 384))  # (shared memory KB, threads) per CTA


def max_active_clusters(func, cluster: int, threads: int, smem_bytes: int) -> int:
    from cuda.bindings import driver as cu

    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = cluster, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = smem_bytes
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
    config.attrs = [attr]
    config.numAttrs = 1
    return driver_ok(cu.cuOccupancyMaxActiveClusters(func, config))


def main() -> int:
    import torch

    torch.zeros(1, device="cuda")  # makes the primary context current
    from cuda.bindings import driver as cu

    func = driver_ok(cu.cuModuleGetFunction(driver_ok(cu.cuModuleLoadData(PTX)), b"probe"))
    attrs = cu.CUfunction_attribute
    driver_ok(cu.cuFuncSetAttribute(func, attrs.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
    print(f"{torch.cuda.get_device_name()}: {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    for smem_kb, threads in SHAPES:
        driver_ok(cu.cuFuncSetAttribute(func, attrs.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_kb * 1024))
        counts = {c: max_active_clusters(func, c, threads, smem_kb * 1024) for c in CLUSTER_SIZES}
        print(f"{smem_kb} KB, {threads} threads per CTA: "
              + "; ".join(f"clusters of {c}: {n} ({n * c} CTAs)" for c, n in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
