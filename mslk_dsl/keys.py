"""KernelKey: everything that decides the bytes of a compiled kernel, and nothing else.

Its digest names the cache entry. Dynamic sizes (tokens, batch, K) are never part of it. A key
covers: the op, template and its source (see ``template_digest``), the config, the target and
every field of its arch/*.toml descriptor, the static signature, the options the backend passes
to the DSL compiler, the framework version, the versions of the DSL packages, and the values of
the DSL environment variables that change generated code (see ``codegen_env_names``).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import asdict, dataclass, field
from importlib import metadata

import mslk_dsl
from mslk_dsl import env
from mslk_dsl.targets import get_target
from mslk_dsl.template import Template, config_name

# The packages whose versions change what a backend generates. For CuTe these are the DSL's
# library wheels, which both the compiling install ([cute]: nvidia-cutlass-dsl pins them) and the
# serving install ([serve-cute]: nvidia-cutlass-dsl-libs-cu12 pulls them in) hold at the same
# version. nvidia-cutlass-dsl itself is a metapackage that only pins them, and a serving install
# does not have it, so it is not part of the key.
DSL_PACKAGES = {
    "cute": ("nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core", "apache-tvm-ffi"),
    "flydsl": ("flydsl",),
}

# The options each backend gives the DSL compiler beyond the target's arch (backends/cute.py's
# cute.compile options, backends/flydsl.py's compile-child environment), which take them from here.
# A key covers exactly what the compilers were given.
COMPILE_OPTIONS = {
    "cute": ("--enable-tvm-ffi",),
    "flydsl": ("COMPILE_ONLY=1", "FLYDSL_RUNTIME_ENABLE_CACHE=1"),
}


@functools.cache
def dsl_versions(backend: str) -> dict[str, str]:
    """Installed versions of the backend's DSL packages ("" where not installed)."""
    out = {}
    for pkg in DSL_PACKAGES[backend]:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = ""
    return out


@dataclass(frozen=True)
class KernelKey:
    op: str
    backend: str
    template: str
    template_digest: str
    config: dict = field(hash=False)
    target: str = ""
    signature: dict = field(default_factory=dict, hash=False)
    framework_version: str = ""
    dsl_versions: dict = field(default_factory=dict, hash=False)
    codegen_env: dict = field(default_factory=dict, hash=False)
    target_spec: dict = field(default_factory=dict, hash=False)
    compile_options: list = field(default_factory=list, hash=False)

    @classmethod
    def make(cls, template: Template, config: dict, target: str, signature: dict) -> KernelKey:
        spec = get_target(target)
        return cls(
            op=template.op,
            backend=template.backend,
            template=template.name,
            template_digest=template_digest(template.source),
            config=dict(sorted(config.items())),
            target=target,
            signature=dict(sorted(signature.items())),
            framework_version=mslk_dsl.__version__,
            dsl_versions=dsl_versions(template.backend),
            codegen_env=env.values_of(codegen_env_names(template.backend, spec.dsl_arch)),
            target_spec=_target_spec(target),
            compile_options=list(COMPILE_OPTIONS.get(template.backend, ())),
        )

    @classmethod
    def from_parts(cls, parts: dict) -> KernelKey:
        return cls(**{k: parts[k] for k in cls.__dataclass_fields__})

    def parts(self) -> dict:
        return asdict(self)

    @functools.cached_property
    def digest(self) -> str:
        return hashlib.sha256(_canonical(self.parts()).encode()).hexdigest()[:32]

    @property
    def config_name(self) -> str:
        return config_name(self.config)

    def describe(self) -> str:
        return (f"op={self.op} target={self.target} template={self.template} "
                f"config={self.config_name} signature={_canonical(self.signature)}")

    def __hash__(self):
        return hash(self.digest)

    def __eq__(self, other):
        return isinstance(other, KernelKey) and self.digest == other.digest


@functools.cache
def _target_spec(name: str) -> dict:
    # Templates read these fields (shared memory size, FP8 flavour, warp size) while building.
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(get_target(name)).items()}


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def diff_parts(a: dict, b: dict) -> dict[str, tuple]:
    """Which parts of two keys differ: {part: (a's value, b's value)}."""
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def package_set_difference(wanted: dict, found: dict) -> str:
    """For two keys' ``dsl_versions``: a sentence naming the packages that differ, or "" when
    they agree. A kernel built with other DSL package versions is never served, so a miss with
    this difference is fixed by installing the versions the bundle was built with (or rebuilding
    the bundle with this install), not by compiling."""
    wanted, found = wanted or {}, found or {}
    differing = [f"{pkg} {found.get(pkg) or 'absent'} in the bundle, {wanted.get(pkg) or 'not installed'} here"
                 for pkg in sorted(set(wanted) | set(found)) if wanted.get(pkg) != found.get(pkg)]
    if not differing:
        return ""
    return ("the installed DSL packages differ from the ones the entry was built with ("
            + "; ".join(differing) + "): install those versions (pip install 'mslk-dsl[serve-cute]' "
            "serves CuTe bundles) or rebuild the bundle with this install")


# -- DSL environment variables that change generated code -----------------------------------------
# Both DSLs say which of their variables change what they generate: CuTe DSL declares each
# setting with ``affects_compile=True/False`` (cutlass/base_dsl/env_manager.py), FlyDSL keeps the
# list that invalidates its own cache (flydsl/compiler/jit_function.py). The key reads those
# lists from the installed package's source (without importing the DSL, which a serving process
# must not pay for), so a DSL upgrade that adds a variable extends the key by itself. The
# fallbacks below, used where the source cannot be read, are the lists of the pinned versions
# (tests/test_keys.py checks they still agree).
CUTE_PREFIX = "CUTE_DSL_"
CUTE_CODEGEN_ENV_FALLBACK = (
    "CUTE_DSL_ARCH", "CUTE_DSL_AUTO_M2S", "CUTE_DSL_COMPILER_BACKEND", "CUTE_DSL_COMPILER_OPT",
    "CUTE_DSL_DEBUG", "CUTE_DSL_DRYRUN", "CUTE_DSL_ENABLE_ASSERTIONS", "CUTE_DSL_ENABLE_PYIR",
    "CUTE_DSL_ENABLE_TVM_FFI", "CUTE_DSL_LINEINFO", "CUTE_DSL_LOC_TRACEBACKS", "CUTE_DSL_TOLERATE_M2M",
    "CUTE_DSL_USE_EXTENSION_COMPILER", "CUTE_DSL_WARNINGS_AS_ERRORS",
)
FLYDSL_CODEGEN_ENV_FALLBACK = (
    "FLYDSL_COMPILE_OPT_LEVEL", "FLYDSL_COMPILE_BACKEND", "FLYDSL_COMPILE_LLVM_DIR",
    "FLYDSL_DEBUG_ENABLE_DEBUG_INFO", "FLYDSL_EXTRA_SOURCE_DIRS", "FLYDSL_KTRACE_ENABLE",
    "FLYDSL_KTRACE_BLOCKS", "FLYDSL_KTRACE_BUFFER_BYTES",
)
FLYDSL_TARGET_CODEGEN_ENV_FALLBACK = {"gfx1250": ("LLVM_GFX1250_ANY_XNACK_CODEGEN",)}

# Variables the key takes although the DSL's own list leaves them out.
EXTRA_CODEGEN_ENV = {
    # CuTe's shared_libs setting (affects_compile=True) is computed from CUTE_DSL_LIBS.
    "cute": ("CUTE_DSL_LIBS",),
    # Source locations recorded in the code object's debug info.
    "flydsl": ("FLYDSL_DEBUG_MAX_LOC_DEPTH",),
}

# DSL variables deliberately left out of the key, with why (fnmatch patterns). A variable the
# DSLs read that is neither in the key nor here fails tests/test_keys.py.
EXCLUDED_ENV = {
    "CUTE_DSL_CACHE_DIR": "where the DSL's own cache lives, not what it generates",
    "CUTE_DSL_DISABLE_FILE_CACHING": "whether the DSL caches, not what it generates",
    "CUTE_DSL_NO_CACHE": "whether the DSL caches, not what it generates",
    "CUTE_DSL_JIT_CACHE_MAX_ELEMS": "size of the DSL's in-memory cache",
    "CUTE_DSL_JIT_TIME_PROFILING": "timing printout",
    "CUTE_DSL_DUMP_DIR": "where dumps are written",
    "CUTE_DSL_KEEP*": "which intermediate files are kept (the backend asks for PTX and cubin itself)",
    "CUTE_DSL_LOG_*": "logging",
    "CUTE_DSL_PRINT_*": "printing IR",
    "CUTE_DSL_SHOW_STACKTRACE": "error display",
    "CUTE_DSL_FILTER_STACKTRACE": "error display",
    "CUTE_DSL_WARNINGS_IGNORE": "warning display",
    "CUTE_DSL_ENABLE_OPTIMIZATION_WARNINGS": "warning display",
    "CUTE_DSL_VERIFY_TRACE": "tracing of the IR verifier",
    "CUTE_DSL_DEBUG_LEAVES": "debug printout of pytree leaves",
    "CUTE_DSL_LOG_AUTOTUNE": "logging of the DSL's test autotuner",
    "COMPILE_ONLY": "FlyDSL's compile-only switch, set by the compile child (keys.COMPILE_OPTIONS)",
    "ARCH": "set by the compile child from the target (target_spec.dsl_arch)",
    "FLYDSL_GPU_ARCH": "device detection only; the compile child sets ARCH from the target",
    "HSA_OVERRIDE_GFX_VERSION": "device detection only; the compile child sets ARCH from the target",
    "FLYDSL_ROCM_AGENT_TIMEOUT": "a run-time timeout",
    "FLYDSL_RUNTIME_*": "FlyDSL's own cache and run mode, set by the backend",
    "FLYDSL_DUMP_*": "where and whether IR is dumped",
    "FLYDSL_DEBUG_DUMP_ASM": "dumps the ISA; set by the backend for MSLK_DSL_KEEP_ISA",
    "FLYDSL_DEBUG_AST_DIFF": "printing",
    "FLYDSL_DEBUG_LOG_*": "logging",
    "FLYDSL_DEBUG_PRINT_*": "printing IR",
    "FLYDSL_DEBUG_ENABLE_VERIFIER": "checks the IR, does not change it",
    "FLYDSL_DEBUG_SHOW_STACKTRACE": "error display",
    "FLYDSL_KTRACE_DUMP_DIR": "where traces are written at run time",
    "FLYDSL_AUTOTUNE*": "FlyDSL's own autotuner, which mslk-dsl does not use",
}

_CUTE_SETTING = re.compile(r'env_var\(\s*"([A-Z0-9_]+)"\s*,\s*affects_compile\s*=\s*(True|False)')
_FLYDSL_LIST = re.compile(r"^_CACHE_INVALIDATING_ENV_VARS\s*=\s*(\([^)]*\))", re.M)
_FLYDSL_TARGET_LIST = re.compile(r"^_TARGET_CACHE_INVALIDATING_ENV_VARS\s*=\s*(\{[^}]*\})", re.M)


@functools.cache
def codegen_env_names(backend: str, dsl_arch: str = "") -> tuple[str, ...]:
    """The environment variables whose values go into the keys of ``backend`` for a target of
    DSL arch ``dsl_arch``: the DSL's own list plus EXTRA_CODEGEN_ENV."""
    if backend == "cute":
        names = cute_declared_env().get(True) or CUTE_CODEGEN_ENV_FALLBACK
    elif backend == "flydsl":
        general, by_arch = flydsl_declared_env() or (FLYDSL_CODEGEN_ENV_FALLBACK, FLYDSL_TARGET_CODEGEN_ENV_FALLBACK)
        names = (*general, *by_arch.get(dsl_arch, ()))
    else:
        names = ()
    return tuple(sorted({*names, *EXTRA_CODEGEN_ENV.get(backend, ())}))


@functools.cache
def cute_declared_env() -> dict[bool, tuple[str, ...]]:
    """CuTe DSL's settings by ``affects_compile`` ({True: names, False: names}), read from the
    installed source; {} where it is not installed."""
    found: dict[bool, set[str]] = {True: set(), False: set()}
    for relative in ("base_dsl/env_manager.py", "cutlass_dsl/cutlass.py"):
        text = _package_source("cutlass", relative)
        for name, affects in _CUTE_SETTING.findall(text or ""):
            found[affects == "True"].add(CUTE_PREFIX + name)
    return {k: tuple(sorted(v)) for k, v in found.items()} if found[True] else {}


@functools.cache
def flydsl_declared_env() -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]] | None:
    """FlyDSL's cache-invalidating variables (general, per arch), read from the installed
    source; None where it is not installed or the lists are not found."""
    import ast

    text = _package_source("flydsl", "compiler/jit_function.py")
    general = _FLYDSL_LIST.search(text or "")
    by_arch = _FLYDSL_TARGET_LIST.search(text or "")
    if general is None:
        return None
    try:
        return (tuple(ast.literal_eval(general[1])),
                {k: tuple(v) for k, v in ast.literal_eval(by_arch[1]).items()} if by_arch else {})
    except (ValueError, SyntaxError):
        return None


def _package_source(package: str, relative: str) -> str | None:
    for root in _package_roots(package):
        try:
            with open(os.path.join(root, relative), encoding="utf-8") as f:
                return f.read()
        except OSError:
            continue
    return None


def _package_roots(package: str) -> list[str]:
    roots = []
    for name, below in ((package, ""), *_PACKAGE_HOMES.get(package, ())):
        try:
            spec = importlib.util.find_spec(name)  # finds, does not import, a top-level package
        except (ImportError, ValueError):
            continue
        roots += [os.path.join(root, below) for root in (spec.submodule_search_locations or [])] if spec else []
    return roots


# Where a package lives when it is not importable by its own name: a CuTe serving install has the
# DSL's files (nvidia-cutlass-dsl-libs-core) but not the .pth of the nvidia-cutlass-dsl
# metapackage that puts ``cutlass`` on sys.path.
_PACKAGE_HOMES = {"cutlass": (("nvidia_cutlass_dsl", "dsl_packages/cutlass"),)}


# -- template digests -----------------------------------------------------------------------------
@functools.cache
def template_digest(source: str) -> str:
    """sha256 over the template file and the project template modules it imports, transitively:
    the private sibling modules of its folder (``from . import _x``, ``from mslk_dsl.templates
    import _x`` in the package's own folder), and for a template outside the package (on
    MSLK_DSL_TEMPLATE_PATH) every module of the package's templates it imports, so editing
    shared device code invalidates every user of it."""
    home = os.path.dirname(source)
    package = _package_templates_dir()
    seen: dict[str, bytes] = {}
    pending = [source]
    while pending:
        path = pending.pop()
        if path in seen or not os.path.exists(path):
            continue
        with open(path, "rb") as f:
            seen[path] = f.read()
        relative, absolute = _template_imports(seen[path])
        folder = os.path.dirname(path)
        pending.extend(os.path.join(folder, f"{m}.py") for m in relative)
        if package:
            pending.extend(os.path.join(package, f"{m}.py") for m in absolute
                           if m.startswith("_") or folder != package)
        if folder != package:
            # Also a same-named private file of the template's own folder: a superset of what is
            # imported is harmless (one more file in the digest), a subset would serve stale code.
            pending.extend(os.path.join(folder, f"{m}.py") for m in absolute if m.startswith("_"))
    h = hashlib.sha256()
    for path in sorted(seen):
        # Files of the template's own folder by name (as always); package files it reaches from
        # another folder by a name no user file can have.
        label = os.path.basename(path) if os.path.dirname(path) == home else f"mslk_dsl.templates/{os.path.basename(path)}"
        h.update(label.encode() + b"\0" + seen[path] + b"\0")
    return h.hexdigest()


@functools.cache
def _package_templates_dir() -> str:
    spec = importlib.util.find_spec("mslk_dsl.templates")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return os.path.abspath(locations[0]) if locations else ""


def _local_imports(source: bytes) -> set[str]:
    """Names of private template modules (``_x``) a file imports, from its own folder or from
    the package's templates (see ``_template_imports``)."""
    relative, absolute = _template_imports(source)
    return {n for n in relative | absolute if n.startswith("_")}


def _template_imports(source: bytes) -> tuple[set[str], set[str]]:
    """(private modules imported from the file's own folder: ``from . import _x``, ``from ._x
    import``; modules imported from the package's templates: ``from mslk_dsl.templates import x``,
    ``import mslk_dsl.templates.x``).

    Read from the text, not with ``ast``: this runs on the first call of every op, and parsing
    the larger templates cost tens of milliseconds. Text that merely looks like such an import
    (a line of a docstring) counts too: that can only add a file to the digest, never leave an
    imported one out. tests/test_cache.py checks that the result equals the syntax tree's
    reading for every template file.
    """
    relative: set[str] = set()
    absolute: set[str] = set()
    for level, module, imported in _import_statements(source.decode("utf-8", errors="replace")):
        if module is None:  # import a.b, c
            absolute.update(n.split(".")[2] for n in imported if n.startswith("mslk_dsl.templates."))
        elif level and not module:
            relative.update(imported)
        elif level:
            relative.add(module.split(".")[0])
        elif module == "mslk_dsl.templates":
            absolute.update(imported)
        elif module.startswith("mslk_dsl.templates."):
            absolute.add(module.split(".")[2])
    return {n for n in relative if n.startswith("_")}, absolute


# Statements are found from their ``import`` keyword: a pattern that starts with a literal is
# scanned for at memchr speed, ten times faster than one that tries every line start.
_IMPORT_KEYWORD = re.compile(r"import\b")
_FROM_HEAD = re.compile(r"[ \t]*from\b[ \t]*(\.*)[ \t]*([\w.]*)[ \t]*")
# The name list: to the end of the line (backslash continuations included), or in parentheses.
_NAME_LIST = re.compile(r"[ \t]*(\([^)]*\)|(?:[^\n;#\\]|\\\n)*)")


def _import_statements(text: str):
    """(level, module, names) of each ``from <dots><module> import <names>`` statement, and
    (0, None, names) of each ``import <names>``, in the order they appear."""
    for keyword in _IMPORT_KEYWORD.finditer(text):
        at = keyword.start()
        if at and (text[at - 1].isalnum() or text[at - 1] == "_"):
            continue  # the end of a longer word
        head = text[_statement_start(text, at):at].replace("\\\n", " ")
        match = _NAME_LIST.match(text, keyword.end())
        names = _imported_names(match.group(1) if match else "")
        if not head.strip(" \t"):
            yield 0, None, names
        elif (from_head := _FROM_HEAD.fullmatch(head)) is not None:
            yield len(from_head[1]), from_head[2], names


def _statement_start(text: str, at: int) -> int:
    """Where the statement around ``at`` starts: its line (joined to the lines before it that end
    in a backslash), after the last ";" or ":" on it before ``at``."""
    line = text.rfind("\n", 0, at) + 1
    while line >= 2 and text[line - 2] == "\\":
        line = text.rfind("\n", 0, line - 2) + 1
    return max(line, text.rfind(";", line, at) + 1, text.rfind(":", line, at) + 1)


def _imported_names(name_list: str) -> list[str]:
    """The imported names of an import's name list: 'a as b, c' -> ['a', 'c'] (also in
    parentheses over several lines, with comments, or with backslash continuations)."""
    name_list = re.sub(r"#[^\n]*", "", name_list).replace("\\\n", " ").strip("() \t\n")
    return [item.split()[0] for item in name_list.split(",") if item.strip()]
