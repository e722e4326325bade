"""Bytes at a run-time offset moved into place in registers: the data of a vector that does not
start on a 16-byte boundary, read as the aligned 16-byte loads around it.

Used where the two sides of an element-wise step sit at different offsets from a boundary in
every row, so no one vector width serves both: rmsnorm's weight under the aligned middle of a
phased row (config key ``"weight": "vectors"``), the MoE gather's source row under the aligned
middle of its out row. Plain Python (no DSL import): the kernels call it with the DSL's select
and funnel shift, a CPU test with integers.
"""


def shifted_words(words, offset, count: int, select, funnel=None) -> list:
    """The ``count`` 32-bit words that start ``offset`` bytes (0-15, a multiple of the element
    size) into ``words``: the little-endian 32-bit words of consecutive 16-byte loads, at least
    count + 4 of them. A run-time offset cannot index registers (that goes to local memory), so
    word m is built from selects and a funnel shift: words[m + offset // 4] by two selects on the
    offset's bits 2 and 3, then, where the offset is not a multiple of 4 (16-bit elements;
    ``funnel(lo, hi, bits)`` given), the pair (that word, the next) shifted right by 8 * (offset %
    4) bits. Plain Python over the given ``select(cond, a, b)`` and ``funnel``, so the same code
    builds the kernel's instructions and, on integers, checks itself in a CPU test."""
    odd, two = (offset & 4) != 0, (offset & 8) != 0
    near = [select(odd, words[k + 1], words[k]) for k in range(count + 3)]
    word = [select(two, near[m + 2], near[m]) for m in range(count + 1)]
    if funnel is None:
        return word[:count]
    bits = (offset & 3) * 8
    return [funnel(word[m], word[m + 1], bits) for m in range(count)]
