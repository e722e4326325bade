"""What a compiled kernel asks of the GPU, read from its artifact, and what the target gives.

A kernel that needs more registers, shared memory / LDS or threads per block than a GPU has
fails only at launch, and one that spills or fits few warps per SM runs slowly; neither shows
on a machine without that GPU. So every compiled kernel gets a resource report, read from the
code the GPU would load: the cubin (plus the launch constants of the compiled host code) for
CuTe, the code object inside artifact.pkl for FlyDSL (mslk_dsl.binaries reads both).

The report is stored in the cache entry's meta.json (``resources``); ``occupancy`` turns it and
the target's ``[limits]`` (arch/*.toml) into resident warps / waves, and ``problems`` checks it
against the template's declarations (spills, occupancy floor) and the target's limits.
"""
from __future__ import annotations

import math
import os
import re

from mslk_dsl.binaries import amd_kernels, cubin_kernels, cute_launches, flydsl_code_objects
from mslk_dsl.targets import Target, get_target


# -- reports --------------------------------------------------------------------------------------
def cute_report(cubin_path: str, host_ir: str | None = None) -> dict:
    """The report of a CuTe kernel from its cubin (and host IR, when compiling)."""
    with open(cubin_path, "rb") as f:
        kernels = cubin_kernels(f.read())
    launches = cute_launches(host_ir) if host_ir else {}
    for k in kernels:
        launch = launches.get(k["name"], {})
        k["threads"] = k["threads"] or launch.get("threads")
        k["dynamic_shared_bytes"] = launch.get("dynamic_shared_bytes")
        k["shared_bytes"] = k["static_shared_bytes"] + (k["dynamic_shared_bytes"] or 0)
    counts = spill_instructions(cubin_path)
    for k in kernels:
        if k["name"] in counts:
            k["spill_stores"], k["spill_loads"] = counts[k["name"]]
    return {"kernels": kernels}


def nvdisasm() -> str | None:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel (the test extra installs it), or on PATH."""
    import glob
    import shutil
    import site

    for root in site.getsitepackages():
        found = sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "bin", "nvdisasm")))
        if found:
            return found[-1]
    return shutil.which("nvdisasm")


def spill_instructions(cubin_path: str) -> dict[str, tuple[int, int]]:
    """{kernel: (local-memory stores, local-memory loads)} counted in the cubin's SASS (STL and
    LDL, the instructions a spill becomes): the cubin records the local memory a kernel uses but
    not how often it goes there. Empty where nvdisasm is not installed."""
    import subprocess

    tool = nvdisasm()
    if tool is None:
        return {}
    try:
        sass = subprocess.run([tool, "-c", cubin_path], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    counts: dict[str, list[int]] = {}
    current = None
    for line in sass.splitlines():
        function = re.match(r"\s*\.text\.(\S+):", line)
        if function:
            current = counts.setdefault(function.group(1), [0, 0])
        elif current is not None:
            current[0] += len(re.findall(r"\bSTL(?:\.\w+)*\b", line))
            current[1] += len(re.findall(r"\bLDL(?:\.\w+)*\b", line))
    return {name: (stores, loads) for name, (stores, loads) in counts.items()}


def flydsl_report(artifact_path: str) -> dict:
    return {"kernels": [k for co in flydsl_code_objects(artifact_path) for k in amd_kernels(co)]}


def report_for(backend: str, out_dir: str, host_ir: str | None = None) -> dict:
    """The report of the kernel just compiled into ``out_dir`` (called by the backends)."""
    if backend == "cute":
        return cute_report(os.path.join(out_dir, "kernel.cubin"), host_ir)
    return flydsl_report(os.path.join(out_dir, "artifact.pkl"))


def safe_report(backend: str, out_dir: str, host_ir: str | None = None) -> dict:
    """``report_for``, with a failure to read the artifact kept in the report (as ``error``,
    which the checks flag) rather than failing the compile."""
    try:
        return report_for(backend, out_dir, host_ir)
    except Exception as e:  # noqa: BLE001 - an unreadable artifact is the report's finding
        return {"kernels": [], "error": f"{type(e).__name__}: {e}"}


def report_of_entry(entry) -> dict:
    """An entry's report: the one stored at publish, else read from its files now (an entry
    built before reports existed; a CuTe launch's dynamic shared memory is then unknown)."""
    if "resources" in entry.meta:
        return entry.meta["resources"]
    backend = entry.key_parts["backend"]
    if backend == "cute" and not os.path.exists(entry.file("kernel.cubin")):
        return {"kernels": []}
    return report_for(backend, entry.path)


# -- occupancy ----------------------------------------------------------------------------------
def occupancy(kernel: dict, target: Target, threads: int | None = None) -> dict:
    """Blocks (work-groups) resident per SM (CU), the fraction of the SM's (CU's) warp (wave)
    slots they fill, and what limits them. ``threads`` overrides the kernel's block size."""
    threads = threads or kernel.get("threads") or kernel.get("max_threads")
    if not threads:
        return {"blocks": None, "occupancy": None, "limited_by": "unknown block size"}
    lim = target.limits
    warp = target.warp_size
    warps = math.ceil(threads / warp)
    if target.vendor == "nvidia":
        slots = lim["max_warps_per_sm"]
        per_warp = _round_up(max(kernel.get("registers", 0), 1) * warp, lim["register_alloc_unit"])
        smem = kernel.get("shared_bytes") or 0
        smem_per_block = _round_up(smem + lim["shared_memory_reserved_per_block"], lim["shared_memory_alloc_unit"])
        bounds = {"warps": slots // warps, "blocks": lim["max_blocks_per_sm"],
                  "registers": lim["registers_per_sm"] // per_warp // warps,
                  "shared memory": lim["shared_memory_per_sm"] // smem_per_block}
    else:
        simds = lim["simds_per_cu"]
        slots = simds * lim["max_waves_per_simd"]
        vgprs = kernel.get("vgprs_allocated") or _round_up(_unified_vgprs(kernel), lim["vgpr_alloc_unit"])
        sgprs = _round_up(max(kernel.get("sgprs", 0), 1), lim["sgpr_alloc_unit"])
        waves_per_simd = min(lim["max_waves_per_simd"], lim["vgprs_per_simd"] // vgprs,
                             lim["sgprs_per_simd"] // sgprs)
        lds = kernel.get("shared_bytes") or 0
        # A work-group's waves spread over the SIMDs; one of more than one wave holds a barrier.
        # LDS comes before registers: where LDS caps occupancy, LLVM lets the kernel allocate
        # the registers that occupancy leaves free, so a tie means LDS is the cause.
        bounds = {"waves": slots // warps,
                  "workgroups": lim["max_workgroups_per_cu"] if warps > 1 else slots,
                  "LDS": lim["lds_per_cu"] // _round_up(lds, lim["lds_alloc_unit"]) if lds else slots,
                  "registers": simds * waves_per_simd // warps if math.ceil(warps / simds) <= waves_per_simd else 0}
    limited_by = min(bounds, key=lambda name: bounds[name])  # the first of equal bounds
    blocks = bounds[limited_by]
    return {"blocks": blocks, "occupancy": round(blocks * warps / slots, 4), "limited_by": limited_by}


def _unified_vgprs(kernel: dict) -> int:
    """VGPRs + AGPRs in the unified file (AGPRs start at a multiple of 4)."""
    agprs = kernel.get("agprs", 0)
    return _round_up(kernel.get("vgprs", 0), 4) + agprs if agprs else max(kernel.get("vgprs", 0), 1)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


# -- checks -------------------------------------------------------------------------------------
def problems(report: dict, target: Target, spills_allowed: bool = False, occupancy_floor: float = 0.0,
             threads: int | None = None) -> list[str]:
    """What a GPU of ``target`` would refuse (launch limits) or punish (spills, occupancy under
    the floor) in a report; empty when the kernels are fine."""
    lim = target.limits
    shared_limit = target.smem_per_block
    out = [f"the resource report could not be read: {report['error']}"] if report.get("error") else []
    for k in report.get("kernels", []):
        name = _short_name(k["name"])
        block = k.get("threads") or threads or k.get("max_threads")
        if block and block > lim.get("max_threads_per_block", block):
            out.append(f"{name}: {block} threads per block, over the target's {lim['max_threads_per_block']}")
        if k.get("shared_bytes", 0) > shared_limit:
            out.append(f"{name}: {k['shared_bytes']} bytes of shared memory / LDS, over the target's {shared_limit}")
        spills = _spills(k)
        if spills and not spills_allowed:
            out.append(f"{name}: spills ({spills}); declare spills_allowed=True on the template if intended")
        occ = occupancy(k, target, k.get("threads") or threads)
        if occ["occupancy"] is not None and occ["occupancy"] < occupancy_floor:
            out.append(f"{name}: occupancy {occ['occupancy']:.3f} (limited by {occ['limited_by']}) is under "
                       f"the template's floor {occupancy_floor}")
    return out


def _spills(kernel: dict) -> str:
    """What a kernel spills, in words ("" for nothing): scratch (local / private memory per
    thread) and, on AMD, the registers spilled (SGPRs usually into VGPR lanes)."""
    parts = []
    if kernel.get("scratch_bytes"):
        parts.append(f"{kernel['scratch_bytes']} bytes of scratch per thread")
    if kernel.get("spill_stores") or kernel.get("spill_loads"):
        parts.append(f"{kernel.get('spill_stores', 0)} spill stores and {kernel.get('spill_loads', 0)} loads")
    for kind in ("vgpr", "sgpr"):
        if kernel.get(f"{kind}_spills"):
            parts.append(f"{kernel[f'{kind}_spills']} {kind.upper()}s spilled")
    return ", ".join(parts)


def _spills_allowed(template, key: dict) -> bool:
    allowed = template.spills_allowed
    return bool(allowed(key["config"], key["target"], key["signature"]) if callable(allowed) else allowed)


def entry_problems(entry) -> list[str]:
    """``problems`` of a cache entry, against its template's declarations."""
    from mslk_dsl.registry import get_template

    key = entry.key_parts
    template = get_template(key["template"])
    return [f"{key['template']} {key['config']} {key['signature']} on {key['target']}: {p}"
            for p in problems(report_of_entry(entry), get_target(key["target"]), _spills_allowed(template, key),
                              template.occupancy_floor, template.threads_of(key["config"]))]


# -- tables -------------------------------------------------------------------------------------
COLUMNS = ["op", "target", "config", "kernel", "threads", "registers", "shared", "scratch", "occupancy",
           "limited by"]


def rows(entries) -> list[dict]:
    """One row per kernel of each entry, for ``mslk-dsl resources`` and docs/resources.md."""
    out = []
    for entry in entries:
        key = entry.key_parts
        target = get_target(key["target"])
        for k in report_of_entry(entry).get("kernels", []):
            occ = occupancy(k, target)
            if target.vendor == "amd":
                regs = f"{k['vgprs']}v+{k['agprs']}a/{k.get('vgprs_allocated', '?')} {k['sgprs']}s"
            else:
                regs = str(k.get("registers"))
            shared = k.get("shared_bytes")
            if target.vendor == "nvidia" and k.get("dynamic_shared_bytes") is None and k.get("static_shared_bytes") == 0:
                shared = "?"
            out.append({"op": key["op"], "target": key["target"], "config": _config_text(key["config"]),
                        "signature": key["signature"], "kernel": _short_name(k["name"]),
                        "threads": k.get("threads") or k.get("max_threads"), "registers": regs,
                        "shared": shared, "scratch": k.get("scratch_bytes", 0),
                        "occupancy": occ["occupancy"], "limited by": occ["limited_by"]})
    return sorted(out, key=lambda r: (r["op"], r["target"], r["config"], r["kernel"]))


def _config_text(config: dict) -> str:
    from mslk_dsl.template import config_name

    return config_name(config)


def _short_name(name: str) -> str:
    """A kernel's name for a table: CuTe symbols (``kernel_cutlass_<function>_<argument
    types>_0``) by their function, long FlyDSL ones by head and tail."""
    cute = re.match(r"kernel_cutlass_(\w+?)_(tensor|mslk_dsl|object|[A-Z])", name)
    if cute:
        return cute.group(1)
    return name if len(name) <= 40 else f"{name[:24]}...{name[-13:]}"


def markdown(table: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in table:
        cells = [f"{r[c]:.0%}" if c == "occupancy" and r[c] is not None else str(r[c] if r[c] is not None else "-")
                 for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(entry) -> dict:
    """A few numbers per entry, for a bundle's manifest.json: the worst over its kernels."""
    report = report_of_entry(entry)
    kernels = report.get("kernels", [])
    target = get_target(entry.key_parts["target"])
    occupancies = [o for o in (occupancy(k, target)["occupancy"] for k in kernels) if o is not None]
    return {"kernels": len(kernels),
            "registers": max((k.get("vgprs_allocated") or k.get("registers") or k.get("vgprs") or 0
                              for k in kernels), default=0),
            "shared_bytes": max((k.get("shared_bytes") or 0 for k in kernels), default=0),
            "scratch_bytes": max((k.get("scratch_bytes") or 0 for k in kernels), default=0),
            "min_occupancy": min(occupancies, default=None),
            **({"error": report["error"]} if report.get("error") else {})}


def explain_lines(entry) -> list[str]:
    """The report of a cache entry, as ``mslk-dsl explain`` prints it."""
    report = report_of_entry(entry)
    target = get_target(entry.key_parts["target"])
    lines = ["resources:"]
    if report.get("error"):
        lines.append(f"  (unreadable: {report['error']})")
    for k in report.get("kernels", []):
        occ = occupancy(k, target)
        fields = {f: k[f] for f in ("threads", "max_threads", "registers", "vgprs", "agprs", "vgprs_allocated",
                                    "sgprs", "shared_bytes", "static_shared_bytes", "dynamic_shared_bytes",
                                    "scratch_bytes", "spill_stores", "spill_loads", "vgpr_spills", "sgpr_spills")
                  if f in k}
        lines.append(f"  {_short_name(k['name'])}: " + " ".join(f"{f}={v}" for f, v in fields.items()))
        occupancy_text = "-" if occ["occupancy"] is None else f"{occ['occupancy']:.0%}"
        lines.append(f"    occupancy {occupancy_text} ({occ['blocks']} blocks per "
                     f"{'SM' if target.vendor == 'nvidia' else 'CU'}, limited by {occ['limited_by']})")
    return lines
