"""Per-call host time of each op on tiny tensors: the eager path (mslk_dsl.ops.<op>; a repeat
layout is served by the native launcher, mslk_dsl.native), the eager path writing into
preallocated outputs (out=, like the torch.add it is compared with), the eager path with the
native launcher bypassed (the Python path), and the torch.ops path (torch.ops.mslk_dsl.<op>),
next to torch.add(x, y, out=z) in the same run.

Each time is the median over --runs rounds of (wall time of --calls back-to-back calls) / calls,
after a warm-up; tensors are tiny, so for most ops the GPU finishes each kernel before the host
issues the next and the figure is the host cost of validation, kernel lookup and launch. Not for
an op whose kernels take longer than its host time (a split-KV decode with its merge, a one-block
routing kernel): the loop then waits for the GPU and measures it. So a second table times the
host alone: each batch of calls is queued behind a GPU sleep that outlasts it, and next to it the
GPU's own time per call of the same kernels queued back to back. Every round times
torch.add and each path of the op in turn, and each ratio is the median over rounds of the path's
time / that round's torch.add time (the host's speed drifts by 10-30% over a run, and by more
between rounds than within one).

  python tools/bench.py overhead [--calls 10000] [--runs 9] [--json PATH]

``--cpu`` times the op layer alone on the CPU, no GPU needed: every declared kernel op on its
declaration's small example (CPU tensors), its kernel a stand-in that does nothing (the same
choice machinery up to the template lookup, which a stand-in selection replaces; the device's SM
count is an H200's 132). Columns: the eager call (served by a launch plan where the op keeps one:
the Python plan, as the native launcher serves only CUDA kernels) and the checked path (``config=``
given: checks, outputs, prepare, launch, no plan), next to torch.add on the CPU:

  python tools/bench.py overhead --cpu [--calls 2000] [--runs 5]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time


def _rounds(fns, calls: int, runs: int, sync=None) -> list[tuple[float, float]]:
    """(median us/call, median ratio to the first function's time in the same round) of each
    function; the functions take turns within each of ``runs`` rounds. An entry may be
    (fn, context) to time fn inside ``context()``. ``sync`` ends each timed batch (default: CUDA's)."""
    import torch

    sync = sync or torch.cuda.synchronize
    fns = [f if isinstance(f, tuple) else (f, contextlib.nullcontext) for f in fns]
    for fn, context in fns:
        with context():
            for _ in range(200):
                fn()
    sync()
    samples = [[] for _ in fns]
    for _ in range(runs):
        for (fn, context), out in zip(fns, samples):
            with context():
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                sync()
                out.append((time.perf_counter() - start) / calls * 1e6)
    return [(statistics.median(s), statistics.median(t / b for t, b in zip(s, samples[0]))) for s in samples]


def _host_rounds(fns, calls: int, runs: int, batch: int = 200) -> list[tuple[float, float, float]]:
    """(median host us/call, median ratio to the first function's host time in the same round,
    median GPU us/call) of each function, the functions taking turns as in _rounds. Each batch
    of ``batch`` calls is queued behind a GPU sleep that outlasts it, so the host never waits for
    the GPU (checked: the sleep is still running when the batch is queued; such a batch is
    retried with a longer sleep): the time is the host's alone, whatever the kernels take. The
    back-to-back loop of _rounds measures the GPU instead when an op's kernels take longer than
    its host time. GPU us/call: CUDA events around the batch's queued kernels (their durations
    and the gaps between them, no host time)."""
    import torch

    hz = 2.0e9  # cycles per second of the sleep, about an H100 / H200 SM clock
    per_call_s = 40e-6  # sleep per call of the batch: several times any op's host time
    host = [[] for _ in fns]
    gpu = [[] for _ in fns]
    for fn in fns:  # warm: plans made, kernels loaded
        for _ in range(batch):
            fn()
    torch.cuda.synchronize()
    for _ in range(runs):
        for fn, h_out, g_out in zip(fns, host, gpu):
            h_total, g_total, done = 0.0, 0.0, 0
            sleep = per_call_s
            while done < calls:
                started, ended, slept = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                torch.cuda._sleep(int(batch * sleep * hz))
                slept.record()
                started.record()
                start = time.perf_counter()
                for _ in range(batch):
                    fn()
                elapsed = time.perf_counter() - start
                still_asleep = not slept.query()
                ended.record()
                torch.cuda.synchronize()
                if not still_asleep and sleep < 16 * per_call_s:  # the GPU caught up: the host may
                    sleep *= 2                                      # have waited; a longer sleep
                    continue
                if not still_asleep:  # a call that waits for the GPU itself (a host sync)
                    raise RuntimeError(f"a call outlasted a sleep of {sleep * 1e6:.0f} us per call: "
                                       "it waits for the GPU")
                h_total += elapsed
                g_total += started.elapsed_time(ended) * 1e-3
                done += batch
            h_out.append(h_total / done * 1e6)
            g_out.append(g_total / done * 1e6)
    return [(statistics.median(h), statistics.median(t / b for t, b in zip(h, host[0])), statistics.median(g))
            for h, g in zip(host, gpu)]


@contextlib.contextmanager
def _python_path():
    """The native launcher bypassed: every call takes the Python path."""
    from mslk_dsl import native

    with native.bypassed():
        yield


def cases():
    """(eager, torch.ops, eager with out=) calls of every declared kernel op that keeps launch
    plans, on its declaration's small example inputs (distinct tensors: a call whose inputs share
    memory takes the checked path)."""
    import torch

    import mslk_dsl.ops as ops
    from mslk_dsl.ops import declarations

    found = {}
    for name, decl in declarations().items():
        if decl.composite is not None or not decl.plannable or decl.example is None:
            continue
        torch.manual_seed(0)
        args = decl.example(dict(decl.small_problem), {}, torch.device("cuda"))
        eager, via_ops = getattr(ops, name), getattr(torch.ops.mslk_dsl, name)
        try:
            given = eager(*args)   # out=: the outputs of one call, written again by every timed call
        except Exception as e:  # e.g. a template whose package is missing here: say so, time the others
            print(f"| {name} | skipped: {type(e).__name__}: {str(e)[:200]} |", flush=True)
            continue
        # An op updating an input in place (scatter_add) allocates nothing: its out= column is the call.
        with_out = (lambda e=eager, a=args: e(*a)) if given is None else (lambda e=eager, a=args, g=given: e(*a, out=g))
        found[name] = (lambda e=eager, a=args: e(*a), lambda o=via_ops, a=args: o(*a), with_out)
    return found


def _launch_floor(calls: int, runs: int, torch_add) -> dict:
    """The pieces of the eager path of silu_mul (one output) and quantize_fp8_row (two), each timed
    alone (taking turns with torch.add): the native launcher's call, the compiled kernel called
    through TVM-FFI from Python with preallocated outputs (no checks, no lookup), allocations of an
    output, and torch calls that allocate one and two outputs."""
    import torch

    import mslk_dsl.ops as ops
    from mslk_dsl import native
    from mslk_dsl.ops import declaration
    from mslk_dsl.ops.dispatch import placeholder

    x, y = (torch.randn(1, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(x)
    xq, scale = ops.quantize_fp8_row(x)
    ops.silu_mul(x, y)
    # the kernels those calls chose (16-byte rows, bf16, no scale_ub)
    silu_mul = declaration.get("silu_mul").kernels.kernel(x.device, (16, "bfloat16"), (1, 256))
    quantize = declaration.get("quantize_fp8_row").kernels.kernel(x.device, (16, "bfloat16", False), (1, 256))
    ub = placeholder(x.device, torch.float32)
    count = placeholder(x.device, torch.int32, fill=2**31 - 1)  # no valid_token_count: every row
    parts = {"torch.add(x, y, out=z)": torch_add, "eager ops.silu_mul (all of it)": lambda: ops.silu_mul(x, y)}
    fast = native.fast_op("silu_mul")
    if fast is not None:
        # the plan's inputs are the op's arguments as given: x0, x1 and valid_token_count (None)
        parts["silu_mul: the native launcher's call alone (match, allocate, launch)"] = lambda: fast(x, y, None)
    parts["silu_mul: TVM-FFI kernel call from Python, output preallocated"] = lambda: silu_mul(x, y, out, count)
    parts["eager ops.quantize_fp8_row (two outputs)"] = lambda: ops.quantize_fp8_row(x)
    fast_quantize = native.fast_op("quantize_fp8_row")
    if fast_quantize is not None:
        # the plan's inputs are the op's arguments as given: x and scale_ub (None)
        parts["quantize_fp8_row: the native launcher's call alone"] = lambda: fast_quantize(x, None)
    parts.update({
        "quantize_fp8_row: TVM-FFI kernel call from Python, outputs preallocated": lambda: quantize(x, ub, xq, scale),
        "torch.empty(shape, dtype=, device=)": lambda: torch.empty((1, 256), dtype=x.dtype, device=x.device),
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        # torch's own calls that allocate what they return, one output and two: the like-for-like
        # references of the eager ops that allocate theirs
        "torch.add(x, y), allocating its output": lambda: torch.add(x, y),
        "torch.max(x, dim=1), allocating its two outputs": lambda: torch.max(x, dim=1),
    })
    return dict(zip(parts, _rounds(list(parts.values()), calls, runs)))


def cpu_stand_in(calls: int, runs: int) -> list[dict]:
    """The op layer's host time per call on the CPU with stand-in kernels (see the module doc)."""
    import types
    from unittest import mock

    import torch

    import mslk_dsl.ops as ops
    from mslk_dsl.ops import declaration, declarations, validate

    def nothing(*args):
        return None

    a, b, z = (torch.randn(256) for _ in range(3))
    rows = []
    h200 = types.SimpleNamespace(multi_processor_count=132)
    with mock.patch.object(validate, "gpu", nothing), \
            mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: h200):
        for name, decl in declarations().items():
            if decl.composite is not None or decl.example is None:
                continue
            torch.manual_seed(0)
            args = decl.example(dict(decl.small_problem), {}, torch.device("cpu"))
            eager = getattr(ops, name)
            with mock.patch.object(declaration.get(name).kernels, "selection",
                                   lambda device, sig, problem, config: (nothing, {})):
                try:
                    eager(*args)
                except Exception as e:  # an op whose CPU stand-in cannot run: say so, go on
                    print(f"| {name} | skipped: {type(e).__name__}: {e} |")
                    continue
                (add, _), (e, er), (c, cr) = _rounds(
                    [lambda: torch.add(a, b, out=z), lambda: eager(*args), lambda: eager(*args, config={})],
                    calls, runs, sync=nothing)
            rows.append({"op": name, "torch_add_us": add, "eager_us": e, "eager_ratio": er, "checked_us": c,
                         "checked_ratio": cr})
            print(f"| {name} | {add:.2f} | {e:.2f} | {er:.1f} | {c:.2f} | {cr:.1f} |", flush=True)
    return rows


def main(argv: list[str]) -> int:
    import torch

    from mslk_dsl import native

    p = argparse.ArgumentParser(prog="bench.py overhead")
    p.add_argument("--calls", type=int, default=10000)
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--cpu", action="store_true", help="the op layer alone, on the CPU, with stand-in kernels")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.cpu:
        print("| op | torch.add (CPU) us/call | eager us/call | x torch.add | checked path us/call | x torch.add |")
        print("| --- | --- | --- | --- | --- | --- |")
        rows = cpu_stand_in(args.calls, args.runs)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows}, f, indent=1)
        return 0
    a, b, z = (torch.randn(4096, device="cuda") for _ in range(3))
    import mslk_dsl.ops  # noqa: F401  (starts loading the native launcher)

    launcher = native.wait_until_loaded(120)
    rows = []
    print(f"native launcher: {'loaded' if launcher is not None else 'UNAVAILABLE (eager = Python path)'}\n")
    print("| op | torch.add us/call | eager us/call | x torch.add | eager, out= given | x torch.add | "
          "Python path us/call | x torch.add | torch.ops us/call | x torch.add |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    op_calls = cases()  # made once: both tables time the same calls
    for name, (eager, via_ops, eager_out) in op_calls.items():
        (add, _), (e, er), (i, ir), (p, pr), (o, orr) = _rounds(
            [lambda: torch.add(a, b, out=z), eager, eager_out, (eager, _python_path), via_ops], args.calls, args.runs)
        rows.append({"op": name, "eager_us": e, "eager_out_us": i, "python_path_us": p, "torch_ops_us": o,
                     "torch_add_us": add, "eager_ratio": er, "eager_out_ratio": ir, "python_path_ratio": pr,
                     "torch_ops_ratio": orr, "native": launcher is not None})
        print(f"| {name} | {add:.2f} | {e:.2f} | {er:.2f} | {i:.2f} | {ir:.2f} | {p:.2f} | {pr:.2f} | {o:.2f} | "
              f"{orr:.2f} |", flush=True)
    print("\nHost time alone (each batch of calls queued behind a GPU sleep, so no call waits for the "
          "GPU), and the GPU's time per call of the same kernels queued back to back:\n")
    print("| op | torch.add host us/call | eager host us/call | x torch.add | eager, out= given, host us/call | "
          "x torch.add | eager GPU us/call |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    host_rows = []
    for name, (eager, _, eager_out) in op_calls.items():
        try:
            (add, _, _), (e, er, eg), (i, ir, _) = _host_rounds(
                [lambda: torch.add(a, b, out=z), eager, eager_out], args.calls, args.runs)
        except RuntimeError as error:
            print(f"| {name} | {error} |", flush=True)
            continue
        host_rows.append({"op": name, "torch_add_host_us": add, "eager_host_us": e, "eager_host_ratio": er,
                          "eager_out_host_us": i, "eager_out_host_ratio": ir, "eager_gpu_us": eg})
        print(f"| {name} | {add:.2f} | {e:.2f} | {er:.2f} | {i:.2f} | {ir:.2f} | {eg:.2f} |", flush=True)
    floor = _launch_floor(args.calls, args.runs, lambda: torch.add(a, b, out=z))
    print("\nWhere the eager time goes (same run):\n")
    print("| part | us/call | x torch.add |")
    print("| --- | --- | --- |")
    for part, (us, ratio) in floor.items():
        print(f"| {part} | {us:.2f} | {ratio:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            parts = {k: {"us": us, "ratio": r} for k, (us, r) in floor.items()}
            json.dump({"rows": rows, "host_rows": host_rows, "eager_parts": parts}, f, indent=1)
    return 0
