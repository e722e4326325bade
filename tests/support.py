"""Helpers shared by the tests (imported as ``support``)."""
import os
import re
import shutil
import subprocess
import sys

import torch


def run_python(code: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (fresh memo, fresh imports) and return the result."""
    full_env = {**os.environ, **(env or {})}
    done = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"child failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


def amd_kernels(isa: str) -> dict:
    """name -> assembly of each kernel (each ``.globl`` symbol) in a gfx942 ``kernel.s`` (an ISA
    dump), from its label to the end of its function."""
    out = {}
    for name in re.findall(r"^\s*\.globl\s+(\S+)", isa, flags=re.M):
        body = re.search(rf"^{re.escape(name)}:\s*$(.*?)^\.Lfunc_end", isa, flags=re.M | re.S)
        if body:
            out[name] = body.group(1)
    return out


def descriptor_loops(body: str) -> list:
    """Labels of readfirstlane loops in one kernel's assembly: a block that branches back to
    itself on exec after reading a value lane by lane (v_readfirstlane) and masking exec to the
    lanes that share it, what the compiler makes of a buffer access through a per-lane
    descriptor (one pass per distinct descriptor in the wave)."""
    loops = []
    for label, block in re.findall(r"^(\.LBB\w+):\s*$(.*?)(?=^\.LBB|\Z)", body, flags=re.M | re.S):
        if (re.search(rf"s_cbranch_execnz\s+{re.escape(label)}\b", block) and "v_readfirstlane" in block
                and "s_and_saveexec" in block):
            loops.append(label)
    return loops


def have_lld() -> bool:
    from mslk_dsl.backends import flydsl

    try:
        flydsl.rocm_path_with_lld()
        return True
    except Exception:
        return False


def tree_snapshot(root) -> dict:
    """{relative path: (size, mtime_ns)} of everything under root, directories included."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


def copy_tree(src, dst):
    shutil.copytree(src, dst)
    return dst


def relaid(args: tuple, layout: str, pad: int) -> tuple:
    """``args`` with each tensor copied into another layout of the same values: rows padded by
    ``pad`` elements (a row stride past the row; a vector takes every ``pad + 1``-th element of a
    longer one), or starting one element past an aligned address."""
    def relay(a):
        if not isinstance(a, torch.Tensor) or a.numel() == 0:
            return a
        if layout == "padded" and a.dim() == 1:
            return torch.empty(a.shape[0] * (pad + 1), dtype=a.dtype, device=a.device)[::pad + 1].copy_(a)
        if layout == "padded":
            return torch.empty(*a.shape[:-1], a.shape[-1] + pad, dtype=a.dtype, device=a.device)[..., :a.shape[-1]].copy_(a)
        return torch.empty(a.numel() + 1, dtype=a.dtype, device=a.device)[1:].view(a.shape).copy_(a)
    return args if layout == "contiguous" else tuple(relay(a) for a in args)


def cpu_stands_in_for(target: str, monkeypatch) -> None:
    """Ops on CPU tensors run their whole call path as on ``target`` (forced): the device check
    passes, and the SM count the attention ops size their grids by is that target's. The
    caller stands a kernel in for the compiled one (``KernelOp.selection``)."""
    import importlib

    from mslk_dsl.ops import validate

    monkeypatch.setenv("MSLK_DSL_TARGET", target)
    monkeypatch.setattr(validate, "gpu", lambda *args: None)
    sms = {"sm90a": 132, "gfx942": 304, "gfx950": 256}[target]
    for module in ("attention", "attention_decode"):   # (the package's names are the ops)
        monkeypatch.setattr(importlib.import_module(f"mslk_dsl.ops.{module}"), "sm_count", lambda device: sms)
