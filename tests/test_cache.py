"""Keys, the disk cache and the JIT lifecycle, on the tiny scale_copy test template (CuTe)."""
import ast
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from support import run_python, tree_snapshot

import mslk_dsl.templates
from mslk_dsl import jit, keys, registry
from mslk_dsl.cache import KernelCache
from mslk_dsl.errors import DamagedEntryWarning, KernelNotPrebuiltError
from mslk_dsl.keys import KernelKey

CONFIG, TARGET, SIG = {"threads": 128}, "sm90a", {"factor": 2}


def template():
    return registry.get_template("scale_copy_cute")


def key(**changes):
    parts = dict(config=CONFIG, target=TARGET, signature=SIG)
    parts.update(changes)
    return KernelKey.make(template(), parts["config"], parts["target"], parts["signature"])


def build():
    jit._memo.clear()
    return jit.get_kernel(template(), CONFIG, TARGET, SIG)


def build_in_child():
    """Populate the cache from another process, so this one has not mapped the library (damaging
    a mapped library in place would crash this process, not test the cache)."""
    run_python("from mslk_dsl import jit, registry\n"
               "jit.get_kernel(registry.get_template('scale_copy_cute'), {'threads': 128}, 'sm90a', {'factor': 2})")


# -- keys ---------------------------------------------------------------------------------------
def test_key_changes_with_config_target_signature():
    base = key().digest
    assert key(config={"threads": 256}).digest != base
    assert key(target="sm80").digest != base
    assert key(signature={"factor": 3}).digest != base
    assert key().digest == base  # and is stable


def test_key_changes_with_dsl_version(monkeypatch):
    base = key().digest
    versions = dict(keys.dsl_versions("cute"), **{"nvidia-cutlass-dsl": "9.9.9"})
    monkeypatch.setattr(keys, "dsl_versions", lambda backend: versions)
    assert key().digest != base


def test_key_changes_with_codegen_env(monkeypatch):
    base = key().digest
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
    assert key().digest != base


def test_key_changes_with_template_source_and_local_imports(tmp_path):
    folder = tmp_path / "tpl"
    folder.mkdir()
    (folder / "_helpers.py").write_text("SCALE = 1\n")
    main = folder / "thing.py"
    main.write_text("from mslk_dsl.templates import _helpers\nX = 1\n")
    first = keys.template_digest(str(main))
    keys.template_digest.cache_clear()
    (folder / "_helpers.py").write_text("SCALE = 2\n")
    assert keys.template_digest(str(main)) != first, "editing an imported helper must change the key"
    keys.template_digest.cache_clear()
    second = keys.template_digest(str(main))
    main.write_text("from mslk_dsl.templates import _helpers\nX = 2\n")
    keys.template_digest.cache_clear()
    assert keys.template_digest(str(main)) != second
    keys.template_digest.cache_clear()


def _local_imports_by_syntax_tree(source: bytes) -> set[str]:
    """The reference reading of keys._local_imports: the syntax tree's import statements."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level >= 1 and not mod:
                names.update(a.name for a in node.names)
            elif node.level >= 1:
                names.add(mod.split(".")[0])
            elif mod == "mslk_dsl.templates":
                names.update(a.name for a in node.names)
            elif mod.startswith("mslk_dsl.templates."):
                names.add(mod.split(".")[2])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("mslk_dsl.templates."):
                    names.add(a.name.split(".")[2])
    return {n for n in names if n.startswith("_")}


TEMPLATE_FILES = sorted(glob.glob(os.path.join(mslk_dsl.templates.__path__[0], "*.py"))
                        + glob.glob(os.path.join(os.path.dirname(__file__), "fixtures", "user_templates", "*.py")))


@pytest.mark.parametrize("path", TEMPLATE_FILES, ids=os.path.basename)
def test_local_imports_read_from_text_match_the_syntax_tree(path):
    """The digest finds a template's helpers with regular expressions (fast); they must find
    exactly what the syntax tree says, so digests (and existing bundles' keys) do not change."""
    source = open(path, "rb").read()
    assert keys._local_imports(source) == _local_imports_by_syntax_tree(source)
    # ... and so the digest is the one computed from the syntax tree.
    seen, pending = {}, [path]
    while pending:
        p = pending.pop()
        if p not in seen and os.path.exists(p):
            seen[p] = open(p, "rb").read()
            pending += [os.path.join(os.path.dirname(path), f"{m}.py") for m in _local_imports_by_syntax_tree(seen[p])]
    h = hashlib.sha256()
    for p in sorted(seen):
        h.update(os.path.basename(p).encode() + b"\0" + seen[p] + b"\0")
    keys.template_digest.cache_clear()
    assert keys.template_digest(path) == h.hexdigest()


def test_local_imports_read_from_text_handle_every_import_form():
    source = textwrap.dedent("""
        import os, mslk_dsl.templates._plain as p
        from . import _rel_a, public, _rel_b as b
        from ._rel_mod.sub import thing
        from .. import _two_dots
        from mslk_dsl.templates import (
            _paren_a,  # a comment
            _paren_b as pb,
        )
        from mslk_dsl.templates import _cont_a, \\
            _cont_b
        from mslk_dsl.templates._dotted.deep import x
        import mslk_dsl.templates.public_one
        x = 1; from . import _after_semicolon
        if True: import mslk_dsl.templates._after_colon
        def build():
            from mslk_dsl.templates import _nested as n
        from .import _no_space
        from mslk_dsl.templates \\
            import _continued_head
        from mslk_dsl.template import Template
        import fromage, imports
        reimport = "must not import mslk_dsl.templates._in_prose"
    """).encode()
    expected = {"_plain", "_rel_a", "_rel_b", "_rel_mod", "_two_dots", "_paren_a", "_paren_b", "_cont_a",
                "_cont_b", "_dotted", "_after_semicolon", "_after_colon", "_nested", "_no_space",
                "_continued_head"}
    assert _local_imports_by_syntax_tree(source) == expected
    assert keys._local_imports(source) == expected


def test_key_never_contains_sizes():
    parts = key().parts()
    assert set(parts) == {"op", "backend", "template", "template_digest", "config", "target", "signature",
                          "framework_version", "dsl_versions", "codegen_env", "target_spec", "compile_options"}


# -- cache + JIT ----------------------------------------------------------------------------------
def test_compile_then_fresh_process_compiles_nothing(cache_dir):
    build()
    assert jit.stats["compile"] == 1
    entry = KernelCache(str(cache_dir)).lookup(key())
    assert entry is not None and {"kernel.so", "meta.json"} <= set(os.listdir(entry.path))
    meta = json.loads(open(entry.file("meta.json")).read())
    assert meta["key"]["config"] == CONFIG and meta["files"]["kernel.so"]["size"] > 0
    out = run_python(textwrap.dedent("""
        import json, sys
        from mslk_dsl import jit, registry
        jit.get_kernel(registry.get_template("scale_copy_cute"), {"threads": 128}, "sm90a", {"factor": 2})
        print(json.dumps(dict(jit.stats)))
        assert "cutlass" not in sys.modules, "loading a cached kernel must not import the compiler"
    """))
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats.get("compile", 0) == 0 and stats["disk"] == 1


def test_memo_serves_repeat_calls(cache_dir):
    first = build()
    assert jit.get_kernel(template(), CONFIG, TARGET, SIG) is first
    assert jit.stats["memo"] == 1


def test_four_processes_compile_a_missing_key_once(cache_dir):
    code = textwrap.dedent("""
        import json
        from mslk_dsl import jit, registry
        jit.get_kernel(registry.get_template("scale_copy_cute"), {"threads": 256}, "sm90a", {"factor": 3})
        print(json.dumps(dict(jit.stats)))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ)) for _ in range(4)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r.get("compile", 0) for r in results) == 1, results
    assert all(r.get("compile", 0) + r.get("disk", 0) == 1 for r in results), results
    assert len(KernelCache(str(cache_dir)).entries()) == 1


@pytest.mark.parametrize("damage", ["truncate", "garbage", "zero", "no_meta", "bad_meta"])
def test_damaged_entry_is_removed_and_rebuilt(cache_dir, damage):
    build_in_child()
    entry = KernelCache(str(cache_dir)).lookup(key())
    lib = entry.file("kernel.so")
    if damage == "truncate":
        data = open(lib, "rb").read()
        open(lib, "wb").write(data[: len(data) // 2])
    elif damage == "garbage":
        size = os.path.getsize(lib)
        open(lib, "wb").write(os.urandom(size))
    elif damage == "zero":
        open(lib, "wb").close()
    elif damage == "no_meta":
        os.remove(entry.file("meta.json"))
    else:
        open(entry.file("meta.json"), "w").write("{not json")
    jit.stats.clear()
    with pytest.warns(DamagedEntryWarning, match="damaged"):
        build()
    assert jit.stats["compile"] == 1, "the damaged entry must be rebuilt"
    assert KernelCache(str(cache_dir)).lookup(key()) is not None


def test_unloadable_entry_is_removed_and_rebuilt(cache_dir):
    """An artifact whose hash matches meta.json but which cannot be loaded is rebuilt too."""
    build_in_child()
    entry = KernelCache(str(cache_dir)).lookup(key())
    meta = json.load(open(entry.file("meta.json")))
    meta["load"]["symbol"] = "no_such_symbol"
    json.dump(meta, open(entry.file("meta.json"), "w"))
    jit.stats.clear()
    with pytest.warns(DamagedEntryWarning, match="cannot be loaded"):
        build()
    assert jit.stats["compile"] == 1


def test_read_only_bundle_is_used_without_writes(cache_dir, tmp_path, monkeypatch):
    build()
    bundle = tmp_path / "bundle"
    shutil.copytree(cache_dir, bundle, ignore=shutil.ignore_patterns(".locks", ".staging", ".trash"))
    for dirpath, _, files in os.walk(bundle):
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o444)
        os.chmod(dirpath, 0o555)
    before = tree_snapshot(bundle)
    empty_cache = tmp_path / "other-cache"
    out = run_python(textwrap.dedent("""
        import json
        from mslk_dsl import jit, registry
        jit.get_kernel(registry.get_template("scale_copy_cute"), {"threads": 128}, "sm90a", {"factor": 2})
        print(json.dumps(dict(jit.stats)))
    """), env={"MSLK_DSL_AOT_PATH": str(bundle), "MSLK_DSL_CACHE_DIR": str(empty_cache),
               "MSLK_DSL_DISABLE_JIT": "1"})
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats == {"bundle": 1}
    assert tree_snapshot(bundle) == before, "a read-only layer must not be written"
    assert not os.path.exists(empty_cache / "sm90a"), "nothing is copied into the writable cache"


def test_jit_off_miss_names_key_and_build_line(cache_dir, monkeypatch):
    monkeypatch.setenv("MSLK_DSL_DISABLE_JIT", "1")
    with pytest.raises(KernelNotPrebuiltError) as err:
        build()
    text = str(err.value)
    assert "scale_copy" in text and "sm90a" in text and "threads128" in text
    assert "mslk-dsl aot build --op scale_copy --target sm90a --config threads128 --sig factor=2" in text


def test_jit_disabled_context_manager(cache_dir):
    with jit.jit_disabled():
        with pytest.raises(KernelNotPrebuiltError):
            build()
    build()  # allowed again outside the block
    assert jit.stats["compile"] == 1


def test_jit_off_error_explains_version_mismatch(cache_dir, monkeypatch):
    build()
    versions = dict(keys.dsl_versions("cute"), **{"nvidia-cutlass-dsl": "9.9.9"})
    monkeypatch.setattr(keys, "dsl_versions", lambda backend: versions)
    monkeypatch.setenv("MSLK_DSL_DISABLE_JIT", "1")
    jit._memo.clear()
    with pytest.raises(KernelNotPrebuiltError) as err:
        jit.get_kernel(template(), CONFIG, TARGET, SIG)
    # a package-set miss names the packages to install, not a build command
    message = str(err.value)
    assert "dsl_versions" in message and "installed DSL packages differ" in message
    assert "Build it with" not in message


def test_prune_keeps_newest_within_size(cache_dir):
    store = KernelCache(str(cache_dir))
    for threads in (128, 256):
        for factor in (2, 3):
            jit._memo.clear()
            jit.get_kernel(template(), {"threads": threads}, TARGET, {"factor": factor})
    entries = store.entries()
    assert len(entries) == 4
    now = 1_700_000_000
    for age, e in enumerate(sorted(entries, key=lambda e: e.path)):
        os.utime(e.file("meta.json"), (now + age, now + age))
    newest = sorted(entries, key=store.last_used, reverse=True)
    budget = newest[0].size + newest[1].size
    removed = store.prune(budget)
    kept = {e.path for e in store.entries()}
    assert kept == {newest[0].path, newest[1].path}
    assert len(removed) == 2
