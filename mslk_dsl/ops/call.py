"""The one call path of every declared op (see declaration.py), and the eager functions over it.

A call goes through at most these steps, each skipped when an earlier one answered:
1. native plan: the layout was seen before and the native launcher has its plan (one C call:
   match, allocate, launch; mslk_dsl.native);
2. Python plan: the same, in Python (ROCm's FlyDSL kernels are not TVM-FFI functions, and calls
   made before the launcher is loaded);
3. the checked path: argument checks, outputs, the op's ``prepare`` (kernel choice: explicit
   config, tuned, heuristic; see dispatch.KernelOp), launch, and the plan remembered for next time.

The eager function of an op is generated from its schema (like dataclasses generate __init__):
a plain Python function with the op's own parameters, so a call costs no argument binding and
the first step is a few attribute lookups.
"""
from __future__ import annotations

import torch

from mslk_dsl import native
from mslk_dsl.ops import validate as check
from mslk_dsl.ops.declaration import Launch, OpDecl
from mslk_dsl.ops.dispatch import is_placeholder

# -- Python plans ---------------------------------------------------------------------------------
# Where a kernel argument comes from in a Python plan.
_INPUT, _OUTPUT, _HELD, _VIEW_OF_INPUT, _VIEW_OF_OUTPUT = range(5)


class _PythonPlan:
    """A launch to replay for calls with one input layout: what to allocate and where each kernel
    argument comes from (an input, an output, a view of one, or a held placeholder). While the
    native launcher is still loading, each replay offers it the launch (``native_pending``)."""
    __slots__ = ("name", "kernel", "allocate", "args", "returned", "held", "native_pending", "like")

    def __init__(self, name, kernel, allocate, args, returned, held, native_pending, like):
        self.name, self.kernel, self.allocate, self.args = name, kernel, allocate, args
        self.returned, self.held, self.native_pending = returned, held, native_pending
        self.like = like  # the input whose new_empty allocates (same device; cheaper than torch.empty)

    def __call__(self, inputs: tuple):
        like = inputs[self.like]
        made = [like.new_empty(shape, dtype=dtype) for shape, dtype in self.allocate]
        args = []
        for kind, value, view in self.args:
            if kind == _INPUT:
                args.append(inputs[value])
            elif kind == _OUTPUT:
                args.append(made[value])
            elif kind == _HELD:
                args.append(value)
            else:
                source = inputs[value] if kind == _VIEW_OF_INPUT else made[value]
                args.append(source.as_strided(*view, source.storage_offset()))
        self.kernel(*args)
        if self.native_pending:  # None: the launcher may still load; ask again next time
            self.native_pending = native.remember(self.name, inputs, tuple(made), tuple(args),
                                                  tuple(range(self.returned)), self.kernel, held=self.held) is None
        if self.returned == 1:
            return made[0]
        return tuple(made[:self.returned]) if self.returned else None


def _layout(inputs: tuple):
    """What a Python plan is keyed by: each tensor's shape, strides, dtype, device and 16-byte
    alignment; each other argument's type (values are the call's own)."""
    return tuple((t.shape, t.stride(), t.dtype, t.device, not t.data_ptr() & 15)
                 if isinstance(t, torch.Tensor) else type(t) for t in inputs)


class _PlanTable(dict):
    MAX = 1024  # plans per op; cleared when full (serving sees many shapes)

    def add(self, key, plan) -> None:
        if len(self) >= self.MAX:
            self.clear()
        self[key] = plan


def _source(a: torch.Tensor, inputs: tuple, made: tuple):
    """Where kernel argument ``a`` comes from: (kind, index or tensor, (shape, strides) of a view)."""
    for kind, pool in ((_INPUT, inputs), (_OUTPUT, made)):
        for i, x in enumerate(pool):
            if x is a:
                return kind, i, None
    for kind, view_kind, pool in ((_INPUT, _VIEW_OF_INPUT, inputs), (_OUTPUT, _VIEW_OF_OUTPUT, made)):
        for i, x in enumerate(pool):
            if isinstance(x, torch.Tensor) and x.data_ptr() == a.data_ptr() and x.dtype == a.dtype:
                if x.shape == a.shape and x.stride() == a.stride():
                    return kind, i, None  # the same memory, laid out the same: pass the tensor itself
                return view_kind, i, (tuple(a.shape), tuple(a.stride()))
    if is_placeholder(a):
        return _HELD, a, None
    return None


def _python_plan(name: str, inputs: tuple, outputs: tuple, launch: Launch, held: tuple,
                 native_pending: bool) -> _PythonPlan | None:
    """The plan replaying ``launch`` for calls laid out like ``inputs``, or None where an argument
    is not an input, output, view of one or placeholder (a copied input)."""
    made = (*outputs, *launch.scratch)
    args = []
    for a in launch.args:
        if isinstance(a, torch.Tensor):
            source = _source(a, inputs, made)
        else:  # a scalar: the call's own value
            source = next(((_INPUT, i, None) for i, x in enumerate(inputs) if x is a), None)
        if source is None:
            return None
        args.append(source)
    allocate = [(tuple(t.shape), t.dtype) for t in made]
    like = next(i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor))
    return _PythonPlan(name, launch.kernel, allocate, args, len(outputs), held, native_pending, like)


# -- the checked path -------------------------------------------------------------------------------
_plans: dict[str, _PlanTable] = {}


def checked_call(decl: OpDecl, inputs: tuple, out, config: dict | None):
    """Steps 3: validate, choose, launch, remember (see the module docstring)."""
    name = decl.name
    decl.check(*inputs)
    tensors = {n: t for n, t in zip(_arg_names(decl), inputs) if isinstance(t, torch.Tensor)}
    device = next(iter(tensors.values())).device
    check.gpu(name, next(iter(tensors)), next(iter(tensors.values())))
    specs = decl.outputs(*inputs)
    outputs = check.outputs(name, out, specs, device, tensors) if specs else ()

    def select(signature: tuple, problem: tuple):
        return decl.kernels.selection(device, signature, problem, config)

    launch = decl.prepare(select, outputs, *inputs)
    if launch is not None:
        launch.kernel(*launch.args)
        if launch.finish is not None:
            launch.finish()
        elif config is None and decl.plannable:
            _remember(decl, inputs, outputs, out, launch)
    if not specs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _remember(decl: OpDecl, inputs: tuple, outputs: tuple, out, launch: Launch) -> None:
    """Keep a plan for the layout of ``inputs``: native where the launcher takes it, else Python.
    Inputs that share memory (silu_mul(x, x)) get neither: which kernel argument is which input
    would be ambiguous for later calls of the same layout with distinct tensors."""
    pointers = [t.data_ptr() for t in inputs if isinstance(t, torch.Tensor)]
    if len(set(pointers)) != len(pointers):
        return
    held = tuple(a for a in launch.args if isinstance(a, torch.Tensor) and is_placeholder(a))
    if out is not None:
        native.remember_into(decl.name, inputs, outputs, launch.args, launch.kernel, held=held,
                             scratch=launch.scratch)
        return
    added = native.remember(decl.name, inputs, (*outputs, *launch.scratch), launch.args,
                            tuple(range(len(outputs))), launch.kernel, held=held)
    if not added:  # no native plan (None: not yet, the launcher is loading): keep a Python one
        plan = _python_plan(decl.name, inputs, outputs, launch, held, native_pending=added is None)
        if plan is not None:
            _plans.setdefault(decl.name, _PlanTable()).add(_layout(inputs), plan)


def python_plan_call(decl: OpDecl, inputs: tuple, config):
    """Step 2 (then 3): a Python plan for this layout, else the checked path."""
    plans = _plans.get(decl.name)
    if plans:
        try:
            plan = plans.get(_layout(inputs))
        except (AttributeError, RuntimeError):  # not tensors (the checks say so), or no storage
            plan = None
        if plan is not None:
            return plan(inputs)
    return checked_call(decl, inputs, None, config)


def clear_python_plans() -> None:
    _plans.clear()


# -- eager functions ----------------------------------------------------------------------------------
def _arg_names(decl: OpDecl) -> list[str]:
    return [a.name for a in _schema(decl).arguments]


_schemas: dict = {}


def _schema(decl: OpDecl):
    parsed = _schemas.get(decl.name)
    if parsed is None:
        parsed = _schemas[decl.name] = torch._C.parse_schema(f"{decl.name}{decl.schema}")
    return parsed


_EAGER = '''\
def {name}({params}, *, {out_param}config=None):
    inputs = ({args})
    if config is None and ({plan_when}):
        if {allocating}:
            fast = native.fast_op({name!r})
            if fast is not None:
                result = fast(*inputs)
                if result is not native.MISS:
                    return result
            return python_plan_call(DECL, inputs, None)
        if {out_matches} and native.run_into({name!r}, inputs, {out_tuple}):
            return out
    return checked_call(DECL, inputs, {out}, config)
'''


def eager_function(decl: OpDecl):
    """The op as a Python function with the schema's parameters, plus keyword-only ``config``
    (force a config of the op's template) and, for ops with results, ``out`` (write into the
    caller's tensors: one tensor, or a tuple for several results)."""
    if decl.composite is not None:
        fn = decl.composite
        fn.__doc__ = fn.__doc__ or decl.doc
        return fn
    schema = _schema(decl)
    names = [a.name for a in schema.arguments]
    defaults = tuple(a.default_value for a in schema.arguments if a.has_default_value())
    has_out = len(schema.returns) > 0
    plan_when = decl.plan_when if decl.plannable else "False"
    # An op without results (in place) takes no out=: its calls always allocate nothing.
    # out= is a tensor for one result, a tuple for several: anything else takes the checked path,
    # which says what is wrong.
    one = len(schema.returns) == 1
    source = _EAGER.format(name=decl.name, params=", ".join(names), args="".join(f"{n}, " for n in names),
                           plan_when=plan_when, out_param="out=None, " if has_out else "",
                           allocating="out is None" if has_out else "True", out="out" if has_out else "None",
                           out_matches="type(out) is not tuple" if one else "type(out) is tuple",
                           out_tuple="(out,)" if one else "out")
    namespace = {"native": native, "python_plan_call": python_plan_call, "checked_call": checked_call,
                 "DECL": decl}
    exec(compile(source, f"<mslk_dsl.ops.{decl.name}>", "exec"), namespace)
    fn = namespace[decl.name]
    fn.__defaults__ = defaults or None
    fn.__doc__ = decl.doc
    fn.__module__ = "mslk_dsl.ops"
    fn.__qualname__ = decl.name
    return fn
