"""What an op is: one ``OpDecl`` per op, and the table of every declared op.

A declaration says everything the framework needs to serve, register, trace, tune, benchmark
and test an op; nothing else keeps a list of ops. The generic call path (``call.py``) runs every
declared op the same way:

    plan hit (native, then Python)  ->  check  ->  outputs  ->  prepare (choose kernel)
        ->  launch  ->  remember the plan

``prepare`` is the op's own part: it maps the validated inputs to the kernel's static signature
and dynamic problem sizes, asks the framework for the kernel (``select``), and returns the
launch arguments; it may also finish the call itself (empty sizes, a copy) and return None.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Any, NamedTuple
from collections.abc import Callable

import torch

from mslk_dsl.errors import MslkDslError
from mslk_dsl.ops.dispatch import KernelOp

OutputSpec = tuple[tuple[int, ...], torch.dtype]  # (shape, dtype) of one output


class Launch(NamedTuple):
    """One kernel launch, as ``prepare`` builds it. ``args`` are the kernel's arguments, each an
    input, an output, a view of one, a placeholder (``dispatch.placeholder``), a tensor of
    ``scratch`` (allocated for this call only, never returned) or a scalar input. ``finish`` runs
    after the launch (copying out of a temporary); a launch with one is never replayed from a
    plan. ``plannable`` False: the launch holds something that is only right for this call, so
    it is never remembered as a plan either. ``stream_bound``: it holds a buffer of the current
    stream (split-K tile counters, dispatch.zeroed_counters; scratch reused per stream,
    dispatch.call_scratch), so its plan serves calls on that stream only (native plans check
    the stream; Python plans are keyed by it)."""
    kernel: Any
    args: tuple
    scratch: tuple = ()
    finish: Callable[[], None] | None = None
    plannable: bool = True
    stream_bound: bool = False


class Fixed(NamedTuple):
    """A scalar kernel argument that ``prepare`` derives from the call's layout and the values of
    the op's ``plan_values`` (1/sqrt(head_dim), a mask flag): every call a plan serves has the
    same one, so a plan holds it. Any other scalar argument must be one of the op's own
    arguments, passed as given (else the call keeps no plan)."""
    value: Any


# select(signature, problem) -> (kernel, chosen config): the framework's kernel choice for a call.
Select = Callable[[tuple, tuple], tuple[Any, dict]]


def _not_declared(*args, **kwargs):
    """The hook a composite op (plain torch) leaves out: it is never called."""
    raise MslkDslError("this op is a composite: it has no kernel hooks")


@dataclasses.dataclass(frozen=True)
class OpDecl:
    """One op. Fields are hooks called with the op's arguments in schema order.

    - ``schema``: torch's schema of the arguments and results, e.g. ``(Tensor x, float eps=1e-06)
      -> Tensor``; the eager function, ``torch.ops.mslk_dsl.<name>`` and the fake follow from it.
    - ``check(*args)``: argument checks; raise InputError / InputTypeError (mslk_dsl.errors) naming
      the argument.
    - ``outputs(*args)``: the (shape, dtype) of each result, in order (none for an in-place op).
      Runs on fake tensors too: it is the op's fake.
    - ``prepare(select, outputs, *args)``: see the module docstring; ``outputs`` are the result
      tensors (new, or the caller's ``out=``).
    - ``signature`` / ``problem``: the names of the static signature parts and dynamic sizes that
      ``prepare`` passes to ``select`` (the template's signature keys and heuristic sizes).
    - ``example(problem, signature, device)``: arguments for a call of those sizes and signature
      (the autotuner, benchmarks and tests build inputs with it); ``problem`` holds the names in
      ``problem``, ``signature`` a subset of the template's signature parts.
    - ``reference(*args)``: the op in plain torch (fp32 math), the semantics the kernels match.
    - ``tolerance``: (rtol, atol) within which the kernels' floating-point results match
      ``reference`` on ``example`` inputs (FP8 results are compared after dequantization);
      ``mismatch`` applies it.
    - ``defined(results)``: the parts of the results the op defines (index_shuffling leaves the
      slots past its routed count unspecified); by default all of them.
    - ``plan_when``: a Python expression over the argument names that must hold for a launch plan
      to serve a call: the plans match layouts (dtype, shape, strides, alignment, scalar types),
      not values, so a value the checks restrict (a negative eps) must keep the checked path.
    - ``plan_values``: the scalar arguments whose values, not only types, key the op's plans
      (values that choose the kernel's flags, split counts or scratch sizes); its ``prepare`` may
      pass scalars derived from these values as ``Fixed``. A value a plan serves was checked when
      the plan was made, so ``plan_when`` need not guard it.
    - ``plannable``: False where a plan could not replay the launch (outputs sized by a scalar's
      value). An input the schema marks written (``Tensor(a!)``, in place) must share no memory
      with another input: the checked path refuses such a call, and every plan (native or
      Python) tests it before it launches.
    - ``composite``: a plain torch function that is the whole op (no kernel).
    - ``random_problem(rng)``: the sizes of a random call the op serves, for the fuzz tests;
      ``long_sums``: its results are sums of many terms (GEMM K, attention keys, a token's rows
      in scatter_add), whose rounding errors add up: the fuzz tests measure the error against
      the result's largest magnitude rather than elementwise.
    """
    name: str
    schema: str
    doc: str
    check: Callable[..., None] = _not_declared
    outputs: Callable[..., list[OutputSpec]] = _not_declared
    prepare: Callable[..., Launch | None] = _not_declared
    signature: tuple[str, ...] = ()
    problem: tuple[str, ...] = ()
    example: Callable[[dict, dict, torch.device], tuple] | None = None
    reference: Callable[..., Any] | None = None
    tolerance: tuple[float, float] = (2e-2, 2e-2)
    defined: Callable[[tuple], tuple] | None = None
    plan_when: str = "True"
    plan_values: tuple[str, ...] = ()
    plannable: bool = True
    composite: Callable[..., Any] | None = None
    # Sizes for the smallest interesting call (fake tests, smoke runs); names from ``problem``.
    small_problem: dict = dataclasses.field(default_factory=dict)
    # One random call the op serves: ``random_problem(rng)`` -> sizes for ``example`` (names from
    # ``problem``; see random_problems.py). The GPU fuzz test draws them with random signatures
    # of the op's templates and checks each result against ``reference``.
    random_problem: Callable[[random.Random], dict] | None = None
    # Results that are sums of many terms (see the class docstring): judged by the fuzz test
    # against the result's largest value rather than elementwise.
    long_sums: bool = False

    def __post_init__(self):
        hooks = (self.check, self.outputs, self.prepare)
        if self.composite is None and any(hook is _not_declared for hook in hooks):
            raise MslkDslError(f"op {self.name}: a kernel op declares check, outputs and prepare "
                               f"(or is a composite)")

    def defined_results(self, results) -> tuple:
        """The op's results (one tensor or a tuple) as a tuple of their ``defined`` parts."""
        results = results if isinstance(results, tuple) else (results,)
        return self.defined(results) if self.defined is not None else results

    def mismatch(self, got, want) -> str | None:
        """Why the results ``got`` do not match ``want`` (the reference's on the same inputs), or
        None where they match: integers exactly, FP8 values within one step of their grid, other
        floats within ``tolerance`` (16-bit ones at least within one unit in the last place);
        only the ``defined`` parts. The GPU tests and the autotuner judge a kernel by it."""
        got, want = self.defined_results(got), self.defined_results(want)
        if len(got) != len(want):
            return f"{self.name}: {len(got)} results, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            if g.shape != w.shape or g.dtype != w.dtype:
                return (f"{self.name}: result {i} is {tuple(g.shape)} {g.dtype}, "
                        f"expected {tuple(w.shape)} {w.dtype}")
            if not g.is_floating_point():
                if not torch.equal(g, w):
                    return f"{self.name}: result {i} differs in {int((g != w).sum())} of {g.numel()} entries"
                continue
            rtol, atol = (0.0, 1e-3) if g.element_size() == 1 else self.tolerance
            if g.element_size() <= 2:
                # a result rounded to 8 or 16 bits from fp32 math done in another order than the
                # reference's (or with other exp / division roundings) may land one unit in the
                # last place away where its value sits at a rounding midpoint, whatever the
                # tolerance: one FP8 step is 6-12% of the value (rtol 2^-3 for e4m3), down to
                # the subnormal step near zero
                info = torch.finfo(g.dtype)
                rtol = max(rtol, info.eps)
                atol = max(atol, info.smallest_normal * info.eps if g.element_size() == 1 else 0.0)
            try:
                torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=atol)
            except AssertionError as e:
                return f"{self.name}: result {i}: " + " ".join(str(e).split())   # one line
        return None

    def max_error(self, got, want) -> float:
        """The largest absolute difference between the ``defined`` floating-point results ``got``
        and ``want``; infinite where their shapes or dtypes or any integer result differ."""
        got, want = self.defined_results(got), self.defined_results(want)
        worst = 0.0
        if len(got) != len(want):
            return math.inf
        for g, w in zip(got, want):
            if g.shape != w.shape or g.dtype != w.dtype or (not g.is_floating_point() and not torch.equal(g, w)):
                return math.inf
            if g.is_floating_point() and g.numel():
                gf, wf = g.float(), w.float()
                diff = torch.where(gf == wf, 0.0, (gf - wf).abs())   # equal infinities differ by nothing
                worst = max(worst, float(diff.nan_to_num(math.inf).max()))
        return worst

    @property
    def kernels(self) -> KernelOp:
        """Kernel selection for this op (the templates registered under its name)."""
        return _kernel_ops.setdefault(self.name, KernelOp(self.name, self.signature, self.problem))


_kernel_ops: dict[str, KernelOp] = {}
_declared: dict[str, OpDecl] = {}
_eager: dict[str, Callable[..., Any]] = {}


def declare(decl: OpDecl):
    """Add ``decl`` to the table of ops, register ``torch.ops.mslk_dsl.<name>`` and return the
    eager function (see call.eager_function)."""
    from mslk_dsl.ops import call, library

    if decl.name in _declared:
        raise MslkDslError(f"op {decl.name} is declared twice")
    _declared[decl.name] = decl
    eager = _eager[decl.name] = call.eager_function(decl)
    library.register(decl, eager)
    return eager


def declarations() -> dict[str, OpDecl]:
    """Every declared op by name, in declaration order."""
    return dict(_declared)


def eager_functions() -> dict[str, Callable[..., Any]]:
    """Every declared op's eager function by name (what ``mslk_dsl.ops.<name>`` is)."""
    return dict(_eager)


def get(name: str) -> OpDecl:
    try:
        return _declared[name]
    except KeyError:
        raise MslkDslError(f"no op named {name!r}; declared ops: {', '.join(_declared)}") from None
