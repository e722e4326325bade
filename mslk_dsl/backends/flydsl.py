"""FlyDSL backend: compile-only in a child process per job, artifacts copied into our cache.

FlyDSL fixes its target per process and shares MLIR bindings with nothing else, so every compile
runs ``python -m mslk_dsl.backends.flydsl_child`` with COMPILE_ONLY=1, ARCH=<target> and a private
FlyDSL cache directory. The child calls the template's launcher on CPU placeholder tensors, which
compiles and persists without touching a GPU. We keep the pickled artifact (host code with the
code object embedded) and, with MSLK_DSL_KEEP_ISA=1, the final ISA text.
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

from mslk_dsl import env
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
        tmp = f"{link}.{os.getpid()}"
        os.symlink(lld, tmp)
        os.replace(tmp, link)
    return shim


def compile(template, config, target, signature, out_dir) -> dict:
    work = tempfile.mkdtemp(prefix="mslk-flydsl-")
    try:
        job = {"template": template.name, "config": dict(config), "target": target.name,
               "signature": dict(signature)}
        base_env = {k: v for k, v in os.environ.items() if k not in ("ARCH", "FLYDSL_RUNTIME_RUN_ONLY")}
        base_env.update(COMPILE_ONLY="1", ARCH=target.dsl_arch, ROCM_PATH=rocm_path_with_lld(),
                        FLYDSL_RUNTIME_CACHE_DIR=os.path.join(work, "cache"), FLYDSL_RUNTIME_ENABLE_CACHE="1")
        _run_child(job, base_env, template, config, target, signature)
        pickles = sorted(glob.glob(os.path.join(work, "cache", "*", "*.pkl")))
        if len(pickles) != 1:
            raise CompileError(f"FlyDSL compile of {template.name} left {len(pickles)} artifacts, expected 1")
        shutil.copyfile(pickles[0], os.path.join(out_dir, ARTIFACT))
        if env.keep_isa():
            # FlyDSL skips its disk cache while dumping, so the ISA takes a second compile.
            isa_dir = os.path.join(work, "isa")
            _run_child(job, {**base_env, "FLYDSL_DEBUG_DUMP_ASM": "1", "FLYDSL_DUMP_DIR": isa_dir},
                       template, config, target, signature)
            with open(os.path.join(out_dir, ISA), "w") as out:
                for path in sorted(glob.glob(os.path.join(isa_dir, "**", "*.s"), recursive=True)):
                    with open(path) as f:
                        out.write(f.read())
        launcher_dir = os.path.basename(os.path.dirname(pickles[0]))
        return {"load": {"artifact": ARTIFACT, "flydsl_cache_subdir": launcher_dir,
                         "flydsl_cache_file": os.path.basename(pickles[0])}}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_child(job, child_env, template, config, target, signature) -> None:
    done = subprocess.run([sys.executable, "-m", "mslk_dsl.backends.flydsl_child", json.dumps(job)],
                          env=child_env, capture_output=True, text=True)
    if done.returncode != 0:
        raise CompileError(f"FlyDSL failed to compile {template.name} {config} for {target.name} "
                           f"{signature} (exit {done.returncode}):\n{done.stderr[-4000:]}")


def load(entry):
    """Serve a compiled FlyDSL artifact on a ROCm GPU, without compiling.

    The artifact is placed into a private FlyDSL run-only cache and the template's launcher is
    called through it; FlyDSL then finds the compiled code instead of compiling.
    """
    from mslk_dsl.device import is_rocm

    if not is_rocm():
        raise BackendUnavailableError("FlyDSL kernels run only on ROCm GPUs (never loaded where ROCm is absent)")
    from mslk_dsl.registry import get_template

    info = entry.meta["load"]
    key = entry.meta["key"]
    cache = os.path.join(tempfile.gettempdir(), f"mslk-flydsl-run-{os.getpid()}")
    sub = os.path.join(cache, info["flydsl_cache_subdir"])
    os.makedirs(sub, exist_ok=True)
    shutil.copyfile(entry.file(info["artifact"]), os.path.join(sub, info["flydsl_cache_file"]))
    os.environ["FLYDSL_RUNTIME_CACHE_DIR"] = cache
    os.environ["FLYDSL_RUNTIME_RUN_ONLY"] = "1"
    template = get_template(key["template"])
    launcher, _ = template.build(key["config"], key["target"], key["signature"])
    return launcher
