"""Resource reports read from compiled kernels, occupancy, and the checks built on them.

The kernels here are small test-only templates (tests/fixtures/resource_templates): a CuTe kernel
that spills when its registers are capped and a FlyDSL copy whose block size is its config. The
check over every compiled kernel of the registered templates runs in test_compile_templates.py,
on the kernels that test builds anyway.
"""
import importlib.util
import json
import os
import re
import subprocess

import pytest
from support import have_lld

from mslk_dsl import aot, binaries, jit, registry, resources
from mslk_dsl.cache import KernelCache
from mslk_dsl.keys import KernelKey
from mslk_dsl.targets import get_target
from mslk_dsl.templates import _rowwise_plan as plan

HERE = os.path.dirname(os.path.abspath(__file__))
RESOURCE_TEMPLATES = os.path.join(HERE, "fixtures", "resource_templates")


def _template_file(stem: str):
    spec = importlib.util.spec_from_file_location(stem, os.path.join(RESOURCE_TEMPLATES, f"{stem}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TEMPLATE


@pytest.fixture
def resource_templates(monkeypatch):
    """The registry (here and in compile children) sees the resource test templates too."""
    paths = os.environ.get("MSLK_DSL_TEMPLATE_PATH", "")
    monkeypatch.setenv("MSLK_DSL_TEMPLATE_PATH", os.pathsep.join(p for p in (paths, RESOURCE_TEMPLATES) if p))
    registry.reload()
    yield
    monkeypatch.undo()
    registry.reload()


# -- pure functions -------------------------------------------------------------------------------
def test_mlir_string_bytes_decodes_every_escape():
    assert binaries._mlir_string_bytes(r'\7FELF\00a\\b\22') == b'\x7fELF\x00a\\b"'


def test_occupancy_nvidia_registers_and_shared_memory():
    sm90a = get_target("sm90a")
    # 168 registers x 384 threads: 1 block (12 warps of 64) by registers; 225 KiB also allows 1.
    gemm = {"threads": 384, "registers": 168, "shared_bytes": 231424}
    assert resources.occupancy(gemm, sm90a) == {"blocks": 1, "occupancy": 0.1875, "limited_by": "registers"}
    # 32 registers x 256 threads: registers allow 8 blocks, warps 8 (64 / 8 warps), shared memory
    # 48 KiB + 1 KiB reserved per block: 4 blocks.
    small = {"threads": 256, "registers": 32, "shared_bytes": 48 * 1024}
    assert resources.occupancy(small, sm90a) == {"blocks": 4, "occupancy": 0.5, "limited_by": "shared memory"}


def test_occupancy_amd_uses_the_allocated_registers():
    gfx942 = get_target("gfx942")
    # What the kernel descriptor allocates wins over the metadata's count: 264 VGPRs leave one
    # wave per SIMD, so one 4-wave work-group per CU (4 of 32 wave slots).
    kernel = {"threads": 256, "vgprs": 102, "agprs": 0, "sgprs": 38, "shared_bytes": 0}
    assert resources.occupancy({**kernel, "vgprs_allocated": 264}, gfx942) == {
        "blocks": 1, "occupancy": 0.125, "limited_by": "registers"}
    # With 48 KiB of LDS too, LDS is named: it is why LLVM allocated that many registers.
    assert resources.occupancy({**kernel, "vgprs_allocated": 264, "shared_bytes": 49152}, gfx942)[
        "limited_by"] == "LDS"
    assert resources.occupancy({**kernel, "vgprs_allocated": 104}, gfx942) == {
        "blocks": 4, "occupancy": 0.5, "limited_by": "registers"}
    # 48 KiB of LDS of the CU's 64: one work-group.
    assert resources.occupancy({**kernel, "vgprs_allocated": 40, "shared_bytes": 49152}, gfx942) == {
        "blocks": 1, "occupancy": 0.125, "limited_by": "LDS"}
    # Without a descriptor: VGPRs and AGPRs share one file, AGPRs from a multiple of 4.
    assert resources._unified_vgprs({"vgprs": 102, "agprs": 128}) == 232


def test_problems_name_each_limit():
    sm90a = get_target("sm90a")
    report = {"kernels": [{"name": "k", "threads": 2048, "registers": 40, "shared_bytes": 300000,
                           "scratch_bytes": 16}]}
    found = resources.problems(report, sm90a, occupancy_floor=0.25)
    assert any("2048 threads per block" in p for p in found)
    assert any("300000 bytes of shared memory" in p for p in found)
    assert any("spills (16 bytes of scratch per thread)" in p for p in found)
    assert "spills (3 SGPRs spilled)" in resources.problems(
        {"kernels": [{"name": "k", "threads": 64, "vgprs": 8, "sgprs": 100, "sgpr_spills": 3}]}, get_target("gfx942"))[0]
    assert resources.problems({"kernels": [], "error": "ValueError: x"}, sm90a) == [
        "the resource report could not be read: ValueError: x"]
    fine = {"kernels": [{"name": "k", "threads": 256, "registers": 32, "shared_bytes": 0, "scratch_bytes": 0}]}
    assert resources.problems(fine, sm90a, occupancy_floor=1.0) == []
    assert "under the template's floor" in resources.problems(
        {"kernels": [{**fine["kernels"][0], "registers": 128}]}, sm90a, occupancy_floor=0.5)[0]


# -- the 2048-thread config ----------------------------------------------------------------------
def test_a_block_over_the_targets_limit_is_not_a_valid_config():
    template = _template_file("wide_block_flydsl")
    assert template.valid_configs("gfx942", {}) == [{"threads": 256}]
    with pytest.raises(ValueError, match="2048 threads per block, over the target's 1024"):
        template.check_config({"threads": 2048}, "gfx942", {})


def test_every_registered_config_launches_on_its_targets():
    """The check holds for the shipped templates: no config they offer exceeds a block limit."""
    for t in registry.get_templates():
        for target in t.targets:
            for config in t.all_configs():
                if any(t.valid(config, target, s) for s in t.all_signatures()):
                    assert t.launch_problem(config, target) is None, (t.name, config, target)


@pytest.mark.skipif(not have_lld(), reason="FlyDSL needs ld.lld (apt-get install -y lld-19)")
def test_flydsl_code_object_report(tmp_path, resource_templates):
    """The report comes from the code object inside artifact.pkl; the 2048-thread config, forced
    past the validity check, compiles, and its report is what flags it."""
    template = registry.get_template("wide_block_flydsl")
    jobs = [aot.Job(KernelKey.make(template, {"threads": n}, "gfx942", {}), template.name) for n in (256, 2048)]
    report = aot.build(jobs, str(tmp_path), workers=1, progress=False)
    assert report.ok, report.failed
    small, wide = (KernelCache(str(tmp_path)).lookup(j.key) for j in jobs)
    [kernel] = small.meta["resources"]["kernels"]
    assert kernel["threads"] == 256 and kernel["max_threads"] == 256 and kernel["wavefront_size"] == 64
    assert 0 < kernel["vgprs"] <= kernel["vgprs_allocated"] and kernel["sgprs"] > 0
    assert kernel["scratch_bytes"] == 0 and kernel["shared_bytes"] == 0
    assert resources.entry_problems(small) == []
    # The code object of the wide config promises no more than 1024 work-items.
    [kernel] = wide.meta["resources"]["kernels"]
    assert kernel["max_threads"] <= 1024
    assert any("2048 threads per block" in p for p in resources.entry_problems(wide))


# -- a config that spills -------------------------------------------------------------------------
def test_a_spilling_config_is_reported_and_rejected(tmp_path, resource_templates):
    template = registry.get_template("spill_cute")
    jobs = {capped: aot.Job(KernelKey.make(template, {"capped": capped}, "sm90a", {}), template.name)
            for capped in (False, True)}
    report = aot.build(list(jobs.values()), str(tmp_path), workers=1, progress=False)
    assert report.ok, report.failed
    store = KernelCache(str(tmp_path))
    free, capped = store.lookup(jobs[False].key), store.lookup(jobs[True].key)
    [k_free], [k_capped] = free.meta["resources"]["kernels"], capped.meta["resources"]["kernels"]
    assert k_free["scratch_bytes"] == 0 and k_free["threads"] == 1024
    assert k_capped["registers"] <= 32 < k_free["registers"] and k_capped["scratch_bytes"] > 0
    # ...and the report counts the spill instructions in the SASS (nvdisasm is in the test extra)
    assert k_capped["spill_stores"] > 0 and k_capped["spill_loads"] > 0
    assert k_free["spill_stores"] == k_free["spill_loads"] == 0
    # It truly spills: the SASS stores registers to local memory and loads them back.
    from test_compile_templates import _nvdisasm

    sass = subprocess.run([_nvdisasm(), capped.file("kernel.cubin")], capture_output=True, text=True).stdout
    assert re.search(r"\bSTL\b", sass) and re.search(r"\bLDL\b", sass)
    assert resources.entry_problems(free) == []
    # 64 registers x 1024 threads: one block, half the SM's warps; a floor above that is broken.
    assert resources.problems(free.meta["resources"], get_target("sm90a"), occupancy_floor=0.5) == []
    assert "occupancy 0.500 (limited by registers)" in resources.problems(
        free.meta["resources"], get_target("sm90a"), occupancy_floor=0.75)[0]
    assert any("spills" in p for p in resources.entry_problems(capped))
    assert resources.problems(capped.meta["resources"], get_target("sm90a"), spills_allowed=True) == []


def test_aot_build_checks_the_resources_of_exactly_its_kernels(tmp_path, resource_templates, capsys):
    """`mslk-dsl aot build --check-resources` (what `make aot` runs): the build fails on a kernel
    that spills without its template allowing it, and passes where its kernels keep the
    declarations; the check covers the build's kernels only, not others in the same directory."""
    from mslk_dsl.cli import main

    out = str(tmp_path / "bundle")
    build = ["aot", "build", "--op", "resource_spill", "--target", "sm90a", "--workers", "1", "--out", out,
             "--progress", "lines", "--check-resources"]
    assert main(build + ["--config", "cappedTrue"]) == 1
    assert "RESOURCES: spill_cute {'capped': True}" in capsys.readouterr().err
    assert main(build + ["--config", "cappedFalse"]) == 0   # the capped kernel is still in out
    assert "resources: 0 problems in the 1 kernels" in capsys.readouterr().out


# -- where reports show ---------------------------------------------------------------------------
def test_reports_reach_meta_json_explain_the_resources_command_and_bundles(cache_dir, capsys):
    from mslk_dsl.aot import bundle
    from mslk_dsl.cli import main
    from mslk_dsl.explain import explain

    template = registry.get_template("scale_copy_cute")
    key = KernelKey.make(template, {"threads": 128}, "sm90a", {"factor": 2})
    assert aot.build([aot.Job(key, template.name)], str(cache_dir), workers=1, progress=False).ok
    entry = jit.cache().lookup(key)
    [kernel] = entry.meta["resources"]["kernels"]
    assert kernel["threads"] == 128 and kernel["registers"] > 0 and kernel["dynamic_shared_bytes"] == 0

    text, hit = explain("scale_copy", "sm90a", {"factor": 2}, "threads128")
    assert hit, text
    assert re.search(r"occupancy \d+% \(\d+ blocks per SM, limited by \w+", text), text

    capsys.readouterr()
    assert main(["resources", "--op", "scale_copy", "--json", "--check"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["op"], r["target"], r["threads"]) for r in rows] == [("scale_copy", "sm90a", 128)]

    manifest = bundle.write_bundle_manifest(str(cache_dir))
    [record] = manifest["kernels"]
    assert record["resources"]["kernels"] == 1 and record["resources"]["registers"] == kernel["registers"]
    assert record["resources"]["min_occupancy"] > 0


# -- silu_mul_quant's fitted CTAs at 72 registers ------------------------------------------------
@pytest.mark.parametrize("cluster", [2, 1])
def test_silu_mul_quant_224_threads_at_72_registers_fit_one_more_cta(tmp_path, cluster):
    """The ``regs`` 72 configs (224 threads: the 2-CTA cluster the heuristic takes at 14336, and the
    CTA reading its row in two passes) compile within their cap with a few bytes of local memory,
    one CTA per SM more than the same tile at 80 registers (4 instead of 3); no other tile is capped."""
    template = registry.get_template("silu_mul_quant_cute")
    config = {"threads": 224, "rows_per_block": 1, "vec": 8, "chunks": 4, "regs": 72, "l1": "keep"}
    if cluster > 1:
        config["cluster"] = cluster
    assert config in template.all_configs()
    assert {c["threads"] for c in template.all_configs() if "regs" in c} == {224}
    blocks = 4
    sig = {"dtype": "bfloat16", "vec_bytes": 16, "has_scale_ub": False}
    job = aot.Job(KernelKey.make(template, config, "sm90a", sig), template.name)
    report = aot.build([job], str(tmp_path), workers=1, progress=False)
    assert report.ok, report.failed
    entry = KernelCache(str(tmp_path)).lookup(job.key)
    [kernel] = entry.meta["resources"]["kernels"]
    assert kernel["registers"] <= 72 and kernel["scratch_bytes"] <= 16
    assert resources.occupancy(kernel, get_target("sm90a"))["blocks"] == blocks
    assert resources.entry_problems(entry) == []   # the spill is declared (spills_allowed)


def _sm90a_sass(tmp_path, template, config, sig) -> str:
    """The SASS of one sm90a kernel, compiled into ``tmp_path``."""
    from test_compile_templates import _nvdisasm

    job = aot.Job(KernelKey.make(template, config, "sm90a", sig), template.name)
    report = aot.build([job], str(tmp_path), workers=1, progress=False)
    assert report.ok, report.failed
    entry = KernelCache(str(tmp_path)).lookup(job.key)
    return subprocess.run([_nvdisasm(), entry.file("kernel.cubin")], capture_output=True, text=True).stdout


# -- rmsnorm: the weight's loads before the row reduction ---------------------------------------
@pytest.mark.parametrize("op", ["rmsnorm", "rmsnorm_add"])
@pytest.mark.parametrize("fp32_weight", [False, True])
@pytest.mark.parametrize("vec_bytes,config", [
    (16, {"threads": 128, "rows_per_block": 1, "vec": 8, "chunks": 8}),     # weight via shared memory
    (4, {"threads": 128, "rows_per_block": 1, "vec": 8, "chunks": 8}),      # the same, in 4-byte accesses
    (2, {"threads": 256, "rows_per_block": 1, "vec": 1, "chunks": 16}),     # weight in registers
])
def test_rmsnorm_weight_loads_are_issued_before_the_reduction_barrier(tmp_path, op, fp32_weight, vec_bytes, config):
    """In the SASS of a one-tile rmsnorm kernel, every load of the tile (x [and the residual], and
    the weight: cp.async into shared memory on vector rows, into registers otherwise) is issued
    before the row reduction's barrier, and no global load sits between that barrier and the
    first store after it. A weight read in pass 2 between the stores of y was one round trip per
    vector (the compiler cannot hoist a load above a store that may alias it): 8.2 against 5.1 us
    for one row of 7168 on the H200. A one-element config has two paths, each with its barrier:
    phased rows (the middle in vectors, the weight and the edges one element at a time) and one
    element per access."""
    sig = {"dtype": "bfloat16", "vec_bytes": vec_bytes, "fp32_weight": fp32_weight}
    sass = _sm90a_sass(tmp_path, registry.get_template(f"rmsnorm_cute.{op}"), config, sig)
    ops = re.findall(r"\b(LDGSTS|LDG|STG|BAR\.SYNC|EXIT)\b", sass)
    arrays = 2 if op == "rmsnorm_add" else 1
    tile = plan.access_tile(config, sig)   # 4-byte rows: 4 times the accesses of the config's
    # An fp32 weight under 8 16-bit values: 2 x 16 bytes; under 2 values (4-byte rows): 8 bytes.
    weight_parts = 2 if fp32_weight and tile.vec == 8 else 1
    expected = [tile.chunks * arrays + tile.chunks * weight_parts]
    if vec_bytes == 2:
        phased = plan.phased_tile(tile, 2)
        edges = plan.edge_slots(phased)
        expected.append(phased.chunks * arrays + edges * arrays + phased.chunks * phased.vec + edges)
    barriers = [i for i, o in enumerate(ops) if o == "BAR.SYNC"]
    assert len(barriers) == len(expected), ops
    loads = []
    for b in barriers:
        after = ops[b + 1:]
        assert "STG" in after
        assert "LDG" not in after[:after.index("STG")], ops
        start = max((i for i in range(b) if ops[i] == "EXIT"), default=-1) + 1   # this path's code
        loads.append(sum(o in ("LDG", "LDGSTS") for o in ops[start:b]))
    assert all(got >= want for got, want in zip(sorted(loads), sorted(expected))), (loads, expected, ops)
    assert ("LDGSTS" in ops) == (vec_bytes != 2)


# -- rows split over a cluster: one cluster barrier, before the partials are pushed ----------------
@pytest.mark.parametrize("template_name,config,sig", [
    ("rmsnorm_cute.rmsnorm", {"threads": 256, "rows_per_block": 1, "vec": 8, "chunks": 8, "cluster": 4},
     {"dtype": "bfloat16", "vec_bytes": 16, "fp32_weight": False}),
    ("rmsnorm_cute.rmsnorm_add", {"threads": 256, "rows_per_block": 1, "vec": 8, "chunks": 8, "cluster": 8},
     {"dtype": "bfloat16", "vec_bytes": 16, "fp32_weight": False}),
    ("quantize_fp8_row_cute", {"threads": 256, "rows_per_block": 1, "vec": 8, "chunks": 4, "cluster": 2, "l1": "keep"},
     {"dtype": "bfloat16", "vec_bytes": 16, "has_scale_ub": False}),
])
def test_cluster_row_reduction_waits_once_before_the_pushes(tmp_path, template_name, config, sig):
    """A row split over a cluster meets its partials by pushing them into every CTA's shared
    memory (st.async, counted by each CTA's transaction barrier): the kernel's only cluster
    barrier (one arrive, one wait) comes before the pushes, and nothing waits for the other CTAs
    after them. The kernel that read the others' partials instead had to wait at a second
    cluster barrier before exit (rmsnorm on the H200, bf16, 2048 x 65536: 154.0 against 134.4 us)."""
    template = registry.get_template(template_name)
    assert config in template.all_configs()
    sass = _sm90a_sass(tmp_path, template, config, sig)
    ops = re.findall(r"\b(STG|STAS|UCGABAR_ARV|UCGABAR_WAIT)\b", sass)
    assert ops.count("UCGABAR_WAIT") == 1 and ops.count("UCGABAR_ARV") == 1, ops
    assert "STAS" in ops and ops.index("UCGABAR_ARV") < ops.index("UCGABAR_WAIT") < ops.index("STAS"), ops
