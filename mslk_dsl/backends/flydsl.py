"""FlyDSL backend: compile-only in a child process per job, artifacts copied into our cache.

FlyDSL fixes its target per process and shares MLIR bindings with nothing else, so compiles run in
``python -m mslk_dsl.backends.flydsl_child`` (one child per target and batch of jobs) with
COMPILE_ONLY=1, ARCH=<target> and a private FlyDSL cache directory per job, in a scratch directory
beside the batch's staging directory (swept with it if the build is killed); the child exits
when its parent dies. The child calls the template's launcher on CPU placeholder tensors, which
compiles and persists without touching a GPU, and reports the launcher's call ABI. We keep the
pickled artifact (host code with the code object embedded), the ABI (in meta.json, to load the
artifact without the template: flydsl_abi) and, with MSLK_DSL_KEEP_ISA=1, the final ISA text.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

from mslk_dsl import env, fs, resources
from mslk_dsl.errors import BackendUnavailableError, CompileError

ARTIFACT = "artifact.pkl"
ISA = "kernel.s"


@functools.cache
def rocm_path_with_lld() -> str:
    """A ROCM_PATH whose llvm/bin/ld.lld exists (FlyDSL's only external tool)."""
    if os.path.exists("/opt/rocm/llvm/bin/ld.lld") and not env.lld():
        return "/opt/rocm"
    lld = env.lld() or shutil.which("ld.lld") or next(iter(sorted(glob.glob("/usr/lib/llvm-*/bin/ld.lld"),
                                                                  reverse=True)), None)
    if not lld:
        raise CompileError("FlyDSL needs ld.lld to link AMD code objects and none was found: install it "
                           "(Debian/Ubuntu as root: apt-get install -y lld-19) or set MSLK_DSL_LLD")
    shim = os.path.join(tempfile.gettempdir(), f"mslk-dsl-rocm-shim-{os.getuid()}")
    bindir = os.path.join(shim, "llvm", "bin")
    os.makedirs(bindir, exist_ok=True)
    link = os.path.join(bindir, "ld.lld")
    if os.path.realpath(link) != os.path.realpath(lld):
        with fs.replacing(link) as tmp:
            os.symlink(lld, tmp)
    return shim


def child_environment(dsl_arch: str, rocm_path: str) -> dict:
    """The compile child's environment: this one, less what would change the target or forbid
    compiling, plus the target, ld.lld's ROCm folder and the codegen switches every key records
    (keys.COMPILE_OPTIONS, as NAME=VALUE)."""
    from mslk_dsl.keys import COMPILE_OPTIONS

    child_env = {k: v for k, v in os.environ.items() if k not in ("ARCH", "FLYDSL_RUNTIME_RUN_ONLY")}
    for option in COMPILE_OPTIONS["flydsl"]:
        name, value = option.split("=", 1)
        child_env[name] = value
    child_env.update(ARCH=dsl_arch, ROCM_PATH=rocm_path)
    return child_env


def compile(template, config, target, signature, out_dir) -> dict:
    result = compile_many([(template, config, target, signature, out_dir)])[0]
    if isinstance(result, BaseException):
        raise result
    return result


def compile_many(items) -> list:
    """Compile items in one child process per target (FlyDSL fixes its target per process, and
    the children amortize the seconds of importing torch and flydsl over many kernels)."""
    results: list = [None] * len(items)
    by_target: dict[str, list[int]] = {}
    for i, (_, _, target, _, _) in enumerate(items):
        by_target.setdefault(target.name, []).append(i)
    for indices in by_target.values():
        for i, result in zip(indices, _compile_same_target([items[i] for i in indices])):
            results[i] = result
    return results


def _work_dir(out_dir: str) -> str:
    """The compile's scratch directory, beside the first job's staging directory and named after
    it: the cache's sweep removes it with that build's leftovers if this process is killed."""
    work = f"{os.path.normpath(out_dir)}-flydsl-work"
    os.makedirs(work)
    return work


def _compile_same_target(items) -> list:
    target = items[0][2]
    work = _work_dir(items[0][4])
    try:
        jobs = [{"template": t.name, "config": dict(c), "target": target.name, "signature": dict(s),
                 "cache_dir": os.path.join(work, f"cache{i}"),
                 "isa_dir": os.path.join(work, f"isa{i}") if env.keep_isa(target.name) else None}
                for i, (t, c, _, s, _) in enumerate(items)]
        jobs_file = os.path.join(work, "jobs.json")
        with open(jobs_file, "w") as f:
            json.dump(jobs, f)
        child_env = child_environment(target.dsl_arch, rocm_path_with_lld())
        done = subprocess.run([sys.executable, "-m", "mslk_dsl.backends.flydsl_child", jobs_file, str(os.getpid())],
                              env=child_env, capture_output=True, text=True)
        reported, abis = {}, {}
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                reported[record["index"]] = record.get("error")
                abis[record["index"]] = record.get("abi")
        results = []
        for i, ((template, config, _, signature, out_dir), job) in enumerate(zip(items, jobs)):
            what = f"{template.name} {config} for {target.name} {signature}"
            if i not in reported:
                results.append(CompileError(f"FlyDSL compile of {what} did not finish (child exit "
                                            f"{done.returncode}):\n{done.stderr[-3000:]}"))
            elif reported[i] is not None:
                results.append(CompileError(f"FlyDSL failed to compile {what}:\n{reported[i]}"))
            else:
                try:
                    results.append(_collect(job, abis[i], out_dir))
                except CompileError as e:
                    results.append(CompileError(f"{what}: {e}"))
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _collect(job: dict, abi: dict | None, out_dir: str) -> dict:
    """Copy one job's artifact (and ISA) from the child's FlyDSL cache into our entry; its call
    ABI goes into the load information."""
    if not abi:
        raise CompileError("the compile child reported no call ABI")
    pickles = sorted(glob.glob(os.path.join(job["cache_dir"], "*", "*.pkl")))
    if len(pickles) != 1:
        raise CompileError(f"the compile left {len(pickles)} artifacts, expected 1")
    shutil.copyfile(pickles[0], os.path.join(out_dir, ARTIFACT))
    if job["isa_dir"]:
        with open(os.path.join(out_dir, ISA), "w") as out:
            for path in sorted(glob.glob(os.path.join(job["isa_dir"], "**", "*.s"), recursive=True)):
                with open(path) as f:
                    out.write(f.read())
    return {"load": {"artifact": ARTIFACT, "abi": abi}, "resources": resources.safe_report("flydsl", out_dir)}


def load(entry):
    """Serve a compiled FlyDSL artifact on a ROCm GPU, without compiling: the artifact and the
    call ABI recorded when it was compiled make the callable (flydsl_abi.load). The template is
    not built and no environment variable is set; the code object is loaded on the first call."""
    from mslk_dsl.device import is_rocm

    if not is_rocm():
        raise BackendUnavailableError("FlyDSL kernels run only on ROCm GPUs (never loaded where ROCm is absent)")
    return load_artifact(entry)


def load_artifact(entry):
    """``load`` without the ROCm check: the callable, whose first call needs a ROCm GPU (CPU tests
    inspect what a load makes)."""
    from mslk_dsl.backends import flydsl_abi
    from mslk_dsl.cache import CorruptEntry

    info = entry.meta["load"]
    if "abi" not in info:   # an entry from before the ABI was recorded: damaged, so rebuilt
        raise CorruptEntry("this FlyDSL entry records no call ABI (built by an older mslk-dsl)")
    return flydsl_abi.load(entry.file(info["artifact"]), info["abi"])
