"""The AOT runner, bundles, bundle wheels and JIT-off serving (scale_copy test template)."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import fake_backend
import pytest
from support import run_python, tree_snapshot

from mslk_dsl import aot, cli, jit
from mslk_dsl.aot import manifest as aot_manifest
from mslk_dsl.aot import runner
from mslk_dsl.aot.wheel import package_bundle
from mslk_dsl.cache import KernelCache
from mslk_dsl.targets import get_target

HERE = os.path.dirname(os.path.abspath(__file__))
MANIFEST = os.path.join(HERE, "fixtures", "manifests", "scale_copy.toml")


def cute_jobs():
    return aot.expand(aot.load_manifest(MANIFEST), targets=["sm90a"])


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """One CuTe bundle of the test manifest, built with 2 workers, shared by the tests below."""
    out = str(tmp_path_factory.mktemp("bundle") / "b")
    report = aot.build(cute_jobs(), out, workers=2, progress=False)
    assert report.ok and len(report.built) == 4, report
    aot.write_bundle_manifest(out)
    return out


def test_manifest_expands_to_the_product_minus_invalid():
    jobs = aot.expand(aot.load_manifest(MANIFEST))
    # 2 configs x 2 signatures, on sm90a (CuTe) and on gfx942 + gfx950 (FlyDSL)
    assert len(jobs) == 12
    assert len({j.key.digest for j in jobs}) == 12
    narrowed = aot.expand(aot.load_manifest(MANIFEST), targets=["gfx942"],
                          overrides={"configs": ["threads128"], "signatures": {"factor": [3]}})
    assert [(j.key.target, j.key.config, j.key.signature) for j in narrowed] == \
        [("gfx942", {"threads": 128}, {"factor": 3})]


def test_default_manifest_covers_every_registered_op():
    jobs = aot.expand(aot.load_manifest("default"))
    from mslk_dsl import registry

    assert {j.key.op for j in jobs} == {t.op for t in registry.get_templates()}
    assert {j.key.target for j in jobs} <= {"sm90a", "gfx942", "gfx950"}


def test_shards_split_the_jobs_deterministically():
    jobs = aot.expand(aot.load_manifest(MANIFEST))
    a, b = aot_manifest.shard(jobs, 1, 2), aot_manifest.shard(jobs, 2, 2)
    assert sorted(j.key.digest for j in a + b) == sorted(j.key.digest for j in jobs)
    assert not {j.key.digest for j in a} & {j.key.digest for j in b}
    with pytest.raises(ValueError):
        aot_manifest.shard(jobs, 3, 2)


def test_second_build_compiles_nothing(bundle):
    report = aot.build(cute_jobs(), bundle, workers=2, progress=False)
    assert report.built == [] and len(report.skipped) == 4


def test_shards_merge_into_the_unsharded_bundle(bundle, tmp_path):
    jobs = cute_jobs()
    for i in (1, 2):
        assert aot.build(aot_manifest.shard(jobs, i, 2), str(tmp_path / f"s{i}"), workers=1, progress=False).ok
    merged = aot.merge_bundles(str(tmp_path / "merged"), [str(tmp_path / "s1"), str(tmp_path / "s2")])
    whole = json.load(open(os.path.join(bundle, "manifest.json")))
    assert {k["digest"] for k in merged["kernels"]} == {k["digest"] for k in whole["kernels"]}
    assert aot.verify_bundle(str(tmp_path / "merged")) == []
    # The CuTe DSL toolchain is deterministic: the same key gives the same bytes on every shard.
    shas = {k["digest"]: k["files"]["kernel.so"]["sha256"] for k in whole["kernels"]}
    assert {k["digest"]: k["files"]["kernel.so"]["sha256"] for k in merged["kernels"]} == shas
    out = run_python(textwrap.dedent(f"""
        import json
        from mslk_dsl import jit
        from mslk_dsl.keys import KernelKey
        for k in json.load(open({str(tmp_path / "merged" / "manifest.json")!r}))["kernels"]:
            jit.load_prebuilt(KernelKey.from_parts(k["key"]))
        print(json.dumps(dict(jit.stats)))
    """), env={"MSLK_DSL_AOT_PATH": str(tmp_path / "merged"), "MSLK_DSL_DISABLE_JIT": "1"})
    assert json.loads(out.stdout.splitlines()[-1]) == {"bundle": 4}


def test_a_failing_job_is_reported_and_the_rest_build(tmp_path, monkeypatch):
    jobs = cute_jobs()
    broken = jobs[0]
    # A key whose template cannot be resolved in the worker stands in for a compiler error.
    jobs[0] = aot.Job(broken.key, "no_such_template")
    report = aot.build(jobs, str(tmp_path / "out"), workers=1, progress=False)
    assert len(report.built) == 3 and list(report.failed) == [broken.key.digest]
    assert "no_such_template" in report.failed[broken.key.digest]
    assert "op=scale_copy" in report.failed[broken.key.digest]


def test_a_kernel_published_while_waiting_is_reported_present_not_built(tmp_path, monkeypatch):
    """Two builds of one output at once (two `aot build` runs, two test processes) compile each
    kernel once; the one that finds a kernel the other published while it waited for the lock
    reports it as already present, not as built by itself."""
    backend = fake_backend.install(monkeypatch)
    out = str(tmp_path / "out")
    first, second = fake_backend.key(128, 2), fake_backend.key(256, 2)
    # the other process: publishes `first`
    [(entry, compiled)] = jit.build_batch(KernelCache(out, writable=True),
                                          [(first, fake_backend.template(), get_target(first.target))])
    assert compiled and entry is not None
    results = runner._build_task([(first.parts(), "scale_copy_cute"), (second.parts(), "scale_copy_cute")], out)
    assert [(digest, error, compiled) for digest, error, _, compiled in results] == \
        [(first.digest, None, False), (second.digest, None, True)]
    assert backend.compiles == 2


def test_serving_from_a_bundle_with_jit_off_imports_no_compiler(bundle, tmp_path):
    """Every kernel of the bundle loads in a fresh process with JIT off, nothing compiles, and
    neither DSL is imported; a kernel missing from the bundle names its build line."""
    out = run_python(textwrap.dedent("""
        import json, sys
        from mslk_dsl import jit, registry
        from mslk_dsl.errors import KernelNotPrebuiltError
        t = registry.get_template("scale_copy_cute")
        scans = []  # installed distributions are scanned for bundle wheels only after a miss
        scan = jit._bundle_entry_points
        jit._bundle_entry_points = lambda: scans.append(1) or scan()
        for threads in (128, 256):
            for factor in (2, 3):
                jit.get_kernel(t, {"threads": threads}, "sm90a", {"factor": factor})
        scans_before_miss = len(scans)
        try:
            jit.get_kernel(t, {"threads": 128}, "sm80", {"factor": 2})
            raise SystemExit("expected KernelNotPrebuiltError")
        except KernelNotPrebuiltError as e:
            message = str(e)
        print(json.dumps({"stats": dict(jit.stats), "message": message, "scans": [scans_before_miss, len(scans)],
                           "dsls": [m for m in ("cutlass", "flydsl") if m in sys.modules]}))
    """), env={"MSLK_DSL_AOT_PATH": bundle, "MSLK_DSL_DISABLE_JIT": "1",
               "MSLK_DSL_CACHE_DIR": str(tmp_path / "empty")})
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["stats"] == {"bundle": 4}
    assert result["scans"] == [0, 1]
    assert result["dsls"] == []
    assert "mslk-dsl aot build --op scale_copy --target sm80 --config threads128 --sig factor=2" in result["message"]


def test_read_only_bundle_directory(bundle, tmp_path):
    ro = tmp_path / "ro"
    shutil.copytree(bundle, ro)
    for dirpath, _, files in os.walk(ro):
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o444)
        os.chmod(dirpath, 0o555)
    before = tree_snapshot(ro)
    assert aot.verify_bundle(str(ro)) == []
    run_python("from mslk_dsl import jit, registry\n"
               "jit.get_kernel(registry.get_template('scale_copy_cute'), {'threads': 256}, 'sm90a', {'factor': 3})",
               env={"MSLK_DSL_AOT_PATH": str(ro), "MSLK_DSL_DISABLE_JIT": "1",
                    "MSLK_DSL_CACHE_DIR": str(tmp_path / "c")})
    assert tree_snapshot(ro) == before


def test_verify_catches_a_flipped_byte(bundle, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    assert cli.main(["aot", "verify", str(copy)]) == 0
    lib = next(p for p in copy.rglob("kernel.so"))
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0x01
    lib.write_bytes(bytes(data))
    problems = aot.verify_bundle(str(copy))
    assert any("sha256" in p for p in problems), problems
    assert cli.main(["aot", "verify", str(copy)]) == 1


def test_packaged_bundle_wheel_is_served_after_pip_install(bundle, tmp_path):
    wheel = package_bundle(bundle, "testkit", str(tmp_path / "dist"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "mslk_dsl_bundle_testkit/manifest.json" in names
    assert any(n.endswith("entry_points.txt") for n in names)
    # A fresh venv that sees this environment's packages through a .pth (torch, tvm_ffi, mslk_dsl).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    parent_site = [p for p in sys.path if p.endswith("site-packages")][0]
    (site / "parent.pth").write_text(f"import site; site.addsitedir({parent_site!r})\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), wheel],
                   check=True)
    code = textwrap.dedent("""
        import json, sys
        from mslk_dsl import jit, registry
        t = registry.get_template("scale_copy_cute")
        jit.get_kernel(t, {"threads": 256}, "sm90a", {"factor": 2})
        print(json.dumps({"stats": dict(jit.stats), "roots": jit._bundle_roots("", True)}))
    """)
    env = {**os.environ, "MSLK_DSL_DISABLE_JIT": "1", "MSLK_DSL_CACHE_DIR": str(tmp_path / "empty")}
    env.pop("MSLK_DSL_AOT_PATH", None)
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["stats"] == {"bundle": 1}
    assert any(r.endswith("mslk_dsl_bundle_testkit") for r in result["roots"])


def test_cli_cache_and_explain(cache_dir, bundle, capsys):
    assert cli.main(["aot", "build", "--manifest", MANIFEST, "--target", "sm90a", "--config", "threads128",
                     "--sig", "factor=2", "--workers", "1", "--progress", "lines"]) == 0
    assert "built 1" in capsys.readouterr().out
    assert cli.main(["cache", "ls", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["op"], r["config"]) for r in rows] == [("scale_copy", {"threads": 128})]
    assert cli.main(["cache", "stats"]) == 0
    assert "1 entries" in capsys.readouterr().out
    assert cli.main(["explain", "scale_copy", "--target", "sm90a", "--sig", "factor=2",
                     "--config", "threads128"]) == 0
    assert "HIT in cache" in capsys.readouterr().out
    assert cli.main(["explain", "scale_copy", "--target", "sm90a", "--sig", "factor=3",
                     "--config", "threads128"]) == 1  # a miss
    text = capsys.readouterr().out
    assert "MISS" in text and "signature: wanted" in text
    assert cli.main(["cache", "verify"]) == 0
    assert cli.main(["cache", "prune", "--max-size", "0"]) == 0
    assert KernelCache(str(cache_dir)).entries() == []
    capsys.readouterr()
    assert cli.main(["templates", "--json"]) == 0
    assert any(t["op"] == "scale_copy" for t in json.loads(capsys.readouterr().out))
