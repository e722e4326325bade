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


def _default_kernel_isa(tmp_path, target: str, sig: dict) -> tuple[dict, str]:
    """(config, ISA text) of the prefill template's default config for ``sig``, built for
    ``target`` into a fresh cache; the kernel has no resource problem."""
    if not have_lld():
        pytest.skip("FlyDSL needs ld.lld (apt-get install -y lld-19)")
    t = registry.get_template("attention_fwd_flydsl")
    config = t.heuristic(target, sig, {})
    key = KernelKey.make(t, config, target, sig)
    with overridden({"MSLK_DSL_KEEP_ISA": target}):
        report = aot.build([aot.Job(key, t.name)], str(tmp_path), workers=1, progress=False)
    assert not report.failed, report.failed
    entry = KernelCache(str(tmp_path)).lookup(key)
    assert not resources.entry_problems(entry)
    return config, open(entry.file("kernel.s")).read()


@pytest.mark.parametrize("dtype,mnemonic", [("bfloat16", "bf16")])
def test_gfx950_attention_uses_the_wide_mfma(tmp_path, dtype, mnemonic):
    _, isa = _default_kernel_isa(tmp_path, "gfx950", {"dtype": dtype, "head_dim": 128, "head_dim_v": 128})
    assert re.search(r'\.amdgcn_target "amdgcn-amd-amdhsa-\w*-gfx950', isa)
    wide = re.findall(rf"\bv_mfma_f32_16x16x32_{mnemonic}\b", isa)
    # 128 keys x 128 head-dim values per tile: 8 x 4 MFMAs for QK^T and 8 x 4 for PV
    assert len(wide) == 64, len(wide)
    assert not re.search(r"\bv_mfma_f32_16x16x16", isa)
    assert re.search(r"\bds_read_b128\b", isa), "K fragments: one 16-byte LDS read per lane"
    assert not re.search(r"\bscratch_(load|store)", isa)


@pytest.mark.parametrize("dims", [(96, 96), (192, 128)])
def test_gfx942_attention_at_the_new_head_dims(tmp_path, dims):
    """Head dim 96 and DeepSeek's (192, 128) on gfx942: one MFMA per 16 x 16 x 16 step of QK^T
    (D / 16 steps for each 16-key tile) and of PV (Dv / 16 output tiles for each 16-key step),
    and K and V tiles in 16-byte loads of their own row lengths (once before the loop and once in
    it), no scratch."""
    d, dv = dims
    config, isa = _default_kernel_isa(tmp_path, "gfx942", {"dtype": "bfloat16", "head_dim": d, "head_dim_v": dv})
    bn, threads = config["block_n"], 64 * config["waves"]
    mfma = re.findall(r"\bv_mfma_f32_16x16x16_?bf16", isa)
    assert len(mfma) == (d // 16 + dv // 16) * (bn // 16), len(mfma)
    loads = re.findall(r"\bbuffer_load_dwordx4\b", isa)
    assert len(loads) == 2 * (bn * d // 8 // threads + bn * dv // 8 // threads), len(loads)
    assert not re.search(r"\bscratch_(load|store)", isa)
