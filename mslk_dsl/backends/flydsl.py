"""FlyDSL backend: compile-only in a child process per job, artifacts copied into our cache.

FlyDSL fixes its target per process and shares MLIR bindings with nothing else, so compiles run in
``python -m mslk_dsl.backends.flydsl_child`` (one child per target and batch of jobs) with
COMPILE_ONLY=1, ARCH=<target> and a private FlyDSL cache directory per job, in a scratch directory
beside the batch's staging directory (swept with it if the build is killed); the child exits
when its parent dies. The child calls the template's launcher on CPU placeholder tensors, which
compiles and persists without touching a GPU. We keep the pickled artifact (host code with the
code object embedded) and, with MSLK_DSL_KEEP_ISA=1, the final ISA text.
"""
from __future__ import annotations

import atexit
import functools
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

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
        tmp = fs.temp_name(link)
        os.symlink(lld, tmp)
        os.replace(tmp, link)
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
        reported = {}
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                reported[record["index"]] = record.get("error")
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
                    results.append(_collect(job, out_dir))
                except CompileError as e:
                    results.append(CompileError(f"{what}: {e}"))
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _collect(job: dict, out_dir: str) -> dict:
    """Copy one job's artifact (and ISA) from the child's FlyDSL cache into our entry."""
    pickles = sorted(glob.glob(os.path.join(job["cache_dir"], "*", "*.pkl")))
    if len(pickles) != 1:
        raise CompileError(f"the compile left {len(pickles)} artifacts, expected 1")
    shutil.copyfile(pickles[0], os.path.join(out_dir, ARTIFACT))
    if job["isa_dir"]:
        with open(os.path.join(out_dir, ISA), "w") as out:
            for path in sorted(glob.glob(os.path.join(job["isa_dir"], "**", "*.s"), recursive=True)):
                with open(path) as f:
                    out.write(f.read())
    return {"load": {"artifact": ARTIFACT, "flydsl_cache_subdir": os.path.basename(os.path.dirname(pickles[0])),
                     "flydsl_cache_file": os.path.basename(pickles[0])},
            "resources": resources.safe_report("flydsl", out_dir)}


def load(entry):
    """Serve a compiled FlyDSL artifact on a ROCm GPU, without compiling.

    FlyDSL serves compiled code only through the launcher it was compiled from: the artifact is
    the compiled module, while the binding of call arguments (tensors, scalars, constexprs) is
    done by the launcher's Python signature. So the template's launcher is built (Python only,
    no compile) and its first call reads the artifact from a private FlyDSL run-only cache. FlyDSL
    takes run-only mode and the cache directory from the environment at each call, so those two
    variables are set only for the duration of that first call, under a lock, and restored: the
    rest of the process (a user's own FlyDSL kernels) never sees them.
    """
    from mslk_dsl.device import is_rocm

    if not is_rocm():
        raise BackendUnavailableError("FlyDSL kernels run only on ROCm GPUs (never loaded where ROCm is absent)")
    from mslk_dsl.registry import get_template

    info = entry.meta["load"]
    key = entry.meta["key"]
    sub = os.path.join(_run_cache(), info["flydsl_cache_subdir"])
    os.makedirs(sub, exist_ok=True)
    shutil.copyfile(entry.file(info["artifact"]), os.path.join(sub, info["flydsl_cache_file"]))
    launcher, _ = get_template(key["template"]).build(key["config"], key["target"], key["signature"])
    return _RunOnlyLauncher(launcher, _run_cache())


class _RunOnlyLauncher:
    """The launcher, whose first call runs with FlyDSL's run-only variables (see ``load``); once
    FlyDSL holds the compiled code in memory, later calls go straight through."""

    def __init__(self, launcher, cache_dir: str):
        self.launcher, self.cache_dir, self.ready = launcher, cache_dir, False

    def __call__(self, *args, **kwargs):
        if self.ready:
            return self.launcher(*args, **kwargs)
        with _env_lock, env.overridden({"FLYDSL_RUNTIME_CACHE_DIR": self.cache_dir,
                                        "FLYDSL_RUNTIME_RUN_ONLY": "1"}):
            result = self.launcher(*args, **kwargs)
            self.ready = True
            return result


_env_lock = threading.Lock()
_run_cache_path: list[str] = []


def _run_cache() -> str:
    """This process's private FlyDSL run-only cache, removed at exit."""
    if not _run_cache_path:
        path = tempfile.mkdtemp(prefix="mslk-flydsl-run-")
        atexit.register(shutil.rmtree, path, True)
        _run_cache_path.append(path)
    return _run_cache_path[0]
