"""Random problem sizes for the fuzz tests: each declaration's ``random_problem(rng)`` draws the
sizes of one call the op serves (its ``problem`` names), from these helpers.

Sizes are log-uniform, so 1-row calls and calls of many thousands of rows come up alike, and
any integer comes up (odd sizes, primes), not only the round sizes of the benchmark grids. The
caps keep one call and its fp32 reference small enough for a test run.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable

from mslk_dsl.errors import MslkDslError


def log_int(rng: random.Random, low: int, high: int, multiple: int = 1) -> int:
    """An integer in [low, high], log-uniform, a multiple of ``multiple`` (low and high are
    rounded up and down to one)."""
    low, high = -(-low // multiple) * multiple, high // multiple * multiple
    if low >= high:
        return low
    value = math.exp(rng.uniform(math.log(max(low, 1)), math.log(high + 1)))
    return min(high, max(low, int(value) // multiple * multiple))


def within(rng: random.Random, draw: Callable[[random.Random], dict], size: Callable[[dict], int],
           limit: int) -> dict:
    """A problem from ``draw`` whose ``size`` is at most ``limit`` (elements, FLOPs: whatever
    bounds the call and its reference): drawn again until one is."""
    for _ in range(1000):
        problem = draw(rng)
        if size(problem) <= limit:
            return problem
    raise MslkDslError(f"no draw within {limit} in 1000 tries: the draw's lowest sizes exceed it")


def rows(rng: random.Random, width: str = "K", max_rows: int = 131072, max_width: int = 65536,
         limit: int = 1 << 26) -> dict:
    """M rows of ``width`` elements (row ops: elementwise, norms), at most ``limit`` elements."""
    return within(rng, lambda r: {"M": log_int(r, 1, max_rows), width: log_int(r, 1, max_width)},
                  lambda p: p["M"] * p[width], limit)
