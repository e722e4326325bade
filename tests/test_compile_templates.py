"""Every registered template compiles for every target it declares, one test per
(template, config, target, signature), so ``pytest -k`` selects one, e.g.
``-k "silu_mul_cute and threads128_vec8 and sm90a and bfloat16"``.

The cases come from the registry (a new template or config is picked up with no edit here):
  * every template x target x full signature with its default config (the heuristic's choice),
    so every dtype is compiled;
  * each config the heuristic picks at the edge problems (long rows, short rows, 320 experts,
    one row) and not by default, with the last signature that picks it;
  * a bounded, deterministic sample of the other configs: per template and target, the fewest
    configs (taken in the order of a hash of their names) that use every value of every config
    parameter at least once, each with the first signature of each dtype it accepts.
``MSLK_DSL_TEST_ALL_CONFIGS=1`` compiles every config x target x dtype instead (what ``make aot``
covers as well). The selected cases of a backend are compiled together (FlyDSL shares its
compiler child among them) into one directory that every test process of the session shares:
under pytest-xdist each process starts at its own offset in the list of jobs, so the processes
split the batch between them and each kernel is compiled once (the build's per-kernel lock and
second look), however xdist hands out the cases. Each case then checks its own kernel. A fresh
process then finds every kernel in the output and compiles nothing.
"""
import hashlib
import json
import os
import re
import subprocess
import textwrap
from dataclasses import dataclass

import pytest
from support import amd_kernels, descriptor_loops, have_lld, run_python

from mslk_dsl import aot, registry, resources
from mslk_dsl.aot import runner
from mslk_dsl.env import overridden
from mslk_dsl.cache import KernelCache
from mslk_dsl.keys import KernelKey
from mslk_dsl.template import config_name
from mslk_dsl.templates import _rowwise_plan as plan
from mslk_dsl.templates import _rowwise_space as rowwise_space
from mslk_dsl.templates import moe_gather_scatter_flydsl, rmsnorm_flydsl, silu_mul_cute

# What each kernel's code must contain is declared by its template (Template.instructions:
# "ptx", "sass" for sm90a; "isa" for gfx942, kept with MSLK_DSL_KEEP_ISA=1).

# 16-byte vector accesses, for configs that move 16 bytes per access on 16-byte rows; 8- and
# 4-byte loads (four or two 16-bit elements) where the rows admit only those.
PTX_VECTOR = r"(ld|st)\.global(\.[\w:]+)*\.v4\.(b32|u32|f32)"
PTX_NARROW = {8: r"ld\.global(\.[\w:]+)*\.v2\.(b32|u32|f32)\s", 4: r"ld\.global(\.[\w:]+)*\.(b32|u32)\s"}
ISA_VECTOR = r"(global|buffer)_(load|store)_dwordx4"
ISA_NARROW = {8: r"\b(global|buffer)_load_dwordx2\s", 4: r"\b(global|buffer)_load_dword\s"}
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# The copies of a staged tile into shared memory (the FP8 quantizers' ``stage`` configs), with the
# L1 policy and the bytes of each copy.
PTX_STAGED = r"cp\.async\.(ca|cg)\.shared\.global\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(\d+)"
DEFAULT_PROBLEM = {"M": 4096, "N": 4096, "K": 4096, "T": 4096}
# Problems at the edges of the ops' coverage, whose heuristic picks are compiled beside the
# default's: long rows (clusters, streamed rests), short rows (per-head q / k norms: the
# short-row tiles and FlyDSL's sub-wave groups), rows of a few dozen elements (the 64-element
# one-element group tiles), MSLK's 320 experts (the 512-expert configs), and a single row or token.
EDGE_PROBLEMS = ({"N": 65536}, {"N": 262144}, {"N": 128, "K": 128, "D": 128}, {"N": 45, "K": 45, "D": 45},
                 {"E": 320}, {"M": 1, "T": 1, "A": 1})
ALL_CONFIGS = os.environ.get("MSLK_DSL_TEST_ALL_CONFIGS", "") == "1"


@dataclass(frozen=True)
class Case:
    """One kernel to compile: its id names template, config, target and signature values."""

    id: str
    job: aot.Job


def _case(template, config, target, sig) -> Case:
    key = KernelKey.make(template, config, target, sig)
    values = "_".join(str(v) for _, v in sorted(sig.items())) or "nosig"
    return Case(f"{template.name}-{config_name(config)}-{target}-{values}", aot.Job(key, template.name))


def _stable_order(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def _covering_sample(template, target, taken: set[str]) -> list[dict]:
    """The fewest configs, in hash order, that use every value of every config parameter that the
    configs already ``taken`` (by name) leave unused."""
    valid = [c for c in template.all_configs() if any(template.valid(c, target, s) for s in template.all_signatures())]
    unused = {(k, repr(v)) for c in valid for k, v in c.items()}
    unused -= {(k, repr(v)) for c in valid if config_name(c) in taken for k, v in c.items()}
    picked = []
    for config in sorted(valid, key=lambda c: _stable_order(config_name(c))):
        if not unused:
            break
        new = {(k, repr(v)) for k, v in config.items()} & unused
        if new:
            picked.append(config)
            unused -= new
    return picked


def cases(backend: str) -> list[Case]:
    found: dict[str, Case] = {}
    for t in registry.get_templates(backend=backend):
        sigs = t.all_signatures()
        for target in t.targets:
            defaults = {config_name(t.heuristic(target, sig, DEFAULT_PROBLEM)): None for sig in sigs}
            for sig in sigs:
                case = _case(t, t.heuristic(target, sig, DEFAULT_PROBLEM), target, sig)
                found.setdefault(case.job.key.digest, case)
            # each config the edge problems pick beyond the defaults, once: with the last
            # signature that picks it (an fp32 weight, a valid count; the sample takes the first)
            edge_picks: dict[str, tuple] = {}
            for sig in reversed(sigs):
                for edge in EDGE_PROBLEMS:
                    config = t.heuristic(target, sig, {**DEFAULT_PROBLEM, **edge})
                    if config_name(config) not in defaults:
                        edge_picks.setdefault(config_name(config), (config, sig))
            for config, sig in edge_picks.values():
                case = _case(t, config, target, sig)
                found.setdefault(case.job.key.digest, case)
            others = t.all_configs() if ALL_CONFIGS else _covering_sample(t, target, set(defaults))
            for config in others:
                for dtype in {s.get("dtype") for s in sigs}:
                    sig = next((s for s in sigs if s.get("dtype") == dtype and t.valid(config, target, s)), None)
                    if sig is not None:
                        case = _case(t, config, target, sig)
                        found.setdefault(case.job.key.digest, case)
    return sorted(found.values(), key=lambda c: c.id)


def selection(backend: str) -> list[aot.Job]:
    """The jobs of every case of ``backend`` (also planned again by the fresh process)."""
    return [c.job for c in cases(backend)]


def _selected(request, backend: str) -> list[aot.Job]:
    """The jobs of the cases of ``backend`` this run will execute (after -k and the like)."""
    jobs = {}
    for item in request.session.items:
        case = getattr(item, "callspec", None) and item.callspec.params.get(f"{backend}_case")
        if case is not None:
            jobs[case.job.key.digest] = case.job
    return list(jobs.values())


def _shared_output(tmp_path_factory, backend: str):
    """The session's build directory for ``backend``, the same for every test process: xdist
    gives each worker a base temporary directory of its own, side by side in the session's."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    out = base / f"compile-{backend}"
    out.mkdir(exist_ok=True)
    return out


def _this_process_first(jobs: list) -> list:
    """``jobs`` rotated to start at this test process's share (worker k of n starts k/n of the way
    in), so processes building the same list at once start apart and meet only at the end."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    start = int(worker.removeprefix("gw") or 0) * len(jobs) // max(1, count)
    return jobs[start:] + jobs[:start]


def _build(request, backend, out, env=None) -> dict:
    """Compile the selected cases of ``backend`` into the shared ``out``: digest -> Entry, or the
    error text of a job that failed. Built in rounds of a few runner tasks, each round skipping
    what another test process has published meanwhile."""
    jobs = _selected(request, backend)
    per_round = 4 * (runner.CUTE_JOBS_PER_TASK if backend == "cute" else runner.FLYDSL_JOBS_PER_TASK)
    ordered, failed, built, seconds = _this_process_first(jobs), {}, 0, 0.0
    with overridden(env or {}):
        for first in range(0, len(ordered), per_round):
            report = aot.build(ordered[first:first + per_round], str(out), workers=1, progress=False)
            failed.update(report.failed)
            built, seconds = built + len(report.built), seconds + report.seconds
    print(f"{backend}: {built} of {len(jobs)} kernels compiled by this process in {seconds:.0f}s")
    store = KernelCache(str(out))
    return {j.key.digest: failed.get(j.key.digest) or store.lookup(j.key) for j in jobs}


def _entry(built: dict, case: Case):
    """The case's compiled entry, checked for what a GPU would refuse or punish (its resource
    report: spills, shared memory / LDS and block size over the target's limits, occupancy under
    the template's floor; mslk_dsl.resources)."""
    entry = built[case.job.key.digest]
    if entry is None or isinstance(entry, str):
        pytest.fail(f"{case.id} failed to compile:\n{entry}")
    problems = resources.entry_problems(entry)
    assert not problems, f"{case.id}: resource problems:\n" + "\n".join(problems)
    return entry


@pytest.fixture(scope="module")
def cute_built(request, tmp_path_factory):
    out = _shared_output(tmp_path_factory, "cute")
    return out, _build(request, "cute", out)


@pytest.fixture(scope="module")
def flydsl_built(request, tmp_path_factory):
    if not have_lld():
        pytest.skip("FlyDSL needs ld.lld (apt-get install -y lld-19)")
    out = _shared_output(tmp_path_factory, "flydsl")
    return out, _build(request, "flydsl", out, env={"MSLK_DSL_KEEP_ISA": "gfx942"})


def _fresh_process_compiles_nothing(backend, out, built, env=None):
    jobs = [j for j in selection(backend) if j.key.digest in built]
    done = run_python(textwrap.dedent(f"""
        import json
        from mslk_dsl import aot
        from test_compile_templates import selection
        wanted = set({sorted(built)!r})
        jobs = [j for j in selection({backend!r}) if j.key.digest in wanted]
        report = aot.build(jobs, {str(out)!r}, workers=1, progress=False)
        print(json.dumps({{"built": len(report.built), "skipped": len(report.skipped)}}))
    """), env={"PYTHONPATH": os.path.dirname(__file__), **(env or {})})
    assert json.loads(done.stdout.splitlines()[-1]) == {"built": 0, "skipped": len(jobs)}


def _moves_16_bytes(key: dict) -> bool:
    sig, config = key["signature"], key["config"]
    esize = ELEMENT_BYTES.get(sig.get("dtype"), 0)
    return sig.get("vec_bytes") == 16 and "vec" in config and config["vec"] * esize == 16


def _narrow_bytes_of_16_bit(key: dict) -> int | None:
    """8 or 4 for a 16-bit row-wise kernel whose rows admit accesses that narrow, on a config of
    vectors (cut into four or two elements), not of one element; else None."""
    sig, config = key["signature"], key["config"]
    if sig.get("vec_bytes") in (8, 4) and ELEMENT_BYTES.get(sig.get("dtype")) == 2 and config.get("vec", 1) > 1:
        return sig["vec_bytes"]
    return None


# The row-wise ops whose one-element kernels run phased rows (CuTe: _cute_rowwise.PhasedRow,
# FlyDSL: _flydsl_rowwise.PhasedRow): the row's middle in 16-byte accesses where the call's
# tensors sit at one offset from a boundary.
PHASED_ROW_OPS = ("rmsnorm", "rmsnorm_add", "quantize_fp8_row", "silu_mul_quant", "silu_mul")


def _runs_phased_rows(key: dict) -> bool:
    """Whether ``key`` is a one-element kernel of PHASED_ROW_OPS with a phased path: CuTe's
    single-CTA ones (silu_mul: in tiles of at least PHASED_MIN_VECTORS vectors per thread),
    FlyDSL's as its templates say."""
    sig, config = key["signature"], key["config"]
    esize = ELEMENT_BYTES.get(sig.get("dtype"))
    if key["op"] not in PHASED_ROW_OPS or sig.get("vec_bytes") != esize or config.get("vec") != 1:
        return False
    if registry.get_template(key["template"]).backend == "flydsl":
        if key["op"] in ("rmsnorm", "rmsnorm_add"):
            return rmsnorm_flydsl.phased_rows(config, sig, key["op"] == "rmsnorm_add")
        return rowwise_space.phased_rows(config, sig)
    if "cluster" in config:
        return False
    phased = plan.phased_tile(plan.RowTile.of(config), esize)
    return key["op"] != "silu_mul" or phased.chunks >= silu_mul_cute.PHASED_MIN_VECTORS


def _patterns(key: dict, kind: str, vector_pattern: str = "") -> list[str]:
    """The regexes ``key``'s code of ``kind`` must match: its template's, and the 16-byte vector
    accesses of configs that move 16 bytes per access (the middle of phased rows included)."""
    patterns = list(registry.get_template(key["template"]).instructions.get(kind, []))
    if vector_pattern and (_moves_16_bytes(key) or _runs_phased_rows(key)):
        patterns.append(vector_pattern)
    return patterns


@pytest.mark.parametrize("cute_case", cases("cute"), ids=lambda c: c.id)
def test_cute_template_compiles(cute_case, cute_built):
    entry = _entry(cute_built[1], cute_case)
    key = entry.key_parts
    ptx = open(entry.file("kernel.ptx")).read()
    assert re.search(rf"\.target\s+{key['target'].replace('sm', 'sm_')}", ptx), entry.path
    assert os.path.getsize(entry.file("kernel.so")) > 0
    if key["target"] == "sm90a":
        for pattern in _patterns(key, "ptx", PTX_VECTOR):
            assert re.search(pattern, ptx), f"{cute_case.id}: no {pattern} in the PTX"
        if narrow := _narrow_bytes_of_16_bit(key):
            assert re.search(PTX_NARROW[narrow], ptx), f"{cute_case.id}: no {narrow}-byte load in the PTX"
    if _runs_phased_rows(key):
        # The phased path is a kernel of its own (_cute_rowwise.launch_rows): one kernel with both
        # paths takes the registers of the one-element path.
        entries = re.findall(r"\.entry\s+(\w+)", ptx)
        assert len(entries) == 2 and sum("_phased_kernel_" in e for e in entries) == 1, (cute_case.id, entries)
    if key["op"] in ("quantize_fp8_row", "silu_mul_quant"):
        _check_staged_copies(cute_case.id, key, ptx)
    if "swap" in key["config"] or key["op"].endswith("_grouped_stacked"):
        _check_swapped_store(cute_case.id, key, ptx)
    if key["op"] in ("rmsnorm", "rmsnorm_add") and _runs_phased_rows(key):
        _check_phased_weight_loads(cute_case.id, key, ptx)
    if key["signature"].get("fp32_residual"):
        # An fp32 residual beside 16-bit x: its accesses are twice as wide as x's and y's (two
        # 16-byte ones under a 16-byte vector of x; one fp32 element under one of x); none is
        # split narrower than the row admits. One-element rows run their middle phased, in
        # 16-byte accesses of both.
        widths = {_access_bytes(a) for a in re.findall(r"(?:ld|st)\.global[\w.:]*", ptx)}
        vec_bytes = key["signature"]["vec_bytes"]
        phased = {16} if _runs_phased_rows(key) else set()
        assert widths == {vec_bytes, min(2 * vec_bytes, 16)} | phased, (cute_case.id, widths)
    if key["op"] == "scatter_add_dense_tokens" and key["config"].get("method") in ("sorted", "linked"):
        # The sorted scatter counts with integer atomics, the linked one links rows with atomic
        # exchanges; both add the data without atomics.
        index_atomic = r"atom\.global(\.\w+)*\.add\.u32" if key["config"]["method"] == "sorted" else \
            r"atom\.global(\.\w+)*\.exch\.b32"
        assert re.search(index_atomic, ptx), entry.path
        assert not re.search(r"(red|atom)\.global(\.\w+)*\.add(\.noftz)?(\.v\d)?\.(bf16|f16|f32)", ptx), entry.path
    if key["target"] == "sm90a" and _patterns(key, "sass"):
        sass = subprocess.run([_nvdisasm(), entry.file("kernel.cubin")], capture_output=True, text=True,
                              check=True).stdout
        for pattern in _patterns(key, "sass"):
            assert re.search(pattern, sass), f"{cute_case.id}: no {pattern} in the SASS"


def _access_bytes(op: str) -> int:
    """Bytes one PTX global access moves, e.g. 16 for ld.global.v4.b32, 4 for st.global.b32."""
    m = re.search(r"(?:\.v(\d))?\.[bfsu](\d+)$", op)
    assert m, op
    return int(m.group(1) or 1) * int(m.group(2)) // 8


def _check_phased_weight_loads(case_id: str, key: dict, ptx: str) -> None:
    """A norm's phased kernel reads the weight of its aligned middle one element per load, or,
    with the "vectors" weight key, in 16-byte loads moved into place (funnel shifts for a 16-bit
    weight): then the only single-element loads of the weight's width are the row's edges (x,
    residual and weight: at most 3 per lane)."""
    phased = next(b for b in re.split(r"\.entry\s+", ptx)[1:] if "_phased_kernel_" in b.split("(", 1)[0])
    sig = key["signature"]
    width = "32" if sig["fp32_weight"] or ELEMENT_BYTES[sig["dtype"]] == 4 else "16"   # the weight's
    scalar = [op for op in re.findall(r"ld\.global[\w.:]*", phased)
              if ".v" not in op and re.search(rf"\.[bfu]{width}$", op)]
    if key["config"].get("weight") == "vectors":
        assert len(scalar) <= 3, (case_id, scalar)
        assert ("shf.r.wrap.b32" in phased) == (width == "16"), case_id
    else:
        assert len(scalar) > 3 and "shf.r.wrap.b32" not in phased, (case_id, scalar)


def _check_swapped_store(case_id: str, key: dict, ptx: str) -> None:
    """A GEMM's swapped tiles (the weight as wgmma's A, the tokens as its B) hold the output's
    transpose, so their epilogue writes shared memory with transposing stmatrix; unswapped
    tiles never transpose."""
    stores = set(re.findall(r"stmatrix\.sync\.aligned\.m8n8\.x\d(\.trans)?", ptx))
    assert stores == {".trans" if key["config"].get("swap") else ""}, (case_id, stores)


def _check_staged_copies(case_id: str, key: dict, ptx: str) -> None:
    """A staged tile's kernel copies the row's first tile into shared memory by cp.async, .cg
    for the "stream" policy's 16-byte copies, .ca otherwise, each copy a whole access; a one-element
    config stages only in its phased kernel; the register tiles use no cp.async."""
    config, sig = key["config"], key["signature"]
    for body in re.split(r"\.entry\s+", ptx)[1:]:
        copies = re.findall(PTX_STAGED, body)
        phased = body.split("(", 1)[0].find("_phased_kernel_") >= 0
        if config.get("stage") != "smem" or (config["vec"] == 1 and not phased):
            assert not copies, f"{case_id}: cp.async in a kernel that holds its tile in registers"
            continue
        assert copies, f"{case_id}: a staged tile without cp.async"
        access = 16 if config["vec"] == 1 else sig["vec_bytes"]
        policy = "cg" if config["l1"] == "stream" and access == 16 else "ca"
        assert set(copies) == {(policy, str(access))}, (case_id, set(copies))
        # one commit group, waited for before the first read of shared memory
        commit = body.find("cp.async.commit_group")
        wait = re.search(r"cp\.async\.wait_group\s+0;", body)
        first_read = re.search(r"ld\.shared", body)
        assert commit >= 0 and wait and first_read and commit < wait.start() < first_read.start(), case_id


def test_cute_kernels_are_found_by_a_fresh_process(cute_built):
    out, built = cute_built
    _fresh_process_compiles_nothing("cute", out, {d for d, e in built.items() if not isinstance(e, str)})


def test_the_sample_covers_every_dtype_and_config_value():
    """Every template x target x dtype has its default config, and every value of every config
    parameter that some signature can use is compiled for each template and target."""
    for backend in ("cute", "flydsl"):
        chosen = cases(backend)
        for t in registry.get_templates(backend=backend):
            for target in t.targets:
                mine = [c.job.key for c in chosen if c.job.template == t.name and c.job.key.target == target]
                for sig in t.all_signatures():
                    default = t.heuristic(target, sig, DEFAULT_PROBLEM)
                    assert any(k.signature == sig and k.config == default for k in mine), (t.name, target, sig)
                usable = {(k, repr(v)) for c in t.all_configs() for k, v in c.items()
                          if any(t.valid(c, target, s) for s in t.all_signatures())}
                assert usable <= {(k, repr(v)) for key in mine for k, v in key.config.items()}, (t.name, target)
    assert len({c.id for c in cases("cute")}) == len(cases("cute")), "case ids must be unique"


# What `make test` may compile: the whole run must stay under 30 minutes on a 2-core machine. It
# took 14-16 minutes with ~810 kernels (about 1 s a kernel in all: `make aot` built 3293 in 30
# minutes), the rest of the suite ~5 minutes; 13.5 minutes with 959 kernels, 15 with 1118, 18
# with 1168, 16.6 with 1210, 15.5 with 1292, 27.7 with 1337 (heavier kernels: phased rows, decode),
# 20.8 with 1337 once each gfx942 FlyDSL kernel was compiled once, not twice, for its ISA
# (docs/benchmarks.md, "AOT build on the CPU machine"); 1392 took 20.3 (CI: 19.7 minutes for the
# whole run), and the fp32-residual odd rows' defaults (every signature's default is compiled)
# brought the sample to 1404; 1450 kernels leave a margin. A template that multiplies the sample
# past this should thin its signatures or configs (the full matrix is `make aot`).
MAX_SAMPLED_KERNELS = 1450


def test_the_sample_stays_within_the_make_test_budget():
    if ALL_CONFIGS:
        pytest.skip("MSLK_DSL_TEST_ALL_CONFIGS=1 compiles everything on purpose")
    sampled = len(cases("cute")) + len(cases("flydsl"))
    assert sampled <= MAX_SAMPLED_KERNELS, f"{sampled} kernels sampled; make test budgets {MAX_SAMPLED_KERNELS}"


def _nvdisasm() -> str:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel (a test dependency), or on PATH."""
    found = resources.nvdisasm()
    assert found, "nvdisasm not found: pip install nvidia-cuda-nvdisasm (part of the test extra)"
    return found


@pytest.mark.parametrize("flydsl_case", cases("flydsl"), ids=lambda c: c.id)
def test_flydsl_template_compiles(flydsl_case, flydsl_built):
    entry = _entry(flydsl_built[1], flydsl_case)
    key = entry.key_parts
    assert os.path.getsize(entry.file("artifact.pkl")) > 0
    if key["target"] != "gfx942":  # the ISA is kept for gfx942 only (dumping it slows each compile ~1.4x)
        return
    isa = open(entry.file("kernel.s")).read()
    assert re.search(rf'\.amdgcn_target "amdgcn-amd-amdhsa-\w*-{key["target"]}', isa), entry.path
    loops = {name: labels for name, body in amd_kernels(isa).items() if (labels := descriptor_loops(body))}
    assert not loops, f"{flydsl_case.id}: readfirstlane loops (a buffer access through a per-lane descriptor): {loops}"
    for pattern in _patterns(key, "isa", ISA_VECTOR):
        assert re.search(pattern, isa), f"{flydsl_case.id}: no {pattern} in the ISA"
    if narrow := _narrow_bytes_of_16_bit(key):
        assert re.search(ISA_NARROW[narrow], isa), f"{flydsl_case.id}: no {narrow}-byte load in the ISA"
    if key["op"] == "scatter_add_dense_tokens" and key["config"].get("method") == "sorted":
        _check_sorted_scatter_isa(key, isa)
    if key["op"] in ("gather_scale_dense_tokens", "scatter_add_dense_tokens"):
        _check_run_time_block_sizes(key, isa)
    if key["template"] in ROW_GROUP_TEMPLATES:
        _check_row_groups_isa(key, isa)


def test_flydsl_kernels_are_found_by_a_fresh_process(flydsl_built):
    out, built = flydsl_built
    _fresh_process_compiles_nothing("flydsl", out, {d for d, e in built.items() if not isinstance(e, str)},
                                    env={"MSLK_DSL_KEEP_ISA": "gfx942"})


def _check_run_time_block_sizes(key, isa):
    """MoE row kernels take their block size at launch (up to 1024 work-items, 512 where the
    template says so): their code objects must declare that max_flat_workgroup_size (with no
    declaration it is 256)."""
    sizes = dict((name, int(n)) for n, name in
                 re.findall(r"\.max_flat_workgroup_size:\s+(\d+)\s*\n\s*\.name:\s+(\S+)", isa))
    rows = {name: n for name, n in sizes.items() if re.search(r"_(gather|scatter|reduce)$", name)}
    expected = moe_gather_scatter_flydsl.block_threads(key["config"], key["signature"])
    assert rows and set(rows.values()) == {expected}, f"{key['template']} {key['config']}: {sizes}"


# FlyDSL templates whose rows are owned by _flydsl_rowwise.RowGroups, by whether they reduce over
# a row (norms, FP8 row scales).
ROW_GROUP_TEMPLATES = {"silu_mul_flydsl": False, "quantize_fp8_row_flydsl": True, "silu_mul_quant_flydsl": True,
                       "gather_scale_quant_flydsl": True, "rmsnorm_flydsl.rmsnorm": True,
                       "rmsnorm_flydsl.rmsnorm_add": True}


def waterfall_loops(isa: str) -> list[str]:
    """The labels that an ``s_cbranch_execnz`` jumps back to (a loop over the lanes' values)."""
    seen, loops = set(), []
    for line in isa.splitlines():
        if m := re.match(r"^(\.\w+):", line):
            seen.add(m.group(1))
        elif m := re.search(r"s_cbranch_execnz\s+(\.\w+)", line):
            if m.group(1) in seen:
                loops.append(m.group(1))
    return loops


def _check_row_groups_isa(key, isa):
    """Row-wise kernels keep every buffer descriptor wave-uniform: a descriptor that differs
    between lanes (as a sub-wave group's own row would) makes the compiler loop over the lanes'
    values (a waterfall loop, closed by a backward s_cbranch_execnz; a forward one is only an
    if / else on a uniform condition, e.g. the phased rows' test). Their row reductions stop at the
    group's width: a 16-lane group reads each sum from lane 15 of its 16-lane row (no row_bcast),
    a 32-lane group joins pairs of rows (row_bcast:15) and reads lanes 31 and 63, and only whole
    waves fold into lane 63 (row_bcast:31); a wider fold would mix rows."""
    what = f"{key['template']} {key['config']} {key['signature']}"
    assert not waterfall_loops(isa), f"{what}: a buffer descriptor differs between lanes (waterfall loop)"
    if not ROW_GROUP_TEMPLATES[key["template"]]:
        return
    config = key["config"]
    width = config["threads"] // config.get("rows_per_block", config.get("rows"))
    if width >= 64:
        assert "row_bcast:31" in isa, f"{what}: no whole-wave reduction"
        return
    assert "row_bcast:31" not in isa and ("row_bcast:15" in isa) == (width == 32), f"{what}: reduction wider than {width} lanes"
    for last in range(width - 1, 64, width):
        assert re.search(rf"v_readlane_b32 \w+, \w+, {last}\b", isa), f"{what}: no group total read from lane {last}"


def _isa_kernels(isa: str) -> dict[str, str]:
    """Each kernel's code in an AMDGPU ISA dump, by symbol name (label to .Lfunc_end)."""
    return {m.group(1): m.group(2)
            for m in re.finditer(r"^(\w+):\n(.*?)^\.Lfunc_end", isa, re.M | re.S)}


def _check_sorted_scatter_isa(key, isa):
    """The sorted scatter (gfx942) counts with int32 atomics that return the old value, adds the
    data without atomics (no float atomic, no compare-and-swap loop), and its reduce kernel moves
    16 bytes per load on aligned rows."""
    kernels = _isa_kernels(isa)
    what = f"{key['template']} {key['config']} {key['signature']}"
    count = [code for name, code in kernels.items() if name.endswith("_count")]
    reduce = [code for name, code in kernels.items() if name.endswith("_reduce")]
    assert len(count) == 1 and len(reduce) == 1, f"{what}: kernels {sorted(kernels)}"
    # sc0 (glc before gfx940) on an atomic: it returns the old value (the row's position).
    assert re.search(r"\b(global|buffer)_atomic_add(_u32)?\s+v\d+,[^\n]*\b(sc0|glc)\b", count[0]), what
    assert not re.search(r"_atomic_(pk_)?add_(f16|bf16|f32|f64)|_atomic_cmpswap", isa), what
    if key["signature"]["vec_bytes"] == 16:
        assert re.search(r"\b(global|buffer)_load_dwordx4\b", reduce[0]), what
