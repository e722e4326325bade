"""The filesystem steps (mslk_dsl/fs.py) and the error hierarchy."""
import hashlib
import os
import subprocess
import sys
import threading

import pytest

from mslk_dsl import errors, fs


def test_atomic_write_replaces_whole_and_leaves_no_temp(tmp_path):
    path = str(tmp_path / "f.json")
    fs.atomic_write(path, "old")
    fs.atomic_write(path, b"new")
    assert open(path).read() == "new"
    assert os.listdir(tmp_path) == ["f.json"]


def test_atomic_write_failure_keeps_the_old_file_and_removes_the_temp(tmp_path, monkeypatch):
    path = str(tmp_path / "f.json")
    fs.atomic_write(path, "old")

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fs.os, "replace", full)
    with pytest.raises(OSError):
        fs.atomic_write(path, "new")
    assert open(path).read() == "old"
    assert os.listdir(tmp_path) == ["f.json"]


def test_replacing_publishes_a_finished_file_and_drops_a_failed_one(tmp_path):
    """A file another program writes (a compiler's output, a wheel's zip) appears whole or not
    at all: the old file stays when the writer fails, and no temporary is left either way."""
    path = str(tmp_path / "x.whl")
    with fs.replacing(path) as tmp:
        open(tmp, "w").write("one")
    with pytest.raises(RuntimeError), fs.replacing(path) as tmp:
        open(tmp, "w").write("half")
        raise RuntimeError("killed mid-write")
    assert open(path).read() == "one" and os.listdir(tmp_path) == ["x.whl"]


def test_concurrent_writers_of_one_file_never_collide(tmp_path):
    """Each writer has its own temp name (one shared `.tmp` name made concurrent writers replace
    each other's temp file and fail with FileNotFoundError)."""
    path = str(tmp_path / "manifest.json")
    failures = []

    def writer(n):
        try:
            for i in range(200):
                fs.atomic_write(path, f"{n}:{i}")
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            failures.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert os.listdir(tmp_path) == ["manifest.json"]


def test_remove_tree_tolerates_another_remover(tmp_path):
    for n in range(20):
        tree = tmp_path / f"t{n}"
        for d in range(20):
            (tree / f"d{d}").mkdir(parents=True)
            (tree / f"d{d}" / "f").write_text("x")
    results, failures = [], []

    def remover():
        for n in range(20):
            try:
                results.append(fs.remove_tree(str(tmp_path / f"t{n}")))
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                failures.append(e)

    threads = [threading.Thread(target=remover) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert not any(p.name.startswith("t") for p in tmp_path.iterdir())
    assert fs.remove_tree(str(tmp_path / "never")) is False


def test_remove_tree_through_trash_hides_the_tree_at_once(tmp_path):
    tree = tmp_path / "entry"
    tree.mkdir()
    (tree / "meta.json").write_text("{}")
    assert fs.remove_tree(str(tree), trash_dir=str(tmp_path / ".trash"))
    assert not tree.exists() and os.listdir(tmp_path / ".trash") == []


def test_publish_dir_replaces_a_leftover(tmp_path):
    staging, final = tmp_path / "s", tmp_path / "a" / "b"
    staging.mkdir()
    (staging / "f").write_text("new")
    final.mkdir(parents=True)
    (final / "f").write_text("old")
    fs.publish_dir(str(staging), str(final))
    assert (final / "f").read_text() == "new" and not staging.exists()


def test_is_locked_sees_a_lock_held_by_another_process(tmp_path):
    path = str(tmp_path / "k.lock")
    assert fs.is_locked(path) is False
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; from filelock import FileLock\n"
                               f"l = FileLock({path!r}); l.acquire(); print('held', flush=True); time.sleep(30)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert fs.is_locked(path) is True
    finally:
        holder.kill()
        holder.wait()
    assert fs.is_locked(path) is False


def test_sha256_file(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(os.urandom(3 << 20))
    assert fs.sha256_file(str(p)) == hashlib.sha256(p.read_bytes()).hexdigest()


def test_every_error_derives_from_one_base_and_keeps_its_builtin_type():
    assert issubclass(errors.KernelNotPrebuiltError, errors.MslkDslError)
    assert issubclass(errors.KernelNotPrebuiltError, RuntimeError)
    assert issubclass(errors.CompileError, RuntimeError)
    assert issubclass(errors.UnsupportedDeviceError, NotImplementedError)
    assert issubclass(errors.UnsupportedDeviceError, ValueError)
    assert issubclass(errors.BackendUnavailableError, RuntimeError)
    assert issubclass(errors.CacheError, OSError)
    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, Exception) and not issubclass(c, Warning)]
    assert all(issubclass(c, errors.MslkDslError) for c in classes if c is not errors.MslkDslError)


def test_overridden_environment_is_put_back(monkeypatch):
    import os

    from mslk_dsl.env import overridden

    monkeypatch.setenv("MSLK_TEST_SET", "before")
    monkeypatch.delenv("MSLK_TEST_UNSET", raising=False)
    with overridden({"MSLK_TEST_SET": "during", "MSLK_TEST_UNSET": "during"}):
        assert os.environ["MSLK_TEST_SET"] == os.environ["MSLK_TEST_UNSET"] == "during"
    assert os.environ["MSLK_TEST_SET"] == "before" and "MSLK_TEST_UNSET" not in os.environ
