"""Every declared op on random calls it serves: sizes from the declaration's ``random_problem``
(log-uniform, any integer: 1-row calls, odd and prime sizes, large ones), a random signature of
its CuTe template (dtype, weight dtype, bias, accumulation, index dtype, head dim), N(0, 1) data,
contiguous or (half the calls) with padded rows or off an aligned address. Each result matches
the op's plain-torch reference; only a call in another layout may be refused, with a ValueError
or TypeError. Each run draws afresh; the seed is printed with every failure, and
MSLK_DSL_FUZZ_SEED=<seed> repeats a run (MSLK_DSL_FUZZ_DRAWS: draws per op, default 6)."""
import math
import os
import random

import pytest
import torch

from support import relaid

from mslk_dsl import registry
from mslk_dsl.errors import TemplateImportError
from mslk_dsl.testing import skipUnlessCudaCapability

pytestmark = skipUnlessCudaCapability((9, 0))

SEED = int(os.environ.get("MSLK_DSL_FUZZ_SEED") or random.SystemRandom().randrange(2**31))
DRAWS = int(os.environ.get("MSLK_DSL_FUZZ_DRAWS", "6"))


def _names():
    from mslk_dsl.ops import declarations

    return sorted(declarations())


def _fp8_step(w: torch.Tensor) -> torch.Tensor:
    """One step of the e4m3 grid at each value of ``w`` (3 mantissa bits; subnormal steps below
    2**-6)."""
    exponent = torch.floor(torch.log2(w.abs().clamp_min(2.0**-6)))
    return torch.exp2(exponent - 3)


def _mismatch(decl, got, want) -> str | None:
    """None where ``got`` matches ``want``: integers exactly; FP8 values within one step of the
    e4m3 grid (a scale computed in another order may round a value the other way); other floats
    within the op's tolerance, elementwise or, for an op of ``long_sums`` (GEMM K, attention
    keys), against the largest magnitude of the result."""
    why = decl.mismatch(got, want)
    if why is None:
        return None
    rtol, atol = decl.tolerance
    for g, w in zip(decl.defined_results(got), decl.defined_results(want)):
        if g.shape != w.shape or g.dtype != w.dtype or not g.is_floating_point():
            return why
        if g.numel() == 0:
            continue
        gf, wf = g.float(), w.float()
        error = torch.where(gf == wf, 0.0, (gf - wf).abs()).nan_to_num(math.inf)
        if g.element_size() == 1:
            if bool((error > _fp8_step(wf) * 1.001).any()):
                return why
        elif not decl.long_sums or float(error.max()) > rtol * float(wf.abs().max()) + atol:
            return f"{why} (largest error {float(error.max()):.4g}, largest |reference| {float(wf.abs().max()):.4g})"
    return None


@pytest.mark.parametrize("draw", range(DRAWS))
@pytest.mark.parametrize("name", _names())
def test_a_random_call_matches_the_reference(name, draw):
    import mslk_dsl.ops as ops
    from mslk_dsl.ops import declarations

    decl = declarations()[name]
    assert decl.random_problem is not None, f"{name} declares no random_problem"
    templates = registry.get_templates(op=name, backend="cute")
    signatures = templates[0].all_signatures() if templates else [{}]
    rng = random.Random(f"{SEED}-{name}-{draw}")
    problem, sig = decl.random_problem(rng), rng.choice(signatures)
    # Half the calls take their inputs in another layout, which the op may refuse (ValueError /
    # TypeError: strides, alignment) but must otherwise serve.
    layout, pad = rng.choice(("contiguous", "contiguous", "padded", "offset")), rng.randint(1, 8)
    torch.manual_seed(rng.randrange(2**31))
    args = decl.example(problem, sig, torch.device("cuda"))
    fresh = lambda: tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)  # noqa: E731
    call = f"MSLK_DSL_FUZZ_SEED={SEED}: {name} on {problem} {sig} ({layout} inputs, pad {pad})"
    first_args = relaid(fresh(), layout, pad)
    try:
        got = getattr(ops, name)(*first_args)
        torch.cuda.synchronize()
    except TemplateImportError as e:
        pytest.skip(f"{name}: {e}")
    except (ValueError, TypeError) as e:
        # every draw is a call the op serves: only a relaid input may be refused
        assert layout != "contiguous", f"{call}: refused: {type(e).__name__}: {e}"
        return
    except Exception as e:
        raise AssertionError(f"{call}: {type(e).__name__}: {e}") from e
    if not decl.outputs(*args):                      # in place: compare the updated input
        got = first_args[0]
    why = _mismatch(decl, got, decl.reference(*fresh()))
    assert why is None, f"{call}: {why}"
