"""What a compile error says to a kernel author: the error, and where in the template it is.

A DSL's compile error comes with a traceback that is mostly the DSL's own frames (tracing,
preprocessing, MLIR passes); what the author needs is the error's last line and the template
lines that led to it. ``describe_compile_error`` keeps exactly those: the frames, innermost last,
whose file is a template (the package's templates/ or a MSLK_DSL_TEMPLATE_PATH folder), from
the exception and every exception it was raised from, and from a traceback carried as text (a
FlyDSL compile runs in a child process and reports its traceback in the message).
"""
from __future__ import annotations

import os
import re
import traceback

from mslk_dsl import env

# Most frames shown: the innermost ones, where the error is.
MAX_FRAMES = 6
MAX_LINE = 400

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the DSLs colour their messages for a terminal
_TEXT_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ([^\n]+)\n(?:[ \t]+([^\n]*)\n)?')


def describe_compile_error(exc: BaseException) -> str:
    """One line for the error, then one line per template frame: ``  at path:line in function:
    source``. Without template frames (the compiler failed outside any template code), the
    error's line alone."""
    frames = _template_frames(exc)
    lines = [_error_line(exc)]
    lines += [f"  at {path}:{line} in {function}" + (f": {code}" if code else "")
              for path, line, function, code in frames[-MAX_FRAMES:]]
    return "\n".join(lines)


def _error_line(exc: BaseException) -> str:
    """The error as one line (at most MAX_LINE characters); a child's traceback embedded in the
    message is reduced to its last line, the child's exception."""
    text = _ANSI.sub("", f"{type(exc).__name__}: {exc}")
    head, marker, rest = text.partition("Traceback (most recent call last):")
    if marker:
        last = [line for line in rest.splitlines() if line.strip()][-1:]
        text = head + " " + " ".join(last)
    text = " ".join(text.split())
    return text if len(text) <= MAX_LINE else text[:MAX_LINE - 3] + "..."


def _template_frames(exc: BaseException) -> list[tuple[str, int, str, str]]:
    """(path, line, function, source line) of every template frame, outermost first, over the
    chain of exceptions (causes first, as Python prints them)."""
    roots = _template_roots()
    chain: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    frames: list[tuple[str, int, str, str]] = []
    for error in reversed(chain):
        for frame in traceback.extract_tb(error.__traceback__):
            if _is_template(frame.filename, roots):
                frames.append((frame.filename, frame.lineno or 0, frame.name, (frame.line or "").strip()))
        for path, line, function, code in _TEXT_FRAME.findall(str(error)):
            if _is_template(path, roots):
                frames.append((path, int(line), function.strip(), (code or "").strip()))
    return list(dict.fromkeys(frames))


def _template_roots() -> list[str]:
    import mslk_dsl.templates as builtin

    return [os.path.abspath(p) for p in (*builtin.__path__, *env.template_paths())]


def _is_template(path: str, roots: list[str]) -> bool:
    path = os.path.abspath(path)
    return any(os.path.dirname(path) == root for root in roots)
