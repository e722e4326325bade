"""Every registered template compiles for every target it declares, in every config and dtype.

The selection (built from the registry, so a new template or config is picked up with no edit
here): every config x target x dtype, with the other signature parts at their first value that the
config accepts, plus the heuristic's config for every full signature. CuTe and FlyDSL build in
separate tests (separate processes); each then checks the code it produced and that a second,
fresh process finds every kernel in the cache and compiles nothing.
"""
import json
import os
import re
import textwrap

import pytest
from support import have_lld, run_python

from mslk_dsl import aot, registry
from mslk_dsl.cache import KernelCache
from mslk_dsl.keys import KernelKey

# Instructions the code must contain, by (op, backend-target). Regexes over PTX (CuTe) or the
# final ISA (FlyDSL, gfx942 only, from MSLK_DSL_KEEP_ISA=1).
PTX_EXPECT = {
    "bf16_gemm": [r"wgmma\.mma_async", r"cp\.async\.bulk\.tensor"],
    "f8f8bf16_rowwise": [r"wgmma\.mma_async.*e4m3", r"cp\.async\.bulk\.tensor"],
}
ALIGNED_PTX = [r"ld\.global(\.\w+)*\.v4\.|ld\.global(\.\w+)*\.v2\.b64|ld\.global\.L\w+(\.\w+)*\.v4"]
ISA_EXPECT_GFX942 = {
    "bf16_gemm": [r"v_mfma_f32_\w+bf16"],
    "f8f8bf16_rowwise": [r"v_mfma_f32_\w+fp8"],
}
ALIGNED_ISA = [r"global_load_dwordx4|buffer_load_dwordx4"]


def selection(backend: str) -> list[aot.Job]:
    jobs = {}
    for t in registry.get_templates(backend=backend):
        sigs = t.all_signatures()
        for target in t.targets:
            for config in t.all_configs():
                for dtype in {s.get("dtype") for s in sigs}:
                    sig = next((s for s in sigs if s.get("dtype") == dtype and t.valid(config, target, s)), None)
                    if sig is not None:
                        key = KernelKey.make(t, config, target, sig)
                        jobs[key.digest] = aot.Job(key, t.name)
            for sig in sigs:
                config = t.heuristic(target, sig, {"M": 4096, "N": 4096, "K": 4096, "T": 4096})
                key = KernelKey.make(t, config, target, sig)
                jobs[key.digest] = aot.Job(key, t.name)
    return sorted(jobs.values(), key=lambda j: j.key.digest)


def _build_and_recheck(backend, out, env=None):
    jobs = selection(backend)
    assert jobs, f"no {backend} templates registered"
    report = aot.build(jobs, str(out), workers=1, progress=False)
    print(f"{backend}: {len(report.built)} kernels compiled in {report.seconds:.0f}s")
    assert report.ok, "failed to compile:\n" + "\n".join(report.failed.values())
    # A fresh process plans the same jobs and finds every one of them: it compiles nothing.
    done = run_python(textwrap.dedent(f"""
        import json
        from mslk_dsl import aot
        from test_compile_templates import selection
        report = aot.build(selection({backend!r}), {str(out)!r}, workers=1, progress=False)
        print(json.dumps({{"built": len(report.built), "skipped": len(report.skipped)}}))
    """), env={"PYTHONPATH": os.path.dirname(__file__), **(env or {})})
    assert json.loads(done.stdout.splitlines()[-1]) == {"built": 0, "skipped": len(jobs)}
    return {j.key.digest: KernelCache(str(out)).lookup(j.key) for j in jobs}


def _check_code(entries, filename, expect_by_op, aligned_patterns, targets):
    for entry in entries.values():
        key = entry.key_parts
        if key["target"] not in targets:
            continue
        text = open(entry.file(filename)).read()
        patterns = list(expect_by_op.get(key["op"], []))
        if key["signature"].get("aligned") is True and key["config"].get("vec", 8) * 2 >= 16:
            patterns += aligned_patterns
        for pattern in patterns:
            assert re.search(pattern, text), f"{key['template']} {key['config']} {key['signature']}: no {pattern}"


def test_every_cute_template_compiles_for_its_targets(tmp_path):
    entries = _build_and_recheck("cute", tmp_path / "cute")
    for entry in entries.values():
        ptx = open(entry.file("kernel.ptx")).read()
        arch = entry.key_parts["target"].replace("sm", "sm_")
        assert re.search(rf"\.target\s+{arch}", ptx), entry.path
        assert os.path.getsize(entry.file("kernel.so")) > 0
    _check_code(entries, "kernel.ptx", PTX_EXPECT, [], {"sm90a"})


@pytest.mark.skipif(not have_lld(), reason="FlyDSL needs ld.lld (apt-get install -y lld-19)")
def test_every_flydsl_template_compiles_for_gfx942_and_gfx950(tmp_path, monkeypatch):
    monkeypatch.setenv("MSLK_DSL_KEEP_ISA", "1")
    entries = _build_and_recheck("flydsl", tmp_path / "flydsl", env={"MSLK_DSL_KEEP_ISA": "1"})
    targets = {e.key_parts["target"] for e in entries.values()}
    assert {"gfx942", "gfx950"} <= targets
    _check_code(entries, "kernel.s", ISA_EXPECT_GFX942, ALIGNED_ISA, {"gfx942"})
    for entry in entries.values():
        isa = open(entry.file("kernel.s")).read()
        assert f'.amdgcn_target "amdgcn-amd-amdhsa--{entry.key_parts["target"]}' in isa, entry.path
