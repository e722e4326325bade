"""What the FlyDSL kernel classes share: one class per config (see below) and LDS int arrays.

A FlyDSL template's kernels are a class, as in the CuTe templates: the config in ``__init__``,
the host launcher in ``__call__``, one kernel per method, helpers as methods. FlyDSL accepts
``@flyc.kernel`` / ``@flyc.jit`` on methods (a first parameter named ``self`` is bound at the
call), but the decorated object then belongs to the class, and FlyDSL keys its compile caches
on the class, not on the instance: the in-memory cache on (type(self), arguments), the disk
cache on the methods' sources and type(self), the cache directory fixed at the first call per
class. Values kept on ``self`` are in none of them (FlyDSL's own kernel factories put them in
closures, whose scalar values it does hash). Decorated in the class body, two configs of one
class would share one compiled kernel, a compile process building several configs would write
no artifact for the second, and calls alternating between two configs would re-derive the cache
directory on every call.

So kernel classes mark their methods with ``kernel(options)`` and ``jit`` below, which do not
decorate, and ``specialize(cls, ...)`` returns an instance of a subclass named after the
instance's ``name`` (which spells out the config) whose marked methods are decorated afresh.
Each config thus has its own FlyDSL objects and caches, and its compiled kernel is found under
the same key by the process that compiles it and by the one that loads it.

Kernel methods read config values as ``self.x`` where they use them, not through local aliases
(``LANES = self.lanes``): FlyDSL's rewriter passes a kernel's local names into its dynamic loops
as IR values, so an alias turns into an Int32 inside a ``for`` over a dynamic range.

Imported only from a template's ``build()`` (it imports ``flydsl`` at module level).
"""
import types

import flydsl.compiler as flyc
import flydsl.expr as fx

_MARK = "_flydsl_method"


def kernel(options):
    """Mark a method as a ``@flyc.kernel``; ``options(self)`` gives its keyword arguments (name,
    known_block_size), so they can depend on the config."""
    def mark(method):
        setattr(method, _MARK, ("kernel", options))
        return method
    return mark


def jit(method):
    """Mark a method (the host launcher, ``__call__``) as a ``@flyc.jit``."""
    setattr(method, _MARK, ("jit", None))
    return method


def specialize(cls, *args, **kwargs):
    """``cls(*args, **kwargs)``, as an instance of a subclass of its own (see the module
    docstring) whose marked methods are FlyDSL kernels and launchers."""
    sub = type(cls.__name__, (cls,), {"__module__": cls.__module__})
    obj = sub(*args, **kwargs)
    sub.__name__ = sub.__qualname__ = f"{cls.__name__}_{obj.name}"
    for klass in reversed(cls.__mro__):
        for attr, method in vars(klass).items():
            marked = getattr(method, _MARK, None)
            if marked is None:
                continue
            kind, options = marked
            # A copy per config: FlyDSL rewrites the function it decorates in place.
            fresh = types.FunctionType(method.__code__, method.__globals__, method.__name__,
                                       method.__defaults__, method.__closure__)
            fresh.__kwdefaults__, fresh.__qualname__ = method.__kwdefaults__, method.__qualname__
            fresh.__module__ = method.__module__
            setattr(sub, attr, flyc.kernel(**options(obj))(fresh) if kind == "kernel" else flyc.jit(fresh))
    return obj


def lds_ints(*sizes):
    """int32 arrays in LDS (one allocator per kernel), as pointers."""
    fields = {f"a{i}": fx.Array[fx.Int32, n, 16] for i, n in enumerate(sizes)}
    storage = fx.struct(type("LdsInts", (), {"__annotations__": fields}))
    lds = fx.SharedAllocator().allocate(storage).peek()
    return [getattr(lds, f"a{i}").ptr for i in range(len(sizes))]
