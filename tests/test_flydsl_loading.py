"""Loading a compiled FlyDSL kernel (backends/flydsl.py, flydsl_abi.py) builds no template and
sets no environment variable, and packs a call's arguments exactly as FlyDSL's own launcher
does. Real kernels are compiled for gfx942 on the CPU; the loaded callables are called with the
GPU runtime replaced by a function that records the packed argument slots (no ROCm here)."""
import json
import subprocess
import sys
import textwrap

import pytest
from support import have_lld

from mslk_dsl import registry
from mslk_dsl.targets import get_target

# One kernel with tensors and a stream, one with a float scalar too; default configs only.
KERNELS = {"silu_mul_flydsl": {"dtype": "bfloat16", "vec_bytes": 16},
           "rmsnorm_flydsl.rmsnorm": {"dtype": "bfloat16", "vec_bytes": 2}}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not have_lld():
        pytest.skip("FlyDSL needs ld.lld (apt-get install -y lld-19)")
    from mslk_dsl.backends import flydsl

    out = tmp_path_factory.mktemp("flydsl-load")
    items = []
    for name, sig in KERNELS.items():
        template = registry.get_template(name)
        config = template.valid_configs("gfx942", sig)[0]
        items.append((template, config, get_target("gfx942"), sig, str(out / name)))
        (out / name).mkdir()
    results = flydsl.compile_many(items)   # a child process: this one never imports flydsl
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return {name: (str(out / name), meta, item[1]) for (name, item), meta in zip(zip(KERNELS, items), results)}


def test_the_abi_is_recorded_in_the_load_information(built):
    for name, (_, meta, _) in built.items():
        abi = meta["load"]["abi"]
        assert abi["backend"] == "rocm" and abi["defaults"] == [None], name   # the stream may be left out
        kinds = [slot["kind"] for slot in abi["slots"]]
        # silu_mul: x0, x1, out and the one-element row count; rmsnorm: x, weight, out
        assert kinds.count("tensor_data") == (4 if name == "silu_mul_flydsl" else 3), name
        assert kinds[-1] == "stream", name
    assert [s["ctype"] for s in built["rmsnorm_flydsl.rmsnorm"][1]["load"]["abi"]["slots"]
            if s["kind"] == "scalar"] == ["float"]


_PROBE = textwrap.dedent('''
    import ctypes, json, os, sys
    import torch
    from mslk_dsl import registry
    from mslk_dsl.backends import flydsl

    name, folder, meta, config = json.loads(sys.argv[1])

    class Entry:
        def file(self, f):
            return os.path.join(folder, f)
    entry = Entry()
    entry.meta = meta

    def no_template(*args, **kwargs):
        raise AssertionError("loading built a template")
    get_template = registry.get_template
    registry.get_template = no_template
    environ = dict(os.environ)
    kernel = flydsl.load_artifact(entry)
    assert dict(os.environ) == environ, "loading changed the environment"
    assert not [m for m in sys.modules if m.endswith(name.split(".")[0])], "loading imported the template"

    from flydsl.compiler.jit_executor import CallState

    def recorder(spec, seen):
        """FlyDSL's dispatch of ``spec``, with the GPU entry replaced by a copy of each slot."""
        sizes = [ctypes.sizeof(ctype) for _, ctype, _ in spec]
        return CallState(spec, lambda packed: seen.append(
            [ctypes.string_at(packed[i], size) for i, size in enumerate(sizes)]))

    ours = []
    kernel.compiled._call_state = recorder(kernel.compiled._call_spec, ours)
    kernel.compiled._runtime_ready = True
    dtype = torch.bfloat16
    if name == "silu_mul_flydsl":
        base = torch.randn(7, 300, dtype=dtype)
        count = torch.full((1,), 3, dtype=torch.int32)     # valid_token_count: rows from 3 on untouched
        args = (base[:5, :200], torch.randn(5, 200, dtype=dtype), torch.empty(5, 200, dtype=dtype), count)
    else:
        x = torch.randn(9, 4097, dtype=dtype)
        args = (x[1:6], torch.randn(4097, dtype=dtype), torch.empty(5, 4097, dtype=dtype), 1e-5)
    kernel(*args)                                   # the stream left out: its default
    assert dict(os.environ) == environ, "calling changed the environment"

    # FlyDSL's own packing of the same call, through the template's launcher.
    registry.get_template = get_template
    from flydsl.compiler.jit_function import _build_call_spec
    launcher, _ = get_template(name).build(config, "gfx942", meta["key"]["signature"])
    launcher._ensure_sig()
    bound = launcher._sig.bind(*args)
    bound.apply_defaults()
    theirs = []
    recorder(_build_call_spec(launcher._sig, tuple(bound.arguments.values())), theirs)(tuple(bound.arguments.values()))
    assert len(ours) == len(theirs) == 1 and ours == theirs, (ours, theirs)
    print(json.dumps({"slots": len(ours[0])}))
''')


@pytest.mark.parametrize("name", KERNELS)
def test_loading_builds_no_template_sets_no_variable_and_packs_like_flydsl(built, name):
    """In a fresh process (FlyDSL only, never beside the CuTe DSL): the load, then one call of the
    loaded kernel and of the template's launcher on the same odd-sized, row-strided tensors."""
    folder, meta, config = built[name]
    meta = {**meta, "key": {"signature": KERNELS[name]}}
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps([name, folder, meta, config])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.splitlines()[-1])["slots"] == len(meta["load"]["abi"]["slots"])


def test_an_entry_without_a_recorded_abi_is_damaged(tmp_path):
    from mslk_dsl.backends import flydsl
    from mslk_dsl.cache import CorruptEntry

    class Entry:
        meta = {"load": {"artifact": "artifact.pkl", "flydsl_cache_subdir": "x", "flydsl_cache_file": "y.pkl"}}

        def file(self, name):
            return str(tmp_path / name)

    with pytest.raises(CorruptEntry, match="no call ABI"):
        flydsl.load_artifact(Entry())


class _StandInJit:
    """What compile_dumping_isa reads of a @flyc.jit function: a call that compiles (or is
    served from memory), the last compile, the cache manager and its key form."""

    func = None

    def __init__(self, compiles: bool):
        self.compiles, self._last_compiled, self.saved = compiles, ("old-key", "old-artifact"), {}
        self.cache_manager = self

    def __call__(self, *args):
        import os

        assert os.environ.get("FLYDSL_DEBUG_DUMP_ASM") == "1"
        if self.compiles:
            self._last_compiled = ("key", "artifact")

    def set(self, key, value):
        self.saved[key] = value

    @staticmethod
    def _cache_key_to_str(key):
        return f"str-{key}"


def test_the_isa_compile_persists_what_it_compiled_and_refuses_a_call_served_from_memory(tmp_path):
    """The one compile that dumps the ISA also stands for the kernel: its artifact goes into
    FlyDSL's cache. A call FlyDSL served from memory compiled nothing, so an earlier compile's
    artifact must not be taken for it."""
    import os

    from mslk_dsl.backends.flydsl_child import compile_dumping_isa
    from mslk_dsl.errors import CompileError

    jit = _StandInJit(compiles=True)
    compile_dumping_isa(jit, (), str(tmp_path))
    assert jit.saved == {"str-key": "artifact"} and "FLYDSL_DEBUG_DUMP_ASM" not in os.environ
    stale = _StandInJit(compiles=False)
    with pytest.raises(CompileError, match="compiled nothing"):
        compile_dumping_isa(stale, (), str(tmp_path))
    assert stale.saved == {} and "FLYDSL_DEBUG_DUMP_ASM" not in os.environ
