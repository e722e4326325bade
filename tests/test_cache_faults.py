"""The cache, the build path and AOT bundles under faults: full disks, unwritable or misplaced
cache directories, leftovers of killed builds, maintenance racing builds, malformed meta.json,
damaged bundle entries. A stand-in backend (fake_backend) replaces the DSL compile."""
import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import fake_backend
import pytest
from fake_backend import expected, get, key

from mslk_dsl import aot, fs, jit
from mslk_dsl.aot import runner
from mslk_dsl.aot.bundle import merge_bundles, verify_bundle, write_bundle_manifest
from mslk_dsl.cache import STAGING, KernelCache
from mslk_dsl.errors import CacheError, DamagedEntryWarning

HERE = os.path.dirname(os.path.abspath(__file__))
MANIFEST = os.path.join(HERE, "fixtures", "manifests", "scale_copy.toml")
KEYS = [(128, 2), (128, 3), (256, 2), (256, 3)]


@pytest.fixture
def fake(cache_dir, monkeypatch):
    return fake_backend.install(monkeypatch)


def served_ok(threads, factor) -> bool:
    return get(threads, factor)() == expected({"threads": threads}, "sm90a", {"factor": factor})


def leftovers(root) -> list[str]:
    staging = os.path.join(root, STAGING)
    return os.listdir(staging) if os.path.isdir(staging) else []


@contextlib.contextmanager
def tmpfs(path, size: str, read_only: bool = False):
    """A size-limited (or read-only) tmpfs at ``path``; skips the test where it cannot be mounted."""
    os.makedirs(path, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# -- the build path ---------------------------------------------------------------------------------
def test_fake_backend_builds_once_then_loads(fake, cache_dir):
    assert served_ok(128, 2)
    jit._memo.clear()
    assert served_ok(128, 2)
    assert fake.compiles == 1 and jit.stats["disk"] == 1


def test_an_entry_pruned_between_publish_and_load_is_built_again(fake, cache_dir, monkeypatch):
    """Another process's size-bounded prune may remove an entry right after this one published it
    (seen in the torture test): the builder compiles it again instead of failing the call."""
    publish = KernelCache.publish

    def publish_then_pruned(self, *args, **kwargs):
        entry = publish(self, *args, **kwargs)
        if fake.compiles == 1:   # the first build only: a concurrent prune removes it at once
            shutil.rmtree(entry.path)
        return entry

    monkeypatch.setattr(KernelCache, "publish", publish_then_pruned)
    assert served_ok(128, 2)
    assert fake.compiles == 2


def test_full_disk_gives_one_clear_line_and_leaves_no_staging(fake, cache_dir, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs, "atomic_write", full)
    with pytest.raises(CacheError) as err:
        get(128, 2)
    message = str(err.value)
    assert "\n" not in message and "disk is full" in message and str(cache_dir) in message
    assert "MSLK_DSL_CACHE_DIR" in message
    assert leftovers(cache_dir) == [], "a failed publish must not hide a finished kernel in .staging"


def test_compiler_hitting_a_full_disk_is_reported_as_such(cache_dir, monkeypatch):
    backend = fake_backend.install(monkeypatch)

    def compile_into_full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(backend, "compile", compile_into_full_disk)
    with pytest.raises(CacheError, match="disk is full"):
        get(128, 2)
    assert leftovers(cache_dir) == []


def test_full_tmpfs_cache(tmp_path, monkeypatch):
    """A real full filesystem: 64 KiB of tmpfs, artifacts of 24 KiB. Builds fail with one clear
    line once it is full, nothing is left in .staging, and what was published still serves."""
    root = tmp_path / "small"
    with tmpfs(root, "64k"):
        monkeypatch.setenv("MSLK_DSL_CACHE_DIR", str(root / "cache"))
        fake_backend.install(monkeypatch, size=24 << 10)
        served, errors_seen = [], []
        for threads, factor in KEYS:
            jit._memo.clear()
            try:
                assert served_ok(threads, factor)
                served.append((threads, factor))
            except CacheError as e:
                errors_seen.append(str(e))
        assert errors_seen, "64 KiB cannot hold four 24 KiB kernels"
        assert all("disk is full" in e and "\n" not in e for e in errors_seen), errors_seen
        assert leftovers(root / "cache") == []
        assert KernelCache(str(root / "cache")).verify_all() == []
        for threads, factor in served:
            jit._memo.clear()
            assert served_ok(threads, factor)


def test_read_only_cache_dir_gives_one_clear_line(tmp_path, monkeypatch):
    root = tmp_path / "ro"
    with tmpfs(root, "1m", read_only=True):
        monkeypatch.setenv("MSLK_DSL_CACHE_DIR", str(root))
        fake_backend.install(monkeypatch)
        jit._memo.clear()
        with pytest.raises(CacheError) as err:
            get(128, 2)
        assert "not writable" in str(err.value) and str(root) in str(err.value)
        assert "MSLK_DSL_CACHE_DIR" in str(err.value) and "\n" not in str(err.value)


def test_unwritable_cache_without_a_mount(fake, cache_dir, monkeypatch):
    """The same as above where no read-only mount can be made (and for non-root users)."""
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(cache_dir))

    monkeypatch.setattr(fs, "lock", denied)
    with pytest.raises(CacheError, match="not writable"):
        get(128, 2)


def test_cache_dir_that_is_a_file(fake, cache_dir):
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    cache_dir.write_text("not a directory")
    with pytest.raises(CacheError) as err:
        get(128, 2)
    assert str(cache_dir) in str(err.value) and "MSLK_DSL_CACHE_DIR" in str(err.value)
    with pytest.raises(CacheError, match="is a file"):
        jit.cache().entries()  # `cache ls` must not report 0 entries and succeed


def test_small_max_size_still_returns_the_kernel_just_built(fake, cache_dir, monkeypatch):
    monkeypatch.setenv("MSLK_DSL_CACHE_MAX_SIZE", "1")
    for threads, factor in KEYS:
        assert served_ok(threads, factor)
    store = KernelCache(str(cache_dir))
    assert [e.key_parts["config"] for e in store.entries()] == [{"threads": 256}], \
        "the entry just built is kept; older ones go"
    assert store.lookup(key(256, 3)) is not None


# -- leftovers of killed builds -----------------------------------------------------------------------
def _dead_build(root, digest, age: float = 0.0) -> str:
    path = os.path.join(root, STAGING, f"{digest}-99999-deadbeef")
    os.makedirs(path)
    with open(os.path.join(path, "kernel.so"), "w") as f:
        f.write("finished but never published")
    os.makedirs(path + "-flydsl-work")
    if age:
        for p in (path, path + "-flydsl-work"):
            os.utime(p, (time.time() - age, time.time() - age))
    return path


def test_stale_staging_is_listed_and_removed_by_prune_verify_and_clear(fake, cache_dir):
    assert served_ok(128, 2)
    store = KernelCache(str(cache_dir))
    for sweep in (lambda: store.prune(1 << 30), lambda: store.verify_all(repair=True), store.clear):
        dead = _dead_build(str(cache_dir), key(256, 3).digest)
        assert {p for p, _ in store.leftovers(stale_only=True)} == {dead, dead + "-flydsl-work"}
        sweep()
        assert leftovers(cache_dir) == []
    assert [p for p, _ in store.verify_all()] == []


def test_verify_reports_a_stale_staging_dir(fake, cache_dir):
    dead = _dead_build(str(cache_dir), key(128, 2).digest)
    problems = dict(KernelCache(str(cache_dir)).verify_all())
    assert "unfinished build" in problems[dead]


def test_a_build_in_progress_is_not_swept(fake, cache_dir):
    store = KernelCache(str(cache_dir))
    with store.lock(key(128, 2)):
        live = store.staging_dir(key(128, 2))
        assert store.leftovers(stale_only=True) == []
        store.prune(0)
        store.verify_all(repair=True)
        store.clear()
        assert os.path.isdir(live)
    assert store.leftovers(stale_only=True) == [(live, "unfinished build left by a process that died")]


def test_killing_the_parent_of_aot_build_leaves_no_worker(tmp_path):
    """kill -9 of the process that owns the worker pool: the workers exit within seconds."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from mslk_dsl.aot import runner
        pool = runner.pool(2)
        futures = [pool.submit(time.sleep, 120) for _ in range(2)]
        time.sleep(1.5)
        print(" ".join(str(p) for p in pool._processes), flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 5
    alive = pids
    while alive and time.time() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.1)
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert alive == [], "workers kept running after their parent was killed"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- maintenance racing builds ----------------------------------------------------------------------
def test_prune_and_verify_treat_vanished_entries_as_gone(fake, cache_dir, monkeypatch):
    for threads, factor in KEYS:
        assert served_ok(threads, factor)
    store = KernelCache(str(cache_dir))
    real_entry_dirs = store._entry_dirs

    def listed_then_removed_by_another_process():
        paths = real_entry_dirs()
        for p in paths[:2]:
            fs.remove_tree(p)
        return paths

    monkeypatch.setattr(store, "_entry_dirs", listed_then_removed_by_another_process)
    assert store.verify_all() == [], "entries pruned meanwhile are not 'meta.json is missing'"
    store.prune(0)  # never FileNotFoundError


def test_concurrent_prunes_and_builds_never_fail(fake, cache_dir):
    store = KernelCache(str(cache_dir))
    failures = []

    def pruner():
        for _ in range(30):
            try:
                store.prune(0)
                store.verify_all(repair=True)
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                failures.append(repr(e))

    threads = [threading.Thread(target=pruner) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(10):
        for threads_, factor in KEYS:
            jit._memo.clear()
            assert served_ok(threads_, factor)
    for t in threads:
        t.join()
    assert failures == []


# -- malformed meta.json ------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["no_size", "files_list", "meta_list", "key_string"])
def test_malformed_meta_is_discarded_with_a_warning(fake, cache_dir, damage):
    assert served_ok(128, 2)
    entry = KernelCache(str(cache_dir)).lookup(key(128, 2))
    meta = json.load(open(entry.file("meta.json")))
    if damage == "no_size":
        del meta["files"][fake_backend.ARTIFACT]["size"]
    elif damage == "files_list":
        meta["files"] = [fake_backend.ARTIFACT]
    elif damage == "meta_list":
        meta = [meta]
    else:
        meta["key"] = "oops"
    json.dump(meta, open(entry.file("meta.json"), "w"))
    store = KernelCache(str(cache_dir))
    assert store.entries() == []  # `cache ls` / `stats` skip it
    assert len(store.verify_all()) == 1  # `cache verify` reports it
    assert jit.nearest_entry(key(128, 3)) is None  # explain's nearest-entry search skips it
    jit._memo.clear()
    with pytest.warns(DamagedEntryWarning):
        assert served_ok(128, 2)
    assert fake.compiles == 2


# -- AOT output and bundles ------------------------------------------------------------------------
def cute_jobs():
    return aot.expand(aot.load_manifest(MANIFEST), targets=["sm90a"])


def test_aot_build_copies_kernels_already_in_the_cache(fake, cache_dir, tmp_path):
    jobs = cute_jobs()
    for job in jobs:
        jit.get_kernel(fake_backend.template(), job.key.config, "sm90a", job.key.signature)
    assert fake.compiles == len(jobs)
    out = str(tmp_path / "out")
    report = runner.build(jobs, out, workers=1, progress=False)
    assert sorted(report.copied) == sorted(j.key.digest for j in jobs) and report.built == []
    write_bundle_manifest(out)
    assert verify_bundle(out) == []
    assert fake.compiles == len(jobs), "nothing was compiled again"


def _fake_bundle(path, cache_dir) -> str:
    shutil.copytree(cache_dir, path, ignore=shutil.ignore_patterns(".locks", ".staging", ".trash"))
    write_bundle_manifest(str(path))
    return str(path)


def test_merge_prefers_good_copies_and_reports_damaged_ones(fake, cache_dir, tmp_path):
    for threads, factor in KEYS:
        assert served_ok(threads, factor)
    a = _fake_bundle(tmp_path / "a", cache_dir)
    b = _fake_bundle(tmp_path / "b", cache_dir)
    out = _fake_bundle(tmp_path / "out", cache_dir)
    damaged = os.path.relpath(KernelCache(str(cache_dir)).lookup(key(128, 2)).path, str(cache_dir))
    out_damaged = os.path.relpath(KernelCache(str(cache_dir)).lookup(key(256, 3)).path, str(cache_dir))
    with open(os.path.join(a, damaged, fake_backend.ARTIFACT), "w") as f:
        f.write("flipped")
    with open(os.path.join(out, out_damaged, fake_backend.ARTIFACT), "w") as f:
        f.write("flipped")
    problems = []
    with pytest.warns(DamagedEntryWarning):
        manifest = merge_bundles(out, [a, b], problems)
    assert len(manifest["kernels"]) == 4
    assert verify_bundle(out) == []
    assert any(damaged in p and "good copy from another source" in p for p in problems), problems
    assert any(out_damaged in p for p in problems), problems


def test_merge_reports_an_entry_no_source_has_whole(fake, cache_dir, tmp_path):
    assert served_ok(128, 2)
    a = _fake_bundle(tmp_path / "a", cache_dir)
    rel = os.path.relpath(KernelCache(str(cache_dir)).lookup(key(128, 2)).path, str(cache_dir))
    os.remove(os.path.join(a, rel, fake_backend.ARTIFACT))
    out = str(tmp_path / "out")
    problems = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        manifest = merge_bundles(out, [a], problems)
    assert manifest["kernels"] == [] and verify_bundle(out) == []
    assert len(problems) == 1 and "no source has a good copy" in problems[0]
    assert any(issubclass(w.category, DamagedEntryWarning) for w in seen)


def test_bundle_manifest_that_is_not_an_object(tmp_path):
    (tmp_path / "manifest.json").write_text("[1, 2]")
    from mslk_dsl.aot.bundle import read_bundle_manifest

    with pytest.raises(ValueError, match="not a bundle manifest"):
        read_bundle_manifest(str(tmp_path))
    assert any("not a bundle manifest" in p for p in verify_bundle(str(tmp_path)))


# -- backends --------------------------------------------------------------------------------------
def test_cute_compile_notes_are_silenced_and_other_warnings_pass():
    import importlib.util

    from mslk_dsl.backends import cute

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with cute.quiet_dsl_notes():
            warnings.warn("Dynamic variable in block size 128, 1, 1, cannot auto-generate `nvvm.reqntid`",
                          UserWarning, stacklevel=1)
            warnings.warn("something the author must see", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something the author must see"]
    # The DSL still words the note this way (read from its source, without importing it).
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None:
        pytest.skip("nvidia-cutlass-dsl is not installed")
    source = os.path.join(spec.submodule_search_locations[0], "dsl_packages", "cutlass", "cutlass_dsl", "cutlass.py")
    assert "cannot auto-generate `nvvm.reqntid`" in open(source).read()


def test_backends_implement_the_protocol():
    """Each backend module has every method of the Backend protocol, with its parameters (by
    position: the jit calls them positionally)."""
    import inspect

    from mslk_dsl.backends import Backend, cute, flydsl

    methods = [n for n, v in vars(Backend).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert set(methods) == {"compile", "compile_many", "load"}
    for module in (cute, flydsl):
        for name in methods:
            want = list(inspect.signature(getattr(Backend, name)).parameters)[1:]   # less self
            got = list(inspect.signature(getattr(module, name)).parameters)
            assert len(got) == len(want), (module.__name__, name, got, want)


def test_read_only_aot_output_gives_one_clear_line(tmp_path):
    out = tmp_path / "ro-out"
    with tmpfs(out, "1m", read_only=True):
        with pytest.raises(CacheError) as err:
            runner.build(cute_jobs(), str(out), workers=1, progress=False)
        assert "not writable" in str(err.value) and "--out" in str(err.value) and "\n" not in str(err.value)


def test_two_builds_writing_one_bundle_manifest_never_collide(fake, cache_dir, tmp_path):
    assert served_ok(128, 2)
    out = _fake_bundle(tmp_path / "b", cache_dir)
    failures = []

    def writer():
        try:
            for _ in range(50):
                write_bundle_manifest(out)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            failures.append(repr(e))

    threads = [threading.Thread(target=writer) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and verify_bundle(out) == []
    assert sorted(os.listdir(out)) == ["manifest.json", "sm90a"]


def test_a_killed_writers_temp_file_is_swept(fake, cache_dir):
    assert served_ok(128, 2)
    temp = fs.temp_name(os.path.join(str(cache_dir), "manifest.json"))
    open(temp, "w").close()
    store = KernelCache(str(cache_dir))
    assert store.leftovers() == []  # could still be being written
    old = time.time() - 3600
    os.utime(temp, (old, old))
    assert [p for p, _ in store.leftovers()] == [temp]
    store.prune(1 << 30)
    assert not os.path.exists(temp)


# -- what the command line shows of it ---------------------------------------------------------------
def test_cache_stats_lists_leftovers_and_merge_names_damaged_entries(fake, cache_dir, tmp_path, capsys):
    from mslk_dsl import cli

    assert served_ok(128, 2) and served_ok(256, 3)
    dead = _dead_build(str(cache_dir), key(256, 2).digest, age=7200)
    assert cli.main(["cache", "stats"]) == 0
    out = capsys.readouterr().out
    assert "leftovers of unfinished builds" in out and dead in out
    a = _fake_bundle(tmp_path / "a", cache_dir)
    damaged = os.path.relpath(KernelCache(str(cache_dir)).lookup(key(128, 2)).path, str(cache_dir))
    with open(os.path.join(a, damaged, fake_backend.ARTIFACT), "w") as f:
        f.write("flipped")
    with pytest.warns(DamagedEntryWarning):
        assert cli.main(["aot", "merge", str(tmp_path / "out"), a]) == 0
    out = capsys.readouterr().out
    assert "DAMAGED" in out and damaged in out and "1 damaged entries not copied" in out
