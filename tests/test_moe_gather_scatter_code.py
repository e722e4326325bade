"""The MoE gather / scatter kernels' machine code, compiled here (no GPU needed).

- The atomic scatter on rows of one 16-bit element per access (odd widths): Hopper and CDNA3
  have no lone bf16 / fp16 atomic add (a compare-and-swap loop), so both templates add aligned
  4-byte words of two halves with the packed atomic (the CuTe template on a row's edges, around
  its phased middle). tests/gpu/test_moe_cute.py::test_scatter_word_pairs checks the sums on
  the GPU.
- The CuTe gather and atomic scatter on rows of one element per access run them phased (the
  gather also rows of 4- and 8-byte accesses): the out row's aligned middle in 16-byte accesses
  (vector stores, vector atomics), each from the two aligned 16-byte loads around its source. tests/gpu/test_moe_cute.py::test_*_phased_rows check
  them on the GPU.
- The FlyDSL row kernels reach gathered rows (anywhere in their tensor, different in each lane
  of a wave) through per-lane global addresses, and a block's own rows through one descriptor
  per wave: a buffer access through a per-lane descriptor compiles into a readfirstlane loop
  over the wave's distinct descriptors. (FlyDSL kernels are compiled and read here only: there
  is no AMD GPU to run them.)"""
import re
import subprocess

import pytest
from support import amd_kernels, descriptor_loops, have_lld

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


def _sass_counts(entry) -> dict:
    tool = resources.nvdisasm()
    if not tool:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    sass = subprocess.run([tool, entry.file("kernel.cubin")], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"\b((?:LDG|STG|REDG)\.E[\w.]*)", sass)
    return {op: ops.count(op) for op in set(ops)}


@pytest.mark.parametrize("dtype,vector", [("bfloat16", "BF16x8"), ("float16", "F16x8"), ("float32", "F32x4")])
def test_cute_one_element_rows_move_16_bytes_an_access(tmp_path, dtype, vector):
    """The phased gather and atomic scatter (unroll 4) on rows of one element per access, and
    the gather on rows of 4- and 8-byte accesses: per thread, two 16-byte loads for each middle
    vector, and four 16-byte stores (gather) or vector atomics (scatter); the edges and indices
    take the narrow accesses."""
    sig = {"dtype": dtype, "vec_bytes": 4 if dtype == "float32" else 2, "has_valid_count": False}
    gather = _sass_counts(_build(tmp_path / "g", "moe_gather_scatter_cute.gather_scale_dense_tokens",
                                 {"unroll": 4}, "sm90a", {**sig, "score_dtype": "bfloat16"}))
    assert gather.get("LDG.E.128") == 8 and gather.get("STG.E.128") == 4, gather
    scatter = _sass_counts(_build(tmp_path / "s", "moe_gather_scatter_cute.scatter_add_dense_tokens", ATOMIC,
                                  "sm90a", sig))
    assert scatter.get("LDG.E.128") == 8, scatter
    assert sum(n for op, n in scatter.items() if op.startswith(f"REDG.E.ADD.{vector}.")) == 4, scatter
    if dtype == "bfloat16":   # rows of 4- and 8-byte accesses: the gather runs them phased too
        for vec_bytes in (4, 8):
            narrow = _sass_counts(_build(tmp_path / f"n{vec_bytes}", "moe_gather_scatter_cute.gather_scale_dense_tokens",
                                         {"unroll": 4}, "sm90a", {**sig, "vec_bytes": vec_bytes,
                                                                  "score_dtype": "bfloat16"}))
            assert narrow.get("LDG.E.128") == 8 and narrow.get("STG.E.128") == 4, (vec_bytes, narrow)


@pytest.mark.parametrize("dtype,packed", [("bfloat16", "bf16"), ("float16", "f16")])
def test_flydsl_scatter_adds_word_pairs(tmp_path, dtype, packed):
    if not have_lld():
        pytest.skip("FlyDSL needs ld.lld (apt-get install -y lld-19)")
    sig = {"dtype": dtype, "vec_bytes": 2, "has_valid_count": False}
    entry = _build(tmp_path, "moe_gather_scatter_flydsl.scatter_add_dense_tokens", ATOMIC, "gfx942", sig)
    isa = open(entry.file("kernel.s")).read()
    assert len(re.findall(rf"\bglobal_atomic_pk_add_{packed}\b", isa)) == ATOMIC["unroll"]
    assert not re.search(r"\bglobal_atomic_cmpswap", isa), "a compare-and-swap loop"


# Kernels of the FlyDSL template that reach gathered rows (by name suffix).
GATHERED_ROW_KERNELS = ("_gather", "_scatter", "_reduce")


@pytest.mark.parametrize("template,config,sig", [
    ("gather_scale_dense_tokens", {"unroll": 4}, {"dtype": "bfloat16", "vec_bytes": 16, "score_dtype": "float32"}),
    ("gather_scale_dense_tokens", {"unroll": 1}, {"dtype": "float32", "vec_bytes": 4, "score_dtype": "bfloat16"}),
    ("scatter_add_dense_tokens", ATOMIC, {"dtype": "bfloat16", "vec_bytes": 16}),
    ("scatter_add_dense_tokens", ATOMIC, {"dtype": "float16", "vec_bytes": 2}),
    ("scatter_add_dense_tokens", {"method": "sorted", "unroll": 8}, {"dtype": "bfloat16", "vec_bytes": 16}),
], ids=["gather-bf16-v8", "gather-fp32-v1", "atomic-bf16-v8", "atomic-fp16-words", "sorted-bf16-v8-u8"])
def test_flydsl_rows_take_no_descriptor_loop(tmp_path, template, config, sig):
    if not have_lld():
        pytest.skip("FlyDSL needs ld.lld (apt-get install -y lld-19)")
    sig = {**sig, "has_valid_count": True}
    entry = _build(tmp_path, f"moe_gather_scatter_flydsl.{template}", config, "gfx942", sig)
    kernels = {name: body for name, body in amd_kernels(open(entry.file("kernel.s")).read()).items()
               if name.endswith(GATHERED_ROW_KERNELS)}
    assert kernels, "no row kernel found in the ISA"
    for name, body in kernels.items():
        assert not descriptor_loops(body), f"{name}: readfirstlane loops {descriptor_loops(body)}"
        assert re.search(r"\bglobal_load_(dword|ushort)", body), f"{name}: no global load of a gathered row"
