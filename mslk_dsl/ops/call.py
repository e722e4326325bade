"""The one call path of every declared op (see declaration.py), and the eager functions over it.

A call goes through at most these steps, each skipped when an earlier one answered:
1. native plan: the layout was seen before and the native launcher has its plan (one C call:
   match, allocate, launch; on a miss that call passes the arguments on to step 2;
   mslk_dsl.native);
2. Python plan: the same, in Python, replayed by code generated per plan (ROCm's FlyDSL kernels
   are not TVM-FFI functions, and calls made before the launcher is loaded); a plan that holds a
   buffer of a stream is keyed by the current stream too, and one that writes an input in place
   first checks that the input overlaps no other one;
3. the checked path: argument checks, outputs, the op's ``prepare`` (kernel choice: explicit
   config, tuned, heuristic; see dispatch.KernelOp), launch, and the plan remembered for next time.

The eager function of an op is generated from its schema (like dataclasses generate __init__):
a plain Python function with the op's own parameters, so a call costs no argument binding and
the first step is one call of a global (``FAST``, bound by native.bind).
"""
from __future__ import annotations

import functools

import torch

from mslk_dsl import native
from mslk_dsl.errors import InputError, KernelLaunchError, MslkDslError
from mslk_dsl.ops import validate as check
from mslk_dsl.ops.declaration import Fixed, Launch, OpDecl
from mslk_dsl.ops.dispatch import is_placeholder, placeholder

# -- Python plans ---------------------------------------------------------------------------------
# Where a kernel argument comes from in a Python plan.
_INPUT, _OUTPUT, _HELD, _VIEW_OF_INPUT, _VIEW_OF_OUTPUT = range(5)


class _PythonPlan:
    """A launch to replay for calls with one input layout: what to allocate and where each kernel
    argument comes from (an input, an output, a view of one, a held placeholder or Fixed value).
    ``replay`` does it in straight-line code generated for the plan. While the native launcher is
    still loading, each call offers it the launch too (``native_pending``); once that is settled
    the plan table holds ``replay`` itself."""
    __slots__ = ("name", "kernel", "allocate", "args", "returned", "held", "constants", "native_pending",
                 "replay", "table", "key", "spans", "written", "stream_bound")

    def __init__(self, name, kernel, allocate, args, returned, held, constants, native_pending,
                 spans=(), written=(), stream_bound=False):
        self.name, self.kernel, self.allocate, self.args = name, kernel, allocate, args
        self.returned, self.held, self.native_pending = returned, held, native_pending
        self.constants, self.spans, self.written, self.stream_bound = constants, spans, written, stream_bound
        self.replay = _replay_function(name, kernel, allocate, args, returned, spans, written)
        self.table = self.key = None

    def __call__(self, inputs: tuple):
        """The replay, then the offer to the native launcher (with the tensors it needs to see)."""
        if self.written and _overlapping(inputs, self.spans, self.written):
            return OVERLAP
        made = [new() for new in self.allocate]
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
        _launch(self.name, self.kernel, args)
        added = native.remember(self.name, inputs, tuple(made), tuple(args), tuple(range(self.returned)),
                                self.kernel, held=self.held, written=self.written, constants=self.constants,
                                stream_bound=self.stream_bound)
        if added is not None:  # settled (None: the launcher may still load; ask again next time)
            self.native_pending = False
            if self.table is not None and self.table.get(self.key) is self:
                self.table[self.key] = self.replay
        if self.returned == 1:
            return made[0]
        return tuple(made[:self.returned]) if self.returned else None


def _allocator(shape: tuple, dtype: torch.dtype, device: torch.device, made: torch.Tensor):
    """A function returning a new uninitialized tensor laid out like ``made`` (compact).
    ``torch.empty_like`` of a zero-stride view of a one-element tensor is the cheapest such call
    from Python (about half of ``new_empty(shape, dtype=)``: no shape or dtype to parse); where
    it would not give ``made``'s strides (empty shapes), ``new_empty`` does."""
    like = placeholder(device, dtype).as_strided(shape, (0,) * len(shape))
    probe = torch.empty_like(like)
    if probe.shape == made.shape and probe.stride() == made.stride():
        return functools.partial(torch.empty_like, like)
    return functools.partial(like.new_empty, shape)


# What a plan of an op that writes an input in place returns, instead of launching, for a call
# whose written input overlaps another input (the checked path then says what is wrong).
OVERLAP = object()


def _spans(inputs: tuple) -> tuple:
    """Each tensor input's extent in bytes from its data pointer (None for other arguments): fixed
    by the layout a plan is keyed by, so a replay tests overlap with data pointers alone."""
    spans = []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.numel():
            start, end = check.byte_range(t)
            spans.append((t.data_ptr() - start, end - t.data_ptr()))
        else:
            spans.append(None)
    return tuple(spans)


def _overlapping(inputs: tuple, spans: tuple, written: tuple) -> bool:
    """Whether a written input's bytes meet another tensor input's (the plan's ``spans``)."""
    for w in written:
        if spans[w] is None:
            continue
        p = inputs[w].data_ptr()
        w0, w1 = p - spans[w][0], p + spans[w][1]
        for i, span in enumerate(spans):
            if i != w and span is not None:
                q = inputs[i].data_ptr()
                if q - span[0] < w1 and w0 < q + span[1]:
                    return True
    return False


def _launch(op: str, kernel, args) -> None:
    """Call a kernel; an error from the DSL runtime or the driver becomes a KernelLaunchError
    naming the op (the native launcher raises the same class)."""
    try:
        kernel(*args)
    except MslkDslError:
        raise
    except Exception as e:
        raise KernelLaunchError.of(op, e) from e


def _replay_function(name: str, kernel, allocate: list, args: list, returned: int, spans: tuple = (),
                     written: tuple = ()):
    """``replay(inputs)``: allocate, launch, return, written out for one plan (no loop, no test of
    where an argument comes from); for an op writing inputs in place, first the overlap test."""
    namespace: dict = {"KERNEL": kernel, "OVERLAP": OVERLAP, "overlapping": _overlapping, "SPANS": spans,
                       "WRITTEN": written, "MslkDslError": MslkDslError, "KernelLaunchError": KernelLaunchError,
                       "NAME": name}
    lines = ["def replay(inputs):"]
    if written:
        lines.append("    if overlapping(inputs, SPANS, WRITTEN):")
        lines.append("        return OVERLAP")
    for k, new in enumerate(allocate):
        namespace[f"NEW{k}"] = new
        lines.append(f"    o{k} = NEW{k}()")
    call = []
    for a, (kind, value, view) in enumerate(args):
        if kind == _INPUT:
            call.append(f"inputs[{value}]")
        elif kind == _OUTPUT:
            call.append(f"o{value}")
        elif kind == _HELD:
            namespace[f"HELD{a}"] = value
            call.append(f"HELD{a}")
        else:
            source = f"inputs[{value}]" if kind == _VIEW_OF_INPUT else f"o{value}"
            namespace[f"SHAPE{a}"], namespace[f"STRIDES{a}"] = view
            call.append(f"{source}.as_strided(SHAPE{a}, STRIDES{a}, {source}.storage_offset())")
    lines.append("    try:")
    lines.append(f"        KERNEL({', '.join(call)})")
    lines.append("    except MslkDslError:")
    lines.append("        raise")
    lines.append("    except Exception as e:")
    lines.append("        raise KernelLaunchError.of(NAME, e) from e")
    returns = ", ".join(f"o{k}" for k in range(returned))
    lines.append("    return " + (f"({returns})" if returned > 1 else returns or "None"))
    exec(compile("\n".join(lines) + "\n", f"<mslk_dsl.ops.{name} plan>", "exec"), namespace)
    return namespace["replay"]


def _layout(inputs: tuple):
    """What a Python plan is keyed by: each tensor's shape, strides, dtype, device and address
    modulo 16 (which access widths its rows admit); each other argument's type (values are the
    call's own)."""
    return tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)
                 if isinstance(t, torch.Tensor) else type(t) for t in inputs)


_value_positions: dict[str, tuple[int, ...]] = {}  # op -> where its plan_values are in its arguments
# Ops that made a stream-bound launch (declaration.Launch.stream_bound): their Python plans are
# keyed by the current stream too, as a native plan of such a launch serves its stream only.
_stream_keyed: set[str] = set()


def current_stream(inputs: tuple) -> int:
    """The handle of the current stream on the device of the first tensor input (0 off the GPU)."""
    for t in inputs:
        if isinstance(t, torch.Tensor):
            return torch._C._cuda_getCurrentRawStream(t.get_device()) if t.is_cuda else 0
    return 0


def _plan_key(name: str, inputs: tuple):
    """The layout, for an op with ``plan_values`` those arguments' values, and for an op with
    stream-bound launches the current stream."""
    positions = _value_positions.get(name)
    key = (_layout(inputs), *(inputs[i] for i in positions)) if positions else _layout(inputs)
    if name in _stream_keyed:
        return key, current_stream(inputs)
    return key


class _PlanTable(dict):
    """Layout -> what replays it: a plan's ``replay`` function, or the plan itself while it still
    offers its launch to the loading native launcher."""
    MAX = 1024  # plans per op; cleared when full (serving sees many shapes)

    def add(self, key, plan: _PythonPlan) -> None:
        if len(self) >= self.MAX:
            self.clear()
        if plan.native_pending:
            plan.table, plan.key = self, key
            self[key] = plan
        else:
            self[key] = plan.replay


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


def _python_plan(name: str, inputs: tuple, outputs: tuple, launch: Launch, held: tuple, constants: tuple,
                 native_pending: bool, written: tuple = ()) -> _PythonPlan | None:
    """The plan replaying ``launch`` for calls laid out like ``inputs``, or None where an argument
    is not an input, output, view of one or placeholder (a copied input)."""
    made = (*outputs, *launch.scratch)
    args = []
    for a in launch.args:
        if isinstance(a, torch.Tensor):
            source = _source(a, inputs, made)
        elif type(a) is Fixed:  # the same for every call the plan serves (see declaration.Fixed)
            source = (_HELD, a.value, None)
        else:  # a scalar: the call's own value
            source = next(((_INPUT, i, None) for i, x in enumerate(inputs) if x is a), None)
        if source is None:
            return None
        args.append(source)
    allocate = [_allocator(tuple(t.shape), t.dtype, t.device, t) for t in made]
    return _PythonPlan(name, launch.kernel, allocate, args, len(outputs), held, constants, native_pending,
                       _spans(inputs) if written else (), written, launch.stream_bound)


# -- the checked path -------------------------------------------------------------------------------
_plans: dict[str, _PlanTable] = {}
# op -> plan_allowed(*args): the op's plan_when (no plan is made for a call it does not admit,
# since none may serve it)
_plan_allowed: dict = {}


def checked_call(decl: OpDecl, inputs: tuple, out, config: dict | None):
    """Steps 3: validate, choose, launch, remember (see the module docstring)."""
    name = decl.name
    decl.check(*inputs)
    tensors = {n: t for n, t in zip(_arg_names(decl), inputs) if isinstance(t, torch.Tensor)}
    device = next(iter(tensors.values())).device
    _check_written(decl, inputs, tensors)
    check.gpu(name, next(iter(tensors)), next(iter(tensors.values())))
    specs = decl.outputs(*inputs)
    outputs = check.outputs(name, out, specs, device, tensors) if specs else ()

    def select(signature: tuple, problem: tuple):
        return decl.kernels.selection(device, signature, problem, config)

    launch = decl.prepare(select, outputs, *inputs)
    if launch is not None:
        _launch(name, launch.kernel, [a.value if type(a) is Fixed else a for a in launch.args])
        if launch.finish is not None:
            launch.finish()
        elif config is None and decl.plannable and launch.plannable and _plan_allowed[name](*inputs):
            _remember(decl, inputs, outputs, out, launch)
    if not specs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _check_written(decl: OpDecl, inputs: tuple, tensors: dict) -> None:
    """An input the op writes in place must not share memory with another input: the kernel
    would read what it is writing."""
    names = _arg_names(decl)
    for w in _written_positions(decl):
        written = inputs[w]
        for other, t in tensors.items():
            if other != names[w] and t.numel() and written.numel() and check.overlap(written, t):
                raise InputError(f"{decl.name}: {names[w]} is updated in place and shares memory with {other}")


def _remember(decl: OpDecl, inputs: tuple, outputs: tuple, out, launch: Launch) -> None:
    """Keep a plan for the layout of ``inputs``: native where the launcher takes it, else Python.
    Inputs that share memory (silu_mul(x, x)) get neither: which kernel argument is which input
    would be ambiguous for later calls of the same layout with distinct tensors. A launch bound
    to the current stream is kept for that stream, and a plan of an op that writes an input in
    place checks on every call that the input overlaps no other one (natively or in Python)."""
    pointers = [t.data_ptr() for t in inputs if isinstance(t, torch.Tensor)]
    if len(set(pointers)) != len(pointers):
        return
    held = tuple(a for a in launch.args if isinstance(a, torch.Tensor) and is_placeholder(a))
    args = tuple(a.value if type(a) is Fixed else a for a in launch.args)
    constants = tuple(i for i, a in enumerate(launch.args) if type(a) is Fixed)
    written = _written_positions(decl)
    if out is not None:
        native.remember_into(decl.name, inputs, outputs, args, launch.kernel, held=held,
                             scratch=launch.scratch, constants=constants, stream_bound=launch.stream_bound)
        return
    added = native.remember(decl.name, inputs, (*outputs, *launch.scratch), args, tuple(range(len(outputs))),
                            launch.kernel, held=held, written=written, constants=constants,
                            stream_bound=launch.stream_bound)
    if not added:
        # No native plan (None: not yet, the launcher is loading): keep a Python one.
        plan = _python_plan(decl.name, inputs, outputs, launch, held, constants, native_pending=added is None,
                            written=written)
        if plan is not None:
            if launch.stream_bound and decl.name not in _stream_keyed:
                _stream_keyed.add(decl.name)
                _plans.pop(decl.name, None)  # plans keyed without the stream would no longer be found
            _plans.setdefault(decl.name, _PlanTable()).add(_plan_key(decl.name, inputs), plan)


_written: dict[str, tuple[int, ...]] = {}


def _written_positions(decl: OpDecl) -> tuple[int, ...]:
    """The arguments the op writes in place (``Tensor(a!)`` in its schema)."""
    found = _written.get(decl.name)
    if found is None:
        found = _written[decl.name] = tuple(i for i, a in enumerate(_schema(decl).arguments)
                                            if a.alias_info is not None and a.alias_info.is_write)
    return found


def python_plan_call(decl: OpDecl, inputs: tuple, config):
    """Step 2 (then 3): a Python plan for this layout, else the checked path."""
    plans = _plans.get(decl.name)
    if plans:
        try:
            plan = plans.get(_plan_key(decl.name, inputs))
        except (AttributeError, RuntimeError, TypeError):  # not tensors or unhashable values (the checks
            # say so), or no storage
            plan = None
        if plan is not None:
            result = plan(inputs)
            if result is not OVERLAP:
                return result
    return checked_call(decl, inputs, None, config)


def clear_python_plans() -> None:
    _plans.clear()
    _stream_keyed.clear()


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
    if config is None and ({plan_when}):
        if {allocating}:
            return FAST({args})
        if {out_matches} and FAST_OUT({args}, {out_args}) is None:
            return out
    return checked_call(DECL, ({args}, ), {out}, config)


def python_step({params}):
    return python_plan_call(DECL, ({args}, ), None)


def plan_allowed({params}):
    return {plan_when}
'''
# FAST and FAST_OUT are bound by native.bind: FAST serves the call from a native plan or passes it
# on to python_step (step 2, then 3); FAST_OUT runs the out= plan (None when it did).


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
    source = _EAGER.format(name=decl.name, params=", ".join(names), args=", ".join(names),
                           plan_when=plan_when, out_param="out=None, " if has_out else "",
                           allocating="out is None" if has_out else "True", out="out" if has_out else "None",
                           out_matches="type(out) is not tuple" if one else "type(out) is tuple",
                           out_args="out" if one else "*out")
    namespace = {"python_plan_call": python_plan_call, "checked_call": checked_call, "DECL": decl}
    exec(compile(source, f"<mslk_dsl.ops.{decl.name}>", "exec"), namespace)
    _plan_allowed[decl.name] = namespace["plan_allowed"]
    if decl.plan_values:
        names_at = {n: i for i, n in enumerate(names)}
        unknown = [n for n in decl.plan_values if n not in names_at]
        if unknown:
            raise MslkDslError(f"op {decl.name}: plan_values names {unknown}, which are not arguments")
        _value_positions[decl.name] = tuple(names_at[n] for n in decl.plan_values)
        native.key_by_values(decl.name, _value_positions[decl.name])
    native.bind(decl.name, namespace, namespace["python_step"])
    fn = namespace[decl.name]
    fn.__defaults__ = defaults or None
    fn.__doc__ = decl.doc
    fn.__module__ = "mslk_dsl.ops"
    fn.__qualname__ = decl.name
    return fn
