"""Child process for FlyDSL compile jobs of one target (see backends/flydsl.py).

argv[1] is a JSON file: a list of jobs {template, config, signature, cache_dir, isa_dir}; argv[2]
the parent's pid (the child exits when it dies). The
parent sets COMPILE_ONLY=1, ARCH and ROCM_PATH. For each job this sets the job's private FlyDSL
cache directory and calls the launcher on the template's CPU placeholders, which compiles and
persists without launching, then records the launcher's call ABI (flydsl_abi.describe); with an
isa_dir that one compile also dumps the ISA (compile_dumping_isa).
One JSON line per job reports the ABI or the error.
"""
import json
import os
import sys
import traceback


def compile_dumping_isa(launcher, args, isa_dir: str) -> None:
    """Compile ``launcher`` for ``args`` once with FlyDSL's ISA dump on, and persist what it
    compiled into FlyDSL's disk cache. FlyDSL writes no cache entry while dumping (and a second
    compile without the dump would cost as much again), so the artifact the dump's compile made
    is written here, as FlyDSL's own cache writer would."""
    jit_function = launcher if hasattr(launcher, "func") else type(launcher).__call__
    jit_function._last_compiled = None   # set again only by a compile of this call
    os.environ.update(FLYDSL_DEBUG_DUMP_ASM="1", FLYDSL_DUMP_DIR=isa_dir)
    try:
        launcher(*args)
    finally:
        os.environ.pop("FLYDSL_DEBUG_DUMP_ASM", None)
    if jit_function._last_compiled is None:   # served from FlyDSL's memory: nothing was dumped or made
        from mslk_dsl.errors import CompileError

        raise CompileError("FlyDSL compiled nothing for this job (a kernel this process already compiled)")
    key, artifact = jit_function._last_compiled
    jit_function.cache_manager.set(jit_function._cache_key_to_str(key), artifact)


def main() -> int:
    from mslk_dsl.backends import die_with_parent

    if len(sys.argv) > 2:  # the compiling process: never compile on as an orphan
        die_with_parent(int(sys.argv[2]))
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    from mslk_dsl.backends import flydsl_abi
    from mslk_dsl.registry import get_template

    for index, job in enumerate(jobs):
        try:
            template = get_template(job["template"])
            os.environ["FLYDSL_RUNTIME_CACHE_DIR"] = job["cache_dir"]
            launcher, args = template.build(job["config"], job["target"], job["signature"])
            if job.get("isa_dir"):
                compile_dumping_isa(launcher, args, job["isa_dir"])
            else:
                launcher(*args)
            abi = flydsl_abi.describe(launcher, args)
            print(json.dumps({"index": index, "abi": abi}), flush=True)
        except Exception as e:
            detail = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-3000:]
            print(json.dumps({"index": index, "error": f"{type(e).__name__}: {e}\n{detail}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
