"""Torture: several processes build, prune, verify and serve on one cache while random ones are
killed with SIGKILL; afterwards the cache verifies, and every kernel any process reported built
is served with its own bytes. Uses the stand-in backend (tests/fake_backend.py), so a build takes
tens of milliseconds and the whole run stays within about half a minute.

The figures are printed (run with -s to see them): processes, kills, builds, prunes, verifies,
entries served, and the findings that must be zero: torn (bytes of no kernel), stale (another
key's kernel), lost (a reported build gone without any removal), damaged entries, errors.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import fake_backend
import pytest

from mslk_dsl import jit
from mslk_dsl.cache import KernelCache

HERE = os.path.dirname(os.path.abspath(__file__))
PROCESSES = 4
SECONDS = float(os.environ.get("MSLK_DSL_TORTURE_SECONDS", "20"))


def _start(log_dir, deadline, seed) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(HERE, "torture_worker.py"),
                             os.path.join(log_dir, f"{seed}.jsonl"), str(deadline), str(seed)],
                            env={**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_torture_build_prune_verify_serve_with_kills(cache_dir, tmp_path, monkeypatch):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    rng = random.Random(1234)
    deadline = time.time() + SECONDS
    seed = 0
    procs = []
    for _ in range(PROCESSES):
        seed += 1
        procs.append(_start(log_dir, deadline, seed))
    started, kills = PROCESSES, 0
    while time.time() < deadline - 1.0:
        time.sleep(rng.uniform(0.5, 2.0))
        victim = rng.randrange(len(procs))
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait()
        kills += 1
        if time.time() < deadline - 2.0:
            seed += 1
            procs[victim] = _start(log_dir, deadline, seed)
            started += 1
    for p in procs:
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail("a torture process did not stop at its deadline")
        assert p.returncode in (0, -signal.SIGKILL), err[-2000:]

    events = []
    for name in os.listdir(log_dir):
        with open(log_dir / name) as f:
            for line in f:
                if line.endswith("\n"):  # a killed writer may leave half a line
                    events.append(json.loads(line))
    counts = Counter(e["event"] for e in events)
    errors = [e for e in events if e["event"] == "error"]
    damaged = [p for e in events if e["event"] == "verified" for p in e["problems"]]

    # Every kernel reported built: still there and served with its own bytes, without
    # compiling, unless a removal of it was logged after the build began (then it is rebuilt
    # here). The build publishes the entry before its "built" line is written, so a prune in
    # between removes it legitimately: a build counts from its start.
    fake = fake_backend.install(monkeypatch)
    store = KernelCache(str(cache_dir))
    store.sweep()  # leftovers of the killed builds
    final_problems = store.verify_all()
    removed_at: dict[str, float] = {}
    for e in events:
        if e["event"] == "removing":
            removed_at[e["digest"]] = max(removed_at.get(e["digest"], 0.0), e["t"])
    built = {}
    for e in events:
        if e["event"] == "built":
            built[e["digest"]] = (max(built.get(e["digest"], (0.0,))[0], e["started"]), e["threads"], e["factor"])
    lost, served_after, wrong_after = [], 0, []
    for digest, (t, threads, factor) in built.items():
        want = fake_backend.expected({"threads": threads}, "sm90a", {"factor": factor})
        jit._memo.clear()
        present = store.lookup(fake_backend.key(threads, factor)) is not None
        if not present and removed_at.get(digest, 0.0) < t:
            lost.append(digest)
            continue
        compiles_before = fake.compiles
        text = fake_backend.get(threads, factor)()
        if text != want or (present and fake.compiles != compiles_before):
            wrong_after.append(digest)
        served_after += 1

    figures = {
        "processes": started, "kills": kills, "builds": counts["built"], "prunes": counts["pruned"],
        "verifies": counts["verified"], "served during the run": counts["served"],
        "misses (JIT off, not built yet)": counts["miss"], "distinct kernels built": len(built),
        "served after the run": served_after, "torn": counts["torn"], "stale": counts["stale"],
        "lost": len(lost), "damaged": len(damaged) + len(final_problems), "errors": len(errors),
    }
    print("\ntorture figures: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    assert counts["built"] > 0 and counts["served"] > 0 and counts["pruned"] > 0 and kills > 0, figures
    assert errors == [], errors[:5]
    assert counts["torn"] == counts["stale"] == 0, [e for e in events if e["event"] in ("torn", "stale")][:5]
    assert damaged == [] and final_problems == [], (damaged[:5], final_problems[:5])
    assert lost == [] and wrong_after == [], (lost, wrong_after)
    assert store.leftovers() == []
