"""A stand-in compiler backend for cache and lifecycle tests that need no DSL compile.

``install()`` makes ``jit`` build and load through it: compiling writes one artifact whose bytes
are a function of the key's config, target and signature (``expected``), padded to ``size``
bytes, after ``delay`` seconds; loading returns a callable that gives the artifact's text back,
so a test can check that a served kernel is exactly the one its key names. Keys are real keys of
the scale_copy_cute test template; nothing here imports a DSL.
"""
import json
import os
import time

from mslk_dsl import jit, registry
from mslk_dsl.keys import KernelKey

ARTIFACT = "artifact.txt"
TARGET = "sm90a"


def template():
    return registry.get_template("scale_copy_cute")


def key(threads: int, factor: int) -> KernelKey:
    return KernelKey.make(template(), {"threads": threads}, TARGET, {"factor": factor})


def expected(config: dict, target: str, signature: dict) -> str:
    return json.dumps({"config": config, "target": target, "signature": signature}, sort_keys=True)


class FakeBackend:
    def __init__(self, delay: float = 0.0, size: int = 0):
        self.delay, self.size, self.compiles = delay, size, 0

    def compile(self, template, config, target, signature, out_dir) -> dict:
        if self.delay:
            time.sleep(self.delay)
        text = expected(dict(config), target.name, dict(signature))
        with open(os.path.join(out_dir, ARTIFACT), "w") as f:
            f.write(text + " " * max(0, self.size - len(text)))
        self.compiles += 1
        return {"load": {"artifact": ARTIFACT}}

    def compile_many(self, items) -> list:
        out = []
        for item in items:
            try:
                out.append(self.compile(*item))
            except Exception as e:
                out.append(e)
        return out

    def load(self, entry):
        with open(entry.file(entry.meta["load"]["artifact"])) as f:
            text = f.read().rstrip(" ")
        return lambda: text


def install(monkeypatch=None, **options) -> FakeBackend:
    backend = FakeBackend(**options)
    if monkeypatch is not None:
        monkeypatch.setattr(jit, "get_backend", lambda name: backend)
    else:
        jit.get_backend = lambda name: backend
    return backend


def get(threads: int, factor: int):
    """get_kernel for (threads, factor) through whatever backend is installed."""
    return jit.get_kernel(template(), {"threads": threads}, TARGET, {"factor": factor})
