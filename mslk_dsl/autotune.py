"""The autotuner: time every valid config of an op on this GPU and store the winner.

Timing uses CUDA events with the L2 cache flushed before each run (triton.testing.do_bench), on
N(0, 1) inputs. Before a config is timed its results are checked against the op's plain-torch
reference (``OpDecl.mismatch``, the test the GPU tests apply to every op): a config that computes
something else is skipped, loudly, and can never become a stored winner. Winners go to the tuning
DB (tuning.py) under the current GPU name and toolchain versions, per (op, signature, shape
bucket); the op layer then prefers them over the heuristic.
"""
from __future__ import annotations

import json
import os

import torch

from mslk_dsl import fs, registry, tuning
from mslk_dsl.device import target_of
from mslk_dsl.errors import InputError, StateError


def tunable_ops() -> list[str]:
    """The declared ops the tuner can time: those whose declaration builds example inputs."""
    from mslk_dsl.ops import declarations

    return [name for name, decl in declarations().items() if decl.example is not None and decl.composite is None]


def inputs_for(op: str, problem: dict, sig: dict, device="cuda") -> tuple:
    """The arguments the tuner times ``op`` with: the op declaration's example for the problem
    sizes and signature."""
    from mslk_dsl.ops import declaration

    example = declaration.get(op).example
    if example is None:
        raise InputError(f"op {op} declares no example inputs; the tuner cannot time it")
    return example(problem, sig, torch.device(device))


def tuning_signature(template, sig: dict | None) -> dict:
    """The whole signature the tuner times and stores: ``sig``'s parts, and for the others the
    plain call's (no optional input: has_scale_ub, has_valid_count False; 16-byte rows), else
    each part's first value. ``inputs_for`` builds a call of exactly this signature."""
    full_sig = {k: False if k.startswith("has_") and False in v else v[0] for k, v in template.signatures.items()}
    full_sig.update(sig or {})
    if "vec_bytes" in full_sig and "vec_bytes" not in (sig or {}):
        full_sig["vec_bytes"] = 16  # full-width rows unless asked otherwise
    if not template.signature_valid(full_sig):
        raise InputError(f"tuning {template.op}: signature {full_sig} is no call's; its signatures: "
                         f"{template.all_signatures()}")
    return full_sig


def tune(op: str, problems: list[dict], sig: dict | None = None, store: bool = True) -> list[tuple[dict, float]]:
    """For each problem: (best config, its time in ms); stored in the tuning DB when ``store``."""
    from triton.testing import do_bench

    import mslk_dsl.ops as ops

    if op not in tunable_ops():
        raise InputError(f"tuning {op!r} is not supported; supported: {', '.join(tunable_ops())}")
    target = target_of(torch.device("cuda")).name
    template = registry.templates_for(op, target)[0]
    results = []
    for problem in problems:
        full_sig = tuning_signature(template, sig)
        args = inputs_for(op, problem, full_sig)
        fn = getattr(ops, op)
        default = template.heuristic(target, full_sig, problem)
        judge = ResultCheck(op, args, default=lambda a: fn(*a, config=default))
        timings = []
        for config in _candidates(template, target, full_sig, problem):
            try:
                # The default config passes its own check by definition (its error sets the
                # slack), and ResultCheck has already run it once.
                wrong = None if config == default else judge(lambda a: fn(*a, config=config))
                if wrong is None:
                    ms = do_bench(lambda: fn(*args, config=config), warmup=10, rep=50)
            except Exception as e:  # a config that fails to build or run here is skipped, loudly
                print(f"  skip {config}: {type(e).__name__}: {e}")
                continue
            if wrong is not None:
                print(f"  skip {config}: wrong results: {wrong}")
                continue
            timings.append((ms, config))
        if not timings:
            raise StateError(f"{op}: no config ran for {problem}")
        ms, best = min(timings, key=lambda t: t[0])
        results.append((best, ms))
        if store:
            _store(op, target, full_sig, problem, best, ms)
    return results


class ResultCheck:
    """Judges a config's results on the tuner's inputs (``check(run)``: ``run(args)`` is called on
    fresh copies of them; an in-place op's result is its updated first argument). A config passes
    where its results match the op's reference by ``OpDecl.mismatch``, or where they are no
    further from it (``OpDecl.max_error``) than ERROR_SLACK times the heuristic's default config's
    (``default``, the config the GPU tests check): at the tuner's sizes rounding may outgrow the
    declared tolerance (long FP8 sums), but a config that computes something else misses by far
    more. Where the reference does not fit in memory at the tuner's sizes (attention's fp32 score
    matrices of a long sequence), configs are compared with the default config's results within
    the declared tolerance instead. Returns None, or why the results are wrong."""

    ERROR_SLACK = 2.0

    def __init__(self, op: str, args: tuple, default):
        from mslk_dsl.ops import declaration

        self.decl = declaration.get(op)
        self.args = args
        self.in_place = not self.decl.outputs(*args)
        self.want = None
        if self.decl.reference is not None:
            try:
                self.want = self._results(lambda a: self.decl.reference(*a))
                self.default_error = self.decl.max_error(self._results(default), self.want)
            except torch.cuda.OutOfMemoryError:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                print(f"  {op}: the reference does not fit in memory at this size; each config is "
                      f"compared with the default config's results")
                self.want, self.default_error = self._results(default), 0.0

    def _results(self, run):
        fresh = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in self.args)
        out = run(fresh)
        return fresh[0] if self.in_place else out

    def __call__(self, run) -> str | None:
        if self.want is None:
            return None
        got = self._results(run)
        why = self.decl.mismatch(got, self.want)
        if why is None:
            return None
        error = self.decl.max_error(got, self.want)
        if error <= self.ERROR_SLACK * self.default_error:
            return None
        return f"{why} (largest error {error:.4g}; the default config's {self.default_error:.4g})"


# GEMM split-K configs: the decode tiles (64 rows) are timed only up to SPLIT_K_MAX_M, past which
# the 128-row tiles win; the 128-row ones up to MID_SPLIT_K_MAX_M, past which the output tiles
# fill the waves on every layer and the partials buffer (a slot per tile and split) only grows.
SPLIT_K_MAX_M = 128
MID_SPLIT_K_MAX_M = 4096


def _split_k_serves(config: dict, m: int) -> bool:
    if "split_k" not in config:
        return True
    return m <= (SPLIT_K_MAX_M if config.get("tile_m") == 64 else MID_SPLIT_K_MAX_M)


def _candidates(template, target, sig, problem) -> list[dict]:
    """Every valid config, except that a precision knob (FP8 "promote": how often the tensor
    core's partial sums go to fp32) stays at the heuristic's value: tuning trades speed, never
    accuracy; split-K configs only up to their M (see SPLIT_K_MAX_M); and only configs that serve
    the problem (template.serves)."""
    default = template.heuristic(target, sig, problem)
    return [c for c in template.valid_configs(target, sig)
            if ("promote" not in c or c["promote"] == default.get("promote"))
            and _split_k_serves(c, problem.get("M", 0)) and template.serves(c, problem)]


def _store(op, target, sig, problem, config, ms) -> None:
    path = tuning.db_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with fs.lock(path + ".lock"):
        db = tuning.read_db(path)  # a malformed file is replaced (with a warning), not a crash
        db["entries"][tuning.entry_key(op, target, sig, problem)] = {
            "config": config, "ms": ms, "problem": problem, "context": tuning.context()}
        fs.atomic_write(path, json.dumps(db, indent=1, sort_keys=True))
