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
import subprocess
import textwrap

import pytest
from support import have_lld, run_python

from mslk_dsl import aot, registry, resources
from mslk_dsl.cache import KernelCache
from mslk_dsl.keys import KernelKey

# Instructions the code must contain, by op. Regexes over PTX (CuTe) or the final ISA (FlyDSL,
# gfx942, kept with MSLK_DSL_KEEP_ISA=1).
PTX_EXPECT = {
    "bf16_gemm": [r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(bf16\.bf16|f16\.f16)",
                  r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global|cp\.async\.bulk\.tensor\.2d\.shared::cta\.global",
                  r"setmaxnreg"],
    "f8f8bf16_rowwise": [r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3",
                         r"cp\.async\.bulk\.tensor\.2d", r"setmaxnreg"],
    "index_shuffling": [r"shfl\.sync"],
    "scatter_add_dense_tokens": [r"(red|atom)\.global(\.\w+)*\.add"],
}
# 16-byte vector accesses, for configs that move 16 bytes per access on aligned rows.
PTX_VECTOR = r"(ld|st)\.global(\.[\w:]+)*\.v4\.(b32|u32|f32)"
# The SASS of the Hopper GEMMs (from kernel.cubin): warpgroup MMAs and TMA loads.
SASS_EXPECT = {
    "bf16_gemm": [r"HGMMA\.64x\d+x16\.F32", r"UTMALDG\.2D"],
    "f8f8bf16_rowwise": [r"QGMMA\.64x\d+x32\.F32\.E4M3\.E4M3", r"UTMALDG\.2D"],
}
ISA_EXPECT_GFX942 = {
    "bf16_gemm": [r"v_mfma_f32_\w+_(bf16|f16)\b"],
    "f8f8bf16_rowwise": [r"v_mfma_f32_\w+fp8"],
    "rmsnorm": [r"v_rsq_f32"],
    "rmsnorm_add": [r"v_rsq_f32"],
}
ISA_VECTOR = r"(global|buffer)_(load|store)_dwordx4"
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


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
    entries = {j.key.digest: KernelCache(str(out)).lookup(j.key) for j in jobs}
    # What a GPU would refuse or punish, from each kernel's resource report (mslk_dsl.resources).
    problems = [p for entry in entries.values() for p in resources.entry_problems(entry)]
    assert not problems, "resource problems:\n" + "\n".join(problems)
    return entries


def _moves_16_bytes(key: dict) -> bool:
    sig, config = key["signature"], key["config"]
    esize = ELEMENT_BYTES.get(sig.get("dtype"), 0)
    return sig.get("aligned") is True and "vec" in config and config["vec"] * esize == 16


def _check_code(entries, filename, expect_by_op, vector_pattern, targets):
    checked = 0
    for entry in entries.values():
        key = entry.key_parts
        if key["target"] not in targets:
            continue
        text = open(entry.file(filename)).read()
        patterns = list(expect_by_op.get(key["op"], []))
        if _moves_16_bytes(key):
            patterns.append(vector_pattern)
        for pattern in patterns:
            assert re.search(pattern, text), f"{key['template']} {key['config']} {key['signature']}: no {pattern}"
            checked += 1
    assert checked, "no instruction was checked"


def test_every_cute_template_compiles_for_its_targets(tmp_path):
    entries = _build_and_recheck("cute", tmp_path / "cute")
    for entry in entries.values():
        ptx = open(entry.file("kernel.ptx")).read()
        arch = entry.key_parts["target"].replace("sm", "sm_")
        assert re.search(rf"\.target\s+{arch}", ptx), entry.path
        assert os.path.getsize(entry.file("kernel.so")) > 0
    _check_code(entries, "kernel.ptx", PTX_EXPECT, PTX_VECTOR, {"sm90a"})
    _check_sorted_scatter(entries)
    nvdisasm = _nvdisasm()
    for entry in entries.values():
        key = entry.key_parts
        if key["target"] != "sm90a" or key["op"] not in SASS_EXPECT:
            continue
        sass = subprocess.run([nvdisasm, entry.file("kernel.cubin")], capture_output=True, text=True,
                              check=True).stdout
        for pattern in SASS_EXPECT[key["op"]]:
            assert re.search(pattern, sass), f"{key['template']} {key['config']}: no {pattern} in the SASS"


def _check_sorted_scatter(entries):
    """The sorted scatter counts with integer atomics and adds the data without atomics."""
    checked = 0
    for entry in entries.values():
        key = entry.key_parts
        if key["op"] == "scatter_add_dense_tokens" and key["config"].get("method") == "sorted":
            ptx = open(entry.file("kernel.ptx")).read()
            assert re.search(r"atom\.global(\.\w+)*\.add\.u32", ptx), entry.path
            assert not re.search(r"(red|atom)\.global(\.\w+)*\.add(\.noftz)?(\.v\d)?\.(bf16|f16|f32)", ptx), entry.path
            checked += 1
    assert checked, "no sorted scatter was compiled"


def _nvdisasm() -> str:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel (a test dependency), or on PATH."""
    import glob
    import shutil
    import site

    for root in site.getsitepackages():
        found = sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "bin", "nvdisasm")))
        if found:
            return found[-1]
    found = shutil.which("nvdisasm")
    assert found, "nvdisasm not found: pip install nvidia-cuda-nvdisasm (part of the test extra)"
    return found


@pytest.mark.skipif(not have_lld(), reason="FlyDSL needs ld.lld (apt-get install -y lld-19)")
def test_every_flydsl_template_compiles_for_gfx942_and_gfx950(tmp_path, monkeypatch):
    monkeypatch.setenv("MSLK_DSL_KEEP_ISA", "gfx942")  # the ISA costs a second compile: one target
    entries = _build_and_recheck("flydsl", tmp_path / "flydsl", env={"MSLK_DSL_KEEP_ISA": "gfx942"})
    targets = {e.key_parts["target"] for e in entries.values()}
    assert {"gfx942", "gfx950"} <= targets
    _check_code(entries, "kernel.s", ISA_EXPECT_GFX942, ISA_VECTOR, {"gfx942"})
    for entry in (e for e in entries.values() if e.key_parts["target"] == "gfx942"):
        isa = open(entry.file("kernel.s")).read()
        assert re.search(rf'\.amdgcn_target "amdgcn-amd-amdhsa-\w*-{entry.key_parts["target"]}', isa), entry.path
    _check_sorted_scatter_isa(entries)
    _check_run_time_block_sizes(entries)


def _check_run_time_block_sizes(entries):
    """MoE row kernels take their block size at launch (up to 1024 work-items): their code objects
    must declare max_flat_workgroup_size 1024 (with no declaration it is 256)."""
    checked = 0
    for entry in entries.values():
        key = entry.key_parts
        if key["target"] != "gfx942" or key["op"] not in ("gather_scale_dense_tokens", "scatter_add_dense_tokens"):
            continue
        isa = open(entry.file("kernel.s")).read()
        sizes = dict((name, int(n)) for n, name in
                     re.findall(r"\.max_flat_workgroup_size:\s+(\d+)\s*\n\s*\.name:\s+(\S+)", isa))
        rows = {name: n for name, n in sizes.items() if re.search(r"_(gather|scatter|reduce)$", name)}
        assert rows and set(rows.values()) == {1024}, f"{key['template']} {key['config']}: {sizes}"
        checked += 1
    assert checked, "no MoE row kernel was compiled for gfx942"


def _isa_kernels(isa: str) -> dict[str, str]:
    """Each kernel's code in an AMDGPU ISA dump, by symbol name (label to .Lfunc_end)."""
    return {m.group(1): m.group(2)
            for m in re.finditer(r"^(\w+):\n(.*?)^\.Lfunc_end", isa, re.M | re.S)}


def _check_sorted_scatter_isa(entries):
    """The sorted scatter (gfx942) counts with int32 atomics that return the old value, adds the
    data without atomics (no float atomic, no compare-and-swap loop), and its reduce kernel moves
    16 bytes per load on aligned rows."""
    checked = 0
    for entry in entries.values():
        key = entry.key_parts
        if (key["op"] != "scatter_add_dense_tokens" or key["config"].get("method") != "sorted"
                or key["target"] != "gfx942"):
            continue
        isa = open(entry.file("kernel.s")).read()
        kernels = _isa_kernels(isa)
        what = f"{key['template']} {key['config']} {key['signature']}"
        count = [code for name, code in kernels.items() if name.endswith("_count")]
        reduce = [code for name, code in kernels.items() if name.endswith("_reduce")]
        assert len(count) == 1 and len(reduce) == 1, f"{what}: kernels {sorted(kernels)}"
        # sc0 (glc before gfx940) on an atomic: it returns the old value (the row's position).
        assert re.search(r"\b(global|buffer)_atomic_add(_u32)?\s+v\d+,[^\n]*\b(sc0|glc)\b", count[0]), what
        assert not re.search(r"_atomic_(pk_)?add_(f16|bf16|f32|f64)|_atomic_cmpswap", isa), what
        if key["signature"]["aligned"]:
            assert re.search(r"\b(global|buffer)_load_dwordx4\b", reduce[0]), what
        checked += 1
    assert checked, "no sorted scatter was compiled for gfx942"
