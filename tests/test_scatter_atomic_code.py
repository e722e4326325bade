"""The atomic scatter's code on rows of one 16-bit element per access (odd widths): Hopper and
CDNA3 have no lone bf16 / fp16 atomic add (a compare-and-swap loop), so both templates add
aligned 4-byte words of two halves with the packed atomic. Compiled here (no GPU needed);
tests/gpu/test_moe_cute.py::test_scatter_word_pairs checks the sums on the GPU."""
import re
import subprocess

import pytest
from support import have_lld

from mslk_dsl import aot, registry, resources
from mslk_dsl.cache import KernelCache
from mslk_dsl.env import overridden
from mslk_dsl.keys import KernelKey

ATOMIC = {"method": "atomic", "unroll": 4}


def _build(tmp_path, template: str, config: dict, target: str, sig: dict):
    t = registry.get_template(template)
    config = {**config, **({"pdl": False} if "pdl" in t.space else {})}
    key = KernelKey.make(t, config, target, sig)
    with overridden({"MSLK_DSL_KEEP_ISA": target}):
        report = aot.build([aot.Job(key, t.name)], str(tmp_path), workers=1, progress=False)
    assert not report.failed, report.failed
    return KernelCache(str(tmp_path)).lookup(key)


@pytest.mark.parametrize("dtype,packed", [("bfloat16", "BF16x2"), ("float16", "F16x2")])
def test_cute_scatter_adds_word_pairs(tmp_path, dtype, packed):
    tool = resources.nvdisasm()
    if not tool:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    sig = {"dtype": dtype, "vec_bytes": 2, "has_valid_count": False}
    entry = _build(tmp_path, "moe_gather_scatter_cute.scatter_add_dense_tokens", ATOMIC, "sm90a", sig)
    sass = subprocess.run([tool, entry.file("kernel.cubin")], capture_output=True, text=True, check=True).stdout
    assert len(re.findall(rf"\bREDG\.E\.ADD\.{packed}\b", sass)) == ATOMIC["unroll"]
    assert not re.search(r"\bATOMG\.E\.CAS\b", sass), "a compare-and-swap loop"


@pytest.mark.parametrize("dtype,packed", [("bfloat16", "bf16"), ("float16", "f16")])
def test_flydsl_scatter_adds_word_pairs(tmp_path, dtype, packed):
    if not have_lld():
        pytest.skip("FlyDSL needs ld.lld (apt-get install -y lld-19)")
    sig = {"dtype": dtype, "vec_bytes": 2, "has_valid_count": False}
    entry = _build(tmp_path, "moe_gather_scatter_flydsl.scatter_add_dense_tokens", ATOMIC, "gfx942", sig)
    isa = open(entry.file("kernel.s")).read()
    assert len(re.findall(rf"\bglobal_atomic_pk_add_{packed}\b", isa)) == ATOMIC["unroll"]
    assert not re.search(r"\bglobal_atomic_cmpswap", isa), "a compare-and-swap loop"
