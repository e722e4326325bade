"""One process of the cache torture test (tests/test_torture.py): until a deadline, pick at random
to build, prune, verify or serve kernels of the stand-in backend on one shared cache, logging
every outcome as a JSON line (flushed at once: the process may be killed at any instant).

argv: log file, deadline (time.time()), random seed. Every removal of an entry is logged *before*
it happens, so the test can tell a kernel that was pruned from one that was lost.
"""
import json
import os
import random
import sys
import time

import fake_backend

from mslk_dsl import jit
from mslk_dsl.cache import KernelCache

THREADS, FACTORS = (64, 128, 256), (2, 3, 4, 5)


def main() -> int:
    log_path, deadline, seed = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    log = open(log_path, "a", buffering=1)

    def record(event: str, **fields) -> None:
        log.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")

    class LoggedCache(KernelCache):
        def _remove(self, path):
            record("removing", digest=os.path.basename(path))
            return super()._remove(path)

    store = LoggedCache(jit.cache().root)
    jit.cache = lambda: store
    fake_backend.install(delay=rng.uniform(0.02, 0.2), size=rng.choice((0, 2048, 16384)))
    record("start")
    while time.time() < deadline:
        threads, factor = rng.choice(THREADS), rng.choice(FACTORS)
        action = rng.choices(("build", "serve", "prune", "verify"), weights=(4, 4, 1, 1))[0]
        try:
            if action in ("build", "serve"):
                jit._memo.clear()
                before = jit.stats["compile"]
                started = time.time()   # a build is published before its "built" line is written
                if action == "serve":
                    with jit.jit_disabled():
                        kernel = jit.load_prebuilt(fake_backend.key(threads, factor))
                else:
                    kernel = fake_backend.get(threads, factor)
                text = kernel()
                want = fake_backend.expected({"threads": threads}, "sm90a", {"factor": factor})
                if text != want:
                    kind = "stale" if text.startswith("{") and text.endswith("}") else "torn"
                    record(kind, threads=threads, factor=factor, got=text[:200])
                elif jit.stats["compile"] > before:
                    record("built", threads=threads, factor=factor, digest=fake_backend.key(threads, factor).digest,
                           started=started)
                else:
                    record("served", threads=threads, factor=factor)
            elif action == "prune":
                removed = store.prune(rng.choice((0, 8 << 10, 64 << 10)))
                record("pruned", count=len(removed))
            else:
                problems = store.verify_all(repair=rng.random() < 0.5)
                record("verified", problems=[why for _, why in problems
                                             if not why.startswith(("unfinished build", "left over"))])
        except Exception as e:  # noqa: BLE001 - every unexpected failure is a finding
            if type(e).__name__ == "KernelNotPrebuiltError":
                record("miss")
            else:
                record("error", action=action, error=f"{type(e).__name__}: {e}")
    record("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
