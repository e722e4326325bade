"""The gfx950 code of the FlyDSL attention forward: test_compile_templates.py compiles every
template for gfx950 but keeps the ISA of gfx942 only, and gfx950 runs its own MFMA (the 16x16x32
instructions that take 8 elements per lane, twice gfx942's K). One kernel, its default config."""
import re

import pytest
from support import have_lld

from mslk_dsl import aot, registry, resources
from mslk_dsl.cache import KernelCache
from mslk_dsl.env import overridden
from mslk_dsl.keys import KernelKey


@pytest.mark.parametrize("dtype,mnemonic", [("bfloat16", "bf16")])
def test_gfx950_attention_uses_the_wide_mfma(tmp_path, dtype, mnemonic):
    if not have_lld():
        pytest.skip("FlyDSL needs ld.lld (apt-get install -y lld-19)")
    t = registry.get_template("attention_fwd_flydsl")
    sig = {"dtype": dtype, "head_dim": 128, "head_dim_v": 128}
    key = KernelKey.make(t, t.heuristic("gfx950", sig, {}), "gfx950", sig)
    with overridden({"MSLK_DSL_KEEP_ISA": "gfx950"}):
        report = aot.build([aot.Job(key, t.name)], str(tmp_path), workers=1, progress=False)
    assert not report.failed, report.failed
    entry = KernelCache(str(tmp_path)).lookup(key)
    assert not resources.entry_problems(entry)
    isa = open(entry.file("kernel.s")).read()
    assert re.search(r'\.amdgcn_target "amdgcn-amd-amdhsa-\w*-gfx950', isa)
    wide = re.findall(rf"\bv_mfma_f32_16x16x32_{mnemonic}\b", isa)
    # 128 keys x 128 head-dim values per tile: 8 x 4 MFMAs for QK^T and 8 x 4 for PV
    assert len(wide) == 64, len(wide)
    assert not re.search(r"\bv_mfma_f32_16x16x16", isa)
    assert re.search(r"\bds_read_b128\b", isa), "K fragments: one 16-byte LDS read per lane"
    assert not re.search(r"\bscratch_(load|store)", isa)
